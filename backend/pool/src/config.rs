//! The daemon's configuration file (TOML), its embedded default and its validation.
//!
//! ```toml
//! [daemon]                                   # every key optional
//! control_socket = "/run/switchyard/control.sock"
//! state_dir = "/var/lib/switchyard"          # the store, pool.redb, lives here
//! endpoint_dir = "/run/switchyard/endpoints" # endpoint sockets: <endpoint_dir>/<id>.sock
//! fds_per_endpoint = 1024                    # fds a client may keep in custody; 64-65536
//! fd_reserve = 256                           # fds the daemon keeps for itself; 64-65536
//!
//! [[boards]]
//! id = "gpu0"
//! model = "softgpu"      # optional, the only model today
//! vram = "256M"          # bytes, or K/M/G suffixed (binary multiples); default 64M
//! queues = 4             # default 2
//! irq = "msix"           # or "msi"; optional
//! vram_mmap = true       # optional
//! vram_reset = "zero"    # or "keep": resets keep VRAM's contents (for guest-visible moves)
//! partitions = [         # optional (GPU-P style): each partition is a device of its own
//!   { id = "gpu0.p0", vram = "128M", queues = 2 },
//!   { id = "gpu0.p1", vram = "128M", queues = 2 },
//! ]
//!
//! [[boards]]
//! id = "edu0"
//! model = "vfio"         # a PCI device or VF bound to vfio-pci, passed through
//! host = "0000:00:04.0"  # its PCI address (required for vfio, refused otherwise)
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
//! # socket = "/path/vm1.sock"   # default <endpoint_dir>/<id>.sock
//! ```
//!
//! The three paths are absolute, without NUL bytes; the control socket and every endpoint
//! socket fit a UNIX socket path (107 bytes).
//!
//! Errors name the key: a value the parser refuses is reported at its path (`boards[1].vram`,
//! with the line), a semantic problem at the path of the entry that has it
//! (`pools[0].boards[2]: unknown board "gpu9"`).

use std::collections::HashMap;
use std::fmt;
use std::ops::RangeInclusive;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use switchyard_softgpu::{ConfigError as SoftGpuError, IrqMode, SoftGpuConfig};
use utoipa::ToSchema;

use crate::error::{ConfigProblem, PoolError, Size, binary_unit};
use crate::inventory::{DeviceShape, MAX_SOCKET_PATH, Model, valid_id};

/// A byte count written as an integer or a string with an optional `K`, `M` or `G` suffix
/// (binary multiples, case insensitive): `67108864`, `"64M"`, `"1G"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct ByteSize(pub u64);

impl ByteSize {
    /// Parses `"64M"`, `"2048K"`, `"1g"` or `"1048576"`.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        let (digits, shift) = match s.char_indices().last() {
            Some((i, c)) if c.is_ascii_alphabetic() => {
                let shift = match c.to_ascii_uppercase() {
                    'K' => 10,
                    'M' => 20,
                    'G' => 30,
                    _ => return None,
                };
                (s.get(..i)?, shift)
            }
            _ => (s, 0),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let n: u64 = digits.parse().ok()?;
        n.checked_mul(1u64 << shift).map(ByteSize)
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

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size: a number of bytes or a string like \"64M\" (K, M or G)")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                Ok(ByteSize(v))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map(ByteSize)
                    .map_err(|_| E::custom(format!("invalid size {v}: negative")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).ok_or_else(|| {
                    E::custom(format!(
                        "invalid size \"{v}\"; expected a number of bytes with an optional K, M or G suffix"
                    ))
                })
            }
        }
        d.deserialize_any(V)
    }
}

impl utoipa::PartialSchema for ByteSize {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, SchemaType, Type};
        OneOfBuilder::new()
            .item(
                ObjectBuilder::new()
                    .schema_type(SchemaType::new(Type::Integer))
                    .minimum(Some(0)),
            )
            .item(
                ObjectBuilder::new()
                    .schema_type(SchemaType::new(Type::String))
                    .pattern(Some("^[0-9]+[KkMmGg]?$")),
            )
            .description(Some("Bytes, or a string with a K, M or G suffix (binary)"))
            .into()
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

