//! Bounded, stable-toolchain fuzzer for the vfio-user decoders.
//!
//! ```text
//! cargo run --release -p switchyard-proto --example fuzz_decode -- [--seconds N] [--seed S] [--iterations N]
//! ```
//!
//! Feeds random inputs and mutations (bit flips, truncation, length-field
//! and body-field edits, splices) of a generated corpus of valid messages
//! through `switchyard_proto::fuzzing::decode_all`. The input sequence is
//! deterministic for a seed. A panic is a failure (non-zero exit); on panic
//! the offending input is printed as hex (feed it to
//! `fuzzing::decode_all` to reproduce).
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use switchyard_proto::consts::*;
use switchyard_proto::*;

/// xorshift64* PRNG.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed ^ 0x9e37_79b9_7f4a_7c15 | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
    fn chance(&mut self, one_in: u64) -> bool {
        self.next().is_multiple_of(one_in)
    }
}

const INTERESTING32: [u32; 12] = [
    0,
    1,
    7,
    8,
    15,
    16,
    20,
    24,
    32,
    0x7fff_ffff,
    0x8000_0000,
    u32::MAX,
];

fn push(corpus: &mut Vec<Vec<u8>>, f: impl FnOnce(&mut Vec<u8>) -> Result<(), ProtoError>) {
    let mut out = Vec::new();
    if f(&mut out).is_ok() {
        corpus.push(out);
    }
}

