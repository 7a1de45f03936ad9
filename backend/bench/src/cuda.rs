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

use std::path::Path;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use switchyard_cuda::device::CudaAccel;
use switchyard_cuda::gpu::{Gpu as _, Mem, Op};
use switchyard_cuda::real::CudaGpu;
use switchyard_server::{Server, ServerConfig, StopHandle};
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

/// A row: case, op, unit, work per sample (bytes, for GB/s), our command, the native
/// batch, the target, a note.
struct CaseSpec<'a>(
    &'static str,
    &'static str,
    Unit,
    f64,
    Command,
    &'a [Op<'a, CudaGpu>],
    Option<Target>,
    &'static str,
);

/// A softgpu served in this process.
struct InProcess {
    stop: StopHandle,
    thread: Option<thread::JoinHandle<()>>,
}

impl Drop for InProcess {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Serves a softgpu of 512 MiB VRAM at `socket`, on `gpu` (or on the CPU).
fn serve(socket: &Path, gpu: Option<&CudaGpu>) -> Result<InProcess> {
    let config = SoftGpuConfig {
        vram_size: 512 << 20,
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
    let thread = thread::spawn(move || {
        if let Err(e) = server.run() {
            eprintln!("cuda bench server: {e:#}");
        }
    });
    Ok(InProcess {
        stop,
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
    let _server = serve(&socket, Some(&real))?;
    let client = switchyard_client::Client::connect(&socket).context("connect")?;
    let data = 3 * MATRIX + 2 * COPY;
    let mut gpu = Gpu::setup(client, data)?;
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
    for (i, vram) in [0, MATRIX].into_iter().enumerate() {
        fenced(
            &mut gpu,
            Command::copy(
                guest(DATA_OFFSET + i as u64 * MATRIX),
                Operand::Vram(vram),
                MATRIX,
            ),
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
    let vram = |i: u64| Operand::Vram(i * MATRIX);
    let g = |i: u64| guest(DATA_OFFSET + i * MATRIX);
    let cases: [CaseSpec<'_>; 6] = [
        CaseSpec(
            "GEMM 4096, operands in VRAM",
            "gemm-vram",
            Unit::Millis,
            0.0,
            gemm(vram(0), vram(1), vram(2)),
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
            "gemm-guest",
            Unit::Millis,
            0.0,
            gemm(g(0), g(1), g(2)),
            &native_staged,
            None,
            "floor: A, B copied in from registered host memory, SGEMM, C copied out",
        ),
        CaseSpec(
            "COPY guest → VRAM 64 MiB",
            "g2v",
            Unit::GBps,
            COPY as f64,
            Command::copy(g(3), vram(3), COPY),
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
            "v2g",
            Unit::GBps,
            COPY as f64,
            Command::copy(vram(3), g(3), COPY),
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
            "small",
            Unit::Micros,
            0.0,
            Command::copy(g(3), vram(3), 4096),
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
            "gemm-vram-2",
            Unit::Millis,
            0.0,
            gemm(vram(0), vram(1), vram(2)),
            &native_gemm,
            None,
            "a second run of the first row, to show its spread",
        ),
    ];
    for CaseSpec(case, op, unit, work, cmd, native, target, note) in cases {
        let mut cs = vec![
            Contender::new("native", || run(native)),
            Contender::new("ours", ours(cmd)),
        ];
        let mut r = interleaved(&mut cs, plan)?;
        let floor = fig("native CUDA", &mut r[0], unit, work)?;
        let mine = fig("cuda board", &mut r[1], unit, work)?;
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
