//! The one place where failures become HTTP answers.

use pdserve_api::ErrorKind;
use pdserve_http::Response;
use pdserve_scheduler::{Outcome, Rejection, Stage};

/// An error answer: status, stable `type`, message with the numbers that matter, optional Retry-After.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub status: u16,
    pub error_type: &'static str,
    pub message: String,
    pub retry_after_s: Option<u32>,
}

impl ApiError {
    pub(crate) fn new(status: u16, error_type: &'static str, message: impl Into<String>) -> Self {
        let retry_after_s = matches!(status, 429 | 503).then_some(1);
        ApiError { status, error_type, message: message.into(), retry_after_s }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Self {
        ApiError::new(400, "invalid_request", message)
    }

    pub(crate) fn not_ready(reason: &str) -> Self {
        ApiError::new(503, "not_ready", reason.to_owned())
    }

    pub(crate) fn reply(&self, request_id: &str) -> Response {
        let kind = ErrorKind::from_type(self.error_type).unwrap_or(ErrorKind::Internal);
        let mut e = pdserve_api::ApiError::new(kind, self.message.clone());
        e.retry_after_s = self.retry_after_s;
        Response::error(&e, Some(request_id))
    }

    pub(crate) fn from_rejection(r: &Rejection) -> Self {
        let mut e = match r {
            Rejection::QueueFull { retry_after, .. } => {
                let mut e = ApiError::new(429, "queue_full", r.to_string());
                e.retry_after_s = Some(retry_after.as_secs().max(1) as u32);
                e
            }
            Rejection::ContextLengthExceeded { .. } | Rejection::KvCapacityExceeded { .. } => {
                ApiError::new(400, "context_length_exceeded", r.to_string())
            }
            Rejection::DuplicateId => ApiError::new(409, "duplicate_request_id", r.to_string()),
            _ => ApiError::invalid(r.to_string()),
        };
        if e.status != 429 {
            e.retry_after_s = None;
        }
        e
    }

    /// The error for a request that ended other than by completing.
    pub(crate) fn from_outcome(o: &Outcome) -> Option<Self> {
        Some(match o {
            Outcome::Completed(_) | Outcome::PrefillDone { .. } => return None,
            Outcome::Cancelled => ApiError::new(499, "cancelled", "the request was cancelled"),
            Outcome::TimedOut { stage } => ApiError::new(
                504,
                "deadline_exceeded",
                format!("the request's deadline passed while it was {}", stage_words(*stage)),
            ),
            // The KV never arrived from the prefill worker: a failure of the path, not a bug here.
            Outcome::Failed { stage: stage @ Stage::KvTransfer, reason } => ApiError::new(
                502,
                "kv_transfer_failed",
                format!("the request failed while {}: {reason}", stage_words(*stage)),
            ),
            Outcome::Failed { stage, reason } => ApiError::new(
                500,
                "internal",
                format!("the request failed while {}: {reason}", stage_words(*stage)),
            ),
        })
    }
}

fn stage_words(s: Stage) -> &'static str {
    match s {
        Stage::Queued => "queued",
        Stage::KvTransfer => "waiting for its KV transfer",
        Stage::Prefilling => "prefilling",
        Stage::Decoding => "decoding",
    }
}
