//! L2s under QEMU with KVM and a vIOMMU, so L2's user-space drivers use VFIO: the softgpu's
//! full driver workload (`qemu-softgpu`) and L1's edu through switchyard's passthrough backend
//! (`qemu-edu`).

use std::path::Path;

use anyhow::{Context, Result};
use serde_json::{Value, json};
use switchyard_qemu::{Accel, GUEST_BOOT_ARGS, QemuCommand, VfioUserDevice, root_port_id};

use crate::l2::{L2_VERBOSE, l2_outcome};
use crate::procs::{Server, Vm, tail};
use crate::{
    DEVICE, L2_INITRAMFS, L2_KERNEL, L2_MEMORY_MIB, QEMU, SWITCHYARD, bind_vfio, tail_text,
};

/// An L2 under QEMU (`-accel kvm`, in L1) with a vIOMMU (`intel-iommu`), so L2's user-space
/// drivers use VFIO like on the single-level guests; the vfio-user device is at `socket`.
pub fn qemu_l2(dir: &Path, name: &str, socket: &Path, test: &str, args: &[&str]) -> Result<Vm> {
    let device = VfioUserDevice::new("dev0", socket);
    Vm::start_qemu(dir, name, l2_command(test, args, device))
}

/// [`qemu_l2`] with its vfio-user device on a PCIe root port ([`root_port_id`] 1), so the
/// device can be unplugged and plugged in again (through the VM's QMP socket, [`Vm::qmp`]).
pub fn qemu_l2_hotplug(
    dir: &Path,
    name: &str,
    socket: &Path,
    test: &str,
    args: &[&str],
) -> Result<Vm> {
    let device = VfioUserDevice::new("dev0", socket).bus(root_port_id(1));
    Vm::start_qemu(dir, name, l2_command(test, args, device).root_ports(1))
}

fn l2_command(test: &str, args: &[&str], device: VfioUserDevice) -> QemuCommand {
    // `nox2apic`: an L2 in x2APIC mode (its vIOMMU remaps interrupts) hit faults of L0's SVM
    // emulation in most L1 boots (kernels crashing in their page fault handler, an L2 spinning
    // with interrupts off); with the xAPIC, L2s have not (guest-tests/harness/src/nested.rs).
    let mut append =
        format!("console=ttyS0 panic=-1 quiet {GUEST_BOOT_ARGS} intel_iommu=on nox2apic");
    if L2_VERBOSE.load(std::sync::atomic::Ordering::Relaxed) {
        append = append.replace(" quiet", "");
    }
    append.push_str(&format!(" sy.test={test}"));
    for a in args {
        append.push_str(&format!(" sy.arg={a}"));
    }
    QemuCommand::new(QEMU)
        .accel(Accel::Kvm)
        .cpu("host")
        .memory_mib(L2_MEMORY_MIB)
        .kernel(L2_KERNEL)
        .initrd(L2_INITRAMFS)
        .append(append)
        .intel_iommu(true)
        // A physical device's server pins all of L2's RAM for the IOMMU in the first DMA_MAP:
        // seconds at TCG speed, past QEMU's 5 s default reply timeout.
        .vfio_user_device(device.msg_timeout_ms(60_000))
}

/// The softgpu served in L1 to an L2 under QEMU with KVM and a vIOMMU: the in-guest driver's
/// full VFIO workload (DMA through L2's IOMMU, MSI-X, VRAM through the mapped BAR).
pub fn qemu_softgpu(dir: &Path) -> Result<Value> {
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
pub fn qemu_edu(dir: &Path) -> Result<Value> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qemu_l2s_boot_with_the_arguments_for_a_loaded_tcg_host() {
        let device = VfioUserDevice::new("dev0", "/tmp/dev.sock");
        let argv = l2_command("sy-edu", &["0000:00:03.0"], device)
            .args()
            .expect("argv");
        let i = argv.iter().position(|a| a == "-append").expect("-append");
        let append = argv[i + 1].to_str().expect("UTF-8");
        let words: Vec<&str> = append.split_whitespace().collect();
        assert!(words.contains(&"no_timer_check"), "{append}");
        assert!(words.contains(&"sy.test=sy-edu"), "{append}");
    }
}
