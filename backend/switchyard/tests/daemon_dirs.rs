//! `switchyard daemon` against another local user (issue 21, item 4): run and state
//! directories it did not create and that another user owns or can write, or symbolic links
//! where its directories and store must be, are refused before it starts (exit 1, naming the
//! path and what is wrong); a forged worker record (naming a live process that is not its
//! worker, or another daemon's worker of the same binary and uid) never gets that process
//! adopted or killed, neither at start nor at `ctl delete` (issue 34: a worker proves its
//! record's nonce on its adoption socket).
//!
//! The owner cases chown to uid 65534 and need root: they are `#[ignore = "needs root"]`, and
//! `scripts/test.sh` runs them by name as root (and fails if they did not run).
#![forbid(unsafe_code)]

mod common;

use std::fs;
use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::daemon::Daemon;
use switchyard_daemon::custody::{self, LISTENER_ID, Note};

const EXE: &str = env!("CARGO_BIN_EXE_switchyard");
const NOBODY: u32 = 65534;

fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

fn daemon_command(state: &Path, run: &Path) -> Command {
    let mut cmd = Command::new(EXE);
    cmd.arg("daemon")
        .arg("--state-dir")
        .arg(state)
        .arg("--run-dir")
        .arg(run)
        .env("RUST_LOG", "info")
        .env("SWITCHYARD_WORKER_EXE", EXE)
        .stdin(Stdio::null())
        .stdout(Stdio::null());
    cmd
}

