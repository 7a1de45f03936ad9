//! The DMA space and its device's observer: observers run with no lock of the space held, and
//! what accesses, maps and unmaps see meanwhile.

use std::fs::File;
use std::sync::{Arc, Mutex};

use super::tests::{memfd, set_bits};
use super::*;

/// An observer whose calls for one IOVA block until the test releases them (VFIO pinning a
/// large window, a GPU registering it): it says on a channel when such a call entered.
struct SlowObserver {
    slow_iova: u64,
    entered: Mutex<std::sync::mpsc::Sender<&'static str>>,
    release: Mutex<std::sync::mpsc::Receiver<()>>,
    calls: Mutex<Vec<(&'static str, u64)>>,
}

type SlowParts = (
    Arc<SlowObserver>,
    std::sync::mpsc::Receiver<&'static str>,
    std::sync::mpsc::Sender<()>,
);

impl SlowObserver {
    fn new(slow_iova: u64) -> SlowParts {
        let (entered, entered_rx) = std::sync::mpsc::channel();
        let (release_tx, release) = std::sync::mpsc::channel();
        let o = Arc::new(SlowObserver {
            slow_iova,
            entered: Mutex::new(entered),
            release: Mutex::new(release),
            calls: Mutex::new(Vec::new()),
        });
        (o, entered_rx, release_tx)
    }

    fn call(&self, what: &'static str, iova: u64) {
        self.calls.lock().expect("calls").push((what, iova));
        if iova == self.slow_iova {
            let _ = self.entered.lock().expect("entered").send(what);
            let _ = self
                .release
                .lock()
                .expect("release")
                .recv_timeout(std::time::Duration::from_secs(120));
        }
    }
}

impl DmaObserver for SlowObserver {
    fn mapping(
        &self,
        iova: u64,
        _size: u64,
        _prot: DmaProt,
        _file: Option<(&File, u64)>,
    ) -> std::result::Result<(), crate::DeviceError> {
        self.call("mapping", iova);
        Ok(())
    }

