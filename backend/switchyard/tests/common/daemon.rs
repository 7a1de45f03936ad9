//! `switchyard daemon` as a real process for the integration tests: a private state and run
//! directory, the control client, `ctl`, and cleanup of every worker it started.
//!
//! Workers outlive their daemon by design (guests keep their devices), so [`Daemon`]'s drop
//! kills the daemon and then every worker it recorded (`<state>/workers/*.pid`), by pid.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use switchyard_client::{Client, ClientConfig};
use switchyard_control::{ControlClient, ControlError};

use super::driver::Driver;
use super::ours::Ours;

pub const EXE: &str = env!("CARGO_BIN_EXE_switchyard");

/// The `switchyard` binary the daemon runs: `SWITCHYARD_BIN` when set (a test binary carried
/// to another machine, e.g. by `scripts/gpu-check.sh`, with the binary next to it), else the
/// one this test was built with.
pub fn exe() -> PathBuf {
    std::env::var_os("SWITCHYARD_BIN").map_or_else(|| PathBuf::from(EXE), PathBuf::from)
}

/// A daemon on a private state and run directory. Dropping it kills the daemon and every
/// worker it ever recorded.
pub struct Daemon {
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Every worker pid seen (the records are rewritten by each replacement).
    pub seen: Vec<u32>,
    /// `--config` file, if any.
    config: Option<PathBuf>,
    /// The open-file limit (soft and hard) the daemon runs under, if not the test's own.
    nofile: Option<u64>,
    /// `SWITCHYARD_WORKER_EXE`, if not the binary under test.
    worker_exe: Option<PathBuf>,
    /// `--state-dir` and `--run-dir`, if not `state` and `run` in the private directory.
    dirs: Option<(PathBuf, PathBuf)>,
    /// More arguments of `switchyard daemon`.
    args: Vec<String>,
    /// More environment of `switchyard daemon` (and so of its workers).
    env: Vec<(String, String)>,
}

impl Daemon {
    /// A daemon, not started yet ([`Daemon::launch`]).
    pub fn new() -> Self {
        Self {
            child: None,
            dir: tempfile::tempdir().expect("tempdir"),
            seen: Vec::new(),
            config: None,
            nofile: None,
            worker_exe: None,
            dirs: None,
            args: Vec::new(),
            env: Vec::new(),
        }
    }

    /// From the next [`Daemon::launch`] on, no environment of [`Daemon::with_env`].
    pub fn clear_env(&mut self) {
        self.env.clear();
    }

