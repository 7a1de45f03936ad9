//! The daemon's events: the pool's lifecycle events (durable, in the store's history) and
//! its workers' lifecycle (not persisted), in one stream with one sequence number.
//!
//! # Numbering
//!
//! `seq` increases over the daemon's whole life, across restarts, without a persisted
//! counter of its own: a pool event numbered `P` by the store has `seq = P × 1 000 000`, and
//! the worker events that follow it have `seq = P × 1 000 000 + 1, + 2, ...` (the next pool
//! event, `P + 1`, is always above them). Every daemon start records a pool event (`opened`),
//! so the worker events of a new daemon never reuse the numbers of an old one. `GET
//! /events?since=SEQ` therefore resumes from any `seq` a client has seen: pool events come from
//! the store (those its retention keeps, below), worker events from the daemon's memory (the
//! last [`REPLAY`] worker events of this daemon; older worker events, and those of earlier
//! daemons, are gone).
//!
//! # A full gap: no worker event is dropped
//!
//! A gap holds 999 999 worker events. When [`MARK_AT`] of them follow one pool event, the
//! stream asks the pool's owner for a mark ([`EventStream::set_marker`]): a pool event
//! (`seq_mark`) that changes nothing and opens a new gap. The stream only asks (a message to
//! the owner's queue, never a wait), so the supervision thread publishing a worker event never
//! blocks on the store; the owner commits the mark and publishes it like any pool event. Should
//! the gap fill before the mark is published (the store slow, or failing), worker events are
//! not dropped: they wait, in order and with the time they happened, and are numbered right
//! after the next pool event (the mark, or any other), which publishes them. A mark that fails
//! to commit is asked again by the next worker event. `state_lost` and `device_lost` are
//! worker events like the others: every one is published, at worst late.
//!
//! # Retention and `since`
//!
//! The store prunes old pool events (`[daemon] events_keep`, `events_max_age`; see
//! `switchyard_pool`'s store) and records the last pool seq `P` it pruned, so a reader may
//! resume from any `since ≥ P × 1 000 000` ([`EventStream::oldest_since`]). `GET /events`
//! with an older `since` is refused with 410 ([`EventsPruned`], with `oldest_since`) rather
//! than silently starting later. Events pruned while a reader pages through the history are
//! reported where they were, in a `lagged` notice (as worker events gone from memory are).
//!
//! # Across an upgrade
//!
//! The numbering is that of the previous release: `seq = P × 1 000 000 + k` with the store's
//! pool seq `P`, which a store of that release keeps (its `next_seq` goes on). So a `seq` a
//! client saw from the previous daemon, used as `since`, resumes at the same place with this
//! one. Such a store has no record of pruning (it never pruned): its first open with this
//! release prunes what the configured retention does not keep, after which a `since` before
//! that is answered 410. A store with a `seq_mark` cannot be read by a daemon of the previous
//! release (it does not know the event).
//!
//! # Streaming
//!
//! A reader holds one page at a time, whatever the length of the history: the history is read
//! [`PAGE`] events at a time (one store read transaction, merged with the worker events in
//! memory) when the body has sent the previous page on, so a reader that stops reading stops
//! the reads too. Once it has every event published so far it takes the live feed, under the
//! lock that publishing takes: no event is missed or sent twice at the seam. Worker events
//! dropped from memory before a slow reader got to them are reported where they were
//! (`{"type":"lagged","missed":N}`), as the live feed reports a reader that falls behind. At
//! most [`MAX_STREAMS`] streams are open at once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use serde::{Deserialize, Serialize};
use switchyard_control::{ErrorDetail, Events, Received, Sequenced, StreamNotice, Subscription};
use switchyard_pool::{Event as PoolEvent, History};
use utoipa::ToSchema;

use crate::WorkerEvent;

