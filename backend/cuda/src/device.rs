//! The softgpu's commands on a GPU: the [`Accelerator`] of a `cuda` board.
//!
//! **Memory.** Guest DMA windows are mapped by the backend itself (its own shared mapping of
//! the client's file) and registered with the GPU when the client maps them (the
//! [`DmaObserver`], which the DMA space calls with none of its locks held), unregistered
//! when it unmaps them. A command takes its own reference to each registration it uses
//! and drops the windows' lock before it runs on the GPU, so an unmap never waits for a lock
//! held across a stream synchronization: it removes the windows under a short write lock,
//! then waits (with no lock) for the commands still using them, at most [`UNMAP_WAIT`]
//! ([`CudaDevice::set_unmap_wait`]). A command still running then (a GPU that hangs) keeps
//! its registration, which goes away when the command ends; the unmap is answered anyway,
//! logged and counted ([`Stats::late_unmaps`]), rather than stall the connection. VRAM is the device's memfd, registered likewise, with a working copy in
//! GPU memory (`vram` bytes: the board's memory quota).
//!
//! **Which copy is authoritative.** The memfd, always (see `switchyard_softgpu::accel`): a
//! command that writes VRAM writes the GPU copy and then the memfd (write-through) before it
//! completes; writes the server makes to the memfd (trapped BAR2 writes, resets, a
//! migration's restore, a command the CPU path ran) mark the GPU copy's chunks stale, and a
//! command uploads the stale chunks it touches first. A new device (a replacement process, a
//! failover, a move's successor) starts with every chunk stale. So a worker killed at any
//! point, a move, a migration or a failover read VRAM from the memfd as on any softgpu.
//! Stale chunks are uploaded in a batch of their own before the command's; while that runs
//! they are in flight, and a command on another queue that touches one waits for the upload
//! (the GPU copy is not written yet) rather than read it.
//!
//! **Guest memory the GPU writes** (a COPY into it, a kernel's output staged out) is written
//! by the GPU's DMA, past the DMA space's accessors: the command marks it dirty itself
//! ([`switchyard_device::DmaSpace::mark_dirty`]), so a live migration copies it again.
//!
//! **A batch stopped partway** by a transient error (an operation the GPU could not take)
//! before any of its output was written is declined: the CPU path runs the command on what is
//! still untouched. Once a piece was written back, the command's output is partly done (an
//! in-place SAXPY run again would be applied twice there): the batch is resumed where it
//! stopped ([`RESUME_TRIES`]), and the board is lost if it cannot be finished.
//!
//! **Commands.** COPY and FILL are copies (DMA engines) and a memset; SAXPY and REDUCE are
//! kernels, GEMM is cuBLAS; guest operands of kernels are staged through per-queue GPU
//! buffers. One stream per queue; the engine thread of the queue waits for its stream to
//! complete (it polls for at most `switchyard_sys::cuda::SPIN`, then sleeps in a blocking
//! synchronization), then the softgpu publishes
//! the completion and raises the interrupt. A command the GPU cannot take (a window without
//! a file or registration, read-only memory, overlapping operands whose result depends on the
//! CPU path's order, a FILL of a partial word, a GPU short of memory) is declined and the CPU
//! path runs it.
//!
//! **A lost board.** A sticky error (the GPU faulted or fell off the bus) is latched: that
//! command and every later one get [`AccelOutcome::Lost`], and the softgpu reports its board
//! failed with its state intact (the memfd), so a pool fails it over.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, RwLock, Weak};
use std::time::Duration;

use switchyard_device::{DmaObserver, DmaProt};
use switchyard_softgpu::accel::{AccelDevice, AccelError, AccelOutcome, AccelTarget, Accelerator};
use switchyard_softgpu::cmd::{self, Command, Operand};
use switchyard_sys::cuda::REDUCE_PARTS;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, MmapRegion};

use crate::gpu::{Gpu, GpuError, Mem, Offload, Op};

mod plan;
mod registrar;
mod stale;

use plan::{Plan, piece_count, pieces};
use registrar::Registrar;

/// Granule of the GPU copy's staleness (uploads are whole chunks).
pub const CHUNK: u64 = 64 << 10;

