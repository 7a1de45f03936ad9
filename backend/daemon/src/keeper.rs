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

use std::collections::BTreeMap;
use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use switchyard_server::continuity::Custody;

use crate::custody::{self, ChannelError, MAX_FDS, Note, StartMode};

/// How long an adoption connection may take to send its request.
const ADOPT_REQUEST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

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
}

/// See the [module](self) documentation.
pub struct Keeper {
    endpoint: String,
    inner: Mutex<Inner>,
    changed: Condvar,
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
            }),
            changed: Condvar::new(),
        })
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
        if let Note::Ready { replacement, .. } = note {
            g.replacement = *replacement;
        }
        Self::send_locked(&mut g, note, &[]);
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
    /// `sock` the channel. Refused while a supervisor is attached.
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
        if g.channel.is_some() {
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
            },
            &[],
        )?;
        let held = g.ledger.len() + g.objects.len();
        g.channel = Some(Arc::new(sock));
        g.generation += 1;
        drop(g);
        self.changed.notify_all();
        tracing::info!(held, "adopted by a new supervisor");
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
    fn adopted(
        ours: &OwnedFd,
    ) -> (BTreeMap<u64, OwnedFd>, BTreeMap<String, OwnedFd>, Note) {
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
            },
            "the adopting supervisor learns how a replacement starts"
        );
        let got: Vec<(u64, u64)> = held.iter().map(|(id, fd)| (*id, ino(fd))).collect();
        assert_eq!(got, vec![(1, ino(&a)), (12, ino(&d))]);
        let got: Vec<(&str, u64)> = objects.iter().map(|(n, fd)| (n.as_str(), ino(fd))).collect();
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
        };
        custody::send(&adopter, &mv, &[]).expect("send");
        let got = reader.join().expect("reader");
        assert_eq!(got.ok(), Some(mv));
    }
}
