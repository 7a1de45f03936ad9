//! Message-based DMA: answering the server's DMA_READ/DMA_WRITE requests from guest memory.

use std::sync::{Arc, Mutex};

use switchyard_proto::{
    Header, Reply, Request, decode_request_with, dma_read_reply_buffer, encode_error_reply, errno,
};

use crate::transport::send_all;
use crate::{Client, ClientError};

/// Answers server-to-client DMA requests (message-based DMA).
///
/// Errors are errnos sent back in the error reply (e.g. `EFAULT` for an
/// unmapped address).
pub trait MessageDma: Send {
    /// Reads guest memory at `iova` into `buf`.
    fn read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), i32>;
    /// Writes `data` to guest memory at `iova`.
    fn write(&mut self, iova: u64, data: &[u8]) -> Result<(), i32>;
}

impl<T: MessageDma> MessageDma for Arc<Mutex<T>> {
    fn read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), i32> {
        self.lock().map_err(|_| errno::EIO)?.read(iova, buf)
    }
    fn write(&mut self, iova: u64, data: &[u8]) -> Result<(), i32> {
        self.lock().map_err(|_| errno::EIO)?.write(iova, data)
    }
}

/// A flat chunk of "guest memory" at `base` (for tests).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlatDma {
    /// IOVA of `mem[0]`.
    pub base: u64,
    /// The memory.
    pub mem: Vec<u8>,
}

impl FlatDma {
    /// `size` zero bytes at `base`.
    pub fn new(base: u64, size: usize) -> Self {
        FlatDma {
            base,
            mem: vec![0; size],
        }
    }

    fn range(&self, iova: u64, len: usize) -> Result<std::ops::Range<usize>, i32> {
        let start = iova.checked_sub(self.base).ok_or(errno::EFAULT)?;
        let start = usize::try_from(start).map_err(|_| errno::EFAULT)?;
        let end = start.checked_add(len).ok_or(errno::EFAULT)?;
        if end > self.mem.len() {
            return Err(errno::EFAULT);
        }
        Ok(start..end)
    }
}

impl MessageDma for FlatDma {
    fn read(&mut self, iova: u64, buf: &mut [u8]) -> Result<(), i32> {
        let r = self.range(iova, buf.len())?;
        buf.copy_from_slice(self.mem.get(r).ok_or(errno::EFAULT)?);
        Ok(())
    }
    fn write(&mut self, iova: u64, data: &[u8]) -> Result<(), i32> {
        let r = self.range(iova, data.len())?;
        self.mem
            .get_mut(r)
            .ok_or(errno::EFAULT)?
            .copy_from_slice(data);
        Ok(())
    }
}

impl Client {
    /// Answers a server-to-client request whose body is in `self.rx`.
    pub(crate) fn serve_request(&mut self, hdr: &Header, nfds: usize) -> crate::Result<()> {
        // Field borrows (not `self.body()`): the DMA handler is borrowed mutably below.
        let body = self.rx.get(self.rx_start..).unwrap_or_default();
        let result = decode_request_with(hdr, body, nfds, &self.limits);
        let no_reply = hdr.no_reply();
        match result {
            Ok(Request::DmaRead { address, count }) => {
                tracing::trace!(address, count, "serving DMA_READ");
                match dma_read_reply_buffer(&mut self.dma_out, hdr.msg_id, address, count) {
                    Ok(buf) => {
                        let r = match self.dma.as_mut() {
                            Some(d) => d.read(address, buf),
                            None => Err(errno::EFAULT),
                        };
                        if let Err(e) = r {
                            encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e);
                        }
                    }
                    Err(e) => encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e.errno()),
                }
            }
            Ok(Request::DmaWrite { address, data }) => {
                tracing::trace!(address, count = data.len(), "serving DMA_WRITE");
                let r = match self.dma.as_mut() {
                    Some(d) => d.write(address, data),
                    None => Err(errno::EFAULT),
                };
                match r {
                    Ok(()) => Reply::DmaWrite {
                        address,
                        count: data.len() as u64,
                    }
                    .encode(hdr.msg_id, &mut self.dma_out)
                    .map_err(ClientError::Protocol)?,
                    Err(e) => encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e),
                }
            }
            Ok(other) => {
                // Unreachable with Limits::client, but answer defensively.
                tracing::debug!(cmd = ?other.command(), "unexpected server request");
                encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, errno::EINVAL);
            }
            Err(e) => {
                tracing::debug!(error = %e, "malformed server request");
                encode_error_reply(&mut self.dma_out, hdr.msg_id, hdr.cmd, e.errno());
            }
        }
        self.dma_requests_served = self.dma_requests_served.wrapping_add(1);
        if no_reply {
            return Ok(());
        }
        send_all(&self.sock, &self.dma_out, &[])
    }
}