/// How long an unmap waits for the commands using its windows before it is answered anyway
/// (see the module docs).
pub const UNMAP_WAIT: Duration = Duration::from_secs(5);

/// A GPU as the accelerator of softgpu devices (one per board; devices of several
/// partitions share the GPU).
pub struct CudaAccel<G: Gpu> {
    gpu: Arc<G>,
}

impl<G: Gpu> CudaAccel<G> {
    /// The accelerator of `gpu`.
    pub fn new(gpu: Arc<G>) -> Self {
        Self { gpu }
    }
}

impl<G: Gpu> std::fmt::Debug for CudaAccel<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("CudaAccel")
            .field(&self.gpu.describe())
            .finish()
    }
}

fn map_file(file: &File, offset: u64, size: u64, writable: bool) -> Result<MmapRegion<()>, String> {
    let len = usize::try_from(size).map_err(|_| format!("{size} bytes do not fit"))?;
    let file = file.try_clone().map_err(|e| e.to_string())?;
    let prot = if writable {
        libc::PROT_READ | libc::PROT_WRITE
    } else {
        libc::PROT_READ
    };
    MmapRegionBuilder::<()>::new(len)
        .with_file_offset(FileOffset::new(file, offset))
        .with_mmap_prot(prot)
        .with_mmap_flags(libc::MAP_SHARED)
        .build()
        .map_err(|e| e.to_string())
}

impl<G: Gpu> Accelerator for CudaAccel<G> {
    fn describe(&self) -> String {
        let offload = self.gpu.offload();
        if offload.all() {
            self.gpu.describe()
        } else {
            format!("{}: {}", self.gpu.describe(), offload.describe())
        }
    }

    fn open(&self, t: AccelTarget) -> Result<Arc<dyn AccelDevice>, AccelError> {
        let fail = |message: String| AccelError {
            what: self.gpu.describe(),
            message,
        };
        let len = usize::try_from(t.vram_size).map_err(|_| fail("VRAM too large".into()))?;
        let region = map_file(&t.vram, 0, t.vram_size, true)
            .map_err(|e| fail(format!("cannot map VRAM: {e}")))?;
        let vram_host = self
            .gpu
            .register(Arc::new(region))
            .map_err(|e| fail(format!("cannot register VRAM: {e}")))?;
        let vram_dev = self.gpu.alloc(len).map_err(|e| {
            fail(format!(
                "cannot allocate {} MiB of GPU memory for VRAM: {e}",
                t.vram_size >> 20
            ))
        })?;
        let mut queues = Vec::with_capacity(t.queues);
        for _ in 0..t.queues {
            queues.push(Mutex::new(Queue {
                stream: self
                    .gpu
                    .stream()
                    .map_err(|e| fail(format!("cannot create a stream: {e}")))?,
                staging: Default::default(),
                partial: self
                    .gpu
                    .alloc(REDUCE_PARTS * 4 + 4)
                    .map_err(|e| fail(format!("cannot allocate scratch: {e}")))?,
            }));
        }
        let chunks = t.vram_size.div_ceil(CHUNK);
        let device = Arc::new_cyclic(|me| CudaDevice {
            me: me.clone(),
            gpu: self.gpu.clone(),
            dma: t.dma,
            staging_budget: staging_budget(t.vram_size),
            staging_used: AtomicU64::new(0),
            released: Mutex::new(0),
            released_cv: Condvar::new(),
            unmap_wait_us: AtomicU64::new(UNMAP_WAIT.as_micros() as u64),
            vram_size: t.vram_size,
            vram_host,
            vram_dev,
            // Nothing is on the GPU yet.
            stale: (0..chunks.div_ceil(64))
                .map(|w| {
                    let left = chunks - w * 64;
                    AtomicU64::new(if left >= 64 {
                        u64::MAX
                    } else {
                        (1u64 << left) - 1
                    })
                })
                .collect(),
            offload: self.gpu.offload(),
            in_flight: Mutex::new(vec![0; chunks.div_ceil(64) as usize].into_boxed_slice()),
            in_flight_cv: Condvar::new(),
            windows: RwLock::new(BTreeMap::new()),
            queues,
            lost: OnceLock::new(),
            stats: Stats::default(),
        });
        Ok(device as Arc<dyn AccelDevice>)
    }
}

