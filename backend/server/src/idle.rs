//! The migration watchdog: an open migration stream (PRE_COPY, STOP_COPY, RESUMING) with no
//! activity for the idle timeout ([`ServerConfig::migration_idle_timeout`](crate::ServerConfig::migration_idle_timeout))
//! is ended.
//!
//! Ending it abandons the migration as a client's departure does: the device drops the stream
//! and runs ([`Migratable::abort`](switchyard_device::Migratable::abort)), the state is RUNNING
//! and the migration hook is told (cause [`MigCause::IdleTimeout`]). RUNNING rather than ERROR:
//! nothing failed in the device, and ERROR would leave a source whose guest was stopped in
//! STOP_COPY without its device until a reset (QEMU resets a device it cannot put back into
//! RUNNING, and the guest's device state with it); a destination abandoned in RESUMING runs
//! the fresh device it had, and its VMM's next MIG_DATA_WRITE is refused.
//!
//! One thread per server waits on the slot's condition variable (the wait releases the slot's
//! lock): a change of the migration state wakes it to compute the deadline again, and the
//! server's drop ends it.

use std::time::{Duration, Instant};

use switchyard_proto::MigState;

use crate::slot::{DeviceSlot, MigCause};

/// How long the watchdog sleeps when no stream is open (a state change wakes it sooner).
const IDLE_NAP: Duration = Duration::from_secs(3600);

/// Whether `state` has a migration stream open.
pub(crate) fn streaming(state: MigState) -> bool {
    matches!(
        state,
        MigState::PreCopy | MigState::PreCopyP2p | MigState::StopCopy | MigState::Resuming
    )
}

/// Starts the watchdog of `slot`: streams idle for `timeout` are ended. It ends once the slot
/// is closed (`DeviceSlot::close`).
pub(crate) fn spawn(
    slot: &DeviceSlot,
    timeout: Duration,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    let slot = slot.clone();
    std::thread::Builder::new()
        .name("sy-mig-idle".into())
        .spawn(move || watch(&slot, timeout))
}

fn watch(slot: &DeviceSlot, timeout: Duration) {
    let mut s = slot.lock();
    let watch = s.watch.clone();
    while !s.closed {
        let wait = if streaming(s.mig) {
            let due = s.mig_touched + timeout;
            let now = Instant::now();
            if now >= due {
                tracing::warn!(
                    state = ?s.mig,
                    timeout_ms = timeout.as_millis() as u64,
                    "migration stream idle for too long; migration abandoned, the device runs"
                );
                s.abandon_migration(MigCause::IdleTimeout);
                continue;
            }
            due - now
        } else {
            IDLE_NAP
        };
        s = watch
            .wait_timeout(s, wait)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::mpsc;

    use switchyard_device::{DeviceDescription, MigArc, Migratable, MigrationCaps, PciDevice};

    use super::*;
    use crate::MigChange;
    use crate::test_utils::{MockDevice, slot_with};

    /// The mock device, migrating: an empty stream; aborts counted.
    struct Migrating {
        inner: MockDevice,
        aborts: Arc<AtomicU32>,
    }

    impl PciDevice for Migrating {
        fn description(&self) -> &DeviceDescription {
            self.inner.description()
        }
        fn region_read(&mut self, i: u32, o: u64, b: &mut [u8]) -> switchyard_device::Result<()> {
            self.inner.region_read(i, o, b)
        }
        fn region_write(&mut self, i: u32, o: u64, b: &[u8]) -> switchyard_device::Result<()> {
            self.inner.region_write(i, o, b)
        }
        fn reset(&mut self) -> switchyard_device::Result<()> {
            self.inner.reset()
        }
        fn migration(&mut self) -> Option<&mut dyn Migratable> {
            Some(self)
        }
    }

    impl Migratable for Migrating {
        fn caps(&self) -> MigrationCaps {
            MigrationCaps {
                precopy: true,
                p2p: false,
            }
        }
        fn step(&mut self, _: MigArc) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn read(&mut self, _: &mut [u8]) -> switchyard_device::Result<usize> {
            Ok(0)
        }
        fn write(&mut self, _: &[u8]) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn abort(&mut self) {
            self.aborts.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// What the client's MIG_DEVICE_STATE request does to the slot.
    fn request(slot: &DeviceSlot, target: MigState) {
        let mut s = slot.lock();
        let s = &mut *s;
        let before = s.mig;
        s.mig_touched = Instant::now();
        crate::migration::transition(&mut *s.device, &mut s.mig, target, &mut s.origin)
            .expect("transition");
        s.mig_changed(before, MigCause::Request);
    }

    #[test]
    fn an_idle_stream_is_ended_a_timeout_after_its_last_activity() {
        const TIMEOUT: Duration = Duration::from_millis(300);
        let aborts = Arc::new(AtomicU32::new(0));
        let slot = slot_with(
            Box::new(Migrating {
                inner: MockDevice::new(),
                aborts: aborts.clone(),
            }),
            4,
        );
        let (tx, rx) = mpsc::channel::<(MigChange, Instant)>();
        let tx = std::sync::Mutex::new(tx);
        slot.set_migration_hook(Arc::new(move |c| {
            let _ = tx
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .send((c, Instant::now()));
        }));
        let watchdog = spawn(&slot, TIMEOUT).expect("watchdog");
        let next = || rx.recv_timeout(Duration::from_secs(10)).expect("a change");
        // STOP has no stream open: however long it lasts, the timeout counts from PRE_COPY.
        request(&slot, MigState::Stop);
        assert_eq!(next().0.to, MigState::Stop);
        std::thread::sleep(TIMEOUT * 2);
        request(&slot, MigState::PreCopy);
        let (opened, _) = next();
        assert_eq!(
            (opened.from, opened.to),
            (MigState::Stop, MigState::PreCopy)
        );
        // Activity (MIG_DATA_READ) keeps the stream open past the timeout.
        let mut last = Instant::now();
        for _ in 0..4 {
            std::thread::sleep(TIMEOUT / 2);
            let mut s = slot.lock();
            assert_eq!(s.mig, MigState::PreCopy, "ended while active");
            s.mig_touched = Instant::now();
            last = s.mig_touched;
        }
        let (ended, at) = next();
        assert_eq!(
            (ended.from, ended.to, ended.cause),
            (MigState::PreCopy, MigState::Running, MigCause::IdleTimeout)
        );
        assert!(
            at >= last + TIMEOUT,
            "ended {:?} after the last activity",
            at - last
        );
        assert_eq!(
            aborts.load(Ordering::SeqCst),
            1,
            "the device dropped its stream"
        );
        assert_eq!(slot.lock().mig, MigState::Running);
        // RESUMING is a stream too; the server's end stops the watchdog.
        request(&slot, MigState::Resuming);
        assert_eq!(next().0.to, MigState::Resuming);
        let (ended, _) = next();
        assert_eq!(
            (ended.from, ended.cause),
            (MigState::Resuming, MigCause::IdleTimeout)
        );
        slot.close();
        watchdog
            .join()
            .expect("the watchdog ends once the slot is closed");
    }
}
