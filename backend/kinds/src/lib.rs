//! The device-kind registry: every kind of device Switchyard serves, by name.
//!
//! `switchyard serve --device KIND,opts`, a pool board's `model = "KIND"` and the daemon's
//! workers all parse and build through here, and know nothing else of the kinds: a new kind
//! is a crate implementing [`DeviceKind`] (see `switchyard_device::kind`) plus one line in
//! [`KINDS`].

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use serde::{Deserialize, Serialize};
use switchyard_device::kind::{
    DeviceKind, KindCatalog, KindConfig, KindError, KindOptions, Profile, parse_kv,
};

/// Every kind, in the order help texts list them.
pub static KINDS: &[&dyn DeviceKind] = &[
    &switchyard_softgpu::SoftGpuKind,
    &switchyard_vfio::VfioKind,
    &switchyard_scratchpad::ScratchpadKind,
    &switchyard_cuda::CudaKind,
];

/// The kind called `name`.
pub fn get(name: &str) -> Option<&'static dyn DeviceKind> {
    KINDS.iter().copied().find(|k| k.name() == name)
}

/// The kinds' names, comma-separated (for messages).
pub fn names() -> String {
    KINDS
        .iter()
        .map(|k| k.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The registry as a [`KindCatalog`] (what a pool checks its boards against).
#[derive(Debug, Clone, Copy, Default)]
pub struct Registry;

impl KindCatalog for Registry {
    fn kind(&self, name: &str) -> Option<&dyn DeviceKind> {
        get(name)
    }

    fn names(&self) -> String {
        names()
    }
}

/// Why a device could not be described.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    /// No such kind.
    #[error("Unknown device kind `{kind}`; the kinds are {known}")]
    UnknownKind {
        /// What was asked for.
        kind: String,
        /// The known kinds.
        known: String,
    },
    /// The kind refuses the options.
    #[error("{kind}: {source}")]
    Options {
        /// The kind.
        kind: &'static str,
        /// Why.
        #[source]
        source: KindError,
    },
}

/// A device to serve: a kind and its canonical options ([`DeviceKind::check`]). What a
/// worker is told to build.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceSpec {
    /// The kind's name.
    pub kind: String,
    /// Its canonical options.
    pub options: KindOptions,
}

/// A spec its kind has parsed and checked, once ([`DeviceSpec::configure`]): the canonical
/// spec and the typed configuration that builds, recovers and moves its devices, so that
/// nothing parses the options again.
#[derive(Debug)]
pub struct Configured {
    /// The spec, canonical.
    pub spec: DeviceSpec,
    /// The kind's configuration of it.
    pub config: Box<dyn KindConfig>,
}

impl DeviceSpec {
    /// Checks `options` for `kind`: the spec (canonical options) and the pool's profile.
    pub fn new(kind: &str, options: &KindOptions) -> Result<(DeviceSpec, Profile), SpecError> {
        let c = Self::configure_as(kind, options)?;
        let profile = c.config.profile();
        Ok((c.spec, profile))
    }

    /// Parses the command line's `KIND[,name=value...]`.
    pub fn parse(s: &str) -> Result<DeviceSpec, SpecError> {
        let (kind, options) = s.split_once(',').unwrap_or((s, ""));
        let kind = kind.trim();
        let options = parse_kv(options).map_err(|source| SpecError::Options {
            kind: get(kind).map_or("device", |k| k.name()),
            source,
        })?;
        Ok(Self::configure_as(kind, &options)?.spec)
    }

    /// Has the kind parse and check the options of a spec (one made here, or decoded from
    /// elsewhere: a custody note, a store): the configuration a device of it is built with.
    pub fn configure(&self) -> Result<Configured, SpecError> {
        Self::configure_as(&self.kind, &self.options)
    }

    fn configure_as(kind: &str, options: &KindOptions) -> Result<Configured, SpecError> {
        let k = get(kind).ok_or_else(|| SpecError::UnknownKind {
            kind: kind.to_owned(),
            known: names(),
        })?;
        let config = k.configure(options).map_err(|source| SpecError::Options {
            kind: k.name(),
            source,
        })?;
        let spec = DeviceSpec {
            kind: k.name().to_owned(),
            options: config.options(),
        };
        Ok(Configured { spec, config })
    }
}

