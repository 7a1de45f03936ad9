//! The servers under test, each on its own thread in this process, on a real UNIX socket:
//!
//! * Switchyard ([`switchyard_server::Server`], the code `switchyard serve` runs) with the
//!   softgpu, or with [`RegFile`], a trivial register file, so that the server itself can be
//!   compared with the peer on equal terms;
//! * the peer: the published `vfio_user` crate's `Server` with [`PeerRegFile`], the same
//!   trivial register file behind its `ServerBackend` trait.
//!
//! Both register files have region 0 of 4 KiB and region 1 of 1 MiB (for the size sweep).
//!
//! The softgpu can also be served with crash continuity on ([`DeviceKind::SoftGpuJournal`]),
//! as a pool worker serves it, with a custody keeper thread in the supervisor's place, and
//! with the pool's per-client descriptor budget on top ([`DeviceKind::SoftGpuJournalBudget`]).

use std::collections::BTreeMap;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use switchyard_client::Client;
use switchyard_daemon::custody::{self, BLACK_BOX_ID, ChannelCustody, Note};
use switchyard_device::blackbox::BlackBox;
use switchyard_device::{
    DeviceDescription, DeviceError, DmaSpace, IrqDesc, NUM_PCI_REGIONS, PciDevice, RegionDesc,
};
use switchyard_server::continuity::Continuity;
use switchyard_server::{DeviceSlot, Server, ServerConfig, StopHandle};
use switchyard_softgpu::{SoftGpu, SoftGpuConfig};

/// Size of register-file region 0.
pub const REGFILE_R0: usize = 4 << 10;
/// Size of register-file region 1.
pub const REGFILE_R1: usize = 1 << 20;

/// A trivial device: two trapped regions backed by byte vectors, no interrupts.
#[derive(Debug)]
pub struct RegFile {
    desc: DeviceDescription,
    r0: Vec<u8>,
    r1: Vec<u8>,
}

impl RegFile {
    /// A zeroed register file.
    pub fn new() -> RegFile {
        let mut regions: Vec<RegionDesc> =
            (0..NUM_PCI_REGIONS).map(|_| RegionDesc::absent()).collect();
        if let Some(r) = regions.get_mut(0) {
            *r = RegionDesc::trapped(REGFILE_R0 as u64);
        }
        if let Some(r) = regions.get_mut(1) {
            *r = RegionDesc::trapped(REGFILE_R1 as u64);
        }
        let none = IrqDesc {
            count: 0,
            eventfd: false,
            maskable: false,
            automasked: false,
            noresize: true,
        };
        RegFile {
            desc: DeviceDescription {
                name: "regfile",
                regions,
                irqs: vec![none; 5],
                resettable: false,
            },
            r0: vec![0; REGFILE_R0],
            r1: vec![0; REGFILE_R1],
        }
    }

    fn bytes(&mut self, region: u32, offset: u64, len: usize) -> Option<&mut [u8]> {
        let mem = match region {
            0 => &mut self.r0,
            1 => &mut self.r1,
            _ => return None,
        };
        let start = usize::try_from(offset).ok()?;
        mem.get_mut(start..start.checked_add(len)?)
    }
}

impl PciDevice for RegFile {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        let len = data.len();
        let src = self
            .bytes(region, offset, len)
            .ok_or_else(|| DeviceError::OutOfRange {
                region,
                offset,
                len,
            })?;
        data.copy_from_slice(src);
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        let len = data.len();
        let dst = self
            .bytes(region, offset, len)
            .ok_or_else(|| DeviceError::OutOfRange {
                region,
                offset,
                len,
            })?;
        dst.copy_from_slice(data);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        self.r0.fill(0);
        self.r1.fill(0);
        Ok(())
    }
}

/// The same register file behind the `vfio_user` crate's backend trait.
#[derive(Debug)]
pub struct PeerRegFile(RegFile);

