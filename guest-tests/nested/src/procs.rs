//! The processes a scenario runs inside L1: `switchyard serve` and cloud-hypervisor.

use std::ffi::OsString;
use std::fs::{self, File};
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use switchyard_ch::{ChCommand, Output, UserDeviceConfig};
use switchyard_qemu::{QemuCommand, Serial};

/// Polls `f` every 20 ms until it returns `Some`, or fails after `timeout` naming `what`.
pub fn wait_for<T>(
    timeout: Duration,
    what: &str,
    mut f: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f()? {
            return Ok(v);
        }
        if start.elapsed() > timeout {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        thread::sleep(Duration::from_millis(20));
    }
}

/// The last `max` bytes of a log file, for a failure report.
pub fn tail(path: &Path, max: u64) -> String {
    let Ok(mut f) = File::open(path) else {
        return format!("({} missing)", path.display());
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(max)));
    let mut s = String::new();
    let _ = f.read_to_string(&mut s);
    s
}

fn terminate(child: &mut Child, grace: Duration) -> Option<ExitStatus> {
    if let Ok(Some(st)) = child.try_wait() {
        return Some(st);
    }
    if let Ok(pid) = i32::try_from(child.id()) {
        // SIGTERM first: the server removes its socket and cloud-hypervisor its API socket.
        let _ = Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status();
    }
    let start = Instant::now();
    while start.elapsed() < grace {
        if let Ok(Some(st)) = child.try_wait() {
            return Some(st);
        }
        thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    child.wait().ok()
}

/// The servers' `RUST_LOG` filter (`--server-log`; `info` when unset).
pub static SERVER_LOG: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// A `switchyard serve` child serving one device on a socket.
pub struct Server {
    child: Child,
    /// The socket the server listens on.
    pub socket: PathBuf,
    /// Its stdout and stderr.
    pub log: PathBuf,
}

impl Server {
    /// Starts `switchyard serve --socket SOCKET --device DEVICE` and waits until the socket
    /// exists (the server binds before the file appears, so it then accepts).
    pub fn start(binary: &Path, dir: &Path, name: &str, device: &str) -> Result<Server> {
        let socket = dir.join(format!("{name}.sock"));
        let log = dir.join(format!("{name}.log"));
        let out = File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone()?;
        let child = Command::new(binary)
            .args(["serve", "--socket"])
            .arg(&socket)
            .args(["--device", device])
            .env("RUST_LOG", SERVER_LOG.get().map_or("info", String::as_str))
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawn {}", binary.display()))?;
        let mut server = Server { child, socket, log };
        let what = format!("{} to listen", server.socket.display());
        wait_for(Duration::from_secs(20), &what, || {
            if let Some(st) = server.child.try_wait()? {
                bail!(
                    "switchyard serve exited with {st} before listening:\n{}",
                    tail(&server.log, 2000)
                );
            }
            Ok(server.socket.exists().then_some(()))
        })?;
        Ok(server)
    }

    /// Whether the server process still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Its log so far.
    pub fn log_text(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, then SIGKILL after 5 s; returns the exit status.
    pub fn stop(mut self) -> Option<ExitStatus> {
        terminate(&mut self.child, Duration::from_secs(5))
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = terminate(&mut self.child, Duration::from_secs(2));
    }
}

/// Says that L2 `name`'s VMM starts, and when in L1's time since boot (`/proc/uptime`; the
/// kernel's console timestamps count the same, give or take a fraction of a second):
/// `NESTED: start L2[NAME] at L1 uptime S s: BINARY ARGS...`. The harness times L1 kernel
/// panics against it (guest-tests/harness/src/nested.rs).
fn announce(name: &str, binary: &Path, argv: &[OsString]) {
    let uptime = fs::read_to_string("/proc/uptime")
        .ok()
        .and_then(|u| u.split_whitespace().next().map(str::to_owned))
        .unwrap_or_else(|| "?".into());
    println!(
        "NESTED: start L2[{name}] at L1 uptime {uptime} s: {} {}",
        binary.display(),
        argv.iter()
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
}

/// How to start an L2 guest under cloud-hypervisor.
pub struct VmSpec<'a> {
    /// Short name: log files and the `L2[name]:` prefix of its console lines.
    pub name: &'a str,
    /// The cloud-hypervisor binary.
    pub binary: &'a Path,
    /// L2 kernel (PVH vmlinux) and initramfs.
    pub kernel: &'a Path,
    /// L2 initramfs.
    pub initramfs: &'a Path,
    /// L2 kernel command line.
    pub cmdline: String,
    /// Guest RAM (always `shared=on`: vfio-user needs fd-backed memory).
    pub memory_mib: u64,
    /// Devices present at boot.
    pub user_devices: Vec<UserDeviceConfig>,
    /// Start the REST API on this socket.
    pub api_socket: Option<PathBuf>,
    /// Host devices (sysfs directories, bound to vfio-pci) assigned directly.
    pub vfio_devices: Vec<PathBuf>,
    /// More cloud-hypervisor arguments.
    pub extra_args: Vec<String>,
}

/// A VMM child (cloud-hypervisor, or QEMU with KVM) running an L2 guest. Its serial console goes to a file that a
/// thread follows: every line is echoed as `L2[name]: line` and kept for [`Vm::wait_line`].
pub struct Vm {
    child: Child,
    name: String,
    lines: Arc<Mutex<Vec<String>>>,
    /// The VMM's own stdout/stderr.
    pub log: PathBuf,
    /// When cloud-hypervisor was started.
    pub started: Instant,
    /// QEMU's QMP socket, for [`Vm::diagnose`].
    qmp: Option<PathBuf>,
}

impl Vm {
    /// Starts cloud-hypervisor (stdin closed; serial to a file, virtio console off).
    pub fn start(dir: &Path, spec: VmSpec<'_>) -> Result<Vm> {
        let serial = dir.join(format!("{}-serial.log", spec.name));
        let log = dir.join(format!("{}-ch.log", spec.name));
        File::create(&serial)?;
        let mut cmd = ChCommand::new(spec.binary)
            .kernel(spec.kernel)
            .initramfs(spec.initramfs)
            .cmdline(spec.cmdline)
            .cpus(1)
            .memory_mib(spec.memory_mib)
            .serial(Output::File(serial.clone()))
            .console(Output::Off);
        if let Some(api) = &spec.api_socket {
            cmd = cmd.api_socket(api);
        }
        for d in spec.user_devices {
            cmd = cmd.user_device(d);
        }
        for d in spec.vfio_devices {
            cmd = cmd.vfio_device(d);
        }
        cmd = cmd.extra_args(spec.extra_args);
        announce(spec.name, spec.binary, &cmd.args()?);
        Vm::spawn(spec.name, cmd.command()?, serial, log)
    }

    /// Starts QEMU (`-accel kvm` inside L1) from `cmd`, its serial console in a file.
    pub fn start_qemu(dir: &Path, name: &str, cmd: QemuCommand) -> Result<Vm> {
        let serial = dir.join(format!("{name}-serial.log"));
        let log = dir.join(format!("{name}-qemu.log"));
        let qmp = dir.join(format!("{name}-qmp.sock"));
        File::create(&serial)?;
        let cmd = cmd.serial(Serial::File(serial.clone())).qmp_socket(&qmp);
        announce(name, cmd.binary(), &cmd.args()?);
        let mut vm = Vm::spawn(name, cmd.command()?, serial, log)?;
        vm.qmp = Some(qmp);
        Ok(vm)
    }

    fn spawn(name: &str, mut cmd: Command, serial: PathBuf, log: PathBuf) -> Result<Vm> {
        let out = File::create(&log)?;
        let err = out.try_clone()?;
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawn {}", cmd.get_program().to_string_lossy()))?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let vm = Vm {
            child,
            name: name.to_owned(),
            lines: Arc::clone(&lines),
            log,
            started: Instant::now(),
            qmp: None,
        };
        let name = vm.name.clone();
        thread::spawn(move || follow(&serial, &name, &lines));
        Ok(vm)
    }

    /// The first console line (trimmed) that starts with `prefix`, waiting up to `timeout`;
    /// fails early when cloud-hypervisor exits without printing it.
    pub fn wait_line(&mut self, prefix: &str, timeout: Duration) -> Result<String> {
        let what = format!("L2[{}] line `{prefix}...`", self.name);
        let r = self.wait_line_inner(&what, prefix, timeout);
        if r.is_err() && self.alive() {
            self.diagnose();
        }
        r
    }

    /// Where a VMM that stopped making progress is: every thread's state and kernel stack in
    /// L1, and (QEMU) the guest's registers with RIP resolved through L1's kallsyms (L1 and
    /// L2 boot the same kernel without KASLR). QMP not answering means QEMU's main loop is
    /// blocked (a vCPU holding the big lock, waiting for a reply).
    pub fn diagnose(&self) {
        let pid = self.child.id();
        println!("NESTED: diagnosis of L2[{}] (VMM pid {pid}):", self.name);
        let tasks = fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten();
        for t in tasks {
            let p = t.path();
            let read = |f: &str| fs::read_to_string(p.join(f)).unwrap_or_default();
            let state = read("stat")
                .rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next().map(str::to_owned))
                .unwrap_or_default();
            println!(
                "NESTED:   task {} `{}` state={state} wchan={} syscall={}\n{}",
                t.file_name().to_string_lossy(),
                read("comm").trim(),
                read("wchan").trim(),
                read("syscall").trim(),
                read("stack").trim_end()
            );
        }
        let Some(qmp) = &self.qmp else { return };
        let hmp = |q: &mut switchyard_qemu::Qmp, cmd: &str| {
            q.execute(
                "human-monitor-command",
                Some(serde_json::json!({ "command-line": cmd })),
            )
            .map(|v| v.as_str().unwrap_or_default().to_owned())
        };
        let mut q = match switchyard_qemu::Qmp::connect(qmp, Duration::from_secs(5)) {
            Ok(q) => q,
            Err(e) => {
                println!("NESTED:   no QMP (main loop blocked?): {e:#}");
                return;
            }
        };
        let text = match hmp(&mut q, "info registers") {
            Ok(t) => t,
            Err(e) => {
                println!("NESTED:   QMP gave no registers (main loop blocked?): {e:#}");
                return;
            }
        };
        println!("NESTED:   L2 registers:\n{text}");
        let reg = |name: &str| {
            text.split_whitespace()
                .find_map(|w| w.strip_prefix(name))
                .and_then(|h| u64::from_str_radix(h, 16).ok())
        };
        let syms = Kallsyms::load();
        for name in ["RIP=", "RDI=", "RBX="] {
            if let Some(v) = reg(name) {
                println!("NESTED:   L2 {name}{v:#x} = {}", syms.name(v));
            }
        }
        // Kernel addresses on L2's stack: a rough backtrace.
        if let Some(rsp) = reg("RSP=")
            && let Ok(words) = hmp(&mut q, &format!("x /64gx {rsp:#x}"))
        {
            let trace: Vec<String> = words
                .split_whitespace()
                .filter_map(|w| u64::from_str_radix(w.strip_prefix("0x")?, 16).ok())
                .filter(|v| (0xffff_ffff_8100_0000..0xffff_ffff_c000_0000).contains(v))
                .map(|v| syms.name(v))
                .collect();
            println!(
                "NESTED:   L2 stack (kernel addresses): {}",
                trace.join(" < ")
            );
        }
    }

    fn wait_line_inner(&mut self, what: &str, prefix: &str, timeout: Duration) -> Result<String> {
        wait_for(timeout, what, || {
            let exited = self.child.try_wait()?;
            if let Some(l) = self.find_line(prefix) {
                return Ok(Some(l));
            }
            if let Some(st) = exited {
                // The follower may lag the exit by one poll.
                thread::sleep(Duration::from_millis(200));
                if let Some(l) = self.find_line(prefix) {
                    return Ok(Some(l));
                }
                bail!(
                    "the VMM exited with {st} before L2 printed `{prefix}`; its log:\n{}",
                    tail(&self.log, 3000)
                );
            }
            Ok(None)
        })
    }

    /// The VMM's QMP socket (QEMU's).
    pub fn qmp(&self) -> Option<&Path> {
        self.qmp.as_deref()
    }

    /// The first line so far that starts with `prefix`.
    pub fn find_line(&self, prefix: &str) -> Option<String> {
        let lines = self.lines.lock().unwrap_or_else(|e| e.into_inner());
        lines
            .iter()
            .map(|l| l.trim())
            .find(|l| l.starts_with(prefix))
            .map(str::to_owned)
    }

    /// Every console line so far.
    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits for cloud-hypervisor to exit (the guest powered off).
    pub fn wait_exit(&mut self, timeout: Duration) -> Result<ExitStatus> {
        let what = format!("the VMM ({}) to exit", self.name);
        wait_for(timeout, &what, || Ok(self.child.try_wait()?))
    }

    /// Whether cloud-hypervisor still runs.
    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        let _ = terminate(&mut self.child, Duration::from_secs(2));
    }
}

