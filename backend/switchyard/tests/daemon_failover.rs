//! Failover: a board fails under a running client (a fault injected through the daemon's
//! API, detected by the device as a real one), and the pool moves the endpoint to a healthy
//! board of its pool. The client is a real vfio-user client driving the softgpu over its
//! socket; every job's result is checked.
//!
//! Workers outlive their daemon by design, so every test kills the daemon and then every
//! worker it recorded when it ends (`common::daemon::Daemon`'s drop).
#![forbid(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::daemon::{Daemon, api_status, connect, socket_of};
use serde_json::{Value, json};
use switchyard_softgpu::regs::*;

/// `n` boards of one shape (trapped VRAM) in pool `p`, with failover `policy`.
fn boards(n: usize, policy: &str) -> String {
    let mut toml = String::new();
    for i in 0..n {
        toml +=
            &format!("[[boards]]\nid = \"g{i}\"\nvram = \"64M\"\nqueues = 2\nvram_mmap = false\n");
    }
    let ids: Vec<String> = (0..n).map(|i| format!("\"g{i}\"")).collect();
    toml += &format!(
        "[[pools]]\nname = \"p\"\nboards = [{}]\nfailover = \"{policy}\"\n",
        ids.join(", ")
    );
    toml
}

fn daemon(n: usize, policy: &str) -> Daemon {
    let mut d = Daemon::new()
        .with_config(&boards(n, policy))
        .with_args(&["--faults"]);
    d.launch();
    d
}

/// Waits until `f` holds (20 s).
fn wait(what: &str, f: impl FnMut() -> bool) {
    common::wait_until(what, Duration::from_secs(20), f);
}

fn fault(d: &Daemon, board: &str, kind: &str) {
    d.client()
        .post(
            &format!("/v1/boards/{board}/fault"),
            &json!({ "kind": kind }),
        )
        .unwrap_or_else(|e| panic!("fault {kind} on {board}: {e}"));
}

/// The value of the metric line starting with `prefix`.
fn metric(d: &Daemon, prefix: &str) -> Option<String> {
    let text = d.client().get_text("/metrics").expect("metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .map(|v| v.trim().to_owned())
}

/// The failover reconciler's completed passes (everything a pass did is committed before
/// the count moves).
fn passes(d: &Daemon) -> u64 {
    metric(d, "switchyard_failover_passes_total ")
        .and_then(|v| v.parse().ok())
        .expect("switchyard_failover_passes_total")
}

/// Waits until the reconciler has made a whole pass that started after this call: two more
/// passes complete (the first may have been under way already).
fn a_whole_pass(d: &Daemon) {
    let seen = passes(d);
    wait("a whole reconciler pass", || passes(d) >= seen + 2);
}

#[test]
fn twenty_engine_failures_across_three_boards_are_stalls_with_every_job_bit_exact() {
    let mut d = daemon(3, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    guest.setup_queue(1);
    guest.w32(SCRATCH, 0x5ca1_ab1e);
    // VRAM the device wrote before any failure stays readable after every one.
    let keep: Vec<u8> = (0..65536u32).map(|i| (i * 13 + 5) as u8).collect();
    guest.vram_write(0x300_0000, &keep);
    let mut round = 0u64;
    let mut stalls = Vec::new();
    // A failed board is repaired (unquarantined) one failover later, so that the endpoint
    // goes round all three boards.
    let mut in_repair: Option<String> = None;
    for n in 0..20 {
        let failed = d.board_of("vm1");
        for q in 0..2 {
            common::workload::fill_copy_round(&mut guest, round, q);
        }
        round += 1;
        let t0 = Instant::now();
        fault(&d, &failed, "engine");
        // The client keeps working through the failover: its jobs wait out the stall.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            for q in 0..2 {
                common::workload::fill_copy_round(&mut guest, round, q);
            }
            round += 1;
            let now = d.board_of("vm1");
            if now != failed && !now.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "failover {n}: still on {failed}");
        }
        stalls.push(t0.elapsed());
        assert_eq!(guest.r32(SCRATCH), 0x5ca1_ab1e, "failover {n}: registers");
        let board = d
            .client()
            .get(&format!("/v1/boards/{failed}"))
            .expect("board")
            .body;
        assert_eq!(board["state"], "quarantined", "{board}");
        assert!(
            board["failed"]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("engine")),
            "{board}"
        );
        assert_eq!(board["failed"]["state_intact"], true, "{board}");
        // Repaired: it may take leases again.
        if let Some(repaired) = in_repair.replace(failed) {
            d.ctl_ok(&["unquarantine", &repaired]);
        }
    }
    let mut back = vec![0u8; keep.len()];
    guest.vram_read(0x300_0000, &mut back);
    assert!(back == keep, "VRAM survives twenty failovers");
    let failed_over = d.pool_events("failed_over");
    assert_eq!(failed_over.len(), 20, "{failed_over:?}");
    assert!(
        failed_over
            .iter()
            .all(|e| e["kind"]["mode"] == "transparent")
    );
    let used: std::collections::BTreeSet<&str> = failed_over
        .iter()
        .filter_map(|e| e["kind"]["to"].as_str())
        .collect();
    assert_eq!(used.len(), 3, "every board served: {used:?}");
    assert_eq!(d.pool_events("board_failed").len(), 20);
    assert_eq!(
        metric(
            &d,
            "switchyard_failovers_total{pool=\"p\",mode=\"transparent\"}"
        )
        .as_deref(),
        Some("20")
    );
    let e = d.endpoint("vm1");
    assert_eq!(e["failover"]["last"]["mode"], "transparent", "{e}");
    assert!(e["failover"].get("pending").is_none(), "{e}");
    let stall_ms: Vec<f64> = failed_over
        .iter()
        .filter_map(|e| e["kind"]["stall_ms"].as_f64())
        .collect();
    let mut sorted = stall_ms.clone();
    sorted.sort_by(f64::total_cmp);
    eprintln!(
        "20 failovers, {round} rounds; daemon stall (report -> serving) ms: p50 {} max {}; client-seen (fault request -> new board) p50 {:?}",
        sorted[sorted.len() / 2],
        sorted[sorted.len() - 1],
        {
            stalls.sort();
            stalls[stalls.len() / 2]
        }
    );
}

