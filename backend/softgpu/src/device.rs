//! Register state shared between the connection thread (region accesses) and the engines.
//!
//! Locking: one mutex guards every register, the config space and the MSI-X state. Engines
//! hold it only at command boundaries (to pick the next command and to record its outcome);
//! commands execute without it. Each engine sleeps on its own condvar; whoever needs the
//! engines at a command boundary (device reset, save/restore, disconnect) pauses them and
//! waits on the `idle` condvar until none is busy.
//!
//! Why the engines are held (not running commands) has several owners: the client went away
//! (`halted`), a migration STOP, swap parks, a successor waiting for its state, a device that
//! handed its state over. Each owner sets and clears only its own reason ([`Holds`]); the
//! engines run when none holds them.
//!
//! A thread that waits for the engines while it is the server's connection thread (every
//! device call: reset, FLR, migration arcs, a swap's hand-over under the slot) cannot route
//! the client's replies to the server→client DMA an engine may be waiting for; such a wait
//! holds the server's remote waits ([`WaitControl::hold`]), which fails them with `ECANCELED`.
//! The command is abandoned without an error and runs again from its start once the engines
//! run again.
//!
//! # Mirroring into a black box: the rule
//!
//! A device built with a black box ([`crate::SoftGpu::with_black_box`],
//! [`crate::SoftGpu::recover`]) keeps its state there, so that a replacement process can
//! resume it after a `kill -9`. The guest must never observe an effect (a reply to a register
//! access, an interrupt) that a replacement would not know about. So:
//!
//! 1. The registers are only reached through [`Guard`] (what [`Shared::lock`] returns). When
//!    it is dropped, or before it waits on a condvar, it *flushes*: if the registers were
//!    borrowed mutably since the last flush, [`Regs::flush`] publishes what changed (the
//!    hot record when its encoding differs, the cold record when it was marked), all before
//!    the lock is released.
//! 2. Code under the lock never signals MSI-X or MSI itself: [`Regs::fire`] (and the MSI-X
//!    table's own deliveries, through [`OwedSink`]) only records the vector as *owed*; the
//!    flush sends owed interrupts after the publish, which includes them. A replacement
//!    re-sends the owed interrupts of the last publish (a duplicate at worst, never a loss).
//! 3. Whoever changes the config space, the MSI-X table or the PBA calls
//!    [`Regs::cold_changed`] (debug builds check at every flush that nothing else changed
//!    them).
//! 4. An engine marks the command it is about to execute as in flight (published before it
//!    lets go of the lock to run it); [`Regs::finish`] clears the marker in the same flush
//!    that advances `HEAD` or latches the error.
//!
//! Without a black box a flush is one branch plus sending the owed interrupts.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use switchyard_device::config::ConfigSpace;
use switchyard_device::msix::MsixSignal;
use switchyard_device::{DeviceContext, DmaSpace, Interrupts, IrqIndex, WaitControl};

use crate::cmd::COMMAND_SIZE;
use crate::doorbell::DoorbellPage;
use crate::exec::{Done, ExecError, Executor, Irq, Outcome, Scratch};
use crate::mirror::{Mirror, OWED_MSI};
use crate::regs::*;
use crate::state::SoftGpuState;
use crate::vram::Vram;
use crate::{IrqMode, SoftGpuConfig};

/// Engine bookkeeping that is not device state.
#[derive(Debug, Default, Clone, Copy)]
struct Runtime {
    /// The engine is executing a command (outside the lock).
    busy: bool,
    /// How many threads wait for this engine to stay at a command boundary.
    paused: u32,
    /// Bumped by every queue or device reset and restore; results of a command started in an
    /// older epoch are discarded.
    epoch: u64,
    /// What the engine saw when it last looked for work (tests wait for it instead of sleeping).
    #[cfg(test)]
    seen: Seen,
}

/// The inputs of an engine's last look for work: a test that expects a command *not* to run
/// waits until the engine has looked at the state in question, then asserts.
#[cfg(test)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Seen {
    pub(crate) tail: u32,
    pub(crate) enabled: bool,
    pub(crate) bus_master: bool,
    pub(crate) halted: bool,
    pub(crate) stopped: bool,
}

/// Why the engines are held at a command boundary, besides a disconnected client (`halted`,
/// which a register write clears). Each owner sets and clears only its own reason.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Holds {
    /// Stopped by the owner ([`crate::SoftGpu::set_running`]): a migration STOP state.
    pub(crate) migration: bool,
    /// Live [`crate::Parked`] guards (a swap parks the engines before it takes the slot).
    pub(crate) parks: u32,
    /// A successor waiting for its state ([`crate::SoftGpu::successor`]).
    pub(crate) successor: bool,
    /// This device handed its state to a successor: held for good.
    pub(crate) retired: bool,
}

impl Holds {
    fn any(&self) -> bool {
        self.migration || self.parks > 0 || self.successor || self.retired
    }
}

#[derive(Debug)]
pub(crate) struct Regs {
    pub(crate) st: SoftGpuState,
    /// Per queue: the index of the command the engine executes (or abandoned half done and
    /// will run again). Mirrored with the state.
    pub(crate) inflight: Vec<Option<u32>>,
    /// Interrupts raised under the lock, sent by the next flush: bit v MSI-X vector v,
    /// [`OWED_MSI`] the MSI vector.
    owed: u32,
    /// Where the state is mirrored, if anywhere.
    pub(crate) mirror: Option<Mirror>,
    rt: Vec<Runtime>,
    /// The client disconnected: engines are parked.
    halted: bool,
    /// Why else the engines are parked.
    pub(crate) holds: Holds,
    shutdown: bool,
    /// Threads waiting on `idle` (engines skip the futex wake when nobody waits).
    idle_waiters: u32,
    /// Engines a doorbell made runnable; woken after the register lock is dropped so the
    /// engine does not wake up only to block on that lock.
    pending_wake: u32,
    /// What the engines did (not device state: for the pool's metrics).
    pub(crate) work: crate::WorkStats,
}

