//! The client against an in-test fake vfio-user server built on the proto crate.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io::Write;
use std::os::fd::AsFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use switchyard_client::{Client, ClientConfig, ClientError, FlatDma};
use switchyard_endpoint::{recv_exact, send_all};
use switchyard_proto::consts::*;
use switchyard_proto::errno::*;
use switchyard_proto::*;

/// Most descriptors the fake server accepts with one read.
const MAX_FDS: usize = 64;

/// What the fake server observed.
#[derive(Debug, Default)]
struct Seen {
    irq_fds: usize,
    dma_map_fds: usize,
    posted_writes: usize,
    resets: usize,
    mig_state: u32,
    mig_written: Vec<u8>,
}

struct Fake {
    sock: UnixStream,
    regs: Vec<u8>,
    seen: Arc<Mutex<Seen>>,
    out: Vec<u8>,
    next_id: u16,
}

impl Fake {
    fn recv(&mut self) -> Option<(Header, Vec<u8>, Vec<File>)> {
        let mut fds = Vec::new();
        let mut h = [0u8; 16];
        recv_exact(&self.sock, &mut h, MAX_FDS, &mut fds).ok()?;
        let hdr = Header::from_bytes(&h).ok()?;
        let mut body = vec![0; hdr.body_len().ok()?];
        recv_exact(&self.sock, &mut body, MAX_FDS, &mut fds).ok()?;
        Some((hdr, body, fds))
    }

