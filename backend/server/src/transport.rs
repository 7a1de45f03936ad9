//! Message framing over a vfio-user stream socket, with SCM_RIGHTS fd passing.
//!
//! Receiving is done with one `recvmsg` into a per-connection buffer that is allocated once; a
//! read may return several pipelined messages, which are then parsed without further system
//! calls. File descriptors arrive with the bytes of the message whose `sendmsg` carried them.
//! Linux stops a stream `recvmsg` right after the segment that carried descriptors, so the
//! descriptors of one read belong to the last message that *starts* within that read's bytes;
//! that is how they are attributed here.
//!
//! Optional adaptive polling: before blocking, the receiver retries a non-blocking `recvmsg` for
//! a bounded time, so a client that sends its next request quickly never waits for the server
//! thread to be woken up.

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use switchyard_proto::Header;
use switchyard_proto::consts::HEADER_SIZE;

/// Most descriptors accepted with one read (QEMU sends at most 16 per message).
pub const MAX_FDS_PER_READ: usize = 32;

/// Errors of the transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer closed the connection cleanly between messages.
    #[error("peer closed the connection")]
    Closed,
    /// The peer closed the connection in the middle of a message.
    #[error("peer closed the connection in the middle of a message")]
    Truncated,
    /// A header announced a message that cannot be valid (too small or too large): the stream
    /// cannot be framed any more. The header is kept so an error reply can still be sent.
    #[error("invalid message header")]
    BadHeader(Option<Header>, #[source] switchyard_proto::ProtoError),
    /// The socket failed.
    #[error("socket I/O failed")]
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

/// A framed vfio-user connection.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
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
    spin: Duration,
}

