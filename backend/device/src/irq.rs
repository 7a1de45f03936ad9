//! Interrupt routing: the eventfds the client passed with `SET_IRQS`, held by the server on
//! behalf of the device so they can be re-pointed (swap, failover) without the client noticing.

use std::fs::File;
use std::io::Write;
use std::sync::{Mutex, RwLock};

use crate::ratelimit::{LOG_INTERVAL, LogLimiter};

/// VFIO PCI interrupt indexes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u32)]
pub enum IrqIndex {
    /// Legacy INTx.
    Intx = 0,
    /// MSI.
    Msi = 1,
    /// MSI-X.
    Msix = 2,
    /// Error notification.
    Err = 3,
    /// Device request (asks the VMM to release the device).
    Req = 4,
}

impl IrqIndex {
    /// All indexes in numeric order.
    pub const ALL: [IrqIndex; 5] = [
        IrqIndex::Intx,
        IrqIndex::Msi,
        IrqIndex::Msix,
        IrqIndex::Err,
        IrqIndex::Req,
    ];

    /// The index for a raw VFIO value.
    pub fn from_raw(v: u32) -> Option<Self> {
        Self::ALL.get(v as usize).copied()
    }
}

/// Errors of interrupt configuration.
#[derive(Debug, thiserror::Error)]
pub enum IrqError {
    /// The index does not exist on this device.
    #[error("Interrupt index {0} does not exist")]
    NoSuchIndex(u32),
    /// `start`/`count` fall outside the vectors of the index.
    #[error("Interrupt vectors {start}+{count} exceed the {available} of index {index}")]
    OutOfRange {
        /// The index.
        index: u32,
        /// First vector.
        start: u32,
        /// Number of vectors.
        count: u32,
        /// Vectors the index has.
        available: u32,
    },
    /// The number of fds or bools does not match `count`.
    #[error("Expected {expected} values for the interrupt vectors, got {got}")]
    CountMismatch {
        /// Expected.
        expected: u32,
        /// Received.
        got: usize,
    },
    /// Signalling an eventfd failed.
    #[error("Cannot signal the interrupt eventfd")]
    Signal(#[source] std::io::Error),
}

impl IrqError {
    /// The errno for the wire.
    pub fn errno(&self) -> i32 {
        match self {
            IrqError::Signal(e) => e.raw_os_error().unwrap_or(libc::EIO),
            _ => libc::EINVAL,
        }
    }
}

#[derive(Debug, Default)]
struct Vector {
    trigger: Option<File>,
    masked: bool,
    pending: bool,
}

#[derive(Debug)]
struct IndexState {
    vectors: Vec<Vector>,
}

/// Creates a non-blocking, close-on-exec eventfd as a plain file (for tests and clients).
pub fn new_eventfd() -> std::io::Result<File> {
    let fd = rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::NONBLOCK | rustix::event::EventfdFlags::CLOEXEC,
    )?;
    Ok(File::from(fd))
}

/// Reads and resets an eventfd's counter; `None` if it was not signalled (non-blocking fd).
pub fn take_eventfd(fd: &File) -> Option<u64> {
    use std::io::Read;
    let mut b = [0u8; 8];
    match (&*fd).read(&mut b) {
        Ok(8) => Some(u64::from_ne_bytes(b)),
        _ => None,
    }
}

/// Signals an eventfd by adding one to its counter, without ever blocking, whatever the
/// file's `O_NONBLOCK` flag (the server does not change the flags of a client's file: they
/// belong to the client's open file description, shared with the client).
///
/// A write to an eventfd blocks only when it would take the counter to `u64::MAX`: a zero-
/// timeout `poll(POLLOUT)` first tells whether the counter has room for one more. If not, it
/// is at its ceiling: the interrupt is already pending, which is what signalling wants, so
/// nothing is written (`EAGAIN` from a non-blocking eventfd means the same). The caller holds
/// the `signal` lock, so two device threads signalling the same eventfd cannot both pass the
/// check with room for one. Remaining race, documented rather than closed: the *client* (the
/// only other writer of its eventfd) bringing the counter to within one of its ceiling between
/// the poll and the write would block this thread until the client reads the eventfd; a
/// client can only do that to its own interrupt, on purpose, to the last unit of a 2^64 counter.
fn write_eventfd(fd: &File) -> Result<(), IrqError> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    let mut pfd = [PollFd::new(fd, PollFlags::OUT)];
    let zero = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    match poll(&mut pfd, Some(&zero)) {
        Ok(_) => {}
        Err(e) if e == rustix::io::Errno::INTR => return Ok(()),
        Err(e) => return Err(IrqError::Signal(e.into())),
    }
    let ready = pfd[0].revents();
    if ready.intersects(PollFlags::ERR | PollFlags::NVAL) {
        return Err(IrqError::Signal(std::io::Error::from_raw_os_error(
            libc::EBADF,
        )));
    }
    if !ready.contains(PollFlags::OUT) {
        return Ok(());
    }
    match (&*fd).write(&1u64.to_ne_bytes()) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Ok(()),
        Err(e) => Err(IrqError::Signal(e)),
    }
}

