//! The softgpu driver proper: device bring-up over VFIO, rings, submission, and completion by
//! interrupt (fence values in DMA memory, checked when the interrupt arrives: an MSI-X vector's
//! eventfd, or in MSI mode the single MSI eventfd demultiplexed through `INT_STATUS`).
//!
//! The same [`Gpu`] runs without VFIO (`--noiommu`, [`crate::noiommu`]): it is built from its
//! parts ([`Gpu::from_parts`]): config space through a [`DeviceAccess`] other than VFIO,
//! hugepage DMA windows at their physical addresses, and polled delivery
//! ([`crate::irq::Delivery::Polled`]), which waits exactly as MSI does but reads `INT_STATUS`
//! itself.

use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use crate::cmd::{Addr, Cmd};
use crate::dma::{DmaArena, Mark};
use crate::irq::{Delivery, Event, InterruptSource, IrqMode, WaitError};
use crate::mmio::BarMap;
use crate::pci;
use crate::regs::*;
use crate::say;
use crate::vfio::Vfio;

/// Ring entries per queue.
pub const RING_ENTRIES: u32 = 256;
/// First IOVA of the DMA arena (above 4 GiB, clear of the x86 MSI window).
pub const DMA_BASE_IOVA: u64 = 0x1_0000_0000;
/// An IOVA the driver never maps, for the bad-DMA test through an IOMMU.
pub const UNMAPPED_IOVA: u64 = 0x7_0000_0000;

/// How the driver publishes a queue's new tail (the crate documentation of
/// `switchyard-softgpu`, "Mapped doorbells").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Doorbell {
    /// A `Q_DOORBELL` write: trapped by the VMM, a message to the server.
    #[default]
    Trapped,
    /// A store of the tail into the queue's slot of the doorbell page (BAR0 memory the device
    /// watches), then a trapped `Q_DOORBELL` write (a *kick*) only if the device says its
    /// engine sleeps (`DB_NEED_KICK`).
    Mapped,
}

impl Doorbell {
    /// Both modes, trapped first.
    pub const ALL: [Doorbell; 2] = [Doorbell::Trapped, Doorbell::Mapped];

    /// `"trapped"` or `"mapped"` (the `--doorbell` value and the summary's `doorbell`).
    pub fn name(self) -> &'static str {
        match self {
            Doorbell::Trapped => "trapped",
            Doorbell::Mapped => "mapped",
        }
    }

    /// The mode named `s`.
    pub fn parse(s: &str) -> Option<Doorbell> {
        Doorbell::ALL.into_iter().find(|d| d.name() == s)
    }

    /// The `Q_CONTROL` bits of this mode (to OR into every `Q_CONTROL` write: the device takes
    /// the mode from each write).
    pub fn control_bits(self) -> u32 {
        match self {
            Doorbell::Trapped => 0,
            Doorbell::Mapped => Q_CONTROL_MAPPED,
        }
    }
}

/// How the driver reaches the device's config space and interrupt routing, besides its BAR
/// mappings: VFIO ([`Vfio`]), or sysfs without VFIO ([`crate::noiommu::SysfsDevice`]).
pub trait DeviceAccess: std::fmt::Debug {
    /// Reads config space at `offset`.
    fn cfg_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), String>;
    /// Writes config space at `offset`.
    fn cfg_write(&self, offset: u64, data: &[u8]) -> Result<(), String>;
    /// Tears the interrupt routing of `mode` down.
    fn disable_irqs(&self, mode: IrqMode) -> Result<(), String>;
    /// Undoes whatever else bring-up changed, at the end of [`Gpu::shutdown`].
    fn release(&mut self) -> Vec<String> {
        Vec::new()
    }
}

impl DeviceAccess for Vfio {
    fn cfg_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        Vfio::cfg_read(self, offset, buf)
    }

    fn cfg_write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        Vfio::cfg_write(self, offset, data)
    }

    fn disable_irqs(&self, mode: IrqMode) -> Result<(), String> {
        Vfio::disable_irqs(self, mode)
    }
}

/// Counters for the summary.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// Data jobs (COPY, FILL, SAXPY, GEMM, REDUCE) submitted.
    pub jobs_run: u64,
    /// Jobs whose results were checked bit-for-bit.
    pub jobs_verified: u64,
    /// Bytes the engines moved for submitted jobs ([`Cmd::bytes_moved`]).
    pub bytes_moved: u64,
    /// FENCE commands submitted.
    pub fences: u64,
    /// Union of the `INT_STATUS` bits seen by the interrupt handler.
    pub int_status_seen: u32,
    /// Fence waits that ended with their interrupt and the fence value.
    pub fence_irq_waits: u64,
    /// FENCEs submitted without an interrupt.
    pub silent_fences: u64,
    /// Commands the device reported `ERR_INTERRUPTED` for (it was restarted under them).
    pub interrupted: u64,
    /// Interrupting fences of step attempts given up after an interruption: they ran, but
    /// nobody waited for them.
    pub abandoned_fence_waits: u64,
    /// Tails published (one per [`Gpu::submit`]): trapped `Q_DOORBELL` writes, or mapped
    /// stores into the doorbell page.
    pub submissions: u64,
    /// Of the mapped submissions, those that found `DB_NEED_KICK` set and kicked the engine
    /// with a trapped `Q_DOORBELL` write.
    pub kicks: u64,
}

/// A queue that stopped on an error, as its registers describe it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueFault {
    /// Queue.
    pub queue: u32,
    /// `Q_STATUS`.
    pub status: u32,
    /// `Q_ERROR_CODE`.
    pub code: u32,
    /// `Q_ERROR_INDEX`.
    pub index: u32,
    /// `Q_ERROR_ADDR`.
    pub addr: u64,
    /// `Q_ERROR_OPCODE`.
    pub opcode: u32,
    /// The vector that reported it: the queue's MSI-X error vector, or the MSI vector (0;
    /// also 0 when polled).
    pub vector: u32,
    /// How it was delivered.
    pub delivery: Delivery,
}

