//! The configuration's validation: ids, boards (their options checked by their kind),
//! partitions, host resources, pools and endpoints.

use std::collections::HashMap;

use switchyard_device::kind::{DeviceKind, KindCatalog, KindError};
use toml::de::{DeTable, DeValue};

use super::{BoardConfig, PoolConfig, path_check, socket_length_check};
use crate::board::{BoardDef, PartitionDef};
use crate::error::{ConfigProblem, PoolError};
use crate::shape::DeviceShape;
use crate::units::Size;
use crate::view::{MAX_SOCKET_PATH, valid_id};

impl PoolConfig {
    /// [`PoolConfig::validate`], returning the boards as the inventory keeps them.
    pub(crate) fn check(&self, kinds: &dyn KindCatalog) -> Result<Vec<BoardDef>, PoolError> {
        self.daemon.validate()?;
        // One namespace for boards, partitions, pools and endpoints.
        let mut ids: HashMap<String, String> = HashMap::new();
        let mut claim = |id: &str, key: String| -> Result<(), PoolError> {
            if !valid_id(id) {
                return Err(PoolError::config(key, ConfigProblem::BadId(id.into())));
            }
            if let Some(first) = ids.get(id) {
                return Err(PoolError::config(
                    key,
                    ConfigProblem::DuplicateId {
                        id: id.into(),
                        first: first.clone(),
                    },
                ));
            }
            ids.insert(id.to_owned(), key);
            Ok(())
        };
        let mut boards: HashMap<&str, usize> = HashMap::new();
        let mut partitions: HashMap<&str, (usize, usize)> = HashMap::new();
        let mut defs = Vec::with_capacity(self.boards.len());
        // Host resources (PCI addresses) and the board holding each.
        let mut held: HashMap<String, &str> = HashMap::new();
        for (i, b) in self.boards.iter().enumerate() {
            let key = format!("boards[{i}]");
            claim(&b.id, format!("{key}.id"))?;
            boards.insert(&b.id, i);
            for (j, p) in b.partitions.iter().enumerate() {
                claim(&p.id, format!("{key}.partitions[{j}].id"))?;
                partitions.insert(&p.id, (i, j));
            }
            let def = board_def(&key, b, kinds)?;
            if let Some(resource) = &def.shape.profile.exclusive {
                if let Some(first) = held.get(resource.as_str()) {
                    let at = def
                        .shape
                        .options
                        .iter()
                        .find(|(_, v)| v.as_str() == Some(resource.as_str()))
                        .map_or_else(|| key.clone(), |(name, _)| format!("{key}.{name}"));
                    return Err(PoolError::config(
                        at,
                        ConfigProblem::ResourceTaken {
                            resource: resource.clone(),
                            board: (*first).to_owned(),
                        },
                    ));
                }
                held.insert(resource.clone(), &b.id);
            }
            defs.push(def);
        }
        let mut pool_of: HashMap<&str, &str> = HashMap::new();
        for (i, p) in self.pools.iter().enumerate() {
            let key = format!("pools[{i}]");
            claim(&p.name, format!("{key}.name"))?;
            let mut reference: Option<&BoardDef> = None;
            for (k, name) in p.boards.iter().enumerate() {
                let bkey = format!("{key}.boards[{k}]");
                let Some(&bi) = boards.get(name.as_str()) else {
                    let problem = if partitions.contains_key(name.as_str()) {
                        ConfigProblem::PartitionInPool(name.clone())
                    } else {
                        ConfigProblem::UnknownBoard(name.clone())
                    };
                    return Err(PoolError::config(bkey, problem));
                };
                if let Some(first) = pool_of.insert(name, &p.name) {
                    return Err(PoolError::config(
                        bkey,
                        ConfigProblem::BoardInTwoPools {
                            board: name.clone(),
                            pool: first.into(),
                        },
                    ));
                }
                let board = &defs[bi];
                match reference {
                    None => reference = Some(board),
                    Some(r) => {
                        if let Some(difference) = board_difference(board, r) {
                            return Err(PoolError::config(
                                key,
                                ConfigProblem::NotHomogeneous {
                                    board: board.id.clone(),
                                    reference: r.id.clone(),
                                    difference,
                                },
                            ));
                        }
                    }
                }
            }
        }
        let mut named: HashMap<&str, String> = HashMap::new();
        for (i, e) in self.endpoints.iter().enumerate() {
            let key = format!("endpoints[{i}]");
            claim(&e.id, format!("{key}.id"))?;
            match (&e.pool, &e.device) {
                (Some(_), Some(_)) => {
                    return Err(PoolError::config(
                        key,
                        ConfigProblem::Placement("give either `pool` or `device`, not both"),
                    ));
                }
                (None, None) => {
                    return Err(PoolError::config(
                        key,
                        ConfigProblem::Placement("give `pool` or `device`"),
                    ));
                }
                (Some(pool), None) => {
                    if !self.pools.iter().any(|p| &p.name == pool) {
                        return Err(PoolError::config(
                            format!("{key}.pool"),
                            ConfigProblem::UnknownPool(pool.clone()),
                        ));
                    }
                }
                (None, Some(device)) => {
                    let dkey = format!("{key}.device");
                    if let Some(&bi) = boards.get(device.as_str()) {
                        if !self.boards[bi].partitions.is_empty() {
                            return Err(PoolError::config(
                                dkey,
                                ConfigProblem::NotLeasable(device.clone()),
                            ));
                        }
                    } else if !partitions.contains_key(device.as_str()) {
                        return Err(PoolError::config(
                            dkey,
                            ConfigProblem::UnknownDevice(device.clone()),
                        ));
                    }
                    if let Some(first) = named.insert(device, key.clone()) {
                        return Err(PoolError::config(
                            dkey,
                            ConfigProblem::DeviceNamedTwice {
                                device: device.clone(),
                                first,
                            },
                        ));
                    }
                }
            }
            match &e.socket {
                Some(socket) => {
                    let skey = format!("{key}.socket");
                    if !socket.is_absolute() {
                        return Err(PoolError::config(
                            skey,
                            ConfigProblem::SocketPath("a socket path must be absolute"),
                        ));
                    }
                    path_check(socket)
                        .and_then(|()| socket_length_check(socket))
                        .map_err(|p| PoolError::config(skey, p))?;
                }
                None => {
                    let socket = self.daemon.endpoint_dir.join(format!("{}.sock", e.id));
                    let len = socket.as_os_str().len();
                    if len > MAX_SOCKET_PATH {
                        return Err(PoolError::config(
                            format!("{key}.id"),
                            ConfigProblem::Path(format!(
                                "its socket {socket:?} (`<endpoint_dir>/<id>.sock`) is {len} \
                                 bytes, over the {MAX_SOCKET_PATH} a UNIX socket path can have; \
                                 shorten the id or `daemon.endpoint_dir`, or give `socket`"
                            )),
                        ));
                    }
                }
            }
        }
        Ok(defs)
    }
}

