//! FLR, DEVICE_RESET, the register reset and client disconnects.

use std::os::unix::fs::MetadataExt;

use switchyard_device::PciDevice;
use switchyard_device::config::regs as pci;
use switchyard_device::kind::parse_kv;

use crate::SoftGpuKind;
use crate::cmd::{Command, Operand};

use super::*;

/// Puts the device in a thoroughly non-power-on state.
fn dirty(h: &mut Harness) {
    h.init();
    h.wr32(SCRATCH, 0x55);
    h.wr32(INT_MASK, 0x3);
    h.qw(1, Q_ERROR_VECTOR, 2);
    h.run(
        0,
        &[
            Command::fill(Operand::Vram(0), 4096, 0xffff_ffff),
            Command::fence(Operand::Guest(DATA), 1, Some(0)),
        ],
    );
    h.gpu
        .region_write(BAR_VRAM, h.config.vram_size - 4, &[1, 2, 3, 4])
        .expect("vram write");
    h.msix_entry_write(0, 3, 0);
    h.cfg_write(pci::BAR0 as u64, 0xfe00_0000, 4);
    assert_eq!(h.rd64(FENCE_COUNT_LO), 1);
}

fn assert_logic_power_on(h: &mut Harness) {
    assert_eq!(h.rd32(SCRATCH), 0);
    assert_eq!(h.rd32(INT_MASK), 0);
    assert_eq!(h.rd32(INT_STATUS), 0);
    assert_eq!(h.rd64(FENCE_COUNT_LO), 0);
    for q in 0..h.config.queues {
        assert_eq!(h.qr(q, Q_STATUS), Q_STATUS_STOPPED);
        assert_eq!(h.qr(q, Q_CONTROL), 0);
        assert_eq!(h.rd64(queue_reg(q, Q_RING_BASE_LO)), 0);
        assert_eq!(h.qr(q, Q_RING_SIZE), 0);
        assert_eq!((h.qr(q, Q_HEAD), h.qr(q, Q_TAIL)), (0, 0));
        assert_eq!(h.qr(q, Q_ERROR_VECTOR), 8 + q);
        assert_eq!(h.rd64(queue_reg(q, Q_COMPLETED_LO)), 0);
    }
    let size = h.config.vram_size as usize;
    assert!(
        h.vram_file_read(0, size).iter().all(|&b| b == 0),
        "VRAM zeroed"
    );
    assert_eq!(h.vram_region_read(size as u64 - 4, 4), [0; 4]);
}

fn assert_pci_power_on(h: &mut Harness) {
    assert_eq!(h.cfg_read(pci::COMMAND as u64, 2), 0);
    assert_eq!(h.cfg_read(pci::BAR0 as u64, 4), 0);
    let m = h.cap(CAP_MSIX);
    assert_eq!(h.cfg_read(m + 2, 2) & 0xc000, 0, "MSI-X disabled");
    let mut ctl = [0u8; 4];
    h.gpu
        .region_read(BAR_MSIX, 12, &mut ctl)
        .expect("table read");
    assert_eq!(u32::from_le_bytes(ctl), 1, "vector masked again");
    assert_eq!(h.rd32(DEV_STATUS), 0);
}

/// GEMM dimension of [`start_gemm_batch`].
const GEMM_DIM: u64 = 256;
/// VRAM offset of the batch's C matrix.
const GEMM_C: u64 = 0x80000;
/// Bytes of C.
const GEMM_C_LEN: usize = (GEMM_DIM * GEMM_DIM * 4) as usize;
/// Commands in the batch.
const GEMM_BATCH: u32 = 16;

/// Submits a long GEMM batch on queue 0 with non-zero inputs in guest memory (which a reset
/// does not clear), C in VRAM, and returns once the engine is inside the batch: the first
/// command has written part of C and the last has not completed.
fn start_gemm_batch(h: &mut Harness) {
    let ones = f32_bytes(&vec![1.0f32; (GEMM_DIM * GEMM_DIM) as usize]);
    let b = DATA + GEMM_DIM * GEMM_DIM * 4;
    h.guest_write(DATA, &ones);
    h.guest_write(b, &ones);
    let gemm = Command::gemm(
        GEMM_DIM,
        GEMM_DIM,
        GEMM_DIM,
        Operand::Guest(DATA),
        Operand::Guest(b),
        Operand::Vram(GEMM_C),
    );
    let first = h.submit(0, &vec![gemm; GEMM_BATCH as usize]);
    wait_until("the GEMM batch to start", || {
        h.vram_file_read(GEMM_C, 4) != [0; 4]
    });
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_RUNNING);
    assert_ne!(
        h.qr(0, Q_HEAD),
        first.wrapping_add(GEMM_BATCH),
        "batch still in flight"
    );
}

