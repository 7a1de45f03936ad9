//! The daemon's control API (HTTP/JSON on the control socket; the document is
//! `docs/control-api.json`).
//!
//! | route | what |
//! |---|---|
//! | `GET /v1/boards`, `GET /v1/boards/{id}` | boards with their devices and holders |
//! | `POST /v1/boards/{id}/quarantine`, `.../unquarantine` | no new leases on a board / again |
//! | `GET /v1/pools` | pools and their free capacity |
//! | `GET /v1/endpoints`, `GET /v1/endpoints/{id}` | endpoints, their lease and their worker |
//! | `POST /v1/endpoints` | create: lease a device, start its worker (201) |
//! | `DELETE /v1/endpoints/{id}` | stop the worker (the VM's connection closes), delete (204) |
//! | `POST /v1/endpoints/{id}/restart` | SIGKILL drill: the worker is replaced under the guest |
//! | `POST /v1/endpoints/{id}/upgrade` | replace the worker with the executable now on disk |
//! | `POST /v1/endpoints/{id}/move` | move the endpoint's device to another board under the guest |
//! | `PUT /v1/endpoints/{id}/vmm`, `DELETE ...` | register (forget) the VMM of an endpoint, for guest-visible moves |
//! | `POST /v1/endpoints/{id}/detach` | take the endpoint's device away (unplugged through its VMM if a guest uses it); the board is free |
//! | `POST /v1/endpoints/{id}/attach` | lease a device to a detached endpoint, start its worker (fresh VRAM), plug it into its VMM |
//! | `POST /v1/boards/{id}/drain` | quarantine the board and move every endpoint off it |
//! | `GET /events` | pool and worker events, NDJSON ([`super::events`]) |
//! | `GET /metrics`, `GET /health`, `GET /openapi.json` | |
//!
//! A move of a device with trapped VRAM (`vram_mmap = false`) is transparent: the worker
//! pre-copies VRAM while the guest runs, then stops the device for the last changes and the
//! state (`switchyard_softgpu`'s relocation). A guest mapping of VRAM cannot be re-pointed
//! (nothing in vfio-user revokes a mapping), so a device the guest may map moves
//! *guest-visibly*, through its VMM (registered with `PUT .../vmm`: QEMU's QMP socket and
//! the device's id): QMP `device_del` (the guest's driver lets go, QEMU closes the
//! connection), the worker moves VRAM and state, QMP `device_add` of the same socket (the
//! guest re-probes; with `vram_reset = "keep"` it finds its VRAM as it left it). Without a
//! registered VMM such a move is refused (409 `mapped_vram`).
//!
//! Detach and attach hand a board from one VM to another: `detach` unplugs the device from
//! the VM (through its VMM; refused while a client is connected and no VMM is registered),
//! stops the worker and frees the board; `attach` leases a board to a detached endpoint,
//! starts a worker on fresh VRAM (a new tenant never sees the last one's data) and plugs the
//! device into the VM if its VMM is registered.
//!
//! Errors are `{"error":{"code","message"}}`: pool errors by kind (`not_found` 404,
//! `conflict` 409, `invalid` 422, `internal` 500); malformed JSON 400, a bad body 422. A
//! refused request changes nothing: the pool checks a mutation on a copy before the data path
//! acts, and the store is changed last (or the data path undone).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{FromRef, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use switchyard_control::{
    ApiError, ControlApi, ErrorBody, Json, Metrics, NDJSON_CONTENT_TYPE, Path, Query,
};
use switchyard_pool::{
    BoardView, DeviceView, Endpoint, EndpointSpec as PoolEndpointSpec, ErrorKind, MovePlan,
    Placement, PoolError, PoolView,
};
use utoipa::{IntoParams, ToSchema};
use utoipa_axum::routes;

use super::events::{DaemonEvent, MAX_STREAMS, ms};
use super::{Daemon, Unsupervised};
use crate::custody::MoveReport;
use crate::supervisor::{MoveOutcome, SupervisorError, WorkerStatus};

/// How long a new or replaced worker may take to serve.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// How long a guest may take to release its device (TCG guests are slow).
const UNPLUG_TIMEOUT: Duration = Duration::from_secs(120);
/// How long a move may take (pre-copy of a large, busy VRAM included).
const MOVE_TIMEOUT: Duration = Duration::from_secs(120);

const TAG: &str = "pool";

/// The router's state.
#[derive(Debug, Clone)]
pub struct AppState(pub Arc<Daemon>);

impl FromRef<AppState> for Metrics {
    fn from_ref(s: &AppState) -> Self {
        s.0.metrics.clone()
    }
}

/// The router and its OpenAPI document.
pub fn router(daemon: Arc<Daemon>) -> (axum::Router, utoipa::openapi::OpenApi) {
    let (router, doc) = api().build(AppState(daemon));
    let served = doc.clone();
    let router = router.route(
        "/openapi.json",
        axum::routing::get(move || {
            let doc = served.clone();
            async move { axum::Json(doc) }
        }),
    );
    (router, doc)
}

