//! What one client can hold of the control server, over a real socket: a request body must
//! arrive within the body read timeout (a trickled one is cut with 408 and its connection
//! closed, while other clients are served), an idle connection is closed after the header
//! read timeout, and past the connection cap an idle connection makes room for a new one,
//! or, when every connection has a request in progress, the new one gets 503 at once.
#![forbid(unsafe_code)]

mod common;

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::{TestServer, hold_route, socket_path};
use serde_json::Value;
use switchyard_control::{
    BODY_READ_TIMEOUT, ControlApi, ControlClient, ControlError, HEADER_READ_TIMEOUT, Json, Limits,
    MAX_CONNECTIONS,
};
use tokio::sync::watch;

/// `POST /echo` (a JSON body, returned), `GET /hold` (answers when `release` turns true;
/// counts its calls in `entered`) and `GET /health`.
fn router(entered: Arc<AtomicUsize>, release: watch::Receiver<bool>) -> axum::Router {
    let (router, _doc) = ControlApi::new("limits", "0")
        .health()
        .merge(
            axum::Router::new()
                .route(
                    "/echo",
                    axum::routing::post(|Json(v): Json<Value>| async move { Json(v) }),
                )
                .route("/hold", hold_route(entered, release))
                .into(),
        )
        .build(());
    router
}

fn server(
    limits: Limits,
) -> (
    tempfile::TempDir,
    TestServer,
    Arc<AtomicUsize>,
    watch::Sender<bool>,
) {
    let (dir, path) = socket_path();
    let entered = Arc::new(AtomicUsize::new(0));
    let (release, released) = watch::channel(false);
    let server = TestServer::start_with_limits(&path, router(entered.clone(), released), limits)
        .expect("start");
    (dir, server, entered, release)
}

/// Reads until the peer closes (or `limit` passes): what came, and whether it closed.
fn read_to_close(s: &mut UnixStream, limit: Duration) -> (String, bool) {
    s.set_read_timeout(Some(limit)).expect("timeout");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return (String::from_utf8_lossy(&out).into_owned(), true),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return (String::from_utf8_lossy(&out).into_owned(), false);
            }
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {
                return (String::from_utf8_lossy(&out).into_owned(), true);
            }
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// A client (its constructor's probe connection made now, and closed).
fn client(path: &Path) -> ControlClient {
    let client = ControlClient::connect(path).expect("connect");
    thread::sleep(Duration::from_millis(50));
    client
}

