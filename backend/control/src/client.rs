//! A small blocking HTTP/1.1 client for the control socket (what `switchyard ctl` uses).
//!
//! One request per connection (`Connection: close`): a UNIX connect costs microseconds and a
//! CLI sends a handful of requests, so keep-alive would buy nothing and cost a reconnect path.
//! Response bodies may be framed by `Content-Length`, chunked, or the end of the connection.

use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::ControlError;
use crate::api::ErrorBody;

/// The longest response head (status line and headers) accepted.
const MAX_HEAD: usize = 64 * 1024;
/// The largest non-streamed response body accepted.
const MAX_BODY: u64 = 64 * 1024 * 1024;
/// The longest line of a streamed body (an event) or a chunk-size line.
const MAX_LINE: u64 = 16 * 1024 * 1024;
/// The most headers a response may have.
const MAX_HEADERS: usize = 64;

/// Blocking client of the control API on a UNIX socket.
#[derive(Debug, Clone)]
pub struct ControlClient {
    path: PathBuf,
    timeout: Option<Duration>,
}

/// A response, whatever its status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawReply {
    /// The HTTP status.
    pub status: u16,
    /// The `Content-Type`, if any.
    pub content_type: Option<String>,
    /// The whole body.
    pub body: Vec<u8>,
}

impl RawReply {
    /// The body as the error shape of the API, if it is one.
    pub fn error(&self) -> Option<ErrorBody> {
        serde_json::from_slice(&self.body).ok()
    }

    fn into_result(self) -> Result<Self, ControlError> {
        if (200..300).contains(&self.status) {
            return Ok(self);
        }
        Err(match self.error() {
            Some(body) => ControlError::Api {
                status: self.status,
                code: body.error.code,
                message: body.error.message,
            },
            None => ControlError::Api {
                status: self.status,
                code: "unknown".to_owned(),
                message: String::from_utf8_lossy(&self.body).trim().to_owned(),
            },
        })
    }
}

/// A successful JSON response.
#[derive(Debug, Clone, PartialEq)]
pub struct JsonReply {
    /// The HTTP status (2xx).
    pub status: u16,
    /// The body; `Null` when empty (204).
    pub body: serde_json::Value,
}

impl JsonReply {
    /// The body as a `T`.
    pub fn json<T: DeserializeOwned>(self) -> Result<T, ControlError> {
        serde_json::from_value(self.body).map_err(ControlError::BadReplyBody)
    }
}

impl ControlClient {
    /// A client of the server at `path`; checks that something accepts there.
    pub fn connect(path: impl AsRef<Path>) -> Result<Self, ControlError> {
        let client = Self {
            path: path.as_ref().to_owned(),
            timeout: Some(Duration::from_secs(30)),
        };
        client.open()?;
        Ok(client)
    }

    /// Sets how long one request may wait for the socket (send, then each read); `None`
    /// waits forever. The default is 30 s. Streams ([`ControlClient::stream`]) never time
    /// out reading.
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// `GET path`: the JSON body of a 2xx reply, or [`ControlError::Api`].
    pub fn get(&self, path: &str) -> Result<JsonReply, ControlError> {
        json_reply(self.request("GET", path, None)?.into_result()?)
    }

    /// `POST path` with `body` as JSON: the JSON body of a 2xx reply, or
    /// [`ControlError::Api`].
    pub fn post<B: Serialize + ?Sized>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<JsonReply, ControlError> {
        self.send_json("POST", path, body)
    }

    /// `PUT path` with `body` as JSON: the JSON body of a 2xx reply, or
    /// [`ControlError::Api`].
    pub fn put<B: Serialize + ?Sized>(
        &self,
        path: &str,
        body: &B,
    ) -> Result<JsonReply, ControlError> {
        self.send_json("PUT", path, body)
    }

    fn send_json<B: Serialize + ?Sized>(
        &self,
        method: &str,
        path: &str,
        body: &B,
    ) -> Result<JsonReply, ControlError> {
        let body = serde_json::to_vec(body).map_err(ControlError::EncodeBody)?;
        json_reply(
            self.request(method, path, Some(("application/json", &body)))?
                .into_result()?,
        )
    }

    /// `DELETE path`: the JSON body of a 2xx reply (`Null` for 204), or [`ControlError::Api`].
    pub fn delete(&self, path: &str) -> Result<JsonReply, ControlError> {
        json_reply(self.request("DELETE", path, None)?.into_result()?)
    }

    /// `GET path` of a text resource (`/metrics`): the body of a 2xx reply.
    pub fn get_text(&self, path: &str) -> Result<String, ControlError> {
        let reply = self.request("GET", path, None)?.into_result()?;
        String::from_utf8(reply.body).map_err(|_| ControlError::BadReply("the body is not UTF-8"))
    }

