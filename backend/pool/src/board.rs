//! Boards as the store keeps them: a definition (id, shape, partitions) and a state.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use switchyard_device::kind::KindCatalog;

use crate::shape::DeviceShape;
use crate::view::{BoardState, Endpoint};

/// A board's definition as the store keeps it (so that a board removed from the
/// configuration can still be described while leased).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "BoardDefRecord")]
pub(crate) struct BoardDef {
    pub id: String,
    /// The whole board's shape.
    pub shape: DeviceShape,
    pub partitions: Vec<PartitionDef>,
}

/// A partition: a device of its own, with the board's options but its own VRAM and queues.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct PartitionDef {
    pub id: String,
    pub shape: DeviceShape,
}

impl BoardDef {
    /// The leasable devices: the board itself, or its partitions.
    pub fn devices(&self) -> impl Iterator<Item = (&str, &DeviceShape)> {
        let whole = self
            .partitions
            .is_empty()
            .then_some((self.id.as_str(), &self.shape));
        whole
            .into_iter()
            .chain(self.partitions.iter().map(|p| (p.id.as_str(), &p.shape)))
    }

    /// Has the board's kind check its stored shapes again: a record written before device
    /// kinds gets the options it lacked (their defaults), a current one stays as it is. A
    /// shape of a kind `catalog` does not have, or that its kind now refuses, is kept as
    /// stored (compared with the configuration, it differs).
    pub fn recheck(&mut self, catalog: &dyn KindCatalog) {
        let Some(kind) = catalog.kind(&self.shape.model) else {
            return;
        };
        for shape in
            std::iter::once(&mut self.shape).chain(self.partitions.iter_mut().map(|p| &mut p.shape))
        {
            if let Ok(checked) = DeviceShape::of(kind, &shape.options) {
                *shape = checked;
            }
        }
    }
}

/// A board with its state, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct BoardRecord {
    pub def: BoardDef,
    pub quarantined: bool,
    pub missing: bool,
    /// The board failed under its devices (quarantined with it); cleared when the board is
    /// let take leases again. Endpoints leasing its devices fail over.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<crate::view::BoardFailure>,
}

impl BoardRecord {
    pub fn state(&self) -> BoardState {
        if self.missing {
            BoardState::Missing
        } else if self.quarantined {
            BoardState::Quarantined
        } else {
            BoardState::Available
        }
    }
}

/// Everything the store keeps of an inventory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub boards: BTreeMap<String, BoardRecord>,
    pub endpoints: BTreeMap<String, Endpoint>,
    pub next_seq: u64,
    /// Boards whose stored record is in an older form (from before device kinds): written
    /// again at the next commit even when unchanged.
    pub outdated: BTreeSet<String>,
}

/// A board definition as stored, now or before device kinds (when a passthrough board's
/// PCI address was `host` on the board, and partitions were a VRAM size and queues).
#[derive(Deserialize)]
struct BoardDefRecord {
    id: String,
    shape: DeviceShape,
    #[serde(default)]
    partitions: Vec<PartitionRecord>,
    #[serde(default)]
    host: Option<String>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum PartitionRecord {
    Current {
        id: String,
        shape: DeviceShape,
    },
    Legacy {
        id: String,
        vram_size: u64,
        queues: u32,
    },
}

impl From<BoardDefRecord> for BoardDef {
    fn from(r: BoardDefRecord) -> Self {
        let mut shape = r.shape;
        if let Some(host) = r.host
            && !shape.options.contains_key("host")
        {
            shape.options.insert("host".into(), host.clone().into());
            shape.profile.exclusive = Some(host);
        }
        let partitions = r
            .partitions
            .into_iter()
            .map(|p| match p {
                PartitionRecord::Current { id, shape } => PartitionDef { id, shape },
                PartitionRecord::Legacy {
                    id,
                    vram_size,
                    queues,
                } => {
                    let mut part = shape.clone();
                    part.options.insert("vram".into(), vram_size.into());
                    part.options.insert("queues".into(), queues.into());
                    part.profile.memory = vram_size;
                    part.profile.queues = queues;
                    PartitionDef { id, shape: part }
                }
            })
            .collect();
        BoardDef {
            id: r.id,
            shape,
            partitions,
        }
    }
}
