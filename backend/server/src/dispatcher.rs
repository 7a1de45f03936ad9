//! The request handling of one connection, independent of how bytes arrive: a [`Dispatcher`]
//! takes a framed message, decodes it, dispatches it to the DMA space / interrupt table /
//! device model, and builds the reply (bytes and descriptors) in its own reused buffers. It
//! holds no socket; the caller sends the reply (see `dispatch::serve_connection`).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use switchyard_device::ratelimit::{LOG_INTERVAL, LogLimiter};
use switchyard_device::{
    DeviceError, DmaError, DmaProt, DmaSpace, Interrupts, IrqIndex, PciDevice, RegionDesc,
};
use switchyard_proto::consts::*;
use switchyard_proto::{
    Capabilities, DeviceFeatureHeader, DeviceFeatureReply, DeviceInfo, DmaLoggingControl,
    FeatureReply, FeatureRequest, Header, IrqAction, IrqData, IrqInfo, Limits, MigDeviceState,
    MigState, MigrationFeature, ProtoError, RegionCapsBuilder, RegionInfo, Reply, Request,
    ServerLimits, SetIrqs, SparseMmapArea, dirty_bitmap_size, dma_logging_report_reply_buffer,
    encode_error_reply, encode_region_write_reply, encode_version_reply,
    mig_data_read_reply_buffer, negotiate_version, region_read_reply_buffer,
    truncate_mig_data_read_reply,
};

use crate::client_dma::{ClientDma, Routed};
use crate::continuity::{Continuity, WindowRecord};
use crate::migration;
use crate::transport::Message;
use crate::{DeviceSlot, Slot};

/// Why a request failed: an errno for the reply, and a message for the log.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    #[error(transparent)]
    Proto(#[from] ProtoError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Dma(#[from] DmaError),
    #[error("{what}")]
    Invalid { what: &'static str, errno: i32 },
}

impl RequestError {
    fn errno(&self) -> i32 {
        match self {
            RequestError::Proto(e) => e.errno(),
            RequestError::Device(e) => e.errno(),
            RequestError::Dma(e) => e.errno(),
            RequestError::Invalid { errno, .. } => *errno,
        }
    }
}

fn invalid(what: &'static str) -> RequestError {
    RequestError::Invalid {
        what,
        errno: libc::EINVAL,
    }
}

/// Where the [`ClientDma`] of a client comes from: created when the client has negotiated its
/// version (it needs the client's transfer size), it sends server→client requests on its own.
pub(crate) trait ClientDmaSource: Send {
    /// A new [`ClientDma`] for a client that accepts `max_xfer` bytes per transfer.
    fn connect(&mut self, max_xfer: usize) -> io::Result<Arc<ClientDma>>;
}

/// [`ClientDmaSource`] on the connection's socket: requests are sent on a clone of it,
/// serialised with the replies by `send_lock`.
pub(crate) struct SocketClientDma {
    pub(crate) stream: Arc<UnixStream>,
    pub(crate) send_lock: Arc<Mutex<()>>,
    /// How long a server→client request waits for the client's reply.
    pub(crate) timeout: Duration,
}

impl ClientDmaSource for SocketClientDma {
    fn connect(&mut self, max_xfer: usize) -> io::Result<Arc<ClientDma>> {
        Ok(Arc::new(ClientDma::new(
            self.stream.try_clone()?,
            self.send_lock.clone(),
            max_xfer,
            self.timeout,
        )))
    }
}

/// What the caller does after [`Dispatcher::handle`] or [`Dispatcher::unframeable`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Nothing to send (a posted request, a reply from the client).
    Nothing,
    /// Send [`Dispatcher::reply`] (a request's reply).
    Reply,
    /// Send [`Dispatcher::reply`] (an error reply).
    ErrorReply,
    /// The stream cannot be framed any more: send [`Dispatcher::reply`] (an error reply) if
    /// `reply`, then close the connection.
    Close {
        /// An error reply is ready.
        reply: bool,
    },
}

