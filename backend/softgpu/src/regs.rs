//! BAR0 register map, PCI identity and device limits.
//!
//! Every register is 32 bits wide, little-endian. 64-bit quantities are split into a `LO`
//! register at an 8-byte aligned offset and a `HI` register 4 bytes above it; an 8-byte access
//! at the `LO` offset reads (or writes) both halves atomically with respect to the device. The
//! crate documentation has the full table with access rules.

/// Size of BAR0 (registers).
pub const BAR0_SIZE: u64 = 64 << 10;
/// Size of BAR4 (MSI-X table and PBA; BAR4 is absent in MSI mode).
pub const BAR4_SIZE: u64 = 4 << 10;
/// Offset of the MSI-X table in BAR4.
pub const MSIX_TABLE_OFFSET: u64 = 0x0;
/// Offset of the MSI-X pending-bit array in BAR4.
pub const MSIX_PBA_OFFSET: u64 = 0x800;
/// Number of MSI-X vectors (in MSI-X mode; MSI mode has none and one MSI vector instead).
pub const MSIX_VECTORS: u32 = 16;

/// PCI vendor ID (the de-facto test vendor; no Linux driver binds 1234:5347).
pub const PCI_VENDOR_ID: u16 = 0x1234;
/// PCI device ID ("SG").
pub const PCI_DEVICE_ID: u16 = 0x5347;
/// PCI subsystem vendor ID.
pub const PCI_SUBSYSTEM_VENDOR_ID: u16 = 0x1234;
/// PCI subsystem ID.
pub const PCI_SUBSYSTEM_ID: u16 = 0x0001;
/// PCI revision.
pub const PCI_REVISION: u8 = 1;
/// PCI class code: display controller (0x03), 3D controller (0x02), prog-if 0.
pub const PCI_CLASS: u32 = 0x03_02_00;

/// `MAGIC` value: the bytes `"SYGP"` in memory order.
pub const MAGIC_VALUE: u32 = u32::from_le_bytes(*b"SYGP");
/// `VERSION` value: major in bits 31:16, minor in bits 15:0. Minor 1 added the doorbell page
/// ([`FEATURE_DOORBELL_PAGE`]).
pub const VERSION_VALUE: u32 = 0x0001_0001;

/// Identification magic, reads [`MAGIC_VALUE`] (RO).
pub const MAGIC: u64 = 0x000;
/// Register interface version, reads [`VERSION_VALUE`] (RO).
pub const VERSION: u64 = 0x004;
/// Feature bits, `FEATURE_*` (RO).
pub const FEATURES: u64 = 0x008;
/// Number of command queues (RO).
pub const NUM_QUEUES: u64 = 0x00c;
/// VRAM size in bytes, low half (RO).
pub const VRAM_SIZE_LO: u64 = 0x010;
/// VRAM size in bytes, high half (RO).
pub const VRAM_SIZE_HI: u64 = 0x014;
/// Global fence counter, low half (RO). Incremented by every completed `FENCE`.
pub const FENCE_COUNT_LO: u64 = 0x018;
/// Global fence counter, high half (RO).
pub const FENCE_COUNT_HI: u64 = 0x01c;
/// Interrupt status, `INT_*` bits (RO; clear through [`INT_ACK`]).
pub const INT_STATUS: u64 = 0x020;
/// Interrupt mask (RW): a set bit keeps that source from sending its MSI-X (or MSI) message;
/// the status bit is still latched.
pub const INT_MASK: u64 = 0x024;
/// Interrupt acknowledge (WO, write 1 to clear the bit in [`INT_STATUS`]; reads 0).
pub const INT_ACK: u64 = 0x028;
/// Scratch register (RW, no side effects).
pub const SCRATCH: u64 = 0x02c;
/// Device control (`DEV_CONTROL_*` bits).
pub const DEV_CONTROL: u64 = 0x030;
/// Device status (`DEV_STATUS_*` bits, RO).
pub const DEV_STATUS: u64 = 0x034;
/// Number of MSI-X vectors (RO): [`MSIX_VECTORS`], or 0 in MSI mode (no MSI-X; every source
/// uses the single MSI vector).
pub const MSIX_VECTOR_COUNT: u64 = 0x038;
/// Size of one ring entry in bytes (RO, 64).
pub const RING_ENTRY_SIZE: u64 = 0x03c;
/// Largest ring size in entries (RO).
pub const MAX_RING_ENTRIES: u64 = 0x040;
/// Largest `COPY`/`FILL` length in bytes (RO).
pub const MAX_XFER_BYTES: u64 = 0x044;
/// Largest `SAXPY`/`REDUCE` element count (RO).
pub const MAX_ELEMENTS: u64 = 0x048;
/// Largest `GEMM` dimension (M, N and K each) (RO).
pub const MAX_GEMM_DIM: u64 = 0x04c;
/// Largest `GEMM` work `M*N*K`, low half (RO).
pub const MAX_GEMM_WORK_LO: u64 = 0x050;
/// Largest `GEMM` work `M*N*K`, high half (RO).
pub const MAX_GEMM_WORK_HI: u64 = 0x054;

