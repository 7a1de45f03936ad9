//! Linux VFIO, legacy container/group API with the type1v2 IOMMU, through the rust-vmm
//! `vfio-ioctls` crate (built without its KVM/MSHV features: it needs no hypervisor).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use vfio_bindings::bindings::vfio::{
    VFIO_PCI_CONFIG_REGION_INDEX, VFIO_PCI_MSI_IRQ_INDEX, VFIO_PCI_MSIX_IRQ_INDEX,
    VFIO_REGION_INFO_FLAG_MMAP, VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps, VfioRegionInfoCap};
use vmm_sys_util::eventfd::EventFd;

use crate::irq::IrqMode;
use crate::mmio::BarMap;

/// An error with its whole source chain on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// What `VFIO_DEVICE_GET_REGION_INFO` said about a region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RegionInfo {
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: u32,
    /// Size in bytes.
    pub size: u64,
    /// Offset of the region in the device fd.
    pub offset: u64,
    /// Sparse mmap areas `(offset, size)`, if the region has that capability.
    pub sparse: Option<Vec<(u64, u64)>>,
}

impl RegionInfo {
    /// Whether the region can be mmapped.
    pub fn mmappable(&self) -> bool {
        self.flags & VFIO_REGION_INFO_FLAG_MMAP != 0
    }

    /// The areas to mmap: the sparse areas, or the whole region.
    pub fn mmap_areas(&self) -> Vec<(u64, u64)> {
        match &self.sparse {
            Some(a) => a.iter().copied().filter(|&(_, s)| s > 0).collect(),
            None => vec![(0, self.size)],
        }
    }

    /// `rw`/`mmap` flags for logs.
    pub fn describe(&self) -> String {
        let mut f = Vec::new();
        if self.flags & VFIO_REGION_INFO_FLAG_READ != 0 {
            f.push("read");
        }
        if self.flags & VFIO_REGION_INFO_FLAG_WRITE != 0 {
            f.push("write");
        }
        if self.mmappable() {
            f.push("mmap");
        }
        let sparse = match &self.sparse {
            Some(a) => format!(" sparse={a:x?}"),
            None => String::new(),
        };
        format!("size={:#x} [{}]{sparse}", self.size, f.join(","))
    }
}

/// An open VFIO device in its own type1v2 container.
pub struct Vfio {
    // Field order is drop order: our duplicate of the device fd goes first, then the device
    // (which closes its fd and detaches the group), then the container.
    file: File,
    device: VfioDevice,
    container: Arc<VfioContainer>,
    group: u32,
    sysfs_path: PathBuf,
}

impl std::fmt::Debug for Vfio {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vfio")
            .field("group", &self.group)
            .field("device", &self.sysfs_path)
            .finish_non_exhaustive()
    }
}

impl Vfio {
    /// Opens `/dev/vfio/vfio`, the device's group `/dev/vfio/<group>` (waiting up to `wait`
    /// for the node to appear), sets the type1v2 IOMMU and gets the device fd.
    pub fn open(sysfs_path: &Path, group: u32, wait: Duration) -> Result<Vfio, String> {
        let node = PathBuf::from(format!("/dev/vfio/{group}"));
        let deadline = Instant::now() + wait;
        while !node.exists() {
            if Instant::now() >= deadline {
                return Err(format!("{} did not appear", node.display()));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let container = Arc::new(
            VfioContainer::new(None).map_err(|e| format!("VFIO container: {}", chain(&e)))?,
        );
        let ops: Arc<dyn VfioOps> = container.clone();
        let device = VfioDevice::new(sysfs_path, ops, false)
            .map_err(|e| format!("VFIO device {}: {}", sysfs_path.display(), chain(&e)))?;
        let file = switchyard_sys::dup_device_fd(&device).map_err(|e| chain(&e))?;
        Ok(Vfio {
            file,
            device,
            container,
            group,
            sysfs_path: sysfs_path.to_path_buf(),
        })
    }

    /// The IOMMU group.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// Region `index` as reported by `VFIO_DEVICE_GET_REGION_INFO`.
    pub fn region(&self, index: u32) -> RegionInfo {
        let sparse = self
            .device
            .get_region_caps(index)
            .into_iter()
            .find_map(|c| match c {
                VfioRegionInfoCap::SparseMmap(s) => {
                    Some(s.areas.iter().map(|a| (a.offset, a.size)).collect())
                }
                _ => None,
            });
        RegionInfo {
            flags: self.device.get_region_flags(index),
            size: self.device.get_region_size(index),
            offset: self.device.get_region_offset(index),
            sparse,
        }
    }

    /// Vectors VFIO offers on IRQ index `index` (`VFIO_DEVICE_GET_IRQ_INFO`; 0 if absent).
    pub fn irq_count(&self, index: u32) -> u32 {
        self.device.get_irq_info(index).map_or(0, |i| i.count)
    }

    /// Number of MSI-X vectors VFIO offers.
    pub fn msix_count(&self) -> u32 {
        self.irq_count(VFIO_PCI_MSIX_IRQ_INDEX)
    }

    /// Number of MSI vectors VFIO offers.
    pub fn msi_count(&self) -> u32 {
        self.irq_count(VFIO_PCI_MSI_IRQ_INDEX)
    }

    /// Vectors VFIO offers for `mode`.
    pub fn vectors(&self, mode: IrqMode) -> u32 {
        match mode {
            IrqMode::Msix => self.msix_count(),
            IrqMode::Msi => self.msi_count(),
        }
    }

    /// Reads config space through the config region.
    pub fn cfg_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        let r = self.region(VFIO_PCI_CONFIG_REGION_INDEX);
        self.file
            .read_exact_at(buf, r.offset + offset)
            .map_err(|e| format!("config read at {offset:#x}: {e}"))
    }

    /// Writes config space through the config region.
    pub fn cfg_write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        let r = self.region(VFIO_PCI_CONFIG_REGION_INDEX);
        self.file
            .write_all_at(data, r.offset + offset)
            .map_err(|e| format!("config write at {offset:#x}: {e}"))
    }

