//! The softgpu register interface, written from the table in the `switchyard-softgpu` crate
//! documentation. Kept separate from that crate on purpose: the guest driver is an independent
//! implementation of the documented interface (a unit test cross-checks every value against the
//! device model's own constants).

/// PCI vendor ID.
pub const PCI_VENDOR: u16 = 0x1234;
/// PCI device ID.
pub const PCI_DEVICE: u16 = 0x5347;
/// PCI class code (3D controller).
pub const PCI_CLASS: u32 = 0x03_02_00;

/// PCI capability ID: power management.
pub const CAP_PM: u8 = 0x01;
/// PCI capability ID: MSI (the device's MSI mode, `irq=msi`: one vector).
pub const CAP_MSI: u8 = 0x05;
/// MSI capability: offset of Message Control.
pub const MSI_FLAGS: usize = 2;
/// MSI Message Control: MSI enable.
pub const MSI_FLAGS_ENABLE: u16 = 1 << 0;
/// MSI-X capability: offset of Message Control.
pub const MSIX_FLAGS: usize = 2;
/// MSI-X Message Control: MSI-X enable.
pub const MSIX_FLAGS_ENABLE: u16 = 1 << 15;
/// PCI capability ID: PCI Express.
pub const CAP_PCIE: u8 = 0x10;
/// PCI capability ID: MSI-X.
pub const CAP_MSIX: u8 = 0x11;

/// Region index of the registers (BAR0).
pub const BAR_REGS: u32 = 0;
/// Region index of VRAM (BAR2).
pub const BAR_VRAM: u32 = 2;
/// Size of BAR0.
pub const BAR0_SIZE: u64 = 64 << 10;
/// MSI-X vectors.
pub const MSIX_VECTORS: u32 = 16;

/// `MAGIC` value: `"SYGP"` in memory order.
pub const MAGIC_VALUE: u32 = u32::from_le_bytes(*b"SYGP");
/// `VERSION` value (1.1: minor 1 added the doorbell page).
pub const VERSION_VALUE: u32 = 0x0001_0001;
/// `FEATURES` bit 8: mapped doorbells (the doorbell page at [`DOORBELL_PAGE`] and
/// [`Q_CONTROL_MAPPED`]).
pub const FEATURE_DOORBELL_PAGE: u32 = 1 << 8;
/// `FEATURES` value (all nine features: bits 0–7 the commands, VRAM operands and queue
/// recovery, bit 8 [`FEATURE_DOORBELL_PAGE`]).
pub const FEATURES_VALUE: u32 = 0x1ff;

/// Identification magic (RO).
pub const MAGIC: u64 = 0x000;
/// Interface version (RO).
pub const VERSION: u64 = 0x004;
/// Feature bits (RO).
pub const FEATURES: u64 = 0x008;
/// Number of queues (RO).
pub const NUM_QUEUES: u64 = 0x00c;
/// VRAM size, 64-bit (RO).
pub const VRAM_SIZE: u64 = 0x010;
/// Completed FENCEs, 64-bit (RO).
pub const FENCE_COUNT: u64 = 0x018;
/// Interrupt status (RO).
pub const INT_STATUS: u64 = 0x020;
/// Interrupt mask (RW).
pub const INT_MASK: u64 = 0x024;
/// Interrupt acknowledge (WO, write 1 to clear).
pub const INT_ACK: u64 = 0x028;
/// Scratch (RW).
pub const SCRATCH: u64 = 0x02c;
/// Device control (WO).
pub const DEV_CONTROL: u64 = 0x030;
/// Device status (RO).
pub const DEV_STATUS: u64 = 0x034;
/// MSI-X vector count (RO).
pub const MSIX_VECTOR_COUNT: u64 = 0x038;
/// Ring entry size (RO).
pub const RING_ENTRY_SIZE: u64 = 0x03c;
/// Largest ring (RO).
pub const MAX_RING_ENTRIES: u64 = 0x040;
/// Largest COPY/FILL length (RO).
pub const MAX_XFER_BYTES: u64 = 0x044;
/// Largest SAXPY/REDUCE count (RO).
pub const MAX_ELEMENTS: u64 = 0x048;
/// Largest GEMM dimension (RO).
pub const MAX_GEMM_DIM: u64 = 0x04c;
/// Largest GEMM work M*N*K, 64-bit (RO).
pub const MAX_GEMM_WORK: u64 = 0x050;

/// `DEV_CONTROL` bit 0: device reset (registers, queues, interrupt state, VRAM zeroed).
pub const DEV_CONTROL_RESET: u32 = 1;
/// `DEV_STATUS` bit 0: bus mastering enabled.
pub const DEV_STATUS_BUS_MASTER: u32 = 1 << 0;
/// `DEV_STATUS` bit 2: some queue is in error.
pub const DEV_STATUS_ERROR: u32 = 1 << 2;

