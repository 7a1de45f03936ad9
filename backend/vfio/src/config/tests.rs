//! The shadow against a fake device config space: BAR sizing, the hidden ROM, capability
//! filtering, MSI/MSI-X emulation and what reaches the device.

use std::cell::RefCell;

use super::*;

/// A device config space in memory that records the writes that reach it.
struct FakeConfig {
    bytes: RefCell<Vec<u8>>,
    writes: RefCell<Vec<(u64, Vec<u8>)>>,
}

impl RawConfig for FakeConfig {
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let o = offset as usize;
        buf.copy_from_slice(&self.bytes.borrow()[o..o + buf.len()]);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        let o = offset as usize;
        self.bytes.borrow_mut()[o..o + data.len()].copy_from_slice(data);
        self.writes.borrow_mut().push((offset, data.to_vec()));
        Ok(())
    }
}

const PM: usize = 0x40;
const VNDR: usize = 0x48;
const MSI: usize = 0x50;
const EXP: usize = 0x70;
const MSIX: usize = 0xb0;

/// An edu-like device with every kind of BAR and capability: BAR0 1 MiB 32-bit, BAR1 I/O 256 B,
/// BAR2+3 64-bit prefetchable 16 MiB, BAR4 MSI-X 4 KiB; ROM BAR set; caps PM → vendor → MSI
/// (64-bit, maskable) → PCIe v2 → MSI-X.
fn fake() -> FakeConfig {
    let mut c = vec![0u8; 256];
    put16(&mut c, 0, 0x1234);
    put16(&mut c, 2, 0x11e8);
    put16(&mut c, COMMAND, 0x0006 | 0x0400);
    put16(&mut c, STATUS, STATUS_CAP_LIST | 0x0100);
    c[0x08] = 0x10; // revision
    c[0x0b] = 0x00;
    c[0x0e] = 0x80; // multi-function
    put32(&mut c, BAR0, 0xfea0_0000);
    put32(&mut c, BAR0 + 4, 0x0000_c001);
    put32(&mut c, BAR0 + 8, 0xe000_000c);
    put32(&mut c, BAR0 + 12, 0x0000_0001);
    put32(&mut c, BAR0 + 16, 0xfeb0_0000);
    put16(&mut c, 0x2c, 0x1af4);
    put16(&mut c, 0x2e, 0x1100);
    put32(&mut c, ROM_BAR, 0xfec0_0001);
    c[CAP_PTR] = PM as u8;
    c[0x3c] = 11;
    c[0x3d] = 1; // INTA
    // PM
    c[PM] = CAP_PM;
    c[PM + 1] = VNDR as u8;
    put16(&mut c, PM + 2, 0x0003);
    // Vendor-specific
    c[VNDR] = 0x09;
    c[VNDR + 1] = MSI as u8;
    c[VNDR + 2] = 8;
    c[VNDR + 3] = 0xaa;
    // MSI: 64-bit, per-vector mask, 4 vectors (MMC=2)
    c[MSI] = CAP_MSI;
    c[MSI + 1] = EXP as u8;
    put16(&mut c, MSI + 2, 0x0180 | (2 << 1));
    // PCIe v2
    c[EXP] = CAP_EXP;
    c[EXP + 1] = MSIX as u8;
    put16(&mut c, EXP + 2, 0x0002);
    // MSI-X: 8 vectors, table in BAR4 at 0, PBA in BAR4 at 0x800
    c[MSIX] = CAP_MSIX;
    c[MSIX + 1] = 0;
    put16(&mut c, MSIX + 2, 7);
    put32(&mut c, MSIX + 4, 4);
    put32(&mut c, MSIX + 8, 0x800 | 4);
    // Vendor registers outside any capability
    c[0xf0] = 0x5a;
    FakeConfig {
        bytes: RefCell::new(c),
        writes: RefCell::new(vec![]),
    }
}

const SIZES: [u64; 6] = [1 << 20, 256, 16 << 20, 0, 4096, 0];

fn shadow(raw: &FakeConfig) -> VirtConfig {
    VirtConfig::new(raw, 256, SIZES).expect("shadow")
}

fn rd32(c: &VirtConfig, raw: &FakeConfig, o: usize) -> u32 {
    let mut b = [0u8; 4];
    c.read(raw, o as u64, &mut b).expect("read");
    u32::from_le_bytes(b)
}

