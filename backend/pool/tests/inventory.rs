//! The in-memory model: lease selection, moves and their shape checks, detach/attach, drain
//! planning, quarantine, and refusals that change nothing.
#![forbid(unsafe_code)]

mod common;
use common::{KINDS, in_pool, on_device};
use switchyard_pool::{
    BoardState, EndpointSpec, ErrorKind, EventKind, Inventory, MovePlan, Placement, PoolConfig,
    PoolError,
};

/// Pools `fast` (a0, a1: 256M/4q), `parts` (p0, p1: 256M/4q, each two 128M/2q partitions),
/// `small` (s0, s1: 64M/2q); boards in no pool: `loose` (as a0) and `msi0` (as a0 but MSI).
const CONFIG: &str = r#"
[daemon]
endpoint_dir = "/run/sy"

[[boards]]
id = "a0"
vram = "256M"
queues = 4
[[boards]]
id = "a1"
vram = "256M"
queues = 4
[[boards]]
id = "p0"
vram = "256M"
queues = 4
partitions = [ { id = "p0.0", vram = "128M", queues = 2 }, { id = "p0.1", vram = "128M", queues = 2 } ]
[[boards]]
id = "p1"
vram = "256M"
queues = 4
partitions = [ { id = "p1.0", vram = "128M", queues = 2 }, { id = "p1.1", vram = "128M", queues = 2 } ]
[[boards]]
id = "s0"
[[boards]]
id = "s1"
[[boards]]
id = "loose"
vram = "256M"
queues = 4
[[boards]]
id = "msi0"
vram = "256M"
queues = 4
irq = "msi"

[[pools]]
name = "fast"
boards = ["a0", "a1"]
[[pools]]
name = "parts"
boards = ["p0", "p1"]
[[pools]]
name = "small"
boards = ["s0", "s1"]
"#;

fn inventory() -> Inventory {
    let config = PoolConfig::from_toml(CONFIG, KINDS).expect("config");
    let (inv, events, report) = Inventory::from_config(&config, KINDS).expect("inventory");
    assert!(report.failed_endpoints.is_empty());
    assert!(matches!(
        events.last().map(|e| &e.kind),
        Some(EventKind::Opened {
            boards: 8,
            endpoints: 0
        })
    ));
    inv
}

fn lease(inv: &Inventory, endpoint: &str) -> Option<String> {
    inv.endpoint(endpoint).expect("endpoint").device.clone()
}

/// Everything observable, to show that a refused operation changed nothing.
fn state(inv: &Inventory) -> String {
    let endpoints: Vec<_> = inv.endpoints().collect();
    serde_json::to_string(&(inv.boards(), inv.pools(), endpoints, inv.next_seq())).expect("json")
}

/// Runs a refused operation; asserts its kind and that nothing changed; returns the error.
fn refused<T: std::fmt::Debug>(
    inv: &mut Inventory,
    kind: ErrorKind,
    op: impl FnOnce(&mut Inventory) -> Result<T, PoolError>,
) -> PoolError {
    let before = state(inv);
    let e = op(inv).expect_err("operation must be refused");
    assert_eq!(e.kind(), kind, "{e}");
    let msg = e.to_string();
    assert!(msg.starts_with(|c: char| c.is_ascii_uppercase()), "{msg}");
    assert_eq!(
        state(inv),
        before,
        "a refused operation changed the state: {e}"
    );
    e
}

