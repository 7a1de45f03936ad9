//! The supervisor: for each endpoint, the listening socket, a worker process serving it, and
//! a duplicate of every descriptor the worker put into custody. When a worker dies (a crash,
//! `kill -9`, an upgrade), a replacement starts with the same descriptors and resumes the
//! connection; the guest sees a stall.

use std::collections::{BTreeMap, VecDeque};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use switchyard_server::DeviceSocket;

use crate::custody::{
    self, BLACK_BOX_ID, CONNECTION_ID, LISTENER_ID, MoveReport, Note, StartMode, VRAM_ID,
    VRAM_NEXT_ID,
};

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
    /// The worker refused or failed the move; the device runs where it was.
    #[error("Endpoint `{endpoint}` was not moved: {reason}")]
    MoveFailed {
        /// Endpoint.
        endpoint: String,
        /// The worker's error chain, or what happened to the worker.
        reason: String,
    },
}

/// How the daemon's descriptors are shared: `reserve` for itself (the control API, the
/// store, starting workers), then per endpoint its own ([`FdPlan::ENDPOINT_OWN`]: listener,
/// connection, black box, VRAM, doorbells, the custody channel) and its client's budget
/// (`per_endpoint`). Endpoints are admitted while the sum fits `limit` (the open-file
/// limit), so no client, within its budget, can make the daemon run out of descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct FdPlan {
    /// The daemon's open-file limit (`RLIMIT_NOFILE`, soft; raised to the hard limit at
    /// start).
    pub limit: u64,
    /// Descriptors kept for the daemon itself.
    pub reserve: u32,
    /// Each endpoint's client budget.
    pub per_endpoint: u32,
}

impl FdPlan {
    /// An endpoint's own descriptors in the daemon, beyond its client's.
    pub const ENDPOINT_OWN: u32 = 16;
    /// What a worker needs besides its client's descriptors (its threads, the device, the
    /// black box, the socket).
    pub const WORKER_OWN: u64 = 512;

    /// The plan under this process's open-file limit now.
    pub fn current(reserve: u32, per_endpoint: u32) -> Self {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        Self {
            limit,
            reserve,
            per_endpoint,
        }
    }

    /// How many endpoints fit.
    pub fn endpoints(&self) -> u64 {
        let each = u64::from(self.per_endpoint) + u64::from(Self::ENDPOINT_OWN);
        self.limit.saturating_sub(u64::from(self.reserve)) / each
    }

    /// Why the plan cannot work, if it cannot: not one endpoint fits, or a worker (which
    /// has the same limit and holds up to three copies of its client's descriptors while a
    /// replacement restores them: the supervisor's, its ledger's and the device's) could
    /// not hold a full budget.
    pub fn problem(&self) -> Option<String> {
        let worker = 3 * u64::from(self.per_endpoint) + Self::WORKER_OWN;
        if self.endpoints() == 0 {
            Some(format!(
                "not one endpoint fits: {} reserved plus {} + {} per endpoint exceed the open-file limit of {}",
                self.reserve,
                self.per_endpoint,
                Self::ENDPOINT_OWN,
                self.limit
            ))
        } else if worker > self.limit {
            Some(format!(
                "a worker needs up to {worker} descriptors for a budget of {} (three copies while it restores its client, plus {}), over the open-file limit of {}",
                self.per_endpoint,
                Self::WORKER_OWN,
                self.limit
            ))
        } else {
            None
        }
    }
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
    pub device: crate::custody::WorkerDevice,
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
}

#[derive(Debug, Default)]
struct MoveSlot {
    active: bool,
    /// The worker's answer; `Err(None)`: the worker died before answering.
    reply: Option<Result<MoveReport, Option<String>>>,
    /// Identity of the VRAM the move copies to, once it is in custody.
    target: Option<(u64, u64)>,
}

