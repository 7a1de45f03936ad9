//! A node's capacity for the cluster, per pool, and the Pacemaker utilization attributes
//! that publish it.

use std::collections::BTreeMap;

use switchyard_pool::{BoardState, BoardView};

use super::meta::PREFIX;

/// Whether the cluster placed the endpoint `id` (its id starts with `libvirt.`).
fn cluster_placed(id: &str) -> bool {
    id.starts_with(PREFIX)
}

/// Each pool's capacity for the cluster: its leasable devices on healthy boards (available,
/// not failed; quarantined and missing boards take no leases), less the devices taken
/// outside the cluster's accounting: leased by an endpoint the cluster did not place (on
/// any board of the pool: one on a sick board moves to a healthy one) or reserved for a
/// move (the moving endpoint holds two devices until it ends). A device leased by an
/// endpoint the cluster placed is not taken: Pacemaker counts its VM's GPUs itself. Never
/// negative; a pool of `pools` without boards has 0.
pub fn capacity(pools: &[String], boards: &[BoardView]) -> BTreeMap<String, u64> {
    let mut out: BTreeMap<String, (u64, u64)> = pools.iter().map(|p| (p.clone(), (0, 0))).collect();
    for board in boards {
        let Some((healthy, taken)) = board.pool.as_ref().and_then(|p| out.get_mut(p)) else {
            continue;
        };
        let usable = board.state == BoardState::Available && board.failed.is_none();
        for d in &board.devices {
            if usable {
                *healthy += 1;
            }
            let leased_outside = d.endpoint.as_deref().is_some_and(|e| !cluster_placed(e));
            let reserved = d.endpoint.is_none() && d.reserved_for.is_some();
            if leased_outside || reserved {
                *taken += 1;
            }
        }
    }
    out.into_iter()
        .map(|(pool, (healthy, taken))| (pool, healthy.saturating_sub(taken)))
        .collect()
}

/// The node utilization attribute of `pool`: `swy_<pool>_gpus`, every character of the
/// pool's name outside `[A-Za-z0-9_]` made `_`.
pub fn attribute(pool: &str) -> String {
    let name: String = pool
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("swy_{name}_gpus")
}

