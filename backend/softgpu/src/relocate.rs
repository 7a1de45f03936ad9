//! Moving a running device onto another VRAM (a pool's move to another board), without the
//! client noticing: pre-copy while the device runs, then a short stop.
//!
//! Only a device whose VRAM the client cannot map (`vram_mmap=off`) can move this way: every
//! write to its VRAM goes through the device and is logged ([`Vram::mark`]), so the copy
//! knows what changed behind it. (A client mapping cannot be re-pointed: nothing in the
//! protocol revokes it, so a mapped device moves with the VMM's help instead.)
//!
//! 1. [`SoftGpu::begin_relocation`] clears the write log, and the first
//!    [`Relocation::round`] copies every data extent of the source VRAM (`SEEK_DATA`; holes
//!    are zero on the fresh target and cost nothing). Later rounds copy only the pages
//!    logged since the previous round. The device keeps running meanwhile: a page written
//!    during a round is logged after its write and copied again by the next one.
//! 2. [`SoftGpu::relocated`] builds the successor on the target VRAM, parked.
//! 3. The server's swap (`DeviceSlot::swap`) hands the state over: with the old engines
//!    parked and region accesses waiting for the slot, [`SoftGpu::hand_over_to`] copies the
//!    pages logged since the last round, loads the state into the successor (pointing it at
//!    the target VRAM) and makes the target the slot's VRAM object. The stop therefore lasts
//!    as long as copying what the last round left, whatever the VRAM size.
//!
//! A relocation that is dropped before the swap leaves the source untouched (its write log
//! is simply no longer read).

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant};

use switchyard_device::MemoryObjects;

use crate::mig::PAGE;
use crate::recover::check_sealed;
use crate::vram::Vram;
use crate::{Migration, SoftGpu, SoftGpuError, StateError, VRAM_OBJECT};

/// What a relocation copied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelocationStats {
    /// Pre-copy rounds run (the first reads every data extent).
    pub rounds: u32,
    /// Bytes copied by all rounds, the final one included.
    pub bytes: u64,
    /// Bytes copied by the last pre-copy round (what the final round had to beat).
    pub last_round_bytes: u64,
    /// Bytes copied by the final round, with the device stopped.
    pub final_bytes: u64,
    /// How long the final round took.
    pub final_copy: Duration,
}

/// A copy of a running device's VRAM onto another VRAM ([`SoftGpu::begin_relocation`]): the
/// first round copies every data extent, later rounds the pages the device logged as written
/// since; the swap to [`SoftGpu::relocated`]'s successor copies the last ones.
pub struct Relocation {
    source: Arc<Vram>,
    target: Arc<Vram>,
    stats: RelocationStats,
    /// No client is connected (a device whose guest may map VRAM, moved while unplugged).
    detached: bool,
}

impl std::fmt::Debug for Relocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Relocation")
            .field("source", &self.source.identity())
            .field("target", &self.target.identity())
            .field("stats", &self.stats)
            .finish()
    }
}

impl SoftGpu {
    /// Starts moving this device onto `target`: a new VRAM memfd of the same size, zeroed,
    /// sealed against shrinking and growing (e.g. [`SoftGpu::create_vram`]). Refused when the
    /// client may map VRAM (`vram_mmap=on`: its writes would not be seen), while a migration
    /// stream is open (it reads the same write log), and when `target` is unsuitable.
    pub fn begin_relocation(&self, target: File) -> Result<Relocation, SoftGpuError> {
        self.relocation(target, false)
    }

    /// [`SoftGpu::begin_relocation`] of a device no client is connected to, whatever its
    /// `vram_mmap` (nothing can write its VRAM behind it): for a guest-visible move, while
    /// the VMM has unplugged the device. The server's `DeviceSlot::swap_detached` refuses the
    /// final swap if a client connected meanwhile.
    pub fn begin_detached_relocation(&self, target: File) -> Result<Relocation, SoftGpuError> {
        self.relocation(target, true)
    }

    fn relocation(&self, target: File, detached: bool) -> Result<Relocation, SoftGpuError> {
        let source = self.shared.vram.clone();
        source.check().map_err(SoftGpuError::VramFailed)?;
        if !source.tracked() && !detached {
            return Err(StateError::Inconsistent(
                "the client may map this device's VRAM (vram_mmap=on): its writes cannot be followed",
            )
            .into());
        }
        if !matches!(self.migration, Migration::Idle) {
            return Err(StateError::Inconsistent("a migration stream is open").into());
        }
        check_sealed(&target)?;
        let target = Arc::new(Vram::adopt(
            Arc::new(target),
            source.size(),
            source.tracked(),
        )?);
        if target.identity() == source.identity() {
            return Err(StateError::Inconsistent("the target VRAM is the device's own").into());
        }
        // From here on the log holds what changed since the first round started.
        for w in 0..source.written_words() {
            source.take_written(w);
        }
        Ok(Relocation {
            source,
            target,
            stats: RelocationStats::default(),
            detached,
        })
    }

    /// The successor of a device being relocated: a softgpu of `config` on the relocation's
    /// target VRAM, lent `ctx` (the slot's context), parked until the swap hands it the old
    /// device's state (which also copies the pages written since the last round).
    pub fn relocated(
        config: crate::SoftGpuConfig,
        ctx: switchyard_device::DeviceContext,
        relocation: Relocation,
    ) -> Result<SoftGpu, SoftGpuError> {
        config.validate()?;
        if (config.vram_mmap && !relocation.detached)
            || config.vram_mmap == relocation.target.tracked()
            || relocation.target.size() != config.vram_size
        {
            return Err(StateError::Inconsistent(
                "the relocation's VRAM is of another configuration",
            )
            .into());
        }
        let memory = ctx.memory.clone();
        let holds = crate::Holds {
            successor: true,
            ..crate::Holds::default()
        };
        let target = relocation.target.clone();
        let mut gpu = Self::start(config, ctx, target, holds)?;
        gpu.incoming = Some(Incoming { relocation, memory });
        Ok(gpu)
    }

