//! Keeping a client connection alive across the death of the process that serves it.
//!
//! QEMU and cloud-hypervisor never reconnect: if the server's end of the socket closes, the
//! VM loses the device. So in the pool, a supervisor (the daemon) keeps a duplicate of every
//! descriptor that makes up the client's view — the connection itself, its DMA memory fds, its
//! interrupt eventfds, the device's memory objects and a [`BlackBox`] — and the process that
//! serves the endpoint (a worker) writes down, as it goes, what a replacement needs to carry on
//! where it stopped. A `Continuity` is the worker's side of that:
//!
//! - **Custody.** Every descriptor that arrives with a message is handed to the supervisor
//!   ([`Custody::hold`], one `sendmsg`, before the message is handled) under a custody id; ids
//!   no table refers to any more are released ([`Custody::release`]).
//! - **The receive journal** (record `server.rx`): the bytes of the message being handled and
//!   of everything received after it, with the custody ids of their descriptors and the read
//!   boundaries that decide which message gets them ([`Framer::journal`]). A read is *peeked*,
//!   journaled, then consumed, and the kernel's per-socket peek offset (`SO_PEEK_OFF`, seen
//!   through the supervisor's descriptor too) tells a replacement whether the last read left
//!   the socket; so no byte is lost or read twice, whenever the kill lands.
//! - **The tables** (record `server.tables`): DMA windows (IOVA, size, file offset,
//!   protection, custody id of the memory fd) and interrupt vectors (custody id of each
//!   eventfd), published after every change and before the reply that acknowledges it.
//! - **The session** (record `server.session`): the client's VERSION request, replayed by the
//!   replacement to recover the negotiated limits.
//!
//! A replacement opens the same black box, gets the held descriptors from the supervisor,
//! rebuilds the DMA space and interrupts from the tables, resumes the device from its own
//! records, and frames the journal before reading the socket again (`Server::run_resumed`).
//! The request in flight is handled a second time: requests are idempotent for that purpose
//! (a DMA_MAP identical to a window that exists succeeds; an unmap of nothing succeeds;
//! register writes store values). A reply is never sent twice: the message leaves the journal
//! just before the `sendmsg` of its reply, and SIGKILL takes effect when a syscall returns,
//! so a kill during the send leaves the reply sent and the message answered. What remains is
//! a window of a few instructions between that publish and the syscall (and a send that has
//! to wait for a client that does not read), where a kill loses the reply: the client's
//! request times out (QEMU: after `x-msg-timeout`, 5 s) instead of the stream being
//! corrupted by a duplicate, which QEMU cannot recover from. Descriptors received in the
//! instants between the peek and the custody `sendmsg` come again with the bytes when they are
//! read again. See ARCHITECTURE.md ("What survives which failure").

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use switchyard_device::blackbox::{Area, BlackBox, BlackBoxError, Record, RecordSpec};
use switchyard_device::ratelimit::LogLimiter;
use switchyard_proto::ServerLimits;

use crate::transport::framer::{Framer, MAX_FDS_PER_READ};

/// Record names of the server.
pub const RX_RECORD: &str = "server.rx";
/// See [`RX_RECORD`].
pub const TABLES_RECORD: &str = "server.tables";
/// See [`RX_RECORD`].
pub const SESSION_RECORD: &str = "server.session";
/// The area replies are sent from (see the module documentation).
pub const REPLIES_AREA: &str = "server.replies";
/// The log of table changes since the last snapshot, and its length (see `Inner::log_op`).
pub const TABLE_LOG_AREA: &str = "server.tablog";
/// See [`TABLE_LOG_AREA`].
pub const TABLE_LOG_HEAD: &str = "server.tablog.head";

/// Table changes the log holds before it is folded into a snapshot.
const LOG_ENTRIES: usize = 16 << 10;
/// Bytes per log entry.
const LOG_ENTRY: usize = 40;
const OP_MAP: u8 = 1;
const OP_UNMAP: u8 = 2;
const OP_UNMAP_ALL: u8 = 3;
const OP_IRQ_SET: u8 = 4;
const OP_IRQ_CLEAR: u8 = 5;
const OP_IRQ_DISABLE: u8 = 6;

