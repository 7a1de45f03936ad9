//! Interrupts as eventfds, in the device's two interrupt modes, behind one
//! [`InterruptSource`]:
//!
//! - **MSI-X** ([`Msix`]): 16 vectors, one eventfd each. An event is recognised by the vector
//!   it arrives on; the handler then reads and acknowledges `INT_STATUS` (for the record).
//! - **MSI** ([`Msi`]): one vector, one eventfd, for every source. The handler demultiplexes:
//!   on each signal it reads `INT_STATUS`, acknowledges exactly the bits it read (`INT_ACK`,
//!   write 1 to clear), reads again until nothing new is latched, and turns the bits into
//!   pending events (bit q: queue q completed, bit 16+q: queue q stopped on an error).
//!
//! - **Polled** ([`Polled`], the no-IOMMU mode: without VFIO no interrupt reaches user space):
//!   no eventfd. The waiter reads `INT_STATUS` itself, with a growing pause between reads (20 µs
//!   to 1 ms), and demultiplexes the bits exactly as the MSI handler does. The device latches
//!   `INT_STATUS` whether or not MSI-X/MSI is enabled, so every completion and error is seen.
//!
//! With MSI-X and MSI, waiting blocks in `epoll_wait` on the eventfds. `INT_STATUS` is read
//! only in response to a signal, never polled. MSI is edge-triggered (one message per raise, even when the bit is
//! already latched), so a raise that lands after the handler's last read still has its own
//! message on the way and wakes the next wait: nothing is lost, at worst a message finds
//! `INT_STATUS` already empty (counted as `empty`).

use std::time::Instant;

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EFD_NONBLOCK, EventFd};

use crate::mmio::BarMap;
use crate::regs::{
    CAP_MSI, CAP_MSIX, INT_ACK, INT_STATUS, MSIX_VECTORS, int_completion, int_error,
};

/// Why a wait ended without the interrupt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WaitError {
    /// The deadline passed.
    Timeout,
    /// `epoll_wait` or an eventfd read failed.
    Io(String),
}

impl std::fmt::Display for WaitError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WaitError::Timeout => write!(f, "timeout"),
            WaitError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// The device's interrupt mode, as its capability list shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqMode {
    /// MSI-X capability (0x11): 16 vectors, routed per queue and per FENCE.
    Msix,
    /// MSI capability (0x05) and no MSI-X: one vector for every source.
    Msi,
}

impl IrqMode {
    /// MSI-X if the list has an MSI-X capability, else MSI if it has an MSI capability.
    pub fn detect(cap_ids: &[u8]) -> Result<IrqMode, String> {
        if cap_ids.contains(&CAP_MSIX) {
            Ok(IrqMode::Msix)
        } else if cap_ids.contains(&CAP_MSI) {
            Ok(IrqMode::Msi)
        } else {
            Err(format!(
                "neither an MSI-X ({CAP_MSIX:#04x}) nor an MSI ({CAP_MSI:#04x}) capability: {cap_ids:02x?}"
            ))
        }
    }

    /// `"msix"` or `"msi"` (the summary's `irq_mode`).
    pub fn name(self) -> &'static str {
        match self {
            IrqMode::Msix => "msix",
            IrqMode::Msi => "msi",
        }
    }

    /// Human name for logs.
    pub fn label(self) -> &'static str {
        match self {
            IrqMode::Msix => "MSI-X",
            IrqMode::Msi => "MSI",
        }
    }

    /// Eventfds (vectors) the driver routes.
    pub fn vectors(self) -> u32 {
        match self {
            IrqMode::Msix => MSIX_VECTORS,
            IrqMode::Msi => 1,
        }
    }

    /// What the `MSIX_VECTOR_COUNT` register reads in this mode.
    pub fn msix_vector_count(self) -> u32 {
        match self {
            IrqMode::Msix => MSIX_VECTORS,
            IrqMode::Msi => 0,
        }
    }

    /// The capability that carries this mode.
    pub fn capability(self) -> u8 {
        match self {
            IrqMode::Msix => CAP_MSIX,
            IrqMode::Msi => CAP_MSI,
        }
    }
}

/// How events reach the driver: the device's interrupt mode through VFIO eventfds, or nothing
/// at all (no VFIO): `INT_STATUS` polled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Delivery {
    /// MSI-X vectors, one eventfd each.
    Msix,
    /// The MSI vector, one eventfd.
    Msi,
    /// No interrupts: the waiter polls `INT_STATUS`.
    Polled,
}