/// The protocol state of one connection: negotiated capabilities, reply buffers, the client's
/// DMA handle and the per-client log limiters. No socket: messages come in framed, replies go
/// out through [`Dispatcher::reply`] / [`Dispatcher::sent`].
pub(crate) struct Dispatcher {
    limits: Limits,
    /// The server's limits (version negotiation, MIG_DATA_READ size).
    server_limits: ServerLimits,
    negotiated: Option<Capabilities>,
    out: Vec<u8>,
    caps: Vec<u8>,
    out_fds: Vec<OwnedFd>,
    client_dma_source: Box<dyn ClientDmaSource>,
    client_dma: Option<Arc<ClientDma>>,
    /// The buffer large replies whose data area is entirely written by the server
    /// (DMA_LOGGING_REPORT bitmaps, MIG_DATA_READ data) are built in: it keeps its length
    /// between replies, so a megabyte-sized area is not zero-filled before every fill.
    bulk_out: Vec<u8>,
    /// `out` and `bulk_out` are swapped until the next send.
    bulk_in_out: bool,
    /// Warnings a client can provoke at message rate, limited per client (see
    /// [`LogLimiter`]): failed posted requests, unsolicited replies, refused SET_IRQS fds.
    posted_failures: LogLimiter,
    unsolicited_replies: LogLimiter,
    bad_irq_fds: LogLimiter,
    /// Crash continuity (a pool worker): tables and session published as they change.
    continuity: Option<Arc<Continuity>>,
    /// The next request is the one a replaced process was handling: requests that a first
    /// attempt may already have applied succeed again (see [`crate::continuity`]).
    replaying: bool,
}

impl Dispatcher {
    /// A dispatcher for a new connection of a server with `server_limits`.
    pub(crate) fn new(
        server_limits: ServerLimits,
        client_dma_source: Box<dyn ClientDmaSource>,
    ) -> Self {
        let limits = Limits::server(server_limits.max_data_xfer_size);
        Self {
            limits,
            server_limits,
            negotiated: None,
            out: Vec::with_capacity(limits.max_msg_size as usize),
            caps: Vec::with_capacity(256),
            out_fds: Vec::new(),
            client_dma_source,
            client_dma: None,
            bulk_out: Vec::new(),
            bulk_in_out: false,
            posted_failures: LogLimiter::new("posted request failed", LOG_INTERVAL),
            unsolicited_replies: LogLimiter::new("dropping an unsolicited reply", LOG_INTERVAL),
            bad_irq_fds: LogLimiter::new(
                "SET_IRQS refused a file that is not an eventfd",
                LOG_INTERVAL,
            ),
            continuity: None,
            replaying: false,
        }
    }

    /// Publishes tables and session into `continuity` from now on.
    pub(crate) fn set_continuity(&mut self, continuity: Option<Arc<Continuity>>) {
        self.continuity = continuity;
    }

    /// Continues a session a replaced process negotiated: the same VERSION request is
    /// negotiated again (the same server limits give the same result), without a reply; the
    /// next request is handled as a replay.
    pub(crate) fn resume_session(
        &mut self,
        device_slot: &DeviceSlot,
        version: Option<&(u16, u16, Vec<u8>)>,
    ) -> Result<(), RequestError> {
        if let Some((major, minor, data)) = version {
            self.negotiate(device_slot, 0, *major, *minor, data)?;
            // The reply is not sent again: the client has it.
            self.out.clear();
        }
        self.replaying = true;
        Ok(())
    }

    fn negotiate(
        &mut self,
        device_slot: &DeviceSlot,
        id: u16,
        major: u16,
        minor: u16,
        data: &[u8],
    ) -> Result<(), RequestError> {
        let n = negotiate_version(major, minor, data, &self.server_limits)?;
        encode_version_reply(&mut self.out, id, &n.reply)?;
        tracing::info!(
            client_major = major,
            client_minor = minor,
            max_msg_fds = n.client.max_msg_fds,
            max_data_xfer_size = n.client.max_data_xfer_size,
            "version negotiated"
        );
        let cd = self
            .client_dma_source
            .connect(n.client.max_data_xfer_size as usize)
            .map_err(DeviceError::Io)?;
        device_slot.context().dma.set_remote(Some(cd.clone()));
        device_slot.context().waits.set(Some(cd.clone()));
        self.client_dma = Some(cd);
        self.negotiated = Some(n.client);
        if let Some(c) = &self.continuity {
            c.version(major, minor, data);
        }
        Ok(())
    }

    /// The limits messages are framed and decoded with (`max_msg_size`).
    pub(crate) fn limits(&self) -> &Limits {
        &self.limits
    }

    /// Handles one message: a request (its reply, or error reply, is then in
    /// [`Dispatcher::reply`]) or a reply of the client to a server→client request.
    pub(crate) fn handle(&mut self, device_slot: &DeviceSlot, msg: Message<'_>) -> Outcome {
        let fd_ids =
            (self.continuity.is_some() && !msg.fd_ids.is_empty()).then(|| msg.fd_ids.clone());
        if msg.header.is_reply() {
            self.route_reply(&msg);
            // A reply never keeps descriptors (a client may attach some anyway).
            if let (Some(c), Some(ids)) = (&self.continuity, fd_ids) {
                c.settle(&ids);
            }
            return Outcome::Nothing;
        }
        let (msg_id, cmd, no_reply) = (msg.header.msg_id, msg.header.cmd, msg.header.no_reply());
        let result = self.request(device_slot, msg);
        self.replaying = false;
        if let (Some(c), Some(ids)) = (&self.continuity, fd_ids) {
            c.settle(&ids);
        }
        match result {
            Ok(()) if no_reply => {
                // A posted request's reply (and any descriptor it would carry) is dropped
                // here, not sent with the next one.
                self.sent();
                Outcome::Nothing
            }
            Ok(()) => Outcome::Reply,
            Err(e) => {
                self.out_fds.clear();
                tracing::debug!(msg_id, cmd, errno = e.errno(), error = %e, "request failed");
                if no_reply {
                    if self.posted_failures.allow() {
                        tracing::warn!(msg_id, cmd, error = %e, "posted request failed");
                    }
                    self.sent();
                    return Outcome::Nothing;
                }
                encode_error_reply(&mut self.out, msg_id, cmd, e.errno());
                Outcome::ErrorReply
            }
        }
    }

