//! Command line: `sygpu-driver [--quick] [--doorbell trapped|mapped] [--latency N]
//! [--soak SECONDS] [--bdf BDF] [--timeout SECONDS]`, `sygpu-driver --noiommu [the same options]`,
//! `sygpu-driver --probe [--bdf BDF]` or `sygpu-driver --stamp|--check-stamp SEED [--bdf BDF]`.

use std::time::Duration;

use crate::gpu::Doorbell;
use crate::latency::MAX_JOBS;
use crate::soak::MAX_SECONDS;
use crate::sysfs::is_bdf;

/// Usage text.
pub const USAGE: &str = "\
usage: sygpu-driver [--quick] [--doorbell trapped|mapped] [--latency N]
                    [--fill-vram] [--idle SECONDS] [--soak SECONDS]
                    [--bdf DDDD:BB:DD.F] [--timeout SECONDS]
       sygpu-driver --noiommu [--quick] [--doorbell trapped|mapped] [--latency N]
                    [--fill-vram] [--idle SECONDS] [--soak SECONDS]
                    [--bdf DDDD:BB:DD.F] [--timeout SECONDS]
       sygpu-driver --probe [--bdf DDDD:BB:DD.F]
       sygpu-driver --stamp SEED | --check-stamp SEED [--bdf DDDD:BB:DD.F]

Drives the Switchyard softgpu (PCI 1234:5347) from inside a Linux guest.

  (default)   full run through VFIO (type1 IOMMU): bind to vfio-pci, mmap BAR0/BAR2,
              MSI-X eventfds, DMA through the IOMMU, COPY/FILL/SAXPY/GEMM 256^3/REDUCE on
              all queues, VRAM mmap coherence, a bad DMA address and recovery
  --quick     the same with smaller sizes (GEMM 64^3) for slow TCG guests
  --noiommu   the same workload without an IOMMU and without VFIO (for a vfio-user
              device the VMM cannot put behind a vIOMMU): sysfs enable + config file,
              resource0/resource2 mmap, DMA memory in 2 MiB hugepages at their physical
              addresses (needs root and hugepages=16 on the kernel command line),
              completion polled through INT_STATUS and fence values (no interrupts);
              the bad DMA address is one /proc/iomem shows as neither RAM nor a device
  --doorbell trapped|mapped
              how the workload publishes a queue's tail (default trapped): a Q_DOORBELL
              write (trapped by the VMM), or mapped: a store into the queue's slot of the
              doorbell page in BAR0 (FEATURES bit 8), a full fence, and a Q_DOORBELL write
              only as a kick when DB_NEED_KICK says the engine sleeps; the summary counts
              the submissions and kicks
  --latency N after the workload, measure on queue 0 with both doorbell modes (same run):
              N NOP+FENCE jobs and N 4 KiB COPY+FENCE jobs one at a time (submission to
              fence value seen in memory, polled: p50/p90 us), and N NOP+FENCE jobs back
              to back (jobs/s); a table on the console, figures and mapped/trapped ratios
              in the summary's latency object (N = 1..100000)
  --soak S    after the workload (and --latency) keep the device busy for S seconds
              (1..600), e.g. while the VM is live-migrated. Prints
                SYGPU: soak start seconds=S
              then loops: on every queue a small job (COPY guest->VRAM->guest, FILL,
              SAXPY+REDUCE or GEMM) checked bit-exact when it completes; and the device,
              never the CPU, reads a 4 MiB guest DMA region back by COPY into a second
              buffer (the CPU checks it holds the previous iteration's pattern) and then
              rewrites the whole region with FILLs whose pattern changes every iteration.
              About once a second:
                SYGPU: soak progress t=SECS jobs=N region_writes=N
              At the end, with the device idle, the CPU checks the whole region against
              the last pattern; the summary's soak object counts the jobs and the stale
              4 KiB pages. Every wait stays bounded by --timeout; the watchdog allows S
              seconds more
  --soak-vram P
              with --soak: before it, the engine fills P % of VRAM (FILL, a pattern per
              64 MiB); every iteration the CPU checks and rewrites 64 pages of VRAM through
              BAR2; after it, the CPU checks one word per filled page. Stale pages are the
              summary's soak vram_stale_pages
  --fill-vram before the soak, fill 3/4 of VRAM with the engine (FILL, 64 MiB per command,
              a pattern per 64 MiB; the soak's VRAM is left out) and print
                SYGPU: fill done bytes=N ms=M
              after the soak, check the first and last page of every 64 MiB filled
              (engine COPY into guest memory): the step fill-check
  --idle S    before the soak (after --fill-vram), leave the device idle S seconds
              (1..600), printing SYGPU: idle start seconds=S, e.g. for an idle migration
  --second-device
              with --noiommu and before the soak: open the other softgpu too, fill 3/4 of
              its VRAM as --fill-vram does; after the soak, check that fill (steps
              second-fill and second-check), e.g. a VM with two devices live-migrated
  --probe     no VFIO: check the device through sysfs (config space, capabilities,
              resource0 mmap: MAGIC, SCRATCH, NUM_QUEUES)
  --stamp S   through VFIO: write 1 MiB of data made from seed S into the upper half of
              VRAM through the BAR2 mapping, check it there and through an engine COPY
  --check-stamp S
              through VFIO: check that VRAM holds what --stamp S wrote (a device that came
              back after a hot-unplug, e.g. moved to another board), through the mapping
              and an engine COPY
  --bdf B     use the device at B (default: the first 1234:5347)
  --timeout S bound of every wait for an interrupt (or poll), seconds (default 60)

Progress lines start with 'SYGPU:'; the last line is 'SYGPU-SUMMARY {json}'
('SYGPU-PROBE {json}' for --probe, 'SYGPU-STAMP {json}' for the stamps). Exit code 0 only on pass, 1 on fail, 2 on usage errors.";

/// What to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// The VFIO workload.
    Run,
    /// The workload without IOMMU and VFIO.
    NoIommu,
    /// The sysfs probe.
    Probe,
    /// Write (or check) a VRAM stamp.
    Stamp,
    /// Print usage.
    Help,
}

/// Parsed options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Options {
    /// What to do.
    pub mode: Mode,
    /// Smaller sizes.
    pub quick: bool,
    /// Device address.
    pub bdf: Option<String>,
    /// Wait bound.
    pub timeout: Duration,
    /// The stamp's seed (`--stamp`, `--check-stamp`).
    pub stamp_seed: u64,
    /// Check the stamp rather than write it.
    pub stamp_check: bool,
    /// How the workload publishes tails (`--doorbell`).
    pub doorbell: Doorbell,
    /// Jobs per figure of the latency measurement after the workload (`--latency N`).
    pub latency: Option<usize>,
    /// Seconds of device work after the workload (`--soak S`, [`crate::soak`]).
    pub soak: Option<u64>,
    /// `--soak-vram PERCENT`: VRAM filled and checked across the soak ([`crate::vram_soak`]).
    pub soak_vram: Option<u64>,
    /// `--fill-vram`: 3/4 of VRAM filled by the engine before the soak, checked after it.
    pub fill_vram: bool,
    /// `--idle S`: seconds the device is left idle before the soak.
    pub idle: u64,
    /// `--second-device` (with `--noiommu`): a second softgpu filled before the soak and
    /// checked after it.
    pub second_device: bool,
}