/// The attributes of the pools' capacities, in the pools' order; two pools whose names
/// make the same attribute are an error (one would overwrite the other's capacity).
pub fn attributes(capacity: &BTreeMap<String, u64>) -> anyhow::Result<Vec<(String, u64)>> {
    let mut seen: BTreeMap<String, &str> = BTreeMap::new();
    let mut out = Vec::with_capacity(capacity.len());
    for (pool, n) in capacity {
        let name = attribute(pool);
        if let Some(other) = seen.insert(name.clone(), pool) {
            anyhow::bail!(
                "pools {other:?} and {pool:?} both make the utilization attribute {name}; \
                 rename one"
            );
        }
        out.push((name, *n));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use switchyard_pool::{BoardFailure, DeviceShape, DeviceView, DirtyTracking};

    use super::*;

    /// A softgpu's shape (the store's oldest form is the shortest to write).
    fn shape() -> DeviceShape {
        serde_json::from_value(serde_json::json!({
            "vram_size": 16 << 20, "queues": 1, "irq": "msix", "vram_mmap": true,
        }))
        .expect("a shape")
    }

    /// A board of `pool` with one device per entry of `leases` (its endpoint, if any).
    fn board(
        id: &str,
        pool: Option<&str>,
        state: BoardState,
        leases: &[Option<&str>],
    ) -> BoardView {
        BoardView {
            id: id.to_owned(),
            shape: shape(),
            state,
            pool: pool.map(str::to_owned),
            devices: leases
                .iter()
                .enumerate()
                .map(|(i, e)| DeviceView {
                    id: format!("{id}.p{i}"),
                    board: id.to_owned(),
                    partition: leases.len() > 1,
                    shape: shape(),
                    state,
                    endpoint: e.map(str::to_owned),
                    reserved_for: None,
                    host: None,
                })
                .collect(),
            host: None,
            dirty_tracking: DirtyTracking::DeviceLog,
            failed: None,
        }
    }

    fn pools(names: &[&str]) -> Vec<String> {
        names.iter().map(|n| (*n).to_owned()).collect()
    }

    fn caps(pairs: &[(&str, u64)]) -> BTreeMap<String, u64> {
        pairs.iter().map(|(p, n)| ((*p).to_owned(), *n)).collect()
    }

    #[test]
    fn free_and_cluster_leased_devices_count_others_do_not() {
        let boards = [
            board("a", Some("gpu"), BoardState::Available, &[None, None]),
            board(
                "b",
                Some("gpu"),
                BoardState::Available,
                &[Some("libvirt.vm1.0")],
            ),
            board("c", Some("gpu"), BoardState::Available, &[Some("by-hand")]),
            board("d", Some("other"), BoardState::Available, &[None]),
            board("e", None, BoardState::Available, &[None, None]),
        ];
        assert_eq!(
            capacity(&pools(&["gpu", "other", "empty"]), &boards),
            caps(&[("gpu", 3), ("other", 1), ("empty", 0)])
        );
    }

    #[test]
    fn sick_boards_give_nothing_and_their_outside_leases_still_take() {
        let mut failed = board("f", Some("gpu"), BoardState::Quarantined, &[None]);
        failed.failed = Some(BoardFailure {
            reason: "the engine of queue 0 died".into(),
            state_intact: true,
        });
        let boards = [
            board("a", Some("gpu"), BoardState::Available, &[None, None, None]),
            board(
                "q",
                Some("gpu"),
                BoardState::Quarantined,
                &[Some("by-hand")],
            ),
            board(
                "m",
                Some("gpu"),
                BoardState::Missing,
                &[Some("libvirt.vm.0")],
            ),
            failed,
        ];
        // 3 healthy, 1 taken by an endpoint outside the cluster (it will move to one).
        assert_eq!(capacity(&pools(&["gpu"]), &boards), caps(&[("gpu", 2)]));
        // A board failed but not (yet) quarantined is not healthy either.
        let mut failing = board("a", Some("gpu"), BoardState::Available, &[None]);
        failing.failed = Some(BoardFailure {
            reason: "VRAM failed".into(),
            state_intact: false,
        });
        assert_eq!(capacity(&pools(&["gpu"]), &[failing]), caps(&[("gpu", 0)]));
    }

    #[test]
    fn a_move_reservation_takes_a_device() {
        let mut b = board("a", Some("gpu"), BoardState::Available, &[None, None]);
        b.devices[1].reserved_for = Some("libvirt.vm.0".into());
        assert_eq!(capacity(&pools(&["gpu"]), &[b]), caps(&[("gpu", 1)]));
    }

    #[test]
    fn capacity_is_never_negative() {
        let boards = [
            board("a", Some("gpu"), BoardState::Available, &[None]),
            board(
                "q",
                Some("gpu"),
                BoardState::Quarantined,
                &[Some("x"), Some("y")],
            ),
        ];
        assert_eq!(capacity(&pools(&["gpu"]), &boards), caps(&[("gpu", 0)]));
    }

    #[test]
    fn attribute_names_replace_what_pacemaker_would_not_take() {
        assert_eq!(attribute("gpu"), "swy_gpu_gpus");
        assert_eq!(attribute("a100.big-1_x"), "swy_a100_big_1_x_gpus");
        let attrs = attributes(&caps(&[("gpu", 2), ("h.100", 0)])).expect("distinct");
        assert_eq!(
            attrs,
            [
                ("swy_gpu_gpus".to_owned(), 2),
                ("swy_h_100_gpus".to_owned(), 0)
            ]
        );
        let clash = attributes(&caps(&[("a-b", 1), ("a.b", 1)])).expect_err("a clash");
        assert!(clash.to_string().contains("swy_a_b_gpus"), "{clash}");
    }
}
