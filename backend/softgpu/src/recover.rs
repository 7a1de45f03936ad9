//! A device that mirrors its state into a black box, and its recovery in a replacement
//! process (see [Restarts](crate#restarts)).

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::Arc;

use switchyard_device::blackbox::{BlackBox, RecordSpec};
use switchyard_device::{DeviceContext, DmaSpace};

use crate::cmd::{self, COMMAND_SIZE, Command, Operand};
use crate::device::Holds;
use crate::mirror::slot_iova;
use crate::state::{SoftGpuState, StateError};
use crate::{SoftGpu, SoftGpuConfig, SoftGpuError, VRAM_OBJECT, VramRef, build_config_space};
use crate::{doorbell, mirror, regs, vram};

#[cfg(doc)]
use crate::{COLD_RECORD, HOT_RECORD};

/// What [`SoftGpu::recover`] did with one queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueRecovery {
    /// No command was executing.
    Idle,
    /// Command `index` was executing and can safely run again (its outputs do not overlap its
    /// inputs, or its command could not be read and faults again as usual): it runs again
    /// from its start.
    Replayed {
        /// Free-running ring index.
        index: u32,
    },
    /// Command `index` was executing and cannot run again safely (e.g. an in-place SAXPY), or
    /// could not be read without the client (a ring in a window without a file descriptor):
    /// the queue stopped with [`regs::ERR_INTERRUPTED`] on it.
    Interrupted {
        /// Free-running ring index.
        index: u32,
        /// Its opcode (`None`: not read).
        opcode: Option<u8>,
    },
}

/// What [`SoftGpu::recover`] found and did, for logs and tests.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Per queue.
    pub queues: Vec<QueueRecovery>,
    /// Interrupts sent again because the dead process may not have sent them: bit v MSI-X
    /// vector v, bit 31 the MSI vector.
    pub resent: u32,
}

impl SoftGpu {
    /// The records a [`BlackBox`] needs to mirror a device of `config` (see
    /// [`SoftGpu::with_black_box`]): [`HOT_RECORD`] and [`COLD_RECORD`], with their
    /// capacities.
    pub fn black_box_records(config: &SoftGpuConfig) -> Vec<RecordSpec> {
        mirror::records(config)
    }

    /// A new VRAM backing for a device of `config`: a zeroed memfd of `config.vram_size`
    /// bytes, sealed against shrinking and growing (for a pool daemon that keeps VRAM across
    /// the processes that serve it; see [`SoftGpu::with_black_box`]).
    pub fn create_vram(config: &SoftGpuConfig) -> Result<File, SoftGpuError> {
        config.validate()?;
        let vram = vram::Vram::create(config.vram_size, false)?;
        vram.file().try_clone().map_err(SoftGpuError::Vram)
    }

    /// Creates a device that mirrors its state into `bb` (whose records are
    /// [`SoftGpu::black_box_records`], none published yet), so that
    /// [`SoftGpu::recover`] can resume it in another process after this one died.
    ///
    /// Its VRAM is `vram` if given (a sealed memfd of `config.vram_size` bytes, e.g. from
    /// [`SoftGpu::create_vram`]; its contents are kept), which becomes the slot's VRAM object
    /// `"softgpu.vram"`, else the slot's as with [`SoftGpu::new`]. A replacement process needs
    /// that memfd: [`SoftGpu::vram_memfd`].
    ///
    /// Every change of the device state is published into `bb` before the lock that guards it
    /// is released and before the interrupts it causes are sent, so nothing the guest observes
    /// (a register value, an interrupt) is unknown to a replacement. A command's in-flight
    /// marker is published before it starts. See [`SoftGpu::recover`] for what a replacement
    /// makes of it.
    pub fn with_black_box(
        config: SoftGpuConfig,
        ctx: DeviceContext,
        bb: &Arc<BlackBox>,
        vram: Option<File>,
    ) -> Result<SoftGpu, SoftGpuError> {
        config.validate()?;
        let mirror = mirror::Mirror::fresh(bb, &config)?;
        let gpu = match vram {
            Some(file) => {
                check_sealed(&file)?;
                Self::with_vram(config, ctx, Arc::new(file))?
            }
            None => Self::new(config, ctx)?,
        };
        {
            // Nothing has run yet (no queue is enabled): publish the power-on state.
            let mut g = gpu.shared.lock();
            g.mirror = Some(mirror);
            g.cold_changed();
        }
        Ok(gpu)
    }

