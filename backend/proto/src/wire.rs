//! Fixed-layout wire structures (host endian, `repr(C)`, no padding).
//!
//! All derive zerocopy's traits; nothing here uses `unsafe`. Peer bytes are
//! read by copying (`read_from_prefix`), so buffer alignment never matters.

use core::fmt;
use core::marker::PhantomData;

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::error::ProtoError;

/// VERSION payload prefix: `major`, `minor`, followed by optional JSON.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct VersionHeader {
    /// Major version (0).
    pub major: u16,
    /// Minor version.
    pub minor: u16,
}

impl VersionHeader {
    /// Size on the wire.
    pub const SIZE: usize = 4;
}
const _: () = assert!(core::mem::size_of::<VersionHeader>() == VersionHeader::SIZE);

/// `DMA_MAP` request (32 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DmaMap {
    /// 32 (no reply payload).
    pub argsz: u32,
    /// `VFIO_USER_F_DMA_REGION_*`.
    pub flags: u32,
    /// Offset into the passed fd.
    pub offset: u64,
    /// IOVA base.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
}

impl DmaMap {
    /// Size on the wire.
    pub const SIZE: usize = 32;
}
const _: () = assert!(core::mem::size_of::<DmaMap>() == DmaMap::SIZE);

/// `DMA_UNMAP` request and reply entry (24 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DmaUnmap {
    /// Maximum reply payload size.
    pub argsz: u32,
    /// `VFIO_DMA_UNMAP_FLAG_*`.
    pub flags: u32,
    /// IOVA base.
    pub address: u64,
    /// Size in bytes.
    pub size: u64,
}

impl DmaUnmap {
    /// Size on the wire.
    pub const SIZE: usize = 24;
}
const _: () = assert!(core::mem::size_of::<DmaUnmap>() == DmaUnmap::SIZE);

/// `struct vfio_bitmap` header following a dirty-bitmap unmap (16 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct BitmapHeader {
    /// Page size one bit stands for.
    pub pgsize: u64,
    /// Bitmap size in bytes.
    pub size: u64,
}

impl BitmapHeader {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<BitmapHeader>() == BitmapHeader::SIZE);

/// `struct vfio_device_info` (16 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DeviceInfo {
    /// Argument size.
    pub argsz: u32,
    /// `VFIO_DEVICE_FLAGS_*`.
    pub flags: u32,
    /// Number of regions.
    pub num_regions: u32,
    /// Number of IRQ indexes.
    pub num_irqs: u32,
}

impl DeviceInfo {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<DeviceInfo>() == DeviceInfo::SIZE);

/// `struct vfio_region_info` (32 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct RegionInfo {
    /// Argument size (reply: size needed for info plus capabilities).
    pub argsz: u32,
    /// `VFIO_REGION_INFO_FLAG_*`.
    pub flags: u32,
    /// Region index.
    pub index: u32,
    /// Offset of the first capability from the start of this struct (0 = none).
    pub cap_offset: u32,
    /// Region size.
    pub size: u64,
    /// mmap offset into the region fd.
    pub offset: u64,
}

impl RegionInfo {
    /// Size on the wire.
    pub const SIZE: usize = 32;
}
const _: () = assert!(core::mem::size_of::<RegionInfo>() == RegionInfo::SIZE);

/// `struct vfio_info_cap_header` (8 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct CapHeader {
    /// Capability id.
    pub id: u16,
    /// Capability version.
    pub version: u16,
    /// Offset of the next capability from the start of the region info (0 = end).
    pub next: u32,
}

impl CapHeader {
    /// Size on the wire.
    pub const SIZE: usize = 8;
}
const _: () = assert!(core::mem::size_of::<CapHeader>() == CapHeader::SIZE);

/// Sparse mmap capability body prefix (after the cap header).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct SparseMmapHeader {
    /// Number of areas.
    pub nr_areas: u32,
    /// Reserved.
    pub reserved: u32,
}

impl SparseMmapHeader {
    /// Size on the wire.
    pub const SIZE: usize = 8;
}
const _: () = assert!(core::mem::size_of::<SparseMmapHeader>() == SparseMmapHeader::SIZE);

