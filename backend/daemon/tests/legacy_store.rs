//! A pool store written before device kinds opens with the daemon's kinds (the registry):
//! the softgpu and passthrough boards it recorded get the canonical options of their kind,
//! the same the configuration's boards get, so their leases are kept.
#![forbid(unsafe_code)]

use redb::{Database, TableDefinition};
use serde_json::json;
use switchyard_pool::{Pool, PoolConfig};

const BOARDS: TableDefinition<&str, &[u8]> = TableDefinition::new("boards");
const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

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
    {
        let db = Database::create(&path).expect("create");
        let txn = db.begin_write().expect("write");
        {
            let mut t = txn.open_table(BOARDS).expect("boards");
            for b in &boards {
                let id = b["def"]["id"].as_str().expect("id");
                t.insert(id, serde_json::to_vec(b).expect("json").as_slice())
                    .expect("insert");
            }
            let mut t = txn.open_table(ENDPOINTS).expect("endpoints");
            for e in &endpoints {
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
