//! Request counters of a server: messages by command and a latency histogram (from a
//! request's arrival to its reply leaving), kept with atomics so the serving thread records
//! without a lock and another thread (a pool worker reporting to its daemon) reads them.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds of the latency buckets, in nanoseconds: 1, 2.5, 5 per decade from 1 µs to
/// 1 s (the bounds of the daemon's `switchyard_endpoint_request_duration_seconds`).
pub const LATENCY_BOUNDS_NS: [u64; 19] = [
    1_000,
    2_500,
    5_000,
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
];

/// Commands are numbered 1..=`MAX_COMMAND`; others are counted under 0.
const MAX_COMMAND: usize = 31;

/// See the [module](self) documentation.
#[derive(Debug)]
pub struct RequestStats {
    by_command: [AtomicU64; MAX_COMMAND + 1],
    /// One per bound, then one for everything slower.
    buckets: [AtomicU64; LATENCY_BOUNDS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for RequestStats {
    fn default() -> Self {
        Self {
            by_command: std::array::from_fn(|_| AtomicU64::new(0)),
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_ns: AtomicU64::new(0),
        }
    }
}

/// Counts read from [`RequestStats`] (or the difference of two readings).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Messages by command number (index 0: unknown commands).
    pub by_command: Vec<u64>,
    /// Latency bucket counts (not cumulative): one per [`LATENCY_BOUNDS_NS`] bound, then
    /// the overflow.
    pub buckets: Vec<u64>,
    /// Sum of the latencies, nanoseconds.
    pub sum_ns: u64,
}

impl RequestStats {
    /// Records a request of command `cmd` answered `elapsed` after it arrived.
    pub fn record(&self, cmd: u16, elapsed: Duration) {
        let c = usize::from(cmd);
        let c = if c <= MAX_COMMAND { c } else { 0 };
        self.by_command[c].fetch_add(1, Ordering::Relaxed);
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let b = LATENCY_BOUNDS_NS.partition_point(|&bound| bound < ns);
        self.buckets[b].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns, Ordering::Relaxed);
    }

    /// The counts now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            by_command: self.by_command.iter().map(load).collect(),
            buckets: self.buckets.iter().map(load).collect(),
            sum_ns: load(&self.sum_ns),
        }
    }
}

impl StatsSnapshot {
    /// What was counted since `earlier`.
    pub fn since(&self, earlier: &StatsSnapshot) -> StatsSnapshot {
        let diff = |a: &[u64], b: &[u64]| -> Vec<u64> {
            a.iter()
                .enumerate()
                .map(|(i, x)| x.saturating_sub(b.get(i).copied().unwrap_or(0)))
                .collect()
        };
        StatsSnapshot {
            by_command: diff(&self.by_command, &earlier.by_command),
            buckets: diff(&self.buckets, &earlier.buckets),
            sum_ns: self.sum_ns.saturating_sub(earlier.sum_ns),
        }
    }

    /// Whether nothing was counted.
    pub fn is_empty(&self) -> bool {
        self.by_command.iter().all(|&n| n == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_land_in_their_command_and_latency_bucket() {
        let s = RequestStats::default();
        s.record(8, Duration::from_nanos(900)); // REGION_READ, ≤ 1 µs
        s.record(8, Duration::from_micros(1)); // on the bound: still the first bucket
        s.record(9, Duration::from_micros(30)); // ≤ 50 µs
        s.record(200, Duration::from_secs(2)); // unknown command, overflow
        let a = s.snapshot();
        assert_eq!(
            (a.by_command[8], a.by_command[9], a.by_command[0]),
            (2, 1, 1)
        );
        assert_eq!(a.buckets[0], 2);
        assert_eq!(a.buckets[5], 1);
        assert_eq!(a.buckets[LATENCY_BOUNDS_NS.len()], 1);
        assert_eq!(a.sum_ns, 900 + 1_000 + 30_000 + 2_000_000_000);
        s.record(8, Duration::from_micros(3));
        let d = s.snapshot().since(&a);
        assert_eq!(d.by_command.iter().sum::<u64>(), 1);
        assert_eq!((d.by_command[8], d.buckets[2], d.sum_ns), (1, 1, 3_000));
        assert!(!d.is_empty() && s.snapshot().since(&s.snapshot()).is_empty());
    }
}
