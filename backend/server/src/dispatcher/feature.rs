//! DEVICE_FEATURE, and the migration it carries: the probes, MIGRATION and MIG_DEVICE_STATE
//! (the state machine itself is `crate::migration`), and the migration stream (MIG_DATA_READ,
//! MIG_DATA_WRITE). The DMA logging features are `dirty`'s.
//!
//! For a device that cannot migrate, the migration features answer `ENOTTY` ("not
//! supported", as the kernel does).
//!
//! The sizes, as the kernel serves them: GET_PRECOPY_INFO (the vfio-user form of
//! `VFIO_MIG_GET_PRECOPY_INFO`) in PRE_COPY only (`EINVAL` elsewhere), and MIG_DATA_SIZE in
//! any state; both `ENOTSUP`/`ENOTTY` for a device that does not know them, so the VMM
//! estimates. The origin header not sent yet counts as the device's initial bytes.

use switchyard_device::DmaSpace;
use switchyard_proto::consts::*;
use switchyard_proto::{
    DeviceFeatureHeader, FeatureFlags, FeatureReply, FeatureRequest, MigDeviceState, MigState,
    MigrationFeature, PrecopyInfo, Reply, mig_data_read_reply_buffer, truncate_mig_data_read_reply,
};

use super::{Dispatcher, feature_reply, reply_empty};
use crate::Slot;
use crate::error::{RequestError, invalid};
use crate::migration;

/// A refusal with its own errno.
fn invalid_errno(what: &'static str, errno: i32) -> RequestError {
    RequestError::Invalid { what, errno }
}

/// A feature the device does not have.
fn not_supported() -> RequestError {
    RequestError::Invalid {
        what: "device feature not supported",
        errno: libc::ENOTTY,
    }
}

impl Dispatcher {
    /// DEVICE_FEATURE: one handler per feature and operation.
    pub(super) fn device_feature(
        &mut self,
        slot: &mut Slot,
        dma: &DmaSpace,
        id: u16,
        argsz: u32,
        op: FeatureRequest<'_>,
    ) -> Result<(), RequestError> {
        match op {
            FeatureRequest::Probe { feature, get, set } => {
                self.feature_probe(slot, id, feature, get, set)
            }
            FeatureRequest::DmaLoggingStart(_)
            | FeatureRequest::DmaLoggingStop
            | FeatureRequest::DmaLoggingReport(_)
                if self.dirty_log == crate::DirtyLog::Off =>
            {
                Err(not_supported())
            }
            FeatureRequest::DmaLoggingStart(c) => self.dma_logging_start(dma, id, c),
            FeatureRequest::DmaLoggingStop => self.dma_logging_stop(dma, id),
            FeatureRequest::DmaLoggingReport(r) => self.dma_logging_report(dma, id, &r),
            FeatureRequest::GetMigration => self.get_migration(slot, id),
            FeatureRequest::GetMigDeviceState => self.get_mig_device_state(slot, id),
            FeatureRequest::SetMigDeviceState(st) => self.set_mig_device_state(slot, id, st),
            FeatureRequest::Other { flags, data }
                if flags & VFIO_DEVICE_FEATURE_MASK
                    == u32::from(VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS)
                    && flags & VFIO_DEVICE_FEATURE_SET != 0 =>
            {
                self.set_mig_mapped_regions(slot, id, data)
            }
            FeatureRequest::Other { flags, .. } => {
                let f = FeatureFlags(flags);
                if f.feature() == VFIO_DEVICE_FEATURE_MIG_DATA_SIZE && f.get() && !f.set() {
                    self.get_mig_data_size(slot, id, argsz, flags)
                } else {
                    Err(not_supported())
                }
            }
        }
    }

    /// DEVICE_FEATURE GET MIG_DATA_SIZE: `stop_copy_length`, what STOP_COPY would send now.
    fn get_mig_data_size(
        &mut self,
        slot: &mut Slot,
        id: u16,
        argsz: u32,
        flags: u32,
    ) -> Result<(), RequestError> {
        if (argsz as usize) < DeviceFeatureHeader::SIZE + 8 {
            return Err(invalid("MIG_DATA_SIZE argsz too small"));
        }
        let header = slot.origin.unsent_header() as u64;
        let size = slot
            .device
            .migration()
            .and_then(|m| m.stop_copy_size())
            .ok_or_else(not_supported)?;
        tracing::debug!(size, state = ?slot.mig, "MIG_DATA_SIZE");
        let length = size.saturating_add(header).to_le_bytes();
        feature_reply(
            &mut self.out,
            id,
            FeatureReply::Other {
                flags,
                data: &length,
            },
        )
    }