/// `seq` of pool event `P` is `P × SEQ_STRIDE`; worker events number the gaps.
pub const SEQ_STRIDE: u64 = 1_000_000;
/// Worker events this daemon keeps in memory for resuming subscribers (pool events are read
/// from the store).
pub const REPLAY: usize = 4096;
/// How far a live subscriber may fall behind before it is told it lagged.
const CHANNEL: usize = 1024;
/// Events a reader of the history takes at a time: at most this many pool events per store
/// read transaction, and as many worker events from memory.
pub const PAGE: usize = 256;
/// Events streams open at once (`GET /events`); one more is refused (503). Half the control
/// socket's connections, so that streams cannot take them all.
pub const MAX_STREAMS: usize = 32;
/// Worker events after one pool event at which the stream asks the pool's owner for a mark
/// (half the gap: the store has 499 999 worker events' time to commit it before any waits).
pub const MARK_AT: u64 = SEQ_STRIDE / 2;

/// The body of `GET /events`'s 410: the `since` asked for is older than what the store keeps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct EventsPruned {
    /// `code` `events_pruned`, and a message.
    pub error: ErrorDetail,
    /// The oldest `since` this daemon can resume from (every pool event after it is kept):
    /// the last pruned pool seq × 1 000 000.
    pub oldest_since: u64,
}

impl EventsPruned {
    /// The answer to a reader asking for the events after `since` when the store pruned
    /// every pool event up to `pruned`, if that is older than what is kept.
    pub fn check(since: u64, pruned: u64) -> Result<(), Self> {
        let oldest_since = EventStream::oldest_since(pruned);
        if since >= oldest_since {
            return Ok(());
        }
        Err(Self {
            error: ErrorDetail {
                code: "events_pruned".into(),
                message: format!(
                    "The events after seq {since} are no longer all kept (the store's \
                     retention, [daemon] events_keep and events_max_age, pruned the pool events \
                     up to {pruned}); resume from since={oldest_since} or later"
                ),
            },
            oldest_since,
        })
    }
}

/// Where an event comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum EventSource {
    /// The pool (boards, endpoints, leases): the `pool` member; kept in the store.
    Pool,
    /// An endpoint's worker process: the `worker` member; not persisted.
    Worker,
}

/// One line of `GET /events`: `{"seq":..,"at_unix_ms":..,"type":"pool","pool":{..}}` or
/// `{"seq":..,"at_unix_ms":..,"type":"worker","worker":{"event":"ready",..}}`. (A stream may
/// also carry `{"type":"lagged","missed":N}` notices.)
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct DaemonEvent {
    /// Sequence number: `pool_seq × 1 000 000` for a pool event, the gaps between for
    /// worker events (see the module documentation). Resume with `?since=seq`.
    pub seq: u64,
    /// Wall-clock time, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// `pool` or `worker`: which member is present.
    #[serde(rename = "type")]
    pub source: EventSource,
    /// The pool's event (with its own `seq` in the store's history).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolEvent>,
    /// A worker's lifecycle event.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub worker: Option<WorkerLifecycle>,
}

impl Sequenced for DaemonEvent {
    fn seq(&self) -> u64 {
        self.seq
    }
}

impl DaemonEvent {
    /// The stream's form of a pool event.
    pub fn from_pool(event: PoolEvent) -> Self {
        Self {
            seq: event.seq.saturating_mul(SEQ_STRIDE),
            at_unix_ms: event.at_unix_ms,
            source: EventSource::Pool,
            pool: Some(event),
            worker: None,
        }
    }
}

