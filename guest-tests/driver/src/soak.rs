//! `--soak S`: keeps the device busy for `S` seconds after the workload, for a test that
//! live-migrates the VM meanwhile, and checks that no device write was lost.
//!
//! After `SYGPU: soak start seconds=S` the loop runs iterations `n = 1, 2, …` until `S`
//! seconds have passed. Each iteration submits one batch per queue and waits for every batch's
//! fence (each wait bounded by `--timeout`: a VM paused by a migration only makes a job
//! slower, never lost before that):
//!
//! - **a verified job** per queue, the kind rotating with `n + q` ([`Job`]): COPY guest → VRAM
//!   → guest, FILL in guest memory and in VRAM (copied back), SAXPY + REDUCE, or a small GEMM,
//!   with inputs made from `n` and `q`; the result (and guard bytes behind it) is checked bit
//!   for bit against the CPU reference as soon as the fence is in;
//! - **the device-dirtied region**: [`REGION_BYTES`] of guest DMA memory in [`CHUNKS`] chunks
//!   of [`CHUNK_BYTES`] (chunk `c` on queue `c mod queues`; without an IOMMU each chunk lies
//!   in one run of adjacent hugepages). Only the device touches it during the loop: first a
//!   COPY of every chunk into a read-back buffer of the same size (from `n = 2` on), then a
//!   FILL of every chunk with [`region_pattern`]`(n, c)`. The CPU checks the read-back against
//!   the previous iteration's pattern, so a page that lost its device write (e.g. across a
//!   migration switchover, where the destination must have learnt of it from the device's
//!   dirty log) is found even though the next FILL would hide it.
//!
//! At the end the driver waits for every queue to be idle (`HEAD == TAIL`, `FENCE_COUNT` equal
//! to the FENCEs it submitted) and the CPU reads the whole region: every word must hold the
//! last iteration's pattern. Mismatches are counted per 4 KiB page: the summary's
//! `region_stale_pages` counts those of the read-backs and of the final check together
//! (`readback_stale_pages` the read-backs' share). Every soak job counts in
//! the summary's `jobs_run`; a region FILL is verified by the read-back after it (the last by
//! the final check), a read-back COPY by its own check.

use std::io::Write;
use std::time::{Duration, Instant};

use crate::cmd::{Addr, Cmd};
use crate::gpu::Gpu;
use crate::reference as r;
use crate::regs::*;
use crate::say;
use crate::summary::Soak;
use crate::vram_soak::VramSoak;
use crate::workload::{check_bytes, check_f32, mib};

/// Most seconds `--soak` accepts.
pub const MAX_SECONDS: u64 = 600;
/// Bytes of the device-dirtied region.
pub const REGION_BYTES: u64 = 4 << 20;
/// Bytes per region chunk (one FILL, one read-back COPY).
pub const CHUNK_BYTES: u64 = 256 << 10;
/// Chunks of the region.
pub const CHUNKS: usize = (REGION_BYTES / CHUNK_BYTES) as usize;
/// The unit of stale-page counting.
pub const PAGE: usize = 4096;
/// Largest buffer of a verified job.
const JOB_BYTES: u64 = 64 << 10;
/// Elements of a SAXPY + REDUCE job (fewer if the buffers are smaller).
const SAXPY_N: usize = 4096;
/// The GEMM job (M, N, K).
const GEMM: (usize, usize, usize) = (24, 20, 16);
/// Poisoned bytes checked after a job's output.
const GUARD: usize = 16;
/// Their value.
const POISON: u8 = 0xee;
/// Time between two progress lines.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// Odd, so multiplying by it permutes the 32-bit words ([`region_pattern`]).
const PATTERN_MUL: u32 = 0x9e37_79b9;
/// Its inverse modulo 2^32.
const PATTERN_INV: u32 = inverse(PATTERN_MUL);

