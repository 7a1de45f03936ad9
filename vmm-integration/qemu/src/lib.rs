//! Driving QEMU for vfio-user guest tests.
//!
//! * [`QemuCommand`]: a typed builder for the QEMU command line the project's
//!   guest harness uses (TCG, q35 with shared memfd RAM, PVH kernel, optional
//!   VT-d, PCIe root ports for hot-plug, `vfio-user-pci` devices in JSON form,
//!   QMP on a unix socket); `guest-tests/harness` is its user.
//! * [`Qmp`]: a small synchronous QMP client (std I/O with timeouts) with
//!   helpers for hot-plugging and unplugging `vfio-user-pci` devices and for
//!   inspecting the guest's PCI topology.
//!
//! Nothing here starts or supervises processes beyond building a
//! [`std::process::Command`]; the caller owns the child.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod command;
mod error;
mod qmp;

pub use command::{
    Accel, GUEST_BOOT_ARGS, MEMORY_BACKEND_ID, QemuCommand, SERIAL_CHARDEV_ID, Serial,
    VfioUserDevice, root_port_id,
};
pub use error::{QemuError, Result};
pub use qmp::{
    MAX_MESSAGE_LEN, PciBridgeBus, PciBridgeInfo, PciBusInfo, PciClassInfo, PciDeviceInfo, PciIds,
    PciRegionInfo, QemuVersionNumber, Qmp, QmpEvent, QmpGreeting, QmpTimestamp, QmpVersion,
    StatusInfo, all_pci_devices,
};