#[test]
fn pool_leases_go_to_the_first_free_device_meeting_the_requirements() {
    let mut inv = inventory();
    let ev = inv.create_endpoint(&in_pool("vm1", "fast")).expect("vm1");
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("a0"));
    assert!(
        matches!(&ev[..], [e] if e.kind == EventKind::EndpointCreated {
            endpoint: "vm1".into(), device: Some("a0".into()), socket: "/run/sy/vm1.sock".into()
        })
    );
    inv.create_endpoint(&in_pool("vm2", "fast")).expect("vm2");
    assert_eq!(lease(&inv, "vm2").as_deref(), Some("a1"));
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.create_endpoint(&in_pool("vm3", "fast"))
    });
    assert!(matches!(e, PoolError::NoCapacity { .. }), "{e}");

    // Partitions, in board order; requirements filter.
    let spec = EndpointSpec {
        min_vram: Some(256 << 20),
        ..in_pool("big", "parts")
    };
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.create_endpoint(&spec));
    assert_eq!(
        e.to_string(),
        "No free device in pool \"parts\" has at least 256 MiB of VRAM"
    );
    let spec = EndpointSpec {
        min_queues: Some(3),
        ..in_pool("many", "parts")
    };
    refused(&mut inv, ErrorKind::Conflict, |i| i.create_endpoint(&spec));
    let spec = EndpointSpec {
        min_vram: Some(128 << 20),
        min_queues: Some(2),
        ..in_pool("p", "parts")
    };
    inv.create_endpoint(&spec).expect("fits a partition");
    assert_eq!(lease(&inv, "p").as_deref(), Some("p0.0"));
    inv.create_endpoint(&in_pool("q", "parts")).expect("q");
    assert_eq!(lease(&inv, "q").as_deref(), Some("p0.1"));
    inv.create_endpoint(&in_pool("r", "parts")).expect("r");
    assert_eq!(lease(&inv, "r").as_deref(), Some("p1.0"));
    let view = inv.board("p0").expect("p0");
    assert!(
        view.devices
            .iter()
            .all(|d| d.partition && d.endpoint.is_some())
    );
    let parts = inv
        .pools()
        .into_iter()
        .find(|p| p.name == "parts")
        .expect("parts");
    assert_eq!((parts.devices, parts.free), (4, 1));
}

#[test]
fn named_devices_are_checked() {
    let mut inv = inventory();
    inv.create_endpoint(&on_device("vm1", "p1.1"))
        .expect("a partition");
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("p1.1"));
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.create_endpoint(&on_device("vm2", "p1.1"))
    });
    assert_eq!(
        e.to_string(),
        "Device \"p1.1\" is in use by endpoint \"vm1\""
    );
    let e = refused(&mut inv, ErrorKind::Invalid, |i| {
        i.create_endpoint(&on_device("vm2", "p0"))
    });
    assert!(
        matches!(e, PoolError::NotLeasable(ref b) if b == "p0"),
        "{e}"
    );
    let e = refused(&mut inv, ErrorKind::NotFound, |i| {
        i.create_endpoint(&on_device("vm2", "nope"))
    });
    assert!(matches!(e, PoolError::UnknownDevice(_)), "{e}");
    let e = refused(&mut inv, ErrorKind::NotFound, |i| {
        i.create_endpoint(&in_pool("vm2", "nope"))
    });
    assert!(matches!(e, PoolError::UnknownPool(_)), "{e}");
    let spec = EndpointSpec {
        min_vram: Some(128 << 20),
        ..on_device("vm2", "s0")
    };
    let e = refused(&mut inv, ErrorKind::Invalid, |i| i.create_endpoint(&spec));
    assert_eq!(
        e.to_string(),
        "Device \"s0\" does not meet the requirements: 64 MiB of device memory, at least 128 MiB required"
    );
    inv.quarantine("s0").expect("quarantine");
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.create_endpoint(&on_device("vm2", "s0"))
    });
    assert!(
        matches!(
            e,
            PoolError::BoardUnavailable {
                state: BoardState::Quarantined,
                ..
            }
        ),
        "{e}"
    );
    inv.create_endpoint(&on_device("vm2", "s1"))
        .expect("the other board");
}

