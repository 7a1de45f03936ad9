//! A black box: shared memory into which a process that serves a device mirrors what a
//! replacement process needs to carry on after it was killed.
//!
//! The process that serves an endpoint (a pool daemon's worker) creates one (a sealed memfd)
//! when it starts on a fresh device and hands it to the daemon's custody; the device and the
//! server *publish* their state into named [`Record`]s as it changes. When that process dies
//! (`kill -9`, a crash, an upgrade), the daemon hands the same memfd to its replacement, which
//! opens it ([`BlackBox::open`]), reads the records and resumes.
//!
//! A record is double-buffered: [`Record::publish`] writes the copy that is not current, then
//! makes it current with one atomic store of a generation counter. A process killed in the
//! middle of a publish leaves the previous copy intact, so a reader always sees a whole
//! publish (the last completed one). Each copy carries an xxh3 hash of its bytes, which the
//! reader checks. Records have one writer each (`publish` takes `&mut self`); readers run when
//! the writer is gone.
//!
//! File layout (little endian): a 4 KiB header — magic, version, record count, then per record
//! a 48-byte NUL-padded name, its offset and its capacity — then the records, each at a
//! 64-byte aligned offset: the generation (u64), then two copies of
//! `[len: u64][hash: u64][bytes: capacity]`.

use std::fs::File;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use vm_memory::mmap::MmapRegion;
use vm_memory::{Bytes, FileOffset, VolatileMemory, VolatileSlice};

const MAGIC: u64 = u64::from_le_bytes(*b"SYBLACKB");
const VERSION: u32 = 1;
const HEADER: usize = 4096;
const NAME_LEN: usize = 48;
const ENTRY: usize = NAME_LEN + 16;
/// Most records a black box holds.
pub const MAX_RECORDS: usize = (HEADER - 16) / ENTRY;
/// Longest record name.
pub const MAX_NAME: usize = NAME_LEN - 1;
/// Largest record capacity (64 MiB).
pub const MAX_CAPACITY: usize = 64 << 20;
const COPY_HEADER: usize = 16;

/// Black box errors.
#[derive(Debug, thiserror::Error)]
pub enum BlackBoxError {
    /// The layout asked for is not valid.
    #[error("Invalid black box layout: {0}")]
    Layout(String),
    /// Creating, sealing, sizing or mapping the memfd failed.
    #[error("Cannot set up the black box memory")]
    Io(#[source] std::io::Error),
    /// Mapping the memory failed.
    #[error("Cannot map the black box memory: {0}")]
    Map(String),
    /// The file handed to [`BlackBox::open`] is not a black box this code can read.
    #[error("Not a usable black box: {0}")]
    Format(String),
    /// No record of that name.
    #[error("The black box has no record named `{0}`")]
    NoRecord(String),
    /// More bytes than the record holds.
    #[error("{len} bytes do not fit record `{name}` (capacity {capacity})")]
    TooLarge {
        /// Record name.
        name: String,
        /// Bytes offered.
        len: usize,
        /// Capacity.
        capacity: usize,
    },
    /// The current copy of a record fails its hash check.
    #[error("Record `{0}` is corrupt (its hash does not match)")]
    Corrupt(String),
}

/// A record to lay out: its name and the largest publish it must hold.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordSpec {
    /// Unique name, at most [`MAX_NAME`] bytes of ASCII.
    pub name: String,
    /// Largest publish in bytes.
    pub capacity: usize,
    /// A raw [`Area`] rather than a double-buffered [`Record`].
    pub area: bool,
}

impl RecordSpec {
    /// A double-buffered record.
    pub fn new(name: impl Into<String>, capacity: usize) -> Self {
        Self {
            name: name.into(),
            capacity,
            area: false,
        }
    }

    /// A raw area of `capacity` bytes (see [`Area`]).
    pub fn area(name: impl Into<String>, capacity: usize) -> Self {
        Self {
            name: name.into(),
            capacity,
            area: true,
        }
    }
}

/// Bit of a directory entry's capacity that marks an area.
const AREA_FLAG: u64 = 1 << 63;

#[derive(Debug, Clone)]
struct Entry {
    name: String,
    offset: usize,
    capacity: usize,
    area: bool,
}

impl Entry {
    fn size(&self) -> usize {
        if self.area {
            self.capacity.next_multiple_of(8)
        } else {
            record_size(self.capacity)
        }
    }
}

/// A black box: a sealed memfd with named records. See the [module](self) documentation.
#[derive(Debug)]
pub struct BlackBox {
    file: File,
    map: MmapRegion<()>,
    entries: Vec<Entry>,
}

