//! The client's DMA windows in the device's IOMMU, and the dirty pages they report.

use std::collections::BTreeMap;
use std::fs::File;
use std::sync::{Arc, Mutex};

use switchyard_device::{DeviceError, DirtySource, DmaObserver, DmaProt};
use switchyard_sys::DmaMapping;
use vfio_ioctls::{VfioContainer, VfioOps};
use vm_memory::FileOffset;
use vm_memory::mmap::{MmapRegion, MmapRegionBuilder};

/// The IOMMU page size we map at (type1 on x86: 4 KiB).
const IOMMU_PAGE: u64 = 4096;

/// The device's IOMMU, as the client's DMA windows see it: every window with a descriptor is
/// mapped at IOVA = the client's DMA address (read/write, or read-only for a window the device
/// may only read), until it is unmapped. Also the
/// device's [`DirtySource`]: it cannot track its writes, so every page it can reach is
/// reported dirty.
pub struct Iommu {
    container: Arc<VfioContainer>,
    maps: Mutex<BTreeMap<u64, DmaMapping>>,
}

impl std::fmt::Debug for Iommu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        f.debug_struct("Iommu")
            .field("windows", &maps.len())
            .finish_non_exhaustive()
    }
}

fn refuse(errno: i32) -> DeviceError {
    DeviceError::Io(std::io::Error::from_raw_os_error(errno))
}

impl Iommu {
    /// The IOMMU of `container` (a type1v2 VFIO container the device's group is in).
    pub fn new(container: Arc<VfioContainer>) -> Iommu {
        Iommu {
            container,
            maps: Mutex::new(BTreeMap::new()),
        }
    }

    /// The windows mapped now: (IOVA, size).
    pub fn windows(&self) -> Vec<(u64, u64)> {
        let maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        maps.values().map(|m| (m.iova(), m.size() as u64)).collect()
    }

    /// Removes every mapping (the device is going away).
    pub fn clear(&self) {
        let maps = std::mem::take(&mut *self.maps.lock().unwrap_or_else(|p| p.into_inner()));
        for (_, m) in maps {
            unmap_logged(m);
        }
    }
}

fn unmap_logged(m: DmaMapping) {
    let (iova, size) = (m.iova(), m.size());
    match m.unmap() {
        Ok(_memory) => tracing::debug!(iova, size, "DMA window unmapped from the IOMMU"),
        Err(e) => {
            tracing::error!(iova, size, error = %e, "IOMMU unmap failed; the memory is leaked")
        }
    }
}

impl DmaObserver for Iommu {
    fn mapping(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        file: Option<(&File, u64)>,
    ) -> Result<(), DeviceError> {
        let Some((file, offset)) = file else {
            tracing::warn!(
                iova,
                size,
                "DMA_MAP without a file descriptor refused: a physical device can only reach memory mapped into its IOMMU"
            );
            return Err(DeviceError::Unsupported);
        };
        if !prot.read && !prot.write {
            tracing::warn!(
                iova,
                size,
                "DMA_MAP with neither read nor write access refused"
            );
            return Err(refuse(libc::EINVAL));
        }
        if !iova.is_multiple_of(IOMMU_PAGE)
            || !size.is_multiple_of(IOMMU_PAGE)
            || !offset.is_multiple_of(IOMMU_PAGE)
            || size == 0
        {
            tracing::warn!(
                iova,
                size,
                offset,
                "DMA_MAP not aligned to the IOMMU page refused"
            );
            return Err(refuse(libc::EINVAL));
        }
        let len = usize::try_from(size).map_err(|_| refuse(libc::EINVAL))?;
        let file = file.try_clone().map_err(DeviceError::Io)?;
        // Our own shared mapping of the client's memory object: owned by the DmaMapping, so it
        // outlives the IOMMU mapping whatever the server does with its own. A window the
        // device may only read is mapped read-only here too (its file may be read-only) and
        // read-only in the IOMMU.
        let mmap_prot = if prot.write {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        };
        let memory: MmapRegion<()> = MmapRegionBuilder::new(len)
            .with_file_offset(FileOffset::new(file, offset))
            .with_mmap_prot(mmap_prot)
            .with_mmap_flags(libc::MAP_SHARED)
            .build()
            .map_err(|e| DeviceError::Failed(Box::new(e)))?;
        let mapped = if prot.write {
            let ops: Arc<dyn VfioOps> = Arc::clone(&self.container) as Arc<dyn VfioOps>;
            DmaMapping::new(ops, iova, memory)
        } else {
            DmaMapping::new_read_only(Arc::clone(&self.container), iova, memory)
        };
        let mapping = mapped.map_err(|e| {
            tracing::warn!(
                iova,
                size,
                error = %e,
                "IOMMU map failed (ENOMEM: is RLIMIT_MEMLOCK below the pinned DMA memory?)"
            );
            DeviceError::Failed(Box::new(e))
        })?;
        tracing::debug!(
            iova,
            size,
            write = prot.write,
            "DMA window mapped into the IOMMU"
        );
        self.maps
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(iova, mapping);
        Ok(())
    }

