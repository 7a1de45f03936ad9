//! Replies: decoding with validation, allocation-free encoding, and direct
//! hot-path helpers.

use zerocopy::IntoBytes;

use crate::caps::Capabilities;
use crate::check::{check_argsz, check_fds, data_len, exact_body};
use crate::consts::*;
use crate::error::ProtoError;
use crate::header::{Command, Header};
use crate::payload::*;
use crate::wire::*;
use crate::writer::{
    MSG_SIZE_OFFSET, MessageWriter, fixed_then_data, fixed_then_overwritten, patch_u32,
};

/// A decoded reply. Error replies are not a variant: [`decode_reply`]
/// returns [`ProtoError::ErrorReply`] for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply<'a> {
    /// VERSION: the server's chosen version and capabilities.
    Version(Version<'a>),
    /// DMA_MAP done.
    DmaMap,
    /// DMA_UNMAP done (entry echoed, bitmap if requested).
    DmaUnmap {
        /// The unmap entry.
        unmap: DmaUnmap,
        /// The dirty bitmap for `GET_DIRTY_BITMAP`.
        bitmap: Option<DirtyBitmap<'a>>,
    },
    /// DEVICE_GET_INFO.
    DeviceGetInfo(DeviceInfo),
    /// DEVICE_GET_REGION_INFO: the info and the capability bytes following it
    /// (see [`region_caps`]). Region fds travel separately.
    DeviceGetRegionInfo {
        /// The region info.
        info: RegionInfo,
        /// Bytes after the 32-byte info (capability chain), possibly empty.
        caps: &'a [u8],
    },
    /// DEVICE_GET_REGION_IO_FDS.
    DeviceGetRegionIoFds {
        /// Size needed for the full reply.
        argsz: u32,
        /// Region index.
        index: u32,
        /// Number of sub-regions (entries may be omitted if argsz was too small).
        count: u32,
        /// Entries.
        entries: IoFdEntries<'a>,
    },
    /// DEVICE_GET_IRQ_INFO.
    DeviceGetIrqInfo(IrqInfo),
    /// DEVICE_SET_IRQS done.
    DeviceSetIrqs,
    /// REGION_READ data.
    RegionRead {
        /// Offset.
        offset: u64,
        /// Region index.
        region: u32,
        /// Data read.
        data: &'a [u8],
    },
    /// REGION_WRITE done.
    RegionWrite {
        /// Offset.
        offset: u64,
        /// Region index.
        region: u32,
        /// Bytes written.
        count: u32,
    },
    /// DMA_READ data (client to server).
    DmaRead {
        /// IOVA.
        address: u64,
        /// Data read.
        data: &'a [u8],
    },
    /// DMA_WRITE done (client to server). Decodes 4- and 8-byte `count`;
    /// encodes 8 bytes (libvfio-user's struct; §1.20 #2).
    DmaWrite {
        /// IOVA.
        address: u64,
        /// Bytes written.
        count: u64,
    },
    /// DEVICE_RESET done.
    DeviceReset,
    /// REGION_WRITE_MULTI: writes completed.
    RegionWriteMulti {
        /// Writes completed.
        wr_cnt: u64,
    },
    /// DEVICE_FEATURE.
    DeviceFeature(DeviceFeatureReply<'a>),
    /// MIG_DATA_READ data (shorter than requested = end of data).
    MigDataRead {
        /// 8 + data length.
        argsz: u32,
        /// Data.
        data: &'a [u8],
    },
    /// GET_PRECOPY_INFO: what the PRE_COPY stream still holds.
    GetPrecopyInfo(PrecopyInfo),
    /// MIG_DATA_WRITE done: no payload (v0.9.2) or `{argsz, size}` (newer text; §1.20 #5).
    MigDataWrite(Option<MigData>),
}

/// QEMU upstream's DMA_WRITE reply: `address` u64 + `count` u32 (§1.20 #2).
const DMA_WRITE_REPLY_SHORT_SIZE: usize = 12;

fn no_fds(what: &'static str, nfds: usize) -> Result<(), ProtoError> {
    check_fds(what, nfds, 0)
}

fn empty(what: &'static str, body: &[u8]) -> Result<(), ProtoError> {
    exact_body(what, body, 0)
}

/// Decodes and validates a reply (with [`MAX_MSG_SIZE`] as the size cap).
///
/// Error replies (header `Error` flag) return [`ProtoError::ErrorReply`]
/// carrying the peer's errno; their body is ignored. Matching the reply to
/// the request (msg id, command) is the caller's job.
pub fn decode_reply<'a>(
    hdr: &Header,
    body: &'a [u8],
    nfds: usize,
) -> Result<Reply<'a>, ProtoError> {
    decode_reply_within(hdr, body, nfds, MAX_MSG_SIZE)
}

