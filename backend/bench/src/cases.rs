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

use crate::floors::{Echo, EventfdWake, Memcpy, PostedStream, wait_readable};
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
}

impl Settings {
    fn spin_label(&self) -> String {
        format!("spin {}µs", self.spin.as_micros())
    }

    /// Independent setups (fresh servers, floors, peer) the round-trip figures are pooled
    /// from: thread placement on this kind of machine is sticky for a while and bimodal
    /// (same-CPU wake-ups vs cross-CPU ones), so one setup can land in either mode.
    pub fn reps(&self) -> usize {
        if self.quick { 1 } else { 4 }
    }

    /// Per-repetition plan: 4 × 5000 = 20k samples per contender in full mode, in short
    /// interleaved blocks.
    fn rep_plan(&self) -> Plan {
        if self.quick {
            Plan {
                warmup: 50,
                samples: 500,
                blocks: 5,
            }
        } else {
            Plan {
                warmup: 1000,
                samples: 5000,
                blocks: 25,
            }
        }
    }

    /// Latency plans: ≥ 10k samples in full mode.
    fn latency_plan(&self) -> Plan {
        if self.quick {
            Plan {
                warmup: 50,
                samples: 500,
                blocks: 5,
            }
        } else {
            Plan {
                warmup: 2000,
                samples: 20_000,
                blocks: 100,
            }
        }
    }

    fn sweep_plan(&self) -> Plan {
        if self.quick {
            Plan {
                warmup: 20,
                samples: 100,
                blocks: 2,
            }
        } else {
            Plan {
                warmup: 500,
                samples: 10_000,
                blocks: 50,
            }
        }
    }
}

fn summary(name: &str, samples: &mut [u64]) -> Result<Summary> {
    Summary::of(samples).with_context(|| format!("no samples for {name}"))
}