impl std::fmt::Display for QueueFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "queue {} {} code={} ({}) index={} addr={:#x} opcode={:#x} ({})",
            self.queue,
            status_name(self.status),
            self.code,
            error_name(self.code),
            self.index,
            self.addr,
            self.opcode,
            match self.delivery {
                Delivery::Msix => format!("error vector {}", self.vector),
                Delivery::Msi => format!(
                    "MSI vector {}, INT_STATUS bit {}",
                    self.vector,
                    16 + self.queue
                ),
                Delivery::Polled => format!("polled INT_STATUS bit {}", 16 + self.queue),
            }
        )
    }
}

/// How a wait for a fence ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Completion {
    /// The fence value arrived.
    Fence,
    /// The queue reported an error (its error interrupt) first.
    Fault(QueueFault),
}

#[derive(Debug)]
struct Queue {
    ring: u64,
    tail: u32,
    /// Tail index after the last fence known complete (lower bound of HEAD).
    done_upto: u32,
    seq: u64,
    /// (fence value, tail after it) of fences not yet seen complete.
    outstanding: Vec<(u64, u32)>,
    /// How its tails are published.
    doorbell: Doorbell,
}

/// Options for [`Gpu::open`].
#[derive(Debug, Clone)]
pub struct GpuOptions {
    /// Bytes per DMA window.
    pub dma_window: u64,
    /// Number of DMA windows (adjacent IOVA ranges, separate mappings).
    pub dma_windows: usize,
    /// Upper bound of every wait.
    pub timeout: Duration,
    /// How every queue's tails are published.
    pub doorbell: Doorbell,
}

/// The device, brought up and ready for commands.
///
/// Dropping it runs [`Gpu::shutdown`] (queues reset, bus mastering off, interrupts and DMA
/// unmapped). Memory safety does not depend on that or on field order: each DMA window owns
/// its IOMMU mapping and never frees memory the device could still reach. `dma` is declared
/// before `dev` so that its unmaps (if `shutdown` did not run them) happen while the VFIO
/// container still has the device's group. Without an IOMMU nothing stops the device from
/// writing freed memory, so `shutdown` leaks the hugepages when a queue did not stop.
pub struct Gpu {
    /// BAR0 (registers).
    pub bar0: BarMap,
    /// BAR2 (VRAM).
    pub vram: BarMap,
    /// The interrupts (MSI-X or MSI eventfds).
    pub irqs: InterruptSource,
    /// DMA memory ([`Gpu::dma`]), windows mapped through the device's IOMMU (or, without one,
    /// hugepages at their physical addresses).
    dma: DmaArena,
    /// The VFIO device, or sysfs access without VFIO (private, like `dma`: neither can be
    /// replaced from outside).
    dev: Box<dyn DeviceAccess>,
    /// Queues the device has.
    pub nq: u32,
    /// VRAM bytes.
    pub vram_size: u64,
    /// Counters.
    pub stats: Stats,
    /// Upper bound of every wait.
    pub timeout: Duration,
    /// Config space (first 256 bytes) as read at bring-up.
    pub config: Vec<u8>,
    /// A bus address no DMA can reach (the bad-DMA test's target).
    pub unmapped_addr: u64,
    /// Whether the bus addresses right after the arena are unreachable for the device (with
    /// an IOMMU; without one they are other guest RAM).
    pub arena_edge_faults: bool,
    fence_slots: u64,
    queues: Vec<Queue>,
    /// The mode [`Gpu::setup_rings`] puts every queue in.
    doorbell: Doorbell,
    irqs_enabled: bool,
    shut_down: bool,
}

/// What [`Gpu::from_parts`] builds a device from: BARs mapped, device reset
/// ([`Gpu::check_bars_and_reset`]), interrupt delivery and DMA memory ready.
#[derive(Debug)]
pub struct Parts {
    /// BAR0.
    pub bar0: BarMap,
    /// The VRAM BAR.
    pub vram: BarMap,
    /// Interrupt delivery.
    pub irqs: InterruptSource,
    /// DMA memory (not to be mapped into an IOMMU).
    pub dma: DmaArena,
    /// Config space and the rest.
    pub dev: Box<dyn DeviceAccess>,
    /// `NUM_QUEUES`.
    pub nq: u32,
    /// `VRAM_SIZE`.
    pub vram_size: u64,
    /// Config space as read at bring-up.
    pub config: Vec<u8>,
    /// Bound of every wait.
    pub timeout: Duration,
    /// A bus address no DMA can reach.
    pub unmapped_addr: u64,
    /// How every queue's tails are published.
    pub doorbell: Doorbell,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("nq", &self.nq)
            .field("vram_size", &self.vram_size)
            .finish_non_exhaustive()
    }
}

fn ms(d: Duration) -> u128 {
    d.as_millis()
}

/// The interrupt mode of the device behind `vfio`, from the capability list in its config
/// space: MSI-X if it has an MSI-X capability, else MSI if it has an MSI capability.
pub fn detect_irq_mode(vfio: &Vfio) -> Result<IrqMode, String> {
    let mut config = vec![0u8; 256];
    vfio.cfg_read(0, &mut config)?;
    let ids: Vec<u8> = pci::capabilities(&config)?.iter().map(|c| c.0).collect();
    IrqMode::detect(&ids)
}

/// Checks the softgpu's identity and its PM and PCI Express capabilities in `config` (the
/// first 256 bytes of config space), logs them, and returns the interrupt mode its
/// capabilities give.
pub fn check_config(config: &[u8]) -> Result<IrqMode, String> {
    let (ven, dev, class) = pci::identity(config);
    if (ven, dev, class) != (PCI_VENDOR, PCI_DEVICE, PCI_CLASS) {
        return Err(format!(
            "config space says {ven:04x}:{dev:04x} class {class:06x}, not the softgpu"
        ));
    }
    let caps = pci::capabilities(config)?;
    let ids: Vec<u8> = caps.iter().map(|c| c.0).collect();
    say!("config: {ven:04x}:{dev:04x} class {class:06x} capabilities {ids:02x?}");
    for (want, name) in [(CAP_PM, "PM"), (CAP_PCIE, "PCI Express")] {
        if !ids.contains(&want) {
            return Err(format!(
                "capability {name} ({want:#04x}) missing: {ids:02x?}"
            ));
        }
    }
    IrqMode::detect(&ids)
}

