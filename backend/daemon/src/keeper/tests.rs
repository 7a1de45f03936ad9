//! Tests of the keeper: adoption, moves, the bounded queue.

use super::*;

fn memfd() -> OwnedFd {
    rustix::fs::memfd_create("keeper-test", rustix::fs::MemfdFlags::CLOEXEC).expect("memfd")
}

fn ino(fd: &OwnedFd) -> u64 {
    rustix::fs::fstat(fd).expect("fstat").st_ino
}

/// What a supervisor receives from an adoption on `ours`.
fn adopted_ledger(ours: &OwnedFd) -> (BTreeMap<u64, OwnedFd>, Note) {
    let (held, _, note) = adopted(ours);
    (held, note)
}

/// What a supervisor receives from an adoption on `ours`, memory objects included.
fn adopted(ours: &OwnedFd) -> (BTreeMap<u64, OwnedFd>, BTreeMap<String, OwnedFd>, Note) {
    let mut held = BTreeMap::new();
    let mut objects = BTreeMap::new();
    let mut buf = Vec::new();
    loop {
        match custody::recv(ours, &mut buf).expect("recv") {
            (Note::Fds { ids }, fds) => held.extend(ids.into_iter().zip(fds)),
            (Note::Objects { names }, fds) => objects.extend(names.into_iter().zip(fds)),
            (note, _) => return (held, objects, note),
        }
    }
}

#[test]
fn an_adopting_supervisor_gets_exactly_what_the_last_one_held() {
    let (sup1, worker1) = custody::pair().expect("pair");
    let (a, b, c) = (memfd(), memfd(), memfd());
    let handed = BTreeMap::from([(1, a.try_clone().expect("dup"))]);
    let (vram, next, bells) = (memfd(), memfd(), memfd());
    let objects = BTreeMap::from([("k.vram".to_owned(), vram.try_clone().expect("dup"))]);
    let keeper = Keeper::new("ep", worker1, &handed, &objects).expect("keeper");
    keeper.set_restarts(3);
    keeper
        .hold(&[10, 11], &[b.as_fd(), c.as_fd()])
        .expect("hold");
    keeper.release(&[10]);
    // Refused while the first supervisor is attached: no split custody.
    let (sup2, worker2) = custody::pair().expect("pair");
    keeper.adopt(worker2, "ep").expect("answered");
    assert!(matches!(adopted_ledger(&sup2).1, Note::AdoptRefused { .. }));
    // The first supervisor goes; while none is attached, changes stay in the ledger.
    // (As the worker's request thread does when the channel reads closed. Not detected
    // here by a failed send: a process another test forks meanwhile may hold a copy of
    // `sup1` until it execs, keeping the channel open.)
    drop(sup1);
    keeper.lost(1);
    assert!(!keeper.supervised());
    let d = memfd();
    keeper.hold(&[12], &[d.as_fd()]).expect("hold unsupervised");
    keeper.release(&[11]);
    let file = |fd: &OwnedFd| std::fs::File::from(fd.try_clone().expect("dup"));
    keeper
        .hold_objects(&[
            ("k.vram@next".to_owned(), file(&next)),
            ("k.bells".to_owned(), file(&bells)),
        ])
        .expect("hold objects unsupervised");
    keeper.release_objects(&["k.vram@next".to_owned()]);
    keeper.notify(&Note::Ready {
        resumed: false,
        replacement: Some(StartMode::Resume),
    });
    // Another endpoint's supervisor is refused.
    let (sup3, worker3) = custody::pair().expect("pair");
    keeper.adopt(worker3, "other").expect("answered");
    assert!(matches!(adopted_ledger(&sup3).1, Note::AdoptRefused { .. }));
    // The right one gets the ledger and becomes the channel.
    let (sup4, worker4) = custody::pair().expect("pair");
    keeper.adopt(worker4, "ep").expect("adopt");
    let (held, objects, last) = adopted(&sup4);
    assert_eq!(
        last,
        Note::Adopted {
            pid: std::process::id(),
            replacement: Some(StartMode::Resume),
            last_move: None,
            restarts: Some(3),
            lease: None,
            nonce: None,
        },
        "the adopting supervisor learns how a replacement starts and the restarts so far"
    );
    let got: Vec<(u64, u64)> = held.iter().map(|(id, fd)| (*id, ino(fd))).collect();
    assert_eq!(got, vec![(1, ino(&a)), (12, ino(&d))]);
    let got: Vec<(&str, u64)> = objects
        .iter()
        .map(|(n, fd)| (n.as_str(), ino(fd)))
        .collect();
    assert_eq!(got, vec![("k.bells", ino(&bells)), ("k.vram", ino(&vram))]);
    assert!(keeper.supervised());
    keeper.release(&[12]);
    let mut buf = Vec::new();
    let (note, _) = custody::recv(&sup4, &mut buf).expect("the new channel carries notes");
    assert_eq!(note, Note::Release { ids: vec![12] });
}

