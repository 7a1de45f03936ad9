//! The order of what the reactions publish and what the migrations follower is handed.

use std::sync::Mutex;

use switchyard_control::Received;

use super::*;
use crate::app::events::Step;
use crate::app::records::WorkerIdentity;

/// Worker events as `(seq, event name)`.
type Published = Vec<(u64, String)>;

/// The worker events published so far.
fn published(events: &EventStream) -> Published {
    let mut cursor = events.cursor(Some(0), false);
    let mut out = Vec::new();
    loop {
        match events.next_page(&mut cursor, |_, _| Ok::<_, ()>(Vec::new())) {
            Ok(Step::Page(page)) => {
                for r in page {
                    if let Received::Event(e) = r
                        && let Some(w) = &e.worker
                    {
                        let v = serde_json::to_value(w).expect("json");
                        out.push((e.seq, v["event"].as_str().unwrap_or_default().to_owned()));
                    }
                }
            }
            Ok(_) => return out,
            Err(()) => unreachable!("no pool events are read"),
        }
    }
}

/// The follower publishes `migrated` when it is handed the change that completes a migration:
/// the `migration` event of that change must already be in the stream then, or `migrated`
/// would be listed before the event that caused it.
#[test]
fn a_migration_change_is_published_before_the_follower_is_handed_it() {
    let events = Arc::new(EventStream::new(0));
    // What the stream held each time the follower was handed a change.
    let seen: Arc<Mutex<Vec<(String, Published)>>> = Arc::default();
    let reactions = Reactions {
        events: events.clone(),
        metrics: Metrics::new(),
        records: WorkerRecords::new(
            std::env::temp_dir().join("switchyard-reactions-test-unused"),
            WorkerIdentity::of(std::path::Path::new("/nonexistent")),
        ),
        daemon: Arc::default(),
        migrations: Box::new({
            let (events, seen) = (events.clone(), seen.clone());
            move |(_, change): EndpointMigration| {
                let now = published(&events);
                seen.lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push((change.state, now));
            }
        }),
    };
    let sink = reactions.into_sink();
    let running = MigrationChange {
        state: "running".into(),
        cause: "request".into(),
        origin_verified: true,
        sent: false,
    };
    sink(WorkerEvent::Lifecycle(WorkerLifecycle::Migration {
        endpoint: "vm1-in".into(),
        change: running,
    }));
    sink(WorkerEvent::Lifecycle(WorkerLifecycle::Exited {
        endpoint: "vm1-in".into(),
        pid: 1,
        status: "exit status: 0".into(),
    }));
    let seen = seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let states: Vec<&str> = seen.iter().map(|(s, _)| s.as_str()).collect();
    assert_eq!(states, ["running", "exited"]);
    let names = |i: usize| -> Vec<String> { seen[i].1.iter().map(|(_, n)| n.clone()).collect() };
    assert_eq!(names(0), ["migration"], "handed before it was published");
    assert_eq!(
        names(1),
        ["migration", "exited"],
        "handed before it was published"
    );
}
