//! What the server keeps in the black box, and how: the record names, the tables (a snapshot
//! and a log of changes since), the session. Encodings only; `tables` publishes them as they
//! change, `resume` reads them back.

use std::collections::BTreeMap;

/// Record names of the server.
pub const RX_RECORD: &str = "server.rx";
/// See [`RX_RECORD`].
pub const TABLES_RECORD: &str = "server.tables";
/// See [`RX_RECORD`].
pub const SESSION_RECORD: &str = "server.session";
/// The area replies are sent from (see the module documentation).
pub const REPLIES_AREA: &str = "server.replies";
/// The log of table changes since the last snapshot, and its length (see `Inner::log_op`).
pub const TABLE_LOG_AREA: &str = "server.tablog";
/// See [`TABLE_LOG_AREA`].
pub const TABLE_LOG_HEAD: &str = "server.tablog.head";

/// Table changes the log holds before it is folded into a snapshot.
pub(super) const LOG_ENTRIES: usize = 16 << 10;
/// Bytes per log entry.
pub(super) const LOG_ENTRY: usize = 40;
const OP_MAP: u8 = 1;
const OP_UNMAP: u8 = 2;
const OP_UNMAP_ALL: u8 = 3;
const OP_IRQ_SET: u8 = 4;
const OP_IRQ_CLEAR: u8 = 5;
const OP_IRQ_DISABLE: u8 = 6;

/// Largest VERSION request body kept in the session record.
pub(super) const MAX_VERSION_DATA: usize = 64 << 10;

const TABLES_VERSION: u32 = 1;
const SESSION_VERSION: u32 = 1;

/// A DMA window as the tables record it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowRecord {
    /// First IOVA.
    pub iova: u64,
    /// Length.
    pub size: u64,
    /// Offset of the window in its file.
    pub offset: u64,
    /// Readable by the device.
    pub read: bool,
    /// Writable by the device.
    pub write: bool,
    /// Custody id of the memory fd (`None`: a window without fd, served through messages).
    pub fd: Option<u64>,
}

/// Encodes the tables record into `b` (cleared first): the next custody id, the windows and
/// the vectors ([`decode_tables`] reads it back).
pub(super) fn encode_tables(
    b: &mut Vec<u8>,
    next_id: u64,
    windows: &BTreeMap<u64, WindowRecord>,
    vectors: &BTreeMap<(u32, u32), u64>,
) {
    b.clear();
    b.extend_from_slice(&TABLES_VERSION.to_le_bytes());
    b.extend_from_slice(&next_id.to_le_bytes());
    b.extend_from_slice(&(windows.len() as u32).to_le_bytes());
    for w in windows.values() {
        b.extend_from_slice(&w.iova.to_le_bytes());
        b.extend_from_slice(&w.size.to_le_bytes());
        b.extend_from_slice(&w.offset.to_le_bytes());
        b.push(u8::from(w.read) | u8::from(w.write) << 1 | u8::from(w.fd.is_some()) << 2);
        b.extend_from_slice(&w.fd.unwrap_or(0).to_le_bytes());
    }
    b.extend_from_slice(&(vectors.len() as u32).to_le_bytes());
    for (&(i, v), id) in vectors {
        b.extend_from_slice(&i.to_le_bytes());
        b.extend_from_slice(&v.to_le_bytes());
        b.extend_from_slice(&id.to_le_bytes());
    }
}

/// Encodes the session record: the client's VERSION request, if it negotiated (one larger
/// than [`MAX_VERSION_DATA`] is recorded as none); [`decode_session`] reads it back.
pub(super) fn encode_session(version: Option<(u16, u16, &[u8])>) -> Vec<u8> {
    let mut b = Vec::with_capacity(16);
    b.extend_from_slice(&SESSION_VERSION.to_le_bytes());
    match version {
        Some((major, minor, data)) if data.len() <= MAX_VERSION_DATA => {
            b.push(1);
            b.extend_from_slice(&major.to_le_bytes());
            b.extend_from_slice(&minor.to_le_bytes());
            b.extend_from_slice(&(data.len() as u32).to_le_bytes());
            b.extend_from_slice(data);
        }
        _ => b.push(0),
    }
    b
}

/// A change of the tables, as the log records it.
#[derive(Debug, Clone, Copy)]
pub(super) enum Op {
    Map(WindowRecord),
    Unmap { iova: u64, size: u64 },
    UnmapAll,
    IrqSet { index: u32, vector: u32, id: u64 },
    IrqClear { index: u32, vector: u32 },
    IrqDisable { index: u32 },
}

