//! Transparent move downtime (issue 11: "transparent move downtime for 64 MiB–1 GiB VRAM idle
//! and with 10 % of pages rewritten; target: idle ≤ 2 ms at every size; busy ≤ 1.2× a memcpy
//! of the last round's dirty bytes + 1 ms").
//!
//! A softgpu server (`vram=<size>,queues=2,vram_mmap=off`, VRAM filled with random data, a
//! client set up like the other GPU cases) is moved onto a new VRAM again and again with
//! [`move_device_in_slot`], the sequence a pool worker runs for `ctl move` (pre-copy rounds
//! while the device runs, the successor built on the new VRAM, the engines parked, the swap
//! copying the pages written since the last round). A new VRAM is created for every move, as
//! the worker does. Downtime (the worker's own figure): from the engines parked to the swap
//! done.
//!
//! * idle: nothing writes VRAM. Target: absolute, ≤ 2 ms; floor (for the ratio only): a
//!   memcpy of the device state, as in the swap case.
//! * busy: a writer thread keeps both queues fed with 4 KiB FILLs over 10 % of the VRAM pages
//!   (scattered, each queue its half, pass after pass) for the whole move, so the device's
//!   write log sees every page it rewrites. Floor: a single-thread memcpy of the bytes the
//!   final round (the one in the downtime) copied, measured after each move; target ≤ 1.2×
//!   that + 1 ms.
//!
//! Every move is verified: idle, the new VRAM equals the old one; busy, once the writer has
//! drained, pages it did not write equal the old VRAM and every page it wrote holds its last
//! FILL.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use switchyard_daemon::custody::MoveReport;
use switchyard_daemon::worker::move_device_in_slot;
use switchyard_server::DeviceSlot;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::SCRATCH;
use switchyard_softgpu::{SoftGpu, SoftGpuConfig};

