//! The checks of the core every device has: capability groups as declared, the config space,
//! region bounds, reset, the client leaving, a new client.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use switchyard_device::blackbox::BlackBox;
use switchyard_device::config::{cap_id, exp, regs};
use switchyard_device::{CONFIG_REGION_INDEX, DmaProt, IrqIndex, NUM_PCI_REGIONS};

use crate::probe::{Sensor, Slot, chain};
use crate::{Moves, Subject};

/// Each optional group is offered exactly as declared, and answers a first call where it is
/// (migration caps, a park of the quiesce handle, the held objects, work counters that do
/// not go backwards). For a kind: its options are canonical (checking the checked options
/// gives them back, with the same profile), the profile's `movable` says whether the device
/// relocates, its `msix` is set when the device has MSI-X vectors (it may be set without: a
/// kind may not see the device when it checks options), and the black-box records it asks
/// for can be laid out.
pub fn capabilities(subject: &Subject) {
    let mut s = subject.slot("capabilities");
    let d = subject.declared();
    let offered = [
        ("migration", d.migration, s.device.migration().is_some()),
        ("swap", d.swap, s.device.swappable().is_some()),
        ("recovery", d.recovery, s.device.recoverable().is_some()),
        (
            "relocation",
            d.relocation != Moves::No,
            s.device.relocatable().is_some(),
        ),
        ("telemetry", d.telemetry, s.device.telemetry().is_some()),
    ];
    let wrong: Vec<String> = offered
        .iter()
        .filter(|(_, declared, offered)| declared != offered)
        .map(|(group, declared, _)| {
            let (said, got) = if *declared {
                ("present", "None")
            } else {
                ("absent", "Some")
            };
            format!("{group} declared {said}, the device answers {got}")
        })
        .collect();
    if !wrong.is_empty() {
        s.fail(wrong.join("; "));
    }
    let _caps = s.guarded(
        || "migration().caps()".into(),
        |dev| dev.migration().map(|m| m.caps()),
    );
    let quiesce = s.device.swappable().map(|w| w.quiesce());
    if let Some(q) = quiesce {
        let parked = q.park();
        drop(parked);
        s.answers("after a park of its quiesce handle ended");
    }
    if d.recovery {
        let held = s.guarded(
            || "recoverable().held_objects()".into(),
            |dev| dev.recoverable().map(|r| r.held_objects()),
        );
        match held {
            Some(Ok(objects)) => {
                let mut names: Vec<&str> = objects.iter().map(|(n, _)| n.as_str()).collect();
                names.sort_unstable();
                let before = names.len();
                names.dedup();
                if names.len() != before || names.iter().any(|n| n.is_empty()) {
                    s.fail(format_args!(
                        "held_objects() names an object twice or without a name: {names:?}"
                    ));
                }
            }
            Some(Err(e)) => s.fail(format_args!("held_objects() fails: {}", chain(&e))),
            None => unreachable!("checked above"),
        }
    }
    if d.telemetry {
        let first = s.device.telemetry().map(|t| t.work()).unwrap_or_default();
        s.answers("between two reads of the work counters");
        let second = s.device.telemetry().map(|t| t.work()).unwrap_or_default();
        if second.commands < first.commands
            || second.bytes < first.bytes
            || second.errors < first.errors
        {
            s.fail(format_args!(
                "the work counters went backwards: {first:?} then {second:?}"
            ));
        }
    }
    if let Some((kind, given, canonical, profile)) = subject.kind_parts() {
        for (what, options) in [
            ("the checked options", canonical),
            ("the options given", given),
        ] {
            match kind.check(options) {
                Ok((again, p)) => {
                    if &again != canonical || &p != profile {
                        s.fail(format_args!(
                            "checking {what} again gives other options or another profile: \
                             {again:?} / {p:?}, first {canonical:?} / {profile:?}"
                        ));
                    }
                }
                Err(e) => s.fail(format_args!("the kind refuses {what} {options:?}: {e}")),
            }
        }
        if profile.movable != (d.relocation != Moves::No) {
            s.fail(format_args!(
                "the profile says movable = {}, the subject declares relocation {:?}",
                profile.movable, d.relocation
            ));
        }
        let msix = s
            .desc()
            .irqs
            .get(IrqIndex::Msix as usize)
            .is_some_and(|i| i.count > 0);
        // The pool refuses guest-visible moves of devices with MSI-X on this bit: a kind that
        // cannot see the device when it checks options may claim MSI-X (the safe side), never
        // deny it.
        if msix && !profile.msix {
            s.fail("the profile says msix = false, the device has MSI-X vectors");
        }
    }
    let records = subject.black_box_records();
    if d.recovery
        && let Err(e) = BlackBox::create(&records)
    {
        s.fail(format_args!(
            "its black-box records {records:?} cannot be laid out: {e}"
        ));
    }
}

