//! Typed builder for a QEMU (`qemu-system-x86_64`) command line.

use std::ffi::OsString;
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Serialize;

use crate::error::{QemuError, Result};

/// Id of the memory backend object every guest gets (`-object memory-backend-memfd,id=mem0,…`).
pub const MEMORY_BACKEND_ID: &str = "mem0";
/// Chardev id used for the serial port when it is backed by a file or a socket.
pub const SERIAL_CHARDEV_ID: &str = "serial0";
/// Prefetchable 64-bit window the firmware reserves behind each root port
/// (`pref64-reserve=`). SeaBIOS gives an empty hot-plug port only 2 MiB, so a
/// hot-added GPU's VRAM BAR (64 MiB and up) would get no address in the guest.
/// (1G is not honoured by SeaBIOS with a small guest; 256M is.)
pub const ROOT_PORT_PREF64_RESERVE: &str = "256M";

/// Kernel command-line words every Linux guest of the project gets, whatever boots it (the
/// harness's QEMU, `scripts/guest-run.sh`, libvirt, an L1's QEMU or cloud-hypervisor): what a
/// TCG boot on a loaded host needs.
///
/// * `no_timer_check`: the kernel's boot-time check that the timer interrupt works
///   (`check_timer()`, `timer_irq_works()`) busy-waits for a number of TSC cycles and wants more
///   than four timer ticks in that time. Under TCG the TSC is the host's clock while the ticks
///   are emulated by QEMU threads: on a loaded host they come late and too few. Without
///   interrupt remapping the kernel then tries other routes (and may still get through); with it
///   (a guest with a vIOMMU) it panics at once: `timer doesn't work through Interrupt-remapped
///   IO-APIC`. The timer works, only late; with the check skipped the boot goes on.
///
/// Not added: `lpj=`, because the kernel already skips the delay-loop calibration (`Calibrating
/// delay loop (skipped), value calculated using timer frequency`, Debian's 6.12 under QEMU
/// 11.1's TCG); and `tsc=reliable`, because a TSC calibration or a clocksource watchdog upset
/// by a loaded host makes the kernel pick a slower clock, which costs speed, not a boot, and
/// no failure seen came from it.
pub const GUEST_BOOT_ARGS: &str = "no_timer_check";

/// Where the guest's first serial port (`ttyS0`) goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Serial {
    /// No serial port at all (`-nodefaults` removes the default one).
    #[default]
    None,
    /// QEMU's own stdin/stdout: `-serial stdio`.
    Stdio,
    /// A file, truncated at start:
    /// `-chardev file,id=serial0,path=PATH -serial chardev:serial0`.
    File(PathBuf),
    /// A listening unix socket that QEMU creates:
    /// `-chardev socket,id=serial0,path=PATH,server=on,wait=off -serial chardev:serial0`.
    ///
    /// With `wait=off` the guest starts immediately; output produced before a
    /// reader connects is dropped.
    UnixSocket(PathBuf),
}

/// A `vfio-user-pci` device: QEMU connects to a vfio-user server on `socket`.
///
/// QEMU only accepts the `socket` property in JSON syntax, so the device is
/// passed as `-device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":…},…}'`
/// (and as nested JSON in QMP `device_add`). The server must already be
/// listening when QEMU starts (or when `device_add` runs), otherwise QEMU
/// fails with "Failed to connect to '…'".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VfioUserDevice {
    /// The qdev id (needed for `device_del` and shown as `qdev_id` in `query-pci`).
    pub id: String,
    /// The vfio-user server's unix socket.
    pub socket: PathBuf,
    /// The bus to plug into, e.g. a root port id from [`root_port_id`]. `None` puts
    /// the device on the root complex (`pcie.0`), where it cannot be hot-unplugged.
    pub bus: Option<String>,
    /// QEMU's reply timeout in ms (`x-msg-timeout`), QEMU's default (5000) when `None`.
    pub msg_timeout_ms: Option<u32>,
}

#[derive(Serialize)]
struct DeviceJson<'a> {
    driver: &'static str,
    socket: SocketJson<'a>,
    id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    bus: Option<&'a str>,
    #[serde(rename = "x-msg-timeout", skip_serializing_if = "Option::is_none")]
    msg_timeout_ms: Option<u32>,
}

#[derive(Serialize)]
struct SocketJson<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    path: &'a str,
}

