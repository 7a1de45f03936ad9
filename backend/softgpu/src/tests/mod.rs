//! Device tests. A [`Harness`] plays both sides a real deployment has: guest RAM in memfd DMA
//! windows and MSI-X (or MSI) eventfds (what the server lends the device), and a driver that
//! programs the device only through region reads and writes.

mod commands;
mod doorbells;
mod errors;
mod faults;
mod identity;
mod migration;
mod msi;
mod msix;
mod props;
mod recovery;
mod resets;
mod slot_memory;
mod state;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_device::blackbox::BlackBox;
use switchyard_device::config::regs as pci;
use switchyard_device::irq::{new_eventfd, take_eventfd};
use switchyard_device::{
    DeviceContext, DeviceError, DmaProt, DmaSpace, Interrupts, IrqIndex, PciDevice,
};

use crate::cmd::{COMMAND_SIZE, Command};
use crate::regs::*;
use crate::{BAR_MSIX, BAR_REGS, BAR_VRAM, IrqMode, SoftGpu, SoftGpuConfig};

/// First guest RAM window.
pub(crate) const RAM0: u64 = 0x10_0000;
/// Size of each RAM window (2 MiB).
pub(crate) const RAM_SIZE: u64 = 0x20_0000;
/// Second guest RAM window, adjacent to the first, backed by another memfd.
pub(crate) const RAM1: u64 = RAM0 + RAM_SIZE;
/// Unmapped hole after RAM1.
pub(crate) const HOLE: u64 = RAM1 + RAM_SIZE;
/// A read-only window, after the hole.
pub(crate) const RO: u64 = HOLE + 0x10_0000;
/// Size of the read-only window.
pub(crate) const RO_SIZE: u64 = 0x1_0000;
/// Ring entries used by the harness.
pub(crate) const RING_ENTRIES: u32 = 64;
/// Where data buffers start (after the rings).
pub(crate) const DATA: u64 = RAM0 + 0x1_0000;
/// Config space offset of the PCI Express capability's device control register is found by
/// walking the capability chain; these are the capability IDs.
pub(crate) const CAP_PM: u8 = 0x01;
pub(crate) const CAP_MSI: u8 = 0x05;
pub(crate) const CAP_EXP: u8 = 0x10;
pub(crate) const CAP_MSIX: u8 = 0x11;

const TIMEOUT: Duration = Duration::from_secs(30);

pub(crate) fn memfd(size: u64) -> File {
    let f = memfd::MemfdOptions::default()
        .create("softgpu-test-ram")
        .expect("memfd")
        .into_file();
    f.set_len(size).expect("set_len");
    f
}

pub(crate) fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + TIMEOUT;
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A deterministic pseudo-random f32 stream with varied magnitudes and signs.
pub(crate) fn floats(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let mant = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            let exp = ((s >> 8) % 16) as i32 - 8;
            mant * 2f32.powi(exp)
        })
        .collect()
}

pub(crate) fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub(crate) fn bytes_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

pub(crate) struct Window {
    pub iova: u64,
    pub size: u64,
    pub file: File,
}

/// A device plus the client side around it.
pub(crate) struct Harness {
    pub gpu: SoftGpu,
    /// The black box the device mirrors into (every harness device mirrors, so that every
    /// test also checks, in debug builds, that no change escapes the mirror).
    pub bb: Option<Arc<BlackBox>>,
    pub config: SoftGpuConfig,
    pub dma: Arc<DmaSpace>,
    pub irqs: Arc<Interrupts>,
    /// One eventfd per MSI-X vector (none in MSI mode).
    pub msix: Vec<File>,
    /// The MSI vector's eventfd (none in MSI-X mode).
    pub msi: Vec<File>,
    pub windows: Vec<Window>,
    pub tails: Vec<u32>,
    /// The slot's memory objects (its VRAM).
    pub memory: Arc<switchyard_device::MemoryObjects>,
}

impl Harness {
    /// A device with 4 MiB of VRAM and 2 queues, guest RAM mapped, eventfds installed.
    pub fn new() -> Self {
        Self::with_irq(IrqMode::Msix)
    }

