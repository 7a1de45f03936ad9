//! Loopback tests of the [`Dispatcher`]: requests encoded with `switchyard-proto` go straight
//! into the dispatcher (no socket, no process) and its replies are decoded back.

use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;

use switchyard_device::IrqIndex;
use switchyard_proto::consts::*;
use switchyard_proto::{
    Capabilities, Command, DeviceFeatureHeader, DeviceFeatureRequest, DmaMap, FeatureReply,
    FeatureRequest, IrqAction, IrqData, Reply, Request, ServerLimits, SetIrqs, decode_reply,
    encode_version_request,
};

use super::*;
use crate::test_utils::{MOCK_BAR0, MOCK_MSIX, MockDevice, slot_with};

/// A dispatcher on a mock device; `_peer` is the client's end of the socket its
/// [`ClientDma`] would send server→client requests on.
struct Loopback {
    d: Dispatcher,
    slot: DeviceSlot,
    next_id: u16,
    _peer: UnixStream,
}

/// What the dispatcher answered: the outcome, and the reply's header, body and fd count.
struct Answer {
    outcome: Outcome,
    header: Option<Header>,
    bytes: Vec<u8>,
    nfds: usize,
}

impl Answer {
    fn reply(&self) -> Reply<'_> {
        assert_eq!(self.outcome, Outcome::Reply, "expected a reply");
        let h = self.header.expect("reply header");
        decode_reply(&h, &self.bytes[HEADER_SIZE..], self.nfds).expect("decodable reply")
    }

    fn errno(&self) -> u32 {
        assert_eq!(self.outcome, Outcome::ErrorReply, "expected an error reply");
        let h = self.header.expect("reply header");
        assert!(h.is_reply() && h.is_error());
        assert_eq!(self.bytes.len(), HEADER_SIZE, "an error reply has no body");
        h.error_no
    }
}

impl Loopback {
    fn new() -> Self {
        let (ours, peer) = UnixStream::pair().expect("socket pair");
        let limits = ServerLimits {
            max_msg_fds: 16,
            ..ServerLimits::default()
        };
        let source = SocketClientDma {
            stream: Arc::new(ours),
            send_lock: Arc::new(Mutex::new(())),
            timeout: Duration::from_secs(1),
        };
        Self {
            d: Dispatcher::new(limits, Box::new(source)),
            slot: slot_with(Box::new(MockDevice::new()), 16),
            next_id: 1,
            _peer: peer,
        }
    }

    /// Feeds one encoded message (header + body) to the dispatcher.
    fn raw(&mut self, msg: &[u8], fds: Vec<OwnedFd>, fds_truncated: bool) -> Answer {
        let header = Header::from_bytes(&msg[..HEADER_SIZE]).expect("header");
        let outcome = self.d.handle(
            &self.slot,
            Message {
                header,
                body: &msg[HEADER_SIZE..],
                fds,
                fd_ids: Vec::new(),
                fds_truncated,
                fds_refused: None,
            },
        );
        let (bytes, out_fds) = self.d.reply();
        let answer = match outcome {
            Outcome::Reply | Outcome::ErrorReply => Answer {
                outcome,
                header: Some(Header::from_bytes(&bytes[..HEADER_SIZE]).expect("reply header")),
                bytes: bytes.to_vec(),
                nfds: out_fds.len(),
            },
            _ => Answer {
                outcome,
                header: None,
                bytes: Vec::new(),
                nfds: 0,
            },
        };
        if let Some(h) = answer.header {
            assert_eq!(h.msg_id, header.msg_id, "the reply answers the request");
            assert_eq!(h.cmd, header.cmd);
        }
        self.d.sent();
        answer
    }

    fn request(&mut self, req: Request<'_>, fds: Vec<OwnedFd>) -> Answer {
        let mut buf = Vec::new();
        self.next_id += 1;
        req.encode(self.next_id, false, &mut buf).expect("encode");
        self.raw(&buf, fds, false)
    }

