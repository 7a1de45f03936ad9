//! The softgpu workload every client runs: identity, rings on two queues, every command kind
//! verified bit-for-bit, fences with MSI-X eventfds, a bad DMA address and recovery.

#![allow(dead_code)]

use std::time::Duration;

use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::regs::*;

use super::driver::*;

/// Every part of the workload, in order.
pub fn run_all<T: Transport>(d: &mut Driver<T>) {
    check_identity(d);
    copy_fill_compute(d);
    fences_interrupt(d);
    bad_dma_then_recover(d);
}

pub fn check_identity<T: Transport>(d: &mut Driver<T>) {
    assert_eq!(d.cfg16(0x00), 0x1234, "vendor");
    assert_eq!(d.cfg16(0x02), 0x5347, "device");
    assert_eq!(d.cfg32(0x08) >> 8, 0x030200, "class: 3D controller");
    assert_eq!(d.caps(), vec![0x01, 0x10, 0x11], "PM, PCI Express, MSI-X");
    assert_eq!(d.r32(MAGIC), u32::from_le_bytes(*b"SYGP"));
    assert_eq!(d.r32(NUM_QUEUES), 2);
    assert_eq!(d.r64(VRAM_SIZE_LO), 64 << 20);
    assert_eq!(d.r32(FEATURES), FEATURES_VALUE);
}

pub fn copy_fill_compute<T: Transport>(d: &mut Driver<T>) {
    d.setup_queue(0);
    d.setup_queue(1);

    // COPY guest -> VRAM -> guest, 1 MiB straddling the boundary between the two DMA windows.
    let len = 1u64 << 20;
    let src = WINDOW_SIZE - (len / 2);
    let pattern: Vec<u8> = (0..len as usize).map(|i| (i * 7 + i / 251) as u8).collect();
    d.mem.write(src, &pattern);
    let back = 20 << 20;
    d.run(
        0,
        &[
            Command::copy(guest(src), Operand::Vram(0x1000), len),
            Command::copy(Operand::Vram(0x1000), guest(back), len),
        ],
    );
    let mut out = vec![0u8; len as usize];
    d.mem.read(back, &mut out);
    assert!(out == pattern, "guest -> VRAM -> guest copy differs");
    let mut vram = vec![0u8; 4096];
    d.vram_read(0x1000 + 12345, &mut vram);
    assert_eq!(
        &vram[..],
        &pattern[12345..12345 + 4096],
        "VRAM seen through the BAR"
    );

    // FILL in VRAM and in guest memory.
    d.run(
        1,
        &[
            Command::fill(Operand::Vram(0x20_0000), 4096 + 3, 0xa1b2c3d4),
            Command::fill(guest(0x30_0000), 10, 0x01020304),
        ],
    );
    let mut f = vec![0u8; 4099];
    d.vram_read(0x20_0000, &mut f);
    assert!(
        f.chunks(4)
            .all(|c| c == &[0xd4, 0xc3, 0xb2, 0xa1][..c.len()]),
        "VRAM fill"
    );
    let mut g = [0u8; 12];
    d.mem.read(0x30_0000, &mut g);
    assert_eq!(
        g,
        [4, 3, 2, 1, 4, 3, 2, 1, 4, 3, 0, 0],
        "guest fill stops at the length"
    );

    // SAXPY on queue 0 and GEMM on queue 1 at the same time.
    let n = 4096;
    let (x, y) = (data(1, n), data(2, n));
    let a = 1.75f32;
    d.write_f32s(0x40_0000, &x);
    d.write_f32s(0x41_0000, &y);
    let (m, nn, k) = (64usize, 48usize, 32usize);
    let (ga, gb) = (data(3, m * k), data(4, k * nn));
    d.write_f32s(0x50_0000, &ga);
    d.write_f32s(0x51_0000, &gb);
    d.submit(
        0,
        &[Command::saxpy(
            n as u64,
            a,
            guest(0x40_0000),
            guest(0x41_0000),
        )],
    );
    d.submit(
        1,
        &[Command::gemm(
            m as u64,
            nn as u64,
            k as u64,
            guest(0x50_0000),
            guest(0x51_0000),
            guest(0x52_0000),
        )],
    );
    assert_eq!(d.wait_queue(0), Q_STATUS_IDLE);
    assert_eq!(d.wait_queue(1), Q_STATUS_IDLE);
    assert_eq!(
        bits(&d.read_f32s(0x41_0000, n)),
        bits(&saxpy_ref(a, &x, &y)),
        "SAXPY"
    );
    assert_eq!(
        bits(&d.read_f32s(0x52_0000, m * nn)),
        bits(&gemm_ref(m, nn, k, &ga, &gb)),
        "GEMM"
    );

    // GEMM with operands in VRAM, result copied back.
    d.run(
        1,
        &[
            Command::copy(
                guest(0x50_0000),
                Operand::Vram(0x100_0000),
                (m * k * 4) as u64,
            ),
            Command::copy(
                guest(0x51_0000),
                Operand::Vram(0x110_0000),
                (k * nn * 4) as u64,
            ),
            Command::gemm(
                m as u64,
                nn as u64,
                k as u64,
                Operand::Vram(0x100_0000),
                Operand::Vram(0x110_0000),
                Operand::Vram(0x120_0000),
            ),
            Command::copy(
                Operand::Vram(0x120_0000),
                guest(0x53_0000),
                (m * nn * 4) as u64,
            ),
        ],
    );
    assert_eq!(
        bits(&d.read_f32s(0x53_0000, m * nn)),
        bits(&gemm_ref(m, nn, k, &ga, &gb)),
        "VRAM GEMM"
    );

    // REDUCE.
    let r = data(5, 10_000);
    d.write_f32s(0x60_0000, &r);
    d.run(
        0,
        &[Command::reduce(
            r.len() as u64,
            guest(0x60_0000),
            guest(0x61_0000),
        )],
    );
    assert_eq!(
        d.read_f32s(0x61_0000, 1)[0].to_bits(),
        reduce_ref(&r).to_bits(),
        "REDUCE"
    );
}

