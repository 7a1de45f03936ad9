//! The Switchyard vfio-user server.
//!
//! A [`Server`] owns one device model, the device socket and everything the server must be able
//! to re-point later: the client's DMA windows ([`DmaSpace`]) and interrupt eventfds
//! ([`Interrupts`]). It serves one client at a time on a dedicated thread that blocks on the
//! socket (optionally spinning for a bounded time first), decodes each message with the sans-IO
//! codec in `switchyard-proto`, dispatches it, and writes the reply from a reused buffer: no
//! async runtime. Region accesses (REGION_READ/REGION_WRITE, a running guest's messages) and
//! their replies allocate nothing; what does allocate per message: the descriptors a message
//! carries (a `Vec` of them and of their custody ids: DMA_MAP, DEVICE_SET_IRQS), the sparse
//! areas of DEVICE_GET_REGION_INFO, and each reply of the client to a DMA_READ/DMA_WRITE the
//! server sent (its body copied out of the receive buffer: the slow path of guest RAM the
//! server cannot map).
//!
//! Malformed requests get an error reply with a real errno and the connection keeps going;
//! only a header that makes the stream impossible to frame ends the connection. When the client
//! goes away, every DMA window and eventfd is dropped and the device keeps its state, ready for
//! the next client (spec rule), which finds the PCI function as after a reset
//! ([`PciDevice::fresh_open`]) unless it is a resumed one.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod client_dma;
pub mod continuity;
mod dispatch;
mod dispatcher;
mod error;
pub mod fd_kind;
mod framer;
mod idle;
mod listener;
mod migration;
pub mod origin;
mod resume;
mod slot;
pub mod stats;
#[cfg(test)]
mod test_utils;
#[cfg(test)]
mod tests;
pub mod transport;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use listener::{DeviceSocket, MAX_SOCKET_PATH, StopHandle};
pub use slot::{
    DeviceSlot, MigCause, MigChange, MigrationHook, MoveGuard, SwapError, SwapPlan, SwapReport,
    same_shape,
};
use switchyard_device::{DeviceContext, DmaSpace, Interrupts, PciDevice};
use switchyard_proto::{MigState, ProtoError, ServerLimits};