/// Custody ids below this are the supervisor's to assign (the connection, memory objects);
/// the server numbers message descriptors from here.
pub const FIRST_MESSAGE_ID: u64 = 1 << 16;

/// Custody id of the client connection (held from accept until the client leaves).
pub const CONNECTION_ID: u64 = 2;

/// Largest VERSION request body kept in the session record.
const MAX_VERSION_DATA: usize = 64 << 10;

const TABLES_VERSION: u32 = 1;
const SESSION_VERSION: u32 = 1;

/// Where descriptors go to outlive this process: the supervisor's side of the custody
/// channel.
pub trait Custody: Send + std::fmt::Debug {
    /// Keep duplicates of `fds` under `ids` (same length). Must have completed (the kernel has
    /// the descriptors in flight to the supervisor) when it returns.
    fn hold(&mut self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()>;
    /// The descriptors under `ids` are no longer needed.
    fn release(&mut self, ids: &[u64]) -> io::Result<()>;
}

/// A DMA window as the tables record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowRecord {
    /// First IOVA.
    pub iova: u64,
    /// Length.
    pub size: u64,
    /// Offset of the window in its file.
    pub offset: u64,
    /// Readable by the device.
    pub read: bool,
    /// Writable by the device.
    pub write: bool,
    /// Custody id of the memory fd (`None`: a window without fd, served through messages).
    pub fd: Option<u64>,
}

/// What a replacement finds in a black box (see [`Continuity::resume`]).
#[derive(Debug, Clone, Default)]
pub struct Resumed {
    /// The client's VERSION request `(major, minor, data)`, if it had negotiated.
    pub version: Option<(u16, u16, Vec<u8>)>,
    /// DMA windows.
    pub windows: Vec<WindowRecord>,
    /// Interrupt vectors `(index, vector) → custody id of the eventfd`.
    pub vectors: BTreeMap<(u32, u32), u64>,
    /// The receive journal ([`Framer::resume`]); empty if nothing was in flight.
    pub rx: Vec<u8>,
    /// The last reply sent through the reply area: `(offset in the area, length)`.
    pub pending_reply: Option<(u64, u64)>,
    /// Every custody id the records refer to.
    pub referenced: Vec<u64>,
    /// The next custody id to assign.
    pub next_id: u64,
}

#[derive(Debug)]
struct Inner {
    custody: Box<dyn Custody>,
    rx: Record,
    /// Where replies are written and sent from, and the reply being sent: `(offset in the
    /// area, length)`, recorded with the receive journal.
    replies: Area,
    pending_reply: Option<(u64, u64)>,
    /// The black box file's position after the last reply that went out whole (`None`:
    /// unknown, ask the kernel).
    reply_pos: Option<u64>,
    /// Snapshot of the tables; changes since go to the log (`log_op`), which is folded into a
    /// new snapshot when full: a change costs one entry, however many windows there are.
    tables: Record,
    log: Area,
    log_head: Record,
    log_len: usize,
    session: Record,
    next_id: u64,
    windows: BTreeMap<u64, WindowRecord>,
    vectors: BTreeMap<(u32, u32), u64>,
    /// How many table entries refer to each custody id.
    refs: BTreeMap<u64, u32>,
    /// Every message descriptor this process put into custody and has not released: what
    /// the tables refer to, the descriptors of messages received and not yet settled, and
    /// those a replacement took over. All of it goes when the client does.
    outstanding: BTreeSet<u64>,
    /// Regular files (guest memory) among them, by identity `(st_dev, st_ino)`: a descriptor
    /// of a file already in custody is not put there again but shares its custody id, so that
    /// a VMM mapping its guest RAM as thousands of windows (a vIOMMU maps page by page, each
    /// DMA_MAP with its own descriptor of the same memfd) costs one descriptor, not thousands.
    files: HashMap<FileId, u64>,
    /// The identity of each id in [`Inner::files`].
    file_of: HashMap<u64, FileId>,
    /// Messages received and not settled yet that carry each id (an id shared by several).
    pending: HashMap<u64, u32>,
    /// At most this many in [`Inner::outstanding`]: descriptors of a read that would pass it
    /// are refused (closed, never held) and their message fails with EMFILE.
    budget: Option<usize>,
    /// Reads whose descriptors were refused by the budget (see [`Continuity::held_count`]).
    over_budget: u64,
    refused: LogLimiter,
    scratch: Vec<u8>,
    failures: LogLimiter,
}

