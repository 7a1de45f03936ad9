//! Owned mirrors of every Reply variant and the strategy over all of them.

use super::*;
use crate::features::feature_reply;
use crate::region::{io_fds_reply, region_info_reply};
use crate::version::version_data;

#[derive(Debug, Clone)]
pub(crate) enum OFeatRep {
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
pub(crate) enum OIoEntries {
    None,
    Spec(Vec<IoFdEntry>),
    Lvu(Vec<IoFdShadowEntry>),
}

#[derive(Debug, Clone)]
pub(crate) enum ORep {
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
    pub(crate) fn nfds(&self) -> usize {
        match self {
            ORep::Version { nfds, .. }
            | ORep::RegionInfo(_, _, nfds)
            | ORep::IoFds { nfds, .. } => *nfds,
            _ => 0,
        }
    }

    pub(crate) fn with<R>(&self, f: impl FnOnce(&Reply<'_>) -> R) -> R {
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

pub(crate) fn reply() -> impl Strategy<Value = ORep> {
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
