//! A raw vfio-user peer for malformed-input tests: sends arbitrary bytes and fds and reads
//! whole replies, with a timeout so a test can never hang.

#![allow(dead_code)]

use std::io::Read;
use std::os::fd::BorrowedFd;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use switchyard_proto::{Capabilities, Header, encode_version_request};
use zerocopy::{FromBytes, IntoBytes};

/// One whole message: a header for `body`, then `body`.
pub fn message(msg_id: u16, cmd: u16, flags: u32, body: &[u8]) -> Vec<u8> {
    let h = Header {
        msg_id,
        cmd,
        msg_size: 16 + body.len() as u32,
        flags,
        error_no: 0,
    };
    let mut m = h.as_bytes().to_vec();
    m.extend_from_slice(body);
    m
}

pub struct Raw {
    pub s: UnixStream,
    next: u16,
}

impl Raw {
    pub fn connect(path: &Path) -> Raw {
        let s = UnixStream::connect(path).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        Raw { s, next: 1 }
    }

    /// Connects and negotiates the version with default capabilities.
    pub fn negotiated(path: &Path) -> Raw {
        let mut r = Raw::connect(path);
        let mut buf = Vec::new();
        encode_version_request(&mut buf, 0, 0, &Capabilities::default()).expect("encode");
        r.send(&buf, &[]);
        let (h, _) = r.recv().expect("version reply");
        assert!(!h.is_error(), "version failed: {h:?}");
        r
    }

    pub fn id(&mut self) -> u16 {
        self.next = self.next.wrapping_add(1);
        self.next
    }

    /// Sends `bytes` with `fds` (any number the kernel takes: more than the server accepts).
    pub fn send(&mut self, bytes: &[u8], fds: &[BorrowedFd<'_>]) {
        switchyard_endpoint::send_all(&self.s, bytes, fds).expect("send");
    }

    /// Reads one whole message; `None` on EOF.
    pub fn recv(&mut self) -> Option<(Header, Vec<u8>)> {
        let mut h = [0u8; 16];
        if self.s.read_exact(&mut h).is_err() {
            return None;
        }
        let hdr = Header::read_from_bytes(&h).expect("header");
        let mut body = vec![0u8; (hdr.msg_size as usize).saturating_sub(16)];
        self.s.read_exact(&mut body).ok()?;
        Some((hdr, body))
    }

    /// Sends a command built from a header and body and returns the reply.
    pub fn call(
        &mut self,
        cmd: u16,
        flags: u32,
        body: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> (Header, Vec<u8>) {
        let id = self.id();
        self.send(&message(id, cmd, flags, body), fds);
        let (rh, rb) = self.recv().expect("a reply, not EOF");
        assert_eq!(rh.msg_id, id, "reply id");
        assert_eq!(rh.cmd, cmd, "reply command");
        (rh, rb)
    }

    /// Expects an error reply with `errno`.
    pub fn expect_errno(&mut self, cmd: u16, body: &[u8], fds: &[BorrowedFd<'_>], errno: i32) {
        let (h, b) = self.call(cmd, 0, body, fds);
        assert!(
            h.is_error(),
            "cmd {cmd}: expected errno {errno}, got success {h:?}"
        );
        assert_eq!(h.error_no as i32, errno, "cmd {cmd}");
        assert!(b.is_empty(), "error replies carry only the header");
    }

    /// Reads 4 bytes of BAR0 (a liveness probe).
    pub fn read_reg(&mut self, off: u64) -> u32 {
        let mut body = off.to_ne_bytes().to_vec();
        body.extend_from_slice(&0u32.to_ne_bytes());
        body.extend_from_slice(&4u32.to_ne_bytes());
        let (h, b) = self.call(9, 0, &body, &[]);
        assert!(!h.is_error(), "region read failed: {h:?}");
        u32::from_le_bytes([b[16], b[17], b[18], b[19]])
    }
}
