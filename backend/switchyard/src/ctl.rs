//! `switchyard ctl`: the pool daemon's CLI, a client of its control API.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use serde_json::Value;
use switchyard_control::{ControlClient, ControlError};
use switchyard_daemon::app::api::{
    DrainResult, EndpointStatus, FaultInjected, FaultRequest, MoveResult, WorkerReplaced,
};
use switchyard_pool::{BoardState, BoardView, ByteSize, DeviceShape, EndpointSpec, PoolView};

/// The daemon's control socket, as `ctl` and `cluster` take it.
#[derive(Debug, clap::Args)]
pub struct ControlSocket {
    /// The daemon's control socket.
    #[arg(
        long,
        global = true,
        value_name = "PATH",
        env = "SWITCHYARD_CONTROL_SOCKET",
        default_value = "/run/switchyard/control.sock"
    )]
    pub socket: PathBuf,
}

#[derive(Debug, clap::Args)]
pub struct CtlArgs {
    #[command(flatten)]
    control: ControlSocket,

    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: CtlCommand,
}

#[derive(Debug, clap::Subcommand)]
enum CtlCommand {
    /// Boards and their devices, with who leases them.
    Boards,
    /// Pools and their free devices.
    Pools,
    /// Endpoints, their leases and workers.
    Endpoints,
    /// One endpoint in detail.
    Endpoint {
        /// The endpoint's id.
        id: String,
    },
    /// Create an endpoint: lease a device from a pool (or a named device) and serve its socket.
    Create {
        /// The endpoint's id.
        id: String,
        /// Lease from this pool.
        #[arg(long, value_name = "POOL", conflicts_with = "device")]
        pool: Option<String>,
        /// Lease this device (a board, or a partition).
        #[arg(long, value_name = "DEVICE")]
        device: Option<String>,
        /// Least device memory, VRAM for a GPU (K/M/G/T suffix, binary).
        #[arg(
            long,
            visible_alias = "min-memory",
            value_name = "SIZE",
            value_parser = switchyard_device::parse_size
        )]
        min_vram: Option<u64>,
        /// Least command queues.
        #[arg(long, value_name = "N")]
        min_queues: Option<u32>,
        /// The endpoint's socket path (default `<endpoint_dir>/<id>.sock`); only directly in
        /// the daemon's endpoint directory (another place only through its configuration).
        #[arg(long, value_name = "PATH")]
        endpoint_socket: Option<PathBuf>,
        /// The destination endpoint of a live migration of endpoint SRC's VM: a free device
        /// of SRC's shape from SRC's pool. When the migration completes SRC is deleted (its
        /// lease released); when it is aborted this endpoint is.
        #[arg(long, value_name = "SRC", conflicts_with_all = ["pool", "device", "min_vram", "min_queues"])]
        incoming_for: Option<String>,
        /// The destination endpoint of a live migration from another host: FILE is the
        /// source endpoint as `ctl endpoint SRC --json` prints it there (to its owner or
        /// root: it holds the migration token). Leases a free device of its kind and options
        /// from its pool's namesake here (or `--pool`). The source's daemon deletes the
        /// source once its VMM quits after the migration; when it is aborted this endpoint
        /// is deleted.
        #[arg(long, value_name = "FILE", conflicts_with_all = ["incoming_for", "device", "min_vram", "min_queues"])]
        incoming_spec: Option<PathBuf>,
    },
    /// Stop an endpoint's worker (the VM's connection closes) and delete it.
    Delete {
        /// The endpoint's id.
        id: String,
    },
    /// Take no new leases on a board.
    Quarantine {
        /// The board's id.
        board: String,
    },
    /// Let a quarantined board take leases again.
    Unquarantine {
        /// The board's id.
        board: String,
    },
    /// Crash drill: SIGKILL the endpoint's worker; a replacement resumes the guest's
    /// connection.
    Restart {
        /// The endpoint's id.
        id: String,
    },
    /// Replace the endpoint's worker with the switchyard binary now on disk.
    Upgrade {
        /// The endpoint's id.
        id: String,
    },
    /// Move an endpoint's device to another board under the running guest: transparent with
    /// vram_mmap = false (VRAM is copied while the guest runs), guest-visible through the
    /// endpoint's VMM otherwise (see `ctl vmm`).
    Move {
        /// The endpoint's id.
        id: String,
        /// The device to move to (a board, or a partition).
        #[arg(long, value_name = "DEVICE")]
        to: String,
    },
    /// Register the VMM of an endpoint whose guest maps VRAM, so that moves of it are made
    /// guest-visibly (QMP device_del, move, device_add); `--forget` unregisters it.
    Vmm {
        /// The endpoint's id.
        id: String,
        /// QEMU's QMP socket.
        #[arg(long, value_name = "PATH", required_unless_present = "forget")]
        qmp: Option<PathBuf>,
        /// The vfio-user-pci device's id in QEMU.
        #[arg(long, value_name = "ID", required_unless_present = "forget")]
        device_id: Option<String>,
        /// The pcie-root-port it is plugged into.
        #[arg(long, value_name = "BUS")]
        bus: Option<String>,
        /// Forget the endpoint's VMM (moves are then refused while a VM maps VRAM).
        #[arg(long, conflicts_with_all = ["qmp", "device_id", "bus"])]
        forget: bool,
    },
    /// Take an endpoint's device away (unplugged from its VM through the registered VMM);
    /// its board is free.
    Detach {
        /// The endpoint's id.
        id: String,
    },
    /// Lease a device to a detached endpoint and start serving it (fresh VRAM; plugged into
    /// its VM through the registered VMM).
    Attach {
        /// The endpoint's id.
        id: String,
        /// Lease this device.
        #[arg(long, value_name = "DEVICE", conflicts_with = "pool")]
        device: Option<String>,
        /// Lease from this pool (default: the endpoint's own).
        #[arg(long, value_name = "POOL")]
        pool: Option<String>,
    },
    /// Quarantine a board and move every endpoint off it.
    Drain {
        /// The board's id.
        board: String,
    },
    /// Failover drill: the board's running devices simulate a failure (softgpu: `engine`,
    /// an engine thread dies; `vram`, VRAM becomes unusable), then detect it; the board fails
    /// and its endpoints fail over as their pool's `failover` policy says. The daemon must
    /// have been started with `--faults`.
    Fault {
        /// The board's id.
        board: String,
        /// The fault.
        kind: String,
    },
    /// Lifecycle events (pool and workers).
    Events {
        /// Events after this sequence number (default: all the pool's history).
        #[arg(long, value_name = "SEQ", default_value_t = 0)]
        since: u64,
        /// Keep printing new events until interrupted.
        #[arg(long)]
        follow: bool,
    },
    /// Prometheus metrics (OpenMetrics text).
    Metrics,
}

