//! Entry points for fuzzers.

use crate::caps::Capabilities;
use crate::header::{Direction, Header};
use crate::payload::{FeatureReply, FeatureRequest, region_caps};
use crate::reply::{Reply, decode_reply};
use crate::request::{Limits, Request, decode_request_with};

/// Feeds arbitrary bytes through header, request and reply decoding.
///
/// Layout: byte 0 is the fd count (low 2 bits) and limit selector, then a
/// 16-byte header, then the body. Successfully decoded messages are
/// re-encoded and decoded again; the result must be identical (this panics
/// otherwise, which is a bug the fuzzer should report).
pub fn decode_all(data: &[u8]) {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let nfds = usize::from(sel & 3);
    let Ok(hdr) = Header::from_bytes(rest) else {
        return;
    };
    let body = rest.get(Header::SIZE..).unwrap_or_default();
    // Make msg_size consistent half of the time so decoding goes deep.
    let mut hdr2 = hdr;
    if sel & 4 != 0 {
        hdr2.msg_size = u32::try_from(body.len().saturating_add(Header::SIZE)).unwrap_or(u32::MAX);
    }
    let _ = hdr2.body_len();
    let limits = match (sel >> 3) & 3 {
        0 => Limits::default(),
        1 => Limits::server(4096),
        2 => Limits::client(1 << 20),
        _ => Limits {
            direction: Some(Direction::ClientToServer),
            ..Limits::default()
        },
    };

    // Requests: try as command (flip type bits so both decoders get a go).
    let mut req_hdr = hdr2;
    req_hdr.flags &= !0x21;
    check_request(&req_hdr, body, nfds, &limits);
    check_request(&hdr2, body, nfds, &limits);

    let mut rep_hdr = hdr2;
    rep_hdr.flags = (rep_hdr.flags & !0x1f) | 1;
    check_reply(&rep_hdr, body, nfds);
    check_reply(&hdr2, body, nfds);

    let _ = Capabilities::from_version_data(body);
}

fn check_request(hdr: &Header, body: &[u8], nfds: usize, limits: &Limits) {
    if let Ok(req) = decode_request_with(hdr, body, nfds, limits) {
        touch_request(&req);
        let mut out = Vec::new();
        if req.encode(hdr.msg_id, hdr.no_reply(), &mut out).is_ok() {
            let h2 = Header::from_bytes(&out).unwrap_or_default();
            let b2 = out.get(Header::SIZE..).unwrap_or_default();
            let again = decode_request_with(&h2, b2, nfds, limits);
            assert_eq!(again, Ok(req), "request round trip mismatch");
        }
    }
}

fn check_reply(hdr: &Header, body: &[u8], nfds: usize) {
    if let Ok(rep) = decode_reply(hdr, body, nfds) {
        touch_reply(&rep);
        let mut out = Vec::new();
        if rep.encode(hdr.msg_id, &mut out).is_ok() {
            let h2 = Header::from_bytes(&out).unwrap_or_default();
            let b2 = out.get(Header::SIZE..).unwrap_or_default();
            let again = decode_reply(&h2, b2, nfds);
            assert_eq!(again, Ok(rep), "reply round trip mismatch");
        }
    }
}

fn touch_request(req: &Request<'_>) {
    match req {
        Request::Version(v) => {
            let _ = v.capabilities();
        }
        Request::RegionWriteMulti(e) => {
            for x in e.iter() {
                let _ = x.bytes();
            }
        }
        Request::DeviceFeature(f) => {
            if let FeatureRequest::DmaLoggingStart(c) = f.op {
                let _ = c.ranges.iter().count();
            }
        }
        _ => {}
    }
}

fn touch_reply(rep: &Reply<'_>) {
    match rep {
        Reply::Version(v) => {
            let _ = v.capabilities();
        }
        Reply::DeviceGetRegionInfo { info, caps } => {
            for c in region_caps(info, caps).flatten() {
                let _ = c.sparse_mmap_areas().map(|a| a.map(|a| a.iter().count()));
                let _ = c.region_type();
            }
        }
        Reply::DeviceGetRegionIoFds { entries, .. } => {
            let _ = entries.fd_indexes().count();
        }
        Reply::DeviceFeature(f) => {
            if let FeatureReply::DmaLoggingStart(c) = f.op {
                let _ = c.ranges.iter().count();
            }
        }
        _ => {}
    }
}
