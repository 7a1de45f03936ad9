//! What a client can make the server log: warnings it can provoke at message rate are logged
//! once and then counted (one summary line per interval and when the client goes), and a
//! slow-path configuration (guest RAM not shared) is named once per client.

mod common;

use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::ServerProcess;
use common::raw::Raw;
use switchyard_client::Client;
use switchyard_proto::Header;
use switchyard_proto::consts::*;
use switchyard_softgpu::regs::MAGIC;
use zerocopy::IntoBytes;

const SUMMARY: &str = "repeated warning suppressed";

/// Lines logged in full for warning `what`, and the counts its summary lines report.
fn accounting(log: &str, what: &str) -> (usize, u64) {
    let full = log
        .lines()
        .filter(|l| l.contains(what) && !l.contains(SUMMARY))
        .count();
    let tag = format!("what=\"{what}\"");
    let suppressed = log
        .lines()
        .filter(|l| l.contains(SUMMARY) && l.contains(&tag))
        .map(|l| {
            let n = l
                .split("suppressed=")
                .nth(1)
                .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
                .and_then(|n| n.parse::<u64>().ok());
            n.unwrap_or_else(|| panic!("no count in {l}"))
        })
        .sum();
    (full, suppressed)
}

fn message(msg_id: u16, cmd: u16, flags: u32, body: &[u8]) -> Vec<u8> {
    let h = Header {
        msg_id,
        cmd,
        msg_size: 16 + body.len() as u32,
        flags,
        error_no: 0,
    };
    let mut m = h.as_bytes().to_vec();
    m.extend_from_slice(body);
    m
}

#[test]
fn floods_of_failing_posted_writes_and_unsolicited_replies_are_counted_not_logged() {
    const N: usize = 20_000;
    let server = ServerProcess::start_logging("info", &["--device", "softgpu"]);
    let mut r = Raw::negotiated(&server.socket);
    let t0 = Instant::now();
    // Posted (No_reply) REGION_WRITEs just past BAR0's end, and replies nobody asked for.
    let mut bad_write = (64u64 << 10).to_ne_bytes().to_vec();
    bad_write.extend_from_slice(&0u32.to_ne_bytes());
    bad_write.extend_from_slice(&4u32.to_ne_bytes());
    bad_write.extend_from_slice(&[1, 2, 3, 4]);
    let posted = VFIO_USER_F_NO_REPLY;
    let reply = VFIO_USER_F_TYPE_REPLY;
    let mut burst = Vec::new();
    for i in 0..N {
        burst.extend_from_slice(&message(i as u16, 10, posted, &bad_write));
        burst.extend_from_slice(&message(i as u16, 9, reply, &[0; 16]));
        if burst.len() > 256 << 10 {
            r.send(&burst, &[]);
            burst.clear();
        }
    }
    r.send(&burst, &[]);
    // Processed in order: once this is answered, the flood has been handled.
    assert_eq!(r.read_reg(MAGIC), u32::from_le_bytes(*b"SYGP"));
    let elapsed = t0.elapsed();
    drop(r);
    let log = common::wait_for(Duration::from_secs(10), || {
        let t = server.log_text();
        let done = accounting(&t, "dropping an unsolicited reply").1 > 0
            && accounting(&t, "posted request failed").1 > 0;
        done.then_some(t)
    })
    .unwrap_or_else(|| panic!("no summary lines:\n{}", server.log_text()));

    // Every occurrence is accounted for exactly once: logged in full or counted.
    let intervals = 2 + elapsed.as_secs() as usize / 5;
    for what in ["posted request failed", "dropping an unsolicited reply"] {
        let (full, suppressed) = accounting(&log, what);
        assert_eq!(full as u64 + suppressed, N as u64, "{what}:\n{log}");
        assert!(
            (1..=intervals).contains(&full),
            "{what}: {full} full lines in {elapsed:?}:\n{log}"
        );
    }
    // Bounded: 40,000 bad messages leave a handful of lines (connect, version, the above).
    assert!(
        log.lines().count() < 30 && log.len() < 8 << 10,
        "{} lines, {} bytes:\n{log}",
        log.lines().count(),
        log.len()
    );
}

#[test]
fn dma_maps_without_an_fd_are_named_once_per_client() {
    const LINE: &str = "DMA window mapped without a file descriptor";
    let server = ServerProcess::start_logging("info", &["--device", "softgpu"]);
    let count = |s: &ServerProcess| s.log_text().matches(LINE).count();
    let rw = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    let mem = common::GuestMemory::new(1 << 20);
    {
        let mut c = Client::connect(&server.socket).expect("connect");
        // An fd-backed window says nothing.
        c.dma_map(0x100_0000, 1 << 20, rw, Some((mem.file.as_fd(), 0)))
            .expect("fd map");
        assert_eq!(count(&server), 0);
        c.dma_map(0x1_0000, 0x1_0000, rw, None).expect("map 1");
        c.dma_map(0x4_0000, 0x1_0000, rw, None).expect("map 2");
        let log = server.log_text();
        assert_eq!(log.matches(LINE).count(), 1, "{log}");
        let line = log.lines().find(|l| l.contains(LINE)).expect("line");
        assert!(
            line.contains("WARN")
                && line.contains("memory-backend-memfd")
                && line.contains("share=on")
                && line.contains("--memory size=...,shared=on"),
            "{line}"
        );
    }
    // A new client is told again.
    let mut c = common::wait_for(Duration::from_secs(10), || {
        Client::connect(&server.socket).ok()
    })
    .expect("second client");
    c.dma_map(0x1_0000, 0x1_0000, rw, None).expect("map");
    c.dma_map(0x8_0000, 0x1_0000, rw, None).expect("map");
    assert_eq!(count(&server), 2, "{}", server.log_text());
}