fn rd16(c: &VirtConfig, raw: &FakeConfig, o: usize) -> u16 {
    let mut b = [0u8; 2];
    c.read(raw, o as u64, &mut b).expect("read");
    u16::from_le_bytes(b)
}

fn wr32(c: &mut VirtConfig, raw: &FakeConfig, o: usize, v: u32) -> ConfigEffects {
    c.write(raw, o as u64, &v.to_le_bytes()).expect("write")
}

fn wr16(c: &mut VirtConfig, raw: &FakeConfig, o: usize, v: u16) -> ConfigEffects {
    c.write(raw, o as u64, &v.to_le_bytes()).expect("write")
}

#[test]
fn ids_come_from_the_device_and_are_read_only() {
    let raw = fake();
    let mut c = shadow(&raw);
    assert_eq!(rd32(&c, &raw, 0), 0x11e8_1234);
    assert_eq!(rd32(&c, &raw, 0x2c), 0x1100_1af4);
    wr32(&mut c, &raw, 0, 0xffff_ffff);
    assert_eq!(rd32(&c, &raw, 0), 0x11e8_1234);
    assert_eq!(c.shadow()[0x0e], 0, "the multi-function bit is not offered");
    assert!(raw.writes.borrow().is_empty(), "nothing reached the device");
}

#[test]
fn bar_sizing_returns_the_real_size_masks_and_addresses_stay_in_the_shadow() {
    let raw = fake();
    let mut c = shadow(&raw);
    // Before the client programs anything, BARs read their flags only.
    assert_eq!(rd32(&c, &raw, BAR0), 0);
    assert_eq!(rd32(&c, &raw, BAR0 + 8), 0xc);
    for (bar, all_ones) in [
        (0, 0xfff0_0000u32),
        (1, 0xffff_ff01),
        (2, 0xff00_000c),
        (3, 0xffff_ffff),
        (4, 0xffff_f000),
        (5, 0),
    ] {
        let o = BAR0 + 4 * bar;
        wr32(&mut c, &raw, o, 0xffff_ffff);
        assert_eq!(rd32(&c, &raw, o), all_ones, "BAR{bar} sizing");
    }
    assert_eq!(
        *c.bars(),
        [
            BarKind::Mem32 { prefetch: false },
            BarKind::Io,
            BarKind::Mem64 { prefetch: true },
            BarKind::Upper,
            BarKind::Mem32 { prefetch: false },
            BarKind::Absent
        ]
    );
    // An address: low bits below the size are dropped, the flags stay.
    wr32(&mut c, &raw, BAR0, 0x8012_3456);
    assert_eq!(rd32(&c, &raw, BAR0), 0x8010_0000);
    wr32(&mut c, &raw, BAR0 + 8, 0x1234_5678);
    wr32(&mut c, &raw, BAR0 + 12, 0x0000_0042);
    assert_eq!(rd32(&c, &raw, BAR0 + 8), 0x1200_000c);
    assert_eq!(rd32(&c, &raw, BAR0 + 12), 0x42);
    // The device's own BARs are the host's: untouched.
    assert!(raw.writes.borrow().is_empty());
    assert_eq!(get32(&raw.bytes.borrow(), BAR0), 0xfea0_0000);
}

#[test]
fn the_rom_bar_is_hidden() {
    let raw = fake();
    let mut c = shadow(&raw);
    assert_eq!(rd32(&c, &raw, ROM_BAR), 0);
    wr32(&mut c, &raw, ROM_BAR, 0xffff_ffff);
    assert_eq!(rd32(&c, &raw, ROM_BAR), 0, "sizing a missing ROM reads 0");
    assert!(raw.writes.borrow().is_empty());
}

