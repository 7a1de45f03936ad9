//! The worker's side of custody: a ledger of every descriptor the worker's supervisor holds
//! for it (by custody id), and the channel to the supervisor of the moment.
//!
//! A supervisor dies with its daemon; the worker serves on. The ledger lets a *new*
//! supervisor adopt the worker: it connects to the worker's adoption socket
//! (`<dir>/w<pid>.sock`, [`adoption_path`]), sends [`Note::Adopt`], and receives the whole
//! ledger ([`Note::Fds`] batches, then [`Note::Adopted`]); that connection is the custody
//! channel from then on. So after a daemon restart (a crash, or an upgrade of the daemon
//! itself) every endpoint is supervised again, and a worker that dies later is replaced as
//! usual.
//!
//! While no supervisor is attached, holds and releases change the ledger only. The ledger
//! and the channel change under one lock, so an adopting supervisor gets exactly the
//! descriptors it must hold, and every later note.
//!
//! **Nothing here waits for the supervisor.** Notes are not sent by the thread that makes
//! them (a client's connection thread putting a DMA_MAP's descriptor in custody, the
//! migration hook under the device slot's lock): under the keeper's lock the ledger changes
//! and the note (with the ledger's own descriptors, shared, never duplicated) joins a queue,
//! in order; a sender thread (`sy-worker-notes`) drains the queue to the channel of the
//! moment, and only it blocks when the supervisor is slow to read. The queue is bounded
//! ([`QUEUE_BOUND`] notes); when it is full:
//! - a hold of the client's descriptors ([`KeeperCustody`]) is refused (`WouldBlock`):
//!   nothing is held and the message that carried them fails with `EAGAIN` (the client may
//!   send it again; nothing irreversible happened);
//! - a [`Note::Stats`] is added into one pending report (stats are deltas: the counts stay
//!   right, they arrive later), and a [`Note::Migration`] replaces the pending one (the
//!   latest state wins; the events of the states in between are lost): both join the queue
//!   as soon as it has room;
//! - everything else (releases, holds of the worker's own descriptors and memory objects,
//!   ready, move outcomes, failures, sync answers) joins the queue past the bound: they are
//!   few, made by the worker itself, and never dropped.
//!
//! At an adoption the queue is cleared: what it still had for the old channel is covered
//! by the ledger snapshot the new supervisor gets (holds and releases are in the ledger
//! already; the last move, readiness and a board failure are in [`Note::Adopted`] and
//! after it), except stats, which are kept (added into the pending report). The snapshot
//! then goes first on the new channel, through the same queue.
//!
//! **Sequence numbers.** Every note queued gets the next number of the worker's custody
//! sequence. A supervisor asks [`Note::Sync`]; the answer ([`Note::Synced`], with its own
//! number) is queued behind every note made before it, so a supervisor that has applied
//! the answer has applied everything the worker noted up to that number.
//!
//! The keeper also remembers the worker's last move ([`LastMove`]): a supervisor that dies
//! while its worker moves the device (a daemon killed during `ctl move`) never hears the
//! outcome, so the worker tells the next one at adoption. An adoption that arrives while a
//! move runs waits for it to end, up to [`ADOPT_MOVE_WAIT`]; past that the worker hands over
//! with the move still running ([`MoveState::Running`]), and its outcome follows on the new
//! channel ([`Note::Moved`] or [`Note::MoveFailed`]) when the data path ends. Outcome and
//! answer are one step under the lock, so a supervisor learns the outcome exactly once:
//! from the answer, or from the adoption.
//!
//! Likewise a board failure the device reported ([`Note::BoardFailed`]) is told again to an
//! adopting supervisor: the daemon it went to may have died before it recorded it.

use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use switchyard_server::continuity::Custody;

use crate::custody::{
    self, ChannelError, LastMove, MAX_FDS, MoveState, Note, StartMode, WorkerNonce, WorkerStats,
};

/// Most notes waiting for the sender thread before holds of the client's descriptors are
/// refused and stats and migration notes are coalesced (see the [module](self) docs).
pub const QUEUE_BOUND: usize = 1024;

/// A note waiting for the sender thread, with the descriptors it attaches (shared with the
/// ledger: a release before the send does not close them under it).
struct Queued {
    note: Note,
    fds: Vec<Arc<OwnedFd>>,
}

