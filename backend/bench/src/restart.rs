//! The restart stall of a pool endpoint (issue 11: "data-path restart stall, kill -9 to first
//! answered request; target ≤ 50 ms"). A `switchyard_daemon::Supervisor` runs the endpoint's
//! `switchyard worker` process (the release binary, `--switchyard-bin`); a client with a DMA
//! window and MSI-X eventfds wired reads the softgpu's `SCRATCH` back to back on a thread
//! while the worker is SIGKILLed again and again. The stall of one kill is the time from the
//! kill to the first reply the replacement sends. Floor: starting a process of the same binary
//! (spawn to exit of `switchyard --version`), measured between the kills.
//!
//! Every worker runs as a child of the supervisor, which kills its workers when dropped; the
//! case drops it on every path ([`Rig`]) and checks afterwards that none is left.

use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail, ensure};
use switchyard_client::Client;
use switchyard_daemon::{EndpointSpec, Supervisor, WorkerEvent, WorkerLifecycle};
use switchyard_proto::consts::{
    VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD, VFIO_PCI_MSIX_IRQ_INDEX,
};
use switchyard_softgpu::SoftGpuConfig;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Settings, fig, wait_fences};
use crate::floors::wait_readable;
use crate::gpu::{Gpu, QUEUES, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::servers::vmm_client_config;
use crate::stats::ns;

/// The endpoint's name.
const ENDPOINT: &str = "restart";
/// What the client writes to `SCRATCH` before the kills and every read checks.
const SCRATCH_VALUE: u32 = 0x5157_0a11;
/// The client's socket timeout: a replacement must answer within it (QEMU waits 5 s).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a replacement may take to report ready, or the device to deliver the final
/// FENCE, before the run fails: correctness limits, not timings.
const READY_TIMEOUT: Duration = Duration::from_secs(20);
/// MSI-X vectors wired to eventfds (so a replacement restores a real interrupt table).
const VECTORS: u32 = 4;
/// The target, ms.
const TARGET_MS: f64 = 50.0;

type Events = Arc<Mutex<Vec<(Instant, WorkerLifecycle)>>>;
/// What the reader returns: its driver and the arrival time of every reply.
type ReaderResult = Result<(Gpu, Vec<Instant>)>;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// What the reader thread shares with the killing thread.
#[derive(Debug, Default)]
struct ReaderShared {
    stop: AtomicBool,
    pause: AtomicBool,
    /// How many times the reader parked on `pause`.
    parks: AtomicU64,
    /// When the last reply arrived, ns since the epoch (0: none yet).
    last: AtomicU64,
}

/// The client thread: back-to-back REGION_READs of `SCRATCH`, every reply's arrival time
/// kept (the stall is computed from them afterwards, so the loop does nothing else).
#[derive(Debug)]
struct Reader {
    shared: Arc<ReaderShared>,
    epoch: Instant,
    thread: Option<JoinHandle<ReaderResult>>,
}

impl Reader {
    fn start(gpu: Gpu) -> Result<Reader> {
        let shared = Arc::new(ReaderShared::default());
        let epoch = Instant::now();
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("restart-reader".into())
            .spawn(move || read_loop(gpu, &sh, epoch))
            .context("spawn the reader")?;
        Ok(Reader {
            shared,
            epoch,
            thread: Some(thread),
        })
    }

    /// Fails with the reader's error if it stopped.
    fn check(&mut self) -> Result<()> {
        if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
            return match self.finish() {
                Ok(_) => Err(anyhow!("the reader stopped early")),
                Err(e) => Err(e),
            };
        }
        Ok(())
    }

    /// Waits until a reply arrived after `t`.
    fn wait_reply_after(&mut self, t: Instant) -> Result<()> {
        let after = ns(t.saturating_duration_since(self.epoch));
        let deadline = Instant::now() + CLIENT_TIMEOUT;
        while self.shared.last.load(Ordering::Acquire) <= after {
            self.check()?;
            ensure!(
                Instant::now() < deadline,
                "no reply within {CLIENT_TIMEOUT:?} after the replacement reported ready"
            );
            std::thread::sleep(Duration::from_micros(100));
        }
        Ok(())
    }

    /// Parks the reader (returns once it is parked).
    fn pause(&mut self) -> Result<()> {
        let parks = self.shared.parks.load(Ordering::Acquire);
        self.shared.pause.store(true, Ordering::Release);
        while self.shared.parks.load(Ordering::Acquire) == parks {
            self.check()?;
            std::thread::sleep(Duration::from_micros(50));
        }
        Ok(())
    }

    fn resume(&self) {
        self.shared.pause.store(false, Ordering::Release);
    }

    /// Stops the reader; returns its driver and the arrival time of every reply.
    fn finish(&mut self) -> ReaderResult {
        self.shared.stop.store(true, Ordering::Release);
        self.resume();
        self.thread
            .take()
            .context("the reader was already stopped")?
            .join()
            .map_err(|_| anyhow!("the reader panicked"))?
    }
}

