//! A [`Profile`] as stored (a pool's store) and sent (the control API, a cluster's nodes):
//! its fields, but for the device memory, which earlier releases called `vram` and read as
//! a required field. Both names are written (the same value) and either is read, `memory`
//! first: a store, a peer or an API client of the last release reads what this one writes,
//! and this one reads theirs.

use serde::{Deserialize, Serialize};

use super::{DirtyLog, Profile};

#[derive(Serialize, Deserialize)]
pub(super) struct ProfileRecord {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    memory: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    vram: Option<u64>,
    queues: u32,
    partitionable: bool,
    movable: bool,
    msix: bool,
    dirty_log: DirtyLog,
    exclusive: Option<String>,
    #[serde(default)]
    host_settings: Vec<String>,
    #[serde(default)]
    client_maps_memory: bool,
    #[serde(default)]
    presents: Option<String>,
}

impl From<Profile> for ProfileRecord {
    fn from(p: Profile) -> Self {
        ProfileRecord {
            memory: Some(p.memory),
            vram: Some(p.memory),
            queues: p.queues,
            partitionable: p.partitionable,
            movable: p.movable,
            msix: p.msix,
            dirty_log: p.dirty_log,
            exclusive: p.exclusive,
            host_settings: p.host_settings,
            client_maps_memory: p.client_maps_memory,
            presents: p.presents,
        }
    }
}

impl TryFrom<ProfileRecord> for Profile {
    type Error = String;

    fn try_from(r: ProfileRecord) -> Result<Self, String> {
        let memory = r
            .memory
            .or(r.vram)
            .ok_or_else(|| "missing field `memory`".to_owned())?;
        Ok(Profile {
            memory,
            queues: r.queues,
            partitionable: r.partitionable,
            movable: r.movable,
            msix: r.msix,
            dirty_log: r.dirty_log,
            exclusive: r.exclusive,
            host_settings: r.host_settings,
            client_maps_memory: r.client_maps_memory,
            presents: r.presents,
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn fields() -> serde_json::Value {
        json!({"queues": 2, "partitionable": true, "movable": true, "msix": false,
            "dirty_log": "device_log", "exclusive": null})
    }

    #[test]
    fn memory_is_written_under_both_names_and_read_back() {
        let p = Profile {
            memory: 64 << 20,
            queues: 2,
            ..Profile::default()
        };
        let v = serde_json::to_value(&p).expect("json");
        assert_eq!(v["memory"], 64u64 << 20);
        assert_eq!(v["vram"], 64u64 << 20, "for readers of the last release");
        assert_eq!(serde_json::from_value::<Profile>(v).expect("reads"), p);
    }

    #[test]
    fn the_last_releases_vram_is_read_as_memory_and_memory_comes_first() {
        let mut old = fields();
        old["vram"] = json!(32 << 20);
        let p: Profile = serde_json::from_value(old.clone()).expect("reads `vram`");
        assert_eq!((p.memory, p.queues), (32 << 20, 2));
        assert!(p.host_settings.is_empty() && p.presents.is_none());

        let mut both = old;
        both["memory"] = json!(16 << 20);
        let p: Profile = serde_json::from_value(both).expect("reads both");
        assert_eq!(p.memory, 16 << 20);

        let e = serde_json::from_value::<Profile>(fields()).expect_err("neither");
        assert!(e.to_string().contains("missing field `memory`"), "{e}");
    }
}