/// `INT_STATUS` bit of queue `q`'s completion interrupt.
pub const fn int_completion(q: u32) -> u32 {
    1 << q
}
/// `INT_STATUS` bit of queue `q`'s error interrupt.
pub const fn int_error(q: u32) -> u32 {
    1 << (16 + q)
}

/// Offset of queue 0's register block.
pub const QUEUE_BASE: u64 = 0x1000;
/// Distance between queue register blocks.
pub const QUEUE_STRIDE: u64 = 0x100;
/// Offset of register `reg` of queue `q`.
pub const fn queue_reg(q: u32, reg: u64) -> u64 {
    QUEUE_BASE + q as u64 * QUEUE_STRIDE + reg
}

/// Ring base IOVA, 64-bit.
pub const Q_RING_BASE: u64 = 0x00;
/// Ring size in entries.
pub const Q_RING_SIZE: u64 = 0x08;
/// Head (RO).
pub const Q_HEAD: u64 = 0x0c;
/// Tail (RW).
pub const Q_TAIL: u64 = 0x10;
/// Doorbell (write: new tail).
pub const Q_DOORBELL: u64 = 0x14;
/// Queue control.
pub const Q_CONTROL: u64 = 0x18;
/// Queue status (RO).
pub const Q_STATUS: u64 = 0x1c;
/// Error code (RO).
pub const Q_ERROR_CODE: u64 = 0x20;
/// Index of the faulting command (RO).
pub const Q_ERROR_INDEX: u64 = 0x24;
/// Faulting address, 64-bit (RO).
pub const Q_ERROR_ADDR: u64 = 0x28;
/// Completion MSI-X vector (RW).
pub const Q_COMPLETION_VECTOR: u64 = 0x30;
/// Error MSI-X vector (RW).
pub const Q_ERROR_VECTOR: u64 = 0x34;
/// Completed commands, 64-bit (RO).
pub const Q_COMPLETED: u64 = 0x38;
/// Opcode of the faulting command (RO).
pub const Q_ERROR_OPCODE: u64 = 0x40;

/// `Q_CONTROL`: enable.
pub const Q_CONTROL_ENABLE: u32 = 1 << 0;
/// `Q_CONTROL`: reset the queue.
pub const Q_CONTROL_RESET: u32 = 1 << 1;
/// `Q_CONTROL`: leave the error state.
pub const Q_CONTROL_RECOVER: u32 = 1 << 2;
/// `Q_CONTROL`: mapped doorbell. Every `Q_CONTROL` write sets the mode to this bit, so a
/// queue in mapped mode keeps it in every write (`RECOVER` included). While it is set the
/// device takes the tail from the queue's `DB_TAIL` slot and a `Q_DOORBELL` write is a kick.
pub const Q_CONTROL_MAPPED: u32 = 1 << 3;

/// Offset of the doorbell page in BAR0 (ordinary memory shared with the device; the rest of
/// BAR0 is trapped).
pub const DOORBELL_PAGE: u64 = 0x8000;
/// Size of the doorbell page.
pub const DOORBELL_PAGE_SIZE: u64 = 0x1000;
/// Distance between two queues' slots in the doorbell page.
pub const DB_STRIDE: u64 = 0x40;
/// Slot word written by the driver: the queue's tail.
pub const DB_TAIL: u64 = 0x00;
/// Slot word written by the device: non-zero while the engine sleeps (the driver then kicks
/// with a `Q_DOORBELL` write after publishing a tail).
pub const DB_NEED_KICK: u64 = 0x04;

/// BAR0 offset of word `reg` (`DB_TAIL`, `DB_NEED_KICK`) of queue `q`'s doorbell slot.
pub const fn doorbell_slot(q: u32, reg: u64) -> u64 {
    DOORBELL_PAGE + q as u64 * DB_STRIDE + reg
}

// Every queue's slot (up to 8 queues) lies inside the doorbell page, which lies inside BAR0.
const _: () = assert!(doorbell_slot(7, DB_NEED_KICK) + 4 <= DOORBELL_PAGE + DOORBELL_PAGE_SIZE);
const _: () = assert!(DOORBELL_PAGE + DOORBELL_PAGE_SIZE <= BAR0_SIZE);

/// Queue status: disabled.
pub const Q_STATUS_STOPPED: u32 = 0;
/// Queue status: idle.
pub const Q_STATUS_IDLE: u32 = 1;
/// Queue status: running.
pub const Q_STATUS_RUNNING: u32 = 2;
/// Queue status: error.
pub const Q_STATUS_ERROR: u32 = 3;
/// Queue status: paused.
pub const Q_STATUS_PAUSED: u32 = 4;

