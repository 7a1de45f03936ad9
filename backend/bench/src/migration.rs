//! Migration downtime: the softgpu migrated between two servers over vfio-user migration v2
//! (what a VMM does), stop-copy only and with pre-copy, against a memcpy of the bytes moved
//! while the device was down.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use switchyard_client::Client;
use switchyard_client::migrate::{Migration, PreCopyPlan};
use switchyard_proto::consts::{
    VFIO_DEVICE_STATE_RUNNING, VFIO_MIGRATION_PRE_COPY, VFIO_MIGRATION_STOP_COPY,
};
use switchyard_server::DeviceSlot;
use switchyard_softgpu::regs::SCRATCH;
use switchyard_softgpu::{BAR_VRAM, SoftGpuConfig};
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

use crate::cases::{Settings, fig, human, scattered_pages};
use crate::downtime::{
    MIB, PAGE, Stoppable, fill_random, first_difference, gpu_config, median, median_ms, mib,
    slot_vram, vram_fd, vram_sizes,
};
use crate::floors::Memcpy;
use crate::gpu::Gpu;
use crate::report::{Row, Unit};
use crate::servers::Switchyard;
use crate::stats::ns;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum MigMode {
    /// RUNNING → STOP_COPY, everything in the downtime.
    StopCopy,
    /// PRE_COPY rounds while the device runs and nothing writes VRAM.
    PreCopy,
    /// PRE_COPY rounds while a thread rewrites 10% of the VRAM pages.
    PreCopyDirty,
    /// `vram_mmap=off`: PRE_COPY rounds of the write log while nothing writes VRAM.
    TrappedPreCopy,
    /// `vram_mmap=off`: PRE_COPY rounds while a thread rewrites 10% of the VRAM pages through
    /// the device (trapped writes).
    TrappedPreCopyDirty,
}

impl MigMode {
    /// The modes of a device with mappable VRAM, then of one with trapped VRAM.
    const MAPPED: [MigMode; 3] = [MigMode::StopCopy, MigMode::PreCopy, MigMode::PreCopyDirty];
    const TRAPPED: [MigMode; 2] = [MigMode::TrappedPreCopy, MigMode::TrappedPreCopyDirty];

    fn op(self) -> &'static str {
        match self {
            MigMode::StopCopy => "mig-stop-copy",
            MigMode::PreCopy => "mig-pre-copy",
            MigMode::PreCopyDirty => "mig-pre-copy-dirty",
            MigMode::TrappedPreCopy => "mig-pre-copy-trapped",
            MigMode::TrappedPreCopyDirty => "mig-pre-copy-trapped-dirty",
        }
    }

    fn case(self) -> &'static str {
        match self {
            MigMode::StopCopy => "stop-copy only",
            MigMode::PreCopy | MigMode::PreCopyDirty => "pre-copy",
            MigMode::TrappedPreCopy | MigMode::TrappedPreCopyDirty => "pre-copy, vram_mmap=off",
        }
    }

    fn variant(self) -> &'static str {
        match self {
            MigMode::StopCopy | MigMode::PreCopy | MigMode::TrappedPreCopy => "idle",
            MigMode::PreCopyDirty | MigMode::TrappedPreCopyDirty => "10% of pages rewritten",
        }
    }

    fn dirty(self) -> bool {
        matches!(self, MigMode::PreCopyDirty | MigMode::TrappedPreCopyDirty)
    }

    fn trapped(self) -> bool {
        matches!(self, MigMode::TrappedPreCopy | MigMode::TrappedPreCopyDirty)
    }
}

/// Pre-copy ends after a round that moved less than 1 MiB, or after 5 rounds.
const PRECOPY: PreCopyPlan = PreCopyPlan {
    converged_below: MIB,
    max_rounds: 5,
};

