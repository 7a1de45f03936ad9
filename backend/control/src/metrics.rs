//! Prometheus metrics of the pool: per endpoint, per board and for the daemon.
//!
//! Families (all prefixed `switchyard_`):
//!
//! | family | type | labels |
//! |---|---|---|
//! | `switchyard_endpoint_messages_total` | counter | `endpoint`, `command` (`REGION_READ`, ...) |
//! | `switchyard_endpoint_request_duration_seconds` | histogram, 1 µs to 1 s | `endpoint` |
//! | `switchyard_board_jobs_total` | counter | `board` |
//! | `switchyard_board_bytes_total` | counter | `board` |
//! | `switchyard_board_errors_total` | counter | `board` |
//! | `switchyard_board_moves_total` | counter | `board` |
//! | `switchyard_board_last_move_downtime_seconds` | gauge | `board` |
//! | `switchyard_endpoint_restarts_total` | counter | (data-path process restarts) |
//! | `switchyard_endpoint_worker_restarts_total` | counter | `endpoint` |
//! | `switchyard_endpoint_last_restart_seconds` | gauge | `endpoint` (death of a worker to its replacement serving) |
//! | `switchyard_endpoint_state_lost_total` | counter | `endpoint` (replacements that could not restore all of the client's DMA windows and eventfds) |
//! | `switchyard_endpoint_resets_total` | counter | `endpoint` (the daemon let go of the client's or the device's state after failed starts) |
//! | `switchyard_upgrades_total` | counter | |
//!
//! Recording goes through handles ([`EndpointMetrics`], [`BoardMetrics`]) that a hot path
//! caches: an observation is an atomic add (a counter) or a short mutex section (the
//! histogram), never an allocation or a label lookup. The per-command counters of an endpoint
//! are created on the first message of that command.
//!
//! [`Metrics::encode`] writes the OpenMetrics 1.0 text format (what `prometheus-client` writes,
//! ending in `# EOF`), served as [`OPENMETRICS_CONTENT_TYPE`]; Prometheus scrapes it as such.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use switchyard_proto::Command;

/// The content type of [`Metrics::encode`]'s output.
pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Upper bounds of the request latency buckets, in seconds: 1, 2.5, 5 per decade from 1 µs to
/// 1 s (a REGION_READ round trip is a few µs; a migration step can take a good part of a
/// second).
pub const LATENCY_BUCKETS: [f64; 19] = [
    1e-6, 2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
    5e-2, 0.1, 0.25, 0.5, 1.0,
];

