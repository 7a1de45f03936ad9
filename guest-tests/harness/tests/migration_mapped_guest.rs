//! Live migration of a guest that maps a large VRAM (issue 35, item 3), under the patched
//! QEMU (vmm-integration/qemu/patches, 0009 in particular): QEMU migrates the mapped BAR's
//! memory itself, as RAM (the guest's writes through the mapping are dirty-logged by TCG like
//! guest RAM), and the device's stream carries only what the device wrote, so the device's
//! final round visits its own write log instead of hashing every data page of VRAM.
//!
//! - a 4 GiB device, 3/4 of its VRAM filled by the device's FILL engine before the soak
//!   (`sygpu-driver --soak-vram 75`), migrates with the soak running: every job and every
//!   page bit-exact (the filled pages, and a region of VRAM that the guest's CPU checks and
//!   rewrites through its mapping every iteration), the source's device stream carried only
//!   the device's own writes (`client_mapped=true`, no pass over VRAM);
//! - the negative control: a source server that acts as if QEMU migrated the mapped VRAM
//!   (`serve --mapped-migration assume`) while QEMU does not (`x-migrate-mapped-regions=off`):
//!   the destination's VRAM misses what was written before the migration and what the guest
//!   wrote through its mapping, and the driver there finds it stale.
//!
//! Ignored under a plain `cargo test` (they boot QEMU); `scripts/test.sh` runs them.
#![forbid(unsafe_code)]

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_guest_tests::{
    Guest, GuestEnv, GuestOutput, GuestSpec, Server, assert_guest_tests_ignored, wait_until,
    with_logs_within,
};
use switchyard_qemu::{Qmp, VfioUserDevice};

/// Hugepages the guest kernel reserves at boot (`sygpu_driver::hugepage::HUGEPAGES_WANTED`).
const HUGEPAGES: u32 = 16;
/// How long the driver keeps the device busy with a 4 GiB device: long enough for the
/// migration (3 GiB of data at QEMU's default 128 MiB/s) to end in it.
const SOAK_SECONDS_4G: u32 = 90;
/// The same for the negative control's 256 MiB device.
const SOAK_SECONDS_SMALL: u32 = 30;
/// Percent of VRAM the engine fills before the soak.
const FILL_PERCENT: u32 = 75;
/// Bound of a whole test.
const LIMIT: Duration = Duration::from_secs(600);

#[test]
fn mapped_migration_guest_tests_are_ignored_not_passed_under_plain_cargo_test() {
    assert_guest_tests_ignored(
        "mapped_migration_guest_tests_are_ignored_not_passed_under_plain_cargo_test",
        2,
    );
}

