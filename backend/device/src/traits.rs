//! What a device model is, split by capability.
//!
//! Every device implements the core, [`PciDevice`] (regions, configuration, interrupt layout,
//! reset). Everything else is an optional group the device hands out when it has it (the way
//! vhost-user backends and libvfio-user's per-feature callbacks are built), so the server can
//! hold any device as a `Box<dyn PciDevice>` (a softgpu, a `cuda` board, the scratchpad, a
//! passthrough device: every kind of `switchyard_kinds::KINDS`), and a swap can even cross
//! kinds when the shapes match (a softgpu and a `cuda` board present the same device):
//!
//! | group | what the server does with it |
//! |---|---|
//! | [`Migratable`] | VFIO migration v2 arcs and the migration stream |
//! | [`Swappable`] + [`Quiesce`] | replace the device under a client: park it, build a parked successor, check it, hand the state over |
//! | [`DmaObserver`] | told about every DMA map and unmap before it takes effect (a passthrough device programs its IOMMU there) |
//! | [`DirtySource`] | dirty bits ORed into DMA logging reports (a VFIO dirty log, say) |
//! | [`IrqRouter`] | takes the client's interrupt eventfds itself (VFIO `SET_IRQS`, so interrupts never cross the server) |
//!
//! And the groups a pool daemon's worker uses, above the server:
//!
//! | group | what the worker does with it |
//! |---|---|
//! | [`Recoverable`] | names the memory objects a replacement process must be handed (the device mirrors the rest into its black box; [`KindConfig::recover`](crate::kind::KindConfig::recover) rebuilds it) |
//! | [`Relocatable`] | moves the device onto new memory under its client (a pool's move to another board): pre-copy rounds, a parked successor, the slot's swap |
//! | [`Telemetry`] | work counters for the daemon's metrics |

use std::any::Any;
use std::fs::File;
use std::sync::Arc;

use crate::{
    DeviceContext, DeviceDescription, DeviceError, DmaProt, MigArc, MigrationCaps, PrecopyInfo,
    Result,
};

