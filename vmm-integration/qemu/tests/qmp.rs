//! QMP client tests against a scripted fake QMP server on a unix socket.
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use switchyard_qemu::{QemuError, QemuVersionNumber, Qmp, all_pci_devices};
use tempfile::TempDir;

const T: Duration = Duration::from_secs(5);

/// The server side of one QMP connection.
struct Peer {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl Peer {
    fn send(&mut self, v: Value) {
        // QEMU terminates messages with "\r\n".
        write!(self.writer, "{v}\r\n").expect("fake send");
    }

    fn send_raw(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).expect("fake send raw");
    }

    fn recv(&mut self) -> Value {
        let mut line = String::new();
        let n = self.reader.read_line(&mut line).expect("fake recv");
        assert!(n > 0, "client closed the connection");
        serde_json::from_str(&line).expect("client sent valid JSON")
    }

    /// Receives a command, checks its name and arguments, and returns it.
    fn expect_cmd(&mut self, name: &str, args: Option<Value>) -> Value {
        let cmd = self.recv();
        assert_eq!(cmd["execute"], name, "command: {cmd}");
        assert_eq!(cmd.get("arguments").cloned(), args, "arguments: {cmd}");
        assert!(
            cmd["id"].is_u64(),
            "every command carries a numeric id: {cmd}"
        );
        cmd
    }

    fn reply(&mut self, cmd: &Value, ret: Value) {
        self.send(json!({ "return": ret, "id": cmd["id"] }));
    }

    fn reply_error(&mut self, cmd: &Value, class: &str, desc: &str) {
        self.send(json!({ "error": { "class": class, "desc": desc }, "id": cmd["id"] }));
    }

    fn event(&mut self, name: &str, data: Value) {
        self.send(json!({
            "event": name,
            "data": data,
            "timestamp": { "seconds": 1_700_000_000, "microseconds": 42 }
        }));
    }

    fn handshake(&mut self) {
        self.send(json!({
            "QMP": {
                "version": {
                    "qemu": { "micro": 3, "minor": 1, "major": 11 },
                    "package": "Debian 1:11.1.3+ds-1~bpo13+1"
                },
                "capabilities": ["oob"]
            }
        }));
        let cmd = self.expect_cmd("qmp_capabilities", None);
        self.reply(&cmd, json!({}));
    }
}

struct Fake {
    _dir: TempDir,
    path: PathBuf,
    handle: JoinHandle<()>,
}

impl Fake {
    fn join(self) {
        self.handle.join().expect("fake QMP server panicked");
    }
}

fn fake_qmp(script: impl FnOnce(Peer) + Send + 'static) -> Fake {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("qmp.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let handle = thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        let writer = stream.try_clone().expect("clone");
        script(Peer {
            reader: BufReader::new(stream),
            writer,
        });
    });
    Fake {
        _dir: dir,
        path,
        handle,
    }
}

#[test]
fn connect_reads_greeting_and_negotiates_capabilities() {
    let fake = fake_qmp(|mut p| p.handshake());
    let qmp = Qmp::connect(&fake.path, T).expect("connect");
    let g = qmp.greeting();
    assert_eq!(
        g.version.qemu,
        QemuVersionNumber {
            major: 11,
            minor: 1,
            micro: 3
        }
    );
    assert_eq!(g.version.package, "Debian 1:11.1.3+ds-1~bpo13+1");
    assert_eq!(g.capabilities, ["oob"]);
    assert_eq!(qmp.path(), fake.path);
    fake.join();
}

#[test]
fn connect_waits_for_the_socket_to_appear() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("late.sock");
    let server_path = path.clone();
    let handle = thread::spawn(move || {
        thread::sleep(Duration::from_millis(150));
        let listener = UnixListener::bind(&server_path).expect("bind");
        let (stream, _) = listener.accept().expect("accept");
        let writer = stream.try_clone().expect("clone");
        Peer {
            reader: BufReader::new(stream),
            writer,
        }
        .handshake();
    });
    Qmp::connect(&path, T).expect("connect after retries");
    handle.join().expect("server");
}

