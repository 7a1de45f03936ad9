//! Malformed and hostile input: every bad request gets an error reply with a real errno and the
//! server keeps serving (the same connection where it can be framed, the next client otherwise).
#![forbid(unsafe_code)]

mod common;

use std::os::fd::AsFd;

use common::ServerProcess;
use common::raw::Raw;
use switchyard_softgpu::regs::MAGIC;

const MAGIC_VALUE: u32 = u32::from_le_bytes(*b"SYGP");

fn region_access(offset: u64, region: u32, count: u32) -> Vec<u8> {
    let mut b = offset.to_ne_bytes().to_vec();
    b.extend_from_slice(&region.to_ne_bytes());
    b.extend_from_slice(&count.to_ne_bytes());
    b
}

fn dma_map(flags: u32, offset: u64, iova: u64, size: u64) -> Vec<u8> {
    let mut b = 32u32.to_ne_bytes().to_vec();
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&offset.to_ne_bytes());
    b.extend_from_slice(&iova.to_ne_bytes());
    b.extend_from_slice(&size.to_ne_bytes());
    b
}

fn dma_unmap(flags: u32, iova: u64, size: u64) -> Vec<u8> {
    let mut b = 24u32.to_ne_bytes().to_vec();
    b.extend_from_slice(&flags.to_ne_bytes());
    b.extend_from_slice(&iova.to_ne_bytes());
    b.extend_from_slice(&size.to_ne_bytes());
    b
}

fn set_irqs(flags: u32, index: u32, start: u32, count: u32) -> Vec<u8> {
    let mut b = 20u32.to_ne_bytes().to_vec();
    for v in [flags, index, start, count] {
        b.extend_from_slice(&v.to_ne_bytes());
    }
    b
}

/// The server closed the connection: a read sees EOF. (`Raw::recv` returning `None` would also
/// cover a read timeout, i.e. a connection that is still open.)
fn assert_closed_by_server(r: &mut Raw) {
    let mut b = [0u8; 1];
    match std::io::Read::read(&mut r.s, &mut b) {
        Ok(0) => {}
        other => panic!("expected EOF from the server, got {other:?}"),
    }
}

#[test]
fn requests_before_version_and_bad_versions() {
    let server = ServerProcess::start("softgpu");
    let mut r = Raw::connect(&server.socket);
    r.expect_errno(9, &region_access(0, 0, 4), &[], libc::EINVAL);
    // Major 1 is refused.
    let mut v = 1u16.to_ne_bytes().to_vec();
    v.extend_from_slice(&0u16.to_ne_bytes());
    v.extend_from_slice(b"{}\0");
    r.expect_errno(1, &v, &[], libc::EINVAL);
    // Malformed JSON, missing NUL.
    let mut v = vec![0, 0, 0, 0];
    v.extend_from_slice(b"{\"capabilities\":");
    v.push(0);
    r.expect_errno(1, &v, &[], libc::EINVAL);
    let mut v = vec![0, 0, 0, 0];
    v.extend_from_slice(b"{}");
    r.expect_errno(1, &v, &[], libc::EINVAL);
    // A good version still works afterwards, and unknown keys are tolerated.
    let mut v = vec![0, 0, 0, 0];
    v.extend_from_slice(b"{\"capabilities\":{\"max_msg_fds\":8,\"frobnicate\":true}}\0");
    let (h, body) = r.call(1, 0, &v, &[]);
    assert!(!h.is_error());
    assert_eq!(&body[..4], &[0, 0, 0, 0], "reply version 0.0");
    assert_eq!(body.last(), Some(&0), "reply JSON is NUL-terminated");
    let json = std::str::from_utf8(&body[4..body.len() - 1]).expect("utf8");
    assert!(json.contains("\"capabilities\""), "{json}");
    assert_eq!(r.read_reg(MAGIC), MAGIC_VALUE);
    // A second VERSION on the same connection is refused.
    r.expect_errno(1, &v, &[], libc::EINVAL);
}

