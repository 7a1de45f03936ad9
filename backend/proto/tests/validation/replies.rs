//! Replies that differ from the request side or between implementations.

use super::*;

#[test]
fn reply_discrepancies() {
    // DMA_WRITE reply with a 4-byte count (QEMU upstream).
    let body = cat(&[&0x1000u64.to_ne_bytes(), &8u32.to_ne_bytes()]);
    let h = Header::reply(1, VFIO_USER_DMA_WRITE, body.len()).expect("header");
    assert_eq!(
        decode_reply(&h, &body, 0),
        Ok(Reply::DmaWrite {
            address: 0x1000,
            count: 8
        })
    );
    // MIG_DATA_WRITE reply with and without payload.
    let h = Header::reply(1, VFIO_USER_MIG_DATA_WRITE, 0).expect("header");
    assert_eq!(decode_reply(&h, &[], 0), Ok(Reply::MigDataWrite(None)));
    let m = MigData { argsz: 8, size: 4 };
    let h = Header::reply(1, VFIO_USER_MIG_DATA_WRITE, 8).expect("header");
    assert_eq!(
        decode_reply(&h, m.as_bytes(), 0),
        Ok(Reply::MigDataWrite(Some(m)))
    );
    // IO fds: 48-byte entries, fd_index bounds.
    let e = IoFdShadowEntry {
        fd_index: 0,
        ..Default::default()
    };
    let body = cat(&[
        RegionIoFds {
            argsz: 64,
            flags: 0,
            index: 0,
            count: 1,
        }
        .as_bytes(),
        e.as_bytes(),
    ]);
    let h = Header::reply(1, VFIO_USER_DEVICE_GET_REGION_IO_FDS, body.len()).expect("header");
    assert!(matches!(
        decode_reply(&h, &body, 1),
        Ok(Reply::DeviceGetRegionIoFds {
            entries: IoFdEntries::LibvfioUser(_),
            ..
        })
    ));
    assert!(matches!(
        decode_reply(&h, &body, 0),
        Err(ProtoError::BadFdCount { got: 0, .. })
    ));
    // Error reply carries errno; 0 maps to EIO.
    let mut out = Vec::new();
    encode_error_reply(&mut out, 3, VFIO_USER_DMA_MAP, EEXIST);
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(decode_reply(&h, &[], 0).map_err(|e| e.errno()), Err(EEXIST));
    encode_error_reply(&mut out, 3, VFIO_USER_DMA_MAP, 0);
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(decode_reply(&h, &[], 0).map_err(|e| e.errno()), Err(EIO));
}