/// Sets Memory Space and Bus Master in the command register (from `config`) through `dev` and
/// checks that both read back; returns the value read.
pub fn enable_memory_and_master(dev: &dyn DeviceAccess, config: &[u8]) -> Result<u16, String> {
    let cmd =
        pci::le16(config, pci::PCI_COMMAND) | pci::PCI_COMMAND_MEMORY | pci::PCI_COMMAND_MASTER;
    dev.cfg_write(pci::PCI_COMMAND as u64, &cmd.to_le_bytes())?;
    let mut b = [0u8; 2];
    dev.cfg_read(pci::PCI_COMMAND as u64, &mut b)?;
    let got = u16::from_le_bytes(b);
    if got & (pci::PCI_COMMAND_MEMORY | pci::PCI_COMMAND_MASTER)
        != pci::PCI_COMMAND_MEMORY | pci::PCI_COMMAND_MASTER
    {
        return Err(format!(
            "command register reads {got:#06x} after writing {cmd:#06x}"
        ));
    }
    Ok(got)
}

/// Checks that `MSIX_VECTOR_COUNT` agrees with the interrupt mode of the capability list.
pub fn check_vector_count_register(bar0: &BarMap, mode: IrqMode) -> Result<(), String> {
    let reg = bar0.r32(MSIX_VECTOR_COUNT);
    if reg != mode.msix_vector_count() {
        return Err(format!(
            "MSIX_VECTOR_COUNT reads {reg} but the capability list says {} (expected {})",
            mode.label(),
            mode.msix_vector_count()
        ));
    }
    Ok(())
}

impl Gpu {
    /// Brings the device up: config checks, memory + bus master, BAR mmaps, device reset,
    /// interrupts (MSI-X: an eventfd per vector; MSI: one eventfd), DMA windows through the
    /// IOMMU, and all rings.
    pub fn open(vfio: Vfio, opt: &GpuOptions) -> Result<Gpu, String> {
        let mut config = vec![0u8; 256];
        vfio.cfg_read(0, &mut config)?;
        let mode = check_config(&config)?;
        say!(
            "interrupt mode: {} (capability {:#04x}{})",
            mode.label(),
            mode.capability(),
            match mode {
                IrqMode::Msix => "",
                IrqMode::Msi =>
                    "; no MSI-X: every source on one vector, demultiplexed through INT_STATUS",
            }
        );
        for i in [BAR_REGS, BAR_VRAM] {
            say!("region {i}: {}", vfio.region(i).describe());
        }

        // Memory space + bus master before touching the BARs (vfio-pci refuses BAR mmap faults
        // while memory decoding is off).
        let got = enable_memory_and_master(&vfio, &config)?;
        say!("command register {got:#06x} (memory space, bus master)");

        let bar0 = vfio
            .map_region(BAR_REGS)
            .map_err(|e| vfio.explain_absent_bar(BAR_REGS, e))?;
        let vram = vfio
            .map_region(BAR_VRAM)
            .map_err(|e| vfio.explain_absent_bar(BAR_VRAM, e))?;
        if bar0.mapped_len() < BAR0_SIZE {
            return Err(format!("BAR0 mapping is {} bytes", bar0.mapped_len()));
        }
        let (nq, vram_size) = Self::check_bars_and_reset(&bar0, &vram)?;

        let irqs = Self::enable_interrupts(&vfio, mode, &bar0)?;
        let t = Instant::now();
        let dma = DmaArena::new(DMA_BASE_IOVA, opt.dma_window, opt.dma_windows)?;
        let iommu = vfio.iommu();
        let mut gpu = Gpu {
            bar0,
            vram,
            irqs,
            dma,
            dev: Box::new(vfio),
            nq,
            vram_size,
            stats: Stats::default(),
            timeout: opt.timeout,
            config,
            unmapped_addr: UNMAPPED_IOVA,
            arena_edge_faults: true,
            fence_slots: 0,
            queues: Vec::new(),
            doorbell: opt.doorbell,
            irqs_enabled: true,
            shut_down: false,
        };
        // If a later window fails to map, the earlier ones stay mapped until `shutdown` (run by
        // `Drop` on the early return) or the arena's drop unmaps them: each window owns its
        // IOMMU mapping (`switchyard_sys::DmaMapping`).
        gpu.dma.map(&iommu)?;
        say!(
            "DMA: {} windows of {} MiB mapped at IOVA {:#x}..{:#x} through the IOMMU in {} ms",
            gpu.dma.windows().len(),
            opt.dma_window >> 20,
            gpu.dma.base(),
            gpu.dma.end(),
            ms(t.elapsed())
        );
        gpu.setup_rings()?;
        Ok(gpu)
    }

    /// A device without VFIO from its `parts` (see [`Parts`]): sets up every ring. Bad-DMA
    /// tests use `parts.unmapped_addr` and skip the arena's edge (other guest RAM lies there).
    pub fn from_parts(parts: Parts) -> Result<Gpu, String> {
        let mut gpu = Gpu {
            bar0: parts.bar0,
            vram: parts.vram,
            irqs: parts.irqs,
            dma: parts.dma,
            dev: parts.dev,
            nq: parts.nq,
            vram_size: parts.vram_size,
            stats: Stats::default(),
            timeout: parts.timeout,
            config: parts.config,
            unmapped_addr: parts.unmapped_addr,
            arena_edge_faults: false,
            fence_slots: 0,
            queues: Vec::new(),
            doorbell: parts.doorbell,
            irqs_enabled: false,
            shut_down: false,
        };
        gpu.setup_rings()?;
        Ok(gpu)
    }

