//! Endpoints served by real `switchyard worker` processes under a `Supervisor` in the test
//! process (no daemon), and the client a VMM would be.

use std::fs::Permissions;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use switchyard_client::{Client, ClientConfig};
use switchyard_daemon::{EndpointSpec, Supervisor};
use switchyard_kinds::DeviceSpec;
use switchyard_softgpu::SoftGpuConfig;

/// A supervisor that starts this build's `switchyard worker`, its logs kept out of the test's
/// output ([`quiet_worker`]).
pub fn supervisor() -> Supervisor {
    Supervisor::new(quiet_worker())
}

/// This build's `switchyard` behind a wrapper that appends its stderr (a worker's logs) to a
/// file. A worker is a process of its own: the test harness captures what the test's threads
/// print, not what a child writes to the stderr it inherited, so every worker would print its
/// logs into the test run's output. The file's path is printed through the harness (shown with
/// a failing test's output); the file stays in `CARGO_TARGET_TMPDIR`.
pub fn quiet_worker() -> PathBuf {
    let dir = tempfile::Builder::new()
        .prefix("workers-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("a directory for the worker logs")
        .keep();
    let log = dir.join("workers.log");
    let exe = dir.join("switchyard");
    let script = format!(
        "#!/bin/sh\nexec '{}' \"$@\" 2>>'{}'\n",
        env!("CARGO_BIN_EXE_switchyard"),
        log.display()
    );
    std::fs::write(&exe, script).expect("write the worker wrapper");
    std::fs::set_permissions(&exe, Permissions::from_mode(0o755)).expect("chmod the wrapper");
    eprintln!("worker logs: {}", log.display());
    exe
}

/// Endpoint `id` (socket `<dir>/<id>.sock`) serving a 16 MiB, 2-queue softgpu with VRAM
/// mappable or not; returns once its first worker serves.
pub fn endpoint(sup: &Supervisor, dir: &Path, id: &str, vram_mmap: bool) -> PathBuf {
    let device = switchyard_kinds::softgpu(&SoftGpuConfig {
        vram_size: 16 << 20,
        queues: 2,
        vram_mmap,
        ..SoftGpuConfig::default()
    });
    endpoint_of(sup, dir, id, device)
}

/// Endpoint `id` (socket `<dir>/<id>.sock`) serving `device`; returns once its first worker
/// serves.
pub fn endpoint_of(sup: &Supervisor, dir: &Path, id: &str, device: DeviceSpec) -> PathBuf {
    let socket = dir.join(format!("{id}.sock"));
    sup.create(EndpointSpec {
        id: id.into(),
        socket: socket.clone(),
        device,
        failover: false,
        lease: None,
        migration: Default::default(),
    })
    .expect("create endpoint");
    let st = sup
        .wait_ready(id, 1, Duration::from_secs(20))
        .expect("status");
    assert_eq!(st.ready, 1, "the first worker reports ready: {st:?}");
    socket
}

/// A client whose requests wait long enough for a replacement worker (QEMU waits 5 s).
pub fn connect(socket: &Path) -> Client {
    Client::connect_with(
        socket,
        ClientConfig {
            timeout: Some(Duration::from_secs(5)),
            ..ClientConfig::default()
        },
    )
    .expect("connect")
}

/// A driver on the endpoint at `socket` with queue 0 set up on mapped doorbells, and the
/// doorbell page it mapped (as a VMM maps it for the guest).
pub fn mapped_driver(
    socket: &Path,
) -> (
    super::driver::Driver<super::ours::Ours>,
    super::driver::DoorbellPage,
) {
    let mut client = connect(socket);
    let page = super::driver::DoorbellPage::map(&mut client);
    let mut d = super::driver::Driver::new(super::ours::Ours(client));
    d.setup_queue(0);
    d.map_queue(0);
    (d, page)
}
