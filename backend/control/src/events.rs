//! The events hub: lifecycle events fanned out to any number of subscribers, with a bounded
//! replay buffer so that a subscriber can resume "since seq X".
//!
//! The payload is the daemon's own type; it carries its sequence number ([`Sequenced`]), which
//! must increase by one per event (the daemon persists it, so numbering continues across
//! restarts). [`Events::publish`] refuses a number that does not increase.
//!
//! Over HTTP, [`events_handler`] streams newline-delimited JSON (`application/x-ndjson`): one
//! event per line, as the payload serializes (an object with a `type` member is what clients
//! expect). NDJSON rather than server-sent events: `curl -N --unix-socket S
//! http://localhost/events` shows one readable line per event, `jq` reads the stream as it is,
//! and the blocking client needs no SSE parser; resuming is explicit (`?since=SEQ`) instead of
//! SSE's `Last-Event-ID`.
//!
//! A subscriber never misses events silently: one that falls more than the channel capacity
//! behind, or asks to resume from before the replay buffer, gets a [`StreamNotice::Lagged`]
//! line, `{"type":"lagged","missed":N}`, where the events would have been.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::fmt;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use utoipa::{IntoParams, ToSchema};

use crate::ControlError;
use crate::api::{ApiError, Query};

/// The `Content-Type` of the events stream.
pub const NDJSON_CONTENT_TYPE: &str = "application/x-ndjson";

/// An event's sequence number.
pub trait Sequenced {
    /// The sequence number: one more than the previous event's.
    fn seq(&self) -> u64;
}

/// A line of the events stream that is not an event.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamNotice {
    /// `missed` events were dropped here: the subscriber fell behind, or resumed from before
    /// the replay buffer. Re-read the state (the list endpoints) to catch up.
    Lagged {
        /// How many events were not delivered (assuming consecutive sequence numbers).
        missed: u64,
    },
}

/// What a [`Subscription`] yields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Received<T> {
    /// The next event.
    Event(T),
    /// `missed` events were dropped before the next one.
    Lagged {
        /// How many.
        missed: u64,
    },
}

struct Replay<T> {
    buffer: VecDeque<T>,
    capacity: usize,
    last_seq: Option<u64>,
    last_evicted: Option<u64>,
}

struct Inner<T> {
    tx: broadcast::Sender<T>,
    replay: Mutex<Replay<T>>,
    closed: watch::Sender<bool>,
}

/// The events hub. Cheap to clone; clones share subscribers and the replay buffer.
pub struct Events<T> {
    inner: Arc<Inner<T>>,
}

impl<T> Clone for Events<T> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
        }
    }
}

impl<T> fmt::Debug for Events<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let replay = lock(&self.inner.replay);
        f.debug_struct("Events")
            .field("subscribers", &self.inner.tx.receiver_count())
            .field("buffered", &replay.buffer.len())
            .field("last_seq", &replay.last_seq)
            .field("closed", &*self.inner.closed.borrow())
            .finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<T> Events<T>
where
    T: Sequenced + Clone + Send + Sync + 'static,
{
    /// A hub that keeps the last `replay` events for resuming subscribers, and lets a live
    /// subscriber fall up to `channel` events behind before it is told it lagged. Both are at
    /// least 1.
    pub fn new(replay: usize, channel: usize) -> Self {
        let (tx, _) = broadcast::channel(channel.max(1));
        Self {
            inner: Arc::new(Inner {
                tx,
                replay: Mutex::new(Replay {
                    buffer: VecDeque::with_capacity(replay.max(1)),
                    capacity: replay.max(1),
                    last_seq: None,
                    last_evicted: None,
                }),
                closed: watch::Sender::new(false),
            }),
        }
    }

    /// Publishes `event` to every subscriber and the replay buffer. Refused when its sequence
    /// number is not above the previous event's, or after [`Events::close`].
    pub fn publish(&self, event: T) -> Result<(), ControlError> {
        if *self.inner.closed.borrow() {
            return Err(ControlError::EventsClosed);
        }
        let seq = event.seq();
        let mut replay = lock(&self.inner.replay);
        if let Some(last) = replay.last_seq
            && seq <= last
        {
            return Err(ControlError::EventOutOfOrder { seq, last });
        }
        if replay.buffer.len() == replay.capacity
            && let Some(old) = replay.buffer.pop_front()
        {
            replay.last_evicted = Some(old.seq());
        }
        replay.buffer.push_back(event.clone());
        replay.last_seq = Some(seq);
        // Sent under the replay lock, so that a subscriber (which takes it too) gets each
        // event exactly once: from the buffer or from the channel. No receivers is fine.
        let _ = self.inner.tx.send(event);
        Ok(())
    }

    /// A subscription to the events after `since` (the replayable ones first), or to the
    /// events from now on when `since` is `None`. Events before the replay buffer are reported
    /// as one [`Received::Lagged`].
    pub fn subscribe(&self, since: Option<u64>) -> Subscription<T> {
        let replay = lock(&self.inner.replay);
        let rx = self.inner.tx.subscribe();
        let mut gap = None;
        let mut backlog = VecDeque::new();
        if let Some(since) = since {
            if let Some(evicted) = replay.last_evicted
                && since < evicted
            {
                gap = Some(evicted - since);
            }
            backlog.extend(replay.buffer.iter().filter(|e| e.seq() > since).cloned());
        }
        drop(replay);
        Subscription {
            gap,
            backlog,
            rx,
            closed: self.inner.closed.subscribe(),
            closing: false,
        }
    }

    /// The sequence number of the last event published, if any.
    pub fn last_seq(&self) -> Option<u64> {
        lock(&self.inner.replay).last_seq
    }

    /// Ends every subscription (after the events already published) and refuses further
    /// events. Call it when the daemon shuts down: an open events stream otherwise holds its
    /// connection until the server's grace period runs out.
    pub fn close(&self) {
        self.inner.closed.send_replace(true);
    }

    /// Whether [`Events::close`] was called.
    pub fn is_closed(&self) -> bool {
        *self.inner.closed.borrow()
    }
}

