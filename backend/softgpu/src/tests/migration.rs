//! The migration stream and the migration arcs, device to device.

use switchyard_device::Migratable;
use switchyard_device::{MigArc, PciDevice};

use crate::cmd::{Command, Operand};

use super::*;

const VRAM: u64 = 4 << 20;
const PAGE: u64 = 4096;

/// A small deterministic generator (xorshift).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

fn page_of(seed: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..PAGE / 8).flat_map(|_| r.next().to_le_bytes()).collect()
}

/// Every BAR0 register, without `DEV_STATUS`'s "stopped by the host" bit (a stopped
/// source has it, the resumed destination not).
fn register_dump(h: &mut Harness) -> Vec<u32> {
    (0..0x2000)
        .step_by(4)
        .map(|o| {
            let v = h.rd32(o);
            if o == DEV_STATUS { v & !8 } else { v }
        })
        .collect()
}

/// Reads the outgoing stream in chunks of random sizes until a short read.
fn read_round(gpu: &mut SoftGpu, rng: &mut Rng, out: &mut Vec<u8>) -> usize {
    let mut total = 0;
    loop {
        let want = 1 + rng.below(70_000) as usize;
        let mut buf = vec![0u8; want];
        let n = gpu.read(&mut buf).expect("migration_read");
        out.extend_from_slice(&buf[..n]);
        total += n;
        if n < want {
            return total;
        }
    }
}

/// Writes `stream` in chunks of random sizes.
fn write_all(gpu: &mut SoftGpu, rng: &mut Rng, stream: &[u8]) {
    let mut at = 0;
    while at < stream.len() {
        let k = (1 + rng.below(50_000) as usize).min(stream.len() - at);
        gpu.write(&stream[at..at + k]).expect("migration_write");
        at += k;
    }
}

fn small() -> SoftGpuConfig {
    SoftGpuConfig {
        vram_size: VRAM,
        queues: 2,
        irq: IrqMode::Msix,
        vram_mmap: true,
        keep_vram_on_reset: false,
        spin_us: SoftGpuConfig::DEFAULT_SPIN_US,
    }
}

/// Pages written through the memfd (as a guest does through its mapping of the BAR), some
/// by the engines, some zero; returns the pages written.
fn scribble(h: &mut Harness, rng: &mut Rng, pages: usize) -> Vec<u64> {
    let mut written = Vec::new();
    for _ in 0..pages {
        let p = rng.below(VRAM / PAGE);
        h.vram_file_write(p * PAGE, &page_of(rng.next()));
        written.push(p);
    }
    written
}

fn resume_into(b: &mut Harness, rng: &mut Rng, stream: &[u8]) {
    b.gpu.step(MigArc::Stop).expect("stop");
    b.gpu.step(MigArc::StartResuming).expect("resuming");
    write_all(&mut b.gpu, rng, stream);
    b.gpu.step(MigArc::EndResuming).expect("load");
    b.gpu.step(MigArc::Run).expect("run");
}

#[test]
fn stop_copy_stream_survives_any_chunking() {
    for seed in 1..6u64 {
        let mut rng = Rng(seed * 0x9e37_79b9);
        let mut a = Harness::with_config(small());
        a.init();
        a.wr32(SCRATCH, seed as u32);
        scribble(&mut a, &mut rng, 40);
        a.run(
            0,
            &[Command::fill(
                Operand::Vram(0x3000),
                3 * PAGE,
                0xa5a5_0000 | seed as u32,
            )],
        );
        // Stale contents on the destination must not survive.
        let mut b = Harness::with_config(small());
        b.vram_file_write(0x10_0000, &page_of(99));
        a.gpu.step(MigArc::Stop).expect("stop");
        a.gpu.step(MigArc::StartStopCopy).expect("stop copy");
        let mut stream = Vec::new();
        read_round(&mut a.gpu, &mut rng, &mut stream);
        let mut tail = [0u8; 64];
        assert_eq!(a.gpu.read(&mut tail).expect("read"), 0, "stream over");
        resume_into(&mut b, &mut rng, &stream);
        assert!(
            a.vram_file_read(0, VRAM as usize) == b.vram_file_read(0, VRAM as usize),
            "seed {seed}: VRAM differs"
        );
        assert!(
            register_dump(&mut a) == register_dump(&mut b),
            "registers differ"
        );
        let pages = a.gpu.migration_stats().expect("stats").pages_sent;
        assert!(
            pages <= 43,
            "only written pages travel (holes and zero pages do not): {pages}"
        );
    }
}

