//! Control-plane plumbing of the Switchyard pool daemon, independent of the inventory model.
//!
//! The daemon serves an HTTP/JSON API on a UNIX socket; `switchyard ctl` is its client. This
//! crate has the pieces that do not depend on what the API manages:
//!
//! - **Serving** ([`ControlSocket`], [`serve`]): the socket (mode 0600; a stale file from a
//!   crashed daemon is replaced, a live server is refused; removed at shutdown) and an HTTP/1.1
//!   accept loop (tokio + hyper) that runs an axum router, with a bounded graceful shutdown,
//!   header and body read timeouts, and caps on connections and streams, per user with a
//!   reserve for root ([`Limits`]); every request knows its [`Caller`] (`SO_PEERCRED`).
//! - **Errors** ([`ApiError`], [`ErrorBody`], the [`Json`], [`Query`] and [`Path`]
//!   extractors, [`json_fallbacks`]): every failed request, whether refused by a handler, an
//!   extractor (malformed JSON, wrong content type, missing field) or the router (404, 405),
//!   is a 4xx/5xx with `{"error": {"code": "...", "message": "..."}}`.
//! - **The client** ([`ControlClient`]): blocking HTTP/1.1 over `std::os::unix::net::UnixStream`
//!   with `httparse` (the CLI is synchronous): `get`/`post`/`delete` return the JSON body or the
//!   decoded API error, `stream` yields the lines of a streamed reply.
//! - **Metrics** ([`Metrics`]): the Prometheus families of the pool (per endpoint, per board,
//!   daemon-wide) on `prometheus-client`, recorded through cached handles that allocate
//!   nothing, encoded as OpenMetrics text for `GET /metrics`.
//! - **Events** ([`Events`]): a broadcast hub with a replay buffer, generic over the daemon's
//!   event type, streamed as newline-delimited JSON by `GET /events?since=SEQ`; lag is
//!   reported in the stream (`{"type":"lagged","missed":N}`), never silent.
//! - **OpenAPI** ([`ControlApi`], [`check_openapi_file`]): the router and its utoipa document
//!   built together, with this crate's routes (`/health`, `/metrics`, `/events`) ready to add;
//!   a test helper keeps a committed document equal to the generated one.
//!
//! A daemon puts it together like this:
//!
//! ```no_run
//! # use switchyard_control::*;
//! # #[derive(Clone, serde::Serialize, utoipa::ToSchema)]
//! # struct Event { seq: u64 }
//! # impl Sequenced for Event { fn seq(&self) -> u64 { self.seq } }
//! # #[derive(Clone)]
//! # struct AppState { metrics: Metrics, events: Events<Event> }
//! # impl axum::extract::FromRef<AppState> for Metrics {
//! #     fn from_ref(s: &AppState) -> Self { s.metrics.clone() }
//! # }
//! # impl axum::extract::FromRef<AppState> for Events<Event> {
//! #     fn from_ref(s: &AppState) -> Self { s.events.clone() }
//! # }
//! # async fn run(
//! #     state: AppState,
//! #     signal: impl std::future::Future<Output = ()> + Send,
//! # ) -> Result<(), ControlError> {
//! let socket = ControlSocket::bind("/run/switchyard/control.sock".as_ref())?;
//! let (router, _doc) = ControlApi::new("Switchyard pool daemon", env!("CARGO_PKG_VERSION"))
//!     .health()
//!     .metrics()
//!     .events::<Event>()
//!     .build(state.clone());
//! let events = state.events.clone();
//! socket
//!     .serve(router, async move {
//!         signal.await; // SIGTERM, `ctl shutdown`, ...
//!         events.close(); // ends the events streams, so shutdown does not wait for them
//!     })
//!     .await
//! # }
//! ```

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod admission;
mod api;
mod client;
mod events;
mod limits;
mod metrics;
mod openapi;
mod server;

use std::io;
use std::path::PathBuf;

