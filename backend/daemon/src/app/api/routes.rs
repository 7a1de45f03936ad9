//! The routes: each handler parses its request and runs its operation on the blocking
//! pool.

use super::failover::{FaultInjected, FaultRequest};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use switchyard_control::{
    ApiError, Caller, ControlApi, ErrorBody, Json, NDJSON_CONTENT_TYPE, Path, Query,
};
use switchyard_pool::{
    BoardView, EndpointSpec as PoolEndpointSpec, Placement, PoolError, PoolView,
};
use utoipa_axum::routes;

use super::super::events::{DaemonEvent, EventsPruned, MAX_STREAMS};
use super::authz::{RegisteredVmm, check_qmp_registration, operator_only};
use super::incoming::{IncomingFromSpec, IncomingSpec};
use super::views::{
    DrainResult, EndpointStatus, EventsQuery, MoveRequest, MoveResult, VmmLink, WorkerReplaced,
};
use super::{AppState, TAG, blocking, pool_error};

/// The documented routes (without a state: for the document alone, see [`super::openapi`]).
pub(super) fn api() -> ControlApi<AppState> {
    ControlApi::new("Switchyard pool daemon", env!("CARGO_PKG_VERSION"))
        .description(
            "HTTP/JSON on the daemon's UNIX socket (`switchyard ctl` is its client). Every error \
             reply is an ErrorBody: {\"error\": {\"code\": ..., \"message\": ...}} with a 4xx or \
             5xx status; a refused request changes nothing. GET /openapi.json serves this \
             document. Moves and drains are transparent to the guest with trapped VRAM \
             (vram_mmap = false) and guest-visible through a registered VMM otherwise; detach \
             and attach unplug and plug the device through a registered VMM. Who may do \
             what (403 `forbidden` otherwise): root and the daemon's own user everything; \
             another user (a member of the daemon's --socket-group) reads everything, \
             creates endpoints and acts on the endpoints it created, and registers only its \
             own VMM (a QMP socket it owns, served by a process of its own); board \
             operations (quarantine, drain, fault injection) are root's.",
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
        .routes(routes!(create_incoming_endpoint))
        .routes(routes!(create_incoming_from_spec))
        .routes(routes!(restart_endpoint))
        .routes(routes!(upgrade_endpoint))
        .routes(routes!(move_endpoint))
        .routes(routes!(register_vmm, forget_vmm))
        .routes(routes!(detach_endpoint))
        .routes(routes!(attach_endpoint))
        .routes(routes!(drain_board))
        .routes(routes!(inject_fault))
        .routes(routes!(sync_endpoint))
}

// ---- handlers ----

/// `GET /v1/boards`.
#[utoipa::path(get, path = "/v1/boards", tag = TAG, operation_id = "list_boards",
    summary = "Every board with its devices and their holders",
    responses((status = 200, description = "The boards, in configuration order", body = Vec<BoardView>)))]
async fn list_boards(State(s): State<AppState>) -> Json<Vec<BoardView>> {
    Json(s.0.inventory().boards())
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
    s.0.inventory()
        .board(&id)
        .map(Json)
        .ok_or_else(|| pool_error(PoolError::UnknownBoard(id)))
}

async fn set_quarantine(
    s: AppState,
    caller: &Caller,
    id: String,
    on: bool,
) -> Result<Json<BoardView>, ApiError> {
    operator_only(
        caller,
        if on {
            "quarantine a board"
        } else {
            "unquarantine a board"
        },
    )?;
    blocking(&s, move |d| d.set_quarantine(&id, on).map(Json)).await
}

/// `POST /v1/boards/{id}/quarantine`.
#[utoipa::path(post, path = "/v1/boards/{id}/quarantine", tag = TAG, operation_id = "quarantine",
    summary = "Take no new leases on the board (its leases stay)",
    params(("id" = String, Path, description = "The board's id")),
    responses(
        (status = 200, description = "The board, quarantined (already quarantined: unchanged)", body = BoardView),
        (status = 403, description = "Not root or the daemon's own user", body = ErrorBody),
        (status = 404, description = "No such board", body = ErrorBody)))]
