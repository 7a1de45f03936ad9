//! Swapping the device under a client: parking the engines from another thread
//! ([`EngineControl`], the device's [`Quiesce`]) and handing the state to a parked successor
//! ([`Swappable`]).

use super::*;

/// Parks a device's engines from another thread, without the device itself (e.g. to drain
/// the engines before a swap while region accesses are still served).
#[derive(Debug, Clone)]
pub struct EngineControl(pub(crate) Arc<Shared>);

impl EngineControl {
    /// Parks the engines at a command boundary (waits for the running commands to complete)
    /// until the guard is dropped. Parks compose with the other reasons to hold the engines
    /// (a migration STOP in particular): dropping the guard lets them run only if nothing
    /// else holds them. Call it outside the device slot (it waits for commands, which may
    /// wait for the client's DMA replies).
    pub fn park(&self) -> Parked {
        self.0.set_hold(|h| h.parks += 1, false);
        Parked(self.0.clone())
    }
}

/// Engines parked by [`EngineControl::park`]; dropping it releases this park.
#[derive(Debug)]
#[must_use = "the engines run again when the guard is dropped"]
pub struct Parked(Arc<Shared>);

impl Drop for Parked {
    fn drop(&mut self) {
        self.0
            .set_hold(|h| h.parks = h.parks.saturating_sub(1), false);
    }
}

impl Quiesce for EngineControl {
    fn park(&self) -> QuiesceGuard {
        QuiesceGuard::new(EngineControl::park(self))
    }
}

impl SoftGpu {
    /// The successor must be a softgpu with this configuration and VRAM backing (the client
    /// sees the queue count and maps the VRAM), and no migration stream may be open.
    fn check_softgpu_successor(&self, next: &SoftGpu) -> Result<(), &'static str> {
        if !matches!(self.migration, Migration::Idle) {
            return Err("a migration stream is open");
        }
        if next.config != self.config {
            return Err("another configuration (queues, VRAM size, interrupt mode)");
        }
        let relocating_here = next
            .incoming
            .as_ref()
            .is_some_and(|i| i.relocation.source_identity() == self.vram_identity());
        if next.vram_identity() != self.vram_identity() && !relocating_here {
            return Err("another VRAM backing");
        }
        Ok(())
    }

    /// Hands this device's state to `next` (see [`Swappable::hand_over`]).
    ///
    /// This device's engines are parked first (after their current command; park them
    /// earlier with [`EngineControl::park`], outside the slot, to keep that wait out of the
    /// swap) and stay parked for good: the successor continues every queue from its head, so
    /// every command runs exactly once. A command an engine that died left half done is
    /// treated as by [`SoftGpu::recover`]: run again from its start when that is safe, else
    /// its queue stops with `ERR_INTERRUPTED` on it. The failure hook goes to the successor
    /// ([`SoftGpu::set_failure_hook`]). On error this device runs again (unless something
    /// else holds it) and the successor stays parked.
    pub fn hand_over_to(&mut self, next: &mut SoftGpu) -> Result<(), SoftGpuError> {
        self.check_softgpu_successor(next)
            .map_err(StateError::Inconsistent)?;
        self.shared.set_hold(|h| h.retired = true, true);
        // Parked because the client is gone is runtime state, not device state: carry it.
        let halted = self.shared.halted();
        let state = match next.prepare(self.snapshot()) {
            Ok(state) => state,
            Err(e) => {
                self.shared.set_hold(|h| h.retired = false, true);
                return Err(e.into());
            }
        };
        // A command a dead engine left half done is treated as by a recovery: run again when
        // that is safe, else its queue stops with ERR_INTERRUPTED.
        let plans = match self.dead_engines_plans(&state) {
            Ok(plans) => plans,
            Err(e) => {
                self.shared.set_hold(|h| h.retired = false, true);
                return Err(e);
            }
        };
        // A relocation's last changes: nothing writes the source VRAM now (engines parked,
        // region accesses waiting for the slot). The last step that can fail.
        if let Some(incoming) = next.incoming.take() {
            match incoming.finish() {
                Ok(stats) => next.relocated = Some(stats),
                Err(e) => {
                    self.shared.set_hold(|h| h.retired = false, true);
                    return Err(e);
                }
            }
        }
        // The black box this device mirrors into, if any, follows the state: the successor
        // publishes it with the state it loads.
        let (mirror, work) = {
            let mut g = self.shared.lock();
            (g.mirror.take(), g.work)
        };
        next.shared.lock().work = work;
        self.shared.faults.hand_over(&next.shared.faults);
        next.shared.load(state, mirror);
        next.interrupt_commands(&plans);
        if halted {
            next.shared.halt();
        }
        next.shared.set_hold(|h| h.successor = false, true);
        Ok(())
    }
}

impl SoftGpu {
    /// What to do with the commands the dead engines of this (parked) device were running.
    fn dead_engines_plans(&self, state: &SoftGpuState) -> Result<Vec<QueueRecovery>, SoftGpuError> {
        let inflight: Vec<Option<u32>> = {
            let g = self.shared.lock();
            (0..g.inflight.len())
                .map(|q| {
                    let dead = self.shared.faults.engine_failed(q);
                    g.inflight.get(q).copied().flatten().filter(|_| dead)
                })
                .collect()
        };
        if inflight.iter().all(Option::is_none) {
            return Ok(Vec::new());
        }
        crate::recover::plan_replays(state, &inflight, &self.shared.dma)
    }

    /// Stops with `ERR_INTERRUPTED` the queues whose command cannot run again (`plans`).
    fn interrupt_commands(&self, plans: &[QueueRecovery]) {
        let mut g = self.shared.lock();
        for (q, plan) in plans.iter().enumerate() {
            if let QueueRecovery::Interrupted { opcode, .. } = *plan
                && let Some(qs) = g.st.queues.get(q)
            {
                tracing::warn!(queue = q, "a dead engine's command cannot run again");
                let slot = crate::mirror::slot_iova(qs, qs.head);
                g.set_error(q, regs::ERR_INTERRUPTED, slot, opcode.map_or(0, u32::from));
            }
        }
    }
}

impl Swappable for SoftGpu {
    fn quiesce(&self) -> Arc<dyn Quiesce> {
        Arc::new(self.engine_control())
    }

    /// A softgpu on the slot's VRAM ([`SoftGpu::successor`]).
    fn successor(&self) -> SuccessorFactory {
        let config = self.config();
        Box::new(move |ctx| {
            SoftGpu::successor(config, ctx)
                .map(|next| Box::new(next) as Box<dyn PciDevice>)
                .map_err(|e| DeviceError::Failed(Box::new(e)))
        })
    }

    fn check_successor(&self, next: &dyn PciDevice) -> Result<(), &'static str> {
        let next = next
            .as_any()
            .downcast_ref::<SoftGpu>()
            .ok_or("another kind of device")?;
        self.check_softgpu_successor(next)
    }

    fn hand_over(&mut self, next: &mut dyn PciDevice) -> Result<(), DeviceError> {
        let next = next.as_any_mut().downcast_mut::<SoftGpu>().ok_or_else(|| {
            DeviceError::BadState("the successor is another kind of device".into())
        })?;
        self.hand_over_to(next)
            .map_err(|e| DeviceError::Failed(Box::new(e)))
    }
}
