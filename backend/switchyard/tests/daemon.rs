//! `switchyard daemon` and `switchyard ctl` as real processes: the embedded default pool,
//! endpoints created through the CLI and the API and served to a real vfio-user client,
//! restarts under the client's workload, metrics and events, API refusals that change nothing,
//! configuration errors, and a daemon killed with SIGKILL restarting into the same leases.
//!
//! Workers outlive their daemon by design (guests keep their devices), so every test kills
//! the daemon and then every worker it recorded (`<state>/workers/*.pid`), by pid, when it
//! ends (`common::daemon::Daemon`'s drop).
#![forbid(unsafe_code)]

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::daemon::{Daemon, EXE, api_status, connect, is_worker, socket_of};
use common::driver::Driver;
use common::ours::Ours;
use serde_json::{Value, json};
use switchyard_control::ControlError;
use switchyard_softgpu::cmd::{Command as GpuCommand, Operand};
use switchyard_softgpu::regs::SCRATCH;

/// FILL a VRAM range, COPY it to guest memory, check the bytes (queue 0).
fn round(d: &mut Driver<Ours>, round: u64) {
    common::workload::fill_copy_round(d, round, 0);
}

#[test]
fn default_pool_endpoints_and_restarts_under_a_workload() {
    let mut d = Daemon::start();
    let boards = d.ctl_ok(&["boards"]);
    assert!(
        boards.contains("gpu0") && boards.contains("gpu1"),
        "{boards}"
    );
    let pools = d.ctl_ok(&["pools"]);
    assert!(
        pools.lines().any(|l| l.split_whitespace().collect::<Vec<_>>()
            == ["default", "gpu0,gpu1", "2", "2"]),
        "{pools}"
    );
    let json: Value =
        serde_json::from_str(&d.ctl_ok(&["--json", "pools"])).expect("ctl --json is JSON");
    assert_eq!(json[0]["name"], "default");

    // One endpoint through the CLI, one through the API.
    let created = d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    assert!(created.contains("running"), "{created}");
    let reply = d
        .client()
        .post("/v1/endpoints", &json!({"id": "vm2", "device": "gpu1"}))
        .expect("create vm2");
    assert_eq!(reply.status, 201);
    assert_eq!(reply.body["lease"]["id"], "gpu1");
    let vm1 = d.endpoint("vm1");
    assert_eq!(vm1["endpoint"]["device"], "gpu0");
    assert_eq!(vm1["worker"]["state"], "running");
    // `--socket` after the subcommand as well; a leased device says so.
    let out = Command::new(EXE)
        .args(["ctl", "boards", "--socket"])
        .arg(d.socket())
        .output()
        .expect("ctl boards --socket");
    assert!(out.status.success(), "{out:?}");
    let boards = String::from_utf8_lossy(&out.stdout);
    for gpu in ["gpu0", "gpu1"] {
        let line = boards.lines().find(|l| l.starts_with(gpu)).expect(gpu);
        assert!(line.contains(" leased "), "{line}");
    }
    // One pool: `create` needs no --pool; when nothing is free the refusal names no
    // requirement nobody asked for.
    let out = d.ctl(&["create", "vm3"]);
    assert!(!out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("No free device in pool \"default\""), "{err}");
    assert!(
        !err.contains("0 bytes") && !err.contains("0 queues"),
        "{err}"
    );
    let vm2 = d.endpoint("vm2");

    let mut a = connect(&socket_of(&vm1));
    let mut b = connect(&socket_of(&vm2));
    a.setup_queue(0);
    b.setup_queue(0);
    a.w32(SCRATCH, 0xfeed_0001);
    b.w32(SCRATCH, 0xfeed_0002);

    // `ctl restart` three times while the client runs its workload.
    let running = Arc::new(AtomicBool::new(true));
    let restarter = {
        let socket = d.socket();
        let running = running.clone();
        std::thread::spawn(move || {
            let mut outputs = Vec::new();
            for _ in 0..3 {
                // Pacing: the client works between the restarts.
                std::thread::sleep(Duration::from_millis(100));
                let out = Command::new(EXE)
                    .arg("ctl")
                    .arg("--socket")
                    .arg(&socket)
                    .args(["restart", "vm1"])
                    .output()
                    .expect("ctl restart");
                outputs.push(out);
            }
            running.store(false, Ordering::SeqCst);
            outputs
        })
    };
    let start = Instant::now();
    let mut rounds = 0u64;
    while running.load(Ordering::SeqCst) {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "restarts take too long"
        );
        round(&mut a, rounds);
        rounds += 1;
    }
    for out in restarter.join().expect("restarter") {
        assert!(
            out.status.success(),
            "ctl restart: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("replaced by"));
    }
    // The workload goes on after the restarts, with state from before them.
    for r in rounds..rounds + 5 {
        round(&mut a, r);
    }
    assert_eq!(a.r32(SCRATCH), 0xfeed_0001);
    assert_eq!(b.r32(SCRATCH), 0xfeed_0002);
    round(&mut b, 1);
    let vm1 = d.endpoint("vm1");
    assert_eq!(vm1["worker"]["restarts"], 3, "{vm1}");
    assert_eq!(vm1["worker"]["state"], "running");
    assert!(vm1["worker"]["last_restart_ms"].as_f64().is_some());
    assert_eq!(d.endpoint("vm2")["worker"]["restarts"], 0);

    let metrics = d.ctl_ok(&["metrics"]);
    for line in [
        r#"switchyard_endpoint_worker_restarts_total{endpoint="vm1"} 3"#,
        r#"switchyard_endpoint_worker_restarts_total{endpoint="vm2"} 0"#,
        "switchyard_endpoint_restarts_total 3",
    ] {
        assert!(metrics.lines().any(|l| l == line), "{line} in\n{metrics}");
    }
    // The workers report what they served (about every second): vm2's REGION_READs and
    // its board's jobs: 1 round, 2 commands. vm1's last worker ran at least the 5 rounds
    // after the restarts (a killed worker's last second is not reported).
    let value = |text: &str, series: &str| -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    let metrics = loop {
        let m = d.ctl_ok(&["metrics"]);
        if value(&m, r#"switchyard_board_jobs_total{board="gpu1"}"#) == Some(2.0)
            && value(&m, r#"switchyard_board_jobs_total{board="gpu0"}"#) >= Some(10.0)
        {
            break m;
        }
        assert!(Instant::now() < deadline, "no worker report:\n{m}");
        std::thread::sleep(Duration::from_millis(100));
    };
    let reads = value(
        &metrics,
        r#"switchyard_endpoint_messages_total{endpoint="vm2",command="REGION_READ"}"#,
    )
    .unwrap_or_else(|| panic!("{metrics}"));
    assert!(reads >= 1.0, "{metrics}");
    // The 8 KiB FILL and the 8 KiB COPY.
    assert_eq!(
        value(&metrics, r#"switchyard_board_bytes_total{board="gpu1"}"#),
        Some(16384.0),
        "{metrics}"
    );
    let count = value(
        &metrics,
        r#"switchyard_endpoint_request_duration_seconds_count{endpoint="vm2"}"#,
    )
    .unwrap_or_else(|| panic!("{metrics}"));
    let messages: f64 = metrics
        .lines()
        .filter(|l| l.starts_with(r#"switchyard_endpoint_messages_total{endpoint="vm2""#))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(count, messages, "one latency per message: {metrics}");

    // Events: the pool's (opened, two endpoints created) and each worker's lifecycle, in
    // increasing order.
    let events = d.events();
    let seqs: Vec<u64> = events
        .iter()
        .map(|e| e["seq"].as_u64().expect("seq"))
        .collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");
    let pool_kinds: Vec<&str> = events
        .iter()
        .filter_map(|e| e.pointer("/pool/kind/type").and_then(Value::as_str))
        .collect();
    assert_eq!(
        pool_kinds,
        ["opened", "endpoint_created", "endpoint_created"]
    );
    let vm1_ready: Vec<&Value> = events
        .iter()
        .filter(|e| e["worker"]["event"] == "ready" && e["worker"]["endpoint"] == "vm1")
        .collect();
    assert_eq!(vm1_ready.len(), 4, "first worker and three replacements");
    assert!(
        vm1_ready[1..]
            .iter()
            .all(|e| e["worker"]["resumed_connection"] == true
                && e["worker"]["restart_ms"].as_f64().is_some()),
        "{vm1_ready:?}"
    );
    let exits = events
        .iter()
        .filter(|e| e["worker"]["event"] == "exited" && e["worker"]["endpoint"] == "vm1")
        .count();
    assert_eq!(exits, 3);
    // Resuming after an event gives the rest.
    let after = seqs[seqs.len() - 3];
    let rest: Vec<Value> = d
        .client()
        .stream(&format!("/events?since={after}&follow=false"))
        .expect("events")
        .map(|l| serde_json::from_str(&l.expect("line")).expect("json"))
        .collect();
    assert_eq!(rest.len(), 2);
    let text = d.ctl_ok(&["events"]);
    assert!(
        text.contains("endpoint_created") && text.contains("ready"),
        "{text}"
    );

    // Delete: the worker stops (the client's connection closes), the device is free again.
    let out = d.ctl_ok(&["delete", "vm1"]);
    assert!(out.contains("deleted"));
    let mut buf = [0u8; 4];
    assert!(
        a.t.0.region_read(0, SCRATCH, &mut buf).is_err(),
        "the deleted endpoint's client is disconnected"
    );
    let pools: Value = d.client().get("/v1/pools").expect("pools").body;
    assert_eq!(pools[0]["free"], 1);
    assert!(!socket_of(&vm1).exists(), "the socket file is gone");
    round(&mut b, 2);

    // Upgrade replaces the worker with the binary on disk; the client goes on.
    let up = d.ctl_ok(&["upgrade", "vm2"]);
    assert!(up.contains("replaced by"), "{up}");
    round(&mut b, 3);
    assert_eq!(b.r32(SCRATCH), 0xfeed_0002);
    assert!(
        d.ctl_ok(&["metrics"])
            .contains("switchyard_upgrades_total 1")
    );
    d.endpoint("vm2");
}

/// Boards, endpoints and the events, for before/after comparisons.
fn snapshot(d: &Daemon) -> (Value, Value, usize) {
    let c = d.client();
    // What each worker holds reaches the daemon on its own channel, after its client has
    // its replies: a sync first (answered after every earlier custody note).
    let endpoints = c.get("/v1/endpoints").expect("endpoints").body;
    for e in endpoints.as_array().into_iter().flatten() {
        if let Some(id) = e["endpoint"]["id"].as_str()
            && e["worker"]["state"] == "running"
        {
            let _ = c.post(&format!("/v1/endpoints/{id}/sync"), &());
        }
    }
    let mut endpoints = c.get("/v1/endpoints").expect("endpoints").body;
    // The sync's own number is not state.
    for e in endpoints.as_array_mut().into_iter().flatten() {
        if let Some(w) = e["worker"].as_object_mut() {
            w.remove("custody_seq");
        }
    }
    (
        c.get("/v1/boards").expect("boards").body,
        endpoints,
        d.events().len(),
    )
}

#[test]
fn refused_requests_change_nothing() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--device", "gpu0"]);
    d.endpoint("vm1");
    let before = snapshot(&d);
    let c = d.client();
    type Request<'a> = Box<dyn Fn() -> Result<switchyard_control::JsonReply, ControlError> + 'a>;
    let cases: Vec<(&str, Request<'_>, u16)> = vec![
        (
            "unknown endpoint",
            Box::new(|| c.get("/v1/endpoints/nope")),
            404,
        ),
        (
            "delete unknown",
            Box::new(|| c.delete("/v1/endpoints/nope")),
            404,
        ),
        (
            "restart unknown",
            Box::new(|| c.post("/v1/endpoints/nope/restart", &())),
            404,
        ),
        (
            "upgrade unknown",
            Box::new(|| c.post("/v1/endpoints/nope/upgrade", &())),
            404,
        ),
        ("unknown board", Box::new(|| c.get("/v1/boards/nope")), 404),
        (
            "quarantine unknown",
            Box::new(|| c.post("/v1/boards/nope/quarantine", &())),
            404,
        ),
        (
            "unknown pool",
            Box::new(|| c.post("/v1/endpoints", &json!({"id": "x", "pool": "nope"}))),
            404,
        ),
        (
            "duplicate id",
            Box::new(|| c.post("/v1/endpoints", &json!({"id": "vm1", "pool": "default"}))),
            409,
        ),
        (
            "busy device",
            Box::new(|| c.post("/v1/endpoints", &json!({"id": "x", "device": "gpu0"}))),
            409,
        ),
        (
            "id of a board",
            Box::new(|| c.post("/v1/endpoints", &json!({"id": "gpu1", "pool": "default"}))),
            409,
        ),
        (
            "no capacity",
            Box::new(|| {
                c.post(
                    "/v1/endpoints",
                    &json!({"id": "x", "pool": "default", "min_vram": 1u64 << 40}),
                )
            }),
            409,
        ),
        (
            "bad id",
            Box::new(|| c.post("/v1/endpoints", &json!({"id": "a b", "pool": "default"}))),
            422,
        ),
        (
            "pool and device",
            Box::new(|| {
                c.post(
                    "/v1/endpoints",
                    &json!({"id": "x", "pool": "default", "device": "gpu1"}),
                )
            }),
            422,
        ),
        (
            "relative socket",
            Box::new(|| {
                c.post(
                    "/v1/endpoints",
                    &json!({"id": "x", "pool": "default", "socket": "rel.sock"}),
                )
            }),
            422,
        ),
        (
            "unknown field",
            Box::new(|| {
                c.post(
                    "/v1/endpoints",
                    &json!({"id": "x", "pool": "default", "gpus": 2}),
                )
            }),
            422,
        ),
        (
            "wrong type",
            Box::new(|| {
                c.post(
                    "/v1/endpoints",
                    &json!({"id": "x", "pool": "default", "min_queues": "many"}),
                )
            }),
            422,
        ),
        ("unknown route", Box::new(|| c.get("/v1/moves")), 404),
        (
            "a move of a device whose guest maps VRAM",
            Box::new(|| c.post("/v1/endpoints/vm1/move", &json!({"to": "gpu1"}))),
            409,
        ),
        (
            "a drain that cannot move a mapped-VRAM endpoint",
            Box::new(|| c.post("/v1/boards/gpu0/drain", &())),
            409,
        ),
    ];
    for (what, request, want) in cases {
        let (status, code) = api_status(request());
        assert_eq!(status, want, "{what}: {code}");
        assert_eq!(snapshot(&d), before, "{what} changed something");
    }
    // Malformed JSON (sent raw).
    let raw = c
        .request(
            "POST",
            "/v1/endpoints",
            Some(("application/json", b"{\"id\": \"x\", \"pool\": ")),
        )
        .expect("request");
    assert_eq!(raw.status, 400);
    assert_eq!(
        raw.error().expect("error body").error.code,
        "malformed_json"
    );
    assert_eq!(snapshot(&d), before, "malformed JSON changed something");

    // A socket path another server holds: refused by the data path, nothing stored.
    let taken = d.run_dir().join("endpoints/taken.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&taken).expect("bind");
    let (status, code) = api_status(c.post(
        "/v1/endpoints",
        &json!({"id": "x", "pool": "default", "socket": taken}),
    ));
    assert_eq!((status, code.as_str()), (409, "socket_in_use"));
    assert_eq!(snapshot(&d), before, "a refused socket changed something");

    // The CLI: an API error is `error: MESSAGE` and exit 1; a usage error exit 2.
    let out = d.ctl(&["endpoint", "nope"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.starts_with("error: ") && err.contains("nope"), "{err}");
    let out = d.ctl(&["create"]);
    assert_eq!(out.status.code(), Some(2));
    let out = d.ctl(&["create", "x", "--pool", "default", "--device", "gpu1"]);
    assert_eq!(out.status.code(), Some(2), "--pool and --device conflict");
    assert_eq!(snapshot(&d), before);

    // A positive control: the same calls succeed when valid, and are seen.
    d.ctl_ok(&["quarantine", "gpu1"]);
    let (status, _) = api_status(c.post("/v1/endpoints", &json!({"id": "x", "pool": "default"})));
    assert_eq!(status, 409, "no free device on an available board");
    d.ctl_ok(&["unquarantine", "gpu1"]);
    d.ctl_ok(&["create", "x", "--pool", "default"]);
    assert_ne!(snapshot(&d), before);
    d.endpoint("x");
}

#[test]
fn configuration_errors_exit_2_naming_the_key() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (name, text, key) in [
        (
            "value",
            "[[boards]]\nid = \"a\"\nvram = \"lots\"\n",
            "boards[0].vram",
        ),
        ("unknown key", "[daemon]\nbogus = 1\n", "daemon.bogus"),
        (
            "homogeneity",
            "[[boards]]\nid = \"a\"\n[[boards]]\nid = \"b\"\nvram = \"128M\"\n\
             [[pools]]\nname = \"p\"\nboards = [\"a\", \"b\"]\n",
            "pools[0]",
        ),
        ("syntax", "[[boards]\n", "line 1"),
    ] {
        let file = dir.path().join("pool.toml");
        std::fs::write(&file, text).expect("write");
        let out = Command::new(EXE)
            .arg("daemon")
            .arg("--config")
            .arg(&file)
            .arg("--state-dir")
            .arg(dir.path().join("state"))
            .arg("--run-dir")
            .arg(dir.path().join("run"))
            .env("SWITCHYARD_WORKER_EXE", EXE)
            .stdin(Stdio::null())
            .output()
            .expect("run the daemon");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert!(err.contains(key), "{name}: {err}");
        assert!(
            !dir.path().join("state").exists(),
            "{name}: nothing created"
        );
    }
    let out = Command::new(EXE)
        .args(["daemon", "--config"])
        .arg(dir.path().join("missing.toml"))
        .output()
        .expect("run the daemon");
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn a_daemon_killed_with_sigkill_restarts_into_the_same_leases() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    d.ctl_ok(&["create", "vm2", "--pool", "default"]);
    d.ctl_ok(&["quarantine", "gpu1"]);
    let vm1 = d.endpoint("vm1");
    let vm2 = d.endpoint("vm2");
    let mut a = connect(&socket_of(&vm1));
    a.setup_queue(0);
    a.w32(SCRATCH, 0xfeed_0001);
    round(&mut a, 0);
    let leases = |d: &Daemon| -> Vec<(String, String)> {
        let eps: Value = d.client().get("/v1/endpoints").expect("endpoints").body;
        eps.as_array()
            .expect("array")
            .iter()
            .map(|e| {
                (
                    e["endpoint"]["id"].as_str().expect("id").to_owned(),
                    e["endpoint"]["device"].as_str().expect("device").to_owned(),
                )
            })
            .collect()
    };
    let before = leases(&d);
    assert_eq!(before.len(), 2);
    // What a worker holds reaches the daemon on the worker's own channel, a little after the
    // client has its replies: a sync (answered after every earlier custody note) says when
    // the daemon has it all.
    let held: Vec<Value> = ["vm1", "vm2"]
        .iter()
        .map(|id| {
            let synced = d
                .client()
                .post(&format!("/v1/endpoints/{id}/sync"), &())
                .expect("sync");
            assert_eq!(synced.status, 200, "{:?}", synced.body);
            synced.body["worker"]["held"].clone()
        })
        .collect();
    let last_seq = d.events().last().expect("events")["seq"]
        .as_u64()
        .expect("seq");

    d.kill9();
    // The guest keeps its device while no daemon runs.
    round(&mut a, 1);
    d.launch();
    assert_eq!(leases(&d), before, "every lease restored");
    let board: Value = d.client().get("/v1/boards/gpu1").expect("board").body;
    assert_eq!(board["state"], "quarantined", "the quarantine too");
    // The workers of the killed daemon still serve, and the new daemon adopted them: the
    // same processes, supervised again with everything they hold.
    for (old, held) in [&vm1, &vm2].into_iter().zip(&held) {
        let id = old["endpoint"]["id"].as_str().expect("id");
        let now = d.endpoint(id);
        assert_eq!(now["worker"]["state"], "running", "{now}");
        assert_eq!(now["worker"]["pid"], old["worker"]["pid"], "{now}");
        assert_eq!(
            &now["worker"]["held"], held,
            "everything held comes back: {now}"
        );
    }
    round(&mut a, 2);
    assert_eq!(a.r32(SCRATCH), 0xfeed_0001);
    // An adopted worker is replaced like any other, under the client.
    d.ctl_ok(&["restart", "vm1"]);
    let now = d.endpoint("vm1");
    assert_ne!(now["worker"]["pid"], vm1["worker"]["pid"], "{now}");
    round(&mut a, 3);
    assert_eq!(a.r32(SCRATCH), 0xfeed_0001);
    let vm1 = now;

    // A worker that cannot be adopted (its adoption socket is gone) is reported, not
    // replaced: its own process keeps serving.
    d.kill9();
    let pid2 = vm2["worker"]["pid"].as_u64().expect("pid");
    std::fs::remove_file(d.state().join(format!("workers/w{pid2}.sock")))
        .expect("vm2's adoption socket");
    d.launch();
    assert_eq!(d.endpoint("vm2")["worker"]["state"], "orphaned");
    assert_eq!(d.endpoint("vm1")["worker"]["state"], "running");
    assert_eq!(d.endpoint("vm1")["worker"]["pid"], vm1["worker"]["pid"]);
    // The restart count goes on from the last daemon's (it was 1, the `ctl restart`).
    assert_eq!(
        d.endpoint("vm1")["worker"]["restarts"],
        vm1["worker"]["restarts"]
    );
    assert_eq!(vm1["worker"]["restarts"], 1, "{vm1}");
    let out = d.ctl(&["restart", "vm2"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("orphaned"));
    // Event numbers go on from the killed daemon's.
    let events = d.events();
    let opened = events
        .iter()
        .rfind(|e| e.pointer("/pool/kind/type").and_then(Value::as_str) == Some("opened"))
        .expect("opened");
    assert!(opened["seq"].as_u64().expect("seq") > last_seq);

    // An orphan could not prove it is this daemon's worker (issue 34: its record is a
    // claim), so deleting its endpoint is refused while it runs, naming it; once its
    // administrator stops it, the endpoint goes. A new endpoint gets a worker of this daemon.
    let pid = vm2["worker"]["pid"].as_u64().expect("pid") as u32;
    let out = d.ctl(&["delete", "vm2"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(&format!("process {pid}")),
        "{out:?}"
    );
    assert!(is_worker(pid), "the orphan {pid} was signalled");
    if let Some(p) = rustix::process::Pid::from_raw(pid as i32) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_worker(pid) {
        assert!(Instant::now() < deadline, "the orphan {pid} still runs");
        std::thread::sleep(Duration::from_millis(10));
    }
    d.ctl_ok(&["delete", "vm2"]);
    d.ctl_ok(&["unquarantine", "gpu1"]);
    d.ctl_ok(&["create", "vm3", "--pool", "default"]);
    assert_eq!(d.endpoint("vm3")["worker"]["state"], "running");

    // A SIGTERM leaves the workers running too.
    let vm3_pid = d.endpoint("vm3")["worker"]["pid"].as_u64().expect("pid") as u32;
    let child = d.take_child().expect("daemon");
    let status = common::signal_and_wait(child, rustix::process::Signal::TERM, String::new);
    assert!(status.success(), "{status}");
    assert!(is_worker(vm3_pid), "the worker outlives a stopped daemon");
    round(&mut a, 4);
    // ... and the next daemon adopts it (a whole-daemon upgrade).
    d.launch();
    let now = d.endpoint("vm3");
    assert_eq!(now["worker"]["state"], "running", "{now}");
    assert_eq!(now["worker"]["pid"].as_u64(), Some(u64::from(vm3_pid)));
    round(&mut a, 5);
}

/// GPU-P style partitions of one board are separate devices: each endpoint sees its own VRAM
/// size and queue count, its VRAM is its own memory object, and nothing one partition's
/// client or engines do reaches the other's VRAM.
#[test]
fn partitions_of_a_board_cannot_reach_each_other() {
    use std::os::unix::fs::MetadataExt;
    use switchyard_softgpu::regs::{
        ERR_VRAM_RANGE, NUM_QUEUES, Q_ERROR_CODE, Q_STATUS_ERROR, VRAM_SIZE_LO, queue_reg,
    };
    let mut d = Daemon::start_with_config(
        "[[boards]]\nid = \"gpu0\"\nvram = \"64M\"\nqueues = 2\n\
         partitions = [ { id = \"gpu0.p0\", vram = \"32M\", queues = 1 }, \
         { id = \"gpu0.p1\", vram = \"32M\", queues = 1 } ]\n",
    );
    d.ctl_ok(&["create", "a", "--device", "gpu0.p0"]);
    d.ctl_ok(&["create", "b", "--device", "gpu0.p1"]);
    let (ea, eb) = (d.endpoint("a"), d.endpoint("b"));
    let mut a = connect(&socket_of(&ea));
    let mut b = connect(&socket_of(&eb));
    for (name, c) in [("a", &mut a), ("b", &mut b)] {
        assert_eq!(
            c.r32(VRAM_SIZE_LO),
            32 << 20,
            "{name}: its partition's VRAM"
        );
        assert_eq!(c.r32(NUM_QUEUES), 1, "{name}: its share of the queues");
        c.setup_queue(0);
    }
    // Separate memory objects behind the two VRAM BARs.
    let fa = a.t.0.region_info(2).expect("BAR2").fd.expect("VRAM fd");
    let fb = b.t.0.region_info(2).expect("BAR2").fd.expect("VRAM fd");
    let (ma, mb) = (fa.metadata().expect("stat"), fb.metadata().expect("stat"));
    assert_ne!(
        (ma.dev(), ma.ino()),
        (mb.dev(), mb.ino()),
        "one VRAM file each"
    );
    assert_eq!((ma.len(), mb.len()), (32 << 20, 32 << 20));
    // a's engines fill all of a's VRAM; b's VRAM stays zero everywhere.
    a.run(
        0,
        &[GpuCommand::fill(Operand::Vram(0), 32 << 20, 0xa5a5_a5a5)],
    );
    let mut probe = vec![0u8; 4096];
    for off in [0u64, 16 << 20, (32 << 20) - 4096] {
        a.vram_read(off, &mut probe);
        assert!(
            probe.iter().all(|&x| x == 0xa5),
            "a's own VRAM at {off:#x} is filled"
        );
        b.vram_read(off, &mut probe);
        assert!(
            probe.iter().all(|&x| x == 0),
            "b's VRAM at {off:#x} untouched"
        );
    }
    // Neither can address past its partition: the board's other half is not behind it.
    b.submit(0, &[GpuCommand::fill(Operand::Vram(32 << 20), 4096, 1)]);
    assert_eq!(b.wait_queue(0), Q_STATUS_ERROR);
    assert_eq!(b.r32(queue_reg(0, Q_ERROR_CODE)), ERR_VRAM_RANGE);
    // Both boards' devices are leased: a third endpoint finds no capacity.
    let out = d.ctl(&["create", "c", "--device", "gpu0.p0"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
}

const THREE_TRAPPED_BOARDS: &str = "[[boards]]\nid = \"gpu0\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"gpu1\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"gpu2\"\nvram = \"16M\"\nqueues = 2\nvram_mmap = false\n\
     [[boards]]\nid = \"mapped\"\nvram = \"16M\"\nqueues = 2\n\
     [[pools]]\nname = \"trapped\"\nboards = [\"gpu0\", \"gpu1\", \"gpu2\"]\n";

fn lease_board(d: &mut Daemon, id: &str) -> String {
    d.endpoint(id)
        .pointer("/lease/board")
        .and_then(Value::as_str)
        .expect("lease")
        .to_owned()
}

#[test]
fn moves_and_a_drain_under_a_client_keep_its_device_and_follow_the_lease() {
    let mut d = Daemon::start_with_config(THREE_TRAPPED_BOARDS);
    d.ctl_ok(&["create", "vm1", "--pool", "trapped"]);
    d.ctl_ok(&["create", "vm2", "--pool", "trapped"]);
    let (e1, e2) = (d.endpoint("vm1"), d.endpoint("vm2"));
    assert_eq!(lease_board(&mut d, "vm1"), "gpu0");
    assert_eq!(lease_board(&mut d, "vm2"), "gpu1");
    let mut c1 = connect(&socket_of(&e1));
    let mut c2 = connect(&socket_of(&e2));
    c1.setup_queue(0);
    c2.setup_queue(0);
    let kept: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    c1.vram_write(8 << 20, &kept);
    c1.w32(SCRATCH, 0x600d);
    let pid1 = d.endpoint("vm1").pointer("/worker/pid").cloned();

    // vm1 moves to the free board, through the CLI, while vm2 works on.
    let out = d.ctl_ok(&["move", "vm1", "--to", "gpu2"]);
    assert!(out.contains("moved from gpu0 to gpu2"), "{out}");
    assert_eq!(lease_board(&mut d, "vm1"), "gpu2");
    round(&mut c2, 1);
    for r in 0..4 {
        round(&mut c1, r);
    }
    let mut got = vec![0u8; kept.len()];
    c1.vram_read(8 << 20, &mut got);
    assert!(got == kept, "VRAM written before the move");
    assert_eq!(c1.r32(SCRATCH), 0x600d);
    assert_eq!(
        d.endpoint("vm1").pointer("/worker/pid").cloned(),
        pid1,
        "a move is not a restart"
    );

    // Refusals change nothing: a busy target, a mapped-VRAM shape, unknown ids, bad bodies.
    let c = d.client();
    let before = snapshot(&d);
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/move", &json!({ "to": "gpu1" }))),
        (409, "conflict".into()),
        "gpu1 is vm2's"
    );
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/move", &json!({ "to": "mapped" }))),
        (422, "invalid".into()),
        "another shape"
    );
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/move", &json!({ "to": "nope" }))).0,
        404
    );
    assert_eq!(
        api_status(c.post("/v1/endpoints/nope/move", &json!({ "to": "gpu0" }))).0,
        404
    );
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/move", &json!({ "board": "gpu0" }))).0,
        422
    );
    assert_eq!(snapshot(&d), before, "refused moves changed something");

    // Drain gpu2: vm1 goes to the only free board left (gpu0); gpu2 is quarantined.
    let out = d.ctl_ok(&["drain", "gpu2"]);
    assert!(out.contains("1 endpoint(s) moved, 0 failed"), "{out}");
    assert_eq!(lease_board(&mut d, "vm1"), "gpu0");
    let b = c.get("/v1/boards/gpu2").expect("board").body;
    assert_eq!(b["state"], "quarantined", "{b}");
    c1.vram_read(8 << 20, &mut got);
    assert!(got == kept, "VRAM after the drain");
    round(&mut c1, 9);
    round(&mut c2, 9);
    // Nowhere left to drain gpu1 to: refused as a whole, nothing moves.
    assert_eq!(api_status(c.post("/v1/boards/gpu1/drain", &())).0, 409);
    assert_eq!(lease_board(&mut d, "vm2"), "gpu1");

    // Metrics: the boards moved off, with their last downtime; events: the lifecycle.
    let metrics = c.get_text("/metrics").expect("metrics");
    for board in ["gpu0", "gpu2"] {
        let line = format!("switchyard_board_moves_total{{board=\"{board}\"}} 1");
        assert!(metrics.contains(&line), "{line} missing:\n{metrics}");
    }
    assert!(
        metrics.lines().any(|l| l
            .starts_with("switchyard_board_last_move_downtime_seconds{board=\"gpu2\"}")
            && !l.ends_with(" 0.0")),
        "{metrics}"
    );
    let kinds: Vec<String> = d
        .events()
        .iter()
        .filter_map(|e| e.pointer("/pool/kind/type").and_then(Value::as_str))
        .map(str::to_owned)
        .collect();
    for k in ["move_started", "lease_moved", "drain_started"] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing: {kinds:?}");
    }
}

#[test]
fn a_mapped_vram_endpoint_is_refused_a_move_with_a_reason() {
    let mut d = Daemon::start_with_config(
        "[[boards]]\nid = \"a\"\nvram = \"16M\"\n[[boards]]\nid = \"b\"\nvram = \"16M\"\n",
    );
    d.ctl_ok(&["create", "vm", "--device", "a"]);
    let before = snapshot(&d);
    let out = d.ctl(&["move", "vm", "--to", "b"]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("vram_mmap"), "{err}");
    assert_eq!(snapshot(&d), before);
    assert_eq!(lease_board(&mut d, "vm"), "a");
}

#[test]
fn detach_and_attach_hand_a_board_from_one_endpoint_to_another() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    d.ctl_ok(&["create", "vm2", "--pool", "default"]);
    assert_eq!(lease_board(&mut d, "vm1"), "gpu0");
    let (e1, e2) = (d.endpoint("vm1"), d.endpoint("vm2"));
    let mut c1 = connect(&socket_of(&e1));
    c1.setup_queue(0);
    let secret = vec![0xa5u8; 4096];
    c1.vram_write(0, &secret);
    // A VM uses vm1 and its VMM is unknown: refused, nothing changes.
    let before = snapshot(&d);
    let c = d.client();
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/detach", &())),
        (409, "connected".into())
    );
    assert_eq!(snapshot(&d), before);
    round(&mut c1, 0);
    // The VM lets go (as after a device_del); now vm1 and vm2 can be detached.
    drop(c1);
    let deadline = Instant::now() + Duration::from_secs(10);
    while d.endpoint("vm1")["worker"]["held"].as_u64() > Some(3) {
        assert!(Instant::now() < deadline, "the connection is still held");
        std::thread::sleep(Duration::from_millis(10));
    }
    let out = d.ctl_ok(&["detach", "vm1"]);
    assert!(out.contains("detached"), "{out}");
    d.ctl_ok(&["detach", "vm2"]);
    let vm1 = d.endpoint("vm1");
    assert_eq!(vm1["worker"]["state"], "no_lease", "{vm1}");
    assert!(vm1["lease"].is_null(), "{vm1}");
    assert!(!socket_of(&e1).exists(), "nothing serves vm1's socket");
    // vm2 takes gpu0, vm1's board: a worker on fresh VRAM (vm1's data is not there).
    d.ctl_ok(&["attach", "vm2", "--device", "gpu0"]);
    assert_eq!(lease_board(&mut d, "vm2"), "gpu0");
    assert_eq!(d.endpoint("vm2")["worker"]["state"], "running");
    let mut c2 = connect(&socket_of(&e2));
    let mut got = vec![0u8; 4096];
    c2.vram_read(0, &mut got);
    assert!(got.iter().all(|&b| b == 0), "a new tenant gets zeroed VRAM");
    c2.setup_queue(0);
    round(&mut c2, 1);
    // Attach refusals: a leased endpoint; a taken device; an unknown pool.
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm2/attach", &json!({}))).0,
        409
    );
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/attach", &json!({"device": "gpu0"}))).0,
        409
    );
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/attach", &json!({"pool": "nope"}))).0,
        404
    );
    assert_eq!(
        api_status(c.post("/v1/endpoints/vm1/attach", &json!({"board": "gpu1"}))).0,
        422
    );
    // vm1 gets the other board from its pool, and serves again.
    d.ctl_ok(&["attach", "vm1"]);
    assert_eq!(lease_board(&mut d, "vm1"), "gpu1");
    let mut c1 = connect(&socket_of(&e1));
    c1.setup_queue(0);
    round(&mut c1, 2);
    let kinds: Vec<String> = d
        .events()
        .iter()
        .filter_map(|e| e.pointer("/pool/kind/type").and_then(Value::as_str))
        .map(str::to_owned)
        .collect();
    for k in ["detached", "attached"] {
        assert!(kinds.iter().any(|x| x == k), "{k} missing: {kinds:?}");
    }
}

