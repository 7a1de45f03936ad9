//! `--soak-vram PERCENT`: VRAM contents across a soak (and the live migration a test runs
//! meanwhile), for the migration tests of mapped VRAM (issue 35).
//!
//! - **Before the soak**, the device's FILL engine fills `PERCENT` % of VRAM in commands of
//!   [`FILL_BYTES`], each with its own pattern ([`fill_pattern`] of its offset), leaving out
//!   the soak's job buffers and the CPU region: `[0, VRAM/2)` first, then from
//!   `VRAM/2 + `[`HOLE`] on. A fill of gigabytes costs the engine a memset, not guest CPU time.
//! - **Every iteration**, the CPU reads the [`CPU_PAGES`] pages of the CPU region at
//!   `VRAM/2 + `[`CPU_AT`] through BAR2 (the guest's mapping of VRAM, or reads and writes
//!   the device serves when VRAM is not mappable), checks that each holds the pattern it
//!   wrote in the previous iteration ([`cpu_word`]), and writes the next. A write the guest
//!   made through its mapping and a migration lost is found on the destination by the next
//!   iteration's check.
//! - **After the soak**, the CPU checks one word per filled page (every 64th page when VRAM
//!   is not mappable: each read is then a message to the device) and the CPU region.
//!
//! Stale pages of all three checks are counted in the summary's `vram_stale_pages`.

use crate::cmd::{Addr, Cmd};
use crate::gpu::Gpu;
use crate::say;

/// Bytes per FILL command.
pub const FILL_BYTES: u64 = 64 << 20;
/// VRAM left out of the fill above `VRAM/2` (the soak's job buffers and the CPU region).
pub const HOLE: u64 = 4 << 20;
/// Offset of the CPU region above `VRAM/2`.
pub const CPU_AT: u64 = 2 << 20;
/// Pages of the CPU region.
pub const CPU_PAGES: u64 = 64;
const PAGE: u64 = 4096;

/// The pattern of the FILL command at VRAM offset `offset` (never 0).
pub fn fill_pattern(offset: u64) -> u32 {
    (((offset >> 20) as u32).wrapping_mul(0x9e37_79b9) ^ 0x5a5a_0001) | 1
}

/// Every word of CPU-region page `p` after iteration `n`'s write.
pub fn cpu_word(n: u64, p: u64) -> u64 {
    0xc0de_0000_0000_0000 | (n << 16) | p
}

/// The FILL commands for `percent` % of `vram` bytes: `(offset, len)`.
pub fn fill_extents(vram: u64, percent: u64) -> Vec<(u64, u64)> {
    let mut want = (vram / 100 * percent.min(100)) & !(PAGE - 1);
    let half = vram / 2;
    let mut out = Vec::new();
    for (start, end) in [(0, half), (half + HOLE, vram)] {
        let mut at = start;
        while want > 0 && at < end {
            let len = FILL_BYTES.min(end - at).min(want);
            out.push((at, len));
            at += len;
            want -= len;
        }
    }
    out
}

/// The state of `--soak-vram` through a soak.
#[derive(Debug, Default)]
pub struct VramSoak {
    fills: Vec<(u64, u64)>,
    cpu_at: u64,
    /// Bytes the engine filled.
    pub filled: u64,
    /// CPU-region writes (iterations).
    pub cpu_writes: u64,
    /// Stale pages found by all checks.
    pub stale_pages: u64,
    /// The first stale page, described.
    pub first_stale: Option<String>,
}

impl VramSoak {
    /// Fills `percent` % of VRAM with the engine (queue 0), before the soak.
    pub fn fill(g: &mut Gpu, percent: u64) -> Result<VramSoak, String> {
        let fills = fill_extents(g.vram_size, percent);
        let t = std::time::Instant::now();
        for chunk in fills.chunks(8) {
            let cmds: Vec<Cmd> = chunk
                .iter()
                .map(|&(at, len)| Cmd::fill(Addr::Vram(at), len, fill_pattern(at)))
                .collect();
            g.run(0, &cmds).map_err(|e| format!("VRAM fill: {e}"))?;
        }
        let filled = fills.iter().map(|f| f.1).sum();
        say!(
            "soak vram: filled {} MiB of {} MiB in {} ms; CPU region {CPU_PAGES} pages at {:#x}",
            filled >> 20,
            g.vram_size >> 20,
            t.elapsed().as_millis(),
            g.vram_size / 2 + CPU_AT
        );
        Ok(VramSoak {
            fills,
            cpu_at: g.vram_size / 2 + CPU_AT,
            filled,
            ..VramSoak::default()
        })
    }

