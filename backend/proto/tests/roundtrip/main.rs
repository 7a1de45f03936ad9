//! Property tests: decode(encode(x)) == x for every Request and Reply
//! variant, plus no-panic checks on random and mutated input.
//!
//! The owned mirrors live in `requests` and `replies`, the strategies for each command
//! family in their own module; the strategy helpers they share live here.
#![forbid(unsafe_code)]

mod dma;
mod features;
mod irqs;
mod region;
mod replies;
mod requests;
mod version;

use proptest::prelude::*;
use replies::reply;
use requests::request;
use switchyard_proto::consts::*;
use switchyard_proto::*;

/// An (address, size) pair with size ≥ 1 and no overflow.
fn range64(max_size: u64) -> impl Strategy<Value = (u64, u64)> {
    (1..=max_size).prop_flat_map(|size| (0..=u64::MAX - size, Just(size)))
}

fn argsz_at_least(min: u32) -> impl Strategy<Value = u32> {
    prop_oneof![Just(min), min..=u32::MAX]
}

fn pgsize() -> impl Strategy<Value = u64> {
    (12u32..=21).prop_map(|s| 1u64 << s)
}

fn split(buf: &[u8]) -> (Header, &[u8]) {
    let h = Header::from_bytes(buf).expect("header");
    (h, &buf[Header::SIZE..])
}

/// An encoded request or reply.
fn encoded_message() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        request().prop_map(|req| {
            let mut out = Vec::new();
            req.with(|r| r.encode(7, false, &mut out)).expect("encode");
            out
        }),
        reply().prop_map(|rep| {
            let mut out = Vec::new();
            rep.with(|r| r.encode(7, &mut out)).expect("encode");
            out
        }),
    ]
}

/// Mutates an encoded message deterministically from `m`.
fn mutate(mut buf: Vec<u8>, m: (u8, usize, u8, u32)) -> Vec<u8> {
    let (kind, pos, bit, val) = m;
    match kind % 5 {
        0 if !buf.is_empty() => {
            let i = pos % buf.len();
            buf[i] ^= 1 << (bit % 8);
        }
        1 => buf.truncate(pos % (buf.len() + 1)),
        2 if buf.len() >= 8 => buf[4..8].copy_from_slice(&val.to_ne_bytes()),
        3 if buf.len() >= Header::SIZE + 4 => {
            // Edit a 4-byte field inside the body (argsz/count-like fields).
            let i = Header::SIZE + (pos % (buf.len() - Header::SIZE - 3));
            buf[i..i + 4].copy_from_slice(&val.to_ne_bytes());
        }
        _ => buf.extend_from_slice(&val.to_ne_bytes()),
    }
    buf
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn request_round_trip(req in request(), id in any::<u16>(), no_reply in any::<bool>()) {
        let mut out = Vec::new();
        req.with(|r| r.encode(id, no_reply, &mut out)).expect("encode");
        let (h, body) = split(&out);
        prop_assert_eq!(h.msg_id, id);
        prop_assert_eq!(h.no_reply(), no_reply);
        prop_assert_eq!(h.msg_size as usize, out.len());
        let decoded = decode_request(&h, body, req.nfds());
        req.with(|r| {
            prop_assert_eq!(decoded, Ok(*r));
            Ok(())
        })?;
    }

    #[test]
    fn reply_round_trip(rep in reply(), id in any::<u16>()) {
        let mut out = Vec::new();
        rep.with(|r| r.encode(id, &mut out)).expect("encode");
        let (h, body) = split(&out);
        prop_assert_eq!(h.msg_id, id);
        prop_assert!(h.is_reply());
        let decoded = decode_reply(&h, body, rep.nfds());
        rep.with(|r| {
            prop_assert_eq!(decoded, Ok(*r));
            Ok(())
        })?;
    }

    #[test]
    fn error_reply_round_trip(id in any::<u16>(), cmd in 1u16..=19, code in any::<i32>()) {
        let mut out = Vec::new();
        encode_error_reply(&mut out, id, cmd, code);
        let (h, body) = split(&out);
        let e = decode_reply(&h, body, 0).expect_err("error reply");
        // The header carries |code|; 0 and values above 4096 report EIO.
        let wire = code.unsigned_abs();
        prop_assert_eq!(&e, &ProtoError::ErrorReply { cmd, errno: wire });
        let expected = if wire == 0 || wire > errno::MAX_ERRNO {
            errno::EIO
        } else {
            wire as i32
        };
        prop_assert_eq!(e.errno(), expected);
    }

    #[test]
    fn random_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..512)) {
        fuzzing::decode_all(&data);
    }

    #[test]
    fn mutated_messages_never_panic(msg in encoded_message(), sel in any::<u8>(), m in any::<(u8, usize, u8, u32)>()) {
        let mut input = vec![sel];
        input.extend_from_slice(&mutate(msg, m));
        fuzzing::decode_all(&input);
    }

    #[test]
    fn truncated_requests_are_rejected(req in request(), cut in any::<usize>()) {
        // Truncating the body while keeping msg_size consistent never
        // yields the original request (fixed-size commands are rejected,
        // variable ones lose data) and never panics.
        let mut out = Vec::new();
        req.with(|r| r.encode(1, false, &mut out)).expect("encode");
        let body_len = out.len() - Header::SIZE;
        prop_assume!(body_len > 0);
        let keep = cut % body_len;
        out.truncate(Header::SIZE + keep);
        let size = out.len() as u32;
        out[4..8].copy_from_slice(&size.to_ne_bytes());
        let (h, body) = split(&out);
        let decoded = decode_request(&h, body, req.nfds());
        req.with(|r| {
            prop_assert_ne!(decoded, Ok(*r));
            Ok(())
        })?;
    }

    #[test]
    fn caps_json_round_trip(fds in 0u32..=1024, xfer in 1u32..=MAX_DATA_XFER_SIZE_LIMIT, maps in 1u32..=65535,
                            pg in 1u64..1024, wm in any::<bool>(), mig in prop::option::of((1u64..16, 0u64..=MAX_BITMAP_SIZE_LIMIT)),
                            twin in prop::option::of((any::<bool>(), prop::option::of(any::<u32>()))), smf in any::<bool>()) {
        let caps = Capabilities {
            max_msg_fds: fds,
            max_data_xfer_size: xfer,
            max_dma_maps: maps,
            pgsizes: pg * 4096,
            migration: mig.map(|(p, m)| MigrationCap { pgsize: p * 4096, max_bitmap_size: m }),
            write_multiple: wm,
            twin_socket: twin.map(|(supported, fd_index)| TwinSocketCap { supported, fd_index }),
            sparse_mmap_fds: smf,
        };
        let data = caps.to_version_data();
        prop_assert_eq!(data.last(), Some(&0));
        prop_assert_eq!(Capabilities::from_version_data(&data), Ok(caps));
    }
}
