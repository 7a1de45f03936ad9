//! One tenant's slow create under another tenant's traffic (issue 32: "the daemon never
//! stalls"). A real `switchyard daemon` (the release binary) whose workers start through a
//! wrapper that, while a marker file exists, sleeps before it runs the worker: a create then
//! takes that long (its worker is spawned and waited for). Meanwhile a second endpoint's
//! client makes vfio-user round trips (a 4-byte BAR0 read) and the control API is asked
//! `GET /health`:
//!
//! - the client's round trip during the create, against the same client's round trip just
//!   before it (floor; goal ≤ 2×: the data path does not wait on the control plane);
//! - `GET /health` during the create, against `GET /health` just before it (goal ≤ 50 ms:
//!   the control API is not held up by the create's wait).
//!
//! Before the daemon's pool had one owner, the create held the pool's lock for its whole
//! wait, and every API request waited behind it.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use switchyard_client::Client;
use switchyard_control::ControlClient;

use crate::api::start_daemon;
use crate::cases::{Settings, fig};
use crate::report::{Row, Target, Unit};
use crate::servers::vmm_client_config;
use crate::stats::ns;

/// How long a slow worker waits before it starts.
const SLOW_START: Duration = Duration::from_secs(2);

/// p99 of `samples` (ns), nearest rank.
fn p99(samples: &[u64]) -> u64 {
    let mut s = samples.to_vec();
    s.sort_unstable();
    s.get((s.len() * 99 / 100).min(s.len().saturating_sub(1)))
        .copied()
        .unwrap_or(0)
}

/// See the [module](self) documentation.
pub fn create_load(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let bin = &s.switchyard_bin;
    let (state, run) = (dir.join("load-state"), dir.join("load-run"));
    let marker = dir.join("load-slow");
    let wrapper = dir.join("load-worker.sh");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\n[ -e '{}' ] && sleep {}\nexec '{}' \"$@\"\n",
            marker.display(),
            SLOW_START.as_secs(),
            bin.display()
        ),
    )
    .context("write the worker wrapper")?;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    let config = dir.join("load-pool.toml");
    std::fs::write(
        &config,
        "[[boards]]\nid = \"g0\"\nvram = \"16M\"\nvram_mmap = false\n\
         [[boards]]\nid = \"g1\"\nvram = \"16M\"\nvram_mmap = false\n\
         [[pools]]\nname = \"p\"\nboards = [\"g0\", \"g1\"]\n",
    )?;
    let socket = run.join("control.sock");
    let (daemon, api) = start_daemon(
        bin,
        (&state, &run),
        Some(&config),
        &[("SWITCHYARD_WORKER_EXE", wrapper.as_os_str())],
        &["busy", "slow"],
    )?;
    let api = api.with_timeout(Some(Duration::from_secs(60)));
    let created: Value = api
        .post("/v1/endpoints", &json!({ "id": "busy", "pool": "p" }))
        .context("create the busy endpoint")?
        .body;
    let ep_socket = created
        .pointer("/endpoint/socket")
        .and_then(Value::as_str)
        .with_context(|| format!("no socket: {created}"))?
        .to_owned();
    let mut client =
        Client::connect_with(&ep_socket, vmm_client_config(Some(Duration::from_secs(30))))
            .with_context(|| format!("connect {ep_socket}"))?;
    let mut buf = [0u8; 4];
    let mut round_trip = || -> Result<u64> {
        let t0 = Instant::now();
        client.region_read(0, 0, &mut buf).context("BAR0 read")?;
        Ok(ns(t0.elapsed()))
    };
    let health = || -> Result<u64> {
        let t0 = Instant::now();
        api.get("/health").context("GET /health")?;
        Ok(ns(t0.elapsed()))
    };
    let n = if s.quick { 200 } else { 2000 };
    for _ in 0..50 {
        round_trip()?;
    }
    let mut rt_before: Vec<u64> = (0..n).map(|_| round_trip()).collect::<Result<_>>()?;
    let mut api_before: Vec<u64> = (0..n / 10).map(|_| health()).collect::<Result<_>>()?;

    std::fs::write(&marker, b"")?;
    let creating = Arc::new(AtomicBool::new(true));
    let flag = creating.clone();
    let slow_socket = socket.clone();
    let slow = std::thread::Builder::new()
        .name("bench-slow-create".into())
        .spawn(move || -> Result<Duration> {
            let api =
                ControlClient::connect(&slow_socket)?.with_timeout(Some(Duration::from_secs(60)));
            let t0 = Instant::now();
            let r = api.post("/v1/endpoints", &json!({ "id": "slow", "pool": "p" }));
            flag.store(false, Ordering::SeqCst);
            let r = r.context("the slow create")?;
            ensure!(r.status == 201, "the slow create failed: {}", r.body);
            Ok(t0.elapsed())
        })
        .context("spawn the slow create")?;
    // The create is under way once its wrapper sleeps: give it a moment to get there.
    std::thread::sleep(Duration::from_millis(200));
    let (mut rt_during, mut api_during) = (Vec::new(), Vec::new());
    let mut i = 0u64;
    while creating.load(Ordering::SeqCst) {
        rt_during.push(round_trip()?);
        i += 1;
        if i.is_multiple_of(10) {
            api_during.push(health()?);
        }
    }
    let took = slow
        .join()
        .map_err(|_| anyhow::anyhow!("the slow create's thread panicked"))??;
    let _ = std::fs::remove_file(&marker);
    ensure!(
        took >= SLOW_START,
        "the create did not wait for its slow worker ({took:?})"
    );
    ensure!(
        !rt_during.is_empty() && !api_during.is_empty(),
        "nothing was measured during the create"
    );
    let (p99_before, p99_during) = (p99(&rt_before), p99(&rt_during));
    let floor = fig(
        "the same client's round trip before the create",
        &mut rt_before,
        Unit::Micros,
        0.0,
    )?;
    rows.push(Row::new(
        "api",
        "client round trip during another tenant's slow create".into(),
        "api",
        "switchyard daemon (release), BAR0 read over vfio-user",
        None,
        Unit::Micros,
        fig("round trip during the create", &mut rt_during, Unit::Micros, 0.0)?,
        Some(floor),
        None,
        Some(Target {
            floor_ratio: 2.0,
            beat_peer: false,
            plus: 0.0,
        }),
        format!(
            "{} round trips while another endpoint's create waited {:.1} s for its worker; p99 {:.1} µs against {:.1} µs before ({:.2}×); goal ≤ 2× the client's own baseline",
            rt_during.len(),
            took.as_secs_f64(),
            p99_during as f64 / 1e3,
            p99_before as f64 / 1e3,
            p99_during as f64 / p99_before.max(1) as f64,
        ),
    ));
    let floor = fig(
        "GET /health before the create",
        &mut api_before,
        Unit::Micros,
        0.0,
    )?;
    rows.push(Row::new(
        "api",
        "control API: GET /health during a slow create".into(),
        "api",
        "switchyard daemon (release), ControlClient",
        None,
        Unit::Micros,
        fig(
            "GET /health during the create",
            &mut api_during,
            Unit::Micros,
            0.0,
        )?,
        Some(floor),
        None,
        Some(Target::absolute(50_000.0)),
        format!(
            "{} requests while a create waited {:.1} s for its worker; max {:.1} ms; goal ≤ 50 ms",
            api_during.len(),
            took.as_secs_f64(),
            api_during.iter().max().copied().unwrap_or(0) as f64 / 1e6,
        ),
    ));
    drop(daemon);
    Ok(())
}
