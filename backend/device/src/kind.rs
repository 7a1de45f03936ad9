//! Device kinds: what builds a device of a kind from its options, in a server of its own
//! (`switchyard serve --device KIND,opts`), in a pool daemon's worker (a board's
//! `model = "KIND"`), and again in a replacement worker after the last one died.
//!
//! A kind is one crate implementing [`DeviceKind`] plus one line in the registry
//! (`switchyard-kinds`): the server, the pool and the daemon know kinds only through this
//! trait and the capability groups of [`PciDevice`].
//!
//! Options travel in one canonical form, a JSON object ([`KindOptions`]): parsed from the
//! command line's `k=v,...` ([`parse_kv`]), read from a pool board's TOML table, checked and
//! completed by the kind ([`DeviceKind::check`]), and handed to the worker that builds the
//! device, which has the kind parse them once ([`DeviceKind::configure`]) into the typed
//! configuration ([`KindConfig`]) it builds, recovers and moves devices with.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::Arc;

use serde_json::Value;

use crate::blackbox::{BlackBox, RecordSpec};
use crate::{DeviceContext, PciDevice};

mod record;

/// A kind's options: a JSON object of option name to value.
pub type KindOptions = serde_json::Map<String, Value>;

/// Why a kind refused options or could not build a device.
#[derive(Debug, thiserror::Error)]
pub enum KindError {
    /// An option is missing, unknown or has a value the kind refuses.
    #[error("Invalid {}: {message}", option_name(field.as_deref()))]
    Option {
        /// The option at fault (`None`: the combination).
        field: Option<String>,
        /// What is wrong, in a sentence.
        message: String,
    },
    /// The device could not be built (or recovered).
    #[error("Cannot build the {kind} device")]
    Build {
        /// The kind.
        kind: &'static str,
        /// Why.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The kind keeps no state a replacement process could continue from.
    #[error("A {0} device cannot be recovered in another process")]
    NoRecovery(&'static str),
    /// Custody did not hand over a memory object the recovery needs.
    #[error("Custody holds no memory object `{0}`")]
    MissingObject(String),
}

fn option_name(field: Option<&str>) -> String {
    field.map_or_else(|| "options".to_owned(), |f| format!("option `{f}`"))
}

impl KindError {
    /// A refused option.
    pub fn option(field: &str, message: impl Into<String>) -> Self {
        KindError::Option {
            field: Some(field.to_owned()),
            message: message.into(),
        }
    }

    /// A device that could not be built.
    pub fn build(kind: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        KindError::Build {
            kind,
            source: Box::new(e),
        }
    }

    /// The option at fault, if one is.
    pub fn field(&self) -> Option<&str> {
        match self {
            KindError::Option { field, .. } => field.as_deref(),
            _ => None,
        }
    }
}

/// Where the pages a migration copies come from (`DMA_LOGGING_REPORT`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DirtyLog {
    /// The device logs its own writes page by page.
    #[default]
    DeviceLog,
    /// Every mapped page is reported dirty (no device or IOMMU log available).
    AllMapped,
}

/// What a pool needs to know about a device of a kind with given options.
///
/// [`Default`] is a device the pool accounts nothing of: no memory or queues, not
/// partitionable or movable, no MSI-X, a device dirty log, nothing exclusive or
/// host-specific. A kind sets what it has and takes the rest with `..Profile::default()`.
///
/// Stored and sent as JSON: `memory` was `vram` in earlier releases, which is
/// still read and is still written alongside, for their readers.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "record::ProfileRecord", into = "record::ProfileRecord")]
pub struct Profile {
    /// Device memory bytes (0: none the pool accounts): what requirements ask for and
    /// partitions split. What a kind calls it: [`DeviceKind::memory_name`].
    pub memory: u64,
    /// Command queues (0: none the pool accounts).
    pub queues: u32,
    /// Whether a board can be split into partitions (devices of its own each).
    pub partitionable: bool,
    /// Whether the device can move to another board under a connected client
    /// ([`Relocatable`](crate::Relocatable)) with these options.
    pub movable: bool,
    /// Whether the device has MSI-X (QEMU 11.1 aborts the VM on `device_del` of a
    /// vfio-user device with MSI-X, so a guest-visible move refuses such devices).
    pub msix: bool,
    /// Where dirty pages come from.
    pub dirty_log: DirtyLog,
    /// A host resource only one board may name (a PCI address), if any.
    pub exclusive: Option<String>,
    /// Options that are this host's settings rather than what the guest sees (a polling
    /// budget, how interrupts are delivered): two devices that differ only in them are
    /// interchangeable (one pool; a move between them).
    pub host_settings: Vec<String>,
    /// The client may map memory a relocation replaces (VRAM the guest maps): no protocol
    /// message re-points a mapping, so such a device moves guest-visibly, the VMM unplugging
    /// and re-plugging it.
    pub client_maps_memory: bool,
    /// The device the guest sees, when kinds share one (the softgpu's and the `cuda`
    /// board's: `softgpu`): devices of such kinds whose options differ only in host
    /// settings are interchangeable (one pool, a move or a failover between them). `None`:
    /// the kind's own.
    pub presents: Option<String>,
}

/// A callback for the device to say its backing is gone for good (a passthrough device the
/// kernel took back): the worker tells its supervisor.
pub type LostHook = Arc<dyn Fn(String) + Send + Sync>;

/// A device's report that its board failed under it ([`FailedHook`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BoardFailure {
    /// What failed, in words for operators ("engine of queue 1 died: ...").
    pub reason: String,
    /// Whether the device's state is still readable from outside the failed part (the
    /// black box, VRAM in host memory): a replacement on another board can continue it
    /// (transparent failover). `false`: the state died with the board; only a fresh device,
    /// which the guest must probe again, can replace it.
    pub state_intact: bool,
}

