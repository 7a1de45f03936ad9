//! `sy-nested`: the L1 half of the nested guest tests.
//!
//! It runs inside a TCG guest (L1, `-cpu EPYC`, KVM modules loaded by
//! `images/tests/nested.sh`) that plays the host: it starts `switchyard serve` and the real
//! cloud-hypervisor, boots L2 guests under KVM and drives them through cloud-hypervisor's REST
//! API (`switchyard-ch`). The L0 test (`guest-tests/harness/tests/nested_guest.rs`) reads what it
//! prints on L1's console.
//!
//! ```text
//! sy-nested [--driver-mode noiommu|probe] [--l2-verbose] [--server-log FILTER] SCENARIO...
//!   --server-log  the servers' RUST_LOG; their logs and cloud-hypervisor's are printed after each scenario
//!   ch-workload  the softgpu as a boot-time --user-device; L2 runs the in-guest driver on it
//!   ch-hotplug   add-user-device / remove-device through the REST API, twice; L2 runs the
//!                driver on each plug and sees each removal; the server and cloud-hypervisor
//!                survive every removal
//!   ch-pool      the pool daemon serves a cloud-hypervisor L2 while its worker is killed
//!                again and again: every register read in L2 still returns the right value
//!   ch-viommu    what cloud-hypervisor does with a user device on an IOMMU segment (refuses)
//!   qemu-softgpu the softgpu to an L2 under QEMU -accel kvm with a vIOMMU: the driver's
//!                full VFIO workload in L2 (MSI-X included)
//!   qemu-edu     L1's edu (VFIO) served by switchyard's passthrough backend to an L2 under
//!                QEMU; L2's sy-edu drives it through VFIO (registers, MSI, DMA)
//!   pool-edu     the pool daemon with both edus as passthrough boards: edu0 serves vm1's
//!                L2, is detached and attached to vm2 and serves vm2's L2 (whose worker is
//!                killed in QEMU's handshake, then again with L2's driver paused between its
//!                checks: reset + replay, DMA windows and MSI restored, the socket stays;
//!                the driver's checks after the pause pass), then is removed
//!                from L1 under load: no hang, the endpoint fails cleanly (device lost, board
//!                quarantined), the daemon and QEMU survive; a move is refused
//!   pool-edu-kills  (diagnosis, not in CI) one passthrough endpoint, L2 booted nine times,
//!                its worker killed at delays from 0 to 1000 ms after QEMU connected (once
//!                not at all): every boot must pass
//!   vf-probe     an igb VF created and bound by `switchyard inventory`, served by switchyard,
//!                checked from the client side (identity, config space, regions, MSI-X)
//!   irq-bench    edu's MSI to an eventfd: VFIO in L1 (floor), through switchyard with the
//!                eventfds handed to VFIO, and relayed by the server (`-quick`: 50 rounds)
//!   mmio-bench   MMIO read latency from L2: direct-assigned edu, a VMM-emulated register, the
//!                softgpu over vfio-user (`-quick`: 200 reads instead of 2000)
//! ```
//!
//! The `ch-*` and `mmio-bench` scenarios run L2s under `/usr/bin/cloud-hypervisor`, which an L1
//! image has only when the setup cache had it (optional: docs/cloud-hypervisor.md); without it
//! they fail at once, saying so. The others need only QEMU.
//!
//! Output: `NESTED: ...` progress lines, `L2[vm]: ...` for every line of an L2 serial console,
//! and one `NESTED-RESULT {json}` line per scenario (`"ok"`, timings, what L2 reported). Exit
//! code 0 only if every scenario passed.
//!
//! Why the L2 driver runs without an IOMMU: cloud-hypervisor refuses to put a vfio-user device
//! behind its virtio-iommu ("Device does not support being placed behind IOMMU"; upstream chose
//! not to pursue it, cloud-hypervisor#3024), and the Debian guest kernel has no VFIO no-IOMMU
//! mode, so L2 drives the device from user space through sysfs (`sygpu-driver --noiommu`:
//! BAR mmaps of `resourceN`, DMA into hugepages at their physical addresses, completions
//! polled).

#![forbid(unsafe_code)]

mod bench;
mod ch;
mod l2;
mod pool;
mod probe;
mod procs;
mod qemu;
mod vf;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

