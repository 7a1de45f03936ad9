//! Live migration of a running guest holding a Switchyard device, under the patched QEMU
//! (vmm-integration/qemu/patches, built by `scripts/build-qemu.sh`): two `switchyard serve`
//! softgpu servers, a source QEMU (TCG, no vIOMMU: QEMU refuses to migrate a VFIO device
//! behind one) running the in-guest driver, a destination QEMU started with
//! `-incoming unix:...`, and QMP `migrate` while the driver keeps the device busy
//! (`sygpu-driver --noiommu --soak SECONDS`: verified jobs on every queue, and a guest-memory
//! region that only the device writes, re-read by the CPU after every write).
//!
//! What is checked: the migration completes (QEMU's own status, downtime and the device's
//! share of the stream), the driver's output continues on the destination's console and its
//! summary there says every job before, during and after the switchover was bit-exact; with a
//! source server whose dirty log is blind (`serve --dirty-log blind`) the same run loses the
//! device's writes, which proves that QEMU took the device-dirtied pages from the device's log;
//! a `migrate_cancel` leaves the source running its workload; a destination whose device does
//! not match is refused and the source runs on; a pool endpoint's worker killed on the source
//! during pre-copy loses no job; a migration between two endpoints of a pool daemon hands the
//! lease over to the incoming endpoint; a guest booted on a server (or a pool endpoint) where
//! another guest ran and powered off migrates away (and back): a new client finds a fresh
//! config space.
//!
//! Every migration here runs with QEMU's `return-path` capability ([`migrate`]): a destination
//! that fails to load says so to the source, so the test sees `failed` at once (and the source
//! resumes) instead of `completed` with the guest lost on a destination that exited.
//!
//! Ignored under a plain `cargo test` (they boot QEMU); `scripts/test.sh` runs them.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_guest_tests::{
    Guest, GuestEnv, GuestOutput, GuestSpec, PoolDaemon, Server, assert_guest_tests_ignored,
    wait_until, with_logs,
};
use switchyard_qemu::{Qmp, VfioUserDevice};

/// Hugepages the guest kernel reserves at boot (`sygpu_driver::hugepage::HUGEPAGES_WANTED`).
const HUGEPAGES: u32 = 16;
/// How long the driver keeps the device busy; the migration starts once it has started.
const SOAK_SECONDS: u32 = 20;
/// The device both servers serve unless a test says otherwise.
const DEVICE: &str = "softgpu,vram=64M,queues=2";

#[test]
fn migration_guest_tests_are_ignored_not_passed_under_plain_cargo_test() {
    assert_guest_tests_ignored(
        "migration_guest_tests_are_ignored_not_passed_under_plain_cargo_test",
        12,
    );
}

/// One side of a migration: its server, its QEMU and QMP.
struct Side {
    server: Server,
    guest: Guest,
    qmp: Qmp,
}

/// Boots the source guest on the patched QEMU against a fresh server serving `device` (with
/// `serve_args`), running the driver's soak with `driver_args`; returns once the soak started.
fn boot_source(
    env: &GuestEnv,
    dir: &Path,
    device: &str,
    serve_args: &[&str],
    driver_args: &[&str],
) -> Side {
    let server = Server::start_named(env, dir, "src", device, serve_args).expect("source server");
    let (guest, qmp) = boot_soaking(env, dir, &server.socket, driver_args);
    Side { server, guest, qmp }
}

/// Boots the source guest on the patched QEMU against the device on `socket`, running the
/// driver's soak with `driver_args`; returns it and its QMP once the soak started.
fn boot_soaking(env: &GuestEnv, dir: &Path, socket: &Path, driver_args: &[&str]) -> (Guest, Qmp) {
    let mut spec = spec(env, "src", socket);
    spec.args = soak_args(driver_args);
    let mut guest = Guest::boot(env, dir, &spec).expect("boot the source");
    let qmp = Qmp::connect(guest.qmp.clone().expect("QMP"), Duration::from_secs(30))
        .expect("the source's QMP");
    guest
        .wait_for_line("SYGPU: soak start")
        .expect("the driver starts its soak");
    (guest, qmp)
}

/// Starts the destination QEMU, waiting on `incoming`, against a fresh server with `device`;
/// `driver_args` as the source's (the same command line, plus `-incoming`).
fn start_destination(
    env: &GuestEnv,
    dir: &Path,
    device: &str,
    driver_args: &[&str],
    incoming: &Path,
) -> Side {
    let server = Server::start_named(env, dir, "dst", device, &[]).expect("destination server");
    let mut spec = spec(env, "dst", &server.socket);
    spec.args = soak_args(driver_args);
    spec.incoming = Some(incoming.to_owned());
    let guest = Guest::boot(env, dir, &spec).expect("start the destination");
    let qmp = Qmp::connect(guest.qmp.clone().expect("QMP"), Duration::from_secs(30))
        .expect("the destination's QMP");
    wait_until(
        Duration::from_secs(30),
        "the incoming migration socket",
        || incoming.exists().then_some(()),
    )
    .expect("the destination listens");
    Side { server, guest, qmp }
}

/// The driver's arguments: the no-IOMMU soak, then `extra`.
fn soak_args(extra: &[&str]) -> Vec<String> {
    ["--noiommu", "--soak", &SOAK_SECONDS.to_string()]
        .into_iter()
        .chain(extra.iter().copied())
        .map(str::to_owned)
        .collect()
}

