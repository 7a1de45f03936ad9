//! The RAM: a sealed memfd read and written with `pread`/`pwrite` (no mapping), with a log of
//! the pages written, and the copy of one RAM onto another that a relocation runs.

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};
use switchyard_device::{DeviceError, RelocationStats};

use crate::ScratchpadError;

/// Page size of the write log (and of relocation copies).
pub(crate) const PAGE: u64 = 4096;

/// Which memfd a RAM is: saved in the black box instead of the contents, so that a
/// replacement holding two (a worker that died during a move) picks the one the device ran on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RamIdentity {
    /// Size in bytes.
    pub size: u64,
    /// Device number of the file (`st_dev`).
    pub dev: u64,
    /// Inode number of the file (`st_ino`).
    pub ino: u64,
}

impl RamIdentity {
    /// The identity of `file`.
    pub fn of(file: &File) -> std::io::Result<RamIdentity> {
        let meta = file.metadata()?;
        Ok(RamIdentity {
            size: meta.len(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// The RAM: the slot's memory object [`RAM_OBJECT`](crate::RAM_OBJECT).
pub(crate) struct Ram {
    file: File,
    identity: RamIdentity,
    /// One bit per [`PAGE`], set after every write (BAR2 writes, zeroing).
    written: Box<[AtomicU64]>,
}

impl std::fmt::Debug for Ram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ram")
            .field("identity", &self.identity)
            .finish_non_exhaustive()
    }
}

impl Ram {
    /// A zeroed memfd of `size` bytes, sealed against shrinking and growing (so nobody holding
    /// it can change the size a device checked).
    pub(crate) fn create(size: u64) -> Result<Ram, ScratchpadError> {
        let io = |e: memfd::Error| ScratchpadError::Ram(std::io::Error::other(e));
        let mfd = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .close_on_exec(true)
            .create("switchyard-scratchpad-ram")
            .map_err(io)?;
        mfd.as_file().set_len(size).map_err(ScratchpadError::Ram)?;
        mfd.add_seals(&[
            memfd::FileSeal::SealShrink,
            memfd::FileSeal::SealGrow,
            memfd::FileSeal::SealSeal,
        ])
        .map_err(io)?;
        Self::adopt(mfd.into_file(), size)
    }

    /// An existing memfd (held by a daemon for a replacement process): it must be sealed
    /// against shrinking and growing and hold `size` bytes. Its contents are kept.
    pub(crate) fn adopt(file: File, size: u64) -> Result<Ram, ScratchpadError> {
        let seals =
            rustix::fs::fcntl_get_seals(file.as_fd()).map_err(|_| ScratchpadError::NotSealed)?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK | rustix::fs::SealFlags::GROW) {
            return Err(ScratchpadError::NotSealed);
        }
        let identity = RamIdentity::of(&file).map_err(ScratchpadError::Ram)?;
        if identity.size != size {
            return Err(ScratchpadError::RamSize {
                expected: size,
                actual: identity.size,
            });
        }
        let words = (size / PAGE).div_ceil(64);
        Ok(Ram {
            file,
            identity,
            written: (0..words).map(|_| AtomicU64::new(0)).collect(),
        })
    }

    pub(crate) fn size(&self) -> u64 {
        self.identity.size
    }

    pub(crate) fn identity(&self) -> RamIdentity {
        self.identity
    }

    pub(crate) fn file(&self) -> &File {
        &self.file
    }

    /// Whether `[offset, offset + len)` lies inside the RAM.
    pub(crate) fn contains(&self, offset: u64, len: usize) -> bool {
        u64::try_from(len)
            .ok()
            .and_then(|len| offset.checked_add(len))
            .is_some_and(|end| end <= self.size())
    }

    /// Reads `buf.len()` bytes at `offset` (checked with [`Ram::contains`] by the caller;
    /// an access outside fails, it never reads past the end).
    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        if !self.contains(offset, buf.len()) {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        self.file.read_exact_at(buf, offset)
    }

    /// Writes `data` at `offset`, then logs the pages written.
    pub(crate) fn write(&self, offset: u64, data: &[u8]) -> std::io::Result<()> {
        if !self.contains(offset, data.len()) {
            return Err(std::io::Error::from(std::io::ErrorKind::InvalidInput));
        }
        self.file.write_all_at(data, offset)?;
        self.mark(offset, data.len() as u64);
        Ok(())
    }

    /// Zeroes the whole RAM (a hole punched, or zeros written where the file cannot have
    /// holes), then logs every page.
    pub(crate) fn zero(&self) -> std::io::Result<()> {
        let size = self.size();
        let punched = rustix::fs::fallocate(
            &self.file,
            rustix::fs::FallocateFlags::PUNCH_HOLE | rustix::fs::FallocateFlags::KEEP_SIZE,
            0,
            size,
        );
        if punched.is_err() {
            let zeros = vec![0u8; PAGE as usize * 16];
            let mut at = 0;
            while at < size {
                let n = (size - at).min(zeros.len() as u64);
                self.file.write_all_at(&zeros[..n as usize], at)?;
                at += n;
            }
        }
        self.mark(0, size);
        Ok(())
    }

    /// Logs a write of `len` bytes at `offset` (clamped to the RAM). Called after the write,
    /// so a copy that takes the bit has the write behind it, or sees the bit again.
    fn mark(&self, offset: u64, len: u64) {
        let end = offset.saturating_add(len).min(self.size());
        if offset >= end {
            return;
        }
        for page in offset / PAGE..=(end - 1) / PAGE {
            if let Some(word) = self.written.get((page / 64) as usize) {
                word.fetch_or(1 << (page % 64), Ordering::Release);
            }
        }
    }

    /// Takes (reads and clears) the whole log: the pages written since the last take, in
    /// ascending order.
    pub(crate) fn take_written(&self) -> Vec<u64> {
        let mut pages = Vec::new();
        for (w, word) in self.written.iter().enumerate() {
            let mut bits = word.swap(0, Ordering::AcqRel);
            while bits != 0 {
                pages.push(w as u64 * 64 + u64::from(bits.trailing_zeros()));
                bits &= bits - 1;
            }
        }
        pages
    }

    /// Copies `[offset, offset + len)` of this RAM into `to` (same size), in chunks.
    pub(crate) fn copy_to(&self, to: &Ram, offset: u64, len: u64) -> std::io::Result<()> {
        let mut buf = vec![0u8; (PAGE * 16).min(len) as usize];
        let mut at = offset;
        let end = offset.saturating_add(len);
        while at < end {
            let n = (end - at).min(buf.len() as u64) as usize;
            self.read(at, &mut buf[..n])?;
            to.write(at, &buf[..n])?;
            at += n as u64;
        }
        Ok(())
    }
}

/// A copy of one RAM onto another: the relocation's rounds, then (moved into the
/// successor) what the hand-over finishes.
pub(crate) struct RamCopy {
    pub(crate) source: Arc<Ram>,
    pub(crate) target: Arc<Ram>,
    pub(crate) stats: RelocationStats,
}

impl std::fmt::Debug for RamCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RamCopy")
            .field("source", &self.source.identity())
            .field("target", &self.target.identity())
            .field("stats", &self.stats)
            .finish()
    }
}