/// GPU memory a device of `vram` bytes may take beyond its VRAM for staging guest operands of
/// kernels: a quarter of its VRAM, at least 64 MiB. What a guest can make its partition take
/// of the GPU is its quota plus this: other partitions of the GPU keep theirs. A kernel whose
/// guest operands need more is run by the CPU path.
pub fn staging_budget(vram: u64) -> u64 {
    (vram / 4).max(64 << 20)
}

/// A guest DMA window: its registration, or `None` if the GPU cannot reach it. Commands hold
/// their own reference to the registration while they run; it is unregistered when the last
/// one goes.
struct Window<G: Gpu> {
    size: u64,
    host: Option<Arc<G::Host>>,
}

/// The registrations a command uses (window start, registration), taken under the windows'
/// read lock and held, without it, while the command runs; dropping them tells a waiting
/// unmap.
struct Held<'a, G: Gpu> {
    device: &'a CudaDevice<G>,
    hosts: Vec<(u64, Arc<G::Host>)>,
}

impl<G: Gpu> Held<'_, G> {
    fn get(&self, window: u64) -> Option<&G::Host> {
        self.hosts
            .iter()
            .find(|(start, _)| *start == window)
            .map(|(_, h)| &**h)
    }
}

impl<G: Gpu> Drop for Held<'_, G> {
    fn drop(&mut self) {
        if self.hosts.is_empty() {
            return;
        }
        self.hosts.clear();
        let d = self.device;
        let mut released = d.released.lock().unwrap_or_else(|p| p.into_inner());
        *released = released.wrapping_add(1);
        d.released_cv.notify_all();
    }
}

/// A queue's stream and staging buffers.
struct Queue<G: Gpu> {
    stream: G::Stream,
    /// Up to three staged guest operands, grown as needed.
    staging: [Option<(G::Buf, usize)>; 3],
    /// REDUCE's partial sums, then its result.
    partial: G::Buf,
}

/// What a device's accelerator did (tests and telemetry).
#[derive(Debug, Default)]
pub struct Stats {
    /// Commands run on the GPU.
    pub offloaded: AtomicU64,
    /// Commands declined (run by the CPU path).
    pub declined: AtomicU64,
    /// Chunks of VRAM uploaded to the GPU copy.
    pub uploads: AtomicU64,
    /// Unmaps answered while a command still used the window ([`UNMAP_WAIT`]).
    pub late_unmaps: AtomicU64,
    /// Commands that waited for another queue's upload of a chunk they touch.
    pub upload_waits: AtomicU64,
    /// Batches resumed after a transient error had stopped them with their output partly
    /// written ([`RESUME_TRIES`]).
    pub resumed: AtomicU64,
}

/// How often a batch stopped by a transient error after its output was partly written is
/// resumed where it stopped; after that the board is lost (the command cannot be handed to
/// the CPU path: an in-place SAXPY would be applied twice to what was written).
pub const RESUME_TRIES: u32 = 2;

/// One device's use of a GPU.
pub struct CudaDevice<G: Gpu> {
    /// Itself, for its DMA observer.
    me: Weak<CudaDevice<G>>,
    gpu: Arc<G>,
    /// The client's windows, for those mapped before the device.
    dma: Arc<switchyard_device::DmaSpace>,
    /// GPU memory the staging buffers may take ([`staging_budget`]), and take now.
    staging_budget: u64,
    staging_used: AtomicU64,
    /// Counts commands that let go of registrations; an unmap waits on `released_cv` for
    /// those of its windows. Protects nothing else, and is never held while a command runs.
    released: Mutex<u64>,
    released_cv: Condvar,
    /// How long an unmap waits for the commands using its windows (µs).
    unmap_wait_us: AtomicU64,
    vram_size: u64,
    vram_host: G::Host,
    vram_dev: G::Buf,
    /// Which commands the GPU can run; the others are declined before anything is staged.
    offload: Offload,
    /// One bit per [`CHUNK`] of VRAM: the GPU copy is stale.
    stale: Box<[AtomicU64]>,
    /// One bit per [`CHUNK`] of VRAM: a command is uploading it (its stale bit taken, the
    /// copy not finished). Protects only these bits: taken and given back around an upload's
    /// own batch, never held while it runs. A command touching a chunk in flight waits on
    /// `in_flight_cv` until the upload is done (it would read GPU memory not yet written).
    in_flight: Mutex<Box<[u64]>>,
    in_flight_cv: Condvar,
    /// Registered windows by IOVA. Read-locked only to look operands up (a command clones the
    /// registrations it needs and drops the lock before it runs), write-locked to add or remove
    /// a window: never held across GPU work or a registration.
    windows: RwLock<BTreeMap<u64, Window<G>>>,
    queues: Vec<Mutex<Queue<G>>>,
    /// The sticky error the board was lost with.
    lost: OnceLock<String>,
    stats: Stats,
}

