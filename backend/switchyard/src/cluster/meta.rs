//! A libvirt domain's GPU needs, from its XML's `<metadata>`, the descriptions of its
//! endpoints that a live migration's destination needs (`<source>` children), and the
//! endpoint ids they become.

use std::collections::BTreeMap;
use std::fmt;

/// The namespace of Switchyard's libvirt metadata.
pub const NAMESPACE: &str = "https://switchyard.dev/xmlns/libvirt/1";

/// The most GPUs one domain may ask for.
pub const MAX_COUNT: u32 = 16;

/// What the prefix of every endpoint the cluster places starts with.
pub const PREFIX: &str = "libvirt.";

/// `<gpus pool="POOL" count="N"/>` in [`NAMESPACE`]: `count` devices from pool `pool`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuNeeds {
    /// The pool (a cluster pool: the same name on every node).
    pub pool: String,
    /// How many devices, 1 to [`MAX_COUNT`].
    pub count: u32,
}

/// The whole `<gpus>` element: the needs and the sources' descriptions it carries.
///
/// ```xml
/// <sy:gpus xmlns:sy="https://switchyard.dev/xmlns/libvirt/1" pool="gpu" count="2">
///   <sy:source index="0">{"endpoint":{"id":"libvirt.vm.0",...},"lease":{...}}</sy:source>
///   <sy:source index="1">...</sy:source>
/// </sy:gpus>
/// ```
#[derive(Debug, Clone, PartialEq)]
pub struct Gpus {
    /// What the domain needs.
    pub needs: GpuNeeds,
    /// Device index (below `count`) to the description of the endpoint it had on the node
    /// that published it (`GET /v1/endpoints/libvirt.<DOMAIN>.<I>`, a JSON object).
    pub sources: BTreeMap<u32, serde_json::Value>,
}

/// Why a domain's XML or name cannot be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetaError {
    /// The XML does not parse.
    Xml(String),
    /// The root element is not `<domain>`.
    NotDomain(String),
    /// More than one `gpus` element.
    Duplicate,
    /// An element of our namespace other than `gpus`.
    UnknownElement(String),
    /// An attribute `gpus` does not have.
    UnknownAttribute(String),
    /// No `pool` attribute.
    MissingPool,
    /// A `pool` that is not a valid pool name.
    BadPool(String),
    /// No `count` attribute.
    MissingCount,
    /// A `count` that is not 1 to [`MAX_COUNT`].
    BadCount(String),
    /// The domain's name makes an invalid endpoint id.
    BadDomainName(String),
    /// Text directly in `<gpus>` (only `<source>` elements go there).
    Text,
    /// An attribute `source` does not have.
    UnknownSourceAttribute(String),
    /// A `<source>` whose `index` is missing, not a number or not below `count`.
    BadSourceIndex(String),
    /// Two `<source>` elements of one index.
    DuplicateSource(u32),
    /// A `<source>` whose text is not a JSON object.
    BadSource(u32, String),
    /// A standalone element that is not `<gpus>` (of [`NAMESPACE`] or of none).
    NotGpus(String),
}

impl fmt::Display for MetaError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MetaError::Xml(e) => write!(f, "The domain XML does not parse: {e}"),
            MetaError::NotDomain(root) => {
                write!(f, "The XML's root element is <{root}>, not <domain>")
            }
            MetaError::Duplicate => write!(
                f,
                "The metadata has more than one <gpus> element of {NAMESPACE}"
            ),
            MetaError::UnknownElement(name) => write!(
                f,
                "The metadata has an unknown element <{name}> of {NAMESPACE} (only <gpus> \
                 and its <source> children)"
            ),
            MetaError::UnknownAttribute(name) => write!(
                f,
                "<gpus> has an unknown attribute `{name}` (only `pool` and `count`)"
            ),
            MetaError::MissingPool => write!(f, "<gpus> has no `pool` attribute"),
            MetaError::BadPool(p) => write!(
                f,
                "<gpus> names pool {p:?}, not a pool name (1-64 characters of A-Za-z0-9_.-)"
            ),
            MetaError::MissingCount => write!(f, "<gpus> has no `count` attribute"),
            MetaError::BadCount(c) => write!(
                f,
                "<gpus> has count {c:?}; it must be a number from 1 to {MAX_COUNT}"
            ),
            MetaError::BadDomainName(id) => write!(
                f,
                "The domain's name makes the endpoint id {id:?}, which is not an id \
                 (1-64 characters of A-Za-z0-9_.-)"
            ),
            MetaError::Text => write!(f, "<gpus> holds text (only <source> elements)"),
            MetaError::UnknownSourceAttribute(name) => write!(
                f,
                "<source> has an unknown attribute `{name}` (only `index`)"
            ),
            MetaError::BadSourceIndex(i) => write!(
                f,
                "<source> has index {i:?}; it must be a device's number, from 0 to count - 1"
            ),
            MetaError::DuplicateSource(i) => {
                write!(f, "<gpus> has more than one <source> of index {i}")
            }
            MetaError::BadSource(i, e) => write!(
                f,
                "<source index=\"{i}\"> does not hold an endpoint's description (a JSON \
                 object): {e}"
            ),
            MetaError::NotGpus(name) => write!(
                f,
                "The element is <{name}>, not <gpus> of {NAMESPACE} (or of no namespace)"
            ),
        }
    }
}

