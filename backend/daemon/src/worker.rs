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

use switchyard_device::blackbox::BlackBox;
use switchyard_server::continuity::{self, Continuity};
use switchyard_server::{DeviceSocket, Server, ServerConfig};
use switchyard_softgpu::{SoftGpu, SoftGpuConfig};

use std::time::Instant;

use switchyard_server::{DeviceSlot, MoveGuard};
use switchyard_softgpu::VramRef;

use crate::custody::WorkerDevice;
use crate::custody::{
    self, BLACK_BOX_ID, CONNECTION_ID, DOORBELLS_ID, LISTENER_ID, MoveReport, Note, StartMode,
    VRAM_ID, VRAM_NEXT_ID,
};
use crate::keeper::{Keeper, KeeperCustody, adoption_path};

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
}

/// What a worker was asked to serve.
#[derive(Debug)]
struct Start {
    mode: StartMode,
    endpoint: String,
    socket: PathBuf,
    device: WorkerDevice,
    held: BTreeMap<u64, OwnedFd>,
    adopt_dir: Option<PathBuf>,
    fd_budget: Option<u32>,
}

fn receive_start(channel: &OwnedFd) -> Result<Start, WorkerError> {
    let mut held = BTreeMap::new();
    let mut buf = Vec::new();
    loop {
        let (note, fds) = custody::recv(channel, &mut buf)?;
        match note {
            Note::Fds { ids } => held.extend(ids.into_iter().zip(fds)),
            Note::Start {
                mode,
                endpoint,
                socket,
                device,
                adopt_dir,
                fd_budget,
            } => {
                if let WorkerDevice::Softgpu(gpu) = &device {
                    gpu.validate()
                        .map_err(|e| WorkerError::Device(format!("{gpu:?}"), Box::new(e)))?;
                }
                let config = device;
                return Ok(Start {
                    mode,
                    endpoint,
                    socket: socket.into(),
                    device: config,
                    held,
                    adopt_dir: adopt_dir.map(PathBuf::from),
                    fd_budget,
                });
            }
            other => tracing::warn!(?other, "unexpected custody note before start; ignored"),
        }
    }
}

