//! The roles of the control socket's users (issue 34): root (and the daemon's own user) acts
//! on everything; a member of `--socket-group` reads everything, creates endpoints and acts
//! only on its own, registers only its own VMM, and cannot lock root out of the control socket
//! (connections and events streams per user, a reserve for root).
//!
//! A member is uid nobody with group `daemon` (every Debian system has it): requests come from
//! threads of this test that dropped to that user (the kernel's credentials are per thread, and
//! `SO_PEERCRED` names the thread that connected), `ctl` from a copy of the binary nobody can
//! run. So these tests need root: `#[ignore = "needs root"]`, run by name by
//! `scripts/run-root-tests.sh`.
#![forbid(unsafe_code)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::daemon::{Daemon, api_status, connect, socket_of};
use common::nobody::{NOBODY, NobodysExe, gid_of};
use serde_json::{Value, json};
use switchyard_control::{ControlClient, ControlError};

/// The socket group.
const GROUP: &str = "daemon";

/// A daemon whose sockets are group `daemon`'s, reachable by nobody; and the group's gid.
/// Panics without root or the group (never skips: a skipped test would read as passing).
fn group_daemon() -> (Daemon, u32) {
    assert!(
        rustix::process::geteuid().is_root(),
        "needs root (a member of the socket group is another user)"
    );
    let gid = gid_of(GROUP).unwrap_or_else(|| panic!("no group `{GROUP}` in /etc/group"));
    let mut d = Daemon::new().with_args(&["--socket-group", GROUP, "--faults"]);
    // The test's private directory is root's 0700: nobody could not pass through it.
    std::fs::set_permissions(d.dir(), PermissionsExt::from_mode(0o755)).expect("chmod");
    d.launch();
    (d, gid)
}

/// Runs `f` on a thread of this process whose credentials are nobody's, group `gid` (no
/// other group): what it connects to sees a member of the socket group.
fn as_member<T: Send + 'static>(gid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    use rustix::process::{Gid, Uid};
    use rustix::thread::{set_thread_groups, set_thread_res_gid, set_thread_res_uid};
    std::thread::spawn(move || {
        set_thread_groups(&[]).expect("setgroups");
        let g = Gid::from_raw(gid);
        set_thread_res_gid(g, g, g).expect("setresgid");
        let u = Uid::from_raw(NOBODY);
        set_thread_res_uid(u, u, u).expect("setresuid");
        f()
    })
    .join()
    .expect("the member's thread")
}

/// A request as the member: the reply's status and JSON body (an error's too).
fn member(gid: u32, d: &Daemon, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let client = ControlClient::connect(d.socket()).expect("connect");
    let (method, path) = (method.to_owned(), path.to_owned());
    as_member(gid, move || {
        let reply = match (method.as_str(), body) {
            ("GET", _) => client.get(&path),
            ("DELETE", _) => client.delete(&path),
            ("PUT", Some(b)) => client.put(&path, &b),
            ("POST", b) => client.post(&path, &b.unwrap_or(json!({}))),
            other => panic!("{other:?}"),
        };
        match reply {
            Ok(r) => (r.status, r.body),
            Err(ControlError::Api {
                status,
                code,
                message,
            }) => (status, json!({"code": code, "message": message})),
            Err(e) => panic!("{e}"),
        }
    })
}

/// `(status, body)` is a 403 `forbidden` whose message contains `says`.
fn assert_forbidden(what: &str, (status, body): (u16, Value), says: &str) {
    assert_eq!(status, 403, "{what}: {body}");
    assert_eq!(body["code"], "forbidden", "{what}: {body}");
    let message = body["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{what}: {message}");
}

/// The member creates endpoint `id` in pool `default` (201): the reply's body.
fn member_creates(gid: u32, d: &Daemon, id: &str) -> Value {
    let (status, body) = member(
        gid,
        d,
        "POST",
        "/v1/endpoints",
        Some(json!({"id": id, "pool": "default"})),
    );
    assert_eq!(status, 201, "{body}");
    body
}

