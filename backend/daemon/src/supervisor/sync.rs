//! "Caught up to N": the supervisor asks a worker how far its custody notes go and waits
//! until it has applied all of them (see the custody sequence in [`crate::keeper`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::custody::{self, Note};

use super::{Supervisor, SupervisorError};

/// Tokens of sync requests, unique in this process (an endpoint's answers only grow).
static NEXT_TOKEN: AtomicU64 = AtomicU64::new(1);

impl Supervisor {
    /// Asks the endpoint's worker for its custody sequence number ([`Note::Sync`]) and
    /// waits (up to `timeout`) until this supervisor has applied every note the worker made
    /// before its answer: what it holds for the endpoint is then what the worker noted, and
    /// the status says so ([`super::WorkerStatus::custody_seq`]). Returns that number.
    ///
    /// The worker answers from its request thread, so a move in progress delays the
    /// answer; a worker of an earlier release never answers (the wait times out); a worker
    /// replaced meanwhile does not answer either.
    pub fn sync(&self, id: &str, timeout: Duration) -> Result<u64, SupervisorError> {
        crate::blocking::may_block("a custody sync's answer");
        let ep = self.get(id)?;
        let failed = |reason: String| SupervisorError::SyncFailed {
            endpoint: id.to_owned(),
            reason,
        };
        let token = NEXT_TOKEN.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        {
            let channel = ep.channel.lock().unwrap_or_else(|p| p.into_inner());
            let ch = channel
                .as_ref()
                .ok_or_else(|| SupervisorError::NoWorker(id.to_owned()))?;
            custody::send(ch, &Note::Sync { token }, &[])
                .map_err(|e| failed(format!("cannot ask the worker: {e}")))?;
        }
        let mut st = ep.status();
        while st.custody_synced < token {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(failed("the worker did not answer in time".into()));
            }
            st = ep
                .changed
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(st.custody_seq)
    }
}