impl std::error::Error for MetaError {}

/// The GPU needs of the domain whose XML is `xml`: `None` when its `<metadata>` has no
/// `gpus` element of [`NAMESPACE`] (whatever its prefix).
pub fn gpu_needs(xml: &str) -> Result<Option<GpuNeeds>, MetaError> {
    Ok(gpus(xml)?.map(|g| g.needs))
}

/// The `<gpus>` element of the domain whose XML is `xml`, with its `<source>` children:
/// `None` when its `<metadata>` has none (of [`NAMESPACE`], whatever its prefix).
pub fn gpus(xml: &str) -> Result<Option<Gpus>, MetaError> {
    let doc = parse(xml)?;
    let root = doc.root_element();
    if root.tag_name().namespace().is_some() || root.tag_name().name() != "domain" {
        return Err(MetaError::NotDomain(root.tag_name().name().to_owned()));
    }
    let mut found = None;
    let ours = root
        .children()
        .filter(|n| n.is_element() && n.has_tag_name("metadata"))
        .flat_map(|m| m.children())
        .filter(|n| n.is_element() && n.tag_name().namespace() == Some(NAMESPACE));
    for element in ours {
        if element.tag_name().name() != "gpus" {
            return Err(MetaError::UnknownElement(
                element.tag_name().name().to_owned(),
            ));
        }
        if found.is_some() {
            return Err(MetaError::Duplicate);
        }
        found = Some(element);
    }
    found.map(element_gpus).transpose()
}

/// The standalone `<gpus>` element `text`, as `virsh metadata DOMAIN --uri NAMESPACE`
/// prints it (libvirt strips the namespace: of none, or of [`NAMESPACE`] with any prefix);
/// `None` for empty text (the domain has none).
pub fn gpus_element(text: &str) -> Result<Option<Gpus>, MetaError> {
    if text.trim().is_empty() {
        return Ok(None);
    }
    let doc = parse(text)?;
    let root = doc.root_element();
    if !matches!(root.tag_name().namespace(), None | Some(NAMESPACE))
        || root.tag_name().name() != "gpus"
    {
        return Err(MetaError::NotGpus(root.tag_name().name().to_owned()));
    }
    element_gpus(root).map(Some)
}

fn parse(xml: &str) -> Result<roxmltree::Document<'_>, MetaError> {
    roxmltree::Document::parse(xml).map_err(|e| MetaError::Xml(e.to_string()))
}

