//! `migration-bench`: what a live migration of a guest holding a Switchyard softgpu costs under
//! the patched QEMU (`scripts/bench-migration.sh`; docs/performance.md "Live migration under
//! QEMU").
//!
//! Every case boots the same TCG guest (512 MiB, 1 vCPU, `hugepages=16`) on the patched QEMU
//! (`GuestEnv::migration_qemu`), starts a destination with `-incoming unix:...` and runs QMP
//! `migrate` with QEMU's default migration parameters (unless `--set`), as the live-migration
//! guest tests do:
//!
//! - **no device**: the floor, QEMU migrating only the guest's RAM;
//! - **VRAM idle**: a softgpu whose VRAM is three quarters full of data that the bench wrote
//!   from the host into the source server's VRAM memfd (the same pages the guest's BAR2 mapping
//!   reaches; no guest tool writes hundreds of MiB of BAR2 without a driver that maps it:
//!   `/dev/mem` reads and writes stop at the end of RAM). The guest does not touch the device
//!   until the migration completed; then the bench checks the destination's VRAM byte for byte
//!   and injects an NMI (QMP `inject-nmi`), and the guest, which waited for it, checks the
//!   device through sysfs (`sygpu-driver --probe`) on the destination;
//! - **device writing**: the same fill, then `sygpu-driver --noiommu --soak S`: the driver's
//!   workload, then verified jobs on every queue (VRAM and guest memory) and a 4 MiB guest
//!   region only the device writes, checked by the CPU; the migration starts once the soak
//!   reports progress (after its first second), and the driver's summary on the destination
//!   must say pass.
//!
//! The device is `softgpu,vram=SIZE,queues=2,vram_reset=keep`: without `vram_reset=keep` the
//! driver's device reset would zero the filled VRAM before the writing cases migrate. VRAM is
//! mapped by the guest (what a real GPU's BAR is) unless the case says trapped
//! (`vram_mmap=off`); the two-device case gives the guest two softgpus, each with its own
//! server on each side, both filled and both checked.
//!
//! Per case: QEMU's `query-migrate` after completion (`total-time`, `downtime`,
//! `ram.transferred`: the whole stream, `vfio.transferred`: the device's share) and, from the
//! source server's log, the time from the device's stop (`to=StopCopy`) to its stream's last
//! byte read (`read ms`: the device's share of the downtime), the time it spent in STOP_COPY
//! (`to=StopCopy` to `from=StopCopy`; QEMU leaves STOP_COPY in its clean-up after the
//! migration completed, so this also holds the rest of QEMU's switchover), the pre-copy
//! time before it, and what its outgoing stream sent (`rounds`, `pages_sent`, `padding`). A migration still running after its limit
//! ([`Case::limit`]: an idle case twice the time its data needs at `max-bandwidth`, at least
//! 40 s; a writing case 40 s, from 4 GiB 5 minutes at QEMU's default bandwidth and
//! proportionally less at a higher one) is cancelled and counts as failed (it does not
//! converge). The goals of issue 35 are columns: an idle case's total time against
//! 1.5x what its data needs at `max-bandwidth` (`x goal`), the device's share of the
//! downtime (`read ms`), and a line comparing the two-device VM's downtime with the
//! one-device VM's. Each case runs N times (1 with
//! `--quick`, else 3); the table shows the median and, with N > 1, the range. Timings are
//! never asserted: the exit code is non-zero only when a migration or a guest check fails.
//!
//! ```text
//! migration-bench [--quick] [--only CASE,...] [--runs N] [--json PATH] [--set PARAM=VALUE]...
//!   --quick           the no-device floor and 256 MiB idle + writing, once each (CI)
//!   --only CASE,...   only these cases: no-device, 256m-idle, 256m-writing, 1g-idle,
//!                     1g-writing, 1g-idle-2dev, 1g-idle-trapped, 1g-idle-2dev-trapped,
//!                     4g-idle, 4g-idle-trapped, 4g-writing,
//!                     4g-writing-trapped
//!   --runs N          runs per case (default 3, 1 with --quick)
//!   --json PATH       also write the table, every run's figures and QEMU's status there
//!   --set P=V         migrate-set-parameters on the source first, e.g. max-bandwidth=1073741824
//!   --cap NAME        migrate-set-capabilities NAME on both QEMUs first, e.g. switchover-ack
//!                     (which QEMU accepts only with return-path: give both)
//! ```
//!
//! `MIGBENCH_SERVER_LOG` sets the servers' `RUST_LOG` (default `info`, which carries the
//! figures); `info,switchyard_server=trace` logs every reply, to see where a switchover's
//! time goes.

