//! The store's file: opened without following a symbolic link, checked before redb reads
//! it, created private (mode 0600, whatever the umask) and never re-initialised.
//!
//! redb initialises an empty file as a new database and panics on a file shorter than its
//! header says (an `assert!` in its page manager; redb 2.6). Either would lose every lease
//! without a word, or kill the daemon with a panic, on a store that a full disk, a bad copy
//! or an editor emptied or cut. So an existing file is checked first ([`check_header`]: redb's
//! magic number, the page size this build uses, and the length its header's layout needs);
//! one that fails is refused as [`PoolError::StoreDamaged`] and left as it is. A new store is
//! made under a temporary name, initialised by redb, and only then renamed into place: a
//! process killed while it is made leaves no empty store behind. What the check cannot see
//! (a damaged page deeper in the file) is redb's to report; should redb panic on it anyway,
//! the panic is caught ([`no_panic`]) and reported the same way: a panic there is a damaged
//! file, not a bug of the daemon's that should take it down with an exit status of 101.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use redb::{Builder, Database};
use rustix::fs::{Mode, OFlags};

use crate::error::{PoolError, StoreDamage};

/// redb's magic number, the first bytes of every redb file (redb 2's file format).
const MAGIC: [u8; 9] = [b'r', b'e', b'd', b'b', 0x1A, 0x0A, 0xA9, 0x0D, 0x0A];
/// The page size [`Builder`] uses by default, which redb asserts the header has.
const PAGE_SIZE: u64 = 4096;
/// The header's fields: page size, pages of each region's header, data pages of a full
/// region, full regions, data pages of the trailing region (little-endian `u32`s).
const PAGE_SIZE_AT: usize = 12;
const REGION_HEADER_PAGES_AT: usize = 16;
const REGION_DATA_PAGES_AT: usize = 20;
const FULL_REGIONS_AT: usize = 24;
const TRAILING_PAGES_AT: usize = 28;
/// Bytes of the header read by the check.
const HEADER_BYTES: usize = 32;

/// Opens the store at `path`: an existing file once it passes [`check_header`], a missing
/// one created (0600) and initialised.
pub(super) fn open(path: &Path) -> Result<Database, PoolError> {
    let flags = OFlags::RDWR | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    match rustix::fs::open(path, flags, Mode::empty()) {
        Ok(fd) => {
            let file = File::from(fd);
            let damaged = |problem| PoolError::StoreDamaged {
                path: path.into(),
                problem,
            };
            let meta = file.metadata().map_err(|e| io_error(path, e))?;
            if !meta.is_file() {
                return Err(damaged(StoreDamage::NotAFile));
            }
            check_header(&file, meta.len()).map_err(damaged)?;
            no_panic(path, || Builder::new().create_file(file))
        }
        Err(rustix::io::Errno::NOENT) => create(path),
        Err(e) => Err(io_error(path, e.into())),
    }
}

fn io_error(path: &Path, source: io::Error) -> PoolError {
    PoolError::StoreFile {
        path: path.into(),
        source,
    }
}

