//! `switchyard cluster`: the node's side of a Pacemaker + libvirt cluster.
//!
//! Every node runs its own daemon; a pool with the same name on several nodes is one
//! cluster pool. A VM's libvirt domain declares its GPUs in its `<metadata>`:
//!
//! ```xml
//! <metadata>
//!   <sy:gpus xmlns:sy="https://switchyard.dev/xmlns/libvirt/1" pool="gpu" count="2"/>
//! </metadata>
//! ```
//!
//! (any prefix; `count` 1 to 16), and its `<qemu:commandline>` plugs `vfio-user-pci` devices
//! on the sockets `<endpoint_dir>/libvirt.<DOMAIN>.<i>.sock`, i from 0.
//!
//! - `cluster hook DOMAIN OPERATION SUBOP EXTRA` is libvirt's qemu hook
//!   (`/etc/libvirt/hooks/qemu.d/switchyard`, the domain XML on standard input). At
//!   `prepare` it deletes the domain's stale endpoints and creates `libvirt.<DOMAIN>.<i>`
//!   from the pool, all or none (a failure fails the VM's start with the daemon's error); at
//!   `release` it deletes every `libvirt.<DOMAIN>.<digits>` endpoint there is, whatever the
//!   metadata says now (an unreachable daemon is a warning: the resource agent reconciles).
//!   At `migrate` (a live migration's destination, before its `prepare`) it makes them as
//!   incoming endpoints from the sources' descriptions in the metadata, all or none, and
//!   prints the XML with this node's socket paths if they differ (libvirt takes a `migrate`
//!   hook's standard output as the new XML); `prepare` then keeps them. Every other
//!   operation does nothing and prints nothing. It never calls libvirt (a hook that does
//!   deadlocks libvirtd).
//! - `cluster metadata DOMAIN` prints the domain's `<gpus>` element with a `<source
//!   index="I">` per device (the JSON description of `libvirt.<DOMAIN>.<I>` here, with its
//!   migration token) when what is published differs; the resource agent's monitor sets it
//!   on each running domain (`virsh metadata --set --live`), so the XML a migration sends
//!   carries what the destination needs.
//! - `cluster capacity` prints each pool's capacity for the cluster (see
//!   [`capacity::capacity`]: healthy devices less what endpoints outside the cluster take;
//!   Pacemaker subtracts its own VMs' GPUs), `--attributes` as the node utilization
//!   attributes `swy_<pool>_gpus` the resource agent publishes.
//! - `cluster release-stale --running DOMAIN...` deletes the endpoints of domains that are
//!   not running (the resource agent passes `virsh list --name`, at its start).
//!
//! The OCF resource agent `ocf:switchyard:pool` (`debian/ocf/pool`) runs the last three.

mod capacity;
mod meta;
mod migrate;
mod publish;

use std::io::{IsTerminal, Read};
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use switchyard_control::{ControlClient, ControlError};
use switchyard_daemon::app::api::EndpointStatus;
use switchyard_pool::{BoardView, EndpointSpec, PoolView};

#[derive(Debug, clap::Args)]
pub struct ClusterArgs {
    #[command(flatten)]
    control: crate::ctl::ControlSocket,

    #[command(subcommand)]
    command: ClusterCommand,
}

