//! Raw access for tests that send malformed input.

use std::fs::File;
use std::os::fd::BorrowedFd;

use switchyard_proto::Header;

use crate::transport::send_all;
use crate::{Client, ClientError, Result};

/// A raw received message.
#[derive(Debug)]
pub struct RawMessage {
    /// The header.
    pub header: Header,
    /// The body (after the header).
    pub body: Vec<u8>,
    /// Any fds passed with it.
    pub fds: Vec<File>,
}

impl Client {
    /// Sends raw bytes (any content) with fds.
    pub fn send_raw(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<()> {
        send_all(&self.sock, bytes, fds)
    }

    /// Receives the next message as is (no DMA servicing, no validation
    /// beyond the header's size).
    pub fn recv_raw(&mut self) -> Result<RawMessage> {
        let (header, fds) = self.recv_message()?;
        Ok(RawMessage {
            header,
            body: self.body().to_vec(),
            fds,
        })
    }

    /// Sends raw bytes and waits for the reply whose msg id equals the id in
    /// `bytes`' header, answering server DMA requests meanwhile. Error
    /// replies are returned as messages, not as errors.
    pub fn call_raw(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<RawMessage> {
        let hdr = Header::from_bytes(bytes).map_err(ClientError::Protocol)?;
        self.send_raw(bytes, fds)?;
        loop {
            let (header, fds) = self.recv_message()?;
            if header.is_command() {
                self.serve_request(&header, fds.len())?;
                continue;
            }
            if header.msg_id != hdr.msg_id {
                return Err(ClientError::UnexpectedReply(format!(
                    "reply id {} while waiting for {}",
                    header.msg_id, hdr.msg_id
                )));
            }
            return Ok(RawMessage {
                header,
                body: self.body().to_vec(),
                fds,
            });
        }
    }
}