/// L1's `/proc/kallsyms` (L2 boots the same kernel, without KASLR: its addresses resolve too).
struct Kallsyms(Vec<(u64, String)>);

impl Kallsyms {
    fn load() -> Kallsyms {
        let text = fs::read_to_string("/proc/kallsyms").unwrap_or_default();
        let mut v: Vec<(u64, String)> = text
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                let a = u64::from_str_radix(f.next()?, 16).ok()?;
                let _kind = f.next()?;
                Some((a, f.next()?.to_owned()))
            })
            .filter(|&(a, _)| a != 0)
            .collect();
        v.sort();
        Kallsyms(v)
    }

    /// `symbol+0xoff` for an address, `?` when none precedes it.
    fn name(&self, addr: u64) -> String {
        let i = self.0.partition_point(|(a, _)| *a <= addr);
        match i.checked_sub(1).and_then(|i| self.0.get(i)) {
            Some((a, n)) => format!("{n}+{:#x}", addr - a),
            None => "?".into(),
        }
    }
}

/// Follows the serial file: echoes and stores each complete line until the file is removed or
/// the process ends (the thread is detached; it dies with the process).
fn follow(path: &Path, name: &str, lines: &Mutex<Vec<String>>) {
    let Ok(f) = File::open(path) else { return };
    let mut r = BufReader::new(f);
    let mut partial = String::new();
    loop {
        let mut buf = Vec::new();
        match r.read_until(b'\n', &mut buf) {
            Ok(0) => thread::sleep(Duration::from_millis(20)),
            Ok(_) => {
                partial.push_str(&String::from_utf8_lossy(&buf));
                if partial.ends_with('\n') {
                    let line = partial.trim_end_matches(['\r', '\n']).to_owned();
                    partial.clear();
                    println!("L2[{name}]: {line}");
                    lines.lock().unwrap_or_else(|e| e.into_inner()).push(line);
                }
            }
            Err(_) => return,
        }
    }
}
