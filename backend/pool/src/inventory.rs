//! The in-memory model: boards, devices, pools, endpoints and leases, and the operations on
//! them. Every operation checks everything first and changes nothing when it refuses.

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use switchyard_softgpu::{IrqMode, SoftGpuConfig};
use utoipa::ToSchema;

use crate::config::{BoardConfig, PoolConfig};
use crate::error::{PoolError, Size};
use crate::event::{Event, EventKind};

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

/// A device model.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Model {
    /// Switchyard's software GPU (`switchyard-softgpu`).
    #[default]
    Softgpu,
    /// A physical PCI device or SR-IOV VF bound to vfio-pci, passed through
    /// (`switchyard-vfio`; the board's `host` names it). Its state is in the hardware: it can
    /// be detached and attached, not moved under a guest.
    Vfio,
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Model::Softgpu => "softgpu",
            Model::Vfio => "vfio",
        })
    }
}

/// What a guest sees of a device: two devices of the same shape are interchangeable under a
/// running guest (a move keeps the shape).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, ToSchema)]
pub struct DeviceShape {
    /// The model.
    pub model: Model,
    /// VRAM bytes.
    pub vram_size: u64,
    /// Command queues.
    pub queues: u32,
    /// Interrupt mode (`msix` or `msi`).
    #[schema(value_type = String, example = "msix")]
    pub irq: IrqMode,
    /// Whether the guest may mmap VRAM.
    pub vram_mmap: bool,
    /// Whether resets keep VRAM's contents (`vram_reset = "keep"`).
    #[serde(default)]
    pub keep_vram_on_reset: bool,
}

impl DeviceShape {
    /// The softgpu configuration that serves a device of this shape.
    pub fn softgpu_config(&self) -> SoftGpuConfig {
        SoftGpuConfig {
            vram_size: self.vram_size,
            queues: self.queues,
            irq: self.irq,
            vram_mmap: self.vram_mmap,
            keep_vram_on_reset: self.keep_vram_on_reset,
            spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
        }
    }

    /// The first field in which `self` differs from `other`, as `field (self vs other)`, e.g.
    /// `vram (128 MiB vs 64 MiB)`; `None` when they are the same.
    pub fn difference(&self, other: &DeviceShape) -> Option<String> {
        if self.model != other.model {
            return Some(format!("model ({} vs {})", self.model, other.model));
        }
        if self.vram_size != other.vram_size {
            return Some(format!(
                "vram ({} vs {})",
                Size(self.vram_size),
                Size(other.vram_size)
            ));
        }
        if self.queues != other.queues {
            return Some(format!("queues ({} vs {})", self.queues, other.queues));
        }
        if self.irq != other.irq {
            return Some(format!("irq ({} vs {})", self.irq, other.irq));
        }
        if self.vram_mmap != other.vram_mmap {
            return Some(format!(
                "vram_mmap ({} vs {})",
                self.vram_mmap, other.vram_mmap
            ));
        }
        if self.keep_vram_on_reset != other.keep_vram_on_reset {
            let name = |keep: bool| if keep { "keep" } else { "zero" };
            return Some(format!(
                "vram_reset ({} vs {})",
                name(self.keep_vram_on_reset),
                name(other.keep_vram_on_reset)
            ));
        }
        None
    }

    fn meets(&self, req: &Requirements) -> Result<(), String> {
        if self.vram_size < req.min_vram {
            return Err(format!(
                "{} of VRAM, at least {} required",
                Size(self.vram_size),
                Size(req.min_vram)
            ));
        }
        if self.queues < req.min_queues {
            return Err(format!(
                "{} queues, at least {} required",
                self.queues, req.min_queues
            ));
        }
        Ok(())
    }
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

/// A board's definition as the store keeps it (so that a board removed from the
/// configuration can still be described while leased).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BoardDef {
    pub id: String,
    pub shape: DeviceShape,
    pub partitions: Vec<PartitionDef>,
    /// The PCI address of a passthrough board (`model = "vfio"`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PartitionDef {
    pub id: String,
    pub vram_size: u64,
    pub queues: u32,
}

impl BoardDef {
    fn from_config(b: &BoardConfig) -> Self {
        Self {
            id: b.id.clone(),
            shape: b.shape(),
            host: b.host.clone(),
            partitions: b
                .partitions
                .iter()
                .map(|p| PartitionDef {
                    id: p.id.clone(),
                    vram_size: p.vram.0,
                    queues: p.queues,
                })
                .collect(),
        }
    }

