//! Allocation-free message building into a caller-owned buffer.

use zerocopy::{Immutable, IntoBytes};

use crate::consts::*;
use crate::error::ProtoError;
use crate::header::{Command, Header, msg_size_for};

/// Writes one message into a reused `Vec<u8>`: the header first (with a
/// placeholder size), then payload pieces, then [`MessageWriter::finish`]
/// patches `msg_size` (checking it fits in u32).
///
/// The vector is cleared on creation; its capacity is reused, so steady
/// state encoding does not allocate. A writer dropped without `finish`
/// leaves `msg_size` at 0 (an invalid message).
#[derive(Debug)]
pub struct MessageWriter<'b> {
    out: &'b mut Vec<u8>,
}

impl<'b> MessageWriter<'b> {
    /// Starts a command.
    pub fn command(out: &'b mut Vec<u8>, msg_id: u16, cmd: Command, no_reply: bool) -> Self {
        let hdr = Header {
            msg_id,
            cmd: cmd.as_u16(),
            msg_size: 0,
            flags: VFIO_USER_F_TYPE_COMMAND | if no_reply { VFIO_USER_F_NO_REPLY } else { 0 },
            error_no: 0,
        };
        Self::start(out, hdr)
    }

    /// Starts a successful reply echoing `msg_id` and `cmd`.
    pub fn reply(out: &'b mut Vec<u8>, msg_id: u16, cmd: u16) -> Self {
        let hdr = Header {
            msg_id,
            cmd,
            msg_size: 0,
            flags: VFIO_USER_F_TYPE_REPLY,
            error_no: 0,
        };
        Self::start(out, hdr)
    }

    fn start(out: &'b mut Vec<u8>, hdr: Header) -> Self {
        out.clear();
        out.extend_from_slice(hdr.as_bytes());
        MessageWriter { out }
    }

    /// Appends a wire struct.
    pub fn put<T: IntoBytes + Immutable + ?Sized>(&mut self, v: &T) {
        self.out.extend_from_slice(v.as_bytes());
    }

    /// Appends raw bytes.
    pub fn put_bytes(&mut self, data: &[u8]) {
        self.out.extend_from_slice(data);
    }

    /// Appends `n` zero bytes and returns them for filling in place.
    pub fn put_zeroed(&mut self, n: usize) -> &mut [u8] {
        let start = self.out.len();
        self.out.resize(start.saturating_add(n), 0);
        self.out.get_mut(start..).unwrap_or_default()
    }

    /// Bytes of payload written so far.
    pub fn body_len(&self) -> usize {
        self.out.len().saturating_sub(HEADER_SIZE)
    }

    /// Direct access to the underlying buffer (header included).
    pub fn buf(&mut self) -> &mut Vec<u8> {
        self.out
    }

    /// Patches `msg_size`; returns the total message length.
    pub fn finish(self) -> Result<usize, ProtoError> {
        let size = msg_size_for(self.body_len())?;
        if let Some(slot) = self.out.get_mut(4..8) {
            slot.copy_from_slice(&size.to_ne_bytes());
        }
        Ok(self.out.len())
    }
}

/// Writes an error reply (header only, `Error` flag, `error_no = |errno|`)
/// into `out` (cleared first).
pub fn encode_error_reply(out: &mut Vec<u8>, msg_id: u16, cmd: u16, errno: i32) {
    out.clear();
    out.extend_from_slice(Header::error_reply(msg_id, cmd, errno).as_bytes());
}
