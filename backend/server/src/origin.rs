//! Where a migration stream comes from: an origin header the server puts around any device
//! kind's stream.
//!
//! A server with an origin token ([`ServerConfig::migration_origin`](crate::ServerConfig::migration_origin),
//! a pool endpoint's own token) starts every outgoing stream (RUNNING → PRE_COPY, STOP →
//! STOP_COPY) with a header of [`HEADER_LEN`] bytes: the magic `SYORIGN1` and the token's 32
//! characters. The device's own stream follows, unchanged; PRE_COPY → STOP_COPY continues the
//! same stream (no second header).
//!
//! A server that expects an origin ([`ServerConfig::migration_expect_origin`](crate::ServerConfig::migration_expect_origin),
//! the destination of a pool's live migration: its source's token) checks the first bytes of
//! every incoming stream (RESUMING) and strips the header before the device sees the stream:
//! a stream without the header, with another token, or shorter than the header leaves the
//! device in ERROR. A server that expects none (plain `switchyard serve`) takes streams with
//! or without the header (one is stripped, its token ignored). After RESUMING → STOP the
//! server knows whether what was loaded came from the expected origin; every later
//! [`MigChange`](crate::MigChange) says so (`origin_verified`), until the next stream, reset or
//! abandoned migration.

use switchyard_device::{DeviceError, MigArc, Migratable};

/// Characters of an origin token.
pub const TOKEN_LEN: usize = switchyard_device::secret::SECRET_LEN;
/// The header's magic.
const MAGIC: [u8; 8] = *b"SYORIGN1";
/// Bytes of the origin header: the magic, then the token.
pub const HEADER_LEN: usize = MAGIC.len() + TOKEN_LEN;

/// A migration origin token: 32 lowercase hexadecimal characters (128 random bits). Whoever
/// holds it can make a stream pass for one of its endpoint's: it is not printed by `Debug`.
#[derive(Clone, PartialEq, Eq)]
pub struct OriginToken([u8; TOKEN_LEN]);

/// A string that is not an origin token.
#[derive(Debug, thiserror::Error)]
#[error("A migration origin token is {TOKEN_LEN} lowercase hexadecimal characters")]
pub struct BadToken;

impl OriginToken {
    /// Checks `s`: exactly [`TOKEN_LEN`] characters of `0-9a-f`.
    pub fn parse(s: &str) -> Result<Self, BadToken> {
        if !switchyard_device::secret::is_secret(s) {
            return Err(BadToken);
        }
        s.as_bytes().try_into().map(Self).map_err(|_| BadToken)
    }

    /// The token's text.
    pub fn as_str(&self) -> &str {
        // Checked ASCII at `parse`.
        std::str::from_utf8(&self.0).unwrap_or_default()
    }

    /// Compares in constant time (a peer learns nothing from how long a refusal took).
    fn matches(&self, other: &[u8]) -> bool {
        other.len() == TOKEN_LEN
            && self
                .0
                .iter()
                .zip(other)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl std::fmt::Debug for OriginToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("OriginToken(..)")
    }
}

/// Where an incoming stream's header stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Incoming {
    /// No incoming stream.
    Idle,
    /// The first `len` bytes of the stream, which may be the header, are held back.
    Sniffing { buf: [u8; HEADER_LEN], len: usize },
    /// Decided: the rest goes to the device as it comes.
    Passing,
}

/// Why an incoming stream is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum OriginError {
    /// The stream has no origin header (or is shorter than one).
    #[error("Migration stream without an origin header; this device takes only its source's")]
    Missing,
    /// The header names another origin.
    #[error("Migration stream from another origin than this device's source")]
    Other,
}