/// Runs a worker on the custody channel `channel` (its standard input).
pub fn run(
    channel: OwnedFd,
    server_config: impl FnOnce(PathBuf) -> ServerConfig,
) -> Result<(), WorkerError> {
    let mut start = receive_start(&channel)?;
    let span = tracing::info_span!("endpoint", id = %start.endpoint);
    let _g = span.enter();
    let keeper = Arc::new(Keeper::new(&start.endpoint, channel, &start.held)?);
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
    let socket = DeviceSocket::adopt(listener, start.socket.clone());
    let gpu = match start.device.clone() {
        WorkerDevice::Softgpu(gpu) => gpu,
        WorkerDevice::Vfio { host, bars } => {
            let held = std::mem::take(&mut start.held);
            return serve_passthrough(start.mode, held, &keeper, config, socket, host, bars);
        }
    };
    match start.mode {
        StartMode::Fresh => {
            let mut records = Continuity::records(&config.limits);
            records.extend(SoftGpu::black_box_records(&gpu));
            let bb = BlackBox::create(&records)?;
            keeper.hold(&[BLACK_BOX_ID], &[bb.file().as_fd()])?;
            let continuity = Continuity::new(&bb, Box::new(KeeperCustody(keeper.clone())))?;
            let bb2 = bb.clone();
            let mut server = Server::with_socket(config, socket, |ctx| {
                SoftGpu::with_black_box(gpu, ctx, &bb2, None)
            })?;
            let (vram, doorbells) = server
                .device_slot()
                .with_as::<SoftGpu, _>(|g| {
                    Ok::<_, WorkerError>((
                        g.vram_file().try_clone()?,
                        g.doorbell_memfd().map_err(std::io::Error::other)?,
                    ))
                })
                .ok_or(WorkerError::Missing("the device's VRAM"))??;
            keeper.hold(&[VRAM_ID, DOORBELLS_ID], &[vram.as_fd(), doorbells.as_fd()])?;
            server.set_continuity(Arc::new(continuity));
            spawn_control(&keeper, server.device_slot(), Some(gpu))?;
            spawn_stats(&keeper, &server)?;
            report_migrations(&keeper, &server);
            keeper.notify(&Note::Ready { resumed: false });
            tracing::info!(socket = %start.socket.display(), "worker serving (fresh device)");
            server.run()?;
        }
        StartMode::Resume => {
            let bb = BlackBox::open(
                start
                    .held
                    .remove(&BLACK_BOX_ID)
                    .ok_or(WorkerError::Missing("the black box"))?
                    .into(),
            )?;
            // Two VRAMs are held when the last worker died during a move: the black box
            // says which one the device ran on.
            let saved = SoftGpu::black_box_vram(&gpu, &bb)
                .map_err(|e| WorkerError::Device(format!("{gpu:?}"), Box::new(e)))?;
            let current = start.held.remove(&VRAM_ID);
            let next = start.held.remove(&VRAM_NEXT_ID);
            let moved = next.as_ref().and_then(identity) == Some(saved);
            let vram = if moved { next } else { current }
                .ok_or(WorkerError::Missing("the device's VRAM"))?;
            let vram_held = vram.try_clone()?;
            // Workers from before the doorbell page kept none: the device makes a new one.
            let doorbells = start.held.remove(&DOORBELLS_ID).map(std::fs::File::from);
            let connection = start.held.remove(&CONNECTION_ID);
            let (continuity, resumed) =
                Continuity::resume(&bb, Box::new(KeeperCustody(keeper.clone())))?;
            let held = &start.held;
            let bb2 = bb.clone();
            let mut problems = switchyard_server::Unrestored::default();
            // Without a connection the client is gone: its tables are not restored (the
            // supervisor may have let go of their descriptors) but released.
            let no_client = continuity::Resumed::default();
            let tables = if connection.is_some() {
                &resumed
            } else {
                &no_client
            };
            let mut server = Server::with_socket(config, socket, |ctx| {
                problems = Server::restore_tables(&ctx, tables, |id| {
                    held.get(&id).and_then(|f| f.try_clone().ok())
                });
                let (gpu, recovery) = SoftGpu::recover(gpu, ctx, &bb2, vram.into(), doorbells)?;
                tracing::info!(queues = ?recovery.queues, resent_interrupts = recovery.resent, "device recovered");
                Ok::<_, switchyard_softgpu::SoftGpuError>(gpu)
            })?;
            report_lost_state(&keeper, &continuity, problems);
            server.set_continuity(Arc::new(continuity));
            // Whatever VRAM the device runs on is the one held as its VRAM from now on.
            if moved {
                keeper.hold(&[VRAM_ID], &[vram_held.as_fd()])?;
            }
            keeper.release(&[VRAM_NEXT_ID]);
            drop(vram_held);
            spawn_control(&keeper, server.device_slot(), Some(gpu))?;
            spawn_stats(&keeper, &server)?;
            report_migrations(&keeper, &server);
            keeper.notify(&Note::Ready {
                resumed: connection.is_some(),
            });
            match connection {
                Some(conn) => {
                    tracing::info!(
                        windows = resumed.windows.len(),
                        vectors = resumed.vectors.len(),
                        journal_bytes = resumed.rx.len(),
                        "worker resumed the connection"
                    );
                    server.run_resumed(UnixStream::from(conn), &resumed, start.held)?;
                }
                None => {
                    tracing::info!("worker resumed (no client connected)");
                    server.run_resumed_without_client(start.held)?;
                }
            }
        }
    }
    Ok(())
}

/// Black box record of a passthrough device's client configuration.
const VFIO_RECORD: &str = "vfio.config";