    /// Like [`Harness::new`], in MSI mode.
    pub fn msi() -> Self {
        Self::with_irq(IrqMode::Msi)
    }

    /// Like [`Harness::new`], in interrupt mode `irq`.
    pub fn with_irq(irq: IrqMode) -> Self {
        Self::with_config(SoftGpuConfig {
            vram_size: 4 << 20,
            queues: 2,
            irq,
            vram_mmap: true,
            keep_vram_on_reset: false,
            spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
        })
    }

    pub fn with_config(config: SoftGpuConfig) -> Self {
        let bb = BlackBox::create(&SoftGpu::black_box_records(&config)).expect("black box");
        let windows = [
            (RAM0, RAM_SIZE, DmaProt::READ_WRITE),
            (RAM1, RAM_SIZE, DmaProt::READ_WRITE),
            (RO, RO_SIZE, DmaProt::READ_ONLY),
        ]
        .map(|(iova, size, prot)| (iova, size, prot, memfd(size)));
        let mut h = Self::build(config, windows, |ctx| {
            SoftGpu::with_black_box(config, ctx, &bb, None).expect("softgpu")
        });
        h.bb = Some(bb);
        h
    }

    /// A device made by `make` on a context whose DMA windows are `windows` (iova, size,
    /// protection, the guest's memfd) and whose interrupts are new eventfds.
    pub fn build(
        config: SoftGpuConfig,
        windows: impl IntoIterator<Item = (u64, u64, DmaProt, File)>,
        make: impl FnOnce(DeviceContext) -> SoftGpu,
    ) -> Self {
        let dma = Arc::new(DmaSpace::new(16));
        let mut mapped = Vec::new();
        for (iova, size, prot, f) in windows {
            let device_side = f.try_clone().expect("clone");
            dma.map(iova, size, prot, Some((device_side, 0)))
                .expect("map");
            mapped.push(Window {
                iova,
                size,
                file: f,
            });
        }
        let counts = config.irq_counts();
        let irqs = Arc::new(Interrupts::new(&counts));
        let eventfds = |index: IrqIndex| -> Vec<File> {
            let fds: Vec<File> = (0..counts[index as usize])
                .map(|_| new_eventfd().expect("eventfd"))
                .collect();
            irqs.set_triggers(
                index as u32,
                0,
                fds.iter()
                    .map(|e| Some(e.try_clone().expect("clone")))
                    .collect(),
            )
            .expect("set triggers");
            fds
        };
        let msix = eventfds(IrqIndex::Msix);
        let msi = eventfds(IrqIndex::Msi);
        let memory: Arc<switchyard_device::MemoryObjects> = Default::default();
        let ctx = DeviceContext {
            dma: dma.clone(),
            irqs: irqs.clone(),
            waits: Default::default(),
            memory: memory.clone(),
        };
        let gpu = make(ctx);
        let mut h = Self {
            gpu,
            bb: None,
            config,
            dma,
            irqs,
            msix,
            msi,
            windows: mapped,
            tails: vec![0; config.queues as usize],
            memory,
        };
        // A recovered device continues its rings where they were.
        for q in 0..config.queues {
            h.tails[q as usize] = h.qr(q, Q_TAIL);
        }
        h
    }

    /// A second device of the same configuration on this one's VRAM memfd, DMA space,
    /// interrupt table and eventfds (what a server swapping the backing device does).
    pub fn successor(&self) -> Self {
        let clone = |files: &[File]| -> Vec<File> {
            files
                .iter()
                .map(|e| e.try_clone().expect("clone"))
                .collect()
        };
        let vram = self.gpu.vram_file().clone();
        Self {
            gpu: SoftGpu::with_vram(self.config, self.ctx(), vram).expect("second device"),
            bb: None,
            config: self.config,
            dma: self.dma.clone(),
            irqs: self.irqs.clone(),
            msix: clone(&self.msix),
            msi: clone(&self.msi),
            windows: self
                .windows
                .iter()
                .map(|w| Window {
                    iova: w.iova,
                    size: w.size,
                    file: w.file.try_clone().expect("clone"),
                })
                .collect(),
            tails: self.tails.clone(),
            memory: Default::default(),
        }
    }

