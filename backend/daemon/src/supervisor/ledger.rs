//! The custody ledger: a worker's notes on its channel (what it holds and releases, its
//! readiness, stats, moves), kept in the endpoint's held descriptors and status.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};

use std::time::{Duration, Instant};
use switchyard_server::fd_kind::FdKind;

use crate::custody::{self, CONNECTION_ID, LISTENER_ID, MoveState, Note, legacy_object};

use super::common::Launch;
use super::{BUDGET_SLACK, Endpoint, EventSink, WorkerEvent, file_identity};

/// Serves worker `pid`'s custody notes on `channel` until the channel closes. Returns
/// whether it reported ready (an adopted worker did before). `kill` ends a worker that
/// breaks the protocol.
#[allow(clippy::too_many_arguments)]
pub(super) fn serve_notes(
    ep: &Endpoint,
    channel: &OwnedFd,
    pid: u32,
    died_at: Option<Instant>,
    started: Instant,
    sink: &EventSink,
    launch: Launch<'_>,
    kill: &dyn Fn(),
) -> bool {
    let mut ready = false;
    let mut buf = Vec::new();
    let limit = launch
        .fd_budget
        .map(|b| (b as usize).saturating_add(BUDGET_SLACK));
    let over_budget = switchyard_device::ratelimit::LogLimiter::new(
        "worker holds refused past the endpoint's budget",
        Duration::from_secs(5),
    );
    let mut migration_events = EventBudget::new();
    loop {
        match custody::recv(channel, &mut buf) {
            Ok((Note::Hold { ids }, fds)) => {
                let mut pairs: Vec<(u64, OwnedFd)> = Vec::with_capacity(ids.len());
                for (id, fd) in ids.into_iter().zip(fds) {
                    if let Err(what) = admissible(id, &fd) {
                        // A (compromised) worker's hold of what no client may send: never
                        // held, and closed without blocking this thread.
                        switchyard_server::fd_kind::dispose(fd);
                        ep.status().refused_fds += 1;
                        if over_budget.allow() {
                            tracing::error!(
                                pid,
                                id,
                                what,
                                "the worker put a descriptor of a kind no client may send in custody; refused"
                            );
                        }
                        continue;
                    }
                    // A worker of an earlier release holds its memory objects by id.
                    match legacy_object(id) {
                        Some(name) => {
                            hold_object(ep, name.to_owned(), fd);
                        }
                        None => pairs.push((id, fd)),
                    }
                }
                let refused = ep.change_held(|held| {
                    let first = switchyard_server::continuity::FIRST_MESSAGE_ID;
                    let mut client = held.range(first..).count();
                    let mut refused = 0u64;
                    for (id, fd) in pairs {
                        if id >= first && !held.contains_key(&id) {
                            if limit.is_some_and(|l| client >= l) {
                                // The worker should have refused the message: the daemon's
                                // own limit is what the budget protects.
                                refused += 1;
                                continue;
                            }
                            client += 1;
                        }
                        held.insert(id, fd);
                    }
                    refused
                });
                if refused > 0 {
                    ep.status().refused_fds += refused;
                    if over_budget.allow() {
                        tracing::error!(
                            pid,
                            refused,
                            budget = ?launch.fd_budget,
                            "the worker put client descriptors in custody past the endpoint's budget; refused"
                        );
                    }
                }
            }
            Ok((Note::StateLost { problems }, _)) => {
                tracing::error!(?problems, "the replacement lost part of the client's state");
                ep.status().state_lost = problems.clone();
                ep.changed.notify_all();
                sink(WorkerEvent::StateLost {
                    endpoint: ep.spec.id.clone(),
                    problems,
                });
            }
            Ok((
                Note::Migration {
                    streaming,
                    state,
                    cause,
                    origin_verified,
                },
                _,
            )) => {
                ep.status().migrating = streaming;
                ep.changed.notify_all();
                if let Some(state) = state {
                    sink(WorkerEvent::Migration {
                        endpoint: ep.spec.id.clone(),
                        state,
                        cause: cause.unwrap_or_default(),
                        origin_verified,
                        publish: migration_events.take(),
                    });
                }
            }
            Ok((Note::Stats(stats), _)) => sink(WorkerEvent::Stats {
                endpoint: ep.spec.id.clone(),
                stats,
            }),
            Ok((Note::Moved { report }, _)) => {
                adopted_move_ended(
                    ep,
                    sink,
                    MoveState::Moved {
                        report: Some(report.clone()),
                    },
                );
                ep.mv().reply = Some(Ok(report));
                ep.mv_changed.notify_all();
            }
            Ok((Note::MoveFailed { error }, _)) => {
                adopted_move_ended(
                    ep,
                    sink,
                    MoveState::Failed {
                        error: error.clone(),
                    },
                );
                ep.mv().reply = Some(Err(Some(error)));
                ep.mv_changed.notify_all();
            }
            Ok((Note::HoldObjects { names }, fds)) => {
                let mut refused = 0u64;
                for (name, fd) in names.into_iter().zip(fds) {
                    if switchyard_server::fd_kind::fd_kind(fd.as_fd()) != FdKind::Memory {
                        switchyard_server::fd_kind::dispose(fd);
                        refused += 1;
                        continue;
                    }
                    if !hold_object(ep, name, fd) {
                        refused += 1;
                    }
                }
                if refused > 0 {
                    ep.status().refused_fds += refused;
                    if over_budget.allow() {
                        tracing::error!(
                            pid,
                            refused,
                            limit = MAX_OBJECTS,
                            "the worker put more memory objects in custody than any device has; refused"
                        );
                    }
                }
            }
            Ok((Note::ReleaseObjects { names }, _)) => ep.change_objects(|objects| {
                for name in &names {
                    objects.remove(name);
                }
            }),
            Ok((Note::Release { ids }, _)) => {
                let legacy: Vec<&str> = ids.iter().filter_map(|id| legacy_object(*id)).collect();
                if !legacy.is_empty() {
                    ep.change_objects(|objects| {
                        for name in legacy {
                            objects.remove(name);
                        }
                    });
                }
                let client_left = ids.contains(&CONNECTION_ID);
                ep.change_held(|held| {
                    for id in ids {
                        if id != LISTENER_ID {
                            held.remove(&id);
                        }
                    }
                });
                if client_left {
                    // What a replacement lost was the client's; a new client starts whole.
                    ep.status().state_lost.clear();
                }
            }
            Ok((
                Note::Ready {
                    resumed,
                    replacement,
                },
                _,
            )) => {
                ready = true;
                if let Some(mode) = replacement {
                    ep.record_replacement(mode);
                }
                adopted_move_replaced(ep, sink);
                let restart = died_at.map(|t| t.elapsed());
                let mut st = ep.status();
                st.ready += 1;
                if restart.is_some() {
                    st.last_restart = restart;
                }
                ep.changed.notify_all();
                drop(st);
                sink(WorkerEvent::Ready {
                    endpoint: ep.spec.id.clone(),
                    pid,
                    resumed_connection: resumed,
                    restart,
                });
                tracing::info!(
                    pid,
                    resumed,
                    start_ms = started.elapsed().as_secs_f64() * 1e3,
                    "worker ready"
                );
            }
            Ok((Note::DeviceLost { host, reason }, _)) => {
                tracing::error!(%host, %reason, "the endpoint's passthrough device is lost");
                ep.status().device_lost = Some(format!("{host}: {reason}"));
                ep.changed.notify_all();
                sink(WorkerEvent::DeviceLost {
                    endpoint: ep.spec.id.clone(),
                    lease: ep.status().lease.clone(),
                    host,
                    reason,
                });
            }
            Ok((
                Note::BoardFailed {
                    reason,
                    state_intact,
                },
                _,
            )) => {
                tracing::error!(%reason, state_intact, "the device's board failed");
                sink(WorkerEvent::BoardFailed {
                    endpoint: ep.spec.id.clone(),
                    lease: ep.status().lease.clone(),
                    reason,
                    state_intact,
                });
            }
            Ok((Note::Synced { token, seq }, _)) => {
                // Every note the worker made before this one has been applied above.
                let mut st = ep.status();
                st.custody_seq = seq;
                st.custody_synced = st.custody_synced.max(token);
                drop(st);
                ep.changed.notify_all();
            }
            Ok((Note::FaultInjected { error }, _)) => {
                // The answer to `Supervisor::inject_fault`.
                *ep.fault.lock().unwrap_or_else(|p| p.into_inner()) = Some(error);
                ep.fault_answered.notify_all();
            }
            Ok((other, _)) => tracing::warn!(?other, "unexpected custody note; ignored"),
            Err(custody::ChannelError::Closed) => break,
            // A worker that died with notes in flight (killed for a restart or a failover)
            // resets the channel: an end, not a broken protocol.
            Err(custody::ChannelError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                ) =>
            {
                tracing::debug!(error = %e, "custody channel reset by the worker's end");
                break;
            }
            Err(e) => {
                // A worker that breaks the channel protocol cannot be trusted with it.
                tracing::error!(error = %e, "custody channel broken; killing the worker");
                kill();
                break;
            }
        }
    }
    ready
}

