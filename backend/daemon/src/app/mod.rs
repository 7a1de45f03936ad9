//! `switchyard daemon`: the pool daemon. It owns the pool (the inventory and its store), a
//! [`Supervisor`] running one worker per leased endpoint, and the control API on a UNIX
//! socket ([`api`]).
//!
//! Who holds what:
//! - the **store** (`<state_dir>/pool.redb`, [`switchyard_pool::Pool`], behind a mutex): boards,
//!   endpoints, leases and the event history; every API mutation is committed there;
//! - the **supervisor**: per endpoint, the listening socket and every descriptor of the
//!   guest's view, and the worker process serving it (replaced when it dies);
//! - **worker records** (`<state_dir>/workers/<id>.pid`, [`records`]): which process serves
//!   which endpoint, so that a restarted daemon recognises workers that outlived it;
//! - the **events** ([`events`]) and **metrics** (`switchyard_control::Metrics`).
//!
//! At start every endpoint with a lease gets its worker. At SIGTERM/SIGINT the API stops and
//! the workers are *released*, not killed ([`Supervisor::release_all`]): guests keep their
//! devices. A restarted daemon (after a crash, or an upgrade of the daemon itself) *adopts*
//! every worker that still runs ([`Supervisor::adopt`], [`crate::keeper`]): it gets back
//! everything the worker holds for its guest and supervises it as if it had started it. A
//! worker that cannot be adopted (one without an adoption socket, or that cannot prove its
//! record's nonce) is reported `orphaned` (with the pid its record names) and left alone:
//! restart, upgrade and moves are refused for it, and so is delete while it runs (the daemon
//! never signals a process it could not prove is its worker; its administrator stops it).
//! A move an earlier daemon left in progress is settled by what the adopted worker did:
//! committed if its data path finished, aborted otherwise (`pending`). Moves and drains
//! are transparent (trapped VRAM only); detach and attach have no data path yet, so
//! the API does not offer them.

mod access;
pub mod api;
pub mod events;
mod owner;
mod paths;
mod pending;
mod reactions;
pub mod records;
mod stats;
mod store;
pub mod systemd;

use std::collections::BTreeMap;
use std::fs;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use switchyard_control::{ControlError, ControlSocket, Metrics};
use switchyard_device::kind::Host;
use switchyard_pool::{Endpoint, Inventory, Pool, PoolConfig, PoolError};

pub(crate) use crate::blocking::{Held, lock};

use crate::custody::device_spec;
use crate::supervisor::{EndpointSpec, Supervisor, SupervisorError};
use events::EventStream;
pub use paths::PathProblem;
use records::WorkerRecords;

/// How long requests still running when the daemon stops may take to finish.
const BLOCKING_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// The environment variable naming the executable started as `<exe> worker` (tests point
/// it at the binary under test); default: this executable.
pub const WORKER_EXE_ENV: &str = "SWITCHYARD_WORKER_EXE";

/// `switchyard daemon`'s options; each overrides its `[daemon]` key.
#[derive(Debug, Clone, Default)]
pub struct DaemonOptions {
    /// The configuration file; none: the embedded default.
    pub config: Option<PathBuf>,
    /// `[daemon] state_dir`.
    pub state_dir: Option<PathBuf>,
    /// The run directory: the control socket is `<run_dir>/control.sock` and endpoint
    /// sockets `<run_dir>/endpoints/<id>.sock` (`[daemon] control_socket` and
    /// `endpoint_dir`).
    pub run_dir: Option<PathBuf>,
    /// The group whose members may use the control and endpoint sockets (0660) and pass
    /// through their directories; none: the daemon's user only (0600).
    pub socket_group: Option<String>,
    /// Allow fault injection (`POST /v1/boards/{id}/fault`), for tests and drills.
    pub faults: bool,
    /// A damaged store (empty, truncated, not a store) is moved aside and a new, empty one
    /// made, instead of refused: every lease it held is lost.
    pub reinit: bool,
    /// Start the workers without their jail (`--no-jail`, for debugging; see
    /// [`crate::jail`]).
    pub no_jail: bool,
}

