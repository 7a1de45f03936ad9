//! Sans-IO vfio-user protocol codec.
//!
//! * [`Header`] / [`Command`]: the 16-byte header and command numbers.
//! * [`decode_request_with`] / [`Request`]: every command in both directions,
//!   validated (sizes, argsz, flags, fd counts, limits, overflow).
//! * [`decode_reply`] / [`Reply`]: every reply; error replies become
//!   [`ProtoError::ErrorReply`].
//! * Encoding into a caller-owned `Vec<u8>` ([`Request::encode`],
//!   [`Reply::encode`], [`MessageWriter`], [`encode_error_reply`] and the
//!   hot-path helpers such as [`region_read_reply_buffer`]).
//! * [`Capabilities`], [`negotiate`], [`negotiate_version`]: VERSION JSON.
//!
//! No I/O, no threads, no `unsafe`. Where the codec sits in Switchyard: `ARCHITECTURE.md`.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

mod caps;
mod check;
mod command;
pub mod consts;
pub mod errno;
mod error;
pub mod fuzzing;
mod header;
mod payload;
mod reply;
mod request;
mod wire;
mod writer;

pub use caps::{
    Capabilities, MigrationCap, Negotiated, ServerLimits, TwinSocketCap, negotiate,
    negotiate_version, version_json_text,
};
pub use command::{Command, Direction};
pub use error::ProtoError;
pub use header::Header;
pub use payload::{
    DeviceFeatureReply, DeviceFeatureRequest, DirtyBitmap, DmaLoggingControl, FeatureFlags,
    FeatureReply, FeatureRequest, IoFdEntries, IrqAction, IrqData, MigState, RegionCap,
    RegionCapIter, RegionCapsBuilder, SetIrqs, Version, dirty_bitmap_size, region_caps,
};
pub use reply::{
    Reply, decode_reply, decode_reply_body, decode_reply_within, dma_logging_report_reply_buffer,
    dma_read_reply_buffer, dma_unmap_bitmap_reply_buffer, encode_region_write_reply,
    encode_version_reply, encode_version_request, mig_data_read_reply_buffer,
    region_read_reply_buffer, truncate_mig_data_read_reply,
};
pub use request::{
    Limits, Request, decode_request, decode_request_with, region_write_request_buffer,
};
pub use wire::{
    BitmapHeader, CapHeader, DeviceFeatureHeader, DeviceInfo, DmaAccess, DmaLoggingControlHeader,
    DmaLoggingRange, DmaLoggingReport, DmaMap, DmaUnmap, IoFdEntry, IoFdShadowEntry, IrqInfo,
    IrqSet, MigData, MigDeviceState, MigrationFeature, PrecopyInfo, Records, RegionAccess,
    RegionInfo, RegionIoFds, RegionTypeCap, SparseMmapArea, SparseMmapHeader, VersionHeader,
    WriteMultiEntry,
};
pub use writer::{MessageWriter, encode_error_reply};
