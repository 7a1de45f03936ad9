//! Worker reports ([`crate::custody::WorkerStats`]) into the daemon's metrics.

use switchyard_control::Metrics;

/// Adds a worker's report to the endpoint's and its board's metrics.
pub(super) fn record(
    metrics: &Metrics,
    endpoint: &str,
    board: Option<&str>,
    stats: &crate::custody::WorkerStats,
) {
    let by_command: Vec<(switchyard_proto::Command, u64)> = stats
        .messages
        .iter()
        .filter_map(|&(c, n)| Some((switchyard_proto::Command::try_from(c).ok()?, n)))
        .collect();
    metrics.endpoint(endpoint).add_requests(
        &by_command,
        &stats.latency_buckets,
        stats.latency_sum_ns as f64 / 1e9,
    );
    if let Some(board) = board {
        let b = metrics.board(board);
        b.add_jobs(stats.jobs);
        b.add_bytes(stats.bytes);
        b.add_errors(stats.errors);
        b.add_recovered(stats.replayed, stats.interrupted);
    }
}
