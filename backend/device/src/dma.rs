//! The DMA space: the client's DMA windows as the device sees them.
//!
//! Every `DMA_MAP` the client sends becomes one mapping keyed by IOVA. A map that carries a
//! file descriptor is mmapped once (through `vm-memory`, so accesses are volatile and no Rust
//! reference ever points into guest memory) and gets a [`DirtyLog`] that records every write
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

use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{
    Arc, Mutex, MutexGuard, OnceLock, RwLock, RwLockReadGuard, RwLockWriteGuard, Weak,
};

use vm_memory::bitmap::BitmapSlice;
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, MmapRegion, VolatileMemory, VolatileSlice};

pub use crate::dirty::DIRTY_PAGE_SIZE;
use crate::dirty::DirtyLog;

/// Default bound on the memory all windows' dirty logs may take together: 256 MiB, enough to
/// log 4 TiB of mapped guest memory at 4 KiB pages (each page costs two bits).
pub const DEFAULT_LOG_BUDGET: u64 = 256 << 20;

/// How much a guarded access moves per system call.
const GUARDED_CHUNK: usize = 64 << 10;

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
    /// An unmap range cuts through a window.
    #[error("unmap range {iova:#x}+{size:#x} splits a DMA mapping")]
    PartialUnmap {
        /// Start of the requested range.
        iova: u64,
        /// Size of the requested range.
        size: u64,
    },
    /// Too many simultaneous mappings.
    #[error("too many DMA mappings (limit {limit})")]
    TooManyMappings {
        /// The configured limit.
        limit: usize,
    },
    /// Mapping the client's file descriptor failed.
    #[error("cannot mmap the DMA window at {iova:#x}")]
    Mmap {
        /// Start of the window.
        iova: u64,
        /// The underlying error.
        #[source]
        source: vm_memory::mmap::MmapRegionError,
    },
    /// The client's file descriptor cannot be inspected.
    #[error("cannot inspect the file of the DMA window at {iova:#x}")]
    Backing {
        /// Start of the window.
        iova: u64,
        /// The underlying error.
        #[source]
        source: std::io::Error,
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
    #[error("dirty logging needs {need} more bytes of bitmaps, over the budget of {budget}")]
    LogBudget {
        /// Bytes the logs would need in all.
        need: u64,
        /// The budget.
        budget: u64,
    },
    /// Memory for a dirty log could not be allocated.
    #[error("cannot allocate a dirty log")]
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
    #[error("dirty page size {0:#x} is not a power of two multiple of 4 KiB")]
    BadPageSize(u64),
    /// A dirty report was asked for outside a logging session.
    #[error("DMA dirty logging is not started")]
    NotLogging,
    /// Logging was started twice.
    #[error("DMA dirty logging is already started")]
    LoggingActive,
    /// The buffer for a dirty bitmap is too small.
    #[error("dirty bitmap needs {need} bytes, the request has room for {room}")]
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

/// Access permissions of a DMA window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaProt {
    /// The device may read the window.
    pub read: bool,
    /// The device may write the window.
    pub write: bool,
}

impl DmaProt {
    /// Read and write.
    pub const READ_WRITE: DmaProt = DmaProt {
        read: true,
        write: true,
    };
    /// Read only.
    pub const READ_ONLY: DmaProt = DmaProt {
        read: true,
        write: false,
    };
}

/// Message-based access to windows the client mapped without a file descriptor.
///
/// The server implements this by sending `DMA_READ` / `DMA_WRITE` to the client. It is called
/// without any lock of the DMA space held, so the server's connection thread can keep serving
/// (and answering) while an engine waits.
pub trait RemoteDma: Send + Sync {
    /// Reads `buf.len()` bytes at `iova` from the client. Errors are errnos.
    fn read(&self, iova: u64, buf: &mut [u8]) -> std::result::Result<(), i32>;
    /// Writes `data` at `iova` in the client. Errors are errnos.
    fn write(&self, iova: u64, data: &[u8]) -> std::result::Result<(), i32>;
}

enum Backing {
    Fd(Arc<FdWindow>),
    Message,
}

/// A window backed by the client's file: mapped into this process, accessed directly or
/// through the fault-safe path (see the module docs), with its dirty log.
struct FdWindow {
    /// The mapping of the client's file the window lies in; the window starts `delta` bytes
    /// into it.
    obj: Arc<ObjectMap>,
    delta: usize,
    len: usize,
    /// How accesses reach the bytes.
    access: Access,
    log: DirtyLog,
}

impl FdWindow {
    /// The volatile view of `[off, off+len)` of the window (direct windows only).
    fn slice(&self, off: usize, len: usize) -> Option<DmaSlice<'_>> {
        self.obj
            .map
            .get_slice(self.delta.checked_add(off)?, len)
            .ok()
    }

    /// This process's address of byte `off` of the window.
    fn addr(&self, off: usize) -> u64 {
        self.obj.map.as_ptr() as u64 + (self.delta + off) as u64
    }
}

/// One mapping of (part of) a client's file, shared by every window that lies in it.
struct ObjectMap {
    map: MmapRegion<()>,
    /// File offset of the mapping's first byte.
    start: u64,
    /// The space's count of mapped bytes, given back when the mapping goes.
    mapped: Arc<AtomicU64>,
}

impl Drop for ObjectMap {
    fn drop(&mut self) {
        self.mapped
            .fetch_sub(self.map.size() as u64, Ordering::Relaxed);
    }
}

impl ObjectMap {
    /// Where file range `[offset, offset+size)` starts in this mapping, if it lies inside.
    fn place(&self, offset: u64, size: u64) -> Option<usize> {
        let delta = offset.checked_sub(self.start)?;
        let end = delta.checked_add(size)?;
        (end <= self.map.size() as u64).then(|| usize::try_from(delta).ok())?
    }
}

/// Files up to this size are mapped whole, once, and every window into them shares that
/// mapping; a window into a larger file gets a mapping of its own (address space is finite).
const OBJECT_MAP_MAX: u64 = 64 << 30;

/// Address space all of a client's mappings may take together: 64 TiB, half of what x86-64
/// gives a process, so a client mapping huge sparse files cannot leave the server without
/// address space for its own allocations (which would abort it).
pub const MAP_BUDGET: u64 = 64 << 40;

/// The fault-safe path to this process's memory (see the module docs).
fn proc_mem() -> Option<&'static File> {
    static MEM: OnceLock<Option<File>> = OnceLock::new();
    MEM.get_or_init(|| {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/self/mem")
            .map_err(|e| tracing::warn!(error = %e, "/proc/self/mem unavailable: only sealed memfds can back DMA"))
            .ok()
    })
    .as_ref()
}

/// `statfs` magic numbers of the filesystems the access policy tells apart.
const TMPFS_MAGIC: i64 = 0x0102_1994;
const HUGETLBFS_MAGIC: i64 = 0x9584_58f6;

