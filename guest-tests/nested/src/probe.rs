//! A VMM's first look at a device over vfio-user, from L1 with our client library: what a
//! device served through switchyard (a physical function or an SR-IOV VF behind VFIO) shows a
//! client. Identity and capabilities from config space, BAR0 sizing through the shadow, every
//! region's size and flags, the MSI-X capability against the IRQ info, and MSI-X routed to
//! eventfds and torn down again.

use std::os::fd::AsFd;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use switchyard_client::Client;
use switchyard_proto::consts::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_IRQ_SET_DATA_NONE,
};

/// VFIO's region and IRQ indexes for PCI.
const CONFIG_REGION: u32 = 7;
const MSIX_INDEX: u32 = 2;
const CAP_MSIX: u8 = 0x11;

fn le16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn le32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

/// The capability list of a 256-byte config space: `(id, offset)`, bounded against loops.
fn capabilities(cfg: &[u8]) -> Vec<(u8, u8)> {
    let mut caps = vec![];
    if le16(cfg, 6) & 0x10 == 0 {
        return caps;
    }
    let mut p = cfg[0x34] & 0xfc;
    while p >= 0x40 && caps.len() < 48 {
        caps.push((cfg[p as usize], p));
        p = cfg[p as usize + 1] & 0xfc;
    }
    caps
}

/// Probes the device behind `socket`; fails on anything a VMM could not work with.
pub fn probe(socket: &Path) -> Result<Value> {
    let mut c = Client::connect(socket).context("connect and negotiate")?;
    let info = c.device_info().context("DEVICE_GET_INFO")?;
    ensure!(
        info.num_regions > CONFIG_REGION,
        "{} regions",
        info.num_regions
    );
    let mut cfg = vec![0u8; 256];
    c.region_read(CONFIG_REGION, 0, &mut cfg)
        .context("config space read")?;
    let (vendor, device) = (le16(&cfg, 0), le16(&cfg, 2));
    let class = le32(&cfg, 8) >> 8;
    let caps = capabilities(&cfg);

    // BAR0 sizing the way a guest's firmware does it: all ones, read the mask, restore.
    let mut size_mask = |off: u64| -> Result<u32> {
        let mut orig = [0u8; 4];
        c.region_read(CONFIG_REGION, off, &mut orig)?;
        c.region_write(CONFIG_REGION, off, &u32::MAX.to_le_bytes())?;
        let mut m = [0u8; 4];
        c.region_read(CONFIG_REGION, off, &mut m)?;
        c.region_write(CONFIG_REGION, off, &orig)?;
        Ok(u32::from_le_bytes(m))
    };
    let lo = size_mask(0x10)?;
    let mem64 = lo & 0x7 == 0x4;
    let bar0_size = if lo & 1 == 0 && lo != 0 {
        let hi = if mem64 { size_mask(0x14)? } else { u32::MAX };
        let m = (u64::from(hi) << 32) | u64::from(lo & !0xf);
        (!m).wrapping_add(1)
    } else {
        0
    };

    let mut regions = vec![];
    for i in 0..info.num_regions {
        let r = c
            .region_info(i)
            .with_context(|| format!("region {i} info"))?;
        regions.push(json!({
            "index": i, "size": r.info.size, "flags": r.info.flags,
            "mmap_fd": r.fd.is_some(), "sparse_areas": r.sparse_areas.as_ref().map(Vec::len),
        }));
    }
    let region0 = c.region_info(0)?.info.size;
    ensure!(
        bar0_size == region0,
        "BAR0 sizes to {bar0_size:#x} but region 0 is {region0:#x}"
    );

    let msix = caps
        .iter()
        .find(|(id, _)| *id == CAP_MSIX)
        .map(|&(_, off)| {
            let ctl = le16(&cfg, off as usize + 2);
            (u32::from(ctl & 0x7ff) + 1, le32(&cfg, off as usize + 4) & 7)
        });
    let mut msix_routed = 0;
    if info.num_irqs > MSIX_INDEX {
        let irq = c.irq_info(MSIX_INDEX).context("MSI-X IRQ info")?;
        if let Some((table_size, _)) = msix {
            ensure!(
                irq.count == table_size,
                "MSI-X capability says {table_size} vectors, IRQ info {}",
                irq.count
            );
        }
        if irq.count > 0 {
            let fds: Vec<std::fs::File> = (0..irq.count)
                .map(|_| {
                    rustix::event::eventfd(
                        0,
                        rustix::event::EventfdFlags::NONBLOCK
                            | rustix::event::EventfdFlags::CLOEXEC,
                    )
                    .map(std::fs::File::from)
                })
                .collect::<rustix::io::Result<_>>()?;
            let borrowed: Vec<_> = fds.iter().map(AsFd::as_fd).collect();
            c.set_irqs(
                MSIX_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                irq.count,
                &borrowed,
            )
            .context("SET_IRQS MSI-X eventfds")?;
            c.set_irqs(
                MSIX_INDEX,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                0,
                &[],
            )
            .context("SET_IRQS MSI-X off")?;
            msix_routed = irq.count;
        }
    }
    Ok(json!({
        "vendor": format!("{vendor:04x}"),
        "device": format!("{device:04x}"),
        "class": format!("{class:06x}"),
        "capabilities": caps.iter().map(|(id, off)| format!("{id:#04x}@{off:#04x}")).collect::<Vec<_>>(),
        "bar0_size": bar0_size,
        "bar0_mem64": mem64,
        "regions": regions,
        "num_irqs": info.num_irqs,
        "msix_vectors": msix.map(|m| m.0),
        "msix_table_bir": msix.map(|m| m.1),
        "msix_routed": msix_routed,
        "device_flags": info.flags,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_walk_stops_on_loops_and_without_a_list() {
        let mut cfg = vec![0u8; 256];
        assert!(capabilities(&cfg).is_empty());
        cfg[6] = 0x10;
        cfg[0x34] = 0x40;
        cfg[0x40] = 0x01;
        cfg[0x41] = 0x50;
        cfg[0x50] = 0x11;
        cfg[0x51] = 0x40; // loops back
        let caps = capabilities(&cfg);
        assert_eq!(caps[..2], [(0x01, 0x40), (0x11, 0x50)]);
        assert_eq!(caps.len(), 48);
    }
}