/// The inverse of odd `a` modulo 2^32 (Newton's iteration doubles the correct low bits; `a` is
/// its own inverse modulo 8).
const fn inverse(a: u32) -> u32 {
    let mut x = a;
    let mut i = 0;
    while i < 4 {
        x = x.wrapping_mul(2u32.wrapping_sub(a.wrapping_mul(x)));
        i += 1;
    }
    x
}

/// The 32-bit word the device FILLs chunk `chunk` (< 256) of the region with in iteration `n`
/// (≥ 1): `(n mod 2^24) << 8 | chunk`, times an odd constant. Distinct for every iteration
/// (modulo 2^24, far more than a soak runs) and chunk, and never 0 (the memory before the
/// first write), so a stale word tells which write it is left from ([`pattern_source`]).
pub fn region_pattern(n: u64, chunk: usize) -> u32 {
    (((n as u32) << 8) | (chunk as u32 & 0xff)).wrapping_mul(PATTERN_MUL)
}

/// The `(iteration mod 2^24, chunk)` whose [`region_pattern`] `word` is (every word is one).
pub fn pattern_source(word: u32) -> (u64, usize) {
    let v = word.wrapping_mul(PATTERN_INV);
    (u64::from(v >> 8), (v & 0xff) as usize)
}

/// Stale pages of a buffer checked against a pattern ([`stale_pages`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stale {
    /// [`PAGE`]s (the last one possibly partial) with at least one byte that differs.
    pub pages: u64,
    /// The first differing word: its byte offset (a multiple of 4) and value.
    pub first: Option<(usize, u32)>,
}

/// Counts the pages of `data` (starting at a page boundary) that are not entirely
/// `pattern` (little-endian words, as a FILL writes them).
pub fn stale_pages(data: &[u8], pattern: u32) -> Stale {
    let page = r::fill(PAGE, pattern);
    let mut s = Stale::default();
    for (i, p) in data.chunks(PAGE).enumerate() {
        let Some(j) = r::first_byte_mismatch(p, &page[..p.len()]) else {
            continue;
        };
        s.pages += 1;
        if s.first.is_none() {
            let w = j & !3;
            let mut b = [0u8; 4];
            for (k, v) in p[w..p.len().min(w + 4)].iter().enumerate() {
                b[k] = *v;
            }
            s.first = Some((i * PAGE + w, u32::from_le_bytes(b)));
        }
    }
    s
}

/// Says what a stale word of chunk `chunk` holds, seen in iteration `n`.
fn describe(word: u32, chunk: usize, n: u64) -> String {
    match pattern_source(word) {
        (m, c) if (1..=n).contains(&m) && c < CHUNKS => {
            let whose = if c == chunk {
                String::new()
            } else {
                format!("chunk {c}'s ")
            };
            format!("{word:#010x}, {whose}pattern of write {m}")
        }
        _ => format!("{word:#010x}, no pattern of this soak"),
    }
}

/// The kinds of verified jobs; queue `q` runs [`Job::of`]`(n, q)` in iteration `n`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// COPY guest → VRAM, COPY VRAM → guest.
    Copy,
    /// FILL in guest memory; FILL in VRAM, COPY VRAM → guest.
    Fill,
    /// SAXPY, REDUCE of its result.
    SaxpyReduce,
    /// One small GEMM.
    Gemm,
}

impl Job {
    /// Every kind, in rotation order.
    pub const ALL: [Job; 4] = [Job::Copy, Job::Fill, Job::SaxpyReduce, Job::Gemm];

    /// The job of queue `q` in iteration `n`: every queue runs every kind in turn, and in
    /// one iteration the queues run different kinds (up to four queues).
    pub fn of(n: u64, q: u32) -> Job {
        Job::ALL[((n + u64::from(q)) % Job::ALL.len() as u64) as usize]
    }

    /// Data commands of one job of this kind.
    pub fn commands(self) -> u64 {
        match self {
            Job::Copy | Job::SaxpyReduce => 2,
            Job::Fill => 3,
            Job::Gemm => 1,
        }
    }

