//! A harness for tests that boot real guests.
//!
//! It starts `switchyard serve` on a fresh socket and waits until it listens, boots QEMU under
//! TCG (never KVM: `/dev/kvm` on our machines is PVM and cannot boot a stock kernel) with guest
//! RAM as a shared memfd, reads the guest's serial console from a file, enforces timeouts,
//! kills only the processes it started, and keeps the guest, server and QEMU logs of every
//! test under `target/guest-tests/logs/<test>/` (printed when the test fails).
//!
//! The serial console is read while QEMU is still writing it, so everything that looks at it
//! before QEMU has exited considers only complete lines ([`complete_lines`]).
//!
//! Guest tests are `#[ignore]`d, so a plain `cargo test` reports them as ignored, never as
//! passed; `scripts/test.sh` runs them with `--include-ignored`. When they run and QEMU, the
//! kernel or the in-guest driver are missing they fail with a message saying how to set them up
//! (`scripts/setup.sh`); there is no switch that skips them.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod nested;
pub use nested::{NESTED_ATTEMPTS, boot_nested, nested_fault};

use std::fs::{self, File};
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use switchyard_qemu::{QemuCommand, Serial, VfioUserDevice};

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A required file is missing.
    #[error("{what} not found at {path}: {hint}")]
    Missing {
        /// What is missing.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// How to get it.
        hint: &'static str,
    },
    /// Starting or talking to a process failed.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// A step did not happen in time.
    #[error("Timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// A process exited unexpectedly.
    #[error("{0} exited early: {1}")]
    Exited(&'static str, ExitStatus),
    /// The guest ended without powering off cleanly.
    #[error("The guest did not finish cleanly: {0}")]
    Unclean(String),
    /// A [`GuestSpec`] that cannot be passed on the kernel command line.
    #[error("Bad guest spec: {0}")]
    BadSpec(String),
    /// Building the QEMU command line failed.
    #[error("Cannot build the QEMU command line")]
    Qemu(#[source] switchyard_qemu::QemuError),
    /// Building the initramfs failed.
    #[error("Building the initramfs failed: {0}")]
    Initramfs(String),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, HarnessError>;

/// Where everything a guest test needs lives.
#[derive(Debug, Clone)]
pub struct GuestEnv {
    /// Repository root.
    pub repo: PathBuf,
    /// The setup cache (`SWITCHYARD_CACHE` or `.cache/vmtools`).
    pub cache: PathBuf,
    /// The QEMU wrapper.
    pub qemu: PathBuf,
    /// The PVH guest kernel.
    pub vmlinux: PathBuf,
    /// The `switchyard` binary (`SWITCHYARD_BIN`, else `target/{release,debug}/switchyard`).
    pub switchyard: PathBuf,
    /// The static in-guest driver (`SYGPU_DRIVER`, else the static release build).
    pub driver: PathBuf,
    /// Scratch and logs (`target/guest-tests`).
    pub work: PathBuf,
}

const SETUP_HINT: &str = "run scripts/setup.sh (or scripts/test.sh, which sets everything up)";

fn must_exist(what: &'static str, path: PathBuf, hint: &'static str) -> Result<PathBuf> {
    if path.exists() {
        Ok(path)
    } else {
        Err(HarnessError::Missing { what, path, hint })
    }
}

impl GuestEnv {
    /// Finds QEMU, the kernel, the server and the driver.
    pub fn discover() -> Result<GuestEnv> {
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let repo = repo.canonicalize().unwrap_or(repo);
        let cache = std::env::var_os("SWITCHYARD_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| repo.join(".cache/vmtools"));
        Self::discover_in(repo, cache)
    }

    /// [`GuestEnv::discover`] with the setup cache at `cache`.
    fn discover_in(repo: PathBuf, cache: PathBuf) -> Result<GuestEnv> {
        let qemu = must_exist("QEMU", cache.join("qemu"), SETUP_HINT)?;
        let vmlinux = must_exist("guest kernel", cache.join("vmlinux"), SETUP_HINT)?;
        let target = repo.join("target");
        let switchyard = match std::env::var_os("SWITCHYARD_BIN") {
            Some(p) => PathBuf::from(p),
            None => [
                target.join("release/switchyard"),
                target.join("debug/switchyard"),
            ]
            .into_iter()
            .filter(|p| p.exists())
            .max_by_key(|p| fs::metadata(p).and_then(|m| m.modified()).ok())
            .unwrap_or_else(|| target.join("debug/switchyard")),
        };
        let switchyard = must_exist(
            "switchyard binary",
            switchyard,
            "build it with `cargo build -p switchyard` or set SWITCHYARD_BIN",
        )?;
        let driver = std::env::var_os("SYGPU_DRIVER")
            .map(PathBuf::from)
            .unwrap_or_else(|| target.join("x86_64-unknown-linux-gnu/release/sygpu-driver"));
        let driver = must_exist(
            "static in-guest driver",
            driver,
            "build it with `RUSTFLAGS=\"-C target-feature=+crt-static\" cargo build --release \
             -p sygpu-driver --target x86_64-unknown-linux-gnu` or set SYGPU_DRIVER",
        )?;
        let work = target.join("guest-tests");
        fs::create_dir_all(&work)
            .map_err(|e| HarnessError::Io(format!("mkdir {}", work.display()), e))?;
        Ok(GuestEnv {
            repo,
            cache,
            qemu,
            vmlinux,
            switchyard,
            driver,
            work,
        })
    }

    /// The environment for a test; a missing prerequisite fails the test with a message saying
    /// how to set it up.
    pub fn for_test() -> GuestEnv {
        GuestEnv::discover().unwrap_or_else(|e| panic!("guest test environment incomplete: {e}"))
    }

    /// The test initramfs `target/guest-tests/initramfs.cpio.gz`: the base image plus the
    /// driver (built once per test process). It is built under a name of this process and
    /// renamed into place, so processes building it at the same time never see a partial
    /// archive, and a build never leaves a file behind.
    pub fn initramfs(&self) -> Result<PathBuf> {
        static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
        BUILT
            .get_or_init(|| {
                let add = vec!["--add".into(), self.driver.clone().into_os_string()];
                self.build_image("initramfs.cpio.gz", &add)
            })
            .clone()
            .map_err(HarnessError::Initramfs)
    }

    /// The L1 image of the nested tests, `target/guest-tests/initramfs-l1.cpio.gz`: a guest
    /// that plays the host (`build-initramfs.sh --nested`: KVM modules, cloud-hypervisor,
    /// ch-remote; `--qemu`: QEMU for L2s with KVM) with a static `switchyard`, `sy-nested`,
    /// the kernel and the L2 image (the driver, `sy-mmio`, `sy-edu`) under `/l2/`. Built once
    /// per test process.
    pub fn nested_initramfs(&self) -> Result<PathBuf> {
        static BUILT: OnceLock<std::result::Result<PathBuf, String>> = OnceLock::new();
        let bins = self.nested_binaries()?;
        BUILT
            .get_or_init(|| {
                let mut l2_add: Vec<std::ffi::OsString> = vec!["--strip".into()];
                for b in [&self.driver, &bins.sy_mmio, &bins.sy_edu] {
                    l2_add.push("--add".into());
                    l2_add.push(b.clone().into_os_string());
                }
                let l2 = self.build_image("initramfs-l2.cpio.gz", &l2_add)?;
                let mut add: Vec<std::ffi::OsString> =
                    vec!["--nested".into(), "--qemu".into(), "--strip".into()];
                let mut put = |from: &Path, to: &str| {
                    let mut a = from.as_os_str().to_owned();
                    a.push(":");
                    a.push(to);
                    add.push("--add".into());
                    add.push(a);
                };
                put(&bins.switchyard, "/usr/bin/switchyard");
                put(&bins.sy_nested, "/usr/bin/sy-nested");
                put(&self.driver, "/usr/bin/sygpu-driver");
                put(&self.vmlinux, "/l2/vmlinux");
                put(&l2, "/l2/initramfs.cpio.gz");
                self.build_image("initramfs-l1.cpio.gz", &add)
            })
            .clone()
            .map_err(HarnessError::Initramfs)
    }

    /// The static binaries an L1 image needs: `switchyard` (`SWITCHYARD_STATIC_BIN`) and
    /// `sy-nested` (`SY_NESTED_BIN`), by default from the static release build.
    pub fn nested_binaries(&self) -> Result<NestedBinaries> {
        let static_dir = self.repo.join("target/x86_64-unknown-linux-gnu/release");
        let pick = |var: &str, name: &str| {
            std::env::var_os(var)
                .map(PathBuf::from)
                .unwrap_or_else(|| static_dir.join(name))
        };
        const HINT: &str = "build them with `RUSTFLAGS=\"-C target-feature=+crt-static\" cargo \
             build --release -p switchyard -p sy-nested --target x86_64-unknown-linux-gnu` \
             (scripts/test.sh does)";
        let sy_nested = must_exist("static sy-nested", pick("SY_NESTED_BIN", "sy-nested"), HINT)?;
        let sy_mmio = must_exist("static sy-mmio", sy_nested.with_file_name("sy-mmio"), HINT)?;
        let sy_edu = must_exist("static sy-edu", sy_nested.with_file_name("sy-edu"), HINT)?;
        Ok(NestedBinaries {
            switchyard: must_exist(
                "static switchyard",
                pick("SWITCHYARD_STATIC_BIN", "switchyard"),
                HINT,
            )?,
            sy_nested,
            sy_mmio,
            sy_edu,
        })
    }

    /// Runs `images/build-initramfs.sh` into `work/NAME`: built under a name of this process
    /// and renamed into place, so processes building it at the same time never see a partial
    /// archive, and a failed build leaves nothing behind.
    fn build_image(
        &self,
        name: &str,
        args: &[std::ffi::OsString],
    ) -> std::result::Result<PathBuf, String> {
        let out = self.work.join(name);
        let tmp = self
            .work
            .join(format!(".{name}.{}.tmp", std::process::id()));
        let built = Command::new(self.repo.join("images/build-initramfs.sh"))
            .arg(&tmp)
            .args(args)
            .env("SWITCHYARD_CACHE", &self.cache)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| format!("images/build-initramfs.sh: {e}"))
            .and_then(|status| {
                if status.success() {
                    Ok(())
                } else {
                    Err(format!("images/build-initramfs.sh exited with {status}"))
                }
            })
            .and_then(|()| {
                fs::rename(&tmp, &out)
                    .map_err(|e| format!("rename {} to {}: {e}", tmp.display(), out.display()))
            });
        if let Err(e) = built {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        Ok(out)
    }

    /// A static binary for the guest: `$var` if set, else `target/x86_64-unknown-linux-gnu/
    /// release/NAME` (what `RUSTFLAGS="-C target-feature=+crt-static" cargo build --release
    /// -p PACKAGE --target x86_64-unknown-linux-gnu` makes).
    pub fn static_binary(&self, name: &str, var: &str) -> Result<PathBuf> {
        let path = std::env::var_os(var).map(PathBuf::from).unwrap_or_else(|| {
            self.repo
                .join("target/x86_64-unknown-linux-gnu/release")
                .join(name)
        });
        if path.exists() {
            Ok(path)
        } else {
            Err(HarnessError::Initramfs(format!(
                "static {name} not found at {} (set {var} or build it: RUSTFLAGS=\"-C \
                 target-feature=+crt-static\" cargo build --release --target \
                 x86_64-unknown-linux-gnu)",
                path.display()
            )))
        }
    }

    /// An initramfs `target/guest-tests/NAME.cpio.gz`: the base image plus `files` (each in
    /// `/usr/bin`), built now (under a name of this process, then renamed into place).
    pub fn initramfs_with(&self, name: &str, files: &[PathBuf]) -> Result<PathBuf> {
        let out = self.work.join(format!("{name}.cpio.gz"));
        let tmp = self
            .work
            .join(format!(".{name}.cpio.gz.{}.tmp", std::process::id()));
        let mut cmd = Command::new(self.repo.join("images/build-initramfs.sh"));
        cmd.arg(&tmp);
        for f in files {
            cmd.arg("--add").arg(f);
        }
        let status = cmd
            .env("SWITCHYARD_CACHE", &self.cache)
            .stdout(Stdio::null())
            .status()
            .map_err(|e| HarnessError::Initramfs(format!("images/build-initramfs.sh: {e}")))?;
        if !status.success() {
            let _ = fs::remove_file(&tmp);
            return Err(HarnessError::Initramfs(format!(
                "images/build-initramfs.sh exited with {status}"
            )));
        }
        fs::rename(&tmp, &out).map_err(|e| {
            HarnessError::Io(format!("rename {} to {}", tmp.display(), out.display()), e)
        })?;
        Ok(out)
    }

    /// A log directory for `test`, emptied.
    pub fn log_dir(&self, test: &str) -> Result<PathBuf> {
        let dir = self.work.join("logs").join(test);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir)
            .map_err(|e| HarnessError::Io(format!("mkdir {}", dir.display()), e))?;
        Ok(dir)
    }
}

/// The complete lines of `text`: everything up to and including its last `'\n'` (nothing if it
/// has none). A file another process is writing may end in a partly written line.
pub fn complete_lines(text: &str) -> &str {
    text.rfind('\n').map_or("", |i| &text[..=i])
}

/// The first complete line of `text` that starts with `prefix` (after trimming whitespace,
/// including the serial console's `\r`), trimmed.
pub fn find_line<'a>(text: &'a str, prefix: &str) -> Option<&'a str> {
    complete_lines(text)
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with(prefix))
}

