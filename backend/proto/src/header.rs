//! The 16-byte message header, and decoding a command number into a [`Command`].

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::consts::*;
use crate::error::ProtoError;

pub(crate) use crate::command::{Command, Direction};

impl TryFrom<u16> for Command {
    type Error = ProtoError;

    fn try_from(v: u16) -> Result<Self, ProtoError> {
        let idx = usize::from(v)
            .checked_sub(1)
            .ok_or(ProtoError::UnknownCommand(v))?;
        Command::ALL
            .get(idx)
            .copied()
            .ok_or(ProtoError::UnknownCommand(v))
    }
}

/// The 16-byte header that precedes every message (spec §1.3), host endian.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, FromBytes, IntoBytes, KnownLayout, Immutable,
)]
#[repr(C)]
pub struct Header {
    /// Message ID chosen by the sender of a command, echoed in the reply.
    pub msg_id: u16,
    /// Command number.
    pub cmd: u16,
    /// Whole message size including this header.
    pub msg_size: u32,
    /// Type bits, `No_reply`, `Error`.
    pub flags: u32,
    /// errno of an error reply; reserved (0) in commands.
    pub error_no: u32,
}

impl Header {
    /// Size of the header on the wire.
    pub const SIZE: usize = HEADER_SIZE;

    /// Reads a header from the first 16 bytes of `bytes` (no validation
    /// besides length; use [`Header::body_len`] and the decoders).
    pub fn from_bytes(bytes: &[u8]) -> Result<Header, ProtoError> {
        Header::read_from_prefix(bytes)
            .map(|(h, _)| h)
            .map_err(|_| ProtoError::truncated("header", HEADER_SIZE, bytes.len()))
    }

    /// The 16 wire bytes (host endian).
    pub fn to_bytes(&self) -> [u8; HEADER_SIZE] {
        zerocopy::transmute!(*self)
    }

    /// Builds a command header for a body of `body_len` bytes.
    pub fn command(
        msg_id: u16,
        cmd: Command,
        no_reply: bool,
        body_len: usize,
    ) -> Result<Header, ProtoError> {
        Ok(Header {
            msg_size: msg_size_for(body_len)?,
            ..Header::unsized_command(msg_id, cmd, no_reply)
        })
    }

    /// Builds a (successful) reply header for a body of `body_len` bytes.
    pub fn reply(msg_id: u16, cmd: u16, body_len: usize) -> Result<Header, ProtoError> {
        Ok(Header {
            msg_size: msg_size_for(body_len)?,
            ..Header::unsized_reply(msg_id, cmd)
        })
    }

    /// A command header with `msg_size` 0, to be patched once the body is written.
    pub(crate) const fn unsized_command(msg_id: u16, cmd: Command, no_reply: bool) -> Header {
        Header {
            msg_id,
            cmd: cmd.as_u16(),
            msg_size: 0,
            flags: VFIO_USER_F_TYPE_COMMAND | if no_reply { VFIO_USER_F_NO_REPLY } else { 0 },
            error_no: 0,
        }
    }

    /// A successful reply header with `msg_size` 0, to be patched once the body is written.
    pub(crate) const fn unsized_reply(msg_id: u16, cmd: u16) -> Header {
        Header {
            msg_id,
            cmd,
            msg_size: 0,
            flags: VFIO_USER_F_TYPE_REPLY,
            error_no: 0,
        }
    }

    /// Builds an error reply header (no body). Negative errnos are negated.
    pub fn error_reply(msg_id: u16, cmd: u16, errno: i32) -> Header {
        Header {
            msg_id,
            cmd,
            msg_size: HEADER_SIZE as u32,
            flags: VFIO_USER_F_TYPE_REPLY | VFIO_USER_F_ERROR,
            error_no: errno.unsigned_abs(),
        }
    }

    /// Length of the body that follows the header, validating
    /// `16 <= msg_size <= MAX_MSG_SIZE`.
    pub fn body_len(&self) -> Result<usize, ProtoError> {
        self.body_len_within(MAX_MSG_SIZE)
    }

    /// Like [`Header::body_len`] with a caller-chosen maximum message size.
    pub fn body_len_within(&self, max_msg_size: u32) -> Result<usize, ProtoError> {
        if self.msg_size > max_msg_size {
            return Err(ProtoError::BadMsgSize {
                msg_size: self.msg_size,
                max: max_msg_size,
            });
        }
        let body = self
            .msg_size
            .checked_sub(HEADER_SIZE as u32)
            .ok_or(ProtoError::BadMsgSize {
                msg_size: self.msg_size,
                max: max_msg_size,
            })?;
        usize::try_from(body).map_err(|_| ProtoError::overflow("message size"))
    }

    /// The command, if known.
    pub fn command_kind(&self) -> Result<Command, ProtoError> {
        Command::try_from(self.cmd)
    }

    /// Whether the type bits say reply.
    pub fn is_reply(&self) -> bool {
        self.flags & VFIO_USER_F_TYPE_MASK == VFIO_USER_F_TYPE_REPLY
    }

    /// Whether the type bits say command.
    pub fn is_command(&self) -> bool {
        self.flags & VFIO_USER_F_TYPE_MASK == VFIO_USER_F_TYPE_COMMAND
    }

    /// Whether `No_reply` is set.
    pub fn no_reply(&self) -> bool {
        self.flags & VFIO_USER_F_NO_REPLY != 0
    }

    /// Whether `Error` is set.
    pub fn is_error(&self) -> bool {
        self.flags & VFIO_USER_F_ERROR != 0
    }

    /// Validates the header of a command: known type bits, no `Error` flag,
    /// no undefined flags. Does not look at `msg_size` or `cmd`.
    pub fn validate_command_flags(&self) -> Result<(), ProtoError> {
        if self.flags & !VFIO_USER_F_ALL != 0 || self.is_error() {
            return Err(ProtoError::BadHeaderFlags { flags: self.flags });
        }
        if !self.is_command() {
            return Err(ProtoError::BadMessageType { flags: self.flags });
        }
        Ok(())
    }

    /// Validates the header of a reply: reply type bits, no `No_reply`,
    /// no undefined flags.
    pub fn validate_reply_flags(&self) -> Result<(), ProtoError> {
        if self.flags & !VFIO_USER_F_ALL != 0 || self.no_reply() {
            return Err(ProtoError::BadHeaderFlags { flags: self.flags });
        }
        if !self.is_reply() {
            return Err(ProtoError::BadMessageType { flags: self.flags });
        }
        Ok(())
    }
}

/// `msg_size` for a body length, checking the u32 range.
pub(crate) fn msg_size_for(body_len: usize) -> Result<u32, ProtoError> {
    body_len
        .checked_add(HEADER_SIZE)
        .and_then(|n| u32::try_from(n).ok())
        .ok_or(ProtoError::MessageTooLarge {
            size: body_len.saturating_add(HEADER_SIZE),
        })
}