/// How long `ctl` waits for the daemon's answer: longer than what the daemon itself waits
/// for (a guest releasing its device, then a move: 120 s each).
const ANSWER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// Runs the command; API errors come back as [`ControlError::Api`].
pub fn run(args: CtlArgs) -> anyhow::Result<()> {
    let client = ControlClient::connect(&args.control.socket)
        .with_context(|| {
            format!(
                "is the daemon running? (`switchyard daemon`; --socket {})",
                args.control.socket.display()
            )
        })?
        .with_timeout(Some(ANSWER_TIMEOUT));
    let done = command(args, &client);
    if let Err(e) = &done
        && e.chain().any(|c| c.is::<StdoutClosed>())
    {
        return Ok(());
    }
    done.map_err(|e| {
        let timed_out = e.chain().any(|c| {
            c.downcast_ref::<std::io::Error>().is_some_and(|io| {
                matches!(
                    io.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                )
            })
        });
        if timed_out {
            e.context(format!(
                "the daemon did not answer within {} s",
                ANSWER_TIMEOUT.as_secs()
            ))
        } else {
            e
        }
    })
}

/// Standard output closed by its reader (`ctl boards | head -1`): the command stops there,
/// and that is not an error.
#[derive(Debug)]
struct StdoutClosed;

impl std::fmt::Display for StdoutClosed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Standard output is closed")
    }
}

