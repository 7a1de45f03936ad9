//! The store: reopening restores the state exactly, refused operations leave the file
//! untouched, the configuration is reconciled, and a process killed with SIGKILL while it
//! commits restarts into a prefix of its committed mutations.
#![forbid(unsafe_code)]

use std::collections::HashSet;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod common;
use common::{KINDS, config, in_pool, on_device};
use switchyard_pool::{BoardState, EndpointSpec, ErrorKind, EventKind, Placement, Pool, PoolError};

const CONFIG: &str = r#"
[daemon]
endpoint_dir = "/run/sy"

[[boards]]
id = "gpu0"
[[boards]]
id = "gpu1"
[[boards]]
id = "gpu2"
[[boards]]
id = "big"
vram = "256M"
queues = 4
partitions = [ { id = "big.0", vram = "128M", queues = 2 }, { id = "big.1", vram = "128M", queues = 2 } ]

[[pools]]
name = "default"
boards = ["gpu0", "gpu1", "gpu2"]
"#;

fn open(text: &str, path: &Path) -> Pool {
    Pool::open(&config(text), KINDS, path).expect("open").0
}

fn store() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    (dir, path)
}

/// Endpoints (every field) and board states.
fn state(pool: &Pool) -> String {
    let inv = pool.inventory();
    let endpoints: Vec<_> = inv.endpoints().collect();
    serde_json::to_string(&(endpoints, inv.boards())).expect("json")
}

fn has_event(pool: &Pool, kind: EventKind) -> bool {
    let history = pool.history(0, usize::MAX).expect("history");
    history.iter().any(|e| e.kind == kind)
}

fn lease(pool: &Pool, endpoint: &str) -> Option<String> {
    pool.inventory()
        .endpoint(endpoint)
        .expect("endpoint")
        .device
        .clone()
}

#[test]
fn reopening_restores_every_lease_exactly() {
    let (_dir, path) = store();
    let mut pool = open(CONFIG, &path);
    pool.create_endpoint(&in_pool("vm1", "default"))
        .expect("vm1");
    pool.create_endpoint(&in_pool("vm2", "default"))
        .expect("vm2");
    pool.create_endpoint(&on_device("vm3", "big.1"))
        .expect("vm3");
    pool.create_endpoint(&on_device("vm4", "big.0"))
        .expect("vm4");
    let (plan, _) = pool.plan_move("vm1", "gpu2").expect("plan");
    pool.commit_move(&plan).expect("commit");
    pool.detach("vm4").expect("detach");
    let (pending, _) = pool.plan_move("vm2", "gpu0").expect("pending move");
    pool.quarantine("gpu0").expect("quarantine");
    let before = state(&pool);
    let seq = pool.inventory().next_seq();
    drop(pool);

    let (pool, report) = Pool::open(&config(CONFIG), KINDS, &path).expect("reopen");
    assert_eq!(state(&pool), before);
    assert_eq!(lease(&pool, "vm1").as_deref(), Some("gpu2"));
    assert_eq!(lease(&pool, "vm2").as_deref(), Some("gpu1"));
    assert_eq!(lease(&pool, "vm3").as_deref(), Some("big.1"));
    assert_eq!(lease(&pool, "vm4"), None);
    assert_eq!(
        pool.inventory().board("gpu0").expect("gpu0").state,
        BoardState::Quarantined
    );
    assert_eq!(report.pending_moves, vec![pending]);
    assert!(report.added_boards.is_empty() && report.removed_boards.is_empty());
    // The history continues without a gap: the restart is one `opened` event.
    let history = pool.history(0, usize::MAX).expect("history");
    let seqs: Vec<u64> = history.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seq).collect::<Vec<_>>());
    assert!(matches!(
        history.last().map(|e| &e.kind),
        Some(EventKind::Opened {
            boards: 4,
            endpoints: 4
        })
    ));
    let page = pool.history(3, 2).expect("page");
    assert_eq!(page.iter().map(|e| e.seq).collect::<Vec<_>>(), [4, 5]);
    assert!(pool.history(seq, 10).expect("end").is_empty());
}

