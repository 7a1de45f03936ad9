//! The device: its description, its register and RAM accesses, reset, and the state it
//! publishes into a black box (and a replacement process recovers from).

use std::fs::File;
use std::sync::Arc;

use switchyard_device::blackbox::{BlackBox, Record, RecordSpec};
use switchyard_device::config::{Bar, BarKind, CONFIG_SIZE, ConfigSpace, PciIds};
use switchyard_device::{
    CONFIG_REGION_INDEX, DeviceContext, DeviceDescription, DeviceError, IrqDesc, NUM_PCI_REGIONS,
    PciDevice, RegionDesc, RelocationStats, WorkCounters,
};

use crate::ram::{Ram, RamCopy, RamIdentity};
use crate::{
    BAR_RAM, BAR_REGS, ID, MAX_SIZE, MIN_SIZE, PCI_DEVICE_ID, PCI_VENDOR_ID, RAM_OBJECT, REG_ACCUM,
    REG_ID, REG_SIZE, REGS_SIZE, STATE_RECORD, ScratchpadError,
};

/// A scratchpad device (see the [crate] documentation).
pub struct Scratchpad {
    pub(crate) size: u64,
    desc: DeviceDescription,
    pub(crate) ctx: DeviceContext,
    /// The RAM it serves: the slot's [`RAM_OBJECT`] (a relocation's successor: the target,
    /// which becomes the slot's at the hand-over).
    pub(crate) ram: Arc<Ram>,
    pub(crate) accum: u64,
    pub(crate) config: ConfigSpace,
    /// The black-box record it publishes into, if it has one.
    pub(crate) mirror: Option<Record>,
    pub(crate) work: WorkCounters,
    /// A relocation's successor not yet swapped in: the copy the hand-over finishes.
    pub(crate) incoming: Option<RamCopy>,
    /// What the relocation that brought this device onto its RAM copied.
    pub(crate) relocated: Option<RelocationStats>,
    /// Handed over to a successor: it serves no more.
    pub(crate) retired: bool,
}

impl std::fmt::Debug for Scratchpad {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratchpad")
            .field("size", &self.size)
            .field("ram", &self.ram.identity())
            .field("accum", &self.accum)
            .field("mirrored", &self.mirror.is_some())
            .field("relocating", &self.incoming.is_some())
            .field("retired", &self.retired)
            .finish_non_exhaustive()
    }
}

/// Checks a RAM size: a power of two from [`MIN_SIZE`] to [`MAX_SIZE`].
pub(crate) fn check_size(size: u64) -> Result<(), ScratchpadError> {
    if size.is_power_of_two() && (MIN_SIZE..=MAX_SIZE).contains(&size) {
        Ok(())
    } else {
        Err(ScratchpadError::Size(size))
    }
}

/// The power-on config space of a scratchpad of `size` bytes.
fn power_on_config(size: u64) -> ConfigSpace {
    let mut cs = ConfigSpace::new(PciIds {
        vendor: PCI_VENDOR_ID,
        device: PCI_DEVICE_ID,
        subsystem_vendor: PCI_VENDOR_ID,
        subsystem: 0x0001,
        revision: 1,
        class: 0x05_00_00,
    });
    let mem32 = BarKind::Mem32 {
        prefetchable: false,
    };
    cs.add_bar(
        BAR_REGS as usize,
        Bar {
            size: REGS_SIZE,
            kind: mem32,
        },
    );
    cs.add_bar(BAR_RAM as usize, Bar { size, kind: mem32 });
    // FLR, so a guest driver can reset the function.
    cs.add_pcie_cap();
    cs.seal();
    cs
}

/// The black box record's layout: magic, `ACCUM`, the RAM's identity, the config space.
const STATE_MAGIC: u64 = u64::from_le_bytes(*b"SYSCRST1");
const STATE_HEADER: usize = 5 * 8;
/// Bytes of a published state.
pub(crate) const STATE_LEN: usize = STATE_HEADER + CONFIG_SIZE;

/// A state read back from the black box.
struct Saved {
    ram: RamIdentity,
    accum: u64,
    config: Vec<u8>,
}

fn encode(ram: RamIdentity, accum: u64, config: &ConfigSpace) -> Vec<u8> {
    let mut b = Vec::with_capacity(STATE_LEN);
    for v in [STATE_MAGIC, accum, ram.size, ram.dev, ram.ino] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.resize(STATE_LEN, 0);
    // The whole space always reads.
    let _ = config.read(0, &mut b[STATE_HEADER..]);
    b
}

