//! Moving an endpoint's device to another board under a running client: the worker
//! pre-copies VRAM while the device runs, then swaps to a device on the new VRAM. The client
//! here is a real vfio-user client on the endpoint's socket, running a workload through the
//! moves; nothing it observes may change.
#![forbid(unsafe_code)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::driver::{Driver, guest};
use common::ours::Ours;
use common::supervised::{connect, endpoint, supervisor};
use switchyard_daemon::{MoveOutcome, SupervisorError};
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;

const VRAM: u64 = 16 << 20;

/// A pattern no two offsets share.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| (i.wrapping_mul(0x9e37_79b9).wrapping_add(seed) >> 3) as u8)
        .collect()
}

#[test]
fn twenty_moves_under_a_workload_change_nothing_the_client_sees() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = Arc::new(supervisor());
    let socket = endpoint(&sup, dir.path(), "ep", false);
    let mut d = Driver::new(Ours(connect(&socket)));
    d.setup_queue(0);
    d.setup_queue(1);
    d.w32(SCRATCH, 0xfeed_0002);
    // VRAM the workload never touches, written through BAR2 before the first move (4 MiB
    // at 8 MiB) and by an engine (a FILL of 2 MiB at 12 MiB): checked after every move.
    let kept = pattern(7, 4 << 20);
    for (i, chunk) in kept.chunks(64 << 10).enumerate() {
        d.vram_write((8 << 20) + (i as u64) * (64 << 10), chunk);
    }
    d.run(
        1,
        &[Command::fill(Operand::Vram(12 << 20), 2 << 20, 0x5a5a_0001)],
    );

    let running = Arc::new(AtomicBool::new(true));
    let moved = Arc::new(AtomicU64::new(0));
    let mover = {
        let (sup, running, moved) = (Arc::downgrade(&sup), running.clone(), moved.clone());
        thread::spawn(move || {
            let mut reports = Vec::new();
            let boards = ["gpu1", "gpu2", "gpu0"];
            while running.load(Ordering::SeqCst) && reports.len() < 20 {
                // Pacing: the client works between the moves.
                thread::sleep(Duration::from_millis(40));
                let Some(sup) = sup.upgrade() else { break };
                let to = boards[reports.len() % 3];
                match sup.move_device("ep", to, false, Duration::from_secs(30)) {
                    Ok(MoveOutcome::Moved(r)) => reports.push(r),
                    other => panic!("move {} to {to}: {other:?}", reports.len()),
                }
                moved.fetch_add(1, Ordering::SeqCst);
            }
            reports
        })
    };
    let start = Instant::now();
    let mut round = 0u64;
    let mut checked_after = 0;
    while moved.load(Ordering::SeqCst) < 20 {
        assert!(
            start.elapsed() < Duration::from_secs(180),
            "twenty moves take too long"
        );
        // Engines write VRAM (FILL) and the client writes it through BAR2; both are read
        // back through the guest's memory and BAR2.
        for q in 0..2u32 {
            common::workload::fill_copy_round(&mut d, round, q);
        }
        let off = (round % 32) * 4096;
        let mine = pattern(round, 4096);
        d.vram_write(0x30_0000 + off, &mine);
        let mut back = vec![0u8; 4096];
        d.vram_read(0x30_0000 + off, &mut back);
        assert!(back == mine, "round {round}: BAR2 read-back differs");
        assert_eq!(d.r32(SCRATCH), 0xfeed_0002, "round {round}");
        let n = moved.load(Ordering::SeqCst);
        if n > checked_after && n.is_multiple_of(5) {
            checked_after = n;
            let mut got = vec![0u8; kept.len()];
            for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
                d.vram_read((8 << 20) + (i as u64) * (64 << 10), chunk);
            }
            assert!(
                got == kept,
                "after {n} moves: VRAM written before them differs"
            );
        }
        round += 1;
    }
    running.store(false, Ordering::SeqCst);
    let reports = mover.join().expect("mover");
    assert_eq!(reports.len(), 20);
    // Everything written before and during the moves is where it was.
    let mut got = vec![0u8; kept.len()];
    for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
        d.vram_read((8 << 20) + (i as u64) * (64 << 10), chunk);
    }
    assert!(got == kept, "VRAM written before the moves differs");
    let mut filled = vec![0u8; 2 << 20];
    for (i, chunk) in filled.chunks_mut(64 << 10).enumerate() {
        d.vram_read((12 << 20) + (i as u64) * (64 << 10), chunk);
    }
    assert!(
        filled.chunks(4).all(|w| w == 0x5a5a_0001u32.to_le_bytes()),
        "VRAM an engine wrote before the moves differs"
    );
    // Interrupts still arrive from the device on the last board.
    d.submit(0, &[Command::fence(guest(0x7f_0000), 0x77, Some(3))]);
    assert_eq!(d.wait_queue(0), Q_STATUS_IDLE);
    assert!(
        common::driver::wait_eventfd(&d.completion[3], Duration::from_secs(5)).is_some(),
        "the fence's interrupt reaches the client from the moved device"
    );
    let st = sup.status("ep").expect("status");
    assert_eq!(st.restarts, 0, "moves are not restarts: {st:?}");
    // The first move copies the data in VRAM; later ones copy what changed in between.
    assert!(reports[0].bytes >= 6 << 20, "{:?}", reports[0]);
    for r in &reports {
        assert!(r.rounds >= 1 && r.bytes < 64 * VRAM, "{r:?}");
    }
    let mut downtime: Vec<u64> = reports.iter().map(|r| r.downtime_us).collect();
    downtime.sort_unstable();
    eprintln!(
        "20 moves in {round} workload rounds; downtime p50 {} us, max {} us; first {:?}",
        downtime[10], downtime[19], reports[0]
    );
}

