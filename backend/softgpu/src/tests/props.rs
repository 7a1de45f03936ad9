//! Property tests: arbitrary region accesses, and data movement against a reference model.

use std::cell::RefCell;

use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use switchyard_device::PciDevice;

use crate::cmd::{Command, Operand};

use super::*;

fn access_ok(region: u32, off: u64, len: usize, vram: u64) -> bool {
    let end = off.checked_add(len as u64);
    let dword = matches!(len, 4 | 8) && off.is_multiple_of(len as u64);
    match region {
        0 => dword && end.is_some_and(|e| e <= BAR0_SIZE),
        2 => end.is_some_and(|e| e <= vram),
        4 => dword && end.is_some_and(|e| e <= BAR4_SIZE),
        7 => end.is_some_and(|e| e <= 4096),
        _ => false,
    }
}

proptest! {
    #![proptest_config(Config { cases: 24, ..Config::default() })]

    /// Whatever a client sends, the device answers with Ok or a clean error, never a panic,
    /// and it stays usable.
    #[test]
    fn arbitrary_region_accesses_are_safe(
        ops in proptest::collection::vec(
            (
                0u32..10,
                prop_oneof![0u64..0x2000, 0u64..0x2_0000, (u64::MAX - 16)..=u64::MAX],
                0usize..17,
                any::<bool>(),
                any::<u64>(),
            ),
            1..48,
        )
    ) {
        let mut h = Harness::new();
        h.init();
        let vram = h.config.vram_size;
        for (region, off, len, write, v) in ops {
            let mut buf = [0u8; 16];
            buf[..8].copy_from_slice(&v.to_le_bytes());
            buf[8..].copy_from_slice(&v.rotate_left(17).to_le_bytes());
            let r = if write {
                h.gpu.region_write(region, off, &buf[..len])
            } else {
                h.gpu.region_read(region, off, &mut buf[..len])
            };
            // A refused access is refused as an access error, nothing else.
            let ok = access_ok(region, off, len, vram);
            let as_expected = match &r {
                Ok(()) => ok,
                Err(
                    DeviceError::NoSuchRegion(_)
                    | DeviceError::OutOfRange { .. }
                    | DeviceError::BadAccess { .. },
                ) => !ok,
                Err(_) => false,
            };
            prop_assert!(as_expected, "{} {}@{:#x}: {:?} (expected ok: {})", region, len, off, r, ok);
        }
        // Still a working device after a reset.
        h.gpu.reset().map_err(|e| TestCaseError::fail(e.to_string()))?;
        h.tails = vec![0; 2];
        h.init();
        h.run(0, &[Command::fence(Operand::Guest(DATA), 3, None)]);
        prop_assert_eq!(h.guest_read(DATA, 8), 3u64.to_le_bytes().to_vec());
    }
}

const SPAN: u64 = 0x4000;
const GBASE: u64 = RAM1 - SPAN / 2; // straddles the window seam

#[derive(Debug, Clone)]
enum Op {
    Fill {
        vram: bool,
        off: u64,
        len: u64,
        pat: u32,
    },
    Copy {
        sv: bool,
        so: u64,
        dv: bool,
        d: u64,
        len: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (any::<bool>(), 0..SPAN, 0..SPAN, any::<u32>()).prop_map(|(vram, off, len, pat)| {
            Op::Fill {
                vram,
                off,
                len: len.min(SPAN - off),
                pat,
            }
        }),
        (any::<bool>(), 0..SPAN, any::<bool>(), 0..SPAN, 0..SPAN).prop_map(
            |(sv, so, dv, d, len)| Op::Copy {
                sv,
                so,
                dv,
                d,
                len: len.min(SPAN - so).min(SPAN - d)
            }
        ),
    ]
}

#[test]
fn fill_and_copy_match_a_reference_model() {
    let mut h = Harness::new();
    h.init();
    h.guest_write(GBASE, &vec![0; SPAN as usize]);
    let model = RefCell::new((vec![0u8; SPAN as usize], vec![0u8; SPAN as usize]));
    let h = RefCell::new(h);
    let mut runner = TestRunner::new(Config {
        cases: 64,
        ..Config::default()
    });
    runner
        .run(&proptest::collection::vec(op(), 1..8), |ops| {
            let mut h = h.borrow_mut();
            let mut m = model.borrow_mut();
            let operand = |vram: bool, off: u64| {
                if vram {
                    Operand::Vram(off)
                } else {
                    Operand::Guest(GBASE + off)
                }
            };
            let mut cmds = vec![];
            for op in &ops {
                match *op {
                    Op::Fill {
                        vram,
                        off,
                        len,
                        pat,
                    } => {
                        let mem = if vram { &mut m.0 } else { &mut m.1 };
                        for (i, b) in mem[off as usize..(off + len) as usize]
                            .iter_mut()
                            .enumerate()
                        {
                            *b = pat.to_le_bytes()[i % 4];
                        }
                        cmds.push(Command::fill(operand(vram, off), len, pat));
                    }
                    Op::Copy { sv, so, dv, d, len } => {
                        let overlap = sv == dv && so < d + len && d < so + len;
                        if overlap && !sv {
                            continue; // unspecified for guest memory
                        }
                        let src = if sv { m.0.clone() } else { m.1.clone() };
                        let dst = if dv { &mut m.0 } else { &mut m.1 };
                        dst[d as usize..(d + len) as usize]
                            .copy_from_slice(&src[so as usize..(so + len) as usize]);
                        cmds.push(Command::copy(operand(sv, so), operand(dv, d), len));
                    }
                }
            }
            h.run(0, &cmds);
            prop_assert!(h.vram_file_read(0, SPAN as usize) == m.0, "VRAM differs");
            prop_assert!(
                h.guest_read(GBASE, SPAN as usize) == m.1,
                "guest memory differs"
            );
            Ok(())
        })
        .expect("property holds");
}
