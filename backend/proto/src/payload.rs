//! Typed payload pieces shared by [`crate::Request`] and [`crate::Reply`].

use crate::caps::{Capabilities, version_json_text};
use crate::consts::*;
use crate::error::ProtoError;
use crate::wire::*;
use crate::writer::{MessageWriter, patch_u32};

/// VERSION payload (request and reply): versions plus the raw version data
/// (NUL-terminated JSON, or empty).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Version<'a> {
    /// Major version.
    pub major: u16,
    /// Minor version.
    pub minor: u16,
    /// Version data: empty, or JSON text followed by exactly one NUL.
    pub data: &'a [u8],
}

impl<'a> Version<'a> {
    /// The JSON text without the NUL (`None` if absent or blank).
    pub fn json(&self) -> Result<Option<&'a str>, ProtoError> {
        version_json_text(self.data)
    }

    /// Parses the capabilities (defaults when there is no JSON).
    pub fn capabilities(&self) -> Result<Capabilities, ProtoError> {
        Capabilities::from_version_data(self.data)
    }

    /// Decodes a VERSION body (request or reply), checking the version data.
    pub(crate) fn decode(body: &'a [u8], what: &'static str) -> Result<Self, ProtoError> {
        let (v, data) = read_prefix::<VersionHeader>(body, what)?;
        let version = Version {
            major: v.major,
            minor: v.minor,
            data,
        };
        version.json()?;
        Ok(version)
    }

    /// Appends the VERSION body.
    pub(crate) fn write(&self, w: &mut MessageWriter<'_>) {
        w.put(&VersionHeader {
            major: self.major,
            minor: self.minor,
        });
        w.put_bytes(self.data);
    }
}

/// The SET_IRQS action (one of the action bits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IrqAction {
    /// `VFIO_IRQ_SET_ACTION_MASK`.
    Mask,
    /// `VFIO_IRQ_SET_ACTION_UNMASK`.
    Unmask,
    /// `VFIO_IRQ_SET_ACTION_TRIGGER`.
    Trigger,
}

impl IrqAction {
    /// The flag bit.
    pub const fn flag(self) -> u32 {
        match self {
            IrqAction::Mask => VFIO_IRQ_SET_ACTION_MASK,
            IrqAction::Unmask => VFIO_IRQ_SET_ACTION_UNMASK,
            IrqAction::Trigger => VFIO_IRQ_SET_ACTION_TRIGGER,
        }
    }
}

/// The SET_IRQS data kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IrqData<'a> {
    /// `VFIO_IRQ_SET_DATA_NONE`.
    None,
    /// `VFIO_IRQ_SET_DATA_BOOL`: one byte per vector (`count` bytes; nonzero = true).
    Bool(&'a [u8]),
    /// `VFIO_IRQ_SET_DATA_EVENTFD`: the fds travel as SCM_RIGHTS; either
    /// `count` fds, or none to de-assign.
    Eventfd,
}

impl IrqData<'_> {
    /// The flag bit.
    pub const fn flag(&self) -> u32 {
        match self {
            IrqData::None => VFIO_IRQ_SET_DATA_NONE,
            IrqData::Bool(_) => VFIO_IRQ_SET_DATA_BOOL,
            IrqData::Eventfd => VFIO_IRQ_SET_DATA_EVENTFD,
        }
    }
}

/// A validated SET_IRQS request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SetIrqs<'a> {
    /// argsz as sent (≥ 20; may include kernel-style eventfd array space).
    pub argsz: u32,
    /// Action.
    pub action: IrqAction,
    /// Data kind (and bools).
    pub data: IrqData<'a>,
    /// IRQ index.
    pub index: u32,
    /// First vector.
    pub start: u32,
    /// Number of vectors.
    pub count: u32,
}

impl SetIrqs<'_> {
    /// The wire flags (`action | data`).
    pub fn flags(&self) -> u32 {
        self.action.flag() | self.data.flag()
    }
}

