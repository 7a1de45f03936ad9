//! The socket half of the transport: [`Connection`] reads a vfio-user stream socket
//! (`recvmsg`, adaptive polling, and with crash continuity peek, journal, consume) and feeds a
//! [`Framer`].

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::continuity::Continuity;
use crate::framer::{FdRefusal, Framer, MAX_FDS_PER_READ, Message, TransportError};

/// A framed vfio-user connection: a [`Framer`] fed by `recvmsg` on the stream.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
    framer: Framer,
    /// Descriptors of the read in progress, handed to the framer (allocated once).
    read_fds: Vec<OwnedFd>,
    spin: Duration,
    /// Crash continuity: descriptors go into custody as they arrive, and the receive journal
    /// is published after every read and every answered message.
    continuity: Option<Arc<Continuity>>,
    /// Descriptors of kinds their message cannot carry (a client can send them at message
    /// rate).
    bad_fds: switchyard_device::ratelimit::LogLimiter,
}

fn bad_fds_limiter() -> switchyard_device::ratelimit::LogLimiter {
    switchyard_device::ratelimit::LogLimiter::new(
        "descriptors refused by kind",
        switchyard_device::ratelimit::LOG_INTERVAL,
    )
}

impl Connection {
    /// Wraps a connected stream. `max_msg_size` bounds a whole message (header included);
    /// `spin` is the adaptive polling budget (zero disables it).
    pub fn new(stream: UnixStream, max_msg_size: u32, spin: Duration) -> Self {
        Self {
            stream,
            framer: Framer::new(max_msg_size),
            read_fds: Vec::with_capacity(MAX_FDS_PER_READ),
            spin,
            continuity: None,
            bad_fds: bad_fds_limiter(),
        }
    }

    /// A connection that continues where a replaced process stopped: `framer` comes from
    /// [`Framer::resume`].
    pub(crate) fn resumed(stream: UnixStream, framer: Framer, spin: Duration) -> Self {
        Self {
            stream,
            framer,
            read_fds: Vec::with_capacity(MAX_FDS_PER_READ),
            spin,
            continuity: None,
            bad_fds: bad_fds_limiter(),
        }
    }

    /// Keeps descriptors in custody and publishes the receive journal into `continuity`.
    /// Turns on the socket's peek offset (`SO_PEEK_OFF`), through which a replacement learns
    /// whether the last read was consumed (see [`Connection::recv_journaled`]).
    pub(crate) fn set_continuity(&mut self, continuity: Option<Arc<Continuity>>) {
        if continuity.is_some()
            && let Err(e) = switchyard_sys::sock::set_peek_offset(self.stream.as_fd(), 0)
        {
            tracing::warn!(error = %e, "no SO_PEEK_OFF: a restart may replay or lose the last read");
        }
        self.continuity = continuity;
    }

    /// Settles a read a killed process left half done. The socket's peek offset (`off`) says
    /// how many bytes it had peeked and not consumed; the journal (`journaled`) says how many
    /// of its own bytes were peeked and not yet known consumed. They agree (`off ==
    /// journaled`): the journal has the bytes, which leave the socket. The journal does not
    /// have them (`journaled == 0`: killed between the peek and the publish): the offset goes
    /// back to zero and they are read again. `off == 0`: nothing to do. Returns the bytes
    /// consumed.
    pub(crate) fn settle_peeked(stream: &UnixStream, journaled: usize) -> io::Result<usize> {
        let off = usize::try_from(switchyard_sys::sock::peek_offset(stream.as_fd())?).unwrap_or(0);
        if off == 0 {
            return Ok(0);
        }
        if off != journaled {
            if journaled != 0 {
                tracing::warn!(
                    off,
                    journaled,
                    "peek offset and journal disagree; reading again"
                );
            }
            switchyard_sys::sock::set_peek_offset(stream.as_fd(), 0)?;
            return Ok(0);
        }
        discard(stream, off, true)
    }

    /// The crash continuity this connection publishes into, if any.
    pub(crate) fn continuity(&self) -> Option<&Arc<Continuity>> {
        self.continuity.as_ref()
    }

    /// The framer (for the continuity's journal).
    pub(crate) fn framer(&self) -> &Framer {
        &self.framer
    }

    /// The message last received has been answered: it leaves the journal.
    pub fn done(&mut self) {
        self.framer.done();
        if let Some(c) = &self.continuity {
            c.publish_rx(&self.framer);
            let dropped = self.framer.take_dropped_ids();
            if !dropped.is_empty() {
                c.settle(&dropped);
            }
        }
    }

