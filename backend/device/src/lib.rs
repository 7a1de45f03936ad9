//! Device-side building blocks of Switchyard.
//!
//! A device model implements [`PciDevice`]: it describes its regions and interrupts once
//! ([`DeviceDescription`]) and then serves region accesses and resets; what else it can do it
//! offers as optional capability groups ([`Migratable`], [`Swappable`] with [`Quiesce`],
//! [`DmaObserver`], [`DirtySource`], [`IrqRouter`]), so the server holds any device as a
//! `Box<dyn PciDevice>` and asks for what it needs. A device never touches sockets. Everything a device uses to reach the outside world — the client's DMA
//! windows ([`dma::DmaSpace`]) and interrupt eventfds ([`irq::Interrupts`]) — is owned by the
//! server and lent to the device through a [`DeviceContext`], so the server can later re-point
//! both at another backing device without the client noticing.
//!
//! Helpers for models: [`config::ConfigSpace`] (type 0 header, BAR sizing, capability chain),
//! [`msix::MsixState`] (table + PBA).

#![warn(missing_docs)]
#![forbid(unsafe_code)]
// Every dependency is used (the test build also sees the dev-dependencies, hence not there).
#![cfg_attr(not(test), deny(unused_crate_dependencies))]

pub mod blackbox;
pub mod config;
pub mod dirty;
pub mod dma;
pub mod irq;
pub mod kind;
pub mod msix;
pub mod ratelimit;
pub mod secret;
pub mod size;
mod traits;

use std::fs::File;
use std::sync::Arc;

pub use dma::{DmaError, DmaSpace, RemoteDma, WindowBacking};
pub use irq::{Interrupts, IrqError, IrqIndex};
pub use size::{SizeError, parse_size};
pub use traits::{
    AsAny, DirtySource, DmaObserver, FaultInjection, IrqRouter, Migratable, PciDevice, Quiesce,
    QuiesceGuard, Recoverable, Relocatable, Relocation, RelocationStats, SuccessorFactory,
    Swappable, Telemetry, WorkCounters,
};

/// VFIO region index of the PCI configuration space.
pub const CONFIG_REGION_INDEX: u32 = 7;
/// Number of standard VFIO PCI regions (BAR0–5, ROM, config, VGA).
pub const NUM_PCI_REGIONS: u32 = 9;