use crate::cases::{Settings, fig, human, scattered_pages, wait_fences};
use crate::downtime::{
    Stoppable, fill_random, first_difference, gpu_config, median, mib, slot_vram, vram_sizes,
};
use crate::floors::Memcpy;
use crate::gpu::{Gpu, QUEUES, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::servers::Switchyard;
use crate::stats::ns;

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;
/// Issue 11's idle target, ms.
const IDLE_TARGET_MS: f64 = 2.0;
/// Issue 11's busy target: ≤ this × the floor ...
const BUSY_RATIO: f64 = 1.2;
/// ... + this, ms.
const BUSY_PLUS_MS: f64 = 1.0;
/// FILLs per batch (one FENCE after each batch).
const BATCH: usize = 32;
/// Batches in flight per queue: 4 × 33 entries, within the 256-entry ring.
const DEPTH: u64 = 4;
/// How long the writer runs before a move starts (steady state).
const WARM: Duration = Duration::from_millis(20);
/// How long a check waits for the device (a correctness limit, not a timing).
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(20);

/// One move as the worker does it: the move guard, then [`move_device_in_slot`] (which
/// creates the new VRAM).
fn move_once(slot: &DeviceSlot, _config: SoftGpuConfig) -> Result<MoveReport> {
    let moving = slot.begin_move().context("begin the move")?;
    let report = move_device_in_slot(slot, &moving, false).context("move")?;
    Ok(report)
}

/// The pattern of the `pass`-th FILL of queue `q`'s pages in writer run `run` (never zero).
fn pattern(run: u64, q: u32, pass: u64) -> u32 {
    let x = (run.wrapping_mul(0x9e37_79b9) ^ pass.wrapping_mul(0x85eb_ca6b)) << 2;
    (x as u32) | (q << 1) | 1
}

/// The writer's pages: queue `q` rewrites `pages[q]`, one FILL per page, in order, again and
/// again (a page is only ever written by one queue, so its last FILL is known).
type HotPages = Arc<[Vec<u64>; QUEUES as usize]>;

/// What the writer returns: its driver and the FILLs it submitted per queue (all completed).
type WriterOutput = (Gpu, [u64; QUEUES as usize]);

fn write_loop(mut gpu: Gpu, hot: &HotPages, run: u64, stop: &AtomicBool) -> Result<WriterOutput> {
    let mut fenced = [0u64; QUEUES as usize];
    for (q, f) in (0..QUEUES).zip(fenced.iter_mut()) {
        *f = gpu.mem_load_u64(fence_offset(q))?;
    }
    let mut fills = [0u64; QUEUES as usize];
    let mut cmds = Vec::with_capacity(BATCH + 1);
    let mut idle = 0u32;
    while !stop.load(Ordering::Relaxed) {
        let mut progressed = false;
        for q in 0..QUEUES {
            let i = q as usize;
            let (Some(pages), Some(c), Some(f)) = (hot.get(i), fills.get_mut(i), fenced.get_mut(i))
            else {
                bail!("no queue {q}");
            };
            let m = pages.len() as u64;
            let done = gpu.mem_load_u64(fence_offset(q))?;
            while *f - done < DEPTH && m > 0 {
                cmds.clear();
                for _ in 0..BATCH {
                    let page = pages.get((*c % m) as usize).copied().unwrap_or(0);
                    cmds.push(Command::fill(
                        Operand::Vram(page * PAGE),
                        PAGE,
                        pattern(run, q, *c / m),
                    ));
                    *c += 1;
                }
                *f += 1;
                cmds.push(Command::fence(guest(fence_offset(q)), *f, None));
                let tail = gpu.enqueue(q, &cmds)?;
                gpu.doorbell(q, tail, true)?;
                progressed = true;
            }
        }
        // Waiting for the engines (parked during a move): as a driver would, without taking
        // the CPU from them.
        if progressed {
            idle = 0;
        } else {
            idle += 1;
            if idle < 16 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
    }
    let last: Vec<(u64, u64)> = (0..QUEUES)
        .zip(fenced)
        .map(|(q, f)| (fence_offset(q), f))
        .collect();
    wait_fences(&gpu, &last, PROGRESS_TIMEOUT).context("the writer's last fences")?;
    gpu.check_queues()?;
    Ok((gpu, fills))
}

/// The writer thread; stopping it waits for its FILLs to complete.
fn start_writer(gpu: Gpu, hot: HotPages, run: u64) -> Result<Stoppable<WriterOutput>> {
    Stoppable::spawn("move-writer", "the writer", move |stop| {
        write_loop(gpu, &hot, run, stop)
    })
}

/// `page → (queue, index in its list)` of the writer's pages, `u32::MAX` elsewhere.
fn hot_index(pages: u64, hot: &HotPages) -> Result<Vec<(u32, u32)>> {
    let mut idx = vec![(u32::MAX, u32::MAX); usize::try_from(pages)?];
    for (q, list) in (0..QUEUES).zip(hot.iter()) {
        for (j, &p) in list.iter().enumerate() {
            if let Some(e) = idx.get_mut(usize::try_from(p)?) {
                *e = (q, u32::try_from(j)?);
            }
        }
    }
    Ok(idx)
}

/// After a busy move, with the writer drained: pages it did not write in run `run` equal
/// `old` (the VRAM before the move, frozen since the swap), every page it wrote holds its
/// last FILL.
fn verify_busy(
    old: &File,
    new: &File,
    size: u64,
    index: &[(u32, u32)],
    hot: &HotPages,
    run: u64,
    fills: &[u64; QUEUES as usize],
) -> Result<()> {
    let mut a = vec![0u8; MIB as usize];
    let mut b = vec![0u8; MIB as usize];
    let mut off = 0;
    while off < size {
        let len = usize::try_from((size - off).min(MIB))?;
        old.read_exact_at(&mut a[..len], off).context("read VRAM")?;
        new.read_exact_at(&mut b[..len], off).context("read VRAM")?;
        for (k, (pa, pb)) in a[..len]
            .chunks(PAGE as usize)
            .zip(b[..len].chunks(PAGE as usize))
            .enumerate()
        {
            let page = off / PAGE + k as u64;
            let (q, j) = index
                .get(usize::try_from(page)?)
                .copied()
                .unwrap_or((u32::MAX, 0));
            let written = (q != u32::MAX)
                .then(|| {
                    let m = hot.get(q as usize)?.len() as u64;
                    let c = *fills.get(q as usize)?;
                    let j = u64::from(j);
                    (j < c).then(|| pattern(run, q, (c - 1 - j) / m))
                })
                .flatten();
            match written {
                None if pa != pb => {
                    bail!("page {page:#x}: the moved VRAM differs from the old one")
                }
                Some(v) if pb.chunks(4).any(|w| w != v.to_le_bytes()) => {
                    bail!("page {page:#x}: not the writer's last FILL ({v:#x})")
                }
                _ => {}
            }
        }
        off += MIB;
    }
    Ok(())
}

/// The samples of one (size, workload) point.
#[derive(Debug, Default)]
struct MovePoint {
    reports: Vec<MoveReport>,
    floor: Vec<u64>,
    /// Busy only: passes of the writer over its pages, per move.
    passes: Vec<u64>,
}

/// Moves of one VRAM size, idle then busy.
fn move_point(dir: &Path, s: &Settings, size: u64, rows: &mut Vec<Row>) -> Result<()> {
    let reps = if s.quick { 2 } else { 10 };
    let config = SoftGpuConfig {
        vram_mmap: false,
        ..gpu_config(size)
    };
    let (server, slot) = Switchyard::start_softgpu(dir, &format!("move-{}m", size >> 20), config)?;
    let mut gpu = Gpu::setup(server.connect(s.stall_timeout())?, 0)?;
    // Written behind the device's back: the first round copies every data extent anyway.
    fill_random(&slot_vram(&slot)?, size, size ^ 0x30fe)?;
    let scratch = 0x3070_0000 | (size >> 20) as u32;
    gpu.w32(SCRATCH, scratch)?;
    let state_len = slot
        .with_as(|d: &mut SoftGpu| d.save_state())
        .context("the device is not a softgpu")?
        .context("save_state")?
        .len();
    let pages = size / PAGE;
    let mut hot: [Vec<u64>; QUEUES as usize] = Default::default();
    for (i, p) in scattered_pages(pages, pages / 10, size ^ 0xd1e7)
        .into_iter()
        .enumerate()
    {
        if let Some(list) = hot.get_mut(i % QUEUES as usize) {
            list.push(p);
        }
    }
    let hot: HotPages = Arc::new(hot);
    let hot_bytes = hot.iter().map(|l| l.len() as u64).sum::<u64>() * PAGE;
    let index = hot_index(pages, &hot)?;
    let mut memcpy = Memcpy::new(usize::try_from(hot_bytes.max(state_len as u64))?);

    if !s.quick {
        // Warm-up, not recorded (still verified): the first move touches code and pages
        // nothing has touched yet.
        let old = slot_vram(&slot)?;
        move_once(&slot, config).context("warm-up move")?;
        if let Some(off) = first_difference(&old, &slot_vram(&slot)?, size)? {
            bail!("warm-up move: the new VRAM differs from the old one at {off:#x}");
        }
    }

    let mut idle = MovePoint::default();
    for rep in 0..reps {
        std::thread::sleep(Duration::from_millis(5));
        let old = slot_vram(&slot)?;
        let r = move_once(&slot, config).with_context(|| format!("idle move {rep}"))?;
        let new = slot_vram(&slot)?;
        if let Some(off) = first_difference(&old, &new, size)? {
            bail!("idle move {rep}: the new VRAM differs from the old one at {off:#x}");
        }
        let got = gpu.r32(SCRATCH)?;
        ensure!(got == scratch, "idle move {rep}: SCRATCH reads {got:#x}");
        for _ in 0..16 {
            idle.floor.push(ns(memcpy.copy(state_len)?));
        }
        idle.reports.push(r);
    }

    let mut busy = MovePoint::default();
    for rep in 0..reps {
        let run = rep as u64 + 1;
        let old = slot_vram(&slot)?;
        let mut writer = start_writer(gpu, Arc::clone(&hot), run)?;
        std::thread::sleep(WARM);
        writer.check_alive()?;
        let moved = move_once(&slot, config).with_context(|| format!("busy move {rep}"));
        let (g, fills) = writer.stop()?;
        gpu = g;
        let r = moved?;
        let new = slot_vram(&slot)?;
        verify_busy(&old, &new, size, &index, &hot, run, &fills)
            .with_context(|| format!("busy move {rep}"))?;
        let got = gpu.r32(SCRATCH)?;
        ensure!(got == scratch, "busy move {rep}: SCRATCH reads {got:#x}");
        for _ in 0..3 {
            busy.floor
                .push(ns(memcpy.copy(usize::try_from(r.final_bytes)?)?));
        }
        let per_pass = hot.iter().map(|l| l.len() as u64).max().unwrap_or(1).max(1);
        busy.passes
            .push(fills.iter().copied().max().unwrap_or(0) / per_pass);
        busy.reports.push(r);
    }
    drop(memcpy);
    drop(gpu);
    server.shutdown()?;

    idle_row(rows, size, state_len, &mut idle)?;
    busy_row(rows, size, hot_bytes, &mut busy)?;
    Ok(())
}

fn us_to_ns(v: impl Iterator<Item = u64>) -> Vec<u64> {
    v.map(|us| us.saturating_mul(1000)).collect()
}

/// What every row's note says about the moves' parts.
fn parts(p: &MovePoint) -> String {
    let pick = |f: fn(&MoveReport) -> u64| median(&p.reports.iter().map(f).collect::<Vec<_>>());
    let max = |f: fn(&MoveReport) -> u64| p.reports.iter().map(f).max().unwrap_or(0);
    let each: Vec<String> = p
        .reports
        .iter()
        .map(|r| format!("{:.2}", r.downtime_us as f64 / 1e3))
        .collect();
    format!(
        "p50 of the moves: {} pre-copy rounds (stop at ≤ 256 KiB or 12) copying {:.1} MiB in {:.0} ms, last pre-copy round {:.2} MiB, final (stopped) round {:.2} MiB in {} µs; parking the engines {} µs (not downtime: the device works); slot held (region accesses wait) {} µs, max {} µs; downtime of each move in order (ms): {}",
        pick(|r| u64::from(r.rounds)),
        mib(pick(|r| r.bytes)),
        pick(|r| r.precopy_us) as f64 / 1e3,
        mib(pick(|r| r.last_round_bytes)),
        mib(pick(|r| r.final_bytes)),
        pick(|r| r.final_copy_us),
        pick(|r| r.park_wait_us),
        pick(|r| r.held_us),
        max(|r| r.held_us),
        each.join(", ")
    )
}

fn idle_row(rows: &mut Vec<Row>, size: u64, state_len: usize, p: &mut MovePoint) -> Result<()> {
    let mut downtime = us_to_ns(p.reports.iter().map(|r| r.downtime_us));
    let max_ms = downtime.iter().copied().max().unwrap_or(0) as f64 / 1e6;
    rows.push(Row::new(
        "move",
        format!("transparent move, {} VRAM: downtime", human(size)),
        "move-idle",
        "idle",
        Some(size),
        Unit::Millis,
        fig("downtime", &mut downtime, Unit::Millis, 0.0)?,
        Some(fig(
            &format!("single-thread memcpy of the {state_len} B device state"),
            &mut p.floor,
            Unit::Millis,
            0.0,
        )?),
        None,
        Some(Target::absolute(IDLE_TARGET_MS)),
        format!(
            "move_device_in_slot (the worker's sequence) onto a new VRAM, vram_mmap=off, nothing writing VRAM; downtime = engines parked → swap done; max {max_ms:.2} ms {} the ≤ {IDLE_TARGET_MS} ms target (issue 11: at every size); {}; floor (ratio only): memcpy of the state, as in the swap case; verified each move: new VRAM = old, SCRATCH kept",
            if max_ms <= IDLE_TARGET_MS {
                "meets"
            } else {
                "misses"
            },
            parts(p)
        ),
    ));
    Ok(())
}

fn busy_row(rows: &mut Vec<Row>, size: u64, hot_bytes: u64, p: &mut MovePoint) -> Result<()> {
    let mut downtime = us_to_ns(p.reports.iter().map(|r| r.downtime_us));
    let final_bytes = median(&p.reports.iter().map(|r| r.final_bytes).collect::<Vec<_>>());
    let floor = fig(
        &format!(
            "single-thread memcpy of the final round's dirty bytes ({:.2} MiB p50)",
            mib(final_bytes)
        ),
        &mut p.floor,
        Unit::Millis,
        0.0,
    )?;
    // Per move, against its own floor (median of the memcpys after it).
    let missed = p
        .reports
        .iter()
        .zip(p.floor.chunks(3))
        .filter(|(r, f)| {
            let floor_ms = median(f) as f64 / 1e6;
            r.downtime_us as f64 / 1e3 > BUSY_RATIO * floor_ms + BUSY_PLUS_MS
        })
        .count();
    rows.push(Row::new(
        "move",
        format!("transparent move, {} VRAM: downtime", human(size)),
        "move-busy",
        "10% of pages rewritten",
        Some(size),
        Unit::Millis,
        fig("downtime", &mut downtime, Unit::Millis, 0.0)?,
        Some(floor),
        None,
        Some(Target {
            floor_ratio: BUSY_RATIO,
            beat_peer: false,
            plus: BUSY_PLUS_MS,
        }),
        format!(
            "as idle, with a writer thread keeping both queues fed with 4 KiB FILLs (batches of {BATCH} + a FENCE, {DEPTH} in flight per queue) over 10% of the pages ({:.1} MiB, scattered), {} passes p50 over them per move (from {} ms before the move to its end): every write goes through the engines and the write log; {}; {missed} of {} moves miss ≤ {BUSY_RATIO}× their own floor + {BUSY_PLUS_MS} ms; floor: memcpy of the bytes the final round copied, 3× after each move; verified each move: pages not written = old VRAM, written pages hold their last FILL, SCRATCH kept",
            mib(hot_bytes),
            median(&p.passes),
            WARM.as_millis(),
            parts(p),
            p.reports.len()
        ),
    ));
    Ok(())
}

/// Transparent moves of a softgpu onto a new VRAM, idle and busy, at each VRAM size. See the
/// [module](self) documentation.
pub fn moves(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    for &size in vram_sizes(s) {
        move_point(dir, s, size, rows).with_context(|| format!("{} VRAM", human(size)))?;
    }
    Ok(())
}
