//! The worker: one process per endpoint, serving the endpoint's socket with a device whose
//! every descriptor is also held by the supervisor, so that a replacement can continue where
//! it stopped (see `switchyard_server::continuity`).
//!
//! Started by the supervisor as `switchyard worker` with the custody channel as standard
//! input; it receives the held descriptors ([`Note::Fds`]) and a [`Note::Start`], then serves
//! until the listening socket is shut down or the process is killed.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use switchyard_device::PciDevice;
use switchyard_device::blackbox::BlackBox;
use switchyard_device::kind::{
    BoardFailure, Build, FailedHook, KindError, LostHook, PENDING_SUFFIX, pending_object,
};
use switchyard_kinds::Configured;
use switchyard_server::continuity::{self, Continuity};
use switchyard_server::{DeviceSlot, DeviceSocket, MoveGuard, Server, ServerConfig};

use crate::custody::{
    self, BLACK_BOX_ID, CONNECTION_ID, DeviceSpec, LISTENER_ID, MoveReport, Note, StartMode,
};
use crate::keeper::{Keeper, KeeperCustody, adoption_path};
use crate::lifecycle::{LostDevice, LostState, MigrationChange};

/// Why a worker could not serve.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The custody channel failed.
    #[error("Custody channel failed")]
    Channel(#[from] custody::ChannelError),
    /// Something the worker needs was not handed over.
    #[error("The supervisor did not hand over {0}")]
    Missing(&'static str),
    /// The device string is not valid.
    #[error("Invalid device `{0}`")]
    Device(String, #[source] Box<dyn std::error::Error + Send + Sync>),
    /// The black box cannot be used.
    #[error("Black box unusable")]
    BlackBox(#[from] switchyard_device::blackbox::BlackBoxError),
    /// The server failed.
    #[error("Server failed")]
    Server(#[from] switchyard_server::ServerError),
    /// An I/O operation failed.
    #[error("I/O failed")]
    Io(#[from] std::io::Error),
    /// A re-executed image could not take its plan back.
    #[error("Re-exec failed")]
    Reexec(#[from] crate::reexec::ReexecError),
    /// A migration origin token handed over is not one.
    #[error("Invalid migration origin token")]
    Origin(#[from] switchyard_server::origin::BadToken),
    /// The worker could not jail itself (`worker --no-jail` runs it without).
    #[error("Cannot jail the worker")]
    Jail(#[from] crate::jail::JailError),
}

/// What a worker was asked to serve.
#[derive(Debug)]
struct Start {
    mode: StartMode,
    endpoint: String,
    socket: PathBuf,
    /// The device, configured by its kind: the one parse of its options in this worker.
    device: Configured,
    held: BTreeMap<u64, OwnedFd>,
    objects: BTreeMap<String, OwnedFd>,
    adopt_dir: Option<PathBuf>,
    fd_budget: Option<u32>,
    restarts: u64,
    failover: bool,
    lease: Option<String>,
    nonce: Option<custody::WorkerNonce>,
    migration: custody::MigrationSettings,
}

fn receive_start(channel: &OwnedFd) -> Result<Start, WorkerError> {
    let mut held = BTreeMap::new();
    let mut objects = BTreeMap::new();
    let mut buf = Vec::new();
    loop {
        let (note, fds) = custody::recv(channel, &mut buf)?;
        match note {
            Note::Fds { ids } => held.extend(ids.into_iter().zip(fds)),
            Note::Objects { names } => objects.extend(names.into_iter().zip(fds)),
            Note::Start {
                mode,
                endpoint,
                socket,
                device,
                adopt_dir,
                fd_budget,
                restarts,
                failover,
                lease,
                nonce,
                migration,
            } => {
                // A spec is checked where it is made; a worker configures it (a note is only
                // JSON), once: what builds, recovers and moves the device takes the result.
                let device = configure(&device)?;
                return Ok(Start {
                    mode,
                    endpoint,
                    socket: socket.into(),
                    device,
                    held,
                    objects,
                    adopt_dir: adopt_dir.map(PathBuf::from),
                    fd_budget,
                    restarts,
                    failover,
                    lease,
                    nonce,
                    migration,
                });
            }
            other => tracing::warn!(?other, "unexpected custody note before start; ignored"),
        }
    }
}

/// Has the spec's kind parse and check its options: the worker's one parse of them.
fn configure(spec: &DeviceSpec) -> Result<Configured, WorkerError> {
    spec.configure()
        .map_err(|e| WorkerError::Device(spec.to_string(), Box::new(e)))
}

/// Runs a worker on the custody channel `channel` (its standard input), jailed once its
/// device is built unless `jail` is off ([`crate::jail`]).
///
/// One path for every device kind (`switchyard-kinds`): a fresh worker creates the black
/// box with the kind's records, builds the device ([`KindConfig::build`]) and puts the
/// memory objects it names ([`Recoverable`]) into custody; a replacement rebuilds the
/// client's tables, then the device from the black box and those objects
/// ([`KindConfig::recover`]), and continues the connection (see
/// [`Server::resume`]).
///
/// [`KindConfig::build`]: switchyard_device::kind::KindConfig::build
/// [`KindConfig::recover`]: switchyard_device::kind::KindConfig::recover
/// [`Recoverable`]: switchyard_device::Recoverable
pub fn run(
    channel: OwnedFd,
    server_config: impl FnOnce(PathBuf) -> ServerConfig,
    jail: bool,
) -> Result<(), WorkerError> {
    let start = receive_start(&channel)?;
    // Before the first thread: Landlock restricts only the threads started after it.
    let places = crate::jail::Places {
        socket_dirs: start.adopt_dir.iter().cloned().collect(),
        remove_dirs: Vec::new(),
    };
    let jail = crate::jail::begin(jail, &start.device.spec.kind, &places)?;
    serve(Some(channel), start, server_config, jail)
}

/// Runs a worker whose earlier image re-executed it ([`crate::reexec`]): `plan` is the
/// value of [`crate::reexec::REEXEC_FD_ENV`]. It continues the device from what the earlier
/// image held and waits to be adopted by its supervisor (or a new daemon's), in the jail of
/// the earlier image (unless `jail` is off, as it was for that image).
pub fn run_reexeced(
    plan: &str,
    server_config: impl FnOnce(PathBuf) -> ServerConfig,
    jail: bool,
) -> Result<(), WorkerError> {
    let taken = crate::reexec::take_plan(plan)?;
    let p = taken.plan;
    let device = configure(&p.device)?;
    let start = Start {
        mode: StartMode::Resume,
        endpoint: p.endpoint,
        socket: p.socket,
        device,
        held: taken.held,
        objects: taken.objects,
        adopt_dir: p.adopt_dir,
        fd_budget: p.fd_budget,
        restarts: p.restarts,
        failover: p.failover,
        lease: p.lease,
        nonce: p.nonce,
        migration: p.migration,
    };
    let jail = crate::jail::inherited(jail, &start.device.spec.kind);
    serve(None, start, server_config, jail)
}

/// Serves `start`: on `channel` from its supervisor, or (a re-executed image) without one
/// until it is adopted.
fn serve(
    channel: Option<OwnedFd>,
    mut start: Start,
    server_config: impl FnOnce(PathBuf) -> ServerConfig,
    jail: crate::jail::Stage,
) -> Result<(), WorkerError> {
    let span =
        tracing::info_span!("endpoint", id = %start.endpoint, device = %start.device.spec.kind);
    let _g = span.enter();
    let keeper = Arc::new(match channel {
        Some(channel) => Keeper::new(&start.endpoint, channel, &start.held, &start.objects)?,
        None => {
            tracing::info!("re-executed in place; continuing the device, waiting to be adopted");
            Keeper::unsupervised(&start.endpoint, &start.held, &start.objects)?
        }
    });
    keeper.set_restarts(start.restarts);
    keeper.set_lease(start.lease.clone());
    keeper.set_nonce(start.nonce.clone());
    let identity = crate::reexec::Identity {
        endpoint: start.endpoint.clone(),
        socket: start.socket.clone(),
        adopt_dir: start.adopt_dir.clone(),
        fd_budget: start.fd_budget,
        failover: start.failover,
        nonce: start.nonce.clone(),
        migration: start.migration.clone(),
    };
    if let Some(dir) = &start.adopt_dir {
        let path = adoption_path(dir, std::process::id());
        if let Err(e) = keeper.serve_adoptions(path.clone()) {
            tracing::warn!(path = %path.display(), error = %e, "no adoption socket: a new daemon cannot adopt this worker");
        }
    }
    let listener = UnixListener::from(
        start
            .held
            .remove(&LISTENER_ID)
            .ok_or(WorkerError::Missing("the listening socket"))?,
    );
    let mut config = server_config(start.socket.clone());
    config.fd_budget = start.fd_budget;
    apply_migration(&mut config, &start.migration)?;
    let socket = DeviceSocket::adopt(listener, start.socket.clone());
    let Configured {
        spec,
        config: device,
    } = &start.device;
    let custody = || Box::new(KeeperCustody(keeper.clone()));
    let lost: LostHook = {
        let k = keeper.clone();
        // What is lost: the host resource the device holds (a PCI address), else the spec.
        let what = device
            .profile()
            .exclusive
            .unwrap_or_else(|| spec.to_string());
        Arc::new(move |reason: String| {
            k.notify(&Note::DeviceLost(LostDevice {
                host: what.clone(),
                reason,
            }));
        })
    };
    let failed: FailedHook = {
        let (k, failover) = (keeper.clone(), start.failover);
        Arc::new(move |failure: BoardFailure| {
            k.notify(&Note::BoardFailed(crate::lifecycle::BoardFailure {
                reason: failure.reason,
                state_intact: failure.state_intact,
            }));
            failover
        })
    };
    let device_error = |e: KindError| WorkerError::Device(spec.to_string(), Box::new(e));
    let (mut server, continuity, resumed, connection) = match start.mode {
        StartMode::Fresh => {
            // Nothing to continue: a connection held from before is closed.
            if start.held.remove(&CONNECTION_ID).is_some() {
                keeper.release(&[CONNECTION_ID]);
            }
            let mut records = Continuity::records(&config.limits);
            records.extend(device.black_box_records());
            let bb = BlackBox::create(&records)?;
            keeper.hold(&[BLACK_BOX_ID], &[bb.file().as_fd()])?;
            let continuity = Continuity::new(&bb, custody())?;
            let black_box = Some(bb.clone());
            let server = Server::with_device(config, socket, |ctx| {
                let build = Build {
                    ctx,
                    black_box,
                    objects: BTreeMap::new(),
                    lost: Some(lost),
                    failed: Some(failed.clone()),
                };
                device.build(build).map_err(device_error)
            })?;
            (server, continuity, None, None)
        }
        StartMode::Resume => {
            let bb = BlackBox::open(
                start
                    .held
                    .remove(&BLACK_BOX_ID)
                    .ok_or(WorkerError::Missing("the black box"))?
                    .into(),
            )?;
            let (continuity, resumed) = Continuity::resume(&bb, custody())?;
            let connection = start.held.remove(&CONNECTION_ID);
            // Without a connection the client is gone: its tables are not restored (the
            // supervisor may have let go of their descriptors) but released.
            let no_client = continuity::Resumed::default();
            let tables = if connection.is_some() {
                &resumed
            } else {
                &no_client
            };
            let objects = std::mem::take(&mut start.objects)
                .into_iter()
                .map(|(name, fd)| (name, std::fs::File::from(fd)))
                .collect();
            let black_box = Some(bb.clone());
            let held = &start.held;
            let (server, lost) = Server::resume(
                config,
                socket,
                tables,
                |id| held.get(&id).and_then(|f| f.try_clone().ok()),
                |ctx| {
                    let build = Build {
                        ctx,
                        black_box,
                        objects,
                        lost: Some(lost),
                        failed: Some(failed),
                    };
                    device.recover(build).map_err(device_error)
                },
            )?;
            report_lost_state(&keeper, &continuity, lost);
            (server, continuity, Some(resumed), connection)
        }
    };
    server.set_continuity(Arc::new(continuity));
    let replacement = hold_objects(&keeper, &server)?;
    spawn_control(&keeper, server.device_slot(), identity, spec.clone())?;
    spawn_stats(&keeper, &server)?;
    report_migrations(&keeper, &server);
    // The device is built, every socket bound: the seccomp filter, on every thread.
    crate::jail::complete(jail)?;
    if let Some(delay) = crate::knobs::ready_delay(&start.endpoint) {
        tracing::warn!(?delay, "test knob: the ready note is delayed");
        std::thread::sleep(delay);
    }
    keeper.notify(&Note::Ready {
        resumed: connection.is_some(),
        replacement: Some(replacement),
    });
    match (connection, &resumed) {
        (Some(conn), Some(resumed)) => {
            tracing::info!(
                windows = resumed.windows.len(),
                vectors = resumed.vectors.len(),
                journal_bytes = resumed.rx.len(),
                "worker resumed the connection"
            );
            server.run_resumed(UnixStream::from(conn), resumed, start.held)?;
        }
        (_, Some(_)) => {
            tracing::info!("worker resumed (no client connected)");
            server.run_resumed_without_client(start.held)?;
        }
        _ => {
            tracing::info!(socket = %start.socket.display(), "worker serving (fresh device)");
            server.run()?;
        }
    }
    Ok(())
}

/// Puts the memory objects the device names ([`Recoverable::held_objects`]) into custody
/// under their names, and lets go of any pending one (a relocation's target that a
/// predecessor died with: the device runs on one of the two, now held under its name).
/// Returns how a replacement must start: resumed when the device can be recovered.
fn hold_objects(keeper: &Keeper, server: &Server) -> Result<StartMode, WorkerError> {
    let objects = server
        .device_slot()
        .with(|d| d.recoverable().map(|r| r.held_objects()).transpose());
    let objects = objects
        .map_err(|e| WorkerError::Device("the device's memory objects".into(), Box::new(e)))?;
    let mode = match objects {
        Some(objects) => {
            keeper.hold_objects(&objects)?;
            StartMode::Resume
        }
        None => StartMode::Fresh,
    };
    let pending: Vec<String> = keeper
        .object_names()
        .into_iter()
        .filter(|n| n.ends_with(PENDING_SUFFIX))
        .collect();
    keeper.release_objects(&pending);
    Ok(mode)
}

/// A replacement that could not restore all of the client's state says so, to its log and
/// to the supervisor ([`Note::StateLost`]): the client was told those windows and eventfds
/// succeeded, so the loss must be visible, never only a log line. What was lost leaves the
/// tables (and its descriptors custody).
fn report_lost_state(
    keeper: &Keeper,
    continuity: &Continuity,
    lost: switchyard_server::Unrestored,
) {
    if lost.problems.is_empty() {
        return;
    }
    for p in &lost.problems {
        tracing::error!(problem = %p, "could not restore all of the client's state");
    }
    continuity.forget(&lost);
    keeper.notify(&Note::StateLost(LostState {
        problems: lost.problems,
    }));
}

/// Serves the supervisor's requests ([`Note::Move`]) on a thread of its own, one at a time,
/// from whichever supervisor is attached (a new one after an adoption). `device` is the
/// spec of the device it serves; a move's `target` replaces it.
fn spawn_control(
    keeper: &Arc<Keeper>,
    slot: DeviceSlot,
    identity: crate::reexec::Identity,
    mut device: DeviceSpec,
) -> Result<(), WorkerError> {
    let keeper = keeper.clone();
    std::thread::Builder::new()
        .name("sy-worker-ctl".into())
        .spawn(move || {
            let mut buf = Vec::new();
            loop {
                let (generation, channel) = keeper.channel();
                let note = match custody::recv(&*channel, &mut buf) {
                    Ok((note, _)) => note,
                    Err(e) => {
                        if !matches!(e, custody::ChannelError::Closed) {
                            tracing::error!(error = %e, "custody channel unreadable");
                        }
                        keeper.lost(generation);
                        continue;
                    }
                };
                match note {
                    Note::Move {
                        to,
                        detached,
                        target,
                    } => {
                        let span = tracing::info_span!("move", to = %to, detached);
                        let _g = span.enter();
                        // The keeper remembers the move and its outcome, for a supervisor
                        // that adopts this worker after the one that asked died.
                        if !keeper.begin_move(generation, &to) {
                            tracing::warn!(
                                "a move asked by a supervisor that is gone (the worker was adopted since); not run"
                            );
                            continue;
                        }
                        // The successor is made a device of the board it lands on: the
                        // target's spec, or (a move between boards of one spec, e.g. two
                        // partitions of a GPU) this one's, whose kind attaches it there.
                        let target = target.unwrap_or_else(|| device.clone());
                        let answer = match relocate(&slot, &keeper, detached, &target) {
                            Ok(report) => {
                                tracing::info!(?report, "device moved");
                                device = target;
                                Note::Moved { report }
                            }
                            Err(e) => {
                                let error = crate::error_chain::error_chain(&e);
                                tracing::warn!(%error, "move failed; the device stays");
                                Note::MoveFailed { error }
                            }
                        };
                        keeper.end_move(&answer);
                    }
                    Note::Fault { kind } => inject_fault(&slot, &keeper, &kind),
                    Note::FailureUnhandled => slot.with(|d| d.failure_unhandled()),
                    Note::Sync { token } => keeper.synced(generation, token),
                    Note::Reexec { device, lease } => {
                        tracing::warn!(?lease, "re-executing in place (a failover or replacement)");
                        // Returns only if the exec failed: this image serves on; the
                        // supervisor kills it past its wait.
                        let e = crate::reexec::exec(&keeper, &identity, device, lease);
                        tracing::error!(
                            "cannot re-execute: {}",
                            crate::error_chain::error_chain(&e)
                        );
                    }
                    other => tracing::warn!(?other, "unexpected custody note; ignored"),
                }
            }
        })?;
    Ok(())
}

/// Simulates the board fault `kind` on the device ([`Note::Fault`]). The supervisor is
/// answered before the fault is injected: the failure it sets off gets this worker killed
/// (a failover) within milliseconds, and the answer must not die with it.
fn inject_fault(slot: &DeviceSlot, keeper: &Keeper, kind: &str) {
    let refused = slot.with(|d| match d.faults() {
        Some(f) if f.fault_kinds().contains(&kind) => None,
        Some(f) => Some(format!(
            "this device simulates no fault `{kind}` (it simulates: {})",
            f.fault_kinds().join(", ")
        )),
        None => Some("this kind of device simulates no faults".to_owned()),
    });
    keeper.notify(&Note::FaultInjected {
        error: refused.clone(),
    });
    if let Some(error) = refused {
        tracing::warn!(kind, %error, "fault not injected");
        return;
    }
    let injected = slot.with(|d| d.faults().map(|f| f.inject_fault(kind)));
    match injected {
        Some(Ok(())) => tracing::warn!(kind, "fault injected (a drill)"),
        Some(Err(e)) => tracing::error!(
            kind,
            error = %crate::error_chain::error_chain(&e),
            "fault not injected"
        ),
        None => tracing::error!(kind, "the device changed and offers no faults any more"),
    }
}

/// The supervisor's migration settings on the server's configuration: the origin tokens
/// (checked), the idle timeout (the server's default unless given).
fn apply_migration(
    config: &mut ServerConfig,
    m: &custody::MigrationSettings,
) -> Result<(), WorkerError> {
    use switchyard_server::origin::OriginToken;
    let token = |t: &Option<String>| t.as_deref().map(OriginToken::parse).transpose();
    config.migration_origin = token(&m.origin)?;
    config.migration_expect_origin = token(&m.expect_origin)?;
    if let Some(ms) = m.idle_timeout_ms {
        config.migration_idle_timeout = Some(std::time::Duration::from_millis(ms));
    }
    Ok(())
}

/// Tells the supervisor when a migration stream opens or closes ([`Note::Migration`]).
fn report_migrations(keeper: &Arc<Keeper>, server: &Server) {
    use switchyard_proto::MigState;
    let keeper = keeper.clone();
    server.device_slot().set_migration_hook(Arc::new(
        move |change: switchyard_server::MigChange| {
            let streaming = matches!(
                change.to,
                MigState::PreCopy | MigState::PreCopyP2p | MigState::StopCopy | MigState::Resuming
            );
            keeper.notify(&Note::Migration {
                streaming,
                change: Some(MigrationChange {
                    state: crate::custody::mig_state_name(change.to).to_owned(),
                    cause: change.cause.name().to_owned(),
                    origin_verified: change.origin_verified,
                    sent: change.sent,
                }),
            });
        },
    ));
}

/// How often a worker reports what it served.
const STATS_PERIOD: std::time::Duration = std::time::Duration::from_secs(1);

/// Reports what the server served and the device did ([`Note::Stats`]) every
/// [`STATS_PERIOD`], when something happened.
fn spawn_stats(keeper: &Arc<Keeper>, server: &Server) -> Result<(), WorkerError> {
    let (keeper, requests, slot) = (keeper.clone(), server.request_stats(), server.device_slot());
    // The baseline is taken here, before the worker serves: taken by the thread, it could
    // come after the first requests (a thread started late on a loaded machine) and they
    // would never be reported.
    let mut last = requests.snapshot();
    // The device's counters, with which device they are of (its address: a move swaps in
    // a successor, allocated while its predecessor still lives, whose counters start anew).
    let work = move || {
        slot.with(|d| {
            let device =
                std::ptr::from_ref::<dyn switchyard_device::PciDevice>(d).cast::<()>() as usize;
            (device, d.telemetry().map(|t| t.work()).unwrap_or_default())
        })
    };
    // What the device's recovery did (replays, interruptions) happened before this worker
    // served: counted from zero, so that the first report carries it.
    let (mut device, first) = work();
    let mut last_work = switchyard_device::WorkCounters {
        replayed: 0,
        interrupted: 0,
        ..first
    };
    // A test knob may make the reports frequent, and sent even when empty.
    let knob = crate::knobs::stats_period();
    std::thread::Builder::new()
        .name("sy-worker-stats".into())
        .spawn(move || {
            // The first report goes at once (what the recovery did: a worker killed again
            // within a period would take it along), then every period.
            let mut first = true;
            loop {
                if !std::mem::take(&mut first) {
                    std::thread::sleep(knob.unwrap_or(STATS_PERIOD));
                }
                let now = requests.snapshot();
                let (now_device, work) = work();
                if now_device != device {
                    // A successor (a move): all it counted (its recovery's replays and
                    // interruptions included) is new.
                    device = now_device;
                    last_work = switchyard_device::WorkCounters::default();
                }
                let d = now.since(&last);
                let stats = crate::custody::WorkerStats {
                    messages: (0u16..)
                        .zip(&d.by_command)
                        .filter(|(_, n)| **n > 0)
                        .map(|(c, n)| (c, *n))
                        .collect(),
                    latency_buckets: d.buckets,
                    latency_sum_ns: d.sum_ns,
                    jobs: work.commands.saturating_sub(last_work.commands),
                    bytes: work.bytes.saturating_sub(last_work.bytes),
                    errors: work.errors.saturating_sub(last_work.errors),
                    replayed: work.replayed.saturating_sub(last_work.replayed),
                    interrupted: work.interrupted.saturating_sub(last_work.interrupted),
                };
                (last, last_work) = (now, work);
                if !stats.is_empty() || knob.is_some() {
                    keeper.notify(&Note::Stats(stats));
                }
            }
        })?;
    Ok(())
}

/// Pre-copy rounds end when one copies at most this much (the final round, with the device
/// stopped, then has about as much to copy)...
const SETTLED_BYTES: u64 = 256 << 10;
/// ... or after this many rounds (a guest writing faster than the copy).
const MAX_ROUNDS: u32 = 12;

/// Why a move failed (the device keeps running where it was).
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// The server refused (a migration or another move in progress) or the swap failed.
    #[error("The device cannot be moved now")]
    Swap(#[from] switchyard_server::SwapError),
    /// The device cannot relocate (its kind offers no
    /// [`Relocatable`](switchyard_device::Relocatable)).
    #[error("This kind of device cannot be moved under its client")]
    NotMovable,
    /// The device refused or failed the copy.
    #[error("The device cannot be relocated")]
    Device(#[from] switchyard_device::DeviceError),
    /// The new memory could not be put in custody.
    #[error("Cannot put the new memory in custody")]
    Custody(#[source] std::io::Error),
    /// The target board's kind cannot take the device (its successor could not be made
    /// one of the target's: e.g. the target's GPU cannot be opened).
    #[error("The target board cannot take the device")]
    Target(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Moves the device in `slot` onto new memory ([`move_in_slot`]), the new memory in custody
/// under its pending name until the device runs on it, then under its name.
fn relocate(
    slot: &DeviceSlot,
    keeper: &Keeper,
    detached: bool,
    target: &DeviceSpec,
) -> Result<MoveReport, MoveError> {
    // The target's spec, configured before anything moves.
    let target = target
        .configure()
        .map_err(|e| MoveError::Target(Box::new(e)))?;
    let moving = slot.begin_move()?;
    let mut pending = Vec::new();
    let mut targets = Vec::new();
    let adopt = |next: &mut dyn PciDevice| -> Result<(), MoveError> {
        target
            .config
            .adopt_successor(next)
            .map_err(|e| MoveError::Target(Box::new(e)))
    };
    let result = move_in_slot(slot, &moving, detached, adopt, |objects| {
        // Held before the device can run on them, so that a replacement finds them.
        let held: Vec<(String, std::fs::File)> = objects
            .iter()
            .map(|(name, f)| Ok((pending_object(name), f.try_clone()?)))
            .collect::<std::io::Result<_>>()
            .map_err(MoveError::Custody)?;
        pending = held.iter().map(|(n, _)| n.clone()).collect();
        keeper.hold_objects(&held).map_err(MoveError::Custody)?;
        targets = objects
            .iter()
            .map(|(name, f)| Ok((name.clone(), f.try_clone()?)))
            .collect::<std::io::Result<_>>()
            .map_err(MoveError::Custody)?;
        Ok(())
    });
    // The data path's outcome is the truth: a device that runs on the target has moved,
    // whatever custody says; a custody failure now is a warning in the report (a
    // replacement would find the target under its pending name, or the old memory under
    // the name: see `hold_objects`). The pending names go in every case.
    let result = result.map(|mut report| {
        if let Err(e) = hold_after_swap(keeper, &targets) {
            let error = crate::error_chain::error_chain(&e);
            tracing::error!(%error, "the device moved but its new memory is not in custody under its name");
            report.custody_error = Some(error);
        }
        report
    });
    keeper.release_objects(&pending);
    drop(moving);
    result
}

/// Puts the memory a moved device runs on into custody under its names. A test build
/// fails it when `SWITCHYARD_TEST_FAIL_CUSTODY_AFTER_SWAP` is set (the lease must follow
/// the device all the same).
fn hold_after_swap(keeper: &Keeper, targets: &[(String, std::fs::File)]) -> Result<(), MoveError> {
    #[cfg(debug_assertions)]
    if std::env::var_os("SWITCHYARD_TEST_FAIL_CUSTODY_AFTER_SWAP").is_some() {
        return Err(MoveError::Custody(std::io::Error::other(
            "custody failure injected (SWITCHYARD_TEST_FAIL_CUSTODY_AFTER_SWAP)",
        )));
    }
    keeper.hold_objects(targets).map_err(MoveError::Custody)
}

/// Moves the device in `slot` onto new memory under its client (see [`move_in_slot`]),
/// without custody: what `switchyard-bench` measures.
pub fn move_device_in_slot(
    slot: &DeviceSlot,
    moving: &MoveGuard,
    detached: bool,
) -> Result<MoveReport, MoveError> {
    move_in_slot(slot, moving, detached, |_| Ok(()), |_| Ok(()))
}

/// Moves the device in `slot` onto new memory under its client, the sequence a worker runs
/// for a [`Note::Move`] ([`Relocatable`](switchyard_device::Relocatable)): the relocation
/// creates the new memory (`on_targets` sees it before anything runs on it), then pre-copy
/// rounds while the device runs until one copies at most 256 KiB or 12 rounds ran, the
/// successor built on the new memory (parked) and made the target's (`adopt`: the target
/// board's kind, e.g. its GPU attached), one more round for what was written while it
/// was built, the engines parked (the commands running finish), then [`DeviceSlot::swap`],
/// which copies the pages
/// written since the last round and hands the state over. Downtime: from the engines parked
/// to the swap done. `_moving` is the slot's move guard ([`DeviceSlot::begin_move`]), held
/// by the caller for the whole move.
///
/// `detached`: no client is connected (the VMM unplugged the device for a guest-visible
/// move), so memory the guest could map moves too ([`DeviceSlot::swap_detached`], which
/// refuses if a client connected meanwhile).
///
/// On an error the device keeps running where it was; the new memory is not used.
pub fn move_in_slot(
    slot: &DeviceSlot,
    _moving: &MoveGuard,
    detached: bool,
    adopt: impl FnOnce(&mut dyn PciDevice) -> Result<(), MoveError>,
    on_targets: impl FnOnce(&[(String, std::fs::File)]) -> Result<(), MoveError>,
) -> Result<MoveReport, MoveError> {
    let t0 = Instant::now();
    let mut relocation = slot
        .with(|d| d.relocatable().map(|r| r.begin_relocation(detached)))
        .ok_or(MoveError::NotMovable)??;
    on_targets(&relocation.targets()?)?;
    loop {
        let n = relocation.round()?;
        if n <= SETTLED_BYTES || relocation.rounds() >= MAX_ROUNDS {
            break;
        }
    }
    let mut next = relocation.successor(slot.context().clone())?;
    // Made the target board's device before it runs (another kind of the same device,
    // another GPU).
    adopt(next.as_mut())?;
    // Building the successor (its engine threads) takes a while: catch up on what was written
    // meanwhile, so that the stop copies only what the parking lets through.
    next.relocatable()
        .ok_or(MoveError::NotMovable)?
        .relocation_round()?;
    let precopy = t0.elapsed();
    let quiesce = slot.prepare_swap()?.quiesce;
    let t_park = Instant::now();
    let parked = quiesce.park();
    let t_stop = Instant::now();
    let swapped = if detached {
        slot.swap_detached(next)
    } else {
        slot.swap(next)
    };
    drop(parked);
    let swapped = swapped?;
    let downtime = t_stop.elapsed();
    let stats = slot
        .with(|d| d.relocatable().and_then(|r| r.relocation_stats()))
        .unwrap_or_default();
    // The old device's threads are joined outside the slot.
    drop(swapped.old);
    let us = |d: std::time::Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
    Ok(MoveReport {
        rounds: stats.rounds,
        bytes: stats.bytes,
        last_round_bytes: stats.last_round_bytes,
        final_bytes: stats.final_bytes,
        precopy_us: us(precopy),
        park_wait_us: us(t_stop - t_park),
        downtime_us: us(downtime),
        held_us: us(swapped.held),
        final_copy_us: us(stats.final_copy),
        custody_error: None,
    })
}