    /// The context of this harness's slot (its memory objects included), e.g. for a
    /// successor.
    pub fn slot_ctx(&self) -> DeviceContext {
        DeviceContext {
            memory: self.memory.clone(),
            ..self.ctx()
        }
    }

    pub fn ctx(&self) -> DeviceContext {
        DeviceContext {
            dma: self.dma.clone(),
            irqs: self.irqs.clone(),
            waits: Default::default(),
            memory: Default::default(),
        }
    }

    // ---- guest memory (the guest's view, not through the device) ----

    fn window(&self, iova: u64) -> &Window {
        self.windows
            .iter()
            .find(|w| (w.iova..w.iova + w.size).contains(&iova))
            .expect("address in a test window")
    }

    pub fn guest_write(&self, iova: u64, data: &[u8]) {
        let mut off = 0usize;
        while off < data.len() {
            let a = iova + off as u64;
            let w = self.window(a);
            let n = ((w.iova + w.size - a) as usize).min(data.len() - off);
            w.file
                .write_all_at(&data[off..off + n], a - w.iova)
                .expect("pwrite");
            off += n;
        }
    }

    pub fn guest_read(&self, iova: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        let mut off = 0usize;
        while off < len {
            let a = iova + off as u64;
            let w = self.window(a);
            let n = ((w.iova + w.size - a) as usize).min(len - off);
            w.file
                .read_exact_at(&mut out[off..off + n], a - w.iova)
                .expect("pread");
            off += n;
        }
        out
    }

    pub fn vram_file_read(&self, off: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        self.gpu
            .vram_file()
            .read_exact_at(&mut out, off)
            .expect("pread vram");
        out
    }

    pub fn vram_file_write(&self, off: u64, data: &[u8]) {
        self.gpu
            .vram_file()
            .write_all_at(data, off)
            .expect("pwrite vram");
    }

    // ---- register access, as a driver does it ----

    pub fn rd32(&mut self, off: u64) -> u32 {
        let mut b = [0u8; 4];
        self.gpu.region_read(BAR_REGS, off, &mut b).expect("rd32");
        u32::from_le_bytes(b)
    }

    pub fn wr32(&mut self, off: u64, v: u32) {
        self.gpu
            .region_write(BAR_REGS, off, &v.to_le_bytes())
            .expect("wr32");
    }

    pub fn rd64(&mut self, off: u64) -> u64 {
        let mut b = [0u8; 8];
        self.gpu.region_read(BAR_REGS, off, &mut b).expect("rd64");
        u64::from_le_bytes(b)
    }

    pub fn wr64(&mut self, off: u64, v: u64) {
        self.gpu
            .region_write(BAR_REGS, off, &v.to_le_bytes())
            .expect("wr64");
    }

    pub fn qr(&mut self, q: u32, reg: u64) -> u32 {
        self.rd32(queue_reg(q, reg))
    }

    pub fn qw(&mut self, q: u32, reg: u64, v: u32) {
        self.wr32(queue_reg(q, reg), v);
    }

    pub fn cfg_read(&mut self, off: u64, len: usize) -> u32 {
        let mut b = [0u8; 4];
        self.gpu
            .region_read(crate::CONFIG_REGION_INDEX, off, &mut b[..len])
            .expect("config read");
        u32::from_le_bytes(b)
    }

    pub fn cfg_write(&mut self, off: u64, v: u32, len: usize) {
        self.gpu
            .region_write(crate::CONFIG_REGION_INDEX, off, &v.to_le_bytes()[..len])
            .expect("config write");
    }

    /// Function level reset through the PCI Express Device Control register.
    pub fn flr(&mut self) {
        let exp = self.cap(CAP_EXP);
        let devctl = self.cfg_read(exp + 8, 2);
        self.cfg_write(exp + 8, devctl | 0x8000, 2);
    }

    /// Restores `blob`, which must be refused; returns the error message.
    pub fn refused(&mut self, blob: &[u8]) -> String {
        match self.gpu.restore_state(blob) {
            Err(DeviceError::BadState(e)) => e.to_string(),
            other => panic!("expected BadState, got {other:?}"),
        }
    }