    /// Its name in messages.
    pub fn name(self) -> &'static str {
        match self {
            Job::Copy => "COPY guest->VRAM->guest",
            Job::Fill => "FILL guest + VRAM",
            Job::SaxpyReduce => "SAXPY+REDUCE",
            Job::Gemm => "GEMM",
        }
    }
}

/// Bytes per verified-job buffer so that two VRAM slots per queue fit the upper half of
/// `vram` bytes of VRAM: 64 KiB or less, a multiple of 4 KiB; `None` below 4 KiB.
pub fn job_bytes(vram: u64, queues: u32) -> Option<u64> {
    let slot = vram / 2 / (2 * u64::from(queues.max(1)));
    let b = JOB_BYTES.min(slot.saturating_sub(4096) & !4095);
    (b >= 4096).then_some(b)
}

/// DMA memory a soak allocates with `queues` queues, at most (alignment included).
pub fn dma_bytes(queues: u32) -> u64 {
    2 * REGION_BYTES + u64::from(queues) * 3 * (JOB_BYTES + 4096 + 64)
}

/// Where one queue's job puts its data.
#[derive(Debug, Clone, Copy)]
struct QueueBufs {
    /// Three guest buffers of `job_bytes + 64` bytes.
    a: u64,
    b: u64,
    c: u64,
    /// VRAM of the COPY job and of the VRAM FILL.
    vram_copy: u64,
    vram_fill: u64,
}

/// The soak's DMA memory and VRAM.
#[derive(Debug)]
struct Buffers {
    region: Vec<u64>,
    readback: Vec<u64>,
    queues: Vec<QueueBufs>,
    job_bytes: u64,
}

impl Buffers {
    fn allocate(g: &mut Gpu) -> Result<Buffers, String> {
        let job_bytes = job_bytes(g.vram_size, g.nq).ok_or_else(|| {
            format!(
                "{} of VRAM is too little for {} queue(s)",
                mib(g.vram_size),
                g.nq
            )
        })?;
        let dma = |g: &mut Gpu, len: u64| {
            g.dma_alloc(len, 4096)
                .map_err(|e| format!("DMA memory for the soak: {e}"))
        };
        let mut region = Vec::with_capacity(CHUNKS);
        let mut readback = Vec::with_capacity(CHUNKS);
        for _ in 0..CHUNKS {
            region.push(dma(g, CHUNK_BYTES)?);
        }
        for _ in 0..CHUNKS {
            readback.push(dma(g, CHUNK_BYTES)?);
        }
        let stride = job_bytes + 4096;
        let mut queues = Vec::new();
        for q in 0..u64::from(g.nq) {
            let vram = g.vram_size / 2 + 2 * q * stride;
            queues.push(QueueBufs {
                a: dma(g, job_bytes + 64)?,
                b: dma(g, job_bytes + 64)?,
                c: dma(g, job_bytes + 64)?,
                vram_copy: vram,
                vram_fill: vram + stride,
            });
        }
        Ok(Buffers {
            region,
            readback,
            queues,
            job_bytes,
        })
    }
}

/// What a job's output must be.
#[derive(Debug)]
enum Want {
    Bytes(Vec<u8>),
    F32(Vec<f32>),
}

/// One output of a job, checked after its fence.
#[derive(Debug)]
struct Check {
    what: &'static str,
    iova: u64,
    want: Want,
}

/// `want` followed by the guard bytes.
fn guarded(mut want: Vec<u8>) -> Want {
    want.extend_from_slice(&[POISON; GUARD]);
    Want::Bytes(want)
}

