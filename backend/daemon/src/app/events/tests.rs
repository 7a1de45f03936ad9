//! The events hub: numbering, pages and the live feed, read the way `GET /events` reads.

use std::convert::Infallible;
use std::sync::Mutex;

use switchyard_pool::EventKind;

use super::*;

/// A stream and the store's history it publishes after (pool events are committed first).
struct Fixture {
    stream: Arc<EventStream>,
    store: Mutex<Vec<PoolEvent>>,
    /// Every `seq` published, in order.
    published: Mutex<Vec<u64>>,
}

impl Fixture {
    fn new() -> Self {
        Self {
            stream: Arc::new(EventStream::new(0)),
            store: Mutex::new(Vec::new()),
            published: Mutex::new(Vec::new()),
        }
    }

    fn pool_event(&self) {
        self.pool_event_of(EventKind::BoardQuarantined {
            board: "gpu0".into(),
        });
    }

    /// A pool event of `kind`, committed then published (as the pool's owner does).
    fn pool_event_of(&self, kind: EventKind) {
        let mut store = self.store.lock().expect("store");
        let e = PoolEvent {
            seq: store.last().map_or(1, |e| e.seq + 1),
            at_unix_ms: 0,
            kind,
        };
        store.push(e.clone());
        drop(store);
        self.stream.pool(vec![e]);
        let last = self.stream.state().last;
        self.published.lock().expect("published").push(last);
    }

    fn worker_event(&self) {
        self.stream.worker(WorkerLifecycle::GaveUp {
            endpoint: "vm".into(),
        });
        let last = self.stream.state().last;
        self.published.lock().expect("published").push(last);
    }

    /// `n` events: pool events, each followed by 0 to 3 worker events.
    fn history(&self, n: usize) {
        let mut i = 0;
        while i < n {
            self.pool_event();
            i += 1;
            for _ in 0..(i % 4).min(n - i) {
                self.worker_event();
                i += 1;
            }
        }
    }

    fn read(&self, since: u64, limit: usize) -> Result<Vec<PoolEvent>, Infallible> {
        let store = self.store.lock().expect("store");
        let reads = store.iter().filter(|e| e.seq > since).take(limit);
        Ok(reads.cloned().collect())
    }

    fn next(&self, cursor: &mut Cursor) -> Step {
        let step = self.stream.next_page(cursor, |s, n| self.read(s, n));
        step.unwrap_or_else(|e| match e {})
    }
}

fn seqs(page: &[Received<DaemonEvent>]) -> Vec<u64> {
    page.iter()
        .map(|r| match r {
            Received::Event(e) => e.seq,
            Received::Lagged { missed } => panic!("lagged {missed}"),
        })
        .collect()
}

/// Everything the live subscription has now.
fn drain(sub: &mut Subscription<DaemonEvent>) -> Vec<u64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let mut out = Vec::new();
    rt.block_on(async {
        while let Ok(Some(r)) = tokio::time::timeout(Duration::from_millis(10), sub.recv()).await {
            match r {
                Received::Event(e) => out.push(e.seq),
                Received::Lagged { missed } => panic!("lagged {missed}"),
            }
        }
    });
    out
}

#[test]
fn pages_then_live_give_every_event_once_in_order() {
    let f = Fixture::new();
    f.history(3000);
    let mut cursor = f.stream.cursor(Some(0), true);
    let mut got = Vec::new();
    let mut pages = 0;
    let mut sub = loop {
        match f.next(&mut cursor) {
            Step::Page(page) => {
                assert!(page.len() <= 2 * PAGE, "a page of {}", page.len());
                got.extend(seqs(&page));
                pages += 1;
                // Events published while the reader reads the history: between pages,
                // and at the seam (a page that catches up is followed by two more).
                if pages <= 20 {
                    f.pool_event();
                    f.worker_event();
                }
            }
            Step::Live(sub) => break sub,
            Step::End => panic!("a following reader ended"),
        }
    };
    assert!(pages >= 3000 / (2 * PAGE), "{pages} pages");
    f.worker_event();
    f.pool_event();
    got.extend(drain(&mut sub));
    assert_eq!(got, *f.published.lock().expect("published"));
}

