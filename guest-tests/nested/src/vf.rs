//! `vf-probe`: an SR-IOV VF created and bound by `switchyard inventory`, served by switchyard
//! and checked from the client side ([`probe`]).

use std::path::Path;

use anyhow::{Context, Result, bail};
use serde_json::{Value, json};

use crate::procs::Server;
use crate::{SWITCHYARD, probe};

/// `switchyard inventory ARGS... --json`, parsed.
fn inventory(args: &[&str]) -> Result<Value> {
    let out = std::process::Command::new(SWITCHYARD)
        .arg("inventory")
        .args(args)
        .arg("--json")
        .output()
        .context("run switchyard inventory")?;
    if !out.status.success() {
        bail!(
            "switchyard inventory {args:?}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout).context("inventory JSON")
}

/// SR-IOV: the inventory finds the igb PF L0 gave L1, creates two VFs and binds one to vfio-pci;
/// switchyard serves that VF and a client (our library, standing in for the VMM) checks what a
/// VMM would see: identity, config space, BAR sizing, regions, MSI-X.
pub fn vf_probe(dir: &Path) -> Result<Value> {
    let before = inventory(&[])?;
    let pf = before["devices"]
        .as_array()
        .and_then(|d| {
            d.iter()
                .find(|d| d["sriov_totalvfs"].as_u64().is_some_and(|n| n > 0))
        })
        .context("no SR-IOV physical function in L1 (L0 must add an igb on a root port)")?
        .clone();
    let pf_bdf = pf["bdf"].as_str().context("PF address")?.to_owned();
    let created = inventory(&["create-vfs", &pf_bdf, "2"])?;
    let vfs: Vec<String> = created["vfs"]
        .as_array()
        .context("created VFs")?
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    let vf = vfs.first().context("no VF created")?.clone();
    let bound = inventory(&["bind", &vf])?;
    let server = Server::start(Path::new(SWITCHYARD), dir, "vf", &format!("vfio,host={vf}"))?;
    let seen = probe::probe(&server.socket)?;
    let after = inventory(&[])?;
    let vf_entry = after["devices"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["bdf"] == vf.as_str()))
        .cloned()
        .unwrap_or(Value::Null);
    let ok = seen["vendor"] == vf_entry["vendor"]
        && seen["device"] == vf_entry["device"]
        && seen["msix_routed"].as_u64().is_some_and(|n| n > 0)
        && vf_entry["driver"] == "vfio-pci";
    Ok(json!({
        "ok": ok, "pf": pf, "vfs": vfs, "vf": vf_entry, "bind": bound, "client_view": seen,
    }))
}