#[test]
fn endpoint_ids_sockets_and_placement_are_checked() {
    let mut inv = inventory();
    inv.create_endpoint(&in_pool("vm1", "small")).expect("vm1");
    for bad in ["", "a b", "x/y", &"e".repeat(65), "é"] {
        let e = refused(&mut inv, ErrorKind::Invalid, |i| {
            i.create_endpoint(&in_pool(bad, "small"))
        });
        assert!(matches!(e, PoolError::BadId(_)), "{bad}: {e}");
    }
    for (taken, holder) in [
        ("vm1", "endpoint \"vm1\""),
        ("a0", "board \"a0\""),
        ("p0.1", "a partition of board \"p0\""),
        ("fast", "pool \"fast\""),
    ] {
        let e = refused(&mut inv, ErrorKind::Conflict, |i| {
            i.create_endpoint(&in_pool(taken, "small"))
        });
        assert_eq!(
            e.to_string(),
            format!("The id \"{taken}\" is already used by {holder}")
        );
    }
    let both = EndpointSpec {
        device: Some("s1".into()),
        ..in_pool("vm2", "small")
    };
    let e = refused(&mut inv, ErrorKind::Invalid, |i| i.create_endpoint(&both));
    assert_eq!(e.to_string(), "Give either a pool or a device, not both");
    let neither = EndpointSpec {
        id: "vm2".into(),
        ..EndpointSpec::default()
    };
    // Several pools: which one is the caller's to say.
    refused(&mut inv, ErrorKind::Invalid, |i| {
        i.create_endpoint(&neither)
    });
    for socket in [
        "relative.sock".to_owned(),
        format!("/{}", "s".repeat(107)),
        "/run/sy/vm1.sock".to_owned(),
    ] {
        let spec = EndpointSpec {
            socket: Some(socket.clone().into()),
            ..in_pool("vm2", "small")
        };
        let e = refused(&mut inv, ErrorKind::Invalid, |i| i.create_endpoint(&spec));
        assert!(
            matches!(e, PoolError::BadSocketPath { .. }),
            "{socket}: {e}"
        );
    }
    // The longest id makes a default socket path that fits (positive control), and an
    // explicit path is kept.
    let long = "e".repeat(64);
    inv.create_endpoint(&in_pool(&long, "small"))
        .expect("64-character id");
    let spec = EndpointSpec {
        socket: Some("/tmp/own.sock".into()),
        ..in_pool("vm3", "fast")
    };
    inv.create_endpoint(&spec).expect("explicit socket");
    assert_eq!(
        inv.endpoint("vm3").expect("vm3").socket.to_str(),
        Some("/tmp/own.sock")
    );
}

#[test]
fn with_one_pool_an_endpoint_needs_no_placement() {
    let config = PoolConfig::from_toml(
        "[[boards]]\nid = \"g0\"\n[[boards]]\nid = \"g1\"\n[[pools]]\nname = \"only\"\nboards = [\"g0\", \"g1\"]\n",
        KINDS,
    )
    .expect("config");
    let (mut inv, _, _) = Inventory::from_config(&config, KINDS).expect("inventory");
    let spec = EndpointSpec {
        id: "vm1".into(),
        ..EndpointSpec::default()
    };
    inv.create_endpoint(&spec)
        .expect("leases from the only pool");
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("g0"));
    let e = inv.endpoint("vm1").expect("endpoint");
    assert_eq!(
        e.pool.as_deref(),
        Some("only"),
        "attach falls back on it later"
    );
}

#[test]
fn delete_frees_the_lease() {
    let mut inv = inventory();
    inv.create_endpoint(&in_pool("vm1", "fast")).expect("vm1");
    let ev = inv.delete_endpoint("vm1").expect("delete");
    assert_eq!(
        ev[0].kind,
        EventKind::EndpointDeleted {
            endpoint: "vm1".into(),
            device: Some("a0".into())
        }
    );
    assert!(inv.endpoint("vm1").is_none());
    inv.create_endpoint(&in_pool("vm2", "fast")).expect("vm2");
    assert_eq!(
        lease(&inv, "vm2").as_deref(),
        Some("a0"),
        "a0 is free again"
    );
    refused(&mut inv, ErrorKind::NotFound, |i| i.delete_endpoint("vm1"));
}