fn decode(bytes: &[u8]) -> Result<Saved, ScratchpadError> {
    if bytes.len() != STATE_LEN {
        return Err(ScratchpadError::BadState(
            "not the length of a scratchpad state",
        ));
    }
    let (header, config) = bytes.split_at(STATE_HEADER);
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&header[8 * i..8 * i + 8]);
        u64::from_le_bytes(w)
    };
    if word(0) != STATE_MAGIC {
        return Err(ScratchpadError::BadState("not a scratchpad state (magic)"));
    }
    Ok(Saved {
        accum: word(1),
        ram: RamIdentity {
            size: word(2),
            dev: word(3),
            ino: word(4),
        },
        config: config.to_vec(),
    })
}

/// Publishes a state into `mirror`, if there is one.
pub(crate) fn publish_state(
    mirror: &mut Option<Record>,
    ram: RamIdentity,
    accum: u64,
    config: &ConfigSpace,
) -> Result<(), ScratchpadError> {
    match mirror {
        Some(m) => Ok(m.publish(&encode(ram, accum, config))?),
        None => Ok(()),
    }
}

impl Scratchpad {
    /// The black-box records a scratchpad mirrors into: [`STATE_RECORD`].
    pub fn black_box_records() -> Vec<RecordSpec> {
        vec![RecordSpec::new(STATE_RECORD, STATE_LEN)]
    }

    /// A scratchpad of `size` bytes on the slot's RAM ([`RAM_OBJECT`] in `ctx.memory`),
    /// created zeroed if the slot has none yet. Mirrors nothing.
    pub fn new(size: u64, ctx: DeviceContext) -> Result<Scratchpad, ScratchpadError> {
        check_size(size)?;
        let ram = ctx
            .memory
            .get_or_try_insert(RAM_OBJECT, || Ram::create(size))?;
        if ram.size() != size {
            return Err(ScratchpadError::RamSize {
                expected: size,
                actual: ram.size(),
            });
        }
        Ok(Self::on(size, ctx, ram))
    }

    /// [`Scratchpad::new`], publishing its state into `bb` (whose records are
    /// [`Scratchpad::black_box_records`]) before every change the client can see, so
    /// [`Scratchpad::recover`] can carry on in another process. The power-on state is
    /// published at once.
    pub fn with_black_box(
        size: u64,
        ctx: DeviceContext,
        bb: &Arc<BlackBox>,
    ) -> Result<Scratchpad, ScratchpadError> {
        let mut pad = Self::new(size, ctx)?;
        pad.mirror = Some(bb.record(STATE_RECORD)?);
        publish_state(&mut pad.mirror, pad.ram.identity(), pad.accum, &pad.config)?;
        Ok(pad)
    }

    /// Which RAM the device whose state is in `bb` ran on (for a replacement holding two:
    /// its predecessor died during a move). Reads only.
    pub fn black_box_ram(bb: &Arc<BlackBox>) -> Result<RamIdentity, ScratchpadError> {
        let bytes = bb
            .record(STATE_RECORD)?
            .read()?
            .ok_or(ScratchpadError::NoState)?;
        Ok(decode(&bytes)?.ram)
    }