    /// The leasable devices: the board itself, or its partitions.
    fn devices(&self) -> impl Iterator<Item = (&str, DeviceShape)> {
        let whole = self
            .partitions
            .is_empty()
            .then_some((self.id.as_str(), self.shape));
        whole.into_iter().chain(self.partitions.iter().map(|p| {
            (
                p.id.as_str(),
                DeviceShape {
                    vram_size: p.vram_size,
                    queues: p.queues,
                    ..self.shape
                },
            )
        }))
    }
}

/// A board with its state, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BoardRecord {
    pub def: BoardDef,
    pub quarantined: bool,
    pub missing: bool,
}

impl BoardRecord {
    fn state(&self) -> BoardState {
        if self.missing {
            BoardState::Missing
        } else if self.quarantined {
            BoardState::Quarantined
        } else {
            BoardState::Available
        }
    }
}

/// What an endpoint's device must have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Requirements {
    /// Least VRAM, bytes (0: any).
    #[serde(default)]
    pub min_vram: u64,
    /// Least queues (0: any).
    #[serde(default)]
    pub min_queues: u32,
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
    /// Socket path (absolute); default `<endpoint_dir>/<id>.sock`.
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
/// [`Inventory::plan_move`] and [`Inventory::commit_move`] the target is reserved.
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
    /// The PCI address of a passthrough device (`model` `vfio`).
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
    /// The PCI address of a passthrough board (`model` `vfio`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Where the dirty pages a migration copies come from.
    pub dirty_tracking: DirtyTracking,
}

/// Where a device's dirty-page reports (`DMA_LOGGING_REPORT`) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DirtyTracking {
    /// The device logs its own writes page by page (the softgpu).
    DeviceLog,
    /// Every page mapped into the device's IOMMU is reported dirty (the conservative rule
    /// QEMU applies): no VFIO device DMA logging and no iommufd dirty tracking is available
    /// to a passthrough device here.
    AllMapped,
}

impl DirtyTracking {
    /// The source a device of `model` uses.
    pub fn of(model: Model) -> DirtyTracking {
        match model {
            Model::Softgpu => DirtyTracking::DeviceLog,
            Model::Vfio => DirtyTracking::AllMapped,
        }
    }
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

/// What [`Pool::open`](crate::Pool::open) (or [`Inventory::from_config`]) did to reconcile the store with the
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

/// Everything the store keeps of an inventory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub boards: BTreeMap<String, BoardRecord>,
    pub endpoints: BTreeMap<String, Endpoint>,
    pub next_seq: u64,
}

/// A device found by id.
#[derive(Debug, Clone, Copy)]
struct Dev<'a> {
    id: &'a str,
    board: &'a BoardRecord,
    shape: DeviceShape,
}

/// The pool's state in memory: boards (with their devices), pools, endpoints and leases.
///
/// Mutations return the [`Event`]s they produced; a refused mutation returns an error and
/// changes nothing. [`Pool`](crate::Pool) wraps this with the store.
#[derive(Debug, Clone)]
pub struct Inventory {
    endpoint_dir: PathBuf,
    /// Configuration order, then missing boards by id.
    boards: Vec<BoardRecord>,
    pools: Vec<(String, Vec<String>)>,
    endpoints: BTreeMap<String, Endpoint>,
    next_seq: u64,
}

fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

impl Inventory {
    /// An inventory of a validated configuration's boards and pools, without endpoints
    /// (see [`Inventory::from_config`] for the configured endpoints).
    pub fn new(config: &PoolConfig) -> Result<Self, PoolError> {
        config.validate()?;
        Ok(Self {
            endpoint_dir: config.daemon.endpoint_dir.clone(),
            boards: config
                .boards
                .iter()
                .map(|b| BoardRecord {
                    def: BoardDef::from_config(b),
                    quarantined: false,
                    missing: false,
                })
                .collect(),
            pools: config
                .pools
                .iter()
                .map(|p| (p.name.clone(), p.boards.clone()))
                .collect(),
            endpoints: BTreeMap::new(),
            next_seq: 1,
        })
    }

    // ---- queries ----

    /// Every board with its devices and their holders, in configuration order (missing
    /// boards last).
    pub fn boards(&self) -> Vec<BoardView> {
        self.boards.iter().map(|b| self.board_view(b)).collect()
    }

    /// One board.
    pub fn board(&self, id: &str) -> Option<BoardView> {
        self.board_record(id).map(|b| self.board_view(b))
    }

