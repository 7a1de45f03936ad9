//! The worker: one process per endpoint, serving the endpoint's socket with a device whose
//! every descriptor is also held by the supervisor, so that a replacement can continue where
//! it stopped (see `switchyard_server::continuity`).
//!
//! Started by the supervisor as `switchyard worker` with the custody channel as standard
//! input; it receives the held descriptors ([`Note::Fds`]) and a [`Note::Start`], then serves
//! until the listening socket is shut down or the process is killed.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;

use switchyard_device::blackbox::BlackBox;
use switchyard_server::continuity::Continuity;
use switchyard_server::{DeviceSocket, Server, ServerConfig};
use switchyard_softgpu::{SoftGpu, SoftGpuConfig};

use crate::custody::{
    self, BLACK_BOX_ID, CONNECTION_ID, ChannelCustody, LISTENER_ID, Note, StartMode, VRAM_ID,
};

/// Why a worker could not serve.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The custody channel failed.
    #[error("Custody channel failed")]
    Channel(#[from] custody::ChannelError),
    /// Something the worker needs was not handed over.
    #[error("The supervisor did not hand over {0}")]
    Missing(&'static str),
    /// The device string is not valid.
    #[error("Invalid device `{0}`")]
    Device(String, #[source] Box<dyn std::error::Error + Send + Sync>),
    /// The black box cannot be used.
    #[error("Black box unusable")]
    BlackBox(#[from] switchyard_device::blackbox::BlackBoxError),
    /// The server failed.
    #[error("Server failed")]
    Server(#[from] switchyard_server::ServerError),
    /// An I/O operation failed.
    #[error("I/O failed")]
    Io(#[from] std::io::Error),
}

/// What a worker was asked to serve.
#[derive(Debug)]
struct Start {
    mode: StartMode,
    endpoint: String,
    socket: PathBuf,
    device: SoftGpuConfig,
    held: BTreeMap<u64, OwnedFd>,
}

fn receive_start(channel: &OwnedFd) -> Result<Start, WorkerError> {
    let mut held = BTreeMap::new();
    let mut buf = Vec::new();
    loop {
        let (note, fds) = custody::recv(channel, &mut buf)?;
        match note {
            Note::Fds { ids } => held.extend(ids.into_iter().zip(fds)),
            Note::Start {
                mode,
                endpoint,
                socket,
                device,
            } => {
                device
                    .validate()
                    .map_err(|e| WorkerError::Device(format!("{device:?}"), Box::new(e)))?;
                let config = device;
                return Ok(Start {
                    mode,
                    endpoint,
                    socket: socket.into(),
                    device: config,
                    held,
                });
            }
            other => tracing::warn!(?other, "unexpected custody note before start; ignored"),
        }
    }
}

/// Runs a worker on the custody channel `channel` (its standard input).
pub fn run(
    channel: OwnedFd,
    server_config: impl FnOnce(PathBuf) -> ServerConfig,
) -> Result<(), WorkerError> {
    let mut start = receive_start(&channel)?;
    let span = tracing::info_span!("endpoint", id = %start.endpoint);
    let _g = span.enter();
    let listener = UnixListener::from(
        start
            .held
            .remove(&LISTENER_ID)
            .ok_or(WorkerError::Missing("the listening socket"))?,
    );
    let config = server_config(start.socket.clone());
    let socket = DeviceSocket::adopt(listener, start.socket.clone());
    let custody_fd = channel.try_clone()?;
    let gpu = start.device;
    match start.mode {
        StartMode::Fresh => {
            let mut records = Continuity::records(&config.limits);
            records.extend(SoftGpu::black_box_records(&gpu));
            let bb = BlackBox::create(&records)?;
            custody::send(
                &channel,
                &Note::Hold {
                    ids: vec![BLACK_BOX_ID],
                },
                &[bb.file().as_fd()],
            )?;
            let continuity = Continuity::new(&bb, Box::new(ChannelCustody::new(custody_fd)))?;
            let bb2 = bb.clone();
            let mut server = Server::with_socket(config, socket, |ctx| {
                SoftGpu::with_black_box(gpu, ctx, &bb2, None)
            })?;
            let vram = server
                .device_slot()
                .with_as::<SoftGpu, _>(|g| g.vram_file().try_clone())
                .ok_or(WorkerError::Missing("the device's VRAM"))??;
            custody::send(
                &channel,
                &Note::Hold { ids: vec![VRAM_ID] },
                &[vram.as_fd()],
            )?;
            server.set_continuity(Arc::new(continuity));
            custody::send(&channel, &Note::Ready { resumed: false }, &[])?;
            tracing::info!(socket = %start.socket.display(), "worker serving (fresh device)");
            server.run()?;
        }
        StartMode::Resume => {
            let bb = BlackBox::open(
                start
                    .held
                    .remove(&BLACK_BOX_ID)
                    .ok_or(WorkerError::Missing("the black box"))?
                    .into(),
            )?;
            let vram = start
                .held
                .remove(&VRAM_ID)
                .ok_or(WorkerError::Missing("the device's VRAM"))?;
            let connection = start.held.remove(&CONNECTION_ID);
            let (continuity, resumed) =
                Continuity::resume(&bb, Box::new(ChannelCustody::new(custody_fd)))?;
            let held = &start.held;
            let bb2 = bb.clone();
            let mut problems = Vec::new();
            let mut server = Server::with_socket(config, socket, |ctx| {
                problems = Server::restore_tables(&ctx, &resumed, |id| {
                    held.get(&id).and_then(|f| f.try_clone().ok())
                });
                let (gpu, recovery) = SoftGpu::recover(gpu, ctx, &bb2, vram.into())?;
                tracing::info!(queues = ?recovery.queues, resent_interrupts = recovery.resent, "device recovered");
                Ok::<_, switchyard_softgpu::SoftGpuError>(gpu)
            })?;
            for p in &problems {
                tracing::error!(problem = %p, "could not restore all of the client's state");
            }
            server.set_continuity(Arc::new(continuity));
            custody::send(
                &channel,
                &Note::Ready {
                    resumed: connection.is_some(),
                },
                &[],
            )?;
            match connection {
                Some(conn) => {
                    tracing::info!(
                        windows = resumed.windows.len(),
                        vectors = resumed.vectors.len(),
                        journal_bytes = resumed.rx.len(),
                        "worker resumed the connection"
                    );
                    server.run_resumed(UnixStream::from(conn), &resumed, start.held)?;
                }
                None => {
                    tracing::info!("worker resumed (no client connected)");
                    server.run()?;
                }
            }
        }
    }
    Ok(())
}
