//! Step 2 of the jail: the seccomp allow-list of each kind (see the [parent](super)).
//!
//! Built by reading what a worker does (the server's data path, custody, the kinds' builds
//! and recoveries, moves, the re-exec of a failover and the loader of the new image) and
//! checked by running every test that starts workers with the filter in log mode
//! (`SWITCHYARD_TEST_JAIL_SECCOMP=log`: the kernel logs each call it would refuse). Grouped
//! by what needs them, so that a kind's list says why each call is there.

use std::collections::BTreeMap;

use seccompiler::{
    BackendError, BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition,
    SeccompFilter, SeccompRule, TargetArch,
};

use super::{JailError, Policy};

/// Reading, writing and waiting on descriptors the process holds (sockets, memfds, eventfds,
/// the client's files), and closing them.
const IO: &[i64] = &[
    libc::SYS_read,
    libc::SYS_write,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_preadv,
    libc::SYS_pwritev,
    libc::SYS_preadv2,
    libc::SYS_pwritev2,
    libc::SYS_lseek,
    libc::SYS_close,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    libc::SYS_fstatfs,
    libc::SYS_statfs,
    libc::SYS_fcntl,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_ftruncate,
    libc::SYS_fallocate,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_ppoll,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_pwait,
    libc::SYS_eventfd2,
    libc::SYS_memfd_create,
    // std::io::copy between files (a memfd's contents into another).
    libc::SYS_copy_file_range,
    libc::SYS_sendfile,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_poll,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_epoll_wait,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_dup2,
];

/// Paths: `/proc/self` (descriptors, maps, status), the adoption socket (bound, made 0600,
/// a stale one removed), the loader of a re-executed image. What may be opened is Landlock's
/// business.
const PATHS: &[i64] = &[
    libc::SYS_openat,
    libc::SYS_readlinkat,
    libc::SYS_getdents64,
    libc::SYS_faccessat,
    libc::SYS_faccessat2,
    libc::SYS_unlinkat,
    libc::SYS_fchmod,
    libc::SYS_fchmodat,
    libc::SYS_getcwd,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_open,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_readlink,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_access,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_unlink,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_chmod,
];

/// UNIX sockets the process already has, or binds and accepts on (the device socket, the
/// adoption socket, custody): descriptors in and out with SCM_RIGHTS. No `connect`: a worker
/// dials nobody (another worker's adoption socket would hand over that worker's guest).
const SOCKETS: &[i64] = &[
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_sendto,
    libc::SYS_recvfrom,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept4,
    libc::SYS_shutdown,
    libc::SYS_getsockopt,
    libc::SYS_setsockopt,
    libc::SYS_getsockname,
    libc::SYS_getpeername,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_accept,
];

/// Memory: the heap, mappings of memfds and client DMA windows, thread stacks.
const MEMORY: &[i64] = &[
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mremap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_msync,
    libc::SYS_mincore,
];

/// Threads, time, signals and the runtime: what std, glibc and the loader of a re-executed
/// image call. `execve` is the re-exec of a failover (Landlock lets it execute only the
/// worker's own executable).
const RUNTIME: &[i64] = &[
    libc::SYS_futex,
    libc::SYS_set_robust_list,
    libc::SYS_get_robust_list,
    libc::SYS_rseq,
    libc::SYS_set_tid_address,
    libc::SYS_sched_yield,
    libc::SYS_sched_getaffinity,
    libc::SYS_nanosleep,
    libc::SYS_clock_nanosleep,
    libc::SYS_clock_gettime,
    libc::SYS_clock_getres,
    libc::SYS_gettimeofday,
    libc::SYS_getrandom,
    libc::SYS_rt_sigaction,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_sigaltstack,
    libc::SYS_tgkill,
    libc::SYS_getpid,
    libc::SYS_gettid,
    libc::SYS_getppid,
    libc::SYS_getuid,
    libc::SYS_geteuid,
    libc::SYS_getgid,
    libc::SYS_getegid,
    libc::SYS_prlimit64,
    libc::SYS_uname,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_restart_syscall,
    libc::SYS_execve,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_arch_prctl,
    #[cfg(target_arch = "x86_64")]
    libc::SYS_getrlimit,
];

/// The `ioctl`s of a kind without a device node: non-blocking and close-on-exec flags, and
/// whether a descriptor is a terminal (the logger's colours). No `TIOCSTI` on a terminal
/// that `serve`'s standard error may be.
// The casts: libc's `Ioctl` is `c_ulong` on glibc, `c_int` on musl.
#[allow(clippy::unnecessary_cast)]
const FD_IOCTLS: &[u64] = &[
    libc::FIONBIO as u64,
    libc::FIOCLEX as u64,
    libc::FIONCLEX as u64,
    libc::TCGETS as u64,
];