pub(super) fn encode_op(op: Op) -> [u8; LOG_ENTRY] {
    let mut e = [0u8; LOG_ENTRY];
    let mut put = |at: usize, b: &[u8]| e[at..at + b.len()].copy_from_slice(b);
    match op {
        Op::Map(w) => {
            put(0, &[OP_MAP]);
            put(
                1,
                &[u8::from(w.read) | u8::from(w.write) << 1 | u8::from(w.fd.is_some()) << 2],
            );
            put(8, &w.iova.to_le_bytes());
            put(16, &w.size.to_le_bytes());
            put(24, &w.offset.to_le_bytes());
            put(32, &w.fd.unwrap_or(0).to_le_bytes());
        }
        Op::Unmap { iova, size } => {
            put(0, &[OP_UNMAP]);
            put(8, &iova.to_le_bytes());
            put(16, &size.to_le_bytes());
        }
        Op::UnmapAll => put(0, &[OP_UNMAP_ALL]),
        Op::IrqSet { index, vector, id } => {
            put(0, &[OP_IRQ_SET]);
            put(4, &index.to_le_bytes());
            put(8, &vector.to_le_bytes());
            put(16, &id.to_le_bytes());
        }
        Op::IrqClear { index, vector } => {
            put(0, &[OP_IRQ_CLEAR]);
            put(4, &index.to_le_bytes());
            put(8, &vector.to_le_bytes());
        }
        Op::IrqDisable { index } => {
            put(0, &[OP_IRQ_DISABLE]);
            put(4, &index.to_le_bytes());
        }
    }
    e
}

/// Applies one log entry to tables being recovered; `None` if it does not decode.
pub(super) fn apply_op(
    e: &[u8; LOG_ENTRY],
    windows: &mut BTreeMap<u64, WindowRecord>,
    vectors: &mut BTreeMap<(u32, u32), u64>,
) -> Option<()> {
    let u64_at = |at: usize| e.get(at..at + 8)?.try_into().ok().map(u64::from_le_bytes);
    let u32_at = |at: usize| e.get(at..at + 4)?.try_into().ok().map(u32::from_le_bytes);
    match e[0] {
        OP_MAP => {
            let flags = e[1];
            let w = WindowRecord {
                iova: u64_at(8)?,
                size: u64_at(16)?,
                offset: u64_at(24)?,
                read: flags & 1 != 0,
                write: flags & 2 != 0,
                fd: (flags & 4 != 0).then_some(u64_at(32)?),
            };
            windows.insert(w.iova, w);
        }
        OP_UNMAP => {
            let (iova, size) = (u64_at(8)?, u64_at(16)?);
            let end = iova.saturating_add(size);
            windows.retain(|_, w| !(w.iova >= iova && w.iova.saturating_add(w.size) <= end));
        }
        OP_UNMAP_ALL => windows.clear(),
        OP_IRQ_SET => {
            vectors.insert((u32_at(4)?, u32_at(8)?), u64_at(16)?);
        }
        OP_IRQ_CLEAR => {
            vectors.remove(&(u32_at(4)?, u32_at(8)?));
        }
        OP_IRQ_DISABLE => {
            let index = u32_at(4)?;
            vectors.retain(|(i, _), _| *i != index);
        }
        _ => return None,
    }
    Some(())
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (h, t) = self.0.split_at_checked(n)?;
        self.0 = t;
        Some(h)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u16(&mut self) -> Option<u16> {
        self.take(2)?.try_into().ok().map(u16::from_le_bytes)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)?.try_into().ok().map(u32::from_le_bytes)
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)?.try_into().ok().map(u64::from_le_bytes)
    }
}

pub(super) type Tables = (Vec<WindowRecord>, BTreeMap<(u32, u32), u64>, u64);

pub(super) fn decode_tables(b: &[u8]) -> Option<Tables> {
    let mut r = Reader(b);
    if r.u32()? != TABLES_VERSION {
        return None;
    }
    let next = r.u64()?;
    let n = r.u32()? as usize;
    let mut windows = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        let iova = r.u64()?;
        let size = r.u64()?;
        let offset = r.u64()?;
        let flags = r.u8()?;
        let fd = r.u64()?;
        windows.push(WindowRecord {
            iova,
            size,
            offset,
            read: flags & 1 != 0,
            write: flags & 2 != 0,
            fd: (flags & 4 != 0).then_some(fd),
        });
    }
    let n = r.u32()? as usize;
    let mut vectors = BTreeMap::new();
    for _ in 0..n {
        let i = r.u32()?;
        let v = r.u32()?;
        vectors.insert((i, v), r.u64()?);
    }
    r.0.is_empty().then_some((windows, vectors, next))
}

pub(super) type Version = Option<(u16, u16, Vec<u8>)>;

pub(super) fn decode_session(b: &[u8]) -> Option<Version> {
    let mut r = Reader(b);
    if r.u32()? != SESSION_VERSION {
        return None;
    }
    match r.u8()? {
        0 => Some(None),
        1 => {
            let major = r.u16()?;
            let minor = r.u16()?;
            let n = r.u32()? as usize;
            let data = r.take(n)?.to_vec();
            r.0.is_empty().then_some(Some((major, minor, data)))
        }
        _ => None,
    }
}
