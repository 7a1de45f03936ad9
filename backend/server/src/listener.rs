//! The device socket: binding (mode 0600 by default), one client at a time, clean refusal of a
//! second concurrent client, and shutdown.

use std::fs;
use std::io;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;

use rustix::event::{PollFd, PollFlags};

use crate::ServerError;

/// A bound device socket. Removes the socket file when dropped.
#[derive(Debug)]
pub struct DeviceSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl DeviceSocket {
    /// Binds `path` with permissions `mode`. A stale socket file nobody listens on is replaced;
    /// a live one is an error.
    pub fn bind(path: &Path, mode: u32) -> Result<Self, ServerError> {
        if let Ok(meta) = fs::symlink_metadata(path) {
            if !meta.file_type().is_socket() {
                return Err(ServerError::SocketPathTaken(path.to_owned()));
            }
            if UnixStream::connect(path).is_ok() {
                return Err(ServerError::SocketInUse(path.to_owned()));
            }
            fs::remove_file(path).map_err(|e| ServerError::Bind(path.to_owned(), e))?;
        }
        // Bind and listen under a temporary name, then rename into place: the socket file
        // appears only once it accepts connections, so a VMM started as soon as the file
        // exists never sees ECONNREFUSED. The socket is created without group/other access
        // (umask) and then given its exact mode.
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let tmp = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
        let _ = fs::remove_file(&tmp);
        let old = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
        let bound = UnixListener::bind(&tmp);
        rustix::process::umask(old);
        let listener = bound.map_err(|e| ServerError::Bind(path.to_owned(), e))?;
        let placed = fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))
            .and_then(|()| fs::rename(&tmp, path));
        if let Err(e) = placed {
            let _ = fs::remove_file(&tmp);
            return Err(ServerError::Bind(path.to_owned(), e));
        }
        Ok(Self {
            listener,
            path: path.to_owned(),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for DeviceSocket {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
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
        if self.is_stopping() {
            if let Some(s) = slot.as_ref() {
                let _ = s.shutdown(std::net::Shutdown::Read);
            }
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

fn accept_loop(
    listener: UnixListener,
    tx: mpsc::SyncSender<UnixStream>,
    busy: Arc<AtomicBool>,
    stop: StopHandle,
) {
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
                if busy.load(Ordering::SeqCst) && stop.active_is_ending() {
                    // The previous client hung up and is being torn down: let this one wait
                    // for it (bounded) instead of refusing a legitimate reconnect.
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
                    while busy.load(Ordering::SeqCst) && std::time::Instant::now() < deadline {
                        std::thread::sleep(std::time::Duration::from_millis(1));
                    }
                }
                if busy.swap(true, Ordering::SeqCst) {
                    tracing::warn!("refusing a second client: the device already has one");
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
                tracing::error!(error = %e, "accept failed");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
        }
    }
}
