//! Errors of the DMA space.

/// Errors of DMA space operations.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// The requested window overlaps an existing one.
    #[error("DMA window {iova:#x}+{size:#x} overlaps an existing mapping")]
    Overlap {
        /// Start of the requested window.
        iova: u64,
        /// Size of the requested window.
        size: u64,
    },
    /// The window is empty or wraps around the address space.
    #[error("DMA window {iova:#x}+{size:#x} is empty or wraps")]
    BadWindow {
        /// Start of the requested window.
        iova: u64,
        /// Size of the requested window.
        size: u64,
    },
    /// The device's [`DmaObserver`](super::DmaObserver) refused the window.
    #[error("The device refused the DMA window")]
    Observer(#[source] Box<crate::DeviceError>),
    /// An unmap range cuts through a window.
    #[error("Unmap range {iova:#x}+{size:#x} splits a DMA mapping")]
    PartialUnmap {
        /// Start of the requested range.
        iova: u64,
        /// Size of the requested range.
        size: u64,
    },
    /// Too many simultaneous mappings.
    #[error("Too many DMA mappings (limit {limit})")]
    TooManyMappings {
        /// The configured limit.
        limit: usize,
    },
    /// Mapping the client's file descriptor failed.
    #[error("Cannot mmap the DMA window at {iova:#x}")]
    Mmap {
        /// Start of the window.
        iova: u64,
        /// The underlying error.
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    /// The client's file descriptor cannot be inspected.
    #[error("Cannot inspect the file of the DMA window at {iova:#x}")]
    Backing {
        /// Start of the window.
        iova: u64,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The descriptor is not a file that can back DMA memory.
    #[error("The file of the DMA window at {iova:#x} cannot back DMA memory: {what}")]
    UnsupportedBacking {
        /// Start of the window.
        iova: u64,
        /// What the file is.
        what: String,
    },
    /// The window needs the fault-safe access path and this process cannot open it.
    #[error("DMA window at {iova:#x} is not a sealed memfd and /proc/self/mem is unavailable")]
    NoSafeAccess {
        /// Start of the window.
        iova: u64,
    },
    /// The client's memory could not be read or written (truncated file, no page to back a
    /// hole): the kernel refused to fault the page in.
    #[error("DMA access at {iova:#x} hit memory the client's file no longer backs")]
    Fault {
        /// Start of the failing chunk.
        iova: u64,
    },
    /// The dirty logs would exceed their memory budget.
    #[error("Dirty logging needs {need} more bytes of bitmaps, over the budget of {budget}")]
    LogBudget {
        /// Bytes the logs would need in all.
        need: u64,
        /// The budget.
        budget: u64,
    },
    /// Memory for a dirty log could not be allocated.
    #[error("Cannot allocate a dirty log")]
    LogAlloc(#[source] std::collections::TryReserveError),
    /// An access touched an address outside every mapping.
    #[error("DMA access at {iova:#x} is outside every mapping")]
    Unmapped {
        /// First address that is not mapped.
        iova: u64,
    },
    /// An access needed a permission the mapping does not grant.
    #[error("DMA {access} at {iova:#x} is not permitted by its mapping")]
    Permission {
        /// First address that lacks the permission.
        iova: u64,
        /// `"read"` or `"write"`.
        access: &'static str,
    },
    /// The address range of an access wraps around.
    #[error("DMA access at {iova:#x} of {len:#x} bytes wraps")]
    Overflow {
        /// Start of the access.
        iova: u64,
        /// Length of the access.
        len: u64,
    },
    /// A message-based access through the client failed.
    #[error("DMA through the client at {iova:#x} failed with errno {errno}")]
    Remote {
        /// Start of the failing chunk.
        iova: u64,
        /// The errno the transport reported.
        errno: i32,
    },
    /// Dirty logging was asked for with an unusable page size.
    #[error("Dirty page size {0:#x} is not a power of two multiple of 4 KiB")]
    BadPageSize(u64),
    /// A dirty report was asked for outside a logging session.
    #[error("DMA dirty logging is not started")]
    NotLogging,
    /// Logging was started twice.
    #[error("DMA dirty logging is already started")]
    LoggingActive,
    /// The buffer for a dirty bitmap is too small.
    #[error("Dirty bitmap needs {need} bytes, the request has room for {room}")]
    BitmapTooSmall {
        /// Bytes the bitmap needs.
        need: u64,
        /// Bytes available.
        room: usize,
    },
}

impl DmaError {
    /// The errno that best describes this error on the wire.
    pub fn errno(&self) -> i32 {
        match self {
            DmaError::Overlap { .. } => libc::EEXIST,
            DmaError::BadWindow { .. }
            | DmaError::BadPageSize(_)
            | DmaError::NotLogging
            | DmaError::BitmapTooSmall { .. }
            | DmaError::PartialUnmap { .. } => libc::EINVAL,
            DmaError::LoggingActive => libc::EBUSY,
            DmaError::TooManyMappings { .. } => libc::ENOSPC,
            DmaError::Mmap { source, .. } => match source {
                vm_memory::mmap::MmapRegionError::Mmap(e) => {
                    e.raw_os_error().unwrap_or(libc::ENOMEM)
                }
                _ => libc::EINVAL,
            },
            DmaError::Backing { source, .. } => source.raw_os_error().unwrap_or(libc::EINVAL),
            DmaError::NoSafeAccess { .. } => libc::ENOTSUP,
            DmaError::UnsupportedBacking { .. } => libc::EINVAL,
            DmaError::Observer(e) => e.errno(),
            DmaError::LogBudget { .. } | DmaError::LogAlloc(_) => libc::ENOMEM,
            DmaError::Unmapped { .. } | DmaError::Overflow { .. } | DmaError::Fault { .. } => {
                libc::EFAULT
            }
            DmaError::Permission { .. } => libc::EPERM,
            DmaError::Remote { errno, .. } => *errno,
        }
    }
}

/// Result type of DMA operations.
pub type Result<T> = std::result::Result<T, DmaError>;
