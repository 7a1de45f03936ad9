//! The message writer and the hot-path reply/request buffers.

use super::*;

#[test]
fn writer_and_hot_paths() {
    // Allocation-freedom of these paths is checked in tests/no_alloc.rs.
    let mut out = Vec::new();
    let buf = region_read_reply_buffer(&mut out, 9, 0x10, 2, 4).expect("buffer");
    buf.copy_from_slice(&[1, 2, 3, 4]);
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(h.msg_size as usize, out.len());
    assert_eq!(
        decode_reply(&h, &out[16..], 0),
        Ok(Reply::RegionRead {
            offset: 0x10,
            region: 2,
            data: &[1, 2, 3, 4]
        })
    );
    // MessageWriter patches msg_size.
    let mut w = MessageWriter::reply(&mut out, 1, VFIO_USER_REGION_WRITE);
    w.put(&RegionAccess {
        offset: 1,
        region: 2,
        count: 3,
    });
    assert_eq!(w.finish(), Ok(32));
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(h.msg_size, 32);
    assert_eq!(
        decode_reply(&h, &out[16..], 0),
        Ok(Reply::RegionWrite {
            offset: 1,
            region: 2,
            count: 3
        })
    );
    // MIG_DATA_READ truncation.
    let data = mig_data_read_reply_buffer(&mut out, 4, 100).expect("buffer");
    data[..3].copy_from_slice(&[7, 8, 9]);
    truncate_mig_data_read_reply(&mut out, 3).expect("truncate");
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(
        decode_reply(&h, &out[16..], 0),
        Ok(Reply::MigDataRead {
            argsz: 11,
            data: &[7, 8, 9]
        })
    );
    // Dirty bitmap unmap reply.
    let u = DmaUnmap {
        argsz: 72,
        flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
        address: 0,
        size: 1 << 20,
    };
    let bm = dma_unmap_bitmap_reply_buffer(&mut out, 2, &u, 4096).expect("buffer");
    assert_eq!(bm.len(), 32);
    bm[0] = 1;
    let h = Header::from_bytes(&out).expect("header");
    assert!(
        matches!(decode_reply(&h, &out[16..], 0), Ok(Reply::DmaUnmap { bitmap: Some(b), .. }) if b.data[0] == 1)
    );
    // DMA logging report reply: argsz covers the bitmap, the request is echoed.
    let r = DmaLoggingReport {
        iova: 0x10_0000,
        length: 130 << 12,
        page_size: 4096,
    };
    // The buffer's earlier bytes are reused, not zeroed (the server overwrites them all);
    // only growth is zero-filled.
    out.clear();
    out.resize(60, 0xee);
    let bm = dma_logging_report_reply_buffer(&mut out, 5, &r).expect("buffer");
    assert_eq!(bm.len(), 24, "130 pages need three words");
    assert_eq!(bm[..12], [0xee; 12], "reused bytes are left for the caller");
    assert_eq!(bm[12..], [0; 12], "growth is zero-filled");
    bm.fill(0);
    bm[16] = 2;
    let h = Header::from_bytes(&out).expect("header");
    match decode_reply(&h, &out[16..], 0) {
        Ok(Reply::DeviceFeature(f)) => {
            assert_eq!(f.argsz, 8 + 24 + 24);
            assert_eq!(
                f.op,
                FeatureReply::DmaLoggingReport {
                    report: r,
                    bitmap: &[
                        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0
                    ]
                }
            );
        }
        other => panic!("not a report reply: {other:?}"),
    }
    // Client side hot paths.
    let d = dma_read_reply_buffer(&mut out, 3, 0x2000, 2).expect("buffer");
    d.copy_from_slice(&[5, 6]);
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(
        decode_reply(&h, &out[16..], 0),
        Ok(Reply::DmaRead {
            address: 0x2000,
            data: &[5, 6]
        })
    );
    let w = region_write_request_buffer(&mut out, 4, true, 8, 1, 2).expect("buffer");
    w.copy_from_slice(&[1, 2]);
    let h = Header::from_bytes(&out).expect("header");
    assert!(h.no_reply());
    assert_eq!(
        decode_request(&h, &out[16..], 0),
        Ok(Request::RegionWrite {
            offset: 8,
            region: 1,
            data: &[1, 2]
        })
    );
    encode_region_write_reply(&mut out, 4, 8, 1, 2).expect("reply");
    let h = Header::from_bytes(&out).expect("header");
    assert_eq!(
        decode_reply(&h, &out[16..], 0),
        Ok(Reply::RegionWrite {
            offset: 8,
            region: 1,
            count: 2
        })
    );
}
