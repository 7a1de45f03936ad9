//! Device, region and interrupt information, SET_IRQS and DEVICE_RESET.

use std::fs::File;
use std::os::fd::BorrowedFd;

use switchyard_proto::consts::*;
use switchyard_proto::{
    Command, DeviceInfo, IoFdEntries, IoFdEntry, IoFdShadowEntry, IrqInfo, IrqSet, MessageWriter,
    RegionInfo, RegionTypeCap, Reply, Request, SparseMmapArea, region_caps,
};

use crate::error::unexpected;
use crate::{Client, ClientError, Result};

/// A region description from DEVICE_GET_REGION_INFO.
#[derive(Debug)]
pub struct RegionDescription {
    /// The region info as replied (argsz is the size needed for all caps).
    pub info: RegionInfo,
    /// Sparse mmap areas, if the region has a `SPARSE_MMAP` capability.
    pub sparse_areas: Option<Vec<SparseMmapArea>>,
    /// Region type capability, if any.
    pub region_type: Option<RegionTypeCap>,
    /// Whether an `MSIX_MAPPABLE` capability is present.
    pub msix_mappable: bool,
    /// Raw capability bytes (following the 32-byte info).
    pub caps: Vec<u8>,
    /// The first fd passed with the reply (the region's mmap fd).
    pub fd: Option<File>,
    /// Any further fds.
    pub extra_fds: Vec<File>,
}

/// A GET_REGION_IO_FDS reply.
#[derive(Debug)]
pub struct RegionIoFdsReply {
    /// Size needed for the full reply.
    pub argsz: u32,
    /// Number of sub-regions.
    pub count: u32,
    /// Spec-layout (40-byte) entries.
    pub entries: Vec<IoFdEntry>,
    /// libvfio-user-layout (48-byte) entries.
    pub shadow_entries: Vec<IoFdShadowEntry>,
    /// The fds, indexed by `fd_index`.
    pub fds: Vec<File>,
}

impl Client {
    /// DEVICE_GET_INFO.
    pub fn device_info(&mut self) -> Result<DeviceInfo> {
        match self.request(
            &Request::DeviceGetInfo {
                argsz: DeviceInfo::SIZE as u32,
            },
            &[],
        )? {
            (Reply::DeviceGetInfo(i), _) => Ok(i),
            _ => Err(unexpected("DEVICE_GET_INFO")),
        }
    }

    /// DEVICE_GET_REGION_INFO, retrying with a larger argsz when the server
    /// says (through `argsz`, like QEMU reads it) that the capabilities need more room.
    pub fn region_info(&mut self, index: u32) -> Result<RegionDescription> {
        let (mut info, mut caps, mut fds) = self.region_info_raw(index, REGION_INFO_SIZE as u32)?;
        if caps.is_empty() && info.argsz as usize > REGION_INFO_SIZE {
            (info, caps, fds) = self.region_info_raw(index, info.argsz)?;
        }
        let mut sparse_areas = None;
        let mut region_type = None;
        let mut msix_mappable = false;
        for cap in region_caps(&info, &caps) {
            let cap = cap.map_err(ClientError::Protocol)?;
            if let Some(a) = cap.sparse_mmap_areas().map_err(ClientError::Protocol)? {
                sparse_areas = Some(a.iter().collect());
            }
            if let Some(t) = cap.region_type().map_err(ClientError::Protocol)? {
                region_type = Some(t);
            }
            msix_mappable |= cap.header.id == VFIO_REGION_INFO_CAP_MSIX_MAPPABLE;
        }
        let mut it = fds.into_iter();
        let fd = it.next();
        Ok(RegionDescription {
            info,
            sparse_areas,
            region_type,
            msix_mappable,
            caps,
            fd,
            extra_fds: it.collect(),
        })
    }