#[test]
fn a_refused_operation_leaves_the_file_unchanged() {
    let (_dir, path) = store();
    let mut pool = open(CONFIG, &path);
    pool.create_endpoint(&in_pool("vm1", "default"))
        .expect("vm1");
    let bytes = std::fs::read(&path).expect("read");
    let before = state(&pool);
    let refusals: Vec<PoolError> = vec![
        pool.create_endpoint(&in_pool("vm1", "default"))
            .expect_err("duplicate"),
        pool.create_endpoint(&on_device("vm2", "gpu0"))
            .expect_err("busy"),
        pool.plan_move("vm1", "big.0").expect_err("shape"),
        pool.delete_endpoint("nope").expect_err("unknown"),
        pool.attach("vm1", &Placement::default())
            .expect_err("attached"),
        pool.quarantine("nope").expect_err("unknown board"),
        pool.drain("nope").expect_err("unknown board"),
    ];
    assert!(refusals.iter().all(|e| e.kind() != ErrorKind::Internal));
    // Idempotent no-ops and queries write nothing either.
    assert!(pool.unquarantine("gpu1").expect("no-op").is_empty());
    pool.history(0, 100).expect("history");
    pool.check_move("vm1", "gpu1").expect("dry run");
    pool.plan_drain("gpu0").expect("dry run");
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "file changed");
    assert_eq!(state(&pool), before);
    // Positive control: a successful mutation does change the file.
    pool.detach("vm1").expect("detach");
    assert_ne!(std::fs::read(&path).expect("read"), bytes);
}

#[test]
fn the_store_is_locked_to_one_pool() {
    let (_dir, path) = store();
    let _pool = open(CONFIG, &path);
    let e = Pool::open(&config(CONFIG), KINDS, &path).expect_err("second open");
    assert_eq!(e.kind(), ErrorKind::Internal, "{e}");
    assert!(
        e.to_string().starts_with("Cannot open the pool store"),
        "{e}"
    );
}

#[test]
fn reconcile_adds_new_boards_and_keeps_quarantines() {
    let (_dir, path) = store();
    let mut pool = open(CONFIG, &path);
    pool.quarantine("gpu1").expect("quarantine");
    drop(pool);
    let more = format!("{CONFIG}[[boards]]\nid = \"gpu3\"\n").replace(
        "boards = [\"gpu0\", \"gpu1\", \"gpu2\"]",
        "boards = [\"gpu0\", \"gpu1\", \"gpu2\", \"gpu3\"]",
    );
    let (pool, report) = Pool::open(&config(&more), KINDS, &path).expect("reopen");
    assert_eq!(report.added_boards, ["gpu3"]);
    let gpu3 = pool.inventory().board("gpu3").expect("gpu3");
    assert_eq!(
        (gpu3.state, gpu3.pool.as_deref()),
        (BoardState::Available, Some("default"))
    );
    assert_eq!(
        pool.inventory().board("gpu1").expect("gpu1").state,
        BoardState::Quarantined
    );
    assert!(has_event(
        &pool,
        EventKind::BoardAdded {
            board: "gpu3".into()
        }
    ));
}

#[test]
fn reconcile_keeps_a_removed_board_while_it_is_leased() {
    let (_dir, path) = store();
    let mut pool = open(CONFIG, &path);
    pool.create_endpoint(&on_device("vm1", "big.1"))
        .expect("vm1");
    drop(pool);
    // `big` leaves the configuration (and `gpu2`, unleased, too).
    let fewer = CONFIG
        .split("[[boards]]\nid = \"big\"")
        .next()
        .expect("prefix")
        .replace("[[boards]]\nid = \"gpu2\"\n", "")
        + "[[pools]]\nname = \"default\"\nboards = [\"gpu0\", \"gpu1\"]\n";
    let (mut pool, report) = Pool::open(&config(&fewer), KINDS, &path).expect("reopen");
    assert_eq!(report.missing_boards, ["big"]);
    assert_eq!(report.removed_boards, ["gpu2"]);
    let big = pool.inventory().board("big").expect("kept");
    assert_eq!(big.state, BoardState::Missing);
    assert_eq!(big.devices[1].endpoint.as_deref(), Some("vm1"));
    assert!(pool.inventory().board("gpu2").is_none());
    assert_eq!(lease(&pool, "vm1").as_deref(), Some("big.1"));
    assert!(has_event(
        &pool,
        EventKind::BoardMissing {
            board: "big".into(),
            endpoints: vec!["vm1".into()]
        }
    ));
    // A missing board takes no new lease.
    let e = pool
        .create_endpoint(&on_device("vm2", "big.0"))
        .expect_err("missing");
    assert!(
        matches!(
            e,
            PoolError::BoardUnavailable {
                state: BoardState::Missing,
                ..
            }
        ),
        "{e}"
    );
    // Still missing after another restart; once unleased, forgotten at the next.
    drop(pool);
    let (mut pool, report) = Pool::open(&config(&fewer), KINDS, &path).expect("reopen");
    assert_eq!(report.missing_boards, ["big"]);
    pool.detach("vm1").expect("detach");
    drop(pool);
    let (pool, report) = Pool::open(&config(&fewer), KINDS, &path).expect("reopen");
    assert_eq!(report.removed_boards, ["big"]);
    assert!(pool.inventory().board("big").is_none());
    // And a board that returns is available again.
    drop(pool);
    let (pool, report) = Pool::open(&config(CONFIG), KINDS, &path).expect("reopen");
    assert_eq!(report.added_boards, ["gpu2", "big"]);
    assert_eq!(
        pool.inventory().board("big").expect("big").state,
        BoardState::Available
    );
}

