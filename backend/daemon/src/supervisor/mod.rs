//! The supervisor: for each endpoint, the listening socket, a worker process serving it, and
//! a duplicate of every descriptor the worker put into custody. When a worker dies (a crash,
//! `kill -9`, an upgrade), a replacement starts with the same descriptors and resumes the
//! connection; the guest sees a stall.

mod access;
mod adopt;
mod common;
mod failover;
mod handover;
mod launch;
mod ledger;
mod migration;
mod plan;
mod sink;
mod sync;

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use switchyard_server::DeviceSocket;

use crate::custody::{
    self, BLACK_BOX_ID, CONNECTION_ID, DeviceSpec, LastMove, MoveReport, Note, StartMode,
};

pub use access::SocketAccess;
use launch::{Launch, supervise};
pub use plan::FdPlan;
pub use sink::{EventSink, WorkerEvent, WorkerSignal};

/// Supervisor errors.
#[derive(Debug, thiserror::Error)]
pub enum SupervisorError {
    /// An endpoint of that name exists.
    #[error("Endpoint `{0}` already exists")]
    Exists(String),
    /// No endpoint of that name.
    #[error("No endpoint `{0}`")]
    NotFound(String),
    /// Binding the endpoint's socket failed.
    #[error("Cannot bind the socket of endpoint `{0}`")]
    Bind(String, #[source] switchyard_server::ServerError),
    /// Starting a thread or process failed.
    #[error("Cannot start the worker of endpoint `{0}`")]
    Spawn(String, #[source] std::io::Error),
    /// The endpoint is moving already.
    #[error("Endpoint `{0}` is being moved already")]
    Moving(String),
    /// No worker serves the endpoint right now (it is restarting, or was given up).
    #[error("No worker serves endpoint `{0}` right now")]
    NoWorker(String),
    /// A running worker could not be adopted.
    #[error("Cannot adopt worker {pid} of endpoint `{endpoint}`: {reason}")]
    Adopt {
        /// Endpoint.
        endpoint: String,
        /// The worker's pid.
        pid: u32,
        /// Why.
        reason: String,
    },
    /// One more endpoint would break the daemon's descriptor plan ([`FdPlan`]).
    #[error(
        "No room for endpoint `{endpoint}`: {endpoints} endpoints of {per_endpoint} client descriptors each (plus {own} of their own) and {reserve} kept for the daemon fill its open-file limit of {limit}"
    )]
    NoRoom {
        /// Endpoint.
        endpoint: String,
        /// Endpoints supervised now (the most the plan allows).
        endpoints: u64,
        /// Client descriptors per endpoint.
        per_endpoint: u32,
        /// The endpoint's own descriptors (listener, connection, VRAM, black box, ...).
        own: u32,
        /// Kept for the daemon itself.
        reserve: u32,
        /// The daemon's open-file limit.
        limit: u64,
    },
    /// The worker did not inject the fault.
    #[error("Endpoint `{endpoint}`: the fault was not injected: {reason}")]
    FaultFailed {
        /// Endpoint.
        endpoint: String,
        /// The worker's error, or what happened to the worker.
        reason: String,
    },
    /// The worker did not say how far its custody notes go ([`Supervisor::sync`]).
    #[error("Endpoint `{endpoint}`: custody not synced: {reason}")]
    SyncFailed {
        /// Endpoint.
        endpoint: String,
        /// What happened.
        reason: String,
    },
    /// The worker refused or failed the move; the device runs where it was.
    #[error("Endpoint `{endpoint}` was not moved: {reason}")]
    MoveFailed {
        /// Endpoint.
        endpoint: String,
        /// The worker's error chain, or what happened to the worker.
        reason: String,
    },
}

/// How a move ended ([`Supervisor::move_device`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MoveOutcome {
    /// The worker moved the device.
    Moved(MoveReport),
    /// The worker died during the move and its replacement runs the device on the new
    /// VRAM (no report: the final copy had been done).
    MovedAcrossRestart,
}

