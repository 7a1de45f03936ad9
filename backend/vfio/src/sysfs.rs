//! PCI devices as sysfs shows them: an inventory, the checks before a device is opened, and
//! the two changes a pool makes (create SR-IOV VFs, bind a device to vfio-pci).
//!
//! Every function takes the sysfs root (`/sys` on a host) so that tests run against a fake
//! tree in a temporary directory.

use std::fs;
use std::path::{Path, PathBuf};

use crate::Error;

/// One PCI function.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciFunction {
    /// Its address, `DDDD:BB:DD.F`.
    pub bdf: String,
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Class code (24 bits).
    pub class: u32,
    /// The bound driver, if any.
    pub driver: Option<String>,
    /// The IOMMU group, if any.
    pub iommu_group: Option<u32>,
    /// SR-IOV: (total VFs, enabled VFs), for a PF.
    pub sriov: Option<(u32, u32)>,
    /// NUMA node (`None`: unknown, -1 in sysfs).
    pub numa_node: Option<u32>,
    /// The reset methods the kernel can use (`reset_method`), empty if none or unknown.
    pub reset_methods: Vec<String>,
}

/// `DDDD:BB:DD.F` in lower case; `BB:DD.F` gets domain 0.
pub fn normalize_bdf(s: &str) -> Result<String, Error> {
    let bad = || Error::BadAddress(s.to_owned());
    let s = s.trim();
    let parts: Vec<&str> = s.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [d, b, df] => (*d, *b, *df),
        [b, df] => ("0000", *b, *df),
        _ => return Err(bad()),
    };
    let (dev, func) = devfn.split_once('.').ok_or_else(bad)?;
    let hex = |v: &str, max_len: usize| {
        (!v.is_empty() && v.len() <= max_len)
            .then(|| u32::from_str_radix(v, 16).ok())
            .flatten()
    };
    let (Some(domain), Some(bus), Some(dev), Some(func)) =
        (hex(domain, 4), hex(bus, 2), hex(dev, 2), hex(func, 1))
    else {
        return Err(bad());
    };
    if dev > 0x1f || func > 7 {
        return Err(bad());
    }
    Ok(format!("{domain:04x}:{bus:02x}:{dev:02x}.{func:x}"))
}

/// The sysfs directory of PCI device `bdf`.
pub fn device_dir(root: &Path, bdf: &str) -> PathBuf {
    root.join("bus/pci/devices").join(bdf)
}

fn read_trim(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| Error::Sysfs {
            path: path.to_owned(),
            source,
        })
}

fn write_str(path: &Path, value: &str) -> Result<(), Error> {
    fs::write(path, value).map_err(|source| Error::Sysfs {
        path: path.to_owned(),
        source,
    })
}

fn parse_hex(path: &Path) -> Result<u32, Error> {
    let s = read_trim(path)?;
    u32::from_str_radix(s.trim_start_matches("0x"), 16).map_err(|_| Error::SysfsValue {
        path: path.to_owned(),
        content: s,
    })
}

fn parse_dec(path: &Path) -> Result<u32, Error> {
    let s = read_trim(path)?;
    s.parse().map_err(|_| Error::SysfsValue {
        path: path.to_owned(),
        content: s,
    })
}

