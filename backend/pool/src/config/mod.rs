//! The daemon's configuration file (TOML), its embedded default and its validation.
//!
//! ```toml
//! [daemon]                                   # every key optional
//! control_socket = "/run/switchyard/control.sock"
//! state_dir = "/var/lib/switchyard"          # the store, pool.redb, lives here
//! endpoint_dir = "/run/switchyard/endpoints" # endpoint sockets: <endpoint_dir>/<id>.sock
//! fds_per_endpoint = 1024                    # fds a client may keep in custody; 64-65536
//! fd_reserve = 256                           # fds the daemon keeps for itself; 64-65536
//! events_keep = 100000                       # pool events the store keeps, the newest; >= 1
//! events_max_age = "30d"                     # and none older (s, m, h or d); 1m-36500d
//! migration_idle_timeout = "60s"             # an open migration stream idle this long
//!                                            # is ended (s, m, h or d); 1s-1d
//!
//! [[boards]]
//! id = "gpu0"
//! model = "softgpu"      # the device kind; optional, softgpu by default
//! vram = "256M"          # every other key is the kind's own option, checked by the kind:
//! queues = 4             #   the softgpu's VRAM (bytes, or K/M/G/T suffixed; default 64M),
//! irq = "msix"           #   queues (default 2), interrupt mode ("msix" or "msi"),
//! vram_mmap = true       #   whether guests may map VRAM, and what resets do to it
//! vram_reset = "zero"    #   ("zero", or "keep": for guest-visible moves)
//! partitions = [         # optional, for kinds that split (GPU-P style): each a device
//!   { id = "gpu0.p0", vram = "128M", queues = 2 },   # with the board's options but its
//!   { id = "gpu0.p1", vram = "128M", queues = 2 },   # own VRAM and queues
//! ]
//!
//! [[boards]]
//! id = "edu0"
//! model = "vfio"         # a PCI device or VF bound to vfio-pci, passed through
//! host = "0000:00:04.0"  # its PCI address (required; one board per address)
//! bars = "trap"          # or "mmap": BARs offered for mmap (see switchyard-vfio); optional
//!
//! [[pools]]
//! name = "default"
//! boards = ["gpu0"]      # identical boards only
//!
//! [[endpoints]]          # optional: endpoints created at start when absent
//! id = "vm1"
//! pool = "default"       # or device = "gpu0.p1"
//! min_vram = "64M"       # optional requirements
//! min_queues = 1
//! # socket = "/path/vm1.sock"   # default <endpoint_dir>/<id>.sock; anywhere here (a request
//!                               # through the API names one only in <endpoint_dir>)
//! ```
//!
//! The three paths are absolute, without NUL bytes; the control socket and every endpoint
//! socket fit a UNIX socket path (107 bytes).
//!
//! A board's kind is one of a [`KindCatalog`] (the daemon's is every kind Switchyard has,
//! `switchyard_kinds::Registry`); the kind checks the board's options and says what the pool
//! needs to know of the device (VRAM, queues, whether it splits into partitions or moves).
//!
//! Errors name the key: a value the parser or the kind refuses is reported at its path
//! (`boards[1].vram`, with the line), a semantic problem at the path of the entry that has it
//! (`pools[0].boards[2]: unknown board "gpu9"`).

use std::fmt;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use switchyard_device::kind::{KindCatalog, KindOptions};
use utoipa::ToSchema;

use crate::error::{ConfigProblem, PoolError};
use crate::units::binary_unit;
use crate::view::MAX_SOCKET_PATH;

mod age;
mod check;
mod suffixed;

pub use age::Age;