    /// A header that makes the stream impossible to frame (`header` if it could be parsed):
    /// an error reply if the header asks for one, then the connection closes.
    pub(crate) fn unframeable(&mut self, header: Option<Header>, error: &ProtoError) -> Outcome {
        tracing::warn!(error = %error, "unframeable message; closing the connection");
        match header.filter(|h| h.is_command() && !h.no_reply()) {
            Some(h) => {
                encode_error_reply(&mut self.out, h.msg_id, h.cmd, error.errno());
                Outcome::Close { reply: true }
            }
            None => Outcome::Close { reply: false },
        }
    }

    /// The reply to send: bytes and descriptors.
    pub(crate) fn reply(&self) -> (&[u8], &[OwnedFd]) {
        (&self.out, &self.out_fds)
    }

    /// The reply has been sent (or given up): its descriptors are closed and the buffers
    /// are ready for the next one.
    pub(crate) fn sent(&mut self) {
        self.out_fds.clear();
        if self.bulk_in_out {
            std::mem::swap(&mut self.out, &mut self.bulk_out);
            self.bulk_in_out = false;
        }
    }

    /// The client is gone: the limiters report what they held back, and the client's DMA
    /// handle (if it negotiated) goes to the teardown, `Server::client_gone`, which closes it
    /// once the device is parked (a command waiting for this client is then cancelled and runs
    /// again for the next client, instead of failing on the closed connection and latching an
    /// error).
    pub(crate) fn disconnect(&mut self) -> Option<Arc<ClientDma>> {
        for l in [
            &self.posted_failures,
            &self.unsolicited_replies,
            &self.bad_irq_fds,
        ] {
            l.flush();
        }
        self.client_dma.take()
    }

    /// Builds the next reply in the bulk buffer (see `bulk_out`).
    fn use_bulk_buffer(&mut self) {
        if !self.bulk_in_out {
            std::mem::swap(&mut self.out, &mut self.bulk_out);
            self.bulk_in_out = true;
        }
    }

    /// A reply from the client: only answers to our DMA_READ/DMA_WRITE are expected.
    fn route_reply(&self, msg: &Message<'_>) {
        let h = &msg.header;
        let outcome = || {
            if h.is_error() {
                Err(h.error_no as i32)
            } else {
                Ok(msg.body.to_vec())
            }
        };
        let routed = self
            .client_dma
            .as_ref()
            .map_or(Routed::Unsolicited, |cd| cd.complete(h.msg_id, outcome));
        match routed {
            Routed::Delivered => {}
            Routed::Late => tracing::debug!(
                msg_id = h.msg_id,
                cmd = h.cmd,
                "dropping a late reply to a cancelled DMA request"
            ),
            Routed::Unsolicited => {
                if self.unsolicited_replies.allow() {
                    tracing::warn!(
                        msg_id = h.msg_id,
                        cmd = h.cmd,
                        "dropping an unsolicited reply"
                    );
                }
            }
        }
    }

