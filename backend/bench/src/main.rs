//! `switchyard-bench`: latency and throughput of the Switchyard data path against floors
//! measured in the same run, and against the `vfio_user` crate's server (the peer).
//!
//! Every server runs in this process on its own thread, behind a real UNIX socket in a
//! temporary directory, and is driven by our `switchyard-client` — the same code the
//! `switchyard serve` binary runs (`Server::run`) — except in the restart case, which runs a
//! pool supervisor whose workers are `switchyard worker` processes of the release binary
//! (`--switchyard-bin`), and the failover and api cases, which run its `switchyard daemon`.
//! See docs/performance.md for what each row measures and what limits it. Timings are
//! reported, never asserted: the exit status only reflects whether every case could run.

#![forbid(unsafe_code)]

mod api;
mod cases;
mod copy;
mod create_load;
mod cuda;
mod custody;
mod decompose;
mod dirty_report;
mod doorbell;
mod downtime;
mod failover;
mod floors;
mod gpu;
mod interrupt;
mod jail;
mod journal;
mod migration;
mod moves;
mod pin;
mod posted;
mod profile;
mod report;
mod restart;
mod round_trip;
mod servers;
mod size_sweep;
mod stats;
mod svg;
mod swap;
mod write_multi;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

use crate::report::{Machine, Results};

#[derive(Debug, Parser)]
#[command(
    name = "switchyard-bench",
    about = "Switchyard benchmarks against floors and peers"
)]
struct Cli {
    /// Short mode for CI: small sample counts, every case still exercised.
    #[arg(long)]
    quick: bool,
    /// Write the results as JSON.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Write the plot (SVG).
    #[arg(long, value_name = "PATH")]
    svg: Option<PathBuf>,
    /// Write the table as Markdown.
    #[arg(long, value_name = "PATH")]
    markdown: Option<PathBuf>,
    /// Adaptive-polling budget of the "spin" variants, in µs (`--poll-spin-us`).
    #[arg(long, default_value_t = 50)]
    spin_us: u64,
    /// Run only these groups (comma-separated): round-trip, decompose, size-sweep, posted,
    /// write-multi, copy, interrupt, doorbell, dirty-report, swap, migration, journal, custody,
    /// restart, failover, move, api, jail, create-load; and cuda (a real GPU: only when named here).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// The `switchyard` binary whose `switchyard worker` processes the restart case kills, and
    /// whose `switchyard daemon` the failover and api cases run (default: the `switchyard`
    /// next to this binary, i.e. target/release/switchyard, which scripts/bench.sh builds).
    #[arg(long, value_name = "PATH")]
    switchyard_bin: Option<PathBuf>,
    /// Diagnosis only: pin the client (main) thread to this CPU (device threads inherit it).
    #[arg(long, value_name = "CPU")]
    pin_client: Option<usize>,
    /// Diagnosis only: pin every server, peer and floor thread to this CPU.
    #[arg(long, value_name = "CPU")]
    pin_helpers: Option<usize>,
    #[command(subcommand)]
    command: Option<Cmd>,
}

#[derive(Debug, Subcommand)]
enum Cmd {
    /// A plain round-trip loop for profilers (callgrind, strace).
    Profile {
        /// The server.
        #[arg(long, value_enum, default_value = "regfile")]
        target: profile::Target,
        /// The access.
        #[arg(long, value_enum, default_value = "read")]
        access: profile::Access,
        /// Round trips.
        #[arg(long, default_value_t = 10_000)]
        iters: u64,
        /// Adaptive-polling budget, µs.
        #[arg(long, default_value_t = 0)]
        spin_us: u64,
    },
    /// Renders the plot (and optionally the Markdown table) from a results JSON file.
    Plot {
        /// Results written by `--json`.
        #[arg(long)]
        json: PathBuf,
        /// SVG output.
        #[arg(long)]
        svg: PathBuf,
        /// Markdown table output.
        #[arg(long)]
        markdown: Option<PathBuf>,
    },
}

