//! libvirt, the way most operators run QEMU: a guest defined from the documented domain XML
//! (`vmm-integration/libvirt/switchyard-guest.xml`) gets its device from a `switchyard daemon`
//! pool endpoint, and the in-guest VFIO driver runs its workload across a restart of the
//! endpoint's worker.
//!
//! The guest test is `#[ignore]`d like every guest test (`scripts/test.sh` runs it). It needs
//! libvirt's binaries (`scripts/install-libvirt.sh` installs them) and root, and changes nothing
//! on the host: it runs a private `libvirtd` in a mount namespace of its own, with private
//! directories bind-mounted over the paths a root libvirtd has compiled in (`/etc/libvirt`,
//! `/run/libvirt`, `/var/lib/libvirt`, `/var/log/libvirt`, `/var/cache/libvirt`), so a libvirtd
//! of the host, if any, is neither seen nor disturbed. Everything it starts is stopped when it
//! ends, passed or failed: the domain (`virsh destroy`, then its QEMU by the pid file), libvirtd,
//! the endpoint and its worker, the daemon.
#![forbid(unsafe_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use switchyard_guest_tests::{
    BOOT_ATTEMPTS, BootState, GuestEnv, assert_full_workload, boot_state, complete_lines,
    find_line, list_tests, placeholders_in, stop_child, wait_until, with_logs, xml_escape,
};
use switchyard_qemu::GUEST_BOOT_ARGS;

/// The documented domain XML.
const TEMPLATE: &str = include_str!("../../../vmm-integration/libvirt/switchyard-guest.xml");

/// The placeholders of [`TEMPLATE`], each written `@NAME@` in it.
const PLACEHOLDERS: [&str; 8] = [
    "NAME",
    "MEMORY_MIB",
    "EMULATOR",
    "KERNEL",
    "INITRD",
    "CMDLINE",
    "SERIAL_LOG",
    "ENDPOINT_SOCKET",
];

/// What `scripts/install-libvirt.sh` installs and sets up.
const INSTALL_HINT: &str = "run scripts/install-libvirt.sh as root (scripts/test.sh does)";

/// The domain's name (in a libvirtd of the test's own).
const DOMAIN: &str = "switchyard-guest";

/// [`xml_escape`] undone.
fn xml_unescape(s: &str) -> String {
    s.replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&apos;", "'")
        .replace("&quot;", "\"")
        .replace("&amp;", "&")
}

/// The values of the domain XML's placeholders.
struct Domain<'a> {
    name: &'a str,
    memory_mib: u64,
    emulator: &'a Path,
    kernel: &'a Path,
    initrd: &'a Path,
    cmdline: &'a str,
    serial_log: &'a Path,
    endpoint_socket: &'a Path,
}

impl Domain<'_> {
    /// [`TEMPLATE`] with every placeholder replaced by its value, XML-escaped (the endpoint's
    /// socket, inside a JSON string, JSON-escaped first).
    fn render(&self) -> String {
        let path = |p: &Path| {
            p.to_str()
                .unwrap_or_else(|| panic!("{} is not UTF-8", p.display()))
                .to_owned()
        };
        let socket_json = serde_json::to_string(&path(self.endpoint_socket)).expect("a string");
        let values = [
            ("NAME", self.name.to_owned()),
            ("MEMORY_MIB", self.memory_mib.to_string()),
            ("EMULATOR", path(self.emulator)),
            ("KERNEL", path(self.kernel)),
            ("INITRD", path(self.initrd)),
            ("CMDLINE", self.cmdline.to_owned()),
            ("SERIAL_LOG", path(self.serial_log)),
            // Without its quotes: the template has them.
            (
                "ENDPOINT_SOCKET",
                socket_json[1..socket_json.len() - 1].to_owned(),
            ),
        ];
        let mut xml = TEMPLATE.to_owned();
        for (key, value) in &values {
            xml = xml.replace(&format!("@{key}@"), &xml_escape(value));
        }
        let left = placeholders_in(&xml);
        assert!(left.is_empty(), "placeholders left in the XML: {left:?}");
        xml
    }
}

/// The `-device` JSON of the domain's `<qemu:commandline>`, parsed.
fn device_json(xml: &str) -> serde_json::Value {
    let start = xml
        .find("<qemu:arg value='{")
        .expect("a JSON -device argument")
        + "<qemu:arg value='".len();
    let end = start + xml[start..].find('\'').expect("the attribute's end");
    serde_json::from_str(&xml_unescape(&xml[start..end])).expect("the -device argument is JSON")
}

