//! Passthrough as a device kind (`vfio`): a PCI device or SR-IOV VF bound to vfio-pci.
//!
//! Its state is in the hardware, so a replacement process recovers it by *reset + replay*:
//! the device publishes the client's configuration (config-space bits, the MSI-X table) into
//! the black box after every change, and its [`KindConfig::recover`] opens
//! the device again (the kernel reset it when the dead process's descriptors closed) and
//! replays it. The client's DMA windows and eventfds reach the new IOMMU container and the
//! kernel through the device's DMA observer and interrupt router, which the server feeds
//! with everything in its tables when the device takes the slot.

use std::fs::File;

use switchyard_device::blackbox::RecordSpec;
use switchyard_device::kind::{
    Build, DeviceKind, DirtyLog, Host, HostInventory, KindConfig, KindError, KindOptions, Profile,
    opt,
};
use switchyard_device::{DeviceError, PciDevice, Recoverable};

use crate::{BarMode, IrqDelivery, VfioConfig, VfioPci, sysfs};

/// The passthrough kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct VfioKind;

/// The black-box record of the client's configuration.
const RECORD: &str = "vfio.config";

impl VfioKind {
    /// The configuration `options` describe: what [`DeviceKind::configure`] makes of them.
    pub fn config(options: &KindOptions) -> Result<VfioConfig, KindError> {
        opt::only(options, &["host", "bars", "irq"])?;
        let host = opt::str(options, "host")?
            .ok_or_else(|| {
                KindError::option(
                    "host",
                    "required: the device's PCI address (e.g. \"0000:00:04.0\")",
                )
            })
            .and_then(|h| {
                sysfs::normalize_bdf(h).map_err(|_| {
                    KindError::option(
                        "host",
                        format!("`{h}` is not a PCI address; expected DDDD:BB:DD.F or BB:DD.F (hexadecimal)"),
                    )
                })
            })?;
        let mut c = VfioConfig::new(host);
        c.bars = match opt::str(options, "bars")? {
            None | Some("trap") => BarMode::Trap,
            Some("mmap") => BarMode::Mmap,
            Some(b) => {
                return Err(KindError::option(
                    "bars",
                    format!("`{b}` is not `trap` or `mmap`"),
                ));
            }
        };
        c.irq = match opt::str(options, "irq")? {
            None | Some("direct") => IrqDelivery::Direct,
            Some("relay") => IrqDelivery::Relay,
            Some(i) => {
                return Err(KindError::option(
                    "irq",
                    format!("`{i}` is not `direct` or `relay`"),
                ));
            }
        };
        Ok(c)
    }

    /// The canonical options of `config`.
    pub fn options(config: &VfioConfig) -> KindOptions {
        let mut o = KindOptions::new();
        o.insert("host".into(), config.host.clone().into());
        let bars = match config.bars {
            BarMode::Trap => "trap",
            BarMode::Mmap => "mmap",
        };
        o.insert("bars".into(), bars.into());
        let irq = match config.irq {
            IrqDelivery::Direct => "direct",
            IrqDelivery::Relay => "relay",
        };
        o.insert("irq".into(), irq.into());
        o
    }

    fn open(c: &VfioConfig, b: &Build, replay: bool) -> Result<VfioPci, KindError> {
        let mut device = VfioPci::open(c).map_err(|e| KindError::build("vfio", e))?;
        if let Some(bb) = &b.black_box {
            let mirror = bb.record(RECORD).map_err(|e| KindError::build("vfio", e))?;
            if replay {
                match mirror.read() {
                    Ok(Some(saved)) => match device.restore(&saved) {
                        Ok(()) => tracing::info!(
                            "the client's configuration replayed onto the reset device"
                        ),
                        Err(e) => {
                            tracing::error!(error = %e, "cannot replay the client's configuration")
                        }
                    },
                    Ok(None) => {}
                    Err(e) => tracing::error!(error = %e, "cannot read the client's configuration"),
                }
            }
            device.set_mirror(mirror);
        }
        if let Some(lost) = b.lost.clone() {
            device.on_release(move || {
                lost("the kernel took the device back (an unbind or a removal)".into())
            });
        }
        Ok(device)
    }
}