/// Feature: `COPY`.
pub const FEATURE_COPY: u32 = 1 << 0;
/// Feature: `FILL`.
pub const FEATURE_FILL: u32 = 1 << 1;
/// Feature: `SAXPY`.
pub const FEATURE_SAXPY: u32 = 1 << 2;
/// Feature: `GEMM`.
pub const FEATURE_GEMM: u32 = 1 << 3;
/// Feature: `REDUCE`.
pub const FEATURE_REDUCE: u32 = 1 << 4;
/// Feature: `FENCE`.
pub const FEATURE_FENCE: u32 = 1 << 5;
/// Feature: operands may address VRAM (per-operand space bits).
pub const FEATURE_VRAM_OPERANDS: u32 = 1 << 6;
/// Feature: queues recover from errors through `Q_CONTROL_RECOVER`.
pub const FEATURE_RECOVER: u32 = 1 << 7;
/// Feature: mapped doorbells: the doorbell page at [`DOORBELL_PAGE`] and
/// [`Q_CONTROL_MAPPED`] (the crate documentation has the protocol).
pub const FEATURE_DOORBELL_PAGE: u32 = 1 << 8;
/// All features of this version.
pub const FEATURES_VALUE: u32 = FEATURE_COPY
    | FEATURE_FILL
    | FEATURE_SAXPY
    | FEATURE_GEMM
    | FEATURE_REDUCE
    | FEATURE_FENCE
    | FEATURE_VRAM_OPERANDS
    | FEATURE_RECOVER
    | FEATURE_DOORBELL_PAGE;

/// `INT_STATUS` bit: queue `q` completed a command carrying `FLAG_IRQ`.
pub const fn int_completion(q: u32) -> u32 {
    1 << q
}
/// `INT_STATUS` bit: queue `q` stopped on an error.
pub const fn int_error(q: u32) -> u32 {
    1 << (16 + q)
}

/// `DEV_CONTROL` bit 0: write 1 to reset the device logic (registers, queues, interrupt state,
/// fence counter, VRAM zeroed). PCI config space and the MSI-X table are kept. Reads 0.
pub const DEV_CONTROL_RESET: u32 = 1 << 0;

/// `DEV_STATUS` bit 0: bus mastering is enabled in the PCI command register (engines may run).
pub const DEV_STATUS_BUS_MASTER: u32 = 1 << 0;
/// `DEV_STATUS` bit 1: the client disconnected; engines are parked until a reset, a restore or
/// the next register write.
pub const DEV_STATUS_HALTED: u32 = 1 << 1;
/// `DEV_STATUS` bit 2: at least one queue is in the error state.
pub const DEV_STATUS_ERROR: u32 = 1 << 2;
/// `DEV_STATUS` bit 3: the host stopped the engines (e.g. during migration).
pub const DEV_STATUS_STOPPED: u32 = 1 << 3;

/// Offset of queue 0's register block.
pub const QUEUE_BASE: u64 = 0x1000;
/// Distance between two queues' register blocks.
pub const QUEUE_STRIDE: u64 = 0x100;

/// Offset of register `reg` (a `Q_*` constant) of queue `q`.
pub const fn queue_reg(q: u32, reg: u64) -> u64 {
    QUEUE_BASE + q as u64 * QUEUE_STRIDE + reg
}

