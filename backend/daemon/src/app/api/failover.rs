//! Failover: when a board fails under its endpoints, each is moved to a device of its shape
//! on a healthy board, as its pool's policy (`[[pools]] failover`) says.
//!
//! A failure is reported by the device (its worker's [`Note::BoardFailed`]: an engine that
//! died, VRAM that became unusable, a passthrough device the kernel took back) or injected
//! (`POST /v1/boards/{id}/fault`, with `--faults` only). The pool records it durably
//! ([`Pool::fail_board`]: the board is quarantined and keeps its failure until it is
//! unquarantined), so what follows survives a daemon restart: a *reconciler* thread fails
//! over every endpoint that leases a device of a failed board, at once when a failure is
//! reported and every second after (an endpoint waiting for a free device goes as soon as
//! one is).
//!
//! - transparent (the device's state outlived the failure, the policy allows): the lease
//!   moves to the new device and the worker is replaced by one that continues the device
//!   from its black box and memory objects there, under the connected guest, which sees a
//!   stall;
//! - guest-visible (the state died with the board, or the policy says so): QMP `device_del`
//!   through the endpoint's registered VMM, a fresh device on the new board, `device_add`
//!   into the same slot; the guest's driver probes it again;
//! - no free device of the shape: the endpoint waits, degraded (`failover_waiting`);
//! - policy `off`, no VMM for a guest-visible failover, MSI-X under QEMU: the endpoint keeps
//!   its dead device (`failover_refused`, said once).
//!
//! [`Note::BoardFailed`]: crate::custody::Note::BoardFailed
//! [`Pool::fail_board`]: switchyard_pool::Pool::fail_board

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use switchyard_control::ApiError;
use switchyard_pool::{BoardFailure, FailedLease, FailoverPolicy, MovePlan, PoolError};
use utoipa::ToSchema;

use super::super::{Daemon, lock};
use super::commits::Uncommitted;
use super::views::{FailoverView, LastFailover};
use super::{READY_TIMEOUT, UNPLUG_TIMEOUT, pool_error, supervisor_error};
use crate::custody::device_spec;
use crate::error_chain::error_chain;

/// How often the reconciler looks at the endpoints of failed boards without being woken.
const RECONCILE_PERIOD: Duration = Duration::from_secs(1);
/// How long a worker has to answer a fault injection.
const FAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// Most board failure reports of one endpoint waiting to be recorded; more are dropped (the
/// board is being failed already).
const MAX_WAITING_REPORTS: usize = 16;

/// A worker's board failure report: the lease it served, and the failure.
type Report = (Option<String>, BoardFailure);

/// The daemon's failover bookkeeping (in memory; the failures themselves are in the store).
#[derive(Debug, Default)]
pub(crate) struct Failover {
    /// `--faults`: fault injection is allowed.
    faults_enabled: bool,
    /// Set to wake the reconciler.
    wake: Mutex<bool>,
    woken: Condvar,
    /// When each failed board's failure was reported: stalls are measured from there.
    reported: Mutex<BTreeMap<String, Instant>>,
    /// Per endpoint, the board failures its worker reported that are not recorded yet, in
    /// order (the first is being recorded, by the endpoint's one recording thread, off the
    /// supervision thread): the endpoint's failover is pending from the report on.
    recording: Mutex<BTreeMap<String, VecDeque<Report>>>,
    /// What each endpoint that cannot fail over now was last said to wait for, so that
    /// each `failover_waiting` or `failover_refused` is said once.
    said: Mutex<BTreeMap<String, String>>,
    /// The last failover of each endpoint.
    last: Mutex<BTreeMap<String, LastFailover>>,
    /// Moves and failovers whose data path finished but whose commit the store refused:
    /// retried by the reconciler until committed (the lease follows the device).
    uncommitted: Mutex<Vec<Uncommitted>>,
}

/// The body of `POST /v1/boards/{id}/fault`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct FaultRequest {
    /// The fault to simulate, one the board's device kind detects (softgpu: `engine`, an
    /// engine thread dies; `vram`, VRAM becomes unusable).
    pub kind: String,
}

