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
