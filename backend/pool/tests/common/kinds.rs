//! Device kinds for the pool's tests: the pool knows no real kind, so these stand in for
//! them with the same names and the options the configurations of these tests use.
//!
//! - `softgpu` ([`TestGpu`]): `vram` (a power of two, 1 MiB to 64 GiB, default 64 MiB),
//!   `queues` (1 to 8, default 2), `irq` (`msix` or `msi`), `vram_mmap` (on/off, default
//!   on), `vram_reset` (`zero` or `keep`); partitionable and movable.
//! - `vfio` ([`TestPassthrough`]): `host` (required, `DDDD:BB:DD.F` or `BB:DD.F`, held
//!   alone), `bars` (`trap` or `mmap`); neither partitionable nor movable.

use switchyard_device::PciDevice;
use switchyard_device::kind::{
    Build, DeviceKind, DirtyLog, KindCatalog, KindConfig, KindError, KindOptions, Profile, opt,
};

/// A GPU-like kind.
#[derive(Debug)]
pub struct TestGpu;

/// A passthrough-like kind.
#[derive(Debug)]
pub struct TestPassthrough;

/// The catalog of the two.
#[derive(Debug)]
pub struct TestKinds;

/// What the pool's tests pass where the daemon passes the registry.
pub const KINDS: &TestKinds = &TestKinds;

fn no_device(kind: &'static str) -> KindError {
    KindError::NoRecovery(kind)
}

/// What the test kinds make of options: the canonical form and the profile; no device.
#[derive(Debug)]
struct Checked {
    kind: &'static str,
    options: KindOptions,
    profile: Profile,
}

impl KindConfig for Checked {
    fn options(&self) -> KindOptions {
        self.options.clone()
    }

    fn profile(&self) -> Profile {
        self.profile.clone()
    }

    fn build(&self, _: Build) -> Result<Box<dyn PciDevice>, KindError> {
        Err(no_device(self.kind))
    }

    fn recover(&self, _: Build) -> Result<Box<dyn PciDevice>, KindError> {
        Err(no_device(self.kind))
    }
}

impl DeviceKind for TestGpu {
    fn name(&self) -> &'static str {
        "softgpu"
    }

    fn summary(&self) -> &'static str {
        "a test GPU"
    }

    fn options_help(&self) -> &'static str {
        "vram=SIZE queues=N irq=msix|msi vram_mmap=on|off vram_reset=zero|keep"
    }

    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError> {
        opt::only(
            options,
            &["vram", "queues", "irq", "vram_mmap", "vram_reset", "spin"],
        )?;
        let vram = opt::size(options, "vram")?.unwrap_or(64 << 20);
        if !vram.is_power_of_two() {
            return Err(KindError::option(
                "vram",
                format!("{vram} bytes is not a power of two"),
            ));
        }
        if !(1 << 20..=64 << 30).contains(&vram) {
            return Err(KindError::option(
                "vram",
                format!("{vram} bytes is outside 1 MiB to 64 GiB"),
            ));
        }
        let queues = opt::u64(options, "queues")?.unwrap_or(2);
        if !(1..=8).contains(&queues) {
            return Err(KindError::option(
                "queues",
                format!("{queues} queues is outside 1 to 8"),
            ));
        }
        let irq = opt::str(options, "irq")?.unwrap_or("msix");
        if !matches!(irq, "msix" | "msi") {
            return Err(KindError::option(
                "irq",
                format!("`{irq}` is not `msix` or `msi`"),
            ));
        }
        let mmap = opt::bool(options, "vram_mmap")?.unwrap_or(true);
        let reset = opt::str(options, "vram_reset")?.unwrap_or("zero");
        if !matches!(reset, "zero" | "keep") {
            return Err(KindError::option(
                "vram_reset",
                format!("`{reset}` is not `zero` or `keep`"),
            ));
        }
        // A host setting (as the softgpu's polling budget): not what the guest sees.
        let spin = opt::u64(options, "spin")?;
        let mut canonical = KindOptions::new();
        if let Some(spin) = spin {
            canonical.insert("spin".into(), spin.into());
        }
        canonical.insert("vram".into(), vram.into());
        canonical.insert("queues".into(), queues.into());
        canonical.insert("irq".into(), irq.into());
        canonical.insert("vram_mmap".into(), mmap.into());
        canonical.insert("vram_reset".into(), reset.into());
        let profile = Profile {
            memory: vram,
            queues: u32::try_from(queues).unwrap_or(u32::MAX),
            partitionable: true,
            movable: true,
            msix: irq == "msix",
            host_settings: vec!["spin".into()],
            client_maps_memory: mmap,
            ..Profile::default()
        };
        Ok(Box::new(Checked {
            kind: "softgpu",
            options: canonical,
            profile,
        }))
    }
}

impl DeviceKind for TestPassthrough {
    fn name(&self) -> &'static str {
        "vfio"
    }

    fn summary(&self) -> &'static str {
        "a test passthrough device"
    }

    fn options_help(&self) -> &'static str {
        "host=DDDD:BB:DD.F bars=trap|mmap"
    }

    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError> {
        opt::only(options, &["host", "bars"])?;
        let host = opt::str(options, "host")?
            .ok_or_else(|| KindError::option("host", "required: the device's PCI address"))?;
        let host = match host.split(':').count() {
            3 => host.to_owned(),
            2 => format!("0000:{host}"),
            _ => {
                return Err(KindError::option(
                    "host",
                    format!("`{host}` is not a PCI address"),
                ));
            }
        };
        let bars = opt::str(options, "bars")?.unwrap_or("trap");
        if !matches!(bars, "trap" | "mmap") {
            return Err(KindError::option(
                "bars",
                format!("`{bars}` is not `trap` or `mmap`"),
            ));
        }
        let mut canonical = KindOptions::new();
        canonical.insert("host".into(), host.clone().into());
        canonical.insert("bars".into(), bars.into());
        let profile = Profile {
            msix: true,
            dirty_log: DirtyLog::AllMapped,
            exclusive: Some(host),
            ..Profile::default()
        };
        Ok(Box::new(Checked {
            kind: "vfio",
            options: canonical,
            profile,
        }))
    }

    fn partition(&self, board: &KindOptions, _: u64, _: u32) -> KindOptions {
        board.clone()
    }
}

impl KindCatalog for TestKinds {
    fn kind(&self, name: &str) -> Option<&dyn DeviceKind> {
        match name {
            "softgpu" => Some(&TestGpu),
            "vfio" => Some(&TestPassthrough),
            _ => None,
        }
    }

    fn names(&self) -> String {
        "softgpu, vfio".into()
    }
}
