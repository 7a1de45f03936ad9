//! MSI-X delivery rules (and the enable rule MSI mode shares).

use switchyard_device::PciDevice;

use crate::SoftGpuState;
use crate::cmd::{Command, Operand};

use super::*;

fn pba(h: &mut Harness) -> u64 {
    let mut b = [0u8; 8];
    h.gpu
        .region_read(BAR_MSIX, MSIX_PBA_OFFSET, &mut b)
        .expect("pba read");
    u64::from_le_bytes(b)
}

fn table_word(h: &mut Harness, vector: u64, word: u64) -> u32 {
    let mut b = [0u8; 4];
    h.gpu
        .region_read(BAR_MSIX, MSIX_TABLE_OFFSET + vector * 16 + word * 4, &mut b)
        .expect("table read");
    u32::from_le_bytes(b)
}

#[test]
fn disabled_interrupts_send_nothing_in_both_modes() {
    for irq in [IrqMode::Msix, IrqMode::Msi] {
        let mut h = Harness::with_irq(irq);
        h.enable_bus_master();
        h.setup_queue(0);
        h.drain_irqs();
        h.run(0, &[Command::nop().with_irq()]);
        assert_eq!(
            h.rd32(INT_STATUS),
            int_completion(0),
            "{irq}: status still latches"
        );
        assert_eq!(h.irq_total(), 0, "{irq}: no message while disabled");
        h.wr32(INT_ACK, int_completion(0));
        // Enabling does not replay what happened while it was off.
        h.enable_irqs();
        assert_eq!(h.irq_total(), 0, "{irq}: nothing replayed");
        h.run(0, &[Command::nop().with_irq()]);
        assert_eq!(h.wait_source(0), 1, "{irq}");
        assert_eq!(h.rd32(INT_STATUS), int_completion(0), "{irq}");
        assert_eq!(h.irq_total(), 0, "{irq}");
    }
}

#[test]
fn table_written_by_the_client_masks_and_pends() {
    let mut h = Harness::new();
    h.init();
    h.drain_irqs();
    // Program vector 2 through BAR4 (a client that does not emulate the table). It stays
    // masked at power-on.
    h.msix_entry_write(2, 0, 0xfee0_0000);
    h.msix_entry_write(2, 2, 0x41);
    let mut entry = [0u8; 16];
    let (lo, hi) = entry.split_at_mut(8);
    h.gpu.region_read(BAR_MSIX, 32, lo).expect("table read");
    h.gpu.region_read(BAR_MSIX, 40, hi).expect("table read");
    assert_eq!(&entry[..4], &0xfee0_0000u32.to_le_bytes());
    assert_eq!(&entry[12..], &1u32.to_le_bytes(), "masked");
    h.run(0, &[Command::fence(Operand::Guest(DATA), 1, Some(2))]);
    assert_eq!(h.irq_count(2), 0);
    assert_eq!(pba(&mut h), 1 << 2);
    // Unmask: the pending message is delivered.
    h.msix_entry_write(2, 3, 0);
    assert_eq!(h.wait_irq(2), 1);
    assert_eq!(pba(&mut h), 0);
    // Function mask holds it until cleared.
    let m = h.cap(CAP_MSIX);
    h.cfg_write(m + 2, 0xc000, 2);
    h.run(0, &[Command::fence(Operand::Guest(DATA), 2, Some(2))]);
    assert_eq!(h.irq_count(2), 0);
    assert_eq!(pba(&mut h), 1 << 2);
    h.cfg_write(m + 2, 0x8000, 2);
    assert_eq!(h.wait_irq(2), 1);
    // PBA writes are ignored.
    h.gpu
        .region_write(BAR_MSIX, MSIX_PBA_OFFSET, &[0xff; 8])
        .expect("pba write");
    assert_eq!(pba(&mut h), 0);
    // Reserved bits: address bits 1:0 and vector control bits 31:1 read as zero.
    h.msix_entry_write(3, 0, 0xffff_ffff);
    h.msix_entry_write(3, 3, 0xffff_ffff);
    assert_eq!(table_word(&mut h, 3, 0), 0xffff_fffc);
    assert_eq!(table_word(&mut h, 3, 3), 1);
    h.msix_entry_write(3, 3, 0xffff_fffe);
    assert_eq!(table_word(&mut h, 3, 3), 0);
}