    /// One device (a whole board without partitions, or a partition).
    pub fn device(&self, id: &str) -> Option<DeviceView> {
        self.dev(id).map(|d| self.device_view(d))
    }

    /// Every pool with its capacity.
    pub fn pools(&self) -> Vec<PoolView> {
        self.pools
            .iter()
            .map(|(name, boards)| {
                let devs: Vec<Dev<'_>> = boards
                    .iter()
                    .filter_map(|b| self.board_record(b))
                    .flat_map(|b| self.devs_of(b))
                    .collect();
                PoolView {
                    name: name.clone(),
                    boards: boards.clone(),
                    devices: devs.len(),
                    free: devs
                        .iter()
                        .filter(|d| {
                            d.board.state() == BoardState::Available && self.holder(d.id).is_none()
                        })
                        .count(),
                }
            })
            .collect()
    }

    /// Every endpoint, by id.
    pub fn endpoints(&self) -> impl Iterator<Item = &Endpoint> {
        self.endpoints.values()
    }

    /// One endpoint.
    pub fn endpoint(&self, id: &str) -> Option<&Endpoint> {
        self.endpoints.get(id)
    }

    /// The move in progress of an endpoint, e.g. to finish or abort it after a restart.
    pub fn pending_move(&self, endpoint: &str) -> Option<MovePlan> {
        let e = self.endpoints.get(endpoint)?;
        let (from, to) = (
            self.dev(e.device.as_deref()?)?,
            self.dev(e.moving_to.as_deref()?)?,
        );
        Some(MovePlan {
            endpoint: e.id.clone(),
            from: from.id.into(),
            from_board: from.board.def.id.clone(),
            to: to.id.into(),
            to_board: to.board.def.id.clone(),
            shape: from.shape,
        })
    }

    /// Every move in progress.
    pub fn pending_moves(&self) -> Vec<MovePlan> {
        self.endpoints
            .keys()
            .filter_map(|e| self.pending_move(e))
            .collect()
    }

    /// The sequence number the next event will get.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    // ---- mutations ----

    /// Creates an endpoint leasing the first free device of `spec.pool` (boards in pool
    /// order, partitions in board order) on an available board that meets the requirements,
    /// or the named `spec.device`.
    pub fn create_endpoint(&mut self, spec: &EndpointSpec) -> Result<Vec<Event>, PoolError> {
        if !valid_id(&spec.id) {
            return Err(PoolError::BadId(spec.id.clone()));
        }
        if let Some(holder) = self.id_holder(&spec.id) {
            return Err(PoolError::DuplicateId {
                id: spec.id.clone(),
                holder,
            });
        }
        let socket = match &spec.socket {
            Some(s) => s.clone(),
            None => self.endpoint_dir.join(format!("{}.sock", spec.id)),
        };
        self.check_socket(&socket)?;
        let requirements = Requirements {
            min_vram: spec.min_vram.unwrap_or(0),
            min_queues: spec.min_queues.unwrap_or(0),
        };
        let device = match (&spec.pool, &spec.device) {
            (Some(_), Some(_)) => return Err(PoolError::BadPlacement(", not both")),
            (None, None) => return Err(PoolError::BadPlacement("")),
            (Some(pool), None) => self.select(pool, &requirements)?,
            (None, Some(device)) => self.check_leasable(device, &requirements)?.id.to_owned(),
        };
        let endpoint = Endpoint {
            id: spec.id.clone(),
            socket: socket.clone(),
            requirements,
            pool: spec.pool.clone(),
            device: Some(device.clone()),
            moving_to: None,
            created_unix_ms: now_unix_ms(),
        };
        self.endpoints.insert(spec.id.clone(), endpoint);
        Ok(vec![self.emit(EventKind::EndpointCreated {
            endpoint: spec.id.clone(),
            device: Some(device),
            socket: socket.to_string_lossy().into_owned(),
        })])
    }

    /// Deletes an endpoint, freeing its device. Refused while a move is in progress.
    pub fn delete_endpoint(&mut self, id: &str) -> Result<Vec<Event>, PoolError> {
        let e = self.endpoint_checked(id)?;
        self.no_move(e)?;
        let device = e.device.clone();
        self.endpoints.remove(id);
        Ok(vec![self.emit(EventKind::EndpointDeleted {
            endpoint: id.into(),
            device,
        })])
    }