/// One subscriber's view of the hub (see [`Events::subscribe`]).
pub struct Subscription<T> {
    gap: Option<u64>,
    backlog: VecDeque<T>,
    rx: broadcast::Receiver<T>,
    closed: watch::Receiver<bool>,
    closing: bool,
}

impl<T> fmt::Debug for Subscription<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Subscription")
            .field("backlog", &self.backlog.len())
            .field("closing", &self.closing)
            .finish_non_exhaustive()
    }
}

impl<T: Clone> Subscription<T> {
    /// The next event or lag notice; `None` once the hub is closed and every event published
    /// before that has been received.
    pub async fn recv(&mut self) -> Option<Received<T>> {
        if let Some(missed) = self.gap.take() {
            return Some(Received::Lagged { missed });
        }
        if let Some(event) = self.backlog.pop_front() {
            return Some(Received::Event(event));
        }
        loop {
            if self.closing {
                return match self.rx.try_recv() {
                    Ok(event) => Some(Received::Event(event)),
                    Err(broadcast::error::TryRecvError::Lagged(missed)) => {
                        Some(Received::Lagged { missed })
                    }
                    Err(_) => None,
                };
            }
            tokio::select! {
                biased;
                r = self.rx.recv() => return match r {
                    Ok(event) => Some(Received::Event(event)),
                    Err(broadcast::error::RecvError::Lagged(missed)) => {
                        Some(Received::Lagged { missed })
                    }
                    Err(broadcast::error::RecvError::Closed) => None,
                },
                () = async { let _ = self.closed.wait_for(|c| *c).await; } => {
                    self.closing = true;
                }
            }
        }
    }
}

/// The query of `GET /events`.
#[derive(Debug, Clone, Copy, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct EventsQuery {
    /// Replay the buffered events with a sequence number above this one first; without it,
    /// only events from now on.
    pub since: Option<u64>,
}

/// Streams `subscription` as newline-delimited JSON: each event as `T` serializes, each lag as
/// `{"type":"lagged","missed":N}`. The body ends when the hub closes.
pub fn ndjson_response<T>(subscription: Subscription<T>) -> Response
where
    T: Serialize + Sequenced + Clone + Send + Sync + 'static,
{
    let lines = futures_util::stream::unfold(subscription, |mut sub| async move {
        let item = sub.recv().await?;
        Some((Ok::<_, Infallible>(encode_line(&item)), sub))
    });
    (
        [(header::CONTENT_TYPE, NDJSON_CONTENT_TYPE)],
        Body::from_stream(lines),
    )
        .into_response()
}

fn encode_line<T: Serialize + Sequenced>(item: &Received<T>) -> Bytes {
    let encoded = match item {
        Received::Event(event) => serde_json::to_vec(event).map_err(|e| (event.seq(), e)),
        Received::Lagged { missed } => {
            serde_json::to_vec(&StreamNotice::Lagged { missed: *missed }).map_err(|e| (0, e))
        }
    };
    let mut line = encoded.unwrap_or_else(|(seq, e)| {
        // A payload that cannot be serialized is a bug in the daemon; the subscriber is
        // told rather than left with a hole. Counted as a lag of one.
        tracing::error!(seq, "an event could not be serialized: {e}");
        br#"{"type":"lagged","missed":1}"#.to_vec()
    });
    line.push(b'\n');
    Bytes::from(line)
}

/// `GET /events?since=SEQ`: the events stream ([`ndjson_response`]) of the hub in the router's
/// state (`Events<T>: FromRef<S>`). 503 `shutting_down` once the hub is closed.
pub async fn events_handler<T>(
    State(events): State<Events<T>>,
    Query(query): Query<EventsQuery>,
) -> Response
where
    T: Serialize + Sequenced + Clone + Send + Sync + 'static,
{
    if events.is_closed() {
        return ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "shutting_down",
            "The daemon is shutting down",
        )
        .into_response();
    }
    ndjson_response(events.subscribe(query.since))
}
