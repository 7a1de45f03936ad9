//! DEVICE_FEATURE (migration flags and state, DMA dirty logging) and MIG_DATA_READ/WRITE.

use switchyard_proto::{
    Command, DeviceFeatureHeader, DeviceFeatureReply, DmaLoggingControl, DmaLoggingRange,
    DmaLoggingReport, FeatureReply, FeatureRequest, MessageWriter, MigDeviceState, Records, Reply,
    Request,
};
use zerocopy::FromBytes;

use crate::error::unexpected;
use crate::{Client, ClientError, Result};

impl Client {
    /// DEVICE_FEATURE, raw: sends `{argsz, flags}` + `data` and returns the
    /// reply's `{argsz, flags}` and data.
    pub fn device_feature(
        &mut self,
        argsz: u32,
        flags: u32,
        data: &[u8],
    ) -> Result<(DeviceFeatureHeader, Vec<u8>)> {
        let id = self.alloc_id();
        let mut w = MessageWriter::command(&mut self.out, id, Command::DeviceFeature, false);
        w.put(&DeviceFeatureHeader { argsz, flags });
        w.put_bytes(data);
        w.finish().map_err(ClientError::Protocol)?;
        let (_, fds) = self.transact(id, Command::DeviceFeature, &[])?;
        if !fds.is_empty() {
            return Err(unexpected("DEVICE_FEATURE (fds)"));
        }
        let (h, rest) = DeviceFeatureHeader::read_from_prefix(self.body())
            .map_err(|_| unexpected("DEVICE_FEATURE"))?;
        Ok((h, rest.to_vec()))
    }

    fn feature(&mut self, argsz: u32, op: FeatureRequest<'_>) -> Result<FeatureReplyOwned> {
        let req = Request::DeviceFeature(switchyard_proto::DeviceFeatureRequest { argsz, op });
        let (hdr, fds) = self.call(&req, &[])?;
        let reply = self.decode(&hdr, fds.len())?;
        let Reply::DeviceFeature(f) = reply else {
            return Err(unexpected("DEVICE_FEATURE"));
        };
        Ok(match f.op {
            FeatureReply::Probe { .. } => FeatureReplyOwned::Probe,
            FeatureReply::GetMigration(m) => FeatureReplyOwned::Migration(m.flags),
            FeatureReply::GetMigDeviceState(s) | FeatureReply::SetMigDeviceState(s) => {
                FeatureReplyOwned::State(s.device_state)
            }
            FeatureReply::DmaLoggingStart(c) => FeatureReplyOwned::PageSize(c.page_size),
            FeatureReply::DmaLoggingStop => FeatureReplyOwned::Probe,
            FeatureReply::DmaLoggingReport { .. } | FeatureReply::Other { .. } => {
                FeatureReplyOwned::Other
            }
        })
    }

    /// DEVICE_FEATURE PROBE for `feature` with the GET and/or SET bits.
    pub fn feature_probe(&mut self, feature: u16, get: bool, set: bool) -> Result<()> {
        self.feature(8, FeatureRequest::Probe { feature, get, set })
            .map(|_| ())
    }

    /// GET `VFIO_DEVICE_FEATURE_MIGRATION`: the `VFIO_MIGRATION_*` flags.
    pub fn migration_flags(&mut self) -> Result<u64> {
        match self.feature(16, FeatureRequest::GetMigration)? {
            FeatureReplyOwned::Migration(f) => Ok(f),
            _ => Err(unexpected("DEVICE_FEATURE MIGRATION")),
        }
    }

    /// GET `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE`.
    pub fn mig_state(&mut self) -> Result<u32> {
        match self.feature(16, FeatureRequest::GetMigDeviceState)? {
            FeatureReplyOwned::State(s) => Ok(s),
            _ => Err(unexpected("DEVICE_FEATURE MIG_DEVICE_STATE")),
        }
    }

    /// SET `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE`; returns the state echoed.
    pub fn set_mig_state(&mut self, state: u32) -> Result<u32> {
        let s = MigDeviceState {
            device_state: state,
            data_fd: u32::MAX,
        };
        match self.feature(16, FeatureRequest::SetMigDeviceState(s))? {
            FeatureReplyOwned::State(s) => Ok(s),
            _ => Err(unexpected("DEVICE_FEATURE MIG_DEVICE_STATE")),
        }
    }

