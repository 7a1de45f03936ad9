//! A synchronous QMP (QEMU Machine Protocol) client over a unix socket.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tracing::{debug, trace, warn};

use crate::command::VfioUserDevice;
use crate::error::{QemuError, Result};

/// Upper bound for one QMP message (a `query-pci` reply of a big machine is a few tens of KiB).
pub const MAX_MESSAGE_LEN: usize = 16 << 20;

/// How often [`Qmp::connect`] retries while QEMU has not created the socket yet.
const CONNECT_RETRY_INTERVAL: Duration = Duration::from_millis(20);

/// The greeting QEMU sends when a client connects.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QmpGreeting {
    /// QEMU's version.
    pub version: QmpVersion,
    /// Optional protocol capabilities the server offers (e.g. `oob`); none are enabled.
    #[serde(default)]
    pub capabilities: Vec<String>,
}

/// QEMU version from the greeting.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct QmpVersion {
    /// Numeric version.
    pub qemu: QemuVersionNumber,
    /// Distribution package string, e.g. `Debian 1:11.1.3+ds-1~bpo13+1`.
    #[serde(default)]
    pub package: String,
}

/// `major.minor.micro`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Deserialize)]
pub struct QemuVersionNumber {
    /// Major version.
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Micro version.
    pub micro: u32,
}

/// An asynchronous QMP event.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct QmpEvent {
    /// Event name, e.g. `DEVICE_DELETED`, `SHUTDOWN`.
    pub event: String,
    /// Event data (`Null` when absent).
    #[serde(default)]
    pub data: Value,
    /// When QEMU emitted the event.
    #[serde(default)]
    pub timestamp: Option<QmpTimestamp>,
}

/// Event timestamp (host wall clock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct QmpTimestamp {
    /// Seconds since the epoch.
    pub seconds: i64,
    /// Microseconds.
    pub microseconds: i64,
}

/// `query-status` reply.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct StatusInfo {
    /// Whether vCPUs are running.
    pub running: bool,
    /// The QAPI `RunState`, e.g. `running`, `paused`, `prelaunch`, `shutdown`.
    pub status: String,
}

/// One PCI bus from `query-pci` (the root bus; bridges nest inside devices).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PciBusInfo {
    /// Bus number.
    pub bus: u32,
    /// Devices on the bus.
    #[serde(default)]
    pub devices: Vec<PciDeviceInfo>,
}

/// One PCI function from `query-pci`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PciDeviceInfo {
    /// Bus number.
    pub bus: u32,
    /// Slot (device) number.
    pub slot: u32,
    /// Function number.
    pub function: u32,
    /// Class code.
    pub class_info: PciClassInfo,
    /// Vendor/device ids.
    pub id: PciIds,
    /// The qdev id (empty for devices created without `id=`).
    #[serde(default)]
    pub qdev_id: String,
    /// BARs as QEMU sees them.
    #[serde(default)]
    pub regions: Vec<PciRegionInfo>,
    /// Set for bridges (root ports), with the devices behind them.
    #[serde(default)]
    pub pci_bridge: Option<PciBridgeInfo>,
}

/// PCI class information.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PciClassInfo {
    /// Class description, when QEMU knows one.
    #[serde(default)]
    pub desc: Option<String>,
    /// 16-bit class code (base class and subclass).
    pub class: u16,
}

/// PCI ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct PciIds {
    /// Vendor id.
    pub vendor: u16,
    /// Device id.
    pub device: u16,
    /// Subsystem vendor id (type-0 headers).
    #[serde(default, rename = "subsystem-vendor")]
    pub subsystem_vendor: Option<u16>,
    /// Subsystem id (type-0 headers).
    #[serde(default)]
    pub subsystem: Option<u16>,
}

/// A BAR from `query-pci`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PciRegionInfo {
    /// BAR index.
    pub bar: u32,
    /// `io` or `memory`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Guest-physical address; `-1` while unassigned (QAPI `int`).
    pub address: i64,
    /// Size in bytes.
    pub size: i64,
    /// Prefetchable (memory BARs).
    #[serde(default)]
    pub prefetch: Option<bool>,
    /// 64-bit (memory BARs).
    #[serde(default)]
    pub mem_type_64: Option<bool>,
}