impl Default for DaemonConfig {
    fn default() -> Self {
        Self {
            control_socket: default_control_socket(),
            state_dir: default_state_dir(),
            endpoint_dir: default_endpoint_dir(),
            fds_per_endpoint: default_fds_per_endpoint(),
            fd_reserve: default_fd_reserve(),
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

/// `[[boards]]`: one board.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct BoardConfig {
    /// The board's id (and its device id when it has no partitions).
    pub id: String,
    /// The device model.
    #[serde(default)]
    pub model: Model,
    /// VRAM size: a power of two from 1 MiB to 64 GiB.
    #[serde(default = "default_vram")]
    pub vram: ByteSize,
    /// Command queues, 1 to 8.
    #[serde(default = "default_queues")]
    pub queues: u32,
    /// Interrupt mode, `msix` (default) or `msi`; shared by the partitions.
    #[serde(default)]
    #[schema(value_type = String, example = "msix")]
    pub irq: IrqMode,
    /// Whether guests may mmap VRAM (default true); shared by the partitions.
    #[serde(default = "default_true")]
    pub vram_mmap: bool,
    /// What resets do to VRAM: `zero` it (default) or `keep` its contents (as a real GPU's
    /// memory survives a function reset; a guest that gets its device back after a
    /// guest-visible move finds its VRAM as it left it). Shared by the partitions.
    #[serde(default)]
    pub vram_reset: VramReset,
    /// Partitions; when present, only they are leasable, not the whole board.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub partitions: Vec<PartitionConfig>,
    /// `model = "vfio"`: the device's PCI address (`DDDD:BB:DD.F` or `BB:DD.F`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// `model = "vfio"`: how BARs are offered, `trap` (default) or `mmap`.
    #[serde(default, skip_serializing_if = "Bars::is_trap")]
    pub bars: Bars,
}

/// How a passthrough board's BARs are offered to the client.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Bars {
    /// Every access is a message the server forwards (the default).
    #[default]
    Trap,
    /// BARs the kernel lets us mmap are offered as sparse mmap areas (the MSI-X table's
    /// pages excepted): the guest reaches the device directly.
    Mmap,
}

impl Bars {
    fn is_trap(&self) -> bool {
        *self == Bars::Trap
    }
}

/// Whether `s` is a PCI address: `DDDD:BB:DD.F` or `BB:DD.F`, hexadecimal, function 0-7.
pub fn valid_pci_address(s: &str) -> bool {
    let hex = |t: &str, n: usize| t.len() == n && t.bytes().all(|b| b.is_ascii_hexdigit());
    let parts: Vec<&str> = s.split(':').collect();
    let (domain, bus, rest) = match parts.as_slice() {
        [d, b, r] => (Some(*d), *b, *r),
        [b, r] => (None, *b, *r),
        _ => return false,
    };
    let Some((dev, func)) = rest.split_once('.') else {
        return false;
    };
    domain.is_none_or(|d| hex(d, 4))
        && hex(bus, 2)
        && hex(dev, 2)
        && u8::from_str_radix(dev, 16).is_ok_and(|d| d < 32)
        && func.len() == 1
        && matches!(func.as_bytes()[0], b'0'..=b'7')
}

fn default_vram() -> ByteSize {
    ByteSize(SoftGpuConfig::DEFAULT_VRAM)
}
fn default_queues() -> u32 {
    SoftGpuConfig::DEFAULT_QUEUES
}
fn default_true() -> bool {
    true
}

impl BoardConfig {
    /// A softgpu board without partitions.
    pub fn softgpu(id: &str, vram: u64, queues: u32) -> Self {
        Self {
            id: id.to_owned(),
            model: Model::Softgpu,
            vram: ByteSize(vram),
            queues,
            irq: IrqMode::Msix,
            vram_mmap: true,
            vram_reset: VramReset::Zero,
            partitions: Vec::new(),
            host: None,
            bars: Bars::Trap,
        }
    }

    /// A passthrough board for the device at `host`.
    pub fn vfio(id: &str, host: &str, bars: Bars) -> Self {
        Self {
            model: Model::Vfio,
            host: Some(host.to_owned()),
            bars,
            ..Self::softgpu(
                id,
                SoftGpuConfig::DEFAULT_VRAM,
                SoftGpuConfig::DEFAULT_QUEUES,
            )
        }
    }