    fn stale(&mut self, what: String) {
        self.stale_pages += 1;
        self.first_stale.get_or_insert(what);
    }

    /// Checks that the CPU region holds iteration `n`'s pattern (none before `n = 1`).
    fn check_cpu(&mut self, g: &Gpu, n: u64) -> Result<(), String> {
        let mut page = vec![0u8; PAGE as usize];
        for p in 0..CPU_PAGES {
            let at = self.cpu_at + p * PAGE;
            g.vram
                .read(at, &mut page)
                .map_err(|e| format!("VRAM CPU region read: {e:?}"))?;
            let want = cpu_word(n, p);
            if let Some(w) = page
                .chunks_exact(8)
                .map(|c| u64::from_le_bytes(c.try_into().unwrap_or_default()))
                .find(|&w| w != want)
            {
                self.stale(format!(
                    "VRAM {at:#x} (CPU region page {p}) holds {w:#x}, want {want:#x} (write {n})"
                ));
            }
        }
        Ok(())
    }

    /// Iteration `n`: checks the previous write, then writes this one.
    pub fn iteration(&mut self, g: &Gpu, n: u64) -> Result<(), String> {
        if n > 1 {
            self.check_cpu(g, n - 1)?;
        }
        for p in 0..CPU_PAGES {
            let page: Vec<u8> = std::iter::repeat_n(cpu_word(n, p).to_le_bytes(), 512)
                .flatten()
                .collect();
            g.vram
                .write(self.cpu_at + p * PAGE, &page)
                .map_err(|e| format!("VRAM CPU region write: {e:?}"))?;
        }
        self.cpu_writes = n;
        Ok(())
    }

    /// After the soak (`n` iterations): the CPU region and the filled pages. A FILL command
    /// whose pages all hold its pattern counts as a verified job.
    pub fn finish(&mut self, g: &mut Gpu, n: u64) -> Result<(), String> {
        self.check_cpu(g, n)?;
        let step = if g.vram.is_file_io() { 64 * PAGE } else { PAGE };
        let fills = std::mem::take(&mut self.fills);
        let mut word = [0u8; 8];
        for &(at, len) in &fills {
            let stale_before = self.stale_pages;
            let p = fill_pattern(at);
            let want = u64::from(p) | u64::from(p) << 32;
            let mut off = at;
            while off < at + len {
                // A different word of each page.
                let w = off + (off / PAGE % 512) * 8;
                let got = if g.vram.is_file_io() {
                    g.vram
                        .read(w, &mut word)
                        .map_err(|e| format!("VRAM read: {e:?}"))?;
                    u64::from_le_bytes(word)
                } else {
                    g.vram.r64(w)
                };
                if got != want {
                    self.stale(format!(
                        "VRAM {w:#x} (filled) holds {got:#x}, want {want:#x}"
                    ));
                }
                off += step;
            }
            if self.stale_pages == stale_before {
                g.stats.jobs_verified += 1;
            }
        }
        self.fills = fills;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_leave_the_hole_and_add_up() {
        let vram = 4u64 << 30;
        let f = fill_extents(vram, 75);
        let total: u64 = f.iter().map(|e| e.1).sum();
        assert_eq!(total, (vram / 100 * 75) & !(PAGE - 1));
        for &(at, len) in &f {
            assert!(
                at + len <= vram / 2 || at >= vram / 2 + HOLE,
                "{at:#x}+{len:#x}"
            );
            assert!(len <= FILL_BYTES && len > 0);
        }
        assert!(fill_extents(64 << 20, 0).is_empty());
        let all: u64 = fill_extents(64 << 20, 100).iter().map(|e| e.1).sum();
        assert_eq!(all, (64 << 20) - HOLE);
    }

    #[test]
    fn patterns_differ() {
        assert_ne!(fill_pattern(0), fill_pattern(64 << 20));
        assert_ne!(fill_pattern(0), 0);
        assert_ne!(cpu_word(1, 0), cpu_word(2, 0));
        assert_ne!(cpu_word(1, 0), cpu_word(1, 1));
    }
}
