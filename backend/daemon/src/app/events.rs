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
//! the store (all of them, however old), worker events from the daemon's memory (the last
//! [`REPLAY`] events of this daemon; older worker events, and those of earlier daemons, are
//! gone). More than 999 999 worker events between two pool events are not numbered (dropped
//! with a log line).

use std::collections::VecDeque;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use switchyard_control::{Events, Sequenced, Subscription};
use switchyard_pool::Event as PoolEvent;
use utoipa::ToSchema;

use crate::WorkerEvent;

/// `seq` of pool event `P` is `P × SEQ_STRIDE`; worker events number the gaps.
pub const SEQ_STRIDE: u64 = 1_000_000;
/// Events this daemon keeps in memory for resuming subscribers (pool events beyond it are
/// read from the store).
pub const REPLAY: usize = 4096;
/// How far a live subscriber may fall behind before it is told it lagged.
const CHANNEL: usize = 1024;

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
    /// Workers kept dying before serving; the endpoint's client was disconnected.
    GaveUp {
        /// The endpoint.
        endpoint: String,
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
            WorkerEvent::DeviceLost {
                endpoint,
                host,
                reason,
            } => Self::DeviceLost {
                endpoint,
                host,
                reason,
            },
            WorkerEvent::Stats { .. } => return None,
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
    last: u64,
    recent: VecDeque<DaemonEvent>,
}

/// The daemon's event stream: numbering, the in-memory replay and the live hub.
pub struct EventStream {
    hub: Events<DaemonEvent>,
    state: Mutex<State>,
}

impl std::fmt::Debug for EventStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventStream")
            .field("hub", &self.hub)
            .finish_non_exhaustive()
    }
}

/// What a subscriber gets (see [`EventStream::subscribe`]).
#[derive(Debug)]
pub struct Resume {
    /// Pool events to read from the store first: those with `since < seq < before`.
    pub from_store: Option<(u64, u64)>,
    /// Events in memory after `since`.
    pub recent: Vec<DaemonEvent>,
    /// Live events after `recent`.
    pub live: Subscription<DaemonEvent>,
}

impl EventStream {
    /// A stream whose worker events follow pool event `last_pool_seq`; `recent` (the end of
    /// the store's history, oldest first) fills the replay.
    pub fn new(last_pool_seq: u64, recent: Vec<PoolEvent>) -> Self {
        let stream = Self {
            // The hub's own replay is not used: resuming is done here (`subscribe`).
            hub: Events::new(1, CHANNEL),
            state: Mutex::new(State {
                last: 0,
                recent: VecDeque::with_capacity(REPLAY),
            }),
        };
        {
            let mut st = stream.state();
            for e in recent {
                stream.push(&mut st, DaemonEvent::from_pool(e));
            }
            st.last = st.last.max(last_pool_seq.saturating_mul(SEQ_STRIDE));
        }
        stream
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn push(&self, st: &mut State, event: DaemonEvent) {
        st.last = event.seq;
        if st.recent.len() == REPLAY {
            st.recent.pop_front();
        }
        st.recent.push_back(event.clone());
        if let Err(e) = self.hub.publish(event) {
            tracing::debug!("event not streamed: {e}");
        }
    }

    /// Publishes the events of a pool mutation.
    pub fn pool(&self, events: Vec<PoolEvent>) {
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
        }
    }

    /// Publishes a worker event.
    pub fn worker(&self, event: WorkerLifecycle) {
        let mut st = self.state();
        let seq = st.last + 1;
        if seq.is_multiple_of(SEQ_STRIDE) {
            tracing::warn!(
                ?event,
                "too many worker events since the last pool event to number; dropped"
            );
            return;
        }
        let e = DaemonEvent {
            seq,
            at_unix_ms: now_unix_ms(),
            source: EventSource::Worker,
            pool: None,
            worker: Some(event),
        };
        self.push(&mut st, e);
    }

    /// The events after `since` (`None`: from now on), in three parts: pool events older than
    /// the memory (to read from the store), the events in memory, and the live ones.
    pub fn subscribe(&self, since: Option<u64>) -> Resume {
        let st = self.state();
        // Under the state lock: nothing is published between the copy and the subscription.
        let live = self.hub.subscribe(None);
        let Some(since) = since else {
            return Resume {
                from_store: None,
                recent: Vec::new(),
                live,
            };
        };
        let floor = st.recent.front().map_or(st.last + 1, |e| e.seq);
        let from_store = (since + 1 < floor).then_some((since, floor));
        let recent = st
            .recent
            .iter()
            .filter(|e| e.seq > since)
            .cloned()
            .collect();
        Resume {
            from_store,
            recent,
            live,
        }
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
