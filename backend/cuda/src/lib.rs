//! The `cuda` board: a device kind whose devices are the softgpu's (the same registers,
//! command set, VRAM memfd, black box, recovery and failover; the in-guest driver and every
//! client work unchanged) with their commands executed on an NVIDIA GPU.
//!
//! - [`CudaKind`]: the kind (`model = "cuda"`, `gpu = "GPU-…"`, several partitions per GPU).
//! - [`device`]: the [`Accelerator`](switchyard_softgpu::accel::Accelerator) of a GPU: guest
//!   windows registered with the GPU as they are mapped, VRAM's working copy in GPU memory
//!   written through to the authoritative memfd, one stream per queue, a lost board latched.
//! - [`gpu::Gpu`]: what the backend needs of a GPU: [`real::CudaGpu`] (the CUDA driver,
//!   NVRTC and cuBLAS, loaded at run time through `switchyard-sys`) or, in CI and tests,
//!   `fake::FakeGpu` (only in tests and in a build with the `fake-gpu` feature: a board's
//!   `gpu=fake`, the test suite's worker processes run boards on it).
//! - [`inventory`]: the host's GPUs through NVML (loaded at run time), else the driver.
//!
//! Nothing here needs CUDA to build; a host without a driver or GPU reports the board
//! unavailable with the reason.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod device;
#[cfg(any(test, feature = "fake-gpu"))]
pub mod fake;
pub mod gpu;
pub mod inventory;
mod kind;
pub mod real;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_gpu;
#[cfg(test)]
mod tests_kind;

pub use kind::{CudaConfig, CudaKind, FAKE_FAULTS_ENV, GpuUnavailable};
