//! The client's errors.

use std::io;
use std::path::PathBuf;

use switchyard_proto::{Command, ProtoError};

/// Errors returned by [`Client`](crate::Client).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Connecting to the socket failed.
    #[error("Failed to connect to {path}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A socket operation failed.
    #[error("Socket I/O failed")]
    Io(#[source] io::Error),
    /// No message arrived within the receive timeout.
    #[error("Timed out waiting for the server")]
    Timeout,
    /// The server closed the connection.
    #[error("Server closed the connection")]
    Disconnected,
    /// The server sent a malformed message.
    #[error("Malformed message from the server")]
    Protocol(#[source] ProtoError),
    /// The server answered with an error reply.
    #[error("Server failed {command:?} with errno {errno}")]
    Remote {
        /// The command that failed.
        command: Command,
        /// The errno from the reply (as sent; may be 0).
        errno: i32,
    },
    /// The reply does not match the request (id, command, or content).
    #[error("Unexpected reply: {0}")]
    UnexpectedReply(String),
    /// The server's VERSION reply is unacceptable.
    #[error("Server version {major}.{minor} is not acceptable")]
    BadVersion {
        /// Major version.
        major: u16,
        /// Minor version.
        minor: u16,
    },
    /// A caller-supplied argument cannot be encoded.
    #[error("Invalid argument: {0}")]
    InvalidArgument(&'static str),
}

impl ClientError {
    /// The errno of a [`ClientError::Remote`] error.
    pub fn remote_errno(&self) -> Option<i32> {
        match self {
            ClientError::Remote { errno, .. } => Some(*errno),
            _ => None,
        }
    }
}

/// Result alias.
pub type Result<T> = std::result::Result<T, ClientError>;

/// Maps a socket error to the client error a caller can act on.
pub(crate) fn io_err(e: io::Error) -> ClientError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Timeout,
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset => ClientError::Disconnected,
        _ => ClientError::Io(e),
    }
}

/// A reply whose content does not match its request.
pub(crate) fn unexpected(what: &str) -> ClientError {
    ClientError::UnexpectedReply(format!("malformed {what} reply"))
}