/// The config space (region 7) is 256 or 4096 bytes, readable over its whole size; byte and
/// word reads agree with dword reads over the first 256 bytes; the vendor ID is a real one, the
/// header is type 0, and the capability chains (conventional, and extended in a 4 KiB space)
/// stay inside the space, aligned, without loops.
pub fn config_space(subject: &Subject) {
    let mut s = subject.slot("config_space");
    let Some(r) = s.desc().regions.get(CONFIG_REGION_INDEX as usize).cloned() else {
        s.fail("the description has no region 7 (config space)");
    };
    if !r.read || !r.write || !(r.size == 256 || r.size == 4096) {
        s.fail(format_args!(
            "region 7 is {} bytes, read {}, write {} (expected 256 or 4096 bytes, readable and writable)",
            r.size, r.read, r.write
        ));
    }
    let whole = s.config();
    for off in 0..256u64 {
        let b = s.must_read(CONFIG_REGION_INDEX, off, 1)[0];
        if b != whole[off as usize] {
            s.fail(format_args!(
                "the byte at {off:#x} reads {b:#04x} alone and {:#04x} in its dword",
                whole[off as usize]
            ));
        }
    }
    for off in (0..256u64).step_by(2) {
        let w = s.must_read(CONFIG_REGION_INDEX, off, 2);
        if w[..] != whole[off as usize..off as usize + 2] {
            s.fail(format_args!(
                "the word at {off:#x} reads {w:02x?} alone and otherwise in its dword"
            ));
        }
    }
    let vendor = u16::from_le_bytes([whole[0], whole[1]]);
    if vendor == 0 || vendor == 0xffff {
        s.fail(format_args!("vendor ID {vendor:#06x}: no function answers"));
    }
    if whole[regs::HEADER_TYPE] & 0x7f != 0 {
        s.fail(format_args!(
            "header type {:#04x}: not a type 0 header",
            whole[regs::HEADER_TYPE]
        ));
    }
    let status = u16::from_le_bytes([whole[regs::STATUS], whole[regs::STATUS + 1]]);
    if status & regs::STATUS_CAP_LIST != 0 {
        let mut seen = Vec::new();
        let mut at = usize::from(whole[regs::CAP_PTR] & 0xfc);
        while at != 0 {
            if !(0x40..0x100).contains(&at) || seen.contains(&at) || seen.len() > 48 {
                s.fail(format_args!(
                    "the capability chain goes to {at:#x} after {seen:x?}"
                ));
            }
            seen.push(at);
            at = usize::from(whole[at + 1] & 0xfc);
        }
    }
    if whole.len() == 4096 {
        let mut seen = Vec::new();
        let mut at = 0x100usize;
        loop {
            let h = u32::from_le_bytes([whole[at], whole[at + 1], whole[at + 2], whole[at + 3]]);
            if h == 0 || h == 0xffff_ffff {
                break;
            }
            seen.push(at);
            let next = (h >> 20) as usize & 0xffc;
            if next == 0 {
                break;
            }
            if next < 0x100 || seen.contains(&next) || seen.len() > 512 {
                s.fail(format_args!(
                    "the extended capability chain goes to {next:#x} after {seen:x?}"
                ));
            }
            at = next;
        }
    }
}