/// Serves a passthrough device (`switchyard-vfio`) with crash continuity by *reset + replay*:
/// the device publishes the client's configuration (config-space bits, MSI-X table) into the
/// black box after every change; the supervisor holds the connection and the client's
/// descriptors. A replacement (`mode` [`StartMode::Resume`]) opens the device again (the
/// kernel reset it when the dead worker's descriptors closed), replays the configuration,
/// maps the client's DMA windows into the new IOMMU container, hands the client's eventfds
/// to the kernel again and continues the connection: the VMM keeps its socket and the guest
/// its device, which lost its internal state (as after a function reset). When the kernel
/// takes the device back (unbind, removal) the endpoint fails cleanly and the supervisor is
/// told ([`Note::DeviceLost`]).
fn serve_passthrough(
    mode: StartMode,
    mut held: BTreeMap<u64, OwnedFd>,
    keeper: &Arc<Keeper>,
    config: ServerConfig,
    socket: DeviceSocket,
    host: String,
    bars: switchyard_pool::Bars,
) -> Result<(), WorkerError> {
    use switchyard_device::blackbox::RecordSpec;
    let mut vfio = switchyard_vfio::VfioConfig::new(host);
    vfio.bars = match bars {
        switchyard_pool::Bars::Trap => switchyard_vfio::BarMode::Trap,
        switchyard_pool::Bars::Mmap => switchyard_vfio::BarMode::Mmap,
    };
    let custody = || Box::new(KeeperCustody(keeper.clone()));
    let (bb, continuity, resumed) = match mode {
        StartMode::Fresh => {
            // Nothing to continue: a connection held from before is closed.
            if held.remove(&CONNECTION_ID).is_some() {
                keeper.release(&[CONNECTION_ID]);
            }
            let mut records = Continuity::records(&config.limits);
            records.push(RecordSpec::new(
                VFIO_RECORD,
                switchyard_vfio::VfioPci::MIRROR_CAPACITY,
            ));
            let bb = BlackBox::create(&records)?;
            keeper.hold(&[BLACK_BOX_ID], &[bb.file().as_fd()])?;
            let continuity = Continuity::new(&bb, custody())?;
            (bb, continuity, None)
        }
        StartMode::Resume => {
            let bb = BlackBox::open(
                held.remove(&BLACK_BOX_ID)
                    .ok_or(WorkerError::Missing("the black box"))?
                    .into(),
            )?;
            let (continuity, resumed) = Continuity::resume(&bb, custody())?;
            (bb, continuity, Some(resumed))
        }
    };
    let mut device = switchyard_vfio::VfioPci::open(&vfio)
        .map_err(|e| WorkerError::Device(vfio.host.clone(), Box::new(e)))?;
    let mirror = bb.record(VFIO_RECORD)?;
    if resumed.is_some()
        && let Some(saved) = mirror.read()?
    {
        match device.restore(&saved) {
            Ok(()) => tracing::info!("the client's configuration replayed onto the reset device"),
            Err(e) => tracing::error!(error = %e, "cannot replay the client's configuration"),
        }
    }
    device.set_mirror(mirror);
    let bdf = device.bdf().to_owned();
    let k = keeper.clone();
    device.on_release(move || {
        k.notify(&Note::DeviceLost {
            host: bdf,
            reason: "the kernel took the device back (an unbind or a removal)".into(),
        });
    });
    let mut server = Server::with_socket(config, socket, |_ctx| {
        Ok::<_, std::convert::Infallible>(device)
    })?;
    // The tables after the device: its IOMMU sees every window mapped, its interrupt router
    // every eventfd. Without a connection the client is gone: nothing to restore.
    let connection = held.remove(&CONNECTION_ID);
    if let Some(resumed) = &resumed
        && connection.is_some()
    {
        let slot = server.device_slot();
        let fd = |id: u64| held.get(&id).and_then(|f| f.try_clone().ok());
        let mut lost = Server::restore_tables(slot.context(), resumed, fd);
        for (&(index, vector), &id) in &resumed.vectors {
            let Some(file) = fd(id).map(std::fs::File::from) else {
                continue;
            };
            let routed = slot.with_as::<switchyard_vfio::VfioPci, _>(|d| {
                use switchyard_device::IrqRouter;
                d.route(index, vector, &[Some(&file)])
            });
            if let Some(Err(e)) = routed {
                lost.problems
                    .push(format!("interrupt {index}/{vector} to the device: {e}"));
                lost.vectors.push((index, vector));
            }
        }
        report_lost_state(keeper, &continuity, lost);
    }
    server.set_continuity(Arc::new(continuity));
    spawn_control(keeper, server.device_slot(), None)?;
    spawn_stats(keeper, &server)?;
    keeper.notify(&Note::Ready {
        resumed: connection.is_some(),
    });
    match (connection, &resumed) {
        (Some(conn), Some(resumed)) => {
            tracing::info!(
                host = %vfio.host,
                windows = resumed.windows.len(),
                vectors = resumed.vectors.len(),
                "worker resumed the connection (passthrough device reset and replayed)"
            );
            server.run_resumed(UnixStream::from(conn), resumed, held)?;
        }
        (None, Some(_)) => {
            tracing::info!(host = %vfio.host, "worker resumed (no client connected)");
            server.run_resumed_without_client(held)?;
        }
        _ => {
            tracing::info!(host = %vfio.host, "worker serving (passthrough device)");
            server.run()?;
        }
    }
    Ok(())
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
    keeper.notify(&Note::StateLost {
        problems: lost.problems,
    });
}

