//! What a live migration between nodes carries in the domain's XML, without the daemon: the
//! `<gpus>` element with the sources' descriptions that the source node's pool agent
//! publishes (`switchyard cluster metadata`), whether it must be published again, and the
//! domain XML with the destination's socket paths (the `migrate` hook).

use std::fmt::Write as _;

use super::meta::{self, GpuNeeds, Gpus, MetaError};

/// The namespace of libvirt's `<qemu:commandline>`.
const QEMU_NAMESPACE: &str = "http://libvirt.org/schemas/domain/qemu/1.0";

/// What matters in an endpoint's description: its id and migration token.
fn identity(description: &serde_json::Value) -> Option<(&str, &str)> {
    let endpoint = description.get("endpoint")?;
    Some((
        endpoint.get("id")?.as_str()?,
        endpoint.get("migration_token")?.as_str()?,
    ))
}

/// What of endpoint status `status` (`GET /v1/endpoints/{id}`) a destination needs: the
/// endpoint (its id, pool and migration token) and its lease (the device's shape).
pub fn description(status: &serde_json::Value) -> serde_json::Value {
    serde_json::json!({
        "endpoint": status.get("endpoint").cloned().unwrap_or_default(),
        "lease": status.get("lease").cloned().unwrap_or_default(),
    })
}

/// Whether `current` (the domain's `<gpus>` now) differs from `wanted` (the description
/// of each device's endpoint here, in index order) in what matters: each index's endpoint
/// id and migration token. Anything else (the worker's pid, ...) changes nothing.
pub fn differs(current: &Gpus, wanted: &[serde_json::Value]) -> bool {
    current.sources.len() != wanted.len()
        || wanted.iter().enumerate().any(|(i, w)| {
            let now = u32::try_from(i)
                .ok()
                .and_then(|i| current.sources.get(&i))
                .and_then(identity);
            now.is_none() || now != identity(w)
        })
}

/// The `<gpus>` element to set, without a namespace: `virsh metadata --uri NAMESPACE --key
/// KEY --set` puts it and its children in NAMESPACE (with prefix KEY), and `virsh metadata
/// --uri NAMESPACE` prints it back so. One `<source index="I">` per description, in order.
pub fn element(needs: &GpuNeeds, sources: &[serde_json::Value]) -> String {
    let mut out = format!(
        "<gpus pool=\"{}\" count=\"{}\">",
        escape(&needs.pool, true),
        needs.count
    );
    for (i, s) in sources.iter().enumerate() {
        let _ = write!(
            out,
            "<source index=\"{i}\">{}</source>",
            escape(&s.to_string(), false)
        );
    }
    out.push_str("</gpus>");
    out
}

