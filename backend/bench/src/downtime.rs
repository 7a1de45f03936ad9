//! Downtime cases: swapping the softgpu under a connected client (what a pool daemon does,
//! [`swap`]) and migrating it between two servers over vfio-user migration v2 (what a VMM
//! does, [`migration`]). Both measure their floor in the same run: a memcpy of the device
//! state (swap) or of the bytes moved while the device was down (migration).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use switchyard_client::Client;
use switchyard_client::migrate::{Migration, PreCopyPlan};
use switchyard_proto::consts::{
    VFIO_DEVICE_STATE_RUNNING, VFIO_MIGRATION_PRE_COPY, VFIO_MIGRATION_STOP_COPY,
};
use switchyard_server::DeviceSlot;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::SCRATCH;
use switchyard_softgpu::{BAR_VRAM, SoftGpu, SoftGpuConfig};
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

use crate::cases::{Settings, fig, human, scattered_pages, wait_fences};
use crate::floors::Memcpy;
use crate::gpu::{Gpu, QUEUES, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::servers::Switchyard;
use crate::stats::ns;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAGE: u64 = 4096;

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
const PROGRESS_TIMEOUT: Duration = Duration::from_secs(20);

/// The fd of BAR2 (VRAM) from REGION_INFO.
fn vram_fd(c: &mut Client) -> Result<File> {
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

fn median_ms(v: &[Duration]) -> f64 {
    median(&v.iter().map(|&d| ns(d)).collect::<Vec<_>>()) as f64 / 1e6
}

pub(crate) fn mib(bytes: u64) -> f64 {
    bytes as f64 / MIB as f64
}

// ------------------------------------------------------------------------------------- swap

/// The times of one swap.
#[derive(Debug, Clone, Copy)]
struct SwapTimes {
    /// `EngineControl::park` called → the successor installed (its engines run).
    stall: Duration,
    /// The slot's lock held (reported by the server): the register-access stall.
    held: Duration,
    /// `EngineControl::park`: the engines finishing their current command.
    drain: Duration,
    /// Building the successor (mapping VRAM, starting engines), before the swap.
    build: Duration,
    /// Dropping the old device (joining its engines), outside the lock.
    teardown: Duration,
    start: Instant,
    end: Instant,
}

/// One swap the way a pool daemon does it, through the device's swap capability: build the
/// successor (on the same VRAM memfd) and park the engines outside the lock, then only hand
/// the state over inside the swap; resume the old engines if the swap is refused.
fn swap_once(slot: &DeviceSlot) -> Result<SwapTimes> {
    let plan = slot.prepare_swap().context("prepare the swap")?;
    let tb = Instant::now();
    let next = (plan.successor)(slot.context().clone()).context("successor")?;
    let t0 = Instant::now();
    let parked = plan.quiesce.park();
    let t1 = Instant::now();
    // A refused swap lets the old engines run again when `parked` goes.
    let report = slot.swap(next).context("swap")?;
    let t2 = Instant::now();
    drop(parked);
    let held = report.held;
    drop(report.old);
    let t3 = Instant::now();
    Ok(SwapTimes {
        stall: t2 - t0,
        held,
        drain: t1 - t0,
        build: t0 - tb,
        teardown: t3 - t2,
        start: t0,
        end: t2,
    })
}

/// What the busy client publishes for the swapping thread.
#[derive(Debug, Default)]
struct BusyShared {
    stop: AtomicBool,
    /// Sum over the queues of the last fence value seen.
    completed: AtomicU64,
    /// When the reads of `completed` started, ns since the epoch (≥ 1).
    seen_at: AtomicU64,
}

/// What the busy client returns: its driver and every timed REGION_READ as (start ns since
/// the epoch, duration ns).
type BusyResult = Result<(Gpu, Vec<(u64, u64)>)>;

/// FILL + FENCE pairs in flight per queue.
const BUSY_DEPTH: u64 = 8;
/// Bytes per FILL.
const BUSY_FILL: u64 = 64 << 10;

/// The busy client: keeps both queues fed with FILL 64 KiB (VRAM) + FENCE pairs, posted
/// doorbells as QEMU sends them, and reads SCRATCH (timed) between top-ups; at the end waits
/// for every fence and checks the queues.
fn busy_loop(
    mut gpu: Gpu,
    shared: &BusyShared,
    epoch: Instant,
    vram: u64,
    scratch: u32,
) -> BusyResult {
    let slots = vram.min(64 * MIB) / BUSY_FILL;
    let mut submitted = [0u64; QUEUES as usize];
    for (q, s) in (0..QUEUES).zip(submitted.iter_mut()) {
        *s = gpu.mem_load_u64(fence_offset(q))?;
    }
    let mut k = 0u64;
    let mut reads = Vec::with_capacity(1 << 16);
    let mut cmds = Vec::with_capacity(2 * BUSY_DEPTH as usize);
    while !shared.stop.load(Ordering::Relaxed) {
        let seen_at = ns(epoch.elapsed()).max(1);
        let mut total = 0;
        for (q, sub) in (0..QUEUES).zip(submitted.iter_mut()) {
            let done = gpu.mem_load_u64(fence_offset(q))?;
            total += done;
            if *sub - done > BUSY_DEPTH / 2 {
                continue;
            }
            cmds.clear();
            while *sub - done < BUSY_DEPTH {
                *sub += 1;
                k += 1;
                cmds.push(Command::fill(
                    Operand::Vram((k % slots) * BUSY_FILL),
                    BUSY_FILL,
                    (k as u32) | 1,
                ));
                cmds.push(Command::fence(guest(fence_offset(q)), *sub, None));
            }
            let tail = gpu.enqueue(q, &cmds)?;
            gpu.doorbell(q, tail, true)?;
        }
        shared.completed.store(total, Ordering::Release);
        shared.seen_at.store(seen_at, Ordering::Release);
        let t = Instant::now();
        let got = gpu.r32(SCRATCH)?;
        let d = t.elapsed();
        reads.push((ns(t - epoch), ns(d)));
        if got != scratch {
            bail!("SCRATCH reads {got:#x}, expected {scratch:#x}");
        }
    }
    let fences: Vec<(u64, u64)> = (0..QUEUES)
        .zip(submitted)
        .map(|(q, v)| (fence_offset(q), v))
        .collect();
    wait_fences(&gpu, &fences, PROGRESS_TIMEOUT).context("the busy job's last fences")?;
    gpu.check_queues()?;
    Ok((gpu, reads))
}

/// The busy client's thread; stopped when dropped.
#[derive(Debug)]
struct Busy {
    shared: Arc<BusyShared>,
    thread: Option<JoinHandle<BusyResult>>,
}

impl Busy {
    fn start(gpu: Gpu, epoch: Instant, vram: u64, scratch: u32) -> Result<Busy> {
        let shared = Arc::new(BusyShared::default());
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("busy-client".into())
            .spawn(move || busy_loop(gpu, &sh, epoch, vram, scratch))
            .context("spawn the busy client")?;
        Ok(Busy {
            shared,
            thread: Some(thread),
        })
    }

    /// Fails with the client's error if it has stopped.
    fn check_alive(&mut self) -> Result<()> {
        if self.thread.as_ref().is_some_and(|t| t.is_finished()) {
            self.join()?;
            bail!("the busy client stopped");
        }
        Ok(())
    }

    /// Waits until the client has seen at least `QUEUES` more fences complete after `after`:
    /// the job survived the swap that ended then (the old engines were parked before it).
    fn wait_progress(&mut self, epoch: Instant, after: Instant) -> Result<()> {
        let after = ns(after - epoch);
        let start = Instant::now();
        let mut base = None;
        loop {
            self.check_alive()?;
            let seen_at = self.shared.seen_at.load(Ordering::Acquire);
            let completed = self.shared.completed.load(Ordering::Acquire);
            if seen_at > after {
                match base {
                    None => base = Some(completed),
                    Some(b) if completed >= b + u64::from(QUEUES) => return Ok(()),
                    Some(_) => {}
                }
            }
            if start.elapsed() > PROGRESS_TIMEOUT {
                bail!("the busy job made no progress within {PROGRESS_TIMEOUT:?} after a swap");
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn join(&mut self) -> BusyResult {
        self.shared.stop.store(true, Ordering::Relaxed);
        self.thread
            .take()
            .context("the busy client was already joined")?
            .join()
            .map_err(|_| anyhow!("the busy client panicked"))?
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
    }
}

/// The samples of one (size, workload) point.
#[derive(Debug, Default)]
struct SwapPoint {
    held: Vec<u64>,
    stall: Vec<u64>,
    drain: Vec<u64>,
    /// Engine stall − drain − held: waiting for the slot's lock, scheduling.
    rest: Vec<u64>,
    teardown: Vec<u64>,
    build: Vec<u64>,
    floor: Vec<u64>,
    /// Busy only: per swap, the longest REGION_READ in flight during it.
    read_max: Vec<u64>,
    /// Busy only: how long after `swap()` returned the longest read's reply came (0 if
    /// before).
    read_lag: Vec<u64>,
    /// Busy only: REGION_READs that overlapped no swap.
    read_outside: Vec<u64>,
    /// Busy only: fences completed over the run.
    fences: u64,
}

impl SwapPoint {
    fn record(&mut self, t: &SwapTimes, memcpy: &mut Memcpy, state_len: usize) -> Result<()> {
        self.held.push(ns(t.held));
        self.stall.push(ns(t.stall));
        self.drain.push(ns(t.drain));
        self.rest
            .push(ns(t.stall.saturating_sub(t.drain).saturating_sub(t.held)));
        self.teardown.push(ns(t.teardown));
        self.build.push(ns(t.build));
        // The floor, next to each swap.
        for _ in 0..16 {
            self.floor.push(ns(memcpy.copy(state_len)?));
        }
        Ok(())
    }
}

/// Live swap downtime: a softgpu server (`vram=<size>,queues=2`, VRAM filled with random
/// data) with a client set up like the other GPU cases, swapped N times for its successor
/// the way a pool daemon does it (build the successor and park the engines outside the lock,
/// `DeviceSlot::swap` of a parked `SoftGpu::successor`), with the client idle and with a busy client
/// (a stream of FILL + FENCE pairs on both queues and register reads). Per swap: how long the
/// slot was held (the longest a register access waits) and the engine stall (park → successor
/// running), against a memcpy of the device state's bytes measured next to each swap.
pub fn swap(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let swaps = if s.quick { 3 } else { 30 };
    let settle = Duration::from_millis(if s.quick { 5 } else { 10 });
    for &size in vram_sizes(s) {
        let name = format!("swap-{}m", size >> 20);
        let (server, slot) = Switchyard::start_softgpu(dir, &name, gpu_config(size))?;
        let mut gpu = Gpu::setup(server.connect(s.stall_timeout())?, 0)?;
        let vram = vram_fd(&mut gpu.client)?;
        fill_random(&vram, size, size ^ 0x5eed)?;
        let scratch = 0x5a00_0000 | (size >> 20) as u32;
        gpu.w32(SCRATCH, scratch)?;
        let state_len = slot
            .with_as(|d: &mut SoftGpu| d.save_state())
            .context("the device is not a softgpu")?
            .context("save_state")?
            .len();
        let mut memcpy = Memcpy::new(state_len);

        // Idle client.
        let mut idle = SwapPoint::default();
        for _ in 0..swaps {
            std::thread::sleep(settle);
            let t = swap_once(&slot)?;
            idle.record(&t, &mut memcpy, state_len)?;
            let got = gpu.r32(SCRATCH)?;
            if got != scratch {
                bail!("after a swap SCRATCH reads {got:#x}, expected {scratch:#x}");
            }
        }
        // The queues still run after the swaps.
        let mut fences = Vec::new();
        for q in 0..QUEUES {
            let v = gpu.mem_load_u64(fence_offset(q))? + 1;
            let tail = gpu.enqueue(
                q,
                &[
                    Command::fill(Operand::Vram(0), BUSY_FILL, 0x1234_5679),
                    Command::fence(guest(fence_offset(q)), v, None),
                ],
            )?;
            gpu.doorbell(q, tail, false)?;
            fences.push((fence_offset(q), v));
        }
        wait_fences(&gpu, &fences, PROGRESS_TIMEOUT).context("a job after idle swaps")?;

        // Busy client.
        let mut busy = SwapPoint::default();
        let epoch = Instant::now();
        let fences_before: u64 = (0..QUEUES)
            .map(|q| gpu.mem_load_u64(fence_offset(q)))
            .sum::<Result<u64>>()?;
        let mut client = Busy::start(gpu, epoch, size, scratch)?;
        let mut windows = Vec::with_capacity(swaps);
        for _ in 0..swaps {
            std::thread::sleep(settle);
            client.check_alive()?;
            let t = swap_once(&slot)?;
            busy.record(&t, &mut memcpy, state_len)?;
            windows.push((ns(t.start - epoch), ns(t.end - epoch)));
            client.wait_progress(epoch, t.end)?;
        }
        let (mut gpu, reads) = client.join()?;
        let fences_after: u64 = (0..QUEUES)
            .map(|q| gpu.mem_load_u64(fence_offset(q)))
            .sum::<Result<u64>>()?;
        busy.fences = fences_after - fences_before;
        for &(w0, w1) in &windows {
            let longest = reads
                .iter()
                .filter(|&&(r0, d)| r0 < w1 && r0 + d > w0)
                .max_by_key(|&&(_, d)| d);
            if let Some(&(r0, d)) = longest {
                busy.read_max.push(d);
                busy.read_lag.push((r0 + d).saturating_sub(w1));
            }
        }
        busy.read_outside = reads
            .iter()
            .filter(|&&(r0, d)| !windows.iter().any(|&(w0, w1)| r0 < w1 && r0 + d > w0))
            .map(|&(_, d)| d)
            .collect();
        if gpu.r32(SCRATCH)? != scratch {
            bail!("SCRATCH changed across the swaps");
        }
        drop(gpu);
        server.shutdown()?;

        for (variant, p) in [
            ("softgpu, idle client", &mut idle),
            ("softgpu, busy client", &mut busy),
        ] {
            swap_rows(rows, size, variant, state_len, p)?;
        }
    }
    Ok(())
}

fn swap_rows(
    rows: &mut Vec<Row>,
    size: u64,
    variant: &str,
    state_len: usize,
    p: &mut SwapPoint,
) -> Result<()> {
    let floor = fig(
        &format!("single-thread memcpy of the {state_len} B device state"),
        &mut p.floor,
        Unit::Micros,
        0.0,
    )?;
    let target = Target {
        floor_ratio: 1.2,
        beat_peer: false,
        plus: 1000.0,
    };
    let held = fig("slot held", &mut p.held, Unit::Micros, 0.0)?;
    let p99_ok = held.p99 <= target.floor_ratio * floor.p99 + target.plus;
    let teardown = fig("teardown", &mut p.teardown, Unit::Micros, 0.0)?;
    let build = fig("build", &mut p.build, Unit::Micros, 0.0)?;
    let drain = fig("drain", &mut p.drain, Unit::Micros, 0.0)?;
    let rest = fig("rest", &mut p.rest, Unit::Micros, 0.0)?;
    let busy = !p.read_max.is_empty();
    let workload = if busy {
        format!(
            "busy client: FILL {} + FENCE pairs on both queues ({} fences completed, every swap followed by more) and SCRATCH reads",
            human(BUSY_FILL),
            p.fences
        )
    } else {
        "idle client".to_owned()
    };
    rows.push(Row::new(
        "swap",
        format!("live swap, {} VRAM: slot held", human(size)),
        "swap-held",
        variant,
        Some(size),
        Unit::Micros,
        held.clone(),
        Some(floor.clone()),
        None,
        Some(target),
        format!(
            "DeviceSlot::swap(successor) after building the successor (p50 {:.0} µs) and parking the engines outside the lock: the lock's hold time = the longest a region access waits; {workload}; state {state_len} B (save_state); target ≤ 1.2× floor + 1 ms at p50, p99 {} µs {} it; old device dropped outside the lock, p50 {:.0} µs",
            build.p50,
            held.p99.round(),
            if p99_ok { "meets" } else { "misses" },
            teardown.p50
        ),
    ));
    rows.push(Row::new(
        "swap",
        format!("live swap, {} VRAM: engine stall", human(size)),
        "swap-stall",
        variant,
        Some(size),
        Unit::Micros,
        fig("engine stall", &mut p.stall, Unit::Micros, 0.0)?,
        Some(floor),
        None,
        None,
        format!(
            "EngineControl::park called → successor installed with its engines running: drain (current command) p50 {:.0} µs / p99 {:.0} µs, the slot held, and the rest (waiting for the slot's lock, scheduling) p50 {:.0} µs / p99 {:.0} µs; {workload}",
            drain.p50, drain.p99, rest.p50, rest.p99
        ),
    ));
    if busy {
        let in_flight = p.read_max.len();
        let lag = fig("lag", &mut p.read_lag, Unit::Micros, 0.0)?;
        rows.push(Row::new(
            "swap",
            format!(
                "live swap, {} VRAM: longest REGION_READ during a swap",
                human(size)
            ),
            "swap-read",
            variant,
            Some(size),
            Unit::Micros,
            fig("longest read", &mut p.read_max, Unit::Micros, 0.0)?,
            Some(fig(
                "the same client's reads that overlapped no swap",
                &mut p.read_outside,
                Unit::Micros,
                0.0,
            )?),
            None,
            None,
            format!(
                "per swap, the longest 4 B SCRATCH read of the busy client in flight during it ({in_flight} of the swaps had one); its reply came p50 {:.0} µs / p99 {:.0} µs after swap() returned (the server thread getting a CPU back while the successor's engines start on the backlog); floor: the same client's reads outside swaps, same run",
                lag.p50, lag.p99
            ),
        ));
    }
    Ok(())
}

// -------------------------------------------------------------------------------- migration

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
