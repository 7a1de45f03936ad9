//! Message framing over a vfio-user stream socket, with SCM_RIGHTS fd passing (the socket
//! calls are `switchyard-endpoint`'s; replies are sent with its `send_bounded`).
//!
//! The framing is sans-IO ([`Framer`]): fed the bytes and descriptors of each read, it returns
//! complete messages, so any loop that reads a socket can use it; [`Connection`] is the
//! blocking one. Receiving is done with one `recvmsg` into a per-connection buffer that is
//! allocated once; a read may return several pipelined messages, which are then parsed without
//! further system calls. File descriptors arrive with the bytes of the message whose `sendmsg` carried them.
//! Linux stops a stream `recvmsg` right after the segment that carried descriptors, so the
//! descriptors of one read belong to the last message that *starts* within that read's bytes;
//! that is how they are attributed here.
//!
//! Optional adaptive polling: before blocking, the receiver retries a non-blocking `recvmsg` for
//! a bounded time, so a client that sends its next request quickly never waits for the server
//! thread to be woken up.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::continuity::Continuity;

use switchyard_proto::Header;
use switchyard_proto::consts::HEADER_SIZE;

/// Most descriptors accepted with one read (QEMU sends at most 16 per message).
pub const MAX_FDS_PER_READ: usize = 32;

/// Errors of the transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer closed the connection cleanly between messages.
    #[error("Peer closed the connection")]
    Closed,
    /// The peer closed the connection in the middle of a message.
    #[error("Peer closed the connection in the middle of a message")]
    Truncated,
    /// A header announced a message that cannot be valid (too small or too large): the stream
    /// cannot be framed any more. The header is kept so an error reply can still be sent.
    #[error("Invalid message header")]
    BadHeader(Option<Header>, #[source] switchyard_proto::ProtoError),
    /// The socket failed.
    #[error("Socket I/O failed")]
    Io(#[from] io::Error),
    /// A receive journal (see [`Framer::journal`]) does not decode.
    #[error("The receive journal is malformed")]
    Journal,
}

/// One received message: header, body (borrowed from the receive buffer) and descriptors.
#[derive(Debug)]
pub struct Message<'a> {
    /// The parsed header.
    pub header: Header,
    /// The payload after the header.
    pub body: &'a [u8],
    /// Descriptors that came with it.
    pub fds: Vec<OwnedFd>,
    /// Their custody ids, when the connection keeps its descriptors in custody
    /// ([`crate::continuity`]); empty otherwise.
    pub fd_ids: Vec<u64>,
    /// The kernel dropped descriptors sent with this message (`MSG_CTRUNC`: this process is
    /// at its open-file limit, or the client sent more than [`MAX_FDS_PER_READ`]). `fds` is
    /// then incomplete and the message must be refused, never reinterpreted.
    pub fds_truncated: bool,
}

/// Version of the [`Framer::journal`] encoding.
const JOURNAL_VERSION: u32 = 1;

struct JournalReader<'a> {
    b: &'a [u8],
}

impl<'a> JournalReader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, tail) = self.b.split_at_checked(n)?;
        self.b = tail;
        Some(head)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }
    fn ids(&mut self) -> Option<Vec<u64>> {
        let n = self.u32()? as usize;
        if n > 2 * MAX_FDS_PER_READ {
            return None;
        }
        (0..n)
            .map(|_| self.take(8)?.try_into().ok().map(u64::from_le_bytes))
            .collect()
    }
}

/// Sans-IO framing of a vfio-user stream: the caller reads into [`Framer::buffer_mut`],
/// reports the read with [`Framer::filled`] (bytes, descriptors, `MSG_CTRUNC`), and takes the
/// complete messages with [`Framer::next_message`]. The buffer is allocated once; descriptors are
/// attributed to the last message that starts within the read that carried them.
#[derive(Debug)]
pub struct Framer {
    buf: Vec<u8>,
    start: usize,
    end: usize,
    /// Descriptors of the last read and the buffer offsets `[from, to)` that read covered.
    pending_fds: Vec<OwnedFd>,
    /// Custody ids of `pending_fds` (empty without custody).
    pending_ids: Vec<u64>,
    /// Custody ids of descriptors this framer dropped unclaimed: no message will settle
    /// them, so the connection settles them ([`Framer::take_dropped_ids`]).
    dropped_ids: Vec<u64>,
    /// The message handed out by [`Framer::next_message`] and not yet [`Framer::done`]:
    /// its offset, and its descriptors' custody ids and truncation.
    in_flight: Option<InFlight>,
    /// Bytes at the end of the buffer that were peeked from the socket and not consumed yet
    /// (recorded in the journal; see `Connection::recv_journaled`).
    unconsumed: u32,
    /// The last read that carried descriptors lost some (`MSG_CTRUNC`).
    pending_trunc: bool,
    fds_from: usize,
    fds_to: usize,
    max_msg_size: u32,
}

#[derive(Debug, Clone)]
struct InFlight {
    start: usize,
    ids: Vec<u64>,
    truncated: bool,
}

impl Framer {
    /// A framer for messages of at most `max_msg_size` bytes (header included).
    pub fn new(max_msg_size: u32) -> Self {
        Self {
            buf: vec![0; max_msg_size as usize],
            start: 0,
            end: 0,
            pending_fds: Vec::with_capacity(MAX_FDS_PER_READ),
            pending_ids: Vec::new(),
            dropped_ids: Vec::new(),
            in_flight: None,
            unconsumed: 0,
            pending_trunc: false,
            fds_from: 0,
            fds_to: 0,
            max_msg_size,
        }
    }

