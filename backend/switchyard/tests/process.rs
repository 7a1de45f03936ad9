//! The `switchyard` process itself: arguments and exit codes, signals, the socket file's life
//! (path lengths, a path taken over by another server), the open-file limit, and how much it
//! logs. Every test runs a real `switchyard` process.
#![forbid(unsafe_code)]

mod common;

use std::fs::File;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::time::{Duration, Instant};

use common::raw::Raw;
use rustix::process::{Pid, Resource, Rlimit, Signal};
use switchyard_softgpu::regs::MAGIC;

const BIN: &str = env!("CARGO_BIN_EXE_switchyard");

/// A `switchyard serve` started by a test, with its log in a file; killed on drop.
struct Serve {
    child: Option<Child>,
    socket: PathBuf,
    log: PathBuf,
}

impl Serve {
    /// `switchyard serve --socket SOCKET ARGS...` with `RUST_LOG=rust_log`, stderr to `log`,
    /// started through `sh -c 'PRELUDE; exec switchyard ...'` when `prelude` is not empty.
    fn spawn(socket: &Path, log: &Path, args: &[&str], rust_log: &str, prelude: &str) -> Self {
        let mut cmd = if prelude.is_empty() {
            Command::new(BIN)
        } else {
            let mut c = Command::new("/bin/sh");
            c.arg("-c")
                .arg(format!("{prelude}; exec \"$0\" \"$@\""))
                .arg(BIN);
            c
        };
        let child = cmd
            .arg("serve")
            .arg("--socket")
            .arg(socket)
            .args(args)
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(File::create(log).expect("log file"))
            .spawn()
            .expect("spawn switchyard");
        Serve {
            child: Some(child),
            socket: socket.to_owned(),
            log: log.to_owned(),
        }
    }

    /// Like [`Serve::spawn`], then waits until the socket file appears.
    fn start(socket: &Path, log: &Path, args: &[&str], rust_log: &str, prelude: &str) -> Self {
        let mut s = Self::spawn(socket, log, args, rust_log, prelude);
        let deadline = Instant::now() + Duration::from_secs(20);
        while !is_socket(&s.socket) {
            if let Some(st) = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("server exited early ({st}):\n{}", s.log_text());
            }
            assert!(Instant::now() < deadline, "no socket:\n{}", s.log_text());
            std::thread::sleep(Duration::from_millis(5));
        }
        s
    }

    fn pid(&self) -> Pid {
        Pid::from_raw(self.child.as_ref().expect("running").id() as i32).expect("pid")
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Sends `sig` and waits (bounded) for the exit status.
    fn signal_and_wait(&mut self, sig: Signal) -> ExitStatus {
        let child = self.child.take().expect("running");
        common::signal_and_wait(child, sig, || self.log_text())
    }

    /// Waits (bounded) until the log has a line containing `text`; returns that line.
    fn wait_log(&self, text: &str, timeout: Duration) -> String {
        common::wait_for(timeout, || {
            self.log_text()
                .lines()
                .find(|l| l.contains(text))
                .map(str::to_owned)
        })
        .unwrap_or_else(|| panic!("no log line with `{text}`:\n{}", self.log_text()))
    }
}