    /// Checks a move of `endpoint`'s lease to `to` without reserving anything: the endpoint
    /// holds a device and has no move in progress; `to` is another device, free, on an
    /// available board, and of the same shape (model, VRAM, queues, irq, vram_mmap: a move
    /// must not change what the guest sees).
    pub fn check_move(&self, endpoint: &str, to: &str) -> Result<MovePlan, PoolError> {
        let e = self.endpoint_checked(endpoint)?;
        self.no_move(e)?;
        let Some(from) = e.device.as_deref() else {
            return Err(PoolError::NotLeased(endpoint.into()));
        };
        if from == to {
            return Err(PoolError::SameDevice {
                endpoint: endpoint.into(),
                device: to.into(),
            });
        }
        let from = self.dev_checked(from)?;
        let target = self.dev_checked(to)?;
        if from.shape.model == Model::Vfio {
            return Err(PoolError::NotMovable {
                endpoint: endpoint.into(),
                device: from.id.into(),
            });
        }
        // The shape first: an incompatible target is wrong whatever its state.
        if let Some(difference) = target.shape.difference(&from.shape) {
            return Err(PoolError::ShapeMismatch {
                from: from.id.into(),
                to: to.into(),
                difference,
            });
        }
        let target = self.check_leasable(to, &Requirements::default())?;
        Ok(MovePlan {
            endpoint: endpoint.into(),
            from: from.id.into(),
            from_board: from.board.def.id.clone(),
            to: target.id.into(),
            to_board: target.board.def.id.clone(),
            shape: from.shape,
        })
    }

    /// Checks a move (as [`Inventory::check_move`]) and reserves the target for it: no other
    /// endpoint can lease it until [`Inventory::commit_move`] or [`Inventory::abort_move`].
    /// The data path moves the device between the two.
    pub fn plan_move(
        &mut self,
        endpoint: &str,
        to: &str,
    ) -> Result<(MovePlan, Vec<Event>), PoolError> {
        let plan = self.check_move(endpoint, to)?;
        let event = self.start_move(&plan);
        Ok((plan, vec![event]))
    }

    /// Commits a planned move: the endpoint's lease becomes `plan.to`, `plan.from` is freed.
    /// Refused (changing nothing) unless exactly this move is in progress.
    pub fn commit_move(&mut self, plan: &MovePlan) -> Result<Vec<Event>, PoolError> {
        self.check_pending(plan)?;
        if let Some(e) = self.endpoints.get_mut(&plan.endpoint) {
            e.device = Some(plan.to.clone());
            e.moving_to = None;
        }
        Ok(vec![self.emit(EventKind::LeaseMoved {
            endpoint: plan.endpoint.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
        })])
    }

    /// Abandons a planned move: the endpoint keeps `plan.from`, `plan.to` is free again.
    pub fn abort_move(&mut self, plan: &MovePlan) -> Result<Vec<Event>, PoolError> {
        self.check_pending(plan)?;
        if let Some(e) = self.endpoints.get_mut(&plan.endpoint) {
            e.moving_to = None;
        }
        Ok(vec![self.emit(EventKind::MoveAborted {
            endpoint: plan.endpoint.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
        })])
    }

    /// Releases an endpoint's device; the endpoint stays, without a device.
    pub fn detach(&mut self, endpoint: &str) -> Result<Vec<Event>, PoolError> {
        let e = self.endpoint_checked(endpoint)?;
        self.no_move(e)?;
        let Some(device) = e.device.clone() else {
            return Err(PoolError::NotLeased(endpoint.into()));
        };
        if let Some(e) = self.endpoints.get_mut(endpoint) {
            e.device = None;
        }
        Ok(vec![self.emit(EventKind::Detached {
            endpoint: endpoint.into(),
            device,
        })])
    }

    /// Leases a device to a detached endpoint: the named device, the first fitting device of
    /// the named pool, or (neither given) of the endpoint's own pool. The endpoint's
    /// requirements apply.
    pub fn attach(&mut self, endpoint: &str, to: &Placement) -> Result<Vec<Event>, PoolError> {
        let e = self.endpoint_checked(endpoint)?;
        if let Some(device) = &e.device {
            return Err(PoolError::AlreadyLeased {
                endpoint: endpoint.into(),
                device: device.clone(),
            });
        }
        let (device, pool) = match (&to.pool, &to.device) {
            (Some(_), Some(_)) => return Err(PoolError::BadPlacement(", not both")),
            (None, Some(d)) => (
                self.check_leasable(d, &e.requirements)?.id.to_owned(),
                e.pool.clone(),
            ),
            (Some(p), None) => (self.select(p, &e.requirements)?, Some(p.clone())),
            (None, None) => match &e.pool {
                Some(p) => (self.select(p, &e.requirements)?, Some(p.clone())),
                None => {
                    return Err(PoolError::BadPlacement(
                        " (the endpoint was created on a device, so it has no pool)",
                    ));
                }
            },
        };
        if let Some(e) = self.endpoints.get_mut(endpoint) {
            e.device = Some(device.clone());
            e.pool = pool;
        }
        Ok(vec![self.emit(EventKind::Attached {
            endpoint: endpoint.into(),
            device,
        })])
    }