fn io_inval() -> std::io::Error {
    std::io::Error::from_raw_os_error(libc::EINVAL)
}

impl vfio_user::ServerBackend for PeerRegFile {
    fn region_read(&mut self, region: u32, offset: u64, data: &mut [u8]) -> std::io::Result<()> {
        let len = data.len();
        let src = self.0.bytes(region, offset, len).ok_or_else(io_inval)?;
        data.copy_from_slice(src);
        Ok(())
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> std::io::Result<()> {
        let len = data.len();
        let dst = self.0.bytes(region, offset, len).ok_or_else(io_inval)?;
        dst.copy_from_slice(data);
        Ok(())
    }

    fn dma_map(
        &mut self,
        _flags: vfio_user::DmaMapFlags,
        _offset: u64,
        _address: u64,
        _size: u64,
        _fd: Option<File>,
    ) -> std::io::Result<()> {
        Ok(())
    }

    fn dma_unmap(
        &mut self,
        _flags: vfio_user::DmaUnmapFlags,
        _address: u64,
        _size: u64,
    ) -> std::io::Result<()> {
        Ok(())
    }

    fn reset(&mut self) -> std::io::Result<()> {
        self.0.reset().map_err(|_| io_inval())
    }

    fn set_irqs(
        &mut self,
        _index: u32,
        _flags: u32,
        _start: u32,
        _count: u32,
        _fds: Vec<File>,
    ) -> std::io::Result<()> {
        Err(io_inval())
    }
}

/// Which device a Switchyard server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceKind {
    /// The softgpu (64 MiB VRAM, 2 queues, MSI-X), as `switchyard serve --device softgpu`.
    SoftGpu,
    /// [`RegFile`].
    RegFile,
    /// The softgpu of [`DeviceKind::SoftGpu`] with crash continuity on, as a pool worker
    /// (`switchyard worker`) serves it: a black box with the server's records (receive
    /// journal, tables, session, reply area) and the device's (its mirrored state), the device
    /// built with `SoftGpu::with_black_box`, and a real custody channel (a `SOCK_SEQPACKET`
    /// pair whose other end a keeper thread drains and keeps the descriptors of, as the
    /// supervisor does).
    SoftGpuJournal,
    /// [`DeviceKind::SoftGpuJournal`] with the per-client descriptor budget the pool daemon
    /// gives every worker by default (`ServerConfig::fd_budget` = [`BENCH_FD_BUDGET`]): the
    /// custody account is checked against it on every read that carries descriptors.
    SoftGpuJournalBudget,
}

/// The descriptor budget of [`DeviceKind::SoftGpuJournalBudget`]: the pool's default
/// `[daemon] fds_per_endpoint`.
pub const BENCH_FD_BUDGET: u32 = 1024;

impl DeviceKind {
    /// Short name for tables.
    pub fn name(self) -> &'static str {
        match self {
            DeviceKind::SoftGpu => "softgpu",
            DeviceKind::RegFile => "regfile",
            DeviceKind::SoftGpuJournal => "softgpu+journal",
            DeviceKind::SoftGpuJournalBudget => "softgpu+journal+budget",
        }
    }
}

/// The softgpu configuration of the benchmark servers: 64 MiB VRAM, 2 queues.
fn bench_gpu() -> SoftGpuConfig {
    SoftGpuConfig {
        vram_size: 64 << 20,
        queues: 2,
        ..SoftGpuConfig::default()
    }
}

/// The supervisor's side of a custody channel, on a thread: keeps every descriptor the server
/// puts into custody, closes the released ones, and ends when the server's end closes.
#[derive(Debug)]
struct Keeper {
    /// Descriptors received so far (a positive control: the connection goes into custody).
    received: Arc<AtomicUsize>,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Keeper {
    fn start(sock: OwnedFd) -> Result<Keeper> {
        let received = Arc::new(AtomicUsize::new(0));
        let r = received.clone();
        let thread = std::thread::Builder::new()
            .name("sy-custody".into())
            .spawn(move || {
                crate::pin::helper();
                keep(&sock, &r)
            })
            .context("spawn the custody keeper")?;
        Ok(Keeper {
            received,
            thread: Some(thread),
        })
    }

    fn join(&mut self) -> Result<()> {
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow!("custody keeper panicked"))
                .and_then(|r| r),
            None => Ok(()),
        }
    }
}

