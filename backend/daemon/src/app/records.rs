//! Which worker process serves which endpoint, on disk (`<state_dir>/workers/<id>.pid`), so
//! that a restarted daemon can tell an endpoint whose worker outlived the previous daemon
//! (it still serves the guest: *orphaned*) from one whose worker is gone.
//!
//! A record is `PID START_TIME NONCE` (the process's start time in clock ticks since boot,
//! field 22 of `/proc/PID/stat`, and the [`WorkerNonce`] the daemon gave the worker at start):
//! a pid reused by another process does not match. A record is a claim, not a proof: it is
//! considered only when the process is also a worker of this daemon's executable
//! ([`WorkerIdentity::check`]: same uid, started as `<exe> worker`, running the daemon's
//! worker executable), and even then only adoption proves it: the worker must show the
//! record's nonce on its adoption socket in the daemon's private directory
//! (`supervisor::handover`). Another daemon's worker (same binary, same uid) passes the
//! check but not the proof, so a process its record names is never signalled unless it was
//! adopted (an orphan, one that could not be, is left to the administrator). A record naming
//! anything else is reported and treated as "no live worker". Records are read and written
//! without following symbolic links.
//!
//! A record of an earlier release has no nonce (`PID START_TIME`); the daemon adopts under it
//! a worker of that release only (which has none either, and proves itself by the adoption
//! socket's peer as before), so that an upgrade adopts the workers it finds; a worker that
//! has a nonce is never adopted under a record without one. An earlier release reads this
//! release's records by their first two fields (a downgrade adopts as that release did).

use std::ffi::OsStr;
use std::fs;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use rustix::fs::{Mode, OFlags};

use crate::custody::WorkerNonce;

/// Why a process named by a record is not trusted as a worker of this daemon.
#[derive(Debug, thiserror::Error)]
pub enum NotOurWorker {
    /// The process does not run (or is a zombie), or it is not the recorded one.
    #[error("Process {0} is not the recorded process (gone, or its pid was reused)")]
    Gone(u32),
    /// It runs as another user.
    #[error("Process {pid} runs as uid {uid}, not as the daemon's uid {ours}")]
    Uid {
        /// The process.
        pid: u32,
        /// Its effective uid.
        uid: u32,
        /// The daemon's effective uid.
        ours: u32,
    },
    /// It was not started as `<exe> worker`.
    #[error("Process {pid} was not started as a worker (its arguments: {args})")]
    Cmdline {
        /// The process.
        pid: u32,
        /// Its command line, arguments separated by spaces.
        args: String,
    },
    /// It runs another executable than the daemon's worker executable.
    #[error("Process {pid} runs {exe}, not the worker executable {ours}")]
    Exe {
        /// The process.
        pid: u32,
        /// What `/proc/PID/exe` names.
        exe: PathBuf,
        /// The daemon's worker executable.
        ours: PathBuf,
    },
    /// `/proc/PID` cannot be read.
    #[error("Process {pid} cannot be inspected")]
    Unreadable {
        /// The process.
        pid: u32,
        /// Why.
        #[source]
        source: io::Error,
    },
}

/// What a process must be to be trusted as a worker of this daemon.
#[derive(Debug, Clone)]
pub struct WorkerIdentity {
    /// The daemon's effective uid.
    uid: u32,
    /// The worker executable, resolved (as `/proc/PID/exe` names it).
    exe: PathBuf,
    /// Its `(st_dev, st_ino)`, if it can be read.
    file: Option<(u64, u64)>,
}

impl WorkerIdentity {
    /// Workers of the executable `exe` (what the daemon starts as `<exe> worker`) running as
    /// this process's effective uid.
    pub fn of(exe: &Path) -> Self {
        let file = fs::metadata(exe).ok().map(|m| (m.dev(), m.ino()));
        let exe = fs::canonicalize(exe).unwrap_or_else(|_| exe.to_owned());
        Self {
            uid: rustix::process::geteuid().as_raw(),
            exe,
            file,
        }
    }