fn fig(name: &str, samples: &mut [u64], unit: Unit, work: f64) -> Result<Figure> {
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
struct Variant {
    label: String,
    server: Switchyard,
    client: Client,
    spin: bool,
}

fn variant(
    dir: &Path,
    kind: DeviceKind,
    spin: Option<Duration>,
    s: &Settings,
    tag: &str,
) -> Result<Variant> {
    let (name, label, budget) = match spin {
        None => (
            format!("{}-block-{tag}", kind.name()),
            format!("{} blocking", kind.name()),
            Duration::ZERO,
        ),
        Some(d) => (
            format!("{}-spin-{tag}", kind.name()),
            format!("{} {}", kind.name(), s.spin_label()),
            d,
        ),
    };
    let server = Switchyard::start(dir, &name, kind, budget)?;
    let client = server.connect()?;
    Ok(Variant {
        label,
        server,
        client,
        spin: spin.is_some(),
    })
}

fn rt_target() -> Option<Target> {
    Some(Target {
        floor_ratio: 1.10,
        beat_peer: true,
    })
}

/// Appends each contender's samples of one repetition to the pooled samples.
fn pool(pooled: &mut Vec<Vec<u64>>, results: Vec<Vec<u64>>) {
    if pooled.is_empty() {
        *pooled = results;
    } else {
        for (p, r) in pooled.iter_mut().zip(results) {
            p.extend(r);
        }
    }
}

/// Trapped 4-byte REGION_READ / REGION_WRITE round trips: softgpu BAR0 `SCRATCH` and the
/// register file, blocking and spinning, against the blocking / spinning AF_UNIX floor and the
/// `vfio_user` peer. Pooled over [`Settings::reps`] independent setups.
pub fn round_trip(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let kinds = [
        (DeviceKind::SoftGpu, None),
        (DeviceKind::SoftGpu, Some(s.spin)),
        (DeviceKind::RegFile, None),
        (DeviceKind::RegFile, Some(s.spin)),
    ];
    let ops = [Op::Read, Op::Write];
    let mut pooled: [Vec<Vec<u64>>; 2] = Default::default();
    let mut labels = Vec::new();
    for rep in 0..s.reps() {
        let mut vs = Vec::new();
        for (kind, spin) in kinds {
            vs.push(variant(dir, kind, spin, s, &format!("rt{rep}"))?);
        }
        labels = vs.iter().map(|v| (v.label.clone(), v.spin)).collect();
        let peer = Peer::start(dir, &format!("peer-rt{rep}"))?;
        let mut peer_client = peer.connect()?;
        for (op, pooled) in ops.iter().zip(pooled.iter_mut()) {
            let op = *op;
            let (req, reply) = op.sizes(4)?;
            let mut floor_b = Echo::start(req, reply, Duration::ZERO)?;
            let mut floor_s = Echo::start(req, reply, s.spin)?;
            let mut cs = vec![
                Contender::new("floor blocking", || floor_b.round_trip()),
                Contender::new("floor spin", || floor_s.round_trip()),
            ];
            for v in vs.iter_mut() {
                let c = &mut v.client;
                let mut buf = 7u32.to_le_bytes();
                cs.push(Contender::new("switchyard", move || {
                    timed_access(c, op, BAR_REGS, SCRATCH, &mut buf)
                }));
            }
            let mut buf = 7u32.to_le_bytes();
            let pc = &mut peer_client;
            cs.push(Contender::new("peer", move || {
                timed_access(pc, op, 0, SCRATCH, &mut buf)
            }));
            pool(pooled, interleaved(&mut cs, s.rep_plan())?);
        }
        drop(peer_client);
        drop(peer);
        for v in vs {
            drop(v.client);
            v.server.shutdown()?;
        }
    }
    for (op, results) in ops.iter().zip(pooled.iter_mut()) {
        let (req, reply) = op.sizes(4)?;
        let (fb, rest) = results.split_at_mut(1);
        let (fs, rest) = rest.split_at_mut(1);
        let (ours, peer_s) = rest.split_at_mut(labels.len());
        let floor_block = fig("AF_UNIX ping-pong, blocking", &mut fb[0], Unit::Micros, 0.0)?;
        let floor_spin = fig(
            &format!("AF_UNIX ping-pong, echo {}", s.spin_label()),
            &mut fs[0],
            Unit::Micros,
            0.0,
        )?;
        let peer_fig = fig("vfio_user 0.1.7 Server", &mut peer_s[0], Unit::Micros, 0.0)?;
        for ((label, spin), samples) in labels.iter().zip(ours.iter_mut()) {
            let floor = if *spin { &floor_spin } else { &floor_block };
            rows.push(Row::new(
                "round-trip",
                format!("REGION_{} 4 B", op.name().to_uppercase()),
                op.name(),
                label,
                Some(4),
                Unit::Micros,
                fig(label, samples, Unit::Micros, 0.0)?,
                Some(floor.clone()),
                Some(peer_fig.clone()),
                rt_target(),
                format!(
                    "{req} B request / {reply} B reply; floor: {}; peer: blocking vfio_user server, regfile backend",
                    floor.name
                ),
            ));
        }
    }
    Ok(())
}

/// Where the time of a blocking 4-byte REGION_READ round trip goes: the raw floor, the floor
/// with the reply read in two parts (header, then body, as our client does), a raw client
/// (pre-encoded request, one read) against the Switchyard server, our client against a fake
/// server that only echoes a canned reply, and our client against Switchyard.
pub fn decompose(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let mut pooled = Vec::new();
    for rep in 0..s.reps() {
        pool(&mut pooled, decompose_once(dir, s, rep)?);
    }
    let floor_fig = fig(
        "AF_UNIX ping-pong, blocking",
        &mut pooled[0],
        Unit::Micros,
        0.0,
    )?;
    let labels = [
        (
            "floor + client timeouts",
            "the floor with our client's 10 s SO_RCVTIMEO/SO_SNDTIMEO on the client socket",
        ),
        (
            "floor + timeouts + reply read as 16 B + rest",
            "as above, and the client reads the reply in two parts like switchyard-client",
        ),
        (
            "raw client → switchyard",
            "pre-encoded request, one read of the reply, on switchyard-client's socket (timeouts set)",
        ),
        (
            "switchyard-client → fake server",
            "an echo thread that returns a canned reply: the client's whole cost",
        ),
        (
            "switchyard-client → switchyard",
            "regfile, as in the round-trip rows",
        ),
    ];
    for ((variant, note), samples) in labels.iter().zip(pooled.iter_mut().skip(1).take(5)) {
        rows.push(Row::new(
            "decompose",
            "REGION_READ 4 B, blocking".into(),
            "decompose",
            variant,
            Some(4),
            Unit::Micros,
            fig(variant, samples, Unit::Micros, 0.0)?,
            Some(floor_fig.clone()),
            None,
            None,
            (*note).to_owned(),
        ));
    }
    let poll_floor = fig(
        &format!("AF_UNIX ping-pong, both sides poll ({})", s.spin_label()),
        &mut pooled[6],
        Unit::Micros,
        0.0,
    )?;
    let variant = format!("polling raw client → switchyard {}", s.spin_label());
    rows.push(Row::new(
        "decompose",
        "REGION_READ 4 B, both sides poll".into(),
        "decompose",
        &variant,
        Some(4),
        Unit::Micros,
        fig(&variant, &mut pooled[7], Unit::Micros, 0.0)?,
        Some(poll_floor),
        None,
        None,
        "client polls with non-blocking reads; floor: echo polls too".into(),
    ));
    Ok(())
}

fn decompose_once(dir: &Path, s: &Settings, rep: usize) -> Result<Vec<Vec<u64>>> {
    let (req_len, reply_len) = read_sizes(4)?;
    let server = Switchyard::start(
        dir,
        &format!("regfile-decompose{rep}"),
        DeviceKind::RegFile,
        Duration::ZERO,
    )?;
    let mut client = server.connect()?;
    let mut req = Vec::new();
    Request::RegionRead {
        offset: SCRATCH,
        region: 0,
        count: 4,
    }
    .encode(0, false, &mut req)?;
    let mut raw = Echo::raw_client(client.socket().try_clone()?, req.clone(), reply_len);
    let mut reply = Vec::new();
    region_read_reply_buffer(&mut reply, 0, SCRATCH, 0, 4)?;
    let (a, b) = std::os::unix::net::UnixStream::pair()?;
    let fake = Echo::fake_server(b, req_len, reply)?;
    let mut fake_client = Client::without_handshake(a, crate::servers::vmm_client_config())?;
    let mut floor = Echo::start(req_len, reply_len, Duration::ZERO)?;
    let mut floor_t = Echo::start(req_len, reply_len, Duration::ZERO)?.with_client_timeouts()?;
    let mut split = Echo::start_split(req_len, reply_len, 16)?.with_client_timeouts()?;
    // Both sides polling: the best adaptive polling can do (a client that also polls).
    let spin_server = Switchyard::start(
        dir,
        &format!("regfile-decompose-spin{rep}"),
        DeviceKind::RegFile,
        s.spin,
    )?;
    let spin_client = spin_server.connect()?;
    let mut raw_spin =
        Echo::raw_client(spin_client.socket().try_clone()?, req, reply_len).client_polls()?;
    let mut floor_spin = Echo::start(req_len, reply_len, s.spin)?.client_polls()?;
    let results = {
        let mut b1 = [0u8; 4];
        let mut b2 = [0u8; 4];
        let c = &mut client;
        let fc = &mut fake_client;
        let mut cs = vec![
            Contender::new("floor", || floor.round_trip()),
            Contender::new("floor with timeouts", || floor_t.round_trip()),
            Contender::new("split floor", || split.round_trip()),
            Contender::new("raw client", || raw.round_trip()),
            Contender::new("client vs fake", move || {
                timed_access(fc, Op::Read, 0, SCRATCH, &mut b1)
            }),
            Contender::new("client vs switchyard", move || {
                timed_access(c, Op::Read, 0, SCRATCH, &mut b2)
            }),
            Contender::new("polling floor", || floor_spin.round_trip()),
            Contender::new("polling raw client", || raw_spin.round_trip()),
        ];
        interleaved(&mut cs, s.rep_plan())?
    };
    drop(raw_spin);
    drop(spin_client);
    spin_server.shutdown()?;
    drop(raw);
    drop(fake_client);
    let _ = fake.join();
    drop(client);
    server.shutdown()?;
    Ok(results)
}

/// Sizes of the latency-vs-size sweep.
pub const SWEEP_SIZES: [u32; 7] = [4, 64, 512, 4096, 32 << 10, 256 << 10, 1 << 20];

/// REGION_READ / REGION_WRITE round trips of growing size on the register file's 1 MiB
/// region, against the floors and the peer.
pub fn size_sweep(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let ops = [Op::Read, Op::Write];
    let points: Vec<(Op, u32)> = ops
        .iter()
        .flat_map(|&op| SWEEP_SIZES.iter().map(move |&size| (op, size)))
        .collect();
    let mut pooled: Vec<Vec<Vec<u64>>> = vec![Vec::new(); points.len()];
    let mut labels = Vec::new();
    let reps = s.reps().min(2);
    let plan = s.sweep_plan();
    let plan = Plan {
        samples: plan.samples / reps,
        blocks: plan.blocks / reps,
        ..plan
    };
    for rep in 0..reps {
        let tag = format!("sweep{rep}");
        let mut vs = vec![
            variant(dir, DeviceKind::RegFile, None, s, &tag)?,
            variant(dir, DeviceKind::RegFile, Some(s.spin), s, &tag)?,
        ];
        labels = vs.iter().map(|v| (v.label.clone(), v.spin)).collect();
        let peer = Peer::start(dir, &format!("peer-{tag}"))?;
        let mut peer_client = peer.connect()?;
        for (&(op, size), pooled) in points.iter().zip(pooled.iter_mut()) {
            let (req, reply) = op.sizes(size)?;
            let mut floor_b = Echo::start(req, reply, Duration::ZERO)?;
            let mut floor_s = Echo::start(req, reply, s.spin)?;
            let mut cs = vec![
                Contender::new("floor blocking", || floor_b.round_trip()),
                Contender::new("floor spin", || floor_s.round_trip()),
            ];
            for v in vs.iter_mut() {
                let c = &mut v.client;
                let mut buf = vec![0x3cu8; size as usize];
                cs.push(Contender::new("switchyard", move || {
                    timed_access(c, op, 1, 0, &mut buf)
                }));
            }
            let mut buf = vec![0x3cu8; size as usize];
            let pc = &mut peer_client;
            cs.push(Contender::new("peer", move || {
                timed_access(pc, op, 1, 0, &mut buf)
            }));
            pool(pooled, interleaved(&mut cs, plan)?);
        }
        drop(peer_client);
        drop(peer);
        for v in vs {
            drop(v.client);
            v.server.shutdown()?;
        }
    }
    for (&(op, size), results) in points.iter().zip(pooled.iter_mut()) {
        let (req, reply) = op.sizes(size)?;
        let (fb, rest) = results.split_at_mut(1);
        let (fs, rest) = rest.split_at_mut(1);
        let (ours, peer_s) = rest.split_at_mut(labels.len());
        let floor_block = fig("AF_UNIX ping-pong, blocking", &mut fb[0], Unit::Micros, 0.0)?;
        let floor_spin = fig(
            &format!("AF_UNIX ping-pong, echo {}", s.spin_label()),
            &mut fs[0],
            Unit::Micros,
            0.0,
        )?;
        let peer_fig = fig("vfio_user 0.1.7 Server", &mut peer_s[0], Unit::Micros, 0.0)?;
        for ((label, spin), samples) in labels.iter().zip(ours.iter_mut()) {
            let floor = if *spin { &floor_spin } else { &floor_block };
            rows.push(Row::new(
                "size-sweep",
                format!(
                    "REGION_{} {}",
                    op.name().to_uppercase(),
                    human(u64::from(size))
                ),
                op.name(),
                label,
                Some(u64::from(size)),
                Unit::Micros,
                fig(label, samples, Unit::Micros, 0.0)?,
                Some(floor.clone()),
                Some(peer_fig.clone()),
                None,
                format!("{req} B request / {reply} B reply"),
            ));
        }
    }
    Ok(())
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
    let mut vs = vec![
        variant(dir, DeviceKind::SoftGpu, None, s, "posted")?,
        variant(dir, DeviceKind::SoftGpu, Some(s.spin), s, "posted")?,
        variant(dir, DeviceKind::RegFile, None, s, "posted")?,
        variant(dir, DeviceKind::RegFile, Some(s.spin), s, "posted")?,
    ];
    let peer = Peer::start(dir, "peer-posted")?;
    let mut peer_client = peer.connect()?;
    let (wreq, _) = write_sizes(4)?;
    let (rreq, rreply) = read_sizes(4)?;
    let mut floor = PostedStream::start(n, wreq, rreq, rreply)?;
    let plan = if s.quick {
        Plan {
            warmup: 3,
            samples: 30,
            blocks: 3,
        }
    } else {
        Plan {
            warmup: 100,
            samples: 10_000,
            blocks: 50,
        }
    };
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
    for v in vs {
        drop(v.client);
        v.server.shutdown()?;
    }
    Ok(())
}

/// REGION_WRITE_MULTI of 8/64/200 4-byte entries (waiting for the reply).
pub fn write_multi(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let mut vs = vec![
        variant(dir, DeviceKind::SoftGpu, None, s, "multi")?,
        variant(dir, DeviceKind::SoftGpu, Some(s.spin), s, "multi")?,
        variant(dir, DeviceKind::RegFile, None, s, "multi")?,
        variant(dir, DeviceKind::RegFile, Some(s.spin), s, "multi")?,
    ];
    let plan = if s.quick {
        Plan {
            warmup: 10,
            samples: 100,
            blocks: 2,
        }
    } else {
        Plan {
            warmup: 500,
            samples: 10_000,
            blocks: 50,
        }
    };
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
    for v in vs {
        drop(v.client);
        v.server.shutdown()?;
    }
    Ok(())
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
    Plan {
        warmup: (samples / 10).max(1),
        samples,
        blocks: if samples >= 10 { 5 } else { 1 },
    }
}

/// Waits until every `(offset, value)` fence slot holds its value: spins for 20 µs, then yields
/// between checks (the engines need the CPUs more than this thread does).
fn wait_fences(gpu: &Gpu, fences: &[(u64, u64)], timeout: Duration) -> Result<()> {
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

/// softgpu COPY throughput guest memory ↔ VRAM, one queue and both queues, against a
/// single-thread memcpy of the same size; plus the fixed cost (a zero-length COPY + FENCE).
pub fn copy(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let max = COPY_SIZES.iter().copied().max().unwrap_or(1 << 20);
    let server = Switchyard::start(dir, "softgpu-copy", DeviceKind::SoftGpu, Duration::ZERO)?;
    let mut gpu = Gpu::setup(server.connect()?, max)?;
    // Fault in guest memory and VRAM.
    let pattern: Vec<u8> = (0..1usize << 20).map(|i| (i * 13 + 1) as u8).collect();
    let mut off = 0;
    while off < max {
        gpu.mem_write(DATA_OFFSET + off, &pattern)?;
        off += pattern.len() as u64;
    }
    let mut seq = 0u64;
    copy_once(&mut gpu, Dir::GuestToVram, max, 1, &mut seq)?;
    copy_once(&mut gpu, Dir::VramToGuest, max, 1, &mut seq)?;
    let mut memcpy = Memcpy::new(usize::try_from(max)?);

    // Fixed cost: doorbell → FENCE visible with nothing to copy.
    {
        let gpu = RefCell::new(&mut gpu);
        let seq = RefCell::new(&mut seq);
        let mut cs = vec![Contender::new("copy 0", || {
            copy_once(
                &mut gpu.borrow_mut(),
                Dir::GuestToVram,
                0,
                1,
                &mut seq.borrow_mut(),
            )
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
                let mut cs = vec![Contender::new("memcpy", || memcpy.copy(len))];
                for queues in [1, QUEUES] {
                    let (g, sq) = (&gpu_cell, &seq_cell);
                    cs.push(Contender::new("copy", move || {
                        copy_once(&mut g.borrow_mut(), d, size, queues, &mut sq.borrow_mut())
                    }));
                }
                interleaved(&mut cs, copy_plan(s, size))?
            };
            let work = size as f64;
            let (fl, ours) = results.split_at_mut(1);
            let floor = fig("single-thread memcpy", &mut fl[0], Unit::GBps, work)?;
            let (op, name) = match d {
                Dir::GuestToVram => ("g2v", "guest→VRAM"),
                Dir::VramToGuest => ("v2g", "VRAM→guest"),
            };
            for (queues, samples) in [1, QUEUES].into_iter().zip(ours.iter_mut()) {
                let variant = if queues == 1 {
                    "softgpu, 1 queue".to_owned()
                } else {
                    format!("softgpu, {queues} queues")
                };
                rows.push(Row::new(
                    "copy",
                    format!("COPY {name} {}", human(size)),
                    op,
                    &variant,
                    Some(size),
                    Unit::GBps,
                    fig(&variant, samples, Unit::GBps, work)?,
                    Some(floor.clone()),
                    None,
                    Some(Target {
                        floor_ratio: 0.9,
                        beat_peer: false,
                    }),
                    format!(
                        "posted doorbell → FENCE seen in guest memory; {} split over {queues} queue(s)",
                        human(size)
                    ),
                ));
            }
        }
    }
    gpu.check_queues()?;
    drop(gpu);
    server.shutdown()
}

/// Interrupt delivery: FENCE with MSI-X vector 0 → the client's eventfd readable.
pub fn interrupt(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let block = Switchyard::start(
        dir,
        "softgpu-irq-block",
        DeviceKind::SoftGpu,
        Duration::ZERO,
    )?;
    let spin = Switchyard::start(dir, "softgpu-irq-spin", DeviceKind::SoftGpu, s.spin)?;
    let mut gpus = [
        Gpu::setup(block.connect()?, 0)?,
        Gpu::setup(spin.connect()?, 0)?,
    ];
    let labels = [
        "softgpu blocking".to_owned(),
        format!("softgpu {}", s.spin_label()),
    ];
    let mut floor = EventfdWake::start()?;
    let e2e: [RefCell<Vec<u64>>; 2] = Default::default();
    let early = [RefCell::new(0usize), RefCell::new(0usize)];
    let mut seq = 0u64;
    let seq = RefCell::new(&mut seq);
    let plan = s.latency_plan();
    let mut results = {
        let mut cs = vec![Contender::new("eventfd", || floor.one_way())];
        for ((gpu, e2e), early) in gpus.iter_mut().zip(e2e.iter()).zip(early.iter()) {
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
                wait_readable(&gpu.irq)?;
                let t_irq = Instant::now();
                let mut b = [0u8; 8];
                (&gpu.irq).read_exact(&mut b)?;
                if gpu.mem_load_u64(fence_offset(0))? != v {
                    bail!("interrupt before the fence value");
                }
                e2e.borrow_mut().push(crate::stats::ns(t_irq - t_send));
                Ok(t_irq - t_reply)
            }));
        }
        interleaved(&mut cs, plan)?
    };
    let (fl, ours) = results.split_at_mut(1);
    let floor_fig = fig(
        "eventfd signal → poll wakes (other thread)",
        &mut fl[0],
        Unit::Micros,
        0.0,
    )?;
    let warm = plan.warmup;
    for (((label, samples), e2e), early) in labels
        .iter()
        .zip(ours.iter_mut())
        .zip(e2e.iter())
        .zip(early.iter())
    {
        let total = samples.len() + warm;
        let early_pct = 100.0 * *early.borrow() as f64 / total.max(1) as f64;
        rows.push(Row::new(
            "interrupt",
            "FENCE irq: doorbell reply → eventfd readable".into(),
            "irq",
            label,
            None,
            Unit::Micros,
            fig(label, samples, Unit::Micros, 0.0)?,
            Some(floor_fig.clone()),
            None,
            Some(Target {
                floor_ratio: 1.2,
                beat_peer: false,
            }),
            format!(
                "from REGION_WRITE(doorbell) returning to poll() on the MSI-X eventfd returning; fence already in memory when the reply arrived in {early_pct:.0}% of samples"
            ),
        ));
        let mut all = e2e.borrow_mut();
        // The end-to-end vector also holds the warm-up samples; keep only the timed ones.
        let skip = all.len().saturating_sub(samples.len());
        let mut timed: Vec<u64> = all.drain(skip..).collect();
        rows.push(Row::new(
            "interrupt",
            "FENCE irq: doorbell sent → eventfd readable".into(),
            "irq-e2e",
            label,
            None,
            Unit::Micros,
            fig(label, &mut timed, Unit::Micros, 0.0)?,
            None,
            None,
            None,
            "end to end: includes the doorbell REGION_WRITE round trip".into(),
        ));
    }
    for g in &mut gpus {
        g.check_queues()?;
    }
    drop(gpus);
    block.shutdown()?;
    spin.shutdown()
}

/// Rows for figures whose features do not exist yet.
pub fn not_yet(rows: &mut Vec<Row>) {
    rows.push(Row::not_implemented(
        "migration",
        "DMA_LOGGING_REPORT",
        "lands with the migration issue",
    ));
    rows.push(Row::not_implemented(
        "migration",
        "live swap downtime",
        "later issue",
    ));
    rows.push(Row::not_implemented(
        "migration",
        "migration downtime",
        "later issue",
    ));
}

/// `4 KiB`, `64 MiB`, `512 B`.
pub fn human(bytes: u64) -> String {
    if bytes >= 1 << 20 && bytes % (1 << 20) == 0 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 && bytes % (1 << 10) == 0 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}