impl Delivery {
    /// Human name for logs.
    pub fn label(self) -> &'static str {
        match self {
            Delivery::Msix => "MSI-X",
            Delivery::Msi => "MSI",
            Delivery::Polled => "polled INT_STATUS",
        }
    }
}

/// Something a waiter waits for. Each carries both routings: the MSI-X vector the device sends
/// it on, and (through its queue) the `INT_STATUS` bit that names it in MSI mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// Queue `queue` completed a command with IRQ (or an interrupting FENCE), sent on MSI-X
    /// `vector` (the queue's completion vector, or the FENCE's own vector).
    Completion {
        /// Queue.
        queue: u32,
        /// MSI-X vector.
        vector: u32,
    },
    /// Queue `queue` stopped on an error, sent on MSI-X `vector` (its error vector).
    Error {
        /// Queue.
        queue: u32,
        /// MSI-X vector.
        vector: u32,
    },
}

impl Event {
    /// The queue.
    pub fn queue(self) -> u32 {
        match self {
            Event::Completion { queue, .. } | Event::Error { queue, .. } => queue,
        }
    }

    /// The MSI-X vector.
    pub fn msix_vector(self) -> u32 {
        match self {
            Event::Completion { vector, .. } | Event::Error { vector, .. } => vector,
        }
    }

    /// The `INT_STATUS` bit of the event's source.
    pub fn status_bit(self) -> u32 {
        match self {
            Event::Completion { queue, .. } => int_completion(queue),
            Event::Error { queue, .. } => int_error(queue),
        }
    }
}

/// The interrupt status registers (BAR0 `INT_STATUS`, `INT_ACK`): all the interrupt handler
/// touches.
pub trait IntRegs {
    /// Reads `INT_STATUS`.
    fn int_status(&self) -> u32;
    /// Writes `bits` to `INT_ACK` (write 1 to clear).
    fn int_ack(&self, bits: u32);
}

impl IntRegs for BarMap {
    fn int_status(&self) -> u32 {
        self.r32(INT_STATUS)
    }

    fn int_ack(&self, bits: u32) {
        self.w32(INT_ACK, bits)
    }
}

/// Reads `INT_STATUS` and acknowledges exactly what it read, again until it reads 0 (bits
/// raised between a read and its ack stay latched and are picked up by the next read); returns
/// the union. Bounded, in case a source keeps raising.
fn drain_status(regs: &(impl IntRegs + ?Sized)) -> u32 {
    let mut all = 0;
    for _ in 0..8 {
        let st = regs.int_status();
        if st == 0 {
            break;
        }
        regs.int_ack(st);
        all |= st;
    }
    all
}

/// Counts each bit of `st` in `pending` (one entry per `INT_STATUS` bit).
fn record_status(pending: &mut [u64], st: u32) {
    for (bit, p) in pending.iter_mut().enumerate() {
        if st & (1 << bit) != 0 {
            *p += 1;
        }
    }
}

/// Consumes the pending `INT_STATUS` bit of the first of `events` that has one.
fn take_by_status_bit(pending: &mut [u64], events: &[Event]) -> Option<Event> {
    events.iter().copied().find(|ev| {
        let p = &mut pending[ev.status_bit().trailing_zeros() as usize];
        if *p > 0 {
            *p = 0;
            true
        } else {
            false
        }
    })
}

/// Non-blocking eventfds in one epoll set, with the signals counted per eventfd.
#[derive(Debug)]
struct EventFds {
    fds: Vec<EventFd>,
    epoll: Epoll,
    counts: Vec<u64>,
}

impl EventFds {
    fn new(n: usize) -> std::io::Result<EventFds> {
        let epoll = Epoll::new()?;
        let mut fds = Vec::with_capacity(n);
        for v in 0..n {
            let fd = EventFd::new(EFD_NONBLOCK)?;
            epoll.ctl(
                ControlOperation::Add,
                std::os::fd::AsRawFd::as_raw_fd(&fd),
                EpollEvent::new(EventSet::IN, v as u64),
            )?;
            fds.push(fd);
        }
        Ok(EventFds {
            fds,
            epoll,
            counts: vec![0; n],
        })
    }