/// [`decode_reply`] with a caller-chosen maximum message size.
pub fn decode_reply_within<'a>(
    hdr: &Header,
    body: &'a [u8],
    nfds: usize,
    max_msg_size: u32,
) -> Result<Reply<'a>, ProtoError> {
    hdr.validate_reply_flags()?;
    let blen = hdr.body_len_within(max_msg_size)?;
    if blen != body.len() {
        return Err(ProtoError::SizeMismatch {
            msg_size: hdr.msg_size,
            body: body.len(),
        });
    }
    if hdr.is_error() {
        return Err(ProtoError::ErrorReply {
            cmd: hdr.cmd,
            errno: hdr.error_no,
        });
    }
    decode_reply_body(hdr.command_kind()?, body, nfds)
}

/// Decodes and validates the body of a successful reply to `cmd`, for a
/// caller that already checked the header (flags, size, `Error`) and kept
/// only the body. [`decode_reply_within`] is these header checks plus this.
pub fn decode_reply_body(cmd: Command, body: &[u8], nfds: usize) -> Result<Reply<'_>, ProtoError> {
    match cmd {
        Command::Version => {
            check_fds("VERSION reply", nfds, 1)?;
            Version::decode(body, "VERSION reply").map(Reply::Version)
        }
        Command::DmaMap => {
            no_fds("DMA_MAP reply", nfds)?;
            empty("DMA_MAP reply", body)?;
            Ok(Reply::DmaMap)
        }
        Command::DmaUnmap => {
            no_fds("DMA_UNMAP reply", nfds)?;
            let (unmap, rest) = read_prefix::<DmaUnmap>(body, "DMA_UNMAP reply")?;
            if unmap.flags & VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP == 0 {
                empty("DMA_UNMAP reply", rest)?;
                return Ok(Reply::DmaUnmap {
                    unmap,
                    bitmap: None,
                });
            }
            let (b, data) = read_prefix::<BitmapHeader>(rest, "DMA_UNMAP reply bitmap")?;
            let want = dirty_bitmap_size(unmap.size, b.pgsize)?;
            if b.size != want {
                return Err(ProtoError::invalid(
                    "DMA_UNMAP reply bitmap size",
                    "does not match size and pgsize",
                ));
            }
            data_len("DMA_UNMAP reply bitmap", data, want)?;
            Ok(Reply::DmaUnmap {
                unmap,
                bitmap: Some(DirtyBitmap {
                    pgsize: b.pgsize,
                    data,
                }),
            })
        }
        Command::DeviceGetInfo => {
            no_fds("DEVICE_GET_INFO reply", nfds)?;
            let i = read_exact::<DeviceInfo>(body, "DEVICE_GET_INFO reply")?;
            check_argsz("DEVICE_GET_INFO reply", i.argsz, DeviceInfo::SIZE as u64)?;
            Ok(Reply::DeviceGetInfo(i))
        }
        Command::DeviceGetRegionInfo => {
            let (info, caps) = read_prefix::<RegionInfo>(body, "DEVICE_GET_REGION_INFO reply")?;
            check_argsz(
                "DEVICE_GET_REGION_INFO reply",
                info.argsz,
                RegionInfo::SIZE as u64,
            )?;
            check_fds(
                "DEVICE_GET_REGION_INFO reply",
                nfds,
                MAX_MSG_FDS_LIMIT as usize,
            )?;
            let has_chain = info.flags & VFIO_REGION_INFO_FLAG_CAPS != 0 && info.cap_offset != 0;
            if caps.is_empty() == has_chain {
                return Err(ProtoError::invalid(
                    "DEVICE_GET_REGION_INFO reply",
                    "capability bytes do not match cap_offset",
                ));
            }
            for cap in region_caps(&info, caps) {
                let cap = cap?;
                cap.sparse_mmap_areas()?;
                cap.region_type()?;
            }
            Ok(Reply::DeviceGetRegionInfo { info, caps })
        }
        Command::DeviceGetRegionIoFds => {
            let (h, rest) = read_prefix::<RegionIoFds>(body, "DEVICE_GET_REGION_IO_FDS reply")?;
            if h.flags != 0 {
                return Err(ProtoError::BadFlags {
                    what: "DEVICE_GET_REGION_IO_FDS reply",
                    flags: u64::from(h.flags),
                });
            }
            let entries = if rest.is_empty() {
                no_fds("DEVICE_GET_REGION_IO_FDS reply without entries", nfds)?;
                IoFdEntries::Spec(Records::default())
            } else {
                let n = h.count as usize;
                let spec = n
                    .checked_mul(IoFdEntry::SIZE)
                    .ok_or(ProtoError::overflow("io fd entries"))?;
                let lvu = n
                    .checked_mul(IoFdShadowEntry::SIZE)
                    .ok_or(ProtoError::overflow("io fd entries"))?;
                let e = if rest.len() == spec {
                    IoFdEntries::Spec(Records::from_bytes(rest, "io fd entries")?)
                } else if rest.len() == lvu {
                    IoFdEntries::LibvfioUser(Records::from_bytes(rest, "io fd entries")?)
                } else {
                    return Err(ProtoError::invalid(
                        "DEVICE_GET_REGION_IO_FDS reply",
                        "entry array size does not match count",
                    ));
                };
                if nfds == 0 || e.fd_indexes().any(|i| i as usize >= nfds) {
                    return Err(ProtoError::BadFdCount {
                        what: "DEVICE_GET_REGION_IO_FDS reply (fd_index out of range)",
                        got: nfds,
                    });
                }
                e
            };
            Ok(Reply::DeviceGetRegionIoFds {
                argsz: h.argsz,
                index: h.index,
                count: h.count,
                entries,
            })
        }
        Command::DeviceGetIrqInfo => {
            no_fds("DEVICE_GET_IRQ_INFO reply", nfds)?;
            Ok(Reply::DeviceGetIrqInfo(read_exact::<IrqInfo>(
                body,
                "DEVICE_GET_IRQ_INFO reply",
            )?))
        }
        Command::DeviceSetIrqs => {
            no_fds("DEVICE_SET_IRQS reply", nfds)?;
            empty("DEVICE_SET_IRQS reply", body)?;
            Ok(Reply::DeviceSetIrqs)
        }
        Command::RegionRead => {
            no_fds("REGION_READ reply", nfds)?;
            let (a, data) = read_prefix::<RegionAccess>(body, "REGION_READ reply")?;
            data_len("REGION_READ reply data", data, u64::from(a.count))?;
            Ok(Reply::RegionRead {
                offset: a.offset,
                region: a.region,
                data,
            })
        }
        Command::RegionWrite => {
            no_fds("REGION_WRITE reply", nfds)?;
            let a = read_exact::<RegionAccess>(body, "REGION_WRITE reply")?;
            Ok(Reply::RegionWrite {
                offset: a.offset,
                region: a.region,
                count: a.count,
            })
        }
        Command::DmaRead => {
            no_fds("DMA_READ reply", nfds)?;
            let (a, data) = read_prefix::<DmaAccess>(body, "DMA_READ reply")?;
            data_len("DMA_READ reply data", data, a.count)?;
            Ok(Reply::DmaRead {
                address: a.address,
                data,
            })
        }
        Command::DmaWrite => {
            no_fds("DMA_WRITE reply", nfds)?;
            match body.len() {
                DMA_WRITE_REPLY_SHORT_SIZE => {
                    let (address, count) = read_prefix::<u64>(body, "DMA_WRITE reply")?;
                    let count = read_exact::<u32>(count, "DMA_WRITE reply")?;
                    Ok(Reply::DmaWrite {
                        address,
                        count: u64::from(count),
                    })
                }
                _ => {
                    let a = read_exact::<DmaAccess>(body, "DMA_WRITE reply")?;
                    Ok(Reply::DmaWrite {
                        address: a.address,
                        count: a.count,
                    })
                }
            }
        }
        Command::DeviceReset => {
            no_fds("DEVICE_RESET reply", nfds)?;
            empty("DEVICE_RESET reply", body)?;
            Ok(Reply::DeviceReset)
        }
        Command::RegionWriteMulti => {
            no_fds("REGION_WRITE_MULTI reply", nfds)?;
            let wr_cnt = read_exact::<u64>(body, "REGION_WRITE_MULTI reply")?;
            Ok(Reply::RegionWriteMulti { wr_cnt })
        }
        Command::DeviceFeature => {
            no_fds("DEVICE_FEATURE reply", nfds)?;
            decode_feature_reply(body).map(Reply::DeviceFeature)
        }
        Command::MigDataRead => {
            no_fds("MIG_DATA_READ reply", nfds)?;
            let (m, data) = read_prefix::<MigData>(body, "MIG_DATA_READ reply")?;
            data_len("MIG_DATA_READ reply data", data, u64::from(m.size))?;
            Ok(Reply::MigDataRead {
                argsz: m.argsz,
                data,
            })
        }
        Command::MigDataWrite => {
            no_fds("MIG_DATA_WRITE reply", nfds)?;
            if body.is_empty() {
                Ok(Reply::MigDataWrite(None))
            } else {
                Ok(Reply::MigDataWrite(Some(read_exact::<MigData>(
                    body,
                    "MIG_DATA_WRITE reply",
                )?)))
            }
        }
        Command::GetPrecopyInfo => {
            no_fds("GET_PRECOPY_INFO reply", nfds)?;
            let p = read_exact::<PrecopyInfo>(body, "GET_PRECOPY_INFO reply")?;
            check_argsz("GET_PRECOPY_INFO reply", p.argsz, PrecopyInfo::SIZE as u64)?;
            Ok(Reply::GetPrecopyInfo(p))
        }
        Command::DirtyPages => Err(ProtoError::UnsupportedCommand(cmd)),
    }
}

