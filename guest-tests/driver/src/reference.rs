//! Host-side (in-guest CPU) reference results in exactly the order the device documents, and the
//! deterministic test data. f32 arithmetic is written as a rounded product followed by a
//! rounded sum (`let p = a * b; acc += p;`): Rust never contracts that into an FMA, and the
//! baseline x86-64 target has no FMA instructions anyway.

/// A small deterministic generator (xorshift64*), seeded per buffer.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value, including 0).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A float uniformly spaced in [-1, 1) with 24 random bits (exactly representable).
    pub fn next_f32(&mut self) -> f32 {
        let bits = (self.next_u64() >> 40) as u32; // 24 bits
        (bits as f32) * (1.0 / (1u32 << 23) as f32) - 1.0
    }
}

/// `n` random floats in [-1, 1).
pub fn f32_data(seed: u64, n: usize) -> Vec<f32> {
    let mut r = Rng::new(seed);
    (0..n).map(|_| r.next_f32()).collect()
}

/// `n` random bytes.
pub fn byte_data(seed: u64, n: usize) -> Vec<u8> {
    let mut r = Rng::new(seed);
    let mut out = Vec::with_capacity(n + 8);
    while out.len() < n {
        out.extend_from_slice(&r.next_u64().to_le_bytes());
    }
    out.truncate(n);
    out
}

/// `y[i] = a*x[i] + y[i]`: product rounded, then sum rounded.
pub fn saxpy(a: f32, x: &[f32], y: &[f32]) -> Vec<f32> {
    x.iter()
        .zip(y)
        .map(|(&xi, &yi)| {
            let p = a * xi;
            p + yi
        })
        .collect()
}

/// `C[m×n] = A[m×k]·B[k×n]`, row-major; each element summed over k ascending from 0.0.
pub fn gemm(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> Vec<f32> {
    // B transposed so the inner loop walks memory linearly; the summation order is unchanged.
    let mut bt = vec![0f32; n * k];
    for kk in 0..k {
        for j in 0..n {
            bt[j * k + kk] = b[kk * n + j];
        }
    }
    let mut c = vec![0f32; m * n];
    for i in 0..m {
        let row = &a[i * k..(i + 1) * k];
        for j in 0..n {
            let col = &bt[j * k..(j + 1) * k];
            let mut acc = 0f32;
            for (&x, &y) in row.iter().zip(col) {
                let p = x * y;
                acc += p;
            }
            c[i * n + j] = acc;
        }
    }
    c
}

/// `Σ x[i]` ascending from 0.0.
pub fn reduce(x: &[f32]) -> f32 {
    let mut acc = 0f32;
    for &v in x {
        acc += v;
    }
    acc
}

/// The bytes a FILL of `len` bytes with `pattern` produces.
pub fn fill(len: usize, pattern: u32) -> Vec<u8> {
    let p = pattern.to_le_bytes();
    (0..len).map(|i| p[i % 4]).collect()
}

/// Little-endian bytes of floats.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|f| f.to_le_bytes()).collect()
}

/// Floats from little-endian bytes (a trailing partial float is ignored).
pub fn f32_from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The first index where two float vectors differ bit-wise, with both values.
pub fn first_f32_mismatch(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    if got.len() != want.len() {
        return Some((got.len().min(want.len()), f32::NAN, f32::NAN));
    }
    got.iter()
        .zip(want)
        .position(|(g, w)| g.to_bits() != w.to_bits())
        .map(|i| (i, got[i], want[i]))
}

/// The first index where two byte slices differ.
pub fn first_byte_mismatch(got: &[u8], want: &[u8]) -> Option<usize> {
    if got.len() != want.len() {
        return Some(got.len().min(want.len()));
    }
    got.iter().zip(want).position(|(g, w)| g != w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_is_deterministic_and_in_range() {
        assert_eq!(f32_data(7, 100), f32_data(7, 100));
        assert_ne!(f32_data(7, 100), f32_data(8, 100));
        assert!(f32_data(1, 10_000).iter().all(|v| (-1.0..1.0).contains(v)));
        assert_eq!(byte_data(3, 13).len(), 13);
        assert_eq!(byte_data(3, 13)[..8], byte_data(3, 64)[..8]);
    }

    /// With an FMA, `a*x + y` would be 2^-24 here; rounded product then sum gives 0.
    #[test]
    fn saxpy_does_not_fuse() {
        let a = 1.0 + f32::EPSILON * 2048.0; // 1 + 2^-12
        let x = a;
        let p = a * x; // 1 + 2^-11 + 2^-24, rounds to 1 + 2^-11
        let y = -p;
        assert_eq!(saxpy(a, &[x], &[y]), vec![0.0]);
        assert_ne!(a.mul_add(x, y), 0.0, "the FMA result differs");
    }

    #[test]
    fn gemm_small_and_ordered() {
        // [1 2; 3 4] · [5 6; 7 8] = [19 22; 43 50]
        let c = gemm(2, 2, 2, &[1.0, 2.0, 3.0, 4.0], &[5.0, 6.0, 7.0, 8.0]);
        assert_eq!(c, vec![19.0, 22.0, 43.0, 50.0]);
        // Non-square: (1×3)·(3×2).
        let c = gemm(1, 2, 3, &[1.0, 2.0, 3.0], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
        assert_eq!(c, vec![4.0, 5.0]);
        // K = 0 gives zeros.
        assert_eq!(gemm(2, 3, 0, &[], &[]), vec![0.0; 6]);
        // The sum runs k ascending from 0.0: 1e8 + 1 - 1e8 = 0 in f32, not 1.
        let c = gemm(1, 1, 3, &[1e8, 1.0, -1e8], &[1.0, 1.0, 1.0]);
        assert_eq!(c, vec![0.0]);
        // Same as a naive triple loop on random data.
        let (m, n, k) = (5, 7, 9);
        let a = f32_data(1, m * k);
        let b = f32_data(2, k * n);
        let c = gemm(m, n, k, &a, &b);
        for i in 0..m {
            for j in 0..n {
                let mut acc = 0f32;
                for kk in 0..k {
                    let p = a[i * k + kk] * b[kk * n + j];
                    acc += p;
                }
                assert_eq!(c[i * n + j].to_bits(), acc.to_bits());
            }
        }
    }

    #[test]
    fn reduce_is_sequential() {
        assert_eq!(reduce(&[]), 0.0);
        assert_eq!(reduce(&[1e8, 1.0, -1e8, 1.0]), 1.0);
    }

    #[test]
    fn fill_and_conversions() {
        assert_eq!(fill(6, 0x0403_0201), vec![1, 2, 3, 4, 1, 2]);
        let v = vec![1.5f32, -0.0, f32::MIN_POSITIVE];
        assert_eq!(f32_from_bytes(&f32_bytes(&v)), v);
        assert_eq!(first_f32_mismatch(&[1.0, 2.0], &[1.0, 2.0]), None);
        assert_eq!(first_f32_mismatch(&[0.0], &[-0.0]).map(|m| m.0), Some(0));
        assert_eq!(first_byte_mismatch(b"abc", b"abd"), Some(2));
        assert_eq!(first_byte_mismatch(b"ab", b"abc"), Some(2));
    }
}
