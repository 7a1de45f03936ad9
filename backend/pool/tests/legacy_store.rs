//! A store written before device kinds (shapes of softgpu settings, a passthrough board's
//! `host` on the board, partitions as a VRAM size and queues, the same in the history's move
//! plans) still opens: its boards get the options their kind gives them, its leases and
//! quarantines are kept, its history decodes, and the records are written again in the
//! current form.
#![forbid(unsafe_code)]

use std::path::Path;

use redb::{Database, ReadableTable, TableDefinition};
use serde_json::json;

mod common;
use common::{KINDS, config, on_device};
use switchyard_pool::{BoardState, EventKind, Pool, PoolError};

const BOARDS: TableDefinition<&str, &[u8]> = TableDefinition::new("boards");
const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// A softgpu shape as the previous version wrote it.
fn old_shape(vram: u64, queues: u32, irq: &str) -> serde_json::Value {
    json!({
        "model": "softgpu", "vram_size": vram, "queues": queues, "irq": irq,
        "vram_mmap": true, "keep_vram_on_reset": false
    })
}

fn endpoint(id: &str, device: &str) -> serde_json::Value {
    json!({
        "id": id, "socket": format!("/run/sy/{id}.sock"),
        "requirements": {"min_vram": 0, "min_queues": 0},
        "pool": null, "device": device, "moving_to": null, "created_unix_ms": 1
    })
}

/// Writes the previous version's records: gpu0 (quarantined), p0 (256 MiB, MSI, two
/// partitions), edu0 (passthrough), gone (no longer configured, leased by vm3); vm1 on
/// p0.1, vm2 on edu0; two events, the second a drain with a move plan.
fn write_old_store(path: &Path) {
    let boards = [
        (
            "gpu0",
            json!({"def": {"id": "gpu0", "shape": old_shape(64 << 20, 2, "msix"), "partitions": []},
                   "quarantined": true, "missing": false}),
        ),
        (
            "p0",
            json!({"def": {"id": "p0", "shape": old_shape(256 << 20, 4, "msi"), "partitions": [
                       {"id": "p0.0", "vram_size": 128 << 20, "queues": 2},
                       {"id": "p0.1", "vram_size": 128 << 20, "queues": 2}]},
                   "quarantined": false, "missing": false}),
        ),
        (
            "edu0",
            json!({"def": {"id": "edu0", "shape": {"model": "vfio", "vram_size": 0, "queues": 0,
                       "irq": "msix", "vram_mmap": false, "keep_vram_on_reset": false},
                       "partitions": [], "host": "0000:00:04.0"},
                   "quarantined": false, "missing": false}),
        ),
        (
            "gone",
            json!({"def": {"id": "gone", "shape": old_shape(32 << 20, 1, "msix"), "partitions": []},
                   "quarantined": false, "missing": false}),
        ),
    ];
    let endpoints = [
        ("vm1", endpoint("vm1", "p0.1")),
        ("vm2", endpoint("vm2", "edu0")),
        ("vm3", endpoint("vm3", "gone")),
    ];
    let events = [
        json!({"seq": 1, "at_unix_ms": 1, "kind": {"type": "opened", "boards": 4, "endpoints": 0}}),
        json!({"seq": 2, "at_unix_ms": 2, "kind": {"type": "drain_started", "board": "p0", "moves": [
            {"endpoint": "vm1", "from": "p0.0", "from_board": "p0", "to": "p0.1", "to_board": "p0",
             "shape": old_shape(128 << 20, 2, "msi")}]}}),
    ];
    let db = Database::create(path).expect("create");
    let txn = db.begin_write().expect("write");
    {
        let mut t = txn.open_table(BOARDS).expect("boards");
        for (id, record) in &boards {
            let bytes = serde_json::to_vec(record).expect("json");
            t.insert(*id, bytes.as_slice()).expect("insert");
        }
        let mut t = txn.open_table(ENDPOINTS).expect("endpoints");
        for (id, record) in &endpoints {
            let bytes = serde_json::to_vec(record).expect("json");
            t.insert(*id, bytes.as_slice()).expect("insert");
        }
        let mut t = txn.open_table(EVENTS).expect("events");
        for (seq, event) in (1u64..).zip(&events) {
            let bytes = serde_json::to_vec(event).expect("json");
            t.insert(seq, bytes.as_slice()).expect("insert");
        }
        let mut t = txn.open_table(META).expect("meta");
        t.insert("format", 1).expect("format");
        t.insert("next_seq", 3).expect("next_seq");
    }
    txn.commit().expect("commit");
}