/// A member reads every endpoint and board, creates endpoints (its own), acts on its own, and
/// is refused (403, nothing done) every operation on root's endpoint and every board operation.
#[test]
#[ignore = "needs root"]
fn a_member_acts_on_its_own_endpoints_and_reads_every_one() {
    let (mut d, gid) = group_daemon();
    d.ctl_ok(&["create", "rootvm", "--pool", "default"]);
    let before = d.endpoint("rootvm");
    assert_eq!(before["endpoint"]["owner_uid"], 0);

    let mine = member_creates(gid, &d, "mine");
    assert_eq!(mine["endpoint"]["owner_uid"], NOBODY);

    // Reads of everything.
    let (status, theirs) = member(gid, &d, "GET", "/v1/endpoints/rootvm", None);
    assert_eq!((status, &theirs["endpoint"]["owner_uid"]), (200, &json!(0)));
    let (status, all) = member(gid, &d, "GET", "/v1/endpoints", None);
    assert_eq!((status, all.as_array().map(Vec::len)), (200, Some(2)));
    // ... but another's migration token (a capability): only its owner and root read it.
    assert!(
        before["endpoint"]["migration_token"].is_string(),
        "{before}"
    );
    assert!(mine["endpoint"]["migration_token"].is_string(), "{mine}");
    assert!(
        theirs["endpoint"].get("migration_token").is_none(),
        "{theirs}"
    );
    for e in all.as_array().expect("a list") {
        let own = e["endpoint"]["owner_uid"] == NOBODY;
        assert_eq!(e["endpoint"].get("migration_token").is_some(), own, "{e}");
    }
    let (_, synced) = member(gid, &d, "POST", "/v1/endpoints/rootvm/sync", None);
    assert!(
        synced["endpoint"].get("migration_token").is_none(),
        "{synced}"
    );
    assert_eq!(member(gid, &d, "GET", "/v1/boards", None).0, 200);

    // Nothing on root's endpoint.
    let says =
        "Endpoint \"rootvm\" belongs to user 0: user 65534 may act only on its own endpoints";
    for (method, path, body) in [
        ("DELETE", "/v1/endpoints/rootvm", None),
        ("POST", "/v1/endpoints/rootvm/detach", None),
        ("POST", "/v1/endpoints/rootvm/attach", Some(json!({}))),
        ("POST", "/v1/endpoints/rootvm/restart", None),
        ("POST", "/v1/endpoints/rootvm/upgrade", None),
        (
            "POST",
            "/v1/endpoints/rootvm/move",
            Some(json!({"to": "gpu1"})),
        ),
        (
            "PUT",
            "/v1/endpoints/rootvm/vmm",
            Some(json!({"qmp": "/tmp/qmp.sock", "device_id": "gpu0"})),
        ),
        ("DELETE", "/v1/endpoints/rootvm/vmm", None),
        (
            "POST",
            "/v1/endpoints/rootvm/incoming",
            Some(json!({"id": "stolen"})),
        ),
    ] {
        let what = format!("{method} {path}");
        assert_forbidden(&what, member(gid, &d, method, path, body), says);
    }
    // Nor on any board.
    let says = "Only root or the daemon's own user may";
    for (path, body) in [
        ("/v1/boards/gpu0/quarantine", None),
        ("/v1/boards/gpu0/unquarantine", None),
        ("/v1/boards/gpu1/drain", None),
        ("/v1/boards/gpu0/fault", Some(json!({"kind": "engine"}))),
    ] {
        assert_forbidden(path, member(gid, &d, "POST", path, body), says);
    }
    // Nothing was done: root's endpoint has its device and the same worker, the boards take
    // leases, no endpoint "stolen".
    let after = d.endpoint("rootvm");
    assert_eq!(after["endpoint"], before["endpoint"]);
    assert_eq!(after["worker"]["pid"], before["worker"]["pid"]);
    assert_eq!(after["worker"]["state"], "running");
    let boards = d.client().get("/v1/boards").expect("boards").body;
    for b in boards.as_array().expect("boards") {
        assert_eq!(b["state"], "available", "{b}");
    }
    let (status, _) = member(gid, &d, "GET", "/v1/endpoints/stolen", None);
    assert_eq!(status, 404);

    // Its own endpoint: every operation.
    let (status, r) = member(gid, &d, "POST", "/v1/endpoints/mine/restart", None);
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["replaced_pid"], mine["worker"]["pid"]);
    let (status, r) = member(gid, &d, "POST", "/v1/endpoints/mine/detach", None);
    assert_eq!(
        (status, &r["endpoint"]["device"]),
        (200, &Value::Null),
        "{r}"
    );
    let (status, r) = member(
        gid,
        &d,
        "POST",
        "/v1/endpoints/mine/attach",
        Some(json!({})),
    );
    assert_eq!(
        (status, &r["worker"]["state"]),
        (200, &json!("running")),
        "{r}"
    );

    // `ctl` as the member: the owner is shown, a refusal says why.
    let exe = NobodysExe::new();
    let (ok, out, err) = exe.ctl(&d.socket(), gid, &["endpoint", "mine"]);
    assert!(ok, "{err}");
    assert!(out.contains("owner:        uid 65534 (nobody)"), "{out}");
    let (ok, _, err) = exe.ctl(&d.socket(), gid, &["delete", "rootvm"]);
    assert!(
        !ok && err.contains("belongs to user 0") && err.contains("forbidden"),
        "{err}"
    );
    let (ok, _, err) = exe.ctl(&d.socket(), gid, &["delete", "mine"]);
    assert!(ok, "{err}");
    assert_eq!(
        d.client()
            .get("/v1/endpoints")
            .expect("list")
            .body
            .as_array()
            .map(Vec::len),
        Some(1)
    );
}

