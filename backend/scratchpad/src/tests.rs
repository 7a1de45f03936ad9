use std::collections::BTreeMap;
use std::sync::Arc;

use switchyard_device::blackbox::BlackBox;
use switchyard_device::kind::{Build, DeviceKind, KindOptions, parse_kv, pending_object};
use switchyard_device::{
    CONFIG_REGION_INDEX, DeviceContext, DeviceError, DmaSpace, Interrupts, PciDevice, WaitControl,
};

use super::*;

fn ctx() -> DeviceContext {
    DeviceContext {
        dma: Arc::new(DmaSpace::new(4)),
        irqs: Arc::new(Interrupts::new(&[0, 0, 0, 0, 0])),
        waits: Arc::new(WaitControl::default()),
        memory: Default::default(),
    }
}

fn options(s: &str) -> KindOptions {
    parse_kv(s).expect("parses")
}

fn build(s: &str, c: DeviceContext, bb: Option<&Arc<BlackBox>>) -> Box<dyn PciDevice> {
    let o = ScratchpadKind.configure(&options(s)).expect("valid");
    let mut b = Build::new(c);
    b.black_box = bb.cloned();
    o.build(b).expect("builds")
}

fn black_box() -> Arc<BlackBox> {
    let config = ScratchpadKind
        .configure(&KindOptions::new())
        .expect("valid");
    BlackBox::create(&config.black_box_records()).expect("black box")
}

fn read64(d: &mut dyn PciDevice, region: u32, offset: u64) -> u64 {
    let mut b = [0u8; 8];
    d.region_read(region, offset, &mut b).expect("reads");
    u64::from_le_bytes(b)
}

fn write64(d: &mut dyn PciDevice, region: u32, offset: u64, v: u64) {
    d.region_write(region, offset, &v.to_le_bytes())
        .expect("writes");
}

fn ram(d: &mut dyn PciDevice, size: u64) -> Vec<u8> {
    let mut b = vec![0u8; size as usize];
    d.region_read(BAR_RAM, 0, &mut b).expect("reads");
    b
}

fn pad(d: &dyn PciDevice) -> &Scratchpad {
    d.as_any()
        .downcast_ref::<Scratchpad>()
        .expect("a scratchpad")
}

#[test]
fn options_default_complete_and_refuse_naming_the_field() {
    let (o, p) = ScratchpadKind.check(&KindOptions::new()).expect("defaults");
    assert_eq!(o["size"], 1u64 << 20);
    assert_eq!(p.memory, 1 << 20);
    assert_eq!(
        ScratchpadKind.memory_name(),
        "ram",
        "its memory is no GPU's VRAM"
    );
    assert_eq!(p.queues, 0);
    assert!(!p.partitionable && p.movable && !p.msix);
    assert_eq!(p.dirty_log, switchyard_device::kind::DirtyLog::DeviceLog);
    assert_eq!(p.exclusive, None);
    let (o2, _) = ScratchpadKind.check(&o).expect("its canonical form checks");
    assert_eq!(o2, o);
    let (o, p) = ScratchpadKind.check(&options("size=64K")).expect("64K");
    assert_eq!((o["size"].as_u64(), p.memory), (Some(64 << 10), 64 << 10));
    assert_eq!(
        ScratchpadKind
            .check(&options("size=64M"))
            .expect("max")
            .1
            .memory,
        64 << 20
    );
    assert_eq!(
        ScratchpadKind
            .check(&options("size=4K"))
            .expect("min")
            .1
            .memory,
        4 << 10
    );
    for bad in [
        "size=3M",
        "size=2K",
        "size=128M",
        "size=0",
        "size=lots",
        "size=-1",
    ] {
        let e = ScratchpadKind.check(&options(bad)).expect_err(bad);
        assert_eq!(e.field(), Some("size"), "{bad}: {e}");
        assert!(e.to_string().contains("`size`"), "{e}");
    }
    let e = ScratchpadKind
        .check(&options("size=1M,colour=blue"))
        .expect_err("unknown");
    assert_eq!(e.field(), Some("colour"));
    assert!(e.to_string().contains("known: size"), "{e}");
    assert_eq!(
        ScratchpadKind.partition(&o, 1, 1),
        o,
        "a board is one device"
    );
}