/// Errors of the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The socket path exists and is not a socket.
    #[error("Socket path {0} exists and is not a socket")]
    SocketPathTaken(PathBuf),
    /// Another server is listening on the socket path.
    #[error("Socket {0} is in use by another server")]
    SocketInUse(PathBuf),
    /// The socket path is longer than AF_UNIX allows.
    #[error("Socket path {0} is {1} bytes long; AF_UNIX socket paths are limited to 107 bytes")]
    SocketPathTooLong(PathBuf, usize),
    /// Binding the socket failed.
    #[error("Cannot bind socket {0}")]
    Bind(PathBuf, #[source] io::Error),
    /// Accepting clients failed.
    #[error("Cannot accept clients")]
    Accept(#[source] io::Error),
    /// The device model failed to start.
    #[error("Cannot create the device")]
    Device(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// A replaced process's state cannot be resumed.
    #[error("Cannot resume the connection of the replaced process")]
    Resume(#[source] Box<dyn std::error::Error + Send + Sync>),
    /// Encoding a reply failed (a bug: replies are built from validated values).
    #[error("Cannot encode a reply")]
    Encode(#[source] ProtoError),
    /// The thread that ends idle migration streams cannot start.
    #[error("Cannot start the migration watchdog")]
    Watchdog(#[source] io::Error),
}

/// Default [`ServerConfig::send_timeout`].
pub const DEFAULT_SEND_TIMEOUT: Duration = Duration::from_secs(5);

/// Default [`ServerConfig::migration_idle_timeout`]: an open migration stream with no
/// activity for a minute is ended (a long migration is fine as long as it moves).
pub const DEFAULT_MIGRATION_IDLE_TIMEOUT: Duration = Duration::from_secs(60);

/// How many DMA windows this process can really hold: each may cost one mapping (bounded by
/// `vm.max_map_count`) and, unless `files` is false, one open file (bounded by
/// `RLIMIT_NOFILE`), beyond what the process already uses and a reserve for everything else
/// (device threads, the sockets, a message's descriptors in flight).
fn holdable_dma_maps(max_msg_fds: u32, files: bool) -> u32 {
    const RESERVE: u64 = 512;
    let count = |path: &str| std::fs::read_dir(path).map(|d| d.count() as u64).ok();
    let open_files = count("/proc/self/fd").unwrap_or(RESERVE);
    let nofile = rustix::process::getrlimit(rustix::process::Resource::Nofile)
        .current
        .unwrap_or(u64::MAX);
    let by_files = if files {
        nofile.saturating_sub(open_files + RESERVE + 2 * u64::from(max_msg_fds))
    } else {
        u64::MAX
    };
    let max_map_count = std::fs::read_to_string("/proc/sys/vm/max_map_count")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(65530);
    let mappings = std::fs::read_to_string("/proc/self/maps")
        .map(|m| m.lines().count() as u64)
        .unwrap_or(RESERVE);
    let by_maps = max_map_count.saturating_sub(mappings + RESERVE);
    u32::try_from(by_files.min(by_maps))
        .unwrap_or(u32::MAX)
        .max(1)
}

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Socket path.
    pub socket: PathBuf,
    /// Socket file mode (default 0600).
    pub socket_mode: u32,
    /// Limits advertised to and enforced on the client.
    pub limits: ServerLimits,
    /// Adaptive polling budget before blocking on the socket (zero: always block).
    pub poll_spin: Duration,
    /// How long a server→client DMA request waits for the client's reply.
    pub client_dma_timeout: Duration,
    /// How long sending one reply may wait for a client that does not read; then the client
    /// is dropped (its DMA windows and eventfds go, the device keeps its state).
    pub send_timeout: Duration,
    /// Bytes all DMA dirty logs may take together ([`DmaSpace::set_log_budget`]).
    pub dirty_log_budget: u64,
    /// Whether DMA dirty logging is offered, and whether its reports tell the truth.
    pub dirty_log: DirtyLog,
    /// Whether a client may migrate the device's mapped memory itself
    /// (`VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS`; see [`MappedMigration`]).
    pub mapped_migration: MappedMigration,
    /// With crash continuity, the client's descriptors a supervisor keeps for it (its DMA
    /// memory files, each once however many windows it has, interrupt eventfds, those of
    /// messages in flight): a message whose new descriptors would pass it is refused with
    /// EMFILE, and `max_dma_maps` no longer counts this process's own open files (which a
    /// replacement holds twice while it restores them). `None`: no budget, `max_dma_maps` is
    /// what this process can hold.
    pub fd_budget: Option<u32>,
    /// An open migration stream (PRE_COPY, STOP_COPY, RESUMING) with no MIG_DATA_READ, no
    /// MIG_DATA_WRITE and no MIG_DEVICE_STATE request for this long is ended: the migration
    /// is abandoned and the device runs, as when its client goes away (a pool worker then
    /// reports it, and what the stream blocked, restarts, upgrades and moves, goes on).
    /// `None`: streams stay open as long as the client likes.
    pub migration_idle_timeout: Option<Duration>,
    /// Stamped at the start of every outgoing migration stream (see [`origin`]): a pool
    /// endpoint's own token, so that its destination can tell its streams from others'.
    pub migration_origin: Option<origin::OriginToken>,
    /// The origin an incoming migration stream must carry (see [`origin`]); a stream of
    /// another origin leaves the device in ERROR. `None`: any stream, with or without an
    /// origin header.
    pub migration_expect_origin: Option<origin::OriginToken>,
}

/// What the server offers of DMA dirty logging (DEVICE_FEATURE DMA_LOGGING_START, _STOP,
/// _REPORT).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DirtyLog {
    /// Offered: every report names the pages the device wrote since the last one.
    #[default]
    On,
    /// Not offered (the features answer ENOTTY, as a device without logging would): a VMM
    /// must track the device's writes another way or refuse to migrate.
    Off,
    /// Fault injection, for tests: offered, started and stopped as usual, but every report
    /// says that nothing is dirty, like a device whose logging is broken. A migration then
    /// loses what the device wrote to guest memory after the VMM copied it, which is how a
    /// test proves that it depends on the log.
    Blind,
}

/// Whether a client may migrate the memory of the device's sparse mmap areas itself, as its
/// own RAM (DEVICE_FEATURE SET `VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS`, a vfio-user
/// extension that the patched QEMU asks for): then the device's migration stream carries
/// only what the device wrote there, and no pass over all of that memory is needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MappedMigration {
    /// Accepted when the device supports it for the regions asked.
    #[default]
    On,
    /// Refused (`ENOTTY`): the device's stream carries all of its memory.
    Off,
    /// Fault injection, for tests: the device acts as if the client migrated its mapped
    /// memory from the first outgoing stream on, whether the client asked or not. With a
    /// client that does not (QEMU's `x-migrate-mapped-regions=off`), what the guest wrote
    /// through its mapping is lost, which is how a test proves that the mapped path
    /// depends on the client's copy.
    Assume,
}

/// What a replacement could not restore of the client's tables ([`Server::restore_tables`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unrestored {
    /// One line per window or vector lost.
    pub problems: Vec<String>,
    /// Windows lost `(iova, size)`.
    pub windows: Vec<(u64, u64)>,
    /// Interrupt vectors lost `(index, vector)`.
    pub vectors: Vec<(u32, u32)>,
}

impl ServerConfig {
    /// Defaults for `socket`: mode 0600, 16 fds per message, 1 MiB transfers, no spinning.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self {
            socket: socket.into(),
            socket_mode: 0o600,
            limits: ServerLimits {
                max_msg_fds: 16,
                ..ServerLimits::default()
            },
            poll_spin: Duration::ZERO,
            client_dma_timeout: Duration::from_secs(5),
            send_timeout: DEFAULT_SEND_TIMEOUT,
            dirty_log_budget: switchyard_device::dma::DEFAULT_LOG_BUDGET,
            dirty_log: DirtyLog::On,
            mapped_migration: MappedMigration::On,
            fd_budget: None,
            migration_idle_timeout: Some(DEFAULT_MIGRATION_IDLE_TIMEOUT),
            migration_origin: None,
            migration_expect_origin: None,
        }
    }
}

