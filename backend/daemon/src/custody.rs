//! The custody channel between the supervisor and a worker: one `SOCK_SEQPACKET` pair, each
//! datagram a JSON [`Note`] with the descriptors it names attached (`SCM_RIGHTS`).
//!
//! Worker → supervisor: [`Note::Hold`] (keep these descriptors under these ids),
//! [`Note::Release`], [`Note::Ready`]. Supervisor → worker, at start: [`Note::Fds`] batches
//! (descriptors held for this endpoint), then one [`Note::Start`]; later [`Note::Move`],
//! answered by [`Note::Moved`] or [`Note::MoveFailed`].

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use serde::{Deserialize, Serialize};
use switchyard_server::continuity::Custody;

use crate::lifecycle::{BoardFailure, LostDevice, LostState, MigrationChange};

/// Largest datagram on the channel.
pub const MAX_NOTE: usize = 64 << 10;
/// Most descriptors per datagram (below the kernel's `SCM_MAX_FD`).
pub const MAX_FDS: usize = 200;

pub use switchyard_server::continuity::{BLACK_BOX_ID, CONNECTION_ID, LISTENER_ID};

mod nonce;

pub use nonce::WorkerNonce;

/// Custody ids under which workers before custody by name held their (softgpu) memory
/// objects, with those objects' names: what a worker of an earlier release puts in custody
/// (an upgrade adopts it) is held by name. The ids are
/// [`RETIRED_IDS`](switchyard_server::continuity::RETIRED_IDS).
pub const LEGACY_OBJECT_IDS: [(u64, &str); 3] = [
    (4, "softgpu.vram"),
    (5, "softgpu.vram@next"),
    (6, "softgpu.doorbells"),
];

/// The name a legacy custody id stands for, if it is one ([`LEGACY_OBJECT_IDS`]).
pub fn legacy_object(id: u64) -> Option<&'static str> {
    LEGACY_OBJECT_IDS
        .iter()
        .find(|(i, _)| *i == id)
        .map(|(_, name)| *name)
}

#[cfg(test)]
mod legacy_tests {
    #[test]
    fn legacy_object_ids_are_the_retired_ids() {
        for (id, _) in super::LEGACY_OBJECT_IDS {
            assert!(
                switchyard_server::continuity::RETIRED_IDS.contains(&id),
                "{id}"
            );
        }
    }
}

/// What a move of the device to another board did (worker → supervisor).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct MoveReport {
    /// Pre-copy rounds while the device ran (the first copies all data in VRAM).
    pub rounds: u32,
    /// Bytes copied, the final round included.
    pub bytes: u64,
    /// Bytes copied by the last pre-copy round.
    pub last_round_bytes: u64,
    /// Bytes copied by the final round, with the device stopped.
    pub final_bytes: u64,
    /// Pre-copy time, microseconds.
    pub precopy_us: u64,
    /// Waiting for the commands running at the stop to complete, microseconds (the device
    /// works meanwhile).
    pub park_wait_us: u64,
    /// Downtime, microseconds: from the engines' stop to the successor running on the new
    /// board. Region accesses waited for part of it ([`MoveReport::held_us`]).
    pub downtime_us: u64,
    /// How long region accesses waited (the swap held the device), microseconds.
    pub held_us: u64,
    /// The final copy, microseconds.
    pub final_copy_us: u64,
    /// The device moved, but its new memory could not be put in custody under its name
    /// (why): a replacement after a kill may not find it. The move stands (the worker's
    /// data path is the truth). Absent from workers of earlier releases, and when custody
    /// took it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub custody_error: Option<String>,
}

/// How a worker's last move stands ([`LastMove`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MoveState {
    /// The data path is still running.
    Running,
    /// The data path finished: the device runs on the target's memory.
    Moved {
        /// What it took; none when the worker died during the move and its replacement
        /// runs the device on the target (a supervisor's conclusion, not a worker's report).
        #[serde(default)]
        report: Option<MoveReport>,
    },
    /// The move was refused or failed: the device runs where it was.
    Failed {
        /// Why (an error chain).
        error: String,
    },
}

/// The last move a worker ran ([`Note::Move`]) and how it stands: what a worker tells an
/// adopting supervisor ([`Note::Adopted`]), so that a move its last supervisor did not live
/// to see the end of is settled by what the data path did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LastMove {
    /// Where to ([`Note::Move`]'s `to`).
    pub to: String,
    /// How it stands.
    pub state: MoveState,
}