#[test]
fn registers_read_their_values_and_accum_adds_wrapping() {
    let mut d = build("size=64K", ctx(), None);
    let d = &mut *d;
    assert_eq!(read64(d, BAR_REGS, REG_ID), ID);
    assert_eq!(read64(d, BAR_REGS, REG_SIZE), 64 << 10);
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), 0);
    write64(d, BAR_REGS, REG_ACCUM, 5);
    write64(d, BAR_REGS, REG_ACCUM, 7);
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), 12);
    write64(d, BAR_REGS, REG_ACCUM, u64::MAX);
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), 11, "wraps");
    // Two 4-byte writes add their halves; 4-byte reads read halves.
    d.region_write(BAR_REGS, REG_ACCUM, &1u32.to_le_bytes())
        .expect("low half");
    d.region_write(BAR_REGS, REG_ACCUM + 4, &2u32.to_le_bytes())
        .expect("high half");
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), (2 << 32) + 12);
    let mut half = [0u8; 4];
    d.region_read(BAR_REGS, REG_ACCUM + 4, &mut half)
        .expect("reads");
    assert_eq!(u32::from_le_bytes(half), 2);
    // Read-only registers and unknown offsets ignore writes; unknown offsets read 0.
    write64(d, BAR_REGS, REG_ID, 1);
    write64(d, BAR_REGS, REG_SIZE, 1);
    write64(d, BAR_REGS, 0x800, 1);
    assert_eq!(read64(d, BAR_REGS, REG_ID), ID);
    assert_eq!(read64(d, BAR_REGS, REG_SIZE), 64 << 10);
    assert_eq!(read64(d, BAR_REGS, 0x800), 0);
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), (2 << 32) + 12);
    // Widths and alignments the registers do not take, and accesses past the BAR.
    let mut b = [0u8; 8];
    for (offset, len) in [
        (REG_ACCUM + 4, 8),
        (REG_ACCUM, 2),
        (REG_ACCUM + 1, 4),
        (0, 0),
    ] {
        let e = d
            .region_read(BAR_REGS, offset, &mut b[..len])
            .expect_err("bad access");
        assert!(matches!(e, DeviceError::BadAccess { .. }), "{e:?}");
        let e = d
            .region_write(BAR_REGS, offset, &b[..len])
            .expect_err("bad access");
        assert!(matches!(e, DeviceError::BadAccess { .. }), "{e:?}");
    }
    for offset in [REGS_SIZE, REGS_SIZE - 4, u64::MAX - 3, u64::MAX] {
        let e = d
            .region_read(BAR_REGS, offset, &mut b)
            .expect_err("outside");
        assert!(matches!(e, DeviceError::OutOfRange { .. }), "{e:?}");
        assert_eq!(e.errno(), libc_einval());
    }
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), (2 << 32) + 12, "unchanged");
    assert!(matches!(
        d.region_read(1, 0, &mut b),
        Err(DeviceError::NoSuchRegion(1))
    ));
    assert!(d.region_write(8, 0, &b).is_err());
}

fn libc_einval() -> i32 {
    DeviceError::BadAccess {
        region: 0,
        offset: 0,
        len: 0,
    }
    .errno()
}

#[test]
fn ram_reads_what_was_written_and_refuses_accesses_past_the_end() {
    let size = 8u64 << 10;
    let mut d = build("size=8K", ctx(), None);
    let d = &mut *d;
    assert_eq!(ram(d, size), vec![0; size as usize], "zeroed");
    d.region_write(BAR_RAM, 4093, b"across a page")
        .expect("unaligned, across pages");
    d.region_write(BAR_RAM, size - 3, b"end")
        .expect("the last bytes");
    let mut b = [0u8; 13];
    d.region_read(BAR_RAM, 4093, &mut b).expect("reads");
    assert_eq!(&b, b"across a page");
    let mut b = [0u8; 3];
    d.region_read(BAR_RAM, size - 3, &mut b).expect("reads");
    assert_eq!(&b, b"end");
    let mut big = [0u8; 16];
    for (offset, len) in [
        (size - 2, 3usize),
        (size, 1),
        (size + 4096, 4),
        (u64::MAX, 1),
        (u64::MAX - 1, 16),
    ] {
        let e = d
            .region_read(BAR_RAM, offset, &mut big[..len])
            .expect_err("outside");
        assert!(matches!(e, DeviceError::OutOfRange { .. }), "{e:?}");
        let e = d
            .region_write(BAR_RAM, offset, &big[..len])
            .expect_err("outside");
        assert!(matches!(e, DeviceError::OutOfRange { .. }), "{e:?}");
    }
    let mut b = [0u8; 3];
    d.region_read(BAR_RAM, size - 3, &mut b).expect("reads");
    assert_eq!(&b, b"end", "a refused write wrote nothing");
    let whole = vec![0u8; size as usize + 1];
    assert!(d.region_write(BAR_RAM, 0, &whole).is_err());
    let w = d.telemetry().expect("telemetry").work();
    assert_eq!(
        (w.commands, w.bytes),
        (2, 16),
        "BAR2 writes and their bytes"
    );
    assert_eq!(w.errors, 11, "refused BAR accesses");
}

