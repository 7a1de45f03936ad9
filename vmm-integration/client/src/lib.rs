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

mod dma;

use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_proto::consts::*;
use switchyard_proto::errno;
use switchyard_proto::{
    Capabilities, Command, DeviceFeatureHeader, DeviceFeatureReply, DeviceInfo, DmaLoggingControl,
    DmaLoggingRange, DmaLoggingReport, DmaMap, DmaUnmap, FeatureReply, FeatureRequest, Header,
    IoFdEntries, IoFdEntry, IoFdShadowEntry, IrqInfo, IrqSet, Limits, MessageWriter,
    MigDeviceState, ProtoError, Records, RegionInfo, RegionTypeCap, Reply, Request, SparseMmapArea,
    Version, WriteMultiEntry, decode_reply_within, decode_request_with, dma_read_reply_buffer,
    encode_error_reply, encode_version_request, region_caps, region_write_request_buffer,
};
use zerocopy::FromBytes;

pub use dma::{FlatDma, MessageDma};

/// Errors returned by [`Client`].
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

fn io_err(e: io::Error) -> ClientError {
    match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ClientError::Timeout,
        io::ErrorKind::UnexpectedEof
        | io::ErrorKind::BrokenPipe
        | io::ErrorKind::ConnectionReset => ClientError::Disconnected,
        _ => ClientError::Io(e),
    }
}

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

/// A region description from DEVICE_GET_REGION_INFO.
#[derive(Debug)]
pub struct RegionDescription {
    /// The region info as replied (argsz is the size needed for all caps).
    pub info: RegionInfo,
    /// Sparse mmap areas, if the region has a `SPARSE_MMAP` capability.
    pub sparse_areas: Option<Vec<SparseMmapArea>>,
    /// Region type capability, if any.
    pub region_type: Option<RegionTypeCap>,
    /// Whether an `MSIX_MAPPABLE` capability is present.
    pub msix_mappable: bool,
    /// Raw capability bytes (following the 32-byte info).
    pub caps: Vec<u8>,
    /// The first fd passed with the reply (the region's mmap fd).
    pub fd: Option<File>,
    /// Any further fds.
    pub extra_fds: Vec<File>,
}

/// A GET_REGION_IO_FDS reply.
#[derive(Debug)]
pub struct RegionIoFdsReply {
    /// Size needed for the full reply.
    pub argsz: u32,
    /// Number of sub-regions.
    pub count: u32,
    /// Spec-layout (40-byte) entries.
    pub entries: Vec<IoFdEntry>,
    /// libvfio-user-layout (48-byte) entries.
    pub shadow_entries: Vec<IoFdShadowEntry>,
    /// The fds, indexed by `fd_index`.
    pub fds: Vec<File>,
}

/// A raw received message.
#[derive(Debug)]
pub struct RawMessage {
    /// The header.
    pub header: Header,
    /// The body (after the header).
    pub body: Vec<u8>,
    /// Any fds passed with it.
    pub fds: Vec<File>,
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
    fn alloc_id(&mut self) -> u16 {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        id
    }

    // ---------------------------------------------------------------- commands

    /// DEVICE_GET_INFO.
    pub fn device_info(&mut self) -> Result<DeviceInfo> {
        match self.request(
            &Request::DeviceGetInfo {
                argsz: DeviceInfo::SIZE as u32,
            },
            &[],
        )? {
            (Reply::DeviceGetInfo(i), _) => Ok(i),
            _ => Err(unexpected("DEVICE_GET_INFO")),
        }
    }

