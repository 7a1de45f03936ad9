//! Interrupts: DEVICE_GET_IRQ_INFO, and DEVICE_SET_IRQS (eventfds set in the interrupt
//! table, or handed to a device that routes its interrupts itself; triggers; masks).

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};

use switchyard_device::ratelimit::LogLimiter;
use switchyard_device::{DeviceError, Interrupts, IrqIndex, PciDevice};
use switchyard_proto::consts::*;
use switchyard_proto::{IrqAction, IrqData, IrqInfo, Reply, SetIrqs};

use super::{Dispatcher, reply_empty};
use crate::error::{RequestError, invalid};

impl Dispatcher {
    /// DEVICE_GET_IRQ_INFO.
    pub(super) fn device_get_irq_info(
        &mut self,
        dev: &dyn PciDevice,
        id: u16,
        index: u32,
    ) -> Result<(), RequestError> {
        let d = dev.description();
        let irq = d
            .irqs
            .get(index as usize)
            .ok_or_else(|| invalid("no such interrupt index"))?;
        let mut flags = 0;
        if irq.eventfd {
            flags |= VFIO_IRQ_INFO_EVENTFD;
        }
        if irq.maskable {
            flags |= VFIO_IRQ_INFO_MASKABLE;
        }
        if irq.automasked {
            flags |= VFIO_IRQ_INFO_AUTOMASKED;
        }
        if irq.noresize {
            flags |= VFIO_IRQ_INFO_NORESIZE;
        }
        let info = IrqInfo {
            argsz: IrqInfo::SIZE as u32,
            flags,
            index,
            count: irq.count,
        };
        Reply::DeviceGetIrqInfo(info).encode(id, &mut self.out)?;
        Ok(())
    }

    /// DEVICE_SET_IRQS, with the eventfds in `fds` (custody ids in `fd_ids`); the tables a
    /// replacement needs are published, then the device is told.
    pub(super) fn device_set_irqs(
        &mut self,
        dev: &mut dyn PciDevice,
        irqs: &Interrupts,
        id: u16,
        set: SetIrqs<'_>,
        fds: Vec<OwnedFd>,
        fd_ids: &[u64],
    ) -> Result<(), RequestError> {
        let eventfds = matches!(
            (set.action, set.data),
            (IrqAction::Trigger, IrqData::Eventfd)
        );
        let disable = set.count == 0;
        set_irqs(dev, irqs, set, fds, &self.bad_irq_fds)?;
        if let Some(c) = &self.continuity {
            if disable {
                c.irqs_disabled(set.index);
            } else if eventfds {
                let ids: Vec<Option<u64>> = if fd_ids.is_empty() {
                    vec![None; set.count as usize]
                } else {
                    fd_ids.iter().copied().map(Some).collect()
                };
                c.irqs_set(set.index, set.start, &ids);
            }
        }
        dev.irqs_changed(set.index);
        reply_empty(&mut self.out, id, Reply::DeviceSetIrqs)
    }
}

/// What `/proc/self/fd/N` links to for an eventfd: the kernel's name for its anonymous inode
/// (what lsof shows). A real file links to an absolute path and a pipe or socket to
/// `pipe:[ino]`/`socket:[ino]`, so no other file can pose as one.
const EVENTFD_LINK: &str = "anon_inode:[eventfd]";

