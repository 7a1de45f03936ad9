//! What the jail costs (`switchyard_daemon::jail`): the same `switchyard serve` (the release
//! binary, `--switchyard-bin`) twice, jailed (the default: no-new-privileges, Landlock, the
//! softgpu's seccomp allow-list) and with `--no-jail`, every sample of the two interleaved.
//! The unjailed server is the row's floor, so the ratio is the jail's cost: trapped round
//! trips (every message crosses the filter: `recvmsg`, `sendmsg`, and for the engines
//! `futex`), and COPY + FENCE through the doorbell, fixed cost and 1 MiB, the engines woken
//! from their sleep each time (`spin=0`).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use switchyard_client::Client;
use switchyard_softgpu::BAR_REGS;
use switchyard_softgpu::regs::SCRATCH;

use crate::cases::{Op, Settings, fig, timed_access};
use crate::copy::{Dir, copy_once};
use crate::gpu::{DATA_OFFSET, Gpu};
use crate::report::{Row, Target, Unit};
use crate::servers::vmm_client_config;
use crate::stats::{Contender, Plan, interleaved};

/// The goal: the jailed server's median within 5 % of the unjailed one's.
const TARGET: Target = Target {
    floor_ratio: 1.05,
    beat_peer: false,
    plus: 0.0,
};

/// A `switchyard serve` process, killed when dropped.
struct Serve {
    child: Child,
    socket: PathBuf,
}

