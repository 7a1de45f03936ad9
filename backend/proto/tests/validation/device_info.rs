//! DEVICE_GET_INFO, DEVICE_GET_REGION_INFO, DEVICE_GET_REGION_IO_FDS and
//! DEVICE_GET_IRQ_INFO requests.

use super::*;

#[test]
fn info_requests() {
    req_ok(
        VFIO_USER_DEVICE_GET_INFO,
        DeviceInfo {
            argsz: 16,
            ..Default::default()
        }
        .as_bytes(),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_GET_INFO,
            DeviceInfo {
                argsz: 8,
                ..Default::default()
            }
            .as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DEVICE_GET_INFO, &[16, 0, 0, 0], 0).errno(),
        EINVAL
    );
    req_ok(
        VFIO_USER_DEVICE_GET_REGION_INFO,
        RegionInfo {
            argsz: 32,
            index: 7,
            ..Default::default()
        }
        .as_bytes(),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_GET_REGION_INFO,
            RegionInfo {
                argsz: 16,
                ..Default::default()
            }
            .as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    req_ok(
        VFIO_USER_DEVICE_GET_REGION_IO_FDS,
        RegionIoFds {
            argsz: 16,
            flags: 0,
            index: 0,
            count: 0,
        }
        .as_bytes(),
        0,
    );
    assert!(matches!(
        decode_request(&cmd(VFIO_USER_DEVICE_GET_REGION_IO_FDS, 0, &[]).0, &[], 0),
        Err(ProtoError::Truncated { .. })
    ));
    let (h, b) = cmd(
        VFIO_USER_DEVICE_GET_REGION_IO_FDS,
        0,
        RegionIoFds {
            argsz: 16,
            flags: 1,
            index: 0,
            count: 0,
        }
        .as_bytes(),
    );
    assert!(matches!(
        decode_request(&h, &b, 0),
        Err(ProtoError::BadFlags { flags: 1, .. })
    ));
    let (h, b) = cmd(
        VFIO_USER_DEVICE_GET_REGION_IO_FDS,
        0,
        RegionIoFds {
            argsz: 16,
            flags: 0,
            index: 0,
            count: 1,
        }
        .as_bytes(),
    );
    assert!(matches!(
        decode_request(&h, &b, 0),
        Err(ProtoError::Invalid { .. })
    ));
    req_ok(
        VFIO_USER_DEVICE_GET_IRQ_INFO,
        IrqInfo {
            argsz: 16,
            index: 2,
            ..Default::default()
        }
        .as_bytes(),
        0,
    );
}