/// A fault injected.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FaultInjected {
    /// The board.
    pub board: String,
    /// The fault.
    pub kind: String,
    /// The endpoints whose devices (on the board) simulate it.
    pub endpoints: Vec<String>,
}

impl Failover {
    /// Bookkeeping for a daemon started with fault injection allowed or not.
    pub(crate) fn new(faults_enabled: bool) -> Self {
        Self {
            faults_enabled,
            ..Self::default()
        }
    }

    /// Wakes the reconciler.
    pub(crate) fn wake(&self) {
        *lock(&self.wake) = true;
        self.woken.notify_all();
    }

    /// Keeps a commit the store refused, for the reconciler to retry.
    pub(crate) fn retry_commit(&self, what: Uncommitted) {
        lock(&self.uncommitted).push(what);
    }

    fn wait(&self, timeout: Duration) {
        // A condition variable's wait needs the plain guard: the reconciler's own thread,
        // holding nothing else, waits here.
        let mut woken = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        if !*woken {
            woken = self
                .woken
                .wait_timeout(woken, timeout)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        *woken = false;
    }
}

/// Starts the reconciler thread; it ends with the daemon.
pub(crate) fn spawn_reconciler(daemon: Weak<Daemon>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("sy-failover".into())
        .spawn(move || {
            loop {
                let Some(d) = daemon.upgrade() else { return };
                d.reconcile_failed_boards();
                // After everything the pass did is committed: a reader that sees the count
                // move past a pass that started after its look sees what that pass did.
                d.metrics.failover_pass();
                d.failover.wait(RECONCILE_PERIOD);
            }
        })
        .map(drop)
}

/// What the reconciler did with an endpoint of a failed board.
enum Step {
    /// Failed over.
    Done,
    /// Waits for a free device of its shape.
    Waiting,
    /// Cannot fail over now (said why), or will be looked at again.
    Later,
}

impl Daemon {
    /// A worker of `endpoint` reported its board failed (read from its custody channel by
    /// the supervision thread, which must not wait for the pool's owner): recorded by
    /// [`Daemon::board_failed`] on a thread of the endpoint's own, one report after the other
    /// (a worker that keeps reporting gets no more threads, and a report that one waiting
    /// already makes adds nothing). From now until it is recorded, the endpoint shows its
    /// failover pending, so that what the worker reported before its replacement served is
    /// visible as soon as the replacement is.
    pub(crate) fn board_failure_reported(
        self: Arc<Self>,
        endpoint: &str,
        lease: Option<String>,
        failure: BoardFailure,
    ) {
        let report = (lease, failure);
        {
            let mut recording = lock(&self.failover.recording);
            if let Some(queue) = recording.get_mut(endpoint) {
                // Its recording thread takes it after those before it.
                if queue.len() >= MAX_WAITING_REPORTS {
                    tracing::warn!(
                        endpoint,
                        lease = report.0,
                        reason = report.1.reason,
                        "a board failure report dropped: {MAX_WAITING_REPORTS} of the endpoint's are waiting to be recorded"
                    );
                } else if !queue.iter().skip(1).any(|r| *r == report) {
                    queue.push_back(report);
                }
                return;
            }
            recording.insert(endpoint.to_owned(), VecDeque::from([report]));
        }
        let (this, owned) = (self.clone(), endpoint.to_owned());
        let spawned = std::thread::Builder::new()
            .name("sy-board-failed".into())
            .spawn(move || this.record_reports(&owned));
        if let Err(e) = spawned {
            let lost = lock(&self.failover.recording).remove(endpoint);
            tracing::error!(
                endpoint,
                lease = lost
                    .as_ref()
                    .and_then(|q| q.front())
                    .and_then(|r| r.0.as_deref()),
                "cannot start a thread to record the board failure the endpoint's worker reported: {e}"
            );
        }
    }

