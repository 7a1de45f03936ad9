//! Minimal HTTP/1.1 client pieces: request serialization and response parsing.
//!
//! Only what the cloud-hypervisor API needs: one request per connection, no
//! `Expect`, no pipelining. The response head is parsed by `httparse`; bodies are
//! framed by `Content-Length` or by connection close (cloud-hypervisor's API
//! server sends nothing else).

use std::io::{self, BufRead, Read, Write};

/// Limit for the status line plus headers.
pub(crate) const MAX_HEAD_LEN: usize = 64 << 10;
/// Limit for the body.
pub(crate) const MAX_BODY_LEN: usize = 16 << 20;

/// Errors from this module; the caller adds method/endpoint context.
#[derive(Debug)]
pub(crate) enum HttpError {
    Io(io::Error),
    Malformed(String),
    TooLarge(usize),
}

impl From<io::Error> for HttpError {
    fn from(e: io::Error) -> Self {
        HttpError::Io(e)
    }
}

fn malformed(reason: impl Into<String>) -> HttpError {
    HttpError::Malformed(reason.into())
}

/// A parsed response.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpResponse {
    /// Status code.
    pub status: u16,
    /// Reason phrase.
    pub reason: String,
    /// Header fields in order, names as sent.
    pub headers: Vec<(String, String)>,
    /// The (de-chunked) body.
    pub body: Vec<u8>,
}

impl HttpResponse {
    /// The first header called `name` (case-insensitive).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
}

/// Serializes a request. A body comes with `Content-Type: application/json`
/// and `Content-Length`; without a body neither header is sent (as
/// `ch-remote` does).
pub(crate) fn encode_request(method: &str, target: &str, body: Option<&[u8]>) -> Vec<u8> {
    let mut out = format!("{method} {target} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n");
    if let Some(body) = body {
        out.push_str("Content-Type: application/json\r\n");
        out.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    out.push_str("\r\n");
    let mut bytes = out.into_bytes();
    if let Some(body) = body {
        bytes.extend_from_slice(body);
    }
    bytes
}

/// Writes a request.
pub(crate) fn write_request<W: Write>(
    w: &mut W,
    method: &str,
    target: &str,
    body: Option<&[u8]>,
) -> io::Result<()> {
    w.write_all(&encode_request(method, target, body))?;
    w.flush()
}

/// Reads the response head (status line and headers, up to the empty line) of at most
/// [`MAX_HEAD_LEN`] bytes.
fn read_head<R: BufRead>(r: &mut R) -> Result<Vec<u8>, HttpError> {
    let mut head = Vec::new();
    loop {
        let room = MAX_HEAD_LEN.saturating_sub(head.len());
        let limit = u64::try_from(room).unwrap_or(u64::MAX).saturating_add(1);
        let start = head.len();
        r.take(limit).read_until(b'\n', &mut head)?;
        if head.len() > MAX_HEAD_LEN {
            return Err(HttpError::TooLarge(MAX_HEAD_LEN));
        }
        let line = head.get(start..).unwrap_or_default();
        if line.last() != Some(&b'\n') {
            return Err(malformed(
                "connection closed in the middle of the response head",
            ));
        }
        if line == b"\n" || line == b"\r\n" {
            return Ok(head);
        }
    }
}

/// Reads a response to a request made with `method`: the head parsed by `httparse`, the body
/// framed by `Content-Length` or by the connection's end — what cloud-hypervisor's API server
/// (`micro_http`) sends. It sends neither interim (1xx) responses nor chunked bodies; a
/// `Transfer-Encoding` is refused as malformed rather than misread.
pub(crate) fn read_response<R: BufRead>(
    r: &mut R,
    method: &str,
) -> Result<HttpResponse, HttpError> {
    let head = read_head(r)?;
    let mut fields = [httparse::EMPTY_HEADER; 64];
    let mut parsed = httparse::Response::new(&mut fields);
    match parsed.parse(&head) {
        Ok(httparse::Status::Complete(_)) => {}
        Ok(httparse::Status::Partial) => return Err(malformed("incomplete response head")),
        Err(e) => return Err(malformed(format!("bad response head: {e}"))),
    }
    let status = parsed
        .code
        .ok_or_else(|| malformed("bad response head: no status"))?;
    let text = |b: &[u8]| {
        std::str::from_utf8(b)
            .map(str::to_owned)
            .map_err(|_| malformed("header value is not UTF-8"))
    };
    let headers = parsed
        .headers
        .iter()
        .map(|h| Ok((h.name.to_owned(), text(h.value)?)))
        .collect::<Result<Vec<_>, HttpError>>()?;
    let mut resp = HttpResponse {
        status,
        reason: parsed.reason.unwrap_or_default().to_owned(),
        headers,
        body: Vec::new(),
    };
    if method == "HEAD" || (100..200).contains(&status) || status == 204 || status == 304 {
        return Ok(resp);
    }
    if resp.header("transfer-encoding").is_some() {
        return Err(malformed(
            "Transfer-Encoding (cloud-hypervisor's API server never sends one)",
        ));
    }

    let mut length: Option<usize> = None;
    for (name, value) in &resp.headers {
        if !name.eq_ignore_ascii_case("content-length") {
            continue;
        }
        for v in value.split(',') {
            let v = v.trim();
            if v.is_empty() || !v.bytes().all(|b| b.is_ascii_digit()) {
                return Err(malformed(format!("bad Content-Length {value:?}")));
            }
            let n = v
                .parse::<usize>()
                .map_err(|_| HttpError::TooLarge(MAX_BODY_LEN))?;
            if length.is_some_and(|l| l != n) {
                return Err(malformed("conflicting Content-Length headers"));
            }
            length = Some(n);
        }
    }
    resp.body = match length {
        Some(n) if n > MAX_BODY_LEN => return Err(HttpError::TooLarge(MAX_BODY_LEN)),
        Some(n) => {
            let mut body = vec![0; n];
            r.read_exact(&mut body).map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => {
                    malformed("connection closed before the end of the body")
                }
                _ => HttpError::Io(e),
            })?;
            body
        }
        None => read_to_end_limited(r)?,
    };
    Ok(resp)
}

