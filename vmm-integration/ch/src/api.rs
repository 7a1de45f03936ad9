//! Client for cloud-hypervisor's REST API over its unix socket.

use std::io::{self, BufReader, Read};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::debug;

use crate::error::{ChError, Result};
use crate::http::{self, HttpError, HttpResponse};

/// Default per-request timeout of [`ChApi`].
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Prefix of every API endpoint.
pub const API_PREFIX: &str = "/api/v1/";

const CONNECT_RETRY_INTERVAL: Duration = Duration::from_millis(20);

/// HTTP methods the cloud-hypervisor API uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `GET` (queries such as `vmm.ping`, `vm.info`).
    Get,
    /// `PUT` (every action).
    Put,
}

impl Method {
    /// The method token.
    pub fn as_str(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Put => "PUT",
        }
    }
}

/// A vfio-user device for `--user-device` and `PUT /api/v1/vm.add-user-device`
/// (cloud-hypervisor's `UserDeviceConfig`; unset fields are omitted).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct UserDeviceConfig {
    /// The vfio-user server's socket (required). It must be listening, and
    /// must not already be in use by another device of the same VM.
    pub socket: PathBuf,
    /// Device id (cloud-hypervisor generates `_user_deviceN` if unset).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// PCI segment (default 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci_segment: Option<u16>,
    /// Requested PCI device (slot) number on the segment (recent cloud-hypervisor only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pci_device_id: Option<u8>,
}

impl UserDeviceConfig {
    /// A device on `socket` with every optional field unset.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        UserDeviceConfig {
            socket: socket.into(),
            ..UserDeviceConfig::default()
        }
    }

    /// Sets the device id.
    #[must_use]
    pub fn id(mut self, id: impl Into<String>) -> Self {
        self.id = Some(id.into());
        self
    }

    /// Sets the PCI segment.
    #[must_use]
    pub fn pci_segment(mut self, segment: u16) -> Self {
        self.pci_segment = Some(segment);
        self
    }
}

/// Reply to a device hot-plug: the device id and where it landed.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize, Serialize)]
pub struct PciDeviceInfo {
    /// Device id.
    pub id: String,
    /// PCI address, `segment:bus:device.function`, e.g. `0000:00:05.0`.
    pub bdf: String,
}

/// `GET /api/v1/vmm.ping` reply.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct VmmPingResponse {
    /// Build version (git describe).
    #[serde(default)]
    pub build_version: String,
    /// Release version.
    pub version: String,
    /// Process id of the VMM.
    #[serde(default)]
    pub pid: i64,
    /// Compiled-in cargo features.
    #[serde(default)]
    pub features: Vec<String>,
}

/// `GET /api/v1/vm.info` reply.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct VmInfo {
    /// The full VM configuration (`VmConfig`), kept as JSON.
    pub config: Value,
    /// `Created`, `Running`, `Shutdown`, `Paused` or `BreakPoint`.
    pub state: String,
    /// Current memory size in bytes, when reported.
    #[serde(default)]
    pub memory_actual_size: Option<u64>,
    /// The device tree (ids, resources, children, PCI BDFs), when reported.
    #[serde(default)]
    pub device_tree: Option<Value>,
}

#[derive(Serialize)]
struct RemoveDevice<'a> {
    id: &'a str,
}

/// A client for cloud-hypervisor's REST API (`--api-socket`).
///
/// Each call opens a new connection, sends one HTTP/1.1 request and reads one
/// response, framed by `Content-Length`, chunked encoding or connection close
/// (the same pattern as `ch-remote`). Non-2xx statuses become
/// [`ChError::Status`] with the code and body. Every call is bounded by the
/// client's timeout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChApi {
    socket: PathBuf,
    timeout: Duration,
}

impl ChApi {
    /// A client for the API socket at `socket`, with [`DEFAULT_TIMEOUT`].
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        ChApi {
            socket: socket.into(),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// Sets the per-request timeout (connect, send and the whole response).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// The API socket path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends `method` to `/api/v1/{endpoint}` with an optional JSON `body`
    /// and returns the 2xx response.
    pub fn request(
        &self,
        method: Method,
        endpoint: &str,
        body: Option<&[u8]>,
    ) -> Result<HttpResponse> {
        let m = method.as_str();
        let target = format!("{API_PREFIX}{endpoint}");
        let deadline = Instant::now() + self.timeout;
        let stream = UnixStream::connect(&self.socket).map_err(|source| ChError::Connect {
            path: self.socket.clone(),
            source,
        })?;
        let io_err = |e: io::Error| match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ChError::Timeout {
                method: m,
                endpoint: target.clone(),
                timeout: self.timeout,
            },
            _ => ChError::Io {
                method: m,
                endpoint: target.clone(),
                source: e,
            },
        };
        stream
            .set_write_timeout(Some(self.timeout.max(Duration::from_millis(1))))
            .map_err(io_err)?;
        debug!(method = m, target = %target, body_len = body.map_or(0, <[u8]>::len), "API request");
        http::write_request(&mut &stream, m, &target, body).map_err(io_err)?;

        let mut reader = BufReader::new(DeadlineReader {
            stream: &stream,
            deadline,
        });
        let resp = http::read_response(&mut reader, m).map_err(|e| match e {
            HttpError::Io(e) => io_err(e),
            HttpError::Malformed(reason) => ChError::MalformedResponse {
                method: m,
                endpoint: target.clone(),
                reason,
            },
            HttpError::TooLarge(limit) => ChError::ResponseTooLarge {
                method: m,
                endpoint: target.clone(),
                limit,
            },
        })?;
        debug!(method = m, target = %target, status = resp.status, "API response");
        if !(200..300).contains(&resp.status) {
            return Err(ChError::Status {
                method: m,
                endpoint: target,
                status: resp.status,
                body: String::from_utf8_lossy(&resp.body).into_owned(),
            });
        }
        Ok(resp)
    }