struct Endpoint {
    spec: EndpointSpec,
    socket: DeviceSocket,
    held: Mutex<BTreeMap<u64, OwnedFd>>,
    status: Mutex<WorkerStatus>,
    changed: Condvar,
    stopping: AtomicBool,
    /// Bumped to ask the current worker to be replaced by a fresh process (upgrade).
    generation: AtomicU64,
    /// The current worker's end of its custody channel, for requests.
    channel: Mutex<Option<OwnedFd>>,
    /// The move in progress, if any.
    mv: Mutex<MoveSlot>,
    mv_changed: Condvar,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Endpoint {
    fn mv(&self) -> MutexGuard<'_, MoveSlot> {
        self.mv.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn status(&self) -> MutexGuard<'_, WorkerStatus> {
        self.status.lock().unwrap_or_else(|p| p.into_inner())
    }
    fn held(&self) -> MutexGuard<'_, BTreeMap<u64, OwnedFd>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Changes the held descriptors, then the status that counts them.
    fn change_held<R>(&self, f: impl FnOnce(&mut BTreeMap<u64, OwnedFd>) -> R) -> R {
        let mut held = self.held();
        let r = f(&mut held);
        let (n, connected) = (held.len(), held.contains_key(&CONNECTION_ID));
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

/// Crash-loop policy: this many workers dying without reporting ready, in a row, and the
/// supervisor gives up on the endpoint.
const MAX_FAILED_STARTS: u32 = 8;
/// After this many failed starts in a row, the client's connection and descriptors are
/// dropped: what a client sent (too many descriptors, a state that crashes its restore) must
/// not fail the endpoint for good. The next worker resumes the device without a client.
const DROP_CLIENT_AFTER: u32 = 3;
/// After this many, the device's own state goes too (black box, VRAM, doorbell page): the
/// next worker starts a fresh device.
const START_FRESH_AFTER: u32 = 5;
/// Pause between starts once starts fail.
const FAILED_START_PAUSE: Duration = Duration::from_millis(250);

/// Something that happened to an endpoint's worker (for the daemon's events and metrics).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerEvent {
    /// A worker process started.
    Started {
        /// Endpoint.
        endpoint: String,
        /// Its pid.
        pid: u32,
        /// It resumes a device (a restart) rather than creating one.
        resume: bool,
    },
    /// The worker serves.
    Ready {
        /// Endpoint.
        endpoint: String,
        /// Its pid.
        pid: u32,
        /// It continued a client connection.
        resumed_connection: bool,
        /// From the previous worker's death to this one's readiness, if it replaced one.
        restart: Option<Duration>,
    },
    /// A worker exited.
    Exited {
        /// Endpoint.
        endpoint: String,
        /// Its pid.
        pid: u32,
        /// How it ended (`exit status: 0`, `signal: 9 (SIGKILL)`, ...).
        status: String,
    },
    /// What the worker served since its last report (about every second).
    Stats {
        /// Endpoint.
        endpoint: String,
        /// The report.
        stats: crate::custody::WorkerStats,
    },
    /// Workers kept dying before serving; the endpoint's client was disconnected.
    GaveUp {
        /// Endpoint.
        endpoint: String,
    },
    /// Workers kept dying before serving: the supervisor let go of what the next one would
    /// have restored (the client's connection and descriptors; then the device's state).
    Reset {
        /// Endpoint.
        endpoint: String,
        /// What was let go, and why.
        what: String,
    },
    /// A replacement could not restore all of the client's state (windows or eventfds the
    /// client had been told succeeded).
    StateLost {
        /// Endpoint.
        endpoint: String,
        /// What was lost.
        problems: Vec<String>,
    },
    /// The kernel took the endpoint's passthrough device back (unbind, removal): the
    /// endpoint fails every access with ENODEV; its board should take no new lease.
    DeviceLost {
        /// Endpoint.
        endpoint: String,
        /// The device's PCI address.
        host: String,
        /// What happened.
        reason: String,
    },
}

/// Receives [`WorkerEvent`]s (called from supervision threads; keep it short).
pub type EventSink = Arc<dyn Fn(WorkerEvent) + Send + Sync>;

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
        }
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

    /// Takes over supervising `spec`'s running worker `pid`, started by an earlier supervisor
    /// (an earlier daemon) that is gone: connects to its adoption socket in the adoption
    /// directory, receives everything held for the endpoint (the listening socket, the
    /// client's connection and descriptors, VRAM, black box), and from then on supervises it
    /// as if it had started it (a worker that dies is replaced; restart, upgrade and moves
    /// work). Refused if the worker offers no adoption socket or has a supervisor.
    pub fn adopt(&self, spec: EndpointSpec, pid: u32) -> Result<(), SupervisorError> {
        let failed = |reason: String| SupervisorError::Adopt {
            endpoint: spec.id.clone(),
            pid,
            reason,
        };
        let dir = self
            .adopt_dir
            .as_ref()
            .ok_or_else(|| failed("this supervisor has no adoption directory".into()))?;
        let mut endpoints = self.endpoints();
        if endpoints.contains_key(&spec.id) {
            return Err(SupervisorError::Exists(spec.id));
        }
        self.check_room(&endpoints, &spec.id)?;
        let path = crate::keeper::adoption_path(dir, pid);
        let (channel, mut held) = adopt_from(&path, &spec.id, pid)
            .map_err(|e| failed(format!("{}: {e}", path.display())))?;
        let listener = held
            .remove(&LISTENER_ID)
            .ok_or_else(|| failed("the worker did not hand over the listening socket".into()))?;
        let socket = DeviceSocket::adopt_owned(
            std::os::unix::net::UnixListener::from(listener),
            spec.socket.clone(),
        );
        let connected = held.contains_key(&CONNECTION_ID);
        let client = client_fds(&held);
        let ep = Arc::new(Endpoint {
            spec: spec.clone(),
            socket,
            status: Mutex::new(WorkerStatus {
                pid: Some(pid),
                ready: 1,
                held: held.len(),
                client_fds: client,
                connected,
                ..WorkerStatus::default()
            }),
            held: Mutex::new(held),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            channel: Mutex::new(channel.try_clone().ok()),
            mv: Mutex::new(MoveSlot::default()),
            mv_changed: Condvar::new(),
            thread: Mutex::new(None),
        });
        let (exe, ep2, sink) = (self.exe.clone(), ep.clone(), self.sink.clone());
        let adopt_dir = self.adopt_dir.clone();
        let budget = self.fd_budget;
        let thread = std::thread::Builder::new()
            .name(format!("sy-sup-{}", spec.id))
            .spawn(move || {
                supervise(
                    &ep2,
                    &exe,
                    &sink,
                    Launch {
                        adopt_dir: adopt_dir.as_deref(),
                        fd_budget: budget,
                    },
                    Some((channel, pid)),
                );
            })
            .map_err(|e| SupervisorError::Spawn(spec.id.clone(), e))?;
        *ep.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        endpoints.insert(spec.id.clone(), ep);
        tracing::info!(endpoint = spec.id, pid, "worker adopted");
        Ok(())
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
        let mut endpoints = self.endpoints();
        if endpoints.contains_key(&spec.id) {
            return Err(SupervisorError::Exists(spec.id));
        }
        self.check_room(&endpoints, &spec.id)?;
        let socket = DeviceSocket::bind(&spec.socket, 0o600)
            .map_err(|e| SupervisorError::Bind(spec.id.clone(), e))?;
        let ep = Arc::new(Endpoint {
            spec: spec.clone(),
            socket,
            held: Mutex::new(BTreeMap::new()),
            status: Mutex::new(WorkerStatus::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            channel: Mutex::new(None),
            mv: Mutex::new(MoveSlot::default()),
            mv_changed: Condvar::new(),
            thread: Mutex::new(None),
        });
        let exe = self.exe.clone();
        let ep2 = ep.clone();
        let sink = self.sink.clone();
        let adopt_dir = self.adopt_dir.clone();
        let budget = self.fd_budget;
        let thread = std::thread::Builder::new()
            .name(format!("sy-sup-{}", spec.id))
            .spawn(move || {
                let launch = Launch {
                    adopt_dir: adopt_dir.as_deref(),
                    fd_budget: budget,
                };
                supervise(&ep2, &exe, &sink, launch, None);
            })
            .map_err(|e| SupervisorError::Spawn(spec.id.clone(), e))?;
        *ep.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        endpoints.insert(spec.id, ep);
        Ok(())
    }

    /// Stops the endpoint: its worker is killed and every descriptor closed (the client sees
    /// the connection close), the socket file removed.
    pub fn delete(&self, id: &str) -> Result<(), SupervisorError> {
        let ep = self
            .endpoints()
            .remove(id)
            .ok_or_else(|| SupervisorError::NotFound(id.to_owned()))?;
        {
            // Under the status lock: a worker started concurrently either is seen here or
            // sees `stopping` (see `run_worker`).
            let st = ep.status();
            ep.stopping.store(true, Ordering::SeqCst);
            kill(st.pid);
        }
        if let Some(t) = ep.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        ep.held().clear();
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
        let result = self.run_move(&ep, to, detached, deadline);
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
        let target = mv.target;
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
                let current = ep.held().get(&VRAM_ID).and_then(file_identity);
                if target.is_some() && current == target {
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

/// What every worker of a supervisor is started with.
#[derive(Debug, Clone, Copy)]
struct Launch<'a> {
    adopt_dir: Option<&'a Path>,
    fd_budget: Option<u32>,
}

/// Supervises `ep`: first the adopted worker `adopted` (its channel and pid) if any, then
/// workers it starts itself, replacing each that dies.
fn supervise(
    ep: &Endpoint,
    exe: &Path,
    sink: &EventSink,
    launch: Launch<'_>,
    adopted: Option<(OwnedFd, u32)>,
) {
    let span = tracing::info_span!("endpoint", id = %ep.spec.id);
    let _g = span.enter();
    let adopt_dir = launch.adopt_dir;
    let mut failed_starts = 0u32;
    let mut died_at: Option<Instant> = None;
    let mut recent: VecDeque<Instant> = VecDeque::new();
    if let Some((channel, pid)) = adopted {
        // The adopted ledger against the budget: a worker of an older daemon may hold more
        // for its client than this one allows (descriptors of messages it never handled).
        // A replacement keeps what the tables and the journal refer to and releases the rest.
        let client = ep.status().client_fds;
        if let Some(budget) = launch.fd_budget
            && client > budget as usize
        {
            let what = format!(
                "the adopted worker holds {client} client descriptors, over the budget of \
                 {budget}: replaced, so that what no DMA window, eventfd or message in flight \
                 refers to is released"
            );
            tracing::warn!(pid, client, budget, "{what}");
            sink(WorkerEvent::Reset {
                endpoint: ep.spec.id.clone(),
                what,
            });
            kill(Some(pid));
        }
        serve_notes(
            ep,
            &channel,
            pid,
            None,
            Instant::now(),
            sink,
            launch,
            &|| {
                kill(Some(pid));
            },
        );
        // Not our child: it cannot be waited for. It closed its channel by dying (or is
        // made to): a replacement must not serve next to it.
        kill(Some(pid));
        wait_gone(pid, Duration::from_secs(5));
        *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) = None;
        end_move_on_death(ep);
        if let Some(dir) = adopt_dir {
            let _ = std::fs::remove_file(crate::keeper::adoption_path(dir, pid));
        }
        tracing::info!(pid, "adopted worker gone");
        died_at = Some(Instant::now());
        ep.status().pid = None;
        if !ep.stopping.load(Ordering::SeqCst) {
            let mut st = ep.status();
            st.restarts += 1;
            ep.changed.notify_all();
        }
    }
    while !ep.stopping.load(Ordering::SeqCst) {
        let mode = {
            let held = ep.held();
            // A softgpu resumes from its black box and VRAM, a passthrough device from its
            // black box (the hardware is reset and the configuration replayed).
            let passthrough = matches!(ep.spec.device, crate::custody::WorkerDevice::Vfio { .. });
            if held.contains_key(&BLACK_BOX_ID) && (held.contains_key(&VRAM_ID) || passthrough) {
                StartMode::Resume
            } else {
                StartMode::Fresh
            }
        };
        let ready = match run_worker(ep, exe, mode, died_at, sink, launch) {
            Ok(ready) => ready,
            Err(e) => {
                tracing::error!(error = %e, "cannot start a worker");
                false
            }
        };
        died_at = Some(Instant::now());
        ep.status().pid = None;
        if ep.stopping.load(Ordering::SeqCst) {
            break;
        }
        if ready {
            failed_starts = 0;
        } else {
            failed_starts += 1;
            if failed_starts >= MAX_FAILED_STARTS {
                tracing::error!(
                    attempts = failed_starts,
                    "workers keep dying before they serve; giving the endpoint up (its client is disconnected, new connections are refused)"
                );
                ep.change_held(|held| held.clear());
                refuse_connections(&ep.socket);
                let mut st = ep.status();
                st.failed = true;
                ep.changed.notify_all();
                drop(st);
                sink(WorkerEvent::GaveUp {
                    endpoint: ep.spec.id.clone(),
                });
                return;
            }
            let fresh = failed_starts >= START_FRESH_AFTER;
            if let Some(what) = let_go(ep, failed_starts >= DROP_CLIENT_AFTER, fresh) {
                tracing::warn!(
                    attempts = failed_starts,
                    "workers keep dying before they serve: {what}"
                );
                sink(WorkerEvent::Reset {
                    endpoint: ep.spec.id.clone(),
                    what,
                });
            }
            std::thread::sleep(FAILED_START_PAUSE);
        }
        recent.push_back(Instant::now());
        while recent.len() > 10 {
            recent.pop_front();
        }
        let mut st = ep.status();
        st.restarts += 1;
        ep.changed.notify_all();
        drop(st);
        tracing::warn!(mode = ?StartMode::Resume, "worker gone; starting a replacement");
    }
}

/// After failed starts: lets go of the client (`client`: its connection and descriptors),
/// or of everything (`fresh`: the device's state too), so that the next worker starts
/// without what kept its predecessors from serving. Returns what was let go, if anything.
fn let_go(ep: &Endpoint, client: bool, fresh: bool) -> Option<String> {
    ep.change_held(|held| {
        if fresh && !held.is_empty() {
            held.clear();
            return Some(
                "the device's state and its client were let go; the next worker starts a fresh device"
                    .to_owned(),
            );
        }
        let first = switchyard_server::continuity::FIRST_MESSAGE_ID;
        let descriptors = held.range(first..).count();
        if client && (descriptors > 0 || held.contains_key(&CONNECTION_ID)) {
            held.retain(|id, _| *id < first && *id != CONNECTION_ID);
            return Some(format!(
                "the client's connection and its {descriptors} descriptors were let go; the next worker resumes the device without a client"
            ));
        }
        None
    })
}

/// A given-up endpoint refuses connections (they would hang: no worker accepts them). The
/// socket stays bound, so its path is not taken by anyone else; connections already queued
/// are closed.
fn refuse_connections(socket: &DeviceSocket) {
    let listener = socket.listener();
    if let Err(e) = rustix::net::shutdown(listener, rustix::net::Shutdown::Both) {
        tracing::warn!(error = %e, "cannot shut the endpoint's socket; connections will hang");
    }
    if listener.set_nonblocking(true).is_ok() {
        while listener.accept().is_ok() {}
    }
}

/// Starts one worker and serves its custody notes until it dies. Returns whether it
/// reported ready.
fn run_worker(
    ep: &Endpoint,
    exe: &Path,
    mode: StartMode,
    died_at: Option<Instant>,
    sink: &EventSink,
    launch: Launch<'_>,
) -> std::io::Result<bool> {
    let adopt_dir = launch.adopt_dir;
    let (ours, theirs) = custody::pair()?;
    let mut child: Child = Command::new(exe)
        .arg("worker")
        .stdin(Stdio::from(theirs))
        // Its own process group: a terminal's Ctrl-C to the daemon does not reach it.
        .process_group(0)
        .spawn()?;
    let pid = child.id();
    {
        let mut st = ep.status();
        st.pid = Some(pid);
        if ep.stopping.load(Ordering::SeqCst) {
            // `delete` ran between the check in `supervise` and the spawn.
            let _ = child.kill();
        }
    }
    sink(WorkerEvent::Started {
        endpoint: ep.spec.id.clone(),
        pid,
        resume: mode == StartMode::Resume,
    });
    let started = Instant::now();
    let handed = hand_over(ep, &ours, mode, launch);
    *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) = ours.try_clone().ok();
    let mut ready = false;
    if let Err(e) = handed {
        tracing::error!(error = %e, "cannot hand the endpoint's descriptors to the worker");
        let _ = child.kill();
    } else {
        ready = serve_notes(ep, &ours, pid, died_at, started, sink, launch, &|| {
            kill(Some(pid));
        });
    }
    *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) = None;
    end_move_on_death(ep);
    // A restart abandons a migration (its replacement starts RUNNING).
    ep.status().migrating = false;
    let status = child.wait()?;
    if let Some(dir) = adopt_dir {
        let _ = std::fs::remove_file(crate::keeper::adoption_path(dir, pid));
    }
    tracing::info!(pid, %status, "worker exited");
    sink(WorkerEvent::Exited {
        endpoint: ep.spec.id.clone(),
        pid,
        status: status.to_string(),
    });
    Ok(ready)
}