/// A dirty bitmap (DMA_UNMAP with `GET_DIRTY_BITMAP` reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirtyBitmap<'a> {
    /// Page size one bit stands for.
    pub pgsize: u64,
    /// Bitmap bytes (one bit per page, u64 words, host endian).
    pub data: &'a [u8],
}

/// Bytes of a VFIO dirty bitmap covering `size` bytes at `pgsize` granularity:
/// pages rounded up to a multiple of 64 bits, in bytes (libvfio-user's and
/// Linux's formula). `pgsize` must be a nonzero power of two.
pub fn dirty_bitmap_size(size: u64, pgsize: u64) -> Result<u64, ProtoError> {
    if pgsize == 0 || !pgsize.is_power_of_two() {
        return Err(ProtoError::invalid("page size", "not a power of two"));
    }
    let pages = size.div_ceil(pgsize);
    let words = pages.div_ceil(64);
    words
        .checked_mul(8)
        .ok_or(ProtoError::overflow("bitmap size"))
}

/// DMA logging control (START/STOP data): page size and ranges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DmaLoggingControl<'a> {
    /// Page size (nonzero power of two).
    pub page_size: u64,
    /// Ranges; empty means "log all writes".
    pub ranges: Records<'a, DmaLoggingRange>,
}

impl<'a> DmaLoggingControl<'a> {
    /// Encoded size.
    pub fn encoded_len(&self) -> usize {
        DmaLoggingControlHeader::SIZE.saturating_add(self.ranges.as_bytes().len())
    }

    pub(crate) fn decode(data: &'a [u8]) -> Result<Self, ProtoError> {
        let (h, rest) = read_prefix::<DmaLoggingControlHeader>(data, "DMA logging control")?;
        if h.page_size == 0 || !h.page_size.is_power_of_two() {
            return Err(ProtoError::invalid(
                "DMA logging page size",
                "not a power of two",
            ));
        }
        let want = usize::try_from(h.num_ranges)
            .ok()
            .and_then(|n| n.checked_mul(DmaLoggingRange::SIZE))
            .ok_or(ProtoError::overflow("DMA logging ranges"))?;
        // At least `num_ranges` ranges; bytes after them are ignored (libvfio-user does not
        // look at the ranges at all).
        let rest = rest.get(..want).ok_or(ProtoError::BadSize {
            what: "DMA logging ranges",
            expected: want,
            got: rest.len(),
        })?;
        let ranges = Records::<DmaLoggingRange>::from_bytes(rest, "DMA logging ranges")?;
        for r in ranges.iter() {
            r.iova
                .checked_add(r.length)
                .ok_or(ProtoError::overflow("DMA logging range"))?;
        }
        Ok(DmaLoggingControl {
            page_size: h.page_size,
            ranges,
        })
    }

    pub(crate) fn write(&self, out: &mut Vec<u8>) -> Result<(), ProtoError> {
        let num_ranges = u32::try_from(self.ranges.len())
            .map_err(|_| ProtoError::overflow("DMA logging ranges"))?;
        let h = DmaLoggingControlHeader {
            page_size: self.page_size,
            num_ranges,
            reserved: 0,
        };
        out.extend_from_slice(zerocopy::IntoBytes::as_bytes(&h));
        out.extend_from_slice(self.ranges.as_bytes());
        Ok(())
    }
}

/// The feature index and op bits of a DEVICE_FEATURE message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FeatureFlags(pub u32);

impl FeatureFlags {
    /// Feature index (`flags & 0xffff`).
    pub fn feature(self) -> u16 {
        (self.0 & VFIO_DEVICE_FEATURE_MASK) as u16
    }
    /// GET bit.
    pub fn get(self) -> bool {
        self.0 & VFIO_DEVICE_FEATURE_GET != 0
    }
    /// SET bit.
    pub fn set(self) -> bool {
        self.0 & VFIO_DEVICE_FEATURE_SET != 0
    }
    /// PROBE bit.
    pub fn probe(self) -> bool {
        self.0 & VFIO_DEVICE_FEATURE_PROBE != 0
    }
    /// Builds flags.
    pub fn new(feature: u16, get: bool, set: bool, probe: bool) -> Self {
        FeatureFlags(
            u32::from(feature)
                | if get { VFIO_DEVICE_FEATURE_GET } else { 0 }
                | if set { VFIO_DEVICE_FEATURE_SET } else { 0 }
                | if probe { VFIO_DEVICE_FEATURE_PROBE } else { 0 },
        )
    }

