//! PCI configuration space: a type 0 header, BAR sizing, a capability chain (power management,
//! PCI Express endpoint, MSI, MSI-X) and per-byte write semantics (read-only, read/write, RW1C).
//!
//! The space is plain data (`serde`), so it is part of the device state that can be saved,
//! restored and moved to another backing device.

use serde::{Deserialize, Serialize};

/// Size of the (PCI Express) configuration space.
pub const CONFIG_SIZE: usize = 4096;

/// Standard register offsets.
pub mod regs {
    /// Vendor ID.
    pub const VENDOR_ID: usize = 0x00;
    /// Device ID.
    pub const DEVICE_ID: usize = 0x02;
    /// Command register.
    pub const COMMAND: usize = 0x04;
    /// Status register.
    pub const STATUS: usize = 0x06;
    /// Revision ID.
    pub const REVISION: usize = 0x08;
    /// Class code (prog-if, subclass, class).
    pub const CLASS_PROG: usize = 0x09;
    /// Header type.
    pub const HEADER_TYPE: usize = 0x0e;
    /// BAR 0.
    pub const BAR0: usize = 0x10;
    /// Subsystem vendor ID.
    pub const SUBSYS_VENDOR: usize = 0x2c;
    /// Subsystem ID.
    pub const SUBSYS_ID: usize = 0x2e;
    /// Capabilities pointer.
    pub const CAP_PTR: usize = 0x34;
    /// Interrupt line.
    pub const INT_LINE: usize = 0x3c;
    /// Interrupt pin.
    pub const INT_PIN: usize = 0x3d;

    /// Command: memory space enable.
    pub const CMD_MEMORY: u16 = 1 << 1;
    /// Command: bus master enable.
    pub const CMD_BUS_MASTER: u16 = 1 << 2;
    /// Command: INTx disable.
    pub const CMD_INTX_DISABLE: u16 = 1 << 10;
    /// Status: capability list present.
    pub const STATUS_CAP_LIST: u16 = 1 << 4;
}

/// Capability IDs.
pub mod cap_id {
    /// Power management.
    pub const PM: u8 = 0x01;
    /// MSI.
    pub const MSI: u8 = 0x05;
    /// PCI Express.
    pub const EXP: u8 = 0x10;
    /// MSI-X.
    pub const MSIX: u8 = 0x11;
}

/// Offsets inside the PCI Express capability.
pub mod exp {
    /// Device capabilities.
    pub const DEVCAP: usize = 0x04;
    /// Device control.
    pub const DEVCTL: usize = 0x08;
    /// Device status.
    pub const DEVSTA: usize = 0x0a;
    /// Link capabilities.
    pub const LNKCAP: usize = 0x0c;
    /// Link status.
    pub const LNKSTA: usize = 0x12;
    /// Device capabilities: function level reset capable.
    pub const DEVCAP_FLR: u32 = 1 << 28;
    /// Device control: initiate function level reset.
    pub const DEVCTL_BCR_FLR: u16 = 1 << 15;
    /// Length of the version 2 endpoint capability.
    pub const SIZEOF_V2: usize = 0x3c;
}

/// Offsets and bits inside the MSI capability (the 64-bit layout without per-vector masking
/// that [`ConfigSpace::add_msi_cap`] builds).
pub mod msi {
    /// Message Control.
    pub const CONTROL: usize = 0x02;
    /// Message Address, low 32 bits (bits 1:0 read as zero).
    pub const ADDRESS_LO: usize = 0x04;
    /// Message Address, high 32 bits.
    pub const ADDRESS_HI: usize = 0x08;
    /// Message Data (16 bits).
    pub const DATA: usize = 0x0c;
    /// Length of the capability (64-bit address, no per-vector masking).
    pub const SIZEOF_64: usize = 0x0e;
    /// Message Control: MSI enable.
    pub const CTL_ENABLE: u16 = 1 << 0;
    /// Message Control: Multiple Message Capable, log2 of the vectors requested (RO).
    pub const CTL_MMC_MASK: u16 = 0x7 << 1;
    /// Shift of [`CTL_MMC_MASK`].
    pub const CTL_MMC_SHIFT: u32 = 1;
    /// Message Control: Multiple Message Enable, log2 of the vectors allocated (RW).
    pub const CTL_MME_MASK: u16 = 0x7 << 4;
    /// Shift of [`CTL_MME_MASK`].
    pub const CTL_MME_SHIFT: u32 = 4;
    /// Message Control: 64-bit address capable (RO).
    pub const CTL_64BIT: u16 = 1 << 7;
}

