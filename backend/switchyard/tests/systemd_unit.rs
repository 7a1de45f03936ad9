//! The packaged systemd unit (`backend/switchyard/debian/switchyard.service`) keeps a guest's
//! device through a stop and a start of the service: the daemon is started as the unit says,
//! reports ready, serves an endpoint to a client doing jobs, is stopped the way the unit's
//! `KillMode=` stops it, and started again; the client's jobs go on bit-exact and the new
//! daemon adopts the endpoint's worker (the same process, not a replacement).
//!
//! systemd cannot run as PID 1 where these tests run (a container), so its part is played
//! here, read from the unit file: `ExecStart=` (the binary under test in place of
//! /usr/bin/switchyard, with the unit's exact arguments), a clean environment with the
//! unit's `Environment=`, the directories of `RuntimeDirectory=`, `StateDirectory=` and
//! `ConfigurationDirectory=` (created with their modes, given to `Group=`, named by
//! `$RUNTIME_DIRECTORY`, ... as systemd does; the run directory removed at stop unless
//! `RuntimeDirectoryPreserve=yes`), `Group=` and `UMask=`, `$NOTIFY_SOCKET` for
//! `Type=notify` (a socket of the test's, which checks that `READY=1` comes from the main
//! process: `NotifyAccess=main`), and the stop: `KillMode=` decides which processes get
//! SIGTERM. So a change of any of these in the unit changes what this test runs. What
//! systemd alone can check (the sandboxing, `DeviceAllow=`, the cgroup) is left to
//! `systemd-analyze verify` (scripts/check-package.sh).
//!
//! Needs root (the unit runs the daemon as root with `Group=switchyard`): `#[ignore = "needs
//! root"]`, run by name as root by `scripts/test.sh`, which fails if it did not run. The `switchyard`
//! group is created from the package's sysusers.d file when the system lacks it, and removed
//! again.
//!
//! Also here, the rest of what the package installs from this crate: its configuration file
//! is the embedded default, and `switchyard generate` writes a man page per visible command
//! and completions without the hidden ones.
#![forbid(unsafe_code)]

mod common;

use common::nobody::gid_of;

use std::fs::File;
use std::mem::MaybeUninit;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::UnixDatagram;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::daemon::{EXE, connect, is_worker};
use serde_json::Value;
use switchyard_control::ControlClient;
use switchyard_softgpu::regs::SCRATCH;

const DEBIAN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/debian");
/// Where the package installs the binary (the unit's `ExecStart=` names it).
const PACKAGED_EXE: &str = "/usr/bin/switchyard";

/// A unit file: `(section, key, value)` in order.
struct Unit(Vec<(String, String, String)>);

impl Unit {
    fn load() -> Self {
        let path = Path::new(DEBIAN).join("switchyard.service");
        let text = std::fs::read_to_string(&path).expect("the unit file");
        let mut section = String::new();
        let mut entries = Vec::new();
        for line in text.lines().map(str::trim) {
            if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
                continue;
            }
            assert!(!line.ends_with('\\'), "no continuation lines: {line}");
            if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
                section = name.to_owned();
                continue;
            }
            let (key, value) = line.split_once('=').expect("KEY=VALUE");
            entries.push((
                section.clone(),
                key.trim().to_owned(),
                value.trim().to_owned(),
            ));
        }
        Unit(entries)
    }

    /// Every value of `[Service]`'s `key`, in order.
    fn all(&self, key: &str) -> Vec<&str> {
        self.0
            .iter()
            .filter(|(s, k, _)| s == "Service" && k == key)
            .map(|(_, _, v)| v.as_str())
            .collect()
    }

    /// The value of `[Service]`'s `key` (the last one wins, as in systemd).
    fn get(&self, key: &str) -> Option<&str> {
        self.all(key).pop()
    }

    /// `ExecStart=` split into words (the unit uses no quoting, prefixes or specifiers).
    fn exec_start(&self) -> Vec<String> {
        let line = self.get("ExecStart").expect("ExecStart=");
        assert!(
            !line.contains(['"', '\'', '%', '$', '\\']) && !line.starts_with(['-', '@', '+', '!']),
            "this test splits ExecStart= on spaces: {line}"
        );
        line.split_whitespace().map(str::to_owned).collect()
    }

    /// `Environment=` assignments.
    fn environment(&self) -> Vec<(String, String)> {
        self.all("Environment")
            .iter()
            .flat_map(|v| {
                assert!(!v.contains(['"', '\'', '%']), "no quoting: {v}");
                v.split_whitespace()
            })
            .map(|a| {
                let (k, v) = a.split_once('=').expect("NAME=VALUE");
                (k.to_owned(), v.to_owned())
            })
            .collect()
    }

    /// A `*Mode=` setting (octal), or systemd's default.
    fn mode(&self, key: &str, default: u32) -> u32 {
        self.get(key)
            .map_or(default, |m| u32::from_str_radix(m, 8).expect("octal mode"))
    }
}

