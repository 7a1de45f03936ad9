//! The events hub: ordering, replay "since", lag reporting, closing; and the NDJSON stream over
//! a real socket with two subscribers that keep up and one that lags.
#![forbid(unsafe_code)]

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use common::{TestServer, socket_path};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use switchyard_control::{
    ControlApi, ControlError, Events, NDJSON_CONTENT_TYPE, Received, SHUTDOWN_GRACE, Sequenced,
    StreamNotice,
};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename = "tick")]
struct Tick {
    seq: u64,
    /// Padding, to fill socket buffers.
    data: String,
}

impl Sequenced for Tick {
    fn seq(&self) -> u64 {
        self.seq
    }
}

fn tick(seq: u64) -> Tick {
    Tick {
        seq,
        data: String::new(),
    }
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
}

/// Receives until the subscription would wait.
async fn drain(sub: &mut switchyard_control::Subscription<Tick>) -> Vec<Received<u64>> {
    let mut out = Vec::new();
    while let Ok(Some(r)) = tokio::time::timeout(Duration::from_millis(20), sub.recv()).await {
        out.push(match r {
            Received::Event(t) => Received::Event(t.seq),
            Received::Lagged { missed } => Received::Lagged { missed },
        });
    }
    out
}

#[test]
fn out_of_order_and_closed_publishes_are_refused() {
    let events = Events::new(4, 4);
    events.publish(tick(5)).expect("first");
    assert!(matches!(
        events.publish(tick(5)),
        Err(ControlError::EventOutOfOrder { seq: 5, last: 5 })
    ));
    assert!(matches!(
        events.publish(tick(3)),
        Err(ControlError::EventOutOfOrder { seq: 3, last: 5 })
    ));
    events.publish(tick(6)).expect("next");
    assert_eq!(events.last_seq(), Some(6));
    events.close();
    assert!(matches!(
        events.publish(tick(7)),
        Err(ControlError::EventsClosed)
    ));
}

#[test]
fn since_replays_the_buffer_and_reports_what_fell_out() {
    runtime().block_on(async {
        let events = Events::new(4, 16);
        for seq in 1..=10 {
            events.publish(tick(seq)).expect("publish");
        }
        // The buffer holds 7..=10; 1..=6 fell out.
        let mut from_start = events.subscribe(Some(0));
        let mut from_8 = events.subscribe(Some(8));
        let mut from_6 = events.subscribe(Some(6));
        let mut live = events.subscribe(None);
        events.publish(tick(11)).expect("publish");
        let e = Received::Event;
        assert_eq!(
            drain(&mut from_start).await,
            vec![
                Received::Lagged { missed: 6 },
                e(7),
                e(8),
                e(9),
                e(10),
                e(11)
            ]
        );
        assert_eq!(drain(&mut from_8).await, vec![e(9), e(10), e(11)]);
        assert_eq!(
            drain(&mut from_6).await,
            vec![e(7), e(8), e(9), e(10), e(11)]
        );
        assert_eq!(drain(&mut live).await, vec![e(11)]);
    });
}

#[test]
fn a_slow_subscriber_is_told_how_many_it_missed() {
    runtime().block_on(async {
        let events = Events::new(64, 2);
        let mut slow = events.subscribe(None);
        for seq in 1..=10 {
            events.publish(tick(seq)).expect("publish");
        }
        let e = Received::Event;
        assert_eq!(
            drain(&mut slow).await,
            vec![Received::Lagged { missed: 8 }, e(9), e(10)]
        );
    });
}

#[test]
fn close_ends_subscriptions_after_the_published_events() {
    runtime().block_on(async {
        let events = Events::new(8, 8);
        let mut sub = events.subscribe(None);
        events.publish(tick(1)).expect("publish");
        events.publish(tick(2)).expect("publish");
        events.close();
        assert_eq!(sub.recv().await, Some(Received::Event(tick(1))));
        assert_eq!(sub.recv().await, Some(Received::Event(tick(2))));
        assert_eq!(sub.recv().await, None);
        // Subscribing after the close ends at once too (after the replay).
        let mut late = events.subscribe(Some(1));
        assert_eq!(late.recv().await, Some(Received::Event(tick(2))));
        assert_eq!(late.recv().await, None);
    });
}

fn server(events: &Events<Tick>) -> (tempfile::TempDir, TestServer) {
    let (dir, path) = socket_path();
    let (router, _) = ControlApi::new("test", "0")
        .events::<Tick>()
        .build(events.clone());
    (dir, TestServer::start(&path, router).expect("bind"))
}

/// What a stream line is.
#[derive(Debug, PartialEq)]
enum Line {
    Tick(u64),
    Lagged(u64),
}

