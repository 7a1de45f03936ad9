//! The `cuda` board on a real GPU (`--only cuda`; never in the default set: CI has no GPU;
//! `scripts/gpu-check.sh` runs it). A softgpu served in-process with its commands on the GPU
//! `SY_GPU` names (default: the first), driven through vfio-user by the benchmark's driver,
//! against the same operations called natively on the same GPU in the same run:
//!
//! - GEMM 4096 with operands in VRAM, submit → FENCE, against cuBLAS SGEMM on GPU buffers
//!   (goal: ≥ 0.9× its throughput, i.e. ≤ 1.11× its time);
//! - GEMM 4096 with operands in guest memory, against the same with the native copies in
//!   and out of registered host memory;
//! - COPY guest ↔ VRAM, 64 MiB, against a native copy from (to) registered host memory
//!   (goal ≥ 0.9×);
//! - submit → FENCE of a 4 KiB COPY against a native 4 KiB copy + stream synchronize (goal
//!   ≤ 1.5×);
//! - the CPU backend's GEMM 4096 (one engine thread, one run), against the GPU board's, for
//!   scale.
//!
//! Sized for `scripts/gpu-check.sh`'s budget: the softgpu's VRAM ([`VRAM`]) is large enough
//! that the `cuda` board's staging budget (`staging_budget`) holds every row's guest operands
//! (GEMM 4096 in guest memory: 3 × 64 MiB), so every row runs on the GPU (a unit test below
//! checks it from these constants); before a row is measured, one run of ours must have run
//! on the GPU (none declined to the CPU path, where a GEMM 4096 takes 10–25 s and the row's
//! runs would take minutes), else the case fails at once and says which row. Each row's
//! figures go to stderr as soon as it is measured, so a run stopped early still shows them.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use switchyard_cuda::device::{CudaAccel, CudaDevice, staging_budget};
use switchyard_cuda::gpu::{Gpu as _, Mem, Op};
use switchyard_cuda::real::CudaGpu;
use switchyard_server::{DeviceSlot, Server, ServerConfig, StopHandle};
use switchyard_softgpu::cmd::{Command, Operand};
use switchyard_softgpu::{SoftGpu, SoftGpuConfig};
use vm_memory::MmapRegion;

use crate::cases::{Settings, fig, wait_fences};
use crate::gpu::{DATA_OFFSET, Gpu, fence_offset, guest};
use crate::report::{Row, Target, Unit};
use crate::stats::{Contender, Plan, interleaved};

/// GEMM's size.
const N: u64 = 4096;
/// One GEMM operand, bytes.
const MATRIX: u64 = N * N * 4;
/// The COPY rows' size.
const COPY: u64 = 64 << 20;
/// The softgpu's VRAM: its staging budget (a quarter of it, `staging_budget`) must hold the
/// guest operands of every row's kernel, 3 × [`MATRIX`] (GEMM 4096 in guest memory); with
/// 512 MiB (a 128 MiB budget) the third operand was refused and the row ran on the CPU.
const VRAM: u64 = 1 << 30;
/// Guest memory past the driver's control area: three matrices and two COPY buffers.
const GUEST_DATA: u64 = 3 * MATRIX + 2 * COPY;

/// A row: case, unit, work per sample (bytes, for GB/s), the native batch, the target, a
/// note; its op and our command are [`commands`]' of the same index.
struct CaseSpec<'a>(
    &'static str,
    Unit,
    f64,
    &'a [Op<'a, CudaGpu>],
    Option<Target>,
    &'static str,
);

/// Operand `i` of the rows in VRAM: matrix-sized slots.
fn vram(i: u64) -> Operand {
    Operand::Vram(i * MATRIX)
}

/// Operand `i` of the rows in guest memory: matrix-sized slots.
fn in_guest(i: u64) -> Operand {
    guest(DATA_OFFSET + i * MATRIX)
}

