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

mod probe;
mod procs;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use serde_json::{Value, json};
use switchyard_ch::{ChApi, UserDeviceConfig};
use switchyard_qemu::{Accel, QemuCommand, VfioUserDevice};

use procs::{Server, Vm, VmSpec, tail};

const SWITCHYARD: &str = "/usr/bin/switchyard";
const CLOUD_HYPERVISOR: &str = "/usr/bin/cloud-hypervisor";
const QEMU: &str = "/usr/bin/qemu";
const L2_KERNEL: &str = "/l2/vmlinux";
const L2_INITRAMFS: &str = "/l2/initramfs.cpio.gz";
const WORK: &str = "/tmp/nested";
/// The softgpu every scenario serves (defaults: 64 MiB VRAM offered for mmap, MSI-X).
const DEVICE: &str = "softgpu";
/// L2's command line before the test keys. Hugepages back the no-IOMMU driver's DMA memory.
/// `sy.nomodules`: L2 needs no VFIO modules (there is no IOMMU for them to use).
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

/// Set by `--l2-verbose`: L2 boots without `quiet` (kernel messages with timestamps).
static L2_VERBOSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn l2_cmdline(test: &str, args: &[&str]) -> String {
    let mut c = format!("{L2_CMDLINE} sy.test={test}");
    if L2_VERBOSE.load(std::sync::atomic::Ordering::Relaxed) {
        c = c.replace(" quiet", "");
    }
    for a in args {
        c.push_str(" sy.arg=");
        c.push_str(a);
    }
    c
}

fn l2_spec(name: &str, cmdline: String) -> VmSpec<'_> {
    VmSpec {
        name,
        binary: Path::new(CLOUD_HYPERVISOR),
        kernel: Path::new(L2_KERNEL),
        initramfs: Path::new(L2_INITRAMFS),
        cmdline,
        memory_mib: L2_MEMORY_MIB,
        user_devices: vec![],
        api_socket: None,
        vfio_devices: vec![],
        extra_args: vec![],
    }
}

fn json_after(line: &str, prefix: &str) -> Result<Value> {
    let j = line
        .strip_prefix(prefix)
        .with_context(|| format!("`{line}` does not start with `{prefix}`"))?;
    serde_json::from_str(j.trim()).with_context(|| format!("bad JSON after `{prefix}`"))
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

/// The softgpu as a boot-time `--user-device`; L2 runs the driver on it and powers off.
fn ch_workload(dir: &Path, mode: DriverMode) -> Result<Value> {
    let mut server = Server::start(Path::new(SWITCHYARD), dir, "gpu-boot", DEVICE)?;
    let mut args = vec![];
    args.extend_from_slice(mode.args());
    if mode == DriverMode::NoIommu {
        // Submissions through the doorbell page cloud-hypervisor maps from BAR0's sparse area.
        args.extend_from_slice(&["--doorbell", "mapped"]);
    }
    let mut spec = l2_spec("boot", l2_cmdline("sygpu-driver", &args));
    spec.user_devices = vec![UserDeviceConfig::new(&server.socket).id("gpu0")];
    let mut vm = Vm::start(dir, spec)?;
    let booted = vm.wait_line("GUEST: boot", L2_TIMEOUT)?;
    let boot_s = vm.started.elapsed().as_secs_f64();
    let rc_line = vm.wait_line("GUEST: test sygpu-driver rc=", L2_TIMEOUT)?;
    let listed = vm
        .lines()
        .iter()
        .any(|l| l.starts_with("GUEST: pci ") && l.contains("vendor=0x1234 device=0x5347"));
    let rc: i32 = rc_line
        .rsplit('=')
        .next()
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("bad rc line `{rc_line}`"))?;
    let summary = match vm.find_line(mode.summary_prefix()) {
        Some(l) => json_after(&l, mode.summary_prefix())?,
        None => Value::Null,
    };
    let status = vm.wait_exit(Duration::from_secs(60))?;
    let total_s = vm.started.elapsed().as_secs_f64();
    let server_alive = server.alive();
    let log = server.log_text();
    let server_status = server.stop();
    let ok = rc == 0 && status.success() && server_alive && listed && !summary.is_null();
    if !ok {
        println!("NESTED: server log tail:\n{}", tail_text(&log, 3000));
        println!(
            "NESTED: cloud-hypervisor log tail:\n{}",
            tail(&vm.log, 3000)
        );
    }
    Ok(json!({
        "ok": ok,
        "boot_line": booted,
        "device_listed_in_l2": listed,
        "l2_boot_s": boot_s,
        "l2_total_s": total_s,
        "driver_rc": rc,
        "driver_summary": summary,
        "ch_exit": status.code(),
        "server_alive_after_vm": server_alive,
        "server_exit": server_status.and_then(|s| s.code()),
    }))
}

