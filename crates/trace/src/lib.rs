//! Traces for the whole path of a request, across processes: W3C trace context ([`TraceContext`],
//! the `traceparent` header), spans ([`Span`]), and an [`Exporter`] that posts them over OTLP/HTTP
//! (protobuf, `application/x-protobuf`) to a collector, as vLLM's `--otlp-traces-endpoint` does.
//!
//! Serving never waits on the collector: [`Exporter::export`] is a `try_send` into a bounded queue
//! (full: the span is dropped and counted); one thread batches spans (up to 512, or what came within
//! a second) and posts each batch with a 5 s deadline; a batch the collector refuses or that fails is
//! dropped and counted, retried once only when the collector asks for it (429, 502, 503, 504), after
//! its `Retry-After` (2 s at most).
//!
//! ```
//! use pdserve_trace::{AttrValue, Span, SpanKind, TraceContext};
//! let parent = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").unwrap();
//! let mut s = Span::start(&parent, "prefill", SpanKind::Internal);
//! s.attr("gen_ai.request.id", AttrValue::Str("req-1".into()));
//! s.end();
//! assert_eq!(s.context.trace_id, parent.trace_id);
//! assert_eq!(s.parent, Some(parent.span_id));
//! let body = pdserve_trace::otlp::export_request("pdserve-router", &[s]);
//! assert!(!body.is_empty());
//! ```
#![forbid(unsafe_code)]

mod context;
mod http;
pub mod otlp;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender, TrySendError};

pub use context::{new_span_id, TraceContext};

/// What a span is to its trace (OTLP's `SpanKind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    /// Handling a request that came in.
    Server = 2,
    /// A request sent to another process.
    Client = 3,
}

/// An attribute's value.
#[derive(Debug, Clone, PartialEq)]
pub enum AttrValue {
    Str(String),
    Bool(bool),
    Int(i64),
    Float(f64),
}

/// How a span ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Status {
    Unset,
    Ok,
    /// Failed, and why.
    Error(String),
}

/// Nanoseconds since the Unix epoch at `at`, an instant of this process's monotonic clock, read
/// against one reference taken at the first call: every span of the process is on one consistent
/// timeline (a wall-clock step later moves none of them).
pub fn unix_nanos(at: Instant) -> u64 {
    static REFERENCE: std::sync::OnceLock<(Duration, Instant)> = std::sync::OnceLock::new();
    let &(wall, mono) = REFERENCE
        .get_or_init(|| (SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default(), Instant::now()));
    let t = match at.checked_duration_since(mono) {
        Some(after) => wall + after,
        None => wall.saturating_sub(mono.saturating_duration_since(at)),
    };
    t.as_nanos() as u64
}

/// One span: its own context (trace id and span id), its parent span, name, kind, start and end
/// (Unix nanoseconds), attributes, timed events and status.
#[derive(Debug, Clone, PartialEq)]
pub struct Span {
    pub context: TraceContext,
    pub parent: Option<[u8; 8]>,
    pub name: String,
    pub kind: SpanKind,
    pub start_unix_nanos: u64,
    pub end_unix_nanos: u64,
    pub attributes: Vec<(String, AttrValue)>,
    /// (Unix nanoseconds, name).
    pub events: Vec<(u64, String)>,
    pub status: Status,
}

impl Span {
    /// A span starting now, a child of `parent`.
    pub fn start(parent: &TraceContext, name: &str, kind: SpanKind) -> Span {
        Span::between(parent, name, kind, Instant::now(), Instant::now())
    }

    /// A span of `parent` from `start` to `end` (for stages whose times are known afterwards).
    pub fn between(parent: &TraceContext, name: &str, kind: SpanKind, start: Instant, end: Instant) -> Span {
        Span::with_context(parent.child(), Some(parent.span_id), name, kind, start, end)
    }

    /// A span whose own context is `context` (a root span has no `parent`).
    pub fn with_context(
        context: TraceContext,
        parent: Option<[u8; 8]>,
        name: &str,
        kind: SpanKind,
        start: Instant,
        end: Instant,
    ) -> Span {
        Span {
            context,
            parent,
            name: name.to_owned(),
            kind,
            start_unix_nanos: unix_nanos(start),
            end_unix_nanos: unix_nanos(end).max(unix_nanos(start)),
            attributes: Vec::new(),
            events: Vec::new(),
            status: Status::Unset,
        }
    }

    pub fn attr(&mut self, key: &str, value: AttrValue) -> &mut Span {
        self.attributes.push((key.to_owned(), value));
        self
    }

    /// Ends the span now.
    pub fn end(&mut self) {
        self.end_unix_nanos = unix_nanos(Instant::now()).max(self.start_unix_nanos);
    }
}

/// Where spans go: `http://HOST:PORT[/PATH]` (OTLP/HTTP; a URL without a path gets `/v1/traces`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Endpoint {
    pub host: String,
    pub port: u16,
    pub path: String,
}

