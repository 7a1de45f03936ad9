//! Descriptors inherited across an `execve` of the process itself (a worker that replaces
//! its own image, `switchyard_daemon::worker`): the image before the exec leaves them open
//! without close-on-exec and names their numbers; the image after takes each once.

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

/// Numbers taken so far: a number is taken at most once, so two owners never exist.
static TAKEN: Mutex<BTreeSet<RawFd>> = Mutex::new(BTreeSet::new());

/// Takes ownership of the inherited descriptor `raw` and sets close-on-exec on it again.
/// Refused for the standard streams, for a number already taken, and for a number that is
/// not an open descriptor.
pub fn take(raw: RawFd) -> io::Result<OwnedFd> {
    if raw <= 2 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {raw} is a standard stream, not an inherited one"),
        ));
    }
    let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
    if taken.contains(&raw) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("descriptor {raw} was taken already"),
        ));
    }
    // SAFETY: F_GETFD only reads the descriptor's flags; an invalid number fails with EBADF.
    if unsafe { libc::fcntl(raw, libc::F_GETFD) } < 0 {
        return Err(io::Error::last_os_error());
    }
    taken.insert(raw);
    // SAFETY: `raw` is open (checked above), was left open for this image by the one before
    // the exec, which owns nothing after it, and is taken once (the set above): this is its
    // only owner.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // SAFETY: F_SETFD on a descriptor this function owns (above) only changes its flags.
    if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    #[test]
    fn an_inherited_descriptor_is_taken_once_and_closed_on_exec_again() {
        let memfd = rustix::fs::memfd_create("inherit-test", rustix::fs::MemfdFlags::empty())
            .expect("memfd");
        let raw = memfd.into_raw_fd();
        let fd = take(raw).expect("taken");
        assert_eq!(fd.as_raw_fd(), raw);
        let flags = rustix::io::fcntl_getfd(&fd).expect("flags");
        assert!(flags.contains(rustix::io::FdFlags::CLOEXEC));
        assert!(take(raw).is_err(), "taken twice");
        assert!(take(0).is_err(), "standard input");
        drop(fd);
    }
}