#[test]
fn precopy_rounds_send_what_changed_and_stop_copy_completes() {
    let mut rng = Rng(7);
    let mut a = Harness::with_config(small());
    a.init();
    let first = scribble(&mut a, &mut rng, 64);
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    let mut stream = Vec::new();
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let distinct = {
        let mut v = first.clone();
        v.sort_unstable();
        v.dedup();
        v.len() as u64
    };
    assert_eq!(a.gpu.migration_stats().expect("stats").pages_sent, distinct);
    // Nothing changed: a round of nothing.
    let mut buf = vec![0u8; 1 << 16];
    assert_eq!(a.gpu.read(&mut buf).expect("read"), 0);

    // The device keeps running in PRE_COPY: the guest rewrites two sent pages and an engine
    // fills a fresh range; one sent page becomes a hole again.
    let (p0, p1) = (first[0], first[1]);
    a.vram_file_write(p0 * PAGE, &page_of(1234));
    a.vram_file_write(p1 * PAGE + 100, b"changed");
    a.run(
        0,
        &[Command::fill(
            Operand::Vram(VRAM - 2 * PAGE),
            2 * PAGE,
            0x1111_2222,
        )],
    );
    let punched = first
        .iter()
        .copied()
        .find(|&p| p != p0 && p != p1 && p < VRAM / PAGE - 2)
        .expect("another page");
    vmm_sys_util::fallocate::fallocate(
        &**a.gpu.vram_file(),
        vmm_sys_util::fallocate::FallocateMode::PunchHole,
        true,
        punched * PAGE,
        PAGE,
    )
    .expect("punch");
    let before = a.gpu.migration_stats().expect("stats");
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let after = a.gpu.migration_stats().expect("stats");
    assert_eq!(
        after.pages_sent - before.pages_sent,
        4,
        "two rewritten + two filled"
    );
    assert_eq!(
        after.pages_zeroed - before.pages_zeroed,
        1,
        "the punched page"
    );

    // Work queued while bus mastering is off runs on the destination, not here.
    a.set_command(pci::CMD_MEMORY);
    a.submit(0, &[Command::fill(Operand::Vram(0), PAGE, 0x5a5a_5a5a)]);
    a.gpu.step(MigArc::PreCopyToStopCopy).expect("stop copy");
    a.vram_file_write(5 * PAGE, &page_of(5)); // a guest that was not stopped: still caught
    read_round(&mut a.gpu, &mut rng, &mut stream);
    a.gpu.step(MigArc::EndStopCopy).expect("end stop copy");

    // Guest RAM (rings included) moves separately, as the VMM migrates it.
    let mut b = Harness::with_config(small());
    for (wa, wb) in a.windows.iter().zip(&b.windows) {
        let mut buf = vec![0u8; wa.size as usize];
        wa.file.read_exact_at(&mut buf, 0).expect("read RAM");
        wb.file.write_all_at(&buf, 0).expect("write RAM");
    }
    b.tails = a.tails.clone();
    resume_into(&mut b, &mut rng, &stream);
    assert!(a.vram_file_read(0, VRAM as usize) == b.vram_file_read(0, VRAM as usize));
    assert_eq!(
        b.qr(0, Q_STATUS),
        Q_STATUS_PAUSED,
        "pending work came along"
    );
    b.enable_bus_master();
    b.wait_idle(0);
    assert_eq!(b.vram_file_read(0, 4), vec![0x5a; 4]);
    assert_ne!(
        a.vram_file_read(0, 4),
        vec![0x5a; 4],
        "the source stays stopped"
    );
}

