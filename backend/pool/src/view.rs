//! The pool's leaf types: ids, requirements, endpoints, move plans and the views of boards,
//! devices and pools that queries return. They import neither the configuration nor the
//! inventory, which both use them.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

pub use crate::shape::Requirements;
use crate::shape::{DeviceShape, DirtyTracking};

/// Longest id.
pub const MAX_ID_LEN: usize = 64;
/// Longest socket path in bytes (`sun_path` holds 108 bytes with the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// Whether `id` is 1 to 64 characters of `A-Z a-z 0-9 _ . -`.
pub fn valid_id(id: &str) -> bool {
    (1..=MAX_ID_LEN).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// A board's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum BoardState {
    /// Takes new leases.
    Available,
    /// Takes no new leases; existing leases stay until moved (`quarantine`, `drain`).
    Quarantined,
    /// No longer in the configuration but still leased: kept (and reported) until its
    /// endpoints are moved, detached or deleted; forgotten at the next open once unleased.
    Missing,
}

impl fmt::Display for BoardState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BoardState::Available => "available",
            BoardState::Quarantined => "quarantined",
            BoardState::Missing => "missing",
        })
    }
}

/// An endpoint: the vfio-user socket a VM connects to, and its lease.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Endpoint {
    /// The endpoint's id.
    pub id: String,
    /// Its socket path.
    #[schema(value_type = String)]
    pub socket: PathBuf,
    /// What its device must have (checked at create and attach; a move keeps the shape).
    pub requirements: Requirements,
    /// The pool it leases from (set when created or attached through a pool; `attach`
    /// without a target uses it).
    pub pool: Option<String>,
    /// The leased device; none when detached.
    pub device: Option<String>,
    /// The device reserved for a move in progress.
    pub moving_to: Option<String>,
    /// Creation time, milliseconds since the Unix epoch.
    pub created_unix_ms: u64,
    /// The user that created it (the control connection's uid; root for an endpoint of
    /// the configuration file). Users other than root and the daemon's own act only on
    /// their own endpoints. A store written before owners were recorded has none: root's.
    #[serde(default)]
    pub owner_uid: u32,
    /// The endpoint's migration token: 32 hexadecimal characters, random, made when the
    /// endpoint is created (for an endpoint of an earlier release's store, when the store is
    /// opened). Its outgoing migration streams start with it, and the destination of a live
    /// migration of this endpoint (an incoming endpoint, here or on another host) takes only a
    /// stream that does. A capability: whoever holds it can pass a stream off as this
    /// endpoint's. A re-created endpoint with the same id has another.
    /// Empty where the reader may not see it (another user's endpoint).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub migration_token: String,
}

/// A request to create an endpoint. Give exactly one of `pool` and `device`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EndpointSpec {
    /// The endpoint's id: 1 to 64 characters of `A-Z a-z 0-9 _ . -`, unique among endpoints,
    /// boards, partitions and pools.
    pub id: String,
    /// Lease the first free device of this pool that meets the requirements ...
    #[serde(default)]
    pub pool: Option<String>,
    /// ... or this device.
    #[serde(default)]
    pub device: Option<String>,
    /// Least VRAM, bytes.
    #[serde(default)]
    pub min_vram: Option<u64>,
    /// Least queues.
    #[serde(default)]
    pub min_queues: Option<u32>,
    /// Socket path, default `<endpoint_dir>/<id>.sock`: a request may name one only directly
    /// in the daemon's endpoint directory (`<endpoint_dir>/NAME`); another place only through
    /// the configuration file.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub socket: Option<PathBuf>,
}

/// Where `attach` finds a device: a pool, a device, or (neither) the endpoint's own pool.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Placement {
    /// A pool to lease from.
    #[serde(default)]
    pub pool: Option<String>,
    /// A device to lease.
    #[serde(default)]
    pub device: Option<String>,
}

/// A checked move of an endpoint's lease to another device of the same shape. Between
/// `Inventory::plan_move` and `Inventory::commit_move` the target is reserved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct MovePlan {
    /// The endpoint.
    pub endpoint: String,
    /// Its current device.
    pub from: String,
    /// Board of `from`.
    pub from_board: String,
    /// The target device.
    pub to: String,
    /// Board of `to`.
    pub to_board: String,
    /// The shape both devices have.
    pub shape: DeviceShape,
}

/// A leasable device: a board without partitions, or a partition.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct DeviceView {
    /// The device's id (the board's id for a whole board).
    pub id: String,
    /// Its board.
    pub board: String,
    /// Whether it is a partition.
    pub partition: bool,
    /// What a guest sees.
    pub shape: DeviceShape,
    /// Its board's state.
    pub state: BoardState,
    /// The endpoint leasing it.
    pub endpoint: Option<String>,
    /// The endpoint moving onto it.
    pub reserved_for: Option<String>,
    /// The host resource the device holds alone (its kind's `exclusive` resource: a
    /// passthrough device's PCI address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

/// A board with its devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BoardView {
    /// The board's id.
    pub id: String,
    /// The whole board's shape (VRAM and queues of the board, shared by the partitions).
    pub shape: DeviceShape,
    /// Its state.
    pub state: BoardState,
    /// The pool it belongs to.
    pub pool: Option<String>,
    /// Its leasable devices: the board itself, or its partitions.
    pub devices: Vec<DeviceView>,
    /// The host resource the board holds alone (its kind's `exclusive` resource: a
    /// passthrough board's PCI address).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Where the dirty pages a migration copies come from.
    pub dirty_tracking: DirtyTracking,
    /// Why the board failed, while it does (it is quarantined; unquarantining it says it
    /// was repaired).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<BoardFailure>,
}

/// How a board failed under its devices.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BoardFailure {
    /// What failed, as detected ("the engine of queue 0 died: ...", "the kernel took the
    /// device back").
    pub reason: String,
    /// Whether the devices' state outlived the failure (host-side VRAM and the black box):
    /// their endpoints can fail over transparently. Otherwise only a fresh device the guest
    /// probes again can replace them (guest-visible).
    pub state_intact: bool,
}

/// A named pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct PoolView {
    /// The pool's name.
    pub name: String,
    /// Its boards.
    pub boards: Vec<String>,
    /// Leasable devices of its boards.
    pub devices: usize,
    /// Of those, the free ones on available boards.
    pub free: usize,
}

/// What `Pool::open` (or `Inventory::from_config`) did to reconcile the store with the
/// configuration.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct OpenReport {
    /// Boards of the configuration the store did not know.
    pub added_boards: Vec<String>,
    /// Boards gone from the configuration and unleased: forgotten.
    pub removed_boards: Vec<String>,
    /// Boards gone from the configuration but leased: kept as `missing`.
    pub missing_boards: Vec<String>,
    /// Endpoints of the configuration created now.
    pub created_endpoints: Vec<String>,
    /// Endpoints of the configuration that could not be created, with the reason.
    pub failed_endpoints: Vec<FailedEndpoint>,
    /// Moves that were in progress when the pool was last closed (or killed): the daemon
    /// must finish (`commit_move`) or abandon (`abort_move`) each.
    pub pending_moves: Vec<MovePlan>,
}

/// A configured endpoint that could not be created at open.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FailedEndpoint {
    /// The endpoint.
    pub endpoint: String,
    /// Why (the error's message).
    pub error: String,
}
