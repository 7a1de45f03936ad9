//! The dirty log of one DMA window: which 4 KiB pages the device wrote.
//!
//! The [`DmaSpace`](crate::DmaSpace) marks a window's [`DirtyLog`] after every device write
//! into it (mmapped or fault-safe), under the space's table read lock. It is built for what a
//! `DMA_LOGGING_REPORT` pays for on every migration round:
//!
//! * it keeps **two** bitmaps and writers mark the *active* one. A report [`flips`](DirtyLog::flip)
//!   the active index while no write is in flight (the [`DmaSpace`](crate::DmaSpace) holds its
//!   table's write lock, which every access holds for reading), then reads the now-inactive
//!   bitmap with plain loads and stores: no locked read-modify-write per word and no allocation.
//!   vm-memory's `AtomicBitmap::get_and_reset` costs one locked `fetch_and` per word and
//!   allocates the whole bitmap on every call (measured ~3x a plain scan of the same words);
//! * marking checks the word first and skips the atomic `fetch_or` when the bits are already
//!   set, so a device streaming into the same pages does not bounce a cache line per write;
//! * the bitmaps are **not allocated** until logging starts ([`DirtyLog::allocate`], fallible):
//!   a window costs nothing until then, and the space bounds what all windows' logs may take.
//!   Until then marking is a no-op and [`DirtyLog::is_allocated`] is false (a report of such a
//!   window must assume every page dirty).
//!
//! The inactive bitmap is all zero between reports; only the report that flipped it reads and
//! clears it (the [`DmaSpace`](crate::DmaSpace) serializes reports).

use std::collections::TryReserveError;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Page size the log is kept at.
pub const DIRTY_PAGE_SIZE: usize = 4096;
const PAGE_SHIFT: u32 = DIRTY_PAGE_SIZE.trailing_zeros();

/// A double-buffered dirty-page bitmap for one DMA window (see the module docs).
#[derive(Debug)]
pub struct DirtyLog {
    /// Both bitmaps in one allocation: words `[0, words)` and `[words, 2 * words)`.
    maps: OnceLock<Box<[AtomicU64]>>,
    active: AtomicUsize,
    pages: usize,
}

impl DirtyLog {
    /// A log for a window of `len` bytes; nothing is allocated yet.
    pub fn new(len: usize) -> Self {
        Self {
            maps: OnceLock::new(),
            active: AtomicUsize::new(0),
            pages: len.div_ceil(DIRTY_PAGE_SIZE),
        }
    }

    /// Bytes both bitmaps of a window of `len` bytes take once allocated.
    pub fn bytes_for(len: u64) -> u64 {
        len.div_ceil(DIRTY_PAGE_SIZE as u64).div_ceil(64) * 16
    }

    /// Bytes this log takes (or will take) once allocated.
    pub fn bytes(&self) -> u64 {
        self.words() as u64 * 16
    }

    /// Allocates the (clean) bitmaps, failing instead of aborting when memory is short.
    /// Returns whether this call allocated them (`false`: they already were).
    pub fn allocate(&self) -> Result<bool, TryReserveError> {
        if self.maps.get().is_some() {
            return Ok(false);
        }
        let words = self.words().saturating_mul(2);
        let mut v: Vec<AtomicU64> = Vec::new();
        v.try_reserve_exact(words)?;
        v.extend((0..words).map(|_| AtomicU64::new(0)));
        Ok(self.maps.set(v.into_boxed_slice()).is_ok())
    }

    /// Whether the bitmaps exist (logging was started while the window was mapped).
    pub fn is_allocated(&self) -> bool {
        self.maps.get().is_some()
    }

    /// Number of 64-bit words in each bitmap.
    pub fn words(&self) -> usize {
        self.pages.div_ceil(64)
    }

    fn map(&self, which: usize) -> &[AtomicU64] {
        let Some(all) = self.maps.get() else {
            return &[];
        };
        let words = self.words();
        let start = (which & 1) * words;
        all.get(start..start + words).unwrap_or(&[])
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
        [0, 1].into_iter().any(|m| {
            self.map(m)
                .get(page / 64)
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
        if let Some(all) = self.maps.get() {
            for w in all.iter() {
                w.store(0, Ordering::Relaxed);
            }
        }
    }

    /// Marks every page `[offset, offset + len)` of the window touches (a no-op before the
    /// bitmaps are allocated).
    pub fn mark_dirty(&self, offset: usize, len: usize) {
        if len == 0 || !self.is_allocated() {
            return;
        }
        let first = offset >> PAGE_SHIFT;
        let last = offset.saturating_add(len - 1) >> PAGE_SHIFT;
        self.mark_pages(first, last - first + 1);
    }

    /// Whether the page holding byte `offset` is dirty.
    pub fn dirty_at(&self, offset: usize) -> bool {
        self.is_page_dirty(offset >> PAGE_SHIFT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(len: usize) -> DirtyLog {
        let log = DirtyLog::new(len);
        assert!(log.allocate().expect("allocate"));
        log
    }

    #[test]
    fn nothing_is_allocated_or_marked_before_logging() {
        let l = DirtyLog::new(1 << 40);
        assert!(!l.is_allocated());
        l.mark_dirty(0, 1 << 20);
        assert!(!l.dirty_at(0));
        assert_eq!(l.bytes(), DirtyLog::bytes_for(1 << 40));
        assert_eq!(DirtyLog::bytes_for(1 << 40), (1 << 40) / 4096 / 8 * 2);
        let l = DirtyLog::new(64 * DIRTY_PAGE_SIZE);
        assert!(l.allocate().expect("allocate"));
        assert!(
            !l.allocate().expect("again"),
            "the second call allocates nothing"
        );
        l.mark_dirty(0, 1);
        assert!(l.dirty_at(0));
    }

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
        let log = log(300 * DIRTY_PAGE_SIZE);
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
        let log = log(128 * DIRTY_PAGE_SIZE);
        log.mark_pages(3, 1);
        log.flip();
        log.mark_pages(70, 1); // after the flip: not part of this report
        assert_eq!(drained(&log), vec![(0, 1 << 3)]);
        log.flip();
        assert_eq!(drained(&log), vec![(1, 1 << 6)]);
    }

    #[test]
    fn bits_given_back_are_reported_next_time() {
        let log = log(128 * DIRTY_PAGE_SIZE);
        log.mark_pages(0, 2);
        log.mark_pages(64, 1);
        log.flip();
        log.drain_inactive(|i, b| if i == 1 { b } else { 0 });
        log.flip();
        assert_eq!(drained(&log), vec![(1, 1)]);
    }

    #[test]
    fn drain_into_writes_words_and_clears() {
        let log = log(130 * DIRTY_PAGE_SIZE);
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
        let log = log(64 * DIRTY_PAGE_SIZE);
        log.mark_pages(1, 1);
        log.flip();
        log.mark_pages(2, 1);
        log.clear();
        assert!(!log.dirty_at(DIRTY_PAGE_SIZE) && !log.dirty_at(2 * DIRTY_PAGE_SIZE));
        log.flip();
        assert!(drained(&log).is_empty());
    }
}