    fn negotiate(&mut self) -> Answer {
        let mut buf = Vec::new();
        encode_version_request(&mut buf, 1, 0, &Capabilities::default()).expect("encode");
        self.raw(&buf, Vec::new(), false)
    }

    fn with_mock<R>(&self, f: impl FnOnce(&mut MockDevice) -> R) -> R {
        self.slot.with_as(f).expect("a mock device")
    }
}

fn region_read(region: u32, offset: u64, count: u32) -> Request<'static> {
    Request::RegionRead {
        offset,
        region,
        count,
    }
}

#[test]
fn version_is_negotiated_once_and_required_first() {
    let mut l = Loopback::new();
    assert_eq!(
        l.request(region_read(0, 0, 4), Vec::new()).errno(),
        libc::EINVAL as u32,
        "nothing before VERSION"
    );
    let a = l.negotiate();
    let Reply::Version(v) = a.reply() else {
        panic!("not a VERSION reply");
    };
    assert_eq!((v.major, v.minor), (VFIO_USER_MAJOR, VFIO_USER_MINOR));
    let json = v.json().expect("json").expect("capabilities");
    assert!(json.contains("max_msg_fds"), "{json}");
    assert!(
        l.d.client_dma.is_some(),
        "the client's DMA handle is created"
    );
    assert_eq!(l.negotiate().errno(), libc::EINVAL as u32, "only once");
}

#[test]
fn region_write_then_read_reach_the_device() {
    let mut l = Loopback::new();
    l.negotiate();
    let a = l.request(
        Request::RegionWrite {
            offset: 8,
            region: 0,
            data: &[1, 2, 3, 4],
        },
        Vec::new(),
    );
    assert_eq!(
        a.reply(),
        Reply::RegionWrite {
            offset: 8,
            region: 0,
            count: 4
        }
    );
    assert_eq!(l.with_mock(|m| m.bar0[8..12].to_vec()), [1, 2, 3, 4]);
    let a = l.request(region_read(0, 6, 8), Vec::new());
    assert_eq!(
        a.reply(),
        Reply::RegionRead {
            offset: 6,
            region: 0,
            data: &[0, 0, 1, 2, 3, 4, 0, 0]
        }
    );
    // Out of the region, and a region the device does not have: errnos, nothing changed.
    let a = l.request(region_read(0, MOCK_BAR0 - 2, 4), Vec::new());
    assert_eq!(a.errno(), libc::EINVAL as u32);
    let a = l.request(region_read(1, 0, 4), Vec::new());
    assert_eq!(a.errno(), libc::EINVAL as u32);
}

#[test]
fn a_posted_request_leaves_no_descriptor_for_the_next_reply() {
    let mut l = Loopback::new();
    l.negotiate();
    // GET_REGION_INFO of the mappable BAR2, posted: its reply (with the BAR's descriptor) is
    // never sent, and must not ride along with the next reply.
    let mut buf = Vec::new();
    Request::DeviceGetRegionInfo {
        argsz: 256,
        index: 2,
    }
    .encode(40, true, &mut buf)
    .expect("encode");
    let header = Header::from_bytes(&buf[..HEADER_SIZE]).expect("header");
    let outcome = l.d.handle(
        &l.slot,
        Message {
            header,
            body: &buf[HEADER_SIZE..],
            fds: Vec::new(),
            fd_ids: Vec::new(),
            fds_truncated: false,
            fds_refused: None,
        },
    );
    assert_eq!(outcome, Outcome::Nothing);
    assert!(
        l.d.reply().1.is_empty(),
        "the posted reply's descriptor was dropped"
    );
    // Positive control: asked for normally, the same request carries the descriptor.
    let a = l.request(
        Request::DeviceGetRegionInfo {
            argsz: 256,
            index: 2,
        },
        Vec::new(),
    );
    assert_eq!(a.nfds, 1);
}

