//! The device slot: where the server keeps its device, and how another thread swaps it.
//!
//! A swap replaces the backing device under a connected client. The client's DMA windows and
//! interrupt eventfds stay where they are (the server owns them in the [`DeviceContext`]) and
//! are lent to the new device; a region access that arrives during the swap waits for the
//! slot's lock, so the guest vCPU simply stalls for the swap's duration and then talks to the
//! new device. Regions the client has mmapped cannot be re-pointed, so the new device must
//! present the same memory objects ([`DeviceSlot::swap`] checks that).
//!
//! A swap has two phases. The successor is built beforehand, parked (it runs nothing until it
//! has the old device's state), and the old engines are best parked beforehand too, both
//! outside the slot. Under the slot the swap first checks everything that can refuse it (a
//! migration in progress, what the client would see: the device descriptions and
//! [`Swappable::check_successor`](switchyard_device::Swappable::check_successor)); only then does [`Swappable::hand_over`](switchyard_device::Swappable::hand_over) commit. A
//! refused swap has run nothing on the successor and leaves the old device serving. The slot
//! holds any device (`Box<dyn PciDevice>`): a successor of another kind is fine as long as
//! the old device accepts it and the client sees the same device.

use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use switchyard_device::{DeviceContext, DeviceDescription, PciDevice, Quiesce, SuccessorFactory};
use switchyard_proto::MigState;

use crate::Slot;

/// Why a swap was refused. The old device keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// A migration is in progress.
    #[error("Cannot swap the device during a migration (state {0:?})")]
    Migrating(MigState),
    /// Another move of the device is under way.
    #[error("The device is already being moved")]
    Moving,
    /// A detached swap found a client connected.
    #[error("A client is connected: its mappings cannot be re-pointed")]
    ClientConnected,
    /// The device in the slot cannot be replaced under a client.
    #[error("The device cannot be swapped")]
    NotSwappable,
    /// The new device does not look like the old one to the client.
    #[error("The new device differs from the old one: {0}")]
    Incompatible(&'static str),
    /// Building the successor or handing the state over failed.
    #[error("Cannot hand the device state over")]
    HandOver(#[source] switchyard_device::DeviceError),
}

/// The outcome of a swap.
pub struct SwapReport {
    /// How long the slot was locked: the longest a region access can have waited.
    pub held: Duration,
    /// The device that was replaced; dropping it (joining its threads) is left to the caller,
    /// outside the lock.
    pub old: Box<dyn PciDevice>,
}

impl std::fmt::Debug for SwapReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapReport")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

/// What a swap needs from the device in the slot before it takes the slot: a handle that
/// parks the device, and a factory for its parked successor ([`DeviceSlot::prepare_swap`]).
pub struct SwapPlan {
    /// Parks the old device from outside the slot.
    pub quiesce: Arc<dyn Quiesce>,
    /// Builds the successor (call it outside the slot).
    pub successor: SuccessorFactory,
}

impl std::fmt::Debug for SwapPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapPlan").finish_non_exhaustive()
    }
}

/// Told the device's migration state (`MIG_DEVICE_STATE`) each time it changes, under the
/// slot's lock (keep it short).
pub type MigrationHook = Arc<dyn Fn(MigChange) + Send + Sync>;

/// A change of the device's migration state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MigChange {
    /// The state before.
    pub from: MigState,
    /// The state now.
    pub to: MigState,
    /// What changed it.
    pub cause: MigCause,
    /// The device's state was loaded (RESUMING → STOP) from a stream that came from the
    /// expected origin ([`ServerConfig::migration_expect_origin`](crate::ServerConfig::migration_expect_origin)),
    /// and nothing has abandoned that since: what a pool's destination must see before its
    /// migration counts as completed.
    pub origin_verified: bool,
    /// The device's outgoing stream was read to its end in STOP_COPY (a MIG_DATA_READ
    /// answered fewer bytes than asked), then the client put it in STOP, and nothing has run, reset or
    /// opened another stream since: what a completed outgoing migration leaves (QEMU reads
    /// the stream out, then stops the device once the migration completed; a migration that
    /// fails after that sets RUNNING again). With cause [`MigCause::ClientGone`]: the VMM
    /// left after a migration that, as far as this side can know, completed.
    pub sent: bool,
}