impl VfioUserDevice {
    /// A device with qdev id `id` talking to the server at `socket`, on the default bus.
    pub fn new(id: impl Into<String>, socket: impl Into<PathBuf>) -> Self {
        VfioUserDevice {
            id: id.into(),
            socket: socket.into(),
            bus: None,
            msg_timeout_ms: None,
        }
    }

    /// How long QEMU waits for a reply, in ms (`x-msg-timeout`; QEMU's default is 5000). A
    /// server that pins guest memory for a physical device's IOMMU in `DMA_MAP` can take longer
    /// than that for a large guest on a slow host; QEMU then loses the conversation.
    #[must_use]
    pub fn msg_timeout_ms(mut self, ms: u32) -> Self {
        self.msg_timeout_ms = Some(ms);
        self
    }

    /// Plugs the device into `bus` (for hot-plug: a `pcie-root-port` id).
    #[must_use]
    pub fn bus(mut self, bus: impl Into<String>) -> Self {
        self.bus = Some(bus.into());
        self
    }

    fn json_repr(&self) -> Result<DeviceJson<'_>> {
        let path = self.socket.to_str().ok_or_else(|| QemuError::NonUtf8Path {
            path: self.socket.clone(),
        })?;
        Ok(DeviceJson {
            driver: "vfio-user-pci",
            socket: SocketJson { kind: "unix", path },
            id: &self.id,
            bus: self.bus.as_deref(),
            msg_timeout_ms: self.msg_timeout_ms,
        })
    }

    /// The device as a JSON object (the `device_add` arguments).
    pub fn to_json_value(&self) -> Result<serde_json::Value> {
        serde_json::to_value(self.json_repr()?).map_err(QemuError::Serialize)
    }

    /// The device as the JSON string passed to `-device`.
    pub fn to_json_string(&self) -> Result<String> {
        serde_json::to_string(&self.json_repr()?).map_err(QemuError::Serialize)
    }
}

/// The id of the `n`th root port created by [`QemuCommand::root_ports`] (`rpN`, from 1).
pub fn root_port_id(n: u32) -> String {
    format!("rp{n}")
}

/// The accelerator (`-accel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Accel {
    /// `tcg`: the only choice on the project's hosts.
    #[default]
    Tcg,
    /// `kvm`: only where `/dev/kvm` is a real KVM (an L1 guest with nested SVM).
    Kvm,
}

impl Accel {
    /// The `-accel` value.
    pub fn as_str(self) -> &'static str {
        match self {
            Accel::Tcg => "tcg",
            Accel::Kvm => "kvm",
        }
    }
}

/// Typed builder for a QEMU command line that boots a test guest.
///
/// Fixed choices (see `guest-harness.md` §3.3, §4 and §5):
///
/// * **`-accel tcg` by default.** `/dev/kvm` on the project's machines is PVM
///   (`kvm_pvm`), which cannot boot a stock Debian kernel (emulation failure in
///   the bzImage decompressor; a PVH kernel crawls at ~1/20 of TCG speed). Never
///   auto-select KVM just because `/dev/kvm` exists; [`Accel::Kvm`] is for a
///   QEMU that runs inside a TCG guest with nested SVM (an L1 host), where KVM is real.
/// * **q35 with a shared memfd memory backend**
///   (`-machine q35,memory-backend=mem0 -object memory-backend-memfd,id=mem0,size=…,share=on`).
///   QEMU passes guest-RAM file descriptors in `DMA_MAP` only for fd-backed,
///   shared RAM; without it the server gets fd-less regions and would have to
///   use `DMA_READ`/`DMA_WRITE` messages.
/// * `-nodefaults -display none -no-reboot`: no stray devices, no window, and a
///   guest reboot ends QEMU.
///
/// Paths given to QEMU in `key=value` option syntax are escaped (`,` doubled),
/// so any path works there; the `vfio-user-pci` socket path goes into JSON and
/// must be UTF-8.
///
/// ```
/// use switchyard_qemu::{QemuCommand, Serial, VfioUserDevice, root_port_id};
/// let argv = QemuCommand::new("/cache/vmtools/qemu")
///     .memory_mib(512)
///     .serial(Serial::Stdio)
///     .kernel("/cache/vmtools/vmlinux")
///     .append("console=ttyS0 panic=-1")
///     .root_ports(1)
///     .vfio_user_device(VfioUserDevice::new("gpu0", "/tmp/gpu.sock").bus(root_port_id(1)))
///     .qmp_socket("/tmp/qmp.sock")
///     .args()?;
/// assert_eq!(argv[0], "-accel");
/// # Ok::<(), switchyard_qemu::QemuError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QemuCommand {
    binary: PathBuf,
    accel: Accel,
    memory_mib: u64,
    smp: u32,
    cpu: Option<String>,
    serial: Serial,
    kernel: Option<PathBuf>,
    initrd: Option<PathBuf>,
    append: Option<String>,
    intel_iommu: bool,
    intremap: bool,
    root_ports: u32,
    devices: Vec<String>,
    vfio_user_devices: Vec<VfioUserDevice>,
    qmp_socket: Option<PathBuf>,
    extra_args: Vec<OsString>,
}

