//! Booting a guest: how ([`GuestSpec`]), the running QEMU ([`Guest`]: its serial console,
//! timeouts, a clean power-off) and what it printed ([`GuestOutput`]).

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use switchyard_qemu::{GUEST_BOOT_ARGS, QemuCommand, Serial, VfioUserDevice};

use crate::{GuestEnv, HarnessError, Result, complete_lines, find_line, kill_child, wait_until};

/// How to boot a guest.
#[derive(Debug, Clone)]
pub struct GuestSpec {
    /// The test `/init` runs (`sy.test=`).
    pub test: String,
    /// Its arguments (`sy.arg=`; whitespace is rejected by [`Guest::boot`]).
    pub args: Vec<String>,
    /// More kernel command-line words (e.g. `hugepages=16`; whitespace is rejected by
    /// [`Guest::boot`]).
    pub kernel_args: Vec<String>,
    /// Add `intel-iommu,caching-mode=on` (needed for VFIO in the guest).
    pub iommu: bool,
    /// With `iommu`: also `intremap=on` (interrupt remapping, for nested VFIO).
    pub intremap: bool,
    /// Emulated devices present at boot (`-device SPEC`, e.g. `edu`).
    pub emulated: Vec<String>,
    /// The initramfs to boot instead of [`GuestEnv::initramfs`] (e.g. one from
    /// [`GuestEnv::initramfs_with`]).
    pub initrd: Option<PathBuf>,
    /// vfio-user devices present at boot.
    pub devices: Vec<VfioUserDevice>,
    /// PCIe root ports (for hot-plug).
    pub root_ports: u32,
    /// Start a QMP socket.
    pub qmp: bool,
    /// Guest RAM in MiB.
    pub memory_mib: u64,
    /// vCPUs.
    pub smp: u32,
    /// CPU model (`-cpu`), QEMU's default when `None`.
    pub cpu: Option<String>,
    /// More QEMU arguments (e.g. emulated devices for an L1 host: `-device edu`).
    pub qemu_args: Vec<String>,
    /// Overall timeout.
    pub timeout: Duration,
    /// The QEMU to run instead of [`GuestEnv::qemu`] (e.g. [`GuestEnv::migration_qemu`]).
    pub qemu: Option<PathBuf>,
    /// Wait for an incoming live migration on this unix socket (`-incoming unix:PATH`)
    /// instead of booting.
    pub incoming: Option<PathBuf>,
    /// Names this guest's files (`serial-NAME.log`, `qemu-NAME.log`, `qmp-NAME.sock`), for
    /// tests with several QEMU processes; `None`: `serial.log`, `qemu.log`, `qmp.sock`.
    pub name: Option<String>,
}

impl GuestSpec {
    /// A guest running `test`, 512 MiB, no devices, 240 s timeout.
    pub fn new(test: &str) -> Self {
        GuestSpec {
            test: test.to_owned(),
            args: vec![],
            kernel_args: vec![],
            iommu: false,
            intremap: false,
            emulated: vec![],
            initrd: None,
            devices: vec![],
            root_ports: 0,
            qmp: false,
            memory_mib: 512,
            smp: 1,
            cpu: None,
            qemu_args: vec![],
            timeout: Duration::from_secs(240),
            qemu: None,
            incoming: None,
            name: None,
        }
    }

    /// An L1 guest that plays the host ([`GuestEnv::nested_initramfs`]): runs
    /// `/tests/nested.sh` with `args` (the `sy-nested` scenarios), `-cpu EPYC` (SVM with nested
    /// paging under TCG), 2 vCPUs, 3 GiB, 15 minutes. Scenarios that need cloud-hypervisor
    /// ([`needs_cloud_hypervisor`](crate::needs_cloud_hypervisor)) fail here, before any boot,
    /// when the setup cache has none ([`GuestEnv::cloud_hypervisor`]).
    pub fn nested(env: &GuestEnv, args: &[&str]) -> Result<GuestSpec> {
        if args.iter().any(|a| crate::needs_cloud_hypervisor(a)) {
            env.cloud_hypervisor()?;
        }
        let mut s = GuestSpec::new("nested");
        s.args = args.iter().map(|a| (*a).to_owned()).collect();
        s.cpu = Some("EPYC".into());
        s.smp = 2;
        s.memory_mib = 3072;
        s.initrd = Some(env.nested_initramfs()?);
        s.timeout = Duration::from_secs(900);
        Ok(s)
    }

