//! The 64-byte ring command and its little-endian encoding (crate docs of `switchyard-softgpu`,
//! "Commands").

/// Bytes per ring entry.
pub const COMMAND_SIZE: usize = 64;

/// No operation.
pub const OP_NOP: u8 = 0x00;
/// `COPY src=addr0 dst=addr1 len=arg0`.
pub const OP_COPY: u8 = 0x01;
/// `FILL dst=addr0 len=arg0 pattern=imm32`.
pub const OP_FILL: u8 = 0x02;
/// `SAXPY x=addr0 y=addr1 n=arg0 a=imm32`.
pub const OP_SAXPY: u8 = 0x03;
/// `GEMM A=addr0 B=addr1 C=addr2 M=arg0 N=arg1 K=arg2`.
pub const OP_GEMM: u8 = 0x04;
/// `REDUCE x=addr0 out=addr1 n=arg0`.
pub const OP_REDUCE: u8 = 0x05;
/// `FENCE dst=addr0 value=imm64 vector=imm32`.
pub const OP_FENCE: u8 = 0x06;

/// Flag: raise the completion interrupt.
pub const FLAG_IRQ: u8 = 1;

/// An operand address: a guest IOVA or a VRAM offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Addr {
    /// Guest I/O virtual address (what the guest IOMMU translates).
    Iova(u64),
    /// Offset into the device's VRAM.
    Vram(u64),
}

impl Addr {
    fn raw(self) -> u64 {
        match self {
            Addr::Iova(a) | Addr::Vram(a) => a,
        }
    }
}

/// One ring command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cmd {
    /// `OP_*`.
    pub opcode: u8,
    /// `FLAG_*`.
    pub flags: u8,
    /// Bit i: operand i is a VRAM offset.
    pub space: u8,
    /// 32-bit immediate.
    pub imm32: u32,
    /// Operand addresses.
    pub addr: [u64; 3],
    /// Sizes.
    pub arg: [u64; 3],
    /// 64-bit immediate.
    pub imm64: u64,
}

impl Cmd {
    fn with(opcode: u8, ops: &[Addr], arg: [u64; 3]) -> Cmd {
        let mut c = Cmd {
            opcode,
            arg,
            ..Cmd::default()
        };
        for (i, op) in ops.iter().enumerate().take(3) {
            c.addr[i] = op.raw();
            if matches!(op, Addr::Vram(_)) {
                c.space |= 1 << i;
            }
        }
        c
    }

    /// `NOP`.
    pub fn nop() -> Cmd {
        Cmd::with(OP_NOP, &[], [0; 3])
    }

    /// `COPY len bytes src -> dst`.
    pub fn copy(src: Addr, dst: Addr, len: u64) -> Cmd {
        Cmd::with(OP_COPY, &[src, dst], [len, 0, 0])
    }

    /// `FILL len bytes at dst with the little-endian pattern`.
    pub fn fill(dst: Addr, len: u64, pattern: u32) -> Cmd {
        let mut c = Cmd::with(OP_FILL, &[dst], [len, 0, 0]);
        c.imm32 = pattern;
        c
    }

    /// `SAXPY y = a*x + y` over `n` f32.
    pub fn saxpy(x: Addr, y: Addr, n: u64, a: f32) -> Cmd {
        let mut c = Cmd::with(OP_SAXPY, &[x, y], [n, 0, 0]);
        c.imm32 = a.to_bits();
        c
    }

    /// `GEMM C[m×n] = A[m×k] · B[k×n]`.
    pub fn gemm(a: Addr, b: Addr, c_out: Addr, m: u64, n: u64, k: u64) -> Cmd {
        Cmd::with(OP_GEMM, &[a, b, c_out], [m, n, k])
    }

    /// `REDUCE out = Σ x[i]` over `n` f32.
    pub fn reduce(x: Addr, out: Addr, n: u64) -> Cmd {
        Cmd::with(OP_REDUCE, &[x, out], [n, 0, 0])
    }

    /// `FENCE`: write `value` (u64) at `dst`; with `vector`, raise that MSI-X vector.
    pub fn fence(dst: Addr, value: u64, vector: Option<u32>) -> Cmd {
        let mut c = Cmd::with(OP_FENCE, &[dst], [0; 3]);
        c.imm64 = value;
        if let Some(v) = vector {
            c.flags |= FLAG_IRQ;
            c.imm32 = v;
        }
        c
    }

    /// The command with `FLAG_IRQ` set (completion interrupt on the queue's vector).
    pub fn with_irq(mut self) -> Cmd {
        self.flags |= FLAG_IRQ;
        self
    }

    /// Whether this is a data job (everything but NOP and FENCE).
    pub fn is_job(&self) -> bool {
        matches!(
            self.opcode,
            OP_COPY | OP_FILL | OP_SAXPY | OP_GEMM | OP_REDUCE
        )
    }

    /// Bytes the engine reads plus writes for this command (the summary's `bytes_moved`):
    /// COPY and FILL count their length, SAXPY 12n (x, y read, y written), GEMM
    /// 4(MK + KN + MN), REDUCE 4n + 4.
    pub fn bytes_moved(&self) -> u64 {
        let [a0, a1, a2] = self.arg;
        match self.opcode {
            OP_COPY | OP_FILL => a0,
            OP_SAXPY => a0.saturating_mul(12),
            OP_GEMM => 4u64.saturating_mul(
                a0.saturating_mul(a2)
                    .saturating_add(a2.saturating_mul(a1))
                    .saturating_add(a0.saturating_mul(a1)),
            ),
            OP_REDUCE => a0.saturating_mul(4).saturating_add(4),
            _ => 0,
        }
    }