#[test]
fn refused_streams_leave_the_device_as_it_was() {
    let mut rng = Rng(11);
    let mut a = Harness::with_config(small());
    a.init();
    scribble(&mut a, &mut rng, 8);
    a.gpu.step(MigArc::Stop).expect("stop");
    a.gpu.step(MigArc::StartStopCopy).expect("sc");
    let mut good = Vec::new();
    read_round(&mut a.gpu, &mut rng, &mut good);
    let rec = |tag: u32, count: u32, offset: u64| -> Vec<u8> {
        let mut v = tag.to_le_bytes().to_vec();
        v.extend_from_slice(&count.to_le_bytes());
        v.extend_from_slice(&offset.to_le_bytes());
        v
    };
    let begin = good[..16].to_vec();
    let cases: Vec<(&str, Vec<u8>, bool)> = vec![
        ("no begin record", rec(2, 1, 0), true),
        (
            "wrong format",
            rec(u32::from_le_bytes(*b"SYGM"), 2, VRAM),
            true,
        ),
        (
            "wrong VRAM size",
            rec(u32::from_le_bytes(*b"SYGM"), 1, VRAM * 2),
            true,
        ),
        (
            "pages past VRAM",
            [begin.clone(), rec(2, 2, VRAM - PAGE)].concat(),
            true,
        ),
        (
            "unaligned pages",
            [begin.clone(), rec(2, 1, 100)].concat(),
            true,
        ),
        (
            "zero-count pages",
            [begin.clone(), rec(3, 0, 0)].concat(),
            true,
        ),
        ("unknown tag", [begin.clone(), rec(9, 0, 0)].concat(), true),
        (
            "end before state",
            [begin.clone(), rec(5, 0, 0)].concat(),
            true,
        ),
        ("trailing bytes", [good.clone(), vec![0]].concat(), true),
        ("truncated", good[..good.len() - 1].to_vec(), false),
    ];
    for (what, stream, write_fails) in cases {
        let mut b = Harness::with_config(small());
        b.init();
        b.wr32(SCRATCH, 77);
        b.gpu.step(MigArc::Stop).expect("stop");
        b.gpu.step(MigArc::StartResuming).expect("resuming");
        let w = b.gpu.write(&stream);
        match (&w, write_fails) {
            (Ok(()), false) | (Err(DeviceError::BadState(_)), true) => {}
            _ => panic!("{what}: write: {w:?} (expected to fail: {write_fails})"),
        }
        let end = b.gpu.step(MigArc::EndResuming);
        assert!(
            matches!(end, Err(DeviceError::BadState(_))),
            "{what}: loading must fail as bad state: {end:?}"
        );
        assert_eq!(b.rd32(SCRATCH), 77, "{what}: state kept");
        b.gpu.abort();
    }
}

fn tracked() -> SoftGpuConfig {
    SoftGpuConfig {
        vram_mmap: false,
        ..small()
    }
}

fn trapped_write(h: &mut Harness, offset: u64, data: &[u8]) {
    h.gpu
        .region_write(crate::BAR_VRAM, offset, data)
        .expect("trapped VRAM write");
}

