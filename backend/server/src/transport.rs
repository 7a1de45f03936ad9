//! Message framing over a vfio-user stream socket, with SCM_RIGHTS fd passing (the socket
//! calls are `switchyard-endpoint`'s; replies are sent with its `send_bounded`).
//!
//! Two halves:
//!
//! - the framer, sans-IO ([`Framer`], the crate's `framer` module, a leaf that continuity
//!   uses too; re-exported here): fed the bytes and descriptors of each read, it returns
//!   complete messages, so any loop that reads a socket can use it; it also writes and reads
//!   back the receive journal crash continuity keeps ([`Framer::journal`]).
//! - `connection`, the socket I/O ([`Connection`]): the blocking loop that feeds a framer with
//!   `recvmsg` (or, with crash continuity, peeks, journals, then consumes).
//!
//! Receiving is done with one `recvmsg` into a per-connection buffer that is allocated once; a
//! read may return several pipelined messages, which are then parsed without further system
//! calls. File descriptors arrive with the bytes of the message whose `sendmsg` carried them.
//! Linux stops a stream `recvmsg` right after the segment that carried descriptors, so the
//! descriptors of one read belong to the last message that *starts* within that read's bytes;
//! that is how they are attributed here.
//!
//! Optional adaptive polling: before blocking, the receiver retries a non-blocking `recvmsg` for
//! a bounded time, so a client that sends its next request quickly never waits for the server
//! thread to be woken up.

pub(crate) mod connection;

pub use crate::framer::{FdRefusal, Framer, MAX_FDS_PER_READ, Message, TransportError};
pub use connection::Connection;

#[cfg(test)]
mod tests;