/// Parses the arguments (without the program name).
pub fn parse<S: AsRef<str>>(args: &[S]) -> Result<Options, String> {
    let mut o = Options {
        mode: Mode::Run,
        quick: false,
        bdf: None,
        timeout: Duration::from_secs(60),
        stamp_seed: 0,
        stamp_check: false,
        doorbell: Doorbell::Trapped,
        latency: None,
        soak: None,
        soak_vram: None,
        fill_vram: false,
        idle: 0,
        second_device: false,
    };
    let mut workload_options: Vec<&str> = Vec::new();
    let mut modes: Vec<&str> = Vec::new();
    let mut it = args.iter().map(AsRef::as_ref);
    while let Some(a) = it.next() {
        let (key, inline) = match a.split_once('=') {
            Some((k, v)) if k.starts_with("--") => (k, Some(v)),
            _ => (a, None),
        };
        let mut value = |name: &str| -> Result<String, String> {
            match inline {
                Some(v) => Ok(v.to_string()),
                None => it
                    .next()
                    .map(str::to_string)
                    .ok_or_else(|| format!("{name} needs a value")),
            }
        };
        match key {
            "--quick" | "-q" => o.quick = true,
            "--probe" => {
                o.mode = Mode::Probe;
                modes.push("--probe");
            }
            "--noiommu" => {
                o.mode = Mode::NoIommu;
                modes.push("--noiommu");
            }
            "--stamp" | "--check-stamp" => {
                let v = value(key)?;
                o.stamp_seed = v
                    .parse()
                    .map_err(|_| format!("{key} '{v}': want a number"))?;
                o.stamp_check = key == "--check-stamp";
                o.mode = Mode::Stamp;
                modes.push(if o.stamp_check {
                    "--check-stamp"
                } else {
                    "--stamp"
                });
            }
            "--doorbell" => {
                let v = value("--doorbell")?;
                o.doorbell = Doorbell::parse(&v)
                    .ok_or_else(|| format!("--doorbell '{v}': want trapped or mapped"))?;
                workload_options.push("--doorbell");
            }
            "--latency" => {
                let v = value("--latency")?;
                let n: usize = v
                    .parse()
                    .ok()
                    .filter(|&n| (1..=MAX_JOBS).contains(&n))
                    .ok_or_else(|| format!("--latency '{v}': want 1..{MAX_JOBS} jobs"))?;
                o.latency = Some(n);
                workload_options.push("--latency");
            }
            "--soak" => {
                let v = value("--soak")?;
                let s: u64 = v
                    .parse()
                    .ok()
                    .filter(|&s| (1..=MAX_SECONDS).contains(&s))
                    .ok_or_else(|| format!("--soak '{v}': want 1..{MAX_SECONDS} seconds"))?;
                o.soak = Some(s);
                workload_options.push("--soak");
            }
            "--soak-vram" => {
                let v = value("--soak-vram")?;
                let p: u64 = v
                    .parse()
                    .ok()
                    .filter(|&p| p <= 100)
                    .ok_or_else(|| format!("--soak-vram '{v}': want 0..100 (percent)"))?;
                o.soak_vram = Some(p);
                workload_options.push("--soak-vram");
            }
            "--fill-vram" => {
                o.fill_vram = true;
                workload_options.push("--fill-vram");
            }
            "--idle" => {
                let v = value("--idle")?;
                o.idle = v
                    .parse()
                    .ok()
                    .filter(|&s| (1..=MAX_SECONDS).contains(&s))
                    .ok_or_else(|| format!("--idle '{v}': want 1..{MAX_SECONDS} seconds"))?;
                workload_options.push("--idle");
            }
            "--second-device" => {
                o.second_device = true;
                workload_options.push("--second-device");
            }
            "--help" | "-h" => o.mode = Mode::Help,
            "--bdf" => {
                let b = value("--bdf")?;
                // Accept the short form bb:dd.f for domain 0.
                let b = if b.len() == 7 { format!("0000:{b}") } else { b };
                if !is_bdf(&b) {
                    return Err(format!("--bdf '{b}' is not a PCI address (DDDD:BB:DD.F)"));
                }
                o.bdf = Some(b.to_ascii_lowercase());
            }
            "--timeout" => {
                let v = value("--timeout")?;
                let s: u64 = v
                    .parse()
                    .ok()
                    .filter(|&s| (1..=3600).contains(&s))
                    .ok_or_else(|| format!("--timeout '{v}': want 1..3600 seconds"))?;
                o.timeout = Duration::from_secs(s);
            }
            _ => return Err(format!("unknown argument '{a}'")),
        }
    }
    if o.second_device && o.mode != Mode::NoIommu {
        return Err("--second-device applies to --noiommu".into());
    }
    if modes.contains(&"--noiommu") && modes.len() > 1 {
        return Err(format!("{} cannot be combined", modes.join(" and ")));
    }
    if o.mode == Mode::Probe && o.quick {
        return Err("--quick applies to the VFIO run, not to --probe".into());
    }
    if matches!(o.mode, Mode::Probe | Mode::Stamp)
        && let Some(opt) = workload_options.first()
    {
        return Err(format!(
            "{opt} applies to the workload (VFIO or --noiommu), not to {}",
            modes.last().copied().unwrap_or("--probe")
        ));
    }
    Ok(o)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        let none: [&str; 0] = [];
        let o = parse(&none).expect("ok");
        assert_eq!(o.mode, Mode::Run);
        assert!(!o.quick);
        assert_eq!(o.bdf, None);
        assert_eq!(o.timeout, Duration::from_secs(60));
        let o = parse(&["--quick", "--bdf", "0000:00:04.0"]).expect("ok");
        assert!(o.quick);
        assert_eq!(o.bdf.as_deref(), Some("0000:00:04.0"));
        let o = parse(&["--bdf=00:05.0", "--timeout=5"]).expect("ok");
        assert_eq!(o.bdf.as_deref(), Some("0000:00:05.0"));
        assert_eq!(o.timeout, Duration::from_secs(5));
        assert_eq!(parse(&["--probe"]).map(|o| o.mode), Ok(Mode::Probe));
        assert_eq!(parse(&["-h"]).map(|o| o.mode), Ok(Mode::Help));
        assert!(parse(&["--bdf"]).is_err());
        assert!(parse(&["--bdf", "nonsense"]).is_err());
        assert!(parse(&["--timeout", "0"]).is_err());
        assert!(parse(&["--frobnicate"]).is_err());
        assert!(parse(&["--probe", "--quick"]).is_err());
        let o = parse(&["--check-stamp", "7", "--bdf", "00:05.0"]).expect("ok");
        assert_eq!(
            (o.mode, o.stamp_seed, o.stamp_check),
            (Mode::Stamp, 7, true)
        );
        let o = parse(&["--stamp=9"]).expect("ok");
        assert_eq!(
            (o.mode, o.stamp_seed, o.stamp_check),
            (Mode::Stamp, 9, false)
        );
        assert!(parse(&["--stamp", "x"]).is_err());
        assert_eq!((o.doorbell, o.latency), (Doorbell::Trapped, None));
    }

    #[test]
    fn parses_doorbell_and_latency() {
        let o = parse(&["--doorbell", "mapped", "--latency", "200"]).expect("ok");
        assert_eq!(
            (o.mode, o.doorbell, o.latency),
            (Mode::Run, Doorbell::Mapped, Some(200))
        );
        let o = parse(&["--doorbell=trapped", "--latency=1"]).expect("ok");
        assert_eq!((o.doorbell, o.latency), (Doorbell::Trapped, Some(1)));
        let o = parse(&["--noiommu", "--doorbell", "mapped"]).expect("ok");
        assert_eq!((o.mode, o.doorbell), (Mode::NoIommu, Doorbell::Mapped));
        for bad in [
            &["--doorbell"][..],
            &["--doorbell", "shadow"],
            &["--doorbell", "Mapped"],
            &["--latency", "0"],
            &["--latency", "100001"],
            &["--latency", "x"],
        ] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        for bad in [
            &["--probe", "--doorbell", "mapped"][..],
            &["--latency", "5", "--probe"],
            &["--stamp", "3", "--doorbell", "mapped"],
            &["--check-stamp", "3", "--latency", "2"],
        ] {
            assert!(
                parse(bad).is_err_and(|e| e.contains("applies to the workload")),
                "{bad:?}"
            );
        }
        assert!(USAGE.contains("--doorbell trapped|mapped") && USAGE.contains("--latency N"));
    }

    #[test]
    fn parses_soak() {
        let none: [&str; 0] = [];
        assert_eq!(parse(&none).map(|o| o.soak), Ok(None));
        let o = parse(&["--noiommu", "--soak", "30"]).expect("ok");
        assert_eq!((o.mode, o.soak), (Mode::NoIommu, Some(30)));
        let o = parse(&["--soak=1", "--quick", "--latency", "5"]).expect("ok");
        assert_eq!((o.mode, o.soak, o.latency), (Mode::Run, Some(1), Some(5)));
        assert_eq!(parse(&["--soak", "600"]).map(|o| o.soak), Ok(Some(600)));
        // Only the last one counts, as with the other options.
        assert_eq!(
            parse(&["--soak", "5", "--soak", "7"]).map(|o| o.soak),
            Ok(Some(7))
        );
        for bad in [
            &["--soak"][..],
            &["--soak", "0"],
            &["--soak", "601"],
            &["--soak", "-1"],
            &["--soak", "1.5"],
            &["--soak", "x"],
            &["--soak="],
        ] {
            assert!(parse(bad).is_err_and(|e| e.contains("--soak")), "{bad:?}");
        }
        for bad in [
            &["--probe", "--soak", "10"][..],
            &["--soak", "10", "--probe"],
            &["--stamp", "3", "--soak", "10"],
            &["--soak=2", "--check-stamp", "3"],
        ] {
            assert!(
                parse(bad).is_err_and(|e| e.contains("--soak applies to the workload")),
                "{bad:?}"
            );
        }
        assert!(USAGE.contains("[--soak SECONDS]") && USAGE.contains("soak start seconds=S"));
    }

    #[test]
    fn parses_noiommu() {
        let o = parse(&[
            "--noiommu",
            "--quick",
            "--bdf",
            "00:03.0",
            "--timeout",
            "30",
        ])
        .expect("ok");
        assert_eq!(o.mode, Mode::NoIommu);
        assert!(o.quick);
        assert_eq!(o.bdf.as_deref(), Some("0000:00:03.0"));
        assert_eq!(o.timeout, Duration::from_secs(30));
        let o = parse(&["--timeout=5", "--noiommu"]).expect("ok");
        assert_eq!((o.mode, o.quick), (Mode::NoIommu, false));
        for bad in [
            &["--noiommu", "--probe"][..],
            &["--probe", "--noiommu"],
            &["--noiommu", "--stamp", "3"],
            &["--check-stamp", "3", "--noiommu"],
        ] {
            assert!(
                parse(bad).is_err_and(|e| e.contains("cannot be combined")),
                "{bad:?}"
            );
        }
        assert!(parse(&["--noiommu", "--timeout", "0"]).is_err());
        assert!(USAGE.contains("--noiommu"));
    }
}
