//! A `switchyard daemon` (the pool daemon) started by the harness ([`PoolDaemon`]).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use switchyard_control::ControlClient;

use crate::{GuestEnv, stop_child};

/// A `switchyard daemon` on a test's log directory with a configuration (empty: the embedded
/// default), its log in `daemon.log`; dropping it deletes the endpoints it created (their
/// workers stop, orphans included) and stops it (SIGTERM; a daemon that does not stop within
/// 15 s is killed and, unless the test already fails, fails it).
#[derive(Debug)]
pub struct PoolDaemon {
    child: Child,
    socket: PathBuf,
    /// The endpoints [`PoolDaemon::create`] created, deleted on drop.
    pub endpoints: Vec<String>,
}

impl PoolDaemon {
    /// Starts the daemon with `config` (written to `pool.toml`; empty: the embedded default)
    /// and waits until its control API answers.
    pub fn start(env: &GuestEnv, dir: &Path, config: &str) -> Self {
        Self::start_with(env, dir, config, &[])
    }

    /// [`PoolDaemon::start`] with more arguments of `switchyard daemon` (`--faults`).
    pub fn start_with(env: &GuestEnv, dir: &Path, config: &str, args: &[&str]) -> Self {
        Self::launch(env, dir, None, config, args)
    }

    /// [`PoolDaemon::start`] for one of several daemons of a test (e.g. one per "host"):
    /// its files are `pool-NAME.toml`, `daemon-NAME.log`, `state-NAME` and `run-NAME`.
    pub fn start_named(env: &GuestEnv, dir: &Path, name: &str, config: &str) -> Self {
        Self::launch(env, dir, Some(name), config, &[])
    }

    fn launch(env: &GuestEnv, dir: &Path, name: Option<&str>, config: &str, args: &[&str]) -> Self {
        let named = |base: &str, ext: &str| match name {
            Some(n) => dir.join(format!("{base}-{n}{ext}")),
            None => dir.join(format!("{base}{ext}")),
        };
        let file = named("pool", ".toml");
        std::fs::write(&file, config).expect("write the pool configuration");
        let log = std::fs::File::create(named("daemon", ".log")).expect("daemon log");
        let mut cmd = Command::new(&env.switchyard);
        cmd.arg("daemon");
        if !config.is_empty() {
            cmd.arg("--config").arg(&file);
        }
        let run = named("run", "");
        let child = cmd
            .args(args)
            .arg("--state-dir")
            .arg(named("state", ""))
            .arg("--run-dir")
            .arg(&run)
            .env("RUST_LOG", "info")
            .env("SWITCHYARD_WORKER_EXE", &env.switchyard)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the daemon");
        let mut d = Self {
            child,
            socket: run.join("control.sock"),
            endpoints: Vec::new(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        while d.client().and_then(|c| c.get("/health").ok()).is_none() {
            assert!(Instant::now() < deadline, "the daemon does not answer");
            if let Ok(Some(st)) = d.child.try_wait() {
                panic!("the daemon exited: {st}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        d
    }

    /// Its control socket (`ctl --socket`).
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// A client of its control API, if it answers.
    pub fn client(&self) -> Option<ControlClient> {
        ControlClient::connect(&self.socket).ok()
    }

    /// A client of its control API.
    pub fn api(&self) -> ControlClient {
        self.client().expect("connect to the daemon")
    }

    /// Creates an endpoint leased from `pool`; returns its socket.
    pub fn create(&mut self, id: &str, pool: &str) -> PathBuf {
        let reply = self
            .api()
            .post(
                "/v1/endpoints",
                &serde_json::json!({ "id": id, "pool": pool }),
            )
            .expect("create the endpoint");
        self.endpoints.push(id.to_owned());
        PathBuf::from(
            reply.body["endpoint"]["socket"]
                .as_str()
                .expect("the endpoint's socket"),
        )
    }

    /// Kills the daemon with SIGKILL (its workers run on).
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts a new daemon on the same directories and configuration in place of this one
    /// (killed before: [`PoolDaemon::kill9`]); the old log is kept as `daemon.1.log`.
    pub fn restart(&mut self, env: &GuestEnv, dir: &Path) {
        let endpoints = std::mem::take(&mut self.endpoints);
        let config = std::fs::read_to_string(dir.join("pool.toml")).expect("configuration");
        std::fs::rename(dir.join("daemon.log"), dir.join("daemon.1.log")).expect("keep the log");
        // The old child is reaped; the new one takes its place.
        let fresh = PoolDaemon::start(env, dir, &config);
        let old = std::mem::replace(self, fresh);
        std::mem::forget(old);
        self.endpoints = endpoints;
    }
}

impl Drop for PoolDaemon {
    fn drop(&mut self) {
        if let Some(c) = self.client() {
            for id in &self.endpoints {
                let _ = c.delete(&format!("/v1/endpoints/{id}"));
            }
        }
        if stop_child(&mut self.child, Duration::from_secs(15)).is_none()
            && !std::thread::panicking()
        {
            panic!("the pool daemon did not stop within 15 s of SIGTERM (killed)");
        }
    }
}