/// The register lock; see "Mirroring into a black box" in the module documentation.
pub(crate) struct Guard<'a> {
    regs: Option<MutexGuard<'a, Regs>>,
    irqs: &'a Interrupts,
    #[cfg(test)]
    hook: &'a TestHook,
    /// The registers were borrowed mutably since the last flush.
    touched: bool,
}

impl Deref for Guard<'_> {
    type Target = Regs;
    fn deref(&self) -> &Regs {
        self.regs.as_deref().expect("the register lock is held")
    }
}

impl DerefMut for Guard<'_> {
    fn deref_mut(&mut self) -> &mut Regs {
        self.touched = true;
        self.regs.as_deref_mut().expect("the register lock is held")
    }
}

impl Guard<'_> {
    /// Publishes what changed and sends the owed interrupts (see the module documentation).
    fn flush(&mut self) {
        if std::mem::take(&mut self.touched)
            && let Some(regs) = self.regs.as_deref_mut()
        {
            #[cfg(test)]
            if self.hook.mute.load(Ordering::SeqCst) {
                // The process "dies" right after publishing: nothing is sent.
                if let Some(m) = &mut regs.mirror {
                    m.publish(&regs.st, &regs.inflight, regs.owed);
                }
                regs.owed = 0;
                return;
            }
            regs.flush(self.irqs);
        }
    }

    /// Flushes, then waits on `cv` (which releases the lock meanwhile).
    fn wait(mut self, cv: &Condvar) -> Self {
        self.flush();
        let regs = self
            .regs
            .take()
            .map(|g| cv.wait(g).unwrap_or_else(|p| p.into_inner()));
        Guard {
            regs,
            irqs: self.irqs,
            #[cfg(test)]
            hook: self.hook,
            touched: false,
        }
    }
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

/// Collects the MSI-X messages [`MsixState`] decides to send, as owed interrupts.
///
/// [`MsixState`]: switchyard_device::msix::MsixState
#[derive(Debug, Default)]
pub(crate) struct OwedSink(Cell<u32>);

impl MsixSignal for OwedSink {
    fn signal(&self, vector: u32) {
        if vector < 31 {
            self.0.set(self.0.get() | 1 << vector);
        }
    }
}

/// A command an engine picked from its ring.
#[derive(Debug, Clone, Copy)]
struct Job {
    index: u32,
    slot: u64,
    epoch: u64,
}

impl Regs {
    /// Publishes the state if it is mirrored, then sends the owed interrupts. Only
    /// [`Guard`] calls it.
    fn flush(&mut self, irqs: &Interrupts) {
        if let Some(m) = &mut self.mirror {
            m.publish(&self.st, &self.inflight, self.owed);
        }
        let mut owed = std::mem::take(&mut self.owed);
        while owed != 0 {
            let v = owed.trailing_zeros();
            owed &= owed - 1;
            if 1 << v == OWED_MSI {
                irqs.notify(IrqIndex::Msi, 0);
            } else {
                irqs.notify(IrqIndex::Msix, v);
            }
        }
    }

    /// The config space, the MSI-X table or the PBA changed: the next flush publishes them.
    pub(crate) fn cold_changed(&mut self) {
        if let Some(m) = &mut self.mirror {
            m.cold_changed();
        }
    }

    /// Records MSI-X messages collected by an [`OwedSink`] as owed.
    pub(crate) fn owe(&mut self, sink: &OwedSink) {
        self.owed |= sink.0.get();
    }

    /// Owes the interrupts a replacement process must send again (see [`crate::SoftGpu::recover`]).
    pub(crate) fn owe_raw(&mut self, owed: u32) {
        self.owed |= owed;
    }

    #[cfg(test)]
    fn note_seen(&mut self, q: usize) {
        let seen = Seen {
            tail: self.st.queues.get(q).map_or(0, |qs| qs.tail),
            enabled: self.st.queues.get(q).is_some_and(|qs| qs.enabled),
            bus_master: self.st.config_space.bus_master(),
            halted: self.halted,
            stopped: self.holds.any(),
        };
        if let Some(rt) = self.rt.get_mut(q) {
            rt.seen = seen;
        }
    }

    fn queue_status(&self, q: usize) -> u32 {
        let (Some(qs), Some(rt)) = (self.st.queues.get(q), self.rt.get(q)) else {
            return Q_STATUS_STOPPED;
        };
        if qs.error_code != ERR_NONE {
            Q_STATUS_ERROR
        } else if rt.busy {
            Q_STATUS_RUNNING
        } else if !qs.enabled {
            Q_STATUS_STOPPED
        } else if qs.head == qs.tail {
            Q_STATUS_IDLE
        } else if !self.st.config_space.bus_master() || self.halted || self.holds.any() {
            Q_STATUS_PAUSED
        } else {
            Q_STATUS_RUNNING
        }
    }

    /// Whether queue `q` would run a command if it had one: only work is missing (the
    /// condition under which its engine polls, and asks for kicks).
    fn runnable(&self, q: usize) -> bool {
        let (Some(qs), Some(rt)) = (self.st.queues.get(q), self.rt.get(q)) else {
            return false;
        };
        rt.paused == 0
            && !self.halted
            && !self.holds.any()
            && !self.shutdown
            && self.st.config_space.bus_master()
            && qs.enabled
            && qs.error_code == ERR_NONE
    }

    fn next_job(&self, q: usize) -> Option<Job> {
        let qs = self.st.queues.get(q)?;
        let rt = self.rt.get(q)?;
        if !self.runnable(q) || qs.head == qs.tail {
            return None;
        }
        let mask = qs.ring_size.checked_sub(1)?;
        let slot = u64::from(qs.head & mask) * COMMAND_SIZE as u64;
        Some(Job {
            index: qs.head,
            slot: qs.ring_base.wrapping_add(slot),
            epoch: rt.epoch,
        })
    }