/// A guest of this file: no vIOMMU, hugepages for the driver's DMA, the device of `socket`,
/// QMP, the patched QEMU, files named `name`.
fn spec(env: &GuestEnv, name: &str, socket: &Path) -> GuestSpec {
    let mut spec = GuestSpec::new("sygpu-driver");
    spec.kernel_args = vec![format!("hugepages={HUGEPAGES}")];
    spec.devices = vec![VfioUserDevice::new("gpu0", socket)];
    spec.qmp = true;
    spec.qemu = Some(env.migration_qemu().expect("the patched QEMU"));
    spec.name = Some(name.to_owned());
    spec.timeout = Duration::from_secs(300);
    spec
}

/// `migrate` to `uri` with the `return-path` capability on, then [`wait_migration`]. With the
/// return path the destination tells the source whether it loaded the state: one that fails
/// makes the migration `failed` and the source run on (without it the source says
/// `completed` and stays paused while the destination exits).
fn migrate(qmp: &mut Qmp, uri: &str) -> Value {
    let caps = json!({ "capabilities": [{ "capability": "return-path", "state": true }] });
    qmp.execute("migrate-set-capabilities", Some(caps))
        .expect("return-path");
    qmp.execute("migrate", Some(json!({ "uri": uri })))
        .expect("migrate");
    wait_migration(qmp)
}