    /// Records `endpoint`'s reported board failures ([`Daemon::board_failure_reported`]) in
    /// order, until none is left.
    fn record_reports(&self, endpoint: &str) {
        loop {
            let Some((lease, failure)) = lock(&self.failover.recording)
                .get(endpoint)
                .and_then(|queue| queue.front().cloned())
            else {
                return;
            };
            self.board_failed(endpoint, lease.as_deref(), failure);
            let mut recording = lock(&self.failover.recording);
            let Some(queue) = recording.get_mut(endpoint) else {
                return;
            };
            queue.pop_front();
            if queue.is_empty() {
                recording.remove(endpoint);
                return;
            }
        }
    }

    /// The device of `endpoint` reported its board failed: the pool records it (the board
    /// is quarantined) and the reconciler fails the board's endpoints over. The board is
    /// that of `lease`, the device the reporting worker ran (a report read after a failover
    /// chose another device is about the old one); without it, the endpoint's lease now.
    pub(crate) fn board_failed(&self, endpoint: &str, lease: Option<&str>, failure: BoardFailure) {
        let inventory = self.inventory();
        let device = lease
            .map(str::to_owned)
            .or_else(|| inventory.endpoint(endpoint).and_then(|e| e.device.clone()));
        let Some(board) = device
            .as_deref()
            .and_then(|d| inventory.device(d))
            .map(|d| d.board)
        else {
            tracing::warn!(
                endpoint,
                reason = failure.reason,
                "a board failure of an endpoint without a device; ignored"
            );
            return;
        };
        lock(&self.failover.reported)
            .entry(board.clone())
            .or_insert_with(Instant::now);
        let (b, f) = (board.clone(), failure.clone());
        match self.pool.commit(move |pool| {
            let events = pool.fail_board(&b, f)?;
            Ok((!events.is_empty(), events))
        }) {
            Ok(new) => {
                if new {
                    tracing::error!(%board, endpoint, device, reason = failure.reason, state_intact = failure.state_intact, "board failed");
                }
            }
            Err(e) => {
                tracing::error!(%board, "cannot record the board's failure: {}", error_chain(&e))
            }
        }
        self.failover.wake();
    }

    /// Commits what the store refused before ([`Failover::retry_commit`]).
    fn retry_commits(&self) {
        let pending = std::mem::take(&mut *lock(&self.failover.uncommitted));
        for what in pending {
            let result = match &what {
                Uncommitted::Move(plan) => {
                    let p = plan.clone();
                    self.pool.apply(move |pool| pool.commit_move(&p))
                }
                Uncommitted::Failover(plan, mode, stall) => {
                    let (p, mode, stall) = (plan.clone(), *mode, *stall);
                    self.pool
                        .apply(move |pool| pool.commit_failover(&p, mode, stall))
                }
            };
            match result {
                Ok(()) => tracing::info!(?what, "a commit the store had refused is done"),
                Err(e) => {
                    tracing::error!(?what, "cannot commit yet (retried): {}", error_chain(&e));
                    lock(&self.failover.uncommitted).push(what);
                }
            }
        }
    }

    /// Fails over every endpoint of a failed board that can fail over now.
    fn reconcile_failed_boards(&self) {
        self.retry_commits();
        let leases = self.inventory().failed_leases();
        let mut waiting = 0;
        for lease in leases.iter().filter(|l| !l.moving) {
            if let Step::Waiting = self.fail_over(lease) {
                waiting += 1;
            }
        }
        self.metrics.set_failovers_waiting(waiting);
        // Boards no longer failed (unquarantined) are forgotten, and so are what was said of
        // endpoints no longer on one and the last failover of deleted endpoints.
        let failed: std::collections::BTreeSet<&str> =
            leases.iter().map(|l| l.board.as_str()).collect();
        lock(&self.failover.reported).retain(|b, _| failed.contains(b.as_str()));
        let failing: std::collections::BTreeSet<&str> =
            leases.iter().map(|l| l.endpoint.as_str()).collect();
        lock(&self.failover.said).retain(|e, _| failing.contains(e.as_str()));
        let inventory = self.inventory();
        lock(&self.failover.last).retain(|e, _| inventory.endpoint(e).is_some());
    }

