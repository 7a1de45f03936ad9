//! A restarted daemon's events: what it publishes while it starts (a move the killed daemon
//! left in progress is aborted, and the event says so in order).
//!
//! Workers outlive their daemon by design, so every test kills the daemon and then every
//! worker it recorded when it ends (`common::daemon::Daemon`'s drop).

mod common;

use common::daemon::Daemon;
use serde_json::Value;
use switchyard_daemon::app::{DaemonOptions, resolve_config};
use switchyard_pool::Pool;

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
    })
    .expect("the daemon's configuration");
    {
        let (mut pool, _) = Pool::open(&config, &config.daemon.store_path()).expect("the store");
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
