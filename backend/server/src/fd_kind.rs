//! What kind of descriptor a client sent, and whether it may go into custody.
//!
//! A client's descriptors outlive the message that carried them: the supervisor keeps a copy
//! of each (see [`crate::continuity`]), and may be the last to close it. Closing some files
//! blocks: a TCP socket with `SO_LINGER` and unsent data its peer never reads, a tty
//! draining its output, a FUSE or network file flushing. So only what a vfio-user client
//! legitimately sends is taken, checked before custody: memory for `DMA_MAP` (what
//! [`DmaSpace`](switchyard_device::dma::DmaSpace) can use: regular files on a local
//! filesystem, i.e. memfds, shmem, hugetlbfs, tmpfs/ext4/xfs/btrfs/overlayfs files) and
//! eventfds for `SET_IRQS`. Everything else, and descriptors on a message that carries none,
//! is refused with `EINVAL` and closed without blocking anyone ([`dispose`]).

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::OnceLock;
use std::sync::mpsc::{SyncSender, TrySendError};

use switchyard_proto::consts::{VFIO_USER_DEVICE_SET_IRQS, VFIO_USER_DMA_MAP};

/// `statfs` magic of tmpfs (memfds and shmem are on it).
const TMPFS_MAGIC: i64 = 0x0102_1994;
/// `statfs` magic of hugetlbfs.
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// The local filesystems whose regular files may back DMA memory: the list of
/// `switchyard_device::dma`'s access policy (`LOCAL_FILESYSTEMS` there; a file on any other
/// is refused there too, so this check refuses nothing the DMA space would take).
const LOCAL_FILESYSTEMS: [i64; 6] = [
    TMPFS_MAGIC,
    HUGETLBFS_MAGIC,
    0xef53,      // ext2/3/4
    0x5846_5342, // xfs
    0x9123_683e, // btrfs
    0x794c_7630, // overlayfs
];

/// What procfs calls an eventfd's anonymous inode (`/proc/self/fd/N`'s link). No syscall
/// tells an eventfd from the other anonymous inodes (they share one inode), so this is the
/// test; `fstatfs` says first that it is an anonymous inode at all.
const EVENTFD_LINK: &str = "anon_inode:[eventfd]";
/// `statfs` magic of the anonymous inode filesystem.
const ANON_INODE_FS_MAGIC: i64 = 0x0904_1934;

/// A descriptor's kind, as far as custody cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FdKind {
    /// A regular file on a local filesystem: memory a DMA window can use.
    Memory,
    /// An eventfd: an interrupt.
    EventFd,
    /// Anything else (what it is, for logs).
    Other(String),
}

/// The kind of `fd` (an `fstat`, an `fstatfs`, and for an anonymous inode a `readlink`).
pub fn fd_kind(fd: BorrowedFd<'_>) -> FdKind {
    let st = match rustix::fs::fstat(fd) {
        Ok(st) => st,
        Err(e) => return FdKind::Other(format!("fstat failed: {e}")),
    };
    let fs = match rustix::fs::fstatfs(fd) {
        #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
        Ok(fs) => fs.f_type as i64,
        Err(e) => return FdKind::Other(format!("fstatfs failed: {e}")),
    };
    let file_type = rustix::fs::FileType::from_raw_mode(st.st_mode);
    if file_type == rustix::fs::FileType::RegularFile {
        return if LOCAL_FILESYSTEMS.contains(&fs) {
            FdKind::Memory
        } else {
            FdKind::Other(format!("a regular file on filesystem {fs:#x}"))
        };
    }
    if fs == ANON_INODE_FS_MAGIC {
        let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
        return match link {
            Ok(l) if l.as_os_str() == EVENTFD_LINK => FdKind::EventFd,
            Ok(l) => FdKind::Other(l.display().to_string()),
            Err(e) => FdKind::Other(format!("an anonymous inode ({e})")),
        };
    }
    FdKind::Other(format!("{file_type:?}"))
}

/// Which kinds a message of command `cmd` may carry: `None` when it may carry none.
/// `cmd` unknown (`None`: the message's header is not in the read yet): memory or eventfds.
pub fn allowed(cmd: Option<u16>, kind: &FdKind) -> bool {
    match (cmd, kind) {
        (_, FdKind::Other(_)) => false,
        (Some(VFIO_USER_DMA_MAP), k) => *k == FdKind::Memory,
        (Some(VFIO_USER_DEVICE_SET_IRQS), k) => *k == FdKind::EventFd,
        (Some(_), _) => false,
        (None, _) => true,
    }
}

/// Whether every one of `fds` may come with a message of command `cmd` ([`allowed`]); the
/// first that may not, described, otherwise.
pub fn check(cmd: Option<u16>, fds: &[OwnedFd]) -> Result<(), String> {
    for fd in fds {
        let kind = fd_kind(fd.as_fd());
        if !allowed(cmd, &kind) {
            return Err(match kind {
                FdKind::Other(what) => what,
                k => format!("{k:?} on command {cmd:?}"),
            });
        }
    }
    Ok(())
}

