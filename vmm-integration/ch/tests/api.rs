//! `ChApi` tests against a fake cloud-hypervisor API socket (a thread that
//! speaks HTTP/1.1 on a unix socket in a tempdir).
#![forbid(unsafe_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::mpsc;
use std::thread::{self, JoinHandle};
use std::time::Duration;

use serde_json::{Value, json};
use switchyard_ch::{ChApi, ChError, Method, PciDeviceInfo, UserDeviceConfig};
use tempfile::TempDir;

/// One request as the fake server received it.
#[derive(Debug)]
struct Recorded {
    /// Everything up to and including the blank line.
    head: String,
    method: String,
    path: String,
    body: Vec<u8>,
}

impl Recorded {
    fn header(&self, name: &str) -> Option<&str> {
        self.head.lines().skip(1).find_map(|l| {
            let (n, v) = l.split_once(':')?;
            n.eq_ignore_ascii_case(name).then(|| v.trim())
        })
    }

    fn json_body(&self) -> Value {
        serde_json::from_slice(&self.body).expect("request body is JSON")
    }
}

fn read_request(stream: &UnixStream) -> Recorded {
    let mut r = BufReader::new(stream);
    let mut head = String::new();
    loop {
        let mut line = String::new();
        let n = r.read_line(&mut line).expect("read request line");
        assert!(n > 0, "client closed before the end of the head");
        head.push_str(&line);
        if line == "\r\n" {
            break;
        }
    }
    let first = head.lines().next().expect("request line").to_owned();
    let mut parts = first.split(' ');
    let method = parts.next().expect("method").to_owned();
    let path = parts.next().expect("path").to_owned();
    assert_eq!(parts.next(), Some("HTTP/1.1"));
    let mut rec = Recorded {
        head,
        method,
        path,
        body: Vec::new(),
    };
    if let Some(len) = rec.header("content-length") {
        let len: usize = len.parse().expect("numeric Content-Length");
        rec.body = vec![0; len];
        r.read_exact(&mut rec.body).expect("read body");
    }
    rec
}

struct Fake {
    _dir: TempDir,
    path: PathBuf,
    handle: JoinHandle<Vec<Recorded>>,
}

impl Fake {
    fn api(&self) -> ChApi {
        ChApi::new(&self.path).with_timeout(Duration::from_secs(5))
    }

    fn join(self) -> Vec<Recorded> {
        self.handle.join().expect("fake API server panicked")
    }
}

/// Serves one connection per canned response, in order.
fn fake_api(responses: Vec<Vec<u8>>) -> Fake {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("ch-api.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let handle = thread::spawn(move || {
        let mut seen = Vec::new();
        for resp in responses {
            let (mut stream, _) = listener.accept().expect("accept");
            seen.push(read_request(&stream));
            stream.write_all(&resp).expect("write response");
        }
        seen
    });
    Fake {
        _dir: dir,
        path,
        handle,
    }
}