const SWITCHYARD: &str = "/usr/bin/switchyard";
const CLOUD_HYPERVISOR: &str = "/usr/bin/cloud-hypervisor";
const QEMU: &str = "/usr/bin/qemu";
const L2_KERNEL: &str = "/l2/vmlinux";
const L2_INITRAMFS: &str = "/l2/initramfs.cpio.gz";
const WORK: &str = "/tmp/nested";
/// The softgpu every scenario serves (defaults: 64 MiB VRAM offered for mmap, MSI-X).
const DEVICE: &str = "softgpu";
/// L2's command line before the test keys ([`switchyard_qemu::GUEST_BOOT_ARGS`] follow it).
/// Hugepages back the no-IOMMU driver's DMA memory. `sy.nomodules`: L2 needs no VFIO modules
/// (there is no IOMMU for them to use).
const L2_CMDLINE: &str = "console=ttyS0 panic=-1 quiet sy.nomodules hugepages=16";
/// Guest RAM of an L2.
const L2_MEMORY_MIB: u64 = 512;
/// Boot + workload of one L2 (TCG-speed CPU in L2, ~0.4 ms per trapped access).
const L2_TIMEOUT: Duration = Duration::from_secs(300);
/// Boot + `sy-edu` of one L2 (~25 s here; an L2 that takes this long is stuck).
const EDU_TIMEOUT: Duration = Duration::from_secs(150);

/// How L2 runs the driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DriverMode {
    /// The full workload without IOMMU (`--noiommu`).
    NoIommu,
    /// Enumeration and a BAR0 read only (`--probe`).
    Probe,
}

impl DriverMode {
    fn args(self) -> &'static [&'static str] {
        match self {
            DriverMode::NoIommu => &["--noiommu"],
            DriverMode::Probe => &["--probe"],
        }
    }

    /// The driver's last line: its JSON report.
    fn summary_prefix(self) -> &'static str {
        match self {
            DriverMode::NoIommu => "SYGPU-SUMMARY ",
            DriverMode::Probe => "SYGPU-PROBE ",
        }
    }
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// Binds every PCI function `vid:did` in L1 to vfio-pci (`/tests/vfio-bind.sh`) and returns
/// their addresses, in order.
fn bind_vfio(id: &str) -> Result<Vec<String>> {
    let out = std::process::Command::new("sh")
        .args(["/tests/vfio-bind.sh", id])
        .output()
        .context("run /tests/vfio-bind.sh")?;
    let text = String::from_utf8_lossy(&out.stdout);
    print!("{text}");
    if !out.status.success() {
        bail!("vfio-bind {id} failed: {text}");
    }
    let mut bdfs: Vec<String> = text
        .lines()
        .filter(|l| l.ends_with(" ok"))
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_owned))
        .collect();
    bdfs.sort();
    if bdfs.is_empty() {
        bail!("no {id} device in L1 (L0 must add -device edu)");
    }
    Ok(bdfs)
}