/// The name a symlink points at (`driver` → `vfio-pci`, `iommu_group` → `5`).
fn link_name(path: &Path) -> Option<String> {
    let target = fs::read_link(path).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// The driver `bdf` is bound to, if any.
pub fn driver(root: &Path, bdf: &str) -> Option<String> {
    link_name(&device_dir(root, bdf).join("driver"))
}

/// The IOMMU group of `bdf`, if any.
pub fn iommu_group(root: &Path, bdf: &str) -> Option<u32> {
    link_name(&device_dir(root, bdf).join("iommu_group"))?
        .parse()
        .ok()
}

/// Whether `bdf` has an MSI-X capability, from its config space in sysfs (`None` when that
/// cannot be read whole: the device is absent, or only its first 64 bytes are readable, as
/// for users other than root).
pub fn has_msix(root: &Path, bdf: &str) -> Option<bool> {
    const STATUS: usize = 0x06;
    const CAP_LIST: u8 = 1 << 4;
    const CAP_PTR: usize = 0x34;
    const MSIX: u8 = 0x11;
    let config = fs::read(device_dir(root, bdf).join("config")).ok()?;
    if config.len() < 256 {
        return None;
    }
    if config[STATUS] & CAP_LIST == 0 {
        return Some(false);
    }
    let mut at = usize::from(config[CAP_PTR] & 0xfc);
    // A list that loops is cut after as many capabilities as fit.
    for _ in 0..48 {
        if at < 0x40 || at + 1 >= 256 {
            break;
        }
        if config[at] == MSIX {
            return Some(true);
        }
        at = usize::from(config[at + 1] & 0xfc);
    }
    Some(false)
}

/// What sysfs says about `bdf`.
pub fn function(root: &Path, bdf: &str) -> Result<PciFunction, Error> {
    let dir = device_dir(root, bdf);
    if !dir.exists() {
        return Err(Error::NoDevice {
            bdf: bdf.to_owned(),
            path: dir,
        });
    }
    let sriov = match parse_dec(&dir.join("sriov_totalvfs")) {
        Ok(total) => Some((total, parse_dec(&dir.join("sriov_numvfs")).unwrap_or(0))),
        Err(_) => None,
    };
    let numa_node = read_trim(&dir.join("numa_node"))
        .ok()
        .and_then(|s| s.parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    let reset_methods = read_trim(&dir.join("reset_method"))
        .map(|s| s.split_whitespace().map(str::to_owned).collect())
        .unwrap_or_default();
    Ok(PciFunction {
        bdf: bdf.to_owned(),
        vendor: parse_hex(&dir.join("vendor"))? as u16,
        device: parse_hex(&dir.join("device"))? as u16,
        class: parse_hex(&dir.join("class"))?,
        driver: driver(root, bdf),
        iommu_group: iommu_group(root, bdf),
        sriov,
        numa_node,
        reset_methods,
    })
}

/// Every PCI function under `root`, sorted by address.
pub fn scan(root: &Path) -> Result<Vec<PciFunction>, Error> {
    let dir = root.join("bus/pci/devices");
    let rd = fs::read_dir(&dir).map_err(|source| Error::Sysfs {
        path: dir.clone(),
        source,
    })?;
    let mut names: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names.iter().map(|bdf| function(root, bdf)).collect()
}

/// The devices of IOMMU group `group`, sorted.
pub fn group_devices(root: &Path, group: u32) -> Result<Vec<String>, Error> {
    let dir = root
        .join("kernel/iommu_groups")
        .join(group.to_string())
        .join("devices");
    let rd = fs::read_dir(&dir).map_err(|source| Error::Sysfs {
        path: dir.clone(),
        source,
    })?;
    let mut v: Vec<String> = rd
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    Ok(v)
}

/// Drivers another device of the group may be bound to without making the group unviable:
/// vfio-pci, and the two the kernel allows beside it (`pci-stub`, which does no DMA, and
/// `pcieport`, which drives a bridge or port in the group). The kernel's own viability check
/// (the group status when it is opened) has the last word.
pub const GROUP_SAFE_DRIVERS: [&str; 3] = ["vfio-pci", "pci-stub", "pcieport"];

/// Checks that `bdf` can be opened through VFIO: it exists, is bound to vfio-pci, has an IOMMU
/// group, and every other device of the group is bound to no driver or to one of
/// [`GROUP_SAFE_DRIVERS`]. Returns the group.
pub fn check_openable(root: &Path, bdf: &str) -> Result<u32, Error> {
    let dir = device_dir(root, bdf);
    if !dir.exists() {
        return Err(Error::NoDevice {
            bdf: bdf.to_owned(),
            path: dir,
        });
    }
    let group = iommu_group(root, bdf).ok_or_else(|| Error::NoIommuGroup(bdf.to_owned()))?;
    match driver(root, bdf) {
        Some(d) if d == "vfio-pci" => {}
        other => {
            return Err(Error::NotVfio {
                bdf: bdf.to_owned(),
                driver: other.unwrap_or_else(|| "no driver".to_owned()),
            });
        }
    }
    for other in group_devices(root, group)? {
        if let Some(d) = driver(root, &other)
            && !GROUP_SAFE_DRIVERS.contains(&d.as_str())
        {
            return Err(Error::GroupNotViable {
                group,
                other,
                driver: d,
            });
        }
    }
    Ok(group)
}

/// Creates `n` SR-IOV VFs on PF `pf`, left unbound (`sriov_drivers_autoprobe` = 0, so no host
/// driver grabs them before they are bound to vfio-pci). A PF with VFs already enabled is set
/// to 0 first (the kernel refuses to change a non-zero count). Returns the VFs' addresses
/// (`virtfnN` links).
pub fn create_vfs(root: &Path, pf: &str, n: u32) -> Result<Vec<String>, Error> {
    let dir = device_dir(root, pf);
    let total =
        parse_dec(&dir.join("sriov_totalvfs")).map_err(|_| Error::NoSriov(pf.to_owned()))?;
    if n > total {
        return Err(Error::TooManyVfs {
            bdf: pf.to_owned(),
            total,
            asked: n,
        });
    }
    write_str(&dir.join("sriov_drivers_autoprobe"), "0")?;
    if parse_dec(&dir.join("sriov_numvfs"))? != 0 {
        write_str(&dir.join("sriov_numvfs"), "0")?;
    }
    write_str(&dir.join("sriov_numvfs"), &n.to_string())?;
    let mut vfs = Vec::new();
    for i in 0..n {
        if let Some(vf) = link_name(&dir.join(format!("virtfn{i}"))) {
            vfs.push(vf);
        }
    }
    tracing::info!(pf, vfs = n, "SR-IOV VFs created");
    Ok(vfs)
}

/// Binds `bdf` to vfio-pci: unbinds its current driver, sets `driver_override`, and asks the
/// kernel to probe it again (`drivers_probe`).
pub fn bind_vfio(root: &Path, bdf: &str) -> Result<(), Error> {
    let dir = device_dir(root, bdf);
    if !dir.exists() {
        return Err(Error::NoDevice {
            bdf: bdf.to_owned(),
            path: dir,
        });
    }
    match driver(root, bdf) {
        Some(d) if d == "vfio-pci" => return Ok(()),
        Some(_) => write_str(&dir.join("driver/unbind"), bdf)?,
        None => {}
    }
    write_str(&dir.join("driver_override"), "vfio-pci")?;
    write_str(&root.join("bus/pci/drivers_probe"), bdf)?;
    tracing::info!(bdf, "bound to vfio-pci");
    Ok(())
}

#[cfg(test)]
mod tests;