/// What happened to an endpoint's worker process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum WorkerLifecycle {
    /// A worker process started.
    Started {
        /// The endpoint.
        endpoint: String,
        /// The worker's pid.
        pid: u32,
        /// It resumes a device (a restart or upgrade) rather than creating one.
        resume: bool,
    },
    /// The worker serves the endpoint's socket.
    Ready {
        /// The endpoint.
        endpoint: String,
        /// The worker's pid.
        pid: u32,
        /// It continued the client's connection.
        resumed_connection: bool,
        /// From the previous worker's death to this one serving (a restart), milliseconds.
        restart_ms: Option<f64>,
    },
    /// A worker exited (killed, crashed, replaced).
    Exited {
        /// The endpoint.
        endpoint: String,
        /// The worker's pid.
        pid: u32,
        /// How it ended, e.g. `signal: 9 (SIGKILL)`.
        status: String,
    },
    /// Workers kept dying before serving; the endpoint's client was disconnected and the
    /// endpoint refuses connections.
    GaveUp {
        /// The endpoint.
        endpoint: String,
    },
    /// The endpoint's device changed migration state (its VMM migrates it out or in):
    /// `pre_copy`, `stop_copy`, `resuming`, `stop`, `running`, `error`.
    Migration {
        /// The endpoint.
        endpoint: String,
        /// The new state.
        state: String,
        /// What changed it: `request` (the VMM), `reset` (a device reset abandoned the
        /// migration), `client_gone` (the VMM went away, which abandons it), `idle_timeout`
        /// (the stream had no activity for `[daemon] migration_idle_timeout`: abandoned, the
        /// device runs), `wrong_origin` (an incoming endpoint's stream did not come from its
        /// source: ERROR).
        cause: String,
    },
    /// A live migration onto an incoming endpoint (`POST /v1/endpoints/{id}/incoming`)
    /// completed: the destination's device loaded the state and runs; its lease is kept and
    /// the source endpoint is deleted (its lease released) once its VMM let go of it.
    Migrated {
        /// The destination endpoint.
        endpoint: String,
        /// The source endpoint.
        source: String,
    },
    /// A live migration onto an incoming endpoint ended without the destination running:
    /// the destination endpoint is deleted (its lease released); the source serves on.
    MigrationAborted {
        /// The destination endpoint.
        endpoint: String,
        /// The source endpoint.
        source: String,
        /// The destination's last migration state.
        state: String,
    },
    /// The clean-up after a live migration onto an incoming endpoint: `endpoint`, the one the
    /// migration left behind (the source after `migrated`, the destination after
    /// `migration_aborted`), was deleted once its VMM let go of it (`deleted`), or was gone
    /// already: deleted, or deleted and created again with the same id (another incarnation
    /// is never touched).
    MigrationReleased {
        /// The endpoint.
        endpoint: String,
        /// Whether the clean-up deleted it.
        deleted: bool,
    },
    /// Workers kept dying before serving, or an adopted worker held more than the budget:
    /// the daemon let go of what the next worker would have restored (the client's
    /// connection and descriptors; then the device's state).
    Reset {
        /// The endpoint.
        endpoint: String,
        /// What was let go, and why.
        what: String,
    },
    /// A replacement could not restore all of the client's state: DMA windows or interrupt
    /// eventfds the client had been told succeeded are gone (the endpoint is `degraded`
    /// until its client leaves).
    StateLost {
        /// The endpoint.
        endpoint: String,
        /// What was lost, one line each.
        problems: Vec<String>,
    },
    /// The kernel took the endpoint's passthrough device back (unbind, removal): every
    /// access fails with ENODEV, the VMM was told (REQ), the board is quarantined.
    DeviceLost {
        /// The endpoint.
        endpoint: String,
        /// The device's PCI address.
        host: String,
        /// What happened.
        reason: String,
    },
}

