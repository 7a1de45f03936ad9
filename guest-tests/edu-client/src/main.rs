//! `edu-client SOCKET`: drives QEMU's `edu` device (1234:11e8) through a `switchyard serve
//! --device vfio,host=BDF` server on SOCKET, over vfio-user with our client library, and checks
//! what a physical-device backend must get right:
//!
//! - VERSION, DEVICE_GET_INFO, REGION_INFO (BAR0 1 MiB, no ROM, config space);
//! - the virtualized config space: IDs, BAR0 sizing (all-ones reads back the 1 MiB mask, the
//!   address stays in the shadow), the ROM BAR reads 0, INTx pin 0, the capability list;
//! - edu's registers through trapped BAR0 accesses: ID, liveness (0x04 reads back inverted),
//!   factorial (0x08, busy bit 0 of status 0x20);
//! - MSI: an eventfd handed over SET_IRQS is signalled by the host kernel when edu raises an
//!   interrupt (raise 0x60, status 0x24, ack 0x64);
//! - DMA: a memfd DMA_MAPped at an IOVA below edu's 28-bit DMA mask; edu's DMA engine (src
//!   0x80, dst 0x88, count 0x90, cmd 0x98) copies bytes into its buffer (0x40000) and back to
//!   another place of the memfd, verified, with its completion interrupt;
//! - a read-only DMA window (from a read-only descriptor): edu reads it, and its write to it is
//!   blocked by the IOMMU (the bytes stay);
//! - the DMA dirty report: every mapped page reads dirty (the device cannot track its writes);
//! - a DMA_MAP without a file descriptor is refused with ENOTSUP;
//! - with `bars=mmap`: BAR0 comes with the device's descriptor and a sparse area; the client
//!   maps it and reaches edu's registers without a message (ID, liveness).
//!
//! `edu-client --msix SOCKET` instead probes a device with MSI-X behind a PCIe port (the guest
//! test uses `virtio-rng-pci`): the PCI Express capability kept and vendor-specific ones
//! hidden, no extended capability, the emulated MSI-X table (masked at power-on, written and
//! read back), MSI-X eventfds handed to the kernel (all vectors, then one), a vector masked
//! and unmasked through the table (its kernel eventfd parked and restored), the PBA, the
//! sparse mmap areas leaving the table's page trapped, and DEVICE_RESET (FLR) with the config
//! space still answering (`MSIX: <step> ok`, `MSIX-SUMMARY {json}`).
//!
//! `edu-client --nvme SOCKET` drives QEMU's NVMe controller (1b36:0010) far enough to get
//! real MSI-X interrupts: admin queues in a DMA_MAPped memfd, Identify Controller completing on
//! vector 0 (its eventfd signalled by the kernel), then the same with vector 0 masked in the
//! emulated table: no signal, the PBA bit set, and the interrupt delivered on unmask
//! (`NVME: <step> ok`, `NVME-SUMMARY {json}`).
//!
//! `edu-client --abandon SOCKET` maps the DMA window and hands an MSI eventfd over, then exits
//! without undoing either: the server must unmap the window from the IOMMU and take the
//! eventfd back from the kernel when the client is gone (the next client maps the same IOVA).
//!
//! `edu-client --conformance BDF` is not a client: it runs the device conformance suite
//! (`switchyard-conformance`) on the passthrough kind itself, in this process, on the device
//! at BDF (bound to vfio-pci, no server holding it): `CONFORMANCE: <check> ok` or
//! `CONFORMANCE: <check> FAIL <why>` per check, then `CONFORMANCE-SUMMARY {json}`; exit 0
//! only when every check passed.
//!
//! Prints `EDU: <step> ok ...` per step and `EDU-SUMMARY {json}` at the end; exit 0 when every
//! step passed, 1 at the first failure (`EDU: FAIL <step>: <why>`).

#![forbid(unsafe_code)]

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use switchyard_client::Client;
use switchyard_conformance::{Groups, Moves, Subject};
use switchyard_proto::DmaLoggingRange;
use switchyard_proto::consts::*;

