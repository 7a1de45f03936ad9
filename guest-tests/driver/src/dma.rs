//! DMA memory: anonymous mappings ("windows") placed at chosen IOVAs, a stack allocator over
//! that IOVA range, and volatile CPU access by IOVA. The device may read and write this memory
//! at any time, so it is never borrowed as a Rust slice; every CPU access is a volatile copy.
//!
//! A window mapped into the IOMMU ([`DmaArena::map`]) is a [`switchyard_sys::DmaMapping`]: it
//! owns the memory together with the IOMMU mapping, removes the mapping before it frees the
//! memory, and leaks the memory if the unmap fails. So this crate needs no `unsafe`.

use std::sync::Arc;

use switchyard_sys::DmaMapping;
use vfio_ioctls::VfioOps;
use vm_memory::VolatileMemory;
use vm_memory::mmap::MmapRegion;

/// One window: anonymous memory and the IOVA it is (to be) mapped at.
#[derive(Debug)]
pub struct Window {
    /// IOVA of the first byte.
    pub iova: u64,
    size: usize,
    memory: Memory,
}

#[derive(Debug)]
enum Memory {
    /// Not mapped into an IOMMU.
    Plain(MmapRegion<()>),
    /// Mapped at `iova` into an IOMMU.
    Mapped(DmaMapping),
    /// Taken out while changing state, or leaked by a failed unmap.
    Gone,
}

impl Window {
    /// The memory, or an error if a failed unmap leaked it.
    pub fn region(&self) -> Result<&MmapRegion<()>, String> {
        match &self.memory {
            Memory::Plain(r) => Ok(r),
            Memory::Mapped(m) => Ok(m.memory()),
            Memory::Gone => Err(format!(
                "DMA window at IOVA {:#x} is gone (its unmap failed)",
                self.iova
            )),
        }
    }

    /// Length in bytes.
    pub fn size(&self) -> usize {
        self.size
    }

    /// Whether the window is mapped into an IOMMU.
    pub fn is_mapped(&self) -> bool {
        matches!(self.memory, Memory::Mapped(_))
    }
}

/// Contiguous IOVA space `[base, base + windows * window_size)` backed by separate mappings, so
/// that transfers crossing a window boundary scatter across mappings.
#[derive(Debug)]
pub struct DmaArena {
    windows: Vec<Window>,
    base: u64,
    size: u64,
    next: u64,
}

/// A saved allocation point ([`DmaArena::mark`]).
#[derive(Debug, Clone, Copy)]
pub struct Mark(u64);

impl DmaArena {
    /// `count` windows of `window_size` bytes (a multiple of 4 KiB) from IOVA `base`.
    pub fn new(base: u64, window_size: u64, count: usize) -> Result<DmaArena, String> {
        if window_size == 0
            || !window_size.is_multiple_of(4096)
            || !base.is_multiple_of(4096)
            || count == 0
        {
            return Err(format!(
                "bad DMA arena geometry: base {base:#x}, window {window_size:#x}, count {count}"
            ));
        }
        let mut windows = Vec::with_capacity(count);
        for i in 0..count {
            let len = usize::try_from(window_size).map_err(|e| e.to_string())?;
            let region = MmapRegion::<()>::new(len)
                .map_err(|e| format!("anonymous mmap of {len} bytes: {e}"))?;
            windows.push(Window {
                iova: base + i as u64 * window_size,
                size: len,
                memory: Memory::Plain(region),
            });
        }
        Ok(DmaArena {
            windows,
            base,
            size: window_size * count as u64,
            next: base,
        })
    }

    /// The windows.
    pub fn windows(&self) -> &[Window] {
        &self.windows
    }

    /// Maps every window not mapped yet at its IOVA into `iommu` (read/write). On an error the
    /// windows mapped so far stay mapped ([`DmaArena::unmap`] or dropping the arena removes
    /// them).
    pub fn map(&mut self, iommu: &Arc<dyn VfioOps>) -> Result<(), String> {
        for w in &mut self.windows {
            if let Memory::Plain(_) = w.memory {
                let Memory::Plain(region) = std::mem::replace(&mut w.memory, Memory::Gone) else {
                    unreachable!("checked above");
                };
                let mapping = DmaMapping::new(iommu.clone(), w.iova, region)
                    .map_err(|e| crate::vfio::chain(&e))?;
                w.memory = Memory::Mapped(mapping);
            }
        }
        Ok(())
    }

    /// Removes every window's IOMMU mapping; a window whose unmap fails is leaked (the device
    /// might still reach it) and reported.
    pub fn unmap(&mut self) -> Vec<String> {
        let mut problems = Vec::new();
        for w in &mut self.windows {
            if let Memory::Mapped(_) = w.memory {
                let Memory::Mapped(m) = std::mem::replace(&mut w.memory, Memory::Gone) else {
                    unreachable!("checked above");
                };
                match m.unmap() {
                    Ok(region) => w.memory = Memory::Plain(region),
                    Err(e) => problems.push(crate::vfio::chain(&e)),
                }
            }
        }
        problems
    }

    /// First IOVA.
    pub fn base(&self) -> u64 {
        self.base
    }

    /// One past the last IOVA.
    pub fn end(&self) -> u64 {
        self.base + self.size
    }

