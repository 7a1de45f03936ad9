//! The doorbell page: BAR0 `0x8000..0x9000`, memory shared by the guest (which writes queue
//! tails into it) and the engines (which poll them). See the crate documentation, "Mapped
//! doorbells", for the protocol.
//!
//! The backing is a memfd the size of BAR0 up to the end of the page (the sparse mmap area's
//! file offset is its BAR0 offset, as VFIO defines it); only the page itself is ever touched
//! and the hole before it costs nothing. It is sealed against shrinking and growing, so a
//! client that is handed the descriptor cannot make the device's mapping fault. The device
//! touches the page only through `vm-memory` atomic accesses: the guest writes it
//! concurrently, no Rust reference ever points into it.

use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{Bytes, FileOffset, MmapRegion, VolatileMemory};

use crate::SoftGpuError;
use crate::identity::VramRef;
use crate::regs::{DB_NEED_KICK, DB_STRIDE, DB_TAIL, DOORBELL_PAGE, DOORBELL_PAGE_SIZE};

/// The slot's memory object holding the doorbell page (see
/// [`switchyard_device::DeviceContext::memory`]).
pub(crate) const DOORBELL_OBJECT: &str = "softgpu.doorbells";

/// Size of the backing file: BAR0 up to the end of the page.
pub(crate) const BACKING_SIZE: u64 = DOORBELL_PAGE + DOORBELL_PAGE_SIZE;

pub(crate) struct DoorbellPage {
    file: Arc<File>,
    page: MmapRegion<()>,
    identity: VramRef,
}

impl std::fmt::Debug for DoorbellPage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DoorbellPage")
            .field("identity", &self.identity)
            .finish()
    }
}

fn io(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> SoftGpuError {
    SoftGpuError::Doorbells(std::io::Error::other(e))
}

impl DoorbellPage {
    /// A new, zeroed page in a sealed memfd.
    pub(crate) fn create() -> Result<DoorbellPage, SoftGpuError> {
        let mfd = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .close_on_exec(true)
            .create("switchyard-softgpu-doorbells")
            .map_err(io)?;
        mfd.as_file()
            .set_len(BACKING_SIZE)
            .map_err(SoftGpuError::Doorbells)?;
        mfd.add_seals(&[
            memfd::FileSeal::SealShrink,
            memfd::FileSeal::SealGrow,
            memfd::FileSeal::SealSeal,
        ])
        .map_err(io)?;
        Self::adopt(Arc::new(mfd.into_file()))
    }

    /// Maps the page of an existing backing (a replacement process continuing the page the
    /// guest mapped). It must be sealed against shrinking and growing, of [`BACKING_SIZE`]
    /// bytes.
    pub(crate) fn adopt(file: Arc<File>) -> Result<DoorbellPage, SoftGpuError> {
        let seals = rustix::fs::fcntl_get_seals(&*file).map_err(|e| io(std::io::Error::from(e)))?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW) {
            return Err(io(format!(
                "the doorbell backing is not sealed against shrinking and growing ({seals:?})"
            )));
        }
        let identity = VramRef::of(&file).map_err(SoftGpuError::Doorbells)?;
        if identity.size != BACKING_SIZE {
            return Err(io(format!(
                "the doorbell backing has {} bytes, expected {BACKING_SIZE}",
                identity.size
            )));
        }
        let page = MmapRegionBuilder::<()>::new(DOORBELL_PAGE_SIZE as usize)
            .with_file_offset(FileOffset::from_arc(file.clone(), DOORBELL_PAGE))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_SHARED)
            .build()
            .map_err(io)?;
        Ok(DoorbellPage {
            file,
            page,
            identity,
        })
    }

    pub(crate) fn file(&self) -> &Arc<File> {
        &self.file
    }

    pub(crate) fn identity(&self) -> VramRef {
        self.identity
    }

    fn word(q: usize, reg: u64) -> usize {
        q * DB_STRIDE as usize + reg as usize
    }

    /// Queue `q`'s `DB_TAIL` (0 for a queue beyond the page).
    pub(crate) fn tail(&self, q: usize) -> u32 {
        self.load(Self::word(q, DB_TAIL), Ordering::Acquire)
    }

    /// Stores queue `q`'s `DB_TAIL`.
    pub(crate) fn set_tail(&self, q: usize, tail: u32) {
        self.store(Self::word(q, DB_TAIL), tail, Ordering::SeqCst);
    }

    /// Sets or clears queue `q`'s `DB_NEED_KICK`.
    pub(crate) fn set_need_kick(&self, q: usize, on: bool) {
        self.store(Self::word(q, DB_NEED_KICK), u32::from(on), Ordering::SeqCst);
    }

    /// The 32-bit word at page offset `off` (4-byte aligned, inside the page; else 0).
    pub(crate) fn load(&self, off: usize, order: Ordering) -> u32 {
        self.page.as_volatile_slice().load(off, order).unwrap_or(0)
    }

    /// Stores the 32-bit word at page offset `off` (4-byte aligned, inside the page; else
    /// nothing).
    pub(crate) fn store(&self, off: usize, v: u32, order: Ordering) {
        // Out of range or misaligned: the callers check; nothing to store.
        let _ = self.page.as_volatile_slice().store(v, off, order);
    }

    /// Zeroes the page (a device reset).
    pub(crate) fn clear(&self) {
        for off in (0..DOORBELL_PAGE_SIZE as usize).step_by(4) {
            self.store(off, 0, Ordering::Relaxed);
        }
        fence(Ordering::SeqCst);
    }
}
