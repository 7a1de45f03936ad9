//! VRAM: a memfd mapped once into the server, shared with the client through BAR2's mmap area.
//!
//! The device only touches VRAM through `vm-memory` volatile slices; no Rust reference ever
//! points into it (the client writes it concurrently through its own mapping).

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock, Weak};

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, MmapRegion, VolatileMemory, VolatileSlice};

use crate::SoftGpuError;
use crate::accel::AccelDevice;
use crate::identity::VramRef;

/// A slice of VRAM.
pub(crate) type VramSlice<'a> = VolatileSlice<'a, ()>;

pub(crate) struct Vram {
    file: Arc<File>,
    region: MmapRegion<()>,
    size: u64,
    identity: VramRef,
    /// One bit per 4 KiB page, set after every write the device makes or serves (engine
    /// results, trapped BAR2 writes, zeroing): complete only while the client cannot map
    /// VRAM (`tracked`).
    written: Box<[AtomicU64]>,
    tracked: bool,
    /// The memory failed (an injected `vram` fault): the device reaches it no more.
    failed: AtomicBool,
    /// The accelerator of the device on this VRAM, told of writes it did not make (see
    /// `crate::accel`). Weak: VRAM belongs to the slot and outlives its devices.
    watcher: RwLock<Option<Weak<dyn AccelDevice>>>,
}

/// Page size of the write log.
pub(crate) const LOG_PAGE: u64 = 4096;

impl std::fmt::Debug for Vram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vram")
            .field("identity", &self.identity)
            .finish()
    }
}

impl Vram {
    /// Creates a zero-filled sealed memfd of `size` bytes (it can be neither shrunk nor grown,
    /// so a client cannot make our mapping fault by truncating it).
    pub(crate) fn create(size: u64, tracked: bool) -> Result<Vram, SoftGpuError> {
        let mfd = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .close_on_exec(true)
            .create("switchyard-softgpu-vram")
            .map_err(|e| SoftGpuError::Vram(std::io::Error::other(e)))?;
        mfd.as_file().set_len(size).map_err(SoftGpuError::Vram)?;
        mfd.add_seals(&[
            memfd::FileSeal::SealShrink,
            memfd::FileSeal::SealGrow,
            memfd::FileSeal::SealSeal,
        ])
        .map_err(|e| SoftGpuError::Vram(std::io::Error::other(e)))?;
        Self::adopt(Arc::new(mfd.into_file()), size, tracked)
    }

    /// Maps an existing backing file (for a device that replaces another one and must keep the
    /// memory object the client has mmapped).
    pub(crate) fn adopt(file: Arc<File>, size: u64, tracked: bool) -> Result<Vram, SoftGpuError> {
        let meta = file.metadata().map_err(SoftGpuError::Vram)?;
        if meta.len() != size {
            return Err(SoftGpuError::VramSize {
                expected: size,
                actual: meta.len(),
            });
        }
        let len = usize::try_from(size).map_err(|_| SoftGpuError::VramSize {
            expected: size,
            actual: meta.len(),
        })?;
        let region = MmapRegionBuilder::<()>::new(len)
            .with_file_offset(FileOffset::from_arc(file.clone(), 0))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
            .build()
            .map_err(SoftGpuError::VramMap)?;
        let words = (size / LOG_PAGE).div_ceil(64);
        Ok(Vram {
            file,
            region,
            size,
            identity: VramRef {
                size,
                dev: meta.dev(),
                ino: meta.ino(),
            },
            written: (0..words).map(|_| AtomicU64::new(0)).collect(),
            tracked,
            failed: AtomicBool::new(false),
            watcher: RwLock::new(None),
        })
    }

    /// Marks the memory failed, for good (every device on it: it is the board's memory).
    /// Returns whether it was usable until now.
    pub(crate) fn fail(&self) -> bool {
        !self.failed.swap(true, Ordering::SeqCst)
    }

    /// Whether the memory is usable (not [failed](Vram::fail)).
    pub(crate) fn usable(&self) -> bool {
        !self.failed.load(Ordering::SeqCst)
    }

    /// `Ok` while the memory is usable, else the error a device access to it gets (`EIO`).
    pub(crate) fn check(&self) -> std::io::Result<()> {
        if self.usable() {
            Ok(())
        } else {
            Err(std::io::Error::from_raw_os_error(libc::EIO))
        }
    }

    /// Whether every write to VRAM goes through the device (the client cannot map it), so
    /// the write log is complete.
    pub(crate) fn tracked(&self) -> bool {
        self.tracked
    }