/// `query-migrate` until the migration ends (120 s at most); returns its last status object.
fn wait_migration(qmp: &mut Qmp) -> Value {
    let started = Instant::now();
    loop {
        let st = qmp.execute("query-migrate", None).expect("query-migrate");
        if matches!(
            st["status"].as_str(),
            Some("completed" | "failed" | "cancelled")
        ) {
            return st;
        }
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the migration did not end in 120 s: {st}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The driver's summary in `out`, which must say pass, with the soak's figures.
fn soak_summary(out: &GuestOutput) -> Value {
    let s = out
        .json_line("SYGPU-SUMMARY")
        .unwrap_or_else(|| panic!("no summary:\n{}", out.serial));
    assert_eq!(s["result"], "pass", "{s}");
    assert_eq!(out.test_rc("sygpu-driver"), Some(0), "{s}");
    let soak = &s["soak"];
    assert_eq!(soak["ok"], true, "{s}");
    let jobs = soak["jobs"].as_u64().expect("soak jobs");
    assert!(jobs > 0, "{s}");
    assert_eq!(soak["jobs_verified"].as_u64(), Some(jobs), "{s}");
    assert!(soak["region_writes"].as_u64().unwrap_or(0) > 1, "{s}");
    assert_eq!(soak["region_stale_pages"], 0, "{s}");
    s
}

/// A whole live migration under the soak: returns QEMU's final migration status and the
/// driver's summary, as printed on the destination's console.
fn soak_across_migration(
    name: &str,
    device: &str,
    source_serve_args: &[&str],
    driver_args: &[&str],
) -> (Value, GuestOutput, String) {
    let mut result = None;
    with_logs(name, |env, dir| {
        let mut src = boot_source(env, dir, device, source_serve_args, driver_args);
        let incoming = dir.join("migration.sock");
        let dst = start_destination(env, dir, device, driver_args, &incoming);
        // Some jobs before the switchover: the soak reports progress after its first second.
        src.guest
            .wait_for_line("SYGPU: soak progress")
            .expect("the soak runs");
        let st = migrate(&mut src.qmp, &format!("unix:{}", incoming.display()));
        assert_eq!(st["status"], "completed", "{st}");
        // The source stops (postmigrate); the guest runs on in the destination.
        let status = src.qmp.query_status().expect("source status");
        assert_eq!(status.status, "postmigrate", "{status:?}");
        let _ = src.qmp.quit();
        drop(src.guest);
        let out = dst.guest.wait().expect("the destination guest finished");
        let src_serial =
            std::fs::read_to_string(dir.join("serial-src.log")).expect("the source console");
        let dst_log = dst.server.log_text();
        result = Some((st, out, src_serial + &dst_log));
    });
    result.expect("ran")
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn the_driver_runs_on_across_a_live_migration_with_mapped_vram_and_doorbells() {
    let (st, out, before) =
        soak_across_migration("migrate-mapped", DEVICE, &[], &["--doorbell", "mapped"]);
    assert_migrated(&st, &out, &before);
    let s = soak_summary(&out);
    assert_eq!(s["doorbell"], "mapped", "{s}");
    assert_eq!(s["vram_access"], "mmap", "{s}");
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn the_driver_runs_on_across_a_live_migration_with_trapped_vram() {
    let device = format!("{DEVICE},vram_mmap=off");
    let (st, out, before) = soak_across_migration("migrate-trapped", &device, &[], &[]);
    assert_migrated(&st, &out, &before);
    let s = soak_summary(&out);
    assert_eq!(s["doorbell"], "trapped", "{s}");
}

/// The same soak with the source's dirty log blind (`serve --dirty-log blind`: DMA logging
/// is offered and started, but every report is empty): the pages the device wrote after QEMU
/// copied them never reach the destination, and the driver there reads stale data. This is
/// what makes the two tests above a proof that QEMU used the device's log.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn with_a_blind_dirty_log_the_device_writes_are_lost() {
    let (st, out, _) =
        soak_across_migration("migrate-blind-log", DEVICE, &["--dirty-log", "blind"], &[]);
    assert_eq!(st["status"], "completed", "{st}");
    let s = out
        .json_line("SYGPU-SUMMARY")
        .unwrap_or_else(|| panic!("no summary:\n{}", out.serial));
    assert_eq!(s["result"], "fail", "a blind log lost nothing: {s}");
    let stale = s["soak"]["region_stale_pages"].as_u64().unwrap_or(0)
        + (s["soak"]["jobs"].as_u64().unwrap_or(0)
            - s["soak"]["jobs_verified"].as_u64().unwrap_or(0));
    assert!(stale > 0, "the failure is not stale device writes: {s}");
    eprintln!("blind dirty log: {}", s["soak"]);
}

/// `migrate_cancel` during the migration: the source guest keeps running its workload and
/// finishes it there, bit-exact; the destination gives up.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_cancelled_migration_leaves_the_source_running() {
    with_logs("migrate-cancel", |env, dir| {
        let mut src = boot_source(env, dir, DEVICE, &[], &[]);
        let incoming = dir.join("migration.sock");
        let dst = start_destination(env, dir, DEVICE, &[], &incoming);
        // Throttled so that it is still running when cancelled.
        src.qmp
            .execute(
                "migrate-set-parameters",
                Some(json!({ "max-bandwidth": 4 << 20 })),
            )
            .expect("throttle");
        src.qmp
            .execute(
                "migrate",
                Some(json!({ "uri": format!("unix:{}", incoming.display()) })),
            )
            .expect("migrate");
        std::thread::sleep(Duration::from_secs(1));
        src.qmp.execute("migrate_cancel", None).expect("cancel");
        let st = wait_until(Duration::from_secs(60), "the cancel", || {
            let st = src.qmp.execute("query-migrate", None).ok()?;
            matches!(st["status"].as_str(), Some("cancelled")).then_some(st)
        })
        .expect("cancelled");
        assert_eq!(st["status"], "cancelled", "{st}");
        drop(dst);
        let out = src.guest.wait().expect("the source guest finished");
        let s = soak_summary(&out);
        eprintln!("cancelled migration: source soak {}", s["soak"]);
        assert!(src.server.alive());
    });
}

/// A destination whose device does not match the source's (half the VRAM) refuses the
/// device's state: the migration fails and the source guest runs on, bit-exact.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_destination_with_another_device_is_refused_and_the_source_runs_on() {
    with_logs("migrate-mismatch", |env, dir| {
        let mut src = boot_source(env, dir, DEVICE, &[], &[]);
        let incoming = dir.join("migration.sock");
        let mut dst = start_destination(env, dir, "softgpu,vram=32M,queues=2", &[], &incoming);
        let st = migrate(&mut src.qmp, &format!("unix:{}", incoming.display()));
        assert_eq!(st["status"], "failed", "{st}");
        let status = src.qmp.query_status().expect("source status");
        assert!(status.running, "the source is not running: {status:?}");
        let _ = dst.guest.exited();
        let refused = dst.server.log_text();
        assert!(
            refused.contains("VRAM") || refused.contains("vram"),
            "the destination server does not say why:\n{refused}"
        );
        let out = src.guest.wait().expect("the source guest finished");
        soak_summary(&out);
    });
}

/// The migration completed, QEMU reports a downtime and the device's share of the stream, and
/// the driver's output went on in the destination (its summary is there, the soak's start only
/// on the source).
fn assert_migrated(st: &Value, out: &GuestOutput, before: &str) {
    assert_eq!(st["status"], "completed", "{st}");
    let downtime = st["downtime"].as_u64().expect("downtime");
    eprintln!(
        "migration: total {} ms, downtime {downtime} ms, RAM {} bytes transferred, {st}",
        st["total-time"], st["ram"]["transferred"]
    );
    assert!(before.contains("SYGPU: soak start"), "{before}");
    assert!(
        !out.serial.contains("SYGPU: soak start"),
        "the destination booted the guest instead of receiving it:\n{}",
        out.serial
    );
    assert!(
        out.serial.contains("SYGPU: soak progress"),
        "{}",
        out.serial
    );
}

/// A worker kill on the source during pre-copy. The source device is a pool daemon's
/// endpoint; its worker is killed (SIGKILL) while QEMU copies RAM, and the daemon's
/// replacement resumes the connection with the device running (a restart abandons a
/// migration). Either the migration fails and the guest keeps its device on the source, or it
/// completes; either way the driver's soak finishes bit-exact wherever the guest runs, and no
/// VM hangs.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_source_worker_killed_during_pre_copy_loses_no_job() {
    with_logs("migrate-worker-kill", |env, dir| {
        let mut daemon = PoolDaemon::start(
            env,
            dir,
            "[[boards]]\nid = \"gpu0\"\nvram = \"64M\"\nqueues = 2\n\
             [[pools]]\nname = \"p\"\nboards = [\"gpu0\"]\n",
        );
        let socket = daemon.create("vm1", "p");
        let (guest, mut qmp) = boot_soaking(env, dir, &socket, &[]);
        let incoming = dir.join("migration.sock");
        let dst = start_destination(env, dir, DEVICE, &[], &incoming);
        // Throttled: RAM takes seconds to copy, the kill lands in pre-copy.
        qmp.execute(
            "migrate-set-parameters",
            Some(json!({ "max-bandwidth": 16 << 20 })),
        )
        .expect("throttle");
        qmp.execute(
            "migrate",
            Some(json!({ "uri": format!("unix:{}", incoming.display()) })),
        )
        .expect("migrate");
        let api = daemon.api();
        let worker = wait_until(
            Duration::from_secs(30),
            "the source's migration stream",
            || {
                let st = api.get("/v1/endpoints/vm1").ok()?.body;
                (st["worker"]["migrating"] == true).then(|| st["worker"]["pid"].as_i64())?
            },
        )
        .expect("the source worker streams the device's state");
        let pid =
            rustix::process::Pid::from_raw(i32::try_from(worker).expect("pid")).expect("a pid");
        rustix::process::kill_process(pid, rustix::process::Signal::KILL).expect("kill");
        let st = wait_migration(&mut qmp);
        let after = api.get("/v1/endpoints/vm1").expect("endpoint").body;
        assert_eq!(after["worker"]["restarts"], 1, "{after}");
        let out = match st["status"].as_str() {
            Some("completed") => {
                let _ = qmp.quit();
                drop(guest);
                dst.guest.wait().expect("the destination guest finished")
            }
            _ => {
                let status = qmp.query_status().expect("source status");
                assert!(status.running, "the source stopped: {status:?} after {st}");
                drop(dst);
                guest.wait().expect("the source guest finished")
            }
        };
        let s = soak_summary(&out);
        eprintln!(
            "worker killed during pre-copy: migration {}, soak {}",
            st["status"], s["soak"]
        );
    });
}

