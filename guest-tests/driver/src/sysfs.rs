//! PCI devices in sysfs: discovery, identity, IOMMU group, BAR resources, and binding to
//! vfio-pci. The root is a parameter so the logic is tested against a fake tree.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::regs;

/// A PCI function as sysfs describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciDev {
    /// Address `dddd:bb:dd.f`.
    pub bdf: String,
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Class code (24 bits).
    pub class: u32,
    /// Bound driver, if any.
    pub driver: Option<String>,
    /// IOMMU group, if the device is behind an IOMMU.
    pub iommu_group: Option<u32>,
}

impl std::fmt::Display for PciDev {
    /// `bdf vendor:device class cccccc driver=… iommu_group=…`, as the driver logs it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {:04x}:{:04x} class {:06x} driver={} iommu_group=",
            self.bdf,
            self.vendor,
            self.device,
            self.class,
            self.driver.as_deref().unwrap_or("none")
        )?;
        match self.iommu_group {
            Some(g) => write!(f, "{g}"),
            None => f.write_str("none"),
        }
    }
}

/// How [`Sysfs::bind_vfio_pci`] got the device onto vfio-pci.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BindOutcome {
    /// It already was.
    AlreadyBound,
    /// Bound now (after unbinding `previous`), by `method`.
    Bound {
        /// Driver it was unbound from.
        previous: Option<String>,
        /// `driver_override` or `new_id`.
        method: &'static str,
    },
}

/// Parses `0x1234\n`-style sysfs numbers.
pub fn parse_hex(s: &str) -> Option<u64> {
    let t = s.trim();
    let t = t
        .strip_prefix("0x")
        .or_else(|| t.strip_prefix("0X"))
        .unwrap_or(t);
    if t.is_empty() {
        return None;
    }
    u64::from_str_radix(t, 16).ok()
}

/// Whether `s` is a full PCI address `dddd:bb:dd.f` (hex digits, lower or upper case).
pub fn is_bdf(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(u8::is_ascii_hexdigit);
    b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && (b'0'..=b'7').contains(&b[11])
}

/// Line `bar` of a sysfs `resource` file: `(start, end, flags)`.
pub fn parse_resource(text: &str, bar: usize) -> Option<(u64, u64, u64)> {
    let line = text.lines().nth(bar)?;
    let mut it = line.split_whitespace().map(parse_hex);
    Some((it.next()??, it.next()??, it.next()??))
}

/// Size of BAR `bar` from a `resource` file (0 if unassigned).
pub fn resource_size(text: &str, bar: usize) -> Option<u64> {
    let (start, end, _) = parse_resource(text, bar)?;
    Some(if end > start { end - start + 1 } else { 0 })
}

/// A sysfs tree (normally `/sys`).
#[derive(Debug, Clone)]
pub struct Sysfs {
    root: PathBuf,
}

fn read_trim(p: &Path) -> Result<String, String> {
    fs::read_to_string(p)
        .map(|s| s.trim().to_string())
        .map_err(|e| format!("read {}: {e}", p.display()))
}

fn link_name(p: &Path) -> Option<String> {
    let target = fs::read_link(p).ok()?;
    Some(target.file_name()?.to_string_lossy().into_owned())
}

/// Writes `value` to an existing sysfs attribute (never creates one; truncation is a no-op on
/// sysfs and keeps the fake trees of the tests exact).
pub fn sysfs_write(p: &Path, value: &str) -> Result<(), String> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(p)
        .map_err(|e| format!("open {}: {e}", p.display()))?;
    f.write_all(value.as_bytes())
        .map_err(|e| format!("write '{value}' to {}: {e}", p.display()))
}

