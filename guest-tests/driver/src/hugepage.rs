//! DMA memory without an IOMMU (`--noiommu`): the device's bus address of a page is its guest
//! physical address, so DMA buffers must be physically contiguous and must not move.
//!
//! The memory is 2 MiB hugepages from the kernel's boot-time pool (kernel command line
//! `hugepages=N`, see [`HUGEPAGES_WANTED`]), each an anonymous `MAP_HUGETLB` mapping (no
//! hugetlbfs mount needed) made through vm-memory's `MmapRegionBuilder` with
//! `MAP_POPULATE | MAP_LOCKED`, then touched. A hugepage is physically contiguous and the
//! kernel neither swaps nor (without memory hot-unplug) migrates it. Its physical address comes
//! from `/proc/self/pagemap` (present bit 63, PFN in bits 0–54; the PFN reads 0 without
//! `CAP_SYS_ADMIN`, which is refused), and every 4 KiB page of it is checked to follow the
//! first. Each hugepage becomes a [`Window`] at its physical address; adjacent ones form runs
//! ([`crate::dma::DmaArena::runs`]).
//!
//! Also here: which bus address is certainly not guest RAM or a device (from `/proc/iomem`),
//! for the bad-DMA test.

use std::fs::File;
use std::os::unix::fs::FileExt;

use vm_memory::VolatileMemory;
use vm_memory::mmap::{MmapRegion, MmapRegionBuilder};

use crate::dma::Window;

/// Size of one hugepage.
pub const HUGEPAGE: u64 = 2 << 20;
/// Hugepages the driver takes from the pool when it can (32 MiB): boot the guest with
/// `hugepages=16`.
pub const HUGEPAGES_WANTED: usize = 16;
/// Fewest free hugepages the driver runs with.
pub const HUGEPAGES_MIN: usize = 8;

/// Page size of `/proc/self/pagemap` entries.
const PAGE: u64 = 4096;
/// Present bit of a pagemap entry.
const PM_PRESENT: u64 = 1 << 63;
/// PFN bits of a pagemap entry (0–54).
const PM_PFN_MASK: u64 = (1 << 55) - 1;

/// Decodes one `/proc/self/pagemap` entry into the page frame number.
pub fn decode_pagemap(entry: u64) -> Result<u64, String> {
    if entry & PM_PRESENT == 0 {
        return Err(format!("page not present (pagemap entry {entry:#018x})"));
    }
    let pfn = entry & PM_PFN_MASK;
    if pfn == 0 {
        return Err(
            "/proc/self/pagemap hides the page frame number (reads 0): physical addresses need root (CAP_SYS_ADMIN)"
                .into(),
        );
    }
    Ok(pfn)
}

/// `HugePages_Total`, `HugePages_Free` and `Hugepagesize` (bytes) from `/proc/meminfo` text.
pub fn parse_meminfo(text: &str) -> Option<(u64, u64, u64)> {
    let field = |name: &str| -> Option<u64> {
        let line = text.lines().find(|l| l.starts_with(name))?;
        line[name.len()..]
            .trim()
            .trim_start_matches(':')
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some((
        field("HugePages_Total")?,
        field("HugePages_Free")?,
        field("Hugepagesize")? * 1024,
    ))
}

/// `(start, end)` (inclusive) of every resource in `/proc/iomem` text, at any nesting level.
pub fn parse_iomem(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|l| {
            let range = l.trim().split(" : ").next()?;
            let (a, b) = range.split_once('-')?;
            Some((
                u64::from_str_radix(a.trim(), 16).ok()?,
                u64::from_str_radix(b.trim(), 16).ok()?,
            ))
        })
        .collect()
}