impl WorkerLifecycle {
    /// The lifecycle change `e` is, if it is one (a stats report is not).
    pub fn of(e: WorkerEvent) -> Option<Self> {
        Some(match e {
            WorkerEvent::Started {
                endpoint,
                pid,
                resume,
            } => Self::Started {
                endpoint,
                pid,
                resume,
            },
            WorkerEvent::Ready {
                endpoint,
                pid,
                resumed_connection,
                restart,
            } => Self::Ready {
                endpoint,
                pid,
                resumed_connection,
                restart_ms: restart.map(ms),
            },
            WorkerEvent::Exited {
                endpoint,
                pid,
                status,
            } => Self::Exited {
                endpoint,
                pid,
                status,
            },
            WorkerEvent::GaveUp { endpoint } => Self::GaveUp { endpoint },
            WorkerEvent::Migration {
                endpoint,
                state,
                cause,
                publish: true,
                ..
            } => Self::Migration {
                endpoint,
                state,
                cause,
            },
            WorkerEvent::Migration { publish: false, .. } => return None,
            WorkerEvent::Reset { endpoint, what } => Self::Reset { endpoint, what },
            WorkerEvent::StateLost { endpoint, problems } => Self::StateLost { endpoint, problems },
            WorkerEvent::DeviceLost {
                endpoint,
                host,
                reason,
                ..
            } => Self::DeviceLost {
                endpoint,
                host,
                reason,
            },
            // The pool's events say it (`board_failed`) and what came of it.
            WorkerEvent::BoardFailed { .. } => return None,
            // The pool's events say what came of it (`lease_moved`, `move_aborted`).
            WorkerEvent::Stats { .. } | WorkerEvent::AdoptedMoveEnded { .. } => return None,
        })
    }
}

/// A duration in milliseconds (fractional).
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

struct State {
    /// `seq` of the last event published.
    last: u64,
    /// The last [`REPLAY`] worker events (pool events are in the store).
    workers: VecDeque<DaemonEvent>,
    /// Worker events dropped from the front of `workers` so far: the number, over this
    /// daemon's life, of the worker event `workers[0]` ([`Cursor`] counts the same way).
    evicted: u64,
    /// Worker events waiting for a number (the gap after the last pool event is full), in
    /// order; numbered and published after the next pool event.
    waiting: VecDeque<DaemonEvent>,
    /// A mark was asked for and no pool event was published since.
    mark_asked: bool,
}

/// Asks the pool's owner for a mark ([`EventStream::set_marker`]).
type Marker = Box<dyn Fn(u64) + Send + Sync>;

/// The daemon's event stream: numbering, the worker events in memory, the live hub and the
/// readers of the history.
pub struct EventStream {
    hub: Events<DaemonEvent>,
    state: Mutex<State>,
    /// The store's history, once a reader needed it.
    history: OnceLock<History>,
    /// Streams open.
    streams: AtomicUsize,
    /// Asks for a mark, once the pool's owner runs.
    marker: OnceLock<Marker>,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("hub", &self.hub)
            .field("streams", &self.streams.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

/// A reader's place in the stream ([`EventStream::cursor`]): what it has been given so far.
#[derive(Debug, Clone)]
pub struct Cursor {
    /// Every event up to this `seq` has been handed out (or reported lost).
    seq: u64,
    /// The number of the next worker event to hand out (see `State::evicted`).
    worker: u64,
    /// `follow=false`: the last `seq` to hand out (the last event when the reader came).
    end: Option<u64>,
}

/// What [`EventStream::next_page`] hands out.
#[derive(Debug)]
pub enum Step {
    /// The next events in order, with a lag notice first when worker events were dropped from
    /// memory before the reader got them. May be empty.
    Page(Vec<Received<DaemonEvent>>),
    /// The reader has every event published so far: the events after them.
    Live(Subscription<DaemonEvent>),
    /// `follow=false`: every event up to the end was handed out.
    End,
}

/// One of the [`MAX_STREAMS`] stream slots ([`EventStream::open_stream`]), free again when
/// dropped.
#[derive(Debug)]
pub struct StreamSlot(Arc<EventStream>);

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.streams.fetch_sub(1, Ordering::AcqRel);
    }
}

