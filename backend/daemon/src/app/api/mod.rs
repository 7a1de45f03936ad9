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
//! | `POST /v1/boards/{id}/fault` | simulate a failure of the board (`--faults` only): its endpoints fail over (`failover.rs`) |
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
//! Who may do what (`authz`): root and the daemon's own user everything; another user that
//! can connect (a `--socket-group` member) reads everything, creates endpoints, acts only on
//! the endpoints it created and registers only its own VMM; board operations are root's. A
//! refusal is 403 `forbidden`.
//!
//! Errors are `{"error":{"code","message"}}`: pool errors by kind (`not_found` 404,
//! `conflict` 409, `invalid` 422, `internal` 500); malformed JSON 400, a bad body 422. A
//! refused request changes nothing: the pool checks a mutation on a copy before the data path
//! acts, and the store is changed last (or the data path undone).
pub(crate) mod authz;
mod commits;
pub(crate) mod failover;
pub(crate) mod incoming;
mod ops;
mod routes;
mod views;

use std::sync::Arc;
use std::time::Duration;

use axum::extract::FromRef;
use axum::http::StatusCode;
use switchyard_control::{ApiError, Metrics};
use switchyard_pool::{ErrorKind, PoolError};

use super::Daemon;
use crate::supervisor::SupervisorError;

pub use crate::error_chain::error_chain;
pub use failover::{FaultInjected, FaultRequest};
pub use views::{
    DrainResult, EndpointStatus, EventsQuery, FailedMove, FailoverView, LastFailover, MoveRequest,
    MoveResult, VmmLink, WorkerReplaced, WorkerState, WorkerView,
};

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
    let (router, doc) = routes::api().build(AppState(daemon));
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

/// The API's OpenAPI document (what `docs/control-api.json` holds).
pub fn openapi() -> utoipa::openapi::OpenApi {
    routes::api().openapi().clone()
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