const BAR0: u32 = 0;
const ROM: u32 = 6;
const CONFIG: u32 = 7;
const MSI_INDEX: u32 = 1;
const MSIX_INDEX: u32 = 2;

const EDU_ID: u64 = 0x00;
const EDU_LIVENESS: u64 = 0x04;
const EDU_FACT: u64 = 0x08;
const EDU_STATUS: u64 = 0x20;
const EDU_IRQ_STATUS: u64 = 0x24;
const EDU_IRQ_RAISE: u64 = 0x60;
const EDU_IRQ_ACK: u64 = 0x64;
const EDU_DMA_SRC: u64 = 0x80;
const EDU_DMA_DST: u64 = 0x88;
const EDU_DMA_COUNT: u64 = 0x90;
const EDU_DMA_CMD: u64 = 0x98;
const EDU_BUFFER: u64 = 0x40000;
/// edu raises this interrupt status bit when a DMA with the IRQ bit completes.
const EDU_DMA_IRQ: u32 = 0x100;

/// The client's DMA window: below edu's 28-bit DMA mask, 2 pages.
const IOVA: u64 = 0x0010_0000;
const WINDOW: u64 = 0x2000;
/// A read-only window, one page.
const IOVA_RO: u64 = 0x0020_0000;

type Result<T> = std::result::Result<T, String>;

fn ok(step: &str, detail: impl std::fmt::Display) {
    println!("EDU: {step} ok {detail}");
}

fn ensure(cond: bool, what: impl FnOnce() -> String) -> Result<()> {
    if cond { Ok(()) } else { Err(what()) }
}

struct Edu {
    c: Client,
}

impl Edu {
    fn cfg_read32(&mut self, off: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.c
            .region_read(CONFIG, off, &mut b)
            .map_err(|e| format!("config read {off:#x}: {e}"))?;
        Ok(u32::from_le_bytes(b))
    }

    fn cfg_read16(&mut self, off: u64) -> Result<u16> {
        let mut b = [0u8; 2];
        self.c
            .region_read(CONFIG, off, &mut b)
            .map_err(|e| format!("config read {off:#x}: {e}"))?;
        Ok(u16::from_le_bytes(b))
    }

    fn cfg_write(&mut self, off: u64, data: &[u8]) -> Result<()> {
        self.c
            .region_write(CONFIG, off, data)
            .map_err(|e| format!("config write {off:#x}: {e}"))
    }

    fn rd32(&mut self, off: u64) -> Result<u32> {
        let mut b = [0u8; 4];
        self.c
            .region_read(BAR0, off, &mut b)
            .map_err(|e| format!("BAR0 read {off:#x}: {e}"))?;
        Ok(u32::from_le_bytes(b))
    }

    fn wr32(&mut self, off: u64, v: u32) -> Result<()> {
        self.c
            .region_write(BAR0, off, &v.to_le_bytes())
            .map_err(|e| format!("BAR0 write {off:#x}: {e}"))
    }

    fn wr64(&mut self, off: u64, v: u64) -> Result<()> {
        self.c
            .region_write(BAR0, off, &v.to_le_bytes())
            .map_err(|e| format!("BAR0 write {off:#x}: {e}"))
    }

    fn rd64(&mut self, off: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.c
            .region_read(BAR0, off, &mut b)
            .map_err(|e| format!("BAR0 read {off:#x}: {e}"))?;
        Ok(u64::from_le_bytes(b))
    }

    /// DMA_MAP of all of `file` (`size` bytes) at `iova`, read/write or read-only.
    fn map(&mut self, iova: u64, size: u64, writable: bool, file: &File) -> Result<()> {
        let mut flags = VFIO_USER_F_DMA_REGION_READ;
        if writable {
            flags |= VFIO_USER_F_DMA_REGION_WRITE;
        }
        self.c
            .dma_map(iova, size, flags, Some((file.as_fd(), 0)))
            .map_err(|e| format!("DMA_MAP {iova:#x}: {e}"))
    }