/// Downcasting, for a device that needs to know whether another one is of its own kind
/// (a hand-over between two softgpus). Implemented for every `'static` type.
pub trait AsAny: Any {
    /// `self` as [`Any`].
    fn as_any(&self) -> &dyn Any;
    /// `self` as mutable [`Any`].
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

impl<T: Any> AsAny for T {
    fn as_any(&self) -> &dyn Any {
        self
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

/// A PCI device model served over vfio-user: the core every device has.
///
/// Accesses come from the server's connection thread; a model that runs work elsewhere (engine
/// threads) synchronises internally. Accesses are already bounds-checked against the region
/// size by the server, but models must not rely on it for memory safety.
pub trait PciDevice: Send + AsAny {
    /// The static description (regions, interrupts, reset support).
    fn description(&self) -> &DeviceDescription;

    /// Serves a `REGION_READ`.
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> Result<()>;

    /// Serves a `REGION_WRITE`.
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<()>;

    /// Returns the device to its power-on state (`DEVICE_RESET`, also used for FLR).
    fn reset(&mut self) -> Result<()>;

    /// A new client opened the device (every VMM connection that is not a resumed one: a
    /// guest-visible move's re-plug too), before its first message is served: the PCI
    /// function must look as after a reset, the way kernel vfio-pci resets a device when a
    /// user opens it. Config space back to its power-on values (COMMAND, Device Control,
    /// MSI and MSI-X control, BAR addresses: everything a previous guest wrote), MSI-X vectors
    /// masked, nothing pending. Device memory keeps the kind's rules (a softgpu's VRAM is
    /// kept; `vram_reset=` applies to resets, which this is not). A resumed client (a
    /// replaced worker continuing its connection) is never told: it finds the device as it
    /// left it.
    ///
    /// The default does nothing: for devices with no guest-writable state of their own.
    /// An error is logged and the client served anyway.
    fn fresh_open(&mut self) -> Result<()> {
        Ok(())
    }

    /// Called after `SET_IRQS` changed the routing of `index`.
    fn irqs_changed(&mut self, _index: u32) {}

    /// Called when the client is gone: its DMA windows and eventfds have been dropped by the
    /// server. The device keeps its state (spec rule) but must stop touching DMA memory; the
    /// next client that is not a resumed one finds its PCI function fresh
    /// ([`PciDevice::fresh_open`]).
    fn client_disconnected(&mut self) {}

    /// VFIO migration v2, if the device can migrate (`None`: the migration features answer
    /// "not supported").
    fn migration(&mut self) -> Option<&mut dyn Migratable> {
        None
    }

    /// Replacement under a connected client, if the device supports it.
    fn swappable(&mut self) -> Option<&mut dyn Swappable> {
        None
    }

    /// The observer of the client's DMA maps and unmaps, if the device needs one. The server
    /// installs it in the [`DmaSpace`](crate::DmaSpace) when the device takes the slot.
    fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>> {
        None
    }

    /// A source of dirty bits the device tracks itself, ORed into DMA logging reports.
    fn dirty_source(&self) -> Option<Arc<dyn DirtySource>> {
        None
    }

    /// The device's own interrupt routing, if it delivers interrupts itself.
    fn irq_router(&mut self) -> Option<&mut dyn IrqRouter> {
        None
    }

    /// What a replacement process needs beyond the black box, if the device can be
    /// recovered in one.
    fn recoverable(&self) -> Option<&dyn Recoverable> {
        None
    }

    /// Relocation onto new memory under a connected client, if the device can move.
    fn relocatable(&mut self) -> Option<&mut dyn Relocatable> {
        None
    }

    /// Work counters, if the device keeps any.
    fn telemetry(&self) -> Option<&dyn Telemetry> {
        None
    }

    /// Fault injection for tests and drills, if the device offers it.
    fn faults(&self) -> Option<&dyn FaultInjection> {
        None
    }

    /// The failure this device reported as handled above it ([`FailedHook`] said a
    /// failover would take it) will not be failed over after all (the pool refused: no VMM,
    /// no device free for good, policy changed): the device now tells its client as it
    /// would have without a hook (the ERR interrupt). Nothing if it reported no failure.
    ///
    /// [`FailedHook`]: crate::kind::FailedHook
    fn failure_unhandled(&self) {}
}

impl std::fmt::Debug for dyn PciDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("dyn PciDevice")
            .field("name", &self.description().name)
            .finish_non_exhaustive()
    }
}

/// VFIO migration v2 (`DEVICE_FEATURE` MIGRATION / MIG_DEVICE_STATE, `MIG_DATA_READ/WRITE`).
pub trait Migratable: Send {
    /// What the device supports.
    fn caps(&self) -> MigrationCaps;

    /// Takes one direct arc of the migration state machine. The server walks the shortest
    /// path between the client's current and requested states and calls this once per arc;
    /// an error leaves the device in the migration ERROR state until a reset.
    fn step(&mut self, arc: MigArc) -> Result<()>;

    /// Fills `buf` with the next bytes of the outgoing migration stream (PRE_COPY,
    /// STOP_COPY) and returns how many; fewer than `buf.len()` means "no more data for now"
    /// (PRE_COPY: the round is complete; STOP_COPY: the stream is complete).
    fn read(&mut self, buf: &mut [u8]) -> Result<usize>;

    /// Consumes the next bytes of an incoming migration stream (RESUMING). Chunks may split
    /// the stream anywhere.
    fn write(&mut self, data: &[u8]) -> Result<()>;

    /// Abandons any migration in progress and lets the device run (device reset, client
    /// loss, recovery from ERROR).
    fn abort(&mut self);

    /// The regions (bit N: region N) whose sparse mmap areas a client may migrate itself,
    /// as its own RAM: the client logs the guest's writes through its mapping and sends the
    /// dirty pages, and the device's stream carries only what the device itself wrote
    /// there. 0 (the default): none; the device's stream carries all of its memory.
    fn client_migratable_regions(&self) -> u64 {
        0
    }

    /// Whether the client migrates the mapped memory of
    /// [`client_migratable_regions`](Migratable::client_migratable_regions) itself (set
    /// when the client asked and the server agreed; cleared when the client leaves). Takes
    /// effect at the next outgoing stream.
    fn set_client_migrates_mapped(&mut self, _on: bool) {}
    /// In PRE_COPY: what the outgoing stream still holds (`GET_PRECOPY_INFO`). `None`: the
    /// device does not know (the server answers "not supported" and the VMM estimates).
    fn precopy_info(&mut self) -> Option<PrecopyInfo> {
        None
    }