fn read_to_end_limited<R: Read>(r: &mut R) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    let limit = u64::try_from(MAX_BODY_LEN)
        .unwrap_or(u64::MAX)
        .saturating_add(1);
    r.take(limit).read_to_end(&mut body)?;
    if body.len() > MAX_BODY_LEN {
        return Err(HttpError::TooLarge(MAX_BODY_LEN));
    }
    Ok(body)
}

#[cfg(test)]
mod tests {
    use std::io::Cursor;

    use super::*;

    fn parse(raw: &[u8]) -> Result<HttpResponse, HttpError> {
        read_response(&mut Cursor::new(raw.to_vec()), "GET")
    }

    fn ok(raw: &[u8]) -> HttpResponse {
        match parse(raw) {
            Ok(r) => r,
            Err(e) => panic!("parse failed: {e:?}"),
        }
    }

    fn malformed_reason(raw: &[u8]) -> String {
        match parse(raw) {
            Err(HttpError::Malformed(reason)) => reason,
            other => panic!("expected Malformed, got {other:?}"),
        }
    }

    #[test]
    fn request_encoding() {
        assert_eq!(
            encode_request("GET", "/api/v1/vmm.ping", None),
            b"GET /api/v1/vmm.ping HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n"
        );
        assert_eq!(
            encode_request("PUT", "/api/v1/vm.remove-device", Some(br#"{"id":"a"}"#)),
            b"PUT /api/v1/vm.remove-device HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\
              Content-Type: application/json\r\nContent-Length: 10\r\n\r\n{\"id\":\"a\"}"
        );
    }

    #[test]
    fn content_length_body() {
        let r = ok(b"HTTP/1.1 200 OK\r\nServer: Cloud Hypervisor API\r\nContent-Type: application/json\r\ncontent-length: 2\r\n\r\n{}trailing");
        assert_eq!(r.status, 200);
        assert_eq!(r.reason, "OK");
        assert_eq!(r.header("Content-Type"), Some("application/json"));
        assert_eq!(r.body, b"{}");
    }

    #[test]
    fn no_content_has_no_body() {
        let r = ok(b"HTTP/1.1 204 No Content\r\nServer: x\r\n\r\n");
        assert_eq!((r.status, r.reason.as_str()), (204, "No Content"));
        assert!(r.body.is_empty());
    }

    #[test]
    fn head_has_no_body() {
        let r = read_response(
            &mut Cursor::new(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n".to_vec()),
            "HEAD",
        )
        .map_err(|e| format!("{e:?}"))
        .expect("parse");
        assert!(r.body.is_empty());
    }

    #[test]
    fn transfer_encodings_are_refused_not_misread() {
        let reason = malformed_reason(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n4\r\n{\"a\"\r\n0\r\n\r\n",
        );
        assert!(reason.contains("Transfer-Encoding"), "{reason}");
    }

    #[test]
    fn body_until_close_and_bare_lf() {
        let r = ok(b"HTTP/1.0 500 Internal Server Error\nServer: x\n\nboom");
        assert_eq!(r.status, 500);
        assert_eq!(r.body, b"boom");
    }

    #[test]
    fn malformed_responses() {
        assert!(malformed_reason(b"").contains("closed"));
        for bad in [
            &b"SSH-2.0-OpenSSH\r\n\r\n"[..],
            b"HTTP/1.1 20 OK\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nbad\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nA: b\r\n folded\r\n\r\n",
        ] {
            let reason = malformed_reason(bad);
            assert!(
                reason.contains("bad response head"),
                "{:?}: {reason}",
                String::from_utf8_lossy(bad)
            );
        }
        assert!(
            malformed_reason(
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nxx"
            )
            .contains("conflicting")
        );
        assert!(
            malformed_reason(b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n")
                .contains("Content-Length")
        );
        assert!(
            malformed_reason(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab")
                .contains("end of the body")
        );
    }

    #[test]
    fn size_limits() {
        let mut huge_head = b"HTTP/1.1 200 OK\r\nX: ".to_vec();
        huge_head.extend(std::iter::repeat_n(b'a', MAX_HEAD_LEN));
        huge_head.extend_from_slice(b"\r\n\r\n");
        assert!(matches!(parse(&huge_head), Err(HttpError::TooLarge(_))));
        let big = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_LEN + 1
        );
        assert!(matches!(parse(big.as_bytes()), Err(HttpError::TooLarge(_))));
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nContent-Length: 99999999999999999999999\r\n\r\n"),
            Err(HttpError::TooLarge(_))
        ));
    }
}
