//! The daemon's descriptor plan: how many endpoints fit its open-file limit.

/// How the daemon's descriptors are shared: `reserve` for itself (the control API, the
/// store, starting workers), then per endpoint its own ([`FdPlan::ENDPOINT_OWN`]: listener,
/// connection, black box, VRAM, doorbells, the custody channel) and its client's budget
/// (`per_endpoint`). Endpoints are admitted while the sum fits `limit` (the open-file
/// limit), so no client, within its budget, can make the daemon run out of descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, utoipa::ToSchema)]
pub struct FdPlan {
    /// The daemon's open-file limit (`RLIMIT_NOFILE`, soft; raised to the hard limit at
    /// start).
    pub limit: u64,
    /// Descriptors kept for the daemon itself.
    pub reserve: u32,
    /// Each endpoint's client budget.
    pub per_endpoint: u32,
}

impl FdPlan {
    /// An endpoint's own descriptors in the daemon, beyond its client's.
    pub const ENDPOINT_OWN: u32 = 16;
    /// What a worker needs besides its client's descriptors (its threads, the device, the
    /// black box, the socket).
    pub const WORKER_OWN: u64 = 512;

    /// The plan under this process's open-file limit now.
    pub fn current(reserve: u32, per_endpoint: u32) -> Self {
        let limit = rustix::process::getrlimit(rustix::process::Resource::Nofile)
            .current
            .unwrap_or(u64::MAX);
        Self {
            limit,
            reserve,
            per_endpoint,
        }
    }

    /// How many endpoints fit.
    pub fn endpoints(&self) -> u64 {
        let each = u64::from(self.per_endpoint) + u64::from(Self::ENDPOINT_OWN);
        self.limit.saturating_sub(u64::from(self.reserve)) / each
    }

    /// Why the plan cannot work, if it cannot: not one endpoint fits, or a worker (which
    /// has the same limit and holds up to three copies of its client's descriptors while a
    /// replacement restores them: the supervisor's, its ledger's and the device's) could
    /// not hold a full budget.
    pub fn problem(&self) -> Option<String> {
        let worker = 3 * u64::from(self.per_endpoint) + Self::WORKER_OWN;
        if self.endpoints() == 0 {
            Some(format!(
                "not one endpoint fits: {} reserved plus {} + {} per endpoint exceed the open-file limit of {}",
                self.reserve,
                self.per_endpoint,
                Self::ENDPOINT_OWN,
                self.limit
            ))
        } else if worker > self.limit {
            Some(format!(
                "a worker needs up to {worker} descriptors for a budget of {} (three copies while it restores its client, plus {}), over the open-file limit of {}",
                self.per_endpoint,
                Self::WORKER_OWN,
                self.limit
            ))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod fd_plan_tests {
    use super::FdPlan;

    fn plan(limit: u64, reserve: u32, per_endpoint: u32) -> FdPlan {
        FdPlan {
            limit,
            reserve,
            per_endpoint,
        }
    }

    #[test]
    fn endpoints_fit_the_limit_after_the_reserve_at_their_full_budget() {
        // (limit - reserve) / (budget + the endpoint's own 16)
        assert_eq!(plan(1024, 256, 64).endpoints(), 9);
        assert_eq!(plan(1024, 256, 128).endpoints(), 5);
        assert_eq!(plan(524_288, 256, 1024).endpoints(), 503);
        assert_eq!(
            plan(200, 256, 64).endpoints(),
            0,
            "a reserve over the limit"
        );
        assert_eq!(
            plan(u64::MAX, 256, 1024).endpoints(),
            (u64::MAX - 256) / 1040
        );
    }

    #[test]
    fn a_plan_that_fits_no_endpoint_or_no_worker_says_why() {
        assert_eq!(plan(1024, 256, 64).problem(), None);
        let none = plan(1024, 1000, 64).problem().expect("no endpoint fits");
        assert!(none.contains("not one endpoint fits"), "{none}");
        // One endpoint fits the daemon, but a worker restoring 1024 descriptors three
        // times over does not fit the same limit.
        let worker = plan(2048, 256, 1024)
            .problem()
            .expect("a worker does not fit");
        assert!(worker.contains("3584"), "{worker}");
        assert_eq!(plan(4096, 256, 1024).problem(), None);
    }
}
