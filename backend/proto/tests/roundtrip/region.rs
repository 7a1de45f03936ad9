//! REGION_WRITE_MULTI, DEVICE_GET_REGION_INFO and DEVICE_GET_REGION_IO_FDS strategies.

use super::*;
use crate::replies::{OIoEntries, ORep};

pub(crate) fn wm_entry() -> impl Strategy<Value = WriteMultiEntry> {
    (any::<u32>(), 1u32..=8, any::<[u8; 8]>()).prop_flat_map(|(region, count, data)| {
        (0..=u64::MAX - u64::from(count)).prop_map(move |offset| WriteMultiEntry {
            offset,
            region,
            count,
            data,
        })
    })
}

pub(crate) fn region_info_reply() -> impl Strategy<Value = ORep> {
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

pub(crate) fn io_fds_reply() -> impl Strategy<Value = ORep> {
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
