//! The sans-IO half of the transport (re-exported from [`crate::transport`]): [`Framer`] turns the bytes and descriptors of each read
//! into messages, and keeps (and resumes from) the receive journal. No socket here: the
//! connection (or a test) does the reads.

use std::io;
use std::os::fd::OwnedFd;

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
    /// Why the message's descriptors were not taken, if they were not: `fds_truncated` is
    /// then set too, and the message must be refused with [`FdRefusal::errno`].
    pub fds_refused: Option<FdRefusal>,
}

/// Why the descriptors of a read were not taken; the message they came with is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FdRefusal {
    /// The kernel dropped some (`MSG_CTRUNC`), or the client's custody budget is spent:
    /// `EMFILE` (`E2BIG` when the read was full).
    Truncated,
    /// The kernel dropped some of a read that came with as many as a read takes
    /// ([`MAX_FDS_PER_READ`]): the message carried more than any may: `E2BIG`.
    TooMany,
    /// A descriptor of a kind the message cannot carry ([`crate::fd_kind`]): `EINVAL`.
    Kind,
    /// Custody cannot take them now (the queue to the supervisor is full): `EAGAIN`, the
    /// client may send the message again.
    Busy,
}

impl FdRefusal {
    /// The errno the message is refused with; `fds`: descriptors the message got.
    pub fn errno(self, fds: usize) -> i32 {
        match self {
            FdRefusal::Truncated if fds >= MAX_FDS_PER_READ => libc::E2BIG,
            FdRefusal::Truncated => libc::EMFILE,
            FdRefusal::TooMany => libc::E2BIG,
            FdRefusal::Kind => libc::EINVAL,
            FdRefusal::Busy => libc::EAGAIN,
        }
    }

    /// Its code in the receive journal (0 is none: a journal of an earlier release wrote
    /// 0 or 1, and 1 is still [`FdRefusal::Truncated`]).
    fn code(r: Option<FdRefusal>) -> u8 {
        match r {
            None => 0,
            Some(FdRefusal::Truncated) => 1,
            Some(FdRefusal::Kind) => 2,
            Some(FdRefusal::Busy) => 3,
            Some(FdRefusal::TooMany) => 4,
        }
    }

    fn from_code(c: u8) -> Option<FdRefusal> {
        match c {
            0 => None,
            2 => Some(FdRefusal::Kind),
            3 => Some(FdRefusal::Busy),
            4 => Some(FdRefusal::TooMany),
            _ => Some(FdRefusal::Truncated),
        }
    }
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
    pending_trunc: Option<FdRefusal>,
    fds_from: usize,
    fds_to: usize,
    max_msg_size: u32,
}

