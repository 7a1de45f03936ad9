//! MSI-X delivery rules.

use switchyard_device::PciDevice;

use crate::cmd::{Command, Operand};

use super::*;

fn pba(h: &mut Harness) -> u64 {
    let mut b = [0u8; 8];
    h.gpu
        .region_read(BAR_MSIX, MSIX_PBA_OFFSET, &mut b)
        .expect("pba read");
    u64::from_le_bytes(b)
}

#[test]
fn msix_disabled_sends_nothing() {
    let mut h = Harness::new();
    h.enable_bus_master();
    h.setup_queue(0);
    h.drain_irqs();
    h.run(0, &[Command::nop().with_irq()]);
    assert_eq!(
        h.rd32(INT_STATUS),
        int_completion(0),
        "status still latches"
    );
    for v in 0..MSIX_VECTORS {
        assert_eq!(h.irq_count(v), 0);
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