fn record_size(capacity: usize) -> usize {
    8 + 2 * (COPY_HEADER + capacity.next_multiple_of(8))
}

impl BlackBox {
    /// Creates a black box with `records` (zeroed: no record has been published), in a memfd
    /// sealed against shrinking and growing.
    pub fn create(records: &[RecordSpec]) -> Result<Arc<BlackBox>, BlackBoxError> {
        if records.len() > MAX_RECORDS {
            return Err(BlackBoxError::Layout(format!(
                "{} records (at most {MAX_RECORDS})",
                records.len()
            )));
        }
        let mut entries = Vec::with_capacity(records.len());
        let mut offset = HEADER;
        for r in records {
            if r.name.is_empty()
                || r.name.len() > MAX_NAME
                || !r.name.bytes().all(|b| b.is_ascii_graphic())
            {
                return Err(BlackBoxError::Layout(format!(
                    "record name `{}` (1..={MAX_NAME} printable ASCII bytes)",
                    r.name.escape_debug()
                )));
            }
            if entries.iter().any(|e: &Entry| e.name == r.name) {
                return Err(BlackBoxError::Layout(format!("record `{}` twice", r.name)));
            }
            if r.capacity > MAX_CAPACITY {
                return Err(BlackBoxError::Layout(format!(
                    "record `{}` of {} bytes (at most {MAX_CAPACITY})",
                    r.name, r.capacity
                )));
            }
            let e = Entry {
                name: r.name.clone(),
                offset,
                capacity: r.capacity,
                area: r.area,
            };
            offset = (offset + e.size()).next_multiple_of(64);
            entries.push(e);
        }
        let size = offset.next_multiple_of(4096);
        let file = memfd::MemfdOptions::default()
            .allow_sealing(true)
            .close_on_exec(true)
            .create("switchyard-black-box")
            .map_err(|e| BlackBoxError::Io(std::io::Error::other(e)))?;
        file.as_file()
            .set_len(size as u64)
            .map_err(BlackBoxError::Io)?;
        file.add_seals(&[
            memfd::FileSeal::SealShrink,
            memfd::FileSeal::SealGrow,
            memfd::FileSeal::SealSeal,
        ])
        .map_err(|e| BlackBoxError::Io(std::io::Error::other(e)))?;
        let file = file.into_file();
        let map = map_file(&file, size)?;
        let header = map.as_volatile_slice();
        let w = |r: Result<(), vm_memory::volatile_memory::Error>| {
            r.map_err(|e| BlackBoxError::Map(e.to_string()))
        };
        w(header.write_obj(MAGIC, 0))?;
        w(header.write_obj(VERSION, 8))?;
        w(header.write_obj(entries.len() as u32, 12))?;
        for (i, e) in entries.iter().enumerate() {
            let at = 16 + i * ENTRY;
            let mut name = [0u8; NAME_LEN];
            name[..e.name.len()].copy_from_slice(e.name.as_bytes());
            w(header.write_slice(&name, at).map(|_| ()))?;
            w(header.write_obj(e.offset as u64, at + NAME_LEN))?;
            let cap = e.capacity as u64 | if e.area { AREA_FLAG } else { 0 };
            w(header.write_obj(cap, at + NAME_LEN + 8))?;
        }
        Ok(Arc::new(BlackBox { file, map, entries }))
    }

