//! The daemon's operations behind the routes: each checks on a copy of the pool, acts on
//! the data path, then changes the store (or undoes what it did).

use std::time::Duration;

use axum::http::StatusCode;
use switchyard_control::ApiError;
use switchyard_pool::{Endpoint, EndpointSpec as PoolEndpointSpec, MovePlan, Placement};

use super::super::events::ms;
use super::super::{Daemon, Unsupervised};
use super::authz::{RegisteredVmm, qmp_of, vmm_error};
use super::views::{
    DrainResult, EndpointStatus, FailedMove, MoveResult, VmmLink, WorkerReplaced, WorkerState,
    WorkerView,
};
use super::{
    MOVE_TIMEOUT, READY_TIMEOUT, UNPLUG_TIMEOUT, error_chain, pool_error, supervisor_error,
    unknown_endpoint,
};
use crate::supervisor::{MoveOutcome, SupervisorError, WorkerStatus};

/// Whether an endpoint whose migration token is `now` is the incarnation of its id that
/// `want` names (none: any).
fn is_incarnation(want: Option<&str>, now: Option<&str>) -> bool {
    want.is_none_or(|want| now == Some(want))
}

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

    pub(super) fn endpoint_status(
        &self,
        inventory: &switchyard_pool::Inventory,
        endpoint: &Endpoint,
    ) -> EndpointStatus {
        let vmm = self.vmms().get(&endpoint.id).map(|v| v.link.clone());
        EndpointStatus {
            lease: endpoint.device.as_deref().and_then(|d| inventory.device(d)),
            worker: self.worker_view(endpoint),
            vmm,
            incoming_for: self.incoming_source(&endpoint.id),
            failover: self.failover_view(inventory, &endpoint.id),
            endpoint: endpoint.clone(),
        }
    }

    pub(super) fn status_of(&self, id: &str) -> Result<EndpointStatus, ApiError> {
        let inventory = self.inventory();
        let endpoint = inventory.endpoint(id).ok_or_else(|| unknown_endpoint(id))?;
        Ok(self.endpoint_status(&inventory, endpoint))
    }

    /// Creates an endpoint: checked on a copy of the inventory, its worker started and
    /// waited for (no lock held, the pool's owner free for other requests), then committed
    /// by the pool's owner, if the lease it takes is still the one the worker serves (a
    /// concurrent request may have taken it meanwhile: then the worker is stopped and the
    /// request refused, nothing created).
    /// The endpoint is `owner_uid`'s.
    pub(super) fn create(
        &self,
        spec: PoolEndpointSpec,
        owner_uid: u32,
    ) -> Result<EndpointStatus, ApiError> {
        let token = switchyard_pool::new_migration_token().map_err(pool_error)?;
        self.create_expecting(spec, owner_uid, None, &token)
    }

    /// [`Daemon::create`] of an endpoint with migration token `token` (from
    /// [`switchyard_pool::new_migration_token`]) whose device takes only incoming migration
    /// streams of origin `expect_origin` (an incoming endpoint: its source's migration token).
    pub(super) fn create_expecting(
        &self,
        spec: PoolEndpointSpec,
        owner_uid: u32,
        expect_origin: Option<String>,
        token: &str,
    ) -> Result<EndpointStatus, ApiError> {
        // The check and the commit create the same endpoint, with the same token.
        // Everything the pool refuses is refused before a worker starts.
        let mut dry = (*self.inventory()).clone();
        if let Some(socket) = &spec.socket {
            socket_in_endpoint_dir(dry.endpoint_dir(), socket)?;
        }
        dry.create_endpoint_as(&spec, owner_uid, token)
            .map_err(pool_error)?;
        let endpoint = dry
            .endpoint(&spec.id)
            .ok_or_else(|| ApiError::internal("The checked endpoint is missing"))?;
        let planned = endpoint.device.clone();
        let mut worker = Daemon::spec(&dry, endpoint)
            .ok_or_else(|| ApiError::internal("The checked endpoint has no device"))?;
        worker.migration.expect_origin = expect_origin;
        self.supervisor.create(worker).map_err(supervisor_error)?;
        let undo = |e: ApiError| {
            let _ = self.supervisor.delete(&spec.id);
            self.records.remove(&spec.id);
            e
        };
        let st = self
            .supervisor
            .wait_ready(&spec.id, 1, READY_TIMEOUT)
            .map_err(|e| undo(supervisor_error(e)))?;
        if st.ready < 1 {
            return Err(undo(ApiError::internal(format!(
                "The worker of endpoint \"{}\" did not start serving (see the daemon's log); nothing was created",
                spec.id
            ))));
        }
        let committed = {
            let (spec, token) = (spec.clone(), token.to_owned());
            self.pool.run(move |pool, events| {
                // The lease the worker serves must still be the one the pool gives.
                let mut dry = pool.inventory().clone();
                dry.create_endpoint_as(&spec, owner_uid, &token)?;
                let now = dry.endpoint(&spec.id).and_then(|e| e.device.clone());
                if now != planned {
                    return Ok(Some(now));
                }
                events.pool(pool.create_endpoint_as(&spec, owner_uid, &token)?);
                Ok(None)
            })
        };
        match committed {
            Ok(None) => {}
            Ok(Some(now)) => {
                return Err(undo(ApiError::conflict(
                    "conflict",
                    format!(
                        "Endpoint \"{}\": the pool changed while its worker started (its device would now be {}); nothing was created, try again",
                        spec.id,
                        now.as_deref().unwrap_or("none")
                    ),
                )));
            }
            Err(e) => return Err(undo(pool_error(e))),
        }
        self.metrics.endpoint(&spec.id);
        self.status_of(&spec.id)
    }

    /// Deletes an endpoint: checked on a copy, its worker stopped (a process kill and a
    /// thread join: no lock held, the pool's owner free), then the deletion committed.
    pub(super) fn delete(&self, id: &str) -> Result<(), ApiError> {
        self.delete_incarnation(id, None).map(|_| ())
    }

    /// [`Daemon::delete`]; with `token`, only the incarnation of `id` whose migration token
    /// it is (checked by the supervisor with its removal, and by the pool's owner with the
    /// commit): `Ok(false)`, nothing done, when `id` is gone or another incarnation (an
    /// endpoint deleted and created again with the same id is never touched).
    pub(crate) fn delete_incarnation(
        &self,
        id: &str,
        token: Option<&str>,
    ) -> Result<bool, ApiError> {
        let inventory = self.inventory();
        if !is_incarnation(
            token,
            inventory.endpoint(id).map(|e| e.migration_token.as_str()),
        ) {
            return Ok(false);
        }
        let mut dry = (*inventory).clone();
        dry.delete_endpoint(id).map_err(pool_error)?;
        let socket = inventory.endpoint(id).map(|e| e.socket.clone());
        let unsupervised = self.unsupervised().get(id).cloned();
        if let Some(Unsupervised::Orphaned { pid }) = unsupervised {
            // The orphan must stop serving the socket before the endpoint is gone. It could
            // not be adopted, so nothing proves it is this daemon's worker (its record may
            // name another daemon's): never signalled, the administrator stops it.
            let refused = match pid {
                None => Some(format!(
                    "Endpoint \"{id}\" is served by a process this daemon does not know; stop it first"
                )),
                Some(pid) if super::super::records::start_time(pid).is_some() => Some(format!(
                    "Endpoint \"{id}\" is served by process {pid}, which its worker record names but which could not prove it is this daemon's worker (it was not adopted); stop it first"
                )),
                // The recorded process is gone: nothing serves the socket any more.
                Some(_) => None,
            };
            if let Some(message) = refused {
                return Err(ApiError::conflict("orphaned", message));
            }
            if let Some(socket) = &socket {
                remove_stale_socket(socket);
            }
        }
        match self
            .supervisor
            .delete_if(id, |s| is_incarnation(token, s.migration.origin.as_deref()))
        {
            Ok(true) | Err(SupervisorError::NotFound(_)) => {}
            Ok(false) => return Ok(false),
            Err(e) => return Err(supervisor_error(e)),
        }
        self.unsupervised().remove(id);
        self.vmms().remove(id);
        self.forget_incoming(id);
        self.records.remove(id);
        let (owned, token) = (id.to_owned(), token.map(str::to_owned));
        let deleted = self
            .pool
            .commit(move |pool| {
                let now = pool.inventory().endpoint(&owned);
                if !is_incarnation(token.as_deref(), now.map(|e| e.migration_token.as_str())) {
                    return Ok((false, Vec::new()));
                }
                Ok((true, pool.delete_endpoint(&owned)?))
            })
            .map_err(pool_error)?;
        if deleted {
            self.metrics.remove_endpoint(id);
            // Its device is free: an endpoint waiting for one may fail over now.
            self.failover.wake();
        }
        Ok(deleted)
    }

    /// Unplugs the endpoint's device from its VM (if one uses it), stops its worker and
    /// frees its board.
    pub(super) fn detach(&self, id: &str) -> Result<EndpointStatus, ApiError> {
        {
            let mut dry = (*self.inventory()).clone();
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
            let vmm = self.vmms().get(id).cloned().ok_or_else(|| {
                ApiError::conflict(
                    "connected",
                    format!(
                        "A VM uses endpoint \"{id}\": register its VMM (`switchyard ctl vmm {id} --qmp PATH --device-id ID`, or PUT /v1/endpoints/{id}/vmm) so that the device can be unplugged first"
                    ),
                )
            })?;
            let mut qmp = qmp_of(id, &vmm)?;
            let link = &vmm.link;
            qmp.device_del(&link.device_id, UNPLUG_TIMEOUT)
                .map_err(|e| vmm_error(id, link, "the guest did not release the device", &e))?;
            self.wait_disconnected(id);
        }
        match self.supervisor.delete(id) {
            Ok(()) | Err(SupervisorError::NotFound(_)) => {}
            Err(e) => return Err(supervisor_error(e)),
        }
        self.records.remove(id);
        let owned = id.to_owned();
        self.pool
            .apply(move |pool| pool.detach(&owned))
            .map_err(pool_error)?;
        self.status_of(id)
    }

    /// Leases a device to a detached endpoint, starts its worker and plugs the device into
    /// the endpoint's VM if its VMM is registered.
    pub(super) fn attach(&self, id: &str, to: &Placement) -> Result<EndpointStatus, ApiError> {
        let spec = {
            let mut dry = (*self.inventory()).clone();
            dry.attach(id, to).map_err(pool_error)?;
            let endpoint = dry.endpoint(id).ok_or_else(|| unknown_endpoint(id))?;
            Daemon::spec(&dry, endpoint)
                .ok_or_else(|| ApiError::internal("The checked endpoint has no device"))?
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
            let (owned, to) = (id.to_owned(), to.clone());
            self.pool
                .apply(move |pool| pool.attach(&owned, &to))
                .map_err(|e| undo(pool_error(e)))?;
        }
        self.unsupervised().remove(id);
        // The registry's lock is not held across `status_of`, which takes it again.
        let vmm = self.vmms().get(id).cloned();
        if let Some(vmm) = vmm {
            let link = &vmm.link;
            let socket = self.status_of(id)?.endpoint.socket;
            let mut device = switchyard_qemu::VfioUserDevice::new(&link.device_id, &socket);
            device.bus = link.bus.clone();
            qmp_of(id, &vmm)?
                .device_add(&device)
                .map_err(|e| vmm_error(id, link, "the device cannot be plugged in", &e))?;
        }
        self.status_of(id)
    }

    /// Waits (bounded) until the endpoint's client has left.
    pub(super) fn wait_disconnected(&self, id: &str) {
        crate::blocking::may_block("a client's disconnection");
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
            let inventory = self.inventory();
            let endpoint = inventory.endpoint(id).ok_or_else(|| unknown_endpoint(id))?;
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
        if !maps_vram(plan) {
            return Ok(());
        }
        if !self.vmms().contains_key(&plan.endpoint) {
            return Err(ApiError::conflict(
                "mapped_vram",
                format!(
                    "Endpoint \"{0}\" lets its guest map VRAM (vram_mmap = true): a mapping cannot be re-pointed under the guest, so it moves guest-visibly through its VMM; register the VMM first (`switchyard ctl vmm {0} --qmp PATH --device-id ID`, or PUT /v1/endpoints/{0}/vmm)",
                    plan.endpoint
                ),
            ));
        }
        if plan.shape.profile.msix {
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

    pub(super) fn move_endpoint(&self, id: &str, to: &str) -> Result<MoveResult, ApiError> {
        self.serving(id)?;
        self.refuse_while_moving(id)?;
        self.refuse_while_migrating(id)?;
        let checked = self.inventory().check_move(id, to).map_err(pool_error)?;
        self.check_movable(&checked)?;
        let plan = {
            let (id, to) = (id.to_owned(), to.to_owned());
            self.pool
                .commit(move |pool| pool.plan_move(&id, &to))
                .map_err(pool_error)?
        };
        self.execute_move(plan)
    }

    /// Runs a planned move on the data path, then commits it (or releases the target): the
    /// lease follows the device. The worker is told the target device (`plan.to`), which
    /// it remembers with the outcome for a daemon that adopts it after this one died
    /// ([`super::super::pending`]).
    fn execute_move(&self, plan: MovePlan) -> Result<MoveResult, ApiError> {
        let vmm = maps_vram(&plan)
            .then(|| self.vmms().get(&plan.endpoint).cloned())
            .flatten();
        let (outcome, visible_downtime, not_plugged) = match &vmm {
            None => (
                self.supervisor.move_device_to(
                    &plan.endpoint,
                    &plan.to,
                    self.target_spec(&plan),
                    false,
                    MOVE_TIMEOUT,
                ),
                None,
                None,
            ),
            Some(vmm) => match self.move_unplugged(&plan, vmm) {
                Ok(u) => (
                    u.outcome,
                    Some(u.downtime),
                    u.plugged.err().map(|e| (&vmm.link, u.socket, e)),
                ),
                Err(e) => {
                    self.abort_plan(&plan, "move");
                    return Err(e);
                }
            },
        };
        let report = match outcome {
            Ok(MoveOutcome::Moved(report)) => Some(report),
            Ok(MoveOutcome::MovedAcrossRestart) => None,
            Err(e) => {
                self.abort_plan(&plan, "move");
                if let Some((link, socket, plug)) = &not_plugged {
                    // The device stays where it was, but the guest lost it.
                    return Err(not_plugged_back(
                        &plan,
                        link,
                        socket,
                        &format!(
                            "the move failed ({}; the device stays on board {})",
                            error_chain(&e),
                            plan.from_board
                        ),
                        plug,
                    ));
                }
                return Err(match e {
                    SupervisorError::MoveFailed { .. } | SupervisorError::Moving(_) => {
                        ApiError::conflict("move_failed", error_chain(&e))
                    }
                    e => supervisor_error(e),
                });
            }
        };
        // The data path moved the device: the lease follows it, plugged back or not.
        self.commit_plan(&plan, "move")?;
        let downtime = visible_downtime.or_else(|| {
            report
                .as_ref()
                .map(|r| Duration::from_micros(r.downtime_us))
        });
        if let Some(d) = downtime {
            self.metrics.board(&plan.from_board).moved(d);
        }
        if let Some((link, socket, plug)) = &not_plugged {
            return Err(not_plugged_back(
                &plan,
                link,
                socket,
                &format!(
                    "the device moved to board {} (the lease follows it)",
                    plan.to_board
                ),
                plug,
            ));
        }
        Ok(MoveResult {
            guest_visible: vmm.is_some(),
            endpoint: self.status_of(&plan.endpoint)?,
            downtime_ms: downtime.map(ms),
            report,
            plan,
        })
    }

    /// A guest-visible move: the VMM unplugs the device (QMP `device_del`, the guest lets
    /// go), the worker moves it with nobody connected, and the VMM plugs it back
    /// (`device_add` of the same socket), whatever the move's outcome. Errors before the
    /// move (`Err`: the unplug failed) change nothing; once the worker was asked, what the
    /// data path did and whether the plug-back worked are returned, for the lease to follow
    /// the device either way.
    fn move_unplugged(&self, plan: &MovePlan, vmm: &RegisteredVmm) -> Result<Unplugged, ApiError> {
        use switchyard_qemu::VfioUserDevice;
        let link = &vmm.link;
        let vmm_error =
            |what: &str, e: &dyn std::error::Error| vmm_error(&plan.endpoint, link, what, e);
        let mut qmp = qmp_of(&plan.endpoint, vmm)?;
        let socket = self
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
        let target = self.target_spec(plan);
        let outcome =
            self.supervisor
                .move_device_to(&plan.endpoint, &plan.to, target, true, MOVE_TIMEOUT);
        let plugged = qmp.device_add(&device);
        let downtime = t0.elapsed();
        if let Err(e) = &plugged {
            tracing::error!(
                endpoint = plan.endpoint,
                moved = outcome.is_ok(),
                error = %e,
                "cannot plug the device back"
            );
        }
        Ok(Unplugged {
            outcome,
            downtime,
            plugged,
            socket,
        })
    }

    pub(super) fn drain(&self, board: &str) -> Result<DrainResult, ApiError> {
        for plan in self.inventory().plan_drain(board).map_err(pool_error)? {
            self.check_movable(&plan)?;
            self.refuse_while_moving(&plan.endpoint)?;
            self.refuse_while_migrating(&plan.endpoint)?;
        }
        let plans = {
            let board = board.to_owned();
            self.pool
                .commit(move |pool| pool.drain(&board))
                .map_err(pool_error)?
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

    pub(super) fn replace(&self, id: &str, upgrade: bool) -> Result<WorkerReplaced, ApiError> {
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

/// What a guest-visible move did ([`Daemon::move_unplugged`]).
struct Unplugged {
    /// The data path's outcome.
    outcome: Result<MoveOutcome, SupervisorError>,
    /// From `device_del` to `device_add`.
    downtime: Duration,
    /// Whether the device was plugged back.
    plugged: Result<(), switchyard_qemu::QemuError>,
    /// The endpoint's socket (what `device_add` plugs).
    socket: std::path::PathBuf,
}

/// The device of a guest-visible move was not plugged back (502): what became of the move
/// (`what`), the QMP error, and how to plug the device in.
fn not_plugged_back(
    plan: &MovePlan,
    link: &VmmLink,
    socket: &std::path::Path,
    what: &str,
    e: &switchyard_qemu::QemuError,
) -> ApiError {
    let bus = link
        .bus
        .as_deref()
        .map(|b| format!(", bus \"{b}\""))
        .unwrap_or_default();
    ApiError::new(
        StatusCode::BAD_GATEWAY,
        "vmm",
        format!(
            "Endpoint \"{}\": {what}, but could not be plugged back through QMP at {}: {e}. \
             The guest has no device until it is plugged in: the VMM's device_add of a \
             vfio-user-pci device with id \"{}\" on socket {}{bus}",
            plan.endpoint,
            link.qmp.display(),
            link.device_id,
            socket.display()
        ),
    )
}

/// A socket path a request names: only directly in the daemon's endpoint directory, for every
/// caller, root included (another place only through the configuration file, which the
/// daemon's administrator writes). So a request never makes the daemon create, replace or
/// share a file anywhere else (`/etc`, `/root`, its state directory, another user's directory).
fn socket_in_endpoint_dir(dir: &std::path::Path, socket: &std::path::Path) -> Result<(), ApiError> {
    use std::path::Component;
    let name_ok = match socket.components().next_back() {
        Some(Component::Normal(name)) => !name.as_encoded_bytes().starts_with(b"."),
        _ => false,
    };
    if socket.is_absolute() && name_ok && socket.parent() == Some(dir) {
        return Ok(());
    }
    Err(ApiError::unprocessable(
        "socket_outside_endpoint_dir",
        format!(
            "The socket path {} is not in the daemon's endpoint directory {}: a request may name a socket only there (`{}/NAME`, NAME not starting with a dot); another place only through the configuration file",
            socket.display(),
            dir.display(),
            dir.display()
        ),
    ))
}

/// Removes the socket file at `path` once nothing accepts on it (a stopped orphan's).
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

/// Whether the guest may map memory the move replaces (a softgpu's VRAM with `vram_mmap`):
/// a mapping cannot be re-pointed under the guest, so such a device moves guest-visibly,
/// through its VMM.
fn maps_vram(plan: &MovePlan) -> bool {
    plan.shape.profile.client_maps_memory
}
