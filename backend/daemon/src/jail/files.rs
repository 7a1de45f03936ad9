//! Step 1 of the jail: no-new-privileges and a Landlock domain (see the [parent](super)).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use landlock::{
    ABI, Access, AccessFs, AccessNet, BitFlags, LandlockStatus, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreatedAttr, RulesetStatus, Scope,
};

use super::{FilesReport, JailError, Policy};

/// The newest Landlock ABI the rules are written for: what the kernel lacks of it is left
/// out (best effort), said in the log.
const ABI_WANTED: ABI = ABI::V6;

/// Where a jailed process may put files of its own, besides what its [`Policy`] allows.
#[derive(Debug, Clone, Default)]
pub struct Places {
    /// Directories where it binds (and replaces) a socket of its own: a worker's adoption
    /// socket in `<state>/workers`.
    pub socket_dirs: Vec<PathBuf>,
    /// Directories where it removes its socket when it exits: `serve`'s socket directory.
    pub remove_dirs: Vec<PathBuf>,
}

pub(super) fn restrict(policy: Policy, places: &Places) -> Result<FilesReport, JailError> {
    let abi = ABI_WANTED;
    let mut ruleset = Ruleset::default()
        .handle_access(AccessFs::from_all(abi))?
        .handle_access(AccessNet::from_all(abi))?
        .scope(Scope::from_all(abi))?
        .create()?;
    let rules = rules(policy, places)?;
    let count = rules.len();
    for (path, access) in rules {
        let fd = PathFd::new(&path).map_err(|e| JailError::Path(path.clone(), e))?;
        ruleset = ruleset.add_rule(PathBeneath::new(fd, access))?;
    }
    let status = ruleset.restrict_self()?;
    Ok(FilesReport {
        abi: match status.landlock {
            LandlockStatus::Available {
                effective_abi,
                kernel_abi,
            } => kernel_abi.unwrap_or(effective_abi as i32),
            _ => 0,
        },
        fully_enforced: status.ruleset == RulesetStatus::FullyEnforced,
        rules: count,
    })
}

/// The rules of `policy`: each path and what may be done beneath it. Paths that do not
/// exist are left out (a host without `/dev/vfio`, without `/etc/ld.so.cache`).
fn rules(policy: Policy, places: &Places) -> Result<Vec<(PathBuf, BitFlags<AccessFs>)>, JailError> {
    let abi = ABI_WANTED;
    let read_tree = AccessFs::ReadFile | AccessFs::ReadDir;
    let read = BitFlags::from(AccessFs::ReadFile);
    let read_write = AccessFs::ReadFile | AccessFs::WriteFile;
    let device = AccessFs::ReadFile | AccessFs::WriteFile | AccessFs::IoctlDev;
    let mut rules: Vec<(PathBuf, BitFlags<AccessFs>)> = Vec::new();
    // Its own executable, the file the process runs (a re-exec executes it again, even once
    // an upgrade replaced the file at its path).
    let exe = PathBuf::from("/proc/self/exe");
    rules.push((exe.clone(), AccessFs::Execute | AccessFs::ReadFile));
    // What the loader of a re-executed image reads: the libraries mapped now; the loader
    // itself is executed by the kernel (as the executable's interpreter).
    for lib in mapped_files(&exe)? {
        let loader = lib
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with("ld-"));
        let access = if loader {
            AccessFs::ReadFile | AccessFs::Execute
        } else {
            read
        };
        rules.push((lib, access));
    }
    rules.push(("/etc/ld.so.cache".into(), read));
    rules.push(("/dev/null".into(), read_write));
    // Its own state (`/proc/self/fd`, `maps`, `status`; limits in `/proc/sys`), read-only:
    // Landlock keeps other processes' memory and environment out of reach (a domain may
    // not trace a process outside it); `/proc/self/mem` read-write (hugetlbfs DMA).
    rules.push(("/proc".into(), read_tree));
    rules.push(("/proc/self/mem".into(), read_write));
    for dir in &places.socket_dirs {
        rules.push((dir.clone(), AccessFs::MakeSock | AccessFs::RemoveFile));
    }
    for dir in &places.remove_dirs {
        rules.push((dir.clone(), AccessFs::RemoveFile.into()));
    }
    match policy {
        Policy::SoftGpu | Policy::Scratchpad | Policy::Generic => {}
        Policy::Vfio => {
            rules.push(("/dev/vfio".into(), device | AccessFs::ReadDir));
            rules.push(("/sys".into(), read_tree));
        }
        Policy::Cuda => {
            // The driver, NVRTC and cuBLAS are loaded at run time, from wherever the
            // host installed them: every file may be read, none written but the GPU's nodes.
            rules.push(("/".into(), read_tree));
            for node in nvidia_nodes() {
                rules.push((node, device | AccessFs::ReadDir));
            }
        }
    }
    // Keep what exists; a file gets only the rights a file can have.
    let mut kept = Vec::with_capacity(rules.len());
    for (path, access) in rules {
        match std::fs::metadata(&path) {
            Ok(m) if m.is_dir() => kept.push((path, access)),
            Ok(_) => kept.push((path, access & AccessFs::from_file(abi))),
            Err(e) => tracing::debug!(path = %path.display(), error = %e, "no such path; no rule"),
        }
    }
    Ok(kept)
}

/// The files mapped into this process (its libraries), but `exe` itself and files deleted
/// since (memfds).
fn mapped_files(exe: &Path) -> Result<BTreeSet<PathBuf>, JailError> {
    let maps = PathBuf::from("/proc/self/maps");
    let text = std::fs::read_to_string(&maps).map_err(|e| JailError::Proc(maps, e))?;
    let exe = std::fs::canonicalize(exe).ok();
    Ok(text
        .lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .filter(|path| path.starts_with('/'))
        .map(PathBuf::from)
        .filter(|path| Some(path) != exe.as_ref() && !path.starts_with("/memfd:"))
        .filter(|path| !path.starts_with("/dev") && !path.starts_with("/proc"))
        .filter(|path| path.exists())
        .collect())
}

/// The NVIDIA device nodes there are now (`/dev/nvidia0`, `nvidiactl`, `nvidia-uvm`,
/// `nvidia-caps/`...): nodes created later are out of reach.
fn nvidia_nodes() -> Vec<PathBuf> {
    let Ok(dir) = std::fs::read_dir("/dev") else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("nvidia"))
        .map(|e| e.path())
        .collect()
}