/// The documented routes (without a state: for the document alone, see [`openapi`]).
fn api() -> ControlApi<AppState> {
    ControlApi::new("Switchyard pool daemon", env!("CARGO_PKG_VERSION"))
        .description(
            "HTTP/JSON on the daemon's UNIX socket (`switchyard ctl` is its client). Every error \
             reply is an ErrorBody: {\"error\": {\"code\": ..., \"message\": ...}} with a 4xx or \
             5xx status; a refused request changes nothing. GET /openapi.json serves this \
             document. Moves and drains are transparent to the guest with trapped VRAM \
             (vram_mmap = false) and guest-visible through a registered VMM otherwise; detach \
             and attach are not offered yet.",
        )
        .health()
        .metrics()
        .routes(routes!(events))
        .routes(routes!(list_boards))
        .routes(routes!(get_board))
        .routes(routes!(quarantine))
        .routes(routes!(unquarantine))
        .routes(routes!(list_pools))
        .routes(routes!(list_endpoints, create_endpoint))
        .routes(routes!(get_endpoint, delete_endpoint))
        .routes(routes!(restart_endpoint))
        .routes(routes!(upgrade_endpoint))
        .routes(routes!(move_endpoint))
        .routes(routes!(register_vmm, forget_vmm))
        .routes(routes!(detach_endpoint))
        .routes(routes!(attach_endpoint))
        .routes(routes!(drain_board))
}

/// The API's OpenAPI document (what `docs/control-api.json` holds).
pub fn openapi() -> utoipa::openapi::OpenApi {
    api().openapi().clone()
}

// ---- types ----

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
    /// Workers started after the first (crashes, restarts, upgrades) under this daemon.
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
}

impl WorkerView {
    fn supervised(st: &WorkerStatus, fd_budget: Option<u32>) -> Self {
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
        }
    }

    fn unsupervised(state: WorkerState, pid: Option<u32>, detail: String) -> Self {
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
    /// store, however old; worker events this daemon still has in memory); without it, only
    /// events from now on.
    pub since: Option<u64>,
    /// Keep the stream open for new events (default true); `false` ends it after the events
    /// already there.
    pub follow: Option<bool>,
}

// ---- errors ----

/// `e` and its sources, joined with `: `.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn pool_error(e: PoolError) -> ApiError {
    let (status, code) = match e.kind() {
        ErrorKind::NotFound => (StatusCode::NOT_FOUND, "not_found"),
        ErrorKind::Conflict => (StatusCode::CONFLICT, "conflict"),
        ErrorKind::Invalid => (StatusCode::UNPROCESSABLE_ENTITY, "invalid"),
        ErrorKind::Internal => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    };
    ApiError::new(status, code, error_chain(&e))
}

fn supervisor_error(e: SupervisorError) -> ApiError {
    use switchyard_server::ServerError as S;
    match &e {
        SupervisorError::Exists(_) => ApiError::conflict("conflict", error_chain(&e)),
        SupervisorError::NotFound(_) => ApiError::not_found("not_found", error_chain(&e)),
        SupervisorError::Bind(_, S::SocketInUse(_) | S::SocketPathTaken(_)) => {
            ApiError::conflict("socket_in_use", error_chain(&e))
        }
        SupervisorError::NoRoom { .. } => ApiError::conflict("no_room", error_chain(&e)),
        // Out of descriptors, memory or processes: a resource, not a bug; the request may
        // succeed later.
        SupervisorError::Bind(..) | SupervisorError::Spawn(..) if is_resource_error(&e) => {
            ApiError::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "resources",
                error_chain(&e),
            )
        }
        _ => ApiError::internal(error_chain(&e)),
    }
}

/// Whether an error chain ends in the system running out of something (descriptors,
/// memory, processes).
fn is_resource_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        use rustix::io::Errno;
        if let Some(code) = err
            .downcast_ref::<std::io::Error>()
            .and_then(std::io::Error::raw_os_error)
            && [
                Errno::MFILE,
                Errno::NFILE,
                Errno::NOMEM,
                Errno::AGAIN,
                Errno::NOSPC,
            ]
            .iter()
            .any(|e| e.raw_os_error() == code)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

fn unknown_endpoint(id: &str) -> ApiError {
    pool_error(PoolError::UnknownEndpoint(id.to_owned()))
}

/// Runs `f` on the blocking pool (the store commits and the supervisor waits).
async fn blocking<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&Daemon) -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    let daemon = state.0.clone();
    tokio::task::spawn_blocking(move || f(&daemon))
        .await
        .map_err(|e| ApiError::internal(format!("The request's task failed: {e}")))?
}

// ---- the daemon's operations ----

impl Daemon {
    fn worker_view(&self, endpoint: &Endpoint) -> WorkerView {
        if let Some(u) = self.unsupervised().get(&endpoint.id) {
            return match u {
                Unsupervised::Orphaned { pid } => WorkerView::unsupervised(
                    WorkerState::Orphaned,
                    *pid,
                    match pid {
                        Some(pid) => format!(
                            "Worker {pid} of an earlier daemon still serves the socket; not supervised by this daemon"
                        ),
                        None => "Another process serves the socket; not supervised by this daemon"
                            .to_owned(),
                    },
                ),
                Unsupervised::NotStarted { error } => {
                    WorkerView::unsupervised(WorkerState::NotStarted, None, error.clone())
                }
            };
        }
        match self.supervisor.status(&endpoint.id) {
            Ok(st) => WorkerView::supervised(&st, self.supervisor.fd_budget()),
            Err(_) if endpoint.device.is_none() => WorkerView::unsupervised(
                WorkerState::NoLease,
                None,
                "The endpoint holds no device".to_owned(),
            ),
            Err(e) => WorkerView::unsupervised(WorkerState::NotStarted, None, error_chain(&e)),
        }
    }

    fn endpoint_status(&self, pool: &switchyard_pool::Pool, endpoint: &Endpoint) -> EndpointStatus {
        EndpointStatus {
            lease: endpoint
                .device
                .as_deref()
                .and_then(|d| pool.inventory().device(d)),
            worker: self.worker_view(endpoint),
            vmm: self.vmms().get(&endpoint.id).cloned(),
            endpoint: endpoint.clone(),
        }
    }

