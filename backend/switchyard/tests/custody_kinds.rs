//! Only what a vfio-user client legitimately sends goes into custody (issue 32), against real
//! `switchyard daemon` and `switchyard worker` processes: a DMA_MAP carrying a TCP socket with
//! `SO_LINGER` and unsent data its peer never reads (whose last close would block for the
//! linger time) is refused with EINVAL before custody, the connection keeps serving, the
//! daemon holds only the valid window's memory once it has caught up with the worker
//! (`POST /v1/endpoints/{id}/sync`), and the endpoint is deleted at once.
#![forbid(unsafe_code)]

mod common;

use std::io::Write;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::GuestMemory;
use common::daemon::{Daemon, socket_of};
use serde_json::json;
use switchyard_client::{Client, ClientConfig};
use switchyard_proto::consts::*;

const ONE_BOARD: &str = "[[boards]]\nid = \"a\"\nvram = \"16M\"\n";

/// A TCP socket with a 60 s `SO_LINGER` and data its peer (returned, alive) never reads.
fn lingering_socket() -> (
    std::net::TcpStream,
    std::net::TcpStream,
    std::net::TcpListener,
) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("listen");
    let mut s =
        std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
    let (peer, _) = listener.accept().expect("accept");
    rustix::net::sockopt::set_socket_linger(&s, Some(Duration::from_secs(60))).expect("linger");
    s.set_nonblocking(true).expect("nonblocking");
    let chunk = vec![0u8; 1 << 16];
    while s.write(&chunk).is_ok() {}
    s.set_nonblocking(false).expect("blocking");
    (s, peer, listener)
}

#[test]
fn a_dma_map_carrying_a_lingering_socket_is_refused_and_the_daemon_never_stalls() {
    let mut d = Daemon::start_with_config(ONE_BOARD);
    d.ctl_ok(&["create", "ep", "--device", "a"]);
    let socket = socket_of(&d.endpoint("ep"));
    let config = ClientConfig {
        timeout: Some(Duration::from_secs(5)),
        ..ClientConfig::default()
    };
    let mut c = Client::connect_with(&socket, config).expect("connect");
    let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;

    let (sock, _peer, _listener) = lingering_socket();
    let refused = c
        .dma_map(0x1_0000_0000, 4096, flags, Some((sock.as_fd(), 0)))
        .expect_err("a socket is no DMA memory");
    assert_eq!(refused.remote_errno(), Some(libc::EINVAL), "{refused}");
    // The worker's copy was the only other one: ours goes, nobody may block on the last.
    drop(sock);

    // The connection serves on: a valid window is taken.
    let mem = GuestMemory::new(4096);
    c.dma_map(0x2_0000_0000, 4096, flags, Some((mem.file.as_fd(), 0)))
        .expect("a memfd window after the refusal");

    // Once the daemon has applied every custody note the worker made, it holds the
    // memfd and nothing of the socket.
    let synced = d
        .client()
        .post("/v1/endpoints/ep/sync", &json!({}))
        .expect("sync");
    let worker = &synced.body["worker"];
    assert_eq!(worker["client_fds"], 1, "{worker}");
    assert!(worker["custody_seq"].as_u64().unwrap_or(0) > 0, "{worker}");

    let t0 = Instant::now();
    let deleted = d.client().delete("/v1/endpoints/ep").expect("delete");
    assert_eq!(deleted.status, 204);
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "the delete took {:?}",
        t0.elapsed()
    );
    drop(c);
}
