//! `switchyard`: serve a device to a VMM over vfio-user.
//!
//! ```text
//! switchyard serve --socket PATH [--device KIND[,name=value...]] [--swap-every-ms N]
//! switchyard daemon [--config FILE] [--state-dir DIR] [--run-dir DIR] [--socket-group GROUP]
//! switchyard ctl [--socket PATH] [--json] COMMAND
//! switchyard cluster [--socket PATH] hook|capacity|release-stale ...
//! ```
//!
//! Logs go to stderr (`RUST_LOG` honoured, default `info`). SIGTERM / SIGINT / SIGHUP finish the
//! message in progress, remove the socket and exit 0. A runtime error exits 1. Bad arguments
//! print a one-line error and exit 2; no arguments at all print the usage and exit 2.

#![forbid(unsafe_code)]

mod cluster;
mod ctl;
mod generate;
mod inventory;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use signal_hook::consts::{SIGHUP, SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use switchyard_device::kind::{Build, KindConfig};
use switchyard_kinds::DeviceSpec;
use switchyard_server::{
    DeviceSlot, DeviceSocket, DirtyLog, MappedMigration, Server, ServerConfig, StopHandle,
};

/// Logging and exit codes, shown at the end of `--help` (and of `serve --help`).
const AFTER_HELP: &str = "\
Logging: logs go to stderr (stdout stays empty). RUST_LOG sets the filter, default `info`;
e.g. RUST_LOG=debug, or RUST_LOG=trace to see every region access.

Exit codes: 0 clean shutdown (SIGTERM, SIGINT or SIGHUP: the message in progress is answered
and the socket removed), 1 runtime error (e.g. the socket cannot be bound, the device cannot be
created), 2 bad arguments (a one-line error; no arguments at all print the usage).";

/// Switchyard: a vfio-user backend serving software and physical GPUs to VMs: one device on a
/// UNIX socket (`serve`), or a pool of them (`daemon`, `ctl`). Point QEMU at a socket with
/// `-device '{"driver":"vfio-user-pci","socket":{"type":"unix","path":"PATH"}}'` (guest RAM
/// must be a shared memory backend, e.g. `memory-backend-memfd,share=on`), or cloud-hypervisor
/// with `--user-device socket=PATH` and `--memory ...,shared=on`.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version, about, long_about, after_help = AFTER_HELP)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve one device on a socket in the foreground until SIGTERM/SIGINT/SIGHUP.
    ///
    /// The socket file appears only once the server accepts connections, so a VMM can be started as soon
    /// as the socket file exists. One client at a time: a second concurrent client is closed
    /// right away. When a client disconnects its DMA mappings and interrupt eventfds are
    /// dropped, the device keeps its state and the next client is served, with the device's
    /// config space as after a reset.
    #[command(after_help = AFTER_HELP)]
    Serve(ServeArgs),

    /// Run the pool daemon: boards, pools and endpoints (one supervised worker per endpoint),
    /// with its control API on a UNIX socket, until SIGTERM/SIGINT.
    ///
    /// Without --config the embedded default pool is used (two 64 MiB softgpu boards in pool
    /// `default`). At SIGTERM/SIGINT the API stops and the endpoints' workers are left
    /// running, so guests keep their devices; the next daemon adopts them. Under systemd
    /// (switchyard.service) the directories come from $RUNTIME_DIRECTORY, $STATE_DIRECTORY
    /// and $CONFIGURATION_DIRECTORY/pool.toml unless given here, and readiness is reported on
    /// $NOTIFY_SOCKET (Type=notify); such a variable that is set must name absolute
    /// directories. Exit codes: 0 after a signal, 1 runtime error (a damaged store
    /// included: see --reinit), 2 bad arguments, a bad configuration (the error names the
    /// key) or a directory variable that is not absolute.
    Daemon(DaemonArgs),

    /// Control a running pool daemon (a client of its API).
    ///
    /// Tables by default, --json for the API's JSON. An error from the daemon prints
    /// `error: MESSAGE` and exits 1; bad arguments exit 2.
    Ctl(ctl::CtlArgs),

    /// A Pacemaker + libvirt cluster node's side: libvirt's qemu hook (`hook`: endpoints
    /// for the GPUs a domain's metadata asks for), the node's capacity per pool
    /// (`capacity`, published by the resource agent ocf:switchyard:pool) and the release of
    /// endpoints of domains no longer running (`release-stale`).
    Cluster(cluster::ClusterArgs),