impl DeviceKind for VfioKind {
    fn name(&self) -> &'static str {
        "vfio"
    }

    fn summary(&self) -> &'static str {
        "a PCI device or SR-IOV VF bound to vfio-pci, passed through"
    }

    fn options_help(&self) -> &'static str {
        "host=DDDD:BB:DD.F   the device's PCI address (required)\n\
         bars=trap|mmap      BARs trapped, or offered for mmap where the kernel allows (trap)\n\
         irq=direct|relay    interrupts handed to the kernel, or relayed by a thread (direct)"
    }

    fn notes(&self) -> &'static str {
        "The device must be bound to vfio-pci (`switchyard inventory` lists the host's PCI \
         functions, `switchyard inventory bind BDF` binds one) and its IOMMU group viable. Its \
         DMA windows are pinned (RLIMIT_MEMLOCK unless CAP_IPC_LOCK); when the kernel wants \
         the device back, every access fails with ENODEV."
    }

    fn host_inventory(&self, host: &Host) -> Option<Result<HostInventory, String>> {
        Some(crate::inventory::functions(host))
    }

    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError> {
        Ok(Box::new(Self::config(options)?))
    }

    fn partition(&self, board: &KindOptions, _vram: u64, _queues: u32) -> KindOptions {
        board.clone()
    }

    /// The device exists, is bound to vfio-pci and its IOMMU group is viable; its identity
    /// is its `vendor:device` ids.
    fn probe(&self, options: &KindOptions, host: &Host) -> Result<Option<String>, String> {
        let c = Self::config(options).map_err(|e| e.to_string())?;
        let chain = |e: &dyn std::error::Error| {
            let mut s = e.to_string();
            let mut source = e.source();
            while let Some(cause) = source {
                s.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            s
        };
        let f = sysfs::check_openable(&host.sysfs, &c.host)
            .and_then(|_| sysfs::function(&host.sysfs, &c.host))
            .map_err(|e| chain(&e))?;
        tracing::info!(
            host = %c.host, vendor = format!("{:04x}", f.vendor),
            device = format!("{:04x}", f.device), group = ?f.iommu_group,
            "passthrough device usable"
        );
        Ok(Some(format!("{:04x}:{:04x}", f.vendor, f.device)))
    }
}

/// A passthrough device's configuration is what opens it.
impl KindConfig for VfioConfig {
    fn options(&self) -> KindOptions {
        VfioKind::options(self)
    }

    fn profile(&self) -> Profile {
        Profile {
            // What the hardware has, when its config space can be read (as root); else
            // assumed, which only refuses guest-visible unplugs it might not need to.
            msix: sysfs::has_msix(&Host::default().sysfs, &self.host).unwrap_or(true),
            dirty_log: DirtyLog::AllMapped,
            exclusive: Some(self.host.clone()),
            host_settings: vec!["irq".into()],
            // No memory or queues: the hardware's business, which requirements never pick.
            ..Profile::default()
        }
    }

    fn black_box_records(&self) -> Vec<RecordSpec> {
        vec![RecordSpec::new(RECORD, VfioPci::MIRROR_CAPACITY)]
    }

    fn build(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        Ok(Box::new(VfioKind::open(self, &b, false)?))
    }

    fn recover(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        if b.black_box.is_none() {
            return Err(KindError::NoRecovery("vfio"));
        }
        Ok(Box::new(VfioKind::open(self, &b, true)?))
    }
}

impl Recoverable for VfioPci {
    /// Nothing: the hardware is reset and the configuration replayed.
    fn held_objects(&self) -> Result<Vec<(String, File)>, DeviceError> {
        Ok(Vec::new())
    }
}

#[cfg(test)]
mod tests {
    use switchyard_device::kind::parse_kv;

    use super::*;

    /// The configuration of a command line's `k=v,...`, as `--device vfio,...` and a pool's
    /// board get it.
    fn config(s: &str) -> Result<VfioConfig, KindError> {
        VfioKind::config(&parse_kv(s)?)
    }

    #[test]
    fn options_parse_and_name_their_problem() {
        let c = config("host=0000:00:03.0").expect("parse");
        assert_eq!((c.host.as_str(), c.bars), ("0000:00:03.0", BarMode::Trap));
        let c = config("host=00:03.0,bars=mmap").expect("parse");
        assert_eq!((c.host.as_str(), c.bars), ("0000:00:03.0", BarMode::Mmap));
        assert_eq!(c.irq, IrqDelivery::Direct);
        let c = config("host=00:03.0,irq=relay").expect("parse");
        assert_eq!(c.irq, IrqDelivery::Relay);
        assert_eq!(
            VfioKind::config(&VfioKind::options(&c)).expect("canonical"),
            c
        );
        for (bad, field, needle) in [
            (
                "host=0000:00:03.0,irq=msi",
                Some("irq"),
                "`msi` is not `direct` or `relay`",
            ),
            ("", Some("host"), "required"),
            ("bars=mmap", Some("host"), "required"),
            (
                "host=0000:00:03.0,bars=fast",
                Some("bars"),
                "`fast` is not `trap` or `mmap`",
            ),
            (
                "host=0000:00:03.0,colour=red",
                Some("colour"),
                "unknown option",
            ),
            ("host", None, "`host` is not `name=value`"),
            (
                "host=zz:03.0",
                Some("host"),
                "`zz:03.0` is not a PCI address",
            ),
        ] {
            let e = config(bad).expect_err(bad);
            assert_eq!(e.field(), field, "{bad}: {e}");
            assert!(e.to_string().contains(needle), "{bad}: {e}");
        }
    }
}