#[test]
fn bad_sizes_commands_offsets_and_fds_get_errnos() {
    let server = ServerProcess::start("softgpu");
    let mut r = Raw::negotiated(&server.socket);
    // Unknown command numbers and the removed DIRTY_PAGES.
    r.expect_errno(99, &[], &[], libc::EINVAL);
    r.expect_errno(14, &[], &[], libc::ENOTSUP);
    // Payload smaller than the command's fixed size; a larger one is accepted and the spare
    // bytes ignored, as libvfio-user does.
    r.expect_errno(9, &region_access(0, 0, 4)[..12], &[], libc::EINVAL);
    let mut long = region_access(0, 0, 4);
    long.extend_from_slice(&[0; 8]);
    let (h, b) = r.call(9, 0, &long, &[]);
    assert!(!h.is_error(), "{h:?}");
    assert_eq!(b[16..], MAGIC_VALUE.to_le_bytes());
    // REGION_WRITE whose count disagrees with the data.
    let mut w = region_access(0x2c, 0, 8);
    w.extend_from_slice(&[1, 2, 3, 4]);
    r.expect_errno(10, &w, &[], libc::EINVAL);
    // Out-of-range regions and offsets.
    r.expect_errno(9, &region_access(0, 42, 4), &[], libc::EINVAL);
    r.expect_errno(9, &region_access(0, 1, 4), &[], libc::EINVAL);
    r.expect_errno(9, &region_access(64 << 10, 0, 4), &[], libc::EINVAL);
    r.expect_errno(9, &region_access(u64::MAX - 1, 0, 4), &[], libc::EINVAL);
    r.expect_errno(9, &region_access(4094, 7, 4), &[], libc::EINVAL);
    // Larger than max_data_xfer_size.
    r.expect_errno(9, &region_access(0, 2, 2 << 20), &[], libc::E2BIG);
    // Region and IRQ info for indexes that do not exist.
    let mut ri = 32u32.to_ne_bytes().to_vec();
    ri.extend_from_slice(&[0; 4]);
    ri.extend_from_slice(&77u32.to_ne_bytes());
    ri.extend_from_slice(&[0; 20]);
    r.expect_errno(5, &ri, &[], libc::EINVAL);
    let mut ii = 16u32.to_ne_bytes().to_vec();
    ii.extend_from_slice(&[0; 4]);
    ii.extend_from_slice(&9u32.to_ne_bytes());
    ii.extend_from_slice(&[0; 4]);
    r.expect_errno(7, &ii, &[], libc::EINVAL);

    // Wrong fd counts: two fds with DMA_MAP, fds with a command that takes none, eventfd
    // count mismatch, vectors out of range.
    let mem = common::GuestMemory::new(1 << 20);
    let mem2 = common::GuestMemory::new(1 << 20);
    r.expect_errno(
        2,
        &dma_map(3, 0, 0x10000, 1 << 20),
        &[mem.file.as_fd(), mem2.file.as_fd()],
        libc::EINVAL,
    );
    r.expect_errno(
        9,
        &region_access(0, 0, 4),
        &[mem.file.as_fd()],
        libc::EINVAL,
    );
    let e1 = switchyard_device::irq::new_eventfd().expect("eventfd");
    r.expect_errno(8, &set_irqs(4 | 32, 2, 0, 2), &[e1.as_fd()], libc::EINVAL);
    r.expect_errno(
        8,
        &set_irqs(4 | 32, 2, 15, 2),
        &[e1.as_fd(), e1.as_fd()],
        libc::EINVAL,
    );
    r.expect_errno(8, &set_irqs(4 | 32, 9, 0, 1), &[e1.as_fd()], libc::EINVAL);
    // Two actions at once.
    r.expect_errno(8, &set_irqs(1 | 8 | 32, 2, 0, 1), &[], libc::EINVAL);

    // DMA: overlapping maps, unmaps of ranges never mapped, bad flags, unmap-all.
    let (h, _) = r.call(
        2,
        0,
        &dma_map(3, 0, 0x10_0000, 1 << 20),
        &[mem.file.as_fd()],
    );
    assert!(!h.is_error(), "first map");
    r.expect_errno(
        2,
        &dma_map(3, 0, 0x18_0000, 1 << 20),
        &[mem2.file.as_fd()],
        libc::EEXIST,
    );
    // Like type1 (and what QEMU with a vIOMMU expects): unmapping nothing succeeds.
    let (h, _) = r.call(3, 0, &dma_unmap(0, 0x80_0000, 0x1000), &[]);
    assert!(!h.is_error(), "unmap of a range never mapped: {h:?}");
    r.expect_errno(3, &dma_unmap(0, 0x10_0000, 0x1000), &[], libc::EINVAL);
    r.expect_errno(3, &dma_unmap(2, 0x10_0000, 0x1000), &[], libc::EINVAL);
    r.expect_errno(
        2,
        &dma_map(3 | 0x100, 0, 0x40_0000, 1 << 20),
        &[],
        libc::EINVAL,
    );
    let (h, _) = r.call(3, 0, &dma_unmap(2, 0, 0), &[]);
    assert!(!h.is_error(), "unmap all");
    let (h, _) = r.call(
        2,
        0,
        &dma_map(3, 0, 0x18_0000, 1 << 20),
        &[mem2.file.as_fd()],
    );
    assert!(!h.is_error(), "the range is free again after unmap-all");
    // A file that cannot be mmapped.
    let (rd, _wr) = rustix::pipe::pipe().expect("pipe");
    let (h, _) = r.call(2, 0, &dma_map(3, 0, 0x100_0000, 1 << 20), &[rd.as_fd()]);
    assert!(
        h.is_error() && h.error_no != 0,
        "mmap of a pipe fails with an errno"
    );

    // DEVICE_FEATURE: bad flags, features we do not have, malformed DMA logging requests.
    let feature = |argsz: u32, flags: u32, data: &[u64]| {
        let mut b = argsz.to_ne_bytes().to_vec();
        b.extend_from_slice(&flags.to_ne_bytes());
        for v in data {
            b.extend_from_slice(&v.to_ne_bytes());
        }
        b
    };
    const GET: u32 = 1 << 16;
    const SET: u32 = 1 << 17;
    r.expect_errno(16, &feature(8, 6 | GET | SET, &[]), &[], libc::EINVAL);
    r.expect_errno(16, &feature(8, 6 | 1 << 20, &[]), &[], libc::EINVAL);
    r.expect_errno(16, &feature(16, 11 | GET, &[0]), &[], libc::ENOTTY);
    // Migration: an unknown state and ERROR cannot be requested (the softgpu offers the P2P
    // states: RUNNING_P2P and back to RUNNING are taken); MIG_DATA outside the states that
    // carry data; a read larger than max_data_xfer_size.
    r.expect_errno(16, &feature(16, 2 | SET, &[99]), &[], libc::EINVAL);
    r.expect_errno(16, &feature(16, 2 | SET, &[0]), &[], libc::EINVAL);
    for state in [5u64, 2] {
        let (h, _) = r.call(16, 0, &feature(16, 2 | SET, &[state]), &[]);
        assert!(!h.is_error(), "state {state}: {h:?}");
    }
    r.expect_errno(16, &feature(16, 1 | SET, &[0]), &[], libc::EINVAL);
    let mig = |argsz: u32, size: u32| {
        let mut b = argsz.to_ne_bytes().to_vec();
        b.extend_from_slice(&size.to_ne_bytes());
        b
    };
    r.expect_errno(17, &mig(8 + 64, 64), &[], libc::EINVAL);
    r.expect_errno(18, &[mig(8 + 4, 4), vec![0; 4]].concat(), &[], libc::EINVAL);
    let (h, _) = r.call(16, 0, &feature(16, 2 | SET, &[3]), &[]);
    assert!(!h.is_error(), "RUNNING -> STOP_COPY");
    r.expect_errno(17, &mig(8 + (2 << 20), 2 << 20), &[], libc::E2BIG);
    r.expect_errno(18, &[mig(8 + 4, 4), vec![0; 4]].concat(), &[], libc::EINVAL);
    let (h, _) = r.call(16, 0, &feature(16, 2 | SET, &[6]), &[]);
    assert!(
        h.is_error() && h.error_no == libc::EINVAL as u32,
        "STOP_COPY -> PRE_COPY"
    );
    let (h, _) = r.call(16, 0, &feature(16, 2 | SET, &[2]), &[]);
    assert!(!h.is_error(), "back to RUNNING");
    // START: page size not a power of two; a range that wraps.
    r.expect_errno(16, &feature(24, 6 | SET, &[3, 0]), &[], libc::EINVAL);
    r.expect_errno(
        16,
        &feature(40, 6 | SET, &[4096, 1, u64::MAX, 2]),
        &[],
        libc::EINVAL,
    );
    // REPORT: before START, then argsz without room for the bitmap, a zero length, a page
    // size that is not a power of two, a range that wraps.
    r.expect_errno(
        16,
        &feature(40, 8 | GET, &[0x10_0000, 1 << 20, 4096]),
        &[],
        libc::EINVAL,
    );
    let (h, _) = r.call(16, 0, &feature(24, 6 | SET, &[4096, 0]), &[]);
    assert!(!h.is_error(), "start");
    r.expect_errno(
        16,
        &feature(32 + 31, 8 | GET, &[0x10_0000, 1 << 20, 4096]),
        &[],
        libc::EINVAL,
    );
    r.expect_errno(
        16,
        &feature(40, 8 | GET, &[0x10_0000, 0, 4096]),
        &[],
        libc::EINVAL,
    );
    r.expect_errno(
        16,
        &feature(64, 8 | GET, &[0x10_0000, 1 << 20, 4095]),
        &[],
        libc::EINVAL,
    );
    r.expect_errno(
        16,
        &feature(64, 8 | GET, &[u64::MAX, 2, 4096]),
        &[],
        libc::EINVAL,
    );
    // A bitmap larger than argsz can describe; one argsz allows but no message can carry.
    r.expect_errno(
        16,
        &feature(u32::MAX, 8 | GET, &[0, 1 << 60, 4096]),
        &[],
        libc::EINVAL,
    );
    r.expect_errno(
        16,
        &feature(32 + (1 << 27), 8 | GET, &[0, 1 << 42, 4096]),
        &[],
        libc::E2BIG,
    );
    let (h, body) = r.call(
        16,
        0,
        &feature(32 + 32, 8 | GET, &[0x10_0000, 1 << 20, 4096]),
        &[],
    );
    assert!(!h.is_error(), "a good report after the bad ones");
    assert_eq!(
        body.len(),
        8 + 24 + 32,
        "header, report and a 256-page bitmap"
    );

    // Posted write (No_reply): no reply comes back; the next request is answered normally.
    let mut pw = region_access(0x2c, 0, 4);
    pw.extend_from_slice(&0x77u32.to_le_bytes());
    let hdr = switchyard_proto::Header {
        msg_id: 500,
        cmd: 10,
        msg_size: 16 + pw.len() as u32,
        flags: 0x10,
        error_no: 0,
    };
    let mut m = zerocopy::IntoBytes::as_bytes(&hdr).to_vec();
    m.extend_from_slice(&pw);
    r.send(&m, &[]);
    assert_eq!(r.read_reg(0x2c), 0x77);
    assert_eq!(
        r.read_reg(MAGIC),
        MAGIC_VALUE,
        "still serving on the same connection"
    );
}