/// Ring base IOVA, low half (RW while the queue is disabled; must be 64-byte aligned).
pub const Q_RING_BASE_LO: u64 = 0x00;
/// Ring base IOVA, high half (RW while the queue is disabled).
pub const Q_RING_BASE_HI: u64 = 0x04;
/// Ring size in entries: a power of two in `1..=MAX_RING_ENTRIES` (RW while disabled).
pub const Q_RING_SIZE: u64 = 0x08;
/// Head: free-running index of the next command the device executes (RO).
pub const Q_HEAD: u64 = 0x0c;
/// Tail: free-running index one past the last submitted command (RW; a write is a doorbell).
pub const Q_TAIL: u64 = 0x10;
/// Doorbell: write the new tail and wake the engine (reads return the tail).
pub const Q_DOORBELL: u64 = 0x14;
/// Queue control, `Q_CONTROL_*` bits.
pub const Q_CONTROL: u64 = 0x18;
/// Queue status, one of the `Q_STATUS_*` values (RO).
pub const Q_STATUS: u64 = 0x1c;
/// Error code of the last fault, one of the `ERR_*` values (RO).
pub const Q_ERROR_CODE: u64 = 0x20;
/// Ring index (free-running) of the faulting command (RO).
pub const Q_ERROR_INDEX: u64 = 0x24;
/// Faulting address, low half (RO).
pub const Q_ERROR_ADDR_LO: u64 = 0x28;
/// Faulting address, high half (RO).
pub const Q_ERROR_ADDR_HI: u64 = 0x2c;
/// MSI-X vector for completion interrupts (RW; power-on value `q`). Stored but unused in MSI
/// mode, where every source sends MSI vector 0.
pub const Q_COMPLETION_VECTOR: u64 = 0x30;
/// MSI-X vector for error interrupts (RW; power-on value `8 + q`). Stored but unused in MSI
/// mode, where every source sends MSI vector 0.
pub const Q_ERROR_VECTOR: u64 = 0x34;
/// Number of commands completed, low half (RO).
pub const Q_COMPLETED_LO: u64 = 0x38;
/// Number of commands completed, high half (RO).
pub const Q_COMPLETED_HI: u64 = 0x3c;
/// Opcode of the faulting command (RO).
pub const Q_ERROR_OPCODE: u64 = 0x40;

/// Offset of the doorbell page in BAR0: one 4 KiB page offered to the client as a sparse mmap
/// area of BAR0 (the rest of BAR0 stays trapped). Queue `q`'s slot is at
/// [`doorbell_slot`]`(q, ...)`.
pub const DOORBELL_PAGE: u64 = 0x8000;
/// Size of the doorbell page.
pub const DOORBELL_PAGE_SIZE: u64 = 0x1000;
/// Distance between two queues' slots in the doorbell page (a cache line each).
pub const DB_STRIDE: u64 = 0x40;
/// Slot word: the queue's tail, written by the driver (a mapped doorbell). Read by the device
/// while the queue is in mapped mode ([`Q_CONTROL_MAPPED`]).
pub const DB_TAIL: u64 = 0x00;
/// Slot word: non-zero while the queue's engine sleeps, written by the device. A driver that
/// has published a tail reads it (after a full fence) and, if non-zero, rings `Q_DOORBELL`
/// (a *kick*; the value written is ignored in mapped mode).
pub const DB_NEED_KICK: u64 = 0x04;

/// BAR0 offset of word `reg` (a `DB_*` constant) of queue `q`'s doorbell slot.
pub const fn doorbell_slot(q: u32, reg: u64) -> u64 {
    DOORBELL_PAGE + q as u64 * DB_STRIDE + reg
}

/// `Q_CONTROL` bit 0: queue enabled. Every write to `Q_CONTROL` sets the enable state to this
/// bit, after processing `RESET` and `RECOVER`.
pub const Q_CONTROL_ENABLE: u32 = 1 << 0;
/// `Q_CONTROL` bit 1: write 1 to reset the queue (abort the running command, head = tail = 0,
/// error and completion counters cleared; ring base, size and vectors kept). Reads 0.
pub const Q_CONTROL_RESET: u32 = 1 << 1;
/// `Q_CONTROL` bit 2: write 1 to leave the error state. For command errors the head moves past
/// the faulting command (`head = ERROR_INDEX + 1`). Reads 0.
pub const Q_CONTROL_RECOVER: u32 = 1 << 2;

/// `Q_CONTROL` bit 3: mapped doorbell. Every write to `Q_CONTROL` sets the mode to this bit
/// (like [`Q_CONTROL_ENABLE`]). Setting it stores the queue's `TAIL` into its `DB_TAIL`
/// slot; while it is set the device takes the tail from `DB_TAIL` and a `TAIL`/`DOORBELL`
/// write is a kick (the value is ignored). Reads back as written.
pub const Q_CONTROL_MAPPED: u32 = 1 << 3;

