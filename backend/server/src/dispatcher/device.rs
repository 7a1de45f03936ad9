//! The device itself: its description (DEVICE_GET_INFO, DEVICE_GET_REGION_INFO,
//! DEVICE_GET_REGION_IO_FDS), its regions (REGION_READ, REGION_WRITE, REGION_WRITE_MULTI) and
//! DEVICE_RESET.

use std::os::fd::AsFd;

use switchyard_device::{DeviceError, PciDevice, RegionDesc};
use switchyard_proto::consts::*;
use switchyard_proto::{
    DeviceInfo, Records, RegionCapsBuilder, RegionInfo, Reply, SparseMmapArea, WriteMultiEntry,
    encode_region_write_reply, region_read_reply_buffer,
};

use super::{Dispatcher, reply_empty};
use crate::Slot;
use crate::error::{RequestError, invalid};

impl Dispatcher {
    /// REGION_READ: read into the reply.
    #[inline]
    pub(super) fn region_read(
        &mut self,
        dev: &mut dyn PciDevice,
        id: u16,
        offset: u64,
        index: u32,
        count: u32,
    ) -> Result<(), RequestError> {
        let r = region(dev, index)?;
        if !r.read {
            return Err(invalid("region is not readable"));
        }
        check_range(r, index, offset, count as usize)?;
        tracing::trace!(region = index, offset, count, "region read");
        let buf = region_read_reply_buffer(&mut self.out, id, offset, index, count)?;
        dev.region_read(index, offset, buf)?;
        Ok(())
    }

    /// REGION_WRITE.
    #[inline]
    pub(super) fn region_write(
        &mut self,
        dev: &mut dyn PciDevice,
        id: u16,
        offset: u64,
        index: u32,
        data: &[u8],
    ) -> Result<(), RequestError> {
        let r = region(dev, index)?;
        if !r.write {
            return Err(invalid("region is not writable"));
        }
        check_range(r, index, offset, data.len())?;
        tracing::trace!(region = index, offset, count = data.len(), "region write");
        dev.region_write(index, offset, data)?;
        encode_region_write_reply(&mut self.out, id, offset, index, data.len() as u32)?;
        Ok(())
    }

    /// REGION_WRITE_MULTI: the writes in order, up to the first that fails.
    #[inline]
    pub(super) fn region_write_multi(
        &mut self,
        dev: &mut dyn PciDevice,
        id: u16,
        entries: Records<'_, WriteMultiEntry>,
    ) -> Result<(), RequestError> {
        let mut done = 0u64;
        for e in entries.iter() {
            let r = region(dev, e.region)?;
            let data = e
                .data
                .get(..e.count as usize)
                .ok_or_else(|| invalid("write-multi count"))?;
            check_range(r, e.region, e.offset, data.len())?;
            dev.region_write(e.region, e.offset, data)?;
            done += 1;
        }
        Reply::RegionWriteMulti { wr_cnt: done }.encode(id, &mut self.out)?;
        Ok(())
    }

    /// DEVICE_GET_INFO.
    pub(super) fn device_get_info(
        &mut self,
        dev: &dyn PciDevice,
        id: u16,
    ) -> Result<(), RequestError> {
        let d = dev.description();
        let mut flags = VFIO_DEVICE_FLAGS_PCI;
        if d.resettable {
            flags |= VFIO_DEVICE_FLAGS_RESET;
        }
        let info = DeviceInfo {
            argsz: DeviceInfo::SIZE as u32,
            flags,
            num_regions: d.regions.len() as u32,
            num_irqs: d.irqs.len() as u32,
        };
        Reply::DeviceGetInfo(info).encode(id, &mut self.out)?;
        Ok(())
    }

    /// DEVICE_GET_REGION_INFO: the region's flags, size and capabilities, with the descriptor
    /// of its memory if the client may map it.
    pub(super) fn device_get_region_info(
        &mut self,
        dev: &dyn PciDevice,
        id: u16,
        argsz: u32,
        index: u32,
    ) -> Result<(), RequestError> {
        let d = dev.description();
        let r = d
            .regions
            .get(index as usize)
            .ok_or_else(|| invalid("no such region"))?;
        let mut info = RegionInfo {
            argsz: REGION_INFO_SIZE as u32,
            flags: 0,
            index,
            cap_offset: 0,
            size: r.size,
            offset: 0,
        };
        if r.read {
            info.flags |= VFIO_REGION_INFO_FLAG_READ;
        }
        if r.write {
            info.flags |= VFIO_REGION_INFO_FLAG_WRITE;
        }
        let mut send_fd = None;
        let mut builder = RegionCapsBuilder::new(&mut self.caps);
        if let Some(mm) = &r.mmap {
            info.flags |= VFIO_REGION_INFO_FLAG_MMAP;
            info.offset = mm.file_offset;
            if !mm.areas.is_empty() {
                let areas: Vec<SparseMmapArea> = mm
                    .areas
                    .iter()
                    .map(|a| SparseMmapArea {
                        offset: a.offset,
                        size: a.size,
                    })
                    .collect();
                builder.sparse_mmap(&areas)?;
            }
            send_fd = Some(mm.file.clone());
        }
        let fits = builder.finish_info(&mut info, argsz)?;
        // Like libvfio-user, the fd travels only with a complete reply (caps included).
        if !fits {
            send_fd = None;
        }
        let caps: &[u8] = if fits { &self.caps } else { &[] };
        Reply::DeviceGetRegionInfo { info, caps }.encode(id, &mut self.out)?;
        if let Some(f) = send_fd {
            self.out_fds
                .push(f.as_fd().try_clone_to_owned().map_err(DeviceError::Io)?);
        }
        Ok(())
    }

    /// DEVICE_GET_REGION_IO_FDS: none.
    pub(super) fn device_get_region_io_fds(
        &mut self,
        dev: &dyn PciDevice,
        id: u16,
        index: u32,
    ) -> Result<(), RequestError> {
        region(dev, index)?;
        // No region of ours has ioeventfd-capable sub-regions (QEMU does not use them).
        Reply::DeviceGetRegionIoFds {
            argsz: 16,
            index,
            count: 0,
            entries: switchyard_proto::IoFdEntries::Spec(Default::default()),
        }
        .encode(id, &mut self.out)?;
        Ok(())
    }

    /// DEVICE_RESET: ends any migration (the way out of ERROR), then resets the device.
    pub(super) fn device_reset(&mut self, slot: &mut Slot, id: u16) -> Result<(), RequestError> {
        tracing::info!("device reset");
        slot.abandon_migration(crate::MigCause::Reset);
        slot.device.reset()?;
        reply_empty(&mut self.out, id, Reply::DeviceReset)
    }
}

/// Region `index` of `dev`, if it has one (a region of size zero is absent).
fn region<D: PciDevice + ?Sized>(dev: &D, index: u32) -> Result<&RegionDesc, RequestError> {
    dev.description()
        .regions
        .get(index as usize)
        .filter(|r| r.size > 0)
        .ok_or_else(|| RequestError::Device(DeviceError::NoSuchRegion(index)))
}

/// Whether `[offset, offset + len)` lies within region `r` (index `index`).
fn check_range(r: &RegionDesc, index: u32, offset: u64, len: usize) -> Result<(), RequestError> {
    let end = offset.checked_add(len as u64);
    if end.is_none_or(|e| e > r.size) {
        return Err(DeviceError::OutOfRange {
            region: index,
            offset,
            len,
        }
        .into());
    }
    Ok(())
}