#[test]
fn only_pm_msi_pcie_and_msix_are_kept_and_relinked() {
    let raw = fake();
    let c = shadow(&raw);
    let ids: Vec<(u8, usize)> = c.capabilities().iter().map(|k| (k.id, k.offset)).collect();
    assert_eq!(
        ids,
        [
            (CAP_PM, PM),
            (CAP_MSI, MSI),
            (CAP_EXP, EXP),
            (CAP_MSIX, MSIX)
        ]
    );
    assert_eq!(c.hidden_capabilities(), &[(0x09, VNDR)]);
    // Walk the list as a guest driver would.
    let mut walked = vec![];
    let mut p = usize::from(c.shadow()[CAP_PTR]);
    while p != 0 {
        walked.push(c.shadow()[p]);
        p = usize::from(c.shadow()[p + 1]);
    }
    assert_eq!(walked, [CAP_PM, CAP_MSI, CAP_EXP, CAP_MSIX]);
    assert_eq!(
        rd32(&c, &raw, VNDR),
        0,
        "a hidden capability's bytes read 0"
    );
    assert_eq!(c.shadow()[0xf0], 0, "vendor registers are not offered");
    assert_ne!(rd16(&c, &raw, STATUS) & STATUS_CAP_LIST, 0);
}

#[test]
fn a_device_without_kept_capabilities_has_no_capability_list() {
    let raw = fake();
    {
        let mut b = raw.bytes.borrow_mut();
        b[CAP_PTR] = VNDR as u8;
        b[VNDR + 1] = 0;
    }
    let c = shadow(&raw);
    assert!(c.capabilities().is_empty());
    assert_eq!(c.shadow()[CAP_PTR], 0);
    assert_eq!(rd16(&c, &raw, STATUS) & STATUS_CAP_LIST, 0);
}

#[test]
fn a_looping_capability_list_ends() {
    let raw = fake();
    raw.bytes.borrow_mut()[MSIX + 1] = PM as u8;
    let c = shadow(&raw);
    assert!(c.capabilities().len() <= 48);
    assert_eq!(c.capabilities()[0].id, CAP_PM);
}

#[test]
fn msi_is_emulated_in_the_shadow() {
    let raw = fake();
    let mut c = shadow(&raw);
    let msi = c.msi().expect("msi");
    assert_eq!(
        (msi.offset, msi.addr64, msi.maskable, msi.vectors),
        (MSI, true, true, 4)
    );
    assert!(!c.msi_enabled());
    wr32(&mut c, &raw, MSI + 4, 0xfee0_1003);
    wr32(&mut c, &raw, MSI + 8, 0x1);
    wr16(&mut c, &raw, MSI + 12, 0x4041);
    wr32(&mut c, &raw, MSI + 16, 0xffff_ffff);
    let fx = wr16(&mut c, &raw, MSI + 2, 0x0021);
    assert!(fx.msi_control && !fx.msix_control);
    assert!(c.msi_enabled());
    assert_eq!(
        rd32(&c, &raw, MSI + 4),
        0xfee0_1000,
        "address bits 1:0 are reserved"
    );
    assert_eq!(rd32(&c, &raw, MSI + 8), 1);
    assert_eq!(rd16(&c, &raw, MSI + 12), 0x4041);
    assert_eq!(rd32(&c, &raw, MSI + 16), 0xf, "mask bits for 4 vectors");
    assert_eq!(rd16(&c, &raw, MSI + 2), 0x0180 | (2 << 1) | 0x21);
    assert!(
        raw.writes.borrow().is_empty(),
        "the device's MSI capability is the kernel's"
    );
    assert_eq!(get16(&raw.bytes.borrow(), MSI + 2), 0x0180 | (2 << 1));
}

#[test]
fn msix_enable_and_function_mask_are_emulated() {
    let raw = fake();
    let mut c = shadow(&raw);
    let m = c.msix().expect("msix");
    assert_eq!(
        (
            m.vectors,
            m.table_bar,
            m.table_offset,
            m.pba_bar,
            m.pba_offset
        ),
        (8, 4, 0, 4, 0x800)
    );
    assert_eq!((m.table_size(), m.pba_size()), (128, 8));
    assert!(!c.msix_enabled());
    let fx = wr16(&mut c, &raw, MSIX + 2, 0xc000 | 0x3ff);
    assert!(fx.msix_control);
    assert!(c.msix_enabled() && c.msix_function_masked());
    assert_eq!(rd16(&c, &raw, MSIX + 2), 0xc007, "table size is read-only");
    let fx = wr16(&mut c, &raw, MSIX + 2, 0x8000);
    assert!(fx.msix_control && c.msix_enabled() && !c.msix_function_masked());
    let fx = wr16(&mut c, &raw, MSIX + 2, 0x8000);
    assert!(!fx.msix_control, "no change, no effect");
    wr32(&mut c, &raw, MSIX + 4, 0xffff_ffff);
    assert_eq!(rd32(&c, &raw, MSIX + 4), 4, "table location is read-only");
    assert!(raw.writes.borrow().is_empty());
}

