//! Binding a listening UNIX socket at a path, whole: the socket file appears only once it
//! accepts connections and has its final mode, and nothing on the way follows a path that
//! someone else could change.
//!
//! The socket is bound in a fresh private directory (0700) next to the target, its mode set,
//! and then renamed into place. Every step after the parent directory is opened works on
//! directory descriptors (`mkdirat`, `openat(O_NOFOLLOW)`, `fchmodat`, `renameat`): a user
//! who can write the parent directory may rename the staging directory or put a symbolic link
//! in its place while the socket is bound, and still only ever gets the socket moved or
//! refused, never another file's mode changed (the `chmod` through a path that it was before
//! turned any directory into 0660 as root). The process umask is never touched (other threads
//! may be creating files meanwhile).

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};

use rustix::fs::{AtFlags, FileType, Mode, OFlags};

/// Why [`bind_in_place`] refused.
#[derive(Debug, thiserror::Error)]
pub enum PlaceError {
    /// Something other than a socket is at the path.
    #[error("Something other than a socket is at the path")]
    Taken,
    /// A live socket is at the path (a connection to it succeeded).
    #[error("A live socket is at the path")]
    InUse,
    /// A system call failed.
    #[error("Cannot bind the socket in place")]
    Io(#[from] io::Error),
}

impl From<rustix::io::Errno> for PlaceError {
    fn from(e: rustix::io::Errno) -> Self {
        PlaceError::Io(e.into())
    }
}

/// A socket bound by [`bind_in_place`], and the identity of its file.
#[derive(Debug)]
pub struct Placed {
    /// The listening socket.
    pub listener: UnixListener,
    /// Device and inode of the socket file (to tell later whether the file at the path is
    /// still this one).
    pub ident: (u64, u64),
    /// A stale socket file was replaced.
    pub replaced_stale: bool,
}

/// Binds and listens at `path` with permissions `mode`. A stale socket file nobody listens on
/// is replaced; a live one is [`PlaceError::InUse`], anything else [`PlaceError::Taken`].
/// Any path whose final component AF_UNIX could name works (the staging path goes through
/// `/proc/self/fd`, which is short).
pub fn bind_in_place(path: &Path, mode: u32) -> Result<Placed, PlaceError> {
    bind_in_place_with(path, mode, |_| {})
}

/// [`bind_in_place`] that calls `between(staging directory)` after the bind and before the
/// mode is set: where a test plays the user who swaps the staging directory.
#[doc(hidden)]
pub fn bind_in_place_with(
    path: &Path,
    mode: u32,
    between: impl FnOnce(&Path),
) -> Result<Placed, PlaceError> {
    let Some(name) = path.file_name() else {
        return Err(
            io::Error::new(io::ErrorKind::InvalidInput, "the path does not name a file").into(),
        );
    };
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = rustix::fs::open(
        parent,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let replaced_stale = remove_stale(&dir, name)?;
    let staging = Staging::create(&dir, name)?;
    let listener = UnixListener::bind(staging.proc_path("s"))?;
    between(&parent.join(&staging.name));
    rustix::fs::chmodat(
        &staging.fd,
        "s",
        Mode::from_raw_mode(mode & 0o7777),
        AtFlags::empty(),
    )?;
    let st = rustix::fs::statat(&staging.fd, "s", AtFlags::SYMLINK_NOFOLLOW)?;
    rustix::fs::renameat(&staging.fd, "s", &dir, name)?;
    drop(staging);
    Ok(Placed {
        listener,
        ident: (st.st_dev, st.st_ino),
        replaced_stale,
    })
}

/// Removes a socket file at `dir/name` that nobody listens on; `true` if there was one.
fn remove_stale(dir: &OwnedFd, name: &OsStr) -> Result<bool, PlaceError> {
    let st = match rustix::fs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return Ok(false),
        Err(e) => return Err(e.into()),
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Socket {
        return Err(PlaceError::Taken);
    }
    match UnixStream::connect(proc_path(dir, name)) {
        Ok(_) => return Err(PlaceError::InUse),
        Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e.into()),
    }
    match rustix::fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) => Ok(true),
        Err(rustix::io::Errno::NOENT) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `/proc/self/fd/FD/NAME`: a short path to `NAME` in the directory `dir` holds.
fn proc_path(dir: &OwnedFd, name: impl AsRef<OsStr>) -> OsString {
    let mut p = OsString::from(format!("/proc/self/fd/{}/", dir.as_raw_fd()));
    p.push(name);
    p
}

/// The private directory next to the target where the socket is bound; removed (with the
/// socket, if it is still there) when dropped.
struct Staging<'a> {
    parent: BorrowedFd<'a>,
    name: OsString,
    fd: OwnedFd,
}

