//! A memory-mapped BAR (through a VFIO device fd or a sysfs `resourceN` file), accessed only
//! with volatile loads and stores. Register accesses are single, naturally aligned 32- or
//! 64-bit instructions, as the device requires. A BAR that cannot be mapped may be reached
//! through `pread`/`pwrite` on its file instead ([`BarMap::file_io`], bulk copies only).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use vm_memory::mmap::MmapRegion;
use vm_memory::{FileOffset, VolatileMemory};

/// One mapped piece of a BAR.
#[derive(Debug)]
struct Piece {
    /// Offset of the piece in the BAR.
    bar_offset: u64,
    region: MmapRegion<()>,
}

/// A BAR mapped in one or more pieces (one per sparse-mmap area), or reached through file
/// reads and writes.
#[derive(Debug)]
pub struct BarMap {
    pieces: Vec<Piece>,
    /// `pread`/`pwrite` on this file (offset = BAR offset) instead of a mapping, and its length.
    file_io: Option<(File, u64)>,
}

/// An access outside every mapped piece.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unmapped {
    /// Offset in the BAR.
    pub offset: u64,
    /// Length.
    pub len: usize,
}

impl std::fmt::Display for Unmapped {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BAR access at {:#x}+{} is outside the mapping",
            self.offset, self.len
        )
    }
}

impl BarMap {
    /// Maps `areas` (`(offset in BAR, size)`) of a BAR whose data starts at `file_offset` in
    /// `file` (shared, read/write).
    pub fn map(file: &File, file_offset: u64, areas: &[(u64, u64)]) -> std::io::Result<BarMap> {
        let file = Arc::new(file.try_clone()?);
        let mut pieces = Vec::new();
        for &(off, size) in areas {
            let len = usize::try_from(size).map_err(std::io::Error::other)?;
            let fo = FileOffset::from_arc(file.clone(), file_offset + off);
            let region = MmapRegion::<()>::from_file(fo, len)
                .map_err(|e| std::io::Error::other(format!("mmap {len} bytes at {off:#x}: {e}")))?;
            pieces.push(Piece {
                bar_offset: off,
                region,
            });
        }
        Ok(BarMap {
            pieces,
            file_io: None,
        })
    }

    /// A BAR of `len` bytes reached through `pread`/`pwrite` on `file` (BAR offset = file
    /// offset): only [`BarMap::read`] and [`BarMap::write`] work, register accessors read
    /// all-ones.
    pub fn file_io(file: File, len: u64) -> BarMap {
        BarMap {
            pieces: Vec::new(),
            file_io: Some((file, len)),
        }
    }

    /// Whether the BAR is reached through file reads and writes rather than a mapping.
    pub fn is_file_io(&self) -> bool {
        self.file_io.is_some()
    }

    /// Mapped bytes in total (with file I/O: the bytes reachable).
    pub fn mapped_len(&self) -> u64 {
        if let Some((_, len)) = &self.file_io {
            return *len;
        }
        self.pieces.iter().map(|p| p.region.size() as u64).sum()
    }

    /// Number of mapped pieces.
    pub fn pieces(&self) -> usize {
        self.pieces.len()
    }

    fn locate(&self, offset: u64, len: usize) -> Result<(&MmapRegion<()>, usize), Unmapped> {
        for p in &self.pieces {
            let size = p.region.size() as u64;
            if offset >= p.bar_offset && offset + len as u64 <= p.bar_offset + size {
                return Ok((&p.region, (offset - p.bar_offset) as usize));
            }
        }
        Err(Unmapped { offset, len })
    }

    /// 32-bit volatile load (all-ones outside the mapping, like a master abort).
    pub fn r32(&self, offset: u64) -> u32 {
        match self.locate(offset, 4) {
            Ok((r, o)) => r.get_ref::<u32>(o).map(|v| v.load()).unwrap_or(u32::MAX),
            Err(_) => u32::MAX,
        }
    }

    /// 64-bit volatile load: one 8-byte access.
    pub fn r64(&self, offset: u64) -> u64 {
        match self.locate(offset, 8) {
            Ok((r, o)) => r.get_ref::<u64>(o).map(|v| v.load()).unwrap_or(u64::MAX),
            Err(_) => u64::MAX,
        }
    }

