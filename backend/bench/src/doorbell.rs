//! Doorbells: trapped (a BAR0 write over the socket) against mapped (a store into BAR0's
//! doorbell page the engine polls), with the engine blocking or polling, busy (back-to-back
//! submissions) and idle (each submission after a pause, so the engine sleeps and a kick is
//! needed); and what the engines' polling costs in CPU time.

use std::cell::RefCell;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use switchyard_softgpu::SoftGpuConfig;
use switchyard_softgpu::cmd::Command;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Settings, fig, wait_fences};
use crate::floors::{Echo, RoundTripThenWake, Watcher, wait_readable};
use crate::gpu::{Gpu, fence_offset, guest};
use crate::report::{Figure, Row, Target, Unit};
use crate::servers::Switchyard;
use crate::stats::{Contender, interleaved};

/// The pause before each idle sample: longer than the largest polling budget the case uses, so
/// the adaptive budget collapses and the engine sleeps.
const IDLE_GAP: Duration = Duration::from_millis(1);

/// How a contender submits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Submit {
    /// A posted `DOORBELL` write (as QEMU sends BAR writes).
    Trapped,
    /// A store into the doorbell page, with a kick if the device asks.
    Mapped,
}

/// One measured device: a softgpu server of its own.
struct Device {
    server: Switchyard,
    gpu: Gpu,
    submit: Submit,
    seq: u64,
    kicks: u64,
}

impl Device {
    fn start(dir: &Path, name: &str, spin_us: u32, submit: Submit, s: &Settings) -> Result<Self> {
        let config = SoftGpuConfig {
            vram_size: 64 << 20,
            queues: 2,
            spin_us,
            ..SoftGpuConfig::default()
        };
        let (server, _slot) = Switchyard::start_softgpu(dir, name, config)?;
        let mut gpu = Gpu::setup(server.connect(s.stall_timeout())?, 0)?;
        if submit == Submit::Mapped {
            gpu.map_doorbells(0)?;
        }
        Ok(Device {
            server,
            gpu,
            submit,
            seq: 0,
            kicks: 0,
        })
    }

    /// Enqueues a FENCE of the next value (with MSI-X vector 0 if `irq`), starts the clock and
    /// submits it; returns the value and the start time.
    fn fence(&mut self, irq: bool) -> Result<(u64, Instant)> {
        self.seq += 1;
        let v = self.seq;
        let vector = irq.then_some(0);
        let tail = self
            .gpu
            .enqueue(0, &[Command::fence(guest(fence_offset(0)), v, vector)])?;
        let t0 = Instant::now();
        match self.submit {
            Submit::Trapped => self.gpu.doorbell(0, tail, true)?,
            Submit::Mapped => self.kicks += u64::from(self.gpu.publish(0, tail)?),
        }
        Ok((v, t0))
    }

    /// Submit → the FENCE value seen in guest memory (the engine started and ran it).
    fn until_value(&mut self, stall: Option<Duration>) -> Result<Duration> {
        let (v, t0) = self.fence(false)?;
        let limit = stall.unwrap_or(Duration::MAX);
        while self.gpu.mem_load_u64(fence_offset(0))? != v {
            if t0.elapsed() > limit {
                bail!("fence {v} not seen within {limit:?}");
            }
            std::hint::spin_loop();
        }
        Ok(t0.elapsed())
    }

    /// Submit → the MSI-X eventfd readable.
    fn until_irq(&mut self, stall: Option<Duration>) -> Result<Duration> {
        let (v, t0) = self.fence(true)?;
        wait_readable(&self.gpu.irq, stall)?;
        let elapsed = t0.elapsed();
        let mut b = [0u8; 8];
        (&self.gpu.irq).read_exact(&mut b)?;
        if self.gpu.mem_load_u64(fence_offset(0))? != v {
            bail!("interrupt before the fence value");
        }
        Ok(elapsed)
    }

    fn finish(mut self) -> Result<()> {
        let last = self.seq;
        wait_fences(
            &self.gpu,
            &[(fence_offset(0), last)],
            Duration::from_secs(20),
        )?;
        self.gpu.check_queues()?;
        drop(self.gpu);
        self.server.shutdown()
    }
}

/// Runs `op` after a pause (untimed): an idle sample.
fn idle<'a>(
    mut op: impl FnMut() -> Result<Duration> + 'a,
) -> impl FnMut() -> Result<Duration> + 'a {
    move || {
        std::thread::sleep(IDLE_GAP);
        op()
    }
}