    /// Reads eventfd `i`: the signals since the last read (0 if none), also counted.
    fn read(&mut self, i: usize) -> Result<u64, WaitError> {
        match self.fds[i].read() {
            Ok(c) => {
                self.counts[i] += c;
                Ok(c)
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(WaitError::Io(format!("read eventfd of vector {i}: {e}"))),
        }
    }

    /// Blocks until an eventfd is readable or `deadline` passes; returns the readable ones
    /// (empty on an interrupted or timed-out wait). `Timeout` only if the deadline had passed
    /// already.
    fn block(&mut self, deadline: Instant) -> Result<Vec<usize>, WaitError> {
        let now = Instant::now();
        if now >= deadline {
            return Err(WaitError::Timeout);
        }
        let ms = (deadline - now).as_millis().clamp(1, i32::MAX as u128) as i32;
        let mut events = vec![EpollEvent::default(); self.fds.len().max(1)];
        let n = match self.epoll.wait(ms, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => 0,
            Err(e) => return Err(WaitError::Io(format!("epoll_wait: {e}"))),
        };
        Ok(events
            .iter()
            .take(n)
            .map(|ev| ev.data() as usize)
            .filter(|&i| i < self.fds.len())
            .collect())
    }
}

/// MSI-X: one eventfd per vector; an event is pending when its vector has been signalled.
#[derive(Debug)]
pub struct Msix {
    efds: EventFds,
    pending: Vec<u64>,
}

impl Msix {
    fn read(&mut self, v: usize) -> Result<(), WaitError> {
        let c = self.efds.read(v)?;
        self.pending[v] += c;
        Ok(())
    }

    /// Consumes the pending signals of the first of `events` whose vector has any.
    fn take(&mut self, events: &[Event]) -> Option<Event> {
        events
            .iter()
            .copied()
            .find(|ev| match self.pending.get_mut(ev.msix_vector() as usize) {
                Some(p) if *p > 0 => {
                    *p = 0;
                    true
                }
                _ => false,
            })
    }
}

/// MSI: one eventfd for every source; events come from the `INT_STATUS` bits the handler read
/// (and acknowledged) in response to signals.
#[derive(Debug)]
pub struct Msi {
    efd: EventFds,
    /// Per `INT_STATUS` bit: times the handler found it set and has not handed it to a waiter.
    pending: Vec<u64>,
    /// Signals whose handler found `INT_STATUS` empty (its bits were taken by an earlier read).
    empty: u64,
}

impl Msi {
    /// The interrupt handler: runs once per readable signal.
    fn read(&mut self, regs: &(impl IntRegs + ?Sized)) -> Result<u32, WaitError> {
        if self.efd.read(0)? == 0 {
            return Ok(0);
        }
        let st = drain_status(regs);
        if st == 0 {
            self.empty += 1;
        }
        record_status(&mut self.pending, st);
        Ok(st)
    }

    /// Consumes the pending status bit of the first of `events` that has one.
    fn take(&mut self, events: &[Event]) -> Option<Event> {
        take_by_status_bit(&mut self.pending, events)
    }
}

/// No interrupts (no VFIO, so none reaches user space): the waiter reads `INT_STATUS` itself
/// and demultiplexes it like the MSI handler. `count` is the number of reads that found bits.
#[derive(Debug)]
pub struct Polled {
    /// The device's own interrupt mode (its capability list), unused for delivery.
    device_mode: IrqMode,
    /// Per `INT_STATUS` bit: reads that found it set, not yet handed to a waiter.
    pending: Vec<u64>,
    /// Reads that found bits (the one entry of [`InterruptSource::counts`]).
    count: [u64; 1],
    /// `INT_STATUS` reads in total.
    reads: u64,
}

/// First pause between two `INT_STATUS` reads of a polled wait; it doubles up to
/// [`POLL_MAX_PAUSE`].
pub const POLL_FIRST_PAUSE: std::time::Duration = std::time::Duration::from_micros(20);
/// Longest pause between two `INT_STATUS` reads of a polled wait.
pub const POLL_MAX_PAUSE: std::time::Duration = std::time::Duration::from_millis(1);

impl Polled {
    /// One poll: reads and acknowledges `INT_STATUS` until it reads 0, records the bits.
    fn read(&mut self, regs: &(impl IntRegs + ?Sized)) -> u32 {
        self.reads += 1;
        let st = drain_status(regs);
        if st != 0 {
            self.count[0] += 1;
        }
        record_status(&mut self.pending, st);
        st
    }

