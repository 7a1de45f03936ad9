//! `switchyard inventory`: what the host has for a device kind, as the kind lists it
//! ([`DeviceKind::host_inventory`](switchyard_device::kind::DeviceKind::host_inventory):
//! `--kind vfio`, the default, the PCI functions; `--kind cuda`, the GPUs), and the two changes
//! it makes to PCI functions: create SR-IOV VFs, bind a function to vfio-pci.

use std::path::PathBuf;

use anyhow::{Result, bail};
use clap::Subcommand;
use serde_json::json;
use switchyard_device::kind::{Host, HostInventory};
use switchyard_vfio::sysfs;

#[derive(Debug, clap::Args)]
pub struct InventoryArgs {
    /// JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// The sysfs root (tests use a fake tree).
    #[arg(long, global = true, default_value = "/sys", value_name = "DIR")]
    sysfs: PathBuf,
    /// The device kind whose view of the host to list (without a command): `vfio`, the PCI
    /// functions; `cuda`, the GPUs.
    #[arg(long, default_value = "vfio", value_name = "KIND")]
    kind: String,
    #[command(subcommand)]
    action: Option<Action>,
}

#[derive(Debug, Subcommand)]
enum Action {
    /// Create N SR-IOV VFs on physical function PF, left unbound (no host driver grabs them).
    CreateVfs {
        /// The physical function, `DDDD:BB:DD.F`.
        pf: String,
        /// How many VFs (at most the PF's `sriov_totalvfs`).
        n: u32,
    },
    /// Bind a function to vfio-pci (unbinding its driver first), so a server can open it.
    Bind {
        /// The function, `DDDD:BB:DD.F`.
        bdf: String,
    },
    /// The NVIDIA GPUs a `cuda` board can name (`gpu = "GPU-…"`): `--kind cuda`, kept by
    /// this name. NVML when it is installed (UUID, name, memory, PCI address, health), else
    /// the CUDA driver. Exits 1 when neither can list them, saying why.
    Gpus,
}

/// What kind `name` lists of the host.
fn kind_inventory(name: &str, host: &Host) -> Result<HostInventory> {
    let kind = switchyard_kinds::get(name).ok_or_else(|| {
        anyhow::anyhow!(
            "Unknown device kind `{name}`; the kinds are {}",
            switchyard_kinds::names()
        )
    })?;
    match kind.host_inventory(host) {
        Some(inventory) => inventory.map_err(anyhow::Error::msg),
        None => bail!("The {name} kind needs nothing of the host: it has no inventory"),
    }
}

/// An inventory as a table: columns as wide as their widest cell, the last unpadded.
fn print_table(inv: &HostInventory) {
    let mut widths: Vec<usize> = inv.columns.iter().map(|c| c.chars().count()).collect();
    for row in &inv.rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut line = String::new();
        for (c, cell) in cells.enumerate() {
            line.push_str(&format!(
                "{cell:<w$}  ",
                w = widths.get(c).copied().unwrap_or(0)
            ));
        }
        println!("{}", line.trim_end());
    };
    line(&mut inv.columns.iter().copied());
    for row in &inv.rows {
        line(&mut row.iter().map(String::as_str));
    }
    if let Some(footer) = &inv.footer {
        println!("{footer}");
    }
}

pub fn run(args: InventoryArgs) -> Result<()> {
    let root = &args.sysfs;
    let out = match args.action {
        None | Some(Action::Gpus) => {
            let kind = match args.action {
                Some(Action::Gpus) => "cuda",
                _ => &args.kind,
            };
            let inv = kind_inventory(
                kind,
                &Host {
                    sysfs: root.clone(),
                },
            )?;
            if !args.json {
                print_table(&inv);
                return Ok(());
            }
            inv.json
        }
        Some(Action::CreateVfs { pf, n }) => {
            let pf = sysfs::normalize_bdf(&pf)?;
            let vfs = sysfs::create_vfs(root, &pf, n)?;
            if vfs.len() != n as usize {
                bail!("{pf}: asked for {n} VFs, the kernel shows {}", vfs.len());
            }
            if !args.json {
                println!("{pf}: {n} VFs: {}", vfs.join(" "));
                return Ok(());
            }
            json!({ "pf": pf, "vfs": vfs })
        }
        Some(Action::Bind { bdf }) => {
            let bdf = sysfs::normalize_bdf(&bdf)?;
            sysfs::bind_vfio(root, &bdf)?;
            let f = sysfs::function(root, &bdf)?;
            if f.driver.as_deref() != Some("vfio-pci") {
                bail!(
                    "{bdf} is bound to {} after the probe, not vfio-pci",
                    f.driver.as_deref().unwrap_or("no driver")
                );
            }
            if !args.json {
                println!(
                    "{bdf}: vfio-pci, IOMMU group {}",
                    f.iommu_group.map_or("none".into(), |g| g.to_string())
                );
                return Ok(());
            }
            switchyard_vfio::inventory::view(&f)
        }
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
