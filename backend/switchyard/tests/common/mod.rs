//! Shared helpers for the integration tests: a real `switchyard serve` process on a fresh
//! socket, and memfd-backed guest memory.

#![allow(dead_code)]

pub mod cuda;
pub mod daemon;
pub mod driver;
pub mod nobody;
pub mod ours;
pub mod raw;
pub mod supervised;
pub mod workload;

use std::fs::File;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A `switchyard serve` child process, killed on drop (only the process this test started).
pub struct ServerProcess {
    child: Option<Child>,
    pub socket: PathBuf,
    _dir: tempfile::TempDir,
    log: PathBuf,
}

impl ServerProcess {
    /// Starts `switchyard serve --socket <tmp>/gpu.sock --device <device>` and waits until the
    /// socket accepts connections.
    pub fn start(device: &str) -> Self {
        Self::start_with(&["--device", device])
    }

    pub fn start_with(extra: &[&str]) -> Self {
        Self::start_logging("debug", extra)
    }

    /// Like [`ServerProcess::start_with`] with `RUST_LOG=<log>` (tests that count log lines
    /// use the production default, `info`).
    pub fn start_logging(rust_log: &str, extra: &[&str]) -> Self {
        Self::start_with_env(rust_log, extra, &[])
    }

    /// Like [`ServerProcess::start_logging`] with the variables `env` set too.
    pub fn start_with_env(rust_log: &str, extra: &[&str], env: &[(&str, &Path)]) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("gpu.sock");
        let log = dir.path().join("server.log");
        let child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
            .arg("serve")
            .arg("--socket")
            .arg(&socket)
            .args(extra)
            .env("RUST_LOG", rust_log)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(&log).expect("log file"))
            .spawn()
            .expect("spawn switchyard");
        let mut p = ServerProcess {
            child: Some(child),
            socket,
            _dir: dir,
            log,
        };
        p.wait_listening();
        p
    }

    fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if std::fs::symlink_metadata(&self.socket).is_ok_and(|m| m.file_type().is_socket()) {
                return;
            }
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                panic!("server exited early ({status}):\n{}", self.log_text());
            }
            assert!(
                Instant::now() < deadline,
                "server did not listen:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).unwrap_or(0)
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let child = self.child.take().expect("running");
        signal_and_wait(child, rustix::process::Signal::TERM, || self.log_text())
    }

    /// Whether the process is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| c.try_wait().ok().flatten().is_none())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
            if std::thread::panicking() {
                eprintln!("--- server log ---\n{}", self.log_text());
            }
        }
    }
}

/// Guest RAM: a memfd of `size` bytes, like QEMU's `memory-backend-memfd,share=on`.
pub struct GuestMemory {
    pub file: File,
    pub size: u64,
}

impl GuestMemory {
    /// Sealed against shrinking and growing, as QEMU's `memory-backend-memfd` seals by default:
    /// the server accesses it directly.
    pub fn new(size: u64) -> Self {
        let mfd = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .create("guest-ram")
            .expect("memfd");
        mfd.as_file().set_len(size).expect("set_len");
        mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow])
            .expect("seal");
        GuestMemory {
            file: mfd.into_file(),
            size,
        }
    }

    /// Not sealed: the client may shrink it under the server, which therefore accesses it
    /// through its fault-safe path.
    pub fn unsealed(size: u64) -> Self {
        let file = memfd::MemfdOptions::default()
            .create("guest-ram-unsealed")
            .expect("memfd")
            .into_file();
        file.set_len(size).expect("set_len");
        GuestMemory { file, size }
    }

    pub fn read(&self, offset: u64, buf: &mut [u8]) {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(buf, offset).expect("pread");
    }

    pub fn write(&self, offset: u64, data: &[u8]) {
        use std::os::unix::fs::FileExt;
        self.file.write_all_at(data, offset).expect("pwrite");
    }

    pub fn read_u64(&self, offset: u64) -> u64 {
        let mut b = [0; 8];
        self.read(offset, &mut b);
        u64::from_ne_bytes(b)
    }

    pub fn path_fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.file.as_raw_fd()
    }
}

/// Sends `sig` to `child` and waits (at most 10 s) for its exit status; on a timeout kills it
/// and panics with `log()`.
pub fn signal_and_wait(
    mut child: Child,
    sig: rustix::process::Signal,
    log: impl Fn() -> String,
) -> ExitStatus {
    let pid = rustix::process::Pid::from_raw(child.id() as i32).expect("pid");
    rustix::process::kill_process(pid, sig).expect("kill");
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(s) = child.try_wait().expect("wait") {
            return s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("server did not exit on {sig:?}:\n{}", log());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `f` (every 20 ms) until it holds; panics with `what` once `timeout` passes.
pub fn wait_until(what: &str, timeout: Duration, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !f() {
        assert!(Instant::now() < deadline, "{what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `f` until it returns `Some` or `timeout` passes.
pub fn wait_for<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

pub fn socket_path(p: &ServerProcess) -> &Path {
    &p.socket
}
