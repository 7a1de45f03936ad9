//! A second kind of device behind the same server: a mock of what a physical (VFIO
//! passthrough) device needs from the core — told about every DMA map and unmap before it takes
//! effect (to program an IOMMU), a dirty log of its own ORed into reports, interrupt eventfds
//! handed to it, no migration and no swap — served by a real server and driven by our client.
#![forbid(unsafe_code)]

mod common;

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::{Arc, Mutex};
use std::thread;

use common::GuestMemory;
use switchyard_client::Client;
use switchyard_device::{
    DeviceDescription, DeviceError, DirtySource, DmaObserver, DmaProt, IrqDesc, IrqRouter,
    PciDevice, RegionDesc,
};
use switchyard_proto::consts::*;
use switchyard_server::{Server, ServerConfig, StopHandle, SwapError};

/// What the device was told.
#[derive(Default, Debug)]
struct Seen {
    maps: Vec<(u64, u64, bool, Option<u64>)>,
    unmaps: Vec<(u64, u64)>,
    routed: Vec<(u32, u32, usize)>,
}

/// The device's IOMMU stand-in: records maps and unmaps, refuses one address.
struct Iommu(Arc<Mutex<Seen>>);

const REFUSED_IOVA: u64 = 0xdead_0000;

impl DmaObserver for Iommu {
    fn mapping(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        file: Option<(&File, u64)>,
    ) -> Result<(), DeviceError> {
        if iova == REFUSED_IOVA {
            return Err(DeviceError::Unsupported);
        }
        let offset = file.map(|(_, off)| off);
        self.0
            .lock()
            .expect("lock")
            .maps
            .push((iova, size, prot.write, offset));
        Ok(())
    }

    fn unmapped(&self, iova: u64, size: u64) {
        self.0.lock().expect("lock").unmaps.push((iova, size));
    }
}

/// A dirty log of the device's own: reports page 5 of whatever range is asked, once.
struct OwnLog(Mutex<bool>);

impl DirtySource for OwnLog {
    fn report(&self, _iova: u64, _len: u64, _page_size: u64, out: &mut [u8]) {
        let mut pending = self.0.lock().expect("lock");
        if *pending {
            out[0] |= 1 << 5;
            *pending = false;
        }
    }
}

struct Passthrough {
    desc: DeviceDescription,
    iommu: Arc<Iommu>,
    log: Arc<OwnLog>,
    seen: Arc<Mutex<Seen>>,
}

impl IrqRouter for Passthrough {
    fn route(
        &mut self,
        index: u32,
        start: u32,
        fds: &[Option<&File>],
    ) -> switchyard_device::Result<()> {
        let assigned = fds.iter().filter(|f| f.is_some()).count();
        self.seen
            .lock()
            .expect("lock")
            .routed
            .push((index, start, assigned));
        Ok(())
    }
}

impl PciDevice for Passthrough {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }
    fn region_read(&mut self, _: u32, _: u64, data: &mut [u8]) -> switchyard_device::Result<()> {
        data.fill(0x5a);
        Ok(())
    }
    fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> switchyard_device::Result<()> {
        Ok(())
    }
    fn reset(&mut self) -> switchyard_device::Result<()> {
        Ok(())
    }
    fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>> {
        Some(self.iommu.clone())
    }
    fn dirty_source(&self) -> Option<Arc<dyn DirtySource>> {
        Some(self.log.clone())
    }
    fn irq_router(&mut self) -> Option<&mut dyn IrqRouter> {
        Some(self)
    }
}

fn passthrough(seen: &Arc<Mutex<Seen>>) -> Passthrough {
    let mut regions = vec![RegionDesc::absent(); 9];
    regions[0] = RegionDesc::trapped(0x1000);
    regions[7] = RegionDesc::trapped(0x100);
    let msix = IrqDesc {
        count: 4,
        eventfd: true,
        maskable: true,
        automasked: false,
        noresize: false,
    };
    let none = IrqDesc { count: 0, ..msix };
    Passthrough {
        desc: DeviceDescription {
            name: "passthrough-mock",
            regions,
            irqs: vec![none, none, msix, none, none],
            resettable: true,
        },
        iommu: Arc::new(Iommu(seen.clone())),
        log: Arc::new(OwnLog(Mutex::new(true))),
        seen: seen.clone(),
    }
}

