//! Incoming endpoints: the destination of a live migration of an endpoint's VM.
//!
//! `POST /v1/endpoints/{source}/incoming` creates an endpoint leasing a free device of the
//! source's shape from the source's pool (the pool of the source's board when the source was
//! created on a named device; boards in no pool for a board in none), whose worker serves a fresh device for the
//! destination VMM to put into RESUMING. The daemon then follows the destination device's
//! migration states (the worker's [`crate::custody::Note::Migration`]):
//!
//! - RESUMING, then STOP (the stream loaded), then RUNNING: the migration completed. The
//!   destination keeps its lease; the source endpoint is deleted (its lease released) once its
//!   VMM let go of the device (the source QEMU quits after a completed migration), or after
//!   [`SOURCE_GRACE`] at most. Event `migrated`, metric `switchyard_migrations_completed`.
//! - Anything else after RESUMING (back to RUNNING without loading: the destination VMM gave up;
//!   ERROR: the stream did not load; the worker died): the migration is over without the
//!   destination. The destination endpoint is deleted (its lease released) once its VMM is gone;
//!   the source serves on. Event `migration_aborted`, metric `switchyard_migrations_aborted`.
//!
//! Moves, restarts, upgrades and drains of either endpoint are refused while its device
//! streams (see `refuse_while_migrating`). The link between the two endpoints is kept in
//! memory: a daemon restarted in the middle of a migration leaves both endpoints as they are.

use std::time::{Duration, Instant};

use serde::Deserialize;
use switchyard_control::ApiError;
use switchyard_pool::{BoardState, EndpointSpec as PoolEndpointSpec};
use utoipa::ToSchema;

use super::super::Daemon;
use super::unknown_endpoint;
use super::views::EndpointStatus;
use crate::lifecycle::{MigrationChange, WorkerLifecycle};

/// How long a migrated-away source (or an abandoned destination) may stay connected before
/// its endpoint is deleted anyway.
pub const SOURCE_GRACE: Duration = Duration::from_secs(60);

/// A request for an incoming endpoint.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IncomingSpec {
    /// The new endpoint's id.
    pub id: String,
    /// Its socket path, default `<endpoint_dir>/<id>.sock`; only directly in the daemon's
    /// endpoint directory.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub socket: Option<std::path::PathBuf>,
}

/// Where an incoming endpoint's migration is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Created; its device has not started to take a stream in.
    Waiting,
    /// RESUMING: the stream is coming in.
    Resuming,
    /// STOP after RESUMING: the stream loaded; RUNNING completes the migration.
    Loaded,
}

/// An incoming endpoint's link to its source.
#[derive(Debug, Clone)]
pub struct Incoming {
    source: String,
    phase: Phase,
}

/// What a migration state change means for an incoming endpoint.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Continue(Phase),
    Completed,
    Aborted,
}

/// The next step of an incoming endpoint in `phase` whose device went to `state` by `cause`.
fn step(phase: Phase, state: &str, cause: &str) -> Step {
    match (phase, state, cause) {
        // Before RESUMING (a STOP on the way there) nothing has started.
        (Phase::Waiting, "resuming", _) => Step::Continue(Phase::Resuming),
        (Phase::Waiting, _, _) => Step::Continue(Phase::Waiting),
        // The stream loaded (the server validates it on the way out of RESUMING; a stream
        // that does not load leaves ERROR), then the VMM runs the device.
        (Phase::Resuming, "stop", "request") => Step::Continue(Phase::Loaded),
        (Phase::Resuming | Phase::Loaded, "running", "request") => Step::Completed,
        // ERROR, a reset, the VMM gone, the worker dead.
        (Phase::Resuming | Phase::Loaded, _, _) => Step::Aborted,
    }
}

/// A migration state change of an endpoint's device, for the migrations follower: the
/// endpoint and the change (a worker's exit is state `exited`: it ends any migration).
pub type EndpointMigration = (String, MigrationChange);

