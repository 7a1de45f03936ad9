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
