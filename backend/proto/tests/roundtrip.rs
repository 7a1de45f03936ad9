//! Property tests: decode(encode(x)) == x for every Request and Reply
//! variant, plus no-panic checks on random and mutated input.

use proptest::prelude::*;
use switchyard_proto::consts::*;
use switchyard_proto::*;

// ------------------------------------------------------------ owned mirrors

#[derive(Debug, Clone)]
enum OIrqData {
    None,
    Bool(Vec<u8>),
    Eventfd,
}

#[derive(Debug, Clone)]
enum OFeatReq {
    Probe {
        feature: u16,
        get: bool,
        set: bool,
    },
    GetMigration,
    GetMigDeviceState,
    SetMigDeviceState(MigDeviceState),
    Start {
        page_size: u64,
        ranges: Vec<DmaLoggingRange>,
    },
    Stop,
    Report(DmaLoggingReport),
    Other {
        flags: u32,
        data: Vec<u8>,
    },
}

#[derive(Debug, Clone)]
enum OReq {
    Version {
        major: u16,
        minor: u16,
        data: Vec<u8>,
    },
    DmaMap(DmaMap, usize),
    DmaUnmap(DmaUnmap, Option<BitmapHeader>),
    GetInfo(u32),
    GetRegionInfo(u32, u32),
    GetIoFds(u32, u32),
    GetIrqInfo(u32, u32),
    SetIrqs {
        argsz: u32,
        action: IrqAction,
        data: OIrqData,
        index: u32,
        start: u32,
        count: u32,
        nfds: usize,
    },
    RegionRead {
        offset: u64,
        region: u32,
        count: u32,
    },
    RegionWrite {
        offset: u64,
        region: u32,
        data: Vec<u8>,
    },
    DmaRead {
        address: u64,
        count: u64,
    },
    DmaWrite {
        address: u64,
        data: Vec<u8>,
    },
    Reset,
    WriteMulti(Vec<WriteMultiEntry>),
    Feature {
        argsz: u32,
        op: OFeatReq,
    },
    MigDataRead {
        argsz: u32,
        size: u32,
    },
    MigDataWrite {
        argsz: u32,
        data: Vec<u8>,
    },
}

impl OReq {
    fn nfds(&self) -> usize {
        match self {
            OReq::DmaMap(_, n) => *n,
            OReq::SetIrqs { nfds, .. } => *nfds,
            _ => 0,
        }
    }

