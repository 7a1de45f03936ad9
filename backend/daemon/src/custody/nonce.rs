//! A worker's nonce: a secret the daemon makes for each worker process it starts, writes in
//! the worker's pid record and gives the worker ([`Note::Start`](super::Note::Start)); the
//! worker keeps it across re-execs and proves it when adopted
//! ([`Note::Adopted`](super::Note::Adopted)). A pid record is a claim: a process that cannot
//! show the record's nonce on its adoption socket is not taken for the worker it names (see
//! `app::records`).

use std::fmt;
use std::io;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use switchyard_device::secret;

/// A secret the daemon makes for each worker process it starts: written in the worker's pid
/// record and given to the worker ([`Note::Start`](super::Note::Start)), which keeps it
/// across re-execs and proves it when adopted ([`Note::Adopted`](super::Note::Adopted)).
/// Its `Debug` does not show it (notes are logged).
#[derive(Clone, PartialEq, Eq)]
pub struct WorkerNonce(String);

impl WorkerNonce {
    /// A new nonce from the kernel's random source ([`switchyard_device::secret`], the format
    /// of every secret: 128 bits as 32 lowercase hex digits).
    pub fn generate() -> io::Result<Self> {
        secret::new_secret().map(Self)
    }

    /// The nonce written as [`WorkerNonce::as_str`] gives it: `2 × 16` lowercase hex digits;
    /// anything else is none.
    pub fn parse(text: &str) -> Option<Self> {
        secret::is_secret(text).then(|| Self(text.to_owned()))
    }

    /// As written in a record and a note.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for WorkerNonce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("WorkerNonce(..)")
    }
}

impl Serialize for WorkerNonce {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for WorkerNonce {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        Self::parse(&text).ok_or_else(|| serde::de::Error::custom("not a worker nonce"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nonces_differ_round_trip_and_do_not_show() {
        let a = WorkerNonce::generate().expect("nonce");
        let b = WorkerNonce::generate().expect("nonce");
        assert_ne!(a, b);
        assert_eq!(WorkerNonce::parse(a.as_str()), Some(a.clone()));
        let json = serde_json::to_string(&a).expect("json");
        assert_eq!(serde_json::from_str::<WorkerNonce>(&json).expect("back"), a);
        assert!(!format!("{a:?}").contains(a.as_str()));
        for bad in [
            "",
            "xyz",
            &a.as_str()[1..],
            "0123456789ABCDEF0123456789abcdef",
        ] {
            assert_eq!(WorkerNonce::parse(bad), None, "{bad:?}");
        }
        assert!(serde_json::from_str::<WorkerNonce>("\"nope\"").is_err());
    }
}