/// A byte count written as an integer or a string by
/// [`parse_size`](switchyard_device::parse_size)'s rule (binary suffixes K, M, G, T, or KiB,
/// MiB, GiB, TiB, case insensitive): `67108864`, `"64M"`, `"1G"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `"64M"`, `"2048K"`, `"1g"` or `"1048576"` ([`switchyard_device::parse_size`]).
    pub fn parse(s: &str) -> Result<Self, switchyard_device::SizeError> {
        switchyard_device::parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    /// The shortest exact form: `64M`, `1G`, `1536K`, `1000`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match binary_unit(self.0) {
            (n, Some(unit)) => write!(f, "{n}{unit}"),
            (n, None) => write!(f, "{n}"),
        }
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl suffixed::Suffixed for ByteSize {
    const WHAT: &'static str = "size";
    const BASE: &'static str = "bytes";
    const EXAMPLE: &'static str = "64M";
    const UNITS: &'static str = "K, M, G or T (KiB, MiB, GiB, TiB)";
    const PATTERN: &'static str = "^\\s*[0-9]+([KkMmGgTt]([Ii][Bb])?)?\\s*$";
    const DESCRIPTION: &'static str =
        "Bytes, or a string with a K, M, G or T suffix (binary; KiB, MiB, GiB, TiB too)";
    fn from_base(n: u64) -> Self {
        ByteSize(n)
    }
    fn parse_suffixed(s: &str) -> Option<Self> {
        ByteSize::parse(s).ok()
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        suffixed::deserialize(d)
    }
}

impl utoipa::PartialSchema for ByteSize {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        suffixed::schema::<ByteSize>()
    }
}

impl ToSchema for ByteSize {}

/// The whole configuration file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Where the daemon keeps its sockets and state.
    #[serde(default)]
    pub daemon: DaemonConfig,
    /// The boards, in the order leases prefer them.
    #[serde(default)]
    pub boards: Vec<BoardConfig>,
    /// Named pools of identical boards.
    #[serde(default)]
    pub pools: Vec<NamedPoolConfig>,
    /// Endpoints created at start when absent from the store.
    #[serde(default)]
    pub endpoints: Vec<EndpointConfig>,
}

/// `[daemon]`: paths and descriptor budgets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct DaemonConfig {
    /// The control API's UNIX socket.
    #[serde(default = "default_control_socket")]
    #[schema(value_type = String)]
    pub control_socket: PathBuf,
    /// Directory of the store ([`DaemonConfig::store_path`]).
    #[serde(default = "default_state_dir")]
    #[schema(value_type = String)]
    pub state_dir: PathBuf,
    /// Directory of the endpoint sockets (`<endpoint_dir>/<id>.sock`).
    #[serde(default = "default_endpoint_dir")]
    #[schema(value_type = String)]
    pub endpoint_dir: PathBuf,
    /// Descriptors a client of one endpoint may keep in the daemon's custody: DMA memory fds,
    /// interrupt eventfds and those of a message in flight; a message that would exceed it is
    /// refused with EMFILE. 64 to 65536 (default 1024).
    #[serde(default = "default_fds_per_endpoint")]
    pub fds_per_endpoint: u32,
    /// Descriptors the daemon keeps for itself: API connections, the store, starting workers.
    /// 64 to 65536 (default 256).
    #[serde(default = "default_fd_reserve")]
    pub fd_reserve: u32,
    /// Pool events the store's history keeps: the newest this many; older ones are pruned
    /// when the pool commits (a reader's `since` before them is refused). At least 1
    /// (default 100000).
    #[serde(default = "default_events_keep")]
    pub events_keep: u64,
    /// How long the store's history keeps a pool event; older ones are pruned when the pool
    /// commits (the newest event is always kept). 1 minute to 36500 days (default `30d`).
    #[serde(default = "default_events_max_age")]
    pub events_max_age: Age,
    /// An endpoint's open migration stream (its VMM's PRE_COPY, STOP_COPY or RESUMING) with
    /// no migration activity (data read or written, a state requested) for this long is
    /// ended: the migration is abandoned, the device runs, and the restarts, upgrades,
    /// failovers and moves it held back go on. Inactivity, not the migration's whole time: a
    /// long migration is fine while it moves. 1 second to 1 day (default `60s`).
    #[serde(default = "default_migration_idle_timeout")]
    pub migration_idle_timeout: Age,
}

