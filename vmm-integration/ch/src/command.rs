//! Typed builder for a `cloud-hypervisor` command line.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::api::UserDeviceConfig;
use crate::error::{ChError, Result};

/// Where the serial port (`--serial`) or the virtio console (`--console`) goes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Output {
    /// No device at all: `off`.
    #[default]
    Off,
    /// Device present, output discarded: `null`.
    Null,
    /// cloud-hypervisor's own stdin/stdout: `tty`.
    Tty,
    /// A new pseudo-terminal: `pty`.
    Pty,
    /// A file: `file=PATH`.
    File(PathBuf),
    /// A unix socket cloud-hypervisor listens on: `socket=PATH` (serial port).
    Socket(PathBuf),
}

impl Output {
    fn to_arg(&self, option: &'static str) -> Result<String> {
        Ok(match self {
            Output::Off => "off".to_owned(),
            Output::Null => "null".to_owned(),
            Output::Tty => "tty".to_owned(),
            Output::Pty => "pty".to_owned(),
            Output::File(p) => format!("file={}", option_value(option, p)?),
            Output::Socket(p) => format!("socket={}", option_value(option, p)?),
        })
    }
}

/// Checks that `path` can be written as a value in cloud-hypervisor's
/// `key=value,…` syntax, whose parser treats `,` as a separator, `=` as the
/// key/value split and `"`, `[`, `]` as quoting/list syntax.
fn option_value<'a>(option: &'static str, path: &'a Path) -> Result<&'a str> {
    let invalid = || ChError::InvalidOptionValue {
        option,
        value: path.to_string_lossy().into_owned(),
    };
    let s = path.to_str().ok_or_else(invalid)?;
    if s.is_empty() || s.contains([',', '=', '"', '[', ']']) {
        return Err(invalid());
    }
    Ok(s)
}

/// Renders a [`UserDeviceConfig`] as the value of `--user-device`:
/// `socket=PATH[,id=ID][,pci_segment=N][,pci_device_id=N]`.
pub fn user_device_arg(dev: &UserDeviceConfig) -> Result<String> {
    let mut s = format!(
        "socket={}",
        option_value("--user-device socket", &dev.socket)?
    );
    if let Some(id) = &dev.id {
        s.push_str(",id=");
        s.push_str(option_value("--user-device id", Path::new(id))?);
    }
    if let Some(seg) = dev.pci_segment {
        s.push_str(&format!(",pci_segment={seg}"));
    }
    if let Some(slot) = dev.pci_device_id {
        s.push_str(&format!(",pci_device_id={slot}"));
    }
    Ok(s)
}

/// Typed builder for a `cloud-hypervisor` command line.
///
/// Memory is always `shared=on`: cloud-hypervisor DMA-maps into a vfio-user
/// server only the guest-memory regions that have a backing file, which
/// requires shared memory.
///
/// ```
/// use switchyard_ch::{ChCommand, Output, UserDeviceConfig};
/// let argv = ChCommand::new("/usr/bin/cloud-hypervisor")
///     .api_socket("/tmp/ch.sock")
///     .kernel("/cache/vmlinux")
///     .cmdline("console=ttyS0")
///     .serial(Output::Tty)
///     .user_device(UserDeviceConfig::new("/tmp/gpu.sock").id("gpu0"))
///     .args()?;
/// assert_eq!(argv[0], "--api-socket");
/// # Ok::<(), switchyard_ch::ChError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChCommand {
    binary: PathBuf,
    api_socket: Option<PathBuf>,
    kernel: Option<PathBuf>,
    initramfs: Option<PathBuf>,
    cmdline: Option<String>,
    cpus: u32,
    memory_mib: u64,
    serial: Output,
    console: Output,
    user_devices: Vec<UserDeviceConfig>,
    vfio_devices: Vec<PathBuf>,
    extra_args: Vec<OsString>,
}

