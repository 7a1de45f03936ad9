//! Our VMM-side client (`switchyard-client`) against a real `switchyard serve` process: the
//! full workload, plus what the `vfio_user` crate cannot do — error replies, posted and
//! multi writes, message-based DMA, dirty bitmaps, interrupt masking, FLR, BAR sizing.
#![forbid(unsafe_code)]

mod common;

use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::ServerProcess;
use common::driver::{CONFIG, Driver, GUEST_IOVA, Transport, WINDOW_SIZE, guest, wait_eventfd};
use common::ours::Ours;
use switchyard_client::{Client, FlatDma};
use switchyard_proto::WriteMultiEntry;
use switchyard_proto::consts::*;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;

fn connect(server: &ServerProcess) -> Client {
    Client::connect(&server.socket).expect("connect")
}

#[test]
fn negotiation_and_device_description() {
    let server = ServerProcess::start("softgpu,vram=32M,queues=4");
    let mut c = connect(&server);
    assert_eq!(c.server_version(), (0, 0));
    let caps = c.negotiated_caps().clone();
    assert_eq!(caps.max_data_xfer_size, 1 << 20);
    assert!(caps.max_msg_fds >= 8);
    let info = c.device_info().expect("info");
    assert_eq!(info.flags, VFIO_DEVICE_FLAGS_PCI | VFIO_DEVICE_FLAGS_RESET);
    assert_eq!((info.num_regions, info.num_irqs), (9, 5));
    let vram = c.region_info(2).expect("BAR2");
    assert_eq!(vram.info.size, 32 << 20);
    assert_ne!(vram.info.flags & VFIO_REGION_INFO_FLAG_MMAP, 0);
    let areas = vram.sparse_areas.expect("sparse mmap capability");
    assert_eq!(
        (areas.len(), areas[0].offset, areas[0].size),
        (1, 0, 32 << 20)
    );
    let fd = vram.fd.expect("VRAM fd");
    assert_eq!(
        fd.metadata().expect("stat").len(),
        32 << 20,
        "the fd is the VRAM memfd"
    );
    // Too small an argsz: no caps and no fd, argsz says what is needed.
    let (small, _caps, fds) = c.region_info_raw(2, 32).expect("small argsz");
    assert!(small.argsz > 32 && small.cap_offset == 0 && fds.is_empty());
    // QEMU rejects the CAPS flag without a capability offset: the retry is driven by argsz.
    assert_eq!(
        small.flags & VFIO_REGION_INFO_FLAG_CAPS,
        0,
        "no CAPS flag without caps"
    );
    let cfg = c.region_info(7).expect("config");
    assert_eq!(cfg.info.size, 4096);
    assert!(cfg.fd.is_none() && cfg.info.flags & VFIO_REGION_INFO_FLAG_MMAP == 0);
    let mut magic = [0u8; 4];
    c.region_read(0, MAGIC, &mut magic).expect("read");
    assert_eq!(&magic, b"SYGP");
    let mut q = [0u8; 4];
    c.region_read(0, NUM_QUEUES, &mut q).expect("read");
    assert_eq!(u32::from_le_bytes(q), 4);
    assert_eq!(c.irq_info(VFIO_PCI_MSIX_IRQ_INDEX).expect("msix").count, 16);
    c.feature_probe(VFIO_DEVICE_FEATURE_MIGRATION, true, false)
        .expect("migration can be read");
    let e = c.feature_probe(VFIO_DEVICE_FEATURE_MIGRATION, false, true);
    assert_eq!(
        e.expect_err("MIGRATION cannot be set").remote_errno(),
        Some(libc::EINVAL)
    );
}

#[test]
fn full_workload_through_our_client() {
    let server = ServerProcess::start("softgpu");
    let mut d = Driver::new(Ours(connect(&server)));
    common::workload::run_all(&mut d);
}