/// What `fd` is, as procfs names it (compare with [`EVENTFD_LINK`]).
fn fd_kind(fd: &OwnedFd) -> std::io::Result<std::path::PathBuf> {
    std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

fn set_irqs(
    dev: &mut dyn PciDevice,
    irqs: &Interrupts,
    set: SetIrqs<'_>,
    fds: Vec<OwnedFd>,
    bad_fds: &LogLimiter,
) -> Result<(), RequestError> {
    let d = dev.description();
    let irq = d
        .irqs
        .get(set.index as usize)
        .ok_or_else(|| invalid("no such interrupt index"))?;
    let in_range = set
        .start
        .checked_add(set.count)
        .is_some_and(|e| e <= irq.count);
    if set.count == 0 {
        // Only "disable everything" is meaningful with no vectors.
        if matches!((set.action, set.data), (IrqAction::Trigger, IrqData::None)) && set.start == 0 {
            // A device that delivers its interrupts itself gives every vector back first (a
            // physical device's kernel would otherwise keep signalling the client's eventfds).
            let count = irq.count as usize;
            if count > 0
                && let Some(router) = dev.irq_router()
            {
                let none: Vec<Option<&File>> = vec![None; count];
                router.route(set.index, 0, &none)?;
            }
            irqs.disable(set.index).map_err(DeviceError::from)?;
            tracing::debug!(index = set.index, "interrupts disabled");
            return Ok(());
        }
        return Err(invalid(
            "zero-count SET_IRQS must be TRIGGER|DATA_NONE at start 0",
        ));
    }
    if !in_range {
        return Err(invalid("interrupt vectors out of range"));
    }
    match (set.action, set.data) {
        (IrqAction::Trigger, IrqData::Eventfd) => {
            let files: Vec<Option<File>> = if fds.is_empty() {
                (0..set.count).map(|_| None).collect()
            } else {
                if fds.len() != set.count as usize {
                    return Err(invalid("eventfd count does not match vector count"));
                }
                // Only eventfds: anything else (a pipe, /dev/null, a file) would have the
                // device write into it, and may block or fail on every interrupt. Every fd is
                // checked before any vector changes. Their flags stay as the client set them
                // (`Interrupts` never blocks on a blocking eventfd).
                for (i, fd) in (set.start..).zip(&fds) {
                    let kind = fd_kind(fd);
                    if !kind.as_ref().is_ok_and(|k| k.as_os_str() == EVENTFD_LINK) {
                        if bad_fds.allow() {
                            let cause = match &kind {
                                Ok(k) => format!("the file is {}", k.display()),
                                Err(e) => format!("cannot tell what the file is: {e}"),
                            };
                            tracing::warn!(
                                index = set.index,
                                vector = i,
                                cause,
                                "SET_IRQS refused a file that is not an eventfd"
                            );
                        }
                        return Err(invalid("interrupt file descriptor is not an eventfd"));
                    }
                }
                fds.into_iter().map(|fd| Some(File::from(fd))).collect()
            };
            // A device that delivers its interrupts itself gets them first: if it refuses,
            // nothing has changed. The server keeps its own copy for a successor.
            if let Some(router) = dev.irq_router() {
                let refs: Vec<Option<&File>> = files.iter().map(Option::as_ref).collect();
                router.route(set.index, set.start, &refs)?;
            }
            irqs.set_triggers(set.index, set.start, files)
                .map_err(DeviceError::from)?;
            tracing::debug!(
                index = set.index,
                start = set.start,
                count = set.count,
                "eventfds set"
            );
        }
        (IrqAction::Trigger, IrqData::None) => {
            let index =
                IrqIndex::from_raw(set.index).ok_or_else(|| invalid("no such interrupt index"))?;
            for v in set.start..set.start + set.count {
                irqs.trigger(index, v).map_err(DeviceError::from)?;
            }
        }
        (IrqAction::Trigger, IrqData::Bool(bools)) => {
            let index =
                IrqIndex::from_raw(set.index).ok_or_else(|| invalid("no such interrupt index"))?;
            for (v, &b) in (set.start..set.start + set.count).zip(bools) {
                if b != 0 {
                    irqs.trigger(index, v).map_err(DeviceError::from)?;
                }
            }
        }
        (IrqAction::Mask | IrqAction::Unmask, IrqData::None) => {
            let masked = set.action == IrqAction::Mask;
            irqs.set_masked(set.index, set.start, set.count, masked, None)
                .map_err(DeviceError::from)?;
        }
        (IrqAction::Mask | IrqAction::Unmask, IrqData::Bool(bools)) => {
            let masked = set.action == IrqAction::Mask;
            irqs.set_masked(set.index, set.start, set.count, masked, Some(bools))
                .map_err(DeviceError::from)?;
        }
        (IrqAction::Mask | IrqAction::Unmask, IrqData::Eventfd) => {
            return Err(RequestError::Invalid {
                what: "mask/unmask eventfds are not supported",
                errno: libc::ENOTSUP,
            });
        }
    }
    Ok(())
}