/// Why the daemon could not start or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The configuration cannot be used (exit status 2).
    #[error("Cannot use the configuration {0}")]
    Config(String, #[source] Box<PoolError>),
    /// A directory cannot be created.
    #[error("Cannot create the directory {0}")]
    Dir(PathBuf, #[source] io::Error),
    /// A directory or file the daemon uses cannot be looked at.
    #[error("Cannot inspect {0}")]
    Inspect(PathBuf, #[source] io::Error),
    /// A directory or file the daemon uses, or a directory above it, could be controlled by
    /// another user (exit status 1: the configuration is fine, the file system is not).
    #[error("Refusing to use {path}, which another user could control: {problem}")]
    Unsafe {
        /// The offending path.
        path: PathBuf,
        /// What is wrong with it.
        problem: PathProblem,
    },
    /// The store cannot be opened (the message says what to do).
    #[error("Cannot open the pool store {} ({})", .0.display(), store::hint(.1))]
    Store(PathBuf, #[source] Box<PoolError>),
    /// A systemd directory variable is set but does not name absolute directories (exit
    /// status 2).
    #[error(
        "${var} is {value:?}, which is not a list of absolute directories; unset it or give absolute paths"
    )]
    Environment {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
    },
    /// The worker executable cannot be found.
    #[error("Cannot find the worker executable")]
    Exe(#[source] io::Error),
    /// The async runtime or the signal handlers cannot be set up.
    #[error("Cannot start the control plane's runtime")]
    Runtime(#[source] io::Error),
    /// The control socket failed.
    #[error("The control API failed")]
    Control(#[from] ControlError),
    /// `[daemon] fds_per_endpoint` and `fd_reserve` do not fit the open-file limit (exit
    /// status 2).
    #[error(
        "Cannot share the daemon's descriptors by `daemon.fds_per_endpoint` and `daemon.fd_reserve`: {0}"
    )]
    FdPlan(String),
    /// The socket group does not exist (exit status 2).
    #[error(
        "The socket group `{group}` does not exist (not in {}); create it (`systemd-sysusers`, `addgroup --system {group}`) or name another",
        file.display()
    )]
    NoGroup {
        /// The group named.
        group: String,
        /// Where it was looked up.
        file: PathBuf,
    },
    /// A socket or directory cannot be given to the socket group.
    #[error("Cannot give {0} to the socket group")]
    Share(PathBuf, #[source] io::Error),
}

impl DaemonError {
    /// The exit status for this error: 2 for a bad configuration, 1 otherwise (an unsafe
    /// directory included: the fix is on the file system, not in the configuration).
    pub fn exit_code(&self) -> u8 {
        match self {
            DaemonError::Config(..)
            | DaemonError::FdPlan(..)
            | DaemonError::NoGroup { .. }
            | DaemonError::Environment { .. } => 2,
            _ => 1,
        }
    }
}

/// Why an endpoint of the store has no supervised worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Unsupervised {
    /// A worker of an earlier daemon still serves the socket.
    Orphaned {
        /// The pid its record names, when that matches a live worker process: a claim, not
        /// proved (it was not adopted), so never signalled.
        pid: Option<u32>,
    },
    /// Starting the worker failed at daemon start.
    NotStarted {
        /// Why.
        error: String,
    },
}

/// The running daemon's state, shared by the API handlers.
pub struct Daemon {
    /// The pool's owner thread: every mutation of the pool is a command run there.
    pool: owner::PoolOwner,
    supervisor: Supervisor,
    unsupervised: Mutex<BTreeMap<String, Unsupervised>>,
    /// Endpoints' VMMs, as registered (`PUT /v1/endpoints/{id}/vmm`; not stored: a restarted
    /// daemon needs them registered again).
    vmms: Mutex<BTreeMap<String, api::authz::RegisteredVmm>>,
    /// Incoming endpoints of live migrations, with their sources (in memory only).
    incoming: Mutex<BTreeMap<String, api::incoming::Incoming>>,
    /// The migration tokens of the endpoint incarnations a finished migration's clean-up
    /// is deleting: one clean-up each (a local migration's commit and its source's VMM
    /// leaving both name the source). Held only to look up, insert or remove.
    releasing: Mutex<std::collections::BTreeSet<String>>,
    /// Failover bookkeeping (the failures themselves are in the store).
    failover: api::failover::Failover,
    events: Arc<EventStream>,
    metrics: Metrics,
    records: WorkerRecords,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("supervisor", &self.supervisor)
            .finish_non_exhaustive()
    }
}

