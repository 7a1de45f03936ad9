//! The pool daemon in L1 (`switchyard daemon`, driven through `switchyard ctl`): a
//! cloud-hypervisor L2 on a softgpu endpoint whose worker is killed again and again
//! (`ch-pool`), the edus as passthrough boards moved between endpoints, their workers killed
//! and one removed from L1 under load, its endpoint failed over to the other (`pool-edu`), and
//! the kill-delay stress form (`pool-edu-kills`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};
use switchyard_ch::UserDeviceConfig;
use switchyard_qemu::root_port_id;

use crate::l2::{json_after, l2_cmdline, l2_outcome, l2_spec};
use crate::procs::{self, Vm, tail};
use crate::qemu::{qemu_l2, qemu_l2_hotplug};
use crate::{EDU_TIMEOUT, L2_TIMEOUT, SWITCHYARD, bind_vfio, ms};

/// Removes PCI function `bdf` from L1 (`echo 1 > .../remove`) on a thread of its own and
/// waits up to 60 s: "completed", "failed: ..." or "hung ...", the time it took, and whether
/// the function is gone from sysfs.
fn remove_device(bdf: &str) -> (String, f64, bool) {
    let remove = PathBuf::from(format!("/sys/bus/pci/devices/{bdf}/remove"));
    let (tx, rx) = std::sync::mpsc::channel();
    let t = Instant::now();
    std::thread::spawn(move || {
        let r = std::fs::write(&remove, "1");
        let _ = tx.send(r);
    });
    let removed = rx.recv_timeout(Duration::from_secs(60));
    let remove_ms = ms(t.elapsed());
    let removal = match &removed {
        Ok(Ok(())) => "completed".to_owned(),
        Ok(Err(e)) => format!("failed: {e}"),
        Err(_) => "hung (still blocked after 60 s)".to_owned(),
    };
    println!("NESTED: removal of {bdf} {removal} after {remove_ms} ms");
    let gone = !Path::new(&format!("/sys/bus/pci/devices/{bdf}")).exists();
    (removal, remove_ms, gone)
}

/// The pool daemon in L1 with both edus as passthrough boards (one pool): the board view
/// names them and their dirty-tracking source; an endpoint's L2 (QEMU/KVM) drives its edu, the
/// endpoint is detached and the same edu attached to a second endpoint, whose L2 drives it
/// too; a move of a passthrough endpoint is refused. Then the edu is removed from L1 while
/// that L2 keeps it busy, its QEMU registered with the daemon: the removal completes, the
/// daemon quarantines the board and fails the endpoint over guest-visibly (L2's driver sees
/// the device lost and lets go of it, the daemon unplugs it through QMP and plugs a fresh
/// device on the other edu into the same slot), the driver's checks pass on the new device,
/// and QEMU exits normally.
pub fn pool_edu(dir: &Path) -> Result<Value> {
    let edus = bind_vfio("1234:11e8")?;
    let [a, b] = [edus.first(), edus.get(1)].map(|e| e.cloned());
    let (Some(a), Some(b)) = (a, b) else {
        bail!("two edus are needed, L1 has {edus:?}");
    };
    let config = dir.join("pool.toml");
    std::fs::write(
        &config,
        format!(
            "[[boards]]\nid = \"edu0\"\nmodel = \"vfio\"\nhost = \"{a}\"\n\n\
             [[boards]]\nid = \"edu1\"\nmodel = \"vfio\"\nhost = \"{b}\"\n\n\
             [[pools]]\nname = \"edus\"\nboards = [\"edu0\", \"edu1\"]\n"
        ),
    )?;
    let mut daemon = Daemon::start(dir, Some(&config))?;
    let r = pool_edu_with(dir, &mut daemon, [a, b]);
    if r.is_err() {
        println!("NESTED: daemon log tail:\n{}", tail(&daemon.log, 6000));
    }
    r
}