impl Drop for Reader {
    fn drop(&mut self) {
        if self.thread.is_some() {
            let _ = self.finish();
        }
    }
}

fn read_loop(mut gpu: Gpu, sh: &ReaderShared, epoch: Instant) -> ReaderResult {
    let mut replies = Vec::with_capacity(1 << 16);
    while !sh.stop.load(Ordering::Acquire) {
        if sh.pause.load(Ordering::Acquire) {
            sh.parks.fetch_add(1, Ordering::AcqRel);
            while sh.pause.load(Ordering::Acquire) && !sh.stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_micros(100));
            }
            continue;
        }
        let v = gpu.r32(SCRATCH).context("REGION_READ of SCRATCH")?;
        let t = Instant::now();
        if v != SCRATCH_VALUE {
            bail!("SCRATCH reads {v:#x} after a restart, {SCRATCH_VALUE:#x} was written");
        }
        replies.push(t);
        sh.last.store(ns(t - epoch).max(1), Ordering::Release);
    }
    Ok((gpu, replies))
}

/// The supervisor and the reader, torn down in that order on every path: the supervisor
/// kills its workers and closes the connection it holds, which ends a read the reader may
/// be blocked in.
#[derive(Debug)]
struct Rig {
    sup: Option<Supervisor>,
    reader: Option<Reader>,
}

impl Drop for Rig {
    fn drop(&mut self) {
        drop(self.sup.take());
        drop(self.reader.take());
    }
}

/// Spawn to exit of `bin --version`: the cost of starting a process of the worker's binary.
pub(crate) fn process_start(bin: &Path) -> Result<Duration> {
    let t0 = Instant::now();
    let status = Command::new(bin)
        .arg("--version")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .with_context(|| format!("run {} --version", bin.display()))?;
    let d = t0.elapsed();
    ensure!(status.success(), "{} --version: {status}", bin.display());
    Ok(d)
}

/// After the kills: a FENCE with an interrupt on vector 0 reaches guest memory (the DMA
/// window) and the client's eventfd (the MSI-X table) through the latest replacement.
fn check_device(gpu: &mut Gpu) -> Result<()> {
    let v = 0x5e5e_0001u64;
    let fence = switchyard_softgpu::cmd::Command::fence(guest(fence_offset(0)), v, Some(0));
    let tail = gpu.enqueue(0, &[fence])?;
    gpu.doorbell(0, tail, false)?;
    wait_fences(gpu, &[(fence_offset(0), v)], READY_TIMEOUT)
        .context("a FENCE through the last replacement")?;
    wait_readable(&gpu.irq, Some(READY_TIMEOUT))
        .context("the FENCE's MSI-X interrupt through the last replacement")?;
    gpu.check_queues()
}

/// Whether `pid` is still a `switchyard` process.
fn alive_switchyard(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "switchyard")
}

pub(crate) fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

/// Nearest-rank percentile of sorted samples (ns) in ms.
fn pct_ms(sorted: &[u64], p: f64) -> f64 {
    let n = sorted.len();
    let idx = ((p * n as f64).ceil() as usize).clamp(1, n.max(1)) - 1;
    sorted.get(idx).copied().unwrap_or_default() as f64 / 1e6
}

/// The per-kill times, ns from the kill.
#[derive(Debug, Default)]
struct Stalls {
    /// The old worker reaped by the supervisor (its `Exited` event).
    reaped: Vec<u64>,
    /// The replacement spawned (its `Started` event).
    spawned: Vec<u64>,
    /// The replacement's ready note received (its `Ready` event).
    ready: Vec<u64>,
    /// The first reply received after the replacement was spawned.
    first_reply: Vec<u64>,
    /// Replies the old worker had sent that arrived after the kill (not counted).
    stale: usize,
}

