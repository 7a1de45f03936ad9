//! Commands (requests) in both directions: decoding with full validation and
//! allocation-free encoding.

use zerocopy::IntoBytes;

use crate::check::{check_argsz, check_fds, data_len, exact_body};
use crate::consts::*;
use crate::error::ProtoError;
use crate::header::{Command, Direction, Header};
use crate::payload::*;
use crate::wire::*;
use crate::writer::{MessageWriter, fixed_then_data};

/// Limits applied while decoding requests.
///
/// The server uses [`Limits::server`] with the `max_data_xfer_size` it
/// advertised; the client uses [`Limits::client`] with its own advertised
/// value when decoding the server's DMA_READ/DMA_WRITE.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Limits {
    /// Largest REGION_READ/WRITE, DMA_READ/WRITE and MIG_DATA transfer (`E2BIG` above).
    pub max_data_xfer_size: u32,
    /// Largest whole message (`EINVAL` above, like libvfio-user).
    pub max_msg_size: u32,
    /// Most REGION_WRITE_MULTI entries (QEMU sends at most 200).
    pub max_write_multi: u32,
    /// Accept only commands sent in this direction (`None`: both).
    pub direction: Option<Direction>,
}

impl Default for Limits {
    /// Spec defaults: 1 MiB transfers, [`MAX_MSG_SIZE`], 200 WRITE_MULTI
    /// entries, both directions.
    fn default() -> Self {
        Limits {
            max_data_xfer_size: DEFAULT_MAX_DATA_XFER_SIZE,
            max_msg_size: MAX_MSG_SIZE,
            max_write_multi: VFIO_USER_MULTI_MAX,
            direction: None,
        }
    }
}

impl Limits {
    /// Limits for a server that advertised `max_data_xfer_size`: only
    /// client-to-server commands are accepted; messages up to
    /// `max_data_xfer_size + 64 KiB`.
    pub fn server(max_data_xfer_size: u32) -> Self {
        Limits {
            max_data_xfer_size,
            max_msg_size: max_data_xfer_size.saturating_add(64 << 10),
            max_write_multi: VFIO_USER_MULTI_MAX,
            direction: Some(Direction::ClientToServer),
        }
    }

    /// Limits for a client that advertised `max_data_xfer_size`: only
    /// server-to-client commands (DMA_READ/WRITE) are accepted.
    pub fn client(max_data_xfer_size: u32) -> Self {
        Limits {
            direction: Some(Direction::ServerToClient),
            ..Self::server(max_data_xfer_size)
        }
    }
}

