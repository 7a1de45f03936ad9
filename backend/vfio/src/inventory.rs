//! The passthrough kind's inventory of a host (`switchyard inventory --kind vfio`): its PCI
//! functions, with what a passthrough device needs of them (driver, IOMMU group, SR-IOV).

use serde_json::{Value, json};
use switchyard_device::kind::{Host, HostInventory};

use crate::sysfs::{self, PciFunction};

/// A function for programs (`switchyard inventory --json`).
pub fn view(f: &PciFunction) -> Value {
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

/// The host's PCI functions (`host.sysfs`).
pub fn functions(host: &Host) -> Result<HostInventory, String> {
    let all = sysfs::scan(&host.sysfs).map_err(|e| format!("Cannot scan PCI devices: {e}"))?;
    let rows = all
        .iter()
        .map(|f| {
            vec![
                f.bdf.clone(),
                format!("{:04x}:{:04x}", f.vendor, f.device),
                format!("{:06x}", f.class),
                f.driver.clone().unwrap_or_else(|| "-".into()),
                f.iommu_group.map_or("-".into(), |g| g.to_string()),
                f.sriov.map_or("-".into(), |(t, n)| format!("{n}/{t}")),
                f.numa_node.map_or("-".into(), |n| n.to_string()),
                f.reset_methods.join(","),
            ]
        })
        .collect();
    Ok(HostInventory {
        columns: vec![
            "address", "id", "class", "driver", "group", "vfs", "numa", "reset",
        ],
        rows,
        footer: None,
        json: json!({ "devices": all.iter().map(view).collect::<Vec<_>>() }),
    })
}
