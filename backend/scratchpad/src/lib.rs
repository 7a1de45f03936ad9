//! Scratchpad: the smallest complete device kind, and the template for new ones.
//!
//! A device kind is one crate like this one plus one line in the registry
//! (`switchyard-kinds`' `KINDS`): `switchyard serve --device scratchpad,size=64K`, a pool
//! board's `model = "scratchpad"`, a worker killed under its client and a move to another
//! board then all work without a change to the server, the daemon or the pool. This crate
//! shows every piece such a kind has, each in the module that holds it; copy it and replace
//! the device.
//!
//! # The device
//!
//! | field | value |
//! |---|---|
//! | vendor:device | `1234:5350` (the test vendor, as the softgpu's `1234:5347`; no driver binds it) |
//! | subsystem | `1234:0001` |
//! | class | `0x050000` (memory controller, RAM) |
//! | capabilities | PCI Express endpoint (FLR capable) |
//! | interrupts | none (the five VFIO PCI indexes are described, each with 0 vectors) |
//!
//! | region | what | size | access |
//! |---|---|---|---|
//! | 0 (BAR0) | registers, 32-bit | 4 KiB | trapped; 4-byte aligned 4-byte and 8-byte aligned 8-byte accesses |
//! | 2 (BAR2) | RAM, 32-bit | `size` | trapped, any size and alignment inside the BAR; never mmapped |
//! | 7 | PCI config space | 4 KiB | trapped, any size |
//!
//! Registers (BAR0, little endian; offsets not listed read 0 and ignore writes, as do
//! writes to read-only registers):
//!
//! | offset | name | access | meaning |
//! |---|---|---|---|
//! | `0x00` | `ID` | RO, u64 | [`ID`], the bytes `SYSCRPAD` |
//! | `0x08` | `ACCUM` | RW, u64 | a write of `v` to bytes `0x08 + k .. 0x08 + k + w` adds `v << 8k`, wrapping (an 8-byte write adds `v`; two 4-byte writes add their halves); reads return the sum |
//! | `0x10` | `SIZE` | RO, u64 | the RAM's size in bytes |
//!
//! A reset (`DEVICE_RESET`, or a function level reset through the config space) zeroes
//! `ACCUM` and the RAM and returns the config space to its power-on state. Accesses outside
//! a region, or of a width or alignment the registers do not take, are refused with an error
//! (`EINVAL` on the wire), never a panic.
//!
//! # What each piece is for
//!
//! - **The kind** ([`ScratchpadKind`], module `kind`): a
//!   [`DeviceKind`](switchyard_device::kind::DeviceKind). Its options arrive as one JSON
//!   object from the command line (`size=64K`) or a pool board's TOML table; `configure`
//!   reads them once with the `opt` readers, refuses unknown ones (`opt::only`) and returns
//!   the typed configuration ([`ScratchpadConfig`], a
//!   [`KindConfig`](switchyard_device::kind::KindConfig)) that everything else takes: its
//!   canonical form (every option spelled out, so two equal forms build the same device),
//!   the pool's [`Profile`](switchyard_device::kind::Profile) of such a device (its memory,
//!   which the kind calls `ram` for people, that it can move; the rest
//!   `..Profile::default()`), `build` (a fresh device) and `recover`
//!   (rebuilds one in a replacement process).
//! - **The core** ([`Scratchpad`]'s [`PciDevice`](switchyard_device::PciDevice)): the
//!   [`DeviceDescription`](switchyard_device::DeviceDescription) (regions, interrupt
//!   indexes), region reads and writes, reset. The config space is a
//!   [`ConfigSpace`](switchyard_device::config::ConfigSpace). Memory the client sees lives
//!   with the server's slot, not the device: the RAM is the slot's memory object
//!   [`RAM_OBJECT`] (`ctx.memory`), so every device that takes the slot serves the same one.
//! - **Recovery** ([`Recoverable`](switchyard_device::Recoverable)): a pool daemon runs each
//!   endpoint in a worker process and replaces a worker that dies under its client. The
//!   device publishes what a replacement needs into a record of the worker's black box
//!   ([`STATE_RECORD`]: `ACCUM`, the config space and which RAM it runs on) *before* the
//!   change is visible, and names the memory the replacement must serve again
//!   (`held_objects`: the RAM memfd), which the daemon keeps. `KindConfig::recover` reads
//!   the record, takes the held RAM and carries on.
//! - **Relocation** ([`Relocatable`](switchyard_device::Relocatable) and
//!   [`Swappable`](switchyard_device::Swappable) with
//!   [`Quiesce`](switchyard_device::Quiesce), module `relocate`): a pool's move to another
//!   board. The worker starts a relocation (new RAM, held by the daemon as pending), runs
//!   pre-copy rounds while the client keeps writing (the first copies the whole RAM, later
//!   ones the pages written since, from a dirty bitmap every BAR2 write sets), builds a
//!   parked successor on the new RAM, catches up once more, then the server's slot swaps:
//!   the old device checks the successor and hands over (the last dirty pages, `ACCUM`, the
//!   config space, the black-box record), and the new RAM becomes the slot's.
//! - **Telemetry** ([`Telemetry`](switchyard_device::Telemetry)): work counters for the
//!   daemon's metrics (BAR2 writes as commands, the bytes they wrote, refused accesses as
//!   errors).
//!
//! A kind that cannot do one of these leaves the group out (its `PciDevice` method returns
//! `None`): a kind whose `recover` answers `NoRecovery` is started afresh when its worker
//! dies, one without
//! `Relocatable` says `movable: false` in its profile and the pool never moves it.

