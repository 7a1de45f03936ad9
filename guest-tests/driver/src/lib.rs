//! `sygpu-driver`: a user-space driver for the Switchyard softgpu (PCI `1234:5347`) that runs
//! inside a Linux guest, the way a GPU runtime would, over real PCI through Linux VFIO.
//!
//! ```text
//! sygpu-driver [--quick] [--doorbell trapped|mapped] [--latency N] [--soak SECONDS] [--bdf 0000:00:04.0] [--timeout SECONDS]
//! sygpu-driver --noiommu [--quick] [--doorbell trapped|mapped] [--latency N] [--soak SECONDS] [--bdf 0000:00:04.0] [--timeout SECONDS]
//! sygpu-driver --probe [--bdf 0000:00:04.0]
//! ```
//!
//! The default mode finds the device in sysfs, binds it to `vfio-pci`, opens it through the
//! type1v2 container API (the guest needs a vIOMMU: QEMU `-device intel-iommu,caching-mode=on`
//! and `intel_iommu=on`), mmaps BAR0 and the VRAM BAR, enables memory space and bus mastering,
//! routes the interrupts to eventfds (all 16 MSI-X vectors, or in the device's MSI mode
//! (`irq=msi`, no MSI-X capability) its one MSI vector, demultiplexed through `INT_STATUS`; see
//! [`irq`]), maps DMA memory through the guest IOMMU, sets up every queue's ring and runs the workload in [`workload`]: COPY/FILL/SAXPY/GEMM/REDUCE on all
//! queues at once, each result checked bit-for-bit, fences waited for by interrupt only, VRAM
//! coherence between the CPU mapping and the engines, and a bad DMA address with recovery.
//! `--probe` is the no-IOMMU check: sysfs and `resource0` only, no VFIO.
//!
//! `--doorbell mapped` publishes every submission through the device's doorbell page (BAR0
//! `0x8000`, reached through the same BAR0 mapping as the registers): a store of the tail, a
//! full fence, and a trapped `Q_DOORBELL` write only when the device says the queue's engine
//! sleeps ([`gpu::Doorbell`]; the summary counts submissions and kicks). `--latency N` then
//! measures small jobs with both doorbell modes in the same run ([`latency`]).
//!
//! `--soak S` then keeps the device busy for `S` seconds (e.g. while the VM is live-migrated):
//! verified jobs on every queue, and a guest memory region only the device writes, read back
//! and checked every iteration and at the end ([`soak`]; the summary's `soak` object).
//!
//! `--noiommu` ([`noiommu`]) runs the same workload where VFIO cannot work (a vfio-user
//! device under cloud-hypervisor, which puts no vfio-user device behind its virtio-iommu; the
//! Debian 6.12 guest kernel has no VFIO no-IOMMU mode): the device is enabled and mapped
//! through sysfs (`enable`, `config`, `resource0`, `resource2`), DMA memory is 2 MiB hugepages
//! addressed by their physical addresses ([`hugepage`]: read from `/proc/self/pagemap`, so it
//! needs root, and the guest kernel command line needs `hugepages=16`), and every wait polls
//! `INT_STATUS` and the fence values, bounded by `--timeout` (no interrupt reaches user space
//! without VFIO). The [`gpu::Gpu`] and the [`workload`] steps are shared: the two modes differ
//! in their [`gpu::DeviceAccess`], their DMA windows ([`dma::DmaArena`]) and their interrupt
//! delivery ([`irq::Delivery`]). Per-vector interrupt checks and the bad-DMA case that runs
//! off the end of the DMA memory (other guest RAM without an IOMMU) are skipped, and the sizes
//! shrink so every buffer fits one run of physically adjacent hugepages.
//!
//! Output: progress lines `SYGPU: ...`, then exactly one last line `SYGPU-SUMMARY {json}`
//! ([`summary::Summary`]; with `--noiommu` [`summary::NoIommuSummary`], which says
//! `"iommu":"none","dma":"hugepage-physical","interrupts":"polled"`) or `SYGPU-PROBE {json}`
//! ([`summary::ProbeSummary`]). Exit code 0 only on `"result":"pass"`.
//!
//! # Build (static, for a busybox initramfs)
//!
//! ```text
//! RUSTFLAGS="-C target-feature=+crt-static" \
//!     cargo build --release -p sygpu-driver --target x86_64-unknown-linux-gnu
//! # -> target/x86_64-unknown-linux-gnu/release/sygpu-driver
//! ```

