//! What the downtime cases share: swapping the softgpu under a connected client (what a pool
//! daemon does, [`crate::swap`]), migrating it between two servers over vfio-user migration v2
//! (what a VMM does, [`crate::migration`]) and moving it onto a new VRAM ([`crate::moves`]):
//! VRAM sizes and contents, medians, and a stoppable helper thread. The swap and migration
//! cases measure their floor in the same run: a memcpy of the device state (swap) or of the
//! bytes moved while the device was down (migration).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use switchyard_client::Client;
use switchyard_server::DeviceSlot;
use switchyard_softgpu::{BAR_VRAM, SoftGpu, SoftGpuConfig};

use crate::cases::Settings;
use crate::gpu::QUEUES;
use crate::stats::ns;

pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;
pub(crate) const PAGE: u64 = 4096;

/// VRAM sizes of both cases.
pub(crate) fn vram_sizes(s: &Settings) -> &'static [u64] {
    if s.quick {
        &[64 * MIB]
    } else {
        &[64 * MIB, 256 * MIB, GIB]
    }
}

/// `vram=<size>,queues=2`.
pub(crate) fn gpu_config(vram: u64) -> SoftGpuConfig {
    SoftGpuConfig {
        vram_size: vram,
        queues: QUEUES,
        ..SoftGpuConfig::default()
    }
}

/// The server's VRAM memfd (also when the device does not offer it for mmap).
pub(crate) fn slot_vram(slot: &DeviceSlot) -> Result<File> {
    slot.with_as(|d: &mut SoftGpu| d.vram_file().try_clone())
        .context("the device is not a softgpu")?
        .context("dup the VRAM fd")
}

/// How long a check waits for progress (a correctness limit, not a timing).
pub(crate) const PROGRESS_TIMEOUT: Duration = Duration::from_secs(20);

/// The fd of BAR2 (VRAM) from REGION_INFO.
pub(crate) fn vram_fd(c: &mut Client) -> Result<File> {
    c.region_info(BAR_VRAM)
        .context("REGION_INFO of BAR2")?
        .fd
        .context("BAR2 came without an mmap fd")
}

/// Fills the first `size` bytes of `f` with xorshift words (never zero, so every page is data
/// and none is a hole).
pub(crate) fn fill_random(f: &File, size: u64, seed: u64) -> Result<()> {
    let mut buf = vec![0u8; MIB as usize];
    let mut x = seed | 1;
    let mut off = 0;
    while off < size {
        for w in buf.chunks_exact_mut(8) {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            w.copy_from_slice(&x.to_le_bytes());
        }
        let len = usize::try_from((size - off).min(MIB))?;
        f.write_all_at(&buf[..len], off)
            .with_context(|| format!("write VRAM at {off:#x}"))?;
        off += MIB;
    }
    Ok(())
}

/// The first offset at which the first `size` bytes of `a` and `b` differ.
pub(crate) fn first_difference(a: &File, b: &File, size: u64) -> Result<Option<u64>> {
    let mut ba = vec![0u8; MIB as usize];
    let mut bb = vec![0u8; MIB as usize];
    let mut off = 0;
    while off < size {
        let len = usize::try_from((size - off).min(MIB))?;
        a.read_exact_at(&mut ba[..len], off).context("read VRAM")?;
        b.read_exact_at(&mut bb[..len], off).context("read VRAM")?;
        if ba[..len] != bb[..len] {
            let i = ba.iter().zip(&bb).position(|(x, y)| x != y).unwrap_or(0);
            return Ok(Some(off + i as u64));
        }
        off += MIB;
    }
    Ok(None)
}

pub(crate) fn median(v: &[u64]) -> u64 {
    let mut s = v.to_vec();
    s.sort_unstable();
    s.get(s.len().saturating_sub(1) / 2).copied().unwrap_or(0)
}

pub(crate) fn median_ms(v: &[Duration]) -> f64 {
    median(&v.iter().map(|&d| ns(d)).collect::<Vec<_>>()) as f64 / 1e6
}

pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

/// A helper thread that runs until told to stop (its closure polls the flag it is given):
/// the VRAM dirtier here, the move case's writer. Stopped and joined when dropped.
#[derive(Debug)]
pub(crate) struct Stoppable<T> {
    what: &'static str,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<T>>>,
}

impl<T: Send + 'static> Stoppable<T> {
    /// Runs `f` on a thread named `name`; `what` names it in errors.
    pub(crate) fn spawn(
        name: &str,
        what: &'static str,
        f: impl FnOnce(&AtomicBool) -> Result<T> + Send + 'static,
    ) -> Result<Stoppable<T>> {
        let stop = Arc::new(AtomicBool::new(false));
        let st = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || f(&st))
            .with_context(|| format!("spawn {what}"))?;
        Ok(Stoppable {
            what,
            stop,
            thread: Some(thread),
        })
    }

    /// Fails with the thread's error if it ended before being stopped.
    pub(crate) fn check_alive(&mut self) -> Result<()> {
        if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
            self.stop()?;
            bail!("{} stopped", self.what);
        }
        Ok(())
    }

    /// Stops the thread and returns what it returned.
    pub(crate) fn stop(&mut self) -> Result<T> {
        self.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .with_context(|| format!("{} was already stopped", self.what))?
            .join()
            .map_err(|_| anyhow!("{} panicked", self.what))?
    }
}

impl<T> Drop for Stoppable<T> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