/// One sparse mmap area (16 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct SparseMmapArea {
    /// Offset within the region.
    pub offset: u64,
    /// Size of the area.
    pub size: u64,
}

impl SparseMmapArea {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<SparseMmapArea>() == SparseMmapArea::SIZE);

/// `VFIO_REGION_INFO_CAP_TYPE` body.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct RegionTypeCap {
    /// Region type.
    pub kind: u32,
    /// Region subtype.
    pub subtype: u32,
}

impl RegionTypeCap {
    /// Size on the wire.
    pub const SIZE: usize = 8;
}
const _: () = assert!(core::mem::size_of::<RegionTypeCap>() == RegionTypeCap::SIZE);

/// `GET_REGION_IO_FDS` request/reply fixed part (16 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct RegionIoFds {
    /// Argument size.
    pub argsz: u32,
    /// Must be 0.
    pub flags: u32,
    /// Region index.
    pub index: u32,
    /// Request: 0. Reply: number of sub-regions.
    pub count: u32,
}

impl RegionIoFds {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<RegionIoFds>() == RegionIoFds::SIZE);

/// Spec ioeventfd / ioregionfd sub-region entry (40 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct IoFdEntry {
    /// Offset in the region.
    pub offset: u64,
    /// Size (0 allowed).
    pub size: u64,
    /// Index into the SCM_RIGHTS fd array.
    pub fd_index: u32,
    /// `VFIO_USER_IO_FD_TYPE_*`.
    pub kind: u32,
    /// `KVM_IOEVENTFD_FLAG_*` / `KVM_IOREGION_*`.
    pub flags: u32,
    /// Padding.
    pub padding: u32,
    /// Datamatch (ioeventfd) or user data (ioregionfd).
    pub datamatch: u64,
}

impl IoFdEntry {
    /// Size on the wire.
    pub const SIZE: usize = 40;
}
const _: () = assert!(core::mem::size_of::<IoFdEntry>() == IoFdEntry::SIZE);

/// libvfio-user's `vfio_user_sub_region_ioeventfd_t` (48 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct IoFdShadowEntry {
    /// Offset in the region.
    pub gpa_offset: u64,
    /// Size.
    pub size: u64,
    /// Index into the SCM_RIGHTS fd array.
    pub fd_index: u32,
    /// `VFIO_USER_IO_FD_TYPE_*`.
    pub kind: u32,
    /// `KVM_IOEVENTFD_FLAG_*`.
    pub flags: u32,
    /// Index of the shadow memory fd.
    pub shadow_mem_fd_index: u32,
    /// Offset into the shadow memory fd.
    pub shadow_offset: u64,
    /// Datamatch.
    pub datamatch: u64,
}

impl IoFdShadowEntry {
    /// Size on the wire.
    pub const SIZE: usize = 48;
}
const _: () = assert!(core::mem::size_of::<IoFdShadowEntry>() == IoFdShadowEntry::SIZE);

/// `struct vfio_irq_info` (16 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct IrqInfo {
    /// Argument size.
    pub argsz: u32,
    /// `VFIO_IRQ_INFO_*`.
    pub flags: u32,
    /// IRQ index.
    pub index: u32,
    /// Number of vectors.
    pub count: u32,
}

impl IrqInfo {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<IrqInfo>() == IrqInfo::SIZE);

/// `struct vfio_irq_set` fixed part (20 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct IrqSet {
    /// Argument size (includes data).
    pub argsz: u32,
    /// Data type and action flags.
    pub flags: u32,
    /// IRQ index.
    pub index: u32,
    /// First vector.
    pub start: u32,
    /// Number of vectors.
    pub count: u32,
}

impl IrqSet {
    /// Size on the wire.
    pub const SIZE: usize = 20;
}
const _: () = assert!(core::mem::size_of::<IrqSet>() == IrqSet::SIZE);

/// REGION_READ/WRITE fixed part (16 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct RegionAccess {
    /// Offset in the region.
    pub offset: u64,
    /// Region index.
    pub region: u32,
    /// Byte count.
    pub count: u32,
}