/// Polls `f` every 20 ms until it returns `Some` or `timeout` passes.
pub fn wait_until<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> Result<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Ok(v);
        }
        if Instant::now() >= deadline {
            return Err(HarnessError::Timeout(timeout, what.to_owned()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn kill_child(child: &mut Child) {
    if matches!(child.try_wait(), Ok(None)) {
        let _ = child.kill();
    }
    let _ = child.wait();
}

/// A `switchyard serve` process started by the harness.
#[derive(Debug)]
pub struct Server {
    child: Option<Child>,
    /// Its socket.
    pub socket: PathBuf,
    /// Its stderr log.
    pub log: PathBuf,
}

impl Server {
    /// Starts the server with `device` (e.g. `softgpu,vram=64M`) and waits for its socket.
    pub fn start(env: &GuestEnv, dir: &Path, device: &str) -> Result<Server> {
        Self::start_with(env, dir, device, &[])
    }

    /// Like [`Server::start`], with more `switchyard serve` arguments.
    pub fn start_with(env: &GuestEnv, dir: &Path, device: &str, extra: &[&str]) -> Result<Server> {
        let rust_log = std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into());
        Self::start_logging(env, dir, device, extra, &rust_log)
    }

    /// Like [`Server::start_with`], with the server's `RUST_LOG` filter.
    pub fn start_logging(
        env: &GuestEnv,
        dir: &Path,
        device: &str,
        extra: &[&str],
        rust_log: &str,
    ) -> Result<Server> {
        let socket = dir.join("gpu.sock");
        let log = dir.join("server.log");
        let err =
            File::create(&log).map_err(|e| HarnessError::Io("create server log".into(), e))?;
        let child = Command::new(&env.switchyard)
            .args(["serve", "--socket"])
            .arg(&socket)
            .args(["--device", device])
            .args(extra)
            .env("RUST_LOG", rust_log)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError::Io(format!("spawn {}", env.switchyard.display()), e))?;
        let mut s = Server {
            child: Some(child),
            socket,
            log,
        };
        wait_until(Duration::from_secs(20), "the server socket", || {
            if let Some(c) = s.child.as_mut()
                && let Ok(Some(_)) = c.try_wait()
            {
                return Some(false);
            }
            s.socket.exists().then_some(true)
        })
        .and_then(|ok| {
            if ok {
                Ok(())
            } else {
                let st = s.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                Err(HarnessError::Exited("switchyard", st.unwrap_or_default()))
            }
        })?;
        Ok(s)
    }

    /// The server's log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the server is still running.
    pub fn alive(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    /// SIGTERM and wait; returns the exit status.
    pub fn terminate(&mut self) -> Option<ExitStatus> {
        let mut c = self.child.take()?;
        if let Some(pid) = rustix::process::Pid::from_raw(c.id() as i32) {
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(st)) = c.try_wait() {
                return Some(st);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        kill_child(&mut c);
        None
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }
}

/// Static binaries for an L1 image ([`GuestEnv::nested_binaries`]).
#[derive(Debug, Clone)]
pub struct NestedBinaries {
    /// `switchyard`, linked statically.
    pub switchyard: PathBuf,
    /// `sy-nested` (guest-tests/nested), linked statically.
    pub sy_nested: PathBuf,
    /// `sy-mmio` (guest-tests/nested), next to `sy-nested`; runs in L2.
    pub sy_mmio: PathBuf,
    /// `sy-edu` (guest-tests/nested), next to `sy-nested`; runs in L2.
    pub sy_edu: PathBuf,
}

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
        }
    }

    /// An L1 guest that plays the host ([`GuestEnv::nested_initramfs`]): runs
    /// `/tests/nested.sh` with `args` (the `sy-nested` scenarios), `-cpu EPYC` (SVM with nested
    /// paging under TCG), 2 vCPUs, 3 GiB, 15 minutes.
    pub fn nested(env: &GuestEnv, args: &[&str]) -> Result<GuestSpec> {
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
        let initrd = match &spec.initrd {
            Some(p) => p.clone(),
            None => env.initramfs()?,
        };
        let serial = dir.join("serial.log");
        let qemu_log = dir.join("qemu.log");
        let mut append = String::from("console=ttyS0 panic=-1 quiet");
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
        let qmp = spec.qmp.then(|| dir.join("qmp.sock"));
        let mut q = QemuCommand::new(&env.qemu)
            .memory_mib(spec.memory_mib)
            .smp(spec.smp)
            .serial(Serial::File(serial.clone()))
            .kernel(&env.vmlinux)
            .initrd(initrd)
            .append(append)
            .intel_iommu(spec.iommu)
            .intel_iommu_intremap(spec.intremap)
            .root_ports(spec.root_ports);
        if let Some(cpu) = &spec.cpu {
            q = q.cpu(cpu);
        }
        q = q.extra_args(&spec.qemu_args);
        for d in &spec.emulated {
            q = q.device(d.clone());
        }
        for d in &spec.devices {
            q = q.vfio_user_device(d.clone());
        }
        if let Some(p) = &qmp {
            q = q.qmp_socket(p);
        }
        let mut cmd = q.command().map_err(HarnessError::Qemu)?;
        let err =
            File::create(&qemu_log).map_err(|e| HarnessError::Io("create qemu log".into(), e))?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(err)
            .spawn()
            .map_err(|e| HarnessError::Io(format!("spawn {}", env.qemu.display()), e))?;
        Ok(Guest {
            child: Some(child),
            serial,
            qemu_log,
            qmp,
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

impl Drop for Guest {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }
}

/// Runs `body` with the environment and a fresh log dir for `name`; on failure prints the logs
/// (they stay on disk) and fails the same way.
pub fn with_logs(name: &str, body: impl FnOnce(&GuestEnv, &Path)) {
    let env = GuestEnv::for_test();
    let dir = env.log_dir(name).expect("log dir");
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| body(&env, &dir)));
    if let Err(p) = r {
        dump_logs(&dir);
        std::panic::resume_unwind(p);
    }
}

/// Asserts that the running test binary has `booting` tests besides `this_test` and that all
/// of them are `#[ignore]`d, so that a plain `cargo test` lists guest tests as ignored instead
/// of passing them without booting anything.
pub fn assert_guest_tests_ignored(this_test: &str, booting: usize) {
    let list = |extra: &[&str]| {
        let out = Command::new(std::env::current_exe().expect("test binary"))
            .args(["--list", "--format", "terse"])
            .args(extra)
            .output()
            .expect("list tests");
        assert!(out.status.success(), "{out:?}");
        let mut names: Vec<String> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.strip_suffix(": test").map(str::to_owned))
            .collect();
        names.sort();
        names
    };
    let all = list(&[]);
    let ignored = list(&["--ignored"]);
    let others: Vec<String> = all.iter().filter(|n| *n != this_test).cloned().collect();
    assert_eq!(others.len(), booting, "{all:?}");
    assert_eq!(ignored, others, "every guest-booting test is #[ignore]d");
}