impl Drop for Serve {
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

fn is_socket(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run switchyard")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// `switchyard serve --socket SOCKET`, expected to fail at runtime (exit 1); its stderr.
fn serve_fails(socket: &Path) -> String {
    let out = Command::new(BIN)
        .args(["serve", "--socket"])
        .arg(socket)
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    text(&out.stderr)
}

/// A client that negotiates and reads the softgpu's MAGIC register: proof that a server is
/// listening on `socket` and serving.
fn assert_serves(socket: &Path) {
    let mut r = Raw::negotiated(socket);
    assert_eq!(r.read_reg(MAGIC), u32::from_le_bytes(*b"SYGP"));
}

#[test]
fn no_arguments_print_the_usage_to_stderr_and_exit_2() {
    let out = run(&[]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(out.stdout.is_empty(), "stdout: {}", text(&out.stdout));
    let err = text(&out.stderr);
    assert!(err.contains("Usage: switchyard <COMMAND>"), "{err}");
    assert!(err.contains("serve"), "the usage lists the commands: {err}");
}

#[test]
fn help_documents_logging_and_exit_codes() {
    for args in [&["--help"][..], &["serve", "--help"]] {
        let out = run(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {out:?}");
        let help = text(&out.stdout);
        for needle in [
            "RUST_LOG",
            "stderr",
            "0 clean shutdown",
            "1 runtime error",
            "2 bad arguments",
            "SIGHUP",
        ] {
            assert!(help.contains(needle), "{args:?} lacks `{needle}`:\n{help}");
        }
    }
}

#[test]
fn serve_help_lists_every_kind_with_its_own_options_and_notes() {
    let out = run(&["serve", "--help"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let help = text(&out.stdout);
    for needle in [
        "softgpu: ",
        "vram_mmap=on|off",
        "irq=msi (one MSI vector, no MSI-X)",
        "vfio: ",
        "host=DDDD:BB:DD.F",
        "bound to vfio-pci",
        "scratchpad: ",
        "size=SIZE",
        "cuda: ",
        "gpu=UUID|N",
        "switchyard inventory gpus",
    ] {
        assert!(
            help.contains(needle),
            "serve --help lacks `{needle}`:\n{help}"
        );
    }
}

#[test]
fn exit_codes_bad_arguments_2_runtime_error_1() {
    let out = run(&["serve", "--socket", "/tmp/x.sock", "--device", "nonsense"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = text(&out.stderr);
    assert_eq!(err.lines().count(), 1, "one line: {err}");
    assert!(err.contains("Unknown device kind `nonsense`"), "{err}");
    assert!(
        !err.contains("For more information"),
        "one hint, ours, not clap's run into the message: {err}"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    let missing = dir.path().join("no-such-dir/gpu.sock");
    let err = serve_fails(&missing);
    assert!(
        err.contains("Cannot bind socket") && err.contains("No such file or directory"),
        "{err}"
    );
}

#[test]
fn a_vfio_device_that_cannot_be_opened_is_named_and_bad_options_are_argument_errors() {
    let out = run(&[
        "serve",
        "--socket",
        "/tmp/x.sock",
        "--device",
        "vfio,bars=mmap",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        text(&out.stderr).contains("option `host`: required"),
        "{out:?}"
    );
    let out = run(&[
        "serve",
        "--socket",
        "/tmp/x.sock",
        "--device",
        "vfio,host=00:03.0,bars=fast",
    ]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert!(
        text(&out.stderr).contains("option `bars`: `fast` is not `trap` or `mmap`"),
        "{out:?}"
    );
    // No such device on this machine: a runtime error that names it, and no socket left.
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("vfio.sock");
    let out = Command::new(BIN)
        .args(["serve", "--socket"])
        .arg(&socket)
        .args(["--device", "vfio,host=ffff:ff:1f.7"])
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let err = text(&out.stderr);
    assert!(
        err.contains("Cannot create the device") && err.contains("No PCI device ffff:ff:1f.7"),
        "{err}"
    );
    assert!(!socket.exists());
}

#[test]
fn sighup_finishes_like_sigterm_removes_the_socket_and_exits_0() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let mut s = Serve::start(&socket, &dir.path().join("log"), &[], "info", "");
    assert_serves(&socket);
    let st = s.signal_and_wait(Signal::HUP);
    assert_eq!(st.code(), Some(0), "{st}:\n{}", s.log_text());
    assert!(!socket.exists(), "socket removed");
    assert!(s.log_text().contains("shutting down"), "{}", s.log_text());
}

/// Server A's socket path is taken over by server B (A's file was removed, B bound the path):
/// A exiting must not remove B's socket.
#[test]
fn exiting_server_leaves_a_socket_path_another_server_took_over() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let mut a = Serve::start(&socket, &dir.path().join("a.log"), &[], "info", "");
    std::fs::remove_file(&socket).expect("remove A's socket file");
    let mut b = Serve::start(&socket, &dir.path().join("b.log"), &[], "info", "");
    assert_eq!(a.signal_and_wait(Signal::TERM).code(), Some(0));
    assert!(
        is_socket(&socket),
        "A removed B's socket:\n{}",
        a.log_text()
    );
    assert!(
        a.log_text().contains("belongs to another server"),
        "{}",
        a.log_text()
    );
    assert_serves(&socket);
    // B still removes its own socket.
    assert_eq!(b.signal_and_wait(Signal::TERM).code(), Some(0));
    assert!(!socket.exists(), "B removed its socket");
}

/// A directory under a fresh temp dir such that `dir/name` is exactly `len` bytes.
fn path_of_len(base: &Path, name: &str, len: usize) -> PathBuf {
    let base_len = base.as_os_str().len();
    // base + "/" + filler + "/" + name
    let filler = len - base_len - 2 - name.len();
    let dir = base.join("d".repeat(filler));
    std::fs::create_dir_all(&dir).expect("mkdir");
    let p = dir.join(name);
    assert_eq!(p.as_os_str().len(), len);
    p
}

#[test]
fn every_socket_path_length_af_unix_allows_binds_and_longer_ones_name_the_limit() {
    let base = tempfile::tempdir().expect("tempdir");
    for (len, name) in [(97, "gpu.sock"), (107, "gpu.sock"), (107, "s"), (104, "ab")] {
        let case = tempfile::tempdir_in(base.path()).expect("tempdir");
        let socket = path_of_len(case.path(), name, len);
        let log = case.path().join("log");
        let mut s = Serve::start(&socket, &log, &[], "info", "");
        let mode = std::fs::metadata(&socket)
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600, "{len} bytes, {name}");
        assert_serves(&socket);
        assert_eq!(s.signal_and_wait(Signal::TERM).code(), Some(0));
        assert!(!socket.exists(), "{len} bytes: socket removed");
        let left: Vec<_> = std::fs::read_dir(socket.parent().expect("parent"))
            .expect("readdir")
            .map(|e| e.expect("entry").file_name())
            .collect();
        assert!(left.is_empty(), "{len} bytes, {name}: left behind {left:?}");
    }
    // One byte more does not fit in sun_path: refused with the limit in the message.
    let case = tempfile::tempdir_in(base.path()).expect("tempdir");
    let socket = path_of_len(case.path(), "gpu.sock", 108);
    let err = serve_fails(&socket);
    assert!(
        err.contains("108 bytes") && err.contains("107 bytes"),
        "{err}"
    );
}

#[test]
fn socket_gets_its_exact_mode_whatever_the_umask() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let log = dir.path().join("log");
    let _s = Serve::start(
        &socket,
        &log,
        &["--socket-mode", "660"],
        "info",
        "umask 077",
    );
    let mode = std::fs::metadata(&socket)
        .expect("stat")
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o660);
    assert_serves(&socket);
}

#[test]
fn serve_raises_the_soft_open_file_limit_to_the_hard_limit() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let log = dir.path().join("log");
    let hard = rustix::process::getrlimit(Resource::Nofile)
        .maximum
        .expect("a finite hard RLIMIT_NOFILE");
    assert!(hard > 256, "hard limit {hard} leaves nothing to raise");
    let s = Serve::start(&socket, &log, &[], "debug", "ulimit -S -n 256");
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", s.pid().as_raw_nonzero()))
        .expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("Max open files");
    let soft: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(soft[3], hard.to_string(), "soft limit raised: {line}");
    let logged = s.wait_log("RLIMIT_NOFILE", Duration::from_secs(5));
    assert!(
        logged.contains(&format!("nofile={hard}")) && logged.contains("from=256"),
        "{logged}"
    );
}

/// The lowest file descriptor number `pid` does not use: what its next `accept` would get.
fn lowest_free_fd(pid: Pid) -> u64 {
    let used: std::collections::BTreeSet<u64> =
        std::fs::read_dir(format!("/proc/{}/fd", pid.as_raw_nonzero()))
            .expect("fd dir")
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
            .collect();
    (0..).find(|n| !used.contains(n)).expect("a free fd")
}

/// At the open-file limit a pending connection keeps the socket readable and every `accept`
/// fails with EMFILE: the server must back off and log that a bounded number of times, and
/// serve the client once descriptors are available again.
#[test]
fn accept_at_the_open_file_limit_backs_off_with_a_bounded_log() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let log = dir.path().join("log");
    let s = Serve::start(&socket, &log, &[], "info", "");
    let pid = s.pid();
    // The socket file appears before the acceptor thread has cloned the listener: wait for
    // that thread, so its descriptors are all open before the limit is set.
    let acceptor = common::wait_for(Duration::from_secs(10), || {
        std::fs::read_dir(format!("/proc/{}/task", pid.as_raw_nonzero()))
            .ok()?
            .filter_map(Result::ok)
            .any(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim() == "sy-accept")
            })
            .then_some(())
    });
    assert!(acceptor.is_some(), "no sy-accept thread");
    let hard = rustix::process::getrlimit(Resource::Nofile).maximum;
    let exhausted = Rlimit {
        current: Some(lowest_free_fd(pid)),
        maximum: hard,
    };
    let before = rustix::process::prlimit(Some(pid), Resource::Nofile, exhausted).expect("lower");
    // Pending connections: they sit in the backlog while accept fails.
    let _clients: Vec<UnixStream> = (0..8)
        .map(|_| UnixStream::connect(&socket).expect("connect (backlog)"))
        .collect();
    let first = s.wait_log("accept failed", Duration::from_secs(5));
    assert!(first.contains("Too many open files"), "{first}");
    // The limit holds for 3 s: the time the log bound is about (class: a duration under test,
    // not a wait). What the server did meanwhile is read once it says so, below.
    std::thread::sleep(Duration::from_secs(3));
    // Descriptors again: the pending clients are accepted and a new one is served.
    rustix::process::prlimit(Some(pid), Resource::Nofile, before).expect("restore");
    let again = s.wait_log("accept works again", Duration::from_secs(5));
    // The accept thread logs every line about its failures before this one, and counts them
    // in it: the bound on the lines holds for that many failures (positive control: the
    // backoff retried, up to 1 s apart, through the 3 s).
    let failures: u64 = again
        .split_whitespace()
        .find_map(|w| w.strip_prefix("failures=")?.parse().ok())
        .unwrap_or_else(|| panic!("no failure count: {again}"));
    let text = s.log_text();
    let accept_lines = text
        .lines()
        .take_while(|l| !l.contains("accept works again"))
        .filter(|l| l.contains("accept"))
        .count();
    eprintln!("{failures} failed accepts, {accept_lines} log lines about them");
    assert!(
        failures >= 4,
        "only {failures} failed accepts in 3 s at the fd limit: the accept loop did not retry"
    );
    // Backed off: a loop retrying at once fails thousands of times in 3 s.
    assert!(
        failures <= 30,
        "{failures} failed accepts in 3 s: no backoff"
    );
    assert!(
        accept_lines <= 2,
        "{accept_lines} accept log lines for {failures} failed accepts at the fd limit:\n{}",
        text.lines().take(20).collect::<Vec<_>>().join("\n")
    );
    drop(_clients);
    let served = common::wait_for(Duration::from_secs(10), || {
        // The backlog's clients are accepted one at a time and refused or dropped; retry
        // until this one is the client being served.
        std::panic::catch_unwind(|| assert_serves(&socket)).ok()
    });
    assert!(served.is_some(), "not served after the limit was lifted");
}

/// `--swap-every-ms` at INFO: a summary every 10 s and at the end, not a line per swap.
#[test]
fn swap_soak_logs_a_periodic_summary_not_every_swap() {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("gpu.sock");
    let log = dir.path().join("log");
    let mut s = Serve::start(
        &socket,
        &log,
        &["--device", "softgpu,vram=1M", "--swap-every-ms", "5"],
        "info",
        "",
    );
    let summary = s.wait_log("swap soak", Duration::from_secs(20));
    let swaps: u64 = summary
        .split("swaps=")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no swap count: {summary}"));
    assert!(swaps >= 100, "swaps every 5 ms for 10 s: {summary}");
    assert!(
        summary.contains("refused=") && summary.contains("max_held_us="),
        "{summary}"
    );
    assert_eq!(s.signal_and_wait(Signal::TERM).code(), Some(0));
    let text = s.log_text();
    assert_eq!(
        text.matches("device swapped").count(),
        0,
        "per-swap lines at INFO"
    );
    assert!(text.lines().count() < 20, "{text}");
    assert!(text.contains("swap soak finished"), "{text}");
}
