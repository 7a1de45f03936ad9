//! Driving cloud-hypervisor for vfio-user guest tests.
//!
//! * [`ChCommand`]: a typed builder for the `cloud-hypervisor` command line
//!   (API socket, kernel/initramfs/cmdline, CPUs, shared memory, serial and
//!   console, `--user-device`).
//! * [`ChApi`]: a small synchronous client for the REST API on the
//!   `--api-socket` unix socket (hand-written HTTP/1.1 over std I/O), with
//!   vfio-user hot-plug (`vm.add-user-device`) and removal (`vm.remove-device`).
//!
//! What cloud-hypervisor's vfio-user client does (see also docs/serve.md, "Pointing
//! a VMM at the socket"): it needs `--memory …,shared=on` to DMA-map guest RAM
//! into the server, never services `DMA_READ`/`DMA_WRITE`, does not detect a
//! server disconnect, and refuses a socket that another device already uses.

#![warn(missing_docs)]
#![forbid(unsafe_code)]

mod api;
mod command;
mod error;
mod http;

pub use api::{
    API_PREFIX, ChApi, DEFAULT_TIMEOUT, Method, PciDeviceInfo, UserDeviceConfig, VmInfo,
    VmmPingResponse,
};
pub use command::{ChCommand, Output, user_device_arg};
pub use error::{ChError, Result};
pub use http::HttpResponse;
