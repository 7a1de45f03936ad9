//! Floors: the cheapest way to do the same thing with no vfio-user in between, measured in the
//! same process and run as the case they normalize.
//!
//! * [`Echo`]: an AF_UNIX stream ping-pong between two threads with exactly the byte counts of
//!   a vfio-user request and its reply; the echo side either blocks in `read` or polls with
//!   non-blocking reads for a bounded time first (the same policy as the server's adaptive
//!   polling).
//! * [`PostedStream`]: `n` one-way messages of the posted-write size followed by one
//!   request/reply barrier, the receiver draining the socket into a large buffer.
//! * [`EventfdWake`]: one thread signals an eventfd another thread waits on with `poll`; the
//!   sample is the time from just before the `write` to just after `poll` returns.
//! * [`RoundTripThenWake`]: an [`Echo`] round trip, then an [`EventfdWake`]; the sample is the
//!   sum of the two (the floor of "doorbell sent → interrupt eventfd readable").
//! * [`Watcher`]: a helper thread that polls a shared word for a bounded time after each
//!   request, then sleeps until the requester unparks it (the policy of an engine watching a
//!   mapped doorbell, at no protocol cost); it answers by a store the requester spins on (the
//!   floor of "tail stored → FENCE value seen"), or ([`Watcher::then_wake`]) by an eventfd
//!   write once the requester has surely gone to sleep in `poll`, the delay subtracted (the
//!   floor of "tail stored → interrupt eventfd readable" for a client that blocks: one
//!   wake-up of a blocked thread by a thread on another CPU).
//! * [`Memcpy`]: a single-thread `copy_from_slice` between two pre-faulted buffers.
//! * [`Memcpy2`]: the same copy split over two threads, the calling one and a helper woken
//!   per copy (the floor of a COPY split over two queues).
//! * [`BitmapScan`]: reading and clearing a dirty bitmap of a given size into an output buffer,
//!   one plain load and store per word (the floor of a `DMA_LOGGING_REPORT`).
//! * [`WireScan`]: the same scan on a server thread answering a request of a report's size
//!   with a reply of a report's size over AF_UNIX (what a report costs with nothing but the
//!   scan and the transfer).

use std::io::{self, Read, Write};
use std::net::Shutdown;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use rustix::event::{EventfdFlags, PollFd, PollFlags, Timespec};

