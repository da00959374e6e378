//! One request's life in the router, as a sans-IO state machine: events in through `handle_*`
//! (admission, legs opened, response heads and bytes, failures, the deadline, the client leaving),
//! actions out through [`Flight::poll_action`] (open a leg, start the client's stream, forward bytes,
//! answer, close a leg, abort at a worker, stage changes, and the one `Finished`). No sockets, no
//! threads, no clock: `now` comes in as an argument; the mio shell (`router.rs`) owns the rest.
//!
//! Call order: [`Flight::new`]; then, whenever anything happens to the request, the matching
//! `handle_*` call, followed by [`Flight::poll_action`] until `None`. Every leg the flight asks for with
//! [`Action::OpenLeg`] is answered with exactly one of [`Flight::handle_leg_sent`] or
//! [`Flight::handle_leg_failed`] (`Refused`/`NoWorker`); a sent leg then gets head, data and end events,
//! or one failure. Call [`Flight::handle_timeout`] when [`Flight::deadline`] has come.
//!
//! Guarantees (checked by `tests/flight_sim.rs` on a virtual clock):
//! - exactly one [`Action::Finished`], and no action after it;
//! - a client with a connection gets exactly one answer (a response, or a stream ended by its final
//!   event or by the error events of `api.md`), unless it left;
//! - the request is over by its deadline: `handle_timeout` at the deadline always finishes it;
//! - a leg is open at most one at a time, and every leg that was sent ends with its response's end, a
//!   reported failure, or [`Action::CloseLeg`];
//! - when the request does not complete, every worker that was sent part of it and did not answer it
//!   with an error of its own gets an [`Action::Abort`];
//! - a request whose worker dies, stalls or loses its KV is moved to another worker (a *migration*,
//!   at most [`FlightSpec::migrations_max`] times, within the deadline): the client's stream goes on
//!   from the last token it has, with nothing lost or repeated. A streamed answer moves only where
//!   its worker writes resume marks ([`pdserve_api::pd::mark`]): the router forwards the events up to
//!   the newest mark and keeps the token ids the marks name; what came after the newest mark is
//!   dropped and made again by the next worker.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use pdserve_api::{header, pd, ApiError, ErrorKind, Health, Outcome, Role, Stage};
use pdserve_codec::{stream_error_frames, Endpoint, Meta};
use pdserve_http::Response;

mod migrate;
mod retry;
use migrate::Marked;
pub use migrate::Migration;

/// Which part of the request a leg carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LegKind {
    /// The whole request to a unified worker (or a GET forwarded to any worker).
    Main,
    Prefill,
    Decode,
}

impl LegKind {
    /// The role of the worker it goes to (`Main` goes to unified workers).
    pub fn role(self) -> Role {
        match self {
            LegKind::Main => Role::Unified,
            LegKind::Prefill => Role::Prefill,
            LegKind::Decode => Role::Decode,
        }
    }
}

/// A leg's number within its flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LegId(pub u32);

/// Why a flight exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// A client's request.
    Client,
    /// `GET /health/generate` on the router: a client request whose answer is the probe's verdict.
    HealthGenerate,
    /// The periodic pair probe through these prefill and decode workers (no client).
    PairProbe { prefill: u32, decode: u32 },
}

/// How the request is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Plan {
    /// One leg to a unified worker.
    Unified,
    /// A prefill leg, then a decode leg with the prefill worker's handle.
    Disaggregated,
    /// One leg to a decode worker, which computes the prompt itself: it holds the conversation's
    /// history and what it lacks is short (conditional disaggregation). A refusal for load (429, or
    /// 503 `no_capacity`) and every migration fall back to [`Plan::Disaggregated`].
    DecodeLocal,
    /// A GET forwarded to any worker.
    Forward,
}

impl Plan {
    pub fn as_str(self) -> &'static str {
        match self {
            Plan::Unified => "unified",
            Plan::Disaggregated => "disaggregated",
            Plan::DecodeLocal => "decode_local",
            Plan::Forward => "forward",
        }
    }
}