#![forbid(unsafe_code)]

mod figures;
mod run;
mod table;

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use switchyard_guest_tests::GuestEnv;

use crate::run::run_case;
use crate::table::print_table;

/// Hugepages the guest reserves (`sygpu_driver::hugepage::HUGEPAGES_WANTED`); every case
/// boots with them, so the floor's guest is the same guest.
const HUGEPAGES: u32 = 16;
/// Share of VRAM the bench fills before migrating (numerator over 4).
const FILL_QUARTERS: u64 = 3;
/// The least time an idle migration may run before it counts as not converging (and is
/// cancelled); see [`Case::limit`].
const CONVERGE_LIMIT: Duration = Duration::from_secs(40);
/// How long a writing case's migration may run (the goal for busy devices at QEMU's
/// defaults is five minutes).
const BUSY_LIMIT: Duration = Duration::from_secs(300);
/// QEMU's default `max-bandwidth` (128 MiB/s), the one [`BUSY_LIMIT`] is for.
const DEFAULT_BANDWIDTH: f64 = (128u64 << 20) as f64;
const MIB: f64 = (1u64 << 20) as f64;
const CHUNK: u64 = 1 << 20;
const USAGE: &str = "migration-bench [--quick] [--only CASE,...] [--runs N] [--json PATH] [--set PARAM=VALUE]... \
     [--cap CAPABILITY]...";

/// The guest side of the idle cases (`/usr/bin/sy-migbench` in the bench's image).
const GUEST_SCRIPT: &str = r#"#!/bin/sh
# sy-migbench (written by migration-bench): the guest of an idle case. Says it is ready, then
# waits without touching any device until the host injects an NMI (QMP inject-nmi, sent to the
# destination once the migration completed); with `probe`, then checks the softgpu through
# sysfs (sygpu-driver --probe), on the destination.
echo "MIGBENCH: ready"
i=0
until dmesg | grep -q 'NMI received for unknown reason'; do
  i=$((i + 1))
  if [ "$i" -gt 1500 ]; then echo "MIGBENCH: no NMI"; exit 1; fi
  sleep 0.2 2>/dev/null || sleep 1
done
echo "MIGBENCH: resumed uptime=$(cut -d' ' -f1 /proc/uptime)"
if [ "${1:-}" = probe ]; then
  sygpu-driver --probe
  rc=$?
  echo "MIGBENCH: probe rc=$rc"
  exit $rc
fi
"#;

/// Every case; the first three are the `--quick` set.
const CASES: [Case; 12] = [
    Case::floor(),
    Case::new("256m-idle", "256 MiB VRAM, idle", 256, false),
    Case::new("256m-writing", "256 MiB VRAM, device writing", 256, true),
    Case::new("1g-idle", "1 GiB VRAM, idle", 1024, false),
    Case::new("1g-writing", "1 GiB VRAM, device writing", 1024, true),
    Case::new("1g-idle-2dev", "2 devices x 1 GiB VRAM, idle", 1024, false).devices(2),
    Case::new("1g-idle-trapped", "1 GiB VRAM trapped, idle", 1024, false).trapped(),
    Case::new(
        "1g-idle-2dev-trapped",
        "2 devices x 1 GiB VRAM trapped, idle",
        1024,
        false,
    )
    .devices(2)
    .trapped(),
    Case::new("4g-idle", "4 GiB VRAM, idle", 4096, false),
    Case::new("4g-idle-trapped", "4 GiB VRAM trapped, idle", 4096, false).trapped(),
    Case::new("4g-writing", "4 GiB VRAM, device writing", 4096, true),
    Case::new(
        "4g-writing-trapped",
        "4 GiB VRAM trapped, device writing",
        4096,
        true,
    )
    .trapped(),
];

