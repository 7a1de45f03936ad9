//! The physical-device backend (`switchyard serve --device vfio,host=BDF`) against a real
//! device behind a real IOMMU: one TCG guest (L1) with a vIOMMU (`intel-iommu,intremap=on,
//! caching-mode=on`) and QEMU's `edu` device. Inside it, `images/tests/passthrough.sh` binds
//! edu to vfio-pci, serves it with the static `switchyard` and drives it with the static
//! `edu-client` over vfio-user (config space, registers, MSI through an eventfd, edu's DMA
//! engine on a DMA_MAPped memfd, the dirty report).
//!
//! `#[ignore]`d like every guest test; `scripts/test.sh` runs them with `--include-ignored`.
//! Needs, besides the usual guest prerequisites, the static builds of both binaries:
//! `RUSTFLAGS="-C target-feature=+crt-static" cargo build --release -p switchyard -p edu-client
//! --target x86_64-unknown-linux-gnu` (or `SWITCHYARD_STATIC_BIN` / `EDU_CLIENT`).
#![forbid(unsafe_code)]

use switchyard_guest_tests::{Guest, GuestEnv, GuestOutput, GuestSpec, with_logs};

/// Boots the L1 guest with edu and runs the passthrough script with `bars`.
fn run_passthrough(env: &GuestEnv, dir: &std::path::Path, bars: &str) -> GuestOutput {
    run_guest(env, dir, &["1234:11e8", bars, "--abandon-first"], |spec| {
        spec.emulated = vec!["edu".into()];
    })
}

/// Boots the L1 guest (vIOMMU with interrupt remapping) running the passthrough script with
/// `args`; `adjust` adds the devices.
fn run_guest(
    env: &GuestEnv,
    dir: &std::path::Path,
    args: &[&str],
    adjust: impl FnOnce(&mut GuestSpec),
) -> GuestOutput {
    let switchyard = env
        .static_binary("switchyard", "SWITCHYARD_STATIC_BIN")
        .expect("static switchyard");
    let client = env
        .static_binary("edu-client", "EDU_CLIENT")
        .expect("static edu-client");
    let initrd = env
        .initramfs_with(
            &format!("initramfs-passthrough-{}", std::process::id()),
            &[switchyard, client],
        )
        .expect("initramfs");
    let mut spec = GuestSpec::new("passthrough");
    spec.args = args.iter().map(|a| a.to_string()).collect();
    spec.iommu = true;
    spec.intremap = true;
    spec.initrd = Some(initrd);
    adjust(&mut spec);
    let out = Guest::boot(env, dir, &spec)
        .expect("boot")
        .wait()
        .expect("guest finished");
    // The key lines, for the test output (`--nocapture`).
    for l in out.serial.lines().map(str::trim).filter(|l| {
        l.starts_with("EDU")
            || l.starts_with("MSIX")
            || l.starts_with("NVME")
            || l.starts_with("ABANDON")
            || l.starts_with("MIGRATE")
            || l.starts_with("CONFORMANCE")
            || l.starts_with("PASSTHROUGH:")
            || l.contains("hidden")
            || l.contains("dirty tracking")
            || l.contains("vfio-bind")
    }) {
        eprintln!("{l}");
    }
    out
}

/// Every step the client checks, in order.
const STEPS: [&str; 14] = [
    "version",
    "device-info",
    "region-info",
    "irq-info",
    "config",
    "liveness",
    "factorial",
    "msi",
    "dma-map",
    "dma",
    "dma-read-only",
    "dirty",
    "dma-map-without-fd",
    "dma-unmap",
];

/// Checks that the script passed, the client printed `LABEL: STEP ok` for every step and a
/// passing `LABEL-SUMMARY`, and the server exited cleanly at SIGTERM; returns the summary.
fn assert_steps(out: &GuestOutput, label: &str, steps: &[&str]) -> serde_json::Value {
    assert_eq!(
        out.test_rc("passthrough"),
        Some(0),
        "the passthrough script failed:\n{}",
        out.serial
    );
    let lines: Vec<&str> = out.serial.lines().map(str::trim).collect();
    for step in steps {
        let prefix = format!("{label}: {step} ok");
        assert!(
            lines.iter().any(|l| l.starts_with(&prefix)),
            "no `{prefix}` line:\n{}",
            out.serial
        );
    }
    let key = format!("{label}-SUMMARY");
    let summary = out
        .json_line(&key)
        .unwrap_or_else(|| panic!("no {key} line"));
    assert_eq!(summary["result"], "pass", "{summary}");
    assert!(
        lines.contains(&"PASSTHROUGH: server exit=0"),
        "{}",
        out.serial
    );
    summary
}