/// Starts the thread that follows the endpoints' migration states, in order and off the
/// supervision threads (a finished migration deletes an endpoint, which takes the pool's
/// lock); the daemon's event sink sends them into the returned channel.
pub(crate) fn follow_migrations(
    daemon: std::sync::Arc<std::sync::OnceLock<std::sync::Weak<Daemon>>>,
) -> std::io::Result<std::sync::Mutex<std::sync::mpsc::Sender<EndpointMigration>>> {
    let (tx, rx) = std::sync::mpsc::channel::<EndpointMigration>();
    std::thread::Builder::new()
        .name("sy-migrations".into())
        .spawn(move || {
            for (endpoint, change) in rx {
                let Some(d) = daemon.get().and_then(std::sync::Weak::upgrade) else {
                    continue;
                };
                if let Some(release) = d.migration_state(&endpoint, &change.state, &change.cause) {
                    std::thread::spawn(move || d.release_when_let_go(&release));
                }
            }
        })?;
    Ok(std::sync::Mutex::new(tx))
}

impl Daemon {
    /// `POST /v1/endpoints/{source}/incoming`: an endpoint on a free device of the source's
    /// shape, linked to the source for a live migration.
    pub(super) fn create_incoming(
        &self,
        source: &str,
        spec: IncomingSpec,
        owner_uid: u32,
    ) -> Result<EndpointStatus, ApiError> {
        if let Some((dst, _)) = self.incoming().iter().find(|(_, i)| i.source == source) {
            return Err(ApiError::conflict(
                "incoming",
                format!("Endpoint \"{source}\" already has an incoming endpoint, \"{dst}\""),
            ));
        }
        if self.incoming().contains_key(source) {
            return Err(ApiError::conflict(
                "incoming",
                format!(
                    "Endpoint \"{source}\" is itself waiting for a migration; migrate it once it runs"
                ),
            ));
        }
        let device = {
            let inv = self.inventory();
            let src = inv
                .endpoint(source)
                .ok_or_else(|| unknown_endpoint(source))?;
            let theirs = src
                .device
                .as_deref()
                .and_then(|d| inv.device(d))
                .ok_or_else(|| {
                    ApiError::conflict(
                        "detached",
                        format!("Endpoint \"{source}\" has no device to migrate"),
                    )
                })?;
            // The source's pool: the one it leased from, or (created on a named device) its
            // board's; a board in no pool takes its destination from boards in none.
            let pool = src
                .pool
                .clone()
                .or_else(|| inv.board(&theirs.board).and_then(|b| b.pool));
            inv.boards()
                .into_iter()
                .filter(|b| b.pool == pool)
                .flat_map(|b| b.devices)
                .find(|d| {
                    d.shape == theirs.shape
                        && d.state == BoardState::Available
                        && d.endpoint.is_none()
                        && d.reserved_for.is_none()
                })
                .map(|d| d.id)
                .ok_or_else(|| {
                    ApiError::conflict(
                        "no_capacity",
                        format!(
                            "No free device of the shape of endpoint \"{source}\"'s ({} {}){}",
                            theirs.shape.model,
                            serde_json::Value::Object(
                                theirs.shape.options.clone().into_iter().collect()
                            ),
                            pool.as_ref().map_or_else(
                                || " on a board in no pool, as the source's".to_owned(),
                                |p| format!(" in pool \"{p}\", the source's")
                            )
                        ),
                    )
                })?
        };
        let id = spec.id.clone();
        let mut status = self.create(
            PoolEndpointSpec {
                id: spec.id,
                device: Some(device),
                socket: spec.socket,
                ..PoolEndpointSpec::default()
            },
            owner_uid,
        )?;
        self.incoming().insert(
            id.clone(),
            Incoming {
                source: source.to_owned(),
                phase: Phase::Waiting,
            },
        );
        tracing::info!(endpoint = %id, %source, "incoming endpoint for a live migration");
        status.incoming_for = Some(source.to_owned());
        Ok(status)
    }

    /// Endpoint `id` is deleted: a migration it was the destination or the source of is
    /// forgotten (neither a commit nor an abort follows).
    pub(super) fn forget_incoming(&self, id: &str) {
        self.incoming()
            .retain(|dst, inc| dst != id && inc.source != id);
    }