    fn status_of(&self, id: &str) -> Result<EndpointStatus, ApiError> {
        let pool = self.pool();
        let endpoint = pool
            .inventory()
            .endpoint(id)
            .ok_or_else(|| unknown_endpoint(id))?;
        Ok(self.endpoint_status(&pool, endpoint))
    }

    fn create(&self, spec: PoolEndpointSpec) -> Result<EndpointStatus, ApiError> {
        let mut pool = self.pool();
        // Everything the pool refuses is refused before a worker starts.
        let mut dry = pool.inventory().clone();
        dry.create_endpoint(&spec).map_err(pool_error)?;
        let endpoint = dry
            .endpoint(&spec.id)
            .ok_or_else(|| ApiError::internal("The checked endpoint is missing"))?;
        let device = endpoint
            .device
            .as_deref()
            .and_then(|d| dry.device(d))
            .ok_or_else(|| ApiError::internal("The checked endpoint has no device"))?;
        let worker = crate::EndpointSpec {
            id: spec.id.clone(),
            socket: endpoint.socket.clone(),
            device: crate::custody::WorkerDevice::of(&device.shape, device.host.as_deref()),
        };
        self.supervisor.create(worker).map_err(supervisor_error)?;
        let st = self
            .supervisor
            .wait_ready(&spec.id, 1, READY_TIMEOUT)
            .map_err(supervisor_error)?;
        if st.ready < 1 {
            let _ = self.supervisor.delete(&spec.id);
            self.records.remove(&spec.id);
            return Err(ApiError::internal(format!(
                "The worker of endpoint \"{}\" did not start serving (see the daemon's log); nothing was created",
                spec.id
            )));
        }
        match pool.create_endpoint(&spec) {
            Ok(events) => self.events.pool(events),
            Err(e) => {
                let _ = self.supervisor.delete(&spec.id);
                self.records.remove(&spec.id);
                return Err(pool_error(e));
            }
        }
        self.metrics.endpoint(&spec.id);
        let endpoint = pool
            .inventory()
            .endpoint(&spec.id)
            .ok_or_else(|| ApiError::internal("The created endpoint is missing"))?;
        Ok(self.endpoint_status(&pool, endpoint))
    }

    fn delete(&self, id: &str) -> Result<(), ApiError> {
        let mut pool = self.pool();
        let mut dry = pool.inventory().clone();
        dry.delete_endpoint(id).map_err(pool_error)?;
        let socket = pool.inventory().endpoint(id).map(|e| e.socket.clone());
        if let Some(Unsupervised::Orphaned { pid }) = self.unsupervised().get(id).cloned() {
            // The orphan must stop serving the socket before the endpoint is gone.
            let live = self.records.live(id);
            match (pid, live) {
                (Some(pid), Some(live)) if pid == live => kill(pid),
                _ => {
                    return Err(ApiError::conflict(
                        "orphaned",
                        format!(
                            "Endpoint \"{id}\" is served by a process this daemon does not know; stop it first"
                        ),
                    ));
                }
            }
            if let Some(socket) = &socket {
                remove_stale_socket(socket);
            }
        }
        match self.supervisor.delete(id) {
            Ok(()) | Err(SupervisorError::NotFound(_)) => {}
            Err(e) => return Err(supervisor_error(e)),
        }
        self.unsupervised().remove(id);
        self.vmms().remove(id);
        self.records.remove(id);
        let events = pool.delete_endpoint(id).map_err(pool_error)?;
        self.events.pool(events);
        self.metrics.remove_endpoint(id);
        Ok(())
    }

    /// Unplugs the endpoint's device from its VM (if one uses it), stops its worker and
    /// frees its board.
    fn detach(&self, id: &str) -> Result<EndpointStatus, ApiError> {
        {
            let pool = self.pool();
            let mut dry = pool.inventory().clone();
            dry.detach(id).map_err(pool_error)?;
        }
        if matches!(
            self.unsupervised().get(id),
            Some(Unsupervised::Orphaned { .. })
        ) {
            return Err(ApiError::conflict(
                "orphaned",
                format!("Endpoint \"{id}\" is served by a worker this daemon does not supervise"),
            ));
        }
        self.refuse_while_moving(id)?;
        let connected = self.supervisor.status(id).is_ok_and(|st| st.connected);
        if connected {
            let link = self.vmms().get(id).cloned().ok_or_else(|| {
                ApiError::conflict(
                    "connected",
                    format!(
                        "A VM uses endpoint \"{id}\": register its VMM (PUT /v1/endpoints/{id}/vmm) so that the device can be unplugged first"
                    ),
                )
            })?;
            let mut qmp = qmp_of(id, &link)?;
            qmp.device_del(&link.device_id, UNPLUG_TIMEOUT)
                .map_err(|e| vmm_error(id, &link, "the guest did not release the device", &e))?;
            self.wait_disconnected(id);
        }
        match self.supervisor.delete(id) {
            Ok(()) | Err(SupervisorError::NotFound(_)) => {}
            Err(e) => return Err(supervisor_error(e)),
        }
        self.records.remove(id);
        let mut pool = self.pool();
        let events = pool.detach(id).map_err(pool_error)?;
        self.events.pool(events);
        let endpoint = pool
            .inventory()
            .endpoint(id)
            .ok_or_else(|| unknown_endpoint(id))?;
        Ok(self.endpoint_status(&pool, endpoint))
    }