/// The interrupt state of one device: per index, per vector, the client's eventfd and the
/// client-controlled mask (`SET_IRQS` MASK/UNMASK). Eventfds are held as plain files (the
/// server accepts only eventfds and leaves their flags alone) and signalled by adding one to
/// their counter, never blocking (see [`Interrupts::trigger`]).
#[derive(Debug)]
pub struct Interrupts {
    indexes: RwLock<Vec<IndexState>>,
    /// Serialises eventfd writes (see `write_eventfd`); taken after `indexes`, never before.
    signal: Mutex<()>,
    /// Failed signals from device threads ([`Interrupts::notify`]), per client.
    failures: LogLimiter,
}

impl Interrupts {
    /// Creates the routing table with `counts[i]` vectors for index `i`.
    pub fn new(counts: &[u32]) -> Self {
        let indexes = counts
            .iter()
            .map(|&n| IndexState {
                vectors: (0..n).map(|_| Vector::default()).collect(),
            })
            .collect();
        Self {
            indexes: RwLock::new(indexes),
            signal: Mutex::new(()),
            failures: LogLimiter::new("cannot signal an interrupt", LOG_INTERVAL),
        }
    }

    /// Signals one eventfd (see `write_eventfd`).
    fn signal(&self, fd: &File) -> Result<(), IrqError> {
        let _one_at_a_time = self.signal.lock().unwrap_or_else(|p| p.into_inner());
        write_eventfd(fd)
    }

    /// Re-sizes the table to `counts` vectors per index. Vectors that exist in both keep
    /// their eventfd and mask (a server restored after a restart routes interrupts before the
    /// device has described itself); the others are dropped.
    pub fn reconfigure(&self, counts: &[u32]) {
        let mut idx = self.indexes.write().unwrap_or_else(|p| p.into_inner());
        let old = std::mem::take(&mut *idx);
        let mut old = old.into_iter();
        *idx = counts
            .iter()
            .map(|&n| {
                let mut kept = old.next().map(|s| s.vectors).unwrap_or_default();
                kept.truncate(n as usize);
                kept.resize_with(n as usize, Vector::default);
                IndexState { vectors: kept }
            })
            .collect();
    }

    /// Number of vectors of `index`.
    pub fn count(&self, index: u32) -> u32 {
        let idx = self.indexes.read().unwrap_or_else(|p| p.into_inner());
        idx.get(index as usize)
            .map_or(0, |s| s.vectors.len() as u32)
    }

    fn with_range<R>(
        &self,
        index: u32,
        start: u32,
        count: u32,
        f: impl FnOnce(&mut [Vector]) -> Result<R, IrqError>,
    ) -> Result<R, IrqError> {
        let mut idx = self.indexes.write().unwrap_or_else(|p| p.into_inner());
        let state = idx
            .get_mut(index as usize)
            .ok_or(IrqError::NoSuchIndex(index))?;
        let available = state.vectors.len() as u32;
        let range = start
            .checked_add(count)
            .filter(|&end| end <= available)
            .map(|end| start as usize..end as usize)
            .ok_or(IrqError::OutOfRange {
                index,
                start,
                count,
                available,
            })?;
        let slice = state.vectors.get_mut(range).ok_or(IrqError::OutOfRange {
            index,
            start,
            count,
            available,
        })?;
        f(slice)
    }

    /// Every vector with an eventfd, as `(index, vector, a new descriptor of the eventfd)`
    /// (to hand them to a device that routes interrupts itself when it takes the slot). An
    /// eventfd that cannot be duplicated is left out.
    pub fn triggers(&self) -> Vec<(u32, u32, File)> {
        let idx = self.indexes.read().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for (i, state) in (0u32..).zip(idx.iter()) {
            for (v, vector) in (0u32..).zip(&state.vectors) {
                if let Some(f) = vector.trigger.as_ref().and_then(|f| f.try_clone().ok()) {
                    out.push((i, v, f));
                }
            }
        }
        out
    }