    /// Signals interrupt `vector` (a queue's completion or error vector, or a FENCE vector):
    /// owes it, to be sent by the next flush.
    ///
    /// MSI mode has a single vector: every source sends MSI vector 0 while MSI is enabled in
    /// the config space, whatever `vector` says (the driver tells the sources apart through
    /// `INT_STATUS`). MSI has no per-vector masking here; the client masks by re-routing the
    /// eventfd (`SET_IRQS`), which [`Interrupts`] models.
    fn fire(&mut self, vector: u32) {
        match self.st.config.irq {
            IrqMode::Msix => self.fire_msix(vector),
            IrqMode::Msi => {
                if !self.st.config_space.msi_enabled() {
                    return;
                }
                self.owed |= OWED_MSI;
            }
        }
    }

    /// Sends MSI-X `vector` if MSI-X is enabled. Clients that emulate the MSI-X table (QEMU,
    /// Cloud Hypervisor) mask by re-routing the eventfd; once a client writes the table through
    /// BAR4, its per-vector masks and the function mask apply too (see [`MsixState`]).
    ///
    /// [`MsixState`]: switchyard_device::msix::MsixState
    fn fire_msix(&mut self, vector: u32) {
        let cs = &self.st.config_space;
        if cs.msix_enabled() {
            let fm = cs.msix_function_masked();
            let sink = OwedSink::default();
            let was_pending = self.st.msix.pending(vector as usize);
            self.st.msix.fire(vector as usize, fm, &sink);
            if self.st.msix.pending(vector as usize) != was_pending {
                self.cold_changed();
            }
            self.owe(&sink);
        }
    }

    /// Whether pending MSI-X messages are held: MSI-X disabled or the function masked.
    pub(crate) fn msix_held(&self) -> bool {
        let cs = &self.st.config_space;
        !cs.msix_enabled() || cs.msix_function_masked()
    }

    fn raise(&mut self, bit: u32, vector: u32) {
        self.st.int_status |= bit;
        if self.st.int_mask & bit == 0 {
            self.fire(vector);
        }
    }

    /// Stops queue `q` on an error at its head: the error registers, `INT_STATUS` and the
    /// error interrupt.
    pub(crate) fn set_error(&mut self, q: usize, code: u32, addr: u64, opcode: u32) {
        let Some(qs) = self.st.queues.get_mut(q) else {
            return;
        };
        tracing::debug!(
            queue = q,
            code,
            addr,
            opcode,
            index = qs.head,
            "queue error"
        );
        qs.error_code = code;
        qs.error_index = qs.head;
        qs.error_addr = addr;
        qs.error_opcode = opcode;
        let vector = qs.error_vector;
        self.raise(int_error(q as u32), vector);
    }

    /// Records the outcome of `job`: `HEAD` advanced (and the marker of a command in flight
    /// cleared) or an error latched, and the interrupts the command asks for. An abandoned
    /// command keeps its in-flight marker: it may be half done, and runs again.
    fn finish(&mut self, q: usize, job: Job, outcome: Outcome) {
        let Some(rt) = self.rt.get_mut(q) else {
            return;
        };
        rt.busy = false;
        if rt.epoch != job.epoch {
            return;
        }
        let Some(qs) = self.st.queues.get_mut(q) else {
            return;
        };
        match outcome.result {
            Err(ExecError::Aborted) => {}
            Ok(Done { irq, fence }) => {
                self.work.commands += 1;
                self.work.bytes = self.work.bytes.saturating_add(outcome.bytes);
                qs.head = job.index.wrapping_add(1);
                if let Some(i) = self.inflight.get_mut(q) {
                    *i = None;
                }
                qs.completed = qs.completed.wrapping_add(1);
                let completion_vector = qs.completion_vector;
                if fence {
                    self.st.fence_count = self.st.fence_count.wrapping_add(1);
                }
                match irq {
                    Irq::None => {}
                    Irq::Queue => self.raise(int_completion(q as u32), completion_vector),
                    Irq::Vector(v) => self.raise(int_completion(q as u32), v),
                }
            }
            Err(ExecError::Fault { code, addr }) => {
                let dma = matches!(code, ERR_DMA_UNMAPPED | ERR_DMA_PERMISSION | ERR_RING_FETCH);
                if (self.halted || self.holds.any()) && dma {
                    // The client's windows went away under the command (disconnect), or the
                    // device is being stopped (migration, swap): not the driver's fault, and
                    // a stopped device must not change state or interrupt. The command runs
                    // again when the engines resume.
                    tracing::debug!(queue = q, code, addr, "DMA fault while held; not latched");
                    return;
                }
                if let Some(i) = self.inflight.get_mut(q) {
                    *i = None;
                }
                self.work.errors += 1;
                self.set_error(q, code, addr, outcome.opcode);
            }
        }
    }

    /// A tail/doorbell write.
    fn doorbell(&mut self, q: usize, tail: u32) {
        let Some(qs) = self.st.queues.get_mut(q) else {
            return;
        };
        if tail.wrapping_sub(qs.head) > qs.ring_size {
            if qs.error_code == ERR_NONE {
                self.set_error(q, ERR_BAD_DOORBELL, u64::from(tail), 0);
            }
            return;
        }
        qs.tail = tail;
    }

    fn dev_status(&self) -> u32 {
        let mut s = 0;
        if self.st.config_space.bus_master() {
            s |= DEV_STATUS_BUS_MASTER;
        }
        if self.halted {
            s |= DEV_STATUS_HALTED;
        }
        if self.st.queues.iter().any(|q| q.error_code != ERR_NONE) {
            s |= DEV_STATUS_ERROR;
        }
        if self.holds.any() {
            s |= DEV_STATUS_STOPPED;
        }
        s
    }