/// The table's columns after case and runs (the floor ratio follows the downtime): header,
/// figure, divisor, decimals.
const COLUMNS: [(&str, &str, f64, usize); 8] = [
    ("total ms", "total_ms", 1.0, 0),
    ("downtime ms", "downtime_ms", 1.0, 0),
    ("stream MiB", "stream_bytes", MIB, 1),
    ("device MiB", "device_bytes", MIB, 1),
    ("padding MiB", "device_padding_bytes", MIB, 1),
    ("STOP_COPY ms", "stop_copy_ms", 1.0, 1),
    ("read ms", "stream_read_ms", 1.0, 1),
    ("pages sent", "device_pages_sent", 1.0, 0),
];

/// One case of the table.
#[derive(Debug, Clone)]
struct Case {
    id: &'static str,
    label: &'static str,
    /// VRAM in MiB of each device; `None`: no device (the floor).
    vram_mib: Option<u64>,
    /// The device writes (the driver's soak) rather than idles.
    writing: bool,
    /// VRAM trapped (`vram_mmap=off`): the guest cannot map it, every write passes through
    /// the device. Otherwise the guest maps it (what a real GPU's BAR is).
    trapped: bool,
    /// Devices in the guest, each with its own server on each side.
    devices: usize,
}

impl Case {
    const fn floor() -> Self {
        Case {
            id: "no-device",
            label: "no device (floor: RAM only)",
            vram_mib: None,
            writing: false,
            trapped: false,
            devices: 0,
        }
    }

    const fn new(id: &'static str, label: &'static str, vram_mib: u64, writing: bool) -> Self {
        Case {
            id,
            label,
            vram_mib: Some(vram_mib),
            writing,
            trapped: false,
            devices: 1,
        }
    }

    const fn trapped(mut self) -> Self {
        self.trapped = true;
        self
    }

    const fn devices(mut self, n: usize) -> Self {
        self.devices = n;
        self
    }

    fn device(&self) -> Option<String> {
        let size = match self.vram_mib? {
            m if m % 1024 == 0 => format!("{}G", m / 1024),
            m => format!("{m}M"),
        };
        let mmap = if self.trapped { ",vram_mmap=off" } else { "" };
        Some(format!(
            "softgpu,vram={size},queues=2,vram_reset=keep{mmap}"
        ))
    }

    /// Bytes of VRAM data filled on each device.
    fn fill_bytes(&self) -> u64 {
        self.vram_mib.map_or(0, |m| (m << 20) / 4 * FILL_QUARTERS)
    }

    /// Bytes of VRAM data in the guest's devices.
    fn data_bytes(&self) -> u64 {
        self.fill_bytes() * self.devices as u64
    }

    /// How long its migration may run before it counts as not converging: an idle case twice
    /// the time its data needs at `bandwidth` bytes/s, at least [`CONVERGE_LIMIT`]; a writing
    /// case [`CONVERGE_LIMIT`], or [`BUSY_LIMIT`] from 4 GiB of VRAM (the goal there: converge
    /// within five minutes at QEMU's defaults).
    fn limit(&self, bandwidth: f64) -> Duration {
        if self.writing {
            return self.busy_limit(bandwidth);
        }
        let need = Duration::from_secs_f64(2.0 * self.data_bytes() as f64 / bandwidth.max(1.0));
        need.max(CONVERGE_LIMIT)
    }

