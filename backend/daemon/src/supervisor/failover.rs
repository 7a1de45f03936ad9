//! What failover asks of the supervisor: a fault injected into the worker (a drill), and the
//! worker replaced by one that builds the device on another board, continuing its state
//! (transparent) or fresh (guest-visible).

use std::time::{Duration, Instant};

use crate::custody::{self, DeviceSpec, Note, StartMode};

use super::{Supervisor, SupervisorError, kill, launch::let_go};

/// How long a worker asked to re-execute may take before it is killed instead.
const REEXEC_WAIT: Duration = Duration::from_secs(5);

impl Supervisor {
    /// Asks the endpoint's worker to simulate the board fault `kind` and waits (up to
    /// `timeout`) for its answer. The failure is then detected and reported as a real one
    /// ([`super::WorkerSignal::BoardFailed`]).
    ///
    /// `lease`: the device the fault is meant for; refused unless the current worker serves
    /// it (a failover or move may have put the endpoint on another board since the caller
    /// looked: the fault must not land there).
    pub fn inject_fault(
        &self,
        id: &str,
        kind: &str,
        lease: Option<&str>,
        timeout: Duration,
    ) -> Result<(), SupervisorError> {
        crate::blocking::may_block("a fault's answer");
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
            // The channel is the current worker's while it is held: so is its lease.
            if let Some(lease) = lease {
                let serves = ep.status().lease.clone();
                if serves.as_deref() != Some(lease) {
                    return Err(failed(format!(
                        "its worker no longer serves device {lease} (it serves {})",
                        serves.as_deref().unwrap_or("an unknown device")
                    )));
                }
            }
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

    /// Tells the endpoint's worker that its device's failure will not be failed over
    /// ([`Note::FailureUnhandled`]): the device signals it to its client.
    pub fn failure_unhandled(&self, id: &str) -> Result<(), SupervisorError> {
        let ep = self.get(id)?;
        let channel = ep.channel.lock().unwrap_or_else(|p| p.into_inner());
        let ch = channel
            .as_ref()
            .ok_or_else(|| SupervisorError::NoWorker(id.to_owned()))?;
        // A broken channel: the worker is gone (its replacement starts afresh anyway).
        custody::send(ch, &Note::FailureUnhandled, &[])
            .map_err(|_| SupervisorError::NoWorker(id.to_owned()))
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
    ///
    /// `lease`: the pool's device the replacement serves ([`super::WorkerStatus::lease`]).
    pub fn continue_elsewhere(
        &self,
        id: &str,
        device: Option<DeviceSpec>,
        lease: Option<String>,
    ) -> Result<u64, SupervisorError> {
        let ep = self.get(id)?;
        if ep.start_mode() != StartMode::Resume {
            return Err(SupervisorError::NoWorker(id.to_owned()));
        }
        if device.is_some() {
            *ep.device.lock().unwrap_or_else(|p| p.into_inner()) = device;
        }
        if lease.is_some() {
            *ep.next_lease.lock().unwrap_or_else(|p| p.into_inner()) = lease;
        }
        if self.adopt_dir.is_some() {
            return self.reexec(&ep);
        }
        let st = ep.status();
        let ready = st.ready;
        kill(st.pid);
        Ok(ready)
    }

    /// Asks the endpoint's worker to re-execute itself in place ([`Note::Reexec`]) on the
    /// device and lease the next worker gets; the supervision thread adopts the new image.
    /// A worker that has not re-executed within [`REEXEC_WAIT`] (its request thread stuck
    /// with a dead device) is killed and replaced the usual way. Returns the number of
    /// workers that had reported ready, for [`Supervisor::wait_ready`].
    fn reexec(&self, ep: &std::sync::Arc<super::Endpoint>) -> Result<u64, SupervisorError> {
        use std::sync::atomic::Ordering;
        let (ready, pid) = {
            let st = ep.status();
            (st.ready, st.pid)
        };
        let asked = ep.reexec_asked.fetch_add(1, Ordering::SeqCst) + 1;
        let sent = {
            let channel = ep.channel.lock().unwrap_or_else(|p| p.into_inner());
            let note = Note::Reexec {
                device: ep.device(),
                lease: ep.lease(),
            };
            channel.as_ref().map(|ch| custody::send(ch, &note, &[]))
        };
        match sent {
            Some(Ok(())) => {
                tracing::info!(
                    endpoint = ep.spec.id,
                    ?pid,
                    "worker asked to re-execute in place"
                );
                let watched = ep.clone();
                std::thread::Builder::new()
                    .name(format!("sy-reexec-{}", ep.spec.id))
                    .spawn(move || {
                        std::thread::sleep(REEXEC_WAIT);
                        let taken = watched.reexec_taken.load(Ordering::SeqCst);
                        if taken < asked && watched.status().pid == pid {
                            tracing::error!(
                                endpoint = watched.spec.id,
                                ?pid,
                                "the worker did not re-execute in time; killed (replaced from what the daemon holds)"
                            );
                            kill(pid);
                        }
                    })
                    .map_err(|e| SupervisorError::Spawn(ep.spec.id.clone(), e))?;
            }
            _ => {
                // No channel, or it broke: the worker is replaced the usual way.
                ep.reexec_taken.store(asked, Ordering::SeqCst);
                tracing::warn!(
                    endpoint = ep.spec.id,
                    ?pid,
                    "cannot ask the worker to re-execute; killed"
                );
                kill(pid);
            }
        }
        Ok(ready)
    }

    /// Replaces the endpoint's worker by one that builds a fresh `device` (a guest-visible
    /// failover: the device's state died with its board). What the dead device's worker
    /// held is let go: its state, and the client's connection and descriptors (the VMM
    /// unplugged it, or lost it). Returns the number of workers that had reported ready.
    pub fn start_afresh(
        &self,
        id: &str,
        device: DeviceSpec,
        lease: Option<String>,
    ) -> Result<u64, SupervisorError> {
        let ep = self.get(id)?;
        *ep.device.lock().unwrap_or_else(|p| p.into_inner()) = Some(device);
        if lease.is_some() {
            *ep.next_lease.lock().unwrap_or_else(|p| p.into_inner()) = lease;
        }
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
