//! A test hook that parks engines in the middle of a command, or kills them there.

use std::sync::atomic::AtomicBool;
use std::sync::{Condvar, Mutex};

/// Parks engines in the middle of a command (at an abort checkpoint), for tests that need a
/// command half done when its process dies.
#[derive(Debug, Default)]
pub(crate) struct TestHook {
    /// Per queue: park at the n-th checkpoint from now.
    park: Mutex<[Option<u32>; 8]>,
    /// Per queue: panic at the n-th checkpoint from now (an engine bug).
    die: Mutex<[Option<u32>; 8]>,
    /// Queues parked.
    parked: Mutex<u32>,
    changed: Condvar,
    /// Flushes publish but send no interrupt (a process that dies right after publishing).
    pub(crate) mute: AtomicBool,
    /// Every poll window this many µs instead of the adaptive budget (0: the budget), so a
    /// test can know that an engine is still polling.
    pub(crate) poll_us: std::sync::atomic::AtomicU64,
}

impl TestHook {
    /// Parks queue `q`'s engine, for good, at its `n`-th checkpoint from now (1: the first).
    pub(crate) fn park_at(&self, q: usize, n: u32) {
        if let Some(p) = self.park.lock().expect("hook").get_mut(q) {
            *p = Some(n);
        }
    }

    /// Makes queue `q`'s engine panic at its `n`-th checkpoint from now (1: the first), in
    /// the middle of its command, as a bug in it would.
    pub(crate) fn die_at(&self, q: usize, n: u32) {
        if let Some(p) = self.die.lock().expect("hook").get_mut(q) {
            *p = Some(n);
        }
    }

    /// Counts down `q`'s entry of `table`: whether it reached its checkpoint now.
    fn due(table: &Mutex<[Option<u32>; 8]>, q: usize) -> bool {
        let mut p = table.lock().expect("hook");
        match p.get_mut(q) {
            Some(Some(n)) if *n <= 1 => {
                p[q] = None;
                true
            }
            Some(Some(n)) => {
                *n -= 1;
                false
            }
            _ => false,
        }
    }

    /// Waits until the queues of `mask` are parked.
    pub(crate) fn wait_parked(&self, mask: u32) {
        let mut parked = self.parked.lock().expect("hook");
        while *parked & mask != mask {
            parked = self.changed.wait(parked).expect("hook");
        }
    }

    pub(crate) fn checkpoint(&self, q: usize) {
        if Self::due(&self.die, q) {
            panic!("test: an engine bug in queue {q}");
        }
        if Self::due(&self.park, q) {
            *self.parked.lock().expect("hook") |= 1 << q;
            self.changed.notify_all();
            loop {
                std::thread::park();
            }
        }
    }
}