#[test]
fn reset_zeroes_accum_ram_and_the_config_space() {
    let size = 16u64 << 10;
    let mut d = build("size=16K", ctx(), None);
    let d = &mut *d;
    write64(d, BAR_REGS, REG_ACCUM, 42);
    d.region_write(BAR_RAM, 5000, &[0xab; 3000])
        .expect("writes");
    // Memory space + bus master, and a BAR address.
    d.region_write(CONFIG_REGION_INDEX, 0x04, &6u16.to_le_bytes())
        .expect("COMMAND");
    d.region_write(CONFIG_REGION_INDEX, 0x10, &0xfe00_0000u32.to_le_bytes())
        .expect("BAR0");
    let mut cmd = [0u8; 2];
    d.region_read(CONFIG_REGION_INDEX, 0x04, &mut cmd)
        .expect("reads");
    assert_eq!(u16::from_le_bytes(cmd), 6);
    d.reset().expect("resets");
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), 0);
    assert_eq!(ram(d, size), vec![0; size as usize]);
    d.region_read(CONFIG_REGION_INDEX, 0x04, &mut cmd)
        .expect("reads");
    assert_eq!(u16::from_le_bytes(cmd), 0);
    let mut bar = [0u8; 4];
    d.region_read(CONFIG_REGION_INDEX, 0x10, &mut bar)
        .expect("reads");
    assert_eq!(u32::from_le_bytes(bar), 0);
    let mut ids = [0u8; 4];
    d.region_read(CONFIG_REGION_INDEX, 0, &mut ids)
        .expect("reads");
    assert_eq!(u32::from_le_bytes(ids), 0x5350_1234, "vendor:device");
    // A function level reset through the PCI Express capability does the same.
    write64(d, BAR_REGS, REG_ACCUM, 9);
    d.region_write(BAR_RAM, 0, &[1; 8]).expect("writes");
    let exp = (0x40..0x100)
        .step_by(4)
        .find(|&o| {
            let mut id = [0u8; 1];
            d.region_read(CONFIG_REGION_INDEX, o, &mut id)
                .expect("reads");
            id[0] == 0x10
        })
        .expect("a PCI Express capability");
    d.region_write(CONFIG_REGION_INDEX, exp + 0x09, &[0x80])
        .expect("initiate FLR");
    assert_eq!(read64(d, BAR_REGS, REG_ACCUM), 0);
    assert_eq!(ram(d, size), vec![0; size as usize]);
    let mut b = [0u8; 4];
    assert!(
        d.region_read(CONFIG_REGION_INDEX, 4094, &mut b).is_err(),
        "config space bounds"
    );
}

