//! MSI-X table and pending-bit array as the device sees them.
//!
//! QEMU and Cloud Hypervisor emulate the MSI-X table themselves and tell the server which
//! vectors to signal through `SET_IRQS`; they never write the table to the device and mask by
//! re-routing (or masking) the eventfd. So until a client writes the table through
//! `REGION_WRITE` ([`MsixState::direct`]), the device ignores its own table and signals every
//! vector directly. Once it has, the table's masks apply: a vector whose mask bit is set in the
//! table (or while the function mask is set) is not signalled but left pending in the PBA, and
//! delivered when it is unmasked.

use serde::{Deserialize, Serialize};

use crate::irq::{Interrupts, IrqIndex};

/// Size of one table entry.
pub const ENTRY_SIZE: u64 = 16;

/// Where [`MsixState`] sends the messages it decides to send: [`Interrupts`] (the client's
/// eventfds), or a device's own list of messages to send later (e.g. once it has published
/// the state that caused them).
pub trait MsixSignal {
    /// Sends MSI-X `vector`.
    fn signal(&self, vector: u32);
}

impl MsixSignal for Interrupts {
    fn signal(&self, vector: u32) {
        self.notify(IrqIndex::Msix, vector);
    }
}

/// MSI-X table + PBA state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MsixState {
    /// Per vector: address lo, address hi, data, vector control.
    table: Vec<[u32; 4]>,
    pba: Vec<u64>,
    /// The client has written the table (see the module documentation).
    #[serde(default)]
    direct: bool,
}

impl MsixState {
    /// A table of `vectors` entries, all masked (the power-on state).
    pub fn new(vectors: u16) -> Self {
        let n = usize::from(vectors);
        Self {
            table: vec![[0, 0, 0, 1]; n],
            pba: vec![0; n.div_ceil(64)],
            direct: false,
        }
    }

    /// Number of vectors.
    pub fn vectors(&self) -> usize {
        self.table.len()
    }

    /// Whether the client has written the table, so that its masks and the function mask
    /// apply. Until then every vector is signalled directly.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Sets [`MsixState::direct`], e.g. from a saved state that kept the flag elsewhere.
    pub fn set_direct(&mut self, direct: bool) {
        self.direct = direct;
    }

    /// Size in bytes of the table.
    pub fn table_size(&self) -> u64 {
        self.table.len() as u64 * ENTRY_SIZE
    }

    fn masked(&self, vector: usize, function_masked: bool) -> bool {
        function_masked || self.table.get(vector).is_none_or(|e| e[3] & 1 != 0)
    }

