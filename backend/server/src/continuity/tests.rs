//! The tables, the session and custody bookkeeping, against a recording supervisor.

use std::os::fd::OwnedFd;
use std::sync::Mutex as StdMutex;

use super::*;

#[derive(Debug, Default)]
struct Recorder {
    held: Arc<StdMutex<Vec<u64>>>,
}

impl Custody for Recorder {
    fn hold(&mut self, ids: &[u64], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
        assert_eq!(ids.len(), fds.len());
        self.held.lock().expect("lock").extend_from_slice(ids);
        Ok(())
    }
    fn release(&mut self, ids: &[u64]) -> io::Result<()> {
        self.held.lock().expect("lock").retain(|i| !ids.contains(i));
        Ok(())
    }
}

fn setup() -> (Arc<BlackBox>, Continuity, Arc<StdMutex<Vec<u64>>>) {
    let bb = BlackBox::create(&Continuity::records(&ServerLimits::default())).expect("bb");
    let rec = Recorder::default();
    let held = rec.held.clone();
    let c = Continuity::new(&bb, Box::new(rec)).expect("continuity");
    (bb, c, held)
}

fn fds(n: usize) -> Vec<OwnedFd> {
    (0..n)
        .map(|_| {
            switchyard_device::irq::new_eventfd()
                .expect("eventfd")
                .into()
        })
        .collect()
}