#[test]
fn without_mmap_rounds_after_the_first_visit_only_logged_pages() {
    let mut rng = Rng(21);
    let mut a = Harness::with_config(tracked());
    assert!(
        a.gpu.description().regions[crate::BAR_VRAM as usize]
            .mmap
            .is_none(),
        "VRAM is not offered for mmap"
    );
    a.init();
    for p in [3u64, 4, 200, 900] {
        trapped_write(&mut a, p * PAGE, &page_of(p));
    }
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    let mut stream = Vec::new();
    read_round(&mut a.gpu, &mut rng, &mut stream);
    assert_eq!(a.gpu.migration_stats().expect("stats").pages_sent, 4);

    // Logged: two trapped writes and an engine's FILL. Not logged: a write behind the
    // device's back (no client can do that without a mapping; here it proves that the
    // round reads the log, not all of VRAM).
    trapped_write(&mut a, 4 * PAGE + 10, b"trapped");
    trapped_write(&mut a, 700 * PAGE, &page_of(700));
    a.run(
        0,
        &[Command::fill(Operand::Vram(800 * PAGE), PAGE, 0x0101_0101)],
    );
    a.vram_file_write(500 * PAGE, &page_of(500));
    let before = a.gpu.migration_stats().expect("stats").pages_sent;
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let after = a.gpu.migration_stats().expect("stats").pages_sent;
    assert_eq!(after - before, 3, "the logged pages, and only those");

    // Stop in the middle of a logged round: the final round still covers everything logged.
    for p in 0..40u64 {
        trapped_write(&mut a, (600 + 2 * p) * PAGE, &page_of(1000 + p));
    }
    let mut part = vec![0u8; 3 * PAGE as usize];
    assert_eq!(
        a.gpu.read(&mut part).expect("read"),
        part.len(),
        "the round is not over"
    );
    stream.extend_from_slice(&part);
    a.gpu.step(MigArc::PreCopyToStopCopy).expect("stop copy");
    read_round(&mut a.gpu, &mut rng, &mut stream);
    assert_eq!(
        a.gpu.migration_stats().expect("stats").pages_sent - after,
        40
    );

    let mut b = Harness::with_config(tracked());
    resume_into(&mut b, &mut rng, &stream);
    let (va, vb) = (
        a.vram_file_read(0, VRAM as usize),
        b.vram_file_read(0, VRAM as usize),
    );
    let differing: Vec<u64> = (0..VRAM / PAGE)
        .filter(|&p| {
            let r = (p * PAGE) as usize..((p + 1) * PAGE) as usize;
            va[r.clone()] != vb[r]
        })
        .collect();
    assert_eq!(differing, vec![500], "only the unlogged page is missing");
}

/// With the client migrating the mapped VRAM (`set_client_migrates_mapped`), the stream
/// never reads all of VRAM: a pre-copy stream sends only what the device logged after it
/// began (every such page, even one whose content the destination was last sent by this
/// stream, here a zero FILL), at the stop too; what the client wrote through the mapping
/// is the client's to send and does not appear.
#[test]
fn with_the_client_migrating_mapped_vram_only_the_devices_writes_are_sent() {
    let mut rng = Rng(35);
    let mut a = Harness::with_config(small());
    a.init();
    assert_eq!(a.gpu.client_migratable_regions(), 0b101, "BAR0 and BAR2");
    // Before the stream: data the client's RAM pass reads, not this stream.
    scribble(&mut a, &mut rng, 50);
    a.run(0, &[Command::fill(Operand::Vram(10 * PAGE), 4 * PAGE, 7)]);
    a.gpu.set_client_migrates_mapped(true);
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    let mut stream = Vec::new();
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let st = a.gpu.migration_stats().expect("stats");
    assert_eq!((st.pages_sent, st.pages_zeroed), (0, 0), "{st:?}");

    // The device's writes: an engine FILL of zeros over a page the destination holds as
    // zero as far as this stream knows, and a trapped write. The mapping's write is not.
    a.run(0, &[Command::fill(Operand::Vram(300 * PAGE), PAGE, 0)]);
    trapped_write(&mut a, 301 * PAGE, &page_of(301));
    a.vram_file_write(302 * PAGE, &page_of(302));
    read_round(&mut a.gpu, &mut rng, &mut stream);
    assert_eq!(a.gpu.migration_stats().expect("stats").pages_sent, 2);

    a.run(0, &[Command::fill(Operand::Vram(400 * PAGE), 2 * PAGE, 9)]);
    a.gpu.step(MigArc::PreCopyToStopCopy).expect("stop copy");
    read_round(&mut a.gpu, &mut rng, &mut stream);
    assert_eq!(
        a.gpu.migration_stats().expect("stats").pages_sent,
        4,
        "the final round visits the log, not VRAM"
    );
    a.gpu.step(MigArc::EndStopCopy).expect("end");

    // The destination holds the device's pages; the client's copy brings the rest.
    let mut b = Harness::with_config(small());
    resume_into(&mut b, &mut rng, &stream);
    for p in [301u64, 400, 401] {
        let r = a.vram_file_read(p * PAGE, PAGE as usize);
        assert_eq!(b.vram_file_read(p * PAGE, PAGE as usize), r, "page {p}");
    }
    assert_eq!(
        b.vram_file_read(302 * PAGE, PAGE as usize),
        vec![0u8; PAGE as usize],
        "the mapping's write is not this stream's"
    );

    // A new client has not asked: the next stream reads VRAM again.
    a.gpu.client_disconnected();
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    read_round(&mut a.gpu, &mut rng, &mut Vec::new());
    assert!(a.gpu.migration_stats().expect("stats").pages_sent > 40);
}

