//! The jail of a process that parses a client's every byte: `switchyard worker` (and
//! `switchyard serve`, under the same policy). It keeps the process's uid (the packaged unit
//! cannot change it, and adoption checks it) and takes away what a serving device never
//! needs, so that a client who takes over the process gets little more than its own device.
//!
//! Two steps, because Landlock (up to ABI 7) restricts only the calling thread and the
//! threads it starts afterwards, while seccomp can filter every thread at once (TSYNC):
//!
//! 1. [`restrict_files`], before the process starts any thread (so that every thread is in
//!    the domain): no-new-privileges, then a Landlock domain that handles every file-system
//!    right of ABI 6 (TCP bind and connect too, with no rule: none) and scopes signals and
//!    abstract UNIX sockets to the domain. What it may still open: its own executable
//!    (execute: the re-exec of a failover) and the libraries mapped now (read: the re-executed
//!    image's loader), `/etc/ld.so.cache`, `/dev/null`, `/proc` read-only and
//!    `/proc/self/mem` (read-write), a socket of its own in the given directories
//!    ([`Places`]), and its kind's device nodes ([`Policy`]).
//! 2. [`restrict_syscalls`], once the device is built and every socket bound: the kind's
//!    seccomp allow-list on every thread; any other system call fails with `EPERM`, and
//!    `clone3` with `ENOSYS` (so that threads are made with `clone`, whose flags the filter
//!    can see: threads only, no new process).
//!
//! A re-executed worker ([`crate::reexec`]) inherits both (they survive `execve` and cannot
//! be loosened), so its whole start runs inside them; it does not stack them again (Landlock
//! allows 16 layers, seccomp 32768 instructions in all). The policy of each kind, and what
//! the jail costs, are in `docs/security.md` and `docs/performance.md`.

mod files;
mod syscalls;

use std::path::{Path, PathBuf};

pub use files::Places;

/// The policy of a device kind: its Landlock rules and its seccomp allow-list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// The software GPU: memfds only, no device node.
    SoftGpu,
    /// The scratchpad: memfds only, no device node.
    Scratchpad,
    /// A physical device through VFIO: `/dev/vfio`, sysfs read-only, its ioctls.
    Vfio,
    /// The softgpu on an NVIDIA GPU: no seccomp allow-list (the CUDA driver's system calls
    /// are not known until a GPU run exercises one); Landlock lets it read every file and
    /// use the `/dev/nvidia*` nodes.
    Cuda,
    /// A kind this module does not know: no-new-privileges and the common Landlock rules
    /// only, said in the log.
    Generic,
}

impl Policy {
    /// The policy of the device kind `kind` (`softgpu`, `scratchpad`, `vfio`, `cuda`).
    pub fn for_kind(kind: &str) -> Self {
        match kind {
            "softgpu" => Self::SoftGpu,
            "scratchpad" => Self::Scratchpad,
            "vfio" => Self::Vfio,
            "cuda" => Self::Cuda,
            _ => Self::Generic,
        }
    }

    /// Its name in logs.
    pub fn name(self) -> &'static str {
        match self {
            Self::SoftGpu => "softgpu",
            Self::Scratchpad => "scratchpad",
            Self::Vfio => "vfio",
            Self::Cuda => "cuda",
            Self::Generic => "generic",
        }
    }

    /// Whether the policy filters system calls (a seccomp allow-list).
    pub fn filters_syscalls(self) -> bool {
        !matches!(self, Self::Cuda | Self::Generic)
    }
}

