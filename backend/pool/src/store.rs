//! The store: the inventory's state and its event history in one redb file, written in one
//! transaction per mutation.
//!
//! # Retention
//!
//! The history keeps the newest `[daemon] events_keep` events and none older than
//! `events_max_age` (the newest event is always kept, whatever its age). Older events are
//! pruned, oldest first, inside the transaction of a commit: everything due at
//! [`Pool::open`], at most [`PRUNE_BATCH`] per later commit (a commit adds a few events, so
//! the history never lags its limits by more than a commit or two). redb's readers see the
//! history as of their transaction's start, so pruning never blocks or tears a read. The
//! highest sequence number pruned so far is kept (`meta.pruned`, [`History::pruned`]):
//! events are numbered without gaps, so a reader resuming after `since_seq` has missed
//! events exactly when `since_seq < pruned`. Sequence numbers never change: pruning removes
//! history, not numbering (`next_seq` goes on).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod file;

pub use file::move_aside;

use redb::{Database, ReadableTable, TableDefinition, TableError};
use serde::Serialize;
use serde::de::DeserializeOwned;

use switchyard_device::kind::KindCatalog;

use crate::board::Snapshot;
use crate::config::PoolConfig;
use crate::error::PoolError;
use crate::event::Event;
use crate::inventory::Inventory;
use crate::view::{EndpointSpec, MovePlan, OpenReport, Placement};

/// Board records (`BoardRecord` as JSON) by board id.
const BOARDS: TableDefinition<&str, &[u8]> = TableDefinition::new("boards");
/// Endpoints (`Endpoint` as JSON) by id.
const ENDPOINTS: TableDefinition<&str, &[u8]> = TableDefinition::new("endpoints");
/// The history (`Event` as JSON) by sequence number; append-only.
const EVENTS: TableDefinition<u64, &[u8]> = TableDefinition::new("events");
/// `format`, `next_seq` and `pruned` (the highest event seq pruned from the history; absent
/// while none was).
const META: TableDefinition<&str, u64> = TableDefinition::new("meta");

/// Events a commit after [`Pool::open`] prunes at most (see the module documentation).
pub const PRUNE_BATCH: usize = 256;

/// How much history the store keeps (`[daemon] events_keep`, `events_max_age`).
#[derive(Debug, Clone, Copy)]
struct Retention {
    keep: u64,
    max_age_ms: u64,
}

/// The store's format; bumped when a record changes incompatibly.
pub const STORE_FORMAT: u64 = 1;

/// The pool: an [`Inventory`] whose every mutation is committed to the store before it is
/// visible.
///
/// Each mutation runs on a copy of the inventory; its state changes and its events are
/// written in one redb transaction (durable when `commit` returns), and only then does the
/// copy replace the inventory. A refused mutation or a failed commit leaves both the file
/// and the inventory as they were. The queries are on [`Pool::inventory`].
pub struct Pool {
    db: Arc<Database>,
    path: PathBuf,
    inv: Inventory,
    retention: Retention,
}

impl fmt::Debug for Pool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Pool")
            .field("path", &self.path)
            .field("inventory", &self.inv)
            .finish_non_exhaustive()
    }
}

impl Pool {
    /// Opens the store at `path`, or creates it (mode 0600, whatever the umask) where no
    /// file is, and reconciles it with `config` (see
    /// [`OpenReport`]): the stored endpoints, leases, moves in progress and quarantines are
    /// restored, boards new to the configuration appear, boards gone from it are forgotten
    /// when unleased and kept as `missing` otherwise, and configured endpoints are created
    /// when absent. The reconciliation is committed (with an `opened` event) before this
    /// returns. The file is locked: one `Pool` per file.
    ///
    /// A file that is there but is no usable store (empty, truncated, not a redb file) is
    /// refused ([`PoolError::StoreDamaged`], naming it) and left as it is: never
    /// re-initialised, never a panic. [`move_aside`] is for an administrator who chooses to
    /// start afresh.
    ///
    /// Each board's options are checked by its kind in `kinds`, the stored boards' too: a
    /// store written before device kinds (softgpu settings in each shape, a passthrough
    /// board's `host` on the board) loads, its boards with the options their kind gives them.
    pub fn open(
        config: &PoolConfig,
        kinds: &dyn KindCatalog,
        path: &Path,
    ) -> Result<(Self, OpenReport), PoolError> {
        config.validate(kinds)?;
        let db = file::open(path)?;
        let stored = file::no_panic_read(path, || read_snapshot(&db))?;
        let (inv, events, report) = Inventory::restore(config, kinds, stored.clone())?;
        let retention = Retention {
            keep: config.daemon.events_keep,
            max_age_ms: config.daemon.events_max_age.as_millis(),
        };
        let prune = (retention, usize::MAX);
        write(&db, &stored, &inv.snapshot(), &events, prune)?;
        Ok((
            Self {
                db: Arc::new(db),
                path: path.into(),
                inv,
                retention,
            },
            report,
        ))
    }

