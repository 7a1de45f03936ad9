//! Mirroring the device state into a [`BlackBox`] and reading it back after the process that
//! served the device was killed.
//!
//! Two records:
//!
//! - `softgpu.hot` ([`HOT_RECORD`]): what changes at message and command rate, in a fixed
//!   little-endian layout of at most [`HOT_MAX`] bytes (below), published whenever it differs
//!   from the last publish.
//! - `softgpu.cold` ([`COLD_RECORD`]): the whole state as JSON ([`SoftGpuState`] plus the
//!   in-flight markers and the owed interrupts), published only when the config space, the
//!   MSI-X table or the PBA changed (config-space and BAR4 writes, masked MSI-X vectors going
//!   pending, resets, restores).
//!
//! A flush that publishes both writes the cold record first, then the hot one, which names the
//! cold generation it goes with. A reader that finds a cold record newer than the hot one
//! names (a process killed between the two publishes) takes the cold record alone: it is a
//! whole state of its own. Otherwise it overlays the hot fields on the cold state.
//!
//! Hot layout (all little endian):
//!
//! | offset | size | field |
//! |---|---|---|
//! | 0 | 4 | magic `"SGHT"` |
//! | 4 | 4 | version (1) |
//! | 8 | 8 | VRAM size |
//! | 16 | 4 | queues |
//! | 20 | 4 | interrupt mode (0 MSI-X, 1 MSI) |
//! | 24 | 8 | generation of the cold record this goes with |
//! | 32 | 4 | `SCRATCH` |
//! | 36 | 4 | `INT_STATUS` |
//! | 40 | 4 | `INT_MASK` |
//! | 44 | 4 | owed interrupts: bit v MSI-X vector v, bit 31 the MSI vector |
//! | 48 | 8 | `FENCE_COUNT` |
//! | 56 + 64 q | 64 | queue q: ring base (8), ring size (4), head (4), tail (4), flags (4: bit 0 enabled, bit 1 a command in flight, bit 2 mapped doorbell), in-flight index (4), error code (4), error index (4), error opcode (4), error address (8), completion vector (4), error vector (4), completed (8) |

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use switchyard_device::blackbox::{BlackBox, BlackBoxError, Record, RecordSpec};

use crate::cmd::COMMAND_SIZE;
use crate::state::{QueueState, SoftGpuState, StateError};
use crate::{IrqMode, SoftGpuConfig, SoftGpuError};

/// Name of the record of the hot state (queue registers, interrupt state, in-flight markers).
pub const HOT_RECORD: &str = "softgpu.hot";
/// Name of the record of the whole state (published when the config space or MSI-X changes).
pub const COLD_RECORD: &str = "softgpu.cold";

const HOT_MAGIC: u32 = u32::from_le_bytes(*b"SGHT");
const HOT_VERSION: u32 = 1;
const HOT_HEADER: usize = 56;
const HOT_QUEUE: usize = 64;
/// Offset of the owed-interrupts word in the hot record.
const OWED_AT: usize = 44;
/// Largest hot record.
pub(crate) const HOT_MAX: usize = HOT_HEADER + SoftGpuConfig::MAX_QUEUES as usize * HOT_QUEUE;
/// Capacity of the cold record: the JSON state is about 20 KiB (the config space is 4096
/// numbers).
const COLD_CAPACITY: usize = 96 << 10;

/// Owed-interrupt bit of the MSI vector (bits 0..16 are MSI-X vectors).
pub(crate) const OWED_MSI: u32 = 1 << 31;

/// The records a black box needs to mirror a softgpu of `config`.
pub(crate) fn records(config: &SoftGpuConfig) -> Vec<RecordSpec> {
    vec![
        RecordSpec::new(HOT_RECORD, HOT_HEADER + config.queues as usize * HOT_QUEUE),
        RecordSpec::new(COLD_RECORD, COLD_CAPACITY),
    ]
}

/// What the cold record holds.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Cold {
    pub(crate) state: SoftGpuState,
    pub(crate) inflight: Vec<Option<u32>>,
    pub(crate) owed: u32,
}

/// What a black box says about the device that last wrote it.
#[derive(Debug)]
pub(crate) struct Saved {
    pub(crate) state: SoftGpuState,
    /// Per queue: the index of the command that was executing.
    pub(crate) inflight: Vec<Option<u32>>,
    /// Interrupts that may not have been sent (bit v MSI-X vector v, [`OWED_MSI`]).
    pub(crate) owed: u32,
}

