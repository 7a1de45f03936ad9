//! Mapped doorbells: the doorbell page, the kick protocol, polling, and the page following the
//! device through swaps, migration and resets.

use std::sync::atomic::{Ordering, fence};

use switchyard_device::PciDevice;
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

use super::*;
use crate::VramRef;
use crate::cmd::Operand;

/// The guest's mapping of the doorbell page, made the way a VMM makes it: from BAR0's sparse
/// mmap area and the descriptor the region description offers.
pub(crate) struct GuestPage(MmapRegion<()>);

impl GuestPage {
    pub(crate) fn map(gpu: &SoftGpu) -> GuestPage {
        let bar0 = &gpu.description().regions[BAR_REGS as usize];
        let mmap = bar0.mmap.as_ref().expect("BAR0 offers an mmap area");
        assert_eq!(mmap.areas.len(), 1);
        let area = mmap.areas[0];
        assert_eq!(
            (area.offset, area.size),
            (DOORBELL_PAGE, DOORBELL_PAGE_SIZE)
        );
        let file = mmap.file.try_clone().expect("dup");
        let region = MmapRegion::<()>::from_file(
            FileOffset::new(file, mmap.file_offset + area.offset),
            area.size as usize,
        )
        .expect("map the doorbell page");
        GuestPage(region)
    }

    fn word(q: u32, reg: u64) -> usize {
        (u64::from(q) * DB_STRIDE + reg) as usize
    }

    pub(crate) fn tail(&self, q: u32) -> u32 {
        self.0
            .as_volatile_slice()
            .load(Self::word(q, DB_TAIL), Ordering::SeqCst)
            .expect("load")
    }

    pub(crate) fn need_kick(&self, q: u32) -> bool {
        self.0
            .as_volatile_slice()
            .load::<u32>(Self::word(q, DB_NEED_KICK), Ordering::SeqCst)
            .expect("load")
            != 0
    }

    /// Publishes `tail` as the driver protocol says (tail store, full fence, flag read);
    /// returns whether the device asked for a kick.
    pub(crate) fn publish(&self, q: u32, tail: u32) -> bool {
        fence(Ordering::Release);
        self.0
            .as_volatile_slice()
            .store(tail, Self::word(q, DB_TAIL), Ordering::SeqCst)
            .expect("store");
        fence(Ordering::SeqCst);
        self.need_kick(q)
    }
}

fn config(spin_us: u32) -> SoftGpuConfig {
    SoftGpuConfig {
        vram_size: 4 << 20,
        queues: 2,
        spin_us,
        ..SoftGpuConfig::default()
    }
}

/// Puts queue `q` in mapped mode (enabled).
pub(super) fn map_queue(h: &mut Harness, q: u32) {
    h.qw(q, Q_CONTROL, Q_CONTROL_ENABLE | Q_CONTROL_MAPPED);
    assert_eq!(h.qr(q, Q_CONTROL), Q_CONTROL_ENABLE | Q_CONTROL_MAPPED);
}

/// Enqueues `cmds` and submits them through the page; kicks when asked. Returns whether it
/// kicked.
pub(super) fn submit_mapped(h: &mut Harness, page: &GuestPage, q: u32, cmds: &[Command]) -> bool {
    h.enqueue(q, cmds);
    let tail = h.tails[q as usize];
    let kick = page.publish(q, tail);
    if kick {
        h.qw(q, Q_DOORBELL, 0xdead_beef);
    }
    kick
}

fn fence_cmd(slot: u64, value: u64) -> Command {
    Command::fence(Operand::Guest(slot), value, None)
}

const FENCE_SLOT: u64 = RAM1;

fn fence_value(h: &Harness) -> u64 {
    let b = h.guest_read(FENCE_SLOT, 8);
    u64::from_le_bytes(b.try_into().expect("8 bytes"))
}

#[test]
fn the_page_is_offered_and_the_feature_and_version_say_so() {
    let mut h = Harness::with_config(config(50));
    assert_ne!(h.rd32(FEATURES) & FEATURE_DOORBELL_PAGE, 0);
    assert_eq!(h.rd32(VERSION), 0x0001_0001);
    let page = GuestPage::map(&h.gpu);
    // Power-on: zeros, and the registers around the page are still trapped registers.
    for q in 0..2 {
        assert_eq!(page.tail(q), 0);
        assert!(!page.need_kick(q));
    }
    assert_eq!(h.rd32(MAGIC), MAGIC_VALUE);
}

