//! What a client can make the server log: warnings it can provoke at message rate are logged
//! once and then counted (one summary line per interval and when the client goes), and the
//! slow path of guest RAM that is not shared (device DMA through messages) is named once per
//! client.
#![forbid(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::ServerProcess;
use common::driver::{Driver, guest};
use common::ours::Ours;
use common::raw::{Raw, message};
use switchyard_client::{Client, FlatDma};
use switchyard_proto::consts::*;
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::MAGIC;

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

/// A client whose DMA windows have no fd (guest RAM not shared): the device reaches them
/// through DMA_READ/DMA_WRITE messages, which the client serves from `FlatDma`.
fn fdless_client(server: &ServerProcess) -> Driver<Ours> {
    let mut c = common::wait_for(Duration::from_secs(10), || {
        Client::connect(&server.socket).ok()
    })
    .expect("connect");
    c.set_dma_handler(Some(Box::new(FlatDma::new(FDLESS, 2 << 20))));
    Driver::new(Ours(c))
}

const FDLESS: u64 = 0x4000_0000;

#[test]
fn dma_through_windows_without_an_fd_is_named_once_per_client() {
    const LINE: &str = "device DMA goes through DMA_READ/DMA_WRITE messages";
    let server = ServerProcess::start_logging("info", &["--device", "softgpu"]);
    let count = |s: &ServerProcess| s.log_text().matches(LINE).count();
    let rw = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    {
        // fd-backed windows (the driver's guest memory) say nothing.
        let mut d = fdless_client(&server);
        d.setup_queue(0);
        d.run(0, &[Command::fill(guest(0x1000), 4096, 7)]);
        // Nor do fd-less maps by themselves (QEMU maps ROMs and BARs that way in every setup).
        for iova in [FDLESS, FDLESS + (1 << 20)] {
            d.t.0.dma_map(iova, 1 << 20, rw, None).expect("fd-less map");
        }
        assert_eq!(count(&server), 0, "{}", server.log_text());
        // Device DMA through both windows, reads and writes: one line.
        d.run(
            0,
            &[
                Command::copy(Operand::Guest(FDLESS), guest(0x2000), 64),
                Command::fill(Operand::Guest(FDLESS + (1 << 20)), 64 << 10, 1),
                Command::copy(guest(0x2000), Operand::Guest(FDLESS + 0x100), 64),
            ],
        );
        assert!(d.t.0.dma_requests_served() >= 3);
        let log = server.log_text();
        assert_eq!(log.matches(LINE).count(), 1, "{log}");
        let line = log.lines().find(|l| l.contains(LINE)).expect("line");
        assert!(
            line.contains("WARN")
                && line.contains("iova=1073741824")
                && line.contains("memory-backend-memfd")
                && line.contains("share=on")
                && line.contains("--memory size=...,shared=on"),
            "{line}"
        );
    }
    // A new client is told again.
    let mut d = fdless_client(&server);
    d.t.0
        .dma_map(FDLESS, 1 << 20, rw, None)
        .expect("fd-less map");
    d.setup_queue(0);
    d.run(0, &[Command::fill(Operand::Guest(FDLESS), 4096, 2)]);
    d.run(0, &[Command::fill(Operand::Guest(FDLESS), 4096, 3)]);
    assert_eq!(count(&server), 2, "{}", server.log_text());
}
