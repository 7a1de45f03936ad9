//! What the children of the supervisor share without depending on one another: the
//! launch settings ([`Launch`]), which the supervision loop and the custody ledger both read.

use std::path::Path;

/// What every worker of a supervisor is started with.
#[derive(Debug, Clone, Copy)]
pub(super) struct Launch<'a> {
    pub(super) adopt_dir: Option<&'a Path>,
    pub(super) fd_budget: Option<u32>,
    /// Migration streams idle this long are ended (unless the endpoint's spec says).
    pub(super) migration_idle: Option<std::time::Duration>,
    /// Whether workers jail themselves ([`crate::jail`]); off: `worker --no-jail`.
    pub(super) jail: bool,
}
