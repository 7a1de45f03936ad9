//! The DMA space: the client's DMA windows as the device sees them.
//!
//! Every `DMA_MAP` the client sends becomes one mapping keyed by IOVA. A map that carries a
//! file descriptor is mmapped once (through `vm-memory`, so accesses are volatile and no Rust
//! reference ever points into guest memory) and gets a [`DirtyLog`](crate::dirty::DirtyLog) that records every write
//! the device makes, for DMA dirty logging (`DMA_LOGGING_*`, `DMA_UNMAP` with a bitmap). A map
//! without a descriptor is reachable only through messages: the server installs a
//! [`RemoteDma`] that turns accesses into `DMA_READ` / `DMA_WRITE` commands to the client.
//!
//! **Memory that changes under us.** The client owns the files it maps and may shrink them
//! (`ftruncate`), punch holes into a hugetlbfs file with no free huge pages, or hand us a
//! sparse file on a full filesystem: a plain load or store into such a mapping raises SIGBUS
//! and would kill the server. So a window is accessed directly only when that cannot happen:
//! a memfd on the kernel's internal shmem mount (no size limit) sealed with `F_SEAL_SHRINK`
//! (QEMU's `memory-backend-memfd` seals by default). Every other window is *guarded*: the
//! kernel copies its bytes, and reports a page it cannot have as an error instead of a signal.
//! Unsealed memfds (cloud-hypervisor's guest RAM) and tmpfs/ext4 files are read and written
//! with `pread`/`pwrite` on the file (a write is first checked against the file's size, as a
//! `pwrite` past the end would grow the file); hugetlbfs files, which have no `write`, through
//! `/proc/self/mem` at the window's address. The access then fails like any bad address
//! ([`DmaError::Fault`], `EFAULT`): the device reports a DMA error, the server keeps serving.
//! Guarded windows cost a system call per 64 KiB; measured in the bench.
//!
//! **Descriptors and mappings.** Windows of one memory object (QEMU behind a vIOMMU maps guest
//! RAM page by page, each `DMA_MAP` with its own copy of the same descriptor) share one mapping
//! of the whole file and one open file: the duplicates the client sent are closed as soon as
//! the window is mapped, and mapping a page costs no `mmap`. Files over 64 GiB are mapped per
//! window instead (address space is finite).
//!
//! **Dirty-log memory.** Logs are allocated when logging starts (or when a window is mapped
//! while it runs), fallibly, and all of them together are bounded by a budget
//! ([`DmaSpace::set_log_budget`], default [`DEFAULT_LOG_BUDGET`]): beyond it, starting the
//! session or mapping the window is refused with `ENOMEM` and nothing changes.
//!
//! Accesses are checked against the window's permissions and bounds before anything is touched:
//! an access that is not fully covered by mappings with the right permission fails with
//! [`DmaError`] and writes nothing, so a bad address a guest driver programs can never become a
//! wild write.
//!
//! Concurrency: engines access the space under a read lock held for one access; map and unmap
//! take the write lock, so an unmap returns only once no access into the old window is in flight
//! (the spec requires the server to drop every reference before replying to `DMA_UNMAP`).

use std::fmt;
use std::fs::File;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use vm_memory::VolatileSlice;
use vm_memory::bitmap::BitmapSlice;

mod backing;
mod log;
mod remote;
#[cfg(test)]
mod tests;

pub use crate::DmaProt;
pub use crate::dirty::DIRTY_PAGE_SIZE;
use crate::{DirtySource, DmaObserver};
pub use backing::MAP_BUDGET;
use backing::{Access, FdWindow, Objects, guarded_piece};
pub use log::DEFAULT_LOG_BUDGET;
use log::LogState;
pub use remote::RemoteDma;

/// A volatile view of directly mapped DMA memory.
type DmaSlice<'a> = VolatileSlice<'a, ()>;