/// Hot-add and removal through the REST API, `rounds` times.
fn ch_hotplug(dir: &Path, mode: DriverMode, rounds: u32) -> Result<Value> {
    let mut server = Server::start(Path::new(SWITCHYARD), dir, "gpu-hot", DEVICE)?;
    let api_socket = dir.join("ch-api.sock");
    let rounds_s = rounds.to_string();
    let mut args = vec!["1234:5347", rounds_s.as_str()];
    args.extend_from_slice(mode.args());
    let mut spec = l2_spec("hot", l2_cmdline("hotplug", &args));
    spec.api_socket = Some(api_socket.clone());
    let mut vm = Vm::start(dir, spec)?;
    let api = ChApi::new(&api_socket).with_timeout(Duration::from_secs(30));
    let ping = api
        .wait_ready(Duration::from_secs(30))
        .context("cloud-hypervisor REST API")?;
    let mut done = vec![];
    for round in 1..=rounds {
        vm.wait_line(&format!("HOTPLUG: waiting round={round}"), L2_TIMEOUT)?;
        let t = Instant::now();
        let info = api
            .add_user_device(&UserDeviceConfig::new(&server.socket).id("gpu0"))
            .with_context(|| format!("add-user-device, round {round}"))?;
        let add_ms = ms(t.elapsed());
        let present = vm.wait_line(&format!("HOTPLUG: present round={round}"), L2_TIMEOUT)?;
        let seen_ms = ms(t.elapsed());
        let run = vm.wait_line(&format!("HOTPLUG: run round={round} rc="), L2_TIMEOUT)?;
        let rc: i32 = run
            .rsplit('=')
            .next()
            .and_then(|v| v.trim().parse().ok())
            .with_context(|| format!("bad line `{run}`"))?;
        if rc != 0 {
            bail!("the driver failed in L2 on round {round} (rc {rc})");
        }
        let t = Instant::now();
        api.remove_device("gpu0")
            .with_context(|| format!("remove-device, round {round}"))?;
        vm.wait_line(&format!("HOTPLUG: gone round={round}"), L2_TIMEOUT)?;
        let gone_ms = ms(t.elapsed());
        // The VMM lets go of the socket: the server sees its client leave and serves the next.
        let server_alive = server.alive();
        let vm_alive = vm.alive();
        println!(
            "NESTED: round {round}: bdf {} (ch) / `{present}` (L2); add {add_ms} ms, in L2 after {seen_ms} ms; removed in {gone_ms} ms; server alive {server_alive}, ch alive {vm_alive}",
            info.bdf
        );
        if !server_alive || !vm_alive {
            bail!(
                "after removal {round}: server alive {server_alive}, cloud-hypervisor alive {vm_alive}"
            );
        }
        done.push(json!({
            "round": round, "bdf": info.bdf, "add_ms": add_ms, "seen_in_l2_ms": seen_ms,
            "remove_ms": gone_ms, "driver_rc": rc,
        }));
    }
    vm.wait_line("HOTPLUG: done", L2_TIMEOUT)?;
    let status = vm.wait_exit(Duration::from_secs(60))?;
    let log = server.log_text();
    let server_alive = server.alive();
    let server_status = server.stop();
    let ok = status.success() && server_alive;
    if !ok {
        println!("NESTED: server log tail:\n{}", tail_text(&log, 3000));
    }
    Ok(json!({
        "ok": ok,
        "ch_version": ping.version,
        "rounds": done,
        "ch_exit": status.code(),
        "server_alive_after_vm": server_alive,
        "server_exit": server_status.and_then(|s| s.code()),
    }))
}

/// What cloud-hypervisor does with a vfio-user device on a PCI segment behind its
/// virtio-iommu: it refuses the configuration (checked here so the day it changes, the L2
/// driver can switch to VFIO behind the vIOMMU).
fn ch_viommu(dir: &Path) -> Result<Value> {
    let server = Server::start(Path::new(SWITCHYARD), dir, "gpu-viommu", DEVICE)?;
    let mut spec = l2_spec("viommu", l2_cmdline("vfio-bind", &["1234:5347"]));
    spec.user_devices = vec![
        UserDeviceConfig::new(&server.socket)
            .id("gpu0")
            .pci_segment(1),
    ];
    spec.extra_args = vec![
        "--platform".into(),
        "num_pci_segments=2,iommu_segments=[1]".into(),
    ];
    let mut vm = Vm::start(dir, spec)?;
    let status = vm.wait_exit(L2_TIMEOUT)?;
    let log = std::fs::read_to_string(&vm.log).unwrap_or_default();
    let reason = log
        .lines()
        .find(|l| l.contains("IOMMU") || l.contains("iommu"))
        .map(str::to_owned);
    let l2_booted = vm.find_line("GUEST: boot").is_some();
    let bound = vm
        .lines()
        .iter()
        .any(|l| l.starts_with("GUEST: vfio-bind") && l.ends_with(" ok"));
    Ok(json!({
        "ok": true,
        "refused": !status.success() && !l2_booted,
        "ch_exit": status.code(),
        "reason": reason,
        "l2_booted": l2_booted,
        "l2_vfio_bound": bound,
    }))
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

/// AF_UNIX ping-pong in L1 between two threads (one byte each way, blocking): the floor under
/// any vfio-user round trip in L1, measured in the same run. Per-round-trip p50 and mean, ns.
fn l1_socket_floor(rounds: u32) -> Result<Value> {
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;
    let (mut a, mut b) = UnixStream::pair()?;
    let echo = std::thread::spawn(move || -> std::io::Result<()> {
        let mut buf = [0u8; 1];
        loop {
            if b.read(&mut buf)? == 0 {
                return Ok(());
            }
            b.write_all(&buf)?;
        }
    });
    let mut each = Vec::with_capacity(rounds as usize);
    let mut buf = [0u8; 1];
    for i in 0..rounds + 50 {
        let t = Instant::now();
        a.write_all(&[1])?;
        a.read_exact(&mut buf)?;
        if i >= 50 {
            each.push(t.elapsed().as_nanos() as f64);
        }
    }
    drop(a);
    echo.join()
        .map_err(|_| anyhow::anyhow!("echo thread panicked"))??;
    each.sort_by(f64::total_cmp);
    let mean = each.iter().sum::<f64>() / each.len() as f64;
    Ok(json!({ "p50": each[each.len() / 2], "mean": mean, "rounds": rounds }))
}

/// MMIO reads from L2 user space through each path a register can take: a device assigned
/// directly (edu through VFIO in L1: no exit), a device cloud-hypervisor emulates (its
/// virtio-rng: an exit to the VMM), and the softgpu's trapped BAR0 over vfio-user (an exit,
/// then the socket to switchyard). Needs L0 to give L1 an `edu` and `intel-iommu,intremap=on`.
fn mmio_bench(dir: &Path, count: u32) -> Result<Value> {
    let edus = bind_vfio("1234:11e8")?;
    let server = Server::start(Path::new(SWITCHYARD), dir, "gpu-bench", DEVICE)?;
    let count_s = count.to_string();
    let targets = [
        "direct=1234:11e8:0:0:0",
        "vmm-emulated=1af4:1044:0:0:0",
        "vfio-user-trapped=1234:5347:0:0:0",
    ];
    let mut args = vec!["--count", count_s.as_str()];
    args.extend_from_slice(&targets);
    let mut spec = l2_spec(
        "bench",
        l2_cmdline("mmio-bench", &args).replace(" quiet", " quiet iomem=relaxed"),
    );
    spec.user_devices = vec![UserDeviceConfig::new(&server.socket).id("gpu0")];
    spec.vfio_devices = vec![PathBuf::from(format!("/sys/bus/pci/devices/{}/", edus[0]))];
    let mut vm = Vm::start(dir, spec)?;
    let rc_line = vm.wait_line("GUEST: test mmio-bench rc=", L2_TIMEOUT)?;
    let status = vm.wait_exit(Duration::from_secs(60))?;
    let mut rows = serde_json::Map::new();
    for l in vm.lines() {
        if let Some(j) = l.trim().strip_prefix("SY-MMIO ") {
            let v: Value = serde_json::from_str(j).context("SY-MMIO JSON")?;
            let label = v["label"].as_str().unwrap_or("?").to_owned();
            rows.insert(label, v);
        }
    }
    let p50 = |k: &str| rows.get(k).and_then(|v| v["read_ns"]["p50"].as_f64());
    let ratio = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => json!(a / b),
        _ => Value::Null,
    };
    let ok = rc_line.ends_with("rc=0") && status.success() && rows.len() == targets.len();
    let floor = l1_socket_floor(count)?;
    Ok(json!({
        "ok": ok,
        "count": count,
        "rows": rows,
        "l1_socket_rtt_ns": floor,
        "trapped_vs_direct_p50": ratio(p50("vfio-user-trapped"), p50("direct")),
        "trapped_vs_vmm_exit_p50": ratio(p50("vfio-user-trapped"), p50("vmm-emulated")),
        "ch_exit": status.code(),
    }))
}

