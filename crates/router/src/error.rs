//! The crate's one error type.

use std::fmt;

/// What the router refuses: a body it cannot route (a 400), or a worker it cannot register.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum RouterError {
    /// The body is not a JSON object.
    NotAnObject,
    NotJson {
        reason: String,
    },
    /// `timeout` is not a positive number of seconds.
    BadTimeout {
        seconds: f64,
    },
    /// A message's `content` is neither text nor content parts.
    BadContent,
    /// `priority` is not an integer.
    BadPriority,
    /// The body carries a member only the stack itself may set (`pd_transfer`: where a decode
    /// worker pulls KV from).
    InternalField {
        field: &'static str,
    },
    /// A worker URL that is not `http://host:port`, or does not resolve.
    BadWorkerUrl {
        url: String,
        problem: UrlProblem,
    },
    /// A worker with this URL is registered already.
    DuplicateWorker {
        url: String,
    },
    /// A metric for a new worker could not be made.
    Metrics(pdserve_telemetry::TelemetryError),
}

/// What is wrong with a worker URL.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum UrlProblem {
    /// Not `http://` (TLS to workers is not supported).
    NotHttp,
    /// A path after `host:port`, or no host at all.
    NotHostPort,
    /// The resolver failed; its message.
    DoesNotResolve(String),
    /// The name resolved to no address.
    NoAddress,
}

impl fmt::Display for RouterError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RouterError::NotAnObject => write!(f, "request body must be a JSON object"),
            RouterError::NotJson { reason } => write!(f, "request body is not valid JSON: {reason}"),
            RouterError::BadTimeout { seconds } => {
                write!(f, "`timeout` must be a positive number of seconds, got {seconds}")
            }
            RouterError::BadContent => {
                write!(f, "a message's `content` must be a string or an array of content parts")
            }
            RouterError::BadPriority => write!(f, "`priority` must be an integer (lower is served first)"),
            RouterError::InternalField { field } => {
                write!(f, "`{field}` is set by the router, never by a client")
            }
            RouterError::BadWorkerUrl { url, problem } => match problem {
                UrlProblem::NotHttp => {
                    write!(f, "worker URL {url:?} must start with http:// (TLS to workers is not supported)")
                }
                UrlProblem::NotHostPort => {
                    write!(f, "worker URL {url:?} must be http://host:port with no path")
                }
                UrlProblem::DoesNotResolve(why) => write!(f, "worker URL {url:?} does not resolve: {why}"),
                UrlProblem::NoAddress => write!(f, "worker URL {url:?} resolves to no address"),
            },
            RouterError::Metrics(e) => write!(f, "{e}"),
            RouterError::DuplicateWorker { url } => write!(f, "worker {url} is already registered"),
        }
    }
}

impl std::error::Error for RouterError {}
