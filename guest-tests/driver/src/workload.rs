//! The workload a GPU runtime would run, step by step, every result checked bit-for-bit against
//! the in-driver reference.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use crate::cmd::{Addr, Cmd};
use crate::gpu::{Completion, Gpu, RING_ENTRIES};
use crate::irq::{Delivery, Event};
use crate::reference as r;
use crate::regs::*;
use crate::say;

/// Problem sizes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sizes {
    /// `"full"` or `"quick"`.
    pub mode: &'static str,
    /// Bytes of the host → VRAM → host copy (split across all queues).
    pub copy_bytes: u64,
    /// Bytes per FILL.
    pub fill_bytes: u64,
    /// SAXPY / REDUCE elements.
    pub saxpy_n: usize,
    /// The big GEMM (M, N, K), guest operands.
    pub gemm: (usize, usize, usize),
    /// The GEMM with VRAM operands (M, N, K).
    pub gemm_vram: (usize, usize, usize),
    /// Bytes written/read through the VRAM mapping.
    pub vram_mmap_bytes: u64,
    /// DMA window size and count.
    pub dma_window: u64,
    /// DMA windows.
    pub dma_windows: usize,
}

impl Sizes {
    /// The full run.
    pub fn full() -> Sizes {
        Sizes {
            mode: "full",
            copy_bytes: 8 << 20,
            fill_bytes: (1 << 20) + 3,
            saxpy_n: 1 << 20,
            gemm: (256, 256, 256),
            gemm_vram: (96, 80, 72),
            vram_mmap_bytes: 1 << 20,
            dma_window: 12 << 20,
            dma_windows: 2,
        }
    }

    /// [`Sizes::quick`] or [`Sizes::full`].
    pub fn choose(quick: bool) -> Sizes {
        if quick { Sizes::quick() } else { Sizes::full() }
    }

    /// Smaller sizes for slow TCG guests.
    pub fn quick() -> Sizes {
        Sizes {
            mode: "quick",
            copy_bytes: 1 << 20,
            fill_bytes: (64 << 10) + 3,
            saxpy_n: 1 << 16,
            gemm: (64, 64, 64),
            gemm_vram: (24, 20, 16),
            vram_mmap_bytes: 256 << 10,
            dma_window: 4 << 20,
            dma_windows: 2,
        }
    }

    /// Shrinks every DMA buffer to fit `run` bytes, the largest physically contiguous DMA
    /// range without an IOMMU (one run of adjacent hugepages): halves the COPY, FILL, SAXPY
    /// and VRAM-mapping lengths and the GEMM dimensions until each buffer fits. Returns whether
    /// anything changed.
    pub fn fit_dma(&mut self, run: u64) -> bool {
        let before = self.clone();
        let pad = 64;
        while self.copy_bytes > 4096 && self.copy_bytes + pad > run {
            self.copy_bytes /= 2;
        }
        while self.fill_bytes > 4096 && self.fill_bytes + pad > run {
            self.fill_bytes = (self.fill_bytes - 3) / 2 + 3;
        }
        while self.saxpy_n > 1024 && 4 * self.saxpy_n as u64 > run {
            self.saxpy_n /= 2;
        }
        let gemm_max = |(m, n, k): (usize, usize, usize)| 4 * (m * k).max(k * n).max(m * n) as u64;
        while self.gemm.0 > 8 && gemm_max(self.gemm) > run {
            self.gemm = (self.gemm.0 / 2, self.gemm.1 / 2, self.gemm.2 / 2);
        }
        while self.vram_mmap_bytes > 4096 && self.vram_mmap_bytes + pad > run {
            self.vram_mmap_bytes /= 2;
        }
        *self != before
    }

    /// Shrinks the VRAM-resident parts to fit `vram` bytes of VRAM.
    pub fn fit_vram(&mut self, vram: u64) {
        self.copy_bytes = self.copy_bytes.min(vram / 4);
        self.fill_bytes = self.fill_bytes.min(vram / 16 - 64);
        self.vram_mmap_bytes = self.vram_mmap_bytes.min(vram / 32);
    }
}

/// Where each step puts its data in VRAM (fractions of the VRAM size).
#[derive(Debug, Clone, Copy)]
struct VramLayout {
    copy: u64,
    fill: u64,
    gemm: u64,
    mmap: u64,
}

impl VramLayout {
    fn new(vram: u64) -> VramLayout {
        VramLayout {
            copy: vram / 16,
            fill: vram * 3 / 8,
            gemm: vram / 2,
            mmap: vram * 5 / 8,
        }
    }
}

/// One step's outcome.
#[derive(Debug, Clone)]
pub struct StepRecord {
    /// Step name.
    pub name: &'static str,
    /// Passed.
    pub ok: bool,
    /// Wall time.
    pub ms: u64,
}

/// What the workload established.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Steps in order (stops at the first failure).
    pub steps: Vec<StepRecord>,
    /// The bad-DMA test passed (error, code, address, interrupt, recovery, rerun).
    pub error_test_ok: bool,
    /// CPU accesses through the VRAM mapping matched the engines' view.
    pub vram_mmap_ok: bool,
    /// First failure.
    pub failure: Option<String>,
}