/// An L2 under QEMU (`-accel kvm`, in L1) with a vIOMMU (`intel-iommu`), so L2's user-space
/// drivers use VFIO like on the single-level guests; the vfio-user device is at `socket`.
fn qemu_l2(dir: &Path, name: &str, socket: &Path, test: &str, args: &[&str]) -> Result<Vm> {
    // `nox2apic`: an L2 in x2APIC mode (its vIOMMU remaps interrupts) hit faults of L0's SVM
    // emulation in most L1 boots (kernels crashing in their page fault handler, an L2 spinning
    // with interrupts off); with the xAPIC, L2s have not (guest-tests/harness/src/nested.rs).
    let mut append = String::from("console=ttyS0 panic=-1 quiet intel_iommu=on nox2apic");
    if L2_VERBOSE.load(std::sync::atomic::Ordering::Relaxed) {
        append = append.replace(" quiet", "");
    }
    append.push_str(&format!(" sy.test={test}"));
    for a in args {
        append.push_str(&format!(" sy.arg={a}"));
    }
    let cmd = QemuCommand::new(QEMU)
        .accel(Accel::Kvm)
        .cpu("host")
        .memory_mib(L2_MEMORY_MIB)
        .kernel(L2_KERNEL)
        .initrd(L2_INITRAMFS)
        .append(append)
        .intel_iommu(true)
        // A physical device's server pins all of L2's RAM for the IOMMU in the first DMA_MAP:
        // seconds at TCG speed, past QEMU's 5 s default reply timeout.
        .vfio_user_device(VfioUserDevice::new("dev0", socket).msg_timeout_ms(60_000));
    Vm::start_qemu(dir, name, cmd)
}

/// Waits for an L2 test's rc line and its JSON summary line, then for the VMM to exit.
fn l2_outcome(vm: &mut Vm, test: &str, summary: &str) -> Result<(i32, Value, Option<i32>)> {
    let timeout = if test == "sy-edu" {
        EDU_TIMEOUT
    } else {
        L2_TIMEOUT
    };
    let rc_line = vm.wait_line(&format!("GUEST: test {test} rc="), timeout)?;
    let rc: i32 = rc_line
        .rsplit('=')
        .next()
        .and_then(|v| v.trim().parse().ok())
        .with_context(|| format!("bad rc line `{rc_line}`"))?;
    let s = match vm.find_line(summary) {
        Some(l) => json_after(&l, summary)?,
        None => Value::Null,
    };
    let status = vm.wait_exit(Duration::from_secs(60))?;
    Ok((rc, s, status.code()))
}

/// The softgpu served in L1 to an L2 under QEMU with KVM and a vIOMMU: the in-guest driver's
/// full VFIO workload (DMA through L2's IOMMU, MSI-X, VRAM through the mapped BAR).
fn qemu_softgpu(dir: &Path) -> Result<Value> {
    let mut server = Server::start(Path::new(SWITCHYARD), dir, "gpu-qemu", DEVICE)?;
    let mut vm = qemu_l2(
        dir,
        "qemu",
        &server.socket.clone(),
        "sygpu-driver",
        &["--quick"],
    )?;
    let (rc, summary, exit) = l2_outcome(&mut vm, "sygpu-driver", "SYGPU-SUMMARY ")?;
    let server_alive = server.alive();
    let log = server.log_text();
    let ok = rc == 0 && exit == Some(0) && server_alive && summary["result"] == "pass";
    if !ok {
        println!("NESTED: server log tail:\n{}", tail_text(&log, 3000));
        println!("NESTED: QEMU log tail:\n{}", tail(&vm.log, 3000));
    }
    Ok(json!({
        "ok": ok, "driver_rc": rc, "driver_summary": summary, "qemu_exit": exit,
        "server_alive_after_vm": server_alive, "l2_total_s": vm.started.elapsed().as_secs_f64(),
    }))
}