    /// Consumes the pending status bit of the first of `events` that has one.
    fn take(&mut self, events: &[Event]) -> Option<Event> {
        take_by_status_bit(&mut self.pending, events)
    }
}

/// The device's interrupts in either mode.
#[derive(Debug)]
pub enum InterruptSource {
    /// One eventfd per MSI-X vector.
    Msix(Msix),
    /// One eventfd, demultiplexed through `INT_STATUS`.
    Msi(Msi),
    /// No eventfd: `INT_STATUS` polled by the waiter.
    Polled(Polled),
}

impl InterruptSource {
    /// The eventfds for `mode` ([`IrqMode::vectors`] of them), nothing pending.
    pub fn new(mode: IrqMode) -> std::io::Result<InterruptSource> {
        let n = mode.vectors() as usize;
        let efds = EventFds::new(n)?;
        Ok(match mode {
            IrqMode::Msix => InterruptSource::Msix(Msix {
                efds,
                pending: vec![0; n],
            }),
            IrqMode::Msi => InterruptSource::Msi(Msi {
                efd: efds,
                pending: vec![0; 32],
                empty: 0,
            }),
        })
    }

    /// Polled delivery for a device whose own interrupt mode is `device_mode`.
    pub fn polled(device_mode: IrqMode) -> InterruptSource {
        InterruptSource::Polled(Polled {
            device_mode,
            pending: vec![0; 32],
            count: [0],
            reads: 0,
        })
    }

    /// The device's interrupt mode (from its capability list; with polled delivery the mode
    /// it has but that is not used).
    pub fn mode(&self) -> IrqMode {
        match self {
            InterruptSource::Msix(_) => IrqMode::Msix,
            InterruptSource::Msi(_) => IrqMode::Msi,
            InterruptSource::Polled(p) => p.device_mode,
        }
    }

    /// How events reach the driver.
    pub fn delivery(&self) -> Delivery {
        match self {
            InterruptSource::Msix(_) => Delivery::Msix,
            InterruptSource::Msi(_) => Delivery::Msi,
            InterruptSource::Polled(_) => Delivery::Polled,
        }
    }

    /// `INT_STATUS` reads of polled waits (0 with interrupts).
    pub fn status_polls(&self) -> u64 {
        match self {
            InterruptSource::Polled(p) => p.reads,
            _ => 0,
        }
    }

    fn efds(&self) -> Option<&EventFds> {
        match self {
            InterruptSource::Msix(m) => Some(&m.efds),
            InterruptSource::Msi(m) => Some(&m.efd),
            InterruptSource::Polled(_) => None,
        }
    }

    /// The eventfds, vector order (for `VFIO_DEVICE_SET_IRQS`; none when polled).
    pub fn fds(&self) -> Vec<&EventFd> {
        self.efds()
            .map(|e| e.fds.iter().collect())
            .unwrap_or_default()
    }

    /// Signals received per vector (16 in MSI-X mode, 1 in MSI mode); polled: one entry, the
    /// `INT_STATUS` reads that found bits.
    pub fn counts(&self) -> &[u64] {
        match self {
            InterruptSource::Polled(p) => &p.count,
            _ => self.efds().map_or(&[], |e| &e.counts),
        }
    }

    /// Total signals received.
    pub fn total(&self) -> u64 {
        self.counts().iter().sum()
    }

    /// Signals whose handler found `INT_STATUS` empty (MSI mode; 0 in MSI-X mode).
    pub fn empty_signals(&self) -> u64 {
        match self {
            InterruptSource::Msix(_) | InterruptSource::Polled(_) => 0,
            InterruptSource::Msi(m) => m.empty,
        }
    }

    /// The vector (index into [`InterruptSource::counts`]) `ev` arrives on.
    pub fn vector_of(&self, ev: Event) -> u32 {
        match self {
            InterruptSource::Msix(_) => ev.msix_vector(),
            InterruptSource::Msi(_) | InterruptSource::Polled(_) => 0,
        }
    }