/// A VRAM of `size` bytes, every page of it data (no two pages alike).
fn filled(config: SoftGpuConfig, size: u64) -> Harness {
    let mut a = Harness::with_config(SoftGpuConfig {
        vram_size: size,
        ..config
    });
    a.init();
    let mut fill = vec![0u8; 1 << 20];
    for (i, chunk) in fill.chunks_mut(8).enumerate() {
        chunk.copy_from_slice(&(i as u64 | 1).to_le_bytes());
    }
    for mib in 0..size >> 20 {
        fill[..8].copy_from_slice(&mib.to_le_bytes());
        a.vram_file_write(mib << 20, &fill);
    }
    a
}

/// Reads until a read returns nothing; the bytes read.
fn read_until_empty(gpu: &mut SoftGpu, out: &mut Vec<u8>) -> u64 {
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0;
    loop {
        let n = gpu.read(&mut buf).expect("read");
        if n == 0 {
            return total;
        }
        out.extend_from_slice(&buf[..n]);
        total += n as u64;
    }
}

fn info(gpu: &mut SoftGpu) -> (u64, u64) {
    let i = gpu.precopy_info().expect("a stream reports its sizes");
    (i.initial_bytes, i.dirty_bytes)
}

/// Bytes a page costs at most in the stream (its data and a record header).
const PAGE_COST: u64 = PAGE + 16;

#[test]
fn precopy_reads_are_bounded_and_send_nothing_when_nothing_changed() {
    const BIG: u64 = 64 << 20;
    let mut rng = Rng(31);
    let mut a = filled(small(), BIG);
    let full = a.gpu.stop_copy_size().expect("stop-copy size");
    assert!(
        (BIG..BIG + BIG / 100 + (1 << 20)).contains(&full),
        "before any stream, STOP_COPY would send all the data: {full}"
    );
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    let (initial, dirty) = info(&mut a.gpu);
    assert_eq!(dirty, 0);
    assert!(
        (BIG..=BIG / PAGE * PAGE_COST + 16).contains(&initial),
        "{initial}"
    );
    let mut stream = Vec::new();
    let first = read_until_empty(&mut a.gpu, &mut stream);
    assert!(
        first > BIG && first <= initial,
        "{first} of {initial} announced"
    );
    let sent = a.gpu.migration_stats().expect("stats").pages_sent;
    assert_eq!(sent, BIG / PAGE, "every page is data");
    // Without a write log the device cannot know what the guest changed until it looked:
    // after the first pass it reports no initial bytes, and as dirty what the last complete
    // later round found (none yet).
    assert_eq!(info(&mut a.gpu), (0, 0));

    // Nothing changed: a read visits at most SCAN_BUDGET pages and returns what it found,
    // nothing, instead of padding; the next read goes on where it stopped.
    const { assert!(BIG / PAGE > crate::mig::SCAN_BUDGET) };
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..BIG / PAGE / crate::mig::SCAN_BUDGET * 2 {
        assert_eq!(a.gpu.read(&mut buf).expect("read"), 0, "nothing to send");
    }
    let st = a.gpu.migration_stats().expect("stats");
    assert_eq!(st.pages_sent, sent, "nothing changed");
    assert!(
        st.rounds >= 2,
        "the reads went on through whole rounds: {st:?}"
    );
    assert!(st.budget_stops > 0);
    assert_eq!(info(&mut a.gpu), (0, 0), "an idle device: nothing pending");

    // A change is found by the round going on, then estimated for the next one.
    a.vram_file_write(3 * PAGE, b"a change");
    let mut found = 0;
    for _ in 0..BIG / PAGE / crate::mig::SCAN_BUDGET * 2 + 2 {
        let n = a.gpu.read(&mut buf).expect("read");
        stream.extend_from_slice(&buf[..n]);
        found += n;
    }
    assert_eq!(found as u64, PAGE_COST, "exactly the changed page");
    assert_eq!(info(&mut a.gpu), (0, PAGE_COST), "the last round's finding");

    // STOP_COPY has no budget; the stream loads bit-exact.
    a.vram_file_write(5 * PAGE, b"late change");
    a.gpu.step(MigArc::PreCopyToStopCopy).expect("stop copy");
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let mut b = Harness::with_config(SoftGpuConfig {
        vram_size: BIG,
        ..small()
    });
    resume_into(&mut b, &mut rng, &stream);
    assert!(a.vram_file_read(0, BIG as usize) == b.vram_file_read(0, BIG as usize));
}