    /// Whether `pid` is a worker of this daemon: it runs as the daemon's uid, was started as
    /// `<exe> worker`, and runs the daemon's worker executable.
    pub fn check(&self, pid: u32) -> Result<(), NotOurWorker> {
        let proc = Path::new("/proc").join(pid.to_string());
        let unreadable = |source: io::Error| {
            if source.kind() == io::ErrorKind::NotFound {
                NotOurWorker::Gone(pid)
            } else {
                NotOurWorker::Unreadable { pid, source }
            }
        };
        let status = fs::read_to_string(proc.join("status")).map_err(unreadable)?;
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1)?.parse().ok())
            .ok_or_else(|| unreadable(io::Error::other("no effective uid in its status")))?;
        if uid != self.uid {
            return Err(NotOurWorker::Uid {
                pid,
                uid,
                ours: self.uid,
            });
        }
        let cmdline = fs::read(proc.join("cmdline")).map_err(unreadable)?;
        let mut args = cmdline.split(|&b| b == 0);
        if args.nth(1) != Some(b"worker") {
            let args = cmdline
                .split(|&b| b == 0)
                .filter(|a| !a.is_empty())
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>()
                .join(" ");
            return Err(NotOurWorker::Cmdline { pid, args });
        }
        let link = proc.join("exe");
        // The very file: `/proc/PID/exe` resolves to the inode the process runs, even an
        // unlinked one.
        if let (Some(ours), Ok(meta)) = (self.file, fs::metadata(&link))
            && (meta.dev(), meta.ino()) == ours
        {
            return Ok(());
        }
        let exe = fs::read_link(&link).map_err(unreadable)?;
        // An upgrade replaces the executable on disk (a rename onto its path): a worker
        // started before it runs the old file, now unlinked, which the kernel names
        // "PATH (deleted)". Same path, same uid, started as `worker`: still ours.
        let name = exe.as_os_str().as_bytes();
        let same_path = name
            .strip_suffix(b" (deleted)")
            .is_some_and(|n| Path::new(OsStr::from_bytes(n)) == self.exe);
        if same_path {
            Ok(())
        } else {
            Err(NotOurWorker::Exe {
                pid,
                exe,
                ours: self.exe.clone(),
            })
        }
    }
}

/// The records of one daemon.
#[derive(Debug, Clone)]
pub struct WorkerRecords {
    dir: PathBuf,
    worker: WorkerIdentity,
}

impl WorkerRecords {
    /// Records kept in `dir` (created and checked by the caller) of workers that are
    /// `worker`.
    pub fn new(dir: PathBuf, worker: WorkerIdentity) -> Self {
        Self { dir, worker }
    }

    fn path(&self, endpoint: &str) -> PathBuf {
        self.dir.join(format!("{endpoint}.pid"))
    }

