//! The dirty log of one DMA window: which 4 KiB pages the device wrote.
//!
//! [`DirtyLog`] plugs into `vm-memory` as the window's [`Bitmap`], so every write through a
//! [`vm_memory::VolatileSlice`] of the window marks its pages, exactly as `AtomicBitmap` would.
//! It differs from `AtomicBitmap` in how the bits are read back, which is what a
//! `DMA_LOGGING_REPORT` pays for on every migration round:
//!
//! * it keeps **two** bitmaps and writers mark the *active* one. A report [`flips`](DirtyLog::flip)
//!   the active index while no write is in flight (the [`DmaSpace`](crate::DmaSpace) holds its
//!   table's write lock, which every access holds for reading), then reads the now-inactive
//!   bitmap with plain loads and stores: no locked read-modify-write per word and no allocation.
//!   `AtomicBitmap::get_and_reset` costs one locked `fetch_and` per word and allocates the whole
//!   bitmap on every call (measured ~3x a plain scan of the same words);
//! * marking checks the word first and skips the atomic `fetch_or` when the bits are already
//!   set, so a device streaming into the same pages does not bounce a cache line per write.
//!
//! The inactive bitmap is all zero between reports; only the report that flipped it reads and
//! clears it (the [`DmaSpace`](crate::DmaSpace) serializes reports).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use vm_memory::bitmap::{Bitmap, RefSlice, WithBitmapSlice};

/// Page size the log is kept at.
pub const DIRTY_PAGE_SIZE: usize = 4096;
const PAGE_SHIFT: u32 = DIRTY_PAGE_SIZE.trailing_zeros();

/// A double-buffered dirty-page bitmap for one DMA window (see the module docs).
#[derive(Debug)]
pub struct DirtyLog {
    maps: [Box<[AtomicU64]>; 2],
    active: AtomicUsize,
    pages: usize,
}

fn zeroed(words: usize) -> Box<[AtomicU64]> {
    (0..words).map(|_| AtomicU64::new(0)).collect()
}

impl DirtyLog {
    /// A clean log for a window of `len` bytes.
    pub fn new(len: usize) -> Self {
        let pages = len.div_ceil(DIRTY_PAGE_SIZE);
        let words = pages.div_ceil(64);
        Self {
            maps: [zeroed(words), zeroed(words)],
            active: AtomicUsize::new(0),
            pages,
        }
    }

    /// Number of 64-bit words in each bitmap.
    pub fn words(&self) -> usize {
        self.pages.div_ceil(64)
    }

    fn map(&self, which: usize) -> &[AtomicU64] {
        self.maps.get(which & 1).map_or(&[], |m| m)
    }

    fn active_map(&self) -> &[AtomicU64] {
        // Relaxed: a writer runs under the DMA table's read lock and a flip under its write
        // lock, so the lock orders the index against every write.
        self.map(self.active.load(Ordering::Relaxed))
    }

    /// Marks pages `[first, first + count)` dirty in the active bitmap.
    pub fn mark_pages(&self, first: usize, count: usize) {
        let end = first.saturating_add(count).min(self.pages);
        let map = self.active_map();
        let mut page = first;
        while page < end {
            let bit = page % 64;
            let n = (64 - bit).min(end - page);
            let mask = if n == 64 {
                u64::MAX
            } else {
                ((1u64 << n) - 1) << bit
            };
            if let Some(w) = map.get(page / 64) {
                // Most writes hit pages already marked since the last report: a plain load
                // avoids a locked instruction (and a contended cache line) for them.
                if w.load(Ordering::Relaxed) & mask != mask {
                    w.fetch_or(mask, Ordering::Relaxed);
                }
            }
            page += n;
        }
    }

    /// ORs `bits` into word `index` of the active bitmap (used to give back bits a report
    /// drained but did not report).
    fn restore_word(&self, index: usize, bits: u64) {
        if let Some(w) = self.active_map().get(index) {
            w.fetch_or(bits, Ordering::Relaxed);
        }
    }

    /// Whether page `page` is dirty in either bitmap.
    pub fn is_page_dirty(&self, page: usize) -> bool {
        let bit = 1u64 << (page % 64);
        self.maps.iter().any(|m| {
            m.get(page / 64)
                .is_some_and(|w| w.load(Ordering::Relaxed) & bit != 0)
        })
    }

    /// Makes the other bitmap active.
    ///
    /// The caller must guarantee that no write into the window is in flight and orders the
    /// flip against later writes (the [`DmaSpace`](crate::DmaSpace) calls this under its table's
    /// write lock); afterwards the previously active bitmap belongs to the caller until the next
    /// flip, to be read with [`DirtyLog::drain_inactive`].
    pub fn flip(&self) {
        self.active.fetch_xor(1, Ordering::Relaxed);
    }

    /// Reads and clears the inactive bitmap, calling `f(word_index, bits)` for every nonzero
    /// word. Bits `f` returns are given back to the active bitmap (a report of part of the
    /// window keeps the rest of the window's bits for later).
    pub fn drain_inactive(&self, mut f: impl FnMut(usize, u64) -> u64) {
        let map = self.map(self.active.load(Ordering::Relaxed) ^ 1);
        for (i, w) in map.iter().enumerate() {
            let bits = w.load(Ordering::Relaxed);
            if bits != 0 {
                w.store(0, Ordering::Relaxed);
                let keep = f(i, bits);
                if keep != 0 {
                    self.restore_word(i, keep);
                }
            }
        }
    }