/// What kind of BAR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum BarKind {
    /// 32-bit memory BAR.
    Mem32 {
        /// Prefetchable.
        prefetchable: bool,
    },
    /// 64-bit memory BAR (uses this and the next BAR slot).
    Mem64 {
        /// Prefetchable.
        prefetchable: bool,
    },
}

/// A BAR's definition.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bar {
    /// Size in bytes; a power of two ≥ 16.
    pub size: u64,
    /// Kind.
    pub kind: BarKind,
}

impl Bar {
    fn type_bits(&self) -> u32 {
        match self.kind {
            BarKind::Mem32 { prefetchable } => u32::from(prefetchable) << 3,
            BarKind::Mem64 { prefetchable } => (u32::from(prefetchable) << 3) | 0b100,
        }
    }
}

/// Identity of the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PciIds {
    /// Vendor ID.
    pub vendor: u16,
    /// Device ID.
    pub device: u16,
    /// Subsystem vendor ID.
    pub subsystem_vendor: u16,
    /// Subsystem ID.
    pub subsystem: u16,
    /// Revision.
    pub revision: u8,
    /// 24-bit class code: class << 16 | subclass << 8 | prog-if.
    pub class: u32,
}

/// What a config write did that the device must act on.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WriteEffects {
    /// The driver initiated a function level reset.
    pub flr: bool,
    /// The MSI-X message control register changed (enable / function mask).
    pub msix_control: bool,
    /// The MSI message control register changed (enable / multiple message enable).
    pub msi_control: bool,
    /// The command register changed.
    pub command: bool,
}

/// Location of the MSI-X structures, for the device's table emulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MsixLayout {
    /// Number of vectors.
    pub vectors: u16,
    /// BAR holding the table.
    pub table_bar: u8,
    /// Offset of the table in that BAR.
    pub table_offset: u32,
    /// BAR holding the PBA.
    pub pba_bar: u8,
    /// Offset of the PBA in that BAR.
    pub pba_offset: u32,
}

/// The configuration space of one function.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ConfigSpace {
    #[serde(with = "serde_bytes_4k")]
    bytes: Vec<u8>,
    /// Per-byte mask of bits the driver may write.
    #[serde(skip, default = "zeroed")]
    wmask: Vec<u8>,
    /// Per-byte mask of bits that are write-1-to-clear.
    #[serde(skip, default = "zeroed")]
    w1c: Vec<u8>,
    bars: [Option<Bar>; 6],
    /// Offset of the last capability added (to chain the next one).
    last_cap: usize,
    /// Next free offset for a capability.
    next_free: usize,
    exp_offset: Option<usize>,
    msix_offset: Option<usize>,
    /// Absent in states saved before MSI support; those have no MSI capability.
    #[serde(default)]
    msi_offset: Option<usize>,
    /// Power-on image, restored by reset.
    #[serde(skip)]
    power_on: Option<Vec<u8>>,
}

fn zeroed() -> Vec<u8> {
    vec![0; CONFIG_SIZE]
}

mod serde_bytes_4k {
    use serde::{Deserialize, Deserializer, Serializer};
    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(v)
    }
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let v = Vec::<u8>::deserialize(d)?;
        if v.len() != super::CONFIG_SIZE {
            return Err(serde::de::Error::invalid_length(v.len(), &"4096 bytes"));
        }
        Ok(v)
    }
}