    /// Checks MAGIC through the BAR0 mapping, resets the device, reads `NUM_QUEUES` and
    /// `VRAM_SIZE` and checks that the VRAM BAR covers VRAM. Returns `(queues, VRAM bytes)`.
    pub fn check_bars_and_reset(bar0: &BarMap, vram: &BarMap) -> Result<(u32, u64), String> {
        let magic = bar0.r32(MAGIC);
        if magic != MAGIC_VALUE {
            return Err(format!(
                "MAGIC reads {magic:#010x} through the BAR0 mapping"
            ));
        }
        bar0.w32(DEV_CONTROL, DEV_CONTROL_RESET);
        let nq = bar0.r32(NUM_QUEUES);
        let vram_size = bar0.r64(VRAM_SIZE);
        if !(1..=8).contains(&nq) {
            return Err(format!("NUM_QUEUES reads {nq}"));
        }
        if vram.is_file_io() {
            say!(
                "mmap: BAR0 {} KiB, BAR2 through pread/pwrite ({} MiB); MAGIC ok, device reset; {nq} queue(s), VRAM {} MiB",
                bar0.mapped_len() >> 10,
                vram.mapped_len() >> 20,
                vram_size >> 20
            );
        } else {
            say!(
                "mmap: BAR0 {} KiB, BAR2 {} MiB in {} piece(s); MAGIC ok, device reset; {nq} queue(s), VRAM {} MiB",
                bar0.mapped_len() >> 10,
                vram.mapped_len() >> 20,
                vram.pieces(),
                vram_size >> 20
            );
        }
        if vram.mapped_len() < vram_size {
            return Err(format!(
                "VRAM mapping covers {} of {vram_size} bytes",
                vram.mapped_len()
            ));
        }
        Ok((nq, vram_size))
    }

    /// The fence slots and every queue's ring: allocated, programmed, enabled and checked.
    fn setup_rings(&mut self) -> Result<(), String> {
        let gpu = self;
        let nq = gpu.nq;
        if gpu.doorbell == Doorbell::Mapped {
            gpu.check_doorbell_page()?;
        }
        gpu.fence_slots = gpu.dma.alloc(4096, 4096)?;
        for q in 0..nq {
            let ring = gpu.dma.alloc(u64::from(RING_ENTRIES) * 64, 4096)?;
            gpu.queues.push(Queue {
                ring,
                tail: 0,
                done_upto: 0,
                seq: 0,
                outstanding: Vec::new(),
                doorbell: Doorbell::Trapped,
            });
            gpu.bar0.w64(queue_reg(q, Q_RING_BASE), ring);
            gpu.bar0.w32(queue_reg(q, Q_RING_SIZE), RING_ENTRIES);
            gpu.bar0.w32(queue_reg(q, Q_COMPLETION_VECTOR), q);
            gpu.bar0.w32(queue_reg(q, Q_ERROR_VECTOR), 8 + q);
            gpu.enable_queue(q, gpu.doorbell)?;
            let base = gpu.bar0.r64(queue_reg(q, Q_RING_BASE));
            let status = gpu.bar0.r32(queue_reg(q, Q_STATUS));
            let tail = gpu.bar0.r32(queue_reg(q, Q_TAIL));
            if base != ring || status != Q_STATUS_IDLE || tail != 0 {
                return Err(format!(
                    "queue {q} setup: RING_BASE {base:#x} (wrote {ring:#x}), STATUS {}, TAIL {tail}",
                    status_name(status)
                ));
            }
        }
        say!(
            "rings: {nq} x {RING_ENTRIES} entries at IOVA {:#x}.., completion vectors 0..{}, error vectors 8..{}{}; {} doorbells{}",
            gpu.queues[0].ring,
            nq - 1,
            8 + nq - 1,
            match gpu.irqs.delivery() {
                Delivery::Msix => "",
                Delivery::Msi => " (stored, unused in MSI mode)",
                Delivery::Polled => " (stored, unused: completion is polled)",
            },
            gpu.doorbell.name(),
            match gpu.doorbell {
                Doorbell::Trapped => String::new(),
                Doorbell::Mapped => format!(
                    " (tails stored at BAR0 {:#x}.. through the BAR0 mapping, stride {DB_STRIDE:#x}; Q_DOORBELL only as a kick when DB_NEED_KICK is set)",
                    doorbell_slot(0, DB_TAIL)
                ),
            }
        );
        Ok(())
    }

    /// Checks that the device offers mapped doorbells (`FEATURES` bit 8) and that the BAR0
    /// mapping reaches its doorbell page.
    pub fn check_doorbell_page(&self) -> Result<(), String> {
        let features = self.bar0.r32(FEATURES);
        if features & FEATURE_DOORBELL_PAGE == 0 {
            return Err(format!(
                "mapped doorbells requested, but FEATURES {features:#x} lacks bit 8 (doorbell page; VERSION {:#010x})",
                self.bar0.r32(VERSION)
            ));
        }
        if self.bar0.mapped_len() < DOORBELL_PAGE + DOORBELL_PAGE_SIZE {
            return Err(format!(
                "the BAR0 mapping ({} bytes) does not reach the doorbell page at {DOORBELL_PAGE:#x}",
                self.bar0.mapped_len()
            ));
        }
        Ok(())
    }

    /// Enables queue `q` with tails published the `doorbell` way (`Q_CONTROL` = ENABLE, plus
    /// MAPPED in mapped mode) and checks the mode reads back; entering mapped mode, also that
    /// the device stored the queue's tail into `DB_TAIL` (where the driver continues from).
    /// The queue must have nothing in flight.
    pub fn enable_queue(&mut self, q: u32, doorbell: Doorbell) -> Result<(), String> {
        self.qw32(q, Q_CONTROL, Q_CONTROL_ENABLE | doorbell.control_bits());
        self.queues[q as usize].doorbell = doorbell;
        let ctl = self.qr32(q, Q_CONTROL);
        if ctl & Q_CONTROL_MAPPED != doorbell.control_bits() {
            return Err(format!(
                "queue {q}: Q_CONTROL reads {ctl:#x} after enabling it with {} doorbells",
                doorbell.name()
            ));
        }
        if doorbell == Doorbell::Mapped {
            let tail = self.queues[q as usize].tail;
            let db = self.bar0.r32(doorbell_slot(q, DB_TAIL));
            if db != tail {
                return Err(format!(
                    "queue {q}: DB_TAIL reads {db} after entering mapped mode, the queue's tail is {tail}"
                ));
            }
        }
        Ok(())
    }

    /// How queue `q` publishes its tails.
    pub fn doorbell(&self, q: u32) -> Doorbell {
        self.queues[q as usize].doorbell
    }