    /// The store's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The committed state, for queries (boards, devices, pools, endpoints, moves).
    pub fn inventory(&self) -> &Inventory {
        &self.inv
    }

    /// Events with `seq > since_seq`, oldest first, at most `limit`.
    pub fn history(&self, since_seq: u64, limit: usize) -> Result<Vec<Event>, PoolError> {
        read_history(&self.db, since_seq, limit)
    }

    /// The highest event seq pruned from the history (0 when none was): see
    /// [`History::pruned`].
    pub fn pruned(&self) -> Result<u64, PoolError> {
        self.history_reader().pruned()
    }

    /// Commits a [`EventKind::SeqMark`](crate::EventKind::SeqMark) (nothing else changes): the
    /// daemon numbers the worker events after it.
    pub fn seq_mark(&mut self, worker_events: u64) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| Ok(inv.seq_mark(worker_events)))
    }

    /// A handle that reads the history page by page without the pool (see [`History`]).
    pub fn history_reader(&self) -> History {
        History {
            db: Arc::clone(&self.db),
        }
    }

    /// [`Inventory::create_endpoint`], committed.
    pub fn create_endpoint(&mut self, spec: &EndpointSpec) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.create_endpoint(spec))
    }

    /// [`Inventory::create_endpoint_as`], committed.
    pub fn create_endpoint_as(
        &mut self,
        spec: &EndpointSpec,
        owner_uid: u32,
        token: &str,
    ) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.create_endpoint_as(spec, owner_uid, token))
    }

    /// [`Inventory::delete_endpoint`], committed.
    pub fn delete_endpoint(&mut self, id: &str) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.delete_endpoint(id))
    }

    /// [`Inventory::check_move`]: a dry run, nothing reserved.
    pub fn check_move(&self, endpoint: &str, to: &str) -> Result<MovePlan, PoolError> {
        self.inv.check_move(endpoint, to)
    }

    /// [`Inventory::plan_move`], committed: the target is reserved until commit or abort,
    /// across restarts.
    pub fn plan_move(
        &mut self,
        endpoint: &str,
        to: &str,
    ) -> Result<(MovePlan, Vec<Event>), PoolError> {
        self.apply(|inv| inv.plan_move(endpoint, to))
    }

    /// [`Inventory::commit_move`], committed.
    pub fn commit_move(&mut self, plan: &MovePlan) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.commit_move(plan))
    }

    /// [`Inventory::abort_move`], committed.
    pub fn abort_move(&mut self, plan: &MovePlan) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.abort_move(plan))
    }

    /// [`Inventory::detach`], committed.
    pub fn detach(&mut self, endpoint: &str) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.detach(endpoint))
    }

    /// [`Inventory::attach`], committed.
    pub fn attach(&mut self, endpoint: &str, to: &Placement) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.attach(endpoint, to))
    }

    /// [`Inventory::plan_drain`]: a dry run, nothing reserved.
    pub fn plan_drain(&self, board: &str) -> Result<Vec<MovePlan>, PoolError> {
        self.inv.plan_drain(board)
    }

    /// [`Inventory::drain`], committed: the board quarantined and every move started in one
    /// transaction.
    pub fn drain(&mut self, board: &str) -> Result<(Vec<MovePlan>, Vec<Event>), PoolError> {
        self.apply(|inv| inv.drain(board))
    }

    /// [`Inventory::quarantine`], committed.
    pub fn quarantine(&mut self, board: &str) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.quarantine(board))
    }

    /// [`Inventory::unquarantine`], committed.
    pub fn unquarantine(&mut self, board: &str) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.unquarantine(board))
    }

    /// [`Inventory::fail_board`], committed.
    pub fn fail_board(
        &mut self,
        board: &str,
        failure: crate::view::BoardFailure,
    ) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.fail_board(board, failure))
    }

    /// [`Inventory::plan_failover`], committed: the target is reserved until commit or
    /// abort ([`Pool::abort_move`]), across restarts.
    pub fn plan_failover(&mut self, endpoint: &str) -> Result<(MovePlan, Vec<Event>), PoolError> {
        self.apply(|inv| inv.plan_failover(endpoint))
    }

    /// [`Inventory::commit_failover`], committed.
    pub fn commit_failover(
        &mut self,
        plan: &MovePlan,
        mode: &str,
        stall_ms: u64,
    ) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| inv.commit_failover(plan, mode, stall_ms))
    }

    /// [`Inventory::failover_waiting`], committed (the event only).
    pub fn failover_waiting(
        &mut self,
        endpoint: &str,
        device: &str,
    ) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| Ok(inv.failover_waiting(endpoint, device)))
    }

    /// [`Inventory::failover_refused`], committed (the event only).
    pub fn failover_refused(
        &mut self,
        endpoint: &str,
        device: &str,
        reason: &str,
    ) -> Result<Vec<Event>, PoolError> {
        self.apply_events(|inv| Ok(inv.failover_refused(endpoint, device, reason)))
    }

    fn apply_events(
        &mut self,
        op: impl FnOnce(&mut Inventory) -> Result<Vec<Event>, PoolError>,
    ) -> Result<Vec<Event>, PoolError> {
        self.apply(|inv| op(inv).map(|events| ((), events)))
            .map(|((), events)| events)
    }

    /// Runs `op` on a copy, commits what changed with the events, then keeps the copy.
    fn apply<T>(
        &mut self,
        op: impl FnOnce(&mut Inventory) -> Result<(T, Vec<Event>), PoolError>,
    ) -> Result<(T, Vec<Event>), PoolError> {
        let mut next = self.inv.clone();
        let (value, events) = op(&mut next)?;
        if !events.is_empty() {
            let prune = (self.retention, PRUNE_BATCH);
            write(
                &self.db,
                &self.inv.snapshot(),
                &next.snapshot(),
                &events,
                prune,
            )?;
            self.inv = next;
        }
        Ok((value, events))
    }
}