/// One contiguous piece of a DMA access, handed to access callbacks in address order.
#[derive(Debug)]
enum Piece<'a> {
    /// Directly mapped guest memory.
    Mem(DmaSlice<'a>),
    /// A bounce buffer for a message-only window: filled from the client before a read
    /// callback, sent to the client after a write callback.
    Bounce(&'a mut [u8]),
}

impl Piece<'_> {
    /// Length of the piece in bytes.
    pub fn len(&self) -> usize {
        match self {
            Piece::Mem(s) => s.len(),
            Piece::Bounce(b) => b.len(),
        }
    }

    /// Copies the piece into `dst` (which must be at least as long).
    pub fn copy_to(&self, dst: &mut [u8]) {
        match self {
            Piece::Mem(s) => {
                s.copy_to(dst);
            }
            Piece::Bounce(b) => {
                let n = b.len().min(dst.len());
                if let (Some(d), Some(s)) = (dst.get_mut(..n), b.get(..n)) {
                    d.copy_from_slice(s);
                }
            }
        }
    }

    /// Fills the piece from `src`.
    pub fn copy_from(&mut self, src: &[u8]) {
        match self {
            Piece::Mem(s) => s.copy_from(src),
            Piece::Bounce(b) => {
                let n = b.len().min(src.len());
                if let (Some(d), Some(s)) = (b.get_mut(..n), src.get(..n)) {
                    d.copy_from_slice(s);
                }
            }
        }
    }

    /// Copies the piece into device memory.
    pub fn copy_to_volatile<S: BitmapSlice>(&self, dst: VolatileSlice<'_, S>) {
        match self {
            Piece::Mem(s) => s.copy_to_volatile_slice(dst),
            Piece::Bounce(b) => dst.copy_from(b),
        }
    }

    /// Fills the piece from device memory.
    pub fn copy_from_volatile<S: BitmapSlice>(&mut self, src: VolatileSlice<'_, S>) {
        match self {
            Piece::Mem(s) => src.copy_to_volatile_slice(*s),
            Piece::Bounce(b) => {
                src.copy_to(b);
            }
        }
    }
}