/// A guest of this file: no vIOMMU, hugepages, the device of `socket`, QMP, the patched QEMU
/// with `qemu_args`, the soak with VRAM filled and checked.
fn spec(env: &GuestEnv, name: &str, socket: &Path, qemu_args: &[&str], soak: u32) -> GuestSpec {
    let mut spec = GuestSpec::new("sygpu-driver");
    spec.kernel_args = vec![format!("hugepages={HUGEPAGES}")];
    spec.devices = vec![VfioUserDevice::new("gpu0", socket)];
    spec.qmp = true;
    spec.qemu = Some(env.migration_qemu().expect("the patched QEMU"));
    spec.qemu_args = qemu_args.iter().map(|s| (*s).to_owned()).collect();
    spec.name = Some(name.to_owned());
    spec.timeout = LIMIT;
    spec.args = [
        "--noiommu",
        "--soak",
        &soak.to_string(),
        "--soak-vram",
        &FILL_PERCENT.to_string(),
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    spec
}

/// What a run gave: QEMU's final migration status, the destination's driver output, the
/// source server's log.
struct Run {
    status: Value,
    out: GuestOutput,
    source_log: String,
}

/// Boots a soaking guest on a server serving `device` (`serve_args`), migrates it to a second
/// one with QEMU's `parameters` (none: QEMU's defaults) once the soak started, and waits for
/// the destination's guest to finish.
fn migrate_soaking(
    name: &str,
    device: &str,
    serve_args: &[&str],
    qemu_args: &[&str],
    soak: u32,
    parameters: Option<Value>,
) -> Run {
    let mut run = None;
    with_logs_within(name, LIMIT, |env, dir| {
        let src_server =
            Server::start_named(env, dir, "src", device, serve_args).expect("source server");
        let mut src = Guest::boot(
            env,
            dir,
            &spec(env, "src", &src_server.socket, qemu_args, soak),
        )
        .expect("boot the source");
        let mut qmp = Qmp::connect(src.qmp.clone().expect("QMP"), Duration::from_secs(30))
            .expect("the source's QMP");
        src.wait_for_line("SYGPU: soak start")
            .expect("the driver filled VRAM and starts its soak");
        let dst_server =
            Server::start_named(env, dir, "dst", device, &[]).expect("destination server");
        let incoming = dir.join("migration.sock");
        let mut dspec = spec(env, "dst", &dst_server.socket, qemu_args, soak);
        dspec.incoming = Some(incoming.clone());
        let dst = Guest::boot(env, dir, &dspec).expect("start the destination");
        wait_until(
            Duration::from_secs(30),
            "the incoming migration socket",
            || incoming.exists().then_some(()),
        )
        .expect("the destination listens");
        if let Some(p) = parameters {
            qmp.execute("migrate-set-parameters", Some(p))
                .expect("migration parameters");
        }
        let started = Instant::now();
        qmp.execute(
            "migrate",
            Some(json!({ "uri": format!("unix:{}", incoming.display()) })),
        )
        .expect("migrate");
        let status = loop {
            let st = qmp.execute("query-migrate", None).expect("query-migrate");
            if matches!(
                st["status"].as_str(),
                Some("completed" | "failed" | "cancelled")
            ) {
                break st;
            }
            assert!(
                started.elapsed() < Duration::from_secs(300),
                "the migration did not end in 300 s: {st}"
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        assert_eq!(status["status"], "completed", "{status}");
        let _ = qmp.quit();
        drop(src);
        let out = dst.wait().expect("the destination guest finished");
        let source_log = src_server.log_text();
        run = Some(Run {
            status,
            out,
            source_log,
        });
    });
    run.expect("ran")
}

/// The source server's figures of its outgoing stream (`outgoing migration stream closed`).
fn stream_figures(log: &str) -> (u64, u64, bool) {
    let line = log
        .lines()
        .rev()
        .find(|l| l.contains("outgoing migration stream closed") && l.contains("completed=true"))
        .unwrap_or_else(|| panic!("no completed outgoing stream in the source log:\n{log}"));
    let field = |name: &str| -> String {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {line}"))
            .to_owned()
    };
    let num = |name: &str| field(name).parse::<u64>().expect(name);
    (
        num("stop_copy_us"),
        num("pages_sent"),
        field("client_mapped") == "true",
    )
}

/// The driver's summary on the destination.
fn summary(out: &GuestOutput) -> Value {
    out.json_line("SYGPU-SUMMARY")
        .unwrap_or_else(|| panic!("no summary:\n{}", out.serial))
}

/// A 4 GiB device, 3/4 filled, mapped by the guest: QEMU migrates the BAR's memory (patch
/// 0009), the device only what it wrote. Bit-exact, no stale page; the device's stream sent a
/// few pages (its engines' writes during the soak), not the 3 GiB; its share of the downtime
/// (STOP_COPY) is printed.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn a_4g_device_with_mapped_vram_migrates_bit_exact_without_a_pass_over_vram() {
    let r = migrate_soaking(
        "migrate-mapped-4g",
        "softgpu,vram=4G,queues=2",
        &[],
        &[],
        SOAK_SECONDS_4G,
        None,
    );
    let s = summary(&r.out);
    assert_eq!(s["result"], "pass", "{s}");
    let soak = &s["soak"];
    assert_eq!(soak["ok"], true, "{s}");
    assert_eq!(soak["vram_stale_pages"], 0, "{s}");
    assert_eq!(soak["region_stale_pages"], 0, "{s}");
    let filled = soak["vram_filled_bytes"].as_u64().expect("filled");
    assert_eq!(filled, ((4u64 << 30) / 100 * 75) & !4095, "{s}");
    assert!(soak["vram_cpu_writes"].as_u64().unwrap_or(0) > 1, "{s}");
    let (stop_copy_us, pages_sent, client_mapped) = stream_figures(&r.source_log);
    assert!(client_mapped, "QEMU did not take the mapped VRAM over");
    assert!(
        pages_sent < filled / 4096 / 100,
        "the device's stream sent {pages_sent} pages: more than its engines wrote"
    );
    eprintln!(
        "mapped 4 GiB (3 GiB filled): downtime {} ms, total {} ms, source STOP_COPY {} us, \
         device pages sent {pages_sent}, RAM transferred {} bytes",
        r.status["downtime"], r.status["total-time"], stop_copy_us, r.status["ram"]["transferred"]
    );
}

/// The negative control: the source device relies on QEMU migrating the mapped VRAM
/// (`--mapped-migration assume`) while QEMU does not (`x-migrate-mapped-regions=off`): what
/// the engine filled before the migration and what the guest wrote through the mapping never
/// reach the destination, and the driver there finds stale VRAM.
#[test]
#[ignore = "boots QEMU: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn with_mapped_vram_assumed_migrated_but_not_the_guest_finds_stale_vram() {
    let r = migrate_soaking(
        "migrate-mapped-assumed",
        "softgpu,vram=256M,queues=2",
        &["--mapped-migration", "assume"],
        &["-global", "vfio-user-pci.x-migrate-mapped-regions=off"],
        SOAK_SECONDS_SMALL,
        None,
    );
    let (_, _, client_mapped) = stream_figures(&r.source_log);
    assert!(
        client_mapped,
        "the server did not act on --mapped-migration assume"
    );
    let s = summary(&r.out);
    assert_eq!(s["result"], "fail", "nothing was lost: {s}");
    let stale = s["soak"]["vram_stale_pages"].as_u64().unwrap_or(0);
    assert!(stale > 0, "the failure is not stale VRAM: {s}");
    eprintln!("mapped VRAM not migrated: {}", s["soak"]);
}