/// The store's event history, read without the [`Pool`]: a reader never waits for a mutation
/// (or for whoever holds the pool), and sees what was committed when its read began.
///
/// Read it in pages ([`History::page`]): each page is one read transaction of at most `limit`
/// events, so a reader of a long history holds one page at a time. The handle keeps the store
/// open (and locked) while it exists: drop every one before opening the file again.
#[derive(Clone)]
pub struct History {
    db: Arc<Database>,
}

impl fmt::Debug for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("History").finish_non_exhaustive()
    }
}

impl History {
    /// Events with `seq > since_seq`, oldest first, at most `limit`: [`Pool::history`] in one
    /// read transaction.
    pub fn page(&self, since_seq: u64, limit: usize) -> Result<Vec<Event>, PoolError> {
        read_history(&self.db, since_seq, limit)
    }

    /// The highest event seq pruned from the history by retention (0 when none was). Events
    /// are numbered without gaps, so a reader of the events after `since_seq` misses some
    /// exactly when `since_seq < pruned`: the oldest position a reader may resume from is
    /// `pruned`.
    pub fn pruned(&self) -> Result<u64, PoolError> {
        let txn = self
            .db
            .begin_read()
            .map_err(|e| PoolError::store("read", e))?;
        let meta = match txn.open_table(META) {
            Ok(t) => t,
            Err(TableError::TableDoesNotExist(_)) => return Ok(0),
            Err(e) => return Err(PoolError::store("read", e)),
        };
        let pruned = meta
            .get("pruned")
            .map_err(|e| PoolError::store("read", e))?;
        Ok(pruned.map_or(0, |v| v.value()))
    }
}

