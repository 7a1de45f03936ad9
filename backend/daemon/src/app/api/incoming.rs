//! Incoming endpoints: the destination of a live migration of an endpoint's VM.
//!
//! (A source on another host, and the source's own clean-up: `remote`.)
//!
//! `POST /v1/endpoints/{source}/incoming` creates an endpoint leasing a free device of the
//! source's shape from the source's pool (the pool of the source's board when the source was
//! created on a named device; boards in no pool for a board in none), whose worker serves a
//! fresh device for the destination VMM to put into RESUMING. Its device takes only a stream
//! that came from the source: every endpoint has a migration token
//! (`Endpoint::migration_token`), its worker stamps it at the start of every stream it sends
//! (`switchyard_server::origin`), and the incoming endpoint's worker expects the source's; a
//! stream without it or with another endpoint's (the destination's own included) leaves the
//! device in ERROR. The daemon then follows the destination device's migration states (the
//! worker's [`crate::custody::Note::Migration`]):
//!
//! - RESUMING, then STOP (the stream loaded), then RUNNING, with the worker saying that what
//!   was loaded came from the source (`origin_verified`): the migration completed. The
//!   destination keeps its lease; the source endpoint is deleted (its lease released) once its
//!   VMM let go of the device (the source QEMU quits after a completed migration), or after
//!   [`SOURCE_GRACE`] at most. Event `migrated`, metric `switchyard_migrations_completed`.
//! - Anything else after RESUMING (back to RUNNING without loading: the destination VMM gave up
//!   or its stream sat idle past the idle timeout; ERROR: the stream did not load or came from
//!   elsewhere; the worker died): the migration is over without the destination. The
//!   destination endpoint is deleted (its lease released) once its VMM is gone; the source
//!   serves on. Event `migration_aborted`, metric `switchyard_migrations_aborted`.
//!
//! The clean-up deletes the incarnation of the endpoint the migration had, identified by its
//! migration token as well as its id: an endpoint deleted meanwhile and created again with the
//! same id is never touched (event `migration_released` says which happened).
//!
//! Moves, restarts, upgrades and drains of either endpoint are refused while its device
//! streams (see `refuse_while_migrating`); a stream with no activity for `[daemon]
//! migration_idle_timeout` is ended by the worker, which lifts that. The link between the two
//! endpoints is kept in memory: a daemon restarted in the middle of a migration leaves both
//! endpoints as they are.

use std::time::{Duration, Instant};

use serde::Deserialize;
use switchyard_control::ApiError;
use switchyard_pool::{BoardState, DeviceShape, EndpointSpec as PoolEndpointSpec, Inventory};
use utoipa::ToSchema;

mod remote;

pub use remote::IncomingFromSpec;

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
#[derive(Clone)]
pub struct Incoming {
    source: String,
    /// The source's migration token (its incarnation).
    source_token: String,
    /// The incoming endpoint's own (its incarnation).
    token: String,
    phase: Phase,
    /// The source is on another host (`POST /v1/incoming`): a completion releases nothing
    /// here; the source's daemon frees it ([`WorkerLifecycle::MigratedAway`]).
    remote: bool,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Incoming")
            .field("source", &self.source)
            .field("phase", &self.phase)
            .finish_non_exhaustive()
    }
}

/// One incarnation of an endpoint: its id and its migration token.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Incarnation {
    id: String,
    token: String,
}

/// What a migration state change means for an incoming endpoint.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    Continue(Phase),
    Completed,
    Aborted,
}