/// `GET /health` (one new connection) answers 200, quickly.
fn health_answers(client: &ControlClient) {
    let start = Instant::now();
    let reply = client.get("/health").expect("health");
    assert_eq!(reply.status, 200);
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn the_defaults_are_the_documented_limits() {
    let l = Limits::default();
    assert_eq!(l.header_read_timeout, HEADER_READ_TIMEOUT);
    assert_eq!(l.body_read_timeout, BODY_READ_TIMEOUT);
    assert_eq!(l.max_connections, MAX_CONNECTIONS);
    assert!(BODY_READ_TIMEOUT <= Duration::from_secs(10));
    assert!(HEADER_READ_TIMEOUT <= Duration::from_secs(10));
}

#[test]
fn a_trickled_body_is_cut_at_the_timeout_while_others_are_served() {
    let timeout = Duration::from_secs(1);
    let (_dir, server, _, _release) = server(Limits {
        body_read_timeout: timeout,
        ..Limits::default()
    });
    let path = server.path().to_owned();
    let health = client(&path);

    // Positive control: a body sent in pieces, all there before the deadline, is read.
    let mut s = UnixStream::connect(&path).expect("connect");
    let body = br#"{"a":[1,2,3]}"#;
    write!(
        s,
        "POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
    .expect("head");
    for b in body {
        s.write_all(&[*b]).expect("byte");
        thread::sleep(Duration::from_millis(20));
    }
    let (reply, closed) = read_to_close(&mut s, Duration::from_secs(5));
    assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
    assert!(reply.ends_with(r#"{"a":[1,2,3]}"#), "{reply}");
    assert!(closed);

    // One byte per 300 ms of a 100-byte body: cut at the deadline.
    let mut s = UnixStream::connect(&path).expect("connect");
    s.write_all(
        b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
          Content-Length: 100\r\n\r\n[",
    )
    .expect("head");
    let start = Instant::now();
    let trickling = Arc::new(AtomicBool::new(true));
    let trickler = {
        let mut s = s.try_clone().expect("clone");
        let trickling = trickling.clone();
        thread::spawn(move || {
            let mut sent = 0;
            while trickling.load(Ordering::SeqCst) && s.write_all(b"1").is_ok() {
                sent += 1;
                thread::sleep(Duration::from_millis(300));
            }
            sent
        })
    };
    // Others are served meanwhile.
    while start.elapsed() < timeout / 2 {
        health_answers(&health);
        thread::sleep(Duration::from_millis(50));
    }
    let (reply, closed) = read_to_close(&mut s, Duration::from_secs(10));
    let cut = start.elapsed();
    trickling.store(false, Ordering::SeqCst);
    let sent = trickler.join().expect("trickler");
    assert!(reply.starts_with("HTTP/1.1 408"), "{reply}");
    assert!(reply.contains(r#""code":"body_timeout""#), "{reply}");
    assert!(closed, "the connection stays open after the timeout");
    assert!(
        cut >= timeout && cut < timeout + Duration::from_secs(2),
        "cut after {cut:?} ({sent} bytes sent)"
    );
    health_answers(&health);
}

#[test]
fn an_idle_connection_is_closed_after_the_header_timeout() {
    let (_dir, server, _, _release) = server(Limits {
        header_read_timeout: Duration::from_millis(500),
        ..Limits::default()
    });
    let start = Instant::now();
    // Never sends anything.
    let mut silent = UnixStream::connect(server.path()).expect("connect");
    // Sends half a head.
    let mut slow = UnixStream::connect(server.path()).expect("connect");
    slow.write_all(b"GET /health HTTP/1.1\r\nHo").expect("half");
    for s in [&mut silent, &mut slow] {
        let (_, closed) = read_to_close(s, Duration::from_secs(5));
        assert!(closed);
    }
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(3),
        "{took:?}"
    );
}

#[test]
fn past_the_cap_an_idle_connection_makes_room_and_busy_ones_refuse() {
    let cap = 4;
    let (_dir, server, entered, release) = server(Limits {
        max_connections: cap,
        ..Limits::default()
    });
    let path = server.path().to_owned();
    let health = client(&path);

    // `cap` idle connections (one of them half way through its headers): a new client is
    // served, the oldest idle one closed for it, the others left alone.
    let mut idle: Vec<UnixStream> = (0..cap)
        .map(|_| {
            let s = UnixStream::connect(&path).expect("connect");
            thread::sleep(Duration::from_millis(20));
            s
        })
        .collect();
    idle[1]
        .write_all(b"GET /health HTTP/1.1\r\n")
        .expect("half");
    thread::sleep(Duration::from_millis(100));
    health_answers(&health);
    let (_, closed) = read_to_close(&mut idle[0], Duration::from_secs(2));
    assert!(closed, "the oldest idle connection is still open");
    for (i, s) in idle.iter_mut().enumerate().skip(1) {
        let (_, closed) = read_to_close(s, Duration::from_millis(100));
        assert!(!closed, "idle connection {i}, younger, was closed");
    }
    health_answers(&health);
    drop(idle);

    // `cap` requests in progress: a new connection is refused at once, as JSON.
    let mut busy: Vec<UnixStream> = (0..cap)
        .map(|_| {
            let mut s = UnixStream::connect(&path).expect("connect");
            s.write_all(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
                .expect("hold");
            s
        })
        .collect();
    let deadline = Instant::now() + Duration::from_secs(5);
    while entered.load(Ordering::SeqCst) < cap {
        assert!(Instant::now() < deadline, "the holds did not arrive");
        thread::sleep(Duration::from_millis(10));
    }
    let start = Instant::now();
    let refused = health.get("/health");
    match refused {
        Err(ControlError::Api { status, code, .. }) => {
            assert_eq!((status, code.as_str()), (503, "too_many_connections"));
        }
        other => panic!("expected 503, got {other:?}"),
    }
    assert!(start.elapsed() < Duration::from_secs(1));
    // Every held request is still served.
    release.send_replace(true);
    for s in &mut busy {
        let (reply, _) = read_to_close(s, Duration::from_millis(500));
        assert!(reply.starts_with("HTTP/1.1 200"), "{reply}");
        assert!(reply.ends_with("released"), "{reply}");
    }
    drop(busy);
    thread::sleep(Duration::from_millis(50));
    health_answers(&health);
}