pub use admission::{Caller, StreamPermit};
pub use api::{
    ApiError, ErrorBody, ErrorDetail, Json, Path, Query, json_fallbacks, method_not_allowed,
    not_found,
};
pub use client::{ControlClient, JsonReply, LineStream, RawReply};
pub use events::{
    Events, EventsQuery, NDJSON_CONTENT_TYPE, Received, Sequenced, StreamNotice, Subscription,
    events_handler, ndjson_response,
};
pub use limits::{
    BODY_READ_TIMEOUT, HEADER_READ_TIMEOUT, Limits, MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID,
    MAX_STREAMS, MAX_STREAMS_PER_UID, RESERVED_CONNECTIONS, RESERVED_STREAMS,
};
pub use metrics::{
    BoardMetrics, EndpointMetrics, LATENCY_BUCKETS, Metrics, OPENMETRICS_CONTENT_TYPE, command_name,
};
pub use openapi::{
    CONTROL_TAG, ControlApi, Health, UPDATE_ENV, check_openapi_file, check_openapi_file_with,
    health, metrics,
};
pub use server::{ControlSocket, MAX_SOCKET_PATH, SHUTDOWN_GRACE, serve};

/// Errors of the control plane (the server, the client, the events hub and the OpenAPI check).
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The socket path is longer than AF_UNIX allows.
    #[error("Socket path {path:?} is {len} bytes; AF_UNIX allows {MAX_SOCKET_PATH}")]
    SocketPathTooLong {
        /// The path.
        path: PathBuf,
        /// Its length.
        len: usize,
    },
    /// Something other than a socket is at the socket path.
    #[error("{0:?} exists and is not a socket; refusing to replace it")]
    SocketPathTaken(PathBuf),
    /// A server accepts connections at the socket path.
    #[error("Another server is listening on {0:?}; stop it first")]
    SocketInUse(PathBuf),
    /// Binding or listening failed.
    #[error("Cannot bind the control socket {path:?}")]
    Bind {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The client could not connect.
    #[error("Cannot connect to the control socket {path:?}")]
    Connect {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Sending a request or reading its reply failed.
    #[error("I/O on the control socket {path:?} failed")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// The request path or method cannot be sent (not absolute, or has spaces or controls).
    #[error("Invalid request target {0:?}")]
    BadRequestPath(String),
    /// The request body could not be serialized.
    #[error("Cannot encode the request body as JSON")]
    EncodeBody(#[source] serde_json::Error),
    /// The server's reply is not valid HTTP/1.1 (or past a size limit).
    #[error("Malformed reply from the control socket: {0}")]
    BadReply(&'static str),
    /// A reply body is not the JSON expected.
    #[error("The reply body is not the JSON expected")]
    BadReplyBody(#[source] serde_json::Error),
    /// The server answered with an error.
    #[error("{message} ({code}, HTTP {status})")]
    Api {
        /// The HTTP status.
        status: u16,
        /// The error code (`unknown` when the body was not the API's error shape).
        code: String,
        /// The message.
        message: String,
    },
    /// An event's sequence number does not increase.
    #[error("Event {seq} published after event {last}; sequence numbers must increase")]
    EventOutOfOrder {
        /// The refused event's number.
        seq: u64,
        /// The last published number.
        last: u64,
    },
    /// A request's body did not arrive within the server's body read timeout.
    #[error("The request body did not arrive within {0:?}")]
    BodyTimeout(std::time::Duration),
    /// Reading a request's body failed.
    #[error("Cannot read the request body")]
    ReadBody(#[source] hyper::Error),
    /// An event was published after the hub was closed.
    #[error("The events hub is closed")]
    EventsClosed,
    /// The OpenAPI document could not be serialized.
    #[error("Cannot serialize the OpenAPI document")]
    EncodeOpenApi(#[source] serde_json::Error),
    /// Reading or writing the committed OpenAPI document failed.
    #[error("Cannot access the OpenAPI document {path:?}")]
    OpenApiFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// No OpenAPI document is committed at the path.
    #[error(
        "No OpenAPI document at {0:?}; generate it with {UPDATE_ENV}=1 cargo test and commit it",
        UPDATE_ENV = openapi::UPDATE_ENV
    )]
    OpenApiMissing(PathBuf),
    /// The committed OpenAPI document differs from the code's.
    #[error(
        "The OpenAPI document {path:?} differs from the code's at line {line}: committed \
         `{committed}`, generated `{generated}`. If the API change is intended, rewrite it \
         with {UPDATE_ENV}=1 cargo test and commit it",
        UPDATE_ENV = openapi::UPDATE_ENV
    )]
    OpenApiDrift {
        /// The file.
        path: PathBuf,
        /// The first differing line (1-based).
        line: usize,
        /// That line in the file.
        committed: String,
        /// That line as generated.
        generated: String,
    },
}