/// A vfio-user server for one device.
pub struct Server {
    config: ServerConfig,
    socket: DeviceSocket,
    /// The device, and the DMA space and interrupts the server lends it.
    slot: DeviceSlot,
    stop: StopHandle,
    /// Crash continuity, when a supervisor keeps this server's descriptors.
    continuity: Option<Arc<continuity::Continuity>>,
    /// Messages by command and their latencies.
    stats: Arc<stats::RequestStats>,
    /// The migration watchdog (`idle`), joined when the server is dropped.
    watchdog: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("socket", &self.socket.path())
            .finish_non_exhaustive()
    }
}

/// The device and its migration state, behind the slot's lock: the connection thread holds
/// it for one request at a time, a swap holds it while it replaces the device, the migration
/// watchdog (`idle`) while it ends an idle stream.
pub(crate) struct Slot {
    pub(crate) device: Box<dyn PciDevice>,
    pub(crate) mig: MigState,
    /// A move of the device to another backing is under way ([`DeviceSlot::begin_move`]):
    /// the client cannot open a migration stream meanwhile.
    pub(crate) moving: bool,
    /// A client is connected (from its first request to `client_gone`).
    pub(crate) connected: bool,
    /// Told every change of `mig` ([`DeviceSlot::set_migration_hook`]).
    pub(crate) mig_hook: Option<slot::MigrationHook>,
    /// The origin headers of the migration streams ([`origin`]).
    pub(crate) origin: origin::Origin,
    /// The last migration activity: MIG_DATA_READ, MIG_DATA_WRITE, a MIG_DEVICE_STATE
    /// request, a change of `mig`.
    pub(crate) mig_touched: Instant,
    /// Wakes the migration watchdog when `mig` changes or the server goes (`idle`); waited
    /// on with this slot's lock, which the wait releases.
    pub(crate) watch: Arc<Condvar>,
    /// The server is gone: the watchdog ends.
    pub(crate) closed: bool,
}

