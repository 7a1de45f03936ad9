//! A plain loop of round trips for profilers (`valgrind --tool=callgrind`, `strace -c`): no
//! floors, no interleaving, one server, one client.

use std::time::{Duration, Instant};

use anyhow::Result;

use crate::servers::{DeviceKind, Peer, Switchyard};

/// Which server the loop talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// Switchyard with the softgpu (BAR0 `SCRATCH`).
    Softgpu,
    /// Switchyard with the softgpu and crash continuity on (receive journal, black box,
    /// custody), as a pool worker serves it.
    SoftgpuJournal,
    /// Switchyard with the register file (region 0).
    Regfile,
    /// The `vfio_user` crate's server with the register file (region 0).
    Peer,
}

/// What each iteration does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Access {
    /// 4-byte REGION_READ.
    Read,
    /// 4-byte REGION_WRITE.
    Write,
    /// REGION_WRITE_MULTI of 200 4-byte entries (Switchyard only).
    Multi200,
}

/// Runs `iters` 4-byte round trips and prints the mean.
pub fn run(target: Target, access: Access, iters: u64, spin: Duration) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let kind = match target {
        Target::Softgpu => Some(DeviceKind::SoftGpu),
        Target::SoftgpuJournal => Some(DeviceKind::SoftGpuJournal),
        Target::Regfile => Some(DeviceKind::RegFile),
        Target::Peer => None,
    };
    let (sy, peer) = match kind {
        Some(kind) => (
            Some(Switchyard::start(dir.path(), "prof", kind, spin)?),
            None,
        ),
        None => (None, Some(Peer::start(dir.path(), "prof")?)),
    };
    let mut client = match (&sy, &peer) {
        (Some(s), _) => s.connect(None)?,
        (None, Some(p)) => p.connect(None)?,
        (None, None) => anyhow::bail!("no server"),
    };
    let (region, offset) = (0u32, switchyard_softgpu::regs::SCRATCH);
    let mut buf = [1u8, 2, 3, 4];
    let entries: Vec<switchyard_proto::WriteMultiEntry> = (0..200u32)
        .map(|i| switchyard_proto::WriteMultiEntry {
            offset,
            region,
            count: 4,
            data: [i as u8, 0, 0, 0, 0, 0, 0, 0],
        })
        .collect();
    let t0 = Instant::now();
    for _ in 0..iters {
        match access {
            Access::Read => client.region_read(region, offset, &mut buf)?,
            Access::Write => client.region_write(region, offset, &buf)?,
            Access::Multi200 => {
                client.region_write_multi(&entries)?;
            }
        }
    }
    let dt = t0.elapsed();
    drop(client);
    if let Some(s) = sy {
        s.shutdown()?;
    }
    drop(peer);
    println!(
        "{iters} round trips in {:.3} s: {:.2} µs mean",
        dt.as_secs_f64(),
        dt.as_secs_f64() * 1e6 / iters.max(1) as f64
    );
    Ok(())
}
