//! Server→client DMA: accesses to windows the client mapped without a file descriptor become
//! `DMA_READ` / `DMA_WRITE` commands on the connection socket. The engine thread that needs the
//! data sends the command (serialised with the connection thread's replies by a send lock) and
//! waits; the connection thread, which keeps reading the socket, routes the client's reply back
//! by message id.

use std::collections::{HashMap, HashSet};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use switchyard_device::RemoteDma;
use switchyard_proto::{Command, ProtoError, Reply, Request};

use crate::transport::{SendLimit, send_bounded};

/// The outcome of one server→client request: the reply body or an errno.
type Outcome = Result<Vec<u8>, i32>;

#[derive(Default)]
struct Waiters {
    done: HashMap<u16, Outcome>,
    waiting: HashSet<u16>,
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

    /// Hands a reply received by the connection thread to the waiting engine. Returns `false`
    /// if nobody waits for that id (an unsolicited reply).
    pub(crate) fn complete(&self, msg_id: u16, outcome: Outcome) -> bool {
        let mut w = self.waiters.lock().unwrap_or_else(|p| p.into_inner());
        if !w.waiting.remove(&msg_id) {
            return false;
        }
        w.done.insert(msg_id, outcome);
        self.cond.notify_all();
        true
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
        self.waiters
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .waiting
            .insert(id);
        {
            let _g = self.send_lock.lock().unwrap_or_else(|p| p.into_inner());
            let limit = SendLimit {
                timeout: self.timeout,
                abort: None,
            };
            if let Err(e) = send_bounded(&self.stream, &buf, &[], Some(limit)) {
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
