//! The control socket: binding (mode 0600, stale files replaced, live servers refused) and the
//! HTTP/1.1 accept loop that serves an axum router on it.
//!
//! No client can hold the server: a request's headers and its body must each arrive within a
//! timeout ([`HEADER_READ_TIMEOUT`](crate::HEADER_READ_TIMEOUT), [`BODY_READ_TIMEOUT`](crate::BODY_READ_TIMEOUT)), and at most [`MAX_CONNECTIONS`](crate::MAX_CONNECTIONS)
//! connections are served at once. When they are all open, a new one closes the connection
//! that has waited longest for a request (one idle between requests, or still sending its
//! headers); when every one has a request in progress (a handler running, or a reply still
//! being sent, an events stream say), the new one gets 503 `too_many_connections` at once and
//! is closed. See [`Limits`].
//!
//! Connections are admitted by the uid of the process that connected (`SO_PEERCRED`, read at
//! accept and handed to every request as a [`crate::Caller`]): a user other than root and the
//! server's own holds at most [`MAX_CONNECTIONS_PER_UID`](crate::MAX_CONNECTIONS_PER_UID) of them, and such users together
//! never the last [`RESERVED_CONNECTIONS`](crate::RESERVED_CONNECTIONS), which are root's. Past its own limit a user's new
//! connection closes that user's longest idle one, or is refused (503, the message names the
//! limit); it never closes another's connection to get past its own limit. See
//! [`crate::admission`].

use std::collections::HashMap;
use std::fs;
use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixListener as StdUnixListener;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Bytes;
use hyper::body::{Body as HttpBody, Frame, Incoming, SizeHint};
use hyper::service::Service as _;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::net::UnixListener;
use tokio::sync::{Notify, watch};
use tokio::task::JoinSet;

use crate::ControlError;
use crate::admission::{Admission, Caller, ConnectionCounts, Scope, StreamTable, admit_connection};
use crate::api::{ApiError, JSON};
use crate::limits::Limits;

/// The longest path AF_UNIX binds (`sun_path` is 108 bytes with the terminating NUL).
pub const MAX_SOCKET_PATH: usize = 107;

/// How long connections still open at shutdown get to finish their request before they are
/// cut (an events stream whose hub is not closed never finishes by itself).
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(2);