    /// Runs `switchyard daemon` (and so its workers) with this environment variable too
    /// (the test knobs of `switchyard_daemon::knobs`).
    pub fn with_env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.to_owned(), value.to_owned()));
        self
    }

    /// Runs `switchyard daemon` with these arguments too.
    pub fn with_args(mut self, args: &[&str]) -> Self {
        self.args = args.iter().map(|a| (*a).to_owned()).collect();
        self
    }

    pub fn start() -> Self {
        let mut d = Self::new();
        d.launch();
        d
    }

    /// A daemon with this configuration file.
    pub fn start_with_config(toml: &str) -> Self {
        let mut d = Self::new().with_config(toml);
        d.launch();
        d
    }

    /// Uses this configuration file.
    pub fn with_config(mut self, toml: &str) -> Self {
        self.set_config(toml);
        self
    }

    /// Uses this configuration file from the next [`Daemon::launch`] on.
    pub fn set_config(&mut self, toml: &str) {
        let config = self.dir.path().join("pool.toml");
        std::fs::write(&config, toml).expect("write the configuration");
        self.config = Some(config);
    }

    /// Runs under this open-file limit (soft and hard; `prlimit`), so the daemon cannot
    /// raise it.
    pub fn with_nofile(mut self, n: u64) -> Self {
        self.nofile = Some(n);
        self
    }

    /// Starts workers from `exe` instead of the binary under test.
    pub fn with_worker_exe(mut self, exe: PathBuf) -> Self {
        self.worker_exe = Some(exe);
        self
    }

    /// Uses these state and run directories (made by the test) instead of its own.
    pub fn with_dirs(mut self, state: &Path, run: &Path) -> Self {
        self.dirs = Some((state.to_owned(), run.to_owned()));
        self
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
    pub fn state(&self) -> PathBuf {
        self.dirs
            .as_ref()
            .map_or_else(|| self.dir.path().join("state"), |(s, _)| s.clone())
    }
    pub fn run_dir(&self) -> PathBuf {
        self.dirs
            .as_ref()
            .map_or_else(|| self.dir.path().join("run"), |(_, r)| r.clone())
    }
    pub fn socket(&self) -> PathBuf {
        self.run_dir().join("control.sock")
    }
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("daemon.log")).unwrap_or_default()
    }
    /// The daemon's pid, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts (or restarts) the daemon and waits until its API answers.
    pub fn launch(&mut self) {
        let log = File::options()
            .create(true)
            .append(true)
            .open(self.dir.path().join("daemon.log"))
            .expect("log");
        let mut cmd = match self.nofile {
            Some(n) => {
                let mut c = Command::new("prlimit");
                c.arg(format!("--nofile={n}:{n}")).arg("--").arg(exe());
                c
            }
            None => Command::new(exe()),
        };
        cmd.arg("daemon");
        if let Some(c) = &self.config {
            cmd.arg("--config").arg(c);
        }
        let worker_exe = self.worker_exe.clone().unwrap_or_else(exe);
        let child = cmd
            .arg("--state-dir")
            .arg(self.state())
            .arg("--run-dir")
            .arg(self.run_dir())
            .args(&self.args)
            .env("RUST_LOG", "info")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env("SWITCHYARD_WORKER_EXE", worker_exe)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("spawn the daemon");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(c) = ControlClient::connect(self.socket())
                && c.get("/health").is_ok()
            {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("the daemon exited ({status}):\n{}", self.log());
            }
            assert!(
                Instant::now() < deadline,
                "the daemon does not answer:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's process, from now on the caller's to stop.
    pub fn take_child(&mut self) -> Option<Child> {
        self.child.take()
    }

    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn client(&self) -> ControlClient {
        ControlClient::connect(self.socket()).expect("connect to the daemon")
    }

    pub fn ctl(&self, args: &[&str]) -> Output {
        Command::new(exe())
            .arg("ctl")
            .arg("--socket")
            .arg(self.socket())
            .args(args)
            .output()
            .expect("run ctl")
    }

    /// `ctl ARGS` that must succeed; its stdout.
    pub fn ctl_ok(&self, args: &[&str]) -> String {
        let out = self.ctl(args);
        assert!(
            out.status.success(),
            "ctl {args:?}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).expect("utf-8")
    }

    /// Every endpoint's id, sorted.
    pub fn endpoint_ids(&self) -> Vec<String> {
        let list = self.client().get("/v1/endpoints").expect("endpoints").body;
        let mut ids: Vec<String> = list
            .as_array()
            .expect("a list")
            .iter()
            .map(|e| e["endpoint"]["id"].as_str().expect("an id").to_owned())
            .collect();
        ids.sort();
        ids
    }

    pub fn endpoint(&mut self, id: &str) -> Value {
        let v = self
            .client()
            .get(&format!("/v1/endpoints/{id}"))
            .expect("get endpoint")
            .body;
        if let Some(pid) = v.pointer("/worker/pid").and_then(Value::as_u64) {
            self.seen.push(pid as u32);
        }
        v
    }

    pub fn events(&self) -> Vec<Value> {
        self.client()
            .stream("/events?since=0&follow=false")
            .expect("events")
            .map(|l| serde_json::from_str(&l.expect("line")).expect("json"))
            .collect()
    }

    /// The pool events of `kind` (`board_failed`, `failed_over`, ...), oldest first: the
    /// `pool` member of each.
    pub fn pool_events(&self, kind: &str) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter_map(|e| e.get("pool").cloned())
            .filter(|p| p["kind"]["type"] == kind)
            .collect()
    }

    /// The worker events of `kind` (`migrated`, `migration_aborted`, `migration`, ...),
    /// oldest first: the `worker` member of each.
    pub fn worker_events(&self, kind: &str) -> Vec<Value> {
        self.events()
            .into_iter()
            .filter_map(|e| e.get("worker").cloned())
            .filter(|w| w["event"] == kind)
            .collect()
    }

    /// The board of endpoint `id`'s lease (empty when it has none).
    pub fn board_of(&mut self, id: &str) -> String {
        self.endpoint(id)["lease"]["board"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }

    pub fn worker_pids(&self) -> Vec<u32> {
        let mut pids = self.seen.clone();
        if let Ok(dir) = std::fs::read_dir(self.state().join("workers")) {
            for f in dir.flatten() {
                if let Some(pid) = std::fs::read_to_string(f.path())
                    .ok()
                    .and_then(|t| t.split_whitespace().next()?.parse().ok())
                {
                    pids.push(pid);
                }
            }
        }
        pids
    }
}

impl Default for Daemon {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether `pid` is a running `switchyard worker` (not a zombie).
pub fn is_worker(pid: u32) -> bool {
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let zombie = stat
        .rfind(')')
        .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
    // `switchyard worker`, or `switchyard worker --no-jail`.
    !zombie && cmdline.split(|&b| b == 0).nth(1) == Some(b"worker".as_slice())
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("--- daemon log ---\n{}", self.log());
        }
        self.kill9();
        for pid in self.worker_pids() {
            if is_worker(pid)
                && let Some(p) = rustix::process::Pid::from_raw(pid as i32)
            {
                let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
            }
        }
    }
}

pub fn api_status(r: Result<switchyard_control::JsonReply, ControlError>) -> (u16, String) {
    match r {
        Err(ControlError::Api { status, code, .. }) => (status, code),
        other => panic!("expected an API error, got {other:?}"),
    }
}

pub fn connect(socket: &Path) -> Driver<Ours> {
    let client = Client::connect_with(
        socket,
        ClientConfig {
            timeout: Some(Duration::from_secs(5)),
            ..ClientConfig::default()
        },
    )
    .expect("connect to the endpoint");
    Driver::new(Ours(client))
}

pub fn socket_of(endpoint: &Value) -> PathBuf {
    PathBuf::from(
        endpoint
            .pointer("/endpoint/socket")
            .and_then(Value::as_str)
            .expect("socket"),
    )
}

/// Open descriptors of process `pid`.
pub fn fd_count(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}
