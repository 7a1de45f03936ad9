//! MIG_DATA_READ and MIG_DATA_WRITE rules.

use super::*;

#[test]
fn mig_data_rules() {
    req_ok(
        VFIO_USER_MIG_DATA_READ,
        MigData {
            argsz: 8 + 100,
            size: 100,
        }
        .as_bytes(),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_MIG_DATA_READ,
            MigData {
                argsz: 8 + 99,
                size: 100
            }
            .as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_MIG_DATA_READ,
            MigData {
                argsz: u32::MAX,
                size: (1 << 20) + 1
            }
            .as_bytes(),
            0
        )
        .errno(),
        E2BIG
    );
    req_ok(
        VFIO_USER_MIG_DATA_WRITE,
        &cat(&[MigData { argsz: 11, size: 3 }.as_bytes(), &[1, 2, 3]]),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_MIG_DATA_WRITE,
            &cat(&[MigData { argsz: 11, size: 4 }.as_bytes(), &[1, 2, 3]]),
            0
        )
        .errno(),
        EINVAL
    );
}

/// GET_PRECOPY_INFO as the patched QEMU sends it (the whole `vfio_precopy_info`, byte counts
/// zero) and its reply, byte for byte.
#[test]
fn get_precopy_info_request_and_reply() {
    let asked = PrecopyInfo {
        argsz: 24,
        ..PrecopyInfo::default()
    };
    let (h, b) = cmd(VFIO_USER_GET_PRECOPY_INFO, 0, asked.as_bytes());
    assert_eq!(
        decode_request(&h, &b, 0),
        Ok(Request::GetPrecopyInfo { argsz: 24 })
    );
    let mut out = Vec::new();
    Request::GetPrecopyInfo { argsz: 24 }
        .encode(1, false, &mut out)
        .expect("encodes");
    assert_eq!(
        &out[16..],
        asked.as_bytes(),
        "the request is the whole struct"
    );
    assert_eq!(out.len(), 16 + 24);

    // Too short a body, too small an argsz, an fd, flags: refused.
    assert_eq!(
        req_err(VFIO_USER_GET_PRECOPY_INFO, &asked.as_bytes()[..8], 0).errno(),
        EINVAL
    );
    let small = PrecopyInfo { argsz: 23, ..asked };
    assert_eq!(
        req_err(VFIO_USER_GET_PRECOPY_INFO, small.as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_GET_PRECOPY_INFO, asked.as_bytes(), 1).errno(),
        EINVAL
    );
    let flagged = PrecopyInfo { flags: 1, ..asked };
    assert_eq!(
        req_err(VFIO_USER_GET_PRECOPY_INFO, flagged.as_bytes(), 0).errno(),
        EINVAL
    );

    // The reply: {argsz, flags, initial_bytes, dirty_bytes} at the offsets QEMU reads.
    let info = PrecopyInfo {
        argsz: 24,
        flags: 0,
        initial_bytes: 0x1122_3344_5566_7788,
        dirty_bytes: 4096,
    };
    Reply::GetPrecopyInfo(info)
        .encode(7, &mut out)
        .expect("encodes");
    assert_eq!(out.len(), 16 + 24);
    assert_eq!(&out[16..20], &24u32.to_le_bytes());
    assert_eq!(&out[20..24], &0u32.to_le_bytes());
    assert_eq!(&out[24..32], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(&out[32..40], &4096u64.to_le_bytes());
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(
        decode_reply(&h, &out[16..], 0),
        Ok(Reply::GetPrecopyInfo(info))
    );
    let (h, b) = cmd(
        VFIO_USER_GET_PRECOPY_INFO,
        VFIO_USER_F_TYPE_REPLY,
        &out[16..32],
    );
    assert!(decode_reply(&h, &b, 0).is_err(), "a short reply is refused");
}