#[test]
fn connect_to_missing_socket_times_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let start = Instant::now();
    let err = Qmp::connect(dir.path().join("none.sock"), Duration::from_millis(200))
        .expect_err("nothing listens");
    assert!(matches!(err, QemuError::Connect { .. }), "{err}");
    assert!(start.elapsed() >= Duration::from_millis(150));
    assert!(
        err.to_string()
            .starts_with("Failed to connect to the QMP socket ")
    );
}

#[test]
fn bad_greeting_is_rejected() {
    let fake = fake_qmp(|mut p| p.send(json!({ "hello": 1 })));
    let err = Qmp::connect(&fake.path, T).expect_err("not a greeting");
    assert!(matches!(err, QemuError::UnexpectedMessage { .. }), "{err}");
    fake.join();
}

#[test]
fn execute_returns_value_and_typed_query_status() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("query-status", None);
        p.reply(
            &cmd,
            json!({ "running": false, "status": "prelaunch", "singlestep": false }),
        );
        let cmd = p.expect_cmd(
            "qom-get",
            Some(json!({ "path": "/machine", "property": "type" })),
        );
        p.reply(&cmd, json!("pc-q35-11.1-machine"));
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    let st = qmp.query_status().expect("query-status");
    assert!(!st.running);
    assert_eq!(st.status, "prelaunch");
    let v = qmp
        .execute(
            "qom-get",
            Some(json!({ "path": "/machine", "property": "type" })),
        )
        .expect("qom-get");
    assert_eq!(v, "pc-q35-11.1-machine");
    fake.join();
}

#[test]
fn error_response_is_typed() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("device_del", Some(json!({ "id": "nope" })));
        p.reply_error(&cmd, "DeviceNotFound", "Device 'nope' not found");
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    let err = qmp
        .device_del("nope", Duration::from_secs(1))
        .expect_err("error reply");
    match &err {
        QemuError::Command {
            command,
            class,
            desc,
        } => {
            assert_eq!(command, "device_del");
            assert_eq!(class, "DeviceNotFound");
            assert_eq!(desc, "Device 'nope' not found");
        }
        other => panic!("unexpected error {other}"),
    }
    assert_eq!(
        err.to_string(),
        "QMP command device_del failed: DeviceNotFound: Device 'nope' not found"
    );
    fake.join();
}

#[test]
fn events_before_a_reply_are_buffered() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("stop", None);
        p.event("STOP", Value::Null);
        p.event("RESUME", json!({}));
        p.reply(&cmd, json!({}));
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    assert_eq!(qmp.execute("stop", None).expect("stop"), json!({}));
    // Both events are already buffered; no further I/O is needed.
    let ev = qmp
        .wait_event("RESUME", Duration::from_millis(1))
        .expect("buffered RESUME");
    assert_eq!(ev.event, "RESUME");
    let ts = ev.timestamp.expect("timestamp");
    assert_eq!((ts.seconds, ts.microseconds), (1_700_000_000, 42));
    let rest = qmp.take_events();
    assert_eq!(rest.len(), 1);
    assert_eq!(rest[0].event, "STOP");
    assert!(qmp.take_events().is_empty());
    fake.join();
}

