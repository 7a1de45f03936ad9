//! `--latency N`: how long a small job takes from submission until its fence value is visible
//! in guest memory, and how many such jobs run back to back, with trapped and with mapped
//! doorbells on the same queue in the same run (so the ratio compares like with like).
//!
//! Per doorbell mode, on queue 0, each job followed by a FENCE without interrupt in the same
//! submission (one doorbell), completion seen by polling the fence slot (no interrupt, no
//! register read):
//!
//! - **NOP+FENCE**: `N` jobs, one at a time, each timed from before the ring entries are
//!   written until the fence value is seen;
//! - **COPY 4 KiB + FENCE**: the same with a 4 KiB guest → guest COPY from one of 16 source
//!   patterns into its own poisoned destination slot (up to 256 slots, 64 poisoned bytes
//!   between them); the slots are checked, bytes and gaps, after the series (after every 256
//!   jobs), outside the timed windows, so the jobs follow each other as closely as the NOPs;
//! - **back to back**: `N` NOP+FENCE jobs, each submitted as soon as the previous fence is
//!   seen; jobs/s over the whole series.
//!
//! The measurements alternate between the modes (NOP trapped, NOP mapped, COPY trapped, ...),
//! after a short warm-up in each mode. Figures are reported, never judged: the run fails only
//! if a job fails or its bytes differ.

use std::time::Instant;

use crate::cmd::{Addr, Cmd};
use crate::gpu::{Doorbell, Gpu};
use crate::reference as r;
use crate::say;
use crate::summary::{Latency, LatencyMode, LatencyRatios, Percentiles};

/// Bytes per COPY job.
pub const COPY_BYTES: u64 = 4096;
/// Distinct source patterns the COPY jobs cycle through.
const SOURCES: u64 = 16;
/// Jobs run in each mode before measuring (unmeasured, unverified NOPs).
const WARMUP: usize = 16;
/// The queue measured.
const QUEUE: u32 = 0;
/// COPY destination slots: the jobs between two checks.
const SLOTS: u64 = 256;
/// Poisoned bytes between two destination slots (and after the last).
const GAP: u64 = 64;
/// Distance between two destination slots.
const SLOT_STRIDE: u64 = COPY_BYTES + GAP;
/// Poison of the COPY destination slots and the gaps between them.
const POISON: u8 = 0xee;

/// Most jobs per figure `--latency` accepts.
pub const MAX_JOBS: usize = 100_000;

/// Nearest-rank percentile `p` (0–100) of `sorted` (ascending, non-empty).
pub fn percentile(sorted: &[f64], p: u32) -> f64 {
    let n = sorted.len();
    let rank = (u64::from(p) * n as u64).div_ceil(100).max(1) as usize;
    sorted[rank.min(n) - 1]
}

/// p50 and p90 of `samples` (microseconds), rounded to 0.1 µs.
pub fn percentiles(samples: &mut [f64]) -> Percentiles {
    samples.sort_by(f64::total_cmp);
    if samples.is_empty() {
        return Percentiles::default();
    }
    Percentiles {
        p50: round1(percentile(samples, 50)),
        p90: round1(percentile(samples, 90)),
    }
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

/// `a / b` rounded to 0.01 (0 when `b` is 0).
fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 { round2(a / b) } else { 0.0 }
}