    /// The source of incoming endpoint `id`, if it is one.
    pub(crate) fn incoming_source(&self, id: &str) -> Option<String> {
        self.incoming().get(id).map(|i| i.source.clone())
    }

    /// Endpoint `endpoint`'s device went to migration state `state` by `cause` (or its worker
    /// died: `exited`). Completes or aborts the migration of an incoming endpoint; returns the
    /// endpoint whose lease then goes ([`Daemon::release_when_let_go`]).
    pub(crate) fn migration_state(
        &self,
        endpoint: &str,
        state: &str,
        cause: &str,
    ) -> Option<String> {
        let (source, completed) = {
            let mut incoming = self.incoming();
            let inc = incoming.get_mut(endpoint)?;
            match step(inc.phase, state, cause) {
                Step::Continue(phase) => {
                    inc.phase = phase;
                    return None;
                }
                Step::Completed => (inc.source.clone(), true),
                Step::Aborted => (inc.source.clone(), false),
            }
        };
        self.metrics.migration_ended(completed);
        let (released, event) = if completed {
            tracing::info!(%endpoint, %source, "live migration completed; the source's lease goes");
            let event = WorkerLifecycle::Migrated {
                endpoint: endpoint.to_owned(),
                source: source.clone(),
            };
            (source, event)
        } else {
            tracing::warn!(%endpoint, %source, state, "live migration aborted; the destination's lease goes");
            let event = WorkerLifecycle::MigrationAborted {
                endpoint: endpoint.to_owned(),
                source,
                state: state.to_owned(),
            };
            (endpoint.to_owned(), event)
        };
        self.events.worker(event);
        // After the event: a client that sees the link gone finds the event.
        self.incoming().remove(endpoint);
        Some(released)
    }

    /// Deletes endpoint `id` once its VMM let go of it (within [`SOURCE_GRACE`]).
    pub(crate) fn release_when_let_go(&self, id: &str) {
        let deadline = Instant::now() + SOURCE_GRACE;
        while self.supervisor.status(id).is_ok_and(|st| st.connected) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        match self.delete(id) {
            Ok(()) => tracing::info!(endpoint = %id, "endpoint of a finished migration deleted"),
            Err(e) => {
                tracing::error!(endpoint = %id, "cannot delete the endpoint of a finished migration: {e:?}")
            }
        }
    }

    fn incoming(&self) -> super::super::Held<'_, std::collections::BTreeMap<String, Incoming>> {
        super::super::lock(&self.incoming)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_resuming_stop_running_completes() {
        let walk = |states: &[(&str, &str)]| {
            let mut phase = Phase::Waiting;
            for (s, cause) in states {
                match step(phase, s, cause) {
                    Step::Continue(p) => phase = p,
                    end => return Some(end),
                }
            }
            None
        };
        let req = "request";
        // QEMU's destination: RESUMING (through STOP), the stream, RUNNING (through STOP, in
        // one request) or STOP then RUNNING.
        assert_eq!(
            walk(&[("resuming", req), ("running", req)]),
            Some(Step::Completed)
        );
        assert_eq!(
            walk(&[
                ("stop", req),
                ("resuming", req),
                ("stop", req),
                ("running", req)
            ]),
            Some(Step::Completed)
        );
        // Abandoned while the stream came in: the VMM went away, or reset the device.
        assert_eq!(
            walk(&[("resuming", req), ("running", "client_gone")]),
            Some(Step::Aborted)
        );
        assert_eq!(
            walk(&[("resuming", req), ("stop", req), ("running", "reset")]),
            Some(Step::Aborted)
        );
        // The stream did not load.
        assert_eq!(
            walk(&[("resuming", req), ("error", req)]),
            Some(Step::Aborted)
        );
        // The worker died mid-stream.
        assert_eq!(
            walk(&[("resuming", req), ("exited", "")]),
            Some(Step::Aborted)
        );
        // Nothing started yet: a guest running on the endpoint is not a migration.
        assert_eq!(
            walk(&[("stop", req), ("running", req), ("exited", "")]),
            None
        );
    }
}
