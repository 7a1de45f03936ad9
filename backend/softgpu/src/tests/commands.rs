//! The commands, driven through rings as a driver would, checked against host references.

use crate::cmd::{Command, Operand};

use super::*;

const G: fn(u64) -> Operand = Operand::Guest;
const V: fn(u64) -> Operand = Operand::Vram;

fn pattern(seed: u8, n: usize) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ ((i >> 8) as u8))
        .collect()
}

#[test]
fn copy_guest_to_vram_to_guest_across_two_windows() {
    let mut h = Harness::new();
    h.init();
    // The source straddles the seam between the two memfd windows.
    let src = RAM1 - 0x1801;
    let len = 0x3003usize;
    let data = pattern(7, len);
    h.guest_write(src, &data);
    h.run(0, &[Command::copy(G(src), V(0x1001), len as u64)]);
    assert!(h.vram_file_read(0x1001, len) == data, "guest→VRAM");
    assert_eq!(h.vram_region_read(0x1000, 1), [0], "byte before untouched");
    assert_eq!(
        h.vram_region_read(0x1001 + len as u64, 1),
        [0],
        "byte after untouched"
    );
    // Clear the guest area, then copy back to a differently aligned spot across the seam.
    h.guest_write(src - 16, &vec![0xee; len + 64]);
    let dst = src + 5;
    h.run(0, &[Command::copy(V(0x1001), G(dst), len as u64)]);
    assert!(h.guest_read(dst, len) == data, "VRAM→guest");
    assert_eq!(h.guest_read(dst - 21, 21), [0xee; 21]);
    assert_eq!(h.guest_read(dst + len as u64, 16), [0xee; 16]);
    assert_eq!(h.rd64(queue_reg(0, Q_COMPLETED_LO)), 2);
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_IDLE);
}

#[test]
fn copy_vram_to_vram_and_guest_to_guest() {
    let mut h = Harness::new();
    h.init();
    let data = pattern(3, 5000);
    h.vram_file_write(0x10000, &data);
    // Overlapping VRAM→VRAM copy behaves like memmove.
    h.run(0, &[Command::copy(V(0x10000), V(0x10000 + 100), 5000)]);
    assert_eq!(h.vram_file_read(0x10000 + 100, 5000), data);
    assert_eq!(h.vram_file_read(0x10000, 100), data[..100]);
    // Guest→guest, larger than one bounce chunk, the destination across the window seam.
    let n = (1 << 20) + 333;
    let big = pattern(9, n);
    let src = RAM0 + 0x2_0000;
    let dst = RAM1 - 0x4_0001;
    h.guest_write(src, &big);
    h.run(1, &[Command::copy(G(src), G(dst), n as u64)]);
    assert_eq!(h.guest_read(dst, n), big);
    // Zero-length copies are no-ops.
    h.run(1, &[Command::copy(G(HOLE), V(h.config.vram_size), 0)]);
}

#[test]
fn fill_guest_and_vram() {
    let mut h = Harness::new();
    h.init();
    let pat = 0x4433_2211u32;
    let expect = |len: usize| -> Vec<u8> {
        pat.to_le_bytes()
            .iter()
            .copied()
            .cycle()
            .take(len)
            .collect()
    };
    let dst = RAM1 - 10;
    h.guest_write(dst - 1, &[0x77; 40]);
    h.run(0, &[Command::fill(G(dst), 27, pat)]);
    assert_eq!(h.guest_read(dst, 27), expect(27));
    assert_eq!(h.guest_read(dst - 1, 1), [0x77]);
    assert_eq!(h.guest_read(dst + 27, 12), [0x77; 12]);
    // VRAM, more than one chunk, ending exactly at the end of VRAM.
    let size = h.config.vram_size;
    let len = (1 << 20) + 5;
    h.run(0, &[Command::fill(V(size - len), len, 0xa5a5_5a5a)]);
    let back = h.vram_file_read(size - len, len as usize);
    assert!(
        back.iter()
            .zip([0x5a, 0x5a, 0xa5, 0xa5].iter().cycle())
            .all(|(a, b)| a == b)
    );
}

