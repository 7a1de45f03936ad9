//! [`VfioPci`]: the device, its regions and the core traits.

use std::fs::File;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use switchyard_device::{
    CONFIG_REGION_INDEX, DeviceDescription, DeviceError, DirtySource, DmaObserver, IrqDesc,
    IrqRouter, NUM_PCI_REGIONS, PciDevice, RegionDesc, RegionMmap, SparseArea,
};
use vfio_bindings::bindings::vfio::{VFIO_IRQ_INFO_EVENTFD, VFIO_REGION_INFO_FLAG_MMAP};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioOps, VfioRegionInfoCap};

use crate::config::{MsixCap, RawConfig, VirtConfig};
use crate::dma::Iommu;
use crate::irq::{MsixTable, Router};
use crate::{BarMode, Error, VfioConfig, sysfs};
use switchyard_device::blackbox::Record;
use switchyard_device::irq::IrqIndex;

/// Page size for the MSI-X table's trapped pages.
mod migration;

const PAGE: u64 = 4096;

/// Where a VFIO region is in the device descriptor.
#[derive(Debug, Clone, Copy, Default)]
struct Region {
    offset: u64,
    size: u64,
    flags: u32,
}

/// The device's config space through the VFIO config region.
struct DeviceConfig<'a> {
    fd: &'a File,
    offset: u64,
}

impl RawConfig for DeviceConfig<'_> {
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.fd.read_exact_at(buf, self.offset + offset)
    }

    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.fd.write_all_at(data, self.offset + offset)
    }
}

/// What part of a BAR an access falls in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Device,
    Table,
    Pba,
}

/// The MSI-X table and PBA ranges of one BAR (at most two).
type Special = [Option<(u64, u64, Part)>; 2];

/// Splits `[offset, offset+len)` of a BAR at the MSI-X table and PBA (if they are in it):
/// (offset, length, part) pieces in order. Allocation-free (it runs on every BAR access).
fn split(offset: u64, len: u64, special: Special) -> impl Iterator<Item = (u64, u64, Part)> {
    let end = offset + len;
    let mut at = offset;
    std::iter::from_fn(move || {
        if at >= end {
            return None;
        }
        let ranges = special.iter().flatten();
        let inside = ranges.clone().find(|(s, e, _)| *s <= at && at < *e);
        let (stop, part) = match inside {
            Some((_, e, p)) => ((*e).min(end), *p),
            None => {
                let next = ranges
                    .filter(|(s, _, _)| *s > at)
                    .map(|(s, _, _)| *s)
                    .min()
                    .unwrap_or(end);
                (next.min(end), Part::Device)
            }
        };
        let piece = (at, stop - at, part);
        at = stop;
        Some(piece)
    })
}

/// What holds the device open: dropped (interrupts off, every descriptor of the device closed)
/// when the kernel asks for the device back, so its removal completes.
///
/// Fields drop in declaration order, and the order matters: `VfioDevice`'s drop (vfio-ioctls)
/// closes its descriptor and then reads the device's `iommu_group` link in sysfs, unwrapping
/// the result. If that descriptor were the device's last one, a removal waiting for it would
/// go on at once and could delete the link first: a panic. So the router's and our own
/// references to the `VfioDevice` go first and `fd` (our duplicate of the device descriptor)
/// last, keeping the device, and its sysfs directory, until the `VfioDevice` is gone.
struct Hw {
    router: Router,
    device: Arc<VfioDevice>,
    fd: Arc<File>,
}

/// The device as the server thread and the request watcher share it: `None` once released.
type SharedHw = Arc<Mutex<Option<Hw>>>;

fn lock(hw: &SharedHw) -> MutexGuard<'_, Option<Hw>> {
    hw.lock().unwrap_or_else(|e| e.into_inner())
}

/// The errno every access gets once the device is gone.
fn gone() -> DeviceError {
    DeviceError::Io(io::Error::from_raw_os_error(libc::ENODEV))
}

