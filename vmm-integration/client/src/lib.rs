//! A synchronous VMM-side vfio-user client.
//!
//! Used by integration tests and migration orchestration. Built on the
//! sans-IO `switchyard-proto` codec; SCM_RIGHTS through `switchyard-endpoint`.
//!
//! * [`Client::connect`] performs VERSION negotiation.
//! * Every command has a method; error replies surface as
//!   [`ClientError::Remote`].
//! * Server-to-client DMA_READ/DMA_WRITE requests arriving while a reply is
//!   awaited are answered through an optional [`MessageDma`] handler
//!   (`EFAULT` without one).
//! * [`Client::send_raw`], [`Client::recv_raw`] and [`Client::call_raw`] let
//!   tests send malformed input.
//! * A receive timeout (default 10 s) keeps tests from hanging.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod connection;
mod device;
mod dma_map;
mod error;
mod feature;
mod raw;
mod region;
mod transport;

mod dma;
pub mod migrate;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use switchyard_proto::{Capabilities, Limits};

pub use device::{RegionDescription, RegionIoFdsReply};
pub use error::{ClientError, Result};
pub use raw::RawMessage;

pub use dma::{FlatDma, MessageDma};
pub use migrate::{Migration, MigrationError};

/// Client configuration.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Receive (and send) timeout; `None` blocks forever.
    pub timeout: Option<Duration>,
    /// Capabilities proposed in VERSION (also bound what we accept from the
    /// server: DMA_READ/WRITE sizes).
    pub caps: Capabilities,
    /// Minor version proposed.
    pub minor: u16,
}

impl Default for ClientConfig {
    /// 10 s timeout; QEMU-like proposal: 16 fds, 1 MiB transfers, 4 KiB
    /// pages, 65535 maps, `write_multiple`; version 0.0.
    fn default() -> Self {
        ClientConfig {
            timeout: Some(Duration::from_secs(10)),
            caps: Capabilities {
                max_msg_fds: 16,
                write_multiple: true,
                ..Capabilities::default()
            },
            minor: 0,
        }
    }
}

/// A connected vfio-user client.
pub struct Client {
    sock: UnixStream,
    next_id: u16,
    config: ClientConfig,
    server_caps: Capabilities,
    server_version: (u16, u16),
    dma: Option<Box<dyn MessageDma>>,
    out: Vec<u8>,
    dma_out: Vec<u8>,
    /// The last message received; its body starts at `rx_start`.
    rx: Vec<u8>,
    rx_start: usize,
    /// Receive buffer: one `recvmsg` usually brings a whole reply.
    inbuf: Vec<u8>,
    in_start: usize,
    in_end: usize,
    /// Descriptors received but not yet handed to a message.
    pending_fds: Vec<File>,
    limits: Limits,
    dma_requests_served: u64,
}

impl Drop for Client {
    /// Disconnects for real: a copy of the socket that a `fork` elsewhere in this process left
    /// in a child (until its `exec` closes it) would otherwise keep the connection open, and
    /// the server would see a reconnect as a second concurrent client.
    fn drop(&mut self) {
        let _ = self.sock.shutdown(std::net::Shutdown::Both);
    }
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("fd", &self.sock.as_raw_fd())
            .field("next_id", &self.next_id)
            .field("server_caps", &self.server_caps)
            .field("server_version", &self.server_version)
            .field("has_dma_handler", &self.dma.is_some())
            .finish()
    }
}
