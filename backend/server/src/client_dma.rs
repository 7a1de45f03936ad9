//! Server→client DMA: accesses to windows the client mapped without a file descriptor become
//! `DMA_READ` / `DMA_WRITE` commands on the connection socket. The engine thread that needs the
//! data sends the command (serialised with the connection thread's replies by a send lock) and
//! waits; the connection thread, which keeps reading the socket, routes the client's reply back
//! by message id.
//!
//! While the device waits for its engines from a device call, which runs on the connection
//! thread and so stops the routing, it holds these waits ([`RemoteWaits`]): the waits in flight
//! fail with `ECANCELED` at once (instead of after the timeout) and new requests fail without
//! being sent. Replies that arrive for cancelled (or timed-out) requests are recognised as late
//! and dropped.

use std::collections::{HashMap, HashSet};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use switchyard_device::{RemoteDma, RemoteWaits};
use switchyard_endpoint::{SendLimit, send_bounded};
use switchyard_proto::{Command, ProtoError, Reply, Request};

/// The outcome of one server→client request: the reply body or an errno.
type Outcome = Result<Vec<u8>, i32>;

/// Ids of requests given up (cancelled or timed out) remembered for their late replies; the
/// oldest are forgotten beyond this (ids are reused only after 32768 requests).
const MAX_ABANDONED: usize = 1024;

#[derive(Default)]
struct Waiters {
    done: HashMap<u16, Outcome>,
    waiting: HashSet<u16>,
    /// Given-up ids, oldest first.
    abandoned: std::collections::VecDeque<u16>,
    /// Active [`RemoteWaits::hold`]s: requests fail with `ECANCELED` meanwhile.
    holds: u32,
}

impl Waiters {
    fn abandon(&mut self, id: u16) {
        if self.abandoned.len() >= MAX_ABANDONED {
            self.abandoned.pop_front();
        }
        self.abandoned.push_back(id);
    }
}

/// What became of a reply the connection thread received.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Routed {
    /// Handed to the engine waiting for it.
    Delivered,
    /// Its request was cancelled or timed out: nobody waits any more.
    Late,
    /// No request of ours has that id.
    Unsolicited,
}

/// Sends DMA requests to the client and matches replies.
pub(crate) struct ClientDma {
    stream: UnixStream,
    send_lock: Arc<Mutex<()>>,
    next_id: AtomicU16,
    waiters: Mutex<Waiters>,
    cond: Condvar,
    closed: AtomicBool,
    /// This client has been told that its DMA goes through messages (see `note_slow_path`).
    told_slow_path: AtomicBool,
    max_xfer: usize,
    timeout: Duration,
}

impl ClientDma {
    pub(crate) fn new(
        stream: UnixStream,
        send_lock: Arc<Mutex<()>>,
        max_xfer: usize,
        timeout: Duration,
    ) -> Self {
        Self {
            stream,
            send_lock,
            next_id: AtomicU16::new(0x8000),
            waiters: Mutex::new(Waiters::default()),
            cond: Condvar::new(),
            closed: AtomicBool::new(false),
            told_slow_path: AtomicBool::new(false),
            max_xfer: max_xfer.max(1),
            timeout,
        }
    }

    /// Hands a reply received by the connection thread to the waiting engine.
    pub(crate) fn complete(&self, msg_id: u16, outcome: impl FnOnce() -> Outcome) -> Routed {
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        if !w.waiting.remove(&msg_id) {
            if let Some(i) = w.abandoned.iter().position(|&id| id == msg_id) {
                w.abandoned.remove(i);
                return Routed::Late;
            }
            return Routed::Unsolicited;
        }
        // Only an awaited reply is copied out of the receive buffer: a flood of unsolicited
        // or late replies costs no allocation.
        w.done.insert(msg_id, outcome());
        self.cond.notify_all();
        Routed::Delivered
    }

