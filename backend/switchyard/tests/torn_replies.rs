//! Whole replies or a dropped client, across a worker's death (issue 34, item 5): a client
//! stops reading in the middle of the replies, the worker serving it is SIGKILLed, and the
//! replacement either finishes the reply that was leaving (and goes on) or closes the
//! connection. The client never reads part of a reply followed by more bytes.
//!
//! One test per reply size class: replies under 4 KiB, replies larger than the socket's
//! buffer (1 MiB REGION_READs of VRAM, cut in the middle for certain), and replies that carry a
//! descriptor (REGION_INFO of the mappable VRAM BAR). Each runs twice: the client reads again
//! within the replacement's send timeout (everything arrives whole and the connection serves
//! on: the positive control), and the client stays stalled until the replacement has given up
//! on a send (it reads what is there afterwards: whole replies, then the end of the stream).
#![forbid(unsafe_code)]

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::raw::{Raw, message};
use common::supervised::{endpoint, quiet_worker};
use switchyard_daemon::Supervisor;
use switchyard_proto::Header;
use switchyard_softgpu::regs::SCRATCH;
use switchyard_softgpu::{BAR_REGS, BAR_VRAM};

const REGION_INFO: u16 = 5;
const REGION_READ: u16 = 9;
const REGION_WRITE: u16 = 10;
/// Bytes of VRAM each large read returns.
const LARGE: u32 = 1 << 20;
/// What the client's REGION_INFO offers for capabilities (the sparse-mmap one fits).
const INFO_ARGSZ: u32 = 512;

#[derive(Clone, Copy, Debug)]
enum Class {
    /// 4-byte register reads: 36-byte replies.
    Small,
    /// 1 MiB VRAM reads: replies larger than the socket buffer.
    Large,
    /// REGION_INFO of the VRAM BAR: replies that carry its memory's descriptor.
    WithFd,
}

/// What the client does once the worker is dead.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Then {
    /// Reads again as soon as the replacement serves.
    Reads,
    /// Stays stalled until the replacement has given up on a send.
    Stalls,
}

/// The byte of VRAM at `offset` (written before the test's reads).
fn pattern(offset: usize) -> u8 {
    (offset as u8) ^ ((offset >> 8) as u8).wrapping_mul(31) ^ ((offset >> 16) as u8)
}

fn access_body(region: u32, offset: u64, count: u32) -> Vec<u8> {
    let mut b = offset.to_ne_bytes().to_vec();
    b.extend_from_slice(&region.to_ne_bytes());
    b.extend_from_slice(&count.to_ne_bytes());
    b
}

impl Class {
    fn request(self, id: u16) -> Vec<u8> {
        match self {
            Class::Small => message(id, REGION_READ, 0, &access_body(BAR_REGS, SCRATCH, 4)),
            Class::Large => message(id, REGION_READ, 0, &access_body(BAR_VRAM, 0, LARGE)),
            Class::WithFd => {
                let mut b = INFO_ARGSZ.to_ne_bytes().to_vec();
                b.extend_from_slice(&0u32.to_ne_bytes()); // flags
                b.extend_from_slice(&BAR_VRAM.to_ne_bytes());
                b.extend_from_slice(&[0u8; 20]); // cap_offset, size, offset
                message(id, REGION_INFO, 0, &b)
            }
        }
    }

    /// Whether `(h, body)` is the whole, right reply to request `id`; why not otherwise.
    fn check(self, id: u16, h: &Header, body: &[u8]) -> Result<(), String> {
        let cmd = match self {
            Class::Small | Class::Large => REGION_READ,
            Class::WithFd => REGION_INFO,
        };
        if h.msg_id != id || h.cmd != cmd || h.is_error() {
            return Err(format!(
                "wanted the reply to {id} (command {cmd}), read {h:?}"
            ));
        }
        match self {
            Class::Small => {
                if body.len() != 20 || body[16..20] != 0x5ca1_ab1eu32.to_le_bytes() {
                    return Err(format!("register read {id}: {body:02x?}"));
                }
            }
            Class::Large => {
                if body.len() != 16 + LARGE as usize {
                    return Err(format!("VRAM read {id}: {} bytes", body.len()));
                }
                if let Some(at) = (0..LARGE as usize).find(|&i| body[16 + i] != pattern(i)) {
                    return Err(format!("VRAM read {id}: wrong byte at {at}: a torn reply"));
                }
            }
            Class::WithFd => {
                let index = u32::from_ne_bytes(body[8..12].try_into().expect("4 bytes"));
                let size = u64::from_ne_bytes(body[16..24].try_into().expect("8 bytes"));
                if body.len() < 32 || index != BAR_VRAM || size != 16 << 20 {
                    return Err(format!("REGION_INFO {id}: index {index}, size {size}"));
                }
            }
        }
        Ok(())
    }
}

/// A supervisor whose workers log to a file the test reads.
fn supervisor() -> (Arc<Supervisor>, PathBuf) {
    let exe = quiet_worker();
    let log = exe
        .parent()
        .expect("the wrapper's directory")
        .join("workers.log");
    (Arc::new(Supervisor::new(exe)), log)
}

fn log_count(log: &Path, what: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .matches(what)
        .count()
}