    /// The bytes a STOP_COPY phase entered now would send, from here to the end of the
    /// stream (`DEVICE_FEATURE` MIG_DATA_SIZE), in any state. `None`: the device does not
    /// know (the server answers "not supported").
    fn stop_copy_size(&mut self) -> Option<u64> {
        None
    }
}

/// Stops a device's own activity (engines, a physical device's DMA) at a safe boundary, from
/// any thread, without the device itself: a swap parks the old device this way before it
/// takes the slot. Parks compose with every other reason the device is held (a migration
/// STOP in particular): the device runs only when nothing holds it.
pub trait Quiesce: Send + Sync {
    /// Parks the device until the guard is dropped. May wait for work in progress.
    fn park(&self) -> QuiesceGuard;
}

/// A [`Quiesce::park`]; the park ends when it is dropped.
#[must_use = "the device runs again when the guard is dropped"]
pub struct QuiesceGuard {
    _guard: Box<dyn Send>,
}

impl QuiesceGuard {
    /// Wraps a device's own guard (its `Drop` releases the park).
    pub fn new(guard: impl Send + 'static) -> Self {
        Self {
            _guard: Box::new(guard),
        }
    }
}

impl std::fmt::Debug for QuiesceGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuiesceGuard").finish_non_exhaustive()
    }
}

/// Builds a device's successor on a context, outside the device slot (building may be slow:
/// threads, memory). The successor is parked: it runs nothing until it has the old device's
/// state ([`Swappable::hand_over`]).
pub type SuccessorFactory = Box<dyn FnOnce(DeviceContext) -> Result<Box<dyn PciDevice>> + Send>;

/// A device that can be replaced under a connected client, in two phases:
/// [`Swappable::check_successor`] decides, without side effects, whether the successor may
/// replace this device; only then does [`Swappable::hand_over`] commit.
pub trait Swappable: Send {
    /// A handle that parks this device from another thread.
    fn quiesce(&self) -> Arc<dyn Quiesce>;

    /// A factory for a parked successor on the same memory objects the client maps (they
    /// cannot be re-pointed).
    fn successor(&self) -> SuccessorFactory;

    /// `Ok` if `next` (a successor built beforehand, not yet serving) can take over from this
    /// device without the client noticing, otherwise what would differ (another kind,
    /// another configuration, another backing). Changes nothing.
    fn check_successor(&self, next: &dyn PciDevice) -> std::result::Result<(), &'static str>;

    /// Moves this device's state into `next` and lets `next` run; this device stays parked
    /// for good. On error this device runs on (nothing ran on `next`).
    fn hand_over(&mut self, next: &mut dyn PciDevice) -> Result<()>;
}

/// Told about the client's DMA windows before a change takes effect (a passthrough device maps
/// them in its IOMMU; a device that caches translations drops them).
///
/// Both are called with no lock of the [`DmaSpace`](crate::DmaSpace) held (they may take
/// seconds: pinning, registration): engines keep accessing the other windows meanwhile. The
/// window's range stays reserved while either runs (an overlapping map is refused), and no
/// access through the space reaches it.
pub trait DmaObserver: Send + Sync {
    /// A window is about to be mapped; an error refuses the `DMA_MAP` (nothing is mapped).
    /// `file` is the window's backing file and its offset, or `None` for a message-only window.
    /// Accesses through the space reach the window only once this returns `Ok`.
    fn mapping(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        file: Option<(&File, u64)>,
    ) -> std::result::Result<(), DeviceError>;

    /// A window has been removed from the table; when this returns, the device no longer
    /// reaches it (the `DMA_UNMAP` reply waits for it).
    fn unmapped(&self, iova: u64, size: u64);
}

/// Dirty pages a device tracks itself (a physical device's dirty log), reported with the
/// server's own log.
pub trait DirtySource: Send + Sync {
    /// ORs the pages of `[iova, iova+len)` written since the last call into `out` (layout as
    /// [`DmaSpace::report_dirty`](crate::DmaSpace::report_dirty)) and forgets them.
    fn report(&self, iova: u64, len: u64, page_size: u64, out: &mut [u8]);
}

