//! Custody accounting: which of the client's descriptors this process has put into custody,
//! which message or table entry still needs each, what is released and when, and the budget
//! that caps them.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use super::ids::{CONNECTION_ID, FIRST_MESSAGE_ID};
use super::{Continuity, FileId, Inner};
use crate::framer::FdRefusal;

impl Continuity {
    /// A client connected: its connection goes into custody.
    pub(crate) fn connection(&self, stream: &std::os::unix::net::UnixStream) {
        let mut g = self.lock();
        if let Err(e) = g.custody.hold(&[CONNECTION_ID], &[stream.as_fd()]) {
            g.degraded("cannot hand the connection to the supervisor", &e);
        }
    }

    /// Caps the client's descriptors in custody at `budget`: a read past it is refused,
    /// nothing of it is held and its message fails with EMFILE.
    pub fn set_budget(&self, budget: Option<usize>) {
        self.lock().budget = budget;
    }

    /// The budget set by [`Continuity::set_budget`].
    pub fn budget(&self) -> Option<usize> {
        self.lock().budget
    }

    /// `(descriptors of the client in custody, reads refused by the budget)`.
    pub fn held_count(&self) -> (usize, u64) {
        let g = self.lock();
        (g.outstanding.len(), g.over_budget)
    }

    /// A replacement took over `held` from the supervisor (message descriptors by custody
    /// id): they are this process's to release from now on.
    pub fn took_over(&self, held: &BTreeMap<u64, OwnedFd>) {
        let mut g = self.lock();
        for (&id, fd) in held.range(FIRST_MESSAGE_ID..) {
            g.outstanding.insert(id);
            if let Some(file) = regular_file(fd.as_fd()) {
                g.files.entry(file).or_insert(id);
                g.file_of.insert(id, file);
            }
        }
    }

    /// A replacement's framer holds `ids` for messages of the journal (one per descriptor):
    /// they stay in custody until those messages are settled.
    pub fn journaled(&self, ids: &[u64]) {
        let mut g = self.lock();
        for id in ids {
            *g.pending.entry(*id).or_default() += 1;
        }
    }

