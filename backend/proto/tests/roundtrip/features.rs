//! DEVICE_FEATURE strategies (migration state, DMA logging, probes, unknown features).

use super::*;
use crate::replies::{OFeatRep, ORep};
use crate::requests::{OFeatReq, OReq};

fn logging_ranges() -> impl Strategy<Value = Vec<DmaLoggingRange>> {
    prop::collection::vec(
        range64(1 << 40).prop_map(|(iova, length)| DmaLoggingRange { iova, length }),
        0..8,
    )
}

fn unknown_feature() -> impl Strategy<Value = u16> {
    any::<u16>().prop_filter("known feature", |f| ![1u16, 2, 6, 7, 8].contains(f))
}

pub(crate) fn feature_req() -> impl Strategy<Value = OReq> {
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

pub(crate) fn feature_reply() -> impl Strategy<Value = ORep> {
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
