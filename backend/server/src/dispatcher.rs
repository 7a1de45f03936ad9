//! The request handling of one connection, independent of how bytes arrive: a [`Dispatcher`]
//! takes a framed message, decodes it, dispatches it to the DMA space / interrupt table /
//! device model, and builds the reply (bytes and descriptors) in its own reused buffers. It
//! holds no socket; the caller sends the reply (see `dispatch::serve_connection`).
//!
//! One handler per command, grouped by family; one `match` on the decoded request
//! (`Dispatcher::request`) picks it:
//!
//! | module | commands |
//! |---|---|
//! | `version` | VERSION, and a replaced process's session resumed |
//! | `dma` | DMA_MAP, DMA_UNMAP |
//! | `device` | DEVICE_GET_INFO, DEVICE_GET_REGION_INFO, DEVICE_GET_REGION_IO_FDS, REGION_READ, REGION_WRITE, REGION_WRITE_MULTI, DEVICE_RESET |
//! | `irqs` | DEVICE_GET_IRQ_INFO, DEVICE_SET_IRQS |
//! | `feature` | DEVICE_FEATURE (probes, MIGRATION, MIG_DEVICE_STATE), MIG_DATA_READ, MIG_DATA_WRITE |
//! | `dirty` | DEVICE_FEATURE DMA_LOGGING_START, _STOP, _REPORT |

mod device;
mod dirty;
mod dma;
mod feature;
mod irqs;
mod version;

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use switchyard_device::ratelimit::{LOG_INTERVAL, LogLimiter};
use switchyard_proto::{
    Capabilities, DeviceFeatureHeader, DeviceFeatureReply, FeatureReply, Header, Limits,
    ProtoError, Reply, Request, ServerLimits, encode_error_reply,
};

use crate::client_dma::{ClientDma, Routed};
use crate::continuity::Continuity;
use crate::error::{RequestError, invalid};
use crate::framer::{FdRefusal, Message};
use crate::{DeviceSlot, Slot};

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
    /// What DMA dirty logging offers ([`crate::DirtyLog`]).
    dirty_log: crate::DirtyLog,
    /// Whether the client may migrate mapped memory itself ([`crate::MappedMigration`]).
    mapped_migration: crate::MappedMigration,
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
            dirty_log: crate::DirtyLog::On,
            mapped_migration: crate::MappedMigration::On,
        }
    }

    /// Offers DMA dirty logging as `mode` says.
    pub(crate) fn set_dirty_log(&mut self, mode: crate::DirtyLog) {
        self.dirty_log = mode;
    }

    /// Lets the client migrate mapped memory itself as `mode` says.
    pub(crate) fn set_mapped_migration(&mut self, mode: crate::MappedMigration) {
        self.mapped_migration = mode;
    }

    /// Publishes tables and session into `continuity` from now on.
    pub(crate) fn set_continuity(&mut self, continuity: Option<Arc<Continuity>>) {
        self.continuity = continuity;
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
            let refusal = msg.fds_refused.unwrap_or(FdRefusal::Truncated);
            return Err(RequestError::Invalid {
                what: match refusal {
                    FdRefusal::Truncated | FdRefusal::TooMany => {
                        "the kernel dropped descriptors sent with the message (open-file limit, or too many)"
                    }
                    FdRefusal::Kind => {
                        "the message carried a descriptor of a kind it cannot carry (socket, pipe, device, directory, or memory where an eventfd goes)"
                    }
                    FdRefusal::Busy => {
                        "custody cannot take the message's descriptors now (the supervisor is behind); try again"
                    }
                },
                errno: refusal.errno(msg.fds.len()),
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
        let ctx = device_slot.context();
        let mut guard = device_slot.lock();
        let slot: &mut Slot = &mut guard;
        match req {
            Request::RegionRead {
                offset,
                region,
                count,
            } => self.region_read(&mut *slot.device, id, offset, region, count),
            Request::RegionWrite {
                offset,
                region,
                data,
            } => self.region_write(&mut *slot.device, id, offset, region, data),
            Request::Version(v) => self.version(device_slot, id, v),
            Request::DmaMap(m) => self.dma_map(&ctx.dma, id, m, msg.fds, &msg.fd_ids),
            Request::DmaUnmap { unmap, bitmap } => self.dma_unmap(&ctx.dma, id, unmap, bitmap),
            Request::DeviceGetInfo { .. } => self.device_get_info(&*slot.device, id),
            Request::DeviceGetRegionInfo { argsz, index } => {
                self.device_get_region_info(&*slot.device, id, argsz, index)
            }
            Request::DeviceGetRegionIoFds { index, .. } => {
                self.device_get_region_io_fds(&*slot.device, id, index)
            }
            Request::DeviceGetIrqInfo { index, .. } => {
                self.device_get_irq_info(&*slot.device, id, index)
            }
            Request::DeviceSetIrqs(set) => {
                self.device_set_irqs(&mut *slot.device, &ctx.irqs, id, set, msg.fds, &msg.fd_ids)
            }
            Request::DeviceReset => self.device_reset(slot, id),
            Request::RegionWriteMulti(entries) => {
                self.region_write_multi(&mut *slot.device, id, entries)
            }
            Request::DeviceFeature(f) => self.device_feature(slot, &ctx.dma, id, f.argsz, f.op),
            Request::GetPrecopyInfo { .. } => self.get_precopy_info(slot, id),
            Request::MigDataRead { size, .. } => self.mig_data_read(slot, id, size),
            Request::MigDataWrite { data, .. } => self.mig_data_write(slot, id, data),
            Request::DmaRead { .. } | Request::DmaWrite { .. } => {
                // Rejected by the decoder's direction check; kept for exhaustiveness.
                Err(invalid("server-to-client command sent by the client"))
            }
        }
    }
}

/// Encodes `r`, a reply without data of the server's own to fill.
fn reply_empty(out: &mut Vec<u8>, id: u16, r: Reply<'_>) -> Result<(), RequestError> {
    r.encode(id, out)?;
    Ok(())
}

/// Encodes a DEVICE_FEATURE reply carrying `op`.
fn feature_reply(out: &mut Vec<u8>, id: u16, op: FeatureReply<'_>) -> Result<(), RequestError> {
    let argsz = (DeviceFeatureHeader::SIZE + op.data_len()) as u32;
    reply_empty(
        out,
        id,
        Reply::DeviceFeature(DeviceFeatureReply { argsz, op }),
    )
}

#[cfg(test)]
mod tests;
