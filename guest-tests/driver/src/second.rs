//! `--second-device` (with `--noiommu`): a VM with two softgpus. Before the soak on the first
//! device, the second one (the other 1234:5347) is opened as the first was and 3/4 of its VRAM
//! filled by its engine ([`crate::fill`]); after the soak (e.g. on the destination of a live
//! migration) its fill is checked through its engine, which proves that it came across with
//! its VRAM and runs there. Steps `second-fill` and `second-check`.

use std::time::Instant;

use crate::gpu::Gpu;
use crate::say;
use crate::{cli, fill, noiommu, regs, summary, sysfs};

/// The second device, open, with what was filled.
pub struct Second {
    gpu: Gpu,
    filled: fill::Filled,
}

impl std::fmt::Debug for Second {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Second")
            .field("vram_size", &self.gpu.vram_size)
            .field("filled", &self.filled)
            .finish_non_exhaustive()
    }
}

/// Opens the softgpu that is not `first` and fills it; recorded as step `second-fill`.
pub fn open_and_fill(
    opts: &cli::Options,
    first: &str,
    steps: &mut Vec<summary::Step>,
) -> Result<Second, String> {
    let t = Instant::now();
    let r = (|| {
        let sys = sysfs::Sysfs::system();
        let other = sys
            .list()?
            .into_iter()
            .find(|d| {
                (d.vendor, d.device) == (regs::PCI_VENDOR, regs::PCI_DEVICE) && d.bdf != first
            })
            .ok_or_else(|| format!("no second softgpu besides {first}"))?;
        let mut b = noiommu::Bringup::default();
        let mut gpu = noiommu::open(&sys, Some(&other.bdf), opts.timeout, opts.doorbell, &mut b)?;
        say!(
            "second device {}: {} MiB of VRAM",
            other.bdf,
            gpu.vram_size >> 20
        );
        match fill::fill(&mut gpu) {
            Ok(filled) => Ok(Second { gpu, filled }),
            Err(e) => {
                let _ = gpu.shutdown();
                Err(e)
            }
        }
    })();
    record(steps, "second-fill", t, r.as_ref().err())?;
    r
}

/// Checks the second device's fill and shuts it down; recorded as step `second-check`.
pub fn check(mut s: Second, steps: &mut Vec<summary::Step>) -> Result<(), String> {
    let t = Instant::now();
    let r = fill::check(&mut s.gpu, &s.filled).map(|_| ());
    let problems = s.gpu.shutdown();
    let r = r.and_then(|()| {
        if problems.is_empty() {
            Ok(())
        } else {
            Err(format!("shutdown: {}", problems.join("; ")))
        }
    });
    record(steps, "second-check", t, r.as_ref().err())
}

fn record(
    steps: &mut Vec<summary::Step>,
    name: &str,
    t: Instant,
    failure: Option<&String>,
) -> Result<(), String> {
    let ms = t.elapsed().as_millis() as u64;
    steps.push(summary::Step {
        name: name.into(),
        ok: failure.is_none(),
        ms,
    });
    match failure {
        None => {
            say!("step {name}: ok ({ms} ms)");
            Ok(())
        }
        Some(e) => {
            say!("step {name}: FAIL ({ms} ms): {e}");
            Err(format!("{name}: {e}"))
        }
    }
}
