//! The in-guest driver's `--noiommu` mode in a real guest: QEMU (TCG) **without** a vIOMMU
//! gets the softgpu through `vfio-user-pci` from `switchyard serve`, the kernel boots with
//! `hugepages=16`, and `sygpu-driver --noiommu` runs the workload with no VFIO at all: sysfs
//! `enable`/`config`/`resource0`/`resource2`, DMA memory in hugepages at their physical
//! addresses, completion polled. This is how the driver runs where the VMM cannot put the
//! device behind an IOMMU (cloud-hypervisor's `--user-device`).
//!
//! Ignored under a plain `cargo test` (it boots QEMU); `scripts/test.sh` runs it:
//! `cargo test -p switchyard-guest-tests -- --include-ignored`.
#![forbid(unsafe_code)]

use switchyard_guest_tests::{Guest, GuestSpec, Server, assert_guest_tests_ignored, with_logs};
use switchyard_qemu::VfioUserDevice;

/// Hugepages the guest kernel reserves at boot (`sygpu_driver::hugepage::HUGEPAGES_WANTED`).
const HUGEPAGES: u32 = 16;

/// Every test here that boots a guest is ignored, so that a plain `cargo test` reports it as
/// ignored instead of passing it without booting anything.
#[test]
fn noiommu_guest_tests_are_ignored_not_passed_under_plain_cargo_test() {
    assert_guest_tests_ignored(
        "noiommu_guest_tests_are_ignored_not_passed_under_plain_cargo_test",
        2,
    );
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn in_guest_driver_runs_the_workload_without_iommu_or_vfio() {
    let s = noiommu_workload("driver-noiommu", &[]);
    assert_eq!(s["doorbell"], "trapped", "{s}");
    assert_eq!(s["kicks"], 0, "{s}");
}

/// The same with mapped doorbells: the doorbell page is reached through the sysfs
/// `resource0` mapping, and fewer kicks than submissions means the device took tails from
/// the page alone (see `softgpu_guest.rs`, mapped doorbells). A short latency run checks
/// that `--latency` works on this path too (its COPYs verified; figures not asserted).
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn in_guest_driver_runs_the_workload_without_iommu_through_mapped_doorbells() {
    let s = noiommu_workload(
        "driver-noiommu-mapped",
        &["--doorbell", "mapped", "--latency", "50"],
    );
    assert_eq!(s["doorbell"], "mapped", "{s}");
    let (subs, kicks) = (
        s["submissions"].as_u64().expect("submissions"),
        s["kicks"].as_u64().expect("kicks"),
    );
    assert!(kicks < subs, "every mapped submission kicked: {s}");
    assert_eq!(s["latency"]["jobs"], 50, "{s}");
    assert_eq!(s["latency"]["mapped"]["submissions"], 150, "{s}");
}

/// Boots a guest without vIOMMU whose driver runs `sygpu-driver --noiommu` with `extra`
/// arguments, checks everything the no-IOMMU run promises and returns its summary.
fn noiommu_workload(name: &str, extra: &[&str]) -> serde_json::Value {
    let mut summary = None;
    with_logs(name, |env, dir| {
        let mut server = Server::start(env, dir, "softgpu,vram=64M,queues=2").expect("server");
        let mut spec = GuestSpec::new("sygpu-driver");
        spec.args = std::iter::once("--noiommu")
            .chain(extra.iter().copied())
            .map(str::to_owned)
            .collect();
        spec.kernel_args = vec![format!("hugepages={HUGEPAGES}")];
        spec.iommu = false;
        spec.devices = vec![VfioUserDevice::new("gpu0", &server.socket)];
        let out = Guest::boot(env, dir, &spec)
            .expect("boot")
            .wait()
            .expect("guest finished");
        assert!(
            out.serial
                .lines()
                .any(|l| l.contains("vendor=0x1234 device=0x5347 class=0x030200")
                    && l.contains("driver=none")
                    && l.contains("iommu_group=none")),
            "the guest lists the softgpu with no driver and no IOMMU group:\n{}",
            out.serial
        );
        let s = out
            .json_line("SYGPU-SUMMARY")
            .unwrap_or_else(|| panic!("no summary:\n{}", out.serial));
        assert_eq!(s["result"], "pass", "{s}");
        assert_eq!(out.test_rc("sygpu-driver"), Some(0), "exit code");
        assert_eq!(s["mode"], "full", "{s}");
        assert_eq!(s["iommu"], "none", "{s}");
        assert_eq!(s["dma"], "hugepage-physical", "{s}");
        assert_eq!(s["interrupts"], "polled", "{s}");
        assert_eq!(
            s["vram_access"], "mmap",
            "the server offers the VRAM BAR for mmap: {s}"
        );
        assert_eq!(s["device_irq_mode"], "msix", "{s}");
        assert_eq!(s["queues"], 2, "{s}");
        assert_eq!(s["hugepages"]["page_bytes"], 2 << 20, "{s}");
        assert_eq!(s["hugepages"]["count"], HUGEPAGES, "{s}");
        let run = s["jobs_run"].as_u64().expect("jobs_run");
        // 2 queues: COPY 4, FILL 3, compute 7, VRAM mapping 2, bad DMA + the job after it 2.
        assert!(run >= 18, "{s}");
        assert_eq!(
            s["jobs_verified"].as_u64(),
            Some(run),
            "every job verified: {s}"
        );
        assert!(s["fence_polled_waits"].as_u64().unwrap_or(0) >= 16, "{s}");
        assert_eq!(s["error_test_ok"], true, "{s}");
        assert_eq!(s["vram_mmap_ok"], true, "{s}");
        let steps: Vec<(&str, bool)> = s["steps"]
            .as_array()
            .expect("steps")
            .iter()
            .map(|st| (st["name"].as_str().unwrap_or(""), st["ok"] == true))
            .collect();
        let latency = extra.contains(&"--latency").then_some("latency");
        assert_eq!(
            steps,
            [
                "identity",
                "vectors",
                "copy",
                "fill",
                "compute",
                "vram_mmap",
                "error",
                "final"
            ]
            .into_iter()
            .chain(latency)
            .map(|n| (n, true))
            .collect::<Vec<_>>(),
            "{s}"
        );
        // The device reported the bad bus address as unmapped and recovered.
        assert!(
            out.serial
                .lines()
                .any(|l| l.contains("SYGPU: step error: ok") && l.contains("DMA_UNMAPPED")),
            "{}",
            out.serial
        );
        // No VFIO was involved: no vfio-pci binding, no /dev/vfio.
        assert!(
            !out.serial.contains("vfio-pci:") && !out.serial.contains("/dev/vfio"),
            "{}",
            out.serial
        );
        assert!(server.alive(), "server survived the guest");
        let log = server.log_text();
        assert!(log.contains("client connected"), "{log}");
        assert!(!log.contains("panicked"), "{log}");
        eprintln!("{name} guest: {:.1} s, {s}", out.elapsed.as_secs_f64());
        assert!(
            server.terminate().is_some_and(|st| st.success()),
            "clean SIGTERM exit"
        );
        summary = Some(s);
    });
    summary.expect("the workload ran")
}