/// The configuration with the options applied.
pub fn resolve_config(options: &DaemonOptions) -> Result<PoolConfig, DaemonError> {
    let mut config = match &options.config {
        Some(path) => PoolConfig::load(path, &switchyard_kinds::Registry)
            .map_err(|e| DaemonError::Config(path.display().to_string(), Box::new(e)))?,
        None => PoolConfig::default(),
    };
    if let Some(dir) = &options.state_dir {
        config.daemon.state_dir = dir.clone();
    }
    if let Some(dir) = &options.run_dir {
        config.daemon.control_socket = dir.join("control.sock");
        config.daemon.endpoint_dir = dir.join("endpoints");
    }
    // The paths may have changed what is valid (endpoint sockets of the configuration).
    config.validate(&switchyard_kinds::Registry).map_err(|e| {
        DaemonError::Config(
            options.config.as_ref().map_or_else(
                || "(embedded default)".to_owned(),
                |p| p.display().to_string(),
            ),
            Box::new(e),
        )
    })?;
    Ok(config)
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn unsafe_path(path: &Path, problem: PathProblem) -> DaemonError {
    DaemonError::Unsafe {
        path: path.to_owned(),
        problem,
    }
}

/// Checks that `meta` (of `path`, not followed) is the daemon's own: not a symbolic link,
/// a directory (`dir`) or a regular file, owned by the daemon's uid, writable by nobody else.
fn check_own(path: &Path, meta: &fs::Metadata, dir: bool) -> Result<(), DaemonError> {
    use std::os::unix::fs::MetadataExt;
    let ft = meta.file_type();
    if ft.is_symlink() {
        return Err(unsafe_path(path, PathProblem::Symlink));
    }
    if dir && !ft.is_dir() {
        return Err(unsafe_path(path, PathProblem::NotDir));
    }
    if !dir && !ft.is_file() {
        return Err(unsafe_path(path, PathProblem::NotFile));
    }
    let ours = euid();
    if meta.uid() != ours {
        let uid = meta.uid();
        return Err(unsafe_path(path, PathProblem::Owner { uid, ours }));
    }
    if meta.mode() & 0o022 != 0 {
        let mode = meta.mode() & 0o7777;
        return Err(unsafe_path(path, PathProblem::Writable { mode }));
    }
    Ok(())
}

/// Checks the directories above `path` (those that exist), as written and as resolved:
/// each is owned by root or the daemon's uid and writable by nobody else unless sticky (like
/// `/tmp`: others cannot rename what is not theirs); a symbolic link on the way is owned by
/// root or the daemon's uid. Otherwise another user could replace the daemon's directory
/// under it (`/tmp/sy` created by someone else, with the daemon's `/tmp/sy/run` in it).
fn check_ancestors(path: &Path) -> Result<(), DaemonError> {
    use std::os::unix::fs::MetadataExt;
    let ours = euid();
    let check = |dir: &Path, meta: &fs::Metadata| {
        let uid = meta.uid();
        if uid != 0 && uid != ours {
            return Err(unsafe_path(dir, PathProblem::ParentOwner { uid }));
        }
        let mode = meta.mode() & 0o7777;
        if meta.is_dir() && mode & 0o022 != 0 && mode & 0o1000 == 0 {
            return Err(unsafe_path(dir, PathProblem::ParentWritable { mode }));
        }
        Ok(())
    };
    let absolute = std::path::absolute(path).map_err(|e| DaemonError::Inspect(path.into(), e))?;
    let mut deepest = None;
    for dir in absolute.ancestors().skip(1) {
        match fs::symlink_metadata(dir) {
            Ok(meta) => {
                check(dir, &meta)?;
                deepest.get_or_insert(dir);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(DaemonError::Inspect(dir.into(), e)),
        }
    }
    // Where the links lead.
    if let Some(deepest) = deepest {
        let resolved =
            fs::canonicalize(deepest).map_err(|e| DaemonError::Inspect(deepest.into(), e))?;
        for dir in resolved.ancestors() {
            let meta =
                fs::symlink_metadata(dir).map_err(|e| DaemonError::Inspect(dir.into(), e))?;
            check(dir, &meta)?;
        }
    }
    Ok(())
}

/// Makes sure `dir` is the daemon's private directory: created (with its missing parents)
/// with mode 0700 when absent; when present, refused unless it is a directory (not a
/// symbolic link) owned by the daemon's uid and writable by nobody else. The directories
/// above it must be safe too ([`check_ancestors`]).
fn private_dir(dir: &Path) -> Result<(), DaemonError> {
    check_ancestors(dir)?;
    match fs::symlink_metadata(dir) {
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent()
                && !parent.as_os_str().is_empty()
            {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(parent)
                    .map_err(|e| DaemonError::Dir(parent.to_owned(), e))?;
            }
            // Not recursive: whatever appeared there meanwhile is checked below, not taken.
            match fs::DirBuilder::new().mode(0o700).create(dir) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(DaemonError::Dir(dir.to_owned(), e)),
            }
        }
        Err(e) => return Err(DaemonError::Inspect(dir.to_owned(), e)),
    }
    let meta = fs::symlink_metadata(dir).map_err(|e| DaemonError::Inspect(dir.to_owned(), e))?;
    check_own(dir, &meta, true)?;
    check_ancestors(dir)
}