/// What a flight is for and what it carries.
#[derive(Debug, Clone)]
pub struct FlightSpec {
    pub request_id: String,
    pub purpose: Purpose,
    /// `POST` to a completion endpoint, or `GET` of `path`.
    pub method_get: bool,
    pub path: String,
    pub body: Vec<u8>,
    /// The prompt text cache-aware routing reads.
    pub prompt: String,
    pub received: Instant,
    pub deadline: Instant,
    /// Legs re-sent after a refused connection, at most, per leg kind.
    pub retries_max: u32,
    /// Largest worker answer that is buffered (non-streaming answers, prefill handles).
    pub body_bytes_max: usize,
    /// Moves to another worker after a failure, at most (0: none).
    pub migrations_max: u32,
    /// A streaming leg that sends nothing for this long has stalled (`None`: never).
    pub stall_timeout: Option<Duration>,
}

/// Why a leg did not go out or did not come back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LegFailure {
    /// No worker can take the leg (none healthy of the role, all at their connection bound).
    NoWorker { reason: String },
    /// The connection to `worker` never came up: nothing was sent.
    Refused { worker: u32, reason: String },
    /// The leg went out on a pooled connection the worker had closed while idle, and failed before any
    /// response byte: the worker never took it.
    Stale,
    /// The connection failed after the request was (partly) sent, or the answer was malformed.
    Broken { reason: String },
}

/// Why a leg is re-sent, for the retry counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    Refused,
    Stale,
}

/// How a flight ended, for the shell's bookkeeping and metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub outcome: Outcome,
    /// The status the client got (0 when it had left; 200 for a stream, even one ended by an error).
    pub status: u16,
    /// The error's `type`, when the flight ended with one.
    pub error: Option<ErrorKind>,
    /// The stage it ended in.
    pub stage: Stage,
    /// Workers the request went through, for the path-proven bookkeeping.
    pub prefill_worker: Option<u32>,
    pub decode_worker: Option<u32>,
    /// From the prefill leg's start to its end.
    pub prefill_leg: Option<Duration>,
    pub message: Option<String>,
    /// The moves to other workers, in order.
    pub migrations: Vec<Migration>,
}

/// What the shell must do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Pick a worker of `kind`'s role (`pinned` if set; never one of `exclude`), connect, call
    /// [`Flight::handle_leg_sent`] (then send [`Flight::leg_request`]) or report why not.
    OpenLeg { leg: LegId, kind: LegKind, exclude: Vec<u32>, pinned: Option<u32>, retry: Option<Retry> },
    /// Start the client's response as a stream: a `200` head with these headers.
    StartStream { headers: Vec<(String, String)> },
    /// Bytes for the client's stream.
    Forward(Vec<u8>),
    /// End the client's stream.
    EndStream,
    /// Answer the client with a whole response.
    Respond(Response),
    /// The flight gives up on an open leg: close its connection (never reuse it).
    CloseLeg { leg: LegId },
    /// Tell `worker` to drop the request it knows as `request_id` (`POST /abort/{id}`).
    Abort { worker: u32, request_id: String },
    /// The request moved to `stage`, at `worker` when it has one.
    Stage { stage: Stage, worker: Option<u32> },
    /// The flight is over; nothing follows.
    Finished(Finish),
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Head {
    status: u16,
    content_type: Option<String>,
    retry_after: Option<String>,
}

#[derive(Debug)]
enum State {
    /// Admitted or queued; no leg asked for yet.
    Waiting,
    /// A leg was asked for; the shell has not said which worker took it.
    Opening {
        leg: LegId,
        kind: LegKind,
    },
    /// A leg is out at `worker`.
    Open {
        leg: LegId,
        kind: LegKind,
        worker: u32,
        head: Option<Head>,
        body: Vec<u8>,
    },
    Done,
}

/// Per worker the request reached: whether it answered the request itself with an error (then it
/// needs no abort).
#[derive(Debug, Clone, Copy)]
struct Reached {
    worker: u32,
    answered_error: bool,
}

