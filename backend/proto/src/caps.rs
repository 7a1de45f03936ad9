//! VERSION capabilities: tolerant parsing, range validation, negotiation and
//! the reply JSON.

use serde_json::{Map, Value};

use crate::consts::*;
use crate::error::ProtoError;

/// The legacy `migration` capability object (migration v1; still sent by QEMU).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct MigrationCap {
    /// Dirty-bitmap page size (multiple of 4096).
    pub pgsize: u64,
    /// Largest dirty bitmap in bytes (≤ 256 MiB). Defaults to 256 MiB when absent.
    pub max_bitmap_size: u64,
}

/// The `twin_socket` capability object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct TwinSocketCap {
    /// Whether twin-socket mode is supported / agreed.
    pub supported: bool,
    /// Reply only: index of the passed fd that is the server-to-client socket.
    pub fd_index: Option<u32>,
}

/// One side's capabilities, with spec defaults for anything missing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Capabilities {
    /// Most fds the sender of these capabilities can receive in one message.
    pub max_msg_fds: u32,
    /// Most bytes in one REGION/DMA READ/WRITE the sender can receive.
    pub max_data_xfer_size: u32,
    /// Most simultaneous DMA maps.
    pub max_dma_maps: u32,
    /// OR of supported DMA page sizes.
    pub pgsizes: u64,
    /// Legacy migration capability.
    pub migration: Option<MigrationCap>,
    /// REGION_WRITE_MULTI supported.
    pub write_multiple: bool,
    /// Twin-socket capability, if present.
    pub twin_socket: Option<TwinSocketCap>,
    /// In-flight `sparse_mmap_fds` capability.
    pub sparse_mmap_fds: bool,
}

impl Default for Capabilities {
    fn default() -> Self {
        Capabilities {
            max_msg_fds: DEFAULT_MAX_MSG_FDS,
            max_data_xfer_size: DEFAULT_MAX_DATA_XFER_SIZE,
            max_dma_maps: DEFAULT_MAX_DMA_MAPS,
            pgsizes: DEFAULT_PGSIZES,
            migration: None,
            write_multiple: false,
            twin_socket: None,
            sparse_mmap_fds: false,
        }
    }
}

/// What the server supports; input to [`negotiate`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServerLimits {
    /// Most fds the server accepts per message (advertised as `max_msg_fds`).
    pub max_msg_fds: u32,
    /// Most bytes per REGION_READ/WRITE the server accepts.
    pub max_data_xfer_size: u32,
    /// Most simultaneous DMA maps.
    pub max_dma_maps: u32,
    /// OR of supported DMA page sizes.
    pub pgsizes: u64,
    /// Legacy migration capability to offer when the client sends one.
    pub migration: Option<MigrationCap>,
    /// Whether REGION_WRITE_MULTI is implemented.
    pub write_multiple: bool,
    /// Whether twin-socket mode is implemented (the server then passes fd 0).
    pub twin_socket: bool,
    /// Whether the in-flight SPARSE_MMAP_FDS capability is implemented.
    pub sparse_mmap_fds: bool,
}

impl Default for ServerLimits {
    /// QEMU-compatible server defaults: 8 fds, 1 MiB transfers, 65535 maps,
    /// 4 KiB pages, WRITE_MULTI on, no twin socket, no legacy migration cap.
    fn default() -> Self {
        ServerLimits {
            max_msg_fds: QEMU_DEFAULT_MAX_FDS,
            max_data_xfer_size: DEFAULT_MAX_DATA_XFER_SIZE,
            max_dma_maps: DEFAULT_MAX_DMA_MAPS,
            pgsizes: DEFAULT_PGSIZES,
            migration: None,
            write_multiple: true,
            twin_socket: false,
            sparse_mmap_fds: false,
        }
    }
}

fn cap_err(msg: impl Into<String>) -> ProtoError {
    ProtoError::Capabilities(msg.into())
}

fn get_u64(v: &Value, key: &str) -> Result<u64, ProtoError> {
    v.as_u64()
        .ok_or_else(|| cap_err(format!("{key} must be a non-negative integer")))
}

fn get_u32(v: &Value, key: &str) -> Result<u32, ProtoError> {
    u32::try_from(get_u64(v, key)?).map_err(|_| cap_err(format!("{key} is out of range")))
}

fn get_bool(v: &Value, key: &str) -> Result<bool, ProtoError> {
    v.as_bool()
        .ok_or_else(|| cap_err(format!("{key} must be a boolean")))
}

/// Splits the version-data bytes into the JSON text: empty, or NUL-terminated
/// UTF-8 with no interior NUL. Returns `None` for "no JSON".
pub fn version_json_text(data: &[u8]) -> Result<Option<&str>, ProtoError> {
    let Some((&last, text)) = data.split_last() else {
        return Ok(None);
    };
    if last != 0 {
        return Err(ProtoError::BadVersionData("JSON is not NUL-terminated"));
    }
    if text.contains(&0) {
        return Err(ProtoError::BadVersionData("JSON contains a NUL byte"));
    }
    let s =
        core::str::from_utf8(text).map_err(|_| ProtoError::BadVersionData("JSON is not UTF-8"))?;
    if s.trim().is_empty() {
        Ok(None)
    } else {
        Ok(Some(s))
    }
}

