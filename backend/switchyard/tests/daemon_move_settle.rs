//! A move whose data path finished is never recorded as aborted (issue 22): the worker's
//! truth wins and the lease follows it.
//!
//! - A daemon killed during a transparent move: its worker finishes the move alone, and the
//!   restarted daemon, adopting the worker, learns that and commits the move; a move the
//!   worker fails after the kill is aborted.
//! - A guest-visible move whose device cannot be plugged back (QMP `device_add` fails after
//!   the data path moved): committed, and the error says the device moved and how to plug it
//!   in. The VMM is a fake QMP server on a UNIX socket.
//!
//! Workers outlive their daemon by design, so every test kills the daemon and then every
//! worker it recorded when it ends (`common::daemon::Daemon`'s drop).
#![forbid(unsafe_code)]

mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::daemon::{Daemon, connect, socket_of};
use serde_json::{Value, json};
use switchyard_client::{Client, ClientConfig};
use switchyard_control::ControlError;
use switchyard_proto::MigState;
use switchyard_softgpu::BAR_VRAM;
use switchyard_softgpu::cmd::{Command, Operand};

/// Two boards with trapped VRAM (transparent moves), large enough for a move to take a
/// while once the client filled it.
const BIG_TRAPPED_BOARDS: &str = "[[boards]]\nid = \"gpu0\"\nvram = \"512M\"\nqueues = 1\nvram_mmap = false\n\
     [[boards]]\nid = \"gpu1\"\nvram = \"512M\"\nqueues = 1\nvram_mmap = false\n";

/// What the client fills VRAM with (by its engine, fast), so that the move's first round
/// has this much to copy.
const FILLED: u64 = 384 << 20;
/// Where the client writes its own data, through BAR2.
const KEPT_AT: u64 = FILLED + (16 << 20);

/// A pattern no two offsets share.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9).wrapping_add(seed) >> 3) as u8)
        .collect()
}

fn lease_board(d: &mut Daemon, id: &str) -> String {
    d.endpoint(id)
        .pointer("/lease/board")
        .and_then(Value::as_str)
        .unwrap_or_else(|| panic!("no lease: {}", d.endpoint(id)))
        .to_owned()
}

/// The pool events' kinds, in order.
fn pool_kinds(d: &Daemon) -> Vec<String> {
    d.events()
        .iter()
        .filter_map(|e| e.pointer("/pool/kind/type").and_then(Value::as_str))
        .map(str::to_owned)
        .collect()
}

/// How many VRAM memory objects process `pid` has open (distinct memfds): 2 once a move's
/// target exists.
fn vram_objects(pid: u32) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(fds) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return 0;
    };
    let inodes: std::collections::BTreeSet<u64> = fds
        .flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|l| l.to_string_lossy().contains("switchyard-softgpu-vram"))
        })
        .filter_map(|fd| std::fs::metadata(fd.path()).ok().map(|m| m.ino()))
        .collect();
    inodes.len()
}

/// vm1 on gpu0 with a client that filled most of VRAM and wrote `kept` at [`KEPT_AT`]; a
/// move of vm1 to gpu1 asked on a thread, and the daemon SIGKILLed as soon as the worker's
/// data path runs (the move's target VRAM exists). Returns the client, the worker's pid
/// and the move's answer (which the killed daemon never gave).
fn kill_the_daemon_during_a_move(
    d: &mut Daemon,
    kept: &[u8],
) -> (
    common::driver::Driver<common::ours::Ours>,
    Value,
    Result<switchyard_control::JsonReply, ControlError>,
) {
    d.ctl_ok(&["create", "vm1", "--device", "gpu0"]);
    let e1 = d.endpoint("vm1");
    let mut c1 = connect(&socket_of(&e1));
    c1.setup_queue(0);
    let half = FILLED / 2;
    c1.run(
        0,
        &[
            Command::fill(Operand::Vram(0), half, 0x5a5a_0001),
            Command::fill(Operand::Vram(half), half, 0xa5a5_0002),
        ],
    );
    for (i, chunk) in kept.chunks(64 << 10).enumerate() {
        c1.vram_write(KEPT_AT + (i as u64) * (64 << 10), chunk);
    }
    let pid = d.endpoint("vm1")["worker"]["pid"].clone();
    let worker = pid.as_u64().expect("a worker") as u32;
    assert_eq!(vram_objects(worker), 1);
    let client = d.client();
    let mover =
        std::thread::spawn(move || client.post("/v1/endpoints/vm1/move", &json!({ "to": "gpu1" })));
    // The worker creates the move's target VRAM, then copies.
    let deadline = Instant::now() + Duration::from_secs(30);
    while vram_objects(worker) < 2 {
        assert!(
            !mover.is_finished(),
            "the move ended before its data path was seen: {:?}",
            mover.join()
        );
        assert!(Instant::now() < deadline, "the worker does not move");
        std::thread::sleep(Duration::from_millis(1));
    }
    d.kill9();
    let answer = mover.join().expect("mover");
    (c1, pid, answer)
}