/// Runs the daemon until SIGTERM or SIGINT.
pub fn run(options: &DaemonOptions) -> Result<(), DaemonError> {
    let config = resolve_config(options)?;
    // Checked before anything is created: the open-file limit (raised to the hard limit by
    // the binary) must hold the reserve and at least one endpoint at its full budget.
    let fd_plan = crate::supervisor::FdPlan::current(
        config.daemon.fd_reserve,
        config.daemon.fds_per_endpoint,
    );
    if let Some(problem) = fd_plan.problem() {
        return Err(DaemonError::FdPlan(problem));
    }
    // Before anything is created too: a group that does not exist is a bad argument.
    let access = access::socket_access(options.socket_group.as_deref())?;
    let notifier = Arc::new(systemd::Notifier::from_env(|k| std::env::var_os(k)));
    let d = &config.daemon;
    let workers_dir = d.state_dir.join("workers");
    // Every directory the daemon keeps things in is its own and private (or it refuses to
    // start): another user must not serve its sockets, forge its records or aim its store.
    // The control socket's directory before the endpoints' (usually its parent), so that
    // each is reported as itself.
    let control_dir = d
        .control_socket
        .parent()
        .filter(|p| !p.as_os_str().is_empty());
    let dirs = [
        Some(d.state_dir.as_path()),
        Some(workers_dir.as_path()),
        control_dir,
        Some(d.endpoint_dir.as_path()),
    ];
    for dir in dirs.into_iter().flatten() {
        private_dir(dir)?;
    }
    // The socket group passes through the sockets' directories (never the state's).
    access::share_dirs(access, [control_dir, Some(d.endpoint_dir.as_path())])?;
    let exe = match std::env::var_os(WORKER_EXE_ENV) {
        Some(exe) => PathBuf::from(exe),
        None => std::env::current_exe().map_err(DaemonError::Exe)?,
    };
    let (mut pool, report) = store::open(options, &config)?;
    tracing::info!(store = %d.store_path().display(), ?report, "pool opened");
    // The stream starts after the history as loaded: the events of what is done below
    // (quarantines, then the moves left in progress, settled once their workers are
    // adopted: `start_all`) are published after it, in order.
    let last = pool.inventory().next_seq().saturating_sub(1);
    // Boards whose device is not usable (a passthrough device gone) take no new lease.
    let startup_events = check_boards(&mut pool, &Host::default());
    let events = Arc::new(EventStream::new(last));
    let metrics = Metrics::new();
    for b in pool.inventory().boards() {
        metrics.board(&b.id);
    }
    let records = WorkerRecords::new(workers_dir.clone(), records::WorkerIdentity::of(&exe));
    // Where the sink finds the daemon (for a worker's board), once it exists.
    let this: Arc<std::sync::OnceLock<std::sync::Weak<Daemon>>> = Arc::default();
    let follower = api::incoming::follow_migrations(this.clone()).map_err(DaemonError::Runtime)?;
    let migrations = Box::new(move |m| {
        let _ = follower.send(m);
    });
    let sink = reactions::Reactions {
        events: events.clone(),
        metrics: metrics.clone(),
        records: records.clone(),
        daemon: this.clone(),
        migrations,
    }
    .into_sink();
    let control = ControlSocket::bind(&d.control_socket)?;
    access
        .apply(&d.control_socket)
        .map_err(|e| DaemonError::Share(d.control_socket.clone(), e))?;
    tracing::info!(
        limit = fd_plan.limit,
        reserve = fd_plan.reserve,
        per_endpoint = fd_plan.per_endpoint,
        endpoint_own = crate::supervisor::FdPlan::ENDPOINT_OWN,
        endpoints = fd_plan.endpoints(),
        "descriptor plan"
    );
    if options.no_jail {
        tracing::warn!(
            "--no-jail: the workers run without their jail (no seccomp filter, no Landlock, no no-new-privileges)"
        );
    }
    let pool = owner::PoolOwner::start(pool, events.clone()).map_err(DaemonError::Runtime)?;
    let daemon = Arc::new(Daemon {
        pool,
        supervisor: Supervisor::with_events(exe, sink)
            .with_adoption_dir(&workers_dir)
            .with_fd_plan(fd_plan)
            .with_socket_access(access)
            .with_migration_idle_timeout(std::time::Duration::from_secs(d.migration_idle_timeout.0))
            .with_jail(!options.no_jail),
        unsupervised: Mutex::new(BTreeMap::new()),
        vmms: Mutex::new(BTreeMap::new()),
        incoming: Mutex::new(BTreeMap::new()),
        releasing: Mutex::new(std::collections::BTreeSet::new()),
        failover: api::failover::Failover::new(options.faults),
        events,
        metrics,
        records,
    });
    let _ = this.set(Arc::downgrade(&daemon));
    api::failover::spawn_reconciler(Arc::downgrade(&daemon)).map_err(DaemonError::Runtime)?;
    daemon.events.pool(startup_events);
    notifier.status("Starting: adopting the running workers, starting the others");
    daemon.start_all();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(DaemonError::Runtime)?;
    let result = runtime.block_on(async {
        let (router, _doc) = api::router(daemon.clone());
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .map_err(DaemonError::Runtime)?;
        let mut int = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
            .map_err(DaemonError::Runtime)?;
        let events = daemon.events.clone();
        // The control socket listens (connections wait in its backlog until `serve` takes
        // them, right below), every surviving worker is adopted, the signals are caught.
        notifier.ready(&daemon.serving_status(&d.control_socket));
        let stopping = notifier.clone();
        control
            .serve(router, async move {
                tokio::select! {
                    _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
                    _ = int.recv() => tracing::info!("SIGINT: shutting down"),
                }
                stopping.stopping(
                    "Stopping: the endpoints' workers are left running for the next daemon",
                );
                events.close();
            })
            .await
            .map_err(DaemonError::from)
    });
    // A request still working on the blocking pool (a move waits up to its timeout) would
    // hold the process here forever when the runtime is dropped: it gets a grace period,
    // then is cut like a crash would cut it (the store commits atomically; a pending move
    // is settled by the next daemon).
    let stopping = std::time::Instant::now();
    runtime.shutdown_timeout(BLOCKING_GRACE);
    if stopping.elapsed() >= BLOCKING_GRACE {
        tracing::warn!(
            grace_s = BLOCKING_GRACE.as_secs(),
            "requests still running after the shutdown grace period; cut"
        );
    }
    // Stop supervising, but leave every worker running: guests keep their devices.
    for (endpoint, pid) in daemon.supervisor.release_all() {
        tracing::info!(
            endpoint,
            pid,
            "worker left running (a new daemon adopts it)"
        );
    }
    result
}

