//! The device slot: where the server keeps its device, and how another thread swaps it.
//!
//! A swap replaces the backing device under a connected client. The client's DMA windows and
//! interrupt eventfds stay where they are (the server owns them in the [`DeviceContext`]) and
//! are lent to the new device; a region access that arrives during the swap waits for the
//! slot's lock, so the guest vCPU simply stalls for the swap's duration and then talks to the
//! new device. Regions the client has mmapped cannot be re-pointed, so the new device must
//! present the same memory objects ([`DeviceSlot::swap`] checks that).

use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use switchyard_device::{DeviceContext, DeviceDescription, PciDevice};
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
    /// Building the new device failed.
    #[error("Cannot build the new device")]
    Build(#[source] Box<dyn std::error::Error + Send + Sync>),
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

    /// Replaces the device with the one `build` makes from the old device and the server's
    /// context (typically: save the old device's state, create a device on the same memory
    /// objects, load the state). Requests wait for the duration. Refused while a migration
    /// is in progress, and when the new device would look different to the client (regions,
    /// interrupts, mmapped memory objects); then the old device stays.
    pub fn swap<E>(
        &self,
        build: impl FnOnce(&mut D, DeviceContext) -> Result<D, E>,
    ) -> Result<SwapReport<D>, SwapError>
    where
        E: std::error::Error + Send + Sync + 'static,
    {
        let mut slot = self.lock();
        let t0 = Instant::now();
        if slot.mig != MigState::Running {
            return Err(SwapError::Migrating(slot.mig));
        }
        let new =
            build(&mut slot.device, self.ctx.clone()).map_err(|e| SwapError::Build(Box::new(e)))?;
        same_shape(slot.device.description(), new.description())?;
        let old = std::mem::replace(&mut slot.device, new);
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
