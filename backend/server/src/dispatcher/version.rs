//! VERSION: the negotiation that opens a session, and a session a replaced process had
//! negotiated, resumed.

use switchyard_device::DeviceError;
use switchyard_proto::{Version, encode_version_reply, negotiate_version};

use super::Dispatcher;
use crate::DeviceSlot;
use crate::error::{RequestError, invalid};

impl Dispatcher {
    /// VERSION: negotiated once, first.
    pub(super) fn version(
        &mut self,
        device_slot: &DeviceSlot,
        id: u16,
        v: Version<'_>,
    ) -> Result<(), RequestError> {
        if self.negotiated.is_some() {
            return Err(invalid("version already negotiated"));
        }
        self.negotiate(device_slot, id, v.major, v.minor, v.data)
    }

    /// Continues a session a replaced process negotiated: the same VERSION request is
    /// negotiated again (the same server limits give the same result), without a reply; the
    /// next request is handled as a replay.
    pub(crate) fn resume_session(
        &mut self,
        device_slot: &DeviceSlot,
        version: Option<&(u16, u16, Vec<u8>)>,
    ) -> Result<(), RequestError> {
        if let Some((major, minor, data)) = version {
            self.negotiate(device_slot, 0, *major, *minor, data)?;
            // The reply is not sent again: the client has it.
            self.out.clear();
        }
        self.replaying = true;
        Ok(())
    }

    fn negotiate(
        &mut self,
        device_slot: &DeviceSlot,
        id: u16,
        major: u16,
        minor: u16,
        data: &[u8],
    ) -> Result<(), RequestError> {
        let n = negotiate_version(major, minor, data, &self.server_limits)?;
        encode_version_reply(&mut self.out, id, &n.reply)?;
        tracing::info!(
            client_major = major,
            client_minor = minor,
            max_msg_fds = n.client.max_msg_fds,
            max_data_xfer_size = n.client.max_data_xfer_size,
            "version negotiated"
        );
        let cd = self
            .client_dma_source
            .connect(n.client.max_data_xfer_size as usize)
            .map_err(DeviceError::Io)?;
        device_slot.context().dma.set_remote(Some(cd.clone()));
        device_slot.context().waits.set(Some(cd.clone()));
        self.client_dma = Some(cd);
        self.negotiated = Some(n.client);
        if let Some(c) = &self.continuity {
            c.version(major, minor, data);
        }
        Ok(())
    }
}
