//! Adoption: a later daemon's supervisor takes over a running worker from its adoption
//! socket, with everything it holds, and supervises it until it dies.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex};

use switchyard_server::DeviceSocket;

use crate::custody::{self, CONNECTION_ID, LISTENER_ID, LastMove, Note};

use super::launch::{Launch, supervise};
use super::{
    Endpoint, EndpointSpec, MoveSlot, Supervisor, SupervisorError, WorkerStatus, client_fds,
    file_identity,
};

impl Supervisor {
    /// Takes over supervising `spec`'s running worker `pid`, started by an earlier supervisor
    /// (an earlier daemon) that is gone: connects to its adoption socket in the adoption
    /// directory, receives everything held for the endpoint (the listening socket, the
    /// client's connection and descriptors, VRAM, black box), and from then on supervises it
    /// as if it had started it (a worker that dies is replaced; restart, upgrade and moves
    /// work). Refused if the worker offers no adoption socket or has a supervisor.
    pub fn adopt(&self, spec: EndpointSpec, pid: u32) -> Result<(), SupervisorError> {
        let failed = |reason: String| SupervisorError::Adopt {
            endpoint: spec.id.clone(),
            pid,
            reason,
        };
        let dir = self
            .adopt_dir
            .as_ref()
            .ok_or_else(|| failed("this supervisor has no adoption directory".into()))?;
        let mut endpoints = self.endpoints();
        if endpoints.contains_key(&spec.id) {
            return Err(SupervisorError::Exists(spec.id));
        }
        self.check_room(&endpoints, &spec.id)?;
        let path = crate::keeper::adoption_path(dir, pid);
        let Adoption {
            channel,
            mut held,
            objects,
            replacement,
            last_move,
            restarts,
        } = adopt_from(&path, &spec.id, pid)
            .map_err(|e| failed(format!("{}: {e}", path.display())))?;
        // A worker of an earlier release holds its memory objects by id.
        let mut objects = objects;
        for (id, name) in crate::custody::LEGACY_OBJECT_IDS {
            if let Some(fd) = held.remove(&id) {
                objects.insert(name.to_owned(), fd);
            }
        }
        let listener = held
            .remove(&LISTENER_ID)
            .ok_or_else(|| failed("the worker did not hand over the listening socket".into()))?;
        let socket = DeviceSocket::adopt_owned(
            std::os::unix::net::UnixListener::from(listener),
            spec.socket.clone(),
        );
        if let Err(e) = self.access.apply(&spec.socket) {
            tracing::warn!(
                endpoint = spec.id,
                socket = %spec.socket.display(),
                "cannot give the adopted endpoint's socket its access (mode {:o}, group {:?}): {e}",
                self.access.mode(),
                self.access.group
            );
        }
        let connected = held.contains_key(&CONNECTION_ID);
        let client = client_fds(&held);
        // A move still running: what it copies to (held under its pending name) tells, should
        // the worker die before it answers, whether its replacement runs the device there.
        let mut mv = MoveSlot::default();
        if last_move.as_ref().is_some_and(LastMove::running) {
            mv.target = objects.iter().find_map(|(name, fd)| {
                let base = name.strip_suffix(switchyard_device::kind::PENDING_SUFFIX)?;
                Some((base.to_owned(), file_identity(fd)?))
            });
        }
        if let Some(m) = &last_move {
            tracing::info!(endpoint = spec.id, pid, last_move = ?m, "the adopted worker's last move");
        }
        let ep = Arc::new(Endpoint {
            spec: spec.clone(),
            device: Mutex::new(None),
            next_lease: Mutex::new(None),
            fault: Mutex::new(None),
            fault_answered: Condvar::new(),
            socket,
            status: Mutex::new(WorkerStatus {
                pid: Some(pid),
                // The count goes on from the last daemon's: the worker has been ready.
                restarts,
                ready: restarts + 1,
                held: held.len() + objects.len(),
                client_fds: client,
                connected,
                lease: spec.lease.clone(),
                ..WorkerStatus::default()
            }),
            held: Mutex::new(held),
            objects: Mutex::new(objects),
            replacement: Mutex::new(replacement),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            channel: Mutex::new(channel.try_clone().ok()),
            mv: Mutex::new(mv),
            mv_changed: Condvar::new(),
            adopted_move: Mutex::new(last_move),
            thread: Mutex::new(None),
        });
        let (exe, ep2, sink) = (self.exe.clone(), ep.clone(), self.sink.clone());
        let adopt_dir = self.adopt_dir.clone();
        let budget = self.fd_budget;
        let thread = std::thread::Builder::new()
            .name(format!("sy-sup-{}", spec.id))
            .spawn(move || {
                supervise(
                    &ep2,
                    &exe,
                    &sink,
                    Launch {
                        adopt_dir: adopt_dir.as_deref(),
                        fd_budget: budget,
                    },
                    Some((channel, pid)),
                );
            })
            .map_err(|e| SupervisorError::Spawn(spec.id.clone(), e))?;
        *ep.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        endpoints.insert(spec.id.clone(), ep);
        tracing::info!(endpoint = spec.id, pid, "worker adopted");
        Ok(())
    }
}