/// A bus address `a` (from `preferred`, then every 1 GiB above it, below 2^46) such that
/// `[a, a + len)` touches no resource: no guest RAM and no device, so a DMA there must fault.
/// `None` if the resources are all zero (an unprivileged read of `/proc/iomem` shows zeros)
/// or nothing is free.
pub fn unclaimed_address(resources: &[(u64, u64)], preferred: u64, len: u64) -> Option<u64> {
    if resources.is_empty() || resources.iter().all(|&(s, e)| s == 0 && e == 0) {
        return None;
    }
    let mut a = preferred;
    while a < 1 << 46 {
        let end = a + len - 1;
        if resources.iter().all(|&(s, e)| e < a || s > end) {
            return Some(a);
        }
        a += 1 << 30;
    }
    None
}

/// Locked hugepages, each a [`Window`] at its physical address.
#[derive(Debug)]
pub struct Hugepages {
    /// The windows (one per hugepage), in allocation order.
    pub windows: Vec<Window>,
    /// Whether `MAP_LOCKED` was accepted (hugepages are never swapped either way).
    pub locked: bool,
    /// Free hugepages in the pool before the allocation.
    pub pool_free: u64,
}

fn hugepage_region(locked: bool) -> Result<MmapRegion<()>, String> {
    let mut flags = libc::MAP_ANONYMOUS | libc::MAP_SHARED | libc::MAP_HUGETLB | libc::MAP_POPULATE;
    if locked {
        flags |= libc::MAP_LOCKED;
    }
    MmapRegionBuilder::new(HUGEPAGE as usize)
        .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
        .with_mmap_flags(flags)
        .with_hugetlbfs(true)
        .build()
        .map_err(|e| format!("mmap of a 2 MiB MAP_HUGETLB page: {e}"))
}

/// The physical address of `region` (one hugepage), checked contiguous page by page.
fn physical_address(pagemap: &File, region: &MmapRegion<()>) -> Result<u64, String> {
    let va = region.as_ptr() as u64;
    if !va.is_multiple_of(HUGEPAGE) {
        return Err(format!("hugepage mapping at {va:#x} is not 2 MiB aligned"));
    }
    let pages = (HUGEPAGE / PAGE) as usize;
    let mut raw = vec![0u8; pages * 8];
    pagemap
        .read_exact_at(&mut raw, va / PAGE * 8)
        .map_err(|e| format!("read /proc/self/pagemap at {va:#x}: {e}"))?;
    let mut first = 0;
    for (i, e) in raw.chunks_exact(8).enumerate() {
        let entry = u64::from_le_bytes(e.try_into().map_err(|_| "short pagemap entry")?);
        let pfn = decode_pagemap(entry).map_err(|e| format!("{e} (virtual {va:#x})"))?;
        if i == 0 {
            first = pfn;
            if !(pfn * PAGE).is_multiple_of(HUGEPAGE) {
                return Err(format!(
                    "hugepage at virtual {va:#x} starts at physical {:#x}, not 2 MiB aligned",
                    pfn * PAGE
                ));
            }
        } else if pfn != first + i as u64 {
            return Err(format!(
                "hugepage at virtual {va:#x} is not physically contiguous: page {i} at PFN {pfn:#x}, expected {:#x}",
                first + i as u64
            ));
        }
    }
    Ok(first * PAGE)
}

