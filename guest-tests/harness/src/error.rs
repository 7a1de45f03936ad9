//! The harness's error type and its [`Result`] alias.

use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

/// Errors of the harness.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A required file is missing.
    #[error("{what} not found at {path}: {hint}")]
    Missing {
        /// What is missing.
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// How to get it.
        hint: &'static str,
    },
    /// Starting or talking to a process failed.
    #[error("{0}")]
    Io(String, #[source] std::io::Error),
    /// A step did not happen in time.
    #[error("Timed out after {0:?} waiting for {1}")]
    Timeout(Duration, String),
    /// A process exited unexpectedly.
    #[error("{0} exited early: {1}")]
    Exited(&'static str, ExitStatus),
    /// The guest ended without powering off cleanly.
    #[error("The guest did not finish cleanly: {0}")]
    Unclean(String),
    /// A [`GuestSpec`](crate::GuestSpec) that cannot be passed on the kernel command line.
    #[error("Bad guest spec: {0}")]
    BadSpec(String),
    /// Building the QEMU command line failed.
    #[error("Cannot build the QEMU command line")]
    Qemu(#[source] switchyard_qemu::QemuError),
    /// The guest's kernel panicked at boot, before its test's code ran, on every boot it was
    /// given ([`Guest::booted`](crate::Guest::booted)).
    #[error("The guest's kernel panicked at boot again, before the test's own code ran: {0}")]
    BootPanic(String),
    /// Building the initramfs failed.
    #[error("Building the initramfs failed: {0}")]
    Initramfs(String),
}

/// Result alias.
pub type Result<T> = std::result::Result<T, HarnessError>;