fn stalls(
    kills: &[(Instant, u32)],
    events: &[(Instant, WorkerLifecycle)],
    replies: &[Instant],
) -> Result<Stalls> {
    let mut out = Stalls::default();
    for (i, &(t_kill, pid)) in kills.iter().enumerate() {
        let next_kill = kills.get(i + 1).map(|k| k.0);
        let after = |what: &str, pred: &dyn Fn(&WorkerLifecycle) -> bool| -> Result<Instant> {
            let t = events
                .iter()
                .find(|(t, e)| *t > t_kill && pred(e))
                .map(|(t, _)| *t)
                .with_context(|| format!("kill {i}: no {what} event after it"))?;
            ensure!(
                next_kill.is_none_or(|n| t < n),
                "kill {i}: its {what} event came after the next kill"
            );
            Ok(t)
        };
        let t_exit = after(
            "Exited",
            &|e| matches!(e, WorkerLifecycle::Exited { pid: p, .. } if *p == pid),
        )?;
        let t_start = after("Started", &|e| {
            matches!(e, WorkerLifecycle::Started { resume: true, .. })
        })?;
        let t_ready = after("Ready", &|e| matches!(e, WorkerLifecycle::Ready { .. }))?;
        ensure!(
            t_exit <= t_start && t_start <= t_ready,
            "kill {i}: events out of order"
        );
        // Replies are in arrival order. Whatever arrived before the replacement existed was
        // sent by the old worker; the first one after it is the replacement's.
        let from = replies.partition_point(|&t| t <= t_kill);
        let spawned = replies.partition_point(|&t| t <= t_start);
        let first = *replies
            .get(spawned)
            .with_context(|| format!("kill {i}: no reply after the replacement started"))?;
        ensure!(
            next_kill.is_none_or(|n| first < n),
            "kill {i}: its first reply came after the next kill"
        );
        out.stale += spawned - from;
        out.reaped.push(ns(t_exit - t_kill));
        out.spawned.push(ns(t_start - t_kill));
        out.ready.push(ns(t_ready - t_kill));
        out.first_reply.push(ns(first - t_kill));
    }
    Ok(out)
}

