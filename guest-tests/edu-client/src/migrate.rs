//! `edu-client --migrate SRC DST`: a VFIO migration v2 of a passthrough device between two
//! servers, checked on both edus.

use std::fs::File;
use std::os::unix::fs::FileExt;

use switchyard_client::Client;
use switchyard_proto::consts::*;

use crate::edu::{EDU_BUFFER, EDU_LIVENESS, Edu, IOVA, MSI_INDEX, WINDOW, eventfd, memfd};
use crate::{Result, ensure};

fn mig_ok(step: &str, detail: impl std::fmt::Display) {
    println!("MIGRATE: {step} ok {detail}");
}

/// Sets an edu up as a guest driver would: BAR0 address, memory + bus master, MSI enabled with
/// `irq` as its eventfd, a DMA window of `mem` at [`IOVA`]. Returns the MSI capability offset.
fn configure(edu: &mut Edu, irq: &File, mem: &File) -> Result<u64> {
    edu.cfg_write(0x10, &0xfe90_0000u32.to_le_bytes())?;
    edu.cfg_write(0x04, &0x0006u16.to_le_bytes())?;
    let msi_cap = msi_capability(edu)?;
    let ctl = edu.cfg_read16(msi_cap + 2)?;
    edu.cfg_write(msi_cap + 4, &0xfee0_0000u32.to_le_bytes())?;
    edu.cfg_write(msi_cap + 2, &(ctl | 1).to_le_bytes())?;
    edu.set_eventfds(MSI_INDEX, 0, &[irq])?;
    edu.map(IOVA, WINDOW, true, mem)?;
    Ok(msi_cap)
}

fn msi_capability(edu: &mut Edu) -> Result<u64> {
    let caps = edu.capabilities()?;
    caps.iter()
        .find(|(id, _)| *id == 0x05)
        .map(|(_, o)| *o)
        .ok_or_else(|| format!("no MSI capability in {caps:?}"))
}

/// One DMA round trip through edu (RAM → edu → RAM at `IOVA + out`), verified.
fn dma_round_trip(edu: &mut Edu, mem: &File, irq: &File, seed: u8, out: u64) -> Result<()> {
    let pattern: Vec<u8> = (0..512u32)
        .map(|i| (i as u8).wrapping_mul(seed) ^ seed)
        .collect();
    mem.write_all_at(&pattern, 0)
        .map_err(|e| format!("memfd write: {e}"))?;
    let len = pattern.len() as u64;
    edu.dma(IOVA, EDU_BUFFER, len, false, irq)?;
    edu.dma(EDU_BUFFER, IOVA + out, len, true, irq)?;
    let mut back = vec![0u8; pattern.len()];
    mem.read_exact_at(&mut back, out)
        .map_err(|e| format!("memfd read: {e}"))?;
    ensure(back == pattern, || "DMA round trip differs".into())
}

/// `edu-client --migrate SRC DST`: a VFIO migration v2 of a passthrough device between two
/// servers (two edus): quiesce + reset + replay. The source edu is configured and used (DMA,
/// MSI) with DMA logging on (every mapped page reported dirty: the device has no dirty
/// tracking); the stream moves the client's configuration; the destination edu, reset, shows
/// the source's BAR address, COMMAND and MSI enable, and does DMA with its completion
/// interrupt once the client has mapped its memory and handed its eventfd over (as a VMM's
/// destination does before it resumes).
pub fn run_migrate(src_socket: &str, dst_socket: &str) -> Result<serde_json::Value> {
    use switchyard_client::migrate::Migration;
    let mut src = Edu {
        c: Client::connect(src_socket).map_err(|e| format!("connect {src_socket}: {e}"))?,
    };
    let mem = memfd("guest-ram", WINDOW)?;
    let irq = eventfd()?;
    let msi_cap = configure(&mut src, &irq, &mem)?;
    dma_round_trip(&mut src, &mem, &irq, 3, 0x1000)?;
    mig_ok("source", "configured, DMA and MSI verified");
    let page = src.log_window()?;
    dma_round_trip(&mut src, &mem, &irq, 5, 0x1000)?;

    let dst = Edu {
        c: Client::connect(dst_socket).map_err(|e| format!("connect {dst_socket}: {e}"))?,
    };
    let mut m = Migration::new(src.c, dst.c);
    m.ensure_supported(VFIO_MIGRATION_STOP_COPY)
        .map_err(|e| format!("migration support: {e}"))?;
    m.prepare_destination()
        .map_err(|e| format!("destination RESUMING: {e}"))?;
    let sw = m.switchover().map_err(|e| format!("switchover: {e}"))?;
    let (src_c, dst_c) = m.into_parts();
    let mut src = Edu { c: src_c };
    let mut dst = Edu { c: dst_c };
    let bitmap = src
        .c
        .dma_logging_report(IOVA, WINDOW, page)
        .map_err(|e| format!("DMA_LOGGING_REPORT: {e}"))?;
    let dirty: u32 = bitmap.iter().map(|b| b.count_ones()).sum();
    ensure(u64::from(dirty) == WINDOW / page, || {
        format!("{dirty} dirty pages, expected every mapped page")
    })?;
    mig_ok(
        "switchover",
        format!(
            "stream={} bytes downtime_us={} dirty={dirty}/{}",
            sw.stream.bytes,
            sw.downtime.as_micros(),
            WINDOW / page
        ),
    );

    // The destination shows the client's configuration, replayed onto a reset device.
    let bar0 = dst.cfg_read32(0x10)?;
    let command = dst.cfg_read16(0x04)?;
    let dst_msi = msi_capability(&mut dst)?;
    let msi_on = dst.cfg_read16(dst_msi + 2)? & 1 != 0;
    ensure(bar0 == 0xfe90_0000, || format!("BAR0 reads {bar0:#x}"))?;
    ensure(command & 0x6 == 0x6, || {
        format!("COMMAND reads {command:#x}")
    })?;
    ensure(msi_on && dst_msi == msi_cap, || {
        "MSI not enabled on the destination".into()
    })?;
    mig_ok(
        "replayed",
        format!("bar0={bar0:#x} command={command:#x} msi=on"),
    );
    // The destination VMM maps the guest's memory and routes its interrupt; the device runs
    // (bus mastering back on the hardware): DMA and its MSI work.
    let dst_irq = eventfd()?;
    dst.set_eventfds(MSI_INDEX, 0, &[&dst_irq])?;
    dst.map(IOVA, WINDOW, true, &mem)?;
    dma_round_trip(&mut dst, &mem, &dst_irq, 7, 0x1800)?;
    dst.wr32(EDU_LIVENESS, 0x0bad_cafe)?;
    let live = dst.rd32(EDU_LIVENESS)?;
    ensure(live == !0x0bad_cafeu32, || format!("liveness {live:#x}"))?;
    mig_ok(
        "destination",
        "DMA, MSI and registers work on the destination",
    );
    Ok(serde_json::json!({
        "result": "pass",
        "stream_bytes": sw.stream.bytes,
        "downtime_us": sw.downtime.as_micros() as u64,
        "dirty_pages": dirty,
        "bar0": format!("{bar0:#x}"),
        "command": format!("{command:#x}"),
    }))
}