/// A board (at `key`, `boards[i]`) checked by its kind: its shape and its partitions', which
/// fit in the board's VRAM and queues.
fn board_def(key: &str, b: &BoardConfig, kinds: &dyn KindCatalog) -> Result<BoardDef, PoolError> {
    let kind = kinds.kind(&b.model).ok_or_else(|| {
        PoolError::config(
            format!("{key}.model"),
            ConfigProblem::UnknownModel {
                model: b.model.clone(),
                known: kinds.names(),
            },
        )
    })?;
    let shape = DeviceShape::of(kind, &b.options).map_err(|e| kind_error(key, kind, e))?;
    if !b.partitions.is_empty() && !shape.profile.partitionable {
        return Err(PoolError::config(
            format!("{key}.partitions"),
            ConfigProblem::NotPartitionable(b.model.clone()),
        ));
    }
    let (mut vram, mut queues) = (0u64, 0u64);
    let mut parts = Vec::with_capacity(b.partitions.len());
    for (j, p) in b.partitions.iter().enumerate() {
        let pkey = format!("{key}.partitions[{j}]");
        let part = shape.partition(kind, p.vram.0, p.queues).map_err(|e| {
            // The partition's own keys are `vram` and `queues`; the rest are the board's.
            match e.field() {
                Some("vram" | "queues") | None => kind_error(&pkey, kind, e),
                Some(_) => kind_error(key, kind, e),
            }
        })?;
        vram = vram.saturating_add(part.memory());
        queues += u64::from(part.queues());
        parts.push(PartitionDef {
            id: p.id.clone(),
            shape: part,
        });
    }
    if vram > shape.memory() {
        return Err(PoolError::config(
            format!("{key}.partitions"),
            ConfigProblem::PartitionsExceedBoard {
                what: "VRAM",
                used: Size(vram).to_string(),
                board: Size(shape.memory()).to_string(),
            },
        ));
    }
    if queues > u64::from(shape.queues()) {
        return Err(PoolError::config(
            format!("{key}.partitions"),
            ConfigProblem::PartitionsExceedBoard {
                what: "queues",
                used: queues.to_string(),
                board: shape.queues().to_string(),
            },
        ));
    }
    Ok(BoardDef {
        id: b.id.clone(),
        shape,
        partitions: parts,
    })
}

