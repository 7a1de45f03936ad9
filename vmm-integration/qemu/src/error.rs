//! The crate's error type.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Errors returned by [`QemuCommand`](crate::QemuCommand) and [`Qmp`](crate::Qmp).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum QemuError {
    /// A path that must go into JSON (a `vfio-user-pci` socket) is not UTF-8.
    #[error("Path {path:?} is not valid UTF-8 and cannot be passed to QEMU as JSON")]
    NonUtf8Path {
        /// The offending path.
        path: PathBuf,
    },
    /// Serializing a JSON argument (a `-device` description or QMP arguments) failed.
    #[error("Failed to serialize JSON for QEMU")]
    Serialize(#[source] serde_json::Error),
    /// Connecting to the QMP socket failed.
    #[error("Failed to connect to the QMP socket {path}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// The last connection error.
        #[source]
        source: io::Error,
    },
    /// Writing to or reading from the QMP socket failed.
    #[error("QMP socket I/O failed")]
    Io(#[source] io::Error),
    /// QEMU closed the QMP connection.
    #[error("QEMU closed the QMP connection")]
    Closed,
    /// Nothing arrived in time.
    #[error("Timed out after {timeout:?} waiting for {waiting_for}")]
    Timeout {
        /// What was awaited (a command reply, an event, the greeting).
        waiting_for: String,
        /// The timeout that elapsed.
        timeout: Duration,
    },
    /// A line from QEMU is not valid JSON.
    #[error("QEMU sent a malformed QMP message")]
    MalformedMessage(#[source] serde_json::Error),
    /// A single QMP message exceeded the size limit.
    #[error("QMP message exceeds {limit} bytes")]
    MessageTooLong {
        /// The limit in bytes.
        limit: usize,
    },
    /// A JSON message that does not fit the QMP protocol at this point.
    #[error("Unexpected QMP message: {message}")]
    UnexpectedMessage {
        /// The message, re-serialized.
        message: String,
    },
    /// A command succeeded but its `return` value has an unexpected shape.
    #[error("Unexpected reply to QMP command {command}")]
    UnexpectedReply {
        /// The command name.
        command: String,
        /// The decoding error.
        #[source]
        source: serde_json::Error,
    },
    /// QEMU answered a command with an error response.
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        /// The command name.
        command: String,
        /// The QMP error class (for example `GenericError`, `DeviceNotFound`).
        class: String,
        /// QEMU's human-readable description.
        desc: String,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, QemuError>;
