//! Guest-memory access used to answer server DMA_READ/DMA_WRITE.

use std::sync::{Arc, Mutex};

use switchyard_proto::errno;

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