/// One migration's figures.
#[derive(Debug, Default, Clone, Copy)]
struct MigRun {
    /// Source `set_mig_state(STOP_COPY)` called → destination `set_mig_state(RUNNING)`
    /// returned.
    downtime: Duration,
    /// MIG_DATA bytes moved during the downtime.
    downtime_bytes: u64,
    /// MIG_DATA bytes moved in all.
    total_bytes: u64,
    /// PRE_COPY rounds.
    rounds: u32,
    /// Bytes of the last PRE_COPY round.
    last_round_bytes: u64,
    /// In the downtime: the source's transition to STOP_COPY.
    to_stop_copy: Duration,
    /// In the downtime: MIG_DATA_READ round trips to the source.
    reads: Duration,
    /// In the downtime: MIG_DATA_WRITE round trips to the destination.
    writes: Duration,
    /// In the downtime: the destination's RESUMING → RUNNING.
    resume: Duration,
    /// The whole migration (first PRE_COPY or STOP_COPY → destination running).
    total: Duration,
    /// Passes of the dirtying thread over its pages.
    passes: u64,
    /// The longest MIG_DATA_READ while the device ran (PRE_COPY): what a guest's register
    /// access could have waited behind on the shared connection.
    precopy_read_max: Duration,
}

/// How the dirtier writes a VRAM page: through the mapping (a guest writing its BAR mapping,
/// unseen by the server) or through the device (a trapped BAR2 write, logged).
#[derive(Clone)]
enum VramWriter {
    Mapped(Arc<MmapRegion<()>>),
    Trapped(DeviceSlot),
}

impl VramWriter {
    fn write(&self, offset: u64, data: &[u8]) -> Result<()> {
        match self {
            VramWriter::Mapped(map) => {
                map.get_slice(usize::try_from(offset)?, data.len())?
                    .write_slice(data, 0)?;
            }
            VramWriter::Trapped(slot) => {
                slot.with(|d| d.region_write(BAR_VRAM, offset, data))
                    .context("trapped VRAM write")?;
            }
        }
        Ok(())
    }
}

/// Rewrites `hot` pages of VRAM with new data, pass after pass, until stopped.
fn dirty_loop(map: &VramWriter, hot: &[u64], stop: &AtomicBool, seed: u64) -> Result<u64> {
    let mut page = vec![0u8; PAGE as usize];
    let mut passes = 0u64;
    let mut generation = seed;
    loop {
        generation += 1;
        for (i, &p) in hot.iter().enumerate() {
            if i % 256 == 0 && stop.load(Ordering::Relaxed) {
                return Ok(passes);
            }
            let mut x = generation.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ p;
            for w in page.chunks_exact_mut(8) {
                x = x
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                w.copy_from_slice(&(x | 1).to_le_bytes());
            }
            map.write(p * PAGE, &page)?;
        }
        passes += 1;
    }
}

/// A thread rewriting 10% of the source's VRAM pages, through its mapping (as a guest does,
/// unseen by the server) or through the device; stopping it (as a VMM stops the vCPUs)
/// returns its passes.
fn start_dirtier(map: VramWriter, hot: Arc<Vec<u64>>, seed: u64) -> Result<Stoppable<u64>> {
    Stoppable::spawn("vram-dirtier", "the VRAM dirtier", move |stop| {
        dirty_loop(&map, &hot, stop, seed)
    })
}

/// The source, the destination and what a migration between them needs.
struct MigPair {
    src: Gpu,
    dst: Client,
    src_vram: File,
    dst_vram: File,
    /// How the dirtier writes the source's VRAM.
    src_writer: VramWriter,
    /// The pages the dirtier rewrites.
    hot: Arc<Vec<u64>>,
    size: u64,
}

impl std::fmt::Debug for MigPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MigPair")
            .field("size", &self.size)
            .finish_non_exhaustive()
    }
}