/// What an endpoint serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndpointSpec {
    /// Name.
    pub id: String,
    /// vfio-user socket path.
    pub socket: PathBuf,
    /// The device to serve.
    pub device: crate::custody::DeviceSpec,
    /// The daemon fails the endpoint over when its board fails ([`Note::Start`]'s
    /// `failover`).
    ///
    /// [`Note::Start`]: crate::custody::Note::Start
    pub failover: bool,
    /// The lease the worker serves (the pool's device id), if the caller has one: named in
    /// the worker's failure reports ([`WorkerSignal::BoardFailed`]'s `lease`) and checked by
    /// [`Supervisor::inject_fault`].
    pub lease: Option<String>,
    /// Its migration streams' origin tokens ([`Note::Start`]'s `migration`; the idle
    /// timeout, unless set here, is the supervisor's:
    /// [`Supervisor::with_migration_idle_timeout`]).
    ///
    /// [`Note::Start`]: crate::custody::Note::Start
    pub migration: crate::custody::MigrationSettings,
}

/// How an endpoint's worker is doing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerStatus {
    /// Process id of the current worker, if one runs.
    pub pid: Option<u32>,
    /// Workers started after the first (restarts, upgrades).
    pub restarts: u64,
    /// Workers that reported ready.
    pub ready: u64,
    /// From the death of the last worker to its replacement reporting ready.
    pub last_restart: Option<Duration>,
    /// Descriptors held for the endpoint (listener included).
    pub held: usize,
    /// Of those, the client's: DMA memory fds, interrupt eventfds and the descriptors of
    /// messages in flight (what the budget counts).
    pub client_fds: usize,
    /// Descriptors a worker tried to put in custody past the endpoint's budget (refused:
    /// a worker keeps its client within the budget, so this stays 0 unless one does not).
    pub refused_fds: u64,
    /// What a replacement could not restore of the client's state (DMA windows, eventfds
    /// the client had been told succeeded); empty when whole.
    pub state_lost: Vec<String>,
    /// A client (VMM) is connected: its connection is held.
    pub connected: bool,
    /// The supervisor gave up restarting (a crash loop); the client was disconnected.
    pub failed: bool,
    /// The client has a migration stream of the device open: restarts and upgrades wait.
    pub migrating: bool,
    /// The kernel took the passthrough device back: what and why.
    pub device_lost: Option<String>,
    /// The lease the current worker serves ([`EndpointSpec::lease`], changed by moves and
    /// failovers): set when the worker starts, so that what a worker reports is about the
    /// device it ran, even when the report is read after a failover chose another.
    pub lease: Option<String>,
    /// The worker's custody sequence number this supervisor has applied everything up to
    /// (as of the last [`Supervisor::sync`]; 0 before one).
    pub custody_seq: u64,
    /// The last [`Supervisor::sync`] request answered (its token).
    pub custody_synced: u64,
}

#[derive(Debug, Default)]
struct MoveSlot {
    active: bool,
    /// The worker's answer; `Err(None)`: the worker died before answering.
    reply: Option<Result<MoveReport, Option<String>>>,
    /// The memory object the move copies to, once it is in custody: the name the device
    /// will hold it under and its identity.
    target: Option<(String, (u64, u64))>,
}

