//! What the daemon does with its supervisor's reports (its [`EventSink`]).
//!
//! A [`WorkerLifecycle`] is acted on (the worker's pid record, the endpoint's metrics, the
//! migrations the daemon follows) and then published on the events stream as it is: the value
//! the supervisor made is the one a client reads (see [`crate::lifecycle`]). A
//! [`WorkerSignal`] is only acted on: a stats report goes into the metrics, a board failure to
//! the pool (whose own events say what came of it), the end of an adopted worker's move
//! settles the move the store has in progress, a migration change past the endpoint's event
//! budget is followed like any other.
//!
//! Every reaction is short or runs off the calling supervision thread, which must go on
//! reading its worker's notes.

use std::sync::{Arc, OnceLock, Weak};

use switchyard_control::Metrics;

use super::api::incoming::EndpointMigration;
use super::events::EventStream;
use super::records::WorkerRecords;
use super::{Daemon, stats};
use crate::lifecycle::{MigrationChange, WorkerLifecycle};
use crate::supervisor::{EventSink, WorkerEvent, WorkerSignal};

/// Where the reactions find the daemon, once it exists (the sink is made before it).
pub(super) type DaemonCell = Arc<OnceLock<Weak<Daemon>>>;

/// What the sink acts on.
pub(super) struct Reactions {
    pub(super) events: Arc<EventStream>,
    pub(super) metrics: Metrics,
    pub(super) records: WorkerRecords,
    pub(super) daemon: DaemonCell,
    /// Hands a change to the migrations follower (`api::incoming::follow_migrations`: its
    /// queue, a `Sender`, which is `Sync`: every supervision thread sends without a lock).
    pub(super) migrations: Box<dyn Fn(EndpointMigration) + Send + Sync>,
}

impl Reactions {
    /// The supervisor's sink: every report goes through [`Reactions::take`].
    pub(super) fn into_sink(self) -> EventSink {
        Arc::new(move |e| self.take(e))
    }

    fn take(&self, e: WorkerEvent) {
        match e {
            WorkerEvent::Lifecycle(event) => {
                self.act(&event);
                // Followed once published: what the follower publishes because of it
                // (`migrated`, `migration_aborted`) comes after it in the stream.
                let followed = Self::followed(&event);
                self.events.worker(event);
                if let Some((endpoint, change)) = followed {
                    self.follow(&endpoint, change);
                }
            }
            WorkerEvent::Signal(signal) => self.signal(signal),
        }
    }

    fn daemon(&self) -> Option<Arc<Daemon>> {
        self.daemon.get().and_then(Weak::upgrade)
    }

    /// What the daemon does about a worker's lifecycle event, before it is published.
    fn act(&self, event: &WorkerLifecycle) {
        match event {
            WorkerLifecycle::Ready {
                endpoint,
                restart: Some(stall),
                ..
            } => {
                self.metrics.endpoint_restarted();
                self.metrics.endpoint(endpoint).restarted(Some(*stall));
            }
            WorkerLifecycle::StateLost { endpoint, .. } => {
                self.metrics.endpoint(endpoint).state_lost();
            }
            WorkerLifecycle::Reset { endpoint, .. } => self.metrics.endpoint(endpoint).reset(),
            // A lost device's board failure comes as its own signal, and a started worker's
            // pid record with `WorkerSignal::Spawned` (its nonce is not published).
            // Migration changes (and a dead worker, which ends its device's migration) are
            // followed once published (`followed`).
            WorkerLifecycle::Exited { .. }
            | WorkerLifecycle::Migration { .. }
            | WorkerLifecycle::DeviceLost { .. }
            | WorkerLifecycle::Started { .. }
            | WorkerLifecycle::Ready { .. }
            | WorkerLifecycle::GaveUp { .. }
            | WorkerLifecycle::Migrated { .. }
            | WorkerLifecycle::MigrationAborted { .. }
            | WorkerLifecycle::MigrationReleased { .. }
            | WorkerLifecycle::MigratedAway { .. } => {}
        }
    }

    /// The migration change a lifecycle event means for the follower, if any: its device's
    /// new state, or `exited` for a dead worker (which ends its device's migration).
    fn followed(event: &WorkerLifecycle) -> Option<EndpointMigration> {
        match event {
            WorkerLifecycle::Exited { endpoint, .. } => {
                let exited = MigrationChange {
                    state: "exited".into(),
                    cause: String::new(),
                    origin_verified: false,
                    sent: false,
                };
                Some((endpoint.clone(), exited))
            }
            WorkerLifecycle::Migration { endpoint, change } => {
                Some((endpoint.clone(), change.clone()))
            }
            _ => None,
        }
    }

    /// What the daemon does about a signal (never published).
    fn signal(&self, signal: WorkerSignal) {
        match signal {
            WorkerSignal::Stats { endpoint, stats } => {
                // From the inventory's snapshot: never waits for the pool's owner.
                let board = self.daemon().and_then(|d| {
                    let inventory = d.inventory();
                    let device = inventory.endpoint(&endpoint)?.device.clone()?;
                    Some(inventory.device(&device)?.board)
                });
                stats::record(&self.metrics, &endpoint, board.as_deref(), &stats);
            }
            WorkerSignal::BoardFailed {
                endpoint,
                lease,
                failure,
            } => {
                // The daemon records it and fails the board's endpoints over, off the
                // supervision thread (the endpoint shows its failover pending from here on).
                // `lease`: the device the reporting worker ran, whose board failed.
                if let Some(d) = self.daemon() {
                    d.board_failure_reported(&endpoint, lease, failure);
                }
            }
            WorkerSignal::Spawned {
                endpoint,
                pid,
                nonce,
            } => self.records.write(&endpoint, pid, &nonce),
            WorkerSignal::Migration { endpoint, change } => self.follow(&endpoint, change),
            WorkerSignal::AdoptedMoveEnded { endpoint } => {
                // Off the supervision thread, as for a failed board.
                let (daemon, owned) = (self.daemon.clone(), endpoint.clone());
                let spawned = std::thread::Builder::new()
                    .name("sy-move-settle".into())
                    .spawn(move || {
                        if let Some(d) = daemon.get().and_then(Weak::upgrade) {
                            d.adopted_move_ended(&owned);
                        }
                    });
                if let Err(e) = spawned {
                    tracing::error!(%endpoint, "cannot start settling the move an adopted worker ended (it stays in progress in the store): {e}");
                }
            }
        }
    }

    /// Hands an endpoint's migration state change to the migrations follower.
    fn follow(&self, endpoint: &str, change: MigrationChange) {
        (self.migrations)((endpoint.to_owned(), change));
    }
}

#[cfg(test)]
mod tests;