/// With a write log the sizes are exact: an idle device is done after its first pass, and a
/// write makes exactly its pages pending.
#[test]
fn with_a_write_log_the_sizes_are_exact() {
    const BIG: u64 = 32 << 20;
    let mut rng = Rng(57);
    let mut a = filled(tracked(), BIG);
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    let (initial, dirty) = info(&mut a.gpu);
    assert!(
        (BIG..=BIG / PAGE * PAGE_COST + 16).contains(&initial),
        "{initial}"
    );
    assert_eq!(dirty, 0);
    let mut stream = Vec::new();
    read_until_empty(&mut a.gpu, &mut stream);
    assert_eq!(info(&mut a.gpu), (0, 0), "idle after the first pass");
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..4 {
        assert_eq!(a.gpu.read(&mut buf).expect("read"), 0, "nothing pending");
    }
    let sc = a.gpu.stop_copy_size().expect("stop-copy size");
    assert!(sc < 1 << 20, "stop-copy is the state and two records: {sc}");

    // Writes during pre-copy: exactly their pages are pending, then sent.
    trapped_write(&mut a, 7 * PAGE + 100, b"x");
    trapped_write(&mut a, 9 * PAGE, &page_of(9));
    trapped_write(&mut a, 10 * PAGE, &page_of(10));
    a.run(
        0,
        &[Command::fill(Operand::Vram(4000 * PAGE), PAGE, 0x0202_0202)],
    );
    assert_eq!(info(&mut a.gpu), (0, 4 * PAGE_COST));
    assert!(a.gpu.stop_copy_size().expect("size") >= sc + 4 * PAGE);
    let n = read_until_empty(&mut a.gpu, &mut stream);
    assert!(n > 4 * PAGE && n <= 4 * PAGE_COST, "{n}");
    assert_eq!(info(&mut a.gpu), (0, 0));

    a.gpu.step(MigArc::PreCopyToStopCopy).expect("stop copy");
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let mut b = Harness::with_config(SoftGpuConfig {
        vram_size: BIG,
        ..tracked()
    });
    resume_into(&mut b, &mut rng, &stream);
    assert!(a.vram_file_read(0, BIG as usize) == b.vram_file_read(0, BIG as usize));
}