impl ConfigSpace {
    /// A type 0 header with the given identity and no BARs or capabilities.
    pub fn new(ids: PciIds) -> Self {
        let mut c = ConfigSpace {
            bytes: zeroed(),
            wmask: zeroed(),
            w1c: zeroed(),
            bars: [None; 6],
            last_cap: 0,
            next_free: 0x40,
            exp_offset: None,
            msix_offset: None,
            msi_offset: None,
            power_on: None,
        };
        c.set_u16(regs::VENDOR_ID, ids.vendor);
        c.set_u16(regs::DEVICE_ID, ids.device);
        c.set_u8(regs::REVISION, ids.revision);
        c.set_u8(regs::CLASS_PROG, ids.class as u8);
        c.set_u8(regs::CLASS_PROG + 1, (ids.class >> 8) as u8);
        c.set_u8(regs::CLASS_PROG + 2, (ids.class >> 16) as u8);
        c.set_u16(regs::SUBSYS_VENDOR, ids.subsystem_vendor);
        c.set_u16(regs::SUBSYS_ID, ids.subsystem);
        c.set_u8(regs::HEADER_TYPE, 0);
        // Command: memory space, bus master, INTx disable are writable.
        c.set_wmask_u16(
            regs::COMMAND,
            regs::CMD_MEMORY | regs::CMD_BUS_MASTER | regs::CMD_INTX_DISABLE,
        );
        // Status: the error bits are RW1C.
        c.w1c[regs::STATUS + 1] = 0xf9;
        c.wmask[regs::INT_LINE] = 0xff;
        c
    }

    /// Declares a BAR. A 64-bit BAR also takes slot `index + 1`.
    ///
    /// # Panics
    /// On a device-definition bug: size not a power of two ≥ 16, index out of range or taken.
    pub fn add_bar(&mut self, index: usize, bar: Bar) {
        assert!(
            bar.size.is_power_of_two() && bar.size >= 16,
            "BAR size must be a power of two"
        );
        let wide = matches!(bar.kind, BarKind::Mem64 { .. });
        assert!(index < 6 && (!wide || index < 5), "BAR index out of range");
        assert!(self.bars[index].is_none(), "BAR slot taken");
        let off = regs::BAR0 + 4 * index;
        let mask = !(bar.size - 1);
        self.set_u32(off, bar.type_bits());
        self.set_wmask_u32(off, (mask as u32) & !0xf);
        if wide {
            self.set_wmask_u32(off + 4, (mask >> 32) as u32);
        } else {
            assert!(bar.size <= 1 << 31, "32-bit BAR too large");
        }
        self.bars[index] = Some(bar);
    }

    /// The BAR declared at `index`.
    pub fn bar(&self, index: usize) -> Option<Bar> {
        self.bars.get(index).copied().flatten()
    }

    /// The address currently programmed into BAR `index`.
    pub fn bar_address(&self, index: usize) -> Option<u64> {
        let bar = self.bar(index)?;
        let off = regs::BAR0 + 4 * index;
        let lo = u64::from(self.u32(off) & !0xf);
        let hi = match bar.kind {
            BarKind::Mem64 { .. } => u64::from(self.u32(off + 4)),
            BarKind::Mem32 { .. } => 0,
        };
        Some(hi << 32 | lo)
    }

    fn add_cap(&mut self, id: u8, len: usize) -> usize {
        let off = self.next_free;
        assert!(
            off + len <= 0x100,
            "capabilities exceed the legacy config space"
        );
        self.set_u8(off, id);
        self.set_u8(off + 1, 0);
        if self.last_cap == 0 {
            self.set_u8(regs::CAP_PTR, off as u8);
            let st = self.u16(regs::STATUS) | regs::STATUS_CAP_LIST;
            self.set_u16(regs::STATUS, st);
        } else {
            self.set_u8(self.last_cap + 1, off as u8);
        }
        self.last_cap = off;
        // Keep capabilities dword aligned.
        self.next_free = (off + len + 3) & !3;
        off
    }

    /// Adds a power management capability (D0/D3hot, no PME).
    pub fn add_pm_cap(&mut self) -> usize {
        let off = self.add_cap(cap_id::PM, 8);
        // PMC: version 3.
        self.set_u16(off + 2, 0x0003);
        // PMCSR: power state (bits 1:0) writable; No_Soft_Reset = 0.
        self.set_wmask_u16(off + 4, 0x0003);
        off
    }