#[test]
fn flr_returns_to_power_on() {
    let mut h = Harness::new();
    dirty(&mut h);
    h.flr();
    assert_eq!(
        h.gpu.vram_file().metadata().expect("stat").blocks(),
        0,
        "VRAM pages released (hole punched)"
    );
    assert_logic_power_on(&mut h);
    assert_pci_power_on(&mut h);
    // Fully usable again.
    h.tails = vec![0; 2];
    h.init();
    h.run(1, &[Command::fence(Operand::Guest(DATA), 2, None)]);
    assert_eq!(h.guest_read(DATA, 8), 2u64.to_le_bytes());
}

#[test]
fn device_reset_returns_to_power_on() {
    let mut h = Harness::new();
    dirty(&mut h);
    h.gpu.reset().expect("reset");
    assert_logic_power_on(&mut h);
    assert_pci_power_on(&mut h);
}

#[test]
fn register_reset_keeps_pci_state() {
    let mut h = Harness::new();
    dirty(&mut h);
    h.wr32(DEV_CONTROL, DEV_CONTROL_RESET);
    assert_eq!(h.rd32(DEV_CONTROL), 0);
    assert_logic_power_on(&mut h);
    assert_ne!(h.rd32(DEV_STATUS) & DEV_STATUS_BUS_MASTER, 0);
    assert_eq!(h.cfg_read(pci::BAR0 as u64, 4), 0xfe00_0000);
    h.tails = vec![0; 2];
    h.setup_queue(0);
    h.drain_irqs();
    h.run(0, &[Command::nop().with_irq()]);
    assert_eq!(h.wait_irq(0), 1, "MSI-X still enabled");
}

#[test]
fn reset_abandons_a_running_command() {
    let mut h = Harness::new();
    h.init();
    start_gemm_batch(&mut h);
    h.gpu.reset().expect("reset");
    assert_logic_power_on(&mut h);
    // The engine let go of the abandoned command (STATUS reads RUNNING while it executes):
    // whatever it wrote, it has written.
    wait_until("the engine to drop the command", || {
        h.qr(0, Q_STATUS) != Q_STATUS_RUNNING
    });
    assert!(
        h.vram_file_read(GEMM_C, GEMM_C_LEN).iter().all(|&b| b == 0),
        "no engine writes after the reset"
    );
}

#[test]
fn disconnect_parks_engines_until_the_driver_returns() {
    let mut h = Harness::new();
    h.init();
    // A command waits for bus mastering.
    h.set_command(pci::CMD_MEMORY);
    h.submit(0, &[Command::fence(Operand::Guest(DATA), 5, None)]);
    h.gpu.client_disconnected();
    assert_ne!(h.rd32(DEV_STATUS) & DEV_STATUS_HALTED, 0);
    // Bus mastering alone does not wake a halted device.
    h.enable_bus_master();
    h.wait_engine_saw(0, "the engine to see bus mastering while halted", |s| {
        s.bus_master && s.halted
    });
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_PAUSED);
    assert_eq!(h.guest_read(DATA, 8), [0; 8]);
    // The next register write does.
    h.wr32(SCRATCH, 1);
    assert_eq!(h.rd32(DEV_STATUS) & DEV_STATUS_HALTED, 0);
    h.wait_idle(0);
    assert_eq!(h.guest_read(DATA, 8), 5u64.to_le_bytes());
}

#[test]
fn queue_reset_abandons_its_running_command() {
    let mut h = Harness::new();
    h.init();
    start_gemm_batch(&mut h);
    h.qw(0, Q_CONTROL, Q_CONTROL_RESET);
    wait_until("queue stopped", || h.qr(0, Q_STATUS) == Q_STATUS_STOPPED);
    assert_eq!((h.qr(0, Q_HEAD), h.qr(0, Q_TAIL)), (0, 0));
    assert_eq!(h.rd64(queue_reg(0, Q_COMPLETED_LO)), 0);
    // STOPPED, not RUNNING: the engine has let go of the abandoned command, so nothing it
    // started can still be writing.
    let snapshot = h.vram_file_read(GEMM_C, GEMM_C_LEN);
    assert!(
        h.vram_file_read(GEMM_C, GEMM_C_LEN) == snapshot,
        "no engine writes after the queue reset"
    );
    // The queue works again from index 0.
    h.tails[0] = 0;
    h.qw(0, Q_CONTROL, Q_CONTROL_ENABLE);
    h.run(
        0,
        &[Command::fence(Operand::Guest(DATA + 0x80000), 8, None)],
    );
    assert_eq!(h.guest_read(DATA + 0x80000, 8), 8u64.to_le_bytes());
}

