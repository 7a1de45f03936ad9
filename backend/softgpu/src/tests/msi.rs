//! MSI mode (`irq=msi`): identity, and every interrupt source on the single MSI vector.

use std::sync::Arc;

use switchyard_device::config::regs as pci;
use switchyard_device::{DeviceContext, DeviceError, DmaSpace, Interrupts, IrqIndex, PciDevice};

use crate::cmd::{Command, Operand};
use crate::{IrqMode, SoftGpuError, SoftGpuState};

use super::*;

const G: fn(u64) -> Operand = Operand::Guest;

fn msi_control(h: &mut Harness) -> u32 {
    let m = h.cap(CAP_MSI);
    h.cfg_read(m + 2, 2)
}

#[test]
fn msi_mode_identity() {
    let mut h = Harness::msi();
    assert_eq!(h.config.irq, IrqMode::Msi);
    assert_eq!(h.cfg_read(0, 4), 0x5347_1234, "same vendor:device");
    assert_eq!(h.cfg_read(pci::CLASS_PROG as u64, 3), 0x03_02_00);
    assert_eq!(h.cfg_read(pci::INT_PIN as u64, 1), 0, "no INTx");
    let ids: Vec<u8> = h.caps().iter().map(|c| c.0).collect();
    assert_eq!(ids, vec![CAP_PM, CAP_EXP, CAP_MSI], "no MSI-X capability");

    // MSI: 64-bit capable, one vector (MMC 0), disabled, no per-vector masking.
    let m = h.cap(CAP_MSI);
    assert_eq!(msi_control(&mut h), 0x0080);
    h.cfg_write(m + 2, 0xffff, 2);
    assert_eq!(
        msi_control(&mut h),
        0x00f1,
        "only enable and MME are writable"
    );
    h.cfg_write(m + 2, 0, 2);
    h.cfg_write(m + 4, 0xffff_ffff, 4);
    h.cfg_write(m + 8, 0xffff_ffff, 4);
    h.cfg_write(m + 12, 0xffff_ffff, 4);
    assert_eq!(h.cfg_read(m + 4, 4), 0xffff_fffc);
    assert_eq!(h.cfg_read(m + 8, 4), 0xffff_ffff);
    assert_eq!(h.cfg_read(m + 12, 4), 0xffff, "16-bit message data");

    // BAR4 is unimplemented; BAR0 and BAR2 are as in MSI-X mode.
    let size32 = |h: &mut Harness, bar: u64| {
        let off = pci::BAR0 as u64 + 4 * bar;
        h.cfg_write(off, 0xffff_ffff, 4);
        h.cfg_read(off, 4)
    };
    assert_eq!(size32(&mut h, 0), !(64 * 1024 - 1) & !0xf);
    assert_eq!(size32(&mut h, 2) & 0xf, 0b1100);
    for unused in [1, 4, 5] {
        assert_eq!(size32(&mut h, unused), 0, "BAR{unused} unimplemented");
    }

    // Regions and interrupts.
    let d = h.gpu.description();
    assert_eq!(d.regions.len(), 9);
    assert_eq!(d.regions[0].size, 64 << 10);
    assert_eq!(d.regions[2].size, h.config.vram_size);
    assert_eq!(d.regions[7].size, 4096);
    for absent in [1, 3, 4, 5, 6, 8] {
        assert_eq!(d.regions[absent].size, 0, "region {absent}");
    }
    assert_eq!(d.irq_counts(), vec![0, 1, 0, 1, 1]);
    assert_eq!(d.irq_counts(), h.config.irq_counts());
    let msi = d.irqs[IrqIndex::Msi as usize];
    assert!(msi.eventfd && msi.noresize && msi.maskable && !msi.automasked);
    assert!(d.irqs[IrqIndex::Req as usize].eventfd);
    let mut b = [0u8; 4];
    assert!(matches!(
        h.gpu.region_read(BAR_MSIX, 0, &mut b),
        Err(DeviceError::NoSuchRegion(4))
    ));
    assert!(matches!(
        h.gpu.region_write(BAR_MSIX, MSIX_PBA_OFFSET, &b),
        Err(DeviceError::NoSuchRegion(4))
    ));

    // No MSI-X vectors; the per-queue vector registers are kept (power-on values, RW).
    assert_eq!(h.rd32(MSIX_VECTOR_COUNT), 0);
    for q in 0..2 {
        assert_eq!(h.qr(q, Q_COMPLETION_VECTOR), q);
        assert_eq!(h.qr(q, Q_ERROR_VECTOR), 8 + q);
    }
    h.qw(0, Q_COMPLETION_VECTOR, 77);
    assert_eq!(h.qr(0, Q_COMPLETION_VECTOR), 77);

    // The default mode has no MSI capability.
    let mut x = Harness::new();
    assert!(!x.caps().iter().any(|c| c.0 == CAP_MSI));
    assert_eq!(x.gpu.description().irq_counts(), x.config.irq_counts());
}

