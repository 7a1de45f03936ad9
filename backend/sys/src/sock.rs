//! Socket options the safe wrappers (rustix) do not offer.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Sets `SO_PEEK_OFF`: with a value `>= 0`, `MSG_PEEK` reads start that many bytes into the
/// receive queue and advance the offset, and consuming reads move it back; the kernel keeps
/// it per socket (shared by every descriptor of the socket, in every process). `-1` turns it
/// off.
pub fn set_peek_offset(sock: BorrowedFd<'_>, offset: i32) -> io::Result<()> {
    let value: libc::c_int = offset;
    // SAFETY: `sock` is a valid descriptor for the duration of the call (borrowed); the option
    // value points to a live `c_int` whose size is passed.
    let r = unsafe {
        libc::setsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEEK_OFF,
            (&raw const value).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Reads `SO_PEEK_OFF` (`-1`: off): how many bytes at the head of the receive queue have been
/// peeked and not consumed.
pub fn peek_offset(sock: BorrowedFd<'_>) -> io::Result<i32> {
    let mut value: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `sock` is a valid descriptor for the duration of the call; the value and length
    // point to live locals of the sizes the kernel is told.
    let r = unsafe {
        libc::getsockopt(
            sock.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEEK_OFF,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    if r == 0 {
        Ok(value)
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use std::io::{Read, Write};
    use std::os::fd::AsFd;
    use std::os::unix::net::UnixStream;

    use super::*;

    #[test]
    fn the_peek_offset_counts_peeked_unconsumed_bytes_for_every_descriptor() {
        let (mut a, mut b) = UnixStream::pair().expect("pair");
        assert_eq!(peek_offset(b.as_fd()).expect("get"), -1, "off by default");
        set_peek_offset(b.as_fd(), 0).expect("set");
        a.write_all(b"0123456789").expect("write");
        let mut buf = [0u8; 6];
        let n = rustix::net::recv(&b, &mut buf, rustix::net::RecvFlags::PEEK).expect("peek");
        assert_eq!(n.0, 6);
        // Another descriptor of the same socket (what a supervisor holds) sees it.
        let dup = b.try_clone().expect("dup");
        assert_eq!(peek_offset(dup.as_fd()).expect("get"), 6);
        let mut got = [0u8; 4];
        b.read_exact(&mut got).expect("consume");
        assert_eq!(&got, b"0123");
        assert_eq!(peek_offset(dup.as_fd()).expect("get"), 2);
        let mut rest = [0u8; 6];
        b.read_exact(&mut rest).expect("consume");
        assert_eq!(peek_offset(b.as_fd()).expect("get"), 0);
    }
}