struct Endpoint {
    spec: EndpointSpec,
    /// The device the next worker builds, when a failover changed it from `spec`'s.
    device: Mutex<Option<crate::custody::DeviceSpec>>,
    /// The lease the next worker serves, when a failover changed it from `spec`'s (moved
    /// into [`WorkerStatus::lease`] when that worker starts).
    next_lease: Mutex<Option<String>>,
    /// The worker's answer to a fault injection ([`Note::FaultInjected`]).
    fault: Mutex<Option<Option<String>>>,
    fault_answered: Condvar,
    socket: DeviceSocket,
    held: Mutex<BTreeMap<u64, OwnedFd>>,
    /// The slot's memory objects (VRAM, a doorbell page...), by name.
    objects: Mutex<BTreeMap<String, OwnedFd>>,
    /// How the next worker starts, as the last one to report ready said (`None`: a worker
    /// of an earlier release, which did not say).
    replacement: Mutex<Option<StartMode>>,
    status: Mutex<WorkerStatus>,
    changed: Condvar,
    stopping: AtomicBool,
    /// Bumped to ask the current worker to be replaced by a fresh process (upgrade).
    generation: AtomicU64,
    /// Re-execs asked of the worker ([`Note::Reexec`]) and re-execs its supervision thread
    /// has taken up (re-adopting the new image): one is pending while asked > taken.
    reexec_asked: AtomicU64,
    reexec_taken: AtomicU64,
    /// The current worker's end of its custody channel, for requests.
    channel: Mutex<Option<OwnedFd>>,
    /// The move in progress, if any.
    mv: Mutex<MoveSlot>,
    mv_changed: Condvar,
    /// What an adopted worker said of its last move ([`Note::Adopted`]), brought up to date
    /// when a move it was still running ends ([`WorkerSignal::AdoptedMoveEnded`]).
    adopted_move: Mutex<Option<LastMove>>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Endpoint {
    /// A new endpoint serving `spec` on `socket`: nothing held, no worker yet, the first one
    /// starts a fresh device.
    fn new(spec: EndpointSpec, socket: DeviceSocket) -> Self {
        Self {
            spec,
            device: Mutex::new(None),
            next_lease: Mutex::new(None),
            fault: Mutex::new(None),
            fault_answered: Condvar::new(),
            socket,
            held: Mutex::new(BTreeMap::new()),
            objects: Mutex::new(BTreeMap::new()),
            replacement: Mutex::new(Some(StartMode::Fresh)),
            status: Mutex::new(WorkerStatus::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            reexec_asked: AtomicU64::new(0),
            reexec_taken: AtomicU64::new(0),
            channel: Mutex::new(None),
            mv: Mutex::new(MoveSlot::default()),
            mv_changed: Condvar::new(),
            adopted_move: Mutex::new(None),
            thread: Mutex::new(None),
        }
    }

    /// The device a worker started now builds.
    fn device(&self) -> crate::custody::DeviceSpec {
        let device = self.device.lock().unwrap_or_else(|p| p.into_inner());
        device.clone().unwrap_or_else(|| self.spec.device.clone())
    }

    /// The lease a worker started now serves.
    fn lease(&self) -> Option<String> {
        let next = self.next_lease.lock().unwrap_or_else(|p| p.into_inner());
        next.clone().or_else(|| self.spec.lease.clone())
    }

    fn mv(&self) -> MutexGuard<'_, MoveSlot> {
        self.mv.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn status(&self) -> MutexGuard<'_, WorkerStatus> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn held(&self) -> MutexGuard<'_, BTreeMap<u64, OwnedFd>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn objects(&self) -> MutexGuard<'_, BTreeMap<String, OwnedFd>> {
        self.objects.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn adopted_move(&self) -> MutexGuard<'_, Option<LastMove>> {
        self.adopted_move.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How a worker started now must start: as recorded ([`Note::Ready`]'s
    /// `replacement`), or, for a worker of an earlier release that did not say, from its
    /// black box being held.
    fn start_mode(&self) -> StartMode {
        let recorded = *self.replacement.lock().unwrap_or_else(|p| p.into_inner());
        recorded.unwrap_or_else(|| {
            if self.held().contains_key(&BLACK_BOX_ID) {
                StartMode::Resume
            } else {
                StartMode::Fresh
            }
        })
    }

    fn record_replacement(&self, mode: StartMode) {
        *self.replacement.lock().unwrap_or_else(|p| p.into_inner()) = Some(mode);
    }

    /// Changes the held memory objects, then the status that counts them.
    fn change_objects<R>(&self, f: impl FnOnce(&mut BTreeMap<String, OwnedFd>) -> R) -> R {
        let mut objects = self.objects();
        let r = f(&mut objects);
        drop(objects);
        self.change_held(|_| ());
        r
    }

    /// Changes the held descriptors, then the status that counts them.
    fn change_held<R>(&self, f: impl FnOnce(&mut BTreeMap<u64, OwnedFd>) -> R) -> R {
        let mut held = self.held();
        let r = f(&mut held);
        let objects = self.objects().len();
        let (n, connected) = (held.len() + objects, held.contains_key(&CONNECTION_ID));
        let client = client_fds(&held);
        drop(held);
        let mut st = self.status();
        st.held = n;
        st.connected = connected;
        st.client_fds = client;
        r
    }
}

/// How many of `held` are the client's descriptors (custody ids the worker assigns to the
/// descriptors of messages; see `switchyard_server::continuity::FIRST_MESSAGE_ID`).
fn client_fds(held: &BTreeMap<u64, OwnedFd>) -> usize {
    held.range(switchyard_server::continuity::FIRST_MESSAGE_ID..)
        .count()
}

/// Descriptors a worker may put in custody beyond its budget before the supervisor refuses
/// them: one read's worth, which a worker counts against its budget only once it has them.
pub const BUDGET_SLACK: usize = switchyard_server::transport::MAX_FDS_PER_READ;

/// Supervises endpoint workers. See the [module](self) documentation.
pub struct Supervisor {
    exe: PathBuf,
    endpoints: Mutex<BTreeMap<String, Arc<Endpoint>>>,
    sink: EventSink,
    /// Where workers offer their adoption sockets (see [`crate::keeper`]).
    adopt_dir: Option<PathBuf>,
    /// Each endpoint's client descriptor budget ([`Supervisor::with_fd_plan`]).
    fd_budget: Option<u32>,
    /// How many endpoints may be supervised at once.
    fd_plan: Option<FdPlan>,
    /// Who may connect to the endpoint sockets.
    access: SocketAccess,
    /// Workers end migration streams idle this long ([`Supervisor::with_migration_idle_timeout`]).
    migration_idle: Option<Duration>,
    /// Whether workers jail themselves ([`Supervisor::with_jail`]).
    jail: bool,
}

impl std::fmt::Debug for Supervisor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Supervisor")
            .field("exe", &self.exe)
            .finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("spec", &self.spec)
            .finish_non_exhaustive()
    }
}

impl Supervisor {
    /// A supervisor that starts workers as `exe worker`.
    pub fn new(exe: impl Into<PathBuf>) -> Self {
        Self::with_events(exe, Arc::new(|_| {}))
    }

