//! Validation helpers shared by the request and reply decoders.

use crate::error::ProtoError;

/// At most `max` fds came with the message.
pub(crate) fn check_fds(what: &'static str, nfds: usize, max: usize) -> Result<(), ProtoError> {
    if nfds > max {
        return Err(ProtoError::BadFdCount { what, got: nfds });
    }
    Ok(())
}

/// `argsz` is at least `min`.
pub(crate) fn check_argsz(what: &'static str, argsz: u32, min: u64) -> Result<(), ProtoError> {
    if u64::from(argsz) < min {
        return Err(ProtoError::BadArgsz { what, argsz, min });
    }
    Ok(())
}

/// `body` is exactly `size` bytes long.
pub(crate) fn exact_body(what: &'static str, body: &[u8], size: usize) -> Result<(), ProtoError> {
    if body.len() != size {
        return Err(ProtoError::BadSize {
            what,
            expected: size,
            got: body.len(),
        });
    }
    Ok(())
}

/// `data` holds exactly the `count` bytes a fixed part announced.
pub(crate) fn data_len(what: &'static str, data: &[u8], count: u64) -> Result<(), ProtoError> {
    if data.len() as u64 != count {
        return Err(ProtoError::BadSize {
            what,
            expected: usize::try_from(count).unwrap_or(usize::MAX),
            got: data.len(),
        });
    }
    Ok(())
}