    fn with<R>(&self, f: impl FnOnce(&Request<'_>) -> R) -> R {
        let req = match self {
            OReq::Version { major, minor, data } => Request::Version(Version {
                major: *major,
                minor: *minor,
                data,
            }),
            OReq::DmaMap(m, _) => Request::DmaMap(*m),
            OReq::DmaUnmap(u, b) => Request::DmaUnmap {
                unmap: *u,
                bitmap: *b,
            },
            OReq::GetInfo(argsz) => Request::DeviceGetInfo { argsz: *argsz },
            OReq::GetRegionInfo(argsz, index) => Request::DeviceGetRegionInfo {
                argsz: *argsz,
                index: *index,
            },
            OReq::GetIoFds(argsz, index) => Request::DeviceGetRegionIoFds {
                argsz: *argsz,
                index: *index,
            },
            OReq::GetIrqInfo(argsz, index) => Request::DeviceGetIrqInfo {
                argsz: *argsz,
                index: *index,
            },
            OReq::SetIrqs {
                argsz,
                action,
                data,
                index,
                start,
                count,
                ..
            } => Request::DeviceSetIrqs(SetIrqs {
                argsz: *argsz,
                action: *action,
                data: match data {
                    OIrqData::None => IrqData::None,
                    OIrqData::Bool(b) => IrqData::Bool(b),
                    OIrqData::Eventfd => IrqData::Eventfd,
                },
                index: *index,
                start: *start,
                count: *count,
            }),
            OReq::RegionRead {
                offset,
                region,
                count,
            } => Request::RegionRead {
                offset: *offset,
                region: *region,
                count: *count,
            },
            OReq::RegionWrite {
                offset,
                region,
                data,
            } => Request::RegionWrite {
                offset: *offset,
                region: *region,
                data,
            },
            OReq::DmaRead { address, count } => Request::DmaRead {
                address: *address,
                count: *count,
            },
            OReq::DmaWrite { address, data } => Request::DmaWrite {
                address: *address,
                data,
            },
            OReq::Reset => Request::DeviceReset,
            OReq::WriteMulti(e) => Request::RegionWriteMulti(Records::from_slice(e)),
            OReq::Feature { argsz, op } => Request::DeviceFeature(DeviceFeatureRequest {
                argsz: *argsz,
                op: match op {
                    OFeatReq::Probe { feature, get, set } => FeatureRequest::Probe {
                        feature: *feature,
                        get: *get,
                        set: *set,
                    },
                    OFeatReq::GetMigration => FeatureRequest::GetMigration,
                    OFeatReq::GetMigDeviceState => FeatureRequest::GetMigDeviceState,
                    OFeatReq::SetMigDeviceState(s) => FeatureRequest::SetMigDeviceState(*s),
                    OFeatReq::Start { page_size, ranges } => {
                        FeatureRequest::DmaLoggingStart(DmaLoggingControl {
                            page_size: *page_size,
                            ranges: Records::from_slice(ranges),
                        })
                    }
                    OFeatReq::Stop => FeatureRequest::DmaLoggingStop,
                    OFeatReq::Report(r) => FeatureRequest::DmaLoggingReport(*r),
                    OFeatReq::Other { flags, data } => FeatureRequest::Other {
                        flags: *flags,
                        data,
                    },
                },
            }),
            OReq::MigDataRead { argsz, size } => Request::MigDataRead {
                argsz: *argsz,
                size: *size,
            },
            OReq::MigDataWrite { argsz, data } => Request::MigDataWrite {
                argsz: *argsz,
                data,
            },
        };
        f(&req)
    }
}

// --------------------------------------------------------------- strategies

fn version_data() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        Just(Vec::new()),
        "[ -~]{0,64}".prop_map(|s| {
            let mut v = s.into_bytes();
            v.push(0);
            v
        }),
        (any::<u32>(), 1u32..=1024, any::<bool>()).prop_map(|(x, fds, wm)| {
            Capabilities {
                max_msg_fds: fds,
                max_data_xfer_size: (x % MAX_DATA_XFER_SIZE_LIMIT) + 1,
                write_multiple: wm,
                ..Capabilities::default()
            }
            .to_version_data()
        }),
    ]
}

/// An (address, size) pair with size ≥ 1 and no overflow.
fn range64(max_size: u64) -> impl Strategy<Value = (u64, u64)> {
    (1..=max_size).prop_flat_map(|size| (0..=u64::MAX - size, Just(size)))
}

/// A DMA window (address, size) with size ≥ 1 that may end exactly at 2^64
/// (last byte `u64::MAX`), which DMA_MAP/DMA_UNMAP accept; the top edge is
/// generated often.
fn dma_window(max_size: u64) -> impl Strategy<Value = (u64, u64)> {
    (1..=max_size).prop_flat_map(|size| {
        let top = u64::MAX - (size - 1);
        (prop_oneof![Just(top), 0..=top], Just(size))
    })
}

fn argsz_at_least(min: u32) -> impl Strategy<Value = u32> {
    prop_oneof![Just(min), min..=u32::MAX]
}

fn pgsize() -> impl Strategy<Value = u64> {
    (12u32..=21).prop_map(|s| 1u64 << s)
}

fn dma_map() -> impl Strategy<Value = OReq> {
    (
        argsz_at_least(32),
        0u32..4,
        0u32..3,
        dma_window(1 << 40),
        any::<bool>(),
    )
        .prop_flat_map(|(argsz, rw, mode, (address, size), with_fd)| {
            let mode_bits = [
                0,
                VFIO_USER_F_DMA_REGION_MMAP,
                VFIO_USER_F_DMA_REGION_FILE_IO,
            ][mode as usize];
            let nfds = usize::from(mode_bits != 0 || with_fd);
            (0..=u64::MAX - size).prop_map(move |offset| {
                OReq::DmaMap(
                    DmaMap {
                        argsz,
                        flags: rw | mode_bits,
                        offset,
                        address,
                        size,
                    },
                    nfds,
                )
            })
        })
}