/// A live migration between two endpoints of one pool daemon, as an operator runs it: the
/// source VM's endpoint, an incoming endpoint for it (`POST /v1/endpoints/{id}/incoming`,
/// `ctl create DST --incoming-for SRC`) on a free board of the same shape, QEMU's migration
/// between them. When the destination runs, the daemon commits: the incoming endpoint keeps
/// its lease, and once the source QEMU quits the source endpoint is deleted and its board
/// freed (event `migrated`, metric `switchyard_migrations_completed`).
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_migration_between_two_pool_endpoints_hands_the_lease_over() {
    with_logs("migrate-pool", |env, dir| {
        let mut daemon = PoolDaemon::start(
            env,
            dir,
            "[[boards]]\nid = \"gpu0\"\nvram = \"64M\"\nqueues = 2\n\
             [[boards]]\nid = \"gpu1\"\nvram = \"64M\"\nqueues = 2\n\
             [[pools]]\nname = \"p\"\nboards = [\"gpu0\", \"gpu1\"]\n",
        );
        let socket = daemon.create("vm1", "p");
        let (mut guest, mut qmp) = boot_soaking(env, dir, &socket, &[]);
        let api = daemon.api();
        let incoming = api
            .post("/v1/endpoints/vm1/incoming", &json!({ "id": "vm1-in" }))
            .expect("the incoming endpoint")
            .body;
        assert_eq!(incoming["incoming_for"], "vm1", "{incoming}");
        assert_eq!(incoming["lease"]["board"], "gpu1", "{incoming}");
        daemon.endpoints.push("vm1-in".into());
        let dst_socket = PathBuf::from(incoming["endpoint"]["socket"].as_str().expect("socket"));
        let mut dspec = spec(env, "dst", &dst_socket);
        dspec.args = soak_args(&[]);
        let migration = dir.join("migration.sock");
        dspec.incoming = Some(migration.clone());
        let dst = Guest::boot(env, dir, &dspec).expect("start the destination");
        wait_until(
            Duration::from_secs(30),
            "the incoming migration socket",
            || migration.exists().then_some(()),
        )
        .expect("the destination listens");
        // Some jobs before the switchover: the soak reports progress after its first second.
        guest
            .wait_for_line("SYGPU: soak progress")
            .expect("the soak runs");
        let st = migrate(&mut qmp, &format!("unix:{}", migration.display()));
        assert_eq!(st["status"], "completed", "{st}");
        wait_until(
            Duration::from_secs(30),
            "the daemon commits the migration",
            || {
                let e = api.get("/v1/endpoints/vm1-in").ok()?.body;
                e.get("incoming_for").is_none().then_some(())
            },
        )
        .expect("committed");
        // The source QEMU quits, as after any migration: the source endpoint goes.
        let _ = qmp.quit();
        drop(guest);
        wait_until(
            Duration::from_secs(70),
            "the source endpoint is deleted",
            || api.get("/v1/endpoints/vm1").is_err().then_some(()),
        )
        .expect("the source's lease released");
        let boards = api.get("/v1/boards").expect("boards").body;
        let gpu0 = boards
            .as_array()
            .and_then(|b| b.iter().find(|b| b["id"] == "gpu0"))
            .expect("gpu0");
        assert!(gpu0["devices"][0]["endpoint"].is_null(), "{gpu0}");
        let metrics = api.get_text("/metrics").expect("metrics");
        assert!(
            metrics
                .lines()
                .any(|l| l == "switchyard_migrations_completed_total 1"),
            "{metrics}"
        );
        let out = dst.wait().expect("the destination guest finished");
        let s = soak_summary(&out);
        eprintln!("pool migration: {}, soak {}", st["downtime"], s["soak"]);
    });
}