impl Outcome {
    /// The steps as the summary lists them.
    pub fn summary_steps(&self) -> Vec<crate::summary::Step> {
        self.steps
            .iter()
            .map(|s| crate::summary::Step {
                name: s.name.to_string(),
                ok: s.ok,
                ms: s.ms,
            })
            .collect()
    }
}

pub(crate) fn check_bytes(what: &str, got: &[u8], want: &[u8]) -> Result<(), String> {
    match r::first_byte_mismatch(got, want) {
        None => Ok(()),
        Some(i) => Err(format!(
            "{what}: byte {i} of {} differs (got {:#04x?}, want {:#04x?})",
            want.len(),
            got.get(i),
            want.get(i)
        )),
    }
}

pub(crate) fn check_f32(what: &str, got: &[f32], want: &[f32]) -> Result<(), String> {
    match r::first_f32_mismatch(got, want) {
        None => Ok(()),
        Some((i, g, w)) => Err(format!(
            "{what}: element {i} of {} differs: got {g:e} ({:#010x}), want {w:e} ({:#010x})",
            want.len(),
            g.to_bits(),
            w.to_bits()
        )),
    }
}

fn ensure(cond: bool, msg: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(msg()) }
}

fn read_f32(g: &Gpu, iova: u64, n: usize) -> Result<Vec<f32>, String> {
    Ok(r::f32_from_bytes(&g.dma().read_vec(iova, 4 * n)?))
}

pub(crate) fn mib(b: u64) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 {
        format!("{:.1} KiB", b as f64 / 1024.0)
    } else {
        format!("{b} B")
    }
}

/// Registers: identity, limits, scratch, device status.
fn step_identity(g: &mut Gpu, s: &Sizes) -> Result<String, String> {
    let b = &g.bar0;
    let checks: [(&str, u64, u64); 5] = [
        ("MAGIC", b.r32(MAGIC).into(), MAGIC_VALUE.into()),
        ("VERSION", b.r32(VERSION).into(), VERSION_VALUE.into()),
        ("FEATURES", b.r32(FEATURES).into(), FEATURES_VALUE.into()),
        (
            "MSIX_VECTOR_COUNT",
            b.r32(MSIX_VECTOR_COUNT).into(),
            g.irqs.mode().msix_vector_count().into(),
        ),
        ("RING_ENTRY_SIZE", b.r32(RING_ENTRY_SIZE).into(), 64),
    ];
    for (name, got, want) in checks {
        ensure(got == want, || {
            format!("{name} reads {got:#x}, expected {want:#x}")
        })?;
    }
    let (m, n, k) = s.gemm;
    let limits: [(&str, u64, u64); 5] = [
        (
            "MAX_RING_ENTRIES",
            b.r32(MAX_RING_ENTRIES).into(),
            RING_ENTRIES.into(),
        ),
        (
            "MAX_XFER_BYTES",
            b.r32(MAX_XFER_BYTES).into(),
            s.copy_bytes.max(s.fill_bytes),
        ),
        ("MAX_ELEMENTS", b.r32(MAX_ELEMENTS).into(), s.saxpy_n as u64),
        (
            "MAX_GEMM_DIM",
            b.r32(MAX_GEMM_DIM).into(),
            m.max(n).max(k) as u64,
        ),
        ("MAX_GEMM_WORK", b.r64(MAX_GEMM_WORK), (m * n * k) as u64),
    ];
    for (name, got, need) in limits {
        ensure(got >= need, || {
            format!("{name} is {got}, the workload needs {need}")
        })?;
    }
    for v in [0xa5a5_5a5a_u32, 0x0123_4567, 0xffff_ffff, 0] {
        b.w32(SCRATCH, v);
        let got = b.r32(SCRATCH);
        ensure(got == v, || {
            format!("SCRATCH reads {got:#x} after writing {v:#x}")
        })?;
    }
    let ds = b.r32(DEV_STATUS);
    ensure(
        ds & DEV_STATUS_BUS_MASTER != 0 && ds & DEV_STATUS_ERROR == 0,
        || format!("DEV_STATUS {ds:#x}: want bus master on, no error"),
    )?;
    let fc = b.r64(FENCE_COUNT);
    ensure(fc == 0, || format!("FENCE_COUNT {fc} after reset"))?;
    Ok(format!(
        "MAGIC SYGP, VERSION {:#010x}, FEATURES {:#04x}, {} queue(s), VRAM {}, MSIX_VECTOR_COUNT {} ({} mode), limits ok, SCRATCH ok, DEV_STATUS {ds:#x}",
        b.r32(VERSION),
        b.r32(FEATURES),
        g.nq,
        mib(g.vram_size),
        b.r32(MSIX_VECTOR_COUNT),
        g.irqs.mode().label()
    ))
}