/// With a write log, a switchover in the middle of the first round goes on from where that
/// round is (what it visited and was written since is in the log), instead of reading all of
/// VRAM again while the guest waits.
#[test]
fn a_stop_during_the_first_round_of_a_write_log_does_not_start_over() {
    const BIG: u64 = 32 << 20;
    let mut rng = Rng(59);
    let mut a = filled(tracked(), BIG);
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    let mut stream = Vec::new();
    let mut buf = vec![0u8; 1 << 20];
    for _ in 0..3 {
        let n = a.gpu.read(&mut buf).expect("read");
        assert_eq!(n, buf.len(), "the first round is far from done");
        stream.extend_from_slice(&buf);
    }
    let visited = a.gpu.migration_stats().expect("stats").pages_visited;
    trapped_write(&mut a, PAGE, &page_of(1)); // visited already
    trapped_write(&mut a, BIG - PAGE, &page_of(2)); // not yet
    a.gpu.step(MigArc::PreCopyToStopCopy).expect("stop copy");
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let st = a.gpu.migration_stats().expect("stats");
    assert_eq!(
        st.pages_sent,
        BIG / PAGE + 1,
        "every page once, page 1 twice"
    );
    assert!(
        st.pages_visited <= BIG / PAGE + 2,
        "the rest of the round and the two logged pages, not all of VRAM again: {} after {visited}",
        st.pages_visited
    );
    let mut b = Harness::with_config(SoftGpuConfig {
        vram_size: BIG,
        ..tracked()
    });
    resume_into(&mut b, &mut rng, &stream);
    assert!(a.vram_file_read(0, BIG as usize) == b.vram_file_read(0, BIG as usize));
}

/// A stream of an older source, with padding records, still loads.
#[test]
fn padding_records_of_an_older_source_are_skipped() {
    let mut rng = Rng(61);
    let mut a = Harness::with_config(small());
    a.init();
    let pages = scribble(&mut a, &mut rng, 3);
    a.gpu.step(MigArc::Stop).expect("stop");
    a.gpu.step(MigArc::StartStopCopy).expect("stop copy");
    let mut stream = Vec::new();
    read_round(&mut a.gpu, &mut rng, &mut stream);
    // After the begin record: a padding record of 100 bytes, as an older source sent them.
    let mut old = stream[..16].to_vec();
    old.extend_from_slice(&6u32.to_le_bytes());
    old.extend_from_slice(&100u32.to_le_bytes());
    old.extend_from_slice(&0u64.to_le_bytes());
    old.extend_from_slice(&[0xee; 100]);
    old.extend_from_slice(&stream[16..]);
    let mut b = Harness::with_config(small());
    resume_into(&mut b, &mut rng, &old);
    for p in pages {
        assert_eq!(
            a.vram_file_read(p * PAGE, PAGE as usize),
            b.vram_file_read(p * PAGE, PAGE as usize)
        );
    }
}

mod arbitrary_streams {
    use proptest::prelude::*;
    use proptest::test_runner::Config;

    use super::*;

    /// A valid stream of a device with a few written pages (built once).
    fn valid_stream() -> Vec<u8> {
        let mut rng = Rng(41);
        let mut a = Harness::with_config(small());
        a.init();
        scribble(&mut a, &mut rng, 6);
        a.gpu.step(MigArc::Stop).expect("stop");
        a.gpu.step(MigArc::StartStopCopy).expect("sc");
        let mut stream = Vec::new();
        read_round(&mut a.gpu, &mut rng, &mut stream);
        stream
    }

