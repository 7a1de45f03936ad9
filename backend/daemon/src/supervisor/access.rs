//! Who may connect to the daemon's sockets: the daemon's user only (mode 0600), or its user
//! and one group (mode 0660, the file given to the group: `switchyard daemon
//! --socket-group`). Applied to every endpoint socket the supervisor binds or adopts, and by
//! the daemon to its control socket.

use std::io;
use std::path::Path;

/// Who may connect to a socket of the daemon.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SocketAccess {
    /// The group that may connect too, if any.
    pub group: Option<u32>,
}

impl SocketAccess {
    /// The daemon's user and the members of group `gid`.
    pub fn group(gid: u32) -> Self {
        Self { group: Some(gid) }
    }

    /// The socket file's mode: 0660 with a group, 0600 without.
    pub fn mode(&self) -> u32 {
        if self.group.is_some() { 0o660 } else { 0o600 }
    }

    /// Gives the socket file at `path` this access: its group (the link itself, never
    /// followed) and its mode. The file must be the caller's (a socket it bound or adopted,
    /// in a directory only the daemon can write).
    pub fn apply(&self, path: &Path) -> io::Result<()> {
        use std::os::unix::fs::PermissionsExt;
        let meta = std::fs::symlink_metadata(path)?;
        if !std::os::unix::fs::FileTypeExt::is_socket(&meta.file_type()) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a socket file",
            ));
        }
        if let Some(gid) = self.group
            && std::os::unix::fs::MetadataExt::gid(&meta) != gid
        {
            rustix::fs::chownat(
                rustix::fs::CWD,
                path,
                None,
                Some(rustix::fs::Gid::from_raw(gid)),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            )?;
        }
        if meta.permissions().mode() & 0o7777 != self.mode() {
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(self.mode()))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::os::unix::net::UnixListener;

    use super::*;

    #[test]
    fn a_socket_gets_the_group_and_mode_and_loses_them_again() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("s.sock");
        let _l = UnixListener::bind(&path).expect("bind");
        // The process's own group: a chown to it works for any user.
        let gid = rustix::process::getegid().as_raw();
        SocketAccess::group(gid).apply(&path).expect("apply");
        let meta = std::fs::symlink_metadata(&path).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o660);
        assert_eq!(meta.gid(), gid);
        SocketAccess::default().apply(&path).expect("apply");
        let meta = std::fs::symlink_metadata(&path).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600);
    }

    #[test]
    fn only_a_socket_file_is_changed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").expect("write");
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let link = dir.path().join("l");
        std::os::unix::fs::symlink(&file, &link).expect("symlink");
        for p in [&file, &link] {
            let e = SocketAccess::group(rustix::process::getegid().as_raw())
                .apply(p)
                .expect_err("not a socket");
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
        }
        let meta = std::fs::metadata(&file).expect("meta");
        assert_eq!(meta.permissions().mode() & 0o7777, 0o600, "left alone");
    }
}