    /// DEVICE_GET_REGION_INFO, retrying with a larger argsz when the server
    /// says (through `argsz`, like QEMU reads it) that the capabilities need more room.
    pub fn region_info(&mut self, index: u32) -> Result<RegionDescription> {
        let (mut info, mut caps, mut fds) = self.region_info_raw(index, REGION_INFO_SIZE as u32)?;
        if caps.is_empty() && info.argsz as usize > REGION_INFO_SIZE {
            (info, caps, fds) = self.region_info_raw(index, info.argsz)?;
        }
        let mut sparse_areas = None;
        let mut region_type = None;
        let mut msix_mappable = false;
        for cap in region_caps(&info, &caps) {
            let cap = cap.map_err(ClientError::Protocol)?;
            if let Some(a) = cap.sparse_mmap_areas().map_err(ClientError::Protocol)? {
                sparse_areas = Some(a.iter().collect());
            }
            if let Some(t) = cap.region_type().map_err(ClientError::Protocol)? {
                region_type = Some(t);
            }
            msix_mappable |= cap.header.id == VFIO_REGION_INFO_CAP_MSIX_MAPPABLE;
        }
        let mut it = fds.into_iter();
        let fd = it.next();
        Ok(RegionDescription {
            info,
            sparse_areas,
            region_type,
            msix_mappable,
            caps,
            fd,
            extra_fds: it.collect(),
        })
    }

    /// DEVICE_GET_REGION_INFO with an explicit argsz: `(info, caps bytes, fds)`.
    pub fn region_info_raw(
        &mut self,
        index: u32,
        argsz: u32,
    ) -> Result<(RegionInfo, Vec<u8>, Vec<File>)> {
        let (hdr, fds) = self.call(&Request::DeviceGetRegionInfo { argsz, index }, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::DeviceGetRegionInfo { info, caps } => {
                if info.index != index {
                    return Err(ClientError::UnexpectedReply(format!(
                        "region info for {} instead of {index}",
                        info.index
                    )));
                }
                Ok((info, caps.to_vec(), fds))
            }
            _ => Err(unexpected("DEVICE_GET_REGION_INFO")),
        }
    }

    /// DEVICE_GET_REGION_IO_FDS with the given reply buffer size.
    pub fn get_region_io_fds(&mut self, index: u32, argsz: u32) -> Result<RegionIoFdsReply> {
        let (hdr, fds) = self.call(&Request::DeviceGetRegionIoFds { argsz, index }, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::DeviceGetRegionIoFds {
                argsz,
                count,
                entries,
                ..
            } => {
                let (entries, shadow_entries) = match entries {
                    IoFdEntries::Spec(r) => (r.iter().collect(), Vec::new()),
                    IoFdEntries::LibvfioUser(r) => (Vec::new(), r.iter().collect()),
                };
                Ok(RegionIoFdsReply {
                    argsz,
                    count,
                    entries,
                    shadow_entries,
                    fds,
                })
            }
            _ => Err(unexpected("DEVICE_GET_REGION_IO_FDS")),
        }
    }

    /// DEVICE_GET_IRQ_INFO.
    pub fn irq_info(&mut self, index: u32) -> Result<IrqInfo> {
        match self.request(
            &Request::DeviceGetIrqInfo {
                argsz: IrqInfo::SIZE as u32,
                index,
            },
            &[],
        )? {
            (Reply::DeviceGetIrqInfo(i), _) if i.index == index => Ok(i),
            _ => Err(unexpected("DEVICE_GET_IRQ_INFO")),
        }
    }

    /// DEVICE_SET_IRQS with raw `flags` (sent as given, so tests can send
    /// invalid combinations). Eventfds travel as SCM_RIGHTS. For
    /// `VFIO_IRQ_SET_DATA_BOOL` use [`Client::set_irqs_bool`].
    pub fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: &[BorrowedFd<'_>],
    ) -> Result<()> {
        self.set_irqs_with_data(index, flags, start, count, &[], fds)
    }

    /// DEVICE_SET_IRQS with `DATA_BOOL` and the given action flag.
    pub fn set_irqs_bool(
        &mut self,
        index: u32,
        action: u32,
        start: u32,
        values: &[bool],
    ) -> Result<()> {
        let bools: Vec<u8> = values.iter().map(|b| u8::from(*b)).collect();
        let count = u32::try_from(values.len())
            .map_err(|_| ClientError::InvalidArgument("too many vectors"))?;
        self.set_irqs_with_data(
            index,
            action | VFIO_IRQ_SET_DATA_BOOL,
            start,
            count,
            &bools,
            &[],
        )
    }