/// A decoded command. Variable-length parts borrow from the body.
///
/// Fixed "output" fields of GET-style requests (e.g. `flags` in
/// DEVICE_GET_INFO) are ignored on decode and encoded as zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request<'a> {
    /// VERSION proposal.
    Version(Version<'a>),
    /// DMA_MAP; the fd (0 or 1) travels separately.
    DmaMap(DmaMap),
    /// DMA_UNMAP; `bitmap` is present iff `GET_DIRTY_BITMAP` is set.
    DmaUnmap {
        /// The unmap entry.
        unmap: DmaUnmap,
        /// Bitmap header for `GET_DIRTY_BITMAP`.
        bitmap: Option<BitmapHeader>,
    },
    /// DEVICE_GET_INFO.
    DeviceGetInfo {
        /// Reply buffer size.
        argsz: u32,
    },
    /// DEVICE_GET_REGION_INFO.
    DeviceGetRegionInfo {
        /// Reply buffer size (caps only if they fit).
        argsz: u32,
        /// Region index (range is the server's to check).
        index: u32,
    },
    /// DEVICE_GET_REGION_IO_FDS.
    DeviceGetRegionIoFds {
        /// Reply buffer size.
        argsz: u32,
        /// Region index.
        index: u32,
    },
    /// DEVICE_GET_IRQ_INFO.
    DeviceGetIrqInfo {
        /// Reply buffer size.
        argsz: u32,
        /// IRQ index.
        index: u32,
    },
    /// DEVICE_SET_IRQS.
    DeviceSetIrqs(SetIrqs<'a>),
    /// REGION_READ.
    RegionRead {
        /// Offset in the region.
        offset: u64,
        /// Region index.
        region: u32,
        /// Bytes to read (1..=max_data_xfer_size).
        count: u32,
    },
    /// REGION_WRITE.
    RegionWrite {
        /// Offset in the region.
        offset: u64,
        /// Region index.
        region: u32,
        /// Bytes to write.
        data: &'a [u8],
    },
    /// DMA_READ (server to client).
    DmaRead {
        /// IOVA.
        address: u64,
        /// Bytes to read.
        count: u64,
    },
    /// DMA_WRITE (server to client).
    DmaWrite {
        /// IOVA.
        address: u64,
        /// Bytes to write.
        data: &'a [u8],
    },
    /// DEVICE_RESET.
    DeviceReset,
    /// REGION_WRITE_MULTI (entries validated: count 1..=8, no overflow).
    RegionWriteMulti(Records<'a, WriteMultiEntry>),
    /// DEVICE_FEATURE.
    DeviceFeature(DeviceFeatureRequest<'a>),
    /// MIG_DATA_READ.
    MigDataRead {
        /// Reply buffer size (≥ 8 + size).
        argsz: u32,
        /// Bytes wanted.
        size: u32,
    },
    /// GET_PRECOPY_INFO (the request's byte counts are ignored).
    GetPrecopyInfo {
        /// Reply buffer size (≥ 24).
        argsz: u32,
    },
    /// MIG_DATA_WRITE.
    MigDataWrite {
        /// argsz as sent (≥ 8 + data length).
        argsz: u32,
        /// Migration data.
        data: &'a [u8],
    },
}

fn check_xfer(count: u64, limits: &Limits) -> Result<(), ProtoError> {
    if count > u64::from(limits.max_data_xfer_size) {
        return Err(ProtoError::TransferTooLarge {
            count,
            max: u64::from(limits.max_data_xfer_size),
        });
    }
    Ok(())
}

/// Decodes a command body with [`Limits::default`]. See [`decode_request_with`].
pub fn decode_request<'a>(
    hdr: &Header,
    body: &'a [u8],
    nfds: usize,
) -> Result<Request<'a>, ProtoError> {
    decode_request_with(hdr, body, nfds, &Limits::default())
}

/// Decodes and validates a command.
///
/// `body` is everything after the header (the caller read `hdr.body_len()`
/// bytes); `nfds` is the number of fds received with the message. Checks:
/// header flags (command type, no `Error`, no unknown bits),
/// `msg_size == 16 + body.len()` and `≤ limits.max_msg_size`, the command
/// number (unknown: `EINVAL`; 14: `ENOTSUP`), direction, payload
/// sizes, argsz minimums, flag bits, fd counts, transfer limits (`E2BIG`),
/// and offset/size overflow. Range checks that need device knowledge
/// (region/IRQ index, region size, DMA window) are the server's.
///
/// Payload sizes are checked as libvfio-user (the reference server) checks
/// them: a fixed struct must be complete, and bytes after it are ignored
/// where they carry nothing (a kernel-style client sends the whole `argsz`
/// buffer, e.g. DEVICE_GET_REGION_INFO with room for capabilities). Sizes
/// the payload itself announces must hold: REGION_WRITE data equals
/// `count`, SET_IRQS bools equal `count`, MIG_DATA_WRITE has at least
/// `size` bytes (only those are used), DMA logging has at least its
/// `num_ranges` ranges, a dirty-bitmap DMA_UNMAP has its bitmap header,
/// REGION_WRITE_MULTI has exactly `wr_cnt` entries (a command libvfio-user
/// does not implement).
pub fn decode_request_with<'a>(
    hdr: &Header,
    body: &'a [u8],
    nfds: usize,
    limits: &Limits,
) -> Result<Request<'a>, ProtoError> {
    hdr.validate_command_flags()?;
    let blen = hdr.body_len_within(limits.max_msg_size)?;
    if blen != body.len() {
        return Err(ProtoError::SizeMismatch {
            msg_size: hdr.msg_size,
            body: body.len(),
        });
    }
    let cmd = hdr.command_kind()?;
    // Unsupported commands (14) answer ENOTSUP (last match arm) in
    // either direction, so the direction check leaves them alone.
    if let Some(d) = limits.direction
        && d != cmd.direction()
        && cmd.is_supported()
    {
        return Err(ProtoError::WrongDirection(cmd));
    }
    match cmd {
        Command::Version => {
            check_fds("VERSION", nfds, 0)?;
            Version::decode(body, "VERSION").map(Request::Version)
        }
        Command::DmaMap => {
            let (m, _) = read_prefix::<DmaMap>(body, "DMA_MAP")?;
            check_fds("DMA_MAP", nfds, 1)?;
            check_argsz("DMA_MAP", m.argsz, DmaMap::SIZE as u64)?;
            if m.flags & !VFIO_USER_F_DMA_REGION_ALL != 0 {
                return Err(ProtoError::BadFlags {
                    what: "DMA_MAP",
                    flags: u64::from(m.flags),
                });
            }
            let mode = m.flags & (VFIO_USER_F_DMA_REGION_MMAP | VFIO_USER_F_DMA_REGION_FILE_IO);
            if mode == VFIO_USER_F_DMA_REGION_MMAP | VFIO_USER_F_DMA_REGION_FILE_IO {
                return Err(ProtoError::BadFlags {
                    what: "DMA_MAP (two access modes)",
                    flags: u64::from(m.flags),
                });
            }
            if mode != 0 && nfds == 0 {
                return Err(ProtoError::BadFdCount {
                    what: "DMA_MAP (access mode needs an fd)",
                    got: nfds,
                });
            }
            if m.size == 0 {
                return Err(ProtoError::invalid("DMA_MAP size", "zero"));
            }
            // A window may end exactly at 2^64: check the last byte, not one past it.
            m.address
                .checked_add(m.size - 1)
                .ok_or(ProtoError::overflow("DMA_MAP address + size"))?;
            if nfds > 0 {
                m.offset
                    .checked_add(m.size)
                    .ok_or(ProtoError::overflow("DMA_MAP offset + size"))?;
            }
            Ok(Request::DmaMap(m))
        }
        Command::DmaUnmap => {
            check_fds("DMA_UNMAP", nfds, 0)?;
            let (u, rest) = read_prefix::<DmaUnmap>(body, "DMA_UNMAP")?;
            check_argsz("DMA_UNMAP", u.argsz, DmaUnmap::SIZE as u64)?;
            let known = VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP | VFIO_DMA_UNMAP_FLAG_ALL;
            if u.flags & !known != 0 || u.flags == known {
                return Err(ProtoError::BadFlags {
                    what: "DMA_UNMAP",
                    flags: u64::from(u.flags),
                });
            }
            if u.flags & VFIO_DMA_UNMAP_FLAG_ALL != 0 {
                if u.address != 0 || u.size != 0 {
                    return Err(ProtoError::invalid(
                        "DMA_UNMAP",
                        "unmap-all needs address and size 0",
                    ));
                }
                return Ok(Request::DmaUnmap {
                    unmap: u,
                    bitmap: None,
                });
            }
            if u.size == 0 {
                return Err(ProtoError::invalid("DMA_UNMAP size", "zero"));
            }
            // QEMU invalidates up to the top of the IOVA space: [a, 2^64) is a valid range.
            u.address
                .checked_add(u.size - 1)
                .ok_or(ProtoError::overflow("DMA_UNMAP address + size"))?;
            if u.flags & VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP == 0 {
                return Ok(Request::DmaUnmap {
                    unmap: u,
                    bitmap: None,
                });
            }
            let (b, _) = read_prefix::<BitmapHeader>(rest, "DMA_UNMAP bitmap header")?;
            let want = dirty_bitmap_size(u.size, b.pgsize)?;
            if b.size != want {
                return Err(ProtoError::invalid(
                    "DMA_UNMAP bitmap size",
                    "does not match size and pgsize",
                ));
            }
            let min = ((DmaUnmap::SIZE + BitmapHeader::SIZE) as u64)
                .checked_add(want)
                .ok_or(ProtoError::overflow("DMA_UNMAP argsz"))?;
            check_argsz("DMA_UNMAP with dirty bitmap", u.argsz, min)?;
            if u64::from(u.argsz) > MAX_DIRTY_BITMAP_ARGSZ {
                return Err(ProtoError::invalid(
                    "DMA_UNMAP argsz",
                    "dirty bitmap reply too large",
                ));
            }
            Ok(Request::DmaUnmap {
                unmap: u,
                bitmap: Some(b),
            })
        }
        Command::DeviceGetInfo => {
            check_fds("DEVICE_GET_INFO", nfds, 0)?;
            let (i, _) = read_prefix::<DeviceInfo>(body, "DEVICE_GET_INFO")?;
            check_argsz("DEVICE_GET_INFO", i.argsz, DeviceInfo::SIZE as u64)?;
            Ok(Request::DeviceGetInfo { argsz: i.argsz })
        }
        Command::DeviceGetRegionInfo => {
            check_fds("DEVICE_GET_REGION_INFO", nfds, 0)?;
            let (i, _) = read_prefix::<RegionInfo>(body, "DEVICE_GET_REGION_INFO")?;
            check_argsz("DEVICE_GET_REGION_INFO", i.argsz, RegionInfo::SIZE as u64)?;
            Ok(Request::DeviceGetRegionInfo {
                argsz: i.argsz,
                index: i.index,
            })
        }
        Command::DeviceGetRegionIoFds => {
            check_fds("DEVICE_GET_REGION_IO_FDS", nfds, 0)?;
            let (i, _) = read_prefix::<RegionIoFds>(body, "DEVICE_GET_REGION_IO_FDS")?;
            check_argsz(
                "DEVICE_GET_REGION_IO_FDS",
                i.argsz,
                RegionIoFds::SIZE as u64,
            )?;
            if i.flags != 0 {
                return Err(ProtoError::BadFlags {
                    what: "DEVICE_GET_REGION_IO_FDS",
                    flags: u64::from(i.flags),
                });
            }
            if i.count != 0 {
                return Err(ProtoError::invalid(
                    "DEVICE_GET_REGION_IO_FDS count",
                    "must be 0 in a request",
                ));
            }
            Ok(Request::DeviceGetRegionIoFds {
                argsz: i.argsz,
                index: i.index,
            })
        }
        Command::DeviceGetIrqInfo => {
            check_fds("DEVICE_GET_IRQ_INFO", nfds, 0)?;
            let (i, _) = read_prefix::<IrqInfo>(body, "DEVICE_GET_IRQ_INFO")?;
            check_argsz("DEVICE_GET_IRQ_INFO", i.argsz, IrqInfo::SIZE as u64)?;
            Ok(Request::DeviceGetIrqInfo {
                argsz: i.argsz,
                index: i.index,
            })
        }
        Command::DeviceSetIrqs => decode_set_irqs(body, nfds).map(Request::DeviceSetIrqs),
        Command::RegionRead => {
            check_fds("REGION_READ", nfds, 0)?;
            let (a, _) = read_prefix::<RegionAccess>(body, "REGION_READ")?;
            check_access(a.offset, u64::from(a.count), limits)?;
            Ok(Request::RegionRead {
                offset: a.offset,
                region: a.region,
                count: a.count,
            })
        }
        Command::RegionWrite => {
            check_fds("REGION_WRITE", nfds, 0)?;
            let (a, data) = read_prefix::<RegionAccess>(body, "REGION_WRITE")?;
            check_access(a.offset, u64::from(a.count), limits)?;
            data_len("REGION_WRITE data", data, u64::from(a.count))?;
            Ok(Request::RegionWrite {
                offset: a.offset,
                region: a.region,
                data,
            })
        }
        Command::DmaRead => {
            check_fds("DMA_READ", nfds, 0)?;
            let a = read_exact::<DmaAccess>(body, "DMA_READ")?;
            check_access(a.address, a.count, limits)?;
            Ok(Request::DmaRead {
                address: a.address,
                count: a.count,
            })
        }
        Command::DmaWrite => {
            check_fds("DMA_WRITE", nfds, 0)?;
            let (a, data) = read_prefix::<DmaAccess>(body, "DMA_WRITE")?;
            check_access(a.address, a.count, limits)?;
            data_len("DMA_WRITE data", data, a.count)?;
            Ok(Request::DmaWrite {
                address: a.address,
                data,
            })
        }
        Command::DeviceReset => {
            check_fds("DEVICE_RESET", nfds, 0)?;
            Ok(Request::DeviceReset)
        }
        Command::RegionWriteMulti => {
            check_fds("REGION_WRITE_MULTI", nfds, 0)?;
            let (wr_cnt, rest) = read_prefix::<u64>(body, "REGION_WRITE_MULTI")?;
            if wr_cnt == 0 || wr_cnt > u64::from(limits.max_write_multi) {
                return Err(ProtoError::invalid(
                    "REGION_WRITE_MULTI wr_cnt",
                    "zero or above the maximum",
                ));
            }
            let want = usize::try_from(wr_cnt)
                .ok()
                .and_then(|n| n.checked_mul(WriteMultiEntry::SIZE))
                .ok_or(ProtoError::overflow("REGION_WRITE_MULTI size"))?;
            exact_body("REGION_WRITE_MULTI entries", rest, want)?;
            let entries =
                Records::<WriteMultiEntry>::from_bytes(rest, "REGION_WRITE_MULTI entries")?;
            for e in entries.iter() {
                if e.count == 0 || e.count > VFIO_USER_MULTI_DATA {
                    return Err(ProtoError::invalid(
                        "REGION_WRITE_MULTI entry count",
                        "must be 1..=8",
                    ));
                }
                e.offset
                    .checked_add(u64::from(e.count))
                    .ok_or(ProtoError::overflow("REGION_WRITE_MULTI offset + count"))?;
            }
            Ok(Request::RegionWriteMulti(entries))
        }
        Command::DeviceFeature => {
            check_fds("DEVICE_FEATURE", nfds, 0)?;
            decode_feature_request(body).map(Request::DeviceFeature)
        }
        Command::MigDataRead => {
            check_fds("MIG_DATA_READ", nfds, 0)?;
            let (m, _) = read_prefix::<MigData>(body, "MIG_DATA_READ")?;
            check_xfer(u64::from(m.size), limits)?;
            check_argsz(
                "MIG_DATA_READ",
                m.argsz,
                (MigData::SIZE as u64).saturating_add(u64::from(m.size)),
            )?;
            Ok(Request::MigDataRead {
                argsz: m.argsz,
                size: m.size,
            })
        }
        Command::MigDataWrite => {
            check_fds("MIG_DATA_WRITE", nfds, 0)?;
            let (m, data) = read_prefix::<MigData>(body, "MIG_DATA_WRITE")?;
            check_xfer(u64::from(m.size), limits)?;
            let data = data.get(..m.size as usize).ok_or(ProtoError::BadSize {
                what: "MIG_DATA_WRITE data",
                expected: m.size as usize,
                got: data.len(),
            })?;
            check_argsz(
                "MIG_DATA_WRITE",
                m.argsz,
                (MigData::SIZE as u64).saturating_add(u64::from(m.size)),
            )?;
            Ok(Request::MigDataWrite {
                argsz: m.argsz,
                data,
            })
        }
        Command::GetPrecopyInfo => {
            check_fds("GET_PRECOPY_INFO", nfds, 0)?;
            let (p, _) = read_prefix::<PrecopyInfo>(body, "GET_PRECOPY_INFO")?;
            check_argsz("GET_PRECOPY_INFO", p.argsz, PrecopyInfo::SIZE as u64)?;
            if p.flags != 0 {
                return Err(ProtoError::BadFlags {
                    what: "GET_PRECOPY_INFO",
                    flags: u64::from(p.flags),
                });
            }
            Ok(Request::GetPrecopyInfo { argsz: p.argsz })
        }
        Command::DirtyPages => Err(ProtoError::UnsupportedCommand(cmd)),
    }
}