#[test]
fn tables_and_session_survive_into_a_replacement() {
    let (bb, c, held) = setup();
    let ids = c.hold(&fds(3)).expect("within budget");
    assert_eq!(
        ids,
        vec![FIRST_MESSAGE_ID, FIRST_MESSAGE_ID + 1, FIRST_MESSAGE_ID + 2]
    );
    c.version(0, 1, br#"{"capabilities":{}}"#);
    let w = WindowRecord {
        iova: 0x1000_0000,
        size: 0x20_0000,
        offset: 0x4000,
        read: true,
        write: false,
        fd: Some(ids[0]),
    };
    c.dma_mapped(w);
    c.dma_mapped(WindowRecord {
        iova: 0x2000_0000,
        size: 0x1000,
        offset: 0,
        read: true,
        write: true,
        fd: None,
    });
    c.irqs_set(2, 5, &[Some(ids[1]), Some(ids[2])]);
    c.settle(&ids);
    assert_eq!(*held.lock().expect("lock"), ids, "all three are referenced");

    let (c2, r) = Continuity::resume(&bb, Box::new(Recorder::default())).expect("resume");
    assert_eq!(r.version, Some((0, 1, br#"{"capabilities":{}}"#.to_vec())));
    assert_eq!(r.windows.len(), 2);
    assert_eq!(r.windows[0], w);
    assert_eq!(r.windows[1].fd, None);
    assert_eq!(
        r.vectors.iter().map(|(k, v)| (*k, *v)).collect::<Vec<_>>(),
        vec![((2, 5), ids[1]), ((2, 6), ids[2])]
    );
    let mut referenced = r.referenced.clone();
    referenced.sort_unstable();
    assert_eq!(referenced, ids);
    assert_eq!(r.next_id, FIRST_MESSAGE_ID + 3, "ids are never reused");
    // The replacement knows the windows: a replayed identical DMA_MAP is recognised.
    assert!(c2.has_window(&WindowRecord { fd: None, ..w }, Some(ids[0])));
    assert!(!c2.has_window(
        &WindowRecord {
            fd: None,
            offset: 0,
            ..w
        },
        Some(ids[0])
    ));
}

#[test]
fn descriptors_are_released_when_nothing_refers_to_them() {
    let (_bb, c, held) = setup();
    let ids = c.hold(&fds(2)).expect("within budget");
    c.dma_mapped(WindowRecord {
        iova: 0x1000,
        size: 0x1000,
        offset: 0,
        read: true,
        write: true,
        fd: Some(ids[0]),
    });
    // ids[1] came with the message but no table took it (e.g. a duplicate of the same memfd).
    c.settle(&ids);
    assert_eq!(*held.lock().expect("lock"), vec![ids[0]]);
    // An unmap of a range around it removes it.
    c.dma_unmapped(0, 0x4000);
    assert!(held.lock().expect("lock").is_empty());

    // An eventfd replaced by another, then the index disabled (each message settled once
    // handled, as the dispatcher does).
    let a = c.hold(&fds(1)).expect("within budget");
    c.irqs_set(2, 0, &[Some(a[0])]);
    c.settle(&a);
    let b = c.hold(&fds(1)).expect("within budget");
    c.irqs_set(2, 0, &[Some(b[0])]);
    c.settle(&b);
    assert_eq!(*held.lock().expect("lock"), vec![b[0]]);
    c.irqs_set(2, 0, &[None]);
    assert!(held.lock().expect("lock").is_empty());
    let d = c.hold(&fds(2)).expect("within budget");
    c.irqs_set(2, 3, &[Some(d[0]), Some(d[1])]);
    c.settle(&d);
    c.irqs_disabled(2);
    assert!(held.lock().expect("lock").is_empty());
}

#[test]
fn a_client_that_leaves_takes_everything_with_it() {
    let (bb, c, held) = setup();
    let ids = c.hold(&fds(2)).expect("within budget");
    c.version(0, 1, b"{}");
    c.dma_mapped(WindowRecord {
        iova: 0,
        size: 0x1000,
        offset: 0,
        read: true,
        write: true,
        fd: Some(ids[0]),
    });
    c.irqs_set(2, 0, &[Some(ids[1])]);
    c.client_gone();
    assert!(held.lock().expect("lock").is_empty());
    let (_c2, r) = Continuity::resume(&bb, Box::new(Recorder::default())).expect("resume");
    assert_eq!(r.version, None);
    assert!(r.windows.is_empty() && r.vectors.is_empty() && r.rx.is_empty());
    unmaps_remove_only_the_windows_inside_their_range();
}

#[test]
fn descriptors_of_messages_never_handled_go_with_the_client() {
    // Held when they arrived; their message was cut short, could not be framed or was never
    // settled: nothing refers to them, and the client leaving releases them all.
    let (_bb, c, held) = setup();
    let kept = c.hold(&fds(1)).expect("within budget");
    c.dma_mapped(WindowRecord {
        iova: 0,
        size: 0x1000,
        offset: 0,
        read: true,
        write: true,
        fd: Some(kept[0]),
    });
    c.settle(&kept);
    let never_handled = c.hold(&fds(16)).expect("within budget");
    assert_eq!(held.lock().expect("lock").len(), 17);
    assert_eq!(c.held_count().0, 17);
    c.client_gone();
    assert!(held.lock().expect("lock").is_empty());
    assert_eq!(c.held_count().0, 0);
    assert!(never_handled.iter().all(|id| *id >= FIRST_MESSAGE_ID));
}

#[test]
fn the_budget_refuses_a_read_that_would_pass_it_and_holds_nothing_of_it() {
    let (_bb, c, held) = setup();
    c.set_budget(Some(4));
    let a = c.hold(&fds(3)).expect("within budget");
    assert!(c.hold(&fds(2)).is_err(), "3 + 2 > 4");
    assert_eq!(
        *held.lock().expect("lock"),
        a,
        "nothing of the refused read is held"
    );
    assert_eq!(c.held_count(), (3, 1));
    let b = c.hold(&fds(1)).expect("3 + 1 fits");
    c.settle(&a);
    c.settle(&b);
    assert!(held.lock().expect("lock").is_empty());
    assert!(
        c.hold(&fds(4)).is_ok(),
        "released descriptors free the budget"
    );
}

#[test]
fn a_replacement_releases_what_it_took_over_when_the_client_leaves() {
    let (_bb, c, held) = setup();
    let mut taken: BTreeMap<u64, OwnedFd> = BTreeMap::new();
    for (id, fd) in [CONNECTION_ID, FIRST_MESSAGE_ID + 7, FIRST_MESSAGE_ID + 9]
        .into_iter()
        .zip(fds(3))
    {
        taken.insert(id, fd);
    }
    c.took_over(&taken);
    held.lock()
        .expect("lock")
        .extend([FIRST_MESSAGE_ID + 7, FIRST_MESSAGE_ID + 9]);
    assert_eq!(c.held_count().0, 2, "only message descriptors count");
    c.client_gone();
    assert!(held.lock().expect("lock").is_empty());
}

/// `n` descriptors of one memfd (what a VMM sends with each DMA_MAP of its guest RAM).
fn memfd_copies(n: usize) -> Vec<OwnedFd> {
    let mem = memfd::MemfdOptions::default()
        .create("guest-ram")
        .expect("memfd")
        .into_file();
    (0..n)
        .map(|_| OwnedFd::from(mem.try_clone().expect("dup")))
        .collect()
}

fn window(iova: u64, fd: u64) -> WindowRecord {
    WindowRecord {
        iova,
        size: 0x1000,
        offset: iova,
        read: true,
        write: true,
        fd: Some(fd),
    }
}

#[test]
fn windows_of_one_file_share_one_descriptor_in_custody() {
    let (_bb, c, held) = setup();
    c.set_budget(Some(2));
    // Three DMA_MAPs of one memfd, each with its own descriptor, the second pipelined
    // behind the first: one custody id, held once, within a budget of 2.
    let a = c.hold(&memfd_copies(1)).expect("within budget");
    let b = c
        .hold(&memfd_copies(1))
        .expect("another memfd: a second descriptor");
    assert!(c.hold(&memfd_copies(1)).is_err(), "a third file");
    c.settle(&a);
    c.settle(&b);
    assert!(
        held.lock().expect("lock").is_empty(),
        "a and b were settled unused"
    );
    let ram = memfd_copies(3);
    let first = c.hold(&ram[..1]).expect("new");
    let second = c
        .hold(&ram[1..2])
        .expect("the same file: no new descriptor");
    assert_eq!(first, second);
    let e = c.hold(&fds(1)).expect("an eventfd: a second descriptor");
    assert!(c.hold(&fds(1)).is_err(), "a third");
    c.settle(&e);
    assert_eq!(*held.lock().expect("lock"), first);
    c.dma_mapped(window(0x1000, first[0]));
    c.settle(&first);
    // The second message is still unsettled: its id stays even if the window goes.
    c.dma_unmapped(0x1000, 0x1000);
    assert_eq!(*held.lock().expect("lock"), first);
    c.dma_mapped(window(0x2000, second[0]));
    c.settle(&second);
    let third = c.hold(&ram[2..]).expect("the same file");
    assert_eq!(third, first);
    c.dma_mapped(window(0x3000, third[0]));
    c.settle(&third);
    assert_eq!(c.held_count().0, 1);
    c.dma_unmapped(0x2000, 0x1000);
    assert_eq!(*held.lock().expect("lock"), first, "a window still uses it");
    c.dma_unmapped(0x3000, 0x1000);
    assert!(
        held.lock().expect("lock").is_empty(),
        "no window and no message uses it"
    );
    // Eventfds are never taken for one another (they all share one anonymous inode).
    let e = c.hold(&fds(2)).expect("within budget");
    assert_ne!(e[0], e[1]);
}

fn unmaps_remove_only_the_windows_inside_their_range() {
    let (_bb, c, held) = setup();
    let ids = c.hold(&fds(2)).expect("within budget");
    for (i, id) in ids.iter().enumerate() {
        c.dma_mapped(WindowRecord {
            iova: i as u64 * 0x1000,
            size: 0x1000,
            offset: 0,
            read: true,
            write: true,
            fd: Some(*id),
        });
    }
    c.settle(&ids);
    // A range that straddles the second window removes only the first.
    c.dma_unmapped(0, 0x1800);
    assert_eq!(*held.lock().expect("lock"), vec![ids[1]]);
    c.dma_unmapped_all();
    assert!(held.lock().expect("lock").is_empty());
}

#[test]
fn damaged_records_are_refused() {
    let (bb, _c, _held) = setup();
    bb.record(TABLES_RECORD)
        .expect("record")
        .publish(&[1, 0, 0, 0, 9])
        .expect("publish");
    let err = Continuity::resume(&bb, Box::new(Recorder::default())).expect_err("refused");
    assert!(matches!(err, BlackBoxError::Corrupt(_)), "{err}");
}

/// Thousands of changes (QEMU with a vIOMMU maps a window per page) go through the log, which
/// folds into a snapshot when full; a replacement finds exactly the tables at the time of the
/// kill, whichever mix of snapshot and log holds them.
#[test]
fn many_changes_replay_from_snapshot_and_log() {
    let (bb, c, _held) = setup();
    let n = LOG_ENTRIES as u64 + 1000;
    for i in 0..n {
        c.dma_mapped(WindowRecord {
            iova: i * 0x1000,
            size: 0x1000,
            offset: i * 0x1000,
            read: true,
            write: i % 2 == 0,
            fd: None,
        });
    }
    // Unmap every third page, and an irq change in between.
    for i in (0..n).step_by(3) {
        c.dma_unmapped(i * 0x1000, 0x1000);
    }
    c.irqs_set(2, 1, &[Some(FIRST_MESSAGE_ID + 5)]);
    let (_c2, r) = Continuity::resume(&bb, Box::new(Recorder::default())).expect("resume");
    let want: Vec<u64> = (0..n).filter(|i| i % 3 != 0).map(|i| i * 0x1000).collect();
    let got: Vec<u64> = r.windows.iter().map(|w| w.iova).collect();
    assert_eq!(got, want);
    assert!(
        r.windows
            .iter()
            .all(|w| w.write == ((w.iova / 0x1000) % 2 == 0))
    );
    assert_eq!(r.vectors.get(&(2, 1)), Some(&(FIRST_MESSAGE_ID + 5)));
}