impl Serve {
    fn start(bin: &Path, dir: &Path, name: &str, extra: &[&str]) -> Result<Self> {
        if !bin.is_file() {
            bail!(
                "{} not found: build it (`cargo build --release -p switchyard`, which scripts/bench.sh does) or pass --switchyard-bin",
                bin.display()
            );
        }
        let socket = dir.join(format!("{name}.sock"));
        let child = Command::new(bin)
            // Engines that sleep as soon as they run out of work (`spin=0`): two servers'
            // engines spinning on a 2-core machine would measure which one the scheduler
            // favours, not the jail (which costs nothing while a thread spins: no system call).
            .args(["serve", "--device", "softgpu,spin=0", "--socket"])
            .arg(&socket)
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("spawn {}", bin.display()))?;
        let mut serve = Serve { child, socket };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !serve.socket.exists() {
            if let Some(status) = serve.child.try_wait()? {
                bail!("serve {extra:?} exited: {status}");
            }
            if Instant::now() > deadline {
                bail!("serve {extra:?} did not listen");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(serve)
    }

    fn connect(&self, s: &Settings) -> Result<Client> {
        Client::connect_with(&self.socket, vmm_client_config(s.stall_timeout()))
            .with_context(|| format!("connect {}", self.socket.display()))
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `samples` after `warmup`, alternating between the two servers every 20 samples: on a
/// shared 2-core machine a burst of load then falls on both alike. `--quick`: a tenth.
fn plan(s: &Settings, warmup: usize, samples: usize) -> Plan {
    let (warmup, samples) = if s.quick {
        (warmup / 10, samples / 10)
    } else {
        (warmup, samples)
    };
    Plan::new(warmup, samples, samples / 20)
}

fn row(case: &str, op: &str, size: u64, unit: Unit, samples: &mut [Vec<u64>; 2]) -> Result<Row> {
    let [jailed, free] = samples;
    Ok(Row::new(
        "jail",
        case.to_owned(),
        op,
        "softgpu spin=0, jailed",
        Some(size),
        unit,
        fig("jailed", jailed, unit, 0.0)?,
        Some(fig("serve --no-jail", free, unit, 0.0)?),
        None,
        Some(TARGET),
        "switchyard serve (release) jailed vs --no-jail, samples interleaved every 20, pooled over fresh pairs of servers; floor: the unjailed server".into(),
    ))
}

/// The cases, in the order of their rows (and of [`one_rep`]'s results): (name, op, size).
const CASES: [(&str, &str, u64); 4] = [
    ("REGION_READ 4 B", "read", 4),
    ("REGION_WRITE 4 B", "write", 4),
    ("COPY 0 B + FENCE (fixed cost)", "copy", 0),
    ("COPY guest→VRAM 1 MiB + FENCE", "copy", MIB),
];

const MIB: u64 = 1 << 20;

/// The jail's cost: round trips and COPYs, jailed against `--no-jail`, interleaved, pooled over
/// [`Settings::reps`] fresh pairs of servers (started in turn jailed first and unjailed first:
/// thread placement on this kind of machine is sticky and bimodal, see `Settings::reps`).
pub fn jail(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    // Per case: [jailed, unjailed] samples.
    let mut pooled: Vec<[Vec<u64>; 2]> = vec![Default::default(); CASES.len()];
    for rep in 0..s.reps() {
        let jailed = || Serve::start(&s.switchyard_bin, dir, &format!("jailed{rep}"), &[]);
        let free = || {
            let name = format!("free{rep}");
            Serve::start(&s.switchyard_bin, dir, &name, &["--no-jail"])
        };
        let (jailed, free) = if rep % 2 == 0 {
            let j = jailed()?;
            (j, free()?)
        } else {
            let f = free()?;
            (jailed()?, f)
        };
        for (i, r) in one_rep(s, &jailed, &free)?.into_iter().enumerate() {
            let [a, b] = r;
            pooled[i][0].extend(a);
            pooled[i][1].extend(b);
        }
    }
    for ((case, op, size), mut samples) in CASES.into_iter().zip(pooled) {
        rows.push(row(case, op, size, Unit::Micros, &mut samples)?);
    }
    Ok(())
}

/// One repetition of every case, in [`CASES`] order: [jailed, unjailed] samples each.
fn one_rep(s: &Settings, jailed: &Serve, free: &Serve) -> Result<Vec<[Vec<u64>; 2]>> {
    let mut out = Vec::new();
    for op in [Op::Read, Op::Write] {
        let (mut a, mut b) = (jailed.connect(s)?, free.connect(s)?);
        let (mut buf_a, mut buf_b) = ([7u8; 4], [7u8; 4]);
        let mut cs = vec![
            Contender::new("jailed", || {
                timed_access(&mut a, op, BAR_REGS, SCRATCH, &mut buf_a)
            }),
            Contender::new("unjailed", || {
                timed_access(&mut b, op, BAR_REGS, SCRATCH, &mut buf_b)
            }),
        ];
        out.push(pair(interleaved(&mut cs, plan(s, 250, 5_000))?)?);
    }
    let mut gpu_a = Gpu::setup(jailed.connect(s)?, MIB)?;
    let mut gpu_b = Gpu::setup(free.connect(s)?, MIB)?;
    let (mut seq_a, mut seq_b) = (0u64, 0u64);
    let pattern: Vec<u8> = (0..MIB as usize).map(|i| (i * 13 + 1) as u8).collect();
    for g in [&mut gpu_a, &mut gpu_b] {
        g.mem_write(DATA_OFFSET, &pattern)?;
    }
    for size in [0, MIB] {
        let plan = match size {
            0 => plan(s, 250, 2_500),
            _ => plan(s, 50, 500),
        };
        let (ga, gb, sa, sb) = (&mut gpu_a, &mut gpu_b, &mut seq_a, &mut seq_b);
        let mut cs = vec![
            Contender::new("jailed", move || {
                copy_once(ga, Dir::GuestToVram, size, 1, sa)
            }),
            Contender::new("unjailed", move || {
                copy_once(gb, Dir::GuestToVram, size, 1, sb)
            }),
        ];
        out.push(pair(interleaved(&mut cs, plan)?)?);
    }
    Ok(out)
}

fn pair(r: Vec<Vec<u64>>) -> Result<[Vec<u64>; 2]> {
    <[Vec<u64>; 2]>::try_from(r).map_err(|_| anyhow::anyhow!("jail: want two sample sets"))
}