#[test]
fn the_domain_template_names_exactly_the_placeholders_the_test_fills() {
    let mut want: Vec<String> = PLACEHOLDERS.iter().map(|p| (*p).to_owned()).collect();
    want.sort();
    assert_eq!(placeholders_in(TEMPLATE), want);
}

#[test]
fn the_domain_template_renders_with_every_value_escaped() {
    // Quotes, an ampersand, angle brackets and a backslash in every path.
    let odd = Path::new("/tmp/it's \"odd\" & <weird>\\");
    let xml = Domain {
        name: "a&b",
        memory_mib: 512,
        emulator: &odd.join("qemu"),
        kernel: &odd.join("vmlinux"),
        initrd: &odd.join("initrd"),
        cmdline: "console=ttyS0 sy.arg=--doorbell sy.arg=it's",
        serial_log: &odd.join("serial.log"),
        endpoint_socket: &odd.join("vm1.sock"),
    }
    .render();
    assert!(xml.contains("<name>a&amp;b</name>"), "{xml}");
    assert!(
        xml.contains("<cmdline>console=ttyS0 sy.arg=--doorbell sy.arg=it&apos;s</cmdline>"),
        "{xml}"
    );
    assert!(
        xml.contains(
            "<kernel>/tmp/it&apos;s &quot;odd&quot; &amp; &lt;weird&gt;\\/vmlinux</kernel>"
        ),
        "{xml}"
    );
    let device = device_json(&xml);
    assert_eq!(device["driver"], "vfio-user-pci", "{device}");
    assert_eq!(device["socket"]["type"], "unix", "{device}");
    assert_eq!(
        device["socket"]["path"],
        odd.join("vm1.sock").to_str().expect("UTF-8"),
        "{device}"
    );
    // The header comment names the placeholders without their at signs, so a value with
    // `--` (not allowed in an XML comment) never lands in it.
    let comment_end = xml.find("-->").expect("the header comment");
    assert!(!xml[..comment_end].contains("--doorbell"), "{xml}");
}

/// The one test here that boots a guest is ignored, so that a plain `cargo test` reports it as
/// ignored instead of passing it without booting anything; the others run everywhere.
/// (`assert_guest_tests_ignored` wants every other test ignored: the template tests are not.)
#[test]
fn only_the_guest_test_is_ignored() {
    assert_eq!(
        list_tests(false),
        [
            "libvirt_runs_the_driver_workload_across_a_worker_restart",
            "only_the_guest_test_is_ignored",
            "the_domain_template_names_exactly_the_placeholders_the_test_fills",
            "the_domain_template_renders_with_every_value_escaped",
        ]
    );
    assert_eq!(
        list_tests(true),
        ["libvirt_runs_the_driver_workload_across_a_worker_restart"]
    );
}

/// Runs `cmd` for at most `secs` seconds (`timeout`, then SIGKILL 5 s later).
fn run_with_timeout(secs: u64, program: &Path, args: &[&str]) -> Output {
    Command::new("timeout")
        .arg("--kill-after=5")
        .arg(secs.to_string())
        .arg(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()))
}

/// Fails unless `out` is a success; returns its stdout.
fn ok(what: &str, out: Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what}: {}\nstdout: {stdout}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

/// The libvirt binaries the test runs.
struct LibvirtTools {
    libvirtd: PathBuf,
    virsh: PathBuf,
}