/// Both ends of a migration: the source's device streams its state out (PRE_COPY), the
/// destination's takes it in (RESUMING). While a stream is open, restarts, upgrades, moves
/// and drains of that endpoint are refused with a reason and change nothing; once the device
/// is RUNNING again they go.
#[test]
fn restarts_upgrades_and_moves_wait_while_the_vmm_migrates_the_device() {
    use switchyard_proto::MigState;
    let mut d = Daemon::start_with_config(THREE_TRAPPED_BOARDS);
    for (id, state, other) in [
        ("vm1", MigState::PreCopy, "gpu1"),
        ("vm2", MigState::Resuming, "gpu2"),
    ] {
        d.ctl_ok(&["create", id, "--pool", "trapped"]);
        let e = d.endpoint(id);
        let board = lease_board(&mut d, id);
        let mut c = connect(&socket_of(&e));
        c.setup_queue(0);
        round(&mut c, 0);
        let pid = e["worker"]["pid"].clone();
        // The VMM opens a migration stream: the worker tells its supervisor.
        c.t.0.set_mig_state(state as u32).expect("migration state");
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.endpoint(id)["worker"]["migrating"] != true {
            assert!(
                Instant::now() < deadline,
                "{id}: the migration is not reported"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let api = d.client();
        let before = snapshot(&d);
        for (what, r) in [
            (
                "restart",
                api.post(&format!("/v1/endpoints/{id}/restart"), &()),
            ),
            (
                "upgrade",
                api.post(&format!("/v1/endpoints/{id}/upgrade"), &()),
            ),
            (
                "move",
                api.post(&format!("/v1/endpoints/{id}/move"), &json!({ "to": other })),
            ),
            ("drain", api.post(&format!("/v1/boards/{board}/drain"), &())),
        ] {
            assert_eq!(api_status(r), (409, "migrating".into()), "{id} {what}");
        }
        assert_eq!(snapshot(&d), before, "{id}: refusals changed something");
        assert_eq!(
            d.endpoint(id)["worker"]["pid"],
            pid,
            "{id}: never restarted"
        );
        // The migration is over: the source's device is RUNNING again; the destination's VMM
        // gave up (an incoming migration that failed), which abandons it. Everything goes
        // again.
        let c = if state == MigState::PreCopy {
            c.t.0
                .set_mig_state(MigState::Running as u32)
                .expect("RUNNING");
            Some(c)
        } else {
            drop(c);
            None
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while d.endpoint(id)["worker"]["migrating"] != false {
            assert!(
                Instant::now() < deadline,
                "{id}: the end of the migration is not reported"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        d.ctl_ok(&["move", id, "--to", other]);
        d.ctl_ok(&["restart", id]);
        if let Some(mut c) = c {
            round(&mut c, 1);
        }
    }
}

/// `ctl ... | head -1`: a reader that stops reading ends the command quietly (exit 0, no
/// panic about a broken pipe), for tables, metrics and a followed event stream alike.
#[test]
fn ctl_output_into_a_closed_pipe_ends_quietly() {
    let d = Daemon::start();
    let socket = d.socket();
    for args in [
        &["boards"][..],
        &["metrics"],
        &["events", "--follow"],
        &["--json", "pools"],
    ] {
        let mut child = Command::new(EXE)
            .arg("ctl")
            .arg("--socket")
            .arg(&socket)
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ctl");
        // The reader goes away before ctl writes anything.
        drop(child.stdout.take());
        let out = child.wait_with_output().expect("ctl ends");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "ctl {args:?}: {:?} {stderr}",
            out.status
        );
        assert!(!stderr.contains("panicked"), "ctl {args:?}: {stderr}");
    }
}

/// `ctl vmm` registers an endpoint's VMM and `ctl vmm --forget` unregisters it; forgetting
/// twice is an error, and a registration without its QMP socket is a usage error.
#[test]
fn ctl_vmm_registers_and_forgets_a_vmm() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1"]);
    let qmp = d.dir().join("qmp.sock");
    let qmp = qmp.to_str().expect("utf-8 path");
    let out = d.ctl_ok(&[
        "vmm",
        "vm1",
        "--qmp",
        qmp,
        "--device-id",
        "gpu0",
        "--bus",
        "rp1",
    ]);
    assert!(
        out.contains("VMM registered") && out.contains("bus rp1"),
        "{out}"
    );
    assert_eq!(d.endpoint("vm1")["vmm"]["device_id"], "gpu0");

    let out = d.ctl_ok(&["vmm", "vm1", "--forget"]);
    assert!(out.contains("VMM forgotten"), "{out}");
    assert!(d.endpoint("vm1")["vmm"].is_null());

    let again = d.ctl(&["vmm", "vm1", "--forget"]);
    assert_eq!(again.status.code(), Some(1), "{again:?}");
    let usage = d.ctl(&["vmm", "vm1", "--device-id", "gpu0"]);
    assert_eq!(usage.status.code(), Some(2), "{usage:?}");
    assert!(
        String::from_utf8_lossy(&usage.stderr).contains("--qmp"),
        "{usage:?}"
    );
    let both = d.ctl(&["vmm", "vm1", "--forget", "--qmp", qmp]);
    assert_eq!(both.status.code(), Some(2), "{both:?}");
}

/// `SWITCHYARD_CONTROL_SOCKET` names the control socket when `--socket` does not.
#[test]
fn ctl_takes_the_socket_from_the_environment() {
    let d = Daemon::start();
    let out = Command::new(EXE)
        .args(["ctl", "boards"])
        .env("SWITCHYARD_CONTROL_SOCKET", d.socket())
        .output()
        .expect("run ctl");
    assert!(out.status.success(), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("gpu0"),
        "{out:?}"
    );
    // --socket wins over the environment.
    let out = Command::new(EXE)
        .args(["ctl", "boards", "--socket"])
        .arg(d.socket())
        .env("SWITCHYARD_CONTROL_SOCKET", "/nonexistent/control.sock")
        .output()
        .expect("run ctl");
    assert!(out.status.success(), "{out:?}");
}

/// A request stuck on a VMM that never answers does not hold a daemon told to stop: the
/// control connections and then the request get their grace periods, the request is cut (its
/// client gets no reply), the daemon exits cleanly and says so, and the worker keeps running.
/// (The VMM greets and then ignores `device_del`: the detach would wait 120 s for it.)
#[test]
fn a_stopping_daemon_cuts_a_request_stuck_on_a_silent_vmm() {
    let mut d = Daemon::start();
    d.ctl_ok(&["create", "vm1", "--pool", "default"]);
    let e1 = d.endpoint("vm1");
    let worker = e1["worker"]["pid"].as_u64().expect("pid") as u32;
    let mut guest = connect(&socket_of(&e1));
    guest.setup_queue(0);
    let qmp = d.dir().join("qmp.sock");
    let commands = silent_qmp(&qmp);
    d.client()
        .put(
            "/v1/endpoints/vm1/vmm",
            &json!({"qmp": qmp, "device_id": "gpu-dev0"}),
        )
        .expect("register the VMM");
    let api = d.client();
    let detach = std::thread::spawn(move || api.post("/v1/endpoints/vm1/detach", &()));
    let asked = common::wait_for(Duration::from_secs(10), || {
        commands
            .lock()
            .expect("lock")
            .iter()
            .any(|c| c == "device_del")
            .then_some(())
    });
    assert!(asked.is_some(), "the detach never asked the VMM to unplug");
    let child = d.take_child().expect("daemon");
    let status = common::signal_and_wait(child, rustix::process::Signal::TERM, || d.log());
    assert!(status.success(), "{status}\n{}", d.log());
    assert!(
        d.log()
            .contains("requests still running after the shutdown grace period; cut"),
        "{}",
        d.log()
    );
    let reply = detach.join().expect("the detach thread");
    assert!(reply.is_err(), "the cut request was answered: {reply:?}");
    assert!(is_worker(worker), "the worker outlives the stopped daemon");
    round(&mut guest, 1);
}

/// A QMP server on `path` that greets, accepts `qmp_capabilities` and never answers anything
/// else; returns the commands it got.
fn silent_qmp(path: &std::path::Path) -> Arc<std::sync::Mutex<Vec<String>>> {
    use std::io::{BufRead, Write};
    let listener = std::os::unix::net::UnixListener::bind(path).expect("bind the QMP socket");
    let got = Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = got.clone();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { return };
            let greeting = json!({"QMP": {"version": {"qemu": {"major": 11, "minor": 1,
                "micro": 0}, "package": "silent"}, "capabilities": []}});
            let _ = writeln!(conn, "{greeting}");
            let reader = std::io::BufReader::new(conn.try_clone().expect("clone"));
            for line in reader.lines() {
                let Ok(req) = line.map(|l| serde_json::from_str::<Value>(&l)) else {
                    break;
                };
                let Ok(req) = req else { break };
                let command = req["execute"].as_str().unwrap_or_default().to_owned();
                seen.lock().expect("lock").push(command.clone());
                if command == "qmp_capabilities" {
                    let _ = writeln!(conn, "{}", json!({"return": {}, "id": req["id"]}));
                } else {
                    break;
                }
            }
            // Never answered, never closed.
            held.push(conn);
        }
    });
    got
}