    fn set_irqs_with_data(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        data: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<()> {
        let id = self.alloc_id();
        let argsz = u32::try_from(IrqSet::SIZE + data.len())
            .map_err(|_| ClientError::InvalidArgument("too much data"))?;
        let mut w = MessageWriter::command(&mut self.out, id, Command::DeviceSetIrqs, false);
        w.put(&IrqSet {
            argsz,
            flags,
            index,
            start,
            count,
        });
        w.put_bytes(data);
        w.finish().map_err(ClientError::Protocol)?;
        let (hdr, _) = self.transact(id, Command::DeviceSetIrqs, fds)?;
        self.expect_reply(&hdr, 0, |r| matches!(r, Reply::DeviceSetIrqs))
    }

    /// DMA_MAP. `fd` is `(fd, file offset)` for a mappable window.
    pub fn dma_map(
        &mut self,
        iova: u64,
        size: u64,
        flags: u32,
        fd: Option<(BorrowedFd<'_>, u64)>,
    ) -> Result<()> {
        let offset = fd.as_ref().map_or(0, |(_, o)| *o);
        let file = fd.map(|(f, _)| f);
        let raw = file.as_slice();
        let m = DmaMap {
            argsz: DmaMap::SIZE as u32,
            flags,
            offset,
            address: iova,
            size,
        };
        match self.request(&Request::DmaMap(m), raw)? {
            (Reply::DmaMap, _) => Ok(()),
            _ => Err(unexpected("DMA_MAP")),
        }
    }

    /// DMA_UNMAP with raw flags (no dirty bitmap).
    pub fn dma_unmap(&mut self, iova: u64, size: u64, flags: u32) -> Result<()> {
        let u = DmaUnmap {
            argsz: DmaUnmap::SIZE as u32,
            flags,
            address: iova,
            size,
        };
        match self.request(
            &Request::DmaUnmap {
                unmap: u,
                bitmap: None,
            },
            &[],
        )? {
            (Reply::DmaUnmap { .. }, _) => Ok(()),
            _ => Err(unexpected("DMA_UNMAP")),
        }
    }

    /// DMA_UNMAP with `VFIO_DMA_UNMAP_FLAG_ALL` (address = size = 0).
    pub fn dma_unmap_all(&mut self) -> Result<()> {
        self.dma_unmap(0, 0, VFIO_DMA_UNMAP_FLAG_ALL)
    }

    /// DMA_UNMAP with `GET_DIRTY_BITMAP`: returns the bitmap bytes.
    pub fn dma_unmap_dirty(&mut self, iova: u64, size: u64, pgsize: u64) -> Result<Vec<u8>> {
        let bsize =
            switchyard_proto::dirty_bitmap_size(size, pgsize).map_err(ClientError::Protocol)?;
        let argsz = u32::try_from(bsize + (DmaUnmap::SIZE + 16) as u64)
            .map_err(|_| ClientError::InvalidArgument("bitmap too large"))?;
        let u = DmaUnmap {
            argsz,
            flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
            address: iova,
            size,
        };
        let b = switchyard_proto::BitmapHeader {
            pgsize,
            size: bsize,
        };
        match self.request(
            &Request::DmaUnmap {
                unmap: u,
                bitmap: Some(b),
            },
            &[],
        )? {
            (
                Reply::DmaUnmap {
                    bitmap: Some(b), ..
                },
                _,
            ) => Ok(b.data.to_vec()),
            _ => Err(unexpected("DMA_UNMAP")),
        }
    }

    /// REGION_READ into `buf`, split into chunks of the server's
    /// `max_data_xfer_size`.
    pub fn region_read(&mut self, region: u32, offset: u64, buf: &mut [u8]) -> Result<()> {
        let chunk = self.server_caps.max_data_xfer_size.max(1) as usize;
        let mut off = offset;
        for part in buf.chunks_mut(chunk) {
            let count = part.len() as u32;
            let (hdr, fds) = self.call(
                &Request::RegionRead {
                    offset: off,
                    region,
                    count,
                },
                &[],
            )?;
            match self.decode(&hdr, fds.len())? {
                Reply::RegionRead {
                    offset: o,
                    region: r,
                    data,
                } if o == off && r == region && data.len() == part.len() => {
                    part.copy_from_slice(data);
                }
                _ => return Err(unexpected("REGION_READ")),
            }
            off = off
                .checked_add(u64::from(count))
                .ok_or(ClientError::InvalidArgument("offset overflow"))?;
        }
        Ok(())
    }

    /// REGION_WRITE (waits for the reply), chunked like [`Client::region_read`].
    pub fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.region_write_inner(region, offset, data, false)
    }

    /// REGION_WRITE with `No_reply` (posted): returns once sent.
    pub fn region_write_posted(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()> {
        self.region_write_inner(region, offset, data, true)
    }

    fn region_write_inner(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
        posted: bool,
    ) -> Result<()> {
        let chunk = self.server_caps.max_data_xfer_size.max(1) as usize;
        let mut off = offset;
        for part in data.chunks(chunk) {
            let count = part.len() as u32;
            let id = self.alloc_id();
            region_write_request_buffer(&mut self.out, id, posted, off, region, count)
                .map_err(ClientError::Protocol)?
                .copy_from_slice(part);
            if posted {
                self.send_out(&[])?;
            } else {
                let (hdr, _) = self.transact(id, Command::RegionWrite, &[])?;
                self.expect_reply(&hdr, 0, |r| {
                    matches!(r, Reply::RegionWrite { offset: o, region: g, count: c } if *o == off && *g == region && *c == count)
                })?;
            }
            off = off
                .checked_add(u64::from(count))
                .ok_or(ClientError::InvalidArgument("offset overflow"))?;
        }
        Ok(())
    }

    /// REGION_WRITE_MULTI (waits for the reply); returns `wr_cnt`.
    pub fn region_write_multi(&mut self, entries: &[WriteMultiEntry]) -> Result<u64> {
        match self.request(
            &Request::RegionWriteMulti(Records::from_slice(entries)),
            &[],
        )? {
            (Reply::RegionWriteMulti { wr_cnt }, _) => Ok(wr_cnt),
            _ => Err(unexpected("REGION_WRITE_MULTI")),
        }
    }

    /// REGION_WRITE_MULTI with `No_reply` (as QEMU sends it).
    pub fn region_write_multi_posted(&mut self, entries: &[WriteMultiEntry]) -> Result<()> {
        let id = self.alloc_id();
        Request::RegionWriteMulti(Records::from_slice(entries))
            .encode(id, true, &mut self.out)
            .map_err(ClientError::Protocol)?;
        self.send_out(&[])
    }

    /// DEVICE_RESET.
    pub fn device_reset(&mut self) -> Result<()> {
        match self.request(&Request::DeviceReset, &[])? {
            (Reply::DeviceReset, _) => Ok(()),
            _ => Err(unexpected("DEVICE_RESET")),
        }
    }

    /// DEVICE_FEATURE, raw: sends `{argsz, flags}` + `data` and returns the
    /// reply's `{argsz, flags}` and data.
    pub fn device_feature(
        &mut self,
        argsz: u32,
        flags: u32,
        data: &[u8],
    ) -> Result<(DeviceFeatureHeader, Vec<u8>)> {
        let id = self.alloc_id();
        let mut w = MessageWriter::command(&mut self.out, id, Command::DeviceFeature, false);
        w.put(&DeviceFeatureHeader { argsz, flags });
        w.put_bytes(data);
        w.finish().map_err(ClientError::Protocol)?;
        let (_, fds) = self.transact(id, Command::DeviceFeature, &[])?;
        if !fds.is_empty() {
            return Err(unexpected("DEVICE_FEATURE (fds)"));
        }
        let (h, rest) = DeviceFeatureHeader::read_from_prefix(self.body())
            .map_err(|_| unexpected("DEVICE_FEATURE"))?;
        Ok((h, rest.to_vec()))
    }

    fn feature(&mut self, argsz: u32, op: FeatureRequest<'_>) -> Result<FeatureReplyOwned> {
        let req = Request::DeviceFeature(switchyard_proto::DeviceFeatureRequest { argsz, op });
        let (hdr, fds) = self.call(&req, &[])?;
        let reply = self.decode(&hdr, fds.len())?;
        let Reply::DeviceFeature(f) = reply else {
            return Err(unexpected("DEVICE_FEATURE"));
        };
        Ok(match f.op {
            FeatureReply::Probe { .. } => FeatureReplyOwned::Probe,
            FeatureReply::GetMigration(m) => FeatureReplyOwned::Migration(m.flags),
            FeatureReply::GetMigDeviceState(s) | FeatureReply::SetMigDeviceState(s) => {
                FeatureReplyOwned::State(s.device_state)
            }
            FeatureReply::DmaLoggingStart(c) => FeatureReplyOwned::PageSize(c.page_size),
            FeatureReply::DmaLoggingStop => FeatureReplyOwned::Probe,
            FeatureReply::DmaLoggingReport { .. } | FeatureReply::Other { .. } => {
                FeatureReplyOwned::Other
            }
        })
    }

    /// DEVICE_FEATURE PROBE for `feature` with the GET and/or SET bits.
    pub fn feature_probe(&mut self, feature: u16, get: bool, set: bool) -> Result<()> {
        self.feature(8, FeatureRequest::Probe { feature, get, set })
            .map(|_| ())
    }

    /// GET `VFIO_DEVICE_FEATURE_MIGRATION`: the `VFIO_MIGRATION_*` flags.
    pub fn migration_flags(&mut self) -> Result<u64> {
        match self.feature(16, FeatureRequest::GetMigration)? {
            FeatureReplyOwned::Migration(f) => Ok(f),
            _ => Err(unexpected("DEVICE_FEATURE MIGRATION")),
        }
    }

    /// GET `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE`.
    pub fn mig_state(&mut self) -> Result<u32> {
        match self.feature(16, FeatureRequest::GetMigDeviceState)? {
            FeatureReplyOwned::State(s) => Ok(s),
            _ => Err(unexpected("DEVICE_FEATURE MIG_DEVICE_STATE")),
        }
    }

    /// SET `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE`; returns the state echoed.
    pub fn set_mig_state(&mut self, state: u32) -> Result<u32> {
        let s = MigDeviceState {
            device_state: state,
            data_fd: u32::MAX,
        };
        match self.feature(16, FeatureRequest::SetMigDeviceState(s))? {
            FeatureReplyOwned::State(s) => Ok(s),
            _ => Err(unexpected("DEVICE_FEATURE MIG_DEVICE_STATE")),
        }
    }

    /// SET `DMA_LOGGING_START`; returns the page size the device chose.
    pub fn dma_logging_start(&mut self, page_size: u64, ranges: &[DmaLoggingRange]) -> Result<u64> {
        let c = DmaLoggingControl {
            page_size,
            ranges: Records::from_slice(ranges),
        };
        let argsz = u32::try_from(8 + c.encoded_len())
            .map_err(|_| ClientError::InvalidArgument("too many ranges"))?;
        match self.feature(argsz, FeatureRequest::DmaLoggingStart(c))? {
            FeatureReplyOwned::PageSize(p) => Ok(p),
            _ => Err(unexpected("DEVICE_FEATURE DMA_LOGGING_START")),
        }
    }

    /// SET `DMA_LOGGING_STOP`.
    pub fn dma_logging_stop(&mut self) -> Result<()> {
        self.feature(8, FeatureRequest::DmaLoggingStop).map(|_| ())
    }

    /// GET `DMA_LOGGING_REPORT` (read-and-clear): the bitmap bytes, one bit per page.
    pub fn dma_logging_report(
        &mut self,
        iova: u64,
        length: u64,
        page_size: u64,
    ) -> Result<Vec<u8>> {
        self.dma_logging_report_ref(iova, length, page_size)
            .map(<[u8]>::to_vec)
    }

    /// [`Client::dma_logging_report`] without a copy: the bitmap is borrowed from the
    /// receive buffer (valid until the next call), for a VMM that folds it into its own.
    pub fn dma_logging_report_ref(
        &mut self,
        iova: u64,
        length: u64,
        page_size: u64,
    ) -> Result<&[u8]> {
        let bsize = switchyard_proto::dirty_bitmap_size(length, page_size)
            .map_err(ClientError::Protocol)?;
        let argsz = u32::try_from(bsize + 32)
            .map_err(|_| ClientError::InvalidArgument("bitmap too large"))?;
        let r = DmaLoggingReport {
            iova,
            length,
            page_size,
        };
        let op = FeatureRequest::DmaLoggingReport(r);
        let req = Request::DeviceFeature(switchyard_proto::DeviceFeatureRequest { argsz, op });
        let (hdr, fds) = self.call(&req, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::DeviceFeature(DeviceFeatureReply {
                op: FeatureReply::DmaLoggingReport { report, bitmap },
                ..
            }) if report == r => Ok(bitmap),
            _ => Err(unexpected("DEVICE_FEATURE DMA_LOGGING_REPORT")),
        }
    }

    /// MIG_DATA_READ of up to `max` bytes (fewer = end of data).
    pub fn mig_data_read(&mut self, max: u32) -> Result<Vec<u8>> {
        self.mig_data_read_ref(max).map(<[u8]>::to_vec)
    }

    /// [`Client::mig_data_read`] without a copy: the data is borrowed from the receive buffer
    /// (valid until the next call), for a VMM that forwards it into its migration stream.
    pub fn mig_data_read_ref(&mut self, max: u32) -> Result<&[u8]> {
        let argsz = max
            .checked_add(8)
            .ok_or(ClientError::InvalidArgument("size too large"))?;
        let (hdr, fds) = self.call(&Request::MigDataRead { argsz, size: max }, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::MigDataRead { data, .. } if data.len() <= max as usize => Ok(data),
            Reply::MigDataRead { .. } => Err(unexpected("MIG_DATA_READ (too much data)")),
            _ => Err(unexpected("MIG_DATA_READ")),
        }
    }

    /// MIG_DATA_WRITE.
    pub fn mig_data_write(&mut self, data: &[u8]) -> Result<()> {
        let argsz = u32::try_from(data.len() + 8)
            .map_err(|_| ClientError::InvalidArgument("data too large"))?;
        match self.request(&Request::MigDataWrite { argsz, data }, &[])? {
            (Reply::MigDataWrite(_), _) => Ok(()),
            _ => Err(unexpected("MIG_DATA_WRITE")),
        }
    }

    // ------------------------------------------------------------- raw access

    /// Sends raw bytes (any content) with fds.
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        send_all(&self.sock, bytes, fds)
    }

    /// Receives the next message as is (no DMA servicing, no validation
    /// beyond the header's size).
    pub fn recv_raw(&mut self) -> Result<RawMessage> {
        let (header, fds) = self.recv_message()?;
        Ok(RawMessage {
            header,
            body: self.body().to_vec(),
            fds,
        })
    }

    /// Sends raw bytes and waits for the reply whose msg id equals the id in
    /// `bytes`' header, answering server DMA requests meanwhile. Error
    /// replies are returned as messages, not as errors.
    pub fn call_raw(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<RawMessage> {
        let hdr = Header::from_bytes(bytes).map_err(ClientError::Protocol)?;
        self.send_raw(bytes, fds)?;
        loop {
            let (header, fds) = self.recv_message()?;
            if header.is_command() {
                self.serve_request(&header, fds.len())?;
                continue;
            }
            if header.msg_id != hdr.msg_id {
                return Err(ClientError::UnexpectedReply(format!(
                    "reply id {} while waiting for {}",
                    header.msg_id, hdr.msg_id
                )));
            }
            return Ok(RawMessage {
                header,
                body: self.body().to_vec(),
                fds,
            });
        }
    }

    // -------------------------------------------------------------- internals

    fn request(
        &mut self,
        req: &Request<'_>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Reply<'_>, Vec<File>)> {
        let (hdr, files) = self.call(req, fds)?;
        let reply = self.decode(&hdr, files.len())?;
        Ok((reply, files))
    }

    fn call(&mut self, req: &Request<'_>, fds: &[BorrowedFd<'_>]) -> Result<(Header, Vec<File>)> {
        let id = self.alloc_id();
        req.encode(id, false, &mut self.out)
            .map_err(ClientError::Protocol)?;
        self.transact(id, req.command(), fds)
    }

    fn decode(&self, hdr: &Header, nfds: usize) -> Result<Reply<'_>> {
        decode_reply_within(hdr, self.body(), nfds, MAX_MSG_SIZE).map_err(ClientError::Protocol)
    }

