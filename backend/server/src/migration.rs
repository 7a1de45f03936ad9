//! The VFIO migration v2 state machine, driven by DEVICE_FEATURE MIG_DEVICE_STATE.
//!
//! The server keeps the device's migration state and walks the shortest path from the current
//! to the requested state one direct arc at a time ([`next_arc`], the kernel's
//! `vfio_mig_get_next_state`: its table, states the device does not offer skipped), calling
//! [`Migratable::step`](switchyard_device::Migratable::step) for each arc.
//! A failing arc leaves the device in ERROR, from which only a device reset recovers.

use switchyard_device::{MigArc, MigrationCaps, PciDevice};
use switchyard_proto::MigState;

use crate::error::RequestError;
use crate::origin::Origin;

/// The kernel's `vfio_from_fsm_table`: the next state on the shortest path from `cur` to
/// `target` when every state is offered (saving states are never interior).
fn from_fsm(cur: MigState, target: MigState) -> MigState {
    use MigState::*;
    if cur == target || cur == Error || target == Error {
        return if cur == target { cur } else { Error };
    }
    match (cur, target) {
        (Stop, StopCopy) => StopCopy,
        (Stop, Resuming) => Resuming,
        (Stop, _) => RunningP2p,
        (Running, PreCopy) => PreCopy,
        (Running, _) => RunningP2p,
        (PreCopy, PreCopyP2p | StopCopy) => PreCopyP2p,
        (PreCopy, _) => Running,
        (PreCopyP2p, PreCopy) => PreCopy,
        (PreCopyP2p, StopCopy) => StopCopy,
        (PreCopyP2p, _) => RunningP2p,
        (StopCopy, PreCopy | PreCopyP2p) => Error,
        (StopCopy, _) => Stop,
        (Resuming, _) => Stop,
        (RunningP2p, Running | PreCopy) => Running,
        (RunningP2p, PreCopyP2p) => PreCopyP2p,
        (RunningP2p, _) => Stop,
        (Error, _) => Error,
    }
}

/// Whether the device offers `state` (the kernel's `state_flags_table`).
fn offered(state: MigState, caps: MigrationCaps) -> bool {
    use MigState::*;
    match state {
        Stop | Running | StopCopy | Resuming => true,
        RunningP2p => caps.p2p,
        PreCopy => caps.precopy,
        PreCopyP2p => caps.p2p && caps.precopy,
        Error => false,
    }
}

/// The arc that takes a device from `from` to `to`, two adjacent states.
fn arc(from: MigState, to: MigState) -> Option<MigArc> {
    use MigState::*;
    Some(match (from, to) {
        (Running, Stop) => MigArc::Stop,
        (Stop, Running) => MigArc::Run,
        (Running, PreCopy) => MigArc::StartPreCopy,
        (PreCopy, Running) => MigArc::AbortPreCopy,
        (PreCopy, StopCopy) => MigArc::PreCopyToStopCopy,
        (Stop, StopCopy) => MigArc::StartStopCopy,
        (StopCopy, Stop) => MigArc::EndStopCopy,
        (Stop, Resuming) => MigArc::StartResuming,
        (Resuming, Stop) => MigArc::EndResuming,
        (Running, RunningP2p) | (PreCopy, PreCopyP2p) => MigArc::EnterP2p,
        (RunningP2p, Running) | (PreCopyP2p, PreCopy) => MigArc::LeaveP2p,
        (RunningP2p, Stop) => MigArc::StopFromP2p,
        (Stop, RunningP2p) => MigArc::P2pFromStop,
        (RunningP2p, PreCopyP2p) => MigArc::StartPreCopyP2p,
        (PreCopyP2p, RunningP2p) => MigArc::AbortPreCopyP2p,
        (PreCopyP2p, StopCopy) => MigArc::PreCopyP2pToStopCopy,
        _ => return None,
    })
}