    /// DMA_LOGGING_START over the window at [`IOVA`] with 4 KiB pages; the page size.
    fn log_window(&mut self) -> Result<u64> {
        self.c
            .dma_logging_start(
                4096,
                &[DmaLoggingRange {
                    iova: IOVA,
                    length: WINDOW,
                }],
            )
            .map_err(|e| format!("DMA_LOGGING_START: {e}"))
    }

    /// SET_IRQS: `fds` become the eventfds of vectors `start..` of `index`.
    fn set_eventfds(&mut self, index: u32, start: u32, fds: &[&File]) -> Result<()> {
        let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        self.c
            .set_irqs(
                index,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                start,
                fds.len() as u32,
                &borrowed,
            )
            .map_err(|e| format!("SET_IRQS {index} from {start}: {e}"))
    }

    /// SET_IRQS disabling `index`.
    fn disable_irqs(&mut self, index: u32) -> Result<()> {
        self.c
            .set_irqs(
                index,
                VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
                0,
                0,
                &[],
            )
            .map_err(|e| format!("SET_IRQS disable {index}: {e}"))
    }

    /// Offsets of the capabilities, by ID, walking the list the client sees.
    fn capabilities(&mut self) -> Result<Vec<(u8, u64)>> {
        let mut caps = vec![];
        let mut p = u64::from(self.cfg_read32(0x34)? as u8 & 0xfc);
        while p != 0 && caps.len() < 48 {
            let head = self.cfg_read16(p)?;
            caps.push((head as u8, p));
            p = u64::from((head >> 8) as u8 & 0xfc);
        }
        Ok(caps)
    }

    /// Starts one edu DMA and waits for it (bit 0 of the command clears), with its interrupt.
    fn dma(&mut self, src: u64, dst: u64, count: u64, to_ram: bool, irq: &File) -> Result<()> {
        self.wr64(EDU_DMA_SRC, src)?;
        self.wr64(EDU_DMA_DST, dst)?;
        self.wr64(EDU_DMA_COUNT, count)?;
        let cmd = 1 | if to_ram { 2 } else { 0 } | 4;
        self.wr64(EDU_DMA_CMD, cmd)?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.rd64(EDU_DMA_CMD)? & 1 != 0 {
            ensure(Instant::now() < deadline, || {
                "edu DMA did not complete in 10 s".into()
            })?;
            std::thread::sleep(Duration::from_millis(5));
        }
        let n = wait_eventfd(irq, Duration::from_secs(5))?;
        let status = self.rd32(EDU_IRQ_STATUS)?;
        ensure(status & EDU_DMA_IRQ != 0, || {
            format!("DMA interrupt arrived ({n}) but status is {status:#x}")
        })?;
        self.wr32(EDU_IRQ_ACK, EDU_DMA_IRQ)?;
        Ok(())
    }
}

/// A memfd of `size` bytes.
fn memfd(name: &str, size: u64) -> Result<File> {
    let f = File::from(
        rustix::fs::memfd_create(name, rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| format!("memfd: {e}"))?,
    );
    f.set_len(size).map_err(|e| format!("memfd size: {e}"))?;
    Ok(f)
}

