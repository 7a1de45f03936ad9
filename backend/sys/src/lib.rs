//! The one crate of Switchyard that contains `unsafe` code; every other crate is
//! `#![forbid(unsafe_code)]`.
//!
//! What lives here is what no library in the field offers as a safe API:
//!
//! - [`DmaMapping`]: memory mapped into a VFIO IOMMU domain, **owned together with its
//!   mapping**. `VFIO_IOMMU_MAP_DMA` lets a device read and write the memory at any time, so
//!   `vfio-ioctls` rightly makes `VfioOps::vfio_dma_map` an `unsafe fn`: nothing stops the
//!   caller from freeing the memory while the device still reaches it. A `DmaMapping` holds the
//!   memory and the IOMMU (an `Arc`, so the container outlives it), and when it is dropped it
//!   removes the IOMMU mapping *before* it releases the memory; if the unmap fails, the memory
//!   is leaked on purpose (a leak is safe, a freed page the device can still write is not).
//!   [`DmaMapping::new_read_only`] maps memory the device may only read (a raw
//!   `VFIO_IOMMU_MAP_DMA` with the read flag: `vfio-ioctls` maps read/write only). The
//!   CPU only reaches the memory through vm-memory's volatile accessors, never as a Rust
//!   reference, because the device may write it concurrently.
//! - [`dup_device_fd`]: an owned duplicate of a `VfioDevice`'s descriptor (the crate exposes
//!   only `AsRawFd`), for positioned reads and writes of its regions.
//! - [`set_irq_eventfds`], [`disable_irq`], [`reset_device`]: `VFIO_DEVICE_SET_IRQS` for any
//!   vector range with any mix of eventfds and detached vectors (what a vfio-user client's
//!   `SET_IRQS` asks for; `vfio-ioctls` only enables whole indexes from vector 0), and a reset
//!   that reports its error.
//! - [`sock`]: `SO_PEEK_OFF`, which rustix does not wrap: the kernel's count of peeked,
//!   unconsumed bytes, with which a replacement server process learns whether the killed one
//!   consumed what it had journaled.
//! - [`alloc_count`]: a global allocator that counts a thread's allocations, for the tests
//!   that check a hot path does not allocate (a `GlobalAlloc` is an `unsafe impl`).
//!
//! Users: the in-guest drivers (`guest-tests/driver`, `sy-edu` in `guest-tests/nested`) map
//! their DMA windows with it, so every guest test exercises this code against a real IOMMU
//! (the guest's `intel-iommu`); the passthrough backend maps the client's memory into a
//! physical device's IOMMU with it; the server reads `SO_PEEK_OFF` with it (crash continuity).
//!
//! Every `unsafe` block carries a `// SAFETY:` comment (`clippy::undocumented_unsafe_blocks`
//! is denied in the workspace).

#![deny(unsafe_op_in_unsafe_fn)]

pub mod alloc_count;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod inherit;
pub mod sock;
mod vfio;

pub use vfio::{DmaMapping, Error, disable_irq, dup_device_fd, reset_device, set_irq_eventfds};