/// One request. See the [module docs](self).
#[derive(Debug)]
pub struct Flight {
    spec: FlightSpec,
    plan: Plan,
    state: State,
    next_leg: u32,
    reached: Vec<Reached>,
    /// Workers that could not take the current leg kind.
    refused: Vec<u32>,
    /// The last draining worker's refusal: the answer when no other worker is left to try.
    draining_answer: Option<ApiError>,
    /// The current leg was re-sent after a stale connection (once per leg kind).
    stale_retried: bool,
    prefill_worker: Option<u32>,
    decode_worker: Option<u32>,
    prefill_sent: Option<Instant>,
    prefill_leg: Option<Duration>,
    /// The decode leg's body: the client's with the prefill worker's handle spliced in.
    decode_body: Vec<u8>,
    /// The client's stream is open.
    streaming: bool,
    /// The last bytes forwarded on the stream, to end a broken one on an event boundary.
    tail: Vec<u8>,
    client: bool,
    /// The stage last announced with [`Action::Stage`].
    stage: Stage,
    actions: VecDeque<Action>,
    /// Which try this is (0: the first); the workers know try `n` > 0 as `{request_id}.m{n}`.
    attempt: u32,
    migrations: Vec<Migration>,
    /// Workers that died or stalled under this request: no leg goes to them again.
    lost: Vec<u32>,
    /// Tokens the client has, from the resume marks, and the response's `created`.
    generated: Vec<u32>,
    created: Option<u64>,
    /// The open leg writes resume marks: its events pass through here.
    marked: Option<Marked>,
    /// Everything the client's stream holds so far came through resume marks: another worker can go
    /// on from it.
    resumable: bool,
    /// Tries after the first: the client's body with the `pd_resume` member.
    resume_body: Option<Vec<u8>>,
    /// When the open leg's newest resume mark came.
    last_mark: Option<Instant>,
}