/// The writer side: a device's records and what it last published.
pub(crate) struct Mirror {
    hot: Record,
    cold: Record,
    last_hot: [u8; HOT_MAX],
    last_len: usize,
    /// The config space, MSI-X table or PBA changed since the last cold publish.
    cold_dirty: bool,
    /// A publish failed (logged once).
    failed: bool,
    /// What the cold part looked like at the last cold publish: debug builds check that
    /// nothing changed it without marking it dirty.
    #[cfg(debug_assertions)]
    cold_print: Vec<u8>,
}

impl std::fmt::Debug for Mirror {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mirror")
            .field("hot_generation", &self.hot.generation())
            .field("cold_generation", &self.cold.generation())
            .finish()
    }
}

fn records_of(
    bb: &Arc<BlackBox>,
    config: &SoftGpuConfig,
) -> Result<(Record, Record), SoftGpuError> {
    let hot = bb.record(HOT_RECORD).map_err(SoftGpuError::BlackBox)?;
    let cold = bb.record(COLD_RECORD).map_err(SoftGpuError::BlackBox)?;
    for (rec, spec) in [&hot, &cold].into_iter().zip(records(config)) {
        if rec.capacity() < spec.capacity {
            return Err(SoftGpuError::BlackBox(BlackBoxError::Layout(format!(
                "record `{}` holds {} bytes, a softgpu with {} queues needs {}",
                spec.name,
                rec.capacity(),
                config.queues,
                spec.capacity
            ))));
        }
    }
    Ok((hot, cold))
}

impl Mirror {
    /// The records of `bb` for a new device: refused if they hold a state already (that
    /// device is to be recovered, not replaced by a new one).
    pub(crate) fn fresh(bb: &Arc<BlackBox>, config: &SoftGpuConfig) -> Result<Self, SoftGpuError> {
        let (hot, cold) = records_of(bb, config)?;
        if hot.generation() != 0 || cold.generation() != 0 {
            return Err(SoftGpuError::BlackBoxInUse);
        }
        Ok(Self::new(hot, cold))
    }

    fn new(hot: Record, cold: Record) -> Self {
        Self {
            hot,
            cold,
            last_hot: [0; HOT_MAX],
            last_len: 0,
            cold_dirty: true,
            failed: false,
            #[cfg(debug_assertions)]
            cold_print: Vec::new(),
        }
    }

    /// Marks the cold part changed: the next flush publishes it.
    pub(crate) fn cold_changed(&mut self) {
        self.cold_dirty = true;
    }

    /// Publishes what changed since the last publish: the cold record if it is dirty, then
    /// the hot record if it differs (ignoring an owed-interrupt word that went back to 0:
    /// owed interrupts are sent right after the publish, and a record that still names them
    /// only costs a duplicate interrupt after a restart).
    pub(crate) fn publish(&mut self, st: &SoftGpuState, inflight: &[Option<u32>], owed: u32) {
        let r = self.try_publish(st, inflight, owed);
        if let Err(e) = r
            && !std::mem::replace(&mut self.failed, true)
        {
            tracing::error!(
                error = %e,
                "cannot mirror the softgpu state into the black box; a restart would lose it"
            );
        }
    }

    fn try_publish(
        &mut self,
        st: &SoftGpuState,
        inflight: &[Option<u32>],
        owed: u32,
    ) -> Result<(), SoftGpuError> {
        if self.cold_dirty {
            let cold = Cold {
                state: st.clone(),
                inflight: inflight.to_vec(),
                owed,
            };
            let bytes = serde_json::to_vec(&cold)
                .map_err(|e| SoftGpuError::State(StateError::Decode(e)))?;
            self.cold.publish(&bytes).map_err(SoftGpuError::BlackBox)?;
            self.cold_dirty = false;
            #[cfg(debug_assertions)]
            {
                self.cold_print = cold_print(st);
            }
            // Force the hot publish: it must name the new cold generation.
            self.last_len = 0;
        } else {
            #[cfg(debug_assertions)]
            debug_assert!(
                cold_print(st) == self.cold_print,
                "the config space or MSI-X state changed without Regs::cold_changed"
            );
        }
        let mut buf = [0u8; HOT_MAX];
        let len = encode_hot(st, inflight, owed, self.cold.generation(), &mut buf);
        let (new, last) = (&buf[..len], &self.last_hot[..self.last_len]);
        let same = if owed != 0 {
            new == last
        } else {
            new.len() == last.len()
                && new[..OWED_AT] == last[..OWED_AT]
                && new[OWED_AT + 4..] == last[OWED_AT + 4..]
        };
        if !same {
            self.hot.publish(new).map_err(SoftGpuError::BlackBox)?;
            self.last_hot[..len].copy_from_slice(new);
            self.last_len = len;
        }
        Ok(())
    }

