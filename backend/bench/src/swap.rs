//! Live swap downtime: the softgpu swapped for its successor under a connected client, the
//! way a pool daemon does it, idle and busy, against a memcpy of the device state.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use switchyard_server::DeviceSlot;
use switchyard_softgpu::SoftGpu;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Settings, fig, human, wait_fences};
use crate::downtime::{MIB, PROGRESS_TIMEOUT, fill_random, gpu_config, vram_fd, vram_sizes};
use crate::floors::Memcpy;
use crate::gpu::{Gpu, QUEUES, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::servers::Switchyard;
use crate::stats::ns;

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
