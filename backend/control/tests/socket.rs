//! The control socket's file: its mode, a stale file replaced, a live server or another file
//! refused, removal at shutdown, and shutdown with connections open.
#![forbid(unsafe_code)]

mod common;

use std::fs;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;
use std::time::Duration;

use common::{TestServer, socket_path};
use switchyard_control::{
    ControlApi, ControlError, ControlSocket, Events, SHUTDOWN_GRACE, Sequenced,
};

fn health_router() -> axum::Router {
    ControlApi::new("test", "0").health().build(()).0
}

#[test]
fn socket_is_private() {
    let (_dir, path) = socket_path();
    let _server = TestServer::start(&path, health_router()).expect("bind");
    let meta = fs::symlink_metadata(&path).expect("the socket exists");
    assert!(meta.file_type().is_socket());
    assert_eq!(meta.permissions().mode() & 0o777, 0o600);
    // Nothing is left of the staging directory.
    let entries: Vec<_> = fs::read_dir(path.parent().expect("a parent"))
        .expect("readdir")
        .map(|e| e.expect("entry").file_name())
        .collect();
    assert_eq!(entries, vec![path.file_name().expect("a name").to_owned()]);
}

#[test]
fn stale_socket_is_replaced() {
    let (_dir, path) = socket_path();
    // A crashed daemon's socket: the file stays, nobody accepts.
    drop(UnixListener::bind(&path).expect("bind the stale socket"));
    assert!(fs::symlink_metadata(&path).is_ok());
    let server = TestServer::start(&path, health_router()).expect("the stale socket is replaced");
    let reply = server
        .client()
        .get("/health")
        .expect("the new server answers");
    assert_eq!(reply.body["status"], "ok");
}

#[test]
fn live_server_is_not_replaced() {
    let (_dir, path) = socket_path();
    let server = TestServer::start(&path, health_router()).expect("bind");
    match ControlSocket::bind(&path) {
        Err(ControlError::SocketInUse(p)) => assert_eq!(p, path),
        other => panic!("expected SocketInUse, got {other:?}"),
    }
    // The first server still owns the path and answers.
    server.client().get("/health").expect("still served");
    let (result, _) = server.stop();
    result.expect("clean stop");
    assert!(!path.exists());
}

#[test]
fn other_file_is_not_replaced() {
    let (_dir, path) = socket_path();
    fs::write(&path, b"keep me").expect("write");
    match ControlSocket::bind(&path) {
        Err(ControlError::SocketPathTaken(p)) => assert_eq!(p, path),
        other => panic!("expected SocketPathTaken, got {other:?}"),
    }
    assert_eq!(fs::read(&path).expect("still there"), b"keep me");
}

#[test]
fn path_too_long_is_refused() {
    let (dir, _) = socket_path();
    let path = dir.path().join("s".repeat(120));
    assert!(matches!(
        ControlSocket::bind(&path),
        Err(ControlError::SocketPathTooLong { len, .. }) if len > 107
    ));
}

/// A path that fits AF_UNIX while the staging path next to it does not.
#[test]
fn longest_paths_bind() {
    let (dir, _) = socket_path();
    let base = dir.path().as_os_str().len() + 1;
    let path = dir.path().join("s".repeat(107 - base));
    assert_eq!(path.as_os_str().len(), 107);
    let server = TestServer::start(&path, health_router()).expect("bind");
    server.client().get("/health").expect("served");
}

#[test]
fn shutdown_removes_the_socket() {
    let (_dir, path) = socket_path();
    let server = TestServer::start(&path, health_router()).expect("bind");
    server.client().get("/health").expect("served");
    let (result, took) = server.stop();
    result.expect("clean stop");
    assert!(!path.exists(), "the socket file is left behind");
    assert!(
        took < SHUTDOWN_GRACE,
        "an idle server took {took:?} to stop"
    );
}

/// A socket dropped without serving removes its file too.
#[test]
fn unused_socket_removes_its_file() {
    let (_dir, path) = socket_path();
    let socket = ControlSocket::bind(&path).expect("bind");
    assert!(path.exists());
    drop(socket);
    assert!(!path.exists());
}

/// The path was taken over by another server after ours bound it: ours leaves it alone.
#[test]
fn replaced_socket_is_left_to_its_owner() {
    let (dir, path) = socket_path();
    let socket = ControlSocket::bind(&path).expect("bind");
    fs::rename(&path, dir.path().join("moved")).expect("rename");
    let other = UnixListener::bind(&path).expect("another server binds the path");
    drop(socket);
    assert!(path.exists(), "another server's socket was removed");
    drop(other);
}

#[derive(Debug, Clone, serde::Serialize, utoipa::ToSchema)]
struct Tick {
    seq: u64,
}

impl Sequenced for Tick {
    fn seq(&self) -> u64 {
        self.seq
    }
}

fn events_server() -> (tempfile::TempDir, TestServer, Events<Tick>) {
    let (dir, path) = socket_path();
    let events = Events::new(16, 16);
    let (router, _) = ControlApi::new("test", "0")
        .events::<Tick>()
        .build(events.clone());
    let server = TestServer::start(&path, router).expect("bind");
    (dir, server, events)
}

/// An events stream whose hub is never closed is cut after the grace period; the socket file
/// is gone as soon as shutdown starts.
#[test]
fn shutdown_cuts_a_stream_after_the_grace_period() {
    let (_dir, server, events) = events_server();
    let path = server.path().to_owned();
    let mut stream = server.client().stream("/events").expect("stream");
    events.publish(Tick { seq: 1 }).expect("publish");
    assert_eq!(
        stream.next().expect("a line").expect("readable"),
        r#"{"seq":1}"#
    );
    let reader = std::thread::spawn(move || stream.collect::<Vec<_>>());
    let (result, took) = server.stop();
    result.expect("clean stop");
    assert!(!path.exists());
    assert!(
        took >= SHUTDOWN_GRACE && took < SHUTDOWN_GRACE + Duration::from_secs(2),
        "stop took {took:?}"
    );
    // The cut stream ends with an error (no last chunk), it does not hang.
    let rest = reader.join().expect("reader");
    assert!(
        matches!(rest.as_slice(), [Err(ControlError::Io { .. })]),
        "{rest:?}"
    );
}

/// With the hub closed, an open events stream ends at once and shutdown does not wait.
#[test]
fn closing_the_hub_ends_streams_and_shutdown_is_prompt() {
    let (_dir, server, events) = events_server();
    let mut stream = server.client().stream("/events").expect("stream");
    events.publish(Tick { seq: 1 }).expect("publish");
    events.close();
    assert_eq!(
        stream.next().expect("a line").expect("readable"),
        r#"{"seq":1}"#
    );
    assert!(
        stream.next().is_none(),
        "the stream ends after the last event"
    );
    // A new subscriber is told the daemon is going away.
    match server.client().stream("/events") {
        Err(ControlError::Api {
            status: 503, code, ..
        }) => assert_eq!(code, "shutting_down"),
        other => panic!("expected 503 shutting_down, got {other:?}"),
    }
    let (result, took) = server.stop();
    result.expect("clean stop");
    assert!(took < SHUTDOWN_GRACE, "stop took {took:?}");
}