/// The `command` label value of a vfio-user command: its spec name without `VFIO_USER_`.
pub fn command_name(command: Command) -> &'static str {
    match command {
        Command::Version => "VERSION",
        Command::DmaMap => "DMA_MAP",
        Command::DmaUnmap => "DMA_UNMAP",
        Command::DeviceGetInfo => "DEVICE_GET_INFO",
        Command::DeviceGetRegionInfo => "DEVICE_GET_REGION_INFO",
        Command::DeviceGetRegionIoFds => "DEVICE_GET_REGION_IO_FDS",
        Command::DeviceGetIrqInfo => "DEVICE_GET_IRQ_INFO",
        Command::DeviceSetIrqs => "DEVICE_SET_IRQS",
        Command::RegionRead => "REGION_READ",
        Command::RegionWrite => "REGION_WRITE",
        Command::DmaRead => "DMA_READ",
        Command::DmaWrite => "DMA_WRITE",
        Command::DeviceReset => "DEVICE_RESET",
        Command::DirtyPages => "DIRTY_PAGES",
        Command::RegionWriteMulti => "REGION_WRITE_MULTI",
        Command::DeviceFeature => "DEVICE_FEATURE",
        Command::MigDataRead => "MIG_DATA_READ",
        Command::MigDataWrite => "MIG_DATA_WRITE",
        Command::GetPrecopyInfo => "GET_PRECOPY_INFO",
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct EndpointLabel {
    endpoint: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CommandLabels {
    endpoint: String,
    command: &'static str,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash, EncodeLabelSet)]
struct BoardLabel {
    board: String,
}

type F64Gauge = Gauge<f64, AtomicU64>;

fn latency_histogram() -> BucketHistogram {
    BucketHistogram::new(&LATENCY_BUCKETS)
}

/// A classic histogram that also takes bucket counts measured elsewhere (a data-path process
/// counts its requests' latencies and reports them in batches), which
/// `prometheus_client`'s own histogram cannot: it only observes single values.
#[derive(Debug, Clone)]
pub struct BucketHistogram {
    inner: Arc<Mutex<BucketInner>>,
}

#[derive(Debug)]
struct BucketInner {
    /// `(upper bound, count)`, not cumulative; the last bound is +Inf.
    buckets: Vec<(f64, u64)>,
    sum: f64,
    count: u64,
}

impl BucketHistogram {
    /// A histogram with these upper bounds (ascending) and an overflow bucket.
    pub fn new(bounds: &[f64]) -> Self {
        let buckets = bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .map(|b| (b, 0))
            .collect();
        Self {
            inner: Arc::new(Mutex::new(BucketInner {
                buckets,
                sum: 0.0,
                count: 0,
            })),
        }
    }

    /// Observes one value.
    pub fn observe(&self, v: f64) {
        let mut g = lock(&self.inner);
        g.sum += v;
        g.count += 1;
        if let Some(b) = g.buckets.iter_mut().find(|(bound, _)| v <= *bound) {
            b.1 += 1;
        }
    }

    /// Adds counts per bucket (one per bound, then the overflow; extra entries are ignored)
    /// and their sum.
    pub fn add(&self, counts: &[u64], sum: f64) {
        let mut g = lock(&self.inner);
        let mut n = 0u64;
        for (b, c) in g.buckets.iter_mut().zip(counts) {
            b.1 += c;
            n += c;
        }
        g.count += n;
        g.sum += sum;
    }
}

impl prometheus_client::metrics::TypedMetric for BucketHistogram {
    const TYPE: prometheus_client::metrics::MetricType =
        prometheus_client::metrics::MetricType::Histogram;
}

impl prometheus_client::encoding::EncodeMetric for BucketHistogram {
    fn encode(
        &self,
        mut encoder: prometheus_client::encoding::MetricEncoder,
    ) -> Result<(), fmt::Error> {
        let g = lock(&self.inner);
        encoder.encode_histogram::<prometheus_client::encoding::NoLabelSet>(
            g.sum, g.count, &g.buckets, None,
        )
    }

    fn metric_type(&self) -> prometheus_client::metrics::MetricType {
        <Self as prometheus_client::metrics::TypedMetric>::TYPE
    }
}

#[derive(Debug)]
struct Families {
    messages: Family<CommandLabels, Counter>,
    latency: Family<EndpointLabel, BucketHistogram, fn() -> BucketHistogram>,
    jobs: Family<BoardLabel, Counter>,
    bytes: Family<BoardLabel, Counter>,
    errors: Family<BoardLabel, Counter>,
    moves: Family<BoardLabel, Counter>,
    downtime: Family<BoardLabel, F64Gauge>,
    replayed: Family<BoardLabel, Counter>,
    interrupted: Family<BoardLabel, Counter>,
    endpoint_restarts: Family<EndpointLabel, Counter>,
    last_restart: Family<EndpointLabel, F64Gauge>,
    state_lost: Family<EndpointLabel, Counter>,
    resets: Family<EndpointLabel, Counter>,
    restarts: Counter,
    upgrades: Counter,
    migrations_completed: Counter,
    migrations_aborted: Counter,
    failovers: Family<FailoverLabels, Counter>,
    failover_stall: BucketHistogram,
    failovers_waiting: Gauge,
    failover_passes: Counter,
}

/// Labels of a failover: the pool of the failed board (empty: none) and how the endpoint
/// failed over.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FailoverLabels {
    pool: String,
    mode: String,
}

/// Upper bounds of the failover stall histogram, seconds.
const FAILOVER_STALL_BUCKETS: [f64; 10] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

struct Inner {
    registry: Registry,
    families: Families,
    endpoints: Mutex<HashMap<String, EndpointMetrics>>,
    boards: Mutex<HashMap<String, BoardMetrics>>,
}

/// The daemon's metrics registry. Cheap to clone (one `Arc`); every clone records into and
/// encodes the same metrics.
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

impl fmt::Debug for Metrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Metrics")
            .field("families", &self.inner.families)
            .finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// An empty registry with every family registered.
    pub fn new() -> Self {
        let families = Families {
            messages: Family::default(),
            latency: Family::new_with_constructor(latency_histogram),
            jobs: Family::default(),
            bytes: Family::default(),
            errors: Family::default(),
            moves: Family::default(),
            downtime: Family::default(),
            replayed: Family::default(),
            interrupted: Family::default(),
            endpoint_restarts: Family::default(),
            last_restart: Family::default(),
            state_lost: Family::default(),
            resets: Family::default(),
            restarts: Counter::default(),
            upgrades: Counter::default(),
            migrations_completed: Counter::default(),
            migrations_aborted: Counter::default(),
            failovers: Family::default(),
            failover_stall: BucketHistogram::new(&FAILOVER_STALL_BUCKETS),
            failovers_waiting: Gauge::default(),
            failover_passes: Counter::default(),
        };
        let mut registry = Registry::with_prefix("switchyard");
        let f = &families;
        registry.register(
            "endpoint_messages",
            "vfio-user messages handled, by endpoint and command",
            f.messages.clone(),
        );
        registry.register(
            "endpoint_request_duration_seconds",
            "Time from a request's arrival to its reply, by endpoint",
            f.latency.clone(),
        );
        registry.register(
            "board_jobs",
            "Jobs (commands) run by a board",
            f.jobs.clone(),
        );
        registry.register(
            "board_bytes",
            "Bytes moved by a board's jobs",
            f.bytes.clone(),
        );
        registry.register("board_errors", "Jobs a board failed", f.errors.clone());
        registry.register(
            "board_moves",
            "Endpoints moved off a board",
            f.moves.clone(),
        );
        registry.register(
            "board_last_move_downtime_seconds",
            "Downtime of the last move off a board",
            f.downtime.clone(),
        );
        registry.register(
            "board_jobs_replayed",
            "Jobs in flight when a board's device process died, run again by its replacement (a restart, a failover)",
            f.replayed.clone(),
        );
        registry.register(
            "board_jobs_interrupted",
            "Jobs in flight when a board's device process died that could not run again (not idempotent): their queues stopped with an interrupted error",
            f.interrupted.clone(),
        );
        registry.register(
            "endpoint_restarts",
            "Data-path processes restarted under a running endpoint",
            f.restarts.clone(),
        );
        registry.register(
            "endpoint_worker_restarts",
            "Data-path processes restarted under an endpoint (crashes, kills, upgrades)",
            f.endpoint_restarts.clone(),
        );
        registry.register(
            "endpoint_last_restart_seconds",
            "From the death of an endpoint's data-path process to its replacement serving",
            f.last_restart.clone(),
        );
        registry.register(
            "endpoint_state_lost",
            "Replacements of an endpoint's data-path process that could not restore all of the client's DMA windows and eventfds",
            f.state_lost.clone(),
        );
        registry.register(
            "endpoint_resets",
            "Times the daemon let go of an endpoint's client or device state after its data-path processes kept failing to start",
            f.resets.clone(),
        );
        registry.register(
            "upgrades",
            "Binary upgrades under running endpoints",
            f.upgrades.clone(),
        );
        registry.register(
            "migrations_completed",
            "Live migrations onto an incoming endpoint that completed (the destination runs)",
            f.migrations_completed.clone(),
        );
        registry.register(
            "migrations_aborted",
            "Live migrations onto an incoming endpoint that ended without the destination running",
            f.migrations_aborted.clone(),
        );
        registry.register(
            "failovers",
            "Endpoints failed over off a failed board, by the board's pool and how (transparent, guest-visible)",
            f.failovers.clone(),
        );
        registry.register(
            "failover_stall_seconds",
            "From a board failure's report to the endpoint's device serving on a healthy board",
            f.failover_stall.clone(),
        );
        registry.register(
            "failovers_waiting",
            "Endpoints on failed boards waiting for a free device of their shape (degraded)",
            f.failovers_waiting.clone(),
        );
        registry.register(
            "failover_passes",
            "Passes of the failover reconciler over the endpoints of failed boards (at each report, and every second)",
            f.failover_passes.clone(),
        );
        Self {
            inner: Arc::new(Inner {
                registry,
                families,
                endpoints: Mutex::new(HashMap::new()),
                boards: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// The recording handle of endpoint `id`, created on first use. Keep it: recording through
    /// it allocates nothing.
    pub fn endpoint(&self, id: &str) -> EndpointMetrics {
        let f = &self.inner.families;
        let label = EndpointLabel {
            endpoint: id.to_owned(),
        };
        get_or_insert(&self.inner.endpoints, id, || EndpointMetrics {
            inner: Arc::new(EndpointInner {
                id: id.to_owned(),
                latency: f.latency.get_or_create_owned(&label),
                restarts: f.endpoint_restarts.get_or_create_owned(&label),
                last_restart: f.last_restart.get_or_create_owned(&label),
                state_lost: f.state_lost.get_or_create_owned(&label),
                resets: f.resets.get_or_create_owned(&label),
                messages: f.messages.clone(),
                by_command: std::array::from_fn(|_| OnceLock::new()),
            }),
        })
    }

    /// The recording handle of board `id`, created on first use.
    pub fn board(&self, id: &str) -> BoardMetrics {
        let f = &self.inner.families;
        let label = BoardLabel {
            board: id.to_owned(),
        };
        get_or_insert(&self.inner.boards, id, || BoardMetrics {
            inner: Arc::new(BoardInner {
                id: id.to_owned(),
                jobs: f.jobs.get_or_create_owned(&label),
                bytes: f.bytes.get_or_create_owned(&label),
                errors: f.errors.get_or_create_owned(&label),
                moves: f.moves.get_or_create_owned(&label),
                downtime: f.downtime.get_or_create_owned(&label),
                replayed: f.replayed.get_or_create_owned(&label),
                interrupted: f.interrupted.get_or_create_owned(&label),
            }),
        })
    }

    /// Drops endpoint `id`'s series (the endpoint was deleted). Handles still held record into
    /// metrics nobody exports; a later [`Metrics::endpoint`] starts from zero.
    pub fn remove_endpoint(&self, id: &str) -> bool {
        let Some(m) = lock(&self.inner.endpoints).remove(id) else {
            return false;
        };
        let f = &self.inner.families;
        let label = EndpointLabel {
            endpoint: id.to_owned(),
        };
        f.latency.remove(&label);
        f.endpoint_restarts.remove(&label);
        f.last_restart.remove(&label);
        f.state_lost.remove(&label);
        f.resets.remove(&label);
        for command in Command::ALL {
            if m.inner.by_command[command_index(command)].get().is_some() {
                f.messages.remove(&CommandLabels {
                    endpoint: id.to_owned(),
                    command: command_name(command),
                });
            }
        }
        true
    }

    /// Drops board `id`'s series (the board left the inventory). Same rules as
    /// [`Metrics::remove_endpoint`].
    pub fn remove_board(&self, id: &str) -> bool {
        if lock(&self.inner.boards).remove(id).is_none() {
            return false;
        }
        let f = &self.inner.families;
        let label = BoardLabel {
            board: id.to_owned(),
        };
        f.jobs.remove(&label);
        f.bytes.remove(&label);
        f.errors.remove(&label);
        f.moves.remove(&label);
        f.downtime.remove(&label);
        f.replayed.remove(&label);
        f.interrupted.remove(&label);
        true
    }

    /// Counts a data-path process restarted under a running endpoint.
    pub fn endpoint_restarted(&self) {
        self.inner.families.restarts.inc();
    }

    /// Counts an upgrade of the running binary (one endpoint's or the whole daemon's).
    pub fn upgraded(&self) {
        self.inner.families.upgrades.inc();
    }

    /// Counts a live migration onto an incoming endpoint: completed, or aborted.
    pub fn migration_ended(&self, completed: bool) {
        let f = &self.inner.families;
        if completed {
            f.migrations_completed.inc();
        } else {
            f.migrations_aborted.inc();
        }
    }

    /// Counts an endpoint failed over off a board of `pool` (`mode`: `transparent`,
    /// `guest-visible`), the guest's stall `stall`.
    pub fn failed_over(&self, pool: &str, mode: &str, stall: Duration) {
        let f = &self.inner.families;
        f.failovers
            .get_or_create(&FailoverLabels {
                pool: pool.to_owned(),
                mode: mode.to_owned(),
            })
            .inc();
        f.failover_stall.observe(stall.as_secs_f64());
    }

    /// Sets how many endpoints wait, degraded, for a device to fail over to.
    pub fn set_failovers_waiting(&self, n: usize) {
        self.inner
            .families
            .failovers_waiting
            .set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// Counts a pass of the failover reconciler: everything it did in the pass (failovers,
    /// `failover_waiting` and `failover_refused` events) is committed before the count moves.
    pub fn failover_pass(&self) {
        self.inner.families.failover_passes.inc();
    }

    /// Every metric in the OpenMetrics text format ([`OPENMETRICS_CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail, and every label value is a plain string.
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.inner.registry) {
            tracing::error!("encoding the metrics failed: {e}");
        }
        out
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The handle registered under `id`, or a new one made by `make` and registered.
fn get_or_insert<H: Clone>(
    handles: &Mutex<HashMap<String, H>>,
    id: &str,
    make: impl FnOnce() -> H,
) -> H {
    let mut handles = lock(handles);
    if let Some(h) = handles.get(id) {
        return h.clone();
    }
    let h = make();
    handles.insert(id.to_owned(), h.clone());
    h
}

fn command_index(command: Command) -> usize {
    usize::from(command.as_u16()) - 1
}

struct EndpointInner {
    id: String,
    latency: BucketHistogram,
    restarts: Counter,
    last_restart: F64Gauge,
    state_lost: Counter,
    resets: Counter,
    messages: Family<CommandLabels, Counter>,
    by_command: [OnceLock<Counter>; Command::ALL.len()],
}

/// Recording handle of one endpoint's metrics (see [`Metrics::endpoint`]). Cheap to clone.
#[derive(Clone)]
pub struct EndpointMetrics {
    inner: Arc<EndpointInner>,
}

impl fmt::Debug for EndpointMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EndpointMetrics")
            .field("endpoint", &self.inner.id)
            .finish_non_exhaustive()
    }
}

impl EndpointMetrics {
    /// Records one message of `command` that took `elapsed` from arrival to reply.
    pub fn observe(&self, command: Command, elapsed: Duration) {
        self.count(command, 1);
        self.inner.latency.observe(elapsed.as_secs_f64());
    }

    /// Adds a batch reported by a data-path process: messages by command, and their
    /// latencies as counts per bucket of [`LATENCY_BUCKETS`] (then the overflow) with their
    /// sum in seconds.
    pub fn add_requests(&self, by_command: &[(Command, u64)], buckets: &[u64], sum_secs: f64) {
        for &(command, n) in by_command {
            if n > 0 {
                self.count(command, n);
            }
        }
        self.inner.latency.add(buckets, sum_secs);
    }

    /// Counts `n` messages of `command` without a latency (e.g. a batch reported by a
    /// data-path process that keeps its own timings).
    pub fn count(&self, command: Command, n: u64) {
        self.counter(command).inc_by(n);
    }

    /// Records a data-path process of this endpoint replaced, and the stall (from its death
    /// to the replacement serving) when known. Does not count the daemon-wide
    /// `switchyard_endpoint_restarts_total` ([`Metrics::endpoint_restarted`]).
    pub fn restarted(&self, stall: Option<Duration>) {
        self.inner.restarts.inc();
        if let Some(stall) = stall {
            self.inner.last_restart.set(stall.as_secs_f64());
        }
    }

    /// Counts a replacement that could not restore all of the client's state.
    pub fn state_lost(&self) {
        self.inner.state_lost.inc();
    }

    /// Counts the daemon letting go of the client's or the device's state.
    pub fn reset(&self) {
        self.inner.resets.inc();
    }

    fn counter(&self, command: Command) -> &Counter {
        self.inner.by_command[command_index(command)].get_or_init(|| {
            self.inner.messages.get_or_create_owned(&CommandLabels {
                endpoint: self.inner.id.clone(),
                command: command_name(command),
            })
        })
    }
}

struct BoardInner {
    id: String,
    jobs: Counter,
    bytes: Counter,
    errors: Counter,
    moves: Counter,
    downtime: F64Gauge,
    replayed: Counter,
    interrupted: Counter,
}

/// Recording handle of one board's metrics (see [`Metrics::board`]). Cheap to clone.
#[derive(Clone)]
pub struct BoardMetrics {
    inner: Arc<BoardInner>,
}

impl fmt::Debug for BoardMetrics {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BoardMetrics")
            .field("board", &self.inner.id)
            .finish_non_exhaustive()
    }
}

impl BoardMetrics {
    /// Counts `n` jobs run.
    pub fn add_jobs(&self, n: u64) {
        self.inner.jobs.inc_by(n);
    }

    /// Counts `n` bytes moved by jobs.
    pub fn add_bytes(&self, n: u64) {
        self.inner.bytes.inc_by(n);
    }

    /// Counts `n` failed jobs.
    pub fn add_errors(&self, n: u64) {
        self.inner.errors.inc_by(n);
    }

    /// Counts jobs a replacement ran again (`replayed`) or stopped as interrupted.
    pub fn add_recovered(&self, replayed: u64, interrupted: u64) {
        self.inner.replayed.inc_by(replayed);
        self.inner.interrupted.inc_by(interrupted);
    }

    /// Records a finished move off this board and its downtime (the guest-visible stop).
    pub fn moved(&self, downtime: Duration) {
        self.inner.moves.inc();
        self.inner.downtime.set(downtime.as_secs_f64());
    }
}