/// The adopted worker's move that was still running when it was adopted ended (`state`): the
/// supervisor keeps it ([`Supervisor::adopted_move`](super::Supervisor::adopted_move)) and
/// says so ([`WorkerEvent::AdoptedMoveEnded`]). Any other move's answer changes nothing here.
fn adopted_move_ended(ep: &Endpoint, sink: &EventSink, state: MoveState) {
    {
        let mut adopted = ep.adopted_move();
        let Some(m) = adopted.as_mut().filter(|m| m.running()) else {
            return;
        };
        tracing::info!(
            to = m.to,
            ?state,
            "the move the adopted worker was running ended"
        );
        m.state = state;
    }
    sink(WorkerEvent::AdoptedMoveEnded {
        endpoint: ep.spec.id.clone(),
    });
}

/// A replacement reports ready while the move the adopted worker was running never ended
/// (the worker died during it): the replacement runs the device on whichever memory its
/// state names, so the move went through if that is the move's target (held under its
/// pending name when the worker was adopted).
fn adopted_move_replaced(ep: &Endpoint, sink: &EventSink) {
    if !ep.adopted_move().as_ref().is_some_and(|m| m.running()) {
        return;
    }
    let target = ep.mv().target.clone();
    let current = target
        .as_ref()
        .and_then(|(name, _)| ep.objects().get(name).and_then(file_identity));
    let state = if current.is_some() && current == target.map(|(_, id)| id) {
        MoveState::Moved { report: None }
    } else {
        MoveState::Failed {
            error: "the worker died during the move; its replacement runs the device where it was"
                .to_owned(),
        }
    };
    adopted_move_ended(ep, sink, state);
}