/// Most refused descriptors waiting for the closer thread; past it one is leaked (a log
/// line says so) rather than closed where it could block.
const CLOSER_QUEUE: usize = 1024;

/// Closes `fd`, a descriptor that was refused, so that it blocks no one: a socket's
/// `SO_LINGER` is turned off first (its close then returns at once, the kernel sends what is
/// left in the background), and the close itself runs on a closer thread of its own (a
/// tty's drain, a FUSE server's flush). Memory and eventfds, whose close never blocks, are
/// closed here.
pub fn dispose(fd: OwnedFd) {
    if matches!(fd_kind(fd.as_fd()), FdKind::Memory | FdKind::EventFd) {
        drop(fd);
        return;
    }
    // Not a socket: ENOTSOCK, nothing to do.
    let _ = rustix::net::sockopt::set_socket_linger(&fd, None);
    static CLOSER: OnceLock<Option<SyncSender<OwnedFd>>> = OnceLock::new();
    let closer = CLOSER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::sync_channel::<OwnedFd>(CLOSER_QUEUE);
        std::thread::Builder::new()
            .name("sy-fd-closer".into())
            .spawn(move || rx.into_iter().for_each(drop))
            .map_err(|e| tracing::error!(error = %e, "no closer thread: refused descriptors leak"))
            .ok()
            .map(|_| tx)
    });
    let leaked = match closer {
        Some(tx) => match tx.try_send(fd) {
            Ok(()) => return,
            Err(TrySendError::Full(fd) | TrySendError::Disconnected(fd)) => fd,
        },
        None => fd,
    };
    tracing::error!(
        fd = leaked.as_raw_fd(),
        "the closer thread is behind; a refused descriptor is leaked rather than closed here"
    );
    std::mem::forget(leaked);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("fd-kind", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd")
    }

    fn eventfd() -> OwnedFd {
        rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).expect("eventfd")
    }

    #[test]
    fn memory_and_eventfds_are_told_apart_from_everything_else() {
        assert_eq!(fd_kind(memfd().as_fd()), FdKind::Memory);
        let tmp = tempfile::tempfile().expect("tmp file");
        assert_eq!(
            fd_kind(tmp.as_fd()),
            FdKind::Memory,
            "a regular temporary file"
        );
        assert_eq!(fd_kind(eventfd().as_fd()), FdKind::EventFd);
        let (a, _b) = UnixStream::pair().expect("pair");
        assert!(matches!(fd_kind(a.as_fd()), FdKind::Other(_)));
        let (r, _w) = rustix::pipe::pipe().expect("pipe");
        assert!(matches!(fd_kind(r.as_fd()), FdKind::Other(_)));
        let dir = std::fs::File::open("/tmp").expect("dir");
        assert!(matches!(fd_kind(dir.as_fd()), FdKind::Other(_)));
        let null = std::fs::File::open("/dev/null").expect("/dev/null");
        assert!(matches!(fd_kind(null.as_fd()), FdKind::Other(_)));
        let epoll = rustix::event::epoll::create(rustix::event::epoll::CreateFlags::CLOEXEC)
            .expect("epoll");
        assert!(
            matches!(fd_kind(epoll.as_fd()), FdKind::Other(_)),
            "another anonymous inode is not an eventfd"
        );
    }

    #[test]
    fn dma_map_takes_memory_and_set_irqs_eventfds_only() {
        let map = Some(VFIO_USER_DMA_MAP);
        let irqs = Some(VFIO_USER_DEVICE_SET_IRQS);
        assert!(check(map, &[memfd()]).is_ok());
        assert!(check(map, &[eventfd()]).is_err());
        assert!(check(irqs, &[eventfd(), eventfd()]).is_ok());
        assert!(check(irqs, &[memfd()]).is_err());
        let (a, _b) = UnixStream::pair().expect("pair");
        assert!(check(map, &[OwnedFd::from(a)]).is_err());
        assert!(
            check(
                Some(switchyard_proto::consts::VFIO_USER_REGION_READ),
                &[memfd()]
            )
            .is_err(),
            "a message that carries none"
        );
        assert!(check(None, &[memfd(), eventfd()]).is_ok());
        let (r, _w) = rustix::pipe::pipe().expect("pipe");
        assert!(check(None, &[r]).is_err());
    }

    #[test]
    fn disposing_of_a_lingering_socket_does_not_block() {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
        let mut s =
            std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let (_peer, _) = listener.accept().expect("accept");
        rustix::net::sockopt::set_socket_linger(&s, Some(std::time::Duration::from_secs(30)))
            .expect("linger");
        s.set_nonblocking(true).expect("nonblocking");
        // Fill the peer's window: the peer never reads.
        let chunk = vec![0u8; 1 << 16];
        while s.write(&chunk).is_ok() {}
        s.set_nonblocking(false).expect("blocking");
        let t0 = std::time::Instant::now();
        dispose(OwnedFd::from(s));
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            t0.elapsed()
        );
    }
}