    /// Allocates `len` bytes aligned to `align` (a power of two); returns the IOVA.
    pub fn alloc(&mut self, len: u64, align: u64) -> Result<u64, String> {
        let align = align.max(1);
        let start = self.next.div_ceil(align) * align;
        let end = start
            .checked_add(len)
            .filter(|&e| e <= self.end())
            .ok_or_else(|| {
                format!(
                    "DMA arena exhausted: {len} bytes wanted, {} free",
                    self.end().saturating_sub(start)
                )
            })?;
        self.next = end;
        Ok(start)
    }

    /// The current allocation point.
    pub fn mark(&self) -> Mark {
        Mark(self.next)
    }

    /// Frees everything allocated after `m`.
    pub fn release(&mut self, m: Mark) {
        self.next = m.0.clamp(self.base, self.end());
    }

    /// Calls `f(window, offset in window, range in the caller's buffer)` for each piece of
    /// `[iova, iova + len)`.
    fn pieces(
        &self,
        iova: u64,
        len: usize,
        mut f: impl FnMut(&MmapRegion<()>, usize, std::ops::Range<usize>) -> Result<(), String>,
    ) -> Result<(), String> {
        let end = iova
            .checked_add(len as u64)
            .filter(|&e| iova >= self.base && e <= self.end())
            .ok_or_else(|| format!("IOVA range {iova:#x}+{len:#x} outside the DMA arena"))?;
        let mut cur = iova;
        while cur < end {
            let w = self
                .windows
                .iter()
                .find(|w| cur >= w.iova && cur < w.iova + w.size as u64)
                .ok_or_else(|| format!("IOVA {cur:#x} not in any window"))?;
            let wend = w.iova + w.size as u64;
            let n = (end.min(wend) - cur) as usize;
            let b = (cur - iova) as usize;
            f(w.region()?, (cur - w.iova) as usize, b..b + n)?;
            cur += n as u64;
        }
        Ok(())
    }

    /// Copies `data` to `iova`.
    pub fn write(&self, iova: u64, data: &[u8]) -> Result<(), String> {
        self.pieces(iova, data.len(), |r, off, range| {
            let s = r.get_slice(off, range.len()).map_err(|e| e.to_string())?;
            s.copy_from(&data[range]);
            Ok(())
        })
    }

    /// Copies from `iova` into `buf`.
    pub fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), String> {
        let len = buf.len();
        self.pieces(iova, len, |r, off, range| {
            let s = r.get_slice(off, range.len()).map_err(|e| e.to_string())?;
            s.copy_to(&mut buf[range]);
            Ok(())
        })
    }

    /// Reads `len` bytes.
    pub fn read_vec(&self, iova: u64, len: usize) -> Result<Vec<u8>, String> {
        let mut v = vec![0u8; len];
        self.read(iova, &mut v)?;
        Ok(v)
    }

    /// Volatile 64-bit load (8-byte aligned, inside one window): fence values.
    pub fn read_u64(&self, iova: u64) -> Result<u64, String> {
        let mut v = None;
        self.pieces(iova, 8, |r, off, range| {
            if range.len() != 8 {
                return Err(format!("u64 at {iova:#x} crosses a window"));
            }
            v = Some(r.get_ref::<u64>(off).map_err(|e| e.to_string())?.load());
            Ok(())
        })?;
        v.ok_or_else(|| format!("u64 at {iova:#x}: no data"))
    }

    /// Volatile 64-bit store (tests only: the driver writes DMA memory with [`DmaArena::write`]).
    #[cfg(test)]
    pub fn write_u64(&self, iova: u64, val: u64) -> Result<(), String> {
        self.pieces(iova, 8, |r, off, range| {
            if range.len() != 8 {
                return Err(format!("u64 at {iova:#x} crosses a window"));
            }
            r.get_ref::<u64>(off).map_err(|e| e.to_string())?.store(val);
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_mark_release() {
        let mut a = DmaArena::new(0x1_0000_0000, 0x4000, 2).expect("arena");
        assert_eq!(a.end(), 0x1_0000_8000);
        let x = a.alloc(10, 64).expect("alloc");
        assert_eq!(x, 0x1_0000_0000);
        let m = a.mark();
        let y = a.alloc(100, 4096).expect("alloc");
        assert_eq!(y, 0x1_0000_1000);
        a.release(m);
        assert_eq!(a.alloc(1, 1), Ok(0x1_0000_000a));
        assert!(a.alloc(0x8000, 1).is_err());
        assert!(DmaArena::new(0, 100, 1).is_err());
    }

    #[test]
    fn access_across_windows() {
        let a = DmaArena::new(0x10_0000, 0x1000, 3).expect("arena");
        let data: Vec<u8> = (0..6000u32).map(|i| (i % 251) as u8).collect();
        a.write(0x10_0000 + 100, &data).expect("write");
        assert_eq!(a.read_vec(0x10_0000 + 100, 6000), Ok(data.clone()));
        // Each window holds its own part.
        let mut w1 = vec![0u8; 0x1000];
        a.windows()[1]
            .region()
            .expect("plain window")
            .as_volatile_slice()
            .copy_to(&mut w1[..]);
        assert_eq!(&w1[..6000 - (0x1000 - 100)], &data[0x1000 - 100..]);
        a.write_u64(0x10_0ff8, 0x0102_0304_0506_0708).expect("u64");
        assert_eq!(a.read_u64(0x10_0ff8), Ok(0x0102_0304_0506_0708));
        assert!(a.read_u64(0x10_0ffc).is_err(), "crosses a window");
        assert!(a.read_vec(0x10_0000 + 0x2fff, 2).is_err(), "past the end");
        assert!(a.read_vec(0xf_ffff, 1).is_err(), "before the start");
    }
}
