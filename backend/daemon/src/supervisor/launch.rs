//! Starting workers: the supervision loop of an endpoint, which starts a worker, hands it
//! what is held, and replaces it when it dies (with the crash-loop policy's stages).

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use switchyard_server::DeviceSocket;

use crate::custody::{self, CONNECTION_ID, LISTENER_ID, Note, StartMode, WorkerNonce};
use crate::lifecycle::WorkerLifecycle;

pub(super) use super::common::Launch;
use super::ledger::serve_notes;
use super::sink::{EventSink, Report, WorkerSignal};
use super::{Endpoint, kill};

/// Crash-loop policy: this many workers dying without reporting ready, in a row, and the
/// supervisor gives up on the endpoint.
const MAX_FAILED_STARTS: u32 = 8;
/// After this many failed starts in a row, the client's connection and descriptors are
/// dropped: what a client sent (too many descriptors, a state that crashes its restore) must
/// not fail the endpoint for good. The next worker resumes the device without a client.
const DROP_CLIENT_AFTER: u32 = 3;
/// After this many, the device's own state goes too (black box, VRAM, doorbell page): the
/// next worker starts a fresh device.
const START_FRESH_AFTER: u32 = 5;
/// Pause between starts once starts fail.
const FAILED_START_PAUSE: Duration = Duration::from_millis(250);

/// Supervises `ep`: first the adopted worker `adopted` (its channel, pid and the nonce it
/// proved) if any, then workers it starts itself, replacing each that dies.
pub(super) fn supervise(
    ep: &Endpoint,
    exe: &Path,
    sink: &EventSink,
    launch: Launch<'_>,
    adopted: Option<(OwnedFd, u32, Option<WorkerNonce>)>,
) {
    let span = tracing::info_span!("endpoint", id = %ep.spec.id);
    let _g = span.enter();
    let mut failed_starts = 0u32;
    let mut died_at: Option<Instant> = None;
    let mut recent: VecDeque<Instant> = VecDeque::new();
    if let Some((channel, pid, nonce)) = adopted {
        supervise_adopted(ep, sink, launch, channel, (pid, nonce.as_ref()));
        died_at = Some(Instant::now());
    }
    while !ep.stopping.load(Ordering::SeqCst) {
        let mode = ep.start_mode();
        if mode == StartMode::Fresh {
            // Until it reports ready, what a fresh worker left in custody is no device to
            // resume: its replacement starts fresh too.
            ep.record_replacement(StartMode::Fresh);
        }
        let ready = match run_worker(ep, exe, mode, died_at, sink, launch) {
            Ok(ready) => ready,
            Err(e) => {
                tracing::error!(error = %e, "cannot start a worker");
                false
            }
        };
        died_at = Some(Instant::now());
        ep.status().pid = None;
        if ep.stopping.load(Ordering::SeqCst) {
            break;
        }
        if ready {
            failed_starts = 0;
        } else {
            failed_starts += 1;
            if failed_starts >= MAX_FAILED_STARTS {
                tracing::error!(
                    attempts = failed_starts,
                    "workers keep dying before they serve; giving the endpoint up (its client is disconnected, new connections are refused)"
                );
                ep.change_held(|held| held.clear());
                ep.change_objects(|objects| objects.clear());
                refuse_connections(&ep.socket);
                let mut st = ep.status();
                st.failed = true;
                ep.changed.notify_all();
                drop(st);
                let endpoint = ep.spec.id.clone();
                sink.lifecycle(WorkerLifecycle::GaveUp { endpoint });
                return;
            }
            let fresh = failed_starts >= START_FRESH_AFTER;
            if let Some(what) = let_go(ep, failed_starts >= DROP_CLIENT_AFTER, fresh) {
                tracing::warn!(
                    attempts = failed_starts,
                    "workers keep dying before they serve: {what}"
                );
                let endpoint = ep.spec.id.clone();
                sink.lifecycle(WorkerLifecycle::Reset { endpoint, what });
            }
            std::thread::sleep(FAILED_START_PAUSE);
        }
        recent.push_back(Instant::now());
        while recent.len() > 10 {
            recent.pop_front();
        }
        let mut st = ep.status();
        st.restarts += 1;
        ep.changed.notify_all();
        drop(st);
        tracing::warn!(mode = ?ep.start_mode(), "worker gone; starting a replacement");
    }
}