    /// The 64-byte little-endian ring entry.
    pub fn encode(&self) -> [u8; COMMAND_SIZE] {
        let mut b = [0u8; COMMAND_SIZE];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2] = self.space;
        b[3] = 0;
        b[4..8].copy_from_slice(&self.imm32.to_le_bytes());
        for i in 0..3 {
            b[8 + 8 * i..16 + 8 * i].copy_from_slice(&self.addr[i].to_le_bytes());
            b[0x20 + 8 * i..0x28 + 8 * i].copy_from_slice(&self.arg[i].to_le_bytes());
        }
        b[0x38..0x40].copy_from_slice(&self.imm64.to_le_bytes());
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_softgpu::cmd as dev;

    #[test]
    fn layout_by_hand() {
        let c = Cmd::gemm(
            Addr::Iova(0x1122_3344_5566_7788),
            Addr::Vram(0x40),
            Addr::Iova(0x2000),
            3,
            4,
            5,
        )
        .with_irq();
        let b = c.encode();
        assert_eq!(&b[0..4], &[OP_GEMM, FLAG_IRQ, 0b010, 0]);
        assert_eq!(&b[8..16], &[0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11]);
        assert_eq!(&b[0x10..0x18], &0x40u64.to_le_bytes());
        assert_eq!(&b[0x18..0x20], &0x2000u64.to_le_bytes());
        assert_eq!(&b[0x20..0x28], &3u64.to_le_bytes());
        assert_eq!(&b[0x28..0x30], &4u64.to_le_bytes());
        assert_eq!(&b[0x30..0x38], &5u64.to_le_bytes());
        let f = Cmd::fence(Addr::Vram(8), u64::MAX - 1, Some(13)).encode();
        assert_eq!(&f[0..4], &[OP_FENCE, FLAG_IRQ, 0b001, 0]);
        assert_eq!(&f[4..8], &13u32.to_le_bytes());
        assert_eq!(&f[0x38..0x40], &(u64::MAX - 1).to_le_bytes());
        let s = Cmd::saxpy(Addr::Iova(0), Addr::Iova(4), 7, -2.5).encode();
        assert_eq!(&s[4..8], &(-2.5f32).to_bits().to_le_bytes());
        assert_eq!(
            Cmd::fill(Addr::Iova(0), 9, 0xa1b2c3d4).encode()[4..8],
            [0xd4, 0xc3, 0xb2, 0xa1]
        );
        // A fence without an interrupt carries neither the flag nor a vector.
        let n = Cmd::fence(Addr::Iova(0x10), 1, None).encode();
        assert_eq!(&n[1..8], &[0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(Cmd::nop().encode(), [0u8; 64]);
    }

    fn dev_op(a: Addr) -> dev::Operand {
        match a {
            Addr::Iova(x) => dev::Operand::Guest(x),
            Addr::Vram(x) => dev::Operand::Vram(x),
        }
    }

    /// Every command encodes exactly as the device model's own encoder does.
    #[test]
    fn matches_the_device_model_encoder() {
        let ops = [
            Addr::Iova(0x1_0000_1000),
            Addr::Vram(0x3f_ffc0),
            Addr::Iova(u64::MAX - 63),
        ];
        for &x in &ops {
            for &y in &ops {
                for &z in &ops {
                    let pairs = [
                        (
                            Cmd::copy(x, y, 12345),
                            dev::Command::copy(dev_op(x), dev_op(y), 12345),
                        ),
                        (
                            Cmd::fill(x, 77, 0xdead_beef),
                            dev::Command::fill(dev_op(x), 77, 0xdead_beef),
                        ),
                        (
                            Cmd::saxpy(x, y, 99, 1.75),
                            dev::Command::saxpy(99, 1.75, dev_op(x), dev_op(y)),
                        ),
                        (
                            Cmd::gemm(x, y, z, 7, 8, 9).with_irq(),
                            dev::Command::gemm(7, 8, 9, dev_op(x), dev_op(y), dev_op(z)).with_irq(),
                        ),
                        (
                            Cmd::reduce(x, y, 5),
                            dev::Command::reduce(5, dev_op(x), dev_op(y)),
                        ),
                        (
                            Cmd::fence(x, 0x0102_0304_0506_0708, Some(15)),
                            dev::Command::fence(dev_op(x), 0x0102_0304_0506_0708, Some(15)),
                        ),
                        (
                            Cmd::fence(x, 3, None),
                            dev::Command::fence(dev_op(x), 3, None),
                        ),
                        (Cmd::nop().with_irq(), dev::Command::nop().with_irq()),
                    ];
                    for (ours, theirs) in pairs {
                        assert_eq!(ours.encode(), theirs.encode(), "{ours:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn job_accounting() {
        assert!(!Cmd::nop().is_job());
        assert!(!Cmd::fence(Addr::Iova(0), 1, None).is_job());
        assert!(Cmd::copy(Addr::Iova(0), Addr::Vram(0), 1).is_job());
        assert_eq!(
            Cmd::copy(Addr::Iova(0), Addr::Vram(0), 100).bytes_moved(),
            100
        );
        assert_eq!(
            Cmd::saxpy(Addr::Iova(0), Addr::Iova(0), 10, 1.0).bytes_moved(),
            120
        );
        let g = Cmd::gemm(Addr::Iova(0), Addr::Iova(0), Addr::Iova(0), 2, 3, 4);
        assert_eq!(g.bytes_moved(), 4 * (2 * 4 + 4 * 3 + 2 * 3));
        assert_eq!(
            Cmd::reduce(Addr::Iova(0), Addr::Iova(0), 10).bytes_moved(),
            44
        );
    }
}
