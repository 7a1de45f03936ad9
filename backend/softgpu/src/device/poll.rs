//! How an engine polls for work instead of sleeping: the doorbell counter it watches and its
//! adaptive polling budget.

use std::sync::atomic::{AtomicBool, AtomicU32};
use std::time::Duration;

/// How many of a device's engines may poll at once: one core at most, whatever the client
/// submits (a client that kept every queue just busy enough would otherwise keep eight engines
/// spinning on work it never sends). The other engines sleep at once; mapped doorbells reach
/// them by kicks.
pub(super) const MAX_POLLERS: u32 = 1;

/// How a doorbell reaches an engine that polls instead of sleeping.
#[derive(Debug, Default)]
pub(super) struct Poll {
    /// Bumped after every trapped doorbell or kick (once the tail is in the registers).
    pub(super) rung: AtomicU32,
    /// The engine is polling: a doorbell needs no condvar wake-up (set and cleared under the
    /// register lock, so a doorbell written under it sees the engine's choice).
    pub(super) polling: AtomicBool,
}

/// An engine's polling budget, adapted the way KVM adapts halt polling: a sleep that ended
/// within the largest budget (polling a little longer would have caught the work) doubles it,
/// from [`Budget::START`]; a longer sleep (polling was wasted) drops it to zero. Work found
/// while polling keeps it. So a busy queue polls and never sleeps, a sporadic one sleeps at
/// once, an idle one costs nothing.
#[derive(Debug, Clone, Copy)]
pub(super) struct Budget {
    pub(super) max: Duration,
    pub(super) now: Duration,
}

impl Budget {
    /// The first budget after a sleep that polling would have caught.
    const START: Duration = Duration::from_micros(10);

    pub(super) fn new(max: Duration) -> Self {
        Self { max, now: max }
    }

    pub(super) fn now(&self) -> Duration {
        self.now
    }

    /// The engine slept for `slept` (woken by a doorbell, or anything else).
    pub(super) fn slept(&mut self, slept: Duration) {
        if slept > self.max {
            self.now = Duration::ZERO;
        } else if self.now < self.max {
            self.now = (self.now * 2).max(Self::START).min(self.max);
        }
    }
}

#[cfg(test)]
mod budget_tests {
    use std::time::Duration;

    use super::Budget;

    const MAX: Duration = Duration::from_micros(200);

    #[test]
    fn the_budget_starts_full_collapses_after_a_long_sleep_and_doubles_back() {
        let mut b = Budget::new(MAX);
        assert_eq!(b.now(), MAX);
        // A sleep longer than the largest budget: polling would not have caught the work.
        b.slept(MAX + Duration::from_micros(1));
        assert_eq!(b.now(), Duration::ZERO);
        // Sleeps that a budget would have caught: from START, doubling, up to the largest.
        let mut seen = vec![];
        for _ in 0..6 {
            b.slept(Duration::from_micros(5));
            seen.push(b.now().as_micros());
        }
        assert_eq!(seen, [10, 20, 40, 80, 160, 200]);
        // A short sleep at the largest budget keeps it.
        b.slept(Duration::from_micros(5));
        assert_eq!(b.now(), MAX);
    }

    #[test]
    fn a_zero_budget_never_polls() {
        let mut b = Budget::new(Duration::ZERO);
        b.slept(Duration::ZERO);
        assert_eq!(b.now(), Duration::ZERO);
    }
}