/// After failed starts: lets go of the client (`client`: its connection and descriptors),
/// or of everything (`fresh`: the device's state too), so that the next worker starts
/// without what kept its predecessors from serving. Returns what was let go, if anything.
pub(super) fn let_go(ep: &Endpoint, client: bool, fresh: bool) -> Option<String> {
    if fresh {
        ep.record_replacement(StartMode::Fresh);
    }
    let objects = fresh && ep.change_objects(|objects| std::mem::take(objects).len()) > 0;
    ep.change_held(|held| {
        if fresh && (objects || !held.is_empty()) {
            held.clear();
            return Some(
                "the device's state and its client were let go; the next worker starts a fresh device"
                    .to_owned(),
            );
        }
        let first = switchyard_server::continuity::FIRST_MESSAGE_ID;
        let descriptors = held.range(first..).count();
        if client && (descriptors > 0 || held.contains_key(&CONNECTION_ID)) {
            held.retain(|id, _| *id < first && *id != CONNECTION_ID);
            return Some(format!(
                "the client's connection and its {descriptors} descriptors were let go; the next worker resumes the device without a client"
            ));
        }
        None
    })
}

/// A given-up endpoint refuses connections (they would hang: no worker accepts them). The
/// socket stays bound, so its path is not taken by anyone else; connections already queued
/// are closed.
fn refuse_connections(socket: &DeviceSocket) {
    let listener = socket.listener();
    if let Err(e) = rustix::net::shutdown(listener, rustix::net::Shutdown::Both) {
        tracing::warn!(error = %e, "cannot shut the endpoint's socket; connections will hang");
    }
    if listener.set_nonblocking(true).is_ok() {
        while listener.accept().is_ok() {}
    }
}

/// Starts one worker and serves its custody notes until it dies. Returns whether it
/// reported ready.
fn run_worker(
    ep: &Endpoint,
    exe: &Path,
    mode: StartMode,
    died_at: Option<Instant>,
    sink: &EventSink,
    launch: Launch<'_>,
) -> std::io::Result<bool> {
    let adopt_dir = launch.adopt_dir;
    let (ours, theirs) = custody::pair()?;
    // Made before the process, given to it and written in its record (the sink's).
    let nonce = WorkerNonce::generate()?;
    let mut child: Child = Command::new(exe)
        .arg("worker")
        .args((!launch.jail).then_some("--no-jail"))
        .stdin(Stdio::from(theirs))
        // Its own process group: a terminal's Ctrl-C to the daemon does not reach it.
        .process_group(0)
        // systemd's notification socket is the daemon's (NotifyAccess=main): a worker, which
        // outlives the daemon, has nothing to tell the service manager.
        .env_remove("NOTIFY_SOCKET")
        .spawn()?;
    let pid = child.id();
    {
        let mut st = ep.status();
        st.pid = Some(pid);
        st.lease = ep.lease();
        if ep.stopping.load(Ordering::SeqCst) {
            // `delete` ran between the check in `supervise` and the spawn.
            let _ = child.kill();
        }
    }
    let started = WorkerLifecycle::Started {
        endpoint: ep.spec.id.clone(),
        pid,
        resume: mode == StartMode::Resume,
    };
    sink.lifecycle(started);
    sink.signal(WorkerSignal::Spawned {
        endpoint: ep.spec.id.clone(),
        pid,
        nonce: nonce.clone(),
    });
    let started = Instant::now();
    let handed = hand_over(ep, &ours, mode, launch, &nonce);
    *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) = ours.try_clone().ok();
    let mut ready = false;
    if let Err(e) = handed {
        tracing::error!(error = %e, "cannot hand the endpoint's descriptors to the worker");
        let _ = child.kill();
    } else {
        ready = serve_notes(ep, &ours, pid, died_at, started, sink, launch, &|| {
            kill(Some(pid));
        });
        // A re-exec: the process lives on in a new image, which waits to be adopted.
        while take_reexec(ep) {
            let t0 = Instant::now();
            let mut alive = || matches!(child.try_wait(), Ok(None));
            match readopt(ep, &mut alive, (pid, Some(&nonce)), launch) {
                Some(channel) => {
                    *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) =
                        channel.try_clone().ok();
                    let again = serve_notes(ep, &channel, pid, Some(t0), t0, sink, launch, &|| {
                        kill(Some(pid));
                    });
                    ready = ready || again;
                }
                None => {
                    kill(Some(pid));
                    break;
                }
            }
        }
    }
    *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) = None;
    end_move_on_death(ep);
    // A restart abandons a migration (its replacement starts RUNNING).
    ep.status().migrating = false;
    let status = child.wait()?;
    if let Some(dir) = adopt_dir {
        let _ = std::fs::remove_file(crate::keeper::adoption_path(dir, pid));
    }
    tracing::info!(pid, %status, "worker exited");
    let exited = WorkerLifecycle::Exited {
        endpoint: ep.spec.id.clone(),
        pid,
        status: status.to_string(),
    };
    sink.lifecycle(exited);
    Ok(ready)
}

