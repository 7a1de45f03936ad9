//! Control API request latency (issue 11: "API request latency"). A real `switchyard daemon`
//! (the release binary, `--switchyard-bin`) on a private state and run directory with one
//! endpoint; `switchyard_control::ControlClient` (what `switchyard ctl` uses: one HTTP/1.1
//! request per connection over the control socket) times requests back to back:
//!
//! - `GET /health`: the HTTP stack alone (connect, request, reply, close);
//! - `GET /v1/endpoints/{id}`: the pool under its mutex and the supervisor's worker status;
//! - `GET /metrics`: the Prometheus text of every family;
//! - `POST /v1/boards/{id}/quarantine` and `.../unquarantine`: a mutation, one redb
//!   transaction each (durable: fsync), then the event.
//!
//! Floor: an AF_UNIX connect + 64-byte request + 512-byte reply + close, timed in the same run
//! (what one request over a fresh connection cannot go below). No target: the issue asks for
//! the figure.

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use switchyard_control::ControlClient;

use crate::cases::{Settings, fig};
use crate::report::{Row, Unit};
use crate::stats::ns;

/// A daemon killed (with its workers: it deletes its endpoints first) on every path.
pub(crate) struct DaemonProc {
    pub(crate) child: Child,
    socket: std::path::PathBuf,
    /// The endpoints the case creates, deleted before the daemon is killed.
    endpoints: &'static [&'static str],
}

impl Drop for DaemonProc {
    fn drop(&mut self) {
        if let Ok(c) = ControlClient::connect(&self.socket) {
            for id in self.endpoints {
                let _ = c.delete(&format!("/v1/endpoints/{id}"));
            }
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `bin daemon` on `state` and `run` (with `--config` when given, and `env`), and
/// waits until its API answers. `endpoints`: what the case creates (deleted at the end).
pub(crate) fn start_daemon(
    bin: &Path,
    (state, run): (&Path, &Path),
    config: Option<&Path>,
    env: &[(&str, &std::ffi::OsStr)],
    endpoints: &'static [&'static str],
) -> Result<(DaemonProc, ControlClient)> {
    if !bin.is_file() {
        bail!(
            "{} not found: build it (`cargo build --release -p switchyard`, which scripts/bench.sh does) or pass --switchyard-bin",
            bin.display()
        );
    }
    let socket = run.join("control.sock");
    let mut cmd = Command::new(bin);
    cmd.arg("daemon");
    if let Some(config) = config {
        cmd.arg("--config").arg(config);
    }
    let child = cmd
        .arg("--state-dir")
        .arg(state)
        .arg("--run-dir")
        .arg(run)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("start {} daemon", bin.display()))?;
    let mut daemon = DaemonProc {
        child,
        socket: socket.clone(),
        endpoints,
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let client = loop {
        if let Ok(c) = ControlClient::connect(&socket)
            && c.get("/health").is_ok()
        {
            break c;
        }
        if let Some(st) = daemon.child.try_wait()? {
            bail!("the daemon exited: {st}");
        }
        ensure!(Instant::now() < deadline, "the daemon does not answer");
        std::thread::sleep(Duration::from_millis(20));
    };
    Ok((daemon, client))
}

/// AF_UNIX connect + request + reply + close, against an echo thread.
fn connection_floor(dir: &Path, n: usize) -> Result<Vec<u64>> {
    let path = dir.join("floor.sock");
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).context("bind the floor socket")?;
    let server = std::thread::Builder::new()
        .name("api-floor".into())
        .spawn(move || -> Result<()> {
            let mut req = [0u8; 64];
            let reply = [0xa5u8; 512];
            for _ in 0..n {
                let (mut s, _) = listener.accept()?;
                s.read_exact(&mut req)?;
                s.write_all(&reply)?;
            }
            Ok(())
        })
        .context("spawn the floor thread")?;
    let mut samples = Vec::with_capacity(n);
    let mut reply = [0u8; 512];
    for _ in 0..n {
        let t0 = Instant::now();
        let mut s = UnixStream::connect(&path).context("connect the floor socket")?;
        s.write_all(&[0x5a; 64])?;
        s.read_exact(&mut reply)?;
        drop(s);
        samples.push(ns(t0.elapsed()));
    }
    server
        .join()
        .map_err(|_| anyhow::anyhow!("the floor thread panicked"))??;
    Ok(samples)
}

/// One timed API request.
type Request<'a> = Box<dyn FnMut() -> Result<()> + 'a>;

/// Times `n` calls of `f`, after 5 unrecorded ones.
fn timed(n: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<u64>> {
    for _ in 0..5 {
        f()?;
    }
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        f()?;
        samples.push(ns(t0.elapsed()));
    }
    Ok(samples)
}

/// See the [module](self) documentation.
pub fn api(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let n = if s.quick { 30 } else { 300 };
    let (state, run) = (dir.join("api-state"), dir.join("api-run"));
    let (daemon, client) = start_daemon(&s.switchyard_bin, (&state, &run), None, &[], &["bench"])?;
    client
        .post(
            "/v1/endpoints",
            &serde_json::json!({ "id": "bench", "pool": "default" }),
        )
        .context("create the endpoint")?;

    let mut floor = connection_floor(dir, n)?;
    let floor_fig = fig(
        "AF_UNIX connect + 64 B request + 512 B reply + close",
        &mut floor,
        Unit::Micros,
        0.0,
    )?;
    let mut quarantined = false;
    let cases: [(&str, &str, Request<'_>); 4] = [
        (
            "GET /health",
            "the HTTP stack alone",
            Box::new(|| client.get("/health").map(drop).context("GET /health")),
        ),
        (
            "GET /v1/endpoints/{id}",
            "the pool under its mutex and the worker's status",
            Box::new(|| {
                client
                    .get("/v1/endpoints/bench")
                    .map(drop)
                    .context("GET endpoint")
            }),
        ),
        (
            "GET /metrics",
            "every family's OpenMetrics text",
            Box::new(|| {
                client
                    .get_text("/metrics")
                    .map(drop)
                    .context("GET /metrics")
            }),
        ),
        (
            "POST quarantine / unquarantine",
            "a mutation: one durable redb transaction, then its event (alternating)",
            Box::new(|| {
                let verb = if quarantined {
                    "unquarantine"
                } else {
                    "quarantine"
                };
                quarantined = !quarantined;
                client
                    .post(&format!("/v1/boards/gpu1/{verb}"), &())
                    .map(drop)
                    .with_context(|| format!("POST {verb}"))
            }),
        ),
    ];
    for (case, what, f) in cases {
        let mut samples = timed(n, f)?;
        rows.push(Row::new(
            "api",
            format!("control API: {case}"),
            "api",
            "switchyard daemon (release), ControlClient",
            None,
            Unit::Micros,
            fig(case, &mut samples, Unit::Micros, 0.0)?,
            Some(floor_fig.clone()),
            None,
            None,
            format!(
                "{what}; {n} requests back to back, each on a new connection as `switchyard ctl` makes it; floor: {}, same run",
                floor_fig.name
            ),
        ));
    }
    drop(daemon);
    Ok(())
}
