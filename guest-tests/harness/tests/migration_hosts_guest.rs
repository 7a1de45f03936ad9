//! Live migration between two "hosts" on one machine: two network namespaces made by the test
//! (a veth pair between them, addresses only there: [`TwoHosts`]), each with its own pool
//! daemon (own configuration, state and endpoint directories; the daemons need no network),
//! the source QEMU in host A's namespace migrating over TCP to the destination QEMU in host
//! B's (`-incoming tcp:ADDR:PORT`), the guest's driver soaking the device throughout.
//!
//! The destination's endpoint is made the two-host way of docs/migration.md: `ctl endpoint vm1
//! --json` on host A, the file copied, `ctl create vm1-in --incoming-spec FILE` on host B.
//! What is checked: the migration completes, the soak is bit-exact on the destination, host
//! B's daemon commits (its endpoint keeps its lease), and host A's daemon, which has no link
//! to B, deletes the source once its QEMU quits (event `migrated_away`) and frees its board.
//!
//! Needs root (namespaces): it fails, saying so, without. Ignored under a plain `cargo test`
//! (it boots QEMU); `scripts/test.sh` runs it.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_guest_tests::{
    Guest, GuestEnv, GuestOutput, GuestSpec, PoolDaemon, TwoHosts, assert_guest_tests_ignored,
    wait_until, with_logs,
};
use switchyard_qemu::{Qmp, VfioUserDevice};

/// Hugepages the guest kernel reserves at boot (`sygpu_driver::hugepage::HUGEPAGES_WANTED`).
const HUGEPAGES: u32 = 16;
/// How long the driver keeps the device busy; the migration starts once it has started.
const SOAK_SECONDS: u32 = 20;
/// Each host's boards: two of one shape in pool `p`.
const BOARDS: &str = "[[boards]]\nid = \"gpu0\"\nvram = \"64M\"\nqueues = 2\n\
     [[boards]]\nid = \"gpu1\"\nvram = \"64M\"\nqueues = 2\n\
     [[pools]]\nname = \"p\"\nboards = [\"gpu0\", \"gpu1\"]\n";
/// The destination's migration port (in host B's namespace only).
const PORT: u16 = 4444;

#[test]
fn migration_hosts_guest_tests_are_ignored_not_passed_under_plain_cargo_test() {
    assert_guest_tests_ignored(
        "migration_hosts_guest_tests_are_ignored_not_passed_under_plain_cargo_test",
        1,
    );
}

/// A guest of this file: no vIOMMU, hugepages for the driver's DMA, the device of `socket`,
/// QMP, the patched QEMU, files named `name`, QEMU in network namespace `netns`, the driver
/// soaking.
fn spec(env: &GuestEnv, name: &str, socket: &Path, netns: &str) -> GuestSpec {
    let mut spec = GuestSpec::new("sygpu-driver");
    spec.kernel_args = vec![format!("hugepages={HUGEPAGES}")];
    spec.devices = vec![VfioUserDevice::new("gpu0", socket)];
    spec.qmp = true;
    spec.qemu = Some(env.migration_qemu().expect("the patched QEMU"));
    spec.name = Some(name.to_owned());
    spec.timeout = Duration::from_secs(300);
    spec.netns = Some(netns.to_owned());
    spec.args = ["--noiommu", "--soak", &SOAK_SECONDS.to_string()]
        .into_iter()
        .map(str::to_owned)
        .collect();
    spec
}

/// `switchyard ctl --socket DAEMON ARGS`; its output, which must say success.
fn ctl(env: &GuestEnv, daemon: &PoolDaemon, args: &[&str]) -> String {
    let out = Command::new(&env.switchyard)
        .arg("ctl")
        .arg("--socket")
        .arg(daemon.socket())
        .args(args)
        .output()
        .expect("run ctl");
    assert!(
        out.status.success(),
        "ctl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8")
}

/// The endpoint leasing board `board` on `daemon` (null: free).
fn holder(daemon: &PoolDaemon, board: &str) -> Value {
    let boards = daemon.api().get("/v1/boards").expect("boards").body;
    let b = boards
        .as_array()
        .and_then(|bs| bs.iter().find(|b| b["id"] == board))
        .unwrap_or_else(|| panic!("no board {board}: {boards}"))
        .clone();
    b["devices"][0]["endpoint"].clone()
}

/// `daemon`'s worker events of `kind` about `endpoint`.
fn events(daemon: &PoolDaemon, kind: &str, endpoint: &str) -> Vec<Value> {
    daemon
        .api()
        .stream("/events?since=0&follow=false")
        .expect("events")
        .filter_map(|l| serde_json::from_str::<Value>(&l.ok()?).ok())
        .filter_map(|e| e.get("worker").cloned())
        .filter(|w| w["event"] == kind && w["endpoint"] == endpoint)
        .collect()
}