    fn request(&mut self, device_slot: &DeviceSlot, msg: Message<'_>) -> Result<(), RequestError> {
        let h = msg.header;
        if msg.fds_truncated {
            // Never reinterpret a message whose descriptors were dropped (a DMA_MAP would become
            // message-based, a SET_IRQS would de-assign vectors).
            let errno = if msg.fds.len() >= crate::transport::MAX_FDS_PER_READ {
                libc::E2BIG
            } else {
                libc::EMFILE
            };
            return Err(RequestError::Invalid {
                what: "the kernel dropped descriptors sent with the message (open-file limit, or too many)",
                errno,
            });
        }
        let req = switchyard_proto::decode_request_with(&h, msg.body, msg.fds.len(), &self.limits)?;
        if self.negotiated.is_none() && !matches!(req, Request::Version(_)) {
            return Err(RequestError::Invalid {
                what: "version not negotiated yet",
                errno: libc::EINVAL,
            });
        }
        let id = h.msg_id;
        let mut guard = device_slot.lock();
        let slot: &mut Slot = &mut guard;
        let dev: &mut dyn PciDevice = &mut *slot.device;
        match req {
            Request::RegionRead {
                offset,
                region: index,
                count,
            } => {
                let r = region(dev, index)?;
                if !r.read {
                    return Err(invalid("region is not readable"));
                }
                check_range(r, index, offset, count as usize)?;
                tracing::trace!(region = index, offset, count, "region read");
                let buf = region_read_reply_buffer(&mut self.out, id, offset, index, count)?;
                dev.region_read(index, offset, buf)?;
            }
            Request::RegionWrite {
                offset,
                region: index,
                data,
            } => {
                let r = region(dev, index)?;
                if !r.write {
                    return Err(invalid("region is not writable"));
                }
                check_range(r, index, offset, data.len())?;
                tracing::trace!(region = index, offset, count = data.len(), "region write");
                dev.region_write(index, offset, data)?;
                encode_region_write_reply(&mut self.out, id, offset, index, data.len() as u32)?;
            }
            Request::Version(v) => {
                if self.negotiated.is_some() {
                    return Err(invalid("version already negotiated"));
                }
                self.negotiate(device_slot, id, v.major, v.minor, v.data)?;
            }
            Request::DmaMap(m) => {
                if m.flags & VFIO_USER_F_DMA_REGION_FILE_IO != 0 {
                    return Err(RequestError::Invalid {
                        what: "file I/O DMA access mode is not supported",
                        errno: libc::ENOTSUP,
                    });
                }
                let prot = DmaProt {
                    read: m.flags & VFIO_USER_F_DMA_REGION_READ != 0,
                    write: m.flags & VFIO_USER_F_DMA_REGION_WRITE != 0,
                };
                let fd_id = msg.fd_ids.first().copied();
                let record = WindowRecord {
                    iova: m.address,
                    size: m.size,
                    offset: if msg.fds.is_empty() { 0 } else { m.offset },
                    read: prot.read,
                    write: prot.write,
                    fd: None,
                };
                if self.replaying
                    && let Some(c) = &self.continuity
                    && c.has_window(&record, fd_id)
                {
                    // The replaced process mapped it and published it, then died before the
                    // reply: the client still waits for that reply.
                    tracing::info!(
                        iova = m.address,
                        size = m.size,
                        "replayed DMA map: already mapped"
                    );
                    reply_empty(&mut self.out, id, Reply::DmaMap)?;
                    return Ok(());
                }
                let backing = match msg.fds.into_iter().next() {
                    Some(fd) => {
                        if m.offset % 4096 != 0 {
                            return Err(invalid("DMA map file offset is not page aligned"));
                        }
                        Some((File::from(fd), m.offset))
                    }
                    None if m.flags & VFIO_USER_F_DMA_REGION_MMAP != 0 => {
                        return Err(invalid("mmap DMA access mode without a file descriptor"));
                    }
                    None => None,
                };
                let mmapped = backing.is_some();
                device_slot
                    .context()
                    .dma
                    .map(m.address, m.size, prot, backing)?;
                if let Some(c) = &self.continuity {
                    c.dma_mapped(WindowRecord {
                        fd: fd_id.filter(|_| mmapped),
                        ..record
                    });
                }
                tracing::debug!(
                    iova = m.address,
                    size = m.size,
                    flags = m.flags,
                    mmapped,
                    "DMA map"
                );
                reply_empty(&mut self.out, id, Reply::DmaMap)?;
            }
            Request::DmaUnmap { unmap, bitmap } => {
                if unmap.flags & VFIO_DMA_UNMAP_FLAG_ALL != 0 {
                    device_slot.context().dma.unmap_all();
                    if let Some(c) = &self.continuity {
                        c.dma_unmapped_all();
                    }
                    tracing::debug!("DMA unmap all");
                    Reply::DmaUnmap {
                        unmap,
                        bitmap: None,
                    }
                    .encode(id, &mut self.out)?;
                } else if let Some(bh) = bitmap {
                    let buf = switchyard_proto::dma_unmap_bitmap_reply_buffer(
                        &mut self.out,
                        id,
                        &unmap,
                        bh.pgsize,
                    )?;
                    // Bits and windows go together, under one lock: no write falls in between.
                    let n = device_slot.context().dma.unmap_take_dirty(
                        unmap.address,
                        unmap.size,
                        bh.pgsize,
                        buf,
                    )?;
                    if let Some(c) = &self.continuity {
                        c.dma_unmapped(unmap.address, unmap.size);
                    }
                    tracing::debug!(
                        iova = unmap.address,
                        size = unmap.size,
                        windows = n,
                        "DMA unmap with dirty bitmap"
                    );
                } else {
                    let n = device_slot.context().dma.unmap(unmap.address, unmap.size)?;
                    if let Some(c) = &self.continuity {
                        c.dma_unmapped(unmap.address, unmap.size);
                    }
                    tracing::debug!(
                        iova = unmap.address,
                        size = unmap.size,
                        windows = n,
                        "DMA unmap"
                    );
                    Reply::DmaUnmap {
                        unmap,
                        bitmap: None,
                    }
                    .encode(id, &mut self.out)?;
                }
            }
            Request::DeviceGetInfo { .. } => {
                let d = dev.description();
                let mut flags = VFIO_DEVICE_FLAGS_PCI;
                if d.resettable {
                    flags |= VFIO_DEVICE_FLAGS_RESET;
                }
                let info = DeviceInfo {
                    argsz: DeviceInfo::SIZE as u32,
                    flags,
                    num_regions: d.regions.len() as u32,
                    num_irqs: d.irqs.len() as u32,
                };
                Reply::DeviceGetInfo(info).encode(id, &mut self.out)?;
            }
            Request::DeviceGetRegionInfo { argsz, index } => {
                let d = dev.description();
                let r = d
                    .regions
                    .get(index as usize)
                    .ok_or_else(|| invalid("no such region"))?;
                let mut info = RegionInfo {
                    argsz: REGION_INFO_SIZE as u32,
                    flags: 0,
                    index,
                    cap_offset: 0,
                    size: r.size,
                    offset: 0,
                };
                if r.read {
                    info.flags |= VFIO_REGION_INFO_FLAG_READ;
                }
                if r.write {
                    info.flags |= VFIO_REGION_INFO_FLAG_WRITE;
                }
                let mut send_fd = None;
                let mut builder = RegionCapsBuilder::new(&mut self.caps);
                if let Some(mm) = &r.mmap {
                    info.flags |= VFIO_REGION_INFO_FLAG_MMAP;
                    info.offset = mm.file_offset;
                    if !mm.areas.is_empty() {
                        let areas: Vec<SparseMmapArea> = mm
                            .areas
                            .iter()
                            .map(|a| SparseMmapArea {
                                offset: a.offset,
                                size: a.size,
                            })
                            .collect();
                        builder.sparse_mmap(&areas)?;
                    }
                    send_fd = Some(mm.file.clone());
                }
                let fits = builder.finish_info(&mut info, argsz)?;
                // Like libvfio-user, the fd travels only with a complete reply (caps included).
                if !fits {
                    send_fd = None;
                }
                let caps: &[u8] = if fits { &self.caps } else { &[] };
                Reply::DeviceGetRegionInfo { info, caps }.encode(id, &mut self.out)?;
                if let Some(f) = send_fd {
                    self.out_fds
                        .push(f.as_fd().try_clone_to_owned().map_err(DeviceError::Io)?);
                }
            }
            Request::DeviceGetRegionIoFds { index, .. } => {
                region(dev, index)?;
                // No region of ours has ioeventfd-capable sub-regions (QEMU does not use them).
                Reply::DeviceGetRegionIoFds {
                    argsz: 16,
                    index,
                    count: 0,
                    entries: switchyard_proto::IoFdEntries::Spec(Default::default()),
                }
                .encode(id, &mut self.out)?;
            }
            Request::DeviceGetIrqInfo { index, .. } => {
                let d = dev.description();
                let irq = d
                    .irqs
                    .get(index as usize)
                    .ok_or_else(|| invalid("no such interrupt index"))?;
                let mut flags = 0;
                if irq.eventfd {
                    flags |= VFIO_IRQ_INFO_EVENTFD;
                }
                if irq.maskable {
                    flags |= VFIO_IRQ_INFO_MASKABLE;
                }
                if irq.automasked {
                    flags |= VFIO_IRQ_INFO_AUTOMASKED;
                }
                if irq.noresize {
                    flags |= VFIO_IRQ_INFO_NORESIZE;
                }
                let info = IrqInfo {
                    argsz: IrqInfo::SIZE as u32,
                    flags,
                    index,
                    count: irq.count,
                };
                Reply::DeviceGetIrqInfo(info).encode(id, &mut self.out)?;
            }
            Request::DeviceSetIrqs(set) => {
                let eventfds = matches!(
                    (set.action, set.data),
                    (IrqAction::Trigger, IrqData::Eventfd)
                );
                let fd_ids = msg.fd_ids.clone();
                let disable = set.count == 0;
                set_irqs(
                    dev,
                    &device_slot.context().irqs,
                    set,
                    msg.fds,
                    &self.bad_irq_fds,
                )?;
                if let Some(c) = &self.continuity {
                    if disable {
                        c.irqs_disabled(set.index);
                    } else if eventfds {
                        let ids: Vec<Option<u64>> = if fd_ids.is_empty() {
                            vec![None; set.count as usize]
                        } else {
                            fd_ids.into_iter().map(Some).collect()
                        };
                        c.irqs_set(set.index, set.start, &ids);
                    }
                }
                dev.irqs_changed(set.index);
                reply_empty(&mut self.out, id, Reply::DeviceSetIrqs)?;
            }
            Request::DeviceReset => {
                tracing::info!("device reset");
                if slot.mig != MigState::Running {
                    // A reset ends any migration (and is the way out of ERROR).
                    let before = slot.mig;
                    if let Some(m) = dev.migration() {
                        m.abort();
                    }
                    slot.mig = MigState::Running;
                    // (Fields, not `Slot::mig_changed`: `dev` borrows the device.)
                    if let Some(hook) = &slot.mig_hook
                        && before != MigState::Running
                    {
                        hook(slot.mig);
                    }
                }
                dev.reset()?;
                reply_empty(&mut self.out, id, Reply::DeviceReset)?;
            }
            Request::RegionWriteMulti(entries) => {
                let mut done = 0u64;
                for e in entries.iter() {
                    let r = region(dev, e.region)?;
                    let data = e
                        .data
                        .get(..e.count as usize)
                        .ok_or_else(|| invalid("write-multi count"))?;
                    check_range(r, e.region, e.offset, data.len())?;
                    dev.region_write(e.region, e.offset, data)?;
                    done += 1;
                }
                Reply::RegionWriteMulti { wr_cnt: done }.encode(id, &mut self.out)?;
            }
            Request::DeviceFeature(f) => {
                if matches!(f.op, FeatureRequest::DmaLoggingReport(_)) {
                    self.use_bulk_buffer();
                }
                device_feature(slot, &device_slot.context().dma, &mut self.out, id, f.op)?
            }
            Request::MigDataRead { size, .. } => {
                if !matches!(slot.mig, MigState::PreCopy | MigState::StopCopy) {
                    return Err(invalid("MIG_DATA_READ outside PRE_COPY and STOP_COPY"));
                }
                if size > self.server_limits.max_data_xfer_size {
                    return Err(invalid("MIG_DATA_READ larger than max_data_xfer_size"));
                }
                self.use_bulk_buffer();
                let buf = mig_data_read_reply_buffer(&mut self.out, id, size)?;
                let n = dev
                    .migration()
                    .ok_or_else(|| invalid("the device does not migrate"))?
                    .read(buf)?;
                let n = u32::try_from(n)
                    .ok()
                    .filter(|&n| n <= size)
                    .ok_or_else(|| invalid("device produced more migration data than asked"))?;
                truncate_mig_data_read_reply(&mut self.out, n)?;
                tracing::trace!(size, n, "MIG_DATA_READ");
            }
            Request::MigDataWrite { data, .. } => {
                if slot.mig != MigState::Resuming {
                    return Err(invalid("MIG_DATA_WRITE outside RESUMING"));
                }
                dev.migration()
                    .ok_or_else(|| invalid("the device does not migrate"))?
                    .write(data)?;
                tracing::trace!(n = data.len(), "MIG_DATA_WRITE");
                reply_empty(&mut self.out, id, Reply::MigDataWrite(None))?;
            }
            Request::DmaRead { .. } | Request::DmaWrite { .. } => {
                // Rejected by the decoder's direction check; kept for exhaustiveness.
                return Err(invalid("server-to-client command sent by the client"));
            }
        }
        Ok(())
    }
}