fn check_access(offset: u64, count: u64, limits: &Limits) -> Result<(), ProtoError> {
    if count == 0 {
        return Err(ProtoError::invalid("access count", "zero"));
    }
    check_xfer(count, limits)?;
    offset
        .checked_add(count)
        .ok_or(ProtoError::overflow("offset + count"))?;
    Ok(())
}

fn decode_set_irqs(body: &[u8], nfds: usize) -> Result<SetIrqs<'_>, ProtoError> {
    let (s, rest) = read_prefix::<IrqSet>(body, "DEVICE_SET_IRQS")?;
    check_argsz("DEVICE_SET_IRQS", s.argsz, IrqSet::SIZE as u64)?;
    let known = VFIO_IRQ_SET_DATA_TYPE_MASK | VFIO_IRQ_SET_ACTION_TYPE_MASK;
    let bad = || ProtoError::BadFlags {
        what: "DEVICE_SET_IRQS",
        flags: u64::from(s.flags),
    };
    if s.flags & !known != 0 {
        return Err(bad());
    }
    let action = match s.flags & VFIO_IRQ_SET_ACTION_TYPE_MASK {
        VFIO_IRQ_SET_ACTION_MASK => IrqAction::Mask,
        VFIO_IRQ_SET_ACTION_UNMASK => IrqAction::Unmask,
        VFIO_IRQ_SET_ACTION_TRIGGER => IrqAction::Trigger,
        _ => return Err(bad()),
    };
    let data = match s.flags & VFIO_IRQ_SET_DATA_TYPE_MASK {
        VFIO_IRQ_SET_DATA_NONE => {
            check_fds("DEVICE_SET_IRQS (DATA_NONE)", nfds, 0)?;
            IrqData::None
        }
        VFIO_IRQ_SET_DATA_BOOL => {
            check_fds("DEVICE_SET_IRQS (DATA_BOOL)", nfds, 0)?;
            exact_body("DEVICE_SET_IRQS bools", rest, s.count as usize)?;
            IrqData::Bool(rest)
        }
        VFIO_IRQ_SET_DATA_EVENTFD => {
            if nfds != 0 && nfds as u64 != u64::from(s.count) {
                return Err(ProtoError::BadFdCount {
                    what: "DEVICE_SET_IRQS (eventfds must equal count)",
                    got: nfds,
                });
            }
            IrqData::Eventfd
        }
        _ => return Err(bad()),
    };
    if s.count == 0 && (s.start != 0 || action != IrqAction::Trigger || data != IrqData::None) {
        return Err(ProtoError::invalid(
            "DEVICE_SET_IRQS",
            "count 0 is only valid as start 0, DATA_NONE|ACTION_TRIGGER",
        ));
    }
    s.start
        .checked_add(s.count)
        .ok_or(ProtoError::overflow("DEVICE_SET_IRQS start + count"))?;
    Ok(SetIrqs {
        argsz: s.argsz,
        action,
        data,
        index: s.index,
        start: s.start,
        count: s.count,
    })
}

