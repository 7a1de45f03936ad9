//! A physical PCI device bound to Linux `vfio-pci`, served over vfio-user.
//!
//! [`VfioPci::open`] takes a PCI address (`0000:00:03.0`), checks the device and its IOMMU
//! group in sysfs ([`sysfs`]: bound to `vfio-pci`, every other device of the group bound to
//! `vfio-pci`, `pci-stub`, `pcieport` or to no driver), opens a type1v2 container and the group (`vfio-ioctls`), and
//! reads the device's regions and interrupts. Then it serves the device through the core's
//! traits:
//!
//! | what | how |
//! |---|---|
//! | config space | a shadow ([`config::VirtConfig`]): BAR sizing and addresses, ROM hidden, capabilities filtered, MSI/MSI-X emulated; COMMAND's memory/bus-master bits reach the device |
//! | BARs | trapped by default: `pread`/`pwrite` on the VFIO device descriptor at the region's offset. With [`BarMode::Mmap`] the mmappable BARs are offered as sparse mmap areas of the device descriptor itself (the client maps the device's MMIO directly), except the MSI-X table's pages, which stay trapped |
//! | MSI-X table and PBA | emulated (the kernel refuses accesses to the real table): per-vector and function masks are enforced by parking a masked vector's kernel eventfd on one of ours and replaying it on unmask |
//! | interrupts | [`IrqRouter`](switchyard_device::IrqRouter): the client's eventfds from `SET_IRQS` go straight to `VFIO_DEVICE_SET_IRQS`; interrupts never pass through the server (unless [`IrqDelivery::Relay`], for comparison). MSI and MSI-X only; INTx is reported absent |
//! | DMA | [`DmaObserver`](switchyard_device::DmaObserver): every `DMA_MAP` with a descriptor is mapped (our own shared mapping of the client's file) into the device's IOMMU at IOVA = the client's DMA address (read-only windows read-only), and unmapped on `DMA_UNMAP`, unmap-all and client exit, before the memory is released ([`switchyard_sys::DmaMapping`]). A map without a descriptor cannot reach the device and is refused (`ENOTSUP`) |
//! | dirty pages | [`DirtySource`](switchyard_device::DirtySource): the device has no dirty tracking, so every mapped page is reported dirty (the conservative rule) |
//! | reset | `VFIO_DEVICE_RESET` when the device supports it, then the client's COMMAND bits are written again |
//! | migration | [`Migratable`](switchyard_device::Migratable), VFIO migration v2 by *quiesce + reset + replay* (STOP_COPY only, no PRE_COPY): STOP clears bus mastering on the hardware; the stream carries the client's config-space bits and MSI-X table, which the destination replays onto its reset device. What lives inside the hardware is not carried: the guest's driver finds the device reset inside |
//! | continuity | the same configuration published into a black box record after every change and replayed by a replacement process onto the device it opens again (the kernel reset it): a pool worker that dies is replaced under the client |
//!
//! **Trapped or mapped BARs.** A trapped BAR costs a round trip per access but the device stays
//! behind the server, so it could in principle be swapped for another device (or a software
//! model) under the client. A mapped BAR is as fast as the hardware, but the client's mapping
//! points at this device's MMIO: it cannot move to another device without the guest's help
//! (an unplug and replug), and the server no longer sees the accesses.
//!
//! **Pinned memory.** Every page of a mapped DMA window is pinned by the IOMMU driver and
//! counts against the server's `RLIMIT_MEMLOCK` (unless it has `CAP_IPC_LOCK`): serving a VM
//! needs a limit of at least its RAM, or maps fail with `ENOMEM`.
//!
//! **Not done.** The iommufd/cdev interface (`/dev/vfio/devices/vfioN`; our guest kernel has no
//! `IOMMUFD`) is not tried; the kernel's own migration v2 and dirty tracking (for devices whose
//! variant driver has them) are not used; MSI per-vector mask bits are shadowed but not
//! enforced; no extended capability is offered; a passthrough device is not
//! [`Swappable`](switchyard_device::Swappable) (it cannot be swapped or moved under a client).

#![warn(missing_docs)]
#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(unused_crate_dependencies))]

pub mod config;
mod device;
mod dma;
pub mod inventory;
mod irq;
mod kind;
pub mod sysfs;

use std::path::PathBuf;

pub use device::VfioPci;
pub use dma::Iommu;
pub use kind::VfioKind;

/// How the BARs are offered to the client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BarMode {
    /// Every access is a `REGION_READ`/`REGION_WRITE` served with `pread`/`pwrite` on the
    /// device (the default).
    #[default]
    Trap,
    /// BARs the kernel lets us mmap are offered as sparse mmap areas of the VFIO device
    /// descriptor (the MSI-X table's pages excepted); the rest stays trapped.
    Mmap,
}

