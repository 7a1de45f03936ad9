//! Interrupts: the client's eventfds handed to the kernel, and the MSI-X table the client sees.
//!
//! The kernel signals an eventfd per vector itself (`VFIO_DEVICE_SET_IRQS`), so an interrupt
//! goes device → host kernel → the client's eventfd without the server. MSI-X masking: a
//! vector the client masks in its (emulated) table, or all of them under the function mask,
//! has its kernel eventfd swapped for one of ours ("parked"); what arrives there is the
//! vector's pending bit, and it is delivered to the client's eventfd when the vector is
//! unmasked. As the core's `MsixState` does, masks apply only once the client writes the table
//! itself: QEMU and cloud-hypervisor emulate the table on their side and mask by re-routing
//! eventfds through `SET_IRQS`.
//!
//! [`IrqDelivery::Relay`] (`irq=relay`, for comparison and for clients whose eventfds cannot be
//! given to the kernel) hands the kernel the server's own eventfds instead and a relay thread
//! signals the client's: one more thread wake-up per interrupt (`scripts/bench-nested.sh`
//! measures both).

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::IrqDelivery;

use switchyard_device::{DeviceError, IrqIndex};
use vfio_ioctls::VfioDevice;

/// The client's MSI-X table, emulated (the kernel does not let us touch the real one).
#[derive(Debug, Clone)]
pub(crate) struct MsixTable {
    /// Per vector: address low, address high, data, vector control.
    entries: Vec<[u32; 4]>,
    /// The client has written the table, so its masks apply.
    written: bool,
}

impl MsixTable {
    pub(crate) fn new(vectors: u32) -> MsixTable {
        MsixTable {
            entries: vec![[0, 0, 0, 1]; vectors as usize],
            written: false,
        }
    }

    /// Whether the client has written the table.
    pub(crate) fn written(&self) -> bool {
        self.written
    }

    pub(crate) fn read(&self, offset: u64, buf: &mut [u8]) {
        for (i, b) in buf.iter_mut().enumerate() {
            let o = offset + i as u64;
            *b = self.entries.get((o / 16) as usize).map_or(0, |e| {
                e[((o % 16) / 4) as usize].to_le_bytes()[(o % 4) as usize]
            });
        }
    }

    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) {
        for (i, &v) in data.iter().enumerate() {
            let o = offset + i as u64;
            if let Some(e) = self.entries.get_mut((o / 16) as usize) {
                self.written = true;
                let w = ((o % 16) / 4) as usize;
                let mut bytes = e[w].to_le_bytes();
                bytes[(o % 4) as usize] = v;
                e[w] = u32::from_le_bytes(bytes);
                e[0] &= !3;
                e[3] &= 1;
            }
        }
    }

    /// Whether `vector` is masked, given the function mask.
    pub(crate) fn masked(&self, vector: usize, function_masked: bool) -> bool {
        self.written && (function_masked || self.entries.get(vector).is_none_or(|e| e[3] & 1 != 0))
    }
}

fn slot(index: u32) -> Option<usize> {
    match IrqIndex::from_raw(index) {
        Some(IrqIndex::Msi) => Some(0),
        Some(IrqIndex::Msix) => Some(1),
        _ => None,
    }
}

/// The eventfds the kernel signals, per index, and the MSI-X parking.
pub(crate) struct Router {
    device: Arc<VfioDevice>,
    /// Vectors of MSI and MSI-X.
    counts: [u32; 2],
    /// The client's eventfds (our duplicates).
    client: [Vec<Option<File>>; 2],
    /// Vectors enabled in the kernel (0: the index is off).
    enabled: [u32; 2],
    /// MSI-X: our eventfd per vector, where a masked vector is parked.
    parked: Vec<Option<File>>,
    /// MSI-X: the masks applied now.
    masked: Vec<bool>,
    /// MSI-X: a parked vector fired.
    pending: Vec<bool>,
    /// `irq=relay`: the server's eventfds and the thread that forwards them.
    relay: Option<Relay>,
}