#[test]
fn saxpy_is_bit_exact() {
    let mut h = Harness::new();
    h.init();
    let n = 70_001; // more than one engine chunk
    let x = floats(1, n);
    let y = floats(2, n);
    let a = -1.618_034f32;
    // x in guest memory (straddling the windows), y in VRAM.
    let xa = RAM1 - 0x1_0000;
    h.guest_write(xa, &f32_bytes(&x));
    h.vram_file_write(0x4000, &f32_bytes(&y));
    h.run(0, &[Command::saxpy(n as u64, a, G(xa), V(0x4000))]);
    let want: Vec<u32> = x
        .iter()
        .zip(&y)
        .map(|(&xv, &yv)| (a * xv + yv).to_bits())
        .collect();
    let got: Vec<u32> = bytes_f32(&h.vram_file_read(0x4000, n * 4))
        .iter()
        .map(|v| v.to_bits())
        .collect();
    assert!(got == want, "SAXPY differs from the host reference");
    // x and y identical: y = a*y + y.
    let yy = bytes_f32(&h.vram_file_read(0x4000, 64));
    h.run(1, &[Command::saxpy(16, 2.0, V(0x4000), V(0x4000))]);
    let got = bytes_f32(&h.vram_file_read(0x4000, 64));
    for (g, v) in got.iter().zip(&yy) {
        assert_eq!(g.to_bits(), (2.0 * v + v).to_bits());
    }
}

/// The documented GEMM order: acc = 0.0; acc = acc + A[i][k]*B[k][j], k ascending.
fn gemm_ref(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f32;
            for kk in 0..k {
                acc += a[i * k + kk] * b[kk * n + j];
            }
            c[i * n + j] = acc;
        }
    }
    c
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn gemm_is_bit_exact() {
    let mut h = Harness::new();
    h.init();
    for (m, n, k, seed) in [
        (64usize, 48usize, 32usize, 10u64),
        (9, 600, 7, 20),
        (3, 5, 1, 30),
    ] {
        let a = floats(seed, m * k);
        let b = floats(seed + 1, k * n);
        // A in guest memory across the seam, B in VRAM, C in guest memory.
        let aa = RAM1 - 0x800;
        let cc = DATA;
        h.guest_write(aa, &f32_bytes(&a));
        h.vram_file_write(0x8000, &f32_bytes(&b));
        h.run(
            0,
            &[Command::gemm(
                m as u64,
                n as u64,
                k as u64,
                G(aa),
                V(0x8000),
                G(cc),
            )],
        );
        let got = bytes_f32(&h.guest_read(cc, m * n * 4));
        let want = gemm_ref(m, n, k, &a, &b);
        assert!(
            bits(&got) == bits(&want),
            "GEMM {m}x{n}x{k} differs from the host reference"
        );
    }
    // K = 0: C is all zeros.
    h.guest_write(DATA, &[0xff; 24]);
    h.run(0, &[Command::gemm(2, 3, 0, G(0), G(0), G(DATA))]);
    assert_eq!(h.guest_read(DATA, 24), [0; 24]);
}

#[test]
fn reduce_is_bit_exact() {
    let mut h = Harness::new();
    h.init();
    let n = 100_003;
    let x = floats(5, n);
    h.vram_file_write(0x40000, &f32_bytes(&x));
    let out = DATA + 0x100;
    h.run(1, &[Command::reduce(n as u64, V(0x40000), G(out))]);
    let mut acc = 0.0f32;
    for v in &x {
        acc += v;
    }
    let got = f32::from_le_bytes(h.guest_read(out, 4).try_into().expect("4 bytes"));
    assert_eq!(got.to_bits(), acc.to_bits());
    // Empty sum.
    h.run(1, &[Command::reduce(0, V(0), V(0x100))]);
    assert_eq!(h.vram_file_read(0x100, 4), [0; 4]);
}