#[test]
fn posted_and_multi_writes() {
    let server = ServerProcess::start("softgpu");
    let mut c = connect(&server);
    for v in 0..100u32 {
        c.region_write_posted(0, SCRATCH, &v.to_le_bytes())
            .expect("posted");
    }
    let mut b = [0u8; 4];
    c.region_read(0, SCRATCH, &mut b).expect("read");
    assert_eq!(
        u32::from_le_bytes(b),
        99,
        "posted writes applied in order before the read"
    );
    let entry = |off: u64, v: u32| {
        let mut data = [0u8; 8];
        data[..4].copy_from_slice(&v.to_le_bytes());
        WriteMultiEntry {
            offset: off,
            region: 0,
            count: 4,
            data,
        }
    };
    let n = c
        .region_write_multi(&[
            entry(SCRATCH, 1),
            entry(INT_MASK, 0xf),
            entry(SCRATCH, 0x1234),
        ])
        .expect("multi");
    assert_eq!(n, 3);
    c.region_read(0, SCRATCH, &mut b).expect("read");
    assert_eq!(u32::from_le_bytes(b), 0x1234);
    c.region_read(0, INT_MASK, &mut b).expect("read");
    assert_eq!(u32::from_le_bytes(b), 0xf);
    // A bad entry fails the request with an errno.
    let bad = WriteMultiEntry {
        offset: 0,
        region: 6,
        count: 4,
        data: [0; 8],
    };
    assert_eq!(
        c.region_write_multi(&[bad])
            .expect_err("bad region")
            .remote_errno(),
        Some(libc::EINVAL)
    );
}

#[test]
fn message_based_dma_for_windows_without_fd() {
    let server = ServerProcess::start("softgpu");
    let mut c = connect(&server);
    let flat = Arc::new(Mutex::new(FlatDma::new(0x4000_0000, 1 << 20)));
    c.set_dma_handler(Some(Box::new(flat.clone())));
    let mut d = Driver::new(Ours(c));
    // A window the client maps without an fd: the device must reach it through DMA_READ /
    // DMA_WRITE messages to the client.
    d.t.0
        .dma_map(
            0x4000_0000,
            1 << 20,
            VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE,
            None,
        )
        .expect("fd-less map");
    flat.lock().expect("lock").mem[0x100..0x100 + 64].copy_from_slice(&[0x42; 64]);
    d.setup_queue(0);
    d.run(
        0,
        &[
            Command::copy(Operand::Guest(0x4000_0100), guest(0x2000), 64),
            Command::fill(Operand::Guest(0x4000_8000), 3 << 20 >> 4, 0x0badcafe),
        ],
    );
    let mut b = [0u8; 64];
    d.mem.read(0x2000, &mut b);
    assert_eq!(b, [0x42; 64], "read from the client through DMA_READ");
    let fl = flat.lock().expect("lock");
    assert!(
        fl.mem[0x8000..0x8000 + (3 << 20 >> 4)]
            .chunks(4)
            .all(|c| c == [0xfe, 0xca, 0xad, 0x0b])
    );
    drop(fl);
    assert!(d.t.0.dma_requests_served() > 0);
}

#[test]
fn dirty_bitmap_on_unmap_reports_device_writes() {
    let server = ServerProcess::start("softgpu");
    let mut d = Driver::new(Ours(connect(&server)));
    d.setup_queue(0);
    // Outside a logging session nothing is logged: every page of the window is reported.
    let all =
        d.t.0
            .dma_unmap_dirty(GUEST_IOVA, common::driver::WINDOW_SIZE, 4096)
            .expect("unmap");
    assert_eq!(
        set_pages(&all).len() as u64,
        common::driver::WINDOW_SIZE / 4096,
        "never logged: all dirty"
    );
    d.t.0.dma_logging_start(4096, &[]).expect("start logging");
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    d.t.0
        .dma_map(
            GUEST_IOVA,
            common::driver::WINDOW_SIZE,
            flags,
            Some((d.mem.file.as_fd(), 0)),
        )
        .expect("remap");
    d.run(
        0,
        &[
            Command::fill(guest(0x30_0000 + 5), 10, 1),
            Command::fill(guest(0x31_0000), 4096 * 2, 2),
        ],
    );
    let bitmap =
        d.t.0
            .dma_unmap_dirty(GUEST_IOVA, common::driver::WINDOW_SIZE, 4096)
            .expect("unmap dirty");
    let dirty: Vec<usize> = (0..bitmap.len() * 8)
        .filter(|&i| bitmap[i / 8] & (1 << (i % 8)) != 0)
        .collect();
    // Ring page (engine reads only) is not dirty; the fill targets are.
    assert_eq!(dirty, vec![0x300, 0x310, 0x311], "dirty pages {dirty:x?}");
}