#[test]
fn moves_keep_the_shape_and_reserve_the_target() {
    let mut inv = inventory();
    inv.create_endpoint(&in_pool("vm1", "fast")).expect("vm1");
    inv.create_endpoint(&on_device("vm2", "loose"))
        .expect("vm2");

    let e = refused(&mut inv, ErrorKind::Invalid, |i| i.plan_move("vm1", "s0"));
    assert_eq!(
        e.to_string(),
        "Device \"s0\" differs from \"a0\" in memory (64 MiB vs 256 MiB); a move must not change what the guest sees"
    );
    let e = refused(&mut inv, ErrorKind::Invalid, |i| i.plan_move("vm1", "msi0"));
    assert!(e.to_string().contains("in irq (msi vs msix)"), "{e}");
    let e = refused(&mut inv, ErrorKind::Invalid, |i| i.plan_move("vm1", "p1.0"));
    assert!(
        e.to_string().contains("in memory (128 MiB vs 256 MiB)"),
        "{e}"
    );
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.plan_move("vm1", "loose")
    });
    assert!(matches!(e, PoolError::DeviceBusy { .. }), "{e}");
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.plan_move("vm1", "a0"));
    assert!(matches!(e, PoolError::SameDevice { .. }), "{e}");
    refused(&mut inv, ErrorKind::NotFound, |i| i.plan_move("vm1", "zz"));
    refused(&mut inv, ErrorKind::NotFound, |i| i.plan_move("zz", "a1"));
    refused(&mut inv, ErrorKind::Invalid, |i| i.plan_move("vm1", "p0"));
    inv.quarantine("a1").expect("quarantine");
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.plan_move("vm1", "a1"));
    assert!(matches!(e, PoolError::BoardUnavailable { .. }), "{e}");
    inv.unquarantine("a1").expect("release");

    // The dry run reserves nothing; the plan does.
    let dry = inv.check_move("vm1", "a1").expect("check");
    assert_eq!(inv.device("a1").expect("a1").reserved_for, None);
    let (plan, ev) = inv.plan_move("vm1", "a1").expect("plan");
    assert_eq!(plan, dry);
    assert_eq!(
        (plan.from_board.as_str(), plan.to_board.as_str()),
        ("a0", "a1")
    );
    assert_eq!(plan.shape.memory(), 256 << 20);
    assert_eq!(
        ev[0].kind,
        EventKind::MoveStarted {
            endpoint: "vm1".into(),
            from: "a0".into(),
            to: "a1".into()
        }
    );
    assert_eq!(
        inv.device("a1").expect("a1").reserved_for.as_deref(),
        Some("vm1")
    );
    assert_eq!(inv.pending_moves(), vec![plan.clone()]);
    // While it moves: the target is taken, the endpoint cannot be changed otherwise.
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.create_endpoint(&on_device("vm3", "a1"))
    });
    assert!(matches!(e, PoolError::DeviceBusy { ref endpoint, .. } if endpoint == "vm1"));
    refused(&mut inv, ErrorKind::Conflict, |i| {
        i.create_endpoint(&in_pool("vm3", "fast"))
    });
    refused(&mut inv, ErrorKind::Conflict, |i| i.plan_move("vm2", "a1"));
    for e in [
        refused(&mut inv, ErrorKind::Conflict, |i| i.delete_endpoint("vm1")),
        refused(&mut inv, ErrorKind::Conflict, |i| i.detach("vm1")),
        refused(&mut inv, ErrorKind::Conflict, |i| {
            i.plan_move("vm1", "loose")
        }),
    ] {
        assert!(matches!(e, PoolError::MoveInProgress { .. }), "{e}");
    }
    let stale = MovePlan {
        to: "loose".into(),
        ..plan.clone()
    };
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.commit_move(&stale));
    assert!(matches!(e, PoolError::NoSuchMove { .. }), "{e}");

    let ev = inv.commit_move(&plan).expect("commit");
    assert_eq!(
        ev[0].kind,
        EventKind::LeaseMoved {
            endpoint: "vm1".into(),
            from: "a0".into(),
            to: "a1".into()
        }
    );
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("a1"));
    assert_eq!(inv.device("a0").expect("a0").endpoint, None);
    assert_eq!(inv.device("a1").expect("a1").reserved_for, None);
    // Committing twice is refused.
    refused(&mut inv, ErrorKind::Conflict, |i| i.commit_move(&plan));

    // Abort: the endpoint keeps its device, the target is free again.
    let (back, _) = inv.plan_move("vm1", "a0").expect("plan back");
    let ev = inv.abort_move(&back).expect("abort");
    assert!(matches!(ev[0].kind, EventKind::MoveAborted { .. }));
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("a1"));
    inv.create_endpoint(&on_device("vm3", "a0"))
        .expect("a0 free after the abort");

    // Partitions of the same shape on another board are move targets.
    inv.create_endpoint(&on_device("pp", "p0.1")).expect("pp");
    let (plan, _) = inv.plan_move("pp", "p1.0").expect("partition to partition");
    inv.commit_move(&plan).expect("commit");
    assert_eq!(lease(&inv, "pp").as_deref(), Some("p1.0"));
}

