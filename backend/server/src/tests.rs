//! Tests of the whole server on its socket: what a device is told when its client leaves,
//! whichever way the client leaves.
//!
//! The contract ([`PciDevice::client_disconnected`]): one call per departure, made once the
//! server has dropped the client's DMA windows and interrupt eventfds. A device that can be
//! parked ([`Quiesce`]) is parked while they go, so its own activity never runs into a window
//! that went away before it was told.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use switchyard_device::{
    DeviceContext, DeviceDescription, DeviceError, DmaObserver, DmaProt, IrqDesc, IrqIndex,
    PciDevice, Quiesce, QuiesceGuard, RegionDesc, SuccessorFactory, Swappable,
};
use switchyard_proto::consts::*;
use switchyard_proto::{
    Capabilities, DmaMap, Header, IrqAction, IrqData, Request, SetIrqs, encode_version_request,
};

use crate::continuity::{FIRST_MESSAGE_ID, Resumed, WindowRecord};
use crate::{Server, ServerConfig};

/// Where the client's window is.
const IOVA: u64 = 0x10_0000;
/// Its size.
const SIZE: u64 = 0x2000;
/// MSI-X vectors of the device.
const MSIX: u32 = 2;

/// What the device was told, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Event {
    /// Its observer was told a window is being mapped.
    Mapping(u64, u64),
    /// Its observer was told a window is gone.
    Unmapped(u64, u64),
    /// `irqs_changed(index)`.
    IrqsChanged(u32),
    /// Parked through its [`Quiesce`].
    Parked,
    /// That park ended.
    Unparked,
    /// `fresh_open`: a new client (not a resumed one) is about to be served.
    FreshOpen,
    /// `client_disconnected`, with what the device still found then: DMA windows, and
    /// vectors with an eventfd.
    Disconnected { windows: usize, eventfds: usize },
}

type Log = Arc<Mutex<Vec<Event>>>;

fn record(log: &Log, e: Event) {
    log.lock().unwrap_or_else(|p| p.into_inner()).push(e);
}

fn events(log: &Log) -> Vec<Event> {
    log.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// A device that records every callback; at `client_disconnected` it looks at the DMA space
/// and interrupt table it was lent.
struct Recorder {
    desc: DeviceDescription,
    ctx: DeviceContext,
    log: Log,
}

impl Recorder {
    fn new(ctx: DeviceContext, log: &Log) -> Self {
        let mut regions = vec![RegionDesc::absent(); 9];
        regions[0] = RegionDesc::trapped(0x1000);
        let irq = |count| IrqDesc {
            count,
            eventfd: true,
            maskable: true,
            automasked: false,
            noresize: false,
        };
        Self {
            desc: DeviceDescription {
                name: "recorder",
                regions,
                irqs: vec![irq(1), irq(0), irq(MSIX), irq(0), irq(0)],
                resettable: true,
            },
            ctx,
            log: log.clone(),
        }
    }
}

impl PciDevice for Recorder {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }
    fn region_read(&mut self, _: u32, _: u64, data: &mut [u8]) -> switchyard_device::Result<()> {
        data.fill(0);
        Ok(())
    }
    fn region_write(&mut self, _: u32, _: u64, _: &[u8]) -> switchyard_device::Result<()> {
        Ok(())
    }
    fn reset(&mut self) -> switchyard_device::Result<()> {
        Ok(())
    }
    fn fresh_open(&mut self) -> switchyard_device::Result<()> {
        record(&self.log, Event::FreshOpen);
        Ok(())
    }
    fn irqs_changed(&mut self, index: u32) {
        record(&self.log, Event::IrqsChanged(index));
    }
    fn client_disconnected(&mut self) {
        let windows = self.ctx.dma.mappings().len();
        let eventfds = std::iter::once((IrqIndex::Intx, 0))
            .chain((0..MSIX).map(|v| (IrqIndex::Msix, v)))
            .filter(|&(index, v)| self.ctx.irqs.has_trigger(index, v))
            .count();
        record(&self.log, Event::Disconnected { windows, eventfds });
    }
    fn dma_observer(&self) -> Option<Arc<dyn DmaObserver>> {
        Some(Arc::new(Observer(self.log.clone())))
    }
    fn swappable(&mut self) -> Option<&mut dyn Swappable> {
        Some(self)
    }
}

