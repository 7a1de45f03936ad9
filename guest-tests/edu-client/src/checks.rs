//! The default run, `edu-client SOCKET` (device and region info, the virtualized config
//! space, edu's registers, MSI, DMA both ways, a read-only window, the dirty report, an fd-less
//! DMA_MAP refused, BAR0 through its mapping), and `--abandon` (see the crate documentation).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use switchyard_client::Client;
use switchyard_proto::consts::*;

use crate::edu::{
    BAR0, CONFIG, EDU_BUFFER, EDU_FACT, EDU_ID, EDU_IRQ_ACK, EDU_IRQ_RAISE, EDU_IRQ_STATUS,
    EDU_LIVENESS, EDU_STATUS, Edu, IOVA, IOVA_RO, MSI_INDEX, ROM, WINDOW, eventfd, memfd,
    wait_eventfd,
};
use crate::{Result, ensure};

fn ok(step: &str, detail: impl std::fmt::Display) {
    println!("EDU: {step} ok {detail}");
}

/// Maps BAR0's first sparse area from the descriptor the server sent with the region info
/// (the VFIO device descriptor itself) and touches edu's registers through the mapping.
fn mmap_bar0(bar0: &switchyard_client::RegionDescription) -> Result<()> {
    use vm_memory::mmap::MmapRegion;
    use vm_memory::{FileOffset, VolatileMemory};
    let fd = bar0
        .fd
        .as_ref()
        .ok_or("BAR0 is mappable but came without a descriptor")?;
    let area = bar0
        .sparse_areas
        .as_ref()
        .and_then(|a| a.first().copied())
        .ok_or("BAR0 is mappable but has no sparse area")?;
    ensure(area.offset == 0 && area.size >= 0x1000, || {
        format!("BAR0 sparse area {area:?}")
    })?;
    let file = fd.try_clone().map_err(|e| format!("dup: {e}"))?;
    let map: MmapRegion<()> = MmapRegion::from_file(
        FileOffset::new(file, bar0.info.offset + area.offset),
        area.size as usize,
    )
    .map_err(|e| format!("mmap BAR0: {e}"))?;
    let regs = map.as_volatile_slice();
    let reg = |off: u64| {
        regs.get_ref::<u32>(off as usize)
            .map_err(|e| format!("mapped register {off:#x}: {e}"))
    };
    let id = reg(EDU_ID)?.load();
    ensure(id & 0xffff == 0x00ed, || format!("mapped edu ID {id:#x}"))?;
    reg(EDU_LIVENESS)?.store(0x0bad_cafe_u32);
    let live = reg(EDU_LIVENESS)?.load();
    ensure(live == !0x0bad_cafe_u32, || {
        format!("mapped liveness {live:#x}")
    })?;
    ok(
        "bar0-mmap",
        format!(
            "area={:#x}+{:#x} id={id:#010x} ~0x0badcafe={live:#010x} (no message)",
            area.offset, area.size
        ),
    );
    Ok(())
}

/// The `--abandon` run (see the crate documentation).
pub fn run_abandon(socket: &str) -> Result<serde_json::Value> {
    let c = Client::connect(socket).map_err(|e| format!("connect {socket}: {e}"))?;
    let mut d = Edu { c };
    let mem = memfd("edu-abandon", WINDOW)?;
    d.map(IOVA, WINDOW, true, &mem)?;
    let irq = eventfd()?;
    d.set_eventfds(MSI_INDEX, 0, &[&irq])?;
    println!("ABANDON: left ok window {IOVA:#x}+{WINDOW:#x} mapped and the MSI eventfd set");
    Ok(serde_json::json!({"result": "pass"}))
}

