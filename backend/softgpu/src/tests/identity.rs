//! PCI identity, description, register table and VRAM access paths.

use std::os::unix::fs::FileExt;

use switchyard_device::config::regs as pci;
use switchyard_device::{DeviceError, PciDevice};

use super::*;

#[test]
fn config_space_identity_class_and_capabilities() {
    let mut h = Harness::new();
    assert_eq!(h.cfg_read(0, 4), 0x5347_1234, "vendor:device");
    assert_eq!(h.cfg_read(pci::REVISION as u64, 1), 1);
    assert_eq!(h.cfg_read(pci::CLASS_PROG as u64, 3), 0x03_02_00);
    assert_eq!(h.cfg_read(pci::SUBSYS_VENDOR as u64, 4), 0x0001_1234);
    assert_eq!(h.cfg_read(pci::HEADER_TYPE as u64, 1), 0);
    assert_eq!(h.cfg_read(pci::INT_PIN as u64, 1), 0, "no INTx");
    assert_ne!(
        h.cfg_read(pci::STATUS as u64, 2) & u32::from(pci::STATUS_CAP_LIST),
        0
    );
    let ids: Vec<u8> = h.caps().iter().map(|c| c.0).collect();
    assert_eq!(ids, vec![CAP_PM, CAP_EXP, CAP_MSIX]);

    // PCI Express endpoint, FLR capable.
    let exp = h.cap(CAP_EXP);
    assert_eq!(h.cfg_read(exp + 2, 2) & 0xf0, 0, "endpoint");
    assert_ne!(h.cfg_read(exp + 4, 4) & (1 << 28), 0, "FLR capable");

    // MSI-X: 16 vectors, table in BAR4 at 0, PBA in BAR4 at 0x800, disabled at power-on.
    let m = h.cap(CAP_MSIX);
    let ctl = h.cfg_read(m + 2, 2);
    assert_eq!(ctl & 0x7ff, MSIX_VECTORS - 1);
    assert_eq!(ctl & 0xc000, 0);
    assert_eq!(h.cfg_read(m + 4, 4), 4);
    assert_eq!(h.cfg_read(m + 8, 4), 0x800 | 4);

    // BAR sizing.
    let size32 = |h: &mut Harness, bar: u64| {
        let off = pci::BAR0 as u64 + 4 * bar;
        h.cfg_write(off, 0xffff_ffff, 4);
        h.cfg_read(off, 4)
    };
    assert_eq!(size32(&mut h, 0), !(64 * 1024 - 1) & !0xf, "BAR0 64K mem32");
    assert_eq!(size32(&mut h, 4), !(4096 - 1) & !0xf, "BAR4 4K mem32");
    let lo = size32(&mut h, 2);
    let hi = size32(&mut h, 3);
    assert_eq!(lo & 0xf, 0b1100, "BAR2 is 64-bit prefetchable");
    let size = !((u64::from(hi) << 32) | u64::from(lo & !0xf)) + 1;
    assert_eq!(size, h.config.vram_size);
    for unused in [1, 5] {
        assert_eq!(size32(&mut h, unused), 0, "BAR{unused} unimplemented");
    }
    // Out of range config access.
    let mut b = [0u8; 4];
    assert!(matches!(
        h.gpu.region_read(crate::CONFIG_REGION_INDEX, 4094, &mut b),
        Err(DeviceError::OutOfRange { .. })
    ));
}