/// Errors a device model reports. Each maps to an errno for the wire.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// The region index does not exist or is empty.
    #[error("Region {0} does not exist")]
    NoSuchRegion(u32),
    /// The access falls outside the region.
    #[error("Access of {len} bytes at {offset:#x} is outside region {region}")]
    OutOfRange {
        /// Region index.
        region: u32,
        /// Offset of the access.
        offset: u64,
        /// Length of the access.
        len: usize,
    },
    /// The region does not support this kind of access (e.g. a width it cannot do).
    #[error("Region {region} does not support a {len}-byte access at {offset:#x}")]
    BadAccess {
        /// Region index.
        region: u32,
        /// Offset of the access.
        offset: u64,
        /// Length of the access.
        len: usize,
    },
    /// The operation is not supported by this device.
    #[error("Operation not supported by this device")]
    Unsupported,
    /// Saved device state could not be decoded or does not fit this device.
    #[error("Invalid device state")]
    BadState(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A DMA access failed.
    #[error("DMA access failed")]
    Dma(#[from] DmaError),
    /// An interrupt operation failed.
    #[error("Interrupt operation failed")]
    Irq(#[from] IrqError),
    /// The device model failed (building a successor, handing its state over, ...).
    #[error("The device model failed")]
    Failed(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// An I/O error (creating backing memory, threads, ...).
    #[error("Device I/O failed")]
    Io(#[from] std::io::Error),
}

impl DeviceError {
    /// The errno that represents this error on the wire.
    pub fn errno(&self) -> i32 {
        match self {
            DeviceError::NoSuchRegion(_)
            | DeviceError::OutOfRange { .. }
            | DeviceError::BadAccess { .. }
            | DeviceError::BadState(_) => libc::EINVAL,
            DeviceError::Unsupported => libc::ENOTSUP,
            DeviceError::Dma(e) => e.errno(),
            DeviceError::Irq(e) => e.errno(),
            DeviceError::Io(e) => e.raw_os_error().unwrap_or(libc::EIO),
            DeviceError::Failed(_) => libc::EIO,
        }
    }
}

/// Result type of device operations.
pub type Result<T> = std::result::Result<T, DeviceError>;

/// Access permissions of a DMA window (defined here, not in [`dma`], because the
/// [`DmaObserver`] capability names it too; also at `dma::DmaProt`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaProt {
    /// The device may read the window.
    pub read: bool,
    /// The device may write the window.
    pub write: bool,
}

impl DmaProt {
    /// Read and write.
    pub const READ_WRITE: DmaProt = DmaProt {
        read: true,
        write: true,
    };
    /// Read only.
    pub const READ_ONLY: DmaProt = DmaProt {
        read: true,
        write: false,
    };
}

/// A sparse mmappable area of a region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SparseArea {
    /// Offset within the region.
    pub offset: u64,
    /// Size of the area.
    pub size: u64,
}

/// How (part of) a region can be mmapped by the client.
#[derive(Debug, Clone)]
pub struct RegionMmap {
    /// The file backing the region; sent to the client with the region info.
    pub file: Arc<File>,
    /// Offset of the region's start in `file`.
    pub file_offset: u64,
    /// Mappable areas; if empty the whole region is mappable.
    pub areas: Vec<SparseArea>,
}

/// One VFIO region as offered to the client.
#[derive(Debug, Clone)]
pub struct RegionDesc {
    /// Size in bytes (0 = region not implemented).
    pub size: u64,
    /// Readable through `REGION_READ`.
    pub read: bool,
    /// Writable through `REGION_WRITE`.
    pub write: bool,
    /// Mmap information, if the client may map it.
    pub mmap: Option<RegionMmap>,
}

impl RegionDesc {
    /// A region that does not exist.
    pub fn absent() -> Self {
        Self {
            size: 0,
            read: false,
            write: false,
            mmap: None,
        }
    }

    /// A trapped read/write region.
    pub fn trapped(size: u64) -> Self {
        Self {
            size,
            read: true,
            write: true,
            mmap: None,
        }
    }
}

/// One interrupt index as offered to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IrqDesc {
    /// Number of vectors.
    pub count: u32,
    /// Supports eventfd signalling.
    pub eventfd: bool,
    /// Supports MASK/UNMASK.
    pub maskable: bool,
    /// Automatically masked after triggering (INTx).
    pub automasked: bool,
    /// Vector count cannot be resized (MSI-X: false).
    pub noresize: bool,
}

/// The static description of a device.
#[derive(Debug, Clone)]
pub struct DeviceDescription {
    /// Short model name for logs.
    pub name: &'static str,
    /// Regions, indexed by VFIO region index; at least [`NUM_PCI_REGIONS`] entries.
    pub regions: Vec<RegionDesc>,
    /// Interrupt indexes, indexed by VFIO IRQ index.
    pub irqs: Vec<IrqDesc>,
    /// The device supports `DEVICE_RESET`.
    pub resettable: bool,
}

impl DeviceDescription {
    /// The vector counts per index, for [`Interrupts::new`].
    pub fn irq_counts(&self) -> Vec<u32> {
        self.irqs.iter().map(|i| i.count).collect()
    }
}

/// What the server lends a device: the client's DMA windows and interrupt routing, and the
/// memory objects the client maps.
#[derive(Debug, Clone)]
pub struct DeviceContext {
    /// The client's DMA windows.
    pub dma: Arc<DmaSpace>,
    /// The client's interrupt eventfds.
    pub irqs: Arc<Interrupts>,
    /// Cuts short the device's waits on the client (see [`RemoteWaits`]).
    pub waits: Arc<WaitControl>,
    /// Memory the client maps (a BAR's backing): it belongs to the slot, so a device that
    /// replaces another is lent the same objects (see [`MemoryObjects`]).
    pub memory: Arc<MemoryObjects>,
}

/// The memory objects of a device slot, by name: what the client maps (softgpu VRAM today, a
/// BAR's backing later) cannot be re-pointed under it (no protocol message revokes a mapping),
/// so it lives with the slot, next to the DMA space and the interrupts, and every device in
/// the slot is lent it. Names are namespaced by device kind (`"softgpu.vram"`).
#[derive(Default)]
pub struct MemoryObjects {
    objects: std::sync::Mutex<Vec<(&'static str, Arc<dyn std::any::Any + Send + Sync>)>>,
}

impl std::fmt::Debug for MemoryObjects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let objects = self.objects.lock().unwrap_or_else(|p| p.into_inner());
        let names: Vec<&str> = objects.iter().map(|(n, _)| *n).collect();
        f.debug_struct("MemoryObjects")
            .field("objects", &names)
            .finish()
    }
}