    /// What the host has for a device kind, as the kind lists it (`--kind KIND`; by default
    /// the PCI functions: ids, class, driver, IOMMU group, SR-IOV, NUMA node, reset methods),
    /// and the changes a pool makes to PCI functions: `create-vfs PF N` (SR-IOV VFs, left
    /// unbound) and `bind BDF` (to vfio-pci, for `serve --device vfio,host=BDF`); `gpus`
    /// (`--kind cuda`): the NVIDIA GPUs a `cuda` board can name.
    Inventory(inventory::InventoryArgs),

    /// Internal: the process that serves one endpoint of the pool daemon. Started by the
    /// daemon with its custody channel as standard input; not for direct use.
    #[command(hide = true)]
    Worker(WorkerArgs),

    /// Man pages and shell completions, from these definitions (for packaging).
    #[command(hide = true)]
    Generate(generate::GenerateArgs),
}

#[derive(Debug, clap::Args)]
struct WorkerArgs {
    /// Run without the jail (the daemon's --no-jail).
    #[arg(long)]
    no_jail: bool,
}

#[derive(Debug, clap::Args)]
struct DaemonArgs {
    /// The pool configuration (TOML); default: $CONFIGURATION_DIRECTORY/pool.toml if
    /// systemd set the variable and the file exists, else the embedded default pool.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Where the store (pool.redb) lives; default: $STATE_DIRECTORY if systemd set it, else
    /// `[daemon] state_dir` (default /var/lib/switchyard).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<PathBuf>,
    /// Where the sockets live: DIR/control.sock and DIR/endpoints/ID.sock; default:
    /// $RUNTIME_DIRECTORY if systemd set it, else `[daemon] control_socket` and
    /// `endpoint_dir` (default /run/switchyard).
    #[arg(long, value_name = "DIR")]
    run_dir: Option<PathBuf>,
    /// Let the members of GROUP use the control socket and the endpoint sockets (mode 0660,
    /// group GROUP) and pass through their directories (g+rx); a group that does not exist
    /// is an error. Default: the daemon's user only (0600).
    #[arg(long, value_name = "GROUP")]
    socket_group: Option<String>,
    /// Allow fault injection (`switchyard ctl fault BOARD KIND`), for tests and failover
    /// drills. Off by default: a fault makes the board's devices fail for real.
    #[arg(long)]
    faults: bool,
    /// Start with a new, empty pool when the store is damaged (empty, truncated, not a
    /// store): the damaged file is moved aside (pool.redb.damaged-TIME) and every lease it
    /// held is lost. Without it such a store is refused (exit 1) and left as it is.
    #[arg(long)]
    reinit: bool,
    /// Start the workers without their jail, for debugging: no seccomp filter, no Landlock,
    /// no no-new-privileges (said in the daemon's and each worker's log). By default every
    /// worker jails itself once its device is built (docs/security.md).
    #[arg(long)]
    no_jail: bool,
}

#[derive(Debug, clap::Args)]
struct ServeArgs {
    /// Path of the vfio-user socket to create (a stale socket file is replaced).
    #[arg(long, value_name = "PATH")]
    socket: PathBuf,

