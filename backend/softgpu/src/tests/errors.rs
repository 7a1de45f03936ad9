//! Bad commands stop their queue without writing anything; the queue recovers.

use crate::cmd::{self, COMMAND_SIZE, Command, Operand};

use super::*;

const G: fn(u64) -> Operand = Operand::Guest;
const V: fn(u64) -> Operand = Operand::Vram;

fn slot_iova(q: u32, index: u32) -> u64 {
    Harness::ring(q) + u64::from(index % RING_ENTRIES) * COMMAND_SIZE as u64
}

#[test]
fn bad_dma_address_stops_the_queue_and_it_recovers() {
    let mut h = Harness::new();
    h.init();
    h.drain_irqs();
    let q = 1;
    // The last 0x800 bytes of RAM1 hold a guard pattern; the hole follows.
    let tail_start = HOLE - 0x800;
    h.guest_write(tail_start, &[0x3c; 0x800]);
    h.vram_file_write(0, &[0x11; 0x1000]);
    let fence = DATA + 0x40;
    let first = h.submit(
        q,
        &[
            Command::nop(),
            // VRAM → guest, running off the end of RAM1 into the hole.
            Command::copy(V(0), G(tail_start), 0x1000),
            Command::fill(G(DATA), 16, 0xabcd_ef01),
            Command::fence(G(fence), 7, Some(3)),
        ],
    );
    let (code, index, addr, opcode) = h.wait_error(q);
    assert_eq!(code, ERR_DMA_UNMAPPED);
    assert_eq!(index, first + 1);
    assert_eq!(addr, HOLE, "first unmapped address");
    assert_eq!(opcode, u32::from(cmd::OP_COPY));
    assert_eq!(h.qr(q, Q_HEAD), first + 1, "head stays on the bad command");
    assert_eq!(h.rd32(INT_STATUS), int_error(q));
    assert_ne!(h.rd32(DEV_STATUS) & DEV_STATUS_ERROR, 0);
    assert_eq!(h.wait_irq(8 + q), 1, "error vector");
    // Nothing was written: not the valid part, not the commands after it.
    assert_eq!(h.guest_read(tail_start, 0x800), vec![0x3c; 0x800]);
    assert_eq!(h.guest_read(DATA, 16), [0; 16]);
    assert_eq!(h.guest_read(fence, 8), [0; 8]);
    // Queue 0 is unaffected.
    h.run(0, &[Command::fill(G(DATA + 0x100), 4, 0x0102_0304)]);
    assert_eq!(h.guest_read(DATA + 0x100, 4), [4, 3, 2, 1]);
    // The driver acks the error, then recovery skips the bad command and runs the rest.
    h.wr32(INT_ACK, int_error(q));
    assert_eq!(h.rd32(INT_STATUS), 0);
    h.qw(q, Q_CONTROL, Q_CONTROL_RECOVER | Q_CONTROL_ENABLE);
    h.wait_idle(q);
    assert_eq!(h.wait_irq(3), 1);
    assert_eq!(h.guest_read(fence, 8), 7u64.to_le_bytes());
    assert_eq!(h.guest_read(DATA, 4), 0xabcd_ef01u32.to_le_bytes());
    assert_eq!(h.qr(q, Q_HEAD), first + 4);
    assert_eq!(h.rd64(queue_reg(q, Q_COMPLETED_LO)), 3);
    assert_eq!(h.qr(q, Q_ERROR_CODE), ERR_NONE);
    assert_eq!(h.qr(q, Q_ERROR_INDEX), first + 1, "last fault kept");
    assert_eq!(h.rd32(DEV_STATUS) & DEV_STATUS_ERROR, 0);
    // And new submissions work.
    h.run(q, &[Command::fill(G(DATA), 4, 5)]);
    assert_eq!(h.guest_read(DATA, 4), [5, 0, 0, 0]);
}

#[test]
fn unknown_opcode_is_an_error() {
    let mut h = Harness::new();
    h.init();
    let bad = Command {
        opcode: 0x7f,
        ..Command::default()
    };
    let i = h.submit(0, &[bad, Command::fence(G(DATA), 9, None)]);
    let (code, index, addr, opcode) = h.wait_error(0);
    assert_eq!(
        (code, index, addr, opcode),
        (ERR_BAD_OPCODE, i, slot_iova(0, i), 0x7f)
    );
    assert_eq!(h.guest_read(DATA, 8), [0; 8]);
    h.recover(0);
    h.wait_idle(0);
    assert_eq!(h.guest_read(DATA, 8), 9u64.to_le_bytes());
}