    /// Reads from the table at `offset` (relative to the table start). Out-of-range bytes read
    /// as zero.
    pub fn table_read(&self, offset: u64, buf: &mut [u8]) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| {
                    let e = self.table.get(usize::try_from(o / ENTRY_SIZE).ok()?)?;
                    let word = e[((o % ENTRY_SIZE) / 4) as usize];
                    Some(word.to_le_bytes()[(o % 4) as usize])
                })
                .unwrap_or(0);
        }
    }

    /// Writes to the table; unmasking a pending vector delivers it through `irqs` unless `held`
    /// (the function mask is set or MSI-X is disabled). A write that reaches the table makes it
    /// [`MsixState::direct`]. Reserved bits (address bits 1:0, vector control bits 31:1) stay 0.
    pub fn table_write(&mut self, offset: u64, data: &[u8], held: bool, irqs: &impl MsixSignal) {
        if offset < self.table_size() {
            self.direct = true;
        }
        for (i, &v) in data.iter().enumerate() {
            let Some(o) = offset.checked_add(i as u64) else {
                return;
            };
            let Some(e) = usize::try_from(o / ENTRY_SIZE)
                .ok()
                .and_then(|n| self.table.get_mut(n))
            else {
                continue;
            };
            let w = ((o % ENTRY_SIZE) / 4) as usize;
            let mut bytes = e[w].to_le_bytes();
            bytes[(o % 4) as usize] = v;
            e[w] = u32::from_le_bytes(bytes);
        }
        for e in &mut self.table {
            e[0] &= !3;
            e[3] &= 1;
        }
        self.deliver_pending(held, irqs);
    }

    /// Reads the PBA at `offset` (relative to the PBA start).
    pub fn pba_read(&self, offset: u64, buf: &mut [u8]) {
        for (i, b) in buf.iter_mut().enumerate() {
            *b = offset
                .checked_add(i as u64)
                .and_then(|o| {
                    let w = self.pba.get(usize::try_from(o / 8).ok()?)?;
                    Some(w.to_le_bytes()[(o % 8) as usize])
                })
                .unwrap_or(0);
        }
    }

    /// Whether `vector` is pending.
    pub fn pending(&self, vector: usize) -> bool {
        self.pba
            .get(vector / 64)
            .is_some_and(|w| w & (1 << (vector % 64)) != 0)
    }

    fn set_pending(&mut self, vector: usize, on: bool) {
        if let Some(w) = self.pba.get_mut(vector / 64) {
            if on {
                *w |= 1 << (vector % 64);
            } else {
                *w &= !(1 << (vector % 64));
            }
        }
    }

    /// Signals `vector` (the caller has checked that MSI-X is enabled). Once the table is
    /// [`MsixState::direct`], a vector masked in the table or by `function_masked` becomes
    /// pending instead.
    pub fn fire(&mut self, vector: usize, function_masked: bool, irqs: &impl MsixSignal) {
        if vector >= self.table.len() {
            return;
        }
        if self.direct && self.masked(vector, function_masked) {
            self.set_pending(vector, true);
            return;
        }
        irqs.signal(vector as u32);
    }

    /// Delivers every pending vector that is no longer masked (after a table, function mask or
    /// MSI-X enable change) unless `held`: the function mask is set or MSI-X is disabled.
    pub fn deliver_pending(&mut self, held: bool, irqs: &impl MsixSignal) {
        for v in 0..self.table.len() {
            if self.pending(v) && !self.masked(v, held) {
                self.set_pending(v, false);
                irqs.signal(v as u32);
            }
        }
    }

    /// Back to the power-on state.
    pub fn reset(&mut self) {
        *self = Self::new(self.table.len() as u16);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::irq::{new_eventfd, take_eventfd};

    fn vector1() -> (Interrupts, std::fs::File) {
        let irqs = Interrupts::new(&[0, 0, 4]);
        let fd = new_eventfd().expect("eventfd");
        irqs.set_triggers(2, 1, vec![Some(fd.try_clone().expect("clone"))])
            .expect("assign");
        (irqs, fd)
    }

    #[test]
    fn masks_are_ignored_until_the_client_writes_the_table() {
        let (irqs, fd) = vector1();
        let mut m = MsixState::new(4);
        assert!(!m.direct());
        // Power-on: every entry is masked, but a client that emulates the table never
        // writes it, so neither the entry's mask nor the function mask holds the vector.
        m.fire(1, false, &irqs);
        assert_eq!(take_eventfd(&fd), Some(1));
        m.fire(1, true, &irqs);
        assert_eq!(take_eventfd(&fd), Some(1));
        assert!(!m.pending(1));
        // A write beyond the table (PBA side) does not count.
        m.table_write(m.table_size(), &[0; 4], false, &irqs);
        assert!(!m.direct());
        // The client programs entry 2: from now on the table's masks apply.
        m.table_write(32, &0xfee0_0000u32.to_le_bytes(), false, &irqs);
        assert!(m.direct());
        m.fire(1, false, &irqs);
        assert!(m.pending(1));
        let mut pba = [0u8; 8];
        m.pba_read(0, &mut pba);
        assert_eq!(pba[0], 0b10);
        assert_eq!(take_eventfd(&fd), None);
        // Unmasked while held (function mask or MSI-X disabled): still pending.
        m.table_write(16 + 12, &0u32.to_le_bytes(), true, &irqs);
        assert!(m.pending(1));
        assert_eq!(take_eventfd(&fd), None);
        m.deliver_pending(true, &irqs);
        assert_eq!(take_eventfd(&fd), None);
        // Released: delivered once.
        m.deliver_pending(false, &irqs);
        assert!(!m.pending(1));
        assert_eq!(take_eventfd(&fd), Some(1));
        m.deliver_pending(false, &irqs);
        assert_eq!(take_eventfd(&fd), None);
        // Unmasked: fires directly.
        m.fire(1, false, &irqs);
        assert_eq!(take_eventfd(&fd), Some(1));
        // Function mask holds it.
        m.fire(1, true, &irqs);
        assert!(m.pending(1));
        assert_eq!(take_eventfd(&fd), None);
        m.deliver_pending(false, &irqs);
        assert_eq!(take_eventfd(&fd), Some(1));
        // Masking the entry again pends it; unmasking through the table delivers it.
        m.table_write(16 + 12, &1u32.to_le_bytes(), false, &irqs);
        m.fire(1, false, &irqs);
        assert!(m.pending(1));
        m.table_write(16 + 12, &0u32.to_le_bytes(), false, &irqs);
        assert!(!m.pending(1));
        assert_eq!(take_eventfd(&fd), Some(1));
        // Reset: back to power-on, table ignored again.
        m.reset();
        assert!(!m.direct());
        m.fire(1, false, &irqs);
        assert_eq!(take_eventfd(&fd), Some(1));
    }

    #[test]
    fn reserved_bits_read_as_zero() {
        let irqs = Interrupts::new(&[0, 0, 2]);
        let mut m = MsixState::new(2);
        m.table_write(16, &[0xff; 16], false, &irqs);
        let mut b = [0u8; 16];
        m.table_read(16, &mut b);
        assert_eq!(&b[..4], &0xffff_fffcu32.to_le_bytes(), "address bits 1:0");
        assert_eq!(&b[4..12], &[0xff; 8]);
        assert_eq!(&b[12..], &1u32.to_le_bytes(), "vector control bits 31:1");
        // Byte-wise writes too.
        m.table_write(12, &[0xfe, 0xff], false, &irqs);
        m.table_write(0, &[0x03], false, &irqs);
        m.table_read(0, &mut b);
        assert_eq!(b[0], 0);
        assert_eq!(&b[12..], &[0, 0, 0, 0]);
    }

    #[test]
    fn table_roundtrip_and_bounds() {
        let irqs = Interrupts::new(&[0, 0, 2]);
        let mut m = MsixState::new(2);
        m.table_write(
            0,
            &[0x00, 0x10, 0xe0, 0xfe, 0, 0, 0, 0, 0x41, 0, 0, 0],
            false,
            &irqs,
        );
        let mut b = [0u8; 12];
        m.table_read(0, &mut b);
        assert_eq!(&b[..4], &[0x00, 0x10, 0xe0, 0xfe]);
        assert_eq!(b[8], 0x41);
        let mut far = [0xffu8; 4];
        m.table_read(1 << 20, &mut far);
        assert_eq!(far, [0; 4]);
        m.table_write(u64::MAX - 1, &[1, 2, 3], false, &irqs);
    }
}