#[test]
fn detach_and_attach_hand_devices_over() {
    let mut inv = inventory();
    inv.create_endpoint(&in_pool("vm1", "fast")).expect("vm1");
    inv.create_endpoint(&on_device("vm2", "s0")).expect("vm2");
    let ev = inv.detach("vm1").expect("detach");
    assert_eq!(
        ev[0].kind,
        EventKind::Detached {
            endpoint: "vm1".into(),
            device: "a0".into()
        }
    );
    assert_eq!(lease(&inv, "vm1"), None);
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.detach("vm1"));
    assert!(matches!(e, PoolError::NotLeased(_)), "{e}");
    refused(&mut inv, ErrorKind::Conflict, |i| i.plan_move("vm1", "a1"));
    // vm2 takes a0 (a device of another shape than it had: attach is not a move).
    inv.detach("vm2").expect("detach vm2");
    let ev = inv
        .attach(
            "vm2",
            &Placement {
                device: Some("a0".into()),
                ..Placement::default()
            },
        )
        .expect("attach a0");
    assert_eq!(
        ev[0].kind,
        EventKind::Attached {
            endpoint: "vm2".into(),
            device: "a0".into()
        }
    );
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.attach("vm2", &Placement::default())
    });
    assert!(matches!(e, PoolError::AlreadyLeased { .. }), "{e}");
    // vm1 re-attaches from its own pool; a0 is taken, so a1.
    inv.attach("vm1", &Placement::default()).expect("own pool");
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("a1"));
    // An endpoint created on a device has no pool to fall back on.
    inv.detach("vm2").expect("detach");
    let e = refused(&mut inv, ErrorKind::Invalid, |i| {
        i.attach("vm2", &Placement::default())
    });
    assert!(matches!(e, PoolError::BadPlacement(_)), "{e}");
    let fast = Placement {
        pool: Some("fast".into()),
        device: None,
    };
    inv.attach("vm2", &fast).expect("fast");
    assert_eq!(lease(&inv, "vm2").as_deref(), Some("a0"));
    assert_eq!(
        inv.endpoint("vm2").expect("vm2").pool.as_deref(),
        Some("fast")
    );
    // A full pool refuses.
    inv.create_endpoint(&on_device("vm3", "s1")).expect("vm3");
    inv.detach("vm3").expect("detach vm3");
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.attach("vm3", &fast));
    assert!(matches!(e, PoolError::NoCapacity { .. }), "{e}");
    refused(&mut inv, ErrorKind::NotFound, |i| i.attach("zz", &fast));
}

