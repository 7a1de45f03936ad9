//! `switchyard daemon` refuses `[daemon]` paths it cannot use: it exits 2 naming the key
//! before it creates anything (an endpoint directory too long for its sockets used to be
//! accepted and its endpoints silently not created; a relative control socket was accepted; an
//! empty `state_dir` or a NUL byte in a path exited 1 without naming the key).
#![forbid(unsafe_code)]

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const EXE: &str = env!("CARGO_BIN_EXE_switchyard");

/// How long a daemon may take to refuse its configuration (a daemon that accepts it runs).
const REFUSAL_DEADLINE: Duration = Duration::from_secs(20);

/// `path` padded with a last component of `d`s to exactly `len` bytes.
fn padded(path: &Path, len: usize) -> String {
    let base = format!("{}/", path.display());
    assert!(base.len() < len, "the temporary directory is too long");
    format!("{base}{}", "d".repeat(len - base.len()))
}

/// Runs `switchyard daemon --config <dir>/pool.toml` (in `dir`) with `text`; returns its exit
/// status and standard error. A daemon still running at the deadline is killed: the test fails.
fn daemon_with(dir: &Path, text: &str) -> (Option<i32>, String) {
    let config = dir.join("pool.toml");
    std::fs::write(&config, text).expect("write the configuration");
    let stderr = dir.join("stderr");
    let mut child = Command::new(EXE)
        .arg("daemon")
        .arg("--config")
        .arg(&config)
        .current_dir(dir)
        .env("SWITCHYARD_WORKER_EXE", EXE)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&stderr).expect("stderr file"))
        .spawn()
        .expect("start the daemon");
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the daemon") {
            break status;
        }
        if start.elapsed() > REFUSAL_DEADLINE {
            child.kill().expect("kill the daemon");
            child.wait().expect("reap the daemon");
            panic!(
                "the daemon accepted the configuration and runs:\n{text}\n{}",
                std::fs::read_to_string(&stderr).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    (
        status.code(),
        std::fs::read_to_string(&stderr).unwrap_or_default(),
    )
}

#[test]
fn unusable_daemon_paths_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path();
    let state = base.join("state");
    let run = base.join("run");
    let paths = |control: &str, state_dir: &str, endpoint_dir: &str| {
        format!(
            "[daemon]\ncontrol_socket = \"{control}\"\nstate_dir = \"{state_dir}\"\nendpoint_dir = \"{endpoint_dir}\"\n"
        )
    };
    let control = run.join("control.sock").display().to_string();
    let state_dir = state.display().to_string();
    let endpoints = run.join("endpoints").display().to_string();
    let long_endpoints = padded(&run, 120);
    let long_control = padded(&run, 120);
    for (name, text, key) in [
        (
            "a 120-byte endpoint_dir",
            paths(&control, &state_dir, &long_endpoints),
            "daemon.endpoint_dir",
        ),
        (
            "a 120-byte control socket",
            paths(&long_control, &state_dir, &endpoints),
            "daemon.control_socket",
        ),
        (
            "a relative control socket",
            paths("control.sock", &state_dir, &endpoints),
            "daemon.control_socket",
        ),
        (
            "an empty state_dir",
            paths(&control, "", &endpoints),
            "daemon.state_dir",
        ),
        (
            "a NUL byte in the control socket",
            paths(&format!("{control}\\u0000x"), &state_dir, &endpoints),
            "daemon.control_socket",
        ),
    ] {
        let (code, err) = daemon_with(base, &text);
        assert_eq!(code, Some(2), "{name}: {err}");
        assert!(err.contains(&format!("`{key}`")), "{name}: {err}");
        assert!(!state.exists(), "{name}: nothing created");
        assert!(!run.exists(), "{name}: nothing created");
    }
    // Positive control: the same paths, usable, start a daemon (which is then stopped).
    let text = paths(&control, &state_dir, &endpoints);
    let config = base.join("pool.toml");
    std::fs::write(&config, &text).expect("write the configuration");
    let mut child = Command::new(EXE)
        .arg("daemon")
        .arg("--config")
        .arg(&config)
        .current_dir(base)
        .env("SWITCHYARD_WORKER_EXE", EXE)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the daemon");
    let start = Instant::now();
    while !Path::new(&control).exists() {
        if let Some(status) = child.try_wait().expect("wait for the daemon") {
            panic!("the daemon exited ({status}) with usable paths");
        }
        assert!(
            start.elapsed() < REFUSAL_DEADLINE,
            "no control socket at {control}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().expect("stop the daemon");
    child.wait().expect("reap the daemon");
}
