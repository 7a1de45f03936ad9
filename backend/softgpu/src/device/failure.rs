//! The engines' side of board failures (see `crate::fault`): an engine thread that dies is
//! caught, what it held released and the failure reported; injected faults reach the engines
//! wherever they wait; on failed VRAM a queue with work stops with `ERR_DEVICE_LOST`.

use std::any::Any;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::Ordering;

use switchyard_device::DeviceError;
use switchyard_device::kind::BoardFailure;

use super::{Guard, Shared};
use crate::regs::ERR_DEVICE_LOST;

/// The message of a panic payload (`panic!` gives a `&str` or a `String`).
fn panic_message(payload: &(dyn Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("panicked")
}

impl Shared {
    /// The body of engine thread `q`: [`Shared::engine`], and if it panics (the engine died,
    /// its queue will never run another command), the failure handled and reported before
    /// the thread ends with the panic (which the join in `Drop for SoftGpu` logs).
    pub(crate) fn run_engine(&self, q: usize) {
        let Err(payload) = catch_unwind(AssertUnwindSafe(|| self.engine(q))) else {
            return;
        };
        self.faults.fail_engine(q);
        self.engine_died(q);
        let reason = format!(
            "the engine of queue {q} died: {}",
            panic_message(payload.as_ref())
        );
        self.faults.report(
            &self.irqs,
            BoardFailure {
                reason,
                state_intact: true,
            },
        );
        resume_unwind(payload);
    }

    /// Engine `q`'s thread died: it runs its command no more, so nothing is to wait for it
    /// (quiesces, resets, swaps). The command's in-flight marker stays, for a replacement.
    fn engine_died(&self, q: usize) {
        let mut g = self.lock();
        if let Some(rt) = g.rt.get_mut(q) {
            rt.busy = false;
        }
        if g.idle_waiters > 0 {
            self.idle.notify_all();
        }
    }

    /// The engine an injected engine fault kills: the first alive one running a command,
    /// else the first alive one.
    pub(crate) fn pick_engine_to_fail(&self) -> Option<usize> {
        let g = self.lock();
        let n = self.config.queues as usize;
        let alive = |q: &usize| !self.faults.engine_failed(*q);
        (0..n)
            .filter(alive)
            .find(|&q| g.rt.get(q).is_some_and(|rt| rt.busy))
            .or_else(|| (0..n).find(alive))
    }

    /// Wakes the engines of `mask` wherever they wait for work (polling or sleeping), to
    /// look at their fault flags and VRAM. Call without the register lock.
    pub(crate) fn wake_engines(&self, mask: u32) {
        // An engine checks its flags under the lock, then waits: once the lock has been
        // taken here, it is either before its check or waiting.
        drop(self.lock());
        for q in self.queues_in(mask) {
            if let Some(poll) = self.polls.get(q) {
                poll.rung.fetch_add(1, Ordering::Release);
            }
            if let Some(cv) = self.wake.get(q) {
                cv.notify_all();
            }
        }
    }

    /// On failed VRAM: if queue `q` would run a command now (enabled, not in error, work
    /// pending, engines not held), it stops with `ERR_DEVICE_LOST` at that command, latched as
    /// any queue error (the command had not started, or was abandoned half done: no opcode).
    /// Nothing reaches VRAM. The registers are borrowed mutably only if the queue stops.
    pub(super) fn stop_on_lost_vram(g: &mut Guard<'_>, q: usize) {
        let Some(job) = g.next_job(q) else {
            return;
        };
        if let Some(i) = g.inflight.get_mut(q) {
            *i = None;
        }
        g.work.errors += 1;
        g.set_error(q, ERR_DEVICE_LOST, job.slot, 0);
    }

    /// The accelerator lost the board while engine `q` ran a command: reports it (the state
    /// is intact: VRAM's memfd and the mirror hold everything completed). Returns whether
    /// the engine stops, its command left in flight for a replacement (the failure is
    /// handled above the device: a failover); else the caller fails the command with
    /// `ERR_DEVICE_LOST`, as every later one will be (the loss is sticky).
    pub(super) fn board_lost(&self, q: usize, reason: String) -> bool {
        let handled = self.faults.report(
            &self.irqs,
            BoardFailure {
                reason: format!("the board's accelerator was lost: {reason}"),
                state_intact: true,
            },
        );
        if handled {
            self.faults.fail_engine(q);
            self.engine_died(q);
        }
        handled
    }

    /// Reports that VRAM failed (once per device; the caller found it so, holding no lock).
    pub(crate) fn vram_failed(&self) {
        self.faults.report(
            &self.irqs,
            BoardFailure {
                reason: "the VRAM failed: its contents are lost".to_owned(),
                state_intact: false,
            },
        );
    }

    /// Checks that VRAM is usable for an access through the device: `EIO` (and the failure
    /// reported, if nobody did yet) when it is not.
    pub(crate) fn vram_access(&self) -> Result<(), DeviceError> {
        self.vram.check().inspect_err(|_| {
            if !self.faults.reported() {
                self.vram_failed();
            }
        })?;
        Ok(())
    }
}