/// A `<gpus>` element's attributes and `<source>` children (of its own namespace).
fn element_gpus(gpus: roxmltree::Node<'_, '_>) -> Result<Gpus, MetaError> {
    for a in gpus.attributes() {
        if a.namespace().is_some() || !matches!(a.name(), "pool" | "count") {
            return Err(MetaError::UnknownAttribute(a.name().to_owned()));
        }
    }
    let pool = gpus.attribute("pool").ok_or(MetaError::MissingPool)?;
    if !switchyard_pool::valid_id(pool) {
        return Err(MetaError::BadPool(pool.to_owned()));
    }
    let count = gpus.attribute("count").ok_or(MetaError::MissingCount)?;
    let n = number(count)
        .filter(|n| (1..=MAX_COUNT).contains(n))
        .ok_or_else(|| MetaError::BadCount(count.to_owned()))?;
    let mut sources = BTreeMap::new();
    for child in gpus.children() {
        if child.is_text() {
            if child.text().is_some_and(|t| !t.trim().is_empty()) {
                return Err(MetaError::Text);
            }
            continue;
        }
        if !child.is_element() {
            continue;
        }
        if child.tag_name().namespace() != gpus.tag_name().namespace()
            || child.tag_name().name() != "source"
        {
            return Err(MetaError::UnknownElement(
                child.tag_name().name().to_owned(),
            ));
        }
        for a in child.attributes() {
            if a.namespace().is_some() || a.name() != "index" {
                return Err(MetaError::UnknownSourceAttribute(a.name().to_owned()));
            }
        }
        let index = child.attribute("index").unwrap_or_default();
        let i = number(index)
            .filter(|i| *i < n)
            .ok_or_else(|| MetaError::BadSourceIndex(index.to_owned()))?;
        if child.children().any(|c| c.is_element()) {
            return Err(MetaError::BadSource(i, "it holds elements".into()));
        }
        let text: String = child.children().filter_map(|c| c.text()).collect();
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| MetaError::BadSource(i, e.to_string()))?;
        if !json.is_object() {
            return Err(MetaError::BadSource(i, "not an object".into()));
        }
        if sources.insert(i, json).is_some() {
            return Err(MetaError::DuplicateSource(i));
        }
    }
    Ok(Gpus {
        needs: GpuNeeds {
            pool: pool.to_owned(),
            count: n,
        },
        sources,
    })
}

/// A decimal number of ASCII digits only (no sign, no spaces).
fn number(text: &str) -> Option<u32> {
    (!text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()))
        .then(|| text.parse::<u32>().ok())
        .flatten()
}

/// The id of the domain's `index`th endpoint: `libvirt.<DOMAIN>.<index>`.
pub fn endpoint_id(domain: &str, index: u32) -> String {
    format!("{PREFIX}{domain}.{index}")
}

/// The ids of the domain's `count` endpoints, each checked to be a valid id.
pub fn endpoint_ids(domain: &str, count: u32) -> Result<Vec<String>, MetaError> {
    (0..count)
        .map(|i| {
            let id = endpoint_id(domain, i);
            if switchyard_pool::valid_id(&id) {
                Ok(id)
            } else {
                Err(MetaError::BadDomainName(id))
            }
        })
        .collect()
}

/// The domain and index of an endpoint the cluster placed (`libvirt.<DOMAIN>.<digits>`);
/// `None` for any other id. A domain name may hold dots: the index is after the last one.
pub fn placed(id: &str) -> Option<(&str, u32)> {
    let (domain, index) = id.strip_prefix(PREFIX)?.rsplit_once('.')?;
    if domain.is_empty() || index.is_empty() || !index.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((domain, index.parse().ok()?))
}

/// Of `ids`, the endpoints of `domain` (`libvirt.<DOMAIN>.<digits>`; not those of a domain
/// whose name merely starts with `<DOMAIN>.`).
pub fn endpoints_of<'a>(ids: impl IntoIterator<Item = &'a str>, domain: &str) -> Vec<&'a str> {
    ids.into_iter()
        .filter(|id| placed(id).is_some_and(|(d, _)| d == domain))
        .collect()
}

