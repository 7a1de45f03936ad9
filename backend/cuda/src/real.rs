//! The real GPU: the CUDA driver through `switchyard_sys::cuda`.

use std::sync::Arc;

use switchyard_sys::cuda::{self, CudaError};
use vm_memory::MmapRegion;

use crate::gpu::{Gpu, GpuError, Mem, Offload, Op};

/// An NVIDIA GPU opened through the CUDA driver.
#[derive(Debug, Clone)]
pub struct CudaGpu {
    gpu: Arc<cuda::Gpu>,
}

impl CudaGpu {
    /// Opens the GPU `which` (UUID, a unique prefix of it, or ordinal).
    pub fn open(which: &str) -> Result<Self, CudaError> {
        Ok(Self {
            gpu: cuda::Gpu::open(which)?,
        })
    }

    /// What the driver says of it.
    pub fn info(&self) -> &cuda::GpuInfo {
        self.gpu.info()
    }
}

fn gpu_error(e: CudaError) -> GpuError {
    GpuError {
        message: e.to_string(),
        sticky: e.sticky,
        ran: Some(0),
    }
}

fn mem<'a>(m: Mem<'a, CudaGpu>) -> cuda::Mem<'a> {
    match m {
        Mem::Host(h, off) => cuda::Mem::Host(h, off),
        Mem::Dev(d, off) => cuda::Mem::Device(d, off),
    }
}

impl Gpu for CudaGpu {
    type Host = cuda::HostMemory;
    type Buf = cuda::DeviceMemory;
    type Stream = cuda::Stream;

    fn describe(&self) -> String {
        let i = self.gpu.info();
        format!(
            "cuda {} ({}, kernels: {})",
            i.uuid,
            i.name,
            self.gpu.kernel_image()
        )
    }

    fn offload(&self) -> Offload {
        // The host's libraries, and whether this GPU's kernels did load.
        Offload {
            no_kernels: self.gpu.kernels_missing().map(ToString::to_string),
            ..crate::inventory::offload_here()
        }
    }

    fn register(&self, region: Arc<MmapRegion<()>>) -> Result<Self::Host, GpuError> {
        self.gpu.register(region).map_err(gpu_error)
    }

    fn alloc(&self, len: usize) -> Result<Self::Buf, GpuError> {
        self.gpu.alloc(len).map_err(gpu_error)
    }

    fn stream(&self) -> Result<Self::Stream, GpuError> {
        self.gpu.stream().map_err(gpu_error)
    }

    fn run(&self, stream: &Self::Stream, ops: &[Op<'_, Self>]) -> Result<(), GpuError> {
        let ops: Vec<cuda::Op<'_>> = ops
            .iter()
            .map(|op| match *op {
                Op::Copy { dst, src, len } => cuda::Op::Copy {
                    dst: mem(dst),
                    src: mem(src),
                    len,
                },
                Op::WriteBack { dst, src, len } => cuda::Op::WriteBack {
                    dst: mem(dst),
                    src: mem(src),
                    len,
                },
                Op::Fill32 { dst, words, value } => cuda::Op::Fill32 {
                    dst: mem(dst),
                    words,
                    value,
                },
                Op::Saxpy { a, x, y, n } => cuda::Op::Saxpy {
                    a,
                    x: mem(x),
                    y: mem(y),
                    n,
                },
                Op::Reduce { x, n, out, partial } => cuda::Op::Reduce {
                    x: mem(x),
                    n,
                    out: mem(out),
                    partial: mem(partial),
                },
                Op::Gemm { m, n, k, a, b, c } => cuda::Op::Gemm {
                    m,
                    n,
                    k,
                    a: mem(a),
                    b: mem(b),
                    c: mem(c),
                },
            })
            .collect();
        stream
            .run(&ops)
            .map_err(|e| gpu_error(e.error).after(e.ran))
    }
}