    /// SET `DMA_LOGGING_START`; returns the page size the device chose.
    pub fn dma_logging_start(&mut self, page_size: u64, ranges: &[DmaLoggingRange]) -> Result<u64> {
        let c = DmaLoggingControl {
            page_size,
            ranges: Records::from_slice(ranges),
        };
        let argsz = u32::try_from(8 + c.encoded_len())
            .map_err(|_| ClientError::InvalidArgument("too many ranges"))?;
        match self.feature(argsz, FeatureRequest::DmaLoggingStart(c))? {
            FeatureReplyOwned::PageSize(p) => Ok(p),
            _ => Err(unexpected("DEVICE_FEATURE DMA_LOGGING_START")),
        }
    }

    /// SET `DMA_LOGGING_STOP`.
    pub fn dma_logging_stop(&mut self) -> Result<()> {
        self.feature(8, FeatureRequest::DmaLoggingStop).map(|_| ())
    }

    /// GET `DMA_LOGGING_REPORT` (read-and-clear): the bitmap bytes, one bit per page.
    pub fn dma_logging_report(
        &mut self,
        iova: u64,
        length: u64,
        page_size: u64,
    ) -> Result<Vec<u8>> {
        self.dma_logging_report_ref(iova, length, page_size)
            .map(<[u8]>::to_vec)
    }

    /// [`Client::dma_logging_report`] without a copy: the bitmap is borrowed from the
    /// receive buffer (valid until the next call), for a VMM that folds it into its own.
    pub fn dma_logging_report_ref(
        &mut self,
        iova: u64,
        length: u64,
        page_size: u64,
    ) -> Result<&[u8]> {
        let bsize = switchyard_proto::dirty_bitmap_size(length, page_size)
            .map_err(ClientError::Protocol)?;
        let argsz = u32::try_from(bsize + 32)
            .map_err(|_| ClientError::InvalidArgument("bitmap too large"))?;
        let r = DmaLoggingReport {
            iova,
            length,
            page_size,
        };
        let op = FeatureRequest::DmaLoggingReport(r);
        let req = Request::DeviceFeature(switchyard_proto::DeviceFeatureRequest { argsz, op });
        let (hdr, fds) = self.call(&req, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::DeviceFeature(DeviceFeatureReply {
                op: FeatureReply::DmaLoggingReport { report, bitmap },
                ..
            }) if report == r => Ok(bitmap),
            _ => Err(unexpected("DEVICE_FEATURE DMA_LOGGING_REPORT")),
        }
    }

    /// MIG_DATA_READ of up to `max` bytes (fewer = end of data).
    pub fn mig_data_read(&mut self, max: u32) -> Result<Vec<u8>> {
        self.mig_data_read_ref(max).map(<[u8]>::to_vec)
    }

    /// [`Client::mig_data_read`] without a copy: the data is borrowed from the receive buffer
    /// (valid until the next call), for a VMM that forwards it into its migration stream.
    pub fn mig_data_read_ref(&mut self, max: u32) -> Result<&[u8]> {
        let argsz = max
            .checked_add(8)
            .ok_or(ClientError::InvalidArgument("size too large"))?;
        let (hdr, fds) = self.call(&Request::MigDataRead { argsz, size: max }, &[])?;
        match self.decode(&hdr, fds.len())? {
            Reply::MigDataRead { data, .. } if data.len() <= max as usize => Ok(data),
            Reply::MigDataRead { .. } => Err(unexpected("MIG_DATA_READ (too much data)")),
            _ => Err(unexpected("MIG_DATA_READ")),
        }
    }

    /// MIG_DATA_WRITE.
    pub fn mig_data_write(&mut self, data: &[u8]) -> Result<()> {
        let argsz = u32::try_from(data.len() + 8)
            .map_err(|_| ClientError::InvalidArgument("data too large"))?;
        match self.request(&Request::MigDataWrite { argsz, data }, &[])? {
            (Reply::MigDataWrite(_), _) => Ok(()),
            _ => Err(unexpected("MIG_DATA_WRITE")),
        }
    }
}

enum FeatureReplyOwned {
    Probe,
    Migration(u64),
    State(u32),
    PageSize(u64),
    /// A report or an unmodelled feature's data (answered by dedicated paths).
    Other,
}
