//! `switchyard daemon --socket-group GROUP`: the control socket and the endpoint sockets are
//! 0660 and the group's, their directories let the group through (0750), the state stays the
//! daemon's own; a member of the group (and no one else but the daemon's user) can use them;
//! a group that does not exist stops the daemon before it creates anything.
//!
//! The group tests need root (to give files to a group the test is not in, and to run clients
//! as another user): they are `#[ignore = "needs root"]`, and `scripts/test.sh` runs them by
//! name as root (and fails if they did not run). The group is `daemon`, which every Debian
//! system has.
#![forbid(unsafe_code)]

mod common;

use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::process::Command;

use common::daemon::{Daemon, EXE, socket_of};
use common::nobody::{NobodysExe, gid_of};

/// The group the tests share the sockets with, and its gid.
const GROUP: &str = "daemon";
/// A group of nobody's own, outside `GROUP`.
const NOGROUP: u32 = 65534;

/// The group's gid; panics without root or the group (never skips: a skipped test would read
/// as passing).
fn setup() -> u32 {
    assert!(
        rustix::process::geteuid().is_root(),
        "needs root (files given to another group, clients run as nobody)"
    );
    gid_of(GROUP).unwrap_or_else(|| panic!("no group `{GROUP}` in /etc/group"))
}

/// (mode bits, gid) of `path`, not followed.
fn access(path: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.mode() & 0o7777, m.gid())
}

/// `switchyard ctl --socket SOCKET boards` as uid nobody with primary group `gid` (and no
/// other): its exit status and stderr.
fn ctl_as_nobody(exe: &NobodysExe, socket: &Path, gid: u32) -> (bool, String) {
    let (ok, _, err) = exe.ctl(socket, gid, &["boards"]);
    (ok, err)
}

#[test]
#[ignore = "needs root"]
fn the_sockets_are_the_groups_and_nobody_elses() {
    let gid = setup();
    let exe = NobodysExe::new();
    let mut d = Daemon::new().with_args(&["--socket-group", GROUP]);
    // The test's private directory is the root's 0700: nobody could not pass through it.
    std::fs::set_permissions(d.dir(), std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .expect("chmod");
    d.launch();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let vm1 = socket_of(&d.endpoint("vm1"));

    assert_eq!(access(&d.socket()), (0o660, gid), "the control socket");
    assert_eq!(access(&vm1), (0o660, gid), "the endpoint socket");
    assert_eq!(access(&d.run_dir()), (0o750, gid), "the run directory");
    assert_eq!(
        access(&d.run_dir().join("endpoints")),
        (0o750, gid),
        "the endpoints' directory"
    );
    let (mode, state_gid) = access(&d.state());
    assert_eq!(mode, 0o700, "the state stays the daemon's own");
    assert_ne!(state_gid, gid);
    assert_eq!(access(&d.state().join("workers")).0, 0o700);

    // A member of the group uses the control API; another user is refused by the kernel.
    let (ok, err) = ctl_as_nobody(&exe, &d.socket(), gid);
    assert!(ok, "a member of `{GROUP}`: {err}");
    let (ok, err) = ctl_as_nobody(&exe, &d.socket(), NOGROUP);
    assert!(!ok && err.contains("Permission denied"), "{err}");
    // The endpoint socket: a member connects (ctl then finds no HTTP there), another user
    // cannot.
    let (_, err) = ctl_as_nobody(&exe, &vm1, gid);
    assert!(
        !err.contains("Permission denied"),
        "a member of `{GROUP}`: {err}"
    );
    let (ok, err) = ctl_as_nobody(&exe, &vm1, NOGROUP);
    assert!(!ok && err.contains("Permission denied"), "{err}");

    // Without the option the next daemon takes the group's access back from the sockets of
    // the workers it adopts (the directories stay passable: the sockets are what it guards).
    let child = d.take_child().expect("daemon");
    let status = common::signal_and_wait(child, rustix::process::Signal::TERM, String::new);
    assert!(status.success(), "{status}");
    let mut d = d.with_args(&[]);
    d.launch();
    assert_eq!(d.endpoint("vm1")["worker"]["state"], "running");
    assert_eq!(access(&vm1).0, 0o600, "the adopted endpoint's socket");
    assert_eq!(access(&d.socket()).0, 0o600, "the new control socket");
    let (ok, err) = ctl_as_nobody(&exe, &d.socket(), gid);
    assert!(!ok && err.contains("Permission denied"), "{err}");
}

#[test]
fn a_group_that_does_not_exist_stops_the_daemon_before_it_creates_anything() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (state, run) = (dir.path().join("state"), dir.path().join("run"));
    let out = Command::new(EXE)
        .arg("daemon")
        .arg("--state-dir")
        .arg(&state)
        .arg("--run-dir")
        .arg(&run)
        .args(["--socket-group", "no-such-group-sy"])
        .output()
        .expect("run the daemon");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("error: The socket group `no-such-group-sy` does not exist"),
        "{err}"
    );
    assert!(!state.exists() && !run.exists(), "nothing created");
}