#[derive(Debug, clap::Subcommand)]
enum ClusterCommand {
    /// libvirt's qemu hook: a domain's endpoints at prepare and release.
    ///
    /// Installed as /etc/libvirt/hooks/qemu.d/switchyard; the domain XML on standard input.
    /// `prepare` creates the endpoints libvirt.DOMAIN.I (I from 0) that the domain's
    /// metadata asks for (`<gpus xmlns="https://switchyard.dev/xmlns/libvirt/1"
    /// pool="POOL" count="N"/>`, N from 1 to 16), all or none, after deleting any left from
    /// before; no such element: nothing; all of them there already as incoming endpoints
    /// (a migration's destination): they stay. `migrate` (on a live migration's
    /// destination, before `prepare`) makes them as incoming endpoints from the sources'
    /// descriptions in the metadata (`<source index="I">`, see `cluster metadata`), all or
    /// none, and prints the XML with this node's socket paths when they differ from the
    /// XML's (nothing otherwise). `release` deletes them (an unreachable daemon is a
    /// warning). Other operations do nothing. Nothing else is printed on standard output.
    Hook {
        /// The domain's name.
        domain: String,
        /// libvirt's operation (prepare, start, started, stopped, release, migrate, ...).
        operation: String,
        /// libvirt's sub-operation (begin, end, -).
        #[arg(allow_hyphen_values = true)]
        subop: String,
        /// libvirt's extra argument (-).
        #[arg(allow_hyphen_values = true)]
        extra: String,
    },
    /// Each pool's capacity for the cluster.
    ///
    /// Devices on healthy boards (available, not failed), less those leased by endpoints the
    /// cluster did not place (ids not starting with `libvirt.`) and those reserved for a
    /// move; never negative. Pacemaker subtracts its own VMs' GPUs.
    Capacity {
        /// `{"POOL": N, ...}` instead of lines `POOL N`.
        #[arg(long)]
        json: bool,
        /// Lines `swy_<pool>_gpus N`, the Pacemaker node utilization attributes.
        #[arg(long, conflicts_with = "json")]
        attributes: bool,
    },
    /// The domain's `<gpus>` metadata with this node's endpoints' descriptions, when it changed.
    ///
    /// Reads the domain's current element on standard input (what `virsh metadata DOMAIN
    /// --uri https://switchyard.dev/xmlns/libvirt/1` prints; empty when it has none) and
    /// prints the element to set (`virsh metadata DOMAIN --uri ... --key sy --set "$OUT"
    /// --live`): its pool and count, and per device I a `<source index="I">` holding the
    /// JSON description of endpoint libvirt.DOMAIN.I here, with its migration token; a live
    /// migration's destination makes its incoming endpoints from them. Prints nothing when
    /// the ids and tokens published are those of now, when the domain has no `<gpus>`, or
    /// when not all of its endpoints are here and serving (an incoming migration).
    Metadata {
        /// The domain's name.
        domain: String,
    },
    /// Delete the endpoints libvirt.DOMAIN.I of every domain not among the running ones.
    ///
    /// Prints `endpoint ID deleted` for each; one already gone is no error. Ids that start
    /// with `libvirt.` but are not `libvirt.DOMAIN.DIGITS` are left alone.
    ReleaseStale {
        /// A running domain (repeat; `virsh list --name`).
        #[arg(long, value_name = "DOMAIN")]
        running: Vec<String>,
    },
}

/// How long a request may wait for the daemon: creating an endpoint starts its worker.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the command.
pub fn run(args: ClusterArgs) -> anyhow::Result<()> {
    let socket = args.control.socket.as_path();
    match args.command {
        ClusterCommand::Hook {
            domain, operation, ..
        } => hook(socket, &domain, &operation),
        ClusterCommand::Metadata { domain } => {
            let current = read_stdin().with_context(|| format!("domain {domain}"))?;
            if let Some(element) = migrate::metadata(socket, &domain, &current)
                .with_context(|| format!("domain {domain}"))?
            {
                println!("{element}");
            }
            Ok(())
        }
        ClusterCommand::Capacity { json, attributes } => {
            let client = connect(socket)?;
            let pools: Vec<PoolView> = client.get("/v1/pools")?.json()?;
            let boards: Vec<BoardView> = client.get("/v1/boards")?.json()?;
            let names: Vec<String> = pools.into_iter().map(|p| p.name).collect();
            let cap = capacity::capacity(&names, &boards);
            if json {
                println!("{}", serde_json::to_string(&cap)?);
            } else if attributes {
                for (name, n) in capacity::attributes(&cap)? {
                    println!("{name} {n}");
                }
            } else {
                for (pool, n) in &cap {
                    println!("{pool} {n}");
                }
            }
            Ok(())
        }
        ClusterCommand::ReleaseStale { running } => {
            let client = connect(socket)?;
            let ids = endpoint_ids(&client)?;
            let stale = meta::stale(ids.iter().map(String::as_str), &running);
            let mut failed = 0;
            for id in stale {
                match delete(&client, id) {
                    Ok(true) => println!("endpoint {id} deleted"),
                    Ok(false) => {}
                    Err(e) => {
                        eprintln!("error: cannot delete endpoint {id}: {e}");
                        failed += 1;
                    }
                }
            }
            anyhow::ensure!(
                failed == 0,
                "{failed} stale endpoint(s) could not be deleted"
            );
            Ok(())
        }
    }
}

fn connect(socket: &Path) -> anyhow::Result<ControlClient> {
    Ok(ControlClient::connect(socket)
        .with_context(|| {
            format!(
                "the switchyard daemon is unreachable at {} (is it running?)",
                socket.display()
            )
        })?
        .with_timeout(Some(ANSWER_TIMEOUT)))
}

/// Whether the daemon could not be reached (as opposed to answering with an error).
fn unreachable(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        matches!(
            c.downcast_ref::<ControlError>(),
            Some(ControlError::Connect { .. } | ControlError::Io { .. })
        )
    })
}