impl Slot {
    /// A slot holding `device`, RUNNING, whose streams carry and expect no origin.
    pub(crate) fn new(device: Box<dyn PciDevice>) -> Self {
        Self {
            device,
            mig: MigState::Running,
            moving: false,
            connected: false,
            mig_hook: None,
            origin: origin::Origin::new(None, None),
            mig_touched: Instant::now(),
            watch: Arc::default(),
            closed: false,
        }
    }

    /// Tells the hook if `mig` is no longer `before` (changed by `cause`), and the watchdog.
    pub(crate) fn mig_changed(&mut self, before: MigState, cause: slot::MigCause) {
        let sent = self.origin.sent();
        self.mig_changed_sent(before, cause, sent);
    }

    /// [`Slot::mig_changed`], saying whether the stream had been sent ([`MigChange::sent`]).
    fn mig_changed_sent(&mut self, before: MigState, cause: slot::MigCause, sent: bool) {
        if self.mig == before {
            return;
        }
        self.mig_touched = Instant::now();
        self.watch.notify_all();
        if let Some(hook) = &self.mig_hook {
            hook(slot::MigChange {
                from: before,
                to: self.mig,
                cause,
                origin_verified: self.origin.verified(),
                sent,
            });
        }
    }

    /// Abandons a migration in progress (any state but RUNNING): the device drops the
    /// stream and runs ([`Migratable::abort`](switchyard_device::Migratable::abort)).
    pub(crate) fn abandon_migration(&mut self, cause: slot::MigCause) {
        if self.mig == MigState::Running {
            return;
        }
        let before = self.mig;
        if let Some(m) = self.device.migration() {
            m.abort();
        }
        // Whether a completed outgoing migration is what was abandoned (its VMM left).
        let sent = self.origin.sent();
        self.origin.abort();
        self.mig = MigState::Running;
        self.mig_changed_sent(before, cause, sent);
    }
}