impl<'a> Staging<'a> {
    fn create(parent: &'a OwnedFd, target: &OsStr) -> Result<Self, PlaceError> {
        static COUNTER: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        for _ in 0..100 {
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let mut name = OsString::from(".");
            // A long target name makes a long staging name; the bind goes through
            // /proc/self/fd, so only the name's own limit (255 bytes) matters.
            name.push(OsStr::from_bytes(
                &target.as_bytes()[..target.len().min(200)],
            ));
            name.push(format!(".sy{pid:x}.{n:x}"));
            match rustix::fs::mkdirat(parent, &name, Mode::RWXU) {
                Ok(()) => {}
                Err(rustix::io::Errno::EXIST) => continue,
                Err(e) => return Err(e.into()),
            }
            // The directory just made, never a link put in its place; checked to be this
            // user's before anything is bound in it.
            let fd = rustix::fs::openat(
                parent,
                &name,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )?;
            let staging = Self {
                parent: parent.as_fd(),
                name,
                fd,
            };
            let st = rustix::fs::fstat(&staging.fd)?;
            if st.st_uid != rustix::process::geteuid().as_raw() {
                return Err(io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    "the staging directory was replaced by another user's",
                )
                .into());
            }
            // The umask may have taken bits from 0700; the owner needs all three.
            rustix::fs::fchmod(&staging.fd, Mode::RWXU)?;
            return Ok(staging);
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "cannot create a private staging directory next to the socket",
        )
        .into())
    }

    fn proc_path(&self, name: &str) -> OsString {
        proc_path(&self.fd, name)
    }
}

impl Drop for Staging<'_> {
    fn drop(&mut self) {
        let _ = rustix::fs::unlinkat(&self.fd, "s", AtFlags::empty());
        let _ = rustix::fs::unlinkat(self.parent, &self.name, AtFlags::REMOVEDIR);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn mode_of(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).expect("stat").mode() & 0o7777
    }

    #[test]
    fn the_socket_appears_with_its_mode_and_nothing_else_is_left() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.sock");
        let placed = bind_in_place(&path, 0o640).expect("bind");
        assert_eq!(mode_of(&path), 0o640);
        let m = std::fs::symlink_metadata(&path).expect("stat");
        assert_eq!(placed.ident, (m.dev(), m.ino()));
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert_eq!(names, ["a.sock"], "no staging directory left");
        UnixStream::connect(&path).expect("it accepts");
        assert!(!placed.replaced_stale);
    }

    #[test]
    fn a_live_socket_is_in_use_a_stale_one_replaced_a_file_taken() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("a.sock");
        let live = bind_in_place(&path, 0o600).expect("bind");
        assert!(matches!(
            bind_in_place(&path, 0o600),
            Err(PlaceError::InUse)
        ));
        drop(live);
        let again = bind_in_place(&path, 0o600).expect("stale replaced");
        assert!(again.replaced_stale);
        let file = dir.path().join("f");
        std::fs::write(&file, "").expect("file");
        assert!(matches!(
            bind_in_place(&file, 0o600),
            Err(PlaceError::Taken)
        ));
    }

    /// The attack of issue 34: between the bind and the mode change, a user who can write the
    /// parent replaces the staging directory by a link to a directory whose `s` leads to a
    /// victim. A chmod through the path would make the victim 0660; on descriptors the socket
    /// gets the mode and the victim keeps its own.
    #[test]
    fn a_staging_directory_swapped_under_the_bind_changes_no_other_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let victim = dir.path().join("victim");
        std::fs::create_dir(&victim).expect("mkdir");
        std::fs::set_permissions(&victim, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let evil = dir.path().join("evil");
        std::fs::create_dir(&evil).expect("mkdir");
        std::os::unix::fs::symlink(&victim, evil.join("s")).expect("symlink");
        let path = dir.path().join("a.sock");
        let mut swapped = false;
        let placed = bind_in_place_with(&path, 0o660, |staging| {
            std::fs::rename(staging, dir.path().join("moved")).expect("move the staging dir");
            std::os::unix::fs::symlink(&evil, staging).expect("link in its place");
            swapped = true;
        });
        assert!(swapped);
        assert_eq!(mode_of(&victim), 0o755, "the victim's mode is its own");
        // The socket itself went where it was asked, with its mode.
        let placed = placed.expect("bind");
        assert_eq!(mode_of(&path), 0o660);
        let m = std::fs::symlink_metadata(&path).expect("stat");
        assert!(std::os::unix::fs::FileTypeExt::is_socket(&m.file_type()));
        assert_eq!(placed.ident, (m.dev(), m.ino()));
    }
}
