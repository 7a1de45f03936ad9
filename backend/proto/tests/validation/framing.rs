//! Layouts, command numbers, the header, errnos of errors and commands.

use super::*;

#[test]
fn wire_layouts() {
    assert_eq!(std::mem::size_of::<Header>(), 16);
    let h = Header {
        msg_id: 0x0102,
        cmd: 9,
        msg_size: 0x20,
        flags: 0x11,
        error_no: 0x33,
    };
    let b = h.as_bytes();
    assert_eq!(&b[0..2], &0x0102u16.to_ne_bytes());
    assert_eq!(&b[2..4], &9u16.to_ne_bytes());
    assert_eq!(&b[4..8], &0x20u32.to_ne_bytes());
    assert_eq!(&b[8..12], &0x11u32.to_ne_bytes());
    assert_eq!(&b[12..16], &0x33u32.to_ne_bytes());
    let m = DmaMap {
        argsz: 1,
        flags: 2,
        offset: 3,
        address: 4,
        size: 5,
    };
    let b = m.as_bytes();
    assert_eq!(b.len(), 32);
    assert_eq!(&b[8..16], &3u64.to_ne_bytes());
    assert_eq!(&b[16..24], &4u64.to_ne_bytes());
    assert_eq!(&b[24..32], &5u64.to_ne_bytes());
    let a = RegionAccess {
        offset: 7,
        region: 8,
        count: 9,
    };
    assert_eq!(&a.as_bytes()[8..12], &8u32.to_ne_bytes());
    assert_eq!(&a.as_bytes()[12..16], &9u32.to_ne_bytes());
    assert_eq!(WriteMultiEntry::SIZE, 24);
    assert_eq!(IoFdEntry::SIZE, 40);
    assert_eq!(IoFdShadowEntry::SIZE, 48);
    assert_eq!(IrqSet::SIZE, 20);
    assert_eq!(RegionInfo::SIZE, 32);
    assert_eq!(DmaUnmap::SIZE, 24);
    assert_eq!(DmaLoggingReport::SIZE, 24);
    let ri = RegionInfo {
        argsz: 1,
        flags: 2,
        index: 3,
        cap_offset: 4,
        size: 5,
        offset: 6,
    };
    assert_eq!(&ri.as_bytes()[12..16], &4u32.to_ne_bytes());
    assert_eq!(&ri.as_bytes()[24..32], &6u64.to_ne_bytes());
}

#[test]
fn command_numbers() {
    for (i, c) in Command::ALL.iter().enumerate() {
        assert_eq!(c.as_u16() as usize, i + 1);
        assert_eq!(Command::try_from(c.as_u16()), Ok(*c));
    }
    assert_eq!(Command::try_from(0), Err(ProtoError::UnknownCommand(0)));
    assert_eq!(Command::try_from(20), Err(ProtoError::UnknownCommand(20)));
    assert_eq!(Command::DmaRead.direction(), Direction::ServerToClient);
    assert_eq!(Command::RegionRead.direction(), Direction::ClientToServer);
}

#[test]
fn header_checks() {
    let h = |size| Header {
        msg_size: size,
        ..Header::default()
    };
    assert!(matches!(
        h(15).body_len(),
        Err(ProtoError::BadMsgSize { msg_size: 15, .. })
    ));
    assert_eq!(h(16).body_len(), Ok(0));
    assert_eq!(h(MAX_MSG_SIZE).body_len(), Ok(MAX_MSG_SIZE as usize - 16));
    assert_eq!(
        h(MAX_MSG_SIZE + 1).body_len().map_err(|e| e.errno()),
        Err(EINVAL)
    );
    // msg_size / body mismatch
    let (mut hd, b) = cmd(VFIO_USER_DEVICE_RESET, 0, &[]);
    hd.msg_size = 17;
    assert_eq!(
        decode_request(&hd, &b, 0).map_err(|e| e.errno()),
        Err(EINVAL)
    );
    // reply type on a request, unknown flags, error flag on a command
    for flags in [1, 2, 0x40, 0x20] {
        let (hd, b) = cmd(VFIO_USER_DEVICE_RESET, flags, &[]);
        assert_eq!(
            decode_request(&hd, &b, 0).map_err(|e| e.errno()),
            Err(EINVAL),
            "flags {flags:#x}"
        );
    }
    // No_reply is fine
    let (hd, b) = cmd(VFIO_USER_DEVICE_RESET, VFIO_USER_F_NO_REPLY, &[]);
    assert_eq!(decode_request(&hd, &b, 0), Ok(Request::DeviceReset));
    // A reply with No_reply is invalid.
    let rh = Header {
        msg_size: 16,
        flags: 0x11,
        cmd: 13,
        ..Header::default()
    };
    assert!(matches!(
        decode_reply(&rh, &[], 0),
        Err(ProtoError::BadHeaderFlags { flags: 0x11 })
    ));
    // A command decoded as a reply is invalid.
    let ch = Header {
        msg_size: 16,
        flags: 0,
        cmd: 13,
        ..Header::default()
    };
    assert!(matches!(
        decode_reply(&ch, &[], 0),
        Err(ProtoError::BadMessageType { flags: 0 })
    ));
}

