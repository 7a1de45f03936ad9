//! Nested tests: a TCG guest (L1, `-cpu EPYC`) plays the host. It loads KVM (nested SVM with
//! nested paging under TCG), runs a static `switchyard serve` and the real cloud-hypervisor v54,
//! and boots L2 guests under KVM that use the softgpu through `--user-device`. `sy-nested`
//! (guest-tests/nested) drives L1; these tests read what it printed on L1's console.
//!
//! One L1 boot runs several scenarios (an L1 session costs ~10 s before any L2 runs).
//! `#[ignore]`d like every booting test; `scripts/test.sh` runs them with `--include-ignored`.
//! The cloud-hypervisor test needs the setup cache's `ch/` (optional: docs/cloud-hypervisor.md);
//! `scripts/test.sh` skips it by name without one (`scripts/lib/cloud-hypervisor.sh`), and says so.
#![forbid(unsafe_code)]

use serde_json::Value;
use switchyard_guest_tests::{
    GuestOutput, GuestSpec, NESTED_ATTEMPTS, assert_guest_tests_ignored, boot_nested,
    with_logs_within,
};

/// How long a nested test may run before its watchdog calls it a hang: an L1 boot takes one
/// to two minutes, and a boot that hits a fault of the nested virtualization is booted again
/// (up to [`NESTED_ATTEMPTS`] boots).
const NESTED_TEST_LIMIT: std::time::Duration =
    std::time::Duration::from_secs(6 * 60 * NESTED_ATTEMPTS as u64);

/// Every `NESTED-RESULT {json}` line L1 printed, by scenario.
fn results(out: &GuestOutput) -> Vec<Value> {
    out.serial
        .lines()
        .filter_map(|l| l.trim().strip_prefix("NESTED-RESULT "))
        .map(|j| serde_json::from_str(j).expect("NESTED-RESULT JSON"))
        .collect()
}

fn result<'a>(all: &'a [Value], scenario: &str, serial: &str) -> &'a Value {
    all.iter()
        .find(|v| v["scenario"] == scenario)
        .unwrap_or_else(|| panic!("no NESTED-RESULT for {scenario}:\n{serial}"))
}

