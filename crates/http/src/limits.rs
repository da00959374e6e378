//! Size and time limits, one field each, units last.

use std::time::Duration;

/// Limits applied while decoding a request.
///
/// Each violation maps to one status code (see [`crate::HttpError::status`]): an over-long request line to
/// 414, too many or too large headers to 431, a body over `body_bytes_max` to 413, anything else malformed
/// to 400.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Longest request line (`GET /path HTTP/1.1`), in bytes, without the line ending.
    pub request_line_bytes_max: usize,
    /// Largest head (request line plus headers plus the blank line), in bytes.
    pub header_bytes_max: usize,
    /// Most header fields in one head.
    pub header_count_max: usize,
    /// Largest body, in bytes, whether framed by Content-Length or chunked.
    pub body_bytes_max: usize,
    /// Longest line inside a chunked body (a chunk-size line or a trailer field), in bytes.
    pub chunk_line_bytes_max: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            request_line_bytes_max: 8 * 1024,
            header_bytes_max: 32 * 1024,
            header_count_max: 64,
            body_bytes_max: 4 * 1024 * 1024,
            chunk_line_bytes_max: 1024,
        }
    }
}

/// Everything the mio [`crate::Server`] bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ServerConfig {
    /// Request decoding limits.
    pub limits: Limits,
    /// Most open client connections; one over it gets a 503 with `Retry-After` and is closed.
    pub connections_max: usize,
    /// From the first byte of a request (or from accept) until its head is complete. A slowloris client
    /// that trickles its headers is cut off here.
    pub header_read_timeout: Duration,
    /// From a complete head until the body is complete.
    pub body_read_timeout: Duration,
    /// How long a keep-alive connection may sit idle between requests.
    pub idle_timeout: Duration,
    /// Bytes a connection may hold unsent before [`crate::Server::send`] refuses more
    /// ([`crate::HttpError::Backpressure`]). A single write is always accepted while the buffer is under it.
    pub write_buffer_bytes_max: usize,
    /// After an error response, how long to keep reading (and discarding) before closing, so the client
    /// reads the response instead of a reset.
    pub linger_timeout: Duration,
    /// `Retry-After` seconds sent with the 503 for a connection over `connections_max`.
    pub retry_after_s: u32,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            limits: Limits::default(),
            connections_max: 4096,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
            write_buffer_bytes_max: 4 * 1024 * 1024,
            linger_timeout: Duration::from_millis(500),
            retry_after_s: 1,
        }
    }
}