/// The worker's side of crash continuity. See the [module](self) documentation.
#[derive(Debug)]
pub struct Continuity {
    inner: Mutex<Inner>,
}

impl Continuity {
    /// The records a black box needs for a server with `limits` (add the device's).
    pub fn records(limits: &ServerLimits) -> Vec<RecordSpec> {
        let max_msg = switchyard_proto::Limits::server(limits.max_data_xfer_size).max_msg_size;
        let ids = 2 * MAX_FDS_PER_READ * 8;
        vec![
            RecordSpec::new(RX_RECORD, max_msg as usize + ids + 64),
            RecordSpec::new(
                TABLES_RECORD,
                64 + limits.max_dma_maps.min(1 << 16) as usize * 42 + 2048 * 16,
            ),
            RecordSpec::new(SESSION_RECORD, MAX_VERSION_DATA + 64),
            RecordSpec::area(REPLIES_AREA, 2 * max_msg as usize + 4096),
            RecordSpec::area(TABLE_LOG_AREA, LOG_ENTRIES * LOG_ENTRY),
            RecordSpec::new(TABLE_LOG_HEAD, 16),
        ]
    }

    /// A continuity for a worker that starts fresh: empty tables and journal are published.
    pub fn new(bb: &Arc<BlackBox>, custody: Box<dyn Custody>) -> Result<Self, BlackBoxError> {
        let c = Self::open(bb, custody, FIRST_MESSAGE_ID)?;
        {
            let mut g = c.lock();
            g.snapshot_tables();
            g.publish_session(None);
            g.rx.publish(&[])?;
        }
        Ok(c)
    }

