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
//!   region only the device writes, checked by the CPU; the migration starts 2 s into the
//!   soak, and the driver's summary on the destination must say pass.
//!
//! The device is `softgpu,vram=SIZE,queues=2,vram_reset=keep`: without `vram_reset=keep` the
//! driver's device reset would zero the filled VRAM before the writing cases migrate.
//!
//! Per case: QEMU's `query-migrate` after completion (`total-time`, `downtime`,
//! `ram.transferred`: the whole stream, `vfio.transferred`: the device's share) and, from the
//! source server's log, the time the device spent in STOP_COPY (`arc=PreCopyToStopCopy` to
//! `arc=EndStopCopy`), the pre-copy time before it, and what its outgoing stream sent
//! (`rounds`, `pages_sent`, `padding`). A migration still running after [`CONVERGE_LIMIT`] is
//! cancelled and counts as failed (it does not converge). Each case runs N times (1 with
//! `--quick`, else 3); the table shows the median and, with N > 1, the range. Timings are
//! never asserted: the exit code is non-zero only when a migration or a guest check fails.
//!
//! ```text
//! migration-bench [--quick] [--only CASE,...] [--runs N] [--json PATH] [--set PARAM=VALUE]...
//!   --quick           the no-device floor and 256 MiB idle + writing, once each (CI)
//!   --only CASE,...   only these cases: no-device, 256m-idle, 256m-writing, 1g-idle, 1g-writing
//!   --runs N          runs per case (default 3, 1 with --quick)
//!   --json PATH       also write the table, every run's figures and QEMU's status there
//!   --set P=V         migrate-set-parameters on the source first, e.g. max-bandwidth=1073741824
//! ```

#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use switchyard_guest_tests::{Guest, GuestEnv, GuestOutput, GuestSpec, Server, wait_until};
use switchyard_qemu::{Qmp, VfioUserDevice};

/// Hugepages the guest reserves (`sygpu_driver::hugepage::HUGEPAGES_WANTED`); every case
/// boots with them, so the floor's guest is the same guest.
const HUGEPAGES: u32 = 16;
/// Share of VRAM the bench fills before migrating (numerator over 4).
const FILL_QUARTERS: u64 = 3;
/// How long a migration may run before it counts as not converging (and is cancelled).
const CONVERGE_LIMIT: Duration = Duration::from_secs(40);
/// Soak seconds of the writing cases: the migration starts 2 s in and may run for
/// [`CONVERGE_LIMIT`]; the soak must outlast it.
const SOAK_SECONDS: u32 = 50;
const MIB: f64 = (1u64 << 20) as f64;
const CHUNK: u64 = 1 << 20;
const USAGE: &str =
    "migration-bench [--quick] [--only CASE,...] [--runs N] [--json PATH] [--set PARAM=VALUE]...";

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

/// Every case: id, label, VRAM MiB (`None`: no device), writing; the first three are the
/// `--quick` set.
const CASES: [(&str, &str, Option<u64>, bool); 5] = [
    ("no-device", "no device (floor: RAM only)", None, false),
    ("256m-idle", "256 MiB VRAM, idle", Some(256), false),
    (
        "256m-writing",
        "256 MiB VRAM, device writing",
        Some(256),
        true,
    ),
    ("1g-idle", "1 GiB VRAM, idle", Some(1024), false),
    ("1g-writing", "1 GiB VRAM, device writing", Some(1024), true),
];

/// The table's columns after case and runs (the floor ratio follows the downtime): header,
/// figure, divisor, decimals.
const COLUMNS: [(&str, &str, f64, usize); 7] = [
    ("total ms", "total_ms", 1.0, 0),
    ("downtime ms", "downtime_ms", 1.0, 0),
    ("stream MiB", "stream_bytes", MIB, 1),
    ("device MiB", "device_bytes", MIB, 1),
    ("padding MiB", "device_padding_bytes", MIB, 1),
    ("STOP_COPY ms", "stop_copy_ms", 1.0, 1),
    ("pages sent", "device_pages_sent", 1.0, 0),
];

