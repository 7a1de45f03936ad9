//! The register file: the device state behind the register lock, what an engine picks from
//! it and records in it, and the BAR0 register reads.

use std::cell::Cell;

use switchyard_device::msix::MsixSignal;
use switchyard_device::{Interrupts, IrqIndex};

use crate::IrqMode;
use crate::cmd::COMMAND_SIZE;
use crate::exec::{Done, ExecError, Irq, Outcome};
use crate::mirror::{Mirror, OWED_MSI};
use crate::regs::*;
use crate::state::SoftGpuState;

/// Engine bookkeeping that is not device state.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct Runtime {
    /// The engine is executing a command (outside the lock).
    pub(super) busy: bool,
    /// How many threads wait for this engine to stay at a command boundary.
    pub(super) paused: u32,
    /// Bumped by every queue or device reset and restore; results of a command started in an
    /// older epoch are discarded.
    pub(super) epoch: u64,
    /// What the engine saw when it last looked for work (tests wait for it instead of sleeping).
    #[cfg(test)]
    pub(super) seen: Seen,
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
    pub(super) fn any(&self) -> bool {
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
    pub(super) owed: u32,
    /// Where the state is mirrored, if anywhere.
    pub(crate) mirror: Option<Mirror>,
    pub(super) rt: Vec<Runtime>,
    /// The client disconnected: engines are parked.
    pub(super) halted: bool,
    /// Why else the engines are parked.
    pub(crate) holds: Holds,
    pub(super) shutdown: bool,
    /// Threads waiting on `idle` (engines skip the futex wake when nobody waits).
    pub(super) idle_waiters: u32,
    /// Engines a doorbell made runnable; woken after the register lock is dropped so the
    /// engine does not wake up only to block on that lock.
    pub(super) pending_wake: u32,
    /// What the engines did (not device state: for the pool's metrics).
    pub(crate) work: crate::WorkStats,
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
pub(super) struct Job {
    pub(super) index: u32,
    pub(super) slot: u64,
    pub(super) epoch: u64,
}

impl Regs {
    /// Publishes the state if it is mirrored, then sends the owed interrupts. Only
    /// [`Guard`](super::Guard) calls it.
    pub(super) fn flush(&mut self, irqs: &Interrupts) {
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
    pub(super) fn note_seen(&mut self, q: usize) {
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

    pub(super) fn queue_status(&self, q: usize) -> u32 {
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
    pub(super) fn runnable(&self, q: usize) -> bool {
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

    pub(super) fn next_job(&self, q: usize) -> Option<Job> {
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
    pub(super) fn fire(&mut self, vector: u32) {
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
    pub(super) fn fire_msix(&mut self, vector: u32) {
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

    pub(super) fn raise(&mut self, bit: u32, vector: u32) {
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
    pub(super) fn finish(&mut self, q: usize, job: Job, outcome: Outcome) {
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
            // A lost board's command stays in flight (the engine turned it into
            // ERR_DEVICE_LOST if nobody fails the device over).
            Err(ExecError::Aborted | ExecError::BoardLost) => {}
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
    pub(super) fn doorbell(&mut self, q: usize, tail: u32) {
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

    pub(super) fn dev_status(&self) -> u32 {
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

    pub(super) fn queue_read32(&self, q: usize, r: u64) -> u32 {
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