/// A guest that runs the driver's quick check on `socket` and powers off, as a VM that used
/// the device before the one under test: its kernel writes config space (PCIe Device Control
/// 0x2810 -> 0x2830, MSI-X control, COMMAND, BARs).
fn run_and_power_off(env: &GuestEnv, dir: &Path, socket: &Path) {
    let mut first = spec(env, "first", socket);
    first.args = vec!["--noiommu".into(), "--quick".into()];
    let out = Guest::boot(env, dir, &first)
        .expect("boot the first guest")
        .wait()
        .expect("the first guest finished");
    assert_eq!(out.test_rc("sygpu-driver"), Some(0), "{}", out.serial);
}

/// A destination QEMU named `name` on the device at `socket`, waiting on `incoming`, with the
/// source's driver arguments `args`.
fn boot_incoming(
    env: &GuestEnv,
    dir: &Path,
    name: &str,
    socket: &Path,
    args: Vec<String>,
    incoming: &Path,
) -> (Guest, Qmp) {
    let mut spec = spec(env, name, socket);
    spec.args = args;
    spec.incoming = Some(incoming.to_owned());
    let guest = Guest::boot(env, dir, &spec).expect("start the destination");
    let qmp = Qmp::connect(guest.qmp.clone().expect("QMP"), Duration::from_secs(30))
        .expect("the destination's QMP");
    wait_until(
        Duration::from_secs(30),
        "the incoming migration socket",
        || incoming.exists().then_some(()),
    )
    .expect("the destination listens");
    (guest, qmp)
}

/// A server that served a guest before serves the next one fresh. A guest runs the driver and
/// powers off; a second guest boots on the same server (A) under the soak and migrates to
/// another server (B) and back to A (a new QEMU there, a new client), bit-exact. Before a new
/// client found a fresh config space, the destination QEMU's copy of Device Control (read
/// from its server) differed from the stream's: `Bad config data: i=0x50`. A's log shows no
/// abandoned migration (a poweroff and a migrated source leave the device stopped, no more).
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_guest_booted_where_another_ran_migrates_away_and_back() {
    with_logs("migrate-ping-pong", |env, dir| {
        let a = Server::start_named(env, dir, "a", DEVICE, &[]).expect("server a");
        run_and_power_off(env, dir, &a.socket);
        // Long enough for both hops (the summary must come on A's console).
        let args: Vec<String> = ["--noiommu", "--soak", "40"].map(str::to_owned).into();
        let mut src = spec(env, "src", &a.socket);
        src.args = args.clone();
        let mut guest = Guest::boot(env, dir, &src).expect("boot the second guest");
        let mut qmp = Qmp::connect(guest.qmp.clone().expect("QMP"), Duration::from_secs(30))
            .expect("the source's QMP");
        guest
            .wait_for_line("SYGPU: soak start")
            .expect("the driver starts its soak");
        let b = Server::start_named(env, dir, "b", DEVICE, &[]).expect("server b");
        let to_b = dir.join("to-b.sock");
        let (on_b, mut qmp_b) = boot_incoming(env, dir, "dst", &b.socket, args.clone(), &to_b);
        // Some jobs before the switchover: the soak reports progress after its first second.
        guest
            .wait_for_line("SYGPU: soak progress")
            .expect("the soak runs");
        let st = migrate(&mut qmp, &format!("unix:{}", to_b.display()));
        assert_eq!(st["status"], "completed", "A to B: {st}");
        let _ = qmp.quit();
        drop(guest);
        // Back to A: its server's next client.
        let to_a = dir.join("to-a.sock");
        let (back, _qmp_back) = boot_incoming(env, dir, "back", &a.socket, args, &to_a);
        let st = migrate(&mut qmp_b, &format!("unix:{}", to_a.display()));
        assert_eq!(st["status"], "completed", "B to A: {st}");
        let _ = qmp_b.quit();
        drop(on_b);
        let out = back.wait().expect("the guest finished on A");
        let s = soak_summary(&out);
        eprintln!("ping-pong A to B to A: soak {}", s["soak"]);
        let log = a.log_text();
        assert!(!log.contains("abandoned"), "{log}");
    });
}

