//! What the suite runs on: how to make the device, and what it declares.

use std::sync::Arc;

use switchyard_device::PciDevice;
use switchyard_device::blackbox::RecordSpec;
use switchyard_device::kind::{
    Build, DeviceKind, KindConfig, KindError, KindOptions, Profile, parse_kv,
};

/// Builds a device from a [`Build`] (the context, and for a recovery the black box and the
/// held objects).
pub type BuildFn = dyn Fn(Build) -> Result<Box<dyn PciDevice>, KindError> + Send + Sync;

/// How a device moves onto new memory ([`Relocatable`](switchyard_device::Relocatable)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Moves {
    /// It does not: `relocatable()` is `None`.
    #[default]
    No,
    /// Only while no client is connected (`begin_relocation(true)`; memory a client could
    /// map moves too): `begin_relocation(false)` is refused.
    Detached,
    /// Under a connected client (`begin_relocation(false)`).
    UnderClient,
}

/// The optional capability groups a subject declares: each is checked to be offered exactly
/// when declared, and exercised where it is.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Groups {
    /// VFIO migration v2 ([`Migratable`](switchyard_device::Migratable)).
    pub migration: bool,
    /// Replacement under a client ([`Swappable`](switchyard_device::Swappable)).
    pub swap: bool,
    /// Rebuilt in a replacement process ([`Recoverable`](switchyard_device::Recoverable) and
    /// the kind's `recover`).
    pub recovery: bool,
    /// Moves onto new memory ([`Relocatable`](switchyard_device::Relocatable)).
    pub relocation: Moves,
    /// Work counters ([`Telemetry`](switchyard_device::Telemetry)).
    pub telemetry: bool,
}

impl Groups {
    /// No optional group.
    pub const NONE: Groups = Groups {
        migration: false,
        swap: false,
        recovery: false,
        relocation: Moves::No,
        telemetry: false,
    };
}

enum Maker {
    Kind {
        kind: Arc<dyn DeviceKind>,
        /// The kind's configuration of the options (what builds and rebuilds the devices).
        config: Box<dyn KindConfig>,
        /// The options as given.
        given: KindOptions,
        /// The kind's canonical form of them, and its profile.
        canonical: KindOptions,
        profile: Profile,
    },
    Fn {
        build: Arc<BuildFn>,
        /// The black-box records and the rebuild, for a mock that declares recovery.
        recover: Option<(Vec<RecordSpec>, Arc<BuildFn>)>,
    },
}

/// A device the suite runs on: how to make one on a fresh context, and the capability groups
/// it declares (none until [`Subject::declares`]).
pub struct Subject {
    name: String,
    maker: Maker,
    declared: Groups,
}

impl std::fmt::Debug for Subject {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Subject");
        d.field("name", &self.name);
        if let Maker::Kind { canonical, .. } = &self.maker {
            d.field("options", canonical);
        }
        d.field("declared", &self.declared).finish()
    }
}

impl Subject {
    /// Devices of `kind` with `options`, built as a worker builds them: by the configuration
    /// the kind makes of them ([`configure`](DeviceKind::configure)).
    ///
    /// # Panics
    /// If the kind refuses the options (a mistake in the test, not a finding).
    pub fn kind(kind: impl DeviceKind, options: KindOptions) -> Self {
        let config = kind.configure(&options).unwrap_or_else(|e| {
            panic!(
                "conformance subject {}: the kind refuses {options:?}: {e}",
                kind.name()
            )
        });
        let (canonical, profile) = (config.options(), config.profile());
        Self {
            name: kind.name().to_owned(),
            maker: Maker::Kind {
                kind: Arc::new(kind),
                config,
                given: options,
                canonical,
                profile,
            },
            declared: Groups::NONE,
        }
    }

    /// [`Subject::kind`] with options in the command line's `k=v,...` form.
    ///
    /// # Panics
    /// If `options` does not parse or the kind refuses them.
    pub fn kind_kv(kind: impl DeviceKind, options: &str) -> Self {
        let parsed = parse_kv(options)
            .unwrap_or_else(|e| panic!("conformance subject: `{options}` does not parse: {e}"));
        Self::kind(kind, parsed)
    }

    /// Devices made by `build` (a mock): no options, no profile, and no recovery unless
    /// [`Subject::recovered_by`] says how.
    pub fn from_fn(
        name: impl Into<String>,
        build: impl Fn(Build) -> Result<Box<dyn PciDevice>, KindError> + Send + Sync + 'static,
    ) -> Self {
        Self {
            name: name.into(),
            maker: Maker::Fn {
                build: Arc::new(build),
                recover: None,
            },
            declared: Groups::NONE,
        }
    }

    /// For a [`Subject::from_fn`] subject: the black-box records its devices mirror into and
    /// how a replacement rebuilds one (what a kind's `black_box_records` and `recover` are).
    ///
    /// # Panics
    /// On a subject made from a kind (the kind says that itself).
    pub fn recovered_by(
        mut self,
        records: Vec<RecordSpec>,
        recover: impl Fn(Build) -> Result<Box<dyn PciDevice>, KindError> + Send + Sync + 'static,
    ) -> Self {
        match &mut self.maker {
            Maker::Fn { recover: r, .. } => *r = Some((records, Arc::new(recover))),
            Maker::Kind { .. } => panic!(
                "conformance subject {}: a kind recovers through KindConfig::recover",
                self.name
            ),
        }
        self
    }

    /// Declares the optional groups the device offers.
    pub fn declares(mut self, groups: Groups) -> Self {
        self.declared = groups;
        self
    }

    /// Renames the subject (messages name it; a kind's subject is named after the kind).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The name messages use.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The declared groups.
    pub fn declared(&self) -> Groups {
        self.declared
    }

    /// Builds a device (a fresh one, or one rebuilt with a black box and held objects).
    pub fn build(&self, build: Build) -> Result<Box<dyn PciDevice>, KindError> {
        match &self.maker {
            Maker::Kind { config, .. } => config.build(build),
            Maker::Fn { build: f, .. } => f(build),
        }
    }

    /// The black-box records a device mirrors into (empty: none, or no way to recover).
    pub fn black_box_records(&self) -> Vec<RecordSpec> {
        match &self.maker {
            Maker::Kind { config, .. } => config.black_box_records(),
            Maker::Fn { recover, .. } => recover
                .as_ref()
                .map(|(records, _)| records.clone())
                .unwrap_or_default(),
        }
    }

    /// Rebuilds a device the way a replacement process does; `None` for a mock that gave no
    /// way to ([`Subject::recovered_by`]).
    pub fn recover(&self, build: Build) -> Option<Result<Box<dyn PciDevice>, KindError>> {
        match &self.maker {
            Maker::Kind { config, .. } => Some(config.recover(build)),
            Maker::Fn { recover, .. } => recover.as_ref().map(|(_, f)| f(build)),
        }
    }

    /// Whether [`Subject::recover`] can rebuild at all (a kind, or a mock given a way).
    pub(crate) fn rebuilds(&self) -> bool {
        match &self.maker {
            Maker::Kind { .. } => true,
            Maker::Fn { recover, .. } => recover.is_some(),
        }
    }

    /// The kind, its options as given and as checked, and its profile (`None` for a mock).
    pub(crate) fn kind_parts(
        &self,
    ) -> Option<(&dyn DeviceKind, &KindOptions, &KindOptions, &Profile)> {
        match &self.maker {
            Maker::Kind {
                kind,
                given,
                canonical,
                profile,
                ..
            } => Some((&**kind, given, canonical, profile)),
            Maker::Fn { .. } => None,
        }
    }
}