#![forbid(unsafe_code)]

pub mod cli;
pub mod cmd;
pub mod dma;
pub mod fill;
pub mod gpu;
pub mod hugepage;
pub mod irq;
pub mod latency;
pub mod mmio;
pub mod noiommu;
pub mod pci;
pub mod probe;
pub mod reference;
pub mod regs;
pub mod second;
pub mod soak;
pub mod summary;
pub mod sysfs;
pub mod vfio;
pub mod vram_soak;
pub mod workload;

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use summary::{Interrupts, Summary};

/// The whole run is bounded by this many `--timeout`s (default 60 s -> 10 minutes), plus the
/// `--soak` seconds ([`watchdog_limit`]).
pub const WATCHDOG_TIMEOUTS: u32 = 10;

/// The bound of a workload run: [`WATCHDOG_TIMEOUTS`] `--timeout`s plus the `--soak` time.
pub fn watchdog_limit(opts: &cli::Options) -> Duration {
    opts.timeout * WATCHDOG_TIMEOUTS + Duration::from_secs(opts.soak.unwrap_or(0) + opts.idle)
}

/// Prints one progress line `SYGPU: ...` (newlines folded). `println!`, not a write to a
/// locked stdout: stdout is line-buffered, so the line is flushed whole, and the unit tests'
/// harness captures it instead of printing it among the test results.
pub fn emit(line: &str) {
    println!("SYGPU: {}", line.replace('\n', " "));
}

/// `say!("fmt", args)`: a progress line.
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {
        $crate::emit(&::std::format!($($t)*))
    };
}

static FINAL_LINE_PRINTED: AtomicBool = AtomicBool::new(false);

/// Prints the final `SYGPU-SUMMARY`/`SYGPU-PROBE` line unless one was printed already (by the
/// watchdog or the main thread); returns whether this call printed it.
fn print_final(line: &str) -> bool {
    if FINAL_LINE_PRINTED
        .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
        .is_err()
    {
        return false;
    }
    println!("{line}");
    true
}

/// If the run has not finished after `limit` (a hang outside the bounded waits, e.g. in a
/// syscall), prints a failing final line with `make_line` and exits 1.
fn start_watchdog(limit: Duration, make_line: impl FnOnce(String) -> String + Send + 'static) {
    let spawned = std::thread::Builder::new()
        .name("watchdog".into())
        .spawn(move || {
            std::thread::sleep(limit);
            let reason = format!("watchdog: no result after {} s", limit.as_secs());
            emit(&format!("FAIL: {reason}"));
            if print_final(&make_line(reason)) {
                std::process::exit(1);
            }
        });
    if let Err(e) = spawned {
        emit(&format!("cannot start the watchdog thread: {e}"));
    }
}

