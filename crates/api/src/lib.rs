//! The wire vocabulary of pdserve: everything two processes (or a process and its client) must agree
//! on, as plain values with no I/O.
//!
//! - [`ApiError`] and [`ErrorKind`]: the one JSON error body of every process, and the one mapping
//!   from an error to its status code, `type` word and terminal [`Outcome`] ([`ErrorKind::describe`]).
//! - [`Stage`], [`Outcome`], [`Role`]: where a request is, how it ended, what a worker does; the same
//!   words in every ledger, metric label and log line.
//! - [`header`]: the header names every hop reads and writes.
//! - [`Health`]: the bodies and statuses of `/health/live`, `/health/ready` and `/health/generate`.
//! - [`path`]: the paths every process serves, and the 404/405 answer for the rest.
//! - [`pd`]: the prefill/decode handle a router forwards without parsing.
//! - [`generation`]: what a generation asks and gets, in no dialect: the output's constraint, token
//!   log-probabilities, usage.
//! - [`tools`]: tool calling's vocabulary: the tools offered, the choice, the calls made.
//!
//! The OpenAI and Anthropic dialects (request bodies, answers, stream events) are `pdserve-codec`'s.
//!
//! ```
//! use pdserve_api::{ApiError, ErrorKind, Outcome};
//! let e = ApiError::new(ErrorKind::QueueFull, "request queue is full (64 waiting, limit 64)");
//! assert_eq!((e.status(), e.retry_after_s), (429, Some(1)));
//! assert_eq!(e.kind.outcome(), Outcome::Rejected);
//! let body = e.to_json(Some("req-1"));
//! assert_eq!(body["error"]["type"], "queue_full");
//! ```
#![forbid(unsafe_code)]

mod error;
pub mod generation;
pub mod header;
mod health;
mod lifecycle;
pub mod path;
pub mod pd;
pub mod tools;

pub use error::{ApiError, Described, ErrorKind};
pub use health::Health;
pub use lifecycle::{Outcome, Role, Stage};

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