/// The next step of an incoming endpoint in `phase` whose device went to `state` by `cause`
/// (`verified`: what it loaded came from the source).
fn step(phase: Phase, state: &str, cause: &str, verified: bool) -> Step {
    match (phase, state, cause) {
        // Before RESUMING (a STOP on the way there) nothing has started.
        (Phase::Waiting, "resuming", _) => Step::Continue(Phase::Resuming),
        (Phase::Waiting, _, _) => Step::Continue(Phase::Waiting),
        // The stream loaded (the server validates it on the way out of RESUMING; a stream
        // that does not load, or came from elsewhere, leaves ERROR), then the VMM runs the
        // device: complete only if the worker vouches for the stream's origin.
        (Phase::Resuming, "stop", "request") => Step::Continue(Phase::Loaded),
        // A VM with several devices runs them quiesced first (RESUMING → STOP → RUNNING_P2P,
        // or from STOP), then RUNNING.
        (Phase::Resuming | Phase::Loaded, "running_p2p", "request") if verified => {
            Step::Continue(Phase::Loaded)
        }
        (Phase::Resuming | Phase::Loaded, "running", "request") if verified => Step::Completed,
        // Running on a stream of unproven origin (a worker that does not check), ERROR, a
        // reset, the VMM gone, an idle stream ended, the worker dead.
        (Phase::Resuming | Phase::Loaded, _, _) => Step::Aborted,
    }
}

/// Refuses a second incoming endpoint for `source`, and one for an incoming endpoint.
fn refuse_second_incoming(
    incoming: &std::collections::BTreeMap<String, Incoming>,
    source: &str,
) -> Result<(), ApiError> {
    if let Some((dst, _)) = incoming.iter().find(|(_, i)| i.source == source) {
        return Err(ApiError::conflict(
            "incoming",
            format!("Endpoint \"{source}\" already has an incoming endpoint, \"{dst}\""),
        ));
    }
    if incoming.contains_key(source) {
        return Err(ApiError::conflict(
            "incoming",
            format!(
                "Endpoint \"{source}\" is itself waiting for a migration; migrate it once it runs"
            ),
        ));
    }
    Ok(())
}

