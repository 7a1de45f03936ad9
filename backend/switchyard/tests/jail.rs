//! The jail of the processes that parse a client's bytes (`switchyard_daemon::jail`), seen
//! the way the kernel sees it: `/proc/PID/status` (`NoNewPrivs: 1`, `Seccomp: 2`), and the
//! outcome of what the jail forbids, tried by the process itself through a test knob
//! (`SWITCHYARD_TEST_JAIL_PROBE=DIR`: read `DIR/secret`, create a file in `DIR`, open a TCP
//! socket, start a process). Every case runs again with `--no-jail`, the positive control:
//! the same probe then succeeds, so a refusal is the jail's doing.
#![forbid(unsafe_code)]

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use common::ServerProcess;
use common::daemon::{Daemon, connect, socket_of};
use serde_json::Value;

/// What `/proc/PID/status` says of the jail: (`NoNewPrivs`, `Seccomp`, `Seccomp_filters`).
fn kernel_view(pid: u32) -> (String, String, u32) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(|v| v.trim().to_owned())
            .unwrap_or_else(|| panic!("no {name} in /proc/{pid}/status"))
    };
    (
        field("NoNewPrivs"),
        field("Seccomp"),
        field("Seccomp_filters").parse().expect("a count"),
    )
}

/// The probe's results in `log` for process `pid`: what → `ok` or the errno's name. Waits
/// for the line (it is logged before the process says it is ready, but a log is a file).
fn probe(log: impl Fn() -> String, pid: u32) -> BTreeMap<String, String> {
    let marker = format!("jail probe pid={pid} ");
    let deadline = Instant::now() + Duration::from_secs(20);
    let line = loop {
        let text = log();
        if let Some(line) = text.lines().find(|l| l.contains(&marker)) {
            break line.to_owned();
        }
        assert!(Instant::now() < deadline, "no probe of {pid}:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    };
    line.split_once(&marker)
        .expect("marker")
        .1
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

fn results(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

/// What a jailed process gets: Landlock refuses the file outside its rules and the new file
/// (EACCES); the seccomp filter refuses the TCP socket and the new process (EPERM).
fn refused() -> BTreeMap<String, String> {
    results(&[
        ("read", "EACCES"),
        ("create", "EACCES"),
        ("socket", "EPERM"),
        ("spawn", "EPERM"),
    ])
}

/// What the same process gets without the jail.
fn allowed() -> BTreeMap<String, String> {
    results(&[
        ("read", "ok"),
        ("create", "ok"),
        ("socket", "ok"),
        ("spawn", "ok"),
    ])
}

/// A directory with a file the jail must keep out of reach.
fn probe_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("secret"), "not for a worker").expect("secret");
    dir
}

fn worker_pid(d: &mut Daemon, id: &str) -> u32 {
    let pid = d
        .endpoint(id)
        .pointer("/worker/pid")
        .and_then(Value::as_u64)
        .expect("a worker pid");
    u32::try_from(pid).expect("pid")
}

/// Reads the device's vendor and device id through the endpoint: it serves.
fn config_ids(socket: &Path) -> u32 {
    let mut c = switchyard_client::Client::connect(socket).expect("connect");
    let mut b = [0u8; 4];
    c.region_read(7, 0, &mut b).expect("config read");
    u32::from_le_bytes(b)
}

#[test]
fn a_pool_worker_is_jailed_once_its_device_is_built() {
    let dir = probe_dir();
    let probe_dir = dir.path().to_str().expect("utf-8");
    let mut d = Daemon::new().with_env("SWITCHYARD_TEST_JAIL_PROBE", probe_dir);
    d.launch();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let pid = worker_pid(&mut d, "vm1");
    let (nnp, seccomp, filters) = kernel_view(pid);
    assert_eq!((nnp.as_str(), seccomp.as_str()), ("1", "2"), "worker {pid}");
    // The allow-list and the clone3 filter, over whatever the daemon itself runs under.
    let (_, _, daemon_filters) = kernel_view(d.pid().expect("daemon"));
    assert_eq!(filters, daemon_filters + 2, "the worker's own filters");
    assert_eq!(probe(|| d.log(), pid), refused(), "{}", d.log());
    assert!(
        d.log()
            .contains("jailed: the seccomp allow-list is on every thread"),
        "{}",
        d.log()
    );
    // It serves all the same.
    assert_ne!(config_ids(&socket_of(&d.endpoint("vm1"))), u32::MAX);
    assert!(
        !dir.path().read_dir().expect("dir").any(|e| e
            .expect("entry")
            .file_name()
            .to_string_lossy()
            .starts_with("made-by")),
        "the jailed worker made no file"
    );
}

#[test]
fn without_the_jail_a_pool_worker_can_do_what_the_probe_tries() {
    let dir = probe_dir();
    let probe_dir = dir.path().to_str().expect("utf-8");
    let mut d = Daemon::new()
        .with_env("SWITCHYARD_TEST_JAIL_PROBE", probe_dir)
        .with_args(&["--no-jail"]);
    d.launch();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let pid = worker_pid(&mut d, "vm1");
    // Exactly what the daemon runs under (nothing, or a service manager's filter).
    let daemon = d.pid().expect("daemon");
    assert_eq!(kernel_view(pid), kernel_view(daemon), "worker {pid}");
    assert_eq!(probe(|| d.log(), pid), allowed(), "{}", d.log());
    let log = d.log();
    assert!(
        log.contains("--no-jail: the workers run without their jail"),
        "{log}"
    );
    assert!(log.contains("not jailed (--no-jail)"), "{log}");
    assert_ne!(config_ids(&socket_of(&d.endpoint("vm1"))), u32::MAX);
}

#[test]
fn a_failover_re_executes_the_worker_inside_its_jail() {
    // Two boards of one shape, transparent failover: a fault on the first makes its worker
    // re-execute itself (same process) to continue the device on the second.
    let mut toml = String::new();
    for i in 0..2 {
        toml += &format!("[[boards]]\nid = \"g{i}\"\nvram = \"64M\"\nvram_mmap = false\n");
    }
    toml += "[[pools]]\nname = \"p\"\nboards = [\"g0\", \"g1\"]\nfailover = \"transparent\"\n";
    let mut d = Daemon::new().with_config(&toml).with_args(&["--faults"]);
    d.launch();
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let pid = worker_pid(&mut d, "vm1");
    let jailed = kernel_view(pid);
    assert_eq!((jailed.0.as_str(), jailed.1.as_str()), ("1", "2"));
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    guest.setup_queue(1);
    common::workload::fill_copy_round(&mut guest, 1, 0);
    d.ctl_ok(&["fault", "g0", "engine"]);
    // The signal is the pool's `failed_over` event: the lease is committed to g1 by then
    // (the worker's re-exec log comes earlier, before the daemon adopts it).
    let deadline = Instant::now() + Duration::from_secs(20);
    while !d
        .events()
        .iter()
        .any(|e| e["pool"]["kind"]["type"] == "failed_over")
    {
        assert!(Instant::now() < deadline, "no failover:\n{}", d.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        d.log()
            .contains("jailed: the jail of the image before the re-exec goes on"),
        "{}",
        d.log()
    );
    // The same process, in the same jail, not stacked again; and it serves on the new board.
    assert_eq!(kernel_view(pid), jailed, "{}", d.log());
    common::workload::fill_copy_round(&mut guest, 2, 0);
    common::workload::fill_copy_round(&mut guest, 3, 1);
    assert_eq!(worker_pid(&mut d, "vm1"), pid, "re-executed in place");
    assert_eq!(d.endpoint("vm1")["lease"]["board"], "g1");
}

/// `switchyard serve --device DEVICE EXTRA` with the probe knob, killed on drop.
fn serve(device: &str, extra: &[&str], probe_dir: &Path) -> ServerProcess {
    let args: Vec<&str> = ["--device", device].iter().chain(extra).copied().collect();
    ServerProcess::start_with_env("info", &args, &[("SWITCHYARD_TEST_JAIL_PROBE", probe_dir)])
}

#[test]
fn serve_is_jailed_with_the_policy_of_its_kind() {
    let dir = probe_dir();
    let own = kernel_view(std::process::id());
    for device in ["softgpu", "scratchpad"] {
        let s = serve(device, &[], dir.path());
        // The probe runs once the jail is complete, before the server serves.
        let results = probe(|| s.log_text(), s.pid() as u32);
        let (nnp, seccomp, filters) = kernel_view(s.pid() as u32);
        assert_eq!((nnp.as_str(), seccomp.as_str()), ("1", "2"), "{device}");
        assert_eq!(filters, own.2 + 2, "{device}");
        assert_eq!(results, refused(), "{device}: {}", s.log_text());
        assert!(
            s.log_text().contains(&format!("policy=\"{device}\"")),
            "{device}: {}",
            s.log_text()
        );
        assert_ne!(config_ids(&s.socket), u32::MAX, "{device} serves");
    }
}

#[test]
fn serve_without_the_jail_can_do_what_the_probe_tries() {
    let dir = probe_dir();
    let s = serve("softgpu", &["--no-jail"], dir.path());
    let results = probe(|| s.log_text(), s.pid() as u32);
    assert_eq!(kernel_view(s.pid() as u32), kernel_view(std::process::id()));
    assert_eq!(results, allowed(), "{}", s.log_text());
    assert!(
        s.log_text().contains("not jailed (--no-jail)"),
        "{}",
        s.log_text()
    );
    assert_ne!(config_ids(&s.socket), u32::MAX);
}
