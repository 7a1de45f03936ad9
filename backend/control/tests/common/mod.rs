//! A control server on a real UNIX socket, served by a tokio runtime on its own thread, for
//! the blocking client to talk to.

#![allow(dead_code)] // Each test file uses part of it.

use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use switchyard_control::{ControlClient, ControlError, ControlSocket, Limits};
use tokio::sync::oneshot;

/// A server running `router` until stopped (or dropped).
pub struct TestServer {
    path: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<Result<(), ControlError>>>,
}

impl TestServer {
    /// Binds `path` (errors are the bind's) and serves `router` on it.
    pub fn start(path: &Path, router: axum::Router) -> Result<Self, ControlError> {
        Self::start_with_limits(path, router, Limits::default())
    }

    /// [`TestServer::start`] with these limits.
    pub fn start_with_limits(
        path: &Path,
        router: axum::Router,
        limits: Limits,
    ) -> Result<Self, ControlError> {
        let socket = ControlSocket::bind(path)?.with_limits(limits);
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("tokio runtime");
            rt.block_on(socket.serve(router, async {
                let _ = stopped.await;
            }))
        });
        Ok(Self {
            path: path.to_owned(),
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn client(&self) -> ControlClient {
        ControlClient::connect(&self.path).expect("connect to the test server")
    }

    /// Asks the server to shut down and waits for `serve` to return; how long that took.
    pub fn stop(mut self) -> (Result<(), ControlError>, Duration) {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> (Result<(), ControlError>, Duration) {
        let start = Instant::now();
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        let result = match self.thread.take() {
            Some(t) => t.join().expect("the server thread panicked"),
            None => Ok(()),
        };
        (result, start.elapsed())
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// A fresh directory and a socket path in it.
pub fn socket_path() -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("control.sock");
    (dir, path)
}

/// `GET /hold`: answers "released" when `release` turns true, counting its calls in `entered`
/// (a request that stays in progress as long as a test wants).
pub fn hold_route(
    entered: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    release: tokio::sync::watch::Receiver<bool>,
) -> axum::routing::MethodRouter {
    axum::routing::get(move || {
        let (entered, mut release) = (entered.clone(), release.clone());
        async move {
            entered.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = release.wait_for(|r| *r).await;
            "released"
        }
    })
}