impl MigPair {
    /// One migration source → destination in `mode` through [`Migration`]; the destination
    /// is put into RESUMING first (outside the downtime; that zeroes its VRAM).
    fn migrate(&mut self, mode: MigMode, seed: u64) -> Result<MigRun> {
        let mut run = MigRun::default();
        let mut mig = Migration::new(&mut self.src.client, &mut self.dst);
        mig.prepare_destination()?;
        let start = Instant::now();
        if mode != MigMode::StopCopy {
            let dirtier = if mode.dirty() {
                Some(start_dirtier(
                    self.src_writer.clone(),
                    Arc::clone(&self.hot),
                    seed,
                )?)
            } else {
                None
            };
            let rounds = mig.pre_copy(&PRECOPY)?;
            run.rounds = u32::try_from(rounds.len())?;
            run.total_bytes = rounds.iter().map(|r| r.bytes).sum();
            run.last_round_bytes = rounds.last().map_or(0, |r| r.bytes);
            run.precopy_read_max = rounds.iter().map(|r| r.read_max).max().unwrap_or_default();
            if let Some(mut d) = dirtier {
                run.passes = d.stop()?;
            }
        }
        let done = mig.switchover()?;
        run.total = start.elapsed();
        run.downtime = done.downtime;
        run.to_stop_copy = done.to_stop_copy;
        run.reads = done.stream.reads;
        run.writes = done.stream.writes;
        run.resume = done.resume;
        run.downtime_bytes = done.stream.bytes;
        run.total_bytes += done.stream.bytes;
        Ok(run)
    }

    /// Correctness, not timing: the destination's VRAM and SCRATCH equal the source's; then
    /// the source runs again (the next repetition migrates it again).
    fn verify_and_reset(&mut self, scratch: u32) -> Result<()> {
        if let Some(off) = first_difference(&self.src_vram, &self.dst_vram, self.size)? {
            bail!("destination VRAM differs from the source's at {off:#x}");
        }
        let mut b = [0u8; 4];
        self.dst
            .region_read(switchyard_softgpu::BAR_REGS, SCRATCH, &mut b)
            .context("read the destination's SCRATCH")?;
        let got = u32::from_le_bytes(b);
        if got != scratch {
            bail!("destination SCRATCH reads {got:#x}, the source had {scratch:#x}");
        }
        if self.dst.mig_state()? != VFIO_DEVICE_STATE_RUNNING {
            bail!("the destination is not RUNNING");
        }
        let got = self
            .src
            .client
            .set_mig_state(VFIO_DEVICE_STATE_RUNNING)
            .context("source STOP_COPY → RUNNING")?;
        if got != VFIO_DEVICE_STATE_RUNNING {
            bail!("source STOP_COPY → RUNNING: the device reports state {got}");
        }
        Ok(())
    }
}

/// Migration downtime: two softgpu servers (`vram=<size>,queues=2`), the source's VRAM full
/// of random data and its client set up like the other GPU cases; one orchestrator
/// ([`Migration`]) reads MIG_DATA from the source and writes it to the destination, as a VMM
/// does. Stop-copy only,
/// and pre-copy (rounds until one moves < 1 MiB, at most 5) idle and with a thread
/// rewriting 10% of the VRAM pages until just before STOP_COPY. Downtime: source →
/// STOP_COPY until the destination's RUNNING returns; floor: a single-thread memcpy of the
/// bytes moved in that time. Each migration is verified (VRAM and a register).
pub fn migration(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    for &size in vram_sizes(s) {
        migration_point(dir, s, size, &MigMode::MAPPED, rows)?;
        migration_point(dir, s, size, &MigMode::TRAPPED, rows)?;
    }
    Ok(())
}