fn build_corpus() -> Vec<Vec<u8>> {
    let mut c = Vec::new();
    let caps = Capabilities {
        max_msg_fds: 16,
        write_multiple: true,
        ..Capabilities::default()
    };
    let json = caps.to_version_data();
    let ranges = [
        DmaLoggingRange {
            iova: 0,
            length: 1 << 20,
        },
        DmaLoggingRange {
            iova: 1 << 30,
            length: 4096,
        },
    ];
    let entries = [
        WriteMultiEntry {
            offset: 0,
            region: 0,
            count: 4,
            data: [1; 8],
        },
        WriteMultiEntry {
            offset: 8,
            region: 2,
            count: 8,
            data: [2; 8],
        },
    ];
    let requests = [
        Request::Version(Version {
            major: 0,
            minor: 0,
            data: &json,
        }),
        Request::Version(Version {
            major: 0,
            minor: 2,
            data: b"",
        }),
        Request::DmaMap(DmaMap {
            argsz: 32,
            flags: 3,
            offset: 0,
            address: 0x1_0000,
            size: 0x10_0000,
        }),
        Request::DmaMap(DmaMap {
            argsz: 32,
            flags: 3 | VFIO_USER_F_DMA_REGION_MMAP,
            offset: 4096,
            address: 0,
            size: 4096,
        }),
        Request::DmaUnmap {
            unmap: DmaUnmap {
                argsz: 24,
                flags: 0,
                address: 0x1_0000,
                size: 0x10_0000,
            },
            bitmap: None,
        },
        Request::DmaUnmap {
            unmap: DmaUnmap {
                argsz: 24,
                flags: VFIO_DMA_UNMAP_FLAG_ALL,
                address: 0,
                size: 0,
            },
            bitmap: None,
        },
        Request::DmaUnmap {
            unmap: DmaUnmap {
                argsz: 72,
                flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
                address: 0,
                size: 1 << 20,
            },
            bitmap: Some(BitmapHeader {
                pgsize: 4096,
                size: 32,
            }),
        },
        Request::DeviceGetInfo { argsz: 16 },
        Request::DeviceGetRegionInfo {
            argsz: 32,
            index: 0,
        },
        Request::DeviceGetRegionIoFds {
            argsz: 256,
            index: 0,
        },
        Request::DeviceGetIrqInfo {
            argsz: 16,
            index: 2,
        },
        Request::DeviceSetIrqs(SetIrqs {
            argsz: 20,
            action: IrqAction::Trigger,
            data: IrqData::Eventfd,
            index: 2,
            start: 0,
            count: 2,
        }),
        Request::DeviceSetIrqs(SetIrqs {
            argsz: 23,
            action: IrqAction::Mask,
            data: IrqData::Bool(&[1, 0, 1]),
            index: 0,
            start: 0,
            count: 3,
        }),
        Request::DeviceSetIrqs(SetIrqs {
            argsz: 20,
            action: IrqAction::Trigger,
            data: IrqData::None,
            index: 1,
            start: 0,
            count: 0,
        }),
        Request::RegionRead {
            offset: 0x10,
            region: 0,
            count: 4,
        },
        Request::RegionWrite {
            offset: 0x10,
            region: 7,
            data: &[1, 2, 3, 4],
        },
        Request::DmaRead {
            address: 0x2000,
            count: 64,
        },
        Request::DmaWrite {
            address: 0x2000,
            data: &[9; 16],
        },
        Request::DeviceReset,
        Request::RegionWriteMulti(Records::from_slice(&entries)),
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 16,
            op: FeatureRequest::GetMigration,
        }),
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 16,
            op: FeatureRequest::GetMigDeviceState,
        }),
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 16,
            op: FeatureRequest::SetMigDeviceState(MigDeviceState {
                device_state: 3,
                data_fd: 0,
            }),
        }),
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 56,
            op: FeatureRequest::DmaLoggingStart(DmaLoggingControl {
                page_size: 4096,
                ranges: Records::from_slice(&ranges),
            }),
        }),
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 8,
            op: FeatureRequest::DmaLoggingStop,
        }),
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 64,
            op: FeatureRequest::DmaLoggingReport(DmaLoggingReport {
                iova: 0,
                length: 1 << 20,
                page_size: 4096,
            }),
        }),
        Request::DeviceFeature(DeviceFeatureRequest {
            argsz: 8,
            op: FeatureRequest::Probe {
                feature: 6,
                get: false,
                set: true,
            },
        }),
        Request::MigDataRead {
            argsz: 4104,
            size: 4096,
        },
        Request::MigDataWrite {
            argsz: 12,
            data: &[1, 2, 3, 4],
        },
    ];
    for (i, r) in requests.iter().enumerate() {
        push(&mut c, |o| r.encode(i as u16, false, o));
    }
    let mut caps_bytes = Vec::new();
    let mut b = RegionCapsBuilder::new(&mut caps_bytes);
    let _ = b.sparse_mmap(&[
        SparseMmapArea {
            offset: 0,
            size: 4096,
        },
        SparseMmapArea {
            offset: 8192,
            size: 4096,
        },
    ]);
    let _ = b.region_type(3, 1);
    let mut info = RegionInfo {
        argsz: 0,
        flags: 7,
        index: 0,
        cap_offset: 0,
        size: 16384,
        offset: 0,
    };
    let _ = b.finish_info(&mut info, 4096);
    let io = [IoFdEntry {
        offset: 0,
        size: 4,
        fd_index: 0,
        kind: 0,
        flags: 1,
        padding: 0,
        datamatch: 5,
    }];
    let bitmap = [0xffu8; 32];
    let replies = [
        Reply::Version(Version {
            major: 0,
            minor: 0,
            data: &json,
        }),
        Reply::DmaMap,
        Reply::DmaUnmap {
            unmap: DmaUnmap {
                argsz: 24,
                flags: 0,
                address: 0,
                size: 4096,
            },
            bitmap: None,
        },
        Reply::DmaUnmap {
            unmap: DmaUnmap {
                argsz: 72,
                flags: VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP,
                address: 0,
                size: 1 << 20,
            },
            bitmap: Some(DirtyBitmap {
                pgsize: 4096,
                data: &bitmap,
            }),
        },
        Reply::DeviceGetInfo(DeviceInfo {
            argsz: 16,
            flags: 3,
            num_regions: 9,
            num_irqs: 5,
        }),
        Reply::DeviceGetRegionInfo {
            info,
            caps: &caps_bytes,
        },
        Reply::DeviceGetRegionIoFds {
            argsz: 56,
            index: 0,
            count: 1,
            entries: IoFdEntries::Spec(Records::from_slice(&io)),
        },
        Reply::DeviceGetIrqInfo(IrqInfo {
            argsz: 16,
            flags: 1,
            index: 2,
            count: 16,
        }),
        Reply::DeviceSetIrqs,
        Reply::RegionRead {
            offset: 0,
            region: 0,
            data: &[1, 2, 3, 4],
        },
        Reply::RegionWrite {
            offset: 0,
            region: 0,
            count: 4,
        },
        Reply::DmaRead {
            address: 0x2000,
            data: &[7; 8],
        },
        Reply::DmaWrite {
            address: 0x2000,
            count: 8,
        },
        Reply::DeviceReset,
        Reply::RegionWriteMulti { wr_cnt: 2 },
        Reply::DeviceFeature(DeviceFeatureReply {
            argsz: 16,
            op: FeatureReply::GetMigration(MigrationFeature { flags: 5 }),
        }),
        Reply::DeviceFeature(DeviceFeatureReply {
            argsz: 64,
            op: FeatureReply::DmaLoggingReport {
                report: DmaLoggingReport {
                    iova: 0,
                    length: 1 << 20,
                    page_size: 4096,
                },
                bitmap: &bitmap,
            },
        }),
        Reply::DeviceFeature(DeviceFeatureReply {
            argsz: 56,
            op: FeatureReply::DmaLoggingStart(DmaLoggingControl {
                page_size: 4096,
                ranges: Records::from_slice(&ranges),
            }),
        }),
        Reply::MigDataRead {
            argsz: 12,
            data: &[1, 2, 3, 4],
        },
        Reply::MigDataWrite(None),
    ];
    for (i, r) in replies.iter().enumerate() {
        push(&mut c, |o| r.encode(i as u16, o));
    }
    push(&mut c, |o| {
        encode_error_reply(o, 1, VFIO_USER_DMA_MAP, errno::EEXIST);
        Ok(())
    });
    c
}