/// Removes the oldest events of `history` that `retention` no longer keeps, at most `batch`,
/// never the event `last` (the newest); returns the seq of the last one removed.
fn prune(
    history: &mut redb::Table<u64, &[u8]>,
    last: u64,
    retention: Retention,
    batch: usize,
) -> Result<Option<u64>, PoolError> {
    /// What the age check needs of a stored event.
    #[derive(serde::Deserialize)]
    struct At {
        at_unix_ms: u64,
    }
    let fail = |e: redb::Error| PoolError::store("commit to", e);
    let by_count = last.saturating_sub(retention.keep);
    let by_age = crate::inventory::now_unix_ms().saturating_sub(retention.max_age_ms);
    let mut pruned = None;
    for _ in 0..batch {
        let seq = {
            let Some((seq, bytes)) = history.first().map_err(|e| fail(e.into()))? else {
                break;
            };
            let seq = seq.value();
            // An event that does not decode is left to the count.
            let old =
                || serde_json::from_slice::<At>(bytes.value()).is_ok_and(|e| e.at_unix_ms < by_age);
            if seq >= last || !(seq <= by_count || old()) {
                break;
            }
            seq
        };
        history.remove(seq).map_err(|e| fail(e.into()))?;
        pruned = Some(seq);
    }
    Ok(pruned)
}

/// Events with `seq > since_seq`, oldest first, at most `limit`, in one read transaction.
fn read_history(db: &Database, since_seq: u64, limit: usize) -> Result<Vec<Event>, PoolError> {
    let txn = db.begin_read().map_err(|e| PoolError::store("read", e))?;
    let table = match txn.open_table(EVENTS) {
        Ok(t) => t,
        Err(TableError::TableDoesNotExist(_)) => return Ok(Vec::new()),
        Err(e) => return Err(PoolError::store("read", e)),
    };
    let start = since_seq.saturating_add(1);
    let mut out = Vec::with_capacity(limit.min(1024));
    for item in table
        .range(start..)
        .map_err(|e| PoolError::store("read", e))?
        .take(limit)
    {
        let (seq, bytes) = item.map_err(|e| PoolError::store("read", e))?;
        out.push(decode(&format!("event {}", seq.value()), bytes.value())?);
    }
    Ok(out)
}

fn encode<T: Serialize>(what: &str, value: &T) -> Result<Vec<u8>, PoolError> {
    serde_json::to_vec(value).map_err(|source| PoolError::Encode {
        what: what.into(),
        source,
    })
}

fn decode<T: DeserializeOwned>(what: &str, bytes: &[u8]) -> Result<T, PoolError> {
    serde_json::from_slice(bytes).map_err(|source| PoolError::Corrupt {
        what: what.into(),
        source,
    })
}

/// Everything the store holds but the history; empty for a new file.
fn read_snapshot(db: &Database) -> Result<Snapshot, PoolError> {
    let read = |e: redb::Error| PoolError::store("read", e);
    let txn = db.begin_read().map_err(|e| read(e.into()))?;
    let mut snap = Snapshot::default();
    match txn.open_table(META) {
        Ok(meta) => {
            let format = meta.get("format").map_err(|e| read(e.into()))?;
            if let Some(format) = format.map(|v| v.value())
                && format != STORE_FORMAT
            {
                return Err(PoolError::StoreFormat {
                    found: format,
                    expected: STORE_FORMAT,
                });
            }
            let next = meta.get("next_seq").map_err(|e| read(e.into()))?;
            snap.next_seq = next.map_or(1, |v| v.value());
        }
        Err(TableError::TableDoesNotExist(_)) => snap.next_seq = 1,
        Err(e) => return Err(read(e.into())),
    }
    (snap.boards, snap.outdated) = read_map(&txn, BOARDS, "board")?;
    (snap.endpoints, _) = read_map(&txn, ENDPOINTS, "endpoint")?;
    Ok(snap)
}