fn feature_min_argsz(what: &'static str, argsz: u32, data_min: usize) -> Result<(), ProtoError> {
    check_argsz(
        what,
        argsz,
        (DeviceFeatureHeader::SIZE as u64).saturating_add(data_min as u64),
    )
}

fn decode_feature_request(body: &[u8]) -> Result<DeviceFeatureRequest<'_>, ProtoError> {
    let (h, data) = read_prefix::<DeviceFeatureHeader>(body, "DEVICE_FEATURE")?;
    let f = FeatureFlags(h.flags);
    f.validate()?;
    feature_min_argsz("DEVICE_FEATURE", h.argsz, 0)?;
    let op = if f.probe() {
        FeatureRequest::Probe {
            feature: f.feature(),
            get: f.get(),
            set: f.set(),
        }
    } else {
        match f.feature() {
            VFIO_DEVICE_FEATURE_MIGRATION => {
                feature_min_argsz("DEVICE_FEATURE MIGRATION", h.argsz, MigrationFeature::SIZE)?;
                FeatureRequest::GetMigration
            }
            VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE => {
                feature_min_argsz(
                    "DEVICE_FEATURE MIG_DEVICE_STATE",
                    h.argsz,
                    MigDeviceState::SIZE,
                )?;
                if f.get() {
                    FeatureRequest::GetMigDeviceState
                } else {
                    FeatureRequest::SetMigDeviceState(
                        read_prefix::<MigDeviceState>(data, "MIG_DEVICE_STATE")?.0,
                    )
                }
            }
            VFIO_DEVICE_FEATURE_DMA_LOGGING_START => {
                feature_min_argsz(
                    "DEVICE_FEATURE DMA_LOGGING_START",
                    h.argsz,
                    DmaLoggingControlHeader::SIZE,
                )?;
                FeatureRequest::DmaLoggingStart(DmaLoggingControl::decode(data)?)
            }
            VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP => FeatureRequest::DmaLoggingStop,
            VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT => {
                // QEMU-style clients may append the reply buffer; only the
                // 24-byte report header is meaningful.
                let (r, _) = read_prefix::<DmaLoggingReport>(data, "DMA_LOGGING_REPORT")?;
                let bitmap = dirty_bitmap_size(r.length, r.page_size)?;
                if r.length == 0 {
                    return Err(ProtoError::invalid("DMA_LOGGING_REPORT length", "zero"));
                }
                r.iova
                    .checked_add(r.length)
                    .ok_or(ProtoError::overflow("DMA_LOGGING_REPORT iova + length"))?;
                let min = ((DeviceFeatureHeader::SIZE + DmaLoggingReport::SIZE) as u64)
                    .checked_add(bitmap)
                    .ok_or(ProtoError::overflow("DMA_LOGGING_REPORT argsz"))?;
                check_argsz("DEVICE_FEATURE DMA_LOGGING_REPORT", h.argsz, min)?;
                FeatureRequest::DmaLoggingReport(r)
            }
            _ => FeatureRequest::Other {
                flags: h.flags,
                data,
            },
        }
    };
    Ok(DeviceFeatureRequest { argsz: h.argsz, op })
}