    /// Carries on, in a replacement process, the device that published into `bb` and died:
    /// on `ram`, the very memfd it ran on (sealed, of `size` bytes, the identity the black
    /// box names), which becomes the slot's [`RAM_OBJECT`]. `ACCUM` and the config space
    /// are the last published; the device keeps publishing into `bb`.
    pub fn recover(
        size: u64,
        ctx: DeviceContext,
        bb: &Arc<BlackBox>,
        ram: File,
    ) -> Result<Scratchpad, ScratchpadError> {
        check_size(size)?;
        let mirror = bb.record(STATE_RECORD)?;
        let bytes = mirror.read()?.ok_or(ScratchpadError::NoState)?;
        let saved = decode(&bytes)?;
        let ram = Arc::new(Ram::adopt(ram, size)?);
        if saved.ram != ram.identity() {
            return Err(ScratchpadError::RamMismatch {
                saved: saved.ram,
                got: ram.identity(),
            });
        }
        // The saved space is written onto the power-on one, through its write masks: only
        // what the client could change is carried (BAR addresses, COMMAND, ...), the rest
        // stays this device's whatever the record says.
        let mut config = power_on_config(size);
        let ids = [PCI_VENDOR_ID.to_le_bytes(), PCI_DEVICE_ID.to_le_bytes()].concat();
        if saved.config.get(..4) != Some(&ids[..]) {
            return Err(ScratchpadError::BadState(
                "the config space is of another device",
            ));
        }
        config
            .write(0, &saved.config)
            .ok_or(ScratchpadError::BadState("the config space does not fit"))?;
        ctx.memory.insert(RAM_OBJECT, ram.clone());
        let mut pad = Self::on(size, ctx, ram);
        pad.accum = saved.accum;
        pad.config = config;
        pad.mirror = Some(mirror);
        publish_state(&mut pad.mirror, pad.ram.identity(), pad.accum, &pad.config)?;
        tracing::info!(
            size,
            accum = pad.accum,
            "scratchpad recovered from its black box"
        );
        Ok(pad)
    }

    /// The device on `ram`, at power-on, mirroring nothing.
    pub(crate) fn on(size: u64, ctx: DeviceContext, ram: Arc<Ram>) -> Scratchpad {
        let mut regions: Vec<RegionDesc> =
            (0..NUM_PCI_REGIONS).map(|_| RegionDesc::absent()).collect();
        regions[BAR_REGS as usize] = RegionDesc::trapped(REGS_SIZE);
        regions[BAR_RAM as usize] = RegionDesc::trapped(size);
        regions[CONFIG_REGION_INDEX as usize] = RegionDesc::trapped(CONFIG_SIZE as u64);
        // INTx, MSI, MSI-X, ERR, REQ: described (a VMM expects the indexes), none used.
        let none = IrqDesc {
            count: 0,
            eventfd: false,
            maskable: false,
            automasked: false,
            noresize: true,
        };
        Scratchpad {
            size,
            desc: DeviceDescription {
                name: "scratchpad",
                regions,
                irqs: vec![none; 5],
                resettable: true,
            },
            ctx,
            ram,
            accum: 0,
            config: power_on_config(size),
            mirror: None,
            work: WorkCounters::default(),
            incoming: None,
            relocated: None,
            retired: false,
        }
    }

    /// The RAM size.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// `ACCUM`.
    pub fn accum(&self) -> u64 {
        self.accum
    }

    /// Which memfd the device serves as RAM.
    pub fn ram_identity(&self) -> RamIdentity {
        self.ram.identity()
    }

    /// A new descriptor of the RAM memfd (what a daemon holds for a replacement).
    pub fn ram_memfd(&self) -> std::io::Result<File> {
        self.ram.file().try_clone()
    }

    /// Sets `ACCUM` to `accum`, published first.
    fn set_accum(&mut self, accum: u64) -> Result<(), ScratchpadError> {
        publish_state(&mut self.mirror, self.ram.identity(), accum, &self.config)?;
        self.accum = accum;
        Ok(())
    }

    /// Replaces the config space, published first.
    fn set_config(&mut self, config: ConfigSpace) -> Result<(), ScratchpadError> {
        publish_state(&mut self.mirror, self.ram.identity(), self.accum, &config)?;
        self.config = config;
        Ok(())
    }

    /// `[offset, offset + len)` of BAR0 as one register access: its 8-byte register and
    /// the access's byte shift in it.
    fn register(offset: u64, len: usize) -> Result<(u64, u32), DeviceError> {
        let out = DeviceError::OutOfRange {
            region: BAR_REGS,
            offset,
            len,
        };
        let end = u64::try_from(len).ok().and_then(|l| offset.checked_add(l));
        if end.is_none_or(|e| e > REGS_SIZE) {
            return Err(out);
        }
        if !matches!(len, 4 | 8) || !offset.is_multiple_of(len as u64) {
            return Err(DeviceError::BadAccess {
                region: BAR_REGS,
                offset,
                len,
            });
        }
        let base = offset & !7;
        Ok((base, 8 * (offset - base) as u32))
    }

    fn read_register(&self, base: u64) -> u64 {
        match base {
            REG_ID => ID,
            REG_ACCUM => self.accum,
            REG_SIZE => self.size,
            _ => 0,
        }
    }

