//! softgpu COPY throughput between guest memory and VRAM, and its fixed cost.

use std::cell::RefCell;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use switchyard_softgpu::cmd::{Command, Operand};

use crate::cases::{Settings, fig, human, wait_fences};
use crate::floors::{Memcpy, Memcpy2};
use crate::gpu::{DATA_OFFSET, Gpu, QUEUES, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::servers::{DeviceKind, Switchyard};
use crate::stats::{Contender, Plan, interleaved};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dir {
    GuestToVram,
    VramToGuest,
}

/// One COPY of `size` bytes split over `queues` queues, each followed by a FENCE; returns the
/// time from the first doorbell to the last fence seen in guest memory.
pub(crate) fn copy_once(
    gpu: &mut Gpu,
    dir: Dir,
    size: u64,
    queues: u32,
    seq: &mut u64,
) -> Result<Duration> {
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
