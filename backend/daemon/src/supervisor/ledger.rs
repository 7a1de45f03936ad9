//! The custody ledger: a worker's notes on its channel (what it holds and releases, its
//! readiness, stats, moves), kept in the endpoint's held descriptors and status.

use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use crate::custody::{self, CONNECTION_ID, LISTENER_ID, Note, VRAM_NEXT_ID};

use super::launch::Launch;
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
    loop {
        match custody::recv(channel, &mut buf) {
            Ok((Note::Hold { ids }, fds)) => {
                let refused = ep.change_held(|held| {
                    let first = switchyard_server::continuity::FIRST_MESSAGE_ID;
                    let mut client = held.range(first..).count();
                    let mut refused = 0u64;
                    for (id, fd) in ids.into_iter().zip(fds) {
                        if id == VRAM_NEXT_ID {
                            ep.mv().target = file_identity(&fd);
                        }
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
            Ok((Note::Migration { streaming }, _)) => {
                ep.status().migrating = streaming;
                ep.changed.notify_all();
            }
            Ok((Note::Stats(stats), _)) => sink(WorkerEvent::Stats {
                endpoint: ep.spec.id.clone(),
                stats,
            }),
            Ok((Note::Moved { report }, _)) => {
                ep.mv().reply = Some(Ok(report));
                ep.mv_changed.notify_all();
            }
            Ok((Note::MoveFailed { error }, _)) => {
                ep.mv().reply = Some(Err(Some(error)));
                ep.mv_changed.notify_all();
            }
            Ok((Note::Release { ids }, _)) => {
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
            Ok((Note::Ready { resumed }, _)) => {
                ready = true;
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
                    host,
                    reason,
                });
            }
            Ok((other, _)) => tracing::warn!(?other, "unexpected custody note; ignored"),
            Err(custody::ChannelError::Closed) => break,
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