#[test]
fn read_only_window_write_is_refused() {
    let mut h = Harness::new();
    h.init();
    h.guest_write(RO, &[0x99; 64]);
    h.guest_write(DATA, &[0x42; 64]);
    for c in [
        Command::copy(G(DATA), G(RO + 8), 32),
        Command::fill(G(RO), 4, 0),
        Command::fence(G(RO + 16), 1, None),
        Command::saxpy(4, 1.0, G(DATA), G(RO)),
    ] {
        let i = h.submit(0, &[c]);
        let (code, index, addr, _) = h.wait_error(0);
        assert_eq!((code, index), (ERR_DMA_PERMISSION, i), "{c:?}");
        assert!((RO..RO + 32).contains(&addr), "{addr:#x}");
        h.recover(0);
        h.wait_idle(0);
    }
    assert_eq!(h.guest_read(RO, 64), vec![0x99; 64]);
    // Reading from it is fine.
    h.run(0, &[Command::copy(G(RO), V(0), 64)]);
    assert_eq!(h.vram_file_read(0, 64), vec![0x99; 64]);
}

#[test]
fn malformed_commands_and_limits() {
    let mut h = Harness::new();
    h.init();
    let size = h.config.vram_size;
    let reserved_flags = Command {
        flags: 0x80,
        ..Command::nop()
    };
    let reserved_byte = Command {
        reserved: 1,
        ..Command::nop()
    };
    let stray_space = Command {
        space: 0b10,
        ..Command::fill(G(DATA), 4, 0)
    };
    let cases: Vec<(Command, u32, Option<u64>)> = vec![
        (reserved_flags, ERR_BAD_COMMAND, None),
        (reserved_byte, ERR_BAD_COMMAND, None),
        (stray_space, ERR_BAD_COMMAND, None),
        (
            Command::saxpy(4, 1.0, G(DATA + 2), G(DATA + 64)),
            ERR_BAD_COMMAND,
            Some(DATA + 2),
        ),
        (
            Command::fence(G(DATA + 4), 1, None),
            ERR_BAD_COMMAND,
            Some(DATA + 4),
        ),
        (Command::fence(G(DATA), 1, Some(16)), ERR_BAD_COMMAND, None),
        (
            Command::copy(V(size - 8), G(DATA), 16),
            ERR_VRAM_RANGE,
            Some(size - 8),
        ),
        (
            Command::fill(V(u64::MAX - 3), 8, 0),
            ERR_VRAM_RANGE,
            Some(u64::MAX - 3),
        ),
        (
            Command::copy(G(u64::MAX - 3), G(DATA), 8),
            ERR_BAD_COMMAND,
            Some(u64::MAX - 3),
        ),
        (
            Command::copy(G(DATA), G(DATA), MAX_XFER_BYTES_VALUE + 1),
            ERR_LIMIT,
            None,
        ),
        (Command::fill(G(DATA), u64::MAX, 0), ERR_LIMIT, None),
        (
            Command::gemm(4097, 1, 1, G(DATA), G(DATA), G(DATA)),
            ERR_LIMIT,
            None,
        ),
        (
            Command::gemm(4096, 4097, 1, G(DATA), G(DATA), G(DATA)),
            ERR_LIMIT,
            None,
        ),
        (
            Command::reduce(MAX_ELEMENTS_VALUE + 1, G(DATA), G(DATA)),
            ERR_LIMIT,
            None,
        ),
        (
            Command::reduce(16, G(HOLE - 32), G(DATA)),
            ERR_DMA_UNMAPPED,
            Some(HOLE),
        ),
    ];
    h.guest_write(DATA, &[0x5e; 64]);
    for (c, want_code, want_addr) in cases {
        let i = h.submit(0, &[c]);
        let (code, index, addr, opcode) = h.wait_error(0);
        assert_eq!((code, index), (want_code, i), "{c:?}");
        assert_eq!(addr, want_addr.unwrap_or(slot_iova(0, i)), "{c:?}");
        assert_eq!(opcode, u32::from(c.opcode));
        h.recover(0);
        h.wait_idle(0);
    }
    assert_eq!(h.guest_read(DATA, 64), vec![0x5e; 64], "nothing written");
}

