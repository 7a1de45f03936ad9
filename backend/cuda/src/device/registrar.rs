//! The DMA observer of a device: windows registered as the client maps them, unregistered
//! (waiting a bounded time for the commands using them) as it unmaps them.

use std::fs::File;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use switchyard_device::{DeviceError, DmaObserver, DmaProt};

use super::CudaDevice;
use crate::gpu::Gpu;

/// The DMA observer of a [`CudaDevice`]: registers windows as the client maps them.
pub(super) struct Registrar<G: Gpu>(pub(super) Weak<CudaDevice<G>>);

impl<G: Gpu> DmaObserver for Registrar<G> {
    fn mapping(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        file: Option<(&File, u64)>,
    ) -> Result<(), DeviceError> {
        // Never refused: a window the GPU cannot reach is served by the CPU path.
        if let Some(device) = self.0.upgrade() {
            device.register_window(iova, size, prot, file);
        }
        Ok(())
    }

    fn unmapped(&self, iova: u64, size: u64) {
        let Some(device) = self.0.upgrade() else {
            return;
        };
        device.unregister(iova, size);
    }
}

impl<G: Gpu> CudaDevice<G> {
    /// The client unmapped `[iova, iova+size)`: its windows are forgotten under a short lock
    /// (no new command finds them), then the commands still using them are waited for, with no
    /// lock held and at most the unmap wait; a registration is unregistered when the last
    /// command using it lets go (here, unless one is late).
    fn unregister(&self, iova: u64, size: u64) {
        let end = iova.saturating_add(size);
        let gone: Vec<Arc<G::Host>> = {
            let mut w = self.windows.write().unwrap_or_else(|p| p.into_inner());
            let starts: Vec<u64> = w
                .range(..end)
                .filter(|(start, win)| start.saturating_add(win.size) > iova)
                .map(|(start, _)| *start)
                .collect();
            starts
                .iter()
                .filter_map(|s| w.remove(s).and_then(|win| win.host))
                .collect()
        };
        if gone.is_empty() {
            return;
        }
        let wait = Duration::from_micros(self.unmap_wait_us.load(Ordering::Relaxed));
        let deadline = Instant::now().checked_add(wait);
        let mut released = self.released.lock().unwrap_or_else(|p| p.into_inner());
        while gone.iter().any(|h| Arc::strong_count(h) > 1) {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|l| l.is_zero()) {
                self.stats.late_unmaps.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    iova,
                    size,
                    wait_ms = wait.as_millis() as u64,
                    "a GPU command still uses an unmapped window: answered anyway, it is \
                     unregistered when the command ends"
                );
                break;
            }
            released = match left {
                Some(l) => {
                    self.released_cv
                        .wait_timeout(released, l)
                        .unwrap_or_else(|p| p.into_inner())
                        .0
                }
                None => self
                    .released_cv
                    .wait(released)
                    .unwrap_or_else(|p| p.into_inner()),
            };
        }
        drop(released);
        // Unregistered here, before the unmap is answered (unless a command is late).
        drop(gone);
    }
}
