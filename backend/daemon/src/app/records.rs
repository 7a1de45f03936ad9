//! Which worker process serves which endpoint, on disk (`<state_dir>/workers/<id>.pid`), so
//! that a restarted daemon can tell an endpoint whose worker outlived the previous daemon
//! (it still serves the guest: *orphaned*) from one whose worker is gone.
//!
//! A record is `PID START_TIME` (the process's start time in clock ticks since boot, field 22
//! of `/proc/PID/stat`): a pid reused by another process does not match.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

/// The records of one daemon.
#[derive(Debug, Clone)]
pub struct WorkerRecords {
    dir: PathBuf,
}

impl WorkerRecords {
    /// Records kept in `dir` (created by the caller).
    pub fn new(dir: PathBuf) -> Self {
        Self { dir }
    }

    fn path(&self, endpoint: &str) -> PathBuf {
        self.dir.join(format!("{endpoint}.pid"))
    }

    /// Records `pid` as the worker of `endpoint` (replacing the previous record).
    pub fn write(&self, endpoint: &str, pid: u32) {
        let Some(start) = start_time(pid) else {
            // Already gone: nothing to find later.
            self.remove(endpoint);
            return;
        };
        let tmp = self.dir.join(format!(".{endpoint}.pid.tmp"));
        let result = fs::write(&tmp, format!("{pid} {start}\n"))
            .and_then(|()| fs::rename(&tmp, self.path(endpoint)));
        if let Err(e) = result {
            tracing::warn!(endpoint, pid, "cannot record the worker's pid: {e}");
        }
    }

    /// Forgets the worker of `endpoint`.
    pub fn remove(&self, endpoint: &str) {
        match fs::remove_file(self.path(endpoint)) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(endpoint, "cannot remove the worker's pid record: {e}"),
        }
    }

    /// The pid of the recorded worker of `endpoint` if that very process still runs.
    pub fn live(&self, endpoint: &str) -> Option<u32> {
        let text = fs::read_to_string(self.path(endpoint)).ok()?;
        let mut parts = text.split_whitespace();
        let pid: u32 = parts.next()?.parse().ok()?;
        let start: u64 = parts.next()?.parse().ok()?;
        (start_time(pid) == Some(start)).then_some(pid)
    }
}

/// The start time of a running (not zombie) process, from `/proc/PID/stat`.
pub fn start_time(pid: u32) -> Option<u64> {
    stat_start_time(&Path::new("/proc").join(pid.to_string()).join("stat"))
}

fn stat_start_time(path: &Path) -> Option<u64> {
    let stat = fs::read_to_string(path).ok()?;
    // `PID (COMM) STATE ...`: COMM may contain spaces and parentheses; fields after the last
    // `)` are space separated, starting with field 3 (the state).
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    if matches!(fields.first(), Some(&"Z") | Some(&"X") | None) {
        return None;
    }
    fields.get(22 - 3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_finds_the_live_process_and_not_a_dead_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = WorkerRecords::new(dir.path().to_owned());
        let me = std::process::id();
        records.write("ep", me);
        assert_eq!(records.live("ep"), Some(me));
        // A record whose start time differs (the pid was reused) is not live.
        fs::write(dir.path().join("ep.pid"), format!("{me} 1\n")).expect("write");
        assert_eq!(records.live("ep"), None);
        let mut child = std::process::Command::new("true").spawn().expect("spawn");
        let pid = child.id();
        child.wait().expect("wait");
        records.write("gone", pid);
        assert_eq!(records.live("gone"), None);
        records.remove("ep");
        assert!(!dir.path().join("ep.pid").exists());
        assert_eq!(records.live("never"), None);
    }
}
