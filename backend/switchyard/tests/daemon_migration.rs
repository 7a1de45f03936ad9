//! Live migration between two endpoints of one pool daemon: `ctl create DST --incoming-for
//! SRC` leases a device of the source's shape, and the daemon follows the destination's
//! migration states. The migration is driven by our VMM-side client's `Migration`, over the
//! guest's own connection on the source, the way QEMU drives it.
//!
//! Workers outlive their daemon by design, so every test kills the daemon and then every
//! worker it recorded when it ends (`common::daemon::Daemon`'s drop).
#![forbid(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::daemon::{Daemon, api_status, connect, socket_of};
use serde_json::{Value, json};
use switchyard_client::migrate::{Migration, PreCopyPlan};

/// Two boards of one shape in a pool, and one of another shape in none.
const BOARDS: &str = "[[boards]]\nid = \"a\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"b\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"big\"\nvram = \"32M\"\nqueues = 2\nvram_mmap = false\n\
     [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\"]\n";

/// Waits until `f` holds (10 s).
fn wait(what: &str, f: impl FnMut() -> bool) {
    common::wait_until(what, Duration::from_secs(10), f);
}

/// The value of metric `name` (without labels).
fn metric(d: &Daemon, name: &str) -> String {
    let text = d.client().get_text("/metrics").expect("metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} missing:\n{text}"))
        .trim()
        .to_owned()
}

#[test]
fn a_completed_migration_onto_an_incoming_endpoint_hands_the_lease_over() {
    let mut d = Daemon::start_with_config(BOARDS);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let e1 = d.endpoint("vm1");
    assert_eq!(e1["lease"]["board"], "a", "{e1}");
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    let secret: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 7 + 3) as u8).collect();
    guest.vram_write(0x1000, &secret);

    let out = d.ctl_ok(&["create", "vm1-in", "--incoming-for", "vm1"]);
    assert!(out.contains("live migration of vm1"), "{out}");
    let e2 = d.endpoint("vm1-in");
    assert_eq!(e2["incoming_for"], "vm1", "{e2}");
    assert_eq!(
        e2["lease"]["board"], "b",
        "the free board of vm1's shape: {e2}"
    );
    // One incoming endpoint per source; an incoming endpoint is not a source.
    let api = d.client();
    assert_eq!(
        api_status(api.post("/v1/endpoints/vm1/incoming", &json!({"id": "again"}))),
        (409, "incoming".into())
    );
    assert_eq!(
        api_status(api.post("/v1/endpoints/vm1-in/incoming", &json!({"id": "x"}))),
        (409, "incoming".into())
    );

    // The VMMs migrate: the source's over the guest's connection.
    let mut dst = switchyard_client::Client::connect(socket_of(&e2)).expect("destination");
    {
        let mut mig = Migration::new(&mut guest.t.0, &mut dst);
        mig.prepare_destination().expect("destination RESUMING");
        mig.pre_copy(&PreCopyPlan::default()).expect("pre-copy");
        mig.switchover().expect("switchover");
    }
    // The destination runs with the source's VRAM; its endpoint is an ordinary one now.
    let mut back = vec![0u8; secret.len()];
    let mut dst = common::driver::Driver::new(common::ours::Ours(dst));
    dst.vram_read(0x1000, &mut back);
    assert!(back == secret, "the destination's VRAM differs");
    wait("the migration is not committed", || {
        d.endpoint("vm1-in").get("incoming_for").is_none()
    });
    assert_eq!(d.worker_events("migrated").len(), 1, "{:?}", d.events());
    assert_eq!(metric(&d, "switchyard_migrations_completed_total"), "1");
    // `migrated` comes after the destination's RUNNING that completed the migration.
    let seq_of = |kind: &str, wanted: &dyn Fn(&Value) -> bool| {
        d.events()
            .into_iter()
            .find(|e| e["worker"]["event"] == kind && wanted(&e["worker"]))
            .and_then(|e| e["seq"].as_u64())
            .unwrap_or_else(|| panic!("no such {kind} event: {:?}", d.events()))
    };
    let running = seq_of("migration", &|w| {
        w["endpoint"] == "vm1-in" && w["state"] == "running"
    });
    let migrated = seq_of("migrated", &|_| true);
    assert!(running < migrated, "{:?}", d.events());
    // The source's VMM stops its device and lets go (QEMU quits after a migration): the
    // source's lease goes. It abandoned no migration: its device runs again (`client_left`),
    // reported before the daemon learns that the VMM let go.
    guest
        .t
        .0
        .set_mig_state(switchyard_proto::consts::VFIO_DEVICE_STATE_STOP)
        .expect("source STOP");
    drop(guest);
    wait("the source endpoint is still there", || {
        d.client().get("/v1/endpoints/vm1").is_err()
    });
    let source_changes: Vec<Value> = d
        .worker_events("migration")
        .into_iter()
        .filter(|w| w["endpoint"] == "vm1")
        .collect();
    assert!(
        source_changes
            .iter()
            .any(|w| w["state"] == "running" && w["cause"] == "client_left"),
        "{source_changes:?}"
    );
    assert!(
        source_changes.iter().all(|w| w["cause"] != "client_gone"),
        "{source_changes:?}"
    );
    let boards: Vec<Value> = d
        .client()
        .get("/v1/boards")
        .expect("boards")
        .json()
        .expect("json");
    let a = boards.iter().find(|b| b["id"] == "a").expect("board a");
    assert!(
        a["devices"][0]["endpoint"].is_null(),
        "board a is free: {a}"
    );
    let migrated = &d.worker_events("migrated")[0];
    assert_eq!(
        (migrated["endpoint"].as_str(), migrated["source"].as_str()),
        (Some("vm1-in"), Some("vm1"))
    );
}