    /// Sends one request and reads the whole reply, whatever its status. `body` is a content
    /// type and the bytes.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
    ) -> Result<RawReply, ControlError> {
        let (status, content_type, mut reader) = self.send(method, path, body, self.timeout)?;
        let mut buf = Vec::new();
        (&mut reader)
            .take(MAX_BODY + 1)
            .read_to_end(&mut buf)
            .map_err(|e| self.io_err(e))?;
        if buf.len() as u64 > MAX_BODY {
            return Err(ControlError::BadReply("the body is larger than 64 MiB"));
        }
        Ok(RawReply {
            status,
            content_type,
            body: buf,
        })
    }

    /// `GET path` of a streaming resource (`/events`): its lines as they arrive. A non-2xx
    /// reply is [`ControlError::Api`].
    pub fn stream(&self, path: &str) -> Result<LineStream, ControlError> {
        let (status, content_type, reader) = self.send("GET", path, None, None)?;
        if !(200..300).contains(&status) {
            let mut body = Vec::new();
            let _ = reader.take(MAX_BODY).read_to_end(&mut body);
            return Err(RawReply {
                status,
                content_type,
                body,
            }
            .into_result()
            .err()
            .unwrap_or(ControlError::BadReply("an error status without an error")));
        }
        Ok(LineStream {
            reader: BufReader::new(reader),
            path: self.path.clone(),
            content_type,
            failed: false,
        })
    }

    fn open(&self) -> Result<UnixStream, ControlError> {
        UnixStream::connect(&self.path).map_err(|source| ControlError::Connect {
            path: self.path.clone(),
            source,
        })
    }

    fn io_err(&self, source: io::Error) -> ControlError {
        ControlError::Io {
            path: self.path.clone(),
            source,
        }
    }

    fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
        read_timeout: Option<Duration>,
    ) -> Result<(u16, Option<String>, BodyReader), ControlError> {
        if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
            return Err(ControlError::BadRequestPath(path.to_owned()));
        }
        if !method.bytes().all(|b| b.is_ascii_uppercase()) || method.is_empty() {
            return Err(ControlError::BadRequestPath(format!("{method} {path}")));
        }
        let mut stream = self.open()?;
        stream
            .set_write_timeout(self.timeout)
            .and_then(|()| stream.set_read_timeout(read_timeout))
            .map_err(|e| self.io_err(e))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\
             Accept: application/json, */*\r\n"
        );
        if let Some((content_type, bytes)) = body {
            head.push_str(&format!(
                "Content-Type: {content_type}\r\nContent-Length: {}\r\n",
                bytes.len()
            ));
        }
        head.push_str("\r\n");
        let sent = stream.write_all(head.as_bytes()).and_then(|()| match body {
            Some((_, bytes)) => stream.write_all(bytes),
            None => Ok(()),
        });
        // A server may answer and close before reading the whole body (413 on a
        // Content-Length past its limit): its reply, if there is one, is the better error.
        let mut send_error = match sent {
            Ok(()) => None,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset
                ) =>
            {
                Some(e)
            }
            Err(e) => return Err(self.io_err(e)),
        };
        let mut reader = BufReader::new(stream);
        loop {
            let head = match read_head(&mut reader) {
                Ok(head) => head,
                Err(e) => return Err(self.io_err(send_error.take().unwrap_or(e))),
            };
            let parsed = parse_head(&head)?;
            // 1xx (100 Continue, ...) precede the real reply.
            if (100..200).contains(&parsed.status) {
                continue;
            }
            let framing = if method == "HEAD" || parsed.status == 204 || parsed.status == 304 {
                Framing::Length(0)
            } else {
                parsed.framing
            };
            return Ok((
                parsed.status,
                parsed.content_type,
                BodyReader::new(reader, framing),
            ));
        }
    }
}

fn json_reply(reply: RawReply) -> Result<JsonReply, ControlError> {
    let body = if reply.body.iter().all(u8::is_ascii_whitespace) {
        serde_json::Value::Null
    } else {
        serde_json::from_slice(&reply.body).map_err(ControlError::BadReplyBody)?
    };
    Ok(JsonReply {
        status: reply.status,
        body,
    })
}

/// Reads up to and including the empty line that ends a response head.
fn read_head(reader: &mut BufReader<UnixStream>) -> io::Result<Vec<u8>> {
    let mut head = Vec::new();
    loop {
        let start = head.len();
        let n = reader
            .by_ref()
            .take((MAX_HEAD - start) as u64)
            .read_until(b'\n', &mut head)?;
        if n == 0 {
            let what = if head.is_empty() {
                "the server closed the connection without a reply"
            } else {
                "the reply head is cut short or longer than 64 KiB"
            };
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, what));
        }
        let line = &head[start..];
        if line == b"\r\n" || line == b"\n" {
            return Ok(head);
        }
    }
}

#[derive(Debug)]
struct Head {
    status: u16,
    content_type: Option<String>,
    framing: Framing,
}

fn parse_head(bytes: &[u8]) -> Result<Head, ControlError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut response = httparse::Response::new(&mut headers);
    match response.parse(bytes) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => {
            return Err(ControlError::BadReply("the reply head is incomplete"));
        }
        Err(_) => return Err(ControlError::BadReply("the reply head is not HTTP/1.x")),
    }
    let status = response
        .code
        .ok_or(ControlError::BadReply("the reply has no status"))?;
    let mut content_type = None;
    let mut length: Option<u64> = None;
    let mut chunked = false;
    for h in response.headers.iter() {
        let value = std::str::from_utf8(h.value)
            .map_err(|_| ControlError::BadReply("a reply header is not UTF-8"))?
            .trim();
        if h.name.eq_ignore_ascii_case("content-type") {
            content_type = Some(value.to_owned());
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            // Chunked must be the last coding; we ask for no other.
            chunked = value
                .rsplit(',')
                .next()
                .is_some_and(|c| c.trim().eq_ignore_ascii_case("chunked"));
            if !chunked {
                return Err(ControlError::BadReply("unsupported transfer encoding"));
            }
        } else if h.name.eq_ignore_ascii_case("content-length") {
            let n = value
                .parse::<u64>()
                .map_err(|_| ControlError::BadReply("a bad Content-Length"))?;
            if length.is_some_and(|l| l != n) {
                return Err(ControlError::BadReply("conflicting Content-Length headers"));
            }
            length = Some(n);
        }
    }
    let framing = match (chunked, length) {
        (true, _) => Framing::Chunked,
        (false, Some(n)) => Framing::Length(n),
        (false, None) => Framing::UntilClose,
    };
    Ok(Head {
        status,
        content_type,
        framing,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ChunkState {
    /// Expecting a chunk-size line.
    Size,
    /// Inside a chunk's data, this many bytes left.
    Data(u64),
    /// Expecting the CRLF after a chunk's data.
    DataEnd,
    /// The last chunk and the trailers are read.
    Done,
}

/// The body of a reply, de-framed.
struct BodyReader {
    inner: BufReader<UnixStream>,
    framing: Framing,
    /// For `Length`: bytes left; for `Chunked`: the decoder state.
    left: u64,
    chunk: ChunkState,
}

impl fmt::Debug for BodyReader {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BodyReader")
            .field("framing", &self.framing)
            .field("left", &self.left)
            .field("chunk", &self.chunk)
            .finish_non_exhaustive()
    }
}

fn bad_data(what: &'static str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}

impl BodyReader {
    fn new(inner: BufReader<UnixStream>, framing: Framing) -> Self {
        let left = match framing {
            Framing::Length(n) => n,
            _ => 0,
        };
        Self {
            inner,
            framing,
            left,
            chunk: ChunkState::Size,
        }
    }

    fn read_line(&mut self) -> io::Result<Vec<u8>> {
        let mut line = Vec::new();
        self.inner
            .by_ref()
            .take(4096)
            .read_until(b'\n', &mut line)?;
        if line.last() != Some(&b'\n') {
            return Err(bad_data("a chunk line is cut short or too long"));
        }
        Ok(line)
    }

    fn read_chunked(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            match self.chunk {
                ChunkState::Done => return Ok(0),
                ChunkState::Size => {
                    let line = self.read_line()?;
                    let text = std::str::from_utf8(&line)
                        .map_err(|_| bad_data("a chunk size is not ASCII"))?;
                    let size = text.split(';').next().unwrap_or("").trim();
                    let size = u64::from_str_radix(size, 16)
                        .map_err(|_| bad_data("a chunk size is not hexadecimal"))?;
                    if size == 0 {
                        // Trailers, up to the empty line.
                        loop {
                            let line = self.read_line()?;
                            if line == b"\r\n" || line == b"\n" {
                                break;
                            }
                        }
                        self.chunk = ChunkState::Done;
                    } else {
                        self.chunk = ChunkState::Data(size);
                    }
                }
                ChunkState::Data(left) => {
                    let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
                    let n = self.inner.read(&mut buf[..want])?;
                    if n == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::UnexpectedEof,
                            "the body ends inside a chunk",
                        ));
                    }
                    let left = left - n as u64;
                    self.chunk = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                    return Ok(n);
                }
                ChunkState::DataEnd => {
                    let line = self.read_line()?;
                    if line != b"\r\n" && line != b"\n" {
                        return Err(bad_data("chunk data is longer than its size"));
                    }
                    self.chunk = ChunkState::Size;
                }
            }
        }
    }
}

impl Read for BodyReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        match self.framing {
            Framing::UntilClose => self.inner.read(buf),
            Framing::Length(_) => {
                if self.left == 0 {
                    return Ok(0);
                }
                let want = buf
                    .len()
                    .min(usize::try_from(self.left).unwrap_or(usize::MAX));
                let n = self.inner.read(&mut buf[..want])?;
                if n == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the body is shorter than its Content-Length",
                    ));
                }
                self.left -= n as u64;
                Ok(n)
            }
            Framing::Chunked => self.read_chunked(buf),
        }
    }
}

/// The lines of a streamed reply (see [`ControlClient::stream`]), without their line ends;
/// empty lines are skipped. Ends when the server ends the body, or after the first error
/// (a connection cut inside a chunk, a line that is not UTF-8, ...).
pub struct LineStream {
    reader: BufReader<BodyReader>,
    path: PathBuf,
    content_type: Option<String>,
    failed: bool,
}

impl fmt::Debug for LineStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LineStream")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl LineStream {
    /// The reply's `Content-Type`, if any.
    pub fn content_type(&self) -> Option<&str> {
        self.content_type.as_deref()
    }

    /// The next line parsed as JSON; `None` at the end of the stream.
    pub fn next_json<T: DeserializeOwned>(&mut self) -> Option<Result<T, ControlError>> {
        self.next().map(|line| {
            line.and_then(|l| serde_json::from_str(&l).map_err(ControlError::BadReplyBody))
        })
    }
}

impl Iterator for LineStream {
    type Item = Result<String, ControlError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        let next = self.next_line();
        self.failed = matches!(next, Some(Err(_)));
        next
    }
}

impl LineStream {
    fn next_line(&mut self) -> Option<Result<String, ControlError>> {
        loop {
            let mut line = Vec::new();
            let read = self
                .reader
                .by_ref()
                .take(MAX_LINE)
                .read_until(b'\n', &mut line);
            match read {
                Err(source) => {
                    return Some(Err(ControlError::Io {
                        path: self.path.clone(),
                        source,
                    }));
                }
                Ok(0) => return None,
                Ok(_) => {}
            }
            if line.last() == Some(&b'\n') {
                line.pop();
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
            } else if line.len() as u64 == MAX_LINE {
                return Some(Err(ControlError::BadReply("a streamed line is too long")));
            }
            if line.is_empty() {
                continue;
            }
            return Some(
                String::from_utf8(line)
                    .map_err(|_| ControlError::BadReply("a streamed line is not UTF-8")),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunked body decoded from a real socket pair, chunk extensions and trailers included.
    #[test]
    fn chunked_body_with_extensions_and_trailers() {
        let (mut a, b) = UnixStream::pair().expect("socketpair");
        a.write_all(b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\nrest")
            .expect("write");
        drop(a);
        let mut body = BodyReader::new(BufReader::new(b), Framing::Chunked);
        let mut out = String::new();
        body.read_to_string(&mut out).expect("decodes");
        assert_eq!(out, "hello world");
    }

    #[test]
    fn chunk_longer_than_its_size_is_an_error() {
        let (mut a, b) = UnixStream::pair().expect("socketpair");
        a.write_all(b"2\r\nabc\r\n0\r\n\r\n").expect("write");
        drop(a);
        let mut body = BodyReader::new(BufReader::new(b), Framing::Chunked);
        let mut out = Vec::new();
        let err = body.read_to_end(&mut out).expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn short_content_length_body_is_an_error() {
        let (mut a, b) = UnixStream::pair().expect("socketpair");
        a.write_all(b"abc").expect("write");
        drop(a);
        let mut body = BodyReader::new(BufReader::new(b), Framing::Length(5));
        let mut out = Vec::new();
        let err = body.read_to_end(&mut out).expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof);
    }

    #[test]
    fn head_framing() {
        let head = parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\nContent-Type: a/b\r\n\r\n")
            .expect("parses");
        assert_eq!(head.status, 200);
        assert_eq!(head.framing, Framing::Length(7));
        assert_eq!(head.content_type.as_deref(), Some("a/b"));
        let head =
            parse_head(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").expect("parses");
        assert_eq!(head.framing, Framing::Chunked);
        let conflicting =
            parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n");
        assert!(matches!(conflicting, Err(ControlError::BadReply(_))));
    }
}
