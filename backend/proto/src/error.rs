//! The codec's error type.

use crate::command::Command;
use crate::errno;

/// An error found while decoding or encoding a vfio-user message.
///
/// Every variant maps to the errno a server puts into its error reply
/// (see [`ProtoError::errno`]). Malformed messages map to `EINVAL`, which is
/// what libvfio-user answers for the same inputs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    /// The buffer is shorter than the fixed part being read.
    #[error("Message too short for {what}: need {need} bytes, got {got}")]
    Truncated {
        /// What was being read.
        what: &'static str,
        /// Bytes needed.
        need: usize,
        /// Bytes available.
        got: usize,
    },
    /// The payload length is not the one the command requires.
    #[error("Invalid payload size for {what}: expected {expected}, got {got}")]
    BadSize {
        /// What was being decoded.
        what: &'static str,
        /// Expected size (description).
        expected: usize,
        /// Actual size.
        got: usize,
    },
    /// `msg_size` in the header is below 16 or above the allowed maximum.
    #[error("Header message size {msg_size} is out of range (16..={max})")]
    BadMsgSize {
        /// The header's `msg_size`.
        msg_size: u32,
        /// The maximum allowed.
        max: u32,
    },
    /// `msg_size` does not match 16 plus the body length handed to the decoder.
    #[error("Header message size {msg_size} does not match a body of {body} bytes")]
    SizeMismatch {
        /// The header's `msg_size`.
        msg_size: u32,
        /// The body length.
        body: usize,
    },
    /// The command number is not a vfio-user command.
    #[error("Unknown command {0}")]
    UnknownCommand(u16),
    /// The command is known but this codec does not implement it.
    #[error("Command {0:?} is not supported")]
    UnsupportedCommand(Command),
    /// The command may not be sent in this direction.
    #[error("Command {0:?} is not valid in this direction")]
    WrongDirection(Command),
    /// The header's type bits are not the expected command/reply type.
    #[error("Unexpected message type in header flags {flags:#x}")]
    BadMessageType {
        /// The header flags.
        flags: u32,
    },
    /// Undefined bits are set in the header flags.
    #[error("Invalid header flags {flags:#x}")]
    BadHeaderFlags {
        /// The header flags.
        flags: u32,
    },
    /// `argsz` is too small for the command.
    #[error("Invalid argsz {argsz} for {what}: at least {min} required")]
    BadArgsz {
        /// What was being decoded.
        what: &'static str,
        /// The argsz received.
        argsz: u32,
        /// The minimum acceptable.
        min: u64,
    },
    /// Unknown or conflicting flag bits in a command payload.
    #[error("Invalid flags {flags:#x} for {what}")]
    BadFlags {
        /// What was being decoded.
        what: &'static str,
        /// The flags received.
        flags: u64,
    },
    /// The number of passed file descriptors is not acceptable.
    #[error("Invalid number of file descriptors for {what}: got {got}")]
    BadFdCount {
        /// What was being decoded.
        what: &'static str,
        /// The number received.
        got: usize,
    },
    /// A field has an invalid value.
    #[error("Invalid {what}: {reason}")]
    Invalid {
        /// The field.
        what: &'static str,
        /// Why it is invalid.
        reason: &'static str,
    },
    /// Offset/size arithmetic overflowed.
    #[error("Arithmetic overflow in {what}")]
    Overflow {
        /// The computation.
        what: &'static str,
    },
    /// A data transfer exceeds the negotiated maximum.
    #[error("Transfer of {count} bytes exceeds the maximum of {max}")]
    TransferTooLarge {
        /// Requested byte count.
        count: u64,
        /// The limit.
        max: u64,
    },
    /// An encoded message would not fit the 32-bit `msg_size` or the limit.
    #[error("Message of {size} bytes is too large to encode")]
    MessageTooLarge {
        /// The would-be message size.
        size: usize,
    },
    /// The version payload's JSON is malformed (not NUL-terminated, not UTF-8, ...).
    #[error("Invalid version data: {0}")]
    BadVersionData(&'static str),
    /// The capabilities JSON is malformed or out of range.
    #[error("Invalid capabilities: {0}")]
    Capabilities(String),
    /// The peer proposed a protocol major version other than 0.
    #[error("Unsupported protocol major version {0}")]
    UnsupportedMajor(u16),
    /// The peer answered with an error reply (header `Error` flag).
    #[error("Peer returned an error for command {cmd}: errno {errno}")]
    ErrorReply {
        /// The command echoed in the reply header.
        cmd: u16,
        /// The header's `error_no` (may be 0 even for an error).
        errno: u32,
    },
}

impl ProtoError {
    /// The errno to report for this error (always nonzero).
    ///
    /// Malformed input is `EINVAL` (libvfio-user's choice, also for unknown
    /// commands and bad majors); oversized transfers are `E2BIG`; known but
    /// unimplemented commands are `ENOTSUP`. For [`ProtoError::ErrorReply`]
    /// the peer's errno is returned, or `EIO` when it is 0 or above 4096.
    pub fn errno(&self) -> i32 {
        match self {
            ProtoError::TransferTooLarge { .. } | ProtoError::MessageTooLarge { .. } => {
                errno::E2BIG
            }
            ProtoError::UnsupportedCommand(_) => errno::ENOTSUP,
            ProtoError::ErrorReply { errno: e, .. } => {
                if *e == 0 || *e > errno::MAX_ERRNO {
                    errno::EIO
                } else {
                    i32::try_from(*e).unwrap_or(errno::EIO)
                }
            }
            _ => errno::EINVAL,
        }
    }

    pub(crate) fn truncated(what: &'static str, need: usize, got: usize) -> Self {
        ProtoError::Truncated { what, need, got }
    }

    pub(crate) fn invalid(what: &'static str, reason: &'static str) -> Self {
        ProtoError::Invalid { what, reason }
    }

    pub(crate) fn overflow(what: &'static str) -> Self {
        ProtoError::Overflow { what }
    }
}
