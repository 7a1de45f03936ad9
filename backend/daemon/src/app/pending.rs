//! Moves a daemon left in progress (killed between planning a move and committing it): the
//! store has the move planned, the target reserved, and only the endpoint's worker knows
//! whether the data path finished. The worker's truth wins and the lease follows it: a
//! restarted daemon adopts the worker, which tells its last move ([`LastMove`]); a finished
//! move to the planned target is committed, anything else aborted (the device runs where
//! it was). A worker that was still moving when adopted (past
//! [`ADOPT_MOVE_WAIT`](crate::keeper::ADOPT_MOVE_WAIT)) leaves the move pending until its
//! outcome arrives ([`WorkerSignal::AdoptedMoveEnded`](crate::WorkerSignal::AdoptedMoveEnded)).

use std::time::Duration;

use switchyard_pool::MovePlan;

use super::Daemon;
use crate::custody::{LastMove, MoveReport, MoveState};

/// What to do with a move left in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settle {
    /// The data path finished: the lease follows the device (with the worker's report, if
    /// it gave one).
    Commit(Option<MoveReport>),
    /// The device runs where it was: the target is released. Why, for the log.
    Abort(String),
    /// The worker still moves the device: the move stays pending until it says how it
    /// ended.
    Wait,
}

/// How the endpoint of a pending move is served at daemon start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Served {
    /// Its worker (of the killed daemon) was adopted.
    Adopted,
    /// No adopted worker: why (it cannot be adopted, none runs).
    NotAdopted(String),
}

/// What to do with a move to the device `to` left in progress, by what the endpoint's
/// adopted worker said of its last move (`last`; the daemon names the target device in
/// [`Note::Move`](crate::custody::Note::Move)).
pub(crate) fn settle(to: &str, last: Option<&LastMove>) -> Settle {
    let Some(last) = last else {
        return Settle::Abort(
            "the endpoint's worker ran no move (the daemon died before asking it)".to_owned(),
        );
    };
    if last.to != to {
        return Settle::Abort(format!(
            "the endpoint's worker last moved to {}, not to {to}: this move never ran",
            last.to
        ));
    }
    match &last.state {
        MoveState::Moved { report } => Settle::Commit(report.clone()),
        MoveState::Failed { error } => {
            Settle::Abort(format!("the endpoint's worker failed the move: {error}"))
        }
        MoveState::Running => Settle::Wait,
    }
}

impl Daemon {
    /// At start, once the endpoint's worker is adopted (or is known not to be): settles
    /// the move the store has in progress for `endpoint`, if any. Its events are published
    /// after those the daemon made before (the stream starts after the history as loaded).
    pub(super) fn settle_pending_move(&self, endpoint: &str, served: &Served) {
        let Some(plan) = self.inventory().pending_move(endpoint) else {
            return;
        };
        // A failover (its source board failed): the worker's lease says where it continues
        // the device (it re-executes there: `crate::reexec`).
        let failover = self
            .inventory()
            .board(&plan.from_board)
            .is_some_and(|b| b.failed.is_some());
        let what = match served {
            Served::Adopted if failover => {
                let lease = self.supervisor.status(endpoint).ok().and_then(|s| s.lease);
                if lease.as_deref() == Some(plan.to.as_str()) {
                    if self.commit_adopted_failover(&plan) {
                        return;
                    }
                    Settle::Wait
                } else {
                    Settle::Abort(
                        "a failover the earlier daemon planned did not reach the worker, which serves the failed board's device still; it fails over anew".to_owned(),
                    )
                }
            }
            Served::Adopted => {
                let last = self.supervisor.adopted_move(endpoint).ok().flatten();
                settle(&plan.to, last.as_ref())
            }
            Served::NotAdopted(why) => Settle::Abort(why.clone()),
        };
        self.apply(&plan, what);
    }

    /// The move an adopted worker was still running when adopted has ended
    /// ([`WorkerSignal::AdoptedMoveEnded`](crate::WorkerSignal::AdoptedMoveEnded)): settles the
    /// move the store still has in progress for `endpoint` by what the worker said.
    pub(super) fn adopted_move_ended(&self, endpoint: &str) {
        self.settle_pending_move(endpoint, &Served::Adopted);
    }

    fn apply(&self, plan: &MovePlan, what: Settle) {
        let endpoint = plan.endpoint.as_str();
        match what {
            Settle::Commit(report) => {
                let p = plan.clone();
                match self.pool.apply(move |pool| pool.commit_move(&p)) {
                    Ok(()) => {
                        tracing::info!(
                            endpoint,
                            from = plan.from,
                            to = plan.to,
                            "a move left in progress by an earlier daemon: the worker finished it; committed (the lease follows the device)"
                        );
                        if let Some(r) = report {
                            self.metrics
                                .board(&plan.from_board)
                                .moved(Duration::from_micros(r.downtime_us));
                        }
                    }
                    Err(e) => {
                        tracing::error!(?plan, "cannot commit a move the worker finished: {e}")
                    }
                }
            }
            Settle::Abort(why) => {
                let p = plan.clone();
                match self.pool.apply(move |pool| pool.abort_move(&p)) {
                    Ok(()) => tracing::warn!(
                        endpoint,
                        from = plan.from,
                        to = plan.to,
                        "a move left in progress by an earlier daemon is aborted (the device stays on {}): {why}",
                        plan.from
                    ),
                    Err(e) => tracing::error!(?plan, "cannot abort a pending move: {e}"),
                }
            }
            Settle::Wait => tracing::warn!(
                endpoint,
                from = plan.from,
                to = plan.to,
                "a move left in progress by an earlier daemon still runs in the worker: it stays pending (the target reserved) until the worker says how it ended"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn last(to: &str, state: MoveState) -> LastMove {
        LastMove {
            to: to.into(),
            state,
        }
    }

    #[test]
    fn only_a_finished_move_to_the_planned_target_is_committed() {
        let report = MoveReport {
            downtime_us: 7,
            ..MoveReport::default()
        };
        let moved = MoveState::Moved {
            report: Some(report.clone()),
        };
        assert_eq!(
            settle("gpu1", Some(&last("gpu1", moved.clone()))),
            Settle::Commit(Some(report))
        );
        // Another target: the planned move never ran (the worker's last one went elsewhere).
        assert!(matches!(
            settle("gpu1", Some(&last("gpu2", moved))),
            Settle::Abort(why) if why.contains("gpu2")
        ));
        let failed = MoveState::Failed {
            error: "no room".into(),
        };
        assert!(matches!(
            settle("gpu1", Some(&last("gpu1", failed))),
            Settle::Abort(why) if why.contains("no room")
        ));
        assert!(matches!(settle("gpu1", None), Settle::Abort(_)));
        assert_eq!(
            settle("gpu1", Some(&last("gpu1", MoveState::Running))),
            Settle::Wait
        );
    }
}
