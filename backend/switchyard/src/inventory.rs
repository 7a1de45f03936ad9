//! `switchyard inventory`: the host's PCI functions as a pool sees them (sysfs), and the two
//! changes it makes to them: create SR-IOV VFs, bind a function to vfio-pci.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use serde_json::{Value, json};
use switchyard_vfio::sysfs::{self, PciFunction};

#[derive(Debug, clap::Args)]
pub struct InventoryArgs {
    /// JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// The sysfs root (tests use a fake tree).
    #[arg(long, global = true, default_value = "/sys", value_name = "DIR")]
    sysfs: PathBuf,
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
    /// The NVIDIA GPUs a `cuda` board can name (`gpu = "GPU-…"`): NVML when it is installed
    /// (UUID, name, memory, PCI address, health), else the CUDA driver. Exits 1 when neither
    /// can list them, saying why.
    Gpus,
}

fn view(f: &PciFunction) -> Value {
    json!({
        "bdf": f.bdf,
        "vendor": format!("{:04x}", f.vendor),
        "device": format!("{:04x}", f.device),
        "class": format!("{:06x}", f.class),
        "driver": f.driver,
        "iommu_group": f.iommu_group,
        "sriov_totalvfs": f.sriov.map(|s| s.0),
        "sriov_numvfs": f.sriov.map(|s| s.1),
        "numa_node": f.numa_node,
        "reset_methods": f.reset_methods,
    })
}

pub fn run(args: InventoryArgs) -> Result<()> {
    let root = &args.sysfs;
    let out = match args.action {
        None => {
            let all = sysfs::scan(root).context("scan PCI devices")?;
            if !args.json {
                println!(
                    "{:<13} {:<9} {:<6} {:<12} {:>5} {:>7} {:>4}  reset",
                    "address", "id", "class", "driver", "group", "vfs", "numa"
                );
                for f in &all {
                    println!(
                        "{:<13} {:04x}:{:04x} {:06x} {:<12} {:>5} {:>7} {:>4}  {}",
                        f.bdf,
                        f.vendor,
                        f.device,
                        f.class,
                        f.driver.as_deref().unwrap_or("-"),
                        f.iommu_group.map_or("-".into(), |g| g.to_string()),
                        f.sriov.map_or("-".into(), |(t, n)| format!("{n}/{t}")),
                        f.numa_node.map_or("-".into(), |n| n.to_string()),
                        f.reset_methods.join(",")
                    );
                }
                return Ok(());
            }
            json!({ "devices": all.iter().map(view).collect::<Vec<_>>() })
        }
        Some(Action::Gpus) => {
            let gpus = switchyard_cuda::inventory::gpus()
                .map_err(|e| anyhow::anyhow!("No NVIDIA GPU can be listed on this host: {e}"))?;
            let offload = switchyard_cuda::inventory::offload_here();
            if !args.json {
                println!(
                    "{:<41} {:<24} {:>9} {:<13} {:<6} health",
                    "uuid", "name", "memory", "pci", "source"
                );
                for g in &gpus {
                    println!(
                        "{:<41} {:<24} {:>6} GiB {:<13} {:<6} {}",
                        g.uuid,
                        g.name,
                        g.memory >> 30,
                        g.pci.as_deref().unwrap_or("-"),
                        g.source,
                        g.problem.as_deref().unwrap_or("ok")
                    );
                }
                println!("commands: {}", offload.describe());
                return Ok(());
            }
            json!({ "offload": {
                "kernels": offload.no_kernels.is_none(),
                "gemm": offload.no_gemm.is_none(),
                "describe": offload.describe(),
            }, "gpus": gpus.iter().map(|g| json!({
                "uuid": g.uuid,
                "name": g.name,
                "memory": g.memory,
                "pci": g.pci,
                "problem": g.problem,
                "source": g.source,
            })).collect::<Vec<_>>() })
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
            view(&f)
        }
    };
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(())
}