/// One FENCE per vector number 0–15, each waited for by its interrupt; then interrupt ordering:
/// when the interrupt of a NOP arrives, the FENCE (without interrupt) before it has landed.
///
/// MSI-X: every vector must deliver its FENCE, and the NOP's interrupt goes through a re-routed
/// `COMPLETION_VECTOR`. MSI: there is one vector, so each FENCE arrives as its queue's
/// completion bit on it; per-vector delivery and re-routing are MSI-X only and skipped.
/// Polled (no interrupts): as MSI, with `INT_STATUS` read by the waiter.
fn step_vectors(g: &mut Gpu, _s: &Sizes) -> Result<String, String> {
    let mode = g.irqs.delivery();
    match mode {
        Delivery::Msix => {}
        Delivery::Msi => say!(
            "step vectors: MSI mode: per-vector routing (\"all {MSIX_VECTORS} vectors delivered\") and completion-vector re-routing are MSI-X only, skipped; FENCE vectors 0..{} are checked to arrive on the MSI vector as their queue's completion",
            MSIX_VECTORS - 1
        ),
        Delivery::Polled => say!(
            "step vectors: polled (no interrupts without VFIO): per-vector routing and completion-vector re-routing skipped; FENCEs with vectors 0..{} are checked to latch their queue's INT_STATUS completion bit, seen by polling",
            MSIX_VECTORS - 1
        ),
    }
    for v in 0..MSIX_VECTORS {
        let q = v % g.nq;
        let on = g.irqs.vector_of(Event::Completion {
            queue: q,
            vector: v,
        }) as usize;
        let before = g.irqs.counts()[on];
        let seq = g.submit_fence(q, v)?;
        match g.wait_fence_on(q, seq, v)? {
            Completion::Fence => {}
            Completion::Fault(f) => return Err(f.to_string()),
        }
        ensure(g.irqs.counts()[on] > before, || {
            format!(
                "FENCE with vector {v} on queue {q}: no interrupt counted on {} vector {on}",
                mode.label()
            )
        })?;
    }
    // A FENCE without interrupt followed by a NOP with one: when the NOP's interrupt arrives,
    // the fence must already be visible. MSI-X: through a re-routed completion vector.
    let q = g.nq - 1;
    let routed = match mode {
        Delivery::Msix => (q + 1) % 8,
        Delivery::Msi | Delivery::Polled => q,
    };
    if routed != q {
        g.qw32(q, Q_COMPLETION_VECTOR, routed);
    }
    let seq = g.submit_fence_silent(q)?;
    g.submit(q, &[Cmd::nop().with_irq()])?;
    let deadline = Instant::now() + g.timeout;
    let nop = Event::Completion {
        queue: q,
        vector: routed,
    };
    g.wait_event(&[nop], deadline).map_err(|e| match mode {
        Delivery::Msix => format!("re-routed completion vector {routed} of queue {q}: {e}"),
        Delivery::Msi => format!("NOP completion of queue {q} on the MSI vector: {e}"),
        Delivery::Polled => format!("NOP completion of queue {q} in polled INT_STATUS: {e}"),
    })?;
    let v = g.dma().read_u64(g.fence_slot(q))?;
    ensure(v >= seq, || {
        format!("NOP interrupt arrived before the earlier FENCE landed ({v} < {seq})")
    })?;
    g.qw32(q, Q_COMPLETION_VECTOR, q);
    g.fence_landed(q, seq)?;
    for q in 0..g.nq {
        ensure(g.stats.int_status_seen & int_completion(q) != 0, || {
            format!("INT_STATUS never showed queue {q}'s completion bit")
        })?;
    }
    match mode {
        Delivery::Msix => {
            let silent: Vec<usize> = (0..MSIX_VECTORS as usize)
                .filter(|&v| g.irqs.counts()[v] == 0)
                .collect();
            ensure(silent.is_empty(), || {
                format!("vectors {silent:?} never fired")
            })?;
            Ok(format!(
                "all {MSIX_VECTORS} vectors delivered; queue {q} completion re-routed to vector {routed}"
            ))
        }
        Delivery::Msi => Ok(format!(
            "MSI: {MSIX_VECTORS} FENCEs (vectors 0..{}) each arrived as their queue's INT_STATUS completion bit on the MSI vector ({} signal(s)); NOP interrupt on queue {q} came after the earlier FENCE landed; per-vector routing and re-routing skipped (MSI-X only)",
            MSIX_VECTORS - 1,
            g.irqs.counts()[0]
        )),
        Delivery::Polled => Ok(format!(
            "polled: {MSIX_VECTORS} FENCEs (vectors 0..{}) each latched their queue's INT_STATUS completion bit ({} INT_STATUS reads, {} with bits); NOP completion on queue {q} came after the earlier FENCE landed; per-vector routing and re-routing skipped (no interrupts)",
            MSIX_VECTORS - 1,
            g.irqs.status_polls(),
            g.irqs.counts()[0]
        )),
    }
}

