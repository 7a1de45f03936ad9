//! Board failures: reporting them once through the failure hook (or the ERR interrupt), and
//! simulating them ([`FaultInjection`]); the engines detect them (`device/failure.rs`). See
//! [Device failure](crate#device-failure-the-err-interrupt).
//!
//! Two failures are detected:
//!
//! - an engine thread died (it panicked): its thread body catches the unwind, releases what
//!   the engine held (its queue no longer counts as busy, so nothing waits for it), reports,
//!   and resumes the unwind (the join in `Drop` logs it). The device state survives: the
//!   registers are in the black box, VRAM in its memfd.
//! - VRAM failed ([`Vram::fail`]): engines, woken, find it at their next look for work and
//!   report it (as does a BAR2 access); from then on nothing the device does reaches VRAM,
//!   and no command completes: a running one stops at its next checkpoint, and every queue
//!   with work stops with `ERR_DEVICE_LOST` (a queue error the driver sees at once), now or
//!   when it is given work.
//!
//! A report calls the hook without the register lock (the hook tells a supervisor and may
//! block for a while), from the thread that detected the failure, once per device.
//!
//! [`Vram::fail`]: crate::vram::Vram::fail

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use switchyard_device::kind::{BoardFailure, FailedHook};
use switchyard_device::{DeviceError, FaultInjection, Interrupts, IrqIndex};

use crate::SoftGpu;

/// The faults [`SoftGpu`] can simulate.
const FAULT_KINDS: &[&str] = &["engine", "vram"];