#[test]
fn start_checks_the_vectors_each_mode_needs() {
    let build = |irq: IrqMode, counts: &[u32]| {
        let ctx = DeviceContext {
            dma: Arc::new(DmaSpace::new(4)),
            irqs: Arc::new(Interrupts::new(counts)),
            waits: Default::default(),
            memory: Default::default(),
        };
        let config = SoftGpuConfig {
            vram_size: 1 << 20,
            queues: 1,
            irq,
            vram_mmap: true,
            keep_vram_on_reset: false,
            spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
        };
        SoftGpu::new(config, ctx).map(|_| ())
    };
    assert!(matches!(
        build(IrqMode::Msi, &[0, 0, 16, 1, 1]),
        Err(SoftGpuError::IrqCount {
            index: 1,
            needed: 1,
            got: 0
        })
    ));
    assert!(matches!(
        build(IrqMode::Msix, &[0, 1, 8, 0, 1]),
        Err(SoftGpuError::IrqCount {
            index: 2,
            needed: 16,
            got: 8
        })
    ));
    assert!(matches!(
        build(IrqMode::Msix, &[0, 0, 16, 0, 1]),
        Err(SoftGpuError::IrqCount {
            index: 3,
            needed: 1,
            got: 0
        })
    ));
    assert!(matches!(
        build(IrqMode::Msi, &[0, 1, 0, 1, 0]),
        Err(SoftGpuError::IrqCount {
            index: 4,
            needed: 1,
            got: 0
        })
    ));
    // What the server lends before the device has described itself fits both modes.
    for irq in [IrqMode::Msix, IrqMode::Msi] {
        build(irq, &[1, 1, 2048, 1, 1]).expect("server's initial table");
    }
}

#[test]
fn msi_masking_and_disable() {
    // Disabled MSI sends nothing and enabling it replays nothing:
    // `disabled_interrupts_send_nothing_in_both_modes`.
    let mut h = Harness::msi();
    h.init();
    assert_eq!(msi_control(&mut h), 0x0081);
    h.drain_irqs();

    // INT_MASK suppresses the message; the status bit still latches.
    h.wr32(INT_MASK, int_completion(0));
    h.run(0, &[Command::nop().with_irq()]);
    assert_eq!(h.rd32(INT_STATUS), int_completion(0));
    assert_eq!(h.msi_count(), 0);
    h.wr32(INT_MASK, 0);
    h.wr32(INT_ACK, int_completion(0));

    // The client's mask (SET_IRQS on the MSI index) holds the message until it unmasks.
    h.irqs
        .set_masked(IrqIndex::Msi as u32, 0, 1, true, None)
        .expect("mask through SET_IRQS");
    h.run(0, &[Command::nop().with_irq()]);
    assert_eq!(h.msi_count(), 0);
    h.irqs
        .set_masked(IrqIndex::Msi as u32, 0, 1, false, None)
        .expect("unmask through SET_IRQS");
    assert_eq!(h.wait_msi(), 1);
    h.wr32(INT_ACK, int_completion(0));

    // Disabled again: nothing.
    let m = h.cap(CAP_MSI);
    h.cfg_write(m + 2, 0, 2);
    h.run(0, &[Command::nop().with_irq()]);
    assert_eq!(h.rd32(INT_STATUS), int_completion(0));
    assert_eq!(h.msi_count(), 0);
}