fn keep(sock: &OwnedFd, received: &AtomicUsize) -> Result<()> {
    let mut held: BTreeMap<u64, OwnedFd> = BTreeMap::new();
    let mut objects: BTreeMap<String, OwnedFd> = BTreeMap::new();
    let mut buf = Vec::new();
    loop {
        match custody::recv(sock, &mut buf) {
            Ok((Note::Hold { ids }, fds)) => {
                received.fetch_add(fds.len(), Ordering::Relaxed);
                held.extend(ids.into_iter().zip(fds));
            }
            Ok((Note::HoldObjects { names }, fds)) => {
                received.fetch_add(fds.len(), Ordering::Relaxed);
                objects.extend(names.into_iter().zip(fds));
            }
            Ok((Note::Release { ids }, _)) => {
                for id in ids {
                    held.remove(&id);
                }
            }
            Ok((Note::ReleaseObjects { names }, _)) => {
                for name in names {
                    objects.remove(&name);
                }
            }
            Ok((other, _)) => bail!("unexpected custody note {other:?}"),
            Err(custody::ChannelError::Closed) => return Ok(()),
            Err(e) => return Err(e).context("custody channel"),
        }
    }
}

/// A softgpu server with crash continuity, built as `switchyard worker` builds a fresh one
/// (`switchyard_daemon::worker`): black box and VRAM into custody, then the continuity (which
/// takes `config.fd_budget` as the client's custody budget).
fn journaled_softgpu(
    config: ServerConfig,
    gpu: SoftGpuConfig,
) -> Result<(Server, Keeper, Arc<Continuity>)> {
    let mut records = Continuity::records(&config.limits);
    records.extend(SoftGpu::black_box_records(&gpu));
    let bb = BlackBox::create(&records).context("create the black box")?;
    let (ours, keepers) = custody::pair().context("custody channel")?;
    let keeper = Keeper::start(keepers)?;
    custody::send(
        &ours,
        &Note::Hold {
            ids: vec![BLACK_BOX_ID],
        },
        &[bb.file().as_fd()],
    )
    .context("black box into custody")?;
    let continuity = Continuity::new(
        &bb,
        Box::new(ChannelCustody::new(
            ours.try_clone().context("dup the custody channel")?,
        )),
    )
    .context("crash continuity")?;
    let bb2 = bb.clone();
    let mut server = Server::new(config, |ctx| SoftGpu::with_black_box(gpu, ctx, &bb2, None))
        .context("start the journaled softgpu server")?;
    let vram = server
        .device_slot()
        .with_as::<SoftGpu, _>(|g| g.vram_file().try_clone())
        .context("the device is not a softgpu")?
        .context("dup the VRAM fd")?;
    custody::send(
        &ours,
        &Note::HoldObjects {
            names: vec!["softgpu.vram".into()],
        },
        &[vram.as_fd()],
    )
    .context("VRAM into custody")?;
    let continuity = Arc::new(continuity);
    server.set_continuity(continuity.clone());
    Ok((server, keeper, continuity))
}

/// A Switchyard server running [`Server::run`] on a thread.
#[derive(Debug)]
pub struct Switchyard {
    path: PathBuf,
    stop: StopHandle,
    thread: Option<JoinHandle<Result<()>>>,
    /// The custody keeper of a [`DeviceKind::SoftGpuJournal`] server.
    keeper: Option<Keeper>,
    /// The crash continuity of a [`DeviceKind::SoftGpuJournal`] server (its custody account).
    continuity: Option<Arc<Continuity>>,
}

