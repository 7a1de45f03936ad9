//! A libvirt domain's GPU needs, from its XML's `<metadata>`, and the endpoint ids they
//! become.

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
                "The metadata has an unknown element <{name}> of {NAMESPACE} (only <gpus>)"
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
        }
    }
}

impl std::error::Error for MetaError {}

/// The GPU needs of the domain whose XML is `xml`: `None` when its `<metadata>` has no
/// `gpus` element of [`NAMESPACE`] (whatever its prefix).
pub fn gpu_needs(xml: &str) -> Result<Option<GpuNeeds>, MetaError> {
    let doc = roxmltree::Document::parse(xml).map_err(|e| MetaError::Xml(e.to_string()))?;
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
    let Some(gpus) = found else {
        return Ok(None);
    };
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
    let n = (!count.is_empty() && count.bytes().all(|b| b.is_ascii_digit()))
        .then(|| count.parse::<u32>().ok())
        .flatten()
        .filter(|n| (1..=MAX_COUNT).contains(n))
        .ok_or_else(|| MetaError::BadCount(count.to_owned()))?;
    Ok(Some(GpuNeeds {
        pool: pool.to_owned(),
        count: n,
    }))
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
}
