//! What a guest sees of a device: its kind, the kind's canonical options and the pool's view of
//! them ([`Profile`]). A leaf module: the configuration, the events and the inventory use it.
//!
//! A shape is made by the kind ([`DeviceShape::of`]). A record written before device kinds
//! (`{model, vram_size, queues, irq, vram_mmap, keep_vram_on_reset}`) still decodes: its
//! options are those the softgpu (or, for `model = "vfio"`, passthrough) board had, and
//! [`Pool::open`](crate::Pool::open) has the kind check them again.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use switchyard_device::kind::{DeviceKind, DirtyLog, KindError, KindOptions, Profile};
use utoipa::ToSchema;

use crate::units::Size;

/// What a guest sees of a device: two devices of the same shape are interchangeable under a
/// running guest (a move keeps the shape). The device's kind makes it from the board's
/// options: `options` are what the kind's check returned (canonical: equal options build the
/// same device), `profile` what the pool knows of such a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(from = "ShapeRecord")]
pub struct DeviceShape {
    /// The kind's name (`softgpu`, `vfio`).
    pub model: String,
    /// The kind's canonical options, e.g. `{"vram": 67108864, "queues": 2, "irq": "msix", ...}`.
    #[schema(value_type = Object)]
    pub options: KindOptions,
    /// What the pool knows of such a device: `memory` (also written as `vram`, its name in
    /// earlier releases) and `queues` (0: none the pool accounts), `partitionable`, `movable`, `msix`, `dirty_log` and `exclusive` (the host
    /// resource it holds, e.g. a PCI address).
    #[schema(value_type = Object)]
    pub profile: Profile,
}

impl DeviceShape {
    /// Checks `options` with `kind`: the shape of a device of these options. The error names
    /// the option at fault ([`KindError::field`]).
    pub fn of(kind: &dyn DeviceKind, options: &KindOptions) -> Result<Self, KindError> {
        let (options, profile) = kind.check(options)?;
        Ok(Self {
            model: kind.name().to_owned(),
            options,
            profile,
        })
    }

    /// The shape of a partition of a board of this shape with its own `vram` and `queues`
    /// ([`DeviceKind::partition`], checked again).
    pub fn partition(
        &self,
        kind: &dyn DeviceKind,
        vram: u64,
        queues: u32,
    ) -> Result<Self, KindError> {
        Self::of(kind, &kind.partition(&self.options, vram, queues))
    }

    /// Device memory bytes the pool accounts (0: none): VRAM for a GPU
    /// ([`DeviceKind::memory_name`] says what a kind calls it).
    pub fn memory(&self) -> u64 {
        self.profile.memory
    }

    /// Command queues the pool accounts (0: none).
    pub fn queues(&self) -> u32 {
        self.profile.queues
    }

    /// An option as text: a string as it is, anything else as JSON (`true`, `64`).
    pub fn option_text(&self, name: &str) -> Option<String> {
        self.options.get(name).map(value_text)
    }

    /// The first field in which `self` differs from `other`, as `field (self vs other)`: the
    /// model (unless both kinds present the same device, [`Profile::presents`]), then device
    /// memory (`memory (128 MiB vs 64 MiB)`), queues, then the other options by name
    /// (`irq (msi vs msix)`, `vram_reset (keep vs zero)`); `None` when they are the same.
    ///
    /// The option naming the host resource a device holds ([`Profile::exclusive`], a
    /// passthrough device's `host`) says *which* device it is, not what it looks like: it is
    /// not compared (two passthrough boards of one pool have different addresses).
    pub fn difference(&self, other: &DeviceShape) -> Option<String> {
        let same_device =
            self.profile.presents.is_some() && self.profile.presents == other.profile.presents;
        if self.model != other.model && !same_device {
            return Some(format!("model ({} vs {})", self.model, other.model));
        }
        if self.memory() != other.memory() {
            return Some(format!(
                "memory ({} vs {})",
                Size(self.memory()),
                Size(other.memory())
            ));
        }
        if self.queues() != other.queues() {
            return Some(format!("queues ({} vs {})", self.queues(), other.queues()));
        }
        let names: BTreeSet<&String> = self.options.keys().chain(other.options.keys()).collect();
        for name in names {
            if self.is_identity(name) && other.is_identity(name) {
                continue;
            }
            if self.profile.host_settings.contains(name)
                || other.profile.host_settings.contains(name)
            {
                continue;
            }
            let (a, b) = (self.options.get(name), other.options.get(name));
            if a != b {
                let text = |v: Option<&Value>| v.map_or_else(|| "unset".to_owned(), value_text);
                return Some(format!("{name} ({} vs {})", text(a), text(b)));
            }
        }
        None
    }

    /// Whether option `name` is the host resource the device holds.
    fn is_identity(&self, name: &str) -> bool {
        match (&self.profile.exclusive, self.options.get(name)) {
            (Some(resource), Some(Value::String(v))) => v == resource,
            _ => false,
        }
    }

    /// Whether a device of this shape meets `req`; the reason when not.
    pub(crate) fn meets(&self, req: &Requirements) -> Result<(), String> {
        if self.memory() < req.min_vram {
            return Err(format!(
                "{} of device memory, at least {} required",
                Size(self.memory()),
                Size(req.min_vram)
            ));
        }
        if self.queues() < req.min_queues {
            return Err(format!(
                "{} queues, at least {} required",
                self.queues(),
                req.min_queues
            ));
        }
        Ok(())
    }
}

