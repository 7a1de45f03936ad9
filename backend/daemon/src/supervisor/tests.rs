//! A worker's notes, as the previous release's worker wrote them, through the supervisor's
//! ledger to its sink and on to the events stream: each lifecycle event a client reads is the
//! value the supervisor made of the note, with the API's JSON of the previous release.

use std::convert::Infallible;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use switchyard_control::Received;
use switchyard_server::DeviceSocket;

use super::common::Launch;
use super::ledger::serve_notes;
use super::*;
use crate::app::events::{EventStream, Step};
use crate::custody::WorkerStats;
use crate::lifecycle::{BoardFailure, MigrationChange};

/// What the worker says, in order: `(note, the events stream's worker event, if any)`.
const NOTES: &[(&str, Option<&str>)] = &[
    (
        r#"{"ready":{"resumed":true,"replacement":"resume"}}"#,
        Some(
            r#"{"event":"ready","endpoint":"vm","pid":42,"resumed_connection":true,"restart_ms":null}"#,
        ),
    ),
    (
        r#"{"migration":{"streaming":true,"state":"pre_copy","cause":"request"}}"#,
        Some(r#"{"event":"migration","endpoint":"vm","state":"pre_copy","cause":"request"}"#),
    ),
    // A worker from before migration states were reported: no event.
    (r#"{"migration":{"streaming":false}}"#, None),
    (
        r#"{"state_lost":{"problems":["DMA window 0x1000+4096"]}}"#,
        Some(r#"{"event":"state_lost","endpoint":"vm","problems":["DMA window 0x1000+4096"]}"#),
    ),
    (
        r#"{"device_lost":{"host":"0000:00:04.0","reason":"the kernel took the device back"}}"#,
        Some(
            r#"{"event":"device_lost","endpoint":"vm","host":"0000:00:04.0","reason":"the kernel took the device back"}"#,
        ),
    ),
    (
        r#"{"board_failed":{"reason":"the engine of queue 0 died","state_intact":true}}"#,
        None,
    ),
    // A report of the previous release (no `replayed`, `interrupted`).
    (
        r#"{"stats":{"messages":[[1,2]],"latency_buckets":[3],"latency_sum_ns":5,"jobs":6,"bytes":7,"errors":0}}"#,
        None,
    ),
];

/// A flood of migration changes after those: past the endpoint's event budget they are
/// signals, not events.
const FLOOD: usize = 100;
const FLOOD_NOTE: &str = r#"{"migration":{"streaming":false,"state":"running","cause":"reset"}}"#;
const FLOOD_EVENT: &str =
    r#"{"event":"migration","endpoint":"vm","state":"running","cause":"reset"}"#;

fn endpoint(dir: &std::path::Path) -> Endpoint {
    let spec = EndpointSpec {
        id: "vm".into(),
        socket: dir.join("vm.sock"),
        device: switchyard_kinds::DeviceSpec {
            kind: "scratchpad".into(),
            options: Default::default(),
        },
        failover: true,
        lease: Some("gpu0".into()),
        migration: Default::default(),
    };
    let socket = DeviceSocket::bind(&spec.socket, 0o600).expect("bind");
    let ep = Endpoint::new(spec, socket);
    ep.status().lease = Some("gpu0".into());
    ep
}

#[test]
fn a_workers_notes_reach_the_events_stream_as_the_supervisor_made_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ep = endpoint(dir.path());
    let (ours, theirs) = crate::custody::pair().expect("pair");
    let worker = std::thread::spawn(move || {
        let notes = NOTES.iter().map(|(n, _)| *n);
        for note in notes.chain(std::iter::repeat_n(FLOOD_NOTE, FLOOD)) {
            switchyard_endpoint::send_all(&theirs, note.as_bytes(), &[]).expect("send");
        }
        // Closing its end ends `serve_notes`.
    });
    // The daemon's sink, less its reactions: lifecycle events published as they are.
    let stream = Arc::new(EventStream::new(0));
    let signals: Arc<Mutex<Vec<WorkerSignal>>> = Arc::default();
    let sink: EventSink = {
        let (stream, signals) = (stream.clone(), signals.clone());
        Arc::new(move |e| match e {
            WorkerEvent::Lifecycle(e) => stream.worker(e),
            WorkerEvent::Signal(s) => signals.lock().expect("signals").push(s),
        })
    };
    let launch = Launch {
        adopt_dir: None,
        fd_budget: None,
        migration_idle: None,
        jail: true,
    };
    let now = Instant::now();
    let ready = serve_notes(&ep, &ours, 42, None, now, &sink, launch, &|| {
        panic!("a note broke the channel protocol")
    });
    worker.join().expect("worker");
    assert!(ready);

    // What a client of `GET /events` reads: each line's `worker` member.
    let mut cursor = stream.cursor(Some(0), false);
    let read = stream.next_page(&mut cursor, |_, _| Ok::<_, Infallible>(Vec::new()));
    let Ok(Step::Page(page)) = read else {
        panic!("a page of events");
    };
    let lines: Vec<String> = page
        .iter()
        .map(|r| match r {
            Received::Event(e) => {
                serde_json::to_string(e.worker.as_ref().expect("a worker event")).expect("json")
            }
            Received::Lagged { missed } => panic!("lagged {missed}"),
        })
        .collect();
    let expected: Vec<&str> = NOTES.iter().filter_map(|(_, e)| *e).collect();
    assert_eq!(lines[..expected.len()], expected[..]);
    let published = &lines[expected.len()..];
    assert!(published.iter().all(|l| l == FLOOD_EVENT), "{published:?}");

    let signals = signals.lock().expect("signals").clone();
    let failed = |reason: &str, state_intact| WorkerSignal::BoardFailed {
        endpoint: "vm".into(),
        lease: Some("gpu0".into()),
        failure: BoardFailure {
            reason: reason.into(),
            state_intact,
        },
    };
    let stats = WorkerSignal::Stats {
        endpoint: "vm".into(),
        stats: WorkerStats {
            messages: vec![(1, 2)],
            latency_buckets: vec![3],
            latency_sum_ns: 5,
            jobs: 6,
            bytes: 7,
            ..WorkerStats::default()
        },
    };
    assert_eq!(
        signals[..3],
        [
            failed("0000:00:04.0: the kernel took the device back", false),
            failed("the engine of queue 0 died", true),
            stats,
        ]
    );
    // Every change of the flood is either published or signalled, never dropped; some are
    // past the budget.
    let flooded = WorkerSignal::Migration {
        endpoint: "vm".into(),
        change: MigrationChange {
            state: "running".into(),
            cause: "reset".into(),
            origin_verified: false,
            sent: false,
        },
    };
    let signalled = &signals[3..];
    assert!(signalled.iter().all(|s| *s == flooded), "{signalled:?}");
    assert_eq!(published.len() + signalled.len(), FLOOD);
    assert!(!signalled.is_empty(), "{} published", published.len());

    let st = ep.status().clone();
    assert_eq!(st.ready, 1);
    assert_eq!(st.state_lost, ["DMA window 0x1000+4096"]);
    assert_eq!(
        st.device_lost.as_deref(),
        Some("0000:00:04.0: the kernel took the device back")
    );
    assert!(!st.migrating);
}