impl LibvirtTools {
    /// Finds them, and what `scripts/install-libvirt.sh` sets up besides; fails saying how to
    /// install them when something is missing.
    fn find() -> Self {
        let which = |name: &str| {
            std::env::var_os("PATH")
                .into_iter()
                .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
                .chain(["/usr/sbin".into(), "/usr/bin".into()])
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        };
        let mut missing = Vec::new();
        let libvirtd = which("libvirtd");
        let virsh = which("virsh");
        for (name, found) in [("libvirtd", &libvirtd), ("virsh", &virsh)] {
            if found.is_none() {
                missing.push(format!("{name} (not on PATH nor in /usr/sbin, /usr/bin)"));
            }
        }
        let driver =
            Path::new("/usr/lib/x86_64-linux-gnu/libvirt/connection-driver/libvirt_driver_qemu.so");
        if !driver.exists() {
            missing.push(format!("libvirt's QEMU driver ({})", driver.display()));
        }
        for dir in LIBVIRT_DIRS.iter().map(|(_, d)| d) {
            if !Path::new(dir).is_dir() {
                missing.push(format!("the directory {dir} (a mount point)"));
            }
        }
        let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
        if !passwd.lines().any(|l| l.starts_with("libvirt-qemu:")) {
            missing.push(
                "the user libvirt-qemu (libvirt's QEMU driver will not start without it)".into(),
            );
        }
        assert!(
            missing.is_empty(),
            "libvirt is not set up for this test: missing {}; {INSTALL_HINT}",
            missing.join(", ")
        );
        assert!(
            rustix::process::geteuid().is_root(),
            "the libvirt test runs as root (a private libvirtd in a mount namespace of its own, \
             as the system libvirtd runs)"
        );
        LibvirtTools {
            libvirtd: libvirtd.expect("checked"),
            virsh: virsh.expect("checked"),
        }
    }
}

/// The private directories of the test's libvirtd (under its root) and the paths a root
/// libvirtd has compiled in, which they are bind-mounted over.
const LIBVIRT_DIRS: [(&str, &str); 5] = [
    ("etc", "/etc/libvirt"),
    ("run", "/run/libvirt"),
    ("lib", "/var/lib/libvirt"),
    ("log", "/var/log/libvirt"),
    ("cache", "/var/cache/libvirt"),
];

/// libvirtd's configuration: the UNIX socket for root only, without authentication (no
/// polkit here), warnings and errors into the test's log directory.
fn libvirtd_conf(log: &Path) -> String {
    format!(
        "unix_sock_group = \"root\"\n\
         unix_sock_ro_perms = \"0700\"\n\
         unix_sock_rw_perms = \"0700\"\n\
         unix_sock_admin_perms = \"0700\"\n\
         auth_unix_ro = \"none\"\n\
         auth_unix_rw = \"none\"\n\
         log_outputs = \"3:file:{}\"\n",
        log.display()
    )
}

/// The QEMU driver's configuration for the test (vmm-integration/libvirt/README.md says what
/// a production host does instead).
const QEMU_CONF: &str = "\
# QEMU runs as root: the pool daemon's sockets are its user's only (0600 in 0700 directories).
user = \"root\"
group = \"root\"
# Change the owner of no file (the kernel and initramfs are the repository's).
dynamic_ownership = 0
# No AppArmor/SELinux confinement: libvirt cannot put the vfio-user socket of a
# <qemu:commandline> device, nor a QEMU outside /usr/bin, into a profile it generates.
security_driver = \"none\"
# No cgroups: nothing is created in the host's cgroup tree (a container often has none to give).
cgroup_controllers = [ ]
# QEMU's stderr straight into the domain log: no virtlogd to start.
stdio_handler = \"file\"
";

/// A private `libvirtd` (see the module documentation). Dropping it destroys and undefines the
/// domains it started, kills their QEMU if that did not stop it, and stops libvirtd.
struct Libvirtd {
    child: Child,
    tools: LibvirtTools,
    root: PathBuf,
    uri: String,
    log_dir: PathBuf,
    domains: Vec<String>,
}