impl Daemon {
    /// The inventory as of the pool owner's last command (never waits for one).
    pub(crate) fn inventory(&self) -> Arc<Inventory> {
        self.pool.inventory()
    }

    /// A reader of the store's event history.
    pub(crate) fn history_reader(&self) -> switchyard_pool::History {
        self.pool.run(|pool, _| pool.history_reader())
    }

    pub(crate) fn vmms(&self) -> Held<'_, BTreeMap<String, api::authz::RegisteredVmm>> {
        lock(&self.vmms)
    }

    pub(crate) fn unsupervised(&self) -> Held<'_, BTreeMap<String, Unsupervised>> {
        lock(&self.unsupervised)
    }

    /// The worker's spec of an endpoint of `inventory` (none when it holds no device).
    pub(crate) fn spec(
        inventory: &switchyard_pool::Inventory,
        endpoint: &Endpoint,
    ) -> Option<EndpointSpec> {
        let device = inventory.device(endpoint.device.as_deref()?)?;
        Some(EndpointSpec {
            id: endpoint.id.clone(),
            socket: endpoint.socket.clone(),
            device: device_spec(&device.shape, device.host.as_deref()),
            failover: inventory.failover_policy(&device.board)
                != switchyard_pool::FailoverPolicy::Off,
            lease: endpoint.device.clone(),
            migration: crate::custody::MigrationSettings {
                origin: Some(endpoint.migration_token.clone()).filter(|t| !t.is_empty()),
                ..Default::default()
            },
        })
    }

    /// At daemon start: a worker for every endpoint with a lease, unless a worker of an
    /// earlier daemon still serves it (then adopted). A move the store has in progress (an
    /// earlier daemon died during it) is settled once the endpoint's worker is adopted, by
    /// what the worker says of it ([`pending`]); without an adopted worker, aborted.
    fn start_all(&self) {
        let inventory = self.inventory();
        let specs: Vec<EndpointSpec> = inventory
            .endpoints()
            .filter_map(|e| Self::spec(&inventory, e))
            .collect();
        for spec in specs {
            let id = spec.id.clone();
            if let Some(records::Recorded { pid, nonce }) = self.records.live(&id) {
                // A worker of an earlier daemon still serves the endpoint: adopt it, once it
                // proves the record's nonce.
                let served = match self.supervisor.adopt(spec, pid, nonce) {
                    Ok(()) => pending::Served::Adopted,
                    Err(e) => {
                        let error = crate::error_chain::error_chain(&e);
                        tracing::warn!(
                            endpoint = id,
                            pid,
                            "the worker of an earlier daemon still serves this endpoint but cannot be adopted; left alone (orphaned): {error}"
                        );
                        self.unsupervised()
                            .insert(id.clone(), Unsupervised::Orphaned { pid: Some(pid) });
                        pending::Served::NotAdopted(format!(
                            "its worker {pid} cannot be adopted, so what it did is unknown: {error}"
                        ))
                    }
                };
                self.settle_pending_move(&id, &served);
                continue;
            }
            // No worker of an earlier daemon: the device starts afresh where the lease is.
            let none = pending::Served::NotAdopted(
                "no worker of an earlier daemon serves the endpoint; its device starts afresh"
                    .to_owned(),
            );
            self.settle_pending_move(&id, &none);
            // Where the lease is now (settling may have moved it).
            let Some(spec) = self
                .inventory()
                .endpoint(&id)
                .and_then(|e| Self::spec(&self.inventory(), e))
            else {
                continue;
            };
            match self.supervisor.create(spec) {
                Ok(()) => tracing::info!(endpoint = id, "worker started"),
                Err(SupervisorError::Bind(
                    _,
                    switchyard_server::ServerError::SocketInUse(path),
                )) => {
                    tracing::warn!(
                        endpoint = id,
                        socket = %path.display(),
                        "another process serves this endpoint's socket; left alone (orphaned)"
                    );
                    self.unsupervised()
                        .insert(id, Unsupervised::Orphaned { pid: None });
                }
                Err(e) => {
                    let error = crate::error_chain::error_chain(&e);
                    tracing::error!(endpoint = id, "cannot start the worker: {error}");
                    self.unsupervised()
                        .insert(id, Unsupervised::NotStarted { error });
                }
            }
        }
    }
}

