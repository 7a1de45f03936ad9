//! A command's operands as the GPU path sees them, and how outputs are pipelined.

use switchyard_softgpu::cmd::{self, Command, Operand};

use super::Skip;

pub(super) fn overlap(a: (Operand, u64), b: (Operand, u64)) -> bool {
    let same_space = a.0.is_vram() == b.0.is_vram();
    let (a0, b0) = (a.0.addr(), b.0.addr());
    same_space && a0 < b0.saturating_add(b.1) && b0 < a0.saturating_add(a.1)
}

/// Smallest piece of a pipelined output (below: one piece).
const PIECE_MIN: usize = 1 << 20;
/// Largest piece.
const PIECE_MAX: usize = 16 << 20;

/// How many pieces of about an eighth of `len` (1 to 16 MiB each) an output of `len` bytes
/// is computed in: GEMM's row blocks.
pub(super) fn piece_count(len: usize) -> usize {
    len.div_ceil(piece_size(len, 1)).max(1)
}

fn piece_size(len: usize, align: usize) -> usize {
    let unit = 4096usize.max(align);
    (len / 8).clamp(PIECE_MIN, PIECE_MAX).next_multiple_of(unit)
}

/// `len` bytes in pieces of about an eighth (1 to 16 MiB, multiples of `align` and of 4 KiB),
/// the last one tapered (halves down to 1 MiB): `(offset, length)` of each. The copy out of
/// one piece overlaps the next piece's work, so what a write-through adds is the last piece's
/// copy, 1 MiB at most once the output is over 2 MiB.
pub(super) fn pieces(len: usize, align: usize) -> impl Iterator<Item = (usize, usize)> {
    let unit = 4096usize.max(align);
    let piece = piece_size(len, align);
    let regular = len.div_ceil(piece).max(1);
    let mut out = Vec::with_capacity(regular + 8);
    for i in 0..regular - 1 {
        out.push((i * piece, piece));
    }
    let (mut at, mut left) = ((regular - 1) * piece, len - (regular - 1) * piece);
    while left > PIECE_MIN {
        let half = (left / 2).next_multiple_of(unit);
        if half >= left {
            break;
        }
        out.push((at, half));
        at += half;
        left -= half;
    }
    out.push((at, left));
    out.into_iter()
}

/// A command's operands, as the GPU path sees them.
pub(super) struct Plan {
    pub(super) command: Command,
    /// Operands: (operand, bytes, read by the command).
    pub(super) operands: Vec<(Operand, u64, bool)>,
    /// (index of the output operand, bytes written).
    pub(super) output: (usize, u64),
    /// Kernel operands must be in GPU memory (guest ones are staged).
    pub(super) kernel: bool,
}

impl Plan {
    pub(super) fn of(c: &Command) -> Result<Plan, Skip> {
        let op = |i: usize| c.operand(i);
        let (operands, output, kernel) = match c.opcode {
            cmd::OP_COPY => {
                let len = c.arg[0];
                let (src, dst) = ((op(0), len), (op(1), len));
                // Overlapping VRAM copies have memmove semantics on the CPU path.
                if overlap(src, dst) {
                    return Err(Skip::Decline);
                }
                if !src.0.is_vram() && !dst.0.is_vram() {
                    // Guest to guest: nothing for a GPU to add.
                    return Err(Skip::Decline);
                }
                (
                    vec![(src.0, len, true), (dst.0, len, false)],
                    (1, len),
                    false,
                )
            }
            cmd::OP_FILL => {
                let len = c.arg[0];
                if !len.is_multiple_of(4) || !op(0).addr().is_multiple_of(4) || !op(0).is_vram() {
                    return Err(Skip::Decline);
                }
                (vec![(op(0), len, false)], (0, len), false)
            }
            cmd::OP_SAXPY => {
                let bytes = c.arg[0].saturating_mul(4);
                let (x, y) = ((op(0), bytes), (op(1), bytes));
                if overlap(x, y) && x.0 != y.0 {
                    return Err(Skip::Decline);
                }
                (
                    vec![(x.0, bytes, true), (y.0, bytes, true)],
                    (1, bytes),
                    true,
                )
            }
            cmd::OP_REDUCE => {
                let (x, out) = ((op(0), c.arg[0].saturating_mul(4)), (op(1), 4));
                if c.arg[0] == 0 || overlap(x, out) {
                    return Err(Skip::Decline);
                }
                (vec![(x.0, x.1, true), (out.0, 4, false)], (1, 4), true)
            }
            cmd::OP_GEMM => {
                let [m, n, k] = c.arg;
                let a = (op(0), m.saturating_mul(k).saturating_mul(4));
                let b = (op(1), k.saturating_mul(n).saturating_mul(4));
                let cc = (op(2), m.saturating_mul(n).saturating_mul(4));
                if k == 0 || overlap(a, cc) || overlap(b, cc) {
                    return Err(Skip::Decline);
                }
                (
                    vec![(a.0, a.1, true), (b.0, b.1, true), (cc.0, cc.1, false)],
                    (2, cc.1),
                    true,
                )
            }
            _ => return Err(Skip::Decline),
        };
        Ok(Plan {
            command: *c,
            operands,
            output,
            kernel,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::{PIECE_MIN, pieces};

    #[test]
    fn pieces_cover_the_output_in_order_and_the_last_is_at_most_a_mebibyte() {
        for (len, align) in [
            (4096, 4),
            (PIECE_MIN, 1),
            (2 << 20, 1),
            (16 << 20, 1),
            (64 << 20, 4),
            ((64 << 20) + 12, 4),
            (1 << 30, 1),
            (3 * (16 << 20) + 4096, 4),
        ] {
            let p: Vec<(usize, usize)> = pieces(len, align).collect();
            let mut at = 0;
            for &(o, n) in &p {
                assert_eq!(o, at, "{len}: contiguous");
                assert!(n > 0, "{len}: {p:?}");
                assert!(o % 4096 == 0 && o % align == 0, "{len}: aligned {p:?}");
                at += n;
            }
            assert_eq!(at, len, "{len}: covered");
            let last = p.last().expect("a piece").1;
            assert!(last <= PIECE_MIN, "{len}: the exposed tail is {last} bytes");
        }
        let p: Vec<usize> = pieces(64 << 20, 4).map(|(_, n)| n >> 20).collect();
        assert_eq!(
            p,
            [8, 8, 8, 8, 8, 8, 8, 4, 2, 1, 1],
            "halves after the eighths"
        );
    }
}