    /// DEVICE_GET_REGION_INFO with an explicit argsz: `(info, caps bytes, fds)`.
    pub fn region_info_raw(
        &mut self,
        index: u32,
        argsz: u32,
    ) -> Result<(RegionInfo, Vec<u8>, Vec<File>)> {
        let (hdr, fds) = self.call(&Request::DeviceGetRegionInfo { argsz, index }, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::DeviceGetRegionInfo { info, caps } => {
                if info.index != index {
                    return Err(ClientError::UnexpectedReply(format!(
                        "region info for {} instead of {index}",
                        info.index
                    )));
                }
                Ok((info, caps.to_vec(), fds))
            }
            _ => Err(unexpected("DEVICE_GET_REGION_INFO")),
        }
    }

    /// DEVICE_GET_REGION_IO_FDS with the given reply buffer size.
    pub fn get_region_io_fds(&mut self, index: u32, argsz: u32) -> Result<RegionIoFdsReply> {
        let (hdr, fds) = self.call(&Request::DeviceGetRegionIoFds { argsz, index }, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::DeviceGetRegionIoFds {
                argsz,
                count,
                entries,
                ..
            } => {
                let (entries, shadow_entries) = match entries {
                    IoFdEntries::Spec(r) => (r.iter().collect(), Vec::new()),
                    IoFdEntries::LibvfioUser(r) => (Vec::new(), r.iter().collect()),
                };
                Ok(RegionIoFdsReply {
                    argsz,
                    count,
                    entries,
                    shadow_entries,
                    fds,
                })
            }
            _ => Err(unexpected("DEVICE_GET_REGION_IO_FDS")),
        }
    }

    /// DEVICE_GET_IRQ_INFO.
    pub fn irq_info(&mut self, index: u32) -> Result<IrqInfo> {
        match self.request(
            &Request::DeviceGetIrqInfo {
                argsz: IrqInfo::SIZE as u32,
                index,
            },
            &[],
        )? {
            (Reply::DeviceGetIrqInfo(i), _) if i.index == index => Ok(i),
            _ => Err(unexpected("DEVICE_GET_IRQ_INFO")),
        }
    }

    /// DEVICE_SET_IRQS with raw `flags` (sent as given, so tests can send
    /// invalid combinations). Eventfds travel as SCM_RIGHTS. For
    /// `VFIO_IRQ_SET_DATA_BOOL` use [`Client::set_irqs_bool`].
    pub fn set_irqs(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        fds: &[BorrowedFd<'_>],
    ) -> Result<()> {
        self.set_irqs_with_data(index, flags, start, count, &[], fds)
    }

    /// DEVICE_SET_IRQS with `DATA_BOOL` and the given action flag.
    pub fn set_irqs_bool(
        &mut self,
        index: u32,
        action: u32,
        start: u32,
        values: &[bool],
    ) -> Result<()> {
        let bools: Vec<u8> = values.iter().map(|b| u8::from(*b)).collect();
        let count = u32::try_from(values.len())
            .map_err(|_| ClientError::InvalidArgument("too many vectors"))?;
        self.set_irqs_with_data(
            index,
            action | VFIO_IRQ_SET_DATA_BOOL,
            start,
            count,
            &bools,
            &[],
        )
    }

    fn set_irqs_with_data(
        &mut self,
        index: u32,
        flags: u32,
        start: u32,
        count: u32,
        data: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<()> {
        let id = self.alloc_id();
        let argsz = u32::try_from(IrqSet::SIZE + data.len())
            .map_err(|_| ClientError::InvalidArgument("too much data"))?;
        let mut w = MessageWriter::command(&mut self.out, id, Command::DeviceSetIrqs, false);
        w.put(&IrqSet {
            argsz,
            flags,
            index,
            start,
            count,
        });
        w.put_bytes(data);
        w.finish().map_err(ClientError::Protocol)?;
        let (hdr, _) = self.transact(id, Command::DeviceSetIrqs, fds)?;
        self.expect_reply(&hdr, 0, |r| matches!(r, Reply::DeviceSetIrqs))
    }

    /// DEVICE_RESET.
    pub fn device_reset(&mut self) -> Result<()> {
        match self.request(&Request::DeviceReset, &[])? {
            (Reply::DeviceReset, _) => Ok(()),
            _ => Err(unexpected("DEVICE_RESET")),
        }
    }
}