/// A device that delivers interrupts itself: the client's eventfds are handed to it (and the
/// server keeps its own copy, so a successor can be wired to the same eventfds).
pub trait IrqRouter: Send {
    /// `SET_IRQS` assigned (`Some`) or removed (`None`) the eventfds of vectors
    /// `start..start + fds.len()` of interrupt `index`.
    fn route(&mut self, index: u32, start: u32, fds: &[Option<&File>]) -> Result<()>;
}

/// A device a replacement process can rebuild ([`KindConfig::recover`](crate::kind::KindConfig::recover)):
/// its state is mirrored into the worker's black box, and the memory objects the client maps
/// (which a replacement must serve again, the very same files) are named here for custody.
pub trait Recoverable {
    /// The slot's memory objects a replacement needs, by their [`MemoryObjects`](crate::MemoryObjects)
    /// names, each with a new descriptor of its backing file.
    fn held_objects(&self) -> Result<Vec<(String, File)>>;
}

/// What a relocation copied, for the operator's report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelocationStats {
    /// Pre-copy rounds run (the first copies every byte in use).
    pub rounds: u32,
    /// Bytes copied by all rounds, the final one included.
    pub bytes: u64,
    /// Bytes copied by the last pre-copy round.
    pub last_round_bytes: u64,
    /// Bytes copied by the final round, with the device stopped.
    pub final_bytes: u64,
    /// How long the final round took.
    pub final_copy: std::time::Duration,
}

/// A device that can move onto new memory under its client: a copy runs while the device
/// does ([`Relocation::round`]), then a parked successor on the new memory takes the slot
/// through the server's swap, which hands the state over and copies the rest.
pub trait Relocatable: Send {
    /// Starts a relocation onto new memory this call creates. `detached`: no client is
    /// connected (memory the guest could map moves too).
    fn begin_relocation(&self, detached: bool) -> Result<Box<dyn Relocation>>;

    /// On a successor built by [`Relocation::successor`] and not yet swapped in: one more
    /// pre-copy round (what was written while it was built); the bytes copied.
    fn relocation_round(&mut self) -> Result<u64>;

    /// What the relocation that built this device copied (after the swap).
    fn relocation_stats(&self) -> Option<RelocationStats>;
}

/// A relocation in progress ([`Relocatable::begin_relocation`]). Dropped before the swap, it
/// leaves the source untouched.
pub trait Relocation: Send {
    /// The new memory objects, by the names the device will hold them under once it runs on
    /// them: custody holds them (as pending) before anything runs on them.
    fn targets(&self) -> Result<Vec<(String, File)>>;

    /// One pre-copy round: copies what changed since the last (everything in use, the first
    /// time); the bytes copied.
    fn round(&mut self) -> Result<u64>;

    /// Rounds so far.
    fn rounds(&self) -> u32;

    /// Builds the parked successor on the new memory, on the slot's context.
    fn successor(self: Box<Self>, ctx: DeviceContext) -> Result<Box<dyn PciDevice>>;
}

/// Counters of the work a device did (commands, bytes produced, failures), monotonic.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WorkCounters {
    /// Commands completed.
    pub commands: u64,
    /// Bytes the completed commands produced.
    pub bytes: u64,
    /// Commands that failed.
    pub errors: u64,
    /// Commands in flight when the device's last process died, run again by its
    /// replacement (a restart, a failover): idempotent ones.
    pub replayed: u64,
    /// Of those, the ones that could not run again (not idempotent): their queues stopped
    /// with an "interrupted" error for the driver to resubmit.
    pub interrupted: u64,
}

/// A device that counts its work.
pub trait Telemetry {
    /// The counters now.
    fn work(&self) -> WorkCounters;
}

/// A device that can simulate the failures of its board it detects (tests and failover
/// drills: `switchyard ctl fault`). An injected fault goes through the same detection as a
/// real one: the device reports it through its [`FailedHook`](crate::kind::FailedHook).
pub trait FaultInjection {
    /// The faults the device can simulate, by name (`engine`, `vram`...).
    fn fault_kinds(&self) -> &'static [&'static str];

    /// Simulates the fault `kind` (one of [`fault_kinds`](Self::fault_kinds)). Returns
    /// once it is injected; it is detected and reported asynchronously, as a real one.
    fn inject_fault(&self, kind: &str) -> Result<()>;
}
