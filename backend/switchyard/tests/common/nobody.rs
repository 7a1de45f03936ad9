//! Clients that run as another user: uid nobody, and the gid of a group named in
//! `/etc/group` (the root-only tests of the socket group and the roles).

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use super::daemon::EXE;

/// The uid of `nobody`.
pub const NOBODY: u32 = 65534;

/// The gid of `group` in `/etc/group`, if it has one.
pub fn gid_of(group: &str) -> Option<u32> {
    let text = std::fs::read_to_string("/etc/group").ok()?;
    text.lines().find_map(|l| {
        let f: Vec<&str> = l.split(':').collect();
        (f.first() == Some(&group)).then(|| f.get(2)?.parse().ok())?
    })
}

/// A copy of the binary under test that uid nobody can run (the checkout may sit in a
/// directory only root can enter), in a directory that lives as long as the value.
pub struct NobodysExe {
    _dir: tempfile::TempDir,
    path: PathBuf,
}

impl NobodysExe {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o755)).expect("chmod");
        let path = dir.path().join("switchyard");
        std::fs::copy(EXE, &path).expect("copy the binary");
        std::fs::set_permissions(&path, PermissionsExt::from_mode(0o755)).expect("chmod");
        Self { _dir: dir, path }
    }

    /// `switchyard ctl --socket SOCKET ARGS` as uid nobody with primary group `gid` (and no
    /// other): success, stdout, stderr.
    pub fn ctl(&self, socket: &Path, gid: u32, args: &[&str]) -> (bool, String, String) {
        let out = Command::new(&self.path)
            .arg("ctl")
            .arg("--socket")
            .arg(socket)
            .args(args)
            .uid(NOBODY)
            .gid(gid)
            .output()
            .expect("run ctl as nobody");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }
}
