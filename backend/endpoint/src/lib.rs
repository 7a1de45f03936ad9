//! The one SCM_RIGHTS endpoint of Switchyard: bytes and file descriptors over a UNIX stream
//! socket, on rustix's safe `sendmsg`/`recvmsg` (no unsafe code).
//!
//! Used by the server, the client and the tests alike. Nothing here allocates: control
//! buffers live on the stack, received descriptors are handed to the caller one by one.
//!
//! - Receiving sets `MSG_CMSG_CLOEXEC` and reports `MSG_CTRUNC` (descriptors the kernel
//!   dropped because the caller's `max_fds` was too small or the process is at its open-file
//!   limit).
//! - [`send_all`] is a plain blocking send (the socket's `SO_SNDTIMEO` applies);
//!   [`send_bounded`] never blocks in the kernel and waits for room at most a given time,
//!   giving up at once when an abort descriptor becomes readable.
//!
//! Framing (where one message ends and which descriptors belong to it) is the caller's.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod place;

use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Most descriptors one `sendmsg` may carry (the kernel's `SCM_MAX_FD`); also the most a
/// receive can be asked to accept.
pub const SCM_MAX_FD: usize = 253;

/// Control-buffer room for [`SCM_MAX_FD`] descriptors.
const MAX_SPACE: usize = rustix::cmsg_space!(ScmRights(SCM_MAX_FD));

/// What one [`recv`] brought.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    /// Bytes read (0: the peer closed the connection).
    pub bytes: usize,
    /// Descriptors handed to the caller.
    pub fds: usize,
    /// The kernel dropped descriptors sent with these bytes (`MSG_CTRUNC`): the ones handed
    /// over are incomplete.
    pub fds_truncated: bool,
}

/// One `recvmsg` into `buf`, accepting at most `max_fds` descriptors (capped at
/// [`SCM_MAX_FD`]; more are dropped by the kernel and reported as truncated). Each received
/// descriptor (close-on-exec) is passed to `on_fd`. With `nonblocking` the call does not
/// wait (`MSG_DONTWAIT`: `WouldBlock` when there is nothing to read). `Interrupted` is
/// returned as is, for the caller to retry.
pub fn recv(
    sock: impl AsFd,
    buf: &mut [u8],
    max_fds: usize,
    nonblocking: bool,
    on_fd: impl FnMut(OwnedFd),
) -> io::Result<Received> {
    recv_with(sock, buf, max_fds, nonblocking, false, on_fd)
}

/// [`recv`] that leaves the bytes in the socket (`MSG_PEEK`): a later `recv` returns them
/// again, with their descriptors again (the kernel installs a new copy of each descriptor at
/// every receive, peeked or not). For a reader that must record what it received before the
/// socket forgets it.
pub fn peek(
    sock: impl AsFd,
    buf: &mut [u8],
    max_fds: usize,
    nonblocking: bool,
    on_fd: impl FnMut(OwnedFd),
) -> io::Result<Received> {
    recv_with(sock, buf, max_fds, nonblocking, true, on_fd)
}

fn recv_with(
    sock: impl AsFd,
    buf: &mut [u8],
    max_fds: usize,
    nonblocking: bool,
    peek: bool,
    mut on_fd: impl FnMut(OwnedFd),
) -> io::Result<Received> {
    let mut space = [MaybeUninit::<u8>::uninit(); MAX_SPACE];
    let room = rustix::cmsg_space!(ScmRights(max_fds.min(SCM_MAX_FD)));
    let mut control = RecvAncillaryBuffer::new(space.get_mut(..room).unwrap_or_default());
    let mut iov = [io::IoSliceMut::new(buf)];
    let mut flags = RecvFlags::CMSG_CLOEXEC;
    if nonblocking {
        flags |= RecvFlags::DONTWAIT;
    }
    if peek {
        flags |= RecvFlags::PEEK;
    }
    let msg = rustix::net::recvmsg(sock, &mut iov, &mut control, flags)?;
    let mut fds = 0;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            for fd in received {
                fds += 1;
                on_fd(fd);
            }
        }
    }
    Ok(Received {
        bytes: msg.bytes,
        fds,
        fds_truncated: msg.flags.contains(ReturnFlags::CTRUNC),
    })
}