/// Prints the logs in `dir` (for a failing test); they also stay on disk.
pub fn dump_logs(dir: &Path) {
    eprintln!("--- logs kept in {} ---", dir.display());
    if let Ok(rd) = fs::read_dir(dir) {
        let mut files: Vec<_> = rd.flatten().map(|e| e.path()).collect();
        files.sort();
        for f in files {
            if f.extension().is_some_and(|e| e == "log") {
                let text = fs::read_to_string(&f).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(80).collect();
                eprintln!("=== {} (last {} lines) ===", f.display(), tail.len());
                for l in tail.iter().rev() {
                    eprintln!("{l}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_complete_lines_count() {
        assert_eq!(complete_lines(""), "");
        assert_eq!(complete_lines("HOTPLUG: run round=1 rc="), "");
        assert_eq!(
            complete_lines("a\r\nHOTPLUG: run round=1 rc=0\r\nHOTPLUG: run round=2 rc="),
            "a\r\nHOTPLUG: run round=1 rc=0\r\n"
        );
        let text = "x\r\nHOTPLUG: run round=1 rc=0\r\nHOTPLUG: run round=2 rc=";
        assert_eq!(
            find_line(text, "HOTPLUG: run round=1 rc="),
            Some("HOTPLUG: run round=1 rc=0")
        );
        assert_eq!(find_line(text, "HOTPLUG: run round=2 rc="), None);
        assert_eq!(find_line("SYGPU-SUMMARY {\"res", "SYGPU-SUMMARY"), None);
    }

    #[test]
    fn missing_prerequisites_are_an_error_that_says_how_to_set_them_up() {
        let cache = std::env::temp_dir().join(format!("sy-empty-cache.{}", std::process::id()));
        fs::create_dir_all(&cache).expect("mkdir");
        let err = GuestEnv::discover_in(PathBuf::from("/nonexistent"), cache.clone())
            .expect_err("an empty cache has no QEMU");
        let _ = fs::remove_dir(&cache);
        let HarnessError::Missing { what, path, .. } = &err else {
            panic!("not a Missing error: {err:?}");
        };
        assert_eq!((*what, path), ("QEMU", &cache.join("qemu")));
        let msg = err.to_string();
        assert!(msg.contains("run scripts/setup.sh"), "{msg}");
        assert!(!msg.contains("SKIP"), "no skip switch is offered: {msg}");
    }

    #[test]
    fn whitespace_in_guest_args_is_rejected() {
        let none = PathBuf::from("/nonexistent");
        let env = GuestEnv {
            repo: none.clone(),
            cache: none.clone(),
            qemu: none.clone(),
            vmlinux: none.clone(),
            switchyard: none.clone(),
            driver: none.clone(),
            work: none.clone(),
        };
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
}
