//! The one error shape of every process, and the one mapping from an error to its status, `type` word
//! and terminal outcome.

use std::fmt;

use serde_json::{json, Value};

use crate::Outcome;

/// What went wrong, as a client sees it. Each kind has exactly one status code, one stable `type` word
/// and one terminal [`Outcome`], all in [`ErrorKind::describe`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// Malformed JSON, wrong types, empty messages, bad parameter values.
    InvalidRequest,
    /// The prompt (plus `max_tokens` where required) does not fit the context.
    ContextLengthExceeded,
    /// A missing or wrong API key or cluster secret.
    Unauthorized,
    /// No such route, request or worker.
    NotFound,
    /// The body names a model this process does not serve.
    ModelNotFound,
    MethodNotAllowed,
    /// The request did not arrive in time (a slow client).
    RequestTimeout,
    /// A live request already has this id.
    DuplicateRequestId,
    /// The resource exists already (a worker registered twice).
    Conflict,
    BodyTooLarge,
    UriTooLong,
    HeadersTooLarge,
    /// The admission queue is full.
    QueueFull,
    /// The client or an operator ended the request.
    Cancelled,
    /// A bug; the process keeps serving.
    Internal,
    /// A framing or feature this process does not implement.
    NotImplemented,
    /// (Router) a worker failed before the response started and no other path could take it.
    UpstreamFailed,
    /// The prompt's KV never arrived from the prefill worker.
    KvTransferFailed,
    /// Draining, starting, or the engine stopped.
    NotReady,
    /// No healthy worker or path can take the request now.
    NoCapacity,
    /// The request's deadline passed.
    DeadlineExceeded,
}

/// How a kind appears on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Described {
    pub status: u16,
    pub type_word: &'static str,
    pub outcome: Outcome,
}

impl ErrorKind {
    pub const ALL: [ErrorKind; 21] = [
        ErrorKind::InvalidRequest,
        ErrorKind::ContextLengthExceeded,
        ErrorKind::Unauthorized,
        ErrorKind::NotFound,
        ErrorKind::ModelNotFound,
        ErrorKind::MethodNotAllowed,
        ErrorKind::RequestTimeout,
        ErrorKind::DuplicateRequestId,
        ErrorKind::Conflict,
        ErrorKind::BodyTooLarge,
        ErrorKind::UriTooLong,
        ErrorKind::HeadersTooLarge,
        ErrorKind::QueueFull,
        ErrorKind::Cancelled,
        ErrorKind::Internal,
        ErrorKind::NotImplemented,
        ErrorKind::UpstreamFailed,
        ErrorKind::KvTransferFailed,
        ErrorKind::NotReady,
        ErrorKind::NoCapacity,
        ErrorKind::DeadlineExceeded,
    ];

    /// The one place an error becomes a status, a `type` word and an outcome.
    pub const fn describe(self) -> Described {
        use Outcome::{Cancelled, Failed, Rejected, TimedOut};
        let (status, type_word, outcome) = match self {
            ErrorKind::InvalidRequest => (400, "invalid_request", Rejected),
            ErrorKind::ContextLengthExceeded => (400, "context_length_exceeded", Rejected),
            ErrorKind::Unauthorized => (401, "unauthorized", Rejected),
            ErrorKind::NotFound => (404, "not_found", Rejected),
            ErrorKind::ModelNotFound => (404, "model_not_found", Rejected),
            ErrorKind::MethodNotAllowed => (405, "method_not_allowed", Rejected),
            ErrorKind::RequestTimeout => (408, "request_timeout", Rejected),
            ErrorKind::DuplicateRequestId => (409, "duplicate_request_id", Rejected),
            ErrorKind::Conflict => (409, "conflict", Rejected),
            ErrorKind::BodyTooLarge => (413, "body_too_large", Rejected),
            ErrorKind::UriTooLong => (414, "uri_too_long", Rejected),
            ErrorKind::HeadersTooLarge => (431, "headers_too_large", Rejected),
            ErrorKind::QueueFull => (429, "queue_full", Rejected),
            ErrorKind::Cancelled => (499, "cancelled", Cancelled),
            ErrorKind::Internal => (500, "internal", Failed),
            ErrorKind::NotImplemented => (501, "not_implemented", Rejected),
            ErrorKind::UpstreamFailed => (502, "upstream_failed", Failed),
            ErrorKind::KvTransferFailed => (502, "kv_transfer_failed", Failed),
            ErrorKind::NotReady => (503, "not_ready", Rejected),
            ErrorKind::NoCapacity => (503, "no_capacity", Rejected),
            ErrorKind::DeadlineExceeded => (504, "deadline_exceeded", TimedOut),
        };
        Described { status, type_word, outcome }
    }

    pub const fn status(self) -> u16 {
        self.describe().status
    }