impl RegionAccess {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<RegionAccess>() == RegionAccess::SIZE);

/// DMA_READ/WRITE fixed part (16 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DmaAccess {
    /// IOVA.
    pub address: u64,
    /// Byte count.
    pub count: u64,
}

impl DmaAccess {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<DmaAccess>() == DmaAccess::SIZE);

/// One REGION_WRITE_MULTI entry (24 bytes).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct WriteMultiEntry {
    /// Offset in the region.
    pub offset: u64,
    /// Region index.
    pub region: u32,
    /// Byte count (1..=8).
    pub count: u32,
    /// Data (first `count` bytes used).
    pub data: [u8; 8],
}

impl WriteMultiEntry {
    /// Size on the wire.
    pub const SIZE: usize = 24;
}
const _: () = assert!(core::mem::size_of::<WriteMultiEntry>() == WriteMultiEntry::SIZE);

impl WriteMultiEntry {
    /// The bytes this entry writes (`data[..count]`, clamped to 8).
    pub fn bytes(&self) -> &[u8] {
        let n = usize::try_from(self.count).unwrap_or(8).min(8);
        self.data.get(..n).unwrap_or(&self.data)
    }
}

/// DEVICE_FEATURE fixed part (`argsz`, `flags`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DeviceFeatureHeader {
    /// Maximum reply payload size.
    pub argsz: u32,
    /// Feature index and GET/SET/PROBE bits.
    pub flags: u32,
}

impl DeviceFeatureHeader {
    /// Size on the wire.
    pub const SIZE: usize = 8;
}
const _: () = assert!(core::mem::size_of::<DeviceFeatureHeader>() == DeviceFeatureHeader::SIZE);

/// `VFIO_DEVICE_FEATURE_MIGRATION` data.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct MigrationFeature {
    /// `VFIO_MIGRATION_*`.
    pub flags: u64,
}

impl MigrationFeature {
    /// Size on the wire.
    pub const SIZE: usize = 8;
}
const _: () = assert!(core::mem::size_of::<MigrationFeature>() == MigrationFeature::SIZE);

/// `VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE` data.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct MigDeviceState {
    /// `VFIO_DEVICE_STATE_*`.
    pub device_state: u32,
    /// Unused in vfio-user.
    pub data_fd: u32,
}

impl MigDeviceState {
    /// Size on the wire.
    pub const SIZE: usize = 8;
}
const _: () = assert!(core::mem::size_of::<MigDeviceState>() == MigDeviceState::SIZE);

/// DMA logging control fixed part.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DmaLoggingControlHeader {
    /// Page size hint.
    pub page_size: u64,
    /// Number of ranges that follow (0 = everything).
    pub num_ranges: u32,
    /// Reserved.
    pub reserved: u32,
}

impl DmaLoggingControlHeader {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () =
    assert!(core::mem::size_of::<DmaLoggingControlHeader>() == DmaLoggingControlHeader::SIZE);

/// One DMA logging range.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DmaLoggingRange {
    /// IOVA base.
    pub iova: u64,
    /// Length.
    pub length: u64,
}

impl DmaLoggingRange {
    /// Size on the wire.
    pub const SIZE: usize = 16;
}
const _: () = assert!(core::mem::size_of::<DmaLoggingRange>() == DmaLoggingRange::SIZE);

/// DMA logging report fixed part (the bitmap follows in the reply).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct DmaLoggingReport {
    /// IOVA base.
    pub iova: u64,
    /// Length.
    pub length: u64,
    /// Page size one bit stands for.
    pub page_size: u64,
}

impl DmaLoggingReport {
    /// Size on the wire.
    pub const SIZE: usize = 24;
}
const _: () = assert!(core::mem::size_of::<DmaLoggingReport>() == DmaLoggingReport::SIZE);

/// MIG_DATA_READ/WRITE fixed part.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct MigData {
    /// Argument size.
    pub argsz: u32,
    /// Byte count.
    pub size: u32,
}