/// A move waiting for the worker that just died learns it.
fn end_move_on_death(ep: &Endpoint) {
    let mut mv = ep.mv();
    if mv.active && mv.reply.is_none() {
        mv.reply = Some(Err(None));
        ep.mv_changed.notify_all();
    }
}

/// Waits (bounded) until `pid` no longer runs (gone, or a zombie).
fn wait_gone(pid: u32, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        let zombie = stat
            .rfind(')')
            .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
        if stat.is_empty() || zombie {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    tracing::error!(pid, "the worker does not die");
}

/// Serves worker `pid`'s custody notes on `channel` until the channel closes. Returns
/// whether it reported ready (an adopted worker did before). `kill` ends a worker that
/// breaks the protocol.
#[allow(clippy::too_many_arguments)]
fn serve_notes(
    ep: &Endpoint,
    channel: &OwnedFd,
    pid: u32,
    died_at: Option<Instant>,
    started: Instant,
    sink: &EventSink,
    launch: Launch<'_>,
    kill: &dyn Fn(),
) -> bool {
    let mut ready = false;
    let mut buf = Vec::new();
    let limit = launch
        .fd_budget
        .map(|b| (b as usize).saturating_add(BUDGET_SLACK));
    let over_budget = switchyard_device::ratelimit::LogLimiter::new(
        "worker holds refused past the endpoint's budget",
        Duration::from_secs(5),
    );
    loop {
        match custody::recv(channel, &mut buf) {
            Ok((Note::Hold { ids }, fds)) => {
                let refused = ep.change_held(|held| {
                    let first = switchyard_server::continuity::FIRST_MESSAGE_ID;
                    let mut client = held.range(first..).count();
                    let mut refused = 0u64;
                    for (id, fd) in ids.into_iter().zip(fds) {
                        if id == VRAM_NEXT_ID {
                            ep.mv().target = file_identity(&fd);
                        }
                        if id >= first && !held.contains_key(&id) {
                            if limit.is_some_and(|l| client >= l) {
                                // The worker should have refused the message: the daemon's
                                // own limit is what the budget protects.
                                refused += 1;
                                continue;
                            }
                            client += 1;
                        }
                        held.insert(id, fd);
                    }
                    refused
                });
                if refused > 0 {
                    ep.status().refused_fds += refused;
                    if over_budget.allow() {
                        tracing::error!(
                            pid,
                            refused,
                            budget = ?launch.fd_budget,
                            "the worker put client descriptors in custody past the endpoint's budget; refused"
                        );
                    }
                }
            }
            Ok((Note::StateLost { problems }, _)) => {
                tracing::error!(?problems, "the replacement lost part of the client's state");
                ep.status().state_lost = problems.clone();
                ep.changed.notify_all();
                sink(WorkerEvent::StateLost {
                    endpoint: ep.spec.id.clone(),
                    problems,
                });
            }
            Ok((Note::Migration { streaming }, _)) => {
                ep.status().migrating = streaming;
                ep.changed.notify_all();
            }
            Ok((Note::Stats(stats), _)) => sink(WorkerEvent::Stats {
                endpoint: ep.spec.id.clone(),
                stats,
            }),
            Ok((Note::Moved { report }, _)) => {
                ep.mv().reply = Some(Ok(report));
                ep.mv_changed.notify_all();
            }
            Ok((Note::MoveFailed { error }, _)) => {
                ep.mv().reply = Some(Err(Some(error)));
                ep.mv_changed.notify_all();
            }
            Ok((Note::Release { ids }, _)) => {
                let client_left = ids.contains(&CONNECTION_ID);
                ep.change_held(|held| {
                    for id in ids {
                        if id != LISTENER_ID {
                            held.remove(&id);
                        }
                    }
                });
                if client_left {
                    // What a replacement lost was the client's; a new client starts whole.
                    ep.status().state_lost.clear();
                }
            }
            Ok((Note::Ready { resumed }, _)) => {
                ready = true;
                let restart = died_at.map(|t| t.elapsed());
                let mut st = ep.status();
                st.ready += 1;
                if restart.is_some() {
                    st.last_restart = restart;
                }
                ep.changed.notify_all();
                drop(st);
                sink(WorkerEvent::Ready {
                    endpoint: ep.spec.id.clone(),
                    pid,
                    resumed_connection: resumed,
                    restart,
                });
                tracing::info!(
                    pid,
                    resumed,
                    start_ms = started.elapsed().as_secs_f64() * 1e3,
                    "worker ready"
                );
            }
            Ok((Note::DeviceLost { host, reason }, _)) => {
                tracing::error!(%host, %reason, "the endpoint's passthrough device is lost");
                ep.status().device_lost = Some(format!("{host}: {reason}"));
                ep.changed.notify_all();
                sink(WorkerEvent::DeviceLost {
                    endpoint: ep.spec.id.clone(),
                    host,
                    reason,
                });
            }
            Ok((other, _)) => tracing::warn!(?other, "unexpected custody note; ignored"),
            Err(custody::ChannelError::Closed) => break,
            Err(e) => {
                // A worker that breaks the channel protocol cannot be trusted with it.
                tracing::error!(error = %e, "custody channel broken; killing the worker");
                kill();
                break;
            }
        }
    }
    ready
}

/// Connects to a worker's adoption socket at `path` and takes its custody over: the channel
/// and everything held. The socket must be one (not a symbolic link) and served by the
/// recorded worker `pid` itself, running as our uid: the record that named the pid is not
/// proof enough.
fn adopt_from(
    path: &Path,
    endpoint: &str,
    pid: u32,
) -> Result<(OwnedFd, BTreeMap<u64, OwnedFd>), custody::ChannelError> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    use std::os::unix::fs::FileTypeExt;
    let refused = |reason: String| custody::ChannelError::Io(std::io::Error::other(reason));
    let kind = std::fs::symlink_metadata(path)?.file_type();
    if kind.is_symlink() {
        return Err(refused("the adoption socket is a symbolic link".into()));
    }
    if !kind.is_socket() {
        return Err(refused("the adoption socket is not a socket".into()));
    }
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(std::io::Error::from)?;
    let addr = SocketAddrUnix::new(path).map_err(std::io::Error::from)?;
    rustix::net::connect(&sock, &addr).map_err(std::io::Error::from)?;
    let peer = rustix::net::sockopt::socket_peercred(&sock).map_err(std::io::Error::from)?;
    let ours = rustix::process::geteuid();
    if peer.uid != ours {
        return Err(refused(format!(
            "the adoption socket's server runs as uid {}, not as the daemon's uid {}",
            peer.uid.as_raw(),
            ours.as_raw()
        )));
    }
    if u32::try_from(peer.pid.as_raw_nonzero().get()) != Ok(pid) {
        return Err(refused(format!(
            "the adoption socket is served by process {}, not by the recorded worker {pid}",
            peer.pid.as_raw_nonzero()
        )));
    }
    custody::send(
        &sock,
        &Note::Adopt {
            endpoint: endpoint.to_owned(),
        },
        &[],
    )?;
    let mut held = BTreeMap::new();
    let mut buf = Vec::new();
    loop {
        match custody::recv(&sock, &mut buf)? {
            (Note::Fds { ids }, fds) => held.extend(ids.into_iter().zip(fds)),
            (Note::Adopted { .. }, _) => return Ok((sock, held)),
            (Note::AdoptRefused { reason }, _) => {
                return Err(custody::ChannelError::Io(std::io::Error::other(reason)));
            }
            (other, _) => tracing::warn!(?other, "unexpected note during an adoption; ignored"),
        }
    }
}