/// The client's eventfds, as the relay thread sees them.
type Targets = Arc<Mutex<[Vec<Option<File>>; 2]>>;

/// `irq=relay`: the kernel signals `ours[slot][vector]`; a thread forwards each to the
/// client's eventfd for that vector.
struct Relay {
    ours: [Vec<File>; 2],
    targets: Targets,
    stop: File,
    thread: Option<JoinHandle<()>>,
}

fn new_eventfd() -> io::Result<File> {
    Ok(File::from(rustix::event::eventfd(
        0,
        rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
    )?))
}

impl Relay {
    fn start(counts: [u32; 2]) -> io::Result<Relay> {
        let ours = [
            (0..counts[0])
                .map(|_| new_eventfd())
                .collect::<io::Result<Vec<_>>>()?,
            (0..counts[1])
                .map(|_| new_eventfd())
                .collect::<io::Result<Vec<_>>>()?,
        ];
        let targets: Targets = Arc::new(Mutex::new([
            (0..counts[0]).map(|_| None).collect(),
            (0..counts[1]).map(|_| None).collect(),
        ]));
        let stop = new_eventfd()?;
        let watch: Vec<(usize, usize, File)> = ours
            .iter()
            .enumerate()
            .flat_map(|(s, v)| v.iter().enumerate().map(move |(i, f)| (s, i, f)))
            .map(|(s, i, f)| f.try_clone().map(|f| (s, i, f)))
            .collect::<io::Result<_>>()?;
        let stop_r = stop.try_clone()?;
        let t = Arc::clone(&targets);
        let thread = std::thread::Builder::new()
            .name("vfio-irq-relay".into())
            .spawn(move || relay_loop(&watch, &stop_r, &t))?;
        tracing::info!(
            vectors = counts[0] + counts[1],
            "interrupts relayed by a server thread (irq=relay)"
        );
        Ok(Relay {
            ours,
            targets,
            stop,
            thread: Some(thread),
        })
    }
}

fn relay_loop(watch: &[(usize, usize, File)], stop: &File, targets: &Targets) {
    use rustix::event::{PollFd, PollFlags, poll};
    loop {
        let mut fds: Vec<PollFd<'_>> = watch
            .iter()
            .map(|(_, _, f)| PollFd::new(f, PollFlags::IN))
            .collect();
        fds.push(PollFd::new(stop, PollFlags::IN));
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::warn!(error = %e, "interrupt relay stops");
                return;
            }
        }
        if fds.last().is_some_and(|f| !f.revents().is_empty()) {
            return;
        }
        let ready: Vec<usize> = fds[..watch.len()]
            .iter()
            .enumerate()
            .filter(|(_, f)| !f.revents().is_empty())
            .map(|(i, _)| i)
            .collect();
        let t = targets.lock().unwrap_or_else(|e| e.into_inner());
        for i in ready {
            let (s, v, f) = &watch[i];
            if drain(f)
                && let Some(Some(c)) = t[*s].get(*v)
            {
                signal(c);
            }
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = (&self.stop).write_all(&1u64.to_ne_bytes());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("counts", &self.counts)
            .field("enabled", &self.enabled)
            .finish_non_exhaustive()
    }
}

fn irq_error(index: u32, e: io::Error) -> DeviceError {
    tracing::warn!(index, error = %e, "VFIO_DEVICE_SET_IRQS failed");
    DeviceError::Io(e)
}

/// Reads an eventfd's counter without blocking: whether it had fired.
fn drain(fd: &File) -> bool {
    let mut b = [0u8; 8];
    matches!((&*fd).read(&mut b), Ok(8))
}

fn signal(fd: &File) {
    if let Err(e) = (&*fd).write_all(&1u64.to_ne_bytes()) {
        tracing::debug!(error = %e, "cannot signal the client's eventfd");
    }
}