/// Runs a daemon that must refuse to start; its exit status and stderr, or what it said if
/// it started.
fn refused(state: &Path, run: &Path) -> Result<(Option<i32>, String), String> {
    let mut child = daemon_command(state, run)
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the daemon");
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline || run.join("control.sock").exists() {
            let _ = child.kill();
            let out = child.wait_with_output().expect("wait");
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            return Err(format!("the daemon started:\n{stderr}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let out: Output = child.wait_with_output().expect("output");
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    Ok((out.status.code(), stderr))
}

fn mkdir(path: &Path, mode: u32) {
    fs::create_dir_all(path).expect("mkdir");
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::lchown(path, Some(uid), Some(uid)).expect("chown");
}

/// A run or state directory the daemon must refuse.
struct Case {
    name: &'static str,
    /// It makes a directory of another user (chown).
    needs_root: bool,
    /// Prepares `base`; returns the offending path and what the error must say.
    prepare: fn(&Path) -> (PathBuf, &'static str),
}

#[test]
#[ignore = "needs root"]
fn run_and_state_directories_of_another_user_are_refused_naming_the_path() {
    assert!(is_root(), "needs root, to make directories of another user");
    refused_cases(true);
}

#[test]
fn hostile_run_and_state_directories_are_refused_naming_the_path() {
    refused_cases(false);

    // Positive control: fresh directories are created private, and the daemon starts.
    let base = tempfile::tempdir().expect("tempdir");
    let (state, run) = (base.path().join("a/state"), base.path().join("b/run"));
    let mut d = started(&state, &run);
    for dir in [
        base.path().join("a"),
        state.clone(),
        state.join("workers"),
        run.clone(),
        run.join("endpoints"),
    ] {
        let meta = fs::symlink_metadata(&dir).expect("created");
        assert!(meta.is_dir(), "{}", dir.display());
        assert_eq!(meta.mode() & 0o7777, 0o700, "{}", dir.display());
        assert_eq!(meta.uid(), rustix::process::geteuid().as_raw());
    }
    assert!(
        fs::symlink_metadata(state.join("pool.redb"))
            .expect("store")
            .is_file()
    );
    // ... and starts again on the directories it made.
    d.kill9();
    let _d = started(&state, &run);
}

/// Every case whose `needs_root` is `root` is refused, naming the path and the problem.
fn refused_cases(root: bool) {
    let cases = [
        Case {
            name: "a run directory of another user",
            needs_root: true,
            prepare: |b| {
                mkdir(&b.join("run"), 0o700);
                chown(&b.join("run"), NOBODY);
                (b.join("run"), "owned by uid 65534, not by the daemon's uid")
            },
        },
        Case {
            name: "a state directory of another user",
            needs_root: true,
            prepare: |b| {
                mkdir(&b.join("state"), 0o700);
                chown(&b.join("state"), NOBODY);
                (b.join("state"), "owned by uid 65534")
            },
        },
        Case {
            name: "workers/ of another user",
            needs_root: true,
            prepare: |b| {
                mkdir(&b.join("state/workers"), 0o700);
                chown(&b.join("state/workers"), NOBODY);
                (b.join("state/workers"), "owned by uid 65534")
            },
        },
        Case {
            // The README's old walkthrough: `/tmp/sy` pre-created by someone else, the
            // daemon's directories inside it.
            name: "the directory above run/ and state/ of another user",
            needs_root: true,
            prepare: |b| {
                mkdir(&b.join("sy"), 0o755);
                chown(&b.join("sy"), NOBODY);
                (
                    b.join("sy"),
                    "a directory on the way to the daemon's is owned by uid 65534",
                )
            },
        },
        Case {
            name: "a state directory anyone can write",
            needs_root: false,
            prepare: |b| {
                mkdir(&b.join("state"), 0o777);
                (b.join("state"), "writable by group or others (mode 0777)")
            },
        },
        Case {
            name: "a group-writable run directory",
            needs_root: false,
            prepare: |b| {
                mkdir(&b.join("run"), 0o770);
                (
                    b.join("run"),
                    "it is writable by group or others (mode 0770)",
                )
            },
        },
        Case {
            name: "endpoints/ as a symbolic link",
            needs_root: false,
            prepare: |b| {
                mkdir(&b.join("run"), 0o700);
                mkdir(&b.join("elsewhere"), 0o700);
                std::os::unix::fs::symlink(b.join("elsewhere"), b.join("run/endpoints"))
                    .expect("symlink");
                (b.join("run/endpoints"), "it is a symbolic link")
            },
        },
        Case {
            name: "the state directory as a symbolic link",
            needs_root: false,
            prepare: |b| {
                mkdir(&b.join("elsewhere"), 0o700);
                std::os::unix::fs::symlink(b.join("elsewhere"), b.join("state")).expect("symlink");
                (b.join("state"), "it is a symbolic link")
            },
        },
        Case {
            name: "endpoints/ as a file",
            needs_root: false,
            prepare: |b| {
                mkdir(&b.join("run"), 0o700);
                fs::write(b.join("run/endpoints"), "").expect("file");
                (b.join("run/endpoints"), "it is not a directory")
            },
        },
        Case {
            name: "a dangling pool.redb symbolic link",
            needs_root: false,
            prepare: |b| {
                mkdir(&b.join("state"), 0o700);
                std::os::unix::fs::symlink(b.join("chosen"), b.join("state/pool.redb"))
                    .expect("symlink");
                (b.join("state/pool.redb"), "it is a symbolic link")
            },
        },
    ];
    let mut failures = Vec::new();
    for case in cases.iter().filter(|c| c.needs_root == root) {
        let base = tempfile::tempdir().expect("tempdir");
        let (path, problem) = (case.prepare)(base.path());
        let (state, run) = if case.name.contains("above") {
            (base.path().join("sy/state"), base.path().join("sy/run"))
        } else {
            (base.path().join("state"), base.path().join("run"))
        };
        let named = format!(
            "Refusing to use {}, which another user could control",
            path.display()
        );
        let failure = match refused(&state, &run) {
            Err(started) => Some(started),
            Ok((code, stderr)) if code != Some(1) => Some(format!("exit {code:?}: {stderr}")),
            Ok((_, stderr)) if !stderr.contains(&named) || !stderr.contains(problem) => {
                Some(format!("wanted {named:?} and {problem:?} in:\n{stderr}"))
            }
            Ok(_) if base.path().join("chosen").exists() => Some("the link was followed".into()),
            Ok(_) if case.name.contains("above") && run.exists() => {
                Some("a directory was created in another user's directory".into())
            }
            Ok(_) => None,
        };
        if let Some(f) = failure {
            failures.push(format!("{}: {f}", case.name));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n---\n"));
}

/// A daemon on these directories, started; dropping it kills it and its workers.
fn started(state: &Path, run: &Path) -> Daemon {
    let mut d = Daemon::new().with_dirs(state, run);
    d.launch();
    d
}

/// Whether `pid` is a running `switchyard worker` of the binary under test.
fn is_worker(pid: u32) -> bool {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    start_time(pid).is_some()
        && cmdline.ends_with(b"\0worker\0")
        && cmdline.starts_with(EXE.as_bytes())
}

fn kill(pid: u32) {
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
}

/// Field 22 of `/proc/PID/stat`, for a process that runs (not a zombie).
fn start_time(pid: u32) -> Option<u64> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat[stat.rfind(')')? + 1..].split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// `sleep 60`: a live process of the test's, not a worker; killed when dropped.
struct Sleeper(Child);

impl Sleeper {
    fn spawn() -> Self {
        Self(Command::new("sleep").arg("60").spawn().expect("sleep"))
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Whether nothing signalled it: no signal is pending for it (`ShdPnd` and `SigPnd` of
    /// `/proc/PID/status`) and it has not exited. A `kill(2)` of it is pending before the
    /// sender's call returns and stays so until the process is reaped (a zombie shows it
    /// too), so this sees a kill the moment it was sent, without waiting for the death.
    fn untouched(&mut self) -> bool {
        let status = fs::read_to_string(format!("/proc/{}/status", self.pid())).unwrap_or_default();
        let pending = ["SigPnd:", "ShdPnd:"].iter().any(|field| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .is_none_or(|mask| !mask.trim().trim_start_matches('0').is_empty())
        });
        !pending && self.0.try_wait().expect("wait").is_none()
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A fake adoption socket (`<workers>/w<pid>.sock`, served by the test) that hands over a
/// listening socket and says `Adopted` to whoever asks, then closes the channel: a daemon
/// that believed the forged record would supervise `pid` and kill it when the channel ends.
/// Reports the note it was asked with.
fn fake_adoption_socket(workers: &Path, pid: u32, scratch: &Path) -> mpsc::Receiver<Note> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .expect("socket");
    let path = workers.join(format!("w{pid}.sock"));
    rustix::net::bind(&sock, &SocketAddrUnix::new(&path).expect("addr")).expect("bind");
    rustix::net::listen(&sock, 4).expect("listen");
    let listener =
        std::os::unix::net::UnixListener::bind(scratch.join("fake.sock")).expect("listener");
    let (tx, rx) = mpsc::channel();
    // Detached: with the fix nobody connects and it waits until the test process ends.
    std::thread::spawn(move || {
        let Ok(conn) = rustix::net::accept(&sock) else {
            return;
        };
        let Ok((note, _)) = custody::recv(&conn, &mut Vec::new()) else {
            return;
        };
        let _ = tx.send(note);
        let _ = custody::send(
            &conn,
            &Note::Fds {
                ids: vec![LISTENER_ID],
            },
            &[listener.as_fd()],
        );
        let adopted = Note::Adopted {
            pid,
            replacement: None,
            last_move: None,
            restarts: None,
            lease: None,
            nonce: None,
        };
        let _ = custody::send(&conn, &adopted, &[]);
    });
    rx
}

#[test]
fn a_forged_worker_record_never_gets_a_process_killed() {
    let base = tempfile::tempdir().expect("tempdir");
    let (state, run) = (base.path().join("state"), base.path().join("run"));
    let workers = state.join("workers");
    // Two endpoints with leases in the store; then no daemon and none of its workers.
    let mut d = started(&state, &run);
    for id in ["vm1", "vm2"] {
        let out = d.ctl(&["create", id, "--pool", "default"]);
        assert!(out.status.success(), "{out:?}");
    }
    let old: Vec<u32> = ["vm1", "vm2"]
        .iter()
        .map(|id| d.endpoint(id)["worker"]["pid"].as_u64().expect("a worker") as u32)
        .collect();
    d.kill9();
    for &pid in &old {
        kill(pid);
    }
    for &pid in &old {
        let deadline = Instant::now() + Duration::from_secs(10);
        while start_time(pid).is_some() {
            assert!(Instant::now() < deadline, "worker {pid} still runs");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    // Records rewritten to name processes that are not workers, with their true start
    // times. vm1's also has a fake adoption socket; vm2's socket is served by someone else,
    // so the daemon leaves vm2 orphaned.
    let mut a = Sleeper::spawn();
    let mut b = Sleeper::spawn();
    // Positive control of the check below: a kill shows at once, before the death.
    let mut control = Sleeper::spawn();
    assert!(control.untouched(), "a process nobody signalled");
    kill(control.pid());
    assert!(!control.untouched(), "a kill just sent is seen");
    for (id, s) in [("vm1", &a), ("vm2", &b)] {
        let start = start_time(s.pid()).expect("sleep runs");
        fs::write(
            workers.join(format!("{id}.pid")),
            format!("{} {start}\n", s.pid()),
        )
        .expect("forge the record");
    }
    let asked = fake_adoption_socket(&workers, a.pid(), base.path());
    let vm2_socket = run.join("endpoints/vm2.sock");
    let _ = fs::remove_file(&vm2_socket);
    let _squatter = std::os::unix::net::UnixListener::bind(&vm2_socket).expect("bind vm2's socket");

    let mut d = started(&state, &run);
    // At start: neither process adopted nor killed, the records reported.
    let vm1 = wait_state(&mut d, "vm1", "running");
    let vm1_pid = vm1["worker"]["pid"].as_u64().expect("pid") as u32;
    assert_ne!(vm1_pid, a.pid(), "{vm1}");
    assert!(is_worker(vm1_pid), "{vm1}");
    assert_eq!(d.endpoint("vm2")["worker"]["state"], "orphaned");
    // The daemon decides on every record before its API answers (`start_all`); had it
    // adopted the forged vm1, the adoption's end (the fake channel closes) would have killed
    // the process before vm1's own worker started. Nothing to wait for.
    assert!(
        a.untouched(),
        "the process named by vm1's forged record was signalled"
    );
    assert!(
        b.untouched(),
        "the process named by vm2's forged record was signalled"
    );
    assert!(
        asked.try_recv().is_err(),
        "the daemon asked the forged record's process for adoption"
    );
    let log = d.log();
    for s in [&a, &b] {
        assert!(
            log.contains(&format!("pid={}", s.pid()))
                && log.contains("not a worker of this daemon"),
            "the forged record is reported:\n{log}"
        );
    }

    // `ctl delete` of the orphan: refused (its server is unknown), nothing killed.
    let out = d.ctl(&["delete", "vm2"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not know"),
        "{out:?}"
    );
    // `ctl delete` of vm1 stops the daemon's own worker only.
    let out = d.ctl(&["delete", "vm1"]);
    assert!(out.status.success(), "{out:?}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_worker(vm1_pid) {
        assert!(
            Instant::now() < deadline,
            "vm1's worker {vm1_pid} still runs"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // A delete kills before it answers: both answers are in.
    assert!(
        a.untouched() && b.untouched(),
        "a process named by a forged record was signalled"
    );
}

/// Waits until the daemon reports `id`'s worker in `state`; the endpoint's view.
fn wait_state(d: &mut Daemon, id: &str, state: &str) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let e = d.endpoint(id);
        if e["worker"]["state"] == state {
            return e;
        }
        assert!(Instant::now() < deadline, "{id} is not {state}: {e}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Issue 34: a record forged to name another daemon's worker (the same binary, the same
/// uid: it passes every check of the process itself) is a claim the worker cannot prove (it
/// has another daemon's nonce): the daemon neither adopts it, even through that worker's
/// own adoption socket linked into its directory, nor kills it at `ctl delete`.
#[test]
fn a_record_naming_another_daemons_worker_is_neither_adopted_nor_killed() {
    // Daemon A serves vm1 with worker `theirs`. Daemon B had a vm1 too; B is gone, and its
    // worker with it.
    let mut a = Daemon::start();
    a.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let theirs = a.endpoint("vm1")["worker"]["pid"].as_u64().expect("pid") as u32;
    let mut b = Daemon::start();
    b.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let gone = b.endpoint("vm1")["worker"]["pid"].as_u64().expect("pid") as u32;
    b.kill9();
    kill(gone);
    let deadline = Instant::now() + Duration::from_secs(10);
    while start_time(gone).is_some() {
        assert!(Instant::now() < deadline, "worker {gone} still runs");
        std::thread::sleep(Duration::from_millis(10));
    }
    let start = start_time(theirs).expect("A's worker runs");
    let record = b.state().join("workers/vm1.pid");
    let forged_nonce = "0123456789abcdef0123456789abcdef";

    // 1. B's record names A's worker (as a record of an earlier release would: no nonce).
    // No adoption socket of it in B's directory: orphaned, and `delete` must not kill it.
    fs::write(&record, format!("{theirs} {start}\n")).expect("forge");
    b.launch();
    wait_state(&mut b, "vm1", "orphaned");
    let out = b.ctl(&["delete", "vm1"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!("process {theirs}")) && said.contains("stop it first"),
        "{said}"
    );
    // Refused before anything was signalled (a kill would have come before the answer).
    assert!(is_worker(theirs), "A's worker was killed by B's delete");
    assert_eq!(a.endpoint("vm1")["worker"]["pid"], theirs);

    // 2. A is gone too, so its worker waits to be adopted; its adoption socket is linked
    // into B's directory. B's record names it with a nonce of its own making, then with
    // none: neither proves, the worker stays A's to adopt.
    b.kill9();
    a.kill9();
    let socket = format!("workers/w{theirs}.sock");
    fs::hard_link(a.state().join(&socket), b.state().join(&socket)).expect("link");
    for (forged, why) in [
        (
            format!("{theirs} {start} {forged_nonce}\n"),
            "another nonce",
        ),
        (
            format!("{theirs} {start}\n"),
            "has no nonce, but the process has one",
        ),
    ] {
        fs::write(&record, &forged).expect("forge");
        b.launch();
        let vm1 = wait_state(&mut b, "vm1", "orphaned");
        assert!(is_worker(theirs), "{vm1}");
        let log = b.log();
        assert!(log.contains(why), "B says why ({why}):\n{log}");
        b.kill9();
    }

    // Positive control: A, whose record the worker proves, adopts it again.
    a.launch();
    let vm1 = wait_state(&mut a, "vm1", "running");
    assert_eq!(vm1["worker"]["pid"], theirs, "{vm1}");
}
