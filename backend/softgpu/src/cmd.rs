//! The 64-byte command format of the rings, with an encoder/decoder for drivers and tests.
//!
//! All fields are little-endian:
//!
//! | offset | size | field    | meaning                                                      |
//! |-------:|-----:|----------|--------------------------------------------------------------|
//! | 0x00   | 1    | `opcode` | `OP_*`                                                       |
//! | 0x01   | 1    | `flags`  | bit 0 [`FLAG_IRQ`]; bits 7:1 reserved (must be 0)            |
//! | 0x02   | 1    | `space`  | bit i set: `addr[i]` is a VRAM offset, clear: a guest IOVA   |
//! | 0x03   | 1    | reserved | must be 0                                                    |
//! | 0x04   | 4    | `imm32`  | FILL pattern, SAXPY `a` (f32 bits), FENCE vector             |
//! | 0x08   | 8    | `addr0`  | first operand address                                        |
//! | 0x10   | 8    | `addr1`  | second operand address                                       |
//! | 0x18   | 8    | `addr2`  | third operand address                                        |
//! | 0x20   | 8    | `arg0`   | length / element count / M                                  |
//! | 0x28   | 8    | `arg1`   | N                                                            |
//! | 0x30   | 8    | `arg2`   | K                                                            |
//! | 0x38   | 8    | `imm64`  | FENCE value                                                  |

/// Size of one command (and ring entry).
pub const COMMAND_SIZE: usize = 64;

/// Does nothing (completes, may interrupt).
pub const OP_NOP: u8 = 0x00;
/// `COPY src=addr0 dst=addr1 len=arg0` (bytes).
pub const OP_COPY: u8 = 0x01;
/// `FILL dst=addr0 len=arg0 pattern=imm32`.
pub const OP_FILL: u8 = 0x02;
/// `SAXPY x=addr0 y=addr1 n=arg0 a=f32::from_bits(imm32)`: `y[i] = a*x[i] + y[i]`.
pub const OP_SAXPY: u8 = 0x03;
/// `GEMM A=addr0 B=addr1 C=addr2 M=arg0 N=arg1 K=arg2`: `C = A·B` (f32, row-major).
pub const OP_GEMM: u8 = 0x04;
/// `REDUCE x=addr0 out=addr1 n=arg0`: `out = Σ x[i]` (f32, sequential ascending order).
pub const OP_REDUCE: u8 = 0x05;
/// `FENCE dst=addr0 value=imm64 vector=imm32[15:0]`.
pub const OP_FENCE: u8 = 0x06;

/// `flags` bit 0: raise the completion interrupt when this command completes (for `FENCE`:
/// the vector in `imm32[15:0]`, otherwise the queue's `COMPLETION_VECTOR`).
pub const FLAG_IRQ: u8 = 1 << 0;
/// `space` bit for operand `i`: the address is a VRAM offset.
pub const fn space_vram(i: usize) -> u8 {
    1 << i
}

/// Byte offsets of the fields.
pub mod field {
    /// Opcode.
    pub const OPCODE: usize = 0x00;
    /// Flags.
    pub const FLAGS: usize = 0x01;
    /// Operand spaces.
    pub const SPACE: usize = 0x02;
    /// Reserved byte.
    pub const RESERVED: usize = 0x03;
    /// 32-bit immediate.
    pub const IMM32: usize = 0x04;
    /// Operand addresses (3 × u64).
    pub const ADDR0: usize = 0x08;
    /// Sizes (3 × u64).
    pub const ARG0: usize = 0x20;
    /// 64-bit immediate.
    pub const IMM64: usize = 0x38;
}

/// Where an operand lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operand {
    /// A guest IOVA (DMA through the client's windows).
    Guest(u64),
    /// An offset into VRAM.
    Vram(u64),
}

impl Operand {
    /// The raw address.
    pub fn addr(self) -> u64 {
        match self {
            Operand::Guest(a) | Operand::Vram(a) => a,
        }
    }

    /// Whether it addresses VRAM.
    pub fn is_vram(self) -> bool {
        matches!(self, Operand::Vram(_))
    }

    /// The operand `bytes` further on (wrapping; ranges are validated before use).
    pub(crate) fn offset(self, bytes: u64) -> Operand {
        match self {
            Operand::Guest(a) => Operand::Guest(a.wrapping_add(bytes)),
            Operand::Vram(a) => Operand::Vram(a.wrapping_add(bytes)),
        }
    }
}

/// One decoded command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Command {
    /// `OP_*`.
    pub opcode: u8,
    /// `FLAG_*`.
    pub flags: u8,
    /// Operand space bits.
    pub space: u8,
    /// Reserved byte (must be 0).
    pub reserved: u8,
    /// 32-bit immediate.
    pub imm32: u32,
    /// Operand addresses.
    pub addr: [u64; 3],
    /// Sizes.
    pub arg: [u64; 3],
    /// 64-bit immediate.
    pub imm64: u64,
}

fn le_u64(b: &[u8; COMMAND_SIZE], off: usize) -> u64 {
    let mut v = [0u8; 8];
    if let Some(s) = b.get(off..off + 8) {
        v.copy_from_slice(s);
    }
    u64::from_le_bytes(v)
}

impl Command {
    /// Decodes a ring entry.
    pub fn decode(b: &[u8; COMMAND_SIZE]) -> Command {
        let mut imm = [0u8; 4];
        imm.copy_from_slice(&b[field::IMM32..field::IMM32 + 4]);
        Command {
            opcode: b[field::OPCODE],
            flags: b[field::FLAGS],
            space: b[field::SPACE],
            reserved: b[field::RESERVED],
            imm32: u32::from_le_bytes(imm),
            addr: [
                le_u64(b, field::ADDR0),
                le_u64(b, field::ADDR0 + 8),
                le_u64(b, field::ADDR0 + 16),
            ],
            arg: [
                le_u64(b, field::ARG0),
                le_u64(b, field::ARG0 + 8),
                le_u64(b, field::ARG0 + 16),
            ],
            imm64: le_u64(b, field::IMM64),
        }
    }