    /// Capability IDs and offsets along the chain.
    pub fn caps(&mut self) -> Vec<(u8, u64)> {
        let mut out = vec![];
        let mut p = u64::from(self.cfg_read(pci::CAP_PTR as u64, 1));
        while p != 0 {
            out.push((self.cfg_read(p, 1) as u8, p));
            p = u64::from(self.cfg_read(p + 1, 1));
            assert!(out.len() < 16, "capability loop");
        }
        out
    }

    pub fn cap(&mut self, id: u8) -> u64 {
        self.caps()
            .into_iter()
            .find(|c| c.0 == id)
            .map(|c| c.1)
            .expect("capability present")
    }

    pub fn set_command(&mut self, bits: u16) {
        self.cfg_write(pci::COMMAND as u64, u32::from(bits), 2);
    }

    pub fn enable_bus_master(&mut self) {
        self.set_command(pci::CMD_MEMORY | pci::CMD_BUS_MASTER);
    }

    pub fn enable_msix(&mut self) {
        let m = self.cap(CAP_MSIX);
        self.cfg_write(m + 2, 0x8000, 2);
    }

    /// Programs the MSI message (as a guest OS does) and sets the MSI enable bit.
    pub fn enable_msi(&mut self) {
        let m = self.cap(CAP_MSI);
        self.cfg_write(m + 4, 0xfee0_0000, 4);
        self.cfg_write(m + 8, 0, 4);
        self.cfg_write(m + 12, 0x4041, 2);
        self.cfg_write(m + 2, 0x0001, 2);
    }

    /// Enables the device's interrupt mechanism: MSI-X or MSI.
    pub fn enable_irqs(&mut self) {
        match self.config.irq {
            IrqMode::Msix => self.enable_msix(),
            IrqMode::Msi => self.enable_msi(),
        }
    }

    pub fn msix_entry_write(&mut self, vector: u32, word: u64, v: u32) {
        self.gpu
            .region_write(
                BAR_MSIX,
                MSIX_TABLE_OFFSET + u64::from(vector) * 16 + word * 4,
                &v.to_le_bytes(),
            )
            .expect("msix table write");
    }

    pub fn ring(q: u32) -> u64 {
        RAM0 + u64::from(q) * 0x1000
    }

    /// Programs and enables queue `q` with the harness ring.
    pub fn setup_queue(&mut self, q: u32) {
        self.wr64(queue_reg(q, Q_RING_BASE_LO), Self::ring(q));
        self.qw(q, Q_RING_SIZE, RING_ENTRIES);
        self.qw(q, Q_CONTROL, Q_CONTROL_ENABLE);
        assert_eq!(self.qr(q, Q_STATUS), Q_STATUS_IDLE);
        self.tails[q as usize] = self.qr(q, Q_TAIL);
    }

    /// Bus master, MSI-X (or MSI) enable, every queue set up.
    pub fn init(&mut self) {
        self.enable_bus_master();
        self.enable_irqs();
        for q in 0..self.config.queues {
            self.setup_queue(q);
        }
    }

    /// Writes commands into the ring without ringing the doorbell; returns the first index.
    pub fn enqueue(&mut self, q: u32, cmds: &[Command]) -> u32 {
        let first = self.tails[q as usize];
        for c in cmds {
            let t = self.tails[q as usize];
            let slot = u64::from(t % RING_ENTRIES) * COMMAND_SIZE as u64;
            self.guest_write(Self::ring(q) + slot, &c.encode());
            self.tails[q as usize] = t.wrapping_add(1);
        }
        first
    }

    /// Enqueues and rings the doorbell; returns the index of the first command.
    /// Waits until engine `q` has looked for work in a state that `ok` accepts (and that
    /// includes the queue's current tail): the positive signal a test needs before asserting
    /// that a command did *not* run.
    pub fn wait_engine_saw(&self, q: u32, what: &str, ok: impl Fn(crate::device::Seen) -> bool) {
        let tail = self.tails[q as usize];
        wait_until(what, || {
            let seen = self.gpu.shared.engine_seen(q as usize);
            seen.tail == tail && ok(seen)
        });
    }