    /// Maps region `index` (its sparse areas, or all of it).
    pub fn map_region(&self, index: u32) -> Result<BarMap, String> {
        let r = self.region(index);
        if r.size == 0 {
            return Err(format!("region {index} is absent"));
        }
        if !r.mmappable() {
            return Err(format!(
                "region {index} cannot be mmapped ({})",
                r.describe()
            ));
        }
        BarMap::map(&self.file, r.offset, &r.mmap_areas())
            .map_err(|e| format!("mmap region {index}: {e}"))
    }

    /// Routes the vectors of `mode` to `fds` (`VFIO_DEVICE_SET_IRQS` with eventfd triggers on
    /// `VFIO_PCI_MSIX_IRQ_INDEX` or `VFIO_PCI_MSI_IRQ_INDEX`); the kernel then enables MSI-X or
    /// MSI in the device.
    pub fn enable_irqs(&self, mode: IrqMode, fds: Vec<&EventFd>) -> Result<(), String> {
        let n = fds.len();
        match mode {
            IrqMode::Msix => self.device.enable_msix(fds),
            IrqMode::Msi => self.device.enable_msi(fds),
        }
        .map_err(|e| {
            format!(
                "VFIO_DEVICE_SET_IRQS ({}, {n} eventfds): {}",
                mode.label(),
                chain(&e)
            )
        })
    }

    /// Tears the vectors of `mode` down again.
    pub fn disable_irqs(&self, mode: IrqMode) -> Result<(), String> {
        match mode {
            IrqMode::Msix => self.device.disable_msix(),
            IrqMode::Msi => self.device.disable_msi(),
        }
        .map_err(|e| format!("disable {}: {}", mode.label(), chain(&e)))
    }

    /// Adds the likely cause to `err` (from [`Vfio::map_region`]) when BAR `index` has no
    /// address: VFIO reports an unassigned BAR as an absent region. After a PCIe hot-add this
    /// happens when the root port's bridge window is smaller than the BAR (the kernel log then
    /// says `BAR N ...: can't assign; no space`).
    pub fn explain_absent_bar(&self, index: u32, err: String) -> String {
        if self.region(index).size != 0 {
            return err;
        }
        let line = std::fs::read_to_string(self.sysfs_path.join("resource"))
            .ok()
            .and_then(|t| t.lines().nth(index as usize).map(str::to_owned));
        match line {
            Some(l)
                if l.split_whitespace()
                    .all(|w| u64::from_str_radix(w.trim_start_matches("0x"), 16) == Ok(0)) =>
            {
                format!(
                    "{err}: the guest kernel assigned no address to BAR{index} (sysfs resource line {index}: {l}); after a hot-add this means the bridge window above the device is too small for the BAR (the kernel log says \"BAR {index} ...: can't assign; no space\")"
                )
            }
            _ => err,
        }
    }

    /// Reads config space as the guest kernel sees the function (sysfs `config`), not through
    /// VFIO: vfio-pci virtualizes parts of it (e.g. the MSI Message Control byte, whose enable
    /// bit VFIO only shows once the user writes it).
    pub fn sysfs_cfg_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        let path = self.sysfs_path.join("config");
        File::open(&path)
            .and_then(|f| f.read_exact_at(buf, offset))
            .map_err(|e| format!("{} at {offset:#x}: {e}", path.display()))
    }

    /// The IOMMU domain (the type1v2 container) the device's DMA goes through, for
    /// [`crate::dma::DmaArena::map`].
    pub fn iommu(&self) -> Arc<dyn VfioOps> {
        self.container.clone()
    }
}