    /// Leases a device to a detached endpoint, starts its worker and plugs the device into
    /// the endpoint's VM if its VMM is registered.
    fn attach(&self, id: &str, to: &Placement) -> Result<EndpointStatus, ApiError> {
        let spec = {
            let pool = self.pool();
            let mut dry = pool.inventory().clone();
            dry.attach(id, to).map_err(pool_error)?;
            let endpoint = dry.endpoint(id).ok_or_else(|| unknown_endpoint(id))?;
            let device = endpoint
                .device
                .as_deref()
                .and_then(|d| dry.device(d))
                .ok_or_else(|| ApiError::internal("The checked endpoint has no device"))?;
            crate::EndpointSpec {
                id: id.to_owned(),
                socket: endpoint.socket.clone(),
                device: crate::custody::WorkerDevice::of(&device.shape, device.host.as_deref()),
            }
        };
        self.supervisor.create(spec).map_err(supervisor_error)?;
        let st = self
            .supervisor
            .wait_ready(id, 1, READY_TIMEOUT)
            .map_err(supervisor_error)?;
        let undo = |e: ApiError| {
            let _ = self.supervisor.delete(id);
            self.records.remove(id);
            e
        };
        if st.ready < 1 {
            return Err(undo(ApiError::internal(format!(
                "The worker of endpoint \"{id}\" did not start serving (see the daemon's log); nothing was attached"
            ))));
        }
        {
            let mut pool = self.pool();
            let events = pool.attach(id, to).map_err(|e| undo(pool_error(e)))?;
            self.events.pool(events);
        }
        self.unsupervised().remove(id);
        if let Some(link) = self.vmms().get(id).cloned() {
            let socket = self.status_of(id)?.endpoint.socket;
            let mut device = switchyard_qemu::VfioUserDevice::new(&link.device_id, &socket);
            device.bus = link.bus.clone();
            qmp_of(id, &link)?
                .device_add(&device)
                .map_err(|e| vmm_error(id, &link, "the device cannot be plugged in", &e))?;
        }
        self.status_of(id)
    }