#[test]
fn drain_plans_every_move_off_a_board_or_none() {
    let mut inv = inventory();
    // vm1 on a0 goes to a1, its pool's other board.
    inv.create_endpoint(&on_device("vm1", "a0")).expect("vm1");
    let plans = inv.plan_drain("a0").expect("plan");
    assert_eq!(plans.len(), 1);
    assert_eq!((plans[0].from.as_str(), plans[0].to.as_str()), ("a0", "a1"));
    // With a1 taken, a same-shape board outside the pool.
    inv.create_endpoint(&on_device("vm2", "a1")).expect("vm2");
    let plans = inv.plan_drain("a0").expect("plan");
    assert_eq!(plans[0].to, "loose");
    // Two endpoints on p0's partitions, but only one free partition elsewhere: refused as a
    // whole, nothing quarantined or reserved.
    inv.create_endpoint(&on_device("x", "p0.0")).expect("x");
    inv.create_endpoint(&on_device("y", "p0.1")).expect("y");
    inv.create_endpoint(&on_device("z", "p1.1")).expect("z");
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.drain("p0"));
    assert_eq!(
        e.to_string(),
        "Cannot drain board \"p0\": endpoint \"y\" cannot move"
    );
    let reason = std::error::Error::source(&e).expect("the reason is the source");
    assert_eq!(
        reason.to_string(),
        "No free device on an available board has the same shape as \"p0.1\""
    );
    assert_eq!(inv.board("p0").expect("p0").state, BoardState::Available);
    // Free a partition: both move, to distinct targets.
    inv.delete_endpoint("z").expect("delete z");
    let (plans, events) = inv.drain("p0").expect("drain");
    let moves: Vec<(&str, &str)> = plans
        .iter()
        .map(|p| (p.from.as_str(), p.to.as_str()))
        .collect();
    assert_eq!(moves, [("p0.0", "p1.0"), ("p0.1", "p1.1")]);
    let kinds: Vec<&EventKind> = events.iter().map(|e| &e.kind).collect();
    assert!(matches!(
        kinds[..],
        [
            EventKind::BoardQuarantined { .. },
            EventKind::DrainStarted { .. },
            EventKind::MoveStarted { .. },
            EventKind::MoveStarted { .. }
        ]
    ));
    assert_eq!(inv.board("p0").expect("p0").state, BoardState::Quarantined);
    assert_eq!(inv.pending_moves(), plans);
    // Draining again while those moves run is refused.
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.drain("p0"));
    assert!(
        matches!(&e, PoolError::DrainRefused { endpoint, reason, .. }
            if endpoint == "x" && matches!(**reason, PoolError::MoveInProgress { .. })),
        "{e:?}"
    );
    for plan in &plans {
        inv.commit_move(plan).expect("commit");
    }
    assert!(
        inv.board("p0")
            .expect("p0")
            .devices
            .iter()
            .all(|d| d.endpoint.is_none())
    );
    // An empty board drains to nothing (and is quarantined); unknown boards are not found.
    let (plans, _) = inv.drain("s1").expect("empty");
    assert!(plans.is_empty());
    assert_eq!(inv.board("s1").expect("s1").state, BoardState::Quarantined);
    refused(&mut inv, ErrorKind::NotFound, |i| i.drain("zz"));
}

#[test]
fn drain_prefers_the_boards_own_pool() {
    // `x0` (in no pool) comes first in the configuration, `other` is a second pool: the
    // endpoint on y0 still goes to y1.
    let config = PoolConfig::from_toml(
        "[[boards]]\nid = \"x0\"\n[[boards]]\nid = \"z0\"\n[[boards]]\nid = \"y0\"\n\
         [[boards]]\nid = \"y1\"\n[[pools]]\nname = \"other\"\nboards = [\"z0\"]\n\
         [[pools]]\nname = \"y\"\nboards = [\"y0\", \"y1\"]\n",
        KINDS,
    )
    .expect("config");
    let (mut inv, _, _) = Inventory::from_config(&config, KINDS).expect("inventory");
    inv.create_endpoint(&on_device("vm", "y0")).expect("vm");
    assert_eq!(inv.plan_drain("y0").expect("plan")[0].to, "y1");
    // Then the other pools, then boards in no pool.
    inv.quarantine("y1").expect("quarantine");
    assert_eq!(inv.plan_drain("y0").expect("plan")[0].to, "z0");
    inv.quarantine("z0").expect("quarantine");
    assert_eq!(inv.plan_drain("y0").expect("plan")[0].to, "x0");
}

