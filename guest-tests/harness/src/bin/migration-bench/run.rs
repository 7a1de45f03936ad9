//! One migration of a case: both sides started, `migrate`, the checks, the figures.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use switchyard_guest_tests::{Guest, GuestEnv, GuestOutput, GuestSpec, Server, wait_until};
use switchyard_qemu::{Qmp, VfioUserDevice};

use crate::figures::{check_vram, device_figures, fill_vram, vram_file};
use crate::{Args, Case, HUGEPAGES, MIB, Sample};

/// One side of a migration.
struct Side {
    /// One server per device, in the guest's device order.
    servers: Vec<Server>,
    guest: Guest,
    qmp: Qmp,
}

/// Starts one side, the destination when `incoming` is given: its server (the source's VRAM
/// filled), then its QEMU (the destination's waiting on `incoming`).
fn start_side(
    env: &GuestEnv,
    qemu: &Path,
    initrd: &Path,
    dir: &Path,
    case: &Case,
    incoming: Option<&Path>,
    bandwidth: f64,
) -> Result<Side> {
    let name = if incoming.is_some() { "dst" } else { "src" };
    let mut servers = Vec::new();
    if let Some(device) = case.device() {
        for i in 0..case.devices {
            let sdir = dir.join(format!(
                "{name}{}",
                if i == 0 { String::new() } else { i.to_string() }
            ));
            std::fs::create_dir_all(&sdir)?;
            // `info` carries the figures; MIGBENCH_SERVER_LOG (e.g. `info,switchyard_server=trace`)
            // adds every request's reply, to see where a switchover's time goes.
            let level = std::env::var("MIGBENCH_SERVER_LOG").unwrap_or_else(|_| "info".to_owned());
            let s = Server::start_logging(env, &sdir, &device, &[], &level)
                .with_context(|| format!("the {name} server {i}"))?;
            if incoming.is_none() {
                fill_vram(&s, case)?;
            }
            servers.push(s);
        }
    }
    let mut spec = if case.writing {
        let mut spec = GuestSpec::new("sygpu-driver");
        spec.args = vec![
            "--noiommu".into(),
            "--soak".into(),
            case.soak_seconds(bandwidth).to_string(),
        ];
        spec
    } else {
        let mut spec = GuestSpec::new("sy-migbench");
        if !servers.is_empty() {
            spec.args = vec!["probe".into()];
        }
        spec
    };
    spec.kernel_args = vec![format!("hugepages={HUGEPAGES}")];
    spec.initrd = Some(initrd.to_owned());
    spec.devices = servers
        .iter()
        .enumerate()
        .map(|(i, s)| VfioUserDevice::new(format!("gpu{i}"), &s.socket))
        .collect();
    spec.qmp = true;
    spec.qemu = Some(qemu.to_owned());
    spec.name = Some(name.to_owned());
    spec.timeout = Duration::from_secs(300) + 2 * case.busy_limit(bandwidth);
    spec.incoming = incoming.map(Path::to_owned);
    let guest = Guest::boot(env, dir, &spec).with_context(|| format!("boot the {name} QEMU"))?;
    let qmp = Qmp::connect(guest.qmp.clone().context("QMP")?, Duration::from_secs(30))
        .with_context(|| format!("the {name} QMP"))?;
    Ok(Side {
        servers,
        guest,
        qmp,
    })
}

/// One migration of `case`: its figures, or why it failed.
pub(crate) fn run_case(
    env: &GuestEnv,
    qemu: &Path,
    initrd: &Path,
    dir: &Path,
    case: &Case,
    args: &Args,
    params: &mut Value,
) -> Result<Sample> {
    let mut src = start_side(env, qemu, initrd, dir, case, None, args.bandwidth())?;
    let ready = if case.writing {
        "SYGPU: soak start"
    } else {
        "MIGBENCH: ready"
    };
    src.guest
        .wait_for_line(ready)
        .with_context(|| format!("the source guest prints `{ready}`"))?;
    let incoming = dir.join("migration.sock");
    let mut dst = start_side(
        env,
        qemu,
        initrd,
        dir,
        case,
        Some(&incoming),
        args.bandwidth(),
    )?;
    wait_until(Duration::from_secs(30), "the incoming socket", || {
        incoming.exists().then_some(())
    })?;
    if !args.set.is_empty() {
        let set = Value::Object(args.set.clone());
        src.qmp.execute("migrate-set-parameters", Some(set))?;
    }
    if !args.caps.is_empty() {
        let caps: Vec<Value> = args
            .caps
            .iter()
            .map(|c| json!({ "capability": c, "state": true }))
            .collect();
        let caps = json!({ "capabilities": caps });
        for (side, qmp) in [("source", &mut src.qmp), ("destination", &mut dst.qmp)] {
            qmp.execute("migrate-set-capabilities", Some(caps.clone()))
                .with_context(|| format!("the {side}'s capabilities"))?;
        }
    }
    if params.is_null() {
        *params = src.qmp.execute("query-migrate-parameters", None)?;
    }
    if case.writing {
        // Some verified jobs before the migration starts: the soak reports progress after
        // its first second of them.
        src.guest
            .wait_for_line("SYGPU: soak progress")
            .context("the source's soak runs")?;
    }
    let limit = case.limit(params["max-bandwidth"].as_f64().unwrap_or(0.0));
    let src_logs = |servers: &[Server]| servers.iter().map(Server::log_text).collect::<Vec<_>>();
    let st = match migrate(&mut src.qmp, &format!("unix:{}", incoming.display()), limit) {
        Ok(st) => st,
        Err(e) => {
            let f = device_figures(&src_logs(&src.servers));
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
    let logs = src_logs(&src.servers);
    let mut fig = device_figures(&logs);
    ensure!(
        case.vram_mib.is_none() || fig.contains_key("stop_copy_ms"),
        "the source servers' logs lack the migration lines (RUST_LOG=info):\n{}",
        logs.join("\n---\n")
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
/// `completed`. One still running after `limit` is cancelled: an error.
fn migrate(qmp: &mut Qmp, uri: &str, limit: Duration) -> Result<Value> {
    qmp.execute("migrate", Some(json!({ "uri": uri })))?;
    let started = Instant::now();
    loop {
        let st = qmp.execute("query-migrate", None)?;
        match st["status"].as_str() {
            Some("completed") => return Ok(st),
            Some("failed" | "cancelled") => bail!("the migration ended {st}"),
            _ => {}
        }
        if started.elapsed() >= limit {
            qmp.execute("migrate_cancel", None)?;
            let _ = wait_until(Duration::from_secs(30), "the cancel", || {
                let s = qmp.execute("query-migrate", None).ok()?;
                (s["status"] != "active" && s["status"] != "cancelling").then_some(())
            });
            let p = qmp.execute("query-migrate-parameters", None)?;
            bail!(
                "did not converge in {} s (cancelled): QEMU expected a downtime of {} ms \
                 (downtime-limit {} ms) with {:.1} MiB of RAM left; device sent {:.0} MiB",
                limit.as_secs(),
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
        servers,
        guest,
        mut qmp,
    } = dst;
    let mut what = String::new();
    for (i, server) in servers.iter().enumerate() {
        check_vram(&vram_file(server)?.0, case).with_context(|| format!("device {i}"))?;
    }
    if !servers.is_empty() {
        what = format!(
            "destination VRAM bit-exact ({} x {:.0} MiB filled); ",
            servers.len(),
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
    if !servers.is_empty() {
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
