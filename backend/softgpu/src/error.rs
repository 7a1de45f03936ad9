//! The errors of creating a device.

use switchyard_device::blackbox::BlackBoxError;

use crate::{ConfigError, StateError, VramRef};

#[cfg(doc)]
use crate::SoftGpu;

/// Errors creating a [`SoftGpu`].
#[derive(Debug, thiserror::Error)]
pub enum SoftGpuError {
    /// The configuration is invalid.
    #[error("Invalid softgpu configuration")]
    Config(#[from] ConfigError),
    /// The VRAM memfd could not be created or inspected.
    #[error("Cannot create the VRAM backing")]
    Vram(#[source] std::io::Error),
    /// The VRAM could not be mapped.
    #[error("Cannot map the VRAM")]
    VramMap(#[source] vm_memory::mmap::MmapRegionError),
    /// An adopted VRAM file has the wrong size.
    #[error("VRAM backing file has {actual} bytes, expected {expected}")]
    VramSize {
        /// Configured size.
        expected: u64,
        /// Size of the file.
        actual: u64,
    },
    /// The interrupt table lent by the server has too few vectors.
    #[error("Interrupt index {index} has {got} vectors, the softgpu needs {needed}")]
    IrqCount {
        /// VFIO IRQ index.
        index: u32,
        /// Vectors needed.
        needed: u32,
        /// Vectors available.
        got: u32,
    },
    /// An engine thread could not be started.
    #[error("Cannot start an engine thread")]
    Thread(#[source] std::io::Error),
    /// A state could not be carried over to a successor, or the state in a black box is
    /// not one this device can resume (e.g. another configuration's).
    #[error("Cannot carry the device state over")]
    State(#[from] StateError),
    /// The black box cannot be used (records missing or too small, unreadable records).
    #[error("Cannot use the black box")]
    BlackBox(#[source] BlackBoxError),
    /// A new device was given a black box that holds a state already.
    #[error("The black box already holds a softgpu state; recover the device from it instead")]
    BlackBoxInUse,
    /// [`SoftGpu::recover`] was given a black box nothing was published into.
    #[error("The black box holds no softgpu state to recover")]
    NothingToRecover,
    /// A VRAM memfd handed over is not sealed against shrinking and growing (the device maps
    /// it; a shrink would make its accesses fault).
    #[error("The VRAM memfd is not sealed against shrinking and growing")]
    VramNotSealed(#[source] std::io::Error),
    /// The VRAM failed (an injected `vram` fault): its contents cannot be read or written.
    #[error("The VRAM failed")]
    VramFailed(#[source] std::io::Error),
    /// The doorbell page's backing could not be created, checked or mapped.
    #[error("Cannot use the doorbell page's backing")]
    Doorbells(#[source] std::io::Error),
    /// The VRAM memfd handed to [`SoftGpu::recover`] is not the one the black box's device
    /// used.
    #[error("The VRAM memfd ({got:?}) is not the one the black box's device used ({saved:?})")]
    VramMismatch {
        /// VRAM named by the black box.
        saved: VramRef,
        /// VRAM handed over.
        got: VramRef,
    },
}