    /// Encodes the command as a ring entry.
    pub fn encode(&self) -> [u8; COMMAND_SIZE] {
        let mut b = [0u8; COMMAND_SIZE];
        b[field::OPCODE] = self.opcode;
        b[field::FLAGS] = self.flags;
        b[field::SPACE] = self.space;
        b[field::RESERVED] = self.reserved;
        b[field::IMM32..field::IMM32 + 4].copy_from_slice(&self.imm32.to_le_bytes());
        for i in 0..3 {
            let a = field::ADDR0 + 8 * i;
            b[a..a + 8].copy_from_slice(&self.addr[i].to_le_bytes());
            let s = field::ARG0 + 8 * i;
            b[s..s + 8].copy_from_slice(&self.arg[i].to_le_bytes());
        }
        b[field::IMM64..field::IMM64 + 8].copy_from_slice(&self.imm64.to_le_bytes());
        b
    }

    /// Operand `i` with its space.
    pub fn operand(&self, i: usize) -> Operand {
        let a = self.addr.get(i).copied().unwrap_or(0);
        if self.space & space_vram(i) != 0 {
            Operand::Vram(a)
        } else {
            Operand::Guest(a)
        }
    }

    fn set_operand(&mut self, i: usize, op: Operand) {
        if let Some(a) = self.addr.get_mut(i) {
            *a = op.addr();
        }
        if op.is_vram() {
            self.space |= space_vram(i);
        } else {
            self.space &= !space_vram(i);
        }
    }

    fn with_ops(opcode: u8, ops: &[Operand]) -> Command {
        let mut c = Command {
            opcode,
            ..Command::default()
        };
        for (i, &op) in ops.iter().enumerate() {
            c.set_operand(i, op);
        }
        c
    }

    /// `NOP`.
    pub fn nop() -> Command {
        Command::with_ops(OP_NOP, &[])
    }

    /// `COPY len bytes from src to dst`.
    pub fn copy(src: Operand, dst: Operand, len: u64) -> Command {
        let mut c = Command::with_ops(OP_COPY, &[src, dst]);
        c.arg[0] = len;
        c
    }

    /// `FILL len bytes at dst with the little-endian 32-bit pattern`.
    pub fn fill(dst: Operand, len: u64, pattern: u32) -> Command {
        let mut c = Command::with_ops(OP_FILL, &[dst]);
        c.arg[0] = len;
        c.imm32 = pattern;
        c
    }

    /// `SAXPY`: `y[i] = a*x[i] + y[i]` for `n` f32 elements.
    pub fn saxpy(n: u64, a: f32, x: Operand, y: Operand) -> Command {
        let mut c = Command::with_ops(OP_SAXPY, &[x, y]);
        c.arg[0] = n;
        c.imm32 = a.to_bits();
        c
    }

    /// `GEMM`: `C (M×N) = A (M×K) · B (K×N)`.
    pub fn gemm(m: u64, n: u64, k: u64, a: Operand, b: Operand, c_out: Operand) -> Command {
        let mut c = Command::with_ops(OP_GEMM, &[a, b, c_out]);
        c.arg = [m, n, k];
        c
    }

    /// `REDUCE`: `out = Σ x[i]` over `n` f32 elements.
    pub fn reduce(n: u64, x: Operand, out: Operand) -> Command {
        let mut c = Command::with_ops(OP_REDUCE, &[x, out]);
        c.arg[0] = n;
        c
    }

    /// `FENCE`: write `value` to `dst`, bump the fence counter; with `irq_vector` raise that
    /// MSI-X vector (in MSI mode the single MSI vector; `irq_vector` must still be < 16).
    pub fn fence(dst: Operand, value: u64, irq_vector: Option<u16>) -> Command {
        let mut c = Command::with_ops(OP_FENCE, &[dst]);
        c.imm64 = value;
        if let Some(v) = irq_vector {
            c.flags |= FLAG_IRQ;
            c.imm32 = u32::from(v);
        }
        c
    }

    /// The same command with [`FLAG_IRQ`] set.
    pub fn with_irq(mut self) -> Command {
        self.flags |= FLAG_IRQ;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_roundtrip_and_layout() {
        let c = Command::gemm(
            3,
            4,
            5,
            Operand::Guest(0x1000),
            Operand::Vram(0x40),
            Operand::Guest(0x2000),
        )
        .with_irq();
        let b = c.encode();
        assert_eq!(b[0], OP_GEMM);
        assert_eq!(b[1], FLAG_IRQ);
        assert_eq!(b[2], 0b010);
        assert_eq!(&b[0x10..0x18], &0x40u64.to_le_bytes());
        assert_eq!(&b[0x20..0x28], &3u64.to_le_bytes());
        assert_eq!(&b[0x30..0x38], &5u64.to_le_bytes());
        assert_eq!(Command::decode(&b), c);
        assert_eq!(c.operand(1), Operand::Vram(0x40));
        assert_eq!(c.operand(2), Operand::Guest(0x2000));
        let f = Command::fence(Operand::Guest(8), u64::MAX, Some(3));
        let fb = f.encode();
        assert_eq!(&fb[0x38..0x40], &u64::MAX.to_le_bytes());
        assert_eq!(&fb[4..8], &3u32.to_le_bytes());
    }
}