fn pool_edu_with(dir: &Path, daemon: &mut Daemon, [a, b]: [String; 2]) -> Result<Value> {
    let control = daemon.control.clone();
    let boards = ctl(&control, &["boards"])?;
    let vm1 = ctl(&control, &["create", "vm1", "--pool", "edus"])?;
    let vm2 = ctl(&control, &["create", "vm2", "--pool", "edus"])?;
    let socket = |v: &Value| -> Result<PathBuf> {
        Ok(PathBuf::from(
            v["endpoint"]["socket"]
                .as_str()
                .context("the endpoint's socket")?,
        ))
    };
    let (sock1, sock2) = (socket(&vm1)?, socket(&vm2)?);
    let run_edu = |name: &str, socket: &Path| -> Result<(i32, Value, Option<i32>)> {
        let mut vm = qemu_l2(dir, name, socket, "sy-edu", &[])?;
        l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ")
    };
    // The worker lets go of a client after QEMU exits (unpinning its DMA windows takes a
    // while under TCG); detach waits for nobody.
    let disconnected = |id: &str| {
        procs::wait_for(Duration::from_secs(60), "the VMM disconnected", || {
            let st = ctl(&control, &["endpoint", id])?;
            Ok((st["worker"]["connected"] == false).then_some(()))
        })
    };
    // The first VM uses edu0 and powers off.
    let first = run_edu("vm1-edu0", &sock1)?;
    disconnected("vm1")?;
    let refused_move = ctl(&control, &["move", "vm1", "--to", "edu1"]).err();
    // edu0 goes from vm1 to vm2.
    ctl(&control, &["detach", "vm1"])?;
    ctl(&control, &["detach", "vm2"])?;
    let attached = ctl(&control, &["attach", "vm2", "--device", "edu0"])?;
    // vm2's worker is killed once QEMU is connected (before L2's driver runs): the
    // replacement resets edu0, replays the configuration, maps L2's memory again and
    // continues QEMU's connection; L2 boots on and its driver passes.
    let mut vm = qemu_l2(dir, "vm2-edu0", &sock2, "sy-edu", &["--pause", "8"])?;
    let worker = || -> Result<Option<u64>> {
        let st = ctl(&control, &["endpoint", "vm2"])?;
        let w = &st["worker"];
        Ok((w["connected"] == true)
            .then(|| w["pid"].as_u64())
            .flatten())
    };
    let kill = |pid: u64| {
        std::process::Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status()
    };
    let victim = procs::wait_for(Duration::from_secs(120), "vm2's VMM connected", worker)?;
    kill(victim)?;
    println!("NESTED: killed vm2's worker {victim} with QEMU connected");
    // And again once L2's driver has its DMA windows and MSI set up: the replacement maps
    // the windows from custody into a new IOMMU container and hands the MSI eventfd to VFIO;
    // the driver's checks after its pause go through them.
    vm.wait_line("SY-EDU: pause", EDU_TIMEOUT)?;
    let victim2 = procs::wait_for(Duration::from_secs(20), "vm2's replacement worker", worker)?;
    kill(victim2)?;
    let before_resume = vm.find_line("SY-EDU: resumed").is_none();
    println!(
        "NESTED: killed vm2's worker {victim2} while L2's driver paused (before it resumed: {before_resume})"
    );
    let second = l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ")?;
    let resumed_with = last_resume(&daemon.log);
    let after_kill = ctl(&control, &["endpoint", "vm2"])?["worker"].clone();
    disconnected("vm2")?;
    // vm2's next boot keeps edu0 busy while it is removed from L1; its device sits on a
    // PCIe root port and its QEMU is registered with the daemon, so the board's failure is
    // failed over guest-visibly: the dead device unplugged, a fresh one on edu1 (free: vm1
    // has no device) plugged into the same slot, where L2's driver runs its checks again.
    let boards_before = ctl(&control, &["boards"])?;
    let mut vm = qemu_l2_hotplug(
        dir,
        "vm2-remove",
        &sock2,
        "sy-edu",
        &["--loop", "600", "--again", "120"],
    )?;
    vm.wait_line("SY-EDU: loop rounds=", EDU_TIMEOUT)?;
    let bus = root_port_id(1);
    let qmp = vm.qmp().context("the L2 VMM's QMP socket")?.to_owned();
    let qmp_arg = qmp.to_string_lossy();
    let registered = ctl(
        &control,
        &[
            "vmm",
            "vm2",
            "--qmp",
            &qmp_arg,
            "--device-id",
            "dev0",
            "--bus",
            &bus,
        ],
    )?;
    println!("NESTED: L2 keeps {a} (edu0) busy; removing it from L1");
    let (removal, remove_ms, gone) = remove_device(&a);
    let third = l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ")?;
    let again = vm
        .find_line("SY-EDU-AGAIN ")
        .map(|l| json_after(&l, "SY-EDU-AGAIN "))
        .transpose()?
        .unwrap_or(Value::Null);
    let lost = procs::wait_for(Duration::from_secs(20), "the board quarantined", || {
        let boards = ctl(&control, &["boards"])?;
        let quarantined = boards
            .as_array()
            .into_iter()
            .flatten()
            .any(|b| b["id"] == "edu0" && b["state"] == "quarantined");
        Ok(quarantined.then_some(boards))
    });
    let failed_over = procs::wait_for(Duration::from_secs(20), "vm2 failed over", || {
        let st = ctl(&control, &["endpoint", "vm2"])?;
        Ok((!st["failover"]["last"].is_null()).then_some(st))
    });
    let events = pool_events(&control)?;
    let pool_events = |kind: &str| -> Vec<Value> {
        events
            .iter()
            .filter(|p| p["kind"]["type"] == kind)
            .cloned()
            .collect()
    };
    let (failed_over_events, board_failed) =
        (pool_events("failed_over"), pool_events("board_failed"));
    let ep = ctl(&control, &["endpoint", "vm2"])?;
    let last = ep["failover"]["last"].clone();
    let edu0 = lost
        .as_ref()
        .ok()
        .and_then(|b| b.as_array())
        .and_then(|b| b.iter().find(|b| b["id"] == "edu0"))
        .cloned()
        .unwrap_or(Value::Null);
    let daemon_alive = daemon.alive();
    let pass =
        |r: &(i32, Value, Option<i32>)| r.0 == 0 && r.1["result"] == "pass" && r.2 == Some(0);
    let guest_visible = |e: &Value| {
        e["mode"] == "guest-visible"
            && e["from"].as_str().is_some_and(|f| f.starts_with("edu0"))
            && e["to"].as_str().is_some_and(|t| t.starts_with("edu1"))
    };
    let ok = pass(&first)
        && pass(&second)
        && second.1["after_pause_ok"] == true
        && before_resume
        && resumed_with["windows"].as_u64().is_some_and(|n| n > 0)
        && resumed_with["vectors"].as_u64().is_some_and(|n| n > 0)
        && refused_move.is_some()
        && attached["lease"]["id"] == "edu0"
        && after_kill["restarts"] == 2
        && removal == "completed"
        && gone
        && third.1["result"] == "device-lost"
        && third.1["device_lost"].is_string()
        && again["result"] == "pass"
        && again["factorial_ok"] == true
        && again["dma_bytes_verified"].as_u64() > Some(0)
        && third.0 == 0
        && third.2 == Some(0)
        && lost.is_ok()
        && !edu0["failed"].is_null()
        && failed_over.is_ok()
        && guest_visible(&last)
        && last["stall_ms"].as_f64().is_some()
        && failed_over_events.iter().any(|e| guest_visible(&e["kind"]))
        && !board_failed.is_empty()
        && ep["lease"]["id"]
            .as_str()
            .is_some_and(|d| d.starts_with("edu1"))
        && daemon_alive;
    if !ok {
        println!("NESTED: daemon log tail:\n{}", tail(&daemon.log, 6000));
        println!("NESTED: L2 QEMU log tail:\n{}", tail(&vm.log, 4000));
    }
    let view = |r: &(i32, Value, Option<i32>)| json!({"rc": r.0, "summary": r.1, "qemu_exit": r.2});
    Ok(json!({
        "ok": ok, "hosts": [a, b], "boards": boards,
        "vm1_edu0": view(&first), "vm2_edu0": view(&second),
        "killed_workers": [victim, victim2], "vm2_worker_after_kill": after_kill,
        "second_kill_before_resume": before_resume, "resumed_with": resumed_with,
        "move_refused": refused_move.map(|e| format!("{e:#}")),
        "attached": attached["lease"],
        "removal": removal, "remove_ms": remove_ms, "device_gone_from_l1": gone,
        "vm2_remove": view(&third), "vm2_again": again, "vmm_registered": registered,
        "boards_before_removal": boards_before, "failover": last,
        "failed_over_events": failed_over_events, "board_failed_events": board_failed,
        "failover_refused_events": pool_events("failover_refused"),
        "edu0_after": edu0, "vm2_lease": ep["lease"],
        "boards_after": lost.unwrap_or(Value::Null), "vm2_worker": ep["worker"],
        "daemon_alive": daemon_alive,
    }))
}