/// A table of JSON records by id (empty when it does not exist yet), and the ids of those
/// stored in another form than the one they encode to now (an older version's).
fn read_map<T: DeserializeOwned + Serialize>(
    txn: &redb::ReadTransaction,
    table: TableDefinition<&str, &[u8]>,
    what: &str,
) -> Result<(BTreeMap<String, T>, BTreeSet<String>), PoolError> {
    let read = |e: redb::Error| PoolError::store("read", e);
    let mut map = BTreeMap::new();
    let mut outdated = BTreeSet::new();
    let t = match txn.open_table(table) {
        Ok(t) => t,
        Err(TableError::TableDoesNotExist(_)) => return Ok((map, outdated)),
        Err(e) => return Err(read(e.into())),
    };
    for item in t.iter().map_err(|e| read(e.into()))? {
        let (k, v) = item.map_err(|e| read(e.into()))?;
        let id = k.value().to_owned();
        let what = format!("{what} \"{id}\"");
        let stored: serde_json::Value = decode(&what, v.value())?;
        let record: T = decode(&what, v.value())?;
        if serde_json::to_value(&record).ok().as_ref() != Some(&stored) {
            outdated.insert(id.clone());
        }
        map.insert(id, record);
    }
    Ok((map, outdated))
}

/// Writes the records of `new` that differ from `old` (or are `outdated` in the file) and
/// removes those gone.
fn write_diff<T: PartialEq + Serialize>(
    txn: &redb::WriteTransaction,
    table: TableDefinition<&str, &[u8]>,
    (old, outdated): (&BTreeMap<String, T>, &BTreeSet<String>),
    new: &BTreeMap<String, T>,
    what: &str,
) -> Result<(), PoolError> {
    let fail = |e: redb::Error| PoolError::store("commit to", e);
    let mut t = txn.open_table(table).map_err(|e| fail(e.into()))?;
    for (id, record) in new {
        if old.get(id) != Some(record) || outdated.contains(id) {
            let bytes = encode(&format!("{what} \"{id}\""), record)?;
            t.insert(id.as_str(), bytes.as_slice())
                .map_err(|e| fail(e.into()))?;
        }
    }
    for id in old.keys().filter(|id| !new.contains_key(*id)) {
        t.remove(id.as_str()).map_err(|e| fail(e.into()))?;
    }
    Ok(())
}

/// Writes the difference between two snapshots and the events in one transaction, and prunes
/// at most `batch` events of the history that `retention` no longer keeps.
fn write(
    db: &Database,
    old: &Snapshot,
    new: &Snapshot,
    events: &[Event],
    (retention, batch): (Retention, usize),
) -> Result<(), PoolError> {
    let fail = |e: redb::Error| PoolError::store("commit to", e);
    let txn = db.begin_write().map_err(|e| fail(e.into()))?;
    {
        let current = BTreeSet::new();
        let boards = (&old.boards, &old.outdated);
        write_diff(&txn, BOARDS, boards, &new.boards, "board")?;
        let endpoints = (&old.endpoints, &current);
        write_diff(&txn, ENDPOINTS, endpoints, &new.endpoints, "endpoint")?;
        let mut history = txn.open_table(EVENTS).map_err(|e| fail(e.into()))?;
        for event in events {
            let bytes = encode(&format!("event {}", event.seq), event)?;
            history
                .insert(event.seq, bytes.as_slice())
                .map_err(|e| fail(e.into()))?;
        }
        let mut meta = txn.open_table(META).map_err(|e| fail(e.into()))?;
        let last = new.next_seq.saturating_sub(1);
        if let Some(pruned) = prune(&mut history, last, retention, batch)? {
            let before = meta.get("pruned").map_err(|e| fail(e.into()))?;
            let before = before.map_or(0, |v| v.value());
            meta.insert("pruned", pruned.max(before))
                .map_err(|e| fail(e.into()))?;
        }
        meta.insert("format", STORE_FORMAT)
            .map_err(|e| fail(e.into()))?;
        meta.insert("next_seq", new.next_seq)
            .map_err(|e| fail(e.into()))?;
    }
    txn.commit().map_err(|e| fail(e.into()))
}