impl MemoryObjects {
    /// The object called `name`, if there is one of type `T`.
    pub fn get<T: std::any::Any + Send + Sync>(&self, name: &str) -> Option<Arc<T>> {
        let objects = self.objects.lock().unwrap_or_else(|p| p.into_inner());
        let (_, object) = objects.iter().find(|(n, _)| *n == name)?;
        Arc::clone(object).downcast::<T>().ok()
    }

    /// Puts `object` under `name`, replacing what was there.
    pub fn insert<T: std::any::Any + Send + Sync>(&self, name: &'static str, object: Arc<T>) {
        let mut objects = self.objects.lock().unwrap_or_else(|p| p.into_inner());
        objects.retain(|(n, _)| *n != name);
        objects.push((name, object));
    }

    /// The object called `name` (of type `T`), made by `make` if there is none yet. An object
    /// of another type under that name is replaced.
    pub fn get_or_try_insert<T, E>(
        &self,
        name: &'static str,
        make: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<Arc<T>, E>
    where
        T: std::any::Any + Send + Sync,
    {
        let mut objects = self.objects.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, object)) = objects.iter().find(|(n, _)| *n == name)
            && let Ok(t) = Arc::clone(object).downcast::<T>()
        {
            return Ok(t);
        }
        let t = Arc::new(make()?);
        objects.retain(|(n, _)| *n != name);
        objects.push((name, t.clone()));
        Ok(t)
    }
}

/// Server→client waits that a device can cut short.
///
/// DMA to windows mapped without a file descriptor goes through the client ([`RemoteDma`]):
/// an engine sends a request and waits for the reply, which the server's connection thread
/// reads and routes. That thread is also the one that calls the device (resets, migration
/// arcs); a device that waits there for its engines would wait for a reply only the waiting
/// thread can route. So a device holds the server's waits ([`WaitControl::hold`]) while it waits
/// for its engines: every server→client DMA in flight then fails with `ECANCELED`, and new
/// ones fail right away until the hold is released.
pub trait RemoteWaits: Send + Sync {
    /// Fails the waits in flight with `ECANCELED` and refuses new ones until as many
    /// [`RemoteWaits::release`] calls.
    fn hold(&self);
    /// Undoes one [`RemoteWaits::hold`].
    fn release(&self);
}

/// Where a device finds the server's [`RemoteWaits`] (none while no client is connected).
#[derive(Default)]
pub struct WaitControl {
    target: std::sync::RwLock<Option<Arc<dyn RemoteWaits>>>,
}

impl std::fmt::Debug for WaitControl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitControl").finish_non_exhaustive()
    }
}

impl WaitControl {
    /// Installs (or with `None` removes) the waits a hold applies to.
    pub fn set(&self, target: Option<Arc<dyn RemoteWaits>>) {
        *self.target.write().unwrap_or_else(|p| p.into_inner()) = target;
    }

    /// Holds the current waits until the guard is dropped.
    pub fn hold(&self) -> WaitHold {
        let target = self
            .target
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if let Some(t) = &target {
            t.hold();
        }
        WaitHold { target }
    }
}

/// A [`WaitControl::hold`]; released (on the waits it held) when dropped.
#[must_use = "the hold ends when the guard is dropped"]
pub struct WaitHold {
    target: Option<Arc<dyn RemoteWaits>>,
}

impl std::fmt::Debug for WaitHold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitHold").finish_non_exhaustive()
    }
}