    /// [`Supervisor::new`] that reports what happens to workers to `sink`.
    pub fn with_events(exe: impl Into<PathBuf>, sink: EventSink) -> Self {
        Self {
            exe: exe.into(),
            endpoints: Mutex::new(BTreeMap::new()),
            sink,
            adopt_dir: None,
            fd_budget: None,
            fd_plan: None,
            access: SocketAccess::default(),
            migration_idle: None,
            jail: true,
        }
    }

    /// Whether the workers it starts jail themselves once their device is built
    /// ([`crate::jail`]; the default). Off (`switchyard daemon --no-jail`, for debugging)
    /// they are started as `worker --no-jail`, and each says so in its log.
    pub fn with_jail(mut self, jail: bool) -> Self {
        self.jail = jail;
        self
    }

    /// Gives every endpoint socket `access` (default: the daemon's user only, 0600): the
    /// sockets it binds, and those of the workers it adopts (an earlier daemon may have
    /// given them other access, or none).
    pub fn with_socket_access(mut self, access: SocketAccess) -> Self {
        self.access = access;
        self
    }

    /// Shares the process's descriptors by `plan`: each endpoint's client gets
    /// `plan.per_endpoint` ([`Supervisor::with_fd_budget`]), and an endpoint is created or
    /// adopted only while [`FdPlan::endpoints`] allows ([`SupervisorError::NoRoom`]).
    pub fn with_fd_plan(mut self, plan: FdPlan) -> Self {
        self.fd_budget = Some(plan.per_endpoint);
        self.fd_plan = Some(plan);
        self
    }

    /// The plan set by [`Supervisor::with_fd_plan`].
    pub fn fd_plan(&self) -> Option<FdPlan> {
        self.fd_plan
    }