#[test]
fn ring_errors() {
    let mut h = Harness::new();
    h.init();
    h.drain_irqs();
    // A doorbell beyond head + ring size is refused.
    h.qw(0, Q_DOORBELL, RING_ENTRIES + 1);
    let (code, index, addr, _) = h.wait_error(0);
    assert_eq!(
        (code, index, addr),
        (ERR_BAD_DOORBELL, 0, u64::from(RING_ENTRIES + 1))
    );
    assert_eq!(h.qr(0, Q_TAIL), 0, "tail unchanged");
    assert_eq!(h.wait_irq(8), 1);
    h.recover(0);
    assert_eq!(h.qr(0, Q_HEAD), 0, "nothing skipped");
    h.run(0, &[Command::nop()]);

    // Enabling with an invalid ring.
    h.qw(1, Q_CONTROL, 0);
    wait_until("stopped", || h.qr(1, Q_STATUS) == Q_STATUS_STOPPED);
    h.qw(1, Q_RING_SIZE, 3);
    h.qw(1, Q_CONTROL, Q_CONTROL_ENABLE);
    assert_eq!(h.qr(1, Q_STATUS), Q_STATUS_ERROR);
    assert_eq!(h.qr(1, Q_ERROR_CODE), ERR_BAD_RING);
    assert_eq!(h.qr(1, Q_CONTROL), 0, "not enabled");
    h.qw(1, Q_CONTROL, Q_CONTROL_RECOVER);
    assert_eq!(h.qr(1, Q_STATUS), Q_STATUS_STOPPED);
    h.wr32(queue_reg(1, Q_RING_BASE_LO), (Harness::ring(1) + 8) as u32);
    h.qw(1, Q_RING_SIZE, RING_ENTRIES);
    h.qw(1, Q_CONTROL, Q_CONTROL_ENABLE);
    assert_eq!(h.qr(1, Q_ERROR_CODE), ERR_BAD_RING, "misaligned base");
    h.qw(1, Q_CONTROL, Q_CONTROL_RECOVER);
    h.setup_queue(1);
    h.run(1, &[Command::nop()]);

    // A ring in unmapped memory cannot be fetched.
    h.qw(1, Q_CONTROL, Q_CONTROL_RESET);
    h.wr64(queue_reg(1, Q_RING_BASE_LO), HOLE);
    h.qw(1, Q_CONTROL, Q_CONTROL_ENABLE);
    h.qw(1, Q_DOORBELL, 1);
    let (code, index, addr, _) = h.wait_error(1);
    assert_eq!((code, index, addr), (ERR_RING_FETCH, 0, HOLE));
    h.recover(1);
    wait_until("skipped", || h.qr(1, Q_STATUS) == Q_STATUS_IDLE);
    assert_eq!(h.qr(1, Q_HEAD), 1);
}

#[test]
fn queue_control_reset_disable_and_ring_config() {
    let mut h = Harness::new();
    h.init();
    h.run(0, &[Command::nop(), Command::nop()]);
    // Ring registers are frozen while enabled.
    h.qw(0, Q_RING_SIZE, 8);
    h.wr32(queue_reg(0, Q_RING_BASE_LO), 0x4000);
    assert_eq!(h.qr(0, Q_RING_SIZE), RING_ENTRIES);
    assert_eq!(h.rd64(queue_reg(0, Q_RING_BASE_LO)), Harness::ring(0));
    // Disable: doorbells are accepted but nothing runs.
    h.qw(0, Q_CONTROL, 0);
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_STOPPED);
    h.submit(0, &[Command::fence(G(DATA), 3, None)]);
    assert_eq!(h.qr(0, Q_TAIL), 3);
    h.wait_engine_saw(
        0,
        "the engine to see the doorbell of a disabled queue",
        |s| !s.enabled,
    );
    assert_eq!(h.qr(0, Q_HEAD), 2);
    // Re-enable: it runs.
    h.qw(0, Q_CONTROL, Q_CONTROL_ENABLE);
    h.wait_idle(0);
    assert_eq!(h.guest_read(DATA, 8), 3u64.to_le_bytes());
    // Reset: head = tail = 0, counters cleared, ring config and vectors kept, disabled.
    h.qw(0, Q_COMPLETION_VECTOR, 6);
    h.qw(0, Q_CONTROL, Q_CONTROL_RESET);
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_STOPPED);
    assert_eq!(
        (h.qr(0, Q_HEAD), h.qr(0, Q_TAIL), h.qr(0, Q_CONTROL)),
        (0, 0, 0)
    );
    assert_eq!(h.rd64(queue_reg(0, Q_COMPLETED_LO)), 0);
    assert_eq!(h.qr(0, Q_RING_SIZE), RING_ENTRIES);
    assert_eq!(h.qr(0, Q_COMPLETION_VECTOR), 6);
    h.tails[0] = 0;
    h.qw(0, Q_CONTROL, Q_CONTROL_ENABLE);
    h.run(0, &[Command::fence(G(DATA), 4, None)]);
    assert_eq!(h.guest_read(DATA, 8), 4u64.to_le_bytes());
    assert_eq!(h.qr(0, Q_HEAD), 1);
}

#[test]
fn bus_master_gates_the_engines() {
    let mut h = Harness::new();
    h.init();
    h.set_command(switchyard_device::config::regs::CMD_MEMORY);
    assert_eq!(h.rd32(DEV_STATUS) & DEV_STATUS_BUS_MASTER, 0);
    h.submit(0, &[Command::fence(G(DATA), 1, None)]);
    h.wait_engine_saw(
        0,
        "the engine to see the doorbell without bus mastering",
        |s| !s.bus_master,
    );
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_PAUSED);
    assert_eq!(h.qr(0, Q_HEAD), 0);
    assert_eq!(h.guest_read(DATA, 8), [0; 8]);
    h.enable_bus_master();
    h.wait_idle(0);
    assert_eq!(h.guest_read(DATA, 8), 1u64.to_le_bytes());
}