    /// Validates: no undefined bits; GET and SET exclusive unless PROBE;
    /// one of GET/SET/PROBE present; without PROBE, the op must be one the
    /// feature supports (GET for MIGRATION and DMA_LOGGING_REPORT, SET for
    /// DMA_LOGGING_START/STOP; other features are not restricted).
    pub fn validate(self) -> Result<(), ProtoError> {
        if self.0 & !VFIO_DEVICE_FEATURE_ALL != 0 {
            return Err(ProtoError::BadFlags {
                what: "device feature",
                flags: u64::from(self.0),
            });
        }
        if self.get() && self.set() && !self.probe() {
            return Err(ProtoError::BadFlags {
                what: "device feature (GET with SET)",
                flags: u64::from(self.0),
            });
        }
        if !self.get() && !self.set() && !self.probe() {
            return Err(ProtoError::BadFlags {
                what: "device feature (no operation)",
                flags: u64::from(self.0),
            });
        }
        let op_ok = self.probe()
            || match self.feature() {
                VFIO_DEVICE_FEATURE_MIGRATION | VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT => {
                    self.get()
                }
                VFIO_DEVICE_FEATURE_DMA_LOGGING_START | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP => {
                    self.set()
                }
                _ => true,
            };
        if !op_ok {
            return Err(ProtoError::BadFlags {
                what: "device feature (operation not valid for feature)",
                flags: u64::from(self.0),
            });
        }
        Ok(())
    }
}

/// A DEVICE_FEATURE request operation, typed by feature and op.
///
/// Known vfio-user features (1, 2, 6, 7, 8) with an op they do not support
/// are rejected with `EINVAL` while decoding (libvfio-user's answer). Other
/// feature indexes are passed through as [`FeatureRequest::Other`] so the
/// server can choose the errno.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureRequest<'a> {
    /// PROBE (any feature; GET/SET bits say which ops are probed). Data ignored.
    Probe {
        /// Feature index.
        feature: u16,
        /// Probe GET.
        get: bool,
        /// Probe SET.
        set: bool,
    },
    /// GET `MIGRATION` (reply: [`MigrationFeature`]).
    GetMigration,
    /// GET `MIG_DEVICE_STATE`.
    GetMigDeviceState,
    /// SET `MIG_DEVICE_STATE`.
    SetMigDeviceState(MigDeviceState),
    /// SET `DMA_LOGGING_START`.
    DmaLoggingStart(DmaLoggingControl<'a>),
    /// SET `DMA_LOGGING_STOP` (data, if any, ignored).
    DmaLoggingStop,
    /// GET `DMA_LOGGING_REPORT` (read-and-clear bitmap in the reply).
    DmaLoggingReport(DmaLoggingReport),
    /// A feature index this codec does not model (GET xor SET).
    Other {
        /// Raw flags.
        flags: u32,
        /// Raw data.
        data: &'a [u8],
    },
}

impl FeatureRequest<'_> {
    /// The wire flags.
    pub fn flags(&self) -> u32 {
        let f = |feat: u16, get: bool, set: bool| FeatureFlags::new(feat, get, set, false).0;
        match self {
            FeatureRequest::Probe { feature, get, set } => {
                FeatureFlags::new(*feature, *get, *set, true).0
            }
            FeatureRequest::GetMigration => f(VFIO_DEVICE_FEATURE_MIGRATION, true, false),
            FeatureRequest::GetMigDeviceState => {
                f(VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, true, false)
            }
            FeatureRequest::SetMigDeviceState(_) => {
                f(VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, false, true)
            }
            FeatureRequest::DmaLoggingStart(_) => {
                f(VFIO_DEVICE_FEATURE_DMA_LOGGING_START, false, true)
            }
            FeatureRequest::DmaLoggingStop => f(VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, false, true),
            FeatureRequest::DmaLoggingReport(_) => {
                f(VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, true, false)
            }
            FeatureRequest::Other { flags, .. } => *flags,
        }
    }

    /// The feature index.
    pub fn feature(&self) -> u16 {
        FeatureFlags(self.flags()).feature()
    }
}

