//! The benchmark cases. Each one starts what it needs, measures ours, its floor and (where
//! there is one) the peer interleaved block by block, and appends rows.

use std::cell::RefCell;
use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use switchyard_client::Client;
use switchyard_proto::{
    Records, Reply, Request, WriteMultiEntry, encode_region_write_reply, region_read_reply_buffer,
};
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::SCRATCH;

use crate::floors::{
    BitmapScan, Echo, Memcpy, Memcpy2, PostedStream, RoundTripThenWake, SharedBitmap, WireScan,
    wait_readable,
};
use crate::gpu::{DATA_OFFSET, Gpu, QUEUES, fence_offset, guest};
use crate::report::{Figure, Row, Target, Unit};
use crate::servers::{DeviceKind, Peer, Switchyard};
use crate::stats::{Contender, Plan, Summary, interleaved};

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
const QUICK: Plan = Plan::new(50, 500, 5);
/// Quick-mode plan of the cases with many points (size sweep, WRITE_MULTI).
const QUICK_SHORT: Plan = Plan::new(20, 100, 2);
/// Full-mode plan of the cases with many points: 10k samples per point.
const FULL_POINT: Plan = Plan::new(500, 10_000, 50);

impl Settings {
    fn spin_label(&self) -> String {
        format!("spin {}µs", self.spin.as_micros())
    }