/// Creates a new store at `path` (absent when called): made and initialised under a
/// temporary name, then renamed into place unless another process made one meanwhile (then
/// that one is opened).
fn create(path: &Path) -> Result<Database, PoolError> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.new-{}", std::process::id()));
    let flags = OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let private = Mode::RUSR | Mode::WUSR;
    let fd = match rustix::fs::open(&tmp, flags, private) {
        Err(rustix::io::Errno::EXIST) => {
            // Left by a process of this pid that was killed while it made the store.
            std::fs::remove_file(&tmp).map_err(|e| io_error(&tmp, e))?;
            rustix::fs::open(&tmp, flags, private)
        }
        r => r,
    }
    .map_err(|e| io_error(&tmp, e.into()))?;
    let made = (|| {
        // The umask may have taken bits of the mode: exactly 0600.
        rustix::fs::fchmod(&fd, private).map_err(|e| io_error(&tmp, e.into()))?;
        let db = no_panic(&tmp, || Builder::new().create_file(File::from(fd)))?;
        let cwd = rustix::fs::CWD;
        match rustix::fs::renameat_with(cwd, &tmp, cwd, path, rustix::fs::RenameFlags::NOREPLACE) {
            Ok(()) => Ok(Some(db)),
            Err(rustix::io::Errno::EXIST) => Ok(None),
            Err(e) => Err(io_error(path, e.into())),
        }
    })();
    match made {
        Ok(Some(db)) => Ok(db),
        Ok(None) => {
            let _ = std::fs::remove_file(&tmp);
            open(path)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// Whether the file (`len` bytes) can be handed to redb: not empty, redb's magic number,
/// this build's page size, and at least as long as its header's layout says.
pub(super) fn check_header(file: &File, len: u64) -> Result<(), StoreDamage> {
    if len == 0 {
        return Err(StoreDamage::Empty);
    }
    let mut header = [0u8; HEADER_BYTES];
    let short = || StoreDamage::Truncated {
        len,
        expected: PAGE_SIZE,
    };
    if len < PAGE_SIZE {
        // Too short for even the header's page; if it is no redb file, say that.
        let n = usize::try_from(len)
            .unwrap_or(HEADER_BYTES)
            .min(MAGIC.len());
        file.read_exact_at(&mut header[..n], 0)
            .map_err(|e| StoreDamage::Unreadable(e.to_string()))?;
        return Err(if header[..n] == MAGIC[..n] {
            short()
        } else {
            StoreDamage::NotRedb
        });
    }
    file.read_exact_at(&mut header, 0)
        .map_err(|e| StoreDamage::Unreadable(e.to_string()))?;
    if header[..MAGIC.len()] != MAGIC {
        return Err(StoreDamage::NotRedb);
    }
    let field = |at: usize| {
        let mut b = [0u8; 4];
        b.copy_from_slice(&header[at..at + 4]);
        u64::from(u32::from_le_bytes(b))
    };
    let page = field(PAGE_SIZE_AT);
    if page != PAGE_SIZE {
        return Err(StoreDamage::Header(format!(
            "its page size is {page}, not {PAGE_SIZE}"
        )));
    }
    let (region_header, region_data) = (field(REGION_HEADER_PAGES_AT), field(REGION_DATA_PAGES_AT));
    let (full, trailing) = (field(FULL_REGIONS_AT), field(TRAILING_PAGES_AT));
    if region_data == 0 || (full == 0 && trailing == 0) || trailing >= region_data {
        return Err(StoreDamage::Header(format!(
            "its layout is impossible ({full} full regions of {region_data} pages, {trailing} trailing pages)"
        )));
    }
    // The header's page, the full regions, the trailing region (u32 fields: no overflow in
    // u64 for the products, but the sums are checked anyway).
    let expected = full
        .checked_mul((region_header + region_data) * page)
        .and_then(|b| b.checked_add(page))
        .and_then(|b| {
            let tail = if trailing > 0 {
                (region_header + trailing) * page
            } else {
                0
            };
            b.checked_add(tail)
        })
        .ok_or_else(|| StoreDamage::Header("its layout overflows".into()))?;
    if len < expected {
        return Err(StoreDamage::Truncated { len, expected });
    }
    Ok(())
}

/// Runs an open of redb's, with a panic inside redb reported as a damaged store
/// ([`no_panic_read`]).
fn no_panic(
    path: &Path,
    f: impl FnOnce() -> Result<Database, redb::DatabaseError>,
) -> Result<Database, PoolError> {
    no_panic_read(path, || {
        f().map_err(|e| PoolError::StoreOpen {
            path: path.into(),
            source: Box::new(e.into()),
        })
    })
}

/// Runs `f`, a first use of the store's file by redb, with a panic inside redb reported as
/// a damaged store.
///
/// The last line of defence, not the check: [`check_header`] refuses every file known to
/// make redb panic (one shorter than its layout). A panic of redb's on a file that passed it
/// is about the file's content (an assertion on what it read), so the daemon reports the
/// store as damaged instead of dying with exit status 101. Nothing of ours is left half
/// changed by the unwind: `f` only opens or reads, and what it made is dropped.
pub(super) fn no_panic_read<T>(
    path: &Path,
    f: impl FnOnce() -> Result<T, PoolError>,
) -> Result<T, PoolError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        Err(PoolError::StoreDamaged {
            path: path.into(),
            problem: StoreDamage::Panicked(what),
        })
    })
}

/// Moves the store at `path` aside (`<path>.damaged-<unix seconds>`, or with a number
/// after it when taken), so that a new one can be made there: for an administrator who
/// chose to start afresh (the daemon's `--reinit`). Returns where it went.
pub fn move_aside(path: &Path) -> Result<PathBuf, PoolError> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    // Appended to the path's own bytes: `display()` would mangle a name that is not UTF-8.
    let mut base = path.as_os_str().to_owned();
    base.push(format!(".damaged-{secs}"));
    let cwd = rustix::fs::CWD;
    for n in 0..100u32 {
        let mut aside = base.clone();
        if n > 0 {
            aside.push(format!(".{n}"));
        }
        let aside = PathBuf::from(aside);
        match rustix::fs::renameat_with(cwd, path, cwd, &aside, rustix::fs::RenameFlags::NOREPLACE)
        {
            Ok(()) => return Ok(aside),
            Err(rustix::io::Errno::EXIST) => continue,
            Err(e) => return Err(io_error(path, e.into())),
        }
    }
    Err(io_error(
        path,
        io::Error::new(
            io::ErrorKind::AlreadyExists,
            "every name to move it to is taken",
        ),
    ))
}