async fn quarantine(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<BoardView>, ApiError> {
    set_quarantine(s, &caller, id, true).await
}

/// `POST /v1/boards/{id}/unquarantine`.
#[utoipa::path(post, path = "/v1/boards/{id}/unquarantine", tag = TAG, operation_id = "unquarantine",
    summary = "Let a quarantined board take leases again",
    params(("id" = String, Path, description = "The board's id")),
    responses(
        (status = 200, description = "The board, available (already available: unchanged)", body = BoardView),
        (status = 403, description = "Not root or the daemon's own user", body = ErrorBody),
        (status = 404, description = "No such board", body = ErrorBody)))]
async fn unquarantine(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<BoardView>, ApiError> {
    set_quarantine(s, &caller, id, false).await
}

/// `GET /v1/pools`.
#[utoipa::path(get, path = "/v1/pools", tag = TAG, operation_id = "list_pools",
    summary = "Every pool with its capacity",
    responses((status = 200, description = "The pools", body = Vec<PoolView>)))]
async fn list_pools(State(s): State<AppState>) -> Json<Vec<PoolView>> {
    Json(s.0.inventory().pools())
}

/// `GET /v1/endpoints`.
#[utoipa::path(get, path = "/v1/endpoints", tag = TAG, operation_id = "list_endpoints",
    summary = "Every endpoint with its lease and its worker",
    responses((status = 200, description = "The endpoints, by id", body = Vec<EndpointStatus>)))]
async fn list_endpoints(State(s): State<AppState>, caller: Caller) -> Json<Vec<EndpointStatus>> {
    let d = &s.0;
    let inventory = d.inventory();
    Json(
        inventory
            .endpoints()
            .map(|e| super::authz::for_caller(d.endpoint_status(&inventory, e), &caller))
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
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<EndpointStatus>, ApiError> {
    s.0.status_of(&id)
        .map(|st| Json(super::authz::for_caller(st, &caller)))
}

/// `POST /v1/endpoints/{id}/sync` (issue 32): waits until the daemon has applied every
/// custody note the worker made before the request (`Supervisor::sync`), then answers as
/// `GET /v1/endpoints/{id}`, whose `worker.custody_seq` is the worker's number then.
#[utoipa::path(post, path = "/v1/endpoints/{id}/sync", tag = TAG, operation_id = "sync_endpoint",
    summary = "Wait until the daemon holds everything the endpoint's worker put in custody so far",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "Caught up; the endpoint as it is now", body = EndpointStatus),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 500, description = "No worker, or it did not answer within 10 s", body = ErrorBody)))]
async fn sync_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<EndpointStatus>, ApiError> {
    blocking(&s, move |d| {
        d.supervisor
            .sync(&id, std::time::Duration::from_secs(10))
            .map_err(super::supervisor_error)?;
        d.status_of(&id)
    })
    .await
    .map(|st| Json(super::authz::for_caller(st, &caller)))
}

/// `POST /v1/endpoints`.
#[utoipa::path(post, path = "/v1/endpoints", tag = TAG, operation_id = "create_endpoint",
    summary = "Create an endpoint: lease a device and start the worker serving its socket",
    description = "The lease is checked first; then the worker starts and serves the socket; \
        only then is the endpoint stored. A refused request (or a worker that does not start) \
        leaves nothing behind. The endpoint is the caller's (`owner_uid`).",
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
    caller: Caller,
    Json(spec): Json<PoolEndpointSpec>,
) -> Result<(StatusCode, Json<EndpointStatus>), ApiError> {
    blocking(&s, move |d| d.create(spec, caller.uid))
        .await
        .map(|st| (StatusCode::CREATED, Json(st)))
}