impl RamCopy {
    /// One pre-copy round: everything the first time, then the pages logged since.
    pub(crate) fn round(&mut self) -> Result<u64, DeviceError> {
        let n = if self.stats.rounds == 0 {
            self.source.copy_to(&self.target, 0, self.source.size())?;
            self.source.size()
        } else {
            self.copy_logged()?
        };
        self.stats.rounds += 1;
        self.stats.bytes += n;
        self.stats.last_round_bytes = n;
        Ok(n)
    }

    /// Copies the pages logged since the log was last taken, in runs of adjacent pages.
    pub(crate) fn copy_logged(&self) -> Result<u64, DeviceError> {
        let mut copied = 0;
        let mut run: Option<(u64, u64)> = None;
        let pages = self.source.take_written();
        for page in pages.into_iter().map(Some).chain([None]) {
            run = match (run, page) {
                (Some((first, end)), Some(p)) if p == end => Some((first, p + 1)),
                (run, next) => {
                    if let Some((first, end)) = run {
                        let (at, len) = (first * PAGE, (end - first) * PAGE);
                        let len = len.min(self.source.size().saturating_sub(at));
                        self.source.copy_to(&self.target, at, len)?;
                        copied += len;
                    }
                    next.map(|p| (p, p + 1))
                }
            };
        }
        Ok(copied)
    }
}