impl Libvirtd {
    fn start(tools: LibvirtTools, root: &Path, log_dir: &Path) -> Self {
        for (dir, _) in LIBVIRT_DIRS {
            std::fs::create_dir_all(root.join(dir)).expect("libvirt's private directories");
        }
        std::fs::write(
            root.join("etc/libvirtd.conf"),
            libvirtd_conf(&log_dir.join("libvirtd.log")),
        )
        .expect("libvirtd.conf");
        std::fs::write(root.join("etc/qemu.conf"), QEMU_CONF).expect("qemu.conf");
        // unshare runs the script in a new mount namespace (mounts private, so nothing
        // propagates to the host), which bind-mounts the private directories and becomes
        // libvirtd: the child is libvirtd itself.
        let mut script = String::from("set -e\n");
        for (dir, over) in LIBVIRT_DIRS {
            script.push_str(&format!("mount --bind \"$1/{dir}\" {over}\n"));
        }
        script.push_str("exec \"$2\" --config /etc/libvirt/libvirtd.conf\n");
        let out = std::fs::File::create(log_dir.join("libvirtd.stdout.log")).expect("log");
        // A clean environment (not the test's: libvirt passes PATH and cargo's LD_LIBRARY_PATH
        // on to QEMU).
        let child = Command::new("unshare")
            .args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                &script,
                "sh",
            ])
            .arg(root)
            .arg(&tools.libvirtd)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("LC_ALL", "C")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("log"))
            .stderr(out)
            .spawn()
            .expect("start libvirtd (unshare)");
        let socket = root.join("run/libvirt-sock");
        let mut d = Libvirtd {
            child,
            tools,
            root: root.to_owned(),
            uri: format!("qemu:///system?socket={}", socket.display()),
            log_dir: log_dir.to_owned(),
            domains: Vec::new(),
        };
        wait_until(Duration::from_secs(60), "libvirtd to answer", || {
            if let Ok(Some(st)) = d.child.try_wait() {
                panic!("libvirtd exited: {st} (see libvirtd.log)");
            }
            (socket.exists() && d.virsh(&["list", "--all"]).status.success()).then_some(())
        })
        .expect("libvirtd answers");
        d
    }

    /// `virsh -c URI ARGS` (at most 120 s).
    fn virsh(&self, args: &[&str]) -> Output {
        let mut all = vec!["-c", &self.uri];
        all.extend_from_slice(args);
        run_with_timeout(120, &self.tools.virsh, &all)
    }

    /// [`Libvirtd::virsh`], which must succeed; its stdout.
    fn virsh_ok(&self, args: &[&str]) -> String {
        ok(&format!("virsh {}", args.join(" ")), self.virsh(args))
    }

    /// Defines the domain in `xml` (validated against libvirt's schema) and starts it.
    fn define_and_start(&mut self, xml: &Path, name: &str) {
        let xml = xml.to_str().expect("UTF-8 path");
        self.virsh_ok(&["define", "--validate", xml]);
        self.domains.push(name.to_owned());
        self.virsh_ok(&["start", name]);
    }

    /// `virsh domstate NAME`.
    fn domstate(&self, name: &str) -> String {
        self.virsh_ok(&["domstate", name]).trim().to_owned()
    }

    /// The domain's log: QEMU's command line as libvirt ran it, and QEMU's stderr.
    fn qemu_log(&self, name: &str) -> PathBuf {
        self.root.join(format!("log/qemu/{name}.log"))
    }

    /// Kills the domain's QEMU by its pid file (libvirt's, while it runs), if the process
    /// there is that QEMU.
    fn kill_qemu(&self, name: &str) {
        let pidfile = self.root.join(format!("run/qemu/{name}.pid"));
        let Some(pid) = std::fs::read_to_string(pidfile)
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
        else {
            return;
        };
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
        let ours = String::from_utf8_lossy(&cmdline).contains(&format!("guest={name},"));
        if let (true, Some(pid)) = (ours, rustix::process::Pid::from_raw(pid)) {
            eprintln!("libvirt: killing the QEMU of {name} (pid {pid:?}) left running");
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
        }
    }
}

impl Drop for Libvirtd {
    fn drop(&mut self) {
        for name in std::mem::take(&mut self.domains) {
            let _ = self.virsh(&["destroy", &name]);
            self.kill_qemu(&name);
            let _ = std::fs::copy(self.qemu_log(&name), self.log_dir.join("qemu.log"));
            let _ = self.virsh(&["undefine", &name]);
        }
        if stop_child(&mut self.child, Duration::from_secs(15)).is_none() {
            eprintln!("libvirt: libvirtd did not stop within 15 s of SIGTERM (killed)");
        }
    }
}

/// A `switchyard daemon` driven through `switchyard ctl`, as an operator would. Dropping it
/// deletes its endpoints (their workers stop), stops it, and kills any worker it knew of that
/// is still there.
struct PoolDaemon {
    child: Child,
    bin: PathBuf,
    socket: PathBuf,
    endpoints: Vec<String>,
    workers: Vec<i32>,
}