/// A DEVICE_FEATURE request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceFeatureRequest<'a> {
    /// Maximum reply payload (includes the 8-byte argsz/flags prefix).
    pub argsz: u32,
    /// The typed operation.
    pub op: FeatureRequest<'a>,
}

/// A DEVICE_FEATURE reply operation, typed by feature and op.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeatureReply<'a> {
    /// PROBE succeeded.
    Probe {
        /// Feature index.
        feature: u16,
        /// GET was probed.
        get: bool,
        /// SET was probed.
        set: bool,
    },
    /// GET `MIGRATION` result.
    GetMigration(MigrationFeature),
    /// GET `MIG_DEVICE_STATE` result.
    GetMigDeviceState(MigDeviceState),
    /// SET `MIG_DEVICE_STATE` echo.
    SetMigDeviceState(MigDeviceState),
    /// SET `DMA_LOGGING_START` echo (page size possibly changed by the device).
    DmaLoggingStart(DmaLoggingControl<'a>),
    /// SET `DMA_LOGGING_STOP` done.
    DmaLoggingStop,
    /// GET `DMA_LOGGING_REPORT` result.
    DmaLoggingReport {
        /// The report request echoed.
        report: DmaLoggingReport,
        /// Bitmap: bit k = page `iova + k*page_size`, u64 words.
        bitmap: &'a [u8],
    },
    /// Unmodelled feature.
    Other {
        /// Raw flags.
        flags: u32,
        /// Raw data.
        data: &'a [u8],
    },
}

impl FeatureReply<'_> {
    /// The wire flags.
    pub fn flags(&self) -> u32 {
        let f = |feat: u16, get: bool, set: bool| FeatureFlags::new(feat, get, set, false).0;
        match self {
            FeatureReply::Probe { feature, get, set } => {
                FeatureFlags::new(*feature, *get, *set, true).0
            }
            FeatureReply::GetMigration(_) => f(VFIO_DEVICE_FEATURE_MIGRATION, true, false),
            FeatureReply::GetMigDeviceState(_) => {
                f(VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, true, false)
            }
            FeatureReply::SetMigDeviceState(_) => {
                f(VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE, false, true)
            }
            FeatureReply::DmaLoggingStart(_) => {
                f(VFIO_DEVICE_FEATURE_DMA_LOGGING_START, false, true)
            }
            FeatureReply::DmaLoggingStop => f(VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP, false, true),
            FeatureReply::DmaLoggingReport { .. } => {
                f(VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT, true, false)
            }
            FeatureReply::Other { flags, .. } => *flags,
        }
    }

    /// Encoded data length (after argsz/flags).
    pub fn data_len(&self) -> usize {
        match self {
            FeatureReply::Probe { .. } | FeatureReply::DmaLoggingStop => 0,
            FeatureReply::GetMigration(_) => MigrationFeature::SIZE,
            FeatureReply::GetMigDeviceState(_) | FeatureReply::SetMigDeviceState(_) => {
                MigDeviceState::SIZE
            }
            FeatureReply::DmaLoggingStart(c) => c.encoded_len(),
            FeatureReply::DmaLoggingReport { bitmap, .. } => {
                DmaLoggingReport::SIZE.saturating_add(bitmap.len())
            }
            FeatureReply::Other { data, .. } => data.len(),
        }
    }
}