#[test]
fn error_errnos() {
    assert_eq!(
        ProtoError::BadMsgSize {
            msg_size: 8,
            max: 16
        }
        .errno(),
        EINVAL
    );
    assert_eq!(ProtoError::UnknownCommand(99).errno(), EINVAL);
    assert_eq!(
        ProtoError::TransferTooLarge { count: 2, max: 1 }.errno(),
        E2BIG
    );
    assert_eq!(ProtoError::MessageTooLarge { size: 1 << 33 }.errno(), E2BIG);
    assert_eq!(
        ProtoError::UnsupportedCommand(Command::DirtyPages).errno(),
        ENOTSUP
    );
    let reply = |errno| ProtoError::ErrorReply { cmd: 2, errno }.errno();
    assert_eq!(reply(EEXIST as u32), EEXIST);
    assert_eq!(reply(4096), 4096);
    assert_eq!(reply(0), EIO);
    assert_eq!(reply(4097), EIO);
    assert_eq!(reply(u32::MAX), EIO);
}

#[test]
fn command_errnos() {
    assert_eq!(req_err(0, &[], 0).errno(), EINVAL);
    assert_eq!(req_err(20, &[], 0).errno(), EINVAL);
    assert_eq!(req_err(999, &[0, 0, 0, 0, 0], 0).errno(), EINVAL);
    assert_eq!(req_err(VFIO_USER_DIRTY_PAGES, &[0; 8], 0).errno(), ENOTSUP);
    // GET_PRECOPY_INFO is decoded now: an argsz of 0 is refused as too small.
    assert_eq!(
        req_err(VFIO_USER_GET_PRECOPY_INFO, &[0; 24], 0).errno(),
        EINVAL
    );
    // Direction
    let (h, b) = cmd(
        VFIO_USER_DMA_READ,
        0,
        DmaAccess {
            address: 0,
            count: 4,
        }
        .as_bytes(),
    );
    assert_eq!(
        decode_request_with(&h, &b, 0, &Limits::server(4096)).map_err(|e| e.errno()),
        Err(EINVAL)
    );
    assert!(decode_request_with(&h, &b, 0, &Limits::client(4096)).is_ok());
    let (h, b) = cmd(VFIO_USER_DEVICE_RESET, 0, &[]);
    assert_eq!(
        decode_request_with(&h, &b, 0, &Limits::client(4096)),
        Err(ProtoError::WrongDirection(Command::DeviceReset))
    );
    assert!(decode_request_with(&h, &b, 0, &Limits::server(4096)).is_ok());
    // Unsupported commands answer ENOTSUP whatever the direction limit.
    for c in [VFIO_USER_DIRTY_PAGES] {
        let (h, b) = cmd(c, 0, &[0; 8]);
        for limits in [Limits::server(4096), Limits::client(4096)] {
            assert_eq!(
                decode_request_with(&h, &b, 0, &limits).map_err(|e| e.errno()),
                Err(ENOTSUP),
                "cmd {c}"
            );
        }
    }
    // Reset with fds is refused; a payload is ignored (as libvfio-user does).
    req_ok(VFIO_USER_DEVICE_RESET, &[0], 0);
    assert_eq!(req_err(VFIO_USER_DEVICE_RESET, &[], 1).errno(), EINVAL);
}