/// The same boards, configured today (edu0's address written short).
// Its events are dated 1970: kept for the test (retention would prune them at the open).
const CONFIG: &str = r#"
[daemon]
endpoint_dir = "/run/sy"
events_max_age = "36500d"

[[boards]]
id = "gpu0"
[[boards]]
id = "p0"
vram = "256M"
queues = 4
irq = "msi"
partitions = [ { id = "p0.0", vram = "128M", queues = 2 }, { id = "p0.1", vram = "128M", queues = 2 } ]
[[boards]]
id = "edu0"
model = "vfio"
host = "00:04.0"
"#;

/// The stored board records, as JSON.
fn board_records(path: &Path) -> Vec<serde_json::Value> {
    let db = Database::create(path).expect("open");
    let txn = db.begin_read().expect("read");
    let t = txn.open_table(BOARDS).expect("boards");
    t.iter()
        .expect("iter")
        .map(|item| {
            let (_, v) = item.expect("item");
            serde_json::from_slice(v.value()).expect("json")
        })
        .collect()
}

#[test]
fn a_store_from_before_device_kinds_opens() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    write_old_store(&path);

    // The old shapes are compared with the configuration's: a changed leased board is
    // refused as before, and the refusal writes nothing.
    let changed = CONFIG.replace("irq = \"msi\"", "irq = \"msix\"");
    let e = Pool::open(&config(&changed), KINDS, &path).expect_err("p0.1 changed");
    assert!(matches!(e, PoolError::Reconcile(_)), "{e}");
    assert!(
        e.to_string().contains("changed in irq (msix vs msi)"),
        "{e}"
    );
    assert!(
        board_records(&path)[0]["def"]["shape"]
            .get("options")
            .is_none()
    );

    let (pool, report) = Pool::open(&config(CONFIG), KINDS, &path).expect("opens");
    assert!(report.added_boards.is_empty(), "{report:?}");
    assert_eq!(report.missing_boards, ["gone"]);
    let inv = pool.inventory();
    // Leases and quarantines are kept.
    let lease = |e: &str| inv.endpoint(e).and_then(|e| e.device.clone());
    assert_eq!(lease("vm1").as_deref(), Some("p0.1"));
    assert_eq!(lease("vm2").as_deref(), Some("edu0"));
    assert_eq!(lease("vm3").as_deref(), Some("gone"));
    assert_eq!(
        inv.board("gpu0").expect("gpu0").state,
        BoardState::Quarantined
    );
    // The board no longer configured is described by its stored record, which its kind
    // completed.
    let gone = inv.board("gone").expect("gone");
    assert_eq!(gone.state, BoardState::Missing);
    assert_eq!(
        serde_json::Value::Object(gone.shape.options.clone()),
        json!({"vram": 32 << 20, "queues": 1, "irq": "msix", "vram_mmap": true, "vram_reset": "zero"})
    );
    assert_eq!((gone.shape.memory(), gone.shape.queues()), (32 << 20, 1));
    let edu0 = inv.board("edu0").expect("edu0");
    assert_eq!(edu0.host.as_deref(), Some("0000:00:04.0"));
    assert!(!edu0.shape.profile.movable);
    // The history decodes, the drain's plan with the shape the board had, and goes on.
    let history = pool.history(0, usize::MAX).expect("history");
    let seqs: Vec<u64> = history.iter().map(|e| e.seq).collect();
    assert_eq!(seqs[..3], [1, 2, 3], "{seqs:?}");
    let EventKind::DrainStarted { moves, .. } = &history[1].kind else {
        panic!("{:?}", history[1]);
    };
    assert_eq!(moves[0].shape.model, "softgpu");
    assert_eq!(moves[0].shape.memory(), 128 << 20);
    assert_eq!(moves[0].shape.option_text("irq").as_deref(), Some("msi"));
    assert!(matches!(
        history.last().map(|e| &e.kind),
        Some(EventKind::Opened {
            boards: 4,
            endpoints: 3
        })
    ));
    // The pool works on the converted records: a move between the partitions.
    let mut pool = pool;
    pool.detach("vm1").expect("detach");
    pool.create_endpoint(&on_device("vm4", "p0.0"))
        .expect("p0.0 is free");
    let state = serde_json::to_string(&pool.inventory().boards()).expect("json");
    drop(pool);

    // The boards were written again in the current form, and read back the same.
    for record in board_records(&path) {
        let shape = &record["def"]["shape"];
        assert!(
            shape["options"].is_object() && shape["profile"].is_object(),
            "{record}"
        );
        assert!(shape.get("vram_size").is_none(), "{record}");
        assert!(record["def"].get("host").is_none(), "{record}");
    }
    let (pool, _) = Pool::open(&config(CONFIG), KINDS, &path).expect("reopens");
    assert_eq!(
        serde_json::to_string(&pool.inventory().boards()).expect("json"),
        state
    );
}

