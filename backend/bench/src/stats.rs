//! Sample collection and percentiles, and the interleaved measurement loop.

use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};

/// Percentiles of a set of durations, in nanoseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median (nearest rank).
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
}

impl Summary {
    /// Summarizes samples in nanoseconds (sorted in place). `None` without samples.
    pub fn of(samples: &mut [u64]) -> Option<Summary> {
        if samples.is_empty() {
            return None;
        }
        samples.sort_unstable();
        let n = samples.len();
        let rank = |p: f64| -> f64 {
            let idx = ((p * n as f64).ceil() as usize).clamp(1, n) - 1;
            samples.get(idx).copied().unwrap_or_default() as f64
        };
        Some(Summary {
            n,
            p50: rank(0.50),
            p99: rank(0.99),
        })
    }
}

/// Nanoseconds of a duration, saturating.
pub fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// One thing being measured: a closure that performs one operation and returns how long the
/// timed part took.
pub struct Contender<'a> {
    /// Name, for error messages.
    pub name: &'static str,
    /// One timed operation.
    pub op: Box<dyn FnMut() -> Result<Duration> + 'a>,
}

impl std::fmt::Debug for Contender<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Contender")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<'a> Contender<'a> {
    /// Wraps a closure.
    pub fn new(name: &'static str, op: impl FnMut() -> Result<Duration> + 'a) -> Self {
        Contender {
            name,
            op: Box::new(op),
        }
    }
}

/// How many samples to take and how to split them.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Untimed operations per contender before the first block.
    pub warmup: usize,
    /// Timed samples per contender.
    pub samples: usize,
    /// The samples are taken in this many blocks, contenders alternating block by block, so a
    /// floor and the case it normalizes see the same machine conditions.
    pub blocks: usize,
}

impl Plan {
    /// A plan of `samples` timed samples in `blocks` blocks after `warmup` untimed ones.
    pub const fn new(warmup: usize, samples: usize, blocks: usize) -> Plan {
        Plan {
            warmup,
            samples,
            blocks,
        }
    }
}

/// Runs every contender `plan.samples` times, interleaved in blocks; returns the samples (ns)
/// of each contender, in order.
pub fn interleaved(contenders: &mut [Contender<'_>], plan: Plan) -> Result<Vec<Vec<u64>>> {
    for c in contenders.iter_mut() {
        for _ in 0..plan.warmup {
            (c.op)().map_err(|e| e.context(format!("warm-up of {}", c.name)))?;
        }
    }
    let blocks = plan.blocks.max(1);
    let mut out: Vec<Vec<u64>> = contenders
        .iter()
        .map(|_| Vec::with_capacity(plan.samples))
        .collect();
    for b in 0..blocks {
        let lo = plan.samples * b / blocks;
        let hi = plan.samples * (b + 1) / blocks;
        for (c, v) in contenders.iter_mut().zip(out.iter_mut()) {
            for _ in lo..hi {
                let d = (c.op)().map_err(|e| e.context(format!("sample of {}", c.name)))?;
                v.push(ns(d));
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_nearest_rank() {
        let mut v: Vec<u64> = (1..=100).collect();
        let s = Summary::of(&mut v).expect("summary");
        assert_eq!((s.n, s.p50, s.p99), (100, 50.0, 99.0));
        assert!(Summary::of(&mut []).is_none());
        let mut one = [7u64];
        let s = Summary::of(&mut one).expect("one");
        assert_eq!((s.p50, s.p99), (7.0, 7.0));
    }

    /// Records which contender ran, in order; every call takes "1 ns".
    fn logging<'a>(log: &'a std::cell::RefCell<Vec<char>>, c: char) -> Contender<'a> {
        Contender::new("log", move || {
            log.borrow_mut().push(c);
            Ok(Duration::from_nanos(1))
        })
    }

    #[test]
    fn interleaved_splits_samples_into_alternating_blocks() {
        let log = std::cell::RefCell::new(Vec::new());
        let mut cs = [logging(&log, 'a'), logging(&log, 'b')];
        // 5 samples in 2 blocks: 2, then 3 (block b covers samples * b / blocks ..).
        let out = interleaved(&mut cs, Plan::new(1, 5, 2)).expect("run");
        assert_eq!(out, vec![vec![1; 5], vec![1; 5]]);
        let order: String = log.borrow().iter().collect();
        assert_eq!(
            order,
            "ab" /* warm-up */
                .to_owned()
                + "aabb"
                + "aaabbb"
        );
    }

    #[test]
    fn interleaved_block_edge_cases() {
        let log = std::cell::RefCell::new(Vec::new());
        let mut cs = [logging(&log, 'a'), logging(&log, 'b')];
        // No blocks means one block.
        let out = interleaved(&mut cs, Plan::new(0, 3, 0)).expect("run");
        assert_eq!(out.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3]);
        assert_eq!(log.borrow().iter().collect::<String>(), "aaabbb");
        // More blocks than samples: empty blocks, still every sample exactly once.
        log.borrow_mut().clear();
        let out = interleaved(&mut cs, Plan::new(0, 3, 4)).expect("run");
        assert_eq!(out.iter().map(Vec::len).collect::<Vec<_>>(), [3, 3]);
        assert_eq!(log.borrow().iter().collect::<String>(), "ababab");
        // An error names the contender and the phase.
        let mut bad = [Contender::new("bad", || anyhow::bail!("boom"))];
        let e = interleaved(&mut bad, Plan::new(1, 1, 1)).expect_err("fails");
        assert!(format!("{e:#}").contains("warm-up of bad"), "{e:#}");
    }
}