    fn unmapped(&self, iova: u64, _size: u64) {
        self.call("unmapped", iova);
    }
}

/// Runs `n` writes and reads through the window at `iova` on another thread (an engine's
/// queue) and waits for them, generously: they must not wait for a blocked observer.
fn dma_keeps_flowing(dma: &Arc<DmaSpace>, iova: u64, n: u64) {
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let engine = Arc::clone(dma);
    let worker = std::thread::spawn(move || {
        for i in 0..n {
            let at = iova + (i % 512) * 8;
            engine.write_u64(at, i).expect("write");
            assert_eq!(engine.read_u64(at).expect("read"), i);
            // The log mutex is free too (reports, DMA_LOGGING_* on the connection thread).
            let _ = engine.logging();
        }
        let _ = done_tx.send(());
    });
    done_rx
        .recv_timeout(std::time::Duration::from_secs(30))
        .expect("DMA through another window completes while an observer is blocked");
    worker.join().expect("worker");
}

#[test]
fn a_slow_map_observer_does_not_stall_dma_through_other_windows() {
    let dma = Arc::new(DmaSpace::new(3));
    dma.map(
        0x1_0000,
        0x10000,
        DmaProt::READ_WRITE,
        Some((memfd(0x10000), 0)),
    )
    .expect("map");
    let (observer, entered, release) = SlowObserver::new(0x100_0000);
    dma.set_observer(Some(observer.clone()));
    dma.start_logging(4096).expect("logging");
    let mapper = {
        let dma = Arc::clone(&dma);
        std::thread::spawn(move || {
            dma.map(
                0x100_0000,
                0x10000,
                DmaProt::READ_WRITE,
                Some((memfd(0x10000), 0)),
            )
        })
    };
    // The observer takes its time (test knob: until released): the other queue's DMA keeps
    // completing meanwhile.
    assert_eq!(
        entered.recv_timeout(std::time::Duration::from_secs(30)),
        Ok("mapping")
    );
    dma_keeps_flowing(&dma, 0x1_0000, 1000);
    // The window its observer has not accepted yet is not there for anyone.
    let e = dma.read_u64(0x100_0000).expect_err("not mapped yet");
    assert!(matches!(e, DmaError::Unmapped { .. }), "{e:?}");
    assert!(dma.validate(0x100_0000, 8, false).is_err());
    assert!(dma.window_backing(0x100_0000).is_none());
    assert_eq!(dma.mappings().len(), 1);
    // Its range is reserved, and the reservation counts against the limit.
    let e = dma
        .map(0x100_8000, 0x1000, DmaProt::READ_WRITE, None)
        .expect_err("overlaps the reservation");
    assert_eq!(e.errno(), libc::EEXIST);
    dma.map(0x200_0000, 0x1000, DmaProt::READ_WRITE, None)
        .expect("the third");
    let e = dma
        .map(0x300_0000, 0x1000, DmaProt::READ_WRITE, None)
        .expect_err("a fourth is over the limit");
    assert_eq!(e.errno(), libc::ENOSPC);
    assert!(!mapper.is_finished(), "the observer is still blocked");
    release.send(()).expect("release");
    mapper.join().expect("mapper").expect("mapped");
    // Mapped during the session: logged from its first write.
    dma.write_u64(0x100_2000, 7).expect("write");
    let mut bitmap = [0u8; 8];
    dma.report_dirty(0x100_0000, 0x10000, 4096, &mut bitmap)
        .expect("report");
    assert_eq!(set_bits(&bitmap), vec![2]);
}

/// Two 64 KiB windows of their own memfds, at 0x1_0000 and 0x100_0000.
fn map_two_windows(dma: &DmaSpace) {
    for iova in [0x1_0000, 0x100_0000] {
        dma.map(
            iova,
            0x10000,
            DmaProt::READ_WRITE,
            Some((memfd(0x10000), 0)),
        )
        .expect("map");
    }
}

#[test]
fn an_unmaps_observer_runs_outside_the_locks() {
    let dma = Arc::new(DmaSpace::new(8));
    map_two_windows(&dma);
    let old = dma.window_backing(0x100_0000).expect("backing").generation;
    assert!(dma.window_is_current(0x100_4000, old));
    let (observer, entered, release) = SlowObserver::new(0x100_0000);
    dma.set_observer(Some(observer.clone()));
    dma.start_logging(4096).expect("logging");
    dma.write_u64(0x100_1000, 1).expect("write");
    let unmapper = {
        let dma = Arc::clone(&dma);
        std::thread::spawn(move || {
            let mut bitmap = [0u8; 8];
            let n = dma
                .unmap_take_dirty(0x100_0000, 0x10000, 4096, &mut bitmap)
                .expect("unmap");
            (n, bitmap)
        })
    };
    assert_eq!(
        entered.recv_timeout(std::time::Duration::from_secs(30)),
        Ok("unmapped")
    );
    // Told with no lock held: DMA and the log mutex are free, and the window is gone already.
    dma_keeps_flowing(&dma, 0x1_0000, 1000);
    let e = dma.read_u64(0x100_0000).expect_err("unmapped");
    assert!(matches!(e, DmaError::Unmapped { .. }), "{e:?}");
    assert!(!dma.window_is_current(0x100_4000, old));
    assert!(dma.window_backing(0x100_0000).is_none());
    assert_eq!(dma.mappings().len(), 1);
    // The range stays taken until the observer is done with it.
    let e = dma
        .map(0x100_0000, 0x10000, DmaProt::READ_WRITE, None)
        .expect_err("still being unmapped");
    assert_eq!(e.errno(), libc::EEXIST);
    release.send(()).expect("release");
    let (n, bitmap) = unmapper.join().expect("unmapper");
    assert_eq!(n, 1);
    assert_eq!(set_bits(&bitmap), vec![1], "the write before the unmap");
    // Mapped again: another generation.
    dma.set_observer(None);
    dma.map(
        0x100_0000,
        0x10000,
        DmaProt::READ_WRITE,
        Some((memfd(0x10000), 0)),
    )
    .expect("map again");
    let new = dma.window_backing(0x100_0000).expect("backing").generation;
    assert_ne!(new, old);
    assert!(dma.window_is_current(0x100_4000, new));
    assert!(!dma.window_is_current(0x100_4000, old));
}

#[test]
fn an_unmap_waits_for_a_map_in_flight_in_its_range() {
    let dma = Arc::new(DmaSpace::new(8));
    let (observer, entered, release) = SlowObserver::new(0x100_0000);
    dma.set_observer(Some(observer.clone()));
    let mapper = {
        let dma = Arc::clone(&dma);
        std::thread::spawn(move || dma.map(0x100_0000, 0x1000, DmaProt::READ_WRITE, None))
    };
    assert_eq!(
        entered.recv_timeout(std::time::Duration::from_secs(30)),
        Ok("mapping")
    );
    let unmapper = {
        let dma = Arc::clone(&dma);
        std::thread::spawn(move || dma.unmap(0, 1 << 40))
    };
    release.send(()).expect("release the map");
    mapper.join().expect("mapper").expect("mapped");
    // The unmap waited for the map it overlapped and then removed the window (had it skipped
    // the reservation it would have removed nothing, told nobody, and the window would stay).
    assert_eq!(
        entered.recv_timeout(std::time::Duration::from_secs(30)),
        Ok("unmapped")
    );
    release.send(()).expect("release the unmap");
    let n = unmapper.join().expect("unmapper").expect("unmap");
    assert_eq!(n, 1);
    assert!(dma.mappings().is_empty());
    assert_eq!(
        *observer.calls.lock().expect("calls"),
        vec![("mapping", 0x100_0000), ("unmapped", 0x100_0000)]
    );
}

/// A replacement's device takes tables restored before it was built, and may run on them
/// before its observer has been told of every window (a GPU registering them): its engines
/// replay the commands its predecessor was running. Accesses keep reaching the windows while
/// the observer is told again (before, they were hidden: a replayed command read its ring
/// or wrote its result into "unmapped" memory and failed), and an unmap waits for it.
#[test]
fn windows_stay_reachable_while_a_replay_tells_the_observer() {
    let dma = Arc::new(DmaSpace::new(8));
    map_two_windows(&dma);
    dma.start_logging(4096).expect("logging");
    let (observer, entered, release) = SlowObserver::new(0x100_0000);
    dma.set_observer(Some(observer.clone()));
    let replay = {
        let dma = Arc::clone(&dma);
        std::thread::spawn(move || dma.replay_to_observer())
    };
    assert_eq!(
        entered.recv_timeout(std::time::Duration::from_secs(30)),
        Ok("mapping")
    );
    // The window being replayed: reachable, listed, found by a device that registers
    // windows late, and logged.
    dma_keeps_flowing(&dma, 0x100_0000, 1000);
    assert!(dma.validate(0x100_0000, 8, true).is_ok());
    assert_eq!(dma.mappings().len(), 2);
    let backing = dma.window_backing(0x100_0000).expect("backing");
    assert!(dma.window_is_current(0x100_0000, backing.generation));
    let mut bitmap = [0u8; 8];
    dma.report_dirty(0x100_0000, 0x10000, 4096, &mut bitmap)
        .expect("report");
    assert_eq!(set_bits(&bitmap), vec![0], "the engine's writes are logged");
    // An unmap of it meanwhile waits for the replay: the observer hears of it after.
    let unmapper = {
        let dma = Arc::clone(&dma);
        std::thread::spawn(move || dma.unmap(0x100_0000, 0x10000))
    };
    release.send(()).expect("release the replay");
    let refused = replay.join().expect("replay");
    assert!(refused.is_empty(), "{refused:?}");
    assert_eq!(
        entered.recv_timeout(std::time::Duration::from_secs(30)),
        Ok("unmapped")
    );
    release.send(()).expect("release the unmap");
    assert_eq!(unmapper.join().expect("unmapper").expect("unmap"), 1);
    assert_eq!(
        observer.calls.lock().expect("calls").as_slice(),
        [
            ("mapping", 0x1_0000),
            ("mapping", 0x100_0000),
            ("unmapped", 0x100_0000)
        ]
    );
}