fn parse(line: &str) -> Line {
    let v: Value = serde_json::from_str(line).expect("each line is JSON");
    match v["type"].as_str() {
        Some("tick") => Line::Tick(serde_json::from_value::<Tick>(v).expect("a tick").seq),
        Some("lagged") => match serde_json::from_value(v).expect("a notice") {
            StreamNotice::Lagged { missed } => Line::Lagged(missed),
        },
        _ => panic!("unknown line {line}"),
    }
}

#[test]
fn stream_replays_since_over_http() {
    let events = Events::new(4, 16);
    for seq in 1..=10 {
        events.publish(tick(seq)).expect("publish");
    }
    let (_dir, server) = server(&events);
    let client = server.client();
    let raw_head = client
        .request("GET", "/events?since=bad", None)
        .expect("reply");
    assert_eq!(raw_head.status, 400);
    let mut stream = client.stream("/events?since=2").expect("stream");
    events.close();
    let lines: Vec<Line> = stream
        .by_ref()
        .map(|l| parse(&l.expect("readable")))
        .collect();
    assert_eq!(
        lines,
        vec![
            Line::Lagged(4),
            Line::Tick(7),
            Line::Tick(8),
            Line::Tick(9),
            Line::Tick(10)
        ]
    );
}

/// Two subscribers that keep up see every event in order; a third that reads nothing until the
/// end gets "lagged" lines where events were dropped, and the events it does get plus the
/// missed counts add up to all of them.
#[test]
fn two_subscribers_keep_up_and_a_lagging_one_is_told() {
    const EVENTS: u64 = 300;
    const CHANNEL: usize = 16;
    // Large events, so that the lagging reader's socket and the server's buffers fill after a
    // few of them and the rest must wait in the channel.
    let padding = "x".repeat(64 * 1024);
    let events = Events::new(8, CHANNEL);
    let (_dir, server) = server(&events);
    let client = server.client();

    let seen: Vec<Arc<AtomicU64>> = (0..2).map(|_| Arc::new(AtomicU64::new(0))).collect();
    let readers: Vec<_> = seen
        .iter()
        .map(|seen| {
            let seen = Arc::clone(seen);
            let mut stream = client.stream("/events").expect("stream");
            thread::spawn(move || {
                let mut got = Vec::new();
                for line in stream.by_ref() {
                    let line = parse(&line.expect("readable"));
                    if let Line::Tick(seq) = line {
                        seen.store(seq, Ordering::Release);
                    }
                    got.push(line);
                }
                got
            })
        })
        .collect();
    let lagging = client.stream("/events").expect("stream");

    for seq in 1..=EVENTS {
        // Stay within a few events of the keeping-up readers, far less than the channel.
        let deadline = Instant::now() + Duration::from_secs(20);
        while seen.iter().any(|s| s.load(Ordering::Acquire) + 4 < seq) {
            assert!(Instant::now() < deadline, "the readers stopped at {seen:?}");
            thread::sleep(Duration::from_micros(50));
        }
        events
            .publish(Tick {
                seq,
                data: padding.clone(),
            })
            .expect("publish");
    }
    events.close();

    for reader in readers {
        let got = reader.join().expect("reader");
        assert_eq!(got, (1..=EVENTS).map(Line::Tick).collect::<Vec<_>>());
    }
    let lines: Vec<Line> = lagging.map(|l| parse(&l.expect("readable"))).collect();
    let (mut ticks, mut lags) = (Vec::new(), Vec::new());
    for line in &lines {
        match line {
            Line::Tick(seq) => ticks.push(*seq),
            Line::Lagged(missed) => lags.push(*missed),
        }
    }
    assert!(!lags.is_empty(), "the lagging reader was never told");
    assert!(ticks.windows(2).all(|w| w[0] < w[1]), "{ticks:?}");
    assert_eq!(ticks.len() as u64 + lags.iter().sum::<u64>(), EVENTS);
    // The channel's last events always arrive.
    assert_eq!(ticks.last(), Some(&EVENTS));
    assert!(ticks.len() >= CHANNEL);
    // Every stream ended with the hub: nothing holds the shutdown.
    let (result, took) = server.stop();
    result.expect("clean stop");
    assert!(took < SHUTDOWN_GRACE, "stop took {took:?}");
}

#[test]
fn stream_is_ndjson() {
    let events = Events::new(4, 4);
    let (_dir, server) = server(&events);
    events.publish(tick(1)).expect("publish");
    let stream = server.client().stream("/events?since=0").expect("stream");
    assert_eq!(stream.content_type(), Some(NDJSON_CONTENT_TYPE));
    events.close();
    let lines: Vec<String> = stream.map(|l| l.expect("readable")).collect();
    assert_eq!(
        lines,
        vec![r#"{"type":"tick","seq":1,"data":""}"#.to_owned()]
    );
}
