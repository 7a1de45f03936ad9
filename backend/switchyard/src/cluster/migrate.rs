//! Live migration of a domain between nodes, the switchyard side: the source node publishes
//! its endpoints' descriptions in the domain's metadata (`cluster metadata`, run by the
//! pool agent's monitor), and the destination's `migrate` hook makes incoming endpoints
//! from them before libvirt starts the destination QEMU.

use std::path::Path;

use anyhow::Context;
use switchyard_daemon::app::api::EndpointStatus;

use super::meta;
use super::publish;
use super::{connect, delete, undo};

/// `cluster metadata DOMAIN`: the `<gpus>` element to set on `domain`, whose element now
/// is `current` (`virsh metadata DOMAIN --uri NAMESPACE`; empty when it has none). `None`
/// when it is up to date, has no `<gpus>`, or not all of its endpoints are here and
/// serving it (one missing, or incoming: a migration to this node not yet committed).
pub fn metadata(socket: &Path, domain: &str, current: &str) -> anyhow::Result<Option<String>> {
    let Some(gpus) = meta::gpus_element(current)? else {
        return Ok(None);
    };
    let ids = meta::endpoint_ids(domain, gpus.needs.count)?;
    let client = connect(socket)?;
    let all: Vec<serde_json::Value> = client.get("/v1/endpoints")?.json()?;
    let mut wanted = Vec::with_capacity(ids.len());
    for id in &ids {
        let Some(status) = all.iter().find(|s| s["endpoint"]["id"] == id.as_str()) else {
            return Ok(None);
        };
        if !status["incoming_for"].is_null() {
            return Ok(None);
        }
        wanted.push(publish::description(status));
    }
    Ok(publish::differs(&gpus, &wanted).then(|| publish::element(&gpus.needs, &wanted)))
}

/// The `migrate` hook on the destination: an incoming endpoint `libvirt.<DOMAIN>.<I>` for
/// each device, from the source's description in the domain's metadata, all or none.
/// Returns the XML to give libvirt back (its socket paths made this node's), `None` when
/// it is right as it is.
pub fn migrate(socket: &Path, domain: &str, xml: &str) -> anyhow::Result<Option<String>> {
    let Some(gpus) = meta::gpus(xml)? else {
        return Ok(None);
    };
    let ids = meta::endpoint_ids(domain, gpus.needs.count)?;
    let mut sources = Vec::with_capacity(ids.len());
    for i in 0..gpus.needs.count {
        let source = gpus.sources.get(&i).with_context(|| {
            format!(
                "no switchyard migration description for device {i} in its metadata: the \
                 source node's pool agent publishes it (monitor interval); try again"
            )
        })?;
        sources.push(source);
    }
    let client = connect(socket)?;
    // A domain migrating here has no QEMU here: whatever endpoints it has are stale (a
    // release that never ran, or an earlier attempt's incoming endpoints, whose tokens are
    // another migration's).
    let existing: Vec<EndpointStatus> = client.get("/v1/endpoints")?.json()?;
    for e in &existing {
        let id = e.endpoint.id.as_str();
        if meta::endpoints_of([id], domain).is_empty() {
            continue;
        }
        delete(&client, id).with_context(|| format!("cannot delete stale endpoint {id}"))?;
    }
    let mut sockets = Vec::with_capacity(ids.len());
    for (made, ((index, id), source)) in (0u32..).zip(&ids).zip(&sources).enumerate() {
        let body = serde_json::json!({ "id": id, "pool": gpus.needs.pool, "source": source });
        match client
            .post("/v1/incoming", &body)
            .and_then(|r| r.json::<EndpointStatus>())
        {
            Ok(status) => sockets.push((index, status.endpoint.socket.display().to_string())),
            Err(e) => {
                undo(&client, domain, &ids[..made]);
                let from = source["endpoint"]["id"].as_str().unwrap_or("?");
                return Err(anyhow::Error::new(e).context(format!(
                    "cannot create incoming endpoint {id} for source {from} from pool {}",
                    gpus.needs.pool
                )));
            }
        }
    }
    publish::with_sockets(xml, domain, &sockets)
        .inspect_err(|_| undo(&client, domain, &ids))
        .map_err(Into::into)
}

/// Whether every one of `ids` is an incoming endpoint here (`incoming_for` set): the
/// domain is the destination of a migration, and `prepare` keeps them.
pub fn all_incoming(existing: &[EndpointStatus], ids: &[String]) -> bool {
    ids.iter().all(|id| {
        existing
            .iter()
            .any(|e| &e.endpoint.id == id && e.incoming_for.is_some())
    })
}