/// A callback for the device to report that its board failed. Returns whether the failure is
/// handled above the device (a pool fails the device over): then the device does not signal
/// its own failure to the client (the ERR interrupt, on which a VMM stops the VM).
pub type FailedHook = Arc<dyn Fn(BoardFailure) -> bool + Send + Sync>;

/// What a kind builds a device with.
pub struct Build {
    /// The server's context (DMA windows, interrupts, the slot's memory objects).
    pub ctx: DeviceContext,
    /// The worker's black box, whose records are [`KindConfig::black_box_records`]: the
    /// device mirrors what a replacement needs into it. `None` outside a worker.
    pub black_box: Option<Arc<BlackBox>>,
    /// Memory objects a supervisor held for the slot, by name (see
    /// [`Recoverable::held_objects`](crate::Recoverable::held_objects)); empty for a fresh
    /// device.
    pub objects: BTreeMap<String, File>,
    /// Called when the device's backing is lost for good.
    pub lost: Option<LostHook>,
    /// Called when the device finds its board failed (see [`FailedHook`]).
    pub failed: Option<FailedHook>,
}

impl Build {
    /// A plain build on `ctx`: no black box, no held objects.
    pub fn new(ctx: DeviceContext) -> Self {
        Self {
            ctx,
            black_box: None,
            objects: BTreeMap::new(),
            lost: None,
            failed: None,
        }
    }
}

impl std::fmt::Debug for Build {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Build")
            .field("ctx", &self.ctx)
            .field("black_box", &self.black_box.is_some())
            .field("objects", &self.objects.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

/// Where a kind looks at the host (a test points it at a fake sysfs tree).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Host {
    /// The sysfs mount (`/sys`).
    pub sysfs: std::path::PathBuf,
}

impl Default for Host {
    fn default() -> Self {
        Self {
            sysfs: "/sys".into(),
        }
    }
}

/// What a host has for devices of a kind ([`DeviceKind::host_inventory`], `switchyard
/// inventory --kind KIND`): a table for people, and the same as JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct HostInventory {
    /// The table's column headings.
    pub columns: Vec<&'static str>,
    /// Its rows, a cell per column (`-`: nothing).
    pub rows: Vec<Vec<String>>,
    /// A line after the table, if any (what the rows have in common).
    pub footer: Option<String>,
    /// The same for programs.
    pub json: Value,
}

/// The custody name of a memory object a relocation copies to, until the device runs on it
/// (then it is held under `name` itself).
pub fn pending_object(name: &str) -> String {
    format!("{name}{PENDING_SUFFIX}")
}

/// Suffix of [`pending_object`] names.
pub const PENDING_SUFFIX: &str = "@next";

