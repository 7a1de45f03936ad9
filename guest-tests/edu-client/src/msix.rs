//! `edu-client --msix SOCKET`: a device with MSI-X behind a PCIe port as the client sees it
//! (the capability list, the emulated table and PBA, eventfds to the kernel, masking, the
//! trapped table page, reset; see the crate documentation).

use switchyard_client::Client;
use switchyard_proto::consts::*;

use crate::edu::{CONFIG, Edu, MSIX_INDEX, eventfd};
use crate::{Result, ensure};

fn msix_ok(step: &str, detail: impl std::fmt::Display) {
    println!("MSIX: {step} ok {detail}");
}

/// The `--msix` probe (see the crate documentation).
pub fn run_msix(socket: &str) -> Result<serde_json::Value> {
    let c = Client::connect(socket).map_err(|e| format!("connect {socket}: {e}"))?;
    let mut d = Edu { c };
    let info = d.c.device_info().map_err(|e| format!("device info: {e}"))?;
    let cfg =
        d.c.region_info(CONFIG)
            .map_err(|e| format!("region 7: {e}"))?;
    let ids = d.cfg_read32(0)?;
    let caps = d.capabilities()?;
    let find = |id: u8| caps.iter().find(|(i, _)| *i == id).map(|(_, o)| *o);
    let msix_cap = find(0x11).ok_or_else(|| format!("no MSI-X capability in {caps:?}"))?;
    ensure(find(0x10).is_some(), || {
        format!("no PCI Express capability in {caps:?}")
    })?;
    ensure(find(0x09).is_none(), || {
        format!("a vendor capability is visible: {caps:?}")
    })?;
    let ext = if cfg.info.size > 256 {
        d.cfg_read32(0x100)?
    } else {
        0
    };
    ensure(ext == 0, || format!("extended capability header {ext:#x}"))?;
    msix_ok(
        "config",
        format!(
            "ids={ids:#010x} config={} caps={:?} ext={ext:#x}",
            cfg.info.size,
            caps.iter()
                .map(|(id, o)| format!("{id:#04x}@{o:#x}"))
                .collect::<Vec<_>>()
        ),
    );

    let ctl = d.cfg_read16(msix_cap + 2)?;
    let vectors = u32::from(ctl & 0x7ff) + 1;
    let table = d.cfg_read32(msix_cap + 4)?;
    let pba = d.cfg_read32(msix_cap + 8)?;
    let (tbar, toff) = (table & 7, u64::from(table & !7));
    let (pbar, poff) = (pba & 7, u64::from(pba & !7));
    let irq = d.c.irq_info(2).map_err(|e| format!("irq info 2: {e}"))?;
    ensure(irq.count == vectors && vectors >= 2, || {
        format!("MSI-X irq info {irq:?}, capability says {vectors}")
    })?;
    ensure(ctl & 0xc000 == 0, || {
        format!("MSI-X starts enabled: {ctl:#x}")
    })?;
    msix_ok(
        "msix-cap",
        format!("vectors={vectors} table=bar{tbar}+{toff:#x} pba=bar{pbar}+{poff:#x}"),
    );
    let treg =
        d.c.region_info(tbar)
            .map_err(|e| format!("region {tbar}: {e}"))?;
    let mut sparse = "none".to_owned();
    if treg.info.flags & VFIO_REGION_INFO_FLAG_MMAP != 0 {
        let areas = treg.sparse_areas.clone().unwrap_or_default();
        let page = toff / 4096 * 4096;
        ensure(
            !areas.is_empty()
                && areas
                    .iter()
                    .all(|a| a.offset + a.size <= page || a.offset >= page + 4096),
            || format!("the table page is offered for mmap: {areas:?}"),
        )?;
        sparse = format!("{areas:?}");
    }
    msix_ok("table-trapped", format!("bar{tbar} mmap areas {sparse}"));

    // Memory space on; the table is emulated: masked at power-on, written and read back.
    d.cfg_write(0x04, &0x0006u16.to_le_bytes())?;
    let bar_read = |d: &mut Edu, off: u64| -> Result<u32> {
        let mut b = [0u8; 4];
        d.c.region_read(tbar, off, &mut b)
            .map_err(|e| format!("table read {off:#x}: {e}"))?;
        Ok(u32::from_le_bytes(b))
    };
    let bar_write = |d: &mut Edu, off: u64, v: u32| -> Result<()> {
        d.c.region_write(tbar, off, &v.to_le_bytes())
            .map_err(|e| format!("table write {off:#x}: {e}"))
    };
    let ctrl0 = bar_read(&mut d, toff + 12)?;
    ensure(ctrl0 == 1, || {
        format!("vector 0 control at power-on {ctrl0:#x}")
    })?;
    for v in 0..2u64 {
        bar_write(&mut d, toff + 16 * v, 0xfee0_0000)?;
        bar_write(&mut d, toff + 16 * v + 8, 0x40 + v as u32)?;
        bar_write(&mut d, toff + 16 * v + 12, 0)?;
    }
    let data1 = bar_read(&mut d, toff + 16 + 8)?;
    ensure(data1 == 0x41, || format!("vector 1 data reads {data1:#x}"))?;
    d.cfg_write(msix_cap + 2, &0x8000u16.to_le_bytes())?;
    msix_ok(
        "table",
        "masked at power-on, entries written and read back, MSI-X enabled",
    );

    let fds = [eventfd()?, eventfd()?];
    d.set_eventfds(MSIX_INDEX, 0, &[&fds[0], &fds[1]])?;
    let extra = eventfd()?;
    d.set_eventfds(MSIX_INDEX, 1, &[&extra])?;
    msix_ok(
        "set-irqs",
        "vectors 0..2 handed to the kernel, then vector 1 replaced",
    );
    // Mask vector 0 in the table (its kernel eventfd is parked), read the PBA, unmask.
    bar_write(&mut d, toff + 12, 1)?;
    let mut pending = [0u8; 8];
    let pba_region = pbar;
    d.c.region_read(pba_region, poff, &mut pending)
        .map_err(|e| format!("PBA read: {e}"))?;
    bar_write(&mut d, toff + 12, 0)?;
    // The function mask parks every vector at once, and lifting it restores them.
    d.cfg_write(msix_cap + 2, &0xc000u16.to_le_bytes())?;
    d.cfg_write(msix_cap + 2, &0x8000u16.to_le_bytes())?;
    msix_ok(
        "mask",
        format!(
            "vector 0 masked/unmasked, function mask set/cleared, pba={:#x}",
            u64::from_le_bytes(pending)
        ),
    );

    let mut reset = false;
    if info.flags & VFIO_DEVICE_FLAGS_RESET != 0 {
        d.c.device_reset()
            .map_err(|e| format!("DEVICE_RESET: {e}"))?;
        let again = d.cfg_read32(0)?;
        let cmd = d.cfg_read16(0x04)?;
        ensure(again == ids && cmd & 0x0002 != 0, || {
            format!("after reset: ids {again:#x} command {cmd:#x}")
        })?;
        reset = true;
        msix_ok("reset", format!("ids={again:#010x} command={cmd:#06x}"));
    }
    d.disable_irqs(MSIX_INDEX)?;
    msix_ok("disable", "");
    Ok(serde_json::json!({
        "result": "pass",
        "ids": format!("{ids:#010x}"),
        "vectors": vectors,
        "config_size": cfg.info.size,
        "reset": reset,
    }))
}
