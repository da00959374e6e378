//! The crate's one error type.

use std::fmt;
use std::io;
use std::time::Duration;

use pdserve_api::{ApiError, ErrorKind};

/// What went wrong in HTTP: decoding a message (each such error is answered with one status and one
/// stable `type` word, [`HttpError::kind`]), answering a connection, or a client's call (the pool, the
/// connection, the deadline).
#[derive(Debug)]
#[non_exhaustive]
pub enum HttpError {
    /// The request line is longer than the limit.
    RequestLineTooLong { bytes: usize, limit: usize },
    /// The head is larger than the limit.
    HeadersTooLarge { bytes: usize, limit: usize },
    /// More header fields than the limit.
    TooManyHeaders { limit: usize },
    /// The body (declared or accumulated) is larger than the limit.
    BodyTooLarge { bytes: usize, limit: usize },
    /// A line inside a chunked body is longer than the limit.
    ChunkLineTooLong { limit: usize },
    /// The bytes are not HTTP/1.x as the grammar allows; `what` names the part.
    Malformed { what: &'static str },
    /// A framing this crate does not implement (a transfer coding other than chunked).
    Unsupported { what: &'static str },
    /// The peer closed the connection before the message was complete.
    UnexpectedEof,
    /// (Server) the connection is closed, or the id is stale.
    Gone,
    /// (Server) no request is outstanding on this connection, or a stream call came out of order.
    NotResponding,
    /// (Server) the client is not reading: this many bytes are still unsent, at or over the maximum.
    Backpressure { buffered_bytes: usize },
    /// (Client) the deadline passed while every pooled connection was busy.
    AcquireTimeout { waited: Duration, busy: usize },
    /// (Client) too many callers were already waiting for a connection.
    TooManyWaiters { limit: usize },
    /// (Client) the connection could not be opened: nothing was sent.
    Connect(io::Error),
    /// (Client) reading or writing failed after the request was (partly) sent.
    Io(io::Error),
    /// (Client) the call's deadline passed.
    DeadlineExceeded,
}

impl HttpError {
    /// The error a server answers this with: one kind, so one status and one `type` word.
    pub fn kind(&self) -> ErrorKind {
        match self {
            HttpError::RequestLineTooLong { .. } => ErrorKind::UriTooLong,
            HttpError::HeadersTooLarge { .. } | HttpError::TooManyHeaders { .. } => {
                ErrorKind::HeadersTooLarge
            }
            HttpError::BodyTooLarge { .. } => ErrorKind::BodyTooLarge,
            HttpError::Unsupported { .. } => ErrorKind::NotImplemented,
            HttpError::ChunkLineTooLong { .. } | HttpError::Malformed { .. } | HttpError::UnexpectedEof => {
                ErrorKind::InvalidRequest
            }
            HttpError::DeadlineExceeded | HttpError::AcquireTimeout { .. } => ErrorKind::DeadlineExceeded,
            HttpError::TooManyWaiters { .. } => ErrorKind::NoCapacity,
            HttpError::Connect(_) | HttpError::Io(_) => ErrorKind::UpstreamFailed,
            HttpError::Gone | HttpError::NotResponding | HttpError::Backpressure { .. } => {
                ErrorKind::Internal
            }
        }
    }

    /// The status code a server answers this error with.
    pub fn status(&self) -> u16 {
        self.kind().status()
    }

    /// The peer closed or reset the connection (rather than a timeout, a limit or garbage): on a
    /// reused connection with no answer byte yet, the one failure after which a request is sent again
    /// (the peer closed the connection while it was idle, so it never took the request).
    pub fn peer_closed(&self) -> bool {
        match self {
            HttpError::UnexpectedEof => true,
            HttpError::Io(e) => matches!(
                e.kind(),
                std::io::ErrorKind::UnexpectedEof
                    | std::io::ErrorKind::ConnectionReset
                    | std::io::ErrorKind::BrokenPipe
                    | std::io::ErrorKind::ConnectionAborted
            ),
            _ => false,
        }
    }

    /// The answer's error body.
    pub fn to_api_error(&self) -> ApiError {
        ApiError::new(self.kind(), self.to_string())
    }
}

// Compared by variant and data; I/O errors by their kind (for tests and for matching in callers).
impl PartialEq for HttpError {
    fn eq(&self, other: &Self) -> bool {
        use HttpError::*;
        match (self, other) {
            (RequestLineTooLong { bytes: a, limit: b }, RequestLineTooLong { bytes: c, limit: d })
            | (HeadersTooLarge { bytes: a, limit: b }, HeadersTooLarge { bytes: c, limit: d })
            | (BodyTooLarge { bytes: a, limit: b }, BodyTooLarge { bytes: c, limit: d }) => (a, b) == (c, d),
            (TooManyHeaders { limit: a }, TooManyHeaders { limit: b })
            | (ChunkLineTooLong { limit: a }, ChunkLineTooLong { limit: b })
            | (TooManyWaiters { limit: a }, TooManyWaiters { limit: b })
            | (Backpressure { buffered_bytes: a }, Backpressure { buffered_bytes: b }) => a == b,
            (Malformed { what: a }, Malformed { what: b })
            | (Unsupported { what: a }, Unsupported { what: b }) => a == b,
            (AcquireTimeout { waited: a, busy: b }, AcquireTimeout { waited: c, busy: d }) => {
                (a, b) == (c, d)
            }
            (Connect(a), Connect(b)) | (Io(a), Io(b)) => a.kind() == b.kind(),
            (UnexpectedEof, UnexpectedEof)
            | (Gone, Gone)
            | (NotResponding, NotResponding)
            | (DeadlineExceeded, DeadlineExceeded) => true,
            _ => false,
        }
    }
}

impl fmt::Display for HttpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HttpError::RequestLineTooLong { bytes, limit } => {
                write!(f, "request line is {bytes} bytes, limit {limit}")
            }
            HttpError::HeadersTooLarge { bytes, limit } => {
                write!(f, "request head is at least {bytes} bytes, limit {limit}")
            }
            HttpError::TooManyHeaders { limit } => write!(f, "more than {limit} header fields"),
            HttpError::BodyTooLarge { bytes, limit } => {
                write!(f, "body is at least {bytes} bytes, limit {limit}")
            }
            HttpError::ChunkLineTooLong { limit } => {
                write!(f, "a chunked-body line is longer than {limit} bytes")
            }
            HttpError::Malformed { what } => write!(f, "malformed {what}"),
            HttpError::Unsupported { what } => write!(f, "unsupported {what}"),
            HttpError::UnexpectedEof => write!(f, "connection closed before the message was complete"),
            HttpError::Gone => write!(f, "connection is gone"),
            HttpError::NotResponding => write!(f, "no response in progress on this connection"),
            HttpError::Backpressure { buffered_bytes } => {
                write!(f, "client is not reading ({buffered_bytes} bytes unsent)")
            }
            HttpError::AcquireTimeout { waited, busy } => {
                write!(f, "no upstream connection free after {}ms ({busy} busy)", waited.as_millis())
            }
            HttpError::TooManyWaiters { limit } => write!(f, "{limit} callers already wait for a connection"),
            HttpError::Connect(e) => write!(f, "connect failed: {e}"),
            HttpError::Io(e) => write!(f, "connection failed: {e}"),
            HttpError::DeadlineExceeded => write!(f, "deadline exceeded"),
        }
    }
}

impl std::error::Error for HttpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            HttpError::Connect(e) | HttpError::Io(e) => Some(e),
            _ => None,
        }
    }
}
