//! Starts a kernel-less QEMU (firmware only) with the builder's full flag set,
//! talks to it over QMP and quits it. A manual check that the builder's argv
//! and the QMP client work against the real binary.
//!
//! `cargo run -p switchyard-qemu --example qemu_probe [-- QEMU [SERVER_SOCKET]]`
//! (QEMU defaults to `$SWITCHYARD_CACHE/vmtools/qemu`, else `.cache/vmtools/qemu`).
//! With `SERVER_SOCKET` (a listening vfio-user server), the device is also
//! hot-added on a root port, looked up in `query-pci`, and a `device_del` is
//! attempted; with no guest OS to acknowledge it, that must time out.
//! With `PROBE_KERNEL` and `PROBE_INITRD` set, the guest boots that kernel
//! instead (serial to a file) and the probe waits for the guest's own
//! `SHUTDOWN` instead of sending `quit`.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use switchyard_qemu::{
    GUEST_BOOT_ARGS, QemuCommand, QemuError, Qmp, Serial, all_pci_devices, root_port_id,
};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let qemu = std::env::args_os()
        .nth(1)
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("SWITCHYARD_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| PathBuf::from(".cache"))
                .join("vmtools/qemu")
        });
    let dir = tempfile::tempdir()?;
    let qmp_path = dir.path().join("q,mp.sock");
    let serial = dir.path().join("serial.log");
    let boot = std::env::var_os("PROBE_KERNEL").zip(std::env::var_os("PROBE_INITRD"));
    let mut cmd = QemuCommand::new(&qemu)
        .memory_mib(256)
        .smp(2)
        .serial(Serial::File(serial.clone()))
        .intel_iommu(true)
        .root_ports(2)
        .qmp_socket(&qmp_path);
    if let Some((kernel, initrd)) = &boot {
        cmd = cmd.kernel(kernel).initrd(initrd).append(format!(
            "console=ttyS0 quiet panic=-1 {GUEST_BOOT_ARGS} intel_iommu=on"
        ));
    }
    println!("argv: {:?}", cmd.args()?);
    let mut child = cmd.command()?.stdin(Stdio::null()).spawn()?;

    let result = (|| -> Result<(), Box<dyn std::error::Error>> {
        let mut qmp = Qmp::connect(&qmp_path, Duration::from_secs(20))?;
        println!("greeting: {:?}", qmp.greeting());
        println!("status: {:?}", qmp.query_status()?);
        let buses = qmp.query_pci()?;
        for d in all_pci_devices(&buses) {
            println!(
                "pci {:02x}:{:02x}.{} [{:04x}:{:04x}] class {:04x} qdev_id {:?}",
                d.bus, d.slot, d.function, d.id.vendor, d.id.device, d.class_info.class, d.qdev_id
            );
        }
        println!(
            "find 1b36:000c (root port): {:?}",
            qmp.find_pci_device(0x1b36, 0x000c)?.map(|d| d.qdev_id)
        );
        let missing = dir.path().join("no-server.sock");
        match qmp.device_add_vfio_user("gpu0", &missing, Some(&root_port_id(1))) {
            Err(QemuError::Command { class, desc, .. }) => {
                println!("device_add without server: {class}: {desc}");
            }
            other => println!("device_add without server: unexpected {other:?}"),
        }
        match qmp.device_del("nope", Duration::from_secs(1)) {
            Err(QemuError::Command { class, desc, .. }) => {
                println!("device_del nope: {class}: {desc}");
            }
            other => println!("device_del nope: unexpected {other:?}"),
        }
        if let Some(server) = std::env::args_os().nth(2) {
            qmp.device_add_vfio_user("gpu0", PathBuf::from(server), Some(&root_port_id(1)))?;
            let buses = qmp.query_pci()?;
            let dev = all_pci_devices(&buses)
                .into_iter()
                .find(|d| d.qdev_id == "gpu0")
                .cloned();
            println!("hot-added gpu0 in query-pci (needs guest enumeration): {dev:?}");
            println!("peripheral ids after add: {:?}", qmp.peripheral_ids()?);
            match qmp.device_del("gpu0", Duration::from_secs(3)) {
                Err(e @ QemuError::Timeout { .. }) => println!("device_del gpu0 (no guest): {e}"),
                other => println!("device_del gpu0 (no guest): unexpected {other:?}"),
            }
        }
        if boot.is_some() {
            let ev = qmp.wait_event("SHUTDOWN", Duration::from_secs(120))?;
            println!("guest shut down: {}", ev.data);
        } else {
            qmp.quit()?;
        }
        println!("events: {:?}", qmp.take_events());
        Ok(())
    })();
    if result.is_err() {
        child.kill()?;
    }
    let status = child.wait()?;
    println!("qemu exited: {status}");
    let log = std::fs::read_to_string(&serial)?;
    println!("serial log: {} bytes", log.len());
    for line in log.lines().filter(|l| l.contains("GUEST")) {
        println!("  serial: {line}");
    }
    result
}
