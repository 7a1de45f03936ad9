//! What the benchmark cases share: their settings and sample plans, figures, message sizes,
//! the Switchyard variants they connect to, and small helpers. Each case (one file per case)
//! starts what it needs, measures ours, its floor and (where there is one) the peer
//! interleaved block by block, and appends rows.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use switchyard_client::Client;
use switchyard_proto::{Request, encode_region_write_reply, region_read_reply_buffer};

use crate::gpu::Gpu;
use crate::report::{Figure, Unit};
use crate::servers::{DeviceKind, Switchyard};
use crate::stats::{Plan, Summary};

/// Settings shared by the cases.
#[derive(Debug)]
pub struct Settings {
    /// Short CI mode.
    pub quick: bool,
    /// Adaptive-polling budget of the spin variants.
    pub spin: Duration,
    /// The `switchyard` binary the restart case starts workers of.
    pub switchyard_bin: std::path::PathBuf,
}

/// Quick-mode plan of the round-trip and latency cases.
pub(crate) const QUICK: Plan = Plan::new(50, 500, 5);
/// Quick-mode plan of the cases with many points (size sweep, WRITE_MULTI).
pub(crate) const QUICK_SHORT: Plan = Plan::new(20, 100, 2);
/// Full-mode plan of the cases with many points: 10k samples per point.
pub(crate) const FULL_POINT: Plan = Plan::new(500, 10_000, 50);

impl Settings {
    pub(crate) fn spin_label(&self) -> String {
        format!("spin {}µs", self.spin.as_micros())
    }

    /// `softgpu blocking`, `regfile spin 50µs`.
    pub(crate) fn variant_label(&self, kind: DeviceKind, spin: bool) -> String {
        if spin {
            format!("{} {}", kind.name(), self.spin_label())
        } else {
            format!("{} blocking", kind.name())
        }
    }

    /// Independent setups (fresh servers, floors, peer) the round-trip figures are pooled
    /// from: thread placement on this kind of machine is sticky for a while and bimodal
    /// (same-CPU wake-ups vs cross-CPU ones), so one setup can land in either mode.
    pub fn reps(&self) -> usize {
        if self.quick { 1 } else { 4 }
    }

    /// How long a client waits for a reply, and a case for an interrupt, before the run fails:
    /// 30 s in quick mode, so that a stalled server fails CI instead of hanging it; no limit in
    /// full mode, where the measured clients are configured like a VMM (no socket timeouts).
    /// Timings are never asserted either way.
    pub fn stall_timeout(&self) -> Option<Duration> {
        self.quick.then_some(Duration::from_secs(30))
    }

    /// `quick` in quick mode, `full` otherwise.
    pub(crate) fn plan(&self, quick: Plan, full: Plan) -> Plan {
        if self.quick { quick } else { full }
    }

    /// Per-repetition plan: 4 × 5000 = 20k samples per contender in full mode, in short
    /// interleaved blocks.
    pub(crate) fn rep_plan(&self) -> Plan {
        self.plan(QUICK, Plan::new(1000, 5000, 25))
    }

    /// Latency plans: ≥ 10k samples in full mode.
    pub(crate) fn latency_plan(&self) -> Plan {
        self.plan(QUICK, Plan::new(2000, 20_000, 100))
    }

    /// Plans of samples that each wait for an idle gap first (1 ms): fewer of them.
    pub(crate) fn idle_plan(&self) -> Plan {
        self.plan(Plan::new(10, 100, 5), Plan::new(100, 1000, 20))
    }
}

fn summary(name: &str, samples: &mut [u64]) -> Result<Summary> {
    Summary::of(samples).with_context(|| format!("no samples for {name}"))
}

pub(crate) fn fig(name: &str, samples: &mut [u64], unit: Unit, work: f64) -> Result<Figure> {
    Ok(Figure::from_summary(
        name,
        &summary(name, samples)?,
        unit,
        work,
    ))
}

/// Byte counts of a REGION_READ of `count` bytes: (request, reply).
pub fn read_sizes(count: u32) -> Result<(usize, usize)> {
    let mut req = Vec::new();
    Request::RegionRead {
        offset: 0,
        region: 0,
        count,
    }
    .encode(0, false, &mut req)?;
    let mut reply = Vec::new();
    region_read_reply_buffer(&mut reply, 0, 0, 0, count)?;
    Ok((req.len(), reply.len()))
}