    fn get_json<T: DeserializeOwned>(&self, endpoint: &str) -> Result<T> {
        let resp = self.request(Method::Get, endpoint, None)?;
        decode(endpoint, &resp.body)
    }

    fn put_json<B: Serialize>(&self, endpoint: &str, body: &B) -> Result<HttpResponse> {
        let body = serde_json::to_vec(body).map_err(ChError::Serialize)?;
        self.request(Method::Put, endpoint, Some(&body))
    }

    fn put_empty(&self, endpoint: &str) -> Result<()> {
        self.request(Method::Put, endpoint, None).map(drop)
    }

    /// `GET /api/v1/vmm.ping`.
    pub fn ping(&self) -> Result<VmmPingResponse> {
        self.get_json("vmm.ping")
    }

    /// Pings until the API answers or `timeout` elapses, retrying while the
    /// socket does not exist yet or refuses connections (cloud-hypervisor
    /// starting up).
    pub fn wait_ready(&self, timeout: Duration) -> Result<VmmPingResponse> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.ping() {
                Err(ChError::Connect { source, .. })
                    if matches!(
                        source.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) && Instant::now() + CONNECT_RETRY_INTERVAL < deadline =>
                {
                    thread::sleep(CONNECT_RETRY_INTERVAL);
                }
                other => return other,
            }
        }
    }

    /// `GET /api/v1/vm.info`.
    pub fn vm_info(&self) -> Result<VmInfo> {
        self.get_json("vm.info")
    }

    /// `PUT /api/v1/vm.add-user-device`: hot-plugs a vfio-user device.
    /// cloud-hypervisor connects to the server synchronously, so the server
    /// must be listening.
    pub fn add_user_device(&self, device: &UserDeviceConfig) -> Result<PciDeviceInfo> {
        let endpoint = "vm.add-user-device";
        let resp = self.put_json(endpoint, device)?;
        decode(endpoint, &resp.body)
    }

    /// `PUT /api/v1/vm.remove-device` with `{"id": …}` (any device type).
    ///
    /// cloud-hypervisor signals the guest (ACPI PCI hot-plug) and returns; the
    /// device is gone from the guest once the guest has ejected it.
    pub fn remove_device(&self, id: &str) -> Result<()> {
        self.put_json("vm.remove-device", &RemoveDevice { id })
            .map(drop)
    }

    /// `PUT /api/v1/vm.shutdown`: stops the VM (it can be booted again).
    pub fn vm_shutdown(&self) -> Result<()> {
        self.put_empty("vm.shutdown")
    }

    /// `PUT /api/v1/vm.delete`: shuts down and deletes the VM; the VMM keeps running.
    pub fn vm_delete(&self) -> Result<()> {
        self.put_empty("vm.delete")
    }

    /// `PUT /api/v1/vm.boot`.
    pub fn vm_boot(&self) -> Result<()> {
        self.put_empty("vm.boot")
    }

    /// `PUT /api/v1/vm.reboot`.
    pub fn vm_reboot(&self) -> Result<()> {
        self.put_empty("vm.reboot")
    }

    /// `PUT /api/v1/vm.pause`.
    pub fn vm_pause(&self) -> Result<()> {
        self.put_empty("vm.pause")
    }

    /// `PUT /api/v1/vm.resume`.
    pub fn vm_resume(&self) -> Result<()> {
        self.put_empty("vm.resume")
    }

    /// `PUT /api/v1/vm.power-button`: ACPI power button; the guest decides.
    pub fn vm_power_button(&self) -> Result<()> {
        self.put_empty("vm.power-button")
    }

    /// `PUT /api/v1/vmm.shutdown`: the cloud-hypervisor process exits.
    pub fn vmm_shutdown(&self) -> Result<()> {
        self.put_empty("vmm.shutdown")
    }
}

fn decode<T: DeserializeOwned>(endpoint: &str, body: &[u8]) -> Result<T> {
    serde_json::from_slice(body).map_err(|source| ChError::Deserialize {
        endpoint: format!("{API_PREFIX}{endpoint}"),
        source,
    })
}

/// Reads from the socket, but never past an overall deadline.
struct DeadlineReader<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl Read for DeadlineReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let remaining = self.deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(remaining))?;
        let mut s = self.stream;
        s.read(buf)
    }
}