    /// What a guest leasing the whole board sees. A passthrough board's shape is its model
    /// and BAR policy (VRAM and queues are the hardware's business: 0 here, so VRAM or queue
    /// requirements never pick one).
    pub fn shape(&self) -> DeviceShape {
        if self.model == Model::Vfio {
            return DeviceShape {
                model: Model::Vfio,
                vram_size: 0,
                queues: 0,
                irq: IrqMode::Msix,
                vram_mmap: self.bars == Bars::Mmap,
                keep_vram_on_reset: false,
            };
        }
        DeviceShape {
            model: self.model,
            vram_size: self.vram.0,
            queues: self.queues,
            irq: self.irq,
            vram_mmap: self.vram_mmap,
            keep_vram_on_reset: self.vram_reset == VramReset::Keep,
        }
    }
}

/// What resets do to a board's VRAM.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum VramReset {
    /// Zero it (the default).
    #[default]
    Zero,
    /// Keep its contents.
    Keep,
}

/// One partition of a board: a VRAM slice and a share of the queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PartitionConfig {
    /// The partition's (device) id.
    pub id: String,
    /// Its VRAM: a power of two, at least 1 MiB.
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
    /// The embedded default: two softgpu boards `gpu0` and `gpu1` (64 MiB, 2 queues, MSI-X,
    /// mappable VRAM) in one pool `default`, no endpoints, default paths.
    fn default() -> Self {
        Self {
            daemon: DaemonConfig::default(),
            boards: vec![
                BoardConfig::softgpu("gpu0", 64 << 20, 2),
                BoardConfig::softgpu("gpu1", 64 << 20, 2),
            ],
            pools: vec![NamedPoolConfig {
                name: "default".into(),
                boards: vec!["gpu0".into(), "gpu1".into()],
            }],
            endpoints: Vec::new(),
        }
    }
}

impl PoolConfig {
    /// Parses and validates a configuration.
    pub fn from_toml(text: &str) -> Result<Self, PoolError> {
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
        config.validate()?;
        Ok(config)
    }

    /// Reads, parses and validates a configuration file.
    pub fn load(path: &Path) -> Result<Self, PoolError> {
        let text =
            std::fs::read_to_string(path).map_err(|e| PoolError::ConfigRead(path.into(), e))?;
        Self::from_toml(&text)
    }

    /// The configuration as TOML (sizes with suffixes), e.g. to show the embedded default.
    pub fn to_toml(&self) -> String {
        // Every field serializes to TOML (strings, integers, booleans, arrays, tables).
        toml::to_string(self).unwrap_or_default()
    }