    /// Routes the device's vectors to eventfds (`VFIO_DEVICE_SET_IRQS`) and checks that the
    /// function has MSI-X (MSI) enabled afterwards.
    fn enable_interrupts(
        vfio: &Vfio,
        mode: IrqMode,
        bar0: &BarMap,
    ) -> Result<InterruptSource, String> {
        let nvec = vfio.vectors(mode);
        let want = mode.vectors();
        check_vector_count_register(bar0, mode)?;
        if nvec < want || (mode == IrqMode::Msix && nvec != want) {
            return Err(format!(
                "VFIO offers {nvec} {} vector(s), expected {want}",
                mode.label()
            ));
        }
        let irqs = InterruptSource::new(mode).map_err(|e| format!("eventfds: {e}"))?;
        vfio.enable_irqs(mode, irqs.fds())?;
        let mut cfg = vec![0u8; 256];
        vfio.cfg_read(0, &mut cfg)?;
        let cap = usize::from(pci::find_capability(&cfg, mode.capability()).unwrap_or(0));
        match mode {
            IrqMode::Msix => {
                let ctl = pci::le16(&cfg, cap + MSIX_FLAGS);
                say!(
                    "MSI-X: {nvec} vectors -> eventfds (VFIO_DEVICE_SET_IRQS); message control {ctl:#06x}"
                );
                if ctl & MSIX_FLAGS_ENABLE == 0 {
                    return Err(format!(
                        "MSI-X enable bit clear after SET_IRQS ({ctl:#06x})"
                    ));
                }
            }
            IrqMode::Msi => {
                // vfio-pci virtualizes MSI Message Control: its view shows the enable bit only
                // after a user write, so the device's own state comes from sysfs.
                let virt = pci::le16(&cfg, cap + MSI_FLAGS);
                let mut b = [0u8; 2];
                vfio.sysfs_cfg_read((cap + MSI_FLAGS) as u64, &mut b)?;
                let ctl = u16::from_le_bytes(b);
                say!(
                    "MSI: 1 vector -> eventfd (VFIO_DEVICE_SET_IRQS, {nvec} offered); message control {ctl:#06x} (capability at {cap:#04x}; VFIO's virtual view {virt:#06x})"
                );
                if ctl & MSI_FLAGS_ENABLE == 0 {
                    return Err(format!("MSI enable bit clear after SET_IRQS ({ctl:#06x})"));
                }
            }
        }
        Ok(irqs)
    }

    /// The DMA memory, for CPU access.
    pub fn dma(&self) -> &DmaArena {
        &self.dma
    }

    /// Allocates DMA memory ([`DmaArena::alloc`]).
    pub fn dma_alloc(&mut self, len: u64, align: u64) -> Result<u64, String> {
        self.dma.alloc(len, align)
    }

    /// The current DMA allocation point ([`DmaArena::mark`]).
    pub fn dma_mark(&self) -> Mark {
        self.dma.mark()
    }

    /// Frees the DMA memory allocated after `m` ([`DmaArena::release`]).
    pub fn dma_release(&mut self, m: Mark) {
        self.dma.release(m);
    }

    /// The interrupt mode.
    pub fn irq_mode(&self) -> IrqMode {
        self.irqs.mode()
    }

    /// IOVA of queue `q`'s fence slot.
    pub fn fence_slot(&self, q: u32) -> u64 {
        self.fence_slots + 64 * u64::from(q)
    }

    /// Queue register read.
    pub fn qr32(&self, q: u32, reg: u64) -> u32 {
        self.bar0.r32(queue_reg(q, reg))
    }

    /// Queue register write.
    pub fn qw32(&self, q: u32, reg: u64, v: u32) {
        self.bar0.w32(queue_reg(q, reg), v)
    }

    /// Writes `cmds` into queue `q`'s ring and rings the doorbell once; returns the ring index
    /// of the first command.
    pub fn submit(&mut self, q: u32, cmds: &[Cmd]) -> Result<u32, String> {
        let qs = &self.queues[q as usize];
        let (ring, first) = (qs.ring, qs.tail);
        let n = u32::try_from(cmds.len()).map_err(|e| e.to_string())?;
        if qs.tail.wrapping_sub(qs.done_upto).wrapping_add(n) > RING_ENTRIES {
            // Not enough known-free slots: look at the real head before giving up.
            let head = self.qr32(q, Q_HEAD);
            if qs.tail.wrapping_sub(head).wrapping_add(n) > RING_ENTRIES {
                return Err(format!(
                    "queue {q} ring full (head {head}, tail {})",
                    qs.tail
                ));
            }
        }
        let mut tail = first;
        for c in cmds {
            let slot = u64::from(tail & (RING_ENTRIES - 1));
            self.dma.write(ring + slot * 64, &c.encode())?;
            tail = tail.wrapping_add(1);
            if c.is_job() {
                self.stats.jobs_run += 1;
                self.stats.bytes_moved += c.bytes_moved();
            }
            if c.opcode == crate::cmd::OP_FENCE {
                self.stats.fences += 1;
            }
        }
        self.queues[q as usize].tail = tail;
        self.publish_tail(q, tail);
        Ok(first)
    }

    /// Tells the device that queue `q`'s tail is now `tail` (the ring entries before it are
    /// written): a trapped `Q_DOORBELL` write, or in mapped mode the doorbell page protocol
    /// (crate documentation of `switchyard-softgpu`, "Mapped doorbells").
    fn publish_tail(&mut self, q: u32, tail: u32) {
        self.stats.submissions += 1;
        match self.queues[q as usize].doorbell {
            Doorbell::Trapped => {
                // The ring entries must be visible before the doorbell.
                fence(Ordering::SeqCst);
                self.qw32(q, Q_DOORBELL, tail);
            }
            Doorbell::Mapped => {
                // 1-2. The ring entries are visible before the tail (release).
                fence(Ordering::Release);
                // 3. One aligned 32-bit volatile store into the mapped doorbell page.
                self.bar0.w32(doorbell_slot(q, DB_TAIL), tail);
                // 4. Full fence (mfence): the tail store is ordered before the load below, so
                //    either the engine sees the tail or this sees its DB_NEED_KICK.
                fence(Ordering::SeqCst);
                // 5. The engine sleeps: kick it (trapped; the value is ignored).
                if self.bar0.r32(doorbell_slot(q, DB_NEED_KICK)) != 0 {
                    self.stats.kicks += 1;
                    self.qw32(q, Q_DOORBELL, tail);
                }
            }
        }
    }