pub fn fences_interrupt<T: Transport>(d: &mut Driver<T>) {
    d.setup_queue(0);
    d.setup_queue(1);
    let before = d.r64(FENCE_COUNT_LO);
    // Drain stale signals.
    for f in d.completion.iter().chain(d.error.iter()) {
        switchyard_device::irq::take_eventfd(f);
    }
    d.submit(
        0,
        &[
            Command::nop(),
            Command::fence(guest(0x70_0000), 0x1122_3344_5566_7788, Some(3)),
        ],
    );
    assert!(
        wait_eventfd(&d.completion[3], Duration::from_secs(30)).is_some(),
        "fence MSI-X vector 3"
    );
    assert_eq!(
        d.mem.read_u64(0x70_0000),
        0x1122_3344_5566_7788,
        "fence value in guest memory"
    );
    // A FENCE's interrupt goes to its own vector; other commands use the queue's completion
    // vector (power-on: vector q).
    d.submit(
        1,
        &[
            Command::fence(guest(0x70_0008), 7, None),
            Command::nop().with_irq(),
        ],
    );
    assert!(
        wait_eventfd(&d.completion[1], Duration::from_secs(30)).is_some(),
        "queue 1 completion vector"
    );
    assert_eq!(d.mem.read_u64(0x70_0008), 7);
    assert_eq!(d.r64(FENCE_COUNT_LO), before + 2);
    let st = d.r32(INT_STATUS);
    assert_ne!(
        st & (int_completion(0) | int_completion(1)),
        0,
        "INT_STATUS latched"
    );
    d.w32(INT_ACK, st);
    assert_eq!(d.r32(INT_STATUS) & st, 0, "INT_ACK clears");
}

pub fn bad_dma_then_recover<T: Transport>(d: &mut Driver<T>) {
    d.setup_queue(0);
    for f in d.error.iter() {
        switchyard_device::irq::take_eventfd(f);
    }
    // Guard bytes around where a wild write would land if the address were truncated.
    d.mem.write(0x80_0000, &[0x5a; 64]);
    let bad = 0x7_0000_0000u64;
    d.submit(
        0,
        &[Command::copy(guest(0x80_0000), Operand::Guest(bad), 64)],
    );
    assert_eq!(d.wait_queue(0), Q_STATUS_ERROR);
    assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_DMA_UNMAPPED);
    assert_eq!(d.r64(queue_reg(0, Q_ERROR_ADDR_LO)), bad);
    assert_ne!(d.r32(INT_STATUS) & int_error(0), 0);
    assert!(
        wait_eventfd(&d.error[0], Duration::from_secs(30)).is_some(),
        "error MSI-X vector 8"
    );
    // Recover: ack, skip the bad command, and the queue works again.
    d.w32(INT_ACK, int_error(0));
    d.w32(
        queue_reg(0, Q_CONTROL),
        Q_CONTROL_RECOVER | Q_CONTROL_ENABLE,
    );
    d.run(0, &[Command::fill(guest(0x81_0000), 8, 0xfeedface)]);
    assert_eq!(d.mem.read_u64(0x81_0000), 0xfeedface_feedface);
}