/// Whether loads and stores into a shared mapping of `file` can never fault, and the
/// alignment its mmap offsets need.
fn access_policy(file: &File) -> std::io::Result<(Access, u64)> {
    let fs = rustix::fs::fstatfs(file)?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    let magic = fs.f_type as i64;
    if magic == HUGETLBFS_MAGIC {
        // A punched hole may find no free huge page: never direct; and no write(2).
        return Ok((Access::ProcMem, (fs.f_bsize as u64).max(4096)));
    }
    let sealed = magic == TMPFS_MAGIC
        && rustix::fs::fcntl_get_seals(file)
            .is_ok_and(|s| s.contains(rustix::fs::SealFlags::SHRINK));
    Ok((if sealed { Access::Direct } else { Access::File }, 4096))
}

/// How the device's accesses reach a window's bytes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Access {
    /// Loads and stores into the mapping: a memfd sealed against shrinking.
    Direct,
    /// `pread`/`pwrite` on the client's file (unsealed shmem, regular files): a page that
    /// cannot be had is an error, never a signal.
    File,
    /// Copies through `/proc/self/mem` at the mapping: hugetlbfs, which has no `write`.
    ProcMem,
}

/// One mapping per memory object the client maps (see the module docs).
#[derive(Default)]
struct Objects {
    maps: HashMap<(u64, u64, bool), Weak<ObjectMap>>,
    /// Bytes of address space the live mappings take.
    mapped: Arc<AtomicU64>,
    /// Prune dead entries when the table has grown to this size.
    prune_at: usize,
}