    pub fn submit(&mut self, q: u32, cmds: &[Command]) -> u32 {
        let first = self.enqueue(q, cmds);
        let t = self.tails[q as usize];
        self.qw(q, Q_DOORBELL, t);
        first
    }

    fn error_regs(&mut self, q: u32) -> (u32, u32, u64, u32) {
        (
            self.qr(q, Q_ERROR_CODE),
            self.qr(q, Q_ERROR_INDEX),
            self.rd64(queue_reg(q, Q_ERROR_ADDR_LO)),
            self.qr(q, Q_ERROR_OPCODE),
        )
    }

    /// Waits until queue `q` has executed everything submitted; fails on a queue error.
    pub fn wait_idle(&mut self, q: u32) {
        let tail = self.tails[q as usize];
        let mut error = None;
        wait_until("queue idle", || {
            if self.qr(q, Q_STATUS) == Q_STATUS_ERROR {
                error = Some(self.error_regs(q));
                return true;
            }
            self.qr(q, Q_HEAD) == tail && self.qr(q, Q_STATUS) == Q_STATUS_IDLE
        });
        assert_eq!(error, None, "queue {q} error (code, index, addr, opcode)");
    }

    /// Submits and waits.
    pub fn run(&mut self, q: u32, cmds: &[Command]) {
        self.submit(q, cmds);
        self.wait_idle(q);
    }

    /// Waits for queue `q` to stop on an error; returns (code, index, addr, opcode).
    pub fn wait_error(&mut self, q: u32) -> (u32, u32, u64, u32) {
        wait_until("queue error", || self.qr(q, Q_STATUS) == Q_STATUS_ERROR);
        self.error_regs(q)
    }

    /// Acks queue `q`'s error interrupt and recovers it.
    pub fn recover(&mut self, q: u32) {
        self.wr32(INT_ACK, int_error(q));
        self.qw(q, Q_CONTROL, Q_CONTROL_RECOVER | Q_CONTROL_ENABLE);
    }

    pub fn wait_irq(&self, vector: u32) -> u64 {
        let fd = &self.msix[vector as usize];
        let mut n = 0;
        wait_until("MSI-X eventfd", || {
            n = take_eventfd(fd).unwrap_or(0);
            n > 0
        });
        n
    }

    pub fn irq_count(&self, vector: u32) -> u64 {
        take_eventfd(&self.msix[vector as usize]).unwrap_or(0)
    }

    /// Waits for the MSI vector (MSI mode); returns the eventfd count.
    pub fn wait_msi(&self) -> u64 {
        let fd = self.msi.first().expect("MSI mode");
        let mut n = 0;
        wait_until("MSI eventfd", || {
            n = take_eventfd(fd).unwrap_or(0);
            n > 0
        });
        n
    }

    /// Takes the MSI eventfd's count (MSI mode).
    pub fn msi_count(&self) -> u64 {
        take_eventfd(self.msi.first().expect("MSI mode")).unwrap_or(0)
    }

    /// Waits for the message of a source routed to MSI-X `vector` (in MSI mode: the MSI
    /// vector); returns the eventfd count.
    pub fn wait_source(&self, vector: u32) -> u64 {
        match self.config.irq {
            IrqMode::Msix => self.wait_irq(vector),
            IrqMode::Msi => self.wait_msi(),
        }
    }

    /// Takes the counts of every eventfd (MSI-X and MSI) and returns their sum.
    pub fn irq_total(&self) -> u64 {
        self.msix
            .iter()
            .chain(&self.msi)
            .map(|fd| take_eventfd(fd).unwrap_or(0))
            .sum()
    }

    pub fn drain_irqs(&self) {
        for fd in self.msix.iter().chain(&self.msi) {
            let _ = take_eventfd(fd);
        }
    }

    pub fn vram_region_read(&mut self, off: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        self.gpu
            .region_read(BAR_VRAM, off, &mut b)
            .expect("vram read");
        b
    }
}