    /// A writing case's limit at `bandwidth` bytes/s: [`BUSY_LIMIT`] from 4 GiB of VRAM at
    /// QEMU's default bandwidth, shorter in proportion at a higher one (at least
    /// [`CONVERGE_LIMIT`]); [`CONVERGE_LIMIT`] below 4 GiB.
    fn busy_limit(&self, bandwidth: f64) -> Duration {
        match self.vram_mib {
            Some(m) if m >= 4096 => {
                let scale = (DEFAULT_BANDWIDTH / bandwidth.max(1.0)).min(1.0);
                BUSY_LIMIT.mul_f64(scale).max(CONVERGE_LIMIT)
            }
            _ => CONVERGE_LIMIT,
        }
    }

    /// Soak seconds of a writing case at `bandwidth`: the migration starts once the soak
    /// reported progress (after its first second) and may run for its limit; the soak must
    /// outlast it.
    fn soak_seconds(&self, bandwidth: f64) -> u64 {
        self.busy_limit(bandwidth).as_secs() + 10
    }
}

/// The figures of one migration, by name: QEMU's (`total_ms`, `downtime_ms`, `setup_ms`,
/// `stream_bytes` = `ram.transferred`, the whole stream; `device_bytes` = `vfio.transferred`;
/// `ram_bytes`, the difference) and the source server's (`stop_copy_ms`, `precopy_ms`,
/// `device_rounds`, `device_pages_sent`, `device_padding_bytes`).
#[derive(Debug, Clone, Default)]
struct Sample {
    fig: BTreeMap<&'static str, f64>,
    /// What the guest check saw.
    check: String,
    /// QEMU's final `query-migrate`.
    status: Value,
}

struct Args {
    quick: bool,
    only: Option<Vec<String>>,
    runs: usize,
    json: Option<PathBuf>,
    /// `migrate-set-parameters` arguments.
    set: serde_json::Map<String, Value>,
    /// `migrate-set-capabilities` on both sides (`--cap NAME`), e.g. `switchover-ack`.
    caps: Vec<String>,
}

impl Args {
    /// The `max-bandwidth` the sources migrate at (bytes/s): `--set`'s, else QEMU's default.
    fn bandwidth(&self) -> f64 {
        self.set
            .get("max-bandwidth")
            .and_then(Value::as_f64)
            .filter(|b| *b > 0.0)
            .unwrap_or(DEFAULT_BANDWIDTH)
    }
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        quick: false,
        only: None,
        runs: 0,
        json: None,
        set: serde_json::Map::new(),
        caps: Vec::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut value = |what: &str| it.next().with_context(|| format!("{what} needs a value"));
        match arg.as_str() {
            "--quick" => a.quick = true,
            "--runs" => {
                a.runs = value("--runs")?.parse().context("--runs")?;
                ensure!((1..=20).contains(&a.runs), "--runs: 1..20");
            }
            "--only" => a.only = Some(value("--only")?.split(',').map(str::to_owned).collect()),
            "--json" => a.json = Some(PathBuf::from(value("--json")?)),
            "--set" => {
                let v = value("--set")?;
                let (k, v) = v.split_once('=').context("--set PARAM=VALUE")?;
                let v = serde_json::from_str(v).unwrap_or_else(|_| Value::from(v));
                a.set.insert(k.to_owned(), v);
            }
            "--cap" => a.caps.push(value("--cap")?),
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => bail!("unknown argument `{other}` ({USAGE})"),
        }
    }
    if a.runs == 0 {
        a.runs = if a.quick { 1 } else { 3 };
    }
    Ok(a)
}