    /// A continuity for a replacement: reads what the previous worker published.
    pub fn resume(
        bb: &Arc<BlackBox>,
        custody: Box<dyn Custody>,
    ) -> Result<(Self, Resumed), BlackBoxError> {
        let mut resumed = Resumed::default();
        let corrupt = |what: &str| BlackBoxError::Corrupt(what.to_owned());
        let rx = bb.record(RX_RECORD)?.read()?.unwrap_or_default();
        if rx.len() >= 16 {
            let at = u64::from_le_bytes(rx[..8].try_into().unwrap_or_default());
            let len = u64::from_le_bytes(rx[8..16].try_into().unwrap_or_default());
            resumed.pending_reply = (at != u64::MAX).then_some((at, len));
            resumed.rx = rx[16..].to_vec();
        } else if !rx.is_empty() {
            return Err(corrupt(RX_RECORD));
        }
        let mut windows = BTreeMap::new();
        if let Some(t) = bb.record(TABLES_RECORD)?.read()? {
            let (w, v, next) = decode_tables(&t).ok_or_else(|| corrupt(TABLES_RECORD))?;
            windows = w.into_iter().map(|w| (w.iova, w)).collect();
            resumed.vectors = v;
            resumed.next_id = next;
        }
        // The changes since the snapshot. Replaying one that the snapshot already has is
        // harmless: every change sets or removes entries, so a sequence applied twice ends
        // where it ended once.
        if let Some(h) = bb.record(TABLE_LOG_HEAD)?.read()? {
            let head = |i: usize| {
                h.get(i..i + 8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
            };
            let (Some(len), Some(next)) = (head(0), head(8)) else {
                return Err(corrupt(TABLE_LOG_HEAD));
            };
            resumed.next_id = resumed.next_id.max(next);
            let log = bb.area(TABLE_LOG_AREA)?;
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= LOG_ENTRIES)
                .ok_or_else(|| corrupt(TABLE_LOG_HEAD))?;
            let mut e = [0u8; LOG_ENTRY];
            for i in 0..len {
                log.read_at(i * LOG_ENTRY, &mut e)?;
                apply_op(&e, &mut windows, &mut resumed.vectors)
                    .ok_or_else(|| corrupt(TABLE_LOG_AREA))?;
            }
        }
        resumed.windows = windows.into_values().collect();
        if let Some(s) = bb.record(SESSION_RECORD)?.read()? {
            resumed.version = decode_session(&s).ok_or_else(|| corrupt(SESSION_RECORD))?;
        }
        resumed.referenced = resumed
            .windows
            .iter()
            .filter_map(|w| w.fd)
            .chain(resumed.vectors.values().copied())
            .collect();
        resumed.next_id = resumed.next_id.max(FIRST_MESSAGE_ID);
        let c = Self::open(bb, custody, resumed.next_id)?;
        {
            let mut g = c.lock();
            g.windows = resumed.windows.iter().map(|w| (w.iova, *w)).collect();
            g.vectors = resumed.vectors.clone();
            for id in &resumed.referenced {
                *g.refs.entry(*id).or_default() += 1;
            }
            // A fresh snapshot of what was recovered, and an empty log.
            g.snapshot_tables();
        }
        Ok((c, resumed))
    }

    fn open(
        bb: &Arc<BlackBox>,
        custody: Box<dyn Custody>,
        next_id: u64,
    ) -> Result<Self, BlackBoxError> {
        Ok(Self {
            inner: Mutex::new(Inner {
                custody,
                rx: bb.record(RX_RECORD)?,
                replies: bb.area(REPLIES_AREA)?,
                pending_reply: None,
                reply_pos: None,
                tables: bb.record(TABLES_RECORD)?,
                log: bb.area(TABLE_LOG_AREA)?,
                log_head: bb.record(TABLE_LOG_HEAD)?,
                log_len: 0,
                session: bb.record(SESSION_RECORD)?,
                next_id,
                windows: BTreeMap::new(),
                vectors: BTreeMap::new(),
                refs: BTreeMap::new(),
                outstanding: BTreeSet::new(),
                files: HashMap::new(),
                file_of: HashMap::new(),
                pending: HashMap::new(),
                budget: None,
                over_budget: 0,
                refused: LogLimiter::new(
                    "descriptors refused by the custody budget",
                    std::time::Duration::from_secs(5),
                ),
                scratch: Vec::new(),
                failures: LogLimiter::new(
                    "crash continuity degraded",
                    std::time::Duration::from_secs(5),
                ),
            }),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

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
    /// custody keeps its id: see [`Inner::files`]), or `None` when the new ones would take the
    /// client past its budget: then nothing is held (the caller closes them and the message
    /// they came with is refused).
    pub(crate) fn hold(&self, fds: &[OwnedFd]) -> Option<Vec<u64>> {
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
            return None;
        }
        for id in &ids {
            *g.pending.entry(*id).or_default() += 1;
        }
        if fresh.is_empty() {
            return Some(ids);
        }
        g.next_id = next;
        // The next id survives a restart, so that a replacement never reuses an id a message
        // in the journal carries.
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
            Err(e) => g.degraded("cannot hand descriptors to the supervisor", &e),
        }
        Some(ids)
    }

    /// Publishes the receive journal of `framer`.
    pub(crate) fn publish_rx(&self, framer: &Framer) {
        let mut g = self.lock();
        let mut buf = std::mem::take(&mut g.scratch);
        framer.journal(&mut buf);
        let (at, len) = g.pending_reply.unwrap_or((u64::MAX, 0));
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&at.to_le_bytes());
        head[8..].copy_from_slice(&len.to_le_bytes());
        if let Err(e) = g.rx.publish_parts(&[&head, &buf]) {
            g.degraded("cannot publish the receive journal", &e);
        }
        g.scratch = buf;
    }

