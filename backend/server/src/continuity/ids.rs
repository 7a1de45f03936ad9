//! Custody ids: the names the supervisor holds the client's descriptors under (see the
//! custody channel in the [module](super) documentation). One table for everyone who assigns
//! them:
//!
//! | ids | assigned by | what |
//! |---|---|---|
//! | [`CONNECTION_ID`] | fixed | the client connection, held from accept until the client leaves |
//! | the others below [`FIRST_MESSAGE_ID`] | the supervisor | its own (the device's memory objects, ...) |
//! | [`FIRST_MESSAGE_ID`] and up | the server | descriptors that came with the client's messages, numbered as they arrive |

/// Custody ids below this are the supervisor's to assign (the connection, memory objects);
/// the server numbers message descriptors from here.
pub const FIRST_MESSAGE_ID: u64 = 1 << 16;

/// Custody id of the client connection (held from accept until the client leaves).
pub const CONNECTION_ID: u64 = 2;