/// A notification from `$NOTIFY_SOCKET`: the text and the sender's pid.
#[derive(Debug, Clone)]
struct Notification {
    text: String,
    pid: Option<u32>,
}

/// systemd's part, for one service: its directories, its notification socket, its main
/// process, and the group `Group=` names.
struct Manager {
    unit: Unit,
    dir: tempfile::TempDir,
    notify: UnixDatagram,
    main: Option<Child>,
    gid: Option<u32>,
    /// The group was created for the test (and is removed at the end).
    created_group: Option<String>,
    /// Every notification received.
    notes: Vec<Notification>,
}

impl Manager {
    fn new(unit: Unit) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut created_group = None;
        let gid = unit.get("Group").map(|group| {
            if let Some(gid) = gid_of(group) {
                return gid;
            }
            // As the package's postinst does.
            let out = Command::new("systemd-sysusers")
                .arg(Path::new(DEBIAN).join("switchyard.sysusers"))
                .output()
                .expect("run systemd-sysusers");
            assert!(out.status.success(), "systemd-sysusers: {out:?}");
            created_group = Some(group.to_owned());
            eprintln!("created the group `{group}` for the test (removed at its end)");
            gid_of(group).unwrap_or_else(|| panic!("no group `{group}` after systemd-sysusers"))
        });
        let notify = UnixDatagram::bind(dir.path().join("notify")).expect("notify socket");
        rustix::net::sockopt::set_socket_passcred(&notify, true).expect("SO_PASSCRED");
        notify
            .set_read_timeout(Some(Duration::from_millis(100)))
            .expect("timeout");
        let m = Self {
            unit,
            dir,
            notify,
            main: None,
            gid,
            created_group,
            notes: Vec::new(),
        };
        // The configuration directory exists with the package's file before any start.
        if let Some(name) = m.unit.get("ConfigurationDirectory") {
            let conf = m.dir.path().join("etc").join(name);
            std::fs::create_dir_all(&conf).expect("mkdir");
            std::fs::copy(Path::new(DEBIAN).join("pool.toml"), conf.join("pool.toml"))
                .expect("the packaged pool.toml");
        }
        m
    }

    /// `$RUNTIME_DIRECTORY`.
    fn run_dir(&self) -> PathBuf {
        let name = self
            .unit
            .get("RuntimeDirectory")
            .expect("RuntimeDirectory=");
        self.dir.path().join("run").join(name)
    }

    /// `$STATE_DIRECTORY`.
    fn state_dir(&self) -> PathBuf {
        let name = self.unit.get("StateDirectory").expect("StateDirectory=");
        self.dir.path().join("state").join(name)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("journal")).unwrap_or_default()
    }

    fn control(&self) -> ControlClient {
        ControlClient::connect(self.run_dir().join("control.sock")).expect("the control socket")
    }

    /// An exec directory as systemd makes it at start: created, given `mode` and the unit's
    /// user (root) and group.
    fn exec_dir(&self, path: &Path, mode: u32) {
        std::fs::create_dir_all(path).expect("mkdir");
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
        rustix::fs::chown(
            path,
            Some(rustix::fs::Uid::ROOT),
            Some(rustix::fs::Gid::from_raw(self.gid.unwrap_or(0))),
        )
        .expect("chown");
    }

    /// `systemctl start`: the directories, the environment, `Group=`, `UMask=`, then
    /// `ExecStart=`; returns once `READY=1` came from the main process.
    fn start(&mut self) {
        let exec = self.unit.exec_start();
        assert_eq!(exec[0], PACKAGED_EXE, "the unit runs the packaged binary");
        let mut cmd = Command::new("sh");
        // `UMask=` (systemd's default 0022), then the daemon in the shell's place.
        let umask = self.unit.get("UMask").unwrap_or("0022");
        cmd.arg("-c")
            .arg(r#"umask "$0" && exec "$@""#)
            .arg(umask)
            .arg(EXE)
            .args(&exec[1..]);
        cmd.env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin");
        for (k, v) in self.unit.environment() {
            cmd.env(k, v);
        }
        let dirs = [
            ("RuntimeDirectory", "RUNTIME_DIRECTORY", self.run_dir()),
            ("StateDirectory", "STATE_DIRECTORY", self.state_dir()),
        ];
        for (key, var, path) in dirs {
            if self.unit.get(key).is_some() {
                self.exec_dir(&path, self.unit.mode(&format!("{key}Mode"), 0o755));
                cmd.env(var, &path);
            }
        }
        if let Some(name) = self.unit.get("ConfigurationDirectory") {
            cmd.env(
                "CONFIGURATION_DIRECTORY",
                self.dir.path().join("etc").join(name),
            );
        }
        assert_eq!(self.unit.get("Type"), Some("notify"));
        cmd.env("NOTIFY_SOCKET", self.dir.path().join("notify"));
        if let Some(gid) = self.gid {
            cmd.gid(gid);
        }
        let journal = File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join("journal"))
            .expect("journal");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(journal.try_clone().expect("dup"))
            .stderr(journal)
            .spawn()
            .expect("ExecStart=");
        let pid = child.id();
        self.main = Some(child);
        let ready = self.wait_note(Duration::from_secs(60), |n| {
            n.text.lines().any(|l| l == "READY=1")
        });
        assert_eq!(
            ready.pid,
            Some(pid),
            "NotifyAccess=main: READY=1 comes from the main process"
        );
    }

    /// The next notification `want` accepts (earlier ones are kept in `notes`); panics when
    /// the main process exits first or after `timeout`.
    fn wait_note(
        &mut self,
        timeout: Duration,
        want: impl Fn(&Notification) -> bool,
    ) -> Notification {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(n) = self.recv() {
                self.notes.push(n.clone());
                if want(&n) {
                    return n;
                }
                continue;
            }
            if let Some(status) = self.main.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!(
                    "the main process exited ({status}) before notifying; notes {:?}\n{}",
                    self.notes,
                    self.log()
                );
            }
            assert!(
                Instant::now() < deadline,
                "no such notification; notes {:?}\n{}",
                self.notes,
                self.log()
            );
        }
    }

    fn recv(&self) -> Option<Notification> {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
        let mut buf = [0u8; 4096];
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmCredentials(1))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let msg = match rustix::net::recvmsg(
            &self.notify,
            &mut [std::io::IoSliceMut::new(&mut buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(msg) => msg,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => return None,
            Err(e) => panic!("recvmsg on the notification socket: {e}"),
        };
        let pid = control.drain().find_map(|m| match m {
            RecvAncillaryMessage::ScmCredentials(c) => Some(c.pid.as_raw_nonzero().get() as u32),
            _ => None,
        });
        Some(Notification {
            text: String::from_utf8_lossy(&buf[..msg.bytes]).into_owned(),
            pid,
        })
    }

    /// The processes of the service's control group other than the main one: the workers
    /// (recorded by the daemon), whoever started them.
    fn others(&self) -> Vec<u32> {
        let mut pids = Vec::new();
        if let Ok(dir) = std::fs::read_dir(self.state_dir().join("workers")) {
            for f in dir.flatten() {
                let pid = std::fs::read_to_string(f.path())
                    .ok()
                    .and_then(|t| t.split_whitespace().next()?.parse().ok());
                if let Some(pid) = pid
                    && is_worker(pid)
                {
                    pids.push(pid);
                }
            }
        }
        pids
    }

    /// `systemctl stop`: `KillMode=` says who gets SIGTERM (and, for `mixed`, who gets
    /// SIGKILL once the main process is gone); the run directory goes unless preserved.
    fn stop(&mut self) {
        use rustix::process::{Pid, Signal, kill_process};
        let signal = |pid: u32, sig: Signal| {
            if let Some(p) = Pid::from_raw(pid as i32) {
                let _ = kill_process(p, sig);
            }
        };
        let mut main = self.main.take().expect("running");
        let pid = main.id();
        let mode = self.unit.get("KillMode").unwrap_or("control-group");
        let others = self.others();
        match mode {
            "process" | "mixed" => signal(pid, Signal::TERM),
            "control-group" => {
                signal(pid, Signal::TERM);
                others.iter().for_each(|&p| signal(p, Signal::TERM));
            }
            "none" => {}
            other => panic!("KillMode={other} is not one systemd knows"),
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        let status = loop {
            if let Some(status) = main.try_wait().expect("wait") {
                break status;
            }
            if Instant::now() > deadline {
                // TimeoutStopSec= ran out (shortened here): SIGKILL, then as KillMode= says.
                signal(pid, Signal::KILL);
                break main.wait().expect("wait");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        if matches!(mode, "mixed" | "control-group") {
            others.iter().for_each(|&p| signal(p, Signal::KILL));
        }
        assert!(
            status.success(),
            "the daemon's exit: {status}\n{}",
            self.log()
        );
        // What it said while stopping.
        while let Some(n) = self.recv() {
            self.notes.push(n);
        }
        let preserve = self.unit.get("RuntimeDirectoryPreserve").unwrap_or("no");
        if preserve != "yes" {
            let _ = std::fs::remove_dir_all(self.run_dir());
        }
    }
}

impl Drop for Manager {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- journal ---\n{}", self.log());
        }
        if let Some(mut c) = self.main.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        for pid in self.others() {
            if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
        if let Some(group) = &self.created_group {
            let _ = Command::new("groupdel").arg(group).status();
        }
    }
}

/// (mode bits, gid) of `path`, not followed.
fn access(path: &Path) -> (u32, u32) {
    let m = std::fs::symlink_metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.mode() & 0o7777, m.gid())
}

fn endpoint(m: &Manager, id: &str) -> Value {
    m.control()
        .get(&format!("/v1/endpoints/{id}"))
        .expect("the endpoint")
        .body
}

#[test]
#[ignore = "needs root"]
fn a_stop_and_start_of_the_unit_keeps_the_guests_device() {
    assert!(
        rustix::process::geteuid().is_root(),
        "needs root (the unit runs the daemon as root with Group=switchyard)"
    );
    let unit = Unit::load();
    assert_eq!(
        unit.exec_start()[1..],
        ["daemon", "--socket-group", "switchyard"],
        "the arguments this test was written for"
    );
    let mut m = Manager::new(unit);
    m.start();
    let log = m.log();
    for line in [
        "run directory from $RUNTIME_DIRECTORY",
        "state directory from $STATE_DIRECTORY",
        "configuration from $CONFIGURATION_DIRECTORY",
    ] {
        assert!(log.contains(line), "{line} in\n{log}");
    }
    let gid = m.gid.expect("Group=");
    let control = m.run_dir().join("control.sock");
    assert_eq!(access(&control), (0o660, gid), "the control socket");
    assert_eq!(
        access(&m.run_dir()).0,
        m.unit.mode("RuntimeDirectoryMode", 0o755),
        "the daemon keeps systemd's run directory as it is"
    );
    assert!(m.state_dir().join("pool.redb").exists());

    // An endpoint, and a client doing jobs on it.
    let out = Command::new(EXE)
        .arg("ctl")
        .arg("--socket")
        .arg(&control)
        .args(["create", "vm1"])
        .output()
        .expect("ctl create");
    assert!(out.status.success(), "{out:?}");
    let before = endpoint(&m, "vm1");
    let socket = m.run_dir().join("endpoints/vm1.sock");
    assert_eq!(before["endpoint"]["socket"], socket.display().to_string());
    assert_eq!(access(&socket), (0o660, gid), "the endpoint socket");
    let mut client = connect(&socket);
    client.setup_queue(0);
    client.w32(SCRATCH, 0x5157_0001);
    common::workload::fill_copy_round(&mut client, 0, 0);

    // Stop and start the service while the client works; a few jobs run while no daemon does.
    let rounds = Arc::new(AtomicU64::new(1));
    let done = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicBool::new(false));
    let manager = {
        let (rounds, done, failed) = (rounds.clone(), done.clone(), failed.clone());
        std::thread::spawn(move || {
            // Pacing: the client works a while before the stop.
            std::thread::sleep(Duration::from_millis(100));
            m.stop();
            let stopped_at = rounds.load(Ordering::SeqCst);
            let deadline = Instant::now() + Duration::from_secs(30);
            while rounds.load(Ordering::SeqCst) < stopped_at + 5 {
                if failed.load(Ordering::SeqCst) {
                    return m;
                }
                assert!(
                    Instant::now() < deadline,
                    "no jobs ran while the daemon was stopped"
                );
                std::thread::sleep(Duration::from_millis(5));
            }
            m.start();
            done.store(true, Ordering::SeqCst);
            m
        })
    };
    let start = Instant::now();
    let work = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        while !done.load(Ordering::SeqCst) && !manager.is_finished() {
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "the restart takes too long"
            );
            let r = rounds.load(Ordering::SeqCst);
            common::workload::fill_copy_round(&mut client, r, 0);
            rounds.store(r + 1, Ordering::SeqCst);
        }
    }));
    if let Err(panic) = work {
        // The manager's processes and group go with it (its drop) before the test fails.
        failed.store(true, Ordering::SeqCst);
        drop(manager.join());
        std::panic::resume_unwind(panic);
    }
    let m = manager.join().expect("the stop and the start");
    let r = rounds.load(Ordering::SeqCst);
    for r in r..r + 5 {
        common::workload::fill_copy_round(&mut client, r, 0);
    }
    assert_eq!(client.r32(SCRATCH), 0x5157_0001, "the device's state");

    // The new daemon adopted the worker: the same process, no restart.
    let after = endpoint(&m, "vm1");
    assert_eq!(after["worker"]["state"], "running", "{after}");
    assert_eq!(after["worker"]["pid"], before["worker"]["pid"], "{after}");
    assert_eq!(after["worker"]["restarts"], 0, "{after}");
    assert!(m.log().contains("worker adopted"), "{}", m.log());
    assert_eq!(
        access(&socket),
        (0o660, gid),
        "the adopted endpoint's socket"
    );
    assert_eq!(access(&control), (0o660, gid), "the new control socket");

    // What the service manager was told, from the main process each time.
    let texts: Vec<&str> = m.notes.iter().map(|n| n.text.as_str()).collect();
    let ready: Vec<&&str> = texts.iter().filter(|t| t.starts_with("READY=1")).collect();
    assert_eq!(ready.len(), 2, "{texts:?}");
    assert!(ready[0].contains("STATUS=Endpoints: 0 served"), "{texts:?}");
    assert!(
        ready[1].contains("STATUS=Endpoints: 1 served, 0 not supervised"),
        "{texts:?}"
    );
    let stopping = texts
        .iter()
        .position(|t| t.starts_with("STOPPING=1"))
        .expect("STOPPING=1");
    assert!(
        texts.iter().position(|t| t.starts_with("READY=1")) < Some(stopping)
            && Some(stopping) < texts.iter().rposition(|t| t.starts_with("READY=1")),
        "{texts:?}"
    );
    let pids: Vec<Option<u32>> = m.notes.iter().map(|n| n.pid).collect();
    assert!(
        pids.iter().all(|p| p.is_some_and(|p| !is_worker(p))),
        "only the daemon notifies: {pids:?}"
    );
}

