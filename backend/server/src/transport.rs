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
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

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
    /// The kernel dropped descriptors sent with this message (`MSG_CTRUNC`: this process is
    /// at its open-file limit, or the client sent more than [`MAX_FDS_PER_READ`]). `fds` is
    /// then incomplete and the message must be refused, never reinterpreted.
    pub fds_truncated: bool,
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
    /// The last read that carried descriptors lost some (`MSG_CTRUNC`).
    pending_trunc: bool,
    fds_from: usize,
    fds_to: usize,
    max_msg_size: u32,
}

impl Framer {
    /// A framer for messages of at most `max_msg_size` bytes (header included).
    pub fn new(max_msg_size: u32) -> Self {
        Self {
            buf: vec![0; max_msg_size as usize],
            start: 0,
            end: 0,
            pending_fds: Vec::with_capacity(MAX_FDS_PER_READ),
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
            got_fds = true;
            self.pending_fds.push(fd);
        }
        if truncated {
            // Whatever arrived is incomplete: the message it belongs to is refused.
            if !got_fds {
                self.pending_fds.clear();
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

    /// Whether a complete message is buffered. If not, room is made for the next read.
    ///
    /// A header whose size is invalid makes the stream impossible to frame: it is reported as
    /// [`TransportError::BadHeader`] (the only error of the framer).
    pub fn ready(&mut self) -> Result<bool, TransportError> {
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
        let (fds, fds_truncated) = self.take_fds(msg_start, msg_end);
        let body = self
            .buf
            .get(msg_start + HEADER_SIZE..msg_end)
            .unwrap_or(&[]);
        Ok(Some(Message {
            header,
            body,
            fds,
            fds_truncated,
        }))
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
    fn take_fds(&mut self, msg_start: usize, msg_end: usize) -> (Vec<OwnedFd>, bool) {
        if self.pending_fds.is_empty() && !self.pending_trunc {
            return (Vec::new(), false);
        }
        let starts_in_read = msg_start >= self.fds_from && msg_start < self.fds_to;
        let last_in_read = msg_end >= self.fds_to;
        if starts_in_read && last_in_read {
            let trunc = std::mem::take(&mut self.pending_trunc);
            return (std::mem::take(&mut self.pending_fds), trunc);
        }
        if msg_start >= self.fds_to {
            // Should not happen: a message after the read that carried them. Drop them rather
            // than hand them to the wrong message.
            tracing::warn!(
                count = self.pending_fds.len(),
                "dropping unattributable descriptors"
            );
            self.pending_fds.clear();
            self.pending_trunc = false;
        }
        (Vec::new(), false)
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
}
