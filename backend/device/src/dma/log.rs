//! DMA dirty logging: the logging session, its memory budget, `DMA_LOGGING_REPORT` and
//! `DMA_UNMAP` with a dirty bitmap (see the [module docs](super) and [`DirtyLog`](crate::dirty::DirtyLog)).

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use super::backing::FdWindow;
use super::{Backing, DmaError, DmaSpace, Mapping, Result, State};
use crate::dirty::DIRTY_PAGE_SIZE;

/// Default bound on the memory all windows' dirty logs may take together: 256 MiB, enough to
/// log 4 TiB of mapped guest memory at 4 KiB pages (each page costs two bits).
pub const DEFAULT_LOG_BUDGET: u64 = 256 << 20;

/// Logging session state; its mutex also serializes reports (a drain owns the inactive
/// bitmaps it flipped until it is done).
#[derive(Default)]
pub(super) struct LogState {
    /// Page size of the running session.
    pub(super) page_size: Option<u64>,
    /// Windows of the report in progress (kept to reuse the allocation).
    pub(super) scratch: Vec<(u64, Arc<FdWindow>)>,
}

/// Checks a report's range, page size and bitmap room; returns the last address of the range
/// (the range may end exactly at 2^64).
fn report_geometry(iova: u64, len: u64, page_size: u64, room: usize) -> Result<u64> {
    if !page_size.is_power_of_two() || page_size < DIRTY_PAGE_SIZE as u64 {
        return Err(DmaError::BadPageSize(page_size));
    }
    let last = len
        .checked_sub(1)
        .and_then(|s| iova.checked_add(s))
        .ok_or(DmaError::BadWindow { iova, size: len })?;
    let need = len.div_ceil(page_size).div_ceil(64).saturating_mul(8);
    if (room as u64) < need {
        return Err(DmaError::BitmapTooSmall { need, room });
    }
    Ok(last)
}

/// Drains the (already flipped) logs of `windows`, sorted by IOVA and all intersecting
/// `[iova, last]`, into `out` at `page_size` granularity; bits outside the range go back to
/// their window's log. Bytes of `out` past the range's bitmap are left alone.
fn collect_dirty(
    windows: &[(u64, Arc<FdWindow>)],
    iova: u64,
    last: u64,
    page_size: u64,
    out: &mut [u8],
) {
    let page = DIRTY_PAGE_SIZE as u64;
    let bytes = ((last - iova) / page_size / 64 + 1) as usize * 8;
    let out = match out.get_mut(..bytes) {
        Some(o) => o,
        None => return, // Checked by report_geometry.
    };
    // Bytes below `zeroed` hold final values or zeros: every window is written exactly once,
    // in address order, and gaps are zeroed just before the next window needs them.
    let mut zeroed = 0usize;
    let zero_to = |out: &mut [u8], zeroed: &mut usize, to: usize| {
        if let Some(gap) = out.get_mut(*zeroed..to) {
            gap.fill(0);
        }
        *zeroed = (*zeroed).max(to);
    };
    for (start, window) in windows {
        let log = &window.log;
        let size = window.len as u64;
        let end_last = start + (size - 1); // Window fits the address space.
        if !log.is_allocated() {
            // Never logged (DMA_UNMAP with a bitmap outside a session): every page may have
            // been written.
            let lo = (*start).max(iova);
            let hi = end_last.min(last);
            let b1 = (((hi - iova) / page_size) / 64 + 1) as usize * 8;
            zero_to(out, &mut zeroed, b1);
            for k in (lo - iova) / page_size..=(hi - iova) / page_size {
                if let Some(o) = out.get_mut((k / 8) as usize) {
                    *o |= 1 << (k % 8);
                }
            }
            continue;
        }
        // Fast path: 4 KiB pages, whole window inside the range, window starting on a bitmap
        // word: the window's log *is* this part of the report, word for word.
        let whole = *start >= iova && end_last <= last;
        let off_pages = start.wrapping_sub(iova) / page;
        if page_size == page && whole && off_pages.is_multiple_of(64) {
            let b0 = (off_pages / 8) as usize;
            let b1 = b0 + log.words() * 8;
            zero_to(out, &mut zeroed, b0);
            if let Some(dst) = out.get_mut(b0..) {
                log.drain_inactive_into(dst);
            }
            zeroed = zeroed.max(b1.min(out.len()));
            continue;
        }
        // General path: bit by bit, ORed into zeroed bytes.
        let lo = (*start).max(iova);
        let hi = end_last.min(last);
        let b1 = (((hi - iova) / page_size) / 64 + 1) as usize * 8;
        zero_to(out, &mut zeroed, b1);
        log.drain_inactive(|w, bits| {
            let mut rest = bits;
            let mut keep = 0u64;
            while rest != 0 {
                let b = rest.trailing_zeros();
                rest &= rest - 1;
                let addr = start + (w as u64 * 64 + u64::from(b)) * page;
                if addr < lo || addr > hi {
                    keep |= 1 << b;
                    continue;
                }
                let k = (addr - iova) / page_size;
                if let Some(o) = out.get_mut((k / 8) as usize) {
                    *o |= 1 << (k % 8);
                }
            }
            keep
        });
    }
    zero_to(out, &mut zeroed, bytes);
}