fn mutate(rng: &mut Rng, corpus: &[Vec<u8>], input: &mut Vec<u8>) {
    input.clear();
    // Selector byte for decode_all: fd count, msg_size fix-up, limits.
    input.push(rng.next() as u8);
    if corpus.is_empty() || rng.chance(8) {
        let n = rng.below(300);
        input.extend((0..n).map(|_| rng.next() as u8));
        return;
    }
    input.extend_from_slice(&corpus[rng.below(corpus.len())]);
    let rounds = 1 + rng.below(4);
    for _ in 0..rounds {
        let len = input.len();
        match rng.below(8) {
            0 | 1 => {
                // bit flips
                if len > 1 {
                    let i = 1 + rng.below(len - 1);
                    input[i] ^= 1 << rng.below(8);
                }
            }
            2 => {
                // truncation
                let keep = 1 + rng.below(len);
                input.truncate(keep);
            }
            3 => {
                // header msg_size edit
                if len >= 9 {
                    let body = (len - 1) as u32;
                    let v = match rng.below(4) {
                        0 => body,
                        1 => body.wrapping_add(rng.below(64) as u32).wrapping_sub(32),
                        2 => INTERESTING32[rng.below(INTERESTING32.len())],
                        _ => rng.next() as u32,
                    };
                    input[5..9].copy_from_slice(&v.to_ne_bytes());
                }
            }
            4 => {
                // length/count-like field edit inside the body
                if len >= 1 + 16 + 4 {
                    let i = 1 + 16 + rng.below(len - 1 - 16 - 3);
                    let v = INTERESTING32[rng.below(INTERESTING32.len())];
                    input[i..i + 4].copy_from_slice(&v.to_ne_bytes());
                }
            }
            5 => {
                // 8-byte field edit (offsets, sizes)
                if len >= 1 + 16 + 8 {
                    let i = 1 + 16 + rng.below(len - 1 - 16 - 7);
                    let v = match rng.below(3) {
                        0 => u64::MAX,
                        1 => u64::MAX - rng.below(4096) as u64,
                        _ => rng.next(),
                    };
                    input[i..i + 8].copy_from_slice(&v.to_ne_bytes());
                }
            }
            6 => {
                // splice with another corpus entry
                let other = &corpus[rng.below(corpus.len())];
                // Keep the selector byte (index 0).
                let at = 1 + rng.below(input.len());
                let from = rng.below(other.len() + 1);
                input.truncate(at);
                input.extend_from_slice(&other[from..]);
            }
            _ => {
                // insert random bytes
                let at = 1 + rng.below(input.len());
                let n = 1 + rng.below(16);
                for _ in 0..n {
                    input.insert(at, rng.next() as u8);
                }
            }
        }
    }
    if rng.chance(3) && input.len() >= 9 {
        // keep msg_size consistent so decoding goes deep
        let size = (input.len() - 1) as u32;
        input[5..9].copy_from_slice(&size.to_ne_bytes());
    }
}