/// The kill landed during the move: the killed daemon had started it and neither committed
/// nor aborted it.
fn assert_left_in_progress(kinds: &[String]) {
    let second_open = kinds
        .iter()
        .rposition(|k| k == "opened")
        .expect("the restart's `opened`");
    let before = &kinds[..second_open];
    assert!(
        before.iter().any(|k| k == "move_started")
            && !before
                .iter()
                .any(|k| k == "lease_moved" || k == "move_aborted"),
        "the killed daemon left the move in progress: {kinds:?}"
    );
}

#[test]
fn a_move_the_worker_finishes_after_the_daemon_is_killed_is_committed() {
    let mut d = Daemon::start_with_config(BIG_TRAPPED_BOARDS);
    let kept = pattern(3, 1 << 20);
    let (mut c1, pid, answer) = kill_the_daemon_during_a_move(&mut d, &kept);
    assert!(answer.is_err(), "the killed daemon answered: {answer:?}");

    // The worker moves on alone; the restarted daemon adopts it and learns that it moved.
    d.launch();
    assert_eq!(
        lease_board(&mut d, "vm1"),
        "gpu1",
        "the lease follows the device"
    );
    let now = d.endpoint("vm1");
    assert_eq!(now["worker"]["state"], "running", "{now}");
    assert_eq!(
        now["worker"]["pid"], pid,
        "the worker that moved is adopted: {now}"
    );
    assert_eq!(now["worker"]["restarts"], 0, "{now}");
    let kinds = pool_kinds(&d);
    assert_left_in_progress(&kinds);
    assert!(
        kinds.ends_with(&["opened".to_owned(), "lease_moved".to_owned()]),
        "the restarted daemon committed the move: {kinds:?}"
    );
    assert!(
        !kinds.iter().any(|k| k == "move_aborted"),
        "never aborted: {kinds:?}"
    );
    let metrics = d.ctl_ok(&["metrics"]);
    assert!(
        metrics.contains(r#"switchyard_board_moves_total{board="gpu0"} 1"#),
        "{metrics}"
    );

    // The client's data is on the device, which runs on the target's VRAM: what the client
    // wrote and what its engine filled, read back through the same connection.
    let mut got = vec![0u8; kept.len()];
    for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
        c1.vram_read(KEPT_AT + (i as u64) * (64 << 10), chunk);
    }
    assert!(got == kept, "the client's data moved with the device");
    for (off, word) in [(0u64, 0x5a5a_0001u32), (FILLED - 4, 0xa5a5_0002)] {
        let mut b = [0u8; 4];
        c1.vram_read(off, &mut b);
        assert_eq!(u32::from_le_bytes(b), word, "VRAM at {off:#x}");
    }
    c1.run(
        0,
        &[Command::fill(Operand::Vram(KEPT_AT), 4096, 0x0101_0101)],
    );
    // The next move starts from the target.
    let out = d.ctl_ok(&["move", "vm1", "--to", "gpu0"]);
    assert!(out.contains("moved from gpu1 to gpu0"), "{out}");
}