    /// Reads the 32-bit BAR0 register at `off` (4-byte aligned). Undefined offsets read 0.
    pub(crate) fn read32(&self, off: u64) -> u32 {
        let st = &self.st;
        match off {
            MAGIC => MAGIC_VALUE,
            VERSION => VERSION_VALUE,
            FEATURES => FEATURES_VALUE,
            NUM_QUEUES => st.config.queues,
            VRAM_SIZE_LO => st.config.vram_size as u32,
            VRAM_SIZE_HI => (st.config.vram_size >> 32) as u32,
            FENCE_COUNT_LO => st.fence_count as u32,
            FENCE_COUNT_HI => (st.fence_count >> 32) as u32,
            INT_STATUS => st.int_status,
            INT_MASK => st.int_mask,
            SCRATCH => st.scratch,
            DEV_STATUS => self.dev_status(),
            MSIX_VECTOR_COUNT => st.config.irq.msix_vectors(),
            RING_ENTRY_SIZE => COMMAND_SIZE as u32,
            MAX_RING_ENTRIES => MAX_RING_ENTRIES_VALUE,
            MAX_XFER_BYTES => MAX_XFER_BYTES_VALUE as u32,
            MAX_ELEMENTS => MAX_ELEMENTS_VALUE as u32,
            MAX_GEMM_DIM => MAX_GEMM_DIM_VALUE as u32,
            MAX_GEMM_WORK_LO => MAX_GEMM_WORK_VALUE as u32,
            MAX_GEMM_WORK_HI => (MAX_GEMM_WORK_VALUE >> 32) as u32,
            o if o >= QUEUE_BASE => {
                let q = (o - QUEUE_BASE) / QUEUE_STRIDE;
                let r = (o - QUEUE_BASE) % QUEUE_STRIDE;
                usize::try_from(q).map_or(0, |q| self.queue_read32(q, r))
            }
            _ => 0,
        }
    }

    fn queue_read32(&self, q: usize, r: u64) -> u32 {
        let Some(qs) = self.st.queues.get(q) else {
            return 0;
        };
        match r {
            Q_RING_BASE_LO => qs.ring_base as u32,
            Q_RING_BASE_HI => (qs.ring_base >> 32) as u32,
            Q_RING_SIZE => qs.ring_size,
            Q_HEAD => qs.head,
            Q_TAIL | Q_DOORBELL => qs.tail,
            Q_CONTROL => {
                (u32::from(qs.enabled) * Q_CONTROL_ENABLE)
                    | (u32::from(qs.mapped) * Q_CONTROL_MAPPED)
            }
            Q_STATUS => self.queue_status(q),
            Q_ERROR_CODE => qs.error_code,
            Q_ERROR_INDEX => qs.error_index,
            Q_ERROR_ADDR_LO => qs.error_addr as u32,
            Q_ERROR_ADDR_HI => (qs.error_addr >> 32) as u32,
            Q_COMPLETION_VECTOR => qs.completion_vector,
            Q_ERROR_VECTOR => qs.error_vector,
            Q_COMPLETED_LO => qs.completed as u32,
            Q_COMPLETED_HI => (qs.completed >> 32) as u32,
            Q_ERROR_OPCODE => qs.error_opcode,
            _ => 0,
        }
    }
}

/// Everything the device and its engines share.
#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) config: SoftGpuConfig,
    pub(crate) dma: Arc<DmaSpace>,
    pub(crate) irqs: Arc<Interrupts>,
    pub(crate) vram: Arc<Vram>,
    /// The doorbell page (the slot's, like VRAM).
    pub(crate) bells: Arc<DoorbellPage>,
    /// Per queue: how a doorbell reaches a polling engine.
    polls: Vec<Poll>,
    /// Engines polling right now (at most [`MAX_POLLERS`]).
    pollers: AtomicU32,
    /// The server's remote waits, held while waiting for the engines.
    waits: Arc<WaitControl>,
    /// The power-on config space (sealed), also the source of write masks after a restore.
    pub(crate) config_def: ConfigSpace,
    regs: Mutex<Regs>,
    wake: Vec<Condvar>,
    idle: Condvar,
    abort: Vec<AtomicBool>,
    #[cfg(test)]
    pub(crate) hook: TestHook,
}

/// How many of a device's engines may poll at once: one core at most, whatever the client
/// submits (a client that kept every queue just busy enough would otherwise keep eight engines
/// spinning on work it never sends). The other engines sleep at once; mapped doorbells reach
/// them by kicks.
const MAX_POLLERS: u32 = 1;

/// How a doorbell reaches an engine that polls instead of sleeping.
#[derive(Debug, Default)]
struct Poll {
    /// Bumped after every trapped doorbell or kick (once the tail is in the registers).
    rung: AtomicU32,
    /// The engine is polling: a doorbell needs no condvar wake-up (set and cleared under the
    /// register lock, so a doorbell written under it sees the engine's choice).
    polling: AtomicBool,
}

/// An engine's polling budget, adapted the way KVM adapts halt polling: a sleep that ended
/// within the largest budget (polling a little longer would have caught the work) doubles it,
/// from [`Budget::START`]; a longer sleep (polling was wasted) drops it to zero. Work found
/// while polling keeps it. So a busy queue polls and never sleeps, a sporadic one sleeps at
/// once, an idle one costs nothing.
#[derive(Debug, Clone, Copy)]
struct Budget {
    max: Duration,
    now: Duration,
}

impl Budget {
    /// The first budget after a sleep that polling would have caught.
    const START: Duration = Duration::from_micros(10);

    fn new(max: Duration) -> Self {
        Self { max, now: max }
    }

    fn now(&self) -> Duration {
        self.now
    }

    /// The engine slept for `slept` (woken by a doorbell, or anything else).
    fn slept(&mut self, slept: Duration) {
        if slept > self.max {
            self.now = Duration::ZERO;
        } else if self.now < self.max {
            self.now = (self.now * 2).max(Self::START).min(self.max);
        }
    }
}

/// Parks engines in the middle of a command (at an abort checkpoint), for tests that need a
/// command half done when its process dies.
#[cfg(test)]
#[derive(Debug, Default)]
pub(crate) struct TestHook {
    /// Per queue: park at the n-th checkpoint from now.
    park: Mutex<[Option<u32>; 8]>,
    /// Queues parked.
    parked: Mutex<u32>,
    changed: Condvar,
    /// Flushes publish but send no interrupt (a process that dies right after publishing).
    pub(crate) mute: AtomicBool,
    /// Every poll window this many µs instead of the adaptive budget (0: the budget), so a
    /// test can know that an engine is still polling.
    pub(crate) poll_us: std::sync::atomic::AtomicU64,
}