/// The identity of a held VRAM descriptor.
fn identity(fd: &OwnedFd) -> Option<VramRef> {
    let st = rustix::fs::fstat(fd).ok()?;
    Some(VramRef {
        size: u64::try_from(st.st_size).ok()?,
        dev: st.st_dev,
        ino: st.st_ino,
    })
}

/// Serves the supervisor's requests ([`Note::Move`]) on a thread of its own, one at a time,
/// from whichever supervisor is attached (a new one after an adoption).
fn spawn_control(
    keeper: &Arc<Keeper>,
    slot: DeviceSlot,
    config: Option<SoftGpuConfig>,
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
                let reply = match note {
                    Note::Move { to, detached } => {
                        let span = tracing::info_span!("move", to = %to, detached);
                        let _g = span.enter();
                        let moved = config
                            .ok_or(MoveError::NotSoftGpu)
                            .and_then(|config| relocate(&slot, config, &keeper, detached));
                        match moved {
                            Ok(report) => {
                                tracing::info!(?report, "device moved");
                                Note::Moved { report }
                            }
                            Err(e) => {
                                let error = crate::app::api::error_chain(&e);
                                tracing::warn!(%error, "move failed; the device stays");
                                Note::MoveFailed { error }
                            }
                        }
                    }
                    other => {
                        tracing::warn!(?other, "unexpected custody note; ignored");
                        continue;
                    }
                };
                keeper.notify(&reply);
            }
        })?;
    Ok(())
}

