//! The API's types: what its routes take and answer.

use serde::{Deserialize, Serialize};
use switchyard_pool::{DeviceView, Endpoint, MovePlan};
use utoipa::{IntoParams, ToSchema};

use super::super::events::ms;
use crate::custody::MoveReport;
use crate::supervisor::WorkerStatus;

/// What an endpoint's worker is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum WorkerState {
    /// A worker serves the socket.
    Running,
    /// The first worker, or a replacement, is starting.
    Starting,
    /// Between a worker's death and its replacement.
    Restarting,
    /// Workers kept dying before serving; the client was disconnected (delete the endpoint).
    Failed,
    /// A worker of an earlier daemon still serves the socket and could not be adopted (it
    /// offers no adoption socket): this daemon does not supervise it; restart, upgrade and
    /// moves are refused, delete kills it.
    Orphaned,
    /// The worker could not be started when the daemon started (see `detail`).
    NotStarted,
    /// The endpoint holds no device, so nothing serves it.
    NoLease,
}

/// An endpoint's worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkerView {
    /// What it is doing.
    pub state: WorkerState,
    /// The current worker's pid (an orphan's when it is known).
    pub pid: Option<u32>,
    /// Workers started after the first (crashes, restarts, upgrades), counted on across
    /// daemon restarts (an adopted worker says how many came before it).
    pub restarts: u64,
    /// Workers that reported serving.
    pub ready: u64,
    /// From the death of the last worker to its replacement serving, milliseconds.
    pub last_restart_ms: Option<f64>,
    /// Descriptors the daemon holds for the endpoint (listener, connection, DMA memory,
    /// eventfds, VRAM, black box).
    pub held: usize,
    /// A VMM is connected to the endpoint's socket.
    #[serde(default)]
    pub connected: bool,
    /// The supervisor gave up restarting it.
    pub failed: bool,
    /// Its VMM has a migration stream open (restarts, upgrades and moves wait).
    pub migrating: bool,
    /// Why the endpoint is not supervised, when it is not.
    pub detail: Option<String>,
    /// The kernel took the endpoint's passthrough device back (unbind, removal): which and
    /// why. Every access fails with ENODEV; detach the endpoint and attach another device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_lost: Option<String>,
    /// Of `held`, the client's descriptors (DMA memory, eventfds, a message's in flight).
    #[serde(default)]
    pub client_fds: usize,
    /// How many the client may have (`[daemon] fds_per_endpoint`); a message past it is
    /// refused with EMFILE.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fd_budget: Option<u32>,
    /// What a replacement could not restore of the client's state (DMA windows, eventfds
    /// it had been told succeeded): the endpoint is degraded until its client leaves.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub state_lost: Vec<String>,
    /// The worker's custody sequence number the daemon has applied every note up to, as of
    /// the last `POST /v1/endpoints/{id}/sync` (0 before one).
    #[serde(default)]
    pub custody_seq: u64,
}

impl WorkerView {
    pub(super) fn supervised(st: &WorkerStatus, fd_budget: Option<u32>) -> Self {
        let state = if st.failed {
            WorkerState::Failed
        } else if st.pid.is_none() {
            WorkerState::Restarting
        } else if st.ready > st.restarts {
            WorkerState::Running
        } else {
            WorkerState::Starting
        };
        Self {
            state,
            pid: st.pid,
            restarts: st.restarts,
            ready: st.ready,
            last_restart_ms: st.last_restart.map(ms),
            held: st.held,
            connected: st.connected,
            failed: st.failed,
            migrating: st.migrating,
            detail: None,
            device_lost: st.device_lost.clone(),
            client_fds: st.client_fds,
            fd_budget,
            state_lost: st.state_lost.clone(),
            custody_seq: st.custody_seq,
        }
    }

    pub(super) fn unsupervised(state: WorkerState, pid: Option<u32>, detail: String) -> Self {
        Self {
            state,
            pid,
            restarts: 0,
            ready: 0,
            last_restart_ms: None,
            held: 0,
            connected: false,
            failed: false,
            migrating: false,
            detail: Some(detail),
            device_lost: None,
            client_fds: 0,
            fd_budget: None,
            state_lost: Vec::new(),
            custody_seq: 0,
        }
    }
}