#[test]
fn malformed_and_posted_requests() {
    let mut l = Loopback::new();
    l.negotiate();
    // A REGION_READ whose body is shorter than its fixed part.
    let h = Header::command(7, Command::RegionRead, false, 4).expect("header");
    let mut msg = zerocopy::IntoBytes::as_bytes(&h).to_vec();
    msg.extend_from_slice(&[0; 4]);
    assert_eq!(l.raw(&msg, Vec::new(), false).errno(), libc::EINVAL as u32);
    // The same request posted (no reply wanted): nothing to send.
    let h = Header::command(8, Command::RegionRead, true, 4).expect("header");
    let mut msg = zerocopy::IntoBytes::as_bytes(&h).to_vec();
    msg.extend_from_slice(&[0; 4]);
    assert_eq!(l.raw(&msg, Vec::new(), false).outcome, Outcome::Nothing);
    // Positive control: the connection keeps going.
    assert!(matches!(
        l.request(region_read(0, 0, 4), Vec::new()).reply(),
        Reply::RegionRead { .. }
    ));
}

#[test]
fn a_message_whose_descriptors_were_truncated_is_refused() {
    let mut l = Loopback::new();
    l.negotiate();
    let mut buf = Vec::new();
    region_read(0, 0, 4)
        .encode(3, false, &mut buf)
        .expect("encode");
    assert_eq!(
        l.raw(&buf, Vec::new(), true).errno(),
        libc::EMFILE as u32,
        "refused even though the request itself is fine"
    );
    assert!(matches!(
        l.raw(&buf, Vec::new(), false).reply(),
        Reply::RegionRead { .. }
    ));
}

#[test]
fn dma_map_of_a_memfd_is_readable_by_the_device() {
    let mut l = Loopback::new();
    l.negotiate();
    let mut f = memfd::MemfdOptions::default()
        .create("guest-ram")
        .expect("memfd")
        .into_file();
    f.set_len(0x2000).expect("size");
    f.write_all(b"guest data").expect("write");
    let map = DmaMap {
        argsz: 32,
        flags: VFIO_USER_F_DMA_REGION_READ
            | VFIO_USER_F_DMA_REGION_WRITE
            | VFIO_USER_F_DMA_REGION_MMAP,
        offset: 0,
        address: 0x10_0000,
        size: 0x2000,
    };
    let a = l.request(Request::DmaMap(map), vec![OwnedFd::from(f)]);
    assert_eq!(a.reply(), Reply::DmaMap);
    let mut got = [0u8; 10];
    l.slot
        .context()
        .dma
        .read(0x10_0000, &mut got)
        .expect("mapped");
    assert_eq!(&got, b"guest data");
    // mmap mode without a descriptor is refused.
    let a = l.request(
        Request::DmaMap(DmaMap {
            address: 0x20_0000,
            ..map
        }),
        Vec::new(),
    );
    assert_eq!(a.errno(), libc::EINVAL as u32);
    assert_eq!(l.slot.context().dma.mappings().len(), 1);
}

#[test]
fn set_irqs_takes_eventfds_only() {
    let mut l = Loopback::new();
    l.negotiate();
    let set = |count| SetIrqs {
        argsz: 20,
        action: IrqAction::Trigger,
        data: IrqData::Eventfd,
        index: VFIO_PCI_MSIX_IRQ_INDEX,
        start: 0,
        count,
    };
    // A file that is not an eventfd is refused before anything changes.
    let not_eventfd = memfd::MemfdOptions::default()
        .create("x")
        .expect("memfd")
        .into_file();
    let a = l.request(
        Request::DeviceSetIrqs(set(1)),
        vec![OwnedFd::from(not_eventfd)],
    );
    assert_eq!(a.errno(), libc::EINVAL as u32);
    assert!(l.with_mock(|m| m.irqs_changed.is_empty()));
    let irqs = l.slot.context().irqs.clone();
    assert!(!irqs.has_trigger(IrqIndex::Msix, 0));
    let efd = switchyard_device::irq::new_eventfd().expect("eventfd");
    let a = l.request(Request::DeviceSetIrqs(set(1)), vec![OwnedFd::from(efd)]);
    assert_eq!(a.reply(), Reply::DeviceSetIrqs);
    assert!(irqs.has_trigger(IrqIndex::Msix, 0));
    assert!(!irqs.has_trigger(IrqIndex::Msix, 1));
    assert_eq!(
        l.with_mock(|m| m.irqs_changed.clone()),
        [VFIO_PCI_MSIX_IRQ_INDEX]
    );
    // Vectors beyond the device's.
    let a = l.request(
        Request::DeviceSetIrqs(SetIrqs {
            start: MOCK_MSIX,
            ..set(1)
        }),
        vec![OwnedFd::from(
            switchyard_device::irq::new_eventfd().expect("eventfd"),
        )],
    );
    assert_eq!(a.errno(), libc::EINVAL as u32);
}