impl EventStream {
    /// A stream whose worker events follow pool event `last_pool_seq` (readers read pool
    /// events from the store).
    pub fn new(last_pool_seq: u64) -> Self {
        Self {
            // The hub's own replay is not used: readers catch up here (`next_page`).
            hub: Events::new(1, CHANNEL),
            state: Mutex::new(State {
                last: last_pool_seq.saturating_mul(SEQ_STRIDE),
                workers: VecDeque::with_capacity(REPLAY),
                evicted: 0,
                waiting: VecDeque::new(),
                mark_asked: false,
            }),
            history: OnceLock::new(),
            streams: AtomicUsize::new(0),
            marker: OnceLock::new(),
        }
    }

    /// Sets how the stream asks for a mark: `ask(worker_events)` must commit a pool event
    /// (`seq_mark`) and publish it ([`EventStream::pool`]), or call
    /// [`EventStream::mark_failed`]; it is called from any thread, the pool owner's included,
    /// so it must not wait for the owner (the owner sets it, and queues the mark).
    pub fn set_marker(&self, ask: impl Fn(u64) + Send + Sync + 'static) {
        let _ = self.marker.set(Box::new(ask));
    }

    /// The mark asked for could not be committed: the next worker event asks again.
    pub fn mark_failed(&self) {
        self.state().mark_asked = false;
    }

    /// The oldest `since` a reader can resume from when the store pruned the pool events up
    /// to `pruned` ([`switchyard_pool::History::pruned`]).
    pub fn oldest_since(pruned: u64) -> u64 {
        pruned.saturating_mul(SEQ_STRIDE)
    }

    /// Whether a mark is due after what was just published (and now asked for), and the
    /// worker events of the gap.
    fn mark_due(st: &mut State) -> Option<u64> {
        let in_gap = st.last % SEQ_STRIDE + st.waiting.len() as u64;
        if st.mark_asked || in_gap < MARK_AT {
            return None;
        }
        st.mark_asked = true;
        Some(in_gap)
    }

    fn ask_mark(&self, due: Option<u64>) {
        let Some(worker_events) = due else { return };
        match self.marker.get() {
            Some(ask) => ask(worker_events),
            None => tracing::warn!(
                worker_events,
                "worker events fill their gap and nothing writes a mark: they wait for the next pool event"
            ),
        }
    }