#[test]
fn an_aborted_migration_frees_the_incoming_endpoint_and_the_source_serves_on() {
    let mut d = Daemon::start_with_config(BOARDS);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let e1 = d.endpoint("vm1");
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    guest.vram_write(0, &[0x5a; 4096]);
    d.ctl_ok(&["create", "vm1-in", "--incoming-for", "vm1"]);
    let e2 = d.endpoint("vm1-in");
    // The destination VMM starts taking the stream in, then gives up (the source was
    // cancelled; QEMU's destination exits).
    let mut dst = switchyard_client::Client::connect(socket_of(&e2)).expect("destination");
    {
        let mut mig = Migration::new(&mut guest.t.0, &mut dst);
        mig.prepare_destination().expect("destination RESUMING");
    }
    drop(dst);
    wait("the incoming endpoint is still there", || {
        d.client().get("/v1/endpoints/vm1-in").is_err()
    });
    let aborted = d.worker_events("migration_aborted");
    assert_eq!(aborted.len(), 1, "{aborted:?}");
    assert_eq!(aborted[0]["source"], "vm1");
    assert_eq!(metric(&d, "switchyard_migrations_aborted_total"), "1");
    // The source serves on, its VRAM intact, and can be migrated again later.
    let mut back = [0u8; 4096];
    guest.vram_read(0, &mut back);
    assert!(back.iter().all(|&b| b == 0x5a));
    assert_eq!(d.endpoint("vm1")["lease"]["board"], "a");
    d.ctl_ok(&["create", "vm1-in2", "--incoming-for", "vm1"]);
    // An incoming endpoint deleted before its migration leaves no link behind.
    d.ctl_ok(&["delete", "vm1-in2"]);
    d.ctl_ok(&["create", "vm1-in3", "--incoming-for", "vm1"]);
    assert_eq!(d.endpoint("vm1-in3")["incoming_for"], "vm1");

    // No free device of the source's shape (the only board of vm2's shape is its own):
    // refused.
    d.ctl_ok(&["create", "vm2", "--device", "big"]);
    assert_eq!(
        api_status(
            d.client()
                .post("/v1/endpoints/vm2/incoming", &json!({"id": "vm2-in"}))
        ),
        (409, "no_capacity".into())
    );
    assert_eq!(
        api_status(
            d.client()
                .post("/v1/endpoints/nope/incoming", &json!({"id": "x"}))
        )
        .0,
        404
    );
}