/// Every test here boots L1, so each is ignored: a plain `cargo test` lists them as ignored.
#[test]
fn nested_tests_are_ignored_not_passed_under_plain_cargo_test() {
    assert_guest_tests_ignored(
        "nested_tests_are_ignored_not_passed_under_plain_cargo_test",
        3,
    );
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn cloud_hypervisor_l2_guests_use_the_softgpu_served_in_l1() {
    with_logs_within("nested_cloud_hypervisor", NESTED_TEST_LIMIT, |env, dir| {
        // cloud-hypervisor is optional in the setup (docs/cloud-hypervisor.md): scripts/test.sh
        // leaves this test out without it; run anyway, it fails here, never passes.
        if let Err(e) = env.cloud_hypervisor() {
            panic!("{e}");
        }
        let spec = GuestSpec::nested(env, &["ch-viommu", "ch-workload", "ch-hotplug", "ch-pool"])
            .expect("L1 image");
        let out = boot_nested(env, dir, &spec).expect("L1 finished");
        let serial = &out.serial;
        assert!(
            serial.lines().any(|l| l.starts_with("NESTED: kvm ready")),
            "L1 has no KVM:\n{serial}"
        );
        let all = results(&out);

        // cloud-hypervisor will not put a vfio-user device behind its virtio-iommu, which is
        // why L2 drives the device without an IOMMU below. If this ever changes, L2 can use
        // VFIO like the QEMU guests do.
        let v = result(&all, "ch-viommu", serial);
        assert_eq!(v["refused"], true, "{v}");
        assert!(
            v["reason"]
                .as_str()
                .is_some_and(|r| r.contains("not placed behind IOMMU")),
            "{v}"
        );

        // A boot-time --user-device: L2 enumerates the softgpu and the driver runs its
        // workload on it without an IOMMU.
        let w = result(&all, "ch-workload", serial);
        assert_eq!(w["ok"], true, "{w}");
        assert_eq!(w["device_listed_in_l2"], true, "{w}");
        assert_eq!(w["driver_rc"], 0, "{w}");
        assert_eq!(w["ch_exit"], 0, "cloud-hypervisor exits cleanly: {w}");
        assert_eq!(w["server_alive_after_vm"], true, "{w}");
        let s = &w["driver_summary"];
        assert_eq!(s["result"], "pass", "{s}");
        assert_eq!(s["iommu"], "none", "{s}");
        let run = s["jobs_run"].as_u64().expect("jobs_run");
        assert!(run >= 5, "{s}");
        assert_eq!(s["jobs_verified"].as_u64(), Some(run), "{s}");
        assert_eq!(s["vram_mmap_ok"], true, "VRAM through the mapped BAR: {s}");
        assert_eq!(s["error_test_ok"], true, "bad DMA address: {s}");
        // On mapped doorbells through the BAR0 page cloud-hypervisor offers L2: the device
        // took tails it was not kicked for.
        assert_eq!(s["doorbell"], "mapped", "{s}");
        let (subs, kicks) = (
            s["submissions"].as_u64().expect("submissions"),
            s["kicks"].as_u64().expect("kicks"),
        );
        assert!(kicks < subs, "every one of {subs} submissions kicked: {s}");

        // Hot-add and removal through our REST client, twice: L2 sees the device come and go,
        // the driver runs on each plug, nothing dies.
        let h = result(&all, "ch-hotplug", serial);
        assert_eq!(h["ok"], true, "{h}");
        let rounds = h["rounds"].as_array().expect("rounds");
        assert_eq!(rounds.len(), 2, "{h}");
        for r in rounds {
            assert_eq!(r["driver_rc"], 0, "{r}");
            assert!(
                r["bdf"].as_str().is_some_and(|b| b.starts_with("0000:00:")),
                "{r}"
            );
        }
        assert!(
            h["ch_version"].as_str().is_some_and(|v| v.contains("54.")),
            "{h}"
        );
        assert_eq!(h["server_alive_after_vm"], true, "{h}");

        // The pool daemon serves the same kind of guest while its worker is SIGKILLed: the
        // VMM's socket never drops, every read in L2 returns the register's value.
        let p = result(&all, "ch-pool", serial);
        assert_eq!(p["ok"], true, "{p}");
        assert!(p["kills"].as_u64().is_some_and(|k| k >= 2), "{p}");
        assert_eq!(p["mismatches"], 0, "{p}");
        assert_eq!(p["ch_exit"], 0, "{p}");
        assert!(
            p["worker"]["restarts"].as_u64() >= p["kills"].as_u64(),
            "{p}"
        );
        assert_eq!(out.test_rc("nested"), Some(0), "{serial}");
    });
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn qemu_kvm_l2_runs_the_full_vfio_driver_on_the_softgpu_served_in_l1() {
    with_logs_within("nested_qemu_kvm", NESTED_TEST_LIMIT, |env, dir| {
        let spec = GuestSpec::nested(env, &["qemu-softgpu"]).expect("L1 image");
        let out = boot_nested(env, dir, &spec).expect("L1 finished");
        let serial = &out.serial;
        let all = results(&out);
        // L1 plays the host for QEMU with KVM: L2 has a vIOMMU, so the driver runs its whole
        // VFIO workload there, MSI-X included (the path cloud-hypervisor cannot offer).
        let q = result(&all, "qemu-softgpu", serial);
        assert_eq!(q["ok"], true, "{q}");
        let s = &q["driver_summary"];
        assert_eq!(s["result"], "pass", "{s}");
        assert_eq!(s["irq_mode"], "msix", "{s}");
        let run = s["jobs_run"].as_u64().expect("jobs_run");
        assert!(run >= 5, "{s}");
        assert_eq!(s["jobs_verified"].as_u64(), Some(run), "{s}");
        assert!(
            s["interrupts"]["total"].as_u64().is_some_and(|n| n >= run),
            "an interrupt per job at least: {s}"
        );
        assert_eq!(s["vram_mmap_ok"], true, "{s}");
        assert_eq!(s["error_test_ok"], true, "{s}");
        assert_eq!(q["qemu_exit"], 0, "{q}");
        assert_eq!(out.test_rc("nested"), Some(0), "{serial}");
    });
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn physical_devices_in_l1_are_served_through_switchyard() {
    with_logs_within("nested_passthrough", NESTED_TEST_LIMIT, |env, dir| {
        // L0 gives L1 a vIOMMU with interrupt remapping, two edus and an igb (SR-IOV PF).
        let spec =
            GuestSpec::nested_with_devices(env, &["qemu-edu", "vf-probe", "pool-edu"], 2, true)
                .expect("L1 image");
        let out = boot_nested(env, dir, &spec).expect("L1 finished");
        let serial = &out.serial;
        let all = results(&out);

        // edu, owned by L1 through VFIO, served by switchyard to an L2 under QEMU/KVM: L2's
        // driver sees edu, its factorial and MSI, and DMA into L2 memory both ways.
        let e = result(&all, "qemu-edu", serial);
        assert_eq!(e["ok"], true, "{e}");
        let s = &e["edu_summary"];
        assert_eq!(s["result"], "pass", "{s}");
        assert_eq!(s["id"], "0x010000ed", "{s}");
        assert_eq!(s["factorial_ok"], true, "{s}");
        assert_eq!(s["dma_bytes_verified"], 4096, "{s}");
        assert!(s["interrupts"].as_u64().is_some_and(|n| n >= 4), "{s}");

        // An SR-IOV VF made and bound by the inventory, as a client sees it through switchyard.
        let v = result(&all, "vf-probe", serial);
        assert_eq!(v["ok"], true, "{v}");
        let c = &v["client_view"];
        assert_eq!(c["vendor"], "8086", "{c}");
        assert_eq!(c["device"], "10ca", "igb VF: {c}");
        assert!(c["msix_vectors"].as_u64().is_some_and(|n| n > 0), "{c}");
        assert_eq!(c["msix_routed"], c["msix_vectors"], "{c}");
        assert!(c["bar0_size"].as_u64().is_some_and(|n| n > 0), "{c}");

        // The pool daemon with both edus as passthrough boards.
        let p = result(&all, "pool-edu", serial);
        let boards = p["boards"].as_array().expect("boards");
        assert_eq!(boards.len(), 2, "{p}");
        for b in boards {
            assert_eq!(b["shape"]["model"], "vfio", "{b}");
            assert!(
                b["host"].is_string(),
                "the board names its PCI address: {b}"
            );
            assert_eq!(b["dirty_tracking"], "all_mapped", "{b}");
        }
        // edu0 drives an L2 of vm1, is detached, attached to vm2 and drives vm2's L2.
        for vm in ["vm1_edu0", "vm2_edu0"] {
            let v = &p[vm];
            assert_eq!(v["rc"], 0, "{vm}: {p}");
            assert_eq!(v["summary"]["result"], "pass", "{vm}: {v}");
            assert_eq!(v["summary"]["factorial_ok"], true, "{vm}: {v}");
            assert_eq!(v["summary"]["dma_bytes_verified"], 4096, "{vm}: {v}");
            assert_eq!(v["qemu_exit"], 0, "{vm}: {v}");
        }
        assert_eq!(p["attached"]["id"], "edu0", "{p}");
        // vm2's worker was killed twice: in QEMU's handshake, then with L2's driver paused
        // between its checks (DMA windows and MSI set up). Each replacement reset + replayed
        // edu0 and continued the connection; the second one mapped the windows and routed the
        // MSI again, and the driver's checks after its pause went through them.
        let w = &p["vm2_worker_after_kill"];
        assert_eq!(w["restarts"], 2, "{w}");
        assert_eq!(w["state"], "running", "{w}");
        assert_eq!(p["second_kill_before_resume"], true, "{p}");
        assert_eq!(p["vm2_edu0"]["summary"]["after_pause_ok"], true, "{p}");
        let r = &p["resumed_with"];
        assert!(r["windows"].as_u64().is_some_and(|n| n > 0), "{r}");
        assert!(r["vectors"].as_u64().is_some_and(|n| n > 0), "{r}");
        assert!(
            p["move_refused"]
                .as_str()
                .is_some_and(|m| m.contains("passthrough")),
            "a passthrough endpoint is never moved under its guest: {p}"
        );
        // edu0 removed from L1 under load: no hang, a clean failure, nobody dies.
        assert_eq!(p["removal"], "completed", "{p}");
        assert_eq!(p["device_gone_from_l1"], true, "{p}");
        assert_eq!(p["vm2_remove"]["summary"]["result"], "device-lost", "{p}");
        assert!(p["vm2_remove"]["summary"]["device_lost"].is_string(), "{p}");
        assert_eq!(p["vm2_remove"]["qemu_exit"], 0, "the VMM survived: {p}");
        let edu0 = p["boards_after"]
            .as_array()
            .and_then(|b| b.iter().find(|b| b["id"] == "edu0"))
            .expect("edu0 after");
        assert_eq!(edu0["state"], "quarantined", "{edu0}");
        assert!(
            !edu0["failed"].is_null(),
            "the board's failure recorded: {edu0}"
        );
        // vm2's QEMU was registered with the daemon (its device on a root port): the lost
        // state made the failover guest-visible. The daemon unplugged the dead device once L2's
        // driver let go of it, started a fresh worker on edu1 and plugged it into the same
        // slot, where the driver ran its checks again. (The worker reporting edu0 lost is gone:
        // vm2's worker now is the fresh one on edu1.)
        let f = &p["failover"];
        assert_eq!(f["mode"], "guest-visible", "{p}");
        assert_eq!(f["from"], "edu0", "{f}");
        assert_eq!(f["to"], "edu1", "{f}");
        assert!(f["stall_ms"].as_f64().is_some(), "{f}");
        let events = p["failed_over_events"]
            .as_array()
            .expect("failed_over events");
        assert!(
            events.iter().any(|e| e["kind"]["mode"] == "guest-visible"
                && e["kind"]["from"] == "edu0"
                && e["kind"]["to"] == "edu1"),
            "{p}"
        );
        assert_eq!(p["vm2_lease"]["id"], "edu1", "{p}");
        let again = &p["vm2_again"];
        assert_eq!(again["result"], "pass", "{again}");
        assert_eq!(again["id"], "0x010000ed", "{again}");
        assert_eq!(again["factorial_ok"], true, "{again}");
        assert_eq!(again["dma_bytes_verified"], 4096, "{again}");
        assert_eq!(p["vm2_remove"]["rc"], 0, "the rerun's exit code: {p}");
        assert_eq!(p["daemon_alive"], true, "{p}");
        assert_eq!(p["ok"], true, "{p}");
        assert_eq!(out.test_rc("nested"), Some(0), "{serial}");
    });
}