    fn send_out(&mut self, fds: &[std::os::fd::BorrowedFd<'_>]) {
        send_all(&self.sock, &self.out, fds).expect("send");
    }

    /// Issues a server-to-client request and waits for its reply.
    fn dma(&mut self, req: Request<'_>) -> Result<Vec<u8>, i32> {
        let id = self.next_id;
        self.next_id = self.next_id.wrapping_add(1);
        req.encode(id, false, &mut self.out).expect("encode");
        self.send_out(&[]);
        let (h, body, fds) = self.recv().ok_or(EIO)?;
        assert_eq!(h.msg_id, id);
        assert!(h.is_reply());
        match decode_reply(&h, &body, fds.len()) {
            Ok(Reply::DmaRead { data, .. }) => Ok(data.to_vec()),
            Ok(Reply::DmaWrite { .. }) => Ok(Vec::new()),
            Ok(other) => panic!("unexpected {other:?}"),
            Err(e) => Err(e.errno()),
        }
    }

    fn run(mut self) {
        let limits = Limits::server(1 << 20);
        while let Some((hdr, body, fds)) = self.recv() {
            let req = match decode_request_with(&hdr, &body, fds.len(), &limits) {
                Ok(r) => r,
                Err(e) => {
                    encode_error_reply(&mut self.out, hdr.msg_id, hdr.cmd, e.errno());
                    self.send_out(&[]);
                    continue;
                }
            };
            let mut reply_fds: Vec<File> = Vec::new();
            let res: Result<(), i32> = self.handle(&hdr, req, fds, &mut reply_fds);
            if hdr.no_reply() {
                continue;
            }
            if let Err(e) = res {
                encode_error_reply(&mut self.out, hdr.msg_id, hdr.cmd, e);
            }
            let files: Vec<File> = reply_fds;
            let raw: Vec<_> = files.iter().map(std::os::fd::AsFd::as_fd).collect();
            self.send_out(&raw);
        }
    }

    fn handle(
        &mut self,
        hdr: &Header,
        req: Request<'_>,
        fds: Vec<File>,
        reply_fds: &mut Vec<File>,
    ) -> Result<(), i32> {
        let id = hdr.msg_id;
        let out = &mut self.out;
        let enc = |r: Reply<'_>, out: &mut Vec<u8>| r.encode(id, out).map_err(|e| e.errno());
        match req {
            Request::Version(v) => {
                let n = negotiate_version(v.major, v.minor, v.data, &ServerLimits::default())
                    .map_err(|e| e.errno())?;
                encode_version_reply(out, id, &n.reply).map_err(|e| e.errno())
            }
            Request::DeviceGetInfo { .. } => enc(
                Reply::DeviceGetInfo(DeviceInfo {
                    argsz: 16,
                    flags: VFIO_DEVICE_FLAGS_RESET | VFIO_DEVICE_FLAGS_PCI,
                    num_regions: 9,
                    num_irqs: 5,
                }),
                out,
            ),
            Request::DeviceGetRegionInfo { argsz, index } => {
                if index >= 9 {
                    return Err(EINVAL);
                }
                let mut caps = Vec::new();
                let mut info = RegionInfo {
                    index,
                    size: 4096,
                    flags: 3,
                    ..Default::default()
                };
                if index == 2 {
                    info.flags |= VFIO_REGION_INFO_FLAG_MMAP;
                    let mut b = RegionCapsBuilder::new(&mut caps);
                    b.sparse_mmap(&[
                        SparseMmapArea {
                            offset: 0,
                            size: 1024,
                        },
                        SparseMmapArea {
                            offset: 2048,
                            size: 1024,
                        },
                    ])
                    .map_err(|e| e.errno())?;
                    if !b.finish_info(&mut info, argsz).map_err(|e| e.errno())? {
                        caps.clear();
                    } else {
                        reply_fds.push(tempfile::tempfile().map_err(|_| EIO)?);
                    }
                } else {
                    info.argsz = 32;
                }
                enc(Reply::DeviceGetRegionInfo { info, caps: &caps }, out)
            }
            Request::DeviceGetIrqInfo { index, .. } => enc(
                Reply::DeviceGetIrqInfo(IrqInfo {
                    argsz: 16,
                    flags: VFIO_IRQ_INFO_EVENTFD,
                    index,
                    count: 4,
                }),
                out,
            ),
            Request::DeviceSetIrqs(_) => {
                self.seen.lock().expect("lock").irq_fds += fds.len();
                enc(Reply::DeviceSetIrqs, out)
            }
            Request::DmaMap(_) => {
                self.seen.lock().expect("lock").dma_map_fds += fds.len();
                enc(Reply::DmaMap, out)
            }
            Request::DmaUnmap {
                unmap,
                bitmap: None,
            } => enc(
                Reply::DmaUnmap {
                    unmap,
                    bitmap: None,
                },
                out,
            ),
            Request::DmaUnmap {
                unmap,
                bitmap: Some(b),
            } => {
                let bm = dma_unmap_bitmap_reply_buffer(out, id, &unmap, b.pgsize)
                    .map_err(|e| e.errno())?;
                bm[0] = 0b101;
                Ok(())
            }
            Request::RegionRead {
                offset,
                region: 0,
                count,
            } => {
                let start = offset as usize;
                let end = start
                    .checked_add(count as usize)
                    .filter(|e| *e <= self.regs.len())
                    .ok_or(EINVAL)?;
                let buf =
                    region_read_reply_buffer(out, id, offset, 0, count).map_err(|e| e.errno())?;
                buf.copy_from_slice(&self.regs[start..end]);
                Ok(())
            }
            // Region 1: reading triggers a DMA_READ of the same size at 0x1000.
            Request::RegionRead {
                offset,
                region: 1,
                count,
            } => {
                let data = self.dma(Request::DmaRead {
                    address: 0x1000,
                    count: u64::from(count),
                })?;
                Reply::RegionRead {
                    offset,
                    region: 1,
                    data: &data,
                }
                .encode(id, &mut self.out)
                .map_err(|e| e.errno())
            }
            Request::RegionWrite {
                offset,
                region: 0,
                data,
            } => {
                let start = offset as usize;
                let end = start
                    .checked_add(data.len())
                    .filter(|e| *e <= self.regs.len())
                    .ok_or(EINVAL)?;
                self.regs[start..end].copy_from_slice(data);
                if hdr.no_reply() {
                    self.seen.lock().expect("lock").posted_writes += 1;
                }
                encode_region_write_reply(out, id, offset, 0, data.len() as u32)
                    .map_err(|e| e.errno())
            }
            // Region 1: writing triggers a DMA_WRITE of the data to 0x2000.
            Request::RegionWrite {
                offset,
                region: 1,
                data,
            } => {
                let count = data.len() as u32;
                let owned = data.to_vec();
                self.dma(Request::DmaWrite {
                    address: 0x2000,
                    data: &owned,
                })?;
                encode_region_write_reply(&mut self.out, id, offset, 1, count)
                    .map_err(|e| e.errno())
            }
            Request::RegionRead { .. } | Request::RegionWrite { .. } => Err(EINVAL),
            Request::RegionWriteMulti(entries) => {
                for e in entries.iter() {
                    let start = e.offset as usize;
                    let end = start + e.bytes().len();
                    self.regs
                        .get_mut(start..end)
                        .ok_or(EINVAL)?
                        .copy_from_slice(e.bytes());
                }
                enc(
                    Reply::RegionWriteMulti {
                        wr_cnt: entries.len() as u64,
                    },
                    out,
                )
            }
            Request::DeviceReset => {
                self.seen.lock().expect("lock").resets += 1;
                enc(Reply::DeviceReset, out)
            }
            Request::DeviceFeature(f) => {
                let op = match f.op {
                    FeatureRequest::Probe {
                        feature: 1 | 2 | 6 | 7 | 8,
                        get,
                        set,
                    } => FeatureReply::Probe {
                        feature: f.op.feature(),
                        get,
                        set,
                    },
                    FeatureRequest::GetMigration => FeatureReply::GetMigration(MigrationFeature {
                        flags: VFIO_MIGRATION_STOP_COPY | VFIO_MIGRATION_PRE_COPY,
                    }),
                    FeatureRequest::GetMigDeviceState => {
                        FeatureReply::GetMigDeviceState(MigDeviceState {
                            device_state: self.seen.lock().expect("lock").mig_state,
                            data_fd: u32::MAX,
                        })
                    }
                    FeatureRequest::SetMigDeviceState(s) => {
                        MigState::try_from(s.device_state).map_err(|_| EINVAL)?;
                        self.seen.lock().expect("lock").mig_state = s.device_state;
                        FeatureReply::SetMigDeviceState(s)
                    }
                    FeatureRequest::DmaLoggingStart(c) => FeatureReply::DmaLoggingStart(c),
                    FeatureRequest::DmaLoggingStop => FeatureReply::DmaLoggingStop,
                    FeatureRequest::DmaLoggingReport(r) => {
                        let n = dirty_bitmap_size(r.length, r.page_size).map_err(|e| e.errno())?
                            as usize;
                        let mut bitmap = vec![0u8; n];
                        bitmap[0] = 0x81;
                        let argsz = (32 + n) as u32;
                        return enc(
                            Reply::DeviceFeature(DeviceFeatureReply {
                                argsz,
                                op: FeatureReply::DmaLoggingReport {
                                    report: r,
                                    bitmap: &bitmap,
                                },
                            }),
                            out,
                        );
                    }
                    _ => return Err(ENOTTY),
                };
                let argsz = 8 + op.data_len() as u32;
                enc(Reply::DeviceFeature(DeviceFeatureReply { argsz, op }), out)
            }
            Request::MigDataRead { size, .. } => {
                let data = mig_data_read_reply_buffer(out, id, size).map_err(|e| e.errno())?;
                let n = data.len().min(5);
                data[..n].copy_from_slice(&b"state"[..n]);
                truncate_mig_data_read_reply(out, n as u32).map_err(|e| e.errno())
            }
            Request::MigDataWrite { data, .. } => {
                self.seen
                    .lock()
                    .expect("lock")
                    .mig_written
                    .extend_from_slice(data);
                enc(Reply::MigDataWrite(None), out)
            }
            Request::DeviceGetRegionIoFds { index, .. } => {
                let e = [IoFdEntry {
                    offset: 0x10,
                    size: 4,
                    fd_index: 0,
                    kind: 0,
                    flags: 0,
                    padding: 0,
                    datamatch: 0,
                }];
                reply_fds.push(tempfile::tempfile().map_err(|_| EIO)?);
                enc(
                    Reply::DeviceGetRegionIoFds {
                        argsz: 56,
                        index,
                        count: 1,
                        entries: IoFdEntries::Spec(Records::from_slice(&e)),
                    },
                    out,
                )
            }
            Request::DmaRead { .. } | Request::DmaWrite { .. } => Err(EINVAL),
            Request::GetPrecopyInfo { .. } => Err(ENOTSUP),
        }
    }
}

fn spawn_fake(sock: UnixStream) -> (Arc<Mutex<Seen>>, JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let mut regs = vec![0u8; 4096];
    for (i, b) in regs.iter_mut().enumerate() {
        *b = i as u8;
    }
    let fake = Fake {
        sock,
        regs,
        seen: seen.clone(),
        out: Vec::new(),
        next_id: 0x8000,
    };
    (seen, std::thread::spawn(move || fake.run()))
}

fn pair() -> (Client, Arc<Mutex<Seen>>, JoinHandle<()>) {
    let (a, b) = UnixStream::pair().expect("pair");
    let (seen, h) = spawn_fake(b);
    let c = Client::from_stream(a, ClientConfig::default()).expect("connect");
    (c, seen, h)
}

#[test]
fn version_negotiation_over_a_socket_path() {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("dev.sock");
    let listener = UnixListener::bind(&path).expect("bind");
    let t = std::thread::spawn(move || {
        let (s, _) = listener.accept().expect("accept");
        let (_seen, h) = spawn_fake(s);
        h.join().expect("fake");
    });
    let c = Client::connect(&path).expect("connect");
    assert_eq!(c.server_version(), (0, 0));
    let caps = c.negotiated_caps();
    assert_eq!(caps.max_msg_fds, 8);
    assert_eq!(caps.max_data_xfer_size, DEFAULT_MAX_DATA_XFER_SIZE);
    assert!(caps.write_multiple);
    drop(c);
    t.join().expect("server thread");
}

#[test]
fn region_read_write() {
    let (mut c, seen, _h) = pair();
    let info = c.device_info().expect("info");
    assert_eq!(info.num_regions, 9);
    let mut buf = [0u8; 8];
    c.region_read(0, 16, &mut buf).expect("read");
    assert_eq!(buf, [16, 17, 18, 19, 20, 21, 22, 23]);
    c.region_write(0, 16, &[9, 9, 9, 9]).expect("write");
    c.region_write_posted(0, 20, &[7, 7]).expect("posted write");
    c.region_read(0, 16, &mut buf).expect("read");
    assert_eq!(buf, [9, 9, 9, 9, 7, 7, 22, 23]);
    assert_eq!(seen.lock().expect("lock").posted_writes, 1);
    let e = [WriteMultiEntry {
        offset: 0,
        region: 0,
        count: 2,
        data: [0xaa, 0xbb, 0, 0, 0, 0, 0, 0],
    }];
    assert_eq!(c.region_write_multi(&e).expect("multi"), 1);
    let mut two = [0u8; 2];
    c.region_read(0, 0, &mut two).expect("read");
    assert_eq!(two, [0xaa, 0xbb]);
    let posted = [WriteMultiEntry {
        offset: 0,
        region: 0,
        count: 2,
        data: [0xcc, 0xdd, 0, 0, 0, 0, 0, 0],
    }];
    c.region_write_multi_posted(&posted).expect("multi posted");
    c.region_read(0, 0, &mut two).expect("read");
    assert_eq!(two, [0xcc, 0xdd], "the posted WRITE_MULTI landed");
    c.device_reset().expect("reset");
    assert_eq!(seen.lock().expect("lock").resets, 1);
}

#[test]
fn error_reply_surfaces_errno_and_connection_survives() {
    let (mut c, _seen, _h) = pair();
    let mut buf = [0u8; 4];
    let e = c.region_read(5, 0, &mut buf).expect_err("region 5 fails");
    assert!(
        matches!(
            e,
            ClientError::Remote {
                command: Command::RegionRead,
                errno: EINVAL
            }
        ),
        "{e:?}"
    );
    assert_eq!(e.remote_errno(), Some(EINVAL));
    let e = c.region_read(0, 4094, &mut buf).expect_err("out of range");
    assert_eq!(e.remote_errno(), Some(EINVAL));
    let e = c.region_info(20).expect_err("bad index");
    assert_eq!(e.remote_errno(), Some(EINVAL));
    c.region_read(0, 0, &mut buf).expect("still usable");
    assert_eq!(buf, [0, 1, 2, 3]);
}

#[test]
fn dma_read_interleaved_before_reply() {
    let (mut c, _seen, _h) = pair();
    let mut mem = FlatDma::new(0x1000, 64);
    mem.mem[..8].copy_from_slice(b"guestmem");
    c.set_dma_handler(Some(Box::new(mem)));
    let mut buf = [0u8; 8];
    c.region_read(1, 0, &mut buf).expect("read through DMA");
    assert_eq!(&buf, b"guestmem");
    assert_eq!(c.dma_requests_served(), 1);
}

#[test]
fn dma_write_interleaved_before_reply() {
    let (mut c, _seen, _h) = pair();
    let mem = Arc::new(Mutex::new(FlatDma::new(0x2000, 16)));
    c.set_dma_handler(Some(Box::new(mem.clone())));
    c.region_write(1, 0, b"hello").expect("write through DMA");
    assert_eq!(&mem.lock().expect("lock").mem[..5], b"hello");
}

#[test]
fn dma_without_handler_gets_efault() {
    let (mut c, _seen, _h) = pair();
    let mut buf = [0u8; 8];
    let e = c.region_read(1, 0, &mut buf).expect_err("no DMA memory");
    assert_eq!(e.remote_errno(), Some(EFAULT));
    // Out-of-range DMA also answers EFAULT.
    c.set_dma_handler(Some(Box::new(FlatDma::new(0x1000, 4))));
    let e = c.region_read(1, 0, &mut buf).expect_err("short DMA memory");
    assert_eq!(e.remote_errno(), Some(EFAULT));
}

#[test]
fn fds_are_passed() {
    let (mut c, seen, _h) = pair();
    let e1 = tempfile::tempfile().expect("fd");
    let e2 = tempfile::tempfile().expect("fd");
    c.set_irqs(
        VFIO_PCI_MSIX_IRQ_INDEX,
        VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
        0,
        2,
        &[e1.as_fd(), e2.as_fd()],
    )
    .expect("set irqs");
    assert_eq!(seen.lock().expect("lock").irq_fds, 2);
    // Mismatched fd count is rejected by the server's decoder.
    let e = c
        .set_irqs(
            VFIO_PCI_MSIX_IRQ_INDEX,
            VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER,
            0,
            3,
            &[e1.as_fd()],
        )
        .expect_err("fd count");
    assert_eq!(e.remote_errno(), Some(EINVAL));
    c.set_irqs_bool(
        VFIO_PCI_INTX_IRQ_INDEX,
        VFIO_IRQ_SET_ACTION_UNMASK,
        0,
        &[true],
    )
    .expect("bool");
    c.set_irqs(
        VFIO_PCI_MSIX_IRQ_INDEX,
        VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER,
        0,
        0,
        &[],
    )
    .expect("disable");
    let mut mem = tempfile::tempfile().expect("tempfile");
    mem.write_all(&[0; 4096]).expect("write");
    c.dma_map(
        0x10000,
        4096,
        VFIO_USER_F_DMA_REGION_READ | VFIO_USER_F_DMA_REGION_WRITE,
        Some((mem.as_fd(), 0)),
    )
    .expect("map");
    c.dma_map(0x20000, 4096, 3, None).expect("map without fd");
    assert_eq!(seen.lock().expect("lock").dma_map_fds, 1);
    c.dma_unmap(0x10000, 4096, 0).expect("unmap");
    c.dma_unmap_all().expect("unmap all");
    let bm = c
        .dma_unmap_dirty(0x20000, 1 << 20, 4096)
        .expect("unmap dirty");
    assert_eq!(bm.len(), 32);
    assert_eq!(bm[0], 0b101);
    let e = c
        .dma_unmap(0, 4096, VFIO_DMA_UNMAP_FLAG_ALL)
        .expect_err("ALL with size");
    assert_eq!(e.remote_errno(), Some(EINVAL));
}

#[test]
fn region_info_with_caps_and_fd() {
    let (mut c, _seen, _h) = pair();
    let r = c.region_info(2).expect("region info");
    assert_eq!(r.info.size, 4096);
    assert!(r.info.flags & VFIO_REGION_INFO_FLAG_MMAP != 0);
    let areas = r.sparse_areas.expect("sparse areas");
    assert_eq!(
        areas,
        vec![
            SparseMmapArea {
                offset: 0,
                size: 1024
            },
            SparseMmapArea {
                offset: 2048,
                size: 1024
            }
        ]
    );
    assert!(r.fd.is_some());
    let r0 = c.region_info(0).expect("region 0");
    assert!(r0.sparse_areas.is_none() && r0.fd.is_none());
    let irq = c.irq_info(2).expect("irq info");
    assert_eq!(irq.count, 4);
    let io = c.get_region_io_fds(0, 256).expect("io fds");
    assert_eq!(io.entries.len(), 1);
    assert_eq!(io.fds.len(), 1);
}

#[test]
fn features_and_migration_data() {
    let (mut c, seen, _h) = pair();
    assert_eq!(
        c.migration_flags().expect("flags"),
        VFIO_MIGRATION_STOP_COPY | VFIO_MIGRATION_PRE_COPY
    );
    assert_eq!(
        c.set_mig_state(VFIO_DEVICE_STATE_STOP).expect("set"),
        VFIO_DEVICE_STATE_STOP
    );
    assert_eq!(c.mig_state().expect("get"), VFIO_DEVICE_STATE_STOP);
    assert_eq!(
        c.set_mig_state(42).expect_err("bad state").remote_errno(),
        Some(EINVAL)
    );
    c.feature_probe(VFIO_DEVICE_FEATURE_DMA_LOGGING_START, false, true)
        .expect("probe");
    assert_eq!(
        c.feature_probe(11, true, false)
            .expect_err("unknown")
            .remote_errno(),
        Some(ENOTTY)
    );
    let ranges = [DmaLoggingRange {
        iova: 0,
        length: 1 << 20,
    }];
    assert_eq!(c.dma_logging_start(4096, &ranges).expect("start"), 4096);
    let bm = c.dma_logging_report(0, 1 << 20, 4096).expect("report");
    assert_eq!(bm.len(), 32);
    assert_eq!(bm[0], 0x81);
    c.dma_logging_stop().expect("stop");
    let (h, data) = c
        .device_feature(16, VFIO_DEVICE_FEATURE_GET | 1, &[])
        .expect("raw feature");
    assert_eq!(h.argsz, 16);
    assert_eq!(data.len(), 8);
    assert_eq!(c.mig_data_read(4096).expect("mig read"), b"state");
    assert_eq!(c.mig_data_read(3).expect("mig read"), b"sta");
    c.mig_data_write(b"abc").expect("mig write");
    assert_eq!(seen.lock().expect("lock").mig_written, b"abc");
}

#[test]
fn raw_messages() {
    let (mut c, _seen, _h) = pair();
    // Unknown command 99: the server's decoder answers EINVAL.
    let hdr = Header {
        msg_id: 0x1234,
        cmd: 99,
        msg_size: 17,
        flags: 0,
        error_no: 0,
    };
    let mut bytes = hdr.to_bytes().to_vec();
    bytes.push(0);
    c.send_raw(&bytes, &[]).expect("send");
    let m = c.recv_raw().expect("recv");
    assert_eq!(m.header.msg_id, 0x1234);
    assert!(m.header.is_error());
    assert_eq!(m.header.error_no, EINVAL as u32);
    // call_raw with a valid but oversized REGION_READ -> E2BIG.
    let mut out = Vec::new();
    Request::RegionRead {
        offset: 0,
        region: 0,
        count: (1 << 20) + 1,
    }
    .encode(0x77, false, &mut out)
    .expect("encode");
    let m = c.call_raw(&out, &[]).expect("call");
    assert_eq!(m.header.error_no, E2BIG as u32);
    // fds on a command that takes none.
    let e = tempfile::tempfile().expect("fd");
    Request::DeviceReset
        .encode(0x78, false, &mut out)
        .expect("encode");
    let m = c.call_raw(&out, &[e.as_fd()]).expect("call");
    assert_eq!(m.header.error_no, EINVAL as u32);
    // Normal traffic continues.
    c.device_info().expect("info");
}

#[test]
fn timeout_and_disconnect() {
    let (a, b) = UnixStream::pair().expect("pair");
    let cfg = ClientConfig {
        timeout: Some(Duration::from_millis(200)),
        ..ClientConfig::default()
    };
    let e = Client::from_stream(a, cfg.clone()).expect_err("silent server");
    assert!(matches!(e, ClientError::Timeout), "{e:?}");
    drop(b);
    let (a, b) = UnixStream::pair().expect("pair");
    drop(b);
    let e = Client::from_stream(a, cfg).expect_err("closed server");
    assert!(matches!(e, ClientError::Disconnected), "{e:?}");
}

#[test]
fn mismatched_reply_is_rejected() {
    let (a, b) = UnixStream::pair().expect("pair");
    let t = std::thread::spawn(move || {
        let mut fds: Vec<File> = Vec::new();
        let mut h = [0u8; 16];
        recv_exact(&b, &mut h, MAX_FDS, &mut fds).expect("recv");
        let hdr = Header::from_bytes(&h).expect("hdr");
        let mut body = vec![0; hdr.body_len().expect("len")];
        recv_exact(&b, &mut body, MAX_FDS, &mut fds).expect("recv");
        // Reply with the wrong message id.
        let mut out = Vec::new();
        encode_version_reply(
            &mut out,
            hdr.msg_id.wrapping_add(1),
            &Capabilities::default(),
        )
        .expect("encode");
        send_all(&b, &out, &[]).expect("send");
        b
    });
    let e = Client::from_stream(a, ClientConfig::default()).expect_err("bad id");
    assert!(matches!(e, ClientError::UnexpectedReply(_)), "{e:?}");
    drop(t.join());
}

#[test]
fn server_with_higher_minor_is_rejected() {
    let (a, b) = UnixStream::pair().expect("pair");
    let t = std::thread::spawn(move || {
        let mut fds: Vec<File> = Vec::new();
        let mut h = [0u8; 16];
        recv_exact(&b, &mut h, MAX_FDS, &mut fds).expect("recv");
        let hdr = Header::from_bytes(&h).expect("hdr");
        let mut body = vec![0; hdr.body_len().expect("len")];
        recv_exact(&b, &mut body, MAX_FDS, &mut fds).expect("recv");
        let json = Capabilities::default().to_version_data();
        let mut out = Vec::new();
        Reply::Version(Version {
            major: 0,
            minor: 1,
            data: &json,
        })
        .encode(hdr.msg_id, &mut out)
        .expect("encode");
        send_all(&b, &out, &[]).expect("send");
        b
    });
    let e = Client::from_stream(a, ClientConfig::default()).expect_err("minor 1");
    assert!(
        matches!(e, ClientError::BadVersion { major: 0, minor: 1 }),
        "{e:?}"
    );
    drop(t.join());
}

/// A server DMA request and the awaited reply carrying an fd, sent back to back (Linux may
/// deliver both in one read, with the fd): the fd belongs to the reply, not the request.
#[test]
fn fd_of_a_reply_is_not_given_to_an_interleaved_dma_request() {
    let (a, b) = UnixStream::pair().expect("pair");
    let server = std::thread::spawn(move || {
        let mut fds: Vec<File> = Vec::new();
        let mut h = [0u8; 16];
        recv_exact(&b, &mut h, MAX_FDS, &mut fds).expect("request header");
        let hdr = Header::from_bytes(&h).expect("header");
        let mut body = vec![0; hdr.body_len().expect("len")];
        recv_exact(&b, &mut body, MAX_FDS, &mut fds).expect("request body");
        let mut out = Vec::new();
        Request::DmaRead {
            address: 0x1000,
            count: 4,
        }
        .encode(0x8000, false, &mut out)
        .expect("encode");
        send_all(&b, &out, &[]).expect("send dma read");
        let info = RegionInfo {
            argsz: 32,
            flags: VFIO_REGION_INFO_FLAG_READ | VFIO_REGION_INFO_FLAG_MMAP,
            index: 2,
            cap_offset: 0,
            size: 4096,
            offset: 0,
        };
        Reply::DeviceGetRegionInfo { info, caps: &[] }
            .encode(hdr.msg_id, &mut out)
            .expect("encode");
        let f = memfd_file();
        send_all(&b, &out, &[f.as_fd()]).expect("send reply with fd");
        // The client answers the DMA_READ.
        let mut h = [0u8; 16];
        recv_exact(&b, &mut h, MAX_FDS, &mut fds).expect("dma reply");
        assert!(Header::from_bytes(&h).expect("header").is_reply());
    });
    let mut c = Client::without_handshake(a, ClientConfig::default()).expect("client");
    c.set_dma_handler(Some(Box::new(FlatDma::new(0x1000, 64))));
    let r = c.region_info(2).expect("region info");
    assert!(r.fd.is_some(), "the reply keeps its fd");
    assert_eq!(c.dma_requests_served(), 1);
    server.join().expect("server");
}

fn memfd_file() -> File {
    let f = tempfile::tempfile().expect("tempfile");
    f.set_len(4096).expect("set_len");
    f
}
