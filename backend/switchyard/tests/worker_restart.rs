//! The pool's data path survives the death of the process serving it: a supervisor
//! (`switchyard_daemon::Supervisor`) keeps every descriptor of the client's view and a black
//! box, and a replacement `switchyard worker` resumes the connection. The client here is a
//! real vfio-user client driving the softgpu over its socket while the worker is SIGKILLed
//! under it.
#![forbid(unsafe_code)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::driver::{Driver, guest};
use common::ours::Ours;
use common::supervised::{connect, endpoint, supervisor};
use switchyard_daemon::Supervisor;
use switchyard_softgpu::cmd::Command;
use switchyard_softgpu::regs::*;

/// Kills the endpoint's worker every `every` while `running`; returns how many it killed.
/// Holds the supervisor weakly: if the test fails, dropping the test's reference stops the
/// workers (a supervisor kills them when dropped).
fn killer(
    sup: &Arc<Supervisor>,
    id: &'static str,
    every: Duration,
    running: Arc<AtomicBool>,
) -> thread::JoinHandle<u64> {
    let sup = Arc::downgrade(sup);
    thread::spawn(move || {
        let mut kills = 0;
        let mut last_pid = None;
        while running.load(Ordering::SeqCst) {
            thread::sleep(every);
            let Some(sup) = sup.upgrade() else {
                break;
            };
            // Only a worker that has served since the last kill (a replacement that reported
            // ready): killing replacements before they start is a different test.
            let st = sup.status(id).expect("status");
            if st.pid.is_some() && st.pid != last_pid && st.ready > kills {
                last_pid = sup.kill_worker(id).expect("kill");
                kills += 1;
            }
        }
        kills
    })
}

#[test]
fn a_worker_killed_ten_times_under_a_workload_is_a_stall_not_a_lost_device() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = Arc::new(supervisor());
    let socket = endpoint(&sup, dir.path(), "ep", true);
    let mut d = Driver::new(Ours(connect(&socket)));
    d.setup_queue(0);
    d.setup_queue(1);
    d.w32(SCRATCH, 0xfeed_0001);

    let running = Arc::new(AtomicBool::new(true));
    let kills = killer(&sup, "ep", Duration::from_millis(150), running.clone());
    // Idempotent work (COPY/FILL) on both queues, every result checked, until ten kills.
    let start = Instant::now();
    let mut round = 0u64;
    while sup.status("ep").expect("status").restarts < 10 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "ten restarts take too long"
        );
        for q in 0..2u32 {
            common::workload::fill_copy_round(&mut d, round, q);
        }
        // Registers the client wrote before the kills are still there.
        assert_eq!(d.r32(SCRATCH), 0xfeed_0001, "round {round}");
        round += 1;
    }
    running.store(false, Ordering::SeqCst);
    let killed = kills.join().expect("killer");
    let st = sup.status("ep").expect("status");
    assert!(killed >= 10 && st.restarts >= 10, "{killed} kills, {st:?}");
    assert!(!st.failed);
    // Interrupts still arrive from the latest worker.
    d.submit(0, &[Command::fence(guest(0x7f_0000), 0x77, Some(3))]);
    assert_eq!(d.wait_queue(0), Q_STATUS_IDLE);
    assert!(
        common::driver::wait_eventfd(&d.completion[3], Duration::from_secs(5)).is_some(),
        "the fence's interrupt reaches the client's eventfd through the replacement"
    );
    eprintln!(
        "{round} rounds over {killed} kills; last restart {:?}",
        st.last_restart
    );
}