/// A kind of device: how to check its options, build one, and rebuild one in a replacement
/// process.
///
/// A kind parses its options once ([`DeviceKind::configure`]): what is done with a device of
/// them from then on (its black-box records, building it, recovering it, making a move's
/// successor one of it) takes that typed, checked value ([`KindConfig`]), never the options
/// again.
pub trait DeviceKind: Send + Sync + 'static {
    /// The name (`serve --device NAME,...`, `model = "NAME"`): lowercase letters, digits, `-`.
    fn name(&self) -> &'static str;

    /// One line for help texts.
    fn summary(&self) -> &'static str;

    /// The options, one per line (`name=VALUE  meaning (default)`), for `--help`.
    fn options_help(&self) -> &'static str;

    /// What `--help` says of the kind after its options: caveats, what the host must provide
    /// (one paragraph per line; empty: nothing). The default: nothing.
    fn notes(&self) -> &'static str {
        ""
    }

    /// What this host has for devices of the kind (`switchyard inventory --kind KIND`): the
    /// PCI functions a passthrough device can open, the GPUs a board can name. `None`: the
    /// kind needs nothing of the host (a software device); `Err`: why it cannot be listed.
    /// The default: `None`.
    fn host_inventory(&self, _host: &Host) -> Option<Result<HostInventory, String>> {
        None
    }

    /// What people call the device memory the pool accounts of such a device
    /// ([`Profile::memory`]), in listings and messages: `vram` for a GPU, `ram` for a
    /// scratchpad. The default: `memory`.
    fn memory_name(&self) -> &'static str {
        "memory"
    }

    /// Parses and checks `options`, completing them with defaults: the configuration of a
    /// device of them. The error names the option at fault ([`KindError::field`]).
    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError>;

    /// Checks `options` and completes them with defaults ([`DeviceKind::configure`]): the
    /// canonical options (two equal canonical forms build the same device) and the pool's
    /// view of such a device.
    fn check(&self, options: &KindOptions) -> Result<(KindOptions, Profile), KindError> {
        let config = self.configure(options)?;
        Ok((config.options(), config.profile()))
    }

    /// Options for a partition of a board with `board` options: the partition's own `vram`
    /// and `queues` replace the board's. The default sets those two options.
    fn partition(&self, board: &KindOptions, vram: u64, queues: u32) -> KindOptions {
        let mut options = board.clone();
        options.insert("vram".into(), vram.into());
        options.insert("queues".into(), queues.into());
        options
    }

    /// Checks that a device of (checked) `options` can be served on this host now, without
    /// opening it (a pool daemon asks at start; a board whose device cannot be is taken out
    /// of service with the reason). `Ok(Some(identity))`: what the device is (e.g. its PCI
    /// vendor and device ids), which the boards of one pool must share. The default: any
    /// host serves it, no identity beyond the options.
    fn probe(&self, _options: &KindOptions, _host: &Host) -> Result<Option<String>, String> {
        Ok(None)
    }
}

/// A device's configuration: its kind's options parsed and checked
/// ([`DeviceKind::configure`]), and what builds, rebuilds and describes devices of it.
pub trait KindConfig: Send + Sync + std::fmt::Debug {
    /// The canonical options: two equal canonical forms build the same device, and
    /// configuring them again gives this configuration.
    fn options(&self) -> KindOptions;

    /// What a pool needs to know about a device of this configuration.
    fn profile(&self) -> Profile;

    /// The black-box records a device of this configuration mirrors into (empty: none).
    fn black_box_records(&self) -> Vec<RecordSpec> {
        Vec::new()
    }

    /// Builds a fresh device.
    fn build(&self, build: Build) -> Result<Box<dyn PciDevice>, KindError>;

    /// Makes `device`, the successor a move built on a board of this configuration (by the
    /// moving device's relocation, [`Relocation::successor`](crate::Relocation::successor)),
    /// a device of it, before it runs: e.g. attaches the target board's GPU. A move between
    /// kinds that present the same device ([`Profile::presents`]) relies on it. The default:
    /// nothing to do.
    fn adopt_successor(&self, _device: &mut dyn PciDevice) -> Result<(), KindError> {
        Ok(())
    }

    /// Rebuilds, in a replacement process, the device a dead one served: its black box
    /// (`build.black_box`) and the memory objects its supervisor held (`build.objects`),
    /// with the client's DMA windows and eventfds already in `build.ctx`. A kind that
    /// cannot answers [`KindError::NoRecovery`] (the supervisor starts a fresh device).
    fn recover(&self, build: Build) -> Result<Box<dyn PciDevice>, KindError>;
}

impl std::fmt::Debug for dyn DeviceKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("DeviceKind").field(&self.name()).finish()
    }
}

/// A set of kinds by name (the registry, `switchyard-kinds`; tests bring their own): what a
/// pool checks its boards against without depending on any kind.
pub trait KindCatalog: Send + Sync {
    /// The kind called `name`.
    fn kind(&self, name: &str) -> Option<&dyn DeviceKind>;

    /// The kinds' names, comma-separated (for messages).
    fn names(&self) -> String;
}

/// Parses `k=v,k2=v2` (the command line's form) into options whose values are strings;
/// [`DeviceKind::check`] interprets them ([`opt`]'s readers accept strings). An empty string
/// is no options.
pub fn parse_kv(s: &str) -> Result<KindOptions, KindError> {
    let mut options = KindOptions::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (k, v) = part.split_once('=').ok_or_else(|| KindError::Option {
            field: None,
            message: format!("`{part}` is not `name=value`"),
        })?;
        let k = k.trim();
        if options
            .insert(k.to_owned(), Value::String(v.trim().to_owned()))
            .is_some()
        {
            return Err(KindError::option(k, "given twice"));
        }
    }
    Ok(options)
}

/// Readers of option values, accepting the JSON type or its string form (the command line
/// gives strings).
pub mod opt {
    use super::{KindError, KindOptions, Value};