impl std::error::Error for StdoutClosed {}

/// Writes to standard output and flushes (events are followed line by line); a closed
/// pipe is [`StdoutClosed`], not a panic as with `println!`.
fn out(args: std::fmt::Arguments<'_>) -> anyhow::Result<()> {
    let mut o = std::io::stdout().lock();
    match o.write_fmt(args).and_then(|()| o.flush()) {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => Err(StdoutClosed.into()),
        r => Ok(r?),
    }
}

/// `println!` through [`out`], returning its error from the enclosing function.
macro_rules! outln {
    ($($t:tt)*) => {
        out(format_args!("{}\n", format_args!($($t)*)))?
    };
}

fn command(args: CtlArgs, client: &ControlClient) -> anyhow::Result<()> {
    let json = args.json;
    let show = |v: &Value| -> anyhow::Result<()> {
        outln!("{}", serde_json::to_string_pretty(v)?);
        Ok(())
    };
    match args.command {
        CtlCommand::Boards => {
            let reply = client.get("/v1/boards")?;
            if json {
                return show(&reply.body);
            }
            let boards: Vec<BoardView> = reply.json()?;
            let mut rows = vec![row([
                "BOARD", "DEVICE", "MODEL", "STATE", "POOL", "MEMORY", "QUEUES", "IRQ", "ENDPOINT",
            ])];
            for b in &boards {
                for d in &b.devices {
                    // A passthrough device: its PCI address; memory and queues are the
                    // hardware's (0: none the pool accounts). Memory as the kind calls it
                    // (`64 MiB vram`, `1 MiB ram`). The interrupt mode where the kind has one.
                    let model = match &d.host {
                        Some(host) => format!("{} {host}", d.shape.model),
                        None => d.shape.model.clone(),
                    };
                    let (memory, queues) = (d.shape.memory(), d.shape.queues());
                    let memory = if memory == 0 {
                        "-".into()
                    } else {
                        format!("{} {}", ByteSize(memory), memory_name(&d.shape.model))
                    };
                    let queues = if queues == 0 {
                        "-".into()
                    } else {
                        queues.to_string()
                    };
                    let irq = d.shape.option_text("irq").unwrap_or_else(|| "-".into());
                    rows.push(vec![
                        b.id.clone(),
                        d.id.clone(),
                        model,
                        // A device on an available board is `leased` or `reserved` (for a
                        // move) when it is not free.
                        match (d.state, &d.endpoint, &d.reserved_for) {
                            (BoardState::Available, Some(_), _) => "leased".into(),
                            (BoardState::Available, None, Some(_)) => "reserved".into(),
                            (state, ..) => state.to_string(),
                        },
                        dash(b.pool.as_deref()),
                        memory,
                        queues,
                        irq,
                        match (&d.endpoint, &d.reserved_for) {
                            (Some(e), _) => e.clone(),
                            (None, Some(r)) => format!("(reserved: {r})"),
                            (None, None) => "-".into(),
                        },
                    ]);
                }
            }
            table(&rows)?;
        }
        CtlCommand::Pools => {
            let reply = client.get("/v1/pools")?;
            if json {
                return show(&reply.body);
            }
            let pools: Vec<PoolView> = reply.json()?;
            let mut rows = vec![row(["POOL", "BOARDS", "DEVICES", "FREE"])];
            for p in &pools {
                rows.push(vec![
                    p.name.clone(),
                    p.boards.join(","),
                    p.devices.to_string(),
                    p.free.to_string(),
                ]);
            }
            table(&rows)?;
        }
        CtlCommand::Endpoints => {
            let reply = client.get("/v1/endpoints")?;
            if json {
                return show(&reply.body);
            }
            let endpoints: Vec<EndpointStatus> = reply.json()?;
            let mut rows = vec![row([
                "ENDPOINT", "DEVICE", "BOARD", "WORKER", "PID", "RESTARTS", "SOCKET",
            ])];
            for e in &endpoints {
                rows.push(vec![
                    e.endpoint.id.clone(),
                    dash(e.endpoint.device.as_deref()),
                    dash(e.lease.as_ref().map(|l| l.board.as_str())),
                    match e.failover.as_ref().and_then(|f| f.pending.as_ref()) {
                        // Its board failed and it has not failed over yet.
                        Some(_) => format!("{} (degraded)", state_name(&e.worker.state)),
                        None => state_name(&e.worker.state),
                    },
                    dash(e.worker.pid.map(|p| p.to_string()).as_deref()),
                    e.worker.restarts.to_string(),
                    e.endpoint.socket.display().to_string(),
                ]);
            }
            table(&rows)?;
        }
        CtlCommand::Endpoint { id } => {
            let reply = client.get(&format!("/v1/endpoints/{}", segment(&id)?))?;
            if json {
                return show(&reply.body);
            }
            print_endpoint(&reply.json()?)?;
        }
        CtlCommand::Create {
            id,
            pool,
            endpoint_socket,
            incoming_spec: Some(file),
            ..
        } => {
            let text = std::fs::read_to_string(&file)
                .with_context(|| format!("cannot read {}", file.display()))?;
            let source: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", file.display()))?;
            let reply = client.post(
                "/v1/incoming",
                &serde_json::json!({
                    "id": id, "socket": endpoint_socket, "pool": pool, "source": source,
                }),
            )?;
            if json {
                return show(&reply.body);
            }
            print_endpoint(&reply.json()?)?;
        }
        CtlCommand::Create {
            id,
            endpoint_socket,
            incoming_for: Some(source),
            ..
        } => {
            let reply = client.post(
                &format!("/v1/endpoints/{}/incoming", segment(&source)?),
                &serde_json::json!({ "id": id, "socket": endpoint_socket }),
            )?;
            if json {
                return show(&reply.body);
            }
            print_endpoint(&reply.json()?)?;
        }
        CtlCommand::Create {
            id,
            pool,
            device,
            min_vram,
            min_queues,
            endpoint_socket,
            incoming_for: None,
            incoming_spec: None,
        } => {
            let spec = EndpointSpec {
                id,
                pool,
                device,
                min_vram,
                min_queues,
                socket: endpoint_socket,
            };
            let reply = client.post("/v1/endpoints", &spec)?;
            if json {
                return show(&reply.body);
            }
            print_endpoint(&reply.json()?)?;
        }
        CtlCommand::Delete { id } => {
            client.delete(&format!("/v1/endpoints/{}", segment(&id)?))?;
            if !json {
                outln!("endpoint {id} deleted");
            }
        }
        CtlCommand::Quarantine { ref board } | CtlCommand::Unquarantine { ref board } => {
            let verb = if matches!(args.command, CtlCommand::Quarantine { .. }) {
                "quarantine"
            } else {
                "unquarantine"
            };
            let reply = client.post(&format!("/v1/boards/{}/{verb}", segment(board)?), &())?;
            if json {
                return show(&reply.body);
            }
            let b: BoardView = reply.json()?;
            outln!("board {}: {}", b.id, b.state);
        }
        CtlCommand::Restart { ref id } | CtlCommand::Upgrade { ref id } => {
            let verb = if matches!(args.command, CtlCommand::Restart { .. }) {
                "restart"
            } else {
                "upgrade"
            };
            let reply = client.post(&format!("/v1/endpoints/{}/{verb}", segment(id)?), &())?;
            if json {
                return show(&reply.body);
            }
            let r: WorkerReplaced = reply.json()?;
            outln!(
                "endpoint {}: worker {} replaced by {} ({}), stall {}",
                r.endpoint,
                r.replaced_pid,
                dash(r.worker.pid.map(|p| p.to_string()).as_deref()),
                state_name(&r.worker.state),
                r.worker
                    .last_restart_ms
                    .map_or_else(|| "-".to_owned(), |ms| format!("{ms:.1} ms")),
            );
        }
        CtlCommand::Move { ref id, ref to } => {
            let body = serde_json::json!({ "to": to });
            let reply = client.post(&format!("/v1/endpoints/{}/move", segment(id)?), &body)?;
            if json {
                return show(&reply.body);
            }
            outln!("{}", move_line(&reply.json()?));
        }
        CtlCommand::Vmm {
            ref id,
            forget: true,
            ..
        } => {
            client.delete(&format!("/v1/endpoints/{}/vmm", segment(id)?))?;
            if !json {
                outln!("endpoint {id}: VMM forgotten");
            }
        }
        CtlCommand::Vmm {
            ref id,
            qmp: Some(ref qmp),
            device_id: Some(ref device_id),
            ref bus,
            ..
        } => {
            let qmp = std::path::absolute(qmp)
                .with_context(|| format!("the QMP path {}", qmp.display()))?;
            let body = serde_json::json!({ "qmp": qmp, "device_id": device_id, "bus": bus });
            let reply = client.put(&format!("/v1/endpoints/{}/vmm", segment(id)?), &body)?;
            if json {
                return show(&reply.body);
            }
            let bus = bus
                .as_ref()
                .map(|b| format!(", bus {b}"))
                .unwrap_or_default();
            outln!(
                "endpoint {id}: VMM registered (QMP {}, device {device_id}{bus})",
                qmp.display()
            );
        }
        CtlCommand::Vmm { .. } => {
            // clap requires both unless --forget.
            anyhow::bail!("ctl vmm needs --qmp and --device-id, or --forget");
        }
        CtlCommand::Detach { ref id } => {
            let reply = client.post(&format!("/v1/endpoints/{}/detach", segment(id)?), &())?;
            if json {
                return show(&reply.body);
            }
            outln!("endpoint {id}: detached (no device)");
        }
        CtlCommand::Attach {
            ref id,
            ref device,
            ref pool,
        } => {
            let body = serde_json::json!({ "device": device, "pool": pool });
            let reply = client.post(&format!("/v1/endpoints/{}/attach", segment(id)?), &body)?;
            if json {
                return show(&reply.body);
            }
            print_endpoint(&reply.json()?)?;
        }
        CtlCommand::Drain { ref board } => {
            let reply = client.post(&format!("/v1/boards/{}/drain", segment(board)?), &())?;
            if json {
                return show(&reply.body);
            }
            let r: DrainResult = reply.json()?;
            outln!(
                "board {}: quarantined; {} endpoint(s) moved, {} failed",
                r.board,
                r.moved.len(),
                r.failed.len()
            );
            for m in &r.moved {
                outln!("  {}", move_line(m));
            }
            for f in &r.failed {
                outln!(
                    "  endpoint {}: not moved to {}: {}",
                    f.plan.endpoint,
                    f.plan.to,
                    f.error
                );
            }
            if !r.failed.is_empty() {
                anyhow::bail!("the board still serves {} endpoint(s)", r.failed.len());
            }
        }
        CtlCommand::Fault {
            ref board,
            ref kind,
        } => {
            let body = FaultRequest { kind: kind.clone() };
            let reply = client.post(&format!("/v1/boards/{}/fault", segment(board)?), &body)?;
            if json {
                return show(&reply.body);
            }
            let r: FaultInjected = reply.json()?;
            outln!(
                "board {}: fault {} injected under endpoint(s) {}; follow the failover with `switchyard ctl events --follow`",
                r.board,
                r.kind,
                r.endpoints.join(", ")
            );
        }
        CtlCommand::Events { since, follow } => {
            let path = format!("/events?since={since}&follow={follow}");
            for line in client.stream(&path)? {
                let line = line?;
                if json {
                    outln!("{line}");
                } else {
                    let v: Value = serde_json::from_str(&line)
                        .map_err(ControlError::BadReplyBody)
                        .context("an event line is not JSON")?;
                    outln!("{}", event_line(&v));
                }
            }
        }
        CtlCommand::Metrics => out(format_args!("{}", client.get_text("/metrics")?))?,
    }
    Ok(())
}