#[test]
fn stale_reply_from_a_timed_out_command_is_discarded() {
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let fake = fake_qmp(move |mut p| {
        p.handshake();
        let slow = p.expect_cmd("slow", None);
        go_rx.recv().expect("go");
        let next = p.expect_cmd("query-status", None);
        // The late reply to the first command arrives before the second's.
        p.reply(&slow, json!("late"));
        p.reply(&next, json!({ "running": true, "status": "running" }));
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    qmp.set_timeout(Duration::from_millis(100));
    let err = qmp.execute("slow", None).expect_err("times out");
    assert!(
        matches!(&err, QemuError::Timeout { waiting_for, .. } if waiting_for == "the reply to slow"),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "Timed out after 100ms waiting for the reply to slow"
    );
    go_tx.send(()).expect("go");
    qmp.set_timeout(T);
    assert!(qmp.query_status().expect("query-status").running);
    fake.join();
}

#[test]
fn device_add_vfio_user_sends_nested_socket_json() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd(
            "device_add",
            Some(json!({
                "driver": "vfio-user-pci",
                "socket": { "type": "unix", "path": "/tmp/sw,it\"ch.sock" },
                "id": "gpu0",
                "bus": "rp1"
            })),
        );
        p.reply(&cmd, json!({}));
        let cmd = p.expect_cmd(
            "device_add",
            Some(json!({
                "driver": "vfio-user-pci",
                "socket": { "type": "unix", "path": "/tmp/b.sock" },
                "id": "gpu1"
            })),
        );
        p.reply_error(
            &cmd,
            "GenericError",
            "Failed to connect to '/tmp/b.sock': No such file or directory",
        );
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    qmp.device_add_vfio_user("gpu0", "/tmp/sw,it\"ch.sock", Some("rp1"))
        .expect("device_add");
    let err = qmp
        .device_add_vfio_user("gpu1", "/tmp/b.sock", None)
        .expect_err("server not listening");
    assert!(matches!(err, QemuError::Command { .. }), "{err}");
    fake.join();
}

#[test]
fn device_del_waits_for_the_matching_device_deleted() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("device_del", Some(json!({ "id": "gpu0" })));
        p.reply(&cmd, json!({}));
        // Events for unrelated or child objects must not end the wait.
        p.event(
            "DEVICE_DELETED",
            json!({ "path": "/machine/peripheral/gpu0/child" }),
        );
        p.event(
            "DEVICE_DELETED",
            json!({ "device": "other", "path": "/machine/peripheral/other" }),
        );
        // A message split across writes, followed by two messages in one write.
        p.send_raw(br#"{"event": "DEVICE_DELETED", "data": {"device": "gpu0", "#);
        thread::sleep(Duration::from_millis(30));
        p.send_raw(
            b"\"path\": \"/machine/peripheral/gpu0\"}, \"timestamp\": {\"seconds\": 1, \"microseconds\": 2}}\r\n\
              {\"event\": \"X\"}\r\n{\"event\": \"Y\"}\r\n",
        );
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    let ev = qmp.device_del("gpu0", T).expect("device_del");
    assert_eq!(ev.data["path"], "/machine/peripheral/gpu0");
    fake.join();
    // Everything that was read before the match stays buffered; the trailing
    // X and Y were read in the same chunk but not parsed yet.
    let names: Vec<_> = qmp.take_events().into_iter().map(|e| e.event).collect();
    assert_eq!(names, ["DEVICE_DELETED", "DEVICE_DELETED"]);
    assert_eq!(qmp.wait_event("Y", T).expect("Y").event, "Y");
    assert_eq!(qmp.take_events()[0].event, "X");
}

#[test]
fn device_del_without_guest_cooperation_times_out() {
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let fake = fake_qmp(move |mut p| {
        p.handshake();
        let cmd = p.expect_cmd("device_del", Some(json!({ "id": "gpu0" })));
        p.reply(&cmd, json!({}));
        done_rx.recv().expect("done");
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    let err = qmp
        .device_del("gpu0", Duration::from_millis(150))
        .expect_err("no DEVICE_DELETED");
    assert!(
        matches!(&err, QemuError::Timeout { waiting_for, .. } if waiting_for == "event DEVICE_DELETED"),
        "{err}"
    );
    done_tx.send(()).expect("done");
    fake.join();
}

#[test]
fn query_pci_finds_devices_behind_root_ports() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        for _ in 0..2 {
            let cmd = p.expect_cmd("query-pci", None);
            p.reply(&cmd, query_pci_reply());
        }
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    let buses = qmp.query_pci().expect("query-pci");
    let all = all_pci_devices(&buses);
    assert_eq!(all.len(), 3);
    let rp = all[1];
    assert_eq!(rp.qdev_id, "rp1");
    assert_eq!(rp.pci_bridge.as_ref().expect("bridge").bus.secondary, 1);
    let dev = qmp
        .find_pci_device(0x494f, 0x0dc8)
        .expect("query-pci")
        .expect("device present");
    assert_eq!((dev.bus, dev.slot, dev.function), (1, 0, 0));
    assert_eq!(dev.qdev_id, "gpu0");
    assert_eq!(dev.class_info.class, 0);
    assert_eq!(dev.id.subsystem_vendor, Some(0x494f));
    assert_eq!(dev.regions[0].address, -1);
    assert_eq!(dev.regions[0].kind, "io");
    fake.join();
}

fn query_pci_reply() -> Value {
    json!([{
        "bus": 0,
        "devices": [
            {
                "bus": 0, "slot": 0, "function": 0,
                "class_info": { "desc": "Host bridge", "class": 1536 },
                "id": { "device": 10688, "vendor": 32902, "subsystem": 4352, "subsystem-vendor": 6900 },
                "qdev_id": "",
                "regions": []
            },
            {
                "bus": 0, "slot": 1, "function": 0,
                "class_info": { "desc": "PCI bridge", "class": 1540 },
                "id": { "device": 12, "vendor": 6966 },
                "irq_pin": 1, "irq": 10,
                "qdev_id": "rp1",
                "pci_bridge": {
                    "bus": {
                        "number": 0, "secondary": 1, "subordinate": 1,
                        "io_range": { "base": 4096, "limit": 8191 },
                        "memory_range": { "base": 4261412864_u64, "limit": 4262461439_u64 },
                        "prefetchable_range": { "base": 0, "limit": 0 }
                    },
                    "devices": [{
                        "bus": 1, "slot": 0, "function": 0,
                        "class_info": { "class": 0 },
                        "id": { "device": 3528, "vendor": 18767, "subsystem": 0, "subsystem-vendor": 18767 },
                        "qdev_id": "gpu0",
                        "regions": [{ "bar": 2, "type": "io", "address": -1, "size": 256 }]
                    }]
                },
                "regions": [{ "bar": 0, "type": "memory", "address": 4263510016_u64, "size": 4096,
                              "prefetch": false, "mem_type_64": false }]
            }
        ]
    }])
}

#[test]
fn quit_tolerates_the_connection_closing() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("quit", None);
        p.reply(&cmd, json!({}));
        p.event(
            "SHUTDOWN",
            json!({ "guest": false, "reason": "host-qmp-quit" }),
        );
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    qmp.quit().expect("quit");
    fake.join();

    // QEMU exiting before the reply is flushed also counts as success.
    let fake = fake_qmp(|mut p| {
        p.handshake();
        p.expect_cmd("quit", None);
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    qmp.quit().expect("quit without reply");
    fake.join();
}

#[test]
fn system_powerdown_then_shutdown_event() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("system_powerdown", None);
        p.reply(&cmd, json!({}));
        p.event("POWERDOWN", Value::Null);
        thread::sleep(Duration::from_millis(20));
        p.event(
            "SHUTDOWN",
            json!({ "guest": true, "reason": "guest-shutdown" }),
        );
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    qmp.system_powerdown().expect("system_powerdown");
    let ev = qmp.wait_event("SHUTDOWN", T).expect("SHUTDOWN");
    assert_eq!(ev.data["reason"], "guest-shutdown");
    assert_eq!(qmp.take_events()[0].event, "POWERDOWN");
    fake.join();
}

#[test]
fn closed_connection_and_malformed_lines_are_errors() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        p.expect_cmd("query-status", None);
        p.send_raw(b"{not json\r\n");
        p.expect_cmd("query-status", None);
        // Drop: EOF.
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    let err = qmp.query_status().expect_err("malformed");
    assert!(matches!(err, QemuError::MalformedMessage(_)), "{err}");
    let err = qmp.query_status().expect_err("closed");
    assert!(matches!(err, QemuError::Closed), "{err}");
    fake.join();
}

#[test]
fn unexpected_reply_shape_is_typed() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("query-status", None);
        p.reply(&cmd, json!([1, 2]));
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    let err = qmp.query_status().expect_err("wrong shape");
    assert!(
        matches!(&err, QemuError::UnexpectedReply { command, .. } if command == "query-status"),
        "{err}"
    );
    assert!(std::error::Error::source(&err).is_some());
    fake.join();
}

#[test]
fn peripheral_ids_lists_child_objects() {
    let fake = fake_qmp(|mut p| {
        p.handshake();
        let cmd = p.expect_cmd("qom-list", Some(json!({ "path": "/machine/peripheral" })));
        p.reply(
            &cmd,
            json!([
                { "name": "type", "type": "string" },
                { "name": "rp1", "type": "child<pcie-root-port>" },
                { "name": "gpu0", "type": "child<vfio-user-pci>" }
            ]),
        );
    });
    let mut qmp = Qmp::connect(&fake.path, T).expect("connect");
    assert_eq!(qmp.peripheral_ids().expect("qom-list"), ["gpu0", "rp1"]);
    fake.join();
}
