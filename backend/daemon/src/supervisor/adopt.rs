//! Adoption: a later daemon's supervisor takes over a running worker from its adoption
//! socket, with everything it holds, and supervises it until it dies.

use std::sync::{Arc, Mutex};

use switchyard_server::DeviceSocket;

use crate::custody::{CONNECTION_ID, LISTENER_ID, LastMove, WorkerNonce};

use super::handover::{Adoption, adopt_from};
use super::launch::{Launch, supervise};
use super::{
    Endpoint, EndpointSpec, MoveSlot, Supervisor, SupervisorError, WorkerStatus, client_fds,
    file_identity,
};

impl Supervisor {
    /// Takes over supervising `spec`'s running worker `pid`, started by an earlier supervisor
    /// (an earlier daemon) that is gone: connects to its adoption socket in the adoption
    /// directory, receives everything held for the endpoint (the listening socket, the
    /// client's connection and descriptors, VRAM, black box), and from then on supervises it
    /// as if it had started it (a worker that dies is replaced; restart, upgrade and moves
    /// work). Refused if the worker offers no adoption socket, has a supervisor, or does not
    /// prove `nonce`, its record's (none: a record of an earlier release, which is taken for
    /// a worker of that release only; see `handover::adopt_from`).
    pub fn adopt(
        &self,
        spec: EndpointSpec,
        pid: u32,
        nonce: Option<WorkerNonce>,
    ) -> Result<(), SupervisorError> {
        let failed = |reason: String| SupervisorError::Adopt {
            endpoint: spec.id.clone(),
            pid,
            reason,
        };
        let dir = self
            .adopt_dir
            .as_ref()
            .ok_or_else(|| failed("this supervisor has no adoption directory".into()))?;
        let mut endpoints = self.endpoints();
        if endpoints.contains_key(&spec.id) {
            return Err(SupervisorError::Exists(spec.id));
        }
        self.check_room(&endpoints, &spec.id)?;
        let path = crate::keeper::adoption_path(dir, pid);
        let Adoption {
            channel,
            mut held,
            objects,
            replacement,
            last_move,
            restarts,
            lease,
        } = adopt_from(&path, &spec.id, pid, nonce.as_ref()).map_err(|e| {
            let why = crate::error_chain::error_chain(&e);
            failed(format!("{}: {why}", path.display()))
        })?;
        // A worker of an earlier release holds its memory objects by id.
        let mut objects = objects;
        for (id, name) in crate::custody::LEGACY_OBJECT_IDS {
            if let Some(fd) = held.remove(&id) {
                objects.insert(name.to_owned(), fd);
            }
        }
        let listener = held
            .remove(&LISTENER_ID)
            .ok_or_else(|| failed("the worker did not hand over the listening socket".into()))?;
        let socket = DeviceSocket::adopt_owned(
            std::os::unix::net::UnixListener::from(listener),
            spec.socket.clone(),
        );
        if let Err(e) = self.access.apply(&spec.socket) {
            tracing::warn!(
                endpoint = spec.id,
                socket = %spec.socket.display(),
                "cannot give the adopted endpoint's socket its access (mode {:o}, group {:?}): {e}",
                self.access.mode(),
                self.access.group
            );
        }
        let connected = held.contains_key(&CONNECTION_ID);
        let client = client_fds(&held);
        // A move still running: what it copies to (held under its pending name) tells, should
        // the worker die before it answers, whether its replacement runs the device there.
        let mut mv = MoveSlot::default();
        if last_move.as_ref().is_some_and(LastMove::running) {
            mv.target = objects.iter().find_map(|(name, fd)| {
                let base = name.strip_suffix(switchyard_device::kind::PENDING_SUFFIX)?;
                Some((base.to_owned(), file_identity(fd)?))
            });
        }
        if let Some(m) = &last_move {
            tracing::info!(endpoint = spec.id, pid, last_move = ?m, "the adopted worker's last move");
        }
        let ep = Arc::new(Endpoint {
            status: Mutex::new(WorkerStatus {
                pid: Some(pid),
                // The count goes on from the last daemon's: the worker has been ready.
                restarts,
                ready: restarts + 1,
                held: held.len() + objects.len(),
                client_fds: client,
                connected,
                // What the worker says it serves: a failover or move it finished after the
                // last daemon planned it may have put it elsewhere than the store says.
                lease: lease.or_else(|| spec.lease.clone()),
                ..WorkerStatus::default()
            }),
            held: Mutex::new(held),
            objects: Mutex::new(objects),
            replacement: Mutex::new(replacement),
            channel: Mutex::new(channel.try_clone().ok()),
            mv: Mutex::new(mv),
            adopted_move: Mutex::new(last_move),
            ..Endpoint::new(spec.clone(), socket)
        });
        let (exe, ep2, sink) = (self.exe.clone(), ep.clone(), self.sink.clone());
        let adopt_dir = self.adopt_dir.clone();
        let (budget, migration_idle, jail) = (self.fd_budget, self.migration_idle, self.jail);
        let thread = std::thread::Builder::new()
            .name(format!("sy-sup-{}", spec.id))
            .spawn(move || {
                supervise(
                    &ep2,
                    &exe,
                    &sink,
                    Launch {
                        adopt_dir: adopt_dir.as_deref(),
                        fd_budget: budget,
                        migration_idle,
                        jail,
                    },
                    Some((channel, pid, nonce)),
                );
            })
            .map_err(|e| SupervisorError::Spawn(spec.id.clone(), e))?;
        *ep.thread.lock().unwrap_or_else(|p| p.into_inner()) = Some(thread);
        endpoints.insert(spec.id.clone(), ep);
        tracing::info!(endpoint = spec.id, pid, "worker adopted");
        Ok(())
    }
}
