//! Every request knows who connected (`SO_PEERCRED`, a `Caller`), and connections are
//! admitted by uid: a user other than root and the server's own holds at most its share, all
//! such users together never root's reserve. Connections as other users come from threads
//! that dropped to those users (credentials are per thread for the kernel), so those tests
//! need root: `#[ignore = "needs root"]`, run by `scripts/run-root-tests.sh`.
#![forbid(unsafe_code)]

mod common;

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::{TestServer, hold_route, socket_path};
use serde_json::json;
use switchyard_control::{Caller, ControlApi, Json, Limits};
use tokio::sync::watch;

/// `GET /whoami` (the caller), `GET /hold` (answers when `release` turns true; counts its
/// calls in `entered`) and `GET /health`.
fn router(entered: Arc<AtomicUsize>, release: watch::Receiver<bool>) -> axum::Router {
    let whoami = |caller: Caller| async move {
        Json(
            json!({"uid": caller.uid, "gid": caller.gid, "pid": caller.pid,
                    "privileged": caller.privileged()}),
        )
    };
    let (router, _doc) = ControlApi::new("callers", "0")
        .health()
        .merge(
            axum::Router::new()
                .route("/whoami", axum::routing::get(whoami))
                .route("/hold", hold_route(entered, release))
                .into(),
        )
        .build(());
    router
}

#[test]
fn a_handler_sees_the_process_that_connected() {
    let (_dir, path) = socket_path();
    let (_release, released) = watch::channel(false);
    let server =
        TestServer::start(&path, router(Arc::new(AtomicUsize::new(0)), released)).expect("start");
    let me = server.client().get("/whoami").expect("whoami").body;
    assert_eq!(
        me,
        json!({"uid": rustix::process::geteuid().as_raw(),
               "gid": rustix::process::getegid().as_raw(),
               "pid": std::process::id(), "privileged": true}),
        "the server's own user is privileged"
    );
}

/// Runs `f` on a thread whose credentials are `uid`/`gid` (no supplementary groups).
fn as_user<T: Send + 'static>(uid: u32, gid: u32, f: impl FnOnce() -> T + Send + 'static) -> T {
    use rustix::process::{Gid, Uid};
    use rustix::thread::{set_thread_groups, set_thread_res_gid, set_thread_res_uid};
    thread::spawn(move || {
        set_thread_groups(&[]).expect("setgroups");
        let g = Gid::from_raw(gid);
        set_thread_res_gid(g, g, g).expect("setresgid");
        let u = Uid::from_raw(uid);
        set_thread_res_uid(u, u, u).expect("setresuid");
        f()
    })
    .join()
    .expect("the thread of another user")
}

/// `GET /hold` on a new connection (made as whoever runs this). A refused one may be closed
/// before the request is written: its reply is read all the same.
fn hold(path: &Path) -> UnixStream {
    let mut s = UnixStream::connect(path).expect("connect");
    let _ = s.write_all(b"GET /hold HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s
}

/// The whole reply on `s` (the server closes a refused connection).
fn reply(s: &mut UnixStream) -> String {
    s.set_read_timeout(Some(Duration::from_secs(5)))
        .expect("timeout");
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

const NOBODY: u32 = 65534;
const OTHER: u32 = 65533;

#[test]
#[ignore = "needs root"]
fn users_hold_their_share_of_connections_and_root_its_reserve() {
    assert!(rustix::process::geteuid().is_root(), "needs root");
    let (dir, path) = socket_path();
    std::fs::set_permissions(dir.path(), PermissionsExt::from_mode(0o755)).expect("chmod");
    let entered = Arc::new(AtomicUsize::new(0));
    let (release, released) = watch::channel(false);
    // 4 connections, 1 kept for root, 2 per user.
    let limits = Limits {
        max_connections: 4,
        reserved_connections: 1,
        max_connections_per_uid: 2,
        ..Limits::default()
    };
    let server = TestServer::start_with_limits(&path, router(entered.clone(), released), limits)
        .expect("start");
    // Everyone may connect (the daemon's socket group does this for its members).
    std::fs::set_permissions(&path, PermissionsExt::from_mode(0o666)).expect("chmod");

    // Another user's requests are its own: the caller is that user, unprivileged.
    let client = server.client();
    let whoami = as_user(NOBODY, NOBODY, move || {
        client.get("/whoami").expect("whoami").body
    });
    assert_eq!(whoami["uid"], NOBODY);
    assert_eq!(whoami["privileged"], false);

    // Nobody holds two connections busy; its third is refused, naming the limit (and
    // closes neither of them: they are busy).
    let p = path.clone();
    let mut held = as_user(NOBODY, NOBODY, move || [hold(&p), hold(&p)]);
    wait_for_holds(&entered, 2);
    let p = path.clone();
    let refused = reply(&mut as_user(NOBODY, NOBODY, move || hold(&p)));
    assert!(refused.starts_with("HTTP/1.1 503"), "{refused}");
    assert!(
        refused.contains(r#""code":"too_many_connections""#),
        "{refused}"
    );
    assert!(
        refused.contains("User 65534 has 2 control connections busy, the most one user may hold"),
        "{refused}"
    );
    // A second user gets the last connection users share, not root's reserve.
    let p = path.clone();
    let mut other = as_user(OTHER, OTHER, move || hold(&p));
    wait_for_holds(&entered, 3);
    let p = path.clone();
    let refused = reply(&mut as_user(OTHER, OTHER, move || hold(&p)));
    assert!(
        refused.contains(
            "Every one of the 3 control connections users other than root may hold is busy (1 more are kept for root)"
        ),
        "{refused}"
    );
    // Root is served from its reserve.
    let whoami = server.client().get("/whoami").expect("root is served").body;
    assert_eq!(whoami["privileged"], true);

    release.send_replace(true);
    let [a, b] = &mut held;
    for s in [a, b, &mut other] {
        let r = reply(s);
        assert!(
            r.starts_with("HTTP/1.1 200") && r.ends_with("released"),
            "{r}"
        );
    }
}

/// Waits until `n` holds have reached the handler.
fn wait_for_holds(entered: &AtomicUsize, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while entered.load(Ordering::SeqCst) < n {
        assert!(Instant::now() < deadline, "the holds did not arrive");
        thread::sleep(Duration::from_millis(5));
    }
}