    /// Plans moving every endpoint off `board` (including its partitions) to free devices of
    /// the same shape on other available boards, preferring the board's own pool, without
    /// reserving anything. Refused as a whole when any endpoint cannot move (or has a move in
    /// progress, to or from the board).
    pub fn plan_drain(&self, board: &str) -> Result<Vec<MovePlan>, PoolError> {
        let record = self
            .board_record(board)
            .ok_or_else(|| PoolError::UnknownBoard(board.into()))?;
        let on_board: BTreeSet<&str> = record.def.devices().map(|(id, _)| id).collect();
        let own_pool = self.pool_of(board);
        // Candidate boards: own pool first, then the other pools, then boards in no pool.
        let own: Vec<&str> = own_pool
            .map(|p| self.pool_boards(p).collect())
            .unwrap_or_default();
        let pooled = self
            .pools
            .iter()
            .flat_map(|(_, boards)| boards.iter().map(String::as_str));
        let all = self.boards.iter().map(|r| r.def.id.as_str());
        let mut order: Vec<&BoardRecord> = Vec::new();
        for id in own.into_iter().chain(pooled).chain(all) {
            if id != board
                && !order.iter().any(|o| o.def.id == id)
                && let Some(r) = self.board_record(id)
            {
                order.push(r);
            }
        }
        let mut taken: HashSet<String> = HashSet::new();
        let mut plans = Vec::new();
        for e in self.endpoints.values() {
            let moving_in = e.moving_to.as_deref().is_some_and(|d| on_board.contains(d));
            let leased_here = e.device.as_deref().is_some_and(|d| on_board.contains(d));
            if !moving_in && !leased_here {
                continue;
            }
            let refuse = |reason: PoolError| PoolError::DrainRefused {
                board: board.into(),
                endpoint: e.id.clone(),
                reason: Box::new(reason),
            };
            self.no_move(e).map_err(refuse)?;
            let from = e.device.as_deref().unwrap_or_default();
            let shape = self
                .dev(from)
                .map(|d| d.shape)
                .ok_or_else(|| refuse(PoolError::UnknownDevice(from.into())))?;
            let target = order
                .iter()
                .filter(|r| r.state() == BoardState::Available)
                .flat_map(|r| self.devs_of(r))
                .find(|d| d.shape == shape && self.holder(d.id).is_none() && !taken.contains(d.id))
                .ok_or_else(|| {
                    refuse(PoolError::NoCompatibleDevice {
                        device: from.into(),
                    })
                })?;
            taken.insert(target.id.to_owned());
            plans.push(self.check_move(&e.id, target.id).map_err(refuse)?);
        }
        Ok(plans)
    }

    /// Drains a board: plans as [`Inventory::plan_drain`], then in one step quarantines the
    /// board and starts every move (targets reserved). The data path then moves each
    /// endpoint and commits or aborts each plan.
    pub fn drain(&mut self, board: &str) -> Result<(Vec<MovePlan>, Vec<Event>), PoolError> {
        let plans = self.plan_drain(board)?;
        let mut events = self.quarantine(board)?;
        events.push(self.emit(EventKind::DrainStarted {
            board: board.into(),
            moves: plans.clone(),
        }));
        for plan in &plans {
            let event = self.start_move(plan);
            events.push(event);
        }
        Ok((plans, events))
    }

    /// Stops new leases on a board (and its partitions); existing leases stay until moved.
    /// Quarantining a quarantined board changes nothing and reports no event.
    pub fn quarantine(&mut self, board: &str) -> Result<Vec<Event>, PoolError> {
        self.set_quarantine(board, true)
    }

    /// Lets a quarantined board take leases again.
    pub fn unquarantine(&mut self, board: &str) -> Result<Vec<Event>, PoolError> {
        self.set_quarantine(board, false)
    }

    // ---- restore ----

    /// A fresh inventory of a configuration, with its configured endpoints created (as
    /// [`Pool::open`](crate::Pool::open) does on a new store, without the store).
    pub fn from_config(config: &PoolConfig) -> Result<(Self, Vec<Event>, OpenReport), PoolError> {
        Self::restore(config, Snapshot::default())
    }