/// The same through a pool endpoint: a VM runs on its endpoint and powers off, a second VM
/// boots on the same endpoint (its worker serves on) and migrates to an incoming endpoint,
/// bit-exact; the daemon commits.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_vm_restarted_on_its_pool_endpoint_migrates() {
    with_logs("migrate-pool-restarted", |env, dir| {
        let mut daemon = PoolDaemon::start(
            env,
            dir,
            "[[boards]]\nid = \"gpu0\"\nvram = \"64M\"\nqueues = 2\n\
             [[boards]]\nid = \"gpu1\"\nvram = \"64M\"\nqueues = 2\n\
             [[pools]]\nname = \"p\"\nboards = [\"gpu0\", \"gpu1\"]\n",
        );
        let socket = daemon.create("vm1", "p");
        run_and_power_off(env, dir, &socket);
        let (mut guest, mut qmp) = boot_soaking(env, dir, &socket, &[]);
        let api = daemon.api();
        let incoming = api
            .post("/v1/endpoints/vm1/incoming", &json!({ "id": "vm1-in" }))
            .expect("the incoming endpoint")
            .body;
        daemon.endpoints.push("vm1-in".into());
        let dst_socket = PathBuf::from(incoming["endpoint"]["socket"].as_str().expect("socket"));
        let migration = dir.join("migration.sock");
        let (dst, _dst_qmp) =
            boot_incoming(env, dir, "dst", &dst_socket, soak_args(&[]), &migration);
        // Some jobs before the switchover: the soak reports progress after its first second.
        guest
            .wait_for_line("SYGPU: soak progress")
            .expect("the soak runs");
        let st = migrate(&mut qmp, &format!("unix:{}", migration.display()));
        assert_eq!(st["status"], "completed", "{st}");
        wait_until(
            Duration::from_secs(30),
            "the daemon commits the migration",
            || {
                let e = api.get("/v1/endpoints/vm1-in").ok()?.body;
                e.get("incoming_for").is_none().then_some(())
            },
        )
        .expect("committed");
        let _ = qmp.quit();
        drop(guest);
        let out = dst.wait().expect("the destination guest finished");
        let s = soak_summary(&out);
        eprintln!("restarted VM's pool migration: soak {}", s["soak"]);
    });
}

/// QEMU's default `max-bandwidth` (128 MiB/s), which the sized test leaves as it is.
const DEFAULT_BANDWIDTH: f64 = (128u64 << 20) as f64;

/// Boots a source guest against a fresh server serving `device` whose driver (`--noiommu`
/// and `driver`: `--fill-vram --idle S ...`) fills 3/4 of VRAM through the engine and then
/// idles; returns the source and the driver's fill line once it idles.
fn boot_filled_idle(env: &GuestEnv, dir: &Path, device: &str, driver: &[&str]) -> (Side, String) {
    let server = Server::start_named(env, dir, "src", device, &[]).expect("source server");
    let mut spec = spec(env, "src", &server.socket);
    spec.args = ["--noiommu"]
        .iter()
        .chain(driver)
        .map(|s| s.to_string())
        .collect();
    let mut guest = Guest::boot(env, dir, &spec).expect("boot the source");
    let qmp = Qmp::connect(guest.qmp.clone().expect("QMP"), Duration::from_secs(30))
        .expect("the source's QMP");
    let fill = guest
        .wait_for_line("SYGPU: fill done")
        .expect("the driver fills VRAM");
    guest
        .wait_for_line("SYGPU: idle start")
        .expect("the driver idles");
    (Side { server, guest, qmp }, fill)
}

/// After a filled idle source (`boot_filled_idle`) migrated to `dst`: the destination's VRAM
/// equals the source's over the filled ranges of `vram` bytes; then the source quits and the
/// driver runs on on the destination (received, not booted), its soak bit-exact and its fill
/// found there.
fn check_fill_moved(mut src: Side, dst: Side, vram: u64) {
    let (bad, first, filled) = compare_vram(
        &vram_of(&src.server),
        &vram_of(&dst.server),
        &filled_ranges(vram),
    );
    assert!(filled, "the source's VRAM holds the fill");
    assert_eq!(
        bad, 0,
        "destination VRAM differs from the source's in {bad} pages (first at {first:#x?})"
    );
    let _ = src.qmp.quit();
    drop(src.guest);
    let out = dst.guest.wait().expect("the destination guest finished");
    soak_summary(&out);
    assert!(
        out.serial.contains("SYGPU: step fill-check: ok"),
        "the driver checks its fill on the destination:\n{}",
        out.serial
    );
    assert!(
        !out.serial.contains("SYGPU: fill done"),
        "the destination booted the guest instead of receiving it:\n{}",
        out.serial
    );
}

/// The ranges `sygpu-driver --fill-vram` fills in a VRAM of `vram` bytes (see its `fill.rs`):
/// `[0, V/2)` and `[V/2 + 16 MiB, V/2 + 16 MiB + V/4)`, 3/4 of VRAM.
fn filled_ranges(vram: u64) -> [(u64, u64); 2] {
    let upper = vram / 2 + (16 << 20);
    [(0, vram / 2), (upper, upper + vram / 4)]
}

/// The memfd VRAM of a softgpu server, read-only.
fn vram_of(server: &Server) -> std::fs::File {
    let pid = server.pid().expect("the server runs");
    let fds = PathBuf::from(format!("/proc/{pid}/fd"));
    let path = std::fs::read_dir(&fds)
        .expect("the server's fds")
        .flatten()
        .find(|e| {
            std::fs::read_link(e.path()).is_ok_and(|t| {
                t.to_string_lossy()
                    .starts_with("/memfd:switchyard-softgpu-vram")
            })
        })
        .expect("the server's VRAM memfd")
        .path();
    std::fs::File::open(path).expect("open the VRAM memfd")
}

