//! The serializable device state.

use serde::{Deserialize, Serialize};
use switchyard_device::config::ConfigSpace;
use switchyard_device::msix::MsixState;

use crate::identity::VramRef;
use crate::regs;
use crate::{IrqMode, SoftGpuConfig};

/// Version of the [`SoftGpuState`] format.
pub const STATE_FORMAT: u32 = 1;

/// Where states saved before [`MsixState::direct`] existed keep that flag.
const LEGACY_MSIX_TABLE_DIRECT: &str = "msix_table_direct";

/// Why a saved state was refused.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The blob is not a valid encoding.
    #[error("Cannot decode the softgpu state")]
    Decode(#[source] serde_json::Error),
    /// The blob is of another format version.
    #[error("Softgpu state format {0} is not supported (expected {STATE_FORMAT})")]
    Format(u32),
    /// The state was saved by a device with another interrupt mode.
    #[error("State was saved in interrupt mode `{saved}`, this device uses `{ours}`")]
    IrqModeMismatch {
        /// Mode in the state.
        saved: IrqMode,
        /// Mode of this device.
        ours: IrqMode,
    },
    /// The state was saved by a device with another configuration.
    #[error(
        "State was saved with {saved_queues} queues and {saved_vram} bytes of VRAM, this device has {queues} and {vram}"
    )]
    ConfigMismatch {
        /// Queues in the state.
        saved_queues: u32,
        /// VRAM size in the state.
        saved_vram: u64,
        /// Queues of this device.
        queues: u32,
        /// VRAM size of this device.
        vram: u64,
    },
    /// Some part of the state contradicts another or the device.
    #[error("Inconsistent softgpu state: {0}")]
    Inconsistent(&'static str),
    /// Queue `index` has an invalid ring while enabled.
    #[error("Queue {0} is enabled with an invalid ring")]
    BadRing(usize),
}

/// Per-queue registers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueState {
    /// Ring base IOVA.
    pub ring_base: u64,
    /// Ring size in entries.
    pub ring_size: u32,
    /// Free-running head index.
    pub head: u32,
    /// Free-running tail index.
    pub tail: u32,
    /// Queue enabled.
    pub enabled: bool,
    /// `ERR_*` code; non-zero means the queue is in the error state.
    pub error_code: u32,
    /// Index of the faulting command.
    pub error_index: u32,
    /// Faulting address.
    pub error_addr: u64,
    /// Opcode of the faulting command.
    pub error_opcode: u32,
    /// MSI-X vector for completions (stored but unused in [`IrqMode::Msi`]).
    pub completion_vector: u32,
    /// MSI-X vector for errors (stored but unused in [`IrqMode::Msi`]).
    pub error_vector: u32,
    /// Commands completed.
    pub completed: u64,
    /// Mapped doorbell (`Q_CONTROL.MAPPED`): the tail comes from the doorbell page.
    #[serde(default)]
    pub mapped: bool,
}

impl QueueState {
    /// Power-on state of queue `q`.
    pub fn power_on(q: u32) -> Self {
        Self {
            completion_vector: q,
            error_vector: 8 + q,
            ..Self::default()
        }
    }

    /// Whether the ring configuration can be enabled.
    pub fn ring_valid(&self) -> bool {
        let size = self.ring_size;
        size.is_power_of_two()
            && size <= regs::MAX_RING_ENTRIES_VALUE
            && self.ring_base.is_multiple_of(regs::RING_ALIGN)
            && self
                .ring_base
                .checked_add(u64::from(size) * crate::cmd::COMMAND_SIZE as u64)
                .is_some()
    }

    /// Number of submitted, not yet executed commands.
    pub fn pending(&self) -> u32 {
        self.tail.wrapping_sub(self.head)
    }
}

/// Everything that makes up a running SoftGpu except VRAM contents, which stay in the VRAM
/// memfd and are referenced by identity ([`VramRef`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SoftGpuState {
    /// [`STATE_FORMAT`].
    pub format: u32,
    /// Configuration of the device that saved it.
    pub config: SoftGpuConfig,
    /// The VRAM backing by reference.
    pub vram: VramRef,
    /// `SCRATCH`.
    pub scratch: u32,
    /// `INT_STATUS`.
    pub int_status: u32,
    /// `INT_MASK`.
    pub int_mask: u32,
    /// Global fence counter.
    pub fence_count: u64,
    /// Per-queue registers.
    pub queues: Vec<QueueState>,
    /// MSI-X table and PBA (no vectors in [`IrqMode::Msi`]), including whether the client
    /// accesses the table through BAR4 ([`MsixState::direct`]).
    pub msix: MsixState,
    /// PCI configuration space.
    pub config_space: ConfigSpace,
    /// The doorbell page the mapped queues' tails were taken from (its backing's identity):
    /// a device loading this state on another page writes the tails into it; on the same page
    /// (a swap, a restart) the page is newer than the state and is kept.
    #[serde(default)]
    pub doorbells: Option<VramRef>,
}