#[test]
fn a_sleeping_engine_asks_for_a_kick_and_a_kick_runs_the_work() {
    // No polling: the engine goes to sleep at once, asking for a kick.
    let mut h = Harness::with_config(config(0));
    h.init();
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 0);
    wait_until("the engine asks for a kick", || page.need_kick(0));
    // A tail stored without the kick the device asked for stays where it is.
    h.enqueue(0, &[fence_cmd(FENCE_SLOT, 7)]);
    let tail = h.tails[0];
    assert!(page.publish(0, tail), "the device asked for a kick");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(h.qr(0, Q_HEAD), tail - 1, "nothing ran without the kick");
    assert_eq!(fence_value(&h), 0);
    // The kick (its value ignored) makes the engine take DB_TAIL.
    h.qw(0, Q_DOORBELL, 0);
    h.wait_idle(0);
    assert_eq!(fence_value(&h), 7);
    assert_eq!(h.qr(0, Q_TAIL), tail, "TAIL reads the tail the device took");
    wait_until("the engine asks for a kick again", || page.need_kick(0));
}

/// A device whose engine 0 polls in windows of 30 s (a test hook) instead of the adaptive
/// budget, whose windows a loaded machine can outlast; queue 1 off (one engine of a device
/// polls at a time, and it would be a contender).
fn polling_harness() -> Harness {
    let mut h = Harness::with_config(config(SoftGpuConfig::MAX_SPIN_US));
    h.init();
    h.qw(1, Q_CONTROL, 0);
    h.gpu
        .shared
        .hook
        .poll_us
        .store(30_000_000, Ordering::Relaxed);
    h
}

#[test]
fn a_polling_engine_takes_tails_without_kicks() {
    // Poll windows of 30 s instead of the adaptive budget (whose windows a loaded machine can
    // outlast): the engine is polling whenever a tail is published, so no submission may ask
    // for a kick, and each one runs.
    let mut h = polling_harness();
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 0);
    let jobs = 40u64;
    let mut kicks = 0;
    for v in 1..=jobs {
        kicks += u64::from(submit_mapped(&mut h, &page, 0, &[fence_cmd(FENCE_SLOT, v)]));
        wait_until("the fence", || fence_value(&h) == v);
    }
    h.wait_idle(0);
    assert_eq!(h.qr(0, Q_HEAD), h.tails[0]);
    assert_eq!(kicks, 0, "{kicks} of {jobs} submissions asked for a kick");
}

#[test]
fn a_queue_turned_mapped_while_its_engine_polls_needs_no_kick() {
    // The control write that turns the queue mapped ends the engine's poll window (so the
    // page is looked at now); the engine, having found no work, polls again instead of going
    // to sleep and asking the driver for a kick it does not need.
    let mut h = polling_harness();
    // A trapped doorbell with nothing new wakes the engine into a 30 s window.
    let tail = h.tails[0];
    h.qw(0, Q_DOORBELL, tail);
    wait_until("the engine polls", || h.gpu.shared.is_polling(0));
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 0);
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !page.need_kick(0),
        "the engine went to sleep on the control write"
    );
    assert!(!submit_mapped(
        &mut h,
        &page,
        0,
        &[fence_cmd(FENCE_SLOT, 3)]
    ));
    wait_until("the fence", || fence_value(&h) == 3);
}

#[test]
fn mapped_and_trapped_queues_work_side_by_side() {
    let mut h = Harness::with_config(config(50));
    h.init();
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 1);
    for round in 0..20u8 {
        let a = DATA + u64::from(round) * 0x2000;
        let b = a + 0x1000;
        h.submit(
            0,
            &[Command::fill(
                Operand::Guest(a),
                0x100,
                u32::from_le_bytes([round; 4]),
            )],
        );
        submit_mapped(
            &mut h,
            &page,
            1,
            &[Command::fill(
                Operand::Guest(b),
                0x100,
                u32::from_le_bytes([round + 1; 4]),
            )],
        );
        h.wait_idle(0);
        h.wait_idle(1);
        assert!(h.guest_read(a, 0x100).iter().all(|&x| x == round));
        assert!(h.guest_read(b, 0x100).iter().all(|&x| x == round + 1));
    }
    // The trapped queue's slot in the page is not its tail.
    assert_eq!(page.tail(0), 0);
}