/// How long an adoption connection may take to send its request.
const ADOPT_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long an adoption waits for a running move to end (the daemon's own wait for a move's
/// answer). Past it the worker hands over with the move running, and reports the outcome
/// on the new channel when the data path ends.
pub const ADOPT_MOVE_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// The adoption socket of worker `pid` in `dir`.
pub fn adoption_path(dir: &Path, pid: u32) -> PathBuf {
    dir.join(format!("w{pid}.sock"))
}

struct Inner {
    /// The current supervisor's channel; `None` once it is gone.
    channel: Option<Arc<OwnedFd>>,
    /// Bumped at every new channel.
    generation: u64,
    ledger: BTreeMap<u64, Arc<OwnedFd>>,
    /// Memory objects in custody, by name.
    objects: BTreeMap<String, Arc<OwnedFd>>,
    /// Notes for the current channel, in order, for the sender thread.
    queue: VecDeque<Queued>,
    /// The number of the last note queued (the custody sequence).
    seq: u64,
    /// Stats that did not fit the queue, added up (see the [module](self) docs).
    overflow_stats: Option<WorkerStats>,
    /// The latest migration note that did not fit the queue.
    overflow_migration: Option<Note>,
    /// The keeper is gone: the sender thread ends once the queue is empty.
    closed: bool,
    /// How a replacement must start (told to an adopting supervisor).
    replacement: Option<StartMode>,
    /// The last move and how it stands (told to an adopting supervisor).
    last_move: Option<LastMove>,
    /// The endpoint's restarts before this worker (told to an adopting supervisor).
    restarts: u64,
    /// The lease the worker serves (told to an adopting supervisor): as the supervisor said
    /// at start or re-exec, then where its moves took the device.
    lease: Option<String>,
    /// The nonce its supervisor gave it (proved to an adopting supervisor).
    nonce: Option<WorkerNonce>,
    /// A re-executed image: its [`Note::Ready`], made before its supervisor adopted it, is
    /// told at the adoption (the supervisor waits for it).
    unsent_ready: Option<Option<Note>>,
    /// The device's board failure, if it reported one ([`Note::BoardFailed`]; told again to
    /// an adopting supervisor: the one it was sent to may have died before acting on it).
    board_failed: Option<Note>,
}

/// What [`Keeper::snapshot`] returns.
#[derive(Debug)]
pub struct KeeperSnapshot {
    /// The ledger, by custody id.
    pub held: BTreeMap<u64, OwnedFd>,
    /// The memory objects, by name.
    pub objects: BTreeMap<String, OwnedFd>,
    /// The endpoint's restarts before this worker.
    pub restarts: u64,
}

/// The keeper's state and its sender thread's.
struct Shared {
    /// The ledger, the channel, the queue (everything in [`Inner`]).
    inner: Mutex<Inner>,
    /// A new channel, a move's end.
    changed: Condvar,
    /// A note queued (for the sender thread).
    queued: Condvar,
}

/// See the [module](self) documentation.
pub struct Keeper {
    endpoint: String,
    shared: Arc<Shared>,
    /// How long an adoption waits for a running move ([`ADOPT_MOVE_WAIT`]).
    move_wait: std::time::Duration,
}

impl std::fmt::Debug for Keeper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keeper")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

impl Keeper {
    /// A keeper for `endpoint` on `channel`, with what the supervisor handed over at start
    /// (by custody id, and memory objects by name).
    pub fn new(
        endpoint: &str,
        channel: OwnedFd,
        handed: &BTreeMap<u64, OwnedFd>,
        objects: &BTreeMap<String, OwnedFd>,
    ) -> io::Result<Self> {
        Self::with_channel(endpoint, Some(channel), handed, objects, false)
    }

    /// A keeper with no supervisor yet (a re-executed worker: its supervisor adopts it,
    /// [`Keeper::adopt`], to get the whole ledger).
    pub fn unsupervised(
        endpoint: &str,
        handed: &BTreeMap<u64, OwnedFd>,
        objects: &BTreeMap<String, OwnedFd>,
    ) -> io::Result<Self> {
        Self::with_channel(endpoint, None, handed, objects, true)
    }

    fn with_channel(
        endpoint: &str,
        channel: Option<OwnedFd>,
        handed: &BTreeMap<u64, OwnedFd>,
        objects: &BTreeMap<String, OwnedFd>,
        reexeced: bool,
    ) -> io::Result<Self> {
        let mut ledger = BTreeMap::new();
        for (id, fd) in handed {
            ledger.insert(*id, Arc::new(fd.try_clone()?));
        }
        let mut held_objects = BTreeMap::new();
        for (name, fd) in objects {
            held_objects.insert(name.clone(), Arc::new(fd.try_clone()?));
        }
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                generation: u64::from(channel.is_some()),
                channel: channel.map(Arc::new),
                ledger,
                objects: held_objects,
                queue: VecDeque::new(),
                seq: 0,
                overflow_stats: None,
                overflow_migration: None,
                closed: false,
                replacement: None,
                last_move: None,
                restarts: 0,
                lease: None,
                nonce: None,
                unsent_ready: reexeced.then_some(None),
                board_failed: None,
            }),
            changed: Condvar::new(),
            queued: Condvar::new(),
        });
        let sender = shared.clone();
        std::thread::Builder::new()
            .name("sy-worker-notes".into())
            .spawn(move || send_notes(&sender))?;
        Ok(Self {
            endpoint: endpoint.to_owned(),
            shared,
            move_wait: ADOPT_MOVE_WAIT,
        })
    }

    /// Waits at most `wait` for a running move when adopted (instead of
    /// [`ADOPT_MOVE_WAIT`]).
    pub fn with_move_wait(mut self, wait: std::time::Duration) -> Self {
        self.move_wait = wait;
        self
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.shared.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `note` (with `fds`) for the current channel, past the bound; nothing while no
    /// supervisor is attached.
    fn queue_locked(&self, g: &mut Inner, note: Note, fds: Vec<Arc<OwnedFd>>) {
        if g.channel.is_none() {
            return;
        }
        refill(g);
        g.seq += 1;
        g.queue.push_back(Queued { note, fds });
        self.shared.queued.notify_one();
    }

    /// Puts `fds` into custody under `ids` (the worker's own descriptors: never refused).
    pub fn hold(&self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        self.hold_bounded(ids, fds, false)
    }

    /// Puts the client's `fds` into custody under `ids`, unless the queue to the supervisor
    /// is full: then nothing is held and the error is `WouldBlock` (see the
    /// [module](self) docs).
    pub fn try_hold(&self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        self.hold_bounded(ids, fds, true)
    }

    fn hold_bounded(&self, ids: &[u64], fds: &[BorrowedFd<'_>], bounded: bool) -> io::Result<()> {
        let mut copies = Vec::with_capacity(fds.len());
        for fd in fds {
            copies.push(Arc::new(fd.try_clone_to_owned()?));
        }
        let mut g = self.lock();
        if bounded && g.channel.is_some() && g.queue.len() >= QUEUE_BOUND {
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "the queue of custody notes to the supervisor is full",
            ));
        }
        for (id, fd) in ids.iter().zip(&copies) {
            g.ledger.insert(*id, fd.clone());
        }
        for (ids, fds) in ids.chunks(MAX_FDS).zip(copies.chunks(MAX_FDS)) {
            self.queue_locked(&mut g, Note::Hold { ids: ids.to_vec() }, fds.to_vec());
        }
        Ok(())
    }

    /// Takes `ids` out of custody.
    pub fn release(&self, ids: &[u64]) {
        let mut g = self.lock();
        for id in ids {
            g.ledger.remove(id);
        }
        for ids in ids.chunks(4096) {
            self.queue_locked(&mut g, Note::Release { ids: ids.to_vec() }, Vec::new());
        }
    }

    /// Puts memory objects into custody under `names` (replacing what was held under a
    /// name).
    pub fn hold_objects(&self, objects: &[(String, std::fs::File)]) -> io::Result<()> {
        let mut copies = Vec::with_capacity(objects.len());
        for (_, f) in objects {
            copies.push(Arc::new(OwnedFd::from(f.try_clone()?)));
        }
        let mut g = self.lock();
        for ((name, _), fd) in objects.iter().zip(&copies) {
            g.objects.insert(name.clone(), fd.clone());
        }
        for (batch, fds) in objects.chunks(MAX_FDS).zip(copies.chunks(MAX_FDS)) {
            let names = batch.iter().map(|(n, _)| n.clone()).collect();
            self.queue_locked(&mut g, Note::HoldObjects { names }, fds.to_vec());
        }
        Ok(())
    }

    /// Records the endpoint's restarts before this worker ([`Note::Start`]), for an adopting
    /// supervisor.
    pub fn set_restarts(&self, restarts: u64) {
        self.lock().restarts = restarts;
    }

    /// Records the lease the worker serves ([`Note::Start`], [`Note::Reexec`]), for an
    /// adopting supervisor.
    pub fn set_lease(&self, lease: Option<String>) {
        self.lock().lease = lease;
    }

    /// Records the nonce its supervisor gave the worker ([`Note::Start`]; kept across
    /// re-execs), which it proves to an adopting supervisor.
    pub fn set_nonce(&self, nonce: Option<WorkerNonce>) {
        self.lock().nonce = nonce;
    }

    /// What a re-executed image of this worker must get: every descriptor of the ledger
    /// and every memory object (duplicates), the restarts so far and the lease.
    pub fn snapshot(&self) -> io::Result<KeeperSnapshot> {
        let g = self.lock();
        let mut held = BTreeMap::new();
        for (id, fd) in &g.ledger {
            held.insert(*id, fd.try_clone()?);
        }
        let mut objects = BTreeMap::new();
        for (name, fd) in &g.objects {
            objects.insert(name.clone(), fd.try_clone()?);
        }
        Ok(KeeperSnapshot {
            held,
            objects,
            restarts: g.restarts,
        })
    }

    /// The names of the memory objects in custody.
    pub fn object_names(&self) -> Vec<String> {
        self.lock().objects.keys().cloned().collect()
    }

    /// Takes the memory objects `names` out of custody.
    pub fn release_objects(&self, names: &[String]) {
        if names.is_empty() {
            return;
        }
        let mut g = self.lock();
        for n in names {
            g.objects.remove(n);
        }
        self.queue_locked(
            &mut g,
            Note::ReleaseObjects {
                names: names.to_vec(),
            },
            Vec::new(),
        );
    }

    /// Sends a note without descriptors (ready, move outcomes) to the current supervisor.
    /// A [`Note::Ready`] also records how a replacement must start, for an adopting
    /// supervisor. Never waits: a [`Note::Stats`] or [`Note::Migration`] that does not fit
    /// the queue is coalesced (see the [module](self) docs).
    pub fn notify(&self, note: &Note) {
        let mut g = self.lock();
        match note {
            Note::Ready { replacement, .. } => {
                g.replacement = *replacement;
                if g.channel.is_none()
                    && let Some(unsent) = &mut g.unsent_ready
                {
                    *unsent = Some(note.clone());
                }
            }
            Note::BoardFailed { .. } => g.board_failed = Some(note.clone()),
            _ => {}
        }
        if g.channel.is_none()
            && let Note::Stats(stats) = note
        {
            // No supervisor now: kept (deltas) for the one that adopts this worker.
            g.overflow_stats
                .get_or_insert_with(WorkerStats::default)
                .add(stats);
            return;
        }
        if g.channel.is_some() && g.queue.len() >= QUEUE_BOUND {
            match note {
                Note::Stats(stats) => {
                    g.overflow_stats
                        .get_or_insert_with(WorkerStats::default)
                        .add(stats);
                    return;
                }
                Note::Migration { .. } => {
                    g.overflow_migration = Some(note.clone());
                    return;
                }
                _ => {}
            }
        }
        self.queue_locked(&mut g, note.clone(), Vec::new());
    }

    /// Answers a supervisor's [`Note::Sync`] `token`, asked on the channel of `generation`:
    /// [`Note::Synced`], behind every note queued before it. Nothing when that channel is
    /// no longer the current one (its supervisor is gone).
    pub fn synced(&self, generation: u64, token: u64) {
        let mut g = self.lock();
        if g.generation != generation {
            return;
        }
        let seq = g.seq + 1;
        self.queue_locked(&mut g, Note::Synced { token, seq }, Vec::new());
    }

    /// The number of the last note queued (the custody sequence; see the [module](self)
    /// docs).
    pub fn seq(&self) -> u64 {
        self.lock().seq
    }

    /// A move to `to` asked on the channel of `generation` begins ([`MoveState::Running`]).
    /// Refused (`false`: the move must not run) when that channel is no longer the current
    /// one: a new supervisor adopted the worker meanwhile, and neither asked for the move
    /// nor would hear of it.
    pub fn begin_move(&self, generation: u64, to: &str) -> bool {
        let mut g = self.lock();
        if g.generation != generation {
            return false;
        }
        g.last_move = Some(LastMove {
            to: to.to_owned(),
            state: MoveState::Running,
        });
        true
    }

    /// The move begun by [`Keeper::begin_move`] ended with `answer` ([`Note::Moved`] or
    /// [`Note::MoveFailed`]): recorded, and sent to the current supervisor in the same step,
    /// so that an adopting one learns the outcome either from the adoption or from the
    /// answer, never from both or neither.
    pub fn end_move(&self, answer: &Note) {
        let mut g = self.lock();
        let state = match answer {
            Note::Moved { report } => MoveState::Moved {
                report: Some(report.clone()),
            },
            Note::MoveFailed { error } => MoveState::Failed {
                error: error.clone(),
            },
            other => {
                tracing::error!(?other, "not a move's answer; the move's outcome is unknown");
                return;
            }
        };
        let moved = matches!(state, MoveState::Moved { .. });
        if let Some(m) = &mut g.last_move {
            m.state = state;
            if moved {
                // The device runs on the target now.
                let to = m.to.clone();
                g.lease = Some(to);
            }
        }
        self.queue_locked(&mut g, answer.clone(), Vec::new());
        drop(g);
        self.shared.changed.notify_all();
    }

    /// The last move and how it stands.
    pub fn last_move(&self) -> Option<LastMove> {
        self.lock().last_move.clone()
    }

    /// The current channel (to read requests from), waiting for an adoption while there is
    /// none; with its generation.
    pub fn channel(&self) -> (u64, Arc<OwnedFd>) {
        let mut g = self.lock();
        loop {
            if let Some(ch) = &g.channel {
                return (g.generation, ch.clone());
            }
            g = self
                .shared
                .changed
                .wait(g)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The channel of `generation` closed: its supervisor is gone.
    pub fn lost(&self, generation: u64) {
        let mut g = self.lock();
        if g.generation == generation && g.channel.is_some() {
            tracing::warn!("the supervisor is gone; serving on, waiting to be adopted");
            g.channel = None;
            drop_queue(&mut g);
        }
    }

    /// Whether a supervisor is attached.
    pub fn supervised(&self) -> bool {
        self.lock().channel.is_some()
    }

    /// Hands the ledger to a new supervisor on `sock` (after its [`Note::Adopt`]) and makes
    /// `sock` the channel. Refused while a supervisor is attached (a channel whose peer has
    /// hung up is none: the worker's request thread may be busy with a move and not have
    /// read the close yet).
    ///
    /// While a move runs, waits for it to end (at most the keeper's move wait,
    /// [`ADOPT_MOVE_WAIT`]), so that [`Note::Adopted`] says how it ended; past the wait it
    /// hands over with the move running, and the outcome follows on `sock`.
    pub fn adopt(&self, sock: OwnedFd, endpoint: &str) -> Result<(), ChannelError> {
        self.adopt_claimed(sock, endpoint, None)
    }

    /// [`Keeper::adopt`] by a supervisor whose record of this worker names `nonce`
    /// ([`Note::Adopt`]): refused, the ledger kept, when the worker has another nonce (the
    /// record names another worker; it was forged or copied). A request without one (a
    /// supervisor of an earlier release) is answered: the supervisor checks the nonce in
    /// [`Note::Adopted`].
    pub fn adopt_claimed(
        &self,
        sock: OwnedFd,
        endpoint: &str,
        nonce: Option<&WorkerNonce>,
    ) -> Result<(), ChannelError> {
        let mut g = self.lock();
        let refuse = |reason: String| -> Result<(), ChannelError> {
            custody::send(&sock, &Note::AdoptRefused { reason }, &[])
        };
        if endpoint != self.endpoint {
            return refuse(format!(
                "this worker serves endpoint `{}`, not `{endpoint}`",
                self.endpoint
            ));
        }
        if let Some(claimed) = nonce
            && g.nonce.as_ref() != Some(claimed)
        {
            return refuse(
                "the record that names this worker has another nonce: it names another worker"
                    .into(),
            );
        }
        let attached = |g: &Inner| g.channel.as_ref().is_some_and(|ch| !hung_up(ch));
        if attached(&g) {
            return refuse("this worker has a supervisor".into());
        }
        let deadline = std::time::Instant::now() + self.move_wait;
        while g.last_move.as_ref().is_some_and(LastMove::running) {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                tracing::warn!(
                    wait_s = self.move_wait.as_secs_f64(),
                    "a move still runs: adopted with the move running; its outcome follows on the new channel"
                );
                break;
            }
            g = self
                .shared
                .changed
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if attached(&g) {
            return refuse("this worker has a supervisor".into());
        }
        // What was queued for the old channel is covered by the snapshot, except stats
        // (deltas: kept, to count right).
        drop_queue(&mut g);
        // Stats go after the ledger and `Adopted` (the adoption reads nothing else).
        let stats = g.overflow_stats.take();
        let migration = g.overflow_migration.take();
        g.channel = Some(Arc::new(sock));
        g.generation += 1;
        let all: Vec<(u64, Arc<OwnedFd>)> =
            g.ledger.iter().map(|(id, fd)| (*id, fd.clone())).collect();
        for batch in all.chunks(MAX_FDS) {
            let ids = batch.iter().map(|(id, _)| *id).collect();
            let fds = batch.iter().map(|(_, fd)| fd.clone()).collect();
            self.queue_locked(&mut g, Note::Fds { ids }, fds);
        }
        let objects: Vec<(String, Arc<OwnedFd>)> = g
            .objects
            .iter()
            .map(|(n, fd)| (n.clone(), fd.clone()))
            .collect();
        for batch in objects.chunks(MAX_FDS) {
            let names = batch.iter().map(|(n, _)| n.clone()).collect();
            let fds = batch.iter().map(|(_, fd)| fd.clone()).collect();
            self.queue_locked(&mut g, Note::Objects { names }, fds);
        }
        let adopted = Note::Adopted {
            pid: std::process::id(),
            replacement: g.replacement,
            last_move: g.last_move.clone(),
            restarts: Some(g.restarts),
            lease: g.lease.clone(),
            nonce: g.nonce.clone(),
        };
        self.queue_locked(&mut g, adopted, Vec::new());
        if let Some(failed) = g.board_failed.clone() {
            self.queue_locked(&mut g, failed, Vec::new());
        }
        // A re-executed image's first supervisor waits for its ready, made before it came.
        if let Some(ready) = g.unsent_ready.take().flatten() {
            self.queue_locked(&mut g, ready, Vec::new());
        }
        if let Some(stats) = stats {
            self.queue_locked(&mut g, Note::Stats(stats), Vec::new());
        }
        if let Some(migration) = migration {
            self.queue_locked(&mut g, migration, Vec::new());
        }
        let held = g.ledger.len() + g.objects.len();
        let last_move = g.last_move.clone();
        drop(g);
        self.shared.changed.notify_all();
        tracing::info!(held, ?last_move, "adopted by a new supervisor");
        Ok(())
    }

    /// Serves the adoption socket at `path` (bound here, mode 0600) on a thread: a connection
    /// from this user that sends [`Note::Adopt`] while no supervisor is attached gets the
    /// ledger and becomes the channel.
    pub fn serve_adoptions(self: &Arc<Self>, path: PathBuf) -> io::Result<()> {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let _ = std::fs::remove_file(&path);
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )?;
        let addr = SocketAddrUnix::new(&path)?;
        rustix::net::bind(&sock, &addr)?;
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        rustix::net::listen(&sock, 4)?;
        let keeper = self.clone();
        std::thread::Builder::new()
            .name("sy-worker-adopt".into())
            .spawn(move || {
                let uid = rustix::process::getuid();
                loop {
                    let conn = match rustix::net::accept_with(&sock, SocketFlags::CLOEXEC) {
                        Ok(c) => c,
                        Err(rustix::io::Errno::INTR) => continue,
                        Err(e) => {
                            tracing::error!(error = %e, "adoption socket failed; no adoption possible");
                            return;
                        }
                    };
                    match rustix::net::sockopt::socket_peercred(&conn) {
                        Ok(cred) if cred.uid == uid => {}
                        other => {
                            tracing::warn!(?other, "adoption attempt by another user refused");
                            continue;
                        }
                    }
                    // A peer that connects and sends nothing must not hold adoptions up.
                    if let Err(e) = rustix::net::sockopt::set_socket_timeout(
                        &conn,
                        rustix::net::sockopt::Timeout::Recv,
                        Some(ADOPT_REQUEST_TIMEOUT),
                    ) {
                        tracing::warn!(error = %e, "cannot bound the adoption request's wait");
                        continue;
                    }
                    let mut buf = Vec::new();
                    match custody::recv(&conn, &mut buf) {
                        Ok((Note::Adopt { endpoint, nonce }, _)) => {
                            // The connection becomes the custody channel: no timeout there.
                            if let Err(e) = rustix::net::sockopt::set_socket_timeout(
                                &conn,
                                rustix::net::sockopt::Timeout::Recv,
                                None,
                            ) {
                                tracing::warn!(error = %e, "cannot clear the adoption timeout");
                                continue;
                            }
                            if let Err(e) = keeper.adopt_claimed(conn, &endpoint, nonce.as_ref())
                            {
                                tracing::warn!(error = %e, "adoption failed");
                            }
                        }
                        other => tracing::warn!(?other, "not an adoption request; ignored"),
                    }
                }
            })?;
        Ok(())
    }
}

