//! Lifecycle events: what every successful mutation produced, kept in the store's history.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::view::MovePlan;

/// One lifecycle change. `seq` increases by one per event over the pool's whole life (it
/// survives restarts), so `history(since_seq)` resumes a stream without gaps.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Event {
    /// Sequence number, from 1.
    pub seq: u64,
    /// Wall-clock time of the mutation, milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// What happened.
    pub kind: EventKind,
}

/// What an [`Event`] reports. JSON: `{"type": "lease_moved", "endpoint": ..., ...}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum EventKind {
    /// The pool was opened (daemon start); counts after reconciling with the configuration.
    Opened {
        /// Boards known (including missing ones).
        boards: usize,
        /// Endpoints restored or created.
        endpoints: usize,
    },
    /// A board of the configuration that the store did not know.
    BoardAdded {
        /// The board.
        board: String,
    },
    /// A board the configuration no longer has and that held no lease: forgotten.
    BoardRemoved {
        /// The board.
        board: String,
    },
    /// A board the configuration no longer has but that still holds leases: kept as
    /// `missing` until its endpoints are moved, detached or deleted.
    BoardMissing {
        /// The board.
        board: String,
        /// Endpoints holding (or moving to) its devices.
        endpoints: Vec<String>,
    },
    /// A missing board is back in the configuration.
    BoardReturned {
        /// The board.
        board: String,
    },
    /// A board takes no new leases.
    BoardQuarantined {
        /// The board.
        board: String,
    },
    /// A quarantined board takes leases again.
    BoardReleased {
        /// The board.
        board: String,
    },
    /// A board failed under its devices (detected by the device or injected); it is
    /// quarantined, and its endpoints fail over as their pools' policies say.
    BoardFailed {
        /// The board.
        board: String,
        /// What failed.
        reason: String,
        /// Whether the devices' state outlived the failure.
        state_intact: bool,
    },
    /// An endpoint failed over: its device runs on `to` (on a healthy board) instead of
    /// `from` (on a failed one).
    FailedOver {
        /// The endpoint.
        endpoint: String,
        /// The device it left.
        from: String,
        /// The device it holds.
        to: String,
        /// `transparent` (the guest saw a stall) or `guest-visible` (unplugged, a fresh
        /// device plugged in).
        mode: String,
        /// From the failure's report to the replacement serving, in milliseconds.
        stall_ms: u64,
    },
    /// An endpoint's board failed and no device of its shape is free on a healthy board: it
    /// waits, degraded, and fails over as soon as one is (a board unquarantined, a lease
    /// released).
    FailoverWaiting {
        /// The endpoint.
        endpoint: String,
        /// Its failed device.
        device: String,
    },
    /// An endpoint's board failed and it cannot fail over (the pool's policy is `off`, or
    /// its state died and no VMM is registered to plug a fresh device in); it keeps its dead
    /// device until that changes.
    FailoverRefused {
        /// The endpoint.
        endpoint: String,
        /// Its failed device.
        device: String,
        /// Why.
        reason: String,
    },
    /// A drain began: the board is quarantined and every move below is started.
    DrainStarted {
        /// The board.
        board: String,
        /// The moves, each also reported by a `move_started` event.
        moves: Vec<MovePlan>,
    },
    /// An endpoint was created, leasing `device` (none when created detached).
    EndpointCreated {
        /// The endpoint.
        endpoint: String,
        /// Its device.
        device: Option<String>,
        /// Its socket path.
        socket: String,
    },
    /// An endpoint was deleted, freeing `device`.
    EndpointDeleted {
        /// The endpoint.
        endpoint: String,
        /// The device it held.
        device: Option<String>,
    },
    /// A move began: `to` is reserved for the endpoint until commit or abort.
    MoveStarted {
        /// The endpoint.
        endpoint: String,
        /// Its device.
        from: String,
        /// The reserved target.
        to: String,
    },
    /// A move was committed: the endpoint's lease is now `to`, `from` is free.
    LeaseMoved {
        /// The endpoint.
        endpoint: String,
        /// The device it left.
        from: String,
        /// The device it holds.
        to: String,
    },
    /// A move was abandoned: the endpoint keeps `from`, `to` is free again.
    MoveAborted {
        /// The endpoint.
        endpoint: String,
        /// The device it keeps.
        from: String,
        /// The released target.
        to: String,
    },
    /// An endpoint released its device and stays without one.
    Detached {
        /// The endpoint.
        endpoint: String,
        /// The released device.
        device: String,
    },
    /// A detached endpoint leased a device.
    Attached {
        /// The endpoint.
        endpoint: String,
        /// Its device.
        device: String,
    },
    /// Nothing changed: the daemon's worker events were filling the numbers between the
    /// last pool event and the next (999 999 in the daemon's events stream), so the daemon
    /// wrote this event for the worker events after it to be numbered after it.
    SeqMark {
        /// Worker events the daemon had numbered since the previous pool event when it
        /// asked for this mark.
        worker_events: u64,
    },
}