/// Runs the program with `args` (without the program name); returns the exit code.
pub fn main_with(args: &[String]) -> i32 {
    let opts = match cli::parse(args) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("sygpu-driver: {e}\n\n{}", cli::USAGE);
            return 2;
        }
    };
    match opts.mode {
        cli::Mode::Help => {
            println!("{}", cli::USAGE);
            0
        }
        cli::Mode::Probe => {
            start_watchdog(opts.timeout * 2, |reason| {
                summary::ProbeSummary {
                    result: "fail",
                    reason: Some(reason),
                    ..summary::ProbeSummary::default()
                }
                .line()
            });
            let s = probe::probe(opts.bdf.as_deref());
            if print_final(&s.line()) && s.result == "pass" {
                0
            } else {
                1
            }
        }
        cli::Mode::Stamp => {
            start_watchdog(opts.timeout * WATCHDOG_TIMEOUTS, |reason| {
                summary::StampSummary {
                    result: "fail",
                    reason: Some(reason),
                    ..summary::StampSummary::default()
                }
                .line()
            });
            let s = run_stamp(&opts);
            if print_final(&s.line()) && s.result == "pass" {
                0
            } else {
                1
            }
        }
        cli::Mode::Run => {
            let mode = if opts.quick { "quick" } else { "full" };
            let start = Instant::now();
            start_watchdog(watchdog_limit(&opts), move |reason| {
                let mut s = Summary::new(mode);
                s.duration_ms = start.elapsed().as_millis() as u64;
                s.conclude(Some(reason));
                s.line()
            });
            let s = run_vfio(&opts);
            if print_final(&s.line()) && s.passed() {
                0
            } else {
                1
            }
        }
        cli::Mode::NoIommu => {
            let mode = if opts.quick { "quick" } else { "full" };
            let start = Instant::now();
            start_watchdog(watchdog_limit(&opts), move |reason| {
                let mut s = summary::NoIommuSummary::new(mode);
                s.duration_ms = start.elapsed().as_millis() as u64;
                s.conclude(Some(reason));
                s.line()
            });
            let s = run_noiommu(&opts);
            if print_final(&s.line()) && s.passed() {
                0
            } else {
                1
            }
        }
    }
}

/// The workload without IOMMU and VFIO ([`noiommu`]); never panics (a panic becomes a
/// failed summary).
pub fn run_noiommu(opts: &cli::Options) -> summary::NoIommuSummary {
    let start = Instant::now();
    let sizes = workload::Sizes::choose(opts.quick);
    let mut sum = summary::NoIommuSummary::new(sizes.mode);
    say!(
        "start: sygpu-driver {} --noiommu mode={} timeout={}s (no IOMMU, no VFIO: hugepage DMA at physical addresses, polled completion)",
        env!("CARGO_PKG_VERSION"),
        sizes.mode,
        opts.timeout.as_secs()
    );
    let failure = guarded(|| drive_noiommu(opts, sizes, &mut sum));
    sum.duration_ms = start.elapsed().as_millis() as u64;
    sum.conclude(failure);
    say_done(sum.result, sum.duration_ms, sum.reason.as_deref());
    sum
}

