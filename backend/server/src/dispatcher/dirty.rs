//! DMA dirty logging (DEVICE_FEATURE DMA_LOGGING_START, _STOP and _REPORT): the DMA space's
//! logs, ORed with the device's own.

use switchyard_device::DmaSpace;
use switchyard_proto::consts::*;
use switchyard_proto::{
    DmaLoggingControl, DmaLoggingReport, FeatureReply, dirty_bitmap_size,
    dma_logging_report_reply_buffer,
};

use super::{Dispatcher, feature_reply};
use crate::error::{RequestError, invalid};

impl Dispatcher {
    /// DMA_LOGGING_START: every window is logged, at the page size the DMA space picks.
    pub(super) fn dma_logging_start(
        &mut self,
        dma: &DmaSpace,
        id: u16,
        c: DmaLoggingControl<'_>,
    ) -> Result<(), RequestError> {
        // Every window is logged whatever the ranges say; still, nonsense is refused.
        if c.ranges
            .iter()
            .any(|r| r.length == 0 || r.iova.checked_add(r.length - 1).is_none())
        {
            return Err(invalid("DMA logging range is empty or wraps"));
        }
        let page_size = dma.start_logging(c.page_size)?;
        tracing::info!(
            page_size,
            ranges = c.ranges.len(),
            "DMA dirty logging started"
        );
        feature_reply(
            &mut self.out,
            id,
            FeatureReply::DmaLoggingStart(DmaLoggingControl { page_size, ..c }),
        )
    }

    /// DMA_LOGGING_STOP.
    pub(super) fn dma_logging_stop(&mut self, dma: &DmaSpace, id: u16) -> Result<(), RequestError> {
        dma.stop_logging();
        tracing::info!("DMA dirty logging stopped");
        feature_reply(&mut self.out, id, FeatureReply::DmaLoggingStop)
    }

    /// DMA_LOGGING_REPORT: the range's dirty bits, read and cleared, built in place in the
    /// reply (in the bulk buffer).
    pub(super) fn dma_logging_report(
        &mut self,
        dma: &DmaSpace,
        id: u16,
        r: &DmaLoggingReport,
    ) -> Result<(), RequestError> {
        self.use_bulk_buffer();
        // The bitmap is built in place in the reply (whose bitmap area is not zeroed:
        // `report_dirty` writes every byte of it); the decoder checked that the client's
        // argsz has room for it.
        if dirty_bitmap_size(r.length, r.page_size)? > u64::from(MAX_DATA_XFER_SIZE_LIMIT) {
            return Err(RequestError::Invalid {
                what: "DMA logging report bitmap too large for one message",
                errno: libc::E2BIG,
            });
        }
        let buf = dma_logging_report_reply_buffer(&mut self.out, id, r)?;
        dma.report_dirty(r.iova, r.length, r.page_size, buf)?;
        if self.dirty_log == crate::DirtyLog::Blind {
            // Read and cleared as usual, then withheld (fault injection; see `DirtyLog`).
            buf.fill(0);
        }
        tracing::trace!(
            iova = r.iova,
            length = r.length,
            page_size = r.page_size,
            "DMA logging report"
        );
        Ok(())
    }
}
