//! `--fill-vram`: 3/4 of VRAM filled by the engine (a VRAM of gigabytes is filled in seconds,
//! where CPU stores through a trapped BAR would take hours under TCG), and checked after the
//! soak, e.g. on the destination of a live migration.
//!
//! The soak's VRAM (from the middle of VRAM on) is left out: the fill is `[0, V/2)` and
//! `[V/2 + G, V/2 + G + V/4)` (G: 16 MiB, or V/4 if less), in FILL commands of 64 MiB (1/16
//! of a smaller VRAM), each with its own pattern.

use std::time::Instant;

use crate::cmd::{Addr, Cmd};
use crate::gpu::Gpu;
use crate::say;

/// Bytes per FILL command, and the sampling step of the check: 64 MiB, or 1/16 of a smaller
/// VRAM.
fn step_of(vram: u64) -> u64 {
    (64u64 << 20).min((vram / 16).max(PAGE) & !(PAGE - 1))
}
/// The soak's VRAM, left out past the middle.
const SOAK_GAP: u64 = 16 << 20;
const PAGE: u64 = 4096;

/// What was filled: `(offset, pattern)` per `step` bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Filled {
    pub step: u64,
    pub steps: Vec<(u64, u32)>,
}

/// The pattern of step `n`.
fn pattern(n: u64) -> u32 {
    0x5f00_0011 | ((n as u32 & 0xffff) << 8)
}

/// The steps of a VRAM of `vram` bytes: `(offset, pattern)` each `step_of(vram)` bytes.
pub fn plan(vram: u64) -> Vec<(u64, u32)> {
    let step = step_of(vram);
    let half = vram / 2 / step * step;
    let quarter = vram / 4 / step * step;
    let upper = vram / 2 + SOAK_GAP.min(vram / 4);
    (0..half)
        .step_by(step as usize)
        .chain((upper..upper + quarter).step_by(step as usize))
        .filter(|o| o + step <= vram)
        .map(|o| (o, pattern(o / step)))
        .collect()
}

/// Fills the planned steps on queue 0 and waits for them.
pub fn fill(g: &mut Gpu) -> Result<Filled, String> {
    let step = step_of(g.vram_size);
    let steps = plan(g.vram_size);
    if steps.is_empty() {
        return Err(format!(
            "{} bytes of VRAM is too little to fill",
            g.vram_size
        ));
    }
    let t = Instant::now();
    for chunk in steps.chunks(8) {
        let cmds: Vec<Cmd> = chunk
            .iter()
            .map(|&(o, p)| Cmd::fill(Addr::Vram(o), step, p))
            .collect();
        g.run(0, &cmds)?;
    }
    say!(
        "fill done bytes={} ms={}",
        steps.len() as u64 * step,
        t.elapsed().as_millis()
    );
    Ok(Filled { step, steps })
}

/// Checks the first and last page of every step (engine COPY into guest memory); the pages
/// checked. Each COPY that matched, and each FILL whose two pages matched, counts as a
/// verified job.
pub fn check(g: &mut Gpu, f: &Filled) -> Result<u64, String> {
    let mark = g.dma_mark();
    let r = check_pages(g, f);
    g.dma_release(mark);
    r
}

fn check_pages(g: &mut Gpu, f: &Filled) -> Result<u64, String> {
    let buf = g.dma_alloc(PAGE, PAGE)?;
    let mut pages = 0;
    for &(o, p) in &f.steps {
        for at in [o, o + f.step - PAGE] {
            g.run(0, &[Cmd::copy(Addr::Vram(at), Addr::Iova(buf), PAGE)])?;
            let data = g.dma().read_vec(buf, PAGE as usize)?;
            if let Some(i) = data.chunks(4).position(|w| w != p.to_le_bytes().as_slice()) {
                return Err(format!(
                    "VRAM {:#x}: word {i} is {:02x?}, want {p:#010x}",
                    at,
                    &data[i * 4..i * 4 + 4]
                ));
            }
            pages += 1;
            g.stats.jobs_verified += 1;
        }
        g.stats.jobs_verified += 1;
    }
    Ok(pages)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_quarters_outside_the_soak() {
        for v in [4u64 << 30, 64 << 20] {
            let (p, step) = (plan(v), step_of(v));
            assert_eq!(p.len() as u64 * step, v / 4 * 3, "{v}");
            for &(o, _) in &p {
                assert!(
                    o + step <= v / 2 || o >= v / 2 + SOAK_GAP.min(v / 4),
                    "{o:#x}"
                );
            }
            let patterns: std::collections::HashSet<u32> = p.iter().map(|&(_, x)| x).collect();
            assert_eq!(patterns.len(), p.len(), "a pattern per step");
        }
        assert_eq!(step_of(4 << 30), 64 << 20);
    }
}