/// Whether custody may hold `fd` under `id` (defence in depth: the worker checked the
/// client's descriptors already, see `switchyard_server::fd_kind`): the client's are memory
/// or eventfds; the worker's own are the listening socket, the connection (both UNIX
/// sockets, whose close never blocks) and the black box (memory). A legacy memory object's
/// id holds memory.
fn admissible(id: u64, fd: &OwnedFd) -> Result<(), String> {
    use switchyard_server::continuity::{BLACK_BOX_ID, FIRST_MESSAGE_ID};
    let kind = switchyard_server::fd_kind::fd_kind(fd.as_fd());
    let unix_socket = || {
        rustix::net::getsockname(fd)
            .is_ok_and(|a| a.address_family() == rustix::net::AddressFamily::UNIX)
    };
    let ok = match id {
        LISTENER_ID | CONNECTION_ID => unix_socket(),
        BLACK_BOX_ID => kind == FdKind::Memory,
        id if legacy_object(id).is_some() => kind == FdKind::Memory,
        id if id >= FIRST_MESSAGE_ID => matches!(kind, FdKind::Memory | FdKind::EventFd),
        _ => false,
    };
    if ok {
        Ok(())
    } else {
        Err(format!("{kind:?} under custody id {id}"))
    }
}

/// Holds `fd` as the memory object `name`. A pending object (a relocation's target,
/// [`switchyard_device::kind::pending_object`]) is what a move copies to: its identity tells,
/// should the worker die, whether its replacement runs the device there.
/// Returns false, holding nothing, when the endpoint holds [`MAX_OBJECTS`] other objects
/// already (a worker that does is broken: a device names a few).
fn hold_object(ep: &Endpoint, name: String, fd: OwnedFd) -> bool {
    let target = name
        .strip_suffix(switchyard_device::kind::PENDING_SUFFIX)
        .and_then(|base| Some((base.to_owned(), file_identity(&fd)?)));
    let held = ep.change_objects(|objects| admit_object(objects, name, fd));
    if held && let Some(target) = target {
        ep.mv().target = Some(target);
    }
    held
}