fn move_line(m: &MoveResult) -> String {
    let detail = match &m.report {
        Some(r) => format!(
            "downtime {:.2} ms, {} pre-copy round(s), {} copied",
            r.downtime_us as f64 / 1e3,
            r.rounds,
            ByteSize(r.bytes)
        ),
        None => "completed by a replacement worker".to_owned(),
    };
    let detail = if m.guest_visible {
        format!(
            "guest-visible: unplugged for {:.1} ms; {detail}",
            m.downtime_ms.unwrap_or(0.0)
        )
    } else {
        detail
    };
    format!(
        "endpoint {}: moved from {} to {} ({detail})",
        m.plan.endpoint, m.plan.from, m.plan.to
    )
}

/// A path segment: ids are `[A-Za-z0-9_.-]`, anything else is refused here rather than
/// sent as a different path.
fn segment(id: &str) -> anyhow::Result<&str> {
    if id.is_empty()
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        || id == "."
        || id == ".."
    {
        anyhow::bail!("invalid id {id:?}: ids are characters of A-Z, a-z, 0-9, `_`, `.` and `-`");
    }
    Ok(id)
}

fn row<const N: usize>(cells: [&str; N]) -> Vec<String> {
    cells.iter().map(|c| (*c).to_owned()).collect()
}