    /// Waits (bounded) until the endpoint's client has left.
    fn wait_disconnected(&self, id: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.supervisor.status(id).is_ok_and(|st| st.connected)
            && std::time::Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The endpoint's worker, refused unless it is supervised and serving.
    fn serving(&self, id: &str) -> Result<WorkerStatus, ApiError> {
        let view = {
            let pool = self.pool();
            let endpoint = pool
                .inventory()
                .endpoint(id)
                .ok_or_else(|| unknown_endpoint(id))?;
            self.worker_view(endpoint)
        };
        if view.state != WorkerState::Running {
            let detail = view.detail.map(|d| format!(": {d}")).unwrap_or_default();
            return Err(ApiError::conflict(
                "busy",
                format!(
                    "The worker of endpoint \"{id}\" is {}, not running{detail}",
                    serde_json::to_value(view.state)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_owned))
                        .unwrap_or_default()
                ),
            ));
        }
        self.supervisor.status(id).map_err(supervisor_error)
    }

    fn refuse_while_migrating(&self, id: &str) -> Result<(), ApiError> {
        if self.supervisor.status(id).is_ok_and(|st| st.migrating) {
            return Err(ApiError::conflict(
                "migrating",
                format!(
                    "Endpoint \"{id}\" is being migrated (its VMM has a migration stream open); try again when the migration is over"
                ),
            ));
        }
        Ok(())
    }

    fn refuse_while_moving(&self, id: &str) -> Result<(), ApiError> {
        if self.supervisor.is_moving(id).unwrap_or(false) {
            return Err(ApiError::conflict(
                "moving",
                format!("Endpoint \"{id}\" is being moved; try again when the move is done"),
            ));
        }
        Ok(())
    }

    /// Refuses moves the data path cannot make (before anything is reserved).
    fn check_movable(&self, plan: &MovePlan) -> Result<(), ApiError> {
        if !plan.shape.vram_mmap {
            return Ok(());
        }
        if !self.vmms().contains_key(&plan.endpoint) {
            return Err(ApiError::conflict(
                "mapped_vram",
                format!(
                    "Endpoint \"{}\" lets its guest map VRAM (vram_mmap = true): a mapping cannot be re-pointed under the guest, so it moves guest-visibly through its VMM; register the VMM first (PUT /v1/endpoints/{}/vmm)",
                    plan.endpoint, plan.endpoint
                ),
            ));
        }
        if plan.shape.irq == switchyard_softgpu::IrqMode::Msix {
            return Err(ApiError::conflict(
                "mapped_vram",
                format!(
                    "Endpoint \"{}\" uses MSI-X: QEMU 11.1 aborts the VM on device_del of a vfio-user device with MSI-X, so it is not unplugged for a guest-visible move (irq = \"msi\" boards are)",
                    plan.endpoint
                ),
            ));
        }
        Ok(())
    }

    fn move_endpoint(&self, id: &str, to: &str) -> Result<MoveResult, ApiError> {
        self.serving(id)?;
        self.refuse_while_moving(id)?;
        self.refuse_while_migrating(id)?;
        let plan = {
            let mut pool = self.pool();
            let checked = pool.inventory().check_move(id, to).map_err(pool_error)?;
            self.check_movable(&checked)?;
            let (plan, events) = pool.plan_move(id, to).map_err(pool_error)?;
            self.events.pool(events);
            plan
        };
        self.execute_move(plan)
    }

    /// Runs a planned move on the data path, then commits it (or releases the target).
    fn execute_move(&self, plan: MovePlan) -> Result<MoveResult, ApiError> {
        let vmm = plan
            .shape
            .vram_mmap
            .then(|| self.vmms().get(&plan.endpoint).cloned())
            .flatten();
        let (outcome, visible_downtime) = match &vmm {
            None => (
                self.supervisor
                    .move_device(&plan.endpoint, &plan.to_board, false, MOVE_TIMEOUT),
                None,
            ),
            Some(link) => match self.move_unplugged(&plan, link) {
                Ok((outcome, downtime)) => (outcome, Some(downtime)),
                Err(e) => {
                    let mut pool = self.pool();
                    match pool.abort_move(&plan) {
                        Ok(events) => self.events.pool(events),
                        Err(e) => {
                            tracing::error!(?plan, "cannot release a failed move's target: {e}")
                        }
                    }
                    return Err(e);
                }
            },
        };
        let mut pool = self.pool();
        let report = match outcome {
            Ok(MoveOutcome::Moved(report)) => Some(report),
            Ok(MoveOutcome::MovedAcrossRestart) => None,
            Err(e) => {
                match pool.abort_move(&plan) {
                    Ok(events) => self.events.pool(events),
                    Err(e) => tracing::error!(?plan, "cannot release a failed move's target: {e}"),
                }
                return Err(match e {
                    SupervisorError::MoveFailed { .. } | SupervisorError::Moving(_) => {
                        ApiError::conflict("move_failed", error_chain(&e))
                    }
                    e => supervisor_error(e),
                });
            }
        };
        let events = pool.commit_move(&plan).map_err(pool_error)?;
        self.events.pool(events);
        let downtime = visible_downtime.or_else(|| {
            report
                .as_ref()
                .map(|r| Duration::from_micros(r.downtime_us))
        });
        if let Some(d) = downtime {
            self.metrics.board(&plan.from_board).moved(d);
        }
        let endpoint = pool
            .inventory()
            .endpoint(&plan.endpoint)
            .ok_or_else(|| unknown_endpoint(&plan.endpoint))?;
        Ok(MoveResult {
            guest_visible: vmm.is_some(),
            endpoint: self.endpoint_status(&pool, endpoint),
            downtime_ms: downtime.map(ms),
            report,
            plan,
        })
    }

    /// A guest-visible move: the VMM unplugs the device (QMP `device_del`, the guest lets
    /// go), the worker moves it with nobody connected, and the VMM plugs it back
    /// (`device_add` of the same socket), whatever the move's outcome. Errors before the
    /// unplug change nothing; the device is plugged back after one that happens later.
    /// Returns the move's outcome and the time from `device_del` to `device_add`.
    fn move_unplugged(
        &self,
        plan: &MovePlan,
        link: &VmmLink,
    ) -> Result<(Result<MoveOutcome, SupervisorError>, Duration), ApiError> {
        use switchyard_qemu::VfioUserDevice;
        let vmm_error =
            |what: &str, e: &dyn std::error::Error| vmm_error(&plan.endpoint, link, what, e);
        let mut qmp = qmp_of(&plan.endpoint, link)?;
        let socket = self
            .pool()
            .inventory()
            .endpoint(&plan.endpoint)
            .map(|e| e.socket.clone())
            .ok_or_else(|| unknown_endpoint(&plan.endpoint))?;
        let mut device = VfioUserDevice::new(&link.device_id, &socket);
        device.bus = link.bus.clone();
        let t0 = std::time::Instant::now();
        qmp.device_del(&link.device_id, UNPLUG_TIMEOUT)
            .map_err(|e| vmm_error("the guest did not release the device", &e))?;
        // QEMU closes the vfio-user connection when it unrealizes the device.
        self.wait_disconnected(&plan.endpoint);
        let outcome =
            self.supervisor
                .move_device(&plan.endpoint, &plan.to_board, true, MOVE_TIMEOUT);
        let plugged = qmp.device_add(&device);
        let downtime = t0.elapsed();
        if let Err(e) = plugged {
            tracing::error!(endpoint = plan.endpoint, error = %e, "cannot plug the device back");
            return Err(vmm_error(
                "the device was moved but cannot be plugged back",
                &e,
            ));
        }
        Ok((outcome, downtime))
    }

    fn drain(&self, board: &str) -> Result<DrainResult, ApiError> {
        let plans = {
            let mut pool = self.pool();
            for plan in pool.plan_drain(board).map_err(pool_error)? {
                self.check_movable(&plan)?;
                self.refuse_while_moving(&plan.endpoint)?;
                self.refuse_while_migrating(&plan.endpoint)?;
            }
            let (plans, events) = pool.drain(board).map_err(pool_error)?;
            self.events.pool(events);
            plans
        };
        let mut out = DrainResult {
            board: board.to_owned(),
            moved: Vec::new(),
            failed: Vec::new(),
        };
        for plan in plans {
            match self.execute_move(plan.clone()) {
                Ok(r) => out.moved.push(r),
                Err(e) => out.failed.push(FailedMove {
                    plan,
                    error: e.message,
                }),
            }
        }
        Ok(out)
    }

    fn replace(&self, id: &str, upgrade: bool) -> Result<WorkerReplaced, ApiError> {
        self.refuse_while_moving(id)?;
        self.refuse_while_migrating(id)?;
        let before = self.serving(id)?;
        let replaced_pid = before
            .pid
            .ok_or_else(|| ApiError::conflict("busy", "The worker is being replaced"))?;
        if upgrade {
            self.supervisor.upgrade(id).map_err(supervisor_error)?;
            self.metrics.upgraded();
        } else {
            self.supervisor.kill_worker(id).map_err(supervisor_error)?;
        }
        let st = self
            .supervisor
            .wait_ready(id, before.ready + 1, READY_TIMEOUT)
            .map_err(supervisor_error)?;
        Ok(WorkerReplaced {
            endpoint: id.to_owned(),
            replaced_pid,
            worker: WorkerView::supervised(&st, self.supervisor.fd_budget()),
        })
    }
}