/// Waits until `fd` is readable (blocking `poll`, retried on `EINTR`); with a `timeout`, fails
/// with [`io::ErrorKind::TimedOut`] once it has passed (so a stalled server fails a run instead
/// of hanging it).
pub fn wait_readable(fd: impl AsFd, timeout: Option<Duration>) -> io::Result<()> {
    let deadline = timeout.map(|t| Instant::now() + t);
    loop {
        let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
        let ts = left
            .map(Timespec::try_from)
            .transpose()
            .map_err(io::Error::other)?;
        let mut pfd = [PollFd::new(&fd, PollFlags::IN)];
        match rustix::event::poll(&mut pfd, ts.as_ref()) {
            Ok(0) if deadline.is_some() => {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("not readable within {timeout:?}"),
                ));
            }
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

fn wait_writable(fd: impl AsFd) -> io::Result<()> {
    loop {
        let mut pfd = [PollFd::new(&fd, PollFlags::OUT)];
        match rustix::event::poll(&mut pfd, None) {
            Ok(_) => return Ok(()),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reads exactly `buf.len()` bytes; on a non-blocking socket polls with reads until `spin`
/// has passed, then waits in `poll` (at most `stall` at a time). `Ok(false)` on EOF before the
/// first byte.
fn read_exact_spin(
    s: &UnixStream,
    buf: &mut [u8],
    spin: Duration,
    stall: Option<Duration>,
) -> io::Result<bool> {
    let deadline = Instant::now() + spin;
    let mut got = 0;
    while got < buf.len() {
        let part = buf.get_mut(got..).unwrap_or_default();
        match (&*s).read(part) {
            Ok(0) if got == 0 => return Ok(false),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                if Instant::now() < deadline {
                    std::hint::spin_loop();
                } else {
                    wait_readable(s, stall)?;
                }
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// `write_all` that also works on a non-blocking socket.
fn write_all_nb(s: &UnixStream, data: &[u8]) -> io::Result<()> {
    let mut sent = 0;
    while sent < data.len() {
        let part = data.get(sent..).unwrap_or_default();
        match (&*s).write(part) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => sent += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => wait_writable(s)?,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// AF_UNIX stream ping-pong: `req_len` bytes one way, `reply_len` bytes back.
#[derive(Debug)]
pub struct Echo {
    stream: UnixStream,
    req: Vec<u8>,
    reply: Vec<u8>,
    /// `Some(stall)`: the client side polls for the reply, waiting in `poll` at most `stall`.
    client_polls: Option<Option<Duration>>,
    thread: Option<JoinHandle<()>>,
}

impl Echo {
    /// Starts the echo thread. With a non-zero `spin` the echo side polls with non-blocking
    /// reads for up to `spin` before it blocks.
    pub fn start(req_len: usize, reply_len: usize, spin: Duration) -> Result<Echo> {
        let (a, b) = UnixStream::pair().context("socketpair")?;
        let thread = Self::spawn(b, req_len, vec![0xa5; reply_len], spin)?;
        Ok(Echo {
            stream: a,
            req: vec![0x5a; req_len],
            reply: vec![0; reply_len],
            client_polls: None,
            thread: Some(thread),
        })
    }

    /// A minimal fake vfio-user server on `stream`: answers every `req_len`-byte request with
    /// `reply` after copying the request's message id into it (for decomposition: our client
    /// against a server that does nothing).
    pub fn fake_server(
        stream: UnixStream,
        req_len: usize,
        reply: Vec<u8>,
    ) -> Result<JoinHandle<()>> {
        Self::spawn(stream, req_len, reply, Duration::ZERO)
    }

    fn spawn(
        b: UnixStream,
        req_len: usize,
        reply: Vec<u8>,
        spin: Duration,
    ) -> Result<JoinHandle<()>> {
        std::thread::Builder::new()
            .name("floor-echo".into())
            .spawn(move || {
                crate::pin::helper();
                let _ = echo_loop(&b, req_len, reply, spin);
            })
            .context("spawn echo thread")
    }

    /// Wraps an already connected stream (e.g. a negotiated vfio-user connection) and a
    /// pre-encoded request: a raw client with no codec.
    pub fn raw_client(stream: UnixStream, req: Vec<u8>, reply_len: usize) -> Echo {
        Echo {
            stream,
            req,
            reply: vec![0; reply_len],
            client_polls: None,
            thread: None,
        }
    }

    /// Makes the client side poll for the reply with non-blocking reads instead of blocking
    /// (both sides then spin; on the wrapped stream of [`Echo::raw_client`] this changes the
    /// shared file description, so that connection must not be used by anything else). After
    /// 1 s of polling it waits in `poll`, failing after `stall` (if given).
    pub fn client_polls(mut self, stall: Option<Duration>) -> Result<Echo> {
        self.stream.set_nonblocking(true)?;
        self.client_polls = Some(stall);
        Ok(self)
    }

    /// One timed round trip.
    pub fn round_trip(&mut self) -> Result<Duration> {
        let t0 = Instant::now();
        if let Some(stall) = self.client_polls {
            write_all_nb(&self.stream, &self.req)?;
            if !read_exact_spin(&self.stream, &mut self.reply, Duration::from_secs(1), stall)? {
                anyhow::bail!("peer closed");
            }
            return Ok(t0.elapsed());
        }
        (&self.stream).write_all(&self.req)?;
        (&self.stream).read_exact(&mut self.reply)?;
        Ok(t0.elapsed())
    }
}

fn echo_loop(s: &UnixStream, req_len: usize, mut reply: Vec<u8>, spin: Duration) -> io::Result<()> {
    let mut req = vec![0u8; req_len];
    if !spin.is_zero() {
        s.set_nonblocking(true)?;
    }
    while read_exact_spin(s, &mut req, spin, None)? {
        // Message id (first two bytes of the header) echoed, for the fake server.
        if let (Some(dst), Some(src)) = (reply.get_mut(..2), req.get(..2)) {
            dst.copy_from_slice(src);
        }
        write_all_nb(s, &reply)?;
    }
    Ok(())
}

impl Drop for Echo {
    fn drop(&mut self) {
        if self.thread.is_none() {
            return;
        }
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `n` one-way messages of `msg_len` bytes, then a `barrier_len`/`reply_len` round trip.
#[derive(Debug)]
pub struct PostedStream {
    stream: UnixStream,
    msg: Vec<u8>,
    barrier: Vec<u8>,
    reply: Vec<u8>,
    n: usize,
    thread: Option<JoinHandle<()>>,
}

impl PostedStream {
    /// Starts the receiver thread.
    pub fn start(
        n: usize,
        msg_len: usize,
        barrier_len: usize,
        reply_len: usize,
    ) -> Result<PostedStream> {
        let (a, b) = UnixStream::pair().context("socketpair")?;
        let batch = n * msg_len + barrier_len;
        let thread = std::thread::Builder::new()
            .name("floor-posted".into())
            .spawn(move || {
                crate::pin::helper();
                let _ = drain_loop(&b, batch, reply_len);
            })
            .context("spawn receiver thread")?;
        Ok(PostedStream {
            stream: a,
            msg: vec![0x5a; msg_len],
            barrier: vec![0x5b; barrier_len],
            reply: vec![0; reply_len],
            n,
            thread: Some(thread),
        })
    }

    /// One timed batch: `n` sends, the barrier and its reply.
    pub fn batch(&mut self) -> Result<Duration> {
        let t0 = Instant::now();
        for _ in 0..self.n {
            (&self.stream).write_all(&self.msg)?;
        }
        (&self.stream).write_all(&self.barrier)?;
        (&self.stream).read_exact(&mut self.reply)?;
        Ok(t0.elapsed())
    }
}

/// Reads into a 1 MiB buffer (like the server's connection buffer) and answers every `batch`
/// bytes with `reply_len` bytes.
fn drain_loop(s: &UnixStream, batch: usize, reply_len: usize) -> io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    let reply = vec![0xa5u8; reply_len];
    let mut have = 0usize;
    loop {
        let n = match (&*s).read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        have += n;
        while have >= batch {
            have -= batch;
            write_all_nb(s, &reply)?;
        }
    }
}

impl Drop for PostedStream {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn efd_write(fd: &OwnedFd) -> io::Result<()> {
    rustix::io::write(fd, &1u64.to_ne_bytes())?;
    Ok(())
}

fn efd_read(fd: &OwnedFd) -> io::Result<u64> {
    let mut b = [0u8; 8];
    rustix::io::read(fd, &mut b)?;
    Ok(u64::from_ne_bytes(b))
}

/// Eventfd wake-up latency: signal → the waiting thread's `poll` returns.
#[derive(Debug)]
pub struct EventfdWake {
    ping: Arc<OwnedFd>,
    pong: Arc<OwnedFd>,
    base: Instant,
    t0: Arc<AtomicU64>,
    last: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EventfdWake {
    /// Starts the waiting thread.
    pub fn start() -> Result<EventfdWake> {
        let ping = Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC)?);
        let pong = Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC)?);
        let base = Instant::now();
        let t0 = Arc::new(AtomicU64::new(0));
        let last = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (p, q, t, l, st) = (
            ping.clone(),
            pong.clone(),
            t0.clone(),
            last.clone(),
            stop.clone(),
        );
        let thread = std::thread::Builder::new()
            .name("floor-eventfd".into())
            .spawn(move || {
                crate::pin::helper();
                loop {
                    if wait_readable(&*p, None).is_err() {
                        return;
                    }
                    let t1 = crate::stats::ns(base.elapsed());
                    if efd_read(&p).is_err() || st.load(Ordering::Acquire) {
                        return;
                    }
                    l.store(
                        t1.saturating_sub(t.load(Ordering::Acquire)),
                        Ordering::Release,
                    );
                    if efd_write(&q).is_err() {
                        return;
                    }
                }
            })
            .context("spawn eventfd thread")?;
        Ok(EventfdWake {
            ping,
            pong,
            base,
            t0,
            last,
            stop,
            thread: Some(thread),
        })
    }

    /// One sample: the one-way wake-up time measured by the waiter.
    pub fn one_way(&mut self) -> Result<Duration> {
        self.t0
            .store(crate::stats::ns(self.base.elapsed()), Ordering::Release);
        efd_write(&self.ping)?;
        wait_readable(&*self.pong, None)?;
        efd_read(&self.pong)?;
        Ok(Duration::from_nanos(self.last.load(Ordering::Acquire)))
    }
}

impl Drop for EventfdWake {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        let _ = efd_write(&self.ping);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A request/reply ping-pong followed by an eventfd wake-up of another thread: the least that
/// "send a request, get its reply, then be woken by an interrupt eventfd" can cost.
#[derive(Debug)]
pub struct RoundTripThenWake {
    echo: Echo,
    wake: EventfdWake,
}

impl RoundTripThenWake {
    /// An [`Echo`] of `req_len`/`reply_len` bytes (echo side spinning for `spin`) and an
    /// [`EventfdWake`].
    pub fn start(req_len: usize, reply_len: usize, spin: Duration) -> Result<RoundTripThenWake> {
        Ok(RoundTripThenWake {
            echo: Echo::start(req_len, reply_len, spin)?,
            wake: EventfdWake::start()?,
        })
    }

    /// One sample: the round trip plus the one-way wake-up, taken back to back.
    pub fn once(&mut self) -> Result<Duration> {
        let rt = self.echo.round_trip()?;
        Ok(rt + self.wake.one_way()?)
    }
}

/// Single-thread memcpy between two pre-faulted buffers.
#[derive(Debug)]
pub struct Memcpy {
    src: Vec<u8>,
    dst: Vec<u8>,
}

impl Memcpy {
    /// Buffers for copies up to `max` bytes.
    pub fn new(max: usize) -> Memcpy {
        let src: Vec<u8> = (0..max).map(|i| (i * 7 + 3) as u8).collect();
        Memcpy {
            src,
            dst: vec![1u8; max],
        }
    }

    /// Copies `len` bytes once; returns the time.
    pub fn copy(&mut self, len: usize) -> Result<Duration> {
        let (Some(src), Some(dst)) = (self.src.get(..len), self.dst.get_mut(..len)) else {
            anyhow::bail!("memcpy of {len} bytes exceeds the buffers");
        };
        let t0 = Instant::now();
        dst.copy_from_slice(std::hint::black_box(src));
        std::hint::black_box(&dst);
        Ok(t0.elapsed())
    }
}

/// A dirty bitmap (64-bit atomic words, like a device's log) shared by a floor and whoever
/// sets its bits.
#[derive(Debug, Clone)]
pub struct SharedBitmap(Arc<[AtomicU64]>);

impl SharedBitmap {
    /// A clean bitmap of `words` words.
    pub fn new(words: usize) -> SharedBitmap {
        SharedBitmap((0..words).map(|_| AtomicU64::new(0)).collect())
    }

    /// Sets the bits of `pages`.
    pub fn set(&self, pages: &[u64]) {
        for &p in pages {
            if let Some(w) = self.0.get((p / 64) as usize) {
                w.fetch_or(1 << (p % 64), Ordering::Relaxed);
            }
        }
    }

    /// Reads and clears every word into `out` (plain loads and stores: the scan no report can
    /// avoid).
    fn drain(&self, out: &mut [u8]) {
        for (w, o) in self.0.iter().zip(out.chunks_exact_mut(8)) {
            let v = w.load(Ordering::Relaxed);
            w.store(0, Ordering::Relaxed);
            o.copy_from_slice(&v.to_ne_bytes());
        }
    }
}

/// Reading and clearing a dirty bitmap into an output buffer.
#[derive(Debug)]
pub struct BitmapScan {
    map: SharedBitmap,
    out: Vec<u8>,
}

impl BitmapScan {
    /// A scan of `map` into a pre-faulted buffer.
    pub fn new(map: SharedBitmap) -> BitmapScan {
        let out = vec![1u8; map.0.len() * 8];
        BitmapScan { map, out }
    }

    /// One timed scan; returns the time.
    pub fn scan(&mut self) -> Duration {
        let t0 = Instant::now();
        self.map.drain(&mut self.out);
        std::hint::black_box(&self.out);
        t0.elapsed()
    }
}

/// A request/reply over AF_UNIX where the replying thread scans a [`SharedBitmap`] into its
/// reply: `req_len` bytes out, `head_len` + bitmap bytes back.
#[derive(Debug)]
pub struct WireScan {
    stream: UnixStream,
    req: Vec<u8>,
    reply: Vec<u8>,
    thread: Option<JoinHandle<()>>,
}

impl WireScan {
    /// Starts the replying thread.
    pub fn start(map: SharedBitmap, req_len: usize, head_len: usize) -> Result<WireScan> {
        let (a, b) = UnixStream::pair().context("socketpair")?;
        let reply_len = head_len + map.0.len() * 8;
        let thread = std::thread::Builder::new()
            .name("floor-wire-scan".into())
            .spawn(move || {
                crate::pin::helper();
                let mut req = vec![0u8; req_len];
                let mut reply = vec![0u8; reply_len];
                while matches!(
                    read_exact_spin(&b, &mut req, Duration::ZERO, None),
                    Ok(true)
                ) {
                    if let Some(bits) = reply.get_mut(head_len..) {
                        map.drain(bits);
                    }
                    if (&b).write_all(&reply).is_err() {
                        return;
                    }
                }
            })
            .context("spawn wire-scan thread")?;
        Ok(WireScan {
            stream: a,
            req: vec![0x5a; req_len],
            reply: vec![1u8; reply_len],
            thread: Some(thread),
        })
    }

    /// One timed request/reply.
    pub fn report(&mut self) -> Result<Duration> {
        let t0 = Instant::now();
        (&self.stream).write_all(&self.req)?;
        (&self.stream).read_exact(&mut self.reply)?;
        Ok(t0.elapsed())
    }
}

impl Drop for WireScan {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Memcpy split over two threads: the calling thread copies the first half while a helper
/// thread, woken through a channel, copies the second half between its own pre-faulted
/// buffers; the sample ends when both are done.
#[derive(Debug)]
pub struct Memcpy2 {
    own: Memcpy,
    work: Option<mpsc::Sender<usize>>,
    done: mpsc::Receiver<Result<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Memcpy2 {
    /// Buffers for copies up to `max` bytes (half on each thread) and the helper thread.
    pub fn new(max: usize) -> Result<Memcpy2> {
        let (work, jobs) = mpsc::channel::<usize>();
        let (finished, done) = mpsc::channel();
        let theirs = max - max / 2;
        let thread = std::thread::Builder::new()
            .name("floor-memcpy".into())
            .spawn(move || {
                crate::pin::helper();
                let mut m = Memcpy::new(theirs);
                while let Ok(len) = jobs.recv() {
                    if finished.send(m.copy(len).map(drop)).is_err() {
                        return;
                    }
                }
            })
            .context("spawn memcpy thread")?;
        Ok(Memcpy2 {
            own: Memcpy::new(max / 2),
            work: Some(work),
            done,
            thread: Some(thread),
        })
    }

    /// Copies `len` bytes once, `len / 2` here and the rest on the helper; returns the time.
    pub fn copy(&mut self, len: usize) -> Result<Duration> {
        let Some(work) = &self.work else {
            anyhow::bail!("memcpy thread gone");
        };
        let mine = len / 2;
        let t0 = Instant::now();
        work.send(len - mine).context("memcpy thread gone")?;
        let own = self.own.copy(mine);
        // Always collect the helper's answer, so an error leaves no stale one behind.
        let theirs = self.done.recv().context("memcpy thread gone")?;
        let d = t0.elapsed();
        own?;
        theirs?;
        Ok(d)
    }
}

impl Drop for Memcpy2 {
    fn drop(&mut self) {
        drop(self.work.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn floors_run() {
        let mut e = Echo::start(32, 36, Duration::ZERO).expect("echo");
        e.round_trip().expect("rt");
        let mut s = Echo::start(36, 32, Duration::from_micros(50)).expect("spin echo");
        s.round_trip().expect("rt");
        let mut p = PostedStream::start(10, 36, 32, 36).expect("posted");
        p.batch().expect("batch");
        p.batch().expect("batch");
        let mut w = EventfdWake::start().expect("eventfd");
        w.one_way().expect("one way");
        let mut m = Memcpy::new(4096);
        m.copy(4096).expect("copy");
        assert!(m.copy(8192).is_err());
        let mut m2 = Memcpy2::new(4097).expect("memcpy2");
        m2.copy(4097).expect("copy");
        m2.copy(0).expect("copy nothing");
        assert!(m2.copy(8192).is_err());
        m2.copy(4096).expect("still usable after an error");
        let map = SharedBitmap::new(3);
        map.set(&[0, 65, 191, 192]);
        let mut scan = BitmapScan::new(map.clone());
        scan.scan();
        assert_eq!(scan.out[..8], 1u64.to_ne_bytes());
        assert_eq!(scan.out[8..16], 2u64.to_ne_bytes());
        assert_eq!(scan.out[16..], (1u64 << 63).to_ne_bytes());
        scan.scan();
        assert!(scan.out.iter().all(|&b| b == 0), "a scan clears");
        let mut wire = WireScan::start(map.clone(), 48, 48).expect("wire scan");
        map.set(&[3]);
        wire.report().expect("report");
        assert_eq!(wire.reply.len(), 48 + 24);
        assert_eq!(wire.reply[48..56], 8u64.to_ne_bytes());
        let mut i = RoundTripThenWake::start(36, 16, Duration::ZERO).expect("irq floor");
        i.once().expect("once");
        let (a, _b) = UnixStream::pair().expect("pair");
        let t = Some(Duration::from_millis(20));
        let e = wait_readable(&a, t).expect_err("nothing to read");
        assert_eq!(e.kind(), io::ErrorKind::TimedOut);
    }
}

/// What a [`Watcher`] and its requester share.
#[derive(Debug, Default)]
struct Watched {
    req: AtomicU64,
    ack: AtomicU64,
    sleeping: AtomicBool,
    stop: AtomicBool,
}

/// A thread watching a shared word the way an engine watches a mapped doorbell: it polls for
/// `budget` after each request, then announces that it sleeps, looks once more and parks;
/// a requester that sees the announcement unparks it (the kick). It answers each request by
/// storing its number into `ack` (and, for [`Watcher::then_wake`], an eventfd write).
#[derive(Debug)]
pub struct Watcher {
    shared: Arc<Watched>,
    /// The eventfd and the delay before its write.
    wake: Option<(Arc<OwnedFd>, Duration)>,
    seq: u64,
    thread: Option<JoinHandle<()>>,
}

impl Watcher {
    /// A watcher answering by a store the requester spins on.
    pub fn ping_pong(budget: Duration) -> Result<Watcher> {
        Self::start(budget, None)
    }

    /// A watcher answering by an eventfd write `delay` after it saw the request (long enough
    /// for the requester to be asleep in `poll`); [`Watcher::once`] subtracts the delay.
    pub fn then_wake(budget: Duration, delay: Duration) -> Result<Watcher> {
        let efd = Arc::new(rustix::event::eventfd(0, EventfdFlags::CLOEXEC)?);
        Self::start(budget, Some((efd, delay)))
    }

    fn start(budget: Duration, wake: Option<(Arc<OwnedFd>, Duration)>) -> Result<Watcher> {
        let shared = Arc::new(Watched::default());
        let (sh, wk) = (shared.clone(), wake.clone());
        let thread = std::thread::Builder::new()
            .name("floor-watcher".into())
            .spawn(move || {
                crate::pin::helper();
                let mut seen = 0u64;
                loop {
                    let deadline = Instant::now() + budget;
                    let mut req = sh.req.load(Ordering::Acquire);
                    while req == seen && Instant::now() < deadline {
                        std::hint::spin_loop();
                        req = sh.req.load(Ordering::Acquire);
                    }
                    if req == seen {
                        sh.sleeping.store(true, Ordering::SeqCst);
                        std::sync::atomic::fence(Ordering::SeqCst);
                        if sh.req.load(Ordering::SeqCst) == seen {
                            std::thread::park();
                        }
                        sh.sleeping.store(false, Ordering::SeqCst);
                        if sh.stop.load(Ordering::Acquire) {
                            return;
                        }
                        continue;
                    }
                    seen = req;
                    if let Some((efd, delay)) = &wk {
                        let at = Instant::now() + *delay;
                        while Instant::now() < at {
                            std::hint::spin_loop();
                        }
                        if efd_write(efd).is_err() {
                            return;
                        }
                    }
                    sh.ack.store(req, Ordering::Release);
                }
            })
            .context("spawn the watcher thread")?;
        Ok(Watcher {
            shared,
            wake,
            seq: 0,
            thread: Some(thread),
        })
    }

    fn request(&mut self) -> u64 {
        self.seq += 1;
        self.shared.req.store(self.seq, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        if self.shared.sleeping.load(Ordering::SeqCst)
            && let Some(t) = &self.thread
        {
            t.thread().unpark();
        }
        self.seq
    }

    /// One sample: the request stored → its answer seen (spinning), or for
    /// [`Watcher::then_wake`] → `poll` on the eventfd returning, less the delay.
    pub fn once(&mut self) -> Result<Duration> {
        let t0 = Instant::now();
        let n = self.request();
        if let Some((efd, delay)) = self.wake.clone() {
            wait_readable(&*efd, Some(Duration::from_secs(30)))?;
            let elapsed = t0.elapsed();
            efd_read(&efd)?;
            return Ok(elapsed.saturating_sub(delay));
        }
        while self.shared.ack.load(Ordering::Acquire) != n {
            std::hint::spin_loop();
        }
        Ok(t0.elapsed())
    }
}

impl Drop for Watcher {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            t.thread().unpark();
            let _ = t.join();
        }
    }
}
