//! A watchdog for one guest test: a test that is still running after its limit is a hang.
//!
//! Every wait in the harness has a timeout, but a test's own code (a thread it joins, a process
//! it waits for) may not, and one hung test used to hold `scripts/test.sh` until CI killed the
//! whole run without a word about where. When the limit passes, the watchdog prints what the
//! test binary and every process it started are blocked in (each thread's state and kernel wait
//! channel, from `/proc`), then the test's logs, kills those processes and exits the test binary
//! with a failure.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::thread;
use std::time::Duration;

/// How long a guest test may run before the watchdog calls it a hang. The slowest tests take
/// about 2 minutes on our 2-core machines; the nested ones set their own limit.
pub const TEST_LIMIT: Duration = Duration::from_secs(15 * 60);

/// The exit status of a test binary the watchdog stopped (101 is a Rust test failure).
const HUNG_EXIT: i32 = 101;

/// Armed while a test runs; dropping it disarms it.
pub(crate) struct Watchdog {
    done: Option<mpsc::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching the test `name` (logs in `dir`) for `limit`.
    pub(crate) fn arm(name: &str, dir: &Path, limit: Duration) -> Self {
        let (done, rx) = mpsc::channel::<()>();
        let (name, dir) = (name.to_owned(), dir.to_owned());
        let thread = thread::Builder::new()
            .name(format!("watchdog {name}"))
            .spawn(move || {
                if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                    fire(&name, &dir, limit);
                }
            })
            .expect("spawn the test's watchdog");
        Self {
            done: Some(done),
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn fire(name: &str, dir: &Path, limit: Duration) -> ! {
    let me = std::process::id();
    say(&format!(
        "\nwatchdog: test `{name}` is still running after {} s: it hangs. Where it waits:\n",
        limit.as_secs()
    ));
    let descendants = descendants(me);
    for pid in std::iter::once(me).chain(descendants.iter().copied()) {
        say(&describe(pid));
    }
    say(&crate::logs_text(dir));
    for &pid in descendants.iter().rev() {
        if let Some(pid) = i32::try_from(pid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
        {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
    say(&format!(
        "watchdog: killed {} processes the test started; the test binary exits failed\n",
        descendants.len()
    ));
    std::process::exit(HUNG_EXIT);
}

/// Writes to the real stderr: the test harness captures `eprint!` (and discards what it
/// captured when the process exits), but not writes to the stream itself.
fn say(text: &str) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes());
    let _ = err.flush();
}

/// The processes below `root`, parents before children.
fn descendants(root: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(rd) = fs::read_dir("/proc") {
        for e in rd.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
                continue;
            };
            if let Some(ppid) = stat_field(&e.path().join("stat"), 1).and_then(|p| p.parse().ok()) {
                parents.push((pid, ppid));
            }
        }
    }
    let mut out = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(pid, _) in parents.iter().filter(|&&(_, pp)| pp == p) {
            out.push(pid);
            frontier.push(pid);
        }
    }
    out
}

/// The `i`th field of a `/proc/.../stat` file after the command name (0: the state, 1: the
/// parent's pid).
fn stat_field(path: &Path, i: usize) -> Option<String> {
    let text = fs::read_to_string(path).ok()?;
    let rest = &text[text.rfind(')')? + 1..];
    rest.split_whitespace().nth(i).map(str::to_owned)
}

/// One process and its threads: name, state, wait channel.
fn describe(pid: u32) -> String {
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    let cmdline = fs::read(proc_dir.join("cmdline"))
        .map(|b| {
            let s: String = String::from_utf8_lossy(&b).replace('\0', " ");
            s.trim().chars().take(300).collect::<String>()
        })
        .unwrap_or_default();
    let mut text = format!("  process {pid}: {cmdline}\n");
    let Ok(rd) = fs::read_dir(proc_dir.join("task")) else {
        return text;
    };
    let mut tasks: Vec<PathBuf> = rd.flatten().map(|e| e.path()).collect();
    tasks.sort();
    for task in tasks {
        let read = |f: &str| {
            fs::read_to_string(task.join(f))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default()
        };
        text.push_str(&format!(
            "    thread {} `{}`: state {}, waiting in {}\n",
            task.file_name().and_then(|n| n.to_str()).unwrap_or("?"),
            read("comm"),
            stat_field(&task.join("stat"), 0).unwrap_or_default(),
            match read("wchan").as_str() {
                "" | "0" => "(running or unknown)".to_owned(),
                w => w.to_owned(),
            }
        ));
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_and_its_threads_are_found_and_described() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let found = descendants(std::process::id());
        // Right after the spawn, a loaded machine may not show the new image's command line
        // yet: described once it does (bounded).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let described = loop {
            let d = describe(child.id());
            if d.contains("sleep 30") || std::time::Instant::now() > deadline {
                break d;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        };
        let _ = child.kill();
        let _ = child.wait();
        assert!(found.contains(&child.id()), "{found:?}");
        assert!(described.contains("sleep 30"), "{described}");
        assert!(described.contains("`sleep`: state "), "{described}");
        let me = describe(std::process::id());
        assert!(me.matches("    thread ").count() >= 1, "{me}");
    }

    /// Runs itself in a child test binary, where (with `SY_WATCHDOG_SELF_TEST` set) it hangs
    /// past a short limit with a child process of its own.
    #[test]
    fn a_hung_test_is_reported_and_fails_its_binary() {
        if let Some(dir) = std::env::var_os("SY_WATCHDOG_SELF_TEST") {
            hang_past_a_short_limit(Path::new(&dir));
        }
        let dir = std::env::temp_dir().join(format!("sy-watchdog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("log dir");
        std::fs::write(dir.join("qemu.log"), "the last line QEMU wrote\n").expect("a log");
        let started = std::time::Instant::now();
        let out = std::process::Command::new(std::env::current_exe().expect("test binary"))
            .args([
                "--exact",
                "watchdog::tests::a_hung_test_is_reported_and_fails_its_binary",
            ])
            .env("SY_WATCHDOG_SELF_TEST", &dir)
            .output()
            .expect("run the hanging test");
        let _ = std::fs::remove_dir_all(&dir);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(HUNG_EXIT), "{err}");
        assert!(started.elapsed() < Duration::from_secs(30), "{err}");
        assert!(
            err.contains("test `hang_past_a_short_limit` is still running"),
            "{err}"
        );
        assert!(err.contains(": sleep 60"), "its child is named: {err}");
        assert!(err.contains("the last line QEMU wrote"), "its logs: {err}");
        assert!(err.contains("killed 1 processes"), "{err}");
    }

    fn hang_past_a_short_limit(dir: &Path) {
        let _dog = Watchdog::arm("hang_past_a_short_limit", dir, Duration::from_millis(300));
        let mut child = std::process::Command::new("sleep")
            .arg("60")
            .spawn()
            .expect("sleep");
        let _ = child.wait();
        unreachable!("the watchdog ends this process");
    }

    #[test]
    fn a_test_that_finishes_in_time_disarms_it() {
        let dog = Watchdog::arm(
            "quick",
            Path::new("/nonexistent"),
            Duration::from_millis(200),
        );
        drop(dog);
        // Still here after the limit: it did not fire.
        thread::sleep(Duration::from_millis(300));
    }
}