    /// Where the next read goes. Never empty after [`Framer::next_message`] returned `None`.
    pub fn buffer_mut(&mut self) -> &mut [u8] {
        self.buf.get_mut(self.end..).unwrap_or(&mut [])
    }

    /// `n` bytes were read into [`Framer::buffer_mut`], with `fds`; `truncated`: the kernel
    /// dropped some descriptors of that read (`MSG_CTRUNC`), and the message they belong to
    /// will say so. Read only when [`Framer::next_message`] has returned `None`: descriptors a
    /// previous read brought and no message has claimed yet are dropped (with a warning) when
    /// a new read brings descriptors.
    pub fn filled(&mut self, n: usize, fds: impl IntoIterator<Item = OwnedFd>, truncated: bool) {
        self.filled_with_ids(n, fds, &[], truncated);
    }

    /// [`Framer::filled`] for a connection whose descriptors are in custody: `ids[i]` is the
    /// custody id of the `i`-th descriptor (the message that claims them gets them in
    /// [`Message::fd_ids`]).
    pub fn filled_with_ids(
        &mut self,
        n: usize,
        fds: impl IntoIterator<Item = OwnedFd>,
        ids: &[u64],
        truncated: bool,
    ) {
        let read_from = self.end;
        let mut got_fds = false;
        for fd in fds {
            if !got_fds && !self.pending_fds.is_empty() {
                tracing::warn!(
                    count = self.pending_fds.len(),
                    "dropping unclaimed descriptors"
                );
                self.pending_fds.clear();
            }
            if !got_fds {
                self.drop_pending_ids();
            }
            got_fds = true;
            self.pending_fds.push(fd);
        }
        self.pending_ids.extend_from_slice(ids);
        if truncated {
            // Whatever arrived is incomplete: the message it belongs to is refused.
            if !got_fds {
                self.pending_fds.clear();
                self.drop_pending_ids();
            }
            self.pending_trunc = true;
            got_fds = true;
        }
        if got_fds {
            self.fds_from = read_from;
            self.fds_to = read_from + n;
        }
        self.end = (self.end + n).min(self.buf.len());
    }

    /// Bytes of a message not complete yet (zero: the stream is between messages).
    pub fn partial(&self) -> usize {
        self.end - self.start
    }

    /// Whether a complete message is buffered. If not, room is made for the next read. The
    /// message last returned by [`Framer::next_message`] is done from here on.
    ///
    /// A header whose size is invalid makes the stream impossible to frame: it is reported as
    /// [`TransportError::BadHeader`] (the only error of the framer).
    pub fn ready(&mut self) -> Result<bool, TransportError> {
        // Looking for the next message means the last one is done; only then may the buffer
        // move (the journal refers to the bytes of the message in flight).
        self.in_flight = None;
        let avail = self.end - self.start;
        if avail >= HEADER_SIZE {
            let total = HEADER_SIZE + self.header()?.1;
            if avail >= total {
                return Ok(true);
            }
            // Incomplete: make room for the rest.
            if self.start + total > self.buf.len() {
                self.compact();
            }
        } else if self.start > 0 && self.start == self.end {
            self.start = 0;
            self.end = 0;
        } else if self.buf.len() - self.end < HEADER_SIZE {
            self.compact();
        }
        Ok(false)
    }

