//! `--noiommu`: the workload without an IOMMU and without VFIO, for guests where VFIO cannot
//! work (cloud-hypervisor does not put a vfio-user device behind its virtio-iommu, and the
//! Debian 6.12 guest kernel has no VFIO no-IOMMU mode).
//!
//! - **Device**: found in sysfs (no driver may be bound to it), enabled through
//!   `/sys/bus/pci/devices/<bdf>/enable`, Memory Space and Bus Master set in the command
//!   register through the `config` file (`pread`/`pwrite`), BAR0 mapped through `resource0`
//!   and the VRAM BAR through `resource2` (if that cannot be mapped, reached with
//!   `pread`/`pwrite` on it, which the summary reports as `"vram_access":"pread"`; Linux
//!   implements read/write on the `resourceN` files of I/O BARs only, so for this memory BAR
//!   the fallback normally fails as well, and the error names both failures).
//! - **DMA**: without an IOMMU a bus address is a guest physical address: the DMA memory is
//!   locked 2 MiB hugepages at their physical addresses ([`crate::hugepage`]; kernel command
//!   line `hugepages=16`). Every buffer lies inside one run of physically adjacent hugepages,
//!   and the sizes shrink to fit the longest run ([`crate::workload::Sizes::fit_dma`]).
//! - **Completion**: no interrupt reaches user space without VFIO, so waits poll the
//!   `INT_STATUS` bits the device latches (whether or not MSI-X/MSI is enabled) and then read
//!   the fence value, each bounded by `--timeout` ([`crate::irq::Delivery::Polled`]).
//! - **Bad DMA**: a bus address that `/proc/iomem` shows as neither RAM nor a device. The
//!   second bad-DMA case (a range running off the end of the DMA memory) is skipped: without
//!   an IOMMU the device reaches the guest RAM there.
//!
//! The steps themselves are [`crate::workload`]'s, run through the same [`Gpu`].

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::time::Duration;

use crate::dma::DmaArena;
use crate::gpu::{self, DeviceAccess, Gpu, Parts, UNMAPPED_IOVA};
use crate::hugepage;
use crate::irq::{InterruptSource, IrqMode};
use crate::mmio::BarMap;
use crate::pci;
use crate::regs::*;
use crate::say;
use crate::sysfs::{Sysfs, sysfs_write};

/// The device through sysfs: config space through the `config` file; `release` undoes the
/// `enable` write.
#[derive(Debug)]
pub struct SysfsDevice {
    dir: PathBuf,
    config: File,
    /// `enable` read 0 before bring-up wrote 1.
    enabled_here: bool,
}

impl DeviceAccess for SysfsDevice {
    fn cfg_read(&self, offset: u64, buf: &mut [u8]) -> Result<(), String> {
        self.config
            .read_exact_at(buf, offset)
            .map_err(|e| format!("config read at {offset:#x}: {e}"))
    }

    fn cfg_write(&self, offset: u64, data: &[u8]) -> Result<(), String> {
        self.config
            .write_all_at(data, offset)
            .map_err(|e| format!("config write at {offset:#x}: {e}"))
    }

    /// Nothing was routed.
    fn disable_irqs(&self, _mode: IrqMode) -> Result<(), String> {
        Ok(())
    }

    fn release(&mut self) -> Vec<String> {
        if !std::mem::take(&mut self.enabled_here) {
            return Vec::new();
        }
        match sysfs_write(&self.dir.join("enable"), "0") {
            Ok(()) => Vec::new(),
            Err(e) => vec![e],
        }
    }
}