/// How the device's interrupts reach the client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IrqDelivery {
    /// The client's eventfds are handed to the kernel (`VFIO_DEVICE_SET_IRQS`): an interrupt
    /// never passes through the server (the default).
    #[default]
    Direct,
    /// The kernel signals the server's eventfds and a server thread signals the client's: one
    /// more thread wake-up per interrupt (for comparison; `irq=relay`).
    Relay,
}

/// What to open: `host=0000:00:03.0[,bars=trap|mmap][,irq=direct|relay]` (options parsed by
/// [`VfioKind::config`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VfioConfig {
    /// The PCI address (`DDDD:BB:DD.F`; `BB:DD.F` means domain 0).
    pub host: String,
    /// How BARs are offered.
    pub bars: BarMode,
    /// How interrupts reach the client.
    pub irq: IrqDelivery,
    /// Where sysfs is (`/sys`; a fake tree in tests).
    pub sysfs: PathBuf,
}

impl VfioConfig {
    /// A configuration for `host` with trapped BARs.
    pub fn new(host: impl Into<String>) -> VfioConfig {
        VfioConfig {
            host: host.into(),
            bars: BarMode::Trap,
            irq: IrqDelivery::Direct,
            sysfs: PathBuf::from("/sys"),
        }
    }
}

/// Errors of the passthrough backend.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not a PCI address.
    #[error("Not a PCI address: `{0}` (expected DDDD:BB:DD.F)")]
    BadAddress(String),
    /// No such device in sysfs.
    #[error("No PCI device {bdf} in {path}")]
    NoDevice {
        /// The address.
        bdf: String,
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The device has no IOMMU group (no IOMMU, or it is off).
    #[error(
        "PCI device {0} has no IOMMU group: enable the IOMMU (intel_iommu=on / amd_iommu=on); VFIO no-IOMMU mode is not supported"
    )]
    NoIommuGroup(String),
    /// The device is not bound to vfio-pci.
    #[error(
        "PCI device {bdf} is bound to {driver}, not vfio-pci (bind it: driver_override + drivers_probe, see `switchyard_vfio::sysfs::bind_vfio`)"
    )]
    NotVfio {
        /// The address.
        bdf: String,
        /// Its driver (`no driver` if none).
        driver: String,
    },
    /// Another device of the group is bound to a host driver.
    #[error(
        "IOMMU group {group} is not viable: {other} is bound to {driver} (every device of the group must be bound to vfio-pci, pci-stub, pcieport or to no driver)"
    )]
    GroupNotViable {
        /// The group.
        group: u32,
        /// The offending device.
        other: String,
        /// Its driver.
        driver: String,
    },
    /// A sysfs file could not be read or written.
    #[error("Cannot access {path}")]
    Sysfs {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// A sysfs value is not what it should be.
    #[error("Unexpected content in {path}: {content:?}")]
    SysfsValue {
        /// The file.
        path: PathBuf,
        /// What it held.
        content: String,
    },
    /// Opening the container, the group or the device failed.
    #[error("Cannot open VFIO device {bdf} (IOMMU group {group})")]
    Open {
        /// The address.
        bdf: String,
        /// The group.
        group: u32,
        /// What VFIO said.
        #[source]
        source: vfio_ioctls::VfioError,
    },
    /// The device's descriptor could not be duplicated.
    #[error("Cannot duplicate the VFIO device descriptor")]
    Dup(#[source] switchyard_sys::Error),
    /// The interrupt relay (`irq=relay`) could not be started.
    #[error("Cannot start the interrupt relay for {bdf}")]
    Relay {
        /// The address.
        bdf: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The device request (`REQ`) interrupt could not be wired to its watcher thread.
    #[error("Cannot watch for the kernel's device requests on {bdf}")]
    ReqWatch {
        /// The address.
        bdf: String,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The device has no usable config region.
    #[error("VFIO device {bdf} has no config space region")]
    NoConfig {
        /// The address.
        bdf: String,
    },
    /// The config space could not be shadowed.
    #[error("Cannot virtualize the config space of {bdf}")]
    Config {
        /// The address.
        bdf: String,
        /// Why.
        #[source]
        source: config::ConfigError,
    },
    /// Creating an eventfd for interrupt masking failed.
    #[error("Cannot create an eventfd")]
    Eventfd(#[source] std::io::Error),
    /// SR-IOV is not possible on this device.
    #[error("PCI device {0} has no SR-IOV capability (no sriov_totalvfs)")]
    NoSriov(String),
    /// More VFs asked for than the device has.
    #[error("PCI device {bdf} supports {total} VFs, {asked} asked for")]
    TooManyVfs {
        /// The PF.
        bdf: String,
        /// Its maximum.
        total: u32,
        /// What was asked.
        asked: u32,
    },
}
