//! VRAM's GPU copy kept in step with the memfd: stale chunks, their uploads (in flight while
//! they run), and batches run to the end or declined whole.

use std::sync::atomic::Ordering;

use super::{CHUNK, CudaDevice, Place, Plan, Queue, RESUME_TRIES, Skip};
use crate::gpu::{Gpu, GpuError, Mem, Op};

impl<G: Gpu> CudaDevice<G> {
    /// Marks the chunks of `[off, off+len)` stale.
    pub(super) fn invalidate(&self, off: u64, len: u64) {
        let end = off.saturating_add(len).min(self.vram_size);
        if len == 0 || off >= end {
            return;
        }
        for c in off / CHUNK..=(end - 1) / CHUNK {
            if let Some(w) = self.stale.get((c / 64) as usize) {
                w.fetch_or(1 << (c % 64), Ordering::AcqRel);
            }
        }
    }

    /// The chunks of `[off, off+len)`.
    fn chunks(&self, off: u64, len: u64) -> std::ops::Range<u64> {
        let end = off.saturating_add(len).min(self.vram_size);
        if len == 0 || off >= end {
            return 0..0;
        }
        off / CHUNK..(end - 1) / CHUNK + 1
    }

    /// Takes the stale chunks of the command's VRAM operands (`(offset, length, read)`),
    /// clearing their stale bits: those to upload are marked in flight and returned; those an
    /// output covers whole need none (the command writes them, and through to the memfd).
    /// Waits first while another command uploads any of them.
    fn take_uploads(&self, ranges: &[(u64, u64, bool)]) -> Vec<u64> {
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        let mut waited = false;
        while ranges.iter().any(|&(off, len, _)| {
            self.chunks(off, len)
                .any(|c| in_flight[(c / 64) as usize] & (1 << (c % 64)) != 0)
        }) {
            if !waited {
                waited = true;
                self.stats.upload_waits.fetch_add(1, Ordering::Relaxed);
            }
            in_flight = self
                .in_flight_cv
                .wait(in_flight)
                .unwrap_or_else(|p| p.into_inner());
        }
        let mut uploads = Vec::new();
        for &(off, len, read) in ranges {
            let end = off.saturating_add(len);
            for c in self.chunks(off, len) {
                let (word, bit) = ((c / 64) as usize, 1u64 << (c % 64));
                if self.stale[word].fetch_and(!bit, Ordering::AcqRel) & bit == 0 {
                    continue;
                }
                let whole = c * CHUNK >= off && (c + 1) * CHUNK <= end;
                if read || !whole {
                    in_flight[word] |= bit;
                    uploads.push(c);
                }
            }
        }
        uploads.sort_unstable();
        uploads.dedup();
        uploads
    }

    /// Uploads the stale chunks the command's VRAM operands touch, in a batch of their own,
    /// before the command's: a chunk is in flight only while its copy runs.
    pub(super) fn upload(
        &self,
        plan: &Plan,
        places: &[Place],
        queue: &Queue<G>,
    ) -> Result<(), Skip> {
        let ranges: Vec<(u64, u64, bool)> = plan
            .operands
            .iter()
            .zip(places)
            .filter_map(|(&(_, len, read), place)| match *place {
                Place::Vram(off) => Some((off, len, read)),
                Place::Guest { .. } => None,
            })
            .collect();
        let uploads = self.take_uploads(&ranges);
        if uploads.is_empty() {
            return Ok(());
        }
        let result = self.upload_batch(&uploads, queue);
        let mut in_flight = self.in_flight.lock().unwrap_or_else(|p| p.into_inner());
        for &c in &uploads {
            in_flight[(c / 64) as usize] &= !(1 << (c % 64));
        }
        if result.is_err() {
            // The command does not run: stale again, the chunks it would have written whole
            // (taken without an upload) as well as those it uploaded.
            for &(off, len, _) in &ranges {
                self.invalidate(off, len);
            }
        } else {
            self.stats
                .uploads
                .fetch_add(uploads.len() as u64, Ordering::Relaxed);
        }
        drop(in_flight);
        self.in_flight_cv.notify_all();
        result.map_err(Skip::from)
    }

    /// Copies the chunks `uploads` (sorted) from the memfd to the GPU copy, adjacent ones in
    /// one copy.
    fn upload_batch(&self, uploads: &[u64], queue: &Queue<G>) -> Result<(), GpuError> {
        let too_big = |_| GpuError::transient("an offset beyond the address space");
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for &c in uploads {
            match runs.last_mut() {
                Some((_, end)) if *end == c => *end += 1,
                _ => runs.push((c, c + 1)),
            }
        }
        let mut ops: Vec<Op<'_, G>> = Vec::with_capacity(runs.len());
        for (first, end) in runs {
            let off = usize::try_from(first * CHUNK).map_err(too_big)?;
            let len = usize::try_from((end * CHUNK).min(self.vram_size) - first * CHUNK)
                .map_err(too_big)?;
            ops.push(Op::Copy {
                dst: Mem::Dev(&self.vram_dev, off),
                src: Mem::Host(&self.vram_host, off),
                len,
            });
        }
        self.gpu.run(&queue.stream, &ops)
    }

    /// Runs `ops` on `stream`. A transient error that stopped the batch after a write-back
    /// ran (its output partly written: the CPU path must not run the command again) resumes
    /// it where it stopped, at most [`RESUME_TRIES`] times; then, or when how far it got is
    /// unknown, the board is lost. A transient error before any write-back is returned: the
    /// CPU path runs the command on what is still untouched.
    pub(super) fn run_batch(&self, stream: &G::Stream, ops: &[Op<'_, G>]) -> Result<(), GpuError> {
        let written = |upto: usize| {
            ops.iter()
                .take(upto)
                .any(|op| matches!(op, Op::WriteBack { .. }))
        };
        let mut from = 0;
        let mut tries = 0;
        loop {
            let e = match self.gpu.run(stream, &ops[from..]) {
                Ok(()) => return Ok(()),
                Err(e) if e.sticky => return Err(e),
                Err(e) => e,
            };
            let Some(k) = e.ran else {
                if !written(ops.len()) {
                    return Err(e);
                }
                return Err(GpuError::sticky(format!(
                    "{}; the batch stopped with its output partly written, and how far it got \
                     is unknown",
                    e.message
                )));
            };
            let upto = from.saturating_add(k).min(ops.len());
            if !written(upto) {
                return Err(e.after(Some(upto)));
            }
            tries += 1;
            if tries > RESUME_TRIES {
                return Err(GpuError::sticky(format!(
                    "{}; the batch stopped {tries} times with its output partly written",
                    e.message
                )));
            }
            tracing::debug!(error = %e.message, at = upto, "resuming a batch stopped by a transient error");
            self.stats.resumed.fetch_add(1, Ordering::Relaxed);
            from = upto;
        }
    }
}