impl std::fmt::Display for DeviceSpec {
    /// `KIND,name=value,...`, the command line's form.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.kind)?;
        for (k, v) in &self.options {
            match v {
                serde_json::Value::String(s) => write!(f, ",{k}={s}")?,
                serde_json::Value::Bool(b) => write!(f, ",{k}={}", if *b { "on" } else { "off" })?,
                other => write!(f, ",{k}={other}")?,
            }
        }
        Ok(())
    }
}

/// The spec of a softgpu of `config` (for tests and benchmarks that build one directly).
pub fn softgpu(config: &switchyard_softgpu::SoftGpuConfig) -> DeviceSpec {
    DeviceSpec {
        kind: "softgpu".into(),
        options: switchyard_softgpu::SoftGpuKind::options(config),
    }
}

/// Help text listing every kind: its summary, its options, then its notes
/// ([`DeviceKind::notes`]), each kind's own text.
pub fn help() -> String {
    let mut s = String::new();
    for k in KINDS {
        s.push_str(&format!("{}: {}\n", k.name(), k.summary()));
        for line in k.options_help().lines() {
            s.push_str("    ");
            s.push_str(line.trim_start());
            s.push('\n');
        }
        for line in k.notes().lines().filter(|l| !l.trim().is_empty()) {
            s.push_str("  ");
            s.push_str(line.trim_start());
            s.push('\n');
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_well_formed() {
        let mut seen = std::collections::BTreeSet::new();
        for k in KINDS {
            let n = k.name();
            assert!(
                !n.is_empty()
                    && n.bytes()
                        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'),
                "{n}"
            );
            assert!(seen.insert(n), "{n} registered twice");
        }
    }

    #[test]
    fn the_command_line_form_parses_checks_and_prints_back() {
        let spec = DeviceSpec::parse("softgpu,vram=128M,queues=4,irq=msi").expect("parses");
        assert_eq!(spec.kind, "softgpu");
        assert_eq!(spec.options["vram"], 128u64 << 20);
        let again = DeviceSpec::parse(&spec.to_string()).expect("its own form parses");
        assert_eq!(again, spec);
        let e = DeviceSpec::parse("softgpu,vram=3M").expect_err("not a power of two");
        assert!(e.to_string().contains("`vram`"), "{e}");
        let e = DeviceSpec::parse("gpu9").expect_err("unknown");
        assert!(e.to_string().contains("softgpu, vfio"), "{e}");
        let e = DeviceSpec::parse("vfio,bars=mmap").expect_err("no host");
        assert!(e.to_string().contains("`host`"), "{e}");
    }

    #[test]
    fn help_gives_every_kind_its_own_options_and_notes() {
        let help = help();
        for k in KINDS {
            let at = help
                .find(&format!("{}: {}", k.name(), k.summary()))
                .unwrap_or_else(|| panic!("{} is not listed:\n{help}", k.name()));
            // Its options and notes come next, before the next kind.
            let own = &help[at..];
            let own = KINDS
                .iter()
                .filter_map(|other| own.find(&format!("\n{}: ", other.name())))
                .min()
                .map_or(own, |end| &own[..end]);
            for line in k.options_help().lines().chain(k.notes().lines()) {
                assert!(own.contains(line.trim()), "{}: `{line}`:\n{own}", k.name());
            }
        }
        // The cuda kind's options are its own: the GPU, and no mappable VRAM.
        let cuda = get("cuda").expect("cuda").options_help();
        assert!(
            cuda.contains("gpu=") && cuda.contains("vram_mmap=off"),
            "{cuda}"
        );
        assert_ne!(cuda, get("softgpu").expect("softgpu").options_help());
    }

    #[test]
    fn a_spec_survives_json() {
        let spec = DeviceSpec::parse("vfio,host=00:04.0,bars=mmap").expect("parses");
        assert_eq!(spec.options["host"], "0000:00:04.0");
        let json = serde_json::to_string(&spec).expect("encodes");
        let back: DeviceSpec = serde_json::from_str(&json).expect("decodes");
        assert_eq!(back.configure().expect("configures").spec, spec);
    }
}
