//! `GET /events?since=0` against a real `switchyard daemon` with a history of thousands of
//! events: readers that stop reading cost the daemon a bounded amount of memory each (the
//! history is read from the store page by page as the body is sent), streams past the cap
//! are refused with 503, and the API keeps answering meanwhile.
#![forbid(unsafe_code)]

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use common::daemon::Daemon;
use serde_json::Value;

/// Pool events in the history (quarantine and unquarantine of one board, alternately): more
/// than the daemon keeps in memory, so the history comes from the store.
const HISTORY: usize = 8000;
/// Readers that stop reading (the daemon's cap on events streams).
const READERS: usize = 32;
/// How much the daemon's resident memory may grow with every reader stalled. The whole
/// history as lines is about 1.3 MB per reader (about 40 MB for all); a page is tens of KB.
const BOUND_KB: u64 = 12 * 1024;

/// The daemon's resident memory, KiB.
fn rss_kb(d: &Daemon) -> u64 {
    let pid = d.pid().expect("the daemon runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// Sends `GET path` on a new connection and reads the reply's head (status line and headers)
/// byte by byte, so that nothing of the body is read; the connection, unread.
fn request_head(socket: &PathBuf, path: &str) -> (UnixStream, String) {
    let mut s = UnixStream::connect(socket).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    write!(s, "GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n").expect("send");
    let mut head = Vec::new();
    let mut byte = [0u8];
    while !head.ends_with(b"\r\n\r\n") {
        s.read_exact(&mut byte).expect("reply head");
        head.push(byte[0]);
    }
    (s, String::from_utf8_lossy(&head).into_owned())
}

#[test]
fn stalled_readers_of_a_long_history_cost_bounded_memory() {
    let d = Daemon::start_with_config("[[boards]]\nid = \"gpu0\"\nvram = \"16M\"\n");
    let c = d.client();
    for i in 0..HISTORY / 2 {
        for op in ["quarantine", "unquarantine"] {
            c.post(&format!("/v1/boards/gpu0/{op}"), &serde_json::json!({}))
                .unwrap_or_else(|e| panic!("{op} #{i}: {e}"));
        }
    }
    // A reader that reads everything sees the whole history in order, once.
    let read_all = || -> Vec<u64> {
        c.stream("/events?since=0&follow=false")
            .expect("events")
            .map(|l| {
                let v: Value = serde_json::from_str(&l.expect("line")).expect("json");
                v["seq"].as_u64().expect("seq")
            })
            .collect()
    };
    let seqs = read_all();
    assert!(seqs.len() > HISTORY, "{} events", seqs.len());
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "out of order");
    let before = rss_kb(&d);

    let mut readers = Vec::new();
    for _ in 0..READERS {
        let (s, head) = request_head(&d.socket(), "/events?since=0");
        assert!(head.starts_with("HTTP/1.1 200"), "{head}");
        readers.push(s);
    }
    // Every stream has read pages of the history from the store and sent them until its
    // socket is full or nearly: the daemon's send buffer (the kernel's default) takes about
    // half of it in lines before a writer waits (overhead per message), so a quarter is
    // well past the first page and short of where the stream stalls. A daemon that held
    // the whole history per reader would hold it from the first page on.
    let wmem = std::fs::read_to_string("/proc/sys/net/core/wmem_default")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(212_992);
    let queued = |s: &UnixStream| rustix::io::ioctl_fionread(s).expect("FIONREAD");
    let streamed = common::wait_for(Duration::from_secs(30), || {
        readers.iter().all(|s| queued(s) >= wmem / 4).then_some(())
    });
    assert!(
        streamed.is_some(),
        "the readers' streams stopped short of {} bytes: {:?}",
        wmem / 4,
        readers.iter().map(queued).collect::<Vec<_>>()
    );
    let stalled = rss_kb(&d);
    eprintln!(
        "daemon VmRSS: {before} kB before, {stalled} kB with {READERS} stalled readers of \
         {HISTORY} events"
    );
    assert!(
        stalled.saturating_sub(before) < BOUND_KB,
        "{READERS} stalled readers grew the daemon by {} kB (bound {BOUND_KB} kB)",
        stalled - before
    );
    // The API answers meanwhile.
    assert_eq!(c.get("/health").expect("health").status, 200);
    // One stream more is refused, as JSON.
    let (mut s, head) = request_head(&d.socket(), "/events?since=0");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    assert!(body.contains("\"too_many_streams\""), "{body}");
    drop(s);

    drop(readers);
    // The streams' slots are free again once the daemon has seen the readers go.
    let reopened = common::wait_for(Duration::from_secs(10), || {
        let (s, head) = request_head(&d.socket(), "/events?since=0");
        head.starts_with("HTTP/1.1 200").then_some(s)
    });
    assert!(reopened.is_some(), "a stream slot stays taken");
    eprintln!("daemon VmRSS: {} kB after the readers closed", rss_kb(&d));
    assert_eq!(read_all(), seqs, "the history changed");
}