/// Each row's op and our command, in the order of the rows.
fn commands() -> [(&'static str, Command); 6] {
    [
        ("gemm-vram", gemm(vram(0), vram(1), vram(2))),
        ("gemm-guest", gemm(in_guest(0), in_guest(1), in_guest(2))),
        ("g2v", Command::copy(in_guest(3), vram(3), COPY)),
        ("v2g", Command::copy(vram(3), in_guest(3), COPY)),
        ("small", Command::copy(in_guest(3), vram(3), 4096)),
        ("gemm-vram-2", gemm(vram(0), vram(1), vram(2))),
    ]
}

/// A softgpu served in this process.
struct InProcess {
    stop: StopHandle,
    slot: DeviceSlot,
    thread: Option<thread::JoinHandle<()>>,
}

impl InProcess {
    /// Commands the `cuda` board declined (ran on the CPU path) so far; 0 without one.
    fn declined(&self) -> u64 {
        self.slot
            .with_as(|d: &mut SoftGpu| {
                d.accelerator()
                    .and_then(|a| a.as_any().downcast_ref::<CudaDevice<CudaGpu>>())
                    .map_or(0, |dev| dev.stats().declined.load(Ordering::SeqCst))
            })
            .unwrap_or(0)
    }
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves a softgpu of [`VRAM`] at `socket`, on `gpu` (or on the CPU).
fn serve(socket: &Path, gpu: Option<&CudaGpu>) -> Result<InProcess> {
    let config = SoftGpuConfig {
        vram_size: VRAM,
        vram_mmap: false,
        ..SoftGpuConfig::default()
    };
    let accel = gpu.map(|g| Arc::new(CudaAccel::new(Arc::new(g.clone()))));
    let mut server = Server::new(ServerConfig::new(socket), move |ctx| {
        let dev = SoftGpu::new(config, ctx)?;
        match &accel {
            Some(a) => dev
                .with_accelerator(a.as_ref())
                .map_err(|e| switchyard_softgpu::SoftGpuError::Vram(std::io::Error::other(e))),
            None => Ok(dev),
        }
    })
    .context("server")?;
    let stop = server.stop_handle();
    let slot = server.device_slot();
    let thread = thread::spawn(move || {
        if let Err(e) = server.run() {
            eprintln!("cuda bench server: {e:#}");
        }
    });
    Ok(InProcess {
        stop,
        slot,
        thread: Some(thread),
    })
}

/// Runs `cmd` then a FENCE on queue 0; the time from the doorbell to the fence seen.
fn fenced(gpu: &mut Gpu, cmd: Command, seq: &mut u64) -> Result<Duration> {
    *seq += 1;
    let tail = gpu.enqueue(
        0,
        &[cmd, Command::fence(guest(fence_offset(0)), *seq, None)],
    )?;
    let t0 = Instant::now();
    gpu.doorbell(0, tail, true)?;
    if let Err(e) = wait_fences(gpu, &[(fence_offset(0), *seq)], Duration::from_secs(200)) {
        gpu.check_queues()?;
        return Err(e);
    }
    Ok(t0.elapsed())
}

fn gemm(a: Operand, b: Operand, c: Operand) -> Command {
    Command::gemm(N, N, N, a, b, c)
}

/// A registered host buffer (a memfd, as guest RAM is) of `len` bytes.
fn host_buffer(gpu: &CudaGpu, len: u64) -> Result<<CudaGpu as switchyard_cuda::gpu::Gpu>::Host> {
    let mfd = memfd::MemfdOptions::default()
        .create("cuda-bench")
        .context("memfd")?;
    mfd.as_file().set_len(len).context("size")?;
    let region = MmapRegion::<()>::from_file(
        vm_memory::FileOffset::new(mfd.into_file(), 0),
        usize::try_from(len)?,
    )
    .context("mmap")?;
    gpu.register(Arc::new(region)).map_err(|e| anyhow!("{e}"))
}

/// The rows (see the module documentation).
pub fn cuda(dir: &Path, s: &Settings, rows: &mut Vec<Row>) -> Result<()> {
    let which = std::env::var("SY_GPU").unwrap_or_else(|_| "0".into());
    let real = CudaGpu::open(&which).map_err(|e| anyhow!("the GPU `{which}`: {e}"))?;
    let what = format!("{} {}", real.info().name, real.info().uuid);
    eprint!("[{what}] ");
    let socket = dir.join("cuda.sock");
    let server = serve(&socket, Some(&real))?;
    let client = switchyard_client::Client::connect(&socket).context("connect")?;
    let mut gpu = Gpu::setup(client, GUEST_DATA)?;
    // Operands: A and B in guest memory and in VRAM.
    let pattern: Vec<u8> = (0..1u32 << 20)
        .flat_map(|i| (((i % 1000) as f32) * 0.001 - 0.5).to_le_bytes())
        .take(4 << 20)
        .collect();
    let mut off = 0;
    while off < 2 * MATRIX {
        gpu.mem_write(DATA_OFFSET + off, &pattern)?;
        off += pattern.len() as u64;
    }
    let mut seq = 0;
    for i in 0..2 {
        fenced(
            &mut gpu,
            Command::copy(in_guest(i), vram(i), MATRIX),
            &mut seq,
        )?;
    }
    let samples = if s.quick { 3 } else { 20 };
    let plan = Plan::new(2, samples, 1);

    // Native: the same GPU, buffers of its own.
    let stream = real.stream().map_err(|e| anyhow!("{e}"))?;
    let dev: Vec<_> = (0..3)
        .map(|_| real.alloc(MATRIX as usize))
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow!("{e}"))?;
    let host = host_buffer(&real, 3 * MATRIX)?;
    let run = |ops: &[Op<'_, CudaGpu>]| -> Result<Duration> {
        let t = Instant::now();
        real.run(&stream, ops).map_err(|e| anyhow!("{e}"))?;
        Ok(t.elapsed())
    };
    let m = usize::try_from(MATRIX)?;
    let n = usize::try_from(N)?;
    let native_gemm = [Op::Gemm {
        m: n,
        n,
        k: n,
        a: Mem::Dev(&dev[0], 0),
        b: Mem::Dev(&dev[1], 0),
        c: Mem::Dev(&dev[2], 0),
    }];
    let native_staged = [
        Op::Copy {
            dst: Mem::Dev(&dev[0], 0),
            src: Mem::Host(&host, 0),
            len: m,
        },
        Op::Copy {
            dst: Mem::Dev(&dev[1], 0),
            src: Mem::Host(&host, m),
            len: m,
        },
        Op::Gemm {
            m: n,
            n,
            k: n,
            a: Mem::Dev(&dev[0], 0),
            b: Mem::Dev(&dev[1], 0),
            c: Mem::Dev(&dev[2], 0),
        },
        Op::Copy {
            dst: Mem::Host(&host, 2 * m),
            src: Mem::Dev(&dev[2], 0),
            len: m,
        },
    ];
    let copy_len = usize::try_from(COPY)?;
    let h2d = [Op::Copy {
        dst: Mem::Dev(&dev[0], 0),
        src: Mem::Host(&host, 0),
        len: copy_len,
    }];
    let d2h = [Op::Copy {
        dst: Mem::Host(&host, 0),
        src: Mem::Dev(&dev[0], 0),
        len: copy_len,
    }];
    let small = [Op::Copy {
        dst: Mem::Dev(&dev[0], 0),
        src: Mem::Host(&host, 0),
        len: 4096,
    }];
    run(&native_gemm)?;

    let gpu = std::cell::RefCell::new(&mut gpu);
    let seq = std::cell::RefCell::new(&mut seq);
    let ours = |cmd: Command| {
        let (g, q) = (&gpu, &seq);
        move || fenced(&mut g.borrow_mut(), cmd, &mut q.borrow_mut())
    };
    let cases: [CaseSpec<'_>; 6] = [
        CaseSpec(
            "GEMM 4096, operands in VRAM",
            Unit::Millis,
            0.0,
            &native_gemm,
            Some(Target {
                floor_ratio: 1.0 / 0.9,
                beat_peer: false,
                plus: 0.0,
            }),
            "floor: cuBLAS SGEMM on GPU buffers, same GPU; ours writes C through to the VRAM memfd before the fence",
        ),
        CaseSpec(
            "GEMM 4096, operands in guest memory",
            Unit::Millis,
            0.0,
            &native_staged,
            None,
            "floor: A, B copied in from registered host memory, SGEMM, C copied out",
        ),
        CaseSpec(
            "COPY guest → VRAM 64 MiB",
            Unit::GBps,
            COPY as f64,
            &h2d,
            Some(Target {
                floor_ratio: 0.9,
                beat_peer: false,
                plus: 0.0,
            }),
            "floor: native copy from registered host memory; ours also writes VRAM's memfd through",
        ),
        CaseSpec(
            "COPY VRAM → guest 64 MiB",
            Unit::GBps,
            COPY as f64,
            &d2h,
            Some(Target {
                floor_ratio: 0.9,
                beat_peer: false,
                plus: 0.0,
            }),
            "floor: native copy to registered host memory",
        ),
        CaseSpec(
            "COPY guest → VRAM 4 KiB, submit → FENCE",
            Unit::Micros,
            0.0,
            &small,
            Some(Target {
                floor_ratio: 1.5,
                beat_peer: false,
                plus: 0.0,
            }),
            "floor: native 4 KiB copy + stream synchronize; ours: doorbell → fence seen in guest memory",
        ),
        CaseSpec(
            "GEMM 4096 (VRAM), same again",
            Unit::Millis,
            0.0,
            &native_gemm,
            None,
            "a second run of the first row, to show its spread",
        ),
    ];
    for (CaseSpec(case, unit, work, native, target, note), (op, cmd)) in
        cases.into_iter().zip(commands())
    {
        // One run first: it must run on the GPU, not on the CPU path (see the module docs).
        let declined = server.declined();
        ours(cmd)()?;
        if server.declined() != declined {
            bail!(
                "`{case}`: the cuda board ran it on the CPU path (declined: staging beyond its \
                 budget of {} MiB, or GPU memory short); its runs would take minutes",
                staging_budget(VRAM) >> 20
            );
        }
        let mut cs = vec![
            Contender::new("native", || run(native)),
            Contender::new("ours", ours(cmd)),
        ];
        let mut r = interleaved(&mut cs, plan)?;
        let floor = fig("native CUDA", &mut r[0], unit, work)?;
        let mine = fig("cuda board", &mut r[1], unit, work)?;
        eprint!(
            "\n    {op}: cuda board p50 {:.3} {u}, native CUDA p50 {:.3} {u} ",
            mine.p50,
            floor.p50,
            u = unit.label()
        );
        rows.push(Row::new(
            "cuda",
            case.into(),
            op,
            &what,
            None,
            unit,
            mine,
            Some(floor),
            None,
            target,
            note.into(),
        ));
    }
    let g = gpu.into_inner();
    let q = seq.into_inner();

    // The CPU backend's GEMM 4096, once, against the GPU board's.
    let cpu_socket = dir.join("cpu.sock");
    let _cpu = serve(&cpu_socket, None)?;
    let cpu_client = switchyard_client::Client::connect(&cpu_socket).context("connect")?;
    let mut cpu = Gpu::setup(cpu_client, 2 * MATRIX)?;
    let mut cseq = 0;
    let t_gpu = fenced(g, gemm(vram(0), vram(1), vram(2)), q)?;
    let t_cpu = fenced(&mut cpu, gemm(vram(0), vram(1), vram(2)), &mut cseq)?;
    let one = |name: &str, d: Duration| crate::report::Figure {
        name: name.into(),
        p50: d.as_secs_f64() * 1e3,
        p99: d.as_secs_f64() * 1e3,
        n: 1,
    };
    rows.push(Row::new(
        "cuda",
        "GEMM 4096, CPU backend (one engine thread)".into(),
        "gemm-cpu",
        "softgpu (CPU)",
        None,
        Unit::Millis,
        one("cpu", t_cpu),
        Some(one("cuda board", t_gpu)),
        None,
        None,
        "one run each; ratio = how many times the GPU board is faster".into(),
    ));
    if t_cpu.is_zero() {
        bail!("the CPU GEMM took no time");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_softgpu::cmd::{OP_COPY, OP_GEMM};

    /// A command's operands `(operand, bytes)` and whether it is a kernel (whose guest
    /// operands the `cuda` board stages in GPU memory), as the board's plan has them
    /// (`backend/cuda/src/device/plan.rs`) for the commands the rows use.
    fn operands(c: &Command) -> (bool, Vec<(Operand, u64)>) {
        match c.opcode {
            OP_COPY => (
                false,
                vec![(c.operand(0), c.arg[0]), (c.operand(1), c.arg[0])],
            ),
            OP_GEMM => {
                let [m, n, k] = c.arg;
                (
                    true,
                    vec![
                        (c.operand(0), m * k * 4),
                        (c.operand(1), k * n * 4),
                        (c.operand(2), m * n * 4),
                    ],
                )
            }
            op => panic!("the rows use no command {op:#x}: add it here"),
        }
    }

    /// Every row's operands fit the bench's VRAM and guest memory, and the staging buffers of
    /// its kernels' guest operands fit the `cuda` board's staging budget of that VRAM: a row
    /// beyond it runs on the CPU path (a GEMM 4096: 10–25 s a run) and `scripts/gpu-check.sh`'s
    /// bench step runs out of its time. The board keeps each staging buffer of a queue (one per
    /// operand, a power of two) at the largest size it needed, and the rows share queue 0: what
    /// they take together is each operand's largest, summed.
    #[test]
    fn every_rows_guest_operands_fit_the_staging_budget() {
        let budget = staging_budget(VRAM);
        let mut kept = [0u64; 3];
        for (op, c) in commands() {
            let (kernel, ops) = operands(&c);
            let mut need = 0;
            for (i, &(o, len)) in ops.iter().enumerate() {
                match o {
                    Operand::Vram(at) => assert!(at + len <= VRAM, "{op}: VRAM operand {i}"),
                    Operand::Guest(iova) => {
                        let at = iova - guest(DATA_OFFSET).addr();
                        assert!(at + len <= GUEST_DATA, "{op}: guest operand {i}");
                        if kernel {
                            let staged = len.max(4).next_power_of_two();
                            need += staged;
                            kept[i] = kept[i].max(staged);
                        }
                    }
                }
            }
            assert!(
                need <= budget,
                "{op}: {} MiB of guest operands to stage, the budget of {} MiB VRAM is {} MiB",
                need >> 20,
                VRAM >> 20,
                budget >> 20
            );
        }
        let all: u64 = kept.iter().sum();
        assert_eq!(
            all,
            3 * MATRIX,
            "GEMM 4096 in guest memory: three operands staged"
        );
        assert!(
            all <= budget,
            "the rows' staging together: {all} > {budget}"
        );
    }
}
