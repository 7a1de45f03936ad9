//! DMA memory: anonymous mappings ("windows") placed at chosen IOVAs, a stack allocator over
//! that IOVA range, and volatile CPU access by IOVA. Without an IOMMU (`--noiommu`) the windows
//! are hugepages at their physical addresses ([`Window::pinned`], [`crate::hugepage`]), which
//! need not be adjacent: the allocator then hands out ranges inside one run of adjacent windows
//! ([`DmaArena::runs`]), because only those are contiguous for the device. The device may read and write this memory
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
    /// Physically contiguous, locked memory whose physical address is `iova` (no IOMMU).
    Pinned(MmapRegion<()>),
    /// Taken out while changing state, or leaked by a failed unmap.
    Gone,
}

impl Window {
    /// A window of memory the device reaches at bus address `bus` without an IOMMU: the
    /// caller has checked that `region` is physically contiguous at `bus` and stays there
    /// (locked hugepages).
    pub fn pinned(bus: u64, region: MmapRegion<()>) -> Window {
        Window {
            iova: bus,
            size: region.size(),
            memory: Memory::Pinned(region),
        }
    }

    /// The memory, or an error if a failed unmap leaked it.
    pub fn region(&self) -> Result<&MmapRegion<()>, String> {
        match &self.memory {
            Memory::Plain(r) | Memory::Pinned(r) => Ok(r),
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

/// IOVA space backed by separate mappings ("windows"), so that transfers crossing a window
/// boundary scatter across mappings. With an IOMMU it is one contiguous range `[base, base +
/// windows * window_size)`; without one, the windows lie wherever their memory is, and each
/// run of adjacent windows is a contiguous range of its own.
#[derive(Debug)]
pub struct DmaArena {
    /// Sorted by IOVA, not overlapping.
    windows: Vec<Window>,
    /// Runs of adjacent windows: `(start, end)`, ascending.
    runs: Vec<(u64, u64)>,
    base: u64,
    size: u64,
    next: u64,
}

/// Merges sorted, non-overlapping `(start, len)` ranges into runs of adjacent ones:
/// `(start, end)`.
pub fn merge_runs(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (start, len) in ranges {
        match runs.last_mut() {
            Some(last) if last.1 == start => last.1 = start + len,
            _ => runs.push((start, start + len)),
        }
    }
    runs
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
        let size = window_size * count as u64;
        Ok(DmaArena {
            windows,
            runs: vec![(base, base + size)],
            base,
            size,
            next: base,
        })
    }

    /// An arena over `windows` placed wherever they are (no IOMMU: at their physical
    /// addresses); they are sorted here and must not overlap.
    pub fn from_windows(mut windows: Vec<Window>) -> Result<DmaArena, String> {
        windows.sort_by_key(|w| w.iova);
        if windows.is_empty() {
            return Err("no DMA windows".into());
        }
        for pair in windows.windows(2) {
            if pair[0].iova + pair[0].size as u64 > pair[1].iova {
                return Err(format!(
                    "DMA windows at {:#x} and {:#x} overlap",
                    pair[0].iova, pair[1].iova
                ));
            }
        }
        let runs = merge_runs(windows.iter().map(|w| (w.iova, w.size as u64)));
        let base = runs[0].0;
        let last = runs[runs.len() - 1].1;
        Ok(DmaArena {
            windows,
            runs,
            base,
            size: last - base,
            next: base,
        })
    }

    /// Runs of adjacent windows, `(start, end)`, ascending: an allocation lies inside one.
    pub fn runs(&self) -> &[(u64, u64)] {
        &self.runs
    }

    /// Length of the longest run: the largest allocation possible.
    pub fn largest_run(&self) -> u64 {
        self.runs.iter().map(|(s, e)| e - s).max().unwrap_or(0)
    }

    /// Forgets the memory of every pinned window (no IOMMU): for when the device may still
    /// write it (its queues did not stop) and nothing protects it.
    pub fn leak(&mut self) {
        for w in &mut self.windows {
            if let Memory::Pinned(_) = w.memory {
                std::mem::forget(std::mem::replace(&mut w.memory, Memory::Gone));
            }
        }
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

    /// Allocates `len` bytes aligned to `align` (a power of two), inside one run; returns the
    /// IOVA. Space left at the end of a run that is too small is skipped.
    pub fn alloc(&mut self, len: u64, align: u64) -> Result<u64, String> {
        let align = align.max(1);
        if self.runs.len() > 1 {
            for &(rs, re) in &self.runs {
                if re <= self.next {
                    continue;
                }
                let start = self.next.max(rs).div_ceil(align) * align;
                if let Some(end) = start.checked_add(len).filter(|&e| e <= re) {
                    self.next = end;
                    return Ok(start);
                }
            }
            return Err(format!(
                "DMA arena exhausted: {len} bytes wanted, no run of adjacent windows has them free (runs {}, largest {} bytes)",
                self.runs.len(),
                self.largest_run()
            ));
        }
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

    fn pinned(bus: u64, len: usize) -> Window {
        Window::pinned(bus, MmapRegion::<()>::new(len).expect("mmap"))
    }

    #[test]
    fn runs_merge_adjacent_windows() {
        assert_eq!(
            merge_runs([
                (0x20_0000, 0x20_0000),
                (0x40_0000, 0x20_0000),
                (0x80_0000, 0x1000)
            ]),
            vec![(0x20_0000, 0x60_0000), (0x80_0000, 0x80_1000)]
        );
        assert_eq!(merge_runs([]), vec![]);
    }

    /// Hugepages at scattered physical addresses (given out of order): allocations stay
    /// inside one run of adjacent pages, skipping a tail that is too short; mark/release
    /// works across runs; accesses may cross adjacent windows but not a gap.
    #[test]
    fn allocation_across_hugepage_runs() {
        const H: u64 = 0x1000; // stands in for 2 MiB
        let mut a = DmaArena::from_windows(vec![
            pinned(10 * H, H as usize),
            pinned(3 * H, H as usize),
            pinned(4 * H, H as usize),
            pinned(20 * H, H as usize),
        ])
        .expect("arena");
        assert_eq!(
            a.runs(),
            &[(3 * H, 5 * H), (10 * H, 11 * H), (20 * H, 21 * H)]
        );
        assert_eq!(a.largest_run(), 2 * H);
        assert_eq!((a.base(), a.end()), (3 * H, 21 * H));
        // Crosses the boundary between the two adjacent pages.
        let x = a.alloc(H + 16, 64).expect("alloc");
        assert_eq!(x, 3 * H);
        let m = a.mark();
        // 0xff0 bytes left in the first run: too few for 0x800 aligned to 0x1000, so the next
        // run.
        let y = a.alloc(0x800, 0x1000).expect("alloc");
        assert_eq!(y, 10 * H);
        let z = a.alloc(0x900, 8).expect("alloc");
        assert_eq!(z, 20 * H, "0x800 left in the page at 10H is not enough");
        assert!(
            a.alloc(2 * H, 1)
                .is_err_and(|e| e.contains("no run of adjacent windows"))
        );
        a.release(m);
        assert_eq!(a.alloc(8, 8), Ok(3 * H + H + 16));
        assert!(a.alloc(3 * H, 1).is_err(), "larger than every run");
        // Data across the two adjacent windows.
        let data: Vec<u8> = (0..0x100u32).map(|i| i as u8).collect();
        a.write(4 * H - 0x80, &data).expect("write");
        assert_eq!(a.read_vec(4 * H - 0x80, 0x100), Ok(data));
        assert!(a.read_vec(5 * H - 8, 16).is_err(), "runs into the gap");
        assert!(
            DmaArena::from_windows(vec![pinned(0, 0x2000), pinned(0x1000, 0x1000)]).is_err(),
            "overlap"
        );
        assert!(!a.windows().iter().any(Window::is_mapped));
        a.leak();
        assert!(a.read_vec(3 * H, 1).is_err(), "leaked windows are gone");
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