/// QEMU's edu, owned by L1 through VFIO and served by switchyard's passthrough backend to an L2
/// under QEMU: L2's `sy-edu` drives it through VFIO in L2 (registers, factorial, MSI through
/// the eventfds switchyard hands to VFIO, DMA into L2 memory both ways).
fn qemu_edu(dir: &Path) -> Result<Value> {
    let edus = bind_vfio("1234:11e8")?;
    let bdf = edus.last().context("no edu")?.clone();
    let device = format!("vfio,host={bdf}");
    let mut server = Server::start(Path::new(SWITCHYARD), dir, "edu-qemu", &device)?;
    let mut vm = qemu_l2(dir, "qemu-edu", &server.socket.clone(), "sy-edu", &[])?;
    let (rc, summary, exit) = l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ")?;
    let server_alive = server.alive();
    let log = server.log_text();
    let ok = rc == 0 && exit == Some(0) && server_alive && summary["result"] == "pass";
    if !ok {
        println!("NESTED: server log tail:\n{}", tail_text(&log, 3000));
        println!("NESTED: QEMU log tail:\n{}", tail(&vm.log, 3000));
    }
    // What QEMU said about the device (refused DMA maps show up here).
    let qemu_log = std::fs::read_to_string(&vm.log).unwrap_or_default();
    let qemu_errors: Vec<&str> = qemu_log
        .lines()
        .filter(|l| l.contains("error") || l.contains("warning"))
        .take(8)
        .collect();
    Ok(json!({
        "ok": ok, "host_bdf": bdf, "edu_rc": rc, "edu_summary": summary, "qemu_exit": exit,
        "server_alive_after_vm": server_alive, "qemu_messages": qemu_errors,
    }))
}

/// Removes PCI function `bdf` from L1 (`echo 1 > .../remove`) on a thread of its own and
/// waits up to 60 s: "completed", "failed: ..." or "hung ...", the time it took, and whether
/// the function is gone from sysfs.
fn remove_device(bdf: &str) -> (String, f64, bool) {
    let remove = PathBuf::from(format!("/sys/bus/pci/devices/{bdf}/remove"));
    let (tx, rx) = std::sync::mpsc::channel();
    let t = Instant::now();
    std::thread::spawn(move || {
        let r = std::fs::write(&remove, "1");
        let _ = tx.send(r);
    });
    let removed = rx.recv_timeout(Duration::from_secs(60));
    let remove_ms = ms(t.elapsed());
    let removal = match &removed {
        Ok(Ok(())) => "completed".to_owned(),
        Ok(Err(e)) => format!("failed: {e}"),
        Err(_) => "hung (still blocked after 60 s)".to_owned(),
    };
    println!("NESTED: removal of {bdf} {removal} after {remove_ms} ms");
    let gone = !Path::new(&format!("/sys/bus/pci/devices/{bdf}")).exists();
    (removal, remove_ms, gone)
}

/// The pool daemon in L1 with both edus as passthrough boards (one pool): the board view
/// names them and their dirty-tracking source; an endpoint's L2 (QEMU/KVM) drives its edu, the
/// endpoint is detached and the same edu attached to a second endpoint, whose L2 drives it
/// too; then the edu is removed from L1 while that L2 keeps it busy: the removal completes,
/// L2's driver sees the device lost, QEMU exits normally, the daemon reports the endpoint's
/// device lost and quarantines the board, and a move of a passthrough endpoint is refused.
fn pool_edu(dir: &Path) -> Result<Value> {
    let edus = bind_vfio("1234:11e8")?;
    let [a, b] = [edus.first(), edus.get(1)].map(|e| e.cloned());
    let (Some(a), Some(b)) = (a, b) else {
        bail!("two edus are needed, L1 has {edus:?}");
    };
    let config = dir.join("pool.toml");
    std::fs::write(
        &config,
        format!(
            "[[boards]]\nid = \"edu0\"\nmodel = \"vfio\"\nhost = \"{a}\"\n\n\
             [[boards]]\nid = \"edu1\"\nmodel = \"vfio\"\nhost = \"{b}\"\n\n\
             [[pools]]\nname = \"edus\"\nboards = [\"edu0\", \"edu1\"]\n"
        ),
    )?;
    let mut daemon = Daemon::start(dir, Some(&config))?;
    let r = pool_edu_with(dir, &mut daemon, [a, b]);
    if r.is_err() {
        println!("NESTED: daemon log tail:\n{}", tail(&daemon.log, 6000));
    }
    r
}