/// Of `ids`, the endpoints the cluster placed for a domain not among `running`.
pub fn stale<'a>(ids: impl IntoIterator<Item = &'a str>, running: &[String]) -> Vec<&'a str> {
    ids.into_iter()
        .filter(|id| placed(id).is_some_and(|(d, _)| !running.iter().any(|r| r == d)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn domain(metadata: &str) -> String {
        format!(
            "<domain type='kvm' xmlns:qemu='http://libvirt.org/schemas/domain/qemu/1.0'>\
             <name>vm1</name><metadata>{metadata}</metadata>\
             <devices/><qemu:commandline><qemu:arg value='-device'/></qemu:commandline>\
             </domain>"
        )
    }

    fn needs(pool: &str, count: u32) -> Option<GpuNeeds> {
        Some(GpuNeeds {
            pool: pool.to_owned(),
            count,
        })
    }

    #[test]
    fn the_element_is_found_by_namespace_whatever_its_prefix() {
        let sy = domain(
            r#"<sy:gpus xmlns:sy="https://switchyard.dev/xmlns/libvirt/1" pool="gpu" count="2"/>"#,
        );
        assert_eq!(gpu_needs(&sy), Ok(needs("gpu", 2)));
        let other = domain(
            r#"<x:gpus xmlns:x="https://switchyard.dev/xmlns/libvirt/1" count="16" pool="a.b-c_1"/>"#,
        );
        assert_eq!(gpu_needs(&other), Ok(needs("a.b-c_1", 16)));
        // The default namespace, as libvirt may write it back.
        let default =
            domain(r#"<gpus xmlns="https://switchyard.dev/xmlns/libvirt/1" pool="p" count="1"/>"#);
        assert_eq!(gpu_needs(&default), Ok(needs("p", 1)));
        // Beside other applications' metadata.
        let mixed = domain(
            r#"<app:x xmlns:app="http://example.org/app"><app:gpus pool="no" count="9"/></app:x>
               <sy:gpus xmlns:sy="https://switchyard.dev/xmlns/libvirt/1" pool="gpu" count="3"/>"#,
        );
        assert_eq!(gpu_needs(&mixed), Ok(needs("gpu", 3)));
    }

    #[test]
    fn no_element_of_the_namespace_is_no_need() {
        assert_eq!(gpu_needs(&domain("")), Ok(None));
        assert_eq!(gpu_needs("<domain><name>x</name></domain>"), Ok(None));
        // `gpus` without a namespace, or in another namespace, is not ours.
        assert_eq!(
            gpu_needs(&domain(r#"<gpus pool="gpu" count="2"/>"#)),
            Ok(None)
        );
        assert_eq!(
            gpu_needs(&domain(
                r#"<sy:gpus xmlns:sy="https://switchyard.dev/xmlns/libvirt/2" pool="gpu" count="2"/>"#
            )),
            Ok(None)
        );
        // Outside <metadata> it is not read either.
        let outside = "<domain><devices><sy:gpus xmlns:sy=\"https://switchyard.dev/xmlns/libvirt/1\" \
                       pool=\"gpu\" count=\"2\"/></devices></domain>";
        assert_eq!(gpu_needs(outside), Ok(None));
    }

    #[test]
    fn malformed_metadata_is_refused_saying_what() {
        let el = |attrs: &str| {
            domain(&format!(
                r#"<sy:gpus xmlns:sy="https://switchyard.dev/xmlns/libvirt/1" {attrs}/>"#
            ))
        };
        for (attrs, want) in [
            (r#"pool="gpu""#, MetaError::MissingCount),
            (r#"count="2""#, MetaError::MissingPool),
            (r#"pool="gpu" count="0""#, MetaError::BadCount("0".into())),
            (r#"pool="gpu" count="17""#, MetaError::BadCount("17".into())),
            (r#"pool="gpu" count="-1""#, MetaError::BadCount("-1".into())),
            (r#"pool="gpu" count="+2""#, MetaError::BadCount("+2".into())),
            (r#"pool="gpu" count=" 2""#, MetaError::BadCount(" 2".into())),
            (
                r#"pool="gpu" count="two""#,
                MetaError::BadCount("two".into()),
            ),
            (
                r#"pool="gpu" count="99999999999""#,
                MetaError::BadCount("99999999999".into()),
            ),
            (r#"pool="" count="2""#, MetaError::BadPool(String::new())),
            (r#"pool="a b" count="2""#, MetaError::BadPool("a b".into())),
            (
                r#"pool="gpu" count="2" min_vram="1G""#,
                MetaError::UnknownAttribute("min_vram".into()),
            ),
        ] {
            assert_eq!(gpu_needs(&el(attrs)), Err(want), "{attrs}");
        }
        let two = domain(
            r#"<sy:gpus xmlns:sy="https://switchyard.dev/xmlns/libvirt/1" pool="a" count="1"/>
               <x:gpus xmlns:x="https://switchyard.dev/xmlns/libvirt/1" pool="b" count="1"/>"#,
        );
        assert_eq!(gpu_needs(&two), Err(MetaError::Duplicate));
        let typo = domain(
            r#"<sy:gpu xmlns:sy="https://switchyard.dev/xmlns/libvirt/1" pool="a" count="1"/>"#,
        );
        assert_eq!(
            gpu_needs(&typo),
            Err(MetaError::UnknownElement("gpu".into()))
        );
        assert_eq!(
            gpu_needs("<network><name>x</name></network>"),
            Err(MetaError::NotDomain("network".into()))
        );
        for bad in ["", "<domain>", "<domain></domian>", "not xml"] {
            assert!(
                matches!(gpu_needs(bad), Err(MetaError::Xml(_))),
                "{bad:?}: {:?}",
                gpu_needs(bad)
            );
        }
        // The message of a parse error is one line (the hook prints it as one).
        let e = gpu_needs("<domain>\n<metadata>\n</domain>").expect_err("no XML");
        assert!(!e.to_string().contains('\n'), "{e}");
    }

    #[test]
    fn endpoint_ids_are_checked_ids() {
        assert_eq!(
            endpoint_ids("vm1", 2),
            Ok(vec!["libvirt.vm1.0".to_owned(), "libvirt.vm1.1".to_owned()])
        );
        assert_eq!(
            endpoint_ids("a.b-c_d", 1),
            Ok(vec!["libvirt.a.b-c_d.0".into()])
        );
        for bad in ["my vm", "vm/1", "vm:1", "vé"] {
            assert_eq!(
                endpoint_ids(bad, 1),
                Err(MetaError::BadDomainName(format!("libvirt.{bad}.0"))),
                "{bad}"
            );
        }
        // 64 characters at most: `libvirt.` + 54 + `.9` fits, `.10` does not.
        let name = "d".repeat(54);
        assert_eq!(endpoint_ids(&name, 10).map(|v| v.len()), Ok(10));
        assert_eq!(
            endpoint_ids(&name, 11),
            Err(MetaError::BadDomainName(format!("libvirt.{name}.10")))
        );
    }

    #[test]
    fn placed_ids_parse_with_dotted_domains() {
        assert_eq!(placed("libvirt.vm1.0"), Some(("vm1", 0)));
        assert_eq!(placed("libvirt.a.b.12"), Some(("a.b", 12)));
        for other in [
            "libvirt.vm1",
            "libvirt.vm1.",
            "libvirt..0",
            "libvirt.vm1.x",
            "libvirt.vm1.-1",
            "libvirt.vm1.+1",
            "vm1.0",
            "libvirtx.vm1.0",
            "libvirt.",
        ] {
            assert_eq!(placed(other), None, "{other}");
        }
    }

    #[test]
    fn a_domains_endpoints_are_not_a_longer_names() {
        let ids = [
            "libvirt.vm.0",
            "libvirt.vm.1",
            "libvirt.vm.b.0",
            "libvirt.vm2.0",
            "libvirt.vm.odd",
            "vm.0",
        ];
        assert_eq!(endpoints_of(ids, "vm"), ["libvirt.vm.0", "libvirt.vm.1"]);
        assert_eq!(endpoints_of(ids, "vm.b"), ["libvirt.vm.b.0"]);
        assert_eq!(endpoints_of(ids, "v"), Vec::<&str>::new());
    }

    #[test]
    fn stale_endpoints_are_those_of_domains_not_running() {
        let ids = [
            "libvirt.up.0",
            "libvirt.up.1",
            "libvirt.down.0",
            "libvirt.up.b.0",
            "libvirt.odd",
            "libvirt.down.x",
            "x",
            "down.0",
        ];
        let running = vec!["up".to_owned()];
        assert_eq!(stale(ids, &running), ["libvirt.down.0", "libvirt.up.b.0"]);
        assert_eq!(
            stale(ids, &[]),
            [
                "libvirt.up.0",
                "libvirt.up.1",
                "libvirt.down.0",
                "libvirt.up.b.0"
            ]
        );
        let all = vec!["up".to_owned(), "down".to_owned(), "up.b".to_owned()];
        assert_eq!(stale(ids, &all), Vec::<&str>::new());
    }

    const SY: &str = r#"xmlns:sy="https://switchyard.dev/xmlns/libvirt/1""#;

    #[test]
    fn sources_are_read_by_index_in_the_elements_namespace() {
        let xml = domain(&format!(
            r#"<sy:gpus {SY} pool="gpu" count="3">
                 <sy:source index="2">{{"endpoint":{{"id":"libvirt.vm1.2"}}}}</sy:source>
                 <sy:source index="0"> {{"endpoint":{{"id":"a&amp;b"}},"lease":null}} </sy:source>
               </sy:gpus>"#
        ));
        let g = gpus(&xml).expect("parses").expect("an element");
        assert_eq!(g.needs, needs("gpu", 3).expect("needs"));
        assert_eq!(g.sources.keys().copied().collect::<Vec<_>>(), [0, 2]);
        assert_eq!(g.sources[&0]["endpoint"]["id"], "a&b");
        assert_eq!(g.sources[&2]["endpoint"]["id"], "libvirt.vm1.2");
        // The needs alone, as before.
        assert_eq!(gpu_needs(&xml), Ok(needs("gpu", 3)));
        // Standalone, as `virsh metadata --uri` prints it: no namespace, or ours.
        let bare = r#"<gpus pool="gpu" count="1"><source index="0">{}</source></gpus>"#;
        let g = gpus_element(bare).expect("parses").expect("an element");
        assert_eq!((g.needs.count, g.sources.len()), (1, 1));
        assert_eq!(gpus_element(" \n"), Ok(None));
        assert_eq!(
            gpus_element(&format!(r#"<sy:gpus {SY} pool="p" count="2"/>"#))
                .map(|g| g.map(|g| g.sources.len())),
            Ok(Some(0))
        );
    }

    #[test]
    fn anything_else_in_gpus_is_refused() {
        let el = |children: &str| {
            domain(&format!(
                r#"<sy:gpus {SY} pool="gpu" count="2">{children}</sy:gpus>"#
            ))
        };
        let src = |attrs: &str, text: &str| format!("<sy:source {attrs}>{text}</sy:source>");
        for (children, want) in [
            (
                src(r#"index="2""#, "{}"),
                MetaError::BadSourceIndex("2".into()),
            ),
            (
                src(r#"index="-1""#, "{}"),
                MetaError::BadSourceIndex("-1".into()),
            ),
            (
                src(r#"index=" 1""#, "{}"),
                MetaError::BadSourceIndex(" 1".into()),
            ),
            (src("", "{}"), MetaError::BadSourceIndex(String::new())),
            (
                src(r#"index="0" token="x""#, "{}"),
                MetaError::UnknownSourceAttribute("token".into()),
            ),
            (
                src(r#"index="0""#, "{}") + &src(r#"index="0""#, "{}"),
                MetaError::DuplicateSource(0),
            ),
            (
                src(r#"index="1""#, "[1]"),
                MetaError::BadSource(1, "not an object".into()),
            ),
            (
                src(r#"index="1""#, "<sy:x/>"),
                MetaError::BadSource(1, "it holds elements".into()),
            ),
            (
                r#"<sy:sources index="0">{}</sy:sources>"#.to_owned(),
                MetaError::UnknownElement("sources".into()),
            ),
            // A `source` of no namespace inside ours is not ours: refused, not skipped.
            (
                r#"<source index="0">{}</source>"#.to_owned(),
                MetaError::UnknownElement("source".into()),
            ),
            ("text".to_owned(), MetaError::Text),
        ] {
            assert_eq!(gpus(&el(&children)), Err(want), "{children}");
        }
        let bad_json = gpus(&el(&src(r#"index="0""#, "{not json"))).expect_err("not JSON");
        assert!(matches!(bad_json, MetaError::BadSource(0, _)), "{bad_json}");
        assert_eq!(
            gpus_element(r#"<source index="0">{}</source>"#),
            Err(MetaError::NotGpus("source".into()))
        );
        assert_eq!(
            gpus_element(r#"<x:gpus xmlns:x="urn:other" pool="p" count="1"/>"#),
            Err(MetaError::NotGpus("gpus".into()))
        );
        assert!(matches!(gpus_element("<gpus"), Err(MetaError::Xml(_))));
    }
}
