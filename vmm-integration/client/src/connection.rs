//! Connecting, VERSION negotiation and the connection's settings.

use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use switchyard_proto::consts::*;
use switchyard_proto::{Capabilities, Command, Limits, Reply, Version, encode_version_request};

use crate::transport::INBUF_MIN;
use crate::{Client, ClientConfig, ClientError, MessageDma, Result};

impl Client {
    /// Connects to `path` and negotiates VERSION with default settings.
    pub fn connect(path: impl AsRef<Path>) -> Result<Client> {
        Self::connect_with(path, ClientConfig::default())
    }

    /// Connects to `path` and negotiates VERSION with `config`.
    pub fn connect_with(path: impl AsRef<Path>, config: ClientConfig) -> Result<Client> {
        let path = path.as_ref();
        let sock = UnixStream::connect(path).map_err(|source| ClientError::Connect {
            path: path.to_owned(),
            source,
        })?;
        Self::from_stream(sock, config)
    }

    /// Negotiates VERSION on an already connected stream.
    pub fn from_stream(sock: UnixStream, config: ClientConfig) -> Result<Client> {
        let mut c = Self::without_handshake(sock, config)?;
        c.negotiate()?;
        Ok(c)
    }

    /// Wraps a stream without negotiating (for tests that send their own
    /// VERSION through [`Client::send_raw`]). Server capabilities are the
    /// spec defaults until [`Client::negotiate`] is called.
    pub fn without_handshake(sock: UnixStream, config: ClientConfig) -> Result<Client> {
        sock.set_read_timeout(config.timeout)
            .map_err(ClientError::Io)?;
        sock.set_write_timeout(config.timeout)
            .map_err(ClientError::Io)?;
        let limits = Limits::client(config.caps.max_data_xfer_size);
        Ok(Client {
            sock,
            next_id: 0,
            config,
            server_caps: Capabilities::default(),
            server_version: (0, 0),
            dma: None,
            out: Vec::with_capacity(4096),
            dma_out: Vec::new(),
            rx: Vec::with_capacity(4096),
            rx_start: 0,
            inbuf: vec![0; INBUF_MIN],
            in_start: 0,
            in_end: 0,
            pending_fds: Vec::new(),
            limits,
            dma_requests_served: 0,
        })
    }

    /// Performs VERSION negotiation (done by [`Client::connect`]).
    pub fn negotiate(&mut self) -> Result<()> {
        let id = self.alloc_id();
        encode_version_request(&mut self.out, id, self.config.minor, &self.config.caps)
            .map_err(ClientError::Protocol)?;
        let (hdr, _fds) = self.transact(id, Command::Version, &[])?;
        let reply = self.decode(&hdr, 0)?;
        let Reply::Version(Version { major, minor, data }) = reply else {
            return Err(ClientError::UnexpectedReply("not a VERSION reply".into()));
        };
        if major != VFIO_USER_MAJOR || minor > self.config.minor {
            return Err(ClientError::BadVersion { major, minor });
        }
        let caps = Capabilities::from_version_data(data).map_err(ClientError::Protocol)?;
        tracing::debug!(major, minor, ?caps, "negotiated vfio-user version");
        self.server_caps = caps;
        self.server_version = (major, minor);
        Ok(())
    }

    /// The server's capabilities from the VERSION reply.
    pub fn negotiated_caps(&self) -> &Capabilities {
        &self.server_caps
    }

    /// The server's reply version `(major, minor)`.
    pub fn server_version(&self) -> (u16, u16) {
        self.server_version
    }

    /// Installs (or removes) the handler for server DMA_READ/DMA_WRITE.
    pub fn set_dma_handler(&mut self, dma: Option<Box<dyn MessageDma>>) {
        self.dma = dma;
    }

    /// How many server-to-client DMA requests have been answered.
    pub fn dma_requests_served(&self) -> u64 {
        self.dma_requests_served
    }

    /// Changes the receive/send timeout.
    pub fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<()> {
        self.sock
            .set_read_timeout(timeout)
            .map_err(ClientError::Io)?;
        self.sock
            .set_write_timeout(timeout)
            .map_err(ClientError::Io)?;
        self.config.timeout = timeout;
        Ok(())
    }

    /// The underlying socket (e.g. to shut it down in a test).
    pub fn socket(&self) -> &UnixStream {
        &self.sock
    }

    /// Allocates a message id (wrapping).
    pub(crate) fn alloc_id(&mut self) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }
}
