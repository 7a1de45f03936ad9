//! Booting a guest: how ([`GuestSpec`]), the running QEMU ([`Guest`]: its serial console,
//! timeouts, a boot that panicked booted again once, a clean power-off) and what it printed
//! ([`GuestOutput`]).

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use switchyard_qemu::{GUEST_BOOT_ARGS, QemuCommand, Serial, VfioUserDevice};

use crate::boot::{BOOT_ATTEMPTS, BootState, boot_state};
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
    /// Wait for an incoming live migration at this URI (`-incoming URI`, e.g.
    /// `tcp:10.0.0.2:4444`) instead of booting.
    pub incoming_uri: Option<String>,
    /// Run QEMU in this network namespace (`ip netns exec NS`; root only), e.g. one of
    /// [`crate::TwoHosts`]'. Its UNIX sockets (QMP, vfio-user) work as anywhere.
    pub netns: Option<String>,
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
            incoming_uri: None,
            netns: None,
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
        // Resets logged (a few at boot): an L1 that triple-faults says so in qemu.log
        // (`crate::nested`).
        s.qemu_args.extend(["-d".into(), "cpu_reset".into()]);
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
    /// While its test has not started: what booting it again takes. `None` once the test
    /// started (or QEMU exited without a boot panic: the waits report that), and for an
    /// incoming migration's destination, which does not boot.
    booting: Option<Booting>,
}

/// A guest whose test has not started yet: what [`Guest::booted`] needs to boot it again.
#[derive(Debug)]
struct Booting {
    env: GuestEnv,
    spec: GuestSpec,
    /// Which boot this is (1, then at most [`BOOT_ATTEMPTS`]).
    boot: u32,
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
    /// Boots QEMU with `spec` and waits until the guest's `/init` starts its test
    /// ([`Guest::booted`]: a guest whose kernel panicked before that is booted again once);
    /// the server(s) must already listen. The test name and its arguments go on the kernel
    /// command line, which the guest splits at whitespace, so any whitespace in them is an
    /// error. A destination of an incoming migration ([`GuestSpec::incoming`]) does not boot:
    /// it is returned as soon as QEMU runs.
    pub fn boot(env: &GuestEnv, dir: &Path, spec: &GuestSpec) -> Result<Guest> {
        let mut guest = Guest::start(env, dir, spec)?;
        guest.booted()?;
        Ok(guest)
    }

    /// Starts QEMU with `spec` like [`Guest::boot`] but returns at once, for guests that boot
    /// side by side; [`Guest::wait_for_line`] and [`Guest::wait`] wait for [`Guest::booted`]
    /// first. Until then the guest may be booted again: a QMP connection made before is then
    /// to a QEMU that is gone.
    pub fn start(env: &GuestEnv, dir: &Path, spec: &GuestSpec) -> Result<Guest> {
        check_spec(spec)?;
        let files = GuestFiles::new(dir, spec);
        let child = spawn_qemu(env, spec, &files)?;
        Ok(Guest {
            child: Some(child),
            serial: files.serial,
            qemu_log: files.qemu_log,
            qmp: files.qmp,
            started: Instant::now(),
            timeout: spec.timeout,
            booting: (spec.incoming.is_none() && spec.incoming_uri.is_none()).then(|| Booting {
                env: env.clone(),
                spec: spec.clone(),
                boot: 1,
            }),
        })
    }

    /// Waits until the guest's `/init` starts its test (`GUEST: test NAME start`; see
    /// [`boot_state`]). A guest whose kernel panicked before that is
    /// booted again, once ([`BOOT_ATTEMPTS`]): said on stderr (`BOOT-PANIC:` with the panic's
    /// line, shown even when the test passes), the failed boot's console and QEMU log kept
    /// as `serial.boot-1.log` and `qemu.boot-1.log`; the new boot has the spec's whole
    /// timeout. A second boot panic is an error ([`HarnessError::BootPanic`]); a panic after
    /// the test started is the test's failure and never booted again. Returns at once once
    /// the test started; if QEMU exits first without a panic, the waits say so.
    pub fn booted(&mut self) -> Result<()> {
        while let Some(test) = self.booting.as_ref().map(|b| b.spec.test.clone()) {
            let what = format!("the guest's test to start (`GUEST: test {test} start`)");
            let state = wait_until(self.remaining(), &what, || {
                // Exit status first, text second: a line written just before QEMU exited is seen.
                let exited = self.exited();
                match boot_state(&self.serial_text(), &test) {
                    BootState::Booting => exited.map(|_| BootState::Booting),
                    done => Some(done),
                }
            })?;
            match state {
                BootState::Panicked(line) => self.boot_again(&line)?,
                BootState::TestStarted | BootState::Booting => self.booting = None,
            }
        }
        Ok(())
    }