/// One case of the table.
#[derive(Debug, Clone)]
struct Case {
    id: &'static str,
    label: &'static str,
    /// VRAM in MiB; `None`: no device (the floor).
    vram_mib: Option<u64>,
    /// The device writes (the driver's soak) rather than idles.
    writing: bool,
}

impl Case {
    fn device(&self) -> Option<String> {
        let size = match self.vram_mib? {
            m if m % 1024 == 0 => format!("{}G", m / 1024),
            m => format!("{m}M"),
        };
        Some(format!("softgpu,vram={size},queues=2,vram_reset=keep"))
    }

    fn fill_bytes(&self) -> u64 {
        self.vram_mib.map_or(0, |m| (m << 20) / 4 * FILL_QUARTERS)
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
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        quick: false,
        only: None,
        runs: 0,
        json: None,
        set: serde_json::Map::new(),
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
    let mut cases: Vec<Case> = CASES[..n]
        .iter()
        .map(|&(id, label, vram_mib, writing)| Case {
            id,
            label,
            vram_mib,
            writing,
        })
        .collect();
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

/// One side of a migration.
struct Side {
    server: Option<Server>,
    guest: Guest,
    qmp: Qmp,
}

/// Starts one side: its server (the source's VRAM filled), then its QEMU (the destination's
/// waiting on `incoming`).
fn start_side(
    env: &GuestEnv,
    qemu: &Path,
    initrd: &Path,
    dir: &Path,
    case: &Case,
    name: &str,
    incoming: Option<&Path>,
) -> Result<Side> {
    let mut server = None;
    if let Some(device) = case.device() {
        let sdir = dir.join(name);
        std::fs::create_dir_all(&sdir)?;
        let s = Server::start_logging(env, &sdir, &device, &[], "info")
            .with_context(|| format!("the {name} server"))?;
        if incoming.is_none() {
            fill_vram(&s, case)?;
        }
        server = Some(s);
    }
    let mut spec = if case.writing {
        let mut spec = GuestSpec::new("sygpu-driver");
        spec.args = vec![
            "--noiommu".into(),
            "--soak".into(),
            SOAK_SECONDS.to_string(),
        ];
        spec
    } else {
        let mut spec = GuestSpec::new("sy-migbench");
        if server.is_some() {
            spec.args = vec!["probe".into()];
        }
        spec
    };
    spec.kernel_args = vec![format!("hugepages={HUGEPAGES}")];
    spec.initrd = Some(initrd.to_owned());
    if let Some(s) = &server {
        spec.devices = vec![VfioUserDevice::new("gpu0", &s.socket)];
    }
    spec.qmp = true;
    spec.qemu = Some(qemu.to_owned());
    spec.name = Some(name.to_owned());
    spec.timeout = Duration::from_secs(300);
    spec.incoming = incoming.map(Path::to_owned);
    let guest = Guest::boot(env, dir, &spec).with_context(|| format!("boot the {name} QEMU"))?;
    let qmp = Qmp::connect(guest.qmp.clone().context("QMP")?, Duration::from_secs(30))
        .with_context(|| format!("the {name} QMP"))?;
    Ok(Side { server, guest, qmp })
}

fn run_case(
    env: &GuestEnv,
    qemu: &Path,
    initrd: &Path,
    dir: &Path,
    case: &Case,
    args: &Args,
    params: &mut Value,
) -> Result<Sample> {
    let mut src = start_side(env, qemu, initrd, dir, case, "src", None)?;
    let ready = if case.writing {
        "SYGPU: soak start"
    } else {
        "MIGBENCH: ready"
    };
    src.guest
        .wait_for_line(ready)
        .with_context(|| format!("the source guest prints `{ready}`"))?;
    let incoming = dir.join("migration.sock");
    let dst = start_side(env, qemu, initrd, dir, case, "dst", Some(&incoming))?;
    wait_until(Duration::from_secs(30), "the incoming socket", || {
        incoming.exists().then_some(())
    })?;
    if !args.set.is_empty() {
        let set = Value::Object(args.set.clone());
        src.qmp.execute("migrate-set-parameters", Some(set))?;
    }
    if params.is_null() {
        *params = src.qmp.execute("query-migrate-parameters", None)?;
    }
    if case.writing {
        // Some verified jobs before the migration starts.
        std::thread::sleep(Duration::from_secs(2));
    }
    let src_log = |src: &Side| {
        src.server
            .as_ref()
            .map(Server::log_text)
            .unwrap_or_default()
    };
    let st = match migrate(&mut src.qmp, &format!("unix:{}", incoming.display())) {
        Ok(st) => st,
        Err(e) => {
            let f = device_figures(&src_log(&src));
            let mib = |k| f.get(k).map_or("?".into(), |v| format!("{:.0}", v / MIB));
            bail!(
                "{e:#}; the device's outgoing stream: {} rounds, {} pages, {} MiB of padding",
                f.get("device_rounds").unwrap_or(&f64::NAN),
                f.get("device_pages_sent").unwrap_or(&f64::NAN),
                mib("device_padding_bytes")
            );
        }
    };
    let status = src.qmp.query_status()?;
    ensure!(
        status.status == "postmigrate",
        "the source is {status:?} after the migration"
    );
    let _ = src.qmp.quit();
    drop(src.guest);
    let check = if case.writing {
        let src_serial = std::fs::read_to_string(dir.join("serial-src.log"))?;
        check_soak(dst.guest.wait()?, &src_serial)?
    } else {
        check_idle(case, dst)?
    };
    let log = src
        .server
        .as_ref()
        .map(Server::log_text)
        .unwrap_or_default();
    let mut fig = device_figures(&log);
    ensure!(
        case.vram_mib.is_none() || fig.contains_key("stop_copy_ms"),
        "the source server's log lacks the migration lines (RUST_LOG=info):\n{log}"
    );
    for (name, v) in [
        ("total_ms", &st["total-time"]),
        ("downtime_ms", &st["downtime"]),
        ("setup_ms", &st["setup-time"]),
        ("stream_bytes", &st["ram"]["transferred"]),
        ("device_bytes", &st["vfio"]["transferred"]),
    ] {
        fig.extend(v.as_f64().map(|v| (name, v)));
    }
    let stream = fig.get("stream_bytes").copied().unwrap_or(0.0);
    fig.insert(
        "ram_bytes",
        stream - fig.get("device_bytes").unwrap_or(&0.0),
    );
    Ok(Sample {
        fig,
        check,
        status: st,
    })
}

/// `migrate` to `uri`, then `query-migrate` until it ends; its last status, which must be
/// `completed`. One still running after [`CONVERGE_LIMIT`] is cancelled: an error.
fn migrate(qmp: &mut Qmp, uri: &str) -> Result<Value> {
    qmp.execute("migrate", Some(json!({ "uri": uri })))?;
    let started = Instant::now();
    loop {
        let st = qmp.execute("query-migrate", None)?;
        match st["status"].as_str() {
            Some("completed") => return Ok(st),
            Some("failed" | "cancelled") => bail!("the migration ended {st}"),
            _ => {}
        }
        if started.elapsed() >= CONVERGE_LIMIT {
            qmp.execute("migrate_cancel", None)?;
            let _ = wait_until(Duration::from_secs(30), "the cancel", || {
                let s = qmp.execute("query-migrate", None).ok()?;
                (s["status"] != "active" && s["status"] != "cancelling").then_some(())
            });
            let p = qmp.execute("query-migrate-parameters", None)?;
            bail!(
                "did not converge in {} s (cancelled): QEMU expected a downtime of {} ms \
                 (downtime-limit {} ms) with {:.1} MiB of RAM left; device sent {:.0} MiB",
                CONVERGE_LIMIT.as_secs(),
                st["expected-downtime"],
                p["downtime-limit"],
                st["ram"]["remaining"].as_f64().unwrap_or(f64::NAN) / MIB,
                st["vfio"]["transferred"].as_f64().unwrap_or(f64::NAN) / MIB,
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// An idle case after the switchover: the destination's VRAM holds the fill, byte for byte;
/// then the NMI lets the guest go on, and it must report from the destination.
fn check_idle(case: &Case, dst: Side) -> Result<String> {
    let Side {
        server,
        guest,
        mut qmp,
    } = dst;
    let mut what = String::new();
    if let Some(server) = &server {
        check_vram(&vram_file(server)?.0, case)?;
        what = format!(
            "destination VRAM bit-exact ({:.0} MiB filled); ",
            case.fill_bytes() as f64 / MIB
        );
    }
    wait_until(Duration::from_secs(30), "the destination to run", || {
        qmp.query_status().ok().filter(|s| s.running)
    })?;
    qmp.execute("inject-nmi", None)?;
    let out = guest.wait()?;
    ensure!(
        out.serial.contains("MIGBENCH: resumed") && !out.serial.contains("MIGBENCH: ready"),
        "the guest did not go on on the destination:\n{}",
        out.serial
    );
    ensure!(
        out.test_rc("sy-migbench") == Some(0),
        "the guest's check failed:\n{}",
        out.serial
    );
    if server.is_some() {
        let probe = out
            .json_line("SYGPU-PROBE")
            .context("no SYGPU-PROBE on the destination")?;
        ensure!(probe["result"] == "pass", "probe: {probe}");
        what.push_str("sygpu-driver --probe on the destination: pass");
    } else {
        what.push_str("the guest went on on the destination");
    }
    Ok(what)
}

/// A writing case: the driver's summary on the destination says every job and every region
/// write was bit-exact, and the switchover came during its soak (the source's console has the
/// soak's start but not its end; the destination's has no start).
fn check_soak(out: GuestOutput, src_serial: &str) -> Result<String> {
    let s = out
        .json_line("SYGPU-SUMMARY")
        .with_context(|| format!("no summary on the destination:\n{}", out.serial))?;
    let soak = &s["soak"];
    let jobs = soak["jobs"].as_u64().unwrap_or(0);
    ensure!(
        s["result"] == "pass"
            && out.test_rc("sygpu-driver") == Some(0)
            && soak["ok"] == true
            && jobs > 0
            && soak["jobs_verified"].as_u64() == Some(jobs)
            && soak["region_stale_pages"] == 0,
        "the driver failed on the destination: {s}"
    );
    ensure!(
        !out.serial.contains("SYGPU: soak start") && !src_serial.contains("SYGPU: soak done"),
        "the switchover was not during the soak:\n--- source ---\n{src_serial}\n--- \
         destination ---\n{}",
        out.serial
    );
    Ok(format!(
        "soak pass on the destination: {jobs} jobs verified, {} region writes, 0 stale pages",
        soak["region_writes"]
    ))
}

/// What the source server logged about the device's side of the migration.
fn device_figures(log: &str) -> BTreeMap<&'static str, f64> {
    let mut fig = BTreeMap::new();
    let stamp = |pat: &str| {
        log.lines()
            .find(|l| l.contains("migration state") && l.contains(pat))
            .and_then(seconds_of_day)
    };
    let ms = |a: f64, b: f64| (b - a).rem_euclid(86_400.0) * 1000.0;
    let precopy = stamp("arc=StartPreCopy");
    let stop = stamp("arc=PreCopyToStopCopy").or_else(|| stamp("arc=StartStopCopy"));
    if let (Some(a), Some(b)) = (stop, stamp("arc=EndStopCopy")) {
        fig.insert("stop_copy_ms", ms(a, b));
    }
    if let (Some(a), Some(b)) = (precopy, stop) {
        fig.insert("precopy_ms", ms(a, b));
    }
    let closed = log
        .lines()
        .find(|l| l.contains("outgoing migration stream closed"));
    if let Some(l) = closed {
        for (key, name) in [
            ("rounds", "device_rounds"),
            ("pages_sent", "device_pages_sent"),
            ("padding", "device_padding_bytes"),
        ] {
            let v = l
                .split_whitespace()
                .find_map(|w| w.strip_prefix(key)?.strip_prefix('=')?.parse().ok());
            fig.extend(v.map(|v| (name, v)));
        }
    }
    fig
}

/// The time of day of a tracing line's leading `YYYY-MM-DDTHH:MM:SS.ffffffZ`, in seconds.
fn seconds_of_day(line: &str) -> Option<f64> {
    let (_, time) = line.split_whitespace().next()?.split_once('T')?;
    let mut t = time.strip_suffix('Z')?.splitn(3, ':');
    let (h, m): (f64, f64) = (t.next()?.parse().ok()?, t.next()?.parse().ok()?);
    let s: f64 = t.next()?.parse().ok()?;
    Some(h * 3600.0 + m * 60.0 + s)
}

/// The fill's 1 MiB chunk at byte `offset`: splitmix64 of each 8-byte word's index (no page
/// of it is zero).
fn fill_chunk(buf: &mut [u8], offset: u64) {
    for (i, w) in buf.chunks_exact_mut(8).enumerate() {
        let mut z = (offset / 8 + i as u64).wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        w.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
}

/// The VRAM memfd of `server` (opened through its `/proc/PID/fd`), and its size.
fn vram_file(server: &Server) -> Result<(File, u64)> {
    let pid = server
        .pid()
        .map(|p| std::path::PathBuf::from(format!("/proc/{p}")))
        .with_context(|| format!("the server of {} is not running", server.socket.display()))?;
    let found = wait_until(Duration::from_secs(10), "the server's VRAM memfd", || {
        std::fs::read_dir(pid.join("fd"))
            .ok()?
            .flatten()
            .find_map(|e| {
                let target = std::fs::read_link(e.path()).ok()?;
                let vram = target
                    .to_string_lossy()
                    .starts_with("/memfd:switchyard-softgpu-vram");
                vram.then(|| e.path())
            })
    })?;
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&found)
        .with_context(|| format!("open {}", found.display()))?;
    let len = file.metadata()?.len();
    Ok((file, len))
}

/// Writes the fill into the first [`FILL_QUARTERS`] quarters of the server's VRAM.
fn fill_vram(server: &Server, case: &Case) -> Result<()> {
    let (vram, len) = vram_file(server)?;
    let want = case.vram_mib.unwrap_or(0) << 20;
    ensure!(len == want, "VRAM memfd is {len} bytes, not {want}");
    let mut buf = vec![0u8; CHUNK as usize];
    for off in (0..case.fill_bytes()).step_by(CHUNK as usize) {
        fill_chunk(&mut buf, off);
        vram.write_all_at(&buf, off)?;
    }
    Ok(())
}

/// The destination's VRAM holds the fill and zeros behind it.
fn check_vram(vram: &File, case: &Case) -> Result<()> {
    let (mut got, mut want) = (vec![0u8; CHUNK as usize], vec![0u8; CHUNK as usize]);
    let (mut bad_pages, mut first) = (0u64, None);
    for off in (0..case.vram_mib.unwrap_or(0) << 20).step_by(CHUNK as usize) {
        vram.read_exact_at(&mut got, off)?;
        if off < case.fill_bytes() {
            fill_chunk(&mut want, off);
        } else {
            want.fill(0);
        }
        for (i, (g, w)) in got.chunks(4096).zip(want.chunks(4096)).enumerate() {
            if g != w {
                bad_pages += 1;
                first.get_or_insert(off + 4096 * i as u64);
            }
        }
    }
    ensure!(
        bad_pages == 0,
        "destination VRAM differs from the source's in {bad_pages} pages (first at {:#x})",
        first.unwrap_or(0)
    );
    Ok(())
}

/// Median, min and max of figure `name` over a case's runs (`None` when no run has it).
fn stat(samples: &[Sample], name: &str) -> Option<(f64, f64, f64)> {
    let mut v: Vec<f64> = samples
        .iter()
        .filter_map(|s| s.fig.get(name).copied())
        .collect();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = match n {
        0 => return None,
        _ if n % 2 == 1 => v[n / 2],
        _ => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    };
    Some((median, v[0], v[n - 1]))
}

/// `median` or `median (min-max)`, divided by `scale`, with `prec` decimals.
fn show(s: Option<(f64, f64, f64)>, runs: usize, scale: f64, prec: usize) -> String {
    match s {
        None => "-".into(),
        Some((m, lo, hi)) if runs > 1 && lo != hi => {
            format!(
                "{:.prec$} ({:.prec$}-{:.prec$})",
                m / scale,
                lo / scale,
                hi / scale
            )
        }
        Some((m, ..)) => format!("{:.prec$}", m / scale),
    }
}

/// Prints the table; returns its rows as JSON.
fn print_table(results: &[(Case, Vec<Sample>, Vec<String>)], params: &Value, runs: usize) -> Value {
    let floor = results
        .iter()
        .find(|r| r.0.vram_mib.is_none())
        .and_then(|r| stat(&r.1, "downtime_ms"))
        .map(|s| s.0);
    let mut head: Vec<String> = ["case", "ok"].map(String::from).to_vec();
    for c in &COLUMNS {
        head.push(c.0.to_owned());
        if c.1 == "downtime_ms" {
            head.push("x floor".into());
        }
    }
    let mut rows = vec![head];
    let mut out = Vec::new();
    for (case, samples, failures) in results {
        let ratio = stat(samples, "downtime_ms")
            .zip(floor)
            .filter(|(_, f)| *f > 0.0)
            .map(|(d, f)| d.0 / f);
        let mut row = vec![
            case.label.to_owned(),
            format!("{}/{}", samples.len(), samples.len() + failures.len()),
        ];
        for &(_, name, scale, prec) in &COLUMNS {
            row.push(show(stat(samples, name), runs, scale, prec));
            if name == "downtime_ms" {
                row.push(ratio.map_or("-".into(), |r| format!("{r:.2}")));
            }
        }
        rows.push(row);
        let mut j = json!({
            "case": case.id,
            "label": case.label,
            "device": case.device(),
            "vram_filled_bytes": case.fill_bytes(),
            "soak_seconds": case.writing.then_some(SOAK_SECONDS),
            "runs_ok": samples.len(),
            "failures": failures,
            "downtime_vs_floor": ratio,
            "samples": samples.iter().map(|s| json!({
                "figures": s.fig, "check": s.check, "query_migrate": s.status,
            })).collect::<Vec<_>>(),
        });
        let names: std::collections::BTreeSet<&str> =
            samples.iter().flat_map(|s| s.fig.keys().copied()).collect();
        for name in names {
            if let Some((m, lo, hi)) = stat(samples, name) {
                j[name] = json!({ "median": m, "min": lo, "max": hi });
            }
        }
        out.push(j);
    }
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| rows.iter().map(|r| r[c].chars().count()).max().unwrap_or(0))
        .collect();
    println!(
        "\nLive migration under the patched QEMU (TCG guest, 512 MiB, 1 vCPU), {runs} run(s) per \
         case, median{}; QEMU downtime-limit {} ms, max-bandwidth {} MiB/s\n",
        if runs > 1 { " (min-max)" } else { "" },
        params["downtime-limit"],
        params["max-bandwidth"]
            .as_f64()
            .map_or("?".into(), |b| format!("{:.0}", b / MIB)),
    );
    for (i, r) in rows.iter().enumerate() {
        let cells: Vec<String> = r
            .iter()
            .zip(&widths)
            .enumerate()
            .map(|(c, (cell, w))| match c {
                0 => format!("{cell:<w$}"),
                _ => format!("{cell:>w$}"),
            })
            .collect();
        println!("{}", cells.join("  ").trim_end());
        if i == 0 {
            println!(
                "{}",
                "-".repeat(widths.iter().sum::<usize>() + 2 * (widths.len() - 1))
            );
        }
    }
    println!(
        "\nx floor: downtime / the no-device downtime. stream MiB: QEMU's ram.transferred (the \
         whole stream, the device's share included); device MiB: its vfio.transferred; padding \
         MiB, STOP_COPY ms, pages sent (all rounds): the source server's log. VRAM cases: {}% of \
         VRAM filled with data before the migration.",
        FILL_QUARTERS * 25
    );
    for (case, samples, failures) in results {
        if let Some(s) = samples.last() {
            println!("  {}: {}", case.id, s.check);
        }
        for f in failures {
            println!("  {}: FAILED {f}", case.id);
        }
    }
    Value::Array(out)
}