/// The doorbell case: see the module documentation.
pub fn doorbell(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let stall = s.stall_timeout();
    let budget = SoftGpuConfig::DEFAULT_SPIN_US;
    let spin = Duration::from_micros(u64::from(budget));
    let devices = [
        ("trapped, engine blocking", 0, Submit::Trapped),
        ("trapped, engine polling", budget, Submit::Trapped),
        ("mapped, engine polling", budget, Submit::Mapped),
    ];
    let mut devs = Vec::new();
    for (i, (_, spin_us, submit)) in devices.iter().enumerate() {
        devs.push(RefCell::new(Device::start(
            dir,
            &format!("doorbell-{i}"),
            *spin_us,
            *submit,
            s,
        )?));
    }
    let (wreq, wreply) = crate::cases::write_sizes(4)?;
    let mut echo = Echo::start(wreq, wreply, Duration::ZERO)?;
    let mut echo_wake = RoundTripThenWake::start(wreq, wreply, Duration::ZERO)?;
    let mut watch = Watcher::ping_pong(spin)?;
    // 20 µs: far longer than the requester takes to reach poll() and sleep.
    let mut watch_wake = Watcher::then_wake(spin, Duration::from_micros(20))?;
    let plan = s.latency_plan();
    let idle_plan = s.idle_plan();

    // Busy: back-to-back submissions.
    let busy = {
        let mut cs = vec![
            Contender::new("floor: socket ping-pong", || echo.round_trip()),
            Contender::new("floor: polled store ping-pong", || watch.once()),
            Contender::new("floor: ping-pong + eventfd", || echo_wake.once()),
            Contender::new("floor: polled store + eventfd wake-up", || {
                watch_wake.once()
            }),
        ];
        // The trapped round trip itself: a (non-posted) register write to the softgpu.
        let trapped = &devs[0];
        cs.push(Contender::new("trapped round trip", move || {
            let t0 = Instant::now();
            trapped.borrow_mut().gpu.w32(SCRATCH, 1)?;
            Ok(t0.elapsed())
        }));
        for d in &devs {
            cs.push(Contender::new("value", move || {
                d.borrow_mut().until_value(stall)
            }));
            cs.push(Contender::new("irq", move || {
                d.borrow_mut().until_irq(stall)
            }));
        }
        interleaved(&mut cs, plan)?
    };
    // Idle: each submission after a pause (the engines sleep; a mapped doorbell needs a kick).
    let idle_samples = {
        let mut cs = Vec::new();
        for d in &devs {
            cs.push(Contender::new(
                "value idle",
                idle(move || d.borrow_mut().until_value(stall)),
            ));
            cs.push(Contender::new(
                "irq idle",
                idle(move || d.borrow_mut().until_irq(stall)),
            ));
        }
        interleaved(&mut cs, idle_plan)?
    };
    let mut busy = busy.into_iter();
    let mut next = |what: &str| busy.next().with_context(|| format!("no samples: {what}"));
    let echo_fig = fig(
        "4 B REGION_WRITE-sized AF_UNIX ping-pong, blocking",
        &mut next("echo")?,
        Unit::Micros,
        0.0,
    )?;
    let watch_fig = fig(
        &format!("store ping-pong with a thread polling {budget} µs, then parked"),
        &mut next("watcher")?,
        Unit::Micros,
        0.0,
    )?;
    let echo_wake_fig = fig(
        "4 B REGION_WRITE-sized AF_UNIX ping-pong, blocking, + eventfd wake-up",
        &mut next("echo + wake")?,
        Unit::Micros,
        0.0,
    )?;
    let watch_wake_fig = fig(
        &format!(
            "store seen by a thread polling {budget} µs, whose eventfd write wakes the blocked requester"
        ),
        &mut next("watcher + wake")?,
        Unit::Micros,
        0.0,
    )?;
    let trapped_rt = fig(
        "REGION_WRITE round trip to the softgpu (SCRATCH)",
        &mut next("trapped round trip")?,
        Unit::Micros,
        0.0,
    )?;
    let mut value_figs = Vec::new();
    let mut irq_figs = Vec::new();
    for (label, _, _) in &devices {
        value_figs.push(fig(label, &mut next("value")?, Unit::Micros, 0.0)?);
        irq_figs.push(fig(label, &mut next("irq")?, Unit::Micros, 0.0)?);
    }
    let mut idle_samples = idle_samples.into_iter();
    let mut idle_value = Vec::new();
    let mut idle_irq = Vec::new();
    for (label, _, _) in &devices {
        let mut v = idle_samples.next().context("no idle samples")?;
        idle_value.push(fig(label, &mut v, Unit::Micros, 0.0)?);
        let mut v = idle_samples.next().context("no idle samples")?;
        idle_irq.push(fig(label, &mut v, Unit::Micros, 0.0)?);
    }

    let value_case = "FENCE: submit → value in guest memory";
    let irq_case = "FENCE irq: submit → eventfd readable";
    let row = |case: &str,
               op: &str,
               variant: &str,
               ours: &Figure,
               floor: &Figure,
               target: Option<Target>,
               note: String| {
        Row::new(
            "doorbell",
            case.into(),
            op,
            variant,
            None,
            Unit::Micros,
            ours.clone(),
            Some(floor.clone()),
            None,
            target,
            note,
        )
    };
    let trapped_note = "posted DOORBELL write (as QEMU sends BAR writes), then spinning on the fence slot; floor: the socket round trip a trapped access costs";
    for (i, (label, _, submit)) in devices.iter().enumerate() {
        let (ours, ours_irq) = (&value_figs[i], &irq_figs[i]);
        match submit {
            Submit::Trapped => {
                rows.push(row(
                    value_case,
                    "value",
                    &format!("{label}, busy"),
                    ours,
                    &echo_fig,
                    None,
                    trapped_note.into(),
                ));
                rows.push(row(
                    irq_case,
                    "irq",
                    &format!("{label}, busy"),
                    ours_irq,
                    &echo_wake_fig,
                    Some(Target {
                        floor_ratio: 1.2,
                        beat_peer: false,
                        plus: 0.0,
                    }),
                    "posted DOORBELL write, then poll() on the MSI-X eventfd; floor: socket round trip + eventfd wake-up".into(),
                ));
            }
            Submit::Mapped => {
                rows.push(row(
                    value_case,
                    "value",
                    &format!("{label}, busy"),
                    ours,
                    &trapped_rt,
                    Some(Target {
                        floor_ratio: 0.1,
                        beat_peer: false,
                        plus: 0.0,
                    }),
                    "tail stored into the doorbell page (kick only if asked), then spinning on the fence slot; against the trapped round trip, a REGION_WRITE to the same kind of device measured alongside (target ≤ 0.1×)".into(),
                ));
                rows.push(row(
                    value_case,
                    "value-socket",
                    &format!("{label}, busy"),
                    ours,
                    &echo_fig,
                    None,
                    "the same samples against the AF_UNIX ping-pong under any trapped access"
                        .into(),
                ));
                rows.push(row(
                    value_case,
                    "value-floor",
                    &format!("{label}, busy"),
                    ours,
                    &watch_fig,
                    None,
                    "the same samples against their own floor: a store ping-pong with a thread that polls like the engine".into(),
                ));
                rows.push(row(
                    irq_case,
                    "irq",
                    &format!("{label}, busy"),
                    ours_irq,
                    &watch_wake_fig,
                    Some(Target {
                        floor_ratio: 1.2,
                        beat_peer: false,
                        plus: 0.0,
                    }),
                    "tail stored, then poll() on the MSI-X eventfd; floor: a thread polling like the engine sees a store and writes an eventfd the requester sleeps on (written 20 µs late so the requester surely sleeps; the delay subtracted): one cross-CPU wake-up".into(),
                ));
            }
        }
    }
    let idle_note = format!(
        "each submission {} ms after the last: the adaptive budget has dropped to zero, the engine sleeps (a mapped doorbell needs its kick, a posted trapped write)",
        IDLE_GAP.as_millis()
    );
    for (i, (label, _, _)) in devices.iter().enumerate() {
        rows.push(row(
            value_case,
            "value-idle",
            &format!("{label}, idle"),
            &idle_value[i],
            &echo_fig,
            None,
            idle_note.clone(),
        ));
        rows.push(row(
            irq_case,
            "irq-idle",
            &format!("{label}, idle"),
            &idle_irq[i],
            &echo_wake_fig,
            None,
            idle_note.clone(),
        ));
    }
    let kicks: Vec<String> = devs
        .iter()
        .zip(&devices)
        .filter(|(_, (_, _, submit))| *submit == Submit::Mapped)
        .map(|(d, (label, _, _))| format!("{label}: {} kicks", d.borrow().kicks))
        .collect();
    eprintln!("doorbell: {}", kicks.join(", "));
    for d in devs {
        d.into_inner().finish()?;
    }
    cpu_rows(dir, s, rows)
}