fn drive_noiommu(
    opts: &cli::Options,
    mut sizes: workload::Sizes,
    sum: &mut summary::NoIommuSummary,
) -> Result<(), String> {
    let mut b = noiommu::Bringup::default();
    let opened = noiommu::open(
        &sysfs::Sysfs::system(),
        opts.bdf.as_deref(),
        opts.timeout,
        opts.doorbell,
        &mut b,
    );
    sum.bdf = (!b.bdf.is_empty()).then(|| b.bdf.clone());
    sum.device_irq_mode = b.device_irq_mode;
    sum.vram_access = (!b.vram_access.is_empty()).then_some(b.vram_access);
    sum.hugepages = summary::Hugepages {
        page_bytes: hugepage::HUGEPAGE,
        count: b.hugepages,
        locked: b.hugepages_locked,
        runs: b.runs,
        largest_run_bytes: b.largest_run_bytes,
    };
    let mut gpu = opened?;
    sum.queues = gpu.nq;
    sum.vram_bytes = gpu.vram_size;
    sizes.fit_vram(gpu.vram_size);
    if sizes.fit_dma(b.largest_run_bytes) {
        sum.sizes_shrunk = true;
        say!(
            "sizes shrunk to fit {} MiB of physically contiguous DMA memory: COPY {} KiB, FILL {} B, SAXPY/REDUCE n={}, GEMM {:?}, VRAM mapping {} KiB",
            b.largest_run_bytes >> 20,
            sizes.copy_bytes >> 10,
            sizes.fill_bytes,
            sizes.saxpy_n,
            sizes.gemm,
            sizes.vram_mmap_bytes >> 10
        );
        sum.skipped.push(format!(
            "{} sizes: every DMA buffer must fit one run of adjacent hugepages (longest {} MiB)",
            sizes.mode,
            b.largest_run_bytes >> 20
        ));
    }
    sum.skipped.push(
        "per-vector interrupt delivery and completion-vector re-routing: no interrupts without VFIO".into(),
    );
    sum.skipped.push(
        "bad DMA range running off the end of the DMA memory: without an IOMMU the guest RAM there is reachable".into(),
    );
    let out = workload::run(&mut gpu, &sizes);
    sum.doorbell = opts.doorbell.name();
    sum.submissions = gpu.stats.submissions;
    sum.kicks = gpu.stats.kicks;
    say_doorbells(opts, &gpu);
    sum.steps = out.summary_steps();
    let measured = measure_latency(opts, &mut gpu, &out, &mut sum.steps);
    let mut ready = out.failure.is_none() && measured.is_ok();
    let mut second_failure = None;
    let second = if opts.second_device && ready {
        let first = b.bdf.clone();
        second::open_and_fill(opts, &first, &mut sum.steps)
            .map_err(|e| second_failure = Some(e))
            .ok()
    } else {
        None
    };
    ready &= second_failure.is_none();
    let (soaked, soak_failure) = run_soak(opts, &mut gpu, ready, &mut sum.steps);
    sum.soak = soaked;
    if let Some(s) = second
        && let Err(e) = second::check(s, &mut sum.steps)
    {
        second_failure.get_or_insert(e);
    }
    sum.jobs_run = gpu.stats.jobs_run;
    sum.jobs_verified = gpu.stats.jobs_verified;
    sum.bytes_moved = gpu.stats.bytes_moved;
    sum.fences = gpu.stats.fences;
    sum.fence_polled_waits = gpu.stats.fence_irq_waits;
    sum.status_polls = gpu.irqs.status_polls();
    sum.error_test_ok = out.error_test_ok;
    sum.vram_mmap_ok = out.vram_mmap_ok;
    let problems = gpu.shutdown();
    drop(gpu);
    if let Some(e) = out.failure {
        return Err(e);
    }
    sum.latency = measured?;
    if let Some(e) = soak_failure.or(second_failure) {
        return Err(e);
    }
    if !problems.is_empty() {
        return Err(format!("shutdown: {}", problems.join("; ")));
    }
    say!(
        "shutdown: queues reset, bus master off, device enable restored if this run set it, hugepages freed"
    );
    Ok(())
}

/// Says how the workload published its tails.
fn say_doorbells(opts: &cli::Options, gpu: &gpu::Gpu) {
    say!(
        "doorbells: {}, {} submissions, {} kicks",
        opts.doorbell.name(),
        gpu.stats.submissions,
        gpu.stats.kicks
    );
}

/// With `--latency N` and a workload that passed: the latency measurement ([`latency::run`]),
/// recorded as step `latency` in `steps` (its failure fails the run). Never panics (a panic
/// is the step's failure).
fn measure_latency(
    opts: &cli::Options,
    gpu: &mut gpu::Gpu,
    out: &workload::Outcome,
    steps: &mut Vec<summary::Step>,
) -> Result<Option<summary::Latency>, String> {
    let Some(jobs) = opts.latency else {
        return Ok(None);
    };
    if out.failure.is_some() {
        return Ok(None);
    }
    let t = Instant::now();
    let mark = gpu.dma_mark();
    let res = match catch_unwind(AssertUnwindSafe(|| latency::run(gpu, jobs))) {
        Ok(r) => r,
        Err(p) => Err(format!("panic: {}", panic_message(p.as_ref()))),
    };
    gpu.dma_release(mark);
    let ms = t.elapsed().as_millis() as u64;
    steps.push(summary::Step {
        name: "latency".into(),
        ok: res.is_ok(),
        ms,
    });
    match res {
        Ok(l) => {
            say!("step latency: ok ({ms} ms)");
            Ok(Some(l))
        }
        Err(e) => {
            say!("step latency: FAIL ({ms} ms): {e}");
            Err(format!("step latency: {e}"))
        }
    }
}

