//! Why a request failed: [`RequestError`], shared by the request handlers (`dispatcher`) and
//! the migration state machine (`migration`), which neither owns.

use switchyard_device::{DeviceError, DmaError};
use switchyard_proto::ProtoError;

/// Why a request failed: an errno for the reply, and a message for the log.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RequestError {
    #[error(transparent)]
    Proto(#[from] ProtoError),
    #[error(transparent)]
    Device(#[from] DeviceError),
    #[error(transparent)]
    Dma(#[from] DmaError),
    #[error("{what}")]
    Invalid { what: &'static str, errno: i32 },
}

impl RequestError {
    /// The errno the error reply carries.
    pub(crate) fn errno(&self) -> i32 {
        match self {
            RequestError::Proto(e) => e.errno(),
            RequestError::Device(e) => e.errno(),
            RequestError::Dma(e) => e.errno(),
            RequestError::Invalid { errno, .. } => *errno,
        }
    }
}

impl From<crate::origin::WriteError> for RequestError {
    /// A refused origin is `EPERM`; the device's own refusal keeps its errno.
    fn from(e: crate::origin::WriteError) -> Self {
        match e {
            crate::origin::WriteError::Origin(o) => RequestError::Invalid {
                what: match o {
                    crate::origin::OriginError::Missing => {
                        "migration stream without the expected origin header"
                    }
                    crate::origin::OriginError::Other => {
                        "migration stream from another origin than the expected one"
                    }
                },
                errno: libc::EPERM,
            },
            crate::origin::WriteError::Device(d) => RequestError::Device(d),
        }
    }
}

/// A request the server refuses with `EINVAL`.
pub(crate) fn invalid(what: &'static str) -> RequestError {
    RequestError::Invalid {
        what,
        errno: libc::EINVAL,
    }
}
