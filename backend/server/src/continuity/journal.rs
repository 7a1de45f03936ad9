//! The receive journal and the reply area: what a replacement needs to frame the rest of the
//! stream, and to send exactly what of the last reply had not left.

use std::io;

use super::{Continuity, Resumed};
use crate::framer::Framer;

impl Continuity {
    /// Publishes the receive journal of `framer`.
    pub(crate) fn publish_rx(&self, framer: &Framer) {
        let mut g = self.lock();
        let mut buf = std::mem::take(&mut g.scratch);
        framer.journal(&mut buf);
        let (at, len) = g.pending_reply.unwrap_or((u64::MAX, 0));
        let mut head = [0u8; 16];
        head[..8].copy_from_slice(&at.to_le_bytes());
        head[8..].copy_from_slice(&len.to_le_bytes());
        if let Err(e) = g.rx.publish_parts(&[&head, &buf]) {
            g.degraded("cannot publish the receive journal", &e);
        }
        g.scratch = buf;
    }

    /// Writes `reply` into the reply area at the black box file's position (moving the
    /// position back to the start of the area first if the reply would not fit), and records
    /// it as the reply being sent: the next [`Continuity::publish_rx`] (the one that takes its
    /// request out of the journal) carries it. Then [`Continuity::send_reply`] sends it with
    /// `sendfile`, which advances the file position as bytes leave. A replacement compares
    /// the position with the recorded reply and sends exactly what had not left
    /// ([`Continuity::resend_unsent`]): no reply is lost or sent twice, whenever the kill
    /// lands. Returns `false` (nothing recorded) if the reply does not fit the area.
    pub(crate) fn prepare_reply(&self, framer: &Framer, reply: &[u8]) -> bool {
        let mut g = self.lock();
        let area_off = g.replies.file_offset();
        let cap = g.replies.capacity() as u64;
        if reply.len() as u64 > cap / 2 {
            return false;
        }
        // The file position, known without asking the kernel once a reply has gone out whole
        // (`send_reply` keeps it); asked after anything else.
        let pos = match g.reply_pos {
            Some(p) => p,
            None => match rustix::fs::seek(g.replies.file(), rustix::fs::SeekFrom::Current(0)) {
                Ok(p) => p,
                Err(e) => {
                    g.degraded("cannot read the reply area's position", &e);
                    return false;
                }
            },
        };
        g.reply_pos = None;
        let mut at = pos
            .checked_sub(area_off)
            .filter(|a| *a <= cap)
            .unwrap_or(cap);
        if at + reply.len() as u64 > cap {
            // Back to the start of the area. The reply before was sent (its `sendfile`
            // returned): the journal stops naming it first, so that a kill between the two
            // steps cannot make a replacement take the rewound position for an unsent reply.
            g.pending_reply = None;
            let mut buf = std::mem::take(&mut g.scratch);
            framer.journal(&mut buf);
            let head = [0xffu8; 8];
            let publish = g.rx.publish_parts(&[&head, &[0u8; 8], &buf]);
            g.scratch = buf;
            if let Err(e) = publish {
                g.degraded("cannot publish the receive journal", &e);
                return false;
            }
            if let Err(e) =
                rustix::fs::seek(g.replies.file(), rustix::fs::SeekFrom::Start(area_off))
            {
                g.degraded("cannot rewind the reply area", &e);
                return false;
            }
            at = 0;
        }
        if let Err(e) = g.replies.write_at(at as usize, reply) {
            g.degraded("cannot write the reply area", &e);
            return false;
        }
        g.pending_reply = Some((at, reply.len() as u64));
        true
    }

    /// Sends the prepared reply to `sock` from the reply area (`sendfile` at the file's
    /// position), all of it within `timeout` (a client that does not read is given up on
    /// then, however many partial sends it let through).
    pub(crate) fn send_reply(
        &self,
        sock: &std::os::unix::net::UnixStream,
        timeout: std::time::Duration,
    ) -> io::Result<()> {
        let mut g = self.lock();
        let Some((at, len)) = g.pending_reply else {
            return Err(io::Error::other("no prepared reply"));
        };
        sendfile_all(sock, g.replies.file(), len, timeout)?;
        g.reply_pos = Some(g.replies.file_offset() + at + len);
        Ok(())
    }

    /// In a replacement: sends what of the last reply had not left when the process died
    /// (the file position says how much had), within `timeout`. Returns the bytes sent.
    pub fn resend_unsent(
        &self,
        resumed: &Resumed,
        sock: &std::os::unix::net::UnixStream,
        timeout: std::time::Duration,
    ) -> io::Result<u64> {
        let Some((at, len)) = resumed.pending_reply else {
            return Ok(0);
        };
        let mut g = self.lock();
        g.pending_reply = resumed.pending_reply;
        let area_off = g.replies.file_offset();
        let pos = rustix::fs::seek(g.replies.file(), rustix::fs::SeekFrom::Current(0))?;
        let start = area_off + at;
        let end = start + len;
        if pos >= end {
            return Ok(0);
        }
        if pos < start {
            return Err(io::Error::other(format!(
                "reply area position {pos} before the reply being sent ({start})"
            )));
        }
        let unsent = end - pos;
        sendfile_all(sock, g.replies.file(), unsent, timeout)?;
        Ok(unsent)
    }
}

/// Sends `len` bytes of `file` from its position to `sock` (`sendfile`, which advances the
/// position as the bytes leave), within `timeout` in all.
///
/// The socket's send timeout (`SO_SNDTIMEO`, set to `timeout` by the connection) bounds one
/// wait; a client that reads a little now and then would reset it with every partial send,
/// so after a partial send the socket's timeout is lowered to what is left of `timeout` (and
/// put back afterwards).
fn sendfile_all(
    sock: &std::os::unix::net::UnixStream,
    file: &std::fs::File,
    len: u64,
    timeout: std::time::Duration,
) -> io::Result<()> {
    use rustix::net::sockopt::{Timeout, set_socket_timeout};
    let deadline = std::time::Instant::now() + timeout;
    let mut left = usize::try_from(len).map_err(io::Error::other)?;
    let mut shortened = false;
    let result = loop {
        if left == 0 {
            break Ok(());
        }
        match rustix::fs::sendfile(sock, file, None, left) {
            Ok(0) => break Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => {
                left -= n;
                if left > 0 {
                    let rest = deadline.saturating_duration_since(std::time::Instant::now());
                    if rest.is_zero() {
                        break Err(io::ErrorKind::TimedOut.into());
                    }
                    // Zero would mean "no timeout".
                    let rest = rest.max(std::time::Duration::from_millis(1));
                    if let Err(e) = set_socket_timeout(sock, Timeout::Send, Some(rest)) {
                        break Err(e.into());
                    }
                    shortened = true;
                }
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => break Err(io::ErrorKind::TimedOut.into()),
            Err(e) => break Err(e.into()),
        }
    };
    if shortened && let Err(e) = set_socket_timeout(sock, Timeout::Send, Some(timeout)) {
        tracing::warn!(error = %e, "cannot restore the reply send timeout (SO_SNDTIMEO)");
    }
    result
}