/// In-place SAXPY counters (y += x with x all ones) run exactly once or report
/// ERR_INTERRUPTED: a kill never makes a command run twice silently.
#[test]
fn an_in_place_command_cut_by_a_kill_runs_once_or_reports_interrupted() {
    const N: usize = 1 << 18;
    const X: u64 = 0x80_0000;
    const Y: u64 = 0xc0_0000;
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = Arc::new(supervisor());
    let socket = endpoint(&sup, dir.path(), "ep", true);
    let mut d = Driver::new(Ours(connect(&socket)));
    d.setup_queue(0);
    let mut counters = common::workload::SaxpyCounters::new(&mut d, N, X, Y);
    for round in 0..6u64 {
        let before = sup.status("ep").expect("status").restarts;
        counters.submit(&mut d, 4);
        // Kill while the batch runs (or not: then nothing is interrupted).
        thread::sleep(Duration::from_millis(1 + round * 2));
        sup.kill_worker("ep").expect("kill");
        let st = sup
            .wait_ready("ep", before + 2, Duration::from_secs(20))
            .expect("status");
        assert_eq!(st.ready, before + 2, "a replacement serves: {st:?}");
        counters.settle(&mut d, &format!("round {round}"));
    }
    counters.check(&mut d);
    let (submitted, interrupted) = (counters.submitted, counters.interrupted);
    eprintln!("{submitted} SAXPYs, {interrupted} interrupted by kills");
}

/// Killing one endpoint's worker does not stall another endpoint's client.
#[test]
fn another_endpoint_keeps_running_while_one_worker_is_killed() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = Arc::new(supervisor());
    let a = endpoint(&sup, dir.path(), "a", true);
    let b = endpoint(&sup, dir.path(), "b", true);
    let mut da = Driver::new(Ours(connect(&a)));
    let mut db = Driver::new(Ours(connect(&b)));
    da.setup_queue(0);
    db.setup_queue(0);
    let running = Arc::new(AtomicBool::new(true));
    let kills = killer(&sup, "a", Duration::from_millis(100), running.clone());
    let mut worst = Duration::ZERO;
    let mut rounds = 0u32;
    while sup.status("a").expect("status").restarts < 5 {
        let t = Instant::now();
        db.w32(SCRATCH, rounds);
        assert_eq!(db.r32(SCRATCH), rounds);
        worst = worst.max(t.elapsed());
        // Endpoint a keeps answering too, after its stalls.
        da.w32(SCRATCH, rounds);
        assert_eq!(da.r32(SCRATCH), rounds);
        rounds += 1;
    }
    running.store(false, Ordering::SeqCst);
    kills.join().expect("killer");
    assert_eq!(
        sup.status("b").expect("status").restarts,
        0,
        "b's worker never restarted"
    );
    // Liveness, not performance: a stall of b behind a's restarts (which take ~100 ms) would
    // show as seconds here; the bound is far above any scheduling noise.
    assert!(
        worst < Duration::from_secs(2),
        "b stalled for {worst:?} while a's worker was killed"
    );
    eprintln!("{rounds} rounds; slowest register round trip on b: {worst:?}");
}

/// Mapped doorbells across kills: the guest keeps the doorbell page it mapped from the first
/// worker; every replacement serves that very page (it is in the supervisor's custody), so
/// tails stored into it, kicked or not, keep running.
#[test]
fn mapped_doorbells_keep_working_across_worker_kills() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sup = Arc::new(supervisor());
    let socket = endpoint(&sup, dir.path(), "ep", true);
    let (mut d, page) = common::supervised::mapped_driver(&socket);

    let running = Arc::new(AtomicBool::new(true));
    let kills = killer(&sup, "ep", Duration::from_millis(150), running.clone());
    let start = Instant::now();
    let (mut round, mut kicks) = (0u64, 0u64);
    while sup.status("ep").expect("status").restarts < 5 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "five restarts take too long"
        );
        let off = (round % 64) * 4096;
        let fill = (round as u32).wrapping_mul(0x0103_0507);
        let what = format!("round {round}");
        kicks += u64::from(common::workload::mapped_fill_copy_round(
            &mut d, &page, off, fill, &what,
        ));
        round += 1;
    }
    running.store(false, Ordering::SeqCst);
    kills.join().expect("killer");
    assert_eq!(
        d.r32(queue_reg(0, Q_CONTROL)),
        Q_CONTROL_ENABLE | Q_CONTROL_MAPPED,
        "the queue is still in mapped mode"
    );
    eprintln!("{round} rounds over 5 restarts, {kicks} kicks");
}