/// Every region of the description, with memory decoding on (as a driver has it before it
/// touches a BAR):
///
/// * absent regions (size 0) and indexes past the description refuse reads and writes;
/// * a readable region serves its first and last dword;
/// * accesses at the end, past it, straddling it, whose offset overflows, or longer than the
///   region are refused, reads and writes;
/// * zero-length accesses and reads of 1, 2, 3 and 8 bytes at both ends are answered, served
///   or refused (the region's own rules), never with a panic;
/// * a write straddling the end of the config space changes nothing in it.
pub fn region_bounds(subject: &Subject) {
    let mut s = subject.slot("region_bounds");
    let cmd = s.cfg16(regs::COMMAND) | regs::CMD_MEMORY;
    s.must_write(
        CONFIG_REGION_INDEX,
        regs::COMMAND as u64,
        &cmd.to_le_bytes(),
    );
    let regions = s.desc().regions.clone();
    if regions.len() < NUM_PCI_REGIONS as usize {
        s.fail(format_args!(
            "the description has {} regions (at least {NUM_PCI_REGIONS})",
            regions.len()
        ));
    }
    for (index, r) in (0u32..).zip(&regions) {
        if r.size == 0 {
            refused(&mut s, index, 0, 4, "in an absent region");
            continue;
        }
        let size = r.size;
        if r.read && size >= 4 {
            s.must_read(index, 0, 4);
            s.must_read(index, (size - 4) & !3, 4);
        }
        let mut bad: Vec<(u64, usize, &str)> = vec![
            (size, 4, "at the end"),
            (size, 1, "at the end"),
            (size.saturating_add(0x1000), 4, "past the end"),
            (u64::MAX - 1, 4, "whose end overflows"),
            (u64::MAX, 1, "at the last offset there is"),
        ];
        if size >= 2 {
            bad.push((size - 2, 4, "straddling the end"));
        }
        bad.push((size - 1, 2, "straddling the end"));
        if size <= 16 << 20 {
            bad.push((0, size as usize + 4, "longer than the region"));
        }
        for (offset, len, what) in bad {
            refused(&mut s, index, offset, len, what);
        }
        for len in [0usize, 1, 2, 3, 8] {
            for offset in [0, size.saturating_sub(len as u64)] {
                let _ = s.read(index, offset, len);
            }
        }
        let _ = s.write(index, 0, &[]);
        let _ = s.write(index, size, &[]);
    }
    let n = regions.len() as u32;
    for index in [n, n + 1, 64, u32::MAX] {
        refused(
            &mut s,
            index,
            0,
            4,
            "in a region the description does not have",
        );
    }
    let before = s.config();
    let size = s.config_size();
    if s.write(CONFIG_REGION_INDEX, size - 2, &[0xff; 4]).is_ok() {
        s.fail("a write straddling the end of the config space was served");
    }
    s.assert_config(&before, "after a refused write straddling its end");
}

fn refused(s: &mut Slot, region: u32, offset: u64, len: usize, what: &str) {
    if s.read(region, offset, len).is_ok() {
        s.fail(format_args!(
            "region {region}: a read of {len} bytes at {offset:#x} ({what}) was served"
        ));
    }
    if s.write(region, offset, &vec![0xa5; len]).is_ok() {
        s.fail(format_args!(
            "region {region}: a write of {len} bytes at {offset:#x} ({what}) was served"
        ));
    }
}

/// A resettable device resets (twice in a row too) after a driver programmed it, its
/// read-only header fields are what they were after the build, and it answers; a device
/// that declares no reset support refuses one.
pub fn reset(subject: &Subject) {
    let mut s = subject.slot("reset");
    let header = s.read_only_header();
    s.program();
    if !s.desc().resettable {
        if s.guarded(|| "reset()".into(), |d| d.reset()).is_ok() {
            s.fail("the description says the device cannot reset, yet reset() succeeded");
        }
        return;
    }
    for round in ["a reset", "a second reset"] {
        if let Err(e) = s.guarded(|| round.to_string(), |d| d.reset()) {
            s.fail(format_args!("{round} failed: {}", chain(&e)));
        }
        let after = s.read_only_header();
        for ((field, was), (_, now)) in header.iter().zip(&after) {
            if was != now {
                s.fail(format_args!(
                    "after {round} the {field} reads {now:#x}, after the build {was:#x}"
                ));
            }
        }
        s.answers(&format!("after {round}"));
    }
}