/// `DELETE /v1/endpoints/{id}`.
#[utoipa::path(delete, path = "/v1/endpoints/{id}", tag = TAG, operation_id = "delete_endpoint",
    summary = "Stop the endpoint's worker (the VM's connection closes) and delete the endpoint",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 403, description = "Neither root, the daemon's own user nor the endpoint's owner", body = ErrorBody),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "A move in progress, or an unknown process serves it", body = ErrorBody)))]
async fn delete_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        d.delete(&id)
    })
    .await
    .map(|()| StatusCode::NO_CONTENT)
}

/// `POST /v1/endpoints/{id}/incoming`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/incoming", tag = TAG, operation_id = "create_incoming_endpoint",
    summary = "Create the destination endpoint of a live migration of this endpoint's VM",
    description = "Leases a free device of the source's shape (from the source's pool) and \
        starts a worker serving a fresh device on the new endpoint's socket, for the destination \
        VMM (QEMU `-incoming`) to load the source's device state into; it takes only a stream \
        that starts with the source's `migration_token` (every stream the source's worker \
        writes does), another leaves the device in ERROR. When the destination's device has \
        loaded the source's stream and runs, the migration is complete: the destination keeps \
        its lease and the source endpoint (that incarnation: not one created again with its \
        id) is deleted once its VMM let go (events `migrated`, `migration_released`). When the \
        destination gives up, fails to load, gets a stream from elsewhere or its stream sits \
        idle past `[daemon] migration_idle_timeout`, the destination endpoint is deleted and \
        the source serves on (event `migration_aborted`). Kept in memory: a daemon restarted \
        during a migration leaves both endpoints as they are.",
    params(("id" = String, Path, description = "The source endpoint's id")),
    request_body = IncomingSpec,
    responses(
        (status = 201, description = "Created; the socket accepts the destination VMM", body = EndpointStatus),
        (status = 400, description = "Malformed JSON", body = ErrorBody),
        (status = 403, description = "Neither root, the daemon's own user nor the source endpoint's owner", body = ErrorBody),
        (status = 404, description = "No such source endpoint", body = ErrorBody),
        (status = 409, description = "The source has no device, already has an incoming endpoint or is one; no free device of its shape; id or socket in use", body = ErrorBody),
        (status = 422, description = "Invalid id or socket path", body = ErrorBody),
        (status = 500, description = "The worker did not start", body = ErrorBody)))]
async fn create_incoming_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(spec): Json<IncomingSpec>,
) -> Result<(StatusCode, Json<EndpointStatus>), ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        d.create_incoming(&id, spec, caller.uid)
    })
    .await
    .map(|st| (StatusCode::CREATED, Json(st)))
}

/// `POST /v1/incoming`.
#[utoipa::path(post, path = "/v1/incoming", tag = TAG, operation_id = "create_incoming_from_spec",
    summary = "Create the destination endpoint of a live migration from another host",
    description = "As `POST /v1/endpoints/{id}/incoming`, for a source on another host: \
        `source` is the source endpoint as `GET /v1/endpoints/{id}` (`ctl endpoint SRC --json`) \
        shows it to its owner there. Leases a free device of the source's kind and (canonical) \
        options from the source's pool's namesake here, or from `pool`; the device takes only a \
        stream that starts with the source's `migration_token`. It commits (event `migrated`; \
        nothing is released here) and aborts (the destination is deleted) as with a local \
        source. The source's daemon deletes the source once its VMM left after sending the \
        whole stream and stopping the device (event `migrated_away`). Admitted as creating \
        an endpoint is; the endpoint is the caller's.",
    request_body = IncomingFromSpec,
    responses(
        (status = 201, description = "Created; the socket accepts the destination VMM", body = EndpointStatus),
        (status = 400, description = "Malformed JSON", body = ErrorBody),
        (status = 404, description = "No such pool here", body = ErrorBody),
        (status = 409, description = "No free device of the source's shape; an incoming endpoint for that source exists; id or socket in use", body = ErrorBody),
        (status = 422, description = "No migration token, or not one; no lease; a kind this host does not have or options it refuses; invalid id or socket path", body = ErrorBody),
        (status = 500, description = "The worker did not start", body = ErrorBody)))]
