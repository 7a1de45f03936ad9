//! The DMA space: the client's DMA windows as the device sees them.
//!
//! Every `DMA_MAP` the client sends becomes one mapping keyed by IOVA. A map that carries a
//! file descriptor is mmapped once (through `vm-memory`, so accesses are volatile and no Rust
//! reference ever points into guest memory) and gets a [`DirtyLog`] that records every write
//! the device makes, for DMA dirty logging (`DMA_LOGGING_*`, `DMA_UNMAP` with a bitmap). A map without a descriptor is reachable only
//! through messages: the server installs a [`RemoteDma`] that turns accesses into `DMA_READ` /
//! `DMA_WRITE` commands to the client.
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
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};

use vm_memory::bitmap::{Bitmap, BitmapSlice};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, MmapRegion, VolatileMemory, VolatileSlice};

pub use crate::dirty::DIRTY_PAGE_SIZE;
use crate::dirty::DirtyLog;

/// A volatile view of mmapped DMA memory; writes through it mark pages dirty.
type DmaSlice<'a> = VolatileSlice<'a, vm_memory::bitmap::BS<'a, DirtyLog>>;

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
    /// No mapping matches the unmap request exactly.
    #[error("no DMA mapping at {iova:#x}+{size:#x}")]
    NoSuchMapping {
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
            DmaError::NoSuchMapping { .. } => libc::ENOENT,
            DmaError::TooManyMappings { .. } => libc::ENOSPC,
            DmaError::Mmap { .. } => libc::ENOMEM,
            DmaError::Unmapped { .. } | DmaError::Overflow { .. } => libc::EFAULT,
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
    Mmap(Arc<MmapRegion<DirtyLog>>),
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
            max_maps,
        }
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
                let len = usize::try_from(size).map_err(|_| DmaError::BadWindow { iova, size })?;
                // A window past the end of the file would fault (SIGBUS) on first access.
                let file_len = file.metadata().map(|m| m.len()).unwrap_or(0);
                if offset.checked_add(size).is_none_or(|e| e > file_len) {
                    return Err(DmaError::BadWindow { iova, size });
                }
                let mut mprot = 0;
                if prot.read {
                    mprot |= libc::PROT_READ;
                }
                if prot.write {
                    mprot |= libc::PROT_WRITE;
                }
                let region = MmapRegionBuilder::new_with_bitmap(len, DirtyLog::new(len))
                    .with_file_offset(FileOffset::new(file, offset))
                    .with_mmap_prot(mprot)
                    .with_mmap_flags(libc::MAP_SHARED | libc::MAP_NORESERVE)
                    .build()
                    .map_err(|source| DmaError::Mmap { iova, source })?;
                Backing::Mmap(Arc::new(region))
            }
        };
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
    /// exact match), a range may cover several windows: QEMU with a vIOMMU invalidates large
    /// ranges at once. A window that straddles the range boundary is an error (nothing is
    /// removed), and so is a range that covers no window.
    pub fn unmap(&self, iova: u64, size: u64) -> Result<usize> {
        let removed: Vec<Mapping> = {
            let mut table = self.write_table();
            let (first, stop) = Self::covered(&table, iova, size)?;
            table.maps.drain(first..stop).collect()
        };
        // The mmaps go away here, outside the lock.
        Ok(removed.len())
    }

    /// Removes every window (client `DMA_UNMAP` with the ALL flag, or client disconnect).
    pub fn unmap_all(&self) {
        let removed = std::mem::take(&mut self.write_table().maps);
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
                mmapped: matches!(m.backing, Backing::Mmap(_)),
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
                    Backing::Mmap(region) => {
                        // Both fit in usize: the piece is within `len`.
                        let (off, piece) = ((cur - m.iova) as usize, (piece_end - cur) as usize);
                        let slice = region
                            .get_slice(off, piece)
                            .map_err(|_| DmaError::Unmapped { iova: cur })?;
                        f((cur - iova) as usize, Piece::Mem(slice));
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
            if let Backing::Mmap(region) = &m.backing {
                // Both fit in usize: the window was mmapped.
                region
                    .bitmap()
                    .mark_dirty((cur - m.iova) as usize, (piece_end - cur) as usize);
            }
            cur = piece_end;
        }
        Ok(())
    }

    fn log_state(&self) -> MutexGuard<'_, LogState> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `DMA_LOGGING_START`: clears every window's log and starts a logging session. Every
    /// fd-backed window is logged, whatever ranges the client named (logging more than asked
    /// is allowed); windows mapped later start clean. `page_size` is the client's hint: the
    /// returned page size is what the log keeps (4 KiB, or the hint if larger). Reports may ask
    /// for any power-of-two page size of at least 4 KiB.
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
        for m in &table.maps {
            if let Backing::Mmap(region) = &m.backing {
                region.bitmap().clear();
            }
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
                if let Backing::Mmap(region) = &m.backing {
                    region.bitmap().flip();
                    windows.push((m.iova, Arc::clone(region)));
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
    /// without a logging session. Fails without touching anything when [`DmaSpace::unmap`]
    /// would.
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
            let windows: Vec<(u64, Arc<MmapRegion<DirtyLog>>)> = removed
                .iter()
                .filter_map(|m| match &m.backing {
                    Backing::Mmap(region) => {
                        region.bitmap().flip();
                        Some((m.iova, Arc::clone(region)))
                    }
                    Backing::Message => None,
                })
                .collect();
            collect_dirty(&windows, iova, last, page_size, out);
            removed
        };
        Ok(removed.len())
    }

    /// The index range of the windows lying entirely inside `[iova, iova+len)`; errors if a
    /// window straddles the range or none is inside. The range may end exactly at 2^64.
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
        if hit.is_empty() {
            return Err(DmaError::NoSuchMapping { iova, size: len });
        }
        Ok((first, stop))
    }
}

/// Logging session state; its mutex also serializes reports (a drain owns the inactive
/// bitmaps it flipped until it is done).
#[derive(Default)]
struct LogState {
    /// Page size of the running session.
    page_size: Option<u64>,
    /// Windows of the report in progress (kept to reuse the allocation).
    scratch: Vec<(u64, Arc<MmapRegion<DirtyLog>>)>,
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
    windows: &[(u64, Arc<MmapRegion<DirtyLog>>)],
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
    for (start, region) in windows {
        let log = region.bitmap();
        let size = region.size() as u64;
        let end_last = start + (size - 1); // Window fits the address space.
        // Fast path: 4 KiB pages, whole window inside the range, window starting on a bitmap
        // word: the window's log *is* this part of the report, word for word.
        let whole = *start >= iova && end_last <= last;
        let off_pages = start.wrapping_sub(iova) / page;
        if page_size == page && whole && off_pages % 64 == 0 {
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
            dma.unmap(0x9000, 0x1000).expect_err("never mapped").errno(),
            libc::ENOENT
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
        assert_eq!(
            dma.unmap(0, u64::MAX).expect_err("nothing left").errno(),
            libc::ENOENT
        );
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
    fn unmap_with_dirty_bitmap_is_all_or_nothing() {
        let dma = DmaSpace::new(8);
        dma.map(
            0x10000,
            0x4000,
            DmaProt::READ_WRITE,
            Some((memfd(0x4000), 0)),
        )
        .expect("map");
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