impl Switchyard {
    /// Binds `dir/name.sock` and starts serving `kind` with the given adaptive-polling budget.
    pub fn start(dir: &Path, name: &str, kind: DeviceKind, spin: Duration) -> Result<Switchyard> {
        let path = dir.join(format!("{name}.sock"));
        let mut config = ServerConfig::new(&path);
        config.poll_spin = spin;
        match kind {
            DeviceKind::SoftGpu => {
                let gpu = bench_gpu();
                let server = Server::new(config, |ctx| SoftGpu::new(gpu, ctx))
                    .context("start the softgpu server")?;
                spawn(name, server)
            }
            DeviceKind::SoftGpuJournal | DeviceKind::SoftGpuJournalBudget => {
                if kind == DeviceKind::SoftGpuJournalBudget {
                    config.fd_budget = Some(BENCH_FD_BUDGET);
                }
                let (server, keeper, continuity) = journaled_softgpu(config, bench_gpu())?;
                let mut sy = spawn(name, server)?;
                sy.keeper = Some(keeper);
                sy.continuity = Some(continuity);
                Ok(sy)
            }
            DeviceKind::RegFile => {
                let server = Server::new(config, |_ctx| Ok::<_, std::io::Error>(RegFile::new()))
                    .context("start the regfile server")?;
                spawn(name, server)
            }
        }
    }

    /// Starts a blocking softgpu server of the given configuration and returns it with its
    /// device slot (to swap the device under the connected client, or to look at it).
    pub fn start_softgpu(
        dir: &Path,
        name: &str,
        gpu: SoftGpuConfig,
    ) -> Result<(Switchyard, DeviceSlot)> {
        let path = dir.join(format!("{name}.sock"));
        let server = Server::new(ServerConfig::new(&path), |ctx| SoftGpu::new(gpu, ctx))
            .context("start the softgpu server")?;
        let slot = server.device_slot();
        Ok((spawn(name, server)?, slot))
    }

    /// Starts a blocking [`RegFile`] server and returns it with its DMA space, so that a case
    /// can make device writes (mark pages dirty) without moving guest memory.
    pub fn start_regfile_with_dma(dir: &Path, name: &str) -> Result<(Switchyard, Arc<DmaSpace>)> {
        let path = dir.join(format!("{name}.sock"));
        let mut dma = None;
        let server = Server::new(ServerConfig::new(&path), |ctx| {
            dma = Some(Arc::clone(&ctx.dma));
            Ok::<_, std::io::Error>(RegFile::new())
        })
        .context("start the regfile server")?;
        let dma = dma.context("the server built no device")?;
        Ok((spawn(name, server)?, dma))
    }

    /// Connects our client (VERSION negotiated) with [`vmm_client_config`]`(timeout)`.
    pub fn connect(&self, timeout: Option<Duration>) -> Result<Client> {
        Client::connect_with(&self.path, vmm_client_config(timeout))
            .with_context(|| format!("connect {}", self.path.display()))
    }

    /// Descriptors the server has put into custody so far (0 without crash continuity).
    pub fn custody_received(&self) -> usize {
        self.keeper
            .as_ref()
            .map_or(0, |k| k.received.load(Ordering::Relaxed))
    }

    /// The server's custody account: (the client's descriptors in custody, reads refused by
    /// the budget); `None` without crash continuity.
    pub fn custody_account(&self) -> Option<(usize, u64)> {
        self.continuity.as_ref().map(|c| c.held_count())
    }

    /// The client's descriptor budget of the server's crash continuity, if any.
    pub fn custody_budget(&self) -> Option<usize> {
        self.continuity.as_ref().and_then(|c| c.budget())
    }

    /// Stops the server and reports how its thread ended.
    pub fn shutdown(mut self) -> Result<()> {
        self.stop_and_join()
    }

