//! Live migration between two pool daemons (two "hosts" as far as the daemons know: nothing
//! links them): the destination's incoming endpoint is made from the source's description
//! (`ctl endpoint SRC --json` on the source, `ctl create DST --incoming-spec FILE` on the
//! destination); the source's daemon frees the source itself once its VMM leaves after a
//! completed migration. The migration is driven by our VMM-side client the way QEMU drives
//! it (the source's stream read until a read answers nothing, then STOP).
//!
//! Workers outlive their daemon by design, so every test kills the daemons and then every
//! worker they recorded when it ends (`common::daemon::Daemon`'s drop).
#![forbid(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::daemon::{Daemon, api_status, connect, socket_of};
use serde_json::{Value, json};
use switchyard_client::migrate::{Migration, PreCopyPlan};
use switchyard_proto::MigState;

/// Two boards of one shape in pool `p`, one bigger in no pool.
const BOARDS: &str = "[[boards]]\nid = \"a\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"b\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"big\"\nvram = \"32M\"\nqueues = 2\nvram_mmap = false\n\
     [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\"]\n";

/// Waits (10 s) for a worker event of `kind` that `wanted` accepts.
fn wait_event(d: &Daemon, kind: &str, wanted: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(e) = d.worker_events(kind).into_iter().find(&wanted) {
            return e;
        }
        assert!(
            Instant::now() < deadline,
            "no such {kind} event: {:?}",
            d.events()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A migration event of the VMM leaving its device (`client_gone`; `client_left` where the
/// server tells a device left stopped apart).
fn vmm_left(e: &Value) -> bool {
    matches!(e["cause"].as_str(), Some("client_gone" | "client_left"))
}

/// Endpoint `id`'s description as its host's `ctl endpoint ID --json` prints it, in a file
/// of `to`'s directory (copied to the destination host).
fn spec_file(from: &Daemon, id: &str, to: &Daemon) -> String {
    let text = from.ctl_ok(&["endpoint", id, "--json"]);
    let path = to.dir().join(format!("{id}.json"));
    std::fs::write(&path, text).expect("write the spec");
    path.to_str().expect("a UTF-8 path").to_owned()
}

/// The endpoint leasing board `board`'s device on `d`, if any.
fn holder(d: &Daemon, board: &str) -> Value {
    let boards: Vec<Value> = d
        .client()
        .get("/v1/boards")
        .expect("boards")
        .json()
        .expect("json");
    let b = boards
        .iter()
        .find(|b| b["id"] == board)
        .unwrap_or_else(|| panic!("no board {board}"));
    b["devices"][0]["endpoint"].clone()
}

/// What QEMU's source does after the last pre-copy round: STOP_COPY, the stream read until a
/// reply is shorter than asked (the stream's end), then (the migration completed) STOP.
fn read_out_and_stop(src: &mut switchyard_client::Client) {
    while src.mig_data_read(1 << 16).expect("read").len() == 1 << 16 {}
    src.set_mig_state(MigState::Stop as u32).expect("STOP");
}

#[test]
fn a_migration_between_two_daemons_commits_on_the_destination_and_frees_the_source() {
    let mut src = Daemon::start_with_config(BOARDS);
    let mut dst = Daemon::start_with_config(BOARDS);
    src.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let e1 = src.endpoint("vm1");
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    let secret: Vec<u8> = (0..256 * 1024u32).map(|i| (i * 13 + 5) as u8).collect();
    guest.vram_write(0x2000, &secret);
    // Board a is taken on the destination host: the incoming endpoint gets b.
    dst.ctl_ok(&["create", "other", "--device", "a"]);

    let file = spec_file(&src, "vm1", &dst);
    let out = dst.ctl_ok(&["create", "vm1-in", "--incoming-spec", &file]);
    assert!(out.contains("live migration of vm1"), "{out}");
    let e2 = dst.endpoint("vm1-in");
    assert_eq!(e2["incoming_for"], "vm1", "{e2}");
    assert_eq!(e2["lease"]["board"], "b", "{e2}");
    // One incoming endpoint per source.
    let again = dst.ctl(&["create", "again", "--incoming-spec", &file]);
    assert!(
        !again.status.success(),
        "a second incoming endpoint for vm1"
    );

    let mut to = switchyard_client::Client::connect(socket_of(&e2)).expect("destination");
    {
        let mut mig = Migration::new(&mut guest.t.0, &mut to);
        mig.prepare_destination().expect("destination RESUMING");
        mig.pre_copy(&PreCopyPlan::default()).expect("pre-copy");
        mig.switchover().expect("switchover");
    }
    read_out_and_stop(&mut guest.t.0);
    let mut to = common::driver::Driver::new(common::ours::Ours(to));
    let mut back = vec![0u8; secret.len()];
    to.vram_read(0x2000, &mut back);
    assert!(back == secret, "the destination's VRAM differs");
    // The destination commits: its endpoint is an ordinary one, leasing b.
    let migrated = wait_event(&dst, "migrated", |e| e["endpoint"] == "vm1-in");
    assert_eq!(migrated["source"], "vm1", "{migrated}");
    common::wait_until("vm1-in still incoming", Duration::from_secs(10), || {
        dst.endpoint("vm1-in").get("incoming_for").is_none()
    });
    assert_eq!(holder(&dst, "b"), "vm1-in");
    // The source's daemon knows nothing of it: vm1 stays while its VMM is connected.
    src.client()
        .post("/v1/endpoints/vm1/sync", &())
        .expect("sync");
    let still = src.endpoint("vm1");
    assert_eq!(still["worker"]["connected"], true, "{still}");
    assert!(src.worker_events("migrated_away").is_empty());

    // Its VMM quits: the source's daemon deletes vm1 and board a is free.
    drop(guest);
    let away = wait_event(&src, "migrated_away", |e| e["endpoint"] == "vm1");
    assert_eq!(away["endpoint"], "vm1");
    let gone = wait_event(&src, "migration", |e| e["endpoint"] == "vm1" && vmm_left(e));
    assert_eq!(gone["sent"], true, "{gone}");
    let released = wait_event(&src, "migration_released", |e| e["endpoint"] == "vm1");
    assert_eq!(released["deleted"], true, "{released}");
    assert!(
        src.client().get("/v1/endpoints/vm1").is_err(),
        "vm1 is gone"
    );
    assert!(holder(&src, "a").is_null(), "board a is free on the source");
    // The destination keeps its lease, and released nothing of its own.
    assert_eq!(holder(&dst, "b"), "vm1-in");
    assert!(dst.worker_events("migration_released").is_empty());
    let mut again = [0u8; 64];
    to.vram_read(0x2000, &mut again);
    assert_eq!(&again[..], &secret[..64]);
}

/// A source whose migration did not complete keeps its endpoint when its VMM leaves: it set
/// RUNNING again after sending the whole stream (the migration failed afterwards), or it
/// left in STOP_COPY (the stream read out, the device never stopped). Each time the daemon
/// has followed the change before the next step is checked: an aborted local migration's
/// event, emitted by the same follower after it, is the barrier.
#[test]
fn a_source_whose_migration_did_not_complete_keeps_its_lease() {
    // Pool q serves the barriers.
    let config = format!(
        "{BOARDS}[[boards]]\nid = \"c\"\nvram = \"8M\"\nqueues = 1\nvram_mmap = false\n\
         [[boards]]\nid = \"d\"\nvram = \"8M\"\nqueues = 1\nvram_mmap = false\n\
         [[pools]]\nname = \"q\"\nboards = [\"c\", \"d\"]\n"
    );
    let mut d = Daemon::start_with_config(&config);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    d.ctl_ok(&["create", "bar", "--pool", "q"]);
    let e1 = d.endpoint("vm1");
    // The follower has handled every change reported before this call when it returns: an
    // incoming endpoint of `bar` abandoned in RESUMING is aborted by the same follower, and
    // deleted (freeing board d for the next one).
    let mut barriers = 0;
    let mut barrier = |d: &mut Daemon| {
        barriers += 1;
        let id = format!("bar-in{barriers}");
        d.ctl_ok(&["create", &id, "--incoming-for", "bar"]);
        let mut c =
            switchyard_client::Client::connect(socket_of(&d.endpoint(&id))).expect("barrier");
        c.set_mig_state(MigState::Resuming as u32)
            .expect("RESUMING");
        drop(c);
        wait_event(d, "migration_aborted", |e| e["endpoint"] == id.as_str());
        wait_event(d, "migration_released", |e| e["endpoint"] == id.as_str());
    };

    // Failed after the stream: RUNNING again, then the VMM leaves.
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    guest.vram_write(0, &[0x3c; 4096]);
    guest
        .t
        .0
        .set_mig_state(MigState::StopCopy as u32)
        .expect("STOP_COPY");
    read_out_and_stop(&mut guest.t.0);
    guest
        .t
        .0
        .set_mig_state(MigState::Running as u32)
        .expect("RUNNING");
    wait_event(&d, "migration", |e| {
        e["endpoint"] == "vm1" && e["state"] == "running" && e["cause"] == "request"
    });
    drop(guest);
    barrier(&mut d);
    assert!(
        d.worker_events("migrated_away").is_empty(),
        "{:?}",
        d.events()
    );
    assert_eq!(d.endpoint("vm1")["lease"]["board"], "a");

    // Left in STOP_COPY with the stream read out.
    let mut guest = connect(&socket_of(&e1));
    let mut back = [0u8; 4096];
    guest.vram_read(0, &mut back);
    assert!(back.iter().all(|&b| b == 0x3c), "vm1's VRAM");
    guest
        .t
        .0
        .set_mig_state(MigState::StopCopy as u32)
        .expect("STOP_COPY");
    while guest.t.0.mig_data_read(1 << 16).expect("read").len() == 1 << 16 {}
    drop(guest);
    let gone = wait_event(&d, "migration", |e| {
        e["endpoint"] == "vm1" && e["cause"] == "client_gone"
    });
    assert!(gone.get("sent").is_none(), "{gone}");
    barrier(&mut d);
    assert!(
        d.worker_events("migrated_away").is_empty(),
        "{:?}",
        d.events()
    );
    assert_eq!(d.endpoint("vm1")["lease"]["board"], "a");

    // Positive control: the same source, migrated to the end, goes.
    let mut guest = connect(&socket_of(&e1));
    guest
        .t
        .0
        .set_mig_state(MigState::StopCopy as u32)
        .expect("STOP_COPY");
    read_out_and_stop(&mut guest.t.0);
    drop(guest);
    wait_event(&d, "migrated_away", |e| e["endpoint"] == "vm1");
    common::wait_until("vm1 is still there", Duration::from_secs(10), || {
        d.client().get("/v1/endpoints/vm1").is_err()
    });
    assert!(holder(&d, "a").is_null());
}

/// A local migration whose source's VMM leaves the QEMU way (read out, STOP, gone) is
/// cleaned up once: the local link decides, and no `migrated_away` doubles it.
#[test]
fn a_local_migration_is_cleaned_up_once() {
    let mut d = Daemon::start_with_config(BOARDS);
    d.ctl_ok(&["create", "vm1", "--pool", "p"]);
    let mut guest = connect(&socket_of(&d.endpoint("vm1")));
    guest.setup_queue(0);
    d.ctl_ok(&["create", "vm1-in", "--incoming-for", "vm1"]);
    let mut to = switchyard_client::Client::connect(socket_of(&d.endpoint("vm1-in"))).expect("dst");
    {
        let mut mig = Migration::new(&mut guest.t.0, &mut to);
        mig.prepare_destination().expect("destination RESUMING");
        mig.pre_copy(&PreCopyPlan::default()).expect("pre-copy");
        mig.switchover().expect("switchover");
    }
    read_out_and_stop(&mut guest.t.0);
    wait_event(&d, "migrated", |e| e["endpoint"] == "vm1-in");
    drop(guest);
    let released = wait_event(&d, "migration_released", |e| e["endpoint"] == "vm1");
    assert_eq!(released["deleted"], true, "{released}");
    wait_event(&d, "migration", |e| {
        e["endpoint"] == "vm1" && vmm_left(e) && e["sent"] == true
    });
    // The follower handled vm1's departure before this abort (one thread, in order).
    d.ctl_ok(&["delete", "vm1-in"]);
    d.ctl_ok(&["create", "vm2", "--pool", "p"]);
    d.ctl_ok(&["create", "vm2-in", "--incoming-for", "vm2"]);
    let mut c =
        switchyard_client::Client::connect(socket_of(&d.endpoint("vm2-in"))).expect("vm2-in");
    c.set_mig_state(MigState::Resuming as u32)
        .expect("RESUMING");
    drop(c);
    wait_event(&d, "migration_aborted", |e| e["endpoint"] == "vm2-in");
    let vm1_released = d
        .worker_events("migration_released")
        .into_iter()
        .filter(|e| e["endpoint"] == "vm1")
        .count();
    assert_eq!(vm1_released, 1, "{:?}", d.events());
    assert!(
        d.worker_events("migrated_away").is_empty(),
        "{:?}",
        d.events()
    );
}

/// A description this host cannot serve is refused with a 4xx naming why, and nothing is
/// leased; a positive control is created from the same description once it is right.
#[test]
fn a_description_this_pool_cannot_serve_is_refused_and_leases_nothing() {
    let mut src = Daemon::start_with_config(BOARDS);
    let dst = Daemon::start_with_config(BOARDS);
    src.ctl_ok(&["create", "vm1", "--pool", "p"]);
    src.ctl_ok(&["create", "vm2", "--device", "big"]);
    let good: Value = src.endpoint("vm1");
    let api = dst.client();
    let post = |source: &Value, pool: Option<&str>| {
        api_status(api.post(
            "/v1/incoming",
            &json!({"id": "in", "source": source, "pool": pool}),
        ))
    };
    // A shape no free device here has (vm2's 32M board, in no pool: "big" there is free,
    // so take it first).
    dst.ctl_ok(&["create", "hog", "--device", "big"]);
    assert_eq!(
        post(&src.endpoint("vm2"), None),
        (409, "no_capacity".into())
    );
    let mut bad = good.clone();
    bad["lease"]["shape"]["options"]["vram"] = json!(64 << 20);
    assert_eq!(post(&bad, None), (409, "no_capacity".into()));
    // No token (as another user sees the source), or not one.
    let mut bad = good.clone();
    bad["endpoint"]
        .as_object_mut()
        .expect("endpoint")
        .remove("migration_token");
    assert_eq!(post(&bad, None), (422, "invalid".into()));
    bad["endpoint"]["migration_token"] = json!("0123");
    assert_eq!(post(&bad, None), (422, "invalid".into()));
    // No lease, an unknown kind, options the kind refuses.
    let mut bad = good.clone();
    bad["lease"] = Value::Null;
    assert_eq!(post(&bad, None), (422, "invalid".into()));
    let mut bad = good.clone();
    bad["lease"]["shape"]["model"] = json!("warpdrive");
    assert_eq!(post(&bad, None), (422, "invalid".into()));
    let mut bad = good.clone();
    bad["lease"]["shape"]["options"]["queues"] = json!("many");
    assert_eq!(post(&bad, None), (422, "invalid".into()));
    // A pool this host does not have.
    assert_eq!(post(&good, Some("nope")).0, 404);
    // Nothing was leased by any of them.
    let endpoints: Vec<Value> = api
        .get("/v1/endpoints")
        .expect("list")
        .json()
        .expect("json");
    let ids: Vec<&str> = endpoints
        .iter()
        .filter_map(|e| e["endpoint"]["id"].as_str())
        .collect();
    assert_eq!(ids, ["hog"], "only the test's own endpoint");
    assert!(holder(&dst, "a").is_null() && holder(&dst, "b").is_null());
    // Positive control: the description as printed is served.
    let created = api
        .post("/v1/incoming", &json!({"id": "in", "source": good}))
        .expect("created");
    assert_eq!(created.status, 201);
    assert_eq!(holder(&dst, "a"), "in");
}

/// The destination takes only a stream that starts with the described source's token: a
/// stream of another endpoint (of the source's host) leaves it in ERROR, the migration is
/// aborted and never committed.
#[test]
fn a_destination_made_from_a_description_takes_no_stream_from_elsewhere() {
    let mut src = Daemon::start_with_config(BOARDS);
    let mut dst = Daemon::start_with_config(BOARDS);
    src.ctl_ok(&["create", "vm1", "--pool", "p"]);
    src.ctl_ok(&["create", "vm2", "--pool", "p"]);
    let mut other = connect(&socket_of(&src.endpoint("vm2")));
    other.setup_queue(0);
    other.vram_write(0, &[0xa5; 4096]);
    let file = spec_file(&src, "vm1", &dst);
    dst.ctl_ok(&["create", "vm1-in", "--incoming-spec", &file]);
    let mut to =
        switchyard_client::Client::connect(socket_of(&dst.endpoint("vm1-in"))).expect("dst");
    let fed = {
        let mut mig = Migration::new(&mut other.t.0, &mut to);
        mig.prepare_destination().expect("destination RESUMING");
        mig.pre_copy(&PreCopyPlan::default())
            .and_then(|_| mig.switchover().map(|_| ()))
    };
    assert!(fed.is_err(), "the destination took vm2's stream");
    assert_eq!(to.mig_state().expect("state"), MigState::Error as u32);
    let aborted = wait_event(&dst, "migration_aborted", |e| e["endpoint"] == "vm1-in");
    assert_eq!(
        (aborted["source"].as_str(), aborted["state"].as_str()),
        (Some("vm1"), Some("error")),
        "{aborted}"
    );
    drop(to);
    let released = wait_event(&dst, "migration_released", |e| e["endpoint"] == "vm1-in");
    assert_eq!(released["deleted"], true, "{released}");
    assert!(
        dst.worker_events("migrated").is_empty(),
        "{:?}",
        dst.events()
    );
    assert!(
        holder(&dst, "a").is_null(),
        "the destination's lease is gone"
    );
    // The source serves on.
    assert_eq!(src.endpoint("vm1")["lease"]["board"], "a");
}