impl PoolDaemon {
    fn start(env: &GuestEnv, root: &Path, log_dir: &Path) -> Self {
        let log = std::fs::File::create(log_dir.join("daemon.log")).expect("daemon log");
        let child = Command::new(&env.switchyard)
            .arg("daemon")
            .arg("--state-dir")
            .arg(root.join("state"))
            .arg("--run-dir")
            .arg(root.join("run"))
            .env("RUST_LOG", "info")
            .env("SWITCHYARD_WORKER_EXE", &env.switchyard)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start the daemon");
        let mut d = PoolDaemon {
            child,
            bin: env.switchyard.clone(),
            socket: root.join("run/control.sock"),
            endpoints: Vec::new(),
            workers: Vec::new(),
        };
        wait_until(Duration::from_secs(30), "the daemon to answer", || {
            if let Ok(Some(st)) = d.child.try_wait() {
                panic!("the daemon exited: {st} (see daemon.log)");
            }
            d.ctl(&["boards"]).status.success().then_some(())
        })
        .expect("the daemon answers");
        d
    }

    /// `switchyard ctl --socket SOCKET ARGS` (at most 60 s).
    fn ctl(&self, args: &[&str]) -> Output {
        let socket = self.socket.to_str().expect("UTF-8 path");
        let mut all = vec!["ctl", "--socket", socket];
        all.extend_from_slice(args);
        run_with_timeout(60, &self.bin, &all)
    }

    /// `ctl --json ARGS`, which must succeed, parsed.
    fn ctl_json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = ok(
            &format!("switchyard ctl {}", args.join(" ")),
            self.ctl(&all),
        );
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("ctl {args:?}: {e}: {out}"))
    }

    /// `ctl create ID`: the endpoint's socket.
    fn create(&mut self, id: &str) -> PathBuf {
        let created = self.ctl_json(&["create", id]);
        self.endpoints.push(id.to_owned());
        self.endpoint(id);
        PathBuf::from(
            created["endpoint"]["socket"]
                .as_str()
                .unwrap_or_else(|| panic!("no socket: {created}")),
        )
    }

    /// `ctl endpoint ID` (and the worker's pid noted, to be killed if it outlives the daemon).
    fn endpoint(&mut self, id: &str) -> serde_json::Value {
        let st = self.ctl_json(&["endpoint", id]);
        if let Some(pid) = st["worker"]["pid"].as_i64() {
            self.workers.push(pid as i32);
        }
        st
    }
}

