//! What a real GPU does that a CPU running every operation at once does not, on the fake
//! that models it (`crate::fake`): results that must be exact, written to guest memory and
//! logged dirty; a batch stopped partway; two queues sharing VRAM's chunks.

use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use switchyard_device::{DmaProt, DmaSpace};
use switchyard_softgpu::accel::{AccelDevice, AccelOutcome, Accelerator};
use switchyard_softgpu::cmd::{Command, Operand};

use crate::device::{CHUNK, CudaAccel, CudaDevice};
use crate::fake::FakeGpu;
use crate::tests::{memfd, open_with, read_at, write_at};

const VRAM: u64 = 16 << 20;
const GUEST: u64 = 0x10_0000;
const GUEST_SIZE: u64 = 8 << 20;
const PAGE: u64 = 4096;

/// A device on `fake` with two queues, and a guest window at [`GUEST`] mapped through the DMA
/// space (as the server maps a client's), its observer installed.
struct Rig {
    dev: Arc<dyn AccelDevice>,
    vram: Arc<File>,
    guest: File,
    dma: Arc<DmaSpace>,
}

impl Rig {
    fn new(fake: &FakeGpu) -> Rig {
        let dma = Arc::new(DmaSpace::default());
        let (dev, vram) = open_with(fake, VRAM, 2, &dma);
        dma.set_observer(dev.dma_observer());
        let guest = memfd(GUEST_SIZE);
        let rw = DmaProt {
            read: true,
            write: true,
        };
        dma.map(
            GUEST,
            GUEST_SIZE,
            rw,
            Some((guest.try_clone().expect("dup"), 0)),
        )
        .expect("map");
        Rig {
            dev,
            vram,
            guest,
            dma,
        }
    }

    fn cuda(&self) -> &CudaDevice<FakeGpu> {
        self.dev
            .as_any()
            .downcast_ref::<CudaDevice<FakeGpu>>()
            .expect("fake")
    }

    /// The pages of the guest window the dirty log holds now (cleared by the report).
    fn dirty_pages(&self) -> Vec<u64> {
        let pages = GUEST_SIZE / PAGE;
        let mut bitmap = vec![0u8; pages.div_ceil(8) as usize];
        self.dma
            .report_dirty(GUEST, GUEST_SIZE, PAGE, &mut bitmap)
            .expect("report");
        (0..pages)
            .filter(|p| bitmap[(p / 8) as usize] & (1 << (p % 8)) != 0)
            .collect()
    }
}