/// COPY host → VRAM → host, one slice per queue, all queues at once; the CPU then reads a
/// slice of VRAM through the BAR mapping.
fn step_copy(g: &mut Gpu, s: &Sizes, vl: VramLayout, vram_ok: &mut bool) -> Result<String, String> {
    let len = s.copy_bytes;
    let src = g.dma_alloc(len + 64, 4096)? + 3;
    let dst = g.dma_alloc(len + 64, 4096)? + 1;
    let pattern = r::byte_data(0xc0b1, len as usize);
    g.dma().write(src, &pattern)?;
    g.dma().write(dst, &vec![0xee; len as usize])?;
    let vbase = vl.copy + 5;
    let nq = u64::from(g.nq);
    let chunk = (len / nq) & !3;
    let t = Instant::now();
    let mut seqs = Vec::new();
    for q in 0..g.nq {
        let off = u64::from(q) * chunk;
        let n = if u64::from(q) + 1 == nq {
            len - off
        } else {
            chunk
        };
        let seq = g.submit_batch(
            q,
            &[
                Cmd::copy(Addr::Iova(src + off), Addr::Vram(vbase + off), n),
                Cmd::copy(Addr::Vram(vbase + off), Addr::Iova(dst + off), n),
            ],
        )?;
        seqs.push((q, seq));
    }
    for (q, seq) in seqs {
        g.wait_fence(q, seq)?;
    }
    let dev_ms = t.elapsed().as_millis();
    let got = g.dma().read_vec(dst, len as usize)?;
    check_bytes("host->VRAM->host copy", &got, &pattern)?;
    g.stats.jobs_verified += 2 * nq;
    // The CPU sees the engines' VRAM writes through the BAR mapping.
    // The last MiB (minus one byte, so the start is unaligned).
    let win = len.min(1 << 20) - 1;
    let woff = len - win;
    let mut seen = vec![0u8; win as usize];
    g.vram
        .read(vbase + woff, &mut seen)
        .map_err(|e| e.to_string())?;
    check_bytes(
        "VRAM read through the BAR2 mapping after COPY",
        &seen,
        &pattern[woff as usize..(woff + win) as usize],
    )?;
    *vram_ok = true;
    Ok(format!(
        "{} host->VRAM->host over {} queue(s) in {dev_ms} ms ({:.0} MiB/s); {} of it read back through the BAR2 mapping",
        mib(len),
        g.nq,
        (2 * len) as f64 / (1 << 20) as f64 / (dev_ms.max(1) as f64 / 1000.0),
        mib(win)
    ))
}

/// FILL in guest memory (odd length, guard bytes after it) and in VRAM (copied back).
fn step_fill(g: &mut Gpu, s: &Sizes, vl: VramLayout) -> Result<String, String> {
    let q = g.nq - 1;
    let len = s.fill_bytes;
    let dst = g.dma_alloc(len + 64, 4096)? + 1;
    let out = g.dma_alloc(len + 64, 4096)? + 2;
    g.dma().write(dst, &vec![0xee; len as usize + 16])?;
    let vdst = vl.fill + 3;
    let (p1, p2) = (0xa1b2_c3d4, 0x0102_0304);
    g.run(
        q,
        &[
            Cmd::fill(Addr::Iova(dst), len, p1),
            Cmd::fill(Addr::Vram(vdst), len, p2),
            Cmd::copy(Addr::Vram(vdst), Addr::Iova(out), len),
        ],
    )?;
    let got = g.dma().read_vec(dst, len as usize + 16)?;
    check_bytes(
        "guest FILL",
        &got[..len as usize],
        &r::fill(len as usize, p1),
    )?;
    check_bytes(
        "bytes after the guest FILL",
        &got[len as usize..],
        &[0xee; 16],
    )?;
    let got = g.dma().read_vec(out, len as usize)?;
    check_bytes("VRAM FILL (copied back)", &got, &r::fill(len as usize, p2))?;
    g.stats.jobs_verified += 3;
    Ok(format!(
        "{} FILL in guest memory and in VRAM on queue {q}",
        mib(len)
    ))
}

