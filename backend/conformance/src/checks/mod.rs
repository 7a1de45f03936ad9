//! The checks. Each takes the [`Subject`](crate::Subject), builds the devices it needs on
//! fresh contexts, and panics with a message naming the subject, the check and what it found
//! (`softgpu: reset: ...`). A device's own panic during a check is a finding too: it is caught
//! and reported with the access or call that caused it.
//!
//! Where the subject declares a group absent, the check of that group asserts the absence
//! (and, for recovery, that the kind refuses to rebuild a device).

mod core;
mod groups;

pub use self::core::{capabilities, client_gone, config_space, fresh_open, region_bounds, reset};
pub use self::groups::{migration, recovery, relocation, swap};