#[test]
fn fence_writes_value_counts_and_interrupts() {
    let mut h = Harness::new();
    h.init();
    h.drain_irqs();
    let f = DATA + 0x800;
    h.run(0, &[Command::fence(G(f), 0x1122_3344_5566_7788, Some(5))]);
    assert_eq!(h.wait_irq(5), 1);
    assert_eq!(h.guest_read(f, 8), 0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(h.rd64(FENCE_COUNT_LO), 1);
    assert_eq!(h.rd32(INT_STATUS), int_completion(0));
    h.wr32(INT_ACK, int_completion(0));
    assert_eq!(h.rd32(INT_STATUS), 0);

    // Without IRQ flag: value and counter, no interrupt. Into VRAM works too.
    h.run(1, &[Command::fence(V(0x800), 42, None)]);
    assert_eq!(h.vram_file_read(0x800, 8), 42u64.to_le_bytes());
    assert_eq!(h.rd64(FENCE_COUNT_LO), 2);
    assert_eq!(h.rd32(INT_STATUS), 0);
    assert_eq!(h.irq_count(5), 0);

    // Other commands interrupt on the queue's completion vector.
    h.qw(1, Q_COMPLETION_VECTOR, 11);
    h.run(1, &[Command::nop().with_irq()]);
    assert_eq!(h.wait_irq(11), 1);
    assert_eq!(h.rd32(INT_STATUS), int_completion(1));

    // Masked source: status latches, no message.
    h.wr32(INT_ACK, 0xffff_ffff);
    h.wr32(INT_MASK, int_completion(1));
    h.run(1, &[Command::nop().with_irq()]);
    assert_eq!(h.rd32(INT_STATUS), int_completion(1));
    assert_eq!(h.irq_count(11), 0);
    for v in 0..MSIX_VECTORS {
        assert_eq!(h.irq_count(v), 0, "vector {v}");
    }
}

#[test]
fn two_queues_run_concurrently() {
    let mut h = Harness::new();
    h.init();
    h.drain_irqs();
    let (m, n, k) = (48usize, 40usize, 64usize);
    let a = floats(100, m * k);
    let b = floats(101, k * n);
    h.vram_file_write(0, &f32_bytes(&a));
    h.vram_file_write(0x10000, &f32_bytes(&b));
    // Queue 0: a batch of GEMMs then a fence. Queue 1: fills then a fence.
    let mut q0 = vec![];
    for i in 0..8u64 {
        q0.push(Command::gemm(
            m as u64,
            n as u64,
            k as u64,
            V(0),
            V(0x10000),
            V(0x20000 + i * 0x2000),
        ));
    }
    q0.push(Command::fence(G(DATA), 1, Some(0)));
    let mut q1 = vec![];
    for i in 0..32u64 {
        q1.push(Command::fill(G(DATA + 0x1000 + i * 0x100), 0x100, i as u32));
    }
    q1.push(Command::fence(G(DATA + 8), 2, Some(1)));
    h.submit(0, &q0);
    h.submit(1, &q1);
    h.wait_irq(0);
    h.wait_irq(1);
    h.wait_idle(0);
    h.wait_idle(1);
    assert_eq!(h.guest_read(DATA, 8), 1u64.to_le_bytes());
    assert_eq!(h.guest_read(DATA + 8, 8), 2u64.to_le_bytes());
    assert_eq!(h.rd64(FENCE_COUNT_LO), 2);
    assert_eq!(h.rd64(queue_reg(0, Q_COMPLETED_LO)), 9);
    assert_eq!(h.rd64(queue_reg(1, Q_COMPLETED_LO)), 33);
    let want = bits(&gemm_ref(m, n, k, &a, &b));
    for i in 0..8u64 {
        let got = bytes_f32(&h.vram_file_read(0x20000 + i * 0x2000, m * n * 4));
        assert!(bits(&got) == want, "GEMM {i}");
    }
    for i in 0..32u64 {
        let got = h.guest_read(DATA + 0x1000 + i * 0x100, 0x100);
        let p = (i as u32).to_le_bytes();
        assert!(got.chunks(4).all(|c| c == p), "fill {i}");
    }
    // Rings wrap: run more than RING_ENTRIES commands through queue 1.
    for _ in 0..3 {
        let cmds = vec![Command::nop(); 40];
        h.run(1, &cmds);
    }
    assert_eq!(h.qr(1, Q_HEAD), 33 + 120);
}
