//! DMA_MAP and DMA_UNMAP (with the dirty bitmap).

use std::os::fd::BorrowedFd;

use switchyard_proto::consts::*;
use switchyard_proto::{DmaMap, DmaUnmap, Reply, Request};

use crate::error::unexpected;
use crate::{Client, ClientError, Result};

impl Client {
    /// DMA_MAP. `fd` is `(fd, file offset)` for a mappable window.
    pub fn dma_map(
        &mut self,
        iova: u64,
        size: u64,
        flags: u32,
        fd: Option<(BorrowedFd<'_>, u64)>,
    ) -> Result<()> {
        let offset = fd.as_ref().map_or(0, |(_, o)| *o);
        let file = fd.map(|(f, _)| f);
        let raw = file.as_slice();
        let m = DmaMap {
            argsz: DmaMap::SIZE as u32,
            flags,
            offset,
            address: iova,
            size,
        };
        match self.request(&Request::DmaMap(m), raw)? {
            (Reply::DmaMap, _) => Ok(()),
            _ => Err(unexpected("DMA_MAP")),
        }
    }

    /// DMA_UNMAP with raw flags (no dirty bitmap).
    pub fn dma_unmap(&mut self, iova: u64, size: u64, flags: u32) -> Result<()> {
        let u = DmaUnmap {
            argsz: DmaUnmap::SIZE as u32,
            flags,
            address: iova,
            size,
        };
        match self.request(
            &Request::DmaUnmap {
                unmap: u,
                bitmap: None,
            },
            &[],
        )? {
            (Reply::DmaUnmap { .. }, _) => Ok(()),
            _ => Err(unexpected("DMA_UNMAP")),
        }
    }

    /// DMA_UNMAP with `VFIO_DMA_UNMAP_FLAG_ALL` (address = size = 0).
    pub fn dma_unmap_all(&mut self) -> Result<()> {
        self.dma_unmap(0, 0, VFIO_DMA_UNMAP_FLAG_ALL)
    }

    /// DMA_UNMAP with `GET_DIRTY_BITMAP`: returns the bitmap bytes.
    pub fn dma_unmap_dirty(&mut self, iova: u64, size: u64, pgsize: u64) -> Result<Vec<u8>> {
        let bsize =
            switchyard_proto::dirty_bitmap_size(size, pgsize).map_err(ClientError::Protocol)?;
        let argsz = u32::try_from(bsize + (DmaUnmap::SIZE + 16) as u64)
            .map_err(|_| ClientError::InvalidArgument("bitmap too large"))?;
        let u = DmaUnmap {
            argsz,
            flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
            address: iova,
            size,
        };
        let b = switchyard_proto::BitmapHeader {
            pgsize,
            size: bsize,
        };
        match self.request(
            &Request::DmaUnmap {
                unmap: u,
                bitmap: Some(b),
            },
            &[],
        )? {
            (
                Reply::DmaUnmap {
                    bitmap: Some(b), ..
                },
                _,
            ) => Ok(b.data.to_vec()),
            _ => Err(unexpected("DMA_UNMAP")),
        }
    }
}