/// Releases the device (the kernel's `REQ`: an unbind or a hot-remove is waiting for it):
/// interrupts off, DMA unmapped, descriptors closed; then tells the client through its REQ
/// eventfd, if it gave one. Idempotent.
fn release(
    bdf: &str,
    hw: &SharedHw,
    iommu: &Iommu,
    client_req: &Mutex<Option<File>>,
    hook: &ReleaseHook,
) {
    let taken = lock(hw).take();
    let Some(mut h) = taken else { return };
    h.router.disable_all();
    iommu.clear();
    // A panic in a library's drop must not keep the supervisor from hearing of the release.
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(h))).is_err() {
        tracing::error!(
            bdf,
            "closing the device panicked (vfio-ioctls); it is closed anyway"
        );
    }
    tracing::warn!(
        bdf,
        "the kernel asked for the device back (VFIO device request: unbind or removal): \
         released; the endpoint is quarantined, every access fails with ENODEV"
    );
    if let Some(fd) = client_req
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
    {
        use std::io::Write;
        if let Err(e) = (&*fd).write_all(&1u64.to_ne_bytes()) {
            tracing::debug!(error = %e, "cannot signal the client's REQ eventfd");
        }
    }
    if let Some(f) = hook.lock().unwrap_or_else(|e| e.into_inner()).take() {
        f();
    }
}

/// Called once when the device is released (see [`VfioPci::on_release`]).
type ReleaseHook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

/// The thread that waits for the kernel's device request (VFIO `REQ` interrupt) and releases
/// the device; stopped through its own eventfd when the device is dropped.
struct ReqWatcher {
    stop: File,
    thread: Option<JoinHandle<()>>,
}

fn eventfd() -> io::Result<File> {
    Ok(File::from(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?))
}

