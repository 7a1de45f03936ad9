//! The softgpu as a device kind (`softgpu`): its options, and the capability groups a pool
//! daemon's worker uses (recovery from the black box, relocation, work counters).

use std::fs::File;
use std::sync::Arc;

use switchyard_device::blackbox::RecordSpec;
use switchyard_device::kind::{
    Build, DeviceKind, KindConfig, KindError, KindOptions, Profile, opt, pending_object,
};
use switchyard_device::{
    DeviceContext, DeviceError, PciDevice, Recoverable, Relocatable, Relocation, RelocationStats,
    Telemetry, WorkCounters,
};

use crate::{ConfigError, IrqMode, SoftGpu, SoftGpuConfig, SoftGpuError, VRAM_OBJECT, doorbell};

/// The softgpu kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct SoftGpuKind;

const OPTIONS: &[&str] = &["vram", "queues", "irq", "vram_mmap", "vram_reset", "spin"];

impl SoftGpuKind {
    /// The configuration `options` (as [`DeviceKind::check`] accepts them) describe: what
    /// [`DeviceKind::configure`] makes of them.
    pub fn config(options: &KindOptions) -> Result<SoftGpuConfig, KindError> {
        opt::only(options, OPTIONS)?;
        let mut c = SoftGpuConfig::default();
        if let Some(v) = opt::size(options, "vram")? {
            c.vram_size = v;
        }
        if let Some(q) = opt::u64(options, "queues")? {
            c.queues = u32::try_from(q).unwrap_or(u32::MAX);
        }
        if let Some(irq) = opt::str(options, "irq")? {
            c.irq = irq
                .parse()
                .map_err(|e: ConfigError| KindError::option("irq", e.to_string()))?;
        }
        if let Some(m) = opt::bool(options, "vram_mmap")? {
            c.vram_mmap = m;
        }
        if let Some(r) = opt::str(options, "vram_reset")? {
            c.keep_vram_on_reset = match r.to_ascii_lowercase().as_str() {
                "keep" => true,
                "zero" => false,
                _ => {
                    return Err(KindError::option(
                        "vram_reset",
                        format!("`{r}` is not `zero` or `keep`"),
                    ));
                }
            };
        }
        if let Some(s) = opt::u64(options, "spin")? {
            c.spin_us = u32::try_from(s).unwrap_or(u32::MAX);
        }
        c.validate().map_err(|e| {
            let field = match e {
                ConfigError::VramNotPowerOfTwo(_)
                | ConfigError::VramTooSmall(_)
                | ConfigError::VramTooLarge(_) => "vram",
                ConfigError::QueuesOutOfRange(_) => "queues",
                ConfigError::SpinTooLarge(_) => "spin",
                _ => "",
            };
            if field.is_empty() {
                KindError::Option {
                    field: None,
                    message: e.to_string(),
                }
            } else {
                KindError::option(field, e.to_string())
            }
        })?;
        Ok(c)
    }

    /// The canonical options of `config`.
    pub fn options(config: &SoftGpuConfig) -> KindOptions {
        let mut o = KindOptions::new();
        o.insert("vram".into(), config.vram_size.into());
        o.insert("queues".into(), config.queues.into());
        o.insert("irq".into(), config.irq.as_str().into());
        o.insert("vram_mmap".into(), config.vram_mmap.into());
        let reset = if config.keep_vram_on_reset {
            "keep"
        } else {
            "zero"
        };
        o.insert("vram_reset".into(), reset.into());
        o.insert("spin".into(), config.spin_us.into());
        o
    }
}

fn build_error(e: SoftGpuError) -> KindError {
    KindError::build("softgpu", e)
}

impl DeviceKind for SoftGpuKind {
    fn name(&self) -> &'static str {
        "softgpu"
    }

    fn summary(&self) -> &'static str {
        "Switchyard's software GPU: command queues run FILL/COPY/SAXPY/GEMM/REDUCE on CPU threads, VRAM is a memfd"
    }

    fn options_help(&self) -> &'static str {
        "vram=SIZE         VRAM, a power of two from 1M to 64G (64M)\n\
         queues=N          command queues, 1 to 8 (2)\n\
         irq=msix|msi      interrupt mode (msix)\n\
         vram_mmap=on|off  whether the guest may mmap VRAM (on)\n\
         vram_reset=zero|keep  what resets do to VRAM (zero)\n\
         spin=US           longest an engine polls for work before sleeping, 0 to 10000 (200)"
    }

    fn memory_name(&self) -> &'static str {
        "vram"
    }

    fn notes(&self) -> &'static str {
        "irq=msi (one MSI vector, no MSI-X) is for PCIe hot-unplug under QEMU 11.1, whose \
         vfio-user-pci aborts when removing a device with MSI-X.\n\
         vram_mmap=off traps VRAM so the device sees every write: a move is transparent to the \
         guest (a mapped VRAM moves guest-visibly, through the VMM)."
    }

    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError> {
        Ok(Box::new(Self::config(options)?))
    }
}

/// A softgpu's configuration is its kind's: what [`SoftGpuKind::config`] parses.
impl KindConfig for SoftGpuConfig {
    fn options(&self) -> KindOptions {
        SoftGpuKind::options(self)
    }