/// Pages of `ranges` in which `a` and `b` differ, and the first of them; also whether `a`'s
/// first word of every 64 MiB is non-zero (the fill is there).
fn compare_vram(
    a: &std::fs::File,
    b: &std::fs::File,
    ranges: &[(u64, u64)],
) -> (u64, Option<u64>, bool) {
    use std::os::unix::fs::FileExt;
    const CHUNK: usize = 16 << 20;
    let (mut x, mut y) = (vec![0u8; CHUNK], vec![0u8; CHUNK]);
    let (mut bad, mut first, mut filled) = (0, None, true);
    for &(start, end) in ranges {
        for off in (start..end).step_by(CHUNK) {
            a.read_exact_at(&mut x, off)
                .expect("read the source's VRAM");
            b.read_exact_at(&mut y, off)
                .expect("read the destination's VRAM");
            if off % (64 << 20) == 0 && x[..4] == [0; 4] {
                filled = false;
            }
            for (i, (p, q)) in x.chunks(4096).zip(y.chunks(4096)).enumerate() {
                if p != q {
                    bad += 1;
                    first.get_or_insert(off + 4096 * i as u64);
                }
            }
        }
    }
    (bad, first, filled)
}

/// The sizes of issue 35: a 4 GiB softgpu with 3/4 of its VRAM filled (by the engine, through
/// the driver) and trapped (`vram_mmap=off`: every write logged), idle, migrates at QEMU's
/// default bandwidth and downtime limit and converges while the device idles (75 s): the
/// device serves GET_PRECOPY_INFO and MIG_DATA_SIZE, and its idle pre-copy rounds send
/// nothing (before, padding kept QEMU iterating forever), so its stream carries its data once
/// (at most 1 % more). How long it takes against the goal (its data's time at 128 MiB/s plus
/// 50 %) is printed, and measured by `scripts/bench-migration.sh` (`4g-idle-trapped`, column
/// `x goal`): a timing is not asserted here (the machine may be loaded). The
/// destination's VRAM equals the source's over the filled 3 GiB; the soak then runs
/// bit-exact on the destination, and the driver finds its fill there.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn an_idle_4_gib_device_3_4_filled_converges_at_qemus_defaults() {
    const VRAM: u64 = 4 << 30;
    let device = "softgpu,vram=4G,queues=2,vram_mmap=off";
    let driver = ["--fill-vram", "--idle", "75", "--soak", "3"];
    with_logs("migrate-sized", |env, dir| {
        let (mut src, fill) = boot_filled_idle(env, dir, device, &driver);
        let incoming = dir.join("migration.sock");
        let dst = start_destination(env, dir, device, &driver, &incoming);
        let st = migrate(&mut src.qmp, &format!("unix:{}", incoming.display()));
        let before = src.guest.serial_text();
        assert_eq!(st["status"], "completed", "{st}");
        assert!(
            !before.contains("SYGPU: soak start"),
            "the device was not idle during the whole migration:\n{before}"
        );

        let total_ms = st["total-time"].as_f64().expect("total-time");
        let stream = st["ram"]["transferred"]
            .as_f64()
            .expect("bytes transferred");
        let device_bytes = st["vfio"]["transferred"].as_f64().unwrap_or(0.0);
        let need_ms = stream / DEFAULT_BANDWIDTH * 1000.0;
        let log = src.server.log_text();
        let stop_copy = log
            .lines()
            .find(|l| l.contains("outgoing migration stream complete"))
            .and_then(|l| l.split("stop_copy_ms=").nth(1))
            .and_then(|v| v.split_whitespace().next())
            .unwrap_or("?")
            .to_owned();
        eprintln!(
            "sized migration: {fill}; total {total_ms} ms (the data needs {need_ms:.0} ms at \
             128 MiB/s: {:.2}x of the goal's 1.5x), downtime {} ms, stream {stream} bytes, device \
             {device_bytes} bytes, device share (stop to last byte read) {stop_copy} ms",
            total_ms / (need_ms * 1.5),
            st["downtime"]
        );
        assert!(
            device_bytes >= (VRAM / 4 * 3) as f64,
            "the device's 3 GiB went over the stream: {st}"
        );
        let data = (VRAM / 4 * 3) as f64;
        assert!(
            device_bytes <= data * 1.01,
            "the device sent {device_bytes} bytes for {data} bytes of data: {st}"
        );
        check_fill_moved(src, dst, VRAM);
    });
}

/// With QEMU's `switchover-ack` (and `return-path`) on both sides, QEMU stops the guest only
/// once the destination has loaded the device's initial data: a trapped 1 GiB device, 3/4
/// filled and idle, stops with no initial bytes left (its server logs what the stop left), so
/// its stop-and-copy sends no first-pass tail. (Without the ack QEMU may stop it with the
/// tail of its first pass still to send, whatever fits the downtime-limit: 145-173 ms at
/// 4 GiB in docs/performance.md.) The destination's VRAM equals the source's, and the driver
/// finds its fill there.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn with_switchover_ack_a_trapped_device_stops_with_its_first_pass_sent() {
    const VRAM: u64 = 1 << 30;
    let device = "softgpu,vram=1G,queues=2,vram_mmap=off";
    let driver = ["--fill-vram", "--idle", "40", "--soak", "3"];
    with_logs("migrate-switchover-ack", |env, dir| {
        let (mut src, _) = boot_filled_idle(env, dir, device, &driver);
        let incoming = dir.join("migration.sock");
        let mut dst = start_destination(env, dir, device, &driver, &incoming);
        let caps = json!({ "capabilities": [
            { "capability": "return-path", "state": true },
            { "capability": "switchover-ack", "state": true },
        ] });
        for q in [&mut src.qmp, &mut dst.qmp] {
            q.execute("migrate-set-capabilities", Some(caps.clone()))
                .expect("return-path and switchover-ack");
        }
        let st = migrate(&mut src.qmp, &format!("unix:{}", incoming.display()));
        let before = src.guest.serial_text();
        assert_eq!(st["status"], "completed", "{st}");
        assert!(
            !before.contains("SYGPU: soak start"),
            "the device was not idle during the whole migration:\n{before}"
        );
        let log = src.server.log_text();
        let stopped = log
            .lines()
            .find(|l| l.contains("the device stopped for the switchover"))
            .unwrap_or_else(|| panic!("the source logs its stop:\n{log}"));
        assert!(
            stopped.contains("initial_bytes=0 "),
            "the device stopped with initial data left: {stopped}"
        );
        eprintln!(
            "switchover-ack: downtime {} ms, total {} ms; {stopped}",
            st["downtime"], st["total-time"]
        );
        check_fill_moved(src, dst, VRAM);
    });
}