/// Root acts on every endpoint, a member's too, and on the boards; `ctl endpoint` shows whose
/// an endpoint is.
#[test]
#[ignore = "needs root"]
fn root_acts_on_every_endpoint_and_board() {
    let (d, gid) = group_daemon();
    let theirs = member_creates(gid, &d, "theirs");
    let out = d.ctl_ok(&["endpoint", "theirs"]);
    assert!(out.contains("owner:        uid 65534 (nobody)"), "{out}");

    let api = d.client();
    let r = api
        .post("/v1/endpoints/theirs/restart", &())
        .expect("restart")
        .body;
    assert_eq!(r["replaced_pid"], theirs["worker"]["pid"]);
    let board = theirs["lease"]["board"].as_str().expect("board").to_owned();
    let q = api
        .post(&format!("/v1/boards/{board}/quarantine"), &())
        .expect("quarantine")
        .body;
    assert_eq!(q["state"], "quarantined");
    let q = api
        .post(&format!("/v1/boards/{board}/unquarantine"), &())
        .expect("unquarantine")
        .body;
    assert_eq!(q["state"], "available");
    let r = api
        .post("/v1/endpoints/theirs/detach", &())
        .expect("detach")
        .body;
    assert!(r["endpoint"]["device"].is_null(), "{r}");
    api.delete("/v1/endpoints/theirs").expect("delete");
    assert_eq!(
        api_status(api.get("/v1/endpoints/theirs")),
        (404, "not_found".to_owned())
    );
}

/// A fake QMP server on a listener: greets, answers `qmp_capabilities`, refuses every other
/// command with an error; records what happened (`connected`, each command, `closed` when
/// the client is gone).
fn fake_qmp(listener: UnixListener) -> Arc<Mutex<Vec<String>>> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let seen = got.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            seen.lock().expect("lock").push("connected".to_owned());
            let greeting = json!({"QMP": {"version": {"qemu": {"major": 11, "minor": 1,
                "micro": 0}, "package": "fake"}, "capabilities": []}});
            let _ = writeln!(conn, "{greeting}");
            let reader = BufReader::new(conn.try_clone().expect("clone"));
            for line in reader.lines() {
                let Ok(Ok(req)) = line.map(|l| serde_json::from_str::<Value>(&l)) else {
                    break;
                };
                let command = req["execute"].as_str().unwrap_or_default().to_owned();
                seen.lock().expect("lock").push(command.clone());
                let reply = if command == "qmp_capabilities" {
                    json!({"return": {}, "id": req["id"]})
                } else {
                    json!({"error": {"class": "GenericError", "desc": "refused by the fake"},
                           "id": req["id"]})
                };
                let _ = writeln!(conn, "{reply}");
            }
            seen.lock().expect("lock").push("closed".to_owned());
        }
    });
    got
}

/// What `got` recorded once the client it had is gone.
fn once_closed(got: &Arc<Mutex<Vec<String>>>) -> Vec<String> {
    common::wait_for(Duration::from_secs(10), || {
        let got = got.lock().expect("lock");
        got.iter().any(|e| e == "closed").then(|| got.clone())
    })
    .expect("the daemon's QMP connection never closed")
}