fn default_control_socket() -> PathBuf {
    PathBuf::from("/run/switchyard/control.sock")
}
fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/switchyard")
}
fn default_endpoint_dir() -> PathBuf {
    PathBuf::from("/run/switchyard/endpoints")
}
fn default_fds_per_endpoint() -> u32 {
    DaemonConfig::DEFAULT_FDS_PER_ENDPOINT
}
fn default_fd_reserve() -> u32 {
    DaemonConfig::DEFAULT_FD_RESERVE
}
fn default_events_keep() -> u64 {
    DaemonConfig::DEFAULT_EVENTS_KEEP
}
fn default_events_max_age() -> Age {
    DaemonConfig::DEFAULT_EVENTS_MAX_AGE
}
fn default_migration_idle_timeout() -> Age {
    DaemonConfig::DEFAULT_MIGRATION_IDLE_TIMEOUT
}

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            control_socket: default_control_socket(),
            state_dir: default_state_dir(),
            endpoint_dir: default_endpoint_dir(),
            fds_per_endpoint: default_fds_per_endpoint(),
            fd_reserve: default_fd_reserve(),
            events_keep: default_events_keep(),
            events_max_age: default_events_max_age(),
            migration_idle_timeout: default_migration_idle_timeout(),
        }
    }
}

impl DaemonConfig {
    /// File name of the store inside `state_dir`.
    pub const STORE_FILE: &'static str = "pool.redb";
    /// Default of `fds_per_endpoint`.
    pub const DEFAULT_FDS_PER_ENDPOINT: u32 = 1024;
    /// Default of `fd_reserve`.
    pub const DEFAULT_FD_RESERVE: u32 = 256;
    /// What `fds_per_endpoint` and `fd_reserve` may be.
    pub const FD_SETTING_RANGE: RangeInclusive<u32> = 64..=65536;
    /// Default of `events_keep`.
    pub const DEFAULT_EVENTS_KEEP: u64 = 100_000;
    /// What `events_keep` may be.
    pub const EVENTS_KEEP_RANGE: RangeInclusive<u64> = 1..=u64::MAX;
    /// Default of `events_max_age`: 30 days.
    pub const DEFAULT_EVENTS_MAX_AGE: Age = Age(30 * 86_400);
    /// What `events_max_age` may be, in seconds: 1 minute to 36500 days.
    pub const EVENTS_MAX_AGE_RANGE: RangeInclusive<u64> = 60..=36_500 * 86_400;
    /// Default of `migration_idle_timeout`: 60 seconds.
    pub const DEFAULT_MIGRATION_IDLE_TIMEOUT: Age = Age(60);
    /// What `migration_idle_timeout` may be, in seconds: 1 second to 1 day.
    pub const MIGRATION_IDLE_TIMEOUT_RANGE: RangeInclusive<u64> = 1..=86_400;

    /// `<state_dir>/pool.redb`.
    pub fn store_path(&self) -> PathBuf {
        self.state_dir.join(Self::STORE_FILE)
    }

    /// Checks the paths (absolute, no NUL byte; the control socket and the endpoint sockets
    /// fit a UNIX socket path) and the descriptor budgets, naming the key (`daemon.state_dir`).
    fn validate(&self) -> Result<(), PoolError> {
        let key = |name: &str| format!("daemon.{name}");
        for (name, path) in [
            ("control_socket", &self.control_socket),
            ("state_dir", &self.state_dir),
            ("endpoint_dir", &self.endpoint_dir),
        ] {
            path_check(path).map_err(|p| PoolError::config(key(name), p))?;
        }
        socket_length_check(&self.control_socket)
            .map_err(|p| PoolError::config(key("control_socket"), p))?;
        // The shortest endpoint socket, that of a one-character id, must fit; longer ids are
        // checked where their endpoint is created.
        let shortest = self.endpoint_dir.join("x.sock");
        if shortest.as_os_str().len() > MAX_SOCKET_PATH {
            return Err(PoolError::config(
                key("endpoint_dir"),
                ConfigProblem::Path(format!(
                    "endpoint sockets (`<endpoint_dir>/<id>.sock`) would be {} bytes or more, \
                     over the {MAX_SOCKET_PATH} a UNIX socket path can have",
                    shortest.as_os_str().len()
                )),
            ));
        }
        for (name, value) in [
            ("fds_per_endpoint", self.fds_per_endpoint),
            ("fd_reserve", self.fd_reserve),
        ] {
            if !Self::FD_SETTING_RANGE.contains(&value) {
                return Err(PoolError::config(
                    key(name),
                    ConfigProblem::OutOfRange {
                        value: value.into(),
                        min: (*Self::FD_SETTING_RANGE.start()).into(),
                        max: (*Self::FD_SETTING_RANGE.end()).into(),
                    },
                ));
            }
        }
        let keep = Self::EVENTS_KEEP_RANGE;
        if !keep.contains(&self.events_keep) {
            return Err(PoolError::config(
                key("events_keep"),
                ConfigProblem::OutOfRange {
                    value: self.events_keep,
                    min: *keep.start(),
                    max: *keep.end(),
                },
            ));
        }
        for (name, value, range) in [
            (
                "events_max_age",
                self.events_max_age,
                Self::EVENTS_MAX_AGE_RANGE,
            ),
            (
                "migration_idle_timeout",
                self.migration_idle_timeout,
                Self::MIGRATION_IDLE_TIMEOUT_RANGE,
            ),
        ] {
            if !range.contains(&value.0) {
                return Err(PoolError::config(
                    key(name),
                    ConfigProblem::Value(format!(
                        "{value} is out of range; expected {} to {}",
                        Age(*range.start()),
                        Age(*range.end())
                    )),
                ));
            }
        }
        Ok(())
    }
}