/// Error: guest range not (fully) mapped.
pub const ERR_DMA_UNMAPPED: u32 = 3;
/// Error: the device was restarted while the command ran (its outputs are undefined; the
/// commands before it completed, none after it ran).
pub const ERR_INTERRUPTED: u32 = 10;
/// Error: the device failed for good (its VRAM is lost): no command will complete on any
/// queue. Like every error but `INTERRUPTED`, a failure of the step.
pub const ERR_DEVICE_LOST: u32 = 11;

/// Human name of a queue status.
pub fn status_name(s: u32) -> &'static str {
    match s {
        Q_STATUS_STOPPED => "STOPPED",
        Q_STATUS_IDLE => "IDLE",
        Q_STATUS_RUNNING => "RUNNING",
        Q_STATUS_ERROR => "ERROR",
        Q_STATUS_PAUSED => "PAUSED",
        _ => "?",
    }
}

/// Human name of an error code.
pub fn error_name(code: u32) -> &'static str {
    match code {
        0 => "NONE",
        1 => "BAD_OPCODE",
        2 => "BAD_COMMAND",
        3 => "DMA_UNMAPPED",
        4 => "DMA_PERMISSION",
        5 => "VRAM_RANGE",
        6 => "LIMIT",
        7 => "RING_FETCH",
        8 => "BAD_DOORBELL",
        9 => "BAD_RING",
        10 => "INTERRUPTED",
        ERR_DEVICE_LOST => "DEVICE_LOST",
        _ => "?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_softgpu::regs as dev;

    #[test]
    fn constants_match_the_device_model() {
        assert_eq!(PCI_VENDOR, dev::PCI_VENDOR_ID);
        assert_eq!(PCI_DEVICE, dev::PCI_DEVICE_ID);
        assert_eq!(PCI_CLASS, dev::PCI_CLASS);
        assert_eq!(BAR_REGS, switchyard_softgpu::BAR_REGS);
        assert_eq!(BAR_VRAM, switchyard_softgpu::BAR_VRAM);
        assert_eq!(BAR0_SIZE, dev::BAR0_SIZE);
        assert_eq!(MSIX_VECTORS, dev::MSIX_VECTORS);
        assert_eq!(MAGIC_VALUE, dev::MAGIC_VALUE);
        assert_eq!(VERSION_VALUE, dev::VERSION_VALUE);
        assert_eq!(FEATURES_VALUE, dev::FEATURES_VALUE);
        let pairs = [
            (MAGIC, dev::MAGIC),
            (VERSION, dev::VERSION),
            (FEATURES, dev::FEATURES),
            (NUM_QUEUES, dev::NUM_QUEUES),
            (VRAM_SIZE, dev::VRAM_SIZE_LO),
            (FENCE_COUNT, dev::FENCE_COUNT_LO),
            (INT_STATUS, dev::INT_STATUS),
            (INT_MASK, dev::INT_MASK),
            (INT_ACK, dev::INT_ACK),
            (SCRATCH, dev::SCRATCH),
            (DEV_CONTROL, dev::DEV_CONTROL),
            (DEV_STATUS, dev::DEV_STATUS),
            (MSIX_VECTOR_COUNT, dev::MSIX_VECTOR_COUNT),
            (RING_ENTRY_SIZE, dev::RING_ENTRY_SIZE),
            (MAX_RING_ENTRIES, dev::MAX_RING_ENTRIES),
            (MAX_XFER_BYTES, dev::MAX_XFER_BYTES),
            (MAX_ELEMENTS, dev::MAX_ELEMENTS),
            (MAX_GEMM_DIM, dev::MAX_GEMM_DIM),
            (MAX_GEMM_WORK, dev::MAX_GEMM_WORK_LO),
            (Q_RING_BASE, dev::Q_RING_BASE_LO),
            (Q_RING_SIZE, dev::Q_RING_SIZE),
            (Q_HEAD, dev::Q_HEAD),
            (Q_TAIL, dev::Q_TAIL),
            (Q_DOORBELL, dev::Q_DOORBELL),
            (Q_CONTROL, dev::Q_CONTROL),
            (Q_STATUS, dev::Q_STATUS),
            (Q_ERROR_CODE, dev::Q_ERROR_CODE),
            (Q_ERROR_INDEX, dev::Q_ERROR_INDEX),
            (Q_ERROR_ADDR, dev::Q_ERROR_ADDR_LO),
            (Q_COMPLETION_VECTOR, dev::Q_COMPLETION_VECTOR),
            (Q_ERROR_VECTOR, dev::Q_ERROR_VECTOR),
            (Q_COMPLETED, dev::Q_COMPLETED_LO),
            (Q_ERROR_OPCODE, dev::Q_ERROR_OPCODE),
            (DOORBELL_PAGE, dev::DOORBELL_PAGE),
            (DOORBELL_PAGE_SIZE, dev::DOORBELL_PAGE_SIZE),
            (DB_STRIDE, dev::DB_STRIDE),
            (DB_TAIL, dev::DB_TAIL),
            (DB_NEED_KICK, dev::DB_NEED_KICK),
        ];
        for (ours, theirs) in pairs {
            assert_eq!(ours, theirs, "register offset {ours:#x}");
        }
        for q in 0..8 {
            assert_eq!(queue_reg(q, Q_STATUS), dev::queue_reg(q, dev::Q_STATUS));
            assert_eq!(int_completion(q), dev::int_completion(q));
            assert_eq!(int_error(q), dev::int_error(q));
            for reg in [DB_TAIL, DB_NEED_KICK] {
                assert_eq!(doorbell_slot(q, reg), dev::doorbell_slot(q, reg));
            }
        }
        assert_eq!(FEATURE_DOORBELL_PAGE, dev::FEATURE_DOORBELL_PAGE);
        assert_eq!(
            FEATURES_VALUE & FEATURE_DOORBELL_PAGE,
            FEATURE_DOORBELL_PAGE
        );
        assert_eq!(DEV_CONTROL_RESET, dev::DEV_CONTROL_RESET);
        assert_eq!(DEV_STATUS_BUS_MASTER, dev::DEV_STATUS_BUS_MASTER);
        assert_eq!(DEV_STATUS_ERROR, dev::DEV_STATUS_ERROR);
        assert_eq!(Q_CONTROL_ENABLE, dev::Q_CONTROL_ENABLE);
        assert_eq!(Q_CONTROL_RESET, dev::Q_CONTROL_RESET);
        assert_eq!(Q_CONTROL_RECOVER, dev::Q_CONTROL_RECOVER);
        assert_eq!(Q_CONTROL_MAPPED, dev::Q_CONTROL_MAPPED);
        assert_eq!(Q_STATUS_STOPPED, dev::Q_STATUS_STOPPED);
        assert_eq!(Q_STATUS_IDLE, dev::Q_STATUS_IDLE);
        assert_eq!(Q_STATUS_RUNNING, dev::Q_STATUS_RUNNING);
        assert_eq!(Q_STATUS_ERROR, dev::Q_STATUS_ERROR);
        assert_eq!(Q_STATUS_PAUSED, dev::Q_STATUS_PAUSED);
        assert_eq!(ERR_DMA_UNMAPPED, dev::ERR_DMA_UNMAPPED);
        assert_eq!(ERR_INTERRUPTED, dev::ERR_INTERRUPTED);
        assert_eq!(ERR_DEVICE_LOST, dev::ERR_DEVICE_LOST);
        // Every error code the device defines has its own name here, and nothing else does.
        let codes = [
            (dev::ERR_NONE, "NONE"),
            (dev::ERR_BAD_OPCODE, "BAD_OPCODE"),
            (dev::ERR_BAD_COMMAND, "BAD_COMMAND"),
            (dev::ERR_DMA_UNMAPPED, "DMA_UNMAPPED"),
            (dev::ERR_DMA_PERMISSION, "DMA_PERMISSION"),
            (dev::ERR_VRAM_RANGE, "VRAM_RANGE"),
            (dev::ERR_LIMIT, "LIMIT"),
            (dev::ERR_RING_FETCH, "RING_FETCH"),
            (dev::ERR_BAD_DOORBELL, "BAD_DOORBELL"),
            (dev::ERR_BAD_RING, "BAD_RING"),
            (dev::ERR_INTERRUPTED, "INTERRUPTED"),
            (dev::ERR_DEVICE_LOST, "DEVICE_LOST"),
        ];
        for (code, name) in codes {
            assert_eq!(error_name(code), name, "error code {code}");
        }
        let max = codes.iter().map(|c| c.0).max().expect("codes");
        assert_eq!(error_name(max + 1), "?");
    }

    #[test]
    fn interrupt_modes_match_the_device_model() {
        use crate::irq::IrqMode;
        use switchyard_softgpu::{IrqMode as DevMode, SoftGpuConfig};
        for (ours, theirs) in [(IrqMode::Msix, DevMode::Msix), (IrqMode::Msi, DevMode::Msi)] {
            assert_eq!(ours.name(), theirs.as_str(), "the option's value");
            let cfg = SoftGpuConfig {
                irq: theirs,
                ..SoftGpuConfig::default()
            };
            // [INTx, MSI, MSI-X, ERR, REQ] vectors VFIO offers for the device.
            let counts = cfg.irq_counts();
            let (msi, msix) = (counts[1], counts[2]);
            assert_eq!(ours.msix_vector_count(), msix, "{ours:?}");
            let routed = if ours == IrqMode::Msix { msix } else { msi };
            assert_eq!(ours.vectors(), routed, "{ours:?}");
        }
        assert_eq!(error_name(dev::ERR_LIMIT), "LIMIT");
    }
}
