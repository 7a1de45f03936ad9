//! REGION_READ/REGION_WRITE, REGION_WRITE_MULTI, region capability chains.

use super::*;

#[test]
fn region_access_rules() {
    let a = |offset, count| RegionAccess {
        offset,
        region: 0,
        count,
    };
    req_ok(VFIO_USER_REGION_READ, a(0, 4).as_bytes(), 0);
    assert_eq!(
        req_err(VFIO_USER_REGION_READ, a(0, 0).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_REGION_READ, a(u64::MAX - 1, 4).as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_REGION_READ, a(0, (1 << 20) + 1).as_bytes(), 0).errno(),
        E2BIG
    );
    // Bytes after the access are ignored, as libvfio-user ignores them.
    req_ok(VFIO_USER_REGION_READ, &cat(&[a(0, 4).as_bytes(), &[0]]), 0);
    assert_eq!(
        req_err(VFIO_USER_REGION_READ, &a(0, 4).as_bytes()[..15], 0).errno(),
        EINVAL
    );
    let (h, b) = cmd(VFIO_USER_REGION_READ, 0, a(0, 8192).as_bytes());
    assert_eq!(
        decode_request_with(&h, &b, 0, &Limits::server(4096)).map_err(|e| e.errno()),
        Err(E2BIG)
    );
    req_ok(
        VFIO_USER_REGION_WRITE,
        &cat(&[a(0, 4).as_bytes(), &[1, 2, 3, 4]]),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_REGION_WRITE,
            &cat(&[a(0, 4).as_bytes(), &[1, 2, 3]]),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_REGION_WRITE,
            &cat(&[a(0, 2).as_bytes(), &[1, 2, 3]]),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_REGION_WRITE,
            &cat(&[a(0, 4).as_bytes(), &[1, 2, 3, 4]]),
            1
        )
        .errno(),
        EINVAL
    );
    let (h, b) = cmd(
        VFIO_USER_REGION_WRITE,
        0,
        &cat(&[a(8, 4).as_bytes(), &[1, 2, 3, 4]]),
    );
    assert_eq!(
        decode_request(&h, &b, 0),
        Ok(Request::RegionWrite {
            offset: 8,
            region: 0,
            data: &[1, 2, 3, 4]
        })
    );
}

#[test]
fn write_multi_rules() {
    let e = |count| WriteMultiEntry {
        offset: 0,
        region: 0,
        count,
        data: [0; 8],
    };
    let msg = |n: u64, es: &[WriteMultiEntry]| cat(&[&n.to_ne_bytes(), es.as_bytes()]);
    req_ok(VFIO_USER_REGION_WRITE_MULTI, &msg(2, &[e(4), e(8)]), 0);
    assert_eq!(
        req_err(VFIO_USER_REGION_WRITE_MULTI, &msg(3, &[e(4), e(8)]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_REGION_WRITE_MULTI, &msg(1, &[e(4), e(8)]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_REGION_WRITE_MULTI, &msg(1, &[e(9)]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_REGION_WRITE_MULTI, &msg(1, &[e(0)]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_REGION_WRITE_MULTI, &msg(0, &[]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_REGION_WRITE_MULTI, &msg(u64::MAX, &[e(1)]), 0).errno(),
        EINVAL
    );
    let many: Vec<_> = (0..201).map(|_| e(1)).collect();
    assert_eq!(
        req_err(VFIO_USER_REGION_WRITE_MULTI, &msg(201, &many), 0).errno(),
        EINVAL
    );
    let entry = WriteMultiEntry {
        offset: 0,
        region: 0,
        count: 3,
        data: [1, 2, 3, 4, 5, 6, 7, 8],
    };
    assert_eq!(entry.bytes(), &[1, 2, 3]);
}

#[test]
fn region_caps_chain() {
    let mut caps = Vec::new();
    let areas = [
        SparseMmapArea {
            offset: 0,
            size: 0x1000,
        },
        SparseMmapArea {
            offset: 0x3000,
            size: 0x1000,
        },
    ];
    let mut b = RegionCapsBuilder::new(&mut caps);
    b.sparse_mmap(&areas).expect("sparse");
    b.region_type(3, 1).expect("type");
    b.msix_mappable().expect("msix");
    let mut info = RegionInfo {
        index: 0,
        size: 0x4000,
        flags: 7,
        ..Default::default()
    };
    assert!(b.finish_info(&mut info, 1024).expect("finish"));
    assert_eq!(info.cap_offset, 32);
    assert_eq!(info.argsz as usize, 32 + caps.len());
    let mut out = Vec::new();
    Reply::DeviceGetRegionInfo { info, caps: &caps }
        .encode(5, &mut out)
        .expect("encode");
    let h = Header::from_bytes(&out).expect("header");
    let Ok(Reply::DeviceGetRegionInfo { info: i2, caps: c2 }) = decode_reply(&h, &out[16..], 1)
    else {
        panic!("decode");
    };
    let all: Vec<_> = region_caps(&i2, c2)
        .collect::<Result<_, _>>()
        .expect("caps");
    assert_eq!(all.len(), 3);
    let got: Vec<_> = all[0]
        .sparse_mmap_areas()
        .expect("ok")
        .expect("sparse")
        .iter()
        .collect();
    assert_eq!(got, areas);
    assert_eq!(
        all[1].region_type(),
        Ok(Some(RegionTypeCap {
            kind: 3,
            subtype: 1
        }))
    );
    assert_eq!(all[2].header.id, VFIO_REGION_INFO_CAP_MSIX_MAPPABLE);
    // Too-small argsz: no caps, argsz says what is needed.
    let mut small = RegionInfo {
        flags: 7,
        ..Default::default()
    };
    assert!(!b_fits(&areas, &mut small, 32));
    assert_eq!(small.cap_offset, 0);
    assert!(small.argsz > 32);
    // A loop (the first capability's next pointing at itself, offset 32)
    // is rejected: next must lie past the current capability's header.
    let mut looped = caps.clone();
    looped[4..8].copy_from_slice(&32u32.to_ne_bytes());
    let h = Header::reply(5, VFIO_USER_DEVICE_GET_REGION_INFO, 32 + looped.len()).expect("header");
    let body = cat(&[info.as_bytes(), &looped]);
    assert!(matches!(
        decode_reply(&h, &body, 0),
        Err(ProtoError::Invalid {
            reason: "next overlaps the current capability",
            ..
        })
    ));
    // nr_areas larger than the cap body is rejected.
    let mut big = caps.clone();
    big[8..12].copy_from_slice(&1000u32.to_ne_bytes());
    let body = cat(&[info.as_bytes(), &big]);
    assert!(matches!(
        decode_reply(&h, &body, 0),
        Err(ProtoError::Truncated {
            what: "sparse mmap areas",
            ..
        })
    ));
}

fn b_fits(areas: &[SparseMmapArea], info: &mut RegionInfo, argsz: u32) -> bool {
    let mut caps = Vec::new();
    let mut b = RegionCapsBuilder::new(&mut caps);
    b.sparse_mmap(areas).expect("sparse");
    b.finish_info(info, argsz).expect("finish")
}