fn pool_edu_with(dir: &Path, daemon: &mut Daemon, [a, b]: [String; 2]) -> Result<Value> {
    let control = daemon.control.clone();
    let boards = ctl(&control, &["boards"])?;
    let vm1 = ctl(&control, &["create", "vm1", "--pool", "edus"])?;
    let vm2 = ctl(&control, &["create", "vm2", "--pool", "edus"])?;
    let socket = |v: &Value| -> Result<PathBuf> {
        Ok(PathBuf::from(
            v["endpoint"]["socket"]
                .as_str()
                .context("the endpoint's socket")?,
        ))
    };
    let (sock1, sock2) = (socket(&vm1)?, socket(&vm2)?);
    let run_edu = |name: &str, socket: &Path| -> Result<(i32, Value, Option<i32>)> {
        let mut vm = qemu_l2(dir, name, socket, "sy-edu", &[])?;
        l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ")
    };
    // The worker lets go of a client after QEMU exits (unpinning its DMA windows takes a
    // while under TCG); detach waits for nobody.
    let disconnected = |id: &str| {
        procs::wait_for(Duration::from_secs(60), "the VMM disconnected", || {
            let st = ctl(&control, &["endpoint", id])?;
            Ok((st["worker"]["connected"] == false).then_some(()))
        })
    };
    // The first VM uses edu0 and powers off.
    let first = run_edu("vm1-edu0", &sock1)?;
    disconnected("vm1")?;
    let refused_move = ctl(&control, &["move", "vm1", "--to", "edu1"]).err();
    // edu0 goes from vm1 to vm2.
    ctl(&control, &["detach", "vm1"])?;
    ctl(&control, &["detach", "vm2"])?;
    let attached = ctl(&control, &["attach", "vm2", "--device", "edu0"])?;
    // vm2's worker is killed once QEMU is connected (before L2's driver runs): the
    // replacement resets edu0, replays the configuration, maps L2's memory again and
    // continues QEMU's connection; L2 boots on and its driver passes.
    let mut vm = qemu_l2(dir, "vm2-edu0", &sock2, "sy-edu", &["--pause", "8"])?;
    let worker = || -> Result<Option<u64>> {
        let st = ctl(&control, &["endpoint", "vm2"])?;
        let w = &st["worker"];
        Ok((w["connected"] == true)
            .then(|| w["pid"].as_u64())
            .flatten())
    };
    let kill = |pid: u64| {
        std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
    };
    let victim = procs::wait_for(Duration::from_secs(120), "vm2's VMM connected", worker)?;
    kill(victim)?;
    println!("NESTED: killed vm2's worker {victim} with QEMU connected");
    // And again once L2's driver has its DMA windows and MSI set up: the replacement maps
    // the windows from custody into a new IOMMU container and hands the MSI eventfd to VFIO;
    // the driver's checks after its pause go through them.
    vm.wait_line("SY-EDU: pause", EDU_TIMEOUT)?;
    let victim2 = procs::wait_for(Duration::from_secs(20), "vm2's replacement worker", worker)?;
    kill(victim2)?;
    let before_resume = vm.find_line("SY-EDU: resumed").is_none();
    println!(
        "NESTED: killed vm2's worker {victim2} while L2's driver paused (before it resumed: {before_resume})"
    );
    let second = l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ")?;
    let resumed_with = last_resume(&daemon.log);
    let after_kill = ctl(&control, &["endpoint", "vm2"])?["worker"].clone();
    disconnected("vm2")?;
    // vm2's next boot keeps edu0 busy while it is removed from L1.
    let mut vm = qemu_l2(dir, "vm2-remove", &sock2, "sy-edu", &["--loop", "600"])?;
    vm.wait_line("SY-EDU: loop rounds=", EDU_TIMEOUT)?;
    println!("NESTED: L2 keeps {a} (edu0) busy; removing it from L1");
    let (removal, remove_ms, gone) = remove_device(&a);
    let third = l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ")?;
    let lost = procs::wait_for(Duration::from_secs(20), "the board quarantined", || {
        let boards = ctl(&control, &["boards"])?;
        let quarantined = boards
            .as_array()
            .into_iter()
            .flatten()
            .any(|b| b["id"] == "edu0" && b["state"] == "quarantined");
        Ok(quarantined.then_some(boards))
    });
    let ep = ctl(&control, &["endpoint", "vm2"])?;
    let daemon_alive = daemon.alive();
    let pass =
        |r: &(i32, Value, Option<i32>)| r.0 == 0 && r.1["result"] == "pass" && r.2 == Some(0);
    let ok = pass(&first)
        && pass(&second)
        && second.1["after_pause_ok"] == true
        && before_resume
        && resumed_with["windows"].as_u64().is_some_and(|n| n > 0)
        && resumed_with["vectors"].as_u64().is_some_and(|n| n > 0)
        && refused_move.is_some()
        && attached["lease"]["id"] == "edu0"
        && after_kill["restarts"] == 2
        && removal == "completed"
        && gone
        && third.0 == 3
        && third.1["result"] == "device-lost"
        && third.2 == Some(0)
        && lost.is_ok()
        && ep["worker"]["device_lost"].is_string()
        && daemon_alive;
    if !ok {
        println!("NESTED: daemon log tail:\n{}", tail(&daemon.log, 6000));
    }
    let view = |r: &(i32, Value, Option<i32>)| json!({"rc": r.0, "summary": r.1, "qemu_exit": r.2});
    Ok(json!({
        "ok": ok, "hosts": [a, b], "boards": boards,
        "vm1_edu0": view(&first), "vm2_edu0": view(&second),
        "killed_workers": [victim, victim2], "vm2_worker_after_kill": after_kill,
        "second_kill_before_resume": before_resume, "resumed_with": resumed_with,
        "move_refused": refused_move.map(|e| format!("{e:#}")),
        "attached": attached["lease"],
        "removal": removal, "remove_ms": remove_ms, "device_gone_from_l1": gone,
        "vm2_remove": view(&third),
        "boards_after": lost.unwrap_or(Value::Null), "vm2_worker": ep["worker"],
        "daemon_alive": daemon_alive,
    }))
}

/// What the last passthrough replacement in a daemon log resumed with: `{"windows": n,
/// "vectors": n}` from its "worker resumed the connection" line (null when none).
fn last_resume(log: &Path) -> Value {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let Some(line) = text
        .lines()
        .rev()
        .find(|l| l.contains("worker resumed the connection (passthrough"))
    else {
        return Value::Null;
    };
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse::<u64>().ok())
    };
    json!({"windows": field("windows="), "vectors": field("vectors=")})
}

