//! Maps, unmaps and replays: the table's write lock is held only to change the table; the
//! device's observer is told with no lock of the space held (see the [module docs](super)).

use std::collections::HashSet;
use std::fs::File;
use std::sync::Arc;

use super::{Backing, DmaError, DmaProt, DmaSpace, Mapping, Result, State, Table, Told};

/// Windows marked retiring by an unmap, whose observer is still to be told.
pub(super) struct Retired(pub(super) Vec<Told>);

impl DmaSpace {
    /// Adds a window. With `backing = Some((file, offset))` the window is mmapped from that file;
    /// without, it is message-only. The range is reserved first (an overlapping map is refused,
    /// the reservation counts against the limit), the observer is told with no lock held, and
    /// only then can accesses reach the window.
    pub fn map(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        backing: Option<(File, u64)>,
    ) -> Result<()> {
        let end = iova.checked_add(size).filter(|_| size > 0);
        let Some(end) = end else {
            return Err(DmaError::BadWindow { iova, size });
        };
        // Build the mapping before taking the lock: mmap can be slow.
        let backing = match backing {
            None => Backing::Message,
            Some((file, offset)) => {
                Backing::Fd(Arc::new(self.map_file(iova, size, prot, file, offset)?))
            }
        };
        let told = {
            let mut table = self.write_table();
            // Pending and retiring windows count: the limit is exact.
            if table.maps.len() >= self.max_maps {
                return Err(DmaError::TooManyMappings {
                    limit: self.max_maps,
                });
            }
            let idx = table.maps.partition_point(|m| m.iova < iova);
            let overlaps_prev = idx
                .checked_sub(1)
                .and_then(|i| table.maps.get(i))
                .is_some_and(|prev| prev.end() > iova);
            let overlaps_next = table.maps.get(idx).is_some_and(|next| next.iova < end);
            if overlaps_prev || overlaps_next {
                return Err(DmaError::Overlap { iova, size });
            }
            table.generation += 1;
            let m = Mapping {
                iova,
                size,
                prot,
                backing,
                state: State::Pending,
                generation: table.generation,
            };
            let told = Told::of(&m);
            table.maps.insert(idx, m);
            told
        };
        let observer = self.observer();
        if let Some(o) = &observer
            && let Err(e) = o.mapping(iova, size, prot, told.file())
        {
            self.drop_reservation(told);
            return Err(DmaError::Observer(Box::new(e)));
        }
        let published = {
            // A window mapped during a logging session is logged from its first write: it had
            // none before (accesses did not see it), and its log is there when they do.
            let log = self.log_state();
            let mut table = self.write_table();
            let logged = match (log.page_size.is_some(), &told.window) {
                (true, Some(w)) => self.allocate_logs(std::iter::once(&**w)),
                _ => Ok(()),
            };
            // Only this map removes its reservation (an unmap waits for it).
            let idx = table.index_of(iova, told.generation);
            match (logged, idx.and_then(|i| table.maps.get_mut(i))) {
                (Ok(()), Some(m)) => {
                    m.state = State::Live;
                    Ok(())
                }
                (Ok(()), None) => Err(DmaError::Unmapped { iova }),
                (Err(e), _) => Err(e),
            }
        };
        if let Err(e) = published {
            if let Some(o) = &observer {
                o.unmapped(iova, size);
            }
            self.drop_reservation(told);
            return Err(e);
        }
        self.settle();
        Ok(())
    }

    /// Removes the pending window `told` (its map failed) and wakes the unmaps waiting for it.
    fn drop_reservation(&self, told: Told) {
        let removed = {
            let mut table = self.write_table();
            match table.index_of(told.iova, told.generation) {
                Some(idx) => vec![table.maps.remove(idx)],
                None => Vec::new(),
            }
        };
        self.forget_logs(&removed);
        self.settle();
        drop(told);
        // The mmap goes away here, outside the lock.
        drop(removed);
    }

    /// Removes every window that lies entirely inside `[iova, iova+size)` and returns how many
    /// were removed. Like the kernel's type1 IOMMU (and unlike the spec text, which asks for an
    /// exact match), a range may cover several windows, or none (QEMU with a vIOMMU
    /// invalidates large ranges at once, including ranges it never mapped): that removes
    /// nothing and succeeds. A window that straddles the range boundary is an error (nothing
    /// is removed). Returns once no access reaches the windows and the observer was told.
    pub fn unmap(&self, iova: u64, size: u64) -> Result<usize> {
        let retired = loop {
            let mut table = self.write_table();
            let (first, stop) = Self::covered(&table, iova, size)?;
            match self.retire(&mut table, first, stop) {
                Ok(r) => break r,
                Err(seen) => {
                    drop(table);
                    self.wait_settled(seen);
                }
            }
        };
        Ok(self.finish_unmap(retired))
    }

