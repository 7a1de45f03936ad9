//! The device socket: binding (mode 0600 by default), one client at a time, clean refusal of a
//! second concurrent client, and shutdown.

use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::ServerError;

/// The longest socket path AF_UNIX can bind or connect to: `sun_path` holds 108 bytes
/// including the terminating NUL.
pub const MAX_SOCKET_PATH: usize = 107;

/// A bound device socket. Removes the socket file when dropped, if the file at its path is
/// still the one this process bound (another server may have taken the path over since).
#[derive(Debug)]
pub struct DeviceSocket {
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file this process bound (`None`: adopted, not ours to
    /// remove).
    ident: Option<(u64, u64)>,
}

impl DeviceSocket {
    /// Binds `path` with permissions `mode`. A stale socket file nobody listens on is replaced;
    /// a live one is an error. Every path AF_UNIX accepts (up to [`MAX_SOCKET_PATH`] bytes)
    /// works.
    pub fn bind(path: &Path, mode: u32) -> Result<Self, ServerError> {
        let len = path.as_os_str().len();
        if len > MAX_SOCKET_PATH {
            return Err(ServerError::SocketPathTooLong(path.to_owned(), len));
        }
        // Bound in a private directory next to the path and renamed into place once it
        // accepts connections with its mode (a VMM started as soon as the file exists never
        // sees ECONNREFUSED), every step on directory descriptors
        // (`switchyard_endpoint::place`).
        use switchyard_endpoint::place::{PlaceError, bind_in_place};
        let placed = bind_in_place(path, mode).map_err(|e| match e {
            PlaceError::Taken => ServerError::SocketPathTaken(path.to_owned()),
            PlaceError::InUse => ServerError::SocketInUse(path.to_owned()),
            PlaceError::Io(e) => ServerError::Bind(path.to_owned(), e),
        })?;
        Ok(Self {
            listener: placed.listener,
            path: path.to_owned(),
            ident: Some(placed.ident),
        })
    }

    /// A listening socket bound by someone else (a supervisor that keeps it across restarts
    /// of this process); `path` is for logs. The socket file is left in place when dropped.
    pub fn adopt(listener: UnixListener, path: PathBuf) -> Self {
        Self {
            listener,
            path,
            ident: None,
        }
    }

    /// Like [`DeviceSocket::adopt`], for a new owner of an endpoint's socket (a supervisor
    /// adopting a running worker): the file now at `path` is taken to be this socket's, and
    /// is removed when this is dropped if it is still that file.
    pub fn adopt_owned(listener: UnixListener, path: PathBuf) -> Self {
        let ident = fs::symlink_metadata(&path).ok().map(|m| (m.dev(), m.ino()));
        Self {
            listener,
            path,
            ident,
        }
    }