fn region<D: PciDevice + ?Sized>(dev: &D, index: u32) -> Result<&RegionDesc, RequestError> {
    dev.description()
        .regions
        .get(index as usize)
        .filter(|r| r.size > 0)
        .ok_or_else(|| RequestError::Device(DeviceError::NoSuchRegion(index)))
}

fn check_range(r: &RegionDesc, index: u32, offset: u64, len: usize) -> Result<(), RequestError> {
    let end = offset.checked_add(len as u64);
    if end.is_none_or(|e| e > r.size) {
        return Err(DeviceError::OutOfRange {
            region: index,
            offset,
            len,
        }
        .into());
    }
    Ok(())
}

/// DEVICE_FEATURE: DMA dirty logging (START / STOP / REPORT and their PROBEs) and, for a
/// device that can migrate, MIGRATION and MIG_DEVICE_STATE; otherwise those answer `ENOTTY`
/// ("not supported", as the kernel does).
fn device_feature(
    slot: &mut Slot,
    dma: &DmaSpace,
    out: &mut Vec<u8>,
    id: u16,
    op: FeatureRequest<'_>,
) -> Result<(), RequestError> {
    let not_supported = RequestError::Invalid {
        what: "device feature not supported",
        errno: libc::ENOTTY,
    };
    let reply = |out: &mut Vec<u8>, op: FeatureReply<'_>| {
        let argsz = (DeviceFeatureHeader::SIZE + op.data_len()) as u32;
        reply_empty(
            out,
            id,
            Reply::DeviceFeature(DeviceFeatureReply { argsz, op }),
        )
    };
    let mig_caps = slot.device.migration().map(|m| m.caps());
    match op {
        FeatureRequest::Probe { feature, get, set } => {
            let (can_get, can_set) = match feature {
                VFIO_DEVICE_FEATURE_DMA_LOGGING_START | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP => {
                    (false, true)
                }
                VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT => (true, false),
                VFIO_DEVICE_FEATURE_MIGRATION if mig_caps.is_some() => (true, false),
                VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE if mig_caps.is_some() => (true, true),
                _ => return Err(not_supported),
            };
            if (get && !can_get) || (set && !can_set) {
                return Err(invalid("device feature does not support that operation"));
            }
            reply(out, FeatureReply::Probe { feature, get, set })
        }
        FeatureRequest::DmaLoggingStart(c) => {
            // Every window is logged whatever the ranges say; still, nonsense is refused.
            if c.ranges
                .iter()
                .any(|r| r.length == 0 || r.iova.checked_add(r.length - 1).is_none())
            {
                return Err(invalid("DMA logging range is empty or wraps"));
            }
            let page_size = dma.start_logging(c.page_size)?;
            tracing::info!(
                page_size,
                ranges = c.ranges.len(),
                "DMA dirty logging started"
            );
            reply(
                out,
                FeatureReply::DmaLoggingStart(DmaLoggingControl { page_size, ..c }),
            )
        }
        FeatureRequest::DmaLoggingStop => {
            dma.stop_logging();
            tracing::info!("DMA dirty logging stopped");
            reply(out, FeatureReply::DmaLoggingStop)
        }
        FeatureRequest::DmaLoggingReport(r) => {
            // The bitmap is built in place in the reply (whose bitmap area is not zeroed:
            // `report_dirty` writes every byte of it); the decoder checked that the client's
            // argsz has room for it.
            if dirty_bitmap_size(r.length, r.page_size)? > u64::from(MAX_DATA_XFER_SIZE_LIMIT) {
                return Err(RequestError::Invalid {
                    what: "DMA logging report bitmap too large for one message",
                    errno: libc::E2BIG,
                });
            }
            let buf = dma_logging_report_reply_buffer(out, id, &r)?;
            dma.report_dirty(r.iova, r.length, r.page_size, buf)?;
            tracing::trace!(
                iova = r.iova,
                length = r.length,
                page_size = r.page_size,
                "DMA logging report"
            );
            Ok(())
        }
        FeatureRequest::GetMigration => {
            let caps = mig_caps.ok_or(not_supported)?;
            let mut flags = VFIO_MIGRATION_STOP_COPY;
            if caps.precopy {
                flags |= VFIO_MIGRATION_PRE_COPY;
            }
            reply(out, FeatureReply::GetMigration(MigrationFeature { flags }))
        }
        FeatureRequest::GetMigDeviceState => {
            mig_caps.ok_or(not_supported)?;
            reply(
                out,
                FeatureReply::GetMigDeviceState(MigDeviceState {
                    device_state: slot.mig as u32,
                    data_fd: u32::MAX,
                }),
            )
        }
        FeatureRequest::SetMigDeviceState(st) => {
            mig_caps.ok_or(not_supported)?;
            let target = MigState::try_from(st.device_state)?;
            if slot.moving && !matches!(target, MigState::Running | MigState::Stop) {
                // A move reads the same device state and write log.
                return Err(RequestError::Invalid {
                    what: "the device is being moved to another backing",
                    errno: libc::EBUSY,
                });
            }
            let before = slot.mig;
            let moved = migration::transition(&mut *slot.device, &mut slot.mig, target);
            slot.mig_changed(before);
            moved?;
            reply(
                out,
                FeatureReply::SetMigDeviceState(MigDeviceState {
                    device_state: slot.mig as u32,
                    data_fd: u32::MAX,
                }),
            )
        }
        FeatureRequest::Other { .. } => Err(not_supported),
    }
}

