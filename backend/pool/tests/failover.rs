//! Failover in the pool's model: a failed board is quarantined and keeps its failure (across a
//! reopen) until it is unquarantined; its endpoints are the failed leases; a failover reserves
//! a free device of the same shape on an available board, own pool first, and commits the
//! lease with a `failed_over` event.
#![forbid(unsafe_code)]

mod common;
use common::{KINDS, in_pool};
use switchyard_pool::{BoardFailure, EventKind, FailoverPolicy, Pool, PoolConfig, PoolError};

const CONFIG: &str = r#"
[daemon]
endpoint_dir = "/run/sy"

[[boards]]
id = "a"
[[boards]]
id = "b"
[[boards]]
id = "c"
[[boards]]
id = "big"
vram = "256M"

[[pools]]
name = "p"
boards = ["a", "b"]
[[pools]]
name = "q"
boards = ["c"]
failover = "off"
"#;

fn open(path: &std::path::Path) -> Pool {
    let config = PoolConfig::from_toml(CONFIG, KINDS).expect("config");
    Pool::open(&config, KINDS, path).expect("open").0
}

fn engine() -> BoardFailure {
    BoardFailure {
        reason: "the engine of queue 0 died".into(),
        state_intact: true,
    }
}

#[test]
fn a_failed_board_is_quarantined_keeps_its_failure_across_a_reopen_until_unquarantined() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    let mut pool = open(&path);
    pool.create_endpoint(&in_pool("vm1", "p")).expect("create");
    let events = pool.fail_board("a", engine()).expect("fail");
    let kinds: Vec<&EventKind> = events.iter().map(|e| &e.kind).collect();
    assert!(
        matches!(kinds[0], EventKind::BoardQuarantined { board } if board == "a"),
        "{kinds:?}"
    );
    assert!(
        matches!(kinds[1], EventKind::BoardFailed { board, state_intact: true, .. } if board == "a"),
        "{kinds:?}"
    );
    // A second report of the same failure says nothing new.
    assert!(pool.fail_board("a", engine()).expect("again").is_empty());
    let leases = pool.inventory().failed_leases();
    assert_eq!(leases.len(), 1);
    assert_eq!(leases[0].endpoint, "vm1");
    assert_eq!(leases[0].board, "a");
    assert_eq!(leases[0].policy, FailoverPolicy::Transparent);
    assert_eq!(leases[0].failure, engine());
    drop(pool);
    let mut pool = open(&path);
    let board = pool.inventory().board("a").expect("board");
    assert_eq!(board.failed, Some(engine()), "kept across a reopen");
    assert_eq!(pool.inventory().failed_leases().len(), 1);
    pool.unquarantine("a").expect("repaired");
    assert_eq!(pool.inventory().board("a").expect("board").failed, None);
    assert!(pool.inventory().failed_leases().is_empty());
}

#[test]
fn a_failover_takes_a_free_device_of_the_shape_on_a_healthy_board_and_commits_the_lease() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut pool = open(&dir.path().join("pool.redb"));
    pool.create_endpoint(&in_pool("vm1", "p")).expect("create");
    pool.fail_board("a", engine()).expect("fail");
    let (plan, _) = pool.plan_failover("vm1").expect("plan");
    // b (own pool) before c (another pool); never big (another shape).
    assert_eq!((plan.from.as_str(), plan.to.as_str()), ("a", "b"));
    assert!(
        pool.inventory().failed_leases()[0].moving,
        "reserved: in progress"
    );
    let events = pool
        .commit_failover(&plan, "transparent", 42)
        .expect("commit");
    assert!(events.iter().any(|e| matches!(
        &e.kind,
        EventKind::FailedOver { endpoint, from, to, mode, stall_ms: 42 }
            if endpoint == "vm1" && from == "a" && to == "b" && mode == "transparent"
    )));
    assert_eq!(
        pool.inventory()
            .endpoint("vm1")
            .and_then(|e| e.device.as_deref()),
        Some("b")
    );
    assert!(pool.inventory().failed_leases().is_empty());
    // b fails too: c (pool q) is the last device of the shape.
    pool.fail_board("b", engine()).expect("fail b");
    let (plan, _) = pool.plan_failover("vm1").expect("plan");
    assert_eq!(plan.to, "c");
    pool.abort_move(&plan).expect("abort");
    // With c leased, nothing is free: the endpoint waits.
    pool.create_endpoint(&in_pool("vm2", "q"))
        .expect("vm2 on c");
    let e = pool.plan_failover("vm1").expect_err("nothing free");
    assert!(matches!(e, PoolError::NoCompatibleDevice { .. }), "{e}");
    assert_eq!(pool.inventory().failover_policy("c"), FailoverPolicy::Off);
    assert_eq!(
        pool.inventory().failover_policy("big"),
        FailoverPolicy::Transparent
    );
}

#[test]
fn an_unknown_failover_policy_is_a_configuration_error_that_names_the_key() {
    let text = CONFIG.replace("failover = \"off\"", "failover = \"sometimes\"");
    let e = PoolConfig::from_toml(&text, KINDS).expect_err("refused");
    let msg = e.to_string();
    assert!(
        msg.contains("failover") || msg.contains("sometimes"),
        "{msg}"
    );
}