    /// Says once that `lease`'s endpoint cannot fail over now, and why.
    fn say_once(&self, lease: &FailedLease, why: &str, waiting: bool) {
        let mut said = lock(&self.failover.said);
        if said.get(&lease.endpoint).is_some_and(|s| s == why) {
            return;
        }
        said.insert(lease.endpoint.clone(), why.to_owned());
        drop(said);
        tracing::warn!(
            endpoint = lease.endpoint,
            board = lease.board,
            "no failover now: {why}"
        );
        let (endpoint, device, why) =
            (lease.endpoint.clone(), lease.device.clone(), why.to_owned());
        let recorded = self.pool.apply(move |pool| {
            if waiting {
                pool.failover_waiting(&endpoint, &device)
            } else {
                pool.failover_refused(&endpoint, &device, &why)
            }
        });
        if let Err(e) = recorded {
            tracing::error!("cannot record an event: {}", error_chain(&e));
        }
        if !waiting {
            // The device held its failure back for the failover; there will be none now:
            // its client is told (the ERR interrupt), as without a pool.
            if let Err(e) = self.supervisor.failure_unhandled(&lease.endpoint) {
                tracing::warn!(
                    endpoint = lease.endpoint,
                    "cannot have the device signal its failure: {}",
                    error_chain(&e)
                );
            }
        }
    }

    fn fail_over(&self, lease: &FailedLease) -> Step {
        let id = lease.endpoint.as_str();
        let Ok(status) = self.supervisor.status(id) else {
            self.say_once(lease, "no worker of this daemon serves the endpoint", false);
            return Step::Later;
        };
        // A move or a migration of the endpoint ends first (the move may take it off the
        // failed board).
        if status.migrating || self.supervisor.is_moving(id).unwrap_or(false) {
            return Step::Later;
        }
        let transparent = match lease.policy {
            FailoverPolicy::Off => {
                self.say_once(lease, "the pool's failover policy is off", false);
                return Step::Later;
            }
            FailoverPolicy::Transparent => {
                lease.failure.state_intact && self.supervisor.can_continue(id).unwrap_or(false)
            }
            FailoverPolicy::GuestVisible => false,
        };
        let link = self.vmms().get(id).cloned();
        if !transparent {
            let why = match &link {
                None if !lease.failure.state_intact => Some(
                    "the device's state did not outlive the failure and no VMM is registered to plug a fresh device in (`switchyard ctl vmm`)",
                ),
                None => Some(
                    "the failover is guest-visible (the pool's policy, or a device that cannot be recovered) and no VMM is registered to plug a fresh device in (`switchyard ctl vmm`)",
                ),
                Some(_) if self.shape_has_msix(&lease.device) => Some(
                    "the device uses MSI-X: QEMU 11.1 aborts the VM on device_del of a vfio-user device with MSI-X, so it is not unplugged (irq = \"msi\" boards are)",
                ),
                Some(_) => None,
            };
            if let Some(why) = why {
                self.say_once(lease, why, false);
                return Step::Later;
            }
        }
        let owned = id.to_owned();
        let planned = self.pool.commit(move |pool| pool.plan_failover(&owned));
        let plan = match planned {
            Ok(plan) => plan,
            Err(PoolError::NoCompatibleDevice { .. }) => {
                self.say_once(
                    lease,
                    "no device of its shape is free on a healthy board",
                    true,
                );
                return Step::Waiting;
            }
            Err(e) => {
                self.say_once(lease, &error_chain(&e), false);
                return Step::Later;
            }
        };
        lock(&self.failover.said).remove(id);
        crate::knobs::pause("failover-planned");
        // From the failure's report; a failure an earlier daemon recorded, from its time in
        // the store (not from this daemon's plan).
        let reported = lock(&self.failover.reported).get(&lease.board).copied();
        let at = reported
            .or_else(|| {
                let ago = self.failed_ms_ago(&lease.board)?;
                Instant::now().checked_sub(Duration::from_millis(ago))
            })
            .unwrap_or_else(Instant::now);
        let result = match &link {
            Some(link) if !transparent => self.fail_over_visibly(&plan, link),
            _ => self.fail_over_transparently(&plan),
        };
        let mode = if transparent {
            "transparent"
        } else {
            "guest-visible"
        };
        if let Err(error) = result {
            tracing::error!(endpoint = id, mode, "failover failed: {}", error.message);
            self.abort_plan(&plan, "failover");
            self.say_once(
                lease,
                &format!("the failover failed: {}", error.message),
                false,
            );
            return Step::Later;
        }
        let stall = at.elapsed();
        let stall_ms = u64::try_from(stall.as_millis()).unwrap_or(u64::MAX);
        let p = plan.clone();
        if let Err(e) = self
            .pool
            .apply(move |pool| pool.commit_failover(&p, mode, stall_ms))
        {
            // The replacement serves on the target: the lease must follow it.
            tracing::error!(
                ?plan,
                "cannot commit a failover (retried): {}",
                error_chain(&e)
            );
            self.failover
                .retry_commit(Uncommitted::Failover(plan.clone(), mode, stall_ms));
        }
        let pool_name = self
            .inventory()
            .board(&plan.from_board)
            .and_then(|b| b.pool);
        self.metrics
            .failed_over(pool_name.as_deref().unwrap_or(""), mode, stall);
        tracing::warn!(
            endpoint = id,
            from = plan.from,
            to = plan.to,
            mode,
            stall_ms,
            "failed over"
        );
        lock(&self.failover.last).insert(
            id.to_owned(),
            LastFailover {
                from: plan.from.clone(),
                to: plan.to.clone(),
                mode: mode.to_owned(),
                stall_ms: super::super::events::ms(stall),
                at_unix_ms: now_unix_ms(),
            },
        );
        Step::Done
    }