    /// Reads the state a device of `config` published into `bb`, and the records to continue
    /// mirroring into.
    pub(crate) fn recover(
        bb: &Arc<BlackBox>,
        config: &SoftGpuConfig,
    ) -> Result<(Self, Saved), SoftGpuError> {
        let (hot, cold) = records_of(bb, config)?;
        let cold_bytes = cold
            .read()
            .map_err(SoftGpuError::BlackBox)?
            .ok_or(SoftGpuError::NothingToRecover)?;
        let hot_bytes = hot.read().map_err(SoftGpuError::BlackBox)?;
        let hot_view = hot_bytes.as_deref().map(HotView::new).transpose()?;
        if let Some(h) = &hot_view {
            h.check_config(config)?;
        }
        let Cold {
            state,
            inflight,
            owed,
        } = serde_json::from_slice(&cold_bytes)
            .map_err(|e| SoftGpuError::State(StateError::Decode(e)))?;
        let mut saved = Saved {
            state,
            inflight,
            owed,
        };
        if saved.inflight.len() != saved.state.queues.len() {
            return Err(
                StateError::Inconsistent("in-flight markers do not match the queues").into(),
            );
        }
        match hot_view {
            // The hot record goes with this cold record or a later one: it is newer.
            Some(h) if h.cold_generation() >= cold.generation() => h.overlay(&mut saved)?,
            // Killed between the cold and the hot publish: the cold record is the newest
            // whole state.
            _ => {}
        }
        Ok((Self::new(hot, cold), saved))
    }
}

/// The bytes of the cold part (config space, MSI-X table and PBA), to check that every change
/// of them was marked.
#[cfg(debug_assertions)]
fn cold_print(st: &SoftGpuState) -> Vec<u8> {
    let mut v = vec![0u8; switchyard_device::config::CONFIG_SIZE];
    st.config_space.read(0, &mut v);
    let table = st.msix.table_size() as usize;
    let pba = st.msix.vectors().div_ceil(64) * 8;
    let at = v.len();
    v.resize(at + table + pba + 1, 0);
    st.msix.table_read(0, &mut v[at..at + table]);
    st.msix.pba_read(0, &mut v[at + table..at + table + pba]);
    if let Some(last) = v.last_mut() {
        *last = u8::from(st.msix.direct());
    }
    v
}

struct Writer<'a> {
    buf: &'a mut [u8],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, b: &[u8]) {
        if let Some(d) = self.buf.get_mut(self.at..self.at + b.len()) {
            d.copy_from_slice(b);
        }
        self.at += b.len();
    }
    fn u32(&mut self, v: u32) {
        self.put(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.put(&v.to_le_bytes());
    }
}

fn irq_code(irq: IrqMode) -> u32 {
    match irq {
        IrqMode::Msix => 0,
        IrqMode::Msi => 1,
    }
}

/// Encodes the hot state into `buf`; returns its length.
fn encode_hot(
    st: &SoftGpuState,
    inflight: &[Option<u32>],
    owed: u32,
    cold_generation: u64,
    buf: &mut [u8; HOT_MAX],
) -> usize {
    let mut w = Writer { buf, at: 0 };
    w.u32(HOT_MAGIC);
    w.u32(HOT_VERSION);
    w.u64(st.config.vram_size);
    w.u32(st.config.queues);
    w.u32(irq_code(st.config.irq));
    w.u64(cold_generation);
    w.u32(st.scratch);
    w.u32(st.int_status);
    w.u32(st.int_mask);
    w.u32(owed);
    w.u64(st.fence_count);
    for (q, i) in st.queues.iter().zip(inflight) {
        w.u64(q.ring_base);
        w.u32(q.ring_size);
        w.u32(q.head);
        w.u32(q.tail);
        w.u32(u32::from(q.enabled) | u32::from(i.is_some()) << 1 | u32::from(q.mapped) << 2);
        w.u32(i.unwrap_or(0));
        w.u32(q.error_code);
        w.u32(q.error_index);
        w.u32(q.error_opcode);
        w.u64(q.error_addr);
        w.u32(q.completion_vector);
        w.u32(q.error_vector);
        w.u64(q.completed);
    }
    w.at.min(HOT_MAX)
}