fn parse_args() -> (u64, u64, Option<u64>) {
    let mut seconds = 10;
    let mut seed = 1;
    let mut iterations = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = |name: &str| -> u64 {
            match args.next().and_then(|v| v.parse().ok()) {
                Some(v) => v,
                None => {
                    eprintln!("{name} needs a number");
                    std::process::exit(2);
                }
            }
        };
        match a.as_str() {
            "--seconds" => seconds = val("--seconds"),
            "--seed" => seed = val("--seed"),
            "--iterations" => iterations = Some(val("--iterations")),
            "-h" | "--help" => {
                println!(
                    "usage: fuzz_decode [--seconds N (default 10)] [--seed S (default 1)] [--iterations N]"
                );
                std::process::exit(0);
            }
            other => {
                eprintln!("unknown argument {other}");
                std::process::exit(2);
            }
        }
    }
    (seconds, seed, iterations)
}

fn main() {
    let (seconds, seed, iterations) = parse_args();
    let corpus = build_corpus();
    // Sanity: every corpus entry decodes (as request or reply).
    for m in &corpus {
        let h = Header::from_bytes(m).unwrap_or_default();
        let body = m.get(Header::SIZE..).unwrap_or_default();
        let ok = if h.is_reply() {
            matches!(
                decode_reply(&h, body, 1),
                Ok(_) | Err(ProtoError::ErrorReply { .. })
            ) || decode_reply(&h, body, 0).is_ok()
                || decode_reply(&h, body, 2).is_ok()
        } else {
            (0..3).any(|n| decode_request(&h, body, n).is_ok())
        };
        if !ok {
            eprintln!("corpus entry for command {} does not decode", h.cmd);
            std::process::exit(1);
        }
    }
    let mut rng = Rng::new(seed);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let start = Instant::now();
    let mut input = Vec::with_capacity(1024);
    let mut n: u64 = 0;
    loop {
        if let Some(max) = iterations {
            if n >= max {
                break;
            }
        } else if n.is_multiple_of(1024) && Instant::now() >= deadline {
            break;
        }
        mutate(&mut rng, &corpus, &mut input);
        let r = std::panic::catch_unwind(|| fuzzing::decode_all(&input));
        if r.is_err() {
            let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
            eprintln!("FAILED at iteration {n} (seed {seed}); input: {hex}");
            std::process::exit(1);
        }
        n += 1;
    }
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    println!(
        "fuzz_decode: seed {seed}, {} corpus entries, {n} iterations in {secs:.1} s ({:.0} iterations/s), no failures",
        corpus.len(),
        n as f64 / secs
    );
}