    /// [`GuestSpec::nested`] with host hardware for VFIO in L1: QEMU's `intel-iommu` with
    /// interrupt remapping (VFIO refuses a group without it), `edus` emulated `edu` devices
    /// (1234:11e8) and, with `igb`, an `igb` NIC on a PCIe root port: an SR-IOV physical
    /// function (8086:10c9) whose VFs (8086:10ca) L1 can create.
    pub fn nested_with_devices(
        env: &GuestEnv,
        args: &[&str],
        edus: u32,
        igb: bool,
    ) -> Result<GuestSpec> {
        let mut s = GuestSpec::nested(env, args)?;
        s.iommu = true;
        s.intremap = true;
        s.emulated = vec!["edu".into(); edus as usize];
        if igb {
            s.qemu_args.extend([
                "-device".into(),
                "pcie-root-port,id=sy-igb-rp,chassis=90,slot=90".into(),
                "-device".into(),
                "igb,bus=sy-igb-rp".into(),
            ]);
        }
        Ok(s)
    }
}

/// A running guest.
#[derive(Debug)]
pub struct Guest {
    child: Option<Child>,
    /// The serial console log.
    pub serial: PathBuf,
    /// QEMU's own stderr.
    pub qemu_log: PathBuf,
    /// The QMP socket, if requested.
    pub qmp: Option<PathBuf>,
    started: Instant,
    timeout: Duration,
}

/// What a finished guest printed.
#[derive(Debug, Clone)]
pub struct GuestOutput {
    /// The serial console.
    pub serial: String,
    /// QEMU's exit status.
    pub status: ExitStatus,
    /// Wall time from QEMU start to exit.
    pub elapsed: Duration,
}

impl GuestOutput {
    /// The exit code `/init` reported for `test` (`GUEST: test NAME rc=N`).
    pub fn test_rc(&self, test: &str) -> Option<i32> {
        let key = format!("GUEST: test {test} rc=");
        self.serial
            .lines()
            .find_map(|l| l.trim().strip_prefix(&key)?.trim().parse().ok())
    }

    /// The JSON after the first line that starts with `prefix`.
    pub fn json_line(&self, prefix: &str) -> Option<serde_json::Value> {
        self.serial
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|j| serde_json::from_str(j.trim()).ok())
    }
}