fn dma_unmap() -> impl Strategy<Value = OReq> {
    prop_oneof![
        argsz_at_least(24).prop_map(|argsz| OReq::DmaUnmap(
            DmaUnmap {
                argsz,
                flags: VFIO_DMA_UNMAP_FLAG_ALL,
                address: 0,
                size: 0
            },
            None
        )),
        (argsz_at_least(24), dma_window(u64::MAX / 2)).prop_map(|(argsz, (address, size))| {
            OReq::DmaUnmap(
                DmaUnmap {
                    argsz,
                    flags: 0,
                    address,
                    size,
                },
                None,
            )
        }),
        (dma_window(1 << 30), pgsize()).prop_flat_map(|((address, size), pgsize)| {
            let bsize = dirty_bitmap_size(size, pgsize).unwrap_or(0);
            let min = (40 + bsize) as u32;
            (min..=(1u32 << 20)).prop_map(move |argsz| {
                OReq::DmaUnmap(
                    DmaUnmap {
                        argsz,
                        flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
                        address,
                        size,
                    },
                    Some(BitmapHeader {
                        pgsize,
                        size: bsize,
                    }),
                )
            })
        }),
    ]
}

fn irq_action() -> impl Strategy<Value = IrqAction> {
    prop_oneof![
        Just(IrqAction::Mask),
        Just(IrqAction::Unmask),
        Just(IrqAction::Trigger)
    ]
}

fn set_irqs() -> impl Strategy<Value = OReq> {
    prop_oneof![
        argsz_at_least(20).prop_map(|argsz| OReq::SetIrqs {
            argsz,
            action: IrqAction::Trigger,
            data: OIrqData::None,
            index: 2,
            start: 0,
            count: 0,
            nfds: 0
        }),
        (
            argsz_at_least(20),
            irq_action(),
            any::<u32>(),
            0u32..4096,
            1u32..=16,
            0u8..3,
            any::<bool>()
        )
            .prop_flat_map(|(argsz, action, index, start, count, kind, with_fds)| {
                prop::collection::vec(any::<u8>(), count as usize).prop_map(move |bools| {
                    let (data, nfds) = match kind {
                        0 => (OIrqData::None, 0),
                        1 => (OIrqData::Bool(bools), 0),
                        _ => (OIrqData::Eventfd, if with_fds { count as usize } else { 0 }),
                    };
                    OReq::SetIrqs {
                        argsz,
                        action,
                        data,
                        index,
                        start,
                        count,
                        nfds,
                    }
                })
            }),
    ]
}

fn wm_entry() -> impl Strategy<Value = WriteMultiEntry> {
    (any::<u32>(), 1u32..=8, any::<[u8; 8]>()).prop_flat_map(|(region, count, data)| {
        (0..=u64::MAX - u64::from(count)).prop_map(move |offset| WriteMultiEntry {
            offset,
            region,
            count,
            data,
        })
    })
}

fn logging_ranges() -> impl Strategy<Value = Vec<DmaLoggingRange>> {
    prop::collection::vec(
        range64(1 << 40).prop_map(|(iova, length)| DmaLoggingRange { iova, length }),
        0..8,
    )
}

fn unknown_feature() -> impl Strategy<Value = u16> {
    any::<u16>().prop_filter("known feature", |f| ![1u16, 2, 6, 7, 8].contains(f))
}

fn feature_req() -> impl Strategy<Value = OReq> {
    prop_oneof![
        (
            argsz_at_least(8),
            any::<u16>(),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(argsz, feature, get, set)| OReq::Feature {
                argsz,
                op: OFeatReq::Probe { feature, get, set }
            }),
        argsz_at_least(16).prop_map(|argsz| OReq::Feature {
            argsz,
            op: OFeatReq::GetMigration
        }),
        argsz_at_least(16).prop_map(|argsz| OReq::Feature {
            argsz,
            op: OFeatReq::GetMigDeviceState
        }),
        (argsz_at_least(16), any::<u32>(), any::<u32>()).prop_map(|(argsz, s, fd)| OReq::Feature {
            argsz,
            op: OFeatReq::SetMigDeviceState(MigDeviceState {
                device_state: s,
                data_fd: fd
            })
        }),
        (argsz_at_least(24), pgsize(), logging_ranges()).prop_map(|(argsz, page_size, ranges)| {
            OReq::Feature {
                argsz,
                op: OFeatReq::Start { page_size, ranges },
            }
        }),
        argsz_at_least(8).prop_map(|argsz| OReq::Feature {
            argsz,
            op: OFeatReq::Stop
        }),
        (range64(1 << 32), pgsize()).prop_flat_map(|((iova, length), page_size)| {
            let min = 32 + dirty_bitmap_size(length, page_size).unwrap_or(0) as u32;
            argsz_at_least(min).prop_map(move |argsz| OReq::Feature {
                argsz,
                op: OFeatReq::Report(DmaLoggingReport {
                    iova,
                    length,
                    page_size,
                }),
            })
        }),
        (
            argsz_at_least(8),
            unknown_feature(),
            any::<bool>(),
            prop::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(argsz, feature, get, data)| OReq::Feature {
                argsz,
                op: OFeatReq::Other {
                    flags: FeatureFlags::new(feature, get, !get, false).0,
                    data
                },
            }),
    ]
}

