//! Our VMM-side client as the [`Transport`] of the test driver.

use std::borrow::{Borrow, BorrowMut};
use std::fs::File;
use std::os::fd::AsFd;

use switchyard_client::Client;
use switchyard_proto::consts::*;

use super::driver::{Driver, Transport};

/// The driver's transport over [`Client`].
pub struct Ours(pub Client);

impl Transport for Ours {
    fn region_read(&mut self, region: u32, offset: u64, buf: &mut [u8]) {
        self.0
            .region_read(region, offset, buf)
            .expect("region_read");
    }
    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) {
        self.0
            .region_write(region, offset, data)
            .expect("region_write");
    }
    fn dma_map(&mut self, iova: u64, size: u64, file: &File, offset: u64) {
        let flags = VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE;
        self.0
            .dma_map(iova, size, flags, Some((file.as_fd(), offset)))
            .expect("dma_map");
    }
    fn set_msix_eventfds(&mut self, start: u32, fds: &[&File]) {
        let b: Vec<_> = fds.iter().map(|f| f.as_fd()).collect();
        self.0
            .set_irqs(
                VFIO_PCI_MSIX_IRQ_INDEX,
                VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
                start,
                b.len() as u32,
                &b,
            )
            .expect("set_irqs");
    }
}

/// The source VMM's driver lends its client to a [`switchyard_client::migrate::Migration`]
/// and stays usable between its steps (the guest's jobs run during pre-copy).
impl Borrow<Client> for Driver<Ours> {
    fn borrow(&self) -> &Client {
        &self.t.0
    }
}

impl BorrowMut<Client> for Driver<Ours> {
    fn borrow_mut(&mut self) -> &mut Client {
        &mut self.t.0
    }
}
