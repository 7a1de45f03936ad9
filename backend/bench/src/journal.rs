//! The round-trip cost of crash continuity's journal (issue 11).

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, bail};
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Op, Settings, Variant, fig, pool, shutdown_all, timed_access};
use crate::floors::Echo;
use crate::report::{Figure, Row, Target, Unit};
use crate::servers::DeviceKind;
use crate::stats::{Contender, interleaved};

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
