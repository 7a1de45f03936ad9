//! The `cuda` device kind: the softgpu's device (registers, command set, VRAM memfd,
//! recovery) with its commands executed on an NVIDIA GPU.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use switchyard_device::PciDevice;
use switchyard_device::blackbox::RecordSpec;
use switchyard_device::kind::{
    Build, DeviceKind, Host, HostInventory, KindConfig, KindError, KindOptions, Profile, opt,
};
use switchyard_softgpu::accel::Accelerator;
use switchyard_softgpu::{IrqMode, SoftGpu, SoftGpuConfig, SoftGpuKind};

use crate::device::CudaAccel;
use crate::real::CudaGpu;

/// The `cuda` kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct CudaKind;

/// The options of a `cuda` device beyond the softgpu's.
const GPU: &str = "gpu";

/// Why a `cuda` device cannot be built on this host.
#[derive(Debug, thiserror::Error)]
#[error("The GPU `{gpu}` is not usable")]
pub struct GpuUnavailable {
    /// The `gpu` option.
    pub gpu: String,
    /// Why.
    #[source]
    pub source: switchyard_sys::cuda::CudaError,
}

/// A `cuda` device's configuration: the softgpu's device on a GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaConfig {
    /// The device (`vram_mmap` always off).
    pub soft: SoftGpuConfig,
    /// The GPU (the `gpu` option: a UUID, a prefix of one, or an ordinal).
    pub gpu: String,
}

impl CudaKind {
    /// The configuration `options` describe: what [`DeviceKind::configure`] makes of them.
    pub fn config(options: &KindOptions) -> Result<CudaConfig, KindError> {
        let gpu = opt::str(options, GPU)?
            .map(str::trim)
            .filter(|g| !g.is_empty())
            .ok_or_else(|| {
                KindError::option(
                    GPU,
                    "missing: the GPU's UUID (`GPU-…`, see `nvidia-smi -L`) or ordinal",
                )
            })?
            .to_owned();
        if opt::bool(options, "vram_mmap")? == Some(true) {
            return Err(KindError::option(
                "vram_mmap",
                "a cuda board's VRAM has its working copy in GPU memory, which the guest cannot map: it is always off",
            ));
        }
        let mut soft = options.clone();
        soft.remove(GPU);
        soft.insert("vram_mmap".into(), false.into());
        let soft = SoftGpuKind::config(&soft)?;
        Ok(CudaConfig { soft, gpu })
    }

    /// The canonical options of `config` on `gpu`: the softgpu's (`vram_mmap` always off,
    /// so that a softgpu board of the same options is of the same shape) and `gpu`.
    pub fn options(config: &SoftGpuConfig, gpu: &str) -> KindOptions {
        let mut o = SoftGpuKind::options(config);
        o.insert(GPU.into(), gpu.into());
        o
    }
}

/// The GPUs this process opened, by `gpu` option: the partitions of one GPU share it.
/// Protects only the map: a GPU is opened with it held (once per process and GPU, before any
/// device of it exists: nothing else waits on it then).
fn accelerator(gpu: &str) -> Result<Arc<dyn Accelerator>, KindError> {
    static OPEN: Mutex<Option<HashMap<String, Weak<dyn Accelerator>>>> = Mutex::new(None);
    let mut open = OPEN.lock().unwrap_or_else(|p| p.into_inner());
    let map = open.get_or_insert_with(HashMap::new);
    if let Some(a) = map.get(gpu).and_then(Weak::upgrade) {
        return Ok(a);
    }
    let accel: Arc<dyn Accelerator> = match fake_accelerator(gpu) {
        Some(fake) => fake,
        None => {
            let real = CudaGpu::open(gpu).map_err(|source| {
                KindError::build(
                    "cuda",
                    GpuUnavailable {
                        gpu: gpu.to_owned(),
                        source,
                    },
                )
            })?;
            Arc::new(CudaAccel::new(Arc::new(real)))
        }
    };
    map.insert(gpu.to_owned(), Arc::downgrade(&accel));
    Ok(accel)
}

/// Where a `gpu=fake…` board's fake GPU looks for injected faults: `DIR/NAME.lose` (a file
/// there makes it lose the GPU with a sticky error at its next batch).
pub const FAKE_FAULTS_ENV: &str = "SWITCHYARD_FAKE_GPU_FAULTS";

/// Whether a `gpu` option names a fake GPU (`fake`, `fake-NAME`) this build has: one with the
/// `fake-gpu` feature (the test suite's); without it the name is a real GPU's, which no GPU has.
fn is_fake(gpu: &str) -> bool {
    cfg!(any(test, feature = "fake-gpu")) && (gpu == "fake" || gpu.starts_with("fake-"))
}

/// The fake GPU a `gpu` option names ([`is_fake`]), with its faults injected from
/// [`FAKE_FAULTS_ENV`].
#[cfg(any(test, feature = "fake-gpu"))]
fn fake_accelerator(gpu: &str) -> Option<Arc<dyn Accelerator>> {
    if !is_fake(gpu) {
        return None;
    }
    let fake = crate::fake::FakeGpu::new();
    if let Some(dir) = std::env::var_os(FAKE_FAULTS_ENV) {
        fake.state
            .lose_when(std::path::Path::new(&dir).join(format!("{gpu}.lose")));
    }
    Some(Arc::new(CudaAccel::new(Arc::new(fake))))
}