#[cfg(test)]
impl TestHook {
    /// Parks queue `q`'s engine, for good, at its `n`-th checkpoint from now (1: the first).
    pub(crate) fn park_at(&self, q: usize, n: u32) {
        if let Some(p) = self.park.lock().expect("hook").get_mut(q) {
            *p = Some(n);
        }
    }

    /// Waits until the queues of `mask` are parked.
    pub(crate) fn wait_parked(&self, mask: u32) {
        let mut parked = self.parked.lock().expect("hook");
        while *parked & mask != mask {
            parked = self.changed.wait(parked).expect("hook");
        }
    }

    pub(crate) fn checkpoint(&self, q: usize) {
        let park = {
            let mut p = self.park.lock().expect("hook");
            match p.get_mut(q) {
                Some(Some(n)) if *n <= 1 => true,
                Some(Some(n)) => {
                    *n -= 1;
                    false
                }
                _ => false,
            }
        };
        if park {
            *self.parked.lock().expect("hook") |= 1 << q;
            self.changed.notify_all();
            loop {
                std::thread::park();
            }
        }
    }
}

impl Shared {
    pub(crate) fn new(
        config: SoftGpuConfig,
        ctx: DeviceContext,
        vram: Arc<Vram>,
        bells: Arc<DoorbellPage>,
        config_def: ConfigSpace,
        holds: Holds,
    ) -> Self {
        let n = config.queues as usize;
        let mut st = SoftGpuState::power_on(config, vram.identity(), &config_def);
        st.doorbells = Some(bells.identity());
        let DeviceContext {
            dma, irqs, waits, ..
        } = ctx;
        Self {
            config,
            dma,
            irqs,
            vram,
            bells,
            polls: (0..n).map(|_| Poll::default()).collect(),
            pollers: AtomicU32::new(0),
            waits,
            config_def,
            regs: Mutex::new(Regs {
                st,
                inflight: vec![None; n],
                owed: 0,
                mirror: None,
                rt: vec![Runtime::default(); n],
                halted: false,
                holds,
                shutdown: false,
                idle_waiters: 0,
                pending_wake: 0,
                work: crate::WorkStats::default(),
            }),
            wake: (0..n).map(|_| Condvar::new()).collect(),
            idle: Condvar::new(),
            abort: (0..n).map(|_| AtomicBool::new(false)).collect(),
            #[cfg(test)]
            hook: TestHook::default(),
        }
    }

