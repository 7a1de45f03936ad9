//! What the supervisor tells its owner about the workers ([`EventSink`]): a
//! [`WorkerLifecycle`] (what happened to a worker, which the daemon publishes as it is), or a
//! [`WorkerSignal`] (something only the daemon acts on). See [`crate::lifecycle`].

use std::sync::Arc;

use crate::custody::WorkerStats;
use crate::lifecycle::{BoardFailure, MigrationChange, WorkerLifecycle};

/// What the supervisor reports of an endpoint's worker.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkerEvent {
    /// Something that happened to the worker: the daemon acts on it and publishes it on its
    /// events stream, as it is.
    Lifecycle(WorkerLifecycle),
    /// Something only the daemon acts on; not an event of the stream.
    Signal(WorkerSignal),
}

/// What the daemon acts on but the events stream does not show (see [`crate::lifecycle`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerSignal {
    /// What the worker served since its last report (about every second; for the metrics).
    Stats {
        /// Endpoint.
        endpoint: String,
        /// The report.
        stats: WorkerStats,
    },
    /// The device found its board failed ([`Note::BoardFailed`]), or lost its backing
    /// ([`Note::DeviceLost`], a failure whose state did not outlive it): the pool records
    /// the failure and fails the endpoint over, and its own events say so.
    ///
    /// [`Note::BoardFailed`]: crate::custody::Note::BoardFailed
    /// [`Note::DeviceLost`]: crate::custody::Note::DeviceLost
    BoardFailed {
        /// Endpoint.
        endpoint: String,
        /// The lease the reporting worker served
        /// ([`WorkerStatus::lease`](super::WorkerStatus::lease)): the failed board is that
        /// device's, whatever the endpoint leases when the report is read.
        lease: Option<String>,
        /// What failed, and whether the device's state outlived it.
        failure: BoardFailure,
    },
    /// A migration state change past the endpoint's event budget (a client can change its
    /// device's migration state at message rate): the daemon follows it as it follows a
    /// [`WorkerLifecycle::Migration`], the stream does not show it.
    Migration {
        /// Endpoint.
        endpoint: String,
        /// The change.
        change: MigrationChange,
    },
    /// A worker process was spawned, with the nonce it proves itself by on its adoption
    /// socket: the daemon writes its pid record (see [`crate::custody::WorkerNonce`]). Not
    /// an event: the nonce is for the daemon alone.
    Spawned {
        /// Endpoint.
        endpoint: String,
        /// Its pid.
        pid: u32,
        /// Its nonce.
        nonce: crate::custody::WorkerNonce,
    },
    /// A move that an adopted worker was still running when adopted has ended (the worker
    /// answered, or died and its replacement runs the device on one side):
    /// [`Supervisor::adopted_move`](super::Supervisor::adopted_move) says how.
    AdoptedMoveEnded {
        /// Endpoint.
        endpoint: String,
    },
}

/// Receives [`WorkerEvent`]s (called from supervision threads; keep it short).
pub type EventSink = Arc<dyn Fn(WorkerEvent) + Send + Sync>;

/// How the supervision threads hand their reports to the sink.
pub(super) trait Report {
    /// Hands `event` over.
    fn lifecycle(&self, event: WorkerLifecycle);
    /// Hands `signal` over.
    fn signal(&self, signal: WorkerSignal);
}

impl Report for EventSink {
    fn lifecycle(&self, event: WorkerLifecycle) {
        self(WorkerEvent::Lifecycle(event));
    }

    fn signal(&self, signal: WorkerSignal) {
        self(WorkerEvent::Signal(signal));
    }
}