    /// Appends a FENCE that raises `vector` and returns its value.
    pub fn submit_fence(&mut self, q: u32, vector: u32) -> Result<u64, String> {
        self.push_fence(q, Some(vector))
    }

    /// Appends a FENCE without an interrupt and returns its value.
    pub fn submit_fence_silent(&mut self, q: u32) -> Result<u64, String> {
        self.push_fence(q, None)
    }

    fn push_fence(&mut self, q: u32, vector: Option<u32>) -> Result<u64, String> {
        let seq = self.queues[q as usize].seq + 1;
        self.queues[q as usize].seq = seq;
        if vector.is_none() {
            self.stats.silent_fences += 1;
        }
        let slot = self.fence_slot(q);
        self.submit(q, &[Cmd::fence(Addr::Iova(slot), seq, vector)])?;
        let tail = self.queues[q as usize].tail;
        self.queues[q as usize].outstanding.push((seq, tail));
        Ok(seq)
    }

    /// Submits `cmd` and a FENCE without interrupt behind it with one doorbell; returns the
    /// fence value (for [`Gpu::poll_fence`]).
    pub fn submit_with_silent_fence(&mut self, q: u32, cmd: Cmd) -> Result<u64, String> {
        let seq = self.queues[q as usize].seq + 1;
        self.queues[q as usize].seq = seq;
        self.stats.silent_fences += 1;
        let fence_cmd = Cmd::fence(Addr::Iova(self.fence_slot(q)), seq, None);
        self.submit(q, &[cmd, fence_cmd])?;
        let tail = self.queues[q as usize].tail;
        self.queues[q as usize].outstanding.push((seq, tail));
        Ok(seq)
    }

