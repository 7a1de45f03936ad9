//! A worker that replaces its own process image ([`Note::Reexec`](crate::custody::Note::Reexec)): how a failover (or any
//! replacement the daemon chooses) continues a device without a moment in which only the
//! daemon holds the guest's descriptors.
//!
//! Killing a worker and starting its replacement leaves a window: the descriptors of the
//! guest's view (its connection, DMA memory, eventfds, VRAM, the black box) then live only in
//! the supervisor, and a daemon killed in that window takes the last copies with it (the
//! guest's connection resets, the device's state is gone). A re-exec has no such window: the
//! worker leaves every descriptor of its ledger open across `execve` of its own executable
//! and writes what the new image needs (a `Plan`: the start and the descriptors' numbers)
//! into a memfd it also leaves open. The process, and so every descriptor, lives on; the new
//! image continues the device from the black box as a replacement would, and offers its
//! adoption socket; its supervisor (or a new daemon's, if the old one died meanwhile) adopts
//! it and gets the whole ledger. Same pid, same worker record.

use std::collections::BTreeMap;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::custody::DeviceSpec;
use crate::keeper::Keeper;

/// The environment variable naming the plan's descriptor in a re-executed image.
pub const REEXEC_FD_ENV: &str = "SWITCHYARD_REEXEC_FD";

/// The parts of a worker's start that a re-exec keeps.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    pub endpoint: String,
    pub socket: PathBuf,
    pub adopt_dir: Option<PathBuf>,
    pub fd_budget: Option<u32>,
    pub failover: bool,
    /// The worker's nonce: the same process, the same record, the same proof.
    pub nonce: Option<crate::custody::WorkerNonce>,
    pub migration: crate::custody::MigrationSettings,
}

/// What the image before the exec tells the image after it.
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Plan {
    pub endpoint: String,
    pub socket: PathBuf,
    pub device: DeviceSpec,
    pub adopt_dir: Option<PathBuf>,
    pub fd_budget: Option<u32>,
    /// The endpoint's workers before the new image (this one counted).
    pub restarts: u64,
    pub failover: bool,
    pub lease: Option<String>,
    /// Absent from a plan of an earlier release's image.
    #[serde(default)]
    pub nonce: Option<crate::custody::WorkerNonce>,
    /// The migration streams' origin and idle timeout (absent from an earlier release's
    /// image: none, the server's default timeout).
    #[serde(default)]
    pub migration: crate::custody::MigrationSettings,
    /// The ledger: custody id → descriptor number.
    pub held: Vec<(u64, i32)>,
    /// The memory objects: name → descriptor number.
    pub objects: Vec<(String, i32)>,
}

/// What a re-exec gives the new image, taken back ([`take_plan`]).
#[derive(Debug)]
pub(crate) struct Taken {
    pub plan: Plan,
    pub held: BTreeMap<u64, OwnedFd>,
    pub objects: BTreeMap<String, OwnedFd>,
}

