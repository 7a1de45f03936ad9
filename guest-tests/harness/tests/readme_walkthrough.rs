//! The pool walkthrough (docs/pool.md, "A walkthrough"; README.md links to it), run as
//! written: the blocks marked `<!-- walkthrough -->` are taken from docs/pool.md, so the
//! document cannot drift from what works, and run with `bash -euo pipefail` against a real
//! `switchyard daemon` and a real QEMU guest (`scripts/boot-guest.sh`). Nothing in their text
//! is replaced: the test sets only what the document names (`SY_DIR`, `switchyard` on `PATH`)
//! and what boot-guest.sh documents (`SYGPU_DRIVER`).
//!
//! The run is `#[ignore]`d (a plain `cargo test` lists it as ignored, never as passed);
//! `scripts/test.sh` runs it: `cargo test -p switchyard-guest-tests -- --include-ignored`.
#![forbid(unsafe_code)]

use std::fs;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal};
use switchyard_guest_tests::{assert_full_workload, assert_guest_tests_ignored, with_logs};

/// The line that marks a walkthrough block (a ```` ```sh ```` fence on the next line).
const MARKER: &str = "<!-- walkthrough -->";

/// The walkthrough: the `sh` blocks right after a [`MARKER`] line, in order.
fn walkthrough_blocks(readme: &str) -> Vec<String> {
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if line.trim() != MARKER {
            continue;
        }
        let fence = lines.next().unwrap_or_default();
        assert_eq!(
            fence.trim(),
            "```sh",
            "{MARKER} must be followed by a ```sh fence"
        );
        let mut block = String::new();
        for l in lines.by_ref() {
            if l.trim_start().starts_with("```") {
                break;
            }
            block.push_str(l);
            block.push('\n');
        }
        blocks.push(block);
    }
    blocks
}

/// docs/pool.md, where the walkthrough lives.
fn readme() -> String {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/pool.md");
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The walkthrough's blocks are in docs/pool.md's "A walkthrough" section, cover what the pool
/// daemon offers, keep to `$SY_DIR`, end (no endless `--follow`), and are valid bash.
fn check_walkthrough(readme: &str) -> String {
    let section = readme
        .split("\n## ")
        .find(|s| s.starts_with("A walkthrough\n"))
        .expect("docs/pool.md has an \"A walkthrough\" section");
    let blocks = walkthrough_blocks(readme);
    assert!(!blocks.is_empty(), "no {MARKER} block in docs/pool.md");
    assert_eq!(
        walkthrough_blocks(section).len(),
        blocks.len(),
        "every walkthrough block is in the \"A walkthrough\" section"
    );
    let script = blocks.concat();
    // The commands, without comments (a `#` after whitespace; `$#` and `"#"` do not occur).
    let commands: String = script
        .lines()
        .map(|l| match l.find(" #") {
            Some(i) => &l[..i],
            None if l.trim_start().starts_with('#') => "",
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n");
    for needed in [
        "switchyard daemon --config",
        "ctl boards",
        "ctl pools",
        "ctl create vm1",
        "scripts/boot-guest.sh",
        "--qmp",
        "ctl move vm1",
        "ctl drain",
        "ctl restart vm1",
        "ctl upgrade vm1",
        "ctl vmm vm1",
        "ctl detach vm1",
        "ctl attach vm1",
        "ctl endpoint vm1",
        "ctl events",
        "ctl metrics",
        "ctl delete vm1",
        "wait \"$GUEST\"",
        "kill \"$DAEMON\"",
    ] {
        assert!(
            commands.contains(needed),
            "the walkthrough lacks `{needed}`:\n{script}"
        );
    }
    assert!(
        !commands.contains("--follow"),
        "`ctl events --follow` never returns: the walkthrough could not go on"
    );
    for root_only in ["/etc/", "/run/switchyard", "/var/lib"] {
        assert!(
            !commands.contains(root_only),
            "the walkthrough keeps to $SY_DIR (it runs as a user too), not {root_only}"
        );
    }
    let syntax = Command::new("bash")
        .arg("-n")
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .and_then(|mut c| {
            use std::io::Write;
            c.stdin
                .take()
                .expect("stdin")
                .write_all(script.as_bytes())?;
            c.wait_with_output()
        })
        .expect("bash -n");
    assert!(
        syntax.status.success(),
        "the walkthrough is not valid bash: {}",
        String::from_utf8_lossy(&syntax.stderr)
    );
    script
}

/// Checks the walkthrough in docs/pool.md (no guest is booted for that) and that its run, the one
/// other test here, is `#[ignore]`d so that a plain `cargo test` lists it as ignored.
#[test]
fn the_walkthrough_is_in_the_readme_and_its_run_is_ignored() {
    check_walkthrough(&readme());
    assert_guest_tests_ignored("the_walkthrough_is_in_the_readme_and_its_run_is_ignored", 1);
}

/// The fields of `/proc/PID/stat` after the command name: state, ppid, pgrp, ...
fn proc_stat(pid: u32) -> Option<Vec<String>> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The name is in parentheses and may hold anything: the fields start after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    Some(rest.split_whitespace().map(str::to_owned).collect())
}

/// The live processes of process group `pgid` (the script and everything it started in the
/// background: the daemon, boot-guest.sh, QEMU) and their descendants in other groups (the
/// daemon's workers), found in /proc.
fn processes_of_group(pgid: u32) -> Vec<u32> {
    let mut all: Vec<(u32, u32, u32)> = Vec::new(); // (pid, ppid, pgrp), zombies left out
    for entry in fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        let Some(f) = proc_stat(pid) else { continue };
        let (Some(state), Some(ppid), Some(pgrp)) = (
            f.first(),
            f.get(1).and_then(|v| v.parse().ok()),
            f.get(2).and_then(|v| v.parse().ok()),
        ) else {
            continue;
        };
        if state != "Z" {
            all.push((pid, ppid, pgrp));
        }
    }
    let mut found: Vec<u32> = all.iter().filter(|p| p.2 == pgid).map(|p| p.0).collect();
    let mut i = 0;
    while i < found.len() {
        let parent = found[i];
        for p in &all {
            if p.1 == parent && !found.contains(&p.0) {
                found.push(p.0);
            }
        }
        i += 1;
    }
    found
}

/// SIGKILLs what [`processes_of_group`] finds (all collected before the first kill, so that
/// workers are found through their daemon); returns their command lines.
fn kill_group(pgid: u32) -> Vec<String> {
    let pids = processes_of_group(pgid);
    let names = pids
        .iter()
        .map(|p| {
            let cmd = fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            format!("{p}: {}", String::from_utf8_lossy(&cmd).replace('\0', " "))
        })
        .collect();
    for p in pids {
        if let Some(pid) = Pid::from_raw(p as i32) {
            let _ = rustix::process::kill_process(pid, Signal::KILL);
        }
    }
    names
}

/// Whatever the outcome, nothing the walkthrough started outlives the test.
struct GroupGuard(u32);

impl Drop for GroupGuard {
    fn drop(&mut self) {
        let left = kill_group(self.0);
        if !left.is_empty() {
            eprintln!("readme-walkthrough: killed what was left: {left:#?}");
        }
    }
}

/// The first complete line of `text` (serial console `\r` removed) that starts with `prefix`.
fn line_starting<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    let complete = text.rfind('\n').map_or("", |i| &text[..i]);
    complete
        .lines()
        .map(|l| l.trim_end_matches('\r'))
        .find(|l| l.starts_with(prefix))
}