#[test]
fn description_lists_regions_and_interrupts() {
    let h = Harness::new();
    let d = h.gpu.description();
    assert_eq!(d.regions.len(), 9);
    assert_eq!(d.regions[0].size, 64 << 10);
    assert!(d.regions[0].read && d.regions[0].write);
    // BAR0 is trapped but for the doorbell page, whose backing holds it at its BAR0 offset.
    let bells = d.regions[0]
        .mmap
        .as_ref()
        .expect("the doorbell page is mappable");
    assert_eq!(bells.file_offset, 0);
    assert_eq!(
        bells.areas,
        vec![switchyard_device::SparseArea {
            offset: DOORBELL_PAGE,
            size: DOORBELL_PAGE_SIZE
        }]
    );
    assert_eq!(
        bells.file.metadata().expect("stat").len(),
        DOORBELL_PAGE + DOORBELL_PAGE_SIZE
    );
    let vram = &d.regions[2];
    assert_eq!(vram.size, h.config.vram_size);
    let mmap = vram.mmap.as_ref().expect("VRAM is mappable");
    assert_eq!(mmap.file_offset, 0);
    assert_eq!(
        mmap.areas,
        vec![switchyard_device::SparseArea {
            offset: 0,
            size: h.config.vram_size
        }]
    );
    assert_eq!(
        mmap.file.metadata().expect("stat").len(),
        h.config.vram_size
    );
    assert_eq!(d.regions[4].size, 4096);
    assert!(d.regions[4].mmap.is_none());
    assert_eq!(d.regions[7].size, 4096);
    for absent in [1, 3, 5, 6, 8] {
        assert_eq!(d.regions[absent].size, 0, "region {absent}");
    }
    assert_eq!(d.irq_counts(), vec![0, 0, 16, 1, 1]);
    assert!(d.irqs[2].eventfd && d.irqs[4].eventfd);
    assert!(d.irqs[2].maskable, "MSI-X: SET_IRQS MASK/UNMASK");
    assert!(!d.irqs[2].noresize && !d.irqs[2].automasked);
    assert!(!d.irqs[4].maskable, "REQ");
    let err = d.irqs[IrqIndex::Err as usize];
    assert!(err.eventfd && err.noresize && !err.maskable, "ERR: {err:?}");
    assert!(d.resettable);
}

#[test]
fn register_table_reads() {
    let mut h = Harness::new();
    let mut magic = [0u8; 4];
    h.gpu
        .region_read(BAR_REGS, MAGIC, &mut magic)
        .expect("magic");
    assert_eq!(&magic, b"SYGP");
    assert_eq!(h.rd32(MAGIC), 0x5047_5953);
    assert_eq!(h.rd32(VERSION), 0x0001_0001);
    assert_eq!(h.rd32(FEATURES), 0x1ff);
    assert_eq!(h.rd32(NUM_QUEUES), 2);
    assert_eq!(h.rd32(VRAM_SIZE_LO), 4 << 20);
    assert_eq!(h.rd32(VRAM_SIZE_HI), 0);
    assert_eq!(h.rd64(VRAM_SIZE_LO), 4 << 20);
    assert_eq!(h.rd64(FENCE_COUNT_LO), 0);
    assert_eq!(h.rd32(INT_STATUS), 0);
    assert_eq!(h.rd32(INT_MASK), 0);
    assert_eq!(h.rd32(DEV_STATUS), 0, "bus master off at power-on");
    assert_eq!(h.rd32(MSIX_VECTOR_COUNT), 16);
    assert_eq!(h.rd32(RING_ENTRY_SIZE), 64);
    assert_eq!(h.rd32(MAX_RING_ENTRIES), 65536);
    assert_eq!(h.rd32(MAX_XFER_BYTES), 1 << 28);
    assert_eq!(h.rd32(MAX_ELEMENTS), 1 << 26);
    assert_eq!(h.rd32(MAX_GEMM_DIM), 4096);
    assert_eq!(h.rd64(MAX_GEMM_WORK_LO), 1 << 36);
    for q in 0..2 {
        assert_eq!(h.qr(q, Q_STATUS), Q_STATUS_STOPPED);
        assert_eq!(h.qr(q, Q_COMPLETION_VECTOR), q);
        assert_eq!(h.qr(q, Q_ERROR_VECTOR), 8 + q);
        assert_eq!(h.qr(q, Q_HEAD), 0);
        assert_eq!(h.qr(q, Q_CONTROL), 0);
    }

    // Scratch is read/write; read-only registers ignore writes.
    h.wr32(SCRATCH, 0xdead_beef);
    assert_eq!(h.rd32(SCRATCH), 0xdead_beef);
    h.wr32(MAGIC, 0);
    h.wr32(NUM_QUEUES, 7);
    assert_eq!(h.rd32(MAGIC), MAGIC_VALUE);
    assert_eq!(h.rd32(NUM_QUEUES), 2);
    // An 8-byte write is low then high: INT_ACK (no effect) then SCRATCH.
    h.wr64(INT_ACK, 0x1234_5678_0000_0000);
    assert_eq!(h.rd32(SCRATCH), 0x1234_5678);
    // 64-bit ring base through one 8-byte write, and through two 4-byte writes.
    h.wr64(queue_reg(1, Q_RING_BASE_LO), 0x1_2345_6780);
    assert_eq!(h.qr(1, Q_RING_BASE_LO), 0x2345_6780);
    assert_eq!(h.qr(1, Q_RING_BASE_HI), 1);
    h.qw(1, Q_RING_BASE_HI, 0);
    assert_eq!(h.rd64(queue_reg(1, Q_RING_BASE_LO)), 0x2345_6780);

    // Undefined offsets read 0 and ignore writes; so do queues beyond NUM_QUEUES.
    for off in [
        0x058,
        0x100,
        0xffc,
        queue_reg(0, 0x44),
        queue_reg(2, 0),
        0xfffc,
    ] {
        h.wr32(off, 0xffff_ffff);
        assert_eq!(h.rd32(off), 0, "offset {off:#x}");
    }
}

