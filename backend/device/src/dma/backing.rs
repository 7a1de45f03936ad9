//! How a window's bytes are reached: one mapping per memory object the client maps, direct
//! loads and stores for memfds sealed against shrinking, and the fault-safe paths for every
//! other file (see the [module docs](super)).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock, Weak};

use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{FileOffset, MmapRegion, VolatileMemory};

use super::{Dir, DmaError, DmaProt, DmaSlice, DmaSpace, Piece, Result};
use crate::dirty::DirtyLog;

/// How much a guarded access moves per system call.
const GUARDED_CHUNK: usize = 64 << 10;

/// A window backed by the client's file: mapped into this process, accessed directly or
/// through the fault-safe path (see the module docs), with its dirty log.
pub(super) struct FdWindow {
    /// The mapping of the client's file the window lies in; the window starts `delta` bytes
    /// into it.
    pub(super) obj: Arc<ObjectMap>,
    pub(super) delta: usize,
    pub(super) len: usize,
    /// How accesses reach the bytes.
    pub(super) access: Access,
    pub(super) log: DirtyLog,
}

impl FdWindow {
    /// The volatile view of `[off, off+len)` of the window (direct windows only).
    pub(super) fn slice(&self, off: usize, len: usize) -> Option<DmaSlice<'_>> {
        self.obj
            .map
            .get_slice(self.delta.checked_add(off)?, len)
            .ok()
    }

    /// The window's backing file and the offset of its first byte in it.
    pub(super) fn file(&self) -> Option<(&File, u64)> {
        let fo = self.obj.map.file_offset()?;
        Some((fo.file(), self.obj.start + self.delta as u64))
    }

    /// This process's address of byte `off` of the window.
    pub(super) fn addr(&self, off: usize) -> u64 {
        self.obj.map.as_ptr() as u64 + (self.delta + off) as u64
    }
}

/// One mapping of (part of) a client's file, shared by every window that lies in it.
pub(super) struct ObjectMap {
    pub(super) map: MmapRegion<()>,
    /// File offset of the mapping's first byte.
    pub(super) start: u64,
    /// The space's count of mapped bytes, given back when the mapping goes.
    pub(super) mapped: Arc<AtomicU64>,
}

impl Drop for ObjectMap {
    fn drop(&mut self) {
        self.mapped
            .fetch_sub(self.map.size() as u64, Ordering::Relaxed);
    }
}

impl ObjectMap {
    /// Where file range `[offset, offset+size)` starts in this mapping, if it lies inside.
    pub(super) fn place(&self, offset: u64, size: u64) -> Option<usize> {
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

/// Opens the fault-safe path to this process's memory now (it is otherwise opened at the
/// first window that needs it): a process about to be jailed, whose rules may not reach
/// procfs files opened later, calls it first. Whether it is available.
pub fn open_proc_mem() -> bool {
    proc_mem().is_some()
}

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

/// Local filesystems whose page cache a device may read and write: an access to them finishes
/// (or fails) on its own. Everything else — FUSE, whose server may be the client itself and
/// never answer, network filesystems, device nodes, procfs and the like — could block a device
/// thread forever or has no memory behind it, and is refused.
const LOCAL_FILESYSTEMS: [(i64, &str); 6] = [
    (TMPFS_MAGIC, "tmpfs"),
    (HUGETLBFS_MAGIC, "hugetlbfs"),
    (0xef53, "ext2/3/4"),
    (0x5846_5342, "xfs"),
    (0x9123_683e, "btrfs"),
    (0x794c_7630, "overlayfs"),
];

/// Whether loads and stores into a shared mapping of `file` can never fault, and the
/// alignment its mmap offsets need; `Err(what)` for a file that cannot back DMA memory.
fn access_policy(file: &File) -> std::io::Result<std::result::Result<(Access, u64), String>> {
    let meta = file.metadata()?;
    if !meta.file_type().is_file() {
        return Ok(Err(format!("not a regular file ({:?})", meta.file_type())));
    }
    let fs = rustix::fs::fstatfs(file)?;
    #[allow(clippy::unnecessary_cast)] // f_type's width differs between targets
    let magic = fs.f_type as i64;
    if !LOCAL_FILESYSTEMS.iter().any(|&(m, _)| m == magic) {
        return Ok(Err(format!(
            "on a filesystem (statfs type {magic:#x}) that is not one of {}",
            LOCAL_FILESYSTEMS.map(|(_, n)| n).join(", ")
        )));
    }
    if magic == HUGETLBFS_MAGIC {
        // A punched hole may find no free huge page: never direct; and no write(2).
        return Ok(Ok((Access::ProcMem, (fs.f_bsize as u64).max(4096))));
    }
    let sealed = magic == TMPFS_MAGIC
        && rustix::fs::fcntl_get_seals(file)
            .is_ok_and(|s| s.contains(rustix::fs::SealFlags::SHRINK));
    Ok(Ok((
        if sealed { Access::Direct } else { Access::File },
        4096,
    )))
}

/// How the device's accesses reach a window's bytes (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Access {
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
pub(super) struct Objects {
    pub(super) maps: HashMap<(u64, u64, bool), Weak<ObjectMap>>,
    /// Bytes of address space the live mappings take.
    pub(super) mapped: Arc<AtomicU64>,
    /// Prune dead entries when the table has grown to this size.
    pub(super) prune_at: usize,
}

impl Objects {
    /// A mapping of `file` that holds `[offset, offset+size)`, and where that range starts in
    /// it: the object's shared mapping if one exists, else a new one (of the whole file when
    /// it is at most [`OBJECT_MAP_MAX`], aligned to `align`). `file` (the client's copy of
    /// the descriptor) is closed when an existing mapping serves. Read-only and read-write
    /// opens of one object are kept apart.
    pub(super) fn map(
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

/// Accesses `[off, off + len)` of a guarded window with `pread`/`pwrite` on the client's file
/// (or, for hugetlbfs, through `/proc/self/mem` at the mapping), in chunks of a stack bounce
/// buffer: the kernel copies, and a page it cannot have (a truncated file, a hole with no
/// memory to fill it) fails the chunk with an error instead of raising SIGBUS.
/// `iova` is the address of `off`, `done` its offset within the whole access. A write that
/// fails part-way leaves the chunks before it written.
pub(super) fn guarded_piece<F>(
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

impl DmaSpace {
    /// Maps the client's file for a window (outside every lock: mmap can be slow).
    pub(super) fn map_file(
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
        let (access, align) = access_policy(&file)
            .map_err(backing_err)?
            .map_err(|what| DmaError::UnsupportedBacking { iova, what })?;
        // A window past the end of the file would fault on first access.
        let file_len = file.metadata().map_err(backing_err)?.len();
        if offset.checked_add(size).is_none_or(|e| e > file_len) {
            return Err(bad);
        }
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
}