impl QemuCommand {
    /// A command running `binary` (for the project: the wrapper script
    /// `$SWITCHYARD_CACHE/vmtools/qemu`, by default `.cache/vmtools/qemu`) with
    /// 512 MiB of RAM, one vCPU, no serial port and nothing else.
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        QemuCommand {
            binary: binary.into(),
            accel: Accel::Tcg,
            memory_mib: 512,
            smp: 1,
            cpu: None,
            serial: Serial::None,
            kernel: None,
            initrd: None,
            append: None,
            intel_iommu: false,
            intremap: false,
            root_ports: 0,
            devices: Vec::new(),
            vfio_user_devices: Vec::new(),
            qmp_socket: None,
            extra_args: Vec::new(),
        }
    }

    /// The QEMU binary.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// The accelerator ([`Accel::Tcg`] unless set).
    #[must_use]
    pub fn accel(mut self, accel: Accel) -> Self {
        self.accel = accel;
        self
    }

    /// Guest RAM in MiB (both `-m` and the memfd backend's `size`).
    #[must_use]
    pub fn memory_mib(mut self, mib: u64) -> Self {
        self.memory_mib = mib;
        self
    }

    /// Number of vCPUs (`-smp`).
    #[must_use]
    pub fn smp(mut self, cpus: u32) -> Self {
        self.smp = cpus;
        self
    }

    /// The CPU model (`-cpu`; QEMU's default when unset). `EPYC` gives the guest SVM with
    /// nested paging under TCG, so it can load kvm_amd and run guests of its own.
    #[must_use]
    pub fn cpu(mut self, model: impl Into<String>) -> Self {
        self.cpu = Some(model.into());
        self
    }

    /// Where the serial console goes.
    #[must_use]
    pub fn serial(mut self, serial: Serial) -> Self {
        self.serial = serial;
        self
    }

    /// `-kernel`: the guest kernel, normally the PVH-bootable `vmlinux`
    /// (direct PVH entry skips the bzImage decompressor, ~3 s faster under TCG).
    #[must_use]
    pub fn kernel(mut self, path: impl Into<PathBuf>) -> Self {
        self.kernel = Some(path.into());
        self
    }

    /// `-initrd`.
    #[must_use]
    pub fn initrd(mut self, path: impl Into<PathBuf>) -> Self {
        self.initrd = Some(path.into());
        self
    }

    /// `-append`: the kernel command line.
    #[must_use]
    pub fn append(mut self, cmdline: impl Into<String>) -> Self {
        self.append = Some(cmdline.into());
        self
    }

    /// Adds an emulated VT-d: `-device intel-iommu,caching-mode=on` plus
    /// `kernel-irqchip=split` on `-machine`.
    ///
    /// `caching-mode=on` is mandatory next to any VFIO-type device (QEMU
    /// refuses otherwise: "requires caching mode"). The guest needs
    /// `intel_iommu=on` on its command line to use it. Expect `DMA_UNMAP`s of
    /// ranges that were never mapped.
    #[must_use]
    pub fn intel_iommu(mut self, enabled: bool) -> Self {
        self.intel_iommu = enabled;
        self
    }

    /// With [`QemuCommand::intel_iommu`]: also `intremap=on`, interrupt remapping (what a
    /// guest that assigns devices with VFIO itself, nested, uses for their MSIs). Off by
    /// default.
    #[must_use]
    pub fn intel_iommu_intremap(mut self, enabled: bool) -> Self {
        self.intremap = enabled;
        self
    }

    /// Adds a cold-plugged emulated device, `-device SPEC` (e.g. `edu`), after the IOMMU and
    /// the root ports and before the `vfio-user-pci` devices.
    #[must_use]
    pub fn device(mut self, spec: impl Into<String>) -> Self {
        self.devices.push(spec.into());
        self
    }

    /// Adds `count` PCIe root ports `rp1`…`rpN`
    /// (`-device pcie-root-port,id=rpN,chassis=N,slot=N,pref64-reserve=256M`). Devices must sit on
    /// a root port to be hot-pluggable/unpluggable; see [`root_port_id`].
    #[must_use]
    pub fn root_ports(mut self, count: u32) -> Self {
        self.root_ports = count;
        self
    }

    /// Adds a cold-plugged `vfio-user-pci` device.
    #[must_use]
    pub fn vfio_user_device(mut self, device: VfioUserDevice) -> Self {
        self.vfio_user_devices.push(device);
        self
    }

    /// Serves QMP on a unix socket that QEMU creates:
    /// `-qmp unix:PATH,server=on,wait=off`.
    ///
    /// (Not `-chardev socket,… -mon chardev=…,mode=control`: QEMU 11.1 warns
    /// that `-mon` is deprecated in favour of `-object monitor-qmp`, which in
    /// turn does not exist in older QEMUs. `-qmp` works with both.)
    #[must_use]
    pub fn qmp_socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.qmp_socket = Some(path.into());
        self
    }

    /// Appends one raw argument after everything else.
    #[must_use]
    pub fn extra_arg(mut self, arg: impl Into<OsString>) -> Self {
        self.extra_args.push(arg.into());
        self
    }

    /// Appends raw arguments after everything else.
    #[must_use]
    pub fn extra_args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<OsString>,
    {
        self.extra_args.extend(args.into_iter().map(Into::into));
        self
    }

    /// The arguments (without the binary itself).
    pub fn args(&self) -> Result<Vec<OsString>> {
        let mut a: Vec<OsString> = Vec::new();
        let mut push = |s: &str| a.push(OsString::from(s));
        push("-accel");
        push(self.accel.as_str());
        push("-machine");
        let mut machine = format!("q35,memory-backend={MEMORY_BACKEND_ID}");
        if self.intel_iommu {
            machine.push_str(",kernel-irqchip=split");
        }
        push(&machine);
        push("-object");
        push(&format!(
            "memory-backend-memfd,id={MEMORY_BACKEND_ID},size={}M,share=on",
            self.memory_mib
        ));
        push("-m");
        push(&format!("{}M", self.memory_mib));
        push("-smp");
        push(&self.smp.to_string());
        if let Some(cpu) = &self.cpu {
            push("-cpu");
            push(cpu);
        }
        push("-nodefaults");
        push("-display");
        push("none");
        push("-no-reboot");

        match &self.serial {
            Serial::None => {}
            Serial::Stdio => {
                a.push("-serial".into());
                a.push("stdio".into());
            }
            Serial::File(path) => {
                a.push("-chardev".into());
                a.push(opts_with_path(
                    &format!("file,id={SERIAL_CHARDEV_ID},path="),
                    path,
                    "",
                ));
                a.push("-serial".into());
                a.push(format!("chardev:{SERIAL_CHARDEV_ID}").into());
            }
            Serial::UnixSocket(path) => {
                a.push("-chardev".into());
                a.push(opts_with_path(
                    &format!("socket,id={SERIAL_CHARDEV_ID},path="),
                    path,
                    ",server=on,wait=off",
                ));
                a.push("-serial".into());
                a.push(format!("chardev:{SERIAL_CHARDEV_ID}").into());
            }
        }

        if let Some(kernel) = &self.kernel {
            a.push("-kernel".into());
            a.push(kernel.into());
        }
        if let Some(initrd) = &self.initrd {
            a.push("-initrd".into());
            a.push(initrd.into());
        }
        if let Some(append) = &self.append {
            a.push("-append".into());
            a.push(append.into());
        }

        // The IOMMU goes before any PCI device so that it is realized first.
        if self.intel_iommu {
            a.push("-device".into());
            a.push(if self.intremap {
                "intel-iommu,intremap=on,caching-mode=on".into()
            } else {
                "intel-iommu,caching-mode=on".into()
            });
        }
        for n in 1..=self.root_ports {
            a.push("-device".into());
            a.push(
                format!(
                    "pcie-root-port,id={},chassis={n},slot={n},pref64-reserve={ROOT_PORT_PREF64_RESERVE}",
                    root_port_id(n)
                )
                .into(),
            );
        }
        for dev in &self.devices {
            a.push("-device".into());
            a.push(dev.into());
        }
        for dev in &self.vfio_user_devices {
            a.push("-device".into());
            a.push(dev.to_json_string()?.into());
        }

        if let Some(qmp) = &self.qmp_socket {
            a.push("-qmp".into());
            a.push(opts_with_path("unix:", qmp, ",server=on,wait=off"));
        }

        a.extend(self.extra_args.iter().cloned());
        Ok(a)
    }

    /// A [`Command`] for the binary with [`args`](Self::args); stdio is left
    /// at `Command`'s defaults for the caller to set.
    pub fn command(&self) -> Result<Command> {
        let mut cmd = Command::new(&self.binary);
        cmd.args(self.args()?);
        Ok(cmd)
    }
}