impl Connection {
    /// Wraps a connected stream. `max_msg_size` bounds a whole message (header included);
    /// `spin` is the adaptive polling budget (zero disables it).
    pub fn new(stream: UnixStream, max_msg_size: u32, spin: Duration) -> Self {
        let cap = max_msg_size as usize;
        Self {
            stream,
            buf: vec![0; cap],
            start: 0,
            end: 0,
            pending_fds: Vec::with_capacity(MAX_FDS_PER_READ),
            pending_trunc: false,
            fds_from: 0,
            fds_to: 0,
            max_msg_size,
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
        loop {
            let avail = self.end - self.start;
            if avail >= HEADER_SIZE {
                let hbytes = self
                    .buf
                    .get(self.start..self.start + HEADER_SIZE)
                    .unwrap_or(&[]);
                let header =
                    Header::from_bytes(hbytes).map_err(|e| TransportError::BadHeader(None, e))?;
                let body_len = header
                    .body_len_within(self.max_msg_size)
                    .map_err(|e| TransportError::BadHeader(Some(header), e))?;
                let total = HEADER_SIZE + body_len;
                if avail >= total {
                    let msg_start = self.start;
                    let msg_end = msg_start + total;
                    self.start = msg_end;
                    let (fds, fds_truncated) = self.take_fds(msg_start, msg_end);
                    let body = self
                        .buf
                        .get(msg_start + HEADER_SIZE..msg_end)
                        .unwrap_or(&[]);
                    return Ok(Message {
                        header,
                        body,
                        fds,
                        fds_truncated,
                    });
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
            self.fill()?;
        }
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

    fn fill(&mut self) -> Result<(), TransportError> {
        // Adaptive polling: non-blocking reads (MSG_DONTWAIT, no fcntl round trips) until the
        // budget is spent, then one blocking read.
        let deadline = (!self.spin.is_zero()).then(|| Instant::now() + self.spin);
        loop {
            let spinning = deadline.is_some_and(|d| Instant::now() < d);
            match self.recv_once(spinning) {
                Ok(0) => {
                    return Err(if self.start == self.end {
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
        let mut space =
            [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_READ))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let read_from = self.end;
        let dst = self.buf.get_mut(read_from..).unwrap_or(&mut []);
        let mut iov = [io::IoSliceMut::new(dst)];
        let mut flags = RecvFlags::CMSG_CLOEXEC;
        if dontwait {
            flags |= RecvFlags::DONTWAIT;
        }
        let msg = rustix::net::recvmsg(&self.stream, &mut iov, &mut control, flags)?;
        let truncated = msg.flags.contains(rustix::net::ReturnFlags::CTRUNC);
        let mut got_fds = false;
        for m in control.drain() {
            if let RecvAncillaryMessage::ScmRights(fds) = m {
                if !got_fds && !self.pending_fds.is_empty() {
                    tracing::warn!(
                        count = self.pending_fds.len(),
                        "dropping unclaimed descriptors"
                    );
                    self.pending_fds.clear();
                }
                got_fds = true;
                self.pending_fds.extend(fds);
            }
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
            self.fds_to = read_from + msg.bytes;
        }
        self.end += msg.bytes;
        Ok(msg.bytes)
    }
}

/// How long a send may wait for a peer that does not read.
#[derive(Debug, Clone, Copy)]
pub struct SendLimit<'a> {
    /// The whole send must be done within this time; then it fails with `TimedOut`.
    pub timeout: Duration,
    /// Gives up at once (`ConnectionAborted`) when this descriptor becomes readable (the
    /// server's stop eventfd).
    pub abort: Option<std::os::fd::BorrowedFd<'a>>,
}

/// Sends `bytes` (one or more whole messages) with optional descriptors in a single `sendmsg`,
/// retrying on short writes (descriptors go with the first part only). Waits as long as the
/// peer needs to make room; see [`send_bounded`] for a send that gives up.
pub fn send_all(
    stream: &UnixStream,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
) -> io::Result<()> {
    send_bounded(stream, bytes, fds, None)
}

/// [`send_all`] that waits for room in the socket at most `limit.timeout` in all and stops
/// early when `limit.abort` fires: a client that stops reading its replies can never hold
/// the thread that sends them.
pub fn send_bounded(
    stream: &UnixStream,
    bytes: &[u8],
    fds: &[std::os::fd::BorrowedFd<'_>],
    limit: Option<SendLimit<'_>>,
) -> io::Result<()> {
    let deadline = limit.map(|l| Instant::now() + l.timeout);
    let mut sent = 0;
    let mut first = true;
    while sent < bytes.len() || (first && !fds.is_empty()) {
        let rest = bytes.get(sent..).unwrap_or(&[]);
        let iov = [io::IoSlice::new(rest)];
        let n = if first && !fds.is_empty() {
            let mut space =
                [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS_PER_READ))];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(io::Error::from_raw_os_error(libc::E2BIG));
            }
            rustix::net::sendmsg(
                stream.as_fd(),
                &iov,
                &mut control,
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            )
        } else {
            rustix::net::send(
                stream.as_fd(),
                rest,
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            )
        };
        match n {
            Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero)),
            Ok(n) => sent += n,
            Err(e) if e == rustix::io::Errno::INTR => continue,
            Err(e) if e == rustix::io::Errno::AGAIN => {
                wait_for_room(stream, deadline, limit.and_then(|l| l.abort))?;
                continue;
            }
            Err(e) => return Err(e.into()),
        }
        first = false;
    }
    Ok(())
}

/// Waits until `stream` has room, the deadline passes (`TimedOut`) or `abort` is readable
/// (`ConnectionAborted`).
fn wait_for_room(
    stream: &UnixStream,
    deadline: Option<Instant>,
    abort: Option<std::os::fd::BorrowedFd<'_>>,
) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    loop {
        let timeout = match deadline {
            None => None,
            Some(d) => {
                let left = d.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "the peer did not read for the whole send timeout",
                    ));
                }
                Some(Timespec::try_from(left).unwrap_or(Timespec {
                    tv_sec: 1,
                    tv_nsec: 0,
                }))
            }
        };
        let mut pfd = [
            PollFd::new(stream, PollFlags::OUT),
            PollFd::from_borrowed_fd(abort.unwrap_or(stream.as_fd()), PollFlags::IN),
        ];
        let n = if abort.is_some() { 2 } else { 1 };
        match rustix::event::poll(&mut pfd[..n], timeout.as_ref()) {
            Ok(_) => {}
            Err(e) if e == rustix::io::Errno::INTR => continue,
            Err(e) => return Err(e.into()),
        }
        if n == 2 && pfd[1].revents().contains(PollFlags::IN) {
            return Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the server is stopping",
            ));
        }
        if !pfd[0].revents().is_empty() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;
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
    fn a_send_to_a_peer_that_never_reads_is_bounded_and_abortable() {
        let (a, _peer) = UnixStream::pair().expect("pair");
        let big = vec![0u8; 8 << 20]; // more than any socket buffer
        let t0 = Instant::now();
        let limit = SendLimit {
            timeout: Duration::from_millis(200),
            abort: None,
        };
        let e = send_bounded(&a, &big, &[], Some(limit)).expect_err("peer never reads");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(5),
            "{took:?}"
        );
        // The abort descriptor ends the wait at once, whatever the timeout.
        let (b, _peer2) = UnixStream::pair().expect("pair");
        let stop = switchyard_device::irq::new_eventfd().expect("eventfd");
        std::io::Write::write_all(&mut &stop, &1u64.to_ne_bytes()).expect("fire");
        let limit = SendLimit {
            timeout: Duration::from_secs(3600),
            abort: Some(stop.as_fd()),
        };
        let e = send_bounded(&b, &big, &[], Some(limit)).expect_err("aborted");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
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
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(64))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        assert!(control.push(SendAncillaryMessage::ScmRights(&many)));
        let m = msg(1, &[0; 16]);
        let iov = [io::IoSlice::new(&m)];
        rustix::net::sendmsg(&a, &iov, &mut control, SendFlags::empty()).expect("send");
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
}
