//! What the supervisor does for live migrations: the idle timeout its workers get, and a
//! delete that touches only one incarnation of an endpoint id (the clean-up after a
//! migration must never delete an endpoint re-created with the same id).

use std::sync::atomic::Ordering;
use std::time::Duration;

use super::{EndpointSpec, Supervisor, SupervisorError, kill};

impl Supervisor {
    /// Workers end migration streams with no activity for `timeout` (the device's migration
    /// is abandoned and it runs; the worker reports it with cause `idle_timeout`). Without
    /// it, a worker's server has its default.
    pub fn with_migration_idle_timeout(mut self, timeout: Duration) -> Self {
        self.migration_idle = Some(timeout);
        self
    }

    /// Stops the endpoint: its worker is killed and every descriptor closed (the client sees
    /// the connection close), the socket file removed.
    pub fn delete(&self, id: &str) -> Result<(), SupervisorError> {
        self.delete_if(id, |_| true).map(|_| ())
    }

    /// [`Supervisor::delete`] if the endpoint's spec passes `this_one` (checked under the
    /// endpoints' lock, with the removal): `Ok(false)`, nothing done, when it does not.
    pub fn delete_if(
        &self,
        id: &str,
        this_one: impl FnOnce(&EndpointSpec) -> bool,
    ) -> Result<bool, SupervisorError> {
        crate::blocking::may_block("a worker's kill and its supervision thread's join");
        let ep = {
            let mut endpoints = self.endpoints();
            let ep = endpoints
                .get(id)
                .ok_or_else(|| SupervisorError::NotFound(id.to_owned()))?;
            if !this_one(&ep.spec) {
                return Ok(false);
            }
            endpoints.remove(id)
        };
        let Some(ep) = ep else {
            return Err(SupervisorError::NotFound(id.to_owned()));
        };
        {
            // Under the status lock: a worker started concurrently either is seen here or
            // sees `stopping` (see `run_worker`).
            let st = ep.status();
            ep.stopping.store(true, Ordering::SeqCst);
            kill(st.pid);
        }
        if let Some(t) = ep.thread.lock().unwrap_or_else(|p| p.into_inner()).take() {
            let _ = t.join();
        }
        ep.held().clear();
        Ok(true)
    }
}