impl SoftGpuState {
    /// The power-on state of a device.
    pub(crate) fn power_on(config: SoftGpuConfig, vram: VramRef, cs: &ConfigSpace) -> Self {
        Self {
            format: STATE_FORMAT,
            config,
            vram,
            scratch: 0,
            int_status: 0,
            int_mask: 0,
            fence_count: 0,
            queues: (0..config.queues).map(QueueState::power_on).collect(),
            msix: MsixState::new(config.irq.msix_vectors() as u16),
            config_space: cs.clone(),
            doorbells: None,
        }
    }

    /// Encodes the state (JSON).
    pub fn to_bytes(&self) -> Result<Vec<u8>, StateError> {
        serde_json::to_vec(self).map_err(StateError::Decode)
    }

    /// Decodes a state produced by [`SoftGpuState::to_bytes`] (not yet validated).
    ///
    /// States saved before [`MsixState::direct`] existed keep that flag in a top-level
    /// `msix_table_direct` field; it is carried into `msix`.
    pub fn from_bytes(b: &[u8]) -> Result<Self, StateError> {
        let mut v: serde_json::Value = serde_json::from_slice(b).map_err(StateError::Decode)?;
        let legacy_direct = v
            .as_object_mut()
            .and_then(|o| o.remove(LEGACY_MSIX_TABLE_DIRECT))
            .map(serde_json::from_value::<bool>)
            .transpose()
            .map_err(StateError::Decode)?;
        let mut st: Self = serde_json::from_value(v).map_err(StateError::Decode)?;
        if legacy_direct == Some(true) {
            st.msix.set_direct(true);
        }
        Ok(st)
    }

    /// Checks that the state fits a device with `config` and VRAM of `vram_size` bytes.
    pub(crate) fn validate(
        &self,
        config: SoftGpuConfig,
        vram_size: u64,
        def: &ConfigSpace,
    ) -> Result<(), StateError> {
        if self.format != STATE_FORMAT {
            return Err(StateError::Format(self.format));
        }
        if self.config.irq != config.irq {
            return Err(StateError::IrqModeMismatch {
                saved: self.config.irq,
                ours: config.irq,
            });
        }
        if !self.config.same_device(&config) || self.vram.size != vram_size {
            return Err(StateError::ConfigMismatch {
                saved_queues: self.config.queues,
                saved_vram: self.vram.size,
                queues: config.queues,
                vram: vram_size,
            });
        }
        if self.queues.len() != config.queues as usize {
            return Err(StateError::Inconsistent(
                "number of queue states does not match",
            ));
        }
        if self.msix.vectors() != config.irq.msix_vectors() as usize {
            return Err(StateError::Inconsistent(
                "MSI-X vector count does not match",
            ));
        }
        if config.irq == IrqMode::Msi && self.msix.direct() {
            return Err(StateError::Inconsistent(
                "MSI-X table accessed by a device without MSI-X",
            ));
        }
        let cs = &self.config_space;
        // The layout fields must be ours before any register of the saved bytes is read.
        if cs.msix_offset() != def.msix_offset()
            || cs.msi_offset() != def.msi_offset()
            || cs.pcie_offset() != def.pcie_offset()
            || (0..6).any(|i| cs.bar(i) != def.bar(i))
        {
            return Err(StateError::Inconsistent(
                "config space layout does not match",
            ));
        }
        if cs.u16(0) != regs::PCI_VENDOR_ID || cs.u16(2) != regs::PCI_DEVICE_ID {
            return Err(StateError::Inconsistent("config space is not a softgpu's"));
        }
        for (i, q) in self.queues.iter().enumerate() {
            if q.enabled && (!q.ring_valid() || q.pending() > q.ring_size) {
                return Err(StateError::BadRing(i));
            }
        }
        Ok(())
    }
}