    /// The stable machine-readable `type` of the error body.
    pub const fn as_str(self) -> &'static str {
        self.describe().type_word
    }

    /// How a request that ends with this error is counted.
    pub const fn outcome(self) -> Outcome {
        self.describe().outcome
    }

    /// 429 and 503 answers tell the client when to come back.
    pub const fn wants_retry_after(self) -> bool {
        matches!(self.status(), 429 | 503)
    }

    /// The kind whose `type` word is `word`.
    pub fn from_type(word: &str) -> Option<ErrorKind> {
        ErrorKind::ALL.into_iter().find(|k| k.as_str() == word)
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error answer: `{"error": {"type", "message", "code", "request_id"}}`, plus `Retry-After` for 429
/// and 503. The message is for people and carries the numbers that matter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    pub kind: ErrorKind,
    pub message: String,
    /// Seconds for `Retry-After`; set (at least 1) whenever the kind wants one.
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> ApiError {
        let retry_after_s = kind.wants_retry_after().then_some(1);
        ApiError { kind, message: message.into(), retry_after_s }
    }

    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(ErrorKind::InvalidRequest, message)
    }

    /// Sets `Retry-After` (kinds without one ignore it).
    pub fn with_retry_after(mut self, seconds: u32) -> ApiError {
        if self.kind.wants_retry_after() {
            self.retry_after_s = Some(seconds.max(1));
        }
        self
    }

    pub fn status(&self) -> u16 {
        self.kind.status()
    }

    /// The JSON body, with `request_id` when known.
    pub fn to_json(&self, request_id: Option<&str>) -> Value {
        let mut error = json!({"type": self.kind.as_str(), "message": self.message, "code": self.status()});
        if let Some(id) = request_id {
            error["request_id"] = Value::String(id.to_owned());
        }
        json!({ "error": error })
    }

    /// The JSON body in Anthropic's shape, for `/v1/messages` and its sub-paths (Anthropic's clients
    /// read it): `{"type": "error", "error": {"type", "message", "pdserve_type"}, "request_id"}`, with
    /// Anthropic's error type for the status and this project's `type` word beside it.
    pub fn to_anthropic_json(&self, request_id: Option<&str>) -> Value {
        let kind = match self.status() {
            400 | 405 | 409 | 414 | 431 => "invalid_request_error",
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            503 => "overloaded_error",
            504 | 408 => "timeout_error",
            _ => "api_error",
        };
        let mut body = json!({"type": "error",
            "error": {"type": kind, "message": self.message, "pdserve_type": self.kind.as_str()}});
        if let Some(id) = request_id {
            body["request_id"] = Value::String(id.to_owned());
        }
        body
    }

    /// The body for an answer on `path`: Anthropic's shape under `/v1/messages`, this project's
    /// elsewhere.
    pub fn to_json_at(&self, path: &str, request_id: Option<&str>) -> Value {
        if crate::path::is_anthropic(path) {
            self.to_anthropic_json(request_id)
        } else {
            self.to_json(request_id)
        }
    }

    /// Reads an error body back, in either shape (`None` if `body` is not one). Unknown `type` words
    /// are `Internal`.
    pub fn parse(body: &[u8]) -> Option<ApiError> {
        let v: Value = serde_json::from_slice(body).ok()?;
        let e = v.get("error")?;
        let kind = e.get("pdserve_type").or_else(|| e.get("type"))?.as_str()?;
        let message = e.get("message").and_then(Value::as_str).unwrap_or("").to_owned();
        Some(ApiError {
            kind: ErrorKind::from_type(kind).unwrap_or(ErrorKind::Internal),
            message,
            retry_after_s: None,
        })
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.kind, self.message)
    }
}

impl std::error::Error for ApiError {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kind_has_its_own_word_and_round_trips() {
        for k in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_type(k.as_str()), Some(k));
            assert!((400..600).contains(&k.status()), "{k}");
            assert_eq!(k.wants_retry_after(), ApiError::new(k, "x").retry_after_s.is_some());
        }
        let words: std::collections::HashSet<_> = ErrorKind::ALL.iter().map(|k| k.as_str()).collect();
        assert_eq!(words.len(), ErrorKind::ALL.len());
    }

    #[test]
    fn body_shape() {
        let e = ApiError::new(ErrorKind::QueueFull, "request queue is full (64 waiting, limit 64)")
            .with_retry_after(7);
        let v = e.to_json(Some("req-1"));
        assert_eq!(v["error"]["type"], "queue_full");
        assert_eq!(v["error"]["code"], 429);
        assert_eq!(v["error"]["request_id"], "req-1");
        assert_eq!(e.retry_after_s, Some(7));
        let back = ApiError::parse(v.to_string().as_bytes()).unwrap();
        assert_eq!((back.kind, back.message.as_str()), (e.kind, e.message.as_str()));
        assert_eq!(ApiError::new(ErrorKind::InvalidRequest, "x").with_retry_after(3).retry_after_s, None);
        // Under /v1/messages, Anthropic's shape, read back to the same kind (a router reads a
        // worker's answer).
        let a = e.to_json_at("/v1/messages/count_tokens", Some("req-1"));
        assert_eq!(
            (a["type"].as_str(), a["error"]["type"].as_str()),
            (Some("error"), Some("rate_limit_error"))
        );
        assert_eq!(
            (a["error"]["pdserve_type"].as_str(), a["request_id"].as_str()),
            (Some("queue_full"), Some("req-1"))
        );
        assert_eq!(ApiError::parse(a.to_string().as_bytes()).unwrap().kind, ErrorKind::QueueFull);
        assert_eq!(e.to_json_at("/v1/chat/completions", None)["error"]["type"], "queue_full");
    }
}
