//! Test helpers shared by the server's unit tests: a small mock device and a [`DeviceSlot`]
//! around it, so the dispatcher can be driven without a process or a socket.
//!
//! Kept inside the crate (`#[cfg(test)]`) rather than in a crate of its own: building a
//! [`DeviceSlot`] by hand needs the crate-private `Slot`, and the process tests in
//! `backend/switchyard/tests/` have their own helpers against a real server.

use std::sync::{Arc, Mutex};

use switchyard_device::{
    DeviceContext, DeviceDescription, DeviceError, DmaSpace, Interrupts, IrqDesc, PciDevice,
    RegionDesc, WaitControl,
};

use crate::{DeviceSlot, Slot};

/// Size of the mock's BAR0.
pub(crate) const MOCK_BAR0: u64 = 0x1000;
/// Vectors of the mock's MSI-X index.
pub(crate) const MOCK_MSIX: u32 = 4;

/// A device with one trapped BAR0 backed by memory, INTx, and MSI-X with [`MOCK_MSIX`]
/// vectors; it records what the server told it.
pub(crate) struct MockDevice {
    desc: DeviceDescription,
    /// BAR0's contents.
    pub(crate) bar0: Vec<u8>,
    /// The indexes `irqs_changed` was called with, in order.
    pub(crate) irqs_changed: Vec<u32>,
    /// `reset` calls.
    pub(crate) resets: u32,
}

impl MockDevice {
    pub(crate) fn new() -> Self {
        let mut regions = vec![RegionDesc::absent(); 9];
        regions[0] = RegionDesc::trapped(MOCK_BAR0);
        // BAR2: mappable by the client (its descriptor travels with REGION_INFO), never
        // accessed through the server.
        let backing = memfd::MemfdOptions::default()
            .create("mock-bar2")
            .expect("memfd")
            .into_file();
        backing.set_len(MOCK_BAR0).expect("size");
        regions[2] = RegionDesc {
            size: MOCK_BAR0,
            read: false,
            write: false,
            mmap: Some(switchyard_device::RegionMmap {
                file: Arc::new(backing),
                file_offset: 0,
                areas: Vec::new(),
            }),
        };
        let irq = |count| IrqDesc {
            count,
            eventfd: true,
            maskable: true,
            automasked: false,
            noresize: false,
        };
        Self {
            desc: DeviceDescription {
                name: "mock",
                regions,
                irqs: vec![irq(1), irq(0), irq(MOCK_MSIX), irq(0), irq(0)],
                resettable: true,
            },
            bar0: vec![0; MOCK_BAR0 as usize],
            irqs_changed: Vec::new(),
            resets: 0,
        }
    }

    fn bar0(
        &mut self,
        region: u32,
        offset: u64,
        len: usize,
    ) -> switchyard_device::Result<&mut [u8]> {
        let range = usize::try_from(offset)
            .ok()
            .and_then(|o| Some(o..o.checked_add(len)?));
        match range.and_then(|r| self.bar0.get_mut(r)) {
            Some(b) if region == 0 => Ok(b),
            _ => Err(DeviceError::OutOfRange {
                region,
                offset,
                len,
            }),
        }
    }
}

impl PciDevice for MockDevice {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }
    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> switchyard_device::Result<()> {
        data.copy_from_slice(self.bar0(region, offset, data.len())?);
        Ok(())
    }
    fn region_write(
        &mut self,
        region: u32,
        offset: u64,
        data: &[u8],
    ) -> switchyard_device::Result<()> {
        self.bar0(region, offset, data.len())?.copy_from_slice(data);
        Ok(())
    }
    fn reset(&mut self) -> switchyard_device::Result<()> {
        self.resets += 1;
        self.bar0.fill(0);
        Ok(())
    }
    fn irqs_changed(&mut self, index: u32) {
        self.irqs_changed.push(index);
    }
}

/// A slot holding `device`, with a DMA space of `max_maps` windows and an interrupt table
/// sized to the device (as `Server::new` builds it).
pub(crate) fn slot_with(device: Box<dyn PciDevice>, max_maps: usize) -> DeviceSlot {
    let ctx = DeviceContext {
        dma: Arc::new(DmaSpace::new(max_maps)),
        irqs: Arc::new(Interrupts::new(&device.description().irq_counts())),
        waits: Arc::new(WaitControl::default()),
        memory: Default::default(),
    };
    ctx.dma.set_observer(device.dma_observer());
    ctx.dma.set_dirty_source(device.dirty_source());
    DeviceSlot::new(Arc::new(Mutex::new(Slot::new(device))), ctx)
}