#[test]
fn device_feature_probes() {
    let mut l = Loopback::new();
    l.negotiate();
    let probe = |feature, get, set| {
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: DeviceFeatureHeader::SIZE as u32,
            op: FeatureRequest::Probe { feature, get, set },
        })
    };
    let a = l.request(
        probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_START, false, true),
        Vec::new(),
    );
    let Reply::DeviceFeature(f) = a.reply() else {
        panic!("not a DEVICE_FEATURE reply");
    };
    assert_eq!(
        f.op,
        FeatureReply::Probe {
            feature: VFIO_DEVICE_FEATURE_DMA_LOGGING_START,
            get: false,
            set: true
        }
    );
    // GET of a SET-only feature.
    let a = l.request(
        probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_START, true, false),
        Vec::new(),
    );
    assert_eq!(a.errno(), libc::EINVAL as u32);
    // The mock does not migrate: MIGRATION is not supported, as the kernel says it.
    let a = l.request(
        probe(VFIO_DEVICE_FEATURE_MIGRATION, true, false),
        Vec::new(),
    );
    assert_eq!(a.errno(), libc::ENOTTY as u32);
}

#[test]
fn an_unframeable_header_closes_with_an_error_reply() {
    let mut l = Loopback::new();
    let h = Header::command(5, Command::RegionWrite, false, 0).expect("header");
    let e = switchyard_proto::ProtoError::MessageTooLarge { size: usize::MAX };
    let outcome = l.d.unframeable(Some(h), &e);
    assert_eq!(outcome, Outcome::Close { reply: true });
    let (bytes, _) = l.d.reply();
    let rh = Header::from_bytes(&bytes[..HEADER_SIZE]).expect("header");
    assert!(rh.is_error() && rh.msg_id == 5);
    assert_eq!(rh.error_no, e.errno() as u32);
    l.d.sent();
    assert_eq!(l.d.unframeable(None, &e), Outcome::Close { reply: false });
}

#[test]
fn a_reply_from_the_client_is_routed_not_answered() {
    let mut l = Loopback::new();
    l.negotiate();
    // A reply to a server→client request nobody made: dropped, nothing sent.
    let mut buf = Vec::new();
    Reply::DmaWrite {
        address: 0,
        count: 0,
    }
    .encode(0x8001, &mut buf)
    .expect("encode");
    assert_eq!(l.raw(&buf, Vec::new(), false).outcome, Outcome::Nothing);
    assert!(matches!(
        l.request(region_read(0, 0, 4), Vec::new()).reply(),
        Reply::RegionRead { .. }
    ));
}

/// A mock device that migrates and knows its sizes.
struct Sizing {
    inner: MockDevice,
}

impl switchyard_device::PciDevice for Sizing {
    fn description(&self) -> &switchyard_device::DeviceDescription {
        self.inner.description()
    }
    fn region_read(&mut self, r: u32, o: u64, d: &mut [u8]) -> switchyard_device::Result<()> {
        self.inner.region_read(r, o, d)
    }
    fn region_write(&mut self, r: u32, o: u64, d: &[u8]) -> switchyard_device::Result<()> {
        self.inner.region_write(r, o, d)
    }
    fn reset(&mut self) -> switchyard_device::Result<()> {
        self.inner.reset()
    }
    fn migration(&mut self) -> Option<&mut dyn switchyard_device::Migratable> {
        Some(self)
    }
}