impl<G: Gpu> std::fmt::Debug for CudaDevice<G> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("gpu", &self.gpu.describe())
            .field("vram_size", &self.vram_size)
            .field("lost", &self.lost.get())
            .finish_non_exhaustive()
    }
}

/// Where a command operand is, once resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    /// In VRAM at an offset.
    Vram(u64),
    /// In the registered window at `iova`, at an offset into it.
    Guest { window: u64, off: u64 },
}

/// Why a command is not run on the GPU.
enum Skip {
    /// The CPU path runs it.
    Decline,
    /// The board is lost.
    Lost(String),
}

impl From<GpuError> for Skip {
    fn from(e: GpuError) -> Self {
        if e.sticky {
            Skip::Lost(e.message)
        } else {
            tracing::debug!(error = %e.message, "GPU declined a command");
            Skip::Decline
        }
    }
}

fn usize_of(v: u64) -> Result<usize, Skip> {
    usize::try_from(v).map_err(|_| Skip::Decline)
}

impl<G: Gpu> CudaDevice<G> {
    /// What the accelerator did so far.
    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// Guest windows registered with the GPU now.
    pub fn registered_windows(&self) -> usize {
        let w = self.windows.read().unwrap_or_else(|p| p.into_inner());
        w.values().filter(|w| w.host.is_some()).count()
    }

    /// Sets how long an unmap waits for the commands using its windows ([`UNMAP_WAIT`]).
    pub fn set_unmap_wait(&self, wait: Duration) {
        let us = u64::try_from(wait.as_micros()).unwrap_or(u64::MAX);
        self.unmap_wait_us.store(us, Ordering::Relaxed);
    }

    /// Whether the board was lost, and why.
    pub fn lost(&self) -> Option<&str> {
        self.lost.get().map(String::as_str)
    }

    /// The client maps a window (the DMA observer, with no lock held: the registration takes
    /// 38 ms/GiB): it is registered, or recorded as one the GPU does not reach. Commands may
    /// use it from here on (a whole registration: nothing half-done is reachable).
    fn register_window(&self, iova: u64, size: u64, prot: DmaProt, file: Option<(&File, u64)>) {
        let host = self.registration(iova, size, prot, file).map(Arc::new);
        let mut w = self.windows.write().unwrap_or_else(|p| p.into_inner());
        w.insert(iova, Window { size, host });
    }

    /// A registration of the window, or `None` (logged) if the GPU cannot reach it.
    fn registration(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        file: Option<(&File, u64)>,
    ) -> Option<G::Host> {
        let Some((file, offset)) = file else {
            tracing::debug!(
                iova,
                size,
                "a window without a file: its commands run on the CPU"
            );
            return None;
        };
        if !prot.write {
            // Registering read-only pages needs a flag not every driver has; the CPU path
            // reads them.
            tracing::debug!(
                iova,
                size,
                "a read-only window: its commands run on the CPU"
            );
            return None;
        }
        let registered = map_file(file, offset, size, true)
            .map_err(GpuError::transient)
            .and_then(|region| self.gpu.register(Arc::new(region)));
        match registered {
            Ok(host) => Some(host),
            Err(e) => {
                if e.sticky {
                    let _ = self.lost.set(e.message.clone());
                }
                tracing::debug!(iova, size, error = %e, "window not registered: its commands run on the CPU");
                None
            }
        }
    }