async fn create_incoming_from_spec(
    State(s): State<AppState>,
    caller: Caller,
    Json(req): Json<IncomingFromSpec>,
) -> Result<(StatusCode, Json<EndpointStatus>), ApiError> {
    blocking(&s, move |d| d.create_incoming_from_spec(req, caller.uid))
        .await
        .map(|st| (StatusCode::CREATED, Json(st)))
}

/// `POST /v1/endpoints/{id}/restart`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/restart", tag = TAG, operation_id = "restart_endpoint",
    summary = "Crash drill: SIGKILL the worker; a replacement resumes the guest's connection",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "Replaced; the replacement serves (or `failed`)", body = WorkerReplaced),
        (status = 403, description = "Neither root, the daemon's own user nor the endpoint's owner", body = ErrorBody),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "The worker is not running (starting, restarting, failed, orphaned), or a move or a migration is in progress", body = ErrorBody)))]
async fn restart_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<WorkerReplaced>, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        d.replace(&id, false)
    })
    .await
    .map(Json)
}

/// `POST /v1/endpoints/{id}/upgrade`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/upgrade", tag = TAG, operation_id = "upgrade_endpoint",
    summary = "Replace the worker with the executable now on disk, under the running guest",
    params(("id" = String, Path, description = "The endpoint's id")),
    responses(
        (status = 200, description = "Replaced; the replacement serves (or `failed`)", body = WorkerReplaced),
        (status = 403, description = "Neither root, the daemon's own user nor the endpoint's owner", body = ErrorBody),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "The worker is not running (starting, restarting, failed, orphaned), or a move or a migration is in progress", body = ErrorBody)))]
async fn upgrade_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<WorkerReplaced>, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        d.replace(&id, true)
    })
    .await
    .map(Json)
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
        (status = 403, description = "Neither root, the daemon's own user nor the endpoint's owner", body = ErrorBody),
        (status = 404, description = "No such endpoint or device", body = ErrorBody),
        (status = 409, description = "The target is busy, quarantined or another shape; the guest maps VRAM; a move, restart or migration is in progress; the data path failed (the device stays)", body = ErrorBody),
        (status = 422, description = "A bad body", body = ErrorBody)))]
async fn move_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(req): Json<MoveRequest>,
) -> Result<Json<MoveResult>, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        d.move_endpoint(&id, &req.to)
    })
    .await
    .map(Json)
}

/// `PUT /v1/endpoints/{id}/vmm`.
#[utoipa::path(put, path = "/v1/endpoints/{id}/vmm", tag = TAG, operation_id = "register_vmm",
    summary = "Register the endpoint's VMM (QEMU's QMP socket and the device's id), for guest-visible moves",
    description = "Kept in memory: a restarted daemon needs it registered again. A user other \
        than root and the daemon's own registers only its own VMM: `qmp` must be a socket \
        (not a symbolic link) that the user owns, and whenever the daemon connects to it, the \
        process listening on it must run as that user (SO_PEERCRED), or nothing is sent to it \
        (403).",
    params(("id" = String, Path, description = "The endpoint's id")),
    request_body = VmmLink,
    responses(
        (status = 200, description = "Registered (replacing an earlier registration)", body = EndpointStatus),
        (status = 403, description = "Not the endpoint's owner (nor root or the daemon's own user), or the QMP socket is not a socket of the caller's", body = ErrorBody),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 422, description = "A bad body: an empty device id, a relative QMP path", body = ErrorBody)))]