fn request() -> impl Strategy<Value = OReq> {
    let data = || prop::collection::vec(any::<u8>(), 1..256);
    prop_oneof![
        (any::<u16>(), any::<u16>(), version_data())
            .prop_map(|(major, minor, data)| OReq::Version { major, minor, data }),
        dma_map(),
        dma_unmap(),
        argsz_at_least(16).prop_map(OReq::GetInfo),
        (argsz_at_least(32), any::<u32>()).prop_map(|(a, i)| OReq::GetRegionInfo(a, i)),
        (argsz_at_least(16), any::<u32>()).prop_map(|(a, i)| OReq::GetIoFds(a, i)),
        (argsz_at_least(16), any::<u32>()).prop_map(|(a, i)| OReq::GetIrqInfo(a, i)),
        set_irqs(),
        (any::<u32>(), 1u32..=(1 << 20)).prop_flat_map(|(region, count)| {
            (0..=u64::MAX - u64::from(count)).prop_map(move |offset| OReq::RegionRead {
                offset,
                region,
                count,
            })
        }),
        (any::<u32>(), data()).prop_flat_map(|(region, data)| {
            (0..=u64::MAX - data.len() as u64).prop_map(move |offset| OReq::RegionWrite {
                offset,
                region,
                data: data.clone(),
            })
        }),
        range64(1 << 20).prop_map(|(address, count)| OReq::DmaRead { address, count }),
        data().prop_flat_map(|data| {
            (0..=u64::MAX - data.len() as u64).prop_map(move |address| OReq::DmaWrite {
                address,
                data: data.clone(),
            })
        }),
        Just(OReq::Reset),
        prop::collection::vec(wm_entry(), 1..=200).prop_map(OReq::WriteMulti),
        feature_req(),
        (0u32..=(1 << 20)).prop_flat_map(|size| argsz_at_least(size + 8)
            .prop_map(move |argsz| OReq::MigDataRead { argsz, size })),
        prop::collection::vec(any::<u8>(), 0..256).prop_flat_map(|data| {
            argsz_at_least(data.len() as u32 + 8).prop_map(move |argsz| OReq::MigDataWrite {
                argsz,
                data: data.clone(),
            })
        }),
    ]
}

// ------------------------------------------------------------------ replies

#[derive(Debug, Clone)]
enum OFeatRep {
    Probe {
        feature: u16,
        get: bool,
        set: bool,
    },
    GetMigration(u64),
    GetState(MigDeviceState),
    SetState(MigDeviceState),
    Start {
        page_size: u64,
        ranges: Vec<DmaLoggingRange>,
    },
    Stop,
    Report(DmaLoggingReport, Vec<u8>),
    Other {
        flags: u32,
        data: Vec<u8>,
    },
}

#[derive(Debug, Clone)]
enum OIoEntries {
    None,
    Spec(Vec<IoFdEntry>),
    Lvu(Vec<IoFdShadowEntry>),
}

#[derive(Debug, Clone)]
enum ORep {
    Version {
        major: u16,
        minor: u16,
        data: Vec<u8>,
        nfds: usize,
    },
    DmaMap,
    DmaUnmap(DmaUnmap, Option<(u64, Vec<u8>)>),
    GetInfo(DeviceInfo),
    RegionInfo(RegionInfo, Vec<u8>, usize),
    IoFds {
        argsz: u32,
        index: u32,
        count: u32,
        entries: OIoEntries,
        nfds: usize,
    },
    IrqInfo(IrqInfo),
    SetIrqs,
    RegionRead {
        offset: u64,
        region: u32,
        data: Vec<u8>,
    },
    RegionWrite {
        offset: u64,
        region: u32,
        count: u32,
    },
    DmaRead {
        address: u64,
        data: Vec<u8>,
    },
    DmaWrite {
        address: u64,
        count: u64,
    },
    Reset,
    WriteMulti(u64),
    Feature {
        argsz: u32,
        op: OFeatRep,
    },
    MigDataRead {
        argsz: u32,
        data: Vec<u8>,
    },
    MigDataWrite(Option<MigData>),
}

impl ORep {
    fn nfds(&self) -> usize {
        match self {
            ORep::Version { nfds, .. }
            | ORep::RegionInfo(_, _, nfds)
            | ORep::IoFds { nfds, .. } => *nfds,
            _ => 0,
        }
    }