#[test]
fn a_reader_resumes_after_any_seq() {
    let f = Fixture::new();
    f.history(1200);
    let all = f.published.lock().expect("published").clone();
    for since in [all[0], all[1], all[517], all[1198], all[1199], all[700] + 1] {
        let mut cursor = f.stream.cursor(Some(since), false);
        let mut got = Vec::new();
        while let Step::Page(page) = f.next(&mut cursor) {
            got.extend(seqs(&page));
        }
        let expected: Vec<u64> = all.iter().copied().filter(|&s| s > since).collect();
        assert_eq!(got, expected, "since {since}");
    }
}

#[test]
fn follow_false_ends_at_the_last_event_when_the_reader_came() {
    let f = Fixture::new();
    f.history(600);
    let until = f.published.lock().expect("published").clone();
    let mut cursor = f.stream.cursor(Some(0), false);
    let mut got = Vec::new();
    loop {
        match f.next(&mut cursor) {
            Step::Page(page) => {
                got.extend(seqs(&page));
                if got.len() < 2000 {
                    f.pool_event();
                    f.worker_event();
                }
            }
            Step::End => break,
            Step::Live(_) => panic!("follow=false went live"),
        }
    }
    assert_eq!(got, until);
    // No history: the end at once; no `since`: nothing before now.
    let mut none = f.stream.cursor(None, false);
    assert!(matches!(f.next(&mut none), Step::End));
}

#[test]
fn worker_events_dropped_before_a_slow_reader_got_them_are_reported() {
    let f = Fixture::new();
    f.history(400);
    let mut cursor = f.stream.cursor(Some(0), true);
    let Step::Page(first) = f.next(&mut cursor) else {
        panic!("no page")
    };
    let mut got = seqs(&first);
    // The reader stalls while more worker events than memory holds are published.
    for _ in 0..REPLAY + 10 {
        f.worker_event();
    }
    f.pool_event();
    let mut missed = 0;
    let sub = loop {
        match f.next(&mut cursor) {
            Step::Page(page) => {
                for r in page {
                    match r {
                        Received::Event(e) => got.push(e.seq),
                        Received::Lagged { missed: n } => missed += n,
                    }
                }
            }
            Step::Live(sub) => break sub,
            Step::End => panic!("ended"),
        }
    };
    drop(sub);
    let published = f.published.lock().expect("published").clone();
    assert!(got.windows(2).all(|w| w[0] < w[1]), "out of order");
    assert!(got.iter().all(|s| published.contains(s)));
    // Every pool event (the store has them all), and a count of what is gone.
    let pool = published.iter().filter(|s| *s % SEQ_STRIDE == 0);
    assert!(pool.into_iter().all(|s| got.contains(s)));
    assert!(missed > 0);
    assert_eq!(got.len() as u64 + missed, published.len() as u64);
}

#[test]
fn streams_past_the_cap_are_refused_until_one_ends() {
    let f = Fixture::new();
    let slots: Vec<StreamSlot> = (0..MAX_STREAMS)
        .map(|_| f.stream.open_stream().expect("a slot"))
        .collect();
    assert!(f.stream.open_stream().is_none());
    drop(slots);
    assert!(f.stream.open_stream().is_some());
}