fn reply_empty(out: &mut Vec<u8>, id: u16, r: Reply<'_>) -> Result<(), RequestError> {
    r.encode(id, out)?;
    Ok(())
}

/// What `/proc/self/fd/N` links to for an eventfd: the kernel's name for its anonymous inode
/// (what lsof shows). A real file links to an absolute path and a pipe or socket to
/// `pipe:[ino]`/`socket:[ino]`, so no other file can pose as one.
const EVENTFD_LINK: &str = "anon_inode:[eventfd]";

/// What `fd` is, as procfs names it (compare with [`EVENTFD_LINK`]).
fn fd_kind(fd: &OwnedFd) -> std::io::Result<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn set_irqs(
    dev: &mut dyn PciDevice,
    irqs: &Interrupts,
    set: SetIrqs<'_>,
    fds: Vec<OwnedFd>,
    bad_fds: &LogLimiter,
) -> Result<(), RequestError> {
    let d = dev.description();
    let irq = d
        .irqs
        .get(set.index as usize)
        .ok_or_else(|| invalid("no such interrupt index"))?;
    let in_range = set
        .start
        .checked_add(set.count)
        .is_some_and(|e| e <= irq.count);
    if set.count == 0 {
        // Only "disable everything" is meaningful with no vectors.
        if matches!((set.action, set.data), (IrqAction::Trigger, IrqData::None)) && set.start == 0 {
            // A device that delivers its interrupts itself gives every vector back first (a
            // physical device's kernel would otherwise keep signalling the client's eventfds).
            let count = irq.count as usize;
            if count > 0
                && let Some(router) = dev.irq_router()
            {
                let none: Vec<Option<&File>> = vec![None; count];
                router.route(set.index, 0, &none)?;
            }
            irqs.disable(set.index).map_err(DeviceError::from)?;
            tracing::debug!(index = set.index, "interrupts disabled");
            return Ok(());
        }
        return Err(invalid(
            "zero-count SET_IRQS must be TRIGGER|DATA_NONE at start 0",
        ));
    }
    if !in_range {
        return Err(invalid("interrupt vectors out of range"));
    }
    match (set.action, set.data) {
        (IrqAction::Trigger, IrqData::Eventfd) => {
            let files: Vec<Option<File>> = if fds.is_empty() {
                (0..set.count).map(|_| None).collect()
            } else {
                if fds.len() != set.count as usize {
                    return Err(invalid("eventfd count does not match vector count"));
                }
                // Only eventfds: anything else (a pipe, /dev/null, a file) would have the
                // device write into it, and may block or fail on every interrupt. Every fd is
                // checked before any vector changes. Their flags stay as the client set them
                // (`Interrupts` never blocks on a blocking eventfd).
                for (i, fd) in (set.start..).zip(&fds) {
                    let kind = fd_kind(fd);
                    if !kind.as_ref().is_ok_and(|k| k.as_os_str() == EVENTFD_LINK) {
                        if bad_fds.allow() {
                            let cause = match &kind {
                                Ok(k) => format!("the file is {}", k.display()),
                                Err(e) => format!("cannot tell what the file is: {e}"),
                            };
                            tracing::warn!(
                                index = set.index,
                                vector = i,
                                cause,
                                "SET_IRQS refused a file that is not an eventfd"
                            );
                        }
                        return Err(invalid("interrupt file descriptor is not an eventfd"));
                    }
                }
                fds.into_iter().map(|fd| Some(File::from(fd))).collect()
            };
            // A device that delivers its interrupts itself gets them first: if it refuses,
            // nothing has changed. The server keeps its own copy for a successor.
            if let Some(router) = dev.irq_router() {
                let refs: Vec<Option<&File>> = files.iter().map(Option::as_ref).collect();
                router.route(set.index, set.start, &refs)?;
            }
            irqs.set_triggers(set.index, set.start, files)
                .map_err(DeviceError::from)?;
            tracing::debug!(
                index = set.index,
                start = set.start,
                count = set.count,
                "eventfds set"
            );
        }
        (IrqAction::Trigger, IrqData::None) => {
            let index =
                IrqIndex::from_raw(set.index).ok_or_else(|| invalid("no such interrupt index"))?;
            for v in set.start..set.start + set.count {
                irqs.trigger(index, v).map_err(DeviceError::from)?;
            }
        }
        (IrqAction::Trigger, IrqData::Bool(bools)) => {
            let index =
                IrqIndex::from_raw(set.index).ok_or_else(|| invalid("no such interrupt index"))?;
            for (v, &b) in (set.start..set.start + set.count).zip(bools) {
                if b != 0 {
                    irqs.trigger(index, v).map_err(DeviceError::from)?;
                }
            }
        }
        (IrqAction::Mask | IrqAction::Unmask, IrqData::None) => {
            let masked = set.action == IrqAction::Mask;
            irqs.set_masked(set.index, set.start, set.count, masked, None)
                .map_err(DeviceError::from)?;
        }
        (IrqAction::Mask | IrqAction::Unmask, IrqData::Bool(bools)) => {
            let masked = set.action == IrqAction::Mask;
            irqs.set_masked(set.index, set.start, set.count, masked, Some(bools))
                .map_err(DeviceError::from)?;
        }
        (IrqAction::Mask | IrqAction::Unmask, IrqData::Eventfd) => {
            return Err(RequestError::Invalid {
                what: "mask/unmask eventfds are not supported",
                errno: libc::ENOTSUP,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