/// A line of the server's log (the script prints it with a `SERVER: ` prefix).
fn server_line(l: &str, what: &str) -> bool {
    l.starts_with("SERVER: ") && l.contains(what)
}

fn assert_passed(out: &GuestOutput) -> serde_json::Value {
    let summary = assert_steps(out, "EDU", &STEPS);
    let lines: Vec<&str> = out.serial.lines().map(str::trim).collect();
    assert_eq!(summary["ids"], "0x11e81234", "{summary}");
    assert_eq!(summary["bar0_size"], 1 << 20, "{summary}");
    assert_eq!(summary["dirty_pages"], 2, "{summary}");
    // The server ran as a physical-device backend, said which dirty source it uses, and
    // exited cleanly at SIGTERM.
    let server = |needle: &str| lines.iter().any(|l| server_line(l, needle));
    assert!(server("opened"), "server log:\n{}", out.serial);
    assert!(
        server("dirty tracking: the device has none"),
        "server log:\n{}",
        out.serial
    );
    // A first client left its window mapped and its eventfd set, then went away: the server
    // unmapped the window from the IOMMU (the full run above mapped the same IOVA again) and
    // took the MSI index back from the kernel.
    assert!(
        lines.contains(&"PASSTHROUGH: abandoning client rc=0"),
        "{}",
        out.serial
    );
    // The server cleans up before it logs the disconnection; the abandoning client itself
    // unmapped and disabled nothing.
    let first_in = lines
        .iter()
        .position(|l| server_line(l, "client connected"))
        .expect("the first client in the server log");
    let first_out = lines
        .iter()
        .position(|l| server_line(l, "client disconnected"))
        .expect("the first client's disconnection in the server log");
    let after = &lines[first_in..first_out];
    assert!(
        after
            .iter()
            .any(|l| l.contains("DMA window unmapped from the IOMMU")),
        "no IOMMU unmap after the first client left:\n{}",
        out.serial
    );
    assert!(
        after
            .iter()
            .any(|l| l.contains("interrupt index disabled in the kernel")),
        "MSI still enabled after the first client left:\n{}",
        out.serial
    );
    summary
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn edu_behind_the_guest_iommu_is_served_with_trapped_bars() {
    with_logs("passthrough_trap", |env, dir| {
        let out = run_passthrough(env, dir, "trap");
        let summary = assert_passed(&out);
        assert_eq!(summary["bar0_mmap"], false, "{summary}");
    });
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn edu_behind_the_guest_iommu_is_served_with_mmapped_bars() {
    with_logs("passthrough_mmap", |env, dir| {
        let out = run_passthrough(env, dir, "mmap");
        let summary = assert_passed(&out);
        assert_eq!(summary["bar0_mmap"], true, "{summary}");
        assert!(
            out.serial
                .lines()
                .any(|l| l.trim().starts_with("EDU: bar0-mmap ok")),
            "{}",
            out.serial
        );
    });
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_passthrough_device_migrates_by_quiesce_reset_and_replay() {
    with_logs("passthrough_migrate", |env, dir| {
        let out = run_guest(env, dir, &["1234:11e8", "trap", "--migrate"], |spec| {
            spec.emulated = vec!["edu".into(), "edu".into()];
        });
        let serial = &out.serial;
        let summary = out
            .serial
            .lines()
            .find_map(|l| l.trim().strip_prefix("MIGRATE-SUMMARY "))
            .and_then(|j| serde_json::from_str::<serde_json::Value>(j).ok())
            .unwrap_or_else(|| panic!("no MIGRATE-SUMMARY:\n{serial}"));
        assert_eq!(summary["result"], "pass", "{summary}");
        // The stream is the client's configuration: a config space and a flag, not device memory.
        let bytes = summary["stream_bytes"].as_u64().expect("stream bytes");
        assert!((256 + 16..=4096 + 64).contains(&bytes), "{summary}");
        assert_eq!(summary["bar0"], "0xfe900000", "{summary}");
        assert_eq!(
            summary["dirty_pages"], 2,
            "every mapped page is dirty: {summary}"
        );
        for step in ["source", "switchover", "replayed", "destination"] {
            assert!(
                serial
                    .lines()
                    .any(|l| l.trim().starts_with(&format!("MIGRATE: {step} ok"))),
                "step {step}:\n{serial}"
            );
        }
        assert!(
            serial.contains("migration stream loaded: device reset"),
            "the destination server replayed the stream:\n{serial}"
        );
        assert_eq!(out.test_rc("passthrough"), Some(0), "{serial}");
    });
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_pcie_device_with_msix_gets_its_capabilities_filtered_and_msix_emulated() {
    // virtio-rng-pci behind a PCIe root port: modern only (1af4:1044), PCI Express with FLR,
    // MSI-X, and vendor-specific capabilities that the client must not see.
    with_logs("passthrough_msix", |env, dir| {
        let out = run_guest(env, dir, &["1af4:1044", "mmap", "--msix"], |spec| {
            spec.root_ports = 1;
            spec.emulated = vec!["virtio-rng-pci,bus=rp1".into()];
        });
        let summary = assert_steps(
            &out,
            "MSIX",
            &[
                "config",
                "msix-cap",
                "table-trapped",
                "table",
                "set-irqs",
                "mask",
                "reset",
                "disable",
            ],
        );
        assert_eq!(summary["config_size"], 4096, "{summary}");
        assert_eq!(summary["reset"], true, "{summary}");
        assert!(
            out.serial.lines().any(
                |l| server_line(l.trim(), "capability hidden from the client")
                    && l.contains("id=9")
            ),
            "the server did not hide the vendor capabilities:\n{}",
            out.serial
        );
    });
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn nvme_msix_interrupts_reach_the_client_and_a_masked_vector_is_held_pending() {
    // QEMU's NVMe controller behind a PCIe root port: real MSI-X interrupts (admin command
    // completions on vector 0), so delivery and the emulated per-vector mask are both seen.
    with_logs("passthrough_nvme", |env, dir| {
        let out = run_guest(env, dir, &["1b36:0010", "trap", "--nvme"], |spec| {
            spec.root_ports = 1;
            spec.emulated = vec!["nvme,serial=sy0001,bus=rp1".into()];
        });
        let summary = assert_steps(&out, "NVME", &["enable", "msix", "mask", "disable"]);
        assert_eq!(summary["vid"], "0x1b36", "{summary}");
    });
}

#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_passthrough_device_passes_the_device_conformance_suite() {
    // `edu-client --conformance BDF` runs every check of `switchyard-conformance` on the
    // passthrough kind (`vfio,host=BDF`) in its own process, on edu bound to vfio-pci behind
    // the guest's IOMMU: region bounds, config space, reset, client gone, migration (quiesce,
    // reset and replay, into the same edu opened again), recovery (reset and replay), and no
    // swap, relocation or telemetry.
    with_logs("passthrough_conformance", |env, dir| {
        let out = run_guest(env, dir, &["1234:11e8", "trap", "--conformance"], |spec| {
            spec.emulated = vec!["edu".into()];
        });
        let serial = &out.serial;
        let lines: Vec<&str> = serial.lines().map(str::trim).collect();
        let failed: Vec<&str> = lines
            .iter()
            .copied()
            .filter(|l| l.starts_with("CONFORMANCE: ") && l.contains(" FAIL "))
            .collect();
        assert!(failed.is_empty(), "checks failed:\n{}", failed.join("\n"));
        for (check, _) in switchyard_conformance::CHECKS {
            let line = format!("CONFORMANCE: {check} ok");
            assert!(lines.contains(&line.as_str()), "no `{line}`:\n{serial}");
        }
        let summary = out
            .json_line("CONFORMANCE-SUMMARY")
            .unwrap_or_else(|| panic!("no CONFORMANCE-SUMMARY:\n{serial}"));
        assert_eq!(summary["result"], "pass", "{summary}");
        assert_eq!(
            summary["checks"],
            switchyard_conformance::CHECKS.len(),
            "{summary}"
        );
        assert!(lines.contains(&"PASSTHROUGH: conformance rc=0"), "{serial}");
        assert_eq!(out.test_rc("passthrough"), Some(0), "{serial}");
    });
}