/// The worker gave up on a reply (the one it found torn, or a later one).
const GAVE_UP: [&str; 2] = [
    "cannot finish the replaced process's last reply",
    "cannot send a reply",
];

fn gave_up(log: &Path) -> usize {
    GAVE_UP.iter().map(|w| log_count(log, w)).sum()
}

/// Writes requests until the worker stops reading them (it is stuck sending a reply the client
/// does not read); returns the ids sent whole.
fn flood(r: &mut Raw, class: Class) -> Vec<u16> {
    let mut ids = Vec::new();
    if let Class::Large = class {
        // Four requests; the first reply is larger than the socket's buffer, so once any byte
        // of it has arrived the worker is in the middle of it until the client reads.
        for _ in 0..4 {
            let id = r.id();
            r.send(&class.request(id), &[]);
            ids.push(id);
        }
        let t0 = Instant::now();
        while rustix::io::ioctl_fionread(&r.s).expect("FIONREAD") == 0 {
            assert!(t0.elapsed() < Duration::from_secs(20), "no reply began");
            std::thread::sleep(Duration::from_millis(5));
        }
        return ids;
    }
    // One request per write (a write this small is taken whole or not at all); a write that
    // takes no byte for a second means the worker stopped reading.
    r.s.set_write_timeout(Some(Duration::from_secs(1)))
        .expect("timeout");
    loop {
        assert!(ids.len() < 1 << 20, "the worker never stopped reading");
        let id = r.id();
        match (&r.s).write(&class.request(id)) {
            Ok(n) => {
                assert_eq!(n, class.request(id).len(), "a request written in part");
                ids.push(id);
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                return ids;
            }
            Err(e) => panic!("write a request: {e}"),
        }
    }
}

fn torn_reply_case(class: Class, then: Then) {
    let dir = tempfile::tempdir().expect("tempdir");
    let (sup, log) = supervisor();
    let socket = endpoint(&sup, dir.path(), "ep", true);
    let mut r = Raw::negotiated(&socket);
    // What the reads return: a register value, and VRAM's first MiB.
    let mut w = access_body(BAR_REGS, SCRATCH, 4);
    w.extend_from_slice(&0x5ca1_ab1eu32.to_le_bytes());
    assert!(!r.call(REGION_WRITE, 0, &w, &[]).0.is_error());
    const CHUNK: usize = 64 << 10;
    for at in (0..LARGE as usize).step_by(CHUNK) {
        let mut w = access_body(BAR_VRAM, at as u64, CHUNK as u32);
        w.extend((at..at + CHUNK).map(pattern));
        assert!(!r.call(REGION_WRITE, 0, &w, &[]).0.is_error());
    }

    let ids = flood(&mut r, class);
    let gave_up_before = gave_up(&log);
    sup.kill_worker("ep").expect("kill");
    let st = sup
        .wait_ready("ep", 2, Duration::from_secs(30))
        .expect("status");
    assert_eq!(st.ready, 2, "a replacement serves: {st:?}");
    if then == Then::Stalls {
        // Stalled past the replacement's send timeout (5 s): it gave up on a reply.
        let t0 = Instant::now();
        while gave_up(&log) == gave_up_before {
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "the replacement never gave up on the stalled client"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    // Everything that arrives is a whole, right reply, in order.
    r.s.set_read_timeout(Some(Duration::from_secs(20)))
        .expect("timeout");
    let mut whole = 0;
    for &id in &ids {
        let Some((h, body)) = r.recv() else {
            break; // the end of the stream (a torn reply's bytes are read up to it)
        };
        if let Err(e) = class.check(id, &h, &body) {
            panic!("{class:?}, {then:?}: reply {whole} of {}: {e}", ids.len());
        }
        whole += 1;
    }
    match then {
        Then::Reads => {
            assert_eq!(whole, ids.len(), "{class:?}: every reply arrives");
            // ... and the connection serves on.
            assert_eq!(r.read_reg(SCRATCH), 0x5ca1_ab1e);
        }
        Then::Stalls => {
            // The client was dropped: after the whole replies, the end of the stream.
            assert!(
                whole < ids.len(),
                "{class:?}: the stalled client was dropped"
            );
            assert!(r.recv().is_none(), "{class:?}: nothing after the end");
        }
    }
    eprintln!(
        "{class:?}, {then:?}: {} requests, {whole} whole replies",
        ids.len()
    );
}

#[test]
fn a_small_reply_cut_by_a_kill_arrives_whole_or_the_client_is_dropped() {
    torn_reply_case(Class::Small, Then::Reads);
    torn_reply_case(Class::Small, Then::Stalls);
}

#[test]
fn a_reply_larger_than_the_socket_buffer_cut_by_a_kill_is_finished_or_the_client_is_dropped() {
    torn_reply_case(Class::Large, Then::Reads);
    torn_reply_case(Class::Large, Then::Stalls);
}

#[test]
fn a_reply_carrying_a_descriptor_cut_by_a_kill_arrives_whole_or_the_client_is_dropped() {
    torn_reply_case(Class::WithFd, Then::Reads);
    torn_reply_case(Class::WithFd, Then::Stalls);
}