    /// One more pre-copy round of the relocation this parked successor will finish (`0`
    /// if it has none): run it after building the successor, so that what was written
    /// meanwhile is not left to the stop.
    pub fn relocation_round(&mut self) -> Result<u64, SoftGpuError> {
        match &mut self.incoming {
            Some(incoming) => incoming.relocation.round(),
            None => Ok(0),
        }
    }

    /// What the relocation that brought this device onto its VRAM copied, once the swap
    /// completed it (`None` for a device that was not relocated).
    pub fn relocation_stats(&self) -> Option<RelocationStats> {
        self.relocated
    }
}

/// A successor's pending relocation: finished by the hand-over.
pub(crate) struct Incoming {
    pub(crate) relocation: Relocation,
    /// The slot's memory objects: the target becomes its VRAM object.
    pub(crate) memory: Arc<MemoryObjects>,
}

impl std::fmt::Debug for Incoming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.relocation.fmt(f)
    }
}

impl Incoming {
    /// The final round, with the source stopped; then the target is the slot's VRAM.
    pub(crate) fn finish(mut self) -> Result<RelocationStats, SoftGpuError> {
        let t0 = Instant::now();
        self.relocation
            .source
            .check()
            .map_err(SoftGpuError::VramFailed)?;
        let n = self.relocation.copy_logged()?;
        let stats = &mut self.relocation.stats;
        stats.final_bytes = n;
        stats.bytes += n;
        stats.final_copy = t0.elapsed();
        self.memory
            .insert(VRAM_OBJECT, self.relocation.target.clone());
        Ok(self.relocation.stats)
    }
}

impl Relocation {
    /// Runs one pre-copy round while the device runs and returns the bytes it copied: the
    /// first round every data extent, later rounds the pages written since the previous one.
    pub fn round(&mut self) -> Result<u64, SoftGpuError> {
        self.source.check().map_err(SoftGpuError::VramFailed)?;
        let n = if self.stats.rounds == 0 {
            self.copy_extents()?
        } else {
            self.copy_logged()?
        };
        self.stats.rounds += 1;
        self.stats.bytes += n;
        self.stats.last_round_bytes = n;
        Ok(n)
    }

    /// Identity of the VRAM being copied from.
    pub fn source_identity(&self) -> crate::VramRef {
        self.source.identity()
    }

    /// Identity of the VRAM being copied to.
    pub fn target_identity(&self) -> crate::VramRef {
        self.target.identity()
    }

    /// What has been copied so far.
    pub fn stats(&self) -> RelocationStats {
        self.stats
    }

    /// Copies every data extent of the source (holes are zero on both sides).
    fn copy_extents(&self) -> Result<u64, SoftGpuError> {
        use rustix::fs::{SeekFrom, seek};
        let size = self.source.size();
        let file = self.source.file();
        let mut off = 0u64;
        let mut copied = 0u64;
        while off < size {
            let data = match seek(&**file, SeekFrom::Data(off)) {
                Ok(d) => d,
                Err(rustix::io::Errno::NXIO) => break,
                // A backing without SEEK_DATA: everything is data.
                Err(_) => off,
            };
            if data >= size {
                break;
            }
            let start = data / PAGE * PAGE;
            let end = seek(&**file, SeekFrom::Hole(data))
                .unwrap_or(size)
                .div_ceil(PAGE)
                .saturating_mul(PAGE)
                .min(size);
            let end = end.max(start + PAGE).min(size);
            self.copy(start, end - start)?;
            copied += end - start;
            off = end;
        }
        Ok(copied)
    }

    /// Copies the pages logged since the log was last taken, in runs.
    fn copy_logged(&self) -> Result<u64, SoftGpuError> {
        let pages = self.source.size() / PAGE;
        let mut copied = 0u64;
        let mut run: Option<(u64, u64)> = None;
        for w in 0..self.source.written_words() {
            let mut bits = self.source.take_written(w);
            while bits != 0 {
                let page = w as u64 * 64 + u64::from(bits.trailing_zeros());
                bits &= bits - 1;
                if page >= pages {
                    break;
                }
                run = match run {
                    Some((a, b)) if b == page => Some((a, page + 1)),
                    Some((a, b)) => {
                        self.copy(a * PAGE, (b - a) * PAGE)?;
                        copied += (b - a) * PAGE;
                        Some((page, page + 1))
                    }
                    None => Some((page, page + 1)),
                };
            }
        }
        if let Some((a, b)) = run {
            self.copy(a * PAGE, (b - a) * PAGE)?;
            copied += (b - a) * PAGE;
        }
        Ok(copied)
    }

    /// Copies `[offset, offset + len)` from the source to the target VRAM.
    fn copy(&self, offset: u64, len: u64) -> Result<(), SoftGpuError> {
        self.source.check().map_err(SoftGpuError::VramFailed)?;
        self.target.check().map_err(SoftGpuError::VramFailed)?;
        let bad = || StateError::Inconsistent("a relocation copy fell outside VRAM");
        let src = self.source.slice(offset, len).ok_or_else(bad)?;
        let dst = self.target.slice(offset, len).ok_or_else(bad)?;
        src.copy_to_volatile_slice(dst);
        Ok(())
    }
}