#[test]
fn command_memory_and_bus_master_reach_the_device_and_the_rest_stays_in_the_shadow() {
    let raw = fake();
    let mut c = shadow(&raw);
    assert_eq!(
        c.command(),
        0x0006,
        "the client sees only the forwarded bits the device has"
    );
    wr16(&mut c, &raw, COMMAND, 0x0000);
    assert_eq!(
        get16(&raw.bytes.borrow(), COMMAND),
        0x0400,
        "memory and bus master cleared on the device, its INTx disable kept"
    );
    wr16(&mut c, &raw, COMMAND, 0x0146);
    assert_eq!(get16(&raw.bytes.borrow(), COMMAND), 0x0406);
    assert_eq!(rd16(&c, &raw, COMMAND), 0x0146);
    // A 32-bit write over COMMAND and STATUS: STATUS error bits are write-1-to-clear.
    raw.bytes.borrow_mut()[STATUS + 1] |= 0x80; // detected parity error
    wr32(&mut c, &raw, COMMAND, 0x8000_0006);
    let dev_status = get16(&raw.bytes.borrow(), STATUS);
    assert_eq!(
        dev_status & 0x8000,
        0x8000,
        "the fake keeps what is written: the 1 went through"
    );
    let writes = raw.writes.borrow();
    let last = writes.last().expect("a write");
    assert_eq!(last.0, COMMAND as u64);
    assert_eq!(
        u32::from_le_bytes(last.1.clone().try_into().expect("4 bytes")) & 0x7900_0000,
        0,
        "error bits the client did not write are written as 0 (not cleared)"
    );
}

#[test]
fn status_is_read_from_the_device_except_the_capability_list_bit() {
    let raw = fake();
    let c = shadow(&raw);
    raw.bytes.borrow_mut()[STATUS] |= 0x08; // interrupt status
    assert_eq!(rd16(&c, &raw, STATUS) & 0x08, 0x08);
    raw.bytes.borrow_mut()[STATUS] &= !(STATUS_CAP_LIST as u8);
    assert_ne!(rd16(&c, &raw, STATUS) & STATUS_CAP_LIST, 0);
}

#[test]
fn interrupt_pin_is_zero_and_line_is_scratch() {
    let raw = fake();
    let mut c = shadow(&raw);
    assert_eq!(c.shadow()[0x3d], 0, "no INTx");
    c.write(&raw, 0x3c, &[0xff, 0xff]).expect("write");
    assert_eq!(&c.shadow()[0x3c..0x3e], &[0xff, 0]);
}

#[test]
fn accesses_outside_the_space_fail() {
    let raw = fake();
    let mut c = shadow(&raw);
    let mut b = [0u8; 4];
    assert!(c.read(&raw, 254, &mut b).is_err());
    assert!(c.write(&raw, u64::MAX, &b).is_err());
}

#[test]
fn bridges_and_odd_bar_sizes_are_refused() {
    let raw = fake();
    raw.bytes.borrow_mut()[0x0e] = 0x01;
    assert!(matches!(
        VirtConfig::new(&raw, 256, SIZES),
        Err(ConfigError::NotEndpoint(1))
    ));
    let raw = fake();
    assert!(matches!(
        VirtConfig::new(&raw, 256, [3000, 0, 0, 0, 0, 0]),
        Err(ConfigError::BarSize { bar: 0, .. })
    ));
}

#[test]
fn reapply_puts_the_clients_command_back_on_the_device() {
    let raw = fake();
    let mut c = shadow(&raw);
    wr16(&mut c, &raw, COMMAND, 0x0002);
    // A reset restores the device's saved config.
    put16(&mut raw.bytes.borrow_mut(), COMMAND, 0x0406);
    c.reapply(&raw).expect("reapply");
    assert_eq!(get16(&raw.bytes.borrow(), COMMAND), 0x0402);
}