/// kill -9 of the endpoint's worker under back-to-back register reads → the first reply the
/// replacement sends. See the [module](self) documentation.
pub fn restart(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let bin = &s.switchyard_bin;
    if !bin.is_file() {
        bail!(
            "{} not found: build it (`cargo build --release -p switchyard`, which scripts/bench.sh does) or pass --switchyard-bin",
            bin.display()
        );
    }
    let kills = if s.quick { 3 } else { 30 };
    let events: Events = Arc::default();
    let sink = events.clone();
    let mut rig = Rig {
        sup: Some(Supervisor::with_events(
            bin,
            Arc::new(move |e| {
                if let WorkerEvent::Lifecycle(e) = e {
                    lock(&sink).push((Instant::now(), e));
                }
            }),
        )),
        reader: None,
    };
    let socket = dir.join("restart.sock");
    let gpu_config = SoftGpuConfig {
        vram_size: 64 << 20,
        queues: QUEUES,
        ..SoftGpuConfig::default()
    };
    {
        let sup = rig.sup.as_ref().context("no supervisor")?;
        sup.create(EndpointSpec {
            id: ENDPOINT.into(),
            socket: socket.clone(),
            device: switchyard_kinds::softgpu(&gpu_config),
            failover: false,
            lease: None,
            migration: Default::default(),
        })
        .context("create the endpoint")?;
        let st = sup.wait_ready(ENDPOINT, 1, READY_TIMEOUT)?;
        ensure!(
            st.ready == 1,
            "the first worker did not report ready within {READY_TIMEOUT:?}: {st:?}"
        );
    }
    let client = Client::connect_with(&socket, vmm_client_config(Some(CLIENT_TIMEOUT)))
        .with_context(|| format!("connect {}", socket.display()))?;
    // One DMA window (a memfd), MSI-X on with vector 0 wired, both queues enabled ...
    let mut gpu = Gpu::setup(client, 0)?;
    // ... and more vectors, so that a replacement restores a real interrupt table.
    let extra = (1..VECTORS)
        .map(|_| rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).map(File::from))
        .collect::<rustix::io::Result<Vec<File>>>()
        .context("eventfd")?;
    let fds: Vec<BorrowedFd<'_>> = extra.iter().map(|f| f.as_fd()).collect();
    gpu.client
        .set_irqs(
            VFIO_PCI_MSIX_IRQ_INDEX,
            VFIO_IRQ_SET_ACTION_TRIGGER | VFIO_IRQ_SET_DATA_EVENTFD,
            1,
            VECTORS - 1,
            &fds,
        )
        .context("SET_IRQS of the other vectors")?;
    gpu.w32(SCRATCH, SCRATCH_VALUE)?;
    rig.reader = Some(Reader::start(gpu)?);

    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut killed: Vec<(Instant, u32)> = Vec::with_capacity(kills);
    let mut floor = Vec::with_capacity(kills);
    for i in 0..kills {
        let (Some(sup), Some(reader)) = (rig.sup.as_ref(), rig.reader.as_mut()) else {
            bail!("the rig is gone");
        };
        // 5-15 ms of back-to-back reads first, so the kill lands anywhere in a request.
        std::thread::sleep(Duration::from_micros(5_000 + xorshift(&mut rng) % 10_000));
        reader.check()?;
        let before = sup.status(ENDPOINT)?;
        let t_kill = Instant::now();
        let pid = sup
            .kill_worker(ENDPOINT)?
            .with_context(|| format!("kill {i}: no worker running"))?;
        killed.push((t_kill, pid));
        let st = sup.wait_ready(ENDPOINT, before.ready + 1, READY_TIMEOUT)?;
        ensure!(
            st.ready > before.ready && !st.failed && st.pid.is_some_and(|p| p != pid),
            "kill {i}: no replacement reported ready within {READY_TIMEOUT:?}: {st:?}"
        );
        reader.wait_reply_after(Instant::now())?;
        // The floor, with the reader parked: the CPUs as quiet as during a restart.
        reader.pause()?;
        let start = process_start(bin);
        reader.resume();
        floor.push(ns(start?));
    }
    let (mut gpu, replies) = rig.reader.as_mut().context("no reader")?.finish()?;
    check_device(&mut gpu)?;
    drop(gpu);
    drop(extra);
    let events = std::mem::take(&mut *lock(&events));
    // The supervisor kills and reaps its workers: none may be left.
    drop(rig);
    let pids: Vec<u32> = events
        .iter()
        .filter_map(|(_, e)| match e {
            WorkerLifecycle::Started { pid, .. } => Some(*pid),
            _ => None,
        })
        .collect();
    let left: Vec<u32> = pids.into_iter().filter(|&p| alive_switchyard(p)).collect();
    if !left.is_empty() {
        for &p in &left {
            if let Some(pid) = rustix::process::Pid::from_raw(p as i32) {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        bail!("worker processes left behind after the supervisor was dropped: {left:?}");
    }

    let mut st = stalls(&killed, &events, &replies)?;
    let mut sorted = st.first_reply.clone();
    sorted.sort_unstable();
    let (p90, max) = (pct_ms(&sorted, 0.90), pct_ms(&sorted, 1.0));
    let floor_fig = fig(
        "process start: spawn to exit of `switchyard --version`",
        &mut floor,
        Unit::Millis,
        0.0,
    )?;
    let variant = "softgpu worker (release), supervisor in process";
    rows.push(Row::new(
        "restart",
        "restart: kill -9 → first answered REGION_READ".into(),
        "restart",
        variant,
        None,
        Unit::Millis,
        fig("kill → first reply", &mut st.first_reply, Unit::Millis, 0.0)?,
        Some(floor_fig.clone()),
        None,
        Some(Target::absolute(TARGET_MS)),
        format!(
            "p90 {p90:.1} ms, max {max:.1} ms; Supervisor::kill_worker (SIGKILL) under back-to-back 4 B REGION_READs of SCRATCH → the first reply received after the replacement was spawned ({} replies the old worker had sent arrived after the kill, not counted); {kills} kills 5-15 ms apart, each after the previous replacement answered; client: one DMA window (memfd), {VECTORS} MSI-X eventfds, both queues enabled; floor: {}, between the kills with the reader parked; target: issue 11's absolute ≤ {TARGET_MS} ms",
            st.stale, floor_fig.name
        ),
    ));
    for (what, samples, note) in [
        (
            "kill → old worker reaped",
            &mut st.reaped,
            "the supervisor's wait for the killed worker returns (its Exited event)",
        ),
        (
            "kill → replacement spawned",
            &mut st.spawned,
            "the supervisor's fork+exec of `switchyard worker` returned (its Started event)",
        ),
        (
            "kill → replacement ready",
            &mut st.ready,
            "the replacement's Ready note received: descriptors handed over, black box opened, DMA windows and interrupts restored, device recovered; the first reply can beat the supervisor thread to this note",
        ),
    ] {
        rows.push(Row::new(
            "restart",
            format!("restart: {what}"),
            "restart-part",
            variant,
            None,
            Unit::Millis,
            fig(what, samples, Unit::Millis, 0.0)?,
            None,
            None,
            None,
            format!("information only, no floor: {note}"),
        ));
    }
    Ok(())
}