#[test]
fn unframeable_and_truncated_messages_do_not_kill_the_server() {
    let mut server = ServerProcess::start("softgpu");
    // Truncated header, then EOF.
    {
        let mut r = Raw::connect(&server.socket);
        r.send(&[1, 0, 9, 0, 0xff], &[]);
    }
    // A size field larger than what follows, then EOF.
    {
        let mut r = Raw::negotiated(&server.socket);
        let hdr = switchyard_proto::Header {
            msg_id: 1,
            cmd: 9,
            msg_size: 16 + 64,
            flags: 0,
            error_no: 0,
        };
        let mut m = zerocopy::IntoBytes::as_bytes(&hdr).to_vec();
        m.extend_from_slice(&[0; 10]);
        r.send(&m, &[]);
    }
    // msg_size smaller than a header: error reply, then the connection is closed.
    {
        let mut r = Raw::negotiated(&server.socket);
        let hdr = switchyard_proto::Header {
            msg_id: 7,
            cmd: 9,
            msg_size: 8,
            flags: 0,
            error_no: 0,
        };
        r.send(zerocopy::IntoBytes::as_bytes(&hdr), &[]);
        let (h, _) = r.recv().expect("error reply before close");
        assert!(h.is_error() && h.error_no as i32 == libc::EINVAL);
        assert_eq!(h.msg_id, 7);
        assert_closed_by_server(&mut r);
    }
    // An absurd size: error reply, connection closed.
    {
        let mut r = Raw::negotiated(&server.socket);
        let hdr = switchyard_proto::Header {
            msg_id: 8,
            cmd: 10,
            msg_size: u32::MAX,
            flags: 0,
            error_no: 0,
        };
        r.send(zerocopy::IntoBytes::as_bytes(&hdr), &[]);
        let (h, _) = r.recv().expect("error reply before close");
        assert!(h.is_error() && h.error_no as i32 == libc::EINVAL, "{h:?}");
        assert_eq!(h.msg_id, 8);
        assert_closed_by_server(&mut r);
    }
    // Random garbage.
    {
        let mut r = Raw::negotiated(&server.socket);
        let junk: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        let _ = std::io::Write::write_all(&mut r.s, &junk);
        while r.recv().is_some() {}
    }
    assert!(server.alive(), "server survived");
    let mut r = common::wait_for(std::time::Duration::from_secs(10), || {
        std::panic::catch_unwind(|| Raw::negotiated(&server.socket)).ok()
    })
    .expect("serves the next client");
    assert_eq!(r.read_reg(MAGIC), MAGIC_VALUE);
}

#[test]
fn sigterm_removes_the_socket_and_exits_zero() {
    let mut server = ServerProcess::start("softgpu");
    let r = Raw::negotiated(&server.socket);
    let status = server.terminate();
    assert!(status.success(), "exit status {status:?}");
    assert!(!server.socket.exists(), "socket removed");
    drop(r);
}