/// Puts `fd` under `name` in `objects`, replacing what was there, unless that would make more
/// than [`MAX_OBJECTS`] (then `fd` is closed and nothing changes).
fn admit_object(objects: &mut BTreeMap<String, OwnedFd>, name: String, fd: OwnedFd) -> bool {
    if objects.len() >= MAX_OBJECTS && !objects.contains_key(&name) {
        return false;
    }
    objects.insert(name, fd);
    true
}

/// Most memory objects one endpoint's custody holds (a device names a few: VRAM, a doorbell
/// page; twice that during a move).
pub(super) const MAX_OBJECTS: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    fn memfd() -> OwnedFd {
        rustix::fs::memfd_create("ledger-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd")
    }

    #[test]
    fn custody_holds_a_bounded_number_of_memory_objects_and_replaces_by_name() {
        let mut objects = BTreeMap::new();
        for i in 0..MAX_OBJECTS {
            assert!(admit_object(&mut objects, format!("k.o{i}"), memfd()));
        }
        assert!(!admit_object(
            &mut objects,
            "k.one-too-many".into(),
            memfd()
        ));
        assert_eq!(objects.len(), MAX_OBJECTS);
        // A name already held is replaced, even at the bound.
        let next = memfd();
        let ino = rustix::fs::fstat(&next).expect("fstat").st_ino;
        assert!(admit_object(&mut objects, "k.o0".into(), next));
        let held = rustix::fs::fstat(&objects["k.o0"]).expect("fstat").st_ino;
        assert_eq!(held, ino);
    }
}

/// How many migration state changes of one endpoint become events: a burst of
/// [`EventBudget::BURST`], then [`EventBudget::PER_SECOND`]. A client can change its device's
/// migration state at message rate; its events must not crowd the other endpoints' out of the
/// daemon's event stream (every change still reaches the daemon's migration bookkeeping).
struct EventBudget {
    tokens: f64,
    last: Instant,
}

impl EventBudget {
    const BURST: f64 = 32.0;
    const PER_SECOND: f64 = 10.0;

    fn new() -> Self {
        Self {
            tokens: Self::BURST,
            last: Instant::now(),
        }
    }

    /// Whether one more event may be published now.
    fn take(&mut self) -> bool {
        let now = Instant::now();
        let refill = now.duration_since(self.last).as_secs_f64() * Self::PER_SECOND;
        self.tokens = (self.tokens + refill).min(Self::BURST);
        self.last = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod event_budget_tests {
    use super::EventBudget;

    #[test]
    fn a_burst_then_nothing_until_it_refills() {
        let mut b = EventBudget::new();
        let granted = (0..1000).filter(|_| b.take()).count();
        assert!((32..=33).contains(&granted), "{granted}");
        std::thread::sleep(std::time::Duration::from_millis(250));
        assert!(b.take(), "refilled after 250 ms");
    }
}