/// Errors of DMA space operations.
#[derive(Debug, thiserror::Error)]
pub enum DmaError {
    /// The requested window overlaps an existing one.
    #[error("DMA window {iova:#x}+{size:#x} overlaps an existing mapping")]
    Overlap {
        /// Start of the requested window.
        iova: u64,
        /// Size of the requested window.
        size: u64,
    },
    /// The window is empty or wraps around the address space.
    #[error("DMA window {iova:#x}+{size:#x} is empty or wraps")]
    BadWindow {
        /// Start of the requested window.
        iova: u64,
        /// Size of the requested window.
        size: u64,
    },
    /// The device's [`DmaObserver`] refused the window.
    #[error("The device refused the DMA window")]
    Observer(#[source] Box<crate::DeviceError>),
    /// An unmap range cuts through a window.
    #[error("Unmap range {iova:#x}+{size:#x} splits a DMA mapping")]
    PartialUnmap {
        /// Start of the requested range.
        iova: u64,
        /// Size of the requested range.
        size: u64,
    },
    /// Too many simultaneous mappings.
    #[error("Too many DMA mappings (limit {limit})")]
    TooManyMappings {
        /// The configured limit.
        limit: usize,
    },
    /// Mapping the client's file descriptor failed.
    #[error("Cannot mmap the DMA window at {iova:#x}")]
    Mmap {
        /// Start of the window.
        iova: u64,
        /// The underlying error.
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    /// The client's file descriptor cannot be inspected.
    #[error("Cannot inspect the file of the DMA window at {iova:#x}")]
    Backing {
        /// Start of the window.
        iova: u64,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The descriptor is not a file that can back DMA memory.
    #[error("The file of the DMA window at {iova:#x} cannot back DMA memory: {what}")]
    UnsupportedBacking {
        /// Start of the window.
        iova: u64,
        /// What the file is.
        what: String,
    },
    /// The window needs the fault-safe access path and this process cannot open it.
    #[error("DMA window at {iova:#x} is not a sealed memfd and /proc/self/mem is unavailable")]
    NoSafeAccess {
        /// Start of the window.
        iova: u64,
    },
    /// The client's memory could not be read or written (truncated file, no page to back a
    /// hole): the kernel refused to fault the page in.
    #[error("DMA access at {iova:#x} hit memory the client's file no longer backs")]
    Fault {
        /// Start of the failing chunk.
        iova: u64,
    },
    /// The dirty logs would exceed their memory budget.
    #[error("Dirty logging needs {need} more bytes of bitmaps, over the budget of {budget}")]
    LogBudget {
        /// Bytes the logs would need in all.
        need: u64,
        /// The budget.
        budget: u64,
    },
    /// Memory for a dirty log could not be allocated.
    #[error("Cannot allocate a dirty log")]
    LogAlloc(#[source] std::collections::TryReserveError),
    /// An access touched an address outside every mapping.
    #[error("DMA access at {iova:#x} is outside every mapping")]
    Unmapped {
        /// First address that is not mapped.
        iova: u64,
    },
    /// An access needed a permission the mapping does not grant.
    #[error("DMA {access} at {iova:#x} is not permitted by its mapping")]
    Permission {
        /// First address that lacks the permission.
        iova: u64,
        /// `"read"` or `"write"`.
        access: &'static str,
    },
    /// The address range of an access wraps around.
    #[error("DMA access at {iova:#x} of {len:#x} bytes wraps")]
    Overflow {
        /// Start of the access.
        iova: u64,
        /// Length of the access.
        len: u64,
    },
    /// A message-based access through the client failed.
    #[error("DMA through the client at {iova:#x} failed with errno {errno}")]
    Remote {
        /// Start of the failing chunk.
        iova: u64,
        /// The errno the transport reported.
        errno: i32,
    },
    /// Dirty logging was asked for with an unusable page size.
    #[error("Dirty page size {0:#x} is not a power of two multiple of 4 KiB")]
    BadPageSize(u64),
    /// A dirty report was asked for outside a logging session.
    #[error("DMA dirty logging is not started")]
    NotLogging,
    /// Logging was started twice.
    #[error("DMA dirty logging is already started")]
    LoggingActive,
    /// The buffer for a dirty bitmap is too small.
    #[error("Dirty bitmap needs {need} bytes, the request has room for {room}")]
    BitmapTooSmall {
        /// Bytes the bitmap needs.
        need: u64,
        /// Bytes available.
        room: usize,
    },
}

impl DmaError {
    /// The errno that best describes this error on the wire.
    pub fn errno(&self) -> i32 {
        match self {
            DmaError::Overlap { .. } => libc::EEXIST,
            DmaError::BadWindow { .. }
            | DmaError::BadPageSize(_)
            | DmaError::NotLogging
            | DmaError::BitmapTooSmall { .. }
            | DmaError::PartialUnmap { .. } => libc::EINVAL,
            DmaError::LoggingActive => libc::EBUSY,
            DmaError::TooManyMappings { .. } => libc::ENOSPC,
            DmaError::Mmap { source, .. } => match source {
                vm_memory::mmap::MmapRegionError::Mmap(e) => {
                    e.raw_os_error().unwrap_or(libc::ENOMEM)
                }
                _ => libc::EINVAL,
            },
            DmaError::Backing { source, .. } => source.raw_os_error().unwrap_or(libc::EINVAL),
            DmaError::NoSafeAccess { .. } => libc::ENOTSUP,
            DmaError::UnsupportedBacking { .. } => libc::EINVAL,
            DmaError::Observer(e) => e.errno(),
            DmaError::LogBudget { .. } | DmaError::LogAlloc(_) => libc::ENOMEM,
            DmaError::Unmapped { .. } | DmaError::Overflow { .. } | DmaError::Fault { .. } => {
                libc::EFAULT
            }
            DmaError::Permission { .. } => libc::EPERM,
            DmaError::Remote { errno, .. } => *errno,
        }
    }
}

/// Result type of DMA operations.
pub type Result<T> = std::result::Result<T, DmaError>;

enum Backing {
    Fd(Arc<FdWindow>),
    Message,
}

/// One DMA window.
struct Mapping {
    iova: u64,
    size: u64,
    prot: DmaProt,
    backing: Backing,
}

impl Mapping {
    fn end(&self) -> u64 {
        // Cannot overflow: checked when the mapping was created.
        self.iova + self.size
    }
}

/// A summary of one window, for logs, tests and later migration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MappingInfo {
    /// Start IOVA.
    pub iova: u64,
    /// Size in bytes.
    pub size: u64,
    /// Permissions.
    pub prot: DmaProt,
    /// Whether the window is mmapped (fd-backed) or message-only.
    pub mmapped: bool,
    /// Whether an fd-backed window is accessed with loads and stores (a sealed memfd) rather
    /// than through the fault-safe path.
    pub direct: bool,
}

/// A window and its backing file ([`DmaSpace::window_backing`]).
#[derive(Debug)]
pub struct WindowBacking {
    /// Start IOVA.
    pub iova: u64,
    /// Size in bytes.
    pub size: u64,
    /// Permissions.
    pub prot: DmaProt,
    /// The backing file (a duplicate descriptor).
    pub file: File,
    /// Offset of the window's first byte in the file.
    pub offset: u64,
}

#[derive(Default)]
struct Table {
    /// Sorted by IOVA, non-overlapping.
    maps: Vec<Mapping>,
}

impl Table {
    /// Index of the mapping containing `iova`, if any.
    fn find(&self, iova: u64) -> Option<&Mapping> {
        let idx = self.maps.partition_point(|m| m.iova <= iova);
        let m = self.maps.get(idx.checked_sub(1)?)?;
        (iova < m.end()).then_some(m)
    }
}

/// The client's DMA windows, shared between the server (which maps and unmaps) and the device's
/// engines (which access them).
pub struct DmaSpace {
    table: RwLock<Table>,
    remote: RwLock<Option<Arc<dyn RemoteDma>>>,
    log: Mutex<LogState>,
    objects: Mutex<Objects>,
    /// Bytes of dirty logs allocated (changed under the table's write lock).
    log_bytes: AtomicU64,
    log_budget: AtomicU64,
    max_maps: usize,
    /// The device's observer of maps and unmaps ([`DmaObserver`]).
    observer: RwLock<Option<Arc<dyn DmaObserver>>>,
    /// Dirty bits the device tracks itself ([`DirtySource`]).
    dirty_source: RwLock<Option<Arc<dyn DirtySource>>>,
}

impl fmt::Debug for DmaSpace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DmaSpace")
            .field("mappings", &self.mappings())
            .field("max_maps", &self.max_maps)
            .field("logging", &self.logging())
            .finish()
    }
}

impl Default for DmaSpace {
    fn default() -> Self {
        Self::new(65535)
    }
}

/// What an access wants to do with the memory.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Dir {
    Read,
    Write,
}