/// A build without the `fake-gpu` feature has no fake GPU.
#[cfg(not(any(test, feature = "fake-gpu")))]
fn fake_accelerator(_gpu: &str) -> Option<Arc<dyn Accelerator>> {
    None
}

/// Runs `gpu`'s commands on its board's GPU.
fn accelerate(gpu: SoftGpu, which: &str) -> Result<Box<dyn PciDevice>, KindError> {
    let accel = accelerator(which)?;
    let gpu = gpu
        .with_accelerator(accel.as_ref())
        .map_err(|e| KindError::build("cuda", e))?;
    // The accelerator lives as long as a device uses it (the device holds its per-device
    // part, which holds the GPU).
    Ok(Box::new(gpu))
}

impl DeviceKind for CudaKind {
    fn name(&self) -> &'static str {
        "cuda"
    }

    fn summary(&self) -> &'static str {
        "The softgpu's device (registers, commands, VRAM) with its commands run on an NVIDIA GPU: COPY/FILL as GPU DMA, SAXPY/REDUCE as kernels, GEMM by cuBLAS"
    }

    fn options_help(&self) -> &'static str {
        "gpu=UUID|N        the GPU (`GPU-…` as `nvidia-smi -L` prints it, a unique prefix, or an ordinal); required\n\
         gpu=fake[-NAME]   the fake GPU instead (a build with the `fake-gpu` feature: the test suite's)\n\
         vram=SIZE         VRAM, a power of two from 1M to 64G (64M): the GPU memory it takes\n\
         queues=N          command queues, 1 to 8 (2): one CUDA stream each\n\
         irq=msix|msi      interrupt mode (msix)\n\
         vram_mmap=off     always off: VRAM's working copy is in GPU memory, which the guest cannot map\n\
         vram_reset=zero|keep  what resets do to VRAM (zero)\n\
         spin=US           longest an engine polls for work before sleeping, 0 to 10000 (200)"
    }

    fn memory_name(&self) -> &'static str {
        "vram"
    }

    fn notes(&self) -> &'static str {
        "`switchyard inventory gpus` lists the GPUs gpu= can name. The guest sees a softgpu: \
         a cuda device moves to and from softgpu boards of the same options.\n\
         irq=msi (one MSI vector, no MSI-X) is for PCIe hot-unplug under QEMU 11.1, whose \
         vfio-user-pci aborts when removing a device with MSI-X."
    }

    fn host_inventory(&self, _host: &Host) -> Option<Result<HostInventory, String>> {
        Some(crate::inventory::host_inventory())
    }

    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError> {
        Ok(Box::new(Self::config(options)?))
    }

    /// The GPU must be there and healthy (NVML when it is installed, else the driver).
    fn probe(&self, options: &KindOptions, _host: &Host) -> Result<Option<String>, String> {
        let c = Self::config(options).map_err(|e| e.to_string())?;
        if is_fake(&c.gpu) {
            return Ok(Some("fake GPU".into()));
        }
        crate::inventory::probe(&c.gpu).map(Some)
    }
}

impl KindConfig for CudaConfig {
    fn options(&self) -> KindOptions {
        CudaKind::options(&self.soft, &self.gpu)
    }

    fn profile(&self) -> Profile {
        let c = &self.soft;
        Profile {
            memory: c.vram_size,
            queues: c.queues,
            partitionable: true,
            // Between `cuda` boards and to or from softgpu boards of the same options: the
            // successor is given the target's GPU (`adopt_successor`), or none.
            movable: true,
            msix: c.irq == IrqMode::Msix,
            host_settings: vec!["spin".into(), GPU.into()],
            presents: Some("softgpu".into()),
            ..Profile::default()
        }
    }

    fn black_box_records(&self) -> Vec<RecordSpec> {
        SoftGpu::black_box_records(&self.soft)
    }

    fn build(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        // The GPU first: a board whose GPU is gone builds nothing.
        accelerator(&self.gpu)?;
        accelerate(SoftGpuKind::build_device(self.soft, b)?, &self.gpu)
    }

    /// The successor a move built (a softgpu on the new VRAM) runs on this board's GPU.
    fn adopt_successor(&self, device: &mut dyn PciDevice) -> Result<(), KindError> {
        let accel = accelerator(&self.gpu)?;
        let soft = device
            .as_any_mut()
            .downcast_mut::<SoftGpu>()
            .ok_or_else(|| KindError::Option {
                field: None,
                message: "a cuda board takes only a softgpu's device".into(),
            })?;
        soft.set_accelerator(accel.as_ref())
            .map_err(|e| KindError::build("cuda", e))
    }

    fn recover(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        accelerator(&self.gpu)?;
        accelerate(SoftGpuKind::recover_device(self.soft, b)?, &self.gpu)
    }
}