fn main() -> ExitCode {
    match bench() {
        Ok(0) => ExitCode::SUCCESS,
        Ok(n) => {
            eprintln!("migration-bench: {n} migration(s) or guest check(s) failed; see above");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("migration-bench: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs every case; returns how many runs failed.
fn bench() -> Result<usize> {
    let args = parse_args()?;
    let env = GuestEnv::discover()?;
    let qemu = env.migration_qemu()?;
    let n = if args.quick { 3 } else { CASES.len() };
    let mut cases: Vec<Case> = CASES[..n].to_vec();
    if let Some(only) = &args.only {
        for o in only {
            ensure!(
                cases.iter().any(|c| c.id == o),
                "--only {o}: not a case of this mode"
            );
        }
        cases.retain(|c| only.iter().any(|o| o == c.id));
    }
    let top = env.log_dir("migration_bench")?;
    let initrd = build_image(&env)?;
    eprintln!(
        "migration-bench: {} case(s) x {} run(s) on {}; logs in {}",
        cases.len(),
        args.runs,
        qemu.display(),
        top.display()
    );
    let started = Instant::now();
    let mut params = Value::Null;
    let mut results: Vec<(Case, Vec<Sample>, Vec<String>)> = Vec::new();
    for case in cases {
        let (mut samples, mut failures) = (Vec::new(), Vec::new());
        for run in 1..=args.runs {
            let dir = top.join(format!("{}-{run}", case.id));
            std::fs::create_dir_all(&dir)?;
            let t = Instant::now();
            match run_case(&env, &qemu, &initrd, &dir, &case, &args, &mut params) {
                Ok(s) => {
                    eprintln!(
                        "  {} run {run}: total {} ms, downtime {} ms, device {:.1} MiB ({:.0} s)",
                        case.id,
                        s.fig.get("total_ms").unwrap_or(&f64::NAN),
                        s.fig.get("downtime_ms").unwrap_or(&f64::NAN),
                        s.fig.get("device_bytes").unwrap_or(&0.0) / MIB,
                        t.elapsed().as_secs_f64()
                    );
                    samples.push(s);
                }
                Err(e) => {
                    eprintln!(
                        "  {} run {run}: FAILED ({:.0} s; logs in {}): {e:#}",
                        case.id,
                        t.elapsed().as_secs_f64(),
                        dir.display()
                    );
                    failures.push(format!("run {run}: {e:#}"));
                }
            }
        }
        results.push((case, samples, failures));
    }
    let table = print_table(&results, &params, args.runs);
    if !args.caps.is_empty() {
        println!(
            "migration capabilities on both sides: {}",
            args.caps.join(", ")
        );
    }
    eprintln!(
        "migration-bench: {:.0} s in all",
        started.elapsed().as_secs_f64()
    );
    if let Some(path) = &args.json {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d)?;
        }
        let doc = json!({
            "mode": if args.quick { "quick" } else { "full" },
            "runs_per_case": args.runs,
            "qemu": qemu.display().to_string(),
            "migrate_parameters": params,
            "migrate_capabilities": args.caps,
            "guest": { "memory_mib": 512, "vcpus": 1, "accel": "tcg", "hugepages": HUGEPAGES },
            "vram_filled_fraction": FILL_QUARTERS as f64 / 4.0,
            "converge_limit_s": CONVERGE_LIMIT.as_secs(),
            "rows": table,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("write {}", path.display()))?;
        println!("results: {}", path.display());
    }
    Ok(results.iter().map(|r| r.2.len()).sum())
}

/// The bench's initramfs: the base image, the driver and `sy-migbench`.
fn build_image(env: &GuestEnv) -> Result<PathBuf> {
    let tmp = env
        .work
        .join(format!("migration-bench.{}", std::process::id()));
    std::fs::create_dir_all(&tmp)?;
    let script = tmp.join("sy-migbench");
    std::fs::write(&script, GUEST_SCRIPT)?;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755))?;
    let image = env.initramfs_with("initramfs-migration-bench", &[env.driver.clone(), script]);
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(image?)
}