/// A DEVICE_FEATURE reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceFeatureReply<'a> {
    /// argsz: size of the full reply payload (8 + data).
    pub argsz: u32,
    /// The typed result.
    pub op: FeatureReply<'a>,
}

/// Migration device states (`VFIO_DEVICE_STATE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum MigState {
    /// ERROR (0).
    Error = VFIO_DEVICE_STATE_ERROR,
    /// STOP (1).
    Stop = VFIO_DEVICE_STATE_STOP,
    /// RUNNING (2).
    Running = VFIO_DEVICE_STATE_RUNNING,
    /// STOP_COPY (3).
    StopCopy = VFIO_DEVICE_STATE_STOP_COPY,
    /// RESUMING (4).
    Resuming = VFIO_DEVICE_STATE_RESUMING,
    /// RUNNING_P2P (5; not used in vfio-user).
    RunningP2p = VFIO_DEVICE_STATE_RUNNING_P2P,
    /// PRE_COPY (6).
    PreCopy = VFIO_DEVICE_STATE_PRE_COPY,
    /// PRE_COPY_P2P (7; not used in vfio-user).
    PreCopyP2p = VFIO_DEVICE_STATE_PRE_COPY_P2P,
}

impl TryFrom<u32> for MigState {
    type Error = ProtoError;
    fn try_from(v: u32) -> Result<Self, ProtoError> {
        Ok(match v {
            VFIO_DEVICE_STATE_ERROR => MigState::Error,
            VFIO_DEVICE_STATE_STOP => MigState::Stop,
            VFIO_DEVICE_STATE_RUNNING => MigState::Running,
            VFIO_DEVICE_STATE_STOP_COPY => MigState::StopCopy,
            VFIO_DEVICE_STATE_RESUMING => MigState::Resuming,
            VFIO_DEVICE_STATE_RUNNING_P2P => MigState::RunningP2p,
            VFIO_DEVICE_STATE_PRE_COPY => MigState::PreCopy,
            VFIO_DEVICE_STATE_PRE_COPY_P2P => MigState::PreCopyP2p,
            _ => {
                return Err(ProtoError::invalid(
                    "device state",
                    "unknown migration state",
                ));
            }
        })
    }
}

/// GET_REGION_IO_FDS reply entries, in either layout (§1.20 #3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoFdEntries<'a> {
    /// Spec layout, 40-byte entries.
    Spec(Records<'a, IoFdEntry>),
    /// libvfio-user layout, 48-byte entries.
    LibvfioUser(Records<'a, IoFdShadowEntry>),
}

impl IoFdEntries<'_> {
    /// Number of entries.
    pub fn len(&self) -> usize {
        match self {
            IoFdEntries::Spec(r) => r.len(),
            IoFdEntries::LibvfioUser(r) => r.len(),
        }
    }
    /// Whether there are none (e.g. omitted because argsz was too small).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Raw bytes.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            IoFdEntries::Spec(r) => r.as_bytes(),
            IoFdEntries::LibvfioUser(r) => r.as_bytes(),
        }
    }
    /// The fd indexes referenced, in order.
    pub fn fd_indexes(&self) -> impl Iterator<Item = u32> + '_ {
        let (a, b) = match self {
            IoFdEntries::Spec(r) => (Some(r.iter().map(|e| e.fd_index)), None),
            IoFdEntries::LibvfioUser(r) => (None, Some(r.iter().map(|e| e.fd_index))),
        };
        a.into_iter().flatten().chain(b.into_iter().flatten())
    }
}

/// One region-info capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionCap<'a> {
    /// Offset of the cap header from the start of the region info.
    pub offset: u32,
    /// Capability header.
    pub header: CapHeader,
    /// Body after the header, up to the next capability (or the end).
    pub body: &'a [u8],
}