/// One round of idempotent work on `q`: FILL 8 KiB of VRAM with a pattern of `round` and `q`,
/// COPY it to guest memory, check the bytes (slots cycle through 64 × 8 KiB).
pub fn fill_copy_round<T: Transport>(d: &mut Driver<T>, round: u64, q: u32) {
    let off = ((round * 2 + u64::from(q)) % 64) * 8192;
    let fill = (round as u32).wrapping_mul(0x0101_0101) ^ q;
    d.run(
        q,
        &[
            Command::fill(Operand::Vram(0x10_0000 + off), 8192, fill),
            Command::copy(Operand::Vram(0x10_0000 + off), guest(0x40_0000 + off), 8192),
        ],
    );
    let mut got = vec![0u8; 8192];
    d.mem.read(0x40_0000 + off, &mut got);
    let want: Vec<u8> = std::iter::repeat_n(fill.to_le_bytes(), 2048)
        .flatten()
        .collect();
    assert!(got == want, "round {round} queue {q}: result differs");
}

/// One FILL (of VRAM at `off`, with `fill`) + COPY (to guest memory) on queue 0 submitted
/// through the doorbell page, the result checked; returns whether the submission kicked.
pub fn mapped_fill_copy_round<T: Transport>(
    d: &mut Driver<T>,
    page: &DoorbellPage,
    off: u64,
    fill: u32,
    what: &str,
) -> bool {
    let cmds = [
        Command::fill(Operand::Vram(off), 4096, fill),
        Command::copy(Operand::Vram(off), guest(0x40_0000 + off), 4096),
    ];
    let kicked = d.submit_mapped(page, 0, &cmds);
    assert_eq!(d.wait_queue(0), Q_STATUS_IDLE, "{what}");
    let mut got = vec![0u8; 4096];
    d.mem.read(0x40_0000 + off, &mut got);
    assert!(
        got.chunks_exact(4).all(|c| c == fill.to_le_bytes()),
        "{what}: result differs"
    );
    kicked
}

/// In-place SAXPY counters on queue 0: y += x over `n` floats, x all ones, so every element
/// of y counts the commands that completed. A command cut by a restart or a failover must run
/// exactly once or stop its queue with ERR_INTERRUPTED, never run twice silently.
pub struct SaxpyCounters {
    n: usize,
    x: u64,
    y: u64,
    /// Commands submitted.
    pub submitted: u32,
    /// Of those, the ones that stopped the queue with ERR_INTERRUPTED.
    pub interrupted: u32,
}

impl SaxpyCounters {
    /// x (all ones) at guest offset `x`, y (zeros) at `y`; queue 0 must be set up.
    pub fn new<T: Transport>(d: &mut Driver<T>, n: usize, x: u64, y: u64) -> Self {
        let ones: Vec<u8> = std::iter::repeat_n(1.0f32.to_le_bytes(), n)
            .flatten()
            .collect();
        d.mem.write(x, &ones);
        d.mem.write(y, &vec![0u8; n * 4]);
        Self {
            n,
            x,
            y,
            submitted: 0,
            interrupted: 0,
        }
    }

    /// Submits `count` SAXPYs.
    pub fn submit<T: Transport>(&mut self, d: &mut Driver<T>, count: usize) {
        let saxpy = Command::saxpy(self.n as u64, 1.0, guest(self.x), guest(self.y));
        d.submit(0, &vec![saxpy; count]);
        self.submitted += count as u32;
    }

    /// Waits for queue 0; each ERR_INTERRUPTED is handled as a driver would: the
    /// interrupted command's output is undefined, so y is put back to what the commands
    /// before it made it, and the queue skips it (RECOVER | ENABLE).
    pub fn settle<T: Transport>(&mut self, d: &mut Driver<T>, what: &str) {
        loop {
            if d.wait_queue(0) != Q_STATUS_ERROR {
                return;
            }
            let head = d.r32(queue_reg(0, Q_HEAD));
            assert_eq!(d.r32(queue_reg(0, Q_ERROR_CODE)), ERR_INTERRUPTED, "{what}");
            assert_eq!(d.r32(queue_reg(0, Q_ERROR_INDEX)), head, "{what}");
            let done = (head - self.interrupted) as f32;
            let y: Vec<u8> = std::iter::repeat_n(done.to_le_bytes(), self.n)
                .flatten()
                .collect();
            d.mem.write(self.y, &y);
            self.interrupted += 1;
            d.w32(
                queue_reg(0, Q_CONTROL),
                Q_CONTROL_RECOVER | Q_CONTROL_ENABLE,
            );
        }
    }

    /// Every command ran, and each element of y counts the completed ones exactly once.
    pub fn check<T: Transport>(&self, d: &mut Driver<T>) {
        assert_eq!(d.r32(queue_reg(0, Q_HEAD)), self.submitted);
        let y = d.read_f32s(self.y, self.n);
        let want = (self.submitted - self.interrupted) as f32;
        let wrong = y.iter().filter(|v| **v != want).count();
        assert_eq!(
            wrong, 0,
            "every element counts each completed command once ({} submitted, {} interrupted; y[0] = {})",
            self.submitted, self.interrupted, y[0]
        );
    }
}