/// Checks every board's device at start through its kind ([`DeviceKind::probe`]: a
/// passthrough device missing, not bound to vfio-pci or in a group that is not viable, say),
/// and, in a pool, that it is what the pool's first board is (the kind's identity: a
/// passthrough device's vendor/device ids). A board that fails is quarantined with the
/// reason logged, so that no new lease lands on it (an existing lease stays; its worker
/// reports what fails). Returns the events.
///
/// [`DeviceKind::probe`]: switchyard_device::kind::DeviceKind::probe
fn check_boards(pool: &mut Pool, host: &Host) -> Vec<switchyard_pool::Event> {
    use std::collections::btree_map::Entry;
    use switchyard_device::kind::KindCatalog;
    let boards = pool.inventory().boards();
    let mut events = Vec::new();
    let mut pool_ids: BTreeMap<String, (String, String)> = BTreeMap::new();
    for b in &boards {
        let Some(kind) = switchyard_kinds::Registry.kind(&b.shape.model) else {
            continue;
        };
        let problem = match kind.probe(&b.shape.options, host) {
            Err(e) => Some(e),
            Ok(None) => None,
            Ok(Some(identity)) => match b.pool.as_ref().map(|p| pool_ids.entry(p.clone())) {
                Some(Entry::Occupied(first)) if first.get().1 != identity => {
                    let (reference, theirs) = first.get();
                    Some(format!(
                        "its device is {identity}, the pool's first board {reference} is {theirs}"
                    ))
                }
                Some(Entry::Vacant(slot)) => {
                    slot.insert((b.id.clone(), identity));
                    None
                }
                _ => None,
            },
        };
        if let Some(problem) = problem
            && b.state == switchyard_pool::BoardState::Available
        {
            tracing::warn!(board = %b.id, model = %b.shape.model, %problem, "board quarantined");
            match pool.quarantine(&b.id) {
                Ok(e) => events.extend(e),
                Err(e) => tracing::error!(board = %b.id, error = %e, "cannot quarantine"),
            }
        }
    }
    events
}

