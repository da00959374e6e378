//! Requests and the incremental request decoder.

use std::io::Write as _;

use crate::chunked::ChunkedDecoder;
use crate::{HttpError, Limits};

/// The outcome of feeding bytes to a decoder: a complete value, or a request for more input.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Status<T> {
    /// A whole message was decoded.
    Complete(T),
    /// The input ends inside a message; feed more bytes and call again.
    Partial,
}

/// One header field. Names keep their case as sent; look them up with [`Request::header`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub name: String,
    pub value: Vec<u8>,
}

/// A decoded HTTP/1.x request with its whole body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub method: String,
    /// The request target as sent: path plus optional `?query`.
    pub target: String,
    /// 0 for HTTP/1.0, 1 for HTTP/1.1.
    pub minor_version: u8,
    pub headers: Vec<Header>,
    pub body: Vec<u8>,
}

impl Request {
    /// A request with no headers and no body, for building one to send.
    pub fn new(method: &str, target: &str) -> Self {
        Request {
            method: method.to_owned(),
            target: target.to_owned(),
            minor_version: 1,
            headers: Vec::new(),
            body: Vec::new(),
        }
    }

    /// The first value of header `name`, compared without regard to case.
    pub fn header(&self, name: &str) -> Option<&[u8]> {
        find_header(&self.headers, name)
    }

    /// The first value of header `name` if it is valid UTF-8, with surrounding whitespace trimmed.
    pub fn header_str(&self, name: &str) -> Option<&str> {
        self.header(name).and_then(|v| std::str::from_utf8(v).ok()).map(str::trim)
    }

    /// The client's `x-request-id`, if it is one a process may adopt and echo: 1 to 128 visible ASCII
    /// characters. Anything else is ignored and the process makes up its own id.
    pub fn request_id(&self) -> Option<&str> {
        self.header_str(pdserve_api::header::REQUEST_ID)
            .filter(|id| !id.is_empty() && id.len() <= 128 && id.bytes().all(|b| b.is_ascii_graphic()))
    }

    /// The target's path, without the query.
    pub fn path(&self) -> &str {
        self.target.split_once('?').map_or(&self.target, |(p, _)| p)
    }

    /// The target's query string, without the `?`.
    pub fn query(&self) -> Option<&str> {
        self.target.split_once('?').map(|(_, q)| q)
    }

    /// Whether the client wants the connection kept open after the response (HTTP/1.1 default yes,
    /// HTTP/1.0 default no, `Connection` overrides either way).
    pub fn keep_alive(&self) -> bool {
        keep_alive(self.minor_version, self.header("connection"))
    }

    /// Appends the request in wire form to `out`, framing the body with `Content-Length` (any
    /// `Content-Length` or `Transfer-Encoding` header in `headers` is not written).
    pub fn write_to(&self, out: &mut Vec<u8>) {
        let headers = self.headers.iter().filter(|h| {
            !h.name.eq_ignore_ascii_case("content-length")
                && !h.name.eq_ignore_ascii_case("transfer-encoding")
        });
        write_request_head_to(
            out,
            &self.method,
            &self.target,
            self.minor_version,
            headers.map(|h| (h.name.as_str(), h.value.as_slice())),
            self.body.len(),
        );
        out.extend_from_slice(&self.body);
    }
}

/// Appends a request head (HTTP/1.1) to `out`, framing a body of `body_len` bytes with
/// `Content-Length` (written for any body, and for an empty one of `POST`, `PUT` and `PATCH`). The body
/// itself follows from the caller: a proxy writes the head, then the bytes it already holds.
pub fn write_request_head(
    out: &mut Vec<u8>,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body_len: usize,
) {
    write_request_head_to(out, method, target, 1, headers.iter().map(|(n, v)| (*n, v.as_bytes())), body_len);
}

fn write_request_head_to<'a>(
    out: &mut Vec<u8>,
    method: &str,
    target: &str,
    minor_version: u8,
    headers: impl Iterator<Item = (&'a str, &'a [u8])>,
    body_len: usize,
) {
    out.extend_from_slice(method.as_bytes());
    out.push(b' ');
    out.extend_from_slice(target.as_bytes());
    out.extend_from_slice(if minor_version == 0 { b" HTTP/1.0\r\n" } else { b" HTTP/1.1\r\n" });
    for (name, value) in headers {
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value);
        out.extend_from_slice(b"\r\n");
    }
    if body_len > 0 || matches!(method, "POST" | "PUT" | "PATCH") {
        let _ = write!(out, "content-length: {body_len}\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

pub(crate) fn find_header<'a>(headers: &'a [Header], name: &str) -> Option<&'a [u8]> {
    headers.iter().find(|h| h.name.eq_ignore_ascii_case(name)).map(|h| h.value.as_slice())
}