    /// Stops a guest whose kernel panicked at boot (`panic`: the line) and boots it again, or
    /// fails if that was its last boot.
    fn boot_again(&mut self, panic: &str) -> Result<()> {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
        let Some(mut b) = self.booting.take() else {
            return Ok(());
        };
        if b.boot >= BOOT_ATTEMPTS {
            return Err(HarnessError::BootPanic(format!(
                "boot {} of {BOOT_ATTEMPTS}: {panic} (consoles in {} and beside it)",
                b.boot,
                self.serial.display()
            )));
        }
        let kept = |p: &Path| p.with_extension(format!("boot-{}.log", b.boot));
        let (serial, qemu_log) = (kept(&self.serial), kept(&self.qemu_log));
        let _ = fs::rename(&self.serial, &serial);
        let _ = fs::rename(&self.qemu_log, &qemu_log);
        if let Some(q) = &self.qmp {
            let _ = fs::remove_file(q);
        }
        // Past the test harness's capture: said even when the next boot passes.
        let _ = writeln!(
            std::io::stderr(),
            "BOOT-PANIC: the guest's kernel panicked at boot {} of {BOOT_ATTEMPTS}, before the \
             test's own code ran: {panic}; its console is kept in {}; booting again once",
            b.boot,
            serial.display()
        );
        let files = GuestFiles {
            serial: self.serial.clone(),
            qemu_log: self.qemu_log.clone(),
            qmp: self.qmp.clone(),
        };
        self.child = Some(spawn_qemu(&b.env, &b.spec, &files)?);
        self.started = Instant::now();
        b.boot += 1;
        self.booting = Some(b);
        Ok(())
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
    /// exits first. Waits for [`Guest::booted`] first.
    pub fn wait_for_line(&mut self, prefix: &str) -> Result<String> {
        self.booted()?;
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
    /// Waits for [`Guest::booted`] first.
    pub fn wait(mut self) -> Result<GuestOutput> {
        self.booted()?;
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
                "QEMU exited with {status}, {} (see {} and {}); the console's last lines:\n{}",
                if powered_off {
                    "after `GUEST: poweroff`"
                } else {
                    "but the guest never printed `GUEST: poweroff`"
                },
                self.serial.display(),
                self.qemu_log.display(),
                last_lines(&serial, UNCLEAN_CONSOLE_LINES)
            )));
        }
        Ok(GuestOutput {
            serial,
            status,
            elapsed: self.started.elapsed(),
        })
    }
}

/// How many of the console's last lines an unclean end quotes: CI keeps only the test's
/// output, not the log files, and a kernel's crash report fits in this many.
const UNCLEAN_CONSOLE_LINES: usize = 80;

/// The last `n` lines of `text`, each indented for a report.
fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().map(str::trim_end).collect();
    let from = lines.len().saturating_sub(n);
    lines[from..].iter().map(|l| format!("  | {l}\n")).collect()
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