impl Capabilities {
    /// Parses the version data of a VERSION message (the bytes after
    /// `major`/`minor`): empty or `"\0"` yields defaults; otherwise a
    /// NUL-terminated JSON object, optionally with a `capabilities` object.
    /// Unknown keys are ignored, missing keys get defaults, wrong types and
    /// out-of-range values are `EINVAL`.
    pub fn from_version_data(data: &[u8]) -> Result<Capabilities, ProtoError> {
        match version_json_text(data)? {
            None => Ok(Capabilities::default()),
            Some(text) => Capabilities::from_json_str(text),
        }
    }

    /// Parses JSON text (without NUL) as described in [`Capabilities::from_version_data`].
    pub fn from_json_str(text: &str) -> Result<Capabilities, ProtoError> {
        let root: Value =
            serde_json::from_str(text).map_err(|e| cap_err(format!("malformed JSON: {e}")))?;
        let root = root
            .as_object()
            .ok_or_else(|| cap_err("version data is not a JSON object"))?;
        let mut caps = Capabilities::default();
        let Some(c) = root.get("capabilities") else {
            return Ok(caps);
        };
        let c = c
            .as_object()
            .ok_or_else(|| cap_err("capabilities is not an object"))?;
        for (key, v) in c {
            match key.as_str() {
                "max_msg_fds" => caps.max_msg_fds = get_u32(v, key)?,
                "max_data_xfer_size" => caps.max_data_xfer_size = get_u32(v, key)?,
                "max_dma_maps" => caps.max_dma_maps = get_u32(v, key)?,
                "pgsizes" => caps.pgsizes = get_u64(v, key)?,
                "write_multiple" => caps.write_multiple = get_bool(v, key)?,
                "sparse_mmap_fds" => caps.sparse_mmap_fds = get_bool(v, key)?,
                "migration" => {
                    let m = v
                        .as_object()
                        .ok_or_else(|| cap_err("migration is not an object"))?;
                    let mut mig = MigrationCap {
                        pgsize: DEFAULT_PGSIZES,
                        max_bitmap_size: DEFAULT_MAX_BITMAP_SIZE,
                    };
                    for (k, mv) in m {
                        match k.as_str() {
                            "pgsize" => mig.pgsize = get_u64(mv, "migration.pgsize")?,
                            "max_bitmap_size" => {
                                mig.max_bitmap_size = get_u64(mv, "migration.max_bitmap_size")?
                            }
                            _ => {}
                        }
                    }
                    caps.migration = Some(mig);
                }
                "twin_socket" => {
                    let t = v
                        .as_object()
                        .ok_or_else(|| cap_err("twin_socket is not an object"))?;
                    let mut ts = TwinSocketCap::default();
                    for (k, tv) in t {
                        match k.as_str() {
                            "supported" => ts.supported = get_bool(tv, "twin_socket.supported")?,
                            "fd_index" => ts.fd_index = Some(get_u32(tv, "twin_socket.fd_index")?),
                            _ => {}
                        }
                    }
                    caps.twin_socket = Some(ts);
                }
                _ => {}
            }
        }
        caps.validate()?;
        Ok(caps)
    }

    /// Checks QEMU/libvfio-user-like ranges: `max_msg_fds ≤ 1024`,
    /// `0 < max_data_xfer_size ≤ 64 MiB`, `0 < max_dma_maps ≤ 65535`,
    /// `pgsizes` a nonzero multiple of 4096, migration `pgsize` a nonzero
    /// multiple of 4096 and `max_bitmap_size ≤ 256 MiB`.
    pub fn validate(&self) -> Result<(), ProtoError> {
        if self.max_msg_fds > MAX_MSG_FDS_LIMIT {
            return Err(cap_err(format!(
                "max_msg_fds {} exceeds {MAX_MSG_FDS_LIMIT}",
                self.max_msg_fds
            )));
        }
        if self.max_data_xfer_size == 0 || self.max_data_xfer_size > MAX_DATA_XFER_SIZE_LIMIT {
            return Err(cap_err(format!(
                "max_data_xfer_size {} is out of range",
                self.max_data_xfer_size
            )));
        }
        if self.max_dma_maps == 0 || self.max_dma_maps > MAX_DMA_MAPS_LIMIT {
            return Err(cap_err(format!(
                "max_dma_maps {} is out of range",
                self.max_dma_maps
            )));
        }
        if self.pgsizes == 0 || !self.pgsizes.is_multiple_of(4096) {
            return Err(cap_err(format!(
                "pgsizes {:#x} is not a multiple of 4096",
                self.pgsizes
            )));
        }
        if let Some(m) = &self.migration {
            if m.pgsize == 0 || m.pgsize % 4096 != 0 {
                return Err(cap_err(format!(
                    "migration pgsize {:#x} is not a multiple of 4096",
                    m.pgsize
                )));
            }
            if m.max_bitmap_size > MAX_BITMAP_SIZE_LIMIT {
                return Err(cap_err(format!(
                    "migration max_bitmap_size {} is too large",
                    m.max_bitmap_size
                )));
            }
        }
        Ok(())
    }