/// A worker event that says which it was: `i` in the pid, or in the endpoint's name.
fn numbered(i: u64) -> WorkerLifecycle {
    match i {
        // Among the first, at the gap's very end, and among those that wait for a number.
        3 | 1_000_000 => WorkerLifecycle::StateLost {
            endpoint: i.to_string(),
            lost: crate::lifecycle::LostState {
                problems: vec!["DMA window 0x1000".into()],
            },
        },
        999_998 | 1_000_001 => WorkerLifecycle::DeviceLost {
            endpoint: i.to_string(),
            lost: crate::lifecycle::LostDevice {
                host: "0000:00:04.0".into(),
                reason: "unbound".into(),
            },
        },
        _ => WorkerLifecycle::Exited {
            endpoint: String::new(),
            pid: u32::try_from(i).expect("pid"),
            status: String::new(),
        },
    }
}

/// The number [`numbered`] gave a worker event.
fn number_of(e: &WorkerLifecycle) -> u64 {
    match e {
        WorkerLifecycle::Exited { pid, .. } => u64::from(*pid),
        WorkerLifecycle::StateLost { endpoint, .. }
        | WorkerLifecycle::DeviceLost { endpoint, .. } => endpoint.parse().expect("a number"),
        other => panic!("unexpected {other:?}"),
    }
}

/// Reads every page the reader at `cursor` can have now: `(seq, worker event's number)`
/// (`None` for a pool event), and whether a worker event was a `state_lost` or `device_lost`.
fn read_all(
    f: &Fixture,
    cursor: &mut Cursor,
    got: &mut Vec<(u64, Option<u64>)>,
    lost: &mut Vec<u64>,
) {
    while let Step::Page(page) = f.next(cursor) {
        for r in page {
            let Received::Event(e) = r else {
                panic!("{r:?}: nothing may be dropped")
            };
            let n = e.worker.as_ref().map(number_of);
            if let Some(WorkerLifecycle::StateLost { .. } | WorkerLifecycle::DeviceLost { .. }) =
                &e.worker
            {
                lost.extend(n);
            }
            got.push((e.seq, n));
        }
    }
}

#[test]
fn a_full_gap_drops_no_worker_event() {
    const N: u64 = 1_100_000;
    /// When the slow pool owner commits the mark it was asked for: the gap (999 999 worker
    /// events) is full and 3001 wait (fewer than the REPLAY a reader may be behind by).
    const COMMIT_AT: u64 = 1_003_000;
    let f = Fixture::new();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let marks = Arc::clone(&asked);
    f.stream
        .set_marker(move |n| marks.lock().expect("asked").push(n));
    f.pool_event();
    let mut cursor = f.stream.cursor(Some(0), true);
    let (mut got, mut lost) = (Vec::with_capacity(N as usize + 2), Vec::new());
    for i in 0..N {
        f.stream.worker(numbered(i));
        if i == COMMIT_AT {
            // Asked once, at half the gap, not again while the mark is on its way.
            assert_eq!(*asked.lock().expect("asked"), [MARK_AT]);
            assert_eq!(
                f.stream.state().waiting.len() as u64,
                i + 1 - (SEQ_STRIDE - 1)
            );
            f.pool_event_of(EventKind::SeqMark {
                worker_events: MARK_AT,
            });
            assert!(f.stream.state().waiting.is_empty());
        }
        // Well within the REPLAY events memory keeps for a reader.
        if i % 1000 == 999 {
            read_all(&f, &mut cursor, &mut got, &mut lost);
        }
    }
    read_all(&f, &mut cursor, &mut got, &mut lost);
    assert_eq!(got.len() as u64, N + 2, "every event, once");
    assert!(
        got.windows(2).all(|w| w[0].0 < w[1].0),
        "seq strictly increasing"
    );
    // The worker events in the order they happened; the mark after the gap's last.
    let workers: Vec<u64> = got.iter().filter_map(|(_, n)| *n).collect();
    assert!(workers.iter().copied().eq(0..N));
    assert_eq!(got[0], (SEQ_STRIDE, None));
    assert_eq!(
        got[SEQ_STRIDE as usize - 1],
        (2 * SEQ_STRIDE - 1, Some(999_998))
    );
    assert_eq!(got[SEQ_STRIDE as usize], (2 * SEQ_STRIDE, None));
    assert_eq!(
        got[SEQ_STRIDE as usize + 1],
        (2 * SEQ_STRIDE + 1, Some(999_999))
    );
    assert_eq!(lost, [3, 999_998, 1_000_000, 1_000_001]);
    assert_eq!(asked.lock().expect("asked").len(), 1);
}