#[test]
fn drain_refuses_when_a_target_is_quarantined() {
    let mut inv = inventory();
    inv.create_endpoint(&on_device("vm1", "s0")).expect("vm1");
    inv.plan_drain("s0").expect("s1 is a target");
    inv.quarantine("s1").expect("quarantine s1");
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.drain("s0"));
    assert!(matches!(e, PoolError::DrainRefused { .. }), "{e}");
}

#[test]
fn quarantine_stops_new_leases_only() {
    let mut inv = inventory();
    inv.create_endpoint(&in_pool("vm1", "small")).expect("vm1");
    let ev = inv.quarantine("s0").expect("quarantine");
    assert_eq!(
        ev[0].kind,
        EventKind::BoardQuarantined { board: "s0".into() }
    );
    assert!(
        inv.quarantine("s0").expect("again").is_empty(),
        "idempotent"
    );
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("s0"), "the lease stays");
    let view = inv.device("s0").expect("s0");
    assert_eq!(view.state, BoardState::Quarantined);
    // New leases skip it.
    inv.create_endpoint(&in_pool("vm2", "small")).expect("vm2");
    assert_eq!(lease(&inv, "vm2").as_deref(), Some("s1"));
    inv.delete_endpoint("vm1").expect("free s0");
    refused(&mut inv, ErrorKind::Conflict, |i| {
        i.create_endpoint(&in_pool("vm3", "small"))
    });
    let ev = inv.unquarantine("s0").expect("release");
    assert_eq!(ev[0].kind, EventKind::BoardReleased { board: "s0".into() });
    assert!(inv.unquarantine("s0").expect("again").is_empty());
    inv.create_endpoint(&in_pool("vm3", "small")).expect("vm3");
    assert_eq!(lease(&inv, "vm3").as_deref(), Some("s0"));
    refused(&mut inv, ErrorKind::NotFound, |i| i.quarantine("zz"));
    // A partition is not a board.
    refused(&mut inv, ErrorKind::NotFound, |i| i.quarantine("p0.0"));
}

#[test]
fn events_are_numbered_without_gaps_and_tagged_in_json() {
    let mut inv = inventory();
    let first = inv.next_seq();
    let mut seqs = Vec::new();
    seqs.extend(
        inv.create_endpoint(&in_pool("vm1", "fast"))
            .expect("create"),
    );
    refused(&mut inv, ErrorKind::NotFound, |i| i.detach("zz"));
    seqs.extend(inv.detach("vm1").expect("detach"));
    seqs.extend(inv.drain("a0").expect("drain").1);
    let numbers: Vec<u64> = seqs.iter().map(|e| e.seq).collect();
    assert_eq!(numbers, (first..first + 4).collect::<Vec<_>>());
    let json = serde_json::to_value(&seqs[0]).expect("json");
    assert_eq!(json["kind"]["type"], "endpoint_created");
    assert_eq!(json["kind"]["device"], "a0");
    assert!(json["at_unix_ms"].as_u64().expect("time") > 1_600_000_000_000);
    let back: switchyard_pool::Event = serde_json::from_value(json).expect("decode");
    assert_eq!(back, seqs[0]);
}