impl Server {
    /// Creates the DMA space and interrupt table, builds the device on them, and binds the
    /// socket (the server is listening when this returns, so a VMM may connect right away).
    pub fn new<D, E>(
        config: ServerConfig,
        build: impl FnOnce(DeviceContext) -> Result<D, E>,
    ) -> Result<Self, ServerError>
    where
        D: PciDevice,
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::build(config, None, |ctx| {
            build(ctx).map(|d| Box::new(d) as Box<dyn PciDevice>)
        })
    }

    /// [`Server::new`] on a socket that is already listening (e.g. one a supervisor keeps
    /// across restarts of this process: [`DeviceSocket::adopt`]).
    pub fn with_socket<D, E>(
        config: ServerConfig,
        socket: DeviceSocket,
        build: impl FnOnce(DeviceContext) -> Result<D, E>,
    ) -> Result<Self, ServerError>
    where
        D: PciDevice,
        E: std::error::Error + Send + Sync + 'static,
    {
        Self::build(config, Some(socket), |ctx| {
            build(ctx).map(|d| Box::new(d) as Box<dyn PciDevice>)
        })
    }

    fn build<E>(
        mut config: ServerConfig,
        socket: Option<DeviceSocket>,
        build: impl FnOnce(DeviceContext) -> Result<Box<dyn PciDevice>, E>,
    ) -> Result<Self, ServerError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        // With a budget, the client's files are counted by it (and windows of one file are
        // one descriptor in custody and one mapping here), not by what this process holds now
        // (a replacement holds the client's descriptors twice while it restores them).
        let holdable = holdable_dma_maps(config.limits.max_msg_fds, config.fd_budget.is_none());
        if holdable < config.limits.max_dma_maps {
            tracing::info!(
                configured = config.limits.max_dma_maps,
                advertised = holdable,
                "max_dma_maps lowered to what this process can hold (open files, mappings)"
            );
            config.limits.max_dma_maps = holdable;
        }
        let ctx = DeviceContext {
            dma: Arc::new(DmaSpace::new(config.limits.max_dma_maps as usize)),
            // Sized to the VFIO maximum until the device has described itself.
            irqs: Arc::new(Interrupts::new(&[1, 1, 2048, 1, 1])),
            waits: Default::default(),
            memory: Default::default(),
        };
        ctx.dma.set_log_budget(config.dirty_log_budget);
        let device = build(ctx.clone()).map_err(|e| ServerError::Device(Box::new(e)))?;
        ctx.dma.set_observer(device.dma_observer());
        ctx.dma.set_dirty_source(device.dirty_source());
        ctx.irqs.reconfigure(&device.description().irq_counts());
        let socket = match socket {
            Some(s) => s,
            None => DeviceSocket::bind(&config.socket, config.socket_mode)?,
        };
        let stop = StopHandle::new().map_err(ServerError::Accept)?;
        let mut inner = Slot::new(device);
        inner.origin = origin::Origin::new(
            config.migration_origin.clone(),
            config.migration_expect_origin.clone(),
        );
        let slot = DeviceSlot::new(Arc::new(Mutex::new(inner)), ctx);
        let watchdog = config
            .migration_idle_timeout
            .map(|timeout| idle::spawn(&slot, timeout))
            .transpose()
            .map_err(ServerError::Watchdog)?;
        tracing::info!(
            socket = %socket.path().display(),
            device = slot.with(|d| d.description().name),
            "listening"
        );
        Ok(Self {
            config,
            socket,
            slot,
            stop,
            continuity: None,
            stats: Arc::default(),
            watchdog,
        })
    }

    /// From now on, descriptors the client sends go into custody and the server publishes
    /// what a replacement needs (see [`continuity`]).
    pub fn set_continuity(&mut self, continuity: Arc<continuity::Continuity>) {
        continuity.set_budget(self.config.fd_budget.map(|b| b as usize));
        self.continuity = Some(continuity);
    }

    /// A replacement whose client left while no process served it (the supervisor holds no
    /// connection): whatever the supervisor still holds for that client (`fds`: message
    /// descriptors by custody id, tables restored from them) is released, as when a client
    /// leaves; then it serves like [`Server::run`].
    pub fn run_resumed_without_client(
        &mut self,
        fds: std::collections::BTreeMap<u64, std::os::fd::OwnedFd>,
    ) -> Result<(), ServerError> {
        if let Some(c) = &self.continuity {
            c.took_over(&fds);
        }
        drop(fds);
        self.client_gone(None);
        self.run()
    }

    /// Rebuilds the client's DMA windows and interrupt routing a replaced process had, from
    /// `resumed` and the descriptors its supervisor held (`fd(id)`); call before building
    /// nothing else on the context. A window whose memory can no longer be mapped is left
    /// out (the device then faults on it) and reported, and so is an eventfd that cannot be
    /// set: drop them from the continuity's tables ([`continuity::Continuity::forget`]) and
    /// tell the supervisor.
    pub fn restore_tables(
        ctx: &DeviceContext,
        resumed: &continuity::Resumed,
        mut fd: impl FnMut(u64) -> Option<std::os::fd::OwnedFd>,
    ) -> Unrestored {
        let mut lost = Unrestored::default();
        let problems = &mut lost.problems;
        for w in &resumed.windows {
            let prot = switchyard_device::DmaProt {
                read: w.read,
                write: w.write,
            };
            let backing = match w.fd {
                None => None,
                Some(id) => match fd(id) {
                    Some(f) => Some((std::fs::File::from(f), w.offset)),
                    None => {
                        problems.push(format!(
                            "DMA window {:#x}+{:#x}: its memory fd (custody id {id}) is gone",
                            w.iova, w.size
                        ));
                        lost.windows.push((w.iova, w.size));
                        continue;
                    }
                },
            };
            if let Err(e) = ctx.dma.map(w.iova, w.size, prot, backing) {
                problems.push(format!("DMA window {:#x}+{:#x}: {e}", w.iova, w.size));
                lost.windows.push((w.iova, w.size));
            }
        }
        for (&(index, vector), &id) in &resumed.vectors {
            match fd(id) {
                Some(f) => {
                    if let Err(e) =
                        ctx.irqs
                            .set_triggers(index, vector, vec![Some(std::fs::File::from(f))])
                    {
                        problems.push(format!("interrupt {index}/{vector}: {e}"));
                        lost.vectors.push((index, vector));
                    }
                }
                None => {
                    problems.push(format!(
                        "interrupt {index}/{vector}: its eventfd (custody id {id}) is gone"
                    ));
                    lost.vectors.push((index, vector));
                }
            }
        }
        lost
    }

    /// Serves `stream`, a connection a replaced process was serving, from where it stopped
    /// (the receive journal in `resumed`, whose descriptors `fd(id)` gives), then goes on
    /// like [`Server::run`]. The DMA space and interrupts must have been restored
    /// ([`Server::restore_tables`]) before the device was built on them.
    ///
    /// `fds` holds what the supervisor kept, by custody id; what neither the tables nor the
    /// journal need is released.
    pub fn run_resumed(
        &mut self,
        stream: std::os::unix::net::UnixStream,
        resumed: &continuity::Resumed,
        fds: std::collections::BTreeMap<u64, std::os::fd::OwnedFd>,
    ) -> Result<(), ServerError> {
        let max_msg =
            switchyard_proto::Limits::server(self.config.limits.max_data_xfer_size).max_msg_size;
        // Everything held for the client is this process's to release from now on: what the
        // journal and the tables need when they are done with it, the rest below.
        if let Some(c) = &self.continuity {
            c.took_over(&fds);
        }
        let mut framer = if resumed.rx.is_empty() {
            transport::Framer::new(max_msg)
        } else {
            // A descriptor may come with several messages (one file, one custody id).
            transport::Framer::resume(max_msg, &resumed.rx, |id| {
                fds.get(&id).and_then(|f| f.try_clone().ok())
            })
            .map_err(|e| ServerError::Resume(Box::new(e)))?
        };
        // A read the killed process peeked but had not consumed (see `settle_peeked`).
        match transport::Connection::settle_peeked(&stream, framer.unconsumed()) {
            Ok(0) => tracing::debug!("nothing peeked and unconsumed"),
            Ok(n) => tracing::info!(bytes = n, "consumed what the replaced process had peeked"),
            Err(e) => tracing::warn!(error = %e, "cannot settle the socket's peek offset"),
        }
        // The reply the killed process was sending: whatever of it had not left goes first.
        // Whole replies or a dropped client: a reply that cannot be finished (the client does
        // not read within the send timeout) ends the connection, since anything sent after
        // it would be read as the rest of the torn reply.
        if let Some(c) = &self.continuity {
            match c.resend_unsent(resumed, &stream, self.config.send_timeout) {
                Ok(0) => {}
                Ok(n) => tracing::info!(
                    bytes = n,
                    "sent the rest of the replaced process's last reply"
                ),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "cannot finish the replaced process's last reply: dropping the client"
                    );
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    drop((stream, fds, framer));
                    self.client_gone(None);
                    if self.stop.is_stopping() {
                        return Ok(());
                    }
                    return self.run();
                }
            }
        }
        tracing::debug!(
            unconsumed = framer.unconsumed(),
            partial = framer.partial(),
            messages = ?framer.buffered_ids(),
            "receive journal"
        );
        framer.set_unconsumed(0);
        if let Some(c) = &self.continuity {
            // The journal's messages carry these until they are settled; the rest no table
            // refers to is released.
            let journaled = framer.held_ids();
            c.journaled(&journaled);
            let leftover: Vec<u64> = fds
                .keys()
                .copied()
                .filter(|id| {
                    *id >= continuity::FIRST_MESSAGE_ID
                        && !resumed.referenced.contains(id)
                        && !journaled.contains(id)
                })
                .collect();
            c.release(&leftover);
        }
        drop(fds);
        let span = tracing::info_span!("client", id = 0, resumed = true);
        let g = span.enter();
        tracing::info!("resuming the connection of the replaced process");
        if let Ok(s) = stream.try_clone() {
            self.stop.set_active(Some(s));
        }
        let ended = dispatch::serve_connection(
            self,
            stream,
            Some(dispatch::Resume {
                framer,
                version: resumed.version.clone(),
            }),
        );
        self.stop.set_active(None);
        self.client_gone(ended.client_dma);
        match ended.result {
            Ok(()) => tracing::info!("client disconnected"),
            Err(e) => tracing::warn!(error = %e, "client connection ended with an error"),
        }
        drop(g);
        if self.stop.is_stopping() {
            return Ok(());
        }
        self.run()
    }

    /// A handle that stops [`Server::run`] from another thread.
    pub fn stop_handle(&self) -> StopHandle {
        self.stop.clone()
    }

    /// A handle on the device for other threads: inspect it, or swap it for another backing
    /// device under a connected client ([`DeviceSlot::swap`]).
    pub fn device_slot(&self) -> DeviceSlot {
        self.slot.clone()
    }

    /// The server's request counters (messages by command, latency histogram), for another
    /// thread to read.
    pub fn request_stats(&self) -> Arc<stats::RequestStats> {
        self.stats.clone()
    }

    /// The socket path.
    pub fn socket_path(&self) -> &Path {
        self.socket.path()
    }

    /// Serves clients one after another until [`StopHandle::stop`] is called.
    pub fn run(&mut self) -> Result<(), ServerError> {
        let acceptor = listener::Acceptor::start(&self.socket, self.stop.clone())?;
        let mut client_id = 0u64;
        while let Some(stream) = acceptor.next() {
            client_id += 1;
            let span = tracing::info_span!("client", id = client_id);
            let _g = span.enter();
            tracing::info!("client connected");
            match stream.try_clone() {
                Ok(s) => self.stop.set_active(Some(s)),
                Err(e) => tracing::warn!(error = %e, "cannot watch the connection for shutdown"),
            }
            if let Some(c) = &self.continuity {
                c.connection(&stream);
            }
            self.fresh_open();
            let ended = dispatch::serve_connection(self, stream, None);
            self.stop.set_active(None);
            self.client_gone(ended.client_dma);
            match ended.result {
                Ok(()) => tracing::info!("client disconnected"),
                Err(e) => tracing::warn!(error = %e, "client connection ended with an error"),
            }
            acceptor.done();
            if self.stop.is_stopping() {
                break;
            }
        }
        drop(acceptor);
        tracing::info!("server stopped");
        Ok(())
    }

    /// A new client (not a resumed one) finds the device's PCI function as after a reset
    /// ([`PciDevice::fresh_open`]), as a new user of kernel vfio-pci does: what the previous
    /// guest wrote into config space stays out of the new VMM's copy (which it reads before
    /// anything else, and a migration's load compares against).
    fn fresh_open(&mut self) {
        let mut slot = self.slot.lock();
        if let Err(e) = slot.device.fresh_open() {
            tracing::warn!(error = %e, "cannot give the new client a fresh device; served as it is");
        }
    }

    /// Spec rule on client loss: drop DMA windows, eventfds and the dirty-logging session,
    /// keep device state. A migration in progress is abandoned (the device runs again); a
    /// device left in STOP with no stream open runs again too, with no migration abandoned
    /// ([`MigCause::ClientLeft`](crate::MigCause::ClientLeft)).
    /// `client_dma` is the client's server→client DMA, if it negotiated.
    ///
    /// The device is told once ([`PciDevice::client_disconnected`]), when its windows and
    /// eventfds are gone, as the trait documents. Until then a device that can be parked (its
    /// [`Quiesce`](switchyard_device::Quiesce), from [`PciDevice::swappable`]) is parked, so
    /// that its own activity never finds a window gone before it knows the client is (a
    /// command it runs then must not fail and latch an error for the next client). The
    /// client's remote waits are held first: a command waiting for this client's reply is
    /// cancelled (it runs again later) instead of keeping the park waiting for a reply that
    /// will not come, and the DMA to the client is closed only under the park.
    fn client_gone(&mut self, client_dma: Option<Arc<client_dma::ClientDma>>) {
        let ctx = self.slot.context();
        let waits = ctx.waits.hold();
        let quiesce = self.slot.lock().device.swappable().map(|s| s.quiesce());
        let parked = quiesce.as_ref().map(|q| q.park());
        if let Some(cd) = client_dma {
            cd.close();
        }
        ctx.dma.set_remote(None);
        ctx.waits.set(None);
        {
            let mut slot = self.slot.lock();
            match slot.mig {
                MigState::Running => {}
                // No stream is open: nothing is abandoned, but the next client must find the
                // device running (a guest's poweroff and a migrated source's VMM leave it so;
                // a VMM with several devices may leave it quiesced in RUNNING_P2P).
                MigState::Stop | MigState::RunningP2p => {
                    tracing::info!("client gone leaving its device stopped; it runs again");
                    slot.abandon_migration(slot::MigCause::ClientLeft);
                }
                state => {
                    tracing::info!(?state, "client gone during migration; abandoned");
                    slot.abandon_migration(slot::MigCause::ClientGone);
                }
            }
        }
        ctx.dma.stop_logging();
        ctx.dma.unmap_all();
        ctx.irqs.clear();
        {
            let mut slot = self.slot.lock();
            slot.device.client_disconnected();
            slot.connected = false;
        }
        drop(parked);
        drop(waits);
        if let Some(c) = &self.continuity {
            c.client_gone();
        }
    }
}

