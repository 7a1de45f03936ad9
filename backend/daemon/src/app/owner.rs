//! The pool's owner: one thread owns the [`Pool`] (inventory, leases, store) and runs every
//! mutation of it, one at a time, as a command sent on a channel. It never blocks on a
//! process, a thread join, QMP or a socket ([`crate::blocking`] panics if it tries, in debug
//! builds): spawns, waits, kills and QMP happen on the requesting thread, before or after
//! its commands, and their results come back as further commands (plan → act → commit or
//! undo).
//!
//! Readers never wait for a command: after each command the owner publishes a snapshot of
//! the inventory ([`PoolOwner::inventory`]), which the API's reads, the metrics sink and
//! the views use. A command's pool events are published by the owner in store order, before
//! its caller hears back.
//!
//! The owner also writes the events stream's marks ([`EventStream::set_marker`]): the stream
//! queues a command that nobody waits for.

use std::sync::mpsc;
use std::sync::{Arc, RwLock};

use switchyard_pool::{Event, Inventory, Pool, PoolError};

use super::events::EventStream;

/// A command: a function of the pool, run on the owner thread; what it returns sends its
/// result back, once the snapshot shows what it did.
type Command = Box<dyn FnOnce(&mut Pool, &EventStream) -> Reply + Send>;
type Reply = Box<dyn FnOnce() + Send>;

/// The handle to the pool's owner thread. See the [module](self) documentation.
pub(crate) struct PoolOwner {
    /// The only strong reference: the thread ends when the handle is dropped (the events
    /// stream's marker holds a weak one).
    commands: Arc<mpsc::Sender<Command>>,
    /// The inventory as of the last command (a leaf lock: written by the owner only, read
    /// for a clone of the `Arc`).
    snapshot: Arc<RwLock<Arc<Inventory>>>,
}

impl std::fmt::Debug for PoolOwner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolOwner").finish_non_exhaustive()
    }
}

impl PoolOwner {
    /// Starts the owner thread with `pool`; events of commands go to `events`. The thread
    /// ends when the last handle is dropped.
    pub(crate) fn start(pool: Pool, events: Arc<EventStream>) -> std::io::Result<Self> {
        let snapshot = Arc::new(RwLock::new(Arc::new(pool.inventory().clone())));
        let (tx, rx) = mpsc::channel::<Command>();
        let commands = Arc::new(tx);
        let marks = Arc::downgrade(&commands);
        events.set_marker(move |worker_events| {
            let mark: Command = Box::new(move |pool, events| {
                match pool.seq_mark(worker_events) {
                    Ok(e) => events.pool(e),
                    Err(e) => {
                        tracing::warn!("the events stream's mark was not committed: {e}");
                        events.mark_failed();
                    }
                }
                Box::new(|| {})
            });
            // Sent, never waited for: this runs on a supervision thread or on the owner.
            let sent = marks.upgrade().is_some_and(|c| c.send(mark).is_ok());
            if !sent {
                tracing::warn!(
                    "the events stream's mark was not written: the pool's owner is gone"
                );
            }
        });
        let published = snapshot.clone();
        std::thread::Builder::new()
            .name("sy-pool".into())
            .spawn(move || {
                crate::blocking::enter_owner();
                let mut pool = pool;
                for command in rx {
                    let reply = command(&mut pool, &events);
                    // Before the caller hears back: what it reads next shows its command.
                    let inventory = Arc::new(pool.inventory().clone());
                    *published.write().unwrap_or_else(|p| p.into_inner()) = inventory;
                    reply();
                }
            })?;
        Ok(Self { commands, snapshot })
    }

    /// The inventory as of the last command. Never waits for a command.
    pub(crate) fn inventory(&self) -> Arc<Inventory> {
        self.snapshot
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Runs `f` on the owner thread and returns its result. `f` must not block (it runs
    /// store transactions). Blocks the caller until the owner ran it: so not callable from
    /// the owner thread itself.
    pub(crate) fn run<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Pool, &EventStream) -> R + Send + 'static,
    ) -> R {
        assert!(
            !crate::blocking::on_owner(),
            "a pool command sent from the pool's owner thread would wait for itself"
        );
        let (tx, rx) = mpsc::sync_channel(1);
        let command: Command = Box::new(move |pool, events| {
            let result = f(pool, events);
            Box::new(move || {
                let _ = tx.send(result);
            })
        });
        if self.commands.send(command).is_err() {
            // The owner thread runs as long as a handle exists; it can only be gone if a
            // command panicked on it.
            panic!("the pool's owner thread is gone (a command panicked)");
        }
        rx.recv()
            .unwrap_or_else(|_| panic!("the pool's owner thread is gone (a command panicked)"))
    }

    /// Runs a mutation `f` on the owner thread; its events are published there, in store
    /// order, before this returns.
    pub(crate) fn commit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Pool) -> Result<(R, Vec<Event>), PoolError> + Send + 'static,
    ) -> Result<R, PoolError> {
        self.run(move |pool, events| {
            let (r, e) = f(pool)?;
            events.pool(e);
            Ok(r)
        })
    }

    /// [`PoolOwner::commit`] of a mutation that only returns events.
    pub(crate) fn apply(
        &self,
        f: impl FnOnce(&mut Pool) -> Result<Vec<Event>, PoolError> + Send + 'static,
    ) -> Result<(), PoolError> {
        self.commit(move |pool| f(pool).map(|e| ((), e)))
    }
}