impl<'a> RegionCap<'a> {
    /// Sparse mmap areas, if this is a `SPARSE_MMAP` capability.
    pub fn sparse_mmap_areas(&self) -> Result<Option<Records<'a, SparseMmapArea>>, ProtoError> {
        if self.header.id != VFIO_REGION_INFO_CAP_SPARSE_MMAP {
            return Ok(None);
        }
        let (h, rest) = read_prefix::<SparseMmapHeader>(self.body, "sparse mmap capability")?;
        let len = usize::try_from(h.nr_areas)
            .ok()
            .and_then(|n| n.checked_mul(SparseMmapArea::SIZE))
            .ok_or(ProtoError::overflow("sparse mmap areas"))?;
        let bytes =
            rest.get(..len)
                .ok_or(ProtoError::truncated("sparse mmap areas", len, rest.len()))?;
        Ok(Some(Records::from_bytes(bytes, "sparse mmap areas")?))
    }

    /// Region type/subtype, if this is a `TYPE` capability.
    pub fn region_type(&self) -> Result<Option<RegionTypeCap>, ProtoError> {
        if self.header.id != VFIO_REGION_INFO_CAP_TYPE {
            return Ok(None);
        }
        Ok(Some(
            read_prefix::<RegionTypeCap>(self.body, "region type capability")?.0,
        ))
    }
}

/// Iterates the capability chain of a region info reply.
///
/// `caps` are the bytes following the 32-byte `vfio_region_info`; offsets in
/// the chain are relative to the start of the region info. The chain must
/// move strictly forward, so iteration always terminates.
pub fn region_caps<'a>(info: &RegionInfo, caps: &'a [u8]) -> RegionCapIter<'a> {
    let first = if info.flags & VFIO_REGION_INFO_FLAG_CAPS != 0 {
        info.cap_offset
    } else {
        0
    };
    RegionCapIter {
        caps,
        next: first,
        failed: false,
    }
}

/// Iterator returned by [`region_caps`].
#[derive(Debug, Clone)]
pub struct RegionCapIter<'a> {
    caps: &'a [u8],
    next: u32,
    failed: bool,
}

impl<'a> Iterator for RegionCapIter<'a> {
    type Item = Result<RegionCap<'a>, ProtoError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.next == 0 || self.failed {
            return None;
        }
        let r = self.step();
        if r.is_err() {
            self.failed = true;
        }
        Some(r)
    }
}

impl<'a> RegionCapIter<'a> {
    fn step(&mut self) -> Result<RegionCap<'a>, ProtoError> {
        // Each `next` is at least a header past its capability (checked
        // below), so the chain moves strictly forward; only the first
        // offset can point back into the region info.
        let off = self.next;
        let rel = (off as usize)
            .checked_sub(REGION_INFO_SIZE)
            .ok_or(ProtoError::invalid(
                "region capability chain",
                "offset does not move forward",
            ))?;
        let from = self.caps.get(rel..).ok_or(ProtoError::invalid(
            "region capability chain",
            "offset beyond the reply",
        ))?;
        let (header, rest) = read_prefix::<CapHeader>(from, "capability header")?;
        let body_len = if header.next == 0 {
            rest.len()
        } else {
            let end = (header.next as usize)
                .checked_sub(off as usize)
                .and_then(|d| d.checked_sub(CapHeader::SIZE))
                .ok_or(ProtoError::invalid(
                    "region capability chain",
                    "next overlaps the current capability",
                ))?;
            if end > rest.len() {
                return Err(ProtoError::invalid(
                    "region capability chain",
                    "next beyond the reply",
                ));
            }
            end
        };
        let body = rest.get(..body_len).unwrap_or(rest);
        self.next = header.next;
        Ok(RegionCap {
            offset: off,
            header,
            body,
        })
    }
}

/// Builds a region-info capability chain into a buffer; the result is the
/// bytes that follow the 32-byte `vfio_region_info` in a reply.
///
/// The first capability sits at offset 32, so set `cap_offset = 32`,
/// `flags |= CAPS` and `argsz = 32 + caps.len()` (see [`RegionCapsBuilder::finish_info`]).
#[derive(Debug)]
pub struct RegionCapsBuilder<'b> {
    out: &'b mut Vec<u8>,
    last_next_at: Option<usize>,
}

