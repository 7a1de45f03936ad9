//! Failover under a real guest: QEMU 11.1 (TCG) runs the in-guest driver on a pool endpoint
//! while the pool daemon (`--faults`) fails the board under it again and again
//! (`POST /v1/boards/{id}/fault`, an engine thread of the softgpu dies and the device detects
//! it); each time the daemon fails the endpoint over to a healthy board of the pool, and the
//! failed board is repaired (unquarantined) for a later failover.
//!
//! Ignored under a plain `cargo test` (they boot QEMU); `scripts/test.sh` runs them.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_guest_tests::{
    Guest, GuestSpec, PoolDaemon, assert_full_workload, assert_guest_tests_ignored, with_logs,
};
use switchyard_qemu::{Qmp, VfioUserDevice, root_port_id};

/// How long the driver keeps the device busy after its full workload.
const SOAK_SECONDS: u32 = 60;
/// A board fails this long after the last failover finished.
const FAULT_EVERY: Duration = Duration::from_secs(3);

#[test]
fn failover_guest_tests_are_ignored_not_passed_under_plain_cargo_test() {
    assert_guest_tests_ignored(
        "failover_guest_tests_are_ignored_not_passed_under_plain_cargo_test",
        2,
    );
}

/// The held-out-style run: for a minute, a board fails under the guest every few
/// seconds. The driver (mapped doorbells, VRAM mapped into the guest, MSI-X) runs its full
/// workload and then a soak of verified jobs on both queues; every failover is transparent
/// (QEMU never notices: no unplug, no reconnect), and the summary on the console says every
/// job was bit-exact and no device-written page was stale.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn the_driver_soaks_through_a_board_failure_every_few_seconds() {
    with_logs("failover-soak", |env, dir| {
        let mut config = String::new();
        for b in 0..3 {
            config += &format!("[[boards]]\nid = \"gpu{b}\"\nvram = \"64M\"\nqueues = 2\n");
        }
        config += "[[pools]]\nname = \"p\"\nboards = [\"gpu0\", \"gpu1\", \"gpu2\"]\n";
        let mut daemon = PoolDaemon::start_with(env, dir, &config, &["--faults"]);
        let socket = daemon.create("vm1", "p");
        let running = Arc::new(AtomicBool::new(true));
        let failer = {
            let api = daemon.api();
            let running = running.clone();
            std::thread::spawn(move || {
                let mut failovers = Vec::new();
                while running.load(Ordering::SeqCst) {
                    std::thread::sleep(FAULT_EVERY);
                    let st = api.get("/v1/endpoints/vm1").expect("endpoint").body;
                    // Once the driver runs: it enabled MSI-X, and QEMU handed the vectors'
                    // eventfds over (16 + ERR + REQ).
                    if st["worker"]["held"].as_u64().unwrap_or(0) < 20 {
                        continue;
                    }
                    let board = st["lease"]["board"].as_str().expect("board").to_owned();
                    let t0 = Instant::now();
                    api.post(
                        &format!("/v1/boards/{board}/fault"),
                        &json!({ "kind": "engine" }),
                    )
                    .unwrap_or_else(|e| panic!("fault {}: {e}", failovers.len()));
                    let deadline = t0 + Duration::from_secs(30);
                    loop {
                        let st = api.get("/v1/endpoints/vm1").expect("endpoint").body;
                        if st["lease"]["board"] != board.as_str()
                            && st["worker"]["state"] == "running"
                        {
                            break;
                        }
                        assert!(Instant::now() < deadline, "no failover off {board}: {st}");
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    failovers.push(t0.elapsed());
                    api.post(&format!("/v1/boards/{board}/unquarantine"), &json!({}))
                        .expect("repair the board");
                }
                failovers
            })
        };
        let mut spec = GuestSpec::new("sygpu-driver");
        spec.args = ["--doorbell", "mapped", "--soak", &SOAK_SECONDS.to_string()]
            .map(str::to_owned)
            .to_vec();
        spec.iommu = true;
        spec.devices = vec![VfioUserDevice::new("gpu0", &socket)];
        let out = Guest::boot(env, dir, &spec)
            .expect("boot")
            .wait()
            .expect("guest finished");
        running.store(false, Ordering::SeqCst);
        let failovers = failer.join().expect("failer");
        let s: Value = out
            .json_line("SYGPU-SUMMARY")
            .unwrap_or_else(|| panic!("no summary:\n{}", out.serial));
        assert_full_workload(&s);
        assert_eq!(out.test_rc("sygpu-driver"), Some(0), "{s}");
        assert_eq!(s["doorbell"], "mapped", "{s}");
        let soak = &s["soak"];
        assert_eq!(soak["ok"], true, "{s}");
        let jobs = soak["jobs"].as_u64().expect("soak jobs");
        assert!(jobs > 0, "{s}");
        assert_eq!(
            soak["jobs_verified"].as_u64(),
            Some(jobs),
            "zero wrong results: {s}"
        );
        assert_eq!(soak["region_stale_pages"], 0, "{s}");
        assert!(
            failovers.len() >= 10,
            "only {} failovers while the guest ran",
            failovers.len()
        );
        let events: Vec<Value> = daemon
            .api()
            .stream("/events?since=0&follow=false")
            .expect("events")
            .map(|l| serde_json::from_str(&l.expect("line")).expect("json"))
            .filter_map(|e: Value| e.get("pool").cloned())
            .filter(|p| p["kind"]["type"] == "failed_over")
            .collect();
        assert_eq!(
            events.len(),
            failovers.len(),
            "one failover per failure: {events:?}"
        );
        assert!(events.iter().all(|e| e["kind"]["mode"] == "transparent"));
        let qemu = std::fs::read_to_string(dir.join("qemu.log")).expect("QEMU's log");
        assert!(
            !qemu.contains("server closed socket") && !qemu.contains("hardware error"),
            "QEMU noticed:\n{qemu}"
        );
        let mut stalls: Vec<f64> = events
            .iter()
            .filter_map(|e| e["kind"]["stall_ms"].as_f64())
            .collect();
        stalls.sort_by(f64::total_cmp);
        eprintln!(
            "failover-soak guest: {:.1} s, {} failovers (report -> serving ms: p50 {} max {}), {jobs} soak jobs, {s}",
            out.elapsed.as_secs_f64(),
            failovers.len(),
            stalls[stalls.len() / 2],
            stalls[stalls.len() - 1],
        );
    });
}

