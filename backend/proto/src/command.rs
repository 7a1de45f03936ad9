//! The vfio-user command numbers and who sends each command.
//!
//! A leaf module: it names no other module of the crate but `consts`, so the error type can
//! name a [`Command`] without depending on the header. Decoding a number into a command
//! (`TryFrom<u16>`, which fails with a `ProtoError`) lives with the header.

use crate::consts::*;

/// vfio-user command numbers (spec §1.2).
///
/// `DirtyPages` (14, legacy migration v1) is known but not supported: decoding it fails
/// with `ENOTSUP`. `GetPrecopyInfo` (19) is the in-flight QEMU work's, as the project's
/// QEMU patches send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum Command {
    /// `VFIO_USER_VERSION` (1).
    Version = VFIO_USER_VERSION,
    /// `VFIO_USER_DMA_MAP` (2).
    DmaMap = VFIO_USER_DMA_MAP,
    /// `VFIO_USER_DMA_UNMAP` (3).
    DmaUnmap = VFIO_USER_DMA_UNMAP,
    /// `VFIO_USER_DEVICE_GET_INFO` (4).
    DeviceGetInfo = VFIO_USER_DEVICE_GET_INFO,
    /// `VFIO_USER_DEVICE_GET_REGION_INFO` (5).
    DeviceGetRegionInfo = VFIO_USER_DEVICE_GET_REGION_INFO,
    /// `VFIO_USER_DEVICE_GET_REGION_IO_FDS` (6).
    DeviceGetRegionIoFds = VFIO_USER_DEVICE_GET_REGION_IO_FDS,
    /// `VFIO_USER_DEVICE_GET_IRQ_INFO` (7).
    DeviceGetIrqInfo = VFIO_USER_DEVICE_GET_IRQ_INFO,
    /// `VFIO_USER_DEVICE_SET_IRQS` (8).
    DeviceSetIrqs = VFIO_USER_DEVICE_SET_IRQS,
    /// `VFIO_USER_REGION_READ` (9).
    RegionRead = VFIO_USER_REGION_READ,
    /// `VFIO_USER_REGION_WRITE` (10).
    RegionWrite = VFIO_USER_REGION_WRITE,
    /// `VFIO_USER_DMA_READ` (11, server to client).
    DmaRead = VFIO_USER_DMA_READ,
    /// `VFIO_USER_DMA_WRITE` (12, server to client).
    DmaWrite = VFIO_USER_DMA_WRITE,
    /// `VFIO_USER_DEVICE_RESET` (13).
    DeviceReset = VFIO_USER_DEVICE_RESET,
    /// `VFIO_USER_DIRTY_PAGES` (14, legacy; unsupported).
    DirtyPages = VFIO_USER_DIRTY_PAGES,
    /// `VFIO_USER_REGION_WRITE_MULTI` (15).
    RegionWriteMulti = VFIO_USER_REGION_WRITE_MULTI,
    /// `VFIO_USER_DEVICE_FEATURE` (16).
    DeviceFeature = VFIO_USER_DEVICE_FEATURE,
    /// `VFIO_USER_MIG_DATA_READ` (17).
    MigDataRead = VFIO_USER_MIG_DATA_READ,
    /// `VFIO_USER_MIG_DATA_WRITE` (18).
    MigDataWrite = VFIO_USER_MIG_DATA_WRITE,
    /// `VFIO_USER_GET_PRECOPY_INFO` (19, in-flight QEMU work; `struct vfio_precopy_info`).
    GetPrecopyInfo = VFIO_USER_GET_PRECOPY_INFO,
}

/// Who sends a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Client (VMM) to server (device): every command except DMA_READ/WRITE.
    ClientToServer,
    /// Server to client: DMA_READ and DMA_WRITE.
    ServerToClient,
}

impl Command {
    /// All commands, in numeric order.
    pub const ALL: [Command; 19] = [
        Command::Version,
        Command::DmaMap,
        Command::DmaUnmap,
        Command::DeviceGetInfo,
        Command::DeviceGetRegionInfo,
        Command::DeviceGetRegionIoFds,
        Command::DeviceGetIrqInfo,
        Command::DeviceSetIrqs,
        Command::RegionRead,
        Command::RegionWrite,
        Command::DmaRead,
        Command::DmaWrite,
        Command::DeviceReset,
        Command::DirtyPages,
        Command::RegionWriteMulti,
        Command::DeviceFeature,
        Command::MigDataRead,
        Command::MigDataWrite,
        Command::GetPrecopyInfo,
    ];

    /// The wire value.
    pub const fn as_u16(self) -> u16 {
        self as u16
    }

    /// Who sends this command.
    pub const fn direction(self) -> Direction {
        match self {
            Command::DmaRead | Command::DmaWrite => Direction::ServerToClient,
            _ => Direction::ClientToServer,
        }
    }

    /// Whether this codec decodes the command (all but 14).
    pub const fn is_supported(self) -> bool {
        !matches!(self, Command::DirtyPages)
    }
}

impl From<Command> for u16 {
    fn from(c: Command) -> u16 {
        c as u16
    }
}