#[test]
fn reconcile_refuses_a_kept_board_whose_id_is_reused() {
    let (_dir, path) = store();
    let mut pool = open(CONFIG, &path);
    pool.create_endpoint(&on_device("vm1", "big.0"))
        .expect("vm1");
    drop(pool);
    // `big` is gone but leased, and its partition's id is now a board's.
    let reused = CONFIG
        .split("[[boards]]\nid = \"big\"")
        .next()
        .expect("prefix")
        .to_owned()
        + "[[boards]]\nid = \"big.0\"\n[[pools]]\nname = \"default\"\nboards = [\"gpu0\"]\n";
    let e = Pool::open(&config(&reused), KINDS, &path).expect_err("collision");
    assert_eq!(e.kind(), ErrorKind::Conflict);
    assert!(
        e.to_string()
            .contains("has the id \"big.0\" of board \"big.0\""),
        "{e}"
    );
}

#[test]
fn a_missing_board_that_returns_is_reported() {
    let (_dir, path) = store();
    let mut pool = open(CONFIG, &path);
    pool.create_endpoint(&on_device("vm1", "gpu2"))
        .expect("vm1");
    drop(pool);
    let without = CONFIG
        .replace("[[boards]]\nid = \"gpu2\"\n", "")
        .replace("\"gpu1\", \"gpu2\"", "\"gpu1\"");
    let (pool, _) = Pool::open(&config(&without), KINDS, &path).expect("reopen");
    assert_eq!(
        pool.inventory().board("gpu2").expect("gpu2").state,
        BoardState::Missing
    );
    drop(pool);
    let (pool, _) = Pool::open(&config(CONFIG), KINDS, &path).expect("reopen");
    assert_eq!(
        pool.inventory().board("gpu2").expect("gpu2").state,
        BoardState::Available
    );
    assert_eq!(lease(&pool, "vm1").as_deref(), Some("gpu2"));
    assert!(has_event(
        &pool,
        EventKind::BoardReturned {
            board: "gpu2".into()
        }
    ));
}

#[test]
fn reconcile_refuses_a_leased_device_that_changed_or_vanished() {
    let (_dir, path) = store();
    let mut pool = open(CONFIG, &path);
    pool.create_endpoint(&on_device("vm1", "gpu1"))
        .expect("vm1");
    pool.create_endpoint(&on_device("vm2", "big.1"))
        .expect("vm2");
    drop(pool);
    let bytes = std::fs::read(&path).expect("read");
    let bigger = CONFIG.replacen(
        "[[boards]]\nid = \"gpu1\"\n",
        "[[boards]]\nid = \"gpu1\"\nvram = \"128M\"\n",
        1,
    );
    // (gpu1 is then unlike its pool: take it out of the pool.)
    let bigger = bigger.replace("\"gpu0\", \"gpu1\", \"gpu2\"", "\"gpu0\", \"gpu2\"");
    let e = Pool::open(&config(&bigger), KINDS, &path).expect_err("changed");
    assert_eq!(e.kind(), ErrorKind::Conflict);
    assert!(
        e.to_string().contains(
            "endpoint \"vm1\" holds device \"gpu1\", whose configuration changed in memory (128 MiB vs 64 MiB)"
        ),
        "{e}"
    );
    let one_part = CONFIG.replace(", { id = \"big.1\", vram = \"128M\", queues = 2 }", "");
    let e = Pool::open(&config(&one_part), KINDS, &path).expect_err("vanished");
    assert!(
        e.to_string().contains(
            "endpoint \"vm2\" holds device \"big.1\", which the configuration no longer has"
        ),
        "{e}"
    );
    assert_eq!(std::fs::read(&path).expect("read"), bytes, "file changed");
    // The original configuration still opens it (positive control).
    let pool = open(CONFIG, &path);
    assert_eq!(lease(&pool, "vm2").as_deref(), Some("big.1"));
}