    /// Writes `reply` into the reply area at the black box file's position (moving the
    /// position back to the start of the area first if the reply would not fit), and records
    /// it as the reply being sent: the next [`Continuity::publish_rx`] (the one that takes its
    /// request out of the journal) carries it. Then [`Continuity::send_reply`] sends it with
    /// `sendfile`, which advances the file position as bytes leave. A replacement compares
    /// the position with the recorded reply and sends exactly what had not left
    /// ([`Continuity::resend_unsent`]): no reply is lost or sent twice, whenever the kill
    /// lands. Returns `false` (nothing recorded) if the reply does not fit the area.
    pub(crate) fn prepare_reply(&self, framer: &Framer, reply: &[u8]) -> bool {
        let mut g = self.lock();
        let area_off = g.replies.file_offset();
        let cap = g.replies.capacity() as u64;
        if reply.len() as u64 > cap / 2 {
            return false;
        }
        // The file position, known without asking the kernel once a reply has gone out whole
        // (`send_reply` keeps it); asked after anything else.
        let pos = match g.reply_pos {
            Some(p) => p,
            None => match rustix::fs::seek(g.replies.file(), rustix::fs::SeekFrom::Current(0)) {
                Ok(p) => p,
                Err(e) => {
                    g.degraded("cannot read the reply area's position", &e);
                    return false;
                }
            },
        };
        g.reply_pos = None;
        let mut at = pos
            .checked_sub(area_off)
            .filter(|a| *a <= cap)
            .unwrap_or(cap);
        if at + reply.len() as u64 > cap {
            // Back to the start of the area. The reply before was sent (its `sendfile`
            // returned): the journal stops naming it first, so that a kill between the two
            // steps cannot make a replacement take the rewound position for an unsent reply.
            g.pending_reply = None;
            let mut buf = std::mem::take(&mut g.scratch);
            framer.journal(&mut buf);
            let head = [0xffu8; 8];
            let publish = g.rx.publish_parts(&[&head, &[0u8; 8], &buf]);
            g.scratch = buf;
            if let Err(e) = publish {
                g.degraded("cannot publish the receive journal", &e);
                return false;
            }
            if let Err(e) =
                rustix::fs::seek(g.replies.file(), rustix::fs::SeekFrom::Start(area_off))
            {
                g.degraded("cannot rewind the reply area", &e);
                return false;
            }
            at = 0;
        }
        if let Err(e) = g.replies.write_at(at as usize, reply) {
            g.degraded("cannot write the reply area", &e);
            return false;
        }
        g.pending_reply = Some((at, reply.len() as u64));
        true
    }

    /// Sends the prepared reply to `sock` from the reply area (`sendfile` at the file's
    /// position), all of it within `timeout` (a client that does not read is given up on
    /// then, however many partial sends it let through).
    pub(crate) fn send_reply(
        &self,
        sock: &std::os::unix::net::UnixStream,
        timeout: std::time::Duration,
    ) -> io::Result<()> {
        let mut g = self.lock();
        let Some((at, len)) = g.pending_reply else {
            return Err(io::Error::other("no prepared reply"));
        };
        sendfile_all(sock, g.replies.file(), len, timeout)?;
        g.reply_pos = Some(g.replies.file_offset() + at + len);
        Ok(())
    }