impl MigData {
    /// Size on the wire.
    pub const SIZE: usize = 8;
}
const _: () = assert!(core::mem::size_of::<MigData>() == MigData::SIZE);

/// GET_PRECOPY_INFO request and reply (`struct vfio_precopy_info`, as the patched QEMU's
/// `VFIOUserGetPrecopyInfo` carries it after the header). The request's byte counts are
/// ignored; the reply's say what the PRE_COPY stream still holds.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct PrecopyInfo {
    /// Argument size (≥ 24).
    pub argsz: u32,
    /// Flags (none defined over vfio-user; 0).
    pub flags: u32,
    /// Bytes of the initial pass still to read.
    pub initial_bytes: u64,
    /// Bytes known dirty, still to read.
    pub dirty_bytes: u64,
}

impl PrecopyInfo {
    /// Size on the wire.
    pub const SIZE: usize = 24;
}
const _: () = assert!(core::mem::size_of::<PrecopyInfo>() == PrecopyInfo::SIZE);

/// Reads a `T` from the start of `bytes`, returning it and the rest.
pub(crate) fn read_prefix<'a, T: FromBytes>(
    bytes: &'a [u8],
    what: &'static str,
) -> Result<(T, &'a [u8]), ProtoError> {
    T::read_from_prefix(bytes)
        .map_err(|_| ProtoError::truncated(what, core::mem::size_of::<T>(), bytes.len()))
}

/// Reads exactly a `T` from `bytes` (length must match).
pub(crate) fn read_exact<T: FromBytes>(bytes: &[u8], what: &'static str) -> Result<T, ProtoError> {
    T::read_from_bytes(bytes).map_err(|_| ProtoError::BadSize {
        what,
        expected: core::mem::size_of::<T>(),
        got: bytes.len(),
    })
}

/// A borrowed array of fixed-size wire records.
///
/// Backed by raw bytes (peer bytes need not be aligned), iterated by copy.
/// Build one from typed values with [`Records::from_slice`].
pub struct Records<'a, T> {
    bytes: &'a [u8],
    _t: PhantomData<fn() -> T>,
}

impl<T> Clone for Records<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Records<'_, T> {}
impl<T> PartialEq for Records<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}
impl<T> Eq for Records<'_, T> {}

impl<T: FromBytes + fmt::Debug> fmt::Debug for Records<'_, T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter()).finish()
    }
}

impl<T> Default for Records<'_, T> {
    fn default() -> Self {
        Records {
            bytes: &[],
            _t: PhantomData,
        }
    }
}

impl<'a, T: FromBytes> Records<'a, T> {
    /// Wraps typed values (no copy).
    pub fn from_slice(items: &'a [T]) -> Self
    where
        T: IntoBytes + Immutable,
    {
        Records {
            bytes: items.as_bytes(),
            _t: PhantomData,
        }
    }

    /// Wraps raw bytes; the length must be a multiple of the record size.
    pub fn from_bytes(bytes: &'a [u8], what: &'static str) -> Result<Self, ProtoError> {
        let size = core::mem::size_of::<T>();
        if size == 0 || !bytes.len().is_multiple_of(size) {
            return Err(ProtoError::invalid(
                what,
                "length is not a whole number of entries",
            ));
        }
        Ok(Records {
            bytes,
            _t: PhantomData,
        })
    }

    /// Number of records.
    pub fn len(&self) -> usize {
        self.bytes
            .len()
            .checked_div(core::mem::size_of::<T>())
            .unwrap_or(0)
    }

    /// Whether there are no records.
    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &'a [u8] {
        self.bytes
    }

    /// Record `i`, if present.
    pub fn get(&self, i: usize) -> Option<T> {
        let size = core::mem::size_of::<T>();
        let start = i.checked_mul(size)?;
        let end = start.checked_add(size)?;
        T::read_from_bytes(self.bytes.get(start..end)?).ok()
    }

    /// Iterates over the records by value.
    pub fn iter(&self) -> impl Iterator<Item = T> + 'a {
        self.bytes
            .chunks_exact(core::mem::size_of::<T>().max(1))
            .filter_map(|c| T::read_from_bytes(c).ok())
    }
}
