//! Migrations between hosts.
//!
//! The destination: `POST /v1/incoming` creates an incoming endpoint from a description of
//! the source (what `ctl endpoint SRC --json` prints on the source's host: its pool, its
//! device's kind and options, its migration token) instead of a local source endpoint. It
//! leases a free device of that kind and those options (canonical for this host's kind)
//! from that pool (or the one the request names), and its worker takes only a stream of the
//! source's token. It commits and aborts as an incoming endpoint of a local source does,
//! except that a commit releases nothing here: the source is on another host.
//!
//! The source: its daemon has no link to the destination, so it decides from its own
//! device. A VMM that leaves (cause `client_gone` or `client_left`) a device whose outgoing stream it read to
//! its end in STOP_COPY and then stopped, without running it again
//! ([`switchyard_server::MigChange::sent`]), completed the migration as far as this side can
//! know (QEMU stops the device after a completed migration and sets RUNNING again after one
//! that failed): the endpoint is deleted, that incarnation only (event `migrated_away`).
//! Where a local incoming endpoint is linked to it, the link decides instead (`migrated`, or
//! `migration_aborted` and the source stays). One clean-up per incarnation
//! ([`Daemon::claim_release`]).

use serde::Deserialize;
use switchyard_control::ApiError;
use utoipa::ToSchema;

use super::super::super::Daemon;
use super::super::views::EndpointStatus;
use super::{Incarnation, IncomingSpec, free_device};
use crate::lifecycle::{MigrationChange, WorkerLifecycle};

/// The body of `POST /v1/incoming`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct IncomingFromSpec {
    /// The new endpoint's id.
    pub id: String,
    /// Its socket path, default `<endpoint_dir>/<id>.sock`; only directly in the daemon's
    /// endpoint directory.
    #[serde(default)]
    #[schema(value_type = Option<String>)]
    pub socket: Option<std::path::PathBuf>,
    /// Lease from this pool rather than the source's pool's namesake.
    #[serde(default)]
    pub pool: Option<String>,
    /// The source endpoint, as `ctl endpoint SRC --json` (`GET /v1/endpoints/{id}`) shows
    /// it to its owner on its host; what else that document holds is ignored.
    pub source: SourceSpec,
}

/// What a destination needs of the source endpoint's description.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct SourceSpec {
    /// The endpoint.
    pub endpoint: SourceEndpoint,
    /// Its lease: the device's shape.
    #[serde(default)]
    pub lease: Option<SourceLease>,
}

/// The source endpoint: its id, pool and migration token.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct SourceEndpoint {
    /// Its id (on its host).
    pub id: String,
    /// The pool it leases from.
    #[serde(default)]
    pub pool: Option<String>,
    /// Its migration token (shown to its owner and root only): the origin its streams carry.
    #[serde(default)]
    pub migration_token: String,
}

/// The source's lease.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct SourceLease {
    /// What the guest sees.
    pub shape: SourceShape,
}

/// The source device's kind and options.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct SourceShape {
    /// The kind (`softgpu`, ...).
    pub model: String,
    /// Its canonical options.
    #[schema(value_type = Object)]
    pub options: switchyard_device::kind::KindOptions,
}

/// The source's pool, kind and canonical options, and its token, checked.
#[derive(Debug, PartialEq)]
struct Wanted {
    pool: Option<String>,
    model: String,
    options: switchyard_device::kind::KindOptions,
    token: String,
}