#[test]
fn a_move_the_worker_fails_after_the_daemon_is_killed_is_aborted() {
    let mut d = Daemon::start_with_config(BIG_TRAPPED_BOARDS);
    let kept = pattern(5, 1 << 20);
    let (mut c1, _, answer) = kill_the_daemon_during_a_move(&mut d, &kept);
    assert!(answer.is_err(), "the killed daemon answered: {answer:?}");
    // The VMM stops the device before the worker could switch it: the switch is refused
    // (a device is not moved under a migration's stop), the device stays on gpu0.
    c1.t.0.set_mig_state(MigState::Stop as u32).expect("STOP");

    d.launch();
    assert_eq!(lease_board(&mut d, "vm1"), "gpu0", "the device stayed");
    let kinds = pool_kinds(&d);
    assert_left_in_progress(&kinds);
    assert!(
        kinds.ends_with(&["opened".to_owned(), "move_aborted".to_owned()]),
        "the restarted daemon aborted the move: {kinds:?}"
    );
    assert!(!kinds.iter().any(|k| k == "lease_moved"), "{kinds:?}");
    assert!(
        d.log().contains("failed the move"),
        "the log says why the move was aborted"
    );
    c1.t.0
        .set_mig_state(MigState::Running as u32)
        .expect("RUNNING");
    let mut got = vec![0u8; kept.len()];
    for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
        c1.vram_read(KEPT_AT + (i as u64) * (64 << 10), chunk);
    }
    assert!(got == kept, "the client's data is where it was");
    // gpu1 is free again: the endpoint can move there.
    let out = d.ctl_ok(&["move", "vm1", "--to", "gpu1"]);
    assert!(out.contains("moved from gpu0 to gpu1"), "{out}");
}

/// A fake VMM: a QMP server on `path` that greets, accepts `qmp_capabilities`, answers
/// `device_del` by running `on_unplug` (the guest lets go: the client disconnects), `{}`
/// and a `DEVICE_DELETED` event for the id, and fails every `device_add`. Returns the
/// commands it got.
fn fake_qmp(path: &Path, on_unplug: impl FnOnce() + Send + 'static) -> Arc<Mutex<Vec<Value>>> {
    let listener = UnixListener::bind(path).expect("bind the QMP socket");
    let got = Arc::new(Mutex::new(Vec::new()));
    let seen = got.clone();
    std::thread::spawn(move || {
        let mut on_unplug = Some(on_unplug);
        for conn in listener.incoming() {
            let Ok(conn) = conn else { return };
            serve_qmp(conn, &seen, &mut on_unplug);
        }
    });
    got
}

fn serve_qmp(conn: UnixStream, seen: &Mutex<Vec<Value>>, on_unplug: &mut Option<impl FnOnce()>) {
    let mut out = conn.try_clone().expect("clone");
    let mut send = |v: Value| {
        let mut line = v.to_string();
        line.push('\n');
        out.write_all(line.as_bytes()).is_ok()
    };
    let greeting = json!({"QMP": {"version": {"qemu": {"major": 11, "minor": 1, "micro": 0},
        "package": "fake"}, "capabilities": []}});
    if !send(greeting) {
        return;
    }
    for line in BufReader::new(conn).lines() {
        let Ok(line) = line else { return };
        let Ok(req) = serde_json::from_str::<Value>(&line) else {
            return;
        };
        seen.lock().expect("lock").push(req.clone());
        let id = req["id"].clone();
        let ok = match req["execute"].as_str() {
            Some("device_del") => {
                if let Some(f) = on_unplug.take() {
                    f();
                }
                let device = req["arguments"]["id"].clone();
                send(json!({"return": {}, "id": id}))
                    && send(json!({"event": "DEVICE_DELETED",
                        "data": {"device": device, "path": "/machine/peripheral/dev"},
                        "timestamp": {"seconds": 1, "microseconds": 0}}))
            }
            Some("device_add") => send(json!({"error": {"class": "GenericError",
                "desc": "fake VMM: no free slot on bus rp1"}, "id": id})),
            _ => send(json!({"return": {}, "id": id})),
        };
        if !ok {
            return;
        }
    }
}

/// Two boards whose guests may map VRAM (guest-visible moves), with MSI (QEMU cannot
/// unplug an MSI-X vfio-user device).
const MAPPED_MSI_BOARDS: &str = "[[boards]]\nid = \"a\"\nvram = \"16M\"\nirq = \"msi\"\nvram_reset = \"keep\"\n\
     [[boards]]\nid = \"b\"\nvram = \"16M\"\nirq = \"msi\"\nvram_reset = \"keep\"\n";

fn client(socket: &Path) -> Client {
    Client::connect_with(
        socket,
        ClientConfig {
            timeout: Some(Duration::from_secs(5)),
            ..ClientConfig::default()
        },
    )
    .expect("connect to the endpoint")
}

/// Registers a fake VMM ([`fake_qmp`], device `gpu-dev0` on `rp1`) for `vm1`, whose guest
/// (`guest`) lets go of the device when the VMM unplugs it. Returns the commands it gets.
fn register_fake_vmm(d: &Daemon, guest: Client) -> Arc<Mutex<Vec<Value>>> {
    let guest = Mutex::new(Some(guest));
    let qmp = d.dir().join("qmp.sock");
    let commands = fake_qmp(&qmp, move || {
        guest.lock().expect("lock").take();
    });
    d.client()
        .put(
            "/v1/endpoints/vm1/vmm",
            &json!({"qmp": qmp, "device_id": "gpu-dev0", "bus": "rp1"}),
        )
        .expect("register the VMM");
    commands
}