    fn refused(&mut self, e: DeviceError) -> DeviceError {
        self.work.errors += 1;
        e
    }

    fn ram_access(&mut self, offset: u64, len: usize) -> Result<(), DeviceError> {
        if self.ram.contains(offset, len) {
            Ok(())
        } else {
            Err(self.refused(DeviceError::OutOfRange {
                region: BAR_RAM,
                offset,
                len,
            }))
        }
    }

    fn config_out_of_range(offset: u64, len: usize) -> DeviceError {
        DeviceError::OutOfRange {
            region: CONFIG_REGION_INDEX,
            offset,
            len,
        }
    }

    fn power_on(&mut self) -> Result<(), DeviceError> {
        self.ram.zero()?;
        let mut config = self.config.clone();
        config.reset();
        publish_state(&mut self.mirror, self.ram.identity(), 0, &config)?;
        self.accum = 0;
        self.config = config;
        Ok(())
    }
}

impl PciDevice for Scratchpad {
    fn description(&self) -> &DeviceDescription {
        &self.desc
    }

    fn region_read(
        &mut self,
        region: u32,
        offset: u64,
        data: &mut [u8],
    ) -> Result<(), DeviceError> {
        match region {
            BAR_REGS => {
                let (base, shift) =
                    Self::register(offset, data.len()).map_err(|e| self.refused(e))?;
                let v = self.read_register(base) >> shift;
                let len = data.len();
                data.copy_from_slice(&v.to_le_bytes()[..len]);
                Ok(())
            }
            BAR_RAM => {
                self.ram_access(offset, data.len())?;
                Ok(self.ram.read(offset, data)?)
            }
            CONFIG_REGION_INDEX => {
                if self.config.read(offset, data) {
                    Ok(())
                } else {
                    Err(Self::config_out_of_range(offset, data.len()))
                }
            }
            _ => Err(DeviceError::NoSuchRegion(region)),
        }
    }

    fn region_write(&mut self, region: u32, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        match region {
            BAR_REGS => {
                let (base, shift) =
                    Self::register(offset, data.len()).map_err(|e| self.refused(e))?;
                if base == REG_ACCUM {
                    let mut v = [0u8; 8];
                    v[..data.len()].copy_from_slice(data);
                    let add = u64::from_le_bytes(v) << shift;
                    self.set_accum(self.accum.wrapping_add(add))?;
                }
                // Writes to the other registers are ignored, as hardware does.
                Ok(())
            }
            BAR_RAM => {
                self.ram_access(offset, data.len())?;
                self.ram.write(offset, data)?;
                self.work.commands += 1;
                self.work.bytes += data.len() as u64;
                Ok(())
            }
            CONFIG_REGION_INDEX => {
                let mut config = self.config.clone();
                let fx = config
                    .write(offset, data)
                    .ok_or_else(|| Self::config_out_of_range(offset, data.len()))?;
                self.set_config(config)?;
                if fx.flr {
                    tracing::debug!("function level reset");
                    self.power_on()?;
                }
                Ok(())
            }
            _ => Err(DeviceError::NoSuchRegion(region)),
        }
    }

    fn reset(&mut self) -> Result<(), DeviceError> {
        self.power_on()
    }

    /// Config space back to power-on (published first); RAM and `ACCUM` stay.
    fn fresh_open(&mut self) -> Result<(), DeviceError> {
        let mut config = self.config.clone();
        config.reset();
        Ok(self.set_config(config)?)
    }

    fn swappable(&mut self) -> Option<&mut dyn switchyard_device::Swappable> {
        Some(self)
    }

    fn recoverable(&self) -> Option<&dyn switchyard_device::Recoverable> {
        Some(self)
    }

    fn relocatable(&mut self) -> Option<&mut dyn switchyard_device::Relocatable> {
        Some(self)
    }

    fn telemetry(&self) -> Option<&dyn switchyard_device::Telemetry> {
        Some(self)
    }
}

impl switchyard_device::Recoverable for Scratchpad {
    /// The RAM: the black box holds the rest.
    fn held_objects(&self) -> Result<Vec<(String, File)>, DeviceError> {
        Ok(vec![(RAM_OBJECT.to_owned(), self.ram_memfd()?)])
    }
}

impl switchyard_device::Telemetry for Scratchpad {
    fn work(&self) -> WorkCounters {
        self.work
    }
}
