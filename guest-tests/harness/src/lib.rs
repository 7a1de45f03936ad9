//! A harness for tests that boot real guests.
//!
//! It starts `switchyard serve` on a fresh socket and waits until it listens, boots QEMU under
//! TCG (never KVM: `/dev/kvm` on our machines is PVM and cannot boot a stock kernel) with guest
//! RAM as a shared memfd, reads the guest's serial console from a file, enforces timeouts (and
//! a watchdog per test, which says where a hung test waits and fails it: [`with_logs`]),
//! kills only the processes it started, and keeps the guest, server and QEMU logs of every
//! test under `target/guest-tests/logs/<test>/` (printed when the test fails). A guest whose
//! kernel panicked at boot, before its test's code ran, is booted again once and said so
//! (`BOOT-PANIC:`; [`boot_state`], [`Guest::booted`]).
//!
//! The serial console is read while QEMU is still writing it, so everything that looks at it
//! before QEMU has exited considers only complete lines ([`complete_lines`]).
//!
//! Guest tests are `#[ignore]`d, so a plain `cargo test` reports them as ignored, never as
//! passed; `scripts/test.sh` runs them with `--include-ignored`. When they run and QEMU, the
//! kernel or the in-guest driver are missing they fail with a message saying how to set them up
//! (`scripts/setup.sh`); there is no switch that skips them. cloud-hypervisor alone is optional
//! (docs/cloud-hypervisor.md): without it `scripts/test.sh` leaves out the tests that need it and
//! says so in its last line; run anyway, they fail ([`GuestEnv::cloud_hypervisor`]).

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod boot;
pub mod cluster;
mod env;
mod error;
mod guest;
mod nested;
mod netns;
mod pool;
mod server;
mod watchdog;

pub use boot::{BOOT_ATTEMPTS, BootState, boot_state};
// Template helpers of the libvirt and cluster domain XMLs.
pub use cluster::{placeholders_in, xml_escape};
pub use env::{GuestEnv, NestedBinaries, needs_cloud_hypervisor};
pub use error::{HarnessError, Result};
pub use guest::{Guest, GuestOutput, GuestSpec};
pub use nested::{NESTED_ATTEMPTS, STACK_PROTECTOR_WINDOW, boot_nested, nested_fault};
pub use netns::TwoHosts;
pub use pool::PoolDaemon;
pub use server::Server;
pub use watchdog::TEST_LIMIT;

use std::fs;
use std::path::Path;
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

/// The complete lines of `text`: everything up to and including its last `'\n'` (nothing if it
/// has none). A file another process is writing may end in a partly written line.
pub fn complete_lines(text: &str) -> &str {
    text.rfind('\n').map_or("", |i| &text[..=i])
}

/// The first complete line of `text` that starts with `prefix` (after trimming whitespace,
/// including the serial console's `\r`), trimmed.
pub fn find_line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    complete_lines(text)
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(prefix))
}

/// Polls `f` every 20 ms until it returns `Some` or `timeout` passes.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(HarnessError::Timeout(timeout, what.to_owned()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Stops `child` as a service manager would: SIGTERM, up to `grace` for it to exit, then
/// SIGKILL. Returns its exit status if it exited within `grace`, `None` if it had to be killed
/// (or was already reaped).
pub fn stop_child(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    if let Ok(Some(st)) = child.try_wait() {
        return Some(st);
    }
    let _ = rustix::process::kill_process(
        rustix::process::Pid::from_child(child),
        rustix::process::Signal::TERM,
    );
    let stopped = wait_until(grace, "the process to stop", || {
        child.try_wait().ok().flatten()
    });
    match stopped {
        Ok(st) => Some(st),
        Err(_) => {
            kill_child(child);
            None
        }
    }
}