    /// Device to serve: `KIND[,name=value...]` (`--help` lists the kinds and their options).
    #[arg(
        long,
        value_name = "SPEC",
        default_value = "softgpu",
        value_parser = parse_device,
        long_help = device_help()
    )]
    device: DeviceSpec,

    /// Permissions of the socket file, in octal.
    #[arg(long, value_name = "MODE", default_value = "600", value_parser = parse_mode)]
    socket_mode: u32,

    /// Adaptive polling: spin on the socket for up to this many microseconds before blocking,
    /// trading CPU for lower round-trip latency. 0 disables it.
    #[arg(long, value_name = "MICROSECONDS", default_value_t = 0)]
    poll_spin_us: u64,

    /// Soak test of transparent swaps: every MILLISECONDS, replace the device with a fresh
    /// instance of itself carrying its state (the same swap a pool daemon does for
    /// maintenance or failover), while the client keeps running. 0 (the default) disables it.
    #[arg(long, value_name = "MILLISECONDS", default_value_t = 0)]
    swap_every_ms: u64,

    /// Memory the DMA dirty logs may take in all (2 bits per 4 KiB page of logged guest
    /// memory; the default 256M logs 4 TiB). Beyond it DMA_LOGGING_START, or a DMA_MAP during
    /// logging, is refused with ENOMEM. SIZE takes a K/M/G/T suffix (binary).
    #[arg(long, value_name = "SIZE", default_value = "256M", value_parser = switchyard_device::parse_size)]
    dirty_log_budget: u64,

    /// DMA dirty logging (what a VMM's live migration learns the device's writes to guest
    /// memory from): `on`; `off`, not offered (a VMM must refuse to migrate or resend all
    /// of guest memory); `blind`, fault injection for tests: offered, but every report says
    /// nothing is dirty, so a migration loses what the device wrote after the VMM copied it.
    #[arg(long, value_name = "MODE", default_value = "on", value_parser = parse_dirty_log)]
    dirty_log: DirtyLog,

    /// Whether a VMM may migrate the device's mapped memory itself, as its own RAM (the
    /// patched QEMU asks; then the device's stream carries only what the device wrote
    /// there): `on`; `off`, refused (the device's stream carries all of it); `assume`, fault
    /// injection for tests: the device acts as if the VMM did, even when it does not, so a
    /// migration loses what the guest wrote through its mapping.
    #[arg(long, value_name = "MODE", default_value = "on", value_parser = parse_mapped_migration)]
    mapped_migration: MappedMigration,

    /// End an open migration stream (PRE_COPY, STOP_COPY, RESUMING) that had no migration
    /// activity (data read or written, a state requested) for this long: the migration is
    /// abandoned and the device runs, as when the VMM goes away. Seconds, or with an s, m, h
    /// or d suffix; 0 never ends one.
    #[arg(long, value_name = "DURATION", default_value = "60s", value_parser = parse_idle_timeout)]
    migration_idle_timeout: Duration,
    /// Serve without the jail, for debugging: no seccomp filter, no Landlock, no
    /// no-new-privileges (said in the log). By default the server jails itself once its
    /// device is built, as a pool's workers do (docs/security.md).
    #[arg(long)]
    no_jail: bool,
}

fn parse_idle_timeout(s: &str) -> Result<Duration, String> {
    switchyard_pool::Age::parse(s)
        .map(|age| Duration::from_secs(age.0))
        .ok_or_else(|| format!("`{s}`: want seconds, or a number with an s, m, h or d suffix"))
}

fn parse_mapped_migration(s: &str) -> Result<MappedMigration, String> {
    match s {
        "on" => Ok(MappedMigration::On),
        "off" => Ok(MappedMigration::Off),
        "assume" => Ok(MappedMigration::Assume),
        _ => Err(format!("`{s}`: want on, off or assume")),
    }
}

fn parse_dirty_log(s: &str) -> Result<DirtyLog, String> {
    match s {
        "on" => Ok(DirtyLog::On),
        "off" => Ok(DirtyLog::Off),
        "blind" => Ok(DirtyLog::Blind),
        _ => Err(format!("`{s}`: want on, off or blind")),
    }
}

fn parse_device(s: &str) -> Result<DeviceSpec, String> {
    DeviceSpec::parse(s).map_err(|e| e.to_string())
}

/// `--device`'s long help: the first paragraph of its doc comment, then every kind of the
/// registry with the text it owns (summary, options, notes).
fn device_help() -> String {
    format!(
        "Device to serve: `KIND[,name=value...]`, a kind and its options.\n\n{}",
        switchyard_kinds::help().trim_end()
    )
}