/// Byte counts of a REGION_WRITE of `count` bytes: (request, reply).
pub fn write_sizes(count: u32) -> Result<(usize, usize)> {
    let data = vec![0u8; count as usize];
    let mut req = Vec::new();
    Request::RegionWrite {
        offset: 0,
        region: 0,
        data: &data,
    }
    .encode(0, false, &mut req)?;
    let mut reply = Vec::new();
    encode_region_write_reply(&mut reply, 0, 0, 0, count)?;
    Ok((req.len(), reply.len()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
}

impl Op {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }

    pub(crate) fn sizes(self, count: u32) -> Result<(usize, usize)> {
        match self {
            Op::Read => read_sizes(count),
            Op::Write => write_sizes(count),
        }
    }
}

pub(crate) fn timed_access(
    c: &mut Client,
    op: Op,
    region: u32,
    offset: u64,
    buf: &mut [u8],
) -> Result<Duration> {
    let t0 = Instant::now();
    match op {
        Op::Read => c.region_read(region, offset, buf)?,
        Op::Write => c.region_write(region, offset, buf)?,
    }
    Ok(t0.elapsed())
}

/// One connected Switchyard variant.
pub(crate) struct Variant {
    pub(crate) label: String,
    pub(crate) spin: bool,
    // Before `server`: a variant dropped on an error path disconnects before the server stops.
    pub(crate) client: Client,
    pub(crate) server: Switchyard,
}

impl Variant {
    /// Starts `kind` blocking (`spin: None`) or with adaptive polling, and connects to it.
    pub(crate) fn start(
        dir: &Path,
        kind: DeviceKind,
        spin: Option<Duration>,
        s: &Settings,
        tag: &str,
    ) -> Result<Variant> {
        let policy = if spin.is_some() { "spin" } else { "block" };
        let name = format!("{}-{policy}-{tag}", kind.name());
        let server = Switchyard::start(dir, &name, kind, spin.unwrap_or_default())?;
        let client = server.connect(s.stall_timeout())?;
        Ok(Variant {
            label: s.variant_label(kind, spin.is_some()),
            spin: spin.is_some(),
            client,
            server,
        })
    }

    /// Disconnects, stops the server and reports how its thread ended.
    pub(crate) fn shutdown(self) -> Result<()> {
        drop(self.client);
        self.server.shutdown()
    }
}

/// softgpu and the register file, each blocking and spinning.
pub(crate) fn four_variants(dir: &Path, s: &Settings, tag: &str) -> Result<Vec<Variant>> {
    [DeviceKind::SoftGpu, DeviceKind::RegFile]
        .into_iter()
        .flat_map(|kind| [(kind, None), (kind, Some(s.spin))])
        .map(|(kind, spin)| Variant::start(dir, kind, spin, s, tag))
        .collect()
}

pub(crate) fn shutdown_all(vs: Vec<Variant>) -> Result<()> {
    for v in vs {
        v.shutdown()?;
    }
    Ok(())
}

/// Appends each contender's samples of one repetition to the pooled samples.
pub(crate) fn pool(pooled: &mut Vec<Vec<u64>>, results: Vec<Vec<u64>>) {
    if pooled.is_empty() {
        *pooled = results;
    } else {
        for (p, r) in pooled.iter_mut().zip(results) {
            p.extend(r);
        }
    }
}

/// Waits until every `(offset, value)` fence slot holds its value: spins for 20 µs, then yields
/// between checks (the engines need the CPUs more than this thread does).
pub(crate) fn wait_fences(gpu: &Gpu, fences: &[(u64, u64)], timeout: Duration) -> Result<()> {
    let start = Instant::now();
    let mut spins = 0u32;
    loop {
        let mut all = true;
        for &(off, v) in fences {
            if gpu.mem_load_u64(off)? != v {
                all = false;
                break;
            }
        }
        if all {
            return Ok(());
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            if start.elapsed() > timeout {
                bail!("fence not seen within {timeout:?}");
            }
            if start.elapsed() < Duration::from_micros(20) {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
    }
}

/// `n` distinct pages out of `pages`, one at a random place in each of `n` equal strides
/// (uniform and sparse, like a guest touching scattered pages: the worst case for a scan that
/// skips clean words, which we do not rely on).
pub(crate) fn scattered_pages(pages: u64, n: u64, seed: u64) -> Vec<u64> {
    let mut x = seed | 1;
    let stride = (pages / n.max(1)).max(1);
    (0..n.min(pages))
        .map(|i| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            i * stride + x % stride
        })
        .collect()
}

/// `4 KiB`, `64 MiB`, `16 GiB`, `512 B`.
pub fn human(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{} GiB", bytes >> 30)
    } else if bytes >= 1 << 20 && bytes.is_multiple_of(1 << 20) {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes.is_multiple_of(1 << 10) {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}