    /// Adds a PCI Express v2 endpoint capability with FLR support.
    pub fn add_pcie_cap(&mut self) -> usize {
        let off = self.add_cap(cap_id::EXP, exp::SIZEOF_V2);
        // Capabilities register: version 2, device/port type 0 (endpoint).
        self.set_u16(off + 2, 0x0002);
        // Device capabilities: max payload 256 B, FLR capable.
        self.set_u32(off + exp::DEVCAP, 0x1 | exp::DEVCAP_FLR);
        // Device control: relaxed ordering, max payload, max read request, etc. writable;
        // bit 15 (initiate FLR) is write-only and reads as zero.
        self.set_wmask_u16(off + exp::DEVCTL, 0x7fff);
        self.set_u16(off + exp::DEVCTL, 0x2810);
        // Device status: error bits RW1C.
        self.w1c[off + exp::DEVSTA] = 0x0f;
        // Link: x16, 16 GT/s (gen 4); link status reports the same.
        self.set_u32(off + exp::LNKCAP, (16 << 4) | 4);
        self.set_u16(off + exp::LNKSTA, (16 << 4) | 4);
        // Device capabilities 2 / control 2: nothing special, control 2 writable.
        self.set_wmask_u16(off + 0x28, 0x07ff);
        self.exp_offset = Some(off);
        off
    }

    /// Adds an MSI-X capability.
    pub fn add_msix_cap(&mut self, layout: MsixLayout) -> usize {
        assert!(
            layout.vectors >= 1 && layout.vectors <= 2048,
            "MSI-X vector count"
        );
        let off = self.add_cap(cap_id::MSIX, 12);
        self.set_u16(off + 2, layout.vectors - 1);
        // Enable (15) and function mask (14) are writable.
        self.set_wmask_u16(off + 2, 0xc000);
        self.set_u32(off + 4, layout.table_offset | u32::from(layout.table_bar));
        self.set_u32(off + 8, layout.pba_offset | u32::from(layout.pba_bar));
        self.msix_offset = Some(off);
        off
    }

    /// Adds an MSI capability with a 64-bit message address and no per-vector masking,
    /// requesting `1 << multiple_message_capable_log2` vectors.
    ///
    /// Message Control: enable (bit 0) and Multiple Message Enable (bits 6:4) are writable,
    /// Multiple Message Capable (bits 3:1) reads `multiple_message_capable_log2`, bit 7 (64-bit
    /// capable) reads 1. Message Address bits 63:2 and the 16-bit Message Data are writable.
    /// All of it is zero at power-on (MSI disabled, one vector allocated).
    ///
    /// # Panics
    /// On a device-definition bug: `multiple_message_capable_log2` above 5 (32 vectors) or a
    /// second MSI capability.
    pub fn add_msi_cap(&mut self, multiple_message_capable_log2: u8) -> usize {
        assert!(
            multiple_message_capable_log2 <= 5,
            "MSI supports at most 32 vectors"
        );
        assert!(self.msi_offset.is_none(), "MSI capability already present");
        let off = self.add_cap(cap_id::MSI, msi::SIZEOF_64);
        let mmc = u16::from(multiple_message_capable_log2) << msi::CTL_MMC_SHIFT;
        self.set_u16(off + msi::CONTROL, msi::CTL_64BIT | mmc);
        self.set_wmask_u16(off + msi::CONTROL, msi::CTL_ENABLE | msi::CTL_MME_MASK);
        self.set_wmask_u32(off + msi::ADDRESS_LO, 0xffff_fffc);
        self.set_wmask_u32(off + msi::ADDRESS_HI, 0xffff_ffff);
        self.set_wmask_u16(off + msi::DATA, 0xffff);
        self.msi_offset = Some(off);
        off
    }

    /// Freezes the current contents as the power-on state restored by [`ConfigSpace::reset`].
    pub fn seal(&mut self) {
        self.power_on = Some(self.bytes.clone());
    }

    /// Returns the space to its power-on state (FLR / device reset).
    pub fn reset(&mut self) {
        if let Some(p) = &self.power_on {
            self.bytes.clone_from(p);
        }
    }

    /// Offset of the PCI Express capability.
    pub fn pcie_offset(&self) -> Option<usize> {
        self.exp_offset
    }

    /// Offset of the MSI-X capability.
    pub fn msix_offset(&self) -> Option<usize> {
        self.msix_offset
    }

    /// MSI-X enable bit.
    pub fn msix_enabled(&self) -> bool {
        self.msix_offset
            .is_some_and(|o| self.u16(o + 2) & 0x8000 != 0)
    }

    /// MSI-X function mask bit.
    pub fn msix_function_masked(&self) -> bool {
        self.msix_offset
            .is_some_and(|o| self.u16(o + 2) & 0x4000 != 0)
    }