#[test]
fn host_stop_parks_engines() {
    let mut h = Harness::new();
    h.init();
    h.gpu.set_running(false);
    assert_ne!(h.rd32(DEV_STATUS) & DEV_STATUS_STOPPED, 0);
    h.submit(1, &[Command::fence(Operand::Guest(DATA), 6, None)]);
    h.wait_engine_saw(1, "the engine to see the doorbell while stopped", |s| {
        s.stopped
    });
    assert_eq!(h.qr(1, Q_STATUS), Q_STATUS_PAUSED);
    assert_eq!(h.guest_read(DATA, 8), [0; 8]);
    h.gpu.set_running(true);
    h.wait_idle(1);
    assert_eq!(h.guest_read(DATA, 8), 6u64.to_le_bytes());
    assert_eq!(h.rd32(DEV_STATUS) & DEV_STATUS_STOPPED, 0);
}

#[test]
fn a_swap_park_does_not_release_a_migration_stop() {
    let mut h = Harness::new();
    h.init();
    let ctl = h.gpu.engine_control();
    // The swap's order of events that used to restart a stopped device: park, STOP, the
    // refused swap lets go of its park.
    let parked = ctl.park();
    h.gpu.set_running(false);
    drop(parked);
    assert_ne!(h.rd32(DEV_STATUS) & DEV_STATUS_STOPPED, 0);
    h.submit(1, &[Command::fence(Operand::Guest(DATA), 6, None)]);
    // Positive control below: the same command runs once the migration lets go.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(h.qr(1, Q_STATUS), Q_STATUS_PAUSED);
    assert_eq!(h.guest_read(DATA, 8), [0; 8]);
    // And the other way round: RUNNING while a swap holds its park keeps the engines parked.
    let parked = ctl.park();
    h.gpu.set_running(true);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(h.qr(1, Q_STATUS), Q_STATUS_PAUSED);
    assert_eq!(h.guest_read(DATA, 8), [0; 8]);
    drop(parked);
    h.wait_idle(1);
    assert_eq!(h.guest_read(DATA, 8), 6u64.to_le_bytes());
    assert_eq!(h.qr(1, Q_COMPLETED_LO), 1);
    assert_eq!(h.rd32(DEV_STATUS) & DEV_STATUS_STOPPED, 0);
}

#[test]
fn with_vram_reset_keep_no_reset_touches_vram() {
    let mut h = Harness::with_config(SoftGpuConfig {
        vram_size: 4 << 20,
        queues: 2,
        irq: IrqMode::Msix,
        vram_mmap: true,
        keep_vram_on_reset: true,
        spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
    });
    let stamp: Vec<u8> = (0..8192u32).map(|i| (i * 13 + 5) as u8).collect();
    h.vram_file_write(0x1000, &stamp);
    h.flr();
    assert_eq!(h.vram_file_read(0x1000, stamp.len()), stamp, "after FLR");
    h.gpu.reset().expect("reset");
    assert_eq!(
        h.vram_file_read(0x1000, stamp.len()),
        stamp,
        "after DEVICE_RESET"
    );
    h.wr32(DEV_CONTROL, DEV_CONTROL_RESET);
    assert_eq!(
        h.vram_file_read(0x1000, stamp.len()),
        stamp,
        "after DEV_CONTROL.RESET"
    );
    // The registers did go back to power-on.
    assert_eq!(h.rd32(SCRATCH), 0);
    // The option parses, and other values are refused naming it.
    let options = |s: &str| parse_kv(s).expect("name=value");
    let cfg = SoftGpuKind::config(&options("vram_reset=keep")).expect("parse");
    assert!(cfg.keep_vram_on_reset);
    let err = SoftGpuKind::config(&options("vram_reset=maybe")).expect_err("an unknown vram_reset");
    assert_eq!(err.field(), Some("vram_reset"), "{err}");
}