    /// Checks everything the types do not: `[daemon]` paths and budgets, ids, softgpu values,
    /// partitions against their board, pools (boards exist, one pool per board, identical
    /// boards) and endpoints. The first problem is returned, named by its key path.
    pub fn validate(&self) -> Result<(), PoolError> {
        self.daemon.validate()?;
        // One namespace for boards, partitions, pools and endpoints.
        let mut ids: HashMap<String, String> = HashMap::new();
        let mut claim = |id: &str, key: String| -> Result<(), PoolError> {
            if !valid_id(id) {
                return Err(PoolError::config(key, ConfigProblem::BadId(id.into())));
            }
            if let Some(first) = ids.get(id) {
                return Err(PoolError::config(
                    key,
                    ConfigProblem::DuplicateId {
                        id: id.into(),
                        first: first.clone(),
                    },
                ));
            }
            ids.insert(id.to_owned(), key);
            Ok(())
        };
        let mut boards: HashMap<&str, usize> = HashMap::new();
        let mut partitions: HashMap<&str, (usize, usize)> = HashMap::new();
        for (i, b) in self.boards.iter().enumerate() {
            let key = format!("boards[{i}]");
            claim(&b.id, format!("{key}.id"))?;
            boards.insert(&b.id, i);
            passthrough_check(&key, b)?;
            softgpu_check(&key, &b.shape())?;
            let (mut vram, mut queues) = (0u64, 0u64);
            for (j, p) in b.partitions.iter().enumerate() {
                let pkey = format!("{key}.partitions[{j}]");
                claim(&p.id, format!("{pkey}.id"))?;
                partitions.insert(&p.id, (i, j));
                softgpu_check(
                    &pkey,
                    &DeviceShape {
                        vram_size: p.vram.0,
                        queues: p.queues,
                        ..b.shape()
                    },
                )?;
                vram = vram.saturating_add(p.vram.0);
                queues += u64::from(p.queues);
            }
            if vram > b.vram.0 {
                return Err(PoolError::config(
                    format!("{key}.partitions"),
                    ConfigProblem::PartitionsExceedBoard {
                        what: "VRAM",
                        used: Size(vram).to_string(),
                        board: Size(b.vram.0).to_string(),
                    },
                ));
            }
            if queues > u64::from(b.queues) {
                return Err(PoolError::config(
                    format!("{key}.partitions"),
                    ConfigProblem::PartitionsExceedBoard {
                        what: "queues",
                        used: queues.to_string(),
                        board: b.queues.to_string(),
                    },
                ));
            }
        }
        let mut pool_of: HashMap<&str, &str> = HashMap::new();
        for (i, p) in self.pools.iter().enumerate() {
            let key = format!("pools[{i}]");
            claim(&p.name, format!("{key}.name"))?;
            let mut reference: Option<&BoardConfig> = None;
            for (k, name) in p.boards.iter().enumerate() {
                let bkey = format!("{key}.boards[{k}]");
                let Some(&bi) = boards.get(name.as_str()) else {
                    let problem = if partitions.contains_key(name.as_str()) {
                        ConfigProblem::PartitionInPool(name.clone())
                    } else {
                        ConfigProblem::UnknownBoard(name.clone())
                    };
                    return Err(PoolError::config(bkey, problem));
                };
                if let Some(first) = pool_of.insert(name, &p.name) {
                    return Err(PoolError::config(
                        bkey,
                        ConfigProblem::BoardInTwoPools {
                            board: name.clone(),
                            pool: first.into(),
                        },
                    ));
                }
                let board = &self.boards[bi];
                match reference {
                    None => reference = Some(board),
                    Some(r) => {
                        if let Some(difference) = board_difference(board, r) {
                            return Err(PoolError::config(
                                key,
                                ConfigProblem::NotHomogeneous {
                                    board: board.id.clone(),
                                    reference: r.id.clone(),
                                    difference,
                                },
                            ));
                        }
                    }
                }
            }
        }
        let mut named: HashMap<&str, String> = HashMap::new();
        for (i, e) in self.endpoints.iter().enumerate() {
            let key = format!("endpoints[{i}]");
            claim(&e.id, format!("{key}.id"))?;
            match (&e.pool, &e.device) {
                (Some(_), Some(_)) => {
                    return Err(PoolError::config(
                        key,
                        ConfigProblem::Placement("give either `pool` or `device`, not both"),
                    ));
                }
                (None, None) => {
                    return Err(PoolError::config(
                        key,
                        ConfigProblem::Placement("give `pool` or `device`"),
                    ));
                }
                (Some(pool), None) => {
                    if !self.pools.iter().any(|p| &p.name == pool) {
                        return Err(PoolError::config(
                            format!("{key}.pool"),
                            ConfigProblem::UnknownPool(pool.clone()),
                        ));
                    }
                }
                (None, Some(device)) => {
                    let dkey = format!("{key}.device");
                    if let Some(&bi) = boards.get(device.as_str()) {
                        if !self.boards[bi].partitions.is_empty() {
                            return Err(PoolError::config(
                                dkey,
                                ConfigProblem::NotLeasable(device.clone()),
                            ));
                        }
                    } else if !partitions.contains_key(device.as_str()) {
                        return Err(PoolError::config(
                            dkey,
                            ConfigProblem::UnknownDevice(device.clone()),
                        ));
                    }
                    if let Some(first) = named.insert(device, key.clone()) {
                        return Err(PoolError::config(
                            dkey,
                            ConfigProblem::DeviceNamedTwice {
                                device: device.clone(),
                                first,
                            },
                        ));
                    }
                }
            }
            match &e.socket {
                Some(socket) => {
                    let skey = format!("{key}.socket");
                    if !socket.is_absolute() {
                        return Err(PoolError::config(
                            skey,
                            ConfigProblem::SocketPath("a socket path must be absolute"),
                        ));
                    }
                    path_check(socket)
                        .and_then(|()| socket_length_check(socket))
                        .map_err(|p| PoolError::config(skey, p))?;
                }
                None => {
                    let socket = self.daemon.endpoint_dir.join(format!("{}.sock", e.id));
                    let len = socket.as_os_str().len();
                    if len > MAX_SOCKET_PATH {
                        return Err(PoolError::config(
                            format!("{key}.id"),
                            ConfigProblem::Path(format!(
                                "its socket {socket:?} (`<endpoint_dir>/<id>.sock`) is {len} \
                                 bytes, over the {MAX_SOCKET_PATH} a UNIX socket path can have; \
                                 shorten the id or `daemon.endpoint_dir`, or give `socket`"
                            )),
                        ));
                    }
                }
            }
        }
        Ok(())
    }
}

