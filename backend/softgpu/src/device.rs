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

mod failure;
#[cfg(test)]
mod hook;
mod poll;
mod regfile;

#[cfg(test)]
pub(crate) use hook::TestHook;
use poll::{Budget, MAX_POLLERS, Poll};
use regfile::Runtime;
#[cfg(test)]
pub(crate) use regfile::Seen;
pub(crate) use regfile::{Holds, OwedSink, Regs};

use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering, fence};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use switchyard_device::config::ConfigSpace;
use switchyard_device::{DeviceContext, DmaSpace, Interrupts, WaitControl};

use crate::SoftGpuConfig;
use crate::doorbell::DoorbellPage;
use crate::exec::{ExecError, Executor, Scratch};
use crate::fault::Faults;
use crate::mirror::Mirror;
use crate::regs::*;
use crate::state::SoftGpuState;
use crate::vram::Vram;

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
    /// Failure reporting and injected faults.
    pub(crate) faults: Faults,
    /// The board's accelerator, if commands run on one (set once, before the engines run a
    /// command on it; see `crate::accel`).
    pub(crate) accel: std::sync::OnceLock<Arc<dyn crate::accel::AccelDevice>>,
    #[cfg(test)]
    pub(crate) hook: TestHook,
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
            faults: Faults::new(n),
            accel: std::sync::OnceLock::new(),
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

    /// A new client opened the device: its PCI function as after a reset (config space and
    /// MSI-X table and PBA at power-on: COMMAND, Device Control, MSI/MSI-X control, BAR
    /// addresses, every vector masked). The device's own state stays: registers, queues,
    /// VRAM (the engines are parked anyway: bus mastering is off until the new driver sets it).
    pub(crate) fn fresh_pci(&self, g: &mut Regs) {
        g.st.config_space = self.config_def.clone();
        g.st.msix = switchyard_device::msix::MsixState::new(self.config.irq.msix_vectors() as u16);
        g.cold_changed();
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

    /// The body of engine thread `q` (run by [`Shared::run_engine`]).
    pub(crate) fn engine(&self, q: usize) {
        let (Some(abort), Some(wake), Some(fail)) = (
            self.abort.get(q),
            self.wake.get(q),
            self.faults.engine_flag(q),
        ) else {
            return;
        };
        let exec = Executor {
            dma: &self.dma,
            vram: &self.vram,
            abort,
            fail,
            queue: q,
            accel: &self.accel,
            offloaded: std::cell::Cell::new(false),
            lost: std::cell::RefCell::new(None),
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
            if self.faults.engine_failed(q) {
                // An injected fault; not under the lock.
                drop(g);
                panic!("injected fault: engine of queue {q}");
            }
            self.take_page_tail_guarded(&mut g, q);
            // Nothing runs on failed VRAM: a command the queue would run stops it with
            // ERR_DEVICE_LOST (published and interrupting before the report), and the engine
            // reports the failure (once; not while the device waits for a predecessor's
            // state, without its hook yet).
            let vram_ok = self.vram.usable();
            if !vram_ok {
                Self::stop_on_lost_vram(&mut g, q);
                if !self.faults.reported() && !g.holds.successor {
                    drop(g);
                    self.vram_failed();
                    g = self.lock();
                    continue;
                }
            }
            #[cfg(test)]
            g.note_seen(q);
            let Some(job) = g.next_job(q) else {
                // On failed VRAM a queue is runnable still (new work stops it at once: a
                // mapped queue asks for kicks), but its engine does not poll.
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
                if runnable && vram_ok && !polled && !window.is_zero() && self.start_polling() {
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
            let mut outcome = exec.run(job.slot, &mut scratch);
            if !self.vram.usable() {
                // VRAM failed meanwhile: whatever the command did, it does not complete.
                outcome = outcome.device_lost(job.slot);
            }
            if matches!(outcome.result, Err(ExecError::BoardLost)) {
                let reason = exec.take_lost().unwrap_or_default();
                if self.board_lost(q, reason) {
                    // Failed over: the command stays in flight for the replacement.
                    return;
                }
                outcome = outcome.device_lost(job.slot);
            }
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