/// A path of the configuration: not empty, no NUL byte, absolute.
fn path_check(path: &Path) -> Result<(), ConfigProblem> {
    if path.as_os_str().is_empty() {
        return Err(ConfigProblem::Path("the path is empty".into()));
    }
    if path.as_os_str().as_encoded_bytes().contains(&0) {
        return Err(ConfigProblem::Path(format!(
            "the path {path:?} contains a NUL byte"
        )));
    }
    if !path.is_absolute() {
        return Err(ConfigProblem::Path(format!(
            "the path {path:?} is relative; give an absolute path"
        )));
    }
    Ok(())
}

/// A socket path fits `sun_path` (107 bytes and the NUL).
fn socket_length_check(path: &Path) -> Result<(), ConfigProblem> {
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH {
        return Err(ConfigProblem::Path(format!(
            "the socket path {path:?} is {len} bytes, over the {MAX_SOCKET_PATH} a UNIX socket \
             path can have"
        )));
    }
    Ok(())
}

/// `[[boards]]`: one board: its id, its kind (`model`), its partitions, and the kind's own
/// options (every other key, checked by the kind: `vram`, `queues`, `irq`, ... for a softgpu;
/// `host`, `bars` for a passthrough device).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct BoardConfig {
    /// The board's id (and its device id when it has no partitions).
    pub id: String,
    /// The device kind (default `softgpu`).
    #[serde(default = "default_model")]
    pub model: String,
    /// Partitions, for a kind whose boards can be split; when present, only they are
    /// leasable, not the whole board.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionConfig>,
    /// The kind's options: every other key of the table.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub options: KindOptions,
}

/// The model of a board that names none.
pub const DEFAULT_MODEL: &str = "softgpu";

fn default_model() -> String {
    DEFAULT_MODEL.into()
}

impl BoardConfig {
    /// A board of `model` with `options` and no partitions.
    pub fn new(id: &str, model: &str, options: KindOptions) -> Self {
        Self {
            id: id.to_owned(),
            model: model.to_owned(),
            partitions: Vec::new(),
            options,
        }
    }
}

/// One partition of a board: a VRAM slice and a share of the queues (the board's other
/// options are the partition's; its kind checks the result).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PartitionConfig {
    /// The partition's (device) id.
    pub id: String,
    /// Its VRAM.
    pub vram: ByteSize,
    /// Its queues.
    pub queues: u32,
}

/// `[[pools]]`: a named set of identical boards.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NamedPoolConfig {
    /// The pool's name.
    pub name: String,
    /// Its boards, in the order leases prefer them.
    #[serde(default)]
    pub boards: Vec<String>,
    /// What happens to an endpoint whose board fails under it.
    #[serde(default)]
    pub failover: FailoverPolicy,
}

/// `[[pools]] failover`: what the daemon does when a board fails under an endpoint.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "kebab-case")]
pub enum FailoverPolicy {
    /// The default. When the device's state outlived the failure (a software GPU's VRAM and
    /// black box), a device of the same shape on a healthy board continues it under the
    /// connected guest, which sees a stall; when it did not (a passthrough device's state
    /// dies with it), as `guest-visible`.
    #[default]
    Transparent,
    /// The endpoint's VMM (registered with `PUT /v1/endpoints/{id}/vmm`) unplugs the dead
    /// device and plugs a fresh one of a healthy board into the same slot; the guest's driver
    /// probes it again.
    GuestVisible,
    /// No failover: the board is quarantined and its endpoints keep their dead devices.
    Off,
}

