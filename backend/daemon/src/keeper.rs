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

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use switchyard_server::continuity::Custody;

use crate::custody::{self, ChannelError, LastMove, MAX_FDS, MoveState, Note, StartMode};

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
    ledger: BTreeMap<u64, OwnedFd>,
    /// Memory objects in custody, by name.
    objects: BTreeMap<String, OwnedFd>,
    /// How a replacement must start (told to an adopting supervisor).
    replacement: Option<StartMode>,
    /// The last move and how it stands (told to an adopting supervisor).
    last_move: Option<LastMove>,
    /// The endpoint's restarts before this worker (told to an adopting supervisor).
    restarts: u64,
    /// The device's board failure, if it reported one ([`Note::BoardFailed`]; told again to
    /// an adopting supervisor: the one it was sent to may have died before acting on it).
    board_failed: Option<Note>,
}

/// See the [module](self) documentation.
pub struct Keeper {
    endpoint: String,
    inner: Mutex<Inner>,
    changed: Condvar,
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
        let mut ledger = BTreeMap::new();
        for (id, fd) in handed {
            ledger.insert(*id, fd.try_clone()?);
        }
        let mut held_objects = BTreeMap::new();
        for (name, fd) in objects {
            held_objects.insert(name.clone(), fd.try_clone()?);
        }
        Ok(Self {
            endpoint: endpoint.to_owned(),
            inner: Mutex::new(Inner {
                channel: Some(Arc::new(channel)),
                generation: 1,
                ledger,
                objects: held_objects,
                replacement: None,
                last_move: None,
                restarts: 0,
                board_failed: None,
            }),
            changed: Condvar::new(),
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
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Sends `note` on the current channel; a broken channel is dropped (the supervisor is
    /// gone) and the note with it.
    fn send_locked(g: &mut Inner, note: &Note, fds: &[BorrowedFd<'_>]) {
        let Some(ch) = &g.channel else { return };
        match custody::send(&**ch, note, fds) {
            Ok(()) => {}
            Err(e) => {
                tracing::warn!(error = %e, "the supervisor is gone; serving on without it");
                g.channel = None;
            }
        }
    }

    /// Puts `fds` into custody under `ids`.
    pub fn hold(&self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        let mut copies = Vec::with_capacity(fds.len());
        for fd in fds {
            copies.push(fd.try_clone_to_owned()?);
        }
        let mut g = self.lock();
        for (id, fd) in ids.iter().zip(copies) {
            g.ledger.insert(*id, fd);
        }
        for (ids, fds) in ids.chunks(MAX_FDS).zip(fds.chunks(MAX_FDS)) {
            Self::send_locked(&mut g, &Note::Hold { ids: ids.to_vec() }, fds);
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
            Self::send_locked(&mut g, &Note::Release { ids: ids.to_vec() }, &[]);
        }
    }

    /// Puts memory objects into custody under `names` (replacing what was held under a
    /// name).
    pub fn hold_objects(&self, objects: &[(String, std::fs::File)]) -> io::Result<()> {
        let mut copies = Vec::with_capacity(objects.len());
        for (_, f) in objects {
            copies.push(OwnedFd::from(f.try_clone()?));
        }
        let mut g = self.lock();
        for ((name, _), fd) in objects.iter().zip(copies) {
            g.objects.insert(name.clone(), fd);
        }
        for batch in objects.chunks(MAX_FDS) {
            let names = batch.iter().map(|(n, _)| n.clone()).collect();
            let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, f)| f.as_fd()).collect();
            Self::send_locked(&mut g, &Note::HoldObjects { names }, &fds);
        }
        Ok(())
    }

    /// Records the endpoint's restarts before this worker ([`Note::Start`]), for an adopting
    /// supervisor.
    pub fn set_restarts(&self, restarts: u64) {
        self.lock().restarts = restarts;
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
        Self::send_locked(
            &mut g,
            &Note::ReleaseObjects {
                names: names.to_vec(),
            },
            &[],
        );
    }

    /// Sends a note without descriptors (ready, move outcomes) to the current supervisor.
    /// A [`Note::Ready`] also records how a replacement must start, for an adopting
    /// supervisor.
    pub fn notify(&self, note: &Note) {
        let mut g = self.lock();
        match note {
            Note::Ready { replacement, .. } => g.replacement = *replacement,
            Note::BoardFailed { .. } => g.board_failed = Some(note.clone()),
            _ => {}
        }
        Self::send_locked(&mut g, note, &[]);
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
        if let Some(m) = &mut g.last_move {
            m.state = state;
        }
        Self::send_locked(&mut g, answer, &[]);
        drop(g);
        self.changed.notify_all();
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
            g = self.changed.wait(g).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// The channel of `generation` closed: its supervisor is gone.
    pub fn lost(&self, generation: u64) {
        let mut g = self.lock();
        if g.generation == generation && g.channel.is_some() {
            tracing::warn!("the supervisor is gone; serving on, waiting to be adopted");
            g.channel = None;
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
                .changed
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if attached(&g) {
            return refuse("this worker has a supervisor".into());
        }
        let all: Vec<(u64, BorrowedFd<'_>)> =
            g.ledger.iter().map(|(id, fd)| (*id, fd.as_fd())).collect();
        for batch in all.chunks(MAX_FDS) {
            let ids = batch.iter().map(|(id, _)| *id).collect();
            let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, fd)| *fd).collect();
            custody::send(&sock, &Note::Fds { ids }, &fds)?;
        }
        let objects: Vec<(&String, BorrowedFd<'_>)> =
            g.objects.iter().map(|(n, fd)| (n, fd.as_fd())).collect();
        for batch in objects.chunks(MAX_FDS) {
            let names = batch.iter().map(|(n, _)| (*n).clone()).collect();
            let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, fd)| *fd).collect();
            custody::send(&sock, &Note::Objects { names }, &fds)?;
        }
        custody::send(
            &sock,
            &Note::Adopted {
                pid: std::process::id(),
                replacement: g.replacement,
                last_move: g.last_move.clone(),
                restarts: Some(g.restarts),
            },
            &[],
        )?;
        if let Some(failed) = &g.board_failed {
            custody::send(&sock, failed, &[])?;
        }
        let held = g.ledger.len() + g.objects.len();
        g.channel = Some(Arc::new(sock));
        g.generation += 1;
        let last_move = g.last_move.clone();
        drop(g);
        self.changed.notify_all();
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
                        Ok((Note::Adopt { endpoint }, _)) => {
                            // The connection becomes the custody channel: no timeout there.
                            if let Err(e) = rustix::net::sockopt::set_socket_timeout(
                                &conn,
                                rustix::net::sockopt::Timeout::Recv,
                                None,
                            ) {
                                tracing::warn!(error = %e, "cannot clear the adoption timeout");
                                continue;
                            }
                            if let Err(e) = keeper.adopt(conn, &endpoint) {
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
    fn hold(&mut self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        self.0.hold(ids, fds)
    }

    fn release(&mut self, ids: &[u64]) -> io::Result<()> {
        self.0.release(ids);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("keeper-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd")
    }

    fn ino(fd: &OwnedFd) -> u64 {
        rustix::fs::fstat(fd).expect("fstat").st_ino
    }

    /// What a supervisor receives from an adoption on `ours`.
    fn adopted_ledger(ours: &OwnedFd) -> (BTreeMap<u64, OwnedFd>, Note) {
        let (held, _, note) = adopted(ours);
        (held, note)
    }

    /// What a supervisor receives from an adoption on `ours`, memory objects included.
    fn adopted(ours: &OwnedFd) -> (BTreeMap<u64, OwnedFd>, BTreeMap<String, OwnedFd>, Note) {
        let mut held = BTreeMap::new();
        let mut objects = BTreeMap::new();
        let mut buf = Vec::new();
        loop {
            match custody::recv(ours, &mut buf).expect("recv") {
                (Note::Fds { ids }, fds) => held.extend(ids.into_iter().zip(fds)),
                (Note::Objects { names }, fds) => objects.extend(names.into_iter().zip(fds)),
                (note, _) => return (held, objects, note),
            }
        }
    }

    #[test]
    fn an_adopting_supervisor_gets_exactly_what_the_last_one_held() {
        let (sup1, worker1) = custody::pair().expect("pair");
        let (a, b, c) = (memfd(), memfd(), memfd());
        let handed = BTreeMap::from([(1, a.try_clone().expect("dup"))]);
        let (vram, next, bells) = (memfd(), memfd(), memfd());
        let objects = BTreeMap::from([("k.vram".to_owned(), vram.try_clone().expect("dup"))]);
        let keeper = Keeper::new("ep", worker1, &handed, &objects).expect("keeper");
        keeper.set_restarts(3);
        keeper
            .hold(&[10, 11], &[b.as_fd(), c.as_fd()])
            .expect("hold");
        keeper.release(&[10]);
        // Refused while the first supervisor is attached: no split custody.
        let (sup2, worker2) = custody::pair().expect("pair");
        keeper.adopt(worker2, "ep").expect("answered");
        assert!(matches!(adopted_ledger(&sup2).1, Note::AdoptRefused { .. }));
        // The first supervisor goes; while none is attached, changes stay in the ledger.
        // (As the worker's request thread does when the channel reads closed. Not detected
        // here by a failed send: a process another test forks meanwhile may hold a copy of
        // `sup1` until it execs, keeping the channel open.)
        drop(sup1);
        keeper.lost(1);
        assert!(!keeper.supervised());
        let d = memfd();
        keeper.hold(&[12], &[d.as_fd()]).expect("hold unsupervised");
        keeper.release(&[11]);
        let file = |fd: &OwnedFd| std::fs::File::from(fd.try_clone().expect("dup"));
        keeper
            .hold_objects(&[
                ("k.vram@next".to_owned(), file(&next)),
                ("k.bells".to_owned(), file(&bells)),
            ])
            .expect("hold objects unsupervised");
        keeper.release_objects(&["k.vram@next".to_owned()]);
        keeper.notify(&Note::Ready {
            resumed: false,
            replacement: Some(StartMode::Resume),
        });
        // Another endpoint's supervisor is refused.
        let (sup3, worker3) = custody::pair().expect("pair");
        keeper.adopt(worker3, "other").expect("answered");
        assert!(matches!(adopted_ledger(&sup3).1, Note::AdoptRefused { .. }));
        // The right one gets the ledger and becomes the channel.
        let (sup4, worker4) = custody::pair().expect("pair");
        keeper.adopt(worker4, "ep").expect("adopt");
        let (held, objects, last) = adopted(&sup4);
        assert_eq!(
            last,
            Note::Adopted {
                pid: std::process::id(),
                replacement: Some(StartMode::Resume),
                last_move: None,
                restarts: Some(3),
            },
            "the adopting supervisor learns how a replacement starts and the restarts so far"
        );
        let got: Vec<(u64, u64)> = held.iter().map(|(id, fd)| (*id, ino(fd))).collect();
        assert_eq!(got, vec![(1, ino(&a)), (12, ino(&d))]);
        let got: Vec<(&str, u64)> = objects
            .iter()
            .map(|(n, fd)| (n.as_str(), ino(fd)))
            .collect();
        assert_eq!(got, vec![("k.bells", ino(&bells)), ("k.vram", ino(&vram))]);
        assert!(keeper.supervised());
        keeper.release(&[12]);
        let mut buf = Vec::new();
        let (note, _) = custody::recv(&sup4, &mut buf).expect("the new channel carries notes");
        assert_eq!(note, Note::Release { ids: vec![12] });
    }

    #[test]
    fn a_silent_connection_does_not_hold_an_adoption_up() {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let dir = tempfile::tempdir().expect("tempdir");
        let path = adoption_path(dir.path(), 1);
        let (sup1, worker1) = custody::pair().expect("pair");
        let keeper = Arc::new(
            Keeper::new("ep", worker1, &BTreeMap::new(), &BTreeMap::new()).expect("keeper"),
        );
        keeper
            .serve_adoptions(path.clone())
            .expect("adoption socket");
        drop(sup1);
        keeper.lost(1);
        let connect = || {
            let s = rustix::net::socket_with(
                AddressFamily::UNIX,
                SocketType::SEQPACKET,
                SocketFlags::CLOEXEC,
                None,
            )
            .expect("socket");
            rustix::net::connect(&s, &SocketAddrUnix::new(&path).expect("addr")).expect("connect");
            s
        };
        let _silent = connect();
        let adopter = connect();
        let t0 = std::time::Instant::now();
        custody::send(
            &adopter,
            &Note::Adopt {
                endpoint: "ep".into(),
            },
            &[],
        )
        .expect("send");
        let (_, last) = adopted_ledger(&adopter);
        assert!(matches!(last, Note::Adopted { .. }), "{last:?}");
        assert!(
            t0.elapsed() < ADOPT_REQUEST_TIMEOUT * 2,
            "{:?}",
            t0.elapsed()
        );
        // The adopted channel has no timeout: a read on it (the worker's request thread)
        // waits for a quiet supervisor as long as it takes.
        let (_, channel) = keeper.channel();
        let reader = std::thread::spawn(move || {
            let mut buf = Vec::new();
            custody::recv(&*channel, &mut buf).map(|(note, _)| note)
        });
        std::thread::sleep(ADOPT_REQUEST_TIMEOUT + std::time::Duration::from_millis(500));
        let mv = Note::Move {
            to: "b".into(),
            detached: false,
            target: None,
        };
        custody::send(&adopter, &mv, &[]).expect("send");
        let got = reader.join().expect("reader");
        assert_eq!(got.ok(), Some(mv));
    }

    /// A keeper whose first supervisor (`sup1`, returned) asked for a move to `to`, begun.
    fn moving(to: &str, wait: std::time::Duration) -> (Arc<Keeper>, OwnedFd) {
        let (sup1, worker1) = custody::pair().expect("pair");
        let keeper = Arc::new(
            Keeper::new("ep", worker1, &BTreeMap::new(), &BTreeMap::new())
                .expect("keeper")
                .with_move_wait(wait),
        );
        let (generation, _) = keeper.channel();
        assert!(keeper.begin_move(generation, to));
        (keeper, sup1)
    }

    fn moved(downtime_us: u64) -> Note {
        Note::Moved {
            report: crate::custody::MoveReport {
                downtime_us,
                ..Default::default()
            },
        }
    }

    #[test]
    fn an_adoption_during_a_move_waits_for_it_and_says_how_it_ended() {
        let (keeper, sup1) = moving("gpu1", std::time::Duration::from_secs(30));
        // The supervisor that asked dies; the worker's request thread, busy moving, has not
        // read the close: the hung-up channel does not refuse the adoption.
        drop(sup1);
        assert!(keeper.supervised());
        // (A process another test forks meanwhile may hold a copy of `sup1` until it execs.)
        let (_, old) = keeper.channel();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !hung_up(&old) {
            assert!(
                std::time::Instant::now() < deadline,
                "the channel does not read hung up"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let (sup2, worker2) = custody::pair().expect("pair");
        let adopting = {
            let keeper = keeper.clone();
            std::thread::spawn(move || keeper.adopt(worker2, "ep"))
        };
        std::thread::sleep(std::time::Duration::from_millis(200));
        assert!(!adopting.is_finished(), "the adoption waits for the move");
        keeper.end_move(&moved(42));
        adopting.join().expect("adopting").expect("adopted");
        let (_, last) = adopted_ledger(&sup2);
        let Note::Adopted { last_move, .. } = last else {
            panic!("{last:?}")
        };
        let last_move = last_move.expect("the last move");
        assert!(last_move.moved_to("gpu1"), "{last_move:?}");
        assert_eq!(
            last_move.state,
            MoveState::Moved {
                report: Some(crate::custody::MoveReport {
                    downtime_us: 42,
                    ..Default::default()
                })
            }
        );
        // The outcome is told once: no answer follows on the new channel.
        keeper.release(&[9]);
        let (note, _) = custody::recv(&sup2, &mut Vec::new()).expect("recv");
        assert_eq!(note, Note::Release { ids: vec![9] });
    }

    #[test]
    fn past_the_move_wait_the_adoption_says_the_move_runs_and_its_outcome_follows() {
        let (keeper, sup1) = moving("gpu1", std::time::Duration::from_millis(100));
        drop(sup1);
        keeper.lost(1);
        let (sup2, worker2) = custody::pair().expect("pair");
        keeper.adopt(worker2, "ep").expect("adopted");
        let (_, last) = adopted_ledger(&sup2);
        let Note::Adopted { last_move, .. } = last else {
            panic!("{last:?}")
        };
        assert_eq!(
            last_move.map(|m| m.state),
            Some(MoveState::Running),
            "handed over with the move running"
        );
        let failed = Note::MoveFailed {
            error: "no room".into(),
        };
        keeper.end_move(&failed);
        let (note, _) = custody::recv(&sup2, &mut Vec::new()).expect("recv");
        assert_eq!(note, failed, "the outcome follows on the new channel");
    }

    #[test]
    fn a_move_asked_by_a_supervisor_gone_before_it_began_does_not_run() {
        let (sup1, worker1) = custody::pair().expect("pair");
        let keeper =
            Keeper::new("ep", worker1, &BTreeMap::new(), &BTreeMap::new()).expect("keeper");
        let (old, _) = keeper.channel();
        // The request thread read a Move from the first channel, but a new supervisor
        // adopted the worker before the move began: it would never hear of it.
        drop(sup1);
        keeper.lost(old);
        let (sup2, worker2) = custody::pair().expect("pair");
        keeper.adopt(worker2, "ep").expect("adopted");
        assert!(matches!(adopted_ledger(&sup2).1, Note::Adopted { .. }));
        assert!(!keeper.begin_move(old, "gpu1"));
        assert_eq!(keeper.last_move(), None);
        let (current, _) = keeper.channel();
        assert!(keeper.begin_move(current, "gpu1"));
    }

    #[test]
    fn an_adopted_note_of_an_earlier_release_has_no_last_move() {
        let note: Note =
            serde_json::from_str(r#"{"adopted":{"pid":7,"replacement":"resume"}}"#).expect("note");
        assert_eq!(
            note,
            Note::Adopted {
                pid: 7,
                replacement: Some(StartMode::Resume),
                last_move: None,
                restarts: None,
            }
        );
    }
}