    /// Runs the handler for whatever is already signalled, without blocking. Returns the
    /// `INT_STATUS` bits it read (and acknowledged) in MSI mode; 0 in MSI-X mode, where
    /// signals just stay pending on their vectors.
    pub fn collect(&mut self, regs: &(impl IntRegs + ?Sized)) -> Result<u32, WaitError> {
        match self {
            InterruptSource::Msix(m) => {
                for v in 0..m.pending.len() {
                    m.read(v)?;
                }
                Ok(0)
            }
            InterruptSource::Msi(m) => m.read(regs),
            InterruptSource::Polled(p) => Ok(p.read(regs)),
        }
    }

    /// Collects what is signalled, then forgets every undelivered event (tests only).
    #[cfg(test)]
    pub fn clear_pending(&mut self, regs: &(impl IntRegs + ?Sized)) -> Result<u32, WaitError> {
        let st = self.collect(regs)?;
        match self {
            InterruptSource::Msix(m) => m.pending.iter_mut().for_each(|p| *p = 0),
            InterruptSource::Msi(m) => m.pending.iter_mut().for_each(|p| *p = 0),
            InterruptSource::Polled(m) => m.pending.iter_mut().for_each(|p| *p = 0),
        }
        Ok(st)
    }

    /// Blocks until one of `events` has arrived (or the deadline passes) and consumes it (all
    /// of its pending signals); other arrivals stay pending. Returns the event and the
    /// `INT_STATUS` bits the handler read and acknowledged meanwhile.
    ///
    /// MSI-X: `events` are matched by vector (the first listed wins if two share one); the
    /// handler reads and acknowledges `INT_STATUS` once the event is there. MSI: the handler
    /// runs on every signal and `events` are matched by their `INT_STATUS` bit, so a FENCE's
    /// own vector is irrelevant: it arrives as its queue's completion. Polled: like MSI, but
    /// the waiter reads `INT_STATUS` itself, pausing between reads.
    pub fn wait_any(
        &mut self,
        regs: &(impl IntRegs + ?Sized),
        events: &[Event],
        deadline: Instant,
    ) -> Result<(Event, u32), WaitError> {
        let mut seen = 0;
        if let InterruptSource::Polled(p) = self {
            let mut pause = POLL_FIRST_PAUSE;
            loop {
                if let Some(ev) = p.take(events) {
                    return Ok((ev, seen));
                }
                if Instant::now() >= deadline {
                    return Err(WaitError::Timeout);
                }
                let st = p.read(regs);
                seen |= st;
                if st == 0 {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(POLL_MAX_PAUSE);
                }
            }
        }
        loop {
            match self {
                InterruptSource::Msix(m) => {
                    if let Some(ev) = m.take(events) {
                        return Ok((ev, seen | drain_status(regs)));
                    }
                }
                InterruptSource::Msi(m) => {
                    if let Some(ev) = m.take(events) {
                        return Ok((ev, seen));
                    }
                }
                InterruptSource::Polled(_) => unreachable!("handled above"),
            }
            let ready = match self {
                InterruptSource::Msix(m) => m.efds.block(deadline)?,
                InterruptSource::Msi(m) => m.efd.block(deadline)?,
                InterruptSource::Polled(_) => unreachable!("handled above"),
            };
            for v in ready {
                match self {
                    InterruptSource::Msix(m) => m.read(v)?,
                    InterruptSource::Msi(m) => seen |= m.read(regs)?,
                    InterruptSource::Polled(_) => unreachable!("handled above"),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// `INT_STATUS`/`INT_ACK` like the device's: W1C, and a hook that raises more bits when a
    /// given ack happens (a source firing between the handler's read and its ack).
    #[derive(Debug, Default)]
    struct FakeRegs {
        status: AtomicU32,
        reads: AtomicU32,
        acks: Mutex<Vec<u32>>,
        raise_on_first_ack: AtomicU32,
    }

    impl IntRegs for FakeRegs {
        fn int_status(&self) -> u32 {
            self.reads.fetch_add(1, Ordering::SeqCst);
            self.status.load(Ordering::SeqCst)
        }

        fn int_ack(&self, bits: u32) {
            self.status.fetch_and(!bits, Ordering::SeqCst);
            self.acks.lock().expect("lock").push(bits);
            let late = self.raise_on_first_ack.swap(0, Ordering::SeqCst);
            self.status.fetch_or(late, Ordering::SeqCst);
        }
    }

    impl FakeRegs {
        fn acks(&self) -> Vec<u32> {
            self.acks.lock().expect("lock").clone()
        }
    }

    fn soon() -> Instant {
        Instant::now() + Duration::from_secs(5)
    }

    fn done(q: u32, vector: u32) -> Event {
        Event::Completion { queue: q, vector }
    }

    fn err(q: u32) -> Event {
        Event::Error {
            queue: q,
            vector: 8 + q,
        }
    }

    fn msi_fd(s: &InterruptSource) -> EventFd {
        s.fds()[0].try_clone().expect("clone")
    }

    #[test]
    fn detects_the_mode_from_the_capability_list() {
        assert_eq!(IrqMode::detect(&[0x01, 0x10, 0x11]), Ok(IrqMode::Msix));
        assert_eq!(IrqMode::detect(&[0x01, 0x10, 0x05]), Ok(IrqMode::Msi));
        // Both: MSI-X wins (what a real driver prefers).
        assert_eq!(IrqMode::detect(&[0x05, 0x01, 0x11]), Ok(IrqMode::Msix));
        let e = IrqMode::detect(&[0x01, 0x10]).expect_err("no interrupt capability");
        assert!(
            e.contains("neither") && e.contains("0x11") && e.contains("0x05"),
            "{e}"
        );
        assert_eq!(IrqMode::Msix.vectors(), 16);
        assert_eq!(IrqMode::Msi.vectors(), 1);
        assert_eq!(IrqMode::Msi.msix_vector_count(), 0);
        assert_eq!((IrqMode::Msix.name(), IrqMode::Msi.name()), ("msix", "msi"));
    }

    /// Polled: no eventfd; the waiter reads INT_STATUS itself, demultiplexes it like MSI,
    /// keeps other queues' bits pending, sees a bit the device raises while it waits, and
    /// gives up at the deadline.
    #[test]
    fn polled_reads_int_status_until_the_event() {
        let regs = Arc::new(FakeRegs::default());
        let mut irqs = InterruptSource::polled(IrqMode::Msix);
        assert_eq!(irqs.delivery(), Delivery::Polled);
        assert_eq!(irqs.mode(), IrqMode::Msix, "the device's own mode is kept");
        assert!(irqs.fds().is_empty());
        assert_eq!(irqs.counts(), &[0]);
        regs.status
            .store(int_completion(0) | int_error(2), Ordering::SeqCst);
        let (ev, st) = irqs
            .wait_any(regs.as_ref(), &[done(0, 5), err(0)], soon())
            .expect("queue 0");
        assert_eq!(ev, done(0, 5), "matched by INT_STATUS bit, not by vector");
        assert_eq!(st, int_completion(0) | int_error(2));
        assert_eq!(regs.acks(), vec![int_completion(0) | int_error(2)]);
        // Queue 2's error stays pending for its waiter, without another read.
        let reads = regs.reads.load(Ordering::SeqCst);
        assert_eq!(
            irqs.wait_any(regs.as_ref(), &[err(2)], soon()),
            Ok((err(2), 0))
        );
        assert_eq!(regs.reads.load(Ordering::SeqCst), reads);
        assert_eq!(irqs.vector_of(err(2)), 0);
        // A bit raised while the waiter polls.
        let r2 = regs.clone();
        let raiser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            r2.status.fetch_or(int_completion(1), Ordering::SeqCst);
        });
        let t = Instant::now();
        let got = irqs.wait_any(regs.as_ref(), &[done(1, 1)], soon());
        raiser.join().expect("raiser");
        assert_eq!(got.map(|(e, _)| e), Ok(done(1, 1)));
        assert!(t.elapsed() >= Duration::from_millis(25));
        assert!(irqs.status_polls() > 3, "{}", irqs.status_polls());
        assert_eq!(irqs.counts(), &[2], "two reads found bits");
        // Nothing raised: bounded by the deadline.
        let t = Instant::now();
        assert_eq!(
            irqs.wait_any(
                regs.as_ref(),
                &[done(3, 3)],
                Instant::now() + Duration::from_millis(50)
            ),
            Err(WaitError::Timeout)
        );
        assert!(t.elapsed() < Duration::from_secs(2));
        // collect() reads once without waiting.
        regs.status.store(int_completion(4), Ordering::SeqCst);
        assert_eq!(irqs.collect(regs.as_ref()), Ok(int_completion(4)));
    }

    #[test]
    fn msix_waits_and_counts() {
        let regs = FakeRegs::default();
        let mut irqs = InterruptSource::new(IrqMode::Msix).expect("eventfds");
        assert_eq!(irqs.fds().len(), 16);
        let fd = |irqs: &InterruptSource, v: usize| irqs.fds()[v].try_clone().expect("clone");
        regs.status
            .store(int_completion(3) | int_completion(1), Ordering::SeqCst);
        fd(&irqs, 3).write(1).expect("signal");
        fd(&irqs, 9).write(2).expect("signal");
        let (ev, st) = irqs
            .wait_any(&regs, &[done(3, 3)], soon())
            .expect("vector 3");
        assert_eq!(ev, done(3, 3));
        // The handler read and acknowledged INT_STATUS once the event was there.
        assert_eq!(st, int_completion(3) | int_completion(1));
        assert_eq!(regs.acks(), vec![int_completion(3) | int_completion(1)]);
        // Vector 9 (queue 1's error vector) was counted and stays pending.
        assert_eq!(
            irqs.wait_any(&regs, &[done(1, 2), err(1)], soon()),
            Ok((err(1), 0))
        );
        assert_eq!(irqs.counts()[3], 1);
        assert_eq!(irqs.counts()[9], 2);
        assert_eq!(irqs.total(), 3);
        assert_eq!(irqs.vector_of(err(1)), 9);
        assert_eq!(irqs.vector_of(done(0, 5)), 5);
        // A FENCE's own vector counts, not its queue: vector 5 is not vector 0.
        fd(&irqs, 5).write(1).expect("signal");
        let t = Instant::now();
        assert_eq!(
            irqs.wait_any(&regs, &[done(0, 0)], t + Duration::from_millis(50)),
            Err(WaitError::Timeout)
        );
        assert!(t.elapsed() >= Duration::from_millis(50));
        assert_eq!(
            irqs.wait_any(&regs, &[done(0, 5)], soon()).map(|r| r.0),
            Ok(done(0, 5))
        );
        // A signal from another thread wakes the blocked waiter.
        let f = fd(&irqs, 15);
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            f.write(1).expect("signal");
        });
        assert_eq!(
            irqs.wait_any(&regs, &[done(7, 15)], soon()).map(|r| r.0),
            Ok(done(7, 15))
        );
        h.join().expect("join");
        fd(&irqs, 0).write(1).expect("signal");
        irqs.clear_pending(&regs).expect("clear");
        assert_eq!(irqs.counts()[0], 1);
        assert_eq!(
            irqs.wait_any(
                &regs,
                &[done(0, 0)],
                Instant::now() + Duration::from_millis(10)
            ),
            Err(WaitError::Timeout)
        );
        assert_eq!(irqs.empty_signals(), 0);
    }

