//! `switchyard daemon` and its state directory's input (issue 34, item 7): a truncated or
//! empty `pool.redb` is refused (exit 1, naming the file and what to do), never a panic and
//! never re-initialised, and `--reinit` moves it aside for a new one; the store is created
//! 0600 whatever the umask, so a daemon started under umask 002 opens it again; systemd's
//! directory variables, when set, must be absolute (else exit 2).
#![forbid(unsafe_code)]

mod common;

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::daemon::{Daemon, exe, is_worker};

/// How a daemon that was expected to refuse to start ended.
#[derive(Debug)]
enum Ended {
    /// It exited: its status code and stderr.
    Exited(Option<i32>, String),
    /// It started (its control socket listened; killed): its stderr.
    Started(String),
}

impl Ended {
    /// What the daemon said.
    fn stderr(&self) -> &str {
        match self {
            Ended::Exited(_, stderr) | Ended::Started(stderr) => stderr,
        }
    }
}

/// Runs `cmd` (a `switchyard daemon` whose control socket is `control`) until it exits or
/// its control socket listens (then it is killed).
fn run_until_refused_or_started(mut cmd: Command, control: &Path) -> Ended {
    let mut child = cmd
        .env("RUST_LOG", "info")
        .env("SWITCHYARD_WORKER_EXE", exe())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the daemon");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if child.try_wait().expect("wait").is_some() {
            let out = child.wait_with_output().expect("output");
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            return Ended::Exited(out.status.code(), stderr);
        }
        // Connected: a socket left by a killed daemon refuses connections.
        let listening = std::os::unix::net::UnixStream::connect(control).is_ok();
        if listening || Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
            assert!(
                listening,
                "the daemon neither exited nor listened in 20 s:\n{stderr}"
            );
            return Ended::Started(stderr);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `switchyard daemon` on `d`'s directories, with `args` too.
fn daemon_on(d: &Daemon, args: &[&str]) -> Command {
    let mut cmd = Command::new(exe());
    cmd.arg("daemon")
        .arg("--state-dir")
        .arg(d.state())
        .arg("--run-dir")
        .arg(d.run_dir())
        .args(args);
    cmd
}

/// A daemon whose store holds endpoint vm1, stopped (SIGKILL), its worker killed too.
fn stopped_with_a_lease() -> Daemon {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let pid = d.endpoint("vm1")["worker"]["pid"]
        .as_u64()
        .expect("a worker") as u32;
    d.kill9();
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_worker(pid) {
        assert!(Instant::now() < deadline, "worker {pid} still runs");
        std::thread::sleep(Duration::from_millis(10));
    }
    d
}

#[test]
fn a_damaged_store_is_refused_naming_it_and_reinit_starts_afresh() {
    let d = stopped_with_a_lease();
    let store = d.state().join("pool.redb");
    let good = fs::read(&store).expect("the store");
    for (what, bytes, problem) in [
        ("truncated", &good[..good.len() / 2], "is truncated"),
        ("empty", &good[..0], "is empty"),
    ] {
        fs::write(&store, bytes).expect("damage the store");
        let ended = run_until_refused_or_started(daemon_on(&d, &[]), &d.socket());
        match &ended {
            Ended::Exited(Some(1), stderr)
                if stderr.contains(&format!("Cannot open the pool store {}", store.display()))
                    && stderr.contains(problem)
                    && stderr.contains("--reinit") => {}
            other => panic!("a {what} store: {other:?}"),
        }
        assert_eq!(
            fs::read(&store).expect("still there"),
            bytes,
            "the {what} store was changed"
        );
    }
    // The administrator chooses to start afresh: the damaged file is kept aside.
    fs::write(&store, &good[..good.len() / 2]).expect("damage the store");
    let mut d = d.with_args(&["--reinit"]);
    d.launch();
    let aside: Vec<PathBuf> = fs::read_dir(d.state())
        .expect("state")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.to_string_lossy().contains("pool.redb.damaged-"))
        .collect();
    assert_eq!(aside.len(), 1, "{aside:?}");
    assert_eq!(fs::read(&aside[0]).expect("kept"), &good[..good.len() / 2]);
    let out = d.ctl(&["endpoint", "vm1"]);
    assert!(!out.status.success(), "vm1 is gone with the old store");
    assert!(d.log().contains("moved aside"), "{}", d.log());
    d.ctl_ok(&["create", "vm2", "--pool", "default"]);
    // ... and the new store opens again without --reinit.
    d.kill9();
    let mut d = d.with_args(&[]);
    d.launch();
    assert_eq!(d.endpoint("vm2")["endpoint"]["id"], "vm2");
}

#[test]
fn a_store_made_under_umask_002_is_private_and_opens_again() {
    let d = Daemon::new();
    let start = || {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(r#"umask 002; exec "$0" daemon --state-dir "$1" --run-dir "$2""#)
            .arg(exe())
            .arg(d.state())
            .arg(d.run_dir());
        run_until_refused_or_started(cmd, &d.socket())
    };
    let first = start();
    assert!(
        matches!(first, Ended::Started(_)),
        "the first start:\n{}",
        first.stderr()
    );
    match start() {
        Ended::Started(_) => {}
        other => panic!("the daemon refuses its own store: {other:?}"),
    }
    let mode = fs::metadata(d.state().join("pool.redb"))
        .expect("the store")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600);
}

#[test]
fn a_systemd_directory_variable_that_is_not_absolute_exits_2() {
    let d = Daemon::new();
    let base = d.dir();
    // The directories the daemon would use if it ignored the variable: private ones.
    let config = base.join("pool.toml");
    fs::write(
        &config,
        format!(
            "[daemon]\nstate_dir = \"{0}/cfg-state\"\ncontrol_socket = \"{0}/cfg-run/control.sock\"\nendpoint_dir = \"{0}/cfg-run/endpoints\"\n",
            base.display()
        ),
    )
    .expect("config");
    let control = base.join("cfg-run/control.sock");
    for (var, value) in [
        ("RUNTIME_DIRECTORY", "relative/run"),
        ("RUNTIME_DIRECTORY", ""),
        ("STATE_DIRECTORY", ""),
        ("STATE_DIRECTORY", "state"),
        ("CONFIGURATION_DIRECTORY", "etc/switchyard"),
    ] {
        let mut cmd = Command::new(exe());
        cmd.arg("daemon");
        if var != "CONFIGURATION_DIRECTORY" {
            cmd.arg("--config").arg(&config);
        } else {
            cmd.arg("--state-dir")
                .arg(base.join("cfg-state"))
                .arg("--run-dir")
                .arg(base.join("cfg-run"));
        }
        cmd.env(var, value);
        let ended = run_until_refused_or_started(cmd, &control);
        match &ended {
            Ended::Exited(Some(2), stderr)
                if stderr.contains(&format!("${var} is {value:?}"))
                    && stderr.contains("absolute") => {}
            other => panic!("{var}={value:?}: {other:?}"),
        }
    }
    // Positive control: the same command lines start without the variables.
    let ended = run_until_refused_or_started(
        {
            let mut cmd = Command::new(exe());
            cmd.arg("daemon").arg("--config").arg(&config);
            cmd
        },
        &control,
    );
    assert!(matches!(ended, Ended::Started(_)), "{ended:?}");
}
