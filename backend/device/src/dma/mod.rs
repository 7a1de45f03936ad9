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
//! **Concurrency.** Engines access the space under the table's read lock, held for one access.
//! Map and unmap change the table under its write lock, briefly: the device's [`DmaObserver`]
//! (VFIO pinning a window, a GPU registering it: seconds for large windows) is called with no
//! lock of the space held, so engines keep translating through the other windows meanwhile.
//! Every window has a state and a generation (unique in the space):
//!
//! - `DMA_MAP` reserves the range under the write lock (a *pending* window: it counts against
//!   the map limit, an overlapping map is refused, accesses see nothing there), calls the
//!   observer, then publishes the window under the write lock (or removes the reservation if
//!   the observer refused it). An access can only reach a window the observer accepted.
//! - `DMA_UNMAP` marks the windows *retiring* under the write lock (accesses no longer find
//!   them; the write lock waited for the accesses in flight), calls the observer's `unmapped`,
//!   then removes them and drops their mmaps outside the lock. An unmap whose range holds a
//!   window whose map or unmap is in flight waits for that to finish first (without a lock).
//! - [`DmaSpace::window_backing`] names the window's generation, and
//!   [`DmaSpace::window_is_current`] says whether that very window is still mapped: a device
//!   that learns of a window by looking (not through its observer) checks it under its own
//!   lock before it keeps what it built, so it never keeps a window unmapped meanwhile.
//!
//! Lock order: the log mutex, then the table, then the settle mutex (never the other way);
//! the observer and dirty-source slots are read alone (the `Arc` is cloned out). No lock of
//! the space is held while an observer or the remote transport runs.

use std::collections::HashSet;
use std::fmt;
use std::fs::File;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Condvar, Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use vm_memory::VolatileSlice;
use vm_memory::bitmap::BitmapSlice;

mod backing;
mod error;
mod lifecycle;
mod log;
mod remote;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_observer;

pub use crate::DmaProt;
pub use crate::dirty::DIRTY_PAGE_SIZE;
use crate::{DirtySource, DmaObserver};
use backing::{Access, FdWindow, Objects, guarded_piece};
pub use backing::{MAP_BUDGET, open_proc_mem};
pub use error::{DmaError, Result};
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

enum Backing {
    Fd(Arc<FdWindow>),
    Message,
}

/// Where a window is in its life (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Reserved: its observer is being told of a map; accesses do not see it.
    Pending,
    /// Mapped: accesses reach it.
    Live,
    /// Mapped, and its observer is being told of it again ([`DmaSpace::replay_to_observer`]:
    /// a replacement's device taking restored tables): accesses reach it, as they did before
    /// (the device built on these tables may be running already), and an unmap waits for it
    /// as for a pending one.
    Replaying,
    /// Being unmapped: its observer is being told; accesses do not see it.
    Retiring,
}

impl State {
    /// Whether accesses reach a window in this state.
    fn reachable(self) -> bool {
        matches!(self, State::Live | State::Replaying)
    }
}

/// One DMA window.
struct Mapping {
    iova: u64,
    size: u64,
    prot: DmaProt,
    backing: Backing,
    state: State,
    /// Unique in the space: a window mapped again at the same IOVA has another.
    generation: u64,
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
    /// The window's generation ([`DmaSpace::window_is_current`]).
    pub generation: u64,
}

#[derive(Default)]
struct Table {
    /// Sorted by IOVA, non-overlapping; every state (pending and retiring windows hold their
    /// range).
    maps: Vec<Mapping>,
    /// The last generation handed out.
    generation: u64,
}

impl Table {
    /// The live mapping containing `iova`, if any.
    fn find(&self, iova: u64) -> Option<&Mapping> {
        let idx = self.maps.partition_point(|m| m.iova <= iova);
        let m = self.maps.get(idx.checked_sub(1)?)?;
        (iova < m.end() && m.state.reachable()).then_some(m)
    }

    /// Index of the window of `generation` starting at `iova`.
    fn index_of(&self, iova: u64, generation: u64) -> Option<usize> {
        let idx = self.maps.partition_point(|m| m.iova < iova);
        self.maps
            .get(idx)
            .is_some_and(|m| m.iova == iova && m.generation == generation)
            .then_some(idx)
    }

    /// Takes the windows whose generations are in `which` out of the table.
    fn extract(&mut self, which: &HashSet<u64>) -> Vec<Mapping> {
        let mut out = Vec::with_capacity(which.len());
        if which.is_empty() {
            return out;
        }
        let mut kept = Vec::with_capacity(self.maps.len().saturating_sub(which.len()));
        for m in std::mem::take(&mut self.maps) {
            if which.contains(&m.generation) {
                out.push(m);
            } else {
                kept.push(m);
            }
        }
        self.maps = kept;
        out
    }
}

/// A window whose observer is being told, taken from the table under its lock.
struct Told {
    iova: u64,
    size: u64,
    prot: DmaProt,
    generation: u64,
    window: Option<Arc<FdWindow>>,
}

impl Told {
    fn of(m: &Mapping) -> Self {
        Told {
            iova: m.iova,
            size: m.size,
            prot: m.prot,
            generation: m.generation,
            window: match &m.backing {
                Backing::Fd(w) => Some(Arc::clone(w)),
                Backing::Message => None,
            },
        }
    }

    fn file(&self) -> Option<(&File, u64)> {
        self.window.as_ref().and_then(|w| w.file())
    }
}

/// The client's DMA windows, shared between the server (which maps and unmaps) and the device's
/// engines (which access them).
pub struct DmaSpace {
    /// The windows; read-locked for one access, write-locked briefly to change the table
    /// (never across an observer call or other blocking work).
    table: RwLock<Table>,
    /// Counts pending and retiring windows that left that state (under the table's lock
    /// or after it); an unmap waits on `settle_cv` for those in its range.
    settled: Mutex<u64>,
    settle_cv: Condvar,
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
            settled: Mutex::new(0),
            settle_cv: Condvar::new(),
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
            .filter(|m| m.state.reachable())
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
            generation: m.generation,
        })
    }

    /// Whether the window of `generation` ([`WindowBacking::generation`]) still holds `iova`
    /// and is mapped: `false` once it is being unmapped (its observer may be running).
    pub fn window_is_current(&self, iova: u64, generation: u64) -> bool {
        self.read_table()
            .find(iova)
            .is_some_and(|m| m.generation == generation)
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
