//! The crate's error type.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

/// Errors returned by [`ChCommand`](crate::ChCommand) and [`ChApi`](crate::ChApi).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ChError {
    /// A value cannot be written in cloud-hypervisor's `key=value,…` option
    /// syntax (it contains `,`, `=`, `"`, `[` or `]`, or is not UTF-8).
    #[error("Value {value:?} for {option} cannot be expressed in cloud-hypervisor option syntax")]
    InvalidOptionValue {
        /// The option and key, e.g. `--user-device socket`.
        option: &'static str,
        /// The offending value (lossily converted).
        value: String,
    },
    /// Serializing a request body failed (e.g. a socket path that is not UTF-8).
    #[error("Failed to serialize the request body")]
    Serialize(#[source] serde_json::Error),
    /// Connecting to the API socket failed.
    #[error("Failed to connect to the API socket {path}")]
    Connect {
        /// Socket path.
        path: PathBuf,
        /// The connection error.
        #[source]
        source: io::Error,
    },
    /// Writing the request or reading the response failed.
    #[error("API socket I/O failed during {method} {endpoint}")]
    Io {
        /// HTTP method.
        method: &'static str,
        /// Request path.
        endpoint: String,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// No complete response arrived in time.
    #[error("Timed out after {timeout:?} waiting for the response to {method} {endpoint}")]
    Timeout {
        /// HTTP method.
        method: &'static str,
        /// Request path.
        endpoint: String,
        /// The timeout that elapsed.
        timeout: Duration,
    },
    /// The response is not valid HTTP/1.1.
    #[error("Malformed HTTP response to {method} {endpoint}: {reason}")]
    MalformedResponse {
        /// HTTP method.
        method: &'static str,
        /// Request path.
        endpoint: String,
        /// What is wrong.
        reason: String,
    },
    /// The response head or body exceeds the size limit.
    #[error("HTTP response to {method} {endpoint} exceeds {limit} bytes")]
    ResponseTooLarge {
        /// HTTP method.
        method: &'static str,
        /// Request path.
        endpoint: String,
        /// The limit in bytes.
        limit: usize,
    },
    /// cloud-hypervisor answered with a non-2xx status.
    #[error("Request {method} {endpoint} failed with HTTP status {status}: {body}")]
    Status {
        /// HTTP method.
        method: &'static str,
        /// Request path.
        endpoint: String,
        /// The status code.
        status: u16,
        /// The response body (lossily decoded), usually cloud-hypervisor's error chain.
        body: String,
    },
    /// A 2xx response whose body does not have the expected shape.
    #[error("Unexpected response body from {endpoint}")]
    Deserialize {
        /// Request path.
        endpoint: String,
        /// The decoding error.
        #[source]
        source: serde_json::Error,
    },
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, ChError>;