/// `text` escaped for XML: `&`, `<`, `>`, and in an attribute the quotes too.
fn escape(text: &str, attribute: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' if attribute => out.push_str("&quot;"),
            '\'' if attribute => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

/// The socket path of a `vfio-user-pci` device's JSON (`-device`'s argument
/// `{"driver":"vfio-user-pci",...,"socket":{"type":"unix","path":PATH}}`).
fn vfio_user_socket(arg: &str) -> Option<String> {
    let json: serde_json::Value = serde_json::from_str(arg).ok()?;
    if json.get("driver")?.as_str()? != "vfio-user-pci" {
        return None;
    }
    Some(json.get("socket")?.get("path")?.as_str()?.to_owned())
}

/// The domain XML `xml` with the socket path of each device `(I, PATH)` of `new` made
/// PATH: the `vfio-user-pci` device of `<qemu:commandline>` whose socket's file name is
/// `libvirt.<DOMAIN>.<I>.sock` (its path replaced in that argument, everything else kept
/// byte for byte). `None` when every such path is already the new one (or there is none).
pub fn with_sockets(
    xml: &str,
    domain: &str,
    new: &[(u32, String)],
) -> Result<Option<String>, MetaError> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| MetaError::Xml(e.to_string()))?;
    // (range of the attribute's raw value, old path, new path), in document order.
    let mut edits = Vec::new();
    let args = doc.descendants().filter(|n| {
        n.is_element() && n.tag_name().namespace() == Some(QEMU_NAMESPACE) && n.has_tag_name("arg")
    });
    for arg in args {
        let Some(value) = arg.attribute_node("value") else {
            continue;
        };
        let Some(old) = vfio_user_socket(value.value()) else {
            continue;
        };
        let name = old.rsplit('/').next().unwrap_or_default();
        let wanted = new.iter().find(|(i, _)| {
            name.strip_suffix(".sock") == Some(meta::endpoint_id(domain, *i).as_str())
        });
        if let Some((_, path)) = wanted
            && *path != old
        {
            edits.push((value.range_value(), old, path.clone()));
        }
    }
    if edits.is_empty() {
        return Ok(None);
    }
    let mut out = String::with_capacity(xml.len());
    let mut at = 0;
    for (range, old, path) in edits {
        out.push_str(&xml[at..range.start]);
        let raw = &xml[range.clone()];
        // The path as it is written in the JSON, then in the attribute.
        let json = |p: &str| serde_json::Value::from(p).to_string();
        let written = |p: &str| {
            let j = json(p);
            escape(&j[1..j.len() - 1], true)
        };
        let (from, to) = (written(&old), written(&path));
        if raw.contains(&from) {
            out.push_str(&raw.replace(&from, &to));
        } else if raw.contains(&old) {
            out.push_str(&raw.replace(&old, &to));
        } else {
            return Err(MetaError::Xml(format!(
                "the socket path {old:?} is written with escapes this hook does not rewrite"
            )));
        }
        at = range.end;
    }
    out.push_str(&xml[at..]);
    Ok(Some(out))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn needs(pool: &str, count: u32) -> GpuNeeds {
        GpuNeeds {
            pool: pool.to_owned(),
            count,
        }
    }

    fn desc(id: &str, token: &str, pid: u32) -> serde_json::Value {
        json!({
            "endpoint": {"id": id, "pool": "gpu", "migration_token": token, "socket": "/s"},
            "lease": {"shape": {"model": "softgpu", "options": {"vram_size": 8}}},
            "worker": {"pid": pid},
        })
    }

    #[test]
    fn the_element_round_trips_through_the_parser_without_and_with_a_namespace() {
        let sources = [
            desc("libvirt.vm.0", "a".repeat(32).as_str(), 1),
            json!({"endpoint": {"id": "libvirt.vm.1", "note": "<&>\"'"}}),
        ];
        let text = element(&needs("gpu", 2), &sources);
        let parsed = meta::gpus_element(&text)
            .expect("parses")
            .expect("an element");
        assert_eq!(parsed.needs, needs("gpu", 2));
        assert_eq!(parsed.sources.len(), 2);
        assert_eq!(parsed.sources[&0], sources[0]);
        assert_eq!(parsed.sources[&1], sources[1]);
        // As libvirt keeps it in the domain: in the namespace, with the prefix of --key.
        let namespaced = text
            .replace(
                "<gpus ",
                "<sy:gpus xmlns:sy=\"https://switchyard.dev/xmlns/libvirt/1\" ",
            )
            .replace("</gpus>", "</sy:gpus>")
            .replace("<source", "<sy:source")
            .replace("</source>", "</sy:source>");
        let domain = format!("<domain><name>vm</name><metadata>{namespaced}</metadata></domain>");
        assert_eq!(meta::gpus(&domain), Ok(Some(parsed.clone())));
        assert_eq!(meta::gpus_element(&namespaced), Ok(Some(parsed)));
    }

    #[test]
    fn only_ids_and_tokens_make_a_difference() {
        let (a, b) = ("a".repeat(32), "b".repeat(32));
        let published = meta::gpus_element(&element(
            &needs("gpu", 2),
            &[desc("libvirt.vm.0", &a, 1), desc("libvirt.vm.1", &a, 2)],
        ))
        .expect("parses")
        .expect("an element");
        // Another worker pid, same endpoints: up to date.
        let same = [desc("libvirt.vm.0", &a, 7), desc("libvirt.vm.1", &a, 8)];
        assert!(!differs(&published, &same));
        // A new token (the endpoint made again), another id, one device fewer or more.
        assert!(differs(
            &published,
            &[desc("libvirt.vm.0", &a, 1), desc("libvirt.vm.1", &b, 2)]
        ));
        assert!(differs(
            &published,
            &[desc("libvirt.vm.0", &a, 1), desc("libvirt.vx.1", &a, 2)]
        ));
        assert!(differs(&published, &[desc("libvirt.vm.0", &a, 1)]));
        // Nothing published yet, or a description without a token: publish.
        let bare = meta::gpus_element("<gpus pool='gpu' count='2'/>")
            .expect("parses")
            .expect("an element");
        assert!(differs(&bare, &same));
        let tokenless = meta::gpus_element(
            "<gpus pool='gpu' count='1'><source index='0'>{\"endpoint\":{\"id\":\"libvirt.vm.0\"}}</source></gpus>",
        )
        .expect("parses")
        .expect("an element");
        assert!(differs(&tokenless, &[desc("libvirt.vm.0", &a, 1)]));
    }

    #[test]
    fn a_description_keeps_the_endpoint_and_its_lease() {
        let status = desc("libvirt.vm.0", "t", 3);
        assert_eq!(
            description(&status),
            json!({"endpoint": status["endpoint"], "lease": status["lease"]})
        );
    }

    /// A domain with `devices` (index, socket path) plugged as libvirt writes them back
    /// (`&quot;` in single-quoted attributes).
    fn domain_xml(devices: &[(u32, &str)]) -> String {
        quoted_domain_xml(devices, '\'')
    }

    /// The same with attribute values in `quote`s.
    fn quoted_domain_xml(devices: &[(u32, &str)], quote: char) -> String {
        let mut args = String::new();
        for (i, path) in devices {
            let json = json!({"driver": "vfio-user-pci", "id": format!("gpu{i}"),
                              "socket": {"type": "unix", "path": path}});
            let _ = write!(
                args,
                "\n    <qemu:arg value={quote}-device{quote}/>\n    <qemu:arg value={quote}{}{quote}/>",
                json.to_string().replace('"', "&quot;")
            );
        }
        format!(
            "<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>\n  \
             <name>vm</name>\n  <devices/>\n  <qemu:commandline>\n    \
             <qemu:arg value={quote}-device{quote}/>\n    \
             <qemu:arg value={quote}{{&quot;driver&quot;:&quot;virtio-rng-pci&quot;}}{quote}/>\
             {args}\n  </qemu:commandline>\n</domain>\n"
        )
    }

    #[test]
    fn sockets_are_rewritten_in_place_and_only_when_they_differ() {
        let a0 = "/run/a/endpoints/libvirt.vm.0.sock";
        let a1 = "/run/a/endpoints/libvirt.vm.1.sock";
        let b0 = "/run/b/endpoints/libvirt.vm.0.sock".to_owned();
        let b1 = "/run/b/endpoints/libvirt.vm.1.sock".to_owned();
        let xml = domain_xml(&[(0, a0), (1, a1)]);
        let new = [(0, b0.clone()), (1, b1.clone())];
        let out = with_sockets(&xml, "vm", &new)
            .expect("rewrites")
            .expect("changed");
        assert_eq!(out, domain_xml(&[(0, &b0), (1, &b1)]));
        // The same paths: nothing to print.
        assert_eq!(with_sockets(&out, "vm", &new), Ok(None));
        // One of two differs: that one alone changes.
        let half = with_sockets(&xml, "vm", &[(0, a0.to_owned()), (1, b1.clone())])
            .expect("rewrites")
            .expect("changed");
        assert_eq!(half, domain_xml(&[(0, a0), (1, &b1)]));
        // Double quotes outside, as a hand-written XML has them.
        let plain = quoted_domain_xml(&[(0, a0), (1, a1)], '"');
        assert_eq!(
            with_sockets(&plain, "vm", &new),
            Ok(Some(quoted_domain_xml(&[(0, &b0), (1, &b1)], '"')))
        );
    }

    #[test]
    fn other_devices_and_domains_are_left_alone() {
        // Another domain's socket (a name that merely starts alike), another driver, no
        // device at all: nothing to change.
        let xml = domain_xml(&[
            (0, "/run/a/libvirt.vm.b.0.sock"),
            (1, "/run/a/libvirt.vm2.1.sock"),
        ]);
        assert_eq!(
            with_sockets(&xml, "vm", &[(0, "/x/libvirt.vm.0.sock".into())]),
            Ok(None)
        );
        let rng = domain_xml(&[]);
        assert_eq!(
            with_sockets(&rng, "vm", &[(0, "/x/libvirt.vm.0.sock".into())]),
            Ok(None)
        );
        // A device the new list does not name keeps its path.
        let two = domain_xml(&[(0, "/a/libvirt.vm.0.sock"), (1, "/a/libvirt.vm.1.sock")]);
        assert_eq!(
            with_sockets(&two, "vm", &[(1, "/b/libvirt.vm.1.sock".into())]),
            Ok(Some(domain_xml(&[
                (0, "/a/libvirt.vm.0.sock"),
                (1, "/b/libvirt.vm.1.sock")
            ])))
        );
        assert!(matches!(
            with_sockets("<domain>", "vm", &[]),
            Err(MetaError::Xml(_))
        ));
    }
}
