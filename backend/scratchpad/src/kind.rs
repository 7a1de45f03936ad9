//! The scratchpad as a device kind (`scratchpad`): its options, what a pool sees of it, and
//! how a worker builds or recovers one.

use switchyard_device::PciDevice;
use switchyard_device::blackbox::RecordSpec;
use switchyard_device::kind::{
    Build, DeviceKind, KindConfig, KindError, KindOptions, Profile, opt, pending_object,
};

use crate::device::check_size;
use crate::{DEFAULT_SIZE, RAM_OBJECT, RamIdentity, Scratchpad, ScratchpadError};

/// The scratchpad kind.
#[derive(Debug, Clone, Copy, Default)]
pub struct ScratchpadKind;

const OPTIONS: &[&str] = &["size"];

impl ScratchpadKind {
    /// The RAM size `options` ask for (unknown options refused, naming the first).
    pub fn size(options: &KindOptions) -> Result<u64, KindError> {
        opt::only(options, OPTIONS)?;
        let size = opt::size(options, "size")?.unwrap_or(DEFAULT_SIZE);
        check_size(size).map_err(|e| KindError::option("size", e.to_string()))?;
        Ok(size)
    }

    /// The canonical options of a scratchpad of `size` bytes.
    pub fn options(size: u64) -> KindOptions {
        let mut o = KindOptions::new();
        o.insert("size".into(), size.into());
        o
    }
}

fn build_error(e: ScratchpadError) -> KindError {
    KindError::build("scratchpad", e)
}

impl DeviceKind for ScratchpadKind {
    fn name(&self) -> &'static str {
        "scratchpad"
    }

    fn summary(&self) -> &'static str {
        "the smallest device kind, the template for new ones: an accumulator register (BAR0) and RAM (BAR2), both trapped"
    }

    fn options_help(&self) -> &'static str {
        "size=SIZE  RAM, a power of two from 4K to 64M (1M)"
    }

    fn memory_name(&self) -> &'static str {
        "ram"
    }

    /// The options parsed once: what builds, recovers and describes the devices.
    fn configure(&self, options: &KindOptions) -> Result<Box<dyn KindConfig>, KindError> {
        Ok(Box::new(ScratchpadConfig {
            size: Self::size(options)?,
        }))
    }

    /// Not partitionable ([`Profile::partitionable`] is false): a board is one device.
    fn partition(&self, board: &KindOptions, _vram: u64, _queues: u32) -> KindOptions {
        board.clone()
    }
}

/// A scratchpad's configuration ([`ScratchpadKind`]'s options, checked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScratchpadConfig {
    /// Its RAM, bytes.
    pub size: u64,
}

impl KindConfig for ScratchpadConfig {
    fn options(&self) -> KindOptions {
        ScratchpadKind::options(self.size)
    }

    fn profile(&self) -> Profile {
        Profile {
            memory: self.size,
            movable: true,
            ..Profile::default()
        }
    }

    fn black_box_records(&self) -> Vec<RecordSpec> {
        Scratchpad::black_box_records()
    }

    fn build(&self, b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        let pad = match &b.black_box {
            Some(bb) => Scratchpad::with_black_box(self.size, b.ctx, bb),
            None => Scratchpad::new(self.size, b.ctx),
        }
        .map_err(build_error)?;
        Ok(Box::new(pad))
    }

    /// A worker that died during a move leaves two RAMs in custody, the current one and
    /// the move's target (pending): the black box says which one the device ran on.
    fn recover(&self, mut b: Build) -> Result<Box<dyn PciDevice>, KindError> {
        let bb = b
            .black_box
            .clone()
            .ok_or(KindError::NoRecovery("scratchpad"))?;
        let saved = Scratchpad::black_box_ram(&bb).map_err(build_error)?;
        let pending = b.objects.remove(&pending_object(RAM_OBJECT));
        let current = b.objects.remove(RAM_OBJECT);
        let moved = pending
            .as_ref()
            .and_then(|f| RamIdentity::of(f).ok())
            .is_some_and(|p| p == saved);
        let ram = if moved { pending } else { current }
            .ok_or_else(|| KindError::MissingObject(RAM_OBJECT.into()))?;
        let pad = Scratchpad::recover(self.size, b.ctx, &bb, ram).map_err(build_error)?;
        tracing::info!(moved, "scratchpad recovered");
        Ok(Box::new(pad))
    }
}