    fn expect_reply(
        &self,
        hdr: &Header,
        nfds: usize,
        ok: impl Fn(&Reply<'_>) -> bool,
    ) -> Result<()> {
        let r = self.decode(hdr, nfds)?;
        if ok(&r) {
            Ok(())
        } else {
            Err(unexpected("reply content"))
        }
    }

    fn send_out(&mut self, fds: &[BorrowedFd<'_>]) -> Result<()> {
        send_all(&self.sock, &self.out, fds)
    }

    /// Sends `self.out` and waits for the matching reply (id, command, type),
    /// serving interleaved server requests. Error replies become
    /// [`ClientError::Remote`]. The reply body is left in `self.rx`.
    fn transact(
        &mut self,
        id: u16,
        cmd: Command,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Header, Vec<File>)> {
        self.send_out(fds)?;
        loop {
            let (hdr, files) = self.recv_message()?;
            if hdr.is_command() {
                self.serve_request(&hdr, files.len())?;
                continue;
            }
            hdr.validate_reply_flags().map_err(ClientError::Protocol)?;
            if hdr.msg_id != id {
                return Err(ClientError::UnexpectedReply(format!(
                    "reply id {} while waiting for {id}",
                    hdr.msg_id
                )));
            }
            if hdr.cmd != cmd.as_u16() {
                return Err(ClientError::UnexpectedReply(format!(
                    "reply command {} for {cmd:?}",
                    hdr.cmd
                )));
            }
            if hdr.is_error() {
                let errno = i32::try_from(hdr.error_no).unwrap_or(i32::MAX);
                tracing::debug!(?cmd, errno, "server returned an error");
                return Err(ClientError::Remote {
                    command: cmd,
                    errno,
                });
            }
            return Ok((hdr, files));
        }
    }

    /// Receives the next whole message into `self.rx`. Reads go into a buffer, so a reply
    /// usually costs one `recvmsg`. Descriptors go to the next reply parsed after they arrived:
    /// the only commands a server sends (DMA_READ/DMA_WRITE) carry none, and a read that
    /// brings such a command may also bring the start of a reply with fds.
    fn recv_message(&mut self) -> Result<(Header, Vec<File>)> {
        loop {
            let avail = self.in_end - self.in_start;
            if avail >= HEADER_SIZE {
                let hbytes = self
                    .inbuf
                    .get(self.in_start..self.in_start + HEADER_SIZE)
                    .unwrap_or_default();
                let hdr = Header::from_bytes(hbytes).map_err(ClientError::Protocol)?;
                let len = hdr.body_len().map_err(ClientError::Protocol)?;
                let total = HEADER_SIZE + len;
                if avail >= total {
                    if self.in_start == 0 && self.in_end == total && total >= INBUF_MIN {
                        // A large message alone in the buffer (a dirty bitmap, a big read):
                        // swap buffers instead of copying it.
                        std::mem::swap(&mut self.rx, &mut self.inbuf);
                        self.rx.truncate(total);
                        self.rx_start = HEADER_SIZE;
                        if self.inbuf.len() < INBUF_MIN {
                            self.inbuf.resize(INBUF_MIN, 0);
                        }
                    } else {
                        let body = self
                            .inbuf
                            .get(self.in_start + HEADER_SIZE..self.in_start + total)
                            .unwrap_or_default();
                        self.rx.clear();
                        self.rx.extend_from_slice(body);
                        self.rx_start = 0;
                    }
                    self.in_start += total;
                    if self.in_start == self.in_end {
                        self.in_start = 0;
                        self.in_end = 0;
                    }
                    let fds = if hdr.is_command() {
                        Vec::new()
                    } else {
                        std::mem::take(&mut self.pending_fds)
                    };
                    tracing::trace!(
                        id = hdr.msg_id,
                        cmd = hdr.cmd,
                        flags = hdr.flags,
                        len,
                        nfds = fds.len(),
                        "received"
                    );
                    return Ok((hdr, fds));
                }
                if self.inbuf.len() < total {
                    self.inbuf.resize(total, 0);
                }
            }
            // Move the partial message to the front (usually a few bytes, usually none).
            if self.in_start > 0 {
                self.inbuf.copy_within(self.in_start..self.in_end, 0);
                self.in_end = avail;
                self.in_start = 0;
            }
            let room = self.inbuf.get_mut(self.in_end..).unwrap_or_default();
            let pending = &mut self.pending_fds;
            match switchyard_endpoint::recv(&self.sock, room, MAX_RECV_FDS, false, |fd| {
                pending.push(File::from(fd));
            }) {
                Ok(r) if r.bytes == 0 => return Err(ClientError::Disconnected),
                Ok(r) => self.in_end += r.bytes,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e)),
            }
        }
    }

