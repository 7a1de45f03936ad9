//! The API's JSON of every lifecycle event, byte for byte as the previous release wrote it, and
//! back; the notes that carry an event's payload, in the datagram's form of the previous
//! release, and back.

use std::time::Duration;

use super::*;
use crate::custody::Note;

fn device_lost() -> LostDevice {
    LostDevice {
        host: "0000:00:04.0".into(),
        reason: "the kernel took the device back".into(),
    }
}

fn state_lost() -> LostState {
    LostState {
        problems: vec![
            "DMA window 0x1000+4096".into(),
            "eventfd of vector 2".into(),
        ],
    }
}

fn migration() -> MigrationChange {
    MigrationChange {
        state: "pre_copy".into(),
        cause: "request".into(),
        origin_verified: false,
        sent: false,
    }
}

/// Every variant, with its JSON as the previous release's `WorkerLifecycle` (fields inline)
/// serialised it.
fn every_event() -> Vec<(WorkerLifecycle, &'static str)> {
    let ep = || "vm".to_owned();
    vec![
        (
            WorkerLifecycle::Started {
                endpoint: ep(),
                pid: 7,
                resume: true,
            },
            r#"{"event":"started","endpoint":"vm","pid":7,"resume":true}"#,
        ),
        (
            WorkerLifecycle::Ready {
                endpoint: ep(),
                pid: 7,
                resumed_connection: true,
                restart: Some(Duration::from_millis(250)),
            },
            r#"{"event":"ready","endpoint":"vm","pid":7,"resumed_connection":true,"restart_ms":250.0}"#,
        ),
        (
            WorkerLifecycle::Ready {
                endpoint: ep(),
                pid: 8,
                resumed_connection: false,
                restart: None,
            },
            r#"{"event":"ready","endpoint":"vm","pid":8,"resumed_connection":false,"restart_ms":null}"#,
        ),
        (
            WorkerLifecycle::Exited {
                endpoint: ep(),
                pid: 7,
                status: "signal: 9 (SIGKILL)".into(),
            },
            r#"{"event":"exited","endpoint":"vm","pid":7,"status":"signal: 9 (SIGKILL)"}"#,
        ),
        (
            WorkerLifecycle::GaveUp { endpoint: ep() },
            r#"{"event":"gave_up","endpoint":"vm"}"#,
        ),
        (
            WorkerLifecycle::Migration {
                endpoint: ep(),
                change: migration(),
            },
            r#"{"event":"migration","endpoint":"vm","state":"pre_copy","cause":"request"}"#,
        ),
        (
            WorkerLifecycle::Migrated {
                endpoint: "dst".into(),
                source: "src".into(),
            },
            r#"{"event":"migrated","endpoint":"dst","source":"src"}"#,
        ),
        (
            WorkerLifecycle::MigrationAborted {
                endpoint: "dst".into(),
                source: "src".into(),
                state: "error".into(),
            },
            r#"{"event":"migration_aborted","endpoint":"dst","source":"src","state":"error"}"#,
        ),
        (
            WorkerLifecycle::MigrationReleased {
                endpoint: "src".into(),
                deleted: true,
            },
            r#"{"event":"migration_released","endpoint":"src","deleted":true}"#,
        ),
        (
            WorkerLifecycle::MigratedAway {
                endpoint: "src".into(),
            },
            r#"{"event":"migrated_away","endpoint":"src"}"#,
        ),
        (
            WorkerLifecycle::Reset {
                endpoint: ep(),
                what: "the client's connection was let go".into(),
            },
            r#"{"event":"reset","endpoint":"vm","what":"the client's connection was let go"}"#,
        ),
        (
            WorkerLifecycle::StateLost {
                endpoint: ep(),
                lost: state_lost(),
            },
            r#"{"event":"state_lost","endpoint":"vm","problems":["DMA window 0x1000+4096","eventfd of vector 2"]}"#,
        ),
        (
            WorkerLifecycle::DeviceLost {
                endpoint: ep(),
                lost: device_lost(),
            },
            r#"{"event":"device_lost","endpoint":"vm","host":"0000:00:04.0","reason":"the kernel took the device back"}"#,
        ),
    ]
}

const VARIANTS: usize = 12;