#[derive(Debug, Clone)]
struct InFlight {
    start: usize,
    ids: Vec<u64>,
    truncated: Option<FdRefusal>,
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
            pending_trunc: None,
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
        self.filled_refused(n, fds, ids, truncated.then_some(FdRefusal::Truncated));
    }

    /// [`Framer::filled_with_ids`] with the reason the read's descriptors were not all
    /// taken, if they were not (the message they belong to is refused; `fds` and `ids` are
    /// then what was taken, usually none).
    pub fn filled_refused(
        &mut self,
        n: usize,
        fds: impl IntoIterator<Item = OwnedFd>,
        ids: &[u64],
        refused: Option<FdRefusal>,
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
        if refused.is_some() {
            // Whatever arrived is incomplete: the message it belongs to is refused.
            if !got_fds {
                self.pending_fds.clear();
                self.drop_pending_ids();
            }
            self.pending_trunc = refused;
            got_fds = true;
        }
        if got_fds {
            self.fds_from = read_from;
            self.fds_to = read_from + n;
        }
        self.end = (self.end + n).min(self.buf.len());
    }

    /// The command of the message that will claim the descriptors of a read of `n` bytes,
    /// now in [`Framer::buffer_mut`] and not yet [`Framer::filled`]: the last message that
    /// starts within the read. `None` when that is not known yet (the read ends before a
    /// whole header, or a header is invalid).
    pub fn claimant(&self, n: usize) -> Option<u16> {
        let (from, to) = (self.end, (self.end + n).min(self.buf.len()));
        let mut at = self.start;
        let mut cmd = None;
        while at < to {
            if at + HEADER_SIZE > to {
                return None;
            }
            let h = Header::from_bytes(self.buf.get(at..at + HEADER_SIZE)?).ok()?;
            if at >= from {
                cmd = Some(h.cmd);
            }
            at += HEADER_SIZE + h.body_len_within(self.max_msg_size).ok()?;
        }
        cmd
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
        let (fds, fd_ids, fds_refused) = self.take_fds(msg_start, msg_end);
        self.in_flight = Some(InFlight {
            start: msg_start,
            ids: fd_ids.clone(),
            truncated: fds_refused,
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
            fds_truncated: fds_refused.is_some(),
            fds_refused,
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
        let (inflight, ids, trunc): (&[u8], &[u64], Option<FdRefusal>) = match &self.in_flight {
            Some(f) => (
                self.buf.get(f.start..self.start).unwrap_or(&[]),
                &f.ids,
                f.truncated,
            ),
            None => (&[], &[], None),
        };
        let rest = self.buf.get(rest_from..self.end).unwrap_or(&[]);
        let rel = |x: usize| x.saturating_sub(rest_from).min(rest.len()) as u32;
        out.extend_from_slice(&JOURNAL_VERSION.to_le_bytes());
        out.extend_from_slice(&self.unconsumed.to_le_bytes());
        out.extend_from_slice(&(inflight.len() as u32).to_le_bytes());
        out.push(FdRefusal::code(trunc));
        out.extend_from_slice(&(ids.len() as u32).to_le_bytes());
        ids.iter()
            .for_each(|i| out.extend_from_slice(&i.to_le_bytes()));
        out.extend_from_slice(&(rest.len() as u32).to_le_bytes());
        out.extend_from_slice(&rel(self.fds_from).to_le_bytes());
        out.extend_from_slice(&rel(self.fds_to).to_le_bytes());
        out.push(FdRefusal::code(self.pending_trunc));
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
        let inflight_trunc = FdRefusal::from_code(r.u8().ok_or_else(bad)?);
        let inflight_ids = r.ids().ok_or_else(bad)?;
        let rest_len = r.u32().ok_or_else(bad)? as usize;
        let fds_from = r.u32().ok_or_else(bad)? as usize;
        let fds_to = r.u32().ok_or_else(bad)? as usize;
        let pending_trunc = FdRefusal::from_code(r.u8().ok_or_else(bad)?);
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
        let mut feed = |f: &mut Framer, bytes: &[u8], ids: &[u64], trunc: Option<FdRefusal>| {
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
            f.filled_refused(n, fds, ids, trunc.or(lost.then_some(FdRefusal::Truncated)));
        };
        if !inflight.is_empty() {
            feed(&mut f, inflight, &inflight_ids, inflight_trunc);
        }
        let (before, with_fds, after) =
            (&rest[..fds_from], &rest[fds_from..fds_to], &rest[fds_to..]);
        if !before.is_empty() {
            feed(&mut f, before, &[], None);
        }
        if !with_fds.is_empty() || !pending_ids.is_empty() || pending_trunc.is_some() {
            feed(&mut f, with_fds, &pending_ids, pending_trunc);
        }
        if !after.is_empty() {
            feed(&mut f, after, &[], None);
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
    fn take_fds(
        &mut self,
        msg_start: usize,
        msg_end: usize,
    ) -> (Vec<OwnedFd>, Vec<u64>, Option<FdRefusal>) {
        if self.pending_fds.is_empty() && self.pending_trunc.is_none() {
            return (Vec::new(), Vec::new(), None);
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
            self.pending_trunc = None;
        }
        (Vec::new(), Vec::new(), None)
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