impl LastMove {
    /// Whether this is a finished move to `to`: the device runs there.
    pub fn moved_to(&self, to: &str) -> bool {
        self.to == to && matches!(self.state, MoveState::Moved { .. })
    }

    /// Whether the data path is still running.
    pub fn running(&self) -> bool {
        self.state == MoveState::Running
    }
}

/// A worker's report of what it served since its last one ([`Note::Stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerStats {
    /// `(command number, messages)`, commands with messages only.
    pub messages: Vec<(u16, u64)>,
    /// Request latencies: counts per bucket of `switchyard_server::stats::LATENCY_BOUNDS_NS`,
    /// then the overflow.
    pub latency_buckets: Vec<u64>,
    /// Sum of those latencies, nanoseconds.
    pub latency_sum_ns: u64,
    /// Commands the device completed.
    pub jobs: u64,
    /// Bytes those commands produced.
    pub bytes: u64,
    /// Commands that failed (stopped their queue).
    pub errors: u64,
    /// Commands the device ran again after a restart or failover (idempotent ones in flight
    /// when its last process died); absent from workers of earlier releases.
    #[serde(default)]
    pub replayed: u64,
    /// Commands in flight when its last process died that could not run again (their queues
    /// stopped with an "interrupted" error); absent from workers of earlier releases.
    #[serde(default)]
    pub interrupted: u64,
}

impl WorkerStats {
    /// Adds `other` (a later report) into this one: one report of both periods.
    pub fn add(&mut self, other: &WorkerStats) {
        for (cmd, n) in &other.messages {
            match self.messages.iter_mut().find(|(c, _)| c == cmd) {
                Some((_, m)) => *m = m.saturating_add(*n),
                None => self.messages.push((*cmd, *n)),
            }
        }
        if self.latency_buckets.len() < other.latency_buckets.len() {
            self.latency_buckets.resize(other.latency_buckets.len(), 0);
        }
        for (a, b) in self.latency_buckets.iter_mut().zip(&other.latency_buckets) {
            *a = a.saturating_add(*b);
        }
        self.latency_sum_ns = self.latency_sum_ns.saturating_add(other.latency_sum_ns);
        self.jobs = self.jobs.saturating_add(other.jobs);
        self.bytes = self.bytes.saturating_add(other.bytes);
        self.errors = self.errors.saturating_add(other.errors);
        self.replayed = self.replayed.saturating_add(other.replayed);
        self.interrupted = self.interrupted.saturating_add(other.interrupted);
    }

    /// Whether nothing happened.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
            && self.jobs == 0
            && self.errors == 0
            && self.replayed == 0
            && self.interrupted == 0
    }
}

/// What a worker serves: a device kind and its options (`switchyard-kinds`).
pub use switchyard_kinds::DeviceSpec;

/// What serves a pool device of this shape: its kind and canonical options (`host`, the
/// passthrough device's PCI address, is among them).
pub fn device_spec(shape: &switchyard_pool::DeviceShape, _host: Option<&str>) -> DeviceSpec {
    DeviceSpec {
        kind: shape.model.clone(),
        options: shape.options.clone(),
    }
}

/// What a worker's server is told of migration streams ([`Note::Start`]; see
/// `switchyard_server::origin`).
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MigrationSettings {
    /// The endpoint's migration token, stamped at the start of its outgoing streams.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub origin: Option<String>,
    /// The token an incoming stream must carry (an incoming endpoint's: its source's); a
    /// stream of another origin leaves the device in ERROR.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expect_origin: Option<String>,
    /// An open stream with no activity for this long is ended, milliseconds (none: the
    /// server's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_ms: Option<u64>,
}

impl std::fmt::Debug for MigrationSettings {
    /// The tokens are capabilities: not in logs.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigrationSettings")
            .field("origin", &self.origin.as_ref().map(|_| ".."))
            .field("expect_origin", &self.expect_origin.as_ref().map(|_| ".."))
            .field("idle_timeout_ms", &self.idle_timeout_ms)
            .finish()
    }
}

/// How a worker starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartMode {
    /// A new device: the worker creates the black box and VRAM and hands them over.
    Fresh,
    /// A replacement: everything comes from custody.
    Resume,
}

/// A batch of memory objects by name: what [`Note::HoldObjects`] and [`Note::Objects`]
/// attach, one descriptor per name.
pub type ObjectNames = Vec<String>;

