//! DEVICE_FEATURE rules.

use super::*;

#[test]
fn device_feature_rules() {
    let get = VFIO_DEVICE_FEATURE_GET;
    let set = VFIO_DEVICE_FEATURE_SET;
    let probe = VFIO_DEVICE_FEATURE_PROBE;
    let mig = u32::from(VFIO_DEVICE_FEATURE_MIGRATION);
    let state = u32::from(VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE);
    let start = u32::from(VFIO_DEVICE_FEATURE_DMA_LOGGING_START);
    let report = u32::from(VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT);
    req_ok(VFIO_USER_DEVICE_FEATURE, &feat(16, get | mig, &[]), 0);
    // QEMU-style: GET carries its output buffer.
    req_ok(VFIO_USER_DEVICE_FEATURE, &feat(16, get | mig, &[0; 8]), 0);
    assert_eq!(
        req_err(VFIO_USER_DEVICE_FEATURE, &feat(8, get | mig, &[]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DEVICE_FEATURE, &feat(16, set | mig, &[0; 8]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_FEATURE,
            &feat(16, get | set | state, &[0; 8]),
            0
        )
        .errno(),
        EINVAL
    );
    req_ok(
        VFIO_USER_DEVICE_FEATURE,
        &feat(8, get | set | probe | state, &[]),
        0,
    );
    assert_eq!(
        req_err(VFIO_USER_DEVICE_FEATURE, &feat(16, state, &[]), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_FEATURE,
            &feat(16, get | 1 << 19 | mig, &[]),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DEVICE_FEATURE, &feat(16, set | state, &[0; 4]), 0).errno(),
        EINVAL
    );
    let (h, b) = cmd(
        VFIO_USER_DEVICE_FEATURE,
        0,
        &feat(
            16,
            set | state,
            MigDeviceState {
                device_state: 1,
                data_fd: 0,
            }
            .as_bytes(),
        ),
    );
    assert_eq!(
        decode_request(&h, &b, 0),
        Ok(Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 16,
            op: FeatureRequest::SetMigDeviceState(MigDeviceState {
                device_state: 1,
                data_fd: 0
            })
        }))
    );
    // Logging start: ranges must match num_ranges.
    let ctl = DmaLoggingControlHeader {
        page_size: 4096,
        num_ranges: 1,
        reserved: 0,
    };
    let r = DmaLoggingRange {
        iova: 0,
        length: 1 << 20,
    };
    req_ok(
        VFIO_USER_DEVICE_FEATURE,
        &feat(40, set | start, &cat(&[ctl.as_bytes(), r.as_bytes()])),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_FEATURE,
            &feat(40, set | start, ctl.as_bytes()),
            0
        )
        .errno(),
        EINVAL
    );
    let bad = DmaLoggingControlHeader {
        page_size: 4095,
        ..ctl
    };
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_FEATURE,
            &feat(40, set | start, &cat(&[bad.as_bytes(), r.as_bytes()])),
            0
        )
        .errno(),
        EINVAL
    );
    let over = DmaLoggingRange {
        iova: u64::MAX,
        length: 2,
    };
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_FEATURE,
            &feat(40, set | start, &cat(&[ctl.as_bytes(), over.as_bytes()])),
            0
        )
        .errno(),
        EINVAL
    );
    // Report: argsz must hold the bitmap (1 MiB / 4 KiB = 32 bytes).
    let rep = DmaLoggingReport {
        iova: 0,
        length: 1 << 20,
        page_size: 4096,
    };
    req_ok(
        VFIO_USER_DEVICE_FEATURE,
        &feat(8 + 24 + 32, get | report, rep.as_bytes()),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_FEATURE,
            &feat(8 + 24, get | report, rep.as_bytes()),
            0
        )
        .errno(),
        EINVAL
    );
    let zero = DmaLoggingReport { length: 0, ..rep };
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_FEATURE,
            &feat(64, get | report, zero.as_bytes()),
            0
        )
        .errno(),
        EINVAL
    );
    // Unknown feature passes through.
    let (h, b) = cmd(VFIO_USER_DEVICE_FEATURE, 0, &feat(8, get | 11, &[9]));
    assert_eq!(
        decode_request(&h, &b, 0),
        Ok(Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 8,
            op: FeatureRequest::Other {
                flags: get | 11,
                data: &[9]
            }
        }))
    );
    assert_eq!(
        req_err(VFIO_USER_DEVICE_FEATURE, &[0; 4], 0).errno(),
        EINVAL
    );
}
