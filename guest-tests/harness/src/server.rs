//! A `switchyard serve` process started by the harness ([`Server`]).

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::Duration;

use crate::{GuestEnv, HarnessError, Result, kill_child, stop_child, wait_until};

/// A `switchyard serve` process started by the harness.
#[derive(Debug)]
pub struct Server {
    child: Option<Child>,
    /// Its socket.
    pub socket: PathBuf,
    /// Its stderr log.
    pub log: PathBuf,
}

impl Server {
    /// Starts the server with `device` (e.g. `softgpu,vram=64M`) and waits for its socket.
    pub fn start(env: &GuestEnv, dir: &Path, device: &str) -> Result<Server> {
        Self::start_with(env, dir, device, &[])
    }

    /// Like [`Server::start`], with more `switchyard serve` arguments.
    pub fn start_with(env: &GuestEnv, dir: &Path, device: &str, extra: &[&str]) -> Result<Server> {
        let rust_log = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
        Self::start_logging(env, dir, device, extra, &rust_log)
    }

    /// Like [`Server::start_with`], with the server's `RUST_LOG` filter.
    pub fn start_logging(
        env: &GuestEnv,
        dir: &Path,
        device: &str,
        extra: &[&str],
        rust_log: &str,
    ) -> Result<Server> {
        let (socket, log) = (dir.join("gpu.sock"), dir.join("server.log"));
        Self::spawn(env, socket, log, device, extra, rust_log)
    }

    /// Like [`Server::start_with`] for one of several servers of a test: socket `NAME.sock`,
    /// log `server-NAME.log`.
    pub fn start_named(
        env: &GuestEnv,
        dir: &Path,
        name: &str,
        device: &str,
        extra: &[&str],
    ) -> Result<Server> {
        let rust_log = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("server-{name}.log"));
        Self::spawn(env, socket, log, device, extra, &rust_log)
    }

    fn spawn(
        env: &GuestEnv,
        socket: PathBuf,
        log: PathBuf,
        device: &str,
        extra: &[&str],
        rust_log: &str,
    ) -> Result<Server> {
        let err =
            File::create(&log).map_err(|e| HarnessError::Io("create server log".into(), e))?;
        let child = Command::new(&env.switchyard)
            .args(["serve", "--socket"])
            .arg(&socket)
            .args(["--device", device])
            .args(extra)
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError::Io(format!("spawn {}", env.switchyard.display()), e))?;
        let mut s = Server {
            child: Some(child),
            socket,
            log,
        };
        wait_until(Duration::from_secs(20), "the server socket", || {
            if let Some(c) = s.child.as_mut()
                && let Ok(Some(_)) = c.try_wait()
            {
                return Some(false);
            }
            s.socket.exists().then_some(true)
        })
        .and_then(|ok| {
            if ok {
                Ok(())
            } else {
                let st = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                Err(HarnessError::Exited("switchyard", st.unwrap_or_default()))
            }
        })?;
        Ok(s)
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the server is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        stop_child(&mut c, Duration::from_secs(10))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }
}
