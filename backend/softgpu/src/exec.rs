//! Command execution: decoding, operand validation and the data paths of each command.
//!
//! Every command validates all of its operand ranges (VRAM bounds, DMA mapping and permission)
//! before it writes anything, so a bad command never leaves a partial result behind unless the
//! client unmaps memory while the command runs.

use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicBool, Ordering};

use std::sync::{Arc, OnceLock};

use switchyard_device::DmaError;
use switchyard_device::dma::DmaSpace;

use crate::accel::{AccelDevice, AccelOutcome};
use crate::cmd::{self, COMMAND_SIZE, Command, Operand};
use crate::regs::*;
use crate::vram::Vram;

/// Guest→guest copies bounce through chunks of this size.
const BOUNCE_CHUNK: usize = 1 << 20;
/// Guest↔VRAM copies and fills are split into chunks of this size (abort points).
const XFER_CHUNK: u64 = 16 << 20;
/// Elements per chunk of the streaming compute commands.
const ELEM_CHUNK: usize = 1 << 16;
/// Rows of C computed per GEMM block.
const GEMM_ROWS: usize = 8;
/// Columns of C per GEMM tile.
const GEMM_COLS: usize = 512;
/// Scratch buffers larger than this are released after a command.
const SCRATCH_KEEP: usize = 4 << 20;

/// Why a command did not complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExecError {
    /// The command faulted: `ERR_*` code and address.
    Fault {
        /// `ERR_*`.
        code: u32,
        /// Faulting address.
        addr: u64,
    },
    /// The engine was asked to stop (reset, restore, shutdown), or a quiesce cancelled its
    /// wait for the client; nothing is recorded.
    Aborted,
    /// The accelerator running the command lost its board (see `crate::accel`): the
    /// command did not complete; why is in [`Executor::take_lost`].
    BoardLost,
}

fn fault(code: u32, addr: u64) -> ExecError {
    ExecError::Fault { code, addr }
}

/// The interrupt a completed command asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Irq {
    None,
    /// The queue's completion vector.
    Queue,
    /// An explicit vector (FENCE).
    Vector(u32),
}

/// A completed command.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Done {
    pub irq: Irq,
    pub fence: bool,
}

/// Result of running one ring entry.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Outcome {
    /// Opcode of the command (0 if it could not be fetched).
    pub opcode: u32,
    pub result: Result<Done, ExecError>,
    /// Bytes the command produces (its output operand's size), for the work counters.
    pub bytes: u64,
}

impl Outcome {
    /// The VRAM failed while the command at `slot` ran: whatever it did, it does not
    /// complete. It fails with `ERR_DEVICE_LOST`, unless it was abandoned (nothing recorded;
    /// it stays in flight and fails so when its engine looks at it again).
    pub(crate) fn device_lost(self, slot: u64) -> Outcome {
        let result = match self.result {
            Err(ExecError::Aborted) => Err(ExecError::Aborted),
            _ => Err(fault(ERR_DEVICE_LOST, slot)),
        };
        Outcome { result, ..self }
    }
}

/// Per-engine buffers, reused across commands.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    bytes: Vec<u8>,
    x: Vec<f32>,
    y: Vec<f32>,
    b: Vec<f32>,
}

impl Scratch {
    /// Releases buffers a very large command grew.
    pub(crate) fn trim(&mut self) {
        if self.bytes.capacity() > SCRATCH_KEEP {
            self.bytes = Vec::new();
        }
        for v in [&mut self.x, &mut self.y, &mut self.b] {
            if v.capacity() * 4 > SCRATCH_KEEP {
                *v = Vec::new();
            }
        }
    }
}

/// The `ERR_*` code and faulting address of a DMA error.
fn dma_error(e: &DmaError, fallback: u64) -> (u32, u64) {
    match *e {
        DmaError::Unmapped { iova } | DmaError::Remote { iova, .. } | DmaError::Fault { iova } => {
            (ERR_DMA_UNMAPPED, iova)
        }
        DmaError::Permission { iova, .. } => (ERR_DMA_PERMISSION, iova),
        DmaError::Overflow { iova, .. } => (ERR_BAD_COMMAND, iova),
        _ => (ERR_DMA_UNMAPPED, fallback),
    }
}