#[test]
fn pending_vectors_wait_for_msix_enable() {
    let mut h = Harness::new();
    h.init();
    h.drain_irqs();
    h.msix_entry_write(2, 0, 0xfee0_0000);
    h.run(0, &[Command::fence(Operand::Guest(DATA), 1, Some(2))]);
    assert_eq!(pba(&mut h), 1 << 2);
    // Disable MSI-X, then unmask the entry: nothing is sent while MSI-X is off.
    let m = h.cap(CAP_MSIX);
    h.cfg_write(m + 2, 0, 2);
    h.msix_entry_write(2, 3, 0);
    assert_eq!(h.irq_count(2), 0);
    assert_eq!(pba(&mut h), 1 << 2);
    // Re-enabled with the function masked: still held.
    h.cfg_write(m + 2, 0xc000, 2);
    assert_eq!(h.irq_count(2), 0);
    assert_eq!(pba(&mut h), 1 << 2);
    // Function unmasked: delivered once.
    h.cfg_write(m + 2, 0x8000, 2);
    assert_eq!(h.wait_irq(2), 1);
    assert_eq!(pba(&mut h), 0);
    assert_eq!(h.irq_total(), 0);
}

#[test]
fn states_from_before_the_flag_moved_keep_the_table_mode() {
    // The table-written flag used to be the top-level `msix_table_direct` of the state; it
    // now lives in `msix`. Old states restore with the table mode they were saved in.
    let mut a = Harness::new();
    a.init();
    let emulated = a.gpu.save_state().expect("save");
    a.msix_entry_write(2, 0, 0xfee0_0000);
    let direct = a.gpu.save_state().expect("save");
    let json = |blob: &[u8]| -> serde_json::Value { serde_json::from_slice(blob).expect("json") };
    assert_eq!(json(&emulated)["msix"]["direct"], serde_json::json!(false));
    assert_eq!(json(&direct)["msix"]["direct"], serde_json::json!(true));
    let old = |blob: &[u8]| -> Vec<u8> {
        let mut j = json(blob);
        let d = j["msix"]
            .as_object_mut()
            .and_then(|m| m.remove("direct"))
            .expect("direct flag");
        j["msix_table_direct"] = d;
        serde_json::to_vec(&j).expect("encode")
    };
    let mut b = a.successor();
    drop(a);
    let fence = |h: &mut Harness, v: u64| {
        h.run(0, &[Command::fence(Operand::Guest(DATA), v, Some(2))]);
    };
    // Saved before the client wrote the table: masks are ignored.
    b.gpu.restore_state(&old(&emulated)).expect("old state");
    b.drain_irqs();
    fence(&mut b, 1);
    assert_eq!(b.wait_irq(2), 1);
    assert_eq!(pba(&mut b), 0);
    // Saved after: vector 2 is masked in the table and goes pending.
    b.gpu.restore_state(&old(&direct)).expect("old state");
    b.tails = vec![b.qr(0, Q_TAIL), b.qr(1, Q_TAIL)];
    fence(&mut b, 2);
    assert_eq!(b.irq_count(2), 0);
    assert_eq!(pba(&mut b), 1 << 2);
    let st = SoftGpuState::from_bytes(&b.gpu.save_state().expect("save")).expect("decode");
    assert!(st.msix.direct());
    // A malformed legacy flag is a decode error.
    let mut j = json(&emulated);
    j["msix_table_direct"] = serde_json::json!("yes");
    assert!(
        b.refused(&serde_json::to_vec(&j).expect("encode"))
            .contains("decode")
    );
}

#[test]
fn client_emulated_table_delivers_directly() {
    // QEMU and Cloud Hypervisor never write the table to the device; the vector still fires
    // (they mask by re-routing the eventfd, which `Interrupts` models).
    let mut h = Harness::new();
    h.init();
    h.drain_irqs();
    h.run(1, &[Command::nop().with_irq()]);
    assert_eq!(h.wait_irq(1), 1);
    assert_eq!(pba(&mut h), 0);
    h.irqs
        .set_masked(2, 1, 1, true, None)
        .expect("mask through SET_IRQS");
    h.run(1, &[Command::nop().with_irq()]);
    assert_eq!(h.irq_count(1), 0);
    h.irqs
        .set_masked(2, 1, 1, false, None)
        .expect("unmask through SET_IRQS");
    assert_eq!(h.wait_irq(1), 1);
}