impl Request<'_> {
    /// The command of this request.
    pub fn command(&self) -> Command {
        match self {
            Request::Version(_) => Command::Version,
            Request::DmaMap(_) => Command::DmaMap,
            Request::DmaUnmap { .. } => Command::DmaUnmap,
            Request::DeviceGetInfo { .. } => Command::DeviceGetInfo,
            Request::DeviceGetRegionInfo { .. } => Command::DeviceGetRegionInfo,
            Request::DeviceGetRegionIoFds { .. } => Command::DeviceGetRegionIoFds,
            Request::DeviceGetIrqInfo { .. } => Command::DeviceGetIrqInfo,
            Request::DeviceSetIrqs(_) => Command::DeviceSetIrqs,
            Request::RegionRead { .. } => Command::RegionRead,
            Request::RegionWrite { .. } => Command::RegionWrite,
            Request::DmaRead { .. } => Command::DmaRead,
            Request::DmaWrite { .. } => Command::DmaWrite,
            Request::DeviceReset => Command::DeviceReset,
            Request::RegionWriteMulti(_) => Command::RegionWriteMulti,
            Request::DeviceFeature(_) => Command::DeviceFeature,
            Request::MigDataRead { .. } => Command::MigDataRead,
            Request::MigDataWrite { .. } => Command::MigDataWrite,
            Request::GetPrecopyInfo { .. } => Command::GetPrecopyInfo,
        }
    }

    /// Encodes the request into `out` (cleared first; capacity reused).
    ///
    /// Encoding does not re-run decode validation (tests may build odd but
    /// representable messages); it fails only when the message cannot be
    /// represented (a bool array whose length differs from `count`, a
    /// dirty-bitmap flag without a bitmap header or vice versa, sizes beyond
    /// the 32-bit fields).
    pub fn encode(&self, msg_id: u16, no_reply: bool, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let mut w = MessageWriter::command(out, msg_id, self.command(), no_reply);
        match self {
            Request::Version(v) => v.write(&mut w),
            Request::DmaMap(m) => w.put(m),
            Request::DmaUnmap { unmap, bitmap } => {
                let flag = unmap.flags & VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP != 0;
                if flag != bitmap.is_some() {
                    return Err(ProtoError::invalid(
                        "DMA_UNMAP",
                        "bitmap header must match GET_DIRTY_BITMAP",
                    ));
                }
                w.put(unmap);
                if let Some(b) = bitmap {
                    w.put(b);
                }
            }
            Request::DeviceGetInfo { argsz } => w.put(&DeviceInfo {
                argsz: *argsz,
                ..Default::default()
            }),
            Request::DeviceGetRegionInfo { argsz, index } => w.put(&RegionInfo {
                argsz: *argsz,
                index: *index,
                ..Default::default()
            }),
            Request::DeviceGetRegionIoFds { argsz, index } => w.put(&RegionIoFds {
                argsz: *argsz,
                index: *index,
                ..Default::default()
            }),
            Request::DeviceGetIrqInfo { argsz, index } => w.put(&IrqInfo {
                argsz: *argsz,
                index: *index,
                ..Default::default()
            }),
            Request::DeviceSetIrqs(s) => {
                if let IrqData::Bool(b) = s.data
                    && b.len() as u64 != u64::from(s.count)
                {
                    return Err(ProtoError::invalid(
                        "DEVICE_SET_IRQS",
                        "bool data length differs from count",
                    ));
                }
                w.put(&IrqSet {
                    argsz: s.argsz,
                    flags: s.flags(),
                    index: s.index,
                    start: s.start,
                    count: s.count,
                });
                if let IrqData::Bool(b) = s.data {
                    w.put_bytes(b);
                }
            }
            Request::RegionRead {
                offset,
                region,
                count,
            } => w.put(&RegionAccess {
                offset: *offset,
                region: *region,
                count: *count,
            }),
            Request::RegionWrite {
                offset,
                region,
                data,
            } => {
                let count = u32::try_from(data.len())
                    .map_err(|_| ProtoError::MessageTooLarge { size: data.len() })?;
                w.put(&RegionAccess {
                    offset: *offset,
                    region: *region,
                    count,
                });
                w.put_bytes(data);
            }
            Request::DmaRead { address, count } => w.put(&DmaAccess {
                address: *address,
                count: *count,
            }),
            Request::DmaWrite { address, data } => {
                w.put(&DmaAccess {
                    address: *address,
                    count: data.len() as u64,
                });
                w.put_bytes(data);
            }
            Request::DeviceReset => {}
            Request::RegionWriteMulti(entries) => {
                w.put(&(entries.len() as u64));
                w.put_bytes(entries.as_bytes());
            }
            Request::DeviceFeature(f) => {
                w.put(&DeviceFeatureHeader {
                    argsz: f.argsz,
                    flags: f.op.flags(),
                });
                match &f.op {
                    FeatureRequest::Probe { .. }
                    | FeatureRequest::GetMigration
                    | FeatureRequest::GetMigDeviceState
                    | FeatureRequest::DmaLoggingStop => {}
                    FeatureRequest::SetMigDeviceState(s) => w.put(s),
                    FeatureRequest::DmaLoggingStart(c) => c.write(w.buf())?,
                    FeatureRequest::DmaLoggingReport(r) => w.put(r),
                    FeatureRequest::Other { data, .. } => w.put_bytes(data),
                }
            }
            Request::MigDataRead { argsz, size } => w.put(&MigData {
                argsz: *argsz,
                size: *size,
            }),
            Request::GetPrecopyInfo { argsz } => w.put(&PrecopyInfo {
                argsz: *argsz,
                ..PrecopyInfo::default()
            }),
            Request::MigDataWrite { argsz, data } => {
                let size = u32::try_from(data.len())
                    .map_err(|_| ProtoError::MessageTooLarge { size: data.len() })?;
                w.put(&MigData {
                    argsz: *argsz,
                    size,
                });
                w.put_bytes(data);
            }
        }
        w.finish().map(|_| ())
    }
}

/// Hot path for the client: writes a complete REGION_WRITE request (header
/// and access) and returns the `count`-byte data area to fill in place.
pub fn region_write_request_buffer(
    out: &mut Vec<u8>,
    msg_id: u16,
    no_reply: bool,
    offset: u64,
    region: u32,
    count: u32,
) -> Result<&mut [u8], ProtoError> {
    let body = RegionAccess::SIZE
        .checked_add(count as usize)
        .ok_or(ProtoError::overflow("REGION_WRITE size"))?;
    let hdr = Header::command(msg_id, Command::RegionWrite, no_reply, body)?;
    Ok(fixed_then_data(
        out,
        hdr,
        &[RegionAccess {
            offset,
            region,
            count,
        }
        .as_bytes()],
        count as usize,
    ))
}