/// Tells the supervisor when a migration stream opens or closes ([`Note::Migration`]).
fn report_migrations(keeper: &Arc<Keeper>, server: &Server) {
    use switchyard_proto::MigState;
    let keeper = keeper.clone();
    server
        .device_slot()
        .set_migration_hook(Arc::new(move |state: MigState| {
            let streaming = matches!(
                state,
                MigState::PreCopy | MigState::StopCopy | MigState::Resuming
            );
            keeper.notify(&Note::Migration { streaming });
        }));
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
    let mut last_work = slot
        .with_as::<SoftGpu, _>(|g| g.work_stats())
        .unwrap_or_default();
    std::thread::Builder::new()
        .name("sy-worker-stats".into())
        .spawn(move || {
            loop {
                std::thread::sleep(STATS_PERIOD);
                let now = requests.snapshot();
                let work = slot
                    .with_as::<SoftGpu, _>(|g| g.work_stats())
                    .unwrap_or_default();
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
                };
                (last, last_work) = (now, work);
                if !stats.is_empty() {
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
    /// The device is not a softgpu.
    #[error("The device is not a softgpu")]
    NotSoftGpu,
    /// The device refused or failed the copy.
    #[error("The device cannot be relocated")]
    Device(#[from] switchyard_softgpu::SoftGpuError),
    /// The custody channel failed (the new VRAM could not be put in custody).
    #[error("Cannot put the new VRAM in custody")]
    Custody(#[from] custody::ChannelError),
    /// An I/O operation failed.
    #[error("I/O failed")]
    Io(#[from] std::io::Error),
}

/// Moves the device in `slot` onto a new VRAM: pre-copy while it runs, then a swap to a
/// successor on the new VRAM (see `switchyard_softgpu`'s relocation).
fn relocate(
    slot: &DeviceSlot,
    config: SoftGpuConfig,
    keeper: &Keeper,
    detached: bool,
) -> Result<MoveReport, MoveError> {
    let moving = slot.begin_move()?;
    let target = SoftGpu::create_vram(&config)?;
    // Held before the device can run on it, so that a replacement finds it.
    keeper.hold(&[VRAM_NEXT_ID], &[target.as_fd()])?;
    let result = move_device_in_slot(slot, &moving, config, target.try_clone()?, detached);
    if result.is_ok() {
        keeper.hold(&[VRAM_ID], &[target.as_fd()])?;
    }
    keeper.release(&[VRAM_NEXT_ID]);
    drop(moving);
    result
}

/// Moves the softgpu in `slot` onto `target` (a new VRAM memfd of `config`'s size, zeroed and
/// sealed: [`SoftGpu::create_vram`]) under its client, the sequence a worker runs for a
/// [`Note::Move`]: pre-copy rounds while the device runs until one copies at most 256 KiB
/// or 12 rounds ran, the successor built on `target` (parked), one more round for what was
/// written while it was built, the engines parked (the
/// commands running finish), then [`DeviceSlot::swap`], which copies the pages written since
/// the last round and hands the state over. Downtime: from the engines parked to the swap
/// done. `_moving` is the slot's move guard ([`DeviceSlot::begin_move`]), held by the caller
/// for the whole move (a worker also puts `target` into custody around it).
///
/// `detached`: no client is connected (the VMM unplugged the device for a guest-visible
/// move), so VRAM the guest could map moves too ([`SoftGpu::begin_detached_relocation`],
/// [`DeviceSlot::swap_detached`], which refuses if a client connected meanwhile).
///
/// On an error the device keeps running on its VRAM; `target` is not used.
pub fn move_device_in_slot(
    slot: &DeviceSlot,
    _moving: &MoveGuard,
    config: SoftGpuConfig,
    target: std::fs::File,
    detached: bool,
) -> Result<MoveReport, MoveError> {
    let t0 = Instant::now();
    let mut relocation = slot
        .with_as::<SoftGpu, _>(|g| {
            if detached {
                g.begin_detached_relocation(target)
            } else {
                g.begin_relocation(target)
            }
        })
        .ok_or(MoveError::NotSoftGpu)??;
    loop {
        let n = relocation.round()?;
        let rounds = relocation.stats().rounds;
        if n <= SETTLED_BYTES || rounds >= MAX_ROUNDS {
            break;
        }
    }
    let mut next = SoftGpu::relocated(config, slot.context().clone(), relocation)?;
    // Building the successor (its engine threads) takes a while: catch up on what was written
    // meanwhile, so that the stop copies only what the parking lets through.
    next.relocation_round()?;
    let precopy = t0.elapsed();
    let quiesce = slot.prepare_swap()?.quiesce;
    let t_park = Instant::now();
    let parked = quiesce.park();
    let t_stop = Instant::now();
    let swapped = if detached {
        slot.swap_detached(Box::new(next))
    } else {
        slot.swap(Box::new(next))
    };
    drop(parked);
    let swapped = swapped?;
    let downtime = t_stop.elapsed();
    let stats = slot
        .with_as::<SoftGpu, _>(|g| g.relocation_stats())
        .flatten()
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
    })
}