/// CPU time of this process's softgpu engine threads (`softgpu-q*`), from the scheduler's
/// per-thread accounting (`/proc/self/task/*/schedstat`, ns on CPU).
fn engine_cpu() -> Result<Duration> {
    let mut total = 0u64;
    for task in std::fs::read_dir("/proc/self/task").context("list threads")? {
        let path = task?.path();
        let Ok(comm) = std::fs::read_to_string(path.join("comm")) else {
            continue;
        };
        if !comm.starts_with("softgpu-q") {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(path.join("schedstat")) else {
            continue;
        };
        let ns: u64 = stat
            .split_whitespace()
            .next()
            .and_then(|f| f.parse().ok())
            .context("parse schedstat")?;
        total += ns;
    }
    Ok(Duration::from_nanos(total))
}

/// Engine CPU time per second over `window`: idle (no submissions), then with one mapped
/// FENCE per millisecond. Only `d`'s engines run meanwhile (the other devices are gone).
fn engine_load(d: &mut Device, window: Duration, stall: Option<Duration>) -> Result<(u64, u64)> {
    let per_second = |cpu: Duration, wall: Duration| -> u64 {
        (cpu.as_nanos() as f64 / wall.as_secs_f64() / 1000.0) as u64
    };
    // Busy first, so an adaptive budget starts at its largest.
    for _ in 0..1000 {
        d.until_value(stall)?;
    }
    let (c0, t0) = (engine_cpu()?, Instant::now());
    std::thread::sleep(window);
    let idle = per_second(engine_cpu()? - c0, t0.elapsed());
    let (c0, t0) = (engine_cpu()?, Instant::now());
    while t0.elapsed() < window {
        d.until_value(stall)?;
        std::thread::sleep(Duration::from_millis(1));
    }
    let sporadic = per_second(engine_cpu()? - c0, t0.elapsed());
    Ok((idle, sporadic))
}

/// What the engines' polling costs: CPU time of one device's engines per second, idle (no
/// submissions) and at one mapped FENCE per millisecond (sporadic work: the budget adapts
/// down), reported as µs of CPU per second (10 000 µs/s = 1 % of a core). The sporadic
/// figure's floor is the same load on a device that never polls (`spin=0`): what the jobs
/// themselves cost (wake-up, FENCE, sleep).
fn cpu_rows(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let stall = s.stall_timeout();
    let window = if s.quick {
        Duration::from_millis(500)
    } else {
        Duration::from_secs(2)
    };
    let mut loads = Vec::new();
    for (name, spin_us) in [
        ("doorbell-cpu", SoftGpuConfig::DEFAULT_SPIN_US),
        ("doorbell-cpu-nopoll", 0),
    ] {
        let mut d = Device::start(dir, name, spin_us, Submit::Mapped, s)?;
        loads.push(engine_load(&mut d, window, stall)?);
        d.finish()?;
    }
    let [(idle, sporadic), (_, sporadic_nopoll)] = loads[..] else {
        bail!("missing CPU figures");
    };
    let one = |name: &str, us: u64| Figure {
        name: name.into(),
        p50: us as f64,
        p99: us as f64,
        n: 1,
    };
    let variant = format!(
        "mapped, adaptive budget ≤ {} µs",
        SoftGpuConfig::DEFAULT_SPIN_US
    );
    rows.push(Row::new(
        "doorbell",
        "engine CPU per second, idle".into(),
        "cpu-idle",
        &variant,
        None,
        Unit::Micros,
        one("engines idle", idle),
        None,
        None,
        Some(Target::absolute(10_000.0)),
        format!(
            "CPU time of both engine threads over {} ms with no submissions, right after a busy phase (µs per second; target ≤ 1 % of a core)",
            window.as_millis()
        ),
    ));
    rows.push(Row::new(
        "doorbell",
        "engine CPU per second, one job per ms".into(),
        "cpu-sporadic",
        &variant,
        None,
        Unit::Micros,
        one("engines, sporadic", sporadic),
        Some(one("the same load on an engine that never polls", sporadic_nopoll)),
        None,
        None,
        "one FENCE through the doorbell page per ms: the budget drops to zero when sleeps outlast it, so the engine sleeps between jobs instead of polling; floor: the same load with polling off (spin=0)".into(),
    ));
    Ok(())
}