/// A hot record being read.
struct HotView<'a>(&'a [u8]);

fn bad_hot(what: &'static str) -> SoftGpuError {
    SoftGpuError::State(StateError::Inconsistent(what))
}

impl<'a> HotView<'a> {
    fn new(b: &'a [u8]) -> Result<Self, SoftGpuError> {
        let h = HotView(b);
        if b.len() < HOT_HEADER || h.u32(0) != HOT_MAGIC {
            return Err(bad_hot("the hot record is not a softgpu's"));
        }
        if h.u32(4) != HOT_VERSION {
            return Err(bad_hot("the hot record is of another version"));
        }
        if b.len() != HOT_HEADER + h.u32(16) as usize * HOT_QUEUE {
            return Err(bad_hot(
                "the hot record's length does not match its queue count",
            ));
        }
        Ok(h)
    }

    fn u32(&self, at: usize) -> u32 {
        let mut v = [0u8; 4];
        if let Some(s) = self.0.get(at..at + 4) {
            v.copy_from_slice(s);
        }
        u32::from_le_bytes(v)
    }

    fn u64(&self, at: usize) -> u64 {
        let mut v = [0u8; 8];
        if let Some(s) = self.0.get(at..at + 8) {
            v.copy_from_slice(s);
        }
        u64::from_le_bytes(v)
    }

    fn cold_generation(&self) -> u64 {
        self.u64(24)
    }

    /// Refuses a record written by a device of another configuration.
    fn check_config(&self, config: &SoftGpuConfig) -> Result<(), SoftGpuError> {
        let irq = if self.u32(20) == 0 {
            IrqMode::Msix
        } else {
            IrqMode::Msi
        };
        if irq != config.irq {
            return Err(StateError::IrqModeMismatch {
                saved: irq,
                ours: config.irq,
            }
            .into());
        }
        let (queues, vram) = (self.u32(16), self.u64(8));
        if queues != config.queues || vram != config.vram_size {
            return Err(StateError::ConfigMismatch {
                saved_queues: queues,
                saved_vram: vram,
                queues: config.queues,
                vram: config.vram_size,
            }
            .into());
        }
        Ok(())
    }

    fn overlay(&self, saved: &mut Saved) -> Result<(), SoftGpuError> {
        let st = &mut saved.state;
        if st.queues.len() != self.u32(16) as usize {
            return Err(bad_hot(
                "the hot and cold records disagree on the queue count",
            ));
        }
        st.scratch = self.u32(32);
        st.int_status = self.u32(36);
        st.int_mask = self.u32(40);
        saved.owed = self.u32(OWED_AT);
        st.fence_count = self.u64(48);
        for (i, (q, inflight)) in st.queues.iter_mut().zip(&mut saved.inflight).enumerate() {
            let at = HOT_HEADER + i * HOT_QUEUE;
            let flags = self.u32(at + 20);
            *q = QueueState {
                ring_base: self.u64(at),
                ring_size: self.u32(at + 8),
                head: self.u32(at + 12),
                tail: self.u32(at + 16),
                enabled: flags & 1 != 0,
                error_code: self.u32(at + 28),
                error_index: self.u32(at + 32),
                error_opcode: self.u32(at + 36),
                error_addr: self.u64(at + 40),
                completion_vector: self.u32(at + 48),
                error_vector: self.u32(at + 52),
                completed: self.u64(at + 56),
                mapped: flags & 4 != 0,
            };
            *inflight = (flags & 2 != 0).then(|| self.u32(at + 24));
        }
        Ok(())
    }
}

/// The IOVA of ring entry `index` of queue `qs`.
pub(crate) fn slot_iova(qs: &QueueState, index: u32) -> u64 {
    let mask = qs.ring_size.saturating_sub(1);
    qs.ring_base
        .wrapping_add(u64::from(index & mask) * COMMAND_SIZE as u64)
}