impl Sysfs {
    /// A tree rooted at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Sysfs {
        Sysfs { root: root.into() }
    }

    /// The real `/sys`.
    pub fn system() -> Sysfs {
        Sysfs::new("/sys")
    }

    /// `<root>/bus/pci/devices/<bdf>`.
    pub fn device_dir(&self, bdf: &str) -> PathBuf {
        self.root.join("bus/pci/devices").join(bdf)
    }

    /// `<root>/bus/pci/drivers/<name>`.
    pub fn driver_dir(&self, name: &str) -> PathBuf {
        self.root.join("bus/pci/drivers").join(name)
    }

    /// Reads one device.
    pub fn read_device(&self, bdf: &str) -> Result<PciDev, String> {
        let d = self.device_dir(bdf);
        let num = |attr: &str| -> Result<u64, String> {
            let p = d.join(attr);
            let s = read_trim(&p)?;
            parse_hex(&s).ok_or_else(|| format!("{}: not a hex number: '{s}'", p.display()))
        };
        Ok(PciDev {
            bdf: bdf.to_string(),
            vendor: num("vendor")? as u16,
            device: num("device")? as u16,
            class: num("class")? as u32,
            driver: link_name(&d.join("driver")),
            iommu_group: link_name(&d.join("iommu_group")).and_then(|g| g.parse().ok()),
        })
    }

    /// All PCI devices, sorted by address.
    pub fn list(&self) -> Result<Vec<PciDev>, String> {
        let dir = self.root.join("bus/pci/devices");
        let rd = fs::read_dir(&dir).map_err(|e| format!("read {}: {e}", dir.display()))?;
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| is_bdf(n))
            .collect();
        names.sort();
        names.iter().map(|n| self.read_device(n)).collect()
    }

    /// The softgpu: the one at `bdf` (checked), else the first 1234:5347 in the system.
    pub fn find_softgpu(&self, bdf: Option<&str>) -> Result<PciDev, String> {
        let dev = match bdf {
            Some(b) => {
                if !is_bdf(b) {
                    return Err(format!("'{b}' is not a PCI address (dddd:bb:dd.f)"));
                }
                if !self.device_dir(b).exists() {
                    return Err(format!("no PCI device {b}"));
                }
                self.read_device(b)?
            }
            None => self
                .list()?
                .into_iter()
                .find(|d| d.vendor == regs::PCI_VENDOR && d.device == regs::PCI_DEVICE)
                .ok_or_else(|| {
                    format!(
                        "no PCI device {:04x}:{:04x} in {}",
                        regs::PCI_VENDOR,
                        regs::PCI_DEVICE,
                        self.root.join("bus/pci/devices").display()
                    )
                })?,
        };
        if (dev.vendor, dev.device) != (regs::PCI_VENDOR, regs::PCI_DEVICE) {
            return Err(format!(
                "{} is {:04x}:{:04x}, not the softgpu {:04x}:{:04x}",
                dev.bdf,
                dev.vendor,
                dev.device,
                regs::PCI_VENDOR,
                regs::PCI_DEVICE
            ));
        }
        Ok(dev)
    }

    /// Binds `bdf` to vfio-pci: unbind the current driver, then `driver_override` +
    /// `drivers_probe`; falls back to `new_id` + `bind` if that did not take.
    pub fn bind_vfio_pci(&self, bdf: &str) -> Result<(PciDev, BindOutcome), String> {
        let dev = self.read_device(bdf)?;
        if dev.driver.as_deref() == Some("vfio-pci") {
            return Ok((dev, BindOutcome::AlreadyBound));
        }
        let vfio = self.driver_dir("vfio-pci");
        if !vfio.is_dir() {
            return Err(format!(
                "the vfio-pci driver is not loaded ({} missing): load vfio, vfio_iommu_type1, vfio-pci-core, vfio-pci",
                vfio.display()
            ));
        }
        let d = self.device_dir(bdf);
        let previous = dev.driver.clone();
        if previous.is_some() {
            sysfs_write(&d.join("driver/unbind"), bdf)?;
        }
        sysfs_write(&d.join("driver_override"), "vfio-pci")?;
        // drivers_probe reports an error when no driver takes the device; the link decides.
        let probe = sysfs_write(&self.root.join("bus/pci/drivers_probe"), bdf);
        let now = self.read_device(bdf)?;
        if now.driver.as_deref() == Some("vfio-pci") {
            return Ok((
                now,
                BindOutcome::Bound {
                    previous,
                    method: "driver_override",
                },
            ));
        }
        // Fallback: a dynamic ID (EEXIST when already added is fine), then an explicit bind.
        let id = format!("{:04x} {:04x}", dev.vendor, dev.device);
        let new_id = sysfs_write(&vfio.join("new_id"), &id);
        let now = self.read_device(bdf)?;
        if now.driver.as_deref() != Some("vfio-pci") {
            let _ = sysfs_write(&vfio.join("bind"), bdf);
        }
        let now = self.read_device(bdf)?;
        if now.driver.as_deref() == Some("vfio-pci") {
            return Ok((
                now,
                BindOutcome::Bound {
                    previous,
                    method: "new_id",
                },
            ));
        }
        Err(format!(
            "{bdf} did not bind to vfio-pci (driver now {:?}; drivers_probe: {}; new_id: {})",
            now.driver,
            probe.err().unwrap_or_else(|| "ok".into()),
            new_id.err().unwrap_or_else(|| "ok".into())
        ))
    }

    /// Size of BAR `bar` from `<dev>/resource`.
    pub fn bar_size(&self, bdf: &str, bar: usize) -> Result<u64, String> {
        let p = self.device_dir(bdf).join("resource");
        let text = fs::read_to_string(&p).map_err(|e| format!("read {}: {e}", p.display()))?;
        resource_size(&text, bar).ok_or_else(|| format!("{}: no line for BAR{bar}", p.display()))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// Builds a fake `/sys` with a few PCI devices.
    pub struct FakeSys {
        pub dir: tempfile::TempDir,
    }

    impl FakeSys {
        pub fn new() -> FakeSys {
            let dir = tempfile::tempdir().expect("tempdir");
            let r = dir.path();
            for d in [
                "bus/pci/devices",
                "bus/pci/drivers",
                "kernel/iommu_groups",
                "devices/pci0000:00",
            ] {
                fs::create_dir_all(r.join(d)).expect("mkdir");
            }
            fs::write(r.join("bus/pci/drivers_probe"), "").expect("write");
            FakeSys { dir }
        }

        pub fn root(&self) -> &Path {
            self.dir.path()
        }

        pub fn add_driver(&self, name: &str) {
            let d = self.root().join("bus/pci/drivers").join(name);
            fs::create_dir_all(&d).expect("mkdir");
            for f in ["bind", "unbind", "new_id"] {
                fs::write(d.join(f), "").expect("write");
            }
        }

        pub fn add_device(
            &self,
            bdf: &str,
            ids: (u16, u16, u32),
            driver: Option<&str>,
            group: Option<u32>,
        ) {
            let r = self.root();
            let real = r.join("devices/pci0000:00").join(bdf);
            fs::create_dir_all(&real).expect("mkdir");
            fs::write(real.join("vendor"), format!("0x{:04x}\n", ids.0)).expect("write");
            fs::write(real.join("device"), format!("0x{:04x}\n", ids.1)).expect("write");
            fs::write(real.join("class"), format!("0x{:06x}\n", ids.2)).expect("write");
            fs::write(real.join("driver_override"), "(null)\n").expect("write");
            fs::write(
                real.join("resource"),
                "0x00000000fe000000 0x00000000fe00ffff 0x0000000000040200\n\
                 0x0000000000000000 0x0000000000000000 0x0000000000000000\n\
                 0x0000008000000000 0x0000008003ffffff 0x000000000014220c\n",
            )
            .expect("write");
            if let Some(drv) = driver {
                self.add_driver(drv);
                symlink(r.join("bus/pci/drivers").join(drv), real.join("driver")).expect("ln");
            }
            if let Some(g) = group {
                let gd = r.join("kernel/iommu_groups").join(g.to_string());
                fs::create_dir_all(&gd).expect("mkdir");
                symlink(&gd, real.join("iommu_group")).expect("ln");
            }
            symlink(&real, r.join("bus/pci/devices").join(bdf)).expect("ln");
        }
    }

    const GPU: (u16, u16, u32) = (0x1234, 0x5347, 0x030200);

    #[test]
    fn parsing() {
        assert_eq!(parse_hex("0x1234\n"), Some(0x1234));
        assert_eq!(parse_hex("030200"), Some(0x030200));
        assert_eq!(parse_hex("0x"), None);
        assert_eq!(parse_hex("zz"), None);
        assert!(is_bdf("0000:00:04.0"));
        assert!(is_bdf("0000:0A:1f.7"));
        assert!(!is_bdf("00:04.0"));
        assert!(!is_bdf("0000:00:04.8"));
        assert!(!is_bdf("0000-00:04.0"));
        let res = "0x00000000fe000000 0x00000000fe00ffff 0x0000000000040200\n\
                   0x0000000000000000 0x0000000000000000 0x0000000000000000\n";
        assert_eq!(resource_size(res, 0), Some(0x10000));
        assert_eq!(resource_size(res, 1), Some(0));
        assert_eq!(resource_size(res, 5), None);
    }

    #[test]
    fn finds_the_softgpu() {
        let fs_ = FakeSys::new();
        fs_.add_device("0000:00:01.0", (0x8086, 0x29c0, 0x060000), None, Some(0));
        fs_.add_device(
            "0000:00:03.0",
            (0x1234, 0x1111, 0x030000),
            Some("bochs-drm"),
            Some(1),
        );
        fs_.add_device("0000:00:04.0", GPU, None, Some(3));
        let s = Sysfs::new(fs_.root());
        assert_eq!(s.list().map(|l| l.len()), Ok(3));
        let d = s.find_softgpu(None).expect("found");
        assert_eq!(
            d,
            PciDev {
                bdf: "0000:00:04.0".into(),
                vendor: 0x1234,
                device: 0x5347,
                class: 0x030200,
                driver: None,
                iommu_group: Some(3),
            }
        );
        assert_eq!(s.find_softgpu(Some("0000:00:04.0")), Ok(d));
        assert!(
            s.find_softgpu(Some("0000:00:03.0"))
                .is_err_and(|e| e.contains("not the softgpu"))
        );
        assert!(
            s.find_softgpu(Some("0000:00:09.0"))
                .is_err_and(|e| e.contains("no PCI device"))
        );
        assert!(s.find_softgpu(Some("bogus")).is_err());
        let drv = s.read_device("0000:00:03.0").expect("read");
        assert_eq!(drv.driver.as_deref(), Some("bochs-drm"));
        assert_eq!(s.bar_size("0000:00:04.0", 0), Ok(0x10000));
        assert_eq!(s.bar_size("0000:00:04.0", 2), Ok(64 << 20));
    }

    #[test]
    fn no_softgpu() {
        let fs_ = FakeSys::new();
        fs_.add_device("0000:00:01.0", (0x8086, 0x29c0, 0x060000), None, None);
        let s = Sysfs::new(fs_.root());
        assert!(
            s.find_softgpu(None)
                .is_err_and(|e| e.contains("no PCI device 1234:5347"))
        );
    }

    #[test]
    fn bind_already_bound_touches_nothing() {
        let fs_ = FakeSys::new();
        fs_.add_device("0000:00:04.0", GPU, Some("vfio-pci"), Some(3));
        let s = Sysfs::new(fs_.root());
        let (d, how) = s.bind_vfio_pci("0000:00:04.0").expect("bound");
        assert_eq!(how, BindOutcome::AlreadyBound);
        assert_eq!(d.iommu_group, Some(3));
        let ov = fs::read_to_string(s.device_dir("0000:00:04.0").join("driver_override"));
        assert_eq!(ov.ok().as_deref(), Some("(null)\n"));
    }

    #[test]
    fn bind_needs_the_vfio_pci_driver() {
        let fs_ = FakeSys::new();
        fs_.add_device("0000:00:04.0", GPU, None, Some(3));
        let s = Sysfs::new(fs_.root());
        assert!(
            s.bind_vfio_pci("0000:00:04.0")
                .is_err_and(|e| e.contains("not loaded"))
        );
    }

    /// The fake kernel never binds, so the whole sequence is visible in the files it wrote.
    #[test]
    fn bind_sequence() {
        let fs_ = FakeSys::new();
        fs_.add_device("0000:00:04.0", GPU, Some("other"), Some(3));
        fs_.add_driver("vfio-pci");
        let s = Sysfs::new(fs_.root());
        let err = s
            .bind_vfio_pci("0000:00:04.0")
            .expect_err("fake kernel does not bind");
        assert!(err.contains("did not bind"), "{err}");
        let r = fs_.root();
        let read = |p: &str| fs::read_to_string(r.join(p)).expect("read");
        assert_eq!(read("bus/pci/drivers/other/unbind"), "0000:00:04.0");
        assert_eq!(
            read("devices/pci0000:00/0000:00:04.0/driver_override"),
            "vfio-pci"
        );
        assert_eq!(read("bus/pci/drivers_probe"), "0000:00:04.0");
        assert_eq!(read("bus/pci/drivers/vfio-pci/new_id"), "1234 5347");
        assert_eq!(read("bus/pci/drivers/vfio-pci/bind"), "0000:00:04.0");
    }
}
