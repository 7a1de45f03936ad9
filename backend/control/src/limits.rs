//! What one client, and one user, may hold of a control socket ([`Limits`]).

use std::time::Duration;

/// How long a client may take to send a request's headers. hyper starts the clock when it
/// waits for a request, so this is also how long a connection may stay idle between requests.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a client may take to send a request's body, counted from the end of its headers.
/// A body still arriving then is cut: a handler reading it fails (the JSON extractor answers
/// 408 `body_timeout`) and the connection is closed.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections served at once (see the module documentation for what happens past it).
pub const MAX_CONNECTIONS: usize = 64;

/// Connections one user other than root and the server's own may hold at once.
pub const MAX_CONNECTIONS_PER_UID: usize = 16;

/// Connections only root and the server's own user may hold: users other than them together
/// hold at most [`MAX_CONNECTIONS`] less these.
pub const RESERVED_CONNECTIONS: usize = 8;

/// Long-lived streams (events streams) open at once.
pub const MAX_STREAMS: usize = 32;

/// Streams one user other than root and the server's own may hold open.
pub const MAX_STREAMS_PER_UID: usize = 8;

/// Streams only root and the server's own user may open: users other than them together open
/// at most [`MAX_STREAMS`] less these.
pub const RESERVED_STREAMS: usize = 8;

/// What a client of a [`crate::ControlSocket`] may hold. The default is [`HEADER_READ_TIMEOUT`],
/// [`BODY_READ_TIMEOUT`], [`MAX_CONNECTIONS`], [`MAX_CONNECTIONS_PER_UID`],
/// [`RESERVED_CONNECTIONS`], [`MAX_STREAMS`], [`MAX_STREAMS_PER_UID`] and
/// [`RESERVED_STREAMS`]. Root and the server's own user are bound only by the totals; a
/// reserve larger than its total leaves one for the others, and a per-user limit is at most
/// what the others share ([`crate::admission`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// How long a request's headers may take, and a connection may stay idle.
    pub header_read_timeout: Duration,
    /// How long a request's body may take after its headers.
    pub body_read_timeout: Duration,
    /// Connections served at once (at least 1).
    pub max_connections: usize,
    /// Connections one unprivileged user may hold (at least 1).
    pub max_connections_per_uid: usize,
    /// Connections kept for root and the server's own user.
    pub reserved_connections: usize,
    /// Streams open at once ([`crate::Caller::open_stream`]; at least 1).
    pub max_streams: usize,
    /// Streams one unprivileged user may hold open (at least 1).
    pub max_streams_per_uid: usize,
    /// Streams kept for root and the server's own user.
    pub reserved_streams: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read_timeout: HEADER_READ_TIMEOUT,
            body_read_timeout: BODY_READ_TIMEOUT,
            max_connections: MAX_CONNECTIONS,
            max_connections_per_uid: MAX_CONNECTIONS_PER_UID,
            reserved_connections: RESERVED_CONNECTIONS,
            max_streams: MAX_STREAMS,
            max_streams_per_uid: MAX_STREAMS_PER_UID,
            reserved_streams: RESERVED_STREAMS,
        }
    }
}