    /// A window mapped before this device was attached (a move's successor, a swap): found
    /// in the DMA table and registered now. Returns whether the table had it.
    fn register_late(&self, iova: u64) -> bool {
        // Only a window whose observer accepted it (a pending one is not found).
        let Some(b) = self.dma.window_backing(iova) else {
            return false;
        };
        // Registered with no lock held.
        let host = self
            .registration(b.iova, b.size, b.prot, Some((&b.file, b.offset)))
            .map(Arc::new);
        let mut w = self.windows.write().unwrap_or_else(|p| p.into_inner());
        // Checked under our lock (lock order: ours, then the DMA table's; the table calls us
        // with none of its locks held). An unmap marks the window retiring before it tells us,
        // and its `unmapped` takes our lock: either the window is still current here and that
        // call removes what we keep, or it is not and we keep nothing.
        if !self.dma.window_is_current(b.iova, b.generation) {
            return false;
        }
        w.entry(b.iova).or_insert(Window { size: b.size, host });
        true
    }

    /// Where `len` bytes at `op` are: VRAM, or inside one registered window; `Err(None)`
    /// when no window we know of holds it.
    fn place(
        windows: &BTreeMap<u64, Window<G>>,
        op: Operand,
        len: u64,
    ) -> Result<Place, Option<Skip>> {
        match op {
            Operand::Vram(off) => Ok(Place::Vram(off)),
            Operand::Guest(iova) => {
                let (&start, w) = windows.range(..=iova).next_back().ok_or(None)?;
                let off = iova - start;
                if off >= w.size {
                    return Err(None);
                }
                if w.host.is_some() && off.checked_add(len).is_some_and(|end| end <= w.size) {
                    Ok(Place::Guest { window: start, off })
                } else {
                    Err(Some(Skip::Decline))
                }
            }
        }
    }

    /// Where the operands of `plan` are, registering windows mapped before the device, with
    /// the registrations of the windows they are in (held until the command is done; the
    /// windows' lock is not).
    fn places(&self, plan: &Plan) -> Result<(Vec<Place>, Held<'_, G>), Skip> {
        let mut late = false;
        loop {
            let windows = self.windows.read().unwrap_or_else(|p| p.into_inner());
            let mut places = Vec::with_capacity(plan.operands.len());
            let mut missing = None;
            for &(op, len, _) in &plan.operands {
                match Self::place(&windows, op, len) {
                    Ok(p) => places.push(p),
                    Err(Some(skip)) => return Err(skip),
                    Err(None) => {
                        missing = Some(op.addr());
                        break;
                    }
                }
            }
            let Some(iova) = missing else {
                let mut held = Held {
                    device: self,
                    hosts: Vec::new(),
                };
                for p in &places {
                    if let Place::Guest { window, .. } = *p
                        && held.get(window).is_none()
                        && let Some(h) = windows.get(&window).and_then(|w| w.host.as_ref())
                    {
                        held.hosts.push((window, Arc::clone(h)));
                    }
                }
                return Ok((places, held));
            };
            drop(windows);
            if late || !self.register_late(iova) {
                return Err(Skip::Decline);
            }
            late = true;
        }
    }