/// A member registers only a QMP socket of its own, and the daemon speaks only to a VMM that
/// runs as that member: a root-owned socket, a link to one, and a socket of the member's name
/// that root serves (a swap after registration) are refused (403) with nothing sent; the
/// member's own VMM is spoken to.
#[test]
#[ignore = "needs root"]
fn a_member_registers_only_its_own_vmm() {
    let (d, gid) = group_daemon();
    let mine = member_creates(gid, &d, "mine");
    let dir = d.dir().join("vmms");
    std::fs::create_dir(&dir).expect("mkdir");
    rustix::fs::chown(
        &dir,
        Some(rustix::fs::Uid::from_raw(NOBODY)),
        Some(rustix::fs::Gid::from_raw(gid)),
    )
    .expect("chown");
    let register = |qmp: &Path| {
        member(
            gid,
            &d,
            "PUT",
            "/v1/endpoints/mine/vmm",
            Some(json!({"qmp": qmp, "device_id": "gpu-dev0"})),
        )
    };

    // Root's VMM (another VM's), and a link of the member's to it.
    let victim = d.dir().join("victim-qmp.sock");
    let victim_got = fake_qmp(UnixListener::bind(&victim).expect("bind"));
    assert_forbidden(
        "root's QMP socket",
        register(&victim),
        "belongs to user 0, not to user 65534",
    );
    let link = dir.join("link.sock");
    let (target, at) = (victim.clone(), link.clone());
    as_member(gid, move || {
        std::os::unix::fs::symlink(target, at).expect("symlink")
    });
    assert_forbidden(
        "a link",
        register(&link),
        "is not a socket (a symbolic link is not followed)",
    );

    // The member's own VMM (a listener made by a thread of the member's) is registered and
    // spoken to: a detach under a connected guest asks it to unplug (the fake refuses: 502).
    let own = dir.join("own-qmp.sock");
    let at = own.clone();
    let own_got = fake_qmp(as_member(gid, move || {
        UnixListener::bind(at).expect("bind")
    }));
    let (status, r) = register(&own);
    assert_eq!(status, 200, "{r}");
    let guest = connect(&socket_of(&mine));
    let connected = common::wait_for(Duration::from_secs(10), || {
        let api = d.client();
        api.get("/v1/endpoints/mine").expect("mine").body["worker"]["connected"]
            .as_bool()
            .filter(|c| *c)
    });
    assert!(connected.is_some(), "the guest's connection is not seen");
    let (status, r) = member(gid, &d, "POST", "/v1/endpoints/mine/detach", None);
    assert_eq!((status, r["code"].as_str()), (502, Some("vmm")), "{r}");
    assert_eq!(
        once_closed(&own_got),
        ["connected", "qmp_capabilities", "device_del", "closed"]
    );

    // A socket of the member's name served by root (the path swapped after registration):
    // registered (its owner is the member), but the daemon sends the VMM nothing.
    let swapped = dir.join("swapped-qmp.sock");
    let swapped_got = fake_qmp(UnixListener::bind(&swapped).expect("bind"));
    rustix::fs::chownat(
        rustix::fs::CWD,
        &swapped,
        Some(rustix::fs::Uid::from_raw(NOBODY)),
        None,
        rustix::fs::AtFlags::SYMLINK_NOFOLLOW,
    )
    .expect("chown");
    let (status, r) = register(&swapped);
    assert_eq!(status, 200, "{r}");
    assert_forbidden(
        "a VMM served by root",
        member(gid, &d, "POST", "/v1/endpoints/mine/detach", None),
        "runs as user 0, not as user 65534, who registered it; nothing was sent to it",
    );
    // It was connected to (its greeting never read) and sent no command.
    assert_eq!(once_closed(&swapped_got), ["connected", "closed"]);
    assert!(victim_got.lock().expect("lock").is_empty());
    let still = d.client().get("/v1/endpoints/mine").expect("mine").body;
    assert!(still["endpoint"]["device"].is_string(), "{still}");
    drop(guest);

    // Root may register any VMM, even one not there yet.
    let r = d
        .client()
        .put(
            "/v1/endpoints/mine/vmm",
            &json!({"qmp": d.dir().join("later.sock"), "device_id": "gpu-dev0"}),
        )
        .expect("root registers");
    assert_eq!(r.status, 200);
}

/// A raw HTTP request on a new connection (made by whoever runs this): the reply's head, read
/// up to its blank line, with the connection (the rest unread).
fn open(socket: &Path, request: &str) -> (String, UnixStream) {
    let mut s = UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    // A refused connection may be closed before the request is written.
    let _ = s.write_all(request.as_bytes());
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        match s.read(&mut byte) {
            Ok(1) => head.push(byte[0]),
            _ => break,
        }
    }
    (String::from_utf8_lossy(&head).into_owned(), s)
}

