//! The daemon's rules for blocking work, checked in debug builds.
//!
//! Blocking work is a process spawn, a kill followed by a wait, a thread join, a QMP
//! exchange, a wait for a worker's answer, a socket's blocking I/O. Two rules hold (see
//! ARCHITECTURE.md, "Concurrency"):
//!
//! 1. The pool's owner thread ([`crate::app`]'s `PoolOwner`) never blocks: it runs store
//!    transactions and nothing else.
//! 2. No lock of the daemon's (`Held`) is held across blocking work, and no two of them are
//!    held at once (each protects one small map; none is taken while another is held, so
//!    there is no order to get wrong).
//!
//! [`may_block`] is called at the start of every blocking operation of the supervisor and
//! the daemon; `Held` wraps every guard of a daemon lock. In debug builds a broken rule
//! panics where it is broken (tests run debug builds); release builds check nothing.

use std::cell::Cell;
use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

thread_local! {
    /// This thread is the pool's owner.
    static OWNER: Cell<bool> = const { Cell::new(false) };
    /// Daemon locks this thread holds now.
    static HELD: Cell<u32> = const { Cell::new(0) };
}

/// Marks the calling thread as the pool's owner: from now on [`may_block`] panics on it (in
/// debug builds).
pub(crate) fn enter_owner() {
    OWNER.with(|o| o.set(true));
}

/// Whether the calling thread is the pool's owner.
pub(crate) fn on_owner() -> bool {
    OWNER.with(Cell::get)
}

/// Says that the calling thread is about to block on `what` (a spawn, a join, QMP, a wait for
/// a worker). In debug builds, panics if that breaks a rule of the [module](self): the
/// thread is the pool's owner, or holds a daemon lock.
#[track_caller]
pub fn may_block(what: &str) {
    if cfg!(debug_assertions) {
        assert!(
            !on_owner(),
            "the pool's owner thread must not block (on {what})"
        );
        let held = HELD.with(Cell::get);
        assert!(
            held == 0,
            "{held} daemon lock(s) held while blocking on {what}"
        );
    }
}

/// A guard of a daemon lock, counted for [`may_block`]; taking a second daemon lock while
/// one is held panics in debug builds.
pub(crate) struct Held<'a, T> {
    guard: MutexGuard<'a, T>,
}

/// Locks `m` (a daemon lock: a leaf, never held across blocking work), taking it back from
/// a panicked holder (every daemon lock protects a map whose entries are each consistent).
#[track_caller]
pub(crate) fn lock<T>(m: &Mutex<T>) -> Held<'_, T> {
    if cfg!(debug_assertions) {
        let held = HELD.with(Cell::get);
        assert!(
            held == 0,
            "a daemon lock taken while another is held (every daemon lock is a leaf)"
        );
    }
    let guard = m.lock().unwrap_or_else(|p| p.into_inner());
    HELD.with(|h| h.set(h.get() + 1));
    Held { guard }
}

impl<T> Drop for Held<'_, T> {
    fn drop(&mut self) {
        HELD.with(|h| h.set(h.get().saturating_sub(1)));
    }
}

impl<T> Deref for Held<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.guard
    }
}

impl<T> DerefMut for Held<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        &mut self.guard
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocking_is_allowed_without_locks_off_the_owner() {
        may_block("a test");
        let m = Mutex::new(1);
        {
            let g = lock(&m);
            assert_eq!(*g, 1);
        }
        may_block("a test, the lock released");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "daemon lock(s) held while blocking")]
    fn blocking_under_a_daemon_lock_panics() {
        let m = Mutex::new(());
        let _g = lock(&m);
        may_block("a join");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "another is held")]
    fn two_daemon_locks_at_once_panic() {
        let (a, b) = (Mutex::new(()), Mutex::new(()));
        let _a = lock(&a);
        let _b = lock(&b);
    }

    #[test]
    #[cfg(debug_assertions)]
    fn the_owner_may_not_block() {
        let r = std::thread::spawn(|| {
            enter_owner();
            may_block("a spawn");
        })
        .join();
        assert!(r.is_err(), "blocking on the owner thread must panic");
    }
}