impl Objects {
    /// A mapping of `file` that holds `[offset, offset+size)`, and where that range starts in
    /// it: the object's shared mapping if one exists, else a new one (of the whole file when
    /// it is at most [`OBJECT_MAP_MAX`], aligned to `align`). `file` (the client's copy of
    /// the descriptor) is closed when an existing mapping serves. Read-only and read-write
    /// opens of one object are kept apart.
    fn map(
        &mut self,
        file: File,
        writable: bool,
        offset: u64,
        size: u64,
        align: u64,
    ) -> std::result::Result<(Arc<ObjectMap>, usize), vm_memory::mmap::MmapRegionError> {
        use vm_memory::mmap::MmapRegionError as E;
        let meta = file.metadata().map_err(E::Mmap)?;
        let key = (meta.dev(), meta.ino(), writable);
        if let Some(o) = self.maps.get(&key).and_then(Weak::upgrade)
            && let Some(delta) = o.place(offset, size)
        {
            return Ok((o, delta));
        }
        let whole = meta.len() <= OBJECT_MAP_MAX;
        let (start, end) = if whole {
            (0, meta.len())
        } else {
            (offset - offset % align, offset + size)
        };
        let invalid = || E::Mmap(std::io::Error::from_raw_os_error(libc::EINVAL));
        let len = end
            .checked_sub(start)
            .and_then(|l| l.checked_next_multiple_of(align))
            .and_then(|l| usize::try_from(l).ok())
            .ok_or_else(invalid)?;
        if self
            .mapped
            .load(Ordering::Relaxed)
            .saturating_add(len as u64)
            > MAP_BUDGET
        {
            return Err(E::Mmap(std::io::Error::from_raw_os_error(libc::ENOMEM)));
        }
        let prot = libc::PROT_READ | if writable { libc::PROT_WRITE } else { 0 };
        let map = MmapRegionBuilder::new(len)
            .with_file_offset(FileOffset::new(file, start))
            .with_mmap_prot(prot)
            .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
            .build()?;
        self.mapped.fetch_add(len as u64, Ordering::Relaxed);
        let o = Arc::new(ObjectMap {
            map,
            start,
            mapped: Arc::clone(&self.mapped),
        });
        let delta = o.place(offset, size).ok_or_else(invalid)?;
        if whole {
            if self.maps.len() >= self.prune_at {
                self.maps.retain(|_, w| w.strong_count() > 0);
                self.prune_at = (self.maps.len() * 2).max(64);
            }
            self.maps.insert(key, Arc::downgrade(&o));
        }
        Ok((o, delta))
    }
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
        }
    }

    /// Sets how many bytes all dirty logs may take together (see the module docs).
    pub fn set_log_budget(&self, bytes: u64) {
        self.log_budget.store(bytes, Ordering::Relaxed);
    }

    /// Bytes the dirty logs take now.
    pub fn log_bytes(&self) -> u64 {
        self.log_bytes.load(Ordering::Relaxed)
    }

    /// Allocates the logs of `windows` (those not yet allocated) if the budget allows all of
    /// them; call with the table write-locked. On error nothing more is allocated than before
    /// (except after a failed allocation, whose predecessors stay allocated and counted).
    fn allocate_logs<'a>(&self, windows: impl Iterator<Item = &'a FdWindow> + Clone) -> Result<()> {
        let need: u64 = windows
            .clone()
            .filter(|w| !w.log.is_allocated())
            .map(|w| w.log.bytes())
            .fold(0u64, u64::saturating_add);
        let budget = self.log_budget.load(Ordering::Relaxed);
        let total = self.log_bytes().saturating_add(need);
        if total > budget {
            return Err(DmaError::LogBudget {
                need: total,
                budget,
            });
        }
        for w in windows {
            if w.log.allocate().map_err(DmaError::LogAlloc)? {
                self.log_bytes.fetch_add(w.log.bytes(), Ordering::Relaxed);
            }
        }
        Ok(())
    }

    /// Gives back the log memory of windows that were removed.
    fn forget_logs(&self, removed: &[Mapping]) {
        for m in removed {
            if let Backing::Fd(w) = &m.backing
                && w.log.is_allocated()
            {
                self.log_bytes.fetch_sub(w.log.bytes(), Ordering::Relaxed);
            }
        }
    }

    /// Maps the client's file for a window (outside every lock: mmap can be slow).
    fn map_file(
        &self,
        iova: u64,
        size: u64,
        prot: DmaProt,
        file: File,
        offset: u64,
    ) -> Result<FdWindow> {
        let bad = DmaError::BadWindow { iova, size };
        let backing_err = |source| DmaError::Backing { iova, source };
        let len = usize::try_from(size).map_err(|_| DmaError::BadWindow { iova, size })?;
        // A window past the end of the file would fault on first access.
        let file_len = file.metadata().map_err(backing_err)?.len();
        if offset.checked_add(size).is_none_or(|e| e > file_len) {
            return Err(bad);
        }
        let (access, align) = access_policy(&file).map_err(backing_err)?;
        if access == Access::ProcMem && proc_mem().is_none() {
            return Err(DmaError::NoSafeAccess { iova });
        }
        let writable = rustix::fs::fcntl_getfl(&file)
            .map_err(|e| backing_err(e.into()))?
            .contains(rustix::fs::OFlags::RDWR);
        if prot.write && !writable {
            return Err(DmaError::Backing {
                iova,
                source: std::io::Error::from_raw_os_error(libc::EACCES),
            });
        }
        let (obj, delta) = self
            .objects
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(file, writable, offset, size, align)
            .map_err(|source| DmaError::Mmap { iova, source })?;
        Ok(FdWindow {
            obj,
            delta,
            len,
            access,
            log: DirtyLog::new(len),
        })
    }

    fn read_table(&self) -> RwLockReadGuard<'_, Table> {
        self.table.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write_table(&self) -> RwLockWriteGuard<'_, Table> {
        self.table.write().unwrap_or_else(|p| p.into_inner())
    }

    /// Installs (or removes) the message-based transport for fd-less windows.
    pub fn set_remote(&self, remote: Option<Arc<dyn RemoteDma>>) {
        *self.remote.write().unwrap_or_else(|p| p.into_inner()) = remote;
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
        if let (true, Backing::Fd(w)) = (logging, &backing) {
            self.allocate_logs(std::iter::once(&**w))?;
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
        self.forget_logs(&removed);
        // The mmaps go away here, outside the lock.
        Ok(removed.len())
    }

    /// Removes every window (client `DMA_UNMAP` with the ALL flag, or client disconnect).
    pub fn unmap_all(&self) {
        let removed = std::mem::take(&mut self.write_table().maps);
        self.forget_logs(&removed);
        drop(removed);
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

    /// Accesses `[cur, piece_end)` of a message-only window through the client, in chunks of a
    /// stack bounce buffer. `done` is the offset of `cur` within the whole access.
    fn remote_piece<F>(
        &self,
        cur: u64,
        piece_end: u64,
        done: usize,
        dir: Dir,
        f: &mut F,
    ) -> Result<()>
    where
        F: FnMut(usize, Piece<'_>),
    {
        let remote = self
            .remote
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(remote) = remote else {
            return Err(DmaError::Remote {
                iova: cur,
                errno: libc::ENOTCONN,
            });
        };
        let mut bounce = [0u8; 4096];
        let mut at = cur;
        while at < piece_end {
            // At most 4096: fits in usize.
            let n = (piece_end - at).min(bounce.len() as u64) as usize;
            let buf = bounce.get_mut(..n).unwrap_or_default();
            let off = done + (at - cur) as usize;
            if dir == Dir::Read {
                remote
                    .read(at, buf)
                    .map_err(|errno| DmaError::Remote { iova: at, errno })?;
                f(off, Piece::Bounce(buf));
            } else {
                f(off, Piece::Bounce(buf));
                remote
                    .write(at, buf)
                    .map_err(|errno| DmaError::Remote { iova: at, errno })?;
            }
            at += n as u64;
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

    fn log_state(&self) -> MutexGuard<'_, LogState> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `DMA_LOGGING_START`: allocates (within the budget) and clears every window's log and
    /// starts a logging session. Every fd-backed window is logged, whatever ranges the client
    /// named (logging more than asked is allowed); windows mapped later start clean. Refused
    /// with `ENOMEM`, and no session started, when the logs would exceed the budget.
    /// `page_size` is the client's hint: the returned page size is what the log keeps (4 KiB,
    /// or the hint if larger). Reports may ask for any power-of-two page size of at least
    /// 4 KiB.
    pub fn start_logging(&self, page_size: u64) -> Result<u64> {
        if !page_size.is_power_of_two() {
            return Err(DmaError::BadPageSize(page_size));
        }
        let mut log = self.log_state();
        if log.page_size.is_some() {
            return Err(DmaError::LoggingActive);
        }
        // No write is in flight while the table is write-locked: none straddles the clear.
        let table = self.write_table();
        let windows = table.maps.iter().filter_map(|m| match &m.backing {
            Backing::Fd(w) => Some(&**w),
            Backing::Message => None,
        });
        self.allocate_logs(windows.clone())?;
        for w in windows {
            w.log.clear();
        }
        let chosen = page_size.max(DIRTY_PAGE_SIZE as u64);
        log.page_size = Some(chosen);
        Ok(chosen)
    }

    /// `DMA_LOGGING_STOP`: ends the logging session (a no-op without one).
    pub fn stop_logging(&self) {
        self.log_state().page_size = None;
    }

    /// The page size of the running logging session, if any.
    pub fn logging(&self) -> Option<u64> {
        self.log_state().page_size
    }

    /// `DMA_LOGGING_REPORT`: reads and clears the dirty bits of `[iova, iova+len)` into `out`
    /// at `page_size` granularity (bit k = page `iova + k*page_size`: byte k/8... as host-order
    /// 64-bit words, word k/64, bit k%64). The range may cover any number of windows, parts of
    /// windows and holes (which read clean); bits of a window outside the range stay logged.
    /// Needs a logging session. Writes that race with the report land in this report or in the
    /// next one, never in neither.
    pub fn report_dirty(&self, iova: u64, len: u64, page_size: u64, out: &mut [u8]) -> Result<()> {
        let mut log = self.log_state();
        if log.page_size.is_none() {
            return Err(DmaError::NotLogging);
        }
        let last = report_geometry(iova, len, page_size, out.len())?;
        let mut windows = std::mem::take(&mut log.scratch);
        {
            // Flip under the write lock: no write is in flight, and every later write marks
            // the other bitmap. The drain then runs with device DMA flowing again.
            let table = self.write_table();
            let first = table.maps.partition_point(|m| m.end() <= iova);
            for m in table.maps.iter().skip(first).take_while(|m| m.iova <= last) {
                if let Backing::Fd(w) = &m.backing {
                    w.log.flip();
                    windows.push((m.iova, Arc::clone(w)));
                }
            }
        }
        collect_dirty(&windows, iova, last, page_size, out);
        windows.clear();
        log.scratch = windows;
        Ok(())
    }

    /// `DMA_UNMAP` with `GET_DIRTY_BITMAP`: atomically (under the table's write lock, with no
    /// access in flight) reads and clears the dirty bits of the windows in `[iova, iova+len)`
    /// into `out` (layout as [`DmaSpace::report_dirty`]) and removes them. Works with or
    /// without a logging session: a window whose writes were never logged reports every page
    /// dirty. Fails without touching anything when [`DmaSpace::unmap`] would.
    pub fn unmap_take_dirty(
        &self,
        iova: u64,
        len: u64,
        page_size: u64,
        out: &mut [u8],
    ) -> Result<usize> {
        let last = report_geometry(iova, len, page_size, out.len())?;
        let _log = self.log_state();
        let removed: Vec<Mapping> = {
            let mut table = self.write_table();
            let (first, stop) = Self::covered(&table, iova, len)?;
            let removed: Vec<Mapping> = table.maps.drain(first..stop).collect();
            let windows: Vec<(u64, Arc<FdWindow>)> = removed
                .iter()
                .filter_map(|m| match &m.backing {
                    Backing::Fd(w) => {
                        w.log.flip();
                        Some((m.iova, Arc::clone(w)))
                    }
                    Backing::Message => None,
                })
                .collect();
            collect_dirty(&windows, iova, last, page_size, out);
            removed
        };
        self.forget_logs(&removed);
        Ok(removed.len())
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

/// Accesses `[off, off + len)` of a guarded window with `pread`/`pwrite` on the client's file
/// (or, for hugetlbfs, through `/proc/self/mem` at the mapping), in chunks of a stack bounce
/// buffer: the kernel copies, and a page it cannot have (a truncated file, a hole with no
/// memory to fill it) fails the chunk with an error instead of raising SIGBUS.
/// `iova` is the address of `off`, `done` its offset within the whole access. A write that
/// fails part-way leaves the chunks before it written.
fn guarded_piece<F>(
    w: &FdWindow,
    iova: u64,
    off: usize,
    len: usize,
    done: usize,
    dir: Dir,
    f: &mut F,
) -> Result<()>
where
    F: FnMut(usize, Piece<'_>),
{
    // Where the piece's bytes are: the file and its offset (pread/pwrite), or this process's
    // memory at the mapping (/proc/self/mem).
    let (file, base) = match w.access {
        Access::ProcMem => (
            proc_mem().ok_or(DmaError::NoSafeAccess { iova })?,
            w.addr(off),
        ),
        _ => {
            let fo = w
                .obj
                .map
                .file_offset()
                .ok_or(DmaError::NoSafeAccess { iova })?;
            (fo.file(), w.obj.start + (w.delta + off) as u64)
        }
    };
    if dir == Dir::Write && w.access == Access::File {
        // A pwrite past the end would grow the file instead of failing like the page.
        let size = file.metadata().map(|m| m.len()).unwrap_or(0);
        if base.saturating_add(len as u64) > size {
            let backed = size.saturating_sub(base);
            tracing::debug!(iova, backed, "DMA write past the end of the client's file");
            return Err(DmaError::Fault {
                iova: iova + backed,
            });
        }
    }
    let mut bounce = [0u8; GUARDED_CHUNK];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(GUARDED_CHUNK);
        let buf = bounce.get_mut(..n).unwrap_or_default();
        let pos = base + at as u64;
        let fault = |e: std::io::Error| {
            let iova = iova + at as u64;
            tracing::debug!(iova, error = %e, "DMA into memory the client's file does not back");
            DmaError::Fault { iova }
        };
        if dir == Dir::Read {
            file.read_exact_at(buf, pos).map_err(fault)?;
            f(done + at, Piece::Bounce(buf));
        } else {
            f(done + at, Piece::Bounce(buf));
            file.write_all_at(buf, pos).map_err(fault)?;
        }
        at += n;
    }
    Ok(())
}

/// Logging session state; its mutex also serializes reports (a drain owns the inactive
/// bitmaps it flipped until it is done).
#[derive(Default)]
struct LogState {
    /// Page size of the running session.
    page_size: Option<u64>,
    /// Windows of the report in progress (kept to reuse the allocation).
    scratch: Vec<(u64, Arc<FdWindow>)>,
}

/// Checks a report's range, page size and bitmap room; returns the last address of the range
/// (the range may end exactly at 2^64).
fn report_geometry(iova: u64, len: u64, page_size: u64, room: usize) -> Result<u64> {
    if !page_size.is_power_of_two() || page_size < DIRTY_PAGE_SIZE as u64 {
        return Err(DmaError::BadPageSize(page_size));
    }
    let last = len
        .checked_sub(1)
        .and_then(|s| iova.checked_add(s))
        .ok_or(DmaError::BadWindow { iova, size: len })?;
    let need = len.div_ceil(page_size).div_ceil(64).saturating_mul(8);
    if (room as u64) < need {
        return Err(DmaError::BitmapTooSmall { need, room });
    }
    Ok(last)
}

/// Drains the (already flipped) logs of `windows`, sorted by IOVA and all intersecting
/// `[iova, last]`, into `out` at `page_size` granularity; bits outside the range go back to
/// their window's log. Bytes of `out` past the range's bitmap are left alone.
fn collect_dirty(
    windows: &[(u64, Arc<FdWindow>)],
    iova: u64,
    last: u64,
    page_size: u64,
    out: &mut [u8],
) {
    let page = DIRTY_PAGE_SIZE as u64;
    let bytes = ((last - iova) / page_size / 64 + 1) as usize * 8;
    let out = match out.get_mut(..bytes) {
        Some(o) => o,
        None => return, // Checked by report_geometry.
    };
    // Bytes below `zeroed` hold final values or zeros: every window is written exactly once,
    // in address order, and gaps are zeroed just before the next window needs them.
    let mut zeroed = 0usize;
    let zero_to = |out: &mut [u8], zeroed: &mut usize, to: usize| {
        if let Some(gap) = out.get_mut(*zeroed..to) {
            gap.fill(0);
        }
        *zeroed = (*zeroed).max(to);
    };
    for (start, window) in windows {
        let log = &window.log;
        let size = window.len as u64;
        let end_last = start + (size - 1); // Window fits the address space.
        if !log.is_allocated() {
            // Never logged (DMA_UNMAP with a bitmap outside a session): every page may have
            // been written.
            let lo = (*start).max(iova);
            let hi = end_last.min(last);
            let b1 = (((hi - iova) / page_size) / 64 + 1) as usize * 8;
            zero_to(out, &mut zeroed, b1);
            for k in (lo - iova) / page_size..=(hi - iova) / page_size {
                if let Some(o) = out.get_mut((k / 8) as usize) {
                    *o |= 1 << (k % 8);
                }
            }
            continue;
        }
        // Fast path: 4 KiB pages, whole window inside the range, window starting on a bitmap
        // word: the window's log *is* this part of the report, word for word.
        let whole = *start >= iova && end_last <= last;
        let off_pages = start.wrapping_sub(iova) / page;
        if page_size == page && whole && off_pages.is_multiple_of(64) {
            let b0 = (off_pages / 8) as usize;
            let b1 = b0 + log.words() * 8;
            zero_to(out, &mut zeroed, b0);
            if let Some(dst) = out.get_mut(b0..) {
                log.drain_inactive_into(dst);
            }
            zeroed = zeroed.max(b1.min(out.len()));
            continue;
        }
        // General path: bit by bit, ORed into zeroed bytes.
        let lo = (*start).max(iova);
        let hi = end_last.min(last);
        let b1 = (((hi - iova) / page_size) / 64 + 1) as usize * 8;
        zero_to(out, &mut zeroed, b1);
        log.drain_inactive(|w, bits| {
            let mut rest = bits;
            let mut keep = 0u64;
            while rest != 0 {
                let b = rest.trailing_zeros();
                rest &= rest - 1;
                let addr = start + (w as u64 * 64 + u64::from(b)) * page;
                if addr < lo || addr > hi {
                    keep |= 1 << b;
                    continue;
                }
                let k = (addr - iova) / page_size;
                if let Some(o) = out.get_mut((k / 8) as usize) {
                    *o |= 1 << (k % 8);
                }
            }
            keep
        });
    }
    zero_to(out, &mut zeroed, bytes);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn memfd(size: usize) -> File {
        let mfd = memfd::MemfdOptions::default()
            .create("dma-test")
            .expect("memfd");
        let f = mfd.into_file();
        f.set_len(size as u64).expect("set_len");
        f
    }

    /// A memfd sealed against shrinking, as QEMU's `memory-backend-memfd` makes them.
    fn sealed_memfd(size: usize) -> File {
        let mfd = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .create("dma-test-sealed")
            .expect("memfd");
        mfd.as_file().set_len(size as u64).expect("set_len");
        mfd.add_seals(&[memfd::FileSeal::SealShrink, memfd::FileSeal::SealGrow])
            .expect("seal");
        mfd.into_file()
    }

    #[test]
    fn only_sealed_memfds_are_accessed_directly() {
        let dma = DmaSpace::new(8);
        dma.map(
            0x1000,
            0x1000,
            DmaProt::READ_WRITE,
            Some((sealed_memfd(0x1000), 0)),
        )
        .expect("sealed");
        dma.map(
            0x2000,
            0x1000,
            DmaProt::READ_WRITE,
            Some((memfd(0x1000), 0)),
        )
        .expect("unsealed");
        let tmp = tempfile_in_tmp(0x1000);
        dma.map(0x3000, 0x1000, DmaProt::READ_WRITE, Some((tmp, 0)))
            .expect("plain file");
        let direct: Vec<bool> = dma.mappings().iter().map(|m| m.direct).collect();
        assert_eq!(direct, [true, false, false]);
        // Both paths move the same bytes.
        let data: Vec<u8> = (0..0x3000u32).map(|i| (i * 7) as u8).collect();
        dma.write(0x1000, &data).expect("write across all three");
        let mut back = vec![0u8; 0x3000];
        dma.read(0x1000, &mut back).expect("read back");
        assert_eq!(back, data);
    }

    fn tempfile_in_tmp(size: u64) -> File {
        let path = std::env::temp_dir().join(format!("sy-dma-{}-{size}", std::process::id()));
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("temp file");
        std::fs::remove_file(&path).expect("unlink");
        f.set_len(size).expect("set_len");
        f
    }

    #[test]
    fn a_truncated_file_fails_the_access_instead_of_killing_the_process() {
        let f = memfd(0x10000);
        let client = f.try_clone().expect("clone");
        let dma = DmaSpace::new(8);
        dma.map(0x10000, 0x10000, DmaProt::READ_WRITE, Some((f, 0)))
            .expect("map");
        dma.start_logging(4096).expect("log");
        dma.write_u64(0x1f000, 1).expect("before the truncation");
        client.set_len(0x8000).expect("the client shrinks its file");
        // Below the new end: fine. At or past it: a clean EFAULT, never SIGBUS.
        dma.write_u64(0x17ff8, 2).expect("still backed");
        assert_eq!(dma.read_u64(0x17ff8).expect("read"), 2);
        let e = dma.write_u64(0x18000, 3).expect_err("truncated page");
        assert!(matches!(e, DmaError::Fault { iova: 0x18000 }), "{e:?}");
        assert_eq!(e.errno(), libc::EFAULT);
        let e = dma
            .read(0x17000, &mut [0u8; 0x2000])
            .expect_err("straddles the end");
        assert!(matches!(e, DmaError::Fault { .. }), "{e:?}");
        let mut buf = vec![0u8; 0x100];
        dma.copy_to_slice(0x1f000, &VolatileSlice::from(&mut buf[..]))
            .expect_err("device copy from a truncated page");
        // The window is still there and can be unmapped cleanly.
        assert_eq!(dma.unmap(0x10000, 0x10000).expect("unmap"), 1);
    }

    #[test]
    fn hugetlb_holes_with_no_huge_pages_fail_cleanly() {
        let Ok(mfd) = memfd::MemfdOptions::default()
            .hugetlb(Some(memfd::HugetlbSize::Huge2MB))
            .create("dma-test-huge")
        else {
            panic!("this kernel cannot create hugetlb memfds (CONFIG_HUGETLBFS)");
        };
        let f = mfd.into_file();
        f.set_len(4 << 20).expect("set_len (reserves nothing)");
        let dma = DmaSpace::new(8);
        // A 4 KiB window in the middle of a huge page: the mmap is aligned down and up.
        dma.map(0x5000, 0x1000, DmaProt::READ_WRITE, Some((f, 0x20_3000)))
            .expect("hugetlb window");
        assert!(!dma.mappings()[0].direct, "hugetlbfs is always guarded");
        let free = std::fs::read_to_string("/proc/sys/vm/nr_hugepages").unwrap_or_default();
        match dma.write_u64(0x5008, 7) {
            Ok(()) => {
                // A huge page was free: the bytes must be where they belong.
                assert_ne!(free.trim(), "0");
                assert_eq!(dma.read_u64(0x5008).expect("read"), 7);
            }
            Err(e) => {
                assert!(matches!(e, DmaError::Fault { iova: 0x5008 }), "{e:?}");
            }
        }
    }

    #[test]
    fn windows_of_one_object_share_one_mapping_and_one_open_file() {
        let f = sealed_memfd(0x40000);
        let dma = DmaSpace::new(128);
        for i in 0..64u64 {
            let dup = f.try_clone().expect("dup");
            dma.map(
                0x100000 + i * 0x1000,
                0x1000,
                DmaProt::READ_WRITE,
                Some((dup, i * 0x1000)),
            )
            .expect("map");
        }
        // A read-only window of the same file shares it too.
        dma.map(
            0x200000,
            0x1000,
            DmaProt::READ_ONLY,
            Some((f.try_clone().expect("dup"), 0)),
        )
        .expect("ro map");
        let table = dma.read_table();
        let objs: Vec<&Arc<ObjectMap>> = table
            .maps
            .iter()
            .filter_map(|m| match &m.backing {
                Backing::Fd(w) => Some(&w.obj),
                Backing::Message => None,
            })
            .collect();
        assert_eq!(objs.len(), 65);
        assert!(
            objs.iter().all(|o| Arc::ptr_eq(o, objs[0])),
            "one mapping for all"
        );
        // 65 windows hold it; every duplicate descriptor the "client" sent is closed.
        assert_eq!(Arc::strong_count(objs[0]), 65);
        drop(table);
        // The windows see the file where their offsets say.
        use std::os::unix::fs::FileExt;
        f.write_all_at(&7u64.to_ne_bytes(), 5 * 0x1000 + 8)
            .expect("pwrite");
        assert_eq!(dma.read_u64(0x100000 + 5 * 0x1000 + 8).expect("read"), 7);
        // A window past the end of the first mapping (the file grew) gets a new one.
        f.set_len(0x80000).expect_err("sealed against growing");
        let g = memfd(0x1000);
        dma.map(
            0x300000,
            0x1000,
            DmaProt::READ_WRITE,
            Some((g.try_clone().expect("dup"), 0)),
        )
        .expect("map");
        g.set_len(0x3000).expect("grow");
        dma.map(
            0x301000,
            0x1000,
            DmaProt::READ_WRITE,
            Some((g.try_clone().expect("dup"), 0x2000)),
        )
        .expect("map past the first mapping");
        dma.write_u64(0x301000, 9).expect("write");
        let mut b = [0u8; 8];
        g.read_exact_at(&mut b, 0x2000).expect("pread");
        assert_eq!(u64::from_ne_bytes(b), 9);
    }

    #[test]
    fn dirty_logs_are_allocated_at_start_within_the_budget() {
        let dma = DmaSpace::new(8);
        // 16 TiB of sparse memfd is free for a client; mapping it costs no log memory.
        let f = memfd(0);
        f.set_len(1 << 44).expect("sparse");
        dma.map(1 << 44, 1 << 44, DmaProt::READ_WRITE, Some((f, 0)))
            .expect("huge window");
        assert_eq!(
            dma.log_bytes(),
            0,
            "nothing allocated before logging starts"
        );
        let e = dma
            .start_logging(4096)
            .expect_err("1 GiB of bitmaps is over budget");
        assert!(matches!(e, DmaError::LogBudget { .. }), "{e:?}");
        assert_eq!(e.errno(), libc::ENOMEM);
        assert_eq!(dma.logging(), None, "no session was started");
        assert_eq!(dma.log_bytes(), 0);
        // A budget that fits: allocated then, and given back at unmap.
        dma.unmap(1 << 44, 1 << 44).expect("unmap");
        let f = memfd(0);
        f.set_len(1 << 36).expect("sparse");
        dma.map(1 << 44, 1 << 36, DmaProt::READ_WRITE, Some((f, 0)))
            .expect("64 GiB window");
        dma.set_log_budget(DirtyLog::bytes_for(1 << 36));
        dma.start_logging(4096).expect("within the budget");
        assert_eq!(dma.log_bytes(), DirtyLog::bytes_for(1 << 36));
        // A window mapped during the session needs its log too: refused beyond the budget.
        dma.set_log_budget(dma.log_bytes() + 10);
        let e = dma
            .map(
                0x10000,
                0x100000,
                DmaProt::READ_WRITE,
                Some((memfd(0x100000), 0)),
            )
            .expect_err("over budget");
        assert_eq!(e.errno(), libc::ENOMEM);
        assert_eq!(dma.mappings().len(), 1, "the refused window was not mapped");
        dma.unmap(1 << 44, 1 << 36).expect("unmap");
        assert_eq!(dma.log_bytes(), 0);
    }

    #[test]
    fn mappings_are_bounded_by_an_address_space_budget() {
        let dma = DmaSpace::new(8);
        let huge = |len: u64| {
            let f = memfd(0);
            f.set_len(len).expect("sparse");
            f
        };
        // Two windows of 32 TiB fill the budget; a third is refused before it is mapped.
        dma.map(0, 1 << 45, DmaProt::READ_WRITE, Some((huge(1 << 45), 0)))
            .expect("first");
        dma.map(
            1 << 45,
            1 << 45,
            DmaProt::READ_WRITE,
            Some((huge(1 << 45), 0)),
        )
        .expect("second");
        let e = dma
            .map(
                2 << 45,
                1 << 40,
                DmaProt::READ_WRITE,
                Some((huge(1 << 40), 0)),
            )
            .expect_err("over the budget");
        assert_eq!(e.errno(), libc::ENOMEM);
        // Unmapping gives the address space back.
        dma.unmap(0, 1 << 45).expect("unmap");
        dma.map(
            2 << 45,
            1 << 40,
            DmaProt::READ_WRITE,
            Some((huge(1 << 40), 0)),
        )
        .expect("room again");
    }

    #[test]
    fn a_window_larger_than_the_address_space_is_refused() {
        let dma = DmaSpace::new(8);
        let f = memfd(0);
        f.set_len(1 << 50).expect("sparse");
        let e = dma
            .map(0, 1 << 50, DmaProt::READ_WRITE, Some((f, 0)))
            .expect_err("cannot be mapped");
        assert_eq!(e.errno(), libc::ENOMEM);
        assert!(dma.mappings().is_empty());
    }

    #[test]
    fn map_rejects_overlap_and_empty() {
        let dma = DmaSpace::new(8);
        dma.map(
            0x1000,
            0x2000,
            DmaProt::READ_WRITE,
            Some((memfd(0x2000), 0)),
        )
        .expect("map");
        for (iova, size) in [
            (0x0, 0x1001),
            (0x2fff, 0x10),
            (0x1800, 0x10),
            (0x0, 0x10000),
        ] {
            let e = dma
                .map(iova, size, DmaProt::READ_WRITE, None)
                .expect_err("overlap");
            assert_eq!(e.errno(), libc::EEXIST, "{iova:#x}+{size:#x}");
        }
        assert_eq!(
            dma.map(0x5000, 0, DmaProt::READ_WRITE, None)
                .expect_err("empty")
                .errno(),
            libc::EINVAL
        );
        assert_eq!(
            dma.map(u64::MAX - 10, 0x100, DmaProt::READ_WRITE, None)
                .expect_err("wrap")
                .errno(),
            libc::EINVAL
        );
        // Adjacent windows are fine.
        dma.map(0x0, 0x1000, DmaProt::READ_WRITE, None)
            .expect("adjacent below");
        dma.map(0x3000, 0x1000, DmaProt::READ_WRITE, None)
            .expect("adjacent above");
        assert_eq!(dma.mappings().len(), 3);
    }

    #[test]
    fn unmap_removes_whole_windows_only() {
        let dma = DmaSpace::new(8);
        dma.map(0x1000, 0x2000, DmaProt::READ_WRITE, None)
            .expect("map");
        assert_eq!(
            dma.unmap(0x1000, 0x1000).expect_err("partial").errno(),
            libc::EINVAL
        );
        assert_eq!(
            dma.unmap(0x9000, 0x1000)
                .expect("never mapped: nothing to do"),
            0,
            "like type1, an unmap of nothing succeeds"
        );
        assert_eq!(dma.unmap(0x1000, 0x2000).expect("exact"), 1);
        assert!(dma.mappings().is_empty());
        // One large range removes every window inside it (vIOMMU invalidation).
        for i in 0..4u64 {
            dma.map(0x10000 * (i + 1), 0x1000, DmaProt::READ_WRITE, None)
                .expect("map");
        }
        assert_eq!(dma.unmap(0, 1 << 39).expect("range"), 4);
        assert!(dma.mappings().is_empty());
        // A range that ends exactly at 2^64 is valid.
        dma.map(0xfff0_0000, 0x1000, DmaProt::READ_WRITE, None)
            .expect("map");
        assert_eq!(
            dma.unmap(0xfef0_0000, 0u64.wrapping_sub(0xfef0_0000))
                .expect("to the top"),
            1
        );
        assert_eq!(dma.unmap(0, u64::MAX).expect("nothing left"), 0);
    }

    #[test]
    fn access_spans_windows_and_lands_in_the_file() {
        let f1 = memfd(0x1000);
        let f2 = memfd(0x1000);
        let mut f1c = f1.try_clone().expect("clone");
        let dma = DmaSpace::new(8);
        dma.map(0x10000, 0x1000, DmaProt::READ_WRITE, Some((f1, 0)))
            .expect("map1");
        dma.map(0x11000, 0x1000, DmaProt::READ_WRITE, Some((f2, 0)))
            .expect("map2");
        let data: Vec<u8> = (0..0x200u32).map(|i| i as u8).collect();
        dma.write(0x10f00, &data).expect("write across the seam");
        let mut back = vec![0u8; 0x200];
        dma.read(0x10f00, &mut back).expect("read back");
        assert_eq!(back, data);
        // The bytes really are in the client's file.
        use std::os::unix::fs::FileExt;
        let mut head = [0u8; 4];
        f1c.read_exact_at(&mut head, 0xf00).expect("pread");
        assert_eq!(head, [0, 1, 2, 3]);
        f1c.flush().expect("flush");
    }

    #[test]
    fn bad_accesses_fail_before_writing_anything() {
        let f = memfd(0x1000);
        let fc = f.try_clone().expect("clone");
        let dma = DmaSpace::new(8);
        dma.map(0x1000, 0x1000, DmaProt::READ_WRITE, Some((f, 0)))
            .expect("map");
        dma.map(0x3000, 0x1000, DmaProt::READ_ONLY, None)
            .expect("ro map");
        // Runs off the end of the window into a hole.
        let e = dma.write(0x1ff0, &[0xaa; 0x20]).expect_err("hole");
        assert_eq!(e.errno(), libc::EFAULT);
        use std::os::unix::fs::FileExt;
        let mut b = [0u8; 0x10];
        fc.read_exact_at(&mut b, 0xff0).expect("pread");
        assert_eq!(
            b, [0u8; 0x10],
            "nothing may be written when the access is invalid"
        );
        assert_eq!(
            dma.write(0x3000, &[1]).expect_err("ro").errno(),
            libc::EPERM
        );
        assert_eq!(
            dma.read(u64::MAX - 1, &mut [0; 4])
                .expect_err("wrap")
                .errno(),
            libc::EFAULT
        );
    }

    #[test]
    fn message_windows_go_through_the_remote() {
        struct Echo(std::sync::Mutex<Vec<u8>>);
        impl RemoteDma for Echo {
            fn read(&self, iova: u64, buf: &mut [u8]) -> std::result::Result<(), i32> {
                let mem = self.0.lock().map_err(|_| libc::EIO)?;
                let off = iova as usize - 0x8000;
                buf.copy_from_slice(mem.get(off..off + buf.len()).ok_or(libc::EFAULT)?);
                Ok(())
            }
            fn write(&self, iova: u64, data: &[u8]) -> std::result::Result<(), i32> {
                let mut mem = self.0.lock().map_err(|_| libc::EIO)?;
                let off = iova as usize - 0x8000;
                mem.get_mut(off..off + data.len())
                    .ok_or(libc::EFAULT)?
                    .copy_from_slice(data);
                Ok(())
            }
        }
        let dma = DmaSpace::new(8);
        dma.map(0x8000, 0x1000, DmaProt::READ_WRITE, None)
            .expect("map");
        assert_eq!(
            dma.write_u64(0x8000, 7).expect_err("no remote").errno(),
            libc::ENOTCONN
        );
        dma.set_remote(Some(Arc::new(Echo(std::sync::Mutex::new(vec![0; 0x1000])))));
        dma.write_u64(0x8010, 0xdead_beef).expect("remote write");
        assert_eq!(dma.read_u64(0x8010).expect("remote read"), 0xdead_beef);
    }

    /// Pages (relative to the report's start, in report pages) whose bit is set.
    fn set_bits(bitmap: &[u8]) -> Vec<u64> {
        (0..bitmap.len() as u64 * 8)
            .filter(|k| bitmap[(k / 8) as usize] >> (k % 8) & 1 == 1)
            .collect()
    }

    #[test]
    fn device_writes_are_logged_dirty() {
        let dma = DmaSpace::new(8);
        dma.map(
            0x100000,
            0x10000,
            DmaProt::READ_WRITE,
            Some((memfd(0x10000), 0)),
        )
        .expect("map");
        dma.write(0x100000, &[1]).expect("write before the session");
        assert_eq!(
            dma.start_logging(512).expect("start"),
            4096,
            "4 KiB at least"
        );
        dma.write(0x100000 + 0x3000 + 5, &[1, 2, 3])
            .expect("write page 3");
        dma.write_u64(0x100000 + 0xfff8, 9).expect("write page 15");
        dma.read_u64(0x100000 + 0x5000)
            .expect("reads are not logged");
        let mut bits = [0u8; 8];
        dma.report_dirty(0x100000, 0x10000, 4096, &mut bits)
            .expect("report");
        assert_eq!(
            set_bits(&bits),
            [3, 15],
            "the write before START is forgotten"
        );
        dma.report_dirty(0x100000, 0x10000, 4096, &mut bits)
            .expect("report again");
        assert!(set_bits(&bits).is_empty(), "a report reads and clears");
        dma.write(0x100000 + 0x9000, &[1]).expect("write page 9");
        dma.report_dirty(0x100000, 0x10000, 0x8000, &mut bits)
            .expect("coarse report");
        assert_eq!(
            set_bits(&bits),
            [1],
            "page 9 of 4K is in the second 32K page"
        );
    }

    #[test]
    fn reports_need_a_session_a_page_size_and_room() {
        let dma = DmaSpace::new(8);
        dma.map(
            0x10000,
            0x10000,
            DmaProt::READ_WRITE,
            Some((memfd(0x10000), 0)),
        )
        .expect("map");
        let mut bits = [0u8; 8];
        let e = dma
            .report_dirty(0x10000, 0x10000, 4096, &mut bits)
            .expect_err("no session");
        assert_eq!(e.errno(), libc::EINVAL);
        assert_eq!(
            dma.start_logging(3).expect_err("page size").errno(),
            libc::EINVAL
        );
        dma.start_logging(4096).expect("start");
        assert_eq!(
            dma.start_logging(4096).expect_err("twice").errno(),
            libc::EBUSY
        );
        dma.write(0x10000 + 0x2000, &[1]).expect("write page 2");
        for (page, room) in [(2048, 8), (4096 + 1, 8), (4096, 7)] {
            let e = dma
                .report_dirty(0x10000, 0x10000, page, &mut bits[..room])
                .expect_err("bad report");
            assert_eq!(e.errno(), libc::EINVAL, "page {page} room {room}");
        }
        let e = dma
            .report_dirty(u64::MAX - 0xfff, 0x2000, 4096, &mut bits)
            .expect_err("wraps");
        assert_eq!(e.errno(), libc::EINVAL);
        // Nothing was cleared by the failed calls.
        dma.report_dirty(0x10000, 0x10000, 4096, &mut bits)
            .expect("report");
        assert_eq!(set_bits(&bits), [2]);
        dma.stop_logging();
        assert_eq!(dma.logging(), None);
        dma.report_dirty(0x10000, 0x10000, 4096, &mut bits)
            .expect_err("stopped");
        dma.start_logging(4096).expect("a new session");
    }

    /// A tiny deterministic generator for the model tests.
    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[test]
    fn reports_of_any_range_match_a_model() {
        const PAGE: u64 = 4096;
        // Windows at awkward places: word-aligned, misaligned, a message-only one, holes.
        let windows: [(u64, u64, bool); 5] = [
            (0, 64 * PAGE, true),
            (64 * PAGE, 100 * PAGE, true),
            (200 * PAGE, 7 * PAGE, true),
            (207 * PAGE, 3 * PAGE, false),
            (300 * PAGE, 130 * PAGE, true),
        ];
        let dma = DmaSpace::new(8);
        for (iova, size, fd) in windows {
            let backing = fd.then(|| (memfd(size as usize), 0));
            dma.map(iova, size, DmaProt::READ_WRITE, backing)
                .expect("map");
        }
        dma.start_logging(PAGE).expect("start");
        let mapped = |p: u64| {
            windows
                .iter()
                .any(|&(i, s, fd)| fd && p * PAGE >= i && p * PAGE < i + s)
        };
        let mut model = std::collections::BTreeSet::new();
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        for round in 0..400 {
            for _ in 0..rng.below(40) {
                let p = rng.below(430);
                if mapped(p) {
                    dma.mark_dirty(p * PAGE + rng.below(PAGE), 1).expect("mark");
                    model.insert(p);
                }
            }
            let shift = [0u32, 0, 0, 1, 3][rng.below(5) as usize];
            let page_size = PAGE << shift;
            let first = rng.below(430);
            let pages = 1 + rng.below(430 - first);
            let (iova, len) = (first * PAGE, pages * PAGE);
            let mut out = vec![0xa5u8; 8 * (pages.div_ceil(64) as usize) + 16];
            dma.report_dirty(iova, len, page_size, &mut out)
                .expect("report");
            let want: Vec<u64> = model
                .range(first..first + pages)
                .map(|p| (p - first) / (1 << shift))
                .collect::<std::collections::BTreeSet<u64>>()
                .into_iter()
                .collect();
            let used = 8 * (len.div_ceil(page_size).div_ceil(64) as usize);
            assert_eq!(
                set_bits(&out[..used]),
                want,
                "round {round}: {iova:#x}+{len:#x}/{page_size:#x}"
            );
            assert!(
                out[used..].iter().all(|&b| b == 0xa5),
                "round {round}: wrote past the bitmap"
            );
            // Pages inside the range are reported; the rest stays logged.
            model.retain(|&p| p < first || p >= first + pages);
        }
    }

    #[test]
    fn writes_racing_with_reports_are_never_lost() {
        const PAGES: u64 = 4096;
        let dma = Arc::new(DmaSpace::new(8));
        dma.map(
            0,
            PAGES * 4096,
            DmaProt::READ_WRITE,
            Some((memfd((PAGES * 4096) as usize), 0)),
        )
        .expect("map");
        dma.start_logging(4096).expect("start");
        let writer = {
            let dma = Arc::clone(&dma);
            std::thread::spawn(move || {
                for p in 0..PAGES {
                    dma.write_u64(p * 4096, p).expect("write");
                }
            })
        };
        let mut seen = vec![false; PAGES as usize];
        let mut out = vec![0u8; (PAGES / 8) as usize];
        let mut collect = |dma: &DmaSpace, seen: &mut Vec<bool>| {
            dma.report_dirty(0, PAGES * 4096, 4096, &mut out)
                .expect("report");
            for k in set_bits(&out) {
                assert!(
                    !seen[k as usize],
                    "page {k} reported twice but written once"
                );
                seen[k as usize] = true;
            }
        };
        while !writer.is_finished() {
            collect(&dma, &mut seen);
        }
        writer.join().expect("writer");
        collect(&dma, &mut seen);
        assert!(
            seen.iter().all(|&s| s),
            "every page written was reported exactly once"
        );
    }

    #[test]
    fn unmap_with_dirty_bitmap_outside_a_session_reports_everything() {
        let dma = DmaSpace::new(8);
        dma.map(
            0x10000,
            0x4000,
            DmaProt::READ_WRITE,
            Some((memfd(0x4000), 0)),
        )
        .expect("map");
        let mut bits = [0u8; 8];
        dma.unmap_take_dirty(0x10000, 0x4000, 4096, &mut bits)
            .expect("unmap");
        assert_eq!(
            set_bits(&bits),
            [0, 1, 2, 3],
            "never logged: every page may be dirty"
        );
    }

    #[test]
    fn unmap_with_dirty_bitmap_is_all_or_nothing() {
        let dma = DmaSpace::new(8);
        dma.map(
            0x10000,
            0x4000,
            DmaProt::READ_WRITE,
            Some((memfd(0x4000), 0)),
        )
        .expect("map");
        dma.start_logging(4096).expect("log");
        dma.write(0x10000 + 0x3000, &[1]).expect("write page 3");
        let mut bits = [0u8; 8];
        let e = dma
            .unmap_take_dirty(0x10000, 0x2000, 4096, &mut bits)
            .expect_err("splits the window");
        assert_eq!(e.errno(), libc::EINVAL);
        assert_eq!(dma.mappings().len(), 1, "window kept");
        assert_eq!(
            dma.unmap_take_dirty(0x10000, 0x4000, 4096, &mut bits)
                .expect("unmap"),
            1
        );
        assert_eq!(set_bits(&bits), [3], "bits survived the failed call");
        assert!(dma.mappings().is_empty());
    }

    #[test]
    fn windows_past_the_end_of_the_file_are_refused() {
        let dma = DmaSpace::new(8);
        let e = dma
            .map(
                0x1000,
                0x2000,
                DmaProt::READ_WRITE,
                Some((memfd(0x1000), 0)),
            )
            .expect_err("file too short");
        assert_eq!(e.errno(), libc::EINVAL);
        let e = dma
            .map(
                0x1000,
                0x1000,
                DmaProt::READ_WRITE,
                Some((memfd(0x1000), 0x1000)),
            )
            .expect_err("offset at the end");
        assert_eq!(e.errno(), libc::EINVAL);
        assert!(dma.mappings().is_empty());
    }
}
