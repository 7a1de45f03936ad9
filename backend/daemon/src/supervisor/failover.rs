//! What failover asks of the supervisor: a fault injected into the worker (a drill), and the
//! worker replaced by one that builds the device on another board, continuing its state
//! (transparent) or fresh (guest-visible).

use std::time::{Duration, Instant};

use crate::custody::{self, DeviceSpec, Note, StartMode};

use super::{Supervisor, SupervisorError, kill, launch::let_go};

impl Supervisor {
    /// Asks the endpoint's worker to simulate the board fault `kind` and waits (up to
    /// `timeout`) for its answer. The failure is then detected and reported as a real one
    /// ([`super::WorkerEvent::BoardFailed`]).
    pub fn inject_fault(
        &self,
        id: &str,
        kind: &str,
        timeout: Duration,
    ) -> Result<(), SupervisorError> {
        let ep = self.get(id)?;
        let failed = |reason: String| SupervisorError::FaultFailed {
            endpoint: id.to_owned(),
            reason,
        };
        let deadline = Instant::now() + timeout;
        let mut answer = ep.fault.lock().unwrap_or_else(|p| p.into_inner());
        *answer = None;
        {
            let channel = ep.channel.lock().unwrap_or_else(|p| p.into_inner());
            let ch = channel
                .as_ref()
                .ok_or_else(|| SupervisorError::NoWorker(id.to_owned()))?;
            let note = Note::Fault {
                kind: kind.to_owned(),
            };
            custody::send(ch, &note, &[])
                .map_err(|e| failed(format!("cannot ask the worker: {e}")))?;
        }
        while answer.is_none() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(failed("the worker did not answer in time".into()));
            }
            answer = ep
                .fault_answered
                .wait_timeout(answer, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        match answer.take().flatten() {
            None => Ok(()),
            Some(error) => Err(failed(error)),
        }
    }

    /// Whether a replacement of the endpoint's worker would continue its device (the device
    /// can be recovered from what is in custody).
    pub fn can_continue(&self, id: &str) -> Result<bool, SupervisorError> {
        Ok(self.get(id)?.start_mode() == StartMode::Resume)
    }

    /// Replaces the endpoint's worker by one that continues the device from what is in
    /// custody (its black box and memory objects) on another board: `device`, when the
    /// board's device spec differs (a kind whose spec names its host resource). A
    /// transparent failover: the client's connection is kept. Returns the number of workers
    /// that had reported ready, for [`Supervisor::wait_ready`].
    pub fn continue_elsewhere(
        &self,
        id: &str,
        device: Option<DeviceSpec>,
    ) -> Result<u64, SupervisorError> {
        let ep = self.get(id)?;
        if ep.start_mode() != StartMode::Resume {
            return Err(SupervisorError::NoWorker(id.to_owned()));
        }
        let st = ep.status();
        if device.is_some() {
            *ep.device.lock().unwrap_or_else(|p| p.into_inner()) = device;
        }
        let ready = st.ready;
        kill(st.pid);
        Ok(ready)
    }

    /// Replaces the endpoint's worker by one that builds a fresh `device` (a guest-visible
    /// failover: the device's state died with its board). What the dead device's worker
    /// held is let go: its state, and the client's connection and descriptors (the VMM
    /// unplugged it, or lost it). Returns the number of workers that had reported ready.
    pub fn start_afresh(&self, id: &str, device: DeviceSpec) -> Result<u64, SupervisorError> {
        let ep = self.get(id)?;
        *ep.device.lock().unwrap_or_else(|p| p.into_inner()) = Some(device);
        let _ = let_go(&ep, true, true);
        ep.record_replacement(StartMode::Fresh);
        let mut st = ep.status();
        // What the dead device lost is not the fresh one's.
        st.device_lost = None;
        st.state_lost.clear();
        let ready = st.ready;
        kill(st.pid);
        Ok(ready)
    }
}