    /// Opens a black box another process created and used: checks that the file is a memfd
    /// sealed against shrinking (so the mapping cannot fault) and that its header and
    /// directory are sound.
    pub fn open(file: File) -> Result<Arc<BlackBox>, BlackBoxError> {
        let seals = rustix::fs::fcntl_get_seals(file.as_fd())
            .map_err(|e| BlackBoxError::Format(format!("no seals ({e}): not a sealed memfd")))?;
        if !seals.contains(rustix::fs::SealFlags::SHRINK) {
            return Err(BlackBoxError::Format(
                "the memfd is not sealed against shrinking".into(),
            ));
        }
        let size = file.metadata().map_err(BlackBoxError::Io)?.len();
        let size = usize::try_from(size)
            .ok()
            .filter(|&s| (HEADER..=MAX_RECORDS * record_size(MAX_CAPACITY) + HEADER).contains(&s))
            .ok_or_else(|| BlackBoxError::Format(format!("size {size}")))?;
        let map = map_file(&file, size)?;
        let header = map.as_volatile_slice();
        let r = |e: vm_memory::volatile_memory::Error| BlackBoxError::Format(e.to_string());
        let magic: u64 = header.read_obj(0).map_err(r)?;
        let version: u32 = header.read_obj(8).map_err(r)?;
        let count: u32 = header.read_obj(12).map_err(r)?;
        if magic != MAGIC || version != VERSION {
            return Err(BlackBoxError::Format(format!(
                "magic {magic:#x} version {version} (expected {MAGIC:#x} version {VERSION})"
            )));
        }
        let count = count as usize;
        if count > MAX_RECORDS {
            return Err(BlackBoxError::Format(format!("{count} records")));
        }
        let mut entries: Vec<Entry> = Vec::with_capacity(count);
        let mut end = HEADER;
        for i in 0..count {
            let at = 16 + i * ENTRY;
            let mut name = [0u8; NAME_LEN];
            header.read_slice(&mut name, at).map_err(r)?;
            let len = name.iter().position(|&b| b == 0).unwrap_or(NAME_LEN);
            let name = std::str::from_utf8(&name[..len])
                .ok()
                .filter(|n| !n.is_empty() && len <= MAX_NAME)
                .ok_or_else(|| BlackBoxError::Format(format!("record {i} has a bad name")))?
                .to_owned();
            let offset: u64 = header.read_obj(at + NAME_LEN).map_err(r)?;
            let capacity: u64 = header.read_obj(at + NAME_LEN + 8).map_err(r)?;
            let area = capacity & AREA_FLAG != 0;
            let capacity = capacity & !AREA_FLAG;
            let (Ok(offset), Ok(capacity)) = (usize::try_from(offset), usize::try_from(capacity))
            else {
                return Err(BlackBoxError::Format(format!(
                    "record `{name}` out of range"
                )));
            };
            let entry = Entry {
                name: name.clone(),
                offset,
                capacity,
                area,
            };
            let fits = capacity <= MAX_CAPACITY
                && offset >= end
                && offset.is_multiple_of(8)
                && offset.checked_add(entry.size()).is_some_and(|e| e <= size);
            if !fits || entries.iter().any(|e| e.name == name) {
                return Err(BlackBoxError::Format(format!(
                    "record `{name}` at {offset:#x} (capacity {capacity}) does not fit or repeats"
                )));
            }
            end = offset + entry.size();
            entries.push(entry);
        }
        Ok(Arc::new(BlackBox { file, map, entries }))
    }

    /// The memfd (to hand to the daemon or a replacement process).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The records and their capacities, in layout order.
    pub fn layout(&self) -> Vec<RecordSpec> {
        self.entries
            .iter()
            .map(|e| RecordSpec {
                name: e.name.clone(),
                capacity: e.capacity,
                area: e.area,
            })
            .collect()
    }

    /// The writer (and reader) of record `name`. There must be one writer per record at a time;
    /// a process takes each of its records once.
    pub fn record(self: &Arc<Self>, name: &str) -> Result<Record, BlackBoxError> {
        let e = self
            .entries
            .iter()
            .find(|e| e.name == name && !e.area)
            .ok_or_else(|| BlackBoxError::NoRecord(name.to_owned()))?;
        Ok(Record {
            bb: self.clone(),
            name: e.name.clone(),
            offset: e.offset,
            capacity: e.capacity,
        })
    }

    /// The raw area `name` (see [`Area`]).
    pub fn area(self: &Arc<Self>, name: &str) -> Result<Area, BlackBoxError> {
        let e = self
            .entries
            .iter()
            .find(|e| e.name == name && e.area)
            .ok_or_else(|| BlackBoxError::NoRecord(name.to_owned()))?;
        Ok(Area {
            bb: self.clone(),
            offset: e.offset,
            capacity: e.capacity,
        })
    }

    fn slice(&self) -> VolatileSlice<'_> {
        self.map.as_volatile_slice()
    }
}

fn map_file(file: &File, size: usize) -> Result<MmapRegion<()>, BlackBoxError> {
    let fo = FileOffset::new(file.try_clone().map_err(BlackBoxError::Io)?, 0);
    MmapRegion::<()>::from_file(fo, size).map_err(|e| BlackBoxError::Map(e.to_string()))
}

/// A raw byte range of the black box file, for data that is read through the file rather than
/// the mapping: the server writes each reply into its reply area and sends it with
/// `sendfile` from the black box's file position, which the kernel advances as the bytes go
/// out (a counter that survives the process, shared with every descriptor of the file).
#[derive(Debug)]
pub struct Area {
    bb: Arc<BlackBox>,
    offset: usize,
    capacity: usize,
}