/// The client leaves the way the server handles it (the device parked where it can be, the
/// DMA windows and eventfds dropped, then `client_disconnected`): the device still answers
/// config reads and writes, region reads, a second `client_disconnected` and a reset, and
/// touches no DMA memory: a window a next client maps (a sensor the device's DMA observer is
/// not told about, since a physical device reaches memory only through its IOMMU) sees no
/// access.
pub fn client_gone(subject: &Subject) {
    let mut s = subject.slot("client_gone");
    s.program();
    s.disconnect();
    let sensor = Arc::new(Sensor::default());
    s.ctx.dma.set_observer(None);
    s.ctx.dma.set_remote(Some(sensor.clone()));
    if let Err(e) = s.ctx.dma.map(0, 1 << 40, DmaProt::READ_WRITE, None) {
        s.fail(format_args!("the sensor window cannot be mapped: {e}"));
    }
    s.answers("after the client left");
    let cmd = s.cfg16(regs::COMMAND);
    s.must_write(
        CONFIG_REGION_INDEX,
        regs::COMMAND as u64,
        &cmd.to_le_bytes(),
    );
    s.guarded(
        || "a second client_disconnected()".into(),
        |d| d.client_disconnected(),
    );
    s.answers("after a second client_disconnected");
    if s.desc().resettable
        && let Err(e) = s.guarded(|| "reset() after the client left".into(), |d| d.reset())
    {
        s.fail(format_args!(
            "a reset after the client left failed: {}",
            chain(&e)
        ));
    }
    // Time for engines that did not stop to show it.
    std::thread::sleep(Duration::from_millis(50));
    let (reads, writes) = (
        sensor.reads.load(Ordering::SeqCst),
        sensor.writes.load(Ordering::SeqCst),
    );
    if reads + writes != 0 {
        s.fail(format_args!(
            "after the client left the device made {reads} DMA reads and {writes} DMA writes"
        ));
    }
}

/// A new client finds the PCI function fresh
/// ([`PciDevice::fresh_open`](switchyard_device::PciDevice::fresh_open)): a client programs
/// the device as a guest's driver does (memory decoding and bus mastering, a BAR's address,
/// the interrupt line, PCI Express Device Control, MSI and MSI-X enable where the device has
/// them) and leaves; after `fresh_open` the config space reads as it did after the build, and
/// the device answers.
pub fn fresh_open(subject: &Subject) {
    let mut s = subject.slot("fresh_open");
    let fresh = s.config();
    s.program();
    // What a guest's driver writes besides (a write the device refuses changes nothing).
    let _ = s.write(CONFIG_REGION_INDEX, regs::INT_LINE as u64, &[11]);
    let caps = capabilities_of(&fresh);
    let find = |id: u8| caps.iter().find(|(c, _)| *c == id).map(|(_, at)| *at);
    if let Some(at) = find(cap_id::EXP) {
        // Extended tags on (a Linux guest's 0x2810 -> 0x2830), never the FLR bit.
        let ctl = (s.cfg16(at + exp::DEVCTL) | 0x0020) & !exp::DEVCTL_BCR_FLR;
        let _ = s.write(
            CONFIG_REGION_INDEX,
            (at + exp::DEVCTL) as u64,
            &ctl.to_le_bytes(),
        );
    }
    if let Some(at) = find(cap_id::MSI) {
        let ctl = s.cfg16(at + 2) | 0x0001;
        let _ = s.write(CONFIG_REGION_INDEX, (at + 2) as u64, &ctl.to_le_bytes());
    }
    if let Some(at) = find(cap_id::MSIX) {
        let ctl = s.cfg16(at + 2) | 0xc000;
        let _ = s.write(CONFIG_REGION_INDEX, (at + 2) as u64, &ctl.to_le_bytes());
    }
    s.disconnect();
    if let Err(e) = s.guarded(|| "fresh_open()".into(), |d| d.fresh_open()) {
        s.fail(format_args!("fresh_open() failed: {}", chain(&e)));
    }
    s.assert_config(&fresh, "for a new client (after fresh_open)");
    s.answers("after fresh_open");
}

/// The (ID, offset) of each capability of the standard chain of `config`.
fn capabilities_of(config: &[u8]) -> Vec<(u8, usize)> {
    let mut out = Vec::new();
    let status = u16::from_le_bytes([config[regs::STATUS], config[regs::STATUS + 1]]);
    if status & regs::STATUS_CAP_LIST == 0 {
        return out;
    }
    let mut at = usize::from(config[regs::CAP_PTR] & 0xfc);
    while at >= 0x40 && at + 4 <= config.len().min(0x100) && out.len() < 48 {
        out.push((config[at], at));
        at = usize::from(config[at + 1] & 0xfc);
    }
    out
}