#[cfg(test)]
mod tests {
    /// A worker counts latencies in the server's buckets and the daemon adds them to its
    /// histogram bucket by bucket: the bounds must be the same.
    #[test]
    fn worker_latency_buckets_are_the_daemons() {
        let server: Vec<f64> = switchyard_server::stats::LATENCY_BOUNDS_NS
            .iter()
            .map(|&ns| ns as f64 / 1e9)
            .collect();
        assert_eq!(server, switchyard_control::LATENCY_BUCKETS.to_vec());
    }

    use std::os::unix::fs::symlink;

    use super::*;

    /// A fake sysfs with the device `bdf` (`ids`) bound to vfio-pci, alone in IOMMU `group`.
    fn add_device(root: &Path, bdf: &str, ids: (&str, &str), group: u32) {
        let real = root.join("devices/pci0000:00").join(bdf);
        let drv = root.join("bus/pci/drivers/vfio-pci");
        let gdir = root.join("kernel/iommu_groups").join(group.to_string());
        for d in [
            &real,
            &drv,
            &gdir.join("devices"),
            &root.join("bus/pci/devices"),
        ] {
            fs::create_dir_all(d).expect("mkdir");
        }
        symlink(&real, root.join("bus/pci/devices").join(bdf)).expect("link");
        fs::write(real.join("vendor"), format!("{}\n", ids.0)).expect("w");
        fs::write(real.join("device"), format!("{}\n", ids.1)).expect("w");
        fs::write(real.join("class"), "0x00ff00\n").expect("w");
        symlink(&drv, real.join("driver")).expect("link");
        symlink(&gdir, real.join("iommu_group")).expect("link");
        symlink(&real, gdir.join("devices").join(bdf)).expect("link");
    }

    #[test]
    fn passthrough_boards_that_cannot_serve_are_quarantined_at_start() {
        let dir = tempfile::tempdir().expect("tempdir");
        let sys = dir.path().join("sys");
        add_device(&sys, "0000:00:03.0", ("0x1234", "0x11e8"), 3);
        add_device(&sys, "0000:00:04.0", ("0x1234", "0x11e9"), 4);
        let config = PoolConfig::from_toml(
            r#"
[[boards]]
id = "edu0"
model = "vfio"
host = "0000:00:03.0"
[[boards]]
id = "odd"
model = "vfio"
host = "00:04.0"
[[boards]]
id = "gone"
model = "vfio"
host = "0000:00:05.0"
[[boards]]
id = "gpu0"
[[pools]]
name = "edus"
boards = ["edu0", "odd"]
"#,
            &switchyard_kinds::Registry,
        )
        .expect("config");
        let (mut pool, _) = Pool::open(
            &config,
            &switchyard_kinds::Registry,
            &dir.path().join("pool.redb"),
        )
        .expect("pool");
        let events = check_boards(
            &mut pool,
            &Host {
                sysfs: sys.to_path_buf(),
            },
        );
        let state = |id: &str| pool.inventory().board(id).expect("board").state;
        use switchyard_pool::BoardState::{Available, Quarantined};
        assert_eq!(state("edu0"), Available);
        assert_eq!(
            state("odd"),
            Quarantined,
            "other ids than the pool's first board"
        );
        assert_eq!(state("gone"), Quarantined, "no such device");
        assert_eq!(state("gpu0"), Available, "a softgpu is not checked");
        assert_eq!(events.len(), 2, "{events:?}");
        // Already quarantined boards are left alone (no new events) at the next start.
        assert!(
            check_boards(
                &mut pool,
                &Host {
                    sysfs: sys.to_path_buf()
                }
            )
            .is_empty()
        );
    }
}