/// `prefix` + `path` with QemuOpts escaping (`,` → `,,`) + `suffix`.
fn opts_with_path(prefix: &str, path: &Path, suffix: &str) -> OsString {
    let mut out = prefix.as_bytes().to_vec();
    for &b in path.as_os_str().as_bytes() {
        out.push(b);
        if b == b',' {
            out.push(b',');
        }
    }
    out.extend_from_slice(suffix.as_bytes());
    OsString::from_vec(out)
}

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;

    use super::*;

    fn strs(args: &[OsString]) -> Vec<&str> {
        args.iter()
            .map(|a| a.to_str().expect("test args are UTF-8"))
            .collect()
    }

    fn base() -> Vec<&'static str> {
        vec![
            "-accel",
            "tcg",
            "-machine",
            "q35,memory-backend=mem0",
            "-object",
            "memory-backend-memfd,id=mem0,size=512M,share=on",
            "-m",
            "512M",
            "-smp",
            "1",
            "-nodefaults",
            "-display",
            "none",
            "-no-reboot",
        ]
    }

    #[test]
    fn message_timeout_goes_into_the_device_json() {
        let d = VfioUserDevice::new("gpu0", "/tmp/s.sock");
        assert!(!d.to_json_string().expect("json").contains("x-msg-timeout"));
        let j = d.msg_timeout_ms(30_000).to_json_value().expect("json");
        assert_eq!(j["x-msg-timeout"], 30_000);
    }

    #[test]
    fn kvm_only_when_asked() {
        let tcg = QemuCommand::new("/q").args().expect("args");
        assert_eq!(strs(&tcg)[..2], ["-accel", "tcg"]);
        let kvm = QemuCommand::new("/q")
            .accel(Accel::Kvm)
            .args()
            .expect("args");
        assert_eq!(strs(&kvm)[..2], ["-accel", "kvm"]);
    }

    #[test]
    fn minimal_argv() {
        let args = QemuCommand::new("/q").args().expect("args");
        assert_eq!(strs(&args), base());
    }

    #[test]
    fn full_argv() {
        let cmd = QemuCommand::new("/cache/vmtools/qemu")
            .memory_mib(1024)
            .smp(2)
            .cpu("EPYC")
            .serial(Serial::File("/tmp/serial.log".into()))
            .kernel("/cache/vmtools/vmlinux")
            .initrd("/cache/vmtools/initramfs-base.cpio.gz")
            .append("console=ttyS0 quiet panic=-1")
            .intel_iommu(true)
            .root_ports(2)
            .vfio_user_device(VfioUserDevice::new("gpu0", "/tmp/gpu0.sock").bus(root_port_id(1)))
            .vfio_user_device(VfioUserDevice::new("gpu1", "/tmp/gpu1.sock"))
            .qmp_socket("/tmp/qmp.sock")
            .extra_args(["-trace", "vfio_user*"]);
        let args = cmd.args().expect("args");
        assert_eq!(
            strs(&args),
            vec![
                "-accel",
                "tcg",
                "-machine",
                "q35,memory-backend=mem0,kernel-irqchip=split",
                "-object",
                "memory-backend-memfd,id=mem0,size=1024M,share=on",
                "-m",
                "1024M",
                "-smp",
                "2",
                "-cpu",
                "EPYC",
                "-nodefaults",
                "-display",
                "none",
                "-no-reboot",
                "-chardev",
                "file,id=serial0,path=/tmp/serial.log",
                "-serial",
                "chardev:serial0",
                "-kernel",
                "/cache/vmtools/vmlinux",
                "-initrd",
                "/cache/vmtools/initramfs-base.cpio.gz",
                "-append",
                "console=ttyS0 quiet panic=-1",
                "-device",
                "intel-iommu,caching-mode=on",
                "-device",
                "pcie-root-port,id=rp1,chassis=1,slot=1,pref64-reserve=256M",
                "-device",
                "pcie-root-port,id=rp2,chassis=2,slot=2,pref64-reserve=256M",
                "-device",
                r#"{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/gpu0.sock"},"id":"gpu0","bus":"rp1"}"#,
                "-device",
                r#"{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/gpu1.sock"},"id":"gpu1"}"#,
                "-qmp",
                "unix:/tmp/qmp.sock,server=on,wait=off",
                "-trace",
                "vfio_user*",
            ]
        );

        let command = cmd.command().expect("command");
        assert_eq!(command.get_program(), OsStr::new("/cache/vmtools/qemu"));
        assert_eq!(
            command
                .get_args()
                .map(OsStr::to_os_string)
                .collect::<Vec<_>>(),
            args
        );
    }

    #[test]
    fn intremap_and_plain_devices_for_nested_vfio() {
        let args = QemuCommand::new("/q")
            .intel_iommu(true)
            .intel_iommu_intremap(true)
            .root_ports(1)
            .device("edu")
            .vfio_user_device(VfioUserDevice::new("gpu0", "/tmp/g.sock"))
            .args()
            .expect("args");
        let s = strs(&args);
        let tail: Vec<&str> =
            s[s.iter().position(|a| *a == "-device").expect("devices")..].to_vec();
        assert_eq!(
            tail,
            [
                "-device",
                "intel-iommu,intremap=on,caching-mode=on",
                "-device",
                "pcie-root-port,id=rp1,chassis=1,slot=1,pref64-reserve=256M",
                "-device",
                "edu",
                "-device",
                r#"{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/g.sock"},"id":"gpu0"}"#,
            ]
        );
        // intremap alone adds no IOMMU.
        let args = QemuCommand::new("/q")
            .intel_iommu_intremap(true)
            .args()
            .expect("args");
        assert!(!strs(&args).iter().any(|a| a.contains("intel-iommu")));
    }

    #[test]
    fn serial_variants() {
        let tail = |serial| {
            let args = QemuCommand::new("/q").serial(serial).args().expect("args");
            strs(&args)[14..]
                .iter()
                .map(|s| s.to_string())
                .collect::<Vec<_>>()
        };
        assert!(tail(Serial::None).is_empty());
        assert_eq!(tail(Serial::Stdio), ["-serial", "stdio"]);
        assert_eq!(
            tail(Serial::UnixSocket("/run/s.sock".into())),
            [
                "-chardev",
                "socket,id=serial0,path=/run/s.sock,server=on,wait=off",
                "-serial",
                "chardev:serial0"
            ]
        );
    }

    #[test]
    fn commas_in_option_paths_are_doubled() {
        let args = QemuCommand::new("/q")
            .serial(Serial::File("/tmp/a,b.log".into()))
            .qmp_socket("/tmp/q,mp.sock")
            .args()
            .expect("args");
        let s = strs(&args);
        assert!(s.contains(&"file,id=serial0,path=/tmp/a,,b.log"));
        assert!(s.contains(&"unix:/tmp/q,,mp.sock,server=on,wait=off"));
    }

    #[test]
    fn non_utf8_option_paths_pass_through() {
        let path = PathBuf::from(OsString::from_vec(b"/tmp/\xff.log".to_vec()));
        let args = QemuCommand::new("/q")
            .serial(Serial::File(path))
            .args()
            .expect("args");
        assert_eq!(
            args[15].as_bytes(),
            b"file,id=serial0,path=/tmp/\xff.log".as_slice()
        );
    }

    #[test]
    fn device_json_escapes_path() {
        let dev = VfioUserDevice::new("d\"0", "/tmp/we\"ird\\,path.sock");
        let json = dev.to_json_string().expect("json");
        assert_eq!(
            json,
            r#"{"driver":"vfio-user-pci","socket":{"type":"unix","path":"/tmp/we\"ird\\,path.sock"},"id":"d\"0"}"#
        );
        let back: serde_json::Value = serde_json::from_str(&json).expect("parse");
        assert_eq!(back, dev.to_json_value().expect("value"));
        assert_eq!(back["socket"]["path"], "/tmp/we\"ird\\,path.sock");
    }

    #[test]
    fn non_utf8_socket_path_is_an_error() {
        let path = PathBuf::from(OsString::from_vec(b"/tmp/\xff.sock".to_vec()));
        let err = QemuCommand::new("/q")
            .vfio_user_device(VfioUserDevice::new("d", path))
            .args()
            .expect_err("must fail");
        assert!(matches!(err, QemuError::NonUtf8Path { .. }), "{err}");
    }
}
