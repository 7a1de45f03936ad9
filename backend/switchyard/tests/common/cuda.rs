//! A softgpu whose commands run on the `cuda` board's accelerator (the fake GPU, or a real one
//! where a test asks for it), served in-process over vfio-user.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::thread;

use switchyard_client::Client;
use switchyard_cuda::device::{CudaAccel, CudaDevice};
use switchyard_cuda::fake::FakeGpu;
use switchyard_cuda::real::CudaGpu;
use switchyard_device::kind::BoardFailure;
use switchyard_server::{DeviceSlot, Server, ServerConfig, StopHandle};
use switchyard_softgpu::accel::Accelerator;
use switchyard_softgpu::{SoftGpu, SoftGpuConfig};

use super::driver::{Driver, data, guest, reduce_ref};
use super::ours::Ours;

pub struct Board {
    /// The fake GPU, unless the board has a real one.
    pub fake: FakeGpu,
    pub slot: DeviceSlot,
    stop: StopHandle,
    thread: Option<thread::JoinHandle<()>>,
    pub socket: std::path::PathBuf,
    _dir: tempfile::TempDir,
}

impl Board {
    /// A softgpu whose commands run on a fake GPU; `failed` handles its board failures.
    pub fn start(failed: Option<mpsc::Sender<BoardFailure>>) -> Self {
        let fake = FakeGpu::new();
        let accel: Arc<dyn Accelerator> = Arc::new(CudaAccel::new(Arc::new(fake.clone())));
        Self::start_on(fake, accel, failed, 64 << 20)
    }

    /// A softgpu of `vram` bytes whose commands run on the GPU `SY_GPU` names (default: the
    /// first).
    pub fn start_real(vram: u64) -> Self {
        let which = std::env::var("SY_GPU").unwrap_or_else(|_| "0".into());
        let gpu = CudaGpu::open(&which).expect("the GPU opens");
        eprintln!("GPU: {:?}", gpu.info());
        let accel: Arc<dyn Accelerator> = Arc::new(CudaAccel::new(Arc::new(gpu)));
        Self::start_on(FakeGpu::new(), accel, None, vram)
    }

    pub fn start_on(
        fake: FakeGpu,
        accel: Arc<dyn Accelerator>,
        failed: Option<mpsc::Sender<BoardFailure>>,
        vram: u64,
    ) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("gpu.sock");
        let config = SoftGpuConfig {
            vram_mmap: false,
            vram_size: vram,
            ..SoftGpuConfig::default()
        };
        let mut server = Server::new(ServerConfig::new(&socket), move |ctx| {
            let hook = failed.clone().map(|tx| {
                Arc::new(move |f: BoardFailure| tx.send(f).is_ok())
                    as switchyard_device::kind::FailedHook
            });
            let gpu = SoftGpu::new(config, ctx)?.with_failure_hook(hook);
            Ok::<_, switchyard_softgpu::SoftGpuError>(
                gpu.with_accelerator(accel.as_ref())
                    .expect("the accelerator opens"),
            )
        })
        .expect("server");
        let slot = server.device_slot();
        let stop = server.stop_handle();
        let thread = thread::spawn(move || server.run().expect("run"));
        Self {
            fake,
            slot,
            stop,
            thread: Some(thread),
            socket,
            _dir: dir,
        }
    }

    pub fn connect(&self) -> Driver<Ours> {
        Driver::new(Ours(Client::connect(&self.socket).expect("connect")))
    }

    /// `(commands offloaded, declined, guest windows registered)`.
    pub fn accel(&self) -> (u64, u64, usize) {
        self.slot
            .with_as(|d: &mut SoftGpu| {
                let a = d.accelerator().expect("accelerated").as_any();
                let (s, windows) = match a.downcast_ref::<CudaDevice<FakeGpu>>() {
                    Some(dev) => (dev.stats(), dev.registered_windows()),
                    None => {
                        let dev = a
                            .downcast_ref::<CudaDevice<CudaGpu>>()
                            .expect("a CUDA device");
                        (dev.stats(), dev.registered_windows())
                    }
                };
                (
                    s.offloaded.load(Ordering::SeqCst),
                    s.declined.load(Ordering::SeqCst),
                    windows,
                )
            })
            .expect("the slot holds a softgpu")
    }
}

impl Drop for Board {
    fn drop(&mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What ran a command: the (fake) GPU, or the CPU path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ran {
    Gpu,
    Cpu,
}

/// Where [`reduce_ran`] puts REDUCE's input and output in guest memory (away from what
/// `workload::fill_copy_round` uses), and how many floats it sums.
pub const REDUCE_X: u64 = 0x60_0000;
pub const REDUCE_OUT: u64 = 0x61_0000;
pub const REDUCE_N: usize = 10_000;

/// REDUCE input for `seed` whose sums in the fake GPU's order
/// ([`switchyard_cuda::fake::reduce_in_kernel_order`]) and in the CPU path's differ: the data,
/// and the bits of the CPU's sum and of the GPU's.
pub fn reduce_input(seed: u64) -> (Vec<f32>, u32, u32) {
    (0..)
        .map(|k| data((seed as u32).wrapping_mul(977).wrapping_add(k), REDUCE_N))
        .map(|x| {
            let cpu = reduce_ref(&x);
            let gpu = switchyard_cuda::fake::reduce_in_kernel_order(&x).1;
            (x, cpu.to_bits(), gpu.to_bits())
        })
        .find(|(_, cpu, gpu)| cpu != gpu)
        .expect("some data tells the orders apart")
}

/// Runs a REDUCE on queue 0 (set up) and says what ran it: its result must be, bit for bit,
/// the fake GPU's sum or the CPU path's.
pub fn reduce_ran(d: &mut Driver<Ours>, seed: u64) -> Ran {
    let (x, cpu, gpu) = reduce_input(seed);
    d.write_f32s(REDUCE_X, &x);
    d.run(
        0,
        &[switchyard_softgpu::cmd::Command::reduce(
            REDUCE_N as u64,
            guest(REDUCE_X),
            guest(REDUCE_OUT),
        )],
    );
    let got = d.read_f32s(REDUCE_OUT, 1)[0].to_bits();
    match got {
        g if g == gpu => Ran::Gpu,
        g if g == cpu => Ran::Cpu,
        _ => panic!(
            "REDUCE {seed} gave {got:#x}, neither the GPU's sum {gpu:#x} nor the CPU's {cpu:#x}"
        ),
    }
}
