//! DEVICE_SET_IRQS rules.

use super::*;

#[test]
fn set_irqs_rules() {
    let s = |flags, start, count| IrqSet {
        argsz: 20,
        flags,
        index: 2,
        start,
        count,
    };
    let ev_trig = VFIO_IRQ_SET_DATA_EVENTFD | VFIO_IRQ_SET_ACTION_TRIGGER;
    req_ok(VFIO_USER_DEVICE_SET_IRQS, s(ev_trig, 0, 3).as_bytes(), 3);
    req_ok(VFIO_USER_DEVICE_SET_IRQS, s(ev_trig, 0, 3).as_bytes(), 0);
    assert_eq!(
        req_err(VFIO_USER_DEVICE_SET_IRQS, s(ev_trig, 0, 3).as_bytes(), 2).errno(),
        EINVAL
    );
    // disable all
    req_ok(
        VFIO_USER_DEVICE_SET_IRQS,
        s(VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER, 0, 0).as_bytes(),
        0,
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_SET_IRQS,
            s(VFIO_IRQ_SET_DATA_NONE | VFIO_IRQ_SET_ACTION_TRIGGER, 1, 0).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DEVICE_SET_IRQS, s(ev_trig, 0, 0).as_bytes(), 0).errno(),
        EINVAL
    );
    // two actions / two data types / none
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_SET_IRQS,
            s(VFIO_IRQ_SET_DATA_NONE | 0x18, 0, 1).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_SET_IRQS,
            s(3 | VFIO_IRQ_SET_ACTION_MASK, 0, 1).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_SET_IRQS,
            s(VFIO_IRQ_SET_ACTION_MASK, 0, 1).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_SET_IRQS,
            s(0x40 | 0x21, 0, 1).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    // fds without DATA_EVENTFD (libvfio-user test_bad_request_closes_fds)
    let b = s(VFIO_IRQ_SET_DATA_BOOL | VFIO_IRQ_SET_ACTION_TRIGGER, 0, 1);
    assert_eq!(
        req_err(VFIO_USER_DEVICE_SET_IRQS, &cat(&[b.as_bytes(), &[1]]), 2).errno(),
        EINVAL
    );
    req_ok(VFIO_USER_DEVICE_SET_IRQS, &cat(&[b.as_bytes(), &[1]]), 0);
    // bool length != count
    assert_eq!(
        req_err(VFIO_USER_DEVICE_SET_IRQS, b.as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(
        req_err(VFIO_USER_DEVICE_SET_IRQS, &cat(&[b.as_bytes(), &[1, 1]]), 0).errno(),
        EINVAL
    );
    // start + count overflow
    assert_eq!(
        req_err(
            VFIO_USER_DEVICE_SET_IRQS,
            s(ev_trig, u32::MAX, 2).as_bytes(),
            0
        )
        .errno(),
        EINVAL
    );
    // argsz too small, no payload (libvfio-user test_no_payload)
    let mut small = s(ev_trig, 0, 1);
    small.argsz = 19;
    assert_eq!(
        req_err(VFIO_USER_DEVICE_SET_IRQS, small.as_bytes(), 0).errno(),
        EINVAL
    );
    assert_eq!(req_err(VFIO_USER_DEVICE_SET_IRQS, &[], 0).errno(), EINVAL);
}