/// Takes up to [`HUGEPAGES_WANTED`] hugepages (at least [`HUGEPAGES_MIN`]) from the pool,
/// touches and locks them and finds their physical addresses. Refuses when the pool is empty
/// or too small, and when pagemap hides physical addresses.
pub fn allocate() -> Result<Hugepages, String> {
    let meminfo =
        std::fs::read_to_string("/proc/meminfo").map_err(|e| format!("read /proc/meminfo: {e}"))?;
    let (total, free, size) = parse_meminfo(&meminfo)
        .ok_or("/proc/meminfo has no HugePages_* lines: the kernel has no hugetlb support")?;
    if size != HUGEPAGE {
        return Err(format!(
            "the default hugepage size is {} KiB, need 2048 KiB",
            size >> 10
        ));
    }
    if free < HUGEPAGES_MIN as u64 {
        return Err(format!(
            "{free} free 2 MiB hugepages ({total} in the pool), need at least {HUGEPAGES_MIN}: boot the guest with hugepages={HUGEPAGES_WANTED} on the kernel command line"
        ));
    }
    let count = (free as usize).min(HUGEPAGES_WANTED);
    let pagemap =
        File::open("/proc/self/pagemap").map_err(|e| format!("open /proc/self/pagemap: {e}"))?;
    let mut locked = true;
    let mut windows = Vec::with_capacity(count);
    for i in 0..count {
        let region = match hugepage_region(locked) {
            Ok(r) => r,
            Err(first) if locked => {
                locked = false;
                hugepage_region(false)
                    .map_err(|e| format!("hugepage {i}: {e} (with MAP_LOCKED: {first})"))?
            }
            Err(e) => return Err(format!("hugepage {i} of {count}: {e}")),
        };
        // Touch every 4 KiB page (MAP_POPULATE faulted them in already).
        for off in (0..HUGEPAGE as usize).step_by(PAGE as usize) {
            region
                .get_ref::<u64>(off)
                .map_err(|e| e.to_string())?
                .store(0);
        }
        let bus = physical_address(&pagemap, &region)?;
        windows.push(Window::pinned(bus, region));
    }
    Ok(Hugepages {
        windows,
        locked,
        pool_free: free,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pagemap_entries() {
        assert_eq!(decode_pagemap((1 << 63) | 0x1234), Ok(0x1234));
        // Soft-dirty (55), exclusive (56) and file (61) bits are not part of the PFN.
        assert_eq!(
            decode_pagemap((1 << 63) | (1 << 61) | (1 << 56) | (1 << 55) | 0x7_ffff_ffff_ffff),
            Ok(0x7_ffff_ffff_ffff)
        );
        assert!(
            decode_pagemap(1 << 63).is_err_and(|e| e.contains("root")),
            "PFN 0: no privilege"
        );
        assert!(decode_pagemap(0x1234).is_err_and(|e| e.contains("not present")));
        // Swapped (bit 62) without present.
        assert!(decode_pagemap((1 << 62) | 5).is_err());
    }

    #[test]
    fn meminfo_fields() {
        let text = "MemTotal:         502392 kB\nHugePages_Total:      16\nHugePages_Free:       12\n\
                    HugePages_Rsvd:        0\nHugePages_Surp:        0\nHugepagesize:       2048 kB\n";
        assert_eq!(parse_meminfo(text), Some((16, 12, 2 << 20)));
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn iomem_and_an_unclaimed_address() {
        let text = "00000000-00000fff : Reserved\n\
                    00001000-0009fbff : System RAM\n\
                    000f0000-000fffff : System ROM\n\
                    00100000-1ffdffff : System RAM\n\
                    \x20 01000000-01ffffff : Kernel code\n\
                    fd000000-fdffffff : PCI Bus 0000:00\n\
                    700000000-7000fffff : PCI Bus 0000:00\n\
                    \x20 700000000-7000fffff : 0000:00:04.0\n";
        let r = parse_iomem(text);
        assert_eq!(r.len(), 8);
        assert_eq!(r[1], (0x1000, 0x9fbff));
        assert_eq!(r[4], (0x100_0000, 0x1ff_ffff));
        // 0x7_0000_0000 is a BAR here: the next GiB up is free.
        assert_eq!(
            unclaimed_address(&r, 0x7_0000_0000, 0x1000),
            Some(0x7_4000_0000)
        );
        assert_eq!(
            unclaimed_address(&r, 0x6_0000_0000, 0x1000),
            Some(0x6_0000_0000)
        );
        // An unprivileged read shows zeros: no answer.
        let zeros = parse_iomem("00000000-00000000 : System RAM\n00000000-00000000 : Reserved\n");
        assert_eq!(unclaimed_address(&zeros, 0x7_0000_0000, 64), None);
        assert_eq!(unclaimed_address(&[], 0x7_0000_0000, 64), None);
    }
}