    fn with<R>(&self, f: impl FnOnce(&Reply<'_>) -> R) -> R {
        let r = match self {
            ORep::Version {
                major, minor, data, ..
            } => Reply::Version(Version {
                major: *major,
                minor: *minor,
                data,
            }),
            ORep::DmaMap => Reply::DmaMap,
            ORep::DmaUnmap(u, b) => Reply::DmaUnmap {
                unmap: *u,
                bitmap: b.as_ref().map(|(pgsize, data)| DirtyBitmap {
                    pgsize: *pgsize,
                    data,
                }),
            },
            ORep::GetInfo(i) => Reply::DeviceGetInfo(*i),
            ORep::RegionInfo(info, caps, _) => Reply::DeviceGetRegionInfo { info: *info, caps },
            ORep::IoFds {
                argsz,
                index,
                count,
                entries,
                ..
            } => Reply::DeviceGetRegionIoFds {
                argsz: *argsz,
                index: *index,
                count: *count,
                entries: match entries {
                    OIoEntries::None => IoFdEntries::Spec(Records::default()),
                    OIoEntries::Spec(e) => IoFdEntries::Spec(Records::from_slice(e)),
                    OIoEntries::Lvu(e) => IoFdEntries::LibvfioUser(Records::from_slice(e)),
                },
            },
            ORep::IrqInfo(i) => Reply::DeviceGetIrqInfo(*i),
            ORep::SetIrqs => Reply::DeviceSetIrqs,
            ORep::RegionRead {
                offset,
                region,
                data,
            } => Reply::RegionRead {
                offset: *offset,
                region: *region,
                data,
            },
            ORep::RegionWrite {
                offset,
                region,
                count,
            } => Reply::RegionWrite {
                offset: *offset,
                region: *region,
                count: *count,
            },
            ORep::DmaRead { address, data } => Reply::DmaRead {
                address: *address,
                data,
            },
            ORep::DmaWrite { address, count } => Reply::DmaWrite {
                address: *address,
                count: *count,
            },
            ORep::Reset => Reply::DeviceReset,
            ORep::WriteMulti(n) => Reply::RegionWriteMulti { wr_cnt: *n },
            ORep::Feature { argsz, op } => Reply::DeviceFeature(DeviceFeatureReply {
                argsz: *argsz,
                op: match op {
                    OFeatRep::Probe { feature, get, set } => FeatureReply::Probe {
                        feature: *feature,
                        get: *get,
                        set: *set,
                    },
                    OFeatRep::GetMigration(f) => {
                        FeatureReply::GetMigration(MigrationFeature { flags: *f })
                    }
                    OFeatRep::GetState(s) => FeatureReply::GetMigDeviceState(*s),
                    OFeatRep::SetState(s) => FeatureReply::SetMigDeviceState(*s),
                    OFeatRep::Start { page_size, ranges } => {
                        FeatureReply::DmaLoggingStart(DmaLoggingControl {
                            page_size: *page_size,
                            ranges: Records::from_slice(ranges),
                        })
                    }
                    OFeatRep::Stop => FeatureReply::DmaLoggingStop,
                    OFeatRep::Report(r, b) => FeatureReply::DmaLoggingReport {
                        report: *r,
                        bitmap: b,
                    },
                    OFeatRep::Other { flags, data } => FeatureReply::Other {
                        flags: *flags,
                        data,
                    },
                },
            }),
            ORep::MigDataRead { argsz, data } => Reply::MigDataRead {
                argsz: *argsz,
                data,
            },
            ORep::MigDataWrite(m) => Reply::MigDataWrite(*m),
        };
        f(&r)
    }
}

fn region_info_reply() -> impl Strategy<Value = ORep> {
    (
        any::<RegionInfoParts>(),
        prop::option::of(prop::collection::vec((any::<u64>(), any::<u64>()), 0..6)),
        prop::option::of((any::<u32>(), any::<u32>())),
        any::<bool>(),
        0usize..3,
    )
        .prop_map(|(p, sparse, rtype, msix, nfds)| {
            let mut caps = Vec::new();
            let mut b = RegionCapsBuilder::new(&mut caps);
            if let Some(areas) = &sparse {
                let areas: Vec<SparseMmapArea> = areas
                    .iter()
                    .map(|(o, s)| SparseMmapArea {
                        offset: *o,
                        size: *s,
                    })
                    .collect();
                let _ = b.sparse_mmap(&areas);
            }
            if let Some((k, s)) = rtype {
                let _ = b.region_type(k, s);
            }
            if msix {
                let _ = b.msix_mappable();
            }
            let mut info = RegionInfo {
                argsz: 0,
                flags: p.flags,
                index: p.index,
                cap_offset: 0,
                size: p.size,
                offset: p.offset,
            };
            let fits = b
                .finish_info(&mut info, if p.small_argsz { 32 } else { u32::MAX })
                .unwrap_or(false);
            if !fits {
                caps.clear();
            }
            ORep::RegionInfo(info, caps, nfds)
        })
}

#[derive(Debug, Clone, Copy)]
struct RegionInfoParts {
    flags: u32,
    index: u32,
    size: u64,
    offset: u64,
    small_argsz: bool,
}

impl Arbitrary for RegionInfoParts {
    type Parameters = ();
    type Strategy = BoxedStrategy<Self>;
    fn arbitrary_with(_: ()) -> Self::Strategy {
        (
            0u32..8,
            any::<u32>(),
            any::<u64>(),
            any::<u64>(),
            any::<bool>(),
        )
            .prop_map(
                |(flags, index, size, offset, small_argsz)| RegionInfoParts {
                    flags,
                    index,
                    size,
                    offset,
                    small_argsz,
                },
            )
            .boxed()
    }
}

fn io_fds_reply() -> impl Strategy<Value = ORep> {
    (any::<u32>(), any::<u32>(), 1usize..5, 0u8..3).prop_flat_map(|(argsz, index, nfds, kind)| {
        let fdi = 0..nfds as u32;
        let spec = prop::collection::vec(
            (
                any::<u64>(),
                any::<u64>(),
                fdi.clone(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
            )
                .prop_map(|(offset, size, fd_index, kind, flags, datamatch)| {
                    IoFdEntry {
                        offset,
                        size,
                        fd_index,
                        kind,
                        flags,
                        padding: 0,
                        datamatch,
                    }
                }),
            1..6,
        );
        let lvu = prop::collection::vec(
            (
                any::<u64>(),
                any::<u64>(),
                fdi,
                any::<u32>(),
                any::<u32>(),
                any::<u32>(),
                any::<u64>(),
                any::<u64>(),
            )
                .prop_map(
                    |(gpa_offset, size, fd_index, kind, flags, smfi, shadow_offset, datamatch)| {
                        IoFdShadowEntry {
                            gpa_offset,
                            size,
                            fd_index,
                            kind,
                            flags,
                            shadow_mem_fd_index: smfi,
                            shadow_offset,
                            datamatch,
                        }
                    },
                ),
            1..6,
        );
        match kind {
            0 => any::<u32>()
                .prop_map(move |count| ORep::IoFds {
                    argsz,
                    index,
                    count,
                    entries: OIoEntries::None,
                    nfds: 0,
                })
                .boxed(),
            1 => spec
                .prop_map(move |e| ORep::IoFds {
                    argsz,
                    index,
                    count: e.len() as u32,
                    entries: OIoEntries::Spec(e),
                    nfds,
                })
                .boxed(),
            _ => lvu
                .prop_map(move |e| ORep::IoFds {
                    argsz,
                    index,
                    count: e.len() as u32,
                    entries: OIoEntries::Lvu(e),
                    nfds,
                })
                .boxed(),
        }
    })
}

fn feature_reply() -> impl Strategy<Value = ORep> {
    let op = prop_oneof![
        (any::<u16>(), any::<bool>(), any::<bool>())
            .prop_map(|(feature, get, set)| OFeatRep::Probe { feature, get, set }),
        any::<u64>().prop_map(OFeatRep::GetMigration),
        (any::<u32>(), any::<u32>()).prop_map(|(s, f)| OFeatRep::GetState(MigDeviceState {
            device_state: s,
            data_fd: f
        })),
        (any::<u32>(), any::<u32>()).prop_map(|(s, f)| OFeatRep::SetState(MigDeviceState {
            device_state: s,
            data_fd: f
        })),
        (pgsize(), logging_ranges())
            .prop_map(|(page_size, ranges)| OFeatRep::Start { page_size, ranges }),
        Just(OFeatRep::Stop),
        (any::<u64>(), 1u64..(1 << 24), pgsize()).prop_flat_map(|(iova, length, page_size)| {
            let n = dirty_bitmap_size(length, page_size).unwrap_or(0) as usize;
            prop::collection::vec(any::<u8>(), n).prop_map(move |b| {
                OFeatRep::Report(
                    DmaLoggingReport {
                        iova,
                        length,
                        page_size,
                    },
                    b,
                )
            })
        }),
        (
            unknown_feature(),
            any::<bool>(),
            prop::collection::vec(any::<u8>(), 0..64)
        )
            .prop_map(|(feature, get, data)| OFeatRep::Other {
                flags: FeatureFlags::new(feature, get, !get, false).0,
                data
            }),
    ];
    (any::<u32>(), op).prop_map(|(argsz, op)| ORep::Feature { argsz, op })
}

fn reply() -> impl Strategy<Value = ORep> {
    let data = || prop::collection::vec(any::<u8>(), 0..256);
    prop_oneof![
        (any::<u16>(), any::<u16>(), version_data(), 0usize..2).prop_map(
            |(major, minor, data, nfds)| ORep::Version {
                major,
                minor,
                data,
                nfds
            }
        ),
        Just(ORep::DmaMap),
        (any::<u32>(), any::<u64>(), any::<u64>()).prop_map(|(argsz, address, size)| {
            ORep::DmaUnmap(
                DmaUnmap {
                    argsz,
                    flags: 0,
                    address,
                    size,
                },
                None,
            )
        }),
        (any::<u32>(), any::<u64>(), 1u64..(1 << 26), pgsize()).prop_flat_map(
            |(argsz, address, size, pg)| {
                let n = dirty_bitmap_size(size, pg).unwrap_or(0) as usize;
                prop::collection::vec(any::<u8>(), n).prop_map(move |b| {
                    ORep::DmaUnmap(
                        DmaUnmap {
                            argsz,
                            flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
                            address,
                            size,
                        },
                        Some((pg, b)),
                    )
                })
            }
        ),
        (16u32.., any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(argsz, flags, num_regions, num_irqs)| ORep::GetInfo(DeviceInfo {
                argsz,
                flags,
                num_regions,
                num_irqs
            })
        ),
        region_info_reply(),
        io_fds_reply(),
        (any::<u32>(), any::<u32>(), any::<u32>(), any::<u32>()).prop_map(
            |(argsz, flags, index, count)| ORep::IrqInfo(IrqInfo {
                argsz,
                flags,
                index,
                count
            })
        ),
        Just(ORep::SetIrqs),
        (any::<u64>(), any::<u32>(), data()).prop_map(|(offset, region, data)| ORep::RegionRead {
            offset,
            region,
            data
        }),
        (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(|(offset, region, count)| {
            ORep::RegionWrite {
                offset,
                region,
                count,
            }
        }),
        (any::<u64>(), data()).prop_map(|(address, data)| ORep::DmaRead { address, data }),
        (any::<u64>(), any::<u64>()).prop_map(|(address, count)| ORep::DmaWrite { address, count }),
        Just(ORep::Reset),
        any::<u64>().prop_map(ORep::WriteMulti),
        feature_reply(),
        (any::<u32>(), data()).prop_map(|(argsz, data)| ORep::MigDataRead { argsz, data }),
        prop::option::of(
            (any::<u32>(), any::<u32>()).prop_map(|(argsz, size)| MigData { argsz, size })
        )
        .prop_map(ORep::MigDataWrite),
    ]
}

fn split(buf: &[u8]) -> (Header, &[u8]) {
    let h = Header::from_bytes(buf).expect("header");
    (h, &buf[Header::SIZE..])
}

/// An encoded request or reply.
fn encoded_message() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        request().prop_map(|req| {
            let mut out = Vec::new();
            req.with(|r| r.encode(7, false, &mut out)).expect("encode");
            out
        }),
        reply().prop_map(|rep| {
            let mut out = Vec::new();
            rep.with(|r| r.encode(7, &mut out)).expect("encode");
            out
        }),
    ]
}

/// Mutates an encoded message deterministically from `m`.
fn mutate(mut buf: Vec<u8>, m: (u8, usize, u8, u32)) -> Vec<u8> {
    let (kind, pos, bit, val) = m;
    match kind % 5 {
        0 if !buf.is_empty() => {
            let i = pos % buf.len();
            buf[i] ^= 1 << (bit % 8);
        }
        1 => buf.truncate(pos % (buf.len() + 1)),
        2 if buf.len() >= 8 => buf[4..8].copy_from_slice(&val.to_ne_bytes()),
        3 if buf.len() >= Header::SIZE + 4 => {
            // Edit a 4-byte field inside the body (argsz/count-like fields).
            let i = Header::SIZE + (pos % (buf.len() - Header::SIZE - 3));
            buf[i..i + 4].copy_from_slice(&val.to_ne_bytes());
        }
        _ => buf.extend_from_slice(&val.to_ne_bytes()),
    }
    buf
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn request_round_trip(req in request(), id in any::<u16>(), no_reply in any::<bool>()) {
        let mut out = Vec::new();
        req.with(|r| r.encode(id, no_reply, &mut out)).expect("encode");
        let (h, body) = split(&out);
        prop_assert_eq!(h.msg_id, id);
        prop_assert_eq!(h.no_reply(), no_reply);
        prop_assert_eq!(h.msg_size as usize, out.len());
        let decoded = decode_request(&h, body, req.nfds());
        req.with(|r| {
            prop_assert_eq!(decoded, Ok(*r));
            Ok(())
        })?;
    }

    #[test]
    fn reply_round_trip(rep in reply(), id in any::<u16>()) {
        let mut out = Vec::new();
        rep.with(|r| r.encode(id, &mut out)).expect("encode");
        let (h, body) = split(&out);
        prop_assert_eq!(h.msg_id, id);
        prop_assert!(h.is_reply());
        let decoded = decode_reply(&h, body, rep.nfds());
        rep.with(|r| {
            prop_assert_eq!(decoded, Ok(*r));
            Ok(())
        })?;
    }

    #[test]
    fn error_reply_round_trip(id in any::<u16>(), cmd in 1u16..=19, code in any::<i32>()) {
        let mut out = Vec::new();
        encode_error_reply(&mut out, id, cmd, code);
        let (h, body) = split(&out);
        let e = decode_reply(&h, body, 0).expect_err("error reply");
        // The header carries |code|; 0 and values above 4096 report EIO.
        let wire = code.unsigned_abs();
        prop_assert_eq!(&e, &ProtoError::ErrorReply { cmd, errno: wire });
        let expected = if wire == 0 || wire > errno::MAX_ERRNO {
            errno::EIO
        } else {
            wire as i32
        };
        prop_assert_eq!(e.errno(), expected);
    }

    #[test]
    fn random_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::decode_all(&data);
    }

