//! A replacement reading back what the previous worker published: the tables (the snapshot,
//! then the log of changes since), the session, the receive journal and the reply being sent.

use std::collections::BTreeMap;
use std::sync::Arc;

use switchyard_device::blackbox::{BlackBox, BlackBoxError};

use super::ids::FIRST_MESSAGE_ID;
use super::records::{
    LOG_ENTRIES, LOG_ENTRY, RX_RECORD, SESSION_RECORD, TABLE_LOG_AREA, TABLE_LOG_HEAD,
    TABLES_RECORD, apply_op, decode_session, decode_tables,
};
use super::{Continuity, Custody, Resumed};

impl Continuity {
    /// A continuity for a replacement: reads what the previous worker published.
    pub fn resume(
        bb: &Arc<BlackBox>,
        custody: Box<dyn Custody>,
    ) -> Result<(Self, Resumed), BlackBoxError> {
        let mut resumed = Resumed::default();
        let corrupt = |what: &str| BlackBoxError::Corrupt(what.to_owned());
        let rx = bb.record(RX_RECORD)?.read()?.unwrap_or_default();
        if rx.len() >= 16 {
            let at = u64::from_le_bytes(rx[..8].try_into().unwrap_or_default());
            let len = u64::from_le_bytes(rx[8..16].try_into().unwrap_or_default());
            resumed.pending_reply = (at != u64::MAX).then_some((at, len));
            resumed.rx = rx[16..].to_vec();
        } else if !rx.is_empty() {
            return Err(corrupt(RX_RECORD));
        }
        let mut windows = BTreeMap::new();
        if let Some(t) = bb.record(TABLES_RECORD)?.read()? {
            let (w, v, next) = decode_tables(&t).ok_or_else(|| corrupt(TABLES_RECORD))?;
            windows = w.into_iter().map(|w| (w.iova, w)).collect();
            resumed.vectors = v;
            resumed.next_id = next;
        }
        // The changes since the snapshot. Replaying one that the snapshot already has is
        // harmless: every change sets or removes entries, so a sequence applied twice ends
        // where it ended once.
        if let Some(h) = bb.record(TABLE_LOG_HEAD)?.read()? {
            let head = |i: usize| {
                h.get(i..i + 8)
                    .and_then(|b| b.try_into().ok())
                    .map(u64::from_le_bytes)
            };
            let (Some(len), Some(next)) = (head(0), head(8)) else {
                return Err(corrupt(TABLE_LOG_HEAD));
            };
            resumed.next_id = resumed.next_id.max(next);
            let log = bb.area(TABLE_LOG_AREA)?;
            let len = usize::try_from(len)
                .ok()
                .filter(|&l| l <= LOG_ENTRIES)
                .ok_or_else(|| corrupt(TABLE_LOG_HEAD))?;
            let mut e = [0u8; LOG_ENTRY];
            for i in 0..len {
                log.read_at(i * LOG_ENTRY, &mut e)?;
                apply_op(&e, &mut windows, &mut resumed.vectors)
                    .ok_or_else(|| corrupt(TABLE_LOG_AREA))?;
            }
        }
        resumed.windows = windows.into_values().collect();
        if let Some(s) = bb.record(SESSION_RECORD)?.read()? {
            resumed.version = decode_session(&s).ok_or_else(|| corrupt(SESSION_RECORD))?;
        }
        resumed.referenced = resumed
            .windows
            .iter()
            .filter_map(|w| w.fd)
            .chain(resumed.vectors.values().copied())
            .collect();
        resumed.next_id = resumed.next_id.max(FIRST_MESSAGE_ID);
        let c = Self::open(bb, custody, resumed.next_id)?;
        {
            let mut g = c.lock();
            g.windows = resumed.windows.iter().map(|w| (w.iova, *w)).collect();
            g.vectors = resumed.vectors.clone();
            for id in &resumed.referenced {
                *g.refs.entry(*id).or_default() += 1;
            }
            // A fresh snapshot of what was recovered, and an empty log.
            g.snapshot_tables();
        }
        Ok((c, resumed))
    }
}
