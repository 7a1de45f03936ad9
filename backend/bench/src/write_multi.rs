//! REGION_WRITE_MULTI throughput.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use switchyard_proto::{Records, Reply, Request, WriteMultiEntry};
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{FULL_POINT, QUICK_SHORT, Settings, fig, four_variants, shutdown_all};
use crate::floors::Echo;
use crate::report::{Row, Unit};
use crate::stats::{Contender, interleaved};

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