    /// Assigns (`Some`) or de-assigns (`None`) trigger eventfds for `start..start+fds.len()`.
    pub fn set_triggers(
        &self,
        index: u32,
        start: u32,
        fds: Vec<Option<File>>,
    ) -> Result<(), IrqError> {
        let count = u32::try_from(fds.len()).map_err(|_| IrqError::CountMismatch {
            expected: u32::MAX,
            got: fds.len(),
        })?;
        self.with_range(index, start, count, |vectors| {
            for (v, fd) in vectors.iter_mut().zip(fds) {
                v.trigger = fd;
            }
            Ok(())
        })
    }

    /// Disables every vector of `index` (drops the eventfds, clears masks).
    pub fn disable(&self, index: u32) -> Result<(), IrqError> {
        let n = self.count(index);
        self.with_range(index, 0, n, |vectors| {
            vectors.iter_mut().for_each(|v| *v = Vector::default());
            Ok(())
        })
    }

    /// Drops every eventfd of every index (client disconnect), and logs how many failed
    /// signals of this client were not logged.
    pub fn clear(&self) {
        let mut idx = self.indexes.write().unwrap_or_else(|p| p.into_inner());
        for state in idx.iter_mut() {
            state
                .vectors
                .iter_mut()
                .for_each(|v| *v = Vector::default());
        }
        drop(idx);
        self.failures.flush();
    }

    /// Masks or unmasks vectors; `which` selects per vector (`None` = all in range). Unmasking a
    /// vector with a pending interrupt delivers it.
    pub fn set_masked(
        &self,
        index: u32,
        start: u32,
        count: u32,
        masked: bool,
        which: Option<&[u8]>,
    ) -> Result<(), IrqError> {
        if let Some(w) = which
            && w.len() != count as usize
        {
            return Err(IrqError::CountMismatch {
                expected: count,
                got: w.len(),
            });
        }
        self.with_range(index, start, count, |vectors| {
            for (i, v) in vectors.iter_mut().enumerate() {
                if which.is_some_and(|w| w.get(i).copied().unwrap_or(0) == 0) {
                    continue;
                }
                v.masked = masked;
                if !masked && v.pending {
                    v.pending = false;
                    if let Some(fd) = &v.trigger {
                        self.signal(fd)?;
                    }
                }
            }
            Ok(())
        })
    }

    /// Signals vector `vector` from a device thread: like [`Interrupts::trigger`], but a
    /// failure is logged here, rate-limited per client (the first in full, then a count per
    /// interval and when the client goes), instead of returned. Returns whether an eventfd was
    /// signalled.
    pub fn notify(&self, index: IrqIndex, vector: u32) -> bool {
        match self.trigger(index, vector) {
            Ok(signalled) => signalled,
            Err(e) => {
                if self.failures.allow() {
                    tracing::warn!(?index, vector, error = %e, "cannot signal an interrupt");
                }
                false
            }
        }
    }

    /// Signals vector `vector` of `index`. Returns `Ok(true)` if an eventfd was signalled,
    /// `Ok(false)` if the vector is masked (then it is left pending) or has no eventfd. Never
    /// blocks, even on a blocking eventfd whose counter is at its ceiling (the interrupt is
    /// pending then anyway).
    pub fn trigger(&self, index: IrqIndex, vector: u32) -> Result<bool, IrqError> {
        // Fast path: read lock only, unless the vector is masked.
        {
            let idx = self.indexes.read().unwrap_or_else(|p| p.into_inner());
            let v = idx
                .get(index as usize)
                .and_then(|s| s.vectors.get(vector as usize))
                .ok_or(IrqError::OutOfRange {
                    index: index as u32,
                    start: vector,
                    count: 1,
                    available: idx
                        .get(index as usize)
                        .map_or(0, |s| s.vectors.len() as u32),
                })?;
            if !v.masked {
                return match &v.trigger {
                    Some(fd) => self.signal(fd).map(|()| true),
                    None => Ok(false),
                };
            }
        }
        // Masked on the fast path: decide again under the write lock, where an unmask cannot
        // slip in between (it would find no pending bit and the interrupt would be lost).
        self.with_range(index as u32, vector, 1, |v| match v.first_mut() {
            Some(v) if v.masked => {
                v.pending = true;
                Ok(false)
            }
            Some(Vector {
                trigger: Some(fd), ..
            }) => self.signal(fd).map(|()| true),
            _ => Ok(false),
        })
    }