/// What the last passthrough replacement in a daemon log resumed with: `{"windows": n,
/// "vectors": n}` from its "worker resumed the connection" line (null when none).
fn last_resume(log: &Path) -> Value {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let Some(line) = text
        .lines()
        .rev()
        .find(|l| l.contains("worker resumed the connection"))
    else {
        return Value::Null;
    };
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .and_then(|v| v.parse::<u64>().ok())
    };
    json!({"windows": field("windows="), "vectors": field("vectors=")})
}

/// A stress form of `pool-edu`'s kill, for diagnosis: one passthrough endpoint whose L2 boots
/// nine times, its worker killed at a range of delays after QEMU connected (once not at
/// all); every boot must pass. Stops at the first failure, with the daemon's log.
pub fn pool_edu_kills(dir: &Path) -> Result<Value> {
    let edus = bind_vfio("1234:11e8")?;
    let a = edus.first().cloned().context("an edu")?;
    let config = dir.join("pool.toml");
    std::fs::write(
        &config,
        format!(
            "[[boards]]\nid = \"edu0\"\nmodel = \"vfio\"\nhost = \"{a}\"\n\n\
             [[pools]]\nname = \"edus\"\nboards = [\"edu0\"]\n"
        ),
    )?;
    let daemon = Daemon::start(dir, Some(&config))?;
    let control = daemon.control.clone();
    let vm = ctl(&control, &["create", "vm", "--pool", "edus"])?;
    let socket = PathBuf::from(vm["endpoint"]["socket"].as_str().context("socket")?);
    let delays = [
        Some(0),
        Some(0),
        Some(50),
        Some(150),
        Some(400),
        None,
        Some(0),
        Some(1000),
        Some(0),
    ];
    let mut rounds = vec![];
    let mut ok = true;
    for (i, delay) in delays.iter().enumerate() {
        let name = format!("vm-{i}");
        let t = Instant::now();
        let mut vm = qemu_l2(dir, &name, &socket, "sy-edu", &[])?;
        let victim = procs::wait_for(Duration::from_secs(120), "the VMM connected", || {
            let st = ctl(&control, &["endpoint", "vm"])?;
            let w = &st["worker"];
            Ok((w["connected"] == true)
                .then(|| w["pid"].as_u64())
                .flatten())
        })?;
        let connected_ms = t.elapsed().as_millis();
        if let Some(d) = delay {
            std::thread::sleep(Duration::from_millis(*d));
            std::process::Command::new("kill")
                .args(["-KILL", &victim.to_string()])
                .status()?;
        }
        println!("NESTED: round {i}: connected after {connected_ms} ms, kill after {delay:?} ms");
        let r = l2_outcome(&mut vm, "sy-edu", "SY-EDU-SUMMARY ");
        let pass = matches!(&r, Ok((0, s, Some(0))) if s["result"] == "pass");
        println!("NESTED: round {i}: pass={pass} in {:?}: {r:?}", t.elapsed());
        if !pass {
            ok = false;
            println!("NESTED: daemon log tail:\n{}", tail(&daemon.log, 20000));
            println!("NESTED: qemu log:\n{}", tail(&vm.log, 4000));
        }
        drop(vm);
        let _ = procs::wait_for(Duration::from_secs(60), "the VMM disconnected", || {
            let st = ctl(&control, &["endpoint", "vm"])?;
            Ok((st["worker"]["connected"] == false).then_some(()))
        });
        rounds.push(json!({"delay_ms": delay, "pass": pass, "connected_ms": connected_ms as u64}));
        if !pass {
            break;
        }
    }
    Ok(json!({"ok": ok, "rounds": rounds}))
}

