//! The configuration space the client sees: a shadow of the device's, not a window onto it.
//!
//! Built once from the device's own config space (read through [`RawConfig`]) and the BAR sizes
//! VFIO reports, then served from the shadow:
//!
//! | bytes | what the client gets |
//! |---|---|
//! | IDs, class, revision, subsystem | the device's, read-only |
//! | COMMAND | shadowed; the I/O, memory and bus-master bits of every write also go to the device |
//! | STATUS | read from the device (but "capability list" says whether any capability is left); write-1-to-clear bits go to the device |
//! | BAR0–5 | shadowed: all-ones reads back the size mask, addresses stay in the shadow (the host owns the real BAR addresses) |
//! | expansion ROM BAR | 0: no ROM |
//! | interrupt line / pin | line is a scratch byte; pin 0 (INTx is not offered) |
//! | capabilities | only power management, MSI, MSI-X and PCI Express are kept and relinked; everything else (vendor-specific, VPD, ...) reads 0 and ignores writes |
//! | MSI, MSI-X | emulated: enable, function mask, address, data and masks live in the shadow; the kernel programs the real capability when the client's eventfds are handed to it |
//! | power management, PCI Express control | shadowed only (the device stays in D0; its link and payload settings stay the host's) |
//! | anything else (vendor registers, extended space) | reads 0, writes dropped; no extended capability is offered |

use std::io;

/// Offset of the COMMAND register.
pub const COMMAND: usize = 0x04;
/// Offset of the STATUS register.
pub const STATUS: usize = 0x06;
/// Offset of BAR0.
pub const BAR0: usize = 0x10;
/// Offset of the expansion ROM BAR (type 0 header).
pub const ROM_BAR: usize = 0x30;
/// Offset of the capability pointer.
pub const CAP_PTR: usize = 0x34;

/// COMMAND bits whose writes go to the device: I/O space, memory space, bus master.
pub const COMMAND_FORWARDED: u16 = 0x0007;
/// COMMAND bits the client may set in the shadow.
const COMMAND_WRITABLE: u16 = 0x0547;
/// STATUS bit: the capability list exists.
const STATUS_CAP_LIST: u16 = 0x0010;
/// STATUS write-1-to-clear error bits (forwarded).
const STATUS_W1C: u16 = 0xf900;

/// Capability IDs.
pub const CAP_PM: u8 = 0x01;
/// MSI.
pub const CAP_MSI: u8 = 0x05;
/// PCI Express.
pub const CAP_EXP: u8 = 0x10;
/// MSI-X.
pub const CAP_MSIX: u8 = 0x11;

/// Where the shadow's bytes come from: the device's own config space (`pread`/`pwrite` on the
/// VFIO config region), or a fake in tests.
pub trait RawConfig {
    /// Reads `buf.len()` bytes at `offset`.
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `data` at `offset`.
    fn write(&self, offset: u64, data: &[u8]) -> io::Result<()>;
}

/// What a BAR is, from its low bits in the device's config space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BarKind {
    /// Not implemented (size 0).
    Absent,
    /// I/O space.
    Io,
    /// 32-bit memory.
    Mem32 {
        /// Prefetchable.
        prefetch: bool,
    },
    /// The low half of a 64-bit memory BAR.
    Mem64 {
        /// Prefetchable.
        prefetch: bool,
    },
    /// The high half of the 64-bit BAR before it.
    Upper,
}

/// The MSI capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsiCap {
    /// Offset in config space.
    pub offset: usize,
    /// 64-bit message address.
    pub addr64: bool,
    /// Per-vector masking.
    pub maskable: bool,
    /// Vectors the device can request (1..=32).
    pub vectors: u32,
}

impl MsiCap {
    fn len(&self) -> usize {
        let base = if self.addr64 { 14 } else { 10 };
        if self.maskable { base + 10 } else { base }
    }

    fn data_offset(&self) -> usize {
        self.offset + if self.addr64 { 12 } else { 8 }
    }
}

/// The MSI-X capability.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MsixCap {
    /// Offset in config space.
    pub offset: usize,
    /// Number of vectors (table entries).
    pub vectors: u32,
    /// BAR of the table.
    pub table_bar: u32,
    /// Offset of the table in its BAR.
    pub table_offset: u64,
    /// BAR of the pending-bit array.
    pub pba_bar: u32,
    /// Offset of the PBA in its BAR.
    pub pba_offset: u64,
}

