//! The DMA and interrupt tables and the session, as the client changes them: each change
//! costs one entry in the table log, which is folded into a new snapshot when full.

use super::records::{
    LOG_ENTRIES, LOG_ENTRY, Op, WindowRecord, encode_op, encode_session, encode_tables,
};
use super::{Continuity, Inner};

impl Continuity {
    /// The client negotiated with this VERSION request.
    pub(crate) fn version(&self, major: u16, minor: u16, data: &[u8]) {
        self.lock().publish_session(Some((major, minor, data)));
    }

    /// Whether a window identical to this one is in the tables (a DMA_MAP replayed after a
    /// restart).
    pub(crate) fn has_window(&self, w: &WindowRecord, fd_id: Option<u64>) -> bool {
        let g = self.lock();
        g.windows
            .get(&w.iova)
            .is_some_and(|e| WindowRecord { fd: fd_id, ..*w } == *e)
    }

    /// A window was mapped.
    pub(crate) fn dma_mapped(&self, w: WindowRecord) {
        let mut g = self.lock();
        if let Some(old) = g.windows.insert(w.iova, w)
            && let Some(id) = old.fd
        {
            g.unref(id);
        }
        if let Some(id) = w.fd {
            *g.refs.entry(id).or_default() += 1;
        }
        g.log_op(&encode_op(Op::Map(w)));
    }

    /// `[iova, iova + size)` was unmapped: the windows entirely inside it are gone (the DMA
    /// space's rule).
    pub(crate) fn dma_unmapped(&self, iova: u64, size: u64) {
        let mut g = self.lock();
        let end = iova.saturating_add(size);
        let gone: Vec<u64> = g
            .windows
            .range(iova..end)
            .filter(|(_, w)| w.iova.saturating_add(w.size) <= end)
            .map(|(k, _)| *k)
            .collect();
        if gone.is_empty() {
            return;
        }
        let mut released = Vec::new();
        for k in gone {
            if let Some(w) = g.windows.remove(&k)
                && let Some(id) = w.fd
                && g.unref(id)
            {
                released.push(id);
            }
        }
        g.log_op(&encode_op(Op::Unmap { iova, size }));
        g.release_unused(&released);
    }

    /// Every window was unmapped.
    pub(crate) fn dma_unmapped_all(&self) {
        let mut g = self.lock();
        let ids: Vec<u64> = g.windows.values().filter_map(|w| w.fd).collect();
        g.windows.clear();
        let released: Vec<u64> = ids.into_iter().filter(|id| g.unref(*id)).collect();
        g.log_op(&encode_op(Op::UnmapAll));
        g.release_unused(&released);
    }

    /// Vectors `start..` of `index` now have these eventfds (`None`: de-assigned).
    pub(crate) fn irqs_set(&self, index: u32, start: u32, ids: &[Option<u64>]) {
        let mut g = self.lock();
        let mut released = Vec::new();
        for (v, id) in (start..).zip(ids) {
            let old = match id {
                Some(id) => {
                    *g.refs.entry(*id).or_default() += 1;
                    g.vectors.insert((index, v), *id)
                }
                None => g.vectors.remove(&(index, v)),
            };
            if let Some(old) = old
                && g.unref(old)
            {
                released.push(old);
            }
            let op = match id {
                Some(id) => Op::IrqSet {
                    index,
                    vector: v,
                    id: *id,
                },
                None => Op::IrqClear { index, vector: v },
            };
            g.log_op(&encode_op(op));
        }
        g.release_unused(&released);
    }

    /// Every vector of `index` was disabled.
    pub(crate) fn irqs_disabled(&self, index: u32) {
        let mut g = self.lock();
        let ids: Vec<u64> = g
            .vectors
            .iter()
            .filter(|((i, _), _)| *i == index)
            .map(|(_, id)| *id)
            .collect();
        g.vectors.retain(|(i, _), _| *i != index);
        let released: Vec<u64> = ids.into_iter().filter(|id| g.unref(*id)).collect();
        g.log_op(&encode_op(Op::IrqDisable { index }));
        g.release_unused(&released);
    }

    /// A replacement could not restore these windows and vectors ([`crate::Unrestored`]):
    /// they leave the tables, and their descriptors custody, as if the client had unmapped
    /// and de-assigned them (the supervisor is told separately, loudly).
    pub fn forget(&self, lost: &crate::Unrestored) {
        for &(iova, size) in &lost.windows {
            self.dma_unmapped(iova, size);
        }
        for &(index, vector) in &lost.vectors {
            self.irqs_set(index, vector, &[None]);
        }
    }
}

impl Inner {
    /// full log is first folded into a snapshot.
    pub(super) fn log_op(&mut self, entry: &[u8; LOG_ENTRY]) {
        if self.log_len >= LOG_ENTRIES {
            // The snapshot already has this change (the tables in memory are updated
            // first); the log restarts empty.
            self.snapshot_tables();
            return;
        }
        if let Err(e) = self.log.write_at(self.log_len * LOG_ENTRY, entry) {
            self.degraded("cannot append to the table log", &e);
            return;
        }
        self.log_len += 1;
        self.publish_log_head();
    }

    pub(super) fn publish_log_head(&mut self) {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&(self.log_len as u64).to_le_bytes());
        h[8..].copy_from_slice(&self.next_id.to_le_bytes());
        if let Err(e) = self.log_head.publish(&h) {
            self.degraded("cannot publish the table log", &e);
        }
    }

    /// Publishes the whole tables, then empties the log (a kill between the two replays the
    /// log onto the new snapshot, which changes nothing: see `Continuity::resume`).
    pub(super) fn snapshot_tables(&mut self) {
        self.publish_tables();
        self.log_len = 0;
        self.publish_log_head();
    }

    pub(super) fn publish_tables(&mut self) {
        let mut b = std::mem::take(&mut self.scratch);
        encode_tables(&mut b, self.next_id, &self.windows, &self.vectors);
        if let Err(e) = self.tables.publish(&b) {
            self.degraded("cannot publish the DMA and interrupt tables", &e);
        }
        self.scratch = b;
    }

    pub(super) fn publish_session(&mut self, version: Option<(u16, u16, &[u8])>) {
        let b = encode_session(version);
        if let Err(e) = self.session.publish(&b) {
            self.degraded("cannot publish the session", &e);
        }
    }
}