fn hand_over(
    ep: &Endpoint,
    sock: &OwnedFd,
    mode: StartMode,
    launch: Launch<'_>,
) -> Result<(), custody::ChannelError> {
    let held = ep.held();
    let listener = ep.socket.listener().as_fd();
    let mut all: Vec<(u64, BorrowedFd<'_>)> = vec![(LISTENER_ID, listener)];
    all.extend(held.iter().map(|(id, fd)| (*id, fd.as_fd())));
    for batch in all.chunks(custody::MAX_FDS) {
        let ids = batch.iter().map(|(id, _)| *id).collect();
        let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, fd)| *fd).collect();
        custody::send(sock, &Note::Fds { ids }, &fds)?;
    }
    drop(held);
    custody::send(
        sock,
        &Note::Start {
            mode,
            endpoint: ep.spec.id.clone(),
            socket: ep.spec.socket.display().to_string(),
            device: ep.spec.device.clone(),
            adopt_dir: launch.adopt_dir.map(|d| d.display().to_string()),
            fd_budget: launch.fd_budget,
        },
        &[],
    )
}

#[cfg(test)]
mod adopt_from_tests {
    use super::*;

    /// An adoption socket served by this process: it answers one `Adopt` with `Adopted`.
    fn serve(path: &Path) -> std::thread::JoinHandle<Option<Note>> {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .expect("socket");
        let _ = std::fs::remove_file(path);
        rustix::net::bind(&sock, &SocketAddrUnix::new(path).expect("addr")).expect("bind");
        rustix::net::listen(&sock, 4).expect("listen");
        std::thread::spawn(move || {
            let conn = rustix::net::accept(&sock).expect("accept");
            let (note, _) = custody::recv(&conn, &mut Vec::new()).ok()?;
            let pid = std::process::id();
            custody::send(&conn, &Note::Adopted { pid }, &[]).expect("send");
            Some(note)
        })
    }