    /// Puts descriptors that just arrived into custody; returns their ids (a file already in
    /// custody keeps its id: see [`Inner::files`]). Refused, nothing held (the caller closes
    /// them and the message they came with is refused): [`FdRefusal::Truncated`] when the new
    /// ones would take the client past its budget, [`FdRefusal::Busy`] when custody cannot
    /// take them now (its queue to the supervisor is full: `WouldBlock`).
    pub(crate) fn hold(&self, fds: &[OwnedFd]) -> Result<Vec<u64>, FdRefusal> {
        let mut g = self.lock();
        // Which descriptors are new to custody, and the id of each.
        let mut ids = Vec::with_capacity(fds.len());
        let mut fresh: Vec<(u64, BorrowedFd<'_>, Option<FileId>)> = Vec::new();
        let mut next = g.next_id;
        for fd in fds {
            let file = regular_file(fd.as_fd());
            let known = file.and_then(|f| {
                g.files.get(&f).copied().or_else(|| {
                    fresh
                        .iter()
                        .find(|(_, _, other)| *other == Some(f))
                        .map(|(id, _, _)| *id)
                })
            });
            match known {
                Some(id) => ids.push(id),
                None => {
                    ids.push(next);
                    fresh.push((next, fd.as_fd(), file));
                    next += 1;
                }
            }
        }
        if let Some(budget) = g.budget
            && g.outstanding.len().saturating_add(fresh.len()) > budget
        {
            g.over_budget += 1;
            if g.refused.allow() {
                tracing::warn!(
                    held = g.outstanding.len(),
                    arriving = fresh.len(),
                    budget,
                    "the client's descriptors would pass its custody budget; the message is refused (EMFILE)"
                );
            }
            return Err(FdRefusal::Truncated);
        }
        if !fresh.is_empty() {
            g.next_id = next;
            // The next id survives a restart, so that a replacement never reuses an id a
            // message in the journal carries.
            g.publish_log_head();
            let new_ids: Vec<u64> = fresh.iter().map(|(id, _, _)| *id).collect();
            let borrowed: Vec<BorrowedFd<'_>> = fresh.iter().map(|(_, fd, _)| *fd).collect();
            match g.custody.hold(&new_ids, &borrowed) {
                Ok(()) => {
                    for (id, _, file) in &fresh {
                        g.outstanding.insert(*id);
                        if let Some(file) = file {
                            g.files.insert(*file, *id);
                            g.file_of.insert(*id, *file);
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // Nothing was held (the ids are skipped, never reused).
                    if g.refused.allow() {
                        tracing::warn!(
                            arriving = fresh.len(),
                            "custody is behind (its queue to the supervisor is full); the message is refused (EAGAIN)"
                        );
                    }
                    return Err(FdRefusal::Busy);
                }
                Err(e) => g.degraded("cannot hand descriptors to the supervisor", &e),
            }
        }
        for id in &ids {
            *g.pending.entry(*id).or_default() += 1;
        }
        Ok(ids)
    }

    /// A message with descriptors `ids` has been handled: those no table refers to are
    /// released.
    pub(crate) fn settle(&self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        let mut g = self.lock();
        for id in ids {
            if let Some(n) = g.pending.get_mut(id) {
                *n -= 1;
                if *n == 0 {
                    g.pending.remove(id);
                }
            }
        }
        g.release_unused(ids);
    }

    /// Releases ids a replacement found held but unreferenced.
    pub fn release(&self, ids: &[u64]) {
        self.lock().release(ids);
    }

    /// The client is gone: tables, session and journal are cleared and every descriptor
    /// released.
    pub(crate) fn client_gone(&self) {
        let mut g = self.lock();
        // Everything still held for this client: what the tables refer to, and descriptors of
        // messages that were never handled (cut short, unframeable, refused) or that a
        // framer dropped.
        let all: BTreeSet<u64> = g
            .windows
            .values()
            .filter_map(|w| w.fd)
            .chain(g.vectors.values().copied())
            .chain(g.outstanding.iter().copied())
            .collect();
        let all: Vec<u64> = all.into_iter().collect();
        g.windows.clear();
        g.vectors.clear();
        g.refs.clear();
        g.snapshot_tables();
        g.publish_session(None);
        g.pending_reply = None;
        if let Err(e) = g.rx.publish(&[]) {
            g.degraded("cannot clear the receive journal", &e);
        }
        g.release(&all);
        g.release(&[CONNECTION_ID]);
    }
}

impl Inner {
    pub(super) fn release(&mut self, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        for id in ids {
            self.outstanding.remove(id);
            self.pending.remove(id);
            if let Some(file) = self.file_of.remove(id) {
                self.files.remove(&file);
            }
        }
        if let Err(e) = self.custody.release(ids) {
            self.degraded("cannot release descriptors held by the supervisor", &e);
        }
    }

    /// Releases those of `ids` that no table refers to and no unsettled message carries
    /// (each once).
    pub(super) fn release_unused(&mut self, ids: &[u64]) {
        let unused: BTreeSet<u64> = ids
            .iter()
            .copied()
            .filter(|id| !self.refs.contains_key(id) && !self.pending.contains_key(id))
            .collect();
        let unused: Vec<u64> = unused.into_iter().collect();
        self.release(&unused);
    }

    /// Drops one reference to custody id `id`; true if none is left.
    pub(super) fn unref(&mut self, id: u64) -> bool {
        match self.refs.get_mut(&id) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            Some(_) => {
                self.refs.remove(&id);
                true
            }
            None => true,
        }
    }
}

/// The identity of `fd` if it is a regular file (guest memory). Other kinds are never
/// shared: every eventfd has the same (anonymous) inode.
fn regular_file(fd: BorrowedFd<'_>) -> Option<FileId> {
    let st = rustix::fs::fstat(fd).ok()?;
    rustix::fs::FileType::from_raw_mode(st.st_mode)
        .is_file()
        .then_some((st.st_dev, st.st_ino))
}
