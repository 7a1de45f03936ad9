//! The VFIO migration v2 state machine, driven by DEVICE_FEATURE MIG_DEVICE_STATE.
//!
//! The server keeps the device's migration state and walks the shortest path from the current
//! to the requested state one direct arc at a time ([`next_arc`], the kernel's
//! `vfio_mig_get_next_state` without P2P), calling [`Migratable::step`](switchyard_device::Migratable::step) for each arc.
//! A failing arc leaves the device in ERROR, from which only a device reset recovers.

use switchyard_device::{MigArc, MigrationCaps, PciDevice};
use switchyard_proto::MigState;

use crate::error::RequestError;
use crate::origin::Origin;

/// The next direct arc from `cur` towards `target`, and the state it reaches; `None` if
/// `target` cannot be reached from `cur` (ERROR, P2P states, STOP_COPY → PRE_COPY, PRE_COPY
/// without device support).
pub(crate) fn next_arc(
    cur: MigState,
    target: MigState,
    caps: MigrationCaps,
) -> Option<(MigArc, MigState)> {
    use MigState::*;
    if matches!(target, Error | RunningP2p | PreCopyP2p) || (target == PreCopy && !caps.precopy) {
        return None;
    }
    let step = match (cur, target) {
        (Stop, Running | PreCopy) => (MigArc::Run, Running),
        (Stop, StopCopy) => (MigArc::StartStopCopy, StopCopy),
        (Stop, Resuming) => (MigArc::StartResuming, Resuming),
        (Running, Stop | StopCopy | Resuming) => (MigArc::Stop, Stop),
        (Running, PreCopy) => (MigArc::StartPreCopy, PreCopy),
        (StopCopy, Stop | Running | Resuming) => (MigArc::EndStopCopy, Stop),
        (Resuming, Stop | Running | StopCopy | PreCopy) => (MigArc::EndResuming, Stop),
        (PreCopy, Running | Stop | Resuming) => (MigArc::AbortPreCopy, Running),
        (PreCopy, StopCopy) => (MigArc::PreCopyToStopCopy, StopCopy),
        _ => return None,
    };
    Some(step)
}

/// Moves `dev` from `*state` to `target`. On success `*state == target`; on a refused target
/// the state is unchanged (`EINVAL`); when an arc fails the state becomes ERROR. `origin`
/// follows the streams the arcs open and close: RESUMING → STOP fails (ERROR, `EPERM`) for a
/// stream whose origin is not the expected one.
pub(crate) fn transition(
    dev: &mut dyn PciDevice,
    state: &mut MigState,
    target: MigState,
    origin: &mut Origin,
) -> Result<(), RequestError> {
    let dev = dev.migration().ok_or(RequestError::Invalid {
        what: "the device cannot migrate",
        errno: libc::ENOTTY,
    })?;
    let caps = dev.caps();
    if matches!(
        target,
        MigState::Error | MigState::RunningP2p | MigState::PreCopyP2p
    ) {
        return Err(RequestError::Invalid {
            what: "migration state cannot be requested",
            errno: libc::EINVAL,
        });
    }
    // Check the whole path before taking any arc: a refused target changes nothing.
    let mut probe = *state;
    while probe != target {
        let (_, next) = next_arc(probe, target, caps).ok_or(RequestError::Invalid {
            what: "migration state transition not allowed",
            errno: libc::EINVAL,
        })?;
        probe = next;
    }
    while *state != target {
        let Some((arc, next)) = next_arc(*state, target, caps) else {
            return Err(RequestError::Invalid {
                what: "migration state transition not allowed",
                errno: libc::EINVAL,
            });
        };
        let stepped = origin
            .before_arc(arc, dev)
            .map_err(RequestError::from)
            .and_then(|()| dev.step(arc).map_err(RequestError::from));
        if let Err(e) = stepped {
            tracing::warn!(error = %e, ?arc, from = ?*state, "migration arc failed; device in ERROR");
            *state = MigState::Error;
            origin.abort();
            return Err(e);
        }
        origin.after_arc(arc);
        tracing::info!(?arc, from = ?*state, to = ?next, "migration state");
        *state = next;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use MigState::*;

    const ALL: [MigState; 8] = [
        Error, Stop, Running, StopCopy, Resuming, RunningP2p, PreCopy, PreCopyP2p,
    ];

    fn path(from: MigState, to: MigState, precopy: bool) -> Option<Vec<MigState>> {
        let caps = MigrationCaps { precopy };
        if matches!(to, Error | RunningP2p | PreCopyP2p) {
            // What `transition` refuses before looking for a path.
            return None;
        }
        let mut cur = from;
        let mut v = vec![cur];
        while cur != to {
            let (_, next) = next_arc(cur, to, caps)?;
            cur = next;
            v.push(cur);
            assert!(
                v.len() <= 4,
                "path {from:?} -> {to:?} does not converge: {v:?}"
            );
        }
        Some(v)
    }

    #[test]
    fn required_direct_arcs_are_single_steps() {
        for (a, b) in [
            (Running, Stop),
            (StopCopy, Stop),
            (Resuming, Stop),
            (PreCopy, Running),
            (Stop, Running),
            (Running, PreCopy),
            (Stop, StopCopy),
            (PreCopy, StopCopy),
            (Stop, Resuming),
        ] {
            assert_eq!(path(a, b, true), Some(vec![a, b]), "{a:?} -> {b:?}");
        }
    }

    #[test]
    fn composite_paths_are_the_kernels() {
        assert_eq!(
            path(Running, StopCopy, true),
            Some(vec![Running, Stop, StopCopy])
        );
        assert_eq!(
            path(Running, Resuming, true),
            Some(vec![Running, Stop, Resuming])
        );
        assert_eq!(
            path(PreCopy, Stop, true),
            Some(vec![PreCopy, Running, Stop])
        );
        assert_eq!(
            path(StopCopy, Running, true),
            Some(vec![StopCopy, Stop, Running])
        );
        assert_eq!(
            path(Resuming, Running, true),
            Some(vec![Resuming, Stop, Running])
        );
        assert_eq!(
            path(Stop, PreCopy, true),
            Some(vec![Stop, Running, PreCopy])
        );
        assert_eq!(
            path(Resuming, PreCopy, true),
            Some(vec![Resuming, Stop, Running, PreCopy])
        );
    }

    #[test]
    fn refused_targets() {
        assert_eq!(path(StopCopy, PreCopy, true), None);
        assert_eq!(path(Running, PreCopy, false), None);
        for s in ALL {
            assert_eq!(path(s, Error, true), None, "{s:?} -> ERROR");
            assert_eq!(path(s, RunningP2p, true), None);
            assert_eq!(path(s, PreCopyP2p, true), None);
        }
        for s in [Stop, Running, StopCopy, Resuming, PreCopy] {
            if s != Error {
                assert_eq!(path(Error, s, true), None, "ERROR -> {s:?}");
            }
        }
    }

    #[test]
    fn saving_states_are_never_interior() {
        for a in [Stop, Running, StopCopy, Resuming, PreCopy] {
            for b in [Stop, Running, StopCopy, Resuming, PreCopy] {
                if let Some(p) = path(a, b, true).filter(|p| p.len() > 2) {
                    for s in &p[1..p.len() - 1] {
                        assert!(!matches!(s, StopCopy | PreCopy | Resuming), "{p:?}");
                    }
                }
            }
        }
    }
}