    #[test]
    fn only_the_recorded_process_on_a_real_socket_is_adopted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w.sock");
        let server = serve(&path);
        let me = std::process::id();
        // The record names another process than the one serving the socket.
        let e = adopt_from(&path, "ep", me + 1).expect_err("another process");
        let wanted = format!(
            "served by process {me}, not by the recorded worker {}",
            me + 1
        );
        assert!(format!("{e:?}").contains(&wanted), "{e:?}");
        let asked = server.join().expect("server");
        assert!(asked.is_none(), "nothing was asked: {asked:?}");
        // A symbolic link to a genuine socket is not followed.
        let server = serve(&path);
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        let e = adopt_from(&link, "ep", me).expect_err("a link");
        assert!(format!("{e:?}").contains("symbolic link"), "{e:?}");
        // Positive control: the recorded process on the socket itself.
        let (_channel, held) = adopt_from(&path, "ep", me).expect("adopted");
        assert!(held.is_empty());
        assert!(matches!(
            server.join().expect("server"),
            Some(Note::Adopt { endpoint }) if endpoint == "ep"
        ));
    }
}

#[cfg(test)]
mod fd_plan_tests {
    use super::FdPlan;

    fn plan(limit: u64, reserve: u32, per_endpoint: u32) -> FdPlan {
        FdPlan {
            limit,
            reserve,
            per_endpoint,
        }
    }