    /// GET_PRECOPY_INFO: what the PRE_COPY stream still holds (`EINVAL` outside PRE_COPY, as
    /// the kernel's ioctl; `ENOTSUP` for a device that does not know).
    pub(super) fn get_precopy_info(
        &mut self,
        slot: &mut Slot,
        id: u16,
    ) -> Result<(), RequestError> {
        let mig = slot
            .device
            .migration()
            .ok_or_else(|| invalid_errno("the device does not migrate", libc::ENOTSUP))?;
        if !matches!(slot.mig, MigState::PreCopy | MigState::PreCopyP2p) {
            return Err(invalid("GET_PRECOPY_INFO outside PRE_COPY"));
        }
        let info = mig.precopy_info().ok_or_else(|| {
            invalid_errno(
                "the device does not report its pre-copy sizes",
                libc::ENOTSUP,
            )
        })?;
        let header = slot.origin.unsent_header() as u64;
        tracing::debug!(
            initial = info.initial_bytes,
            dirty = info.dirty_bytes,
            "GET_PRECOPY_INFO"
        );
        reply_empty(
            &mut self.out,
            id,
            Reply::GetPrecopyInfo(PrecopyInfo {
                argsz: PrecopyInfo::SIZE as u32,
                flags: 0,
                initial_bytes: info.initial_bytes.saturating_add(header),
                dirty_bytes: info.dirty_bytes,
            }),
        )
    }

    /// DEVICE_FEATURE PROBE: which operations a feature supports.
    fn feature_probe(
        &mut self,
        slot: &mut Slot,
        id: u16,
        feature: u16,
        get: bool,
        set: bool,
    ) -> Result<(), RequestError> {
        let migrates = slot.device.migration().is_some();
        let logs = self.dirty_log != crate::DirtyLog::Off;
        let (can_get, can_set) = match feature {
            VFIO_DEVICE_FEATURE_DMA_LOGGING_START | VFIO_DEVICE_FEATURE_DMA_LOGGING_STOP
                if logs =>
            {
                (false, true)
            }
            VFIO_DEVICE_FEATURE_DMA_LOGGING_REPORT if logs => (true, false),
            VFIO_DEVICE_FEATURE_MIGRATION if migrates => (true, false),
            VFIO_DEVICE_FEATURE_MIG_DEVICE_STATE if migrates => (true, true),
            VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS if self.mapped_regions(slot) != 0 => {
                (false, true)
            }
            VFIO_DEVICE_FEATURE_MIG_DATA_SIZE
                if slot
                    .device
                    .migration()
                    .is_some_and(|m| m.stop_copy_size().is_some()) =>
            {
                (true, false)
            }
            _ => return Err(not_supported()),
        };
        if (get && !can_get) || (set && !can_set) {
            return Err(invalid("device feature does not support that operation"));
        }
        feature_reply(&mut self.out, id, FeatureReply::Probe { feature, get, set })
    }

    /// The regions whose mapped memory the client may migrate itself (0: none, or the
    /// server refuses it).
    fn mapped_regions(&self, slot: &mut Slot) -> u64 {
        if self.mapped_migration == crate::MappedMigration::Off {
            return 0;
        }
        slot.device
            .migration()
            .map_or(0, |m| m.client_migratable_regions())
    }

    /// DEVICE_FEATURE SET MIG_MAPPED_REGIONS (a vfio-user extension, see
    /// [`VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS`]): the client migrates the mapped
    /// memory of the regions in its 64-bit mask itself. Accepted when every region named is
    /// one the device allows (and the mask names one); else `ENOTTY`, and the device's
    /// stream goes on carrying all of its memory.
    fn set_mig_mapped_regions(
        &mut self,
        slot: &mut Slot,
        id: u16,
        data: &[u8],
    ) -> Result<(), RequestError> {
        let mask = data
            .get(..8)
            .and_then(|b| <[u8; 8]>::try_from(b).ok())
            .map(u64::from_le_bytes)
            .ok_or_else(|| invalid("MIG_MAPPED_REGIONS needs a 64-bit region mask"))?;
        let allowed = self.mapped_regions(slot);
        if mask == 0 || mask & !allowed != 0 {
            tracing::debug!(
                mask = format_args!("{mask:#x}"),
                allowed = format_args!("{allowed:#x}"),
                "client's offer to migrate mapped memory refused"
            );
            return Err(not_supported());
        }
        if let Some(m) = slot.device.migration() {
            m.set_client_migrates_mapped(true);
        }
        tracing::info!(
            mask = format_args!("{mask:#x}"),
            "the client migrates the mapped memory of these regions itself"
        );
        feature_reply(
            &mut self.out,
            id,
            FeatureReply::Other {
                flags: VFIO_DEVICE_FEATURE_SET
                    | u32::from(VFIO_USER_DEVICE_FEATURE_MIG_MAPPED_REGIONS),
                data: &[],
            },
        )
    }

    /// DEVICE_FEATURE GET MIGRATION: the flows the device supports.
    fn get_migration(&mut self, slot: &mut Slot, id: u16) -> Result<(), RequestError> {
        let caps = slot
            .device
            .migration()
            .map(|m| m.caps())
            .ok_or_else(not_supported)?;
        let mut flags = VFIO_MIGRATION_STOP_COPY;
        if caps.precopy {
            flags |= VFIO_MIGRATION_PRE_COPY;
        }
        if caps.p2p {
            flags |= VFIO_MIGRATION_P2P;
        }
        feature_reply(
            &mut self.out,
            id,
            FeatureReply::GetMigration(MigrationFeature { flags }),
        )
    }