struct Running {
    stop: StopHandle,
    thread: Option<thread::JoinHandle<()>>,
    socket: std::path::PathBuf,
    slot: switchyard_server::DeviceSlot,
    _dir: tempfile::TempDir,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(seen: &Arc<Mutex<Seen>>) -> Running {
    let dir = tempfile::tempdir().expect("tempdir");
    let socket = dir.path().join("pt.sock");
    let device = passthrough(seen);
    let mut server = Server::new(ServerConfig::new(&socket), move |_ctx| {
        Ok::<_, std::io::Error>(device)
    })
    .expect("server");
    let stop = server.stop_handle();
    let slot = server.device_slot();
    let thread = thread::spawn(move || server.run().expect("run"));
    Running {
        stop,
        thread: Some(thread),
        socket,
        slot,
        _dir: dir,
    }
}

#[test]
fn a_device_that_maps_its_own_iommu_and_routes_its_own_interrupts() {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let server = serve(&seen);
    let mut c = Client::connect(&server.socket).expect("connect");
    let mut b = [0u8; 4];
    c.region_read(0, 0, &mut b).expect("read");
    assert_eq!(b, [0x5a; 4], "the core serves region accesses");

    // Maps: the device hears of each before it takes effect, with the file offset.
    let mem = GuestMemory::new(0x20_0000);
    let rw = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
    c.dma_map(
        0x10_0000,
        0x10_0000,
        rw,
        Some((mem.file.as_fd(), 0x10_0000)),
    )
    .expect("map");
    c.dma_map(0x40_0000, 0x1000, VFIO_USER_F_DMA_REGION_READ, None)
        .expect("message-only map");
    let e = c
        .dma_map(REFUSED_IOVA, 0x1000, rw, Some((mem.file.as_fd(), 0)))
        .expect_err("the device refuses it");
    assert_eq!(e.remote_errno(), Some(libc::ENOTSUP));
    assert_eq!(
        seen.lock().expect("lock").maps,
        [
            (0x10_0000, 0x10_0000, true, Some(0x10_0000)),
            (0x40_0000, 0x1000, false, None)
        ]
    );
    // The refused window was not mapped: unmapping its range removes nothing.
    c.dma_unmap(REFUSED_IOVA, 0x1000, 0)
        .expect("unmap of nothing");
    assert!(seen.lock().expect("lock").unmaps.is_empty());

    // Dirty bits of the device's own log are in the report.
    c.dma_logging_start(4096, &[]).expect("start");
    let bits = c
        .dma_logging_report(0x10_0000, 0x10_0000, 4096)
        .expect("report");
    assert_eq!(bits[0], 1 << 5, "page 5 from the device's log");

    // Interrupt eventfds go to the device too.
    let fds: Vec<File> = (0..2)
        .map(|_| switchyard_device::irq::new_eventfd().expect("eventfd"))
        .collect();
    let borrowed: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
    c.set_irqs(
        VFIO_PCI_MSIX_IRQ_INDEX,
        VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
        1,
        2,
        &borrowed,
    )
    .expect("set_irqs");
    assert_eq!(
        seen.lock().expect("lock").routed,
        [(VFIO_PCI_MSIX_IRQ_INDEX, 1, 2)]
    );
    // Disabling the index (TRIGGER|DATA_NONE, count 0) takes every vector back from the device.
    c.set_irqs(
        VFIO_PCI_MSIX_IRQ_INDEX,
        VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
        0,
        0,
        &[],
    )
    .expect("disable");
    assert_eq!(
        seen.lock().expect("lock").routed,
        [
            (VFIO_PCI_MSIX_IRQ_INDEX, 1, 2),
            (VFIO_PCI_MSIX_IRQ_INDEX, 0, 0)
        ]
    );

    // Unmaps: the device hears of each.
    c.dma_unmap(0, 0x100_0000, 0).expect("unmap both");
    let mut unmaps = seen.lock().expect("lock").unmaps.clone();
    unmaps.sort();
    assert_eq!(unmaps, [(0x10_0000, 0x10_0000), (0x40_0000, 0x1000)]);

    // No migration, no swap: the features say so, the slot refuses.
    let e = c.migration_flags().expect_err("no migration");
    assert_eq!(e.remote_errno(), Some(libc::ENOTTY));
    assert!(matches!(
        server.slot.prepare_swap(),
        Err(SwapError::NotSwappable)
    ));
}