/// Bridge information from `query-pci`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct PciBridgeInfo {
    /// Bus numbers behind the bridge.
    pub bus: PciBridgeBus,
    /// Devices on the secondary bus.
    #[serde(default)]
    pub devices: Vec<PciDeviceInfo>,
}

/// Bus numbers of a bridge.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct PciBridgeBus {
    /// Primary bus number.
    pub number: u32,
    /// Secondary bus number.
    pub secondary: u32,
    /// Subordinate bus number.
    pub subordinate: u32,
}

/// All functions in a `query-pci` result, depth first, including those behind bridges.
///
/// Devices behind a bridge whose secondary bus number the guest has not
/// programmed yet are missing from `query-pci` itself.
pub fn all_pci_devices(buses: &[PciBusInfo]) -> Vec<&PciDeviceInfo> {
    fn walk<'a>(devs: &'a [PciDeviceInfo], out: &mut Vec<&'a PciDeviceInfo>) {
        for d in devs {
            out.push(d);
            if let Some(bridge) = &d.pci_bridge {
                walk(&bridge.devices, out);
            }
        }
    }
    let mut out = Vec::new();
    for bus in buses {
        walk(&bus.devices, &mut out);
    }
    out
}

#[derive(Serialize)]
struct Request<'a> {
    execute: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    arguments: Option<&'a Value>,
    id: u64,
}

/// A message from QEMU, classified.
enum Incoming {
    Return {
        id: Option<Value>,
        value: Value,
    },
    Error {
        id: Option<Value>,
        class: String,
        desc: String,
    },
    Event(QmpEvent),
}

/// A QMP connection.
///
/// * [`Qmp::connect`] waits for the socket, reads the greeting and negotiates
///   capabilities (none are enabled, so there is no out-of-band execution).
/// * [`Qmp::execute`] tags each command with an `id`; replies to earlier,
///   timed-out commands are discarded, and asynchronous events that arrive
///   meanwhile are buffered for [`Qmp::wait_event`] / [`Qmp::take_events`].
/// * Every wait is bounded: commands by [`Qmp::timeout`], event waits by their
///   own timeout.
#[derive(Debug)]
pub struct Qmp {
    conn: Connection,
    path: PathBuf,
    events: VecDeque<QmpEvent>,
    greeting: QmpGreeting,
    timeout: Duration,
    next_id: u64,
}

impl Qmp {
    /// Connects to the QMP socket at `path` and negotiates capabilities.
    ///
    /// Retries while the socket does not exist or refuses connections (QEMU
    /// creates it shortly after starting), for up to `timeout` in total
    /// including the handshake. `timeout` is also the initial per-command
    /// timeout (see [`set_timeout`](Self::set_timeout)).
    pub fn connect(path: impl AsRef<Path>, timeout: Duration) -> Result<Qmp> {
        let path = path.as_ref();
        let deadline = Instant::now() + timeout;
        let stream = Self::connect_stream(path, timeout)?;
        Self::handshake(stream, path, deadline, timeout)
    }