/// Every endpoint's id.
fn endpoint_ids(client: &ControlClient) -> anyhow::Result<Vec<String>> {
    let endpoints: Vec<EndpointStatus> = client.get("/v1/endpoints")?.json()?;
    Ok(endpoints.into_iter().map(|e| e.endpoint.id).collect())
}

/// Deletes endpoint `id`: `Ok(false)` when it was already gone.
fn delete(client: &ControlClient, id: &str) -> Result<bool, ControlError> {
    // Ids come from the daemon's list or were checked (`meta::endpoint_ids`): valid path
    // segments.
    match client.delete(&format!("/v1/endpoints/{id}")) {
        Ok(_) => Ok(true),
        Err(ControlError::Api { status: 404, .. }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Deletes the endpoints `made` (all or none: one could not be made), warning about those
/// that cannot be.
fn undo(client: &ControlClient, domain: &str, made: &[String]) {
    for id in made {
        if let Err(e) = delete(client, id) {
            eprintln!("warning: domain {domain}: cannot delete endpoint {id}: {e}");
        }
    }
}

/// Standard input, unless it is a terminal (then nothing).
fn read_stdin() -> anyhow::Result<String> {
    let mut text = String::new();
    let stdin = std::io::stdin();
    if !stdin.is_terminal() {
        stdin
            .lock()
            .read_to_string(&mut text)
            .context("cannot read standard input")?;
    }
    Ok(text)
}

/// libvirt's hook for `domain`'s `operation`. Prints nothing on standard output, but at
/// `migrate` the domain XML with this node's socket paths, when they are not those of the
/// XML libvirt gave.
fn hook(socket: &Path, domain: &str, operation: &str) -> anyhow::Result<()> {
    match operation {
        "prepare" => {
            let xml = read_stdin().with_context(|| format!("domain {domain}: its XML"))?;
            prepare(socket, domain, &xml).with_context(|| format!("domain {domain}"))
        }
        "migrate" => {
            let xml = read_stdin().with_context(|| format!("domain {domain}: its XML"))?;
            if let Some(xml) = migrate::migrate(socket, domain, &xml)
                .with_context(|| format!("domain {domain}"))?
            {
                print!("{xml}");
            }
            Ok(())
        }
        "release" => match release(socket, domain) {
            Err(e) if unreachable(&e) => {
                eprintln!(
                    "warning: domain {domain}: {e:#}; its endpoints stay until the resource \
                     agent releases them"
                );
                Ok(())
            }
            r => r.with_context(|| format!("domain {domain}")),
        },
        _ => Ok(()),
    }
}

/// Creates the domain's endpoints, all or none, after deleting any left from before.
fn prepare(socket: &Path, domain: &str, xml: &str) -> anyhow::Result<()> {
    let Some(needs) = meta::gpu_needs(xml)? else {
        return Ok(());
    };
    let ids = meta::endpoint_ids(domain, needs.count)?;
    let client = connect(socket)?;
    let existing: Vec<EndpointStatus> = client.get("/v1/endpoints")?.json()?;
    let incoming = migrate::all_incoming(&existing, &ids);
    // A VM that is starting has no endpoints: these are stale (a release that never ran).
    // A VM migrating here has its incoming endpoints (the migrate hook made them): they
    // stay, the others go.
    let existing: Vec<&str> = existing.iter().map(|e| e.endpoint.id.as_str()).collect();
    for id in meta::endpoints_of(existing, domain) {
        if incoming && ids.iter().any(|i| i == id) {
            continue;
        }
        delete(&client, id).with_context(|| format!("cannot delete stale endpoint {id}"))?;
    }
    if incoming {
        return Ok(());
    }
    for (i, id) in ids.iter().enumerate() {
        let spec = EndpointSpec {
            id: id.clone(),
            pool: Some(needs.pool.clone()),
            ..EndpointSpec::default()
        };
        if let Err(e) = client.post("/v1/endpoints", &spec) {
            undo(&client, domain, &ids[..i]);
            return Err(anyhow::Error::new(e).context(format!(
                "cannot create endpoint {id} from pool {} ({} GPU(s) asked)",
                needs.pool, needs.count
            )));
        }
    }
    Ok(())
}

/// Deletes every endpoint of the domain, whatever its metadata says now.
fn release(socket: &Path, domain: &str) -> anyhow::Result<()> {
    let client = connect(socket)?;
    let ids = endpoint_ids(&client)?;
    let mut failed = Vec::new();
    for id in meta::endpoints_of(ids.iter().map(String::as_str), domain) {
        if let Err(e) = delete(&client, id) {
            failed.push(format!("{id}: {e}"));
        }
    }
    anyhow::ensure!(
        failed.is_empty(),
        "cannot delete endpoint(s) {}",
        failed.join("; ")
    );
    Ok(())
}