impl Endpoint {
    pub fn parse(url: &str) -> Result<Endpoint, String> {
        let rest = url.strip_prefix("http://").ok_or_else(|| {
            format!("--otlp-traces-endpoint {url}: an http:// URL (OTLP/HTTP with protobuf; put a collector without TLS on the node)")
        })?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, ""),
        };
        let (host, port) = match authority.rsplit_once(':') {
            // An IPv6 address without a port: `[::1]`.
            Some(_) if authority.starts_with('[') && authority.ends_with(']') => (authority, 4318),
            Some((h, p)) => {
                (h, p.parse::<u16>().map_err(|e| format!("--otlp-traces-endpoint {url}: port: {e}"))?)
            }
            None => (authority, 4318),
        };
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.is_empty() {
            return Err(format!("--otlp-traces-endpoint {url}: no host"));
        }
        let path = if path.is_empty() || path == "/" { "/v1/traces".to_owned() } else { path.to_owned() };
        Ok(Endpoint { host: host.to_owned(), port, path })
    }
}

/// What an exporter has done, for the process's metrics.
#[derive(Debug, Default)]
pub struct ExporterStats {
    /// Spans the collector accepted.
    pub spans_exported: AtomicU64,
    /// Spans dropped: the queue was full, or their batch failed.
    pub spans_dropped: AtomicU64,
    /// Batches that failed (connection, timeout, or a status other than 2xx).
    pub batches_failed: AtomicU64,
}

impl ExporterStats {
    /// The span counts by result, as a `{result}` label names them (`exported`, `dropped`): what a
    /// process copies into its `otlp_spans_total` counter.
    pub fn spans_by_result(&self) -> [(&'static str, u64); 2] {
        [
            ("exported", self.spans_exported.load(Ordering::Relaxed)),
            ("dropped", self.spans_dropped.load(Ordering::Relaxed)),
        ]
    }
}

/// Spans queued for the exporting thread at most.
pub const QUEUE_SPANS_MAX: usize = 16_384;
/// Spans per posted batch at most.
const BATCH_SPANS_MAX: usize = 512;
/// A post's deadline (connect, send, answer).
const POST_TIMEOUT: Duration = Duration::from_secs(5);

/// Exports spans on a thread of its own (see the crate docs). Cloning shares it.
#[derive(Debug, Clone)]
pub struct Exporter {
    spans: Sender<Span>,
    stats: Arc<ExporterStats>,
}

impl Exporter {
    /// Starts the exporting thread for spans of `service_name` (OTLP's `service.name`).
    pub fn start(endpoint: Endpoint, service_name: &str) -> std::io::Result<Exporter> {
        let (spans, rx) = crossbeam_channel::bounded(QUEUE_SPANS_MAX);
        let stats = Arc::new(ExporterStats::default());
        let (st, name) = (Arc::clone(&stats), service_name.to_owned());
        std::thread::Builder::new()
            .name("otlp-export".into())
            .spawn(move || run(&rx, &endpoint, &name, &st))?;
        Ok(Exporter { spans, stats })
    }

    /// Queues `span`; never waits (a full queue drops it, counted).
    pub fn export(&self, span: Span) {
        match self.spans.try_send(span) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.spans_dropped.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    pub fn stats(&self) -> &ExporterStats {
        &self.stats
    }
}

fn run(rx: &Receiver<Span>, endpoint: &Endpoint, service: &str, stats: &ExporterStats) {
    loop {
        let first = match rx.recv() {
            Ok(s) => s,
            Err(_) => return, // every exporter handle is gone
        };
        let mut batch = vec![first];
        let until = Instant::now() + Duration::from_secs(1);
        while batch.len() < BATCH_SPANS_MAX {
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(s) => batch.push(s),
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        let body = otlp::export_request(service, &batch);
        let mut outcome = http::post(endpoint, &body, POST_TIMEOUT);
        if let Err(http::Failure::Retryable(after)) = &outcome {
            std::thread::sleep((*after).min(Duration::from_secs(2)));
            outcome = http::post(endpoint, &body, POST_TIMEOUT);
        }
        let n = batch.len() as u64;
        match outcome {
            Ok(()) => {
                stats.spans_exported.fetch_add(n, Ordering::Relaxed);
            }
            Err(failure) => {
                // The first failure and every hundredth after it are logged; all are counted.
                let failed = stats.batches_failed.fetch_add(1, Ordering::Relaxed);
                stats.spans_dropped.fetch_add(n, Ordering::Relaxed);
                if failed.is_multiple_of(100) {
                    let why = match failure {
                        http::Failure::Retryable(_) => "the collector asked to retry, twice".to_owned(),
                        http::Failure::Final(why) => why,
                    };
                    eprintln!(
                        "otlp: {n} spans dropped, posting to http://{}:{}{} failed: {why} ({} batches so far)",
                        endpoint.host,
                        endpoint.port,
                        endpoint.path,
                        failed + 1
                    );
                }
            }
        }
    }
}

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
