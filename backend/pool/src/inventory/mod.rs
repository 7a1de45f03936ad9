//! The in-memory model: boards, devices, pools, endpoints and leases, and the operations on
//! them. Every operation checks everything first and changes nothing when it refuses.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use switchyard_device::kind::KindCatalog;

use crate::board::{BoardRecord, Snapshot};
use crate::config::{FailoverPolicy, PoolConfig};
use crate::error::PoolError;
use crate::event::{Event, EventKind};
use crate::shape::{DeviceShape, DirtyTracking};
use crate::view::{
    BoardState, BoardView, DeviceView, Endpoint, EndpointSpec, MAX_SOCKET_PATH, MovePlan,
    Placement, PoolView, Requirements, valid_id,
};

mod failover;
pub use failover::FailedLease;
mod restore;

/// The plan of moving `endpoint`'s lease from `from` to `to`.
fn move_plan(endpoint: &str, from: Dev<'_>, to: Dev<'_>) -> MovePlan {
    MovePlan {
        endpoint: endpoint.into(),
        from: from.id.into(),
        from_board: from.board.def.id.clone(),
        to: to.id.into(),
        to_board: to.board.def.id.clone(),
        shape: from.shape.clone(),
    }
}

/// A device found by id.
#[derive(Debug, Clone, Copy)]
struct Dev<'a> {
    id: &'a str,
    board: &'a BoardRecord,
    shape: &'a DeviceShape,
}

/// The pool's state in memory: boards (with their devices), pools, endpoints and leases.
///
/// Mutations return the [`Event`]s they produced; a refused mutation returns an error and
/// changes nothing. [`Pool`](crate::Pool) wraps this with the store.
#[derive(Debug, Clone)]
pub struct Inventory {
    endpoint_dir: PathBuf,
    /// Configuration order, then missing boards by id.
    boards: Vec<BoardRecord>,
    pools: Vec<(String, Vec<String>)>,
    /// Each pool's failover policy (`[[pools]] failover`).
    failover: BTreeMap<String, FailoverPolicy>,
    endpoints: BTreeMap<String, Endpoint>,
    next_seq: u64,
}

pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Inventory {
    /// An inventory of a configuration's boards and pools, without endpoints (see
    /// [`Inventory::from_config`] for the configured endpoints). The configuration is
    /// validated, each board's options checked by its kind in `kinds`.
    pub fn new(config: &PoolConfig, kinds: &dyn KindCatalog) -> Result<Self, PoolError> {
        let defs = config.check(kinds)?;
        Ok(Self {
            endpoint_dir: config.daemon.endpoint_dir.clone(),
            boards: defs
                .into_iter()
                .map(|def| BoardRecord {
                    def,
                    quarantined: false,
                    missing: false,
                    failed: None,
                })
                .collect(),
            pools: config
                .pools
                .iter()
                .map(|p| (p.name.clone(), p.boards.clone()))
                .collect(),
            failover: config
                .pools
                .iter()
                .map(|p| (p.name.clone(), p.failover))
                .collect(),
            endpoints: BTreeMap::new(),
            next_seq: 1,
        })
    }

    // ---- queries ----

    /// Every board with its devices and their holders, in configuration order (missing
    /// boards last).
    pub fn boards(&self) -> Vec<BoardView> {
        self.boards.iter().map(|b| self.board_view(b)).collect()
    }

    /// One board.
    pub fn board(&self, id: &str) -> Option<BoardView> {
        self.board_record(id).map(|b| self.board_view(b))
    }

    /// One device (a whole board without partitions, or a partition).
    pub fn device(&self, id: &str) -> Option<DeviceView> {
        self.dev(id).map(|d| self.device_view(d))
    }

    /// Every pool with its capacity.
    pub fn pools(&self) -> Vec<PoolView> {
        self.pools
            .iter()
            .map(|(name, boards)| {
                let devs: Vec<Dev<'_>> = boards
                    .iter()
                    .filter_map(|b| self.board_record(b))
                    .flat_map(|b| self.devs_of(b))
                    .collect();
                PoolView {
                    name: name.clone(),
                    boards: boards.clone(),
                    devices: devs.len(),
                    free: devs
                        .iter()
                        .filter(|d| {
                            d.board.state() == BoardState::Available && self.holder(d.id).is_none()
                        })
                        .count(),
                }
            })
            .collect()
    }

    /// Every endpoint, by id.
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.values()
    }

    /// Where endpoint sockets go by default (`[daemon] endpoint_dir`).
    pub fn endpoint_dir(&self) -> &std::path::Path {
        &self.endpoint_dir
    }

    /// One endpoint.
    pub fn endpoint(&self, id: &str) -> Option<&Endpoint> {
        self.endpoints.get(id)
    }

    /// The move in progress of an endpoint, e.g. to finish or abort it after a restart.
    pub fn pending_move(&self, endpoint: &str) -> Option<MovePlan> {
        let e = self.endpoints.get(endpoint)?;
        let (from, to) = (
            self.dev(e.device.as_deref()?)?,
            self.dev(e.moving_to.as_deref()?)?,
        );
        Some(MovePlan {
            endpoint: e.id.clone(),
            from: from.id.into(),
            from_board: from.board.def.id.clone(),
            to: to.id.into(),
            to_board: to.board.def.id.clone(),
            shape: from.shape.clone(),
        })
    }

    /// Every move in progress.
    pub fn pending_moves(&self) -> Vec<MovePlan> {
        self.endpoints
            .keys()
            .filter_map(|e| self.pending_move(e))
            .collect()
    }

    /// The sequence number the next event will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    // ---- mutations ----

    /// A [`EventKind::SeqMark`] (no state changes): the daemon numbers its worker events
    /// after it.
    pub fn seq_mark(&mut self, worker_events: u64) -> Vec<Event> {
        vec![self.emit(EventKind::SeqMark { worker_events })]
    }

    /// Creates an endpoint leasing the first free device of `spec.pool` (boards in pool
    /// order, partitions in board order) on an available board that meets the requirements,
    /// or the named `spec.device`. Its owner is root; it gets a new migration token
    /// ([`Inventory::create_endpoint_as`] for another owner or a given token).
    pub fn create_endpoint(&mut self, spec: &EndpointSpec) -> Result<Vec<Event>, PoolError> {
        let token = crate::new_migration_token()?;
        self.create_endpoint_as(spec, 0, &token)
    }

    /// [`Inventory::create_endpoint`] for the user `owner_uid` (its [`Endpoint::owner_uid`]),
    /// with the migration token `token` (made beforehand with
    /// [`new_migration_token`](crate::new_migration_token): a check on a copy and its
    /// commit then create the same endpoint).
    pub fn create_endpoint_as(
        &mut self,
        spec: &EndpointSpec,
        owner_uid: u32,
        token: &str,
    ) -> Result<Vec<Event>, PoolError> {
        if !valid_id(&spec.id) {
            return Err(PoolError::BadId(spec.id.clone()));
        }
        if let Some(holder) = self.id_holder(&spec.id) {
            return Err(PoolError::DuplicateId {
                id: spec.id.clone(),
                holder,
            });
        }
        let socket = match &spec.socket {
            Some(s) => s.clone(),
            None => self.endpoint_dir.join(format!("{}.sock", spec.id)),
        };
        self.check_socket(&socket)?;
        let requirements = Requirements {
            min_vram: spec.min_vram.unwrap_or(0),
            min_queues: spec.min_queues.unwrap_or(0),
        };
        // Neither: the pool, when there is only one.
        let only_pool = match (&spec.pool, &spec.device, self.pools.as_slice()) {
            (None, None, [(name, _)]) => Some(name.clone()),
            _ => None,
        };
        let pool_name = spec.pool.clone().or(only_pool);
        let device = match (&pool_name, &spec.device) {
            (Some(_), Some(_)) => return Err(PoolError::BadPlacement(", not both")),
            (None, None) => return Err(PoolError::BadPlacement("")),
            (Some(pool), None) => self.select(pool, &requirements)?,
            (None, Some(device)) => self.check_leasable(device, &requirements)?.id.to_owned(),
        };
        let endpoint = Endpoint {
            id: spec.id.clone(),
            socket: socket.clone(),
            requirements,
            pool: pool_name,
            device: Some(device.clone()),
            moving_to: None,
            created_unix_ms: now_unix_ms(),
            owner_uid,
            migration_token: token.to_owned(),
        };
        self.endpoints.insert(spec.id.clone(), endpoint);
        Ok(vec![self.emit(EventKind::EndpointCreated {
            endpoint: spec.id.clone(),
            device: Some(device),
            socket: socket.to_string_lossy().into_owned(),
        })])
    }

    /// Deletes an endpoint, freeing its device. Refused while a move is in progress.
    pub fn delete_endpoint(&mut self, id: &str) -> Result<Vec<Event>, PoolError> {
        let e = self.endpoint_checked(id)?;
        self.no_move(e)?;
        let device = e.device.clone();
        self.endpoints.remove(id);
        Ok(vec![self.emit(EventKind::EndpointDeleted {
            endpoint: id.into(),
            device,
        })])
    }

    /// Checks a move of `endpoint`'s lease to `to` without reserving anything: the endpoint
    /// holds a device and has no move in progress; `to` is another device, free, on an
    /// available board, and of the same shape (model and options: a move must not change
    /// what the guest sees); the device's kind can move it ([`Profile::movable`]).
    ///
    /// [`Profile::movable`]: switchyard_device::kind::Profile::movable
    pub fn check_move(&self, endpoint: &str, to: &str) -> Result<MovePlan, PoolError> {
        let e = self.endpoint_checked(endpoint)?;
        self.no_move(e)?;
        let Some(from) = e.device.as_deref() else {
            return Err(PoolError::NotLeased(endpoint.into()));
        };
        if from == to {
            return Err(PoolError::SameDevice {
                endpoint: endpoint.into(),
                device: to.into(),
            });
        }
        let from = self.dev_checked(from)?;
        let target = self.dev_checked(to)?;
        if !from.shape.profile.movable {
            return Err(PoolError::NotMovable {
                endpoint: endpoint.into(),
                device: from.id.into(),
                model: from.shape.model.clone(),
            });
        }
        // The shape first: an incompatible target is wrong whatever its state.
        if let Some(difference) = target.shape.difference(from.shape) {
            return Err(PoolError::ShapeMismatch {
                from: from.id.into(),
                to: to.into(),
                difference,
            });
        }
        let target = self.check_leasable(to, &Requirements::default())?;
        Ok(move_plan(endpoint, from, target))
    }

    /// Checks a move (as [`Inventory::check_move`]) and reserves the target for it: no other
    /// endpoint can lease it until [`Inventory::commit_move`] or [`Inventory::abort_move`].
    /// The data path moves the device between the two.
    pub fn plan_move(
        &mut self,
        endpoint: &str,
        to: &str,
    ) -> Result<(MovePlan, Vec<Event>), PoolError> {
        let plan = self.check_move(endpoint, to)?;
        let event = self.start_move(&plan);
        Ok((plan, vec![event]))
    }

    /// Commits a planned move: the endpoint's lease becomes `plan.to`, `plan.from` is freed.
    /// Refused (changing nothing) unless exactly this move is in progress.
    pub fn commit_move(&mut self, plan: &MovePlan) -> Result<Vec<Event>, PoolError> {
        self.check_pending(plan)?;
        if let Some(e) = self.endpoints.get_mut(&plan.endpoint) {
            e.device = Some(plan.to.clone());
            e.moving_to = None;
        }
        Ok(vec![self.emit(EventKind::LeaseMoved {
            endpoint: plan.endpoint.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
        })])
    }

    /// Abandons a planned move: the endpoint keeps `plan.from`, `plan.to` is free again.
    pub fn abort_move(&mut self, plan: &MovePlan) -> Result<Vec<Event>, PoolError> {
        self.check_pending(plan)?;
        if let Some(e) = self.endpoints.get_mut(&plan.endpoint) {
            e.moving_to = None;
        }
        Ok(vec![self.emit(EventKind::MoveAborted {
            endpoint: plan.endpoint.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
        })])
    }

    /// Releases an endpoint's device; the endpoint stays, without a device.
    pub fn detach(&mut self, endpoint: &str) -> Result<Vec<Event>, PoolError> {
        let e = self.endpoint_checked(endpoint)?;
        self.no_move(e)?;
        let Some(device) = e.device.clone() else {
            return Err(PoolError::NotLeased(endpoint.into()));
        };
        if let Some(e) = self.endpoints.get_mut(endpoint) {
            e.device = None;
        }
        Ok(vec![self.emit(EventKind::Detached {
            endpoint: endpoint.into(),
            device,
        })])
    }

    /// Leases a device to a detached endpoint: the named device, the first fitting device of
    /// the named pool, or (neither given) of the endpoint's own pool. The endpoint's
    /// requirements apply.
    pub fn attach(&mut self, endpoint: &str, to: &Placement) -> Result<Vec<Event>, PoolError> {
        let e = self.endpoint_checked(endpoint)?;
        if let Some(device) = &e.device {
            return Err(PoolError::AlreadyLeased {
                endpoint: endpoint.into(),
                device: device.clone(),
            });
        }
        let (device, pool) = match (&to.pool, &to.device) {
            (Some(_), Some(_)) => return Err(PoolError::BadPlacement(", not both")),
            (None, Some(d)) => (
                self.check_leasable(d, &e.requirements)?.id.to_owned(),
                e.pool.clone(),
            ),
            (Some(p), None) => (self.select(p, &e.requirements)?, Some(p.clone())),
            (None, None) => match &e.pool {
                Some(p) => (self.select(p, &e.requirements)?, Some(p.clone())),
                None => {
                    return Err(PoolError::BadPlacement(
                        " (the endpoint was created on a device, so it has no pool)",
                    ));
                }
            },
        };
        if let Some(e) = self.endpoints.get_mut(endpoint) {
            e.device = Some(device.clone());
            e.pool = pool;
        }
        Ok(vec![self.emit(EventKind::Attached {
            endpoint: endpoint.into(),
            device,
        })])
    }

    /// Plans moving every endpoint off `board` (including its partitions) to free devices of
    /// the same shape on other available boards, preferring the board's own pool, without
    /// reserving anything. Refused as a whole when any endpoint cannot move (or has a move in
    /// progress, to or from the board).
    pub fn plan_drain(&self, board: &str) -> Result<Vec<MovePlan>, PoolError> {
        let record = self
            .board_record(board)
            .ok_or_else(|| PoolError::UnknownBoard(board.into()))?;
        let on_board: BTreeSet<&str> = record.def.devices().map(|(id, _)| id).collect();
        let order = self.boards_to_leave(board);
        let mut taken: HashSet<String> = HashSet::new();
        let mut plans = Vec::new();
        for e in self.endpoints.values() {
            let moving_in = e.moving_to.as_deref().is_some_and(|d| on_board.contains(d));
            let leased_here = e.device.as_deref().is_some_and(|d| on_board.contains(d));
            if !moving_in && !leased_here {
                continue;
            }
            let refuse = |reason: PoolError| PoolError::DrainRefused {
                board: board.into(),
                endpoint: e.id.clone(),
                reason: Box::new(reason),
            };
            self.no_move(e).map_err(refuse)?;
            let from = e.device.as_deref().unwrap_or_default();
            let shape = self
                .dev(from)
                .map(|d| d.shape)
                .ok_or_else(|| refuse(PoolError::UnknownDevice(from.into())))?;
            let target = order
                .iter()
                .filter(|r| r.state() == BoardState::Available)
                .flat_map(|r| self.devs_of(r))
                .find(|d| {
                    d.shape.difference(shape).is_none()
                        && self.holder(d.id).is_none()
                        && !taken.contains(d.id)
                })
                .ok_or_else(|| {
                    refuse(PoolError::NoCompatibleDevice {
                        device: from.into(),
                    })
                })?;
            taken.insert(target.id.to_owned());
            plans.push(self.check_move(&e.id, target.id).map_err(refuse)?);
        }
        Ok(plans)
    }

    /// Drains a board: plans as [`Inventory::plan_drain`], then in one step quarantines the
    /// board and starts every move (targets reserved). The data path then moves each
    /// endpoint and commits or aborts each plan.
    pub fn drain(&mut self, board: &str) -> Result<(Vec<MovePlan>, Vec<Event>), PoolError> {
        let plans = self.plan_drain(board)?;
        let mut events = self.quarantine(board)?;
        events.push(self.emit(EventKind::DrainStarted {
            board: board.into(),
            moves: plans.clone(),
        }));
        for plan in &plans {
            let event = self.start_move(plan);
            events.push(event);
        }
        Ok((plans, events))
    }

    /// Stops new leases on a board (and its partitions); existing leases stay until moved.
    /// Quarantining a quarantined board changes nothing and reports no event.
    pub fn quarantine(&mut self, board: &str) -> Result<Vec<Event>, PoolError> {
        self.set_quarantine(board, true)
    }

    /// Lets a quarantined board take leases again.
    pub fn unquarantine(&mut self, board: &str) -> Result<Vec<Event>, PoolError> {
        self.set_quarantine(board, false)
    }

    /// What the store keeps.
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot {
            boards: self
                .boards
                .iter()
                .map(|b| (b.def.id.clone(), b.clone()))
                .collect(),
            endpoints: self.endpoints.clone(),
            next_seq: self.next_seq,
            outdated: Default::default(),
        }
    }

    // ---- helpers ----

    fn emit(&mut self, kind: EventKind) -> Event {
        let seq = self.next_seq;
        self.next_seq += 1;
        Event {
            seq,
            at_unix_ms: now_unix_ms(),
            kind,
        }
    }

    fn start_move(&mut self, plan: &MovePlan) -> Event {
        if let Some(e) = self.endpoints.get_mut(&plan.endpoint) {
            e.moving_to = Some(plan.to.clone());
        }
        self.emit(EventKind::MoveStarted {
            endpoint: plan.endpoint.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
        })
    }

    fn set_quarantine(&mut self, board: &str, on: bool) -> Result<Vec<Event>, PoolError> {
        let record = self
            .boards
            .iter_mut()
            .find(|b| b.def.id == board)
            .ok_or_else(|| PoolError::UnknownBoard(board.into()))?;
        if record.quarantined == on {
            return Ok(Vec::new());
        }
        record.quarantined = on;
        if !on {
            // Taking leases again says the board is repaired.
            record.failed = None;
        }
        let board = board.to_owned();
        Ok(vec![self.emit(if on {
            EventKind::BoardQuarantined { board }
        } else {
            EventKind::BoardReleased { board }
        })])
    }

    /// The boards an endpoint leaving `board` may go to, in the order they are preferred:
    /// the board's own pool first, then the other pools, then boards in no pool.
    fn boards_to_leave(&self, board: &str) -> Vec<&BoardRecord> {
        let own: Vec<&str> = self
            .pool_of(board)
            .map(|p| self.pool_boards(p).collect())
            .unwrap_or_default();
        let pooled = self
            .pools
            .iter()
            .flat_map(|(_, boards)| boards.iter().map(String::as_str));
        let all = self.boards.iter().map(|r| r.def.id.as_str());
        let mut order: Vec<&BoardRecord> = Vec::new();
        for id in own.into_iter().chain(pooled).chain(all) {
            if id != board
                && !order.iter().any(|o| o.def.id == id)
                && let Some(r) = self.board_record(id)
            {
                order.push(r);
            }
        }
        order
    }

    fn board_record(&self, id: &str) -> Option<&BoardRecord> {
        self.boards.iter().find(|b| b.def.id == id)
    }

    fn devs_of<'a>(&'a self, b: &'a BoardRecord) -> impl Iterator<Item = Dev<'a>> + 'a {
        b.def.devices().map(move |(id, shape)| Dev {
            id,
            board: b,
            shape,
        })
    }

    fn dev(&self, id: &str) -> Option<Dev<'_>> {
        self.boards
            .iter()
            .flat_map(|b| self.devs_of(b))
            .find(|d| d.id == id)
    }

    fn pool_of(&self, board: &str) -> Option<&str> {
        self.pools
            .iter()
            .find(|(_, boards)| boards.iter().any(|b| b == board))
            .map(|(name, _)| name.as_str())
    }

    fn pool_boards(&self, pool: &str) -> impl Iterator<Item = &str> {
        self.pools
            .iter()
            .filter(move |(name, _)| name == pool)
            .flat_map(|(_, boards)| boards.iter().map(String::as_str))
    }

    /// The endpoint leasing or reserving a device.
    fn holder(&self, device: &str) -> Option<&Endpoint> {
        self.endpoints
            .values()
            .find(|e| e.device.as_deref() == Some(device) || e.moving_to.as_deref() == Some(device))
    }

    /// What already uses an id, in the one namespace of endpoints, boards, partitions and
    /// pools.
    fn id_holder(&self, id: &str) -> Option<String> {
        if self.endpoints.contains_key(id) {
            return Some(format!("endpoint \"{id}\""));
        }
        for b in &self.boards {
            if b.def.id == id {
                return Some(format!("board \"{id}\""));
            }
            if b.def.partitions.iter().any(|p| p.id == id) {
                return Some(format!("a partition of board \"{}\"", b.def.id));
            }
        }
        self.pools
            .iter()
            .any(|(name, _)| name == id)
            .then(|| format!("pool \"{id}\""))
    }

    fn check_socket(&self, socket: &std::path::Path) -> Result<(), PoolError> {
        let bad = |reason| {
            Err(PoolError::BadSocketPath {
                path: socket.into(),
                reason,
            })
        };
        if !socket.is_absolute() {
            return bad("a socket path must be absolute");
        }
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return bad("longer than the 107 bytes a UNIX socket path can have");
        }
        if socket.as_os_str().as_encoded_bytes().contains(&0) {
            return bad("it contains a NUL byte");
        }
        if self.endpoints.values().any(|e| e.socket == socket) {
            return bad("another endpoint uses it");
        }
        Ok(())
    }

    fn endpoint_checked(&self, id: &str) -> Result<&Endpoint, PoolError> {
        self.endpoints
            .get(id)
            .ok_or_else(|| PoolError::UnknownEndpoint(id.into()))
    }

    fn no_move(&self, e: &Endpoint) -> Result<(), PoolError> {
        match &e.moving_to {
            Some(to) => Err(PoolError::MoveInProgress {
                endpoint: e.id.clone(),
                to: to.clone(),
            }),
            None => Ok(()),
        }
    }

    /// A device an endpoint with `req` may lease now.
    fn check_leasable(&self, device: &str, req: &Requirements) -> Result<Dev<'_>, PoolError> {
        let d = self.dev_checked(device)?;
        if let Some(holder) = self.holder(device) {
            return Err(PoolError::DeviceBusy {
                device: device.into(),
                endpoint: holder.id.clone(),
            });
        }
        let state = d.board.state();
        if state != BoardState::Available {
            return Err(PoolError::BoardUnavailable {
                device: device.into(),
                board: d.board.def.id.clone(),
                state,
            });
        }
        d.shape
            .meets(req)
            .map_err(|detail| PoolError::RequirementsNotMet {
                device: device.into(),
                detail,
            })?;
        Ok(d)
    }

    fn dev_checked(&self, device: &str) -> Result<Dev<'_>, PoolError> {
        self.dev(device).ok_or_else(|| {
            if self.board_record(device).is_some() {
                PoolError::NotLeasable(device.into())
            } else {
                PoolError::UnknownDevice(device.into())
            }
        })
    }

    /// The first free device of `pool` on an available board meeting `req`.
    fn select(&self, pool: &str, req: &Requirements) -> Result<String, PoolError> {
        if !self.pools.iter().any(|(name, _)| name == pool) {
            return Err(PoolError::UnknownPool(pool.into()));
        }
        self.pool_boards(pool)
            .filter_map(|b| self.board_record(b))
            .filter(|b| b.state() == BoardState::Available)
            .flat_map(|b| self.devs_of(b))
            .find(|d| self.holder(d.id).is_none() && d.shape.meets(req).is_ok())
            .map(|d| d.id.to_owned())
            .ok_or_else(|| PoolError::NoCapacity {
                pool: pool.into(),
                min_vram: req.min_vram,
                min_queues: req.min_queues,
            })
    }

    fn check_pending(&self, plan: &MovePlan) -> Result<(), PoolError> {
        let e = self.endpoint_checked(&plan.endpoint)?;
        if e.device.as_deref() != Some(plan.from.as_str())
            || e.moving_to.as_deref() != Some(plan.to.as_str())
        {
            return Err(PoolError::NoSuchMove {
                endpoint: plan.endpoint.clone(),
                from: plan.from.clone(),
                to: plan.to.clone(),
            });
        }
        Ok(())
    }

    fn board_view(&self, b: &BoardRecord) -> BoardView {
        BoardView {
            id: b.def.id.clone(),
            shape: b.def.shape.clone(),
            state: b.state(),
            pool: self.pool_of(&b.def.id).map(str::to_owned),
            devices: self.devs_of(b).map(|d| self.device_view(d)).collect(),
            host: b.def.shape.profile.exclusive.clone(),
            dirty_tracking: DirtyTracking::of(&b.def.shape.profile),
            failed: b.failed.clone(),
        }
    }

    fn device_view(&self, d: Dev<'_>) -> DeviceView {
        let lessee = self
            .endpoints
            .values()
            .find(|e| e.device.as_deref() == Some(d.id));
        let mover = self
            .endpoints
            .values()
            .find(|e| e.moving_to.as_deref() == Some(d.id));
        DeviceView {
            id: d.id.into(),
            board: d.board.def.id.clone(),
            partition: d.id != d.board.def.id,
            shape: d.shape.clone(),
            state: d.board.state(),
            endpoint: lessee.map(|e| e.id.clone()),
            reserved_for: mover.map(|e| e.id.clone()),
            host: d.shape.profile.exclusive.clone(),
        }
    }
}
