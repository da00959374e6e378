//! The crate's error type.

use std::fmt;

use pdserve_api::{ApiError, ErrorKind};

/// Why a message could not be decoded. Each variant maps to one HTTP status and one stable `type` word.
#[derive(Debug, Clone, PartialEq, Eq)]
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
        }
    }

    /// The status code a server answers this error with.
    pub fn status(&self) -> u16 {
        self.kind().status()
    }

    /// The answer's error body.
    pub fn to_api_error(&self) -> ApiError {
        ApiError::new(self.kind(), self.to_string())
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
        }
    }
}

impl std::error::Error for HttpError {}