fn decode_feature_reply(body: &[u8]) -> Result<DeviceFeatureReply<'_>, ProtoError> {
    let (h, data) = read_prefix::<DeviceFeatureHeader>(body, "DEVICE_FEATURE reply")?;
    let f = FeatureFlags(h.flags);
    f.validate()?;
    let op = if f.probe() {
        FeatureReply::Probe {
            feature: f.feature(),
            get: f.get(),
            set: f.set(),
        }
    } else {
        match f.feature() {
            VFIO_DEVICE_FEATURE_MIGRATION => {
                FeatureReply::GetMigration(read_exact::<MigrationFeature>(data, "MIGRATION reply")?)
            }
            VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE => {
                let s = read_exact::<MigDeviceState>(data, "MIG_DEVICE_STATE reply")?;
                if f.get() {
                    FeatureReply::GetMigDeviceState(s)
                } else {
                    FeatureReply::SetMigDeviceState(s)
                }
            }
            VFIO_DEVICE_FEATURE_DMA_LOGGING_START => {
                FeatureReply::DmaLoggingStart(DmaLoggingControl::decode(data)?)
            }
            VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP => FeatureReply::DmaLoggingStop,
            VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT => {
                let (report, bitmap) =
                    read_prefix::<DmaLoggingReport>(data, "DMA_LOGGING_REPORT reply")?;
                let want = dirty_bitmap_size(report.length, report.page_size)?;
                data_len("DMA_LOGGING_REPORT bitmap", bitmap, want)?;
                FeatureReply::DmaLoggingReport { report, bitmap }
            }
            _ => FeatureReply::Other {
                flags: h.flags,
                data,
            },
        }
    };
    Ok(DeviceFeatureReply { argsz: h.argsz, op })
}