    /// Offset of the MSI capability.
    pub fn msi_offset(&self) -> Option<usize> {
        self.msi_offset
    }

    /// MSI enable bit (`false` without an MSI capability).
    pub fn msi_enabled(&self) -> bool {
        self.msi_control().is_some_and(|c| c & msi::CTL_ENABLE != 0)
    }

    /// Number of MSI vectors software allocated: `1 << Multiple Message Enable` (1 at
    /// power-on), whether or not MSI is enabled; 0 without an MSI capability. Software must not
    /// allocate more than the capability requests (Multiple Message Capable); the value is
    /// reported as written.
    pub fn msi_vectors_enabled(&self) -> u32 {
        self.msi_control()
            .map_or(0, |c| 1 << ((c & msi::CTL_MME_MASK) >> msi::CTL_MME_SHIFT))
    }

    fn msi_control(&self) -> Option<u16> {
        self.msi_offset.map(|o| self.u16(o + msi::CONTROL))
    }

    /// Bus master enable.
    pub fn bus_master(&self) -> bool {
        self.u16(regs::COMMAND) & regs::CMD_BUS_MASTER != 0
    }

    /// Reads `buf.len()` bytes at `offset`. Returns `false` if the access is out of range.
    pub fn read(&self, offset: u64, buf: &mut [u8]) -> bool {
        let Some(src) = range(offset, buf.len()).and_then(|r| self.bytes.get(r)) else {
            return false;
        };
        buf.copy_from_slice(src);
        true
    }

    /// Writes `data` at `offset` honouring per-bit write semantics. Returns `None` if the access
    /// is out of range.
    pub fn write(&mut self, offset: u64, data: &[u8]) -> Option<WriteEffects> {
        let r = range(offset, data.len())?;
        if r.end > CONFIG_SIZE {
            return None;
        }
        let before_cmd = self.u16(regs::COMMAND);
        let msix_ctl = self.msix_offset.map(|o| self.u16(o + 2));
        let msi_ctl = self.msi_control();
        let mut effects = WriteEffects::default();
        for (i, &v) in r.clone().zip(data) {
            let (wm, w1c) = (self.wmask[i], self.w1c[i]);
            let old = self.bytes[i];
            let mut new = (old & !wm) | (v & wm);
            new &= !(v & w1c);
            self.bytes[i] = new;
        }
        if let Some(o) = self.exp_offset {
            let ctl = o + exp::DEVCTL + 1;
            if r.contains(&ctl) {
                let v = data[ctl - r.start];
                if v & 0x80 != 0 {
                    effects.flr = true;
                }
                // Initiate FLR always reads as zero.
                self.bytes[ctl] &= 0x7f;
            }
        }
        effects.command = before_cmd != self.u16(regs::COMMAND);
        effects.msix_control = msix_ctl != self.msix_offset.map(|o| self.u16(o + 2));
        effects.msi_control = msi_ctl != self.msi_control();
        Some(effects)
    }

    /// Raw read of a 16-bit register.
    pub fn u16(&self, off: usize) -> u16 {
        u16::from_le_bytes([self.bytes[off], self.bytes[off + 1]])
    }

    /// Raw read of a 32-bit register.
    pub fn u32(&self, off: usize) -> u32 {
        u32::from_le_bytes([
            self.bytes[off],
            self.bytes[off + 1],
            self.bytes[off + 2],
            self.bytes[off + 3],
        ])
    }

    fn set_u8(&mut self, off: usize, v: u8) {
        self.bytes[off] = v;
    }