fn dash(s: Option<&str>) -> String {
    s.unwrap_or("-").to_owned()
}

fn state_name<T: serde::Serialize>(state: &T) -> String {
    serde_json::to_value(state)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn table(rows: &[Vec<String>]) -> anyhow::Result<()> {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, |s| s.chars().count()))
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows {
        let mut line = String::new();
        for (c, cell) in r.iter().enumerate() {
            if c + 1 == r.len() {
                line.push_str(cell);
            } else {
                line.push_str(&format!("{cell:<w$}  ", w = widths[c]));
            }
        }
        outln!("{}", line.trim_end());
    }
    Ok(())
}

/// What kind `model` calls its device memory (`vram`, `ram`); `memory` for a kind this
/// build does not know (a newer daemon's).
fn memory_name(model: &str) -> &'static str {
    switchyard_kinds::get(model).map_or("memory", |k| k.memory_name())
}

/// A shape on one line: the model, then VRAM and queues, then the kind's other options,
/// e.g. `softgpu vram=64M queues=2 irq=msix spin=200 vram_mmap=true vram_reset=zero`.
fn shape_text(shape: &DeviceShape) -> String {
    let mut text = shape.model.clone();
    let first = ["vram", "queues"];
    let names = first
        .iter()
        .copied()
        .filter(|n| shape.options.contains_key(*n))
        .chain(
            shape
                .options
                .keys()
                .map(String::as_str)
                .filter(|n| !first.contains(n)),
        );
    for name in names {
        let value = match (name, shape.options.get(name).and_then(Value::as_u64)) {
            ("vram", Some(bytes)) => ByteSize(bytes).to_string(),
            _ => shape.option_text(name).unwrap_or_default(),
        };
        text.push_str(&format!(" {name}={value}"));
    }
    text
}