type Case = fn(&std::path::Path, &cases::Settings, &mut Vec<report::Row>) -> Result<()>;

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Cmd::Profile {
            target,
            access,
            iters,
            spin_us,
        }) => return profile::run(target, access, iters, Duration::from_micros(spin_us)),
        Some(Cmd::Plot {
            ref json,
            ref svg,
            ref markdown,
        }) => {
            let text = std::fs::read_to_string(json)
                .with_context(|| format!("read {}", json.display()))?;
            let results: Results = serde_json::from_str(&text).context("parse results")?;
            write_outputs(&results, None, Some(svg), markdown.as_ref())?;
            return Ok(());
        }
        None => {}
    }

    // Before pinning: the CPU count is the machine's, not the pinned thread's affinity mask.
    let machine = Machine::probe();
    pin::setup(cli.pin_client, cli.pin_helpers)?;
    let pinning = pin::describe(cli.pin_client, cli.pin_helpers);
    let switchyard_bin = match cli.switchyard_bin {
        Some(p) => p,
        None => std::env::current_exe()
            .context("locate switchyard-bench")?
            .with_file_name("switchyard"),
    };
    let settings = cases::Settings {
        quick: cli.quick,
        spin: Duration::from_micros(cli.spin_us),
        switchyard_bin,
    };
    let mode = if cli.quick { "quick" } else { "full" };
    eprintln!(
        "switchyard-bench ({mode}): {} ({} CPUs), kernel {}, load {}, pinning: {pinning}",
        machine.cpu, machine.cpus, machine.kernel, machine.loadavg_start
    );
    let dir = tempfile::tempdir().context("tempdir")?;
    let all: [(&str, Case); 20] = [
        ("round-trip", round_trip::round_trip),
        ("decompose", decompose::decompose),
        ("size-sweep", size_sweep::size_sweep),
        ("posted", posted::posted),
        ("write-multi", write_multi::write_multi),
        ("copy", copy::copy),
        ("interrupt", interrupt::interrupt),
        ("doorbell", doorbell::doorbell),
        ("dirty-report", dirty_report::dirty_report),
        ("swap", swap::swap),
        ("migration", migration::migration),
        ("journal", journal::journal),
        ("custody", custody::custody),
        ("restart", restart::restart),
        ("failover", failover::failover),
        ("move", moves::moves),
        ("api", api::api),
        ("jail", jail::jail),
        ("create-load", create_load::create_load),
        ("cuda", cuda::cuda),
    ];
    // Cases that need hardware CI does not have run only when named.
    let explicit = ["cuda"];
    if let Some(bad) = cli.only.iter().find(|o| !all.iter().any(|(n, _)| n == o)) {
        let names: Vec<&str> = all.iter().map(|(n, _)| *n).collect();
        anyhow::bail!(
            "--only: unknown case `{bad}`; the cases are {}",
            names.join(", ")
        );
    }
    let start = Instant::now();
    let mut rows = Vec::new();
    for (name, case) in all {
        if !cli.only.is_empty() && !cli.only.iter().any(|o| o == name) {
            continue;
        }
        if cli.only.is_empty() && explicit.contains(&name) {
            continue;
        }
        let t = Instant::now();
        eprint!("  {name} ... ");
        case(dir.path(), &settings, &mut rows).with_context(|| format!("case {name}"))?;
        eprintln!("{:.1} s", t.elapsed().as_secs_f64());
    }
    let results = Results {
        mode: mode.into(),
        spin_us: cli.spin_us,
        pinning,
        machine,
        loadavg_end: std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .trim()
            .to_owned(),
        seconds: start.elapsed().as_secs_f64(),
        rows,
    };
    println!("{}", report::text_table(&results.rows));
    println!(
        "ratio = ours/floor at p50 (latency: lower is better; GB/s and Mw/s: higher is better); \
         peer ratio = ours/peer. Targets are reported, never enforced."
    );
    write_outputs(
        &results,
        cli.json.as_ref(),
        cli.svg.as_ref(),
        cli.markdown.as_ref(),
    )
}

fn write_outputs(
    results: &Results,
    json: Option<&PathBuf>,
    svg: Option<&PathBuf>,
    markdown: Option<&PathBuf>,
) -> Result<()> {
    let create_parent = |p: &PathBuf| -> Result<()> {
        if let Some(d) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).with_context(|| format!("create {}", d.display()))?;
        }
        Ok(())
    };
    if let Some(p) = json {
        create_parent(p)?;
        std::fs::write(p, serde_json::to_string_pretty(results)? + "\n")
            .with_context(|| format!("write {}", p.display()))?;
    }
    if let Some(p) = svg {
        create_parent(p)?;
        std::fs::write(p, svg::render(results)?)
            .with_context(|| format!("write {}", p.display()))?;
    }
    if let Some(p) = markdown {
        create_parent(p)?;
        std::fs::write(p, report::markdown_table(&results.rows))
            .with_context(|| format!("write {}", p.display()))?;
    }
    Ok(())
}