/// The next direct arc from `cur` towards `target`, and the state it reaches; `None` if
/// `target` cannot be reached from `cur` (ERROR, a state the device does not offer,
/// STOP_COPY → PRE_COPY).
pub(crate) fn next_arc(
    cur: MigState,
    target: MigState,
    caps: MigrationCaps,
) -> Option<(MigArc, MigState)> {
    if cur == target || !offered(cur, caps) || !offered(target, caps) {
        return None;
    }
    // As the kernel: states the device does not offer are passed through.
    let mut next = from_fsm(cur, target);
    while next != MigState::Error && !offered(next, caps) {
        next = from_fsm(next, target);
    }
    if next == MigState::Error {
        return None;
    }
    // Without a state in between, the two direct neighbours of the full table may be
    // linked by an arc the table does not list (RUNNING → STOP without RUNNING_P2P):
    // the device's arc of that pair.
    arc(cur, next).map(|a| (a, next))
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
    if target == MigState::Error || !offered(target, caps) {
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
        path_with(
            from,
            to,
            MigrationCaps {
                precopy,
                p2p: false,
            },
        )
    }

    fn path_with(from: MigState, to: MigState, caps: MigrationCaps) -> Option<Vec<MigState>> {
        if to == Error || !offered(to, caps) {
            // What `transition` refuses before looking for a path.
            return None;
        }
        let mut cur = from;
        let mut v = vec![cur];
        while cur != to {
            let (_, next) = next_arc(cur, to, caps)?;
            cur = next;
            v.push(cur);
            // The longest: RESUMING → STOP → RUNNING_P2P → RUNNING → PRE_COPY.
            assert!(
                v.len() <= 4 + usize::from(caps.p2p),
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

    const P2P: MigrationCaps = MigrationCaps {
        precopy: true,
        p2p: true,
    };

    fn p2p(from: MigState, to: MigState) -> Option<Vec<MigState>> {
        path_with(from, to, P2P)
    }

    /// With P2P every path is the kernel's `vfio_mig_get_next_state` with all states.
    #[test]
    fn p2p_paths_are_the_kernels() {
        for (a, b, want) in [
            (Running, Stop, vec![Running, RunningP2p, Stop]),
            (Stop, Running, vec![Stop, RunningP2p, Running]),
            (Running, RunningP2p, vec![Running, RunningP2p]),
            (RunningP2p, Running, vec![RunningP2p, Running]),
            (Stop, RunningP2p, vec![Stop, RunningP2p]),
            (RunningP2p, Stop, vec![RunningP2p, Stop]),
            (PreCopy, PreCopyP2p, vec![PreCopy, PreCopyP2p]),
            (PreCopyP2p, PreCopy, vec![PreCopyP2p, PreCopy]),
            (PreCopy, StopCopy, vec![PreCopy, PreCopyP2p, StopCopy]),
            (PreCopyP2p, StopCopy, vec![PreCopyP2p, StopCopy]),
            (RunningP2p, PreCopyP2p, vec![RunningP2p, PreCopyP2p]),
            (PreCopyP2p, RunningP2p, vec![PreCopyP2p, RunningP2p]),
            (Running, StopCopy, vec![Running, RunningP2p, Stop, StopCopy]),
            (Resuming, Running, vec![Resuming, Stop, RunningP2p, Running]),
            (Resuming, RunningP2p, vec![Resuming, Stop, RunningP2p]),
            (StopCopy, Running, vec![StopCopy, Stop, RunningP2p, Running]),
            (PreCopy, Stop, vec![PreCopy, Running, RunningP2p, Stop]),
            (PreCopyP2p, Running, vec![PreCopyP2p, RunningP2p, Running]),
            (Running, PreCopyP2p, vec![Running, RunningP2p, PreCopyP2p]),
            (Stop, PreCopyP2p, vec![Stop, RunningP2p, PreCopyP2p]),
            (Stop, PreCopy, vec![Stop, RunningP2p, Running, PreCopy]),
            (
                Resuming,
                PreCopy,
                vec![Resuming, Stop, RunningP2p, Running, PreCopy],
            ),
        ] {
            assert_eq!(p2p(a, b), Some(want), "{a:?} -> {b:?}");
        }
        assert_eq!(p2p(StopCopy, PreCopy), None);
        assert_eq!(p2p(StopCopy, PreCopyP2p), None);
        for s in ALL {
            assert_eq!(p2p(s, Error), None);
            assert_eq!(p2p(Error, s), None);
        }
    }

    /// Every arc of a P2P path is one the device has, and no path opens a stream on the
    /// way: RESUMING is never interior, and the saving group (PRE_COPY, PRE_COPY_P2P,
    /// STOP_COPY, one stream) is interior only between two of its own states.
    #[test]
    fn p2p_saving_states_are_never_interior_and_every_step_is_an_arc() {
        let states = [
            Stop, Running, StopCopy, Resuming, RunningP2p, PreCopy, PreCopyP2p,
        ];
        for a in states {
            for b in states {
                let Some(p) = p2p(a, b) else {
                    assert!(
                        a == StopCopy && matches!(b, PreCopy | PreCopyP2p),
                        "{a:?} -> {b:?} refused"
                    );
                    continue;
                };
                for w in p.windows(2) {
                    assert!(arc(w[0], w[1]).is_some(), "{p:?}");
                }
                let saving = |s: &MigState| matches!(s, StopCopy | PreCopy | PreCopyP2p);
                let within = saving(&a) && saving(&b);
                for s in p.iter().skip(1).take(p.len().saturating_sub(2)) {
                    assert!(*s != Resuming && (within || !saving(s)), "{p:?}");
                }
            }
        }
    }

    /// A device without P2P: its paths never touch a P2P state, and P2P targets are
    /// refused.
    #[test]
    fn without_p2p_no_path_touches_a_p2p_state() {
        for a in [Stop, Running, StopCopy, Resuming, PreCopy] {
            for b in [Stop, Running, StopCopy, Resuming, PreCopy] {
                if let Some(p) = path(a, b, true) {
                    assert!(!p.iter().any(|s| matches!(s, RunningP2p | PreCopyP2p)));
                }
            }
        }
    }

    /// A device that records its arcs.
    struct Arcs {
        inner: crate::test_utils::MockDevice,
        caps: MigrationCaps,
        taken: Vec<MigArc>,
        fail: Option<MigArc>,
    }

    impl PciDevice for Arcs {
        fn description(&self) -> &switchyard_device::DeviceDescription {
            self.inner.description()
        }
        fn region_read(&mut self, r: u32, o: u64, d: &mut [u8]) -> switchyard_device::Result<()> {
            self.inner.region_read(r, o, d)
        }
        fn region_write(&mut self, r: u32, o: u64, d: &[u8]) -> switchyard_device::Result<()> {
            self.inner.region_write(r, o, d)
        }
        fn reset(&mut self) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn migration(&mut self) -> Option<&mut dyn switchyard_device::Migratable> {
            Some(self)
        }
    }

    impl switchyard_device::Migratable for Arcs {
        fn caps(&self) -> MigrationCaps {
            self.caps
        }
        fn step(&mut self, arc: MigArc) -> switchyard_device::Result<()> {
            if self.fail == Some(arc) {
                return Err(switchyard_device::DeviceError::Unsupported);
            }
            self.taken.push(arc);
            Ok(())
        }
        fn read(&mut self, _: &mut [u8]) -> switchyard_device::Result<usize> {
            Ok(0)
        }
        fn write(&mut self, _: &[u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn abort(&mut self) {}
    }

    fn arcs(caps: MigrationCaps) -> Arcs {
        Arcs {
            inner: crate::test_utils::MockDevice::new(),
            caps,
            taken: Vec::new(),
            fail: None,
        }
    }

    /// A refused target takes no arc and leaves the state; a device without P2P is never
    /// asked for a P2P state; the source's and the destination's P2P walks take the arcs
    /// QEMU's multi-device migration needs.
    #[test]
    fn transitions_take_the_arcs_and_refusals_change_nothing() {
        let mut origin = Origin::new(None, None);
        let mut dev = arcs(MigrationCaps {
            precopy: true,
            p2p: false,
        });
        let mut state = Running;
        for target in [RunningP2p, PreCopyP2p, Error] {
            assert!(transition(&mut dev, &mut state, target, &mut origin).is_err());
            assert_eq!(state, Running);
            assert!(dev.taken.is_empty(), "{:?}", dev.taken);
        }
        transition(&mut dev, &mut state, StopCopy, &mut origin).expect("stop copy");
        assert_eq!(dev.taken, [MigArc::Stop, MigArc::StartStopCopy]);
        assert!(transition(&mut dev, &mut state, PreCopy, &mut origin).is_err());
        assert_eq!(
            state, StopCopy,
            "STOP_COPY -> PRE_COPY refused, nothing changed"
        );

        // The source of a VM with two devices: PRE_COPY, both quiesced, then STOP_COPY.
        let mut dev = arcs(P2P);
        let mut state = Running;
        for target in [PreCopy, PreCopyP2p, StopCopy, Stop] {
            transition(&mut dev, &mut state, target, &mut origin).expect("source walk");
        }
        assert_eq!(
            dev.taken,
            [
                MigArc::StartPreCopy,
                MigArc::EnterP2p,
                MigArc::PreCopyP2pToStopCopy,
                MigArc::EndStopCopy
            ]
        );
        // The destination: RESUMING, then RUNNING_P2P (the load), then RUNNING.
        let mut dev = arcs(P2P);
        let mut state = Running;
        for target in [Resuming, RunningP2p, Running] {
            transition(&mut dev, &mut state, target, &mut origin).expect("destination walk");
        }
        assert_eq!(
            dev.taken,
            [
                MigArc::EnterP2p,
                MigArc::StopFromP2p,
                MigArc::StartResuming,
                MigArc::EndResuming,
                MigArc::P2pFromStop,
                MigArc::LeaveP2p
            ]
        );
        // A failing arc leaves ERROR.
        let mut dev = arcs(P2P);
        dev.fail = Some(MigArc::EnterP2p);
        let mut state = Running;
        assert!(transition(&mut dev, &mut state, RunningP2p, &mut origin).is_err());
        assert_eq!(state, Error);
    }
}