async fn register_vmm(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(link): Json<VmmLink>,
) -> Result<Json<EndpointStatus>, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        if link.device_id.is_empty() || !link.qmp.is_absolute() {
            return Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid",
                "The VMM needs an absolute QMP socket path and a non-empty device id",
            ));
        }
        check_qmp_registration(&caller, &link.qmp)?;
        d.vmms()
            .insert(id.clone(), RegisteredVmm::new(link, &caller));
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
        (status = 403, description = "Neither root, the daemon's own user nor the endpoint's owner", body = ErrorBody),
        (status = 404, description = "No such endpoint, or no VMM registered", body = ErrorBody)))]
async fn forget_vmm(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<StatusCode, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
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
        (status = 403, description = "Neither root, the daemon's own user nor the endpoint's owner; or the registered VMM's QMP socket is served by another user than the one that registered it", body = ErrorBody),
        (status = 404, description = "No such endpoint", body = ErrorBody),
        (status = 409, description = "No device to detach; a VM uses it and no VMM is registered; a move in progress", body = ErrorBody),
        (status = 502, description = "The VMM failed (the device stays)", body = ErrorBody)))]
async fn detach_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<EndpointStatus>, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        d.detach(&id)
    })
    .await
    .map(Json)
}

/// `POST /v1/endpoints/{id}/attach`.
#[utoipa::path(post, path = "/v1/endpoints/{id}/attach", tag = TAG, operation_id = "attach_endpoint",
    summary = "Lease a device to a detached endpoint (a device, a pool, or its own pool), start its worker on fresh VRAM, plug it into its VM through the registered VMM",
    params(("id" = String, Path, description = "The endpoint's id")),
    request_body = Placement,
    responses(
        (status = 200, description = "Attached and serving", body = EndpointStatus),
        (status = 403, description = "Neither root, the daemon's own user nor the endpoint's owner; or the registered VMM's QMP socket is served by another user than the one that registered it", body = ErrorBody),
        (status = 404, description = "No such endpoint, device or pool", body = ErrorBody),
        (status = 409, description = "The endpoint holds a device; no free device fits; `no_room`: the daemon's descriptor plan has no room for another endpoint", body = ErrorBody),
        (status = 422, description = "A bad body", body = ErrorBody),
        (status = 502, description = "The VMM failed to plug the device in (the endpoint is attached)", body = ErrorBody),
        (status = 503, description = "`resources`: the system is out of descriptors, memory or processes right now", body = ErrorBody)))]
async fn attach_endpoint(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(to): Json<Placement>,
) -> Result<Json<EndpointStatus>, ApiError> {
    blocking(&s, move |d| {
        d.owner_or_operator(&caller, &id)?;
        d.attach(&id, &to)
    })
    .await
    .map(Json)
}

/// `POST /v1/boards/{id}/drain`.
#[utoipa::path(post, path = "/v1/boards/{id}/drain", tag = TAG, operation_id = "drain_board",
    summary = "Quarantine the board and move every endpoint off it, under the running guests",
    params(("id" = String, Path, description = "The board's id")),
    responses(
        (status = 200, description = "The board is quarantined; the moves made and those that failed", body = DrainResult),
        (status = 403, description = "Not root or the daemon's own user", body = ErrorBody),
        (status = 404, description = "No such board", body = ErrorBody),
        (status = 409, description = "Not every endpoint can move (no free device of its shape, mapped VRAM, a move in progress): nothing was done", body = ErrorBody)))]