/// With `--soak S` and a workload (and latency measurement) that passed: the soak
/// ([`soak::run`]), recorded as step `soak` in `steps`. Returns its summary and its failure
/// (which fails the run). Never panics (a panic is the step's failure).
fn run_soak(
    opts: &cli::Options,
    gpu: &mut gpu::Gpu,
    ready: bool,
    steps: &mut Vec<summary::Step>,
) -> (Option<summary::Soak>, Option<String>) {
    let Some(seconds) = opts.soak.filter(|_| ready) else {
        return (None, None);
    };
    let filled = if opts.fill_vram {
        match fill::fill(gpu) {
            Ok(f) => Some(f),
            Err(e) => return (None, Some(format!("fill: {e}"))),
        }
    } else {
        None
    };
    if opts.idle > 0 {
        say!("idle start seconds={}", opts.idle);
        std::thread::sleep(Duration::from_secs(opts.idle));
        say!("idle end");
    }
    let (soak, failure) = soak_steps(gpu, seconds, opts.soak_vram, steps);
    let Some(filled) = filled.filter(|_| failure.is_none()) else {
        return (soak, failure);
    };
    let t = Instant::now();
    let checked = fill::check(gpu, &filled);
    let ms = t.elapsed().as_millis() as u64;
    steps.push(summary::Step {
        name: "fill-check".into(),
        ok: checked.is_ok(),
        ms,
    });
    match checked {
        Ok(n) => {
            say!("step fill-check: ok ({ms} ms, {n} pages)");
            (soak, None)
        }
        Err(e) => {
            say!("step fill-check: FAIL ({ms} ms): {e}");
            (soak, Some(format!("fill-check: {e}")))
        }
    }
}

/// The soak itself, recorded as step `soak`.
fn soak_steps(
    gpu: &mut gpu::Gpu,
    seconds: u64,
    soak_vram: Option<u64>,
    steps: &mut Vec<summary::Step>,
) -> (Option<summary::Soak>, Option<String>) {
    let t = Instant::now();
    let (soak, failure) =
        match catch_unwind(AssertUnwindSafe(|| soak::run(gpu, seconds, soak_vram))) {
            Ok(r) => r,
            Err(p) => {
                let s = summary::Soak {
                    seconds,
                    ..summary::Soak::default()
                };
                (
                    s,
                    Some(format!("soak: panic: {}", panic_message(p.as_ref()))),
                )
            }
        };
    let ms = t.elapsed().as_millis() as u64;
    steps.push(summary::Step {
        name: "soak".into(),
        ok: failure.is_none(),
        ms,
    });
    match &failure {
        None => say!("step soak: ok ({ms} ms)"),
        Some(e) => say!("step soak: FAIL ({ms} ms): {e}"),
    }
    (Some(soak), failure)
}

/// The message of a caught panic.
pub fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "unknown panic".into()
    }
}

/// The VFIO workload; never panics (a panic becomes a failed summary).
pub fn run_vfio(opts: &cli::Options) -> Summary {
    let start = Instant::now();
    let sizes = workload::Sizes::choose(opts.quick);
    let mut sum = Summary::new(sizes.mode);
    say!(
        "start: sygpu-driver {} mode={} timeout={}s",
        env!("CARGO_PKG_VERSION"),
        sizes.mode,
        opts.timeout.as_secs()
    );
    let failure = guarded(|| drive(opts, sizes, &mut sum));
    sum.duration_ms = start.elapsed().as_millis() as u64;
    sum.conclude(failure);
    say_done(sum.result, sum.duration_ms, sum.reason.as_deref());
    sum
}

/// Runs `body`; returns its error, or the message of its panic, if any.
fn guarded(body: impl FnOnce() -> Result<(), String>) -> Option<String> {
    match catch_unwind(AssertUnwindSafe(body)) {
        Ok(Ok(())) => None,
        Ok(Err(e)) => Some(e),
        Err(p) => Some(format!("panic: {}", panic_message(p.as_ref()))),
    }
}

