//! DMA_MAP and DMA_UNMAP rules.

use super::*;

#[test]
fn dma_map_rules() {
    let m = |flags, address, size, offset| DmaMap {
        argsz: 32,
        flags,
        offset,
        address,
        size,
    };
    req_ok(VFIO_USER_DMA_MAP, m(3, 0x1000, 0x1000, 0).as_bytes(), 0);
    req_ok(VFIO_USER_DMA_MAP, m(3, 0x1000, 0x1000, 0).as_bytes(), 1);
    req_ok(VFIO_USER_DMA_MAP, m(3 | 4, 0x1000, 0x1000, 0).as_bytes(), 1);
    req_ok(VFIO_USER_DMA_MAP, m(1 | 8, 0x1000, 0x1000, 0).as_bytes(), 1);
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, m(3, 0x1000, 0x1000, 0).as_bytes(), 2).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, m(3 | 4, 0x1000, 0x1000, 0).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, m(4 | 8, 0x1000, 0x1000, 0).as_bytes(), 1).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, m(0x10, 0x1000, 0x1000, 0).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, m(3, u64::MAX, 2, 0).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, m(3, 0, 0x1000, u64::MAX).as_bytes(), 1).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, m(3, 0, 0, 0).as_bytes(), 0).errno(),
        EINVAL
    );
    // A window may end exactly at 2^64 (last byte u64::MAX).
    req_ok(
        VFIO_USER_DMA_MAP,
        m(3, u64::MAX - 0xfff, 0x1000, 0).as_bytes(),
        0,
    );
    req_ok(
        VFIO_USER_DMA_MAP,
        m(3, u64::MAX - 0xfff, 0x1000, 0).as_bytes(),
        1,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DMA_MAP,
            m(3, u64::MAX - 0xffe, 0x1000, 0).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    let mut short = m(3, 0, 0x1000, 0);
    short.argsz = 31;
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, short.as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_MAP, &m(3, 0, 0x1000, 0).as_bytes()[..31], 0).errno(),
        EINVAL
    );
    // Bytes after the struct are ignored (libvfio-user: payload ≥ 32, argsz ≥ 32).
    req_ok(
        VFIO_USER_DMA_MAP,
        &cat(&[m(3, 0, 0x1000, 0).as_bytes(), &[0]]),
        0,
    );
}

#[test]
fn dma_unmap_rules() {
    let u = |argsz, flags, address, size| DmaUnmap {
        argsz,
        flags,
        address,
        size,
    };
    req_ok(VFIO_USER_DMA_UNMAP, u(24, 0, 0x1000, 0x1000).as_bytes(), 0);
    req_ok(
        VFIO_USER_DMA_UNMAP,
        u(24, VFIO_DMA_UNMAP_FLAG_ALL, 0, 0).as_bytes(),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DMA_UNMAP,
            u(24, VFIO_DMA_UNMAP_FLAG_ALL, 0x1000, 0).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_DMA_UNMAP,
            u(24, VFIO_DMA_UNMAP_FLAG_ALL, 0, 1).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_UNMAP, u(64, 3, 0, 0).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_UNMAP, u(24, 4, 0x1000, 0x1000).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_UNMAP, u(23, 0, 0x1000, 0x1000).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_UNMAP, u(24, 0, u64::MAX, 2).as_bytes(), 0).errno(),
        EINVAL
    );
    // A window may end exactly at 2^64 (last byte u64::MAX).
    req_ok(
        VFIO_USER_DMA_UNMAP,
        u(24, 0, u64::MAX - 0xfff, 0x1000).as_bytes(),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DMA_UNMAP,
            u(24, 0, u64::MAX - 0xffe, 0x1000).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DMA_UNMAP, u(24, 0, 0x1000, 0x1000).as_bytes(), 1).errno(),
        EINVAL
    );
    // Dirty bitmap: 1 MiB at 4 KiB = 256 pages = 32 bytes.
    let d = u(
        24 + 16 + 32,
        VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
        0x10000,
        1 << 20,
    );
    let bh = BitmapHeader {
        pgsize: 4096,
        size: 32,
    };
    req_ok(VFIO_USER_DMA_UNMAP, &cat(&[d.as_bytes(), bh.as_bytes()]), 0);
    // missing bitmap header
    assert_eq!(
        req_err(VFIO_USER_DMA_UNMAP, d.as_bytes(), 0).errno(),
        EINVAL
    );
    // wrong bitmap size
    let bad = BitmapHeader {
        pgsize: 4096,
        size: 24,
    };
    assert_eq!(
        req_err(
            VFIO_USER_DMA_UNMAP,
            &cat(&[d.as_bytes(), bad.as_bytes()]),
            0
        )
        .errno(),
        EINVAL
    );
    // non power-of-two pgsize
    let bad = BitmapHeader {
        pgsize: 3000,
        size: 32,
    };
    assert_eq!(
        req_err(
            VFIO_USER_DMA_UNMAP,
            &cat(&[d.as_bytes(), bad.as_bytes()]),
            0
        )
        .errno(),
        EINVAL
    );
    // argsz too small for the bitmap
    let small = u(
        24 + 16,
        VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
        0x10000,
        1 << 20,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DMA_UNMAP,
            &cat(&[small.as_bytes(), bh.as_bytes()]),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(dirty_bitmap_size(1, 4096), Ok(8));
    assert_eq!(dirty_bitmap_size(64 * 4096, 4096), Ok(8));
    assert_eq!(dirty_bitmap_size(65 * 4096, 4096), Ok(16));
}