impl Area {
    /// Offset of the area in the black box file.
    pub fn file_offset(&self) -> u64 {
        self.offset as u64
    }

    /// Length in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Copies `bytes` to `at` (from the start of the area).
    pub fn write_at(&self, at: usize, bytes: &[u8]) -> Result<(), BlackBoxError> {
        let end = at.checked_add(bytes.len()).filter(|&e| e <= self.capacity);
        if end.is_none() {
            return Err(BlackBoxError::TooLarge {
                name: "area".into(),
                len: at.saturating_add(bytes.len()),
                capacity: self.capacity,
            });
        }
        self.bb
            .slice()
            .write_slice(bytes, self.offset + at)
            .map_err(|e| BlackBoxError::Map(e.to_string()))
    }

    /// Reads `buf.len()` bytes at `at`.
    pub fn read_at(&self, at: usize, buf: &mut [u8]) -> Result<(), BlackBoxError> {
        if at.checked_add(buf.len()).is_none_or(|e| e > self.capacity) {
            return Err(BlackBoxError::TooLarge {
                name: "area".into(),
                len: at.saturating_add(buf.len()),
                capacity: self.capacity,
            });
        }
        self.bb
            .slice()
            .read_slice(buf, self.offset + at)
            .map_err(|e| BlackBoxError::Map(e.to_string()))
    }

    /// The black box file (its position is what `sendfile` without an offset uses).
    pub fn file(&self) -> &File {
        &self.bb.file
    }
}

/// One named, double-buffered record of a [`BlackBox`].
#[derive(Debug)]
pub struct Record {
    bb: Arc<BlackBox>,
    name: String,
    offset: usize,
    capacity: usize,
}

impl Record {
    /// Largest publish in bytes.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// How many publishes completed (0: never published).
    pub fn generation(&self) -> u64 {
        self.bb
            .slice()
            .load::<u64>(self.offset, Ordering::Acquire)
            .unwrap_or(0)
    }

    fn copy_at(&self, generation: u64) -> usize {
        self.offset
            + 8
            + (generation % 2) as usize * (COPY_HEADER + self.capacity.next_multiple_of(8))
    }

    /// Publishes `bytes` as the record's content: written to the copy that is not current,
    /// then made current by one atomic store. A process killed during the publish leaves the
    /// previous content readable.
    pub fn publish(&mut self, bytes: &[u8]) -> Result<(), BlackBoxError> {
        self.publish_parts(&[bytes])
    }

    /// [`Record::publish`] of the concatenation of `parts` (no intermediate buffer).
    pub fn publish_parts(&mut self, parts: &[&[u8]]) -> Result<(), BlackBoxError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        if len > self.capacity {
            return Err(BlackBoxError::TooLarge {
                name: self.name.clone(),
                len,
                capacity: self.capacity,
            });
        }
        let s = self.bb.slice();
        let generation = self.generation();
        let next = generation.wrapping_add(1);
        let at = self.copy_at(next);
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        let mut pos = at + COPY_HEADER;
        let map = |e: vm_memory::volatile_memory::Error| BlackBoxError::Map(e.to_string());
        for p in parts {
            hasher.update(p);
            s.write_slice(p, pos).map_err(map)?;
            pos += p.len();
        }
        s.write_obj(len as u64, at).map_err(map)?;
        s.write_obj(hasher.digest(), at + 8).map_err(map)?;
        s.store(next, self.offset, Ordering::Release).map_err(map)?;
        Ok(())
    }

    /// The last completed publish, or `None` if there was none.
    pub fn read(&self) -> Result<Option<Vec<u8>>, BlackBoxError> {
        let generation = self.generation();
        if generation == 0 {
            return Ok(None);
        }
        let s = self.bb.slice();
        let at = self.copy_at(generation);
        let corrupt = || BlackBoxError::Corrupt(self.name.clone());
        let len: u64 = s.read_obj(at).map_err(|_| corrupt())?;
        let hash: u64 = s.read_obj(at + 8).map_err(|_| corrupt())?;
        let len = usize::try_from(len)
            .ok()
            .filter(|&l| l <= self.capacity)
            .ok_or_else(corrupt)?;
        let mut bytes = vec![0u8; len];
        s.read_slice(&mut bytes, at + COPY_HEADER)
            .map_err(|_| corrupt())?;
        if xxhash_rust::xxh3::xxh3_64(&bytes) != hash {
            return Err(corrupt());
        }
        Ok(Some(bytes))
    }
}

#[cfg(test)]
mod tests;