#[test]
fn every_source_shares_msi_vector_0() {
    let mut h = Harness::msi();
    h.init();
    h.drain_irqs();

    // Completion interrupts, whatever the queue's completion vector says.
    h.run(1, &[Command::nop().with_irq()]);
    assert_eq!(h.wait_msi(), 1);
    assert_eq!(h.rd32(INT_STATUS), int_completion(1));
    h.wr32(INT_ACK, int_completion(1));
    h.qw(1, Q_COMPLETION_VECTOR, 1000);
    h.run(1, &[Command::nop().with_irq()]);
    assert_eq!(h.wait_msi(), 1, "vectors >= 16 still signal in MSI mode");
    assert_eq!(h.rd32(INT_STATUS), int_completion(1));
    h.wr32(INT_ACK, int_completion(1));

    // A FENCE with an explicit vector: queue 0's completion bit on MSI vector 0.
    h.run(0, &[Command::fence(G(DATA), 0x1234, Some(7))]);
    assert_eq!(h.guest_read(DATA, 8), 0x1234u64.to_le_bytes());
    assert_eq!(h.rd64(FENCE_COUNT_LO), 1);
    assert_eq!(h.wait_msi(), 1);
    assert_eq!(h.rd32(INT_STATUS), int_completion(0));
    h.wr32(INT_ACK, int_completion(0));

    // The FENCE vector is still checked against the 16 vectors of the command format.
    let i = h.submit(0, &[Command::fence(G(DATA), 5, Some(16))]);
    let (code, index, ..) = h.wait_error(0);
    assert_eq!((code, index), (ERR_BAD_COMMAND, i));
    assert_eq!(h.wait_msi(), 1);
    assert_eq!(h.rd32(INT_STATUS), int_error(0));
    h.recover(0);
    h.wait_idle(0);

    // An error on queue 1, whose error vector points nowhere.
    h.qw(1, Q_ERROR_VECTOR, 0xffff_ffff);
    let bad = Command {
        opcode: 0x7f,
        ..Command::default()
    };
    h.submit(1, &[bad]);
    assert_eq!(h.wait_error(1).0, ERR_BAD_OPCODE);
    assert_eq!(h.wait_msi(), 1);
    assert_eq!(h.rd32(INT_STATUS), int_error(1));
    h.recover(1);
    h.wait_idle(1);
    assert_eq!(h.rd32(INT_STATUS), 0);

    // Sources raised before the driver looks: one message each, INT_STATUS tells them apart.
    h.run(0, &[Command::nop().with_irq()]);
    h.run(1, &[Command::fence(G(DATA + 8), 9, Some(3))]);
    assert_eq!(h.rd32(INT_STATUS), int_completion(0) | int_completion(1));
    assert_eq!(h.msi_count(), 2);
    assert!(h.msix.is_empty(), "no MSI-X eventfds in MSI mode");
}

#[test]
fn resets_disable_msi() {
    let mut h = Harness::msi();
    h.init();
    assert_eq!(msi_control(&mut h), 0x0081);
    let m = h.cap(CAP_MSI);
    // The register reset keeps the config space, MSI included.
    h.wr32(DEV_CONTROL, DEV_CONTROL_RESET);
    assert_eq!(msi_control(&mut h), 0x0081);
    assert_eq!(h.cfg_read(m + 4, 4), 0xfee0_0000);
    // FLR returns it to power-on.
    h.flr();
    assert_eq!(msi_control(&mut h), 0x0080);
    assert_eq!(h.cfg_read(m + 4, 4), 0);
    assert_eq!(h.cfg_read(m + 12, 2), 0);
    h.tails = vec![0; 2];
    h.enable_bus_master();
    h.setup_queue(0);
    h.drain_irqs();
    h.run(0, &[Command::nop().with_irq()]);
    assert_eq!(h.msi_count(), 0);
    h.enable_msi();
    h.run(0, &[Command::nop().with_irq()]);
    assert_eq!(h.wait_msi(), 1);
}