/// The migrations of one VRAM size and VRAM access mode (all `modes` mapped or all trapped).
fn migration_point(
    dir: &Path,
    s: &Settings,
    size: u64,
    modes: &[MigMode],
    rows: &mut Vec<Row>,
) -> Result<()> {
    let reps = if s.quick { 1 } else { 5 };
    let trapped = modes.iter().any(|m| m.trapped());
    let config = SoftGpuConfig {
        vram_mmap: !trapped,
        ..gpu_config(size)
    };
    let tag = format!("{}m{}", size >> 20, if trapped { "-trapped" } else { "" });
    let (src_server, src_slot) = Switchyard::start_softgpu(dir, &format!("mig-src-{tag}"), config)?;
    let (dst_server, dst_slot) = Switchyard::start_softgpu(dir, &format!("mig-dst-{tag}"), config)?;
    let mut src = Gpu::setup(src_server.connect(s.stall_timeout())?, 0)?;
    let mut dst = dst_server.connect(s.stall_timeout())?;
    Migration::new(&mut src.client, &mut dst)
        .ensure_supported(VFIO_MIGRATION_STOP_COPY | VFIO_MIGRATION_PRE_COPY)?;
    let (src_vram, dst_vram) = if trapped {
        if src.client.region_info(BAR_VRAM)?.fd.is_some() {
            bail!("vram_mmap=off still offers VRAM for mmap");
        }
        (slot_vram(&src_slot)?, slot_vram(&dst_slot)?)
    } else {
        (vram_fd(&mut src.client)?, vram_fd(&mut dst)?)
    };
    // Written behind the device's back: the first round reads all of VRAM anyway.
    fill_random(&src_vram, size, size ^ 0x0de9)?;
    let src_writer = if trapped {
        VramWriter::Trapped(src_slot.clone())
    } else {
        VramWriter::Mapped(Arc::new(
            MmapRegion::<()>::from_file(
                FileOffset::new(src_vram.try_clone().context("dup the VRAM fd")?, 0),
                usize::try_from(size)?,
            )
            .context("mmap the source's VRAM")?,
        ))
    };
    let pages = size / PAGE;
    let hot = Arc::new(scattered_pages(pages, pages / 10, size ^ 0xd1e7));
    let mut pair = MigPair {
        src,
        dst,
        src_vram,
        dst_vram,
        src_writer,
        hot,
        size,
    };
    // Floor buffers: the downtime moves at most VRAM + record headers + the state.
    let mut memcpy = Memcpy::new(usize::try_from(size + 8 * MIB)?);
    let mut runs: Vec<Vec<MigRun>> = vec![Vec::new(); modes.len()];
    let mut floors: Vec<Vec<u64>> = vec![Vec::new(); modes.len()];
    // Context for the pre-copy rows (not a floor): a memcpy of the whole VRAM, which the
    // final round of a mapped device reads.
    let mut vram_copy = Vec::new();
    if !s.quick {
        // Warm-up, not recorded (still verified): the first migration to a destination
        // writes VRAM pages the machine has never backed (on a VM: host first-touch), up to
        // 3× slower than later ones.
        let scratch = 0x4d00_ff00;
        pair.src.w32(SCRATCH, scratch)?;
        pair.migrate(modes[0], 0)
            .and_then(|_| pair.verify_and_reset(scratch))
            .with_context(|| format!("{} VRAM, warm-up migration", human(size)))?;
    }
    for rep in 0..reps {
        for ((i, &mode), (runs, floor)) in modes
            .iter()
            .enumerate()
            .zip(runs.iter_mut().zip(floors.iter_mut()))
        {
            let scratch = 0x4d00_0000 | ((rep as u32) << 8) | i as u32;
            pair.src.w32(SCRATCH, scratch)?;
            let run = pair
                .migrate(mode, (rep * 8 + i) as u64)
                .with_context(|| format!("{} VRAM, {mode:?}, repetition {rep}", human(size)))?;
            pair.verify_and_reset(scratch)
                .with_context(|| format!("{} VRAM, {mode:?}, repetition {rep}", human(size)))?;
            for _ in 0..3 {
                floor.push(ns(memcpy.copy(usize::try_from(run.downtime_bytes)?)?));
            }
            runs.push(run);
        }
        vram_copy.push(memcpy.copy(usize::try_from(size)?)?);
    }
    drop(memcpy);
    drop(pair);
    src_server.shutdown()?;
    dst_server.shutdown()?;
    let vram_copy_ms = median_ms(&vram_copy);
    for ((&mode, runs), floor) in modes.iter().zip(&runs).zip(&mut floors) {
        mig_row(rows, size, mode, runs, floor, vram_copy_ms)?;
    }
    Ok(())
}