#[test]
fn a_mapped_vram_endpoint_is_not_moved_and_keeps_serving() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = supervisor();
    let socket = endpoint(&sup, dir.path(), "ep", true);
    let mut d = Driver::new(Ours(connect(&socket)));
    d.w32(SCRATCH, 0x1234);
    let refused = || match sup.move_device("ep", "gpu1", false, Duration::from_secs(10)) {
        Err(SupervisorError::MoveFailed { reason, .. }) => {
            assert!(reason.contains("vram_mmap=on"), "{reason}");
        }
        other => panic!("a mapped-VRAM move must be refused: {other:?}"),
    };
    // The worker answers on the channel that carries its holds: once the first refusal is
    // back, everything the client's connection gave it is in the ledger.
    refused();
    let held = sup.status("ep").expect("status").held;
    refused();
    assert_eq!(d.r32(SCRATCH), 0x1234);
    let st = sup.status("ep").expect("status");
    assert_eq!(
        (st.restarts, st.held),
        (0, held),
        "a refused move leaves nothing more held: {st:?}"
    );
}

#[test]
fn a_worker_killed_during_a_move_leaves_the_device_on_one_board_intact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = Arc::new(supervisor());
    let socket = endpoint(&sup, dir.path(), "ep", false);
    let mut d = Driver::new(Ours(connect(&socket)));
    d.setup_queue(0);
    let kept = pattern(3, 8 << 20);
    for (i, chunk) in kept.chunks(64 << 10).enumerate() {
        d.vram_write((i as u64) * (64 << 10), chunk);
    }
    // The worker's holds reach the ledger on their own channel, a little after the client
    // has its replies: a sync (answered after every earlier custody note) says when the
    // ledger has them all.
    sup.sync("ep", Duration::from_secs(20))
        .expect("the worker's custody notes applied");
    let held = sup.status("ep").expect("status").held;
    let mut outcomes = Vec::new();
    for attempt in 0..8u64 {
        // The kill lands at a different point of the move each time.
        let sup2 = sup.clone();
        let killer = thread::spawn(move || {
            thread::sleep(Duration::from_micros(500 + attempt * 4000));
            sup2.kill_worker("ep").expect("kill")
        });
        let outcome = sup.move_device("ep", "gpu1", false, Duration::from_secs(30));
        killer.join().expect("killer");
        sup.wait_ready("ep", attempt + 2, Duration::from_secs(20))
            .expect("status");
        outcomes.push(format!("{outcome:?}"));
        // Wherever the device ended up, it is the device the client had.
        let mut got = vec![0u8; kept.len()];
        for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
            d.vram_read((i as u64) * (64 << 10), chunk);
        }
        assert!(got == kept, "attempt {attempt} ({outcome:?}): VRAM differs");
        d.run(
            0,
            &[Command::fill(Operand::Vram(12 << 20), 4096, attempt as u32)],
        );
        // Once the worker's custody notes are all applied (a sync is answered after them):
        sup.sync("ep", Duration::from_secs(20)).expect("sync");
        let st = sup.status("ep").expect("status");
        // One VRAM is held, never the move's target as well.
        assert_eq!(st.held, held, "attempt {attempt} ({outcome:?}): {st:?}");
    }
    eprintln!("outcomes: {outcomes:#?}");
    // The kills landed before and after the point of no return (the swap), at least once
    // each, whatever this machine's speed: a kill before leaves the device where it was.
    assert!(
        outcomes.iter().any(|o| o.contains("where it was")),
        "{outcomes:#?}"
    );
}