    /// The connection [`Qmp::connect`] makes (with its retries, for up to `timeout`), before
    /// anything is read or written on it: for a caller that checks who is at the other end
    /// (`SO_PEERCRED`) before it speaks, then hands it to [`Qmp::over`].
    pub fn connect_stream(path: impl AsRef<Path>, timeout: Duration) -> Result<UnixStream> {
        let path = path.as_ref();
        let deadline = Instant::now() + timeout;
        loop {
            match UnixStream::connect(path) {
                Ok(s) => return Ok(s),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused
                    ) && Instant::now() + CONNECT_RETRY_INTERVAL < deadline =>
                {
                    thread::sleep(CONNECT_RETRY_INTERVAL);
                }
                Err(source) => {
                    return Err(QemuError::Connect {
                        path: path.to_path_buf(),
                        source,
                    });
                }
            }
        }
    }

    /// A QMP client on `stream`, a fresh connection to the QMP socket at `path`
    /// ([`Qmp::connect_stream`]): reads the greeting and negotiates capabilities within
    /// `timeout`, also the initial per-command timeout.
    pub fn over(stream: UnixStream, path: impl AsRef<Path>, timeout: Duration) -> Result<Qmp> {
        let deadline = Instant::now() + timeout;
        Self::handshake(stream, path.as_ref(), deadline, timeout)
    }

    fn handshake(
        stream: UnixStream,
        path: &Path,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Qmp> {
        debug!(path = %path.display(), "QMP connected");
        let mut conn = Connection {
            stream,
            rbuf: Vec::new(),
        };
        let msg = conn.read_message(deadline, timeout, "the QMP greeting")?;
        let greeting = match msg.get("QMP") {
            Some(g) => serde_json::from_value::<QmpGreeting>(g.clone()).map_err(|source| {
                QemuError::UnexpectedReply {
                    command: "greeting".to_owned(),
                    source,
                }
            })?,
            None => {
                return Err(QemuError::UnexpectedMessage {
                    message: msg.to_string(),
                });
            }
        };
        debug!(
            version = ?greeting.version.qemu,
            package = %greeting.version.package,
            "QMP greeting"
        );
        let mut qmp = Qmp {
            conn,
            path: path.to_path_buf(),
            events: VecDeque::new(),
            greeting,
            timeout,
            next_id: 1,
        };
        qmp.execute_until("qmp_capabilities", None, deadline, timeout)?;
        Ok(qmp)
    }

    /// The greeting QEMU sent.
    pub fn greeting(&self) -> &QmpGreeting {
        &self.greeting
    }

    /// The socket path this client is connected to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The per-command reply timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sets the per-command reply timeout.
    pub fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
    }

    /// Runs `command` with optional `arguments` (a JSON object) and returns its
    /// `return` value.
    ///
    /// An error response becomes [`QemuError::Command`] with QEMU's error class
    /// and description. Events arriving before the reply are buffered.
    pub fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value> {
        let timeout = self.timeout;
        self.execute_until(
            command,
            arguments.as_ref(),
            Instant::now() + timeout,
            timeout,
        )
    }

    /// [`execute`](Self::execute) and decode the `return` value as `T`.
    pub fn execute_as<T: DeserializeOwned>(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<T> {
        let value = self.execute(command, arguments)?;
        serde_json::from_value(value).map_err(|source| QemuError::UnexpectedReply {
            command: command.to_owned(),
            source,
        })
    }

    fn execute_until(
        &mut self,
        command: &str,
        arguments: Option<&Value>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let mut line = serde_json::to_vec(&Request {
            execute: command,
            arguments,
            id,
        })
        .map_err(QemuError::Serialize)?;
        line.push(b'\n');
        trace!(line = %String::from_utf8_lossy(&line).trim_end(), "QMP send");
        debug!(command, id, "QMP execute");
        self.conn.send(&line, timeout)?;

        let waiting_for = format!("the reply to {command}");
        loop {
            let msg = self.conn.read_message(deadline, timeout, &waiting_for)?;
            let ours = |reply_id: &Option<Value>| match reply_id {
                // A reply without an id can only answer a request QEMU could not
                // parse far enough to see the id, i.e. this one.
                None => true,
                Some(v) => v.as_u64() == Some(id),
            };
            match classify(msg)? {
                Incoming::Event(ev) => self.buffer_event(ev),
                Incoming::Return { id: rid, value } if ours(&rid) => return Ok(value),
                Incoming::Error {
                    id: rid,
                    class,
                    desc,
                } if ours(&rid) => {
                    debug!(command, %class, %desc, "QMP error reply");
                    return Err(QemuError::Command {
                        command: command.to_owned(),
                        class,
                        desc,
                    });
                }
                Incoming::Return { id: rid, .. } | Incoming::Error { id: rid, .. } => {
                    warn!(?rid, expected = id, "Discarding stale QMP reply");
                }
            }
        }
    }

    fn buffer_event(&mut self, ev: QmpEvent) {
        debug!(event = %ev.event, data = %ev.data, "QMP event");
        self.events.push_back(ev);
    }

    /// Waits for the next event called `name` (buffered or new) and removes it
    /// from the buffer. Other events stay buffered.
    pub fn wait_event(&mut self, name: &str, timeout: Duration) -> Result<QmpEvent> {
        self.wait_event_where(name, |_| true, timeout)
    }

    /// Waits for an event called `name` for which `matches` holds.
    pub fn wait_event_where<F>(
        &mut self,
        name: &str,
        mut matches: F,
        timeout: Duration,
    ) -> Result<QmpEvent>
    where
        F: FnMut(&QmpEvent) -> bool,
    {
        if let Some(pos) = self
            .events
            .iter()
            .position(|e| e.event == name && matches(e))
            && let Some(ev) = self.events.remove(pos)
        {
            return Ok(ev);
        }
        let deadline = Instant::now() + timeout;
        let waiting_for = format!("event {name}");
        loop {
            let msg = self.conn.read_message(deadline, timeout, &waiting_for)?;
            match classify(msg)? {
                Incoming::Event(ev) if ev.event == name && matches(&ev) => {
                    debug!(event = %ev.event, data = %ev.data, "QMP event");
                    return Ok(ev);
                }
                Incoming::Event(ev) => self.buffer_event(ev),
                Incoming::Return { id, .. } | Incoming::Error { id, .. } => {
                    warn!(?id, "Discarding stale QMP reply");
                }
            }
        }
    }

    /// Removes and returns all buffered events, oldest first.
    pub fn take_events(&mut self) -> Vec<QmpEvent> {
        self.events.drain(..).collect()
    }

    /// Hot-plugs a `vfio-user-pci` device (`device_add` with the socket as
    /// nested JSON). The server must be listening; `bus` should be a free
    /// `pcie-root-port` (see [`root_port_id`](crate::root_port_id)).
    pub fn device_add_vfio_user(
        &mut self,
        id: &str,
        socket_path: impl AsRef<Path>,
        bus: Option<&str>,
    ) -> Result<()> {
        let mut dev = VfioUserDevice::new(id, socket_path.as_ref());
        dev.bus = bus.map(str::to_owned);
        self.device_add(&dev)
    }

    /// Hot-plugs `device` (see [`device_add_vfio_user`](Self::device_add_vfio_user)).
    pub fn device_add(&mut self, device: &VfioUserDevice) -> Result<()> {
        let args = device.to_json_value()?;
        self.execute("device_add", Some(args))?;
        Ok(())
    }

    /// Requests unplug of device `id` and waits up to `timeout` for its
    /// `DEVICE_DELETED` event.
    ///
    /// `device_del` only *asks*: on q35 the device sits behind a PCIe root
    /// port and the guest must cooperate. QEMU presses the slot's attention
    /// button (native PCIe hot-plug, Linux `pciehp`) or raises an ACPI eject
    /// request (ACPI PCI hot-plug, q35's default since QEMU 6.1;
    /// `-global ICH9-LPC.acpi-pci-hotplug-with-bridge-support=off` selects
    /// native); the guest driver releases the device and powers the slot off,
    /// and only then does QEMU unrealize it and emit `DEVICE_DELETED`. A guest
    /// that has not booted, has no hot-plug driver, or is stuck never
    /// completes the unplug, and this returns [`QemuError::Timeout`]. Devices
    /// on the root complex (`pcie.0`) cannot be unplugged at all.
    pub fn device_del(&mut self, id: &str, timeout: Duration) -> Result<QmpEvent> {
        self.execute("device_del", Some(serde_json::json!({ "id": id })))?;
        self.wait_event_where(
            "DEVICE_DELETED",
            |e| e.data.get("device").and_then(Value::as_str) == Some(id),
            timeout,
        )
    }

    /// `query-pci`.
    pub fn query_pci(&mut self) -> Result<Vec<PciBusInfo>> {
        self.execute_as("query-pci", None)
    }

    /// The first PCI function (also behind bridges) with the given vendor and device id.
    ///
    /// `query-pci` lists a bridge's devices only once the guest (firmware or
    /// OS) has programmed the bridge's secondary bus number, so a device
    /// hot-added on a root port of a guest that has not enumerated PCI yet is
    /// not found here; [`peripheral_ids`](Self::peripheral_ids) does not
    /// depend on the guest.
    pub fn find_pci_device(&mut self, vendor: u16, device: u16) -> Result<Option<PciDeviceInfo>> {
        let buses = self.query_pci()?;
        Ok(all_pci_devices(&buses)
            .into_iter()
            .find(|d| d.id.vendor == vendor && d.id.device == device)
            .cloned())
    }

    /// The ids of all user-created devices (`qom-list /machine/peripheral`),
    /// sorted. Unlike `query-pci` this does not depend on the guest having
    /// enumerated the bus, and an id disappears exactly when `DEVICE_DELETED`
    /// is emitted.
    pub fn peripheral_ids(&mut self) -> Result<Vec<String>> {
        #[derive(Deserialize)]
        struct ObjectProperty {
            name: String,
            #[serde(rename = "type")]
            kind: String,
        }
        let props: Vec<ObjectProperty> = self.execute_as(
            "qom-list",
            Some(serde_json::json!({ "path": "/machine/peripheral" })),
        )?;
        let mut ids: Vec<String> = props
            .into_iter()
            .filter(|p| p.kind.starts_with("child<"))
            .map(|p| p.name)
            .collect();
        ids.sort();
        Ok(ids)
    }

    /// `query-status`.
    pub fn query_status(&mut self) -> Result<StatusInfo> {
        self.execute_as("query-status", None)
    }

    /// `system_powerdown`: an ACPI power-button press. The guest decides what
    /// to do; wait for `SHUTDOWN` (see [`wait_event`](Self::wait_event)).
    pub fn system_powerdown(&mut self) -> Result<()> {
        self.execute("system_powerdown", None)?;
        Ok(())
    }

    /// `quit`: QEMU exits immediately. QEMU closing the socket before or
    /// after the reply counts as success.
    pub fn quit(&mut self) -> Result<()> {
        match self.execute("quit", None) {
            Ok(_) | Err(QemuError::Closed) => Ok(()),
            Err(QemuError::Io(e)) if e.kind() == io::ErrorKind::ConnectionReset => Ok(()),
            Err(e) => Err(e),
        }
    }
}