/// The configuration the package installs as /etc/switchyard/pool.toml is the daemon's
/// embedded default, comments aside.
#[test]
fn the_packaged_configuration_is_the_embedded_default() {
    let text = std::fs::read_to_string(Path::new(DEBIAN).join("pool.toml")).expect("pool.toml");
    let packaged = switchyard_pool::PoolConfig::from_toml(&text, &switchyard_kinds::Registry)
        .expect("the packaged configuration parses");
    assert_eq!(packaged, switchyard_pool::PoolConfig::default());
}

/// The man pages and completions the package ships (`switchyard generate`): a page per
/// visible command, none for the hidden ones, and completions that know the daemon's options.
#[test]
fn the_package_gets_a_man_page_per_command_and_completions() {
    let dir = tempfile::tempdir().expect("tempdir");
    let run = |what: &str| {
        let out = Command::new(EXE)
            .args(["generate", what, "--out"])
            .arg(dir.path().join(what))
            .output()
            .expect("switchyard generate");
        assert!(out.status.success(), "{out:?}");
        let listed: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(PathBuf::from)
            .collect();
        assert!(listed.iter().all(|p| p.is_file()), "{listed:?}");
        listed
    };
    let pages = run("man");
    let names: Vec<String> = pages
        .iter()
        .map(|p| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    for page in [
        "switchyard.1",
        "switchyard-serve.1",
        "switchyard-daemon.1",
        "switchyard-ctl.1",
        "switchyard-ctl-create.1",
        "switchyard-ctl-upgrade.1",
        "switchyard-inventory.1",
        "switchyard-inventory-bind.1",
    ] {
        assert!(names.iter().any(|n| n == page), "{page} in {names:?}");
    }
    assert!(
        !names
            .iter()
            .any(|n| n.contains("worker") || n.contains("generate") || n.contains("help")),
        "hidden commands have no page: {names:?}"
    );
    let daemon = std::fs::read_to_string(dir.path().join("man/switchyard-daemon.1")).expect("page");
    assert!(daemon.contains("socket\\-group"), "{daemon}");

    let completions = run("completions");
    assert_eq!(completions.len(), 3, "{completions:?}");
    let bash =
        std::fs::read_to_string(dir.path().join("completions/switchyard.bash")).expect("bash");
    assert!(bash.contains("--socket-group") && bash.contains("inventory"));
    assert!(!bash.contains(" worker "), "no hidden command: {bash}");
    let zsh = std::fs::read_to_string(dir.path().join("completions/_switchyard")).expect("zsh");
    assert!(
        zsh.contains("'daemon:") && !zsh.contains("'worker:"),
        "{zsh}"
    );
    let fish =
        std::fs::read_to_string(dir.path().join("completions/switchyard.fish")).expect("fish");
    assert!(
        fish.contains("-a \"daemon\"") && !fish.contains("-a \"worker\""),
        "{fish}"
    );
}