    fn check_room(
        &self,
        endpoints: &BTreeMap<String, Arc<Endpoint>>,
        id: &str,
    ) -> Result<(), SupervisorError> {
        let Some(plan) = self.fd_plan else {
            return Ok(());
        };
        let max = plan.endpoints();
        if endpoints.len() as u64 >= max {
            return Err(SupervisorError::NoRoom {
                endpoint: id.to_owned(),
                endpoints: endpoints.len() as u64,
                per_endpoint: plan.per_endpoint,
                own: FdPlan::ENDPOINT_OWN,
                reserve: plan.reserve,
                limit: plan.limit,
            });
        }
        Ok(())
    }

    /// Caps each endpoint's client at `budget` descriptors in custody (DMA memory fds,
    /// interrupt eventfds, a message's descriptors in flight): its worker refuses a message
    /// that would pass it (EMFILE to the client) and advertises `max_dma_maps` within it;
    /// the supervisor refuses holds past it (plus one read: [`BUDGET_SLACK`]).
    pub fn with_fd_budget(mut self, budget: u32) -> Self {
        self.fd_budget = Some(budget);
        self
    }

    /// The budget set by [`Supervisor::with_fd_budget`].
    pub fn fd_budget(&self) -> Option<u32> {
        self.fd_budget
    }