/// A VM with two Switchyard devices (two softgpus, two servers each side) migrates: QEMU
/// requires `VFIO_MIGRATION_P2P` of every device of such a VM, and quiesces both
/// (PRE_COPY_P2P) before either stops. The driver keeps the first device busy (the soak)
/// and fills the second's VRAM before the migration; on the destination it checks both (the
/// soak bit-exact, the second device's fill through its engine). Each source device went
/// through PRE_COPY_P2P and each destination device through RUNNING_P2P (their servers'
/// logs). The downtime is measured against a one-device VM migrated in the same run.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_vm_with_two_devices_migrates_both_quiesced_first() {
    let (one, one_out, one_before) = soak_across_migration("migrate-one-device", DEVICE, &[], &[]);
    assert_migrated(&one, &one_out, &one_before);
    soak_summary(&one_out);
    let driver = [
        "--noiommu",
        "--quick",
        "--second-device",
        "--soak",
        &SOAK_SECONDS.to_string(),
    ];
    with_logs("migrate-two-devices", |env, dir| {
        let start = |side: &str| -> [Server; 2] {
            [0, 1].map(|i| {
                Server::start_named(env, dir, &format!("{side}{i}"), DEVICE, &[]).expect("a server")
            })
        };
        let two_spec = |side: &str, servers: &[Server; 2]| {
            let mut spec = spec(env, side, &servers[0].socket);
            spec.kernel_args = vec![format!("hugepages={}", 2 * HUGEPAGES)];
            spec.devices = vec![
                VfioUserDevice::new("gpu0", &servers[0].socket),
                VfioUserDevice::new("gpu1", &servers[1].socket),
            ];
            spec.args = driver.iter().map(|s| s.to_string()).collect();
            spec
        };
        let src = start("src");
        let mut guest = Guest::boot(env, dir, &two_spec("src", &src)).expect("boot the source");
        let mut qmp = Qmp::connect(guest.qmp.clone().expect("QMP"), Duration::from_secs(30))
            .expect("the source's QMP");
        guest
            .wait_for_line("SYGPU: step second-fill: ok")
            .expect("the second device is filled");
        guest
            .wait_for_line("SYGPU: soak start")
            .expect("the soak starts");
        let dst = start("dst");
        let incoming = dir.join("migration.sock");
        let mut spec = two_spec("dst", &dst);
        spec.incoming = Some(incoming.clone());
        let dst_guest = Guest::boot(env, dir, &spec).expect("start the destination");
        wait_until(
            Duration::from_secs(30),
            "the incoming migration socket",
            || incoming.exists().then_some(()),
        )
        .expect("the destination listens");
        // Some jobs before the switchover: the soak reports progress after its first second.
        guest
            .wait_for_line("SYGPU: soak progress")
            .expect("the soak runs");
        let st = migrate(&mut qmp, &format!("unix:{}", incoming.display()));
        let before = guest.serial_text();
        let _ = qmp.quit();
        drop(guest);
        let out = dst_guest.wait().expect("the destination guest finished");
        assert_migrated(&st, &out, &before);
        let s = soak_summary(&out);
        assert!(
            out.serial.contains("SYGPU: step second-check: ok"),
            "the second device's fill is checked on the destination:\n{}",
            out.serial
        );
        assert!(
            !out.serial.contains("SYGPU: step second-fill"),
            "the destination booted the guest instead of receiving it:\n{}",
            out.serial
        );
        for server in &src {
            let log = server.log_text();
            assert!(
                log.contains("arc=EnterP2p from=PreCopy to=PreCopyP2p")
                    && log.contains("arc=PreCopyP2pToStopCopy"),
                "each source device is quiesced before it stops:\n{log}"
            );
        }
        for server in &dst {
            let log = server.log_text();
            assert!(
                log.contains("to=RunningP2p") && log.contains("arc=LeaveP2p"),
                "each destination device runs quiesced first:\n{log}"
            );
        }
        eprintln!(
            "two-device VM: downtime {} ms (one-device VM in this run: {} ms), total {} ms, soak {}",
            st["downtime"], one["downtime"], st["total-time"], s["soak"]
        );
    });
}