fn tail_text(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Whether `scenario` runs its L2s under cloud-hypervisor: the `ch-*` scenarios and
/// `mmio-bench` (the harness's `needs_cloud_hypervisor` says the same on the L0 side).
fn needs_cloud_hypervisor(scenario: &str) -> bool {
    scenario.starts_with("ch-") || scenario.starts_with("mmio-bench")
}

/// Fails a scenario that needs cloud-hypervisor in an L1 image without it
/// (`build-initramfs.sh --nested` from a setup cache that had none): never a pass.
fn check_cloud_hypervisor(scenario: &str, binary: &Path) -> Result<()> {
    if needs_cloud_hypervisor(scenario) && !binary.exists() {
        bail!(
            "scenario {scenario} needs cloud-hypervisor, and this L1 image has no {} (the setup \
             cache had none: set SWITCHYARD_CH_DIR and run scripts/setup.sh; see \
             docs/cloud-hypervisor.md)",
            binary.display()
        );
    }
    Ok(())
}

fn run(scenario: &str, mode: DriverMode) -> Value {
    let dir = PathBuf::from(WORK).join(scenario);
    let started = Instant::now();
    println!("NESTED: {scenario} start");
    let r = check_cloud_hypervisor(scenario, Path::new(CLOUD_HYPERVISOR))
        .and_then(|()| std::fs::create_dir_all(&dir).map_err(anyhow::Error::from))
        .and_then(|()| match scenario {
            "ch-workload" => ch::ch_workload(&dir, mode),
            "ch-hotplug" => ch::ch_hotplug(&dir, mode, 2),
            "ch-viommu" => ch::ch_viommu(&dir),
            "ch-pool" => pool::ch_pool(&dir),
            "qemu-softgpu" => qemu::qemu_softgpu(&dir),
            "qemu-edu" => qemu::qemu_edu(&dir),
            "pool-edu" => pool::pool_edu(&dir),
            "pool-edu-kills" => pool::pool_edu_kills(&dir),
            "vf-probe" => vf::vf_probe(&dir),
            "irq-bench" => bench::irq_bench(&dir, 500),
            "irq-bench-quick" => bench::irq_bench(&dir, 50),
            "mmio-bench" => bench::mmio_bench(&dir, 2000),
            "mmio-bench-quick" => bench::mmio_bench(&dir, 200),
            other => bail!("unknown scenario `{other}`"),
        });
    let mut v = match r {
        Ok(v) => v,
        Err(e) => json!({ "ok": false, "error": format!("{e:#}") }),
    };
    // Every log of the scenario when asked for, their tails when it failed.
    let verbose = procs::SERVER_LOG.get().is_some();
    if verbose || v["ok"] != json!(true) {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let p = entry.path();
            if p.extension().is_some_and(|e| e == "log") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                let shown = if verbose {
                    &text[..]
                } else {
                    tail_text(&text, 3000)
                };
                println!("NESTED: ==== {} ====\n{shown}", p.display());
            }
        }
    }
    v["scenario"] = json!(scenario);
    v["elapsed_s"] = json!(started.elapsed().as_secs_f64());
    v
}

fn main() {
    let mut mode = DriverMode::NoIommu;
    let mut scenarios = vec![];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--driver-mode" => match args.next().as_deref() {
                Some("noiommu") => mode = DriverMode::NoIommu,
                Some("probe") => mode = DriverMode::Probe,
                other => {
                    eprintln!("sy-nested: --driver-mode wants noiommu or probe, not {other:?}");
                    std::process::exit(2);
                }
            },
            "--server-log" => match args.next() {
                Some(level) => {
                    let _ = procs::SERVER_LOG.set(level);
                }
                None => {
                    eprintln!("sy-nested: --server-log wants a RUST_LOG filter");
                    std::process::exit(2);
                }
            },
            "--l2-verbose" => l2::L2_VERBOSE.store(true, std::sync::atomic::Ordering::Relaxed),
            "-h" | "--help" => {
                println!(
                    "sy-nested [--driver-mode noiommu|probe] [--l2-verbose] ch-workload|ch-hotplug|ch-viommu..."
                );
                return;
            }
            s => scenarios.push(s.to_owned()),
        }
    }
    if scenarios.is_empty() {
        eprintln!("sy-nested: no scenario given (ch-workload, ch-hotplug)");
        std::process::exit(2);
    }
    let mut all_ok = true;
    for s in &scenarios {
        let v = run(s, mode);
        all_ok &= v["ok"] == json!(true);
        println!("NESTED-RESULT {v}");
    }
    std::process::exit(if all_ok { 0 } else { 1 });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cloud_hypervisor_scenario_fails_in_an_image_without_it() {
        let none = Path::new("/nonexistent/cloud-hypervisor");
        for s in [
            "ch-workload",
            "ch-hotplug",
            "ch-viommu",
            "ch-pool",
            "mmio-bench-quick",
        ] {
            let e = check_cloud_hypervisor(s, none).expect_err(s).to_string();
            assert!(e.contains("docs/cloud-hypervisor.md"), "{e}");
        }
        for s in [
            "qemu-softgpu",
            "qemu-edu",
            "pool-edu",
            "vf-probe",
            "irq-bench",
        ] {
            check_cloud_hypervisor(s, none).expect(s);
        }
        let present = std::env::current_exe().expect("test binary");
        check_cloud_hypervisor("ch-workload", &present).expect("present");
    }
}
