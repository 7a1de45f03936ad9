//! The pool's model and state: what the pool daemon owns, which VM holds what, and what
//! survives a crash. Pure logic and an embedded store; no sockets, no HTTP, no processes —
//! the control API and the data path are built on this crate's public API.
//!
//! # The model
//!
//! - A **board** is a device the daemon can serve, of a device **kind** (its `model`): a
//!   softgpu, or a physical PCI device or SR-IOV VF bound to vfio-pci (named by its `host`
//!   address; what the guest made of it lives in the hardware, so it is detached and
//!   attached, never moved under a guest). The pool knows kinds only through the kind API
//!   of `switchyard-device` ([`KindCatalog`]): the kind checks a board's options and gives
//!   the pool its [`Profile`] (VRAM and queues, whether it splits into partitions or moves,
//!   where its dirty pages come from, a host resource it holds alone). A board's state is
//!   [`BoardState::Available`], [`BoardState::Quarantined`] (no new leases; the leases it has
//!   stay until moved) or [`BoardState::Missing`] (gone from the configuration but still
//!   leased, so kept and reported rather than dropped).
//! - A board of a kind that splits may be cut into **partitions** (GPU-P style): each a VRAM
//!   slice and a share of the queues, with the board's other options. The partitions' VRAM
//!   and queues fit in the board's.
//! - A **device** is what is leased: a whole board when it has no partitions, otherwise each
//!   partition (a partitioned board is not leasable whole). A device's [`DeviceShape`]
//!   (model and the kind's canonical options) is everything a guest sees: devices of one
//!   shape are interchangeable under a running guest.
//! - A **pool** is a named set of identical boards (same model, options and partition
//!   layout, as Windows DDA pools), listed in the order leases prefer them. A board is in at
//!   most one pool.
//! - An **endpoint** is a vfio-user socket a VM connects to (`<endpoint_dir>/<id>.sock`
//!   unless given), with requirements (least VRAM and queues) and a **lease**: the device it
//!   serves, or none when detached. A lease is chosen from a pool (the first free device on
//!   an available board meeting the requirements) or named explicitly.
//! - Ids of boards, partitions, pools and endpoints share one namespace:
//!   `[A-Za-z0-9_.-]{1,64}`.
//!
//! # Operations
//!
//! [`Inventory`] holds the model in memory; [`Pool`] wraps it with the store and is what a
//! daemon uses. Every operation checks everything before it changes anything, so a refused
//! operation changes nothing; its [`PoolError`] has a [`kind`](PoolError::kind)
//! (not found, conflict, invalid, internal) for an API's status code. Every successful
//! mutation returns the [`Event`]s it produced, numbered without gaps for the pool's life.
//!
//! A **move** of an endpoint to another device has three steps, because the data path
//! moves the device in between: [`Pool::plan_move`] checks the target (exists, free, on an
//! available board, same shape) and reserves it; the data path moves VRAM and state;
//! [`Pool::commit_move`] swaps the lease (or [`Pool::abort_move`] releases the target).
//! [`Pool::drain`] plans moves of every endpoint off a board to free devices of the same
//! shape (the board's pool first), refused as a whole if one cannot move, and quarantines
//! the board and starts every move in one step. [`Pool::detach`] and [`Pool::attach`] hand
//! a device from one endpoint to another.
//!
//! # The store and what survives a SIGKILL
//!
//! The store is one redb file (`<state_dir>/pool.redb`): board records (definition and
//! quarantine), endpoints (with their lease and any move in progress) and the history of
//! events, keyed by sequence number. It is the source of truth: a mutation runs on a copy
//! of the inventory, its changes and events are committed in one transaction, and only
//! then is the copy swapped in. A process killed at any point therefore restarts into the
//! state after its last committed mutation: every committed lease, quarantine and reserved
//! move target, and none of a mutation that had not committed. [`Pool::open`] reconciles that
//! state with the (possibly edited) configuration and reports what it did ([`OpenReport`]),
//! including moves that were in progress, which the daemon must commit or abort. A file
//! that is no usable store (empty, truncated, not redb's) is refused with its path and left
//! as it is, never re-initialised; a new store is created 0600 whatever the umask.
//!
//! # Configuration
//!
//! [`PoolConfig`] is the daemon's TOML file (see the [`config`] module for its shape); its
//! errors name the offending key (`boards[1].vram`, `pools[0].boards[2]`).
//! `PoolConfig::default()` is the embedded default: two softgpu boards `gpu0` and `gpu1`
//! (64 MiB, 2 queues) in one pool `default`.
#![forbid(unsafe_code)]

mod board;
pub mod config;
mod error;
mod event;
mod inventory;
mod shape;
mod store;
mod token;
mod units;
mod view;

pub use config::{
    Age, BoardConfig, ByteSize, DEFAULT_MODEL, DaemonConfig, EndpointConfig, FailoverPolicy,
    NamedPoolConfig, PartitionConfig, PoolConfig,
};
pub use error::{ConfigProblem, ErrorKind, PoolError, StoreDamage};
pub use event::{Event, EventKind};
pub use inventory::{FailedLease, Inventory};
pub use shape::{DeviceShape, DirtyTracking};
pub use store::{History, PRUNE_BATCH, Pool, STORE_FORMAT, move_aside};
pub use switchyard_device::kind::{KindCatalog, KindOptions, Profile};
pub use token::{is_migration_token, new_migration_token};
pub use view::{
    BoardFailure, BoardState, BoardView, DeviceView, Endpoint, EndpointSpec, FailedEndpoint,
    MAX_ID_LEN, MAX_SOCKET_PATH, MovePlan, OpenReport, Placement, PoolView, Requirements, valid_id,
};