/// Starts QEMU for `spec`, writing `files` (its stderr truncated).
fn spawn_qemu(env: &GuestEnv, spec: &GuestSpec, files: &GuestFiles) -> Result<Child> {
    let binary = spec.qemu.as_ref().unwrap_or(&env.qemu);
    let q = qemu_command(env, spec, files)?;
    let mut cmd = match &spec.netns {
        // `ip netns exec` enters the namespace and execs QEMU: the child is QEMU.
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns])
                .arg(binary)
                .args(q.args().map_err(HarnessError::Qemu)?);
            c
        }
        None => q.command().map_err(HarnessError::Qemu)?,
    };
    let err =
        File::create(&files.qemu_log).map_err(|e| HarnessError::Io("create qemu log".into(), e))?;
    cmd.stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(err)
        .spawn()
        .map_err(|e| HarnessError::Io(format!("spawn {}", binary.display()), e))
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
    if let Some(uri) = &spec.incoming_uri {
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

    /// A guest of `testdata/fake-qemu`: its Nth boot prints `consoles[N-1]` and exits.
    struct FakeGuest {
        env: GuestEnv,
        dir: PathBuf,
        spec: GuestSpec,
    }

    impl FakeGuest {
        fn new(name: &str, consoles: &[&str]) -> FakeGuest {
            let dir = std::env::temp_dir().join(format!("sy-boot-{}-{name}", std::process::id()));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).expect("test dir");
            for (i, c) in consoles.iter().enumerate() {
                fs::write(dir.join(format!("console-{}", i + 1)), c).expect("console");
            }
            let mut env = nowhere();
            env.qemu = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/fake-qemu");
            let mut spec = GuestSpec::new("sygpu-driver");
            spec.initrd = Some(dir.join("initrd"));
            spec.timeout = Duration::from_secs(60);
            FakeGuest { env, dir, spec }
        }

        fn boot(&self) -> Result<Guest> {
            Guest::boot(&self.env, &self.dir, &self.spec)
        }

        /// How many times QEMU was started.
        fn boots(&self) -> u32 {
            let n = fs::read_to_string(self.dir.join("boots")).unwrap_or_default();
            n.trim().parse().unwrap_or(0)
        }

        fn text(&self, file: &str) -> String {
            fs::read_to_string(self.dir.join(file)).unwrap_or_default()
        }
    }

    impl Drop for FakeGuest {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }

    const BOOT_PANIC: &str = "\
[    0.634567] Kernel panic - not syncing: timer doesn't work through Interrupt-remapped IO-APIC
";

    const PASSES: &str = "\
GUEST: boot kernel=6.12.117+deb13-amd64 modules=5/5 test=sygpu-driver uptime=2.71
GUEST: test sygpu-driver start args=
SYGPU: done: pass in 943 ms
GUEST: test sygpu-driver rc=0
GUEST: poweroff
";

    #[test]
    fn a_guest_that_panics_at_boot_is_booted_again_once() {
        let g = FakeGuest::new("again", &[BOOT_PANIC, PASSES]);
        let out = g
            .boot()
            .expect("booted")
            .wait()
            .expect("the second boot passes");
        assert_eq!(g.boots(), 2);
        assert_eq!(out.test_rc("sygpu-driver"), Some(0), "{}", out.serial);
        // The failed boot's console is kept beside the new one's.
        assert_eq!(g.text("serial.boot-1.log"), BOOT_PANIC);
        assert_eq!(g.text("serial.log"), PASSES);
        assert!(g.dir.join("qemu.boot-1.log").exists());
    }

    #[test]
    fn a_second_boot_panic_fails_the_test() {
        let g = FakeGuest::new("twice", &[BOOT_PANIC, BOOT_PANIC, PASSES]);
        let err = g.boot().expect_err("two boot panics");
        assert!(
            matches!(&err, HarnessError::BootPanic(m) if m.contains("boot 2 of 2")
                && m.contains("timer doesn't work")),
            "{err}"
        );
        assert_eq!(g.boots(), 2, "booted again once, not twice");
    }

    #[test]
    fn a_panic_after_the_test_started_is_the_tests_failure() {
        let in_test = "\
GUEST: test sygpu-driver start args=
[    5.123456] Kernel panic - not syncing: Attempted to kill init! exitcode=0x00000009
";
        let g = FakeGuest::new("in-test", &[in_test, PASSES]);
        let err = g
            .boot()
            .expect("the test started")
            .wait()
            .expect_err("panicked");
        assert!(matches!(err, HarnessError::Unclean(_)), "{err}");
        assert!(
            err.to_string()
                .contains("  | [    5.123456] Kernel panic - not syncing: Attempted to kill init!"),
            "the report quotes the console: {err}"
        );
        assert_eq!(g.boots(), 1, "never booted again");
    }

    #[test]
    fn a_guest_started_beside_others_is_booted_again_in_its_wait() {
        let g = FakeGuest::new("started", &[BOOT_PANIC, PASSES]);
        let mut guest = Guest::start(&g.env, &g.dir, &g.spec).expect("started");
        let line = guest
            .wait_for_line("SYGPU: done:")
            .expect("the second boot's line");
        assert_eq!(line, "SYGPU: done: pass in 943 ms");
        assert_eq!(g.boots(), 2);
    }
}
