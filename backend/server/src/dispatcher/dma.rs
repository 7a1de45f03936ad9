//! DMA_MAP and DMA_UNMAP: the client's windows in the DMA space, published for a replacement.

use std::fs::File;
use std::os::fd::OwnedFd;

use switchyard_device::{DmaProt, DmaSpace};
use switchyard_proto::consts::*;
use switchyard_proto::{BitmapHeader, DmaMap, DmaUnmap, Reply};

use super::{Dispatcher, reply_empty};
use crate::continuity::WindowRecord;
use crate::error::{RequestError, invalid};

impl Dispatcher {
    /// DMA_MAP: a window backed by the descriptor in `fds` (custody id in `fd_ids`), or by
    /// messages to the client without one.
    pub(super) fn dma_map(
        &mut self,
        dma: &DmaSpace,
        id: u16,
        m: DmaMap,
        fds: Vec<OwnedFd>,
        fd_ids: &[u64],
    ) -> Result<(), RequestError> {
        if m.flags & VFIO_USER_F_DMA_REGION_FILE_IO != 0 {
            return Err(RequestError::Invalid {
                what: "file I/O DMA access mode is not supported",
                errno: libc::ENOTSUP,
            });
        }
        let prot = DmaProt {
            read: m.flags & VFIO_USER_F_DMA_REGION_READ != 0,
            write: m.flags & VFIO_USER_F_DMA_REGION_WRITE != 0,
        };
        let fd_id = fd_ids.first().copied();
        let record = WindowRecord {
            iova: m.address,
            size: m.size,
            offset: if fds.is_empty() { 0 } else { m.offset },
            read: prot.read,
            write: prot.write,
            fd: None,
        };
        if self.replaying
            && let Some(c) = &self.continuity
            && c.has_window(&record, fd_id)
        {
            // The replaced process mapped it and published it, then died before the
            // reply: the client still waits for that reply.
            tracing::info!(
                iova = m.address,
                size = m.size,
                "replayed DMA map: already mapped"
            );
            return reply_empty(&mut self.out, id, Reply::DmaMap);
        }
        let backing = match fds.into_iter().next() {
            Some(fd) => {
                if !m.offset.is_multiple_of(4096) {
                    return Err(invalid("DMA map file offset is not page aligned"));
                }
                Some((File::from(fd), m.offset))
            }
            None if m.flags & VFIO_USER_F_DMA_REGION_MMAP != 0 => {
                return Err(invalid("mmap DMA access mode without a file descriptor"));
            }
            None => None,
        };
        let mmapped = backing.is_some();
        dma.map(m.address, m.size, prot, backing)?;
        if let Some(c) = &self.continuity {
            c.dma_mapped(WindowRecord {
                fd: fd_id.filter(|_| mmapped),
                ..record
            });
        }
        tracing::debug!(
            iova = m.address,
            size = m.size,
            flags = m.flags,
            mmapped,
            "DMA map"
        );
        reply_empty(&mut self.out, id, Reply::DmaMap)
    }

    /// DMA_UNMAP: one range (its dirty bits with it, if asked) or every window.
    pub(super) fn dma_unmap(
        &mut self,
        dma: &DmaSpace,
        id: u16,
        unmap: DmaUnmap,
        bitmap: Option<BitmapHeader>,
    ) -> Result<(), RequestError> {
        if unmap.flags & VFIO_DMA_UNMAP_FLAG_ALL != 0 {
            dma.unmap_all();
            if let Some(c) = &self.continuity {
                c.dma_unmapped_all();
            }
            tracing::debug!("DMA unmap all");
            Reply::DmaUnmap {
                unmap,
                bitmap: None,
            }
            .encode(id, &mut self.out)?;
        } else if let Some(bh) = bitmap {
            let buf = switchyard_proto::dma_unmap_bitmap_reply_buffer(
                &mut self.out,
                id,
                &unmap,
                bh.pgsize,
            )?;
            // Bits and windows go together, under one lock: no write falls in between.
            let n = dma.unmap_take_dirty(unmap.address, unmap.size, bh.pgsize, buf)?;
            if let Some(c) = &self.continuity {
                c.dma_unmapped(unmap.address, unmap.size);
            }
            tracing::debug!(
                iova = unmap.address,
                size = unmap.size,
                windows = n,
                "DMA unmap with dirty bitmap"
            );
        } else {
            let n = dma.unmap(unmap.address, unmap.size)?;
            if let Some(c) = &self.continuity {
                c.dma_unmapped(unmap.address, unmap.size);
            }
            tracing::debug!(
                iova = unmap.address,
                size = unmap.size,
                windows = n,
                "DMA unmap"
            );
            Reply::DmaUnmap {
                unmap,
                bitmap: None,
            }
            .encode(id, &mut self.out)?;
        }
        Ok(())
    }
}
