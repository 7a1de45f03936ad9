//! Windows the client mapped without a descriptor: reached through messages to the client
//! ([`RemoteDma`]), through a stack bounce buffer.

use std::sync::Arc;

use super::{Dir, DmaError, DmaSpace, Piece, Result};

/// Message-based access to windows the client mapped without a file descriptor.
///
/// The server implements this by sending `DMA_READ` / `DMA_WRITE` to the client. It is called
/// without any lock of the DMA space held, so the server's connection thread can keep serving
/// (and answering) while an engine waits.
pub trait RemoteDma: Send + Sync {
    /// Reads `buf.len()` bytes at `iova` from the client. Errors are errnos.
    fn read(&self, iova: u64, buf: &mut [u8]) -> std::result::Result<(), i32>;
    /// Writes `data` at `iova` in the client. Errors are errnos.
    fn write(&self, iova: u64, data: &[u8]) -> std::result::Result<(), i32>;
}

impl DmaSpace {
    /// Installs (or removes) the message-based transport for fd-less windows.
    pub fn set_remote(&self, remote: Option<Arc<dyn RemoteDma>>) {
        *self.remote.write().unwrap_or_else(|p| p.into_inner()) = remote;
    }

    /// Accesses `[cur, piece_end)` of a message-only window through the client, in chunks of a
    /// stack bounce buffer. `done` is the offset of `cur` within the whole access.
    pub(super) fn remote_piece<F>(
        &self,
        cur: u64,
        piece_end: u64,
        done: usize,
        dir: Dir,
        f: &mut F,
    ) -> Result<()>
    where
        F: FnMut(usize, Piece<'_>),
    {
        let remote = self
            .remote
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(remote) = remote else {
            return Err(DmaError::Remote {
                iova: cur,
                errno: libc::ENOTCONN,
            });
        };
        let mut bounce = [0u8; 4096];
        let mut at = cur;
        while at < piece_end {
            // At most 4096: fits in usize.
            let n = (piece_end - at).min(bounce.len() as u64) as usize;
            let buf = bounce.get_mut(..n).unwrap_or_default();
            let off = done + (at - cur) as usize;
            if dir == Dir::Read {
                remote
                    .read(at, buf)
                    .map_err(|errno| DmaError::Remote { iova: at, errno })?;
                f(off, Piece::Bounce(buf));
            } else {
                f(off, Piece::Bounce(buf));
                remote
                    .write(at, buf)
                    .map_err(|errno| DmaError::Remote { iova: at, errno })?;
            }
            at += n as u64;
        }
        Ok(())
    }
}