    /// Refuses options not in `known`, naming the first and the known ones.
    pub fn only(options: &KindOptions, known: &[&str]) -> Result<(), KindError> {
        match options.keys().find(|k| !known.contains(&k.as_str())) {
            Some(k) => Err(KindError::option(
                k,
                format!("unknown option; known: {}", known.join(", ")),
            )),
            None => Ok(()),
        }
    }

    /// A non-negative integer.
    pub fn u64(options: &KindOptions, name: &str) -> Result<Option<u64>, KindError> {
        match options.get(name) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_u64()
                .map(Some)
                .ok_or_else(|| KindError::option(name, format!("`{n}` is not a whole number"))),
            Some(Value::String(s)) => s
                .parse()
                .map(Some)
                .map_err(|_| KindError::option(name, format!("`{s}` is not a whole number"))),
            Some(v) => Err(KindError::option(name, format!("`{v}` is not a number"))),
        }
    }

    /// A size in bytes: a number, or a string by [`parse_size`](crate::parse_size)'s rule
    /// (`64M`, `1GiB`: binary suffixes K, M, G, T).
    pub fn size(options: &KindOptions, name: &str) -> Result<Option<u64>, KindError> {
        match options.get(name) {
            Some(Value::String(s)) => crate::parse_size(s)
                .map(Some)
                .map_err(|e| KindError::option(name, e.to_string())),
            _ => u64(options, name),
        }
    }

    /// A boolean: `true`/`false`, or `on`/`off`, `yes`/`no`, `1`/`0` as strings.
    pub fn bool(options: &KindOptions, name: &str) -> Result<Option<bool>, KindError> {
        match options.get(name) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(Value::String(s)) => match s.as_str() {
                "true" | "on" | "yes" | "1" => Ok(Some(true)),
                "false" | "off" | "no" | "0" => Ok(Some(false)),
                _ => Err(KindError::option(
                    name,
                    format!("`{s}` is not on/off (true/false)"),
                )),
            },
            Some(v) => Err(KindError::option(name, format!("`{v}` is not on/off"))),
        }
    }

    /// A string.
    pub fn str<'a>(options: &'a KindOptions, name: &str) -> Result<Option<&'a str>, KindError> {
        match options.get(name) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(KindError::option(name, format!("`{v}` is not a string"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_default_profile_accounts_nothing_and_logs_its_own_writes() {
        let p = Profile::default();
        assert_eq!((p.memory, p.queues), (0, 0));
        assert!(!p.partitionable && !p.movable && !p.msix && !p.client_maps_memory);
        assert_eq!(p.dirty_log, DirtyLog::DeviceLog);
        assert_eq!((p.exclusive, p.presents), (None, None));
        assert!(p.host_settings.is_empty());
    }

    #[test]
    fn kv_options_parse_and_refuse_what_is_not_name_value() {
        let o = parse_kv("vram=64M, queues=2,,irq=msi").expect("parses");
        assert_eq!(o.len(), 3);
        assert_eq!(opt::size(&o, "vram").expect("size"), Some(64 << 20));
        assert_eq!(opt::u64(&o, "queues").expect("n"), Some(2));
        assert_eq!(opt::str(&o, "irq").expect("s"), Some("msi"));
        assert!(parse_kv("").expect("empty").is_empty());
        assert!(parse_kv("vram").is_err());
        let twice = parse_kv("a=1,a=2").expect_err("twice");
        assert_eq!(twice.field(), Some("a"));
    }

    #[test]
    fn sizes_accept_suffixes_and_refuse_overflow() {
        let one = |v: Value| {
            let mut o = KindOptions::new();
            o.insert("v".into(), v);
            opt::size(&o, "v")
        };
        assert_eq!(one("1G".into()).expect("1G"), Some(1 << 30));
        assert_eq!(one("128MiB".into()).expect("MiB"), Some(128 << 20));
        assert_eq!(one("4k".into()).expect("k"), Some(4096));
        assert_eq!(one(4096.into()).expect("number"), Some(4096));
        assert_eq!(one("2T".into()).expect("T"), Some(2 << 40));
        assert!(one("99999999999999G".into()).is_err());
        let bad = one("12X".into()).expect_err("12X");
        assert_eq!(bad.field(), Some("v"));
        assert!(bad.to_string().contains("`12X`"), "{bad}");
        assert!(one((-1).into()).is_err());
        assert!(one(true.into()).is_err());
    }

    #[test]
    fn unknown_options_are_named() {
        let o = parse_kv("vram=1M,colour=blue").expect("parses");
        let e = opt::only(&o, &["vram", "queues"]).expect_err("unknown");
        assert_eq!(e.field(), Some("colour"));
        assert!(e.to_string().contains("known: vram, queues"), "{e}");
    }
}