async fn drain_board(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Json<DrainResult>, ApiError> {
    operator_only(&caller, "drain a board")?;
    blocking(&s, move |d| d.drain(&id)).await.map(Json)
}

/// `POST /v1/boards/{id}/fault`.
#[utoipa::path(post, path = "/v1/boards/{id}/fault", tag = TAG, operation_id = "inject_fault",
    summary = "Simulate a failure of the board under its running devices (tests and drills; the daemon needs --faults)",
    description = "The board's leased devices simulate the fault `kind`, which they then detect and report as a real one: the board fails (`board_failed`) and its endpoints fail over as their pools' `failover` policies say.",
    params(("id" = String, Path, description = "The board's id")),
    request_body = FaultRequest,
    responses(
        (status = 200, description = "Injected; detection and failover follow", body = FaultInjected),
        (status = 403, description = "The daemon was not started with --faults (`faults_disabled`), or the caller is not root or the daemon's own user (`forbidden`)", body = ErrorBody),
        (status = 404, description = "No such board", body = ErrorBody),
        (status = 409, description = "No device of the board is leased, one of its endpoints is moving, or a device refused the fault (a kind it does not simulate)", body = ErrorBody)))]
async fn inject_fault(
    State(s): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Json(req): Json<FaultRequest>,
) -> Result<Json<FaultInjected>, ApiError> {
    operator_only(&caller, "inject a fault into a board")?;
    blocking(&s, move |d| d.inject_fault(&id, &req.kind))
        .await
        .map(Json)
}

/// `GET /events`.
#[utoipa::path(get, path = "/events", tag = TAG, operation_id = "events",
    summary = "Pool and worker lifecycle events, newline-delimited JSON",
    description = "One DaemonEvent per line: `type` is `pool` (the `pool` member: a pool event, \
        durable, also in the store's history) or `worker` (the `worker` member: a worker process \
        started, served, exited or was given up; not persisted). `seq` increases across daemon \
        restarts: a pool event P has seq P×1000000, worker events number the gaps (a full gap \
        is closed by a `seq_mark` pool event; no event is dropped). A \
        `{\"type\":\"lagged\",\"missed\":N}` line stands where N events were dropped (a slow \
        reader: worker events gone from memory, pool events pruned by the store's retention \
        meanwhile). A `since` older than the store keeps (`[daemon] events_keep`, \
        `events_max_age`) is refused with 410 and the oldest `since` that resumes without a \
        gap. With `follow=false` the body ends after the events already there.",
    params(EventsQuery),
    responses(
        (status = 200, description = "One JSON value per line", body = DaemonEvent, content_type = "application/x-ndjson"),
        (status = 400, description = "A bad query string", body = ErrorBody),
        (status = 410, description = "`since` is older than the store's history keeps (events_pruned): resume from `oldest_since`", body = EventsPruned),
        (status = 503, description = "The daemon is shutting down (shutting_down), or too many events streams are open (too_many_streams: the caller's user has 8 open, or users other than root hold their 24; the message names the limit)", body = ErrorBody)))]
async fn events(
    State(s): State<AppState>,
    caller: Caller,
    Query(q): Query<EventsQuery>,
) -> Response {
    let d = s.0.clone();
    if d.events.is_closed() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "The daemon is shutting down",
        )
        .into_response();
    }
    // The caller's share of the streams (per user, root's reserve), then the hub's slot.
    let permit = match caller.open_stream() {
        Ok(permit) => permit,
        Err(e) => return e.into_response(),
    };
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
        None => match blocking(&s, |d| Ok(d.history_reader())).await {
            Ok(h) => {
                d.events.set_history(h.clone());
                h
            }
            Err(e) => return e.into_response(),
        },
    };
    if let Some(since) = q.since {
        let h = history.clone();
        match blocking(&s, move |_| h.pruned().map_err(pool_error)).await {
            Ok(pruned) => {
                if let Err(gone) = EventsPruned::check(since, pruned) {
                    return (StatusCode::GONE, Json(gone)).into_response();
                }
            }
            Err(e) => return e.into_response(),
        }
    }
    let cursor = d.events.cursor(q.since, q.follow.unwrap_or(true));
    let body = permit.hold(d.events.body(cursor, history, slot));
    ([(header::CONTENT_TYPE, NDJSON_CONTENT_TYPE)], body).into_response()
}
