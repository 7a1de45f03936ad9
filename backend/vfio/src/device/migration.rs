//! VFIO migration v2 for a passthrough device without a variant driver: *quiesce + reset +
//! replay*. The stream carries what the client made of the device, the shadowed config space
//! (BAR addresses, COMMAND, MSI/MSI-X control, cache line) and the emulated MSI-X table; the
//! destination resets its device and replays them. What lives inside the hardware (registers
//! beyond config space, queues, on-board memory) is not carried: after the switchover the
//! guest finds its device configured as it left it but reset inside, as after a function
//! reset, and its driver must re-initialise it. A device whose variant driver implements the
//! kernel's migration v2 would carry that too (not available here: see the crate docs).
//!
//! STOP clears bus mastering on the hardware (its DMA stops; the guest's view keeps the bit),
//! RUNNING puts the client's COMMAND bits back. No PRE_COPY: the stream is a few KiB.

use switchyard_device::{DeviceError, MigArc, Migratable, MigrationCaps, Result};

use super::{DeviceConfig, VfioPci, gone, lock};
use crate::config::{COMMAND, RawConfig};

/// Stream magic and version.
const MAGIC: &[u8; 8] = b"SYVFIO01";
/// The largest stream accepted: a 4 KiB config space and a 2048-vector MSI-X table.
pub(super) const MAX_STREAM: usize = 8 + 4 + 4 + 4096 + 1 + 4 + 2048 * 16;

/// The migration side of a [`VfioPci`].
#[derive(Debug, Default)]
pub(super) struct MigState {
    /// The outgoing stream (STOP_COPY) and how much was read.
    out: Option<(Vec<u8>, usize)>,
    /// The incoming stream (RESUMING).
    incoming: Option<Vec<u8>>,
}

fn invalid(what: &str) -> DeviceError {
    tracing::warn!("migration stream refused: {what}");
    DeviceError::Io(std::io::Error::from_raw_os_error(libc::EINVAL))
}

impl VfioPci {
    /// Bus mastering on the hardware: off (quiesced) or as the client set it.
    pub(super) fn set_bus_master(&self, run: bool) -> Result<()> {
        let (fd, cfg_offset) = self.live_fd()?;
        let raw = DeviceConfig {
            fd: &fd,
            offset: cfg_offset,
        };
        if run {
            return self.config.reapply(&raw).map_err(DeviceError::Io);
        }
        let mut cmd = [0u8; 2];
        RawConfig::read(&raw, COMMAND as u64, &mut cmd).map_err(DeviceError::Io)?;
        let v = u16::from_le_bytes(cmd) & !0x0004;
        RawConfig::write(&raw, COMMAND as u64, &v.to_le_bytes()).map_err(DeviceError::Io)
    }

    /// `MAGIC`, vendor and device ids, the shadow, then the MSI-X table if the client wrote it.
    pub(super) fn save_stream(&self) -> Vec<u8> {
        let shadow = self.config.shadow();
        let mut v = Vec::with_capacity(64 + shadow.len());
        v.extend_from_slice(MAGIC);
        v.extend_from_slice(&shadow[..4]);
        v.extend_from_slice(&(shadow.len() as u32).to_le_bytes());
        v.extend_from_slice(shadow);
        match &self.msix {
            Some((m, t)) if t.written() => {
                v.push(1);
                let mut table = vec![0u8; m.table_size() as usize];
                t.read(0, &mut table);
                v.extend_from_slice(&(table.len() as u32).to_le_bytes());
                v.extend_from_slice(&table);
            }
            _ => v.push(0),
        }
        v
    }

