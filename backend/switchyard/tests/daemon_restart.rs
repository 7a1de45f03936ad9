//! A restarted daemon's events: what it publishes while it starts (a move the killed daemon
//! left in progress is aborted, and the event says so in order), and what it reports of the
//! workers it adopted (a dying one is an `exited` event, like one of its own, and its
//! replacement counts as a restart).
//!
//! Workers outlive their daemon by design, so every test kills the daemon and then every
//! worker it recorded when it ends (`common::daemon::Daemon`'s drop).
#![forbid(unsafe_code)]

mod common;

use std::time::{Duration, Instant};

use common::daemon::{Daemon, is_worker};
use serde_json::Value;
use switchyard_daemon::app::{DaemonOptions, resolve_config};
use switchyard_pool::Pool;

/// The worker events of the daemon's stream.
fn worker_events(d: &Daemon) -> Vec<Value> {
    d.events()
        .iter()
        .filter_map(|e| e.get("worker").cloned())
        .collect()
}

/// The daemon's log lines at `ERROR`.
fn errors(d: &Daemon) -> Vec<String> {
    d.log()
        .lines()
        .filter(|l| l.contains("ERROR"))
        .map(str::to_owned)
        .collect()
}

#[test]
fn a_restarted_daemon_publishes_the_abort_of_a_move_left_in_progress_in_order() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    assert_eq!(d.endpoint("vm1")["worker"]["state"], "running");
    d.kill9();

    // The killed daemon had planned a move of vm1 (the target reserved in the store) when
    // it died: what the store holds then, written through the pool as the daemon does.
    let config = resolve_config(&DaemonOptions {
        config: None,
        state_dir: Some(d.state()),
        run_dir: Some(d.run_dir()),
        ..DaemonOptions::default()
    })
    .expect("the daemon's configuration");
    {
        let (mut pool, _) = Pool::open(
            &config,
            &switchyard_kinds::Registry,
            &config.daemon.store_path(),
        )
        .expect("the store");
        let free: Vec<String> = pool
            .inventory()
            .boards()
            .iter()
            .flat_map(|b| &b.devices)
            .filter(|dev| dev.endpoint.is_none() && dev.reserved_for.is_none())
            .map(|dev| dev.id.clone())
            .collect();
        let planned = free
            .iter()
            .find_map(|to| pool.plan_move("vm1", to).ok())
            .unwrap_or_else(|| panic!("no device to plan vm1's move to among {free:?}"));
        assert_eq!(planned.0.endpoint, "vm1");
    }

    d.launch();
    // The new daemon aborted the move (vm1 keeps its device) and published the abort.
    let kinds: Vec<String> = d
        .events()
        .iter()
        .filter_map(|e| e.pointer("/pool/kind/type").and_then(Value::as_str))
        .map(str::to_owned)
        .collect();
    assert!(
        kinds.ends_with(&["opened".to_owned(), "move_aborted".to_owned()]),
        "{kinds:?}"
    );
    assert_eq!(d.endpoint("vm1")["worker"]["state"], "running");
    let errors = errors(&d);
    assert!(
        errors.iter().all(|l| !l.contains("out of order")),
        "the events the daemon made while starting were published in order: {errors:#?}"
    );
}

#[test]
fn an_adopted_worker_that_dies_is_an_exited_event_and_its_replacement_a_restart() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let adopted = d.endpoint("vm1")["worker"]["pid"]
        .as_u64()
        .expect("a worker") as u32;
    d.kill9();
    d.launch();
    let now = d.endpoint("vm1");
    assert_eq!(now["worker"]["state"], "running", "{now}");
    assert_eq!(now["worker"]["pid"].as_u64(), Some(u64::from(adopted)));
    assert_eq!(now["worker"]["restarts"], 0, "{now}");

    // The adopted worker dies (SIGKILL): replaced like one of the daemon's own.
    d.ctl_ok(&["restart", "vm1"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_worker(adopted) {
        assert!(
            Instant::now() < deadline,
            "the adopted worker {adopted} runs"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    let now = d.endpoint("vm1");
    assert_eq!(now["worker"]["state"], "running", "{now}");
    assert_ne!(now["worker"]["pid"].as_u64(), Some(u64::from(adopted)));
    assert_eq!(now["worker"]["restarts"], 1, "{now}");
    let replacement = now["worker"]["pid"].as_u64().expect("a worker");

    // Its events: the adopted worker exited, the replacement started and served after a
    // restart; as many exits as replacements.
    let events = worker_events(&d);
    let of = |kind: &str| -> Vec<&Value> {
        events
            .iter()
            .filter(|e| e["event"] == kind && e["endpoint"] == "vm1")
            .collect()
    };
    let exited = of("exited");
    assert_eq!(exited.len(), 1, "{events:#?}");
    assert_eq!(exited[0]["pid"].as_u64(), Some(u64::from(adopted)));
    assert!(exited[0]["status"].is_string(), "{events:#?}");
    let started = of("started");
    assert_eq!(started.len(), 1, "{events:#?}");
    assert_eq!(started[0]["pid"].as_u64(), Some(replacement));
    assert_eq!(started[0]["resume"], true);
    let ready = of("ready");
    assert_eq!(ready.len(), 1, "{events:#?}");
    assert!(ready[0]["restart_ms"].as_f64().is_some(), "{events:#?}");
    let position = |e: &Value| events.iter().position(|x| x == e).expect("event");
    assert!(
        position(exited[0]) < position(started[0]),
        "the exit comes before its replacement starts: {events:#?}"
    );
    let metrics = d.ctl_ok(&["metrics"]);
    assert!(
        metrics.contains(r#"switchyard_endpoint_worker_restarts_total{endpoint="vm1"} 1"#),
        "{metrics}"
    );
}
