//! A pool store written before device kinds opens with the daemon's kinds (the registry):
//! the softgpu and passthrough boards it recorded get the canonical options of their kind,
//! the same the configuration's boards get, so their leases are kept. A store of the release
//! before events retention keeps its numbering: a `since` a client had is still good, or
//! refused with 410 once retention pruned past it. A store of the release that called device
//! memory `vram` (a scratchpad's RAM too) has it read as `memory`.
#![forbid(unsafe_code)]

use std::path::Path;

use redb::{Database, TableDefinition};
use serde_json::{Value, json};
use switchyard_control::Received;
use switchyard_daemon::app::events::{EventStream, EventsPruned, SEQ_STRIDE, Step};
use switchyard_pool::{DeviceShape, EventKind, Pool, PoolConfig};

const BOARDS: TableDefinition<&str, &[u8]> = TableDefinition::new("boards");
const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");

/// A store of format 1 with these board and endpoint records (keyed by their ids), as an
/// earlier release wrote it.
fn write_store(path: &Path, boards: &[Value], endpoints: &[Value]) {
    let db = Database::create(path).expect("create");
    let txn = db.begin_write().expect("write");
    {
        let mut t = txn.open_table(BOARDS).expect("boards");
        for b in boards {
            let id = b["def"]["id"].as_str().expect("id");
            t.insert(id, serde_json::to_vec(b).expect("json").as_slice())
                .expect("insert");
        }
        let mut t = txn.open_table(ENDPOINTS).expect("endpoints");
        for e in endpoints {
            let id = e["id"].as_str().expect("id");
            t.insert(id, serde_json::to_vec(e).expect("json").as_slice())
                .expect("insert");
        }
        let mut t = txn.open_table(META).expect("meta");
        t.insert("format", 1).expect("format");
        t.insert("next_seq", 1).expect("next_seq");
    }
    txn.commit().expect("commit");
}

#[test]
fn a_store_from_before_device_kinds_opens_with_the_registry() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    let boards = [
        json!({"def": {"id": "gpu0", "shape": {"model": "softgpu", "vram_size": 64 << 20,
            "queues": 2, "irq": "msi", "vram_mmap": false, "keep_vram_on_reset": true},
            "partitions": []}, "quarantined": false, "missing": false}),
        json!({"def": {"id": "edu0", "shape": {"model": "vfio", "vram_size": 0, "queues": 0,
            "irq": "msix", "vram_mmap": true, "keep_vram_on_reset": false},
            "partitions": [], "host": "0000:00:04.0"}, "quarantined": false, "missing": false}),
    ];
    let endpoints = [("vm1", "gpu0"), ("vm2", "edu0")].map(|(id, device)| {
        json!({"id": id, "socket": format!("/run/sy/{id}.sock"),
            "requirements": {"min_vram": 0, "min_queues": 0}, "pool": null,
            "device": device, "moving_to": null, "created_unix_ms": 1})
    });
    write_store(&path, &boards, &endpoints);
    let config = PoolConfig::from_toml(
        r#"
[daemon]
endpoint_dir = "/run/sy"
[[boards]]
id = "gpu0"
vram = "64M"
irq = "msi"
vram_mmap = false
vram_reset = "keep"
[[boards]]
id = "edu0"
model = "vfio"
host = "00:04.0"
bars = "mmap"
"#,
        &switchyard_kinds::Registry,
    )
    .expect("config");
    let (pool, _) = Pool::open(&config, &switchyard_kinds::Registry, &path).expect("opens");
    let inv = pool.inventory();
    assert_eq!(
        inv.endpoint("vm1").and_then(|e| e.device.as_deref()),
        Some("gpu0")
    );
    assert_eq!(
        inv.endpoint("vm2").and_then(|e| e.device.as_deref()),
        Some("edu0")
    );
    let gpu0 = inv.board("gpu0").expect("gpu0").shape;
    assert_eq!(gpu0.model, "softgpu");
    assert_eq!(gpu0.option_text("vram_reset").as_deref(), Some("keep"));
    assert!(!gpu0.profile.msix && gpu0.profile.movable);
    let edu0 = inv.board("edu0").expect("edu0").shape;
    assert_eq!(edu0.option_text("host").as_deref(), Some("0000:00:04.0"));
    assert_eq!(edu0.option_text("bars").as_deref(), Some("mmap"));
    assert!(!edu0.profile.movable);
}

