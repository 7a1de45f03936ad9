//! Execution backends other than the engine threads' own CPU code: an [`Accelerator`] (a
//! board's GPU, `switchyard-cuda`) runs the data paths of COPY, FILL, SAXPY, GEMM and REDUCE
//! for a device, which keeps everything else: the registers, the rings, validation, FENCE,
//! interrupts, the mirror and VRAM's memfd.
//!
//! The contract, which moves, restarts, migration and failover rely on:
//!
//! - **VRAM's memfd is authoritative, always.** An accelerator may keep a working copy (GPU
//!   memory), but a command that writes VRAM has written the memfd too before
//!   [`AccelDevice::run`] returns (write-through), and every write to the memfd that does not
//!   come from the accelerator (trapped BAR2 writes, zeroing, a migration's restore, the CPU
//!   path) is announced with [`AccelDevice::host_wrote`] before the next command. A device
//!   attached afresh (a replacement process, a failover, a move's successor) starts with
//!   nothing cached.
//! - **Commands arrive validated**: operands in range, DMA windows mapped with the
//!   permission each needs, limits checked. The accelerator may still decline one
//!   ([`AccelOutcome::Declined`]: a window it cannot reach, memory it cannot get): the CPU
//!   path runs it then, with the same result.
//! - **A lost board is sticky**: once [`AccelOutcome::Lost`] was returned, every later
//!   command gets it too. The device then reports its board failed (state intact: the memfd
//!   and the mirror hold everything completed) and either stops its engines for a failover
//!   or, when nobody handles the failure, fails every command with `ERR_DEVICE_LOST`.

use std::fs::File;
use std::sync::Arc;

use switchyard_device::{DmaObserver, DmaSpace};

use crate::cmd::Command;

/// An execution backend for softgpu devices (one per board).
pub trait Accelerator: Send + Sync + std::fmt::Debug {
    /// What runs the commands, for logs and status ("cuda GPU-8f…, NVIDIA H200").
    fn describe(&self) -> String;

    /// Opens the accelerator for one device: its VRAM (`size` bytes of `vram`'s memfd), its
    /// queue count, and the client's DMA space.
    fn open(&self, device: AccelTarget) -> Result<Arc<dyn AccelDevice>, AccelError>;
}

/// What an accelerator is opened for ([`Accelerator::open`]).
#[derive(Debug, Clone)]
pub struct AccelTarget {
    /// VRAM's memfd (authoritative; the accelerator maps it itself).
    pub vram: Arc<File>,
    /// VRAM's size.
    pub vram_size: u64,
    /// Command queues.
    pub queues: usize,
    /// The client's DMA windows.
    pub dma: Arc<DmaSpace>,
}

/// One device's use of an accelerator.
pub trait AccelDevice: Send + Sync + std::fmt::Debug {
    /// Runs command `c` of queue `queue` (validated; see the module documentation) to the
    /// end: when it returns, its results are in guest memory and VRAM's memfd.
    fn run(&self, queue: usize, c: &Command) -> AccelOutcome;

    /// `[offset, offset+len)` of VRAM's memfd was written by someone else than the
    /// accelerator: a copy it keeps of those bytes is stale.
    fn host_wrote(&self, offset: u64, len: u64);

    /// Learns of the client's DMA maps and unmaps (installed by the server when the device
    /// takes its slot), e.g. to register guest memory with a GPU.
    fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>>;

    /// The implementation, for its own statistics ([`crate::SoftGpu::accelerator`]).
    fn as_any(&self) -> &dyn std::any::Any;
}

/// How a command went on an accelerator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccelOutcome {
    /// Done; results written.
    Done,
    /// Not run, nothing written: the CPU path runs it.
    Declined,
    /// The command faulted: `ERR_*` code and address (nothing the CPU path would not fault).
    Fault {
        /// `ERR_*`.
        code: u32,
        /// Faulting address.
        addr: u64,
    },
    /// The board is lost (a sticky error: the GPU faulted or fell off the bus); why, in
    /// words for operators. What the command wrote is undefined; it did not complete.
    Lost(String),
}

/// Why an accelerator could not be opened for a device.
#[derive(Debug, thiserror::Error)]
#[error("Cannot open {what} for the device: {message}")]
pub struct AccelError {
    /// The accelerator ([`Accelerator::describe`]).
    pub what: String,
    /// Why, in a sentence.
    pub message: String,
}

impl crate::SoftGpu {
    /// Runs the device's commands on `accel` from now on (a board's GPU): opens it for this
    /// device and tells it of VRAM writes it does not make. Set before the device is handed
    /// to its server (the server installs the accelerator's DMA observer with the device);
    /// a command that ran before on the CPU path needs nothing from the accelerator.
    pub fn set_accelerator(&self, accel: &dyn Accelerator) -> Result<(), AccelError> {
        let shared = &self.shared;
        let device = accel.open(AccelTarget {
            vram: shared.vram.file().clone(),
            vram_size: shared.vram.size(),
            queues: shared.config.queues as usize,
            dma: shared.dma.clone(),
        })?;
        shared.vram.watch(&device);
        shared.accel.set(device).map_err(|_| AccelError {
            what: accel.describe(),
            message: "the device has an accelerator already".into(),
        })?;
        tracing::info!(accelerator = %accel.describe(), "commands run on the accelerator");
        Ok(())
    }

    /// [`crate::SoftGpu::set_accelerator`], for building.
    pub fn with_accelerator(self, accel: &dyn Accelerator) -> Result<Self, AccelError> {
        self.set_accelerator(accel)?;
        Ok(self)
    }

    /// The device's accelerator, if its commands run on one.
    pub fn accelerator(&self) -> Option<&Arc<dyn AccelDevice>> {
        self.shared.accel.get()
    }
}
