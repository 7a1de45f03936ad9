//! The cloud-hypervisor scenarios: the softgpu as a boot-time user device (`ch-workload`),
//! hot-added and removed through the REST API (`ch-hotplug`), and on a segment behind
//! cloud-hypervisor's virtio-iommu (`ch-viommu`, refused).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use switchyard_ch::{ChApi, UserDeviceConfig};

use crate::l2::{json_after, l2_cmdline, l2_spec};
use crate::procs::{Server, Vm, tail};
use crate::{DEVICE, DriverMode, L2_TIMEOUT, SWITCHYARD, ms, tail_text};

/// The softgpu as a boot-time `--user-device`; L2 runs the driver on it and powers off.
pub fn ch_workload(dir: &Path, mode: DriverMode) -> Result<Value> {
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
pub fn ch_hotplug(dir: &Path, mode: DriverMode, rounds: u32) -> Result<Value> {
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
pub fn ch_viommu(dir: &Path) -> Result<Value> {
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