fn micros(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

/// Raw samples of one mode.
#[derive(Debug, Default)]
struct Samples {
    nop: Vec<f64>,
    copy: Vec<f64>,
    jobs_per_s: f64,
    submissions: u64,
    kicks: u64,
}

/// One NOP+FENCE (or `cmd`+FENCE) submitted and polled for; returns its latency in µs.
fn timed_job(g: &mut Gpu, cmd: Cmd) -> Result<f64, String> {
    let t = Instant::now();
    let seq = g.submit_with_silent_fence(QUEUE, cmd)?;
    g.poll_fence(QUEUE, seq)?;
    Ok(micros(t))
}

/// Runs `f` with queue 0 in `mode`, adding its doorbell counts to `s`.
fn in_mode(
    g: &mut Gpu,
    mode: Doorbell,
    s: &mut Samples,
    f: impl FnOnce(&mut Gpu, &mut Samples) -> Result<(), String>,
) -> Result<(), String> {
    g.enable_queue(QUEUE, mode)?;
    for _ in 0..WARMUP {
        timed_job(g, Cmd::nop())?;
    }
    let (sub, kicks) = (g.stats.submissions, g.stats.kicks);
    f(g, s)?;
    s.submissions += g.stats.submissions - sub;
    s.kicks += g.stats.kicks - kicks;
    Ok(())
}

/// Checks the COPY destination `got` (all slots and gaps) after jobs `first..first + n`:
/// slot `i` holds source pattern `(first + i) % SOURCES`, everything else the poison.
fn check_slots(got: &[u8], n: u64, first: u64, patterns: &[u8]) -> Result<(), String> {
    for (i, slot) in got.chunks(SLOT_STRIDE as usize).enumerate() {
        let i = i as u64;
        let (data, gap) = slot.split_at(COPY_BYTES as usize);
        let job = first + i;
        if i < n {
            let k = (job % SOURCES) as usize;
            let want = &patterns[k * COPY_BYTES as usize..(k + 1) * COPY_BYTES as usize];
            if let Some(b) = r::first_byte_mismatch(data, want) {
                return Err(format!(
                    "COPY job {job}: byte {b} of {COPY_BYTES} differs (got {:#04x}, want {:#04x})",
                    data[b], want[b]
                ));
            }
        } else if data.iter().any(|&b| b != POISON) {
            return Err(format!(
                "destination slot {i} was written, but only {n} jobs ran"
            ));
        }
        if gap.iter().any(|&b| b != POISON) {
            return Err(format!(
                "a COPY wrote into the {GAP} bytes after destination slot {i} (job {job})"
            ));
        }
    }
    Ok(())
}

/// Measures both doorbell modes with `jobs` jobs per figure (see the module documentation),
/// prints the table and returns the figures. Queue 0 must be idle; it is left in the mode it
/// had. COPY jobs count as run and verified in the [`Gpu`]'s stats.
pub fn run(g: &mut Gpu, jobs: usize) -> Result<Latency, String> {
    g.check_doorbell_page()?;
    let before = g.doorbell(QUEUE);
    let src = g.dma_alloc(SOURCES * COPY_BYTES, 4096)?;
    let slots = SLOTS.min(jobs as u64);
    let dst = g.dma_alloc(slots * SLOT_STRIDE, 4096)?;
    let patterns = r::byte_data(0x1a7e, (SOURCES * COPY_BYTES) as usize);
    g.dma().write(src, &patterns)?;
    let poison = vec![POISON; (slots * SLOT_STRIDE) as usize];
    let mut samples: [Samples; 2] = Default::default();
    let t = Instant::now();

    for (i, mode) in Doorbell::ALL.into_iter().enumerate() {
        in_mode(g, mode, &mut samples[i], |g, s| {
            for _ in 0..jobs {
                s.nop.push(timed_job(g, Cmd::nop())?);
            }
            Ok(())
        })?;
    }
    for (i, mode) in Doorbell::ALL.into_iter().enumerate() {
        in_mode(g, mode, &mut samples[i], |g, s| {
            let mut first = 0u64;
            while first < jobs as u64 {
                let n = slots.min(jobs as u64 - first);
                g.dma().write(dst, &poison)?;
                for slot in 0..n {
                    let k = (first + slot) % SOURCES;
                    let copy = Cmd::copy(
                        Addr::Iova(src + k * COPY_BYTES),
                        Addr::Iova(dst + slot * SLOT_STRIDE),
                        COPY_BYTES,
                    );
                    s.copy.push(timed_job(g, copy)?);
                }
                let got = g.dma().read_vec(dst, (slots * SLOT_STRIDE) as usize)?;
                check_slots(&got, n, first, &patterns)
                    .map_err(|e| format!("{} doorbell: {e}", mode.name()))?;
                g.stats.jobs_verified += n;
                first += n;
            }
            Ok(())
        })?;
    }
    for (i, mode) in Doorbell::ALL.into_iter().enumerate() {
        in_mode(g, mode, &mut samples[i], |g, s| {
            let t = Instant::now();
            for _ in 0..jobs {
                let seq = g.submit_with_silent_fence(QUEUE, Cmd::nop())?;
                g.poll_fence(QUEUE, seq)?;
            }
            s.jobs_per_s = (jobs as f64 / t.elapsed().as_secs_f64()).round();
            Ok(())
        })?;
    }
    g.enable_queue(QUEUE, before)?;

    let [trapped, mapped] = samples.map(|mut s| LatencyMode {
        nop_fence_us: percentiles(&mut s.nop),
        copy_4k_us: percentiles(&mut s.copy),
        jobs_per_s: s.jobs_per_s,
        submissions: s.submissions,
        kicks: s.kicks,
    });
    let lat = Latency {
        jobs: jobs as u64,
        queue: QUEUE,
        copy_bytes: COPY_BYTES,
        ms: t.elapsed().as_millis() as u64,
        mapped_over_trapped: LatencyRatios {
            nop_fence_p50: ratio(mapped.nop_fence_us.p50, trapped.nop_fence_us.p50),
            nop_fence_p90: ratio(mapped.nop_fence_us.p90, trapped.nop_fence_us.p90),
            copy_4k_p50: ratio(mapped.copy_4k_us.p50, trapped.copy_4k_us.p50),
            copy_4k_p90: ratio(mapped.copy_4k_us.p90, trapped.copy_4k_us.p90),
            jobs_per_s: ratio(mapped.jobs_per_s, trapped.jobs_per_s),
        },
        trapped,
        mapped,
    };
    for line in table(&lat) {
        say!("{line}");
    }
    Ok(lat)
}

/// The readable table of `lat` (one line each, prefixed `latency:`).
pub fn table(lat: &Latency) -> Vec<String> {
    let row = |name: &str, m: &LatencyMode| {
        format!(
            "latency: {name:<15} | {:>9.1} {:>9.1} | {:>9.1} {:>9.1} | {:>12.0} | {:>6} {:>6}",
            m.nop_fence_us.p50,
            m.nop_fence_us.p90,
            m.copy_4k_us.p50,
            m.copy_4k_us.p90,
            m.jobs_per_s,
            m.submissions,
            m.kicks
        )
    };
    let r = &lat.mapped_over_trapped;
    vec![
        format!(
            "latency: queue {}, {} jobs per figure, each job + FENCE in one submission, fence polled in guest memory (no interrupt); both doorbell modes in this run ({} ms)",
            lat.queue, lat.jobs, lat.ms
        ),
        format!(
            "latency: {:<15} | {:>19} | {:>19} | {:>12} | {:>13}",
            "doorbell", "NOP+FENCE us", "COPY 4 KiB us", "back-to-back", "doorbells"
        ),
        format!(
            "latency: {:<15} | {:>9} {:>9} | {:>9} {:>9} | {:>12} | {:>6} {:>6}",
            "", "p50", "p90", "p50", "p90", "jobs/s", "subm.", "kicks"
        ),
        row("trapped", &lat.trapped),
        row("mapped", &lat.mapped),
        format!(
            "latency: {:<15} | {:>9.2} {:>9.2} | {:>9.2} {:>9.2} | {:>12.2} |",
            "mapped/trapped",
            r.nop_fence_p50,
            r.nop_fence_p90,
            r.copy_4k_p50,
            r.copy_4k_p90,
            r.jobs_per_s
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=10).map(f64::from).collect();
        assert_eq!(percentile(&v, 50), 5.0);
        assert_eq!(percentile(&v, 90), 9.0);
        assert_eq!(percentile(&v, 100), 10.0);
        assert_eq!(percentile(&v, 0), 1.0);
        assert_eq!(percentile(&[7.0], 90), 7.0);
        let mut shuffled = vec![3.04, 1.0, 2.0, 10.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0];
        let p = percentiles(&mut shuffled);
        assert_eq!((p.p50, p.p90), (5.0, 9.0));
        assert_eq!(shuffled[2], 3.04, "sorted in place");
        assert_eq!(percentiles(&mut []), Percentiles::default());
        assert_eq!(ratio(1.0, 3.0), 0.33);
        assert_eq!(ratio(1.0, 0.0), 0.0);
    }

    #[test]
    fn copy_slots_are_checked_bytes_and_gaps() {
        let patterns = r::byte_data(7, (SOURCES * COPY_BYTES) as usize);
        let src = |k: u64| &patterns[(k * COPY_BYTES) as usize..((k + 1) * COPY_BYTES) as usize];
        // Three slots, two jobs (17 and 18: sources 1 and 2) ran.
        let mut dst = vec![POISON; 3 * SLOT_STRIDE as usize];
        for (slot, k) in [(0u64, 1u64), (1, 2)] {
            let at = (slot * SLOT_STRIDE) as usize;
            dst[at..at + COPY_BYTES as usize].copy_from_slice(src(k));
        }
        assert_eq!(check_slots(&dst, 2, 17, &patterns), Ok(()));
        // The wrong source.
        assert!(check_slots(&dst, 2, 16, &patterns).is_err_and(|e| e.contains("COPY job 16")));
        // A job that did not run.
        let e = check_slots(&dst, 3, 17, &patterns).expect_err("slot 2 is poison");
        assert!(e.contains("COPY job 19: byte 0"), "{e}");
        // A slot written by no job.
        assert!(check_slots(&dst, 1, 17, &patterns).is_err_and(|e| e.contains("slot 1 was")));
        // One byte too many.
        dst[COPY_BYTES as usize] = src(1)[0] ^ 1;
        assert!(check_slots(&dst, 2, 17, &patterns).is_err_and(|e| e.contains("64 bytes after")));
    }

    #[test]
    fn table_has_a_row_per_mode_and_the_ratios() {
        let m = |p50: f64, jps: f64, kicks: u64| LatencyMode {
            nop_fence_us: Percentiles {
                p50,
                p90: p50 * 2.0,
            },
            copy_4k_us: Percentiles {
                p50: p50 + 10.0,
                p90: p50 + 20.0,
            },
            jobs_per_s: jps,
            submissions: 432,
            kicks,
        };
        let lat = Latency {
            jobs: 200,
            queue: 0,
            copy_bytes: COPY_BYTES,
            ms: 1234,
            trapped: m(100.0, 9000.0, 0),
            mapped: m(25.0, 30000.0, 12),
            mapped_over_trapped: LatencyRatios {
                nop_fence_p50: 0.25,
                nop_fence_p90: 0.25,
                copy_4k_p50: 0.32,
                copy_4k_p90: 0.38,
                jobs_per_s: 3.33,
            },
        };
        let t = table(&lat);
        assert_eq!(t.len(), 6);
        assert!(t.iter().all(|l| l.starts_with("latency: ")));
        assert!(t[3].contains("trapped") && t[3].contains("100.0") && t[3].contains("9000"));
        assert!(t[4].contains("mapped") && t[4].contains("25.0") && t[4].ends_with("12"));
        assert!(t[5].contains("mapped/trapped") && t[5].contains("3.33"));
    }
}