fn print_endpoint(e: &EndpointStatus) -> anyhow::Result<()> {
    let w = &e.worker;
    let lines = [
        ("endpoint", e.endpoint.id.clone()),
        ("socket", e.endpoint.socket.display().to_string()),
        ("owner", owner_text(e.endpoint.owner_uid)),
        ("pool", dash(e.endpoint.pool.as_deref())),
        ("device", dash(e.endpoint.device.as_deref())),
        ("board", dash(e.lease.as_ref().map(|l| l.board.as_str()))),
        (
            "shape",
            e.lease
                .as_ref()
                .map_or_else(|| "-".to_owned(), |l| shape_text(&l.shape)),
        ),
        ("worker", state_name(&w.state)),
        ("pid", dash(w.pid.map(|p| p.to_string()).as_deref())),
        ("restarts", w.restarts.to_string()),
        (
            "last restart",
            w.last_restart_ms
                .map_or_else(|| "-".to_owned(), |ms| format!("{ms:.1} ms")),
        ),
        ("held fds", w.held.to_string()),
    ];
    for (k, v) in lines {
        outln!("{:<14}{v}", format!("{k}:"));
    }
    if let Some(detail) = &w.detail {
        outln!("{:<14}{detail}", "detail:");
    }
    if let Some(source) = &e.incoming_for {
        outln!("{:<14}live migration of {source}", "incoming:");
    }
    if let Some(f) = &e.failover {
        if let Some(pending) = &f.pending {
            outln!("{:<14}degraded: its board failed; {pending}", "failover:");
        }
        if let Some(l) = &f.last {
            outln!(
                "{:<14}{} -> {} ({}, stall {:.1} ms)",
                "last failover:",
                l.from,
                l.to,
                l.mode,
                l.stall_ms
            );
        }
    }
    Ok(())
}