/// `prctl`s: naming threads.
const PRCTLS: &[u64] = &[libc::PR_SET_NAME as u64, libc::PR_GET_NAME as u64];

/// The allow-list of `policy`: each system call with the conditions one of which its
/// arguments must meet (none: any arguments).
pub(super) fn allow_list(policy: Policy) -> Result<BTreeMap<i64, Vec<SeccompRule>>, BackendError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for group in [IO, PATHS, SOCKETS, MEMORY, RUNTIME] {
        for &nr in group {
            rules.insert(nr, Vec::new());
        }
    }
    let eq = |arg: u8, value: u64| {
        SeccompCondition::new(arg, SeccompCmpArgLen::Dword, SeccompCmpOp::Eq, value)
            .and_then(|c| SeccompRule::new(vec![c]))
    };
    let any_of = |arg: u8, values: &[u64]| -> Result<Vec<SeccompRule>, BackendError> {
        values.iter().map(|v| eq(arg, *v)).collect()
    };
    // UNIX sockets only (the adoption socket; signal-hook's pipe in `serve`).
    rules.insert(libc::SYS_socket, any_of(0, &[libc::AF_UNIX as u64])?);
    rules.insert(libc::SYS_socketpair, any_of(0, &[libc::AF_UNIX as u64])?);
    // Threads, never a new process: `clone` with CLONE_THREAD (`clone3`, whose flags a
    // filter cannot read, answers ENOSYS: see `no_clone3`).
    let thread = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Qword,
        SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
        libc::CLONE_THREAD as u64,
    )?;
    rules.insert(libc::SYS_clone, vec![SeccompRule::new(vec![thread])?]);
    rules.insert(libc::SYS_clone3, Vec::new());
    rules.insert(libc::SYS_prctl, any_of(0, PRCTLS)?);
    match policy {
        Policy::SoftGpu | Policy::Scratchpad => {
            rules.insert(libc::SYS_ioctl, any_of(1, FD_IOCTLS)?);
        }
        Policy::Vfio => {
            // VFIO's container, group and device ioctls, on descriptors opened before the
            // jail or in `/dev/vfio` (Landlock); pinning guest memory counts against
            // RLIMIT_MEMLOCK.
            rules.insert(libc::SYS_ioctl, Vec::new());
            rules.insert(libc::SYS_mlock, Vec::new());
            rules.insert(libc::SYS_munlock, Vec::new());
        }
        Policy::Cuda | Policy::Generic => unreachable!("no allow-list for {}", policy.name()),
    }
    Ok(rules)
}

/// The filters of `policy`: the allow-list (anything else `EPERM`, or logged and allowed
/// with `log_only`), and one that answers `clone3` with `ENOSYS`, so that glibc makes its
/// threads with `clone`; and how many calls the allow-list has.
pub(super) fn compile(
    policy: Policy,
    log_only: bool,
) -> Result<(BpfProgram, BpfProgram, usize), JailError> {
    let arch = TargetArch::try_from(std::env::consts::ARCH).map_err(JailError::Compile)?;
    let rules = allow_list(policy).map_err(JailError::Compile)?;
    let count = rules.len();
    let denied = if log_only {
        SeccompAction::Log
    } else {
        SeccompAction::Errno(libc::EPERM as u32)
    };
    let compile = |rules, mismatch, matched| -> Result<BpfProgram, JailError> {
        SeccompFilter::new(rules, mismatch, matched, arch)
            .and_then(BpfProgram::try_from)
            .map_err(JailError::Compile)
    };
    let allow = compile(rules, denied, SeccompAction::Allow)?;
    let no_clone3 = compile(
        BTreeMap::from([(libc::SYS_clone3, Vec::new())]),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::ENOSYS as u32),
    )?;
    Ok((allow, no_clone3, count))
}

/// Installs `policy`'s filters ([`compile`]) on every thread. Returns how many calls the
/// allow-list has.
pub(super) fn install(policy: Policy, log_only: bool) -> Result<usize, JailError> {
    let (allow, no_clone3, count) = compile(policy, log_only)?;
    seccompiler::apply_filter_all_threads(&no_clone3).map_err(JailError::Seccomp)?;
    seccompiler::apply_filter_all_threads(&allow).map_err(JailError::Seccomp)?;
    Ok(count)
}