/// The `done:` progress line of a workload run.
fn say_done(result: &str, ms: u64, reason: Option<&str>) {
    say!(
        "done: {result} in {ms} ms{}",
        reason.map(|r| format!(" ({r})")).unwrap_or_default()
    );
}

/// Length of the VRAM stamp.
const STAMP_BYTES: u64 = 1 << 20;

/// `--stamp` / `--check-stamp`; never panics.
pub fn run_stamp(opts: &cli::Options) -> summary::StampSummary {
    let start = Instant::now();
    let mut s = summary::StampSummary {
        action: if opts.stamp_check { "check" } else { "write" },
        seed: opts.stamp_seed,
        bytes: STAMP_BYTES,
        ..summary::StampSummary::default()
    };
    let failure = guarded(|| stamp(opts, &mut s));
    s.duration_ms = start.elapsed().as_millis() as u64;
    s.result = if failure.is_none() && s.mapping_ok && s.engine_ok {
        "pass"
    } else {
        "fail"
    };
    s.reason = failure.or_else(|| (s.result == "fail").then(|| "the stamp differs".to_owned()));
    say!("stamp {}: {}", s.action, s.result);
    s
}

fn stamp(opts: &cli::Options, s: &mut summary::StampSummary) -> Result<(), String> {
    let sizes = workload::Sizes::quick();
    let (mut gpu, bdf) = open_gpu(opts, &sizes)?;
    s.bdf = Some(bdf);
    let offset = gpu.vram_size / 2;
    s.offset = offset;
    let want = reference::byte_data(opts.stamp_seed, STAMP_BYTES as usize);
    if !opts.stamp_check {
        gpu.vram.write(offset, &want).map_err(|e| e.to_string())?;
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
    }
    let mut seen = vec![0u8; want.len()];
    gpu.vram
        .read(offset, &mut seen)
        .map_err(|e| e.to_string())?;
    s.mapping_ok = seen == want;
    let buf = gpu.dma_alloc(STAMP_BYTES, 4096)?;
    gpu.run(
        0,
        &[cmd::Cmd::copy(
            cmd::Addr::Vram(offset),
            cmd::Addr::Iova(buf),
            STAMP_BYTES,
        )],
    )?;
    s.engine_ok = gpu.dma().read_vec(buf, want.len())? == want;
    say!(
        "stamp {} seed {} at VRAM+{offset:#x}: mapping {}, engine COPY {}",
        s.action,
        opts.stamp_seed,
        if s.mapping_ok { "matches" } else { "DIFFERS" },
        if s.engine_ok { "matches" } else { "DIFFERS" }
    );
    let problems = gpu.shutdown();
    if !problems.is_empty() {
        return Err(format!("shutdown: {}", problems.join("; ")));
    }
    Ok(())
}

/// Finds the softgpu (checking its class), binds it to vfio-pci and opens it through VFIO.
/// Returns the device, its IOMMU group and the VFIO handles.
fn open_vfio(opts: &cli::Options) -> Result<(sysfs::PciDev, u32, vfio::Vfio), String> {
    let sys = sysfs::Sysfs::system();
    let dev = sys.find_softgpu(opts.bdf.as_deref())?;
    say!("device {dev}");
    if dev.class != regs::PCI_CLASS {
        return Err(format!(
            "class {:06x}, expected {:06x}",
            dev.class,
            regs::PCI_CLASS
        ));
    }
    let group = dev.iommu_group.ok_or_else(|| {
        format!(
            "{} has no IOMMU group: boot with a vIOMMU (QEMU -device intel-iommu,caching-mode=on) and intel_iommu=on (the kernel has no VFIO no-IOMMU mode)",
            dev.bdf
        )
    })?;
    let (_, how) = sys.bind_vfio_pci(&dev.bdf)?;
    say!("vfio-pci: {how:?}, IOMMU group {group}");
    let vfio = vfio::Vfio::open(&sys.device_dir(&dev.bdf), group, Duration::from_secs(5))?;
    say!(
        "VFIO: container /dev/vfio/vfio (type1v2), group /dev/vfio/{}, device fd; {} MSI-X vectors, {} MSI vector(s)",
        vfio.group(),
        vfio.msix_count(),
        vfio.msi_count()
    );
    Ok((dev, group, vfio))
}