    /// The capabilities as a JSON value `{"capabilities": {...}}`.
    pub fn to_json_value(&self) -> Value {
        let mut c = Map::new();
        c.insert("max_msg_fds".into(), self.max_msg_fds.into());
        c.insert("max_data_xfer_size".into(), self.max_data_xfer_size.into());
        c.insert("max_dma_maps".into(), self.max_dma_maps.into());
        c.insert("pgsizes".into(), self.pgsizes.into());
        if let Some(m) = &self.migration {
            let mut mo = Map::new();
            mo.insert("pgsize".into(), m.pgsize.into());
            mo.insert("max_bitmap_size".into(), m.max_bitmap_size.into());
            c.insert("migration".into(), Value::Object(mo));
        }
        c.insert("write_multiple".into(), self.write_multiple.into());
        if let Some(t) = &self.twin_socket {
            let mut to = Map::new();
            to.insert("supported".into(), t.supported.into());
            if let Some(i) = t.fd_index {
                to.insert("fd_index".into(), i.into());
            }
            c.insert("twin_socket".into(), Value::Object(to));
        }
        if self.sparse_mmap_fds {
            c.insert("sparse_mmap_fds".into(), true.into());
        }
        let mut root = Map::new();
        root.insert("capabilities".into(), Value::Object(c));
        Value::Object(root)
    }

    /// Appends the NUL-terminated JSON (the VERSION version data) to `out`.
    pub fn write_version_data(&self, out: &mut Vec<u8>) {
        // Serialising a `Value` into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut *out, &self.to_json_value());
        out.push(0);
    }

    /// The NUL-terminated JSON as a new vector.
    pub fn to_version_data(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.write_version_data(&mut v);
        v
    }
}

/// Computes the server's reply capabilities from the client's proposal.
///
/// * `max_msg_fds`, `max_data_xfer_size`, `max_dma_maps`: the server's own
///   limits (each side advertises what *it* can receive).
/// * `pgsizes`: client ∩ server; if empty, 4 KiB (the spec default).
/// * `migration`: only if the client proposed it and the server offers it;
///   `pgsize` is the server's, `max_bitmap_size` the smaller of the two.
/// * `write_multiple`, `sparse_mmap_fds`: both sides must support it.
/// * `twin_socket`: `{supported: true, fd_index: 0}` only if the client asked
///   and the server supports it (the caller must then pass the socket as the
///   reply's only fd); otherwise omitted.
pub fn negotiate(client: &Capabilities, server: &ServerLimits) -> Capabilities {
    let pg = client.pgsizes & server.pgsizes;
    Capabilities {
        max_msg_fds: server.max_msg_fds,
        max_data_xfer_size: server.max_data_xfer_size,
        max_dma_maps: server.max_dma_maps,
        pgsizes: if pg == 0 { DEFAULT_PGSIZES } else { pg },
        migration: match (&client.migration, &server.migration) {
            (Some(c), Some(s)) => Some(MigrationCap {
                pgsize: s.pgsize,
                max_bitmap_size: c.max_bitmap_size.min(s.max_bitmap_size),
            }),
            _ => None,
        },
        write_multiple: client.write_multiple && server.write_multiple,
        twin_socket: match client.twin_socket {
            Some(t) if t.supported && server.twin_socket => Some(TwinSocketCap {
                supported: true,
                fd_index: Some(0),
            }),
            _ => None,
        },
        sparse_mmap_fds: client.sparse_mmap_fds && server.sparse_mmap_fds,
    }
}

/// The outcome of a server-side VERSION negotiation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// Minor version to reply with (always 0).
    pub minor: u16,
    /// The client's capabilities (limits for what the server sends it).
    pub client: Capabilities,
    /// The capabilities the server replies with.
    pub reply: Capabilities,
}

/// Server side of VERSION: rejects major ≠ 0 (`EINVAL`), parses the client's
/// capabilities and negotiates. The reply minor is 0: QEMU proposes 0.0 and
/// rejects a higher reply minor, and nothing in minors 1–2 is needed.
pub fn negotiate_version(
    major: u16,
    _minor: u16,
    version_data: &[u8],
    server: &ServerLimits,
) -> Result<Negotiated, ProtoError> {
    if major != VFIO_USER_MAJOR {
        return Err(ProtoError::UnsupportedMajor(major));
    }
    let client = Capabilities::from_version_data(version_data)?;
    let reply = negotiate(&client, server);
    Ok(Negotiated {
        minor: VFIO_USER_MINOR,
        client,
        reply,
    })
}