/// A write into an incoming stream that failed.
#[derive(Debug, thiserror::Error)]
pub(crate) enum WriteError {
    /// The stream's origin is refused: the device goes to ERROR.
    #[error(transparent)]
    Origin(#[from] OriginError),
    /// The device refused the bytes.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// The origin bookkeeping of a device slot's migration streams.
#[derive(Debug)]
pub(crate) struct Origin {
    /// Stamped on outgoing streams.
    token: Option<OriginToken>,
    /// Required of incoming streams.
    expect: Option<OriginToken>,
    /// Bytes of the header already read out, while the outgoing header is not all out.
    out: Option<usize>,
    incoming: Incoming,
    /// The incoming stream's header named the expected origin.
    matched: bool,
    /// What the device loaded last (RESUMING → STOP) came from the expected origin.
    verified: bool,
    /// The outgoing stream was read to its end in the current STOP_COPY.
    drained: bool,
    /// STOP was reached from a drained STOP_COPY, and no arc was taken since
    /// ([`crate::MigChange::sent`]).
    sent: bool,
}

impl Origin {
    pub(crate) fn new(token: Option<OriginToken>, expect: Option<OriginToken>) -> Self {
        Self {
            token,
            expect,
            out: None,
            incoming: Incoming::Idle,
            matched: false,
            verified: false,
            drained: false,
            sent: false,
        }
    }

    /// Whether STOP was reached from a STOP_COPY whose stream was read to its end, with
    /// no arc since ([`crate::MigChange::sent`]).
    pub(crate) fn sent(&self) -> bool {
        self.sent
    }

    /// A MIG_DATA_READ in STOP_COPY answered fewer bytes than asked: the outgoing stream is
    /// read out.
    pub(crate) fn stream_read_out(&mut self) {
        self.drained = true;
    }

    /// Whether the device's state was loaded from a stream of the expected origin.
    pub(crate) fn verified(&self) -> bool {
        self.verified
    }

    fn header(token: &OriginToken) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[..MAGIC.len()].copy_from_slice(&MAGIC);
        h[MAGIC.len()..].copy_from_slice(&token.0);
        h
    }

    /// Before arc `arc` is taken: RESUMING → STOP first hands the device what was held back
    /// (a stream too short to be a header), or refuses a stream whose origin is unproven.
    pub(crate) fn before_arc(
        &mut self,
        arc: MigArc,
        mig: &mut dyn Migratable,
    ) -> Result<(), WriteError> {
        if arc != MigArc::EndResuming {
            return Ok(());
        }
        if let Incoming::Sniffing { buf, len } = self.incoming {
            if self.expect.is_some() {
                return Err(OriginError::Missing.into());
            }
            self.incoming = Incoming::Passing;
            if len > 0 {
                mig.write(&buf[..len])?;
            }
        } else if self.expect.is_some() && !self.matched {
            // An empty stream (nothing was written), or one refused already.
            return Err(OriginError::Missing.into());
        }
        Ok(())
    }

    /// Arc `arc` was taken.
    pub(crate) fn after_arc(&mut self, arc: MigArc) {
        // Only STOP_COPY → STOP keeps what the stream's end said; any other arc runs the
        // device, opens a stream or starts another STOP_COPY.
        self.sent = arc == MigArc::EndStopCopy && self.drained;
        self.drained = false;
        match arc {
            MigArc::StartPreCopy | MigArc::StartPreCopyP2p | MigArc::StartStopCopy => {
                self.out = self.token.as_ref().map(|_| 0);
            }
            MigArc::AbortPreCopy | MigArc::AbortPreCopyP2p | MigArc::EndStopCopy => self.out = None,
            MigArc::StartResuming => {
                self.incoming = Incoming::Sniffing {
                    buf: [0; HEADER_LEN],
                    len: 0,
                };
                self.matched = false;
                self.verified = false;
            }
            MigArc::EndResuming => {
                self.incoming = Incoming::Idle;
                self.verified = self.expect.is_some() && self.matched;
            }
            MigArc::PreCopyToStopCopy
            | MigArc::PreCopyP2pToStopCopy
            | MigArc::Stop
            | MigArc::Run
            | MigArc::EnterP2p
            | MigArc::LeaveP2p
            | MigArc::StopFromP2p
            | MigArc::P2pFromStop => {}
        }
    }

    /// The migration was abandoned (reset, client gone, idle timeout) or failed: no stream
    /// is open and nothing loaded is vouched for.
    pub(crate) fn abort(&mut self) {
        self.out = None;
        self.drained = false;
        self.sent = false;
        self.incoming = Incoming::Idle;
        self.matched = false;
        self.verified = false;
    }

    /// MIG_DATA_READ: the header's next bytes, then the device's stream.
    /// Bytes of the origin header the outgoing stream has still to send.
    pub(crate) fn unsent_header(&self) -> usize {
        match (self.out, &self.token) {
            (Some(pos), Some(_)) => HEADER_LEN - pos,
            _ => 0,
        }
    }

    pub(crate) fn read(
        &mut self,
        mig: &mut dyn Migratable,
        buf: &mut [u8],
    ) -> Result<usize, DeviceError> {
        let mut n = 0;
        if let (Some(pos), Some(token)) = (self.out, &self.token) {
            let h = Self::header(token);
            n = (HEADER_LEN - pos).min(buf.len());
            buf[..n].copy_from_slice(&h[pos..pos + n]);
            self.out = (pos + n < HEADER_LEN).then_some(pos + n);
        }
        if n < buf.len() {
            n += mig.read(&mut buf[n..])?;
        }
        Ok(n)
    }

    /// MIG_DATA_WRITE: the header is taken off (and checked), the rest goes to the device.
    pub(crate) fn write(
        &mut self,
        mig: &mut dyn Migratable,
        data: &[u8],
    ) -> Result<(), WriteError> {
        let Incoming::Sniffing { mut buf, mut len } = self.incoming else {
            return Ok(mig.write(data)?);
        };
        let take = (HEADER_LEN - len).min(data.len());
        buf[len..len + take].copy_from_slice(&data[..take]);
        len += take;
        let rest = &data[take..];
        let magic = len.min(MAGIC.len());
        if buf[..magic] != MAGIC[..magic] {
            // Not a header: the stream is the device's own.
            self.incoming = Incoming::Passing;
            if self.expect.is_some() {
                return Err(OriginError::Missing.into());
            }
            mig.write(&buf[..len])?;
            if !rest.is_empty() {
                mig.write(rest)?;
            }
            return Ok(());
        }
        if len < HEADER_LEN {
            self.incoming = Incoming::Sniffing { buf, len };
            return Ok(());
        }
        self.incoming = Incoming::Passing;
        if let Some(expect) = &self.expect {
            if !expect.matches(&buf[MAGIC.len()..]) {
                return Err(OriginError::Other.into());
            }
            self.matched = true;
        }
        if !rest.is_empty() {
            mig.write(rest)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use switchyard_device::MigrationCaps;

    use super::*;

    const A: &str = "0123456789abcdef0123456789abcdef";
    const B: &str = "fedcba9876543210fedcba9876543210";

    /// A device whose stream is `out` and which records what it is written.
    #[derive(Default)]
    struct Recorder {
        out: Vec<u8>,
        read: usize,
        written: Vec<u8>,
    }

    impl Migratable for Recorder {
        fn caps(&self) -> MigrationCaps {
            MigrationCaps {
                precopy: true,
                p2p: false,
            }
        }
        fn step(&mut self, _: MigArc) -> switchyard_device::Result<()> {
            Ok(())
        }
        fn read(&mut self, buf: &mut [u8]) -> switchyard_device::Result<usize> {
            let n = (self.out.len() - self.read).min(buf.len());
            buf[..n].copy_from_slice(&self.out[self.read..self.read + n]);
            self.read += n;
            Ok(n)
        }
        fn write(&mut self, data: &[u8]) -> switchyard_device::Result<()> {
            self.written.extend_from_slice(data);
            Ok(())
        }
        fn abort(&mut self) {}
    }

    fn token(s: &str) -> Option<OriginToken> {
        Some(OriginToken::parse(s).expect("token"))
    }

    /// Reads a whole outgoing stream of `token`'s server in reads of `chunk` bytes.
    fn outgoing(token: Option<OriginToken>, body: &[u8], chunk: usize) -> Vec<u8> {
        let mut o = Origin::new(token, None);
        let mut dev = Recorder {
            out: body.to_vec(),
            ..Recorder::default()
        };
        o.after_arc(MigArc::StartStopCopy);
        let mut stream = Vec::new();
        loop {
            let mut buf = vec![0u8; chunk];
            let n = o.read(&mut dev, &mut buf).expect("read");
            stream.extend_from_slice(&buf[..n]);
            if n < chunk {
                return stream;
            }
        }
    }

    /// Writes `stream` into a server expecting `expect`, in chunks of `chunk` bytes, then
    /// ends RESUMING: what the device got, or the refusal.
    fn incoming(
        expect: Option<OriginToken>,
        stream: &[u8],
        chunk: usize,
    ) -> (Result<Vec<u8>, OriginError>, bool) {
        let mut o = Origin::new(None, expect);
        let mut dev = Recorder::default();
        o.after_arc(MigArc::StartResuming);
        for c in stream.chunks(chunk) {
            match o.write(&mut dev, c) {
                Ok(()) => {}
                Err(WriteError::Origin(e)) => return (Err(e), o.verified()),
                Err(e) => panic!("{e}"),
            }
        }
        match o.before_arc(MigArc::EndResuming, &mut dev) {
            Ok(()) => {}
            Err(WriteError::Origin(e)) => return (Err(e), o.verified()),
            Err(e) => panic!("{e}"),
        }
        o.after_arc(MigArc::EndResuming);
        (Ok(dev.written), o.verified())
    }

    #[test]
    fn tokens_are_32_lowercase_hex_characters() {
        assert_eq!(OriginToken::parse(A).expect("A").as_str(), A);
        for bad in [
            "",
            "0123",
            &A.to_uppercase(),
            &format!("{A}0"),
            &A.replace('a', "g"),
        ] {
            assert!(OriginToken::parse(bad).is_err(), "{bad}");
        }
        assert!(
            !format!("{:?}", token(A)).contains(A),
            "Debug shows the token"
        );
    }

    #[test]
    fn the_header_goes_first_and_the_device_stream_follows_unchanged() {
        let body: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        for chunk in [1, 7, 39, 40, 41, 4096] {
            let s = outgoing(token(A), &body, chunk);
            assert_eq!(&s[..8], b"SYORIGN1", "chunk {chunk}");
            assert_eq!(&s[8..HEADER_LEN], A.as_bytes(), "chunk {chunk}");
            assert_eq!(&s[HEADER_LEN..], &body[..], "chunk {chunk}");
        }
        // Without a token, the device's stream alone.
        assert_eq!(outgoing(None, &body, 100), body);
    }

    #[test]
    fn an_expected_origin_is_checked_and_stripped_in_chunks_of_any_size() {
        let body: Vec<u8> = (0..300u32).map(|i| i as u8).collect();
        let stream = outgoing(token(A), &body, 4096);
        for chunk in [1, 3, 8, 39, 40, 41, 1000] {
            assert_eq!(
                incoming(token(A), &stream, chunk),
                (Ok(body.clone()), true),
                "chunk {chunk}"
            );
            // Another origin, and the device's stream without a header: refused.
            assert_eq!(
                incoming(token(B), &stream, chunk),
                (Err(OriginError::Other), false),
                "chunk {chunk}"
            );
            assert_eq!(
                incoming(token(A), &body, chunk),
                (Err(OriginError::Missing), false),
                "chunk {chunk}"
            );
        }
        // Shorter than a header, or empty: refused.
        assert_eq!(
            incoming(token(A), &stream[..20], 5),
            (Err(OriginError::Missing), false)
        );
        assert_eq!(
            incoming(token(A), &[], 5),
            (Err(OriginError::Missing), false)
        );
    }

    #[test]
    fn without_an_expected_origin_streams_with_or_without_the_header_load() {
        let body: Vec<u8> = (0..300u32).map(|i| (i * 3) as u8).collect();
        let stamped = outgoing(token(B), &body, 4096);
        for chunk in [1, 5, 40, 1000] {
            assert_eq!(incoming(None, &stamped, chunk), (Ok(body.clone()), false));
            assert_eq!(incoming(None, &body, chunk), (Ok(body.clone()), false));
        }
        // A stream shorter than a header that starts like one reaches the device whole.
        assert_eq!(incoming(None, b"SYOR", 1), (Ok(b"SYOR".to_vec()), false));
    }

    #[test]
    fn a_new_stream_or_an_abort_forgets_what_was_verified() {
        let stream = outgoing(token(A), b"state", 4096);
        let mut o = Origin::new(None, token(A));
        let mut dev = Recorder::default();
        o.after_arc(MigArc::StartResuming);
        o.write(&mut dev, &stream).expect("write");
        o.before_arc(MigArc::EndResuming, &mut dev).expect("end");
        o.after_arc(MigArc::EndResuming);
        assert!(o.verified());
        o.after_arc(MigArc::Run);
        assert!(o.verified(), "running on what was loaded");
        o.abort();
        assert!(!o.verified());
        o.after_arc(MigArc::StartResuming);
        o.write(&mut dev, &stream).expect("write");
        assert!(!o.verified(), "not before the stream is complete");
    }

    #[test]
    fn only_stop_after_a_stream_read_out_counts_as_sent() {
        let mut o = Origin::new(token(A), None);
        // QEMU's completed migration: STOP_COPY, read to the end, STOP.
        o.after_arc(MigArc::StartStopCopy);
        o.stream_read_out();
        assert!(!o.sent(), "not before STOP");
        o.after_arc(MigArc::EndStopCopy);
        assert!(o.sent());
        // The migration failed after all: the device runs again.
        o.after_arc(MigArc::Run);
        assert!(!o.sent());
        // STOP_COPY left before the stream's end (a cancelled migration).
        o.after_arc(MigArc::Stop);
        o.after_arc(MigArc::StartStopCopy);
        o.after_arc(MigArc::EndStopCopy);
        assert!(!o.sent());
        // A stream read out and then abandoned (the client went away in STOP_COPY).
        o.after_arc(MigArc::StartStopCopy);
        o.stream_read_out();
        o.abort();
        o.after_arc(MigArc::EndStopCopy);
        assert!(!o.sent());
        // Sent, then abandoned: the abort forgets it (the change reports it before).
        o.after_arc(MigArc::StartStopCopy);
        o.stream_read_out();
        o.after_arc(MigArc::EndStopCopy);
        assert!(o.sent());
        o.abort();
        assert!(!o.sent());
    }
}
