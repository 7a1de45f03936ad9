//! Linux errno values used on the wire.
//!
//! vfio-user carries errnos in the reply header's `error_no` field. The
//! protocol is defined for Linux hosts, so these are the Linux values; they
//! are defined here to keep the codec free of `libc`.

/// Operation not permitted.
pub const EPERM: i32 = 1;
/// No such file or directory.
pub const ENOENT: i32 = 2;
/// I/O error.
pub const EIO: i32 = 5;
/// Argument list too long (used for transfers above `max_data_xfer_size`).
pub const E2BIG: i32 = 7;
/// Bad file descriptor.
pub const EBADF: i32 = 9;
/// Try again.
pub const EAGAIN: i32 = 11;
/// Out of memory.
pub const ENOMEM: i32 = 12;
/// Bad address (DMA to an unmapped IOVA).
pub const EFAULT: i32 = 14;
/// Device or resource busy.
pub const EBUSY: i32 = 16;
/// File exists (overlapping DMA map).
pub const EEXIST: i32 = 17;
/// No such device.
pub const ENODEV: i32 = 19;
/// Invalid argument (the default for malformed messages, as in libvfio-user).
pub const EINVAL: i32 = 22;
/// Inappropriate ioctl (unsupported device feature in the kernel's convention).
pub const ENOTTY: i32 = 25;
/// No space left on device.
pub const ENOSPC: i32 = 28;
/// Result out of range.
pub const ERANGE: i32 = 34;
/// Function not implemented.
pub const ENOSYS: i32 = 38;
/// Protocol error.
pub const EPROTO: i32 = 71;
/// Value too large for defined data type.
pub const EOVERFLOW: i32 = 75;
/// Message too long.
pub const EMSGSIZE: i32 = 90;
/// Operation not supported (`EOPNOTSUPP` has the same value on Linux).
pub const ENOTSUP: i32 = 95;
/// Transport endpoint is not connected.
pub const ENOTCONN: i32 = 107;
/// Connection timed out.
pub const ETIMEDOUT: i32 = 110;

/// Largest errno a peer may put in a reply header (libvfio-user's
/// `SERVER_MAX_ERROR_NO`). Larger values are treated as [`EIO`].
pub const MAX_ERRNO: u32 = 4096;