impl Drop for PoolDaemon {
    fn drop(&mut self) {
        for id in std::mem::take(&mut self.endpoints) {
            let _ = self.ctl(&["delete", &id]);
        }
        let stopped = stop_child(&mut self.child, Duration::from_secs(15)).is_some();
        for pid in std::mem::take(&mut self.workers) {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let worker = cmdline
                .split(|b| *b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect::<Vec<_>>();
            let is_ours = worker
                .first()
                .is_some_and(|a| Path::new(a).file_name() == self.bin.file_name())
                && worker.get(1).is_some_and(|a| a == "worker");
            if let (true, Some(pid)) = (is_ours, rustix::process::Pid::from_raw(pid)) {
                eprintln!("pool: killing worker {pid:?} left running");
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        if !stopped && !std::thread::panicking() {
            panic!("the pool daemon did not stop within 15 s of SIGTERM (killed)");
        }
    }
}

/// A directory of the test's own under the temporary directory (0700; short paths for
/// sockets), removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        use std::os::unix::fs::DirBuilderExt;
        let path = std::env::temp_dir().join(format!("{name}.{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&path);
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The serial console so far.
fn console(path: &Path) -> String {
    std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default()
}

/// Waits until the console has a complete line starting with `prefix`, while the domain runs.
fn wait_for_line(libvirt: &Libvirtd, serial: &Path, prefix: &str, timeout: Duration) -> String {
    let mut checked = Instant::now();
    wait_until(timeout, &format!("a guest line `{prefix}...`"), || {
        if let Some(l) = find_line(&console(serial), prefix) {
            return Some(l.to_owned());
        }
        // Every second: a domain that stopped will not print it.
        if checked.elapsed() > Duration::from_secs(1) {
            checked = Instant::now();
            let state = libvirt.domstate(DOMAIN);
            assert_eq!(
                state, "running",
                "the domain stopped before the guest printed `{prefix}`"
            );
        }
        None
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Waits until the domain's guest starts its `test`; a guest whose kernel panicked before that
/// (`panic=-1`: it reboots, and `on_reboot` destroys the domain) is started again once, as the
/// harness's own guests are (`Guest::booted`): said on stderr (`BOOT-PANIC:`), its console kept
/// as `serial.boot-1.log`. A second boot panic fails the test.
fn wait_booted(libvirt: &Libvirtd, serial: &Path, test: &str, timeout: Duration) {
    for boot in 1..=BOOT_ATTEMPTS {
        let mut checked = Instant::now();
        let state = wait_until(timeout, &format!("`GUEST: test {test} start`"), || {
            let state = boot_state(&console(serial), test);
            if state != BootState::Booting {
                return Some(state);
            }
            // Every second: a domain that stopped without a panic will not print it.
            if checked.elapsed() > Duration::from_secs(1) {
                checked = Instant::now();
                let running = libvirt.domstate(DOMAIN) == "running";
                let state = boot_state(&console(serial), test);
                assert!(
                    running || state != BootState::Booting,
                    "the domain stopped before the guest started its test"
                );
                return (state != BootState::Booting).then_some(state);
            }
            None
        })
        .unwrap_or_else(|e| panic!("{e}"));
        let BootState::Panicked(panic) = state else {
            return;
        };
        assert!(
            boot < BOOT_ATTEMPTS,
            "the guest's kernel panicked at boot {boot} of {BOOT_ATTEMPTS}, before the test's \
             own code ran: {panic}"
        );
        let _ = libvirt.virsh(&["destroy", DOMAIN]);
        let kept = serial.with_extension(format!("boot-{boot}.log"));
        std::fs::rename(serial, &kept).expect("keep the console");
        // Past the test harness's capture: said even when the next boot passes.
        let _ = writeln!(
            std::io::stderr(),
            "BOOT-PANIC: the guest's kernel panicked at boot {boot} of {BOOT_ATTEMPTS}, before \
             the test's own code ran: {panic}; its console is kept in {}; booting again once",
            kept.display()
        );
        libvirt.virsh_ok(&["start", DOMAIN]);
    }
}

/// The libvirt test: the documented domain XML, rendered with the pool endpoint's
/// socket, QEMU 11.1 as its emulator and the guest-test kernel and initramfs, boots under a
/// private libvirtd; the in-guest VFIO driver runs its workload (mapped doorbells, then the
/// doorbell latency figures, so it runs for a few seconds more) while the endpoint's worker is
/// restarted (`switchyard ctl restart vm1`, mid-workload); every job is bit-exact, QEMU never
/// notices, and `ctl endpoint vm1` shows the restart.
#[test]
#[ignore = "boots QEMU under libvirt: run by scripts/test.sh (cargo test -p switchyard-guest-tests -- --include-ignored)"]
fn libvirt_runs_the_driver_workload_across_a_worker_restart() {
    with_logs("libvirt", |env, dir| {
        let started = Instant::now();
        let tools = LibvirtTools::find();
        let initrd = env.initramfs().expect("initramfs");
        // Dropped last: after libvirt and the daemon (declared below) have stopped.
        let root = TempDir::new("sy-libvirt");
        let mut pool = PoolDaemon::start(env, &root.0, dir);
        let socket = pool.create("vm1");
        let before = pool.endpoint("vm1");
        assert_eq!(before["worker"]["restarts"], 0, "{before}");
        let mut libvirt = Libvirtd::start(tools, &root.0.join("libvirt"), dir);
        let libvirtd_up = started.elapsed();

        let serial = dir.join("serial.log");
        let xml = Domain {
            name: DOMAIN,
            memory_mib: 512,
            emulator: &env.qemu,
            kernel: &env.vmlinux,
            initrd: &initrd,
            cmdline: &format!(
                "console=ttyS0 panic=-1 quiet {GUEST_BOOT_ARGS} intel_iommu=on \
                 sy.test=sygpu-driver sy.arg=--doorbell sy.arg=mapped sy.arg=--latency \
                 sy.arg=500"
            ),
            serial_log: &serial,
            endpoint_socket: &socket,
        }
        .render();
        let xml_path = dir.join("domain.xml");
        std::fs::write(&xml_path, &xml).expect("write the domain XML");
        let boot = Instant::now();
        libvirt.define_and_start(&xml_path, DOMAIN);
        wait_booted(&libvirt, &serial, "sygpu-driver", Duration::from_secs(240));

        // The driver has the device up and its first jobs verified: restart the worker under
        // the rest of the workload.
        wait_for_line(
            &libvirt,
            &serial,
            "SYGPU: step copy:",
            Duration::from_secs(240),
        );
        let restart = pool.ctl(&["restart", "vm1"]);
        let restart = ok("switchyard ctl restart vm1", restart);
        assert!(restart.contains("replaced by"), "{restart}");
        let text = console(&serial);
        assert!(
            find_line(&text, "SYGPU-SUMMARY").is_none(),
            "the driver finished before the restart:\n{text}"
        );

        wait_for_line(
            &libvirt,
            &serial,
            "GUEST: poweroff",
            Duration::from_secs(240),
        );
        let guest_time = boot.elapsed();
        // on_poweroff = destroy: libvirt stops QEMU.
        wait_until(Duration::from_secs(60), "the domain to shut off", || {
            (libvirt.domstate(DOMAIN) == "shut off").then_some(())
        })
        .expect("the domain shuts off");

        let text = console(&serial);
        let text = complete_lines(&text);
        assert!(
            text.lines()
                .any(|l| l.contains("vendor=0x1234 device=0x5347 class=0x030200")),
            "the guest did not enumerate the softgpu:\n{text}"
        );
        assert_eq!(
            find_line(text, "GUEST: test sygpu-driver rc="),
            Some("GUEST: test sygpu-driver rc=0"),
            "{text}"
        );
        let s: serde_json::Value = find_line(text, "SYGPU-SUMMARY")
            .and_then(|l| serde_json::from_str(l["SYGPU-SUMMARY".len()..].trim()).ok())
            .unwrap_or_else(|| panic!("no summary:\n{text}"));
        assert_full_workload(&s);
        assert_eq!(s["doorbell"], "mapped", "{s}");
        assert!(
            s["steps"]
                .as_array()
                .expect("steps")
                .iter()
                .any(|st| st["name"] == "latency" && st["ok"] == true),
            "{s}"
        );

        // `ctl endpoint vm1` shows the restart: one, to a new worker, which serves.
        let after = pool.endpoint("vm1");
        assert_eq!(after["worker"]["restarts"], 1, "{after}");
        assert_eq!(after["worker"]["state"], "running", "{after}");
        assert_ne!(after["worker"]["pid"], before["worker"]["pid"], "{after}");
        assert!(after["worker"]["last_restart_ms"].is_number(), "{after}");
        let table = ok(
            "switchyard ctl endpoint vm1",
            pool.ctl(&["endpoint", "vm1"]),
        );
        assert!(
            table
                .lines()
                .any(|l| l.split_whitespace().collect::<Vec<_>>() == ["restarts:", "1"]),
            "{table}"
        );

        // libvirt ran QEMU with the documented settings, and QEMU never saw the device go.
        let qemu = std::fs::read_to_string(libvirt.qemu_log(DOMAIN)).expect("the domain log");
        for want in [
            "\"qom-type\":\"memory-backend-memfd\",\"id\":\"pc.ram\",\"share\":true",
            "\"driver\":\"intel-iommu\"",
            "\"caching-mode\":true",
            "kernel_irqchip=split",
            "-accel tcg",
            "\"driver\":\"vfio-user-pci\"",
        ] {
            assert!(
                qemu.contains(want),
                "no `{want}` in the domain log:\n{qemu}"
            );
        }
        assert!(
            !qemu.contains("server closed socket") && !qemu.contains("hardware error"),
            "QEMU noticed:\n{qemu}"
        );
        let daemon = std::fs::read_to_string(dir.join("daemon.log")).expect("the daemon log");
        assert!(daemon.contains("client connected"), "{daemon}");
        assert!(!daemon.contains("panicked"), "{daemon}");
        // Guest RAM is the shared memfd: the device maps it, no DMA goes through messages.
        assert!(
            !daemon.contains("device DMA goes through DMA_READ/DMA_WRITE messages"),
            "{daemon}"
        );

        libvirt.virsh_ok(&["undefine", DOMAIN]);
        libvirt.domains.clear();
        let _ = std::fs::copy(libvirt.qemu_log(DOMAIN), dir.join("qemu.log"));
        eprintln!(
            "libvirt guest: libvirtd and the pool up in {:.1} s, guest {:.1} s, test {:.1} s; \
             restart: {}; {s}",
            libvirtd_up.as_secs_f64(),
            guest_time.as_secs_f64(),
            started.elapsed().as_secs_f64(),
            restart.trim()
        );
    });
}