impl Reply<'_> {
    /// The command this reply answers.
    pub fn command(&self) -> Command {
        match self {
            Reply::Version(_) => Command::Version,
            Reply::DmaMap => Command::DmaMap,
            Reply::DmaUnmap { .. } => Command::DmaUnmap,
            Reply::DeviceGetInfo(_) => Command::DeviceGetInfo,
            Reply::DeviceGetRegionInfo { .. } => Command::DeviceGetRegionInfo,
            Reply::DeviceGetRegionIoFds { .. } => Command::DeviceGetRegionIoFds,
            Reply::DeviceGetIrqInfo(_) => Command::DeviceGetIrqInfo,
            Reply::DeviceSetIrqs => Command::DeviceSetIrqs,
            Reply::RegionRead { .. } => Command::RegionRead,
            Reply::RegionWrite { .. } => Command::RegionWrite,
            Reply::DmaRead { .. } => Command::DmaRead,
            Reply::DmaWrite { .. } => Command::DmaWrite,
            Reply::DeviceReset => Command::DeviceReset,
            Reply::RegionWriteMulti { .. } => Command::RegionWriteMulti,
            Reply::DeviceFeature(_) => Command::DeviceFeature,
            Reply::MigDataRead { .. } => Command::MigDataRead,
            Reply::MigDataWrite(_) => Command::MigDataWrite,
            Reply::GetPrecopyInfo(_) => Command::GetPrecopyInfo,
        }
    }

    /// Encodes the reply into `out` (cleared first; capacity reused).
    pub fn encode(&self, msg_id: u16, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let mut w = MessageWriter::reply(out, msg_id, self.command().as_u16());
        match self {
            Reply::Version(v) => v.write(&mut w),
            Reply::DmaMap | Reply::DeviceSetIrqs | Reply::DeviceReset => {}
            Reply::DmaUnmap { unmap, bitmap } => {
                let flag = unmap.flags & VFIO_DMA_UNMAP_FLAG_GET_DIRTY_BITMAP != 0;
                if flag != bitmap.is_some() {
                    return Err(ProtoError::invalid(
                        "DMA_UNMAP reply",
                        "bitmap must match GET_DIRTY_BITMAP",
                    ));
                }
                w.put(unmap);
                if let Some(b) = bitmap {
                    w.put(&BitmapHeader {
                        pgsize: b.pgsize,
                        size: b.data.len() as u64,
                    });
                    w.put_bytes(b.data);
                }
            }
            Reply::DeviceGetInfo(i) => w.put(i),
            Reply::DeviceGetRegionInfo { info, caps } => {
                w.put(info);
                w.put_bytes(caps);
            }
            Reply::DeviceGetRegionIoFds {
                argsz,
                index,
                count,
                entries,
            } => {
                w.put(&RegionIoFds {
                    argsz: *argsz,
                    flags: 0,
                    index: *index,
                    count: *count,
                });
                w.put_bytes(entries.as_bytes());
            }
            Reply::DeviceGetIrqInfo(i) => w.put(i),
            Reply::RegionRead {
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
            Reply::RegionWrite {
                offset,
                region,
                count,
            } => w.put(&RegionAccess {
                offset: *offset,
                region: *region,
                count: *count,
            }),
            Reply::DmaRead { address, data } => {
                w.put(&DmaAccess {
                    address: *address,
                    count: data.len() as u64,
                });
                w.put_bytes(data);
            }
            Reply::DmaWrite { address, count } => w.put(&DmaAccess {
                address: *address,
                count: *count,
            }),
            Reply::RegionWriteMulti { wr_cnt } => w.put(wr_cnt),
            Reply::DeviceFeature(f) => {
                w.put(&DeviceFeatureHeader {
                    argsz: f.argsz,
                    flags: f.op.flags(),
                });
                match &f.op {
                    FeatureReply::Probe { .. } | FeatureReply::DmaLoggingStop => {}
                    FeatureReply::GetMigration(m) => w.put(m),
                    FeatureReply::GetMigDeviceState(s) | FeatureReply::SetMigDeviceState(s) => {
                        w.put(s)
                    }
                    FeatureReply::DmaLoggingStart(c) => c.write(w.buf())?,
                    FeatureReply::DmaLoggingReport { report, bitmap } => {
                        w.put(report);
                        w.put_bytes(bitmap);
                    }
                    FeatureReply::Other { data, .. } => w.put_bytes(data),
                }
            }
            Reply::MigDataRead { argsz, data } => {
                let size = u32::try_from(data.len())
                    .map_err(|_| ProtoError::MessageTooLarge { size: data.len() })?;
                w.put(&MigData {
                    argsz: *argsz,
                    size,
                });
                w.put_bytes(data);
            }
            Reply::MigDataWrite(m) => {
                if let Some(m) = m {
                    w.put(m);
                }
            }
            Reply::GetPrecopyInfo(p) => w.put(p),
        }
        w.finish().map(|_| ())
    }
}

