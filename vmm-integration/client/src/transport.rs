//! Sending requests and receiving whole messages: one buffered `recvmsg` usually brings a
//! whole reply; server requests that arrive meanwhile are answered (see `dma`).

use std::fs::File;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;

use switchyard_proto::consts::*;
use switchyard_proto::{Command, Header, Reply, Request, decode_reply_within};

use crate::error::{io_err, unexpected};
use crate::{Client, ClientError, Result};

impl Client {
    pub(crate) fn request(
        &mut self,
        req: &Request<'_>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Reply<'_>, Vec<File>)> {
        let (hdr, files) = self.call(req, fds)?;
        let reply = self.decode(&hdr, files.len())?;
        Ok((reply, files))
    }

    pub(crate) fn call(
        &mut self,
        req: &Request<'_>,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Header, Vec<File>)> {
        let id = self.alloc_id();
        req.encode(id, false, &mut self.out)
            .map_err(ClientError::Protocol)?;
        self.transact(id, req.command(), fds)
    }

    pub(crate) fn decode(&self, hdr: &Header, nfds: usize) -> Result<Reply<'_>> {
        decode_reply_within(hdr, self.body(), nfds, MAX_MSG_SIZE).map_err(ClientError::Protocol)
    }

    pub(crate) fn expect_reply(
        &self,
        hdr: &Header,
        nfds: usize,
        ok: impl Fn(&Reply<'_>) -> bool,
    ) -> Result<()> {
        let r = self.decode(hdr, nfds)?;
        if ok(&r) {
            Ok(())
        } else {
            Err(unexpected("reply content"))
        }
    }

    pub(crate) fn send_out(&mut self, fds: &[BorrowedFd<'_>]) -> Result<()> {
        send_all(&self.sock, &self.out, fds)
    }

    /// Sends `self.out` and waits for the matching reply (id, command, type),
    /// serving interleaved server requests. Error replies become
    /// [`ClientError::Remote`]. The reply body is left in `self.rx`.
    pub(crate) fn transact(
        &mut self,
        id: u16,
        cmd: Command,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Header, Vec<File>)> {
        self.send_out(fds)?;
        loop {
            let (hdr, files) = self.recv_message()?;
            if hdr.is_command() {
                self.serve_request(&hdr, files.len())?;
                continue;
            }
            hdr.validate_reply_flags().map_err(ClientError::Protocol)?;
            if hdr.msg_id != id {
                return Err(ClientError::UnexpectedReply(format!(
                    "reply id {} while waiting for {id}",
                    hdr.msg_id
                )));
            }
            if hdr.cmd != cmd.as_u16() {
                return Err(ClientError::UnexpectedReply(format!(
                    "reply command {} for {cmd:?}",
                    hdr.cmd
                )));
            }
            if hdr.is_error() {
                let errno = i32::try_from(hdr.error_no).unwrap_or(i32::MAX);
                tracing::debug!(?cmd, errno, "server returned an error");
                return Err(ClientError::Remote {
                    command: cmd,
                    errno,
                });
            }
            return Ok((hdr, files));
        }
    }

    /// Receives the next whole message into `self.rx`. Reads go into a buffer, so a reply
    /// usually costs one `recvmsg`. Descriptors go to the next reply parsed after they arrived:
    /// the only commands a server sends (DMA_READ/DMA_WRITE) carry none, and a read that
    /// brings such a command may also bring the start of a reply with fds.
    pub(crate) fn recv_message(&mut self) -> Result<(Header, Vec<File>)> {
        loop {
            let avail = self.in_end - self.in_start;
            if avail >= HEADER_SIZE {
                let hbytes = self
                    .inbuf
                    .get(self.in_start..self.in_start + HEADER_SIZE)
                    .unwrap_or_default();
                let hdr = Header::from_bytes(hbytes).map_err(ClientError::Protocol)?;
                let len = hdr.body_len().map_err(ClientError::Protocol)?;
                let total = HEADER_SIZE + len;
                if avail >= total {
                    if self.in_start == 0 && self.in_end == total && total >= INBUF_MIN {
                        // A large message alone in the buffer (a dirty bitmap, a big read):
                        // swap buffers instead of copying it.
                        std::mem::swap(&mut self.rx, &mut self.inbuf);
                        self.rx.truncate(total);
                        self.rx_start = HEADER_SIZE;
                        if self.inbuf.len() < INBUF_MIN {
                            self.inbuf.resize(INBUF_MIN, 0);
                        }
                    } else {
                        let body = self
                            .inbuf
                            .get(self.in_start + HEADER_SIZE..self.in_start + total)
                            .unwrap_or_default();
                        self.rx.clear();
                        self.rx.extend_from_slice(body);
                        self.rx_start = 0;
                    }
                    self.in_start += total;
                    if self.in_start == self.in_end {
                        self.in_start = 0;
                        self.in_end = 0;
                    }
                    let fds = if hdr.is_command() {
                        Vec::new()
                    } else {
                        std::mem::take(&mut self.pending_fds)
                    };
                    tracing::trace!(
                        id = hdr.msg_id,
                        cmd = hdr.cmd,
                        flags = hdr.flags,
                        len,
                        nfds = fds.len(),
                        "received"
                    );
                    return Ok((hdr, fds));
                }
                if self.inbuf.len() < total {
                    self.inbuf.resize(total, 0);
                }
            }
            // Move the partial message to the front (usually a few bytes, usually none).
            if self.in_start > 0 {
                self.inbuf.copy_within(self.in_start..self.in_end, 0);
                self.in_end = avail;
                self.in_start = 0;
            }
            let room = self.inbuf.get_mut(self.in_end..).unwrap_or_default();
            let pending = &mut self.pending_fds;
            match switchyard_endpoint::recv(&self.sock, room, MAX_RECV_FDS, false, |fd| {
                pending.push(File::from(fd));
            }) {
                Ok(r) if r.bytes == 0 => return Err(ClientError::Disconnected),
                Ok(r) => self.in_end += r.bytes,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_err(e)),
            }
        }
    }

    /// The body of the last message received.
    pub(crate) fn body(&self) -> &[u8] {
        self.rx.get(self.rx_start..).unwrap_or_default()
    }
}

/// Smallest receive buffer (and the size from which a message is swapped out, not copied).
pub(crate) const INBUF_MIN: usize = 64 << 10;

/// Most descriptors accepted with one read; more are dropped by the kernel.
const MAX_RECV_FDS: usize = 64;

/// Sends all of `bytes`, attaching `fds` to the first chunk.
pub(crate) fn send_all(sock: &UnixStream, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
    switchyard_endpoint::send_all(sock, bytes, fds).map_err(io_err)
}