#[test]
fn entering_mapped_mode_continues_from_tail_and_resets_clear_the_page() {
    let mut h = Harness::with_config(config(50));
    h.init();
    let page = GuestPage::map(&h.gpu);
    for v in 1..=3 {
        h.run(0, &[fence_cmd(FENCE_SLOT, v)]);
    }
    map_queue(&mut h, 0);
    assert_eq!(page.tail(0), 3, "the page starts at TAIL");
    submit_mapped(&mut h, &page, 0, &[fence_cmd(FENCE_SLOT, 4)]);
    h.wait_idle(0);
    assert_eq!(fence_value(&h), 4);
    // Leaving mapped mode: TAIL writes are tails again.
    h.qw(0, Q_CONTROL, Q_CONTROL_ENABLE);
    h.run(0, &[fence_cmd(FENCE_SLOT, 5)]);
    assert_eq!(fence_value(&h), 5);
    // A queue reset in mapped mode: head = tail = 0 in the registers and in the page.
    h.qw(0, Q_CONTROL, Q_CONTROL_RESET | Q_CONTROL_MAPPED);
    assert_eq!((h.qr(0, Q_HEAD), h.qr(0, Q_TAIL)), (0, 0));
    assert_eq!(page.tail(0), 0);
    assert_eq!(h.qr(0, Q_CONTROL), Q_CONTROL_MAPPED);
    // A device reset clears the page and leaves mapped mode.
    h.qw(1, Q_CONTROL, Q_CONTROL_ENABLE | Q_CONTROL_MAPPED);
    page.publish(1, 0);
    h.wr32(DEV_CONTROL, DEV_CONTROL_RESET);
    for q in 0..2 {
        assert_eq!(page.tail(q), 0);
        assert!(!page.need_kick(q));
        assert_eq!(h.qr(q, Q_CONTROL), 0);
    }
}

#[test]
fn a_bad_mapped_tail_stops_the_queue_until_the_driver_corrects_it() {
    let mut h = Harness::with_config(config(0));
    h.init();
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 0);
    let bad = RING_ENTRIES + 1;
    page.publish(0, bad);
    h.qw(0, Q_DOORBELL, 0);
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_ERROR);
    assert_eq!(h.qr(0, Q_ERROR_CODE), ERR_BAD_DOORBELL);
    assert_eq!(h.rd64(queue_reg(0, Q_ERROR_ADDR_LO)), u64::from(bad));
    assert_eq!(h.qr(0, Q_TAIL), 0, "the bad tail was refused");
    h.wr32(INT_ACK, int_error(0));
    // Recovering with the bad tail still in the page faults again.
    h.qw(
        0,
        Q_CONTROL,
        Q_CONTROL_RECOVER | Q_CONTROL_ENABLE | Q_CONTROL_MAPPED,
    );
    assert_eq!(h.qr(0, Q_ERROR_CODE), ERR_BAD_DOORBELL);
    // Corrected, the queue runs.
    page.publish(0, 0);
    h.qw(
        0,
        Q_CONTROL,
        Q_CONTROL_RECOVER | Q_CONTROL_ENABLE | Q_CONTROL_MAPPED,
    );
    assert_eq!(h.qr(0, Q_STATUS), Q_STATUS_IDLE);
    submit_mapped(&mut h, &page, 0, &[fence_cmd(FENCE_SLOT, 9)]);
    h.wait_idle(0);
    assert_eq!(fence_value(&h), 9);
}

