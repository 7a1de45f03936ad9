//! SCM_RIGHTS helpers on rustix's safe `sendmsg`/`recvmsg` (no unsafe code).
//!
//! Public so that test servers and fakes can reuse them.

use std::fs::File;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd};
use std::os::unix::net::UnixStream;

use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};

/// Most fds accepted in one `recvmsg`; more are truncated by the kernel (and closed).
pub const MAX_RECV_FDS: usize = 64;

/// Receives into `buf`, appending any passed fds (as owned close-on-exec `File`s) to `fds`.
/// Returns the number of bytes read (0 = EOF).
pub fn recv_with_files(
    sock: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<File>,
) -> io::Result<usize> {
    let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_RECV_FDS))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let mut iov = [io::IoSliceMut::new(buf)];
    let msg = rustix::net::recvmsg(sock, &mut iov, &mut control, RecvFlags::CMSG_CLOEXEC)?;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(received) = m {
            fds.extend(received.map(File::from));
        }
    }
    Ok(msg.bytes)
}

/// Sends `bytes` with `fds` attached (one `sendmsg`, then `write_all` for any remainder of a
/// partial send).
pub fn send_with_borrowed(
    sock: &UnixStream,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<()> {
    let n = if fds.is_empty() {
        rustix::net::send(sock.as_fd(), bytes, SendFlags::NOSIGNAL)?
    } else {
        let mut space = [MaybeUninit::<u8>::uninit(); rustix::cmsg_space!(ScmRights(MAX_RECV_FDS))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        if !control.push(SendAncillaryMessage::ScmRights(fds)) {
            return Err(io::Error::from_raw_os_error(libc::E2BIG));
        }
        let iov = [io::IoSlice::new(bytes)];
        rustix::net::sendmsg(sock.as_fd(), &iov, &mut control, SendFlags::NOSIGNAL)?
    };
    if let Some(rest) = bytes.get(n..)
        && !rest.is_empty()
    {
        io::Write::write_all(&mut &*sock, rest)?;
    }
    Ok(())
}

/// Fills `buf` completely, appending received fds; EOF is `UnexpectedEof`.
pub fn recv_exact_with_files(
    sock: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<File>,
) -> io::Result<()> {
    let mut got = 0;
    while got < buf.len() {
        let part = buf.get_mut(got..).unwrap_or_default();
        match recv_with_files(sock, part, fds) {
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}