#[test]
fn a_silent_connection_does_not_hold_an_adoption_up() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let dir = tempfile::tempdir().expect("tempdir");
    let path = adoption_path(dir.path(), 1);
    let (sup1, worker1) = custody::pair().expect("pair");
    let keeper =
        Arc::new(Keeper::new("ep", worker1, &BTreeMap::new(), &BTreeMap::new()).expect("keeper"));
    keeper
        .serve_adoptions(path.clone())
        .expect("adoption socket");
    drop(sup1);
    keeper.lost(1);
    let connect = || {
        let s = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .expect("socket");
        rustix::net::connect(&s, &SocketAddrUnix::new(&path).expect("addr")).expect("connect");
        s
    };
    let _silent = connect();
    let adopter = connect();
    let t0 = std::time::Instant::now();
    custody::send(
        &adopter,
        &Note::Adopt {
            endpoint: "ep".into(),
            nonce: None,
        },
        &[],
    )
    .expect("send");
    let (_, last) = adopted_ledger(&adopter);
    assert!(matches!(last, Note::Adopted { .. }), "{last:?}");
    assert!(
        t0.elapsed() < ADOPT_REQUEST_TIMEOUT * 2,
        "{:?}",
        t0.elapsed()
    );
    // The adopted channel has no timeout: a read on it (the worker's request thread)
    // waits for a quiet supervisor as long as it takes.
    let (_, channel) = keeper.channel();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        custody::recv(&*channel, &mut buf).map(|(note, _)| note)
    });
    std::thread::sleep(ADOPT_REQUEST_TIMEOUT + std::time::Duration::from_millis(500));
    let mv = Note::Move {
        to: "b".into(),
        detached: false,
        target: None,
    };
    custody::send(&adopter, &mv, &[]).expect("send");
    let got = reader.join().expect("reader");
    assert_eq!(got.ok(), Some(mv));
}

/// A keeper whose first supervisor (`sup1`, returned) asked for a move to `to`, begun.
fn moving(to: &str, wait: std::time::Duration) -> (Arc<Keeper>, OwnedFd) {
    let (sup1, worker1) = custody::pair().expect("pair");
    let keeper = Arc::new(
        Keeper::new("ep", worker1, &BTreeMap::new(), &BTreeMap::new())
            .expect("keeper")
            .with_move_wait(wait),
    );
    let (generation, _) = keeper.channel();
    assert!(keeper.begin_move(generation, to));
    (keeper, sup1)
}

fn moved(downtime_us: u64) -> Note {
    Note::Moved {
        report: crate::custody::MoveReport {
            downtime_us,
            ..Default::default()
        },
    }
}