#[test]
fn configured_endpoints_are_created_only_when_absent() {
    let (_dir, path) = store();
    let with = format!(
        "{CONFIG}[[endpoints]]\nid = \"vm1\"\npool = \"default\"\n\
         [[endpoints]]\nid = \"vm2\"\ndevice = \"big.0\"\nmin_vram = \"256M\"\n"
    );
    let (mut pool, report) = Pool::open(&config(&with), KINDS, &path).expect("open");
    assert_eq!(report.created_endpoints, ["vm1"]);
    assert_eq!(report.failed_endpoints.len(), 1);
    assert_eq!(report.failed_endpoints[0].endpoint, "vm2");
    assert!(
        report.failed_endpoints[0]
            .error
            .contains("does not meet the requirements"),
        "{:?}",
        report.failed_endpoints
    );
    assert_eq!(lease(&pool, "vm1").as_deref(), Some("gpu0"));
    let (plan, _) = pool.plan_move("vm1", "gpu1").expect("plan");
    pool.commit_move(&plan).expect("commit");
    drop(pool);
    // Present: kept as it is (moved), not re-created.
    let (mut pool, report) = Pool::open(&config(&with), KINDS, &path).expect("reopen");
    assert!(report.created_endpoints.is_empty());
    assert_eq!(lease(&pool, "vm1").as_deref(), Some("gpu1"));
    // Deleted: created again at the next start.
    pool.delete_endpoint("vm1").expect("delete");
    drop(pool);
    let (pool, report) = Pool::open(&config(&with), KINDS, &path).expect("reopen");
    assert_eq!(report.created_endpoints, ["vm1"]);
    assert_eq!(lease(&pool, "vm1").as_deref(), Some("gpu0"));
}

// ---- SIGKILL while committing ----

const CHILD_ENV: &str = "SWITCHYARD_POOL_CRASH_CHILD";

/// Step `i` of an endless, deterministic stream of mutations on four boards: create,
/// plan a move, commit it, detach, attach, delete the previous round's endpoint, toggle a
/// quarantine. Refusals are part of the stream (they are deterministic too).
fn step(pool: &mut Pool, i: u64) {
    let (n, k) = (i / 7, i % 7);
    let me = format!("e{n}");
    let _ = match k {
        0 => pool.create_endpoint(&EndpointSpec {
            id: me,
            pool: Some("default".into()),
            ..EndpointSpec::default()
        }),
        1 => {
            let free = pool
                .inventory()
                .boards()
                .into_iter()
                .flat_map(|b| b.devices)
                .find(|d| {
                    d.state == BoardState::Available
                        && d.endpoint.is_none()
                        && d.reserved_for.is_none()
                        && d.shape.memory() == 64 << 20
                })
                .map(|d| d.id);
            match free {
                Some(to) => pool.plan_move(&me, &to).map(|(_, ev)| ev),
                None => Ok(Vec::new()),
            }
        }
        2 => match pool.inventory().pending_move(&me) {
            Some(plan) => pool.commit_move(&plan),
            None => Ok(Vec::new()),
        },
        3 => pool.detach(&me),
        4 => pool.attach(&me, &Placement::default()),
        5 => match n.checked_sub(1) {
            Some(prev) => pool.delete_endpoint(&format!("e{prev}")),
            None => Ok(Vec::new()),
        },
        _ => {
            let board = format!("gpu{}", n % 4);
            if n % 2 == 0 {
                pool.quarantine(&board)
            } else {
                pool.unquarantine(&format!("gpu{}", (n - 1) % 4))
            }
        }
    };
}

const CRASH_CONFIG: &str = r#"
[daemon]
endpoint_dir = "/run/sy"
[[boards]]
id = "gpu0"
[[boards]]
id = "gpu1"
[[boards]]
id = "gpu2"
[[boards]]
id = "gpu3"
[[pools]]
name = "default"
boards = ["gpu0", "gpu1", "gpu2", "gpu3"]
"#;