/// `uid N (NAME)`, the name from `/etc/passwd` when it has one.
fn owner_text(uid: u32) -> String {
    let name = std::fs::read_to_string("/etc/passwd")
        .ok()
        .and_then(|text| {
            text.lines().find_map(|line| {
                let mut f = line.split(':');
                let name = f.next()?;
                (f.nth(1)?.parse::<u32>().ok()? == uid).then(|| name.to_owned())
            })
        });
    match name {
        Some(name) => format!("uid {uid} ({name})"),
        None => format!("uid {uid}"),
    }
}

/// `SEQ  pool|worker  TYPE  key=value ...`.
fn event_line(v: &Value) -> String {
    let seq = v.get("seq").and_then(Value::as_u64);
    let kind = v.get("type").and_then(Value::as_str).unwrap_or("?");
    let (name, fields) = match kind {
        "pool" => {
            let k = v.pointer("/pool/kind");
            (k.and_then(|k| k.get("type")).and_then(Value::as_str), k)
        }
        "worker" => {
            let w = v.get("worker");
            (w.and_then(|w| w.get("event")).and_then(Value::as_str), w)
        }
        _ => (None, Some(v)),
    };
    let mut out = format!(
        "{:>12}  {kind:<6}  {:<18}",
        seq.map_or_else(|| "-".to_owned(), |s| s.to_string()),
        name.unwrap_or("")
    );
    if let Some(Value::Object(map)) = fields {
        for (k, val) in map {
            if k == "type" || k == "event" {
                continue;
            }
            let val = match val {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            out.push_str(&format!(" {k}={val}"));
        }
    }
    out.trim_end().to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_pool::Profile;

    #[test]
    fn a_shape_shows_vram_and_queues_first_then_the_kinds_options() {
        let Value::Object(options) = serde_json::json!({
            "irq": "msi", "queues": 2, "spin": 200, "vram": 64 << 20, "vram_mmap": false
        }) else {
            unreachable!("an object")
        };
        let shape = DeviceShape {
            model: "softgpu".into(),
            options,
            profile: Profile {
                memory: 64 << 20,
                queues: 2,
                partitionable: true,
                movable: true,
                ..Profile::default()
            },
        };
        assert_eq!(
            shape_text(&shape),
            "softgpu vram=64M queues=2 irq=msi spin=200 vram_mmap=false"
        );
    }

    #[test]
    fn min_memory_is_min_vram_by_another_name() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            ctl: CtlArgs,
        }
        for flag in ["--min-vram", "--min-memory"] {
            let cli = <Cli as clap::Parser>::try_parse_from([
                "ctl", "create", "vm1", "--pool", "p", flag, "1G",
            ])
            .expect(flag);
            let CtlCommand::Create { min_vram, .. } = cli.ctl.command else {
                panic!("{flag}: not a create");
            };
            assert_eq!(min_vram, Some(1 << 30), "{flag}");
        }
    }

    #[test]
    fn device_memory_is_named_as_its_kind_calls_it() {
        assert_eq!(memory_name("softgpu"), "vram");
        assert_eq!(memory_name("cuda"), "vram");
        assert_eq!(memory_name("scratchpad"), "ram");
        assert_eq!(memory_name("vfio"), "memory");
        assert_eq!(memory_name("a-newer-kind"), "memory");
    }
}