/// Server hot path: writes a complete REGION_READ reply (header with final
/// `msg_size`, access echo) into `out` and returns the `count` zeroed data
/// bytes for the device to fill in place. On device failure, overwrite `out`
/// with [`crate::encode_error_reply`].
pub fn region_read_reply_buffer(
    out: &mut Vec<u8>,
    msg_id: u16,
    offset: u64,
    region: u32,
    count: u32,
) -> Result<&mut [u8], ProtoError> {
    let body = RegionAccess::SIZE
        .checked_add(count as usize)
        .ok_or(ProtoError::overflow("REGION_READ reply size"))?;
    let hdr = Header::reply(msg_id, VFIO_USER_REGION_READ, body)?;
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

/// Server hot path: writes a complete REGION_WRITE reply (16-byte echo).
pub fn encode_region_write_reply(
    out: &mut Vec<u8>,
    msg_id: u16,
    offset: u64,
    region: u32,
    count: u32,
) -> Result<(), ProtoError> {
    let hdr = Header::reply(msg_id, VFIO_USER_REGION_WRITE, RegionAccess::SIZE)?;
    fixed_then_data(
        out,
        hdr,
        &[RegionAccess {
            offset,
            region,
            count,
        }
        .as_bytes()],
        0,
    );
    Ok(())
}

/// Client hot path: writes a complete DMA_READ reply and returns the `count`
/// zeroed data bytes to fill from guest memory.
pub fn dma_read_reply_buffer(
    out: &mut Vec<u8>,
    msg_id: u16,
    address: u64,
    count: u64,
) -> Result<&mut [u8], ProtoError> {
    let n = usize::try_from(count).map_err(|_| ProtoError::overflow("DMA_READ reply size"))?;
    let body = DmaAccess::SIZE
        .checked_add(n)
        .ok_or(ProtoError::overflow("DMA_READ reply size"))?;
    let hdr = Header::reply(msg_id, VFIO_USER_DMA_READ, body)?;
    Ok(fixed_then_data(
        out,
        hdr,
        &[DmaAccess { address, count }.as_bytes()],
        n,
    ))
}

/// Server: writes a MIG_DATA_READ reply with room for `size` bytes and
/// returns the data area; if fewer bytes are produced, call
/// [`truncate_mig_data_read_reply`] with the actual count. The data area is
/// not zeroed where `out` already had bytes (see `fixed_then_overwritten`):
/// every byte up to the count sent must be written by the caller.
pub fn mig_data_read_reply_buffer(
    out: &mut Vec<u8>,
    msg_id: u16,
    size: u32,
) -> Result<&mut [u8], ProtoError> {
    let body = MigData::SIZE
        .checked_add(size as usize)
        .ok_or(ProtoError::overflow("MIG_DATA_READ reply size"))?;
    let argsz = u32::try_from(body).map_err(|_| ProtoError::overflow("MIG_DATA_READ argsz"))?;
    let hdr = Header::reply(msg_id, VFIO_USER_MIG_DATA_READ, body)?;
    Ok(fixed_then_overwritten(
        out,
        hdr,
        &[MigData { argsz, size }.as_bytes()],
        size as usize,
    ))
}

/// Shrinks a reply built by [`mig_data_read_reply_buffer`] to `actual` data
/// bytes (patching `msg_size`, `argsz` and `size`). `actual` must not exceed
/// the reserved size.
pub fn truncate_mig_data_read_reply(out: &mut Vec<u8>, actual: u32) -> Result<(), ProtoError> {
    let body = MigData::SIZE
        .checked_add(actual as usize)
        .ok_or(ProtoError::overflow("MIG_DATA_READ reply size"))?;
    let total = body
        .checked_add(HEADER_SIZE)
        .ok_or(ProtoError::overflow("MIG_DATA_READ reply size"))?;
    if total > out.len() {
        return Err(ProtoError::invalid(
            "MIG_DATA_READ reply",
            "actual size exceeds the reserved size",
        ));
    }
    out.truncate(total);
    let msg_size = u32::try_from(total).map_err(|_| ProtoError::MessageTooLarge { size: total })?;
    let argsz = u32::try_from(body).map_err(|_| ProtoError::MessageTooLarge { size: body })?;
    patch_u32(out, MSG_SIZE_OFFSET, msg_size);
    patch_u32(
        out,
        HEADER_SIZE + core::mem::offset_of!(MigData, argsz),
        argsz,
    );
    patch_u32(
        out,
        HEADER_SIZE + core::mem::offset_of!(MigData, size),
        actual,
    );
    Ok(())
}

/// Server: writes a DMA_UNMAP reply with a dirty bitmap area sized for
/// `unmap.size / pgsize` and returns the zeroed bitmap to fill.
pub fn dma_unmap_bitmap_reply_buffer<'b>(
    out: &'b mut Vec<u8>,
    msg_id: u16,
    unmap: &DmaUnmap,
    pgsize: u64,
) -> Result<&'b mut [u8], ProtoError> {
    let size = dirty_bitmap_size(unmap.size, pgsize)?;
    let n = usize::try_from(size).map_err(|_| ProtoError::overflow("bitmap size"))?;
    let body = (DmaUnmap::SIZE + BitmapHeader::SIZE)
        .checked_add(n)
        .ok_or(ProtoError::overflow("DMA_UNMAP reply size"))?;
    let hdr = Header::reply(msg_id, VFIO_USER_DMA_UNMAP, body)?;
    Ok(fixed_then_data(
        out,
        hdr,
        &[unmap.as_bytes(), BitmapHeader { pgsize, size }.as_bytes()],
        n,
    ))
}

