//! Who is calling, and how much of the server one caller may hold.
//!
//! Every accepted connection is a UNIX socket whose peer the kernel names (`SO_PEERCRED`: the
//! uid, gid and pid of the process that connected). The server hands it to every request of
//! the connection as a [`Caller`] (an extractor), and admits connections and long-lived
//! streams by uid:
//!
//! - **Privileged** callers are root and the server's own user (the daemon's operator). Only
//!   the totals bound them ([`Limits::max_connections`], [`Limits::max_streams`]).
//! - **Everyone else** (members of the daemon's `--socket-group`) gets at most
//!   [`Limits::max_connections_per_uid`] connections and [`Limits::max_streams_per_uid`]
//!   streams per uid, and all of them together never more than the totals less the reserves
//!   ([`Limits::reserved_connections`], [`Limits::reserved_streams`]). So however many users
//!   hold however many connections, root always has the reserve to connect with.
//!
//! The decisions are pure functions of the counts ([`admit_connection`], [`admit_stream`]),
//! tested without sockets or other users; the server keeps the connection counts in its
//! accept loop (one task: no lock) and the stream counts in a table of their own (a mutex).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use axum::extract::FromRequestParts;
use axum::http::StatusCode;
use axum::http::request::Parts;

use crate::api::ApiError;
use crate::limits::Limits;

/// The uid of root.
pub const ROOT_UID: u32 = 0;

/// The process at the other end of a control connection (`SO_PEERCRED`, read when the
/// connection was accepted), as every request of the connection sees it. Take it as a
/// handler argument; a request that did not come through a [`crate::ControlSocket`] has
/// none and is answered 500.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Its user id.
    pub uid: u32,
    /// Its group id.
    pub gid: u32,
    /// Its process id (none when the kernel could not name it: another pid namespace).
    pub pid: Option<u32>,
    /// Root, or the server's own user: see [`Caller::privileged`].
    privileged: bool,
    /// The server's stream counts.
    streams: Arc<StreamTable>,
}

impl Caller {
    pub(crate) fn new(
        uid: u32,
        gid: u32,
        pid: Option<u32>,
        server_uid: u32,
        streams: Arc<StreamTable>,
    ) -> Self {
        Self {
            uid,
            gid,
            pid,
            privileged: is_privileged(uid, server_uid),
            streams,
        }
    }

    /// Whether the caller is root or the server's own user: the operator, who may act on
    /// everything and whom the reserves of [`Limits`] are kept for.
    pub fn privileged(&self) -> bool {
        self.privileged
    }

    /// A slot for one long-lived stream (an events stream): held until the permit is
    /// dropped, e.g. with the reply's body ([`StreamPermit::hold`]). Refused with 503
    /// `too_many_streams`, naming the limit, when the caller's uid has
    /// [`Limits::max_streams_per_uid`] open, or the server [`Limits::max_streams`] (less the
    /// reserve for an unprivileged caller).
    pub fn open_stream(&self) -> Result<StreamPermit, ApiError> {
        self.streams.open(self.uid, self.privileged)
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        parts.extensions.get::<Caller>().cloned().ok_or_else(|| {
            ApiError::internal(
                "The request has no caller (it did not come through the control socket)",
            )
        })
    }
}

/// Whether `uid` is root or the server's own user.
pub(crate) fn is_privileged(uid: u32, server_uid: u32) -> bool {
    uid == ROOT_UID || uid == server_uid
}

/// Connections open now (those told to close not counted), as a new one finds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnectionCounts {
    /// All of them.
    pub total: usize,
    /// Those of unprivileged callers.
    pub unprivileged: usize,
    /// Those of the new connection's uid.
    pub of_uid: usize,
}

/// Which open connections an idle one may be closed from to make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Any.
    Any,
    /// Those of unprivileged callers.
    Unprivileged,
    /// Those of this uid.
    Uid(u32),
}

/// What a new connection needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// There is room: serve it.
    Room,
    /// Close the idle connection (no request in progress) of `scope` that has waited
    /// longest, then serve it; without one, refuse it with `refusal` (the message of a 503
    /// `too_many_connections`).
    CloseIdle {
        /// Where an idle connection may be closed.
        scope: Scope,
        /// Why it is refused when none is idle.
        refusal: String,
    },
}

/// The decision on a new connection of `uid` (privileged or not) when `counts` are open.
pub fn admit_connection(
    limits: &Limits,
    counts: ConnectionCounts,
    uid: u32,
    privileged: bool,
) -> Admission {
    let max = limits.max_connections.max(1);
    let shared = max.saturating_sub(limits.reserved_connections).max(1);
    let per_uid = limits.max_connections_per_uid.clamp(1, shared);
    if !privileged {
        if counts.of_uid >= per_uid {
            return Admission::CloseIdle {
                scope: Scope::Uid(uid),
                refusal: format!(
                    "User {uid} has {per_uid} control connections busy, the most one user may hold; close one or try again later"
                ),
            };
        }
        if counts.unprivileged >= shared {
            return Admission::CloseIdle {
                scope: Scope::Unprivileged,
                refusal: format!(
                    "Every one of the {shared} control connections users other than root may hold is busy ({} more are kept for root); try again later",
                    max - shared
                ),
            };
        }
    }
    if counts.total >= max {
        return Admission::CloseIdle {
            scope: Scope::Any,
            refusal: format!("Every one of the {max} control connections is busy; try again later"),
        };
    }
    Admission::Room
}