    /// The underlying stream (for `try_clone` / shutdown).
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }

    /// Receives the next complete message.
    ///
    /// A header whose size is invalid makes the connection unusable (the stream can no longer
    /// be framed): it is reported as [`TransportError::BadHeader`] after which the caller should
    /// reply with an error if it can and drop the connection.
    pub fn recv(&mut self) -> Result<Message<'_>, TransportError> {
        // Whatever came before has been answered.
        self.framer.done();
        while !self.framer.ready()? {
            self.fill()?;
        }
        // `ready` said a message is complete.
        self.framer.next_message()?.ok_or(TransportError::Truncated)
    }

    fn fill(&mut self) -> Result<(), TransportError> {
        // Adaptive polling: non-blocking reads (MSG_DONTWAIT, no fcntl round trips) until the
        // budget is spent, then one blocking read.
        let deadline = (!self.spin.is_zero()).then(|| Instant::now() + self.spin);
        loop {
            let spinning = deadline.is_some_and(|d| Instant::now() < d);
            match self.recv_once(spinning) {
                Ok(0) => {
                    return Err(if self.framer.partial() == 0 {
                        TransportError::Closed
                    } else {
                        TransportError::Truncated
                    });
                }
                Ok(_) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && spinning => {
                    std::hint::spin_loop();
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    fn recv_once(&mut self, dontwait: bool) -> io::Result<usize> {
        if let Some(c) = self.continuity.clone() {
            return self.recv_journaled(&c, dontwait);
        }
        let fds = &mut self.read_fds;
        fds.clear();
        let got = switchyard_endpoint::recv(
            &self.stream,
            self.framer.buffer_mut(),
            MAX_FDS_PER_READ,
            dontwait,
            |fd| fds.push(fd),
        )?;
        let mut refused = got.fds_truncated.then_some(truncation(self.read_fds.len()));
        if !self.read_fds.is_empty() && refused.is_none() {
            refused = self.check_kinds(got.bytes);
        }
        if refused.is_some() {
            self.read_fds.drain(..).for_each(crate::fd_kind::dispose);
        }
        self.framer
            .filled_refused(got.bytes, self.read_fds.drain(..), &[], refused);
        Ok(got.bytes)
    }

    /// Whether the descriptors of the read of `n` bytes (in the framer's buffer, not yet
    /// filled) are of kinds their message may carry ([`crate::fd_kind`]): checked before
    /// they go into custody, where the supervisor could be the last to close them.
    fn check_kinds(&self, n: usize) -> Option<FdRefusal> {
        let cmd = self.framer.claimant(n);
        match crate::fd_kind::check(cmd, &self.read_fds) {
            Ok(()) => None,
            Err(what) => {
                if self.bad_fds.allow() {
                    tracing::warn!(
                        cmd,
                        count = self.read_fds.len(),
                        what,
                        "the client sent a descriptor of a kind its message cannot carry; refused (EINVAL)"
                    );
                }
                Some(FdRefusal::Kind)
            }
        }
    }

    /// A read that the journal records before the socket forgets it: peek (the bytes stay in
    /// the socket), put the descriptors into custody, publish the journal, and only then
    /// consume the bytes. A kill before the publish leaves the bytes in the socket only; after
    /// it, in the journal and, until the consume, also in the socket — which the kernel's
    /// per-socket peek offset (`SO_PEEK_OFF`, shared with the supervisor's descriptor) tells
    /// the replacement, so it consumes them instead of reading them twice
    /// ([`Connection::settle_peeked`]). SIGKILL takes effect when a syscall returns, so the
    /// offset and the socket always agree.
    fn recv_journaled(&mut self, c: &Continuity, dontwait: bool) -> io::Result<usize> {
        let fds = &mut self.read_fds;
        fds.clear();
        let got = switchyard_endpoint::peek(
            &self.stream,
            self.framer.buffer_mut(),
            MAX_FDS_PER_READ,
            dontwait,
            |fd| fds.push(fd),
        )?;
        if got.bytes == 0 {
            return Ok(0);
        }
        let mut refused = got.fds_truncated.then_some(truncation(self.read_fds.len()));
        if !self.read_fds.is_empty() && refused.is_none() {
            refused = self.check_kinds(got.bytes);
        }
        let ids = if self.read_fds.is_empty() || refused.is_some() {
            Vec::new()
        } else {
            match c.hold(&self.read_fds) {
                Ok(ids) => ids,
                Err(why) => {
                    refused = Some(why);
                    Vec::new()
                }
            }
        };
        if refused.is_some() {
            // Never held: closed here (without blocking: see `fd_kind::dispose`), and their
            // message is refused (as one whose descriptors the kernel dropped, with the
            // refusal's errno).
            self.read_fds.drain(..).for_each(crate::fd_kind::dispose);
        }
        self.framer
            .filled_refused(got.bytes, self.read_fds.drain(..), &ids, refused);
        self.framer.set_unconsumed(got.bytes);
        c.publish_rx(&self.framer);
        // Descriptors the framer dropped are no longer in the journal just published.
        let dropped = self.framer.take_dropped_ids();
        if !dropped.is_empty() {
            c.settle(&dropped);
        }
        // Consume what was peeked. The kernel installs the descriptors again: the copies from
        // the peek are the ones kept, these are closed.
        discard(&self.stream, got.bytes, false)?;
        self.framer.set_unconsumed(0);
        c.publish_rx(&self.framer);
        Ok(got.bytes)
    }
}

/// Reads and drops `n` bytes (and the descriptors that come with them) from `stream`;
/// returns how many there were (fewer at end of stream, or with `nonblocking` when the socket
/// has fewer).
fn discard(stream: &UnixStream, n: usize, nonblocking: bool) -> io::Result<usize> {
    let mut left = n;
    let mut sink = [0u8; 4096];
    while left > 0 {
        let chunk = left.min(sink.len());
        match switchyard_endpoint::recv(
            stream,
            &mut sink[..chunk],
            MAX_FDS_PER_READ,
            nonblocking,
            crate::fd_kind::dispose,
        ) {
            Ok(r) if r.bytes == 0 => break,
            Ok(r) => left -= r.bytes,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(n - left)
}

/// How a read whose descriptors the kernel truncated, with `got` of them, is refused: a
/// full read means the message carried more than any may.
fn truncation(got: usize) -> FdRefusal {
    if got >= MAX_FDS_PER_READ {
        FdRefusal::TooMany
    } else {
        FdRefusal::Truncated
    }
}

impl Drop for Connection {
    /// The client is gone: what the kind check suppressed is summarised now.
    fn drop(&mut self) {
        self.bad_fds.flush();
    }
}
