//! Save and restore.

use switchyard_device::config::regs as pci;

use crate::cmd::{Command, Operand};
use crate::{SoftGpuState, StateError};

use super::*;

const G: fn(u64) -> Operand = Operand::Guest;

/// Every BAR0 register a driver can read (status included).
fn register_dump(h: &mut Harness) -> Vec<u32> {
    (0..0x2000).step_by(4).map(|o| h.rd32(o)).collect()
}

fn config_dump(h: &mut Harness) -> Vec<u32> {
    (0..4096).step_by(4).map(|o| h.cfg_read(o, 4)).collect()
}

#[test]
fn save_and_restore_into_a_second_device() {
    let mut a = Harness::new();
    a.init();
    a.wr32(SCRATCH, 0xfeed);
    a.wr32(INT_MASK, int_error(1));
    a.qw(1, Q_COMPLETION_VECTOR, 12);
    a.cfg_write(pci::BAR0 as u64, 0xfe00_0000, 4);
    a.run(
        0,
        &[
            Command::fill(Operand::Vram(0x100), 64, 0x0706_0504),
            Command::fence(G(DATA), 1, Some(0)),
        ],
    );
    a.run(1, &[Command::nop().with_irq(), Command::nop()]);
    // Work submitted but not yet run: bus mastering is off when the state is saved.
    a.set_command(pci::CMD_MEMORY);
    a.submit(
        0,
        &[Command::copy(Operand::Vram(0x100), G(DATA + 0x100), 64)],
    );
    a.submit(1, &[Command::fence(G(DATA + 8), 2, Some(4))]);
    let regs = register_dump(&mut a);
    let cfg = config_dump(&mut a);
    let blob = a.gpu.save_state().expect("save");
    assert_eq!(register_dump(&mut a), regs, "saving changes nothing");

    // The replacement device shares the VRAM memfd, the DMA space and the eventfds.
    let identity = a.gpu.vram_identity();
    let mut b = a.successor();
    drop(a);
    assert_eq!(b.gpu.vram_identity(), identity);
    b.gpu.restore_state(&blob).expect("restore");
    assert_eq!(register_dump(&mut b), regs);
    assert_eq!(config_dump(&mut b), cfg);
    assert_eq!(b.rd32(SCRATCH), 0xfeed);
    assert_eq!(b.qr(0, Q_STATUS), Q_STATUS_PAUSED);

    // The rings continue where the first device stopped.
    b.drain_irqs();
    b.enable_bus_master();
    b.wait_idle(0);
    b.wait_idle(1);
    assert_eq!(b.guest_read(DATA + 0x100, 8), [4, 5, 6, 7, 4, 5, 6, 7]);
    assert_eq!(b.guest_read(DATA + 8, 8), 2u64.to_le_bytes());
    assert_eq!(b.wait_irq(4), 1);
    assert_eq!(b.rd64(FENCE_COUNT_LO), 2);
    assert_eq!(b.rd64(queue_reg(0, Q_COMPLETED_LO)), 3);
    assert_eq!(b.rd64(queue_reg(1, Q_COMPLETED_LO)), 3);
    // Config-space write masks survived the trip: BAR sizing still works.
    b.cfg_write(pci::BAR0 as u64, 0xffff_ffff, 4);
    assert_eq!(b.cfg_read(pci::BAR0 as u64, 4), !(64 * 1024 - 1) & !0xf);
}

#[test]
fn restore_into_a_device_with_fresh_vram() {
    let mut a = Harness::new();
    a.init();
    a.run(0, &[Command::fill(Operand::Vram(0), 16, 0x1111_1111)]);
    let blob = a.gpu.save_state().expect("save");
    let mut b = Harness::new();
    // The VRAM contents travel separately (here: a plain file copy).
    let contents = a.vram_file_read(0, a.config.vram_size as usize);
    b.vram_file_write(0, &contents);
    b.gpu.restore_state(&blob).expect("restore");
    assert_ne!(b.gpu.vram_identity(), a.gpu.vram_identity());
    assert_eq!(b.qr(0, Q_HEAD), 1);
    b.tails = a.tails.clone();
    b.run(0, &[Command::copy(Operand::Vram(0), G(DATA), 16)]);
    assert_eq!(b.guest_read(DATA, 16), [0x11; 16]);
    // The saved identity is replaced by the device's own on restore.
    let st = SoftGpuState::from_bytes(&b.gpu.save_state().expect("save")).expect("decode");
    assert_eq!(st.vram, b.gpu.vram_identity());
}

#[test]
fn restore_rejects_mismatched_or_broken_states() {
    let mut h = Harness::new();
    h.init();
    h.wr32(SCRATCH, 9);
    let good = SoftGpuState::from_bytes(&h.gpu.save_state().expect("save")).expect("decode");

    assert!(h.refused(b"not json").contains("decode"));
    let mut s = good.clone();
    s.format = 2;
    assert!(
        h.refused(&s.to_bytes().expect("encode"))
            .contains("format 2")
    );

    let mut other = Harness::with_config(SoftGpuConfig {
        vram_size: 4 << 20,
        queues: 3,
        irq: IrqMode::Msix,
        vram_mmap: true,
        keep_vram_on_reset: false,
        spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
    });
    other.init();
    let three = other.gpu.save_state().expect("save");
    assert!(h.refused(&three).contains("3 queues"));
    let mut bigger = Harness::with_config(SoftGpuConfig {
        vram_size: 8 << 20,
        queues: 2,
        irq: IrqMode::Msix,
        vram_mmap: true,
        keep_vram_on_reset: false,
        spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
    });
    let big = bigger.gpu.save_state().expect("save");
    assert!(h.refused(&big).contains("8388608"));
    drop(bigger);

    let mut s = good.clone();
    s.queues.pop();
    assert!(
        h.refused(&s.to_bytes().expect("encode"))
            .contains("queue states")
    );
    let mut s = good.clone();
    s.queues[1].ring_size = 5;
    assert!(
        h.refused(&s.to_bytes().expect("encode"))
            .contains("Queue 1")
    );
    let mut s = good.clone();
    s.queues[0].tail = s.queues[0].head + RING_ENTRIES + 1;
    assert!(
        h.refused(&s.to_bytes().expect("encode"))
            .contains("Queue 0")
    );
    // A config space of another layout (MSI-X capability moved).
    let mut json: serde_json::Value =
        serde_json::from_slice(&good.to_bytes().expect("encode")).expect("json");
    json["config_space"]["msix_offset"] = serde_json::json!(4000);
    let blob = serde_json::to_vec(&json).expect("encode");
    assert!(h.refused(&blob).contains("layout"));
    let mut json: serde_json::Value =
        serde_json::from_slice(&good.to_bytes().expect("encode")).expect("json");
    json["config_space"]["bytes"] = serde_json::json!([0, 1, 2]);
    assert!(
        h.refused(&serde_json::to_vec(&json).expect("encode"))
            .contains("decode")
    );

    // Nothing of the refused states was applied.
    assert_eq!(h.rd32(SCRATCH), 9);
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_IDLE);
    let e = StateError::Format(3);
    assert!(e.to_string().starts_with("Softgpu state format 3"));
}