impl MsixCap {
    /// Size of the table in bytes.
    pub fn table_size(&self) -> u64 {
        u64::from(self.vectors) * 16
    }

    /// Size of the PBA in bytes.
    pub fn pba_size(&self) -> u64 {
        u64::from(self.vectors.div_ceil(64)) * 8
    }
}

/// A capability the client sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capability {
    /// Capability ID.
    pub id: u8,
    /// Offset in config space.
    pub offset: usize,
    /// Length in bytes.
    pub len: usize,
}

/// What a config write changed that the device must act on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConfigEffects {
    /// The MSI-X enable or function mask bits changed.
    pub msix_control: bool,
    /// The MSI enable bit changed.
    pub msi_control: bool,
}

/// The virtualized configuration space (see the module documentation).
#[derive(Debug, Clone)]
pub struct VirtConfig {
    shadow: Vec<u8>,
    /// The shadow as built (the device opened): what a new client finds
    /// ([`VirtConfig::fresh`]).
    opened: Vec<u8>,
    /// Bits the client may write into the shadow.
    wmask: Vec<u8>,
    /// Bits whose writes also go to the device.
    forward: Vec<u8>,
    /// Bits read from the device on every read.
    live: Vec<u8>,
    bars: [BarKind; 6],
    bar_sizes: [u64; 6],
    caps: Vec<Capability>,
    hidden: Vec<(u8, usize)>,
    msi: Option<MsiCap>,
    msix: Option<MsixCap>,
}

/// The errors of building the shadow.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// Reading the device's config space failed.
    #[error("Cannot read the device's config space")]
    Read(#[source] io::Error),
    /// The device is not a type 0 (endpoint) function.
    #[error(
        "Header type {0:#04x} is not a type 0 (endpoint) header; bridges cannot be passed through"
    )]
    NotEndpoint(u8),
    /// A BAR size is not a power of two.
    #[error("BAR{bar} has size {size:#x}, which is not a power of two")]
    BarSize {
        /// BAR index.
        bar: usize,
        /// Its size.
        size: u64,
    },
}

