//! `edu-client --nvme SOCKET`: QEMU's NVMe controller driven far enough for real MSI-X
//! interrupts, delivered and held back by the emulated table's mask (see the crate
//! documentation).

use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use switchyard_client::Client;

use crate::edu::{Edu, IOVA, MSIX_INDEX, eventfd, memfd, wait_eventfd};
use crate::{Result, ensure};

fn nvme_ok(step: &str, detail: impl std::fmt::Display) {
    println!("NVME: {step} ok {detail}");
}

/// The `--nvme` run (see the crate documentation).
pub fn run_nvme(socket: &str) -> Result<serde_json::Value> {
    const CAP: u64 = 0x00;
    const CC: u64 = 0x14;
    const CSTS: u64 = 0x1c;
    const AQA: u64 = 0x24;
    const ASQ: u64 = 0x28;
    const ACQ: u64 = 0x30;
    const SQ_IOVA: u64 = IOVA;
    const CQ_IOVA: u64 = IOVA + 0x1000;
    const DATA_IOVA: u64 = IOVA + 0x2000;
    let c = Client::connect(socket).map_err(|e| format!("connect {socket}: {e}"))?;
    let mut d = Edu { c };
    let caps = d.capabilities()?;
    let msix_cap = caps
        .iter()
        .find(|(id, _)| *id == 0x11)
        .map(|(_, o)| *o)
        .ok_or_else(|| format!("no MSI-X capability in {caps:?}"))?;
    let table = d.cfg_read32(msix_cap + 4)?;
    let pba = d.cfg_read32(msix_cap + 8)?;
    let (tbar, toff) = (table & 7, u64::from(table & !7));
    let (pbar, poff) = (pba & 7, u64::from(pba & !7));
    ensure(tbar == 0 && pbar == 0, || {
        format!("MSI-X table in BAR{tbar}, PBA in BAR{pbar}")
    })?;

    // DMA: submission queue, completion queue, data page.
    let mem = memfd("nvme-dma", 0x3000)?;
    d.map(IOVA, 0x3000, true, &mem)?;

    // MSI-X vector 0: written in the (emulated) table, enabled, its eventfd to the kernel.
    d.wr32(toff, 0xfee0_0000)?;
    d.wr32(toff + 4, 0)?;
    d.wr32(toff + 8, 0x51)?;
    d.wr32(toff + 12, 0)?;
    d.cfg_write(msix_cap + 2, &0x8000u16.to_le_bytes())?;
    d.cfg_write(0x04, &0x0006u16.to_le_bytes())?;
    let irq = eventfd()?;
    d.set_eventfds(MSIX_INDEX, 0, &[&irq])?;

    // Controller: disable, admin queues of 4 entries, enable.
    let cap = d.rd64(CAP)?;
    let stride = 4u64 << ((cap >> 32) & 0xf);
    let wait_rdy = |d: &mut Edu, want: u32| -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.rd32(CSTS)? & 1 != want {
            ensure(Instant::now() < deadline, || {
                format!("CSTS.RDY != {want} for 10 s")
            })?;
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    };
    d.wr32(CC, 0)?;
    wait_rdy(&mut d, 0)?;
    d.wr32(AQA, 0x0003_0003)?;
    d.wr64(ASQ, SQ_IOVA)?;
    d.wr64(ACQ, CQ_IOVA)?;
    d.wr32(CC, 0x0046_0001)?;
    wait_rdy(&mut d, 1)?;
    nvme_ok("enable", format!("cap={cap:#x} doorbell-stride={stride}"));

    // Submits Identify Controller with `cid` in slot `cid - 1` and rings the doorbell.
    let submit = |d: &mut Edu, cid: u16| -> Result<()> {
        let mut sqe = [0u8; 64];
        sqe[0] = 0x06;
        sqe[2..4].copy_from_slice(&cid.to_le_bytes());
        sqe[24..32].copy_from_slice(&DATA_IOVA.to_le_bytes());
        sqe[40..44].copy_from_slice(&1u32.to_le_bytes());
        mem.write_all_at(&sqe, u64::from(cid - 1) * 64)
            .map_err(|e| format!("SQE write: {e}"))?;
        d.wr32(0x1000, u32::from(cid))
    };
    // Waits for the completion of `cid` (phase 1) in the CQ in memory.
    let completion = |cid: u16| -> Result<u32> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut cqe = [0u8; 16];
            mem.read_exact_at(&mut cqe, 0x1000 + u64::from(cid - 1) * 16)
                .map_err(|e| format!("CQE read: {e}"))?;
            let dw3 = u32::from_le_bytes([cqe[12], cqe[13], cqe[14], cqe[15]]);
            if dw3 & 0x1_0000 != 0 {
                ensure(dw3 & 0xffff == u32::from(cid), || {
                    format!("CQE {dw3:#x} for CID {cid}")
                })?;
                return Ok(dw3 >> 17);
            }
            ensure(Instant::now() < deadline, || {
                format!("no completion for CID {cid}")
            })?;
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    submit(&mut d, 1)?;
    let t0 = Instant::now();
    let n = wait_eventfd(&irq, Duration::from_secs(10))?;
    let latency_us = t0.elapsed().as_micros() as u64;
    let status = completion(1)?;
    ensure(status == 0, || format!("Identify status {status:#x}"))?;
    let mut vid = [0u8; 2];
    mem.read_exact_at(&mut vid, 0x2000)
        .map_err(|e| format!("data read: {e}"))?;
    let vid = u16::from_le_bytes(vid);
    ensure(vid == 0x1b36, || format!("Identify VID {vid:#x}"))?;
    d.wr32(0x1000 + stride, 1)?;
    nvme_ok(
        "msix",
        format!(
            "Identify completed, vector 0 eventfd count={n} latency_us={latency_us} vid={vid:#06x}"
        ),
    );

    // Vector 0 masked in the table: the completion arrives, the interrupt does not, the PBA
    // says pending; unmasking delivers it.
    d.wr32(toff + 12, 1)?;
    submit(&mut d, 2)?;
    let status = completion(2)?;
    ensure(status == 0, || {
        format!("second Identify status {status:#x}")
    })?;
    std::thread::sleep(Duration::from_millis(200));
    let early = wait_eventfd(&irq, Duration::from_millis(1)).ok();
    ensure(early.is_none(), || {
        format!("a masked vector was signalled ({early:?})")
    })?;
    let mut pending = [0u8; 8];
    d.c.region_read(pbar, poff, &mut pending)
        .map_err(|e| format!("PBA read: {e}"))?;
    ensure(pending[0] & 1 == 1, || {
        format!("PBA {pending:?} while masked")
    })?;
    d.wr32(toff + 12, 0)?;
    let n = wait_eventfd(&irq, Duration::from_secs(5))?;
    d.c.region_read(pbar, poff, &mut pending)
        .map_err(|e| format!("PBA read: {e}"))?;
    ensure(pending[0] & 1 == 0, || {
        format!("PBA {pending:?} after unmask")
    })?;
    d.wr32(0x1000 + stride, 2)?;
    nvme_ok(
        "mask",
        format!(
            "masked: completion posted, no signal, PBA bit 0 set; unmasked: delivered (count={n}), PBA clear"
        ),
    );

    d.wr32(CC, 0)?;
    wait_rdy(&mut d, 0)?;
    d.disable_irqs(MSIX_INDEX)?;
    d.c.dma_unmap(IOVA, 0x3000, 0)
        .map_err(|e| format!("DMA_UNMAP: {e}"))?;
    nvme_ok("disable", "");
    Ok(serde_json::json!({
        "result": "pass",
        "vid": format!("{vid:#06x}"),
        "msix_latency_us": latency_us,
    }))
}
