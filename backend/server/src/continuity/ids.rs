//! Custody ids: the names the supervisor holds a worker's descriptors under (see the custody
//! channel in the [module](super) documentation). One table for everyone who assigns them
//! (the daemon's supervisor and worker, and the server), pinned disjoint by a test:
//!
//! | ids | assigned by | what |
//! |---|---|---|
//! | [`LISTENER_ID`] | fixed | the endpoint's listening socket |
//! | [`CONNECTION_ID`] | fixed | the client connection, held from accept until the client leaves |
//! | [`BLACK_BOX_ID`] | fixed | the worker's black box (its records, this module's and the device's) |
//! | [`RETIRED_IDS`] | nobody now | memory objects of workers before custody by name (a supervisor maps them to names) |
//! | [`FIRST_MESSAGE_ID`] and up | the server | descriptors that came with the client's messages, numbered as they arrive |
//!
//! The device's memory objects (VRAM, a doorbell page, ...) are not numbered: custody holds
//! them by the names the slot's `MemoryObjects` use.

use std::ops::RangeInclusive;

/// Custody id of the endpoint's listening socket.
pub const LISTENER_ID: u64 = 1;

/// Custody id of the client connection (held from accept until the client leaves).
pub const CONNECTION_ID: u64 = 2;

/// Custody id of the worker's black box memfd.
pub const BLACK_BOX_ID: u64 = 3;

/// Ids under which workers before custody by name held their memory objects (4: the
/// softgpu's VRAM, 5: a move's target VRAM, 6: the doorbell page); assigned to nothing else.
pub const RETIRED_IDS: RangeInclusive<u64> = 4..=6;

/// Custody ids below this are fixed (above); the server numbers message descriptors from
/// here.
pub const FIRST_MESSAGE_ID: u64 = 1 << 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_custody_ids_are_disjoint() {
        let fixed = [LISTENER_ID, CONNECTION_ID, BLACK_BOX_ID];
        let mut seen = std::collections::BTreeSet::new();
        for id in fixed {
            assert!(seen.insert(id), "id {id} assigned twice");
            assert!(!RETIRED_IDS.contains(&id), "id {id} is retired");
            assert!(id < FIRST_MESSAGE_ID, "id {id} among the message ids");
        }
        assert!(*RETIRED_IDS.end() < FIRST_MESSAGE_ID);
        assert!(!fixed.contains(&0), "0 is no id");
    }
}