pub(crate) fn keep_alive(minor_version: u8, connection: Option<&[u8]>) -> bool {
    let has = |token: &str| {
        connection.is_some_and(|v| {
            v.split(|&b| b == b',').any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
        })
    };
    if minor_version == 0 {
        has("keep-alive")
    } else {
        !has("close")
    }
}

/// How a message body is delimited.
#[derive(Debug, Clone)]
pub(crate) enum BodyFraming {
    Length(usize),
    Chunked(ChunkedDecoder),
}

/// Reads `Content-Length` / `Transfer-Encoding` and decides the framing. A message with both, or with
/// conflicting lengths, is refused: that ambiguity is how requests are smuggled past proxies.
pub(crate) fn body_framing(headers: &[Header], limits: &Limits) -> Result<Option<BodyFraming>, HttpError> {
    let mut length: Option<usize> = None;
    let mut chunked = false;
    for h in headers {
        if h.name.eq_ignore_ascii_case("content-length") {
            let v = h.value.trim_ascii();
            if v.is_empty() || v.len() > 18 || !v.iter().all(u8::is_ascii_digit) {
                return Err(HttpError::Malformed { what: "content-length" });
            }
            let n = v.iter().fold(0usize, |acc, &b| acc * 10 + usize::from(b - b'0'));
            if length.is_some_and(|l| l != n) {
                return Err(HttpError::Malformed { what: "content-length (conflicting values)" });
            }
            length = Some(n);
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            let last = h.value.rsplit(|&b| b == b',').next().unwrap_or(&[]).trim_ascii();
            if !last.eq_ignore_ascii_case(b"chunked") {
                return Err(HttpError::Unsupported { what: "transfer-encoding" });
            }
            chunked = true;
        }
    }
    match (length, chunked) {
        (Some(_), true) => Err(HttpError::Malformed { what: "framing (both content-length and chunked)" }),
        (None, true) => Ok(Some(BodyFraming::Chunked(ChunkedDecoder::new(
            limits.body_bytes_max,
            limits.chunk_line_bytes_max,
        )))),
        (Some(n), false) if n > limits.body_bytes_max => {
            Err(HttpError::BodyTooLarge { bytes: n, limit: limits.body_bytes_max })
        }
        (Some(n), false) => Ok(Some(BodyFraming::Length(n))),
        (None, false) => Ok(None),
    }
}

/// Finds the end of a head (the byte after its blank line) in `buf`, scanning from `from`.
pub(crate) fn find_head_end(buf: &[u8], from: usize) -> Option<usize> {
    let mut i = from;
    while let Some(off) = buf[i..].iter().position(|&b| b == b'\n') {
        let nl = i + off;
        match buf.get(nl + 1) {
            Some(b'\n') => return Some(nl + 2),
            Some(b'\r') if buf.get(nl + 2) == Some(&b'\n') => return Some(nl + 3),
            Some(_) => i = nl + 1,
            None => return None,
        }
    }
    None
}

#[derive(Debug)]
enum DecodeState {
    Head { scanned: usize },
    Body { request: Request, framing: BodyFraming },
}

/// Incremental request decoder: push bytes as they arrive, take requests out in order.
///
/// Pipelined requests are decoded one at a time: the bytes after a complete request stay buffered for
/// the next [`decode`](Self::decode) call.
///
/// ```
/// use pdserve_http::{Limits, RequestDecoder, Status};
/// let mut d = RequestDecoder::new(Limits::default());
/// d.push(b"POST /v1/x HTTP/1.1\r\nContent-Length: 2\r\n\r\n");
/// assert_eq!(d.decode().unwrap(), Status::Partial);
/// d.push(b"hi");
/// let Status::Complete(req) = d.decode().unwrap() else { panic!() };
/// assert_eq!(req.body, b"hi");
/// ```
#[derive(Debug)]
pub struct RequestDecoder {
    limits: Limits,
    buf: Vec<u8>,
    state: DecodeState,
    continue_pending: bool,
}

impl RequestDecoder {
    pub fn new(limits: Limits) -> Self {
        RequestDecoder {
            limits,
            buf: Vec::new(),
            state: DecodeState::Head { scanned: 0 },
            continue_pending: false,
        }
    }