    /// Fails every waiter (client gone).
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        let ids: Vec<u16> = w.waiting.drain().collect();
        for id in ids {
            w.done.insert(id, Err(libc::ENOTCONN));
        }
        self.cond.notify_all();
    }

    /// The first device DMA of this client that goes through messages: one WARN naming the
    /// cause and the fix. Logged here, when the slow path is taken, rather than at the fd-less
    /// DMA_MAP: QEMU maps fd-less windows in every configuration (firmware ROMs read-only, a
    /// device's own mmapped BAR read-write), which devices do not use for DMA, so warning at
    /// the map would be a false alarm at every start.
    fn note_slow_path(&self, iova: u64, write: bool) {
        if self.told_slow_path.swap(true, Ordering::Relaxed) {
            return;
        }
        tracing::warn!(
            iova,
            write,
            "device DMA goes through DMA_READ/DMA_WRITE messages: the client mapped this \
             window without a file descriptor, usually because guest RAM is not shared \
             (about 12x slower COPY); share guest RAM with the server: QEMU `-object \
             memory-backend-memfd,id=mem0,size=...,share=on -machine memory-backend=mem0`, \
             cloud-hypervisor `--memory size=...,shared=on` (logged once per client)"
        );
    }

    fn transact(&self, req: &Request<'_>) -> Outcome {
        if self.closed.load(Ordering::SeqCst) {
            return Err(libc::ENOTCONN);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed) | 0x8000;
        let mut buf = Vec::new();
        req.encode(id, false, &mut buf).map_err(|e| e.errno())?;
        {
            let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
            if w.holds > 0 {
                return Err(libc::ECANCELED);
            }
            w.waiting.insert(id);
        }
        {
            let _g = self.send_lock.lock().unwrap_or_else(|p| p.into_inner());
            let limit = SendLimit {
                timeout: self.timeout,
                abort: None,
            };
            if let Err(e) = send_bounded(&self.stream, &buf, &[], limit) {
                self.waiters
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .waiting
                    .remove(&id);
                return Err(e.raw_os_error().unwrap_or(libc::EIO));
            }
        }
        let deadline = Instant::now() + self.timeout;
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(outcome) = w.done.remove(&id) {
                return outcome;
            }
            let now = Instant::now();
            if now >= deadline {
                w.waiting.remove(&id);
                w.abandon(id);
                tracing::warn!(
                    msg_id = id,
                    timeout_ms = self.timeout.as_millis() as u64,
                    "the client did not answer a DMA request in time"
                );
                return Err(libc::ETIMEDOUT);
            }
            w = self
                .cond
                .wait_timeout(w, deadline - now)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

impl RemoteWaits for ClientDma {
    fn hold(&self) {
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        w.holds += 1;
        let ids: Vec<u16> = w.waiting.drain().collect();
        for id in ids {
            tracing::debug!(msg_id = id, "cancelling a DMA request to the client");
            w.done.insert(id, Err(libc::ECANCELED));
            w.abandon(id);
        }
        self.cond.notify_all();
    }

    fn release(&self) {
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        w.holds = w.holds.saturating_sub(1);
    }
}

impl RemoteDma for ClientDma {
    fn read(&self, iova: u64, buf: &mut [u8]) -> Result<(), i32> {
        self.note_slow_path(iova, false);
        for (i, chunk) in buf.chunks_mut(self.max_xfer).enumerate() {
            let address = iova
                .checked_add((i * self.max_xfer) as u64)
                .ok_or(libc::EFAULT)?;
            let body = self.transact(&Request::DmaRead {
                address,
                count: chunk.len() as u64,
            })?;
            match decode_dma_reply(Command::DmaRead, &body) {
                Ok(Reply::DmaRead { address: a, data })
                    if a == address && data.len() == chunk.len() =>
                {
                    chunk.copy_from_slice(data);
                }
                _ => return Err(libc::EIO),
            }
        }
        Ok(())
    }

    fn write(&self, iova: u64, data: &[u8]) -> Result<(), i32> {
        self.note_slow_path(iova, true);
        for (i, chunk) in data.chunks(self.max_xfer).enumerate() {
            let address = iova
                .checked_add((i * self.max_xfer) as u64)
                .ok_or(libc::EFAULT)?;
            let body = self.transact(&Request::DmaWrite {
                address,
                data: chunk,
            })?;
            match decode_dma_reply(Command::DmaWrite, &body) {
                Ok(Reply::DmaWrite { count, .. }) if count == chunk.len() as u64 => {}
                _ => return Err(libc::EIO),
            }
        }
        Ok(())
    }
}

/// Decodes the body of a DMA_READ/DMA_WRITE reply that the connection thread stored (its
/// header was checked when it was read).
fn decode_dma_reply(cmd: Command, body: &[u8]) -> Result<Reply<'_>, ProtoError> {
    switchyard_proto::decode_reply_body(cmd, body, 0)
}

#[cfg(test)]
mod tests {
    use std::io::Read;
    use std::time::Duration;

    use super::*;

    /// A `ClientDma` on one end of a socket pair; the other end plays the client.
    fn pair(timeout: Duration) -> (Arc<ClientDma>, UnixStream) {
        let (ours, theirs) = UnixStream::pair().expect("socketpair");
        let cd = ClientDma::new(ours, Arc::new(Mutex::new(())), 4096, timeout);
        (Arc::new(cd), theirs)
    }

    /// Reads one request from the client's end; returns its id.
    fn take_request(s: &mut UnixStream) -> u16 {
        let mut h = [0u8; 16];
        s.read_exact(&mut h).expect("header");
        let size = u32::from_le_bytes([h[4], h[5], h[6], h[7]]) as usize;
        let mut body = vec![0u8; size - 16];
        s.read_exact(&mut body).expect("body");
        u16::from_le_bytes([h[0], h[1]])
    }

    #[test]
    fn a_hold_cancels_waits_at_once_and_late_replies_are_recognised() {
        let (cd, mut client) = pair(Duration::from_secs(30));
        let engine = {
            let cd = cd.clone();
            std::thread::spawn(move || {
                let t = Instant::now();
                let mut b = [0u8; 8];
                (cd.read(0x1000, &mut b), t.elapsed())
            })
        };
        let id = take_request(&mut client);
        cd.hold();
        let (r, took) = engine.join().expect("engine");
        assert_eq!(r, Err(libc::ECANCELED));
        assert!(took < Duration::from_secs(5), "{took:?}");
        // New requests fail without being sent while held.
        let mut b = [0u8; 8];
        assert_eq!(cd.read(0x1000, &mut b), Err(libc::ECANCELED));
        assert_eq!(cd.complete(id, || Ok(Vec::new())), Routed::Late);
        assert_eq!(cd.complete(id ^ 1, || Ok(Vec::new())), Routed::Unsolicited);
        cd.release();
        // Released: requests go out again and their replies are delivered (positive control).
        let engine = {
            let cd = cd.clone();
            std::thread::spawn(move || cd.read(0x1000, &mut [0u8; 8]))
        };
        let id = take_request(&mut client);
        assert_eq!(cd.complete(id, || Err(libc::EFAULT)), Routed::Delivered);
        assert_eq!(engine.join().expect("engine"), Err(libc::EFAULT));
        // A request that timed out: its reply is late, not unsolicited.
        let (cd, mut client) = pair(Duration::from_millis(50));
        let mut b = [0u8; 8];
        assert_eq!(cd.read(0x1000, &mut b), Err(libc::ETIMEDOUT));
        let id = take_request(&mut client);
        assert_eq!(cd.complete(id, || Ok(Vec::new())), Routed::Late);
    }
}