/// Streams open now.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StreamCounts {
    /// All of them.
    pub total: usize,
    /// Those of unprivileged callers.
    pub unprivileged: usize,
    /// By uid (uids with none are not kept).
    pub by_uid: HashMap<u32, usize>,
}

/// Whether one more stream of `uid` (privileged or not) fits when `counts` are open; the
/// refusal's message (a 503 `too_many_streams`) when not.
pub fn admit_stream(
    limits: &Limits,
    counts: &StreamCounts,
    uid: u32,
    privileged: bool,
) -> Result<(), String> {
    let max = limits.max_streams.max(1);
    let shared = max.saturating_sub(limits.reserved_streams).max(1);
    let per_uid = limits.max_streams_per_uid.clamp(1, shared);
    if !privileged {
        if counts.by_uid.get(&uid).copied().unwrap_or(0) >= per_uid {
            return Err(format!(
                "User {uid} has {per_uid} streams open, the most one user may; close one or try again later"
            ));
        }
        if counts.unprivileged >= shared {
            return Err(format!(
                "The {shared} streams users other than root may open are open ({} more are kept for root); try again later",
                max - shared
            ));
        }
    }
    if counts.total >= max {
        return Err(format!(
            "{max} streams are open, the most the server serves; close one or try again later"
        ));
    }
    Ok(())
}

/// The streams open on a server, by uid.
#[derive(Debug)]
pub(crate) struct StreamTable {
    limits: Limits,
    /// The counts; taken for a check-and-count or a release, never across anything else.
    counts: Mutex<StreamCounts>,
}

impl StreamTable {
    pub(crate) fn new(limits: Limits) -> Self {
        Self {
            limits,
            counts: Mutex::new(StreamCounts::default()),
        }
    }

    fn open(self: &Arc<Self>, uid: u32, privileged: bool) -> Result<StreamPermit, ApiError> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        admit_stream(&self.limits, &counts, uid, privileged).map_err(|message| {
            tracing::debug!(uid, "{message}");
            ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "too_many_streams", message)
        })?;
        counts.total += 1;
        if !privileged {
            counts.unprivileged += 1;
        }
        *counts.by_uid.entry(uid).or_insert(0) += 1;
        Ok(StreamPermit {
            table: Arc::clone(self),
            uid,
            privileged,
        })
    }

    fn release(&self, uid: u32, privileged: bool) {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        counts.total = counts.total.saturating_sub(1);
        if !privileged {
            counts.unprivileged = counts.unprivileged.saturating_sub(1);
        }
        if let Some(n) = counts.by_uid.get_mut(&uid) {
            *n -= 1;
            if *n == 0 {
                counts.by_uid.remove(&uid);
            }
        }
    }
}

/// One open stream of a caller ([`Caller::open_stream`]); its slot is free again when this
/// is dropped.
#[derive(Debug)]
pub struct StreamPermit {
    table: Arc<StreamTable>,
    uid: u32,
    privileged: bool,
}

impl StreamPermit {
    /// `body`, holding this permit until it is dropped (sent to its end, or cut).
    pub fn hold(self, body: axum::body::Body) -> axum::body::Body {
        axum::body::Body::new(Held {
            inner: body,
            _permit: self,
        })
    }
}

impl Drop for StreamPermit {
    fn drop(&mut self) {
        self.table.release(self.uid, self.privileged);
    }
}

/// A body that holds a permit.
struct Held {
    inner: axum::body::Body,
    _permit: StreamPermit,
}

impl hyper::body::Body for Held {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALICE: u32 = 1000;
    const BOB: u32 = 1001;

    fn counts(total: usize, unprivileged: usize, of_uid: usize) -> ConnectionCounts {
        ConnectionCounts {
            total,
            unprivileged,
            of_uid,
        }
    }

    #[test]
    fn the_defaults_keep_a_reserve_for_root() {
        let l = Limits::default();
        assert_eq!(l.max_connections, 64);
        assert_eq!(l.max_connections_per_uid, 16);
        assert_eq!(l.reserved_connections, 8);
        assert_eq!(l.max_streams, 32);
        assert_eq!(l.max_streams_per_uid, 8);
        assert_eq!(l.reserved_streams, 8);
    }