#[test]
fn register_accesses_are_checked() {
    let mut h = Harness::new();
    let mut buf = [0u8; 16];
    for (off, len) in [(0, 1), (0, 2), (2, 4), (4, 8), (0, 16), (0x10, 3), (1, 4)] {
        assert!(
            matches!(
                h.gpu.region_read(BAR_REGS, off, &mut buf[..len]),
                Err(DeviceError::BadAccess { .. })
            ),
            "read {len}@{off:#x}"
        );
        assert!(
            matches!(
                h.gpu.region_write(BAR_REGS, off, &buf[..len]),
                Err(DeviceError::BadAccess { .. })
            ),
            "write {len}@{off:#x}"
        );
    }
    for (off, len) in [(0x1_0000, 4), (0xfffc, 8), (u64::MAX - 3, 4)] {
        assert!(
            matches!(
                h.gpu.region_read(BAR_REGS, off, &mut buf[..len]),
                Err(DeviceError::OutOfRange { .. })
            ),
            "read {len}@{off:#x}"
        );
    }
    for absent in [1, 3, 5, 6, 8, 9, 100] {
        assert!(matches!(
            h.gpu.region_read(absent, 0, &mut buf[..4]),
            Err(DeviceError::NoSuchRegion(_))
        ));
    }
    // MSI-X BAR: dword/qword aligned only, inside 4 KiB.
    assert!(matches!(
        h.gpu.region_read(BAR_MSIX, 2, &mut buf[..4]),
        Err(DeviceError::BadAccess { .. })
    ));
    assert!(matches!(
        h.gpu.region_read(BAR_MSIX, 4096, &mut buf[..4]),
        Err(DeviceError::OutOfRange { .. })
    ));
}

#[test]
fn vram_region_and_memfd_are_the_same_bytes() {
    let mut h = Harness::new();
    let size = h.config.vram_size;
    let data: Vec<u8> = (0..13u8).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    h.gpu
        .region_write(BAR_VRAM, 3, &data)
        .expect("unaligned write");
    assert_eq!(h.vram_file_read(3, 13), data);
    assert_eq!(h.vram_region_read(3, 13), data);
    h.vram_file_write(size - 100, &[0xab; 100]);
    assert_eq!(h.vram_region_read(size - 101, 101)[1..], [0xab; 100]);
    assert_eq!(h.vram_region_read(size - 101, 1), [0]);
    // A large access spanning pages.
    let big: Vec<u8> = (0..3 * 4096 + 7).map(|i| (i % 251) as u8).collect();
    h.gpu.region_write(BAR_VRAM, 4095, &big).expect("big write");
    assert_eq!(h.vram_file_read(4095, big.len()), big);
    let mut b = [0u8; 2];
    for off in [size - 1, size, u64::MAX] {
        assert!(matches!(
            h.gpu.region_read(BAR_VRAM, off, &mut b),
            Err(DeviceError::OutOfRange { .. })
        ));
        assert!(matches!(
            h.gpu.region_write(BAR_VRAM, off, &b),
            Err(DeviceError::OutOfRange { .. })
        ));
    }
    // The file the client would mmap is the same memory.
    let d = h.gpu.description();
    let f = &d.regions[2].mmap.as_ref().expect("mmap").file;
    let mut head = [0u8; 3];
    f.read_exact_at(&mut head, 3).expect("pread");
    assert_eq!(head, data[..3]);
}
