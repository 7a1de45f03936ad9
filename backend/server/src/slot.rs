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
//! [`HandOver::check_successor`]); only then does [`HandOver::hand_over`] commit. A refused
//! swap has run nothing on the successor and leaves the old device serving.

use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use switchyard_device::{DeviceContext, DeviceDescription, HandOver, PciDevice};
use switchyard_proto::MigState;

use crate::Slot;

/// Why a swap was refused. The old device keeps serving.
#[derive(Debug, thiserror::Error)]
pub enum SwapError {
    /// A migration is in progress.
    #[error("Cannot swap the device during a migration (state {0:?})")]
    Migrating(MigState),
    /// The new device does not look like the old one to the client.
    #[error("The new device differs from the old one: {0}")]
    Incompatible(&'static str),
    /// Handing the state over to the new device failed.
    #[error("Cannot hand the device state over")]
    HandOver(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// The outcome of a swap.
pub struct SwapReport<D> {
    /// How long the slot was locked: the longest a region access can have waited.
    pub held: Duration,
    /// The device that was replaced; dropping it (joining its threads) is left to the caller,
    /// outside the lock.
    pub old: D,
}

impl<D> std::fmt::Debug for SwapReport<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SwapReport")
            .field("held", &self.held)
            .finish_non_exhaustive()
    }
}

/// A shared handle on the server's device.
pub struct DeviceSlot<D> {
    inner: Arc<Mutex<Slot<D>>>,
    ctx: DeviceContext,
}

impl<D> Clone for DeviceSlot<D> {
    fn clone(&self) -> Self {
        Self {
            inner: self.inner.clone(),
            ctx: self.ctx.clone(),
        }
    }
}

impl<D> std::fmt::Debug for DeviceSlot<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceSlot").finish_non_exhaustive()
    }
}

impl<D: PciDevice> DeviceSlot<D> {
    pub(crate) fn new(inner: Arc<Mutex<Slot<D>>>, ctx: DeviceContext) -> Self {
        Self { inner, ctx }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, Slot<D>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` on the device; requests from the client wait meanwhile.
    pub fn with<R>(&self, f: impl FnOnce(&mut D) -> R) -> R {
        f(&mut self.lock().device)
    }

    /// The DMA windows and interrupt routing the device is lent.
    pub fn context(&self) -> &DeviceContext {
        &self.ctx
    }
}

impl<D: HandOver> DeviceSlot<D> {
    /// Replaces the device with `next`, a successor built beforehand on [`Self::context`]
    /// (parked until it has the state; e.g. `SoftGpu::successor`). Requests wait for the
    /// duration. Refused while a migration is in progress, and when `next` would look
    /// different to the client (regions, interrupts, mmapped memory objects, whatever
    /// [`HandOver::check_successor`] says); those checks come first, so a refused swap has
    /// run nothing on `next` (dropped after the slot is released) and the old device stays.
    /// Then [`HandOver::hand_over`] moves the state; if it fails, the old device stays too.
    pub fn swap(&self, mut next: D) -> Result<SwapReport<D>, SwapError> {
        let mut slot = self.lock();
        let t0 = Instant::now();
        let committed = if slot.mig != MigState::Running {
            Err(SwapError::Migrating(slot.mig))
        } else {
            same_shape(slot.device.description(), next.description())
                .and_then(|()| {
                    slot.device
                        .check_successor(&next)
                        .map_err(SwapError::Incompatible)
                })
                .and_then(|()| {
                    slot.device
                        .hand_over(&mut next)
                        .map_err(|e| SwapError::HandOver(Box::new(e)))
                })
        };
        if let Err(e) = committed {
            drop(slot);
            drop(next);
            return Err(e);
        }
        let old = std::mem::replace(&mut slot.device, next);
        let held = t0.elapsed();
        drop(slot);
        tracing::debug!(held_us = held.as_micros() as u64, "device swapped");
        Ok(SwapReport { held, old })
    }
}

/// Checks that `b` presents itself to the client exactly as `a` does.
fn same_shape(a: &DeviceDescription, b: &DeviceDescription) -> Result<(), SwapError> {
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
                    || ident(&ma.file).is_none()
                    || ident(&ma.file) != ident(&mb.file)
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

    use switchyard_device::{DmaSpace, Interrupts, RegionDesc, WaitControl};

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

    impl HandOver for Counted {
        type Error = std::io::Error;
        fn check_successor(&self, next: &Self) -> Result<(), &'static str> {
            if next.fits {
                Ok(())
            } else {
                Err("does not fit")
            }
        }
        fn hand_over(&mut self, _next: &mut Self) -> Result<(), std::io::Error> {
            self.handed.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
    }

    fn slot(handed: &Arc<AtomicU32>) -> DeviceSlot<Counted> {
        let ctx = DeviceContext {
            dma: Arc::new(DmaSpace::new(4)),
            irqs: Arc::new(Interrupts::new(&[0, 0, 0, 0, 0])),
            waits: Arc::new(WaitControl::default()),
        };
        let inner = Slot {
            device: Counted::new(0x1000, true, handed),
            mig: MigState::Running,
        };
        DeviceSlot::new(Arc::new(Mutex::new(inner)), ctx)
    }

    #[test]
    fn a_refused_swap_never_starts_the_hand_over() {
        let handed = Arc::new(AtomicU32::new(0));
        let s = slot(&handed);
        let r = s.swap(Counted::new(0x2000, true, &handed));
        assert!(matches!(r, Err(SwapError::Incompatible(_))), "{r:?}");
        let r = s.swap(Counted::new(0x1000, false, &handed));
        assert!(
            matches!(r, Err(SwapError::Incompatible("does not fit"))),
            "{r:?}"
        );
        s.lock().mig = MigState::Stop;
        let r = s.swap(Counted::new(0x1000, true, &handed));
        assert!(matches!(r, Err(SwapError::Migrating(_))), "{r:?}");
        assert_eq!(
            handed.load(Ordering::SeqCst),
            0,
            "a refused swap handed over"
        );
        // Positive control: a fitting successor is handed the state, once.
        s.lock().mig = MigState::Running;
        s.swap(Counted::new(0x1000, true, &handed)).expect("swap");
        assert_eq!(handed.load(Ordering::SeqCst), 1);
    }
}
