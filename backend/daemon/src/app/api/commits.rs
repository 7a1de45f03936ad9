//! Commits of moves and failovers whose data path finished, and releases of those that did
//! not: the lease follows the device. A commit the store refuses is kept and retried by the
//! failover reconciler ([`super::failover`]) until it goes through.

use switchyard_control::ApiError;
use switchyard_pool::MovePlan;

use super::super::Daemon;
use super::pool_error;

/// A commit to retry (`Failover::retry_commit`).
#[derive(Debug, Clone)]
pub(crate) enum Uncommitted {
    /// A move.
    Move(MovePlan),
    /// A failover, with its mode and stall.
    Failover(MovePlan, &'static str, u64),
}

impl Daemon {
    /// Releases the target of a move or failover whose data path did not run (`what`, for
    /// the log).
    pub(super) fn abort_plan(&self, plan: &MovePlan, what: &str) {
        let p = plan.clone();
        if let Err(e) = self.pool.apply(move |pool| pool.abort_move(&p)) {
            tracing::error!(?plan, "cannot release a failed {what}'s target: {e}");
        }
    }

    /// Commits a move whose data path finished: the lease follows the device. A commit the
    /// store refuses now is kept and retried by the reconciler (the worker's truth wins:
    /// the device runs on the target whatever the store says); the error is returned for
    /// the request to say so.
    pub(super) fn commit_plan(&self, plan: &MovePlan, what: &str) -> Result<(), ApiError> {
        let p = plan.clone();
        self.pool
            .apply(move |pool| pool.commit_move(&p))
            .map_err(|e| {
                tracing::error!(
                    ?plan,
                    "cannot commit a {what} the data path finished (retried): {e}"
                );
                self.failover.retry_commit(Uncommitted::Move(plan.clone()));
                pool_error(e)
            })
    }
}