#[test]
fn a_mark_not_committed_is_asked_again_and_events_wait_meanwhile() {
    let f = Fixture::new();
    let asked = Arc::new(Mutex::new(Vec::new()));
    let marks = Arc::clone(&asked);
    f.stream
        .set_marker(move |n| marks.lock().expect("asked").push(n));
    f.pool_event();
    // The gap has room for one more worker event.
    f.stream.state().last = 2 * SEQ_STRIDE - 2;
    let mut cursor = f.stream.cursor(None, true);
    for i in 0..3 {
        f.stream.worker(numbered(10 + i));
    }
    assert_eq!(f.stream.state().last, 2 * SEQ_STRIDE - 1);
    assert_eq!(f.stream.state().waiting.len(), 2);
    assert_eq!(*asked.lock().expect("asked"), [SEQ_STRIDE - 1]);
    // The store refused the mark: the next worker event asks again.
    f.stream.mark_failed();
    f.stream.worker(numbered(13));
    assert_eq!(
        *asked.lock().expect("asked"),
        [SEQ_STRIDE - 1, SEQ_STRIDE + 2]
    );
    // Any pool event opens a gap: the waiting events are numbered after it, in order.
    f.pool_event_of(EventKind::SeqMark { worker_events: 1 });
    let (mut got, mut lost) = (Vec::new(), Vec::new());
    read_all(&f, &mut cursor, &mut got, &mut lost);
    let expected = [
        (2 * SEQ_STRIDE - 1, Some(10)),
        (2 * SEQ_STRIDE, None),
        (2 * SEQ_STRIDE + 1, Some(11)),
        (2 * SEQ_STRIDE + 2, Some(12)),
        (2 * SEQ_STRIDE + 3, Some(13)),
    ];
    assert_eq!(got, expected);
    assert_eq!(asked.lock().expect("asked").len(), 2);
}

#[test]
fn pool_events_pruned_under_a_reader_are_reported_where_they_were() {
    let f = Fixture::new();
    for _ in 0..10 {
        f.pool_event();
    }
    let mut cursor = f.stream.cursor(Some(2 * SEQ_STRIDE), false);
    // Retention prunes pool events 1 to 6 before the reader's first page.
    f.store.lock().expect("store").retain(|e| e.seq > 6);
    let Step::Page(page) = f.next(&mut cursor) else {
        panic!("no page")
    };
    assert!(
        matches!(page[0], Received::Lagged { missed: 4 }),
        "{page:?}"
    );
    let seqs: Vec<u64> = page[1..]
        .iter()
        .map(|r| match r {
            Received::Event(e) => e.seq,
            Received::Lagged { .. } => panic!("lagged twice"),
        })
        .collect();
    assert_eq!(seqs, [7, 8, 9, 10].map(|p| p * SEQ_STRIDE));
}

#[test]
fn a_since_older_than_the_store_keeps_is_refused_with_the_oldest_since() {
    assert!(EventsPruned::check(0, 0).is_ok());
    assert!(EventsPruned::check(5 * SEQ_STRIDE, 5).is_ok());
    assert!(EventsPruned::check(5 * SEQ_STRIDE + 7, 5).is_ok());
    let gone = EventsPruned::check(5 * SEQ_STRIDE - 1, 5).expect_err("pruned");
    assert_eq!(gone.oldest_since, 5 * SEQ_STRIDE);
    assert_eq!(gone.error.code, "events_pruned");
    assert!(
        gone.error.message.contains("since=5000000"),
        "{}",
        gone.error.message
    );
}