    /// 32-bit volatile store (dropped outside the mapping).
    pub fn w32(&self, offset: u64, v: u32) {
        if let Ok((r, o)) = self.locate(offset, 4)
            && let Ok(x) = r.get_ref::<u32>(o)
        {
            x.store(v);
        }
    }

    /// 64-bit volatile store: one 8-byte access.
    pub fn w64(&self, offset: u64, v: u64) {
        if let Ok((r, o)) = self.locate(offset, 8)
            && let Ok(x) = r.get_ref::<u64>(o)
        {
            x.store(v);
        }
    }

    /// Copies bytes out of the BAR.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), Unmapped> {
        if let Some((f, len)) = &self.file_io {
            let unmapped = Unmapped {
                offset,
                len: buf.len(),
            };
            if offset + buf.len() as u64 > *len {
                return Err(unmapped);
            }
            return f.read_exact_at(buf, offset).map_err(|_| unmapped);
        }
        let (r, o) = self.locate(offset, buf.len())?;
        let s = r.get_slice(o, buf.len()).map_err(|_| Unmapped {
            offset,
            len: buf.len(),
        })?;
        s.copy_to(buf);
        Ok(())
    }

    /// Copies bytes into the BAR.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), Unmapped> {
        if let Some((f, len)) = &self.file_io {
            let unmapped = Unmapped {
                offset,
                len: data.len(),
            };
            if offset + data.len() as u64 > *len {
                return Err(unmapped);
            }
            return f.write_all_at(data, offset).map_err(|_| unmapped);
        }
        let (r, o) = self.locate(offset, data.len())?;
        let s = r.get_slice(o, data.len()).map_err(|_| Unmapped {
            offset,
            len: data.len(),
        })?;
        s.copy_from(data);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn pieces_and_accesses() {
        let mut f = tempfile::tempfile().expect("tempfile");
        f.write_all(&vec![0u8; 4 * 4096]).expect("write");
        // BAR data at file offset 4096; two pieces, the middle page unmapped.
        let bar = BarMap::map(&f, 4096, &[(0, 4096), (8192, 4096)]).expect("map");
        assert_eq!(bar.mapped_len(), 8192);
        assert_eq!(bar.pieces(), 2);
        bar.w32(0, 0x5059_4753);
        assert_eq!(bar.r32(0), 0x5059_4753);
        bar.w64(8, 0x1122_3344_5566_7788);
        assert_eq!(bar.r32(8), 0x5566_7788);
        assert_eq!(bar.r32(12), 0x1122_3344);
        assert_eq!(bar.r32(4096), u32::MAX, "hole reads as all-ones");
        bar.w32(4096, 1); // dropped
        bar.write(8192 + 3, b"hello").expect("write");
        let mut b = [0u8; 5];
        bar.read(8192 + 3, &mut b).expect("read");
        assert_eq!(&b, b"hello");
        assert!(bar.read(4094, &mut b).is_err(), "straddles the hole");
        // The writes went to the file at the BAR's file offset.
        let mut all = vec![0u8; 4 * 4096];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut all, 0).expect("read");
        assert_eq!(&all[4096..4100], &0x5059_4753u32.to_le_bytes());
        assert_eq!(&all[3 * 4096 + 3..3 * 4096 + 8], b"hello");
    }

    #[test]
    fn file_io_fallback() {
        let mut f = tempfile::tempfile().expect("tempfile");
        f.write_all(&[0u8; 8192]).expect("write");
        let bar = BarMap::file_io(f.try_clone().expect("clone"), 8192);
        assert!(bar.is_file_io());
        assert_eq!(bar.mapped_len(), 8192);
        bar.write(4093, b"abcdef").expect("write");
        let mut b = [0u8; 6];
        bar.read(4093, &mut b).expect("read");
        assert_eq!(&b, b"abcdef");
        assert!(bar.read(8190, &mut b).is_err(), "past the end");
        assert_eq!(bar.r32(0), u32::MAX, "no register access through file I/O");
        let mut all = vec![0u8; 8192];
        f.read_exact_at(&mut all, 0).expect("read");
        assert_eq!(&all[4093..4099], b"abcdef");
    }
}