/// Server: writes a DEVICE_FEATURE `DMA_LOGGING_REPORT` reply (the request's
/// report header echoed, `argsz` covering the bitmap) and returns the bitmap
/// area (`dirty_bitmap_size(report.length, report.page_size)` bytes) to fill
/// in place. The area is **not** zeroed where `out` already had bytes (a
/// report's bitmap is rewritten completely, and zeroing it first would be a
/// second pass over up to megabytes): the caller must write every byte.
pub fn dma_logging_report_reply_buffer<'b>(
    out: &'b mut Vec<u8>,
    msg_id: u16,
    report: &DmaLoggingReport,
) -> Result<&'b mut [u8], ProtoError> {
    let size = dirty_bitmap_size(report.length, report.page_size)?;
    let n = usize::try_from(size).map_err(|_| ProtoError::overflow("bitmap size"))?;
    let body = (DeviceFeatureHeader::SIZE + DmaLoggingReport::SIZE)
        .checked_add(n)
        .ok_or(ProtoError::overflow("DMA_LOGGING_REPORT reply size"))?;
    let argsz = u32::try_from(body).map_err(|_| ProtoError::MessageTooLarge { size: body })?;
    let hdr = Header::reply(msg_id, VFIO_USER_DEVICE_FEATURE, body)?;
    let feature = DeviceFeatureHeader {
        argsz,
        flags: FeatureReply::DmaLoggingReport {
            report: *report,
            bitmap: &[],
        }
        .flags(),
    };
    Ok(fixed_then_overwritten(
        out,
        hdr,
        &[feature.as_bytes(), report.as_bytes()],
        n,
    ))
}

/// Server: writes a VERSION reply (major 0, minor 0, `caps` as
/// NUL-terminated JSON) into `out`.
pub fn encode_version_reply(
    out: &mut Vec<u8>,
    msg_id: u16,
    caps: &Capabilities,
) -> Result<(), ProtoError> {
    let mut w = MessageWriter::reply(out, msg_id, VFIO_USER_VERSION);
    w.put(&VersionHeader {
        major: VFIO_USER_MAJOR,
        minor: VFIO_USER_MINOR,
    });
    caps.write_version_data(w.buf());
    w.finish().map(|_| ())
}

/// Client: writes a VERSION proposal (major 0, `minor`, `caps` as JSON).
pub fn encode_version_request(
    out: &mut Vec<u8>,
    msg_id: u16,
    minor: u16,
    caps: &Capabilities,
) -> Result<(), ProtoError> {
    let mut w = MessageWriter::command(out, msg_id, Command::Version, false);
    w.put(&VersionHeader {
        major: VFIO_USER_MAJOR,
        minor,
    });
    caps.write_version_data(w.buf());
    w.finish().map(|_| ())
}