    fn shape_has_msix(&self, device: &str) -> bool {
        self.inventory()
            .device(device)
            .is_some_and(|d| d.shape.profile.msix)
    }

    /// The worker is replaced by one continuing the device on `plan.to`.
    fn fail_over_transparently(&self, plan: &MovePlan) -> Result<(), ApiError> {
        let device = self.target_spec(plan);
        let ready = self
            .supervisor
            .continue_elsewhere(&plan.endpoint, device, Some(plan.to.clone()))
            .map_err(supervisor_error)?;
        crate::knobs::pause("failover-asked");
        self.supervisor
            .wait_ready(&plan.endpoint, ready + 1, READY_TIMEOUT)
            .map_err(supervisor_error)?;
        Ok(())
    }

    /// The VMM unplugs the dead device, a fresh one is built on `plan.to` and plugged into
    /// the same slot.
    fn fail_over_visibly(
        &self,
        plan: &MovePlan,
        vmm: &super::authz::RegisteredVmm,
    ) -> Result<(), ApiError> {
        use switchyard_qemu::VfioUserDevice;
        let id = &plan.endpoint;
        let mut qmp = super::authz::qmp_of(id, vmm)?;
        let link = &vmm.link;
        let socket = self
            .inventory()
            .endpoint(id)
            .map(|e| e.socket.clone())
            .ok_or_else(|| super::unknown_endpoint(id))?;
        qmp.device_del(&link.device_id, UNPLUG_TIMEOUT)
            .map_err(|e| {
                super::authz::vmm_error(id, link, "the guest did not release the dead device", &e)
            })?;
        self.wait_disconnected(id);
        let device = self
            .target_spec(plan)
            .unwrap_or_else(|| self.current_spec(plan));
        let ready = self
            .supervisor
            .start_afresh(id, device, Some(plan.to.clone()))
            .map_err(supervisor_error)?;
        self.supervisor
            .wait_ready(id, ready + 1, READY_TIMEOUT)
            .map_err(supervisor_error)?;
        let mut plug = VfioUserDevice::new(&link.device_id, &socket);
        plug.bus = link.bus.clone();
        if let Err(e) = qmp.device_add(&plug) {
            // The fresh device serves on the new board; the lease follows it.
            tracing::error!(endpoint = id, error = %e, "cannot plug the replacement device in");
        }
        Ok(())
    }