/// Writes the inputs of queue `q`'s job in iteration `n` (and poisons its outputs); returns
/// its commands and what its outputs must be.
fn job_commands(
    g: &Gpu,
    n: u64,
    q: u32,
    job: Job,
    qb: QueueBufs,
    job_bytes: u64,
) -> Result<(Vec<Cmd>, Vec<Check>), String> {
    let seed = (n << 4) | u64::from(q);
    // Lengths and offsets vary with n (odd ones included).
    let len = job_bytes - 64 - n % 61;
    let ulen = len as usize;
    let poison = vec![POISON; ulen + GUARD];
    let dma = g.dma();
    Ok(match job {
        Job::Copy => {
            let data = r::byte_data(seed, ulen);
            let (src, dst, v) = (qb.a + 3, qb.b + 1, qb.vram_copy + n % 8);
            dma.write(src, &data)?;
            dma.write(dst, &poison)?;
            (
                vec![
                    Cmd::copy(Addr::Iova(src), Addr::Vram(v), len),
                    Cmd::copy(Addr::Vram(v), Addr::Iova(dst), len),
                ],
                vec![Check {
                    what: "COPY guest->VRAM->guest",
                    iova: dst,
                    want: guarded(data),
                }],
            )
        }
        Job::Fill => {
            let p1 = (seed as u32).wrapping_mul(0x85eb_ca6b) ^ 0xa5a5_0f0f;
            let p2 = p1.rotate_left(13) ^ 0x0102_0304;
            let (dst, out, v) = (qb.b + 1, qb.c + 2, qb.vram_fill + n % 4);
            dma.write(dst, &poison)?;
            dma.write(out, &poison)?;
            (
                vec![
                    Cmd::fill(Addr::Iova(dst), len, p1),
                    Cmd::fill(Addr::Vram(v), len, p2),
                    Cmd::copy(Addr::Vram(v), Addr::Iova(out), len),
                ],
                vec![
                    Check {
                        what: "FILL in guest memory",
                        iova: dst,
                        want: guarded(r::fill(ulen, p1)),
                    },
                    Check {
                        what: "FILL in VRAM (copied back)",
                        iova: out,
                        want: guarded(r::fill(ulen, p2)),
                    },
                ],
            )
        }
        Job::SaxpyReduce => {
            let ne = SAXPY_N.min(ulen / 4);
            let a = 0.75 + (n % 7) as f32 * 0.375;
            let x = r::f32_data(seed, ne);
            let y = r::f32_data(!seed, ne);
            dma.write(qb.a, &r::f32_bytes(&x))?;
            dma.write(qb.b, &r::f32_bytes(&y))?;
            dma.write(qb.c, &[POISON; 8])?;
            let y_ref = r::saxpy(a, &x, &y);
            let sum = r::reduce(&y_ref);
            (
                vec![
                    Cmd::saxpy(Addr::Iova(qb.a), Addr::Iova(qb.b), ne as u64, a),
                    Cmd::reduce(Addr::Iova(qb.b), Addr::Iova(qb.c), ne as u64),
                ],
                vec![
                    Check {
                        what: "SAXPY",
                        iova: qb.b,
                        want: Want::F32(y_ref),
                    },
                    Check {
                        what: "REDUCE of the SAXPY result",
                        iova: qb.c,
                        want: Want::F32(vec![sum]),
                    },
                ],
            )
        }
        Job::Gemm => {
            let (m, nn, k) = GEMM;
            let ma = r::f32_data(seed, m * k);
            let mb = r::f32_data(!seed, k * nn);
            dma.write(qb.a, &r::f32_bytes(&ma))?;
            dma.write(qb.b, &r::f32_bytes(&mb))?;
            dma.write(qb.c, &vec![POISON; 4 * m * nn])?;
            (
                vec![Cmd::gemm(
                    Addr::Iova(qb.a),
                    Addr::Iova(qb.b),
                    Addr::Iova(qb.c),
                    m as u64,
                    nn as u64,
                    k as u64,
                )],
                vec![Check {
                    what: "GEMM",
                    iova: qb.c,
                    want: Want::F32(r::gemm(m, nn, k, &ma, &mb)),
                }],
            )
        }
    })
}