    /// `softgpu blocking`, `regfile spin 50µs`.
    fn variant_label(&self, kind: DeviceKind, spin: bool) -> String {
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
    fn plan(&self, quick: Plan, full: Plan) -> Plan {
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

fn multi_sizes(entries: &[WriteMultiEntry]) -> Result<(usize, usize)> {
    let mut req = Vec::new();
    Request::RegionWriteMulti(Records::from_slice(entries)).encode(0, false, &mut req)?;
    let mut reply = Vec::new();
    Reply::RegionWriteMulti {
        wr_cnt: entries.len() as u64,
    }
    .encode(0, &mut reply)?;
    Ok((req.len(), reply.len()))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Read,
    Write,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }

    fn sizes(self, count: u32) -> Result<(usize, usize)> {
        match self {
            Op::Read => read_sizes(count),
            Op::Write => write_sizes(count),
        }
    }
}

fn timed_access(
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
    label: String,
    spin: bool,
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
    fn shutdown(self) -> Result<()> {
        drop(self.client);
        self.server.shutdown()
    }
}

/// softgpu and the register file, each blocking and spinning.
fn four_variants(dir: &Path, s: &Settings, tag: &str) -> Result<Vec<Variant>> {
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

/// A group of REGION_READ / REGION_WRITE round trips: Switchyard variants against the blocking
/// and the spinning AF_UNIX floor (each variant against the one with its own policy) and the
/// `vfio_user` peer, every point interleaved, pooled over `reps` independent setups.
struct RoundTrips<'a> {
    group: &'static str,
    variants: &'a [(DeviceKind, Option<Duration>)],
    sizes: &'a [u32],
    /// Where every access goes, on Switchyard and on the peer.
    region: u32,
    offset: u64,
    reps: usize,
    /// Plan of one repetition.
    plan: Plan,
    /// Whether rows have the round-trip target.
    target: bool,
}

/// The round-trip target: ≤ 1.10× the floor with the same polling policy; "better than the
/// peer" only where the comparison is like for like — the peer is a blocking server with the
/// trivial register-file backend, so only the blocking regfile row is held to it.
fn rt_target(kind: DeviceKind, spin: bool) -> Target {
    Target {
        floor_ratio: 1.10,
        beat_peer: kind == DeviceKind::RegFile && !spin,
        plus: 0.0,
    }
}

impl RoundTrips<'_> {
    fn run(&self, dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
        let points: Vec<(Op, u32)> = [Op::Read, Op::Write]
            .into_iter()
            .flat_map(|op| self.sizes.iter().map(move |&size| (op, size)))
            .collect();
        let mut pooled: Vec<Vec<Vec<u64>>> = vec![Vec::new(); points.len()];
        for rep in 0..self.reps {
            let tag = format!("{}{rep}", self.group);
            let mut vs = self
                .variants
                .iter()
                .map(|&(kind, spin)| Variant::start(dir, kind, spin, s, &tag))
                .collect::<Result<Vec<_>>>()?;
            let peer = Peer::start(dir, &format!("peer-{tag}"))?;
            let mut peer_client = peer.connect(s.stall_timeout())?;
            for (&(op, size), pooled) in points.iter().zip(pooled.iter_mut()) {
                let (req, reply) = op.sizes(size)?;
                let mut floor_b = Echo::start(req, reply, Duration::ZERO)?;
                let mut floor_s = Echo::start(req, reply, s.spin)?;
                // Order: the two floors, the variants, the peer (read back below).
                let mut cs = vec![
                    Contender::new("floor blocking", || floor_b.round_trip()),
                    Contender::new("floor spin", || floor_s.round_trip()),
                ];
                let (region, offset) = (self.region, self.offset);
                for v in vs.iter_mut() {
                    let c = &mut v.client;
                    let mut buf = vec![7u8; size as usize];
                    cs.push(Contender::new("switchyard", move || {
                        timed_access(c, op, region, offset, &mut buf)
                    }));
                }
                let pc = &mut peer_client;
                let mut buf = vec![7u8; size as usize];
                cs.push(Contender::new("peer", move || {
                    timed_access(pc, op, region, offset, &mut buf)
                }));
                pool(pooled, interleaved(&mut cs, self.plan)?);
            }
            drop(peer_client);
            drop(peer);
            shutdown_all(vs)?;
        }
        for (&(op, size), results) in points.iter().zip(pooled.iter_mut()) {
            let (req, reply) = op.sizes(size)?;
            let [fb, fs, rest @ ..] = results.as_mut_slice() else {
                bail!("{}: missing floor samples", self.group);
            };
            let Some((peer_s, ours)) = rest.split_last_mut() else {
                bail!("{}: missing peer samples", self.group);
            };
            let floor_block = fig("AF_UNIX ping-pong, blocking", fb, Unit::Micros, 0.0)?;
            let floor_spin = fig(
                &format!("AF_UNIX ping-pong, echo {}", s.spin_label()),
                fs,
                Unit::Micros,
                0.0,
            )?;
            let peer_fig = fig("vfio_user 0.1.7 Server", peer_s, Unit::Micros, 0.0)?;
            for (&(kind, spin), samples) in self.variants.iter().zip(ours.iter_mut()) {
                let spin = spin.is_some();
                let label = s.variant_label(kind, spin);
                let floor = if spin { &floor_spin } else { &floor_block };
                rows.push(Row::new(
                    self.group,
                    format!(
                        "REGION_{} {}",
                        op.name().to_uppercase(),
                        human(u64::from(size))
                    ),
                    op.name(),
                    &label,
                    Some(u64::from(size)),
                    Unit::Micros,
                    fig(&label, samples, Unit::Micros, 0.0)?,
                    Some(floor.clone()),
                    Some(peer_fig.clone()),
                    self.target.then(|| rt_target(kind, spin)),
                    format!(
                        "{req} B request / {reply} B reply; floor: {}; peer: blocking vfio_user server, regfile backend",
                        floor.name
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Trapped 4-byte REGION_READ / REGION_WRITE round trips: softgpu BAR0 `SCRATCH` and the
/// register file (region 0, same offset), blocking and spinning. Pooled over
/// [`Settings::reps`] independent setups.
pub fn round_trip(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    RoundTrips {
        group: "round-trip",
        variants: &[
            (DeviceKind::SoftGpu, None),
            (DeviceKind::SoftGpu, Some(s.spin)),
            (DeviceKind::RegFile, None),
            (DeviceKind::RegFile, Some(s.spin)),
        ],
        sizes: &[4],
        region: BAR_REGS,
        offset: SCRATCH,
        reps: s.reps(),
        plan: s.rep_plan(),
        target: true,
    }
    .run(dir, s, rows)
}

/// The journal's target: a journaled round trip ≤ 1.05× the same server's without crash
/// continuity (issue 11, "round-trip cost of the journal").
const JOURNAL_TARGET: Target = Target {
    floor_ratio: 1.05,
    beat_peer: false,
    plus: 0.0,
};

/// The cost of crash continuity on the data path: 4-byte REGION_READ / REGION_WRITE round
/// trips of the softgpu's `SCRATCH`, blocking, against the softgpu server as it is served
/// standalone and the same server with continuity on, as a pool worker serves it
/// ([`DeviceKind::SoftGpuJournal`]); the AF_UNIX floor interleaved with both; pooled over
/// [`Settings::reps`] independent setups like the round-trip rows. Rows: each server against
/// the floor, and the journaled one against the plain one (the issue's ≤ 1.05×).
pub fn journal(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    const KINDS: [DeviceKind; 2] = [DeviceKind::SoftGpu, DeviceKind::SoftGpuJournal];
    let ops = [Op::Read, Op::Write];
    let mut pooled: Vec<Vec<Vec<u64>>> = vec![Vec::new(); ops.len()];
    for rep in 0..s.reps() {
        let tag = format!("journal{rep}");
        let mut vs = KINDS
            .iter()
            .map(|&kind| Variant::start(dir, kind, None, s, &tag))
            .collect::<Result<Vec<_>>>()?;
        for (&op, pooled) in ops.iter().zip(pooled.iter_mut()) {
            let (req, reply) = op.sizes(4)?;
            let mut floor = Echo::start(req, reply, Duration::ZERO)?;
            // Order: the floor, then the variants in `KINDS` order (read back below).
            let mut cs = vec![Contender::new("floor blocking", || floor.round_trip())];
            for v in vs.iter_mut() {
                let c = &mut v.client;
                let mut buf = 0x5a5a_0000u32.to_le_bytes();
                cs.push(Contender::new("switchyard", move || {
                    timed_access(c, op, BAR_REGS, SCRATCH, &mut buf)
                }));
            }
            pool(pooled, interleaved(&mut cs, s.rep_plan())?);
        }
        // Positive control: continuity was on (black box, VRAM and the connection were put
        // into custody), and off on the plain server.
        let held: Vec<usize> = vs.iter().map(|v| v.server.custody_received()).collect();
        if !matches!(held.as_slice(), [0, n] if *n >= 3) {
            bail!(
                "journal: descriptors in custody {held:?}, expected none without continuity and black box + VRAM + connection with it"
            );
        }
        shutdown_all(vs)?;
    }
    for (&op, results) in ops.iter().zip(pooled.iter_mut()) {
        let (req, reply) = op.sizes(4)?;
        let [fb, plain, journaled] = results.as_mut_slice() else {
            bail!("journal: expected the floor and two servers");
        };
        let case = format!("REGION_{} 4 B", op.name().to_uppercase());
        let floor = fig("AF_UNIX ping-pong, blocking", fb, Unit::Micros, 0.0)?;
        let plain_label = "softgpu blocking";
        let journaled_label = "softgpu blocking, journaled";
        let plain = fig(plain_label, plain, Unit::Micros, 0.0)?;
        let journaled = fig(journaled_label, journaled, Unit::Micros, 0.0)?;
        let sizes = format!("{req} B request / {reply} B reply");
        rows.push(Row::new(
            "journal",
            case.clone(),
            op.name(),
            plain_label,
            Some(4),
            Unit::Micros,
            plain.clone(),
            Some(floor.clone()),
            None,
            None,
            format!(
                "{sizes}; without crash continuity (as `switchyard serve`): the reference of the journaled row; floor: {}",
                floor.name
            ),
        ));
        rows.push(Row::new(
            "journal",
            case.clone(),
            op.name(),
            journaled_label,
            Some(4),
            Unit::Micros,
            journaled.clone(),
            Some(floor.clone()),
            None,
            None,
            format!(
                "{sizes}; with crash continuity as a pool worker serves it: peeked read, receive journal published before the consume and before the reply, reply sent with sendfile from the black box's reply area, device state mirrored; custody over a real SOCK_SEQPACKET channel; floor: {}",
                floor.name
            ),
        ));
        rows.push(Row::new(
            "journal",
            format!("{case}: journal cost"),
            "journal",
            journaled_label,
            Some(4),
            Unit::Micros,
            journaled,
            Some(Figure {
                name: format!("{plain_label} without crash continuity, same run"),
                ..plain
            }),
            None,
            Some(JOURNAL_TARGET),
            "ratio = journaled / plain softgpu round trip at p50, both interleaved with the floor above in the same run (issue 11: ≤ 1.05× today's round trip)".into(),
        ));
    }
    Ok(())
}

/// Sizes of the latency-vs-size sweep.
pub const SWEEP_SIZES: [u32; 7] = [4, 64, 512, 4096, 32 << 10, 256 << 10, 1 << 20];

/// REGION_READ / REGION_WRITE round trips of growing size on the register file's 1 MiB
/// region, against the floors and the peer (no targets).
pub fn size_sweep(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let reps = s.reps().min(2);
    let plan = s.plan(QUICK_SHORT, FULL_POINT);
    RoundTrips {
        group: "size-sweep",
        variants: &[
            (DeviceKind::RegFile, None),
            (DeviceKind::RegFile, Some(s.spin)),
        ],
        sizes: &SWEEP_SIZES,
        region: 1,
        offset: 0,
        reps,
        plan: Plan {
            samples: plan.samples / reps,
            blocks: plan.blocks / reps,
            ..plan
        },
        target: false,
    }
    .run(dir, s, rows)
}

/// The two settings of the decomposition, each with its own floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Blocking,
    Polling,
}

/// One contender of the decomposition: a floor (`note: None`) or a row against its mode's
/// floor.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    mode: Mode,
    label: String,
    note: Option<&'static str>,
}

/// Where the time of a 4-byte REGION_READ round trip goes, blocking: the floor, a raw client
/// (pre-encoded request, one read of the reply) against the Switchyard server, our client
/// against a fake server that only echoes a canned reply, and our client against Switchyard;
/// and with both sides polling: a polling raw client against a spinning server, against a floor
/// whose two sides poll too.
pub fn decompose(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let mut parts = Vec::new();
    let mut pooled = Vec::new();
    for rep in 0..s.reps() {
        let (p, results) = decompose_once(dir, s, rep)?;
        if !parts.is_empty() && parts != p {
            bail!("decompose: the contenders changed between repetitions");
        }
        parts = p;
        pool(&mut pooled, results);
    }
    for (mode, case) in [
        (Mode::Blocking, "REGION_READ 4 B, blocking"),
        (Mode::Polling, "REGION_READ 4 B, both sides poll"),
    ] {
        let mut floor = None;
        for (part, samples) in parts.iter().zip(pooled.iter_mut()) {
            if part.mode != mode {
                continue;
            }
            let Some(note) = part.note else {
                floor = Some(fig(&part.label, samples, Unit::Micros, 0.0)?);
                continue;
            };
            let floor = floor
                .clone()
                .context("decompose: a floor comes before its rows")?;
            rows.push(Row::new(
                "decompose",
                case.into(),
                "decompose",
                &part.label,
                Some(4),
                Unit::Micros,
                fig(&part.label, samples, Unit::Micros, 0.0)?,
                Some(floor),
                None,
                None,
                note.to_owned(),
            ));
        }
    }
    Ok(())
}

/// One setup of the decomposition: its contenders and their samples, in the same order.
fn decompose_once(dir: &Path, s: &Settings, rep: usize) -> Result<(Vec<Part>, Vec<Vec<u64>>)> {
    let (req_len, reply_len) = read_sizes(4)?;
    let stall = s.stall_timeout();
    let server = Switchyard::start(
        dir,
        &format!("regfile-decompose{rep}"),
        DeviceKind::RegFile,
        Duration::ZERO,
    )?;
    let mut client = server.connect(stall)?;
    let mut req = Vec::new();
    Request::RegionRead {
        offset: SCRATCH,
        region: 0,
        count: 4,
    }
    .encode(0, false, &mut req)?;
    // On a clone of the client's socket: the same socket options (none in full mode).
    let mut raw = Echo::raw_client(client.socket().try_clone()?, req.clone(), reply_len);
    let mut reply = Vec::new();
    region_read_reply_buffer(&mut reply, 0, SCRATCH, 0, 4)?;
    let (a, b) = std::os::unix::net::UnixStream::pair()?;
    let fake = Echo::fake_server(b, req_len, reply)?;
    let mut fake_client = Client::without_handshake(a, crate::servers::vmm_client_config(stall))?;
    let mut floor = Echo::start(req_len, reply_len, Duration::ZERO)?;
    // Both sides polling: the best adaptive polling can do (a client that also polls).
    let spin_server = Switchyard::start(
        dir,
        &format!("regfile-decompose-spin{rep}"),
        DeviceKind::RegFile,
        s.spin,
    )?;
    let spin_client = spin_server.connect(stall)?;
    let mut raw_spin =
        Echo::raw_client(spin_client.socket().try_clone()?, req, reply_len).client_polls(stall)?;
    let mut floor_spin = Echo::start(req_len, reply_len, s.spin)?.client_polls(stall)?;
    let (parts, results) = {
        let part = |mode, label: &str, note| Part {
            mode,
            label: label.to_owned(),
            note,
        };
        let mut b1 = [0u8; 4];
        let mut b2 = [0u8; 4];
        let c = &mut client;
        let fc = &mut fake_client;
        let table = vec![
            (
                part(Mode::Blocking, "AF_UNIX ping-pong, blocking", None),
                Contender::new("floor", || floor.round_trip()),
            ),
            (
                part(
                    Mode::Blocking,
                    "raw client → switchyard",
                    Some(
                        "pre-encoded request, one read of the reply, on switchyard-client's socket: the server's cost",
                    ),
                ),
                Contender::new("raw client", || raw.round_trip()),
            ),
            (
                part(
                    Mode::Blocking,
                    "switchyard-client → fake server",
                    Some("an echo thread that returns a canned reply: the client's cost"),
                ),
                Contender::new("client vs fake", move || {
                    timed_access(fc, Op::Read, 0, SCRATCH, &mut b1)
                }),
            ),
            (
                part(
                    Mode::Blocking,
                    "switchyard-client → switchyard",
                    Some("regfile, as in the round-trip rows"),
                ),
                Contender::new("client vs switchyard", move || {
                    timed_access(c, Op::Read, 0, SCRATCH, &mut b2)
                }),
            ),
            (
                part(
                    Mode::Polling,
                    &format!("AF_UNIX ping-pong, both sides poll ({})", s.spin_label()),
                    None,
                ),
                Contender::new("polling floor", || floor_spin.round_trip()),
            ),
            (
                part(
                    Mode::Polling,
                    &format!("polling raw client → switchyard {}", s.spin_label()),
                    Some("client polls with non-blocking reads; floor: echo polls too"),
                ),
                Contender::new("polling raw client", || raw_spin.round_trip()),
            ),
        ];
        let (parts, mut cs): (Vec<Part>, Vec<Contender<'_>>) = table.into_iter().unzip();
        (parts, interleaved(&mut cs, s.rep_plan())?)
    };
    drop(raw_spin);
    drop(spin_client);
    spin_server.shutdown()?;
    drop(raw);
    drop(fake_client);
    let _ = fake.join();
    drop(client);
    server.shutdown()?;
    Ok((parts, results))
}

/// `n` posted 4-byte REGION_WRITEs, then one 4-byte REGION_READ as a completion barrier.
fn posted_batch(c: &mut Client, region: u32, n: usize) -> Result<Duration> {
    let t0 = Instant::now();
    for i in 0..n {
        c.region_write_posted(region, SCRATCH, &(i as u32).to_le_bytes())?;
    }
    let mut b = [0u8; 4];
    c.region_read(region, SCRATCH, &mut b)?;
    let d = t0.elapsed();
    if u32::from_le_bytes(b) != (n - 1) as u32 {
        bail!("posted writes were not applied in order");
    }
    Ok(d)
}

/// Posted writes per second.
pub fn posted(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let n = 256usize;
    let mut vs = four_variants(dir, s, "posted")?;
    let peer = Peer::start(dir, "peer-posted")?;
    let mut peer_client = peer.connect(s.stall_timeout())?;
    let (wreq, _) = write_sizes(4)?;
    let (rreq, rreply) = read_sizes(4)?;
    let mut floor = PostedStream::start(n, wreq, rreq, rreply)?;
    let plan = s.plan(Plan::new(3, 30, 3), Plan::new(100, 10_000, 50));
    let mut results = {
        let mut cs = vec![Contender::new("floor", || floor.batch())];
        for v in vs.iter_mut() {
            let c = &mut v.client;
            cs.push(Contender::new("switchyard", move || {
                posted_batch(c, BAR_REGS, n)
            }));
        }
        let pc = &mut peer_client;
        cs.push(Contender::new("peer", move || posted_batch(pc, 0, n)));
        interleaved(&mut cs, plan)?
    };
    let (fl, rest) = results.split_at_mut(1);
    let (ours, peer_s) = rest.split_at_mut(vs.len());
    let work = n as f64;
    let floor_fig = fig(
        &format!("{n} one-way AF_UNIX sends + barrier ping-pong"),
        &mut fl[0],
        Unit::Mwps,
        work,
    )?;
    let peer_fig = fig("vfio_user 0.1.7 Server", &mut peer_s[0], Unit::Mwps, work)?;
    for (v, samples) in vs.iter().zip(ours.iter_mut()) {
        rows.push(Row::new(
            "posted",
            format!("{n} posted REGION_WRITE 4 B + read barrier"),
            "posted",
            &v.label,
            None,
            Unit::Mwps,
            fig(&v.label, samples, Unit::Mwps, work)?,
            Some(floor_fig.clone()),
            Some(peer_fig.clone()),
            None,
            format!(
                "{wreq} B per write; the floor receiver blocks and drains into a 1 MiB buffer; Mw/s = {n} / batch time"
            ),
        ));
    }
    drop(peer_client);
    drop(peer);
    shutdown_all(vs)
}

/// REGION_WRITE_MULTI of 8/64/200 4-byte entries (waiting for the reply).
pub fn write_multi(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let mut vs = four_variants(dir, s, "multi")?;
    let plan = s.plan(QUICK_SHORT, FULL_POINT);
    for count in [8usize, 64, 200] {
        let entries: Vec<WriteMultiEntry> = (0..count)
            .map(|i| {
                let mut data = [0u8; 8];
                data[..4].copy_from_slice(&(i as u32).to_le_bytes());
                WriteMultiEntry {
                    offset: SCRATCH,
                    region: BAR_REGS,
                    count: 4,
                    data,
                }
            })
            .collect();
        let (req, reply) = multi_sizes(&entries)?;
        let mut floor_b = Echo::start(req, reply, Duration::ZERO)?;
        let mut floor_s = Echo::start(req, reply, s.spin)?;
        let mut results = {
            let mut cs = vec![
                Contender::new("floor blocking", || floor_b.round_trip()),
                Contender::new("floor spin", || floor_s.round_trip()),
            ];
            for v in vs.iter_mut() {
                let c = &mut v.client;
                let e = &entries;
                cs.push(Contender::new("switchyard", move || {
                    let t0 = Instant::now();
                    let done = c.region_write_multi(e)?;
                    let d = t0.elapsed();
                    if done != e.len() as u64 {
                        bail!("WRITE_MULTI wrote {done} of {}", e.len());
                    }
                    Ok(d)
                }));
            }
            interleaved(&mut cs, plan)?
        };
        let (fb, rest) = results.split_at_mut(1);
        let (fs, ours) = rest.split_at_mut(1);
        let work = count as f64;
        let floor_block = fig("AF_UNIX ping-pong, blocking", &mut fb[0], Unit::Mwps, work)?;
        let floor_spin = fig(
            &format!("AF_UNIX ping-pong, echo {}", s.spin_label()),
            &mut fs[0],
            Unit::Mwps,
            work,
        )?;
        for (v, samples) in vs.iter().zip(ours.iter_mut()) {
            let floor = if v.spin { &floor_spin } else { &floor_block };
            rows.push(Row::new(
                "write-multi",
                format!("REGION_WRITE_MULTI {count} × 4 B"),
                "multi",
                &v.label,
                Some(count as u64),
                Unit::Mwps,
                fig(&v.label, samples, Unit::Mwps, work)?,
                Some(floor.clone()),
                None,
                None,
                format!(
                    "{req} B request / {reply} B reply; no peer: vfio_user 0.1.7 has no REGION_WRITE_MULTI"
                ),
            ));
        }
    }
    shutdown_all(vs)
}

/// COPY sizes.
pub const COPY_SIZES: [u64; 5] = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20];

fn copy_plan(s: &Settings, size: u64) -> Plan {
    let samples = match (s.quick, size) {
        (true, x) if x <= 64 << 10 => 100,
        (true, x) if x <= 1 << 20 => 20,
        (true, x) if x <= 16 << 20 => 4,
        (true, _) => 2,
        (false, x) if x <= 64 << 10 => 10_000,
        (false, x) if x <= 1 << 20 => 2_000,
        (false, x) if x <= 16 << 20 => 200,
        (false, _) => 60,
    };
    Plan::new(
        (samples / 10).max(1),
        samples,
        if samples >= 10 { 5 } else { 1 },
    )
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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    GuestToVram,
    VramToGuest,
}

/// One COPY of `size` bytes split over `queues` queues, each followed by a FENCE; returns the
/// time from the first doorbell to the last fence seen in guest memory.
fn copy_once(gpu: &mut Gpu, dir: Dir, size: u64, queues: u32, seq: &mut u64) -> Result<Duration> {
    *seq += 1;
    let v = *seq;
    let chunk = size / u64::from(queues);
    let mut tails = Vec::with_capacity(queues as usize);
    let mut fences = Vec::with_capacity(queues as usize);
    for q in 0..queues {
        let off = u64::from(q) * chunk;
        let len = if q + 1 == queues { size - off } else { chunk };
        let (src, dst) = match dir {
            Dir::GuestToVram => (guest(DATA_OFFSET + off), Operand::Vram(off)),
            Dir::VramToGuest => (Operand::Vram(off), guest(DATA_OFFSET + off)),
        };
        let cmds = [
            Command::copy(src, dst, len),
            Command::fence(guest(fence_offset(q)), v, None),
        ];
        tails.push((q, gpu.enqueue(q, &cmds)?));
        fences.push((fence_offset(q), v));
    }
    let t0 = Instant::now();
    for (q, tail) in tails {
        gpu.doorbell(q, tail, true)?;
    }
    if let Err(e) = wait_fences(gpu, &fences, Duration::from_secs(20)) {
        gpu.check_queues()?;
        return Err(e);
    }
    Ok(t0.elapsed())
}

/// softgpu COPY throughput guest memory ↔ VRAM, one queue against a single-thread memcpy of
/// the same size and both queues against a memcpy split over two threads; plus the fixed cost
/// (a zero-length COPY + FENCE).
pub fn copy(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    // The 2-queue rows' floor splits the copy over exactly two threads.
    const _: () = assert!(QUEUES == 2);
    let max = COPY_SIZES.iter().copied().max().unwrap_or(1 << 20);
    let server = Switchyard::start(dir, "softgpu-copy", DeviceKind::SoftGpu, Duration::ZERO)?;
    let mut gpu = Gpu::setup(server.connect(s.stall_timeout())?, max)?;
    // The same on guest memory that is not sealed: the server's fault-safe path.
    let server_u = Switchyard::start(dir, "softgpu-copy-u", DeviceKind::SoftGpu, Duration::ZERO)?;
    let mut gpu_u = Gpu::setup_with(server_u.connect(s.stall_timeout())?, max, false)?;
    // Fault in guest memory and VRAM.
    let pattern: Vec<u8> = (0..1usize << 20).map(|i| (i * 13 + 1) as u8).collect();
    let mut seq = 0u64;
    let mut seq_u = 0u64;
    for (g, sq) in [(&mut gpu, &mut seq), (&mut gpu_u, &mut seq_u)] {
        let mut off = 0;
        while off < max {
            g.mem_write(DATA_OFFSET + off, &pattern)?;
            off += pattern.len() as u64;
        }
        copy_once(g, Dir::GuestToVram, max, 1, sq)?;
        copy_once(g, Dir::VramToGuest, max, 1, sq)?;
    }
    let mut memcpy = Memcpy::new(usize::try_from(max)?);
    let mut memcpy2 = Memcpy2::new(usize::try_from(max)?)?;

    // Fixed cost: doorbell → FENCE visible with nothing to copy.
    {
        let mut cs = vec![Contender::new("copy 0", || {
            copy_once(&mut gpu, Dir::GuestToVram, 0, 1, &mut seq)
        })];
        let mut r = interleaved(&mut cs, copy_plan(s, 4 << 10))?;
        let ours = fig("softgpu blocking", &mut r[0], Unit::Micros, 0.0)?;
        rows.push(Row::new(
            "copy",
            "COPY 0 B + FENCE (fixed cost)".into(),
            "fixed",
            "softgpu blocking, 1 queue",
            Some(0),
            Unit::Micros,
            ours,
            None,
            None,
            None,
            "posted doorbell → fence value seen in guest memory".into(),
        ));
    }

    for d in [Dir::GuestToVram, Dir::VramToGuest] {
        for &size in &COPY_SIZES {
            let len = usize::try_from(size)?;
            let gpu_cell = RefCell::new(&mut gpu);
            let seq_cell = RefCell::new(&mut seq);
            let mut results = {
                // Order: the floors, then ours with 1 and 2 queues (read back below).
                let mut cs = vec![
                    Contender::new("memcpy", || memcpy.copy(len)),
                    Contender::new("memcpy 2 threads", || memcpy2.copy(len)),
                ];
                for queues in [1, QUEUES] {
                    let (g, sq) = (&gpu_cell, &seq_cell);
                    cs.push(Contender::new("copy", move || {
                        copy_once(&mut g.borrow_mut(), d, size, queues, &mut sq.borrow_mut())
                    }));
                }
                let (g, sq) = (&mut gpu_u, &mut seq_u);
                cs.push(Contender::new("copy unsealed", move || {
                    copy_once(g, d, size, 1, sq)
                }));
                interleaved(&mut cs, copy_plan(s, size))?
            };
            let work = size as f64;
            let [fl1, fl2, one, two, guarded] = results.as_mut_slice() else {
                bail!("copy: expected 5 contenders");
            };
            let floor1 = fig("single-thread memcpy", fl1, Unit::GBps, work)?;
            let floor2 = fig("memcpy split over 2 threads", fl2, Unit::GBps, work)?;
            let (op, name) = match d {
                Dir::GuestToVram => ("g2v", "guest→VRAM"),
                Dir::VramToGuest => ("v2g", "VRAM→guest"),
            };
            let variant = "softgpu, 1 queue, unsealed guest RAM";
            rows.push(Row::new(
                "copy",
                format!("COPY {name} {}", human(size)),
                op,
                variant,
                Some(size),
                Unit::GBps,
                fig(variant, guarded, Unit::GBps, work)?,
                Some(floor1.clone()),
                None,
                None,
                format!(
                    "guest RAM not sealed against shrinking: the server copies through its \
                     fault-safe path (/proc/self/mem, 64 KiB per system call); {}; floor: {}",
                    human(size),
                    floor1.name
                ),
            ));
            for (queues, samples, floor) in [(1, one, floor1), (QUEUES, two, floor2)] {
                let variant = if queues == 1 {
                    "softgpu, 1 queue".to_owned()
                } else {
                    format!("softgpu, {queues} queues")
                };
                let note = format!(
                    "posted doorbell → FENCE seen in guest memory; {} split over {queues} queue(s); floor: {}",
                    human(size),
                    floor.name
                );
                rows.push(Row::new(
                    "copy",
                    format!("COPY {name} {}", human(size)),
                    op,
                    &variant,
                    Some(size),
                    Unit::GBps,
                    fig(&variant, samples, Unit::GBps, work)?,
                    Some(floor),
                    None,
                    Some(Target {
                        floor_ratio: 0.9,
                        beat_peer: false,
                        plus: 0.0,
                    }),
                    note,
                ));
            }
        }
    }
    drop(memcpy2);
    gpu.check_queues()?;
    gpu_u.check_queues()?;
    drop(gpu);
    drop(gpu_u);
    server_u.shutdown()?;
    server.shutdown()
}

/// Interrupt delivery: FENCE with MSI-X vector 0 → the client's eventfd readable. End to end
/// (doorbell sent → eventfd readable) against a 4-byte REGION_WRITE-sized ping-pong plus an
/// eventfd wake-up, both in one floor sample; the part after the doorbell's reply is reported
/// without a floor (the fence is often delivered before the reply, so it has no fair floor).
pub fn interrupt(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let stall = s.stall_timeout();
    let block = Switchyard::start(
        dir,
        "softgpu-irq-block",
        DeviceKind::SoftGpu,
        Duration::ZERO,
    )?;
    let spin = Switchyard::start(dir, "softgpu-irq-spin", DeviceKind::SoftGpu, s.spin)?;
    let mut gpus = [
        Gpu::setup(block.connect(stall)?, 0)?,
        Gpu::setup(spin.connect(stall)?, 0)?,
    ];
    let labels = [
        s.variant_label(DeviceKind::SoftGpu, false),
        s.variant_label(DeviceKind::SoftGpu, true),
    ];
    let (wreq, wreply) = write_sizes(4)?;
    let mut floor_b = RoundTripThenWake::start(wreq, wreply, Duration::ZERO)?;
    let mut floor_s = RoundTripThenWake::start(wreq, wreply, s.spin)?;
    let after_reply: [RefCell<Vec<u64>>; 2] = Default::default();
    let early = [RefCell::new(0usize), RefCell::new(0usize)];
    let mut seq = 0u64;
    let seq = RefCell::new(&mut seq);
    let plan = s.latency_plan();
    let mut results = {
        // Order: the floors (blocking, spin), then ours (blocking, spin).
        let mut cs = vec![
            Contender::new("floor blocking", || floor_b.once()),
            Contender::new("floor spin", || floor_s.once()),
        ];
        for ((gpu, after_reply), early) in gpus.iter_mut().zip(&after_reply).zip(&early) {
            let seq = &seq;
            cs.push(Contender::new("irq", move || {
                let v = {
                    let mut s = seq.borrow_mut();
                    **s += 1;
                    **s
                };
                let tail = gpu.enqueue(0, &[Command::fence(guest(fence_offset(0)), v, Some(0))])?;
                let t_send = Instant::now();
                gpu.doorbell(0, tail, false)?;
                let t_reply = Instant::now();
                if gpu.mem_load_u64(fence_offset(0))? == v {
                    *early.borrow_mut() += 1;
                }
                wait_readable(&gpu.irq, stall)?;
                let t_irq = Instant::now();
                let mut b = [0u8; 8];
                (&gpu.irq).read_exact(&mut b)?;
                if gpu.mem_load_u64(fence_offset(0))? != v {
                    bail!("interrupt before the fence value");
                }
                after_reply
                    .borrow_mut()
                    .push(crate::stats::ns(t_irq - t_reply));
                Ok(t_irq - t_send)
            }));
        }
        interleaved(&mut cs, plan)?
    };
    let [fb, fs, ours @ ..] = results.as_mut_slice() else {
        bail!("interrupt: missing floor samples");
    };
    let floors = [
        fig(
            "4 B REGION_WRITE-sized AF_UNIX ping-pong, blocking, + eventfd wake-up",
            fb,
            Unit::Micros,
            0.0,
        )?,
        fig(
            &format!(
                "4 B REGION_WRITE-sized AF_UNIX ping-pong, echo {}, + eventfd wake-up",
                s.spin_label()
            ),
            fs,
            Unit::Micros,
            0.0,
        )?,
    ];
    let warm = plan.warmup;
    for ((((label, samples), floor), after_reply), early) in labels
        .iter()
        .zip(ours.iter_mut())
        .zip(floors)
        .zip(&after_reply)
        .zip(&early)
    {
        let note = format!(
            "end to end: the doorbell REGION_WRITE round trip, the engine's FENCE and the MSI-X eventfd; floor: {}, timed back to back in one sample",
            floor.name
        );
        rows.push(Row::new(
            "interrupt",
            "FENCE irq: doorbell sent → eventfd readable".into(),
            "irq-e2e",
            label,
            None,
            Unit::Micros,
            fig(label, samples, Unit::Micros, 0.0)?,
            Some(floor),
            None,
            Some(Target {
                floor_ratio: 1.2,
                beat_peer: false,
                plus: 0.0,
            }),
            note,
        ));
        let total = samples.len() + warm;
        let early_pct = 100.0 * *early.borrow() as f64 / total.max(1) as f64;
        let mut all = after_reply.borrow_mut();
        // This vector also holds the warm-up samples; keep only the timed ones.
        let skip = all.len().saturating_sub(samples.len());
        let mut timed: Vec<u64> = all.drain(skip..).collect();
        rows.push(Row::new(
            "interrupt",
            "FENCE irq: doorbell reply → eventfd readable".into(),
            "irq",
            label,
            None,
            Unit::Micros,
            fig(label, &mut timed, Unit::Micros, 0.0)?,
            None,
            None,
            None,
            format!(
                "information only, no floor: from REGION_WRITE(doorbell) returning to poll() on the MSI-X eventfd returning; the fence was already in memory when the reply arrived in {early_pct:.0}% of samples"
            ),
        ));
    }
    for g in &mut gpus {
        g.check_queues()?;
    }
    drop(gpus);
    block.shutdown()?;
    spin.shutdown()
}

/// IOVA of the window the dirty-report case maps.
const DIRTY_IOVA: u64 = 1 << 40;

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

/// `DMA_LOGGING_REPORT` of a whole window of 1/16/64 GiB with 0.1/1/10 % of its pages dirty,
/// against reading and clearing a bitmap of the same size (the floor) and against that
/// scan plus moving the bitmap over AF_UNIX (the wire floor).
pub fn dirty_report(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    const GIB: u64 = 1 << 30;
    let sizes: &[u64] = if s.quick {
        &[GIB]
    } else {
        &[GIB, 16 * GIB, 64 * GIB]
    };
    let percents = [0.1f64, 1.0, 10.0];
    let plan = s.plan(Plan::new(1, 4, 2), Plan::new(3, 60, 6));
    let (server, dma) = Switchyard::start_regfile_with_dma(dir, "dirty")?;
    let mut client = server.connect(s.stall_timeout())?;
    client
        .dma_logging_start(4096, &[])
        .context("DMA_LOGGING_START")?;
    // Report request: header 16 + feature 8 + report 24; the reply adds the bitmap.
    let head = 16 + 8 + 24;
    for &size in sizes {
        let mem = memfd::MemfdOptions::default()
            .create("dirty-guest")
            .context("memfd")?
            .into_file();
        mem.set_len(size).context("size the guest memory")?;
        let rw = switchyard_proto::consts::VFIO_USER_F_DMA_REGION_READ
            | switchyard_proto::consts::VFIO_USER_F_DMA_REGION_WRITE;
        client
            .dma_map(
                DIRTY_IOVA,
                size,
                rw,
                Some((std::os::fd::AsFd::as_fd(&mem), 0)),
            )
            .context("map the window")?;
        let pages = size / 4096;
        let words = pages.div_ceil(64) as usize;
        let bitmap = SharedBitmap::new(words);
        let mut scan = BitmapScan::new(bitmap.clone());
        let mut wire = WireScan::start(bitmap.clone(), head, head)?;
        let mut direct_out = vec![1u8; words * 8];
        for pct in percents {
            let n = ((pages as f64) * pct / 100.0).round() as u64;
            let dirty = scattered_pages(pages, n, size ^ n);
            let mut results = {
                let (c, dma, dirty, bm) = (&mut client, &dma, &dirty, &bitmap);
                let mut cs = vec![
                    Contender::new("switchyard", move || {
                        for p in dirty {
                            dma.mark_dirty(DIRTY_IOVA + p * 4096, 1)?;
                        }
                        let t0 = Instant::now();
                        let bits = c.dma_logging_report_ref(DIRTY_IOVA, size, 4096)?;
                        let t = t0.elapsed();
                        // Outside the timing: every dirty page came back.
                        let set: u64 = bits.iter().map(|b| u64::from(b.count_ones())).sum();
                        if set != dirty.len() as u64 {
                            bail!("report has {set} pages, {} were dirtied", dirty.len());
                        }
                        Ok(t)
                    }),
                    Contender::new("scan floor", || {
                        bm.set(dirty);
                        Ok(scan.scan())
                    }),
                ];
                let w = &mut wire;
                cs.push(Contender::new("wire floor", move || {
                    bm.set(dirty);
                    w.report()
                }));
                let direct_out = &mut direct_out;
                cs.push(Contender::new("direct", move || {
                    for p in dirty {
                        dma.mark_dirty(DIRTY_IOVA + p * 4096, 1)?;
                    }
                    let t0 = Instant::now();
                    dma.report_dirty(DIRTY_IOVA, size, 4096, direct_out)?;
                    Ok(t0.elapsed())
                }));
                interleaved(&mut cs, plan)?
            };
            let [ours, floor, wire_s, direct] = results.as_mut_slice() else {
                bail!("four contenders, four results");
            };
            let case = format!("DMA_LOGGING_REPORT {} mapped, {pct}% dirty", human(size));
            let ours_fig = fig("switchyard", ours, Unit::Micros, 0.0)?;
            let floor_fig = fig(
                "read+clear scan of the same bitmap",
                floor,
                Unit::Micros,
                0.0,
            )?;
            let note = format!(
                "one window, 4 KiB pages, {n} scattered dirty pages, {} KiB bitmap; untimed: the device marks the pages",
                words * 8 / 1024
            );
            rows.push(Row::new(
                "dirty-report",
                case.clone(),
                "report",
                "regfile blocking",
                Some(size),
                Unit::Micros,
                ours_fig.clone(),
                Some(fig(
                    "read+clear scan of the same bitmap",
                    floor,
                    Unit::Micros,
                    0.0,
                )?),
                None,
                Some(Target {
                    floor_ratio: 1.5,
                    beat_peer: false,
                    plus: 0.0,
                }),
                note.clone(),
            ));
            rows.push(Row::new(
                "dirty-report",
                case.clone(),
                "report-direct",
                "DmaSpace::report_dirty in process",
                Some(size),
                Unit::Micros,
                fig("report_dirty", direct, Unit::Micros, 0.0)?,
                Some(floor_fig.clone()),
                None,
                Some(Target {
                    floor_ratio: 1.5,
                    beat_peer: false,
                    plus: 0.0,
                }),
                "decomposition: the server's flip and drain alone, no message".into(),
            ));
            rows.push(Row::new(
                "dirty-report",
                case,
                "report-wire",
                "regfile blocking",
                Some(size),
                Unit::Micros,
                ours_fig,
                Some(fig(
                    "scan + AF_UNIX request/reply of the same bytes",
                    wire_s,
                    Unit::Micros,
                    0.0,
                )?),
                None,
                None,
                note,
            ));
        }
        client
            .dma_unmap(DIRTY_IOVA, size, 0)
            .context("unmap the window")?;
    }
    drop(client);
    server.shutdown()
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