impl Guest {
    /// Boots QEMU with `spec`; the server(s) must already listen. The test name and its
    /// arguments go on the kernel command line, which the guest splits at whitespace, so any
    /// whitespace in them is an error.
    pub fn boot(env: &GuestEnv, dir: &Path, spec: &GuestSpec) -> Result<Guest> {
        check_spec(spec)?;
        let files = GuestFiles::new(dir, spec);
        let binary = spec.qemu.as_ref().unwrap_or(&env.qemu);
        let mut cmd = qemu_command(env, spec, &files)?
            .command()
            .map_err(HarnessError::Qemu)?;
        let err = File::create(&files.qemu_log)
            .map_err(|e| HarnessError::Io("create qemu log".into(), e))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError::Io(format!("spawn {}", binary.display()), e))?;
        Ok(Guest {
            child: Some(child),
            serial: files.serial,
            qemu_log: files.qemu_log,
            qmp: files.qmp,
            started: Instant::now(),
            timeout: spec.timeout,
        })
    }

    /// The serial console so far.
    pub fn serial_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = File::open(&self.serial) {
            let _ = f.seek(SeekFrom::Start(0));
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    fn remaining(&self) -> Duration {
        self.timeout.saturating_sub(self.started.elapsed())
    }

    /// QEMU's exit status if it has exited (without blocking).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Waits until the console has a complete line starting with `prefix` (within the guest's
    /// overall timeout) and returns that line, trimmed (see [`find_line`]). Fails early if QEMU
    /// exits first.
    pub fn wait_for_line(&mut self, prefix: &str) -> Result<String> {
        let t = self.remaining();
        wait_until(t, &format!("a guest output line `{prefix}...`"), || {
            // Exit status first, text second: a line written just before QEMU exited is seen.
            let exited = self.exited();
            if let Some(l) = find_line(&self.serial_text(), prefix) {
                return Some(Ok(l.to_owned()));
            }
            exited.map(|st| Err(HarnessError::Exited("QEMU", st)))
        })?
    }

    /// Waits for QEMU to exit (the guest powers off after its test). Fails unless QEMU exited
    /// successfully after the guest printed `GUEST: poweroff`, so a QEMU crash or a guest
    /// that died another way is an error even when the test's own markers are all there.
    pub fn wait(mut self) -> Result<GuestOutput> {
        let t = self.remaining();
        let status = wait_until(t, "the guest to power off", || {
            self.child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
        });
        let status = match status {
            Ok(s) => s,
            Err(e) => {
                if let Some(mut c) = self.child.take() {
                    kill_child(&mut c);
                }
                return Err(e);
            }
        };
        self.child = None;
        let serial = self.serial_text();
        let powered_off = complete_lines(&serial)
            .lines()
            .any(|l| l.trim() == "GUEST: poweroff");
        if !status.success() || !powered_off {
            return Err(HarnessError::Unclean(format!(
                "QEMU exited with {status}, {} (see {} and {})",
                if powered_off {
                    "after `GUEST: poweroff`"
                } else {
                    "but the guest never printed `GUEST: poweroff`"
                },
                self.serial.display(),
                self.qemu_log.display()
            )));
        }
        Ok(GuestOutput {
            serial,
            status,
            elapsed: self.started.elapsed(),
        })
    }
}

/// The files a guest's QEMU writes (see [`GuestSpec::name`]).
struct GuestFiles {
    serial: PathBuf,
    qemu_log: PathBuf,
    qmp: Option<PathBuf>,
}

impl GuestFiles {
    fn new(dir: &Path, spec: &GuestSpec) -> GuestFiles {
        let file = |stem: &str, ext: &str| match &spec.name {
            Some(n) => dir.join(format!("{stem}-{n}.{ext}")),
            None => dir.join(format!("{stem}.{ext}")),
        };
        GuestFiles {
            serial: file("serial", "log"),
            qemu_log: file("qemu", "log"),
            qmp: spec.qmp.then(|| file("qmp", "sock")),
        }
    }
}

/// Refuses a spec whose words the guest would split (see [`Guest::boot`]).
fn check_spec(spec: &GuestSpec) -> Result<()> {
    for (what, v) in std::iter::once(("test name", &spec.test))
        .chain(spec.args.iter().map(|a| ("argument", a)))
        .chain(spec.kernel_args.iter().map(|a| ("kernel argument", a)))
    {
        if v.is_empty() || v.chars().any(char::is_whitespace) {
            return Err(HarnessError::BadSpec(format!(
                "{what} {v:?} is empty or contains whitespace (the guest would split it)"
            )));
        }
    }
    Ok(())
}

/// The kernel command line of a guest: the console, a panic that ends QEMU,
/// [`GUEST_BOOT_ARGS`], the vIOMMU's switch, the spec's words and the test keys.
fn kernel_cmdline(spec: &GuestSpec) -> String {
    let mut append = format!("console=ttyS0 panic=-1 quiet {GUEST_BOOT_ARGS}");
    if spec.iommu {
        append.push_str(" intel_iommu=on");
    }
    for a in &spec.kernel_args {
        append.push(' ');
        append.push_str(a);
    }
    append.push_str(&format!(" sy.test={}", spec.test));
    for a in &spec.args {
        append.push_str(&format!(" sy.arg={a}"));
    }
    append
}