    #[test]
    fn msi_demultiplexes_through_int_status() {
        let regs = FakeRegs::default();
        let mut irqs = InterruptSource::new(IrqMode::Msi).expect("eventfd");
        assert_eq!(irqs.mode(), IrqMode::Msi);
        assert_eq!(irqs.fds().len(), 1);
        let fd = msi_fd(&irqs);
        // One message for two sources: queue 0 completed, queue 1 stopped on an error.
        regs.status
            .store(int_completion(0) | int_error(1), Ordering::SeqCst);
        fd.write(1).expect("signal");
        let (ev, st) = irqs
            .wait_any(&regs, &[done(1, 1), err(1)], soon())
            .expect("queue 1 error");
        assert_eq!(ev, err(1));
        assert_eq!(st, int_completion(0) | int_error(1));
        // Acknowledged exactly what was read, once.
        assert_eq!(regs.acks(), vec![int_completion(0) | int_error(1)]);
        assert_eq!(regs.status.load(Ordering::SeqCst), 0);
        // Queue 0's completion was latched by the same handler run: no second message needed,
        // and a FENCE's explicit vector (here 13) does not matter, only its queue does.
        assert_eq!(
            irqs.wait_any(&regs, &[done(0, 13)], soon()),
            Ok((done(0, 13), 0))
        );
        assert_eq!(irqs.counts(), &[1]);
        // Everything arrives on vector 0.
        assert_eq!(irqs.vector_of(err(5)), 0);
        assert_eq!(irqs.vector_of(done(3, 11)), 0);
        // Consumed: a second wait for it times out.
        assert_eq!(
            irqs.wait_any(
                &regs,
                &[done(0, 0)],
                Instant::now() + Duration::from_millis(20)
            ),
            Err(WaitError::Timeout)
        );
    }