#![forbid(unsafe_code)]
#![warn(missing_docs)]
// Every dependency is used (the test build also sees the dev-dependencies, hence not there).
#![cfg_attr(not(test), deny(unused_crate_dependencies))]

mod device;
mod kind;
mod ram;
mod relocate;

#[cfg(test)]
mod tests;

pub use device::Scratchpad;
pub use kind::{ScratchpadConfig, ScratchpadKind};
pub use ram::RamIdentity;

/// The slot's memory object holding the RAM (BAR2's backing, a sealed memfd).
pub const RAM_OBJECT: &str = "scratchpad.ram";

/// The black-box record of the device state (`ACCUM`, the config space, the RAM's identity).
pub const STATE_RECORD: &str = "scratchpad.state";

/// Region index of the registers.
pub const BAR_REGS: u32 = 0;
/// Region index of the RAM.
pub const BAR_RAM: u32 = 2;

/// Size of the register BAR.
pub const REGS_SIZE: u64 = 4096;
/// Offset of `ID`.
pub const REG_ID: u64 = 0x00;
/// Offset of `ACCUM`.
pub const REG_ACCUM: u64 = 0x08;
/// Offset of `SIZE`.
pub const REG_SIZE: u64 = 0x10;
/// What `ID` reads.
pub const ID: u64 = u64::from_le_bytes(*b"SYSCRPAD");

/// PCI vendor ID (the de-facto test vendor).
pub const PCI_VENDOR_ID: u16 = 0x1234;
/// PCI device ID.
pub const PCI_DEVICE_ID: u16 = 0x5350;

/// Smallest RAM.
pub const MIN_SIZE: u64 = 4 << 10;
/// Largest RAM.
pub const MAX_SIZE: u64 = 64 << 20;
/// RAM when `size` is not given.
pub const DEFAULT_SIZE: u64 = 1 << 20;

/// Why a scratchpad could not be built, recovered or relocated.
#[derive(Debug, thiserror::Error)]
pub enum ScratchpadError {
    /// The RAM memfd could not be created, sized, sealed, read or written.
    #[error("Cannot use the RAM memfd")]
    Ram(#[source] std::io::Error),
    /// A RAM memfd handed over is not sealed against shrinking and growing.
    #[error("The RAM memfd is not sealed against shrinking and growing")]
    NotSealed,
    /// A RAM memfd handed over (or the slot's) is of another size.
    #[error("The RAM holds {actual} bytes, not {expected}")]
    RamSize {
        /// The device's size.
        expected: u64,
        /// The memfd's.
        actual: u64,
    },
    /// The held RAM is not the one the black box says the device ran on.
    #[error("The RAM handed over is not the one the device ran on (saved {saved:?}, got {got:?})")]
    RamMismatch {
        /// What the black box says.
        saved: RamIdentity,
        /// What was handed over.
        got: RamIdentity,
    },
    /// The black box cannot be used.
    #[error("The black box cannot be used")]
    BlackBox(#[from] switchyard_device::blackbox::BlackBoxError),
    /// The black box holds no published state.
    #[error("The black box holds no scratchpad state")]
    NoState,
    /// The black box's state cannot be used.
    #[error("The saved state is unusable: {0}")]
    BadState(&'static str),
    /// The RAM size is not one a scratchpad can have.
    #[error("{0} bytes is not a RAM size (a power of two from 4 KiB to 64 MiB)")]
    Size(u64),
    /// A successor is not one this device can hand over to.
    #[error("The successor does not fit: {0}")]
    Successor(&'static str),
}

impl From<ScratchpadError> for switchyard_device::DeviceError {
    fn from(e: ScratchpadError) -> Self {
        switchyard_device::DeviceError::Failed(Box::new(e))
    }
}