impl<'b> RegionCapsBuilder<'b> {
    /// Starts a chain in `out` (cleared).
    pub fn new(out: &'b mut Vec<u8>) -> Self {
        out.clear();
        RegionCapsBuilder {
            out,
            last_next_at: None,
        }
    }

    fn begin(&mut self, id: u16, version: u16) -> Result<(), ProtoError> {
        let off = u32::try_from(self.out.len().saturating_add(REGION_INFO_SIZE))
            .map_err(|_| ProtoError::overflow("capability offset"))?;
        if let Some(at) = self.last_next_at {
            patch_u32(self.out, at, off);
        }
        self.last_next_at = Some(
            self.out
                .len()
                .saturating_add(core::mem::offset_of!(CapHeader, next)),
        );
        let h = CapHeader {
            id,
            version,
            next: 0,
        };
        self.out
            .extend_from_slice(zerocopy::IntoBytes::as_bytes(&h));
        Ok(())
    }

    /// Appends a `SPARSE_MMAP` capability (version 1).
    pub fn sparse_mmap(&mut self, areas: &[SparseMmapArea]) -> Result<&mut Self, ProtoError> {
        self.begin(VFIO_REGION_INFO_CAP_SPARSE_MMAP, 1)?;
        let nr_areas =
            u32::try_from(areas.len()).map_err(|_| ProtoError::overflow("sparse mmap areas"))?;
        let h = SparseMmapHeader {
            nr_areas,
            reserved: 0,
        };
        self.out
            .extend_from_slice(zerocopy::IntoBytes::as_bytes(&h));
        self.out
            .extend_from_slice(zerocopy::IntoBytes::as_bytes(areas));
        Ok(self)
    }

    /// Appends a `TYPE` capability (version 1).
    pub fn region_type(&mut self, kind: u32, subtype: u32) -> Result<&mut Self, ProtoError> {
        self.begin(VFIO_REGION_INFO_CAP_TYPE, 1)?;
        let t = RegionTypeCap { kind, subtype };
        self.out
            .extend_from_slice(zerocopy::IntoBytes::as_bytes(&t));
        Ok(self)
    }

    /// Appends a `MSIX_MAPPABLE` capability (version 1, no body).
    pub fn msix_mappable(&mut self) -> Result<&mut Self, ProtoError> {
        self.begin(VFIO_REGION_INFO_CAP_MSIX_MAPPABLE, 1)?;
        Ok(self)
    }

    /// Fills in `argsz`, `flags` and `cap_offset` of `info` for this chain,
    /// honouring the client's `client_argsz`: if the caps do not fit, the
    /// reply carries no caps (`cap_offset = 0`) and `argsz` says how much is
    /// needed. Returns whether the caps fit (i.e. should be sent).
    pub fn finish_info(
        &self,
        info: &mut RegionInfo,
        client_argsz: u32,
    ) -> Result<bool, ProtoError> {
        if self.out.is_empty() {
            info.argsz = REGION_INFO_SIZE as u32;
            info.cap_offset = 0;
            info.flags &= !VFIO_REGION_INFO_FLAG_CAPS;
            return Ok(true);
        }
        let needed = u32::try_from(self.out.len().saturating_add(REGION_INFO_SIZE))
            .map_err(|_| ProtoError::overflow("region info argsz"))?;
        info.argsz = needed;
        if client_argsz >= needed {
            info.flags |= VFIO_REGION_INFO_FLAG_CAPS;
            info.cap_offset = REGION_INFO_SIZE as u32;
            Ok(true)
        } else {
            // Unlike the kernel, the CAPS flag must not be set without capabilities: QEMU's
            // vfio-user client rejects CAPS with a cap_offset below 32. The client learns
            // from argsz alone that it must ask again with a bigger buffer.
            info.flags &= !VFIO_REGION_INFO_FLAG_CAPS;
            info.cap_offset = 0;
            Ok(false)
        }
    }
}