/// A QMP connection to an endpoint's VMM.
fn qmp_of(endpoint: &str, link: &VmmLink) -> Result<switchyard_qemu::Qmp, ApiError> {
    switchyard_qemu::Qmp::connect(&link.qmp, Duration::from_secs(10))
        .map_err(|e| vmm_error(endpoint, link, "cannot reach the VMM", &e))
}

/// A failure of an endpoint's VMM (502).
fn vmm_error(endpoint: &str, link: &VmmLink, what: &str, e: &dyn std::error::Error) -> ApiError {
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "vmm",
        format!(
            "Endpoint \"{endpoint}\": {what} through QMP at {}: {e}",
            link.qmp.display()
        ),
    )
}

fn kill(pid: u32) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}

/// Removes the socket file at `path` once nothing accepts on it (a killed orphan's).
fn remove_stale_socket(path: &std::path::Path) {
    use std::os::unix::fs::FileTypeExt;
    for _ in 0..100 {
        match std::os::unix::net::UnixStream::connect(path) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                    let _ = std::fs::remove_file(path);
                }
                return;
            }
            Err(_) => return,
            // Still accepting: the process is dying.
            Ok(_) => std::thread::sleep(Duration::from_millis(10)),
        }
    }
}

// ---- handlers ----

/// `GET /v1/boards`.
#[utoipa::path(get, path = "/v1/boards", tag = TAG, operation_id = "list_boards",
    summary = "Every board with its devices and their holders",
    responses((status = 200, description = "The boards, in configuration order", body = Vec<BoardView>)))]
async fn list_boards(State(s): State<AppState>) -> Json<Vec<BoardView>> {
    Json(s.0.pool().inventory().boards())
}

/// `GET /v1/boards/{id}`.
#[utoipa::path(get, path = "/v1/boards/{id}", tag = TAG, operation_id = "get_board",
    summary = "One board",
    params(("id" = String, Path, description = "The board's id")),
    responses(
        (status = 200, description = "The board", body = BoardView),
        (status = 404, description = "No such board", body = ErrorBody)))]
async fn get_board(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<BoardView>, ApiError> {
    s.0.pool()
        .inventory()
        .board(&id)
        .map(Json)
        .ok_or_else(|| pool_error(PoolError::UnknownBoard(id)))
}

async fn set_quarantine(s: AppState, id: String, on: bool) -> Result<Json<BoardView>, ApiError> {
    blocking(&s, move |d| {
        let mut pool = d.pool();
        let events = if on {
            pool.quarantine(&id)
        } else {
            pool.unquarantine(&id)
        }
        .map_err(pool_error)?;
        d.events.pool(events);
        pool.inventory()
            .board(&id)
            .map(Json)
            .ok_or_else(|| pool_error(PoolError::UnknownBoard(id)))
    })
    .await
}

/// `POST /v1/boards/{id}/quarantine`.
#[utoipa::path(post, path = "/v1/boards/{id}/quarantine", tag = TAG, operation_id = "quarantine",
    summary = "Take no new leases on the board (its leases stay)",
    params(("id" = String, Path, description = "The board's id")),
    responses(
        (status = 200, description = "The board, quarantined (already quarantined: unchanged)", body = BoardView),
        (status = 404, description = "No such board", body = ErrorBody)))]
async fn quarantine(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<BoardView>, ApiError> {
    set_quarantine(s, id, true).await
}

/// `POST /v1/boards/{id}/unquarantine`.
#[utoipa::path(post, path = "/v1/boards/{id}/unquarantine", tag = TAG, operation_id = "unquarantine",
    summary = "Let a quarantined board take leases again",
    params(("id" = String, Path, description = "The board's id")),
    responses(
        (status = 200, description = "The board, available (already available: unchanged)", body = BoardView),
        (status = 404, description = "No such board", body = ErrorBody)))]
async fn unquarantine(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<BoardView>, ApiError> {
    set_quarantine(s, id, false).await
}

/// `GET /v1/pools`.
#[utoipa::path(get, path = "/v1/pools", tag = TAG, operation_id = "list_pools",
    summary = "Every pool with its capacity",
    responses((status = 200, description = "The pools", body = Vec<PoolView>)))]
async fn list_pools(State(s): State<AppState>) -> Json<Vec<PoolView>> {
    Json(s.0.pool().inventory().pools())
}

/// `GET /v1/endpoints`.
#[utoipa::path(get, path = "/v1/endpoints", tag = TAG, operation_id = "list_endpoints",
    summary = "Every endpoint with its lease and its worker",
    responses((status = 200, description = "The endpoints, by id", body = Vec<EndpointStatus>)))]
async fn list_endpoints(State(s): State<AppState>) -> Json<Vec<EndpointStatus>> {
    let d = &s.0;
    let pool = d.pool();
    Json(
        pool.inventory()
            .endpoints()
            .map(|e| d.endpoint_status(&pool, e))
            .collect(),
    )
}

/// `GET /v1/endpoints/{id}`.
#[utoipa::path(get, path = "/v1/endpoints/{id}", tag = TAG, operation_id = "get_endpoint",
    summary = "One endpoint with its lease and its worker",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "The endpoint", body = EndpointStatus),
        (status = 404, description = "No such endpoint", body = ErrorBody)))]
