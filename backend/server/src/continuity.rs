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
//!   boundaries that decide which message gets them ([`Framer::journal`](crate::transport::Framer::journal)). A read is *peeked*,
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
//!
//! The parts: `ledger` (custody: what is held, what is released, the budget), `journal` (the
//! receive journal and the reply area), `tables` (the DMA and interrupt tables and the session,
//! published as they change), `records` (their encodings in the black box), `resume` (a
//! replacement reading them back), `ids` (the custody ids).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, Mutex, MutexGuard};

use switchyard_device::blackbox::{Area, BlackBox, BlackBoxError, Record, RecordSpec};
use switchyard_device::ratelimit::LogLimiter;
use switchyard_proto::ServerLimits;

use crate::framer::MAX_FDS_PER_READ;

mod ids;
mod journal;
mod ledger;
mod records;
mod resume;
mod tables;

pub use ids::{BLACK_BOX_ID, CONNECTION_ID, FIRST_MESSAGE_ID, LISTENER_ID, RETIRED_IDS};
use records::{LOG_ENTRIES, LOG_ENTRY, MAX_VERSION_DATA};
pub use records::{
    REPLIES_AREA, RX_RECORD, SESSION_RECORD, TABLE_LOG_AREA, TABLE_LOG_HEAD, TABLES_RECORD,
    WindowRecord,
};

/// Where descriptors go to outlive this process: the supervisor's side of the custody
/// channel.
pub trait Custody: Send + std::fmt::Debug {
    /// Keep duplicates of `fds` under `ids` (same length). Must have completed (the kernel has
    /// the descriptors in flight to the supervisor) when it returns.
    fn hold(&mut self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()>;
    /// The descriptors under `ids` are no longer needed.
    fn release(&mut self, ids: &[u64]) -> io::Result<()>;
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
    /// The receive journal ([`Framer::resume`](crate::transport::Framer::resume)); empty if nothing was in flight.
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
}

impl Inner {
    fn degraded(&self, what: &str, e: &dyn std::error::Error) {
        if self.failures.allow() {
            tracing::warn!(error = %e, "{what}: a restart of this process would lose state");
        }
    }
}

/// A file's identity: `(st_dev, st_ino)`.
type FileId = (u64, u64);

#[cfg(test)]
mod tests;