    /// Removes every window (client `DMA_UNMAP` with the ALL flag, or client disconnect).
    pub fn unmap_all(&self) {
        let retired = loop {
            let mut table = self.write_table();
            let stop = table.maps.len();
            match self.retire(&mut table, 0, stop) {
                Ok(r) => break r,
                Err(seen) => {
                    drop(table);
                    self.wait_settled(seen);
                }
            }
        };
        self.finish_unmap(retired);
    }

    /// Marks the windows `first..stop` retiring (accesses no longer see them); call with the
    /// table write-locked. If one of them is pending, replaying or retiring, nothing changes and
    /// the settle count to wait past ([`DmaSpace::wait_settled`]) is returned instead.
    pub(super) fn retire(
        &self,
        table: &mut Table,
        first: usize,
        stop: usize,
    ) -> std::result::Result<Retired, u64> {
        let hit = table.maps.get_mut(first..stop).unwrap_or_default();
        if hit.iter().any(|m| m.state != State::Live) {
            return Err(*self.settled.lock().unwrap_or_else(|p| p.into_inner()));
        }
        Ok(Retired(
            hit.iter_mut()
                .map(|m| {
                    m.state = State::Retiring;
                    Told::of(m)
                })
                .collect(),
        ))
    }

    /// Tells the observer the retired windows are gone (no lock held), then removes them: their
    /// logs' memory goes back to the budget, their mmaps are dropped. Returns how many.
    pub(super) fn finish_unmap(&self, retired: Retired) -> usize {
        let n = retired.0.len();
        if n == 0 {
            return 0;
        }
        if let Some(o) = self.observer() {
            for t in &retired.0 {
                o.unmapped(t.iova, t.size);
            }
        }
        let which: HashSet<u64> = retired.0.iter().map(|t| t.generation).collect();
        let removed = self.write_table().extract(&which);
        self.forget_logs(&removed);
        self.settle();
        drop(retired);
        // The mmaps go away here, outside the lock.
        drop(removed);
        n
    }

    /// A pending, replaying or retiring window left that state: wakes the unmaps waiting for
    /// it.
    fn settle(&self) {
        let mut settled = self.settled.lock().unwrap_or_else(|p| p.into_inner());
        *settled = settled.wrapping_add(1);
        self.settle_cv.notify_all();
    }

    /// Waits until some pending or retiring window settled after `seen` was read (under the
    /// table's lock, with that window in the table). Holds no lock of the space but its own.
    pub(super) fn wait_settled(&self, seen: u64) {
        let mut settled = self.settled.lock().unwrap_or_else(|p| p.into_inner());
        while *settled == seen {
            settled = self
                .settle_cv
                .wait(settled)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Tells the installed observer about every window already in the table, as if each
    /// were mapped now (a device that takes a slot whose tables were restored before it was
    /// built: its IOMMU must see them all before it serves). Accesses keep reaching the
    /// windows meanwhile (the device was built on them and may run already: a replacement's
    /// engines replaying the commands its predecessor was running), an unmap waits for them
    /// (the observer runs with no lock held). A window the observer refuses is removed from
    /// the table (the others stay); returned with the refusal.
    pub fn replay_to_observer(&self) -> Vec<(u64, u64, DmaError)> {
        let Some(o) = self.observer() else {
            return Vec::new();
        };
        let told: Vec<Told> = {
            let mut table = self.write_table();
            table
                .maps
                .iter_mut()
                .filter(|m| m.state == State::Live)
                .map(|m| {
                    m.state = State::Replaying;
                    Told::of(m)
                })
                .collect()
        };
        let mut refused = Vec::new();
        let mut dropped = HashSet::new();
        for t in &told {
            if let Err(e) = o.mapping(t.iova, t.size, t.prot, t.file()) {
                refused.push((t.iova, t.size, DmaError::Observer(Box::new(e))));
                dropped.insert(t.generation);
            }
        }
        let removed = {
            let mut table = self.write_table();
            let ours: HashSet<u64> = told.iter().map(|t| t.generation).collect();
            for m in &mut table.maps {
                if m.state == State::Replaying
                    && ours.contains(&m.generation)
                    && !dropped.contains(&m.generation)
                {
                    m.state = State::Live;
                }
            }
            table.extract(&dropped)
        };
        // Not `finish_unmap()`: the observer never accepted these.
        self.forget_logs(&removed);
        self.settle();
        drop(told);
        drop(removed);
        refused
    }
}
