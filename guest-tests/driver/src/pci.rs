//! PCI configuration space helpers shared by the VFIO driver and the sysfs probe.

/// Offset of the command register.
pub const PCI_COMMAND: usize = 0x04;
/// Command register: memory space decoding.
pub const PCI_COMMAND_MEMORY: u16 = 1 << 1;
/// Command register: bus mastering.
pub const PCI_COMMAND_MASTER: u16 = 1 << 2;
/// Offset of the status register.
pub const PCI_STATUS: usize = 0x06;
/// Status register: capability list present.
pub const PCI_STATUS_CAP_LIST: u16 = 1 << 4;
/// Offset of the capability pointer.
pub const PCI_CAPABILITY_LIST: usize = 0x34;

/// Little-endian u16 at `off` (0 if out of range).
pub fn le16(cfg: &[u8], off: usize) -> u16 {
    match cfg.get(off..off + 2) {
        Some(b) => u16::from_le_bytes([b[0], b[1]]),
        None => 0,
    }
}

/// Little-endian u32 at `off` (0 if out of range).
pub fn le32(cfg: &[u8], off: usize) -> u32 {
    match cfg.get(off..off + 4) {
        Some(b) => u32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        None => 0,
    }
}

/// Vendor, device and class code (24 bits) from the first bytes of config space.
pub fn identity(cfg: &[u8]) -> (u16, u16, u32) {
    (le16(cfg, 0), le16(cfg, 2), le32(cfg, 8) >> 8)
}

/// Walks the standard capability list; returns `(id, offset)` pairs in list order.
pub fn capabilities(cfg: &[u8]) -> Result<Vec<(u8, u8)>, String> {
    if cfg.len() < 0x40 {
        return Err(format!("config space too short ({} bytes)", cfg.len()));
    }
    if le16(cfg, PCI_STATUS) & PCI_STATUS_CAP_LIST == 0 {
        return Ok(Vec::new());
    }
    let mut out = Vec::new();
    let mut ptr = cfg[PCI_CAPABILITY_LIST] & 0xfc;
    while ptr != 0 {
        if ptr < 0x40 || usize::from(ptr) + 2 > cfg.len().min(256) {
            return Err(format!("capability pointer {ptr:#x} out of range"));
        }
        if out.len() >= 48 {
            return Err("capability list loops".into());
        }
        let id = cfg[usize::from(ptr)];
        out.push((id, ptr));
        ptr = cfg[usize::from(ptr) + 1] & 0xfc;
    }
    Ok(out)
}

/// Offset of capability `id`, if present.
pub fn find_capability(cfg: &[u8], id: u8) -> Option<u8> {
    capabilities(cfg)
        .ok()?
        .into_iter()
        .find(|&(i, _)| i == id)
        .map(|(_, off)| off)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A config space like the softgpu's: PM at 0x40, PCIe at 0x50, MSI-X at 0x90.
    pub fn softgpu_like() -> Vec<u8> {
        let mut c = vec![0u8; 256];
        c[0..2].copy_from_slice(&0x1234u16.to_le_bytes());
        c[2..4].copy_from_slice(&0x5347u16.to_le_bytes());
        c[8..12].copy_from_slice(&0x0302_0001u32.to_le_bytes());
        c[PCI_STATUS..PCI_STATUS + 2].copy_from_slice(&PCI_STATUS_CAP_LIST.to_le_bytes());
        c[PCI_CAPABILITY_LIST] = 0x40;
        c[0x40] = 0x01;
        c[0x41] = 0x50;
        c[0x50] = 0x10;
        c[0x51] = 0x90;
        c[0x90] = 0x11;
        c[0x91] = 0x00;
        c
    }

    #[test]
    fn walks_the_list() {
        let c = softgpu_like();
        assert_eq!(identity(&c), (0x1234, 0x5347, 0x030200));
        assert_eq!(
            capabilities(&c),
            Ok(vec![(0x01, 0x40), (0x10, 0x50), (0x11, 0x90)])
        );
        assert_eq!(find_capability(&c, 0x11), Some(0x90));
        assert_eq!(find_capability(&c, 0x05), None);
    }

    #[test]
    fn rejects_bad_lists() {
        let mut c = softgpu_like();
        c[0x91] = 0x40; // loop back to PM
        assert!(capabilities(&c).is_err());
        let mut c = softgpu_like();
        c[0x41] = 0x10; // into the header
        assert!(capabilities(&c).is_err());
        let mut c = softgpu_like();
        c[PCI_STATUS] = 0; // no capability list
        assert_eq!(capabilities(&c), Ok(vec![]));
        assert!(capabilities(&c[..0x20]).is_err());
        // Low two bits of the pointers are reserved and ignored.
        let mut c = softgpu_like();
        c[PCI_CAPABILITY_LIST] = 0x43;
        assert_eq!(capabilities(&c).map(|v| v.len()), Ok(3));
    }
}