impl ReqWatcher {
    fn start(
        bdf: String,
        hw: SharedHw,
        iommu: Arc<Iommu>,
        client_req: Arc<Mutex<Option<File>>>,
        hook: ReleaseHook,
    ) -> io::Result<ReqWatcher> {
        let req = eventfd()?;
        {
            let g = lock(&hw);
            let h = g
                .as_ref()
                .ok_or_else(|| io::Error::from_raw_os_error(libc::ENODEV))?;
            switchyard_sys::set_irq_eventfds(
                &h.device,
                IrqIndex::Req as u32,
                0,
                &[Some(req.as_fd())],
            )?;
        }
        let stop = eventfd()?;
        let stop_r = stop.try_clone()?;
        let thread = std::thread::Builder::new()
            .name(format!("vfio-req {bdf}"))
            .spawn(move || {
                use rustix::event::{PollFd, PollFlags, poll};
                loop {
                    let mut fds = [
                        PollFd::new(&req, PollFlags::IN),
                        PollFd::new(&stop_r, PollFlags::IN),
                    ];
                    match poll(&mut fds, None) {
                        Ok(_) => {}
                        Err(rustix::io::Errno::INTR) => continue,
                        Err(e) => {
                            tracing::warn!(error = %e, "device request watcher stops");
                            return;
                        }
                    }
                    if !fds[1].revents().is_empty() {
                        return;
                    }
                    if !fds[0].revents().is_empty() {
                        release(&bdf, &hw, &iommu, &client_req, &hook);
                        return;
                    }
                }
            })?;
        Ok(ReqWatcher {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for ReqWatcher {
    fn drop(&mut self) {
        use std::io::Write;
        let _ = (&self.stop).write_all(&1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A PCI device bound to vfio-pci, served to a vfio-user client (see the crate documentation).
pub struct VfioPci {
    bdf: String,
    desc: DeviceDescription,
    hw: SharedHw,
    regions: Vec<Region>,
    config: VirtConfig,
    msix: Option<(MsixCap, MsixTable)>,
    iommu: Arc<Iommu>,
    /// The client's REQ eventfd (signalled when the device is released under it).
    client_req: Arc<Mutex<Option<File>>>,
    /// Run when the device is released.
    release_hook: ReleaseHook,
    /// Migration streams (quiesce + reset + replay).
    mig: migration::MigState,
    /// Where the client's configuration is published after every change (a worker's black
    /// box), so that a replacement process can replay it ([`VfioPci::restore`]).
    mirror: Option<Record>,
    /// `None` if the kernel offers no device request interrupt.
    _watcher: Option<ReqWatcher>,
    /// Whether the kernel offers the error notification (ERR) for the client's eventfd.
    kernel_err: bool,
}

impl std::fmt::Debug for VfioPci {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioPci")
            .field("bdf", &self.bdf)
            .finish_non_exhaustive()
    }
}

impl VfioPci {
    /// Opens the device `config.host` (see the crate documentation for what is checked).
    pub fn open(config: &VfioConfig) -> Result<VfioPci, Error> {
        let bdf = sysfs::normalize_bdf(&config.host)?;
        let span = tracing::info_span!("vfio", bdf = %bdf);
        let _g = span.enter();
        let group = sysfs::check_openable(&config.sysfs, &bdf)?;
        let open_err = |source| Error::Open {
            bdf: bdf.clone(),
            group,
            source,
        };
        // The legacy container/group API; iommufd (/dev/vfio/devices) is future work.
        let container = Arc::new(VfioContainer::new(None).map_err(open_err)?);
        let ops: Arc<dyn VfioOps> = Arc::clone(&container) as Arc<dyn VfioOps>;
        let path = sysfs::device_dir(&config.sysfs, &bdf);
        let device = Arc::new(VfioDevice::new(&path, Arc::clone(&ops), false).map_err(open_err)?);
        let fd = Arc::new(switchyard_sys::dup_device_fd(&device).map_err(Error::Dup)?);

        // BAR0-5, ROM, config; the VGA region (8) is never offered (and asking vfio-ioctls
        // about a region the device lacks logs a warning).
        let mut regions: Vec<Region> = (0..=CONFIG_REGION_INDEX)
            .map(|i| Region {
                offset: device.get_region_offset(i),
                size: device.get_region_size(i),
                flags: device.get_region_flags(i),
            })
            .collect();
        regions.resize(NUM_PCI_REGIONS as usize, Region::default());
        let cfg_region = regions[CONFIG_REGION_INDEX as usize];
        if cfg_region.size < 256 {
            return Err(Error::NoConfig { bdf });
        }
        let mut bar_sizes = [0u64; 6];
        for (i, s) in bar_sizes.iter_mut().enumerate() {
            *s = regions[i].size;
        }
        let raw = DeviceConfig {
            fd: &fd,
            offset: cfg_region.offset,
        };
        let vconfig = VirtConfig::new(&raw, cfg_region.size.min(4096) as usize, bar_sizes)
            .map_err(|source| Error::Config {
                bdf: bdf.clone(),
                source,
            })?;
        for (id, offset) in vconfig.hidden_capabilities() {
            tracing::info!(id, offset, "capability hidden from the client");
        }

        let irq = |index: u32| {
            device
                .get_irq_info(index)
                .filter(|i| i.flags & VFIO_IRQ_INFO_EVENTFD != 0)
                .map_or(0, |i| i.count)
        };
        // Offer what both the kernel and the shadow's capabilities have.
        let msi_count = if vconfig.msi().is_some() { irq(1) } else { 0 };
        let msix_count = vconfig.msix().map_or(0, |m| irq(2).min(m.vectors));
        let none = IrqDesc {
            count: 0,
            eventfd: false,
            maskable: false,
            automasked: false,
            noresize: true,
        };
        let vectors = |count: u32, noresize: bool| {
            if count == 0 {
                none
            } else {
                IrqDesc {
                    count,
                    eventfd: true,
                    maskable: false,
                    automasked: false,
                    noresize,
                }
            }
        };
        let kernel_err = irq(IrqIndex::Err as u32) > 0;
        let irqs = vec![
            none, // INTx: not supported.
            vectors(msi_count, true),
            vectors(msix_count, false),
            // ERR: the client's eventfd goes to the kernel's error notification (AER) when the
            // kernel has one; otherwise no error is ever reported (the client keeps an eventfd
            // that never fires, as for a device without AER on a host).
            vectors(1, true),
            // REQ: signalled when the kernel takes the device back (see `release`).
            vectors(1, true),
        ];

        let msix = vconfig.msix().map(|m| (m, MsixTable::new(m.vectors)));
        let mut descs = Vec::with_capacity(NUM_PCI_REGIONS as usize);
        for (i, r) in regions.iter().enumerate().take(6) {
            if r.size == 0 {
                descs.push(RegionDesc::absent());
                continue;
            }
            let mut d = RegionDesc::trapped(r.size);
            if config.bars == BarMode::Mmap && r.flags & VFIO_REGION_INFO_FLAG_MMAP != 0 {
                let areas = mmap_areas(&device, i as u32, r.size, msix.as_ref().map(|(m, _)| *m));
                if !areas.is_empty() {
                    tracing::info!(bar = i, areas = ?areas, "BAR offered for mmap");
                    d.mmap = Some(RegionMmap {
                        file: Arc::clone(&fd),
                        file_offset: r.offset,
                        areas,
                    });
                }
            }
            descs.push(d);
        }
        descs.push(RegionDesc::absent()); // ROM: hidden.
        descs.push(RegionDesc::trapped(vconfig.size() as u64));
        descs.push(RegionDesc::absent()); // VGA.
        let resettable = sysfs::function(&config.sysfs, &bdf)
            .map(|f| !f.reset_methods.is_empty())
            .unwrap_or(true);
        let desc = DeviceDescription {
            name: "vfio-pci",
            regions: descs,
            irqs,
            resettable,
        };
        tracing::info!(
            group,
            bars = ?vconfig.bar_sizes(),
            msi = msi_count,
            msix = msix_count,
            resettable,
            mode = ?config.bars,
            "opened"
        );
        tracing::info!(
            "dirty tracking: the device has none; every page mapped into its IOMMU is reported dirty"
        );
        let memlock = rustix::process::getrlimit(rustix::process::Resource::Memlock).current;
        tracing::info!(
            memlock = %memlock.map_or_else(|| "unlimited".to_owned(), |b| b.to_string()),
            "the client's DMA windows are pinned while mapped: they count against RLIMIT_MEMLOCK unless the server has CAP_IPC_LOCK"
        );
        let router = Router::new(Arc::clone(&device), msi_count, msix_count, config.irq).map_err(
            |source| Error::Relay {
                bdf: bdf.clone(),
                source,
            },
        )?;
        let kernel_req = irq(IrqIndex::Req as u32) > 0;
        let hw: SharedHw = Arc::new(Mutex::new(Some(Hw { device, fd, router })));
        let iommu = Arc::new(Iommu::new(container));
        let client_req = Arc::new(Mutex::new(None));
        let release_hook: ReleaseHook = Arc::new(Mutex::new(None));
        let watcher = if kernel_req {
            Some(
                ReqWatcher::start(
                    bdf.clone(),
                    Arc::clone(&hw),
                    Arc::clone(&iommu),
                    Arc::clone(&client_req),
                    Arc::clone(&release_hook),
                )
                .map_err(|source| Error::ReqWatch {
                    bdf: bdf.clone(),
                    source,
                })?,
            )
        } else {
            tracing::warn!(
                "the kernel offers no device request interrupt: an unbind or removal of the \
                 device waits until this server exits"
            );
            None
        };
        drop(_g);
        Ok(VfioPci {
            bdf,
            desc,
            hw,
            regions,
            config: vconfig,
            msix,
            iommu,
            client_req,
            release_hook,
            mig: migration::MigState::default(),
            mirror: None,
            _watcher: watcher,
            kernel_err,
        })
    }

    /// The PCI address served.
    pub fn bdf(&self) -> &str {
        &self.bdf
    }

    /// The virtualized config space.
    pub fn config(&self) -> &VirtConfig {
        &self.config
    }

    /// Whether the kernel has taken the device back (the endpoint is quarantined).
    pub fn released(&self) -> bool {
        lock(&self.hw).is_none()
    }

    /// Capacity a mirror record needs ([`VfioPci::set_mirror`]).
    pub const MIRROR_CAPACITY: usize = migration::MAX_STREAM;

    /// Publishes the client's configuration (config-space bits and MSI-X table, the migration
    /// stream's contents) into `record` now and after every change.
    pub fn set_mirror(&mut self, record: Record) {
        self.mirror = Some(record);
        self.publish();
    }

    fn publish(&mut self) {
        if self.mirror.is_none() {
            return;
        }
        let stream = self.save_stream();
        if let Some(m) = &mut self.mirror
            && let Err(e) = m.publish(&stream)
        {
            tracing::warn!(error = %e, "cannot mirror the client's configuration");
        }
    }

    /// Replays a configuration a previous process published ([`VfioPci::set_mirror`]) onto
    /// this freshly opened device: reset, the client's config bits and MSI-X table, bus
    /// mastering as the client set it. The device's internal state is not restored (it was
    /// reset when the previous process's descriptors closed).
    pub fn restore(&mut self, saved: &[u8]) -> switchyard_device::Result<()> {
        self.load_stream(saved)?;
        self.set_bus_master(true)?;
        self.publish();
        Ok(())
    }

    /// Runs `f` once when the kernel takes the device back (see [`VfioPci::released`]), on
    /// the request watcher's thread; at once if that has happened already.
    pub fn on_release(&self, f: impl FnOnce() + Send + 'static) {
        let mut hook = self.release_hook.lock().unwrap_or_else(|e| e.into_inner());
        if self.released() {
            drop(hook);
            f();
        } else {
            *hook = Some(Box::new(f));
        }
    }

    /// The device's descriptor and config offset, or ENODEV once released.
    fn live_fd(&self) -> switchyard_device::Result<(Arc<File>, u64)> {
        let g = lock(&self.hw);
        let h = g.as_ref().ok_or_else(gone)?;
        Ok((
            Arc::clone(&h.fd),
            self.regions[CONFIG_REGION_INDEX as usize].offset,
        ))
    }

    fn bar(&self, region: u32, offset: u64, len: usize) -> switchyard_device::Result<Region> {
        let r = self
            .regions
            .get(region as usize)
            .filter(|r| region < 6 && r.size > 0)
            .copied()
            .ok_or(DeviceError::NoSuchRegion(region))?;
        if offset
            .checked_add(len as u64)
            .is_none_or(|end| end > r.size)
        {
            return Err(DeviceError::OutOfRange {
                region,
                offset,
                len,
            });
        }
        Ok(r)
    }

    /// The MSI-X table and PBA ranges inside BAR `region`.
    fn special(&self, region: u32) -> Special {
        let mut v = [None, None];
        if let Some((m, _)) = &self.msix {
            if m.table_bar == region {
                v[0] = Some((m.table_offset, m.table_offset + m.table_size(), Part::Table));
            }
            if m.pba_bar == region {
                v[1] = Some((m.pba_offset, m.pba_offset + m.pba_size(), Part::Pba));
            }
        }
        v
    }

    fn apply_msix_masks(&mut self) {
        let fmask = self.config.msix_function_masked();
        if let Some((_, table)) = &self.msix {
            let mut g = lock(&self.hw);
            let Some(h) = g.as_mut() else { return };
            if let Err(e) = h.router.apply_msix_masks(table, fmask) {
                tracing::warn!(error = %e, "cannot apply MSI-X masks");
            }
        }
    }
}

/// The mmappable areas of BAR `index`: the kernel's sparse areas (or the whole BAR) minus the
/// pages of the MSI-X table.
fn mmap_areas(
    device: &VfioDevice,
    index: u32,
    size: u64,
    msix: Option<MsixCap>,
) -> Vec<SparseArea> {
    let mut areas: Vec<(u64, u64)> = device
        .get_region_caps(index)
        .into_iter()
        .find_map(|c| match c {
            VfioRegionInfoCap::SparseMmap(s) => Some(
                s.areas
                    .iter()
                    .map(|a| (a.offset, a.offset + a.size))
                    .collect(),
            ),
            _ => None,
        })
        .unwrap_or_else(|| vec![(0, size)]);
    if let Some(m) = msix.filter(|m| m.table_bar == index) {
        let hole_start = m.table_offset / PAGE * PAGE;
        let hole_end = (m.table_offset + m.table_size()).div_ceil(PAGE) * PAGE;
        areas = areas
            .into_iter()
            .flat_map(|(s, e)| {
                [(s, e.min(hole_start)), (s.max(hole_end), e)]
                    .into_iter()
                    .filter(|(a, b)| a < b)
            })
            .collect();
    }
    areas
        .into_iter()
        .map(|(s, e)| SparseArea {
            offset: s,
            size: e - s,
        })
        .collect()
}

impl PciDevice for VfioPci {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> switchyard_device::Result<()> {
        let (fd, cfg_offset) = self.live_fd()?;
        if region == CONFIG_REGION_INDEX {
            let raw = DeviceConfig {
                fd: &fd,
                offset: cfg_offset,
            };
            return self
                .config
                .read(&raw, offset, data)
                .map_err(DeviceError::Io);
        }
        let r = self.bar(region, offset, data.len())?;
        let special = self.special(region);
        for (at, len, part) in split(offset, data.len() as u64, special) {
            let i = (at - offset) as usize;
            let buf = &mut data[i..i + len as usize];
            match part {
                Part::Device => fd.read_exact_at(buf, r.offset + at)?,
                Part::Table => {
                    if let Some((m, t)) = &self.msix {
                        t.read(at - m.table_offset, buf);
                    }
                }
                Part::Pba => {
                    let Some((m, _)) = self.msix else { continue };
                    let base = at - m.pba_offset;
                    let mut g = lock(&self.hw);
                    let h = g.as_mut().ok_or_else(gone)?;
                    for (k, b) in buf.iter_mut().enumerate() {
                        let byte = base + k as u64;
                        *b = 0;
                        for bit in 0..8 {
                            let v = (byte * 8 + bit) as usize;
                            if v < m.vectors as usize && h.router.msix_pending(v) {
                                *b |= 1 << bit;
                            }
                        }
                    }
                }
            }
        }
        tracing::trace!(region, offset, len = data.len(), "read");
        Ok(())
    }

    fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
    ) -> switchyard_device::Result<()> {
        let (fd, cfg_offset) = self.live_fd()?;
        if region == CONFIG_REGION_INDEX {
            let raw = DeviceConfig {
                fd: &fd,
                offset: cfg_offset,
            };
            let fx = self
                .config
                .write(&raw, offset, data)
                .map_err(DeviceError::Io)?;
            if fx.msix_control {
                self.apply_msix_masks();
            }
            self.publish();
            return Ok(());
        }
        let r = self.bar(region, offset, data.len())?;
        let special = self.special(region);
        let mut table_written = false;
        for (at, len, part) in split(offset, data.len() as u64, special) {
            let i = (at - offset) as usize;
            let buf = &data[i..i + len as usize];
            match part {
                Part::Device => fd.write_all_at(buf, r.offset + at)?,
                Part::Table => {
                    if let Some((m, t)) = &mut self.msix {
                        t.write(at - m.table_offset, buf);
                        table_written = true;
                    }
                }
                Part::Pba => {} // Read-only.
            }
        }
        if table_written {
            self.apply_msix_masks();
            self.publish();
        }
        tracing::trace!(region, offset, len = data.len(), "write");
        Ok(())
    }

    fn reset(&mut self) -> switchyard_device::Result<()> {
        if !self.desc.resettable {
            return Err(DeviceError::Unsupported);
        }
        let (fd, cfg_offset) = {
            let g = lock(&self.hw);
            let h = g.as_ref().ok_or_else(gone)?;
            switchyard_sys::reset_device(&h.device).map_err(|e| {
                tracing::warn!(error = %e, "VFIO_DEVICE_RESET failed");
                DeviceError::Io(e)
            })?;
            (
                Arc::clone(&h.fd),
                self.regions[CONFIG_REGION_INDEX as usize].offset,
            )
        };
        let raw = DeviceConfig {
            fd: &fd,
            offset: cfg_offset,
        };
        self.config.reapply(&raw).map_err(DeviceError::Io)?;
        tracing::info!("device reset; the client's COMMAND bits applied again");
        Ok(())
    }

    /// What kernel vfio-pci does for a user that opens the device: the device reset (when it
    /// can be), and what the client sees of it as when this process opened it: the shadow
    /// config space ([`VirtConfig::fresh`]), its COMMAND bits on the device, the MSI-X table
    /// masked.
    fn fresh_open(&mut self) -> switchyard_device::Result<()> {
        self.config.fresh();
        if let Some((m, t)) = &mut self.msix {
            *t = MsixTable::new(m.vectors);
        }
        self.apply_msix_masks();
        self.publish();
        if self.desc.resettable
            && let Err(e) = self.reset()
        {
            tracing::warn!(error = %e, "cannot reset the device for a new client");
        }
        let (fd, cfg_offset) = self.live_fd()?;
        let raw = DeviceConfig {
            fd: &fd,
            offset: cfg_offset,
        };
        self.config.reapply(&raw).map_err(DeviceError::Io)
    }

    fn client_disconnected(&mut self) {
        // The server has dropped its eventfds; the kernel must not keep signalling ours.
        if let Some(h) = lock(&self.hw).as_mut() {
            h.router.disable_all();
            if self.kernel_err {
                let _ = switchyard_sys::disable_irq(&h.device, IrqIndex::Err as u32);
            }
        }
        *self.client_req.lock().unwrap_or_else(|e| e.into_inner()) = None;
        // The DMA windows are gone from the IOMMU already: the server's unmap-all told the
        // observer before the client's memory was released.
        let left = self.iommu.windows();
        if !left.is_empty() {
            tracing::warn!(
                windows = left.len(),
                "DMA windows still mapped after the client left; unmapping"
            );
            self.iommu.clear();
        }
    }

    fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>> {
        Some(Arc::clone(&self.iommu) as Arc<dyn DmaObserver>)
    }

    fn migration(&mut self) -> Option<&mut dyn switchyard_device::Migratable> {
        Some(self)
    }

    fn dirty_source(&self) -> Option<Arc<dyn DirtySource>> {
        Some(Arc::clone(&self.iommu) as Arc<dyn DirtySource>)
    }

    fn recoverable(&self) -> Option<&dyn switchyard_device::Recoverable> {
        Some(self)
    }

    fn irq_router(&mut self) -> Option<&mut dyn IrqRouter> {
        Some(self)
    }
}

impl IrqRouter for VfioPci {
    fn route(
        &mut self,
        index: u32,
        start: u32,
        fds: &[Option<&File>],
    ) -> switchyard_device::Result<()> {
        if index == IrqIndex::Req as u32 {
            // Ours to signal (see `release`); kept even after the release, so a client that
            // routes it late still learns nothing more is coming.
            let fd = fds
                .first()
                .copied()
                .flatten()
                .map(File::try_clone)
                .transpose()?;
            *self.client_req.lock().unwrap_or_else(|e| e.into_inner()) = fd;
            return Ok(());
        }
        let mut g = lock(&self.hw);
        let h = g.as_mut().ok_or_else(gone)?;
        if index == IrqIndex::Err as u32 {
            if !self.kernel_err {
                return Ok(());
            }
            let fd = fds.first().copied().flatten().map(AsFd::as_fd);
            let r = match fd {
                Some(fd) => switchyard_sys::set_irq_eventfds(&h.device, index, 0, &[Some(fd)]),
                None => switchyard_sys::disable_irq(&h.device, index),
            };
            return r.map_err(DeviceError::Io);
        }
        h.router.route(index, start, fds)
    }
}

impl Drop for VfioPci {
    fn drop(&mut self) {
        if let Some(h) = lock(&self.hw).as_mut() {
            h.router.disable_all();
        }
        self.iommu.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accesses_split_at_the_msix_table_and_pba() {
        let special = [
            Some((0x1000, 0x1080, Part::Table)),
            Some((0x1800, 0x1808, Part::Pba)),
        ];
        let pieces = |o, l| split(o, l, special).collect::<Vec<_>>();
        assert_eq!(pieces(0, 4), [(0, 4, Part::Device)]);
        assert_eq!(pieces(0x1000, 16), [(0x1000, 16, Part::Table)]);
        assert_eq!(
            pieces(0xffc, 8),
            [(0xffc, 4, Part::Device), (0x1000, 4, Part::Table)]
        );
        assert_eq!(
            pieces(0x107c, 0x790),
            [
                (0x107c, 4, Part::Table),
                (0x1080, 0x780, Part::Device),
                (0x1800, 8, Part::Pba),
                (0x1808, 4, Part::Device)
            ]
        );
        assert_eq!(
            split(0x10, 8, [None, None]).collect::<Vec<_>>(),
            [(0x10, 8, Part::Device)]
        );
    }
}
