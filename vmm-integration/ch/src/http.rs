//! Minimal HTTP/1.1 client pieces: request serialization and response parsing.
//!
//! Only what the cloud-hypervisor API needs: one request per connection, no
//! `Expect`, no pipelining. Responses are framed by `Content-Length`, by
//! `Transfer-Encoding: chunked`, or by connection close.

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

/// Reads one line (ending in LF, optional CR before it) of at most `*budget`
/// bytes, charging it to the budget. Returns the line without the line ending.
fn read_line<R: BufRead>(r: &mut R, budget: &mut usize) -> Result<Vec<u8>, HttpError> {
    let mut line = Vec::new();
    let limit = u64::try_from(*budget).unwrap_or(u64::MAX).saturating_add(1);
    r.take(limit).read_until(b'\n', &mut line)?;
    if line.len() > *budget {
        return Err(HttpError::TooLarge(MAX_HEAD_LEN));
    }
    *budget -= line.len();
    if line.pop() != Some(b'\n') {
        return Err(malformed(
            "connection closed in the middle of the response head",
        ));
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(line)
}

fn parse_status_line(line: &[u8]) -> Result<(u16, String), HttpError> {
    let text = std::str::from_utf8(line).map_err(|_| malformed("status line is not UTF-8"))?;
    let mut parts = text.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    let code = parts.next().unwrap_or_default();
    let reason = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(malformed(format!("bad status line {text:?}")));
    }
    if code.len() != 3 || !code.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed(format!("bad status code in {text:?}")));
    }
    let status = code
        .parse::<u16>()
        .map_err(|_| malformed(format!("bad status code in {text:?}")))?;
    Ok((status, reason.to_owned()))
}

fn parse_header(line: &[u8]) -> Result<(String, String), HttpError> {
    let text = std::str::from_utf8(line).map_err(|_| malformed("header is not UTF-8"))?;
    if text.starts_with([' ', '\t']) {
        return Err(malformed("obsolete header line folding"));
    }
    let (name, value) = text
        .split_once(':')
        .ok_or_else(|| malformed(format!("header without colon {text:?}")))?;
    if name.is_empty() || name.ends_with([' ', '\t']) {
        return Err(malformed(format!("bad header name {name:?}")));
    }
    Ok((name.to_owned(), value.trim_matches([' ', '\t']).to_owned()))
}

/// Reads a response to a request made with `method`.
pub(crate) fn read_response<R: BufRead>(
    r: &mut R,
    method: &str,
) -> Result<HttpResponse, HttpError> {
    let mut budget = MAX_HEAD_LEN;
    let (status, reason, headers) = loop {
        let (status, reason) = parse_status_line(&read_line(r, &mut budget)?)?;
        let mut headers = Vec::new();
        loop {
            let line = read_line(r, &mut budget)?;
            if line.is_empty() {
                break;
            }
            headers.push(parse_header(&line)?);
        }
        // Interim responses (100 Continue, 103 Early Hints) precede the real one.
        if (100..200).contains(&status) && status != 101 {
            continue;
        }
        break (status, reason, headers);
    };
    let mut resp = HttpResponse {
        status,
        reason,
        headers,
        body: Vec::new(),
    };
    if method == "HEAD" || (100..200).contains(&status) || status == 204 || status == 304 {
        return Ok(resp);
    }

    if let Some(te) = resp.header("transfer-encoding") {
        let chunked = te
            .rsplit(',')
            .next()
            .is_some_and(|last| last.trim().eq_ignore_ascii_case("chunked"));
        resp.body = if chunked {
            read_chunked(r)?
        } else {
            read_to_end_limited(r)?
        };
        return Ok(resp);
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

fn read_chunked<R: BufRead>(r: &mut R) -> Result<Vec<u8>, HttpError> {
    let mut body = Vec::new();
    // Chunk-size lines and trailers share the head budget.
    let mut budget = MAX_HEAD_LEN;
    loop {
        let line = read_line(r, &mut budget)?;
        let text = std::str::from_utf8(&line).map_err(|_| malformed("chunk size is not UTF-8"))?;
        let size_text = text.split(';').next().unwrap_or_default().trim();
        if size_text.is_empty() || !size_text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(malformed(format!("bad chunk size {text:?}")));
        }
        let size =
            usize::from_str_radix(size_text, 16).map_err(|_| HttpError::TooLarge(MAX_BODY_LEN))?;
        if size == 0 {
            // Trailer section, ended by an empty line.
            while !read_line(r, &mut budget)?.is_empty() {}
            return Ok(body);
        }
        if body.len().saturating_add(size) > MAX_BODY_LEN {
            return Err(HttpError::TooLarge(MAX_BODY_LEN));
        }
        let start = body.len();
        body.resize(start + size, 0);
        r.read_exact(body.get_mut(start..).unwrap_or_default())
            .map_err(|e| match e.kind() {
                io::ErrorKind::UnexpectedEof => malformed("connection closed inside a chunk"),
                _ => HttpError::Io(e),
            })?;
        if !read_line(r, &mut budget)?.is_empty() {
            return Err(malformed("chunk data not followed by CRLF"));
        }
    }
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
    fn chunked_body_with_extensions_and_trailers() {
        let r = ok(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, Chunked\r\n\r\n\
                     4;name=val\r\n{\"a\"\r\n3\r\n:1}\r\n0\r\nX-Trailer: y\r\n\r\n",
        );
        assert_eq!(r.body, br#"{"a":1}"#);
    }

    #[test]
    fn body_until_close_and_bare_lf() {
        let r = ok(b"HTTP/1.0 500 Internal Server Error\nServer: x\n\nboom");
        assert_eq!(r.status, 500);
        assert_eq!(r.body, b"boom");
    }

    #[test]
    fn interim_responses_are_skipped() {
        let r = ok(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nx");
        assert_eq!(r.status, 200);
        assert_eq!(r.body, b"x");
    }

    #[test]
    fn malformed_responses() {
        assert!(malformed_reason(b"").contains("closed"));
        assert!(malformed_reason(b"SSH-2.0-OpenSSH\r\n\r\n").contains("status line"));
        assert!(malformed_reason(b"HTTP/1.1 20 OK\r\n\r\n").contains("status code"));
        assert!(malformed_reason(b"HTTP/1.1 200 OK\r\nbad\r\n\r\n").contains("colon"));
        assert!(
            malformed_reason(b"HTTP/1.1 200 OK\r\nA: b\r\n folded\r\n\r\n").contains("folding")
        );
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
        assert!(
            malformed_reason(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n")
                .contains("chunk size")
        );
        assert!(
            malformed_reason(
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n"
            )
            .contains("CRLF")
        );
        assert!(
            malformed_reason(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab")
                .contains("chunk")
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
        assert!(matches!(
            parse(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffffff\r\n"),
            Err(HttpError::TooLarge(_))
        ));
    }
}
