//! Posted REGION_WRITEs per second.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use switchyard_client::Client;
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Settings, fig, four_variants, read_sizes, shutdown_all, write_sizes};
use crate::floors::PostedStream;
use crate::report::{Row, Unit};
use crate::servers::Peer;
use crate::stats::{Contender, Plan, interleaved};

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