    /// Checks an incoming stream against this device and replays it: VFIO reset, the client's
    /// config bits and MSI-X table, bus mastering left off (the device is stopped).
    pub(super) fn load_stream(&mut self, s: &[u8]) -> Result<()> {
        let mut r = Reader(s);
        if r.take(8)? != MAGIC {
            return Err(invalid("not a switchyard passthrough stream"));
        }
        let ids = r.take(4)?;
        if ids != &self.config.shadow()[..4] {
            return Err(invalid(
                "the source is another kind of device (vendor/device ids)",
            ));
        }
        let len = r.u32()? as usize;
        if len != self.config.shadow().len() {
            return Err(invalid("config space sizes differ"));
        }
        let shadow = r.take(len)?.to_vec();
        let table = match r.take(1)?[0] {
            0 => None,
            1 => {
                let n = r.u32()? as usize;
                let expected = self.msix.as_ref().map(|(m, _)| m.table_size() as usize);
                if Some(n) != expected {
                    return Err(invalid("MSI-X table sizes differ"));
                }
                Some(r.take(n)?.to_vec())
            }
            _ => return Err(invalid("bad MSI-X table flag")),
        };
        if !r.0.is_empty() {
            return Err(invalid("trailing bytes"));
        }
        // Quiesce + reset + replay.
        if self.desc.resettable {
            let g = lock(&self.hw);
            let h = g.as_ref().ok_or_else(gone)?;
            switchyard_sys::reset_device(&h.device).map_err(DeviceError::Io)?;
        }
        self.config.load_client_bits(&shadow);
        if let (Some((_, t)), Some(bytes)) = (&mut self.msix, &table) {
            t.write(0, bytes);
        }
        self.apply_msix_masks();
        self.set_bus_master(false)?;
        tracing::info!(
            command = format!("{:#06x}", self.config.command()),
            msix_table = table.is_some(),
            reset = self.desc.resettable,
            "migration stream loaded: device reset (if it can be), the client's configuration replayed"
        );
        Ok(())
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if n > self.0.len() {
            return Err(invalid("truncated"));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

impl Migratable for VfioPci {
    fn caps(&self) -> MigrationCaps {
        MigrationCaps {
            precopy: false,
            p2p: false,
        }
    }

    fn step(&mut self, arc: MigArc) -> Result<()> {
        tracing::debug!(?arc, "migration arc");
        match arc {
            MigArc::Stop => self.set_bus_master(false),
            MigArc::Run => self.set_bus_master(true),
            MigArc::StartStopCopy => {
                self.mig.out = Some((self.save_stream(), 0));
                Ok(())
            }
            MigArc::EndStopCopy => {
                self.mig.out = None;
                Ok(())
            }
            MigArc::StartResuming => {
                self.mig.incoming = Some(Vec::new());
                Ok(())
            }
            MigArc::EndResuming => {
                let s = self.mig.incoming.take().unwrap_or_default();
                self.load_stream(&s)
            }
            // Not offered: no PRE_COPY, no P2P states.
            MigArc::StartPreCopy
            | MigArc::AbortPreCopy
            | MigArc::PreCopyToStopCopy
            | MigArc::EnterP2p
            | MigArc::LeaveP2p
            | MigArc::StopFromP2p
            | MigArc::P2pFromStop
            | MigArc::StartPreCopyP2p
            | MigArc::AbortPreCopyP2p
            | MigArc::PreCopyP2pToStopCopy => Err(DeviceError::Unsupported),
        }
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize> {
        let Some((s, pos)) = &mut self.mig.out else {
            return Ok(0);
        };
        let n = buf.len().min(s.len() - *pos);
        buf[..n].copy_from_slice(&s[*pos..*pos + n]);
        *pos += n;
        Ok(n)
    }

    fn write(&mut self, data: &[u8]) -> Result<()> {
        let s = self.mig.incoming.get_or_insert_with(Vec::new);
        if s.len().saturating_add(data.len()) > MAX_STREAM {
            return Err(invalid("longer than any passthrough stream"));
        }
        s.extend_from_slice(data);
        Ok(())
    }

    fn abort(&mut self) {
        self.mig = MigState::default();
        if let Err(e) = self.set_bus_master(true) {
            tracing::warn!(error = %e, "cannot let the device run again after a migration");
        }
    }

    /// The rest of the stream being read, or the whole stream the device would send now
    /// (a few KiB: config space and the MSI-X table).
    fn stop_copy_size(&mut self) -> Option<u64> {
        Some(match &self.mig.out {
            Some((s, pos)) => (s.len() - pos) as u64,
            None => self.save_stream().len() as u64,
        })
    }
}