    fn profile(&self) -> Profile {
        Profile {
            memory: self.vram_size,
            queues: self.queues,
            partitionable: true,
            movable: true,
            msix: self.irq == IrqMode::Msix,
            host_settings: vec!["spin".into()],
            client_maps_memory: self.vram_mmap,
            presents: Some("softgpu".into()),
            ..Profile::default()
        }
    }

    fn black_box_records(&self) -> Vec<RecordSpec> {
        SoftGpu::black_box_records(self)
    }

    fn build(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        Ok(Box::new(SoftGpuKind::build_device(*self, b)?))
    }

    fn recover(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        Ok(Box::new(SoftGpuKind::recover_device(*self, b)?))
    }
}

impl SoftGpuKind {
    /// [`KindConfig::build`] of a device of `c` (for kinds built on the softgpu's device,
    /// such as the `cuda` board's).
    pub fn build_device(c: SoftGpuConfig, b: Build) -> Result<SoftGpu, KindError> {
        let gpu = match &b.black_box {
            Some(bb) => SoftGpu::with_black_box(c, b.ctx, bb, None),
            None => SoftGpu::new(c, b.ctx),
        }
        .map_err(build_error)?;
        Ok(gpu.with_failure_hook(b.failed))
    }

    /// [`KindConfig::recover`] of a device of `c`. Two VRAMs are held when the last worker
    /// died during a move (the target as pending): the black box says which one the device
    /// ran on.
    pub fn recover_device(c: SoftGpuConfig, mut b: Build) -> Result<SoftGpu, KindError> {
        let bb = b
            .black_box
            .clone()
            .ok_or(KindError::NoRecovery("softgpu"))?;
        let saved = SoftGpu::black_box_vram(&c, &bb).map_err(build_error)?;
        let pending = b.objects.remove(&pending_object(VRAM_OBJECT));
        let current = b.objects.remove(VRAM_OBJECT);
        let moved = pending.as_ref().and_then(|f| crate::VramRef::of(f).ok()) == Some(saved);
        let vram = if moved { pending } else { current }
            .ok_or_else(|| KindError::MissingObject(VRAM_OBJECT.into()))?;
        // Workers from before the doorbell page kept none: the device makes a new one.
        let doorbells = b.objects.remove(doorbell::DOORBELL_OBJECT);
        let (gpu, recovery) =
            SoftGpu::recover(c, b.ctx, &bb, vram, doorbells).map_err(build_error)?;
        tracing::info!(queues = ?recovery.queues, resent_interrupts = recovery.resent, moved, "device recovered");
        Ok(gpu.with_failure_hook(b.failed))
    }
}

fn device_error(e: SoftGpuError) -> DeviceError {
    DeviceError::Failed(Box::new(e))
}

impl Recoverable for SoftGpu {
    fn held_objects(&self) -> Result<Vec<(String, File)>, DeviceError> {
        Ok(vec![
            (
                VRAM_OBJECT.to_owned(),
                self.vram_memfd().map_err(device_error)?,
            ),
            (
                doorbell::DOORBELL_OBJECT.to_owned(),
                self.doorbell_memfd().map_err(device_error)?,
            ),
        ])
    }
}

impl Telemetry for SoftGpu {
    fn work(&self) -> WorkCounters {
        let w = self.work_stats();
        WorkCounters {
            commands: w.commands,
            bytes: w.bytes,
            errors: w.errors,
            replayed: w.replayed,
            interrupted: w.interrupted,
        }
    }
}

impl Relocatable for SoftGpu {
    fn begin_relocation(&self, detached: bool) -> Result<Box<dyn Relocation>, DeviceError> {
        let config = self.config();
        let target = SoftGpu::create_vram(&config).map_err(device_error)?;
        let held = target.try_clone()?;
        let relocation = if detached {
            self.begin_detached_relocation(target)
        } else {
            SoftGpu::begin_relocation(self, target)
        }
        .map_err(device_error)?;
        Ok(Box::new(Move {
            config,
            relocation,
            target: Arc::new(held),
        }))
    }

    fn relocation_round(&mut self) -> Result<u64, DeviceError> {
        SoftGpu::relocation_round(self).map_err(device_error)
    }

    fn relocation_stats(&self) -> Option<RelocationStats> {
        SoftGpu::relocation_stats(self).map(|s| RelocationStats {
            rounds: s.rounds,
            bytes: s.bytes,
            last_round_bytes: s.last_round_bytes,
            final_bytes: s.final_bytes,
            final_copy: s.final_copy,
        })
    }
}

/// A softgpu's relocation onto a new VRAM memfd.
#[derive(Debug)]
struct Move {
    config: SoftGpuConfig,
    relocation: crate::Relocation,
    target: Arc<File>,
}

impl Relocation for Move {
    fn targets(&self) -> Result<Vec<(String, File)>, DeviceError> {
        Ok(vec![(VRAM_OBJECT.to_owned(), self.target.try_clone()?)])
    }

    fn round(&mut self) -> Result<u64, DeviceError> {
        self.relocation.round().map_err(device_error)
    }