/// The driver's summary in `out`, which must say pass, with the soak bit-exact.
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

/// `query-migrate` until the migration ends (120 s at most); its last status object.
fn wait_migration(qmp: &mut Qmp) -> Value {
    wait_until(Duration::from_secs(120), "the migration ends", || {
        let st = qmp.execute("query-migrate", None).ok()?;
        matches!(
            st["status"].as_str(),
            Some("completed" | "failed" | "cancelled")
        )
        .then_some(st)
    })
    .expect("the migration ended")
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_migration_between_two_hosts_hands_the_lease_over() {
    with_logs("migrate-hosts", |env, dir| {
        let hosts = TwoHosts::new("mig");
        let mut a = PoolDaemon::start_named(env, dir, "a", BOARDS);
        let mut b = PoolDaemon::start_named(env, dir, "b", BOARDS);
        // Host B's first board is in use: the destination leases from B's own pool.
        b.create("other", "p");
        let socket = a.create("vm1", "p");
        let mut guest =
            Guest::boot(env, dir, &spec(env, "src", &socket, &hosts.a)).expect("boot the source");
        let mut qmp = Qmp::connect(guest.qmp.clone().expect("QMP"), Duration::from_secs(30))
            .expect("the source's QMP");
        guest
            .wait_for_line("SYGPU: soak start")
            .expect("the driver starts its soak");

        // Host A describes the source; the file goes to host B, which makes the destination.
        let described = dir.join("vm1.json");
        std::fs::write(&described, ctl(env, &a, &["endpoint", "vm1", "--json"]))
            .expect("write the description");
        let file = described.to_str().expect("UTF-8");
        let created: Value = serde_json::from_str(&ctl(
            env,
            &b,
            &["create", "vm1-in", "--incoming-spec", file, "--json"],
        ))
        .expect("JSON");
        b.endpoints.push("vm1-in".into());
        assert_eq!(created["incoming_for"], "vm1", "{created}");
        assert_eq!(created["lease"]["board"], "gpu1", "{created}");
        let dst_socket = PathBuf::from(created["endpoint"]["socket"].as_str().expect("socket"));
        let mut dspec = spec(env, "dst", &dst_socket, &hosts.b);
        dspec.incoming_uri = Some(format!("tcp:{}:{PORT}", TwoHosts::ADDR_B));
        let dst = Guest::boot(env, dir, &dspec).expect("start the destination");
        // QEMU answers QMP once it listens for the migration (set up before its main loop).
        let mut dqmp = Qmp::connect(dst.qmp.clone().expect("QMP"), Duration::from_secs(30))
            .expect("the destination's QMP");
        let status = dqmp.execute("query-status", None).expect("query-status");
        assert_eq!(status["status"], "inmigrate", "{status}");

        qmp.execute(
            "migrate",
            Some(json!({ "uri": format!("tcp:{}:{PORT}", TwoHosts::ADDR_B) })),
        )
        .expect("migrate");
        let st = wait_migration(&mut qmp);
        assert_eq!(st["status"], "completed", "{st}");
        wait_until(
            Duration::from_secs(30),
            "host B's daemon commits the migration",
            || {
                let e = b.api().get("/v1/endpoints/vm1-in").ok()?.body;
                e.get("incoming_for").is_none().then_some(())
            },
        )
        .expect("committed");
        assert_eq!(events(&b, "migrated", "vm1-in").len(), 1);
        // Host A knows nothing of B: vm1 stays while its QEMU lives.
        assert!(a.api().get("/v1/endpoints/vm1").is_ok(), "vm1 went early");

        // The source QEMU quits, as after any migration: host A's daemon frees vm1's board.
        let _ = qmp.quit();
        drop(guest);
        wait_until(
            Duration::from_secs(30),
            "host A's daemon deletes the source",
            || a.api().get("/v1/endpoints/vm1").is_err().then_some(()),
        )
        .expect("the source's lease released");
        a.endpoints.retain(|e| e != "vm1");
        assert_eq!(events(&a, "migrated_away", "vm1").len(), 1);
        assert!(holder(&a, "gpu0").is_null(), "host A's gpu0 is free");
        assert!(holder(&a, "gpu1").is_null(), "host A's gpu1 is free");
        // Host B: the destination keeps its lease, and nothing was released there.
        assert_eq!(holder(&b, "gpu1"), "vm1-in");
        assert!(events(&b, "migration_released", "vm1-in").is_empty());
        let out = dst.wait().expect("the destination guest finished");
        let s = soak_summary(&out);
        eprintln!("two-host migration: {}, soak {}", st["downtime"], s["soak"]);
        drop(hosts);
    });
}