    /// Logs a write of `len` bytes at `offset` (clamped to VRAM). Call after the write.
    pub(crate) fn mark(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.size);
        if len == 0 || offset >= end {
            return;
        }
        let (first, last) = (offset / LOG_PAGE, (end - 1) / LOG_PAGE);
        for w in first / 64..=last / 64 {
            let lo = if w == first / 64 { first % 64 } else { 0 };
            let hi = if w == last / 64 { last % 64 } else { 63 };
            let bits = (u64::MAX >> (63 - hi)) & (u64::MAX << lo);
            if let Some(word) = self.written.get(w as usize)
                && word.load(Ordering::Relaxed) & bits != bits
            {
                word.fetch_or(bits, Ordering::Release);
            }
        }
    }

    /// Makes `accel` the one told of writes to VRAM it does not make ([`Vram::host_wrote`]).
    pub(crate) fn watch(&self, accel: &Arc<dyn AccelDevice>) {
        *self.watcher.write().unwrap_or_else(|p| p.into_inner()) = Some(Arc::downgrade(accel));
    }

    /// `[offset, offset+len)` was written by the server itself (a trapped BAR2 write,
    /// zeroing, a migration's restore, the CPU path of a command): an accelerator's copy of
    /// it is stale. Call after the write.
    pub(crate) fn host_wrote(&self, offset: u64, len: u64) {
        let watcher = self.watcher.read().unwrap_or_else(|p| p.into_inner());
        if let Some(accel) = watcher.as_ref().and_then(Weak::upgrade) {
            accel.host_wrote(offset, len);
        }
    }

    /// Takes (reads and clears) word `index` of the write log: bit `i` is page
    /// `64 * index + i`.
    pub(crate) fn take_written(&self, index: usize) -> u64 {
        self.written
            .get(index)
            .map_or(0, |w| w.swap(0, Ordering::AcqRel))
    }

    /// Reads word `index` of the write log without clearing it.
    pub(crate) fn peek_written(&self, index: usize) -> u64 {
        self.written
            .get(index)
            .map_or(0, |w| w.load(Ordering::Acquire))
    }

    /// Puts bits taken with [`Vram::take_written`] back.
    pub(crate) fn restore_written(&self, index: usize, bits: u64) {
        if let Some(w) = self.written.get(index) {
            w.fetch_or(bits, Ordering::Release);
        }
    }

    /// Number of words in the write log.
    pub(crate) fn written_words(&self) -> usize {
        self.written.len()
    }

    pub(crate) fn file(&self) -> &Arc<File> {
        &self.file
    }

    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    pub(crate) fn identity(&self) -> VramRef {
        self.identity
    }

    /// Whether `[offset, offset+len)` lies inside VRAM.
    pub(crate) fn contains(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.size)
    }

    /// The slice `[offset, offset+len)`, or `None` if it is out of range or the memory
    /// [failed](Vram::fail).
    pub(crate) fn slice(&self, offset: u64, len: u64) -> Option<VramSlice<'_>> {
        if !self.contains(offset, len) || !self.usable() {
            return None;
        }
        let off = usize::try_from(offset).ok()?;
        let len = usize::try_from(len).ok()?;
        self.region.get_slice(off, len).ok()
    }

    /// Zeroes all of VRAM: punches a hole (releasing the memory), or writes zeros if the
    /// backing file does not support that or an accelerator has its pages pinned.
    pub(crate) fn zero(&self) {
        self.zero_range(0, self.size);
    }

    /// Zeroes `[offset, offset+len)` (clamped to VRAM) like [`Vram::zero`]. While an
    /// accelerator watches VRAM it holds the file's pages pinned (a GPU registration: no MMU
    /// notifier); a hole would give the file new pages and leave the GPU's write-through on
    /// the old ones, so the pages are kept and written with zeros.
    pub(crate) fn zero_range(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.size);
        if offset >= end {
            return;
        }
        let pinned = self
            .watcher
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .as_ref()
            .is_some_and(|w| w.strong_count() > 0);
        let punched = if pinned {
            Err(std::io::Error::other("an accelerator has the pages pinned"))
        } else {
            vmm_sys_util::fallocate::fallocate(
                &*self.file,
                vmm_sys_util::fallocate::FallocateMode::PunchHole,
                true,
                offset,
                end - offset,
            )
            .map_err(std::io::Error::from)
        };
        if let Err(e) = punched {
            tracing::debug!(error = %e, "not punching a hole into VRAM; writing zeros");
            const CHUNK: u64 = 1 << 20;
            let zeros = vec![0u8; CHUNK as usize];
            let mut off = offset;
            while off < end {
                let n = CHUNK.min(end - off);
                if let Some(s) = self.slice(off, n) {
                    s.copy_from(&zeros[..n as usize]);
                }
                off += n;
            }
        }
        self.mark(offset, end - offset);
        self.host_wrote(offset, end - offset);
    }
}