    /// Resumes, in a new process, the device that mirrored its state into `bb`
    /// ([`SoftGpu::with_black_box`] or an earlier recovery) and was killed, on its VRAM memfd
    /// `vram`, with `ctx` holding the same DMA windows and interrupt eventfds as the dead
    /// process had.
    ///
    /// `vram` must be sealed against shrinking and growing, of `config.vram_size` bytes and
    /// the very memfd the black box's device used; it becomes the slot's VRAM object
    /// `"softgpu.vram"`. `doorbells` is the doorbell page's backing the dead process used
    /// ([`SoftGpu::doorbell_memfd`]), which the guest may have mapped: the tails in it are
    /// newer than the state's. Without it (a worker that kept none) the device makes a new
    /// page and writes the mapped queues' tails into it. The state is the last one published
    /// (hash-checked by the black box);
    /// a black box written by a device of another configuration is refused
    /// ([`StateError::ConfigMismatch`], [`StateError::IrqModeMismatch`]).
    ///
    /// For each queue whose command was executing (its in-flight marker is set), the command
    /// is read from the ring through `ctx.dma` and:
    /// - run again from its start if that is safe: NOP, FILL, FENCE, COPY whose source and
    ///   destination do not overlap, GEMM whose C overlaps neither A nor B, REDUCE whose output
    ///   does not overlap its input, a command that faults before writing anything (a bad
    ///   opcode or header), or a slot that cannot be read (it then faults with
    ///   `ERR_RING_FETCH` as usual);
    /// - otherwise (SAXPY, overlapping operands; also a ring in a window without a file
    ///   descriptor, which is not read: that would wait for the client) the queue stops with
    ///   [`regs::ERR_INTERRUPTED`] on it (`ERROR_INDEX` = the command, error interrupt raised
    ///   as for any queue error), and the driver recovers it with `RECOVER`.
    ///
    /// A completed command was published with its `HEAD`, `COMPLETED`, `FENCE_COUNT` and
    /// `INT_STATUS` effects in one piece, so none is lost or counted twice. The interrupts
    /// the dead process owed when it last published are sent again: the guest may see a
    /// duplicate interrupt, never miss one. The engines run once the state is in place, and
    /// the device keeps mirroring into `bb`.
    ///
    /// Not carried over: the migration STOP state and engine parks (the server re-applies
    /// what it journaled), a disconnected client's halt, an open migration stream.
    pub fn recover(
        config: SoftGpuConfig,
        ctx: DeviceContext,
        bb: &Arc<BlackBox>,
        vram: File,
        doorbells: Option<File>,
    ) -> Result<(SoftGpu, Recovery), SoftGpuError> {
        config.validate()?;
        check_sealed(&vram)?;
        if let Some(file) = doorbells {
            let page = doorbell::DoorbellPage::adopt(Arc::new(file))?;
            ctx.memory.insert(doorbell::DOORBELL_OBJECT, Arc::new(page));
        }
        let (mirror, saved) = mirror::Mirror::recover(bb, &config)?;
        let vram = Arc::new(vram::Vram::adopt(
            Arc::new(vram),
            config.vram_size,
            !config.vram_mmap,
        )?);
        if saved.state.vram != vram.identity() {
            return Err(SoftGpuError::VramMismatch {
                saved: saved.state.vram,
                got: vram.identity(),
            });
        }
        let def = build_config_space(&config);
        let mut st = saved.state;
        st.validate(config, vram.size(), &def)?;
        st.config_space.restore_masks_from(&def);
        let plans = plan_replays(&st, &saved.inflight, &ctx.dma)?;
        ctx.memory.insert(VRAM_OBJECT, vram.clone());
        let holds = Holds {
            successor: true,
            ..Holds::default()
        };
        let gpu = Self::start(config, ctx, vram, holds)?;
        let mut queues = Vec::with_capacity(plans.len());
        gpu.shared.adopt_doorbells(&mut st);
        {
            let mut g = gpu.shared.lock();
            g.st = st;
            g.owe_raw(saved.owed);
            for (q, plan) in plans.into_iter().enumerate() {
                match plan {
                    QueueRecovery::Interrupted { opcode, .. } => {
                        let slot = mirror::slot_iova(&g.st.queues[q], g.st.queues[q].head);
                        let opcode = opcode.map_or(0, u32::from);
                        g.set_error(q, regs::ERR_INTERRUPTED, slot, opcode);
                        g.work.interrupted += 1;
                    }
                    QueueRecovery::Replayed { .. } => g.work.replayed += 1,
                    QueueRecovery::Idle => {}
                }
                queues.push(plan);
            }
            // Mirrored from here on: this flush publishes the recovered state, then sends
            // the interrupts owed.
            g.mirror = Some(mirror);
            g.cold_changed();
        }
        gpu.shared.set_hold(|h| h.successor = false, false);
        let recovery = Recovery {
            queues,
            resent: saved.owed,
        };
        tracing::info!(?recovery, "softgpu recovered from its black box");
        Ok((gpu, recovery))
    }

    /// The VRAM the device whose state is in `bb` uses (for a replacement that holds more
    /// than one VRAM memfd, e.g. when its predecessor died during a relocation, to pick the
    /// one to [`SoftGpu::recover`] on). Reads only.
    pub fn black_box_vram(
        config: &SoftGpuConfig,
        bb: &Arc<BlackBox>,
    ) -> Result<VramRef, SoftGpuError> {
        let (_, saved) = mirror::Mirror::recover(bb, config)?;
        Ok(saved.state.vram)
    }