impl DmaSpace {
    /// Creates an empty space allowing at most `max_maps` simultaneous windows.
    pub fn new(max_maps: usize) -> Self {
        Self {
            table: RwLock::new(Table::default()),
            remote: RwLock::new(None),
            log: Mutex::new(LogState::default()),
            objects: Mutex::new(Objects::default()),
            log_bytes: AtomicU64::new(0),
            log_budget: AtomicU64::new(DEFAULT_LOG_BUDGET),
            max_maps,
            observer: RwLock::new(None),
            dirty_source: RwLock::new(None),
        }
    }

    fn read_table(&self) -> RwLockReadGuard<'_, Table> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_table(&self) -> RwLockWriteGuard<'_, Table> {
        self.table.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Adds a window. With `backing = Some((file, offset))` the window is mmapped from that file;
    /// without, it is message-only.
    pub fn map(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        backing: Option<(File, u64)>,
    ) -> Result<()> {
        let end = iova.checked_add(size).filter(|_| size > 0);
        let Some(end) = end else {
            return Err(DmaError::BadWindow { iova, size });
        };
        // Build the mapping before taking the lock: mmap can be slow.
        let backing = match backing {
            None => Backing::Message,
            Some((file, offset)) => {
                Backing::Fd(Arc::new(self.map_file(iova, size, prot, file, offset)?))
            }
        };
        // A window mapped during a logging session is logged from its first write.
        let _log = self.log_state();
        let logging = _log.page_size.is_some();
        let mut table = self.write_table();
        if table.maps.len() >= self.max_maps {
            return Err(DmaError::TooManyMappings {
                limit: self.max_maps,
            });
        }
        let idx = table.maps.partition_point(|m| m.iova < iova);
        let overlaps_prev = idx
            .checked_sub(1)
            .and_then(|i| table.maps.get(i))
            .is_some_and(|prev| prev.end() > iova);
        let overlaps_next = table.maps.get(idx).is_some_and(|next| next.iova < end);
        if overlaps_prev || overlaps_next {
            return Err(DmaError::Overlap { iova, size });
        }
        let observer = self.observer();
        if let Some(o) = &observer {
            let file = match &backing {
                Backing::Fd(w) => w.file(),
                Backing::Message => None,
            };
            o.mapping(iova, size, prot, file)
                .map_err(|e| DmaError::Observer(Box::new(e)))?;
        }
        if let (true, Backing::Fd(w)) = (logging, &backing)
            && let Err(e) = self.allocate_logs(std::iter::once(&**w))
        {
            if let Some(o) = &observer {
                o.unmapped(iova, size);
            }
            return Err(e);
        }
        table.maps.insert(
            idx,
            Mapping {
                iova,
                size,
                prot,
                backing,
            },
        );
        Ok(())
    }

    /// Removes every window that lies entirely inside `[iova, iova+size)` and returns how many
    /// were removed. Like the kernel's type1 IOMMU (and unlike the spec text, which asks for an
    /// exact match), a range may cover several windows, or none (QEMU with a vIOMMU
    /// invalidates large ranges at once, including ranges it never mapped): that removes
    /// nothing and succeeds. A window that straddles the range boundary is an error (nothing
    /// is removed).
    pub fn unmap(&self, iova: u64, size: u64) -> Result<usize> {
        let removed: Vec<Mapping> = {
            let mut table = self.write_table();
            let (first, stop) = Self::covered(&table, iova, size)?;
            table.maps.drain(first..stop).collect()
        };
        self.removed(&removed);
        // The mmaps go away here, outside the lock.
        Ok(removed.len())
    }

    /// Removes every window (client `DMA_UNMAP` with the ALL flag, or client disconnect).
    pub fn unmap_all(&self) {
        let removed = std::mem::take(&mut self.write_table().maps);
        self.removed(&removed);
        drop(removed);
    }

    /// Windows left the table: their logs' memory goes back to the budget, and the device's
    /// observer learns they are gone.
    fn removed(&self, removed: &[Mapping]) {
        self.forget_logs(removed);
        if let Some(o) = self.observer() {
            for m in removed {
                o.unmapped(m.iova, m.size);
            }
        }
    }

    /// Tells the installed observer about every window already in the table, as if each
    /// were mapped now (a device that takes a slot whose tables were restored before it was
    /// built: its IOMMU must see them all before it serves). A window the observer refuses
    /// is removed from the table (the others stay); returned with the refusal.
    pub fn replay_to_observer(&self) -> Vec<(u64, u64, DmaError)> {
        let Some(o) = self.observer() else {
            return Vec::new();
        };
        let mut refused = Vec::new();
        let removed: Vec<Mapping> = {
            let mut table = self.write_table();
            let mut kept = Vec::with_capacity(table.maps.len());
            let mut removed = Vec::new();
            for m in std::mem::take(&mut table.maps) {
                let file = match &m.backing {
                    Backing::Fd(w) => w.file(),
                    Backing::Message => None,
                };
                match o.mapping(m.iova, m.size, m.prot, file) {
                    Ok(()) => kept.push(m),
                    Err(e) => {
                        refused.push((m.iova, m.size, DmaError::Observer(Box::new(e))));
                        removed.push(m);
                    }
                }
            }
            table.maps = kept;
            removed
        };
        // Not `removed()`: the observer never accepted these.
        self.forget_logs(&removed);
        drop(removed);
        refused
    }

    /// Installs (or removes) the device's observer of maps and unmaps (see [`DmaObserver`]).
    pub fn set_observer(&self, observer: Option<Arc<dyn DmaObserver>>) {
        *self.observer.write().unwrap_or_else(|p| p.into_inner()) = observer;
    }

    fn observer(&self) -> Option<Arc<dyn DmaObserver>> {
        self.observer
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Installs (or removes) the device's own dirty tracking, ORed into reports (see
    /// [`DirtySource`]).
    pub fn set_dirty_source(&self, source: Option<Arc<dyn DirtySource>>) {
        *self.dirty_source.write().unwrap_or_else(|p| p.into_inner()) = source;
    }

    fn dirty_source(&self) -> Option<Arc<dyn DirtySource>> {
        self.dirty_source
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The current windows, in IOVA order.
    pub fn mappings(&self) -> Vec<MappingInfo> {
        self.read_table()
            .maps
            .iter()
            .map(|m| MappingInfo {
                iova: m.iova,
                size: m.size,
                prot: m.prot,
                mmapped: matches!(m.backing, Backing::Fd(_)),
                direct: matches!(&m.backing, Backing::Fd(w) if w.access == Access::Direct),
            })
            .collect()
    }

    /// The window holding `iova`, with its own descriptor of its backing file (a duplicate)
    /// and the offset of the window's first byte in it; `None` if no window holds `iova` or
    /// it has no file (message-only). For a device that reaches guest memory by other means
    /// than this space (a GPU registering it) and learns of a window after it was mapped.
    pub fn window_backing(&self, iova: u64) -> Option<WindowBacking> {
        let table = self.read_table();
        let m = table.find(iova)?;
        let Backing::Fd(w) = &m.backing else {
            return None;
        };
        let (file, offset) = w.file()?;
        Some(WindowBacking {
            iova: m.iova,
            size: m.size,
            prot: m.prot,
            file: file.try_clone().ok()?,
            offset,
        })
    }

    /// Checks that `[iova, iova+len)` is fully mapped with the permission needed, without
    /// touching memory.
    fn check(&self, table: &Table, iova: u64, len: u64, dir: Dir) -> Result<()> {
        let end = iova
            .checked_add(len)
            .ok_or(DmaError::Overflow { iova, len })?;
        let mut cur = iova;
        while cur < end {
            let m = table.find(cur).ok_or(DmaError::Unmapped { iova: cur })?;
            let allowed = match dir {
                Dir::Read => m.prot.read,
                Dir::Write => m.prot.write,
            };
            if !allowed {
                let access = if dir == Dir::Read { "read" } else { "write" };
                return Err(DmaError::Permission { iova: cur, access });
            }
            cur = m.end();
        }
        Ok(())
    }

    /// Validates that `[iova, iova+len)` is mapped for reading (`write = false`) or writing.
    pub fn validate(&self, iova: u64, len: u64, write: bool) -> Result<()> {
        let dir = if write { Dir::Write } else { Dir::Read };
        self.check(&self.read_table(), iova, len, dir)
    }

    /// Runs `f` over the memory of `[iova, iova+len)` in order, one volatile slice per
    /// contiguous piece, after checking the whole range first. `f` receives the offset of the
    /// piece within the access. The table stays read-locked while mmapped pieces are accessed
    /// (an unmap waits for the access to finish); message-only windows are bounced through a
    /// stack buffer and the [`RemoteDma`] transport with the lock dropped, after which the rest
    /// of the range is checked again.
    fn access<F>(&self, iova: u64, len: usize, dir: Dir, mut f: F) -> Result<()>
    where
        F: FnMut(usize, Piece<'_>),
    {
        let len64 = len as u64;
        let end = iova
            .checked_add(len64)
            .ok_or(DmaError::Overflow { iova, len: len64 })?;
        let mut table = self.read_table();
        self.check(&table, iova, len64, dir)?;
        let mut cur = iova;
        while cur < end {
            let (piece_end, message) = {
                let m = table.find(cur).ok_or(DmaError::Unmapped { iova: cur })?;
                let piece_end = m.end().min(end);
                match &m.backing {
                    Backing::Fd(w) => {
                        // Both fit in usize: the piece is within `len`.
                        let (off, piece) = ((cur - m.iova) as usize, (piece_end - cur) as usize);
                        let done = (cur - iova) as usize;
                        if dir == Dir::Write {
                            // Marked first: a guarded write that fails part-way may have
                            // written some pages, and the lock keeps any flip out until
                            // the write is done.
                            w.log.mark_dirty(off, piece);
                        }
                        if w.access != Access::Direct {
                            guarded_piece(w, cur, off, piece, done, dir, &mut f)?;
                        } else {
                            let slice = w
                                .slice(off, piece)
                                .ok_or(DmaError::Unmapped { iova: cur })?;
                            f(done, Piece::Mem(slice));
                        }
                        (piece_end, false)
                    }
                    Backing::Message => (piece_end, true),
                }
            };
            if message {
                drop(table);
                self.remote_piece(cur, piece_end, (cur - iova) as usize, dir, &mut f)?;
                table = self.read_table();
                self.check(&table, piece_end, end - piece_end, dir)?;
            }
            cur = piece_end;
        }
        Ok(())
    }

    /// Reads `buf.len()` bytes at `iova`.
    pub fn read(&self, iova: u64, buf: &mut [u8]) -> Result<()> {
        self.access(iova, buf.len(), Dir::Read, |off, p| {
            if let Some(dst) = buf.get_mut(off..off + p.len()) {
                p.copy_to(dst);
            }
        })
    }

    /// Writes `data` at `iova`; the written pages are marked dirty.
    pub fn write(&self, iova: u64, data: &[u8]) -> Result<()> {
        self.access(iova, data.len(), Dir::Write, |off, mut p| {
            if let Some(src) = data.get(off..off + p.len()) {
                p.copy_from(src);
            }
        })
    }

    /// Reads a host-endian `u64` at `iova`.
    pub fn read_u64(&self, iova: u64) -> Result<u64> {
        let mut b = [0u8; 8];
        self.read(iova, &mut b)?;
        Ok(u64::from_ne_bytes(b))
    }

    /// Writes a host-endian `u64` at `iova`.
    pub fn write_u64(&self, iova: u64, v: u64) -> Result<()> {
        self.write(iova, &v.to_ne_bytes())
    }

    /// Copies `len` bytes from DMA memory at `iova` into `dst` (device memory, e.g. VRAM).
    pub fn copy_to_slice<S: BitmapSlice>(
        &self,
        iova: u64,
        dst: &VolatileSlice<'_, S>,
    ) -> Result<()> {
        self.access(iova, dst.len(), Dir::Read, |off, p| {
            if let Ok(d) = dst.subslice(off, p.len()) {
                p.copy_to_volatile(d);
            }
        })
    }

    /// Copies `src` (device memory, e.g. VRAM) into DMA memory at `iova`; marks pages dirty.
    pub fn copy_from_slice<S: BitmapSlice>(
        &self,
        iova: u64,
        src: &VolatileSlice<'_, S>,
    ) -> Result<()> {
        self.access(iova, src.len(), Dir::Write, |off, mut p| {
            if let Ok(from) = src.subslice(off, p.len()) {
                p.copy_from_volatile(from);
            }
        })
    }

    /// Marks `[iova, iova+len)` dirty, for a device that wrote guest memory by some other means
    /// than this space's accessors (a DMA engine of its own, a peer). Pieces in message-only
    /// windows are ignored (the client tracks those writes); an unmapped byte is an error and
    /// marks nothing.
    pub fn mark_dirty(&self, iova: u64, len: u64) -> Result<()> {
        let table = self.read_table();
        self.check(&table, iova, len, Dir::Write)?;
        let end = iova.saturating_add(len);
        let mut cur = iova;
        while cur < end {
            let m = table.find(cur).ok_or(DmaError::Unmapped { iova: cur })?;
            let piece_end = m.end().min(end);
            if let Backing::Fd(w) = &m.backing {
                // Both fit in usize: the window was mmapped.
                w.log
                    .mark_dirty((cur - m.iova) as usize, (piece_end - cur) as usize);
            }
            cur = piece_end;
        }
        Ok(())
    }

    /// The index range of the windows lying entirely inside `[iova, iova+len)` (empty if none
    /// is); errors if a window straddles the range. The range may end exactly at 2^64.
    fn covered(table: &Table, iova: u64, len: u64) -> Result<(usize, usize)> {
        let last = len.checked_sub(1).and_then(|s| iova.checked_add(s));
        let Some(last) = last else {
            return Err(DmaError::BadWindow { iova, size: len });
        };
        let first = table.maps.partition_point(|m| m.end() <= iova);
        let stop = table.maps.partition_point(|m| m.iova <= last);
        let hit = table.maps.get(first..stop).unwrap_or(&[]);
        if hit.iter().any(|m| m.iova < iova || m.end() - 1 > last) {
            return Err(DmaError::PartialUnmap { iova, size: len });
        }
        Ok((first, stop.max(first)))
    }
}