/// A bound control socket, not yet serving. The socket file is removed when this is dropped
/// (or [`ControlSocket::serve`] returns), if the file at the path is still the one bound here.
#[derive(Debug)]
pub struct ControlSocket {
    listener: StdUnixListener,
    path: PathBuf,
    /// Device and inode of the socket file bound here.
    ident: (u64, u64),
    limits: Limits,
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
        // Bound in a private directory next to the path and renamed into place with its
        // mode, every step on directory descriptors (`switchyard_endpoint::place`).
        use switchyard_endpoint::place::{PlaceError, bind_in_place};
        let placed = bind_in_place(path, 0o600).map_err(|e| match e {
            PlaceError::Taken => ControlError::SocketPathTaken(path.to_owned()),
            PlaceError::InUse => ControlError::SocketInUse(path.to_owned()),
            PlaceError::Io(e) => bind_err(e),
        })?;
        if placed.replaced_stale {
            tracing::info!(socket = %path.display(), "replaced a stale control socket");
        }
        placed.listener.set_nonblocking(true).map_err(bind_err)?;
        Ok(Self {
            listener: placed.listener,
            path: path.to_owned(),
            ident: placed.ident,
            limits: Limits::default(),
        })
    }

    /// Serves with these limits instead of the default ones.
    pub fn with_limits(mut self, limits: Limits) -> Self {
        self.limits = limits;
        self
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Serves `router` until `shutdown` completes. Then the socket file is removed and no
    /// connection is accepted any more; open connections finish the request in progress
    /// (within [`SHUTDOWN_GRACE`], after which they are cut) and `serve` returns.
    ///
    /// Each connection is HTTP/1.1 with keep-alive, within the socket's [`Limits`]. Must run
    /// inside a tokio runtime (with I/O and time enabled).
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
        let limits = self.limits;
        let server_uid = rustix::process::geteuid().as_raw();
        let streams = Arc::new(StreamTable::new(limits));
        let (stop_tx, stop_rx) = watch::channel(false);
        let mut connections = JoinSet::new();
        let mut slots: HashMap<tokio::task::Id, Arc<Slot>> = HashMap::new();
        let mut accepted_count = 0u64;
        tokio::pin!(shutdown);
        loop {
            tokio::select! {
                () = &mut shutdown => break,
                Some(done) = connections.join_next_with_id(), if !connections.is_empty() => {
                    let id = match done {
                        Ok((id, ())) => id,
                        Err(e) => e.id(),
                    };
                    slots.remove(&id);
                }
                accepted = listener.accept() => match accepted {
                    Ok((stream, _)) => {
                        let Ok(cred) = stream.peer_cred() else {
                            // Nothing to admit it by (the peer is gone already).
                            tracing::debug!("a control connection without peer credentials; closed");
                            continue;
                        };
                        let caller = Caller::new(
                            cred.uid(),
                            cred.gid(),
                            cred.pid().and_then(|p| u32::try_from(p).ok()),
                            server_uid,
                            Arc::clone(&streams),
                        );
                        if let Err(refusal) = admit(&limits, &slots, &caller) {
                            refuse(&stream, &refusal);
                            continue;
                        }
                        accepted_count += 1;
                        let slot = Arc::new(Slot::new(accepted_count, &caller));
                        let task = serve_connection(
                            stream,
                            router.clone(),
                            limits,
                            caller,
                            Arc::clone(&slot),
                            stop_rx.clone(),
                        );
                        let handle = connections.spawn(task);
                        slots.insert(handle.id(), slot);
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

/// A served connection, as the accept loop sees it.
#[derive(Debug)]
struct Slot {
    /// The order it was accepted in.
    number: u64,
    /// Its peer's uid.
    uid: u32,
    /// Whether its peer is root or the server's own user.
    privileged: bool,
    /// Requests in progress (from their headers to the end of their reply), or [`CLOSING`].
    state: Arc<AtomicUsize>,
    /// Tells the connection to close.
    close: Notify,
}

/// [`Slot::state`] of a connection told to close.
const CLOSING: usize = 1 << (usize::BITS - 1);

impl Slot {
    fn new(number: u64, caller: &Caller) -> Self {
        Self {
            number,
            uid: caller.uid,
            privileged: caller.privileged(),
            state: Arc::new(AtomicUsize::new(0)),
            close: Notify::new(),
        }
    }

    fn is_closing(&self) -> bool {
        self.state.load(Ordering::Acquire) & CLOSING != 0
    }

    fn in_scope(&self, scope: Scope) -> bool {
        match scope {
            Scope::Any => true,
            Scope::Unprivileged => !self.privileged,
            Scope::Uid(uid) => self.uid == uid,
        }
    }
}

/// Makes room for a new connection of `caller` ([`admit_connection`]): `Err` with the
/// refusal's message when there is none.
fn admit(
    limits: &Limits,
    slots: &HashMap<tokio::task::Id, Arc<Slot>>,
    caller: &Caller,
) -> Result<(), String> {
    let mut counts = ConnectionCounts::default();
    for slot in slots.values().filter(|s| !s.is_closing()) {
        counts.total += 1;
        counts.unprivileged += usize::from(!slot.privileged);
        counts.of_uid += usize::from(slot.uid == caller.uid);
    }
    match admit_connection(limits, counts, caller.uid, caller.privileged()) {
        Admission::Room => Ok(()),
        Admission::CloseIdle { scope, refusal } => {
            if close_longest_idle(slots, scope) {
                Ok(())
            } else {
                Err(refusal)
            }
        }
    }
}

/// Tells the connection of `scope` that has waited longest for a request (none in progress)
/// to close. Whether there was one.
fn close_longest_idle(slots: &HashMap<tokio::task::Id, Arc<Slot>>, scope: Scope) -> bool {
    let mut idle: Vec<&Arc<Slot>> = slots
        .values()
        .filter(|s| s.in_scope(scope) && s.state.load(Ordering::Acquire) == 0)
        .collect();
    idle.sort_by_key(|s| s.number);
    // A request may start in between: the first that is still idle when it is marked.
    for slot in idle {
        if slot
            .state
            .compare_exchange(0, CLOSING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            tracing::debug!("control connections at the limit; closing an idle one");
            slot.close.notify_one();
            return true;
        }
    }
    false
}

/// Answers 503 `too_many_connections` with `message` on a connection past a limit, without
/// reading it, and closes it (the reply fits the empty socket buffer; a client that is gone
/// already is no matter).
fn refuse(stream: &tokio::net::UnixStream, message: &str) {
    tracing::debug!("{message}");
    let body = ApiError::new(
        hyper::StatusCode::SERVICE_UNAVAILABLE,
        "too_many_connections",
        message,
    )
    .body();
    let body = serde_json::to_string(&body).unwrap_or_default();
    let reply = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: {JSON}\r\nconnection: close\r\n\
         content-length: {}\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(reply.as_bytes());
}

/// Counts a request in progress on its connection until dropped (with the reply's body).
#[derive(Debug)]
struct InProgress(Arc<AtomicUsize>);

impl InProgress {
    fn new(state: &Arc<AtomicUsize>) -> Self {
        state.fetch_add(1, Ordering::AcqRel);
        Self(Arc::clone(state))
    }
}

impl Drop for InProgress {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A reply's body that keeps its request counted as in progress.
struct ReplyBody {
    inner: axum::body::Body,
    _request: InProgress,
}

impl HttpBody for ReplyBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// A request's body that fails with [`ControlError::BodyTimeout`] when it is not all there
/// by its deadline.
struct RequestBody {
    inner: Incoming,
    /// `None` for a request without a body.
    deadline: Option<Pin<Box<tokio::time::Sleep>>>,
    timeout: Duration,
}

impl RequestBody {
    fn new(inner: Incoming, timeout: Duration) -> Self {
        let deadline = (!inner.is_end_stream()).then(|| Box::pin(tokio::time::sleep(timeout)));
        Self {
            inner,
            deadline,
            timeout,
        }
    }
}

impl HttpBody for RequestBody {
    type Data = Bytes;
    type Error = ControlError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, ControlError>>> {
        let timeout = self.timeout;
        if let Some(deadline) = &mut self.deadline
            && deadline.as_mut().poll(cx).is_ready()
        {
            return Poll::Ready(Some(Err(ControlError::BodyTimeout(timeout))));
        }
        Pin::new(&mut self.inner)
            .poll_frame(cx)
            .map_err(ControlError::ReadBody)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

async fn serve_connection(
    stream: tokio::net::UnixStream,
    router: axum::Router,
    limits: Limits,
    caller: Caller,
    slot: Arc<Slot>,
    mut stop: watch::Receiver<bool>,
) {
    let router = TowerToHyperService::new(router);
    let state = Arc::clone(&slot.state);
    let service = hyper::service::service_fn(move |req: hyper::Request<Incoming>| {
        let request = InProgress::new(&state);
        let mut req = req.map(|body| RequestBody::new(body, limits.body_read_timeout));
        req.extensions_mut().insert(caller.clone());
        let reply = router.call(req);
        async move {
            let reply = reply.await?;
            Ok::<_, std::convert::Infallible>(reply.map(|inner| ReplyBody {
                inner,
                _request: request,
            }))
        }
    });
    let conn = hyper::server::conn::http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = async { let _ = stop.wait_for(|s| *s).await; } => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
        // Idle (no request in progress) and the server needs the slot: closed at once.
        () = slot.close.notified() => Ok(()),
    };
    if let Err(e) = result {
        tracing::debug!("control connection ended: {e}");
    }
}
