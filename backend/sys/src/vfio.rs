//! Memory mapped into a VFIO IOMMU domain, and VFIO descriptors.

use std::fmt;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Arc;

use vfio_bindings::bindings::vfio::{
    VFIO_DMA_MAP_FLAG_READ, VFIO_IRQ_SET_ACTION_TRIGGER, VFIO_IRQ_SET_DATA_EVENTFD,
    VFIO_IRQ_SET_DATA_NONE, vfio_iommu_type1_dma_map,
};
use vfio_ioctls::{VfioContainer, VfioDevice, VfioError, VfioOps};
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
    /// `VFIO_IOMMU_MAP_DMA` of a read-only mapping failed; nothing is mapped.
    #[error("Read-only VFIO_IOMMU_MAP_DMA of {size:#x} bytes at IOVA {iova:#x} failed")]
    MapReadOnly {
        /// IOVA of the first byte.
        iova: u64,
        /// Length in bytes.
        size: usize,
        /// What the kernel said.
        #[source]
        source: io::Error,
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

    /// Maps all of `memory` at `iova` in `container` for the device to **read only**
    /// (`VFIO_IOMMU_MAP_DMA` with `VFIO_DMA_MAP_FLAG_READ`), e.g. memory the client offers
    /// read-only, which may be mapped `PROT_READ` here: the kernel pins it without asking for
    /// write access. Owned and unmapped exactly as [`DmaMapping::new`]'s (`vfio-ioctls` only
    /// maps read/write, hence the ioctl here).
    pub fn new_read_only(
        container: Arc<VfioContainer>,
        iova: u64,
        memory: MmapRegion<()>,
    ) -> Result<DmaMapping, Error> {
        if !memory.owned() {
            return Err(Error::BorrowedMemory { iova });
        }
        let size = memory.size();
        let map = vfio_iommu_type1_dma_map {
            argsz: std::mem::size_of::<vfio_iommu_type1_dma_map>() as u32,
            flags: VFIO_DMA_MAP_FLAG_READ,
            vaddr: memory.as_ptr() as u64,
            iova,
            size: size as u64,
        };
        // SAFETY: the descriptor is `container`'s, open for the duration of the call; `map` is a
        // complete `vfio_iommu_type1_dma_map` that the kernel only reads. The mapping lets the
        // device read `[vaddr, vaddr + size)`, which must stay mapped in this process until the
        // IOMMU mapping is removed: the region owns that range (checked above) and `self` owns
        // the region, `Drop` and `unmap` remove the IOMMU mapping first and leak the region if
        // that fails, and `self` keeps the container alive. The device cannot write the memory,
        // and the CPU reaches it only through the region's volatile accessors.
        let ret = unsafe {
            libc::ioctl(
                container.as_raw_fd(),
                nr::VFIO_IOMMU_MAP_DMA() as _,
                &map as *const vfio_iommu_type1_dma_map,
            )
        };
        if ret < 0 {
            return Err(Error::MapReadOnly {
                iova,
                size,
                source: io::Error::last_os_error(),
            });
        }
        Ok(DmaMapping {
            iommu: container,
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

/// The request numbers of the ioctls this crate issues itself, as `linux/vfio.h` defines them
/// (`_IO(VFIO_TYPE, VFIO_BASE + n)`), made by `vmm-sys-util`'s `_IO` (`ioctl_io_nr!`) from the
/// bindings' `VFIO_TYPE` and `VFIO_BASE`; a test pins each against the header's value.
mod nr {
    use vfio_bindings::bindings::vfio::{VFIO_BASE, VFIO_TYPE};

    // `VFIO_DEVICE_SET_IRQS`: `_IO(VFIO_TYPE, VFIO_BASE + 10)`.
    vmm_sys_util::ioctl_io_nr!(VFIO_DEVICE_SET_IRQS, VFIO_TYPE.into(), VFIO_BASE + 10);
    // `VFIO_DEVICE_RESET`: `_IO(VFIO_TYPE, VFIO_BASE + 11)`.
    vmm_sys_util::ioctl_io_nr!(VFIO_DEVICE_RESET, VFIO_TYPE.into(), VFIO_BASE + 11);
    // `VFIO_IOMMU_MAP_DMA`: `_IO(VFIO_TYPE, VFIO_BASE + 13)`.
    vmm_sys_util::ioctl_io_nr!(VFIO_IOMMU_MAP_DMA, VFIO_TYPE.into(), VFIO_BASE + 13);
}

/// Hands eventfds to the vectors `start..start + fds.len()` of interrupt `index` of `device`
/// (`VFIO_DEVICE_SET_IRQS`, `DATA_EVENTFD | ACTION_TRIGGER`): the kernel signals them itself
/// when the device raises the vector. `None` detaches a vector (the kernel's `-1`). With MSI
/// and MSI-X, the first call enables the index with `start + fds.len()` vectors; later calls
/// within that count change single vectors.
///
/// `vfio-ioctls` only offers whole-index `enable_irq` calls that start at vector 0 and take
/// `EventFd`s, so a client's partial `SET_IRQS` could not be passed through as it is.
pub fn set_irq_eventfds(
    device: &VfioDevice,
    index: u32,
    start: u32,
    fds: &[Option<BorrowedFd<'_>>],
) -> io::Result<()> {
    irq_set(
        device,
        VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
        index,
        start,
        fds.iter().map(|f| f.map_or(-1, |f| f.as_raw_fd())),
    )
}

/// Disables interrupt `index` of `device` (`SET_IRQS` `DATA_NONE | ACTION_TRIGGER`, count 0):
/// every vector's eventfd is released by the kernel and MSI/MSI-X is turned off in the device.
pub fn disable_irq(device: &VfioDevice, index: u32) -> io::Result<()> {
    irq_set(
        device,
        VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
        index,
        0,
        std::iter::empty(),
    )
}

fn irq_set(
    device: &VfioDevice,
    flags: u32,
    index: u32,
    start: u32,
    fds: impl ExactSizeIterator<Item = i32>,
) -> io::Result<()> {
    // struct vfio_irq_set { argsz, flags, index, start, count; u8 data[] }: five u32 words and
    // then, for DATA_EVENTFD, one s32 per vector. Built as u32 words so it is aligned.
    let count = u32::try_from(fds.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    let mut words: Vec<u32> = Vec::with_capacity(5 + fds.len());
    let argsz = u32::try_from((5 + fds.len()) * 4)
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    words.extend([argsz, flags, index, start, count]);
    words.extend(fds.map(|fd| fd as u32));
    // SAFETY: the descriptor is `device`'s, open for the duration of the call. The argument is
    // a `vfio_irq_set` header followed by `count` 32-bit descriptors, exactly `argsz` bytes,
    // all initialized and owned by `words`, which outlives the call; the kernel only reads it.
    // The eventfds named in it are borrowed by the caller for the duration of the call (the
    // kernel takes its own references).
    let ret = unsafe {
        libc::ioctl(
            device.as_raw_fd(),
            nr::VFIO_DEVICE_SET_IRQS() as _,
            words.as_ptr(),
        )
    };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Resets `device` (`VFIO_DEVICE_RESET`); the kernel restores the config space it saved when
/// the device was opened. Unlike `VfioDevice::reset`, the error is reported.
pub fn reset_device(device: &VfioDevice) -> io::Result<()> {
    // SAFETY: the descriptor is `device`'s, open for the duration of the call; the request
    // takes no argument.
    let ret = unsafe { libc::ioctl(device.as_raw_fd(), nr::VFIO_DEVICE_RESET() as _) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
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
