//! The identity of a memory object the device maps ([`VramRef`]): saved with the device state
//! instead of the contents. A leaf module, so the error and state types can name it without
//! depending on the VRAM mapping.

use std::fs::File;
use std::os::unix::fs::MetadataExt;

use serde::{Deserialize, Serialize};

/// Identity of the VRAM backing: saved with the device state instead of the contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct VramRef {
    /// Size in bytes.
    pub size: u64,
    /// Device number of the backing file (`st_dev`).
    pub dev: u64,
    /// Inode number of the backing file (`st_ino`).
    pub ino: u64,
}

impl VramRef {
    /// The identity of `file` as VRAM.
    pub fn of(file: &File) -> std::io::Result<VramRef> {
        let meta = file.metadata()?;
        Ok(VramRef {
            size: meta.len(),
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}