    #[test]
    fn mutated_messages_never_panic(msg in encoded_message(), sel in any::<u8>(), m in any::<(u8, usize, u8, u32)>()) {
        let mut input = vec![sel];
        input.extend_from_slice(&mutate(msg, m));
        fuzzing::decode_all(&input);
    }

    #[test]
    fn truncated_requests_are_rejected(req in request(), cut in any::<usize>()) {
        // Truncating the body while keeping msg_size consistent never
        // yields the original request (fixed-size commands are rejected,
        // variable ones lose data) and never panics.
        let mut out = Vec::new();
        req.with(|r| r.encode(1, false, &mut out)).expect("encode");
        let body_len = out.len() - Header::SIZE;
        prop_assume!(body_len > 0);
        let keep = cut % body_len;
        out.truncate(Header::SIZE + keep);
        let size = out.len() as u32;
        out[4..8].copy_from_slice(&size.to_ne_bytes());
        let (h, body) = split(&out);
        let decoded = decode_request(&h, body, req.nfds());
        req.with(|r| {
            prop_assert_ne!(decoded, Ok(*r));
            Ok(())
        })?;
    }

    #[test]
    fn caps_json_round_trip(fds in 0u32..=1024, xfer in 1u32..=MAX_DATA_XFER_SIZE_LIMIT, maps in 1u32..=65535,
                            pg in 1u64..1024, wm in any::<bool>(), mig in prop::option::of((1u64..16, 0u64..=MAX_BITMAP_SIZE_LIMIT)),
                            twin in prop::option::of((any::<bool>(), prop::option::of(any::<u32>()))), smf in any::<bool>()) {
        let caps = Capabilities {
            max_msg_fds: fds,
            max_data_xfer_size: xfer,
            max_dma_maps: maps,
            pgsizes: pg * 4096,
            migration: mig.map(|(p, m)| MigrationCap { pgsize: p * 4096, max_bitmap_size: m }),
            write_multiple: wm,
            twin_socket: twin.map(|(supported, fd_index)| TwinSocketCap { supported, fd_index }),
            sparse_mmap_fds: smf,
        };
        let data = caps.to_version_data();
        prop_assert_eq!(data.last(), Some(&0));
        prop_assert_eq!(Capabilities::from_version_data(&data), Ok(caps));
    }
}