    #[test]
    fn endpoints_fit_the_limit_after_the_reserve_at_their_full_budget() {
        // (limit - reserve) / (budget + the endpoint's own 16)
        assert_eq!(plan(1024, 256, 64).endpoints(), 9);
        assert_eq!(plan(1024, 256, 128).endpoints(), 5);
        assert_eq!(plan(524_288, 256, 1024).endpoints(), 503);
        assert_eq!(
            plan(200, 256, 64).endpoints(),
            0,
            "a reserve over the limit"
        );
        assert_eq!(
            plan(u64::MAX, 256, 1024).endpoints(),
            (u64::MAX - 256) / 1040
        );
    }

    #[test]
    fn a_plan_that_fits_no_endpoint_or_no_worker_says_why() {
        assert_eq!(plan(1024, 256, 64).problem(), None);
        let none = plan(1024, 1000, 64).problem().expect("no endpoint fits");
        assert!(none.contains("not one endpoint fits"), "{none}");
        // One endpoint fits the daemon, but a worker restoring 1024 descriptors three
        // times over does not fit the same limit.
        let worker = plan(2048, 256, 1024)
            .problem()
            .expect("a worker does not fit");
        assert!(worker.contains("3584"), "{worker}");
        assert_eq!(plan(4096, 256, 1024).problem(), None);
    }
}