#[test]
fn a_relocation_with_writes_between_rounds_carries_ram_and_accum() {
    let size = 256u64 << 10;
    let slot = ctx();
    let bb = black_box();
    let mut d = build("size=256K", slot.clone(), Some(&bb));
    write64(&mut *d, BAR_REGS, REG_ACCUM, 1000);
    d.region_write(BAR_RAM, 0, &[1; 10000]).expect("writes");
    d.region_write(BAR_RAM, size - 100, &[2; 100])
        .expect("writes");
    let source = pad(&*d).ram_identity();

    let mut relocation = d
        .relocatable()
        .expect("relocatable")
        .begin_relocation(false)
        .expect("begins");
    let targets = relocation.targets().expect("targets");
    assert_eq!(targets.len(), 1);
    assert_eq!(targets[0].0, RAM_OBJECT);
    let target = RamIdentity::of(&targets[0].1).expect("identity");
    assert_ne!(target, source);
    assert_eq!(relocation.round().expect("first round"), size, "everything");
    // Written behind the first round: copied by the next.
    d.region_write(BAR_RAM, 70_000, &[3; 5000]).expect("writes");
    write64(&mut *d, BAR_REGS, REG_ACCUM, 1);
    assert_eq!(
        relocation.round().expect("second round"),
        2 * 4096,
        "the two pages written"
    );
    assert_eq!(relocation.round().expect("nothing new"), 0);
    assert_eq!(relocation.rounds(), 3);
    let mut next = relocation.successor(slot.clone()).expect("successor");
    assert_eq!(pad(&*next).ram_identity(), target);
    // Written while the successor was built: its own round catches up.
    d.region_write(BAR_RAM, 200_000, &[4; 10]).expect("writes");
    assert_eq!(
        next.relocatable()
            .expect("relocatable")
            .relocation_round()
            .expect("catches up"),
        4096
    );
    // Written before the swap: the hand-over copies it.
    d.region_write(BAR_RAM, 8000, &[5; 300]).expect("writes");
    d.region_write(BAR_RAM, 12288, &[6; 4097]).expect("writes");
    write64(&mut *d, BAR_REGS, REG_ACCUM, 10);
    assert_eq!(
        slot.memory
            .get::<ram::Ram>(RAM_OBJECT)
            .expect("the slot's RAM")
            .identity(),
        source,
        "nothing switched before the swap"
    );

    let old = d.swappable().expect("swappable");
    old.check_successor(&*next).expect("fits");
    old.hand_over(&mut *next).expect("hands over");
    assert_eq!(
        slot.memory
            .get::<ram::Ram>(RAM_OBJECT)
            .expect("the slot's RAM")
            .identity(),
        target,
        "the target is the slot's RAM"
    );
    assert_eq!(
        read64(&mut *next, BAR_REGS, REG_ACCUM),
        1011,
        "ACCUM carried"
    );
    assert_eq!(ram(&mut *next, size), ram(&mut *d, size), "RAM carried");
    let mut b = [0u8; 300];
    next.region_read(BAR_RAM, 8000, &mut b).expect("reads");
    assert_eq!(b, [5; 300]);
    let stats = next
        .relocatable()
        .expect("relocatable")
        .relocation_stats()
        .expect("stats");
    assert_eq!(stats.rounds, 4);
    assert_eq!(
        stats.final_bytes,
        4 * 4096,
        "pages 1 and 2 (8000..8300), 3 and 4"
    );
    assert_eq!(stats.bytes, size + 2 * 4096 + 4096 + 4 * 4096);
    assert_eq!(pad(&*next).work, pad(&*d).work, "the counters carry on");
    // The black box names the new RAM; the old device takes no second hand-over.
    assert_eq!(Scratchpad::black_box_ram(&bb).expect("saved"), target);
    let again = Scratchpad::on(size, slot.clone(), pad(&*next).ram.clone());
    assert!(
        d.swappable()
            .expect("swappable")
            .check_successor(&again)
            .is_err()
    );
    // The successor serves on its own.
    write64(&mut *next, BAR_REGS, REG_ACCUM, 1);
    assert_eq!(read64(&mut *next, BAR_REGS, REG_ACCUM), 1012);
}