/// What changed a device's migration state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigCause {
    /// The client's DEVICE_FEATURE SET MIG_DEVICE_STATE (a failed arc leaves ERROR).
    Request,
    /// The client's DEVICE_RESET (a migration in progress is abandoned).
    Reset,
    /// The client went away (a migration in progress is abandoned).
    ClientGone,
    /// The client went away leaving its device in STOP with no stream open (a guest powered
    /// off, a source's VMM quitting after a completed migration): no migration is abandoned,
    /// the device runs again, as the next client must find it.
    ClientLeft,
    /// The stream had no activity for the idle timeout (the migration is abandoned; see
    /// [`ServerConfig::migration_idle_timeout`](crate::ServerConfig::migration_idle_timeout)).
    IdleTimeout,
    /// An incoming stream came from another origin than the expected one: ERROR.
    WrongOrigin,
}

impl MigCause {
    /// The cause's name in reports (`request`, `reset`, `client_gone`, `client_left`,
    /// `idle_timeout`, `wrong_origin`).
    pub fn name(self) -> &'static str {
        match self {
            MigCause::Request => "request",
            MigCause::Reset => "reset",
            MigCause::ClientGone => "client_gone",
            MigCause::ClientLeft => "client_left",
            MigCause::IdleTimeout => "idle_timeout",
            MigCause::WrongOrigin => "wrong_origin",
        }
    }
}

/// A shared handle on the server's device.
#[derive(Clone)]
pub struct DeviceSlot {
    inner: Arc<Mutex<Slot>>,
    ctx: DeviceContext,
}

impl std::fmt::Debug for DeviceSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSlot").finish_non_exhaustive()
    }
}

impl DeviceSlot {
    pub(crate) fn new(inner: Arc<Mutex<Slot>>, ctx: DeviceContext) -> Self {
        Self { inner, ctx }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Slot> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the device; requests from the client wait meanwhile.
    pub fn with<R>(&self, f: impl FnOnce(&mut dyn PciDevice) -> R) -> R {
        f(&mut *self.lock().device)
    }

    /// Runs `f` on the device if it is a `T` (`None` otherwise); requests wait meanwhile.
    pub fn with_as<T: PciDevice, R>(&self, f: impl FnOnce(&mut T) -> R) -> Option<R> {
        let mut slot = self.lock();
        slot.device.as_any_mut().downcast_mut::<T>().map(f)
    }

    /// The DMA windows and interrupt routing the device is lent.
    pub fn context(&self) -> &DeviceContext {
        &self.ctx
    }

    /// What a swap of the current device needs, taken under the slot for an instant:
    /// [`SwapError::NotSwappable`] if the device cannot be replaced.
    pub fn prepare_swap(&self) -> Result<SwapPlan, SwapError> {
        self.with(|d| {
            let s = d.swappable().ok_or(SwapError::NotSwappable)?;
            Ok(SwapPlan {
                quiesce: s.quiesce(),
                successor: s.successor(),
            })
        })
    }

    /// Has `hook` told every change of the device's migration state (a pool worker tells its
    /// supervisor, which refuses restarts and upgrades while a migration stream is open).
    pub fn set_migration_hook(&self, hook: MigrationHook) {
        self.lock().mig_hook = Some(hook);
    }

    /// The server is gone: its migration watchdog ends.
    pub(crate) fn close(&self) {
        let mut slot = self.lock();
        slot.closed = true;
        slot.watch.notify_all();
    }

    /// Starts a move of the device to another backing (a pool's move to another board: the
    /// device copies its memory while it runs, then [`DeviceSlot::swap`] hands over to a
    /// successor on the new backing). Refused while a migration is in progress or another
    /// move is; while the guard lives, the client cannot open a migration stream (`EBUSY`;
    /// it may still stop and run the device, which then fails the final swap cleanly).
    pub fn begin_move(&self) -> Result<MoveGuard, SwapError> {
        let mut slot = self.lock();
        if slot.mig != MigState::Running {
            return Err(SwapError::Migrating(slot.mig));
        }
        if slot.moving {
            return Err(SwapError::Moving);
        }
        slot.moving = true;
        Ok(MoveGuard { slot: self.clone() })
    }

    /// Replaces the device with `next`, a successor built beforehand and parked (typically
    /// with [`DeviceSlot::prepare_swap`]'s factory, on this slot's context, with the old
    /// device parked through its [`Quiesce`] handle so that the hand-over finds it idle).
    ///
    /// Refused, with nothing run on `next` and the old device serving on, while a migration is
    /// in progress, when the device cannot be swapped, and when `next` would look different to
    /// the client (regions, interrupts, mmapped memory objects) or the old device does not
    /// accept it ([`Swappable::check_successor`](switchyard_device::Swappable::check_successor)); those checks come first, so a refused swap
    /// has run nothing. Then [`Swappable::hand_over`](switchyard_device::Swappable::hand_over) moves the state; if it fails, the old
    /// device stays too. Region accesses wait for the slot meanwhile.
    pub fn swap(&self, next: Box<dyn PciDevice>) -> Result<SwapReport, SwapError> {
        self.swap_checked(next, false)
    }

    /// [`DeviceSlot::swap`] while no client is connected, to a device whose mmappable regions
    /// may be backed by *other* memory objects (nobody maps them now; the next client gets
    /// the new ones): the last step of a guest-visible move, made while the VMM has unplugged
    /// the device. Refused ([`SwapError::ClientConnected`]) if a client is connected.
    pub fn swap_detached(&self, next: Box<dyn PciDevice>) -> Result<SwapReport, SwapError> {
        self.swap_checked(next, true)
    }

    fn swap_checked(
        &self,
        mut next: Box<dyn PciDevice>,
        detached: bool,
    ) -> Result<SwapReport, SwapError> {
        let mut slot = self.lock();
        let t0 = Instant::now();
        let committed = if slot.mig != MigState::Running {
            Err(SwapError::Migrating(slot.mig))
        } else if detached && slot.connected {
            Err(SwapError::ClientConnected)
        } else {
            same_shape(slot.device.description(), next.description(), detached).and_then(|()| {
                let old = slot.device.swappable().ok_or(SwapError::NotSwappable)?;
                old.check_successor(&*next)
                    .map_err(SwapError::Incompatible)?;
                old.hand_over(&mut *next).map_err(SwapError::HandOver)
            })
        };
        if let Err(e) = committed {
            drop(slot);
            drop(next);
            return Err(e);
        }
        self.ctx.dma.set_observer(next.dma_observer());
        self.ctx.dma.set_dirty_source(next.dirty_source());
        let old = std::mem::replace(&mut slot.device, next);
        let held = t0.elapsed();
        drop(slot);
        tracing::debug!(held_us = held.as_micros() as u64, "device swapped");
        Ok(SwapReport { held, old })
    }
}

/// A move of the slot's device to another backing under way (see
/// [`DeviceSlot::begin_move`]); dropping it ends the move.
#[must_use = "the move ends when the guard is dropped"]
pub struct MoveGuard {
    slot: DeviceSlot,
}

impl std::fmt::Debug for MoveGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MoveGuard").finish_non_exhaustive()
    }
}