    /// Records `pid`, given `nonce`, as the worker of `endpoint` (replacing the previous
    /// record).
    pub fn write(&self, endpoint: &str, pid: u32, nonce: &WorkerNonce) {
        let Some(start) = start_time(pid) else {
            // Already gone: nothing to find later.
            self.remove(endpoint);
            return;
        };
        let tmp = self.dir.join(format!(".{endpoint}.pid.tmp"));
        let record = format!("{pid} {start} {}\n", nonce.as_str());
        let result =
            write_new(&tmp, record.as_bytes()).and_then(|()| fs::rename(&tmp, self.path(endpoint)));
        if let Err(e) = result {
            let _ = fs::remove_file(&tmp);
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

    /// The recorded worker of `endpoint` if that very process still runs and is a worker of
    /// this daemon's executable ([`WorkerIdentity::check`]): a claim to prove by adoption
    /// ([`Recorded`]). A record naming any other process is reported and ignored: the daemon
    /// must never adopt or signal it. A record whose third field is no nonce is no record.
    pub fn live(&self, endpoint: &str) -> Option<Recorded> {
        let text = read_record(&self.path(endpoint)).ok()?;
        let mut parts = text.split_whitespace();
        let pid: u32 = parts.next()?.parse().ok()?;
        let start: u64 = parts.next()?.parse().ok()?;
        let nonce = match parts.next() {
            None => None,
            Some(n) => Some(WorkerNonce::parse(n)?),
        };
        if parts.next().is_some() || start_time(pid) != Some(start) {
            return None;
        }
        if let Err(e) = self.worker.check(pid) {
            tracing::warn!(
                endpoint,
                pid,
                "the worker record names a process that is not a worker of this daemon; ignored: {}",
                crate::error_chain::error_chain(&e)
            );
            return None;
        }
        // Still the process just checked (its pid not reused in between).
        (start_time(pid) == Some(start)).then_some(Recorded { pid, nonce })
    }
}

/// What a worker record claims ([`WorkerRecords::live`]): proved only when the process shows
/// the nonce on its adoption socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// The process (running, with the recorded start time, a worker of this executable).
    pub pid: u32,
    /// The nonce the record names; none in a record of an earlier release.
    pub nonce: Option<WorkerNonce>,
}

/// Creates `path` (0600; not if anything, a symbolic link included, is there) with `bytes`.
fn write_new(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let mode = Mode::RUSR | Mode::WUSR;
    let fd = match rustix::fs::open(path, flags, mode) {
        Err(rustix::io::Errno::EXIST) => {
            // A temporary file left by a daemon killed while writing it.
            fs::remove_file(path)?;
            rustix::fs::open(path, flags, mode)?
        }
        r => r?,
    };
    fs::File::from(fd).write_all(bytes)
}

/// Reads a record: a regular file, not through a symbolic link (no blocking on a FIFO).
fn read_record(path: &Path) -> io::Result<String> {
    let flags = OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC;
    let file = fs::File::from(rustix::fs::open(path, flags, Mode::empty())?);
    if !file.metadata()?.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let mut text = String::new();
    file.take(64).read_to_string(&mut text)?;
    Ok(text)
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
    use std::process::{Child, Command};

    /// A child started as `<exe> worker` (a shell running the script `worker` in `dir`),
    /// killed when dropped.
    struct Running(Child);

    impl Running {
        fn worker_like(exe: &Path, dir: &Path) -> Self {
            // Not `exec`: the shell itself must stay.
            fs::write(dir.join("worker"), "sleep 60; :\n").expect("script");
            let child = Command::new(exe)
                .arg("worker")
                .current_dir(dir)
                .spawn()
                .expect("spawn");
            Self::started(child)
        }

        /// Once the child's command line is its own: `spawn` may return while the kernel
        /// is still setting up the new program (an empty command line).
        fn started(child: Child) -> Self {
            let cmdline = Path::new("/proc")
                .join(child.id().to_string())
                .join("cmdline");
            for _ in 0..500 {
                if fs::read(&cmdline).is_ok_and(|c| !c.is_empty()) {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            Self(child)
        }

        fn pid(&self) -> u32 {
            self.0.id()
        }
    }

    impl Drop for Running {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn sh() -> PathBuf {
        fs::canonicalize("/bin/sh").expect("/bin/sh")
    }

    fn nonce() -> WorkerNonce {
        WorkerNonce::generate().expect("nonce")
    }

    /// `pid` as recorded with `nonce`.
    fn rec(pid: u32, nonce: &WorkerNonce) -> Option<Recorded> {
        Some(Recorded {
            pid,
            nonce: Some(nonce.clone()),
        })
    }

    #[test]
    fn a_record_finds_the_live_worker_and_not_a_dead_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let worker = Running::worker_like(&sh(), dir.path());
        let records = WorkerRecords::new(dir.path().to_owned(), WorkerIdentity::of(&sh()));
        let pid = worker.pid();
        let n = nonce();
        records.write("ep", pid, &n);
        assert_eq!(records.live("ep"), rec(pid, &n));
        let mode = fs::metadata(dir.path().join("ep.pid"))
            .expect("record")
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // A record whose start time differs (the pid was reused) is not live.
        fs::write(dir.path().join("ep.pid"), format!("{pid} 1\n")).expect("write");
        assert_eq!(records.live("ep"), None);
        let mut child = Command::new("true").spawn().expect("spawn");
        let gone = child.id();
        child.wait().expect("wait");
        records.write("gone", gone, &n);
        assert_eq!(records.live("gone"), None);
        records.remove("ep");
        assert!(!dir.path().join("ep.pid").exists());
        assert_eq!(records.live("never"), None);
    }

    #[test]
    fn a_record_naming_a_process_that_is_not_our_worker_is_not_live() {
        let dir = tempfile::tempdir().expect("tempdir");
        let records = WorkerRecords::new(dir.path().to_owned(), WorkerIdentity::of(&sh()));
        // A live process with its true start time, but not started as a worker.
        let sleep = Running::started(Command::new("sleep").arg("60").spawn().expect("sleep"));
        let forged = format!(
            "{} {}\n",
            sleep.pid(),
            start_time(sleep.pid()).expect("start")
        );
        fs::write(dir.path().join("ep.pid"), &forged).expect("write");
        assert_eq!(records.live("ep"), None);
        // A worker of another executable.
        let worker = Running::worker_like(&sh(), dir.path());
        let other = WorkerRecords::new(
            dir.path().to_owned(),
            WorkerIdentity::of(&fs::canonicalize("/bin/true").expect("true")),
        );
        let n = nonce();
        records.write("w", worker.pid(), &n);
        assert_eq!(records.live("w"), rec(worker.pid(), &n), "positive control");
        assert_eq!(other.live("w"), None);
        // A record that is a symbolic link to a genuine record is not read.
        std::os::unix::fs::symlink(dir.path().join("w.pid"), dir.path().join("link.pid"))
            .expect("symlink");
        assert_eq!(records.live("link"), None);
        // ... nor written through: the link stays a link to the record it named.
        records.write("link", worker.pid(), &n);
        assert!(
            !fs::symlink_metadata(dir.path().join("link.pid"))
                .expect("link")
                .file_type()
                .is_symlink()
        );
        assert_eq!(records.live("w"), rec(worker.pid(), &n));
    }

    #[test]
    fn a_record_of_an_earlier_release_has_no_nonce_and_a_bad_nonce_is_no_record() {
        let dir = tempfile::tempdir().expect("tempdir");
        let worker = Running::worker_like(&sh(), dir.path());
        let records = WorkerRecords::new(dir.path().to_owned(), WorkerIdentity::of(&sh()));
        let (pid, start) = (worker.pid(), start_time(worker.pid()).expect("start"));
        let record = |text: String| fs::write(dir.path().join("ep.pid"), text).expect("write");
        // An earlier release's record: `PID START`.
        record(format!("{pid} {start}\n"));
        assert_eq!(records.live("ep"), Some(Recorded { pid, nonce: None }));
        // A third field that is no nonce, or a fourth field: not a record of ours.
        for bad in ["zz", "0123456789ABCDEF0123456789abcdef"] {
            record(format!("{pid} {start} {bad}\n"));
            assert_eq!(records.live("ep"), None, "{bad}");
        }
        let n = nonce();
        record(format!("{pid} {start} {} more\n", n.as_str()));
        assert_eq!(records.live("ep"), None);
        // Positive control: this release's record.
        record(format!("{pid} {start} {}\n", n.as_str()));
        assert_eq!(records.live("ep"), rec(pid, &n));
    }

    #[test]
    fn the_check_names_what_is_wrong() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ours = WorkerIdentity::of(&sh());
        let worker = Running::worker_like(&sh(), dir.path());
        ours.check(worker.pid()).expect("a worker of ours");
        let other_uid = WorkerIdentity {
            uid: ours.uid + 1,
            ..ours.clone()
        };
        assert!(matches!(
            other_uid.check(worker.pid()),
            Err(NotOurWorker::Uid { uid, ours: o, .. }) if uid == ours.uid && o == ours.uid + 1
        ));
        let sleep = Running::started(Command::new("sleep").arg("60").spawn().expect("sleep"));
        let e = ours.check(sleep.pid()).expect_err("sleep is no worker");
        assert!(
            matches!(&e, NotOurWorker::Cmdline { args, .. } if args.ends_with("sleep 60")),
            "{e:?}"
        );
        let true_ = WorkerIdentity::of(Path::new("/bin/true"));
        assert!(matches!(
            true_.check(worker.pid()),
            Err(NotOurWorker::Exe { exe, .. }) if exe == sh()
        ));
        let mut child = Command::new("true").spawn().expect("spawn");
        let gone = child.id();
        child.wait().expect("wait");
        assert!(matches!(ours.check(gone), Err(NotOurWorker::Gone(p)) if p == gone));
    }

    #[test]
    fn a_worker_of_an_executable_replaced_on_disk_is_still_ours() {
        let dir = tempfile::tempdir().expect("tempdir");
        let exe = dir.path().join("switchyard");
        fs::copy(sh(), &exe).expect("copy");
        let worker = Running::worker_like(&exe, dir.path());
        WorkerIdentity::of(&exe)
            .check(worker.pid())
            .expect("the same file");
        // An upgrade: a new file renamed onto the path.
        let new = dir.path().join("switchyard.new");
        fs::copy(sh(), &new).expect("copy");
        fs::rename(&new, &exe).expect("rename");
        WorkerIdentity::of(&exe)
            .check(worker.pid())
            .expect("the same path, deleted");
        // Another path is not.
        let elsewhere = dir.path().join("other");
        fs::copy(sh(), &elsewhere).expect("copy");
        assert!(matches!(
            WorkerIdentity::of(&elsewhere).check(worker.pid()),
            Err(NotOurWorker::Exe { .. })
        ));
    }
}