    /// The listening socket.
    pub fn listener(&self) -> &UnixListener {
        &self.listener
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DeviceSocket {
    fn drop(&mut self) {
        let Some(ident) = self.ident else {
            return;
        };
        match fs::symlink_metadata(&self.path) {
            Ok(m) if (m.dev(), m.ino()) == ident => {
                let _ = fs::remove_file(&self.path);
            }
            Ok(_) => tracing::info!(
                socket = %self.path.display(),
                "the socket path belongs to another server now; left in place"
            ),
            Err(_) => {}
        }
    }
}

/// Stops a running server from another thread (or a signal handler thread).
#[derive(Debug, Clone)]
pub struct StopHandle {
    inner: Arc<StopInner>,
}

#[derive(Debug)]
struct StopInner {
    stopping: AtomicBool,
    wake: std::fs::File,
    active: Mutex<Option<UnixStream>>,
}

impl StopHandle {
    pub(crate) fn new() -> io::Result<Self> {
        Ok(Self {
            inner: Arc::new(StopInner {
                stopping: AtomicBool::new(false),
                wake: switchyard_device::irq::new_eventfd()?,
                active: Mutex::new(None),
            }),
        })
    }

    /// Requests shutdown: no new clients are accepted, the active connection stops reading
    /// after the message in progress (its reply is still sent), then `run` returns.
    pub fn stop(&self) {
        self.inner.stopping.store(true, Ordering::SeqCst);
        let _ = std::io::Write::write(&mut &self.inner.wake, &1u64.to_ne_bytes());
        if let Some(s) = self
            .inner
            .active
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
        {
            let _ = s.shutdown(std::net::Shutdown::Read);
        }
    }

    /// A descriptor that becomes readable (and stays so) once shutdown is requested.
    pub(crate) fn abort_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.inner.wake.as_fd()
    }

    /// Whether shutdown was requested.
    pub fn is_stopping(&self) -> bool {
        self.inner.stopping.load(Ordering::SeqCst)
    }

    /// Whether the client being served is going away (hung up, or already detached): a new
    /// client arriving now is its successor, not a second concurrent client.
    fn active_is_ending(&self) -> bool {
        let slot = self.inner.active.lock().unwrap_or_else(|p| p.into_inner());
        let Some(s) = slot.as_ref() else { return true };
        let mut fds = [PollFd::new(s, PollFlags::RDHUP)];
        match rustix::event::poll(&mut fds, Some(&rustix::event::Timespec::default())) {
            Ok(_) => fds[0]
                .revents()
                .intersects(PollFlags::RDHUP | PollFlags::HUP | PollFlags::ERR),
            Err(_) => false,
        }
    }

    pub(crate) fn set_active(&self, s: Option<UnixStream>) {
        let mut slot = self.inner.active.lock().unwrap_or_else(|p| p.into_inner());
        *slot = s;
        if self.is_stopping()
            && let Some(s) = slot.as_ref()
        {
            let _ = s.shutdown(std::net::Shutdown::Read);
        }
    }
}

/// Accepts clients on a background thread and hands them out one at a time: while one is being
/// served (`busy`), further clients are accepted and immediately closed with a log line, so
/// they see EOF instead of hanging in the handshake.
pub(crate) struct Acceptor {
    rx: mpsc::Receiver<UnixStream>,
    busy: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Acceptor {
    pub(crate) fn start(sock: &DeviceSocket, stop: StopHandle) -> Result<Self, ServerError> {
        let listener = sock.listener.try_clone().map_err(ServerError::Accept)?;
        let (tx, rx) = mpsc::sync_channel::<UnixStream>(1);
        let busy = Arc::new(AtomicBool::new(false));
        let busy2 = busy.clone();
        let span = tracing::Span::current();
        let thread = thread::Builder::new()
            .name("sy-accept".into())
            .spawn(move || {
                let _g = span.enter();
                accept_loop(listener, tx, busy2, stop);
            })
            .map_err(ServerError::Accept)?;
        Ok(Self {
            rx,
            busy,
            thread: Some(thread),
        })
    }

    /// Waits for the next client; `None` once the server is stopping.
    pub(crate) fn next(&self) -> Option<UnixStream> {
        self.rx.recv().ok()
    }

    /// Marks the current client as finished so the next one can be handed out.
    pub(crate) fn done(&self) {
        self.busy.store(false, Ordering::SeqCst);
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How often a persisting accept failure is logged again (with the number of failures since).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(10);
/// Longest pause between accept retries while accepting keeps failing.
const ACCEPT_MAX_BACKOFF: Duration = Duration::from_secs(1);

/// Failures of `accept()` in a row: at the open-file limit (EMFILE/ENFILE) a pending
/// connection keeps the socket readable, so retrying at once would spin and flood the log.
/// Retries back off exponentially (up to [`ACCEPT_MAX_BACKOFF`]) and the failure is logged once,
/// then at most every [`ACCEPT_LOG_EVERY`] with a count.
#[derive(Debug, Default)]
struct AcceptFailures {
    /// Failures since accepting last worked.
    total: u64,
    /// Failures since the last log line.
    unlogged: u64,
    last_log: Option<Instant>,
    backoff: Duration,
}

impl AcceptFailures {
    /// Records a failure; returns how long to wait before retrying.
    fn failed(&mut self, e: &io::Error) -> Duration {
        self.total += 1;
        self.unlogged += 1;
        let now = Instant::now();
        match self.last_log {
            None => {
                tracing::warn!(error = %e, "accept failed; retrying with backoff");
                self.last_log = Some(now);
                self.unlogged = 0;
            }
            Some(t) if now.duration_since(t) >= ACCEPT_LOG_EVERY => {
                tracing::warn!(
                    error = %e,
                    failures = self.unlogged,
                    total = self.total,
                    "accept still failing"
                );
                self.last_log = Some(now);
                self.unlogged = 0;
            }
            Some(_) => {}
        }
        self.backoff = (self.backoff * 2).clamp(Duration::from_millis(10), ACCEPT_MAX_BACKOFF);
        self.backoff
    }

    /// Accepting works (again).
    fn succeeded(&mut self) {
        if self.total > 0 {
            tracing::info!(failures = self.total, "accept works again");
            *self = Self::default();
        }
    }
}

fn accept_loop(
    listener: UnixListener,
    tx: mpsc::SyncSender<UnixStream>,
    busy: Arc<AtomicBool>,
    stop: StopHandle,
) {
    let mut failures = AcceptFailures::default();
    // A client that reconnects in a loop while another is served must not flood the log.
    let refusals = switchyard_device::ratelimit::LogLimiter::new(
        "refusing a second client",
        switchyard_device::ratelimit::LOG_INTERVAL,
    );
    loop {
        if stop.is_stopping() {
            return;
        }
        let mut fds = [
            PollFd::new(&listener, PollFlags::IN),
            PollFd::from_borrowed_fd(stop.inner.wake.as_fd(), PollFlags::IN),
        ];
        match rustix::event::poll(&mut fds, None) {
            Ok(_) => {}
            Err(e) if e == rustix::io::Errno::INTR => continue,
            Err(e) => {
                tracing::error!(error = %e, "poll on the device socket failed");
                return;
            }
        }
        if stop.is_stopping() {
            return;
        }
        if !fds[0].revents().contains(PollFlags::IN) {
            continue;
        }
        match listener.accept() {
            Ok((stream, _)) => {
                failures.succeeded();
                if busy.load(Ordering::SeqCst) && stop.active_is_ending() {
                    // The previous client hung up and is being torn down: let this one wait
                    // for it (bounded) instead of refusing a legitimate reconnect.
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
                    while busy.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                if busy.swap(true, Ordering::SeqCst) {
                    if refusals.allow() {
                        tracing::warn!("refusing a second client: the device already has one");
                    }
                    let _ = stream.shutdown(std::net::Shutdown::Both);
                    drop(stream);
                    continue;
                }
                if tx.send(stream).is_err() {
                    return;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                let wait = failures.failed(&e);
                // Back off, but stay responsive to a stop request.
                let mut wake = [PollFd::from_borrowed_fd(
                    stop.inner.wake.as_fd(),
                    PollFlags::IN,
                )];
                let timeout = rustix::event::Timespec::try_from(wait).unwrap_or_default();
                let _ = rustix::event::poll(&mut wake, Some(&timeout));
            }
        }
    }
}