    fn rounds(&self) -> u32 {
        self.relocation.stats().rounds
    }

    fn successor(self: Box<Self>, ctx: DeviceContext) -> Result<Box<dyn PciDevice>, DeviceError> {
        let next = SoftGpu::relocated(self.config, ctx, self.relocation).map_err(device_error)?;
        Ok(Box::new(next))
    }
}

#[cfg(test)]
mod tests {
    use switchyard_device::kind::parse_kv;

    use super::*;

    /// The configuration of a command line's `k=v,...`, as `--device softgpu,...` and a pool's
    /// board get it.
    fn config(s: &str) -> Result<SoftGpuConfig, KindError> {
        SoftGpuKind::config(&parse_kv(s)?)
    }

    #[test]
    fn options_parse_into_the_configuration_and_omitted_ones_keep_defaults() {
        assert_eq!(config("").expect("empty"), SoftGpuConfig::default());
        let c = config("vram=64M,queues=2").expect("full");
        assert_eq!((c.vram_size, c.queues), (64 << 20, 2));
        assert_eq!(config("spin=0").expect("spin").spin_us, 0);
        let c = config("spin=10000").expect("largest spin");
        assert_eq!(c.spin_us, SoftGpuConfig::MAX_SPIN_US);
        assert!(c.same_device(&SoftGpuConfig::default()));
        let c = config("queues=8, vram=1g").expect("spaces");
        assert_eq!((c.vram_size, c.queues), (1 << 30, 8));
        assert_eq!(config("vram=2048K").expect("K").vram_size, 2 << 20);
        assert_eq!(config("vram=2MiB").expect("MiB").vram_size, 2 << 20);
        let c = config("vram=1048576,").expect("bytes");
        assert_eq!(c.vram_size, 1 << 20);
        assert_eq!(c.irq, IrqMode::Msix, "MSI-X by default");
        assert!(c.vram_mmap, "VRAM mappable by default");
        assert!(!c.keep_vram_on_reset, "VRAM zeroed on reset by default");
        let c = config("vram_mmap=off,vram=4M").expect("mmap off");
        assert!(!c.vram_mmap && c.vram_size == 4 << 20);
        let c = config("irq=msi").expect("msi");
        assert_eq!(c.irq_counts(), [0, 1, 0, 1, 1]);
        let c = config("queues=1, irq = MSI ").expect("case, spaces");
        assert_eq!((c.irq, c.queues), (IrqMode::Msi, 1));
        assert!(config("vram_reset=KEEP").expect("keep").keep_vram_on_reset);
        assert!(!config("vram_reset=zero").expect("zero").keep_vram_on_reset);
    }

    #[test]
    fn canonical_options_give_back_the_same_configuration() {
        let c = config("vram=8M,queues=3,irq=msi,vram_mmap=off,vram_reset=keep,spin=7")
            .expect("parses");
        assert_eq!(
            SoftGpuKind::config(&SoftGpuKind::options(&c)).expect("canonical"),
            c
        );
    }

    #[test]
    fn refused_options_name_the_option_in_a_sentence() {
        let cases: &[(&str, Option<&str>, &str)] = &[
            ("colour=red", Some("colour"), "unknown option; known: vram"),
            ("vram", None, "`vram` is not `name=value`"),
            ("queues=1,queues=2", Some("queues"), "given twice"),
            ("vram=12X", Some("vram"), "Invalid size `12X`"),
            ("vram=-1M", Some("vram"), "Invalid size `-1M`"),
            ("vram=99999999999G", Some("vram"), "too large"),
            ("queues=two", Some("queues"), "`two` is not a whole number"),
            ("queues=", Some("queues"), "`` is not a whole number"),
            ("irq=intx", Some("irq"), "Invalid interrupt mode `intx`"),
            ("irq=msi-x", Some("irq"), "Invalid interrupt mode `msi-x`"),
            ("vram=3M", Some("vram"), "is not a power of two"),
            ("vram=512K", Some("vram"), "below the minimum of 1 MiB"),
            ("vram=128G", Some("vram"), "exceeds the maximum of 64 GiB"),
            (
                "queues=0",
                Some("queues"),
                "outside the supported range 1 to 8",
            ),
            (
                "queues=9",
                Some("queues"),
                "outside the supported range 1 to 8",
            ),
            ("spin=fast", Some("spin"), "`fast` is not a whole number"),
            ("spin=-1", Some("spin"), "`-1` is not a whole number"),
            ("spin=10001", Some("spin"), "exceeds the maximum of 10000"),
            (
                "vram_mmap=maybe",
                Some("vram_mmap"),
                "`maybe` is not on/off",
            ),
            (
                "vram_reset=maybe",
                Some("vram_reset"),
                "`maybe` is not `zero` or `keep`",
            ),
        ];
        for &(input, field, want) in cases {
            let e = config(input).expect_err(input);
            assert_eq!(e.field(), field, "{input}: {e}");
            let msg = e.to_string();
            assert!(msg.contains(want), "{input}: {msg}");
            assert!(msg.starts_with("Invalid "), "sentence case: {msg}");
        }
    }
}