    /// A new descriptor of the doorbell page's backing (for a pool daemon to keep, so that a
    /// replacement process can [`SoftGpu::recover`] on the page the guest mapped).
    pub fn doorbell_memfd(&self) -> Result<File, SoftGpuError> {
        self.shared
            .bells
            .file()
            .try_clone()
            .map_err(SoftGpuError::Doorbells)
    }

    /// A new descriptor of the VRAM memfd (for a pool daemon to keep, so that a replacement
    /// process can [`SoftGpu::recover`] on it).
    pub fn vram_memfd(&self) -> Result<File, SoftGpuError> {
        self.shared
            .vram
            .file()
            .try_clone()
            .map_err(SoftGpuError::Vram)
    }
}

/// Checks that `file` is sealed against shrinking and growing.
pub(crate) fn check_sealed(file: &File) -> Result<(), SoftGpuError> {
    let seals = rustix::fs::fcntl_get_seals(file.as_fd())
        .map_err(|e| SoftGpuError::VramNotSealed(e.into()))?;
    if seals.contains(rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW) {
        Ok(())
    } else {
        Err(SoftGpuError::VramNotSealed(std::io::Error::other(format!(
            "seals {seals:?}"
        ))))
    }
}

/// What recovery does with each queue's command in flight (see [`crate::SoftGpu::recover`]):
/// reads it from the ring through `dma` and tells whether it can run again.
pub(crate) fn plan_replays(
    st: &SoftGpuState,
    inflight: &[Option<u32>],
    dma: &DmaSpace,
) -> Result<Vec<QueueRecovery>, SoftGpuError> {
    st.queues
        .iter()
        .zip(inflight)
        .map(|(qs, inflight)| {
            let Some(index) = *inflight else {
                return Ok(QueueRecovery::Idle);
            };
            // HEAD moves only when a command completes, which clears the marker in the same
            // publish.
            if index != qs.head {
                return Err(StateError::Inconsistent(
                    "a command in flight is not at its queue's head",
                )
                .into());
            }
            let slot = slot_iova(qs, index);
            let remote = dma.mappings().iter().any(|m| {
                !m.mmapped
                    && slot < m.iova.saturating_add(m.size)
                    && m.iova < slot.saturating_add(COMMAND_SIZE as u64)
            });
            if remote {
                // Reading it would wait for the client, whose replies the thread building the
                // device may be the one to route: not knowing the command, assume the worst.
                return Ok(QueueRecovery::Interrupted {
                    index,
                    opcode: None,
                });
            }
            let mut raw = [0u8; COMMAND_SIZE];
            if dma.read(slot, &mut raw).is_err() {
                // The engine fails to fetch it again and latches ERR_RING_FETCH as usual.
                return Ok(QueueRecovery::Replayed { index });
            }
            let c = Command::decode(&raw);
            Ok(if replayable(&c) {
                QueueRecovery::Replayed { index }
            } else {
                QueueRecovery::Interrupted {
                    index,
                    opcode: Some(c.opcode),
                }
            })
        })
        .collect()
}

/// Whether running `c` again from its start, after it ran partly, gives the result of
/// running it once: its outputs do not overlap its inputs (or it faults before it writes
/// anything).
pub(crate) fn replayable(c: &Command) -> bool {
    if c.flags & !cmd::FLAG_IRQ != 0 || c.reserved != 0 {
        // Refused before anything is written.
        return true;
    }
    let range = |i: usize, len: u64| (c.operand(i), len);
    let overlap = |(a, la): (Operand, u64), (b, lb): (Operand, u64)| {
        a.is_vram() == b.is_vram()
            && la > 0
            && lb > 0
            && a.addr() < b.addr().saturating_add(lb)
            && b.addr() < a.addr().saturating_add(la)
    };
    let [a0, a1, a2] = c.arg;
    match c.opcode {
        cmd::OP_NOP | cmd::OP_FILL | cmd::OP_FENCE => true,
        cmd::OP_COPY => !overlap(range(0, a0), range(1, a0)),
        // y is read and written.
        cmd::OP_SAXPY => a0 == 0,
        cmd::OP_GEMM => {
            let (m, n, k) = (a0, a1, a2);
            let out = range(2, m.saturating_mul(n).saturating_mul(4));
            !overlap(out, range(0, m.saturating_mul(k).saturating_mul(4)))
                && !overlap(out, range(1, k.saturating_mul(n).saturating_mul(4)))
        }
        cmd::OP_REDUCE => !overlap(range(1, 4), range(0, a0.saturating_mul(4))),
        // An unknown opcode faults before anything is written.
        _ => true,
    }
}