impl DmaSpace {
    /// Sets how many bytes all dirty logs may take together (see the module docs).
    pub fn set_log_budget(&self, bytes: u64) {
        self.log_budget.store(bytes, Ordering::Relaxed);
    }

    /// Bytes the dirty logs take now.
    pub fn log_bytes(&self) -> u64 {
        self.log_bytes.load(Ordering::Relaxed)
    }

    /// Allocates the logs of `windows` (those not yet allocated) if the budget allows all of
    /// them; call with the table write-locked. On error nothing more is allocated than before
    /// (except after a failed allocation, whose predecessors stay allocated and counted).
    pub(super) fn allocate_logs<'a>(
        &self,
        windows: impl Iterator<Item = &'a FdWindow> + Clone,
    ) -> Result<()> {
        let need: u64 = windows
            .clone()
            .filter(|w| !w.log.is_allocated())
            .map(|w| w.log.bytes())
            .fold(0u64, u64::saturating_add);
        let budget = self.log_budget.load(Ordering::Relaxed);
        let total = self.log_bytes().saturating_add(need);
        if total > budget {
            return Err(DmaError::LogBudget {
                need: total,
                budget,
            });
        }
        for w in windows {
            if w.log.allocate().map_err(DmaError::LogAlloc)? {
                self.log_bytes.fetch_add(w.log.bytes(), Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Gives back the log memory of windows that were removed.
    pub(super) fn forget_logs(&self, removed: &[Mapping]) {
        for m in removed {
            if let Backing::Fd(w) = &m.backing
                && w.log.is_allocated()
            {
                self.log_bytes.fetch_sub(w.log.bytes(), Ordering::Relaxed);
            }
        }
    }

    pub(super) fn log_state(&self) -> MutexGuard<'_, LogState> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `DMA_LOGGING_START`: allocates (within the budget) and clears every window's log and
    /// starts a logging session. Every fd-backed window is logged, whatever ranges the client
    /// named (logging more than asked is allowed); windows mapped later start clean. Refused
    /// with `ENOMEM`, and no session started, when the logs would exceed the budget.
    /// `page_size` is the client's hint: the returned page size is what the log keeps (4 KiB,
    /// or the hint if larger). Reports may ask for any power-of-two page size of at least
    /// 4 KiB.
    pub fn start_logging(&self, page_size: u64) -> Result<u64> {
        if !page_size.is_power_of_two() {
            return Err(DmaError::BadPageSize(page_size));
        }
        let mut log = self.log_state();
        if log.page_size.is_some() {
            return Err(DmaError::LoggingActive);
        }
        // No write is in flight while the table is write-locked: none straddles the clear.
        let table = self.write_table();
        // Pending windows too (they are live soon, logged from their first write); retiring
        // ones are gone.
        let windows = table
            .maps
            .iter()
            .filter(|m| m.state != State::Retiring)
            .filter_map(|m| match &m.backing {
                Backing::Fd(w) => Some(&**w),
                Backing::Message => None,
            });
        self.allocate_logs(windows.clone())?;
        for w in windows {
            w.log.clear();
        }
        let chosen = page_size.max(DIRTY_PAGE_SIZE as u64);
        log.page_size = Some(chosen);
        Ok(chosen)
    }

    /// `DMA_LOGGING_STOP`: ends the logging session (a no-op without one).
    pub fn stop_logging(&self) {
        self.log_state().page_size = None;
    }

    /// The page size of the running logging session, if any.
    pub fn logging(&self) -> Option<u64> {
        self.log_state().page_size
    }

    /// `DMA_LOGGING_REPORT`: reads and clears the dirty bits of `[iova, iova+len)` into `out`
    /// at `page_size` granularity (bit k = page `iova + k*page_size`: byte k/8... as host-order
    /// 64-bit words, word k/64, bit k%64). The range may cover any number of windows, parts of
    /// windows and holes (which read clean); bits of a window outside the range stay logged.
    /// Needs a logging session. Writes that race with the report land in this report or in the
    /// next one, never in neither.
    pub fn report_dirty(&self, iova: u64, len: u64, page_size: u64, out: &mut [u8]) -> Result<()> {
        let mut log = self.log_state();
        if log.page_size.is_none() {
            return Err(DmaError::NotLogging);
        }
        let last = report_geometry(iova, len, page_size, out.len())?;
        let mut windows = std::mem::take(&mut log.scratch);
        {
            // Flip under the write lock: no write is in flight, and every later write marks
            // the other bitmap. The drain then runs with device DMA flowing again.
            let table = self.write_table();
            let first = table.maps.partition_point(|m| m.end() <= iova);
            for m in table.maps.iter().skip(first).take_while(|m| m.iova <= last) {
                if let (true, Backing::Fd(w)) = (m.state.reachable(), &m.backing) {
                    w.log.flip();
                    windows.push((m.iova, Arc::clone(w)));
                }
            }
        }
        collect_dirty(&windows, iova, last, page_size, out);
        if let Some(src) = self.dirty_source() {
            src.report(iova, len, page_size, out);
        }
        windows.clear();
        log.scratch = windows;
        Ok(())
    }

    /// `DMA_UNMAP` with `GET_DIRTY_BITMAP`: atomically (under the table's write lock, with no
    /// access in flight, the windows leave the table's reach and their logs are flipped) reads
    /// and clears the dirty bits of the windows in `[iova, iova+len)` into `out` (layout as
    /// [`DmaSpace::report_dirty`]) and removes them. Works with or without a logging session: a
    /// window whose writes were never logged reports every page dirty. Fails without touching
    /// anything when [`DmaSpace::unmap`] would. The observer is told with no lock held.
    pub fn unmap_take_dirty(
        &self,
        iova: u64,
        len: u64,
        page_size: u64,
        out: &mut [u8],
    ) -> Result<usize> {
        let last = report_geometry(iova, len, page_size, out.len())?;
        let retired = loop {
            let log = self.log_state();
            let mut table = self.write_table();
            let (first, stop) = Self::covered(&table, iova, len)?;
            let retired = match self.retire(&mut table, first, stop) {
                Ok(r) => r,
                Err(seen) => {
                    drop(table);
                    drop(log);
                    self.wait_settled(seen);
                    continue;
                }
            };
            let windows: Vec<(u64, Arc<FdWindow>)> = retired
                .0
                .iter()
                .filter_map(|t| {
                    let w = t.window.as_ref()?;
                    w.log.flip();
                    Some((t.iova, Arc::clone(w)))
                })
                .collect();
            // No access reaches the windows any more: drained with the table unlocked, under
            // the log mutex (which owns the flipped bitmaps).
            drop(table);
            collect_dirty(&windows, iova, last, page_size, out);
            if let Some(src) = self.dirty_source() {
                src.report(iova, len, page_size, out);
            }
            drop(log);
            break retired;
        };
        Ok(self.finish_unmap(retired))
    }
}