/// A guest-visible move's data path: with the client gone (its VMM unplugged the device), a
/// device whose VRAM the client could map moves to another VRAM in one copy, and the next
/// client maps the new VRAM and finds the contents. With a client connected it is refused.
#[test]
fn a_mapped_vram_device_moves_while_no_client_is_connected() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = supervisor();
    let socket = endpoint(&sup, dir.path(), "ep", true);
    let mut d = Driver::new(Ours(connect(&socket)));
    let kept = pattern(11, 2 << 20);
    d.vram_write(4 << 20, &kept);
    let before = d.t.0.region_info(2).expect("BAR2").fd.expect("VRAM fd");
    // Connected: the mapping could not follow; nothing changes.
    match sup.move_device("ep", "gpu1", true, Duration::from_secs(10)) {
        Err(SupervisorError::MoveFailed { reason, .. }) => {
            assert!(reason.contains("client is connected"), "{reason}");
        }
        other => panic!("a detached move with a client must be refused: {other:?}"),
    }
    drop(d);
    let deadline = Instant::now() + Duration::from_secs(10);
    while sup.status("ep").expect("status").connected {
        assert!(
            Instant::now() < deadline,
            "the client's connection is still held"
        );
        thread::sleep(Duration::from_millis(5));
    }
    let report = match sup.move_device("ep", "gpu1", true, Duration::from_secs(30)) {
        Ok(MoveOutcome::Moved(r)) => r,
        other => panic!("detached move: {other:?}"),
    };
    assert!(report.bytes >= kept.len() as u64, "{report:?}");
    // The next client (the VMM plugging the device back) maps the new VRAM.
    let mut d = Driver::new(Ours(connect(&socket)));
    let after = d.t.0.region_info(2).expect("BAR2").fd.expect("VRAM fd");
    let ident = |f: &std::fs::File| {
        let m = f.metadata().expect("stat");
        (m.dev(), m.ino())
    };
    assert_ne!(
        ident(&before),
        ident(&after),
        "the device runs on another VRAM"
    );
    let mut got = vec![0u8; kept.len()];
    for (i, chunk) in got.chunks_mut(64 << 10).enumerate() {
        d.vram_read((4 << 20) + (i as u64) * (64 << 10), chunk);
    }
    assert!(got == kept, "VRAM contents moved");
    let mut mapped = vec![0u8; 4096];
    std::os::unix::fs::FileExt::read_exact_at(&after, &mut mapped, 4 << 20).expect("read");
    assert_eq!(mapped, kept[..4096], "through the new memory object");
    d.setup_queue(0);
    d.run(0, &[Command::fill(Operand::Vram(0), 4096, 7)]);
}

/// A queue on mapped doorbells through transparent moves: the device moves to other VRAM, but
/// the doorbell page the client mapped is the endpoint's, so tails stored into it keep
/// reaching whichever device serves.
#[test]
fn mapped_doorbells_keep_working_through_transparent_moves() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = Arc::new(supervisor());
    let socket = endpoint(&sup, dir.path(), "ep", false);
    let (mut d, page) = common::supervised::mapped_driver(&socket);
    let boards = ["gpu1", "gpu2", "gpu0"];
    for m in 0..6u64 {
        for round in 0..8u64 {
            let off = ((m * 8 + round) % 64) * 4096;
            let fill = ((m << 8) | round) as u32;
            let what = format!("move {m} round {round}");
            common::workload::mapped_fill_copy_round(&mut d, &page, off, fill, &what);
        }
        let to = boards[m as usize % 3];
        match sup.move_device("ep", to, false, Duration::from_secs(30)) {
            Ok(MoveOutcome::Moved(_)) => {}
            other => panic!("move {m} to {to}: {other:?}"),
        }
    }
    assert_eq!(
        d.r32(queue_reg(0, Q_CONTROL)),
        Q_CONTROL_ENABLE | Q_CONTROL_MAPPED
    );
}