fn parse_mode(s: &str) -> Result<u32, String> {
    let mode = u32::from_str_radix(s.trim_start_matches("0o"), 8)
        .map_err(|_| format!("`{s}` is not an octal file mode"))?;
    if mode > 0o777 {
        return Err(format!("`{s}` is not a file mode (0..=777)"));
    }
    Ok(mode)
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand {
                // No subcommand (e.g. no arguments at all): the usage, to stderr.
                eprint!("{}", e.render());
                return ExitCode::from(2);
            }
            // One line: the error itself, without clap's usage block.
            let text = e.to_string();
            let line: Vec<&str> = text
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| {
                    !l.is_empty()
                        && !l.starts_with("tip:")
                        && !l.starts_with("For more information")
                })
                .collect();
            eprintln!("{} (see `switchyard --help`)", line.join(" "));
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Worker(args) => worker(&args),
        Command::Daemon(args) => return daemon(args),
        Command::Ctl(args) => ctl::run(args),
        Command::Cluster(args) => cluster::run(args),
        Command::Inventory(args) => inventory::run(args),
        Command::Generate(args) => generate::run(args, Cli::command()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Raises the soft RLIMIT_NOFILE to the hard limit: a client's DMA windows and eventfds are
/// all file descriptors, and the default soft limit (often 1024) is easily reached.
fn raise_nofile_limit() {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let show = |v: Option<u64>| v.map_or_else(|| "unlimited".to_owned(), |v| v.to_string());
    let old = getrlimit(Resource::Nofile);
    if old.current == old.maximum {
        tracing::debug!(nofile = %show(old.current), "RLIMIT_NOFILE already at the hard limit");
        return;
    }
    let raised = Rlimit {
        current: old.maximum,
        maximum: old.maximum,
    };
    match setrlimit(Resource::Nofile, raised) {
        Ok(()) => tracing::debug!(
            from = %show(old.current),
            nofile = %show(old.maximum),
            "raised RLIMIT_NOFILE to the hard limit"
        ),
        Err(e) => tracing::warn!(
            error = %e,
            nofile = %show(old.current),
            "cannot raise RLIMIT_NOFILE"
        ),
    }
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    raise_nofile_limit();
    let mut config = ServerConfig::new(&args.socket);
    config.socket_mode = args.socket_mode;
    config.poll_spin = Duration::from_micros(args.poll_spin_us);
    config.dirty_log_budget = args.dirty_log_budget;
    config.dirty_log = args.dirty_log;
    config.mapped_migration = args.mapped_migration;
    config.migration_idle_timeout = Some(args.migration_idle_timeout).filter(|d| !d.is_zero());
    let spec = args.device;
    let device = spec.configure()?;
    let span = tracing::info_span!("device", model = %spec.kind, socket = %args.socket.display());
    let _g = span.enter();
    tracing::info!(device = %spec, "starting the device");
    let cannot = || format!("cannot serve on {}", args.socket.display());
    // Bound first, then jailed (Landlock, before any thread: it restricts only the threads
    // started after it), then the device built; the seccomp filter comes once every thread
    // and socket is there.
    let socket = DeviceSocket::bind(&args.socket, args.socket_mode).with_context(cannot)?;
    let socket_dir = match args.socket.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_owned(),
        _ => PathBuf::from("."),
    };
    let places = switchyard_daemon::jail::Places {
        socket_dirs: Vec::new(),
        // The socket is removed at exit.
        remove_dirs: vec![socket_dir],
    };
    let jail = switchyard_daemon::jail::begin(!args.no_jail, &spec.kind, &places)
        .context("cannot jail the server (--no-jail serves without)")?;
    let server = Server::with_device(config, socket, |ctx| device.config.build(Build::new(ctx)));
    let mut server = server.with_context(cannot)?;
    let stop = server.stop_handle();
    let mut signals =
        Signals::new([SIGTERM, SIGINT, SIGHUP]).context("cannot install signal handlers")?;
    let handle = signals.handle();
    let watcher = std::thread::Builder::new()
        .name("sy-signals".into())
        .spawn(move || {
            if let Some(sig) = signals.forever().next() {
                tracing::info!(signal = sig, "shutting down");
                stop.stop();
            }
        })
        .context("cannot start the signal thread")?;
    let swapper = (args.swap_every_ms > 0)
        .then(|| {
            let every = Duration::from_millis(args.swap_every_ms);
            let (slot, stop) = (server.device_slot(), server.stop_handle());
            let span = span.clone();
            // Each successor is made a device of this spec, as the device was built (a `cuda`
            // device's successor is attached to its GPU).
            let kind = device.config;
            std::thread::Builder::new()
                .name("sy-swapper".into())
                .spawn(move || {
                    let _g = span.enter();
                    swap_loop(&slot, &stop, every, kind.as_ref());
                })
                .context("cannot start the swap thread")
        })
        .transpose()?;
    switchyard_daemon::jail::complete(jail)
        .context("cannot jail the server (--no-jail serves without)")?;
    let result = server.run().context("server failed");
    handle.close();
    let _ = watcher.join();
    if let Some(t) = swapper {
        let _ = t.join();
    }
    drop(server);
    result
}