    /// The next complete message, if one is buffered (see [`Framer::ready`]).
    pub fn next_message(&mut self) -> Result<Option<Message<'_>>, TransportError> {
        if !self.ready()? {
            return Ok(None);
        }
        let (header, body_len) = self.header()?;
        let msg_start = self.start;
        let msg_end = msg_start + HEADER_SIZE + body_len;
        self.start = msg_end;
        let (fds, fd_ids, fds_truncated) = self.take_fds(msg_start, msg_end);
        self.in_flight = Some(InFlight {
            start: msg_start,
            ids: fd_ids.clone(),
            truncated: fds_truncated,
        });
        let body = self
            .buf
            .get(msg_start + HEADER_SIZE..msg_end)
            .unwrap_or(&[]);
        Ok(Some(Message {
            header,
            body,
            fds,
            fd_ids,
            fds_truncated,
        }))
    }

    /// The message last returned by [`Framer::next_message`] has been answered (or needs no
    /// answer): it leaves the [journal](Framer::journal).
    pub fn done(&mut self) {
        self.in_flight = None;
    }

    /// Everything a replacement process needs to frame the rest of this stream exactly as this
    /// framer would: the bytes of the message in flight (not yet [`Framer::done`]) and of
    /// everything received after it, with the custody ids of the descriptors that came with
    /// them and the read boundaries that decide which message gets them. Encoded into `out`
    /// (cleared first); [`Framer::resume`] decodes it.
    pub fn journal(&self, out: &mut Vec<u8>) {
        out.clear();
        let rest_from = self.start;
        let (inflight, ids, trunc): (&[u8], &[u64], bool) = match &self.in_flight {
            Some(f) => (
                self.buf.get(f.start..self.start).unwrap_or(&[]),
                &f.ids,
                f.truncated,
            ),
            None => (&[], &[], false),
        };
        let rest = self.buf.get(rest_from..self.end).unwrap_or(&[]);
        let rel = |x: usize| x.saturating_sub(rest_from).min(rest.len()) as u32;
        out.extend_from_slice(&JOURNAL_VERSION.to_le_bytes());
        out.extend_from_slice(&self.unconsumed.to_le_bytes());
        out.extend_from_slice(&(inflight.len() as u32).to_le_bytes());
        out.push(u8::from(trunc));
        out.extend_from_slice(&(ids.len() as u32).to_le_bytes());
        ids.iter()
            .for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
        out.extend_from_slice(&(rest.len() as u32).to_le_bytes());
        out.extend_from_slice(&rel(self.fds_from).to_le_bytes());
        out.extend_from_slice(&rel(self.fds_to).to_le_bytes());
        out.push(u8::from(self.pending_trunc));
        out.extend_from_slice(&(self.pending_ids.len() as u32).to_le_bytes());
        self.pending_ids
            .iter()
            .for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
        out.extend_from_slice(inflight);
        out.extend_from_slice(rest);
    }

    /// A framer that continues a stream from a [`Framer::journal`]: the message that was in
    /// flight comes first (with its descriptors), then the rest, split at the same read
    /// boundaries. `fd` gives the descriptor held in custody under an id (`None`: it is
    /// lost, and the message that claims it is marked truncated, so it is refused).
    pub fn resume(
        max_msg_size: u32,
        journal: &[u8],
        mut fd: impl FnMut(u64) -> Option<OwnedFd>,
    ) -> Result<Framer, TransportError> {
        let bad = || TransportError::Journal;
        let mut r = JournalReader { b: journal };
        if r.u32().ok_or_else(bad)? != JOURNAL_VERSION {
            return Err(bad());
        }
        let unconsumed = r.u32().ok_or_else(bad)?;
        let inflight_len = r.u32().ok_or_else(bad)? as usize;
        let inflight_trunc = r.u8().ok_or_else(bad)? != 0;
        let inflight_ids = r.ids().ok_or_else(bad)?;
        let rest_len = r.u32().ok_or_else(bad)? as usize;
        let fds_from = r.u32().ok_or_else(bad)? as usize;
        let fds_to = r.u32().ok_or_else(bad)? as usize;
        let pending_trunc = r.u8().ok_or_else(bad)? != 0;
        let pending_ids = r.ids().ok_or_else(bad)?;
        let inflight = r.take(inflight_len).ok_or_else(bad)?;
        let rest = r.take(rest_len).ok_or_else(bad)?;
        if !r.b.is_empty()
            || inflight_len + rest_len > max_msg_size as usize
            || fds_from > fds_to
            || fds_to > rest_len
        {
            return Err(bad());
        }
        let mut f = Framer::new(max_msg_size);
        let mut feed = |f: &mut Framer, bytes: &[u8], ids: &[u64], trunc: bool| {
            let mut fds = Vec::with_capacity(ids.len());
            let mut lost = false;
            for &id in ids {
                match fd(id) {
                    Some(d) => fds.push(d),
                    None => lost = true,
                }
            }
            let room = f.buffer_mut();
            let n = bytes.len().min(room.len());
            room[..n].copy_from_slice(&bytes[..n]);
            f.filled_with_ids(n, fds, ids, trunc || lost);
        };
        if !inflight.is_empty() {
            feed(&mut f, inflight, &inflight_ids, inflight_trunc);
        }
        let (before, with_fds, after) =
            (&rest[..fds_from], &rest[fds_from..fds_to], &rest[fds_to..]);
        if !before.is_empty() {
            feed(&mut f, before, &[], false);
        }
        if !with_fds.is_empty() || !pending_ids.is_empty() || pending_trunc {
            feed(&mut f, with_fds, &pending_ids, pending_trunc);
        }
        if !after.is_empty() {
            feed(&mut f, after, &[], false);
        }
        f.unconsumed = unconsumed;
        Ok(f)
    }

    /// Custody ids of the descriptors this framer holds for messages not handled yet (the
    /// message in flight's and those of the last read), one per descriptor.
    pub fn held_ids(&self) -> Vec<u64> {
        self.in_flight
            .iter()
            .flat_map(|f| f.ids.iter().copied())
            .chain(self.pending_ids.iter().copied())
            .collect()
    }

    /// Message ids and commands of the complete messages buffered (for logs).
    pub fn buffered_ids(&self) -> Vec<(u16, u16)> {
        let mut out = Vec::new();
        let mut at = self.start;
        while let Some(h) = self.buf.get(at..at + HEADER_SIZE) {
            let Ok(header) = Header::from_bytes(h) else {
                break;
            };
            let Ok(len) = header.body_len_within(self.max_msg_size) else {
                break;
            };
            if at + HEADER_SIZE + len > self.end {
                break;
            }
            out.push((header.msg_id, header.cmd));
            at += HEADER_SIZE + len;
        }
        out
    }

    /// Sets how many bytes at the end of the buffer are still in the socket (peeked, not
    /// consumed); recorded by [`Framer::journal`].
    pub fn set_unconsumed(&mut self, n: usize) {
        self.unconsumed = u32::try_from(n).unwrap_or(u32::MAX);
    }

    /// See [`Framer::set_unconsumed`]; for a framer from [`Framer::resume`], what the journal
    /// said.
    pub fn unconsumed(&self) -> usize {
        self.unconsumed as usize
    }

    /// The header at `start` (at least [`HEADER_SIZE`] bytes are buffered) and its body length.
    fn header(&self) -> Result<(Header, usize), TransportError> {
        let hbytes = self
            .buf
            .get(self.start..self.start + HEADER_SIZE)
            .unwrap_or(&[]);
        let header = Header::from_bytes(hbytes).map_err(|e| TransportError::BadHeader(None, e))?;
        let body_len = header
            .body_len_within(self.max_msg_size)
            .map_err(|e| TransportError::BadHeader(Some(header), e))?;
        Ok((header, body_len))
    }

    /// Descriptors belong to the last message that starts inside the read that carried them
    /// (and so does the news that some were truncated).
    fn take_fds(&mut self, msg_start: usize, msg_end: usize) -> (Vec<OwnedFd>, Vec<u64>, bool) {
        if self.pending_fds.is_empty() && !self.pending_trunc {
            return (Vec::new(), Vec::new(), false);
        }
        let starts_in_read = msg_start >= self.fds_from && msg_start < self.fds_to;
        let last_in_read = msg_end >= self.fds_to;
        if starts_in_read && last_in_read {
            let trunc = std::mem::take(&mut self.pending_trunc);
            return (
                std::mem::take(&mut self.pending_fds),
                std::mem::take(&mut self.pending_ids),
                trunc,
            );
        }
        if msg_start >= self.fds_to {
            // Should not happen: a message after the read that carried them. Drop them rather
            // than hand them to the wrong message.
            tracing::warn!(
                count = self.pending_fds.len(),
                "dropping unattributable descriptors"
            );
            self.pending_fds.clear();
            self.drop_pending_ids();
            self.pending_trunc = false;
        }
        (Vec::new(), Vec::new(), false)
    }

    fn drop_pending_ids(&mut self) {
        self.dropped_ids.append(&mut self.pending_ids);
    }

    /// Custody ids of descriptors dropped unclaimed since the last call (see
    /// [`Framer::filled`]): the journal no longer names them.
    pub fn take_dropped_ids(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.dropped_ids)
    }

    fn compact(&mut self) {
        let len = self.end - self.start;
        self.buf.copy_within(self.start..self.end, 0);
        self.fds_from = self.fds_from.saturating_sub(self.start);
        self.fds_to = self.fds_to.saturating_sub(self.start);
        self.start = 0;
        self.end = len;
    }
}