fn json_response(status: &str, body: &Value) -> Vec<u8> {
    let body = body.to_string();
    format!(
        "HTTP/1.1 {status}\r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

fn no_content() -> Vec<u8> {
    b"HTTP/1.1 204 No Content\r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n\r\n"
        .to_vec()
}

#[test]
fn ping_sends_exact_request_and_parses_reply() {
    let fake = fake_api(vec![json_response(
        "200 OK",
        &json!({
            "build_version": "v48.0-12-gae44c297",
            "version": "48.0.0",
            "pid": 4242,
            "features": ["kvm", "io_uring"]
        }),
    )]);
    let ping = fake.api().ping().expect("ping");
    assert_eq!(ping.version, "48.0.0");
    assert_eq!(ping.build_version, "v48.0-12-gae44c297");
    assert_eq!(ping.pid, 4242);
    assert_eq!(ping.features, ["kvm", "io_uring"]);
    let seen = fake.join();
    assert_eq!(
        seen[0].head,
        "GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n"
    );
    assert!(seen[0].body.is_empty());
}

#[test]
fn vm_info_reply() {
    // As cloud-hypervisor's API server (micro_http) sends it: Content-Length framing.
    let body = json!({
        "config": { "cpus": { "boot_vcpus": 1 }, "memory": { "size": 536870912, "shared": true } },
        "state": "Running",
        "memory_actual_size": 536870912,
        "device_tree": {}
    })
    .to_string();
    let resp = format!(
        "HTTP/1.1 200 OK\r\nServer: Cloud Hypervisor API\r\nConnection: keep-alive\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let fake = fake_api(vec![resp.into_bytes()]);
    let info = fake.api().vm_info().expect("vm.info");
    assert_eq!(info.state, "Running");
    assert_eq!(info.memory_actual_size, Some(536_870_912));
    assert_eq!(info.config["memory"]["shared"], true);
    let seen = fake.join();
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("GET", "/api/v1/vm.info")
    );
}

#[test]
fn add_user_device_sends_config_and_parses_bdf() {
    let fake = fake_api(vec![
        json_response("200 OK", &json!({ "id": "gpu0", "bdf": "0000:00:05.0" })),
        json_response(
            "200 OK",
            &json!({ "id": "_user_device0", "bdf": "0001:00:01.0" }),
        ),
    ]);
    let api = fake.api();
    let info = api
        .add_user_device(&UserDeviceConfig::new("/tmp/gpu0.sock").id("gpu0"))
        .expect("add-user-device");
    assert_eq!(
        info,
        PciDeviceInfo {
            id: "gpu0".into(),
            bdf: "0000:00:05.0".into()
        }
    );
    let info = api
        .add_user_device(&UserDeviceConfig {
            socket: "/tmp/gpu1.sock".into(),
            id: None,
            pci_segment: Some(1),
            pci_device_id: None,
        })
        .expect("add-user-device");
    assert_eq!(info.bdf, "0001:00:01.0");

    let seen = fake.join();
    let body0 = r#"{"socket":"/tmp/gpu0.sock","id":"gpu0"}"#;
    assert_eq!(
        seen[0].head,
        format!(
            "PUT /api/v1/vm.add-user-device HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body0.len()
        )
    );
    assert_eq!(seen[0].body, body0.as_bytes());
    assert_eq!(
        (seen[1].method.as_str(), seen[1].path.as_str()),
        ("PUT", "/api/v1/vm.add-user-device")
    );
    assert_eq!(
        seen[1].json_body(),
        json!({ "socket": "/tmp/gpu1.sock", "pci_segment": 1 })
    );
}

#[test]
fn remove_device_gets_no_content() {
    let fake = fake_api(vec![no_content()]);
    fake.api().remove_device("gpu0").expect("remove-device");
    let seen = fake.join();
    assert_eq!(
        (seen[0].method.as_str(), seen[0].path.as_str()),
        ("PUT", "/api/v1/vm.remove-device")
    );
    assert_eq!(seen[0].body, br#"{"id":"gpu0"}"#);
    assert_eq!(seen[0].header("Content-Type"), Some("application/json"));
}

#[test]
fn error_status_is_typed_with_code_and_body() {
    let msg = "Error from API: The VM could not be found: VM not created";
    let fake = fake_api(vec![
        format!(
            "HTTP/1.1 500 Internal Server Error\r\nServer: Cloud Hypervisor API\r\n\
             Content-Length: {}\r\n\r\n{msg}",
            msg.len()
        )
        .into_bytes(),
        b"HTTP/1.1 404 Not Found\r\n\r\n".to_vec(),
    ]);
    let api = fake.api();
    let err = api.vm_info().expect_err("500");
    match &err {
        ChError::Status {
            method,
            endpoint,
            status,
            body,
        } => {
            assert_eq!(
                (*method, endpoint.as_str(), *status),
                ("GET", "/api/v1/vm.info", 500)
            );
            assert_eq!(
                body,
                "Error from API: The VM could not be found: VM not created"
            );
        }
        other => panic!("unexpected error {other}"),
    }
    assert_eq!(
        err.to_string(),
        "Request GET /api/v1/vm.info failed with HTTP status 500: \
         Error from API: The VM could not be found: VM not created"
    );
    let err = api.remove_device("nope").expect_err("404");
    assert!(matches!(err, ChError::Status { status: 404, .. }), "{err}");
    fake.join();
}

#[test]
fn bodyless_actions_send_put_without_content_headers() {
    let endpoints = [
        "vm.shutdown",
        "vm.delete",
        "vm.boot",
        "vm.reboot",
        "vm.pause",
        "vm.resume",
        "vm.power-button",
        "vmm.shutdown",
    ];
    let fake = fake_api(endpoints.iter().map(|_| no_content()).collect());
    let api = fake.api();
    api.vm_shutdown().expect("shutdown");
    api.vm_delete().expect("delete");
    api.vm_boot().expect("boot");
    api.vm_reboot().expect("reboot");
    api.vm_pause().expect("pause");
    api.vm_resume().expect("resume");
    api.vm_power_button().expect("power-button");
    api.vmm_shutdown().expect("vmm shutdown");
    let seen = fake.join();
    for (rec, ep) in seen.iter().zip(endpoints) {
        assert_eq!(
            rec.head,
            format!("PUT /api/v1/{ep} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n")
        );
    }
}

#[test]
fn generic_request_and_body_until_close() {
    let fake = fake_api(vec![b"HTTP/1.1 200 OK\r\n\r\n{\"counters\":{}}".to_vec()]);
    let resp = fake
        .api()
        .request(Method::Get, "vm.counters", None)
        .expect("counters");
    assert_eq!(resp.status, 200);
    assert_eq!(resp.body, br#"{"counters":{}}"#);
    fake.join();
}

#[test]
fn unexpected_body_is_a_typed_error() {
    let fake = fake_api(vec![no_content()]);
    let err = fake
        .api()
        .add_user_device(&UserDeviceConfig::new("/tmp/x.sock"))
        .expect_err("204 has no PciDeviceInfo");
    assert!(
        matches!(&err, ChError::Deserialize { endpoint, .. } if endpoint == "/api/v1/vm.add-user-device"),
        "{err}"
    );
    fake.join();
}

#[test]
fn malformed_response_is_a_typed_error() {
    let fake = fake_api(vec![b"SSH-2.0-nope\r\n".to_vec()]);
    let err = fake.api().ping().expect_err("not HTTP");
    assert!(matches!(err, ChError::MalformedResponse { .. }), "{err}");
    fake.join();
}

#[test]
fn silent_server_times_out() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("api.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let (done_tx, done_rx) = mpsc::channel::<()>();
    let handle = thread::spawn(move || {
        let (stream, _) = listener.accept().expect("accept");
        read_request(&stream);
        // Half a status line, then silence.
        (&stream).write_all(b"HTTP/1.1 2").expect("write");
        done_rx.recv().expect("done");
    });
    let err = ChApi::new(&path)
        .with_timeout(Duration::from_millis(200))
        .ping()
        .expect_err("no response");
    assert!(matches!(err, ChError::Timeout { .. }), "{err}");
    assert_eq!(
        err.to_string(),
        "Timed out after 200ms waiting for the response to GET /api/v1/vmm.ping"
    );
    done_tx.send(()).expect("done");
    handle.join().expect("server");
}

#[test]
fn connect_errors_and_wait_ready() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("late.sock");
    let err = ChApi::new(&path).ping().expect_err("no socket");
    assert!(matches!(err, ChError::Connect { .. }), "{err}");
    assert!(std::error::Error::source(&err).is_some());

    let server_path = path.clone();
    let handle = thread::spawn(move || {
        thread::sleep(Duration::from_millis(150));
        let listener = UnixListener::bind(&server_path).expect("bind");
        let (mut stream, _) = listener.accept().expect("accept");
        read_request(&stream);
        stream
            .write_all(&json_response("200 OK", &json!({ "version": "48.0.0" })))
            .expect("write");
    });
    let ping = ChApi::new(&path)
        .wait_ready(Duration::from_secs(5))
        .expect("ready after retries");
    assert_eq!(ping.version, "48.0.0");
    assert!(ping.features.is_empty());
    handle.join().expect("server");
}
