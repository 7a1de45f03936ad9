//! Payloads larger than their fixed struct, accepted like libvfio-user.

use super::*;

/// What libvfio-user (the reference server) accepts, we accept: a request whose payload is
/// larger than its fixed struct, e.g. a kernel-style client that sends its whole `argsz`
/// buffer (libvfio-user's own client asks DEVICE_GET_REGION_INFO again with argsz = 64 and a
/// 64-byte payload, room for capabilities). The fixed part must still be complete, and sizes
/// the payload announces must still hold.
#[test]
fn payloads_larger_than_the_fixed_struct_are_accepted_like_libvfio_user() {
    let spare = |fixed: &[u8], n: usize| cat(&[fixed, &vec![0xa5; n]]);
    let decode = |c: u16, body: &[u8], nfds: usize| {
        let (h, b) = cmd(c, 0, body);
        decode_request(&h, &b, nfds)
            .map(|r| format!("{r:?}"))
            .map_err(|e| e.errno())
    };
    let ri = RegionInfo {
        argsz: 64,
        index: 2,
        ..Default::default()
    };
    assert_eq!(
        decode(
            VFIO_USER_DEVICE_GET_REGION_INFO,
            &spare(ri.as_bytes(), 32),
            0
        ),
        Ok(format!(
            "{:?}",
            Request::DeviceGetRegionInfo {
                argsz: 64,
                index: 2
            }
        )),
        "argsz 64 with a 64-byte payload (libvfio-user's client)"
    );
    let di = DeviceInfo {
        argsz: 32,
        ..Default::default()
    };
    assert_eq!(
        decode(VFIO_USER_DEVICE_GET_INFO, &spare(di.as_bytes(), 16), 0),
        Ok(format!("{:?}", Request::DeviceGetInfo { argsz: 32 }))
    );
    let ii = IrqInfo {
        argsz: 24,
        index: 3,
        ..Default::default()
    };
    assert_eq!(
        decode(VFIO_USER_DEVICE_GET_IRQ_INFO, &spare(ii.as_bytes(), 8), 0),
        Ok(format!(
            "{:?}",
            Request::DeviceGetIrqInfo {
                argsz: 24,
                index: 3
            }
        ))
    );
    let io = RegionIoFds {
        argsz: 16 + 48,
        flags: 0,
        index: 0,
        count: 0,
    };
    assert_eq!(
        decode(
            VFIO_USER_DEVICE_GET_REGION_IO_FDS,
            &spare(io.as_bytes(), 48),
            0
        ),
        Ok(format!(
            "{:?}",
            Request::DeviceGetRegionIoFds {
                argsz: 64,
                index: 0
            }
        ))
    );
    let map = DmaMap {
        argsz: 32,
        flags: 3,
        offset: 0,
        address: 0x1000,
        size: 0x1000,
    };
    assert_eq!(
        decode(VFIO_USER_DMA_MAP, &spare(map.as_bytes(), 8), 1),
        Ok(format!("{:?}", Request::DmaMap(map)))
    );
    let unmap = DmaUnmap {
        argsz: 24,
        flags: 0,
        address: 0x1000,
        size: 0x1000,
    };
    assert_eq!(
        decode(VFIO_USER_DMA_UNMAP, &spare(unmap.as_bytes(), 16), 0),
        Ok(format!(
            "{:?}",
            Request::DmaUnmap {
                unmap,
                bitmap: None
            }
        ))
    );
    let all = DmaUnmap {
        flags: VFIO_DMA_UNMAP_FLAG_ALL,
        address: 0,
        size: 0,
        ..unmap
    };
    decode(VFIO_USER_DMA_UNMAP, &spare(all.as_bytes(), 8), 0).expect("unmap all");
    let dirty = DmaUnmap {
        argsz: 24 + 16 + 8,
        flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
        ..unmap
    };
    let bh = BitmapHeader {
        pgsize: 4096,
        size: 8,
    };
    // QEMU-style: the bitmap buffer travels with the request.
    decode(
        VFIO_USER_DMA_UNMAP,
        &spare(&cat(&[dirty.as_bytes(), bh.as_bytes()]), 8),
        0,
    )
    .expect("dirty-bitmap unmap with its buffer");
    let set = |flags: u32| IrqSet {
        argsz: 20,
        flags,
        index: 2,
        start: 0,
        count: 1,
    };
    let ev = set(VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER);
    decode(VFIO_USER_DEVICE_SET_IRQS, &spare(ev.as_bytes(), 4), 1).expect("eventfd + spare");
    let none = set(VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_UNMASK);
    decode(VFIO_USER_DEVICE_SET_IRQS, &spare(none.as_bytes(), 4), 0).expect("none + spare");
    let ra = RegionAccess {
        offset: 0,
        region: 0,
        count: 4,
    };
    decode(VFIO_USER_REGION_READ, &spare(ra.as_bytes(), 4), 0).expect("region read");
    decode(VFIO_USER_DEVICE_RESET, &[0; 8], 0).expect("reset with a payload");
    let md = MigData {
        argsz: 8 + 16,
        size: 16,
    };
    decode(VFIO_USER_MIG_DATA_READ, &spare(md.as_bytes(), 16), 0).expect("mig data read");
    let w = MigData { argsz: 11, size: 3 };
    assert_eq!(
        decode(
            VFIO_USER_MIG_DATA_WRITE,
            &cat(&[w.as_bytes(), &[1, 2, 3, 9, 9]]),
            0
        ),
        Ok(format!(
            "{:?}",
            Request::MigDataWrite {
                argsz: 11,
                data: &[1, 2, 3]
            }
        )),
        "only `size` bytes are migration data"
    );
    let get = VFIO_DEVICE_FEATURE_GET;
    let fset = VFIO_DEVICE_FEATURE_SET;
    let state = u32::from(VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE);
    let st = MigDeviceState {
        device_state: 1,
        data_fd: 0,
    };
    assert_eq!(
        decode(
            VFIO_USER_DEVICE_FEATURE,
            &feat(24, fset | state, &spare(st.as_bytes(), 8)),
            0
        ),
        Ok(format!(
            "{:?}",
            Request::DeviceFeature(DeviceFeatureRequest {
                argsz: 24,
                op: FeatureRequest::SetMigDeviceState(st)
            })
        ))
    );
    decode(VFIO_USER_DEVICE_FEATURE, &feat(16, get | state, &[0; 8]), 0)
        .expect("GET with its buffer");
    let ctl = DmaLoggingControlHeader {
        page_size: 4096,
        num_ranges: 1,
        reserved: 0,
    };
    let r = DmaLoggingRange {
        iova: 0,
        length: 1 << 20,
    };
    let start = u32::from(VFIO_DEVICE_FEATURE_DMA_LOGGING_START);
    decode(
        VFIO_USER_DEVICE_FEATURE,
        &feat(
            48,
            fset | start,
            &spare(&cat(&[ctl.as_bytes(), r.as_bytes()]), 8),
        ),
        0,
    )
    .expect("logging start + spare");

    // Still refused: a fixed part one byte short, sizes the payload announces but lacks,
    // argsz smaller than the fixed struct.
    let short = |fixed: &[u8]| fixed[..fixed.len() - 1].to_vec();
    for (c, body) in [
        (VFIO_USER_DEVICE_GET_REGION_INFO, short(ri.as_bytes())),
        (VFIO_USER_DEVICE_GET_INFO, short(di.as_bytes())),
        (VFIO_USER_DEVICE_GET_IRQ_INFO, short(ii.as_bytes())),
        (VFIO_USER_DEVICE_GET_REGION_IO_FDS, short(io.as_bytes())),
        (VFIO_USER_DMA_MAP, short(map.as_bytes())),
        (VFIO_USER_DMA_UNMAP, short(unmap.as_bytes())),
        (
            VFIO_USER_DMA_UNMAP,
            cat(&[dirty.as_bytes(), &bh.as_bytes()[..15]]),
        ),
        (VFIO_USER_DEVICE_SET_IRQS, short(none.as_bytes())),
        (VFIO_USER_REGION_READ, short(ra.as_bytes())),
        (VFIO_USER_MIG_DATA_READ, short(md.as_bytes())),
        (VFIO_USER_MIG_DATA_WRITE, cat(&[w.as_bytes(), &[1, 2]])),
        (
            VFIO_USER_DEVICE_FEATURE,
            feat(16, fset | state, &short(st.as_bytes())),
        ),
        (
            VFIO_USER_DEVICE_FEATURE,
            feat(40, fset | start, ctl.as_bytes()),
        ),
        (
            VFIO_USER_REGION_WRITE,
            cat(&[ra.as_bytes(), &[1, 2, 3, 4, 5]]),
        ),
    ] {
        assert_eq!(decode(c, &body, 0), Err(EINVAL), "cmd {c}: {body:?}");
    }
    let lying = RegionInfo { argsz: 31, ..ri };
    assert_eq!(
        decode(
            VFIO_USER_DEVICE_GET_REGION_INFO,
            &spare(lying.as_bytes(), 32),
            0
        ),
        Err(EINVAL),
        "argsz below the fixed struct"
    );
    let bools = set(VFIO_IRQ_SET_DATA_BOOL | VFIO_IRQ_SET_ACTION_TRIGGER);
    assert_eq!(
        decode(VFIO_USER_DEVICE_SET_IRQS, &spare(bools.as_bytes(), 2), 0),
        Err(EINVAL),
        "bools must equal count"
    );
}