/// A framed vfio-user connection: a [`Framer`] fed by `recvmsg` on the stream.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    framer: Framer,
    /// Descriptors of the read in progress, handed to the framer (allocated once).
    read_fds: Vec<OwnedFd>,
    spin: Duration,
    /// Crash continuity: descriptors go into custody as they arrive, and the receive journal
    /// is published after every read and every answered message.
    continuity: Option<Arc<Continuity>>,
}

impl Connection {
    /// Wraps a connected stream. `max_msg_size` bounds a whole message (header included);
    /// `spin` is the adaptive polling budget (zero disables it).
    pub fn new(stream: UnixStream, max_msg_size: u32, spin: Duration) -> Self {
        Self {
            stream,
            framer: Framer::new(max_msg_size),
            read_fds: Vec::with_capacity(MAX_FDS_PER_READ),
            spin,
            continuity: None,
        }
    }

    /// A connection that continues where a replaced process stopped: `framer` comes from
    /// [`Framer::resume`].
    pub(crate) fn resumed(stream: UnixStream, framer: Framer, spin: Duration) -> Self {
        Self {
            stream,
            framer,
            read_fds: Vec::with_capacity(MAX_FDS_PER_READ),
            spin,
            continuity: None,
        }
    }

    /// Keeps descriptors in custody and publishes the receive journal into `continuity`.
    /// Turns on the socket's peek offset (`SO_PEEK_OFF`), through which a replacement learns
    /// whether the last read was consumed (see [`Connection::recv_journaled`]).
    pub(crate) fn set_continuity(&mut self, continuity: Option<Arc<Continuity>>) {
        if continuity.is_some()
            && let Err(e) = switchyard_sys::sock::set_peek_offset(self.stream.as_fd(), 0)
        {
            tracing::warn!(error = %e, "no SO_PEEK_OFF: a restart may replay or lose the last read");
        }
        self.continuity = continuity;
    }

    /// Settles a read a killed process left half done. The socket's peek offset (`off`) says
    /// how many bytes it had peeked and not consumed; the journal (`journaled`) says how many
    /// of its own bytes were peeked and not yet known consumed. They agree (`off ==
    /// journaled`): the journal has the bytes, which leave the socket. The journal does not
    /// have them (`journaled == 0`: killed between the peek and the publish): the offset goes
    /// back to zero and they are read again. `off == 0`: nothing to do. Returns the bytes
    /// consumed.
    pub(crate) fn settle_peeked(stream: &UnixStream, journaled: usize) -> io::Result<usize> {
        let off = usize::try_from(switchyard_sys::sock::peek_offset(stream.as_fd())?).unwrap_or(0);
        if off == 0 {
            return Ok(0);
        }
        if off != journaled {
            if journaled != 0 {
                tracing::warn!(
                    off,
                    journaled,
                    "peek offset and journal disagree; reading again"
                );
            }
            switchyard_sys::sock::set_peek_offset(stream.as_fd(), 0)?;
            return Ok(0);
        }
        discard(stream, off, true)
    }

    /// The crash continuity this connection publishes into, if any.
    pub(crate) fn continuity(&self) -> Option<&Arc<Continuity>> {
        self.continuity.as_ref()
    }

