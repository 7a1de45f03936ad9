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

use super::driver::Driver;
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