fn get16(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn get32(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

fn put16(b: &mut [u8], o: usize, v: u16) {
    b[o..o + 2].copy_from_slice(&v.to_le_bytes());
}

fn put32(b: &mut [u8], o: usize, v: u32) {
    b[o..o + 4].copy_from_slice(&v.to_le_bytes());
}

impl VirtConfig {
    /// Builds the shadow of a config space of `size` bytes (256 or 4096) from `raw`, with the
    /// BAR sizes VFIO reports (regions 0–5; 0 = no BAR, and 0 for the upper half of a 64-bit
    /// BAR).
    pub fn new(
        raw: &dyn RawConfig,
        size: usize,
        bar_sizes: [u64; 6],
    ) -> Result<VirtConfig, ConfigError> {
        let size = size.clamp(256, 4096);
        let mut dev = vec![0u8; size];
        raw.read(0, &mut dev).map_err(ConfigError::Read)?;
        let header_type = dev[0x0e] & 0x7f;
        if header_type != 0 {
            return Err(ConfigError::NotEndpoint(dev[0x0e]));
        }
        let mut shadow = vec![0u8; size];
        let mut wmask = vec![0u8; size];
        let mut forward = vec![0u8; size];
        let mut live = vec![0u8; size];
        // IDs, command, status, revision, class, cache line, latency, header type, BIST.
        shadow[..0x10].copy_from_slice(&dev[..0x10]);
        // Not a multi-function device as far as the client knows.
        shadow[0x0e] = 0;
        shadow[0x0f] = 0; // No BIST.
        put16(&mut wmask, COMMAND, COMMAND_WRITABLE);
        put16(&mut forward, COMMAND, COMMAND_FORWARDED);
        // Only the forwarded bits are what the device has; the client starts with the rest off.
        let command = get16(&dev, COMMAND) & COMMAND_FORWARDED;
        put16(&mut shadow, COMMAND, command);
        put16(&mut forward, STATUS, STATUS_W1C);
        put16(&mut live, STATUS, !STATUS_CAP_LIST);
        wmask[0x0c] = 0xff; // Cache line size.
        wmask[0x0d] = 0xff; // Latency timer.
        // Subsystem IDs.
        shadow[0x2c..0x30].copy_from_slice(&dev[0x2c..0x30]);
        // Interrupt line: scratch. Pin: 0, no INTx.
        wmask[0x3c] = 0xff;

        // BARs.
        let mut bars = [BarKind::Absent; 6];
        let mut sizes = [0u64; 6];
        let mut i = 0;
        while i < 6 {
            let o = BAR0 + 4 * i;
            let low = get32(&dev, o);
            let size = bar_sizes[i];
            if size == 0 {
                i += 1;
                continue;
            }
            if !size.is_power_of_two() {
                return Err(ConfigError::BarSize { bar: i, size });
            }
            if low & 1 == 1 {
                bars[i] = BarKind::Io;
                sizes[i] = size;
                put32(&mut shadow, o, 1);
                put32(&mut wmask, o, !(size.max(4) as u32 - 1) & !0x3);
                i += 1;
                continue;
            }
            let prefetch = low & 0x8 != 0;
            let mem64 = (low >> 1) & 0x3 == 0x2;
            let size = size.max(16);
            sizes[i] = size;
            let flags = low & 0xf;
            put32(&mut shadow, o, flags);
            put32(&mut wmask, o, !((size - 1) as u32) & !0xf);
            if mem64 && i < 5 {
                bars[i] = BarKind::Mem64 { prefetch };
                bars[i + 1] = BarKind::Upper;
                sizes[i + 1] = size;
                put32(&mut wmask, o + 4, (!(size - 1) >> 32) as u32);
                i += 2;
            } else {
                bars[i] = BarKind::Mem32 { prefetch };
                i += 1;
            }
        }
        // ROM BAR (0x30): 0, read-only.

        // Capabilities: walk the device's list, keep what the client may drive.
        let mut caps = Vec::new();
        let mut hidden = Vec::new();
        let mut msi = None;
        let mut msix = None;
        if get16(&dev, STATUS) & STATUS_CAP_LIST != 0 {
            let mut ptr = usize::from(dev[CAP_PTR] & 0xfc);
            let mut seen = 0;
            while ptr >= 0x40 && ptr + 2 <= 256 && seen < 48 {
                seen += 1;
                let id = dev[ptr];
                let next = usize::from(dev[ptr + 1] & 0xfc);
                let len = match id {
                    CAP_PM => Some(8),
                    CAP_MSI => {
                        let ctl = get16(&dev, ptr + 2);
                        let cap = MsiCap {
                            offset: ptr,
                            addr64: ctl & 0x80 != 0,
                            maskable: ctl & 0x100 != 0,
                            vectors: 1 << ((ctl >> 1) & 0x7).min(5),
                        };
                        msi = Some(cap);
                        Some(cap.len())
                    }
                    CAP_MSIX => {
                        let ctl = get16(&dev, ptr + 2);
                        let table = get32(&dev, ptr + 4);
                        let pba = get32(&dev, ptr + 8);
                        msix = Some(MsixCap {
                            offset: ptr,
                            vectors: u32::from(ctl & 0x7ff) + 1,
                            table_bar: table & 0x7,
                            table_offset: u64::from(table & !0x7),
                            pba_bar: pba & 0x7,
                            pba_offset: u64::from(pba & !0x7),
                        });
                        Some(12)
                    }
                    CAP_EXP => {
                        let version = get16(&dev, ptr + 2) & 0xf;
                        Some(if version >= 2 { 0x3c } else { 0x14 })
                    }
                    _ => None,
                };
                match len {
                    Some(len) if ptr + len <= 256 => caps.push(Capability {
                        id,
                        offset: ptr,
                        len,
                    }),
                    _ => hidden.push((id, ptr)),
                }
                ptr = next;
            }
        }
        // Relink the kept capabilities in their original order.
        let mut next_ptr = 0u8;
        for cap in caps.iter().rev() {
            shadow[cap.offset..cap.offset + cap.len]
                .copy_from_slice(&dev[cap.offset..cap.offset + cap.len]);
            shadow[cap.offset + 1] = next_ptr;
            next_ptr = cap.offset as u8;
        }
        shadow[CAP_PTR] = next_ptr;
        let mut status = get16(&dev, STATUS) & !STATUS_CAP_LIST;
        if !caps.is_empty() {
            status |= STATUS_CAP_LIST;
        }
        put16(&mut shadow, STATUS, status);

        // What the client may write in each kept capability.
        for cap in &caps {
            let o = cap.offset;
            match cap.id {
                CAP_PM => {
                    // PMCSR: power state and PME enable, shadow only (the device stays in D0).
                    put16(&mut wmask, o + 4, 0x0103);
                    put16(&mut shadow, o + 4, get16(&dev, o + 4) & !0x0103);
                }
                CAP_MSI => {
                    let m = msi.unwrap_or(MsiCap {
                        offset: o,
                        addr64: false,
                        maskable: false,
                        vectors: 1,
                    });
                    // Enable and multiple message enable; the client starts with MSI off.
                    put16(&mut wmask, o + 2, 0x0071);
                    let ctl = get16(&dev, o + 2) & !0x0071;
                    put16(&mut shadow, o + 2, ctl);
                    put32(&mut wmask, o + 4, 0xffff_fffc);
                    put32(&mut shadow, o + 4, 0);
                    if m.addr64 {
                        put32(&mut wmask, o + 8, 0xffff_ffff);
                        put32(&mut shadow, o + 8, 0);
                    }
                    let d = m.data_offset();
                    put16(&mut wmask, d, 0xffff);
                    put16(&mut shadow, d, 0);
                    if m.maskable {
                        let mask_bits = if m.vectors >= 32 {
                            u32::MAX
                        } else {
                            (1u32 << m.vectors) - 1
                        };
                        put32(&mut wmask, d + 4, mask_bits);
                        put32(&mut shadow, d + 4, 0);
                        put32(&mut shadow, d + 8, 0);
                    }
                }
                CAP_MSIX => {
                    // Enable and function mask; the client starts with MSI-X off.
                    put16(&mut wmask, o + 2, 0xc000);
                    let ctl = get16(&dev, o + 2) & !0xc000;
                    put16(&mut shadow, o + 2, ctl);
                }
                CAP_EXP => {
                    // Device control, link control (and their v2 twins): shadow only.
                    put16(&mut wmask, o + 8, 0x7fff);
                    wmask[o + 0x10] = 0xfb;
                    if cap.len >= 0x3c {
                        put16(&mut wmask, o + 0x28, 0xffff);
                        put16(&mut wmask, o + 0x30, 0xffff);
                    }
                }
                _ => {}
            }
        }
        // Extended space (PCIe, 4 KiB): a zero header at 0x100 ends the (empty) list.

        Ok(VirtConfig {
            opened: shadow.clone(),
            shadow,
            wmask,
            forward,
            live,
            bars,
            bar_sizes: sizes,
            caps,
            hidden,
            msi,
            msix,
        })
    }

    /// Size of the config space offered.
    pub fn size(&self) -> usize {
        self.shadow.len()
    }

    /// The kinds of BAR0–5.
    pub fn bars(&self) -> &[BarKind; 6] {
        &self.bars
    }

    /// The sizes of BAR0–5 (the upper half of a 64-bit BAR repeats the size).
    pub fn bar_sizes(&self) -> &[u64; 6] {
        &self.bar_sizes
    }

    /// The capabilities offered, in list order.
    pub fn capabilities(&self) -> &[Capability] {
        &self.caps
    }

    /// The capabilities hidden from the client: (ID, offset).
    pub fn hidden_capabilities(&self) -> &[(u8, usize)] {
        &self.hidden
    }

    /// The MSI capability, if offered.
    pub fn msi(&self) -> Option<MsiCap> {
        self.msi
    }

    /// The MSI-X capability, if offered.
    pub fn msix(&self) -> Option<MsixCap> {
        self.msix
    }

    /// Whether the client has enabled MSI-X.
    pub fn msix_enabled(&self) -> bool {
        self.msix
            .is_some_and(|m| get16(&self.shadow, m.offset + 2) & 0x8000 != 0)
    }

    /// Whether the client has set the MSI-X function mask.
    pub fn msix_function_masked(&self) -> bool {
        self.msix
            .is_some_and(|m| get16(&self.shadow, m.offset + 2) & 0x4000 != 0)
    }

    /// Whether the client has enabled MSI.
    pub fn msi_enabled(&self) -> bool {
        self.msi
            .is_some_and(|m| get16(&self.shadow, m.offset + 2) & 0x1 != 0)
    }

    /// The COMMAND register as the client set it.
    pub fn command(&self) -> u16 {
        get16(&self.shadow, COMMAND)
    }

    /// The shadow as it is now.
    pub fn shadow(&self) -> &[u8] {
        &self.shadow
    }

    fn check(&self, offset: u64, len: usize) -> io::Result<usize> {
        let start =
            usize::try_from(offset).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        if start
            .checked_add(len)
            .is_none_or(|end| end > self.shadow.len())
        {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(start)
    }

    /// The pieces of `[start, start+len)` cut at dword boundaries (a register never crosses
    /// one) that have a bit set in `mask`: (offset, length). Allocation-free.
    fn dwords_with<'a>(
        mask: &'a [u8],
        start: usize,
        len: usize,
    ) -> impl Iterator<Item = (usize, usize)> + 'a {
        let end = start + len;
        let first = start & !3;
        (first..end).step_by(4).filter_map(move |dw| {
            let (a, b) = (dw.max(start), (dw + 4).min(end));
            mask[a..b].iter().any(|&m| m != 0).then_some((a, b - a))
        })
    }

    /// Serves a client read: shadow bytes, with the live bits read from the device (one
    /// device read per register touched; nothing is allocated).
    pub fn read(&self, raw: &dyn RawConfig, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let start = self.check(offset, buf.len())?;
        buf.copy_from_slice(&self.shadow[start..start + buf.len()]);
        for (a, n) in Self::dwords_with(&self.live, start, buf.len()) {
            let mut dev = [0u8; 4];
            raw.read(a as u64, &mut dev[..n])?;
            for (i, d) in dev[..n].iter().enumerate() {
                let m = self.live[a + i];
                let b = &mut buf[a - start + i];
                *b = (*b & !m) | (d & m);
            }
        }
        Ok(())
    }

    /// Serves a client write: writable bits land in the shadow, forwarded bits also go to the
    /// device (the device's other bits of those bytes unchanged), the rest is dropped.
    pub fn write(
        &mut self,
        raw: &dyn RawConfig,
        offset: u64,
        data: &[u8],
    ) -> io::Result<ConfigEffects> {
        let start = self.check(offset, data.len())?;
        let msix_before = self
            .msix
            .map(|m| get16(&self.shadow, m.offset + 2) & 0xc000);
        let msi_before = self.msi_enabled();
        // Read-modify-write of the forwarded bits, per register as the client wrote it.
        for (a, n) in Self::dwords_with(&self.forward, start, data.len()) {
            let mut dev = [0u8; 4];
            raw.read(a as u64, &mut dev[..n])?;
            for (i, d) in dev[..n].iter_mut().enumerate() {
                let (fwd, live) = (self.forward[a + i], self.live[a + i]);
                // Write-1-to-clear bits (live and forwarded) must not be written back as read.
                let keep = !fwd & !live;
                *d = (*d & keep) | (data[a - start + i] & fwd);
            }
            raw.write(a as u64, &dev[..n])?;
        }
        for (i, &v) in data.iter().enumerate() {
            let o = start + i;
            let m = self.wmask[o];
            self.shadow[o] = (self.shadow[o] & !m) | (v & m);
        }
        Ok(ConfigEffects {
            msix_control: self
                .msix
                .map(|m| get16(&self.shadow, m.offset + 2) & 0xc000)
                != msix_before,
            msi_control: self.msi_enabled() != msi_before,
        })
    }

    /// Takes the client's bits (those it may write) from `saved`, another shadow of the same
    /// size (a migration source's); the rest stays this device's. Nothing goes to the device
    /// (see [`VirtConfig::reapply`]).
    pub fn load_client_bits(&mut self, saved: &[u8]) {
        for ((s, &v), &m) in self.shadow.iter_mut().zip(saved).zip(&self.wmask) {
            *s = (*s & !m) | (v & m);
        }
    }

    /// Back to the shadow as it was when the device was opened, for a new client (kernel
    /// vfio-pci resets a device a user opens): COMMAND, BAR addresses, MSI and MSI-X
    /// control and message, PCI Express control, everything a previous client wrote. Nothing
    /// goes to the device (see [`VirtConfig::reapply`]).
    pub fn fresh(&mut self) {
        self.shadow.clone_from(&self.opened);
    }

    /// Writes the forwarded state of the shadow (COMMAND's I/O, memory, bus-master bits) to the
    /// device again, after a reset put the device's own config back to what the kernel saved.
    /// The shadow itself (BAR addresses, MSI state) is the client's and stays as it is.
    pub fn reapply(&self, raw: &dyn RawConfig) -> io::Result<()> {
        let mut cmd = [0u8; 2];
        raw.read(COMMAND as u64, &mut cmd)?;
        let v =
            (u16::from_le_bytes(cmd) & !COMMAND_FORWARDED) | (self.command() & COMMAND_FORWARDED);
        raw.write(COMMAND as u64, &v.to_le_bytes())
    }
}

#[cfg(test)]
mod tests;