#[test]
fn trapped_accesses_to_the_page_store_and_kick() {
    let mut h = Harness::with_config(config(0));
    h.init();
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 0);
    wait_until("the engine asks for a kick", || page.need_kick(0));
    h.enqueue(0, &[fence_cmd(FENCE_SLOT, 3)]);
    // A client that does not map the page writes DB_TAIL through the socket: stored and a
    // kick at once.
    h.wr32(doorbell_slot(0, DB_TAIL), h.tails[0]);
    h.wait_idle(0);
    assert_eq!(fence_value(&h), 3);
    assert_eq!(h.rd32(doorbell_slot(0, DB_TAIL)), h.tails[0]);
    assert_eq!(page.tail(0), h.tails[0]);
    // A trapped queue's slot is memory, not its tail.
    h.wr32(doorbell_slot(1, DB_TAIL), 5);
    assert_eq!(h.qr(1, Q_TAIL), 0);
    assert_eq!(h.rd32(doorbell_slot(1, DB_TAIL)), 5);
    // 8-byte accesses and the reserved rest of the page.
    h.wr64(DOORBELL_PAGE + 0x800, 0x1122_3344_5566_7788);
    assert_eq!(h.rd64(DOORBELL_PAGE + 0x800), 0x1122_3344_5566_7788);
    // Misaligned accesses are refused as for any BAR0 register.
    let mut b = [0u8; 4];
    assert!(
        h.gpu
            .region_read(BAR_REGS, DOORBELL_PAGE + 2, &mut b)
            .is_err()
    );
}

#[test]
fn a_swap_keeps_the_page_and_a_tail_written_during_it_runs_once() {
    let mut h = Harness::with_config(config(0));
    h.init();
    let page = GuestPage::map(&h.gpu);
    map_queue(&mut h, 0);
    submit_mapped(&mut h, &page, 0, &[fence_cmd(FENCE_SLOT, 1)]);
    h.wait_idle(0);
    let mut next = SoftGpu::successor(h.config, h.slot_ctx()).expect("successor");
    assert_eq!(
        VramRef::of(&next.doorbell_memfd().expect("page")).expect("stat"),
        VramRef::of(&h.gpu.doorbell_memfd().expect("page")).expect("stat"),
        "the successor is lent the slot's page"
    );
    // The guest submits while the old device is parked for the swap: no kick reaches
    // anyone (the old device is held, the successor not running yet).
    let parked = h.gpu.engine_control().park();
    h.enqueue(0, &[Command::fill(Operand::Guest(DATA), 0x40, 0xab)]);
    h.enqueue(0, &[fence_cmd(FENCE_SLOT, 2)]);
    let tail = h.tails[0];
    page.publish(0, tail);
    h.gpu.hand_over_to(&mut next).expect("hand over");
    drop(parked);
    let old = std::mem::replace(&mut h.gpu, next);
    drop(old);
    // The successor took the tail from the page (no kick needed: it looks when it starts).
    h.wait_idle(0);
    assert_eq!(fence_value(&h), 2);
    assert_eq!(h.qr(0, Q_COMPLETED_LO), 3, "every command ran exactly once");
    // The old device's engines are gone without clearing the successor's kick request.
    wait_until("the successor asks for a kick", || page.need_kick(0));
    assert!(submit_mapped(&mut h, &page, 0, &[fence_cmd(FENCE_SLOT, 3)]));
    h.wait_idle(0);
    assert_eq!(fence_value(&h), 3);
}

#[test]
fn a_migrated_state_brings_its_tails_to_the_destination_page() {
    let mut a = Harness::with_config(config(0));
    a.init();
    let page_a = GuestPage::map(&a.gpu);
    map_queue(&mut a, 0);
    submit_mapped(&mut a, &page_a, 0, &[fence_cmd(FENCE_SLOT, 1)]);
    a.wait_idle(0);
    // Stopped for the migration: the guest's last submission is only in the page.
    a.gpu.set_running(false);
    a.enqueue(0, &[fence_cmd(FENCE_SLOT, 2)]);
    let tail = a.tails[0];
    page_a.publish(0, tail);
    let state = a.gpu.snapshot();
    assert_eq!(
        state.queues[0].tail, tail,
        "the snapshot takes the page's tail"
    );
    assert!(state.queues[0].mapped);

    let mut b = Harness::with_config(config(0));
    let page_b = GuestPage::map(&b.gpu);
    b.guest_write(Harness::ring(0), &a.guest_read(Harness::ring(0), 0x1000));
    b.gpu.load(state).expect("load");
    assert_eq!(page_b.tail(0), tail, "the destination page holds the tail");
    assert_eq!(b.qr(0, Q_CONTROL), Q_CONTROL_ENABLE | Q_CONTROL_MAPPED);
    b.tails[0] = tail;
    b.wait_idle(0);
    assert_eq!(fence_value(&b), 2);
}