struct Observer(Log);

impl DmaObserver for Observer {
    fn mapping(
        &self,
        iova: u64,
        size: u64,
        _: DmaProt,
        _: Option<(&std::fs::File, u64)>,
    ) -> Result<(), DeviceError> {
        record(&self.0, Event::Mapping(iova, size));
        Ok(())
    }
    fn unmapped(&self, iova: u64, size: u64) {
        record(&self.0, Event::Unmapped(iova, size));
    }
}

struct Park(Log);

/// Records the end of a park when dropped.
struct Unpark(Log);

impl Drop for Unpark {
    fn drop(&mut self) {
        record(&self.0, Event::Unparked);
    }
}

impl Quiesce for Park {
    fn park(&self) -> QuiesceGuard {
        record(&self.0, Event::Parked);
        QuiesceGuard::new(Unpark(self.0.clone()))
    }
}

impl Swappable for Recorder {
    fn quiesce(&self) -> Arc<dyn Quiesce> {
        Arc::new(Park(self.log.clone()))
    }
    fn successor(&self) -> SuccessorFactory {
        Box::new(|_| Err(DeviceError::Unsupported))
    }
    fn check_successor(&self, _: &dyn PciDevice) -> Result<(), &'static str> {
        Err("no swaps in these tests")
    }
    fn hand_over(&mut self, _: &mut dyn PciDevice) -> switchyard_device::Result<()> {
        Err(DeviceError::Unsupported)
    }
}

/// A server on a recorder, in a temporary directory; `restore` runs on the context before the
/// device is built on it (a replacement's `Server::restore_tables`).
fn server(dir: &tempfile::TempDir, log: &Log, restore: impl FnOnce(&DeviceContext)) -> Server {
    let config = ServerConfig::new(dir.path().join("dev.sock"));
    Server::new(config, |ctx| {
        restore(&ctx);
        Ok::<_, DeviceError>(Recorder::new(ctx, log))
    })
    .expect("server")
}