/// A guest-visible failover: the board's VRAM fails under the running driver (the state dies
/// with it), so the daemon unplugs the dead device through the endpoint's registered VMM
/// (QMP `device_del`), builds a fresh device on the other board and plugs it into the same
/// root port (`device_add`); the driver, which gave up on the dead device, probes the new one
/// and runs its full workload there. Boards with MSI (QEMU 11.1 aborts the VM on `device_del`
/// of a vfio-user device with MSI-X) and trapped VRAM (a failed memory fails the guest's
/// accesses too).
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_board_whose_vram_fails_is_replaced_guest_visibly_and_the_driver_reruns_its_job() {
    with_logs("failover-replug", |env, dir| {
        let mut config = String::new();
        for b in 0..2 {
            config += &format!(
                "[[boards]]\nid = \"gpu{b}\"\nvram = \"64M\"\nqueues = 2\nirq = \"msi\"\nvram_mmap = false\n"
            );
        }
        config += "[[pools]]\nname = \"p\"\nboards = [\"gpu0\", \"gpu1\"]\n";
        let mut daemon = PoolDaemon::start_with(env, dir, &config, &["--faults"]);
        let socket = daemon.create("vm1", "p");
        let mut spec = GuestSpec::new("failover");
        spec.args = vec!["1234:5347".into()];
        spec.iommu = true;
        spec.root_ports = 1;
        spec.qmp = true;
        spec.timeout = Duration::from_secs(400);
        let mut guest = Guest::boot(env, dir, &spec).expect("boot");
        let qmp_path = guest.qmp.clone().expect("qmp socket");
        let bus = root_port_id(1);
        assert_eq!(
            guest
                .wait_for_line("FAILOVER: waiting")
                .expect("guest waits"),
            "FAILOVER: waiting"
        );
        {
            let mut qmp =
                switchyard_guest_tests::wait_until(Duration::from_secs(30), "QMP", || {
                    Qmp::connect(&qmp_path, Duration::from_secs(30)).ok()
                })
                .expect("qmp");
            qmp.device_add(&VfioUserDevice::new("gpu0", &socket).bus(bus.clone()))
                .expect("device_add");
            // QMP takes one client at a time: this one leaves before the daemon needs it.
        }
        let api = daemon.api();
        api.put(
            "/v1/endpoints/vm1/vmm",
            &json!({ "qmp": qmp_path, "device_id": "gpu0", "bus": bus }),
        )
        .expect("register the VMM");
        guest
            .wait_for_line("SYGPU: soak start")
            .expect("the driver soaks");
        api.post("/v1/boards/gpu0/fault", &json!({ "kind": "vram" }))
            .expect("fault");
        let rerun = guest
            .wait_for_line("FAILOVER: rerun rc=")
            .expect("the driver reruns on the replacement");
        let out = guest.wait().expect("guest finished");
        assert_eq!(rerun, "FAILOVER: rerun rc=0", "{}", out.serial);
        let first = switchyard_guest_tests::find_line(&out.serial, "FAILOVER: first run rc=")
            .expect("first run");
        assert_ne!(
            first, "FAILOVER: first run rc=0",
            "the dead device failed the first run"
        );
        // The last summary is the rerun's, on the fresh device.
        let summaries: Vec<Value> = out
            .serial
            .lines()
            .filter_map(|l| l.trim().strip_prefix("SYGPU-SUMMARY "))
            .filter_map(|j| serde_json::from_str(j).ok())
            .collect();
        let last = summaries.last().expect("a summary of the rerun");
        assert_full_workload(last);
        let st = api.get("/v1/endpoints/vm1").expect("endpoint").body;
        assert_eq!(st["lease"]["board"], "gpu1", "{st}");
        assert_eq!(st["failover"]["last"]["mode"], "guest-visible", "{st}");
        let qemu = std::fs::read_to_string(dir.join("qemu.log")).expect("QEMU's log");
        assert!(!qemu.contains("hardware error"), "QEMU:\n{qemu}");
        eprintln!(
            "failover-replug guest: {:.1} s; failover {}",
            out.elapsed.as_secs_f64(),
            st["failover"]["last"]
        );
    });
}