/// Why a process could not be jailed (it does not serve then: `--no-jail` runs it without).
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The Landlock ruleset could not be built or enforced.
    #[error("Cannot enforce the Landlock rules")]
    Landlock(#[from] landlock::RulesetError),
    /// A path a rule names cannot be opened.
    #[error("Cannot open {0} for a Landlock rule")]
    Path(PathBuf, #[source] landlock::PathFdError),
    /// The process's view of itself (`/proc/self`) cannot be read.
    #[error("Cannot read {0}")]
    Proc(PathBuf, #[source] std::io::Error),
    /// no-new-privileges is not set after the Landlock step.
    #[error("The kernel does not show no-new-privileges after it was set")]
    NoNewPrivs,
    /// The seccomp filter could not be compiled.
    #[error("Cannot compile the seccomp filter")]
    Compile(#[source] seccompiler::BackendError),
    /// The seccomp filter could not be installed on every thread.
    #[error("Cannot install the seccomp filter")]
    Seccomp(#[source] seccompiler::Error),
}

/// Step 1: no-new-privileges and the Landlock domain of `policy` with `places`, on the
/// calling thread and every thread it starts from now on. Call it before the process starts
/// any thread.
pub fn restrict_files(policy: Policy, places: &Places) -> Result<FilesReport, JailError> {
    let report = files::restrict(policy, places)?;
    if !kernel_view(None)?.no_new_privs {
        return Err(JailError::NoNewPrivs);
    }
    Ok(report)
}

/// What [`restrict_files`] enforced.
#[derive(Debug, Clone)]
pub struct FilesReport {
    /// The kernel's Landlock ABI (0: none).
    pub abi: i32,
    /// Whether every right asked for is enforced (false: the kernel's Landlock is older than
    /// ABI 6, or absent; what it has is enforced).
    pub fully_enforced: bool,
    /// How many path rules the domain has.
    pub rules: usize,
}

/// Step 2: the seccomp allow-list of `policy` on every thread of the process (nothing for a
/// policy without one, see [`Policy::filters_syscalls`]). Returns how many system calls it
/// allows.
pub fn restrict_syscalls(policy: Policy) -> Result<Option<usize>, JailError> {
    if !policy.filters_syscalls() {
        return Ok(None);
    }
    let log_only = crate::knobs::jail_seccomp_log();
    if log_only {
        tracing::warn!(
            "test knob: the seccomp filter logs what it would refuse (SWITCHYARD_TEST_JAIL_SECCOMP=log)"
        );
    }
    syscalls::install(policy, log_only).map(Some)
}

/// Where a process is in its jail, between the two steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Not jailed (`--no-jail`).
    Off,
    /// Step 1 done; the seccomp filter comes once the device is built ([`complete`]).
    Files(Policy),
    /// Inherited from the image before a re-exec: nothing more is applied.
    Inherited(Policy),
}

/// Step 1 for a process about to build a device of kind `kind` (before it starts any
/// thread), or nothing but a log line without `jail` (`--no-jail`).
pub fn begin(jail: bool, kind: &str, places: &Places) -> Result<Stage, JailError> {
    if !jail {
        tracing::warn!(
            "not jailed (--no-jail): no seccomp filter, no Landlock, no no-new-privileges"
        );
        return Ok(Stage::Off);
    }
    let policy = Policy::for_kind(kind);
    // Opened before the jail: a rule on a procfs file holds only while its inode lives.
    if !switchyard_device::dma::open_proc_mem() {
        tracing::warn!("/proc/self/mem cannot be opened: hugetlbfs DMA windows will fail");
    }
    let report = restrict_files(policy, places)?;
    if report.fully_enforced {
        tracing::info!(
            policy = policy.name(),
            landlock_abi = report.abi,
            rules = report.rules,
            "jail: no-new-privileges and Landlock on"
        );
    } else {
        tracing::warn!(
            policy = policy.name(),
            landlock_abi = report.abi,
            rules = report.rules,
            "jail: no-new-privileges on, Landlock only partly enforced (the kernel's Landlock is older than ABI 6, or absent)"
        );
    }
    Ok(Stage::Files(policy))
}

/// The stage of a re-executed image: jailed by its earlier image unless `jail` is off.
pub fn inherited(jail: bool, kind: &str) -> Stage {
    if jail {
        Stage::Inherited(Policy::for_kind(kind))
    } else {
        Stage::Off
    }
}

/// Step 2, once the device is built and every socket bound (see [`begin`]); then the test
/// knob's probe ([`probe_if_asked`]).
pub fn complete(stage: Stage) -> Result<(), JailError> {
    match stage {
        Stage::Off => {}
        Stage::Files(policy) => match restrict_syscalls(policy)? {
            Some(syscalls) => tracing::info!(
                policy = policy.name(),
                syscalls,
                "jailed: the seccomp allow-list is on every thread"
            ),
            None => tracing::warn!(
                policy = policy.name(),
                "jailed without a seccomp filter (no allow-list for this kind): no-new-privileges and Landlock only"
            ),
        },
        Stage::Inherited(policy) => {
            let view = kernel_view(None)?;
            tracing::info!(
                policy = policy.name(),
                no_new_privs = view.no_new_privs,
                seccomp = view.seccomp,
                seccomp_filters = view.seccomp_filters,
                "jailed: the jail of the image before the re-exec goes on"
            );
        }
    }
    probe_if_asked();
    Ok(())
}

/// What the kernel says of a process's jail (`/proc/PID/status`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KernelView {
    /// `NoNewPrivs: 1`.
    pub no_new_privs: bool,
    /// `Seccomp:`: 0 none, 1 strict, 2 filter.
    pub seccomp: u8,
    /// `Seccomp_filters:`: how many filters are stacked.
    pub seccomp_filters: u32,
}

impl KernelView {
    /// Parses the text of `/proc/PID/status`.
    pub fn parse(status: &str) -> Self {
        let mut view = Self::default();
        for line in status.lines() {
            let Some((key, value)) = line.split_once(':') else {
                continue;
            };
            let value = value.trim();
            match key {
                "NoNewPrivs" => view.no_new_privs = value == "1",
                "Seccomp" => view.seccomp = value.parse().unwrap_or(0),
                "Seccomp_filters" => view.seccomp_filters = value.parse().unwrap_or(0),
                _ => {}
            }
        }
        view
    }
}

/// The kernel's view of process `pid` (this one: `None`).
pub fn kernel_view(pid: Option<u32>) -> Result<KernelView, JailError> {
    let path = match pid {
        Some(pid) => PathBuf::from(format!("/proc/{pid}/status")),
        None => PathBuf::from("/proc/self/status"),
    };
    let text = std::fs::read_to_string(&path).map_err(|e| JailError::Proc(path, e))?;
    Ok(KernelView::parse(&text))
}

/// The test knob `SWITCHYARD_TEST_JAIL_PROBE=DIR` (debug builds): tries what a jailed worker
/// must not do and logs what happened, jailed or not (`--no-jail`, the positive control):
/// read `DIR/secret`, create `DIR/made-by-PID` (removed again), open a TCP socket, and
/// start a process (`/bin/true`). Each result is `ok` or the errno's name.
pub fn probe_if_asked() {
    let Some(dir) = crate::knobs::jail_probe() else {
        return;
    };
    let dir = Path::new(&dir);
    let result = |r: std::io::Result<()>| match r {
        Ok(()) => "ok".to_owned(),
        Err(e) => match e.raw_os_error() {
            Some(libc::EACCES) => "EACCES".to_owned(),
            Some(libc::EPERM) => "EPERM".to_owned(),
            Some(n) => format!("errno{n}"),
            None => e.to_string(),
        },
    };
    let read = result(std::fs::read(dir.join("secret")).map(drop));
    let made = dir.join(format!("made-by-{}", std::process::id()));
    let create = result(std::fs::File::create(&made).map(drop));
    let _ = std::fs::remove_file(&made);
    let socket = result(std::net::TcpListener::bind("127.0.0.1:0").map(drop));
    let spawn = result(
        std::process::Command::new("/bin/true")
            .spawn()
            .and_then(|mut c| c.wait())
            .map(drop),
    );
    tracing::warn!(
        pid = std::process::id(),
        %read,
        %create,
        %socket,
        %spawn,
        "test knob: jail probe"
    );
}

#[cfg(test)]
mod tests;
