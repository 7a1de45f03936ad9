//! The history's retention: the store keeps the newest `[daemon] events_keep` events and none
//! older than `events_max_age` (always the newest), prunes the rest when it commits, and says
//! up to which seq it pruned; numbering goes on as before.
#![forbid(unsafe_code)]

use std::path::Path;

use redb::{Database, TableDefinition};
use serde_json::json;

mod common;
use common::KINDS;
use switchyard_pool::{EventKind, PRUNE_BATCH, Pool, PoolConfig};

const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

fn open(daemon: &str, path: &Path) -> Pool {
    let text =
        format!("[daemon]\nendpoint_dir = \"/run/sy\"\n{daemon}\n[[boards]]\nid = \"gpu0\"\n");
    let config = PoolConfig::from_toml(&text, KINDS).expect("config");
    Pool::open(&config, KINDS, path).expect("open").0
}

fn seqs(pool: &Pool) -> Vec<u64> {
    let history = pool.history(0, usize::MAX).expect("history");
    history.iter().map(|e| e.seq).collect()
}

/// A store as the previous release left it: `n` events (quarantines of gpu0), the first
/// `old` of them a year old, none pruned.
fn previous_release_store(path: &Path, n: u64, old: u64) {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64;
    let db = Database::create(path).expect("create");
    let txn = db.begin_write().expect("write");
    {
        let mut t = txn.open_table(EVENTS).expect("events");
        for seq in 1..=n {
            let at = if seq <= old {
                now - 365 * 86_400_000
            } else {
                now
            };
            let e = json!({"seq": seq, "at_unix_ms": at,
                "kind": {"type": "board_quarantined", "board": "gpu0"}});
            t.insert(seq, serde_json::to_vec(&e).expect("json").as_slice())
                .expect("insert");
        }
        let mut t = txn.open_table(META).expect("meta");
        t.insert("format", 1).expect("format");
        t.insert("next_seq", n + 1).expect("next_seq");
    }
    txn.commit().expect("commit");
}

#[test]
fn the_history_keeps_the_newest_events_keep_events() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    let mut pool = open("events_keep = 5", &path);
    assert_eq!(seqs(&pool), [1]);
    assert_eq!(pool.pruned().expect("pruned"), 0);
    for i in 0..20 {
        if i % 2 == 0 {
            pool.quarantine("gpu0").expect("quarantine");
        } else {
            pool.unquarantine("gpu0").expect("unquarantine");
        }
    }
    assert_eq!(seqs(&pool), [17, 18, 19, 20, 21]);
    assert_eq!(pool.pruned().expect("pruned"), 16);
    // A reader of the history sees the same, and the numbering goes on across a reopen.
    assert_eq!(pool.history_reader().pruned().expect("pruned"), 16);
    assert_eq!(pool.history(3, 2).expect("history")[0].seq, 17);
    drop(pool);
    let pool = open("events_keep = 5", &path);
    assert_eq!(seqs(&pool), [18, 19, 20, 21, 22]);
    assert!(matches!(
        pool.history(21, 1).expect("history")[0].kind,
        EventKind::Opened { .. }
    ));
    assert_eq!(pool.pruned().expect("pruned"), 17);
}

#[test]
fn the_history_keeps_no_event_older_than_events_max_age() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    // Ten events, the first seven a year old.
    previous_release_store(&path, 10, 7);
    let pool = open("events_max_age = \"30d\"", &path);
    assert_eq!(seqs(&pool), [8, 9, 10, 11]);
    assert_eq!(pool.pruned().expect("pruned"), 7);
    drop(pool);
    // Every event old: the newest is kept all the same.
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    previous_release_store(&path, 4, 4);
    let mut pool = open("events_max_age = \"1m\"", &path);
    assert_eq!(seqs(&pool), [5]);
    assert_eq!(pool.pruned().expect("pruned"), 4);
    pool.quarantine("gpu0").expect("quarantine");
    assert_eq!(seqs(&pool), [5, 6]);
}

#[test]
fn an_open_prunes_everything_due_even_past_a_commits_batch() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    let n = 3 * PRUNE_BATCH as u64;
    previous_release_store(&path, n, 0);
    let pool = open("events_keep = 10", &path);
    assert_eq!(seqs(&pool), ((n - 8)..=(n + 1)).collect::<Vec<_>>());
    assert_eq!(pool.pruned().expect("pruned"), n - 9);
}