    /// DEVICE_FEATURE GET MIG_DEVICE_STATE.
    fn get_mig_device_state(&mut self, slot: &mut Slot, id: u16) -> Result<(), RequestError> {
        slot.device.migration().ok_or_else(not_supported)?;
        feature_reply(
            &mut self.out,
            id,
            FeatureReply::GetMigDeviceState(MigDeviceState {
                device_state: slot.mig as u32,
                data_fd: u32::MAX,
            }),
        )
    }

    /// DEVICE_FEATURE SET MIG_DEVICE_STATE: the device walks to the requested state.
    fn set_mig_device_state(
        &mut self,
        slot: &mut Slot,
        id: u16,
        st: MigDeviceState,
    ) -> Result<(), RequestError> {
        slot.device.migration().ok_or_else(not_supported)?;
        let target = MigState::try_from(st.device_state)?;
        if slot.moving
            && !matches!(
                target,
                MigState::Running | MigState::RunningP2p | MigState::Stop
            )
        {
            // A move reads the same device state and write log.
            return Err(RequestError::Invalid {
                what: "the device is being moved to another backing",
                errno: libc::EBUSY,
            });
        }
        if self.mapped_migration == crate::MappedMigration::Assume
            && matches!(slot.mig, MigState::Running | MigState::Stop)
            && let Some(m) = slot.device.migration()
        {
            // Fault injection: the device relies on a copy the client may not make.
            m.set_client_migrates_mapped(true);
        }
        let before = slot.mig;
        slot.mig_touched = std::time::Instant::now();
        let moved =
            migration::transition(&mut *slot.device, &mut slot.mig, target, &mut slot.origin);
        slot.mig_changed(before, crate::MigCause::Request);
        moved?;
        feature_reply(
            &mut self.out,
            id,
            FeatureReply::SetMigDeviceState(MigDeviceState {
                device_state: slot.mig as u32,
                data_fd: u32::MAX,
            }),
        )
    }

    /// MIG_DATA_READ: the next bytes of the outgoing stream, read by the device straight
    /// into the reply.
    pub(super) fn mig_data_read(
        &mut self,
        slot: &mut Slot,
        id: u16,
        size: u32,
    ) -> Result<(), RequestError> {
        if !matches!(
            slot.mig,
            MigState::PreCopy | MigState::PreCopyP2p | MigState::StopCopy
        ) {
            return Err(invalid("MIG_DATA_READ outside PRE_COPY and STOP_COPY"));
        }
        if size > self.server_limits.max_data_xfer_size {
            return Err(invalid("MIG_DATA_READ larger than max_data_xfer_size"));
        }
        self.use_bulk_buffer();
        slot.mig_touched = std::time::Instant::now();
        let buf = mig_data_read_reply_buffer(&mut self.out, id, size)?;
        let mig = slot
            .device
            .migration()
            .ok_or_else(|| invalid("the device does not migrate"))?;
        let n = slot.origin.read(mig, buf)?;
        let n = u32::try_from(n)
            .ok()
            .filter(|&n| n <= size)
            .ok_or_else(|| invalid("device produced more migration data than asked"))?;
        truncate_mig_data_read_reply(&mut self.out, n)?;
        // A reply shorter than asked for ends the STOP_COPY stream (the protocol's end of
        // stream; QEMU reads no further).
        if n < size && slot.mig == MigState::StopCopy {
            slot.origin.stream_read_out();
        }
        tracing::trace!(size, n, "MIG_DATA_READ");
        Ok(())
    }

    /// MIG_DATA_WRITE: the next bytes of the incoming stream. A stream whose origin header
    /// is not the expected one (`crate::origin`) puts the device in ERROR (`EPERM`).
    pub(super) fn mig_data_write(
        &mut self,
        slot: &mut Slot,
        id: u16,
        data: &[u8],
    ) -> Result<(), RequestError> {
        if slot.mig != MigState::Resuming {
            return Err(invalid("MIG_DATA_WRITE outside RESUMING"));
        }
        slot.mig_touched = std::time::Instant::now();
        let mig = slot
            .device
            .migration()
            .ok_or_else(|| invalid("the device does not migrate"))?;
        if let Err(e) = slot.origin.write(mig, data) {
            if matches!(e, crate::origin::WriteError::Origin(_)) {
                tracing::warn!(error = %e, "incoming migration stream refused; device in ERROR");
                slot.origin.abort();
                slot.mig = MigState::Error;
                slot.mig_changed(MigState::Resuming, crate::MigCause::WrongOrigin);
            }
            return Err(e.into());
        }
        tracing::trace!(n = data.len(), "MIG_DATA_WRITE");
        reply_empty(&mut self.out, id, Reply::MigDataWrite(None))
    }
}