/// What the bring-up found, for the summary.
#[derive(Debug, Clone, Default)]
pub struct Bringup {
    /// PCI address.
    pub bdf: String,
    /// The device's own interrupt mode (capability list), unused.
    pub device_irq_mode: Option<&'static str>,
    /// `"mmap"` or `"pread"`: how the CPU reaches VRAM.
    pub vram_access: &'static str,
    /// Hugepages taken.
    pub hugepages: usize,
    /// Whether `MAP_LOCKED` was accepted.
    pub hugepages_locked: bool,
    /// Runs of physically adjacent hugepages.
    pub runs: usize,
    /// Bytes of the longest run.
    pub largest_run_bytes: u64,
    /// Lowest and highest bus (physical) address of the DMA memory.
    pub dma_span: (u64, u64),
    /// The bus address of the bad-DMA test.
    pub unmapped_addr: u64,
}

/// Finds, enables and maps the softgpu without VFIO and builds the [`Gpu`] on hugepage DMA
/// memory with polled completion. `bringup` is filled as far as it got.
pub fn open(
    sys: &Sysfs,
    bdf: Option<&str>,
    timeout: Duration,
    doorbell: gpu::Doorbell,
    bringup: &mut Bringup,
) -> Result<Gpu, String> {
    let dev = sys.find_softgpu(bdf)?;
    say!("device {dev}");
    bringup.bdf = dev.bdf.clone();
    if dev.class != PCI_CLASS {
        return Err(format!(
            "class {:06x}, expected {:06x}",
            dev.class, PCI_CLASS
        ));
    }
    let dir = sys.device_dir(&dev.bdf);
    if let Some(driver) = &dev.driver {
        return Err(format!(
            "{} is bound to {driver}: --noiommu drives the device without a kernel driver; unbind it first (echo {} > {}/driver/unbind)",
            dev.bdf,
            dev.bdf,
            dir.display()
        ));
    }

    let cfg_path = dir.join("config");
    let config = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&cfg_path)
        .map_err(|e| format!("open {}: {e} (run as root)", cfg_path.display()))?;
    let cfg = crate::probe::read_config(&config, &cfg_path)?;
    let mode = gpu::check_config(&cfg)?;
    bringup.device_irq_mode = Some(mode.name());
    let pm = usize::from(pci::find_capability(&cfg, CAP_PM).unwrap_or(0));
    let dstate = pci::le16(&cfg, pm + 4) & 3;
    if dstate != 0 {
        return Err(format!(
            "function is in D{dstate} (PMCSR), its BARs do not decode"
        ));
    }

    let enable = dir.join("enable");
    let was =
        std::fs::read_to_string(&enable).map_err(|e| format!("read {}: {e}", enable.display()))?;
    let mut access = SysfsDevice {
        dir: dir.clone(),
        config,
        enabled_here: false,
    };
    if was.trim() == "0" {
        sysfs_write(&enable, "1")?;
        access.enabled_here = true;
    }
    // From here on `access.release()` runs on every exit: the Gpu's shutdown, or this guard.
    let mut guard = ReleaseOnError(Some(access));
    let access = guard.0.as_ref().ok_or("device access gone")?;

    let got = gpu::enable_memory_and_master(access, &cfg)?;
    say!(
        "sysfs: enable {} -> 1; command register {got:#06x} (memory space, bus master) through {}",
        was.trim(),
        cfg_path.display()
    );

    let bar0_size = sys.bar_size(&dev.bdf, BAR_REGS as usize)?;
    if bar0_size < BAR0_SIZE {
        return Err(format!("BAR0 is {bar0_size} bytes, expected {BAR0_SIZE}"));
    }
    let open_rw = |name: &str| {
        let p = dir.join(name);
        OpenOptions::new()
            .read(true)
            .write(true)
            .open(&p)
            .map_err(|e| format!("open {}: {e}", p.display()))
    };
    let bar0 = BarMap::map(&open_rw("resource0")?, 0, &[(0, BAR0_SIZE)])
        .map_err(|e| format!("mmap resource0: {e}"))?;
    let vram_size = sys.bar_size(&dev.bdf, BAR_VRAM as usize)?;
    if vram_size == 0 {
        return Err(format!(
            "BAR{BAR_VRAM} has no address (sysfs resource line {BAR_VRAM} is empty)"
        ));
    }
    let res2 = open_rw("resource2")?;
    let vram = match BarMap::map(&res2, 0, &[(0, vram_size)]) {
        Ok(m) => {
            bringup.vram_access = "mmap";
            m
        }
        Err(e) => {
            say!(
                "resource2 cannot be mmapped ({e}): falling back to pread/pwrite on it (CPU VRAM accesses are file I/O, not a mapping)"
            );
            let mut probe = [0u8; 4];
            res2.read_exact_at(&mut probe, 0).map_err(|pe| {
                format!("VRAM BAR: mmap of resource2 failed ({e}) and so does pread ({pe})")
            })?;
            bringup.vram_access = "pread";
            BarMap::file_io(res2, vram_size)
        }
    };
    let (nq, vram_bytes) = Gpu::check_bars_and_reset(&bar0, &vram)?;
    gpu::check_vector_count_register(&bar0, mode)?;
    say!(
        "interrupts: none without VFIO (the device's {} stays disabled); completion is polled through INT_STATUS, every wait bounded by {} s",
        mode.label(),
        timeout.as_secs()
    );

    let pages = hugepage::allocate()?;
    bringup.hugepages = pages.windows.len();
    bringup.hugepages_locked = pages.locked;
    let mut addrs: Vec<u64> = pages.windows.iter().map(|w| w.iova).collect();
    addrs.sort_unstable();
    let dma = DmaArena::from_windows(pages.windows)?;
    bringup.runs = dma.runs().len();
    bringup.largest_run_bytes = dma.largest_run();
    bringup.dma_span = (dma.base(), dma.end());
    say!(
        "DMA: {} hugepages of 2 MiB ({} free in the pool, {}), physical = bus addresses {:#x}..{:#x} in {} run(s) of adjacent pages, longest {} MiB",
        bringup.hugepages,
        pages.pool_free,
        if pages.locked {
            "MAP_LOCKED"
        } else {
            "not locked: MAP_LOCKED refused; hugepages are never swapped"
        },
        dma.base(),
        dma.end(),
        bringup.runs,
        bringup.largest_run_bytes >> 20
    );
    say!(
        "DMA: hugepages at {}",
        addrs
            .iter()
            .map(|a| format!("{a:#x}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let iomem =
        std::fs::read_to_string("/proc/iomem").map_err(|e| format!("read /proc/iomem: {e}"))?;
    let unmapped = hugepage::unclaimed_address(&hugepage::parse_iomem(&iomem), UNMAPPED_IOVA, 1 << 20)
        .ok_or("/proc/iomem shows no addresses (run as root): cannot pick a bus address that is neither RAM nor a device for the bad-DMA test")?;
    bringup.unmapped_addr = unmapped;
    say!("bad-DMA target: bus address {unmapped:#x} (no RAM, no device in /proc/iomem)");

    let dev_access = guard.0.take().ok_or("device access gone")?;
    Gpu::from_parts(Parts {
        bar0,
        vram,
        irqs: InterruptSource::polled(mode),
        dma,
        dev: Box::new(dev_access),
        nq,
        vram_size: vram_bytes,
        config: cfg,
        timeout,
        unmapped_addr: unmapped,
        doorbell,
    })
}

/// Turns bus mastering off and undoes the `enable` write if bring-up fails before the
/// [`Gpu`] owns the device.
struct ReleaseOnError(Option<SysfsDevice>);

impl Drop for ReleaseOnError {
    fn drop(&mut self) {
        if let Some(mut d) = self.0.take() {
            let mut b = [0u8; 2];
            if d.cfg_read(pci::PCI_COMMAND as u64, &mut b).is_ok() {
                let cmd = u16::from_le_bytes(b) & !pci::PCI_COMMAND_MASTER;
                let _ = d.cfg_write(pci::PCI_COMMAND as u64, &cmd.to_le_bytes());
            }
            for p in d.release() {
                say!("release: {p}");
            }
        }
    }
}