impl ChCommand {
    /// A command running `binary` with one vCPU, 512 MiB of shared memory,
    /// serial and virtio console off.
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        ChCommand {
            binary: binary.into(),
            api_socket: None,
            kernel: None,
            initramfs: None,
            cmdline: None,
            cpus: 1,
            memory_mib: 512,
            serial: Output::Off,
            console: Output::Off,
            user_devices: Vec::new(),
            vfio_devices: Vec::new(),
            extra_args: Vec::new(),
        }
    }

    /// The binary.
    pub fn binary(&self) -> &Path {
        &self.binary
    }

    /// `--api-socket path=PATH`: the REST API socket (see [`ChApi`](crate::ChApi)).
    #[must_use]
    pub fn api_socket(mut self, path: impl Into<PathBuf>) -> Self {
        self.api_socket = Some(path.into());
        self
    }

    /// `--kernel`: an uncompressed `vmlinux` (PVH/ELF entry on x86_64).
    #[must_use]
    pub fn kernel(mut self, path: impl Into<PathBuf>) -> Self {
        self.kernel = Some(path.into());
        self
    }

    /// `--initramfs`.
    #[must_use]
    pub fn initramfs(mut self, path: impl Into<PathBuf>) -> Self {
        self.initramfs = Some(path.into());
        self
    }

    /// `--cmdline`: the kernel command line.
    #[must_use]
    pub fn cmdline(mut self, cmdline: impl Into<String>) -> Self {
        self.cmdline = Some(cmdline.into());
        self
    }

    /// `--cpus boot=N`.
    #[must_use]
    pub fn cpus(mut self, boot: u32) -> Self {
        self.cpus = boot;
        self
    }

    /// `--memory size=NM,shared=on`.
    #[must_use]
    pub fn memory_mib(mut self, mib: u64) -> Self {
        self.memory_mib = mib;
        self
    }

    /// `--serial` (default `off`).
    #[must_use]
    pub fn serial(mut self, output: Output) -> Self {
        self.serial = output;
        self
    }

    /// `--console` (the virtio console; default `off`).
    #[must_use]
    pub fn console(mut self, output: Output) -> Self {
        self.console = output;
        self
    }

    /// Adds a cold-plugged vfio-user device (`--user-device …`). The server
    /// must be listening when cloud-hypervisor starts.
    #[must_use]
    pub fn user_device(mut self, device: UserDeviceConfig) -> Self {
        self.user_devices.push(device);
        self
    }

    /// Assigns a host device bound to vfio-pci directly (`--device path=SYSFS_DIR`, e.g.
    /// `/sys/bus/pci/devices/0000:00:03.0/`): the guest reaches its BARs without a VM exit.
    #[must_use]
    pub fn vfio_device(mut self, sysfs_dir: impl Into<PathBuf>) -> Self {
        self.vfio_devices.push(sysfs_dir.into());
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
        if let Some(api) = &self.api_socket {
            a.push("--api-socket".into());
            a.push(format!("path={}", option_value("--api-socket path", api)?).into());
        }
        if let Some(kernel) = &self.kernel {
            a.push("--kernel".into());
            a.push(kernel.into());
        }
        if let Some(initramfs) = &self.initramfs {
            a.push("--initramfs".into());
            a.push(initramfs.into());
        }
        if let Some(cmdline) = &self.cmdline {
            a.push("--cmdline".into());
            a.push(cmdline.into());
        }
        a.push("--cpus".into());
        a.push(format!("boot={}", self.cpus).into());
        a.push("--memory".into());
        a.push(format!("size={}M,shared=on", self.memory_mib).into());
        a.push("--serial".into());
        a.push(self.serial.to_arg("--serial")?.into());
        a.push("--console".into());
        a.push(self.console.to_arg("--console")?.into());
        for dev in &self.user_devices {
            a.push("--user-device".into());
            a.push(user_device_arg(dev)?.into());
        }
        for path in &self.vfio_devices {
            a.push("--device".into());
            a.push(format!("path={}", option_value("--device path", path)?).into());
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

#[cfg(test)]
mod tests {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStringExt;

    use super::*;

    fn strs(args: &[OsString]) -> Vec<&str> {
        args.iter()
            .map(|a| a.to_str().expect("test args are UTF-8"))
            .collect()
    }

    #[test]
    fn minimal_argv() {
        let args = ChCommand::new("/ch").args().expect("args");
        assert_eq!(
            strs(&args),
            [
                "--cpus",
                "boot=1",
                "--memory",
                "size=512M,shared=on",
                "--serial",
                "off",
                "--console",
                "off"
            ]
        );
    }

    #[test]
    fn full_argv() {
        let cmd = ChCommand::new("/opt/cloud-hypervisor")
            .api_socket("/tmp/ch-api.sock")
            .kernel("/cache/vmtools/vmlinux")
            .initramfs("/cache/vmtools/initramfs-base.cpio.gz")
            .cmdline("console=ttyS0 quiet panic=-1, x=y")
            .cpus(2)
            .memory_mib(1024)
            .serial(Output::File("/tmp/serial.log".into()))
            .user_device(UserDeviceConfig::new("/tmp/gpu0.sock").id("gpu0"))
            .user_device(UserDeviceConfig {
                socket: "/tmp/gpu1.sock".into(),
                id: Some("gpu1".into()),
                pci_segment: Some(1),
                pci_device_id: Some(5),
            })
            .user_device(UserDeviceConfig::new("/tmp/gpu2.sock"))
            .vfio_device("/sys/bus/pci/devices/0000:00:03.0/")
            .extra_args(["-v"]);
        let args = cmd.args().expect("args");
        assert_eq!(
            strs(&args),
            [
                "--api-socket",
                "path=/tmp/ch-api.sock",
                "--kernel",
                "/cache/vmtools/vmlinux",
                "--initramfs",
                "/cache/vmtools/initramfs-base.cpio.gz",
                "--cmdline",
                "console=ttyS0 quiet panic=-1, x=y",
                "--cpus",
                "boot=2",
                "--memory",
                "size=1024M,shared=on",
                "--serial",
                "file=/tmp/serial.log",
                "--console",
                "off",
                "--user-device",
                "socket=/tmp/gpu0.sock,id=gpu0",
                "--user-device",
                "socket=/tmp/gpu1.sock,id=gpu1,pci_segment=1,pci_device_id=5",
                "--user-device",
                "socket=/tmp/gpu2.sock",
                "--device",
                "path=/sys/bus/pci/devices/0000:00:03.0/",
                "-v",
            ]
        );
        let command = cmd.command().expect("command");
        assert_eq!(command.get_program(), OsStr::new("/opt/cloud-hypervisor"));
        assert_eq!(
            command
                .get_args()
                .map(OsStr::to_os_string)
                .collect::<Vec<_>>(),
            args
        );
    }

    #[test]
    fn output_variants() {
        let serial = |o| {
            let args = ChCommand::new("/ch").serial(o).args().expect("args");
            args[5].to_str().expect("utf8").to_owned()
        };
        assert_eq!(serial(Output::Off), "off");
        assert_eq!(serial(Output::Null), "null");
        assert_eq!(serial(Output::Tty), "tty");
        assert_eq!(serial(Output::Pty), "pty");
        assert_eq!(
            serial(Output::Socket("/run/s.sock".into())),
            "socket=/run/s.sock"
        );
        let args = ChCommand::new("/ch")
            .console(Output::Tty)
            .args()
            .expect("args");
        assert_eq!(strs(&args)[6..], ["--console", "tty"]);
    }

    #[test]
    fn unrepresentable_values_are_rejected() {
        for bad in [
            "/tmp/a,b.sock",
            "/tmp/a=b.sock",
            "/tmp/\"q\".sock",
            "/tmp/[x].sock",
            "",
        ] {
            let err = ChCommand::new("/ch")
                .user_device(UserDeviceConfig::new(bad))
                .args()
                .expect_err(bad);
            assert!(
                matches!(
                    err,
                    ChError::InvalidOptionValue {
                        option: "--user-device socket",
                        ..
                    }
                ),
                "{err}"
            );
        }
        let err = ChCommand::new("/ch")
            .user_device(UserDeviceConfig::new("/ok.sock").id("a,b"))
            .args()
            .expect_err("id with comma");
        assert_eq!(
            err.to_string(),
            "Value \"a,b\" for --user-device id cannot be expressed in cloud-hypervisor option syntax"
        );
        let non_utf8 = PathBuf::from(OsString::from_vec(b"/tmp/\xff".to_vec()));
        assert!(ChCommand::new("/ch").api_socket(non_utf8).args().is_err());
        assert!(
            ChCommand::new("/ch")
                .serial(Output::File("/tmp/x,y".into()))
                .args()
                .is_err()
        );
    }
}