    fn set_u16(&mut self, off: usize, v: u16) {
        self.bytes[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn set_u32(&mut self, off: usize, v: u32) {
        self.bytes[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn set_wmask_u16(&mut self, off: usize, v: u16) {
        self.wmask[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }

    fn set_wmask_u32(&mut self, off: usize, v: u32) {
        self.wmask[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }

    /// Re-creates the write masks after deserialization by replaying the definition.
    pub fn restore_masks_from(&mut self, definition: &ConfigSpace) {
        self.wmask.clone_from(&definition.wmask);
        self.w1c.clone_from(&definition.w1c);
        self.power_on.clone_from(&definition.power_on);
    }
}

fn range(offset: u64, len: usize) -> Option<std::ops::Range<usize>> {
    let start = usize::try_from(offset).ok()?;
    let end = start.checked_add(len)?;
    (end <= CONFIG_SIZE).then_some(start..end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> ConfigSpace {
        let mut c = ConfigSpace::new(PciIds {
            vendor: 0x1234,
            device: 0x5678,
            subsystem_vendor: 0x1234,
            subsystem: 1,
            revision: 2,
            class: 0x030200,
        });
        c.add_bar(
            0,
            Bar {
                size: 64 << 10,
                kind: BarKind::Mem32 {
                    prefetchable: false,
                },
            },
        );
        c.add_bar(
            2,
            Bar {
                size: 64 << 20,
                kind: BarKind::Mem64 { prefetchable: true },
            },
        );
        c.add_pm_cap();
        c.add_pcie_cap();
        c.add_msix_cap(MsixLayout {
            vectors: 8,
            table_bar: 0,
            table_offset: 0x8000,
            pba_bar: 0,
            pba_offset: 0x9000,
        });
        c.seal();
        c
    }

    fn rd32(c: &ConfigSpace, off: u64) -> u32 {
        let mut b = [0; 4];
        assert!(c.read(off, &mut b));
        u32::from_le_bytes(b)
    }

    fn wr32(c: &mut ConfigSpace, off: u64, v: u32) -> WriteEffects {
        c.write(off, &v.to_le_bytes()).expect("in range")
    }

    #[test]
    fn identity_is_read_only() {
        let mut c = sample();
        wr32(&mut c, 0, 0xffff_ffff);
        wr32(&mut c, 8, 0xffff_ffff);
        assert_eq!(rd32(&c, 0), 0x5678_1234);
        assert_eq!(rd32(&c, 8), 0x0302_0002);
    }

    #[test]
    fn bar_sizing_reports_size_and_type() {
        let mut c = sample();
        wr32(&mut c, 0x10, 0xffff_ffff);
        assert_eq!(rd32(&c, 0x10), !(64 * 1024 - 1) & !0xf);
        wr32(&mut c, 0x18, 0xffff_ffff);
        wr32(&mut c, 0x1c, 0xffff_ffff);
        assert_eq!(
            rd32(&c, 0x18),
            (!(64u32 << 20).wrapping_sub(1) & !0xf) | 0b1100
        );
        assert_eq!(rd32(&c, 0x1c), 0xffff_ffff);
        let size = !((u64::from(rd32(&c, 0x1c)) << 32) | u64::from(rd32(&c, 0x18) & !0xf)) + 1;
        assert_eq!(size, 64 << 20);
        // Unimplemented BARs read zero and ignore writes.
        wr32(&mut c, 0x14, 0xffff_ffff);
        assert_eq!(rd32(&c, 0x14), 0);
        // Programming an address.
        wr32(&mut c, 0x18, 0xe000_0000);
        wr32(&mut c, 0x1c, 0x1);
        assert_eq!(c.bar_address(2), Some(0x1_e000_0000));
    }

    #[test]
    fn capability_chain_is_well_formed() {
        let c = sample();
        let mut b = [0u8; 2];
        assert!(c.read(regs::STATUS as u64, &mut b));
        assert_ne!(u16::from_le_bytes(b) & regs::STATUS_CAP_LIST, 0);
        let mut ids = vec![];
        let mut p = c.bytes[regs::CAP_PTR] as usize;
        while p != 0 {
            assert_eq!(p % 4, 0, "capabilities are dword aligned");
            assert!(p >= 0x40);
            ids.push(c.bytes[p]);
            p = c.bytes[p + 1] as usize;
        }
        assert_eq!(ids, vec![cap_id::PM, cap_id::EXP, cap_id::MSIX]);
        // Extended config space is empty: header at 0x100 reads as zero.
        assert_eq!(rd32(&c, 0x100), 0);
    }

    #[test]
    fn flr_is_reported_and_reads_back_zero() {
        let mut c = sample();
        let exp = c.pcie_offset().expect("pcie");
        let devctl = (exp + exp::DEVCTL) as u64;
        let e = c
            .write(devctl, &(exp::DEVCTL_BCR_FLR | 0x10).to_le_bytes())
            .expect("write");
        assert!(e.flr);
        let mut b = [0u8; 2];
        c.read(devctl, &mut b);
        assert_eq!(u16::from_le_bytes(b) & exp::DEVCTL_BCR_FLR, 0);
        assert!(c.u32(exp + exp::DEVCAP) & exp::DEVCAP_FLR != 0);
    }

    #[test]
    fn msix_control_and_reset() {
        let mut c = sample();
        let m = c.msix_offset().expect("msix") as u64;
        let e = c.write(m + 2, &0xc007u16.to_le_bytes()).expect("write");
        assert!(e.msix_control);
        assert!(c.msix_enabled() && c.msix_function_masked());
        // Table size is read-only.
        assert_eq!(c.u16(m as usize + 2) & 0x7ff, 7);
        wr32(&mut c, 4, 0x6);
        assert!(c.bus_master());
        c.reset();
        assert!(!c.msix_enabled() && !c.bus_master());
    }

    /// PM, PCI Express and an MSI capability requesting 4 vectors, no MSI-X.
    fn sample_msi() -> ConfigSpace {
        let mut c = ConfigSpace::new(PciIds {
            vendor: 0x1234,
            device: 0x5678,
            subsystem_vendor: 0x1234,
            subsystem: 1,
            revision: 2,
            class: 0x030200,
        });
        c.add_pm_cap();
        c.add_pcie_cap();
        c.add_msi_cap(2);
        c.seal();
        c
    }

    fn cap_ids(c: &ConfigSpace) -> Vec<(u8, usize)> {
        let mut caps = vec![];
        let mut p = c.bytes[regs::CAP_PTR] as usize;
        while p != 0 {
            assert_eq!(p % 4, 0, "capabilities are dword aligned");
            assert!(p >= 0x40);
            caps.push((c.bytes[p], p));
            p = c.bytes[p + 1] as usize;
            assert!(caps.len() < 16, "capability loop");
        }
        caps
    }

    #[test]
    fn msi_capability_is_chained() {
        let c = sample_msi();
        let caps = cap_ids(&c);
        let ids: Vec<u8> = caps.iter().map(|c| c.0).collect();
        assert_eq!(ids, vec![cap_id::PM, cap_id::EXP, cap_id::MSI]);
        let m = c.msi_offset().expect("msi");
        assert_eq!(caps[2].1, m);
        assert_eq!(c.msix_offset(), None);
        assert!(!c.msix_enabled());
        // Power-on: disabled, one vector allocated, 64-bit capable, MMC = log2(4).
        assert_eq!(c.u16(m + msi::CONTROL), msi::CTL_64BIT | (2 << 1));
        assert!(!c.msi_enabled());
        assert_eq!(c.msi_vectors_enabled(), 1);
        for reg in [msi::ADDRESS_LO, msi::ADDRESS_HI] {
            assert_eq!(c.u32(m + reg), 0);
        }
        assert_eq!(c.u16(m + msi::DATA), 0);
        // A capability added after it is chained behind the 14 bytes, dword aligned.
        let mut more = sample_msi();
        let next = more.add_msix_cap(MsixLayout {
            vectors: 1,
            table_bar: 0,
            table_offset: 0,
            pba_bar: 0,
            pba_offset: 0x800,
        });
        assert_eq!(next, m + 0x10);
        assert_eq!(more.bytes[m + 1] as usize, next);
    }

    #[test]
    fn msi_read_only_and_writable_bits() {
        let mut c = sample_msi();
        let m = c.msi_offset().expect("msi");
        // Message Control: only enable and MME take a write; MMC and the 64-bit bit stay.
        let e = c
            .write((m + msi::CONTROL) as u64, &0xffffu16.to_le_bytes())
            .expect("write");
        assert!(e.msi_control && !e.msix_control && !e.flr && !e.command);
        assert_eq!(
            c.u16(m + msi::CONTROL),
            msi::CTL_64BIT | (2 << 1) | msi::CTL_MME_MASK | msi::CTL_ENABLE
        );
        // Writing MMC alone changes nothing.
        let e = c
            .write((m + msi::CONTROL) as u64, &0x0071u16.to_le_bytes())
            .expect("write");
        assert!(!e.msi_control, "same value");
        // The capability header is read-only.
        wr32(&mut c, m as u64, 0xffff_0000);
        assert_eq!(c.bytes[m], cap_id::MSI);
        assert_eq!(c.bytes[m + 1], 0, "last capability");
        // Address: bits 1:0 read zero; the high half is fully writable.
        wr32(&mut c, (m + msi::ADDRESS_LO) as u64, 0xffff_ffff);
        assert_eq!(rd32(&c, (m + msi::ADDRESS_LO) as u64), 0xffff_fffc);
        wr32(&mut c, (m + msi::ADDRESS_HI) as u64, 0xffff_ffff);
        assert_eq!(rd32(&c, (m + msi::ADDRESS_HI) as u64), 0xffff_ffff);
        // Data: 16 bits; the two bytes above it (extended message data) stay zero.
        let e = wr32(&mut c, (m + msi::DATA) as u64, 0xffff_ffff);
        assert!(!e.msi_control);
        assert_eq!(rd32(&c, (m + msi::DATA) as u64), 0x0000_ffff);
    }

    #[test]
    fn msi_enable_and_vector_allocation() {
        let mut c = sample_msi();
        let ctl = (c.msi_offset().expect("msi") + msi::CONTROL) as u64;
        // Allocate 4 vectors (MME = 2) without enabling.
        let e = c.write(ctl, &0x0020u16.to_le_bytes()).expect("write");
        assert!(e.msi_control);
        assert!(!c.msi_enabled());
        assert_eq!(c.msi_vectors_enabled(), 4);
        let e = c.write(ctl, &0x0021u16.to_le_bytes()).expect("write");
        assert!(e.msi_control);
        assert!(c.msi_enabled());
        assert_eq!(c.msi_vectors_enabled(), 4);
        // A byte write to the low half reaches the enable bit.
        let e = c.write(ctl, &[0x00]).expect("write");
        assert!(e.msi_control && !c.msi_enabled());
        assert_eq!(c.msi_vectors_enabled(), 1);
        // A device without the capability.
        let plain = sample();
        assert_eq!(plain.msi_offset(), None);
        assert!(!plain.msi_enabled());
        assert_eq!(plain.msi_vectors_enabled(), 0);
    }

    #[test]
    fn msi_reset_returns_to_power_on() {
        let mut c = sample_msi();
        let m = c.msi_offset().expect("msi");
        let power_on = c.bytes.clone();
        wr32(&mut c, (m + msi::ADDRESS_LO) as u64, 0xfee0_1000);
        wr32(&mut c, (m + msi::ADDRESS_HI) as u64, 0x1);
        wr32(&mut c, (m + msi::DATA) as u64, 0x4041);
        c.write((m + msi::CONTROL) as u64, &0x0011u16.to_le_bytes())
            .expect("write");
        assert!(c.msi_enabled());
        assert_eq!(c.msi_vectors_enabled(), 2);
        c.reset();
        assert_eq!(c.bytes, power_on);
        assert!(!c.msi_enabled());
        assert_eq!(c.msi_vectors_enabled(), 1);
        assert_eq!(c.u32(m + msi::ADDRESS_LO), 0);
        // The masks survive the reset.
        c.write((m + msi::CONTROL) as u64, &0x0001u16.to_le_bytes())
            .expect("write");
        assert!(c.msi_enabled());
    }

    #[test]
    #[should_panic(expected = "at most 32 vectors")]
    fn msi_rejects_more_than_32_vectors() {
        sample_msi_with(6);
    }

    fn sample_msi_with(log2: u8) -> ConfigSpace {
        let mut c = ConfigSpace::new(PciIds {
            vendor: 0x1234,
            device: 0x5678,
            subsystem_vendor: 0,
            subsystem: 0,
            revision: 0,
            class: 0,
        });
        c.add_msi_cap(log2);
        c
    }

    #[test]
    fn status_error_bits_are_write_one_to_clear() {
        let mut c = sample();
        c.bytes[regs::STATUS + 1] |= 0x80;
        c.write(regs::STATUS as u64, &[0, 0x80]);
        assert_eq!(c.bytes[regs::STATUS + 1] & 0x80, 0);
        assert_ne!(
            c.u16(regs::STATUS) & regs::STATUS_CAP_LIST,
            0,
            "RO bit kept"
        );
    }

    #[test]
    fn out_of_range_accesses_are_refused() {
        let mut c = sample();
        assert!(!c.read(4095, &mut [0; 2]));
        assert!(c.write(4094, &[0; 4]).is_none());
        assert!(c.write(u64::MAX, &[0]).is_none());
    }
}