    fn unmapped(&self, iova: u64, size: u64) {
        let end = iova.saturating_add(size);
        let gone: Vec<DmaMapping> = {
            let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
            let keys: Vec<u64> = maps.range(iova..end).map(|(k, _)| *k).collect();
            keys.iter().filter_map(|k| maps.remove(k)).collect()
        };
        for m in gone {
            unmap_logged(m);
        }
    }
}

/// Sets bit `k` of a report laid out as host-order 64-bit words (word k/64, bit k%64).
fn set_bit(out: &mut [u8], k: u64) {
    let word = (k / 64) as usize * 8;
    if let Some(w) = out.get_mut(word..word + 8) {
        let mut v = u64::from_ne_bytes([w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7]]);
        v |= 1 << (k % 64);
        w.copy_from_slice(&v.to_ne_bytes());
    }
}

/// Marks dirty every page of `[iova, iova+len)` that one of `windows` covers.
pub(crate) fn report_all_dirty(
    windows: impl Iterator<Item = (u64, u64)>,
    iova: u64,
    len: u64,
    page_size: u64,
    out: &mut [u8],
) {
    if page_size == 0 {
        return;
    }
    let end = iova.saturating_add(len);
    for (w_start, w_size) in windows {
        let start = w_start.max(iova);
        let stop = w_start.saturating_add(w_size).min(end);
        if start >= stop {
            continue;
        }
        let first = (start - iova) / page_size;
        let last = (stop - 1 - iova) / page_size;
        for k in first..=last {
            set_bit(out, k);
        }
    }
}

impl DirtySource for Iommu {
    fn report(&self, iova: u64, len: u64, page_size: u64, out: &mut [u8]) {
        let maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        report_all_dirty(
            maps.values().map(|m| (m.iova(), m.size() as u64)),
            iova,
            len,
            page_size,
            out,
        );
    }
}

impl Drop for Iommu {
    fn drop(&mut self) {
        self.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_mapped_page_in_the_range_is_dirty_and_nothing_else() {
        let mut out = vec![0u8; 16];
        // Windows: pages 2..4 and 70..72 of the range (4 KiB pages), one outside.
        let windows = [
            (0x10_2000, 0x2000),
            (0x10_0000 + 70 * 4096, 0x2000),
            (0x90_0000, 0x1000),
        ];
        report_all_dirty(windows.into_iter(), 0x10_0000, 128 * 4096, 4096, &mut out);
        let bits: Vec<u64> = (0..128)
            .filter(|k| {
                let w =
                    u64::from_ne_bytes(out[(k / 64) * 8..(k / 64) * 8 + 8].try_into().expect("8"));
                w & (1 << (k % 64)) != 0
            })
            .map(|k| k as u64)
            .collect();
        assert_eq!(bits, [2, 3, 70, 71]);
    }

    #[test]
    fn a_window_straddling_the_range_marks_only_the_pages_inside() {
        let mut out = vec![0u8; 8];
        report_all_dirty(
            [(0, 0x10_000)].into_iter(),
            0x8000,
            0x4000,
            0x1000,
            &mut out,
        );
        assert_eq!(u64::from_ne_bytes(out.try_into().expect("8")), 0b1111);
        let mut out = vec![0u8; 8];
        // Larger report pages: a partial page counts.
        report_all_dirty([(0x1800, 0x800)].into_iter(), 0, 0x8000, 0x2000, &mut out);
        assert_eq!(u64::from_ne_bytes(out.try_into().expect("8")), 0b1);
    }
}
