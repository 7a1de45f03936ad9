//! Rebuilding the inventory at open: the store's state reconciled with the configuration.

use std::collections::HashSet;

use switchyard_device::kind::KindCatalog;

use super::Inventory;
use crate::board::{BoardDef, BoardRecord, Snapshot};
use crate::config::PoolConfig;
use crate::error::PoolError;
use crate::event::{Event, EventKind};
use crate::view::{EndpointSpec, FailedEndpoint, OpenReport};

impl Inventory {
    /// A fresh inventory of a configuration, with its configured endpoints created (as
    /// [`Pool::open`](crate::Pool::open) does on a new store, without the store). Each
    /// board's options are checked by its kind in `kinds`.
    pub fn from_config(
        config: &PoolConfig,
        kinds: &dyn KindCatalog,
    ) -> Result<(Self, Vec<Event>, OpenReport), PoolError> {
        Self::restore(config, kinds, Snapshot::default())
    }

    /// Rebuilds the inventory from a stored snapshot and the configuration: the store's
    /// endpoints, leases, moves in progress and quarantines are kept; boards new to the
    /// configuration appear; boards gone from it are forgotten when unleased and kept as
    /// `missing` otherwise; configured endpoints are created when absent. Refused when a
    /// leased device no longer exists or changed shape in the configuration. The stored
    /// shapes are checked again by their kinds first ([`BoardDef::recheck`]: records from
    /// before device kinds get the options they lacked).
    pub(crate) fn restore(
        config: &PoolConfig,
        kinds: &dyn KindCatalog,
        mut stored: Snapshot,
    ) -> Result<(Self, Vec<Event>, OpenReport), PoolError> {
        let mut inv = Self::new(config, kinds)?;
        for record in stored.boards.values_mut() {
            record.def.recheck(kinds);
        }
        inv.next_seq = stored.next_seq.max(1);
        let mut report = OpenReport::default();
        let mut kinds = Vec::new();
        let fresh = stored.boards.is_empty() && stored.endpoints.is_empty();
        let holders = |board: &BoardDef| -> Vec<String> {
            let devs: HashSet<&str> = board.devices().map(|(id, _)| id).collect();
            stored
                .endpoints
                .values()
                .filter(|e| {
                    [&e.device, &e.moving_to]
                        .into_iter()
                        .flatten()
                        .any(|d| devs.contains(d.as_str()))
                })
                .map(|e| e.id.clone())
                .collect()
        };
        for b in &mut inv.boards {
            match stored.boards.get(&b.def.id) {
                Some(old) => {
                    b.quarantined = old.quarantined;
                    b.failed = old.failed.clone();
                    if old.missing {
                        kinds.push(EventKind::BoardReturned {
                            board: b.def.id.clone(),
                        });
                    }
                }
                None => {
                    report.added_boards.push(b.def.id.clone());
                    if !fresh {
                        kinds.push(EventKind::BoardAdded {
                            board: b.def.id.clone(),
                        });
                    }
                }
            }
        }
        for (id, old) in &stored.boards {
            if inv.board_record(id).is_some() {
                continue;
            }
            let endpoints = holders(&old.def);
            if endpoints.is_empty() {
                report.removed_boards.push(id.clone());
                kinds.push(EventKind::BoardRemoved { board: id.clone() });
            } else {
                // A kept board's ids must not collide with the configuration's.
                let ids = std::iter::once(id).chain(old.def.partitions.iter().map(|p| &p.id));
                for used in ids {
                    if let Some(holder) = inv.id_holder(used) {
                        return Err(PoolError::Reconcile(format!(
                            "board \"{id}\", gone from the configuration but leased by {}, has the id \"{used}\" of {holder}",
                            endpoints.join(", ")
                        )));
                    }
                }
                report.missing_boards.push(id.clone());
                if !old.missing {
                    kinds.push(EventKind::BoardMissing {
                        board: id.clone(),
                        endpoints,
                    });
                }
                inv.boards.push(BoardRecord {
                    def: old.def.clone(),
                    quarantined: old.quarantined,
                    missing: true,
                    failed: old.failed.clone(),
                });
            }
        }
        // Every stored lease must find its device, with the shape it had.
        let old_shape = |device: &str| {
            stored
                .boards
                .values()
                .flat_map(|b| b.def.devices())
                .find(|(id, _)| *id == device)
                .map(|(_, s)| s)
        };
        let mut used: HashSet<&str> = HashSet::new();
        for e in stored.endpoints.values() {
            if let Some(holder) = inv.id_holder(&e.id) {
                return Err(PoolError::Reconcile(format!(
                    "endpoint \"{}\" has the id of {holder} in the configuration",
                    e.id
                )));
            }
            for d in [&e.device, &e.moving_to].into_iter().flatten() {
                let Some(now) = inv.dev(d) else {
                    return Err(PoolError::Reconcile(format!(
                        "endpoint \"{}\" holds device \"{d}\", which the configuration no longer has",
                        e.id
                    )));
                };
                if let Some(was) = old_shape(d)
                    && let Some(diff) = now.shape.difference(was)
                {
                    return Err(PoolError::Reconcile(format!(
                        "endpoint \"{}\" holds device \"{d}\", whose configuration changed in {diff}; restore it, or delete the endpoint first",
                        e.id
                    )));
                }
                if !used.insert(d) {
                    return Err(PoolError::Reconcile(format!(
                        "device \"{d}\" is held by two endpoints"
                    )));
                }
            }
        }
        inv.endpoints = stored.endpoints.clone();
        // Endpoints of an earlier release's store get their migration token now (stored
        // with the reconciliation).
        for e in inv.endpoints.values_mut() {
            if !crate::is_migration_token(&e.migration_token) {
                e.migration_token = crate::new_migration_token()?;
            }
        }
        let mut events: Vec<Event> = kinds.into_iter().map(|k| inv.emit(k)).collect();
        for c in &config.endpoints {
            if inv.endpoints.contains_key(&c.id) {
                continue;
            }
            let spec = EndpointSpec {
                id: c.id.clone(),
                pool: c.pool.clone(),
                device: c.device.clone(),
                min_vram: c.min_vram.map(|s| s.0),
                min_queues: c.min_queues,
                socket: c.socket.clone(),
            };
            match inv.create_endpoint(&spec) {
                Ok(ev) => {
                    events.extend(ev);
                    report.created_endpoints.push(c.id.clone());
                }
                Err(e) => report.failed_endpoints.push(FailedEndpoint {
                    endpoint: c.id.clone(),
                    error: e.to_string(),
                }),
            }
        }
        report.pending_moves = inv.pending_moves();
        let opened = EventKind::Opened {
            boards: inv.boards.len(),
            endpoints: inv.endpoints.len(),
        };
        events.push(inv.emit(opened));
        Ok((inv, events, report))
    }
}
