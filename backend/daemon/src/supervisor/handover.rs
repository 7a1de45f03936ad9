//! The adoption handshake: a supervisor connects to a worker's adoption socket and takes
//! its custody over (used for a worker of an earlier daemon, [`super::adopt`], and for a
//! worker's re-executed image, `launch`).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::Path;

use crate::custody::{self, LastMove, Note, WorkerNonce};

/// What an adoption hands over.
#[derive(Debug)]
pub(super) struct Adoption {
    /// The custody channel from now on.
    pub(super) channel: OwnedFd,
    /// Held descriptors by custody id.
    pub(super) held: BTreeMap<u64, OwnedFd>,
    /// Memory objects by name.
    pub(super) objects: BTreeMap<String, OwnedFd>,
    /// How the worker's replacement must start, as it said.
    pub(super) replacement: Option<crate::custody::StartMode>,
    /// Its last move, as it said.
    pub(super) last_move: Option<LastMove>,
    /// The endpoint's restarts before the worker (0 from workers of earlier releases).
    pub(super) restarts: u64,
    /// The lease it serves, as it said (`None` from workers of earlier releases).
    pub(super) lease: Option<String>,
}

/// Connects to a worker's adoption socket at `path` and takes its custody over: the channel
/// and everything held. The socket must be one (not a symbolic link) and served by the
/// recorded worker `pid` itself, running as our uid, and the worker must prove the record's
/// `nonce` ([`Note::Adopted`]): the record that named the pid is not proof enough.
///
/// A record without a nonce (written by a daemon of an earlier release, which made none)
/// is taken for a worker without one only (a worker of that release, whose proof is the
/// socket's peer alone, as it was then); a worker that has a nonce is never adopted under
/// such a record, nor one without a nonce under a record that has one.
pub(super) fn adopt_from(
    path: &Path,
    endpoint: &str,
    pid: u32,
    nonce: Option<&WorkerNonce>,
) -> Result<Adoption, custody::ChannelError> {
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
            nonce: nonce.cloned(),
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
                    lease,
                    nonce: proved,
                    ..
                },
                _,
            ) => {
                match (nonce, &proved) {
                    (Some(ours), Some(theirs)) if ours == theirs => {}
                    (None, None) => {}
                    (Some(_), _) => {
                        return Err(refused(format!(
                            "process {pid} does not prove the nonce of its record{}",
                            if proved.is_some() {
                                " (it has another: the record names another worker)"
                            } else {
                                " (it has none)"
                            }
                        )));
                    }
                    (None, Some(_)) => {
                        return Err(refused(format!(
                            "the record of process {pid} has no nonce, but the process has one: the record was not written by the daemon that started it"
                        )));
                    }
                }
                return Ok(Adoption {
                    lease,
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
        serve_proving(path, None)
    }

    /// [`serve`], proving `nonce` in its `Adopted`.
    fn serve_proving(
        path: &Path,
        nonce: Option<WorkerNonce>,
    ) -> std::thread::JoinHandle<Option<Note>> {
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
                    lease: None,
                    nonce,
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
        let e = adopt_from(&path, "ep", me + 1, None).expect_err("another process");
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
        let e = adopt_from(&link, "ep", me, None).expect_err("a link");
        assert!(format!("{e:?}").contains("symbolic link"), "{e:?}");
        // Positive control: the recorded process on the socket itself.
        let held = adopt_from(&path, "ep", me, None).expect("adopted").held;
        assert!(held.is_empty());
        assert!(matches!(
            server.join().expect("server"),
            Some(Note::Adopt { endpoint, nonce: None }) if endpoint == "ep"
        ));
    }

    #[test]
    fn only_a_worker_that_proves_its_records_nonce_is_adopted() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("w.sock");
        let me = std::process::id();
        let ours = WorkerNonce::generate().expect("nonce");
        let other = WorkerNonce::generate().expect("nonce");
        // (the record's nonce, the worker's, adopted?)
        let cases = [
            (Some(&ours), Some(other.clone()), false),
            (Some(&ours), None, false),
            (None, Some(ours.clone()), false),
            // An earlier release's record and worker: the socket's peer is the proof.
            (None, None, true),
            (Some(&ours), Some(ours.clone()), true),
        ];
        for (record, worker, adopted) in cases {
            let server = serve_proving(&path, worker.clone());
            let got = adopt_from(&path, "ep", me, record);
            assert_eq!(
                got.is_ok(),
                adopted,
                "record {record:?}, worker {worker:?}: {got:?}"
            );
            if let Err(e) = got {
                assert!(format!("{e}{e:?}").contains("nonce"), "{e:?}");
            }
            // The request named the record's nonce, for the worker to check too.
            assert!(matches!(
                server.join().expect("server"),
                Some(Note::Adopt { nonce, .. }) if nonce.as_ref() == record
            ));
        }
    }
}
