//! Sample collection and percentiles, and the interleaved measurement loop.

use std::time::Duration;

use anyhow::Result;
use serde::{Deserialize, Serialize};

/// Percentiles of a set of durations, in nanoseconds.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Fastest sample.
    pub min: f64,
    /// Median (nearest rank).
    pub p50: f64,
    /// 99th percentile (nearest rank).
    pub p99: f64,
    /// Mean.
    pub mean: f64,
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
        let sum: u128 = samples.iter().map(|&v| u128::from(v)).sum();
        Some(Summary {
            n,
            min: samples.first().copied().unwrap_or_default() as f64,
            p50: rank(0.50),
            p99: rank(0.99),
            mean: sum as f64 / n as f64,
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
        assert_eq!((s.n, s.min, s.p50, s.p99), (100, 1.0, 50.0, 99.0));
        assert!(Summary::of(&mut []).is_none());
        let mut one = [7u64];
        let s = Summary::of(&mut one).expect("one");
        assert_eq!((s.p50, s.p99), (7.0, 7.0));
    }
}