/// SAXPY + REDUCE (+ a GEMM with VRAM operands) on queue 0 while the big GEMM runs on queue 1
/// (and extra REDUCEs on the other queues); the references are computed while the device works.
fn step_compute(g: &mut Gpu, s: &Sizes, vl: VramLayout) -> Result<String, String> {
    let n = s.saxpy_n;
    let a = 1.752_93_f32;
    let x = r::f32_data(0x5a, n);
    let y = r::f32_data(0x5b, n);
    let xa = g.dma_alloc(4 * n as u64, 4096)?;
    let ya = g.dma_alloc(4 * n as u64, 4096)?;
    let outs = g.dma_alloc(64, 64)?;
    g.dma().write(xa, &r::f32_bytes(&x))?;
    g.dma().write(ya, &r::f32_bytes(&y))?;
    g.dma().write(outs, &[0xff; 64])?;

    let (m, nn, k) = s.gemm;
    let ga = r::f32_data(0x61, m * k);
    let gb = r::f32_data(0x62, k * nn);
    let aa = g.dma_alloc(4 * (m * k) as u64, 4096)?;
    let ba = g.dma_alloc(4 * (k * nn) as u64, 4096)?;
    let ca = g.dma_alloc(4 * (m * nn) as u64, 4096)?;
    g.dma().write(aa, &r::f32_bytes(&ga))?;
    g.dma().write(ba, &r::f32_bytes(&gb))?;
    g.dma().write(ca, &vec![0xff; 4 * m * nn])?;

    let (m2, n2, k2) = s.gemm_vram;
    let va = r::f32_data(0x71, m2 * k2);
    let vb = r::f32_data(0x72, k2 * n2);
    let a2 = g.dma_alloc(4 * (m2 * k2) as u64, 64)?;
    let b2 = g.dma_alloc(4 * (k2 * n2) as u64, 64)?;
    let c2 = g.dma_alloc(4 * (m2 * n2) as u64, 64)?;
    g.dma().write(a2, &r::f32_bytes(&va))?;
    g.dma().write(b2, &r::f32_bytes(&vb))?;
    g.dma().write(c2, &vec![0xff; 4 * m2 * n2])?;
    let (vra, vrb) = (vl.gemm, vl.gemm + 4 * (m2 * k2) as u64 + 64);
    let vrc = vrb + 4 * (k2 * n2) as u64 + 128;

    let t = Instant::now();
    let qg = if g.nq > 1 { 1 } else { 0 };
    let mut waits = Vec::new();
    let gemm = Cmd::gemm(
        Addr::Iova(aa),
        Addr::Iova(ba),
        Addr::Iova(ca),
        m as u64,
        nn as u64,
        k as u64,
    );
    waits.push((qg, g.submit_batch(qg, &[gemm])?));
    let q0 = [
        Cmd::saxpy(Addr::Iova(xa), Addr::Iova(ya), n as u64, a),
        Cmd::reduce(Addr::Iova(ya), Addr::Iova(outs), n as u64),
        Cmd::copy(Addr::Iova(a2), Addr::Vram(vra), 4 * (m2 * k2) as u64),
        Cmd::copy(Addr::Iova(b2), Addr::Vram(vrb), 4 * (k2 * n2) as u64),
        Cmd::gemm(
            Addr::Vram(vra),
            Addr::Vram(vrb),
            Addr::Vram(vrc),
            m2 as u64,
            n2 as u64,
            k2 as u64,
        ),
        Cmd::copy(Addr::Vram(vrc), Addr::Iova(c2), 4 * (m2 * n2) as u64),
    ];
    waits.push((0, g.submit_batch(0, &q0)?));
    // Extra queues: REDUCE over overlapping slices of x, all at the same time.
    let mut extra = Vec::new();
    for q in 2..g.nq {
        let start = q as usize * 7;
        let cnt = n / 2 + q as usize;
        let out = outs + 8 * u64::from(q);
        waits.push((
            q,
            g.submit_batch(
                q,
                &[Cmd::reduce(
                    Addr::Iova(xa + 4 * start as u64),
                    Addr::Iova(out),
                    cnt as u64,
                )],
            )?,
        ));
        extra.push((q, start, cnt, out));
    }
    let submit_ms = t.elapsed().as_millis();

    // Reference results on the CPU while the engines run.
    let tr = Instant::now();
    let y_ref = r::saxpy(a, &x, &y);
    let sum_ref = r::reduce(&y_ref);
    let gemm_ref = r::gemm(m, nn, k, &ga, &gb);
    let gemm2_ref = r::gemm(m2, n2, k2, &va, &vb);
    let ref_ms = tr.elapsed().as_millis();

    for (q, seq) in waits {
        g.wait_fence(q, seq)?;
    }
    let dev_ms = t.elapsed().as_millis();
    check_f32("SAXPY", &read_f32(g, ya, n)?, &y_ref)?;
    check_f32(
        "REDUCE of the SAXPY result",
        &read_f32(g, outs, 1)?,
        &[sum_ref],
    )?;
    check_f32(
        &format!("GEMM {m}x{nn}x{k}"),
        &read_f32(g, ca, m * nn)?,
        &gemm_ref,
    )?;
    check_f32(
        &format!("GEMM {m2}x{n2}x{k2} with VRAM operands"),
        &read_f32(g, c2, m2 * n2)?,
        &gemm2_ref,
    )?;
    g.stats.jobs_verified += 1 + 1 + 1 + 4;
    for (q, start, cnt, out) in extra {
        let want = r::reduce(&x[start..start + cnt]);
        check_f32(
            &format!("REDUCE on queue {q}"),
            &read_f32(g, out, 1)?,
            &[want],
        )?;
        g.stats.jobs_verified += 1;
    }
    Ok(format!(
        "SAXPY n={n} + REDUCE + VRAM GEMM {m2}x{n2}x{k2} on q0 || GEMM {m}x{nn}x{k} on q{qg}{}: device {dev_ms} ms (submit {submit_ms} ms), CPU reference {ref_ms} ms, all bit-exact",
        if g.nq > 2 {
            format!(" || REDUCE on q2..q{}", g.nq - 1)
        } else {
            String::new()
        }
    ))
}