async fn get_endpoint(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<EndpointStatus>, ApiError> {
    s.0.status_of(&id).map(Json)
}

/// `POST /v1/endpoints`.
#[utoipa::path(post, path = "/v1/endpoints", tag = TAG, operation_id = "create_endpoint",
    summary = "Create an endpoint: lease a device and start the worker serving its socket",
    description = "The lease is checked first; then the worker starts and serves the socket; \
        only then is the endpoint stored. A refused request (or a worker that does not start) \
        leaves nothing behind.",
    request_body = PoolEndpointSpec,
    responses(
        (status = 201, description = "Created; the socket accepts a VMM", body = EndpointStatus),
        (status = 400, description = "Malformed JSON", body = ErrorBody),
        (status = 404, description = "Unknown pool or device", body = ErrorBody),
        (status = 409, description = "Id in use, device busy, no capacity, socket in use; `no_room`: one more endpoint at its full descriptor budget would not fit the daemon's open-file limit (the message has the numbers)", body = ErrorBody),
        (status = 422, description = "Invalid id, placement, socket path or requirements", body = ErrorBody),
        (status = 500, description = "The worker did not start", body = ErrorBody),
        (status = 503, description = "`resources`: the system is out of descriptors, memory or processes right now; nothing was created", body = ErrorBody)))]
async fn create_endpoint(
    State(s): State<AppState>,
    Json(spec): Json<PoolEndpointSpec>,
) -> Result<(StatusCode, Json<EndpointStatus>), ApiError> {
    blocking(&s, move |d| d.create(spec))
        .await
        .map(|st| (StatusCode::CREATED, Json(st)))
}

/// `DELETE /v1/endpoints/{id}`.
#[utoipa::path(delete, path = "/v1/endpoints/{id}", tag = TAG, operation_id = "delete_endpoint",
    summary = "Stop the endpoint's worker (the VM's connection closes) and delete the endpoint",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "A move in progress, or an unknown process serves it", body = ErrorBody)))]
async fn delete_endpoint(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    blocking(&s, move |d| d.delete(&id))
        .await
        .map(|()| StatusCode::NO_CONTENT)
}

/// `POST /v1/endpoints/{id}/restart`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/restart", tag = TAG, operation_id = "restart_endpoint",
    summary = "Crash drill: SIGKILL the worker; a replacement resumes the guest's connection",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "Replaced; the replacement serves (or `failed`)", body = WorkerReplaced),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "The worker is not running (starting, restarting, failed, orphaned), or a move or a migration is in progress", body = ErrorBody)))]
async fn restart_endpoint(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<WorkerReplaced>, ApiError> {
    blocking(&s, move |d| d.replace(&id, false)).await.map(Json)
}

/// `POST /v1/endpoints/{id}/upgrade`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/upgrade", tag = TAG, operation_id = "upgrade_endpoint",
    summary = "Replace the worker with the executable now on disk, under the running guest",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "Replaced; the replacement serves (or `failed`)", body = WorkerReplaced),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "The worker is not running (starting, restarting, failed, orphaned), or a move or a migration is in progress", body = ErrorBody)))]
async fn upgrade_endpoint(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<WorkerReplaced>, ApiError> {
    blocking(&s, move |d| d.replace(&id, true)).await.map(Json)
}

/// `POST /v1/endpoints/{id}/move`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/move", tag = TAG, operation_id = "move_endpoint",
    summary = "Move the endpoint's device to another board under the running guest",
    description = "With trapped VRAM (vram_mmap = false) the move is transparent: VRAM is \
        copied while the guest runs, then the device stops for the last changes and its state \
        (the downtime) and runs on the target. A device the guest maps moves guest-visibly \
        through its registered VMM (PUT /v1/endpoints/{id}/vmm): unplugged, moved, plugged back.",
    params(("id" = String, Path, description = "The endpoint's id")),
    request_body = MoveRequest,
    responses(
        (status = 200, description = "Moved; the lease follows", body = MoveResult),
        (status = 404, description = "No such endpoint or device", body = ErrorBody),
        (status = 409, description = "The target is busy, quarantined or another shape; the guest maps VRAM; a move, restart or migration is in progress; the data path failed (the device stays)", body = ErrorBody),
        (status = 422, description = "A bad body", body = ErrorBody)))]
async fn move_endpoint(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(req): Json<MoveRequest>,
) -> Result<Json<MoveResult>, ApiError> {
    blocking(&s, move |d| d.move_endpoint(&id, &req.to))
        .await
        .map(Json)
}

/// `PUT /v1/endpoints/{id}/vmm`.
#[utoipa::path(put, path = "/v1/endpoints/{id}/vmm", tag = TAG, operation_id = "register_vmm",
    summary = "Register the endpoint's VMM (QEMU's QMP socket and the device's id), for guest-visible moves",
    description = "Kept in memory: a restarted daemon needs it registered again.",
    params(("id" = String, Path, description = "The endpoint's id")),
    request_body = VmmLink,
    responses(
        (status = 200, description = "Registered (replacing an earlier registration)", body = EndpointStatus),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 422, description = "A bad body: an empty device id, a relative QMP path", body = ErrorBody)))]
async fn register_vmm(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(link): Json<VmmLink>,
) -> Result<Json<EndpointStatus>, ApiError> {
    blocking(&s, move |d| {
        if link.device_id.is_empty() || !link.qmp.is_absolute() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid",
                "The VMM needs an absolute QMP socket path and a non-empty device id",
            ));
        }
        d.status_of(&id)?;
        d.vmms().insert(id.clone(), link);
        d.status_of(&id)
    })
    .await
    .map(Json)
}