#[test]
fn msi_state_round_trip_and_mode_mismatch() {
    let mut a = Harness::msi();
    a.init();
    a.qw(1, Q_COMPLETION_VECTOR, 12);
    a.run(0, &[Command::nop().with_irq()]);
    let cfg: Vec<u32> = (0..4096).step_by(4).map(|o| a.cfg_read(o, 4)).collect();
    let blob = a.gpu.save_state().expect("save");
    let st = SoftGpuState::from_bytes(&blob).expect("decode");
    assert_eq!(st.config.irq, IrqMode::Msi);
    assert_eq!(st.msix.vectors(), 0);

    let mut b = a.successor();
    drop(a);
    b.gpu.restore_state(&blob).expect("restore");
    let restored: Vec<u32> = (0..4096).step_by(4).map(|o| b.cfg_read(o, 4)).collect();
    assert_eq!(restored, cfg);
    assert_eq!(b.rd32(INT_STATUS), int_completion(0));
    assert_eq!(b.qr(1, Q_COMPLETION_VECTOR), 12);
    b.wr32(INT_ACK, int_completion(0));
    b.drain_irqs();
    b.run(1, &[Command::nop().with_irq()]);
    assert_eq!(b.wait_msi(), 1, "MSI still enabled after the restore");

    // A state of the other mode is refused, both ways, and nothing of it is applied.
    let mut x = Harness::new();
    x.init();
    let msix_blob = x.gpu.save_state().expect("save");
    assert_eq!(
        b.refused(&msix_blob),
        "State was saved in interrupt mode `msix`, this device uses `msi`"
    );
    assert_eq!(
        x.refused(&blob),
        "State was saved in interrupt mode `msi`, this device uses `msix`"
    );
    assert_eq!(b.rd32(MSIX_VECTOR_COUNT), 0);
    assert_eq!(x.rd32(MSIX_VECTOR_COUNT), MSIX_VECTORS);

    // The mode's own layout is checked too.
    let json = |blob: &[u8]| -> serde_json::Value { serde_json::from_slice(blob).expect("json") };
    let mut j = json(&blob);
    j["config_space"]["msi_offset"] = serde_json::json!(4095);
    assert!(
        b.refused(&serde_json::to_vec(&j).expect("encode"))
            .contains("layout")
    );
    let mut j = json(&blob);
    j["msix_table_direct"] = serde_json::json!(true);
    assert!(
        b.refused(&serde_json::to_vec(&j).expect("encode"))
            .contains("MSI-X")
    );
    let mut j = json(&blob);
    j["msix"]["direct"] = serde_json::json!(true);
    assert!(
        b.refused(&serde_json::to_vec(&j).expect("encode"))
            .contains("MSI-X")
    );
    let mut j = json(&blob);
    j["msix"] = json(&msix_blob)["msix"].clone();
    assert!(
        b.refused(&serde_json::to_vec(&j).expect("encode"))
            .contains("vector count")
    );

    // A state saved before the interrupt mode existed (no `irq`, no `msi_offset`) is MSI-X.
    let mut j = json(&msix_blob);
    let removed = j["config"]
        .as_object_mut()
        .and_then(|c| c.remove("irq"))
        .zip(
            j["config_space"]
                .as_object_mut()
                .and_then(|c| c.remove("msi_offset")),
        );
    assert_eq!(
        removed,
        Some((serde_json::json!("msix"), serde_json::Value::Null))
    );
    let old = serde_json::to_vec(&j).expect("encode");
    x.gpu.restore_state(&old).expect("old MSI-X state");
    assert!(b.refused(&old).contains("`msix`"));
}
