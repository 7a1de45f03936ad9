//! Memory mapped into a VFIO IOMMU domain, and VFIO descriptors.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use vfio_ioctls::{VfioDevice, VfioError, VfioOps};
use vm_memory::mmap::MmapRegion;

/// Errors of this crate.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The memory is not owned by its `MmapRegion` (built with `build_raw`): someone else could
    /// unmap it while the device still reaches it.
    #[error("Refusing to map borrowed memory at IOVA {iova:#x}: the region must own its mapping")]
    BorrowedMemory {
        /// The IOVA asked for.
        iova: u64,
    },
    /// `VFIO_IOMMU_MAP_DMA` failed; nothing is mapped.
    #[error("VFIO_IOMMU_MAP_DMA of {size:#x} bytes at IOVA {iova:#x} failed")]
    Map {
        /// IOVA of the first byte.
        iova: u64,
        /// Length in bytes.
        size: usize,
        /// What VFIO said.
        #[source]
        source: VfioError,
    },
    /// `VFIO_IOMMU_UNMAP_DMA` failed; the memory was leaked so that the device can never reach
    /// freed memory.
    #[error(
        "VFIO_IOMMU_UNMAP_DMA of {size:#x} bytes at IOVA {iova:#x} failed; the memory is leaked"
    )]
    Unmap {
        /// IOVA of the first byte.
        iova: u64,
        /// Length in bytes.
        size: usize,
        /// What VFIO said.
        #[source]
        source: VfioError,
    },
    /// `dup` of a VFIO descriptor failed.
    #[error("Duplicating the VFIO device descriptor failed")]
    Dup(#[source] io::Error),
}

/// Memory mapped read/write at an IOVA of a VFIO IOMMU domain, owned together with the mapping.
///
/// The device can read and write the memory from [`DmaMapping::new`] until the mapping is
/// removed ([`DmaMapping::unmap`] or drop), and the memory is released only after that, or
/// never if the unmap fails. Access it through [`DmaMapping::memory`], whose accessors are all
/// volatile.
pub struct DmaMapping {
    iommu: Arc<dyn VfioOps>,
    iova: u64,
    size: usize,
    /// `None` only after `unmap` moved it out.
    memory: Option<MmapRegion<()>>,
}

impl fmt::Debug for DmaMapping {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaMapping")
            .field("iova", &format_args!("{:#x}", self.iova))
            .field("size", &format_args!("{:#x}", self.size))
            .finish_non_exhaustive()
    }
}

impl DmaMapping {
    /// Maps all of `memory` at `iova` in `iommu` (`VFIO_IOMMU_MAP_DMA`, read and write) and
    /// takes ownership of both. The region must own its mapping (anonymous memory from
    /// `MmapRegion::new`, or a file mapped with `MmapRegion::from_file`/`build`).
    ///
    /// On failure nothing is mapped and the memory is released.
    pub fn new(
        iommu: Arc<dyn VfioOps>,
        iova: u64,
        memory: MmapRegion<()>,
    ) -> Result<DmaMapping, Error> {
        if !memory.owned() {
            return Err(Error::BorrowedMemory { iova });
        }
        let size = memory.size();
        // SAFETY: `VFIO_IOMMU_MAP_DMA` requires that `[as_ptr, as_ptr + size)` stays mapped in
        // this process until the IOMMU mapping is removed. The region owns that range (checked
        // above: it unmaps it only when dropped) and `self` owns the region; `Drop` and
        // `unmap` remove the IOMMU mapping before the region can be dropped, and leak the region
        // if that fails. `iommu` is kept alive by `self`, so the container cannot be closed
        // under the mapping by us either. The CPU reaches the memory only through the region's
        // volatile accessors, so concurrent device writes are not data races on Rust
        // references.
        unsafe { iommu.vfio_dma_map(iova, size, memory.as_ptr()) }
            .map_err(|source| Error::Map { iova, size, source })?;
        Ok(DmaMapping {
            iommu,
            iova,
            size,
            memory: Some(memory),
        })
    }

    /// IOVA of the first byte.
    pub fn iova(&self) -> u64 {
        self.iova
    }

    /// Length in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The memory, for volatile access (the device may write it at any time).
    pub fn memory(&self) -> &MmapRegion<()> {
        // Invariant: `memory` is `Some` until `unmap` or `drop` consume `self`.
        match &self.memory {
            Some(m) => m,
            None => unreachable!("a DmaMapping's memory is only taken when it is consumed"),
        }
    }

    /// Removes the IOMMU mapping and gives the memory back. If the unmap fails, the memory is
    /// leaked (the device may still reach it) and the error says so.
    pub fn unmap(mut self) -> Result<MmapRegion<()>, Error> {
        self.release()
    }

    fn release(&mut self) -> Result<MmapRegion<()>, Error> {
        let Some(memory) = self.memory.take() else {
            unreachable!("a DmaMapping is released once");
        };
        match self.iommu.vfio_dma_unmap(self.iova, self.size) {
            Ok(()) => Ok(memory),
            Err(source) => {
                std::mem::forget(memory);
                Err(Error::Unmap {
                    iova: self.iova,
                    size: self.size,
                    source,
                })
            }
        }
    }
}

impl Drop for DmaMapping {
    fn drop(&mut self) {
        if self.memory.is_some() {
            // An error has nobody to go to; the memory is leaked, which is what keeps it safe.
            let _ = self.release();
        }
    }
}

/// An owned duplicate of `device`'s descriptor (close-on-exec), e.g. for `FileExt` reads and
/// writes of its regions.
pub fn dup_device_fd(device: &VfioDevice) -> Result<File, Error> {
    // SAFETY: the descriptor is owned by `device`, which outlives this borrow; it is only
    // borrowed to duplicate it, never closed through the borrow.
    let borrowed = unsafe { BorrowedFd::borrow_raw(device.as_raw_fd()) };
    borrowed
        .try_clone_to_owned()
        .map(File::from)
        .map_err(Error::Dup)
}

#[cfg(test)]
mod tests;