    #[test]
    fn one_user_holds_at_most_its_share_of_connections() {
        let l = Limits::default();
        assert_eq!(
            admit_connection(&l, counts(15, 15, 15), ALICE, false),
            Admission::Room
        );
        let Admission::CloseIdle { scope, refusal } =
            admit_connection(&l, counts(16, 16, 16), ALICE, false)
        else {
            panic!("the 17th of one user")
        };
        assert_eq!(scope, Scope::Uid(ALICE));
        assert_eq!(
            refusal,
            "User 1000 has 16 control connections busy, the most one user may hold; close one or try again later"
        );
        // Another user is not held to Alice's count.
        assert_eq!(
            admit_connection(&l, counts(16, 16, 0), BOB, false),
            Admission::Room
        );
    }

    #[test]
    fn users_together_never_take_roots_reserve() {
        let l = Limits::default();
        // 56 connections of other users (four of them at 14): no fifth user's, but root's.
        let Admission::CloseIdle { scope, refusal } =
            admit_connection(&l, counts(56, 56, 0), BOB, false)
        else {
            panic!("past the shared connections")
        };
        assert_eq!(scope, Scope::Unprivileged);
        assert!(
            refusal.contains("56 control connections")
                && refusal.contains("8 more are kept for root"),
            "{refusal}"
        );
        assert_eq!(
            admit_connection(&l, counts(56, 56, 0), ROOT_UID, true),
            Admission::Room
        );
        assert_eq!(
            admit_connection(&l, counts(63, 56, 7), ROOT_UID, true),
            Admission::Room
        );
        // Root is held only to the total.
        let Admission::CloseIdle { scope, .. } =
            admit_connection(&l, counts(64, 56, 8), ROOT_UID, true)
        else {
            panic!("past the total")
        };
        assert_eq!(scope, Scope::Any);
        // Root's own connections past the reserve count against the total for everyone.
        let Admission::CloseIdle { scope, .. } =
            admit_connection(&l, counts(64, 10, 0), BOB, false)
        else {
            panic!("past the total")
        };
        assert_eq!(scope, Scope::Any);
    }

    #[test]
    fn limits_that_do_not_fit_each_other_are_bounded() {
        // A reserve as large as the total leaves one shared connection; a per-user limit
        // above the shared ones is the shared ones.
        let l = Limits {
            max_connections: 4,
            reserved_connections: 10,
            max_connections_per_uid: 100,
            ..Limits::default()
        };
        assert_eq!(
            admit_connection(&l, counts(0, 0, 0), ALICE, false),
            Admission::Room
        );
        assert!(matches!(
            admit_connection(&l, counts(1, 1, 1), ALICE, false),
            Admission::CloseIdle {
                scope: Scope::Uid(ALICE),
                ..
            }
        ));
        assert_eq!(
            admit_connection(&l, counts(3, 1, 0), ROOT_UID, true),
            Admission::Room
        );
    }

    #[test]
    fn streams_per_user_and_roots_reserve() {
        let l = Limits::default();
        let mut c = StreamCounts::default();
        c.by_uid.insert(ALICE, 8);
        c.total = 8;
        c.unprivileged = 8;
        let refusal = admit_stream(&l, &c, ALICE, false).expect_err("Alice's 9th");
        assert_eq!(
            refusal,
            "User 1000 has 8 streams open, the most one user may; close one or try again later"
        );
        assert_eq!(admit_stream(&l, &c, BOB, false), Ok(()));
        c.total = 24;
        c.unprivileged = 24;
        let refusal = admit_stream(&l, &c, BOB, false).expect_err("past the shared streams");
        assert!(
            refusal.contains("The 24 streams") && refusal.contains("8 more are kept for root"),
            "{refusal}"
        );
        assert_eq!(admit_stream(&l, &c, ROOT_UID, true), Ok(()));
        c.total = 32;
        assert!(
            admit_stream(&l, &c, ROOT_UID, true).is_err(),
            "root past the total"
        );
    }

    #[test]
    fn a_permit_counts_until_dropped() {
        let limits = Limits {
            max_streams_per_uid: 2,
            ..Limits::default()
        };
        let table = Arc::new(StreamTable::new(limits));
        let caller = Caller::new(ALICE, ALICE, Some(1), 4242, Arc::clone(&table));
        assert!(!caller.privileged());
        let a = caller.open_stream().expect("first");
        let _b = caller.open_stream().expect("second");
        let refused = caller.open_stream().expect_err("third");
        assert_eq!(
            (refused.status, refused.code),
            (StatusCode::SERVICE_UNAVAILABLE, "too_many_streams")
        );
        drop(a);
        let _c = caller
            .open_stream()
            .expect("a slot again once one is dropped");
        // Root and the server's own user are privileged.
        let server_self = Caller::new(4242, 0, None, 4242, Arc::clone(&table));
        assert!(server_self.privileged());
        assert!(Caller::new(ROOT_UID, 0, None, 4242, table).privileged());
    }
}