impl switchyard_device::Migratable for Sizing {
    fn caps(&self) -> switchyard_device::MigrationCaps {
        switchyard_device::MigrationCaps {
            precopy: true,
            p2p: false,
        }
    }
    fn step(&mut self, _: switchyard_device::MigArc) -> switchyard_device::Result<()> {
        Ok(())
    }
    fn read(&mut self, _: &mut [u8]) -> switchyard_device::Result<usize> {
        Ok(0)
    }
    fn write(&mut self, _: &[u8]) -> switchyard_device::Result<()> {
        Ok(())
    }
    fn abort(&mut self) {}
    fn precopy_info(&mut self) -> Option<switchyard_device::PrecopyInfo> {
        Some(switchyard_device::PrecopyInfo {
            initial_bytes: 1000,
            dirty_bytes: 24,
        })
    }
    fn stop_copy_size(&mut self) -> Option<u64> {
        Some(5000)
    }
}

fn mig_data_size() -> Request<'static> {
    Request::DeviceFeature(DeviceFeatureRequest {
        argsz: DeviceFeatureHeader::SIZE as u32 + 8,
        op: FeatureRequest::Other {
            flags: switchyard_proto::FeatureFlags::new(
                VFIO_DEVICE_FEATURE_MIG_DATA_SIZE,
                true,
                false,
                false,
            )
            .0,
            data: &[],
        },
    })
}

/// GET_PRECOPY_INFO in PRE_COPY only (EINVAL elsewhere, like the kernel's ioctl), and
/// MIG_DATA_SIZE in any state; a device that cannot tell answers "not supported".
#[test]
fn precopy_info_and_stop_copy_size_are_served_as_the_kernel_serves_them() {
    let mut l = Loopback::new();
    l.slot = slot_with(
        Box::new(Sizing {
            inner: MockDevice::new(),
        }),
        16,
    );
    l.negotiate();
    let info = Request::GetPrecopyInfo { argsz: 24 };
    assert_eq!(l.request(info, Vec::new()).errno(), libc::EINVAL as u32);
    let a = l.request(mig_data_size(), Vec::new());
    let Reply::DeviceFeature(f) = a.reply() else {
        panic!("not a DEVICE_FEATURE reply");
    };
    let FeatureReply::Other { data, .. } = f.op else {
        panic!("not MIG_DATA_SIZE: {:?}", f.op);
    };
    assert_eq!(
        data,
        5000u64.to_le_bytes(),
        "stop_copy_length, in RUNNING too"
    );
    let probe = Request::DeviceFeature(DeviceFeatureRequest {
        argsz: DeviceFeatureHeader::SIZE as u32,
        op: FeatureRequest::Probe {
            feature: VFIO_DEVICE_FEATURE_MIG_DATA_SIZE,
            get: true,
            set: false,
        },
    });
    assert!(matches!(
        l.request(probe, Vec::new()).reply(),
        Reply::DeviceFeature(_)
    ));

    let pre_copy = Request::DeviceFeature(DeviceFeatureRequest {
        argsz: DeviceFeatureHeader::SIZE as u32 + 8,
        op: FeatureRequest::SetMigDeviceState(switchyard_proto::MigDeviceState {
            device_state: switchyard_proto::MigState::PreCopy as u32,
            data_fd: u32::MAX,
        }),
    });
    assert!(matches!(
        l.request(pre_copy, Vec::new()).reply(),
        Reply::DeviceFeature(_)
    ));
    let a = l.request(info, Vec::new());
    let Reply::GetPrecopyInfo(p) = a.reply() else {
        panic!("not a GET_PRECOPY_INFO reply");
    };
    assert_eq!(
        (p.argsz, p.flags, p.initial_bytes, p.dirty_bytes),
        (24, 0, 1000, 24)
    );

    // The mock that does not migrate: neither is served.
    let mut l = Loopback::new();
    l.negotiate();
    assert_eq!(l.request(info, Vec::new()).errno(), libc::ENOTSUP as u32);
    assert_eq!(
        l.request(mig_data_size(), Vec::new()).errno(),
        libc::ENOTTY as u32
    );
}