    /// Reads and clears the inactive bitmap into `out`, one word per 8 bytes in host order,
    /// with stores rather than ORs: the fast path of a report whose bitmap is laid out exactly
    /// like the window's. `out` must hold at least [`DirtyLog::words`] words; extra bytes are
    /// left alone.
    pub fn drain_inactive_into(&self, out: &mut [u8]) {
        let map = self.map(self.active.load(Ordering::Relaxed) ^ 1);
        for (w, o) in map.iter().zip(out.chunks_exact_mut(8)) {
            let bits = w.load(Ordering::Relaxed);
            w.store(0, Ordering::Relaxed);
            o.copy_from_slice(&bits.to_ne_bytes());
        }
    }

    /// Clears both bitmaps (start of a logging session). Writes racing with the clear may or
    /// may not stay marked; writes after it always are.
    pub fn clear(&self) {
        for m in &self.maps {
            for w in m.iter() {
                w.store(0, Ordering::Relaxed);
            }
        }
    }
}

impl Default for DirtyLog {
    fn default() -> Self {
        Self::new(0)
    }
}

impl<'a> WithBitmapSlice<'a> for DirtyLog {
    type S = RefSlice<'a, Self>;
}

impl Bitmap for DirtyLog {
    fn mark_dirty(&self, offset: usize, len: usize) {
        if len == 0 {
            return;
        }
        let first = offset >> PAGE_SHIFT;
        let last = offset.saturating_add(len - 1) >> PAGE_SHIFT;
        self.mark_pages(first, last - first + 1);
    }

    fn dirty_at(&self, offset: usize) -> bool {
        self.is_page_dirty(offset >> PAGE_SHIFT)
    }

    fn slice_at(&self, offset: usize) -> RefSlice<'_, Self> {
        RefSlice::new(self, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drained(log: &DirtyLog) -> Vec<(usize, u64)> {
        let mut v = Vec::new();
        log.drain_inactive(|i, b| {
            v.push((i, b));
            0
        });
        v
    }

    #[test]
    fn marks_every_page_a_write_touches() {
        let log = DirtyLog::new(300 * DIRTY_PAGE_SIZE);
        log.mark_dirty(DIRTY_PAGE_SIZE - 1, 2); // pages 0 and 1
        log.mark_dirty(63 * DIRTY_PAGE_SIZE, 2 * DIRTY_PAGE_SIZE); // 63, 64
        log.mark_dirty(100 * DIRTY_PAGE_SIZE, 130 * DIRTY_PAGE_SIZE); // 100..=229
        log.mark_dirty(5 * DIRTY_PAGE_SIZE, 0); // nothing
        log.mark_dirty(299 * DIRTY_PAGE_SIZE, 10 * DIRTY_PAGE_SIZE); // 299, rest clipped
        let mut want = vec![0u64; 5];
        for p in [0usize, 1, 63, 64, 299].into_iter().chain(100..230) {
            want[p / 64] |= 1 << (p % 64);
        }
        for p in 0..300 {
            assert_eq!(
                log.dirty_at(p * DIRTY_PAGE_SIZE),
                want[p / 64] >> (p % 64) & 1 == 1
            );
        }
        log.flip();
        let got = drained(&log);
        let want: Vec<(usize, u64)> = want
            .into_iter()
            .enumerate()
            .filter(|&(_, w)| w != 0)
            .collect();
        assert_eq!(got, want);
        assert!(drained(&log).is_empty(), "a drain clears what it read");
    }

    #[test]
    fn writes_after_a_flip_go_to_the_next_report() {
        let log = DirtyLog::new(128 * DIRTY_PAGE_SIZE);
        log.mark_pages(3, 1);
        log.flip();
        log.mark_pages(70, 1); // after the flip: not part of this report
        assert_eq!(drained(&log), vec![(0, 1 << 3)]);
        log.flip();
        assert_eq!(drained(&log), vec![(1, 1 << 6)]);
    }

    #[test]
    fn bits_given_back_are_reported_next_time() {
        let log = DirtyLog::new(128 * DIRTY_PAGE_SIZE);
        log.mark_pages(0, 2);
        log.mark_pages(64, 1);
        log.flip();
        log.drain_inactive(|i, b| if i == 1 { b } else { 0 });
        log.flip();
        assert_eq!(drained(&log), vec![(1, 1)]);
    }

    #[test]
    fn drain_into_writes_words_and_clears() {
        let log = DirtyLog::new(130 * DIRTY_PAGE_SIZE);
        log.mark_pages(1, 1);
        log.mark_pages(129, 1);
        log.flip();
        let mut out = vec![0xffu8; 32];
        log.drain_inactive_into(&mut out);
        assert_eq!(out[..8], 2u64.to_ne_bytes());
        assert_eq!(out[8..16], 0u64.to_ne_bytes());
        assert_eq!(out[16..24], 2u64.to_ne_bytes());
        assert_eq!(out[24..], [0xff; 8], "bytes past the log are untouched");
        assert!(drained(&log).is_empty());
    }

    #[test]
    fn clear_forgets_both_bitmaps() {
        let log = DirtyLog::new(64 * DIRTY_PAGE_SIZE);
        log.mark_pages(1, 1);
        log.flip();
        log.mark_pages(2, 1);
        log.clear();
        assert!(!log.dirty_at(DIRTY_PAGE_SIZE) && !log.dirty_at(2 * DIRTY_PAGE_SIZE));
        log.flip();
        assert!(drained(&log).is_empty());
    }
}