    proptest! {
        #![proptest_config(Config { cases: 32, ..Config::default() })]

        /// Whatever bytes a VMM writes while RESUMING (random, or a valid stream with bytes
        /// flipped, cut or spliced), the device answers with Ok or a clean error, never a
        /// panic or a write outside VRAM, and a refused stream leaves the old state.
        #[test]
        fn mutated_streams_are_refused_or_applied_never_a_panic(
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6),
            cut in any::<prop::sample::Index>(),
            garbage in proptest::collection::vec(any::<u8>(), 0..64),
            chunk in 1usize..5000,
        ) {
            let mut stream = valid_stream();
            for (at, byte) in flips {
                let i = at.index(stream.len());
                stream[i] ^= byte;
            }
            let keep = cut.index(stream.len() + 1);
            stream.truncate(keep);
            stream.extend_from_slice(&garbage);
            let mut b = Harness::with_config(small());
            b.init();
            b.wr32(SCRATCH, 0x77);
            b.gpu.step(MigArc::Stop).expect("stop");
            b.gpu.step(MigArc::StartResuming).expect("resuming");
            let mut failed = false;
            for part in stream.chunks(chunk) {
                if b.gpu.write(part).is_err() {
                    failed = true;
                    break;
                }
            }
            let loaded = b.gpu.step(MigArc::EndResuming);
            if failed {
                prop_assert!(
                    matches!(loaded, Err(DeviceError::BadState(_))),
                    "a refused stream cannot load: {:?}",
                    loaded
                );
            }
            if loaded.is_err() {
                prop_assert_eq!(b.rd32(SCRATCH), 0x77, "the old state stays");
            }
            b.gpu.abort();
            prop_assert_eq!(b.rd32(MAGIC), 0x5047_5953, "the device still serves");
        }
    }
}

/// The P2P states hold the engines as STOP does (a command submitted meanwhile waits; the
/// hold is the one every STOP test exercises) while the registers are served, and RUNNING
/// lets the command run; a P2P pre-copy streams like PRE_COPY.
#[test]
fn p2p_states_quiesce_the_engines_and_serve_the_registers() {
    let mut rng = Rng(67);
    let mut a = Harness::with_config(small());
    a.init();
    assert!(a.gpu.caps().p2p);
    a.gpu
        .step(MigArc::EnterP2p)
        .expect("RUNNING -> RUNNING_P2P");
    assert_ne!(a.rd32(DEV_STATUS) & DEV_STATUS_STOPPED, 0, "engines held");
    a.submit(1, &[Command::fence(Operand::Guest(DATA), 9, None)]);
    a.wr32(SCRATCH, 0x1234_5678);
    assert_eq!(a.rd32(SCRATCH), 0x1234_5678, "registers served");
    assert_eq!(a.qr(1, Q_STATUS), Q_STATUS_PAUSED, "the command waits");
    a.gpu
        .step(MigArc::StopFromP2p)
        .expect("RUNNING_P2P -> STOP");
    a.gpu
        .step(MigArc::P2pFromStop)
        .expect("STOP -> RUNNING_P2P");
    assert_eq!(a.qr(1, Q_STATUS), Q_STATUS_PAUSED, "still held");
    a.gpu
        .step(MigArc::LeaveP2p)
        .expect("RUNNING_P2P -> RUNNING");
    a.wait_idle(1);
    assert_eq!(a.guest_read(DATA, 8), 9u64.to_le_bytes());
    assert_eq!(a.rd32(DEV_STATUS) & DEV_STATUS_STOPPED, 0);

    // The source of a VM with two devices: PRE_COPY, PRE_COPY_P2P, STOP_COPY.
    let pages = scribble(&mut a, &mut rng, 5);
    a.gpu.step(MigArc::StartPreCopy).expect("pre-copy");
    let mut stream = Vec::new();
    read_round(&mut a.gpu, &mut rng, &mut stream);
    a.gpu
        .step(MigArc::EnterP2p)
        .expect("PRE_COPY -> PRE_COPY_P2P");
    assert_ne!(a.rd32(DEV_STATUS) & DEV_STATUS_STOPPED, 0);
    assert!(a.gpu.precopy_info().is_some(), "the stream goes on");
    a.gpu
        .step(MigArc::PreCopyP2pToStopCopy)
        .expect("PRE_COPY_P2P -> STOP_COPY");
    read_round(&mut a.gpu, &mut rng, &mut stream);
    let mut b = Harness::with_config(small());
    resume_into(&mut b, &mut rng, &stream);
    for p in pages {
        assert_eq!(
            a.vram_file_read(p * PAGE, PAGE as usize),
            b.vram_file_read(p * PAGE, PAGE as usize)
        );
    }
}