/// An endpoint stored before owners were recorded is root's (uid 0); one created by another
/// user keeps that user across a reopen.
#[test]
fn an_endpoint_without_a_recorded_owner_is_roots() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    write_old_store(&path);
    let (mut pool, _) = Pool::open(&config(CONFIG), KINDS, &path).expect("opens");
    let owner = |pool: &Pool, e: &str| pool.inventory().endpoint(e).map(|e| e.owner_uid);
    assert_eq!(owner(&pool, "vm1"), Some(0));
    let token = switchyard_pool::new_migration_token().expect("token");
    pool.create_endpoint_as(&on_device("vm4", "p0.0"), 1000, &token)
        .expect("p0.0 is free");
    assert_eq!(owner(&pool, "vm4"), Some(1000));
    drop(pool);
    let (pool, _) = Pool::open(&config(CONFIG), KINDS, &path).expect("reopens");
    assert_eq!(owner(&pool, "vm4"), Some(1000));
    assert_eq!(owner(&pool, "vm2"), Some(0));
}

/// Endpoints stored before migration tokens get one when the store opens, each its own,
/// stored: the next open reads the same; a new endpoint gets a new one.
#[test]
fn endpoints_of_an_earlier_store_get_a_migration_token_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    write_old_store(&path);
    let tokens = |pool: &Pool| -> Vec<String> {
        ["vm1", "vm2", "vm3"]
            .iter()
            .map(|id| {
                let e = pool.inventory().endpoint(id).expect("endpoint");
                e.migration_token.clone()
            })
            .collect()
    };
    let (mut pool, _) = Pool::open(&config(CONFIG), KINDS, &path).expect("opens");
    let first = tokens(&pool);
    for t in &first {
        assert!(switchyard_pool::is_migration_token(t), "{first:?}");
    }
    assert!(first[0] != first[1] && first[1] != first[2], "{first:?}");
    pool.detach("vm1").expect("detach");
    pool.create_endpoint(&on_device("vm4", "p0.0"))
        .expect("p0.0 is free");
    let vm4 = pool
        .inventory()
        .endpoint("vm4")
        .expect("vm4")
        .migration_token
        .clone();
    assert!(switchyard_pool::is_migration_token(&vm4) && !first.contains(&vm4));
    drop(pool);
    let (pool, _) = Pool::open(&config(CONFIG), KINDS, &path).expect("reopens");
    assert_eq!(
        tokens(&pool),
        first,
        "the tokens made at the first open were stored"
    );
    assert_eq!(
        pool.inventory()
            .endpoint("vm4")
            .expect("vm4")
            .migration_token,
        vm4
    );
}