    /// Rebuilds the inventory from a stored snapshot and the configuration: the store's
    /// endpoints, leases, moves in progress and quarantines are kept; boards new to the
    /// configuration appear; boards gone from it are forgotten when unleased and kept as
    /// `missing` otherwise; configured endpoints are created when absent. Refused when a
    /// leased device no longer exists or changed shape in the configuration.
    pub(crate) fn restore(
        config: &PoolConfig,
        stored: Snapshot,
    ) -> Result<(Self, Vec<Event>, OpenReport), PoolError> {
        let mut inv = Self::new(config)?;
        inv.next_seq = stored.next_seq.max(1);
        let mut report = OpenReport::default();
        let mut kinds = Vec::new();
        let fresh = stored.boards.is_empty() && stored.endpoints.is_empty();
        let holders = |board: &BoardDef| -> Vec<String> {
            let devs: HashSet<&str> = board.devices().map(|(id, _)| id).collect();
            stored
                .endpoints
                .values()
                .filter(|e| {
                    [&e.device, &e.moving_to]
                        .into_iter()
                        .flatten()
                        .any(|d| devs.contains(d.as_str()))
                })
                .map(|e| e.id.clone())
                .collect()
        };
        for b in &mut inv.boards {
            match stored.boards.get(&b.def.id) {
                Some(old) => {
                    b.quarantined = old.quarantined;
                    if old.missing {
                        kinds.push(EventKind::BoardReturned {
                            board: b.def.id.clone(),
                        });
                    }
                }
                None => {
                    report.added_boards.push(b.def.id.clone());
                    if !fresh {
                        kinds.push(EventKind::BoardAdded {
                            board: b.def.id.clone(),
                        });
                    }
                }
            }
        }
        for (id, old) in &stored.boards {
            if inv.board_record(id).is_some() {
                continue;
            }
            let endpoints = holders(&old.def);
            if endpoints.is_empty() {
                report.removed_boards.push(id.clone());
                kinds.push(EventKind::BoardRemoved { board: id.clone() });
            } else {
                // A kept board's ids must not collide with the configuration's.
                let ids = std::iter::once(id).chain(old.def.partitions.iter().map(|p| &p.id));
                for used in ids {
                    if let Some(holder) = inv.id_holder(used) {
                        return Err(PoolError::Reconcile(format!(
                            "board \"{id}\", gone from the configuration but leased by {}, has the id \"{used}\" of {holder}",
                            endpoints.join(", ")
                        )));
                    }
                }
                report.missing_boards.push(id.clone());
                if !old.missing {
                    kinds.push(EventKind::BoardMissing {
                        board: id.clone(),
                        endpoints,
                    });
                }
                inv.boards.push(BoardRecord {
                    def: old.def.clone(),
                    quarantined: old.quarantined,
                    missing: true,
                });
            }
        }
        // Every stored lease must find its device, with the shape it had.
        let old_shape = |device: &str| {
            stored
                .boards
                .values()
                .flat_map(|b| b.def.devices())
                .find(|(id, _)| *id == device)
                .map(|(_, s)| s)
        };
        let mut used: HashSet<&str> = HashSet::new();
        for e in stored.endpoints.values() {
            if let Some(holder) = inv.id_holder(&e.id) {
                return Err(PoolError::Reconcile(format!(
                    "endpoint \"{}\" has the id of {holder} in the configuration",
                    e.id
                )));
            }
            for d in [&e.device, &e.moving_to].into_iter().flatten() {
                let Some(now) = inv.dev(d) else {
                    return Err(PoolError::Reconcile(format!(
                        "endpoint \"{}\" holds device \"{d}\", which the configuration no longer has",
                        e.id
                    )));
                };
                if let Some(was) = old_shape(d)
                    && let Some(diff) = now.shape.difference(&was)
                {
                    return Err(PoolError::Reconcile(format!(
                        "endpoint \"{}\" holds device \"{d}\", whose configuration changed in {diff}; restore it, or delete the endpoint first",
                        e.id
                    )));
                }
                if !used.insert(d) {
                    return Err(PoolError::Reconcile(format!(
                        "device \"{d}\" is held by two endpoints"
                    )));
                }
            }
        }
        inv.endpoints = stored.endpoints.clone();
        let mut events: Vec<Event> = kinds.into_iter().map(|k| inv.emit(k)).collect();
        for c in &config.endpoints {
            if inv.endpoints.contains_key(&c.id) {
                continue;
            }
            let spec = EndpointSpec {
                id: c.id.clone(),
                pool: c.pool.clone(),
                device: c.device.clone(),
                min_vram: c.min_vram.map(|s| s.0),
                min_queues: c.min_queues,
                socket: c.socket.clone(),
            };
            match inv.create_endpoint(&spec) {
                Ok(ev) => {
                    events.extend(ev);
                    report.created_endpoints.push(c.id.clone());
                }
                Err(e) => report.failed_endpoints.push(FailedEndpoint {
                    endpoint: c.id.clone(),
                    error: e.to_string(),
                }),
            }
        }
        report.pending_moves = inv.pending_moves();
        let opened = EventKind::Opened {
            boards: inv.boards.len(),
            endpoints: inv.endpoints.len(),
        };
        events.push(inv.emit(opened));
        Ok((inv, events, report))
    }