    /// Numbers the waiting worker events after the last event, as many as the gap holds.
    fn number_waiting(&self, st: &mut State) {
        while !(st.last + 1).is_multiple_of(SEQ_STRIDE) {
            let Some(mut e) = st.waiting.pop_front() else {
                break;
            };
            e.seq = st.last + 1;
            self.push(st, e);
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, st: &mut State, event: DaemonEvent) {
        st.last = event.seq;
        if event.source == EventSource::Worker {
            if st.workers.len() == REPLAY {
                st.workers.pop_front();
                st.evicted += 1;
            }
            st.workers.push_back(event.clone());
        }
        if let Err(e) = self.hub.publish(event) {
            tracing::debug!("event not streamed: {e}");
        }
    }

    /// Publishes the events of a pool mutation (committed to the store before this).
    pub fn pool(&self, events: Vec<PoolEvent>) {
        let due = {
            let mut st = self.state();
            for e in events {
                let e = DaemonEvent::from_pool(e);
                if e.seq <= st.last {
                    tracing::error!(
                        seq = e.seq,
                        last = st.last,
                        "pool event out of order; dropped"
                    );
                    continue;
                }
                self.push(&mut st, e);
                // A new gap: the mark asked for (if any) is no longer needed.
                st.mark_asked = false;
                self.number_waiting(&mut st);
            }
            Self::mark_due(&mut st)
        };
        self.ask_mark(due);
    }

    /// Publishes a worker event.
    /// Never dropped: when the gap after the last pool event is full, it waits for the next
    /// pool event (see the module documentation).
    pub fn worker(&self, event: WorkerLifecycle) {
        let due = {
            let mut st = self.state();
            let mut e = DaemonEvent {
                seq: 0,
                at_unix_ms: now_unix_ms(),
                source: EventSource::Worker,
                pool: None,
                worker: Some(event),
            };
            if st.waiting.is_empty() && !(st.last + 1).is_multiple_of(SEQ_STRIDE) {
                e.seq = st.last + 1;
                self.push(&mut st, e);
            } else {
                if st.waiting.is_empty() {
                    tracing::warn!(
                        last = st.last,
                        "the worker events' gap is full: they wait for the next pool event"
                    );
                }
                st.waiting.push_back(e);
            }
            Self::mark_due(&mut st)
        };
        self.ask_mark(due);
    }

    /// Where a reader of the events after `since` starts (`None`: the events from now on).
    /// With `follow` false, it ends at the last event published now.
    pub fn cursor(&self, since: Option<u64>, follow: bool) -> Cursor {
        let st = self.state();
        let seq = since.map_or(st.last, |s| s.min(st.last));
        Cursor {
            seq,
            worker: st.evicted + st.workers.partition_point(|e| e.seq <= seq) as u64,
            end: (!follow).then_some(st.last),
        }
    }

    /// The next step of the reader at `cursor`, which it advances: the next page of events
    /// (pool events read with `read_pool(after_pool_seq, limit)`, the store's
    /// [`History::page`]), the live feed once it has every event published, or the end.
    pub fn next_page<E>(
        &self,
        cursor: &mut Cursor,
        read_pool: impl FnOnce(u64, usize) -> Result<Vec<PoolEvent>, E>,
    ) -> Result<Step, E> {
        let (bound, lost, workers) = {
            let st = self.state();
            let bound = cursor.end.map_or(st.last, |end| end.min(st.last));
            if cursor.seq >= bound {
                return Ok(match cursor.end {
                    Some(_) => Step::End,
                    // Under the state lock, which publishing takes: every event after
                    // `cursor.seq` is published after this subscription.
                    None => Step::Live(self.hub.subscribe(None)),
                });
            }
            let lost = st.evicted.saturating_sub(cursor.worker);
            cursor.worker = cursor.worker.max(st.evicted);
            let from = usize::try_from(cursor.worker - st.evicted)
                .unwrap_or(usize::MAX)
                .min(st.workers.len());
            let workers: Vec<DaemonEvent> = st
                .workers
                .range(from..)
                .take_while(|e| e.seq <= bound)
                .take(PAGE)
                .cloned()
                .collect();
            (bound, lost, workers)
        };
        // Committed before published: every pool event up to `bound` is in the store.
        let pool: Vec<DaemonEvent> = read_pool(cursor.seq / SEQ_STRIDE, PAGE)?
            .into_iter()
            .map(DaemonEvent::from_pool)
            .collect();
        // A list cut at PAGE may go on past its last event: the page ends there.
        let mut cut = bound;
        for list in [&pool, &workers] {
            if list.len() == PAGE
                && let Some(last) = list.last()
            {
                cut = cut.min(last.seq);
            }
        }
        // Pool events are numbered without gaps and every one up to `bound` is committed: those
        // up to `cut` that the store no longer has were pruned (retention) since the reader came.
        let passed = cut / SEQ_STRIDE - cursor.seq / SEQ_STRIDE;
        let kept = pool.iter().filter(|e| e.seq <= cut).count() as u64;
        let lost = lost + passed.saturating_sub(kept);
        let mut page = Vec::with_capacity(pool.len() + workers.len() + 1);
        if lost > 0 {
            page.push(Received::Lagged { missed: lost });
        }
        let mut pool = pool.into_iter().filter(|e| e.seq <= cut).peekable();
        let mut workers = workers.into_iter().filter(|e| e.seq <= cut).peekable();
        loop {
            let take_worker = match (pool.peek(), workers.peek()) {
                (Some(p), Some(w)) => w.seq < p.seq,
                (Some(_), None) => false,
                (None, Some(_)) => true,
                (None, None) => break,
            };
            let next = if take_worker {
                cursor.worker += 1;
                workers.next()
            } else {
                pool.next()
            };
            page.extend(next.map(Received::Event));
        }
        cursor.seq = cut;
        Ok(Step::Page(page))
    }

    /// A stream slot, or `None` when [`MAX_STREAMS`] are open.
    pub fn open_stream(self: &Arc<Self>) -> Option<StreamSlot> {
        self.streams
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < MAX_STREAMS).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamSlot(Arc::clone(self)))
    }

    /// The store's history, if a reader has set it ([`EventStream::set_history`]).
    pub fn history(&self) -> Option<History> {
        self.history.get().cloned()
    }

    /// Keeps the store's history for readers.
    pub fn set_history(&self, history: History) {
        let _ = self.history.set(history);
    }

    /// The body of `GET /events` for the reader at `cursor`, which holds `slot` until it
    /// ends: newline-delimited JSON, one event (or lag notice) per line. Each page of the
    /// history is read (off the runtime thread) when the body has sent the previous one on;
    /// a store that fails mid-stream cuts the body (the client sees it unterminated).
    pub fn body(self: &Arc<Self>, cursor: Cursor, history: History, slot: StreamSlot) -> Body {
        enum Phase {
            History(Cursor),
            Live(Subscription<DaemonEvent>),
            /// Cut (the error was the last item).
            Cut,
        }
        struct Reader {
            events: Arc<EventStream>,
            history: History,
            phase: Phase,
            page: std::vec::IntoIter<Received<DaemonEvent>>,
            _slot: StreamSlot,
        }
        let reader = Reader {
            events: Arc::clone(self),
            history,
            phase: Phase::History(cursor),
            page: Vec::new().into_iter(),
            _slot: slot,
        };
        let lines = futures_util::stream::unfold(reader, |mut r| async move {
            loop {
                if let Some(item) = r.page.next() {
                    return Some((Ok(line(&item)), r));
                }
                let mut cursor = match &mut r.phase {
                    Phase::Live(sub) => {
                        let item = sub.recv().await?;
                        return Some((Ok(line(&item)), r));
                    }
                    Phase::History(cursor) => cursor.clone(),
                    Phase::Cut => return None,
                };
                let (events, history) = (Arc::clone(&r.events), r.history.clone());
                let step = tokio::task::spawn_blocking(move || {
                    let step = events.next_page(&mut cursor, |since, n| history.page(since, n));
                    (cursor, step)
                })
                .await;
                match step {
                    Ok((cursor, Ok(Step::Page(page)))) => {
                        r.phase = Phase::History(cursor);
                        r.page = page.into_iter();
                    }
                    Ok((_, Ok(Step::Live(sub)))) => r.phase = Phase::Live(sub),
                    Ok((_, Ok(Step::End))) => return None,
                    Ok((_, Err(e))) => {
                        tracing::warn!("events stream cut: cannot read the history: {e}");
                        r.phase = Phase::Cut;
                        return Some((Err(std::io::Error::other(e)), r));
                    }
                    Err(e) => {
                        tracing::warn!("events stream cut: {e}");
                        r.phase = Phase::Cut;
                        return Some((Err(std::io::Error::other(e)), r));
                    }
                }
            }
        });
        Body::from_stream(lines)
    }

    /// Whether [`EventStream::close`] was called.
    pub fn is_closed(&self) -> bool {
        self.hub.is_closed()
    }

    /// Ends every live subscription (the daemon stops).
    pub fn close(&self) {
        self.hub.close();
    }
}

/// One line of the stream: the event, or `{"type":"lagged","missed":N}`.
fn line(item: &Received<DaemonEvent>) -> Bytes {
    let encoded = match item {
        Received::Event(e) => serde_json::to_vec(e),
        Received::Lagged { missed } => {
            serde_json::to_vec(&StreamNotice::Lagged { missed: *missed })
        }
    };
    let mut v = encoded.unwrap_or_else(|_| br#"{"type":"lagged","missed":1}"#.to_vec());
    v.push(b'\n');
    Bytes::from(v)
}

#[cfg(test)]
mod tests;