#[test]
fn with_no_free_device_the_endpoint_waits_degraded_and_fails_over_once_one_is_free() {
    let mut d = daemon(2, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    d.ctl_ok(&["create", "vm2", "--pool", "p"]);
    assert_eq!(d.board_of("vm1"), "g0");
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    guest.setup_queue(1);
    common::workload::fill_copy_round(&mut guest, 1, 0);
    fault(&d, "g0", "engine");
    wait("failover_waiting", || {
        !d.pool_events("failover_waiting").is_empty()
    });
    let e = d.endpoint("vm1");
    assert!(
        e["failover"]["pending"]
            .as_str()
            .is_some_and(|p| p.contains("no device of its shape")),
        "{e}"
    );
    assert_eq!(e["lease"]["board"], "g0");
    assert_eq!(
        metric(&d, "switchyard_failovers_waiting ").as_deref(),
        Some("1")
    );
    let listed = d.ctl_ok(&["endpoint", "vm1"]);
    assert!(listed.contains("degraded"), "{listed}");
    // Said once, however long it waits: the reconciler looks at the waiting endpoint again
    // at every pass, and a pass that started after the event says nothing more.
    a_whole_pass(&d);
    assert_eq!(d.pool_events("failover_waiting").len(), 1);
    // A device becomes free: the waiting endpoint takes it.
    d.ctl_ok(&["delete", "vm2"]);
    wait("failed over to g1", || d.board_of("vm1") == "g1");
    common::workload::fill_copy_round(&mut guest, 2, 0);
    common::workload::fill_copy_round(&mut guest, 3, 1);
    assert_eq!(
        metric(&d, "switchyard_failovers_waiting ").as_deref(),
        Some("0")
    );
}

#[test]
fn with_failover_off_the_board_is_quarantined_and_the_endpoint_keeps_its_device() {
    let mut d = daemon(2, "off");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(1);
    fault(&d, "g0", "engine");
    wait("failover_refused", || {
        !d.pool_events("failover_refused").is_empty()
    });
    let refused = d.pool_events("failover_refused");
    assert!(
        refused[0]["kind"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("off")),
        "{refused:?}"
    );
    assert_eq!(d.board_of("vm1"), "g0");
    let board = d.client().get("/v1/boards/g0").expect("board").body;
    assert_eq!(board["state"], "quarantined");
    // The device's other queue still runs: only the failed engine's is dead.
    common::workload::fill_copy_round(&mut guest, 1, 1);
    assert!(d.pool_events("failed_over").is_empty());
}

#[test]
fn lost_vram_without_a_registered_vmm_cannot_fail_over_and_says_why() {
    let mut d = daemon(2, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    fault(&d, "g0", "vram");
    wait("failover_refused", || {
        !d.pool_events("failover_refused").is_empty()
    });
    let failed = d.pool_events("board_failed");
    assert_eq!(failed[0]["kind"]["state_intact"], false, "{failed:?}");
    let refused = d.pool_events("failover_refused");
    assert!(
        refused[0]["kind"]["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no VMM is registered")),
        "{refused:?}"
    );
    // The dead memory answers with errors, never with data.
    let mut buf = [0u8; 4096];
    let r = guest
        .t
        .0
        .region_read(switchyard_softgpu::BAR_VRAM, 0, &mut buf);
    assert!(r.is_err(), "a read of lost VRAM fails: {r:?}");
    assert_eq!(d.board_of("vm1"), "g0");
}

#[test]
fn fault_injection_is_refused_unless_enabled_and_where_nothing_runs() {
    let mut plain = Daemon::new().with_config(&boards(2, "transparent"));
    plain.launch();
    plain.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let r = plain
        .client()
        .post("/v1/boards/g0/fault", &json!({ "kind": "engine" }));
    assert_eq!(api_status(r), (403, "faults_disabled".into()));
    drop(plain);

    let d = daemon(2, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let r = d
        .client()
        .post("/v1/boards/g1/fault", &json!({ "kind": "engine" }));
    assert_eq!(api_status(r), (409, "idle_board".into()));
    let r = d
        .client()
        .post("/v1/boards/g0/fault", &json!({ "kind": "meteor" }));
    assert_eq!(api_status(r), (409, "fault_refused".into()));
    let r = d
        .client()
        .post("/v1/boards/nope/fault", &json!({ "kind": "engine" }));
    assert_eq!(api_status(r), (404, "not_found".into()));
    let out = d.ctl(&["fault", "g0", "meteor"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("engine") && err.contains("vram"),
        "names the faults it simulates: {err}"
    );
    // Nothing failed.
    assert!(d.pool_events("board_failed").is_empty());
}

#[test]
fn a_failure_during_a_worker_restart_still_fails_over() {
    let mut d = daemon(3, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    guest.setup_queue(1);
    common::workload::fill_copy_round(&mut guest, 0, 0);
    let ready = d.endpoint("vm1")["worker"]["ready"]
        .as_u64()
        .expect("ready");
    // A restart (SIGKILL drill) right after the fault. Either the device reported its
    // failure first (the failover's replacement and the restart's race; the endpoint ends on
    // another board), or the restart took the dying engine's process down before it could
    // (the replacement's engines are whole: nothing failed). Both leave a working device.
    fault(&d, "g0", "engine");
    let _ = d.ctl(&["restart", "vm1"]);
    for round in 1..6 {
        common::workload::fill_copy_round(&mut guest, round, round as u32 % 2);
    }
    // A worker newer than the faulted one serves: the daemon read everything the faulted one
    // sent (its notes are read until its channel closes, before a replacement starts), so a
    // report it got out shows the endpoint's failover pending from then until it is done.
    wait("a newer worker serves", || {
        let w = d.endpoint("vm1")["worker"].clone();
        w["state"] == "running" && w["ready"].as_u64().is_some_and(|r| r > ready)
    });
    wait("no failover pending", || {
        d.endpoint("vm1")
            .get("failover")
            .is_none_or(|f| f.get("pending").is_none())
    });
    assert_eq!(
        d.pool_events("board_failed").len(),
        d.pool_events("failed_over").len(),
        "every recorded failure failed over"
    );
    let failed = d.pool_events("board_failed").len();
    assert!(failed <= 1, "one fault, at most one failure");
    assert_eq!(d.board_of("vm1") != "g0", failed == 1);
    for round in 6..10 {
        common::workload::fill_copy_round(&mut guest, round, round as u32 % 2);
    }
    eprintln!("fault + restart: {failed} failover(s)");
}

/// A board failure outlives the daemon that recorded it: a daemon whose pool does not fail
/// over records it; the next one, whose pool does, adopts the worker and fails the endpoint
/// over under the connected client.
#[test]
fn a_board_failure_recorded_by_one_daemon_is_failed_over_by_the_next() {
    let mut d = daemon(2, "off");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(1);
    common::workload::fill_copy_round(&mut guest, 0, 1);
    fault(&d, "g0", "engine");
    wait("failover_refused", || {
        !d.pool_events("failover_refused").is_empty()
    });
    d.kill9();
    d.set_config(&boards(2, "transparent"));
    d.launch();
    wait("failed over to g1", || d.board_of("vm1") == "g1");
    // Queue 0's engine was the dead one: on the new board it runs again.
    guest.setup_queue(0);
    for round in 1..6 {
        common::workload::fill_copy_round(&mut guest, round, round as u32 % 2);
    }
    let e = d.endpoint("vm1");
    assert_eq!(e["worker"]["state"], "running", "{e}");
}

/// In-place SAXPY counters (y += x, x all ones) across failovers: each command runs exactly
/// once, or its queue reports ERR_INTERRUPTED (a command cut by the failure is never run
/// twice), and the daemon counts what the replacements replayed and interrupted.
#[test]
fn an_in_place_command_cut_by_a_failover_runs_once_or_reports_interrupted() {
    const N: usize = 1 << 18;
    const X: u64 = 0x80_0000;
    const Y: u64 = 0xc0_0000;
    let mut d = daemon(3, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    let mut counters = common::workload::SaxpyCounters::new(&mut guest, N, X, Y);
    let mut in_repair: Option<String> = None;
    for round in 0..4 {
        let board = d.board_of("vm1");
        counters.submit(&mut guest, 8);
        // The engine dies while it runs one of them (the fault picks a busy engine).
        fault(&d, &board, "engine");
        wait("failed over", || d.board_of("vm1") != board);
        if let Some(repaired) = in_repair.replace(board) {
            d.ctl_ok(&["unquarantine", &repaired]);
        }
        counters.settle(&mut guest, &format!("round {round}"));
    }
    counters.check(&mut guest);
    let (submitted, interrupted) = (counters.submitted, counters.interrupted);
    // The workers report every second: the counts reach the metrics.
    let counted = |name: &str| -> u64 {
        let text = d.client().get_text("/metrics").expect("metrics");
        text.lines()
            .filter(|l| l.starts_with(&format!("switchyard_board_jobs_{name}_total{{")))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum()
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while counted("interrupted") != u64::from(interrupted) {
        assert!(
            Instant::now() < deadline,
            "{interrupted} interruptions seen, metrics:\n{}",
            d.client().get_text("/metrics").expect("metrics")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    eprintln!(
        "{submitted} SAXPYs over 4 failovers: {interrupted} interrupted, {} replayed",
        counted("replayed")
    );
}

/// A board failing around a move of its endpoint. A fault is refused while the move runs (it
/// could land on either board); a failure just before a move: the move and the failover
/// race for the endpoint, one of them is refused. Either way the endpoint ends on a healthy
/// board, its VRAM intact and every job checked.
#[test]
fn a_failure_around_a_move_ends_on_a_healthy_board() {
    let mut d = daemon(3, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    guest.setup_queue(1);
    // VRAM worth copying, so that a move takes a while.
    let data: Vec<u8> = (0..(8u32 << 20)).map(|i| (i * 31 + 7) as u8).collect();
    guest.vram_write(0x100_0000, &data);
    common::workload::fill_copy_round(&mut guest, 0, 0);
    // A fault while a move runs: refused, or in before or after it.
    let mut refused = 0;
    let mover = {
        let client = d.client();
        std::thread::spawn(move || client.post("/v1/endpoints/vm1/move", &json!({ "to": "g1" })))
    };
    loop {
        let r = d
            .client()
            .post("/v1/boards/g0/fault", &json!({ "kind": "engine" }));
        match r {
            Ok(_) => break,
            Err(e) => match api_status(Err(e)) {
                (409, code) if code == "moving" => refused += 1,
                // The move finished between two looks: nothing runs on g0 any more.
                (409, code) if code == "idle_board" => break,
                other => panic!("a fault during a move: {other:?}"),
            },
        }
        if d.board_of("vm1") == "g1" {
            break; // moved before any fault got in
        }
    }
    let moved = mover.join().expect("mover");
    // A failure, then a move at once.
    let board = d.board_of("vm1");
    let _ = d.client().post(
        &format!("/v1/boards/{board}/fault"),
        &json!({ "kind": "engine" }),
    );
    let to = if board == "g2" { "g0" } else { "g2" };
    let second = d
        .client()
        .post("/v1/endpoints/vm1/move", &json!({ "to": to }));
    wait("no failover pending, on a healthy board", || {
        let e = d.endpoint("vm1");
        let board = e["lease"]["board"].as_str().unwrap_or_default().to_owned();
        let healthy = d
            .client()
            .get(&format!("/v1/boards/{board}"))
            .is_ok_and(|b| b.body.get("failed").is_none());
        healthy && e.get("failover").is_none_or(|f| f.get("pending").is_none())
    });
    for round in 1..6 {
        common::workload::fill_copy_round(&mut guest, round, round as u32 % 2);
    }
    let mut back = vec![0u8; data.len()];
    guest.vram_read(0x100_0000, &mut back);
    assert!(back == data, "VRAM intact after the moves and the failures");
    eprintln!(
        "first move: {} ({refused} faults refused meanwhile); second move: {}; failovers: {}",
        moved.map_or_else(
            |e| e.to_string(),
            |r| r.body["plan"]["to_board"].to_string()
        ),
        second.map_or_else(
            |e| e.to_string(),
            |r| r.body["plan"]["to_board"].to_string()
        ),
        d.pool_events("failed_over").len()
    );
}

/// A fault accepted for board X goes to the endpoint's worker only while that worker runs
/// X's device: two faults on X a moment apart, and the second must not land on the board
/// the first failed the endpoint over to (before, 10 of 45 such pairs quarantined a healthy
/// board and failed the endpoint over again). Every failure recorded is X's.
#[test]
fn a_second_fault_for_a_board_never_lands_on_the_board_its_endpoint_failed_over_to() {
    let mut d = daemon(3, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    guest.setup_queue(1);
    let mut failed_boards = Vec::new();
    for n in 0..8u64 {
        let x = d.board_of("vm1");
        common::workload::fill_copy_round(&mut guest, n, 0);
        fault(&d, &x, "engine");
        // At once again: the endpoint may be on X still (the fault lands there: X is failed
        // already), or on its new board (refused, or X idle): never on the new board.
        let (status, body) = match d.client().post(
            &format!("/v1/boards/{x}/fault"),
            &json!({ "kind": "engine" }),
        ) {
            Ok(reply) => (reply.status, reply.body.to_string()),
            Err(e) => api_status(Err(e)),
        };
        assert!(
            status == 200 || body.contains("idle_board") || body.contains("fault_refused"),
            "round {n}: {status} {body}"
        );
        wait("failed over", || {
            let now = d.board_of("vm1");
            now != x && !now.is_empty()
        });
        failed_boards.push(x.clone());
        common::workload::fill_copy_round(&mut guest, n, 1);
        // The new board is healthy and the endpoint stays there.
        let y = d.board_of("vm1");
        let board: Value = d
            .client()
            .get(&format!("/v1/boards/{y}"))
            .expect("board")
            .body;
        assert_eq!(board["state"], "available", "round {n}: {board}");
        d.ctl_ok(&["unquarantine", &x]);
    }
    let recorded: Vec<String> = d
        .pool_events("board_failed")
        .iter()
        .filter_map(|e| e["kind"]["board"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(recorded, failed_boards, "only the boards faulted failed");
    assert_eq!(d.pool_events("failed_over").len(), failed_boards.len());
}

/// Unquarantining a failed board while its endpoint waits on it, degraded, declares it
/// repaired: the endpoint's worker is replaced there and the device serves again (before,
/// the failure was cleared and the dead engine stayed, shown healthy).
#[test]
fn unquarantining_a_failed_board_repairs_the_endpoint_waiting_on_it() {
    let mut d = daemon(1, "transparent");
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    guest.setup_queue(1);
    common::workload::fill_copy_round(&mut guest, 0, 0);
    let ready = d.endpoint("vm1")["worker"]["ready"]
        .as_u64()
        .expect("ready");
    fault(&d, "g0", "engine");
    wait("failover_waiting", || {
        !d.pool_events("failover_waiting").is_empty()
    });
    d.ctl_ok(&["unquarantine", "g0"]);
    wait("the worker replaced", || {
        d.endpoint("vm1")["worker"]["ready"]
            .as_u64()
            .is_some_and(|r| r > ready)
    });
    // Both queues serve again (the engine that died is a new one), on g0.
    common::workload::fill_copy_round(&mut guest, 1, 0);
    common::workload::fill_copy_round(&mut guest, 2, 1);
    let e = d.endpoint("vm1");
    assert_eq!(e["lease"]["board"], "g0", "{e}");
    assert!(e["failover"].get("pending").is_none(), "{e}");
}

/// A daemon killed inside a transparent failover's window (a test knob stops it there):
/// after the target is reserved and before the worker is asked (`failover-planned`), and
/// after the worker is asked to continue on the target and before the daemon hears it did
/// (`failover-asked`). Before, the worker was killed and replaced from what the daemon held:
/// a daemon killed between the two took the guest's connection and the device's state with
/// it. Now the worker re-executes in place, so its process holds everything at every
/// instant: the next daemon adopts it, commits the failover it finished or aborts the one it
/// never got and fails over anew. Either way: the guest's connection lives, its registers and
/// VRAM are intact, and exactly one failover is recorded.
#[test]
fn a_daemon_killed_inside_a_failover_leaves_the_guest_its_device_and_fails_over_once() {
    for point in ["failover-planned", "failover-asked"] {
        let mut d = Daemon::new()
            .with_config(&boards(2, "transparent"))
            .with_args(&["--faults"])
            .with_env("SWITCHYARD_TEST_PAUSE", point);
        d.launch();
        d.ctl_ok(&["create", "vm1", "--pool", "p"]);
        let mut guest = connect(&socket_of(&d.endpoint("vm1")));
        guest.setup_queue(0);
        guest.setup_queue(1);
        guest.w32(SCRATCH, 0x0dd_ba11);
        let keep: Vec<u8> = (0..65536u32).map(|i| (i * 29 + 3) as u8).collect();
        guest.vram_write(0x300_0000, &keep);
        common::workload::fill_copy_round(&mut guest, 0, 0);
        let pid = d.endpoint("vm1")["worker"]["pid"].as_u64().expect("pid");
        fault(&d, "g0", "engine");
        wait(&format!("{point}: paused"), || {
            d.log().contains("test knob: paused here for good")
        });
        d.kill9();
        d.clear_env();
        d.launch();
        wait(&format!("{point}: failed over to g1"), || {
            d.board_of("vm1") == "g1"
        });
        // The connection never reset: the same client goes on, state intact.
        assert_eq!(guest.r32(SCRATCH), 0x0dd_ba11, "{point}: registers");
        let mut back = vec![0u8; keep.len()];
        guest.vram_read(0x300_0000, &mut back);
        assert!(back == keep, "{point}: VRAM survives");
        common::workload::fill_copy_round(&mut guest, 1, 0);
        common::workload::fill_copy_round(&mut guest, 2, 1);
        assert_eq!(
            d.pool_events("failed_over").len(),
            1,
            "{point}: one failover"
        );
        assert_eq!(d.pool_events("board_failed").len(), 1, "{point}");
        let e = d.endpoint("vm1");
        assert_eq!(e["worker"]["state"], "running", "{point}: {e}");
        if point == "failover-asked" {
            // The worker continued in place: the same process, in its new image.
            assert_eq!(e["worker"]["pid"].as_u64(), Some(pid), "{point}: {e}");
        }
    }
}