/// `switchyard daemon`: exits 2 for a bad configuration or environment (a systemd
/// directory variable that is not absolute), 1 for other errors.
fn daemon(args: DaemonArgs) -> ExitCode {
    raise_nofile_limit();
    let options = switchyard_daemon::app::DaemonOptions {
        config: args.config,
        state_dir: args.state_dir,
        run_dir: args.run_dir,
        socket_group: args.socket_group,
        faults: args.faults,
        reinit: args.reinit,
        no_jail: args.no_jail,
    }
    .with_systemd_dirs(|name| std::env::var_os(name));
    match options.and_then(|options| switchyard_daemon::app::run(&options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = e.exit_code();
            eprintln!("error: {:#}", anyhow::Error::new(e));
            ExitCode::from(code)
        }
    }
}

/// `switchyard worker`: serves one pool endpoint; the custody channel is standard input.
fn worker(args: &WorkerArgs) -> anyhow::Result<()> {
    use std::os::fd::AsFd;
    raise_nofile_limit();
    if let Some(plan) = std::env::var_os(switchyard_daemon::reexec::REEXEC_FD_ENV) {
        // An earlier image of this worker re-executed it in place.
        let plan = plan.to_string_lossy().into_owned();
        return switchyard_daemon::worker::run_reexeced(&plan, ServerConfig::new, !args.no_jail)
            .context("re-executed worker failed");
    }
    let channel = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .context("no custody channel on standard input")?;
    switchyard_daemon::worker::run(channel, ServerConfig::new, !args.no_jail)
        .context("worker failed")
}

/// How often `--swap-every-ms` logs a summary at INFO (each swap is logged at DEBUG).
const SWAP_SUMMARY_EVERY: Duration = Duration::from_secs(10);

/// Swap counters for one summary period (or the whole run).
#[derive(Debug, Default, Clone, Copy)]
struct SwapStats {
    swaps: u64,
    refused: u64,
    max_held: Duration,
}

impl SwapStats {
    fn add(&mut self, other: &SwapStats) {
        self.swaps += other.swaps;
        self.refused += other.refused;
        self.max_held = self.max_held.max(other.max_held);
    }
}

/// `--swap-every-ms`: swaps the device for its successor until the server stops, the way a pool
/// daemon does, through the device's swap capability (parked successor built and old device
/// parked outside the slot; inside, the checks, then the hand-over), each successor made a
/// device of the served spec first (`kind`'s `adopt_successor`: a `cuda` device's runs on its
/// GPU). Logs a summary every [`SWAP_SUMMARY_EVERY`] and when it ends.
fn swap_loop(slot: &DeviceSlot, stop: &StopHandle, every: Duration, kind: &dyn KindConfig) {
    let mut total = SwapStats::default();
    let mut period = SwapStats::default();
    let mut period_start = Instant::now();
    while !stop.is_stopping() {
        std::thread::sleep(every);
        if stop.is_stopping() {
            break;
        }
        if period_start.elapsed() >= SWAP_SUMMARY_EVERY {
            tracing::info!(
                swaps = period.swaps,
                refused = period.refused,
                max_held_us = period.max_held.as_micros() as u64,
                secs = period_start.elapsed().as_secs(),
                "swap soak"
            );
            total.add(&period);
            period = SwapStats::default();
            period_start = Instant::now();
        }
        let plan = match slot.prepare_swap() {
            Ok(plan) => plan,
            Err(e) => {
                tracing::warn!(error = %e, "the device cannot be swapped; swap soak ends");
                break;
            }
        };
        let mut next = match (plan.successor)(slot.context().clone()) {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, "cannot build a successor; no swap");
                continue;
            }
        };
        if let Err(e) = kind.adopt_successor(next.as_mut()) {
            tracing::warn!(error = %e, "the successor cannot be made a device of the spec; no swap");
            continue;
        }
        // Released when this iteration ends: a refused swap lets the old engines run again
        // unless something else (a migration STOP) holds them.
        let _parked = plan.quiesce.park();
        match slot.swap(next) {
            Ok(report) => {
                period.swaps += 1;
                period.max_held = period.max_held.max(report.held);
                drop(report.old);
            }
            Err(e) => {
                period.refused += 1;
                tracing::debug!(error = %e, "swap soak: swap refused");
            }
        }
    }
    total.add(&period);
    tracing::info!(
        swaps = total.swaps,
        refused = total.refused,
        max_held_us = total.max_held.as_micros() as u64,
        "swap soak finished"
    );
}