    /// Spins until fence `seq` of queue `q` is in DMA memory, reading the fence slot only (no
    /// interrupt, no register access), bounded by the timeout.
    pub fn poll_fence(&mut self, q: u32, seq: u64) -> Result<(), String> {
        let slot = self.fence_slot(q);
        let deadline = Instant::now() + self.timeout;
        let mut spins = 0u32;
        while self.dma.read_u64(slot)? < seq {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) && Instant::now() >= deadline {
                return Err(format!(
                    "timeout after {} s polling fence {seq} on queue {q} ({} doorbell): fence slot {}, STATUS {}, HEAD {}, TAIL {}, ERROR_CODE {}",
                    self.timeout.as_secs(),
                    self.doorbell(q).name(),
                    self.dma.read_u64(slot).unwrap_or(u64::MAX),
                    status_name(self.qr32(q, Q_STATUS)),
                    self.qr32(q, Q_HEAD),
                    self.qr32(q, Q_TAIL),
                    error_name(self.qr32(q, Q_ERROR_CODE))
                ));
            }
            std::hint::spin_loop();
        }
        // Acquire (and the bookkeeping of the outstanding fences).
        self.fence_done(q, seq).map(|_| ())
    }

    /// Submits `cmds` followed by a FENCE on the queue's completion vector; returns its value.
    pub fn submit_batch(&mut self, q: u32, cmds: &[Cmd]) -> Result<u64, String> {
        self.submit(q, cmds)?;
        self.submit_fence(q, q)
    }

    /// Blocks until one of `events` arrives (see [`InterruptSource::wait_any`]), recording the
    /// `INT_STATUS` bits the interrupt handler acknowledged on the way.
    pub fn wait_event(&mut self, events: &[Event], deadline: Instant) -> Result<Event, WaitError> {
        let (ev, st) = self.irqs.wait_any(&self.bar0, events, deadline)?;
        self.stats.int_status_seen |= st;
        Ok(ev)
    }

    /// Runs the interrupt handler for whatever is signalled already (no blocking).
    pub fn collect_interrupts(&mut self) -> Result<(), String> {
        let st = self.irqs.collect(&self.bar0).map_err(|e| e.to_string())?;
        self.stats.int_status_seen |= st;
        Ok(())
    }

    fn fence_done(&mut self, q: u32, seq: u64) -> Result<bool, String> {
        fence(Ordering::SeqCst);
        let v = self.dma.read_u64(self.fence_slot(q))?;
        let qs = &mut self.queues[q as usize];
        if let Some(&(_, tail)) = qs.outstanding.iter().rev().find(|(s, _)| *s <= v) {
            qs.done_upto = tail;
        }
        qs.outstanding.retain(|(s, _)| *s > v);
        Ok(v >= seq)
    }

    fn fault(&mut self, q: u32, ev: Event) -> QueueFault {
        let code = self.qr32(q, Q_ERROR_CODE);
        if code == ERR_INTERRUPTED {
            self.stats.interrupted += 1;
        }
        QueueFault {
            queue: q,
            status: self.qr32(q, Q_STATUS),
            code: self.qr32(q, Q_ERROR_CODE),
            index: self.qr32(q, Q_ERROR_INDEX),
            addr: self.bar0.r64(queue_reg(q, Q_ERROR_ADDR)),
            opcode: self.qr32(q, Q_ERROR_OPCODE),
            vector: self.irqs.vector_of(ev),
            delivery: self.irqs.delivery(),
        }
    }

    /// Whether fence `seq` of queue `q` is already in memory (no waiting; for fences without
    /// an interrupt whose completion is known by other means).
    pub fn fence_landed(&mut self, q: u32, seq: u64) -> Result<bool, String> {
        self.fence_done(q, seq)
    }

    /// Waits for fence `seq` of queue `q`, which raises MSI-X `vector`, by sleeping until its
    /// completion interrupt or the queue's error interrupt arrives: in MSI-X mode the eventfds
    /// of `vector` and of the queue's error vector, in MSI mode the MSI eventfd with
    /// `INT_STATUS` bit q or 16+q. The wait ends when the interrupt has arrived *and* the fence
    /// value is in DMA memory (the handler has acknowledged `INT_STATUS` before the fence slot
    /// is read, so a completion is never acknowledged unseen): every interrupting fence must
    /// deliver its interrupt (the workload keeps at most one such fence outstanding per vector
    /// and queue, so coalescing cannot merge two). Device registers are read only in the
    /// interrupt handler (`INT_STATUS`/`INT_ACK`) and when the error interrupt fires.
    pub fn wait_fence_on(&mut self, q: u32, seq: u64, vector: u32) -> Result<Completion, String> {
        let deadline = Instant::now() + self.timeout;
        let done = Event::Completion { queue: q, vector };
        let err = Event::Error {
            queue: q,
            vector: 8 + q,
        };
        let mut interrupted = false;
        loop {
            if interrupted && self.fence_done(q, seq)? {
                self.stats.fence_irq_waits += 1;
                return Ok(Completion::Fence);
            }
            match self.wait_event(&[done, err], deadline) {
                Ok(ev) if ev == err => {
                    let f = self.fault(q, ev);
                    if f.status == Q_STATUS_ERROR {
                        return Ok(Completion::Fault(f));
                    }
                }
                Ok(_) => interrupted = true,
                Err(WaitError::Timeout) => {
                    return Err(format!(
                        "timeout after {} s waiting for fence {seq} on queue {q} ({} vector {}, interrupt {}): fence slot {}, STATUS {}, HEAD {}, TAIL {}, INT_STATUS {:#x}",
                        self.timeout.as_secs(),
                        self.irqs.delivery().label(),
                        self.irqs.vector_of(done),
                        if interrupted {
                            "received"
                        } else {
                            "not received"
                        },
                        self.dma.read_u64(self.fence_slot(q)).unwrap_or(u64::MAX),
                        status_name(self.qr32(q, Q_STATUS)),
                        self.qr32(q, Q_HEAD),
                        self.qr32(q, Q_TAIL),
                        self.bar0.r32(INT_STATUS)
                    ));
                }
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    /// [`Gpu::wait_fence_on`] the queue's completion vector; a fault is an error.
    pub fn wait_fence(&mut self, q: u32, seq: u64) -> Result<(), String> {
        match self.wait_fence_on(q, seq, q)? {
            Completion::Fence => Ok(()),
            Completion::Fault(f) => Err(f.to_string()),
        }
    }

    /// Submits a batch and waits for its fence.
    pub fn run(&mut self, q: u32, cmds: &[Cmd]) -> Result<(), String> {
        let seq = self.submit_batch(q, cmds)?;
        self.wait_fence(q, seq)
    }

    /// After a command was interrupted by a device restart: every queue in the error state is
    /// recovered (the interrupted command skipped) and every queue runs dry, so that nothing
    /// submitted before still writes memory when the work is submitted again.
    pub fn settle(&mut self) -> Result<(), String> {
        let deadline = Instant::now() + self.timeout;
        for q in 0..self.nq {
            loop {
                match self.qr32(q, Q_STATUS) {
                    Q_STATUS_ERROR => {
                        let code = self.qr32(q, Q_ERROR_CODE);
                        if code != ERR_INTERRUPTED {
                            return Err(format!(
                                "queue {q} stopped on {} while settling",
                                error_name(code)
                            ));
                        }
                        self.recover(q);
                    }
                    Q_STATUS_IDLE => break,
                    st => {
                        if Instant::now() >= deadline {
                            return Err(format!(
                                "queue {q} still {} after {} s",
                                status_name(st),
                                self.timeout.as_secs()
                            ));
                        }
                        std::thread::sleep(Duration::from_millis(2));
                    }
                }
            }
            // Everything submitted ran: its fences are done.
            let tail = self.queues[q as usize].tail;
            let queue = &mut self.queues[q as usize];
            queue.outstanding.clear();
            queue.done_upto = tail;
        }
        Ok(())
    }

    /// Leaves the error state: acknowledge, `RECOVER | ENABLE` (skips the faulting command).
    pub fn recover(&mut self, q: u32) {
        self.bar0.w32(INT_ACK, int_error(q));
        // The mode bit too: every Q_CONTROL write sets the doorbell mode.
        let mode = self.queues[q as usize].doorbell.control_bits();
        self.qw32(q, Q_CONTROL, Q_CONTROL_RECOVER | Q_CONTROL_ENABLE | mode);
    }

    /// Stops every queue, waits (bounded) for the engines to let go, turns bus mastering and
    /// MSI-X (MSI) off and removes the DMA mappings. Idempotent; errors are reported, not fatal.
    pub fn shutdown(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.shut_down {
            return problems;
        }
        self.shut_down = true;
        for q in 0..self.nq {
            self.qw32(q, Q_CONTROL, Q_CONTROL_RESET);
        }
        // Teardown only: bounded wait for the engines to drop their commands before the DMA
        // memory goes away.
        let deadline = Instant::now() + Duration::from_secs(10);
        for q in 0..self.nq {
            while self.qr32(q, Q_STATUS) != Q_STATUS_STOPPED {
                if Instant::now() >= deadline {
                    problems.push(format!("queue {q} did not stop"));
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if !problems.is_empty() {
            // Memory outside an IOMMU the device may still write: never freed.
            self.dma.leak();
        }
        let cmd = pci::le16(&self.config, pci::PCI_COMMAND) | pci::PCI_COMMAND_MEMORY;
        if let Err(e) = self.dev.cfg_write(
            pci::PCI_COMMAND as u64,
            &(cmd & !pci::PCI_COMMAND_MASTER).to_le_bytes(),
        ) {
            problems.push(e);
        }
        if self.irqs_enabled {
            if let Err(e) = self.dev.disable_irqs(self.irqs.mode()) {
                problems.push(e);
            }
            self.irqs_enabled = false;
        }
        problems.extend(self.dma.unmap());
        problems.extend(self.dev.release());
        problems
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        for p in self.shutdown() {
            say!("shutdown: {p}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Config space that reads zeros and takes every write.
    #[derive(Debug)]
    struct NoDevice;

    impl DeviceAccess for NoDevice {
        fn cfg_read(&self, _offset: u64, buf: &mut [u8]) -> Result<(), String> {
            buf.fill(0);
            Ok(())
        }

        fn cfg_write(&self, _offset: u64, _data: &[u8]) -> Result<(), String> {
            Ok(())
        }

        fn disable_irqs(&self, _mode: IrqMode) -> Result<(), String> {
            Ok(())
        }
    }

    /// BAR0 as a plain file (no device behind it: registers read what was last written) with
    /// `features` in FEATURES and both queues IDLE (else STOPPED), and a [`Gpu`] on it with
    /// `doorbell`.
    fn gpu_on_a_file(
        features: u32,
        idle: bool,
        doorbell: Doorbell,
    ) -> (std::fs::File, Result<Gpu, String>) {
        let mut f = tempfile::tempfile().expect("tempfile");
        f.write_all(&vec![0u8; BAR0_SIZE as usize]).expect("write");
        let bar0 = BarMap::map(&f, 0, &[(0, BAR0_SIZE)]).expect("map");
        bar0.w32(FEATURES, features);
        if idle {
            for q in 0..2 {
                bar0.w32(queue_reg(q, Q_STATUS), Q_STATUS_IDLE);
            }
        }
        let vram = BarMap::map(&f, 0, &[(0, 4096)]).expect("map");
        let gpu = Gpu::from_parts(Parts {
            bar0,
            vram,
            irqs: InterruptSource::polled(IrqMode::Msix),
            dma: DmaArena::new(DMA_BASE_IOVA, 1 << 20, 1).expect("arena"),
            dev: Box::new(NoDevice),
            nq: 2,
            vram_size: 4096,
            config: vec![0; 256],
            timeout: Duration::from_secs(1),
            unmapped_addr: UNMAPPED_IOVA,
            doorbell,
        });
        (f, gpu)
    }

    /// Lets [`Gpu::shutdown`] find every queue stopped.
    fn stop_queues(g: &Gpu) {
        for q in 0..g.nq {
            g.bar0.w32(queue_reg(q, Q_STATUS), Q_STATUS_STOPPED);
        }
    }

    #[test]
    fn mapped_doorbells_store_the_tail_and_kick_only_a_sleeping_engine() {
        let (_f, g) = gpu_on_a_file(FEATURES_VALUE, true, Doorbell::Mapped);
        let mut g = g.expect("gpu");
        for q in 0..2 {
            assert_eq!(g.doorbell(q), Doorbell::Mapped);
            assert_eq!(
                g.qr32(q, Q_CONTROL),
                Q_CONTROL_ENABLE | Q_CONTROL_MAPPED,
                "queue {q} enabled in mapped mode"
            );
        }
        // The engine runs (DB_NEED_KICK 0): the tail goes to the page only.
        g.submit(1, &[Cmd::nop(), Cmd::nop()]).expect("submit");
        assert_eq!(g.bar0.r32(doorbell_slot(1, DB_TAIL)), 2);
        assert_eq!(g.qr32(1, Q_DOORBELL), 0, "no trapped write");
        assert_eq!((g.stats.submissions, g.stats.kicks), (1, 0));
        // The engine sleeps: the tail, then a kick.
        g.bar0.w32(doorbell_slot(1, DB_NEED_KICK), 1);
        g.submit(1, &[Cmd::nop()]).expect("submit");
        assert_eq!(g.bar0.r32(doorbell_slot(1, DB_TAIL)), 3);
        assert_eq!(g.qr32(1, Q_DOORBELL), 3, "kicked");
        assert_eq!((g.stats.submissions, g.stats.kicks), (2, 1));
        // Queue 0's slot is its own.
        assert_eq!(g.bar0.r32(doorbell_slot(0, DB_TAIL)), 0);
        // RECOVER keeps the mode (every Q_CONTROL write sets it).
        g.recover(1);
        assert_eq!(
            g.qr32(1, Q_CONTROL),
            Q_CONTROL_RECOVER | Q_CONTROL_ENABLE | Q_CONTROL_MAPPED
        );
        // Back to trapped: Q_DOORBELL carries the tail, the page is left alone.
        g.enable_queue(1, Doorbell::Trapped).expect("trapped");
        g.bar0.w32(doorbell_slot(1, DB_NEED_KICK), 0);
        g.submit(1, &[Cmd::nop()]).expect("submit");
        assert_eq!(g.qr32(1, Q_DOORBELL), 4);
        assert_eq!(g.bar0.r32(doorbell_slot(1, DB_TAIL)), 3);
        assert_eq!((g.stats.submissions, g.stats.kicks), (3, 1));
        // Entering mapped mode again: the device would have stored TAIL (4) into DB_TAIL; a
        // page that does not hold it is refused.
        assert!(
            g.enable_queue(1, Doorbell::Mapped)
                .is_err_and(|e| e.contains("DB_TAIL reads 3")),
        );
        stop_queues(&g);
        assert!(g.shutdown().is_empty());
    }

    #[test]
    fn trapped_doorbells_never_touch_the_page() {
        let (_f, g) = gpu_on_a_file(FEATURES_VALUE, true, Doorbell::Trapped);
        let mut g = g.expect("gpu");
        assert_eq!(g.qr32(0, Q_CONTROL), Q_CONTROL_ENABLE);
        g.bar0.w32(doorbell_slot(0, DB_NEED_KICK), 1);
        g.submit(0, &[Cmd::nop()]).expect("submit");
        assert_eq!(g.qr32(0, Q_DOORBELL), 1);
        assert_eq!(g.bar0.r32(doorbell_slot(0, DB_TAIL)), 0);
        assert_eq!((g.stats.submissions, g.stats.kicks), (1, 0));
        g.recover(0);
        assert_eq!(g.qr32(0, Q_CONTROL), Q_CONTROL_RECOVER | Q_CONTROL_ENABLE);
        stop_queues(&g);
        assert!(g.shutdown().is_empty());
    }

    #[test]
    fn mapped_doorbells_need_the_feature() {
        let (_f, g) = gpu_on_a_file(0xff, false, Doorbell::Mapped);
        let e = g.expect_err("a version 1.0 device has no doorbell page");
        assert!(e.contains("FEATURES 0xff lacks bit 8"), "{e}");
        // Trapped doorbells work without it.
        let (_f, g) = gpu_on_a_file(0xff, true, Doorbell::Trapped);
        let g = g.expect("gpu");
        stop_queues(&g);
        drop(g);
        for d in Doorbell::ALL {
            assert_eq!(Doorbell::parse(d.name()), Some(d));
        }
        assert_eq!(Doorbell::parse("shadow"), None);
    }
}