fn floats_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn bytes_floats(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// Small integers: every sum and product below is exact in f32, whatever the order.
fn ints(n: usize, modulo: usize) -> Vec<f32> {
    (0..n).map(|i| (i % modulo) as f32).collect()
}

#[test]
fn reduce_writes_its_result_into_guest_memory_exactly() {
    let fake = FakeGpu::new();
    let rig = Rig::new(&fake);
    let n = 100_000;
    let x = ints(n, 7);
    let want: f32 = x.iter().sum();
    write_at(&rig.vram, 0, &floats_bytes(&x));
    let out = GUEST + 0x1000;
    // A value the result cannot be, so a result never written shows.
    write_at(&rig.guest, 0x1000, &f32::NAN.to_le_bytes());
    let c = Command::reduce(n as u64, Operand::Vram(0), Operand::Guest(out));
    assert_eq!(rig.dev.run(0, &c), AccelOutcome::Done);
    let got = bytes_floats(&read_at(&rig.guest, 0x1000, 4))[0];
    assert_eq!(got, want, "REDUCE of VRAM into guest memory");

    // Its input in guest memory too (staged in, the result staged out).
    write_at(&rig.guest, 0x10_0000, &floats_bytes(&x));
    write_at(&rig.guest, 0x1000, &f32::NAN.to_le_bytes());
    let c = Command::reduce(
        n as u64,
        Operand::Guest(GUEST + 0x10_0000),
        Operand::Guest(out),
    );
    assert_eq!(rig.dev.run(1, &c), AccelOutcome::Done);
    let got = bytes_floats(&read_at(&rig.guest, 0x1000, 4))[0];
    assert_eq!(got, want, "REDUCE of guest memory into guest memory");
}

#[test]
fn gpu_writes_to_guest_memory_are_in_the_dirty_log() {
    let fake = FakeGpu::new();
    let rig = Rig::new(&fake);
    rig.dma.start_logging(PAGE).expect("logging");
    assert!(rig.dirty_pages().is_empty(), "nothing written yet");

    // COPY VRAM -> guest: the GPU's DMA engine writes pages 2..6 of the window.
    write_at(&rig.vram, 0, &[0xa5u8; 4 * PAGE as usize]);
    let c = Command::copy(Operand::Vram(0), Operand::Guest(GUEST + 2 * PAGE), 4 * PAGE);
    assert_eq!(rig.dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(read_at(&rig.guest, 2 * PAGE, 4), vec![0xa5u8; 4]);
    assert_eq!(rig.dirty_pages(), vec![2, 3, 4, 5], "the copy's pages");

    // A kernel's output in guest memory (staged out): SAXPY's y, pages 16..18.
    let x = ints(2048, 5);
    write_at(&rig.guest, 8 * PAGE, &floats_bytes(&x));
    let c = Command::saxpy(
        2048,
        2.0,
        Operand::Guest(GUEST + 8 * PAGE),
        Operand::Guest(GUEST + 16 * PAGE),
    );
    assert_eq!(rig.dev.run(1, &c), AccelOutcome::Done);
    assert_eq!(rig.dirty_pages(), vec![16, 17], "y's pages, x's not");

    // GEMM's C in guest memory, REDUCE's result.
    let c = Command::gemm(
        8,
        8,
        8,
        Operand::Vram(0),
        Operand::Vram(4096),
        Operand::Guest(GUEST + 32 * PAGE),
    );
    assert_eq!(rig.dev.run(0, &c), AccelOutcome::Done);
    let c = Command::reduce(16, Operand::Vram(0), Operand::Guest(GUEST + 40 * PAGE + 8));
    assert_eq!(rig.dev.run(0, &c), AccelOutcome::Done);
    assert_eq!(rig.dirty_pages(), vec![32, 40]);
}

/// What the softgpu does with a declined SAXPY of VRAM: the CPU path runs it on the memfd.
fn cpu_saxpy(vram: &File, n: usize, a: f32, x: u64, y: u64) {
    let xs = bytes_floats(&read_at(vram, x, n * 4));
    let mut ys = bytes_floats(&read_at(vram, y, n * 4));
    for (yv, xv) in ys.iter_mut().zip(xs) {
        *yv += a * xv;
    }
    write_at(vram, y, &floats_bytes(&ys));
}

/// An in-place SAXPY over 4 MiB of VRAM (four pieces, each written through while the next is
/// computed) whose batch fails at operation `at`; the softgpu's CPU path runs it if declined.
/// Returns the outcome and whether y is exactly `2·x + y`.
fn saxpy_failing_at(at: usize) -> (AccelOutcome, bool, u64) {
    let fake = FakeGpu::new();
    let rig = Rig::new(&fake);
    let n = 1 << 20;
    let (xo, yo) = (0, 8 << 20);
    let (x, y) = (ints(n, 9), ints(n, 11));
    write_at(&rig.vram, xo, &floats_bytes(&x));
    write_at(&rig.vram, yo, &floats_bytes(&y));
    // VRAM on the GPU first (y + 0·x: y again), so the failure is the command's own batch's.
    let warm = Command::saxpy(n as u64, 0.0, Operand::Vram(xo), Operand::Vram(yo));
    assert_eq!(rig.dev.run(0, &warm), AccelOutcome::Done);
    let c = Command::saxpy(n as u64, 2.0, Operand::Vram(xo), Operand::Vram(yo));
    fake.state.fail_at(at, false);
    let outcome = rig.dev.run(0, &c);
    if outcome == AccelOutcome::Declined {
        cpu_saxpy(&rig.vram, n, 2.0, xo, yo);
    }
    let want: Vec<f32> = x.iter().zip(&y).map(|(x, y)| 2.0 * x + y).collect();
    let got = bytes_floats(&read_at(&rig.vram, yo, n * 4));
    let resumed = rig.cuda().stats().resumed.load(Ordering::SeqCst);
    (outcome, got == want, resumed)
}

#[test]
fn a_transient_error_partway_through_a_batch_never_applies_saxpy_twice() {
    // The batch: SAXPY piece 0, write-back 0, SAXPY piece 1, write-back 1, ... (x and y
    // already on the GPU). Stopped at its first operation: nothing
    // was written, the CPU path runs it.
    let (outcome, exact, resumed) = saxpy_failing_at(0);
    assert_eq!(outcome, AccelOutcome::Declined);
    assert!(exact, "declined before any write: the CPU path's result");
    assert_eq!(resumed, 0);
    // Stopped after the first piece was written through: the memfd's y holds 2·x + y there.
    // Handing the command to the CPU path would apply SAXPY twice to that piece; the batch is
    // resumed where it stopped instead.
    for at in [2, 3, 5] {
        let (outcome, exact, resumed) = saxpy_failing_at(at);
        assert_eq!(outcome, AccelOutcome::Done, "stopped at operation {at}");
        assert!(
            exact,
            "stopped at operation {at}: y is 2·x + y exactly once"
        );
        assert_eq!(resumed, 1, "stopped at operation {at}");
    }
}

#[test]
fn a_chunk_another_queue_is_uploading_is_waited_for() {
    let fake = FakeGpu::new();
    let rig = Rig::new(&fake);
    let data: Vec<u8> = (0..4096u32).map(|i| (i % 253) as u8 + 1).collect();
    write_at(&rig.vram, 0, &data);
    // Queue 0 (stream 0) takes VRAM's first chunk to upload it, and its GPU stalls.
    fake.state.gate.close_stream(0);
    let long = Duration::from_secs(20);
    std::thread::scope(|s| {
        let first = s.spawn(|| {
            rig.dev.run(
                0,
                &Command::copy(Operand::Vram(0), Operand::Vram(2 * CHUNK), 4096),
            )
        });
        assert!(
            fake.state.gate.wait_held(1, long),
            "queue 0 reached the GPU"
        );
        // Queue 1 reads the same chunk meanwhile.
        let second = s.spawn(|| {
            rig.dev.run(
                1,
                &Command::copy(Operand::Vram(0), Operand::Vram(3 * CHUNK), 4096),
            )
        });
        // Either it finished (it did not wait for the upload) or it waits for it.
        let waits = || rig.cuda().stats().upload_waits.load(Ordering::SeqCst);
        let start = Instant::now();
        while !second.is_finished() && waits() == 0 && start.elapsed() < long {
            std::thread::yield_now();
        }
        fake.state.gate.open();
        assert_eq!(first.join().expect("first"), AccelOutcome::Done);
        assert_eq!(second.join().expect("second"), AccelOutcome::Done);
    });
    assert!(
        read_at(&rig.vram, 2 * CHUNK, 4096) == data,
        "queue 0's copy"
    );
    assert!(
        read_at(&rig.vram, 3 * CHUNK, 4096) == data,
        "queue 1 read the chunk before its upload finished"
    );
    assert_eq!(rig.cuda().stats().upload_waits.load(Ordering::SeqCst), 1);
}

#[test]
fn without_nvrtc_or_cublas_the_gpu_copies_and_fills_and_the_cpu_runs_the_rest() {
    let fake = FakeGpu::new();
    fake.state.no_kernels.store(true, Ordering::SeqCst);
    fake.state.no_blas.store(true, Ordering::SeqCst);
    let accel = CudaAccel::new(Arc::new(fake.clone()));
    let said = accel.describe();
    assert!(
        said.contains("COPY and FILL on the GPU")
            && said.contains("SAXPY and REDUCE (libnvrtc.so was not found")
            && said.contains("GEMM (libcublas.so was not found"),
        "{said}"
    );
    let rig = Rig::new(&fake);
    let copy = Command::copy(Operand::Vram(0), Operand::Guest(GUEST), 4096);
    let fill = Command::fill(Operand::Vram(0), 4096, 7);
    assert_eq!(rig.dev.run(0, &fill), AccelOutcome::Done);
    assert_eq!(rig.dev.run(0, &copy), AccelOutcome::Done);
    let batches = fake.state.batches.load(Ordering::SeqCst);
    let allocated = fake.state.allocated.load(Ordering::SeqCst);
    for c in [
        Command::saxpy(
            1024,
            2.0,
            Operand::Guest(GUEST),
            Operand::Guest(GUEST + 0x1_0000),
        ),
        Command::reduce(1024, Operand::Vram(0), Operand::Vram(0x1_0000)),
        Command::gemm(
            8,
            8,
            8,
            Operand::Vram(0),
            Operand::Vram(4096),
            Operand::Vram(8192),
        ),
    ] {
        assert_eq!(rig.dev.run(1, &c), AccelOutcome::Declined, "{c:?}");
    }
    assert_eq!(
        fake.state.batches.load(Ordering::SeqCst),
        batches,
        "declined before anything ran on the GPU"
    );
    assert_eq!(
        fake.state.allocated.load(Ordering::SeqCst),
        allocated,
        "and before anything was staged"
    );
}

#[test]
fn wherever_the_gpu_runs_a_write_back_the_results_are_the_same() {
    for seed in 0..12u64 {
        let fake = FakeGpu::new();
        fake.state.seed.store(seed, Ordering::SeqCst);
        let rig = Rig::new(&fake);
        let n = 1 << 20;
        let (x, y) = (ints(n, 9), ints(n, 11));
        write_at(&rig.vram, 0, &floats_bytes(&x));
        write_at(&rig.vram, 8 << 20, &floats_bytes(&y));
        // In place in VRAM (4 MiB: eleven pieces, each written through), then a copy of the
        // result into guest memory (staged pieces written back).
        let saxpy = Command::saxpy(n as u64, 2.0, Operand::Vram(0), Operand::Vram(8 << 20));
        assert_eq!(rig.dev.run(0, &saxpy), AccelOutcome::Done, "seed {seed}");
        let out = Command::copy(Operand::Vram(8 << 20), Operand::Guest(GUEST), 4 << 20);
        assert_eq!(rig.dev.run(1, &out), AccelOutcome::Done, "seed {seed}");
        let want = floats_bytes(
            &x.iter()
                .zip(&y)
                .map(|(x, y)| 2.0 * x + y)
                .collect::<Vec<_>>(),
        );
        assert!(
            read_at(&rig.vram, 8 << 20, n * 4) == want,
            "seed {seed}: VRAM"
        );
        assert!(read_at(&rig.guest, 0, n * 4) == want, "seed {seed}: guest");
    }
}

#[test]
fn queues_interleaved_operation_by_operation_in_a_seeds_order_get_exact_results() {
    for seed in 1..6u64 {
        let fake = FakeGpu::new();
        fake.state.seed.store(seed, Ordering::SeqCst);
        let rig = Rig::new(&fake);
        let n = 1 << 18;
        let x = ints(n, 7);
        write_at(&rig.vram, 0, &floats_bytes(&x));
        // Queue 0 copies x along VRAM while queue 1 sums it and copies it into guest memory:
        // both read chunks neither has uploaded yet.
        std::thread::scope(|s| {
            let q0 = s.spawn(|| {
                rig.dev.run(
                    0,
                    &Command::copy(Operand::Vram(0), Operand::Vram(4 << 20), n as u64 * 4),
                )
            });
            let q1 = s.spawn(|| {
                let sum = Command::reduce(n as u64, Operand::Vram(0), Operand::Guest(GUEST));
                let copy = Command::copy(
                    Operand::Vram(0),
                    Operand::Guest(GUEST + 0x1000),
                    n as u64 * 4,
                );
                (rig.dev.run(1, &sum), rig.dev.run(1, &copy))
            });
            assert_eq!(q0.join().expect("q0"), AccelOutcome::Done, "seed {seed}");
            let (a, b) = q1.join().expect("q1");
            assert_eq!(
                (a, b),
                (AccelOutcome::Done, AccelOutcome::Done),
                "seed {seed}"
            );
        });
        let want = floats_bytes(&x);
        assert!(
            read_at(&rig.vram, 4 << 20, n * 4) == want,
            "seed {seed}: VRAM copy"
        );
        assert!(
            read_at(&rig.guest, 0x1000, n * 4) == want,
            "seed {seed}: guest copy"
        );
        let sum = bytes_floats(&read_at(&rig.guest, 0, 4))[0];
        assert_eq!(sum, x.iter().sum::<f32>(), "seed {seed}: REDUCE");
    }
}