    /// The worker's device spec on `plan.to`, when it differs from the one on `plan.from`
    /// (a spec naming its host resource).
    /// The spec of `plan`'s target device when it differs from its source's (another
    /// kind presenting the same device, another GPU, a passthrough device's address).
    pub(super) fn target_spec(&self, plan: &MovePlan) -> Option<crate::custody::DeviceSpec> {
        let inventory = self.inventory();
        let spec = |d: &str| {
            inventory
                .device(d)
                .map(|d| device_spec(&d.shape, d.host.as_deref()))
        };
        let to = spec(&plan.to)?;
        (spec(&plan.from).as_ref() != Some(&to)).then_some(to)
    }

    fn current_spec(&self, plan: &MovePlan) -> crate::custody::DeviceSpec {
        device_spec(&plan.shape, None)
    }

    /// `POST /v1/boards/{id}/fault`: the devices on `board` simulate the fault `kind`.
    pub(super) fn inject_fault(&self, board: &str, kind: &str) -> Result<FaultInjected, ApiError> {
        if !self.failover.faults_enabled {
            return Err(ApiError::new(
                axum::http::StatusCode::FORBIDDEN,
                "faults_disabled",
                "Fault injection is off: it is for tests and drills, and the daemon must be started with --faults to allow it",
            ));
        }
        // Each endpoint with the device of the board it leases: the fault goes to the
        // worker only while it serves that device.
        let leases: Vec<(String, String)> = {
            let inv = self.inventory();
            let b = inv
                .board(board)
                .ok_or_else(|| pool_error(PoolError::UnknownBoard(board.into())))?;
            b.devices
                .iter()
                .filter_map(|d| Some((d.endpoint.clone()?, d.id.clone())))
                .collect()
        };
        let endpoints: Vec<String> = leases.iter().map(|(e, _)| e.clone()).collect();
        if endpoints.is_empty() {
            return Err(ApiError::conflict(
                "idle_board",
                format!(
                    "No device of board \"{board}\" is leased: a fault needs a running device to be simulated by"
                ),
            ));
        }
        // A move switches the device to another board's memory at a moment the daemon learns
        // only afterwards: a fault now could land on either board.
        if let Some(id) = endpoints
            .iter()
            .find(|id| self.supervisor.is_moving(id).unwrap_or(false))
        {
            return Err(ApiError::conflict(
                "moving",
                format!(
                    "Endpoint \"{id}\" on board \"{board}\" is moving; inject the fault when the move is over"
                ),
            ));
        }
        for (id, device) in &leases {
            self.supervisor
                .inject_fault(id, kind, Some(device), FAULT_TIMEOUT)
                .map_err(|e| ApiError::conflict("fault_refused", error_chain(&e)))?;
        }
        Ok(FaultInjected {
            board: board.to_owned(),
            kind: kind.to_owned(),
            endpoints,
        })
    }

    /// How long ago (ms) the store recorded `board`'s last failure, from its event history
    /// (the last 4096 events).
    pub(crate) fn failed_ms_ago(&self, board: &str) -> Option<u64> {
        let board = board.to_owned();
        let at = self.pool.run(move |pool, _| {
            let since = pool.inventory().next_seq().saturating_sub(4096);
            let events = pool.history(since, 4096).ok()?;
            events.iter().rev().find_map(|e| match &e.kind {
                switchyard_pool::EventKind::BoardFailed { board: b, .. } if *b == board => {
                    Some(e.at_unix_ms)
                }
                _ => None,
            })
        })?;
        Some(now_unix_ms().saturating_sub(at))
    }

