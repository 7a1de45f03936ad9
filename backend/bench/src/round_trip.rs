//! Trapped REGION_READ / REGION_WRITE round trips against the floors and the peer: the
//! round-trip group, and [`RoundTrips`], which the size sweep runs too.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, bail};
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Op, Settings, Variant, fig, human, pool, shutdown_all, timed_access};
use crate::floors::Echo;
use crate::report::{Row, Target, Unit};
use crate::servers::{DeviceKind, Peer};
use crate::stats::{Contender, Plan, interleaved};

/// A group of REGION_READ / REGION_WRITE round trips: Switchyard variants against the blocking
/// and the spinning AF_UNIX floor (each variant against the one with its own policy) and the
/// `vfio_user` peer, every point interleaved, pooled over `reps` independent setups.
pub(crate) struct RoundTrips<'a> {
    pub(crate) group: &'static str,
    pub(crate) variants: &'a [(DeviceKind, Option<Duration>)],
    pub(crate) sizes: &'a [u32],
    /// Where every access goes, on Switchyard and on the peer.
    pub(crate) region: u32,
    pub(crate) offset: u64,
    pub(crate) reps: usize,
    /// Plan of one repetition.
    pub(crate) plan: Plan,
    /// Whether rows have the round-trip target.
    pub(crate) target: bool,
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
    pub(crate) fn run(&self, dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
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