/// CPU writes through the VRAM mapping are what the engines read, and engine writes to VRAM
/// are what the CPU reads.
fn step_vram_mmap(g: &mut Gpu, s: &Sizes, vl: VramLayout) -> Result<String, String> {
    let len = s.vram_mmap_bytes;
    let v1 = vl.mmap + 7;
    let pattern = r::byte_data(0x77aa, len as usize);
    g.vram.write(v1, &pattern).map_err(|e| e.to_string())?;
    fence(Ordering::SeqCst);
    let buf = g.dma_alloc(len + 64, 4096)? + 5;
    g.run(0, &[Cmd::copy(Addr::Vram(v1), Addr::Iova(buf), len)])?;
    check_bytes(
        "engine COPY of bytes the CPU wrote through the BAR2 mapping",
        &g.dma().read_vec(buf, len as usize)?,
        &pattern,
    )?;
    g.stats.jobs_verified += 1;

    let v2 = v1 + len + 4096 + 1;
    let l2 = len / 2 + 3;
    let guard = [0x5a_u8; 16];
    g.vram.write(v2 - 16, &guard).map_err(|e| e.to_string())?;
    g.vram.write(v2 + l2, &guard).map_err(|e| e.to_string())?;
    fence(Ordering::SeqCst);
    let q = g.nq - 1;
    let pat = 0xc0ff_ee11;
    g.run(q, &[Cmd::fill(Addr::Vram(v2), l2, pat)])?;
    let mut seen = vec![0u8; l2 as usize + 32];
    g.vram.read(v2 - 16, &mut seen).map_err(|e| e.to_string())?;
    check_bytes("guard before the VRAM FILL (CPU view)", &seen[..16], &guard)?;
    check_bytes(
        "engine FILL in VRAM read by the CPU through the BAR2 mapping",
        &seen[16..16 + l2 as usize],
        &r::fill(l2 as usize, pat),
    )?;
    check_bytes(
        "guard after the VRAM FILL (CPU view)",
        &seen[16 + l2 as usize..],
        &guard,
    )?;
    g.stats.jobs_verified += 1;
    Ok(format!(
        "CPU wrote {} at VRAM+{v1:#x} -> engine COPY matched; engine FILL {} at VRAM+{v2:#x} -> CPU read matched, guards intact",
        mib(len),
        mib(l2)
    ))
}

/// Submits one bad command (plus a FENCE behind it), checks the error the device reports and
/// its interrupt, recovers the queue and lets the FENCE run.
fn provoke(g: &mut Gpu, q: u32, bad: Cmd, want_addr: u64) -> Result<String, String> {
    g.stats.int_status_seen = 0;
    let err_vec = g.irqs.vector_of(Event::Error {
        queue: q,
        vector: 8 + q,
    });
    let before = g.irqs.counts()[err_vec as usize];
    let index = g.submit(q, &[bad])?;
    let seq = g.submit_fence(q, q)?;
    let f = match g.wait_fence_on(q, seq, q)? {
        Completion::Fault(f) => f,
        Completion::Fence => return Err("the bad command completed without an error".into()),
    };
    let ds = g.bar0.r32(DEV_STATUS);
    ensure(f.status == Q_STATUS_ERROR, || {
        format!("STATUS {} ({f})", status_name(f.status))
    })?;
    ensure(f.code == ERR_DMA_UNMAPPED, || {
        format!("want DMA_UNMAPPED: {f}")
    })?;
    ensure(f.addr == want_addr, || {
        format!("want ERROR_ADDR {want_addr:#x}: {f}")
    })?;
    ensure(f.index == index, || {
        format!("want ERROR_INDEX {index}: {f}")
    })?;
    ensure(f.opcode == u32::from(bad.opcode), || {
        format!("want ERROR_OPCODE {:#x}: {f}", bad.opcode)
    })?;
    ensure(
        f.vector == err_vec && g.irqs.counts()[err_vec as usize] > before,
        || {
            format!(
                "error interrupt not seen on {} vector {err_vec}",
                g.irqs.delivery().label()
            )
        },
    )?;
    ensure(g.stats.int_status_seen & int_error(q) != 0, || {
        format!("INT_STATUS bit {} not latched", 16 + q)
    })?;
    ensure(ds & DEV_STATUS_ERROR != 0, || {
        format!("DEV_STATUS {ds:#x} lacks the error bit")
    })?;
    let fence_before = g.dma().read_u64(g.fence_slot(q))?;
    ensure(fence_before < seq, || {
        "the FENCE behind the bad command ran".into()
    })?;

    g.recover(q);
    g.wait_fence(q, seq)?;
    let st = g.qr32(q, Q_STATUS);
    let code = g.qr32(q, Q_ERROR_CODE);
    let ds = g.bar0.r32(DEV_STATUS);
    ensure(
        st == Q_STATUS_IDLE && code == 0 && ds & DEV_STATUS_ERROR == 0,
        || {
            format!(
                "after RECOVER: STATUS {} ERROR_CODE {code} DEV_STATUS {ds:#x}",
                status_name(st)
            )
        },
    )?;
    Ok(format!(
        "{} code {} addr {:#x} index {} on {} vector {err_vec}{}, recovered",
        error_name(f.code),
        f.code,
        f.addr,
        f.index,
        g.irqs.delivery().label(),
        match g.irqs.delivery() {
            Delivery::Msix => String::new(),
            Delivery::Msi | Delivery::Polled => format!(" (INT_STATUS bit {})", 16 + q),
        }
    ))
}