    /// In a replacement: sends what of the last reply had not left when the process died
    /// (the file position says how much had), within `timeout`. Returns the bytes sent.
    pub fn resend_unsent(
        &self,
        resumed: &Resumed,
        sock: &std::os::unix::net::UnixStream,
        timeout: std::time::Duration,
    ) -> io::Result<u64> {
        let Some((at, len)) = resumed.pending_reply else {
            return Ok(0);
        };
        let mut g = self.lock();
        g.pending_reply = resumed.pending_reply;
        let area_off = g.replies.file_offset();
        let pos = rustix::fs::seek(g.replies.file(), rustix::fs::SeekFrom::Current(0))?;
        let start = area_off + at;
        let end = start + len;
        if pos >= end {
            return Ok(0);
        }
        if pos < start {
            return Err(io::Error::other(format!(
                "reply area position {pos} before the reply being sent ({start})"
            )));
        }
        let unsent = end - pos;
        sendfile_all(sock, g.replies.file(), unsent, timeout)?;
        Ok(unsent)
    }

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
    fn degraded(&self, what: &str, e: &dyn std::error::Error) {
        if self.failures.allow() {
            tracing::warn!(error = %e, "{what}: a restart of this process would lose state");
        }
    }

    fn release(&mut self, ids: &[u64]) {
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
    fn release_unused(&mut self, ids: &[u64]) {
        let unused: BTreeSet<u64> = ids
            .iter()
            .copied()
            .filter(|id| !self.refs.contains_key(id) && !self.pending.contains_key(id))
            .collect();
        let unused: Vec<u64> = unused.into_iter().collect();
        self.release(&unused);
    }

    /// Drops one reference to custody id `id`; true if none is left.
    fn unref(&mut self, id: u64) -> bool {
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

    /// Appends a table change to the log (one entry, then the log's length, published); a
    /// full log is first folded into a snapshot.
    fn log_op(&mut self, entry: &[u8; LOG_ENTRY]) {
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

    fn publish_log_head(&mut self) {
        let mut h = [0u8; 16];
        h[..8].copy_from_slice(&(self.log_len as u64).to_le_bytes());
        h[8..].copy_from_slice(&self.next_id.to_le_bytes());
        if let Err(e) = self.log_head.publish(&h) {
            self.degraded("cannot publish the table log", &e);
        }
    }

    /// Publishes the whole tables, then empties the log (a kill between the two replays the
    /// log onto the new snapshot, which changes nothing: see `Continuity::resume`).
    fn snapshot_tables(&mut self) {
        self.publish_tables();
        self.log_len = 0;
        self.publish_log_head();
    }

    fn publish_tables(&mut self) {
        let mut b = std::mem::take(&mut self.scratch);
        b.clear();
        b.extend_from_slice(&TABLES_VERSION.to_le_bytes());
        b.extend_from_slice(&self.next_id.to_le_bytes());
        b.extend_from_slice(&(self.windows.len() as u32).to_le_bytes());
        for w in self.windows.values() {
            b.extend_from_slice(&w.iova.to_le_bytes());
            b.extend_from_slice(&w.size.to_le_bytes());
            b.extend_from_slice(&w.offset.to_le_bytes());
            b.push(u8::from(w.read) | u8::from(w.write) << 1 | u8::from(w.fd.is_some()) << 2);
            b.extend_from_slice(&w.fd.unwrap_or(0).to_le_bytes());
        }
        b.extend_from_slice(&(self.vectors.len() as u32).to_le_bytes());
        for (&(i, v), id) in &self.vectors {
            b.extend_from_slice(&i.to_le_bytes());
            b.extend_from_slice(&v.to_le_bytes());
            b.extend_from_slice(&id.to_le_bytes());
        }
        if let Err(e) = self.tables.publish(&b) {
            self.degraded("cannot publish the DMA and interrupt tables", &e);
        }
        self.scratch = b;
    }

    fn publish_session(&mut self, version: Option<(u16, u16, &[u8])>) {
        let mut b = Vec::with_capacity(16);
        b.extend_from_slice(&SESSION_VERSION.to_le_bytes());
        match version {
            Some((major, minor, data)) if data.len() <= MAX_VERSION_DATA => {
                b.push(1);
                b.extend_from_slice(&major.to_le_bytes());
                b.extend_from_slice(&minor.to_le_bytes());
                b.extend_from_slice(&(data.len() as u32).to_le_bytes());
                b.extend_from_slice(data);
            }
            _ => b.push(0),
        }
        if let Err(e) = self.session.publish(&b) {
            self.degraded("cannot publish the session", &e);
        }
    }
}

/// A file's identity: `(st_dev, st_ino)`.
type FileId = (u64, u64);

/// The identity of `fd` if it is a regular file (guest memory). Other kinds are never
/// shared: every eventfd has the same (anonymous) inode.
fn regular_file(fd: BorrowedFd<'_>) -> Option<FileId> {
    let st = rustix::fs::fstat(fd).ok()?;
    rustix::fs::FileType::from_raw_mode(st.st_mode)
        .is_file()
        .then_some((st.st_dev, st.st_ino))
}

/// Sends `len` bytes of `file` from its position to `sock` (`sendfile`, which advances the
/// position as the bytes leave), within `timeout` in all.
///
/// The socket's send timeout (`SO_SNDTIMEO`, set to `timeout` by the connection) bounds one
/// wait; a client that reads a little now and then would reset it with every partial send,
/// so after a partial send the socket's timeout is lowered to what is left of `timeout` (and
/// put back afterwards).
fn sendfile_all(
    sock: &std::os::unix::net::UnixStream,
    file: &std::fs::File,
    len: u64,
    timeout: std::time::Duration,
) -> io::Result<()> {
    use rustix::net::sockopt::{Timeout, set_socket_timeout};
    let deadline = std::time::Instant::now() + timeout;
    let mut left = usize::try_from(len).map_err(io::Error::other)?;
    let mut shortened = false;
    let result = loop {
        if left == 0 {
            break Ok(());
        }
        match rustix::fs::sendfile(sock, file, None, left) {
            Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                left -= n;
                if left > 0 {
                    let rest = deadline.saturating_duration_since(std::time::Instant::now());
                    if rest.is_zero() {
                        break Err(io::ErrorKind::TimedOut.into());
                    }
                    // Zero would mean "no timeout".
                    let rest = rest.max(std::time::Duration::from_millis(1));
                    if let Err(e) = set_socket_timeout(sock, Timeout::Send, Some(rest)) {
                        break Err(e.into());
                    }
                    shortened = true;
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => break Err(io::ErrorKind::TimedOut.into()),
            Err(e) => break Err(e.into()),
        }
    };
    if shortened && let Err(e) = set_socket_timeout(sock, Timeout::Send, Some(timeout)) {
        tracing::warn!(error = %e, "cannot restore the reply send timeout (SO_SNDTIMEO)");
    }
    result
}

/// A change of the tables, as the log records it.
#[derive(Debug, Clone, Copy)]
enum Op {
    Map(WindowRecord),
    Unmap { iova: u64, size: u64 },
    UnmapAll,
    IrqSet { index: u32, vector: u32, id: u64 },
    IrqClear { index: u32, vector: u32 },
    IrqDisable { index: u32 },
}

fn encode_op(op: Op) -> [u8; LOG_ENTRY] {
    let mut e = [0u8; LOG_ENTRY];
    let mut put = |at: usize, b: &[u8]| e[at..at + b.len()].copy_from_slice(b);
    match op {
        Op::Map(w) => {
            put(0, &[OP_MAP]);
            put(
                1,
                &[u8::from(w.read) | u8::from(w.write) << 1 | u8::from(w.fd.is_some()) << 2],
            );
            put(8, &w.iova.to_le_bytes());
            put(16, &w.size.to_le_bytes());
            put(24, &w.offset.to_le_bytes());
            put(32, &w.fd.unwrap_or(0).to_le_bytes());
        }
        Op::Unmap { iova, size } => {
            put(0, &[OP_UNMAP]);
            put(8, &iova.to_le_bytes());
            put(16, &size.to_le_bytes());
        }
        Op::UnmapAll => put(0, &[OP_UNMAP_ALL]),
        Op::IrqSet { index, vector, id } => {
            put(0, &[OP_IRQ_SET]);
            put(4, &index.to_le_bytes());
            put(8, &vector.to_le_bytes());
            put(16, &id.to_le_bytes());
        }
        Op::IrqClear { index, vector } => {
            put(0, &[OP_IRQ_CLEAR]);
            put(4, &index.to_le_bytes());
            put(8, &vector.to_le_bytes());
        }
        Op::IrqDisable { index } => {
            put(0, &[OP_IRQ_DISABLE]);
            put(4, &index.to_le_bytes());
        }
    }
    e
}

/// Applies one log entry to tables being recovered; `None` if it does not decode.
fn apply_op(
    e: &[u8; LOG_ENTRY],
    windows: &mut BTreeMap<u64, WindowRecord>,
    vectors: &mut BTreeMap<(u32, u32), u64>,
) -> Option<()> {
    let u64_at = |at: usize| e.get(at..at + 8)?.try_into().ok().map(u64::from_le_bytes);
    let u32_at = |at: usize| e.get(at..at + 4)?.try_into().ok().map(u32::from_le_bytes);
    match e[0] {
        OP_MAP => {
            let flags = e[1];
            let w = WindowRecord {
                iova: u64_at(8)?,
                size: u64_at(16)?,
                offset: u64_at(24)?,
                read: flags & 1 != 0,
                write: flags & 2 != 0,
                fd: (flags & 4 != 0).then_some(u64_at(32)?),
            };
            windows.insert(w.iova, w);
        }
        OP_UNMAP => {
            let (iova, size) = (u64_at(8)?, u64_at(16)?);
            let end = iova.saturating_add(size);
            windows.retain(|_, w| !(w.iova >= iova && w.iova.saturating_add(w.size) <= end));
        }
        OP_UNMAP_ALL => windows.clear(),
        OP_IRQ_SET => {
            vectors.insert((u32_at(4)?, u32_at(8)?), u64_at(16)?);
        }
        OP_IRQ_CLEAR => {
            vectors.remove(&(u32_at(4)?, u32_at(8)?));
        }
        OP_IRQ_DISABLE => {
            let index = u32_at(4)?;
            vectors.retain(|(i, _), _| *i != index);
        }
        _ => return None,
    }
    Some(())
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (h, t) = self.0.split_at_checked(n)?;
        self.0 = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2)?.try_into().ok().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
}

type Tables = (Vec<WindowRecord>, BTreeMap<(u32, u32), u64>, u64);

fn decode_tables(b: &[u8]) -> Option<Tables> {
    let mut r = Reader(b);
    if r.u32()? != TABLES_VERSION {
        return None;
    }
    let next = r.u64()?;
    let n = r.u32()? as usize;
    let mut windows = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let iova = r.u64()?;
        let size = r.u64()?;
        let offset = r.u64()?;
        let flags = r.u8()?;
        let fd = r.u64()?;
        windows.push(WindowRecord {
            iova,
            size,
            offset,
            read: flags & 1 != 0,
            write: flags & 2 != 0,
            fd: (flags & 4 != 0).then_some(fd),
        });
    }
    let n = r.u32()? as usize;
    let mut vectors = BTreeMap::new();
    for _ in 0..n {
        let i = r.u32()?;
        let v = r.u32()?;
        vectors.insert((i, v), r.u64()?);
    }
    r.0.is_empty().then_some((windows, vectors, next))
}

type Version = Option<(u16, u16, Vec<u8>)>;

fn decode_session(b: &[u8]) -> Option<Version> {
    let mut r = Reader(b);
    if r.u32()? != SESSION_VERSION {
        return None;
    }
    match r.u8()? {
        0 => Some(None),
        1 => {
            let major = r.u16()?;
            let minor = r.u16()?;
            let n = r.u32()? as usize;
            let data = r.take(n)?.to_vec();
            r.0.is_empty().then_some(Some((major, minor, data)))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests;
