//! Requests whose payload is larger than the command's fixed struct, as kernel-style clients
//! send them (the whole `argsz` buffer): accepted like libvfio-user accepts them.
#![forbid(unsafe_code)]

mod common;

use common::ServerProcess;
use common::raw::Raw;
use switchyard_proto::consts::*;

fn words(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|w| w.to_ne_bytes()).collect()
}

#[test]
fn region_info_with_room_for_capabilities_in_the_request() {
    let server = ServerProcess::start("softgpu");
    let mut r = Raw::negotiated(&server.socket);
    // libvfio-user's client: first call argsz 32 learns the size with caps, the second sends
    // argsz = that size with a payload of that size.
    let (h, first) = r.call(5, 0, &words(&[32, 0, 2, 0, 0, 0, 0, 0]), &[]);
    assert!(!h.is_error(), "{h:?}");
    let full = u32::from_ne_bytes(first[..4].try_into().expect("argsz"));
    assert!(full > 32, "VRAM has a sparse-mmap capability: argsz {full}");
    let mut req = words(&[full, 0, 2, 0, 0, 0, 0, 0]);
    req.resize(full as usize, 0);
    let (h, body) = r.call(5, 0, &req, &[]);
    assert!(
        !h.is_error(),
        "argsz {full} with a {full}-byte payload: {h:?}"
    );
    assert_eq!(body.len(), full as usize, "info and capabilities");
    let flags = u32::from_ne_bytes(body[4..8].try_into().expect("flags"));
    assert_ne!(flags & VFIO_REGION_INFO_FLAG_CAPS, 0, "flags {flags:#x}");
    assert_ne!(flags & VFIO_REGION_INFO_FLAG_MMAP, 0, "flags {flags:#x}");
    // The other info requests, with spare room too.
    let (h, body) = r.call(4, 0, &words(&[32, 0, 0, 0, 0, 0, 0, 0]), &[]);
    assert!(!h.is_error() && body.len() == 16, "{h:?}");
    let (h, body) = r.call(7, 0, &words(&[24, 0, 2, 0, 0, 0]), &[]);
    assert!(!h.is_error(), "{h:?}");
    assert_eq!(body[12..16], 16u32.to_ne_bytes(), "16 MSI-X vectors");
    // Still refused: a fixed part that is too short, argsz below the fixed struct.
    r.expect_errno(5, &words(&[64, 0, 2, 0, 0, 0, 0])[..28], &[], libc::EINVAL);
    let mut lying = words(&[31, 0, 2, 0, 0, 0, 0, 0]);
    lying.resize(64, 0);
    r.expect_errno(5, &lying, &[], libc::EINVAL);
}