/// Bad DMA addresses: an IOVA the guest never mapped, and a range running off the end of the
/// mapped arena. Each must fault without writing anything, interrupt on the error vector, and
/// the queue must work again after RECOVER. Without an IOMMU the first is a bus address that
/// is neither RAM nor a device, and the second is skipped: past the arena lies other guest RAM.
fn step_error(g: &mut Gpu, _s: &Sizes) -> Result<String, String> {
    // (a) Entirely unmapped destination, queue 0.
    let src = g.dma_alloc(4096, 4096)?;
    g.dma().write(src, &[0x5a; 64])?;
    let bad = g.unmapped_addr;
    let a = provoke(g, 0, Cmd::copy(Addr::Iova(src), Addr::Iova(bad), 64), bad)?;
    g.stats.jobs_verified += 1;
    let ok = g.dma_alloc(64, 64)?;
    g.run(0, &[Cmd::fill(Addr::Iova(ok), 16, 0xfeed_face)])?;
    check_bytes(
        "FILL after recovery",
        &g.dma().read_vec(ok, 16)?,
        &r::fill(16, 0xfeed_face),
    )?;
    g.stats.jobs_verified += 1;
    if !g.arena_edge_faults {
        return Ok(format!(
            "unmapped bus address: {a}; job ran again; partly mapped range skipped (no IOMMU: the bus addresses past the DMA memory are other guest RAM, which the device reaches)"
        ));
    }

    // (b) A range whose second page lies past the end of the arena, on the last queue.
    let q = g.nq - 1;
    let last = g.dma().end() - 4096;
    g.dma().write(last, &[0x77; 4096])?;
    let src = g.dma_alloc(8192, 4096)?;
    let data = r::byte_data(0xbad, 8192);
    g.dma().write(src, &data)?;
    let b = provoke(
        g,
        q,
        Cmd::copy(Addr::Iova(src), Addr::Iova(last), 8192),
        g.dma().end(),
    )?;
    check_bytes(
        "mapped page of the faulting COPY (must be untouched)",
        &g.dma().read_vec(last, 4096)?,
        &[0x77; 4096],
    )?;
    g.stats.jobs_verified += 1;
    g.run(q, &[Cmd::copy(Addr::Iova(src), Addr::Iova(last), 4096)])?;
    check_bytes(
        "COPY after recovery",
        &g.dma().read_vec(last, 4096)?,
        &data[..4096],
    )?;
    g.stats.jobs_verified += 1;
    Ok(format!(
        "unmapped IOVA: {a}; partly mapped range: {b}; jobs ran again"
    ))
}

/// Global consistency: every FENCE counted, no queue in error, all idle.
fn step_final(g: &mut Gpu, _s: &Sizes) -> Result<String, String> {
    let fc = g.bar0.r64(FENCE_COUNT);
    ensure(fc == g.stats.fences, || {
        format!("FENCE_COUNT {fc}, driver submitted {}", g.stats.fences)
    })?;
    let irq_fences = g.stats.fences - g.stats.silent_fences;
    ensure(
        g.stats.fence_irq_waits + g.stats.abandoned_fence_waits == irq_fences,
        || {
            format!(
                "{} fence waits ended by interrupt (+{} abandoned after device restarts), {irq_fences} interrupting fences submitted",
                g.stats.fence_irq_waits, g.stats.abandoned_fence_waits
            )
        },
    )?;
    for q in 0..g.nq {
        let st = g.qr32(q, Q_STATUS);
        let (head, tail) = (g.qr32(q, Q_HEAD), g.qr32(q, Q_TAIL));
        ensure(st == Q_STATUS_IDLE && head == tail, || {
            format!(
                "queue {q}: STATUS {} HEAD {head} TAIL {tail}",
                status_name(st)
            )
        })?;
    }
    let ds = g.bar0.r32(DEV_STATUS);
    ensure(ds & DEV_STATUS_ERROR == 0, || format!("DEV_STATUS {ds:#x}"))?;
    g.collect_interrupts()?;
    Ok(format!(
        "FENCE_COUNT {fc} matches; {irq_fences} fences each waited for by their {} ({}); all queues idle",
        match g.irqs.delivery() {
            Delivery::Polled => "INT_STATUS completion bit",
            Delivery::Msix | Delivery::Msi => "interrupt",
        },
        match g.irqs.delivery() {
            Delivery::Msix => format!("{} MSI-X signals", g.irqs.total()),
            Delivery::Polled => format!(
                "{} INT_STATUS reads, {} found bits",
                g.irqs.status_polls(),
                g.irqs.total()
            ),
            Delivery::Msi => format!(
                "{} MSI signals, {} found INT_STATUS already drained",
                g.irqs.total(),
                g.irqs.empty_signals()
            ),
        }
    ))
}

/// How many times a step runs again after a device restart interrupted one of its commands.
const MAX_STEP_RETRIES: u32 = 8;