#[test]
fn a_guest_visible_move_that_cannot_plug_the_device_back_is_committed_and_says_so() {
    let mut d = Daemon::start_with_config(MAPPED_MSI_BOARDS);
    d.ctl_ok(&["create", "vm1", "--device", "a"]);
    let e1 = d.endpoint("vm1");
    let socket = socket_of(&e1);
    let mut guest = client(&socket);
    let kept = pattern(9, 256 << 10);
    for (i, chunk) in kept.chunks(64 << 10).enumerate() {
        guest
            .region_write(BAR_VRAM, (1 << 20) + (i as u64) * (64 << 10), chunk)
            .expect("write VRAM");
    }
    let commands = register_fake_vmm(&d, guest);

    let answer = d
        .client()
        .post("/v1/endpoints/vm1/move", &json!({ "to": "b" }));
    let Err(ControlError::Api {
        status, message, ..
    }) = answer
    else {
        panic!("the plug-back failure is an error: {answer:?}");
    };
    // The data path moved the device: the lease follows it, plugged back or not.
    assert_eq!(lease_board(&mut d, "vm1"), "b");
    let kinds = pool_kinds(&d);
    assert!(kinds.iter().any(|k| k == "lease_moved"), "{kinds:?}");
    assert!(!kinds.iter().any(|k| k == "move_aborted"), "{kinds:?}");
    // The error says so: where the device is, the QMP error, how to plug it in.
    assert_eq!(status, 502, "{message}");
    for part in [
        "moved to board b",
        "could not be plugged back",
        "fake VMM: no free slot on bus rp1",
        "device_add",
        "gpu-dev0",
    ] {
        assert!(message.contains(part), "`{part}` missing: {message}");
    }
    let executed: Vec<String> = commands
        .lock()
        .expect("lock")
        .iter()
        .filter_map(|c| c["execute"].as_str().map(str::to_owned))
        .collect();
    assert!(
        executed.ends_with(&["device_del".to_owned(), "device_add".to_owned()]),
        "{executed:?}"
    );

    assert_eq!(d.endpoint("vm1")["worker"]["state"], "running");
    // Plugged in by hand (a new connection, as after device_add): the guest's VRAM moved.
    let mut again = client(&socket);
    let mut got = vec![0u8; kept.len()];
    for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
        again
            .region_read(BAR_VRAM, (1 << 20) + (i as u64) * (64 << 10), chunk)
            .expect("read VRAM");
    }
    assert!(got == kept, "the guest's VRAM moved with the device");
}

/// `attach` of an endpoint whose VMM is registered plugs the device in through QMP: it
/// answers (here the fake VMM refuses the plug: 502 naming its error), it does not hang on
/// the VMM registry's lock.
#[test]
fn attach_with_a_registered_vmm_answers_and_names_the_failed_plug() {
    let mut d = Daemon::start_with_config(MAPPED_MSI_BOARDS);
    d.ctl_ok(&["create", "vm1", "--device", "a"]);
    let socket = socket_of(&d.endpoint("vm1"));
    let commands = register_fake_vmm(&d, client(&socket));
    d.client()
        .post("/v1/endpoints/vm1/detach", &json!({}))
        .expect("detach");

    let answer = d
        .client()
        .with_timeout(Some(Duration::from_secs(20)))
        .post("/v1/endpoints/vm1/attach", &json!({ "device": "b" }));
    let Err(ControlError::Api {
        status, message, ..
    }) = answer
    else {
        panic!("the fake VMM refuses the plug: an error, not {answer:?}");
    };
    assert_eq!(status, 502, "{message}");
    assert!(
        message.contains("fake VMM: no free slot on bus rp1"),
        "{message}"
    );
    let executed: Vec<String> = commands
        .lock()
        .expect("lock")
        .iter()
        .filter_map(|c| c["execute"].as_str().map(str::to_owned))
        .filter(|c| c != "qmp_capabilities")
        .collect();
    assert!(executed == ["device_del", "device_add"], "{executed:?}");
    assert_eq!(lease_board(&mut d, "vm1"), "b");
}
