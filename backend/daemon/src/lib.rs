//! The pool daemon's data path: endpoint workers supervised from a process that keeps every
//! descriptor making up the guest's view of its device.
//!
//! - [`supervisor`]: per endpoint, the listening socket, the worker process, and the held
//!   descriptors (client connection, DMA memory fds, interrupt eventfds, the memory objects
//!   the device's kind names, such as a softgpu's or a `cuda` board's VRAM and doorbell page
//!   memfds, the black box the worker created); a dead worker is replaced and resumes the
//!   connection.
//! - [`worker`]: `switchyard worker`, the process that serves one endpoint: a device of any
//!   kind the binary registers (`switchyard_kinds::KINDS`: the softgpu, the `cuda` board, the
//!   scratchpad, a passthrough device over `switchyard-vfio`), known to the worker only
//!   through its `DeviceKind`.
//! - [`custody`]: the channel between them.
//! - [`lifecycle`]: what happens to a worker ([`WorkerLifecycle`]), one type from the
//!   worker's note through the supervisor and the daemon to the events stream.
//! - [`keeper`]: the worker's ledger of what it put in custody, offered to a new supervisor so
//!   that a restarted daemon adopts its running workers.
//! - [`jail`]: what a worker (and `serve`) may still do once its device is built.
//! - [`app`]: `switchyard daemon`, the pool daemon around them: the pool's store, a worker per
//!   leased endpoint, the control API.
//!
//! What survives what, and the limits, are in ARCHITECTURE.md ("What survives which
//! failure").

#![warn(missing_docs)]
#![forbid(unsafe_code)]

pub mod app;
pub mod blocking;
pub mod custody;
pub mod error_chain;
pub mod jail;
pub mod keeper;
pub mod knobs;
pub mod lifecycle;
pub mod reexec;
pub mod supervisor;
pub mod worker;

pub use lifecycle::WorkerLifecycle;
pub use supervisor::{
    EndpointSpec, EventSink, MoveOutcome, Supervisor, SupervisorError, WorkerEvent, WorkerSignal,
    WorkerStatus,
};
