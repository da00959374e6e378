//! Writing responses: fixed-length, chunked, and JSON error bodies in the shape of `api.md`.

use std::io::Write as _;

use pdserve_api::{header, ApiError, Health};

/// How a response body is delimited on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `Content-Length: n` followed by exactly `n` bytes.
    Length(usize),
    /// `Transfer-Encoding: chunked`; write frames with [`write_chunk`] and end with [`write_last_chunk`].
    Chunked,
}

/// The standard reason phrase of a status code (empty for codes this crate does not name).
pub fn reason_phrase(status: u16) -> &'static str {
    match status {
        100 => "Continue",
        200 => "OK",
        201 => "Created",
        202 => "Accepted",
        204 => "No Content",
        301 => "Moved Permanently",
        302 => "Found",
        304 => "Not Modified",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        413 => "Content Too Large",
        414 => "URI Too Long",
        415 => "Unsupported Media Type",
        422 => "Unprocessable Content",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "",
    }
}

/// Appends a response head. `headers` must not contain framing headers; they are written from `body`.
/// `keep_alive: false` adds `connection: close`.
pub fn write_head(
    out: &mut Vec<u8>,
    status: u16,
    headers: &[(&str, &str)],
    body: BodyKind,
    keep_alive: bool,
) {
    // Writing into a Vec cannot fail.
    let _ = write!(out, "HTTP/1.1 {} {}\r\n", status, reason_phrase(status));
    for (name, value) in headers {
        let _ = write!(out, "{name}: {value}\r\n");
    }
    match body {
        BodyKind::Length(n) => {
            let _ = write!(out, "content-length: {n}\r\n");
        }
        BodyKind::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    if !keep_alive {
        out.extend_from_slice(b"connection: close\r\n");
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends one chunk frame. An empty `data` writes nothing (an empty chunk would end the body).
pub fn write_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    let _ = write!(out, "{:x}\r\n", data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// Appends the zero-length chunk that ends a chunked body.
pub fn write_last_chunk(out: &mut Vec<u8>) {
    out.extend_from_slice(b"0\r\n\r\n");
}

/// A whole response held in memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Response {
    /// A response with `status`, no headers and an empty body.
    pub fn new(status: u16) -> Self {
        Response { status, headers: Vec::new(), body: Vec::new() }
    }

    /// A JSON body with `content-type: application/json`.
    pub fn json(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Response::new(status).header("content-type", "application/json").body(body)
    }

    /// A plain-text body with `content-type: text/plain; charset=utf-8`.
    pub fn text(status: u16, body: impl Into<Vec<u8>>) -> Self {
        Response::new(status).header("content-type", "text/plain; charset=utf-8").body(body)
    }

    /// Adds a header.
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.headers.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Sets the body.
    pub fn body(mut self, body: impl Into<Vec<u8>>) -> Self {
        self.body = body.into();
        self
    }

    /// The first value of header `name`, compared without regard to case.
    pub fn header_value(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(n, _)| n.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }

    /// Appends the response in wire form, framed by `Content-Length`.
    pub fn write_to(&self, out: &mut Vec<u8>, keep_alive: bool) {
        let headers: Vec<(&str, &str)> = self.headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        write_head(out, self.status, &headers, BodyKind::Length(self.body.len()), keep_alive);
        out.extend_from_slice(&self.body);
    }
}

impl Response {
    /// The answer for `error` in the one shape of every process (`pdserve_api::ApiError`), with
    /// `retry-after` where it applies and `x-request-id` when known.
    pub fn error(error: &ApiError, request_id: Option<&str>) -> Response {
        Response::error_at("", error, request_id)
    }

    /// An error answer on `path`: in Anthropic's shape under `/v1/messages`
    /// ([`ApiError::to_json_at`]), with `Retry-After` and the request id as [`Response::error`].
    pub fn error_at(path: &str, error: &ApiError, request_id: Option<&str>) -> Response {
        let mut r = Response::json(error.status(), error.to_json_at(path, request_id).to_string());
        if let Some(s) = error.retry_after_s {
            r = r.header(header::RETRY_AFTER, &s.to_string());
        }
        if let Some(id) = request_id {
            r = r.header(header::REQUEST_ID, id);
        }
        r
    }

    /// A health answer (`pdserve_api::Health`); a 503 carries `retry-after: 1`.
    pub fn health(health: &Health, request_id: Option<&str>) -> Response {
        let mut r = Response::json(health.status(), health.to_json().to_string());
        if health.status() != 200 {
            r = r.header(header::RETRY_AFTER, "1");
        }
        if let Some(id) = request_id {
            r = r.header(header::REQUEST_ID, id);
        }
        r
    }
}