fn mig_row(
    rows: &mut Vec<Row>,
    size: u64,
    mode: MigMode,
    runs: &[MigRun],
    floor: &mut [u64],
    vram_copy_ms: f64,
) -> Result<()> {
    let pick = |f: fn(&MigRun) -> u64| median(&runs.iter().map(f).collect::<Vec<_>>());
    let pick_ms = |f: fn(&MigRun) -> Duration| median_ms(&runs.iter().map(f).collect::<Vec<_>>());
    let mut downtime: Vec<u64> = runs.iter().map(|r| ns(r.downtime)).collect();
    let downtime_bytes = pick(|r| r.downtime_bytes);
    let mut note = format!(
        "source {} → STOP_COPY called … destination RESUMING → RUNNING returned, one orchestrator thread (MIG_DATA_READ {} from the source, MIG_DATA_WRITE to the destination); p50 of the runs: {:.1} MiB moved in the downtime of {:.1} MiB in all",
        if mode == MigMode::StopCopy {
            "RUNNING"
        } else {
            "PRE_COPY"
        },
        human(MIB),
        mib(downtime_bytes),
        mib(pick(|r| r.total_bytes)),
    );
    if mode.trapped() {
        note.push_str(&format!(
            ", {} pre-copy rounds (last {:.2} MiB; stop at < 1 MiB or 5 rounds); vram_mmap=off: every VRAM write goes through the device and is logged, so rounds after the first, the STOP_COPY round included, visit only logged pages (a memcpy of all {} of VRAM takes {vram_copy_ms:.1} ms here, for comparison)",
            pick(|r| u64::from(r.rounds)),
            mib(pick(|r| r.last_round_bytes)),
            human(size),
        ));
    } else if mode != MigMode::StopCopy {
        note.push_str(&format!(
            ", {} pre-copy rounds (last {:.2} MiB; stop at < 1 MiB or 5 rounds); the STOP_COPY round still reads and hashes all {} of VRAM (guest writes through the mapping are invisible to the server), a memcpy of which takes {vram_copy_ms:.1} ms here",
            pick(|r| u64::from(r.rounds)),
            mib(pick(|r| r.last_round_bytes)),
            human(size),
        ));
    }
    if mode != MigMode::StopCopy {
        note.push_str(&format!(
            "; the longest MIG_DATA_READ while the device ran took {:.2} ms p50 of the runs (a PRE_COPY read visits at most 16 MiB of VRAM, padding the rest: a guest's register access waits at most that long behind it)",
            pick_ms(|r| r.precopy_read_max)
        ));
    }
    if mode.dirty() {
        note.push_str(&format!(
            ", the dirtier rewrote 10% of the pages {} {} times over, stopped before STOP_COPY",
            if mode.trapped() {
                "through the device (trapped BAR2 writes)"
            } else {
                "through the source's mapping"
            },
            pick(|r| r.passes)
        ));
    }
    note.push_str(&format!(
        "; downtime split (p50): →STOP_COPY {:.2} ms, MIG_DATA_READ {:.1} ms, MIG_DATA_WRITE {:.1} ms, destination →RUNNING {:.2} ms; whole migration {:.0} ms; floor: single-thread memcpy of the bytes moved in the downtime, same run; verified each run: destination VRAM and SCRATCH equal the source's",
        pick_ms(|r| r.to_stop_copy),
        pick_ms(|r| r.reads),
        pick_ms(|r| r.writes),
        pick_ms(|r| r.resume),
        pick_ms(|r| r.total),
    ));
    let each: Vec<String> = runs
        .iter()
        .map(|r| format!("{:.1}", r.downtime.as_secs_f64() * 1e3))
        .collect();
    note.push_str(&format!(
        "; downtime of each run in order (ms): {}",
        each.join(", ")
    ));
    rows.push(Row::new(
        "migration",
        format!("migration, {} VRAM: downtime, {}", human(size), mode.case()),
        mode.op(),
        mode.variant(),
        Some(size),
        Unit::Millis,
        fig("downtime", &mut downtime, Unit::Millis, 0.0)?,
        Some(fig(
            &format!(
                "single-thread memcpy of the {:.1} MiB moved in the downtime",
                mib(downtime_bytes)
            ),
            floor,
            Unit::Millis,
            0.0,
        )?),
        None,
        None,
        note,
    ));
    Ok(())
}