#[test]
fn successors_of_another_size_backing_or_kind_are_refused() {
    let slot = ctx();
    let mut d = build("size=64K", slot.clone(), None);
    let other = build("size=128K", ctx(), None);
    let elsewhere = build("size=64K", ctx(), None);
    let s = d.swappable().expect("swappable");
    assert_eq!(s.check_successor(&*other), Err("another RAM size"));
    assert_eq!(s.check_successor(&*elsewhere), Err("another RAM backing"));
    struct Other(switchyard_device::DeviceDescription);
    impl PciDevice for Other {
        fn description(&self) -> &switchyard_device::DeviceDescription {
            &self.0
        }
        fn region_read(&mut self, _: u32, _: u64, _: &mut [u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn reset(&mut self) -> switchyard_device::Result<()> {
            Ok(())
        }
    }
    let mut foreign = Other(d.description().clone());
    let s = d.swappable().expect("swappable");
    assert_eq!(s.check_successor(&foreign), Err("another kind of device"));
    assert!(s.hand_over(&mut foreign).is_err());
    // The plain successor (same RAM, the slot's) fits and takes the state.
    write64(&mut *d, BAR_REGS, REG_ACCUM, 3);
    let s = d.swappable().expect("swappable");
    let mut next = (s.successor())(slot.clone()).expect("builds");
    s.check_successor(&*next).expect("fits");
    s.hand_over(&mut *next).expect("hands over");
    assert_eq!(read64(&mut *next, BAR_REGS, REG_ACCUM), 3);
    let _guard = d.swappable().expect("swappable").quiesce().park();
}

#[test]
fn a_replacement_recovers_from_the_black_box_and_the_held_ram() {
    let size = 32u64 << 10;
    let bb = black_box();
    let mut d = build("size=32K", ctx(), Some(&bb));
    write64(&mut *d, BAR_REGS, REG_ACCUM, 77);
    d.region_write(BAR_RAM, 100, b"survives").expect("writes");
    d.region_write(CONFIG_REGION_INDEX, 0x04, &6u16.to_le_bytes())
        .expect("COMMAND");
    d.region_write(CONFIG_REGION_INDEX, 0x18, &0xfd00_0000u32.to_le_bytes())
        .expect("BAR2");
    let held = d
        .recoverable()
        .expect("recoverable")
        .held_objects()
        .expect("held");
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].0, RAM_OBJECT);
    let before = ram(&mut *d, size);
    drop(d); // The worker dies; the daemon holds the black box and the RAM.

    let bb = BlackBox::open(bb.file().try_clone().expect("dup")).expect("opens");
    let slot = ctx();
    let mut b = Build::new(slot.clone());
    b.black_box = Some(bb.clone());
    b.objects = held.into_iter().collect();
    let o = ScratchpadKind
        .configure(&options("size=32K"))
        .expect("valid");
    let mut r = o.recover(b).expect("recovers");
    assert_eq!(read64(&mut *r, BAR_REGS, REG_ACCUM), 77);
    assert_eq!(ram(&mut *r, size), before);
    let mut cfg = [0u8; 4];
    r.region_read(CONFIG_REGION_INDEX, 0x04, &mut cfg[..2])
        .expect("reads");
    assert_eq!(u16::from_le_bytes([cfg[0], cfg[1]]), 6, "COMMAND carried");
    r.region_read(CONFIG_REGION_INDEX, 0x18, &mut cfg)
        .expect("reads");
    assert_eq!(u32::from_le_bytes(cfg), 0xfd00_0000, "BAR2 address carried");
    assert!(
        slot.memory.get::<ram::Ram>(RAM_OBJECT).is_some(),
        "the slot's RAM"
    );
    // It keeps publishing: a second replacement sees the new value.
    write64(&mut *r, BAR_REGS, REG_ACCUM, 1);
    let mut b = Build::new(ctx());
    b.black_box = Some(bb.clone());
    b.objects = r
        .recoverable()
        .expect("recoverable")
        .held_objects()
        .expect("held")
        .into_iter()
        .collect();
    drop(r);
    let mut again = o.recover(b).expect("recovers again");
    assert_eq!(read64(&mut *again, BAR_REGS, REG_ACCUM), 78);

    // What a recovery refuses: no black box, no RAM, another RAM, another size.
    let e = o.recover(Build::new(ctx())).expect_err("no black box");
    assert!(
        matches!(e, switchyard_device::kind::KindError::NoRecovery(_)),
        "{e}"
    );
    let mut b = Build::new(ctx());
    b.black_box = Some(bb.clone());
    let e = o.recover(b).expect_err("no RAM");
    assert!(e.to_string().contains(RAM_OBJECT), "{e}");
    let stranger = ram::Ram::create(size).expect("a RAM");
    let mut b = Build::new(ctx());
    b.black_box = Some(bb.clone());
    b.objects = BTreeMap::from([(
        RAM_OBJECT.to_owned(),
        stranger.file().try_clone().expect("dup"),
    )]);
    let e = o.recover(b).expect_err("another RAM");
    assert!(format!("{:?}", e).contains("RamMismatch"), "{e:?}");
    let big = ScratchpadKind
        .configure(&options("size=64K"))
        .expect("valid");
    let mut b = Build::new(ctx());
    b.black_box = Some(bb.clone());
    b.objects = again
        .recoverable()
        .expect("recoverable")
        .held_objects()
        .expect("held")
        .into_iter()
        .collect();
    assert!(big.recover(b).is_err(), "another size");
    // A black box nothing was published into.
    let mut b = Build::new(ctx());
    b.black_box = Some(black_box());
    b.objects = again
        .recoverable()
        .expect("recoverable")
        .held_objects()
        .expect("held")
        .into_iter()
        .collect();
    let e = o.recover(b).expect_err("no state");
    assert!(format!("{e:?}").contains("NoState"), "{e:?}");
}

