//! Targeted validation tests: layouts, each rejection rule and its errno,
//! capabilities parsing and negotiation.
//!
//! One module per command family; the helpers shared between them live here.
#![forbid(unsafe_code)]

mod device_info;
mod dma;
mod features;
mod framing;
mod irqs;
mod larger_payloads;
mod migration;
mod region;
mod replies;
mod version;
mod writer;

use switchyard_proto::consts::*;
use switchyard_proto::errno::*;
use switchyard_proto::*;
use zerocopy::IntoBytes;

/// Builds a command message with raw body bytes.
fn cmd(cmd: u16, flags: u32, body: &[u8]) -> (Header, Vec<u8>) {
    let h = Header {
        msg_id: 1,
        cmd,
        msg_size: (16 + body.len()) as u32,
        flags,
        error_no: 0,
    };
    (h, body.to_vec())
}

fn req_err(c: u16, body: &[u8], nfds: usize) -> ProtoError {
    let (h, b) = cmd(c, 0, body);
    decode_request(&h, &b, nfds).expect_err("must be rejected")
}

fn req_ok(c: u16, body: &[u8], nfds: usize) {
    let (h, b) = cmd(c, 0, body);
    if let Err(e) = decode_request(&h, &b, nfds) {
        panic!("unexpected error {e:?}");
    }
}

fn cat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

fn feat(argsz: u32, flags: u32, data: &[u8]) -> Vec<u8> {
    cat(&[DeviceFeatureHeader { argsz, flags }.as_bytes(), data])
}