/// What an adoption hands over.
#[derive(Debug)]
struct Adoption {
    /// The custody channel from now on.
    channel: OwnedFd,
    /// Held descriptors by custody id.
    held: BTreeMap<u64, OwnedFd>,
    /// Memory objects by name.
    objects: BTreeMap<String, OwnedFd>,
    /// How the worker's replacement must start, as it said.
    replacement: Option<crate::custody::StartMode>,
    /// Its last move, as it said.
    last_move: Option<LastMove>,
    /// The endpoint's restarts before the worker (0 from workers of earlier releases).
    restarts: u64,
}

/// Connects to a worker's adoption socket at `path` and takes its custody over: the channel
/// and everything held. The socket must be one (not a symbolic link) and served by the
/// recorded worker `pid` itself, running as our uid: the record that named the pid is not
/// proof enough.
fn adopt_from(path: &Path, endpoint: &str, pid: u32) -> Result<Adoption, custody::ChannelError> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    use std::os::unix::fs::FileTypeExt;
    let refused = |reason: String| custody::ChannelError::Io(std::io::Error::other(reason));
    let kind = std::fs::symlink_metadata(path)?.file_type();
    if kind.is_symlink() {
        return Err(refused("the adoption socket is a symbolic link".into()));
    }
    if !kind.is_socket() {
        return Err(refused("the adoption socket is not a socket".into()));
    }
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(std::io::Error::from)?;
    let addr = SocketAddrUnix::new(path).map_err(std::io::Error::from)?;
    rustix::net::connect(&sock, &addr).map_err(std::io::Error::from)?;
    let peer = rustix::net::sockopt::socket_peercred(&sock).map_err(std::io::Error::from)?;
    let ours = rustix::process::geteuid();
    if peer.uid != ours {
        return Err(refused(format!(
            "the adoption socket's server runs as uid {}, not as the daemon's uid {}",
            peer.uid.as_raw(),
            ours.as_raw()
        )));
    }
    if u32::try_from(peer.pid.as_raw_nonzero().get()) != Ok(pid) {
        return Err(refused(format!(
            "the adoption socket is served by process {}, not by the recorded worker {pid}",
            peer.pid.as_raw_nonzero()
        )));
    }
    custody::send(
        &sock,
        &Note::Adopt {
            endpoint: endpoint.to_owned(),
        },
        &[],
    )?;
    let mut held = BTreeMap::new();
    let mut objects = BTreeMap::new();
    let mut buf = Vec::new();
    loop {
        match custody::recv(&sock, &mut buf)? {
            (Note::Fds { ids }, fds) => held.extend(ids.into_iter().zip(fds)),
            (Note::Objects { names }, fds) => objects.extend(names.into_iter().zip(fds)),
            (
                Note::Adopted {
                    replacement,
                    last_move,
                    restarts,
                    ..
                },
                _,
            ) => {
                return Ok(Adoption {
                    restarts: restarts.unwrap_or(0),
                    channel: sock,
                    held,
                    objects,
                    replacement,
                    last_move,
                });
            }
            (Note::AdoptRefused { reason }, _) => {
                return Err(custody::ChannelError::Io(std::io::Error::other(reason)));
            }
            (other, _) => tracing::warn!(?other, "unexpected note during an adoption; ignored"),
        }
    }
}

#[cfg(test)]
mod adopt_from_tests {
    use super::*;

    /// An adoption socket served by this process: it answers one `Adopt` with `Adopted`.
    fn serve(path: &Path) -> std::thread::JoinHandle<Option<Note>> {
        use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .expect("socket");
        let _ = std::fs::remove_file(path);
        rustix::net::bind(&sock, &SocketAddrUnix::new(path).expect("addr")).expect("bind");
        rustix::net::listen(&sock, 4).expect("listen");
        std::thread::spawn(move || {
            let conn = rustix::net::accept(&sock).expect("accept");
            let (note, _) = custody::recv(&conn, &mut Vec::new()).ok()?;
            let pid = std::process::id();
            custody::send(
                &conn,
                &Note::Adopted {
                    pid,
                    replacement: None,
                    last_move: None,
                    restarts: None,
                },
                &[],
            )
            .expect("send");
            Some(note)
        })
    }

    #[test]
    fn only_the_recorded_process_on_a_real_socket_is_adopted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w.sock");
        let server = serve(&path);
        let me = std::process::id();
        // The record names another process than the one serving the socket.
        let e = adopt_from(&path, "ep", me + 1).expect_err("another process");
        let wanted = format!(
            "served by process {me}, not by the recorded worker {}",
            me + 1
        );
        assert!(format!("{e:?}").contains(&wanted), "{e:?}");
        let asked = server.join().expect("server");
        assert!(asked.is_none(), "nothing was asked: {asked:?}");
        // A symbolic link to a genuine socket is not followed.
        let server = serve(&path);
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&path, &link).expect("symlink");
        let e = adopt_from(&link, "ep", me).expect_err("a link");
        assert!(format!("{e:?}").contains("symbolic link"), "{e:?}");
        // Positive control: the recorded process on the socket itself.
        let held = adopt_from(&path, "ep", me).expect("adopted").held;
        assert!(held.is_empty());
        assert!(matches!(
            server.join().expect("server"),
            Some(Note::Adopt { endpoint }) if endpoint == "ep"
        ));
    }
}