/// The socket plus bytes received but not yet split into lines.
#[derive(Debug)]
struct Connection {
    stream: UnixStream,
    rbuf: Vec<u8>,
}

impl Connection {
    fn send(&mut self, line: &[u8], timeout: Duration) -> Result<()> {
        self.stream
            .set_write_timeout(Some(timeout.max(Duration::from_millis(1))))
            .map_err(QemuError::Io)?;
        self.stream.write_all(line).map_err(|e| match e.kind() {
            io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => QemuError::Closed,
            _ => QemuError::Io(e),
        })
    }

    /// Reads one newline-terminated JSON message.
    fn read_message(
        &mut self,
        deadline: Instant,
        timeout: Duration,
        waiting_for: &str,
    ) -> Result<Value> {
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(pos) = self.rbuf.iter().position(|&b| b == b'\n') {
                let line: Vec<u8> = self.rbuf.drain(..=pos).collect();
                let text = line.trim_ascii();
                if text.is_empty() {
                    continue;
                }
                trace!(line = %String::from_utf8_lossy(text), "QMP recv");
                return serde_json::from_slice(text).map_err(QemuError::MalformedMessage);
            }
            if self.rbuf.len() > MAX_MESSAGE_LEN {
                return Err(QemuError::MessageTooLong {
                    limit: MAX_MESSAGE_LEN,
                });
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(QemuError::Timeout {
                    waiting_for: waiting_for.to_owned(),
                    timeout,
                });
            }
            self.stream
                .set_read_timeout(Some(remaining))
                .map_err(QemuError::Io)?;
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(QemuError::Closed),
                Ok(n) => self
                    .rbuf
                    .extend_from_slice(chunk.get(..n).unwrap_or_default()),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock
                            | io::ErrorKind::TimedOut
                            | io::ErrorKind::Interrupted
                    ) => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset => {
                    return Err(QemuError::Closed);
                }
                Err(e) => return Err(QemuError::Io(e)),
            }
        }
    }
}

fn classify(msg: Value) -> Result<Incoming> {
    let Value::Object(mut obj) = msg else {
        return Err(QemuError::UnexpectedMessage {
            message: msg.to_string(),
        });
    };
    let id = obj.remove("id");
    if let Some(value) = obj.remove("return") {
        return Ok(Incoming::Return { id, value });
    }
    if let Some(err) = obj.get("error") {
        let field = |k: &str| {
            err.get(k)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        return Ok(Incoming::Error {
            id,
            class: field("class"),
            desc: field("desc"),
        });
    }
    if obj.contains_key("event") {
        let value = Value::Object(obj);
        return QmpEvent::deserialize(&value)
            .map(Incoming::Event)
            .map_err(|_| QemuError::UnexpectedMessage {
                message: value.to_string(),
            });
    }
    if let Some(id) = id {
        obj.insert("id".to_owned(), id);
    }
    Err(QemuError::UnexpectedMessage {
        message: Value::Object(obj).to_string(),
    })
}