    #[test]
    fn msi_never_reads_int_status_without_a_signal() {
        let regs = FakeRegs::default();
        let mut irqs = InterruptSource::new(IrqMode::Msi).expect("eventfd");
        // Latched, but no message (e.g. masked): the waiter must not poll the register.
        regs.status.store(int_completion(2), Ordering::SeqCst);
        assert_eq!(
            irqs.wait_any(
                &regs,
                &[done(2, 2)],
                Instant::now() + Duration::from_millis(30)
            ),
            Err(WaitError::Timeout)
        );
        assert_eq!(irqs.collect(&regs), Ok(0));
        assert_eq!(regs.reads.load(Ordering::SeqCst), 0);
        assert!(regs.acks().is_empty());
        // The message arrives later: now it is seen.
        msi_fd(&irqs).write(1).expect("signal");
        assert_eq!(
            irqs.wait_any(&regs, &[done(2, 2)], soon()).map(|r| r.0),
            Ok(done(2, 2))
        );
    }

    #[test]
    fn msi_raise_between_read_and_ack_is_not_lost() {
        let regs = FakeRegs::default();
        let mut irqs = InterruptSource::new(IrqMode::Msi).expect("eventfd");
        let fd = msi_fd(&irqs);
        // Queue 0 completes and signals; queue 2 completes just as the handler acks queue 0's
        // bit (its own message follows).
        regs.status.store(int_completion(0), Ordering::SeqCst);
        regs.raise_on_first_ack
            .store(int_completion(2), Ordering::SeqCst);
        fd.write(1).expect("signal");
        let (ev, st) = irqs
            .wait_any(&regs, &[done(0, 0)], soon())
            .expect("queue 0");
        assert_eq!(ev, done(0, 0));
        // The re-read after the ack picked queue 2 up; the ack did not clear it unread.
        assert_eq!(st, int_completion(0) | int_completion(2));
        assert_eq!(regs.acks(), vec![int_completion(0), int_completion(2)]);
        fd.write(1).expect("queue 2's own message");
        // Queue 2's event is pending already; its message then finds INT_STATUS empty.
        assert_eq!(
            irqs.wait_any(&regs, &[done(2, 2)], soon()),
            Ok((done(2, 2), 0))
        );
        assert_eq!(irqs.collect(&regs), Ok(0));
        assert_eq!(irqs.empty_signals(), 1);
        assert_eq!(irqs.counts(), &[2]);
    }