/// Refuses a second incoming endpoint for the source of migration token `token` (here or on
/// another host).
fn refuse_second_for_token(
    incoming: &std::collections::BTreeMap<String, Incoming>,
    source: &str,
    token: &str,
) -> Result<(), ApiError> {
    match incoming.iter().find(|(_, i)| i.source_token == token) {
        Some((dst, _)) => Err(ApiError::conflict(
            "incoming",
            format!("Endpoint \"{source}\" already has an incoming endpoint, \"{dst}\""),
        )),
        None => Ok(()),
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
) -> std::io::Result<std::sync::mpsc::Sender<EndpointMigration>> {
    let (tx, rx) = std::sync::mpsc::channel::<EndpointMigration>();
    std::thread::Builder::new()
        .name("sy-migrations".into())
        .spawn(move || {
            for (endpoint, change) in rx {
                let Some(d) = daemon.get().and_then(std::sync::Weak::upgrade) else {
                    continue;
                };
                // A stream the worker ended for idleness lets a failover it held back go on
                // now rather than at the next reconciliation (not on every change: a client
                // can change states at message rate).
                if change.cause == "idle_timeout" {
                    d.failover.wake();
                }
                let release = d
                    .migration_state(&endpoint, &change)
                    .filter(|r| d.claim_release(r));
                if let Some(release) = release {
                    // One per finished migration; a failed start must not end this thread.
                    let (claimed, owned) = (release.clone(), d.clone());
                    let spawned = std::thread::Builder::new()
                        .name("sy-migration-release".into())
                        .spawn(move || owned.release_when_let_go(&release));
                    if let Err(e) = spawned {
                        d.unclaim_release(&claimed);
                        tracing::error!(%endpoint, "cannot start the clean-up of a finished migration (its endpoint stays until deleted): {e}");
                    }
                }
            }
        })?;
    Ok(tx)
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
        refuse_second_incoming(&self.incoming(), source)?;
        let (device, source_token) = {
            let inv = self.inventory();
            let src = inv
                .endpoint(source)
                .ok_or_else(|| unknown_endpoint(source))?;
            let source_token = src.migration_token.clone();
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
            let device =
                free_device(&inv, &pool, |shape| *shape == theirs.shape).ok_or_else(|| {
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
                })?;
            (device, source_token)
        };
        let mut status =
            self.create_linked(spec, owner_uid, device, source, &source_token, false)?;
        status.incoming_for = Some(source.to_owned());
        Ok(status)
    }

    /// Creates incoming endpoint `spec` on `device`, linked to source `source` (an endpoint
    /// here, or on another host: `remote`) of migration token `source_token`, whose streams
    /// only its device takes.
    fn create_linked(
        &self,
        spec: IncomingSpec,
        owner_uid: u32,
        device: String,
        source: &str,
        source_token: &str,
        remote: bool,
    ) -> Result<EndpointStatus, ApiError> {
        let id = spec.id.clone();
        let token = switchyard_pool::new_migration_token().map_err(super::pool_error)?;
        // An endpoint's id in use is refused by the creation below; no link is taken for it
        // (its holder's migration changes are not to be followed as this one's).
        if self.inventory().endpoint(&id).is_none() {
            // Checked again and taken under one lock, before the worker serves: of two
            // requests for one source, one gets it; a destination VMM that starts at once
            // finds its migration followed.
            let mut incoming = self.incoming();
            if !remote {
                refuse_second_incoming(&incoming, source)?;
            }
            refuse_second_for_token(&incoming, source, source_token)?;
            if incoming.contains_key(&id) {
                return Err(ApiError::conflict(
                    "incoming",
                    format!("Endpoint \"{id}\" is being created as another incoming endpoint"),
                ));
            }
            let link = Incoming {
                source: source.to_owned(),
                source_token: source_token.to_owned(),
                token: token.clone(),
                phase: Phase::Waiting,
                remote,
            };
            incoming.insert(id.clone(), link);
        }
        let created = self.create_expecting(
            PoolEndpointSpec {
                id: spec.id,
                device: Some(device),
                socket: spec.socket,
                ..PoolEndpointSpec::default()
            },
            owner_uid,
            Some(source_token.to_owned()),
            &token,
        );
        match created {
            Ok(status) => {
                tracing::info!(endpoint = %id, %source, remote, "incoming endpoint for a live migration");
                Ok(status)
            }
            Err(e) => {
                // Only the link taken above (a request that lost no other).
                let mut incoming = self.incoming();
                if incoming.get(&id).is_some_and(|i| i.token == token) {
                    incoming.remove(&id);
                }
                Err(e)
            }
        }
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

    /// An endpoint's device changed migration state (or its worker died: `exited`).
    /// Completes or aborts the migration of an incoming endpoint; returns the incarnation of
    /// the endpoint whose lease then goes ([`Daemon::release_when_let_go`]).
    pub(crate) fn migration_state(
        &self,
        endpoint: &str,
        change: &MigrationChange,
    ) -> Option<Incarnation> {
        if let Some(away) = self.migrated_away(endpoint, change) {
            return Some(away);
        }
        let (inc, completed) = {
            let mut incoming = self.incoming();
            let inc = incoming.get_mut(endpoint)?;
            let verified = change.origin_verified;
            match step(inc.phase, &change.state, &change.cause, verified) {
                Step::Continue(phase) => {
                    inc.phase = phase;
                    return None;
                }
                Step::Completed => (inc.clone(), true),
                Step::Aborted => (inc.clone(), false),
            }
        };
        self.metrics.migration_ended(completed);
        let source = inc.source.clone();
        let (released, event) = if completed {
            tracing::info!(%endpoint, %source, "live migration completed; the source's lease goes");
            let event = WorkerLifecycle::Migrated {
                endpoint: endpoint.to_owned(),
                source: source.clone(),
            };
            let released = Incarnation {
                id: source,
                token: inc.source_token,
            };
            (released, event)
        } else {
            let state = change.state.as_str();
            tracing::warn!(%endpoint, %source, state, cause = change.cause, "live migration aborted; the destination's lease goes");
            let event = WorkerLifecycle::MigrationAborted {
                endpoint: endpoint.to_owned(),
                source,
                state: state.to_owned(),
            };
            let released = Incarnation {
                id: endpoint.to_owned(),
                token: inc.token,
            };
            (released, event)
        };
        self.events.worker(event);
        // After the event: a client that sees the link gone finds the event.
        self.incoming().remove(endpoint);
        // A source on another host is its own daemon's to free.
        (!(completed && inc.remote)).then_some(released)
    }

    /// Deletes incarnation `which` of an endpoint once its VMM let go of it (within
    /// [`SOURCE_GRACE`]); nothing when it is gone meanwhile (deleted, or deleted and created
    /// again: another incarnation is never touched). Polls every 50 ms, no lock held.
    pub(crate) fn release_when_let_go(&self, which: &Incarnation) {
        let id = which.id.as_str();
        let this_one = || {
            self.inventory()
                .endpoint(id)
                .is_some_and(|e| e.migration_token == which.token)
        };
        let deadline = Instant::now() + SOURCE_GRACE;
        loop {
            if !this_one() {
                break;
            }
            // An endpoint the supervisor does not know (a delete under way, an orphan) is
            // waited for: the pool says when it is gone.
            let let_go = self.supervisor.status(id).is_ok_and(|st| !st.connected);
            if let_go || Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let deleted = match self.delete_incarnation(id, Some(&which.token)) {
            Ok(true) => {
                tracing::info!(endpoint = %id, "endpoint of a finished migration deleted");
                true
            }
            Ok(false) => {
                tracing::info!(endpoint = %id, "endpoint of a finished migration already gone (deleted, or created again: left alone)");
                false
            }
            Err(e) => {
                tracing::error!(endpoint = %id, "cannot delete the endpoint of a finished migration: {e:?}");
                false
            }
        };
        self.events.worker(WorkerLifecycle::MigrationReleased {
            endpoint: id.to_owned(),
            deleted,
        });
        self.unclaim_release(which);
    }

    fn incoming(&self) -> super::super::Held<'_, std::collections::BTreeMap<String, Incoming>> {
        super::super::lock(&self.incoming)
    }
}

/// The first free device (available, no endpoint, not reserved) on the boards of `pool` (or
/// of no pool) whose shape `fits`: where an incoming endpoint, from a local source or from a
/// description, is leased.
fn free_device(
    inv: &Inventory,
    pool: &Option<String>,
    fits: impl Fn(&DeviceShape) -> bool,
) -> Option<String> {
    inv.boards()
        .into_iter()
        .filter(|b| &b.pool == pool)
        .flat_map(|b| b.devices)
        .find(|d| {
            fits(&d.shape)
                && d.state == BoardState::Available
                && d.endpoint.is_none()
                && d.reserved_for.is_none()
        })
        .map(|d| d.id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_resuming_stop_running_completes() {
        let walk = |states: &[(&str, &str)]| {
            let mut phase = Phase::Waiting;
            for (s, cause) in states {
                match step(phase, s, cause, true) {
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
        // A VM with several devices: quiesced (RUNNING_P2P) first, then RUNNING.
        assert_eq!(
            walk(&[("resuming", req), ("running_p2p", req), ("running", req)]),
            Some(Step::Completed)
        );
        assert_eq!(
            walk(&[
                ("resuming", req),
                ("stop", req),
                ("running_p2p", req),
                ("running", req)
            ]),
            Some(Step::Completed)
        );
        assert_eq!(
            walk(&[("resuming", req), ("running_p2p", "client_gone")]),
            Some(Step::Aborted)
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
        // Loaded, and the VMM left before it ran the device (which then runs for the next
        // client, with no stream abandoned): not completed either.
        assert_eq!(
            walk(&[("resuming", req), ("stop", req), ("running", "client_left")]),
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
        // The stream sat idle: the worker ended it.
        assert_eq!(
            walk(&[("resuming", req), ("running", "idle_timeout")]),
            Some(Step::Aborted)
        );
    }

    #[test]
    fn running_on_a_stream_of_unproven_origin_is_no_completion() {
        assert_eq!(
            step(Phase::Loaded, "running", "request", false),
            Step::Aborted
        );
        assert_eq!(
            step(Phase::Resuming, "running", "request", false),
            Step::Aborted
        );
        assert_eq!(
            step(Phase::Resuming, "error", "wrong_origin", false),
            Step::Aborted
        );
        assert_eq!(
            step(Phase::Loaded, "running", "request", true),
            Step::Completed
        );
        assert_eq!(
            step(Phase::Resuming, "running_p2p", "request", false),
            Step::Aborted
        );
    }
}