/// Queue status: disabled.
pub const Q_STATUS_STOPPED: u32 = 0;
/// Queue status: enabled, no pending commands (head == tail).
pub const Q_STATUS_IDLE: u32 = 1;
/// Queue status: enabled, commands pending or executing.
pub const Q_STATUS_RUNNING: u32 = 2;
/// Queue status: stopped on an error; see `Q_ERROR_*`.
pub const Q_STATUS_ERROR: u32 = 3;
/// Queue status: commands pending but bus mastering is disabled (or the device is halted or
/// stopped by the host).
pub const Q_STATUS_PAUSED: u32 = 4;

/// No error.
pub const ERR_NONE: u32 = 0;
/// Unknown opcode.
pub const ERR_BAD_OPCODE: u32 = 1;
/// Malformed command: reserved bits set, misaligned operand, bad vector, range wraps.
pub const ERR_BAD_COMMAND: u32 = 2;
/// A guest operand range is not (fully) mapped, or the client's memory no longer backs it (a
/// file truncated under the device). `ERROR_ADDR` = first unmapped IOVA.
pub const ERR_DMA_UNMAPPED: u32 = 3;
/// A guest operand range lacks the permission (e.g. a write into a read-only window).
/// `ERROR_ADDR` = first IOVA without the permission.
pub const ERR_DMA_PERMISSION: u32 = 4;
/// A VRAM operand range exceeds the VRAM. `ERROR_ADDR` = the operand's VRAM offset.
pub const ERR_VRAM_RANGE: u32 = 5;
/// A length or dimension exceeds the device limits (`MAX_*` registers).
pub const ERR_LIMIT: u32 = 6;
/// The command could not be read from the ring. `ERROR_ADDR` = the IOVA of the ring slot.
pub const ERR_RING_FETCH: u32 = 7;
/// A tail/doorbell write put more than `RING_SIZE` commands in flight; the write was refused.
/// `ERROR_ADDR` = the value written.
pub const ERR_BAD_DOORBELL: u32 = 8;
/// The queue was enabled with an invalid ring (size not a power of two in range, or base not
/// 64-byte aligned). `ERROR_ADDR` = ring base.
pub const ERR_BAD_RING: u32 = 9;

/// The device was restarted (its serving process died and another took over) while this
/// command ran, and it cannot be run again safely (its output overlaps its inputs, e.g. an
/// in-place SAXPY): its outputs are undefined; the commands before it completed, none after it
/// ran. `ERROR_ADDR` = the IOVA of the ring slot. `RECOVER` skips it.
pub const ERR_INTERRUPTED: u32 = 10;

/// The device failed for good: its VRAM is lost, so no command on any queue will complete. A
/// queue that had work pending or running when the VRAM failed stops with it at the first
/// command not completed, and so does one given work later; `RECOVER` skips the command, and
/// the next fails the same way. The driver should give up on the device. `ERROR_ADDR` = the
/// IOVA of the ring slot; `ERROR_OPCODE` = the command's opcode if it had started, else 0.
pub const ERR_DEVICE_LOST: u32 = 11;

/// Largest ring size in entries.
pub const MAX_RING_ENTRIES_VALUE: u32 = 1 << 16;
/// Required alignment of the ring base.
pub const RING_ALIGN: u64 = 64;
/// Largest `COPY`/`FILL` length in bytes.
pub const MAX_XFER_BYTES_VALUE: u64 = 1 << 28;
/// Largest `SAXPY`/`REDUCE` element count.
pub const MAX_ELEMENTS_VALUE: u64 = 1 << 26;
/// Largest `GEMM` dimension.
pub const MAX_GEMM_DIM_VALUE: u64 = 4096;
/// Largest `GEMM` work `M*N*K`: every GEMM within [`MAX_GEMM_DIM_VALUE`] (2^36), on a GPU
/// (a `cuda` board) as on the CPU, so that a device moves between the two unchanged. The
/// CPU path checks for aborts every few rows, so a large GEMM does not hold up a reset.
pub const MAX_GEMM_WORK_VALUE: u64 = MAX_GEMM_DIM_VALUE * MAX_GEMM_DIM_VALUE * MAX_GEMM_DIM_VALUE;
