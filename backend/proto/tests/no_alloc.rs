//! The hot paths do not allocate once their buffers are warm: a counting
//! global allocator checks decoding REGION_READ/REGION_WRITE and building
//! their replies, [`MessageWriter`] and error replies.
#![forbid(unsafe_code)]

use std::hint::black_box;

use switchyard_proto::consts::*;
use switchyard_proto::errno::EIO;
use switchyard_proto::*;
use switchyard_sys::alloc_count::{CountingAlloc, allocations};

/// Counts the allocations of the threads that ask ([`allocations`]); `switchyard-sys` holds
/// it, the crate of the workspace's unsafe code (a `GlobalAlloc` is an `unsafe impl`).
#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

fn split(msg: &[u8]) -> (Header, &[u8]) {
    let h = Header::from_bytes(msg).expect("header");
    (h, msg.get(Header::SIZE..).expect("body"))
}

#[test]
fn hot_paths_do_not_allocate() {
    // Inputs are built before counting starts.
    let mut read_req = Vec::new();
    Request::RegionRead {
        offset: 0x10,
        region: 2,
        count: 4,
    }
    .encode(1, false, &mut read_req)
    .expect("encode");
    let mut write_req = Vec::new();
    Request::RegionWrite {
        offset: 0x20,
        region: 0,
        data: &[1, 2, 3, 4, 5, 6, 7, 8],
    }
    .encode(2, false, &mut write_req)
    .expect("encode");
    let limits = Limits::server(1 << 20);
    let mut out = Vec::new();

    let mut run = || {
        let (h, body) = split(&read_req);
        let req = decode_request_with(&h, body, 0, &limits).expect("REGION_READ");
        assert!(matches!(req, Request::RegionRead { count: 4, .. }));
        black_box(req);

        let (h, body) = split(&write_req);
        let req = decode_request_with(&h, body, 0, &limits).expect("REGION_WRITE");
        assert!(matches!(req, Request::RegionWrite { data, .. } if data.len() == 8));
        black_box(req);

        let data = region_read_reply_buffer(&mut out, 1, 0x10, 2, 4).expect("read reply");
        data.copy_from_slice(&[9, 8, 7, 6]);
        black_box(&out);

        encode_region_write_reply(&mut out, 2, 0x20, 0, 8).expect("write reply");
        black_box(&out);

        let mut w = MessageWriter::reply(&mut out, 3, VFIO_USER_REGION_WRITE);
        w.put(&RegionAccess {
            offset: 1,
            region: 2,
            count: 3,
        });
        w.put_bytes(&[0; 8]);
        assert_eq!(w.finish(), Ok(40));
        black_box(&out);

        encode_error_reply(&mut out, 4, VFIO_USER_REGION_READ, EIO);
        black_box(&out);
    };

    // The counter works (so a zero below means something).
    assert_eq!(
        allocations(|| drop(black_box(Vec::<u8>::with_capacity(1)))),
        1
    );
    // Warm-up: `out` grows to its working size.
    run();
    assert_eq!(allocations(&mut run), 0, "steady-state hot paths allocated");
}