    /// What the store keeps.
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot {
            boards: self
                .boards
                .iter()
                .map(|b| (b.def.id.clone(), b.clone()))
                .collect(),
            endpoints: self.endpoints.clone(),
            next_seq: self.next_seq,
        }
    }

    // ---- helpers ----

    fn emit(&mut self, kind: EventKind) -> Event {
        let seq = self.next_seq;
        self.next_seq += 1;
        Event {
            seq,
            at_unix_ms: now_unix_ms(),
            kind,
        }
    }

    fn start_move(&mut self, plan: &MovePlan) -> Event {
        if let Some(e) = self.endpoints.get_mut(&plan.endpoint) {
            e.moving_to = Some(plan.to.clone());
        }
        self.emit(EventKind::MoveStarted {
            endpoint: plan.endpoint.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
        })
    }

    fn set_quarantine(&mut self, board: &str, on: bool) -> Result<Vec<Event>, PoolError> {
        let record = self
            .boards
            .iter_mut()
            .find(|b| b.def.id == board)
            .ok_or_else(|| PoolError::UnknownBoard(board.into()))?;
        if record.quarantined == on {
            return Ok(Vec::new());
        }
        record.quarantined = on;
        let board = board.to_owned();
        Ok(vec![self.emit(if on {
            EventKind::BoardQuarantined { board }
        } else {
            EventKind::BoardReleased { board }
        })])
    }

    fn board_record(&self, id: &str) -> Option<&BoardRecord> {
        self.boards.iter().find(|b| b.def.id == id)
    }

    fn devs_of<'a>(&'a self, b: &'a BoardRecord) -> impl Iterator<Item = Dev<'a>> + 'a {
        b.def.devices().map(move |(id, shape)| Dev {
            id,
            board: b,
            shape,
        })
    }

    fn dev(&self, id: &str) -> Option<Dev<'_>> {
        self.boards
            .iter()
            .flat_map(|b| self.devs_of(b))
            .find(|d| d.id == id)
    }

    fn pool_of(&self, board: &str) -> Option<&str> {
        self.pools
            .iter()
            .find(|(_, boards)| boards.iter().any(|b| b == board))
            .map(|(name, _)| name.as_str())
    }

    fn pool_boards(&self, pool: &str) -> impl Iterator<Item = &str> {
        self.pools
            .iter()
            .filter(move |(name, _)| name == pool)
            .flat_map(|(_, boards)| boards.iter().map(String::as_str))
    }

    /// The endpoint leasing or reserving a device.
    fn holder(&self, device: &str) -> Option<&Endpoint> {
        self.endpoints
            .values()
            .find(|e| e.device.as_deref() == Some(device) || e.moving_to.as_deref() == Some(device))
    }

    /// What already uses an id, in the one namespace of endpoints, boards, partitions and
    /// pools.
    fn id_holder(&self, id: &str) -> Option<String> {
        if self.endpoints.contains_key(id) {
            return Some(format!("endpoint \"{id}\""));
        }
        for b in &self.boards {
            if b.def.id == id {
                return Some(format!("board \"{id}\""));
            }
            if b.def.partitions.iter().any(|p| p.id == id) {
                return Some(format!("a partition of board \"{}\"", b.def.id));
            }
        }
        self.pools
            .iter()
            .any(|(name, _)| name == id)
            .then(|| format!("pool \"{id}\""))
    }

    fn check_socket(&self, socket: &std::path::Path) -> Result<(), PoolError> {
        let bad = |reason| {
            Err(PoolError::BadSocketPath {
                path: socket.into(),
                reason,
            })
        };
        if !socket.is_absolute() {
            return bad("a socket path must be absolute");
        }
        if socket.as_os_str().len() > MAX_SOCKET_PATH {
            return bad("longer than the 107 bytes a UNIX socket path can have");
        }
        if socket.as_os_str().as_encoded_bytes().contains(&0) {
            return bad("it contains a NUL byte");
        }
        if self.endpoints.values().any(|e| e.socket == socket) {
            return bad("another endpoint uses it");
        }
        Ok(())
    }

    fn endpoint_checked(&self, id: &str) -> Result<&Endpoint, PoolError> {
        self.endpoints
            .get(id)
            .ok_or_else(|| PoolError::UnknownEndpoint(id.into()))
    }

    fn no_move(&self, e: &Endpoint) -> Result<(), PoolError> {
        match &e.moving_to {
            Some(to) => Err(PoolError::MoveInProgress {
                endpoint: e.id.clone(),
                to: to.clone(),
            }),
            None => Ok(()),
        }
    }

    /// A device an endpoint with `req` may lease now.
    fn check_leasable(&self, device: &str, req: &Requirements) -> Result<Dev<'_>, PoolError> {
        let d = self.dev_checked(device)?;
        if let Some(holder) = self.holder(device) {
            return Err(PoolError::DeviceBusy {
                device: device.into(),
                endpoint: holder.id.clone(),
            });
        }
        let state = d.board.state();
        if state != BoardState::Available {
            return Err(PoolError::BoardUnavailable {
                device: device.into(),
                board: d.board.def.id.clone(),
                state,
            });
        }
        d.shape
            .meets(req)
            .map_err(|detail| PoolError::RequirementsNotMet {
                device: device.into(),
                detail,
            })?;
        Ok(d)
    }

    fn dev_checked(&self, device: &str) -> Result<Dev<'_>, PoolError> {
        self.dev(device).ok_or_else(|| {
            if self.board_record(device).is_some() {
                PoolError::NotLeasable(device.into())
            } else {
                PoolError::UnknownDevice(device.into())
            }
        })
    }

    /// The first free device of `pool` on an available board meeting `req`.
    fn select(&self, pool: &str, req: &Requirements) -> Result<String, PoolError> {
        if !self.pools.iter().any(|(name, _)| name == pool) {
            return Err(PoolError::UnknownPool(pool.into()));
        }
        self.pool_boards(pool)
            .filter_map(|b| self.board_record(b))
            .filter(|b| b.state() == BoardState::Available)
            .flat_map(|b| self.devs_of(b))
            .find(|d| self.holder(d.id).is_none() && d.shape.meets(req).is_ok())
            .map(|d| d.id.to_owned())
            .ok_or_else(|| PoolError::NoCapacity {
                pool: pool.into(),
                min_vram: req.min_vram,
                min_queues: req.min_queues,
            })
    }

    fn check_pending(&self, plan: &MovePlan) -> Result<(), PoolError> {
        let e = self.endpoint_checked(&plan.endpoint)?;
        if e.device.as_deref() != Some(plan.from.as_str())
            || e.moving_to.as_deref() != Some(plan.to.as_str())
        {
            return Err(PoolError::NoSuchMove {
                endpoint: plan.endpoint.clone(),
                from: plan.from.clone(),
                to: plan.to.clone(),
            });
        }
        Ok(())
    }

    fn board_view(&self, b: &BoardRecord) -> BoardView {
        BoardView {
            id: b.def.id.clone(),
            shape: b.def.shape,
            state: b.state(),
            pool: self.pool_of(&b.def.id).map(str::to_owned),
            devices: self.devs_of(b).map(|d| self.device_view(d)).collect(),
            host: b.def.host.clone(),
            dirty_tracking: DirtyTracking::of(b.def.shape.model),
        }
    }

    fn device_view(&self, d: Dev<'_>) -> DeviceView {
        let lessee = self
            .endpoints
            .values()
            .find(|e| e.device.as_deref() == Some(d.id));
        let mover = self
            .endpoints
            .values()
            .find(|e| e.moving_to.as_deref() == Some(d.id));
        DeviceView {
            id: d.id.into(),
            board: d.board.def.id.clone(),
            partition: d.id != d.board.def.id,
            shape: d.shape,
            state: d.board.state(),
            endpoint: lessee.map(|e| e.id.clone()),
            reserved_for: mover.map(|e| e.id.clone()),
            host: d.board.def.host.clone(),
        }
    }
}