    #[test]
    fn msi_wakes_a_blocked_waiter_and_keeps_other_queues_pending() {
        let regs = Arc::new(FakeRegs::default());
        let mut irqs = InterruptSource::new(IrqMode::Msi).expect("eventfd");
        let fd = msi_fd(&irqs);
        let dev = regs.clone();
        // A device thread: queue 1 completes, then queue 3 (separate messages), then queue 0.
        let h = std::thread::spawn(move || {
            for q in [1, 3, 0] {
                std::thread::sleep(Duration::from_millis(20));
                dev.status.fetch_or(int_completion(q), Ordering::SeqCst);
                fd.write(1).expect("signal");
            }
        });
        let (ev, _) = irqs
            .wait_any(&*regs, &[done(0, 0), err(0)], soon())
            .expect("queue 0");
        assert_eq!(ev, done(0, 0));
        h.join().expect("join");
        // Queues 1 and 3 came first and were kept.
        for q in [3, 1] {
            assert_eq!(
                irqs.wait_any(&*regs, &[done(q, 9), err(q)], soon())
                    .map(|r| r.0),
                Ok(done(q, 9))
            );
        }
        assert_eq!(irqs.total(), 3);
        assert_eq!(regs.status.load(Ordering::SeqCst), 0);
        // clear_pending drops undelivered events.
        regs.status.store(int_error(4), Ordering::SeqCst);
        msi_fd(&irqs).write(1).expect("signal");
        assert_eq!(irqs.clear_pending(&*regs), Ok(int_error(4)));
        assert_eq!(
            irqs.wait_any(
                &*regs,
                &[err(4)],
                Instant::now() + Duration::from_millis(10)
            ),
            Err(WaitError::Timeout)
        );
    }
}