    /// The body of the last message received.
    fn body(&self) -> &[u8] {
        self.rx.get(self.rx_start..).unwrap_or_default()
    }

    /// Answers a server-to-client request whose body is in `self.rx`.
    fn serve_request(&mut self, hdr: &Header, nfds: usize) -> Result<()> {
        // Field borrows (not `self.body()`): the DMA handler is borrowed mutably below.
        let body = self.rx.get(self.rx_start..).unwrap_or_default();
        let result = decode_request_with(hdr, body, nfds, &self.limits);
        let no_reply = hdr.no_reply();
        match result {
            Ok(Request::DmaRead { address, count }) => {
                tracing::trace!(address, count, "serving DMA_READ");
                match dma_read_reply_buffer(&mut self.dma_out, hdr.msg_id, address, count) {
                    Ok(buf) => {
                        let r = match self.dma.as_mut() {
                            Some(d) => d.read(address, buf),
                            None => Err(errno::EFAULT),
                        };
                        if let Err(e) = r {
                            encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e);
                        }
                    }
                    Err(e) => encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e.errno()),
                }
            }
            Ok(Request::DmaWrite { address, data }) => {
                tracing::trace!(address, count = data.len(), "serving DMA_WRITE");
                let r = match self.dma.as_mut() {
                    Some(d) => d.write(address, data),
                    None => Err(errno::EFAULT),
                };
                match r {
                    Ok(()) => Reply::DmaWrite {
                        address,
                        count: data.len() as u64,
                    }
                    .encode(hdr.msg_id, &mut self.dma_out)
                    .map_err(ClientError::Protocol)?,
                    Err(e) => encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e),
                }
            }
            Ok(other) => {
                // Unreachable with Limits::client, but answer defensively.
                tracing::debug!(cmd = ?other.command(), "unexpected server request");
                encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, errno::EINVAL);
            }
            Err(e) => {
                tracing::debug!(error = %e, "malformed server request");
                encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e.errno());
            }
        }
        self.dma_requests_served = self.dma_requests_served.wrapping_add(1);
        if no_reply {
            return Ok(());
        }
        send_all(&self.sock, &self.dma_out, &[])
    }
}

enum FeatureReplyOwned {
    Probe,
    Migration(u64),
    State(u32),
    PageSize(u64),
    /// A report or an unmodelled feature's data (answered by dedicated paths).
    Other,
}

/// Smallest receive buffer (and the size from which a message is swapped out, not copied).
const INBUF_MIN: usize = 64 << 10;

/// Most descriptors accepted with one read; more are dropped by the kernel.
const MAX_RECV_FDS: usize = 64;

fn unexpected(what: &str) -> ClientError {
    ClientError::UnexpectedReply(format!("malformed {what} reply"))
}

/// Sends all of `bytes`, attaching `fds` to the first chunk.
fn send_all(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    switchyard_endpoint::send_all(sock, bytes, fds).map_err(io_err)
}