/// A worker killed during a move leaves the current RAM and the target (pending) in custody;
/// the replacement runs on the one the black box names.
#[test]
fn a_replacement_picks_the_pending_ram_only_when_the_device_ran_on_it() {
    let size = 16u64 << 10;
    let o = ScratchpadKind
        .configure(&options("size=16K"))
        .expect("valid");
    let recover = |bb: &Arc<BlackBox>, current: &std::fs::File, pending: &std::fs::File| {
        let mut b = Build::new(ctx());
        b.black_box = Some(bb.clone());
        b.objects = BTreeMap::from([
            (RAM_OBJECT.to_owned(), current.try_clone().expect("dup")),
            (
                pending_object(RAM_OBJECT),
                pending.try_clone().expect("dup"),
            ),
        ]);
        o.recover(b).expect("recovers")
    };

    // Killed during the rounds: the device still ran on the current RAM.
    let bb = black_box();
    let slot = ctx();
    let mut d = build("size=16K", slot.clone(), Some(&bb));
    d.region_write(BAR_RAM, 0, b"old").expect("writes");
    let current = pad(&*d).ram_memfd().expect("dup");
    let mut relocation = d
        .relocatable()
        .expect("relocatable")
        .begin_relocation(false)
        .expect("begins");
    let pending = relocation.targets().expect("targets").remove(0).1;
    relocation.round().expect("copies");
    d.region_write(BAR_RAM, 0, b"new")
        .expect("writes behind the copy");
    drop((relocation, d));
    let mut r = recover(&bb, &current, &pending);
    assert_eq!(
        pad(&*r).ram_identity(),
        RamIdentity::of(&current).expect("id")
    );
    let mut b = [0u8; 3];
    r.region_read(BAR_RAM, 0, &mut b).expect("reads");
    assert_eq!(&b, b"new");

    // Killed after the swap, before custody held the target under its name.
    let bb = black_box();
    let slot = ctx();
    let mut d = build("size=16K", slot.clone(), Some(&bb));
    write64(&mut *d, BAR_REGS, REG_ACCUM, 5);
    let current = pad(&*d).ram_memfd().expect("dup");
    let mut relocation = d
        .relocatable()
        .expect("relocatable")
        .begin_relocation(false)
        .expect("begins");
    let pending = relocation.targets().expect("targets").remove(0).1;
    relocation.round().expect("copies");
    let mut next = relocation.successor(slot.clone()).expect("successor");
    d.region_write(BAR_RAM, 0, b"moved").expect("writes");
    d.swappable()
        .expect("swappable")
        .hand_over(&mut *next)
        .expect("hands over");
    write64(&mut *next, BAR_REGS, REG_ACCUM, 1);
    drop((d, next));
    let mut r = recover(&bb, &current, &pending);
    assert_eq!(
        pad(&*r).ram_identity(),
        RamIdentity::of(&pending).expect("id")
    );
    let mut b = [0u8; 5];
    r.region_read(BAR_RAM, 0, &mut b).expect("reads");
    assert_eq!(&b, b"moved");
    assert_eq!(read64(&mut *r, BAR_REGS, REG_ACCUM), 6);
    assert_eq!(ram(&mut *r, size).len(), size as usize);
}

#[test]
fn ram_handed_over_must_be_a_sealed_memfd_of_the_size() {
    let plain = tempfile_like();
    assert!(matches!(
        ram::Ram::adopt(plain, 4096),
        Err(ScratchpadError::NotSealed)
    ));
    let small = ram::Ram::create(4096).expect("a RAM");
    assert!(matches!(
        ram::Ram::adopt(small.file().try_clone().expect("dup"), 8192),
        Err(ScratchpadError::RamSize { .. })
    ));
    assert!(matches!(
        Scratchpad::new(3 << 10, ctx()),
        Err(ScratchpadError::Size(_))
    ));
    // A slot whose RAM is of another size.
    let slot = ctx();
    Scratchpad::new(4096, slot.clone()).expect("builds");
    assert!(matches!(
        Scratchpad::new(8192, slot),
        Err(ScratchpadError::RamSize { .. })
    ));
}

/// An unsealed memfd.
fn tempfile_like() -> std::fs::File {
    let m = memfd::MemfdOptions::default()
        .create("unsealed")
        .expect("memfd");
    m.as_file().set_len(4096).expect("sized");
    m.into_file()
}
