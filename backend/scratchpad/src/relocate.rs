//! Moving the device onto new RAM under its client (a pool's move to another board), and
//! the swap that completes it.
//!
//! Every write to the RAM passes through the device (BAR2 is never mmapped), which logs the
//! pages it wrote ([`Ram`]'s write log), so a copy can run while the client keeps writing:
//!
//! 1. [`Relocatable::begin_relocation`] creates the target RAM (a new sealed memfd) and
//!    clears the log; the worker puts the target in custody as pending.
//! 2. Pre-copy rounds ([`Relocation::round`]): the first copies the whole RAM, later ones the
//!    pages logged since the previous round. A page written during a round is logged after
//!    the write, so the next round copies it again.
//! 3. [`Relocation::successor`] builds the device on the target, parked (it runs nothing of
//!    its own anyway: the device works only when the slot calls it), and
//!    [`Relocatable::relocation_round`] on it catches up once more.
//! 4. The server's `DeviceSlot::swap`, with region accesses waiting for the slot: the old
//!    device checks the successor ([`Swappable::check_successor`]) and hands over
//!    ([`Swappable::hand_over`]): the pages logged since the last round, `ACCUM`, the config
//!    space, the black-box record (published at once with the target's identity), and the
//!    target becomes the slot's [`RAM_OBJECT`].
//!
//! A relocation dropped before the swap leaves the source as it was.

use std::sync::Arc;
use std::time::Instant;

use switchyard_device::{
    DeviceContext, DeviceError, PciDevice, Quiesce, QuiesceGuard, Relocatable, Relocation,
    RelocationStats, SuccessorFactory, Swappable,
};

use crate::ram::{Ram, RamCopy};
use crate::{RAM_OBJECT, Scratchpad, ScratchpadError};

/// A relocation under way ([`Relocatable::begin_relocation`]).
#[derive(Debug)]
struct Move {
    size: u64,
    copy: RamCopy,
}

impl Relocation for Move {
    fn targets(&self) -> Result<Vec<(String, std::fs::File)>, DeviceError> {
        Ok(vec![(
            RAM_OBJECT.to_owned(),
            self.copy.target.file().try_clone()?,
        )])
    }

    fn round(&mut self) -> Result<u64, DeviceError> {
        self.copy.round()
    }

    fn rounds(&self) -> u32 {
        self.copy.stats.rounds
    }

    fn successor(self: Box<Self>, ctx: DeviceContext) -> Result<Box<dyn PciDevice>, DeviceError> {
        let mut next = Scratchpad::on(self.size, ctx, self.copy.target.clone());
        next.incoming = Some(self.copy);
        Ok(Box::new(next))
    }
}

impl Relocatable for Scratchpad {
    /// `detached` changes nothing: no client maps the RAM, attached or not.
    fn begin_relocation(&self, _detached: bool) -> Result<Box<dyn Relocation>, DeviceError> {
        if self.retired || self.incoming.is_some() {
            return Err(ScratchpadError::Successor("this device is not serving").into());
        }
        let target = Arc::new(Ram::create(self.size)?);
        // From here on the log holds what changed since the first round started.
        self.ram.take_written();
        Ok(Box::new(Move {
            size: self.size,
            copy: RamCopy {
                source: self.ram.clone(),
                target,
                stats: RelocationStats::default(),
            },
        }))
    }

    fn relocation_round(&mut self) -> Result<u64, DeviceError> {
        match &mut self.incoming {
            Some(copy) => copy.round(),
            None => Ok(0),
        }
    }

    fn relocation_stats(&self) -> Option<RelocationStats> {
        self.relocated
    }
}

/// The park of a device without threads of its own: it works only when the server's slot
/// calls it, and the slot's lock already keeps every call out of a swap. Nothing to stop.
struct NoThreads;

impl Quiesce for NoThreads {
    fn park(&self) -> QuiesceGuard {
        QuiesceGuard::new(())
    }
}

impl Scratchpad {
    /// Whether `next` may take over from this device (see [`Swappable::check_successor`]).
    fn check_scratchpad_successor(&self, next: &Scratchpad) -> Result<(), &'static str> {
        if self.retired {
            return Err("this device was handed over already");
        }
        if next.retired {
            return Err("the successor was handed over already");
        }
        if next.size != self.size {
            return Err("another RAM size");
        }
        let here = self.ram.identity();
        let relocating_here = next
            .incoming
            .as_ref()
            .is_some_and(|c| c.source.identity() == here);
        if next.ram.identity() != here && !relocating_here {
            return Err("another RAM backing");
        }
        Ok(())
    }
}

impl Swappable for Scratchpad {
    fn quiesce(&self) -> Arc<dyn Quiesce> {
        Arc::new(NoThreads)
    }

    /// A scratchpad on the slot's RAM.
    fn successor(&self) -> SuccessorFactory {
        let size = self.size;
        Box::new(move |ctx: DeviceContext| {
            let ram = ctx
                .memory
                .get::<Ram>(RAM_OBJECT)
                .ok_or(ScratchpadError::Successor("the slot has no scratchpad RAM"))?;
            if ram.size() != size {
                return Err(ScratchpadError::Successor("the slot's RAM is of another size").into());
            }
            Ok(Box::new(Scratchpad::on(size, ctx, ram)) as Box<dyn PciDevice>)
        })
    }

    fn check_successor(&self, next: &dyn PciDevice) -> Result<(), &'static str> {
        let next = next
            .as_any()
            .downcast_ref::<Scratchpad>()
            .ok_or("another kind of device")?;
        self.check_scratchpad_successor(next)
    }

    fn hand_over(&mut self, next: &mut dyn PciDevice) -> Result<(), DeviceError> {
        let next = next
            .as_any_mut()
            .downcast_mut::<Scratchpad>()
            .ok_or(ScratchpadError::Successor("another kind of device"))?;
        self.check_scratchpad_successor(next)
            .map_err(ScratchpadError::Successor)?;
        // A relocation's last pages: nothing writes the source now (region accesses wait
        // for the slot).
        let finished = match &next.incoming {
            Some(copy) => {
                let t0 = Instant::now();
                let n = copy.copy_logged()?;
                let mut stats = copy.stats;
                stats.final_bytes = n;
                stats.bytes += n;
                stats.final_copy = t0.elapsed();
                Some(stats)
            }
            None => None,
        };
        // The record follows the state, published at once with the RAM the successor runs
        // on: a replacement of a worker killed from here on picks that RAM.
        let mut mirror = self.mirror.take();
        let published = crate::device::publish_state(
            &mut mirror,
            next.ram.identity(),
            self.accum,
            &self.config,
        );
        if let Err(e) = published {
            self.mirror = mirror;
            return Err(e.into());
        }
        next.mirror = mirror;
        next.accum = self.accum;
        next.config = self.config.clone();
        next.work = self.work;
        if let Some(stats) = finished {
            next.incoming = None;
            next.relocated = Some(stats);
            next.ctx.memory.insert(RAM_OBJECT, next.ram.clone());
        }
        self.retired = true;
        Ok(())
    }
}