/// Checks `req`: a token, a lease, a kind this host has, options that kind takes.
fn wanted(req: &IncomingFromSpec) -> Result<Wanted, ApiError> {
    let src = &req.source;
    let token = src.endpoint.migration_token.clone();
    if token.is_empty() {
        return Err(ApiError::unprocessable(
            "invalid",
            format!(
                "The description of source \"{}\" has no migration token (only its owner and root see it: run `ctl endpoint {0} --json` as one of them)",
                src.endpoint.id
            ),
        ));
    }
    if !switchyard_device::secret::is_secret(&token) {
        return Err(ApiError::unprocessable(
            "invalid",
            "The source's migration token is not 32 lowercase hexadecimal characters",
        ));
    }
    let shape = &src
        .lease
        .as_ref()
        .ok_or_else(|| {
            ApiError::unprocessable(
                "invalid",
                format!(
                    "Source \"{}\" has no device (no lease) to migrate",
                    src.endpoint.id
                ),
            )
        })?
        .shape;
    let kind = switchyard_kinds::get(&shape.model).ok_or_else(|| {
        ApiError::unprocessable(
            "invalid",
            format!(
                "The source's kind \"{}\" is not one of this host's ({})",
                shape.model,
                switchyard_kinds::names()
            ),
        )
    })?;
    let checked = switchyard_pool::DeviceShape::of(kind, &shape.options).map_err(|e| {
        ApiError::unprocessable(
            "invalid",
            format!(
                "The source's device options are not this host's {}: {}",
                shape.model,
                crate::error_chain::error_chain(&e)
            ),
        )
    })?;
    Ok(Wanted {
        pool: req.pool.clone().or_else(|| src.endpoint.pool.clone()),
        model: checked.model,
        options: checked.options,
        token,
    })
}

impl Daemon {
    /// `POST /v1/incoming`: an incoming endpoint for a source on another host.
    pub(in super::super) fn create_incoming_from_spec(
        &self,
        req: IncomingFromSpec,
        owner_uid: u32,
    ) -> Result<EndpointStatus, ApiError> {
        let want = wanted(&req)?;
        let source = req.source.endpoint.id.clone();
        let device = {
            let inv = self.inventory();
            if let Some(p) = &want.pool
                && !inv.pools().iter().any(|v| &v.name == p)
            {
                return Err(ApiError::not_found(
                    "not_found",
                    format!("No pool \"{p}\" here (name another with `pool`)"),
                ));
            }
            free_device(&inv, &want.pool, |shape| {
                shape.model == want.model && shape.options == want.options
            })
            .ok_or_else(|| {
                ApiError::conflict(
                    "no_capacity",
                    format!(
                        "No free device of source \"{source}\"'s shape ({} {}){}",
                        want.model,
                        serde_json::Value::Object(want.options.clone()),
                        want.pool.as_ref().map_or_else(
                            || " on a board in no pool".to_owned(),
                            |p| format!(" in pool \"{p}\"")
                        )
                    ),
                )
            })?
        };
        let spec = IncomingSpec {
            id: req.id,
            socket: req.socket,
        };
        let mut status = self.create_linked(spec, owner_uid, device, &source, &want.token, true)?;
        status.incoming_for = Some(source);
        Ok(status)
    }

    /// The source's rule: `endpoint`'s VMM left after a completed outgoing migration
    /// (`change`: cause `client_gone` or `client_left`, stream sent). Returns the incarnation to delete, with
    /// event `migrated_away`; nothing where a local incoming endpoint is linked to it (the
    /// link decides) or its clean-up is under way already.
    pub(super) fn migrated_away(
        &self,
        endpoint: &str,
        change: &MigrationChange,
    ) -> Option<Incarnation> {
        // The VMM left: `client_gone`, or `client_left` where the server tells a client that
        // left its device stopped (nothing abandoned) apart.
        let left = matches!(change.cause.as_str(), "client_gone" | "client_left");
        if !left || !change.sent {
            return None;
        }
        let token = self.inventory().endpoint(endpoint)?.migration_token.clone();
        let linked = self
            .incoming()
            .values()
            .any(|i| !i.remote && i.source == endpoint && i.source_token == token);
        if linked {
            tracing::info!(%endpoint, "the VMM left after sending its migration; the local incoming endpoint decides");
            return None;
        }
        let which = Incarnation {
            id: endpoint.to_owned(),
            token,
        };
        if self.releasing().contains(&which.token) {
            // A local migration completed: its clean-up deletes this incarnation.
            return None;
        }
        tracing::info!(%endpoint, "the VMM left after a completed outgoing migration; the endpoint goes");
        self.events.worker(WorkerLifecycle::MigratedAway {
            endpoint: endpoint.to_owned(),
        });
        Some(which)
    }