    /// The framer (for the continuity's journal).
    pub(crate) fn framer(&self) -> &Framer {
        &self.framer
    }

    /// The message last received has been answered: it leaves the journal.
    pub fn done(&mut self) {
        self.framer.done();
        if let Some(c) = &self.continuity {
            c.publish_rx(&self.framer);
            let dropped = self.framer.take_dropped_ids();
            if !dropped.is_empty() {
                c.settle(&dropped);
            }
        }
    }

    /// The underlying stream (for `try_clone` / shutdown).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Receives the next complete message.
    ///
    /// A header whose size is invalid makes the connection unusable (the stream can no longer
    /// be framed): it is reported as [`TransportError::BadHeader`] after which the caller should
    /// reply with an error if it can and drop the connection.
    pub fn recv(&mut self) -> Result<Message<'_>, TransportError> {
        // Whatever came before has been answered.
        self.framer.done();
        while !self.framer.ready()? {
            self.fill()?;
        }
        // `ready` said a message is complete.
        self.framer.next_message()?.ok_or(TransportError::Truncated)
    }

    fn fill(&mut self) -> Result<(), TransportError> {
        // Adaptive polling: non-blocking reads (MSG_DONTWAIT, no fcntl round trips) until the
        // budget is spent, then one blocking read.
        let deadline = (!self.spin.is_zero()).then(|| Instant::now() + self.spin);
        loop {
            let spinning = deadline.is_some_and(|d| Instant::now() < d);
            match self.recv_once(spinning) {
                Ok(0) => {
                    return Err(if self.framer.partial() == 0 {
                        TransportError::Closed
                    } else {
                        TransportError::Truncated
                    });
                }
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && spinning => {
                    std::hint::spin_loop();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn recv_once(&mut self, dontwait: bool) -> io::Result<usize> {
        if let Some(c) = self.continuity.clone() {
            return self.recv_journaled(&c, dontwait);
        }
        let fds = &mut self.read_fds;
        fds.clear();
        let got = switchyard_endpoint::recv(
            &self.stream,
            self.framer.buffer_mut(),
            MAX_FDS_PER_READ,
            dontwait,
            |fd| fds.push(fd),
        )?;
        self.framer
            .filled(got.bytes, self.read_fds.drain(..), got.fds_truncated);
        Ok(got.bytes)
    }

    /// A read that the journal records before the socket forgets it: peek (the bytes stay in
    /// the socket), put the descriptors into custody, publish the journal, and only then
    /// consume the bytes. A kill before the publish leaves the bytes in the socket only; after
    /// it, in the journal and, until the consume, also in the socket — which the kernel's
    /// per-socket peek offset (`SO_PEEK_OFF`, shared with the supervisor's descriptor) tells
    /// the replacement, so it consumes them instead of reading them twice
    /// ([`Connection::consume_peeked`]). SIGKILL takes effect when a syscall returns, so the
    /// offset and the socket always agree.
    fn recv_journaled(&mut self, c: &Continuity, dontwait: bool) -> io::Result<usize> {
        let fds = &mut self.read_fds;
        fds.clear();
        let got = switchyard_endpoint::peek(
            &self.stream,
            self.framer.buffer_mut(),
            MAX_FDS_PER_READ,
            dontwait,
            |fd| fds.push(fd),
        )?;
        if got.bytes == 0 {
            return Ok(0);
        }
        let mut truncated = got.fds_truncated;
        let ids = if self.read_fds.is_empty() {
            Vec::new()
        } else if let Some(ids) = c.hold(&self.read_fds) {
            ids
        } else {
            // Past the client's custody budget: the descriptors are closed, never held, and
            // their message is refused as one whose descriptors the kernel dropped (EMFILE).
            self.read_fds.clear();
            truncated = true;
            Vec::new()
        };
        self.framer
            .filled_with_ids(got.bytes, self.read_fds.drain(..), &ids, truncated);
        self.framer.set_unconsumed(got.bytes);
        c.publish_rx(&self.framer);
        // Descriptors the framer dropped are no longer in the journal just published.
        let dropped = self.framer.take_dropped_ids();
        if !dropped.is_empty() {
            c.settle(&dropped);
        }
        // Consume what was peeked. The kernel installs the descriptors again: the copies from
        // the peek are the ones kept, these are closed.
        discard(&self.stream, got.bytes, false)?;
        self.framer.set_unconsumed(0);
        c.publish_rx(&self.framer);
        Ok(got.bytes)
    }
}

/// Reads and drops `n` bytes (and the descriptors that come with them) from `stream`;
/// returns how many there were (fewer at end of stream, or with `nonblocking` when the socket
/// has fewer).
fn discard(stream: &UnixStream, n: usize, nonblocking: bool) -> io::Result<usize> {
    let mut left = n;
    let mut sink = [0u8; 4096];
    while left > 0 {
        let chunk = left.min(sink.len());
        match switchyard_endpoint::recv(
            stream,
            &mut sink[..chunk],
            MAX_FDS_PER_READ,
            nonblocking,
            drop,
        ) {
            Ok(r) if r.bytes == 0 => break,
            Ok(r) => left -= r.bytes,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(n - left)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
    use switchyard_endpoint::send_all;
    use switchyard_proto::Command;

    fn msg(id: u16, body: &[u8]) -> Vec<u8> {
        let h = Header::command(id, Command::DeviceGetInfo, false, body.len()).expect("header");
        let mut v = zerocopy::IntoBytes::as_bytes(&h).to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn pipelined_messages_are_split_and_fds_attributed() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mut conn = Connection::new(b, 4096, Duration::ZERO);
        let f = memfd::MemfdOptions::default()
            .create("t")
            .expect("memfd")
            .into_file();
        // Message 1 without fds, then message 2 with one fd, then message 3 without.
        send_all(&a, &msg(1, &[0; 16]), &[]).expect("send 1");
        send_all(&a, &msg(2, &[1; 16]), &[f.as_fd()]).expect("send 2");
        send_all(&a, &msg(3, &[2; 16]), &[]).expect("send 3");
        let m1 = conn.recv().expect("m1");
        assert_eq!((m1.header.msg_id, m1.fds.len()), (1, 0));
        let m2 = conn.recv().expect("m2");
        assert_eq!((m2.header.msg_id, m2.fds.len()), (2, 1));
        assert_eq!(m2.body, &[1; 16]);
        let m3 = conn.recv().expect("m3");
        assert_eq!((m3.header.msg_id, m3.fds.len()), (3, 0));
        drop(a);
        assert!(matches!(conn.recv(), Err(TransportError::Closed)));
    }

    #[test]
    fn message_split_across_reads_and_truncation() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mut conn = Connection::new(b, 4096, Duration::from_micros(50));
        let m = msg(9, &[7; 100]);
        let t = std::thread::spawn(move || {
            send_all(&a, &m[..10], &[]).expect("part 1");
            std::thread::sleep(Duration::from_millis(20));
            send_all(&a, &m[10..], &[]).expect("part 2");
            send_all(&a, &m[..20], &[]).expect("truncated");
        });
        let got = conn.recv().expect("whole");
        assert_eq!(got.header.msg_id, 9);
        assert_eq!(got.body.len(), 100);
        t.join().expect("join");
        assert!(matches!(conn.recv(), Err(TransportError::Truncated)));
    }

    #[test]
    fn truncated_descriptors_are_reported_with_their_message() {
        // Send more descriptors than the receiver's control buffer holds.
        let (a, b) = UnixStream::pair().expect("pair");
        let mut conn = Connection::new(b, 4096, Duration::ZERO);
        let f = memfd::MemfdOptions::default()
            .create("t")
            .expect("memfd")
            .into_file();
        let many: Vec<_> = (0..MAX_FDS_PER_READ + 8).map(|_| f.as_fd()).collect();
        send_all(&a, &msg(1, &[0; 16]), &many).expect("send");
        send_all(&a, &msg(2, &[0; 16]), &[f.as_fd()]).expect("send");
        let m1 = conn.recv().expect("m1");
        assert!(
            m1.fds_truncated,
            "the kernel dropped some: the message must say so"
        );
        let m2 = conn.recv().expect("m2");
        assert!(!m2.fds_truncated);
        assert_eq!(m2.fds.len(), 1);
    }

    #[test]
    fn oversized_header_is_rejected() {
        let (a, b) = UnixStream::pair().expect("pair");
        let mut conn = Connection::new(b, 64, Duration::ZERO);
        send_all(&a, &msg(1, &[0; 100]), &[]).expect("send");
        assert!(matches!(
            conn.recv(),
            Err(TransportError::BadHeader(Some(_), _))
        ));
    }

    // The framer alone: reads simulated by copying into `buffer_mut`.

    fn feed(f: &mut Framer, bytes: &[u8], fds: Vec<OwnedFd>, truncated: bool) {
        let dst = f.buffer_mut();
        assert!(dst.len() >= bytes.len(), "room for the read");
        dst[..bytes.len()].copy_from_slice(bytes);
        f.filled(bytes.len(), fds, truncated);
    }

    fn fd() -> OwnedFd {
        memfd::MemfdOptions::default()
            .create("t")
            .expect("memfd")
            .into_file()
            .into()
    }

    #[test]
    fn framer_joins_a_message_split_across_reads() {
        let mut f = Framer::new(4096);
        let m = msg(9, &[7; 100]);
        assert!(f.next_message().expect("frame").is_none(), "nothing yet");
        for chunk in [&m[..3], &m[3..16], &m[16..50]] {
            feed(&mut f, chunk, Vec::new(), false);
            assert!(f.next_message().expect("frame").is_none(), "incomplete");
            assert!(f.partial() > 0);
        }
        feed(&mut f, &m[50..], Vec::new(), false);
        let got = f.next_message().expect("frame").expect("whole message");
        assert_eq!((got.header.msg_id, got.body), (9, &[7u8; 100][..]));
        assert!(f.next_message().expect("frame").is_none());
        assert_eq!(f.partial(), 0, "between messages");
    }

    /// Every complete message, as (id, descriptor count, truncated), until more bytes are needed.
    fn drain(f: &mut Framer) -> Vec<(u16, usize, bool)> {
        std::iter::from_fn(|| {
            f.next_message()
                .expect("frame")
                .map(|m| (m.header.msg_id, m.fds.len(), m.fds_truncated))
        })
        .collect()
    }

    #[test]
    fn framer_gives_a_reads_fds_to_the_last_message_starting_in_it() {
        let mut f = Framer::new(4096);
        // One read: message 1 whole, message 2 whole (its sendmsg carried two fds).
        let mut read = msg(1, &[0; 8]);
        read.extend(msg(2, &[1; 8]));
        feed(&mut f, &read, vec![fd(), fd()], false);
        assert_eq!(drain(&mut f), [(1, 0, false), (2, 2, false)]);
        // Next read: message 3 without fds, and the start of message 4 with one fd.
        let m4 = msg(4, &[4; 32]);
        let mut read = msg(3, &[]);
        read.extend_from_slice(&m4[..20]);
        feed(&mut f, &read, vec![fd()], false);
        assert_eq!(drain(&mut f), [(3, 0, false)]);
        feed(&mut f, &m4[20..], Vec::new(), false);
        assert_eq!(drain(&mut f), [(4, 1, false)]);
    }

    #[test]
    fn framer_reports_truncated_fds_with_their_message_only() {
        let mut f = Framer::new(4096);
        feed(&mut f, &msg(1, &[0; 16]), vec![fd()], true);
        assert_eq!(drain(&mut f), [(1, 1, true)]);
        feed(&mut f, &msg(2, &[0; 16]), vec![fd()], false);
        assert_eq!(drain(&mut f), [(2, 1, false)]);
        // Truncated with no descriptor at all (the process is out of files).
        feed(&mut f, &msg(3, &[]), Vec::new(), true);
        assert_eq!(drain(&mut f), [(3, 0, true)]);
    }

    #[test]
    fn framer_drops_descriptors_left_unclaimed_by_a_later_read() {
        let mut f = Framer::new(4096);
        // Descriptors with an incomplete message, then another read with descriptors (a
        // broken peer): the first ones cannot be told apart and are dropped, not misattributed.
        let m1 = msg(1, &[0; 16]);
        feed(&mut f, &m1[..20], vec![fd(), fd()], false);
        assert!(drain(&mut f).is_empty());
        let mut read = m1[20..].to_vec();
        read.extend(msg(2, &[]));
        feed(&mut f, &read, vec![fd()], false);
        assert_eq!(drain(&mut f), [(1, 0, false), (2, 1, false)]);
    }

    #[test]
    fn framer_compacts_to_fit_a_message_at_the_buffer_end() {
        let size = 256;
        let mut f = Framer::new(size);
        let first = msg(1, &[1; 150]);
        let second = msg(2, &[2; 200]);
        // The second message starts at byte 166: it only fits once the first is gone.
        let mut read = first.clone();
        read.extend_from_slice(&second[..40]);
        feed(&mut f, &read, vec![fd()], false);
        assert_eq!(
            f.next_message().expect("frame").expect("m1").header.msg_id,
            1
        );
        assert!(f.next_message().expect("frame").is_none());
        feed(&mut f, &second[40..], Vec::new(), false);
        let m2 = f.next_message().expect("frame").expect("m2");
        assert_eq!((m2.header.msg_id, m2.body.len()), (2, 200));
        assert_eq!(m2.fds.len(), 1, "its descriptors survive the compaction");
    }

    #[test]
    fn framer_rejects_a_header_larger_than_the_limit() {
        let mut f = Framer::new(64);
        feed(&mut f, &msg(1, &[0; 100])[..64], Vec::new(), false);
        assert!(matches!(
            f.next_message(),
            Err(TransportError::BadHeader(Some(h), _)) if h.msg_id == 1
        ));
    }

    /// What a framer yields from here on: id, body, custody ids of its descriptors (as many
    /// descriptors as ids), truncation.
    fn drain_ids(f: &mut Framer) -> Vec<(u16, Vec<u8>, Vec<u64>, bool)> {
        std::iter::from_fn(|| {
            f.next_message().expect("frame").map(|m| {
                assert_eq!(m.fds.len(), m.fd_ids.len(), "a descriptor per id");
                (
                    m.header.msg_id,
                    m.body.to_vec(),
                    m.fd_ids.clone(),
                    m.fds_truncated,
                )
            })
        })
        .collect()
    }

    /// Three reads: message 1 alone with a descriptor; the end of nothing... (see the body).
    fn scenario() -> Vec<(Vec<u8>, Vec<u64>)> {
        let m1 = msg(1, b"first");
        let m2 = msg(2, &[7u8; 100]);
        let m3 = msg(3, b"third");
        let m4 = msg(4, b"fourth, split across reads");
        let mut reads = vec![(m1, vec![100])];
        // Message 2 and the start of 3 in one read, with two descriptors (they belong to 3,
        // the last message starting in the read).
        let mut r2 = m2.clone();
        r2.extend_from_slice(&m3[..10]);
        reads.push((r2, vec![101, 102]));
        // The rest of 3 and the first half of 4.
        let mut r3 = m3[10..].to_vec();
        r3.extend_from_slice(&m4[..20]);
        reads.push((r3, vec![]));
        reads.push((m4[20..].to_vec(), vec![]));
        reads
    }

    fn feed_ids(f: &mut Framer, bytes: &[u8], ids: &[u64]) {
        let dst = f.buffer_mut();
        dst[..bytes.len()].copy_from_slice(bytes);
        let fds: Vec<OwnedFd> = ids.iter().map(|_| fd()).collect();
        f.filled_with_ids(bytes.len(), fds, ids, false);
    }

    /// Journals taken at every point of the stream (after each read, after each message
    /// handed out) resume into a framer that yields exactly what the original yields from
    /// that point, message in flight first.
    #[test]
    fn a_journal_resumes_the_stream_exactly_where_it_stopped() {
        let reads = scenario();
        // The reference: everything the stream yields.
        let mut reference = Framer::new(4096);
        let mut all = Vec::new();
        for (bytes, ids) in &reads {
            feed_ids(&mut reference, bytes, ids);
            all.extend(drain_ids(&mut reference));
        }
        assert_eq!(
            all.iter().map(|m| (m.0, m.2.clone())).collect::<Vec<_>>(),
            vec![
                (1, vec![100]),
                (2, vec![]),
                (3, vec![101, 102]),
                (4, vec![])
            ]
        );
        // As the server reads: every read is drained before the next. Stop after read r, in
        // the middle of its drain: j messages of it handed out, the j-th still in flight (or,
        // with j = 3, the drain finished and nothing in flight).
        for r in 0..reads.len() {
            for j in 0..=3 {
                let mut f = Framer::new(4096);
                let mut seen = Vec::new();
                let mut last_in_flight = false;
                for (n, (bytes, ids)) in reads[..=r].iter().enumerate() {
                    feed_ids(&mut f, bytes, ids);
                    let limit = if n == r { j } else { usize::MAX };
                    let mut handed = 0;
                    while handed < limit {
                        match f.next_message().expect("frame") {
                            Some(m) => {
                                seen.push((
                                    m.header.msg_id,
                                    m.body.to_vec(),
                                    m.fd_ids.clone(),
                                    m.fds_truncated,
                                ));
                                last_in_flight = true;
                                handed += 1;
                            }
                            None => {
                                last_in_flight = false;
                                break;
                            }
                        }
                    }
                }
                let mut journal = Vec::new();
                f.journal(&mut journal);
                let mut resumed = Framer::resume(4096, &journal, |_| Some(fd())).expect("resume");
                // The message in flight (the last handed out) comes again, then the rest.
                let answered = seen.len() - usize::from(last_in_flight);
                let mut got: Vec<_> = seen[..answered].to_vec();
                got.extend(drain_ids(&mut resumed));
                for (bytes, ids) in &reads[r + 1..] {
                    feed_ids(&mut resumed, bytes, ids);
                    got.extend(drain_ids(&mut resumed));
                }
                assert_eq!(
                    got, all,
                    "stopped after read {r}, {j} messages into its drain"
                );
            }
        }
    }

    #[test]
    fn a_journal_with_lost_descriptors_marks_their_message_truncated() {
        let reads = scenario();
        let mut f = Framer::new(4096);
        feed_ids(&mut f, &reads[0].0, &reads[0].1);
        let m = f.next_message().expect("frame").expect("message 1");
        assert_eq!(m.fd_ids, vec![100]);
        let mut journal = Vec::new();
        f.journal(&mut journal);
        let mut resumed = Framer::resume(4096, &journal, |_| None).expect("resume");
        let again = drain_ids(&mut resumed);
        assert_eq!(again.len(), 1);
        assert!(
            again[0].3,
            "refused as truncated, never reinterpreted without its fd"
        );
    }

    #[test]
    fn malformed_journals_are_refused() {
        let mut f = Framer::new(4096);
        feed_ids(&mut f, &msg(1, b"x"), &[5]);
        let mut j = Vec::new();
        f.journal(&mut j);
        for cut in 0..j.len() {
            assert!(
                matches!(
                    Framer::resume(4096, &j[..cut], |_| Some(fd())),
                    Err(TransportError::Journal)
                ),
                "cut at {cut}"
            );
        }
        let mut longer = j.clone();
        longer.push(0);
        assert!(Framer::resume(4096, &longer, |_| Some(fd())).is_err());
        assert!(
            Framer::resume(16, &j, |_| Some(fd())).is_err(),
            "larger than the buffer"
        );
        assert!(Framer::resume(4096, &j, |_| Some(fd())).is_ok());
    }

    /// The receiving half of a process killed after it peeked a message: whether it had
    /// journaled it (`journaled`) or not, the replacement's connection yields that message
    /// exactly once, then the next.
    fn killed_after_peek(journaled: bool) {
        let (mut client, server) = UnixStream::pair().expect("pair");
        switchyard_sys::sock::set_peek_offset(server.as_fd(), 0).expect("SO_PEEK_OFF");
        use std::io::Write;
        client.write_all(&msg(1, b"first")).expect("send");
        // The dead process: peeked, and (maybe) journaled, never consumed.
        let mut dead = Framer::new(4096);
        let got =
            switchyard_endpoint::peek(&server, dead.buffer_mut(), 8, false, drop).expect("peek");
        dead.filled(got.bytes, Vec::new(), false);
        dead.set_unconsumed(got.bytes);
        let mut journal = Vec::new();
        if journaled {
            dead.journal(&mut journal);
        } else {
            Framer::new(4096).journal(&mut journal);
        }
        // The replacement.
        let framer = Framer::resume(4096, &journal, |_| None).expect("resume");
        Connection::settle_peeked(&server, framer.unconsumed()).expect("settle");
        client.write_all(&msg(2, b"second")).expect("send");
        let mut conn = Connection::resumed(server, framer, Duration::ZERO);
        let ids: Vec<u16> = (0..2)
            .map(|_| conn.recv().expect("message").header.msg_id)
            .collect();
        assert_eq!(ids, vec![1, 2], "journaled: {journaled}");
    }

    #[test]
    fn a_read_peeked_and_journaled_by_a_killed_process_is_not_read_again() {
        killed_after_peek(true);
    }

    #[test]
    fn a_read_peeked_but_not_journaled_by_a_killed_process_is_read_again() {
        killed_after_peek(false);
    }
}
