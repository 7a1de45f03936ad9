//! MSI-X table and pending-bit array as the device sees them.
//!
//! QEMU emulates the MSI-X table itself and tells the server which vectors to signal through
//! `SET_IRQS`; only PBA reads reach the server. Other clients may access the table through
//! `REGION_READ`/`REGION_WRITE`, so the device keeps a real table: a vector whose mask bit is set
//! in the table (or while the function mask is set) is not signalled but left pending in the PBA,
//! and delivered when it is unmasked.

use serde::{Deserialize, Serialize};

use crate::irq::{Interrupts, IrqIndex};

/// Size of one table entry.
pub const ENTRY_SIZE: u64 = 16;

/// MSI-X table + PBA state.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MsixState {
    /// Per vector: address lo, address hi, data, vector control.
    table: Vec<[u32; 4]>,
    pba: Vec<u64>,
}

impl MsixState {
    /// A table of `vectors` entries, all masked (the power-on state).
    pub fn new(vectors: u16) -> Self {
        let n = usize::from(vectors);
        Self {
            table: vec![[0, 0, 0, 1]; n],
            pba: vec![0; n.div_ceil(64)],
        }
    }

    /// Number of vectors.
    pub fn vectors(&self) -> usize {
        self.table.len()
    }

    /// Size in bytes of the table.
    pub fn table_size(&self) -> u64 {
        self.table.len() as u64 * ENTRY_SIZE
    }

    /// Size in bytes of the PBA.
    pub fn pba_size(&self) -> u64 {
        self.pba.len() as u64 * 8
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

    /// Writes to the table; unmasking a pending vector delivers it through `irqs`.
    pub fn table_write(
        &mut self,
        offset: u64,
        data: &[u8],
        function_masked: bool,
        irqs: &Interrupts,
    ) {
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
        self.deliver_pending(function_masked, irqs);
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

    /// Signals `vector` unless it is masked, in which case it becomes pending.
    pub fn fire(&mut self, vector: usize, function_masked: bool, irqs: &Interrupts) {
        if vector >= self.table.len() {
            return;
        }
        if self.masked(vector, function_masked) {
            self.set_pending(vector, true);
            return;
        }
        if let Err(e) = irqs.trigger(IrqIndex::Msix, vector as u32) {
            tracing::warn!(vector, error = %e, "cannot signal MSI-X vector");
        }
    }

    /// Delivers every pending vector that is no longer masked (after a table or function mask
    /// change).
    pub fn deliver_pending(&mut self, function_masked: bool, irqs: &Interrupts) {
        for v in 0..self.table.len() {
            if self.pending(v) && !self.masked(v, function_masked) {
                self.set_pending(v, false);
                if let Err(e) = irqs.trigger(IrqIndex::Msix, v as u32) {
                    tracing::warn!(vector = v, error = %e, "cannot signal MSI-X vector");
                }
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

    #[test]
    fn masked_vector_goes_pending_and_is_delivered_on_unmask() {
        let irqs = Interrupts::new(&[0, 0, 4]);
        let fd = new_eventfd().expect("eventfd");
        irqs.set_triggers(2, 1, vec![Some(fd.try_clone().expect("clone"))])
            .expect("assign");
        let mut m = MsixState::new(4);
        // Power-on: masked.
        m.fire(1, false, &irqs);
        assert!(m.pending(1));
        let mut pba = [0u8; 8];
        m.pba_read(0, &mut pba);
        assert_eq!(pba[0], 0b10);
        assert_eq!(take_eventfd(&fd), None);
        // Unmask through the table (vector control of entry 1 at 16 + 12).
        m.table_write(16 + 12, &0u32.to_le_bytes(), false, &irqs);
        assert!(!m.pending(1));
        assert_eq!(take_eventfd(&fd), Some(1));
        // Unmasked: fires directly.
        m.fire(1, false, &irqs);
        assert_eq!(take_eventfd(&fd), Some(1));
        // Function mask holds it.
        m.fire(1, true, &irqs);
        assert!(m.pending(1));
        m.deliver_pending(false, &irqs);
        assert_eq!(take_eventfd(&fd), Some(1));
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