    /// Takes the clean-up of incarnation `which`: false when one is under way already.
    pub(super) fn claim_release(&self, which: &Incarnation) -> bool {
        self.releasing().insert(which.token.clone())
    }

    /// The clean-up of `which` is over (or did not start).
    pub(super) fn unclaim_release(&self, which: &Incarnation) {
        self.releasing().remove(&which.token);
    }

    fn releasing(&self) -> super::super::super::Held<'_, std::collections::BTreeSet<String>> {
        super::super::super::lock(&self.releasing)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "0123456789abcdef0123456789abcdef";

    fn request(source: serde_json::Value) -> IncomingFromSpec {
        serde_json::from_value(serde_json::json!({"id": "dst", "source": source}))
            .expect("a request")
    }

    fn status(token: &str, shape: serde_json::Value) -> serde_json::Value {
        // What `ctl endpoint SRC --json` prints, abridged (the rest is ignored).
        serde_json::json!({
            "endpoint": {"id": "vm", "socket": "/x", "pool": "p", "device": "a",
                "migration_token": token, "owner_uid": 0},
            "lease": {"id": "a", "board": "a", "partition": false, "shape": shape,
                "state": "available"},
            "worker": {"state": "running"},
        })
    }

    fn softgpu() -> serde_json::Value {
        serde_json::json!({"model": "softgpu", "options": {"vram": 16 << 20, "queues": 2},
            "profile": {}})
    }

    #[test]
    fn a_description_gives_the_pool_the_canonical_options_and_the_token() {
        let w = wanted(&request(status(TOKEN, softgpu()))).expect("wanted");
        assert_eq!(w.pool.as_deref(), Some("p"));
        assert_eq!(w.model, "softgpu");
        assert_eq!(w.token, TOKEN);
        assert_eq!(w.options.get("vram"), Some(&serde_json::json!(16 << 20)));
        // Canonical: the kind's defaults filled in.
        assert!(w.options.len() > 2, "{:?}", w.options);
        let mut named = request(status(TOKEN, softgpu()));
        named.pool = Some("q".into());
        assert_eq!(wanted(&named).expect("wanted").pool.as_deref(), Some("q"));
    }

    #[test]
    fn a_description_without_a_token_lease_kind_or_valid_options_is_refused() {
        let code = |v: serde_json::Value| {
            let e = wanted(&request(v)).expect_err("refused");
            (e.status.as_u16(), e.message.clone())
        };
        let (s, m) = code(status("", softgpu()));
        assert_eq!(s, 422);
        assert!(m.contains("no migration token"), "{m}");
        let (s, m) = code(status("not-a-token", softgpu()));
        assert_eq!(s, 422);
        assert!(m.contains("hexadecimal"), "{m}");
        let mut no_lease = status(TOKEN, softgpu());
        no_lease["lease"] = serde_json::Value::Null;
        let (s, m) = code(no_lease);
        assert_eq!(s, 422);
        assert!(m.contains("no device"), "{m}");
        let (s, m) = code(status(
            TOKEN,
            serde_json::json!({"model": "warpdrive", "options": {}}),
        ));
        assert_eq!(s, 422);
        assert!(m.contains("warpdrive"), "{m}");
        let (s, m) = code(status(
            TOKEN,
            serde_json::json!({"model": "softgpu", "options": {"vram": "lots"}}),
        ));
        assert_eq!(s, 422);
        assert!(m.contains("vram"), "{m}");
    }
}