fn set_pages(bitmap: &[u8]) -> Vec<usize> {
    (0..bitmap.len() * 8)
        .filter(|&i| bitmap[i / 8] & (1 << (i % 8)) != 0)
        .collect()
}

#[test]
fn dma_logging_reports_what_the_device_wrote() {
    let server = ServerProcess::start("softgpu");
    let mut d = Driver::new(Ours(connect(&server)));
    d.setup_queue(0);
    let c = &mut d.t.0;
    // PROBE: the three logging features with their own op, migration not at all.
    c.feature_probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_START, false, true)
        .expect("probe start");
    c.feature_probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, false, true)
        .expect("probe stop");
    c.feature_probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, true, false)
        .expect("probe report");
    let e = c
        .feature_probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, false, true)
        .expect_err("report is GET only");
    assert_eq!(e.remote_errno(), Some(libc::EINVAL));
    let e = c
        .dma_logging_report(GUEST_IOVA, WINDOW_SIZE, 4096)
        .expect_err("no session yet");
    assert_eq!(e.remote_errno(), Some(libc::EINVAL));

    assert_eq!(c.dma_logging_start(4096, &[]).expect("start"), 4096);
    let e = c.dma_logging_start(4096, &[]).expect_err("started twice");
    assert_eq!(e.remote_errno(), Some(libc::EBUSY));
    d.run(
        0,
        &[
            Command::fill(guest(0x30_0000 + 5), 10, 1),
            Command::fill(guest(0x31_0000), 4096 * 2, 2),
            // Crosses into the second window.
            Command::fill(guest(WINDOW_SIZE - 4), 8, 3),
        ],
    );
    let c = &mut d.t.0;
    // Part of window 0 first: only its pages come back, the rest stays logged.
    let part = c
        .dma_logging_report(GUEST_IOVA + 0x31_0000, 0x1_0000, 4096)
        .expect("partial report");
    assert_eq!(set_pages(&part), [0, 1]);
    // Both windows in one report, at 8 KiB pages.
    let all = c
        .dma_logging_report(GUEST_IOVA, 2 * WINDOW_SIZE, 8192)
        .expect("report");
    let last = (WINDOW_SIZE / 8192) as usize;
    assert_eq!(
        set_pages(&all),
        [0x180, last - 1, last],
        "ring pages are only read"
    );
    let again = c
        .dma_logging_report(GUEST_IOVA, 2 * WINDOW_SIZE, 4096)
        .expect("report again");
    assert!(set_pages(&again).is_empty(), "a report reads and clears");
    c.dma_logging_stop().expect("stop");
    let e = c
        .dma_logging_report(GUEST_IOVA, WINDOW_SIZE, 4096)
        .expect_err("stopped");
    assert_eq!(e.remote_errno(), Some(libc::EINVAL));
    // A new session after STOP; a disconnect ends it.
    c.dma_logging_start(4096, &[]).expect("restart");
    drop(d);
    let mut c = connect(&server);
    let e = c
        .dma_logging_report(GUEST_IOVA, WINDOW_SIZE, 4096)
        .expect_err("session ended with the client");
    assert_eq!(e.remote_errno(), Some(libc::EINVAL));
    c.dma_logging_start(4096, &[])
        .expect("a new client starts its own session");
}

#[test]
fn interrupt_masking_through_set_irqs() {
    let server = ServerProcess::start("softgpu");
    let mut d = Driver::new(Ours(connect(&server)));
    d.setup_queue(0);
    d.t.0
        .set_irqs(
            VFIO_PCI_MSIX_IRQ_INDEX,
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_MASK,
            3,
            1,
            &[],
        )
        .expect("mask");
    d.run(0, &[Command::fence(guest(0x100), 1, Some(3))]);
    assert!(
        switchyard_device::irq::take_eventfd(&d.completion[3]).is_none(),
        "masked"
    );
    d.t.0
        .set_irqs(
            VFIO_PCI_MSIX_IRQ_INDEX,
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_UNMASK,
            3,
            1,
            &[],
        )
        .expect("unmask");
    assert!(
        wait_eventfd(&d.completion[3], Duration::from_secs(5)).is_some(),
        "pending delivered on unmask"
    );
    // De-assign: no more signals.
    d.t.0
        .set_irqs(
            VFIO_PCI_MSIX_IRQ_INDEX,
            VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
            0,
            0,
            &[],
        )
        .expect("disable all");
    d.run(0, &[Command::fence(guest(0x100), 2, Some(3))]);
    assert!(
        switchyard_device::irq::take_eventfd(&d.completion[3]).is_none(),
        "disabled"
    );
}