/// One datagram.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Note {
    /// Keep the attached descriptors under these ids.
    Hold {
        /// One per attached descriptor.
        ids: Vec<u64>,
    },
    /// Close what is held under these ids.
    Release {
        /// Custody ids.
        ids: Vec<u64>,
    },
    /// Keep the attached descriptors as the slot's memory objects under these names (the
    /// device's [`Recoverable::held_objects`](switchyard_device::Recoverable::held_objects),
    /// or a relocation's targets under their pending names), replacing what was held
    /// under a name.
    HoldObjects {
        /// One per attached descriptor.
        names: ObjectNames,
    },
    /// Close the memory objects held under these names.
    ReleaseObjects {
        /// Object names.
        names: ObjectNames,
    },
    /// Memory objects held for this endpoint, by name: handed to a starting worker (after
    /// its [`Note::Fds`], before [`Note::Start`]) and by a worker to an adopting supervisor.
    Objects {
        /// One per attached descriptor.
        names: ObjectNames,
    },
    /// The worker serves (`resumed`: it continued a connection).
    Ready {
        /// It continued a connection.
        resumed: bool,
        /// How its replacement must start, should it die: [`StartMode::Resume`] when the
        /// device can be recovered from what is in custody now. `None` from workers of
        /// earlier releases (the supervisor then infers it from what is held).
        #[serde(default)]
        replacement: Option<StartMode>,
    },
    /// Held descriptors, handed to a starting worker.
    Fds {
        /// One per attached descriptor.
        ids: Vec<u64>,
    },
    /// Move the device onto another board's VRAM (supervisor → worker; one at a time).
    Move {
        /// Where to: the daemon names the target device (a whole board's id is the
        /// board's). The worker remembers it with the outcome ([`LastMove`]).
        to: String,
        /// The VMM has unplugged the device (no client): VRAM the guest could map is moved
        /// too, with one copy (a guest-visible move).
        #[serde(default)]
        detached: bool,
        /// The target device's spec when it differs from the moving one's (another kind
        /// presenting the same device, another GPU): the successor is made one of it
        /// ([`KindConfig::adopt_successor`](switchyard_device::kind::KindConfig::adopt_successor)).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        target: Option<DeviceSpec>,
    },
    /// The move is done: the device runs on the new VRAM (worker → supervisor).
    Moved {
        /// What it took.
        report: MoveReport,
    },
    /// The move was refused or failed; the device runs where it was (worker → supervisor).
    MoveFailed {
        /// Why (an error chain).
        error: String,
    },
    /// A migration stream of the device opened or closed (worker → supervisor): while one
    /// is open (PRE_COPY, STOP_COPY, RESUMING), restarts and upgrades are refused.
    Migration {
        /// A stream is open.
        streaming: bool,
        /// The device's migration state now and what changed it (`state`, `cause`, inline:
        /// the `migration` event's own); absent from workers of earlier releases.
        #[serde(flatten)]
        change: Option<MigrationChange>,
    },
    /// What the worker served since its last report (worker → supervisor, every second
    /// while it serves; for the daemon's metrics).
    Stats(WorkerStats),
    /// A new supervisor asks a running worker for custody (on the worker's adoption socket;
    /// see [`crate::keeper`]).
    Adopt {
        /// The endpoint the supervisor expects the worker to serve.
        endpoint: String,
        /// The nonce the worker's record names: a worker that has another refuses
        /// ([`Note::AdoptRefused`]), keeping its ledger. None from a supervisor of an
        /// earlier release, and for a record of one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<WorkerNonce>,
    },
    /// The worker handed its custody over (after [`Note::Fds`] batches): this connection is
    /// its custody channel now.
    Adopted {
        /// The worker's pid.
        pid: u32,
        /// How its replacement must start ([`Note::Ready`]'s `replacement`).
        #[serde(default)]
        replacement: Option<StartMode>,
        /// Its last move and how it stands (a worker waits for a running one to end before
        /// it hands over, within a bound: [`crate::keeper::ADOPT_MOVE_WAIT`]). `None` when
        /// it moved nothing, and from workers of earlier releases.
        #[serde(default)]
        last_move: Option<LastMove>,
        /// Workers the endpoint had started before this one ([`Note::Start`]'s `restarts`),
        /// so that an adopting daemon counts on from there. `None` from workers of earlier
        /// releases.
        #[serde(default)]
        restarts: Option<u64>,
        /// The lease (the pool's device) the worker serves, as its supervisor last told it
        /// ([`Note::Start`], [`Note::Reexec`]) and its moves changed it: a daemon that adopts
        /// it settles a failover or move left in progress by it. `None` from workers of
        /// earlier releases.
        #[serde(default)]
        lease: Option<String>,
        /// The nonce its supervisor gave it ([`Note::Start`]): what proves it is the worker
        /// its record names. `None` from workers of earlier releases.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<WorkerNonce>,
    },
    /// The worker refused to be adopted.
    AdoptRefused {
        /// Why.
        reason: String,
    },
    /// The device's backing is gone for good, e.g. the kernel took a passthrough device
    /// back (worker → supervisor): every access now fails with ENODEV and the client was
    /// told through its REQ eventfd.
    ///
    /// `{"device_lost":{"host":..,"reason":..}}`, the `device_lost` event's own fields.
    DeviceLost(LostDevice),
    /// The device found its board failed (worker → supervisor): the pool fails the endpoint
    /// over when its policy says so. Whether the device's state outlived the failure: the
    /// black box and the memory objects in custody can continue it elsewhere.
    ///
    /// `{"board_failed":{"reason":..,"state_intact":..}}`, the pool's failure record.
    BoardFailed(BoardFailure),
    /// The board failure the device reported will not be failed over (supervisor → worker:
    /// the pool refused it): the device tells its client now, as it would have without a
    /// pool ([`PciDevice::failure_unhandled`]).
    ///
    /// [`PciDevice::failure_unhandled`]: switchyard_device::PciDevice::failure_unhandled
    FailureUnhandled,
    /// Simulate the board fault `kind` (supervisor → worker; a drill, `ctl fault`).
    Fault {
        /// The fault, one of the device's [`FaultInjection::fault_kinds`].
        ///
        /// [`FaultInjection::fault_kinds`]: switchyard_device::FaultInjection::fault_kinds
        kind: String,
    },
    /// Asks the worker to say how far its custody notes go (supervisor → worker): answered
    /// by [`Note::Synced`] behind every note the worker made before it (see
    /// [`crate::keeper`]). A worker of an earlier release ignores it.
    Sync {
        /// Echoed in the answer.
        token: u64,
    },
    /// The answer to [`Note::Sync`] (worker → supervisor): a supervisor that has read it
    /// has applied every note the worker made before it.
    Synced {
        /// The request's.
        token: u64,
        /// This note's number in the worker's custody sequence.
        seq: u64,
    },
    /// The answer to [`Note::Fault`] (worker → supervisor): `None` when injected.
    FaultInjected {
        /// Why it was not.
        error: Option<String>,
    },
    /// Start serving.
    Start {
        /// Fresh or resume.
        mode: StartMode,
        /// The endpoint's name (logs).
        endpoint: String,
        /// The socket path (logs).
        socket: String,
        /// The device.
        device: DeviceSpec,
        /// Where to offer the adoption socket (`<dir>/w<pid>.sock`), if anywhere.
        #[serde(default)]
        adopt_dir: Option<String>,
        /// The client's descriptor budget (`switchyard_server::ServerConfig::fd_budget`);
        /// none from a supervisor that has none.
        #[serde(default)]
        fd_budget: Option<u32>,
        /// Workers the endpoint started before this one (its restarts so far), for a daemon
        /// that adopts this worker later to count on.
        #[serde(default)]
        restarts: u64,
        /// The daemon fails the endpoint over when its board fails: the device then does not
        /// signal its failure to the client itself (see
        /// [`FailedHook`](switchyard_device::kind::FailedHook)).
        #[serde(default)]
        failover: bool,
        /// The lease (the pool's device) the worker serves, if its supervisor has one.
        #[serde(default)]
        lease: Option<String>,
        /// The worker's nonce (its supervisor writes it in the worker's record), which it
        /// proves when adopted ([`Note::Adopted`]); none from a supervisor that keeps no
        /// records.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        nonce: Option<WorkerNonce>,
        /// Its migration streams' origin and idle timeout.
        #[serde(default)]
        migration: MigrationSettings,
    },
    /// Replace this worker's process image in place (supervisor → worker): the worker execs
    /// a fresh `switchyard worker` that continues the device from what it holds, as a
    /// replacement would, but in the same process, so that every descriptor of the guest's
    /// view lives on at every instant (a daemon killed meanwhile loses nothing: the next one
    /// adopts the new image). The new image builds `device` and serves `lease`.
    Reexec {
        /// The device the new image builds.
        device: DeviceSpec,
        /// The lease it serves.
        #[serde(default)]
        lease: Option<String>,
    },
    /// A replacement could not restore all of what the client had been told succeeded (a
    /// DMA window, an interrupt eventfd): it serves, but the client's state is not whole
    /// (worker → supervisor; the endpoint is reported degraded).
    ///
    /// `{"state_lost":{"problems":[..]}}`, the `state_lost` event's own fields.
    StateLost(LostState),
}