/// Bytes of the stream's end kept to see whether it ended on an event boundary (or with `[DONE]`).
const TAIL_BYTES: usize = 96;

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Flight {
    /// A flight waiting for admission. `client`: a client connection waits for the answer.
    pub fn new(spec: FlightSpec, client: bool) -> Flight {
        Flight {
            spec,
            plan: Plan::Unified,
            state: State::Waiting,
            next_leg: 0,
            reached: Vec::new(),
            refused: Vec::new(),
            draining_answer: None,
            stale_retried: false,
            prefill_worker: None,
            decode_worker: None,
            prefill_sent: None,
            prefill_leg: None,
            decode_body: Vec::new(),
            streaming: false,
            tail: Vec::new(),
            client,
            stage: Stage::RouterQueued,
            actions: VecDeque::new(),
            attempt: 0,
            migrations: Vec::new(),
            lost: Vec::new(),
            generated: Vec::new(),
            created: None,
            marked: None,
            resumable: false,
            resume_body: None,
            last_mark: None,
        }
    }

    /// The request's id at its workers: the client's on the first try, then `{id}.m{n}`.
    pub fn worker_request_id(&self) -> String {
        match self.attempt {
            0 => self.spec.request_id.clone(),
            n => format!("{}.m{n}", self.spec.request_id),
        }
    }

    /// How many times the request moved to another worker so far.
    pub fn migrations(&self) -> &[Migration] {
        &self.migrations
    }

    pub fn spec(&self) -> &FlightSpec {
        &self.spec
    }

    pub fn deadline(&self) -> Instant {
        self.spec.deadline
    }

    pub fn is_done(&self) -> bool {
        matches!(self.state, State::Done)
    }

    /// The worker the open leg is at, if one is.
    pub fn worker(&self) -> Option<u32> {
        match self.state {
            State::Open { worker, .. } => Some(worker),
            _ => None,
        }
    }

    /// The open leg, if one is.
    pub fn open_leg(&self) -> Option<LegId> {
        match self.state {
            State::Open { leg, .. } | State::Opening { leg, .. } => Some(leg),
            _ => None,
        }
    }

    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    fn endpoint(&self) -> Endpoint {
        Endpoint::from_path(&self.spec.path).unwrap_or(Endpoint::Chat)
    }

    fn push(&mut self, a: Action) {
        if let Action::Stage { stage, .. } = a {
            self.stage = stage;
        }
        self.actions.push_back(a);
    }

    /// How the request is served (a [`Plan::DecodeLocal`] flight falls back to
    /// [`Plan::Disaggregated`] on a refusal for load or a migration).
    pub fn plan(&self) -> Plan {
        self.plan
    }

    /// Where the request is now (the last stage announced).
    pub fn stage(&self) -> Stage {
        self.stage
    }

    /// Admission let the request go: the first leg is asked for.
    pub fn handle_dispatch(&mut self, plan: Plan) {
        if !matches!(self.state, State::Waiting) {
            return;
        }
        self.plan = plan;
        let kind = match plan {
            Plan::Unified | Plan::Forward => LegKind::Main,
            Plan::Disaggregated => LegKind::Prefill,
            Plan::DecodeLocal => LegKind::Decode,
        };
        self.open(kind, None);
    }

    fn open(&mut self, kind: LegKind, retry: Option<Retry>) {
        let leg = LegId(self.next_leg);
        self.next_leg += 1;
        let pinned = match (self.spec.purpose, kind) {
            (Purpose::PairProbe { decode, .. }, LegKind::Decode) => Some(decode),
            (Purpose::PairProbe { prefill, .. }, _) => Some(prefill),
            _ => None,
        };
        if let Some(p) = pinned {
            if self.refused.contains(&p) {
                let reason = format!("probe worker {p} refused the connection");
                return self.fail(ApiError::new(ErrorKind::NoCapacity, reason).with_retry_after(1));
            }
        }
        self.state = State::Opening { leg, kind };
        let mut exclude = self.refused.clone();
        for &w in &self.lost {
            if !exclude.contains(&w) {
                exclude.push(w);
            }
        }
        self.push(Action::OpenLeg { leg, kind, exclude, pinned, retry });
    }

    /// The shell connected leg `leg` to `worker` and is sending it: the worker may see the request
    /// from now on.
    pub fn handle_leg_sent(&mut self, leg: LegId, worker: u32, now: Instant) {
        let State::Opening { leg: l, kind } = self.state else { return };
        if l != leg {
            return;
        }
        self.state = State::Open { leg, kind, worker, head: None, body: Vec::new() };
        match self.reached.iter_mut().find(|r| r.worker == worker) {
            // It ended an earlier leg with its own error, but holds this one now (a decode-local
            // refusal's fallback, say): it is owed an abort again.
            Some(r) => r.answered_error = false,
            None => self.reached.push(Reached { worker, answered_error: false }),
        }
        let stage = match kind {
            LegKind::Prefill => {
                self.prefill_worker = Some(worker);
                self.prefill_sent = Some(now);
                Stage::Prefilling
            }
            LegKind::Decode => {
                self.decode_worker = Some(worker);
                Stage::Decoding
            }
            LegKind::Main => Stage::Decoding,
        };
        self.push(Action::Stage { stage, worker: Some(worker) });
    }

    /// The request bytes of leg `kind` for a worker at `authority`, carrying the time left (and the
    /// stack's `secret`, if it has one).
    /// The leg's HTTP request; `traceparent`: the leg's span, for the worker's spans to join.
    pub fn leg_request(
        &self,
        kind: LegKind,
        authority: &str,
        secret: Option<&str>,
        traceparent: Option<&str>,
        now: Instant,
    ) -> Vec<u8> {
        let remaining = ms(self.spec.deadline.saturating_duration_since(now)).max(1);
        let body = match kind {
            LegKind::Decode if self.plan == Plan::Disaggregated => &self.decode_body,
            _ => self.resume_body.as_ref().unwrap_or(&self.spec.body),
        };
        let method = if self.spec.method_get { "GET" } else { "POST" };
        let remaining = remaining.to_string();
        let rid = self.worker_request_id();
        let mut headers = vec![
            ("host", authority),
            (header::REQUEST_ID, rid.as_str()),
            (header::DEADLINE_MS, remaining.as_str()),
            ("content-type", "application/json"),
        ];
        headers.extend(secret.map(|s| (header::CLUSTER_SECRET, s)));
        headers.extend(traceparent.map(|t| (header::TRACEPARENT, t)));
        if self.may_migrate() && kind != LegKind::Prefill {
            headers.push((header::RESUMABLE, "1"));
        }
        let mut out = Vec::with_capacity(body.len() + 256);
        pdserve_http::write_request_head(&mut out, method, &self.spec.path, &headers, body.len());
        out.extend_from_slice(body);
        out
    }

    /// The leg's response head; `resumable`: it carries [`header::RESUMABLE`] (the stream has
    /// resume marks).
    pub fn handle_leg_head(
        &mut self,
        leg: LegId,
        status: u16,
        content_type: Option<&str>,
        retry_after: Option<&str>,
        resumable: bool,
    ) {
        let State::Open { leg: l, kind, head, .. } = &mut self.state else { return };
        if *l != leg || head.is_some() {
            return;
        }
        let kind = *kind;
        *head = Some(Head {
            status,
            content_type: content_type.map(str::to_owned),
            retry_after: retry_after.map(str::to_owned),
        });
        let sse = content_type.is_some_and(|c| c.starts_with("text/event-stream"));
        let stream = kind != LegKind::Prefill && status == 200 && sse;
        self.marked = (stream && resumable && self.may_migrate()).then(Marked::default);
        if stream && self.streaming {
            // A later try: the client's stream is open already and goes on.
            self.resumable &= self.marked.is_some();
            self.push(Action::Stage { stage: Stage::Streaming, worker: None });
        } else if stream && self.spec.purpose == Purpose::Client && self.client {
            self.resumable = self.marked.is_some();
            self.streaming = true;
            let headers = vec![
                ("content-type".to_owned(), "text/event-stream".to_owned()),
                ("cache-control".to_owned(), "no-cache".to_owned()),
                (header::REQUEST_ID.to_owned(), self.spec.request_id.clone()),
            ];
            self.push(Action::StartStream { headers });
            self.push(Action::Stage { stage: Stage::Streaming, worker: None });
        }
    }

    /// A piece of the leg's response body.
    pub fn handle_leg_data(&mut self, leg: LegId, data: &[u8], now: Instant) {
        let State::Open { leg: l, kind, body, head, .. } = &mut self.state else { return };
        if *l != leg {
            return;
        }
        // (A later try's prefill answer is buffered like any other, the client's stream open or not;
        // so is a later try's error answer, which `answered` reads.)
        let ok = head.as_ref().is_some_and(|h| h.status == 200);
        if self.streaming && *kind != LegKind::Prefill && ok {
            if !self.client {
                return;
            }
            if self.marked.is_some() {
                return self.marked_data(data, now);
            }
            self.forward(data.to_vec());
        } else if body.len() + data.len() > self.spec.body_bytes_max {
            // `fail` closes the open leg.
            let msg = format!("worker's answer is over {} bytes", self.spec.body_bytes_max);
            self.fail(ApiError::new(ErrorKind::UpstreamFailed, msg));
        } else {
            body.extend_from_slice(data);
        }
    }

    /// Bytes for the client's stream, remembering how it ends.
    fn forward(&mut self, data: Vec<u8>) {
        if data.is_empty() {
            return;
        }
        let from = data.len().saturating_sub(TAIL_BYTES);
        if data.len() >= TAIL_BYTES {
            self.tail.clear();
        } else {
            let keep = (self.tail.len() + data.len()).saturating_sub(TAIL_BYTES);
            self.tail.drain(..keep.min(self.tail.len()));
        }
        self.tail.extend_from_slice(&data[from..]);
        self.push(Action::Forward(data));
    }

    /// The leg's response ended (its connection may go back to the pool).
    pub fn handle_leg_end(&mut self, leg: LegId, now: Instant) {
        let State::Open { leg: l, kind, worker, .. } = self.state else { return };
        if l != leg {
            return;
        }
        if self.marked.as_ref().is_some_and(|m| m.retry) && self.can_migrate() {
            // The connection ended cleanly: nothing to close.
            self.state = State::Waiting;
            return self.migrate(Migration::KvTransfer, None);
        }
        if let Some(m) = self.marked.take() {
            // The stream's end (its final events, or the worker's error events) goes out whole.
            let mut rest = m.held;
            rest.extend_from_slice(&m.partial);
            self.forward(rest);
        }
        let State::Open { ref mut head, ref mut body, .. } = self.state else { return };
        let head = head.take().unwrap_or(Head { status: 502, content_type: None, retry_after: None });
        let body = std::mem::take(body);
        self.state = State::Waiting;
        if let Some(refusal) = self.draining_refusal(&head, &body, worker) {
            // A draining worker took nothing (it answers `not_ready` before any work): another may.
            self.reached.retain(|r| r.worker != worker);
            if self.local_fell_through(kind) {
                return;
            }
            self.draining_answer = Some(refusal);
            self.refused.push(worker);
            return self.open(kind, Some(Retry::Refused));
        }
        if head.status >= 300 {
            if let Some(r) = self.reached.iter_mut().find(|r| r.worker == worker) {
                r.answered_error = true;
            }
        }
        match kind {
            LegKind::Prefill => self.prefilled(head, body, now),
            LegKind::Main | LegKind::Decode => self.answered(head, body, now),
        }
    }

    /// The prefill leg ended: an error goes to the client as the worker gave it; a handle starts the
    /// decode leg.
    fn prefilled(&mut self, head: Head, body: Vec<u8>, now: Instant) {
        if let Some(t) = self.prefill_sent {
            self.prefill_leg = Some(now.saturating_duration_since(t));
        }
        if head.status != 200 {
            // The worker's own error, in the shape of api.md: forwarded as is, no decode leg.
            return self.answered(head, body, now);
        }
        let Some(handle) = pd::handle_bytes(&body) else {
            let msg = format!("prefill worker answered 200 without a `{}` handle", pd::HANDLE_FIELD);
            return self.fail(ApiError::new(ErrorKind::UpstreamFailed, msg));
        };
        let body = self.resume_body.as_ref().unwrap_or(&self.spec.body);
        let Some(decode_body) = pd::splice_handle(body, handle) else {
            return self.fail(ApiError::invalid("body is not a JSON object"));
        };
        self.decode_body = decode_body;
        self.refused.clear();
        self.draining_answer = None;
        self.stale_retried = false;
        self.push(Action::Stage { stage: Stage::KvHeld, worker: None });
        self.open(LegKind::Decode, None);
    }

    /// The final leg's response ended: end the stream, or answer with what was buffered.
    fn answered(&mut self, head: Head, body: Vec<u8>, now: Instant) {
        // A worker's error answer names its kind; the outcome follows from it (or from the status).
        let error = if head.status >= 300 {
            ApiError::parse(&body).filter(|e| e.kind.status() == head.status)
        } else {
            None
        };
        if error.as_ref().is_some_and(|e| e.kind == ErrorKind::KvTransferFailed) && self.can_migrate() {
            // The prompt's KV did not arrive (its prefill worker died, say): another pair computes it.
            return self.migrate(Migration::KvTransfer, None);
        }
        let busy =
            error.as_ref().is_some_and(|e| matches!(e.kind, ErrorKind::QueueFull | ErrorKind::NoCapacity));
        // The decode worker has no room to compute the prompt itself: a prefill worker does.
        if busy && self.local_fell_through(LegKind::Decode) {
            return;
        }
        if head.status >= 300 && self.streaming {
            // A later try failed before its stream began: the client's stream ends with its error.
            let e = error.unwrap_or_else(|| {
                ApiError::new(ErrorKind::UpstreamFailed, format!("worker answered {}", head.status))
            });
            return self.fail(e);
        }
        let outcome = match (head.status, &error) {
            (200..=299, _) => Outcome::Completed,
            (_, Some(e)) => e.kind.outcome(),
            (s, None) => Outcome::of_status(s),
        };
        let error = error.map(|e| e.kind);
        let mut status = head.status;
        if self.client {
            if self.streaming {
                self.push(Action::EndStream);
                status = 200;
            } else if self.spec.purpose == Purpose::HealthGenerate {
                let health = if head.status == 200 {
                    let latency_ms = ms(now.saturating_duration_since(self.spec.received));
                    Health::Generated { latency_ms, details: serde_json::Value::Null }
                } else {
                    let body = String::from_utf8_lossy(&body);
                    Health::GenerateFailed { reason: format!("worker answered {}: {body}", head.status) }
                };
                status = health.status();
                self.push(Action::Respond(Response::health(&health, Some(&self.spec.request_id))));
            } else {
                let content_type = head.content_type.as_deref().unwrap_or("application/json");
                let mut resp = Response::new(head.status)
                    .header("content-type", content_type)
                    .header(header::REQUEST_ID, &self.spec.request_id)
                    .body(body);
                if matches!(head.status, 429 | 503) {
                    resp = resp.header(header::RETRY_AFTER, head.retry_after.as_deref().unwrap_or("1"));
                }
                self.push(Action::Respond(resp));
            }
        } else {
            status = 0;
        }
        self.finish(outcome, status, error, None);
    }

    /// The deadline came (call at or after [`deadline`](Self::deadline)).
    pub fn handle_timeout(&mut self, now: Instant) {
        if self.is_done() || now < self.spec.deadline {
            return;
        }
        let msg = format!(
            "deadline of {} ms passed at stage {} (worker: {})",
            ms(self.spec.deadline.saturating_duration_since(self.spec.received)),
            self.stage,
            self.worker().map_or("none".to_owned(), |w| w.to_string())
        );
        self.fail(ApiError::new(ErrorKind::DeadlineExceeded, msg));
    }

    /// Admission refused the request (queue full, queue wait over, no healthy path).
    pub fn handle_rejected(&mut self, error: ApiError) {
        self.fail(error);
    }

    /// The client left (or `POST /abort/{id}`, or it stopped reading its stream).
    pub fn handle_cancel(&mut self, client_gone: bool) {
        if self.is_done() {
            return;
        }
        if client_gone {
            self.client = false;
        }
        self.fail(ApiError::new(ErrorKind::Cancelled, "the request was cancelled"));
    }

    /// Ends the flight with `error`: the client's answer (or the stream's error events), the open leg
    /// closed, and aborts at the workers it reached.
    fn fail(&mut self, error: ApiError) {
        if self.is_done() {
            return;
        }
        if let Some(leg) = self.open_leg() {
            if matches!(self.state, State::Open { .. }) {
                self.push(Action::CloseLeg { leg });
            }
        }
        let mut status = error.status();
        if self.client {
            if self.spec.purpose == Purpose::HealthGenerate {
                let health = Health::GenerateFailed { reason: error.message.clone() };
                status = health.status();
                self.push(Action::Respond(Response::health(&health, Some(&self.spec.request_id))));
            } else if self.streaming {
                let mut frame = Vec::new();
                if !self.tail.is_empty() && !self.tail.ends_with(b"\n\n") {
                    frame.extend_from_slice(b"\n\n");
                }
                if !self.endpoint().stream_ended(&self.tail) {
                    let meta = Meta {
                        endpoint: self.endpoint(),
                        id: self.endpoint().response_id(&self.spec.request_id),
                        created: self.created.unwrap_or(0),
                        model: String::new(),
                    };
                    frame.extend_from_slice(
                        stream_error_frames(&meta, &error, &self.spec.request_id).as_bytes(),
                    );
                }
                self.push(Action::Forward(frame));
                self.push(Action::EndStream);
                status = 200;
            } else {
                let r = Response::error_at(&self.spec.path, &error, Some(&self.spec.request_id));
                self.push(Action::Respond(r));
            }
        } else {
            status = 0;
        }
        let kind = error.kind;
        self.finish(kind.outcome(), status, Some(kind), Some(error.message));
    }

    fn finish(&mut self, outcome: Outcome, status: u16, error: Option<ErrorKind>, message: Option<String>) {
        let stage = self.stage;
        self.state = State::Done;
        if outcome != Outcome::Completed {
            let rid = self.worker_request_id();
            for r in &self.reached {
                if !r.answered_error {
                    self.actions.push_back(Action::Abort { worker: r.worker, request_id: rid.clone() });
                }
            }
        }
        let migrations = std::mem::take(&mut self.migrations);
        self.push(Action::Finished(Finish {
            outcome,
            status,
            error,
            stage,
            prefill_worker: self.prefill_worker,
            decode_worker: self.decode_worker,
            prefill_leg: self.prefill_leg,
            message,
            migrations,
        }));
    }
}
