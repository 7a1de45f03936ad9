//! What happens to an endpoint's worker, as one type from the worker's note to the API:
//! [`WorkerLifecycle`].
//!
//! A worker reports on its custody channel ([`Note`](crate::custody::Note)); its supervisor
//! turns each report, and what it sees itself (a start, an exit, a crash loop), into a
//! [`WorkerLifecycle`] and hands it to its sink
//! ([`WorkerEvent::Lifecycle`](crate::supervisor::WorkerEvent::Lifecycle)); the daemon reacts
//! to it (records, metrics, the migrations it follows) and publishes that same value on the
//! events stream (`GET /events`, a [`DaemonEvent`](crate::app::events::DaemonEvent)'s
//! `worker` member), whose JSON is its serde form. Nothing copies its fields on the way.
//!
//! Where a note and an event say the same thing, they carry the same struct: a lost device
//! ([`LostDevice`]), client state a replacement could not restore ([`LostState`]), a
//! migration state change ([`MigrationChange`]) and a failed board
//! ([`BoardFailure`], the pool's). The note's JSON is what it was with the fields inline
//! (`{"device_lost":{"host":..,"reason":..}}`), so that workers and daemons of the previous
//! release still understand each other; the event's is too (`{"event":"device_lost",
//! "endpoint":..,"host":..,"reason":..}`: the struct's fields are flattened after
//! `endpoint`).
//!
//! What the daemon needs but the stream does not show is not a lifecycle event: a worker's
//! stats report, a board failure (the pool's own events, `board_failed` and what the failover
//! did, say it), the end of a move an adopted worker was running (the pool's `lease_moved` or
//! `move_aborted` say what came of it), a migration change past the endpoint's event budget.
//! Those are [`WorkerSignal`](crate::supervisor::WorkerSignal)s, the other half of the sink's
//! [`WorkerEvent`](crate::supervisor::WorkerEvent).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use switchyard_pool::BoardFailure;

/// A device's migration state change: what a worker's `migration` note and the `migration`
/// event carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct MigrationChange {
    /// The new state: `pre_copy`, `stop_copy`, `resuming`, `stop`, `running`, `error`.
    pub state: String,
    /// What changed it: `request` (the VMM), `reset` (a device reset abandoned the
    /// migration), `client_gone` (the VMM went away, which abandons it), `client_left` (the
    /// VMM went away leaving its device stopped with no stream open, as a guest's poweroff
    /// and a migrated source's VMM do: nothing is abandoned, the device runs again for the
    /// next client), `idle_timeout` (the
    /// stream had no activity for the idle timeout), `wrong_origin` (an incoming stream of
    /// another origin than the expected one). Always in an event; a worker of an earlier
    /// release may not say (empty).
    #[serde(default)]
    #[schema(required = true)]
    pub cause: String,
    /// The device's state was loaded from a stream of the expected origin
    /// (`switchyard_server::MigChange::origin_verified`; shown only when true). False from
    /// workers of earlier releases, which do not check.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub origin_verified: bool,
    /// The device's outgoing stream had been read to its end in STOP_COPY and the device
    /// stopped, with nothing since (`switchyard_server::MigChange::sent`; shown only when
    /// true). With the VMM gone (`client_gone`, `client_left`): it left after a completed
    /// outgoing migration.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub sent: bool,
}

/// What a replacement could not restore of its client's state: what a worker's `state_lost`
/// note and the `state_lost` event carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LostState {
    /// What was lost, one line each (DMA windows or interrupt eventfds the client had been
    /// told succeeded).
    pub problems: Vec<String>,
}

/// A device whose backing is gone for good (the kernel took a passthrough device back): what
/// a worker's `device_lost` note and the `device_lost` event carry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LostDevice {
    /// What is lost: the device's host resource (a PCI address) or its description.
    pub host: String,
    /// What happened.
    pub reason: String,
}

impl LostDevice {
    /// The failure of the device's board this is: its state did not outlive it.
    pub fn board_failure(&self) -> BoardFailure {
        BoardFailure {
            reason: self.to_string(),
            state_intact: false,
        }
    }
}

impl std::fmt::Display for LostDevice {
    /// `HOST: REASON`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.host, self.reason)
    }
}

/// What happened to an endpoint's worker process (the `worker` member of an event of
/// `GET /events`).
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
        #[serde(rename = "restart_ms", default, with = "millis")]
        #[schema(value_type = Option<f64>)]
        restart: Option<Duration>,
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
        /// The new state and what changed it.
        #[serde(flatten)]
        change: MigrationChange,
    },
    /// A live migration onto an incoming endpoint (`POST /v1/endpoints/{id}/incoming`)
    /// completed: the destination's device loaded the state and runs; its lease is kept and
    /// the source endpoint is deleted (its lease released) once its VMM let go of it (a
    /// source on another host, `POST /v1/incoming`, by its own daemon: `migrated_away`).
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
    /// The endpoint's VMM left after a completed outgoing live migration (the device's
    /// stream read to its end, the device stopped, never run again): the endpoint is deleted
    /// (its lease released) by this daemon, which may have no link to the destination (on
    /// another host). Not emitted where a local incoming endpoint decides (`migrated`).
    MigratedAway {
        /// The endpoint (the migration's source).
        endpoint: String,
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
        /// What was lost.
        #[serde(flatten)]
        lost: LostState,
    },
    /// The kernel took the endpoint's passthrough device back (unbind, removal): every
    /// access fails with ENODEV, the VMM was told (REQ), the board is quarantined.
    DeviceLost {
        /// The endpoint.
        endpoint: String,
        /// What is lost and what happened.
        #[serde(flatten)]
        lost: LostDevice,
    },
}

impl WorkerLifecycle {
    /// The endpoint it happened to.
    pub fn endpoint(&self) -> &str {
        match self {
            Self::Started { endpoint, .. }
            | Self::Ready { endpoint, .. }
            | Self::Exited { endpoint, .. }
            | Self::GaveUp { endpoint }
            | Self::Migration { endpoint, .. }
            | Self::Migrated { endpoint, .. }
            | Self::MigrationAborted { endpoint, .. }
            | Self::MigrationReleased { endpoint, .. }
            | Self::MigratedAway { endpoint }
            | Self::Reset { endpoint, .. }
            | Self::StateLost { endpoint, .. }
            | Self::DeviceLost { endpoint, .. } => endpoint,
        }
    }
}

/// A duration as fractional milliseconds (the API's `restart_ms`).
mod millis {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_some(&(d.as_secs_f64() * 1e3)),
            None => s.serialize_none(),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        let ms = Option::<f64>::deserialize(d)?;
        ms.map(|ms| Duration::try_from_secs_f64(ms / 1e3).map_err(serde::de::Error::custom))
            .transpose()
    }
}

#[cfg(test)]
mod tests;