/// Whether a DMA error is the server cancelling a wait on the client because the device is
/// being quiesced (see `device.rs`): the command is abandoned, not failed.
fn cancelled(e: &DmaError) -> bool {
    matches!(e, DmaError::Remote { errno, .. } if *errno == libc::ECANCELED)
}

fn dma_fault(e: &DmaError, fallback: u64) -> ExecError {
    if cancelled(e) {
        return ExecError::Aborted;
    }
    let (code, addr) = dma_error(e, fallback);
    fault(code, addr)
}

fn to_usize(v: u64) -> Result<usize, ExecError> {
    usize::try_from(v).map_err(|_| fault(ERR_LIMIT, v))
}

fn bytes_to_f32(bytes: &[u8], out: &mut Vec<f32>) {
    out.extend(
        bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
    );
}

fn f32_to_bytes(vals: &[f32], out: &mut Vec<u8>) {
    out.clear();
    out.reserve(vals.len() * 4);
    for v in vals {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

/// The VRAM range a command writes, if its output operand is in VRAM (unvalidated; the log
/// clamps it).
fn vram_output(c: &Command) -> Option<(u64, u64)> {
    match output(c)? {
        (Operand::Vram(off), len) => Some((off, len)),
        (Operand::Guest(_), _) => None,
    }
}

/// The output operand of `c` and its size in bytes.
fn output(c: &Command) -> Option<(Operand, u64)> {
    let (operand, len) = match c.opcode {
        cmd::OP_COPY => (1, c.arg[0]),
        cmd::OP_FILL => (0, c.arg[0]),
        cmd::OP_SAXPY => (1, c.arg[0].saturating_mul(4)),
        cmd::OP_GEMM => (2, c.arg[0].saturating_mul(c.arg[1]).saturating_mul(4)),
        cmd::OP_REDUCE => (1, 4),
        cmd::OP_FENCE => (0, 8),
        _ => return None,
    };
    Some((c.operand(operand), len))
}

/// What an engine needs to execute commands.
pub(crate) struct Executor<'a> {
    pub dma: &'a DmaSpace,
    pub vram: &'a Vram,
    pub abort: &'a AtomicBool,
    /// The engine is to die (an injected fault): it panics at its next checkpoint.
    pub fail: &'a AtomicBool,
    /// The engine's queue.
    pub queue: usize,
    /// The board's accelerator, once the device has one (set after the engines start).
    pub accel: &'a OnceLock<Arc<dyn AccelDevice>>,
    /// The last command ran on the accelerator.
    pub offloaded: Cell<bool>,
    /// Why the accelerator's board was lost (after [`ExecError::BoardLost`]).
    pub lost: RefCell<Option<String>>,
    /// Tests park engines in the middle of a command through it: (hook, queue).
    #[cfg(test)]
    pub hook: (&'a crate::device::TestHook, usize),
}

impl Executor<'_> {
    fn check_abort(&self) -> Result<(), ExecError> {
        #[cfg(test)]
        self.hook.0.checkpoint(self.hook.1);
        if self.fail.load(Ordering::Relaxed) {
            // Not under the register lock: engines execute commands without it.
            panic!("injected fault: engine of queue {}", self.queue);
        }
        if self.abort.load(Ordering::Relaxed) {
            Err(ExecError::Aborted)
        } else if !self.vram.usable() {
            // The device is lost: stop at once (the engine records where).
            Err(fault(ERR_DEVICE_LOST, 0))
        } else {
            Ok(())
        }
    }

    /// Validates that `len` bytes at `op` can be read (or written).
    fn check(&self, op: Operand, len: u64, write: bool) -> Result<(), ExecError> {
        match op {
            Operand::Vram(off) => {
                if self.vram.contains(off, len) {
                    Ok(())
                } else {
                    Err(fault(ERR_VRAM_RANGE, off))
                }
            }
            Operand::Guest(iova) => self
                .dma
                .validate(iova, len, write)
                .map_err(|e| dma_fault(&e, iova)),
        }
    }

    fn read(&self, op: Operand, buf: &mut [u8]) -> Result<(), ExecError> {
        match op {
            Operand::Vram(off) => {
                let s = self
                    .vram
                    .slice(off, buf.len() as u64)
                    .ok_or(fault(ERR_VRAM_RANGE, off))?;
                s.copy_to(buf);
                Ok(())
            }
            Operand::Guest(iova) => self.dma.read(iova, buf).map_err(|e| dma_fault(&e, iova)),
        }
    }

    fn write(&self, op: Operand, data: &[u8]) -> Result<(), ExecError> {
        match op {
            Operand::Vram(off) => {
                let s = self
                    .vram
                    .slice(off, data.len() as u64)
                    .ok_or(fault(ERR_VRAM_RANGE, off))?;
                s.copy_from(data);
                Ok(())
            }
            Operand::Guest(iova) => self.dma.write(iova, data).map_err(|e| dma_fault(&e, iova)),
        }
    }

    /// Appends `count` f32 read from `op` to `out`, converting through `bytes` in chunks.
    fn read_f32(
        &self,
        op: Operand,
        count: usize,
        out: &mut Vec<f32>,
        bytes: &mut Vec<u8>,
    ) -> Result<(), ExecError> {
        out.clear();
        out.reserve(count);
        let mut done = 0;
        while done < count {
            let n = ELEM_CHUNK.min(count - done);
            bytes.clear();
            bytes.resize(n * 4, 0);
            self.read(op.offset(done as u64 * 4), bytes)?;
            bytes_to_f32(bytes, out);
            done += n;
        }
        Ok(())
    }

    /// Writes `vals` to `op`, converting through `bytes` in chunks.
    fn write_f32(&self, op: Operand, vals: &[f32], bytes: &mut Vec<u8>) -> Result<(), ExecError> {
        for (i, chunk) in vals.chunks(ELEM_CHUNK).enumerate() {
            f32_to_bytes(chunk, bytes);
            self.write(op.offset((i * ELEM_CHUNK) as u64 * 4), bytes)?;
        }
        Ok(())
    }

    /// Fetches and runs the command in the ring slot at `slot`.
    pub(crate) fn run(&self, slot: u64, s: &mut Scratch) -> Outcome {
        let mut raw = [0u8; COMMAND_SIZE];
        if let Err(e) = self.dma.read(slot, &mut raw) {
            let result = if cancelled(&e) {
                Err(ExecError::Aborted)
            } else {
                Err(fault(ERR_RING_FETCH, dma_error(&e, slot).1))
            };
            return Outcome {
                opcode: 0,
                result,
                bytes: 0,
            };
        }
        let c = Command::decode(&raw);
        self.offloaded.set(false);
        let result = self.execute(&c, slot, s);
        // Logged after the writes (whatever the outcome: an abandoned command may have
        // written part of its output), so a migration round that takes the bit sees them.
        if let Some((off, len)) = vram_output(&c) {
            self.vram.mark(off, len);
            if !self.offloaded.get() {
                // Written here, not by the accelerator: its copy of those bytes is stale.
                self.vram.host_wrote(off, len);
            }
        }
        Outcome {
            opcode: u32::from(c.opcode),
            result,
            bytes: output(&c).map_or(0, |(_, len)| len),
        }
    }

    fn execute(&self, c: &Command, slot: u64, s: &mut Scratch) -> Result<Done, ExecError> {
        // Checks the header of a command with `operands` operands: no unknown flags, reserved
        // byte zero, no space bits of unused operands.
        let header = |operands: u32| {
            if c.flags & !cmd::FLAG_IRQ != 0 || c.reserved != 0 || c.space >> operands != 0 {
                return Err(fault(ERR_BAD_COMMAND, slot));
            }
            let irq = if c.flags & cmd::FLAG_IRQ != 0 {
                Irq::Queue
            } else {
                Irq::None
            };
            Ok(Done { irq, fence: false })
        };
        match c.opcode {
            cmd::OP_NOP => header(0),
            cmd::OP_COPY => header(2).and_then(|d| self.copy(c, slot, s).map(|()| d)),
            cmd::OP_FILL => header(1).and_then(|d| self.fill(c, slot, s).map(|()| d)),
            cmd::OP_SAXPY => header(2).and_then(|d| self.saxpy(c, slot, s).map(|()| d)),
            cmd::OP_GEMM => header(3).and_then(|d| self.gemm(c, slot, s).map(|()| d)),
            cmd::OP_REDUCE => header(2).and_then(|d| self.reduce(c, slot, s).map(|()| d)),
            cmd::OP_FENCE => header(1).and_then(|_| self.fence(c, slot)),
            _ => Err(fault(ERR_BAD_OPCODE, slot)),
        }
    }

    /// Runs validated command `c` on the accelerator, if the device has one and it takes
    /// the command; `None`: the CPU path runs it.
    fn offload(&self, c: &Command) -> Option<Result<(), ExecError>> {
        let accel = self.accel.get()?;
        if let Err(e) = self.check_abort() {
            return Some(Err(e));
        }
        match accel.run(self.queue, c) {
            AccelOutcome::Declined => None,
            AccelOutcome::Done => {
                self.offloaded.set(true);
                Some(Ok(()))
            }
            AccelOutcome::Fault { code, addr } => {
                self.offloaded.set(true);
                Some(Err(fault(code, addr)))
            }
            AccelOutcome::Lost(reason) => {
                self.offloaded.set(true);
                *self.lost.borrow_mut() = Some(reason);
                Some(Err(ExecError::BoardLost))
            }
        }
    }

    /// Why the accelerator's board was lost, once (after [`ExecError::BoardLost`]).
    pub(crate) fn take_lost(&self) -> Option<String> {
        self.lost.borrow_mut().take()
    }

    fn copy(&self, c: &Command, slot: u64, s: &mut Scratch) -> Result<(), ExecError> {
        let (src, dst, len) = (c.operand(0), c.operand(1), c.arg[0]);
        if len > MAX_XFER_BYTES_VALUE {
            return Err(fault(ERR_LIMIT, slot));
        }
        self.check(src, len, false)?;
        self.check(dst, len, true)?;
        if len == 0 {
            return Ok(());
        }
        if let Some(r) = self.offload(c) {
            return r;
        }
        match (src, dst) {
            (Operand::Vram(so), Operand::Vram(d)) => {
                let from = self.vram.slice(so, len).ok_or(fault(ERR_VRAM_RANGE, so))?;
                let to = self.vram.slice(d, len).ok_or(fault(ERR_VRAM_RANGE, d))?;
                // memmove semantics: overlapping VRAM ranges copy as if through a buffer.
                from.copy_to_volatile_slice(to);
            }
            (Operand::Guest(iova), Operand::Vram(d)) => {
                let mut off = 0;
                while off < len {
                    self.check_abort()?;
                    let n = XFER_CHUNK.min(len - off);
                    let to = self
                        .vram
                        .slice(d + off, n)
                        .ok_or(fault(ERR_VRAM_RANGE, d))?;
                    self.dma
                        .copy_to_slice(iova + off, &to)
                        .map_err(|e| dma_fault(&e, iova))?;
                    off += n;
                }
            }
            (Operand::Vram(so), Operand::Guest(iova)) => {
                let mut off = 0;
                while off < len {
                    self.check_abort()?;
                    let n = XFER_CHUNK.min(len - off);
                    let from = self
                        .vram
                        .slice(so + off, n)
                        .ok_or(fault(ERR_VRAM_RANGE, so))?;
                    self.dma
                        .copy_from_slice(iova + off, &from)
                        .map_err(|e| dma_fault(&e, iova))?;
                    off += n;
                }
            }
            (Operand::Guest(_), Operand::Guest(_)) => {
                let total = to_usize(len)?;
                let mut off = 0usize;
                while off < total {
                    self.check_abort()?;
                    let n = BOUNCE_CHUNK.min(total - off);
                    s.bytes.clear();
                    s.bytes.resize(n, 0);
                    self.read(src.offset(off as u64), &mut s.bytes)?;
                    self.write(dst.offset(off as u64), &s.bytes)?;
                    off += n;
                }
            }
        }
        Ok(())
    }

    fn fill(&self, c: &Command, slot: u64, s: &mut Scratch) -> Result<(), ExecError> {
        let (dst, len) = (c.operand(0), c.arg[0]);
        if len > MAX_XFER_BYTES_VALUE {
            return Err(fault(ERR_LIMIT, slot));
        }
        self.check(dst, len, true)?;
        let total = to_usize(len)?;
        if total > 0
            && let Some(r) = self.offload(c)
        {
            return r;
        }
        // Chunks are multiples of 4, so each starts at pattern phase 0.
        let chunk = BOUNCE_CHUNK.min(total);
        let pattern = c.imm32.to_le_bytes();
        s.bytes.clear();
        s.bytes.extend(
            pattern
                .iter()
                .copied()
                .cycle()
                .take(chunk.next_multiple_of(4)),
        );
        let mut off = 0usize;
        while off < total {
            self.check_abort()?;
            let n = chunk.min(total - off);
            let data = s.bytes.get(..n).ok_or(fault(ERR_LIMIT, slot))?;
            self.write(dst.offset(off as u64), data)?;
            off += n;
        }
        Ok(())
    }

    fn check_aligned(op: Operand, align: u64) -> Result<(), ExecError> {
        if op.addr().is_multiple_of(align) {
            Ok(())
        } else {
            Err(fault(ERR_BAD_COMMAND, op.addr()))
        }
    }

    fn saxpy(&self, c: &Command, slot: u64, s: &mut Scratch) -> Result<(), ExecError> {
        let (x, y, n) = (c.operand(0), c.operand(1), c.arg[0]);
        if n > MAX_ELEMENTS_VALUE {
            return Err(fault(ERR_LIMIT, slot));
        }
        Self::check_aligned(x, 4)?;
        Self::check_aligned(y, 4)?;
        let bytes = n * 4;
        self.check(x, bytes, false)?;
        self.check(y, bytes, false)?;
        self.check(y, bytes, true)?;
        let a = f32::from_bits(c.imm32);
        let total = to_usize(n)?;
        if total > 0
            && let Some(r) = self.offload(c)
        {
            return r;
        }
        let mut done = 0usize;
        while done < total {
            self.check_abort()?;
            let k = ELEM_CHUNK.min(total - done);
            let off = done as u64 * 4;
            self.read_f32(x.offset(off), k, &mut s.x, &mut s.bytes)?;
            self.read_f32(y.offset(off), k, &mut s.y, &mut s.bytes)?;
            for (yv, &xv) in s.y.iter_mut().zip(&s.x) {
                *yv += a * xv;
            }
            self.write_f32(y.offset(off), &s.y, &mut s.bytes)?;
            done += k;
        }
        Ok(())
    }

    fn gemm(&self, c: &Command, slot: u64, s: &mut Scratch) -> Result<(), ExecError> {
        let (a_op, b_op, c_op) = (c.operand(0), c.operand(1), c.operand(2));
        let [m, n, k] = c.arg;
        if m > MAX_GEMM_DIM_VALUE
            || n > MAX_GEMM_DIM_VALUE
            || k > MAX_GEMM_DIM_VALUE
            || m * n * k > MAX_GEMM_WORK_VALUE
        {
            return Err(fault(ERR_LIMIT, slot));
        }
        for op in [a_op, b_op, c_op] {
            Self::check_aligned(op, 4)?;
        }
        self.check(a_op, m * k * 4, false)?;
        self.check(b_op, k * n * 4, false)?;
        self.check(c_op, m * n * 4, true)?;
        let (m, n, k) = (to_usize(m)?, to_usize(n)?, to_usize(k)?);
        if m == 0 || n == 0 {
            return Ok(());
        }
        if k > 0
            && let Some(r) = self.offload(c)
        {
            return r;
        }
        if k == 0 {
            // Every element is an empty sum: 0.0.
            s.y.clear();
            s.y.resize(n * GEMM_ROWS.min(m), 0.0);
            let mut i0 = 0;
            while i0 < m {
                let rows = GEMM_ROWS.min(m - i0);
                let block = s.y.get(..rows * n).ok_or(fault(ERR_LIMIT, slot))?;
                self.write_f32(c_op.offset((i0 * n) as u64 * 4), block, &mut s.bytes)?;
                i0 += rows;
            }
            return Ok(());
        }
        self.read_f32(b_op, k * n, &mut s.b, &mut s.bytes)?;
        let mut i0 = 0;
        while i0 < m {
            self.check_abort()?;
            let rows = GEMM_ROWS.min(m - i0);
            self.read_f32(
                a_op.offset((i0 * k) as u64 * 4),
                rows * k,
                &mut s.x,
                &mut s.bytes,
            )?;
            s.y.clear();
            s.y.resize(rows * n, 0.0);
            for (a_row, c_row) in s.x.chunks_exact(k).zip(s.y.chunks_exact_mut(n)) {
                let mut j0 = 0;
                while j0 < n {
                    let j1 = (j0 + GEMM_COLS).min(n);
                    if let Some(c_tile) = c_row.get_mut(j0..j1) {
                        // For each C[i][j]: acc = 0.0; acc = acc + A[i][k]*B[k][j] for k
                        // ascending. Separate multiply and add (Rust never fuses them).
                        for (&a, b_row) in a_row.iter().zip(s.b.chunks_exact(n)) {
                            if let Some(b_tile) = b_row.get(j0..j1) {
                                for (cv, &bv) in c_tile.iter_mut().zip(b_tile) {
                                    *cv += a * bv;
                                }
                            }
                        }
                    }
                    j0 = j1;
                }
            }
            self.write_f32(c_op.offset((i0 * n) as u64 * 4), &s.y, &mut s.bytes)?;
            i0 += rows;
        }
        Ok(())
    }

    fn reduce(&self, c: &Command, slot: u64, s: &mut Scratch) -> Result<(), ExecError> {
        let (x, out, n) = (c.operand(0), c.operand(1), c.arg[0]);
        if n > MAX_ELEMENTS_VALUE {
            return Err(fault(ERR_LIMIT, slot));
        }
        Self::check_aligned(x, 4)?;
        Self::check_aligned(out, 4)?;
        self.check(x, n * 4, false)?;
        self.check(out, 4, true)?;
        let total = to_usize(n)?;
        if let Some(r) = self.offload(c) {
            return r;
        }
        let mut acc = 0.0f32;
        let mut done = 0usize;
        while done < total {
            self.check_abort()?;
            let k = ELEM_CHUNK.min(total - done);
            self.read_f32(x.offset(done as u64 * 4), k, &mut s.x, &mut s.bytes)?;
            for &v in &s.x {
                acc += v;
            }
            done += k;
        }
        self.write(out, &acc.to_le_bytes())
    }

    fn fence(&self, c: &Command, slot: u64) -> Result<Done, ExecError> {
        let dst = c.operand(0);
        Self::check_aligned(dst, 8)?;
        let irq = if c.flags & cmd::FLAG_IRQ != 0 {
            let v = c.imm32;
            if v >= MSIX_VECTORS {
                return Err(fault(ERR_BAD_COMMAND, slot));
            }
            Irq::Vector(v)
        } else {
            Irq::None
        };
        // Everything earlier in this queue is complete; make it visible before the value.
        std::sync::atomic::fence(Ordering::SeqCst);
        // Checks the whole range (VRAM bounds, mapping, permission) before writing anything.
        self.write(dst, &c.imm64.to_le_bytes())?;
        Ok(Done { irq, fence: true })
    }
}