/// Waits until the (non-blocking) eventfd has a count, and returns it.
fn wait_eventfd(fd: &File, timeout: Duration) -> Result<u64> {
    let deadline = Instant::now() + timeout;
    loop {
        let mut b = [0u8; 8];
        match rustix::io::read(fd, &mut b) {
            Ok(8) => return Ok(u64::from_ne_bytes(b)),
            Ok(n) => return Err(format!("short eventfd read ({n})")),
            Err(rustix::io::Errno::AGAIN) => {}
            Err(e) => return Err(format!("eventfd read: {e}")),
        }
        if Instant::now() >= deadline {
            return Err(format!("no interrupt within {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn eventfd() -> Result<File> {
    rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )
    .map(File::from)
    .map_err(|e| format!("eventfd: {e}"))
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

fn msix_ok(step: &str, detail: impl std::fmt::Display) {
    println!("MSIX: {step} ok {detail}");
}

fn nvme_ok(step: &str, detail: impl std::fmt::Display) {
    println!("NVME: {step} ok {detail}");
}

/// The `--abandon` run (see the crate documentation).
fn run_abandon(socket: &str) -> Result<serde_json::Value> {
    let c = Client::connect(socket).map_err(|e| format!("connect {socket}: {e}"))?;
    let mut d = Edu { c };
    let mem = memfd("edu-abandon", WINDOW)?;
    d.map(IOVA, WINDOW, true, &mem)?;
    let irq = eventfd()?;
    d.set_eventfds(MSI_INDEX, 0, &[&irq])?;
    println!("ABANDON: left ok window {IOVA:#x}+{WINDOW:#x} mapped and the MSI eventfd set");
    Ok(serde_json::json!({"result": "pass"}))
}

/// The `--nvme` run (see the crate documentation).
fn run_nvme(socket: &str) -> Result<serde_json::Value> {
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

/// The `--msix` probe (see the crate documentation).
fn run_msix(socket: &str) -> Result<serde_json::Value> {
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

fn run(socket: &str) -> Result<serde_json::Value> {
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
fn run_migrate(src_socket: &str, dst_socket: &str) -> Result<serde_json::Value> {
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

/// What the passthrough kind offers besides the core: migration (quiesce, reset and replay)
/// and recovery in a replacement process (reset and replay); no swap, no relocation (its state
/// is in the hardware), no work counters.
const VFIO_GROUPS: Groups = Groups {
    migration: true,
    swap: false,
    recovery: true,
    relocation: Moves::No,
    telemetry: false,
};

/// `--conformance BDF`: the conformance suite on `vfio,host=BDF`, every check whatever fails.
fn run_conformance(bdf: &str) -> std::process::ExitCode {
    let subject = Subject::kind_kv(switchyard_vfio::VfioKind, &format!("host={bdf}"))
        .named(format!("vfio({bdf})"))
        .declares(VFIO_GROUPS);
    let results = switchyard_conformance::run_all(&subject);
    let mut failed = Vec::new();
    for (check, r) in &results {
        match r {
            Ok(()) => println!("CONFORMANCE: {check} ok"),
            Err(why) => {
                println!("CONFORMANCE: {check} FAIL {}", why.replace('\n', " | "));
                failed.push(*check);
            }
        }
    }
    let summary = serde_json::json!({
        "result": if failed.is_empty() { "pass" } else { "fail" },
        "checks": results.len(),
        "failed": failed,
    });
    println!("CONFORMANCE-SUMMARY {summary}");
    if failed.is_empty() {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}

fn main() -> std::process::ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, bdf] = args.as_slice()
        && flag == "--conformance"
    {
        return run_conformance(bdf);
    }
    if let [flag, src, dst] = args.as_slice()
        && flag == "--migrate"
    {
        return match run_migrate(src, dst) {
            Ok(summary) => {
                println!("MIGRATE-SUMMARY {summary}");
                std::process::ExitCode::SUCCESS
            }
            Err(e) => {
                println!("MIGRATE: FAIL {e}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    let (mode, socket) = match args.as_slice() {
        [s] => ("", s),
        [flag, s] if ["--msix", "--nvme", "--abandon"].contains(&flag.as_str()) => {
            (flag.as_str(), s)
        }
        _ => {
            eprintln!(
                "usage: edu-client [--msix|--nvme|--abandon] SOCKET | --migrate SRC DST | --conformance BDF"
            );
            return std::process::ExitCode::from(2);
        }
    };
    let (result, label) = match mode {
        "--msix" => (run_msix(socket), "MSIX"),
        "--nvme" => (run_nvme(socket), "NVME"),
        "--abandon" => (run_abandon(socket), "ABANDON"),
        _ => (run(socket), "EDU"),
    };
    match result {
        Ok(summary) => {
            println!("{label}-SUMMARY {summary}");
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            println!("{label}: FAIL {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
