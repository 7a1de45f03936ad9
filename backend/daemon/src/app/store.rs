//! The pool's store at daemon start: the file checked (the daemon's own, no symbolic link),
//! opened, and, when it is damaged and the administrator said `--reinit`, moved aside for a
//! new, empty one. Errors name the file and say what to do ([`hint`]).

use std::fs;
use std::io;
use std::path::Path;

use switchyard_pool::{OpenReport, Pool, PoolConfig, PoolError};

use super::{DaemonError, DaemonOptions, check_own};

/// Opens the store of `config` (see the [module](self) documentation).
pub(super) fn open(
    options: &DaemonOptions,
    config: &PoolConfig,
) -> Result<(Pool, OpenReport), DaemonError> {
    let store = config.daemon.store_path();
    check_store(&store)?;
    let failed = |e: PoolError| DaemonError::Store(store.clone(), Box::new(e));
    match Pool::open(config, &switchyard_kinds::Registry, &store) {
        Err(e) if options.reinit && e.is_damaged() => {
            let aside = switchyard_pool::move_aside(&store).map_err(failed)?;
            tracing::warn!(
                store = %store.display(),
                aside = %aside.display(),
                "--reinit: the damaged store was moved aside and a new one is made; every lease it held is lost (workers it started serve on, unsupervised): {}",
                crate::error_chain::error_chain(&e)
            );
            Pool::open(config, &switchyard_kinds::Registry, &store).map_err(failed)
        }
        Err(e) => Err(failed(e)),
        Ok(opened) => {
            if options.reinit {
                tracing::info!(
                    store = %store.display(),
                    "--reinit: the store is not damaged; opened as it is"
                );
            }
            Ok(opened)
        }
    }
}

/// The store file, when it exists, must be a regular file of the daemon's (never a symbolic
/// link, even a dangling one: opening it would create a file where the link points).
fn check_store(path: &Path) -> Result<(), DaemonError> {
    match fs::symlink_metadata(path) {
        Ok(meta) => check_own(path, &meta, false),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(DaemonError::Inspect(path.to_owned(), e)),
    }
}

/// What an administrator can do about a store that does not open.
pub(super) fn hint(e: &PoolError) -> &'static str {
    match e {
        e if e.is_damaged() => {
            "left as it is: restore it from a backup, or start the daemon once with --reinit to move it aside and begin with an empty pool, losing every lease it holds"
        }
        e if e.store_in_use() => {
            "another process has it open: is another daemon running on this state directory?"
        }
        PoolError::StoreFormat { .. } => {
            "written by another release: run that release, or restore a store of this one"
        }
        PoolError::Corrupt { .. } => {
            "a record does not decode: written by an incompatible release, or damaged; restore it from a backup"
        }
        PoolError::Reconcile(_) => "the configuration does not fit what the store holds",
        PoolError::StoreFile { .. } | PoolError::StoreOpen { .. } => {
            "check the state directory's file system"
        }
        _ => "see why below",
    }
}