/// Errors on the channel.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The socket failed.
    #[error("Custody channel I/O failed")]
    Io(#[from] io::Error),
    /// The peer closed the channel.
    #[error("The custody channel was closed")]
    Closed,
    /// A datagram does not decode.
    #[error("Malformed custody note")]
    Malformed(#[source] serde_json::Error),
    /// Descriptors do not match the note (dropped by the kernel, or a peer bug).
    #[error("A custody note names {named} descriptors but carries {carried}")]
    FdMismatch {
        /// Ids in the note.
        named: usize,
        /// Descriptors attached.
        carried: usize,
    },
}

/// A `SOCK_SEQPACKET` pair (close-on-exec).
pub fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    use rustix::net::{AddressFamily, SocketFlags, SocketType, socketpair};
    Ok(socketpair(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )?)
}

/// Sends one note with `fds`.
pub fn send(sock: impl AsFd, note: &Note, fds: &[BorrowedFd<'_>]) -> Result<(), ChannelError> {
    let bytes = serde_json::to_vec(note).map_err(ChannelError::Malformed)?;
    if bytes.len() > MAX_NOTE || fds.len() > MAX_FDS {
        return Err(ChannelError::Io(io::Error::from_raw_os_error(libc_e2big())));
    }
    switchyard_endpoint::send_all(sock, &bytes, fds)?;
    Ok(())
}

fn libc_e2big() -> i32 {
    rustix::io::Errno::TOOBIG.raw_os_error()
}

/// Receives one note and its descriptors (blocking).
pub fn recv(sock: impl AsFd, buf: &mut Vec<u8>) -> Result<(Note, Vec<OwnedFd>), ChannelError> {
    buf.resize(MAX_NOTE, 0);
    let mut fds = Vec::new();
    let got = loop {
        match switchyard_endpoint::recv(sock.as_fd(), buf, MAX_FDS, false, |fd| fds.push(fd)) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => break r?,
        }
    };
    if got.bytes == 0 {
        return Err(ChannelError::Closed);
    }
    let note: Note = serde_json::from_slice(&buf[..got.bytes]).map_err(ChannelError::Malformed)?;
    let named = match &note {
        Note::Hold { ids } | Note::Fds { ids } => ids.len(),
        Note::HoldObjects { names } | Note::Objects { names } => names.len(),
        _ => 0,
    };
    if got.fds_truncated || named != fds.len() {
        return Err(ChannelError::FdMismatch {
            named,
            carried: fds.len(),
        });
    }
    Ok((note, fds))
}