/// Reads every output of a job and compares it with what it must be.
fn verify(g: &Gpu, checks: &[Check]) -> Result<(), String> {
    for c in checks {
        match &c.want {
            Want::Bytes(want) => {
                check_bytes(c.what, &g.dma().read_vec(c.iova, want.len())?, want)?;
            }
            Want::F32(want) => {
                let got = r::f32_from_bytes(&g.dma().read_vec(c.iova, 4 * want.len())?);
                check_f32(c.what, &got, want)?;
            }
        }
    }
    Ok(())
}

/// The counts, and the first problem of each kind.
#[derive(Debug, Default)]
struct Tally {
    soak: Soak,
    /// Jobs (commands) whose results differed.
    mismatched: u64,
    job_mismatch: Option<String>,
    readback_stale: Option<String>,
    region_stale: Option<String>,
    vram_stale: Option<String>,
}

/// Checks chunk `c` (at `iova`) against the pattern of write `n`; returns its stale pages and
/// a description of the first.
fn check_chunk(g: &Gpu, iova: u64, c: usize, n: u64) -> Result<(u64, Option<String>), String> {
    let data = g.dma().read_vec(iova, CHUNK_BYTES as usize)?;
    let s = stale_pages(&data, region_pattern(n, c));
    Ok((
        s.pages,
        s.first.map(|(off, word)| {
            format!(
                "chunk {c} page {} (+{off:#x}) holds {}, want {:#010x} (write {n})",
                off / PAGE,
                describe(word, c, n),
                region_pattern(n, c)
            )
        }),
    ))
}

/// One iteration: submits every queue's batch, waits for all, checks the jobs and the
/// read-back.
fn iteration(g: &mut Gpu, n: u64, b: &Buffers, t: &mut Tally) -> Result<(), String> {
    let nq = g.nq;
    let mut pending = Vec::with_capacity(nq as usize);
    for q in 0..nq {
        let job = Job::of(n, q);
        let (mut cmds, checks) = job_commands(g, n, q, job, b.queues[q as usize], b.job_bytes)?;
        for c in (q as usize..CHUNKS).step_by(nq as usize) {
            if n > 1 {
                cmds.push(Cmd::copy(
                    Addr::Iova(b.region[c]),
                    Addr::Iova(b.readback[c]),
                    CHUNK_BYTES,
                ));
            }
            cmds.push(Cmd::fill(
                Addr::Iova(b.region[c]),
                CHUNK_BYTES,
                region_pattern(n, c),
            ));
        }
        let seq = g.submit_batch(q, &cmds)?;
        t.soak.jobs += job.commands();
        pending.push((q, job, seq, checks));
    }
    for &(q, _, seq, _) in &pending {
        g.wait_fence(q, seq)
            .map_err(|e| format!("queue {q}: {e}"))?;
    }
    t.soak.region_writes = n;
    for (q, job, _, checks) in &pending {
        match verify(g, checks) {
            Ok(()) => {
                t.soak.jobs_verified += job.commands();
                g.stats.jobs_verified += job.commands();
            }
            Err(e) => {
                t.mismatched += job.commands();
                say!("soak: iteration {n}: queue {q} {}: {e}", job.name());
                t.job_mismatch
                    .get_or_insert_with(|| format!("iteration {n} queue {q} {}: {e}", job.name()));
            }
        }
    }
    if n > 1 {
        t.soak.region_readbacks += 1;
        for c in 0..CHUNKS {
            let (pages, first) = check_chunk(g, b.readback[c], c, n - 1)?;
            if pages == 0 {
                // The read-back COPY, and the FILL it read.
                g.stats.jobs_verified += 2;
            } else {
                t.soak.readback_stale_pages += pages;
                t.soak.region_stale_pages += pages;
                let first = first.unwrap_or_default();
                say!("soak: iteration {n}: read-back: {pages} stale page(s), first {first}");
                t.readback_stale
                    .get_or_insert_with(|| format!("iteration {n}: {first}"));
            }
        }
    }
    Ok(())
}