/// A pool daemon in L1 (`switchyard daemon`, its log in `dir/daemon.log`); stopped (SIGTERM)
/// when dropped.
struct Daemon {
    child: std::process::Child,
    control: PathBuf,
    log: PathBuf,
}

impl Daemon {
    /// Starts it with `config` (or the embedded default pool) and waits for its control API.
    fn start(dir: &Path, config: Option<&Path>) -> Result<Daemon> {
        let log = dir.join("daemon.log");
        let out = std::fs::File::create(&log)?;
        let mut cmd = std::process::Command::new(SWITCHYARD);
        cmd.arg("daemon");
        if let Some(c) = config {
            cmd.arg("--config").arg(c);
        }
        let child = cmd
            .arg("--state-dir")
            .arg(dir.join("state"))
            .arg("--run-dir")
            .arg(dir.join("run"))
            .env(
                "RUST_LOG",
                procs::SERVER_LOG.get().map_or("info", String::as_str),
            )
            .env("SWITCHYARD_WORKER_EXE", SWITCHYARD)
            .stdin(std::process::Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .context("start switchyard daemon")?;
        let daemon = Daemon {
            child,
            control: dir.join("run/control.sock"),
            log,
        };
        procs::wait_for(
            Duration::from_secs(60),
            "the daemon's control socket",
            || Ok(ctl(&daemon.control, &["pools"]).is_ok().then_some(())),
        )?;
        Ok(daemon)
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

/// `switchyard ctl --socket SOCKET --json ARGS...`, parsed.
fn ctl(socket: &Path, args: &[&str]) -> Result<Value> {
    let out = std::process::Command::new(SWITCHYARD)
        .arg("ctl")
        .arg("--socket")
        .arg(socket)
        .arg("--json")
        .args(args)
        .output()
        .context("run switchyard ctl")?;
    if !out.status.success() {
        bail!(
            "switchyard ctl {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("ctl JSON")
}

/// The pool's events so far (`switchyard ctl --json events`: one JSON object a line; the
/// `pool` member of each pool event).
fn pool_events(socket: &Path) -> Result<Vec<Value>> {
    let out = std::process::Command::new(SWITCHYARD)
        .arg("ctl")
        .arg("--socket")
        .arg(socket)
        .arg("--json")
        .arg("events")
        .output()
        .context("run switchyard ctl events")?;
    if !out.status.success() {
        bail!(
            "switchyard ctl events: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|e| e.get("pool").cloned())
        .collect())
}

/// The pool daemon in L1 serves a cloud-hypervisor L2 whose user space reads a softgpu register
/// thousands of times while the endpoint's worker is killed (SIGKILL) again and again: every
/// read returns the register's value (the VMM's socket never drops; the replacement worker
/// serves the same connection) and cloud-hypervisor notices nothing.
pub fn ch_pool(dir: &Path) -> Result<Value> {
    let daemon = Daemon::start(dir, None)?;
    let control = daemon.control.clone();
    let log_path = daemon.log.clone();
    let r = (|| -> Result<Value> {
        let created = ctl(&control, &["create", "vm1", "--pool", "default"])?;
        let socket = created["endpoint"]["socket"]
            .as_str()
            .context("the endpoint's socket")?
            .to_owned();
        // Twice this many reads (timed one by one, then as a batch): ~10 s at ~1 ms each.
        let reads = "4000";
        let args = [
            "--id",
            "1234:5347",
            "--count",
            reads,
            "--expect",
            "0x50475953",
            "--label",
            "pool",
        ];
        let mut spec = l2_spec("pool", l2_cmdline("sy-mmio", &args));
        spec.user_devices = vec![UserDeviceConfig::new(&socket).id("gpu0")];
        let mut vm = Vm::start(dir, spec)?;
        vm.wait_line("GUEST: test sy-mmio start", L2_TIMEOUT)?;
        let mut kills = 0u32;
        let mut last_pid = None;
        while kills < 3 && vm.find_line("SY-MMIO ").is_none() {
            std::thread::sleep(Duration::from_millis(1000));
            let st = ctl(&control, &["endpoint", "vm1"])?;
            let w = &st["worker"];
            let pid = w["pid"].as_u64();
            // Kill only a worker that serves (the previous replacement is ready).
            if w["ready"].as_u64() > Some(u64::from(kills)) && pid.is_some() && pid != last_pid {
                let pid = pid.unwrap_or_default().to_string();
                std::process::Command::new("kill")
                    .args(["-KILL", &pid])
                    .status()?;
                println!("NESTED: killed worker {pid} (kill {})", kills + 1);
                kills += 1;
                last_pid = st["worker"]["pid"].as_u64();
            }
        }
        let (rc, summary, exit) = l2_outcome(&mut vm, "sy-mmio", "SY-MMIO ")?;
        let st = ctl(&control, &["endpoint", "vm1"])?;
        let ok = rc == 0
            && exit == Some(0)
            && kills >= 2
            && summary["mismatches"] == 0
            && st["worker"]["restarts"].as_u64() >= Some(u64::from(kills));
        if !ok {
            println!("NESTED: daemon log tail:\n{}", tail(&log_path, 4000));
        }
        Ok(json!({
            "ok": ok, "kills": kills, "reads": summary["count"], "mismatches": summary["mismatches"],
            "read_ns": summary["read_ns"], "sy_mmio_rc": rc, "ch_exit": exit,
            "worker": st["worker"],
        }))
    })();
    drop(daemon);
    r
}