#[test]
fn config_space_bar_sizing_and_flr() {
    let server = ServerProcess::start("softgpu,vram=128M");
    let mut d = Driver::new(Ours(connect(&server)));
    let rd = |d: &mut Driver<Ours>, off: u64| d.cfg32(off);
    d.t.region_write(CONFIG, 0x10, &u32::MAX.to_le_bytes());
    assert_eq!(
        rd(&mut d, 0x10),
        !(64u32 * 1024 - 1) & !0xf,
        "BAR0: 64 KiB, 32-bit MMIO"
    );
    d.t.region_write(CONFIG, 0x18, &u32::MAX.to_le_bytes());
    d.t.region_write(CONFIG, 0x1c, &u32::MAX.to_le_bytes());
    let lo = rd(&mut d, 0x18);
    assert_eq!(lo & 0xf, 0b1100, "BAR2: 64-bit prefetchable");
    let size = !((u64::from(rd(&mut d, 0x1c)) << 32) | u64::from(lo & !0xf)) + 1;
    assert_eq!(size, 128 << 20);
    // Read-only identity.
    d.t.region_write(CONFIG, 0, &u32::MAX.to_le_bytes());
    assert_eq!(rd(&mut d, 0), 0x5347_1234);
    // FLR through the PCI Express capability returns the device to power-on.
    d.w32(SCRATCH, 0x77);
    let exp = d.find_cap(0x10).expect("PCIe cap");
    let devcap = rd(&mut d, exp + 4);
    assert_ne!(devcap & (1 << 28), 0, "FLR capable");
    let ctl = d.cfg16(exp + 8) | 0x8000;
    d.t.region_write(CONFIG, exp + 8, &ctl.to_le_bytes());
    assert_eq!(d.r32(SCRATCH), 0, "FLR reset the registers");
    assert_eq!(
        d.cfg16(0x04) & 0x6,
        0,
        "FLR cleared memory/bus-master enable"
    );
}

/// `serve --dirty-log off`: the logging features are not offered (ENOTTY, as a device without
/// logging answers). `--dirty-log blind` (fault injection): offered and started, but a report
/// after the device wrote guest memory says nothing is dirty.
#[test]
fn dirty_logging_can_be_withheld_or_blinded() {
    let server = ServerProcess::start_with(&["--device", "softgpu", "--dirty-log", "off"]);
    let mut c = connect(&server);
    for (feature, get, set) in [
        (VFIO_DEVICE_FEATURE_DMA_LOGGING_START, false, true),
        (VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, true, false),
    ] {
        let e = c.feature_probe(feature, get, set).expect_err("not offered");
        assert_eq!(e.remote_errno(), Some(libc::ENOTTY));
    }
    let e = c.dma_logging_start(4096, &[]).expect_err("not offered");
    assert_eq!(e.remote_errno(), Some(libc::ENOTTY));
    drop(c);

    let server = ServerProcess::start_with(&["--device", "softgpu", "--dirty-log", "blind"]);
    let mut d = Driver::new(Ours(connect(&server)));
    d.setup_queue(0);
    let c = &mut d.t.0;
    c.feature_probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, true, false)
        .expect("offered");
    assert_eq!(c.dma_logging_start(4096, &[]).expect("start"), 4096);
    d.run(0, &[Command::fill(guest(0x31_0000), 4096 * 2, 2)]);
    assert_eq!(
        d.read_f32s(0x31_0000, 1)[0].to_bits(),
        2,
        "the device wrote guest memory"
    );
    let c = &mut d.t.0;
    let report = c
        .dma_logging_report(GUEST_IOVA, WINDOW_SIZE, 4096)
        .expect("report");
    assert!(
        set_pages(&report).is_empty(),
        "blind: {:?}",
        set_pages(&report)
    );
    c.dma_logging_stop().expect("stop");
}