impl Drop for Server {
    /// Ends the migration watchdog and waits for it: it holds a handle on the slot, and the
    /// device goes with the server (unless another handle holds it), not whenever the
    /// watchdog's thread happens to run.
    fn drop(&mut self) {
        self.slot.close();
        if let Some(w) = self.watchdog.take()
            && w.join().is_err()
        {
            tracing::warn!("the migration watchdog panicked");
        }
    }
}

#[cfg(test)]
mod errno_tests {
    /// The codec carries its own (libc-free) table of the Linux errnos it puts on the wire;
    /// everything else uses `libc`'s. They must be one table.
    #[test]
    fn the_codec_errno_table_is_libc() {
        use switchyard_proto::errno as wire;
        let pairs = [
            (wire::EPERM, libc::EPERM),
            (wire::ENOENT, libc::ENOENT),
            (wire::EIO, libc::EIO),
            (wire::E2BIG, libc::E2BIG),
            (wire::EBADF, libc::EBADF),
            (wire::EAGAIN, libc::EAGAIN),
            (wire::ENOMEM, libc::ENOMEM),
            (wire::EFAULT, libc::EFAULT),
            (wire::EBUSY, libc::EBUSY),
            (wire::EEXIST, libc::EEXIST),
            (wire::ENODEV, libc::ENODEV),
            (wire::EINVAL, libc::EINVAL),
            (wire::ENOTTY, libc::ENOTTY),
            (wire::ENOSPC, libc::ENOSPC),
            (wire::ERANGE, libc::ERANGE),
            (wire::ENOSYS, libc::ENOSYS),
            (wire::EPROTO, libc::EPROTO),
            (wire::EOVERFLOW, libc::EOVERFLOW),
            (wire::EMSGSIZE, libc::EMSGSIZE),
            (wire::ENOTSUP, libc::ENOTSUP),
            (wire::ENOTCONN, libc::ENOTCONN),
            (wire::ETIMEDOUT, libc::ETIMEDOUT),
        ];
        for (i, (ours, theirs)) in pairs.into_iter().enumerate() {
            assert_eq!(ours, theirs, "entry {i}");
        }
    }
}