/// [`open_vfio`], then the device brought up: BARs mapped, interrupts wired, reset. Returns
/// it and its PCI address.
fn open_gpu(opts: &cli::Options, sizes: &workload::Sizes) -> Result<(gpu::Gpu, String), String> {
    let (dev, _, vfio) = open_vfio(opts)?;
    let gpu = gpu::Gpu::open(vfio, &gpu_options(opts, sizes))?;
    Ok((gpu, dev.bdf))
}

/// The options of [`gpu::Gpu::open`]; with `--soak`, DMA windows enough for the soak's
/// buffers besides the rings (up to 8 queues; the workload's buffers are freed by then).
fn gpu_options(opts: &cli::Options, sizes: &workload::Sizes) -> gpu::GpuOptions {
    let soak_windows = match opts.soak {
        Some(_) => (soak::dma_bytes(8) + (1 << 20)).div_ceil(sizes.dma_window) as usize,
        None => 0,
    };
    gpu::GpuOptions {
        dma_window: sizes.dma_window,
        dma_windows: sizes.dma_windows.max(soak_windows),
        timeout: opts.timeout,
        doorbell: opts.doorbell,
    }
}

fn drive(opts: &cli::Options, mut sizes: workload::Sizes, sum: &mut Summary) -> Result<(), String> {
    let (dev, group, vfio) = open_vfio(opts)?;
    sum.bdf = Some(dev.bdf.clone());
    sum.iommu_group = Some(group);
    let mode = gpu::detect_irq_mode(&vfio)?;
    sum.irq_mode = Some(mode.name());
    sum.interrupts.per_vector = vec![0; mode.vectors() as usize];
    let mut gpu = gpu::Gpu::open(vfio, &gpu_options(opts, &sizes))?;
    sum.queues = gpu.nq;
    sum.vram_bytes = gpu.vram_size;
    sizes.fit_vram(gpu.vram_size);
    let irq_mode = gpu.irq_mode();
    sum.irq_mode = Some(irq_mode.name());
    let out = workload::run(&mut gpu, &sizes);
    sum.doorbell = opts.doorbell.name();
    sum.submissions = gpu.stats.submissions;
    sum.kicks = gpu.stats.kicks;
    say_doorbells(opts, &gpu);
    sum.steps = out.summary_steps();
    let measured = measure_latency(opts, &mut gpu, &out, &mut sum.steps);
    let ready = out.failure.is_none() && measured.is_ok();
    let (soaked, soak_failure) = run_soak(opts, &mut gpu, ready, &mut sum.steps);
    sum.soak = soaked;
    let _ = gpu.collect_interrupts();
    sum.jobs_run = gpu.stats.jobs_run;
    sum.jobs_verified = gpu.stats.jobs_verified;
    sum.bytes_moved = gpu.stats.bytes_moved;
    sum.fences = gpu.stats.fences;
    sum.fence_irq_waits = gpu.stats.fence_irq_waits;
    sum.interrupted_by_restart = gpu.stats.interrupted;
    sum.interrupts = Interrupts {
        per_vector: gpu.irqs.counts().to_vec(),
        total: gpu.irqs.total(),
    };
    sum.error_test_ok = out.error_test_ok;
    sum.vram_mmap_ok = out.vram_mmap_ok;
    say!(
        "interrupts per vector {:?} (total {})",
        sum.interrupts.per_vector,
        sum.interrupts.total
    );
    let problems = gpu.shutdown();
    drop(gpu);
    if let Some(e) = out.failure {
        return Err(e);
    }
    sum.latency = measured?;
    if let Some(e) = soak_failure {
        return Err(e);
    }
    if !problems.is_empty() {
        return Err(format!("shutdown: {}", problems.join("; ")));
    }
    say!(
        "shutdown: queues reset, bus master off, {} off, DMA unmapped",
        irq_mode.label()
    );
    Ok(())
}