    pub(crate) fn lock(&self) -> Guard<'_> {
        Guard {
            regs: Some(self.regs.lock().unwrap_or_else(|p| p.into_inner())),
            irqs: &self.irqs,
            #[cfg(test)]
            hook: &self.hook,
            touched: false,
        }
    }

    fn all_queues(&self) -> u32 {
        (1u32 << self.config.queues) - 1
    }

    fn queues_in(&self, mask: u32) -> impl Iterator<Item = usize> + use<> {
        let n = self.config.queues as usize;
        (0..n).filter(move |q| mask & (1 << q) != 0)
    }

    /// Pauses the engines of `mask` and waits until each is at a command boundary. With
    /// `abort`, a running command is abandoned at its next abort point (its results are not
    /// recorded and it runs again when the engine resumes, unless its epoch changed). With
    /// `cancel_remote` (the caller may be the connection thread, which routes the client's
    /// DMA replies), server→client DMA is cancelled while waiting: a command waiting for the
    /// client is abandoned the same way.
    fn quiesce<'a>(
        &'a self,
        mut g: Guard<'a>,
        mask: u32,
        abort: bool,
        cancel_remote: bool,
    ) -> Guard<'a> {
        for q in self.queues_in(mask) {
            if let Some(rt) = g.rt.get_mut(q) {
                rt.paused += 1;
            }
            if abort && let Some(a) = self.abort.get(q) {
                a.store(true, Ordering::SeqCst);
            }
        }
        let busy = |g: &Regs| {
            self.queues_in(mask)
                .any(|q| g.rt.get(q).is_some_and(|rt| rt.busy))
        };
        let _hold = (cancel_remote && busy(&g)).then(|| self.waits.hold());
        while busy(&g) {
            g.idle_waiters += 1;
            g = g.wait(&self.idle);
            g.idle_waiters -= 1;
        }
        g
    }

    /// Undoes [`Shared::quiesce`].
    fn resume(&self, g: &mut Regs, mask: u32) {
        for q in self.queues_in(mask) {
            let Some(rt) = g.rt.get_mut(q) else {
                continue;
            };
            rt.paused = rt.paused.saturating_sub(1);
            if rt.paused == 0 {
                if let Some(a) = self.abort.get(q) {
                    a.store(false, Ordering::SeqCst);
                }
                if let Some(cv) = self.wake.get(q) {
                    cv.notify_one();
                }
            }
        }
    }

    fn wake_all(&self) {
        self.wake.iter().for_each(Condvar::notify_one);
    }

    /// Quiesces the engines (cancelling waits on the client: see [`Shared::quiesce`]) and runs
    /// `f` on the registers.
    pub(crate) fn with_quiesced<R>(&self, abort: bool, f: impl FnOnce(&mut Regs) -> R) -> R {
        let g = self.lock();
        let mut g = self.quiesce(g, self.all_queues(), abort, true);
        let r = f(&mut g);
        self.resume(&mut g, self.all_queues());
        r
    }

    /// Replaces the whole state (restore); in-flight results are discarded. With `mirror`
    /// (a swap's hand-over), the state is mirrored there from now on, starting with this one.
    ///
    /// A state whose mapped tails come from another doorbell page (a migration) has them
    /// written into this device's page; one from this page (a swap on the slot, a restart)
    /// leaves the page alone: the guest may have written newer tails since.
    pub(crate) fn load(&self, mut st: SoftGpuState, mirror: Option<Mirror>) {
        self.adopt_doorbells(&mut st);
        self.with_quiesced(true, |g| {
            if mirror.is_some() {
                g.mirror = mirror;
            }
            g.st = st;
            g.inflight.fill(None);
            g.cold_changed();
            g.halted = false;
            for rt in &mut g.rt {
                rt.epoch = rt.epoch.wrapping_add(1);
            }
        });
    }

    /// Points `st` at this device's doorbell page, writing its mapped queues' tails there if
    /// they come from another page (see [`Shared::load`]).
    pub(crate) fn adopt_doorbells(&self, st: &mut SoftGpuState) {
        let ours = self.bells.identity();
        if st.doorbells != Some(ours) {
            for (q, qs) in st.queues.iter().enumerate() {
                if qs.mapped {
                    self.bells.set_tail(q, qs.tail);
                }
            }
            st.doorbells = Some(ours);
        }
    }

    /// The state with the engines quiesced at a command boundary, the mapped queues' tails
    /// taken from the doorbell page first (the latest the guest submitted).
    pub(crate) fn snapshot(&self) -> SoftGpuState {
        self.with_quiesced(false, |g| {
            for q in 0..g.st.queues.len() {
                self.take_page_tail(g, q);
            }
            g.st.clone()
        })
    }

    /// Takes queue `q`'s tail from the doorbell page if the queue is mapped and the page
    /// holds another one (checked like a `TAIL` write).
    fn take_page_tail(&self, g: &mut Regs, q: usize) {
        if let Some(qs) = g.st.queues.get(q)
            && qs.mapped
        {
            let tail = self.bells.tail(q);
            if tail != qs.tail {
                g.doorbell(q, tail);
            }
        }
    }

    /// A kick of mapped queue `q` (a trapped `DB_TAIL` write): takes the page's tail and
    /// wakes the engine once the caller drops the lock ([`Shared::wake_pending`]). Nothing
    /// for a queue in trapped mode.
    pub(crate) fn kick(&self, g: &mut Guard<'_>, q: usize) {
        if g.st.queues.get(q).is_some_and(|qs| qs.mapped) {
            self.take_page_tail(g, q);
            g.pending_wake |= 1 << q;
        }
    }

    /// [`Shared::take_page_tail`] through the lock guard, borrowing the registers mutably
    /// (which makes the next flush compare the mirror) only when the tail changed.
    fn take_page_tail_guarded(&self, g: &mut Guard<'_>, q: usize) {
        let changed =
            g.st.queues
                .get(q)
                .is_some_and(|qs| qs.mapped && self.bells.tail(q) != qs.tail);
        if changed {
            self.take_page_tail(g, q);
        }
    }

    /// Back to power-on: registers, queues, interrupt state, VRAM zeroed (unless the device
    /// keeps it, `vram_reset=keep`); with `pci` also the
    /// config space and MSI-X table (FLR, `DEVICE_RESET`), without (DEV_CONTROL.RESET) they are
    /// kept.
    pub(crate) fn reset<'a>(&'a self, g: Guard<'a>, pci: bool) -> Guard<'a> {
        let mut g = self.quiesce(g, self.all_queues(), true, true);
        let mut fresh = SoftGpuState::power_on(self.config, self.vram.identity(), &self.config_def);
        fresh.doorbells = Some(self.bells.identity());
        // Every queue leaves mapped mode: the page goes back to zeros.
        self.bells.clear();
        if !pci {
            std::mem::swap(&mut fresh.config_space, &mut g.st.config_space);
            std::mem::swap(&mut fresh.msix, &mut g.st.msix);
        }
        g.st = fresh;
        g.inflight.fill(None);
        g.cold_changed();
        g.halted = false;
        for rt in &mut g.rt {
            rt.epoch = rt.epoch.wrapping_add(1);
        }
        if !self.config.keep_vram_on_reset {
            self.vram.zero();
        }
        self.resume(&mut g, self.all_queues());
        g
    }

    /// Whether the engines are parked because the client is gone.
    pub(crate) fn halted(&self) -> bool {
        self.lock().halted
    }

    /// What engine `q` saw when it last looked for work.
    #[cfg(test)]
    pub(crate) fn engine_seen(&self, q: usize) -> Seen {
        self.lock().rt.get(q).map(|rt| rt.seen).unwrap_or_default()
    }

    /// The client is gone: park the engines and stop touching DMA memory. Halted before the
    /// wait, so a command failing meanwhile (its windows are gone) latches no error.
    pub(crate) fn halt(&self) {
        let mut g = self.lock();
        g.halted = true;
        let mut g = self.quiesce(g, self.all_queues(), true, true);
        self.resume(&mut g, self.all_queues());
    }

    /// Parks the engines after their current command (`false`) or lets them run (`true`),
    /// as far as the migration is concerned (other holds stay).
    pub(crate) fn set_running(&self, running: bool) {
        self.set_hold(|h| h.migration = !running, true);
    }

    /// Changes the holds with `f`; if the engines are held afterwards, waits until they are
    /// at a command boundary (an engine's DMA fault meanwhile is not latched: see
    /// [`Regs::finish`]). `cancel_remote` as for [`Shared::quiesce`].
    pub(crate) fn set_hold(&self, f: impl FnOnce(&mut Holds), cancel_remote: bool) {
        let mut g = self.lock();
        f(&mut g.holds);
        if g.holds.any() {
            let mut g = self.quiesce(g, self.all_queues(), false, cancel_remote);
            self.resume(&mut g, self.all_queues());
        } else {
            drop(g);
            self.wake_all();
        }
    }

    /// Stops the engines for good.
    pub(crate) fn shutdown(&self) {
        let mut g = self.lock();
        g.shutdown = true;
        for a in &self.abort {
            a.store(true, Ordering::SeqCst);
        }
        drop(g);
        self.wake.iter().for_each(Condvar::notify_all);
    }

    /// A config-space write changed the command register or the MSI-X control. (MSI needs
    /// nothing: without per-vector masking it has no pending messages to deliver, and
    /// interrupts raised while it was disabled stay latched in `INT_STATUS` only, as with
    /// MSI-X.)
    pub(crate) fn config_changed(&self, g: &mut Regs, command: bool, msix_control: bool) {
        g.cold_changed();
        if msix_control {
            let held = g.msix_held();
            let sink = OwedSink::default();
            g.st.msix.deliver_pending(held, &sink);
            g.owe(&sink);
        }
        if command {
            self.wake_all();
        }
    }

    /// Writes the 32-bit BAR0 register at `off` (4-byte aligned).
    pub(crate) fn write32<'a>(&'a self, mut g: Guard<'a>, off: u64, v: u32) -> Guard<'a> {
        if std::mem::replace(&mut g.halted, false) {
            // A driver is talking to the device again.
            self.wake_all();
        }
        match off {
            INT_MASK => {
                g.st.int_mask = v;
            }
            INT_ACK => g.st.int_status &= !v,
            SCRATCH => g.st.scratch = v,
            DEV_CONTROL if v & DEV_CONTROL_RESET != 0 => {
                g = self.reset(g, false);
            }
            o if o >= QUEUE_BASE => {
                let q = (o - QUEUE_BASE) / QUEUE_STRIDE;
                let r = (o - QUEUE_BASE) % QUEUE_STRIDE;
                if q < u64::from(self.config.queues) {
                    self.queue_write32(&mut g, q as usize, r, v);
                }
            }
            _ => {}
        }
        g
    }

    fn queue_write32(&self, g: &mut Regs, q: usize, r: u64, v: u32) {
        let Some(qs) = g.st.queues.get_mut(q) else {
            return;
        };
        match r {
            Q_RING_BASE_LO if !qs.enabled => {
                qs.ring_base = (qs.ring_base & !0xffff_ffff) | u64::from(v);
            }
            Q_RING_BASE_HI if !qs.enabled => {
                qs.ring_base = (qs.ring_base & 0xffff_ffff) | (u64::from(v) << 32);
            }
            Q_RING_SIZE if !qs.enabled => qs.ring_size = v,
            Q_TAIL | Q_DOORBELL => {
                if qs.mapped {
                    // A kick: the tail is the page's.
                    self.take_page_tail(g, q);
                } else {
                    g.doorbell(q, v);
                }
                // Woken by `wake_pending` once the caller has dropped the register lock.
                g.pending_wake |= 1 << q;
            }
            Q_CONTROL => self.queue_control(g, q, v),
            Q_COMPLETION_VECTOR => qs.completion_vector = v,
            Q_ERROR_VECTOR => qs.error_vector = v,
            _ => {}
        }
    }

    fn queue_control(&self, g: &mut Regs, q: usize, v: u32) {
        if v & Q_CONTROL_RESET != 0 {
            // Any running command is abandoned and its results discarded (new epoch); STATUS
            // reads RUNNING until the engine has let go of it.
            if let (Some(qs), Some(rt)) = (g.st.queues.get_mut(q), g.rt.get_mut(q)) {
                let keep = *qs;
                *qs = crate::state::QueueState {
                    ring_base: keep.ring_base,
                    ring_size: keep.ring_size,
                    completion_vector: keep.completion_vector,
                    error_vector: keep.error_vector,
                    ..Default::default()
                };
                rt.epoch = rt.epoch.wrapping_add(1);
                if let Some(i) = g.inflight.get_mut(q) {
                    // Whatever the engine still does to it, nothing is to be replayed.
                    *i = None;
                }
                if rt.busy {
                    // Cleared by the engine once it has let go of the command.
                    if let Some(a) = self.abort.get(q) {
                        a.store(true, Ordering::SeqCst);
                    }
                }
            }
        }
        let Some(qs) = g.st.queues.get_mut(q) else {
            return;
        };
        if v & Q_CONTROL_RECOVER != 0 && qs.error_code != ERR_NONE {
            if !matches!(qs.error_code, ERR_BAD_DOORBELL | ERR_BAD_RING) {
                qs.head = qs.error_index.wrapping_add(1);
            }
            qs.error_code = ERR_NONE;
        }
        let mapped = v & Q_CONTROL_MAPPED != 0;
        if mapped && (!qs.mapped || v & Q_CONTROL_RESET != 0) {
            // Entering mapped mode (or a reset in it): the driver continues from TAIL.
            self.bells.set_tail(q, qs.tail);
        }
        qs.mapped = mapped;
        self.take_page_tail(g, q);
        let Some(qs) = g.st.queues.get_mut(q) else {
            return;
        };
        let enable = v & Q_CONTROL_ENABLE != 0;
        if enable && !qs.enabled && qs.error_code == ERR_NONE {
            if !qs.ring_valid() {
                let base = qs.ring_base;
                g.set_error(q, ERR_BAD_RING, base, 0);
            } else if qs.pending() > qs.ring_size {
                let tail = qs.tail;
                qs.tail = qs.head;
                g.set_error(q, ERR_BAD_DOORBELL, u64::from(tail), 0);
            } else {
                qs.enabled = true;
            }
        } else if !enable {
            // Takes effect at the next command boundary; STATUS reads RUNNING until then.
            qs.enabled = false;
        }
        // A polling engine looks again too (it polls with the mode it saw: a queue turned
        // mapped must not wait for the window to end before its page tail is seen).
        if let Some(poll) = self.polls.get(q) {
            poll.rung.fetch_add(1, Ordering::Release);
        }
        if let Some(cv) = self.wake.get(q) {
            cv.notify_one();
        }
    }

    /// The body of engine thread `q`.
    pub(crate) fn engine(&self, q: usize) {
        let (Some(abort), Some(wake)) = (self.abort.get(q), self.wake.get(q)) else {
            return;
        };
        let exec = Executor {
            dma: &self.dma,
            vram: &self.vram,
            abort,
            #[cfg(test)]
            hook: (&self.hook, q),
        };
        let Some(poll) = self.polls.get(q) else {
            return;
        };
        let mut scratch = Scratch::default();
        let mut budget = Budget::new(Duration::from_micros(u64::from(self.config.spin_us)));
        // This engine polled since it last ran a command or slept.
        let mut polled = false;
        let mut g = self.lock();
        loop {
            if g.shutdown {
                return;
            }
            self.take_page_tail_guarded(&mut g, q);
            #[cfg(test)]
            g.note_seen(q);
            let Some(job) = g.next_job(q) else {
                let runnable = g.runnable(q);
                let (mapped, tail) =
                    g.st.queues
                        .get(q)
                        .map_or((false, 0), |qs| (qs.mapped, qs.tail));
                let window = budget.now();
                #[cfg(test)]
                let window = match self.hook.poll_us.load(Ordering::Relaxed) {
                    0 => window,
                    us => Duration::from_micros(us),
                };
                if runnable && !polled && !window.is_zero() && self.start_polling() {
                    // Poll, without the lock, for a doorbell or a new DB_TAIL.
                    let rung = poll.rung.load(Ordering::Acquire);
                    poll.polling.store(true, Ordering::SeqCst);
                    drop(g);
                    let deadline = Instant::now() + window;
                    while poll.rung.load(Ordering::Acquire) == rung
                        && !(mapped && self.bells.tail(q) != tail)
                        && !abort.load(Ordering::Relaxed)
                        && Instant::now() < deadline
                    {
                        std::hint::spin_loop();
                    }
                    // A window that ended on a doorbell, a control write (a queue turned
                    // mapped) or a new tail may be followed by another if that brought no work:
                    // only a window that ran out (or an abort) sends the engine to sleep. Else a
                    // control write landing in a window would have the engine ask the driver
                    // for a kick it does not need.
                    polled = Instant::now() >= deadline || abort.load(Ordering::Relaxed);
                    self.pollers.fetch_sub(1, Ordering::AcqRel);
                    g = self.lock();
                    poll.polling.store(false, Ordering::SeqCst);
                    continue;
                }
                polled = false;
                // Idle: release what a very large command grew before sleeping.
                scratch.trim();
                // A mapped queue asks for a kick, then looks at DB_TAIL once more: either it
                // sees the driver's new tail or the driver sees the request (full fences on
                // both sides).
                let armed = runnable && mapped;
                if armed {
                    self.bells.set_need_kick(q, true);
                    fence(Ordering::SeqCst);
                    if self.bells.tail(q) != tail {
                        self.bells.set_need_kick(q, false);
                        continue;
                    }
                }
                let slept = Instant::now();
                g = g.wait(wake);
                // A retired device shares the page with its successor: leave the flag alone.
                if armed && !g.shutdown && !g.holds.retired {
                    self.bells.set_need_kick(q, false);
                }
                if runnable {
                    budget.slept(slept.elapsed());
                }
                continue;
            };
            polled = false;
            if let Some(rt) = g.rt.get_mut(q) {
                rt.busy = true;
            }
            if let Some(i) = g.inflight.get_mut(q) {
                *i = Some(job.index);
            }
            // Publishes the marker before the command touches anything.
            drop(g);
            let outcome = exec.run(job.slot, &mut scratch);
            g = self.lock();
            g.finish(q, job, outcome);
            if !g.shutdown && g.rt.get(q).is_some_and(|rt| rt.paused == 0) {
                // A queue reset's abort request has been served.
                abort.store(false, Ordering::SeqCst);
            }
            if g.idle_waiters > 0 {
                self.idle.notify_all();
            }
        }
    }

    /// Whether engine `q` is polling right now.
    #[cfg(test)]
    pub(crate) fn is_polling(&self, q: usize) -> bool {
        self.polls
            .get(q)
            .is_some_and(|p| p.polling.load(Ordering::SeqCst))
    }

    /// Takes one of the [`MAX_POLLERS`] polling slots, if one is free.
    fn start_polling(&self) -> bool {
        self.pollers
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_POLLERS).then_some(n + 1)
            })
            .is_ok()
    }

    /// Takes the set of engines that doorbells made runnable (under the lock).
    pub(crate) fn take_pending_wake(g: &mut Regs) -> u32 {
        std::mem::take(&mut g.pending_wake)
    }

    /// Wakes the engines in `pending`; call after dropping the register lock. An engine that
    /// polls only needs to see its counter move: no wake-up.
    pub(crate) fn wake_pending(&self, pending: u32) {
        for q in 0..self.wake.len() {
            if pending & (1 << q) == 0 {
                continue;
            }
            if let Some(poll) = self.polls.get(q) {
                poll.rung.fetch_add(1, Ordering::Release);
                if poll.polling.load(Ordering::SeqCst) {
                    continue;
                }
            }
            if let Some(cv) = self.wake.get(q) {
                cv.notify_one();
            }
        }
    }
}

#[cfg(test)]
mod budget_tests {
    use std::time::Duration;

    use super::Budget;

    const MAX: Duration = Duration::from_micros(200);

    #[test]
    fn the_budget_starts_full_collapses_after_a_long_sleep_and_doubles_back() {
        let mut b = Budget::new(MAX);
        assert_eq!(b.now(), MAX);
        // A sleep longer than the largest budget: polling would not have caught the work.
        b.slept(MAX + Duration::from_micros(1));
        assert_eq!(b.now(), Duration::ZERO);
        // Sleeps that a budget would have caught: from START, doubling, up to the largest.
        let mut seen = vec![];
        for _ in 0..6 {
            b.slept(Duration::from_micros(5));
            seen.push(b.now().as_micros());
        }
        assert_eq!(seen, [10, 20, 40, 80, 160, 200]);
        // A short sleep at the largest budget keeps it.
        b.slept(Duration::from_micros(5));
        assert_eq!(b.now(), MAX);
    }

    #[test]
    fn a_zero_budget_never_polls() {
        let mut b = Budget::new(Duration::ZERO);
        b.slept(Duration::ZERO);
        assert_eq!(b.now(), Duration::ZERO);
    }
}