/// The rest of a reply (a refusal's body): to the end of the connection.
fn rest(s: &mut UnixStream) -> String {
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body
}

/// The lock-out: a member opens events streams and then slow-body requests (a body that does
/// not come; its request in progress once the server asked for it: `100 Continue`) for as
/// long as the daemon lets it. It gets its share (8 streams, 16 connections), each refusal
/// naming the limit, and root is still served.
#[test]
#[ignore = "needs root"]
fn root_is_served_while_a_member_holds_every_connection_it_may() {
    let (d, gid) = group_daemon();
    let socket = d.socket();
    let (held, stream_refusal, connection_refusal) = as_member(gid, move || {
        let mut held = Vec::new();
        let mut stream_refusal = None;
        for _ in 0..64 {
            let (head, mut s) = open(
                &socket,
                "GET /events?follow=true HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
            );
            if !head.starts_with("HTTP/1.1 200") {
                stream_refusal = Some(format!("{head}{}", rest(&mut s)));
                break;
            }
            held.push(s);
        }
        let mut connection_refusal = None;
        for _ in held.len()..64 {
            let (head, mut s) = open(
                &socket,
                "POST /v1/endpoints HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: 100\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
            );
            if !head.starts_with("HTTP/1.1 100") {
                connection_refusal = Some(format!("{head}{}", rest(&mut s)));
                break;
            }
            held.push(s);
        }
        (held, stream_refusal, connection_refusal)
    });

    // Root is served, by the API and by ctl.
    let boards = d.client().get("/v1/boards");
    assert!(
        boards.is_ok(),
        "root was refused while the member held {} connections: {boards:?}",
        held.len()
    );
    let out = d.ctl(&["boards"]);
    assert!(out.status.success(), "{out:?}");

    let streams = stream_refusal.expect("the member's streams were never refused");
    assert!(streams.starts_with("HTTP/1.1 503"), "{streams}");
    assert!(
        streams.contains(r#""code":"too_many_streams""#),
        "{streams}"
    );
    assert!(
        streams.contains("User 65534 has 8 streams open, the most one user may"),
        "{streams}"
    );
    let connections = connection_refusal.expect("the member's connections were never refused");
    assert!(connections.starts_with("HTTP/1.1 503"), "{connections}");
    assert!(
        connections.contains(r#""code":"too_many_connections""#),
        "{connections}"
    );
    assert!(
        connections.contains("User 65534 has 16 control connections busy"),
        "{connections}"
    );
    assert_eq!(held.len(), 16, "8 streams and 8 slow bodies");
}

/// An incoming endpoint from a source's description (`POST /v1/incoming`) is admitted as a
/// creation is: a member may make one, its own; a description as the member sees another's
/// endpoint (no token) is refused and leases nothing; with the token its owner gave, it is
/// made.
#[test]
#[ignore = "needs root"]
fn a_member_makes_an_incoming_endpoint_from_a_description_as_it_creates_one() {
    let (mut d, gid) = group_daemon();
    d.ctl_ok(&["create", "rootvm", "--pool", "default"]);
    let (status, seen) = member(gid, &d, "GET", "/v1/endpoints/rootvm", None);
    assert_eq!(status, 200);
    assert!(seen["endpoint"].get("migration_token").is_none(), "{seen}");
    let (status, body) = member(
        gid,
        &d,
        "POST",
        "/v1/incoming",
        Some(json!({"id": "in", "source": seen})),
    );
    assert_eq!((status, &body["code"]), (422, &json!("invalid")), "{body}");
    let (_, all) = member(gid, &d, "GET", "/v1/endpoints", None);
    assert_eq!(
        all.as_array().map(Vec::len),
        Some(1),
        "nothing leased: {all}"
    );
    // The owner's description, token included.
    let described = d.endpoint("rootvm");
    let (status, made) = member(
        gid,
        &d,
        "POST",
        "/v1/incoming",
        Some(json!({"id": "in", "source": described})),
    );
    assert_eq!(status, 201, "{made}");
    assert_eq!(made["endpoint"]["owner_uid"], NOBODY, "{made}");
    assert_eq!(made["incoming_for"], "rootvm", "{made}");
}