impl FailoverPolicy {
    /// The policy's name in the configuration.
    pub fn as_str(self) -> &'static str {
        match self {
            FailoverPolicy::Transparent => "transparent",
            FailoverPolicy::GuestVisible => "guest-visible",
            FailoverPolicy::Off => "off",
        }
    }
}

/// `[[endpoints]]`: an endpoint created at start when absent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EndpointConfig {
    /// The endpoint's id.
    pub id: String,
    /// Lease from this pool ...
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<String>,
    /// ... or this device.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Least VRAM the device must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_vram: Option<ByteSize>,
    /// Least queues the device must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_queues: Option<u32>,
    /// Socket path; default `<endpoint_dir>/<id>.sock`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<String>)]
    pub socket: Option<PathBuf>,
}

impl Default for PoolConfig {
    /// The embedded default: two softgpu boards `gpu0` and `gpu1` (`vram = "64M"`,
    /// `queues = 2`, the kind's defaults otherwise) in one pool `default`, no endpoints,
    /// default paths.
    fn default() -> Self {
        let softgpu = |id: &str| {
            let mut options = KindOptions::new();
            options.insert("vram".into(), ByteSize(64 << 20).to_string().into());
            options.insert("queues".into(), 2.into());
            BoardConfig::new(id, DEFAULT_MODEL, options)
        };
        Self {
            daemon: DaemonConfig::default(),
            boards: vec![softgpu("gpu0"), softgpu("gpu1")],
            pools: vec![NamedPoolConfig {
                name: "default".into(),
                boards: vec!["gpu0".into(), "gpu1".into()],
                failover: FailoverPolicy::default(),
            }],
            endpoints: Vec::new(),
        }
    }
}

impl PoolConfig {
    /// Parses and validates a configuration, checking each board's options with its kind in
    /// `kinds`.
    pub fn from_toml(text: &str, kinds: &dyn KindCatalog) -> Result<Self, PoolError> {
        let line_of = |span: Option<std::ops::Range<usize>>| {
            span.map(|r| text[..r.start.min(text.len())].matches('\n').count() + 1)
        };
        let de = toml::Deserializer::parse(text).map_err(|e| PoolError::ConfigSyntax {
            line: line_of(e.span()),
            message: e.message().trim().to_owned(),
        })?;
        let config: PoolConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            let key = e.path().to_string();
            let inner = e.into_inner();
            let line = line_of(inner.span());
            let message = inner.message().trim().to_owned();
            if key == "." {
                PoolError::ConfigSyntax { line, message }
            } else {
                PoolError::Config {
                    key,
                    line,
                    problem: ConfigProblem::Value(message),
                }
            }
        })?;
        config.validate(kinds).map_err(|e| match e {
            // A kind's options are checked after parsing: find their line in the text.
            PoolError::Config {
                key,
                line: None,
                problem:
                    problem @ (ConfigProblem::Kind { .. }
                    | ConfigProblem::UnknownModel { .. }
                    | ConfigProblem::ResourceTaken { .. }),
            } => PoolError::Config {
                line: check::line_of_key(text, &key),
                key,
                problem,
            },
            e => e,
        })?;
        Ok(config)
    }

    /// Reads, parses and validates a configuration file ([`PoolConfig::from_toml`]).
    pub fn load(path: &Path, kinds: &dyn KindCatalog) -> Result<Self, PoolError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| PoolError::ConfigRead(path.into(), e))?;
        Self::from_toml(&text, kinds)
    }

    /// The configuration as TOML (sizes with suffixes), e.g. to show the embedded default.
    pub fn to_toml(&self) -> String {
        // Every field serializes to TOML (strings, integers, booleans, arrays, tables).
        toml::to_string(self).unwrap_or_default()
    }

    /// Checks everything the types do not: `[daemon]` paths and budgets, ids, each board's
    /// options (by its kind in `kinds`), partitions against their board, host resources held
    /// by one board only, pools (boards exist, one pool per board, identical boards) and
    /// endpoints. The first problem is returned, named by its key path.
    pub fn validate(&self, kinds: &dyn KindCatalog) -> Result<(), PoolError> {
        self.check(kinds).map(drop)
    }
}