impl Router {
    pub(crate) fn new(
        device: Arc<VfioDevice>,
        msi: u32,
        msix: u32,
        delivery: IrqDelivery,
    ) -> io::Result<Router> {
        let relay = match delivery {
            IrqDelivery::Direct => None,
            IrqDelivery::Relay => Some(Relay::start([msi, msix])?),
        };
        Ok(Router {
            relay,
            device,
            counts: [msi, msix],
            client: [
                (0..msi).map(|_| None).collect(),
                (0..msix).map(|_| None).collect(),
            ],
            enabled: [0, 0],
            parked: (0..msix).map(|_| None).collect(),
            masked: vec![false; msix as usize],
            pending: vec![false; msix as usize],
        })
    }

    /// The eventfd the kernel should signal for vector `v` of slot `s`.
    fn effective(&self, s: usize, v: usize) -> Option<BorrowedFd<'_>> {
        let client = self.client[s].get(v)?.as_ref()?;
        if s == 1 && self.masked.get(v).copied().unwrap_or(false) {
            return self.parked.get(v)?.as_ref().map(|f| f.as_fd());
        }
        if let Some(r) = &self.relay {
            return r.ours[s].get(v).map(|f| f.as_fd());
        }
        Some(client.as_fd())
    }

    /// Hands the vectors `start..start+len` of slot `s` to the kernel as they should be now,
    /// enabling (or re-enabling with more vectors, or disabling) the index as needed.
    fn program(&mut self, s: usize, start: usize, len: usize) -> io::Result<()> {
        let index = if s == 0 {
            IrqIndex::Msi as u32
        } else {
            IrqIndex::Msix as u32
        };
        let needed = self.client[s]
            .iter()
            .rposition(Option::is_some)
            .map_or(0, |i| i + 1);
        if needed == 0 {
            if self.enabled[s] > 0 {
                switchyard_sys::disable_irq(&self.device, index)?;
                self.enabled[s] = 0;
                tracing::debug!(index, "interrupt index disabled in the kernel");
            }
            return Ok(());
        }
        if self.enabled[s] as usize >= needed {
            let end = (start + len).min(self.enabled[s] as usize);
            if start < end {
                let fds: Vec<_> = (start..end).map(|v| self.effective(s, v)).collect();
                switchyard_sys::set_irq_eventfds(&self.device, index, start as u32, &fds)?;
            }
            return Ok(());
        }
        // More vectors than the kernel has enabled (or none yet): enable them all at once.
        if self.enabled[s] > 0 {
            switchyard_sys::disable_irq(&self.device, index)?;
            self.enabled[s] = 0;
        }
        let fds: Vec<_> = (0..needed).map(|v| self.effective(s, v)).collect();
        switchyard_sys::set_irq_eventfds(&self.device, index, 0, &fds)?;
        self.enabled[s] = needed as u32;
        tracing::debug!(
            index,
            vectors = needed,
            "interrupt index enabled in the kernel"
        );
        Ok(())
    }

    /// `SET_IRQS` from the client: its eventfds for `start..start+fds.len()` of `index`.
    pub(crate) fn route(
        &mut self,
        index: u32,
        start: u32,
        fds: &[Option<&File>],
    ) -> switchyard_device::Result<()> {
        let Some(s) = slot(index) else {
            // INTx, ERR and REQ are not offered: the server refuses them before they get here
            // (their count is 0), this is the backstop.
            return Err(DeviceError::Unsupported);
        };
        let start = start as usize;
        if start + fds.len() > self.counts[s] as usize {
            return Err(DeviceError::Io(io::Error::from_raw_os_error(libc::EINVAL)));
        }
        let mut dups = Vec::with_capacity(fds.len());
        for f in fds {
            dups.push(f.map(File::try_clone).transpose()?);
        }
        let old: Vec<Option<File>> = self.client[s]
            .splice(start..start + fds.len(), dups)
            .collect();
        if let Err(e) = self.program(s, start, fds.len()) {
            // Put the table back as the kernel still has it.
            self.client[s].splice(start..start + fds.len(), old);
            return Err(irq_error(index, e));
        }
        self.sync_relay(s);
        tracing::debug!(
            index,
            start,
            count = fds.len(),
            set = fds.iter().filter(|f| f.is_some()).count(),
            "eventfds handed to the kernel"
        );
        Ok(())
    }

    /// Applies the MSI-X masks of `table` (and the function mask): newly masked vectors are
    /// parked, newly unmasked ones get the client's eventfd back, plus one signal if they fired
    /// while parked.
    pub(crate) fn apply_msix_masks(
        &mut self,
        table: &MsixTable,
        function_masked: bool,
    ) -> io::Result<()> {
        for v in 0..self.masked.len() {
            let m = table.masked(v, function_masked);
            if self.masked[v] == m {
                continue;
            }
            if m && self.parked[v].is_none() {
                let fd = rustix::event::eventfd(
                    0,
                    rustix::event::EventfdFlags::CLOEXEC | rustix::event::EventfdFlags::NONBLOCK,
                )?;
                self.parked[v] = Some(File::from(fd));
            }
            self.masked[v] = m;
            if (v as u32) < self.enabled[1] {
                self.program(1, v, 1)?;
            }
            if !m {
                let fired = self.parked[v].as_ref().is_some_and(drain);
                if (fired || self.pending[v])
                    && let Some(Some(c)) = self.client[1].get(v)
                {
                    signal(c);
                }
                self.pending[v] = false;
            }
        }
        Ok(())
    }

    /// MSI-X: whether vector `v` is pending (fired while masked).
    pub(crate) fn msix_pending(&mut self, v: usize) -> bool {
        if self.masked.get(v).copied().unwrap_or(false)
            && self.parked[v].as_ref().is_some_and(drain)
        {
            self.pending[v] = true;
        }
        self.pending.get(v).copied().unwrap_or(false)
    }

    /// `irq=relay`: the relay thread's copy of the client's eventfds of slot `s`.
    fn sync_relay(&self, s: usize) {
        if let Some(r) = &self.relay {
            let mut t = r.targets.lock().unwrap_or_else(|e| e.into_inner());
            t[s] = self.client[s]
                .iter()
                .map(|f| f.as_ref().and_then(|f| f.try_clone().ok()))
                .collect();
        }
    }

    /// Takes every eventfd back from the kernel (client gone, device closed).
    pub(crate) fn disable_all(&mut self) {
        for s in 0..2 {
            self.client[s].iter_mut().for_each(|f| *f = None);
            if let Err(e) = self.program(s, 0, 0) {
                tracing::warn!(error = %e, "cannot disable the device's interrupts");
            }
            self.sync_relay(s);
        }
        self.pending.iter_mut().for_each(|p| *p = false);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_masks_apply_once_written() {
        let mut t = MsixTable::new(4);
        let masks = |t: &MsixTable, f| (0..4).map(|v| t.masked(v, f)).collect::<Vec<_>>();
        assert_eq!(masks(&t, true), [false; 4], "not written: nothing masked");
        t.write(16 + 12, &[0, 0, 0, 0]);
        assert_eq!(masks(&t, false), [true, false, true, true]);
        assert_eq!(masks(&t, true), [true; 4]);
        assert!(t.masked(9, false), "past the table: masked");
        t.write(0, &0xfee0_0003u32.to_le_bytes());
        let mut b = [0u8; 4];
        t.read(0, &mut b);
        assert_eq!(
            u32::from_le_bytes(b),
            0xfee0_0000,
            "reserved address bits stay 0"
        );
        t.write(12, &0xffff_ffffu32.to_le_bytes());
        t.read(12, &mut b);
        assert_eq!(u32::from_le_bytes(b), 1, "reserved control bits stay 0");
        t.read(64, &mut b);
        assert_eq!(b, [0; 4], "past the table reads 0");
    }
}