/// `DELETE /v1/endpoints/{id}/vmm`.
#[utoipa::path(delete, path = "/v1/endpoints/{id}/vmm", tag = TAG, operation_id = "forget_vmm",
    summary = "Forget the endpoint's VMM",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 204, description = "Forgotten"),
        (status = 404, description = "No such endpoint, or no VMM registered", body = ErrorBody)))]
async fn forget_vmm(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    blocking(&s, move |d| {
        d.status_of(&id)?;
        match d.vmms().remove(&id) {
            Some(_) => Ok(StatusCode::NO_CONTENT),
            None => Err(ApiError::not_found(
                "not_found",
                format!("Endpoint \"{id}\" has no VMM registered"),
            )),
        }
    })
    .await
}

/// `POST /v1/endpoints/{id}/detach`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/detach", tag = TAG, operation_id = "detach_endpoint",
    summary = "Take the endpoint's device away: unplugged from its VM through the registered VMM, worker stopped, board free",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "Detached: the endpoint holds no device", body = EndpointStatus),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "No device to detach; a VM uses it and no VMM is registered; a move in progress", body = ErrorBody),
        (status = 502, description = "The VMM failed (the device stays)", body = ErrorBody)))]
async fn detach_endpoint(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<EndpointStatus>, ApiError> {
    blocking(&s, move |d| d.detach(&id)).await.map(Json)
}

/// `POST /v1/endpoints/{id}/attach`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/attach", tag = TAG, operation_id = "attach_endpoint",
    summary = "Lease a device to a detached endpoint (a device, a pool, or its own pool), start its worker on fresh VRAM, plug it into its VM through the registered VMM",
    params(("id" = String, Path, description = "The endpoint's id")),
    request_body = Placement,
    responses(
        (status = 200, description = "Attached and serving", body = EndpointStatus),
        (status = 404, description = "No such endpoint, device or pool", body = ErrorBody),
        (status = 409, description = "The endpoint holds a device; no free device fits; `no_room`: the daemon's descriptor plan has no room for another endpoint", body = ErrorBody),
        (status = 422, description = "A bad body", body = ErrorBody),
        (status = 502, description = "The VMM failed to plug the device in (the endpoint is attached)", body = ErrorBody),
        (status = 503, description = "`resources`: the system is out of descriptors, memory or processes right now", body = ErrorBody)))]
async fn attach_endpoint(
    State(s): State<AppState>,
    Path(id): Path<String>,
    Json(to): Json<Placement>,
) -> Result<Json<EndpointStatus>, ApiError> {
    blocking(&s, move |d| d.attach(&id, &to)).await.map(Json)
}

/// `POST /v1/boards/{id}/drain`.
#[utoipa::path(post, path = "/v1/boards/{id}/drain", tag = TAG, operation_id = "drain_board",
    summary = "Quarantine the board and move every endpoint off it, under the running guests",
    params(("id" = String, Path, description = "The board's id")),
    responses(
        (status = 200, description = "The board is quarantined; the moves made and those that failed", body = DrainResult),
        (status = 404, description = "No such board", body = ErrorBody),
        (status = 409, description = "Not every endpoint can move (no free device of its shape, mapped VRAM, a move in progress): nothing was done", body = ErrorBody)))]
async fn drain_board(
    State(s): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<DrainResult>, ApiError> {
    blocking(&s, move |d| d.drain(&id)).await.map(Json)
}

/// `GET /events`.
#[utoipa::path(get, path = "/events", tag = TAG, operation_id = "events",
    summary = "Pool and worker lifecycle events, newline-delimited JSON",
    description = "One DaemonEvent per line: `type` is `pool` (the `pool` member: a pool event, \
        durable, also in the store's history) or `worker` (the `worker` member: a worker process \
        started, served, exited or was given up; not persisted). `seq` increases across daemon \
        restarts: a pool event P has seq P×1000000, worker events number the gaps. A \
        `{\"type\":\"lagged\",\"missed\":N}` line stands where N events were dropped (a slow \
        reader). With `follow=false` the body ends after the events already there.",
    params(EventsQuery),
    responses(
        (status = 200, description = "One JSON value per line", body = DaemonEvent, content_type = "application/x-ndjson"),
        (status = 400, description = "A bad query string", body = ErrorBody),
        (status = 503, description = "The daemon is shutting down (shutting_down), or too many events streams are open (too_many_streams)", body = ErrorBody)))]
async fn events(State(s): State<AppState>, Query(q): Query<EventsQuery>) -> Response {
    let d = s.0.clone();
    if d.events.is_closed() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "The daemon is shutting down",
        )
        .into_response();
    }
    let Some(slot) = d.events.open_stream() else {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "too_many_streams",
            format!("{MAX_STREAMS} events streams are open; close one or try again later"),
        )
        .into_response();
    };
    // The store's history is read page by page as the body is sent (`EventStream::body`).
    let history = match d.events.history() {
        Some(h) => h,
        None => match blocking(&s, |d| Ok(d.pool().history_reader())).await {
            Ok(h) => {
                d.events.set_history(h.clone());
                h
            }
            Err(e) => return e.into_response(),
        },
    };
    let cursor = d.events.cursor(q.since, q.follow.unwrap_or(true));
    let body = d.events.body(cursor, history, slot);
    ([(header::CONTENT_TYPE, NDJSON_CONTENT_TYPE)], body).into_response()
}