/// A string as it is, anything else as JSON.
fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Where a device's dirty-page reports (`DMA_LOGGING_REPORT`) come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum DirtyTracking {
    /// The device logs its own writes page by page (the softgpu).
    DeviceLog,
    /// Every page mapped into the device's IOMMU is reported dirty (the conservative rule
    /// QEMU applies): no VFIO device DMA logging and no iommufd dirty tracking is available
    /// to a passthrough device here.
    AllMapped,
}

impl DirtyTracking {
    /// The source a device of this profile uses.
    pub fn of(profile: &Profile) -> DirtyTracking {
        match profile.dirty_log {
            DirtyLog::DeviceLog => DirtyTracking::DeviceLog,
            DirtyLog::AllMapped => DirtyTracking::AllMapped,
        }
    }
}

/// A shape as stored: the current form, or the form from before device kinds.
#[derive(Deserialize)]
#[serde(untagged)]
enum ShapeRecord {
    Current {
        model: String,
        options: KindOptions,
        profile: Profile,
    },
    Legacy(LegacyShape),
}

/// A shape as the store kept it before device kinds: softgpu settings, which a passthrough
/// board filled with zeros (its `host` was on the board; `vram_mmap` was `bars = "mmap"`).
#[derive(Deserialize)]
struct LegacyShape {
    #[serde(default = "softgpu")]
    model: String,
    vram_size: u64,
    queues: u32,
    irq: String,
    vram_mmap: bool,
    #[serde(default)]
    keep_vram_on_reset: bool,
}

fn softgpu() -> String {
    "softgpu".into()
}

impl From<ShapeRecord> for DeviceShape {
    fn from(r: ShapeRecord) -> Self {
        match r {
            ShapeRecord::Current {
                model,
                options,
                profile,
            } => DeviceShape {
                model,
                options,
                profile,
            },
            ShapeRecord::Legacy(l) => l.into(),
        }
    }
}

impl From<LegacyShape> for DeviceShape {
    /// The options the board had and the profile the kind gave such a board; the kind checks
    /// them again at open ([`crate::board::BoardDef::recheck`]), completing what was not
    /// stored (a passthrough board's `host` comes from the board record).
    fn from(l: LegacyShape) -> Self {
        let mut options = KindOptions::new();
        if l.model == "vfio" {
            let bars = if l.vram_mmap { "mmap" } else { "trap" };
            options.insert("bars".into(), bars.into());
            return DeviceShape {
                model: l.model,
                options,
                profile: Profile {
                    msix: true,
                    dirty_log: DirtyLog::AllMapped,
                    ..Profile::default()
                },
            };
        }
        let msix = l.irq == "msix";
        options.insert("vram".into(), l.vram_size.into());
        options.insert("queues".into(), l.queues.into());
        options.insert("irq".into(), l.irq.into());
        options.insert("vram_mmap".into(), l.vram_mmap.into());
        let reset = if l.keep_vram_on_reset { "keep" } else { "zero" };
        options.insert("vram_reset".into(), reset.into());
        DeviceShape {
            model: l.model,
            options,
            profile: Profile {
                memory: l.vram_size,
                queues: l.queues,
                partitionable: true,
                movable: true,
                msix,
                ..Profile::default()
            },
        }
    }
}

/// What an endpoint's device must have.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Requirements {
    /// Least device memory (the profile's `memory`: VRAM for a GPU), bytes (0: any). The
    /// name dates from when every device was a GPU.
    #[serde(default)]
    pub min_vram: u64,
    /// Least queues (0: any).
    #[serde(default)]
    pub min_queues: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(model: &str, presents: Option<&str>, extra: &[(&str, Value)]) -> DeviceShape {
        let mut options = KindOptions::new();
        options.insert("vram".into(), (64u64 << 20).into());
        options.insert("vram_mmap".into(), false.into());
        for (k, v) in extra {
            options.insert((*k).into(), v.clone());
        }
        DeviceShape {
            model: model.into(),
            options,
            profile: Profile {
                memory: 64 << 20,
                queues: 2,
                partitionable: true,
                movable: true,
                msix: true,
                host_settings: vec!["spin".into(), "gpu".into()],
                presents: presents.map(str::to_owned),
                ..Profile::default()
            },
        }
    }

    #[test]
    fn kinds_presenting_the_same_device_are_one_shape_but_for_their_options() {
        let soft = shape("softgpu", Some("softgpu"), &[]);
        let gpu = shape("cuda", Some("softgpu"), &[("gpu", "GPU-1".into())]);
        let gpu2 = shape("cuda", Some("softgpu"), &[("gpu", "GPU-2".into())]);
        assert_eq!(soft.difference(&gpu), None, "the GPU is a host setting");
        assert_eq!(gpu.difference(&gpu2), None);
        let mapped = shape("cuda", Some("softgpu"), &[("vram_mmap", true.into())]);
        assert_eq!(
            soft.difference(&mapped).as_deref(),
            Some("vram_mmap (false vs true)")
        );
        let other = shape("scratchpad", None, &[]);
        assert_eq!(
            soft.difference(&other).as_deref(),
            Some("model (softgpu vs scratchpad)")
        );
        let elsewhere = shape("npu", Some("npu"), &[]);
        assert!(soft.difference(&elsewhere).is_some());
    }
}