/// Fills `buf` completely (blocking), appending received descriptors to `fds` (at most
/// `max_fds` per read). End of stream before that is `UnexpectedEof`; interrupted reads are
/// retried.
pub fn recv_exact<F: From<OwnedFd>>(
    sock: impl AsFd,
    buf: &mut [u8],
    max_fds: usize,
    fds: &mut Vec<F>,
) -> io::Result<()> {
    let sock = sock.as_fd();
    let mut got = 0;
    while got < buf.len() {
        let part = buf.get_mut(got..).unwrap_or_default();
        match recv(sock, part, max_fds, false, |fd| fds.push(F::from(fd))) {
            Ok(r) if r.bytes == 0 => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(r) => got += r.bytes,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// How long a [`send_bounded`] may wait for a peer that does not read.
#[derive(Debug, Clone, Copy)]
pub struct SendLimit<'a> {
    /// The whole send must be done within this time; then it fails with `TimedOut`.
    pub timeout: Duration,
    /// Gives up at once (`ConnectionAborted`) when this descriptor becomes readable (e.g. a
    /// server's stop eventfd).
    pub abort: Option<BorrowedFd<'a>>,
}

/// Sends all of `bytes` (blocking, `MSG_NOSIGNAL`), with `fds` (at most [`SCM_MAX_FD`], else
/// `E2BIG`) attached to the first `sendmsg`; short writes are continued and interrupted ones
/// retried. A socket send timeout (`SO_SNDTIMEO`) that expires is `WouldBlock`.
pub fn send_all(sock: impl AsFd, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    send_with(sock.as_fd(), bytes, fds, SendFlags::NOSIGNAL, || {
        Err(io::ErrorKind::WouldBlock.into())
    })
}

/// [`send_all`] that never blocks in the kernel (`MSG_DONTWAIT`) and waits for room in the
/// socket at most `limit.timeout` in all (then `TimedOut`), stopping early when `limit.abort`
/// fires (`ConnectionAborted`): a peer that stops reading can never hold the sending thread.
pub fn send_bounded(
    sock: impl AsFd,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    limit: SendLimit<'_>,
) -> io::Result<()> {
    let sock = sock.as_fd();
    let deadline = Instant::now() + limit.timeout;
    send_with(
        sock,
        bytes,
        fds,
        SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
        || wait_for_room(sock, deadline, limit.abort),
    )
}

/// The send loop: descriptors go with the first part only; `EAGAIN` asks `on_full`.
fn send_with(
    sock: BorrowedFd<'_>,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
    flags: SendFlags,
    mut on_full: impl FnMut() -> io::Result<()>,
) -> io::Result<()> {
    let mut sent = 0;
    let mut first = true;
    while sent < bytes.len() || (first && !fds.is_empty()) {
        let rest = bytes.get(sent..).unwrap_or_default();
        let n = if first && !fds.is_empty() {
            let mut space = [MaybeUninit::<u8>::uninit(); MAX_SPACE];
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(io::Error::from_raw_os_error(libc::E2BIG));
            }
            let iov = [io::IoSlice::new(rest)];
            rustix::net::sendmsg(sock, &iov, &mut control, flags)
        } else {
            rustix::net::send(sock, rest, flags)
        };
        match n {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e == rustix::io::Errno::INTR => continue,
            Err(e) if e == rustix::io::Errno::AGAIN => {
                on_full()?;
                continue;
            }
            Err(e) => return Err(e.into()),
        }
        first = false;
    }
    Ok(())
}

/// Waits until `sock` has room for a send, within `limit` like [`send_bounded`]. A stream
/// socket that polls writable takes a small message (well under a quarter of its send
/// buffer) whole in one non-blocking `sendmsg`: a caller that must not be stopped in the
/// middle of a send waits here first.
pub fn wait_writable(sock: impl AsFd, limit: SendLimit<'_>) -> io::Result<()> {
    wait_for_room(sock.as_fd(), Instant::now() + limit.timeout, limit.abort)
}

/// Waits until `sock` has room, the deadline passes (`TimedOut`) or `abort` is readable
/// (`ConnectionAborted`).
fn wait_for_room(
    sock: BorrowedFd<'_>,
    deadline: Instant,
    abort: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    use rustix::event::{PollFd, PollFlags, Timespec};
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer did not read for the whole send timeout",
            ));
        }
        let timeout = Timespec::try_from(left).unwrap_or(Timespec {
            tv_sec: 1,
            tv_nsec: 0,
        });
        let mut pfd = [
            PollFd::new(&sock, PollFlags::OUT),
            PollFd::from_borrowed_fd(abort.unwrap_or(sock), PollFlags::IN),
        ];
        let n = if abort.is_some() { 2 } else { 1 };
        match rustix::event::poll(pfd.get_mut(..n).unwrap_or_default(), Some(&timeout)) {
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
    use std::os::unix::net::UnixStream;

    #[test]
    fn a_send_to_a_peer_that_never_reads_is_bounded_and_abortable() {
        let (a, _peer) = UnixStream::pair().expect("pair");
        let big = vec![0u8; 8 << 20]; // more than any socket buffer
        let t0 = Instant::now();
        let limit = SendLimit {
            timeout: Duration::from_millis(200),
            abort: None,
        };
        let e = send_bounded(&a, &big, &[], limit).expect_err("peer never reads");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
        let took = t0.elapsed();
        assert!(
            took >= Duration::from_millis(200) && took < Duration::from_secs(5),
            "{took:?}"
        );
        // The abort descriptor ends the wait at once, whatever the timeout.
        let (b, _peer2) = UnixStream::pair().expect("pair");
        let stop =
            rustix::event::eventfd(1, rustix::event::EventfdFlags::CLOEXEC).expect("eventfd");
        let limit = SendLimit {
            timeout: Duration::from_secs(3600),
            abort: Some(stop.as_fd()),
        };
        let e = send_bounded(&b, &big, &[], limit).expect_err("aborted");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionAborted);
    }
}