impl Drop for MoveGuard {
    fn drop(&mut self) {
        self.slot.lock().moving = false;
    }
}

/// The server's rule for a successor's shape, the first check of [`DeviceSlot::swap`] and
/// [`DeviceSlot::swap_detached`]: `b` presents itself to the client exactly as `a` does (the
/// same regions with the same sizes, access and mmap areas, the same interrupts and reset
/// support; an mmappable region backed by the same memory object unless `detached`: no
/// client maps anything then, so it may be another). Public so that the conformance suite
/// (`switchyard-conformance`) checks devices against this rule, not a copy of it.
pub fn same_shape(
    a: &DeviceDescription,
    b: &DeviceDescription,
    detached: bool,
) -> Result<(), SwapError> {
    let bad = SwapError::Incompatible;
    if a.regions.len() != b.regions.len() || a.irqs != b.irqs || a.resettable != b.resettable {
        return Err(bad("region count, interrupts or reset support"));
    }
    for (ra, rb) in a.regions.iter().zip(&b.regions) {
        if (ra.size, ra.read, ra.write) != (rb.size, rb.read, rb.write) {
            return Err(bad("region size or access"));
        }
        match (&ra.mmap, &rb.mmap) {
            (None, None) => {}
            (Some(ma), Some(mb)) => {
                let ident = |f: &std::fs::File| f.metadata().map(|m| (m.dev(), m.ino())).ok();
                if ma.file_offset != mb.file_offset
                    || ma.areas != mb.areas
                    || (!detached
                        && (ident(&ma.file).is_none() || ident(&ma.file) != ident(&mb.file)))
                {
                    return Err(bad(
                        "an mmappable region is backed by another memory object",
                    ));
                }
            }
            _ => return Err(bad("region mmap support")),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use switchyard_device::{DmaSpace, Interrupts, RegionDesc, Swappable, WaitControl};

    use super::*;

    /// A device whose hand-overs are counted; `size` is its BAR0 size.
    struct Counted {
        desc: DeviceDescription,
        handed: Arc<AtomicU32>,
        fits: bool,
    }

    impl Counted {
        fn new(size: u64, fits: bool, handed: &Arc<AtomicU32>) -> Self {
            let mut regions = vec![RegionDesc::absent(); 9];
            regions[0] = RegionDesc::trapped(size);
            Self {
                desc: DeviceDescription {
                    name: "counted",
                    regions,
                    irqs: Vec::new(),
                    resettable: true,
                },
                handed: handed.clone(),
                fits,
            }
        }
    }

    impl PciDevice for Counted {
        fn description(&self) -> &DeviceDescription {
            &self.desc
        }
        fn swappable(&mut self) -> Option<&mut dyn Swappable> {
            Some(self)
        }
        fn region_read(&mut self, _: u32, _: u64, _: &mut [u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn reset(&mut self) -> switchyard_device::Result<()> {
            Ok(())
        }
    }

    struct Parked;

    impl Quiesce for Parked {
        fn park(&self) -> switchyard_device::QuiesceGuard {
            switchyard_device::QuiesceGuard::new(())
        }
    }

    impl Swappable for Counted {
        fn quiesce(&self) -> Arc<dyn Quiesce> {
            Arc::new(Parked)
        }
        fn successor(&self) -> switchyard_device::SuccessorFactory {
            let handed = self.handed.clone();
            Box::new(move |_| Ok(Box::new(Counted::new(0x1000, true, &handed))))
        }
        fn check_successor(&self, next: &dyn PciDevice) -> Result<(), &'static str> {
            match next.as_any().downcast_ref::<Counted>() {
                Some(n) if n.fits => Ok(()),
                Some(_) => Err("does not fit"),
                None => Err("another kind of device"),
            }
        }
        fn hand_over(&mut self, _next: &mut dyn PciDevice) -> switchyard_device::Result<()> {
            self.handed.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    /// Another kind of device with the same shape as `Counted`, that cannot be swapped.
    struct Fixed(DeviceDescription);

    impl PciDevice for Fixed {
        fn description(&self) -> &DeviceDescription {
            &self.0
        }
        fn region_read(&mut self, _: u32, _: u64, _: &mut [u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn reset(&mut self) -> switchyard_device::Result<()> {
            Ok(())
        }
    }

    fn slot(handed: &Arc<AtomicU32>) -> DeviceSlot {
        let ctx = DeviceContext {
            dma: Arc::new(DmaSpace::new(4)),
            irqs: Arc::new(Interrupts::new(&[0, 0, 0, 0, 0])),
            waits: Arc::new(WaitControl::default()),
            memory: Default::default(),
        };
        let inner = Slot::new(Box::new(Counted::new(0x1000, true, handed)));
        DeviceSlot::new(Arc::new(Mutex::new(inner)), ctx)
    }

    #[test]
    fn a_refused_swap_never_starts_the_hand_over() {
        let handed = Arc::new(AtomicU32::new(0));
        let s = slot(&handed);
        let r = s.swap(Box::new(Counted::new(0x2000, true, &handed)));
        assert!(matches!(r, Err(SwapError::Incompatible(_))), "{r:?}");
        let r = s.swap(Box::new(Counted::new(0x1000, false, &handed)));
        assert!(
            matches!(r, Err(SwapError::Incompatible("does not fit"))),
            "{r:?}"
        );
        s.lock().mig = MigState::Stop;
        let r = s.swap(Box::new(Counted::new(0x1000, true, &handed)));
        assert!(matches!(r, Err(SwapError::Migrating(_))), "{r:?}");
        s.lock().mig = MigState::Running;
        // Another kind with the same shape: the old device refuses it.
        let fixed = Fixed(Counted::new(0x1000, true, &handed).desc.clone());
        let r = s.swap(Box::new(fixed));
        assert!(
            matches!(r, Err(SwapError::Incompatible("another kind of device"))),
            "{r:?}"
        );
        assert_eq!(
            handed.load(Ordering::SeqCst),
            0,
            "a refused swap handed over"
        );
        // Positive control: a fitting successor from the device's own factory is handed the
        // state, once.
        let plan = s.prepare_swap().expect("swappable");
        let next = (plan.successor)(s.context().clone()).expect("successor");
        let _parked = plan.quiesce.park();
        s.swap(next).expect("swap");
        assert_eq!(handed.load(Ordering::SeqCst), 1);
        // The new device is in the slot; one that cannot be swapped says so.
        let fixed = Fixed(Counted::new(0x1000, true, &handed).desc.clone());
        s.lock().device = Box::new(fixed);
        assert!(matches!(s.prepare_swap(), Err(SwapError::NotSwappable)));
    }
}
