//! Message framing over a vfio-user stream socket, with SCM_RIGHTS fd passing (the socket
//! calls are `switchyard-endpoint`'s; replies are sent with its `send_bounded`).
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
        let read_from = self.end;
        let dst = self.buf.get_mut(read_from..).unwrap_or(&mut []);
        let pending = &mut self.pending_fds;
        let mut got_fds = false;
        let got = switchyard_endpoint::recv(&self.stream, dst, MAX_FDS_PER_READ, dontwait, |fd| {
            if !got_fds && !pending.is_empty() {
                tracing::warn!(count = pending.len(), "dropping unclaimed descriptors");
                pending.clear();
            }
            got_fds = true;
            pending.push(fd);
        })?;
        if got.fds_truncated {
            // Whatever arrived is incomplete: the message it belongs to is refused.
            if !got_fds {
                self.pending_fds.clear();
            }
            self.pending_trunc = true;
            got_fds = true;
        }
        if got_fds {
            self.fds_from = read_from;
            self.fds_to = read_from + got.bytes;
        }
        self.end += got.bytes;
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
}