    /// Has every worker offer an adoption socket in `dir` (a private directory), so that a
    /// supervisor of a later daemon can [`Supervisor::adopt`] it.
    pub fn with_adoption_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.adopt_dir = Some(dir.into());
        self
    }
    fn endpoints(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Endpoint>>> {
        self.endpoints.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn get(&self, id: &str) -> Result<Arc<Endpoint>, SupervisorError> {
        self.endpoints()
            .get(id)
            .cloned()
            .ok_or_else(|| SupervisorError::NotFound(id.to_owned()))
    }

    /// Binds the endpoint's socket (listening when this returns) and starts its worker.
    pub fn create(&self, spec: EndpointSpec) -> Result<(), SupervisorError> {
        crate::blocking::may_block("a worker's start");
        let mut endpoints = self.endpoints();
        if endpoints.contains_key(&spec.id) {
            return Err(SupervisorError::Exists(spec.id));
        }
        self.check_room(&endpoints, &spec.id)?;
        let socket = DeviceSocket::bind(&spec.socket, self.access.mode())
            .map_err(|e| SupervisorError::Bind(spec.id.clone(), e))?;
        // Before the endpoint is announced: a client told of it can connect.
        self.access.apply(&spec.socket).map_err(|e| {
            SupervisorError::Bind(
                spec.id.clone(),
                switchyard_server::ServerError::Bind(
                    spec.socket.clone(),
                    std::io::Error::new(
                        e.kind(),
                        format!("cannot give the socket to its group: {e}"),
                    ),
                ),
            )
        })?;
        let ep = Arc::new(Endpoint::new(spec.clone(), socket));
        let exe = self.exe.clone();
        let ep2 = ep.clone();
        let sink = self.sink.clone();
        let adopt_dir = self.adopt_dir.clone();
        let (budget, migration_idle, jail) = (self.fd_budget, self.migration_idle, self.jail);
        let thread = std::thread::Builder::new()
            .name(format!("sy-sup-{}", spec.id))
            .spawn(move || {
                let launch = Launch {
                    adopt_dir: adopt_dir.as_deref(),
                    fd_budget: budget,
                    migration_idle,
                    jail,
                };
                supervise(&ep2, &exe, &sink, launch, None);
            })
            .map_err(|e| SupervisorError::Spawn(spec.id.clone(), e))?;
        *ep.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        endpoints.insert(spec.id, ep);
        Ok(())
    }

    /// Kills the endpoint's worker with SIGKILL (a crash drill); the supervisor replaces it.
    /// Returns the pid killed.
    pub fn kill_worker(&self, id: &str) -> Result<Option<u32>, SupervisorError> {
        let ep = self.get(id)?;
        let pid = ep.status().pid;
        kill(pid);
        Ok(pid)
    }

    /// Replaces the endpoint's worker with a new process of the supervisor's executable (an
    /// upgrade when the file changed): the old one is killed at once and the new one resumes
    /// from what is held.
    pub fn upgrade(&self, id: &str) -> Result<(), SupervisorError> {
        let ep = self.get(id)?;
        ep.generation.fetch_add(1, Ordering::SeqCst);
        kill(ep.status().pid);
        Ok(())
    }

    /// Moves the endpoint's device onto a new VRAM (another board) under its running client:
    /// the worker pre-copies VRAM while the device runs, then swaps to a device on the new
    /// VRAM (`to` names the board, for the logs). One move per endpoint at a time; waits up
    /// to `timeout` for the worker's answer.
    ///
    /// If the worker dies during the move, the replacement runs the device on whichever VRAM
    /// its state names: waits for it (within `timeout`) and reports
    /// [`MoveOutcome::MovedAcrossRestart`] or [`SupervisorError::MoveFailed`] accordingly.
    ///
    /// `detached`: the endpoint's client is gone (its VMM unplugged the device for a
    /// guest-visible move): VRAM the guest could map moves too; refused if a client is
    /// connected when the device switches.
    pub fn move_device(
        &self,
        id: &str,
        to: &str,
        detached: bool,
        timeout: Duration,
    ) -> Result<MoveOutcome, SupervisorError> {
        self.move_device_to(id, to, None, detached, timeout)
    }

    /// [`Supervisor::move_device`] onto a device of spec `target` when it differs from the
    /// endpoint's (another kind presenting the same device, another GPU): the worker makes
    /// its successor one of it, and workers started from then on build `target`.
    pub fn move_device_to(
        &self,
        id: &str,
        to: &str,
        target: Option<DeviceSpec>,
        detached: bool,
        timeout: Duration,
    ) -> Result<MoveOutcome, SupervisorError> {
        crate::blocking::may_block("a move's answer");
        let ep = self.get(id)?;
        let deadline = Instant::now() + timeout;
        {
            let mut mv = ep.mv();
            if mv.active {
                return Err(SupervisorError::Moving(id.to_owned()));
            }
            *mv = MoveSlot {
                active: true,
                ..MoveSlot::default()
            };
        }
        let result = self.run_move(&ep, to, target.clone(), detached, deadline);
        if result.is_ok() {
            if target.is_some() {
                // A replacement from now on builds the device of the board it runs on.
                *ep.device.lock().unwrap_or_else(|p| p.into_inner()) = target;
            }
            // The device runs on the target: the worker's reports are about it now, and so
            // are a replacement's.
            *ep.next_lease.lock().unwrap_or_else(|p| p.into_inner()) = Some(to.to_owned());
            ep.status().lease = Some(to.to_owned());
        }
        let mut mv = ep.mv();
        mv.active = false;
        mv.reply = None;
        result
    }

    /// Whether a move of the endpoint is in progress.
    pub fn is_moving(&self, id: &str) -> Result<bool, SupervisorError> {
        Ok(self.get(id)?.mv().active)
    }

    fn run_move(
        &self,
        ep: &Endpoint,
        to: &str,
        target: Option<DeviceSpec>,
        detached: bool,
        deadline: Instant,
    ) -> Result<MoveOutcome, SupervisorError> {
        let id = &ep.spec.id;
        let failed = |reason: String| SupervisorError::MoveFailed {
            endpoint: id.clone(),
            reason,
        };
        let ready_before = ep.status().ready;
        let sent = {
            let channel = ep.channel.lock().unwrap_or_else(|p| p.into_inner());
            let ch = channel
                .as_ref()
                .ok_or_else(|| SupervisorError::NoWorker(id.clone()))?;
            custody::send(
                ch,
                &Note::Move {
                    to: to.to_owned(),
                    detached,
                    target,
                },
                &[],
            )
        };
        sent.map_err(|e| failed(format!("cannot ask the worker: {e}")))?;
        let mut mv = ep.mv();
        while mv.reply.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(failed("the worker did not answer in time".into()));
            }
            mv = ep
                .mv_changed
                .wait_timeout(mv, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let reply = mv.reply.take();
        let target = mv.target.take();
        drop(mv);
        match reply {
            Some(Ok(report)) => Ok(MoveOutcome::Moved(report)),
            Some(Err(Some(reason))) => Err(failed(reason)),
            _ => {
                // The worker died: where does its replacement run the device?
                let left = deadline.saturating_duration_since(Instant::now());
                let st = self.wait_ready(id, ready_before + 1, left)?;
                if st.ready <= ready_before {
                    return Err(failed(
                        "the worker died during the move and no replacement is serving yet".into(),
                    ));
                }
                let current = target
                    .as_ref()
                    .and_then(|(name, _)| ep.objects().get(name).and_then(file_identity));
                if current.is_some() && current == target.map(|(_, id)| id) {
                    Ok(MoveOutcome::MovedAcrossRestart)
                } else {
                    Err(failed(
                        "the worker died during the move; its replacement runs the device where it was"
                            .into(),
                    ))
                }
            }
        }
    }

    /// What the endpoint's adopted worker said of its last move when adopted ([`Supervisor::adopt`]),
    /// up to date if it was still running then ([`WorkerSignal::AdoptedMoveEnded`]); `None`
    /// when the worker was not adopted, moved nothing, or is of a release that does not say.
    pub fn adopted_move(&self, id: &str) -> Result<Option<LastMove>, SupervisorError> {
        Ok(self.get(id)?.adopted_move().clone())
    }

    /// The endpoint's worker status.
    pub fn status(&self, id: &str) -> Result<WorkerStatus, SupervisorError> {
        Ok(self.get(id)?.status().clone())
    }

    /// Waits until the endpoint has had `ready` workers report ready (or `timeout`).
    pub fn wait_ready(
        &self,
        id: &str,
        ready: u64,
        timeout: Duration,
    ) -> Result<WorkerStatus, SupervisorError> {
        crate::blocking::may_block("a worker's readiness");
        let ep = self.get(id)?;
        let deadline = Instant::now() + timeout;
        let mut st = ep.status();
        while st.ready < ready && !st.failed {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            st = ep
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(st.clone())
    }

    /// Names of the endpoints.
    pub fn list(&self) -> Vec<String> {
        self.endpoints().keys().cloned().collect()
    }

    /// Stops supervising every endpoint **without** killing its worker, for a daemon that
    /// exits while guests keep their devices: each worker keeps serving its connection (its
    /// custody notes fail from then on, and it runs without a supervisor: a crash of it is
    /// no longer repaired), the socket files stay in place, and a worker that dies after this
    /// is not replaced. Returns each endpoint with the pid of its worker at that moment.
    ///
    /// The endpoints' descriptors and supervision threads are left to the end of the process
    /// (they are not closed here, so that no socket file is removed): call this just before
    /// exiting. A supervisor dropped afterwards has nothing left to kill.
    pub fn release_all(&self) -> Vec<(String, Option<u32>)> {
        let released = std::mem::take(&mut *self.endpoints());
        let mut out = Vec::with_capacity(released.len());
        for (id, ep) in released {
            let pid = {
                let st = ep.status();
                ep.stopping.store(true, Ordering::SeqCst);
                st.pid
            };
            out.push((id, pid));
            // Dropping the last reference would close the listening socket and remove its
            // file; the process ends soon and releases everything then.
            std::mem::forget(ep);
        }
        out
    }
}

#[cfg(test)]
mod tests;

impl Drop for Supervisor {
    fn drop(&mut self) {
        for id in self.list() {
            let _ = self.delete(&id);
        }
    }
}

/// `(st_dev, st_ino)` of a held descriptor.
fn file_identity(fd: &OwnedFd) -> Option<(u64, u64)> {
    rustix::fs::fstat(fd).ok().map(|st| (st.st_dev, st.st_ino))
}

fn kill(pid: Option<u32>) {
    if let Some(pid) = pid.and_then(|p| rustix::process::Pid::from_raw(p as i32)) {
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
    }
}