impl Drop for Keeper {
    fn drop(&mut self) {
        self.lock().closed = true;
        self.shared.queued.notify_all();
    }
}

/// Drops what is queued for a channel that is gone: covered by the ledger snapshot the next
/// supervisor gets, except stats (deltas), which are kept for it.
fn drop_queue(g: &mut Inner) {
    for q in std::mem::take(&mut g.queue) {
        if let Note::Stats(stats) = q.note {
            g.overflow_stats
                .get_or_insert_with(WorkerStats::default)
                .add(&stats);
        }
    }
}

/// Moves coalesced notes into the queue when it has room.
fn refill(g: &mut Inner) {
    if g.queue.len() < QUEUE_BOUND
        && let Some(note) = g.overflow_migration.take()
    {
        g.seq += 1;
        g.queue.push_back(Queued {
            note,
            fds: Vec::new(),
        });
    }
    if g.queue.len() < QUEUE_BOUND
        && let Some(stats) = g.overflow_stats.take()
    {
        g.seq += 1;
        g.queue.push_back(Queued {
            note: Note::Stats(stats),
            fds: Vec::new(),
        });
    }
}

/// The sender thread: sends the queued notes, in order, to the channel current when each
/// leaves the queue (the queue is cleared when the channel changes); the only place a slow
/// supervisor makes the worker wait. A failed send drops the channel (the supervisor is
/// gone) if it is still the current one.
fn send_notes(shared: &Shared) {
    let lock = || shared.inner.lock().unwrap_or_else(|p| p.into_inner());
    let mut g = lock();
    loop {
        let Some(q) = g.queue.pop_front() else {
            if g.closed {
                return;
            }
            if g.channel.is_some() && (g.overflow_stats.is_some() || g.overflow_migration.is_some())
            {
                refill(&mut g);
                continue;
            }
            g = shared.queued.wait(g).unwrap_or_else(|p| p.into_inner());
            continue;
        };
        let (channel, generation) = (g.channel.clone(), g.generation);
        drop(g);
        if let Some(ch) = channel {
            let fds: Vec<BorrowedFd<'_>> = q.fds.iter().map(|fd| fd.as_fd()).collect();
            if let Err(e) = custody::send(&*ch, &q.note, &fds) {
                let mut g = lock();
                if g.generation == generation && g.channel.is_some() {
                    tracing::warn!(error = %e, "the supervisor is gone; serving on without it");
                    g.channel = None;
                    drop_queue(&mut g);
                }
            }
        }
        drop(q);
        g = lock();
    }
}

/// Whether the peer of `channel` has closed its end (a supervisor that died).
fn hung_up(channel: &OwnedFd) -> bool {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut fds = [PollFd::new(channel, PollFlags::RDHUP)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut fds, Some(&zero)) {
        Ok(_) => fds[0]
            .revents()
            .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR),
        Err(_) => false,
    }
}

/// [`Custody`] through a [`Keeper`].
#[derive(Debug, Clone)]
pub struct KeeperCustody(pub Arc<Keeper>);

impl Custody for KeeperCustody {
    /// The client's descriptors are refused (`WouldBlock`) when the queue to the
    /// supervisor is full; the worker's own (the connection) never are.
    fn hold(&mut self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        if ids
            .iter()
            .all(|id| *id >= switchyard_server::continuity::FIRST_MESSAGE_ID)
        {
            self.0.try_hold(ids, fds)
        } else {
            self.0.hold(ids, fds)
        }
    }

    fn release(&mut self, ids: &[u64]) -> io::Result<()> {
        self.0.release(ids);
        Ok(())
    }
}

#[cfg(test)]
mod tests;