/// The worker's [`Custody`]: notes to the supervisor.
#[derive(Debug)]
pub struct ChannelCustody {
    sock: OwnedFd,
}

impl ChannelCustody {
    /// Custody over the worker's end of the channel.
    pub fn new(sock: OwnedFd) -> Self {
        Self { sock }
    }
}

impl Custody for ChannelCustody {
    fn hold(&mut self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        for (ids, fds) in ids.chunks(MAX_FDS).zip(fds.chunks(MAX_FDS)) {
            send(&self.sock, &Note::Hold { ids: ids.to_vec() }, fds).map_err(io::Error::other)?;
        }
        Ok(())
    }

    fn release(&mut self, ids: &[u64]) -> io::Result<()> {
        for ids in ids.chunks(4096) {
            send(&self.sock, &Note::Release { ids: ids.to_vec() }, &[])
                .map_err(io::Error::other)?;
        }
        Ok(())
    }
}

/// The name a [`Note::Migration`] gives a device's migration state.
pub fn mig_state_name(state: switchyard_proto::MigState) -> &'static str {
    use switchyard_proto::MigState;
    match state {
        MigState::Error => "error",
        MigState::Stop => "stop",
        MigState::Running => "running",
        MigState::StopCopy => "stop_copy",
        MigState::Resuming => "resuming",
        MigState::RunningP2p => "running_p2p",
        MigState::PreCopy => "pre_copy",
        MigState::PreCopyP2p => "pre_copy_p2p",
    }
}