/// Waits until the device has been told of `n` departures.
fn wait_for_departures(log: &Log, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let count = || {
        events(log)
            .iter()
            .filter(|e| matches!(e, Event::Disconnected { .. }))
            .count()
    };
    while count() < n {
        assert!(
            Instant::now() < deadline,
            "{n} departures: {:?}",
            events(log)
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The client's end: requests encoded with `switchyard-proto`, replies read whole.
struct Peer {
    s: UnixStream,
    id: u16,
}

impl Peer {
    fn call(&mut self, msg: &[u8], fds: &[BorrowedFd<'_>]) -> Header {
        switchyard_endpoint::send_all(&self.s, msg, fds).expect("send");
        let mut h = [0u8; HEADER_SIZE];
        self.s.read_exact(&mut h).expect("reply header");
        let h = Header::from_bytes(&h).expect("header");
        let mut body = vec![0u8; h.msg_size as usize - HEADER_SIZE];
        self.s.read_exact(&mut body).expect("reply body");
        assert!(h.is_reply() && !h.is_error(), "{h:?}");
        h
    }

    fn request(&mut self, req: Request<'_>, fds: &[BorrowedFd<'_>]) {
        let mut buf = Vec::new();
        self.id += 1;
        req.encode(self.id, false, &mut buf).expect("encode");
        self.call(&buf, fds);
    }

    /// VERSION, a DMA window backed by a memfd, an eventfd on MSI-X vector 0.
    fn set_up(s: UnixStream) -> Self {
        let mut p = Self { s, id: 0 };
        p.call(&version_request(), &[]);
        let memory = memfd::MemfdOptions::default()
            .create("guest")
            .expect("memfd")
            .into_file();
        memory.set_len(SIZE).expect("size");
        let map = DmaMap {
            argsz: 32,
            flags: VFIO_USER_F_DMA_REGION_READ
                | VFIO_USER_F_DMA_REGION_WRITE
                | VFIO_USER_F_DMA_REGION_MMAP,
            offset: 0,
            address: IOVA,
            size: SIZE,
        };
        p.request(Request::DmaMap(map), &[memory.as_fd()]);
        let efd = switchyard_device::irq::new_eventfd().expect("eventfd");
        let set = SetIrqs {
            argsz: 20,
            action: IrqAction::Trigger,
            data: IrqData::Eventfd,
            index: VFIO_PCI_MSIX_IRQ_INDEX,
            start: 0,
            count: 1,
        };
        p.request(Request::DeviceSetIrqs(set), &[efd.as_fd()]);
        p
    }
}

fn version_request() -> Vec<u8> {
    let mut buf = Vec::new();
    encode_version_request(&mut buf, 0, VFIO_USER_MINOR, &Capabilities::default()).expect("encode");
    buf
}

/// What the device is told while a new client sets up: it is fresh for it (before anything
/// is served), its window is mapped, its vector changed.
fn set_up_events() -> Vec<Event> {
    vec![
        Event::FreshOpen,
        Event::Mapping(IOVA, SIZE),
        Event::IrqsChanged(VFIO_PCI_MSIX_IRQ_INDEX),
    ]
}

/// What the device is told when a client with one window leaves: parked, the window goes,
/// told of the departure (with nothing left), unparked.
fn departure_events() -> Vec<Event> {
    vec![
        Event::Parked,
        Event::Unmapped(IOVA, SIZE),
        Event::Disconnected {
            windows: 0,
            eventfds: 0,
        },
        Event::Unparked,
    ]
}

/// Runs the server until `clients` has run its clients and the device has been told of
/// `departures` departures, then stops it.
fn serve(mut server: Server, log: &Log, departures: usize, clients: impl FnOnce(&std::path::Path)) {
    let stop = server.stop_handle();
    let path = server.socket_path().to_owned();
    let t = std::thread::spawn(move || server.run());
    clients(&path);
    wait_for_departures(log, departures);
    stop.stop();
    t.join().expect("server thread").expect("run");
}

#[test]
fn a_client_that_hangs_up_is_reported_once_after_its_windows_and_eventfds_are_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = Log::default();
    let server = server(&dir, &log, |_| {});
    serve(server, &log, 1, |path| {
        let p = Peer::set_up(UnixStream::connect(path).expect("connect"));
        drop(p);
    });
    let expected: Vec<Event> = [set_up_events(), departure_events()].concat();
    assert_eq!(events(&log), expected);
}

#[test]
fn a_client_that_breaks_the_framing_is_reported_once_after_its_windows_and_eventfds_are_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = Log::default();
    let server = server(&dir, &log, |_| {});
    serve(server, &log, 2, |path| {
        // Two clients one after the other: one per departure, each after the teardown.
        let p = Peer::set_up(UnixStream::connect(path).expect("connect"));
        drop(p);
        wait_for_departures(&log, 1);
        let mut p = Peer::set_up(UnixStream::connect(path).expect("connect"));
        // A header announcing a message larger than any the server takes: the stream cannot
        // be framed any more and the server closes it (after an error reply).
        let mut bad = version_request();
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        switchyard_endpoint::send_all(&p.s, &bad[..HEADER_SIZE], &[]).expect("send");
        let mut rest = Vec::new();
        let _ = p.s.read_to_end(&mut rest);
    });
    let one: Vec<Event> = [set_up_events(), departure_events()].concat();
    assert_eq!(events(&log), [one.clone(), one].concat());
}

/// Tables a replaced process had: the window and MSI-X vector 0 of [`Peer::set_up`], with
/// custody ids, and the negotiated VERSION.
fn resumed_tables() -> (Resumed, BTreeMap<u64, OwnedFd>) {
    let memory = memfd::MemfdOptions::default()
        .create("guest")
        .expect("memfd")
        .into_file();
    memory.set_len(SIZE).expect("size");
    let efd = switchyard_device::irq::new_eventfd().expect("eventfd");
    let (memory_id, efd_id) = (FIRST_MESSAGE_ID, FIRST_MESSAGE_ID + 1);
    let v = version_request();
    let body = &v[HEADER_SIZE..];
    let resumed = Resumed {
        version: Some((
            u16::from_le_bytes([body[0], body[1]]),
            u16::from_le_bytes([body[2], body[3]]),
            body[4..].to_vec(),
        )),
        windows: vec![WindowRecord {
            iova: IOVA,
            size: SIZE,
            offset: 0,
            read: true,
            write: true,
            fd: Some(memory_id),
        }],
        vectors: [((VFIO_PCI_MSIX_IRQ_INDEX, 0), efd_id)].into(),
        referenced: vec![memory_id, efd_id],
        next_id: efd_id + 1,
        ..Resumed::default()
    };
    let fds = [(memory_id, memory.into()), (efd_id, efd.into())].into();
    (resumed, fds)
}

/// A replacement's server with the tables of [`resumed_tables`] restored.
fn resumed_server(dir: &tempfile::TempDir, log: &Log) -> (Server, Resumed, BTreeMap<u64, OwnedFd>) {
    let (resumed, fds) = resumed_tables();
    let server = server(dir, log, |ctx| {
        let lost = Server::restore_tables(ctx, &resumed, |id| {
            fds.get(&id).and_then(|f| f.try_clone().ok())
        });
        assert_eq!(lost, crate::Unrestored::default());
    });
    (server, resumed, fds)
}

#[test]
fn a_resumed_connection_that_ends_is_reported_once_after_its_windows_and_eventfds_are_gone() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = Log::default();
    let (mut server, resumed, fds) = resumed_server(&dir, &log);
    let stop = server.stop_handle();
    let (client, ours) = UnixStream::pair().expect("socket pair");
    let t = std::thread::spawn(move || server.run_resumed(ours, &resumed, fds));
    // The client still has the session: it goes on, then leaves.
    let mut p = Peer { s: client, id: 100 };
    p.request(
        Request::RegionRead {
            offset: 0,
            region: 0,
            count: 4,
        },
        &[],
    );
    drop(p);
    wait_for_departures(&log, 1);
    stop.stop();
    t.join().expect("server thread").expect("run_resumed");
    // Restored before the device was built on them, the tables were never announced to it;
    // a resumed client is not a new one (`fresh_open` never came).
    assert_eq!(events(&log), departure_events());
}

#[test]
fn a_client_that_left_while_no_process_served_it_is_reported_once_after_the_teardown() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = Log::default();
    let (mut server, _, fds) = resumed_server(&dir, &log);
    let stop = server.stop_handle();
    let t = std::thread::spawn(move || server.run_resumed_without_client(fds));
    wait_for_departures(&log, 1);
    stop.stop();
    t.join()
        .expect("server thread")
        .expect("run_resumed_without_client");
    assert_eq!(events(&log), departure_events());
}

/// The device goes with its server: the migration watchdog's handle on the slot is gone when
/// the drop returns, not whenever its thread next runs.
#[test]
fn a_dropped_server_drops_its_device() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = Log::default();
    let server = server(&dir, &log, |_| {});
    assert!(Arc::strong_count(&log) > 1, "the device holds the log");
    drop(server);
    assert_eq!(Arc::strong_count(&log), 1, "the device outlived its server");
}