pub fn run(socket: &str) -> Result<serde_json::Value> {
    let c = Client::connect(socket).map_err(|e| format!("connect {socket}: {e}"))?;
    let (major, minor) = c.server_version();
    ok("version", format!("{major}.{minor}"));
    let mut edu = Edu { c };

    // Device and regions.
    let info = edu
        .c
        .device_info()
        .map_err(|e| format!("device info: {e}"))?;
    ensure(
        info.flags & VFIO_DEVICE_FLAGS_PCI != 0 && info.num_regions >= 9 && info.num_irqs >= 5,
        || format!("device info {info:?}"),
    )?;
    ok(
        "device-info",
        format!(
            "flags={:#x} regions={} irqs={}",
            info.flags, info.num_regions, info.num_irqs
        ),
    );
    let bar0 = edu
        .c
        .region_info(BAR0)
        .map_err(|e| format!("region 0: {e}"))?;
    ensure(
        bar0.info.size == 1 << 20
            && bar0.info.flags & (VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE) == 3,
        || format!("BAR0 region {:?}", bar0.info),
    )?;
    let rom = edu
        .c
        .region_info(ROM)
        .map_err(|e| format!("region 6: {e}"))?;
    ensure(rom.info.size == 0, || format!("ROM region {:?}", rom.info))?;
    let cfg = edu
        .c
        .region_info(CONFIG)
        .map_err(|e| format!("region 7: {e}"))?;
    ensure(cfg.info.size >= 256, || {
        format!("config region {:?}", cfg.info)
    })?;
    ok(
        "region-info",
        format!(
            "bar0={:#x} mmap={} rom={} config={}",
            bar0.info.size,
            bar0.info.flags & VFIO_REGION_INFO_FLAG_MMAP != 0,
            rom.info.size,
            cfg.info.size
        ),
    );
    let intx = edu.c.irq_info(0).map_err(|e| format!("irq info 0: {e}"))?;
    let msi = edu
        .c
        .irq_info(MSI_INDEX)
        .map_err(|e| format!("irq info 1: {e}"))?;
    ensure(intx.count == 0 && msi.count == 1, || {
        format!("irqs: intx {intx:?} msi {msi:?}")
    })?;
    ok("irq-info", format!("intx={} msi={}", intx.count, msi.count));

    // Config space.
    let ids = edu.cfg_read32(0)?;
    ensure(ids == 0x11e8_1234, || format!("IDs {ids:#x}"))?;
    edu.cfg_write(0x10, &0xffff_ffffu32.to_le_bytes())?;
    let sized = edu.cfg_read32(0x10)?;
    ensure(sized == 0xfff0_0000, || {
        format!("BAR0 sizing reads {sized:#x}")
    })?;
    edu.cfg_write(0x10, &0xfe00_0000u32.to_le_bytes())?;
    let addr = edu.cfg_read32(0x10)?;
    ensure(addr == 0xfe00_0000, || {
        format!("BAR0 address reads {addr:#x}")
    })?;
    edu.cfg_write(0x30, &0xffff_ffffu32.to_le_bytes())?;
    let rom_bar = edu.cfg_read32(0x30)?;
    ensure(rom_bar == 0, || format!("ROM BAR reads {rom_bar:#x}"))?;
    let pin = (edu.cfg_read32(0x3c)? >> 8) as u8;
    ensure(pin == 0, || format!("interrupt pin {pin}"))?;
    let caps = edu.capabilities()?;
    let msi_cap = caps
        .iter()
        .find(|(id, _)| *id == 0x05)
        .map(|(_, o)| *o)
        .ok_or_else(|| format!("no MSI capability in {caps:?}"))?;
    ok(
        "config",
        format!(
            "ids={ids:#010x} bar0-sizing={sized:#010x} rom-bar={rom_bar:#x} caps={:?}",
            caps.iter()
                .map(|(id, o)| format!("{id:#04x}@{o:#x}"))
                .collect::<Vec<_>>()
        ),
    );
    // Memory space and bus master (these reach the device).
    edu.cfg_write(0x04, &0x0006u16.to_le_bytes())?;
    let mut mapped = false;
    if bar0.info.flags & VFIO_REGION_INFO_FLAG_MMAP != 0 {
        mmap_bar0(&bar0)?;
        mapped = true;
    }

    // Registers.
    let id = edu.rd32(EDU_ID)?;
    ensure(id & 0xffff == 0x00ed, || format!("edu ID {id:#x}"))?;
    edu.wr32(EDU_LIVENESS, 0x1234_5678)?;
    let live = edu.rd32(EDU_LIVENESS)?;
    ensure(live == !0x1234_5678u32, || {
        format!("liveness reads {live:#x}")
    })?;
    ok(
        "liveness",
        format!("id={id:#010x} ~0x12345678={live:#010x}"),
    );
    edu.wr32(EDU_FACT, 10)?;
    let deadline = Instant::now() + Duration::from_secs(5);
    while edu.rd32(EDU_STATUS)? & 1 != 0 {
        ensure(Instant::now() < deadline, || {
            "factorial busy for 5 s".into()
        })?;
        std::thread::sleep(Duration::from_millis(1));
    }
    let fact = edu.rd32(EDU_FACT)?;
    ensure(fact == 3_628_800, || format!("10! reads {fact}"))?;
    ok("factorial", format!("10!={fact}"));

    // MSI: the client's side of the capability (emulated), then its eventfd to the kernel.
    let ctl = edu.cfg_read16(msi_cap + 2)?;
    let addr64 = ctl & 0x80 != 0;
    edu.cfg_write(msi_cap + 4, &0xfee0_0000u32.to_le_bytes())?;
    let data_off = if addr64 { 12 } else { 8 };
    edu.cfg_write(msi_cap + data_off, &0x0041u16.to_le_bytes())?;
    edu.cfg_write(msi_cap + 2, &(ctl | 1).to_le_bytes())?;
    let enabled = edu.cfg_read16(msi_cap + 2)? & 1 != 0;
    ensure(enabled, || "MSI enable did not stick in the shadow".into())?;
    let irq = eventfd()?;
    edu.set_eventfds(MSI_INDEX, 0, &[&irq])?;
    edu.wr32(EDU_IRQ_RAISE, 0x5)?;
    let t0 = Instant::now();
    let n = wait_eventfd(&irq, Duration::from_secs(5))?;
    let latency_us = t0.elapsed().as_micros() as u64;
    let status = edu.rd32(EDU_IRQ_STATUS)?;
    ensure(status & 0x5 == 0x5, || format!("irq status {status:#x}"))?;
    edu.wr32(EDU_IRQ_ACK, 0x5)?;
    let after = edu.rd32(EDU_IRQ_STATUS)?;
    ensure(after & 0x5 == 0, || {
        format!("irq status after ack {after:#x}")
    })?;
    ok(
        "msi",
        format!(
            "eventfd count={n} status={status:#x} after-ack={after:#x} latency_us={latency_us}"
        ),
    );

    // DMA through the device's IOMMU.
    let mem = memfd("edu-dma", WINDOW)?;
    let pattern: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
    mem.write_all_at(&pattern, 0)
        .map_err(|e| format!("memfd write: {e}"))?;
    edu.map(IOVA, WINDOW, true, &mem)?;
    ok("dma-map", format!("iova={IOVA:#x} size={WINDOW:#x}"));
    let len = pattern.len() as u64;
    // RAM → edu buffer, then edu buffer → the second page.
    edu.dma(IOVA, EDU_BUFFER, len, false, &irq)?;
    edu.dma(EDU_BUFFER, IOVA + 0x1000, len, true, &irq)?;
    let mut back = vec![0u8; pattern.len()];
    mem.read_exact_at(&mut back, 0x1000)
        .map_err(|e| format!("memfd read: {e}"))?;
    ensure(back == pattern, || {
        let first = back.iter().zip(&pattern).position(|(a, b)| a != b);
        format!("DMA round trip differs at byte {first:?}")
    })?;
    // A second pattern the other way round: what edu wrote to RAM goes back through it.
    let pattern2: Vec<u8> = pattern.iter().map(|b| !b).collect();
    mem.write_all_at(&pattern2, 0x1000)
        .map_err(|e| format!("memfd write: {e}"))?;
    edu.dma(IOVA + 0x1000, EDU_BUFFER, len, false, &irq)?;
    edu.dma(EDU_BUFFER, IOVA + 0x200, len, true, &irq)?;
    let mut back2 = vec![0u8; pattern2.len()];
    mem.read_exact_at(&mut back2, 0x200)
        .map_err(|e| format!("memfd read: {e}"))?;
    ensure(back2 == pattern2, || "second DMA round trip differs".into())?;
    ok(
        "dma",
        format!("{len} bytes RAM->edu->RAM twice, both verified, completion MSIs received"),
    );

    // A read-only window (from a read-only descriptor): the device reads it, cannot write it.
    let ro_mem = memfd("edu-ro", 0x1000)?;
    let pattern3: Vec<u8> = (0..1024u32).map(|i| (i * 13 + 1) as u8).collect();
    ro_mem
        .write_all_at(&pattern3, 0)
        .map_err(|e| format!("memfd write: {e}"))?;
    let ro_fd = File::open(format!("/proc/self/fd/{}", ro_mem.as_raw_fd()))
        .map_err(|e| format!("reopen read-only: {e}"))?;
    edu.map(IOVA_RO, 0x1000, false, &ro_fd)?;
    edu.dma(IOVA_RO, EDU_BUFFER, len, false, &irq)?;
    edu.dma(EDU_BUFFER, IOVA + 0x400, len, true, &irq)?;
    let mut back3 = vec![0u8; pattern3.len()];
    mem.read_exact_at(&mut back3, 0x400)
        .map_err(|e| format!("memfd read: {e}"))?;
    ensure(back3 == pattern3, || {
        "read-only window: DMA read differs".into()
    })?;
    // Load edu's buffer with the first pattern (not the window's), then have edu write it into
    // the read-only window: the IOMMU refuses the write and the window's bytes stay.
    edu.dma(IOVA, EDU_BUFFER, len, false, &irq)?;
    edu.dma(EDU_BUFFER, IOVA_RO, len, true, &irq)?;
    let mut still = vec![0u8; pattern3.len()];
    ro_mem
        .read_exact_at(&mut still, 0)
        .map_err(|e| format!("memfd read: {e}"))?;
    ensure(still == pattern3, || {
        "the device wrote a read-only window".into()
    })?;
    edu.c
        .dma_unmap(IOVA_RO, 0x1000, 0)
        .map_err(|e| format!("DMA_UNMAP read-only: {e}"))?;
    ok(
        "dma-read-only",
        "read-only window read by the device; its write was blocked by the IOMMU",
    );

    // Dirty pages: DMA logging over the window reports every mapped page.
    let page = edu.log_window()?;
    let bitmap = edu
        .c
        .dma_logging_report(IOVA, WINDOW, page)
        .map_err(|e| format!("DMA_LOGGING_REPORT: {e}"))?;
    let dirty: u32 = bitmap.iter().map(|b| b.count_ones()).sum();
    ensure(dirty as u64 == WINDOW / page, || {
        format!("{dirty} dirty pages reported, expected {}", WINDOW / page)
    })?;
    edu.c
        .dma_logging_stop()
        .map_err(|e| format!("DMA_LOGGING_STOP: {e}"))?;
    ok(
        "dirty",
        format!("{dirty}/{} pages reported dirty", WINDOW / page),
    );

    // A window without a descriptor cannot be reached by a physical device.
    let refused = edu.c.dma_map(
        0x0080_0000,
        0x1000,
        VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE,
        None,
    );
    let errno = refused.as_ref().err().and_then(|e| e.remote_errno());
    ensure(errno == Some(95), || {
        format!("fd-less DMA_MAP: {refused:?}")
    })?;
    ok("dma-map-without-fd", "refused errno=95 (ENOTSUP)");

    edu.c
        .dma_unmap(IOVA, WINDOW, 0)
        .map_err(|e| format!("DMA_UNMAP: {e}"))?;
    ok("dma-unmap", "");
    edu.disable_irqs(MSI_INDEX)?;
    ok("msi-disable", "");

    Ok(serde_json::json!({
        "result": "pass",
        "ids": format!("{ids:#010x}"),
        "bar0_size": bar0.info.size,
        "bar0_mmap": mapped,
        "msi_latency_us": latency_us,
        "dma_bytes": len * 4,
        "dirty_pages": dirty,
    }))
}
