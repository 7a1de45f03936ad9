//! The crate's error type and the class an API maps it to.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::units::Size;

/// What kind of failure a [`PoolError`] is, for a control API to map to a status code.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// A named endpoint, device, board or pool does not exist (HTTP 404).
    NotFound,
    /// The request is well formed but the current state refuses it: a busy device, no free
    /// capacity, an id in use, an endpoint in the wrong state (HTTP 409).
    Conflict,
    /// The request itself is wrong whatever the state: a bad id, an incompatible target, a bad
    /// configuration (HTTP 422).
    Invalid,
    /// The store failed or holds something it should not (HTTP 500).
    Internal,
}

/// Errors of the pool: configuration, inventory operations and the store.
///
/// Every refused operation changes nothing, in memory or in the store.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// The configuration file is not valid TOML.
    #[error("Cannot parse the configuration{}: {message}", Line(*.line))]
    ConfigSyntax {
        /// 1-based line of the error, when known.
        line: Option<usize>,
        /// The parser's message.
        message: String,
    },
    /// A configuration value is wrong; `key` is its path, e.g. `boards[1].vram`.
    #[error("Invalid configuration at `{key}`{}: {problem}", Line(*.line))]
    Config {
        /// Path of the offending key, e.g. `pools[0].boards[2]`.
        key: String,
        /// 1-based line in the file, when known (values the parser rejected).
        line: Option<usize>,
        /// What is wrong.
        problem: ConfigProblem,
    },
    /// Reading the configuration file failed.
    #[error("Cannot read the configuration file {0}")]
    ConfigRead(PathBuf, #[source] std::io::Error),

    /// An id that is not 1 to 64 characters of `A-Z a-z 0-9 _ . -`.
    #[error("Invalid id \"{0}\"; ids are 1 to 64 characters of A-Z, a-z, 0-9, `_`, `.` and `-`")]
    BadId(String),
    /// An id already used by an endpoint, board, partition or pool (one namespace).
    #[error("The id \"{id}\" is already used by {holder}")]
    DuplicateId {
        /// The id.
        id: String,
        /// What holds it, e.g. `board "gpu0"`.
        holder: String,
    },
    /// An endpoint socket path that is not absolute, too long, or already used.
    #[error("Invalid socket path {path:?}: {reason}")]
    BadSocketPath {
        /// The path.
        path: PathBuf,
        /// Why it is refused.
        reason: &'static str,
    },
    /// A request that names both or neither of a pool and a device (neither is fine when the
    /// configuration has one pool).
    #[error("Give either a pool or a device{0}")]
    BadPlacement(&'static str),

    /// No endpoint with this id.
    #[error("Unknown endpoint \"{0}\"")]
    UnknownEndpoint(String),
    /// No device (whole board without partitions, or partition) with this id.
    #[error("Unknown device \"{0}\"")]
    UnknownDevice(String),
    /// No board with this id.
    #[error("Unknown board \"{0}\"")]
    UnknownBoard(String),
    /// No pool with this name.
    #[error("Unknown pool \"{0}\"")]
    UnknownPool(String),
    /// A board with partitions was named as a device: only its partitions are leasable.
    #[error("Board \"{0}\" is partitioned; name one of its partitions")]
    NotLeasable(String),

    /// The device is leased by (or reserved for a move of) another endpoint.
    #[error("Device \"{device}\" is in use by endpoint \"{endpoint}\"")]
    DeviceBusy {
        /// The device.
        device: String,
        /// The endpoint that holds or reserved it.
        endpoint: String,
    },
    /// The device's board is quarantined or missing: it takes no new lease.
    #[error("Device \"{device}\" is on board \"{board}\", which is {state}")]
    BoardUnavailable {
        /// The device.
        device: String,
        /// Its board.
        board: String,
        /// The board's state.
        state: crate::BoardState,
    },
    /// No free, available device of the pool meets the requirements.
    #[error("No free device in pool \"{pool}\"{}", wanted(*.min_vram, *.min_queues))]
    NoCapacity {
        /// The pool.
        pool: String,
        /// Requested VRAM (bytes).
        min_vram: u64,
        /// Requested queues.
        min_queues: u32,
    },
    /// A named device is smaller than the endpoint's requirements.
    #[error("Device \"{device}\" does not meet the requirements: {detail}")]
    RequirementsNotMet {
        /// The device.
        device: String,
        /// Which requirement fails.
        detail: String,
    },
    /// The target of a move would look different to the guest.
    #[error(
        "Device \"{to}\" differs from \"{from}\" in {difference}; a move must not change what the guest sees"
    )]
    ShapeMismatch {
        /// The endpoint's current device.
        from: String,
        /// The refused target.
        to: String,
        /// The first difference, e.g. `memory (128 MiB vs 64 MiB)`.
        difference: String,
    },
    /// A move to the device the endpoint already holds.
    #[error("Endpoint \"{endpoint}\" already holds device \"{device}\"")]
    SameDevice {
        /// The endpoint.
        endpoint: String,
        /// Its device.
        device: String,
    },
    /// The endpoint holds no device (detached), so it cannot be moved or detached.
    #[error("Endpoint \"{0}\" holds no device")]
    NotLeased(String),
    /// The device's kind cannot move it under a guest (a passthrough device's state is in
    /// the hardware).
    #[error(
        "Endpoint \"{endpoint}\" holds device \"{device}\", a {model} device, which cannot move under the guest (a passthrough device's state is in the hardware); detach it and attach another device instead"
    )]
    NotMovable {
        /// The endpoint.
        endpoint: String,
        /// Its device.
        device: String,
        /// The device's kind.
        model: String,
    },
    /// The endpoint already holds a device, so it cannot be attached.
    #[error("Endpoint \"{endpoint}\" already holds device \"{device}\"; detach it first")]
    AlreadyLeased {
        /// The endpoint.
        endpoint: String,
        /// Its device.
        device: String,
    },
    /// The endpoint has a move in progress; commit or abort it first.
    #[error("Endpoint \"{endpoint}\" has a move to \"{to}\" in progress")]
    MoveInProgress {
        /// The endpoint.
        endpoint: String,
        /// The reserved target.
        to: String,
    },
    /// `commit_move`/`abort_move` for an endpoint with no such move in progress.
    #[error("Endpoint \"{endpoint}\" has no move in progress from \"{from}\" to \"{to}\"")]
    NoSuchMove {
        /// The endpoint.
        endpoint: String,
        /// The plan's source.
        from: String,
        /// The plan's target.
        to: String,
    },
    /// No free device on an available board has the shape of `device` (a drain's target).
    #[error("No free device on an available board has the same shape as \"{device}\"")]
    NoCompatibleDevice {
        /// The device to move off.
        device: String,
    },
    /// A drain refused as a whole because one endpoint cannot move.
    #[error("Cannot drain board \"{board}\": endpoint \"{endpoint}\" cannot move")]
    DrainRefused {
        /// The board.
        board: String,
        /// The first endpoint that cannot move.
        endpoint: String,
        /// Why.
        #[source]
        reason: Box<PoolError>,
    },
    /// The store holds a state the configuration cannot take (e.g. a leased partition that
    /// the configuration no longer has, or that changed shape).
    #[error("The stored state does not fit the configuration: {0}")]
    Reconcile(String),

    /// The store failed.
    #[error("Cannot {action} the pool store")]
    Store {
        /// What was being done (`open`, `commit to`, `read`, ...).
        action: &'static str,
        /// The store's error.
        #[source]
        source: Box<redb::Error>,
    },
    /// The store's file is damaged (empty, truncated, not a redb file): refused and left as
    /// it is, never re-initialised.
    #[error("The pool store {} {problem}", path.display())]
    StoreDamaged {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: StoreDamage,
    },
    /// redb refused to open the store's file (another process has it open, an I/O error,
    /// a damage redb found).
    #[error("Cannot open the pool store {}", path.display())]
    StoreOpen {
        /// The file.
        path: PathBuf,
        /// redb's error.
        #[source]
        source: Box<redb::Error>,
    },
    /// The store's file cannot be opened, created or renamed.
    #[error("Cannot use the pool store file {}", path.display())]
    StoreFile {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The store was written in a format this version does not read.
    #[error("The pool store has format {found}; this version reads format {expected}")]
    StoreFormat {
        /// The store's format.
        found: u64,
        /// The format this version reads and writes.
        expected: u64,
    },
    /// A record does not encode (a bug: records are plain data).
    #[error("Cannot encode the {what} record")]
    Encode {
        /// Which record.
        what: String,
        /// The encoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// The system's random source failed (an endpoint's migration token is made from it).
    #[error("Cannot make an endpoint's migration token")]
    Random(#[source] std::io::Error),
    /// A stored record does not decode (written by an incompatible version, or damaged).
    #[error("Cannot decode the stored {what}")]
    Corrupt {
        /// Which record.
        what: String,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
}

impl PoolError {
    /// The class of the error, for an API to map to a status code.
    pub fn kind(&self) -> ErrorKind {
        use PoolError as E;
        match self {
            E::UnknownEndpoint(_)
            | E::UnknownDevice(_)
            | E::UnknownBoard(_)
            | E::UnknownPool(_) => ErrorKind::NotFound,
            E::DuplicateId { .. }
            | E::DeviceBusy { .. }
            | E::BoardUnavailable { .. }
            | E::NoCapacity { .. }
            | E::NoCompatibleDevice { .. }
            | E::SameDevice { .. }
            | E::NotLeased(_)
            | E::NotMovable { .. }
            | E::AlreadyLeased { .. }
            | E::MoveInProgress { .. }
            | E::NoSuchMove { .. }
            | E::DrainRefused { .. }
            | E::Reconcile(_) => ErrorKind::Conflict,
            E::ConfigSyntax { .. }
            | E::Config { .. }
            | E::BadId(_)
            | E::BadSocketPath { .. }
            | E::BadPlacement(_)
            | E::NotLeasable(_)
            | E::RequirementsNotMet { .. }
            | E::ShapeMismatch { .. } => ErrorKind::Invalid,
            E::ConfigRead(..)
            | E::Store { .. }
            | E::StoreDamaged { .. }
            | E::StoreOpen { .. }
            | E::StoreFile { .. }
            | E::StoreFormat { .. }
            | E::Encode { .. }
            | E::Random(_)
            | E::Corrupt { .. } => ErrorKind::Internal,
        }
    }

    /// Whether this is a store file that cannot be read as a store at all
    /// ([`PoolError::StoreDamaged`], or redb finding it corrupted): what starting afresh
    /// (moving it aside) is for. Not an I/O error, a store another process holds, or one
    /// of another format.
    pub fn is_damaged(&self) -> bool {
        match self {
            PoolError::StoreDamaged { .. } => true,
            PoolError::StoreOpen { source, .. } => match &**source {
                redb::Error::Corrupted(_) => true,
                redb::Error::Io(e) => e.kind() == std::io::ErrorKind::InvalidData,
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether the store could not be opened because another process has it open (redb
    /// locks its file: one pool per store).
    pub fn store_in_use(&self) -> bool {
        matches!(self, PoolError::StoreOpen { source, .. }
            if matches!(**source, redb::Error::DatabaseAlreadyOpen))
    }

    pub(crate) fn store(action: &'static str, e: impl Into<redb::Error>) -> Self {
        PoolError::Store {
            action,
            source: Box::new(e.into()),
        }
    }

    pub(crate) fn config(key: impl Into<String>, problem: ConfigProblem) -> Self {
        PoolError::Config {
            key: key.into(),
            line: None,
            problem,
        }
    }
}

/// What is wrong with a damaged store file (the `problem` of [`PoolError::StoreDamaged`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreDamage {
    /// It has no bytes at all.
    Empty,
    /// It is shorter than its header says.
    Truncated {
        /// Its length in bytes.
        len: u64,
        /// The length its header's layout needs.
        expected: u64,
    },
    /// It does not start with redb's magic number.
    NotRedb,
    /// Its header is not one this build can read.
    Header(String),
    /// It is not a regular file.
    NotAFile,
    /// Its header cannot be read.
    Unreadable(String),
    /// redb panicked on it (caught): its content is damaged.
    Panicked(String),
}

impl fmt::Display for StoreDamage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreDamage::Empty => f.write_str("is empty (0 bytes)"),
            StoreDamage::Truncated { len, expected } => write!(
                f,
                "is truncated: {len} bytes, where its header needs at least {expected}"
            ),
            StoreDamage::NotRedb => f.write_str("is not a redb file (no redb header)"),
            StoreDamage::Header(what) => write!(f, "has a header this build cannot use: {what}"),
            StoreDamage::NotAFile => f.write_str("is not a regular file"),
            StoreDamage::Unreadable(e) => write!(f, "cannot be read: {e}"),
            StoreDamage::Panicked(what) => write!(f, "is damaged (redb failed on it: {what})"),
        }
    }
}

/// What is wrong with a configuration value (the `problem` of [`PoolError::Config`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigProblem {
    /// The parser refused the value (wrong type, unknown key, bad size, ...).
    Value(String),
    /// The board's kind refuses its options (the key names the option, or the board when
    /// the combination is at fault).
    Kind {
        /// The kind.
        model: String,
        /// What it says is wrong.
        message: String,
    },
    /// A board names a kind the catalog does not have.
    UnknownModel {
        /// The model given.
        model: String,
        /// The known kinds, comma-separated.
        known: String,
    },
    /// A board of a kind that does not split has partitions.
    NotPartitionable(String),
    /// A host resource (a PCI address) that another board already holds.
    ResourceTaken {
        /// The resource.
        resource: String,
        /// The board that holds it.
        board: String,
    },
    /// A bad id.
    BadId(String),
    /// An id used twice; `first` is the key of its first use.
    DuplicateId {
        /// The id.
        id: String,
        /// Key of the first use, e.g. `boards[0].id`.
        first: String,
    },
    /// A pool names a board that does not exist.
    UnknownBoard(String),
    /// A pool names a partition instead of a board.
    PartitionInPool(String),
    /// An endpoint names a pool that does not exist.
    UnknownPool(String),
    /// An endpoint names a device that does not exist.
    UnknownDevice(String),
    /// An endpoint names a partitioned board.
    NotLeasable(String),
    /// A board listed in two pools (or twice in one).
    BoardInTwoPools {
        /// The board.
        board: String,
        /// The pool that lists it first.
        pool: String,
    },
    /// Two config endpoints name the same device.
    DeviceNamedTwice {
        /// The device.
        device: String,
        /// Key of the first endpoint naming it.
        first: String,
    },
    /// A board's partitions use more than the board has.
    PartitionsExceedBoard {
        /// `vram` or `queues`.
        what: &'static str,
        /// What the partitions use (formatted).
        used: String,
        /// What the board has (formatted).
        board: String,
    },
    /// Two boards of one pool differ.
    NotHomogeneous {
        /// The differing board.
        board: String,
        /// The pool's first board.
        reference: String,
        /// The first difference, e.g. `memory (128 MiB vs 64 MiB)`.
        difference: String,
    },
    /// An endpoint with both or neither of `pool` and `device`.
    Placement(&'static str),
    /// A bad socket path.
    SocketPath(&'static str),
    /// A bad path: empty, relative, with a NUL byte, or too long for a UNIX socket.
    Path(String),
    /// A number outside its range.
    OutOfRange {
        /// The value given.
        value: u64,
        /// The least allowed.
        min: u64,
        /// The most allowed.
        max: u64,
    },
}

impl fmt::Display for ConfigProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use ConfigProblem as P;
        match self {
            P::Value(m) | P::Path(m) => f.write_str(m),
            P::OutOfRange { value, min, max } => {
                write!(f, "{value} is out of range; expected {min} to {max}")
            }
            P::Kind { model, message } => write!(f, "{model}: {message}"),
            P::UnknownModel { model, known } => {
                write!(f, "unknown model \"{model}\"; the models are {known}")
            }
            P::NotPartitionable(model) => write!(
                f,
                "a {model} board cannot be partitioned (list each device as a board of its own)"
            ),
            P::ResourceTaken { resource, board } => {
                write!(
                    f,
                    "board \"{board}\" already holds \"{resource}\"; a device is one board only"
                )
            }
            P::BadId(id) => write!(
                f,
                "invalid id \"{id}\"; ids are 1 to 64 characters of A-Z, a-z, 0-9, `_`, `.` and `-`"
            ),
            P::DuplicateId { id, first } => write!(f, "id \"{id}\" is already used at `{first}`"),
            P::UnknownBoard(b) => write!(f, "unknown board \"{b}\""),
            P::PartitionInPool(p) => {
                write!(f, "\"{p}\" is a partition; a pool lists whole boards")
            }
            P::UnknownPool(p) => write!(f, "unknown pool \"{p}\""),
            P::UnknownDevice(d) => write!(f, "unknown device \"{d}\""),
            P::NotLeasable(b) => {
                write!(
                    f,
                    "board \"{b}\" is partitioned; name one of its partitions"
                )
            }
            P::BoardInTwoPools { board, pool } => {
                write!(f, "board \"{board}\" is already in pool \"{pool}\"")
            }
            P::DeviceNamedTwice { device, first } => {
                write!(f, "device \"{device}\" is already named by `{first}`")
            }
            P::PartitionsExceedBoard { what, used, board } => write!(
                f,
                "the partitions use {used} of {what} but the board has {board}"
            ),
            P::NotHomogeneous {
                board,
                reference,
                difference,
            } => write!(
                f,
                "board \"{board}\" differs from \"{reference}\" in {difference}; a pool's boards must be identical"
            ),
            P::Placement(m) | P::SocketPath(m) => f.write_str(m),
        }
    }
}

/// ` (line N)` or nothing.
struct Line(Option<usize>);

impl fmt::Display for Line {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(l) => write!(f, " (line {l})"),
            None => Ok(()),
        }
    }
}

/// What a refused lease asked for, for [`PoolError::NoCapacity`]: ` has at least 1 GiB of
/// VRAM and 4 queues`, one of the two, or nothing when it asked for neither.
fn wanted(min_vram: u64, min_queues: u32) -> String {
    match (min_vram, min_queues) {
        (0, 0) => String::new(),
        (v, 0) => format!(" has at least {} of VRAM", Size(v)),
        (0, q) => format!(" has at least {q} queues"),
        (v, q) => format!(" has at least {} of VRAM and {q} queues", Size(v)),
    }
}