/// Why a re-exec did not happen (the worker serves on as it was).
#[derive(Debug, thiserror::Error)]
pub enum ReexecError {
    /// The plan or a descriptor could not be prepared.
    #[error("Cannot prepare the re-exec")]
    Prepare(#[source] std::io::Error),
    /// `execve` failed.
    #[error("Cannot execute the worker's own executable")]
    Exec(#[source] std::io::Error),
    /// A re-executed image cannot read its plan.
    #[error("Cannot read the re-exec plan")]
    Plan(#[source] std::io::Error),
}

/// Replaces this process's image by a fresh `switchyard worker` that continues the device
/// as `device`, serving `lease`, with everything `keeper` holds. Returns only on failure.
pub(crate) fn exec(
    keeper: &Keeper,
    id: &Identity,
    device: DeviceSpec,
    lease: Option<String>,
) -> ReexecError {
    match prepare(keeper, id, device, lease) {
        // Kept open across the exec (and closed again if it fails).
        Ok((memfd, _open)) => {
            // The same arguments (`worker`, and `--no-jail` if this image has it): a jailed
            // image's jail goes on in the new one anyway (it survives the exec).
            let err = std::process::Command::new("/proc/self/exe")
                .args(std::env::args_os().skip(1))
                .env(REEXEC_FD_ENV, memfd.as_raw_fd().to_string())
                .exec();
            ReexecError::Exec(err)
        }
        Err(e) => ReexecError::Prepare(e),
    }
}

/// The plan in a memfd, and the descriptors it names, all without close-on-exec.
fn prepare(
    keeper: &Keeper,
    id: &Identity,
    device: DeviceSpec,
    lease: Option<String>,
) -> std::io::Result<(std::fs::File, Vec<OwnedFd>)> {
    let snapshot = keeper.snapshot()?;
    let mut open = Vec::with_capacity(snapshot.held.len() + snapshot.objects.len());
    let mut inherit = |fd: &OwnedFd| -> std::io::Result<i32> {
        // `dup` leaves close-on-exec off on the copy.
        let copy = rustix::io::dup(fd.as_fd())?;
        let raw = copy.as_raw_fd();
        open.push(copy);
        Ok(raw)
    };
    let mut held = Vec::new();
    for (cid, fd) in &snapshot.held {
        held.push((*cid, inherit(fd)?));
    }
    let mut objects = Vec::new();
    for (name, fd) in &snapshot.objects {
        objects.push((name.clone(), inherit(fd)?));
    }
    let plan = Plan {
        endpoint: id.endpoint.clone(),
        socket: id.socket.clone(),
        device,
        adopt_dir: id.adopt_dir.clone(),
        fd_budget: id.fd_budget,
        restarts: snapshot.restarts + 1,
        failover: id.failover,
        lease,
        nonce: id.nonce.clone(),
        migration: id.migration.clone(),
        held,
        objects,
    };
    let memfd = rustix::fs::memfd_create("switchyard-reexec", rustix::fs::MemfdFlags::empty())?;
    let mut file = std::fs::File::from(memfd);
    file.write_all(&serde_json::to_vec(&plan).map_err(std::io::Error::other)?)?;
    file.rewind()?;
    Ok((file, open))
}

/// In a re-executed image: the plan and the descriptors it names, taken back (each with
/// close-on-exec again); standard input (the old custody channel) is pointed at /dev/null,
/// so that the supervisor sees the old image's channel close and adopts this one.
pub(crate) fn take_plan(raw: &str) -> Result<Taken, ReexecError> {
    let bad = |what: String| ReexecError::Plan(std::io::Error::other(what));
    let raw: i32 = raw
        .parse()
        .map_err(|_| bad(format!("{REEXEC_FD_ENV}={raw} is not a descriptor number")))?;
    let mut file =
        std::fs::File::from(switchyard_sys::inherit::take(raw).map_err(ReexecError::Plan)?);
    let mut json = Vec::new();
    file.read_to_end(&mut json).map_err(ReexecError::Plan)?;
    let plan: Plan =
        serde_json::from_slice(&json).map_err(|e| bad(format!("the plan is not valid: {e}")))?;
    let take = |raw: i32| switchyard_sys::inherit::take(raw).map_err(ReexecError::Plan);
    let mut held = BTreeMap::new();
    for (cid, raw) in &plan.held {
        held.insert(*cid, take(*raw)?);
    }
    let mut objects = BTreeMap::new();
    for (name, raw) in &plan.objects {
        objects.insert(name.clone(), take(*raw)?);
    }
    let devnull = std::fs::File::open("/dev/null").map_err(ReexecError::Plan)?;
    rustix::stdio::dup2_stdin(&devnull).map_err(|e| ReexecError::Plan(e.into()))?;
    Ok(Taken {
        plan,
        held,
        objects,
    })
}
