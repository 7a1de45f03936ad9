//! The control socket: binding (mode 0600, stale files replaced, live servers refused) and the
//! HTTP/1.1 accept loop that serves an axum router on it.

use std::fs;
use std::future::Future;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener as StdUnixListener, UnixStream as StdUnixStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::UnixListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::ControlError;

/// The longest path AF_UNIX binds (`sun_path` is 108 bytes with the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// How long connections still open at shutdown get to finish their request before they are
/// cut (an events stream whose hub is not closed never finishes by itself).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// How long a client may take to send a request's headers.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// A bound control socket, not yet serving. The socket file is removed when this is dropped
/// (or [`ControlSocket::serve`] returns), if the file at the path is still the one bound here.
#[derive(Debug)]
pub struct ControlSocket {
    listener: StdUnixListener,
    path: PathBuf,
    /// Device and inode of the socket file bound here.
    ident: (u64, u64),
}

impl ControlSocket {
    /// Binds `path` with mode 0600 (only the daemon's user can connect). An existing socket
    /// file nobody accepts on (a crashed daemon's) is replaced; one a server accepts on is
    /// [`ControlError::SocketInUse`]; any other file is [`ControlError::SocketPathTaken`].
    ///
    /// The socket is bound in a private directory next to `path` and renamed into place, so
    /// the file appears with its final mode and already accepting. Needs no async runtime.
    pub fn bind(path: &Path) -> Result<Self, ControlError> {
        let len = path.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(ControlError::SocketPathTooLong {
                path: path.to_owned(),
                len,
            });
        }
        let bind_err = |source| ControlError::Bind {
            path: path.to_owned(),
            source,
        };
        let Some(name) = path.file_name() else {
            return Err(bind_err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the path does not name a file",
            )));
        };
        if let Ok(meta) = fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(ControlError::SocketPathTaken(path.to_owned()));
            }
            match StdUnixStream::connect(path) {
                Ok(_) => return Err(ControlError::SocketInUse(path.to_owned())),
                Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                    tracing::info!(socket = %path.display(), "replacing a stale control socket");
                    match fs::remove_file(path) {
                        Ok(()) => {}
                        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                        Err(e) => return Err(bind_err(e)),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(bind_err(e)),
            }
        }
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let staging = Staging::create(parent, name).map_err(bind_err)?;
        let listener = staging.bind().map_err(bind_err)?;
        fs::set_permissions(&staging.socket, fs::Permissions::from_mode(0o600))
            .map_err(bind_err)?;
        let meta = fs::symlink_metadata(&staging.socket).map_err(bind_err)?;
        fs::rename(&staging.socket, path).map_err(bind_err)?;
        drop(staging);
        listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(Self {
            listener,
            path: path.to_owned(),
            ident: (meta.dev(), meta.ino()),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves `router` until `shutdown` completes. Then the socket file is removed and no
    /// connection is accepted any more; open connections finish the request in progress
    /// (within [`SHUTDOWN_GRACE`], after which they are cut) and `serve` returns.
    ///
    /// Each connection is HTTP/1.1 with keep-alive. Must run inside a tokio runtime (with
    /// I/O and time enabled).
    pub async fn serve<F>(self, router: axum::Router, shutdown: F) -> Result<(), ControlError>
    where
        F: Future<Output = ()> + Send,
    {
        let listener = self
            .listener
            .try_clone()
            .and_then(UnixListener::from_std)
            .map_err(|source| ControlError::Bind {
                path: self.path.clone(),
                source,
            })?;
        tracing::info!(socket = %self.path.display(), "control API listening");
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut connections = JoinSet::new();
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => {}
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        connections.spawn(serve_connection(stream, router.clone(), stop_rx.clone()));
                    }
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!("control socket accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                },
            }
        }
        drop(listener);
        drop(self);
        let _ = stop_tx.send(true);
        let drained = tokio::time::timeout(SHUTDOWN_GRACE, async {
            while connections.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                open = connections.len(),
                "control connections still open after the shutdown grace period; cut"
            );
            connections.shutdown().await;
        }
        Ok(())
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        match fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == self.ident => {
                let _ = fs::remove_file(&self.path);
            }
            Ok(_) => tracing::info!(
                socket = %self.path.display(),
                "the control socket path belongs to another server now; left in place"
            ),
            Err(_) => {}
        }
    }
}

/// Binds `path` ([`ControlSocket::bind`]) and serves `router` on it until `shutdown`
/// ([`ControlSocket::serve`]).
pub async fn serve<F>(path: &Path, router: axum::Router, shutdown: F) -> Result<(), ControlError>
where
    F: Future<Output = ()> + Send,
{
    ControlSocket::bind(path)?.serve(router, shutdown).await
}

async fn serve_connection(
    stream: tokio::net::UnixStream,
    router: axum::Router,
    mut stop: watch::Receiver<bool>,
) {
    let service = TowerToHyperService::new(router);
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = async { let _ = stop.wait_for(|s| *s).await; } => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!("control connection ended: {e}");
    }
}

/// A private directory next to the socket path, where the socket is bound before it is renamed
/// into place. Removed (with anything left in it) when dropped.
struct Staging {
    dir: PathBuf,
    socket: PathBuf,
}

impl Staging {
    fn create(parent: &Path, name: &std::ffi::OsStr) -> io::Result<Self> {
        let pid = std::process::id();
        for n in 0..100u32 {
            let mut dir_name = std::ffi::OsString::from(".");
            dir_name.push(name);
            dir_name.push(format!(".{pid:x}.{n}"));
            let dir = parent.join(dir_name);
            match fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    // The umask may have taken bits from 0700; the owner needs all three.
                    fs::set_permissions(&dir, fs::Permissions::from_mode(0o700))?;
                    return Ok(Self {
                        socket: dir.join("s"),
                        dir,
                    });
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AlreadyExists,
            "cannot create a private staging directory next to the socket",
        ))
    }

    /// Binds at `self.socket`, through `/proc/self/fd` when that path is too long for AF_UNIX
    /// (the target fits, the staging path does not).
    fn bind(&self) -> io::Result<StdUnixListener> {
        if self.socket.as_os_str().len() <= MAX_SOCKET_PATH {
            return StdUnixListener::bind(&self.socket);
        }
        let dir = fs::File::open(&self.dir)?;
        StdUnixListener::bind(format!("/proc/self/fd/{}/s", dir.as_raw_fd()))
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.socket);
        let _ = fs::remove_dir(&self.dir);
    }
}