#[test]
fn a_fresh_shadow_drops_everything_the_last_client_wrote() {
    let raw = fake();
    let mut c = shadow(&raw);
    let opened = c.shadow().to_vec();
    wr16(&mut c, &raw, COMMAND, 0x0406);
    wr32(&mut c, &raw, BAR0, 0xfe00_0000);
    wr16(&mut c, &raw, MSI + 2, 0x0001);
    wr16(&mut c, &raw, MSIX + 2, 0xc000);
    wr16(&mut c, &raw, EXP + 8, 0x2830);
    c.write(&raw, 0x3c, &[5]).expect("interrupt line");
    assert_ne!(c.shadow(), &opened[..]);
    c.fresh();
    assert_eq!(c.shadow(), &opened[..]);
    assert!(!c.msix_enabled() && !c.msix_function_masked() && !c.msi_enabled());
    // Then `reapply` hands the device the COMMAND bits of the opened device again.
    c.reapply(&raw).expect("reapply");
    assert_eq!(
        get16(&raw.bytes.borrow(), COMMAND) & COMMAND_FORWARDED,
        get16(&opened, COMMAND) & COMMAND_FORWARDED
    );
}

#[test]
fn extended_space_offers_no_capability() {
    let raw = FakeConfig {
        bytes: RefCell::new({
            let mut b = fake().bytes.into_inner();
            b.resize(4096, 0);
            put32(&mut b, 0x100, 0x1401_0001); // AER, next 0x140
            b
        }),
        writes: RefCell::new(vec![]),
    };
    let c = VirtConfig::new(&raw, 4096, SIZES).expect("shadow");
    assert_eq!(c.size(), 4096);
    assert_eq!(rd32(&c, &raw, 0x100), 0);
}

#[test]
fn the_device_sees_one_access_per_register_touched() {
    let raw = fake();
    let mut c = shadow(&raw);
    wr16(&mut c, &raw, COMMAND, 0x0002);
    assert_eq!(
        *raw.writes.borrow(),
        [(COMMAND as u64, 0x0402u16.to_le_bytes().to_vec())],
        "a 16-bit COMMAND write is one 16-bit device write, STATUS untouched"
    );
    // A whole-space read reads only the live dword from the device.
    let mut all = [0u8; 256];
    c.read(&raw, 0, &mut all).expect("read");
    assert_eq!(&all[..4], &0x11e8_1234u32.to_le_bytes());
    // Writes elsewhere never reach the device.
    raw.writes.borrow_mut().clear();
    c.write(&raw, 0x08, &[0xff; 0xf8]).expect("write");
    assert!(raw.writes.borrow().is_empty());
}

#[test]
fn a_migration_source_s_client_bits_are_replayed_and_the_device_s_own_bits_kept() {
    let raw = fake();
    let mut src = shadow(&raw);
    wr32(&mut src, &raw, 0x10, 0xfe90_0000); // BAR0 address (1 MiB aligned)
    wr16(&mut src, &raw, COMMAND, 0x0146);
    wr16(&mut src, &raw, MSI + 2, 0x0001); // MSI enable
    let saved = src.shadow().to_vec();

    let dst_raw = fake();
    let mut dst = shadow(&dst_raw);
    let ids = rd32(&dst, &dst_raw, 0);
    // A source that claims other read-only bits (ids, capability pointers) changes nothing of them.
    let mut forged = saved.clone();
    forged[0] ^= 0xff;
    forged[0x34] ^= 0xff;
    dst.load_client_bits(&forged);
    assert_eq!(rd32(&dst, &dst_raw, 0), ids, "ids are the device's");
    assert_eq!(
        rd32(&dst, &dst_raw, 0x10),
        0xfe90_0000,
        "BAR address replayed"
    );
    assert_eq!(
        rd16(&dst, &dst_raw, COMMAND),
        0x0146,
        "the client's COMMAND"
    );
    assert!(dst.msi_enabled(), "MSI enable replayed");
    assert_eq!(
        dst.shadow()[0x34],
        src.shadow()[0x34],
        "capability pointer kept"
    );
    assert!(
        dst_raw.writes.borrow().is_empty(),
        "loading touches only the shadow; reapply writes the device"
    );
    dst.reapply(&dst_raw).expect("reapply");
    assert_eq!(get16(&dst_raw.bytes.borrow(), COMMAND) & 0x7, 0x6);
}
