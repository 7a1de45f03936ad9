//! DMA_MAP and DMA_UNMAP strategies.

use super::*;
use crate::requests::OReq;

/// A DMA window (address, size) with size ≥ 1 that may end exactly at 2^64
/// (last byte `u64::MAX`), which DMA_MAP/DMA_UNMAP accept; the top edge is
/// generated often.
fn dma_window(max_size: u64) -> impl Strategy<Value = (u64, u64)> {
    (1..=max_size).prop_flat_map(|size| {
        let top = u64::MAX - (size - 1);
        (prop_oneof![Just(top), 0..=top], Just(size))
    })
}

pub(crate) fn dma_map() -> impl Strategy<Value = OReq> {
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

pub(crate) fn dma_unmap() -> impl Strategy<Value = OReq> {
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