/// The softgpu's own check of a device's settings, reported at `key.vram`, `key.queues`.
/// `host` and `bars` belong to passthrough boards, which have them right and no partitions.
fn passthrough_check(key: &str, b: &BoardConfig) -> Result<(), PoolError> {
    let problem = |field: &str, message: String| {
        Err(PoolError::config(
            format!("{key}{field}"),
            ConfigProblem::Passthrough(message),
        ))
    };
    match (b.model, &b.host) {
        (Model::Vfio, None) => problem(
            "",
            "a vfio board needs `host`, the device's PCI address (e.g. \"0000:00:04.0\")".into(),
        ),
        (Model::Vfio, Some(h)) if !valid_pci_address(h) => problem(
            ".host",
            format!("invalid PCI address \"{h}\"; expected DDDD:BB:DD.F or BB:DD.F (hexadecimal)"),
        ),
        (Model::Vfio, Some(_)) if !b.partitions.is_empty() => problem(
            ".partitions",
            "a passthrough board cannot be partitioned (create SR-IOV VFs and list each as a board)"
                .into(),
        ),
        (Model::Softgpu, Some(_)) => problem(
            ".host",
            "`host` is for passthrough boards (`model = \"vfio\"`)".into(),
        ),
        (Model::Softgpu, None) if b.bars != Bars::Trap => problem(
            ".bars",
            "`bars` is for passthrough boards (`model = \"vfio\"`); a softgpu has `vram_mmap`"
                .into(),
        ),
        _ => Ok(()),
    }
}

fn softgpu_check(key: &str, shape: &DeviceShape) -> Result<(), PoolError> {
    match shape.model {
        Model::Vfio => Ok(()),
        Model::Softgpu => shape.softgpu_config().validate().map_err(|e| {
            let field = match e {
                SoftGpuError::VramNotPowerOfTwo(_)
                | SoftGpuError::VramTooSmall(_)
                | SoftGpuError::VramTooLarge(_) => ".vram",
                SoftGpuError::QueuesOutOfRange(_) => ".queues",
                _ => "",
            };
            PoolError::config(format!("{key}{field}"), ConfigProblem::SoftGpu(e))
        }),
    }
}

/// The first difference between two boards that a pool cannot have, e.g.
/// `vram (128 MiB vs 64 MiB)`.
fn board_difference(a: &BoardConfig, b: &BoardConfig) -> Option<String> {
    if let Some(d) = a.shape().difference(&b.shape()) {
        return Some(d);
    }
    if a.partitions.len() != b.partitions.len() {
        return Some(format!(
            "partition layout ({} partitions vs {})",
            a.partitions.len(),
            b.partitions.len()
        ));
    }
    for (j, (p, q)) in a.partitions.iter().zip(&b.partitions).enumerate() {
        if p.vram != q.vram {
            return Some(format!(
                "partitions[{j}].vram ({} vs {})",
                Size(p.vram.0),
                Size(q.vram.0)
            ));
        }
        if p.queues != q.queues {
            return Some(format!(
                "partitions[{j}].queues ({} vs {})",
                p.queues, q.queues
            ));
        }
    }
    None
}