impl Drop for WaitHold {
    fn drop(&mut self) {
        if let Some(t) = &self.target {
            t.release();
        }
    }
}

/// What a migratable device supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigrationCaps {
    /// The device offers PRE_COPY (an iterative phase while it keeps running).
    pub precopy: bool,
    /// The device offers the P2P quiescent states (RUNNING_P2P, and PRE_COPY_P2P with
    /// `precopy`): it can stop starting work that writes memory or interrupts while it
    /// still serves its registers (`VFIO_MIGRATION_P2P`, which QEMU requires of every
    /// device of a VM with more than one).
    pub p2p: bool,
}

/// What an outgoing PRE_COPY stream still holds (`struct vfio_precopy_info`): bytes a
/// MIG_DATA_READ would return now, split as the kernel splits them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrecopyInfo {
    /// Bytes of the first pass over the device's data not read yet.
    pub initial_bytes: u64,
    /// Bytes changed since they were read (known exactly, or the device's estimate).
    pub dirty_bytes: u64,
}

/// A direct arc of the VFIO migration v2 state machine (`linux/vfio.h`), as the device sees
/// it. The P2P arcs are taken only by a device whose caps say `p2p`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigArc {
    /// RUNNING → STOP: stop changing device state and touching guest memory.
    Stop,
    /// STOP → RUNNING.
    Run,
    /// RUNNING → PRE_COPY: start the outgoing stream while the device keeps running.
    StartPreCopy,
    /// PRE_COPY → RUNNING: abandon the outgoing stream.
    AbortPreCopy,
    /// PRE_COPY → STOP_COPY: stop, then complete the stream begun in PRE_COPY.
    PreCopyToStopCopy,
    /// STOP → STOP_COPY: start the complete outgoing stream of a stopped device.
    StartStopCopy,
    /// STOP_COPY → STOP: the stream is over (read or not).
    EndStopCopy,
    /// STOP → RESUMING: accept an incoming stream; the current state will be replaced.
    StartResuming,
    /// RESUMING → STOP: the stream is complete; validate and load it.
    EndResuming,
    /// RUNNING → RUNNING_P2P, PRE_COPY → PRE_COPY_P2P: quiesce: no new work that writes
    /// memory or signals interrupts starts, work in flight is finished; registers are still
    /// served (an outgoing stream goes on).
    EnterP2p,
    /// RUNNING_P2P → RUNNING, PRE_COPY_P2P → PRE_COPY: the quiesced work runs again.
    LeaveP2p,
    /// RUNNING_P2P → STOP: from quiesced to stopped.
    StopFromP2p,
    /// STOP → RUNNING_P2P: registers served again, work still quiesced.
    P2pFromStop,
    /// RUNNING_P2P → PRE_COPY_P2P: start the outgoing stream of a quiesced device.
    StartPreCopyP2p,
    /// PRE_COPY_P2P → RUNNING_P2P: abandon the outgoing stream, still quiesced.
    AbortPreCopyP2p,
    /// PRE_COPY_P2P → STOP_COPY: stop, then complete the stream begun in PRE_COPY.
    PreCopyP2pToStopCopy,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_objects_are_found_by_name_and_type() {
        let m = MemoryObjects::default();
        let made = m
            .get_or_try_insert("a.vram", || Ok::<_, ()>(7u64))
            .expect("made");
        let again = m
            .get_or_try_insert("a.vram", || Err::<u64, ()>(()))
            .expect("found, not made again");
        assert!(Arc::ptr_eq(&made, &again));
        assert_eq!(m.get::<u64>("a.vram").as_deref(), Some(&7));
        assert!(
            m.get::<u32>("a.vram").is_none(),
            "another type is not that object"
        );
        assert!(m.get::<u64>("b.vram").is_none());
        assert_eq!(
            m.get_or_try_insert("b.vram", || Err::<u64, &str>("no memory")),
            Err("no memory"),
            "a failed make inserts nothing"
        );
        assert!(m.get::<u64>("b.vram").is_none());
        m.insert("a.vram", Arc::new(9u64));
        assert_eq!(m.get::<u64>("a.vram").as_deref(), Some(&9));
    }
}