fn kill_child(child: &mut Child) {
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// Runs `body` with the environment and a fresh log dir for `name`; on failure prints the logs
/// (they stay on disk) and fails the same way. A test still running after [`TEST_LIMIT`] is a
/// hang: see [`with_logs_within`].
pub fn with_logs(name: &str, body: impl FnOnce(&GuestEnv, &Path)) {
    with_logs_within(name, TEST_LIMIT, body);
}

/// [`with_logs`] for a test that may take up to `limit`. When `limit` passes the test's
/// binary prints where the test and the processes it started wait, prints the logs, kills those
/// processes and exits failed, so a hang fails the suite in bounded time and says where.
pub fn with_logs_within(name: &str, limit: Duration, body: impl FnOnce(&GuestEnv, &Path)) {
    let env = GuestEnv::for_test();
    let dir = env.log_dir(name).expect("log dir");
    let watchdog = watchdog::Watchdog::arm(name, &dir, limit);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&env, &dir)));
    drop(watchdog);
    if let Err(p) = r {
        dump_logs(&dir);
        std::panic::resume_unwind(p);
    }
}

/// Asserts that the running test binary has `booting` tests besides `this_test` and that all
/// of them are `#[ignore]`d, so that a plain `cargo test` lists guest tests as ignored instead
/// of passing them without booting anything.
pub fn assert_guest_tests_ignored(this_test: &str, booting: usize) {
    let all = list_tests(false);
    let ignored = list_tests(true);
    let others: Vec<String> = all.iter().filter(|n| *n != this_test).cloned().collect();
    assert_eq!(others.len(), booting, "{all:?}");
    assert_eq!(ignored, others, "every guest-booting test is #[ignore]d");
}

/// The names of the running test binary's tests (`ignored`: only the `#[ignore]`d ones),
/// sorted.
pub fn list_tests(ignored: bool) -> Vec<String> {
    let out = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--list", "--format", "terse"])
        .args(ignored.then_some("--ignored"))
        .output()
        .expect("list tests");
    assert!(out.status.success(), "{out:?}");
    let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.strip_suffix(": test").map(str::to_owned))
        .collect();
    names.sort();
    names
}

/// The in-guest driver's full workload passed, by its `SYGPU-SUMMARY` JSON: result pass,
/// every job run (at least 5) verified bit-exact, the error test and the VRAM mapping
/// checks passed.
pub fn assert_full_workload(summary: &serde_json::Value) {
    let s = summary;
    assert_eq!(s["result"], "pass", "{s}");
    let run = s["jobs_run"].as_u64().expect("jobs_run");
    assert!(run >= 5, "{s}");
    assert_eq!(
        s["jobs_verified"].as_u64(),
        Some(run),
        "every job verified bit-exact: {s}"
    );
    assert_eq!(s["error_test_ok"], true, "{s}");
    assert_eq!(s["vram_mmap_ok"], true, "{s}");
}

/// Prints the logs in `dir` (for a failing test); they also stay on disk.
pub fn dump_logs(dir: &Path) {
    eprint!("{}", logs_text(dir));
}

/// The last 80 lines of each log in `dir`, each under its file name.
fn logs_text(dir: &Path) -> String {
    let mut out = format!("--- logs kept in {} ---\n", dir.display());
    if let Ok(rd) = fs::read_dir(dir) {
        let mut files: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files {
            if f.extension().is_some_and(|e| e == "log") {
                let text = fs::read_to_string(&f).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(80).collect();
                out.push_str(&format!(
                    "=== {} (last {} lines) ===\n",
                    f.display(),
                    tail.len()
                ));
                for l in tail.iter().rev() {
                    out.push_str(l);
                    out.push('\n');
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_complete_lines_count() {
        assert_eq!(complete_lines(""), "");
        assert_eq!(complete_lines("HOTPLUG: run round=1 rc="), "");
        assert_eq!(
            complete_lines("a\r\nHOTPLUG: run round=1 rc=0\r\nHOTPLUG: run round=2 rc="),
            "a\r\nHOTPLUG: run round=1 rc=0\r\n"
        );
        let text = "x\r\nHOTPLUG: run round=1 rc=0\r\nHOTPLUG: run round=2 rc=";
        assert_eq!(
            find_line(text, "HOTPLUG: run round=1 rc="),
            Some("HOTPLUG: run round=1 rc=0")
        );
        assert_eq!(find_line(text, "HOTPLUG: run round=2 rc="), None);
        assert_eq!(find_line("SYGPU-SUMMARY {\"res", "SYGPU-SUMMARY"), None);
    }
}
