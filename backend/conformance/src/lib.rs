//! The conformance suite of Switchyard's devices: one set of checks that every device kind and
//! every mock runs, the way crosvm's `suspendable_tests!` makes every device pass the same
//! suspend/resume tests.
//!
//! A [`Subject`] says how to make the device on a fresh [`DeviceContext`](switchyard_device::DeviceContext)
//! (a [`DeviceKind`](switchyard_device::kind::DeviceKind) with options, or a closure for a
//! mock) and which optional capability groups it declares ([`Groups`]). Each check in
//! [`checks`] takes the subject, builds what it needs and panics with a message naming the
//! subject, the check and what differed; [`conformance_tests!`] expands to one `#[test]` per
//! check, so a kind's crate runs the whole suite with one line:
//!
//! ```ignore
//! switchyard_conformance::conformance_tests!(
//!     softgpu,
//!     Subject::kind_kv(SoftGpuKind, "vram=4M").declares(Groups { migration: true, ..Groups::NONE })
//! );
//! ```
//!
//! Where the device needs a machine the test runner may not have (a device bound to
//! vfio-pci), [`run_all`] runs every check in one process and reports each outcome instead
//! of stopping at the first failure.
//!
//! | check | what it asserts |
//! |---|---|
//! | [`capabilities`](checks::capabilities) | each optional group is offered exactly as declared; a kind's options are canonical and its profile agrees with the device |
//! | [`config_space`](checks::config_space) | region 7 is readable over its whole size, narrow reads agree with wide ones, the header and capability chains are well formed |
//! | [`region_bounds`](checks::region_bounds) | every region: accesses at the end served, past the end / straddling / overflowing refused, odd widths and zero lengths answered, unknown indexes refused; never a panic |
//! | [`reset`](checks::reset) | a resettable device resets and its read-only header is its post-build one; another refuses |
//! | [`client_gone`](checks::client_gone) | after `client_disconnected` the device answers and touches no DMA memory |
//! | [`fresh_open`](checks::fresh_open) | what a client wrote into config space (COMMAND, a BAR, Device Control, MSI/MSI-X enable) is gone for a new client after `fresh_open` |
//! | [`migration`](checks::migration) | RUNNING→STOP→RUNNING; a STOP_COPY (and PRE_COPY) stream loads into a fresh device with the same config space; a truncated one is refused |
//! | [`swap`](checks::swap) | a successor from the device's own factory takes over with the same config space; a device of another kind is refused |
//! | [`recovery`](checks::recovery) | a device rebuilt from its black box and held objects has the same config space; without a black box it is refused |
//! | [`relocation`](checks::relocation) | pre-copy rounds, a successor, the swap as the server makes it; the successor answers with the same config space and reports its relocation |

#![warn(missing_docs)]
#![forbid(unsafe_code)]
// Every dependency is used (the test build also sees the dev-dependencies, hence not there).
#![cfg_attr(not(test), deny(unused_crate_dependencies))]

pub mod checks;
mod probe;
mod subject;

pub use subject::{BuildFn, Groups, Moves, Subject};

/// One check of the suite.
pub type Check = fn(&Subject);

/// Every check, by name, in the order [`conformance_tests!`] declares them.
pub const CHECKS: &[(&str, Check)] = &[
    ("capabilities", checks::capabilities),
    ("config_space", checks::config_space),
    ("region_bounds", checks::region_bounds),
    ("reset", checks::reset),
    ("client_gone", checks::client_gone),
    ("fresh_open", checks::fresh_open),
    ("migration", checks::migration),
    ("swap", checks::swap),
    ("recovery", checks::recovery),
    ("relocation", checks::relocation),
];

/// Runs `check` on `subject`; a failure (the check's panic) comes back as its message.
pub fn run(subject: &Subject, check: Check) -> Result<(), String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(subject)))
        .map_err(|p| probe::panic_message(&*p))
}

/// Runs every check of [`CHECKS`] on `subject`, one after the other, whatever fails.
pub fn run_all(subject: &Subject) -> Vec<(&'static str, Result<(), String>)> {
    CHECKS
        .iter()
        .map(|&(name, check)| (name, run(subject, check)))
        .collect()
}

/// Declares a module `$name` with one `#[test]` per check of the suite, each on a new
/// subject made by `$subject` (an expression evaluated inside the module, which sees the
/// items of the module the macro is called in).
#[macro_export]
macro_rules! conformance_tests {
    ($name:ident, $subject:expr) => {
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn subject() -> $crate::Subject {
                $subject
            }

            #[test]
            fn capabilities() {
                $crate::checks::capabilities(&subject());
            }

            #[test]
            fn config_space() {
                $crate::checks::config_space(&subject());
            }

            #[test]
            fn region_bounds() {
                $crate::checks::region_bounds(&subject());
            }

            #[test]
            fn reset() {
                $crate::checks::reset(&subject());
            }

            #[test]
            fn client_gone() {
                $crate::checks::client_gone(&subject());
            }

            #[test]
            fn fresh_open() {
                $crate::checks::fresh_open(&subject());
            }

            #[test]
            fn migration() {
                $crate::checks::migration(&subject());
            }

            #[test]
            fn swap() {
                $crate::checks::swap(&subject());
            }

            #[test]
            fn recovery() {
                $crate::checks::recovery(&subject());
            }

            #[test]
            fn relocation() {
                $crate::checks::relocation(&subject());
            }
        }
    };
}