    /// A failover an earlier daemon left in progress (its target reserved) whose worker was
    /// adopted continuing the device on the target (it had re-executed there): committed,
    /// as that daemon would have. Returns whether it was.
    pub(crate) fn commit_adopted_failover(&self, plan: &MovePlan) -> bool {
        let stall_ms = self.failed_ms_ago(&plan.from_board).unwrap_or(0);
        let p = plan.clone();
        match self
            .pool
            .apply(move |pool| pool.commit_failover(&p, "transparent", stall_ms))
        {
            Ok(()) => {
                let pool_name = self
                    .inventory()
                    .board(&plan.from_board)
                    .and_then(|b| b.pool);
                let stall = Duration::from_millis(stall_ms);
                self.metrics
                    .failed_over(pool_name.as_deref().unwrap_or(""), "transparent", stall);
                lock(&self.failover.last).insert(
                    plan.endpoint.clone(),
                    LastFailover {
                        from: plan.from.clone(),
                        to: plan.to.clone(),
                        mode: "transparent".to_owned(),
                        stall_ms: super::super::events::ms(stall),
                        at_unix_ms: now_unix_ms(),
                    },
                );
                tracing::warn!(
                    endpoint = plan.endpoint,
                    from = plan.from,
                    to = plan.to,
                    stall_ms,
                    "a failover an earlier daemon left in progress: its worker continues on the target; committed"
                );
                true
            }
            Err(e) => {
                tracing::error!(
                    ?plan,
                    "cannot commit an adopted failover: {}",
                    error_chain(&e)
                );
                false
            }
        }
    }

    /// `POST /v1/boards/{id}/quarantine` (`on`) or `.../unquarantine`. Unquarantining a
    /// failed board declares it repaired: the endpoints still leasing its devices (waiting,
    /// degraded, for a free device elsewhere) get a replacement worker there, which rebuilds
    /// the device on the repaired board (continuing its state from custody when it can):
    /// clearing the failure alone would leave their dead devices shown healthy. Endpoints
    /// waiting elsewhere are looked at again at once (a device may be free now).
    pub(super) fn set_quarantine(
        &self,
        board: &str,
        on: bool,
    ) -> Result<switchyard_pool::BoardView, ApiError> {
        let repaired: Vec<String> = if on {
            Vec::new()
        } else {
            self.inventory()
                .failed_leases()
                .into_iter()
                .filter(|l| l.board == board)
                .map(|l| l.endpoint)
                .collect()
        };
        let b = board.to_owned();
        self.pool
            .apply(move |pool| {
                if on {
                    pool.quarantine(&b)
                } else {
                    pool.unquarantine(&b)
                }
            })
            .map_err(pool_error)?;
        for id in &repaired {
            // The supervisor replaces the worker; its device is built anew on the board.
            lock(&self.failover.said).remove(id);
            match self.supervisor.kill_worker(id) {
                Ok(pid) => tracing::warn!(
                    endpoint = id,
                    board,
                    ?pid,
                    "the board is repaired: the endpoint's worker is replaced to rebuild its device"
                ),
                Err(e) => tracing::error!(
                    endpoint = id,
                    board,
                    "cannot replace the worker of a repaired board's endpoint: {}",
                    error_chain(&e)
                ),
            }
        }
        self.failover.wake();
        self.inventory()
            .board(board)
            .ok_or_else(|| pool_error(PoolError::UnknownBoard(board.into())))
    }

    /// The endpoint's failover, for its status.
    pub(super) fn failover_view(
        &self,
        inventory: &switchyard_pool::Inventory,
        id: &str,
    ) -> Option<FailoverView> {
        let pending = lock(&self.failover.said).get(id).cloned();
        let failed = inventory
            .failed_leases()
            .into_iter()
            .any(|l| l.endpoint == id);
        // A failure reported and not recorded yet is pending too.
        let recording = lock(&self.failover.recording).contains_key(id);
        let pending =
            (failed || recording).then(|| pending.unwrap_or_else(|| "failing over".to_owned()));
        let last = lock(&self.failover.last).get(id).cloned();
        (pending.is_some() || last.is_some()).then_some(FailoverView { pending, last })
    }
}

fn now_unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}