/// Whether a re-exec of the worker was asked and not taken up yet (taken up now).
fn take_reexec(ep: &Endpoint) -> bool {
    let asked = ep.reexec_asked.load(Ordering::SeqCst);
    ep.reexec_taken.swap(asked, Ordering::SeqCst) < asked
}

/// How long a re-executed image may take to offer its adoption socket.
const READOPT_WAIT: Duration = Duration::from_secs(10);

/// The worker `pid` re-executed itself ([`Note::Reexec`]): adopts the new image through its
/// adoption socket, which hands over the whole ledger (the new image's, which is what the
/// old one held: notes the old image had not sent yet are in it), once it proves the
/// process's `nonce`. Returns the new custody channel; `None` when the process died or did
/// not offer its socket in time (then killed).
fn readopt(
    ep: &Endpoint,
    alive: &mut dyn FnMut() -> bool,
    (pid, nonce): (u32, Option<&WorkerNonce>),
    launch: Launch<'_>,
) -> Option<OwnedFd> {
    let Some(dir) = launch.adopt_dir else {
        tracing::error!(
            pid,
            "a re-exec without an adoption directory cannot be followed"
        );
        return None;
    };
    let path = crate::keeper::adoption_path(dir, pid);
    let deadline = Instant::now() + READOPT_WAIT;
    loop {
        if !alive() {
            tracing::error!(pid, "the worker died while re-executing");
            return None;
        }
        match super::handover::adopt_from(&path, &ep.spec.id, pid, nonce) {
            Ok(adoption) => {
                tracing::info!(
                    pid,
                    lease = ?adoption.lease,
                    "re-executed worker adopted"
                );
                return Some(install(ep, adoption));
            }
            Err(e) if Instant::now() >= deadline => {
                tracing::error!(pid, error = %e, "the re-executed worker cannot be adopted");
                return None;
            }
            // Not bound yet (the old image's socket file stays until the new one rebinds).
            Err(_) => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// Takes what a re-adopted image handed over as what the supervisor holds; returns its
/// channel.
fn install(ep: &Endpoint, a: super::handover::Adoption) -> OwnedFd {
    let mut held = a.held;
    // The supervisor has the listening socket already.
    held.remove(&LISTENER_ID);
    ep.change_objects(|objects| *objects = a.objects);
    ep.change_held(|h| *h = held);
    if let Some(mode) = a.replacement {
        ep.record_replacement(mode);
    }
    if a.lease.is_some() {
        ep.status().lease = a.lease;
    }
    a.channel
}

/// A move (or a fault injection) waiting for the worker that just died learns it.
pub(super) fn end_move_on_death(ep: &Endpoint) {
    {
        let mut fault = ep.fault.lock().unwrap_or_else(|p| p.into_inner());
        if fault.is_none() {
            *fault = Some(Some("the worker exited before it answered".to_owned()));
            ep.fault_answered.notify_all();
        }
    }
    let mut mv = ep.mv();
    if mv.active && mv.reply.is_none() {
        mv.reply = Some(Err(None));
        ep.mv_changed.notify_all();
    }
}

/// Whether `pid` runs (exists and is no zombie).
fn running(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let zombie = stat
        .rfind(')')
        .is_some_and(|i| stat[i + 1..].trim_start().starts_with('Z'));
    !stat.is_empty() && !zombie
}

/// Waits (bounded) until `pid` no longer runs (gone, or a zombie).
pub(super) fn wait_gone(pid: u32, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        if !running(pid) {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    tracing::error!(pid, "the worker does not die");
}

fn hand_over(
    ep: &Endpoint,
    sock: &OwnedFd,
    mode: StartMode,
    launch: Launch<'_>,
    nonce: &WorkerNonce,
) -> Result<(), custody::ChannelError> {
    let held = ep.held();
    let listener = ep.socket.listener().as_fd();
    let mut all: Vec<(u64, BorrowedFd<'_>)> = vec![(LISTENER_ID, listener)];
    all.extend(held.iter().map(|(id, fd)| (*id, fd.as_fd())));
    for batch in all.chunks(custody::MAX_FDS) {
        let ids = batch.iter().map(|(id, _)| *id).collect();
        let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, fd)| *fd).collect();
        custody::send(sock, &Note::Fds { ids }, &fds)?;
    }
    drop(held);
    let objects = ep.objects();
    let all: Vec<(&String, BorrowedFd<'_>)> =
        objects.iter().map(|(n, fd)| (n, fd.as_fd())).collect();
    for batch in all.chunks(custody::MAX_FDS) {
        let names = batch.iter().map(|(n, _)| (*n).clone()).collect();
        let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, fd)| *fd).collect();
        custody::send(sock, &Note::Objects { names }, &fds)?;
    }
    drop(all);
    drop(objects);
    custody::send(
        sock,
        &Note::Start {
            mode,
            endpoint: ep.spec.id.clone(),
            socket: ep.spec.socket.display().to_string(),
            device: ep.device(),
            adopt_dir: launch.adopt_dir.map(|d| d.display().to_string()),
            fd_budget: launch.fd_budget,
            restarts: ep.status().restarts,
            failover: ep.spec.failover,
            lease: ep.lease(),
            nonce: Some(nonce.clone()),
            migration: crate::custody::MigrationSettings {
                idle_timeout_ms: ep.spec.migration.idle_timeout_ms.or(launch
                    .migration_idle
                    .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))),
                ..ep.spec.migration.clone()
            },
        },
        &[],
    )
}

