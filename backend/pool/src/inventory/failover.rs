//! Failover in the pool's model: a failed board (quarantined, its failure kept), the endpoints
//! leasing its devices, and the move of each to a free device of its shape on a healthy
//! board. The daemon runs the data path between plan and commit, as for a move.

use crate::board::BoardRecord;
use crate::config::FailoverPolicy;
use crate::error::PoolError;
use crate::event::{Event, EventKind};
use crate::view::{BoardFailure, BoardState, MovePlan};

use super::Inventory;

/// An endpoint leasing a device of a failed board ([`Inventory::failed_leases`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedLease {
    /// The endpoint.
    pub endpoint: String,
    /// Its device, on the failed board.
    pub device: String,
    /// The failed board.
    pub board: String,
    /// How the board failed.
    pub failure: BoardFailure,
    /// The policy of the board's pool.
    pub policy: FailoverPolicy,
    /// A move (or failover) of the endpoint is in progress.
    pub moving: bool,
}

impl Inventory {
    /// The failover policy of `board`'s pool; a board in no pool has the default.
    pub fn failover_policy(&self, board: &str) -> FailoverPolicy {
        self.pool_of(board)
            .and_then(|p| self.failover.get(p).copied())
            .unwrap_or_default()
    }

    /// Records that `board` failed: it is quarantined (no new lease lands on it) and keeps
    /// its failure until it is unquarantined (repaired). A board already failed keeps its
    /// first failure and reports nothing new.
    pub fn fail_board(
        &mut self,
        board: &str,
        failure: BoardFailure,
    ) -> Result<Vec<Event>, PoolError> {
        let record = self
            .boards
            .iter()
            .find(|b| b.def.id == board)
            .ok_or_else(|| PoolError::UnknownBoard(board.into()))?;
        if record.failed.is_some() {
            return Ok(Vec::new());
        }
        let mut events = self.set_quarantine(board, true)?;
        if let Some(record) = self.boards.iter_mut().find(|b| b.def.id == board) {
            record.failed = Some(failure.clone());
        }
        events.push(self.emit(EventKind::BoardFailed {
            board: board.into(),
            reason: failure.reason,
            state_intact: failure.state_intact,
        }));
        Ok(events)
    }

    /// Every endpoint leasing a device of a failed board, in endpoint order.
    pub fn failed_leases(&self) -> Vec<FailedLease> {
        self.endpoints
            .values()
            .filter_map(|e| {
                let device = e.device.as_deref()?;
                let dev = self.dev(device)?;
                let failure = dev.board.failed.clone()?;
                Some(FailedLease {
                    endpoint: e.id.clone(),
                    device: device.to_owned(),
                    board: dev.board.def.id.clone(),
                    failure,
                    policy: self.failover_policy(&dev.board.def.id),
                    moving: e.moving_to.is_some(),
                })
            })
            .collect()
    }

    /// Plans the failover of `endpoint` off its failed board: the first free device of the
    /// same shape on an available board (the board's own pool first, as a drain), reserved
    /// like a move's target until [`Inventory::commit_failover`] or
    /// [`Inventory::abort_move`]. Unlike a move, the device's kind need not be movable: the
    /// device is rebuilt there, not relocated. [`PoolError::NoCompatibleDevice`] when no
    /// device is free.
    pub fn plan_failover(&mut self, endpoint: &str) -> Result<(MovePlan, Vec<Event>), PoolError> {
        let e = self.endpoint_checked(endpoint)?;
        self.no_move(e)?;
        let Some(from) = e.device.as_deref() else {
            return Err(PoolError::NotLeased(endpoint.into()));
        };
        let from = self.dev_checked(from)?;
        let target = self
            .boards_to_leave(&from.board.def.id)
            .into_iter()
            .filter(|r: &&BoardRecord| r.state() == BoardState::Available)
            .flat_map(|r| self.devs_of(r))
            .find(|d| d.shape.difference(from.shape).is_none() && self.holder(d.id).is_none())
            .ok_or_else(|| PoolError::NoCompatibleDevice {
                device: from.id.into(),
            })?;
        let plan = super::move_plan(endpoint, from, target);
        let event = self.start_move(&plan);
        Ok((plan, vec![event]))
    }

    /// Commits a planned failover: the lease moves ([`Inventory::commit_move`]) and a
    /// `failed_over` event says how (`mode`) and how long the guest waited (`stall_ms`).
    pub fn commit_failover(
        &mut self,
        plan: &MovePlan,
        mode: &str,
        stall_ms: u64,
    ) -> Result<Vec<Event>, PoolError> {
        let mut events = self.commit_move(plan)?;
        events.push(self.emit(EventKind::FailedOver {
            endpoint: plan.endpoint.clone(),
            from: plan.from.clone(),
            to: plan.to.clone(),
            mode: mode.into(),
            stall_ms,
        }));
        Ok(events)
    }

    /// Reports that `endpoint` waits for a device to fail over to (no state changes).
    pub fn failover_waiting(&mut self, endpoint: &str, device: &str) -> Vec<Event> {
        vec![self.emit(EventKind::FailoverWaiting {
            endpoint: endpoint.into(),
            device: device.into(),
        })]
    }

    /// Reports that `endpoint` cannot fail over, and why (no state changes).
    pub fn failover_refused(&mut self, endpoint: &str, device: &str, reason: &str) -> Vec<Event> {
        vec![self.emit(EventKind::FailoverRefused {
            endpoint: endpoint.into(),
            device: device.into(),
            reason: reason.into(),
        })]
    }
}