    fn stop_and_join(&mut self) -> Result<()> {
        self.stop.stop();
        let server = match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow!("server thread panicked"))
                .and_then(|r| r),
            None => Ok(()),
        };
        // The server (and with it the custody channel) is gone once our handle on its
        // continuity is too: the keeper sees the channel close.
        self.continuity = None;
        let keeper = self.keeper.as_mut().map_or(Ok(()), Keeper::join);
        server.and(keeper)
    }
}

impl Drop for Switchyard {
    fn drop(&mut self) {
        let _ = self.stop_and_join();
    }
}

/// Runs `server` on a (pinned) thread of its own.
fn spawn(name: &str, mut server: Server) -> Result<Switchyard> {
    let stop = server.stop_handle();
    let path = server.socket_path().to_owned();
    let thread = std::thread::Builder::new()
        .name(format!("sy-{name}"))
        .spawn(move || {
            crate::pin::helper();
            server.run().context("server run")
        })
        .context("spawn server thread")?;
    Ok(Switchyard {
        path,
        stop,
        thread: Some(thread),
        keeper: None,
        continuity: None,
    })
}

/// The `vfio_user` crate's server with [`PeerRegFile`]; serves exactly one connection (its
/// `run` accepts once).
#[derive(Debug)]
pub struct Peer {
    path: PathBuf,
    thread: Option<JoinHandle<Result<()>>>,
}

impl Peer {
    /// Binds `dir/name.sock` and waits for the one client on a thread.
    pub fn start(dir: &Path, name: &str) -> Result<Peer> {
        use vfio_bindings::bindings::vfio::{
            VFIO_REGION_INFO_FLAG_READ, VFIO_REGION_INFO_FLAG_WRITE, vfio_region_info,
        };
        let path = dir.join(format!("{name}.sock"));
        let region = |index: u32, size: usize| vfio_user::ServerRegion {
            region_info: vfio_region_info {
                argsz: std::mem::size_of::<vfio_region_info>() as u32,
                flags: VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_WRITE,
                index,
                cap_offset: 0,
                size: size as u64,
                offset: 0,
            },
            sparse_areas: Vec::new(),
            mmap_fd: None,
        };
        let regions = vec![region(0, REGFILE_R0), region(1, REGFILE_R1)];
        let server = vfio_user::Server::new(&path, false, Vec::new(), regions)
            .map_err(|e| anyhow!("vfio_user server: {e}"))?;
        let thread = std::thread::Builder::new()
            .name(format!("peer-{name}"))
            .spawn(move || {
                crate::pin::helper();
                let mut backend = PeerRegFile(RegFile::new());
                server
                    .run(&mut backend)
                    .map_err(|e| anyhow!("vfio_user server run: {e}"))
            })
            .context("spawn peer thread")?;
        Ok(Peer {
            path,
            thread: Some(thread),
        })
    }

    /// Connects our client (same configuration as for Switchyard).
    pub fn connect(&self, timeout: Option<Duration>) -> Result<Client> {
        Client::connect_with(&self.path, vmm_client_config(timeout))
            .with_context(|| format!("connect {}", self.path.display()))
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            if !t.is_finished() {
                // Still waiting in accept (never connected) or serving a client that is
                // gone: a connection that closes at once lets `run` return.
                let _ = UnixStream::connect(&self.path);
            }
            let _ = t.join();
        }
    }
}

/// The client configuration every measured client uses: the defaults with `timeout` as the
/// socket timeouts. Full runs pass `None`, like a VMM (QEMU sets none; a kernel timer armed on
/// every blocking read costs ~0.5-1 µs here); `--quick` passes 30 s so that a stalled server
/// fails CI instead of hanging it.
pub fn vmm_client_config(timeout: Option<Duration>) -> switchyard_client::ClientConfig {
    switchyard_client::ClientConfig {
        timeout,
        ..Default::default()
    }
}