/// The status of an adopted worker's [`WorkerLifecycle::Exited`]: the worker is not the daemon's
/// child, so its exit status is not the daemon's to read.
const ADOPTED_EXIT_STATUS: &str = "unknown (an adopted worker, not the daemon's child)";

/// Supervises the adopted worker `pid` (its custody `channel`, the `nonce` it proved) until
/// it dies: not our child, so it is not waited for; a replacement is started by
/// [`supervise`] afterwards.
fn supervise_adopted(
    ep: &Endpoint,
    sink: &EventSink,
    launch: Launch<'_>,
    channel: OwnedFd,
    (pid, nonce): (u32, Option<&WorkerNonce>),
) {
    let adopt_dir = launch.adopt_dir;
    // The adopted ledger against the budget: a worker of an older daemon may hold more
    // for its client than this one allows (descriptors of messages it never handled).
    // A replacement keeps what the tables and the journal refer to and releases the rest.
    let client = ep.status().client_fds;
    if let Some(budget) = launch.fd_budget
        && client > budget as usize
    {
        let what = format!(
            "the adopted worker holds {client} client descriptors, over the budget of \
             {budget}: replaced, so that what no DMA window, eventfd or message in flight \
             refers to is released"
        );
        tracing::warn!(pid, client, budget, "{what}");
        let endpoint = ep.spec.id.clone();
        sink.lifecycle(WorkerLifecycle::Reset { endpoint, what });
        kill(Some(pid));
    }
    serve_notes(
        ep,
        &channel,
        pid,
        None,
        Instant::now(),
        sink,
        launch,
        &|| {
            kill(Some(pid));
        },
    );
    // A re-exec: the process lives on in a new image, which waits to be adopted.
    while take_reexec(ep) {
        let t0 = Instant::now();
        let mut alive = || running(pid);
        let Some(channel) = readopt(ep, &mut alive, (pid, nonce), launch) else {
            break;
        };
        *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) = channel.try_clone().ok();
        serve_notes(ep, &channel, pid, Some(t0), t0, sink, launch, &|| {
            kill(Some(pid));
        });
    }
    // Not our child: it cannot be waited for. It closed its channel by dying (or is
    // made to): a replacement must not serve next to it.
    kill(Some(pid));
    wait_gone(pid, Duration::from_secs(5));
    *ep.channel.lock().unwrap_or_else(|p| p.into_inner()) = None;
    end_move_on_death(ep);
    if let Some(dir) = adopt_dir {
        let _ = std::fs::remove_file(crate::keeper::adoption_path(dir, pid));
    }
    tracing::info!(pid, "adopted worker gone");
    // The same event as for a worker of this supervisor's own (`run_worker`), so that the
    // events count every worker that ended; its exit status went to its parent.
    let exited = WorkerLifecycle::Exited {
        endpoint: ep.spec.id.clone(),
        pid,
        status: ADOPTED_EXIT_STATUS.to_owned(),
    };
    sink.lifecycle(exited);
    ep.status().pid = None;
    if !ep.stopping.load(Ordering::SeqCst) {
        let mut st = ep.status();
        st.restarts += 1;
        ep.changed.notify_all();
    }
}