/// The walkthrough of docs/pool.md runs as written: the pool daemon with trapped-VRAM and
/// mapped-VRAM boards, an endpoint, a QEMU guest on it (boot-guest.sh, root port, QMP) whose
/// in-guest driver runs its full workload three times. Round 1 runs while the device moves
/// between boards (a move, a drain) and its worker is killed (restart) and replaced by the
/// binary on disk (upgrade); then the VMM is registered, the device detached and attached
/// again on a mapped-VRAM board (round 2 on the re-probed device) and moved guest-visibly
/// (round 3). Every command succeeds (`bash -euo pipefail`), every job of every round is
/// bit-exact, the transparent operations finished while round 1 ran, and nothing is left
/// running.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn the_readme_pool_walkthrough_runs_as_written() {
    let script = check_walkthrough(&readme());
    with_logs("readme-walkthrough", |env, dir| {
        // `switchyard` on PATH, as docs/pool.md asks (here: the binary under test).
        let bin = dir.join("bin");
        fs::create_dir_all(&bin).expect("mkdir bin");
        std::os::unix::fs::symlink(&env.switchyard, bin.join("switchyard")).expect("symlink");
        let path = std::env::join_paths(std::iter::once(bin.clone()).chain(std::env::split_paths(
            &std::env::var_os("PATH").unwrap_or_default(),
        )))
        .expect("PATH");
        // The blocks as written; the ERR trap (with -E) names a failing command in the log.
        let file = dir.join("walkthrough.sh");
        fs::write(
            &file,
            format!(
                "# The walkthrough of docs/pool.md (guest-tests/harness/tests/readme_walkthrough.rs)\n\
                 trap 'echo \"walkthrough.sh: exit $?: $BASH_COMMAND (line $LINENO${{FUNCNAME:+ of \
                 ${{FUNCNAME[0]}}, called at line ${{BASH_LINENO[0]}}}})\" >&2' ERR\n\
                 {script}"
            ),
        )
        .expect("write walkthrough.sh");
        let log = dir.join("walkthrough.log");
        let out = fs::File::create(&log).expect("walkthrough.log");
        let started = Instant::now();
        let mut child = {
            use std::os::unix::process::CommandExt;
            Command::new("bash")
                .arg("-Eeuo")
                .arg("pipefail")
                .arg(&file)
                .current_dir(&env.repo)
                .env("SY_DIR", dir)
                .env("PATH", path)
                .env("SYGPU_DRIVER", &env.driver)
                .stdin(Stdio::null())
                .stdout(out.try_clone().expect("dup"))
                .stderr(out)
                .process_group(0)
                .spawn()
                .expect("run bash")
        };
        let guard = GroupGuard(child.id());
        // While it runs: when the transparent operations had all answered (the second
        // `replaced by` line: restart, then upgrade) and when round 1 ended.
        let (mut ops_done, mut round1_done) = (None, None);
        let deadline = started + Duration::from_secs(20 * 60);
        let status = loop {
            if ops_done.is_none()
                && fs::read_to_string(&log)
                    .unwrap_or_default()
                    .matches(" replaced by ")
                    .count()
                    >= 2
            {
                ops_done = Some(started.elapsed());
            }
            if round1_done.is_none()
                && line_starting(
                    &fs::read_to_string(dir.join("guest.log")).unwrap_or_default(),
                    "ROUNDS: round=1 rc=",
                )
                .is_some()
            {
                round1_done = Some(started.elapsed());
            }
            if let Some(st) = child.try_wait().expect("wait for bash") {
                break st;
            }
            assert!(
                Instant::now() < deadline,
                "the walkthrough did not finish in 20 minutes"
            );
            std::thread::sleep(Duration::from_millis(100));
        };
        let elapsed = started.elapsed();
        let left = processes_of_group(child.id());
        drop(guard);
        let text = fs::read_to_string(&log).unwrap_or_default();
        assert!(
            status.success(),
            "the walkthrough failed ({status}):\n{text}"
        );
        assert!(
            left.is_empty(),
            "the walkthrough left processes running: {left:?}"
        );

        // Every round of the guest's workload passed, every job bit-exact.
        let guest = fs::read_to_string(dir.join("guest.log"))
            .expect("guest.log")
            .replace('\r', "");
        for round in 1..=3 {
            assert!(
                guest
                    .lines()
                    .any(|l| l == format!("ROUNDS: round={round} rc=0")),
                "round {round} did not pass:\n{guest}"
            );
        }
        for round in 1..=2 {
            assert!(
                guest
                    .lines()
                    .any(|l| l == format!("ROUNDS: round={round} gone")),
                "the device was not unplugged after round {round}:\n{guest}"
            );
        }
        assert!(guest.lines().any(|l| l == "ROUNDS: done"), "{guest}");
        let summaries: Vec<serde_json::Value> = guest
            .lines()
            .filter_map(|l| l.strip_prefix("SYGPU-SUMMARY "))
            .map(|j| serde_json::from_str(j).expect("a summary is JSON"))
            .collect();
        assert_eq!(summaries.len(), 3, "one summary per round:\n{guest}");
        for s in &summaries {
            assert_full_workload(s);
            assert_eq!(s["irq_mode"], "msi", "{s}");
        }
        assert!(!guest.contains("hardware error"), "QEMU:\n{guest}");

        // The daemon did what the walkthrough says, in order.
        for (what, line) in [
            ("the move", "endpoint vm1: moved from gpu0 to gpu1"),
            ("the drain", "endpoint vm1: moved from gpu1 to gpu0"),
            ("the restart and the upgrade", " replaced by "),
            ("the detach", "endpoint vm1: detached"),
            (
                "the guest-visible move",
                "endpoint vm1: moved from gpu2 to gpu3 (guest-visible",
            ),
        ] {
            assert!(text.contains(line), "no sign of {what} (`{line}`):\n{text}");
        }
        let (Some(ops), Some(round1)) = (ops_done, round1_done) else {
            panic!("not seen: the upgrade's answer {ops_done:?}, round 1's end {round1_done:?}");
        };
        assert!(
            ops < round1,
            "the moves, the restart and the upgrade ({ops:?}) did not finish while round 1 ran \
             (it ended at {round1:?})"
        );
        eprintln!(
            "readme-walkthrough: {:.0} s in all; the transparent operations done at {:.0} s, \
             round 1 over at {:.0} s",
            elapsed.as_secs_f64(),
            ops.as_secs_f64(),
            round1.as_secs_f64()
        );
    });
}