    /// Trades a staging buffer of `old` bytes for one of `new` within the budget (the old
    /// one is freed by the caller); declined beyond it: the CPU path runs the command.
    fn reserve_staging(&self, old: usize, new: usize) -> Result<(), Skip> {
        let (old, new) = (old as u64, new as u64);
        let budget = self.staging_budget;
        self.staging_used
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let after = used.saturating_sub(old).checked_add(new)?;
                (after <= budget).then_some(after)
            })
            .map(|_| ())
            .map_err(|_| {
                tracing::debug!(
                    need = new,
                    budget,
                    "staging beyond the budget: the CPU path runs it"
                );
                Skip::Decline
            })
    }

    fn run_command(&self, q: usize, c: &Command) -> Result<(), Skip> {
        if let Some(reason) = self.lost.get() {
            return Err(Skip::Lost(reason.clone()));
        }
        let plan = Plan::of(c)?;
        let runs_here = match c.opcode {
            cmd::OP_SAXPY | cmd::OP_REDUCE => self.offload.no_kernels.is_none(),
            cmd::OP_GEMM => self.offload.no_gemm.is_none(),
            _ => true,
        };
        if !runs_here {
            return Err(Skip::Decline);
        }
        let (places, held) = self.places(&plan)?;
        let queue = self.queues.get(q).ok_or(Skip::Decline)?;
        let mut queue = queue.lock().unwrap_or_else(|p| p.into_inner());
        // Staging buffers for guest operands of kernels, within the device's budget.
        for (i, (&(_, len, _), place)) in plan.operands.iter().zip(&places).enumerate() {
            if plan.kernel && matches!(place, Place::Guest { .. }) {
                let need = usize_of(len)?.max(4);
                let slot = queue.staging.get_mut(i).ok_or(Skip::Decline)?;
                if slot.as_ref().is_none_or(|(_, cap)| *cap < need) {
                    let cap = need.next_power_of_two();
                    let old = slot.as_ref().map_or(0, |(_, c)| *c);
                    self.reserve_staging(old, cap)?;
                    *slot = None;
                    match self.gpu.alloc(cap) {
                        Ok(buf) => *slot = Some((buf, cap)),
                        Err(e) => {
                            self.staging_used.fetch_sub(cap as u64, Ordering::AcqRel);
                            return Err(e.into());
                        }
                    }
                }
            }
        }
        self.upload(&plan, &places, &queue)?;
        let result = self.execute(&plan, &places, &held, &queue);
        // The GPU wrote guest memory past the DMA space's accessors: the dirty log is told
        // (a migration copies those pages again), whether or not the batch finished.
        let (out_index, out_len) = plan.output;
        if let Operand::Guest(iova) = plan.operands[out_index].0
            && result.as_ref().err().is_none_or(|e| e.ran != Some(0))
            && let Err(e) = self.dma.mark_dirty(iova, out_len)
        {
            tracing::debug!(iova, len = out_len, error = %e, "a GPU write not marked dirty");
        }
        if result.is_err() {
            // What the GPU copy holds is unknown now: stale, all that the command touched.
            for (&(_, len, _), place) in plan.operands.iter().zip(&places) {
                if let Place::Vram(off) = place {
                    self.invalidate(*off, len);
                }
            }
        }
        result.map_err(Skip::from)
    }

    /// Builds the command's batch and runs it.
    fn execute(
        &self,
        plan: &Plan,
        places: &[Place],
        held: &Held<'_, G>,
        queue: &Queue<G>,
    ) -> Result<(), GpuError> {
        let too_big = |_| GpuError::transient("an offset beyond the address space");
        let at = |place: Place| -> Result<Mem<'_, G>, GpuError> {
            Ok(match place {
                Place::Vram(off) => {
                    Mem::Dev(&self.vram_dev, usize::try_from(off).map_err(too_big)?)
                }
                Place::Guest { window, off } => {
                    let host = held
                        .get(window)
                        .ok_or_else(|| GpuError::transient("a window went away"))?;
                    Mem::Host(host, usize::try_from(off).map_err(too_big)?)
                }
            })
        };
        let vram_host = |off: u64| -> Result<Mem<'_, G>, GpuError> {
            Ok(Mem::Host(
                &self.vram_host,
                usize::try_from(off).map_err(too_big)?,
            ))
        };
        let mut ops: Vec<Op<'_, G>> = Vec::with_capacity(32);
        // Kernel operands: VRAM in place, guest memory staged in.
        let mut dev: Vec<Mem<'_, G>> = Vec::with_capacity(places.len());
        for (i, (&(_, len, input), &place)) in plan.operands.iter().zip(places).enumerate() {
            let m = at(place)?;
            if plan.kernel && matches!(place, Place::Guest { .. }) {
                let (buf, _) = queue
                    .staging
                    .get(i)
                    .and_then(Option::as_ref)
                    .ok_or_else(|| GpuError::transient("no staging buffer"))?;
                let staged = Mem::Dev(buf, 0);
                if input {
                    ops.push(Op::Copy {
                        dst: staged,
                        src: m,
                        len: usize::try_from(len).map_err(too_big)?,
                    });
                }
                dev.push(staged);
            } else {
                dev.push(m);
            }
        }
        let partial = Mem::Dev(&queue.partial, 0);
        let result = Mem::Dev(&queue.partial, REDUCE_PARTS * 4);
        let c = &plan.command;
        let (out_index, out_len) = plan.output;
        let out_place = places[out_index];
        let out = dev[out_index];
        // Where each piece of the output goes once computed: VRAM's memfd (written
        // through), or the guest (a kernel's staged output); as a write-back, overlapping
        // the next piece.
        let sink = match out_place {
            Place::Vram(off) => Some(vram_host(off)?),
            Place::Guest { .. } if plan.kernel => Some(at(out_place)?),
            Place::Guest { .. } => None,
        };
        let size = |v: u64| usize::try_from(v).map_err(too_big);
        let piece = |at_byte: usize, len: usize| {
            sink.map(|sink| Op::WriteBack {
                dst: shift(sink, at_byte),
                src: shift(out, at_byte),
                len,
            })
        };
        match c.opcode {
            cmd::OP_COPY => {
                let len = size(c.arg[0])?;
                for (o, n) in pieces(len, 1) {
                    ops.push(Op::Copy {
                        dst: shift(dev[1], o),
                        src: shift(dev[0], o),
                        len: n,
                    });
                    ops.extend(piece(o, n));
                }
            }
            cmd::OP_FILL => {
                for (o, n) in pieces(size(c.arg[0])?, 4) {
                    ops.push(Op::Fill32 {
                        dst: shift(dev[0], o),
                        words: n / 4,
                        value: c.imm32,
                    });
                    ops.extend(piece(o, n));
                }
            }
            cmd::OP_SAXPY => {
                for (o, n) in pieces(size(c.arg[0])? * 4, 4) {
                    ops.push(Op::Saxpy {
                        a: f32::from_bits(c.imm32),
                        x: shift(dev[0], o),
                        y: shift(dev[1], o),
                        n: n / 4,
                    });
                    ops.extend(piece(o, n));
                }
            }
            cmd::OP_REDUCE => {
                ops.push(Op::Reduce {
                    x: dev[0],
                    n: size(c.arg[0])?,
                    out: result,
                    partial,
                });
                ops.push(Op::Copy {
                    dst: out,
                    src: result,
                    len: 4,
                });
                ops.extend(piece(0, 4));
            }
            cmd::OP_GEMM => {
                let (m, n, k) = (size(c.arg[0])?, size(c.arg[1])?, size(c.arg[2])?);
                // Row blocks, each written back while the next is computed.
                let blocks = piece_count(size(out_len)?).clamp(1, m);
                let rows = m.div_ceil(blocks);
                let mut i0 = 0;
                while i0 < m {
                    let r = rows.min(m - i0);
                    ops.push(Op::Gemm {
                        m: r,
                        n,
                        k,
                        a: shift(dev[0], i0 * k * 4),
                        b: dev[1],
                        c: shift(dev[2], i0 * n * 4),
                    });
                    ops.extend(piece(i0 * n * 4, r * n * 4));
                    i0 += r;
                }
            }
            _ => return Err(GpuError::transient("not a GPU command")),
        }
        self.run_batch(&queue.stream, &ops)
    }
}

