//! The demo binary's output handling (no guest is booted here).
#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::process::{Command, Stdio};

/// `scripts/demo.sh | head`: when the reader has gone, the demo's next line hits a broken pipe.
/// It must end quietly with exit 0 (no panic, no exit 101). The environment is faked so the demo
/// gets as far as its first line without QEMU or a built driver.
#[test]
fn demo_ends_quietly_when_stdout_is_a_closed_pipe() {
    let cache = tempfile_dir();
    for f in ["qemu", "vmlinux"] {
        std::fs::write(cache.join(f), b"").expect("fake cache file");
    }
    let (read, write): (OwnedFd, OwnedFd) = rustix::pipe::pipe().expect("pipe");
    drop(read);
    let out = Command::new(env!("CARGO_BIN_EXE_demo"))
        .env("SWITCHYARD_CACHE", &cache)
        .env("SWITCHYARD_BIN", "/bin/true")
        .env("SYGPU_DRIVER", "/bin/true")
        .stdin(Stdio::null())
        .stdout(Stdio::from(write))
        .stderr(Stdio::piped())
        .output()
        .expect("run the demo");
    let _ = std::fs::remove_dir_all(&cache);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(out.status.code(), Some(0), "{}: {err}", out.status);
    assert!(err.is_empty(), "quiet: {err}");
}

fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("sy-demo-test.{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("mkdir");
    dir
}