#[test]
fn a_store_that_called_device_memory_vram_reads_it_as_memory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    // The last release's record of a scratchpad board: its 64 KiB of RAM as `vram`.
    let shape = json!({"model": "scratchpad", "options": {"size": 64 << 10},
        "profile": {"vram": 64 << 10, "queues": 0, "partitionable": false, "movable": true,
            "msix": false, "dirty_log": "device_log", "exclusive": null, "host_settings": [],
            "client_maps_memory": false, "presents": null}});
    let decoded: DeviceShape = serde_json::from_value(shape.clone()).expect("decodes");
    assert_eq!(decoded.memory(), 64 << 10);
    let board = json!({"def": {"id": "sp0", "shape": shape, "partitions": []},
        "quarantined": false, "missing": false});
    let endpoint = json!({"id": "vm1", "socket": "/run/sy/vm1.sock",
        "requirements": {"min_vram": 0, "min_queues": 0}, "pool": null,
        "device": "sp0", "moving_to": null, "created_unix_ms": 1});
    write_store(&path, &[board], &[endpoint]);
    let config = PoolConfig::from_toml(
        "[daemon]\nendpoint_dir = \"/run/sy\"\n\
         [[boards]]\nid = \"sp0\"\nmodel = \"scratchpad\"\nsize = \"64K\"\n",
        &switchyard_kinds::Registry,
    )
    .expect("config");
    let (pool, _) = Pool::open(&config, &switchyard_kinds::Registry, &path).expect("opens");
    let inv = pool.inventory();
    // The same shape as the configuration's board: the lease is kept.
    assert_eq!(
        inv.endpoint("vm1").and_then(|e| e.device.as_deref()),
        Some("sp0")
    );
    let sp0 = inv.board("sp0").expect("sp0").shape;
    assert_eq!(sp0, decoded);
    assert_eq!(sp0.profile.memory, 64 << 10);
    // Written back under both names: the last release reads this store too.
    let json = serde_json::to_value(&sp0).expect("json");
    assert_eq!(json["profile"]["memory"], 64 << 10);
    assert_eq!(json["profile"]["vram"], 64 << 10);
}

/// Every `seq` the daemon's stream gives a reader after `since`, reading `pool`'s history, and
/// the events it reports missed.
fn read_after(pool: &Pool, since: u64) -> (Vec<u64>, u64) {
    let last = pool.inventory().next_seq() - 1;
    let stream = EventStream::new(last);
    let history = pool.history_reader();
    let mut cursor = stream.cursor(Some(since), false);
    let (mut seqs, mut missed) = (Vec::new(), 0);
    while let Step::Page(page) = stream
        .next_page(&mut cursor, |after, n| history.page(after, n))
        .expect("page")
    {
        for r in page {
            match r {
                Received::Event(e) => seqs.push(e.seq),
                Received::Lagged { missed: n } => missed += n,
            }
        }
    }
    (seqs, missed)
}

#[test]
fn a_store_from_before_events_retention_keeps_its_numbering() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("pool.redb");
    // The previous release: twelve pool events, nothing pruned, no `pruned` record.
    {
        let db = Database::create(&path).expect("create");
        let txn = db.begin_write().expect("write");
        {
            let mut t = txn.open_table(EVENTS).expect("events");
            for seq in 1..=12u64 {
                let kind = if seq % 2 == 1 {
                    json!({"type": "board_quarantined", "board": "gpu0"})
                } else {
                    json!({"type": "board_released", "board": "gpu0"})
                };
                let e = json!({"seq": seq, "at_unix_ms": 1_700_000_000_000u64 + seq, "kind": kind});
                t.insert(seq, serde_json::to_vec(&e).expect("json").as_slice())
                    .expect("insert");
            }
            let mut t = txn.open_table(META).expect("meta");
            t.insert("format", 1).expect("format");
            t.insert("next_seq", 13).expect("next_seq");
        }
        txn.commit().expect("commit");
    }
    // Events that old are past the default age: this release keeps by count only here.
    let config = PoolConfig::from_toml(
        "[daemon]\nendpoint_dir = \"/run/sy\"\nevents_keep = 5\nevents_max_age = \"36500d\"\n\
         [[boards]]\nid = \"gpu0\"\n",
        &switchyard_kinds::Registry,
    )
    .expect("config");
    let (pool, _) = Pool::open(&config, &switchyard_kinds::Registry, &path).expect("opens");
    // The numbering goes on (`opened` is 13), and retention pruned 1 to 8 at the open.
    let history = pool.history(0, usize::MAX).expect("history");
    let kept: Vec<u64> = history.iter().map(|e| e.seq).collect();
    assert_eq!(kept, [9, 10, 11, 12, 13]);
    assert!(matches!(history[4].kind, EventKind::Opened { .. }));
    let pruned = pool.pruned().expect("pruned");
    assert_eq!(pruned, 8);
    // A client of the previous daemon had seen pool event 9 and three worker events after
    // it: it resumes where it was, the pool events numbered as the previous daemon did.
    let (seqs, missed) = read_after(&pool, 9 * SEQ_STRIDE + 3);
    assert_eq!(seqs, [10, 11, 12, 13].map(|p| p * SEQ_STRIDE));
    assert_eq!(missed, 0);
    assert!(EventsPruned::check(9 * SEQ_STRIDE + 3, pruned).is_ok());
    // The oldest since is good too; one before it is refused, with where to resume.
    assert!(EventsPruned::check(8 * SEQ_STRIDE, pruned).is_ok());
    let (seqs, missed) = read_after(&pool, 8 * SEQ_STRIDE);
    assert_eq!(seqs, [9, 10, 11, 12, 13].map(|p| p * SEQ_STRIDE));
    assert_eq!(missed, 0);
    let gone = EventsPruned::check(4 * SEQ_STRIDE, pruned).expect_err("pruned");
    assert_eq!(gone.oldest_since, 8 * SEQ_STRIDE);
    assert_eq!(gone.error.code, "events_pruned");
    // A reader let through anyway is told how many it missed, where they were.
    let (seqs, missed) = read_after(&pool, 4 * SEQ_STRIDE);
    assert_eq!(seqs, [9, 10, 11, 12, 13].map(|p| p * SEQ_STRIDE));
    assert_eq!(missed, 4);
}