/// Waits (bounded by the timeout) until every queue is idle with nothing left in its ring,
/// then checks that `FENCE_COUNT` counts every FENCE the driver submitted.
fn wait_idle(g: &Gpu) -> Result<(), String> {
    let deadline = Instant::now() + g.timeout;
    for q in 0..g.nq {
        loop {
            let (st, head, tail) = (g.qr32(q, Q_STATUS), g.qr32(q, Q_HEAD), g.qr32(q, Q_TAIL));
            if st == Q_STATUS_IDLE && head == tail {
                break;
            }
            if st == Q_STATUS_ERROR {
                return Err(format!(
                    "queue {q} in error after the loop: {}",
                    error_name(g.qr32(q, Q_ERROR_CODE))
                ));
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "queue {q} not idle {} s after the loop: STATUS {}, HEAD {head}, TAIL {tail}",
                    g.timeout.as_secs(),
                    status_name(st)
                ));
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    let fc = g.bar0.r64(FENCE_COUNT);
    if fc != g.stats.fences {
        return Err(format!(
            "FENCE_COUNT {fc} after the loop, the driver submitted {}",
            g.stats.fences
        ));
    }
    Ok(())
}

/// The loop and the final check.
fn soak(g: &mut Gpu, seconds: u64, vram: Option<u64>, t: &mut Tally) -> Result<(), String> {
    let b = Buffers::allocate(g)?;
    let mut vs = vram.map(|pc| VramSoak::fill(g, pc)).transpose()?;
    let r = soak_loop(g, seconds, &b, vs.as_mut(), t);
    if let Some(vs) = vs {
        t.soak.vram_filled_bytes = vs.filled;
        t.soak.vram_cpu_writes = vs.cpu_writes;
        t.soak.vram_stale_pages = vs.stale_pages;
        t.vram_stale = vs.first_stale;
    }
    r
}

/// The loop and the final check.
fn soak_loop(
    g: &mut Gpu,
    seconds: u64,
    b: &Buffers,
    mut vs: Option<&mut VramSoak>,
    t: &mut Tally,
) -> Result<(), String> {
    say!(
        "soak setup: region of {} in {CHUNKS} chunks of {} (chunk c on queue c mod {}) at {}; read-back buffer from {:#x}; per queue {} job buffers, VRAM from {:#x}",
        mib(REGION_BYTES),
        mib(CHUNK_BYTES),
        g.nq,
        b.region
            .iter()
            .map(|a| format!("{a:#x}"))
            .collect::<Vec<_>>()
            .join(" "),
        b.readback[0],
        mib(b.job_bytes),
        g.vram_size / 2
    );
    say!("soak start seconds={seconds}");
    // `println!` flushes at the newline already; be explicit, the test waits for this line.
    let _ = std::io::stdout().flush();
    let start = Instant::now();
    let length = Duration::from_secs(seconds);
    let mut last_progress = start;
    let mut n = 0;
    while n == 0 || start.elapsed() < length {
        n += 1;
        iteration(g, n, b, t).map_err(|e| format!("iteration {n}: {e}"))?;
        if let Some(vs) = vs.as_deref_mut() {
            vs.iteration(g, n)
                .map_err(|e| format!("iteration {n}: {e}"))?;
        }
        if last_progress.elapsed() >= PROGRESS_EVERY {
            last_progress = Instant::now();
            say!(
                "soak progress t={} jobs={} region_writes={}",
                start.elapsed().as_secs(),
                t.soak.jobs,
                t.soak.region_writes
            );
        }
    }
    wait_idle(g).map_err(|e| format!("after {n} iterations: {e}"))?;
    if let Some(vs) = vs {
        vs.finish(g, n)?;
    }
    for c in 0..CHUNKS {
        let (pages, first) = check_chunk(g, b.region[c], c, n)?;
        if pages == 0 {
            g.stats.jobs_verified += 1;
        } else {
            t.soak.region_stale_pages += pages;
            t.region_stale.get_or_insert(first.unwrap_or_default());
        }
    }
    Ok(())
}

/// Runs the soak for `seconds` on a device that passed the workload; returns its summary and,
/// if it failed, why (`"soak: …"`). Its DMA memory is released afterwards.
pub fn run(g: &mut Gpu, seconds: u64, vram: Option<u64>) -> (Soak, Option<String>) {
    let t0 = Instant::now();
    let mark = g.dma_mark();
    let mut t = Tally {
        soak: Soak {
            seconds,
            region_bytes: REGION_BYTES,
            ..Soak::default()
        },
        ..Tally::default()
    };
    let res = soak(g, seconds, vram, &mut t);
    g.dma_release(mark);
    let s = &mut t.soak;
    s.ms = t0.elapsed().as_millis() as u64;
    let mut problems = Vec::new();
    if let Err(e) = res {
        problems.push(e);
    }
    if t.mismatched > 0 {
        problems.push(format!(
            "{} of {} jobs differ from the CPU reference (first: {})",
            t.mismatched,
            s.jobs,
            t.job_mismatch.as_deref().unwrap_or_default()
        ));
    }
    if s.readback_stale_pages > 0 {
        problems.push(format!(
            "{} stale 4 KiB pages in the region's read-backs (first: {})",
            s.readback_stale_pages,
            t.readback_stale.as_deref().unwrap_or_default()
        ));
    }
    let final_stale = s.region_stale_pages - s.readback_stale_pages;
    if final_stale > 0 {
        problems.push(format!(
            "{final_stale} of {} 4 KiB pages of the region do not hold the last write's pattern at the end (first: {})",
            REGION_BYTES / PAGE as u64,
            t.region_stale.as_deref().unwrap_or_default()
        ));
    }
    if s.vram_stale_pages > 0 {
        problems.push(format!(
            "{} stale 4 KiB pages of VRAM (first: {})",
            s.vram_stale_pages,
            t.vram_stale.as_deref().unwrap_or_default()
        ));
    }
    s.ok = problems.is_empty() && s.region_writes > 0 && s.jobs_verified == s.jobs;
    say!(
        "soak done: {} in {} ms: {} iterations (region writes), jobs {}/{} verified, read-backs {} ({} stale pages), final region check {final_stale} stale pages",
        if s.ok { "ok" } else { "FAIL" },
        s.ms,
        s.region_writes,
        s.jobs_verified,
        s.jobs,
        s.region_readbacks,
        s.readback_stale_pages,
    );
    let failure = (!s.ok).then(|| {
        format!(
            "soak: {}",
            if problems.is_empty() {
                format!(
                    "{} of {} jobs verified, {} region writes",
                    s.jobs_verified, s.jobs, s.region_writes
                )
            } else {
                problems.join("; ")
            }
        )
    });
    (t.soak, failure)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_are_distinct_nonzero_and_decode() {
        assert_eq!(PATTERN_MUL.wrapping_mul(PATTERN_INV), 1);
        let mut seen = std::collections::HashSet::new();
        for n in 1..=2000u64 {
            for c in 0..CHUNKS {
                let p = region_pattern(n, c);
                assert_ne!(p, 0, "n {n} chunk {c}");
                assert!(seen.insert(p), "n {n} chunk {c} repeats {p:#x}");
                assert_eq!(pattern_source(p), (n, c));
            }
        }
        // Changes with n for every chunk, up to 2^24 iterations (a 600 s soak runs far fewer).
        for n in [1, 255, 256, (1 << 24) - 1] {
            assert_ne!(region_pattern(n, 3), region_pattern(n + 1, 3));
        }
        assert_ne!(region_pattern((1 << 24) - 1, 0), 0);
        assert_eq!(
            pattern_source(0),
            (0, 0),
            "zero memory: no iteration of a soak"
        );
        assert!(describe(0, 2, 9).contains("no pattern of this soak"));
        assert!(describe(region_pattern(7, 2), 2, 9).ends_with(", pattern of write 7"));
        assert!(describe(region_pattern(7, 5), 2, 9).contains("chunk 5's pattern of write 7"));
        assert!(
            describe(region_pattern(10, 2), 2, 9).contains("no pattern"),
            "future"
        );
    }

    #[test]
    fn counts_stale_pages() {
        let p = region_pattern(5, 1);
        let mut data = r::fill(4 * PAGE, p);
        assert_eq!(stale_pages(&data, p), Stale::default());
        assert_eq!(stale_pages(&data, region_pattern(4, 1)).pages, 4);
        // One byte in page 1, two words in page 3.
        data[PAGE + 4094] ^= 1;
        let old = region_pattern(4, 1);
        data[3 * PAGE + 8..3 * PAGE + 12].copy_from_slice(&old.to_le_bytes());
        data[3 * PAGE + 100..3 * PAGE + 104].copy_from_slice(&old.to_le_bytes());
        let s = stale_pages(&data, p);
        assert_eq!(s.pages, 2);
        assert_eq!(s.first, Some((PAGE + 4092, p ^ (1 << 16))));
        // A partial last page and a partial last word.
        let mut short = r::fill(PAGE + 6, p);
        assert_eq!(stale_pages(&short, p).pages, 0);
        short[PAGE + 5] ^= 0xff;
        let s = stale_pages(&short, p);
        assert_eq!(s.pages, 1);
        let b = p.to_le_bytes();
        assert_eq!(
            s.first,
            Some((PAGE + 4, u32::from_le_bytes([b[0], b[1] ^ 0xff, 0, 0])))
        );
        assert_eq!(stale_pages(&[], p), Stale::default());
    }

    #[test]
    fn jobs_rotate_over_queues() {
        for n in 1..9 {
            let kinds: Vec<Job> = (0..4).map(|q| Job::of(n, q)).collect();
            for k in Job::ALL {
                assert!(kinds.contains(&k), "iteration {n}: {kinds:?}");
            }
            assert_ne!(Job::of(n, 0), Job::of(n + 1, 0));
        }
        assert_eq!(
            Job::ALL.iter().map(|j| j.commands()).sum::<u64>(),
            8,
            "2 COPY + 3 FILL/COPY + SAXPY, REDUCE + GEMM"
        );
    }

    #[test]
    fn sizes_fit() {
        assert_eq!(CHUNKS, 16);
        assert_eq!(REGION_BYTES % PAGE as u64, 0);
        assert_eq!(CHUNK_BYTES % PAGE as u64, 0);
        assert_eq!(job_bytes(64 << 20, 2), Some(JOB_BYTES));
        assert_eq!(job_bytes(64 << 20, 8), Some(JOB_BYTES));
        // 1 MiB VRAM, 8 queues: 32 KiB slots.
        assert_eq!(job_bytes(1 << 20, 8), Some(28 << 10));
        assert_eq!(job_bytes(64 << 10, 8), None);
        for (vram, nq) in [
            (64u64 << 20, 8u32),
            (1 << 20, 8),
            (1 << 20, 1),
            (16 << 20, 3),
        ] {
            let b = job_bytes(vram, nq).expect("fits");
            let end = vram / 2 + 2 * u64::from(nq) * (b + 4096);
            assert!(end <= vram, "{vram} {nq}");
            // The largest job output (plus offsets and guard) fits its buffer.
            assert!(b - 64 + 3 + GUARD as u64 <= b + 64);
            let (m, n, k) = GEMM;
            assert!(4 * (m * k).max(k * n).max(m * n) as u64 <= b);
        }
        // The soak and the rings fit the arena of a quick VFIO run grown to three windows.
        assert!(dma_bytes(8) + (1 << 20) <= 12 << 20);
    }
}