    /// Whether a trigger eventfd is installed for the vector.
    pub fn has_trigger(&self, index: IrqIndex, vector: u32) -> bool {
        let idx = self.indexes.read().unwrap_or_else(|p| p.into_inner());
        idx.get(index as usize)
            .and_then(|s| s.vectors.get(vector as usize))
            .is_some_and(|v| v.trigger.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn efd() -> File {
        new_eventfd().expect("eventfd")
    }

    fn file(e: &File) -> File {
        e.try_clone().expect("clone")
    }

    #[test]
    fn trigger_signals_the_assigned_eventfd() {
        let irqs = Interrupts::new(&[0, 0, 8, 0, 1]);
        let fd = efd();
        irqs.set_triggers(2, 3, vec![Some(file(&fd))])
            .expect("assign");
        assert!(irqs.trigger(IrqIndex::Msix, 3).expect("trigger"));
        assert_eq!(take_eventfd(&fd), Some(1));
        assert!(!irqs.trigger(IrqIndex::Msix, 4).expect("no fd"));
        let e = irqs
            .trigger(IrqIndex::Msix, 8)
            .expect_err("vector out of range");
        assert!(
            matches!(
                e,
                IrqError::OutOfRange {
                    start: 8,
                    available: 8,
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn ranges_are_checked() {
        let irqs = Interrupts::new(&[0, 0, 8]);
        assert!(irqs.set_triggers(2, 7, vec![None, None]).is_err());
        assert!(irqs.set_triggers(2, u32::MAX, vec![None]).is_err());
        assert!(irqs.set_triggers(4, 0, vec![None]).is_err());
        assert!(irqs.set_masked(2, 0, 2, true, Some(&[1])).is_err());
    }

    #[test]
    fn masked_vectors_stay_pending_until_unmasked() {
        let irqs = Interrupts::new(&[0, 0, 2]);
        let fd = efd();
        irqs.set_triggers(2, 0, vec![Some(file(&fd))])
            .expect("assign");
        irqs.set_masked(2, 0, 1, true, None).expect("mask");
        assert!(!irqs.trigger(IrqIndex::Msix, 0).expect("trigger"));
        assert_eq!(take_eventfd(&fd), None, "nothing delivered while masked");
        irqs.set_masked(2, 0, 1, false, None).expect("unmask");
        assert_eq!(take_eventfd(&fd), Some(1), "pending delivered");
    }

    #[test]
    fn a_saturated_blocking_eventfd_does_not_block_the_trigger() {
        // A blocking eventfd (the client's flags are left alone) whose counter the client
        // brought to its ceiling: a write of 1 would block until someone reads it.
        let fd = File::from(
            rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC).expect("eventfd"),
        );
        (&fd)
            .write_all(&0xffff_ffff_ffff_fffeu64.to_ne_bytes())
            .expect("saturate");
        let irqs = std::sync::Arc::new(Interrupts::new(&[0, 0, 1]));
        irqs.set_triggers(2, 0, vec![Some(file(&fd))])
            .expect("assign");
        let (tx, rx) = std::sync::mpsc::channel();
        let i = irqs.clone();
        std::thread::spawn(move || {
            let r = (0..3).all(|_| i.trigger(IrqIndex::Msix, 0).is_ok());
            let _ = tx.send(r);
        });
        let r = rx.recv_timeout(std::time::Duration::from_secs(5));
        assert_eq!(r, Ok(true), "the trigger returned, without an error");
        let flags = rustix::fs::fcntl_getfl(&fd).expect("getfl");
        assert!(
            !flags.contains(rustix::fs::OFlags::NONBLOCK),
            "flags untouched"
        );
        // Still readable: the interrupt is pending, the counter at its ceiling.
        let mut b = [0u8; 8];
        std::io::Read::read_exact(&mut &fd, &mut b).expect("read");
        assert_eq!(u64::from_ne_bytes(b), 0xffff_ffff_ffff_fffe);
        // Drained, it is signalled normally again.
        assert!(irqs.trigger(IrqIndex::Msix, 0).expect("trigger"));
        std::io::Read::read_exact(&mut &fd, &mut b).expect("read");
        assert_eq!(u64::from_ne_bytes(b), 1);
    }

    #[test]
    fn device_thread_failures_are_counted_not_logged_each_time() {
        let irqs = Interrupts::new(&[0, 0, 2]);
        for _ in 0..1000 {
            // Vector 5 does not exist: every signal fails.
            assert!(!irqs.notify(IrqIndex::Msix, 5));
        }
        assert_eq!(
            irqs.failures.suppressed(),
            999,
            "one logged, the rest counted"
        );
        irqs.clear();
        assert_eq!(
            irqs.failures.suppressed(),
            0,
            "summarised when the client goes"
        );
    }

    #[test]
    fn clear_drops_fds() {
        let irqs = Interrupts::new(&[0, 0, 1]);
        irqs.set_triggers(2, 0, vec![Some(file(&efd()))])
            .expect("assign");
        assert!(irqs.has_trigger(IrqIndex::Msix, 0));
        irqs.clear();
        assert!(!irqs.has_trigger(IrqIndex::Msix, 0));
    }
}