/// An incoming endpoint leases from its source's pool, also when the source was created on
/// a named device (its board's pool then): never from another pool, whose devices are
/// another tenant's or another purpose's. No free device there: refused, naming the pool.
#[test]
fn an_incoming_endpoint_leases_from_the_pool_of_a_source_created_on_a_device() {
    // Two pools of boards of one shape; the first pool's boards come first.
    const TWO_POOLS: &str = "[[boards]]\nid = \"a\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
         [[boards]]\nid = \"b\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
         [[boards]]\nid = \"c\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
         [[boards]]\nid = \"d\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
         [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\"]\n\
         [[pools]]\nname = \"q\"\nboards = [\"c\", \"d\"]\n";
    let mut d = Daemon::start_with_config(TWO_POOLS);
    d.ctl_ok(&["create", "vm1", "--device", "c"]);
    d.ctl_ok(&["create", "vm1-in", "--incoming-for", "vm1"]);
    let e = d.endpoint("vm1-in");
    assert_eq!(e["lease"]["board"], "d", "from pool q, vm1's board's: {e}");
    d.ctl_ok(&["delete", "vm1-in"]);
    // Pool q full: refused, though pool p has free devices of the shape.
    d.ctl_ok(&["create", "vm2", "--device", "d"]);
    let refused = d
        .client()
        .post("/v1/endpoints/vm1/incoming", &json!({"id": "vm1-in"}));
    match refused {
        Err(switchyard_control::ControlError::Api {
            status, message, ..
        }) => {
            assert_eq!(status, 409, "{message}");
            assert!(message.contains("in pool \"q\""), "{message}");
        }
        other => panic!("an incoming endpoint from another pool: {other:?}"),
    }
    // Positive control: a source created in pool p gets its destination there.
    d.ctl_ok(&["create", "vm3", "--pool", "p"]);
    d.ctl_ok(&["create", "vm3-in", "--incoming-for", "vm3"]);
    let e = d.endpoint("vm3-in");
    assert_eq!(e["lease"]["board"], "b", "{e}");
}

/// A client can change its device's migration state at message rate: each endpoint's
/// migration events are rate-limited (a burst, then 10 a second), so one client cannot crowd
/// the other endpoints' events out of the daemon's stream, while the daemon's bookkeeping
/// still sees every change (an incoming endpoint flooded the same way still commits).
#[test]
fn a_client_flipping_migration_states_cannot_flood_the_event_stream() {
    use switchyard_proto::MigState;
    let mut d = Daemon::start_with_config(BOARDS);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut c = switchyard_client::Client::connect(socket_of(&d.endpoint("vm1"))).expect("vm1");
    for _ in 0..500 {
        c.set_mig_state(MigState::Stop as u32).expect("STOP");
        c.set_mig_state(MigState::Running as u32).expect("RUNNING");
    }
    d.ctl_ok(&["create", "vm2", "--pool", "p"]);
    let flood = d
        .worker_events("migration")
        .iter()
        .filter(|e| e["endpoint"] == "vm1")
        .count();
    assert!(
        (32..=60).contains(&flood),
        "{flood} events for 1000 changes"
    );
    assert!(
        d.events()
            .iter()
            .any(|e| e.pointer("/pool/kind/endpoint") == Some(&json!("vm2"))),
        "the other endpoint's events are there"
    );
}

/// Three boards of one shape in a pool: a source, a destination, and another endpoint.
const THREE: &str = "[[boards]]\nid = \"a\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"b\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"c\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\", \"c\"]\n";

/// Waits (up to `secs`) for the first worker event of `kind` about `endpoint`, failing as
/// soon as `bad` finds what must not happen.
fn wait_event(
    d: &Daemon,
    kind: &str,
    endpoint: &str,
    secs: u64,
    bad: impl FnMut(&Daemon) -> Option<String>,
) -> Value {
    wait_event_where(d, kind, secs, |e| e["endpoint"] == endpoint, bad)
}

/// Waits (up to `secs`) for the first worker event of `kind` that `wanted` accepts, failing
/// as soon as `bad` finds what must not happen.
fn wait_event_where(
    d: &Daemon,
    kind: &str,
    secs: u64,
    wanted: impl Fn(&Value) -> bool,
    mut bad: impl FnMut(&Daemon) -> Option<String>,
) -> Value {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(e) = d.worker_events(kind).into_iter().find(&wanted) {
            return e;
        }
        if let Some(why) = bad(d) {
            panic!("{why}; events: {:?}", d.events());
        }
        assert!(
            Instant::now() < deadline,
            "no such {kind} event: {:?}",
            d.events()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The clean-up after a completed migration deletes the source it migrated away from, that
/// incarnation only: an endpoint deleted and created again with the same id before the
/// clean-up ran (its new VM connected) survives and serves.
#[test]
fn the_clean_up_of_a_migration_spares_an_endpoint_created_again_with_the_same_id() {
    let mut d = Daemon::start_with_config(BOARDS);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let e1 = d.endpoint("vm1");
    let old_token = e1["endpoint"]["migration_token"].clone();
    assert_eq!(old_token.as_str().map(str::len), Some(32), "{e1}");
    // What an operator gives a destination on another host.
    let shown: Value =
        serde_json::from_str(&d.ctl_ok(&["endpoint", "vm1", "--json"])).expect("json");
    assert_eq!(shown["endpoint"]["migration_token"], old_token);
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    guest.vram_write(0x1000, &[0x11; 4096]);
    d.ctl_ok(&["create", "vm1-in", "--incoming-for", "vm1"]);
    let e2 = d.endpoint("vm1-in");
    let mut dst = switchyard_client::Client::connect(socket_of(&e2)).expect("destination");
    {
        let mut mig = Migration::new(&mut guest.t.0, &mut dst);
        mig.prepare_destination().expect("destination RESUMING");
        mig.pre_copy(&PreCopyPlan::default()).expect("pre-copy");
        mig.switchover().expect("switchover");
    }
    wait_event(&d, "migrated", "vm1-in", 10, |_| None);
    // The source's VMM has not let go, so the clean-up waits. Meanwhile the operator deletes
    // vm1 and creates it again (on the board it freed), and a new VM connects to it.
    d.ctl_ok(&["delete", "vm1"]);
    drop(guest);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let again = d.endpoint("vm1");
    let new_token = again["endpoint"]["migration_token"].clone();
    assert_ne!(new_token, old_token, "a new incarnation has a new token");
    let mut vm = connect(&socket_of(&again));
    vm.setup_queue(0);
    vm.vram_write(0, &[0x22; 4096]);
    // The clean-up ends without touching it (before the fix it deleted the new vm1: when the
    // new VM was not connected at its next look, else when its grace of 60 s ran out).
    let released = wait_event(&d, "migration_released", "vm1", 75, |d| {
        d.client()
            .get("/v1/endpoints/vm1")
            .is_err()
            .then(|| "the new vm1 was deleted by the clean-up of the old one".to_owned())
    });
    assert_eq!(released["deleted"], false, "{released}");
    d.client()
        .post("/v1/endpoints/vm1/sync", &())
        .expect("sync");
    let now = d.endpoint("vm1");
    assert_eq!(now["endpoint"]["migration_token"], new_token, "{now}");
    assert_eq!(now["worker"]["connected"], true, "{now}");
    let mut back = [0u8; 4096];
    vm.vram_read(0, &mut back);
    assert!(back.iter().all(|&b| b == 0x22), "the new vm1 serves");
    // The destination keeps its lease; the migration's clean-up is over.
    assert_eq!(d.endpoint("vm1-in")["lease"]["board"], "b");
    assert_eq!(d.worker_events("migration_released").len(), 1);
}

/// A destination takes only a stream that came from its source: a stream another endpoint
/// made, or one the destination made itself, leaves its device in ERROR; the migration is
/// aborted and the source is left alone.
#[test]
fn a_destination_fed_a_stream_from_elsewhere_never_completes() {
    use switchyard_proto::MigState;
    let mut d = Daemon::start_with_config(THREE);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    d.ctl_ok(&["create", "vm2", "--pool", "p"]);
    let e1 = d.endpoint("vm1");
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    guest.vram_write(0, &[0x5a; 4096]);
    let mut other = connect(&socket_of(&d.endpoint("vm2")));
    other.vram_write(0, &[0xa5; 4096]);
    let completed = |d: &Daemon| {
        (!d.worker_events("migrated").is_empty())
            .then(|| "a migration completed with a stream from elsewhere".to_owned())
    };

    // Another endpoint's stream: the first bytes the destination takes are refused.
    d.ctl_ok(&["create", "vm1-in", "--incoming-for", "vm1"]);
    let e2 = d.endpoint("vm1-in");
    let mut dst = switchyard_client::Client::connect(socket_of(&e2)).expect("destination");
    let fed = {
        let mut mig = Migration::new(&mut other.t.0, &mut dst);
        mig.prepare_destination().expect("destination RESUMING");
        mig.pre_copy(&PreCopyPlan::default())
            .and_then(|_| mig.switchover().map(|_| ()))
    };
    assert!(fed.is_err(), "the destination took vm2's stream");
    assert_eq!(dst.mig_state().expect("state"), MigState::Error as u32);
    let aborted = wait_event(&d, "migration_aborted", "vm1-in", 10, completed);
    assert_eq!(
        (aborted["source"].as_str(), aborted["state"].as_str()),
        (Some("vm1"), Some("error")),
        "{aborted}"
    );
    assert!(
        d.worker_events("migration")
            .iter()
            .any(|e| e["endpoint"] == "vm1-in" && e["cause"] == "wrong_origin"),
        "{:?}",
        d.events()
    );
    drop(dst);
    let released = wait_event(&d, "migration_released", "vm1-in", 10, completed);
    assert_eq!(released["deleted"], true, "{released}");

    // A stream the destination made itself (STOP_COPY, read out, then RESUMING and written
    // back): it carries the destination's own token, not the source's.
    d.ctl_ok(&["create", "vm1-in2", "--incoming-for", "vm1"]);
    let mut dst =
        switchyard_client::Client::connect(socket_of(&d.endpoint("vm1-in2"))).expect("dst");
    dst.set_mig_state(MigState::StopCopy as u32)
        .expect("STOP_COPY");
    let mut own = Vec::new();
    loop {
        let chunk = dst.mig_data_read(1 << 16).expect("read");
        own.extend_from_slice(&chunk);
        if chunk.len() < 1 << 16 {
            break;
        }
    }
    dst.set_mig_state(MigState::Resuming as u32)
        .expect("RESUMING");
    let written = own.chunks(1 << 16).try_for_each(|c| dst.mig_data_write(c));
    let resumed = written.and_then(|()| dst.set_mig_state(MigState::Running as u32));
    assert!(resumed.is_err(), "the destination took its own stream");
    assert_eq!(dst.mig_state().expect("state"), MigState::Error as u32);
    let aborted = wait_event(&d, "migration_aborted", "vm1-in2", 10, completed);
    assert_eq!(aborted["state"], "error", "{aborted}");

    // The source serves on, untouched, and no migration completed.
    assert!(d.worker_events("migrated").is_empty(), "{:?}", d.events());
    d.client()
        .post("/v1/endpoints/vm1/sync", &())
        .expect("sync");
    let now = d.endpoint("vm1");
    assert_eq!(
        now["endpoint"]["migration_token"],
        e1["endpoint"]["migration_token"]
    );
    assert_eq!(now["worker"]["connected"], true, "{now}");
    let mut back = [0u8; 4096];
    guest.vram_read(0, &mut back);
    assert!(back.iter().all(|&b| b == 0x5a), "the source's VRAM changed");
    assert_eq!(metric(&d, "switchyard_migrations_aborted_total"), "2");
    assert_eq!(metric(&d, "switchyard_migrations_completed_total"), "0");
}

/// A migration stream left open with no activity is ended after `[daemon]
/// migration_idle_timeout`: the device runs again, the daemon says why, and the restart and
/// the drain it held back go ahead.
#[test]
fn an_idle_migration_stream_is_ended_and_releases_what_it_blocked() {
    use switchyard_proto::MigState;
    let config = format!("[daemon]\nmigration_idle_timeout = \"2s\"\n{BOARDS}");
    let mut d = Daemon::start_with_config(&config);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let e1 = d.endpoint("vm1");
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    guest.vram_write(0, &[0x3c; 4096]);
    // The VMM opens a stream and goes quiet.
    guest
        .t
        .0
        .set_mig_state(MigState::PreCopy as u32)
        .expect("PRE_COPY");
    let api = d.client();
    // The daemon has applied the worker's note of the open stream.
    api.post("/v1/endpoints/vm1/sync", &()).expect("sync");
    assert_eq!(d.endpoint("vm1")["worker"]["migrating"], true);
    assert_eq!(
        api_status(api.post("/v1/endpoints/vm1/restart", &json!({}))),
        (409, "migrating".into())
    );
    assert_eq!(
        api_status(api.post("/v1/boards/a/drain", &json!({}))),
        (409, "migrating".into())
    );
    // Ended by the timeout, not by the VMM.
    let ended = wait_event(&d, "migration", "vm1", 20, |_| None);
    assert_eq!(ended["state"], "pre_copy", "{ended}");
    let ended = wait_event_where(
        &d,
        "migration",
        20,
        |e| e["endpoint"] == "vm1" && e["cause"] == "idle_timeout",
        |_| None,
    );
    assert_eq!(ended["state"], "running", "{ended}");
    assert_eq!(d.endpoint("vm1")["worker"]["migrating"], false);
    // The VMM finds its stream gone and its device running.
    assert!(guest.t.0.mig_data_read(4096).is_err());
    assert_eq!(
        guest.t.0.mig_state().expect("state"),
        MigState::Running as u32
    );
    // What it held back goes ahead: a restart (the guest's connection resumed), a drain.
    let restarted: Value = api
        .post("/v1/endpoints/vm1/restart", &json!({}))
        .expect("restart")
        .json()
        .expect("json");
    assert_eq!(restarted["worker"]["state"], "running", "{restarted}");
    let drained: Value = api
        .post("/v1/boards/a/drain", &json!({}))
        .expect("drain")
        .json()
        .expect("json");
    assert_eq!(
        drained["moved"].as_array().map(Vec::len),
        Some(1),
        "{drained}"
    );
    assert_eq!(d.endpoint("vm1")["lease"]["board"], "b");
    let mut back = [0u8; 4096];
    guest.vram_read(0, &mut back);
    assert!(
        back.iter().all(|&b| b == 0x3c),
        "the guest's VRAM moved with it"
    );
}