    /// Appends received bytes.
    pub fn push(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// Bytes received and not yet part of a returned request.
    pub fn buffered_bytes(&self) -> usize {
        self.buf.len()
    }

    /// True when no part of a request has been received (a clean point to close a keep-alive connection).
    pub fn is_idle(&self) -> bool {
        self.buf.is_empty() && matches!(self.state, DecodeState::Head { .. })
    }

    /// True while a head has been decoded and its body is still arriving.
    pub fn is_reading_body(&self) -> bool {
        matches!(self.state, DecodeState::Body { .. })
    }

    /// True once after a head carrying `Expect: 100-continue` was decoded and its body has not all
    /// arrived: the server should send `100 Continue` so the client sends the body.
    pub fn take_expect_continue(&mut self) -> bool {
        std::mem::take(&mut self.continue_pending)
    }

    /// Decodes the next request from the buffered bytes.
    ///
    /// After an error the decoder's state is unspecified; the connection should answer the error and close.
    pub fn decode(&mut self) -> Result<Status<Request>, HttpError> {
        if let DecodeState::Head { scanned } = self.state {
            // Empty lines before a request line are allowed (RFC 9112 section 2.2).
            let blank = self.buf.iter().take_while(|&&b| b == b'\r' || b == b'\n').count();
            if blank > 0 {
                self.buf.drain(..blank);
                self.state = DecodeState::Head { scanned: 0 };
                return self.decode();
            }
            self.check_request_line()?;
            let Some(head_len) = find_head_end(&self.buf, scanned.saturating_sub(3)) else {
                if self.buf.len() > self.limits.header_bytes_max {
                    return Err(HttpError::HeadersTooLarge {
                        bytes: self.buf.len(),
                        limit: self.limits.header_bytes_max,
                    });
                }
                self.state = DecodeState::Head { scanned: self.buf.len() };
                return Ok(Status::Partial);
            };
            if head_len > self.limits.header_bytes_max {
                return Err(HttpError::HeadersTooLarge {
                    bytes: head_len,
                    limit: self.limits.header_bytes_max,
                });
            }
            let request = self.parse_head(head_len)?;
            let framing = body_framing(&request.headers, &self.limits)?;
            self.buf.drain(..head_len);
            let framing = match framing {
                None | Some(BodyFraming::Length(0)) => {
                    self.state = DecodeState::Head { scanned: 0 };
                    return Ok(Status::Complete(request));
                }
                Some(f) => f,
            };
            self.continue_pending = request.minor_version == 1
                && request
                    .header("expect")
                    .is_some_and(|v| v.trim_ascii().eq_ignore_ascii_case(b"100-continue"));
            self.state = DecodeState::Body { request, framing };
        }
        let DecodeState::Body { request, framing } = &mut self.state else {
            unreachable!("head handled above")
        };
        let done = match framing {
            BodyFraming::Length(n) => {
                if self.buf.len() < *n {
                    false
                } else {
                    request.body.extend(self.buf.drain(..*n));
                    true
                }
            }
            BodyFraming::Chunked(dec) => {
                let used = dec.decode(&self.buf, &mut request.body)?;
                self.buf.drain(..used);
                dec.is_done()
            }
        };
        if !done {
            return Ok(Status::Partial);
        }
        self.continue_pending = false;
        let DecodeState::Body { request, .. } =
            std::mem::replace(&mut self.state, DecodeState::Head { scanned: 0 })
        else {
            unreachable!("state is Body")
        };
        Ok(Status::Complete(request))
    }

    fn check_request_line(&self) -> Result<(), HttpError> {
        let max = self.limits.request_line_bytes_max;
        let window = &self.buf[..self.buf.len().min(max + 2)];
        let line_len = match window.iter().position(|&b| b == b'\n') {
            Some(n) => n - usize::from(n > 0 && window[n - 1] == b'\r'),
            None if self.buf.len() > max + 1 => self.buf.len(),
            None => return Ok(()),
        };
        if line_len > max {
            return Err(HttpError::RequestLineTooLong { bytes: line_len, limit: max });
        }
        Ok(())
    }

    fn parse_head(&self, head_len: usize) -> Result<Request, HttpError> {
        let mut slots = vec![httparse::EMPTY_HEADER; self.limits.header_count_max];
        let mut req = httparse::Request::new(&mut slots);
        match req.parse(&self.buf[..head_len]) {
            Ok(httparse::Status::Complete(_)) => {}
            Ok(httparse::Status::Partial) => return Err(HttpError::Malformed { what: "request head" }),
            Err(httparse::Error::TooManyHeaders) => {
                return Err(HttpError::TooManyHeaders { limit: self.limits.header_count_max })
            }
            Err(httparse::Error::Version) => return Err(HttpError::Malformed { what: "http version" }),
            Err(_) => return Err(HttpError::Malformed { what: "request head" }),
        }
        let (Some(method), Some(target), Some(version)) = (req.method, req.path, req.version) else {
            return Err(HttpError::Malformed { what: "request line" });
        };
        Ok(Request {
            method: method.to_owned(),
            target: target.to_owned(),
            minor_version: version,
            headers: req
                .headers
                .iter()
                .map(|h| Header { name: h.name.to_owned(), value: h.value.to_vec() })
                .collect(),
            body: Vec::new(),
        })
    }
}