/// The QEMU command that boots `spec`, writing `files`.
fn qemu_command(env: &GuestEnv, spec: &GuestSpec, files: &GuestFiles) -> Result<QemuCommand> {
    let initrd = match &spec.initrd {
        Some(p) => p.clone(),
        None => env.initramfs()?,
    };
    let binary = spec.qemu.as_ref().unwrap_or(&env.qemu);
    let mut q = QemuCommand::new(binary)
        .memory_mib(spec.memory_mib)
        .smp(spec.smp)
        .serial(Serial::File(files.serial.clone()))
        .kernel(&env.vmlinux)
        .initrd(initrd)
        .append(kernel_cmdline(spec))
        .intel_iommu(spec.iommu)
        .intel_iommu_intremap(spec.intremap)
        .root_ports(spec.root_ports);
    if let Some(cpu) = &spec.cpu {
        q = q.cpu(cpu);
    }
    q = q.extra_args(&spec.qemu_args);
    if let Some(path) = &spec.incoming {
        let mut uri = std::ffi::OsString::from("unix:");
        uri.push(path);
        q = q.extra_arg("-incoming").extra_arg(uri);
    }
    for d in &spec.emulated {
        q = q.device(d.clone());
    }
    for d in &spec.devices {
        q = q.vfio_user_device(d.clone());
    }
    if let Some(p) = &files.qmp {
        q = q.qmp_socket(p);
    }
    Ok(q)
}

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nowhere() -> GuestEnv {
        let none = PathBuf::from("/nonexistent");
        GuestEnv {
            repo: none.clone(),
            cache: none.clone(),
            qemu: none.clone(),
            vmlinux: none.clone(),
            switchyard: none.clone(),
            driver: none.clone(),
            work: none,
        }
    }

    #[test]
    fn whitespace_in_guest_args_is_rejected() {
        let none = PathBuf::from("/nonexistent");
        let env = nowhere();
        for (test, args, kernel_args) in [
            ("sygpu-driver", vec!["--bdf 0000:00:04.0"], vec![]),
            ("a b", vec![], vec![]),
            ("sygpu-driver", vec![], vec!["hugepages=16 sy.shell"]),
            ("sygpu-driver", vec![], vec![""]),
        ] {
            let mut spec = GuestSpec::new(test);
            spec.args = args.into_iter().map(String::from).collect();
            spec.kernel_args = kernel_args.into_iter().map(String::from).collect();
            let err = Guest::boot(&env, &none, &spec).expect_err("rejected");
            assert!(matches!(err, HarnessError::BadSpec(_)), "{err}");
        }
    }

    /// The kernel command line QEMU gets, read back from its argv.
    fn append_of(spec: &GuestSpec) -> String {
        let dir = Path::new("/nonexistent");
        let argv = qemu_command(&nowhere(), spec, &GuestFiles::new(dir, spec))
            .expect("command")
            .args()
            .expect("argv");
        let i = argv.iter().position(|a| a == "-append").expect("-append");
        argv[i + 1].to_str().expect("UTF-8").to_owned()
    }

    #[test]
    fn every_guest_boots_with_the_arguments_for_a_loaded_tcg_host() {
        let mut plain = GuestSpec::new("sygpu-driver");
        plain.initrd = Some(PathBuf::from("/nonexistent/initrd"));
        let mut nested = plain.clone();
        nested.test = "nested".into();
        nested.iommu = true;
        nested.intremap = true;
        nested.kernel_args = vec!["hugepages=16".into()];
        nested.args = vec!["qemu-softgpu".into()];
        for spec in [plain, nested] {
            let append = append_of(&spec);
            let words: Vec<&str> = append.split_whitespace().collect();
            assert!(words.contains(&"no_timer_check"), "{append}");
            for w in GUEST_BOOT_ARGS.split_whitespace() {
                assert!(words.contains(&w), "{append}");
            }
            let test = format!("sy.test={}", spec.test);
            assert!(words.contains(&test.as_str()), "{append}");
        }
    }
}