#[test]
fn an_adoption_during_a_move_waits_for_it_and_says_how_it_ended() {
    let (keeper, sup1) = moving("gpu1", std::time::Duration::from_secs(30));
    // The supervisor that asked dies; the worker's request thread, busy moving, has not
    // read the close: the hung-up channel does not refuse the adoption.
    drop(sup1);
    assert!(keeper.supervised());
    // (A process another test forks meanwhile may hold a copy of `sup1` until it execs.)
    let (_, old) = keeper.channel();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !hung_up(&old) {
        assert!(
            std::time::Instant::now() < deadline,
            "the channel does not read hung up"
        );
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let (sup2, worker2) = custody::pair().expect("pair");
    let adopting = {
        let keeper = keeper.clone();
        std::thread::spawn(move || keeper.adopt(worker2, "ep"))
    };
    std::thread::sleep(std::time::Duration::from_millis(200));
    assert!(!adopting.is_finished(), "the adoption waits for the move");
    keeper.end_move(&moved(42));
    adopting.join().expect("adopting").expect("adopted");
    let (_, last) = adopted_ledger(&sup2);
    let Note::Adopted { last_move, .. } = last else {
        panic!("{last:?}")
    };
    let last_move = last_move.expect("the last move");
    assert!(last_move.moved_to("gpu1"), "{last_move:?}");
    assert_eq!(
        last_move.state,
        MoveState::Moved {
            report: Some(crate::custody::MoveReport {
                downtime_us: 42,
                ..Default::default()
            })
        }
    );
    // The outcome is told once: no answer follows on the new channel.
    keeper.release(&[9]);
    let (note, _) = custody::recv(&sup2, &mut Vec::new()).expect("recv");
    assert_eq!(note, Note::Release { ids: vec![9] });
}

#[test]
fn past_the_move_wait_the_adoption_says_the_move_runs_and_its_outcome_follows() {
    let (keeper, sup1) = moving("gpu1", std::time::Duration::from_millis(100));
    drop(sup1);
    keeper.lost(1);
    let (sup2, worker2) = custody::pair().expect("pair");
    keeper.adopt(worker2, "ep").expect("adopted");
    let (_, last) = adopted_ledger(&sup2);
    let Note::Adopted { last_move, .. } = last else {
        panic!("{last:?}")
    };
    assert_eq!(
        last_move.map(|m| m.state),
        Some(MoveState::Running),
        "handed over with the move running"
    );
    let failed = Note::MoveFailed {
        error: "no room".into(),
    };
    keeper.end_move(&failed);
    let (note, _) = custody::recv(&sup2, &mut Vec::new()).expect("recv");
    assert_eq!(note, failed, "the outcome follows on the new channel");
}

#[test]
fn a_move_asked_by_a_supervisor_gone_before_it_began_does_not_run() {
    let (sup1, worker1) = custody::pair().expect("pair");
    let keeper = Keeper::new("ep", worker1, &BTreeMap::new(), &BTreeMap::new()).expect("keeper");
    let (old, _) = keeper.channel();
    // The request thread read a Move from the first channel, but a new supervisor
    // adopted the worker before the move began: it would never hear of it.
    drop(sup1);
    keeper.lost(old);
    let (sup2, worker2) = custody::pair().expect("pair");
    keeper.adopt(worker2, "ep").expect("adopted");
    assert!(matches!(adopted_ledger(&sup2).1, Note::Adopted { .. }));
    assert!(!keeper.begin_move(old, "gpu1"));
    assert_eq!(keeper.last_move(), None);
    let (current, _) = keeper.channel();
    assert!(keeper.begin_move(current, "gpu1"));
}

#[test]
fn a_supervisor_that_does_not_read_never_blocks_a_hold_and_a_full_queue_refuses_the_clients() {
    let (sup, worker) = custody::pair().expect("pair");
    let keeper = Keeper::new("ep", worker, &BTreeMap::new(), &BTreeMap::new()).expect("keeper");
    let fd = memfd();
    let first = switchyard_server::continuity::FIRST_MESSAGE_ID;
    // The supervisor reads nothing: the socket fills, the sender thread blocks, the
    // queue grows to its bound; no hold ever waits.
    let mut id = first;
    let refused = loop {
        match keeper.try_hold(&[id], &[fd.as_fd()]) {
            Ok(()) => id += 1,
            Err(e) => break e,
        }
        assert!(id - first < 100_000, "the queue is unbounded");
    };
    assert_eq!(refused.kind(), io::ErrorKind::WouldBlock);
    assert!(
        !keeper.lock().ledger.contains_key(&id),
        "nothing of it is held"
    );
    // Stats coalesce into one report with the counts of both; a release still goes.
    let stats = |jobs| {
        Note::Stats(WorkerStats {
            jobs,
            ..Default::default()
        })
    };
    keeper.notify(&stats(2));
    keeper.notify(&stats(3));
    keeper.release(&[first]);
    keeper.synced(1, 7);
    // The supervisor reads at last: every hold, the release, the stats added up, the
    // answer last with its number.
    let mut buf = Vec::new();
    let (mut holds, mut jobs, mut released) = (0, 0, false);
    let seq = loop {
        match custody::recv(&sup, &mut buf).expect("recv") {
            (Note::Hold { ids }, _) => holds += ids.len() as u64,
            (Note::Stats(s), _) => jobs += s.jobs,
            (Note::Release { ids }, _) => released = ids == vec![first],
            (Note::Synced { token, seq }, _) => {
                assert_eq!(token, 7);
                break seq;
            }
            (other, _) => panic!("{other:?}"),
        }
    };
    assert_eq!(holds, id - first);
    assert!(released);
    // The stats wait for room: they come after the answer, with both counts.
    while jobs < 5 {
        match custody::recv(&sup, &mut buf).expect("recv") {
            (Note::Stats(s), _) => jobs += s.jobs,
            (other, _) => panic!("{other:?}"),
        }
    }
    assert_eq!(jobs, 5, "no count lost or doubled");
    assert_eq!(keeper.seq(), seq + 1, "numbered in the order queued");
}

#[test]
fn an_adopted_note_of_an_earlier_release_has_no_last_move() {
    let note: Note =
        serde_json::from_str(r#"{"adopted":{"pid":7,"replacement":"resume"}}"#).expect("note");
    assert_eq!(
        note,
        Note::Adopted {
            pid: 7,
            replacement: Some(StartMode::Resume),
            last_move: None,
            restarts: None,
            lease: None,
            nonce: None,
        }
    );
}

#[test]
fn a_worker_keeps_its_ledger_from_a_record_with_another_nonce_and_proves_its_own() {
    let (sup1, worker1) = custody::pair().expect("pair");
    let a = memfd();
    let handed = BTreeMap::from([(1, a.try_clone().expect("dup"))]);
    let keeper = Keeper::new("ep", worker1, &handed, &BTreeMap::new()).expect("keeper");
    let nonce = WorkerNonce::generate().expect("nonce");
    keeper.set_nonce(Some(nonce.clone()));
    drop(sup1);
    keeper.lost(1);
    // A supervisor whose record names another worker: refused, nothing handed over.
    let other = WorkerNonce::generate().expect("nonce");
    let (sup2, worker2) = custody::pair().expect("pair");
    keeper
        .adopt_claimed(worker2, "ep", Some(&other))
        .expect("answered");
    let (held, note) = adopted_ledger(&sup2);
    assert!(
        matches!(&note, Note::AdoptRefused { reason } if reason.contains("nonce")),
        "{note:?}"
    );
    assert!(held.is_empty());
    assert!(!keeper.supervised());
    // The record's own nonce: adopted, the nonce proved.
    let (sup3, worker3) = custody::pair().expect("pair");
    keeper
        .adopt_claimed(worker3, "ep", Some(&nonce))
        .expect("adopted");
    let (held, note) = adopted_ledger(&sup3);
    assert_eq!(held.len(), 1);
    assert!(
        matches!(&note, Note::Adopted { nonce: Some(n), .. } if *n == nonce),
        "{note:?}"
    );
}
