//! HTTP/1.1 without a framework.
//!
//! - A sans-IO codec on `httparse`: [`RequestDecoder`] (Content-Length and chunked bodies, pipelining,
//!   limits from [`Limits`]), response writers ([`Response`], [`write_head`], [`write_chunk`], SSE frames
//!   with [`write_sse_chunk`]), error answers in the one shape of `pdserve-api` ([`Response::error`]),
//!   and the client side ([`ResponseDecoder`], [`SseDecoder`]). Partial input is [`Status::Partial`],
//!   never an error.
//! - [`Server`]: a single-threaded mio loop that the application drives, enforcing every bound of
//!   [`ServerConfig`] and reporting clients that leave mid-response as [`Event::Disconnected`].
//! - The client side, one rule for both forms (a pooled connection that fails before any response byte
//!   is retried on a fresh one; a response not read to its end closes its connection): [`HttpClient`],
//!   blocking, over a bounded [`Pool`] with acquire deadlines; and [`Upstream`], one non-blocking
//!   connection for a program's own mio loop (the router).
//!
//! ```no_run
//! use pdserve_http::{Event, Response, Server, ServerConfig};
//! let mut server = Server::bind("127.0.0.1:8080".parse().unwrap(), ServerConfig::default()).unwrap();
//! let mut events = Vec::new();
//! loop {
//!     server.poll(&mut events, None).unwrap();
//!     for event in events.drain(..) {
//!         if let Event::Request { conn, request } = event {
//!             let body = format!("you asked for {}", request.path());
//!             let _ = server.respond(conn, &Response::text(200, body));
//!         }
//!     }
//! }
//! ```
#![forbid(unsafe_code)]

mod chunked;
mod client;
mod error;
mod limits;
mod pool;
mod request;
mod response;
mod server;
mod sse;
mod upstream;

pub use client::{ResponseDecoder, ResponseEvent, ResponseHead};
pub use error::HttpError;
pub use limits::{Limits, ServerConfig};
pub use pool::{ClientConfig, ClientResponse, HttpClient, Pool, PoolConfig, PoolStats, Pooled};
pub use request::{write_request_head, Header, Request, RequestDecoder, Status};
pub use response::{reason_phrase, write_chunk, write_head, write_last_chunk, BodyKind, Response};
pub use server::{ConnId, DisconnectReason, Event, Server, ServerStats};
pub use sse::{write_sse_chunk, write_sse_event, SseDecoder, SseEvent};
pub use upstream::{Upstream, UpstreamPhase};

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