/// A stress form of `pool-edu`'s kill, for diagnosis: one passthrough endpoint whose L2 boots
/// nine times, its worker killed at a range of delays after QEMU connected (once not at
/// all); every boot must pass. Stops at the first failure, with the daemon's log.
fn pool_edu_kills(dir: &Path) -> Result<Value> {
    let edus = bind_vfio("1234:11e8")?;
    let a = edus.first().cloned().context("an edu")?;
    let config = dir.join("pool.toml");
    std::fs::write(
        &config,
        format!(
            "[[boards]]\nid = \"edu0\"\nmodel = \"vfio\"\nhost = \"{a}\"\n\n\
             [[pools]]\nname = \"edus\"\nboards = [\"edu0\"]\n"
        ),
    )?;
    let daemon = Daemon::start(dir, Some(&config))?;
    let control = daemon.control.clone();
    let vm = ctl(&control, &["create", "vm", "--pool", "edus"])?;
    let socket = PathBuf::from(vm["endpoint"]["socket"].as_str().context("socket")?);
    let delays = [
        Some(0),
        Some(0),
        Some(50),
        Some(150),
        Some(400),
        None,
        Some(0),
        Some(1000),
        Some(0),
    ];
    let mut rounds = vec![];
    let mut ok = true;
    for (i, delay) in delays.iter().enumerate() {
        let name = format!("vm-{i}");
        let t = Instant::now();
        let mut vm = qemu_l2(dir, &name, &socket, "sy-edu", &[])?;
        let victim = procs::wait_for(Duration::from_secs(120), "the VMM connected", || {
            let st = ctl(&control, &["endpoint", "vm"])?;
            let w = &st["worker"];
            Ok((w["connected"] == true)
                .then(|| w["pid"].as_u64())
                .flatten())
        })?;
        let connected_ms = t.elapsed().as_millis();
        if let Some(d) = delay {
            std::thread::sleep(Duration::from_millis(*d));
            std::process::Command::new("kill")
                .args(["-KILL", &victim.to_string()])
                .status()?;
        }
        println!("NESTED: round {i}: connected after {connected_ms} ms, kill after {delay:?} ms");
        let r = l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ");
        let pass = matches!(&r, Ok((0, s, Some(0))) if s["result"] == "pass");
        println!("NESTED: round {i}: pass={pass} in {:?}: {r:?}", t.elapsed());
        if !pass {
            ok = false;
            println!("NESTED: daemon log tail:\n{}", tail(&daemon.log, 20000));
            println!("NESTED: qemu log:\n{}", tail(&vm.log, 4000));
        }
        drop(vm);
        let _ = procs::wait_for(Duration::from_secs(60), "the VMM disconnected", || {
            let st = ctl(&control, &["endpoint", "vm"])?;
            Ok((st["worker"]["connected"] == false).then_some(()))
        });
        rounds.push(json!({"delay_ms": delay, "pass": pass, "connected_ms": connected_ms as u64}));
        if !pass {
            break;
        }
    }
    Ok(json!({"ok": ok, "rounds": rounds}))
}