/// `m`, `by` bytes further on.
fn shift<G: Gpu>(m: Mem<'_, G>, by: usize) -> Mem<'_, G> {
    match m {
        Mem::Host(h, off) => Mem::Host(h, off + by),
        Mem::Dev(d, off) => Mem::Dev(d, off + by),
    }
}

impl<G: Gpu> AccelDevice for CudaDevice<G> {
    fn run(&self, queue: usize, c: &Command) -> AccelOutcome {
        match self.run_command(queue, c) {
            Ok(()) => {
                self.stats.offloaded.fetch_add(1, Ordering::Relaxed);
                AccelOutcome::Done
            }
            Err(Skip::Decline) => {
                self.stats.declined.fetch_add(1, Ordering::Relaxed);
                AccelOutcome::Declined
            }
            Err(Skip::Lost(reason)) => {
                let first = self.lost.set(reason.clone()).is_ok();
                if first {
                    tracing::error!(gpu = %self.gpu.describe(), %reason, "the GPU is lost");
                }
                AccelOutcome::Lost(self.lost.get().cloned().unwrap_or(reason))
            }
        }
    }

    fn host_wrote(&self, offset: u64, len: u64) {
        self.invalidate(offset, len);
    }

    fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>> {
        Some(Arc::new(Registrar(self.me.clone())))
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}
