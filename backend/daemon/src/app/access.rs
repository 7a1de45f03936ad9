//! `switchyard daemon --socket-group GROUP`: the members of one group may use the control
//! socket and the endpoint sockets (mode 0660, group GROUP), and reach them through the run
//! directories. Everything else the daemon keeps stays its own (the state directory, the
//! workers' adoption sockets: 0700 and 0600).
//!
//! The group is looked up in `/etc/group` (where `systemd-sysusers` and `addgroup --system`
//! put system groups; a group only a network directory knows is not found), or given by its
//! number.

use std::io;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use super::DaemonError;
use crate::supervisor::SocketAccess;

/// Where groups are looked up.
pub const GROUP_FILE: &str = "/etc/group";

/// The gid of group `name` in the text of a group file (`name:x:gid:members` lines).
fn gid_in(text: &str, name: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let mut fields = line.split(':');
        (fields.next()? == name).then_some(())?;
        fields.nth(1)?.trim().parse().ok()
    })
}

/// The gid of group `name` ([`GROUP_FILE`]), or `name` itself when it is a number.
pub fn lookup_group(name: &str) -> Result<u32, DaemonError> {
    lookup_group_in(Path::new(GROUP_FILE), name)
}

/// [`lookup_group`] in the group file `file`.
pub fn lookup_group_in(file: &Path, name: &str) -> Result<u32, DaemonError> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(DaemonError::Inspect(file.to_owned(), e)),
    };
    gid_in(&text, name)
        .or_else(|| name.parse().ok())
        .ok_or_else(|| DaemonError::NoGroup {
            group: name.to_owned(),
            file: file.to_owned(),
        })
}

/// The access of the daemon's sockets: shared with group `group` when one is named (looked
/// up: [`lookup_group`]), else the daemon's user's only.
pub(super) fn socket_access(group: Option<&str>) -> Result<SocketAccess, DaemonError> {
    let Some(name) = group else {
        return Ok(SocketAccess::default());
    };
    let gid = lookup_group(name)?;
    tracing::info!(group = name, gid, "sockets shared with a group (mode 0660)");
    Ok(SocketAccess::group(gid))
}

/// [`share_dir`] for each of `dirs` when `access` has a group.
pub(super) fn share_dirs<'a>(
    access: SocketAccess,
    dirs: impl IntoIterator<Item = Option<&'a Path>>,
) -> Result<(), DaemonError> {
    let Some(gid) = access.group else {
        return Ok(());
    };
    dirs.into_iter()
        .flatten()
        .try_for_each(|dir| share_dir(dir, gid))
}

/// Whether members of group `gid` (not the owner) can pass through a directory of this
/// metadata: as its group, or as others.
fn passable(meta: &std::fs::Metadata, gid: u32) -> bool {
    meta.mode() & 0o001 != 0 || (meta.gid() == gid && meta.mode() & 0o010 != 0)
}

/// Lets the members of group `gid` into the daemon's directory `dir` (checked by the
/// caller: the daemon's own, not a link, writable by nobody else): when they cannot pass
/// through it yet, it is given to the group with `g+rx` (a directory the daemon created,
/// 0700, becomes 0750). Never made writable. Directories above it that keep the group out
/// are logged, not changed: they are not the daemon's.
pub(super) fn share_dir(dir: &Path, gid: u32) -> Result<(), DaemonError> {
    let share_err = |e: io::Error| DaemonError::Share(dir.to_owned(), e);
    let meta = std::fs::symlink_metadata(dir).map_err(share_err)?;
    if !passable(&meta, gid) {
        if meta.gid() != gid {
            rustix::fs::chownat(
                rustix::fs::CWD,
                dir,
                None,
                Some(rustix::fs::Gid::from_raw(gid)),
                rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|e| share_err(e.into()))?;
        }
        let mode = (meta.mode() & 0o7777) | 0o050;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode)).map_err(share_err)?;
    }
    if let Ok(absolute) = std::path::absolute(dir) {
        for above in absolute.ancestors().skip(1) {
            if let Ok(meta) = std::fs::metadata(above)
                && !passable(&meta, gid)
            {
                tracing::warn!(
                    dir = %dir.display(),
                    blocked_by = %above.display(),
                    mode = format!("{:04o}", meta.mode() & 0o7777),
                    gid,
                    "the socket group cannot reach this directory: a directory above it lets neither the group nor others through"
                );
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GROUPS: &str = "root:x:0:\ndaemon:x:1:\nswitchyard:x:997:alice,bob\n# odd\nbroken\n";

    #[test]
    fn groups_are_found_by_name_or_number() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = dir.path().join("group");
        std::fs::write(&file, GROUPS).expect("write");
        assert_eq!(lookup_group_in(&file, "switchyard").expect("found"), 997);
        assert_eq!(lookup_group_in(&file, "daemon").expect("found"), 1);
        assert_eq!(lookup_group_in(&file, "4242").expect("a number"), 4242);
        let e = lookup_group_in(&file, "nosuch").expect_err("missing");
        assert!(matches!(e, DaemonError::NoGroup { .. }), "{e:?}");
        assert_eq!(e.exit_code(), 2, "a bad argument");
        assert_eq!(
            e.to_string(),
            format!(
                "The socket group `nosuch` does not exist (not in {}); create it (`systemd-sysusers`, `addgroup --system nosuch`) or name another",
                file.display()
            )
        );
        // No group file at all: only numbers.
        let none = dir.path().join("none");
        assert_eq!(lookup_group_in(&none, "7").expect("a number"), 7);
        assert!(lookup_group_in(&none, "switchyard").is_err());
    }

    #[test]
    fn a_private_directory_is_opened_to_the_group_and_an_open_one_left_alone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let gid = rustix::process::getegid().as_raw();
        let private = dir.path().join("private");
        std::fs::create_dir(&private).expect("mkdir");
        std::fs::set_permissions(&private, std::fs::Permissions::from_mode(0o700)).expect("chmod");
        share_dir(&private, gid).expect("share");
        let meta = std::fs::symlink_metadata(&private).expect("meta");
        assert_eq!(meta.mode() & 0o7777, 0o750);
        assert_eq!(meta.gid(), gid);

        let open = dir.path().join("open");
        std::fs::create_dir(&open).expect("mkdir");
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o711)).expect("chmod");
        share_dir(&open, gid).expect("share");
        let meta = std::fs::symlink_metadata(&open).expect("meta");
        assert_eq!(meta.mode() & 0o7777, 0o711, "others pass already");
    }
}