/// The child: commits steps forever, reporting each after it returned. Runs only when the
/// parent test re-executes this binary with `CHILD_ENV` set (and `--include-ignored`: on its
/// own it is no test).
#[test]
#[ignore = "child process of sigkill_while_committing_restarts_into_a_prefix"]
fn crash_child() {
    let Some(path) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let mut pool = open(CRASH_CONFIG, Path::new(&path));
    let mut out = std::io::stdout().lock();
    for i in 0.. {
        step(&mut pool, i);
        writeln!(out, "done {i}").expect("stdout");
        out.flush().expect("flush");
    }
}

/// Leases (endpoint, device, moving_to, pool) and board states: what must survive.
fn leases(pool: &Pool) -> String {
    let inv = pool.inventory();
    let endpoints: Vec<_> = inv
        .endpoints()
        .map(|e| (&e.id, &e.device, &e.moving_to, &e.pool, &e.socket))
        .collect();
    let boards: Vec<_> = inv.boards().into_iter().map(|b| (b.id, b.state)).collect();
    serde_json::to_string(&(endpoints, boards)).expect("json")
}

/// No device held or reserved twice; every held device exists and its view agrees.
fn assert_consistent(pool: &Pool) {
    let inv = pool.inventory();
    let mut held = HashSet::new();
    for e in inv.endpoints() {
        for d in [&e.device, &e.moving_to].into_iter().flatten() {
            assert!(held.insert(d.clone()), "device {d} held twice");
            let view = inv.device(d).expect("held device exists");
            assert!(
                view.endpoint.as_deref() == Some(e.id.as_str())
                    || view.reserved_for.as_deref() == Some(e.id.as_str()),
                "{view:?} disagrees with {e:?}"
            );
        }
    }
}

fn crash_once(kill_after: u64, then_ms: u64) {
    let (_dir, path) = store();
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args([
            "crash_child",
            "--exact",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the child");
    let stdout = child.stdout.take().expect("stdout");
    let mut acked = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.expect("line");
        if let Some(i) = line
            .strip_prefix("done ")
            .and_then(|n| n.parse::<u64>().ok())
        {
            acked = Some(i);
            if i >= kill_after {
                break;
            }
        }
    }
    // SIGKILL while the child is committing the next steps (it goes on in the meantime:
    // its output waits in the pipe).
    std::thread::sleep(std::time::Duration::from_millis(then_ms));
    child.kill().expect("SIGKILL");
    child.wait().expect("reap");
    let acked = acked.expect("the child committed steps");

    let (crashed, _) =
        Pool::open(&config(CRASH_CONFIG), KINDS, &path).expect("reopen after SIGKILL");
    assert_consistent(&crashed);
    let mut history = crashed.history(0, usize::MAX).expect("history");
    assert!(matches!(
        history.pop().map(|e| e.kind),
        Some(EventKind::Opened { .. })
    ));
    let kinds = |h: &[switchyard_pool::Event]| -> Vec<(u64, EventKind)> {
        h.iter().map(|e| (e.seq, e.kind.clone())).collect()
    };
    let want_history = kinds(&history);
    let want_leases = leases(&crashed);

    // Replay the same stream on a fresh store until it matches: the crashed state must be
    // the state after some number of whole steps, at least every acknowledged one.
    let (_replay_dir, replay_path) = store();
    let mut replay = open(CRASH_CONFIG, &replay_path);
    let mut steps = 0;
    loop {
        let h = replay.history(0, usize::MAX).expect("history");
        if kinds(&h) == want_history && leases(&replay) == want_leases {
            break;
        }
        assert!(
            h.len() <= want_history.len(),
            "the crashed state is no prefix of the stream (after {steps} steps)"
        );
        step(&mut replay, steps);
        steps += 1;
    }
    // The stream moved leases before the kill (it is not just creates and deletes).
    assert!(
        want_history
            .iter()
            .any(|(_, k)| matches!(k, EventKind::LeaseMoved { .. })),
        "no move before the kill"
    );
    // A step with no event cannot be told apart from the next, so the match may come one
    // step early only if that step produced nothing.
    assert!(
        steps > acked
            || (steps..=acked).all(|i| {
                let before = replay.inventory().next_seq();
                step(&mut replay, i);
                replay.inventory().next_seq() == before
            }),
        "acknowledged step {acked} lost: the crashed state is after {steps} steps"
    );
}

#[test]
fn sigkill_while_committing_restarts_into_a_prefix() {
    for (kill_after, then_ms) in [(20, 0), (45, 7), (70, 23)] {
        crash_once(kill_after, then_ms);
    }
}