/// Runs every step, stopping at the first failure.
pub fn run(g: &mut Gpu, sizes: &Sizes) -> Outcome {
    let mut out = Outcome::default();
    let vl = VramLayout::new(g.vram_size);
    let mut copy_vram_ok = false;
    type Step<'a> = (
        &'static str,
        Box<dyn FnMut(&mut Gpu) -> Result<String, String> + 'a>,
    );
    let steps: Vec<Step> = vec![
        ("identity", Box::new(|g| step_identity(g, sizes))),
        ("vectors", Box::new(|g| step_vectors(g, sizes))),
        (
            "copy",
            Box::new(|g| step_copy(g, sizes, vl, &mut copy_vram_ok)),
        ),
        ("fill", Box::new(|g| step_fill(g, sizes, vl))),
        ("compute", Box::new(|g| step_compute(g, sizes, vl))),
        ("vram_mmap", Box::new(|g| step_vram_mmap(g, sizes, vl))),
        ("error", Box::new(|g| step_error(g, sizes))),
        ("final", Box::new(|g| step_final(g, sizes))),
    ];
    let mut vram_step_ok = false;
    for (name, mut f) in steps {
        let t = Instant::now();
        let mut attempts = 0;
        let res = loop {
            let mark = g.dma_mark();
            let interrupted = g.stats.interrupted;
            let irq_fences = g.stats.fences - g.stats.silent_fences;
            let irq_waits = g.stats.fence_irq_waits;
            let (jobs_run, bytes_moved) = (g.stats.jobs_run, g.stats.bytes_moved);
            let res = match catch_unwind(AssertUnwindSafe(|| f(g))) {
                Ok(r) => r,
                Err(p) => Err(format!("panic: {}", crate::panic_message(p.as_ref()))),
            };
            // A device restart under a command (ERR_INTERRUPTED, as a pool daemon's restart of
            // the process serving the device can cause): settle the queues and run the step
            // again from its inputs, as a GPU runtime replays work after a device reset.
            let cut = g.stats.interrupted > interrupted;
            if res.is_err() && cut && attempts < MAX_STEP_RETRIES {
                attempts += 1;
                say!(
                    "step {name}: interrupted by a device restart ({}); running it again",
                    res.as_ref().err().map_or("", String::as_str)
                );
                let settled = g.settle();
                g.stats.abandoned_fence_waits +=
                    (g.stats.fences - g.stats.silent_fences - irq_fences)
                        - (g.stats.fence_irq_waits - irq_waits);
                // The attempt's jobs are submitted again and counted (and verified) then.
                g.stats.jobs_run = jobs_run;
                g.stats.bytes_moved = bytes_moved;
                g.dma_release(mark);
                if let Err(e) = settled {
                    break Err(format!("after a device restart: {e}"));
                }
                continue;
            }
            g.dma_release(mark);
            break res;
        };
        let ms = t.elapsed().as_millis() as u64;
        let ok = res.is_ok();
        match res {
            Ok(detail) => say!("step {name}: ok ({ms} ms): {detail}"),
            Err(e) => {
                say!("step {name}: FAIL ({ms} ms): {e}");
                out.failure = Some(format!("step {name}: {e}"));
            }
        }
        out.steps.push(StepRecord { name, ok, ms });
        match name {
            "error" => out.error_test_ok = ok,
            "vram_mmap" => vram_step_ok = ok,
            _ => {}
        }
        if !ok {
            break;
        }
    }
    out.vram_mmap_ok = vram_step_ok && copy_vram_ok;
    out
}

/// Default wait bound.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        let f = Sizes::full();
        assert_eq!(f.gemm, (256, 256, 256));
        assert_eq!(Sizes::quick().gemm, (64, 64, 64));
        // Every step's DMA fits the arena (rings and fences take < 1 MiB).
        for s in [Sizes::full(), Sizes::quick()] {
            let arena = s.dma_window * s.dma_windows as u64 - (1 << 20);
            assert!(2 * s.copy_bytes + 8192 <= arena, "{s:?}");
            let (m, n, k) = s.gemm;
            let compute = 8 * s.saxpy_n as u64 + 4 * (m * k + k * n + m * n) as u64 + (1 << 20);
            assert!(compute <= arena, "{s:?}");
        }
        let mut small = Sizes::full();
        small.fit_vram(1 << 20);
        assert_eq!(small.copy_bytes, 256 << 10);
        assert!(small.fill_bytes < 1 << 16);
        let vl = VramLayout::new(1 << 20);
        assert!(vl.copy + small.copy_bytes + 8 < vl.fill);
        assert!(vl.fill + small.fill_bytes + 8 < vl.gemm);
        assert!(vl.mmap + 2 * small.vram_mmap_bytes + 8192 < 1 << 20);
        let mut full = Sizes::full();
        full.fit_vram(64 << 20);
        assert_eq!(full, Sizes::full(), "64 MiB VRAM needs no shrinking");
    }

    /// Without an IOMMU every buffer must fit one run of adjacent 2 MiB hugepages.
    #[test]
    fn sizes_fit_a_hugepage() {
        let mut q = Sizes::quick();
        assert!(!q.fit_dma(2 << 20), "quick buffers fit one hugepage");
        assert_eq!(q, Sizes::quick());
        let mut f = Sizes::full();
        assert!(!f.fit_dma(24 << 20), "a 24 MiB run holds the full sizes");
        assert!(f.fit_dma(2 << 20));
        assert_eq!(f.copy_bytes, 1 << 20);
        assert_eq!(f.fill_bytes, (1 << 20) + 3);
        assert_eq!(f.saxpy_n, 1 << 19);
        assert_eq!(f.gemm, (256, 256, 256), "256x256 f32 is 256 KiB");
        assert_eq!(f.vram_mmap_bytes, 1 << 20);
        for b in [f.copy_bytes + 64, f.fill_bytes + 64, 4 * f.saxpy_n as u64] {
            assert!(b <= 2 << 20);
        }
        // Two adjacent hugepages: SAXPY and COPY grow again.
        let mut f = Sizes::full();
        f.fit_dma(4 << 20);
        assert_eq!((f.copy_bytes, f.saxpy_n), (2 << 20, 1 << 20));
    }
}