/// A kind's refusal of the options of the entry at `key`, reported at the option it names.
fn kind_error(key: &str, kind: &dyn DeviceKind, e: KindError) -> PoolError {
    let at = match e.field() {
        Some(field) => format!("{key}.{field}"),
        None => key.to_owned(),
    };
    let message = match e {
        KindError::Option { message, .. } => message,
        other => other.to_string(),
    };
    PoolError::config(
        at,
        ConfigProblem::Kind {
            model: kind.name().to_owned(),
            message,
        },
    )
}

/// The first difference between two boards that a pool cannot have, e.g.
/// `memory (128 MiB vs 64 MiB)`.
fn board_difference(a: &BoardDef, b: &BoardDef) -> Option<String> {
    if let Some(d) = a.shape.difference(&b.shape) {
        return Some(d);
    }
    if a.partitions.len() != b.partitions.len() {
        return Some(format!(
            "partition layout ({} partitions vs {})",
            a.partitions.len(),
            b.partitions.len()
        ));
    }
    for (j, (p, q)) in a.partitions.iter().zip(&b.partitions).enumerate() {
        if let Some(d) = p.shape.difference(&q.shape) {
            return Some(format!("partitions[{j}].{d}"));
        }
    }
    None
}

/// The line of the value at `key` (`boards[1].vram`, `boards[0].partitions[1].queues`) in
/// the TOML `text`, if it is there.
pub(super) fn line_of_key(text: &str, key: &str) -> Option<usize> {
    let doc = DeTable::parse(text).ok()?;
    let mut table: &DeTable<'_> = doc.get_ref();
    let mut span = None;
    let mut segments = key.split('.').peekable();
    while let Some(segment) = segments.next() {
        let (name, index) = match segment.split_once('[') {
            Some((name, rest)) => (
                name,
                Some(rest.trim_end_matches(']').parse::<usize>().ok()?),
            ),
            None => (segment, None),
        };
        let (_, value) = table.iter().find(|(k, _)| k.get_ref().as_ref() == name)?;
        let value = match (index, value.get_ref()) {
            (None, _) => value,
            (Some(i), DeValue::Array(items)) => items.get(i)?,
            _ => return None,
        };
        span = Some(value.span());
        if segments.peek().is_some() {
            match value.get_ref() {
                DeValue::Table(t) => table = t,
                _ => return None,
            }
        }
    }
    let start = span?.start.min(text.len());
    Some(text[..start].matches('\n').count() + 1)
}