/// An endpoint with its lease and its worker.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct EndpointStatus {
    /// The endpoint as the pool stores it.
    pub endpoint: Endpoint,
    /// The leased device.
    pub lease: Option<DeviceView>,
    /// Its worker.
    pub worker: WorkerView,
    /// Its VMM, if registered.
    pub vmm: Option<VmmLink>,
    /// For the destination endpoint of a live migration not yet over: the source endpoint
    /// (`POST /v1/endpoints/{id}/incoming`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incoming_for: Option<String>,
    /// Its board failed: the failover pending, and the last one done.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failover: Option<FailoverView>,
}

/// The outcome of a restart or an upgrade.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct WorkerReplaced {
    /// The endpoint.
    pub endpoint: String,
    /// The pid of the worker replaced.
    pub replaced_pid: u32,
    /// The worker now (serving, unless it failed).
    pub worker: WorkerView,
}

/// The body of `POST /v1/endpoints/{id}/move`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MoveRequest {
    /// The device to move to: a board without partitions, or a partition, of the same shape
    /// as the endpoint's, free and on an available board.
    pub to: String,
}

/// An endpoint's VMM, for guest-visible moves (`PUT /v1/endpoints/{id}/vmm`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct VmmLink {
    /// QEMU's QMP socket (`-qmp unix:PATH,server=on,wait=off`).
    #[schema(value_type = String)]
    pub qmp: std::path::PathBuf,
    /// The `vfio-user-pci` device's id in QEMU.
    pub device_id: String,
    /// The bus it is plugged into (a `pcie-root-port` id), to plug it back there.
    #[serde(default)]
    pub bus: Option<String>,
}

/// A finished move.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct MoveResult {
    /// Whether the guest saw it: its VMM unplugged the device and plugged it back.
    pub guest_visible: bool,
    /// What moved where.
    pub plan: MovePlan,
    /// What the data path did; absent when the worker died after the device had switched
    /// and its replacement runs the device on the target.
    pub report: Option<MoveReport>,
    /// The stop the guest saw, milliseconds: transparent, from the engines' stop to the
    /// device running on the target; guest-visible, from `device_del` to `device_add`.
    pub downtime_ms: Option<f64>,
    /// The endpoint now.
    pub endpoint: EndpointStatus,
}

/// A move of a drain that did not happen (the endpoint keeps its device).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FailedMove {
    /// The move.
    pub plan: MovePlan,
    /// Why it failed.
    pub error: String,
}

/// The outcome of a drain.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DrainResult {
    /// The board (quarantined).
    pub board: String,
    /// Endpoints moved off it.
    pub moved: Vec<MoveResult>,
    /// Endpoints still on it.
    pub failed: Vec<FailedMove>,
}

/// The query of `GET /events`.
#[derive(Debug, Clone, Copy, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Send the events with a sequence number above this one first (pool events from the
    /// store, as far back as its retention keeps: an older `since` is refused with 410;
    /// worker events this daemon still has in memory); without it, only events from now on.
    pub since: Option<u64>,
    /// Keep the stream open for new events (default true); `false` ends it after the events
    /// already there.
    pub follow: Option<bool>,
}

/// An endpoint's failover, as `GET /v1/endpoints/{id}` shows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct FailoverView {
    /// Its device's board failed and it has not failed over yet: why (waiting for a free
    /// device of its shape, or refused and why). Absent when its board is healthy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending: Option<String>,
    /// Its last failover since the daemon started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last: Option<LastFailover>,
}

/// A finished failover.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct LastFailover {
    /// The device left (on the failed board).
    pub from: String,
    /// The device it runs on now.
    pub to: String,
    /// `transparent` or `guest-visible`.
    pub mode: String,
    /// From the failure's report to the device serving again, milliseconds.
    pub stall_ms: f64,
    /// When it finished, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
}