/// A pool daemon in L1 (`switchyard daemon`, its log in `dir/daemon.log`); stopped (SIGTERM)
/// when dropped.
struct Daemon {
    child: std::process::Child,
    control: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Starts it with `config` (or the embedded default pool) and waits for its control API.
    fn start(dir: &Path, config: Option<&Path>) -> Result<Daemon> {
        let log = dir.join("daemon.log");
        let out = std::fs::File::create(&log)?;
        let mut cmd = std::process::Command::new(SWITCHYARD);
        cmd.arg("daemon");
        if let Some(c) = config {
            cmd.arg("--config").arg(c);
        }
        let child = cmd
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--run-dir")
            .arg(dir.join("run"))
            .env(
                "RUST_LOG",
                procs::SERVER_LOG.get().map_or("info", String::as_str),
            )
            .env("SWITCHYARD_WORKER_EXE", SWITCHYARD)
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("start switchyard daemon")?;
        let daemon = Daemon {
            child,
            control: dir.join("run/control.sock"),
            log,
        };
        procs::wait_for(
            Duration::from_secs(60),
            "the daemon's control socket",
            || Ok(ctl(&daemon.control, &["pools"]).is_ok().then_some(())),
        )?;
        Ok(daemon)
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

/// `switchyard ctl --socket SOCKET --json ARGS...`, parsed.
fn ctl(socket: &Path, args: &[&str]) -> Result<Value> {
    let out = std::process::Command::new(SWITCHYARD)
        .arg("ctl")
        .arg("--socket")
        .arg(socket)
        .arg("--json")
        .args(args)
        .output()
        .context("run switchyard ctl")?;
    if !out.status.success() {
        bail!(
            "switchyard ctl {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("ctl JSON")
}

/// The pool daemon in L1 serves a cloud-hypervisor L2 whose user space reads a softgpu register
/// thousands of times while the endpoint's worker is killed (SIGKILL) again and again: every
/// read returns the register's value (the VMM's socket never drops; the replacement worker
/// serves the same connection) and cloud-hypervisor notices nothing.
fn ch_pool(dir: &Path) -> Result<Value> {
    let daemon = Daemon::start(dir, None)?;
    let control = daemon.control.clone();
    let log_path = daemon.log.clone();
    let r = (|| -> Result<Value> {
        let created = ctl(&control, &["create", "vm1", "--pool", "default"])?;
        let socket = created["endpoint"]["socket"]
            .as_str()
            .context("the endpoint's socket")?
            .to_owned();
        // Twice this many reads (timed one by one, then as a batch): ~10 s at ~1 ms each.
        let reads = "4000";
        let args = [
            "--id",
            "1234:5347",
            "--count",
            reads,
            "--expect",
            "0x50475953",
            "--label",
            "pool",
        ];
        let mut spec = l2_spec("pool", l2_cmdline("sy-mmio", &args));
        spec.user_devices = vec![UserDeviceConfig::new(&socket).id("gpu0")];
        let mut vm = Vm::start(dir, spec)?;
        vm.wait_line("GUEST: test sy-mmio start", L2_TIMEOUT)?;
        let mut kills = 0u32;
        let mut last_pid = None;
        while kills < 3 && vm.find_line("SY-MMIO ").is_none() {
            std::thread::sleep(Duration::from_millis(1000));
            let st = ctl(&control, &["endpoint", "vm1"])?;
            let w = &st["worker"];
            let pid = w["pid"].as_u64();
            // Kill only a worker that serves (the previous replacement is ready).
            if w["ready"].as_u64() > Some(u64::from(kills)) && pid.is_some() && pid != last_pid {
                let pid = pid.unwrap_or_default().to_string();
                std::process::Command::new("kill")
                    .args(["-KILL", &pid])
                    .status()?;
                println!("NESTED: killed worker {pid} (kill {})", kills + 1);
                kills += 1;
                last_pid = st["worker"]["pid"].as_u64();
            }
        }
        let (rc, summary, exit) = l2_outcome(&mut vm, "sy-mmio", "SY-MMIO ")?;
        let st = ctl(&control, &["endpoint", "vm1"])?;
        let ok = rc == 0
            && exit == Some(0)
            && kills >= 2
            && summary["mismatches"] == 0
            && st["worker"]["restarts"].as_u64() >= Some(u64::from(kills));
        if !ok {
            println!("NESTED: daemon log tail:\n{}", tail(&log_path, 4000));
        }
        Ok(json!({
            "ok": ok, "kills": kills, "reads": summary["count"], "mismatches": summary["mismatches"],
            "read_ns": summary["read_ns"], "sy_mmio_rc": rc, "ch_exit": exit,
            "worker": st["worker"],
        }))
    })();
    drop(daemon);
    r
}

/// `switchyard inventory ARGS... --json`, parsed.
fn inventory(args: &[&str]) -> Result<Value> {
    let out = std::process::Command::new(SWITCHYARD)
        .arg("inventory")
        .args(args)
        .arg("--json")
        .output()
        .context("run switchyard inventory")?;
    if !out.status.success() {
        bail!(
            "switchyard inventory {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("inventory JSON")
}

/// SR-IOV: the inventory finds the igb PF L0 gave L1, creates two VFs and binds one to vfio-pci;
/// switchyard serves that VF and a client (our library, standing in for the VMM) checks what a
/// VMM would see: identity, config space, BAR sizing, regions, MSI-X.
fn vf_probe(dir: &Path) -> Result<Value> {
    let before = inventory(&[])?;
    let pf = before["devices"]
        .as_array()
        .and_then(|d| {
            d.iter()
                .find(|d| d["sriov_totalvfs"].as_u64().is_some_and(|n| n > 0))
        })
        .context("no SR-IOV physical function in L1 (L0 must add an igb on a root port)")?
        .clone();
    let pf_bdf = pf["bdf"].as_str().context("PF address")?.to_owned();
    let created = inventory(&["create-vfs", &pf_bdf, "2"])?;
    let vfs: Vec<String> = created["vfs"]
        .as_array()
        .context("created VFs")?
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    let vf = vfs.first().context("no VF created")?.clone();
    let bound = inventory(&["bind", &vf])?;
    let server = Server::start(Path::new(SWITCHYARD), dir, "vf", &format!("vfio,host={vf}"))?;
    let seen = probe::probe(&server.socket)?;
    let after = inventory(&[])?;
    let vf_entry = after["devices"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["bdf"] == vf.as_str()))
        .cloned()
        .unwrap_or(Value::Null);
    let ok = seen["vendor"] == vf_entry["vendor"]
        && seen["device"] == vf_entry["device"]
        && seen["msix_routed"].as_u64().is_some_and(|n| n > 0)
        && vf_entry["driver"] == "vfio-pci";
    Ok(json!({
        "ok": ok, "pf": pf, "vfs": vfs, "vf": vf_entry, "bind": bound, "client_view": seen,
    }))
}

/// p50/p90/max of a set of durations, in µs.
fn stats_us(mut v: Vec<f64>) -> Value {
    if v.is_empty() {
        return Value::Null;
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((v.len() - 1) as f64 * p).round() as usize];
    json!({ "p50": at(0.5), "p90": at(0.9), "max": v[v.len() - 1], "n": v.len() })
}

/// Waits until a non-blocking eventfd is signalled (spinning on `read`), up to 5 s.
fn wait_eventfd(fd: &std::fs::File) -> Result<()> {
    use std::io::Read;
    let t = Instant::now();
    let mut buf = [0u8; 8];
    loop {
        match (&*fd).read(&mut buf) {
            Ok(_) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                ensure!(
                    t.elapsed() < Duration::from_secs(5),
                    "no interrupt within 5 s"
                );
                std::hint::spin_loop();
            }
            Err(e) => return Err(e.into()),
        }
    }
}

fn new_eventfd() -> Result<std::fs::File> {
    Ok(std::fs::File::from(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )?))
}

const EDU_IRQ_RAISE: u64 = 0x60;
const EDU_IRQ_ACK: u64 = 0x64;
const EDU_LIVENESS: u64 = 0x04;

/// edu's MSI through switchyard as a VMM sees it: raise (a region write) → the client's eventfd.
fn irq_through_switchyard(dir: &Path, bdf: &str, opts: &str, rounds: u32) -> Result<Value> {
    use std::os::fd::AsFd;
    let name = if opts.is_empty() {
        "irq-direct"
    } else {
        "irq-relay"
    };
    let server = Server::start(
        Path::new(SWITCHYARD),
        dir,
        name,
        &format!("vfio,host={bdf}{opts}"),
    )?;
    let mut c = switchyard_client::Client::connect(&server.socket)?;
    // Memory space on, then MSI enabled in the (emulated) capability, as a guest would.
    let mut cfg = vec![0u8; 256];
    c.region_read(7, 0, &mut cfg)?;
    let cmd = u16::from_le_bytes([cfg[4], cfg[5]]) | 0x6;
    c.region_write(7, 4, &cmd.to_le_bytes())?;
    let mut p = cfg[0x34] & 0xfc;
    let mut msi = None;
    while p >= 0x40 && msi.is_none() {
        if cfg[p as usize] == 0x05 {
            msi = Some(u64::from(p));
        }
        p = cfg[p as usize + 1] & 0xfc;
    }
    let msi = msi.context("edu has no MSI capability in the client's view")?;
    let ctl = u16::from_le_bytes([cfg[msi as usize + 2], cfg[msi as usize + 3]]) | 1;
    c.region_write(7, msi + 2, &ctl.to_le_bytes())?;
    let efd = new_eventfd()?;
    c.set_irqs(
        1,
        switchyard_proto::consts::VFIO_IRQ_SET_DATA_EVENTFD
            | switchyard_proto::consts::VFIO_IRQ_SET_ACTION_TRIGGER,
        0,
        1,
        &[efd.as_fd()],
    )?;
    let (mut raise, mut write) = (vec![], vec![]);
    for i in 0..rounds + 20 {
        let t = Instant::now();
        c.region_write(0, EDU_LIVENESS, &i.to_le_bytes())?;
        let w = t.elapsed();
        let t = Instant::now();
        c.region_write(0, EDU_IRQ_RAISE, &1u32.to_le_bytes())?;
        wait_eventfd(&efd)?;
        let r = t.elapsed();
        c.region_write(0, EDU_IRQ_ACK, &1u32.to_le_bytes())?;
        if i >= 20 {
            write.push(w.as_secs_f64() * 1e6);
            raise.push(r.as_secs_f64() * 1e6);
        }
    }
    drop(c);
    Ok(json!({ "raise_to_eventfd_us": stats_us(raise), "write_rtt_us": stats_us(write) }))
}

/// Interrupt latency: edu's MSI delivered to an eventfd (1) by VFIO in L1 directly (the floor),
/// (2) through switchyard with the client's eventfds handed to VFIO (`SET_IRQS` straight to the
/// kernel: the interrupt never passes through the server), (3) through switchyard relaying
/// (the kernel signals the server, a server thread signals the client). Each number includes the
/// region write that raises the interrupt; the write's own round trip is measured beside it.
fn irq_bench(dir: &Path, rounds: u32) -> Result<Value> {
    use sygpu_driver::irq::IrqMode;
    let edus = bind_vfio("1234:11e8")?;
    ensure!(
        edus.len() >= 2,
        "irq-bench needs two edus (L0: nested_with_devices(.., 2, ..))"
    );
    // (1) VFIO directly in L1.
    let sys = sygpu_driver::sysfs::Sysfs::system();
    let dev = sys.read_device(&edus[0]).map_err(anyhow::Error::msg)?;
    let group = dev.iommu_group.context("edu has no IOMMU group")?;
    let vfio =
        sygpu_driver::vfio::Vfio::open(&sys.device_dir(&edus[0]), group, Duration::from_secs(5))
            .map_err(anyhow::Error::msg)?;
    let bar = vfio.map_region(0).map_err(anyhow::Error::msg)?;
    let mut cmd = [0u8; 2];
    vfio.cfg_read(4, &mut cmd).map_err(anyhow::Error::msg)?;
    let c = u16::from_le_bytes(cmd) | 0x6;
    vfio.cfg_write(4, &c.to_le_bytes())
        .map_err(anyhow::Error::msg)?;
    let efd = vmm_sys_util::eventfd::EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK)?;
    vfio.enable_irqs(IrqMode::Msi, vec![&efd])
        .map_err(anyhow::Error::msg)?;
    let mut floor = vec![];
    for i in 0..rounds + 20 {
        let t = Instant::now();
        bar.w32(EDU_IRQ_RAISE, 1);
        let start = Instant::now();
        loop {
            match efd.read() {
                Ok(_) => break,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    ensure!(
                        start.elapsed() < Duration::from_secs(5),
                        "no MSI from edu in L1"
                    );
                    std::hint::spin_loop();
                }
                Err(e) => return Err(e.into()),
            }
        }
        let r = t.elapsed();
        bar.w32(EDU_IRQ_ACK, 1);
        if i >= 20 {
            floor.push(r.as_secs_f64() * 1e6);
        }
    }
    vfio.disable_irqs(IrqMode::Msi)
        .map_err(anyhow::Error::msg)?;
    drop(vfio);
    let direct = irq_through_switchyard(dir, &edus[1], "", rounds)?;
    let relay = irq_through_switchyard(dir, &edus[1], ",irq=relay", rounds)?;
    let socket = l1_socket_floor(rounds)?;
    let p50 = |v: &Value| v["raise_to_eventfd_us"]["p50"].as_f64();
    let floor_s = stats_us(floor);
    Ok(json!({
        "ok": true,
        "rounds": rounds,
        "vfio_in_l1_us": floor_s,
        "switchyard_eventfd_to_vfio": direct,
        "switchyard_relay": relay,
        "l1_socket_rtt_ns": socket,
        "relay_vs_direct_p50": match (p50(&relay), p50(&direct)) {
            (Some(a), Some(b)) if b > 0.0 => json!(a / b),
            _ => Value::Null,
        },
    }))
}

fn tail_text(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

fn run(scenario: &str, mode: DriverMode) -> Value {
    let dir = PathBuf::from(WORK).join(scenario);
    let started = Instant::now();
    println!("NESTED: {scenario} start");
    let r = std::fs::create_dir_all(&dir)
        .map_err(anyhow::Error::from)
        .and_then(|()| match scenario {
            "ch-workload" => ch_workload(&dir, mode),
            "ch-hotplug" => ch_hotplug(&dir, mode, 2),
            "ch-viommu" => ch_viommu(&dir),
            "ch-pool" => ch_pool(&dir),
            "qemu-softgpu" => qemu_softgpu(&dir),
            "qemu-edu" => qemu_edu(&dir),
            "pool-edu" => pool_edu(&dir),
            "pool-edu-kills" => pool_edu_kills(&dir),
            "vf-probe" => vf_probe(&dir),
            "irq-bench" => irq_bench(&dir, 500),
            "irq-bench-quick" => irq_bench(&dir, 50),
            "mmio-bench" => mmio_bench(&dir, 2000),
            "mmio-bench-quick" => mmio_bench(&dir, 200),
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
            "--l2-verbose" => L2_VERBOSE.store(true, std::sync::atomic::Ordering::Relaxed),
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