/// A device's failure reporting and injected faults.
pub(crate) struct Faults {
    /// Where failures go; without one (or if it declines) the ERR interrupt is signalled.
    hook: Mutex<Option<FailedHook>>,
    /// A failure was reported (or the device handed its state over): later ones report
    /// nothing.
    reported: AtomicBool,
    /// The failure reported was handled above the device (a failover).
    handled: AtomicBool,
    /// Per queue: the engine died or is to die at its next check (an injected fault).
    engine: Vec<AtomicBool>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults")
            .field("hook", &self.hook().is_some())
            .field("reported", &self.reported.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Faults {
    pub(crate) fn new(queues: usize) -> Self {
        Self {
            hook: Mutex::new(None),
            reported: AtomicBool::new(false),
            handled: AtomicBool::new(false),
            engine: (0..queues).map(|_| AtomicBool::new(false)).collect(),
        }
    }

    fn hook(&self) -> Option<FailedHook> {
        self.hook.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(crate) fn set_hook(&self, hook: Option<FailedHook>) {
        *self.hook.lock().unwrap_or_else(|p| p.into_inner()) = hook;
    }

    /// A device hands its state to `next`: the hook goes with it (unless `next` has one of
    /// its own) and this device, retired, reports nothing any more.
    pub(crate) fn hand_over(&self, next: &Faults) {
        self.reported.store(true, Ordering::SeqCst);
        let hook = self.hook.lock().unwrap_or_else(|p| p.into_inner()).take();
        let mut theirs = next.hook.lock().unwrap_or_else(|p| p.into_inner());
        if theirs.is_none() {
            *theirs = hook;
        }
    }

    /// Whether a failure was reported already.
    pub(crate) fn reported(&self) -> bool {
        self.reported.load(Ordering::SeqCst)
    }

    /// Whether engine `q` died or is to die.
    pub(crate) fn engine_failed(&self, q: usize) -> bool {
        self.engine.get(q).is_some_and(|f| f.load(Ordering::SeqCst))
    }

    /// The flag of engine `q` (for its executor's checkpoints).
    pub(crate) fn engine_flag(&self, q: usize) -> Option<&AtomicBool> {
        self.engine.get(q)
    }

    /// Marks engine `q` failed; whether it was alive until now.
    pub(crate) fn fail_engine(&self, q: usize) -> bool {
        self.engine
            .get(q)
            .is_some_and(|f| !f.swap(true, Ordering::SeqCst))
    }

    /// The failure reported as handled above the device will not be (the pool refused to
    /// fail it over): the client is told now, as it would have been without a hook (the ERR
    /// interrupt), once.
    pub(crate) fn unhandled(&self, irqs: &Interrupts) {
        if !self.reported.load(Ordering::SeqCst) || !self.handled.swap(false, Ordering::SeqCst) {
            return;
        }
        let signalled = irqs.trigger(IrqIndex::Err, 0);
        tracing::error!(
            err_irq_signalled = matches!(signalled, Ok(true)),
            "the failure will not be failed over: the softgpu is broken (ERR interrupt)"
        );
    }

    /// Reports `failure`, if it is the device's first: to the hook, or, if there is none or
    /// it declines, to the client as the ERR interrupt. Call without the register lock.
    /// Returns whether the device's (first) failure is handled above the device.
    pub(crate) fn report(&self, irqs: &Interrupts, failure: BoardFailure) -> bool {
        if self.reported.swap(true, Ordering::SeqCst) {
            tracing::debug!(reason = %failure.reason, "another softgpu failure (reported already)");
            return self.handled.load(Ordering::SeqCst);
        }
        tracing::error!(
            reason = %failure.reason,
            state_intact = failure.state_intact,
            "the softgpu failed"
        );
        let handled = self.hook().is_some_and(|hook| hook(failure));
        self.handled.store(handled, Ordering::SeqCst);
        if handled {
            tracing::info!("the failure is handled above the device: no ERR interrupt");
            return true;
        }
        let signalled = irqs.trigger(IrqIndex::Err, 0);
        tracing::error!(
            err_irq_signalled = matches!(signalled, Ok(true)),
            "the softgpu is broken (ERR interrupt)"
        );
        false
    }
}

impl SoftGpu {
    /// Sets where the device reports that its board failed (see [`FailedHook`]): an engine
    /// thread died (`state_intact`: the registers are mirrored, VRAM is in its memfd), or
    /// VRAM failed (its contents are lost). Reported once per device, from the thread that
    /// detected the failure, without the device's locks held; the hook must not wait for
    /// this device to be dropped or swapped. If the hook returns `true` the device does not
    /// signal its ERR interrupt; without a hook, or if it returns `false`, it does. A swap
    /// hands the hook to the successor.
    pub fn set_failure_hook(&self, hook: Option<FailedHook>) {
        self.shared.faults.set_hook(hook);
    }

    /// [`SoftGpu::set_failure_hook`], for building.
    pub fn with_failure_hook(self, hook: Option<FailedHook>) -> Self {
        self.set_failure_hook(hook);
        self
    }

    /// Kills an engine: the first one running a command, else the first alive. `None` if
    /// every engine is dead already.
    fn inject_engine_fault(&self) -> Option<usize> {
        let q = self.shared.pick_engine_to_fail()?;
        if self.shared.faults.fail_engine(q) {
            tracing::warn!(queue = q, "injecting a fault: the engine dies");
            self.shared.wake_engines(1 << q);
        }
        Some(q)
    }
}

impl FaultInjection for SoftGpu {
    fn fault_kinds(&self) -> &'static [&'static str] {
        FAULT_KINDS
    }

    /// `engine`: the engine of the first queue running a command (else of the first queue
    /// whose engine is alive) panics at its next checkpoint or look for work, idle or not.
    /// `vram`: VRAM fails for good; engines and BAR2 accesses find it so, and queues with work
    /// stop with `ERR_DEVICE_LOST`. Another kind:
    /// [`DeviceError::Unsupported`].
    fn inject_fault(&self, kind: &str) -> Result<(), DeviceError> {
        match kind {
            "engine" => {
                if self.inject_engine_fault().is_none() {
                    tracing::warn!("no engine left to inject a fault into");
                }
                Ok(())
            }
            "vram" => {
                if self.shared.vram.fail() {
                    tracing::warn!("injecting a fault: VRAM fails");
                }
                self.shared.wake_engines(u32::MAX);
                Ok(())
            }
            _ => Err(DeviceError::Unsupported),
        }
    }
}