#[test]
fn views_list_boards_devices_and_holders() {
    let mut inv = inventory();
    inv.create_endpoint(&on_device("vm1", "p1.1")).expect("vm1");
    let boards = inv.boards();
    let ids: Vec<&str> = boards.iter().map(|b| b.id.as_str()).collect();
    assert_eq!(ids, ["a0", "a1", "p0", "p1", "s0", "s1", "loose", "msi0"]);
    let p1 = &boards[3];
    assert_eq!(p1.pool.as_deref(), Some("parts"));
    assert_eq!(p1.shape.memory(), 256 << 20);
    let devs: Vec<(&str, Option<&str>)> = p1
        .devices
        .iter()
        .map(|d| (d.id.as_str(), d.endpoint.as_deref()))
        .collect();
    assert_eq!(devs, [("p1.0", None), ("p1.1", Some("vm1"))]);
    assert_eq!(p1.devices[1].shape.memory(), 128 << 20);
    assert_eq!(p1.devices[1].shape.queues(), 2);
    // A partition's options are the board's with its own VRAM and queues.
    assert_eq!(p1.devices[1].shape.options["vram"], 128u64 << 20);
    assert_eq!(p1.devices[1].shape.options["irq"], "msix");
    assert!(!boards[0].devices[0].partition);
    assert_eq!(boards[6].pool, None);
    let json = serde_json::to_value(&boards[7]).expect("json");
    assert_eq!(json["shape"]["model"], "softgpu");
    assert_eq!(json["shape"]["options"]["irq"], "msi");
    assert_eq!(json["shape"]["profile"]["memory"], 256u64 << 20);
    // Also under the name earlier releases gave it, for their readers.
    assert_eq!(json["shape"]["profile"]["vram"], 256u64 << 20);
    assert_eq!(json["shape"]["profile"]["msix"], false);
    assert_eq!(json["state"], "available");
    assert_eq!(json["dirty_tracking"], "device_log");
}

const PASSTHROUGH: &str = r#"
[[boards]]
id = "edu0"
model = "vfio"
host = "0000:00:04.0"

[[boards]]
id = "edu1"
model = "vfio"
host = "00:05.0"

[[boards]]
id = "gpu0"

[[pools]]
name = "edus"
boards = ["edu0", "edu1"]
"#;

#[test]
fn passthrough_boards_are_leased_detached_and_attached_but_never_moved() {
    let config = PoolConfig::from_toml(PASSTHROUGH, KINDS).expect("config");
    let (mut inv, _, _) = Inventory::from_config(&config, KINDS).expect("inventory");
    let edu0 = inv.board("edu0").expect("edu0");
    assert_eq!(edu0.host.as_deref(), Some("0000:00:04.0"));
    assert_eq!(edu0.shape.model, "vfio");
    assert_eq!(
        edu0.dirty_tracking,
        switchyard_pool::DirtyTracking::AllMapped
    );
    assert_eq!(edu0.devices[0].host.as_deref(), Some("0000:00:04.0"));
    assert_eq!(
        inv.board("edu1").expect("edu1").host.as_deref(),
        Some("0000:00:05.0"),
        "the kind's canonical address"
    );
    assert_eq!(inv.board("gpu0").expect("gpu0").host, None);
    // A VRAM requirement never picks a passthrough board: its VRAM is the hardware's business.
    let mut wants_vram = in_pool("big", "edus");
    wants_vram.min_vram = Some(1 << 20);
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.create_endpoint(&wants_vram)
    });
    assert!(matches!(e, PoolError::NoCapacity { .. }), "{e}");
    inv.create_endpoint(&in_pool("vm1", "edus")).expect("vm1");
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("edu0"));
    // Its state is in the hardware: no move, no drain; detach and attach instead.
    let e = refused(&mut inv, ErrorKind::Conflict, |i| {
        i.plan_move("vm1", "edu1")
    });
    assert!(matches!(e, PoolError::NotMovable { .. }), "{e}");
    assert!(e.to_string().contains("detach it"), "{e}");
    let e = refused(&mut inv, ErrorKind::Conflict, |i| i.drain("edu0"));
    assert!(matches!(e, PoolError::DrainRefused { .. }), "{e}");
    inv.detach("vm1").expect("detach");
    inv.create_endpoint(&on_device("vm2", "edu0"))
        .expect("vm2 takes the detached device");
    inv.attach("vm1", &Placement::default()).expect("attach");
    assert_eq!(lease(&inv, "vm1").as_deref(), Some("edu1"));
}