/// The variant's number (an exhaustive match: a new variant must be named here).
fn variant(e: &WorkerLifecycle) -> usize {
    match e {
        WorkerLifecycle::Started { .. } => 0,
        WorkerLifecycle::Ready { .. } => 1,
        WorkerLifecycle::Exited { .. } => 2,
        WorkerLifecycle::GaveUp { .. } => 3,
        WorkerLifecycle::Migration { .. } => 4,
        WorkerLifecycle::Migrated { .. } => 5,
        WorkerLifecycle::MigrationAborted { .. } => 6,
        WorkerLifecycle::Reset { .. } => 7,
        WorkerLifecycle::StateLost { .. } => 8,
        WorkerLifecycle::DeviceLost { .. } => 9,
        WorkerLifecycle::MigrationReleased { .. } => 10,
        WorkerLifecycle::MigratedAway { .. } => 11,
    }
}

#[test]
fn every_lifecycle_event_keeps_its_api_json_and_reads_back() {
    let events = every_event();
    // Every variant is there (a new one does not compile in `variant` until it is named,
    // and is missing here until it is added with its JSON).
    let variants: std::collections::BTreeSet<usize> =
        events.iter().map(|(e, _)| variant(e)).collect();
    assert_eq!(variants.len(), VARIANTS, "{variants:?}");
    for (event, json) in events {
        assert_eq!(serde_json::to_string(&event).expect("encodes"), json);
        let back: WorkerLifecycle = serde_json::from_str(json).expect(json);
        assert_eq!(back, event, "{json}");
        assert_eq!(
            back.endpoint(),
            json.split('"').nth(7).expect("an endpoint")
        );
    }
}

#[test]
fn a_ready_event_of_the_previous_release_without_restart_ms_reads() {
    let back: WorkerLifecycle = serde_json::from_str(
        r#"{"event":"ready","endpoint":"vm","pid":3,"resumed_connection":false}"#,
    )
    .expect("decodes");
    assert!(
        matches!(back, WorkerLifecycle::Ready { restart: None, .. }),
        "{back:?}"
    );
    let e = serde_json::from_str::<WorkerLifecycle>(
        r#"{"event":"ready","endpoint":"vm","pid":3,"resumed_connection":false,"restart_ms":-1.0}"#,
    )
    .expect_err("a negative duration");
    assert!(e.to_string().contains("negative"), "{e}");
}

/// The notes that carry a lifecycle event's payload, as the previous release's worker sent
/// them (fields inline), with the payload they carry.
#[test]
fn notes_carry_the_events_payload_in_the_previous_releases_datagram() {
    let cases: Vec<(Note, &str)> = vec![
        (
            Note::DeviceLost(device_lost()),
            r#"{"device_lost":{"host":"0000:00:04.0","reason":"the kernel took the device back"}}"#,
        ),
        (
            Note::StateLost(state_lost()),
            r#"{"state_lost":{"problems":["DMA window 0x1000+4096","eventfd of vector 2"]}}"#,
        ),
        (
            Note::Migration {
                streaming: true,
                change: Some(migration()),
            },
            r#"{"migration":{"streaming":true,"state":"pre_copy","cause":"request"}}"#,
        ),
        (
            Note::BoardFailed(BoardFailure {
                reason: "the engine of queue 0 died".into(),
                state_intact: true,
            }),
            r#"{"board_failed":{"reason":"the engine of queue 0 died","state_intact":true}}"#,
        ),
    ];
    for (note, json) in cases {
        assert_eq!(serde_json::to_string(&note).expect("encodes"), json);
        let back: Note = serde_json::from_str(json).expect(json);
        assert_eq!(back, note, "{json}");
    }
}

#[test]
fn a_migration_note_without_its_state_carries_no_change() {
    // Workers from before the state was reported; a state not said (null).
    for json in [
        r#"{"migration":{"streaming":true}}"#,
        r#"{"migration":{"streaming":false,"state":null,"cause":null}}"#,
    ] {
        let note: Note = serde_json::from_str(json).expect(json);
        assert!(
            matches!(note, Note::Migration { change: None, .. }),
            "{json}: {note:?}"
        );
    }
    // A state without its cause (not said): the event's cause is empty.
    let note: Note = serde_json::from_str(r#"{"migration":{"streaming":false,"state":"running"}}"#)
        .expect("decodes");
    let Note::Migration {
        streaming: false,
        change: Some(change),
    } = note
    else {
        panic!("{note:?}");
    };
    assert_eq!(change.state, "running");
    assert_eq!(change.cause, "");
}

#[test]
fn a_lost_device_is_a_board_failure_without_its_state() {
    let failure = device_lost().board_failure();
    assert_eq!(
        failure.reason,
        "0000:00:04.0: the kernel took the device back"
    );
    assert!(!failure.state_intact);
}
