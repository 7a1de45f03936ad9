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
        Self::start(out, Header::unsized_command(msg_id, cmd, no_reply))
    }

    /// Starts a successful reply echoing `msg_id` and `cmd`.
    pub fn reply(out: &'b mut Vec<u8>, msg_id: u16, cmd: u16) -> Self {
        Self::start(out, Header::unsized_reply(msg_id, cmd))
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
        patch_u32(self.out, MSG_SIZE_OFFSET, size);
        Ok(self.out.len())
    }
}

/// Writes an error reply (header only, `Error` flag, `error_no = |errno|`)
/// into `out` (cleared first).
pub fn encode_error_reply(out: &mut Vec<u8>, msg_id: u16, cmd: u16, errno: i32) {
    out.clear();
    out.extend_from_slice(Header::error_reply(msg_id, cmd, errno).as_bytes());
}

/// Offset of `msg_size` in the header.
pub(crate) const MSG_SIZE_OFFSET: usize = core::mem::offset_of!(Header, msg_size);

/// Overwrites the host-endian u32 at `at` in an already written message
/// (no-op if `out` is too short, which the callers rule out).
pub(crate) fn patch_u32(out: &mut [u8], at: usize, v: u32) {
    if let Some(slot) = out.get_mut(at..at.saturating_add(4)) {
        slot.copy_from_slice(v.as_bytes());
    }
}

/// Hot-path builder: writes `hdr` (with its final `msg_size`) and the
/// `fixed` parts into `out` (cleared first), then `count` zero bytes, and
/// returns those for the caller to fill in place.
pub(crate) fn fixed_then_data<'b>(
    out: &'b mut Vec<u8>,
    hdr: Header,
    fixed: &[&[u8]],
    count: usize,
) -> &'b mut [u8] {
    out.clear();
    fixed_then_overwritten(out, hdr, fixed, count)
}

/// Like [`fixed_then_data`], but the `count` data bytes are **not** zeroed where `out` already
/// had bytes: they hold whatever `out` held at those offsets (an earlier message built in the
/// same buffer), and the caller must overwrite every one of them. Only growth past `out`'s
/// current length is zero-filled. For large replies rebuilt again and again in a buffer kept
/// for them (dirty bitmaps), where zeroing would be a whole extra pass over the data.
pub(crate) fn fixed_then_overwritten<'b>(
    out: &'b mut Vec<u8>,
    hdr: Header,
    fixed: &[&[u8]],
    count: usize,
) -> &'b mut [u8] {
    let start = fixed
        .iter()
        .fold(HEADER_SIZE, |n, p| n.saturating_add(p.len()));
    let need = start.saturating_add(count);
    if out.len() < need {
        out.resize(need, 0);
    } else {
        out.truncate(need);
    }
    let mut at = 0usize;
    for part in core::iter::once(hdr.as_bytes()).chain(fixed.iter().copied()) {
        if let Some(dst) = out.get_mut(at..at.saturating_add(part.len())) {
            dst.copy_from_slice(part);
        }
        at = at.saturating_add(part.len());
    }
    out.get_mut(start..).unwrap_or_default()
}
