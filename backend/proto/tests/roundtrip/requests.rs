//! Owned mirrors of every Request variant and the strategy over all of them.

use super::*;
use crate::dma::{dma_map, dma_unmap};
use crate::features::feature_req;
use crate::irqs::set_irqs;
use crate::region::wm_entry;
use crate::version::version_data;

#[derive(Debug, Clone)]
pub(crate) enum OIrqData {
    None,
    Bool(Vec<u8>),
    Eventfd,
}

#[derive(Debug, Clone)]
pub(crate) enum OFeatReq {
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
pub(crate) enum OReq {
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
    pub(crate) fn nfds(&self) -> usize {
        match self {
            OReq::DmaMap(_, n) => *n,
            OReq::SetIrqs { nfds, .. } => *nfds,
            _ => 0,
        }
    }

    pub(crate) fn with<R>(&self, f: impl FnOnce(&Request<'_>) -> R) -> R {
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

pub(crate) fn request() -> impl Strategy<Value = OReq> {
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
