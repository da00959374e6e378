//! The router's loop: one mio thread holding the client connections (through [`pdserve_http::Server`])
//! and every upstream connection to workers, so that a request's whole life (admission, the prefill
//! leg, the decode leg, streaming, deadline, client disconnect) is handled in one place without locks.
//!
//! Every request that enters reaches exactly one terminal state through [`Router::finish`], which frees
//! its admission slot, closes or pools its upstream connection, and tells workers to abort a request
//! that did not end normally.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::io::Write as _;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdserve_api::{ApiError, ErrorKind, Stage};
use pdserve_http::{write_sse_event, ConnId, Event, Request, ResponseEvent, Server};
use pdserve_telemetry::RequestLedger;
use serde_json::json;

use crate::admission::{Admission, Admit};
use crate::config::{Role, RouterConfig};
use crate::metrics::{Metrics, Outcome};
use crate::peek::{pd_handle, peek, with_pd_transfer};
use crate::upstream::{Phase, UpError, Upstream};
use crate::workers::Workers;
use crate::{Candidate, LeastOutstanding, Policy};

/// How often the loop looks at timers when nothing else wakes it.
const TICK: Duration = Duration::from_millis(10);
/// Requests the router's ledger tracks at once (client requests are bounded far below by admission).
const LEDGER_CAPACITY: usize = 1 << 16;
const PROBE_BODY: &[u8] = br#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"temperature":0}"#;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LegKind {
    /// The whole request to a unified worker (or a GET forwarded to any worker).
    Main,
    Prefill,
    Decode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Owner {
    None,
    Leg { flight: u64, kind: LegKind },
    Probe { worker: u32 },
    Abort,
    Collect { id: u64, worker: u32 },
}

/// Why a flight is being pinned to given workers (probes) or routed by policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Purpose {
    Client,
    /// `GET /health/generate` on the router: a client request whose answer is the probe's verdict.
    HealthGenerate,
    /// The periodic prefill + decode pair probe.
    PairProbe {
        prefill: u32,
        decode: u32,
    },
}

#[derive(Debug)]
struct Flight {
    rid: String,
    client: Option<ConnId>,
    purpose: Purpose,
    method_get: bool,
    path: String,
    body: Vec<u8>,
    prompt: String,
    received: Instant,
    deadline: Instant,
    queued_at: Option<Instant>,
    /// Holds an admission slot.
    admitted: bool,
    /// The open leg: upstream slot, kind, worker.
    leg: Option<(usize, LegKind, u32)>,
    /// Workers that were sent (part of) this request: told to abort if it ends abnormally.
    started: Vec<u32>,
    /// Workers that refused the connection for the current leg.
    refused: Vec<u32>,
    /// The current leg was re-sent after a stale pooled connection (at most once per leg).
    stale_retried: bool,
    prefill_worker: Option<u32>,
    decode_worker: Option<u32>,
    prefill_sent: Option<Instant>,
    /// The decode leg's body: the client's with the prefill worker's KV handle spliced in.
    decode_body: Vec<u8>,
    /// The response to the client: head sent, streaming, and what is buffered.
    head_sent: bool,
    streaming: bool,
    status: u16,
    content_type: Option<String>,
    resp_body: Vec<u8>,
    /// The last bytes forwarded on a stream, to end a broken stream on an event boundary.
    tail: Vec<u8>,
}

impl Flight {
    /// A flight not yet dispatched, with no client connection (set `client` for one that has).
    fn new(
        rid: String,
        purpose: Purpose,
        path: &str,
        body: Vec<u8>,
        now: Instant,
        deadline: Instant,
    ) -> Flight {
        Flight {
            rid,
            client: None,
            purpose,
            method_get: false,
            path: path.to_owned(),
            body,
            prompt: String::new(),
            received: now,
            deadline,
            queued_at: None,
            admitted: false,
            leg: None,
            started: Vec::new(),
            refused: Vec::new(),
            stale_retried: false,
            prefill_worker: None,
            decode_worker: None,
            prefill_sent: None,
            decode_body: Vec::new(),
            head_sent: false,
            streaming: false,
            status: 0,
            content_type: None,
            resp_body: Vec::new(),
            tail: Vec::new(),
        }
    }

    fn chat(&self) -> bool {
        self.path == "/v1/chat/completions"
    }
}

#[derive(Debug)]
struct Collect {
    conn: ConnId,
    older_than: Duration,
    pending: usize,
    deadline: Instant,
    hops: Vec<serde_json::Value>,
    workers: Vec<serde_json::Value>,
    raw: HashMap<u32, Vec<u8>>,
}

/// The router. Build with [`Router::bind`], run with [`Router::run`].
#[derive(Debug)]
pub struct Router {
    cfg: RouterConfig,
    server: Server,
    workers: Workers,
    ups: Vec<Option<Upstream>>,
    owners: Vec<Owner>,
    ups_free: Vec<usize>,
    flights: HashMap<u64, Flight>,
    by_conn: HashMap<ConnId, u64>,
    by_rid: HashMap<String, u64>,
    admission: Admission,
    deadlines: BinaryHeap<Reverse<(Instant, u64)>>,
    policy: Box<dyn Policy>,
    decode_policy: LeastOutstanding,
    ledger: RequestLedger,
    metrics: Metrics,
    next_id: u64,
    collects: HashMap<u64, Collect>,
    next_probe: Instant,
    next_sweep: Instant,
    probe_round: usize,
    pair_probes_in_flight: usize,
    next_pair_probe: Instant,
    pumping: bool,
    read_buf: Vec<u8>,
    resp_events: Vec<ResponseEvent>,
    stop: Arc<AtomicBool>,
}

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// Constant-time comparison of a presented bearer token with the configured key.
fn key_matches(presented: Option<&str>, key: &str) -> bool {
    let Some(p) = presented.and_then(|h| h.strip_prefix("Bearer ")) else { return false };
    let (a, b) = (p.as_bytes(), key.as_bytes());
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0xff);
    }
    diff == 0
}

/// A health-shaped answer (`{"status": ...}`); anything but 200 carries `Retry-After`.
fn health_response(status: u16, body: &serde_json::Value) -> pdserve_http::Response {
    let resp = pdserve_http::Response::json(status, body.to_string());
    if status == 200 {
        resp
    } else {
        resp.header("retry-after", "1")
    }
}

fn error_response(
    status: u16,
    kind: &str,
    message: String,
    rid: &str,
    retry_after: Option<u32>,
) -> pdserve_http::Response {
    let kind = ErrorKind::from_type(kind).unwrap_or(ErrorKind::Internal);
    debug_assert_eq!(kind.status(), status);
    let mut e = ApiError::new(kind, message);
    if let Some(s) = retry_after {
        e = e.with_retry_after(s);
    }
    pdserve_http::Response::error(&e, Some(rid))
}

impl Router {
    /// Binds the client port and registers the configured workers (their health is probed at once).
    pub fn bind(cfg: RouterConfig) -> io::Result<Router> {
        let server = Server::bind(cfg.listen, cfg.server)?;
        let now = Instant::now();
        let metrics = Metrics::new().map_err(|e| io::Error::other(e.to_string()))?;
        let mut r = Router {
            server,
            workers: Workers::default(),
            ups: Vec::new(),
            owners: Vec::new(),
            ups_free: Vec::new(),
            flights: HashMap::new(),
            by_conn: HashMap::new(),
            by_rid: HashMap::new(),
            admission: Admission::new(cfg.admission, now),
            deadlines: BinaryHeap::new(),
            policy: cfg.policy.build(),
            decode_policy: LeastOutstanding,
            ledger: RequestLedger::new(&cfg.process_name, LEDGER_CAPACITY),
            metrics,
            next_id: 1,
            collects: HashMap::new(),
            next_probe: now,
            next_sweep: now,
            probe_round: 0,
            pair_probes_in_flight: 0,
            next_pair_probe: now,
            pumping: false,
            read_buf: vec![0; 64 * 1024],
            resp_events: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            cfg,
        };
        for spec in r.cfg.workers.clone() {
            r.add_worker(&spec.url, spec.role).map_err(io::Error::other)?;
        }
        Ok(r)
    }

    pub fn local_addr(&self) -> io::Result<SocketAddr> {
        self.server.local_addr()
    }

    /// A flag that ends [`run`](Self::run) (checked every few milliseconds).
    pub fn stop_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.stop)
    }

    /// Runs the loop until the stop flag is set.
    pub fn run(&mut self) -> io::Result<()> {
        let mut events = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            let now = Instant::now();
            let mut timeout = TICK;
            if let Some(Reverse((d, _))) = self.deadlines.peek() {
                timeout = timeout.min(d.saturating_duration_since(now));
            }
            self.server.poll(&mut events, Some(timeout))?;
            for ev in events.drain(..) {
                match ev {
                    Event::Request { conn, request } => self.handle_request(conn, request),
                    Event::Disconnected { conn, .. } => {
                        if let Some(id) = self.by_conn.remove(&conn) {
                            if let Some(f) = self.flights.get_mut(&id) {
                                f.client = None;
                            }
                            self.finish(id, Outcome::Cancelled);
                        }
                        self.collects.retain(|_, c| c.conn != conn);
                    }
                    Event::Io { token, readable, writable, read_closed } => {
                        self.on_upstream(token, readable, writable, read_closed)
                    }
                }
            }
            self.timers(Instant::now());
        }
        Ok(())
    }

    // ----- workers -------------------------------------------------------------------------------

    fn add_worker(&mut self, url: &str, role: Role) -> Result<u32, String> {
        let (canonical, _, _) = crate::workers::resolve(url)?;
        let labels = [canonical.as_str(), role.as_str()];
        let gauges = (
            self.metrics.worker_in_flight.with(&labels).map_err(|e| e.to_string())?,
            self.metrics.worker_connections.with(&labels).map_err(|e| e.to_string())?,
        );
        let id = self.workers.add(url, role, self.cfg.breaker, Instant::now(), gauges)?;
        // Probe it, and a pair through it, on the next turn.
        self.next_probe = Instant::now();
        self.next_pair_probe = Instant::now();
        Ok(id)
    }

    fn candidates(&self, role: Role, exclude: &[u32]) -> Vec<Candidate> {
        self.workers
            .iter()
            .filter(|w| w.role == role && w.routable() && !exclude.contains(&w.id))
            .filter(|w| w.connections < self.cfg.connections_per_worker_max || !w.idle.is_empty())
            .map(|w| Candidate { worker: w.id, outstanding: w.outstanding })
            .collect()
    }

    fn has_role(&self, role: Role) -> bool {
        self.workers.iter().any(|w| w.role == role && w.routable())
    }

    // ----- client requests -----------------------------------------------------------------------

    fn request_id(req: &Request, n: u64) -> String {
        match req.request_id() {
            Some(id) => id.to_owned(),
            None => format!("rt-{:x}-{n}", unix_ms()),
        }
    }

    fn handle_request(&mut self, conn: ConnId, req: Request) {
        let n = self.next_id;
        self.next_id += 1;
        let rid = Self::request_id(&req, n);
        let path = req.path().to_owned();
        let admin =
            path.starts_with("/workers") || path.starts_with("/debug/") || path.starts_with("/abort/");
        let key = if admin {
            self.cfg.admin_key.as_deref()
        } else if path.starts_with("/v1/") {
            self.cfg.api_key.as_deref()
        } else {
            None
        };
        if let Some(key) = key {
            if !key_matches(req.header_str("authorization"), key) {
                self.metrics.finished(Outcome::Invalid);
                let resp = error_response(
                    401,
                    "unauthorized",
                    "missing or wrong API key (Authorization: Bearer ...)".into(),
                    &rid,
                    None,
                );
                let _ = self.server.respond(conn, &resp);
                return;
            }
        }
        let method = req.method.as_str();
        match (method, path.as_str()) {
            ("GET", "/health/live") => self.respond_json(conn, 200, &json!({"status": "live"}), &rid),
            ("GET", "/health/ready" | "/health") => {
                let (status, body) =
                    match self.workers.path_ready(self.ready_window(), self.pair_window(), Instant::now()) {
                        Ok(()) => (200, json!({"status": "ready", "workers": self.workers.iter().count()})),
                        Err(reason) => (503, json!({"status": "not_ready", "reason": reason})),
                    };
                let resp = health_response(status, &body).header("x-request-id", &rid);
                let _ = self.server.respond(conn, &resp);
            }
            ("GET", "/health/generate") => self.start_flight(
                conn,
                &rid,
                "/v1/chat/completions",
                PROBE_BODY.to_vec(),
                false,
                Purpose::HealthGenerate,
            ),
            ("GET", "/metrics") => {
                self.refresh_gauges();
                let resp = pdserve_http::Response::text(200, self.metrics.registry.render())
                    .header("content-type", "text/plain; version=0.0.4; charset=utf-8");
                let _ = self.server.respond(conn, &resp);
            }
            ("GET", "/debug/requests") => self.start_collect(conn, &req),
            ("GET", "/workers") => {
                let now = Instant::now();
                let list: Vec<_> = self.workers.iter().map(|w| w.to_json(now)).collect();
                self.respond_json(conn, 200, &json!({"workers": list}), &rid);
            }
            ("POST", "/workers") => self.post_worker(conn, &req, &rid),
            ("DELETE", p) if p == "/workers" || p.starts_with("/workers/") => {
                self.delete_worker(conn, &req, &rid)
            }
            ("POST", p) if p.starts_with("/abort/") => {
                let target = &p["/abort/".len()..];
                match self.by_rid.get(target).copied() {
                    Some(id) => {
                        self.finish(id, Outcome::Cancelled);
                        self.respond_json(conn, 200, &json!({"aborted": target}), &rid);
                    }
                    None => {
                        let resp =
                            error_response(404, "not_found", format!("no live request {target}"), &rid, None);
                        let _ = self.server.respond(conn, &resp);
                    }
                }
            }
            ("POST", "/v1/chat/completions" | "/v1/completions") => {
                let path = if path == "/v1/completions" { "/v1/completions" } else { "/v1/chat/completions" };
                self.start_flight(conn, &rid, path, req.body, false, Purpose::Client);
            }
            ("GET", "/v1/models") => {
                self.start_flight(conn, &rid, "/v1/models", Vec::new(), true, Purpose::Client)
            }
            (
                _,
                "/health/live"
                | "/health/ready"
                | "/health"
                | "/health/generate"
                | "/metrics"
                | "/debug/requests"
                | "/v1/models"
                | "/v1/chat/completions"
                | "/v1/completions"
                | "/workers",
            ) => {
                let resp = error_response(
                    405,
                    "method_not_allowed",
                    format!("{method} is not allowed on {path}"),
                    &rid,
                    None,
                );
                let _ = self.server.respond(conn, &resp);
            }
            _ => {
                let resp = error_response(404, "not_found", format!("no route {method} {path}"), &rid, None);
                let _ = self.server.respond(conn, &resp);
            }
        }
    }

    fn respond_json(&mut self, conn: ConnId, status: u16, body: &serde_json::Value, rid: &str) {
        let resp = pdserve_http::Response::json(status, body.to_string()).header("x-request-id", rid);
        let _ = self.server.respond(conn, &resp);
    }

    fn ready_window(&self) -> Duration {
        self.cfg.probe_interval * 2 + self.cfg.probe_timeout
    }

    fn pair_window(&self) -> Duration {
        self.cfg.pair_probe_interval.max(self.cfg.probe_interval) * 2 + self.cfg.probe_timeout
    }

    fn post_worker(&mut self, conn: ConnId, req: &Request, rid: &str) {
        #[derive(serde::Deserialize)]
        struct Add {
            url: String,
            #[serde(default)]
            role: Option<String>,
        }
        let result = serde_json::from_slice::<Add>(&req.body)
            .map_err(|e| {
                (400, "invalid_request", format!("body must be {{\"url\": ..., \"role\": ...}}: {e}"))
            })
            .and_then(|a| {
                let role = match a.role.as_deref() {
                    None => Role::Unified,
                    Some(r) => Role::parse(r).ok_or((
                        400,
                        "invalid_request",
                        format!("unknown role {r:?} (unified, prefill, decode)"),
                    ))?,
                };
                self.add_worker(&a.url, role).map_err(|e| {
                    if e.contains("already registered") {
                        (409, "conflict", e)
                    } else {
                        (400, "invalid_request", e)
                    }
                })
            });
        match result {
            Ok(id) => {
                let now = Instant::now();
                let body = self.workers.get(id).map(|w| w.to_json(now)).unwrap_or_default();
                eprintln!("router: worker added: {body}");
                self.respond_json(conn, 201, &body, rid);
            }
            Err((status, kind, msg)) => {
                let _ = self.server.respond(conn, &error_response(status, kind, msg, rid, None));
            }
        }
    }

    fn delete_worker(&mut self, conn: ConnId, req: &Request, rid: &str) {
        let from_query = req
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("url=")))
            .map(|u| u.replace("%3A", ":").replace("%2F", "/").replace("%3a", ":").replace("%2f", "/"));
        let from_body = serde_json::from_slice::<serde_json::Value>(&req.body)
            .ok()
            .and_then(|v| v.get("url").and_then(|u| u.as_str()).map(str::to_owned));
        let from_path = req.path().strip_prefix("/workers/").and_then(|id| id.parse::<u32>().ok());
        let id = match (from_path, from_query.or(from_body)) {
            (Some(id), _) => self.workers.get(id).map(|w| w.id),
            (None, Some(url)) => self.workers.by_url(&url),
            (None, None) => {
                let msg = "say which worker: DELETE /workers/{id}, ?url=..., or {\"url\": ...}".to_owned();
                let _ = self.server.respond(conn, &error_response(400, "invalid_request", msg, rid, None));
                return;
            }
        };
        let Some(id) = id else {
            let _ = self
                .server
                .respond(conn, &error_response(404, "not_found", "no such worker".into(), rid, None));
            return;
        };
        let Some(w) = self.workers.get_mut(id) else { return };
        w.draining = true;
        let (url, draining) = (w.url.clone(), w.outstanding);
        eprintln!("router: worker {url} removed; draining {draining} requests");
        self.policy.forget(id);
        self.sweep_workers();
        self.respond_json(conn, 200, &json!({"removed": url, "draining_requests": draining}), rid);
    }

    // ----- flights -------------------------------------------------------------------------------

    fn start_flight(
        &mut self,
        conn: ConnId,
        rid: &str,
        path: &str,
        body: Vec<u8>,
        method_get: bool,
        purpose: Purpose,
    ) {
        let now = Instant::now();
        let (timeout_s, prompt) = if method_get {
            (None, String::new())
        } else {
            match peek(&body) {
                Ok(p) => (p.timeout_s, p.prompt),
                Err(msg) => {
                    self.metrics.finished(Outcome::Invalid);
                    let _ =
                        self.server.respond(conn, &error_response(400, "invalid_request", msg, rid, None));
                    return;
                }
            }
        };
        if self.by_rid.contains_key(rid) {
            self.metrics.finished(Outcome::Invalid);
            let msg = format!("request id {rid} is already in flight; x-request-id must be unique");
            let _ = self.server.respond(conn, &error_response(409, "conflict", msg, rid, None));
            return;
        }
        let timeout = match (purpose, timeout_s) {
            (Purpose::HealthGenerate, _) => self.cfg.probe_timeout,
            (_, Some(t)) => Duration::from_secs_f64(t.min(1e6)).min(self.cfg.request_timeout_max),
            (_, None) => self.cfg.request_timeout_max,
        };
        let id = self.next_id;
        self.next_id += 1;
        let mut flight = Flight::new(rid.to_owned(), purpose, path, body, now, now + timeout);
        flight.client = Some(conn);
        flight.method_get = method_get;
        flight.prompt = prompt;
        // No working capacity at all: answer at once rather than queue.
        let capacity =
            self.has_role(Role::Unified) || (self.has_role(Role::Prefill) && self.has_role(Role::Decode));
        if !method_get && !capacity {
            self.metrics.finished(Outcome::NoCapacity);
            let msg = self.workers.path_ready(Duration::ZERO, Duration::ZERO, now).err().unwrap_or_default();
            let msg = format!("no healthy worker can take the request ({msg})");
            let resp = if purpose == Purpose::HealthGenerate {
                let body = json!({"status": "failed", "reason": msg});
                health_response(503, &body)
            } else {
                error_response(503, "no_capacity", msg, rid, Some(1))
            };
            let _ = self.server.respond(conn, &resp);
            return;
        }
        let _ = self.ledger.admit(rid, Stage::RouterQueued, now, flight.deadline, "");
        self.by_conn.insert(conn, id);
        self.by_rid.insert(flight.rid.clone(), id);
        self.push_deadline(flight.deadline, id);
        self.flights.insert(id, flight);
        if purpose == Purpose::HealthGenerate {
            // Probes are never queued behind client traffic.
            self.dispatch(id);
            return;
        }
        match self.admission.offer(id, now) {
            Admit::Dispatch => {
                if let Some(f) = self.flights.get_mut(&id) {
                    f.admitted = true;
                }
                self.dispatch(id);
            }
            Admit::Queued => {
                if let Some(f) = self.flights.get_mut(&id) {
                    f.queued_at = Some(now);
                }
            }
            Admit::Full { retry_after_s } => {
                let msg = format!(
                    "router queue is full ({} waiting, limit {}; {} in flight)",
                    self.admission.queued(),
                    self.cfg.admission.queued_max,
                    self.admission.in_flight()
                );
                self.fail(id, Outcome::QueueFull, 429, "queue_full", msg, Some(retry_after_s));
            }
        }
    }

    /// Deadlines are removed lazily (when they come due); the heap is rebuilt from the live flights
    /// when stale entries outnumber them, so its size stays bounded by the flights in progress.
    fn push_deadline(&mut self, deadline: Instant, id: u64) {
        self.deadlines.push(Reverse((deadline, id)));
        if self.deadlines.len() > 2 * self.flights.len() + 1024 {
            self.deadlines = self.flights.iter().map(|(&id, f)| Reverse((f.deadline, id))).collect();
            self.deadlines.push(Reverse((deadline, id)));
        }
    }

    /// Starts an internal pair probe through the given prefill and decode workers.
    fn start_pair_probe(&mut self, prefill: u32, decode: u32) {
        let now = Instant::now();
        let id = self.next_id;
        self.next_id += 1;
        let rid = format!("probe-{id}");
        let deadline = now + self.cfg.probe_timeout;
        let flight = Flight::new(
            rid.clone(),
            Purpose::PairProbe { prefill, decode },
            "/v1/chat/completions",
            PROBE_BODY.to_vec(),
            now,
            deadline,
        );
        self.flights.insert(id, flight);
        self.by_rid.insert(rid, id);
        self.push_deadline(deadline, id);
        self.pair_probes_in_flight += 1;
        self.dispatch(id);
    }

    /// Sends the flight's first leg: to a unified worker, or to a prefill worker in PD mode.
    fn dispatch(&mut self, id: u64) {
        let Some(f) = self.flights.get_mut(&id) else { return };
        let now = Instant::now();
        if let Some(q) = f.queued_at.take() {
            self.metrics.queue_wait.observe_duration(now - q);
        }
        let purpose = f.purpose;
        let method_get = f.method_get;
        if let Purpose::PairProbe { prefill, .. } = purpose {
            self.open_leg(id, LegKind::Prefill, prefill);
            return;
        }
        let unified = self.has_role(Role::Unified);
        let kind = if unified || method_get { LegKind::Main } else { LegKind::Prefill };
        self.route_leg(id, kind);
    }

    /// Picks a worker for the flight's next leg of `kind` and opens it; answers 503 if none can take it.
    fn route_leg(&mut self, id: u64, kind: LegKind) {
        let Some(f) = self.flights.get(&id) else { return };
        if let Purpose::PairProbe { prefill, decode } = f.purpose {
            let w = if kind == LegKind::Decode { decode } else { prefill };
            if f.refused.contains(&w) {
                let msg = format!("probe worker {w} refused the connection");
                self.fail(id, Outcome::NoCapacity, 503, "no_capacity", msg, Some(1));
            } else {
                self.open_leg(id, kind, w);
            }
            return;
        }
        let role = match kind {
            LegKind::Main if self.has_role(Role::Unified) => Role::Unified,
            LegKind::Main => {
                if self.has_role(Role::Decode) {
                    Role::Decode
                } else {
                    Role::Prefill
                }
            }
            LegKind::Prefill => Role::Prefill,
            LegKind::Decode => Role::Decode,
        };
        let cands = self.candidates(role, &f.refused);
        if cands.is_empty() {
            let total = self.workers.iter().filter(|w| w.role == role).count();
            let up = self.workers.iter().filter(|w| w.role == role && w.routable()).count();
            let msg = format!(
                "no {} worker can take the request ({up} of {total} healthy; {} refused the connection; {} connections per worker at most)",
                role.as_str(),
                f.refused.len(),
                self.cfg.connections_per_worker_max
            );
            self.fail(id, Outcome::NoCapacity, 503, "no_capacity", msg, Some(1));
            return;
        }
        let pick = if kind == LegKind::Decode {
            cands[self.decode_policy.pick(&cands, "")].worker
        } else {
            let i = self.policy.pick(&cands, &f.prompt);
            cands[i].worker
        };
        if kind != LegKind::Decode {
            let prompt = f.prompt.clone();
            self.policy.routed(pick, &prompt);
        }
        self.open_leg(id, kind, pick);
    }

    fn alloc_slot(&mut self) -> usize {
        if let Some(s) = self.ups_free.pop() {
            s
        } else {
            self.ups.push(None);
            self.owners.push(Owner::None);
            self.ups.len() - 1
        }
    }

    /// A connection to `worker`: a pooled idle one, or a new one. `Err((why, refused))` if the pool is
    /// at its bound (`refused` false) or the connect failed at once (`refused` true).
    fn acquire(&mut self, worker: u32) -> Result<usize, (String, bool)> {
        let now = Instant::now();
        let max = self.cfg.connections_per_worker_max;
        let Some(w) = self.workers.get_mut(worker) else { return Err(("worker is gone".into(), false)) };
        if let Some(slot) = w.idle.pop() {
            return Ok(slot);
        }
        if w.connections >= max {
            return Err((format!("all {max} pooled connections to {} are busy", w.url), false));
        }
        let addr = w.addr;
        let slot = self.alloc_slot();
        let limits =
            pdserve_http::Limits { body_bytes_max: self.cfg.upstream_body_bytes_max, ..Default::default() };
        match Upstream::connect(
            addr,
            worker,
            self.server.registry(),
            Server::app_token(slot),
            limits,
            now + self.cfg.connect_timeout,
        ) {
            Ok(up) => {
                self.ups[slot] = Some(up);
                if let Some(w) = self.workers.get_mut(worker) {
                    w.connections += 1;
                }
                Ok(slot)
            }
            Err(e) => {
                self.ups_free.push(slot);
                Err((format!("connect to {addr} failed: {e}"), true))
            }
        }
    }

    fn build_request(&self, f: &Flight, kind: LegKind, worker: u32) -> Vec<u8> {
        let authority = self.workers.get(worker).map_or("", |w| w.authority.as_str());
        let remaining = ms(f.deadline.saturating_duration_since(Instant::now())).max(1);
        let body = if kind == LegKind::Decode { &f.decode_body } else { &f.body };
        let mut out = Vec::with_capacity(body.len() + 256);
        let method = if f.method_get { "GET" } else { "POST" };
        let _ = write!(
            &mut out,
            "{method} {} HTTP/1.1\r\nhost: {authority}\r\nx-request-id: {}\r\nx-request-deadline-ms: {remaining}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
            f.path,
            f.rid,
            body.len()
        );
        out.extend_from_slice(body);
        out
    }

    fn open_leg(&mut self, id: u64, kind: LegKind, worker: u32) {
        let slot = match self.acquire(worker) {
            Ok(s) => s,
            Err((msg, refused)) => {
                // Nothing was sent: another worker may take it.
                if let Some(f) = self.flights.get_mut(&id) {
                    f.refused.push(worker);
                }
                if let Some(w) = self.workers.get_mut(worker) {
                    if refused {
                        w.breaker.request_failed(Instant::now(), msg.clone(), true);
                    }
                }
                self.retry_or_fail(id, kind, msg);
                return;
            }
        };
        let Some(f) = self.flights.get(&id) else {
            self.close_slot(slot);
            return;
        };
        let bytes = self.build_request(f, kind, worker);
        let deadline = f.deadline;
        let now = Instant::now();
        let _ = self.ledger.set_stage(
            &f.rid,
            if kind == LegKind::Prefill { Stage::Prefilling } else { Stage::Decoding },
            now,
        );
        if let Some(w) = self.workers.get(worker) {
            let _ = self.ledger.set_owner(&f.rid, &w.url);
        }
        self.owners[slot] = Owner::Leg { flight: id, kind };
        if let Some(w) = self.workers.get_mut(worker) {
            w.outstanding += 1;
            w.requests_total += 1;
        }
        if let Some(f) = self.flights.get_mut(&id) {
            f.leg = Some((slot, kind, worker));
            if !f.started.contains(&worker) {
                f.started.push(worker);
            }
            if kind == LegKind::Prefill {
                f.prefill_worker = Some(worker);
                f.prefill_sent = Some(now);
            }
            if kind == LegKind::Decode {
                f.decode_worker = Some(worker);
            }
        }
        let Some(up) = self.ups[slot].as_mut() else { return };
        if up.phase != Phase::Connecting {
            up.timer = deadline + Duration::from_secs(1);
        }
        if let Err(e) = up.send(bytes, false) {
            self.upstream_failed(slot, e);
        }
    }

    fn retry_or_fail(&mut self, id: u64, kind: LegKind, why: String) {
        let Some(f) = self.flights.get(&id) else { return };
        let retries = f.refused.len() as u32;
        if retries <= self.cfg.retries_max && Instant::now() < f.deadline {
            self.metrics.retries.inc();
            self.route_leg(id, kind);
        } else {
            let msg = format!("{} connect attempts failed; last: {why}", retries);
            self.fail(id, Outcome::NoCapacity, 503, "no_capacity", msg, Some(1));
        }
    }

    /// Ends a flight with an error answer (or, once a stream has started, an error event and the
    /// terminal chunk).
    fn fail(
        &mut self,
        id: u64,
        outcome: Outcome,
        status: u16,
        kind: &str,
        msg: String,
        retry_after: Option<u32>,
    ) {
        let Some(f) = self.flights.get_mut(&id) else { return };
        if let Some(conn) = f.client {
            if f.purpose == Purpose::HealthGenerate {
                let body = json!({"status": "failed", "reason": msg});
                let resp = health_response(503, &body);
                let _ = self.server.respond(conn, &resp);
            } else if f.streaming {
                let mut frame = Vec::new();
                if !f.tail.ends_with(b"\n\n") && !f.tail.is_empty() {
                    frame.extend_from_slice(b"\n\n");
                }
                if !f.tail.ends_with(b"data: [DONE]\n\n") {
                    let err =
                        ApiError::new(ErrorKind::from_type(kind).unwrap_or(ErrorKind::Internal), msg.clone())
                            .to_json(Some(&f.rid));
                    write_sse_event(&mut frame, &err.to_string());
                    let choice = if f.chat() {
                        json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": "error"})
                    } else {
                        json!({"index": 0, "text": "", "logprobs": null, "finish_reason": "error"})
                    };
                    let last = json!({"id": f.rid, "object": if f.chat() { "chat.completion.chunk" } else { "text_completion" },
                        "created": unix_ms() / 1000, "model": "", "choices": [choice]});
                    write_sse_event(&mut frame, &last.to_string());
                    write_sse_event(&mut frame, pdserve_http::SSE_DONE);
                }
                let _ = self.server.send_chunk(conn, &frame);
                let _ = self.server.end_stream(conn);
            } else if f.head_sent {
                self.server.close(conn);
            } else {
                let resp = error_response(status, kind, msg.clone(), &f.rid, retry_after);
                let _ = self.server.respond(conn, &resp);
            }
            f.client = None;
            self.by_conn.remove(&conn);
        }
        if self.cfg.log_requests || outcome == Outcome::UpstreamFailed {
            eprintln!("router: {} ended: {} {kind}: {msg}", f.rid, status);
        }
        self.finish(id, outcome);
    }

    /// The one place a flight ends: frees its admission slot, its connection, its ledger entry; tells
    /// workers to drop a request that did not end normally; dispatches what the queue holds.
    fn finish(&mut self, id: u64, outcome: Outcome) {
        let Some(mut f) = self.flights.remove(&id) else { return };
        let now = Instant::now();
        self.by_rid.remove(&f.rid);
        if let Some(conn) = f.client.take() {
            self.by_conn.remove(&conn);
            // A client still connected without an answer gets one (a path that forgot to answer is a bug,
            // but the promise is that nobody waits on a silent socket).
            if outcome == Outcome::Cancelled {
                let resp = error_response(499, "cancelled", "the request was aborted".into(), &f.rid, None);
                if f.streaming {
                    let _ = self.server.end_stream(conn);
                } else if !f.head_sent {
                    let _ = self.server.respond(conn, &resp);
                }
            }
        }
        self.ledger.finish(&f.rid);
        if f.queued_at.is_some() {
            self.admission.remove(id);
        }
        if f.admitted {
            self.admission.finished(now);
        }
        let normal = matches!(outcome, Outcome::Ok | Outcome::WorkerError);
        if let Some((slot, _, worker)) = f.leg.take() {
            if let Some(w) = self.workers.get_mut(worker) {
                w.outstanding = w.outstanding.saturating_sub(1);
            }
            // Never pooled: its response was not read to the end.
            self.close_slot(slot);
        }
        if !normal {
            for w in std::mem::take(&mut f.started) {
                self.send_abort(w, &f.rid);
            }
        }
        match f.purpose {
            Purpose::PairProbe { prefill, decode } => {
                self.pair_probes_in_flight -= 1;
                let ok = outcome == Outcome::Ok;
                self.metrics.probes.with(&["pair", if ok { "ok" } else { "failed" }]).map(|c| c.inc()).ok();
                // A failed pair probe withdraws the proof at once (the two workers may each answer
                // their own probes while the link between them is down); the next success restores it.
                for w in [prefill, decode] {
                    if let Some(w) = self.workers.get_mut(w) {
                        w.path_ok = ok.then_some(now);
                    }
                }
            }
            Purpose::Client | Purpose::HealthGenerate => {
                // A request that went through a prefill and a decode worker proves that path as well
                // as a probe does.
                if outcome == Outcome::Ok {
                    if let (Some(p), Some(d)) = (f.prefill_worker, f.decode_worker) {
                        for w in [p, d] {
                            if let Some(w) = self.workers.get_mut(w) {
                                w.path_ok = Some(now);
                            }
                        }
                    }
                }
                self.metrics.finished(outcome);
                self.metrics.latency.observe_duration(now - f.received);
            }
        }
        self.pump_queue();
    }

    fn pump_queue(&mut self) {
        // Not re-entered from a dispatch that fails and finishes: the outer loop keeps going instead,
        // so a burst of failures never deepens the stack.
        if std::mem::replace(&mut self.pumping, true) {
            return;
        }
        while let Some(next) = self.admission.next_dispatch() {
            match self.flights.get_mut(&next) {
                Some(f) => {
                    f.admitted = true;
                    self.dispatch(next);
                }
                None => self.admission.finished(Instant::now()),
            }
        }
        self.pumping = false;
    }

    // ----- upstream I/O --------------------------------------------------------------------------

    fn close_slot(&mut self, slot: usize) {
        if let Some(mut up) = self.ups.get_mut(slot).and_then(Option::take) {
            let _ = self.server.registry().deregister(&mut up.stream);
            if let Some(w) = self.workers.get_mut(up.worker) {
                w.connections = w.connections.saturating_sub(1);
                w.idle.retain(|&s| s != slot);
            }
            self.owners[slot] = Owner::None;
            self.ups_free.push(slot);
        }
    }

    /// Returns a connection whose response ended cleanly to its worker's pool, or closes it.
    fn release_slot(&mut self, slot: usize) {
        let Some(up) = self.ups.get_mut(slot).and_then(Option::as_mut) else { return };
        let keep = up.reusable();
        let worker = up.worker;
        let keep = keep && self.workers.get(worker).is_some_and(|w| !w.draining);
        if keep {
            up.phase = Phase::Idle;
            up.timer = Instant::now() + self.cfg.idle_connection_timeout;
            self.owners[slot] = Owner::None;
            if let Some(w) = self.workers.get_mut(worker) {
                w.idle.push(slot);
            }
        } else {
            self.close_slot(slot);
        }
    }

    fn on_upstream(&mut self, slot: usize, readable: bool, writable: bool, read_closed: bool) {
        let Some(up) = self.ups.get_mut(slot).and_then(Option::as_mut) else { return };
        match up.phase {
            Phase::Connecting => match up.finish_connect() {
                Ok(false) => return,
                Ok(true) => {
                    if let Owner::Leg { flight, .. } = self.owners[slot] {
                        let d = self.flights.get(&flight).map(|f| f.deadline);
                        if let (Some(d), Some(up)) = (d, self.ups[slot].as_mut()) {
                            up.timer = d + Duration::from_secs(1);
                        }
                    }
                }
                Err(e) => return self.upstream_failed(slot, e),
            },
            Phase::Idle => {
                if readable {
                    let mut buf = [0u8; 64];
                    if up.idle_is_dead(&mut buf) {
                        self.close_slot(slot);
                    }
                }
                return;
            }
            Phase::Busy => {
                if writable {
                    if let Err(e) = up.flush() {
                        return self.upstream_failed(slot, e);
                    }
                }
            }
        }
        if !readable {
            return;
        }
        let mut events = std::mem::take(&mut self.resp_events);
        let mut buf = std::mem::take(&mut self.read_buf);
        let result = match self.ups[slot].as_mut() {
            Some(up) => up.read(&mut buf, &mut events, read_closed),
            None => Ok(()),
        };
        self.read_buf = buf;
        for ev in events.drain(..) {
            if self.ups[slot].is_none() {
                break;
            }
            self.on_response_event(slot, ev);
        }
        self.resp_events = events;
        if let Err(e) = result {
            if self.ups[slot].is_some() {
                self.upstream_failed(slot, e);
            }
        }
    }

    fn upstream_failed(&mut self, slot: usize, err: UpError) {
        let owner = self.owners[slot];
        let worker = self.ups[slot].as_ref().map(|u| u.worker);
        let stale = self.ups[slot].as_ref().is_some_and(Upstream::stale);
        self.close_slot(slot);
        let Some(worker) = worker else { return };
        let now = Instant::now();
        let connect = matches!(err, UpError::Connect(_));
        let url = self.workers.get(worker).map(|w| w.url.clone()).unwrap_or_default();
        match owner {
            Owner::None | Owner::Abort => {}
            Owner::Probe { .. } => {
                self.metrics.probes.with(&["worker", "failed"]).map(|c| c.inc()).ok();
                if let Some(w) = self.workers.get_mut(worker) {
                    w.probing = false;
                    w.breaker.probe_failed(now, format!("probe: {err}"));
                }
            }
            Owner::Collect { id, .. } => {
                self.collect_done(id, json!({"url": url, "error": err.to_string()}), None)
            }
            Owner::Leg { flight, kind } => {
                let stale_retry =
                    !connect && stale && self.flights.get(&flight).is_some_and(|f| !f.stale_retried);
                if let Some(w) = self.workers.get_mut(worker) {
                    w.outstanding = w.outstanding.saturating_sub(1);
                    // A pooled connection the worker had closed says nothing about its health.
                    if !stale_retry {
                        w.breaker.request_failed(now, err.to_string(), connect);
                    }
                }
                let Some(f) = self.flights.get_mut(&flight) else { return };
                f.leg = None;
                if stale_retry {
                    // Nothing came back on a connection the worker had closed while idle: it never
                    // took the request, so the leg goes out again on a fresh connection. The
                    // worker's other idle connections are as old as this one: close them too.
                    f.stale_retried = true;
                    f.started.retain(|&w| w != worker);
                    let idle = self.workers.get(worker).map(|w| w.idle.clone()).unwrap_or_default();
                    for s in idle {
                        self.close_slot(s);
                    }
                    self.metrics.stale_retries.inc();
                    self.route_leg(flight, kind);
                } else if connect {
                    f.started.retain(|&w| w != worker);
                    f.refused.push(worker);
                    self.retry_or_fail(flight, kind, format!("{url}: {err}"));
                } else {
                    let leg = match kind {
                        LegKind::Prefill => "prefill worker",
                        LegKind::Decode => "decode worker",
                        LegKind::Main => "worker",
                    };
                    let msg = format!("{leg} {url} failed: {err}");
                    self.fail(flight, Outcome::UpstreamFailed, 502, "upstream_failed", msg, None);
                }
            }
        }
    }

    fn on_response_event(&mut self, slot: usize, ev: ResponseEvent) {
        match self.owners[slot] {
            Owner::None => {}
            Owner::Abort => {
                if ev == ResponseEvent::End {
                    self.release_slot(slot);
                }
            }
            Owner::Probe { worker } => self.on_probe_event(slot, worker, ev),
            Owner::Collect { id, worker } => self.on_collect_event(slot, id, worker, ev),
            Owner::Leg { flight, kind } => self.on_leg_event(slot, flight, kind, ev),
        }
    }

    fn on_leg_event(&mut self, slot: usize, id: u64, kind: LegKind, ev: ResponseEvent) {
        let Some(f) = self.flights.get_mut(&id) else {
            self.close_slot(slot);
            return;
        };
        match ev {
            ResponseEvent::Head(head) => {
                f.status = head.status;
                f.content_type = head.header_str("content-type").map(str::to_owned);
                let sse = f.content_type.as_deref().is_some_and(|c| c.starts_with("text/event-stream"));
                if kind != LegKind::Prefill && head.status == 200 && sse && f.purpose == Purpose::Client {
                    if let Some(conn) = f.client {
                        let headers = [
                            ("content-type", "text/event-stream"),
                            ("cache-control", "no-cache"),
                            ("x-request-id", f.rid.as_str()),
                        ];
                        let _ = self.server.start_stream(conn, 200, &headers);
                        f.head_sent = true;
                        f.streaming = true;
                        self.metrics.ttfb.observe_duration(f.received.elapsed());
                        let _ = self.ledger.set_stage(&f.rid, Stage::Streaming, Instant::now());
                    }
                }
            }
            ResponseEvent::Data(data) => {
                if f.streaming {
                    let Some(conn) = f.client else { return };
                    let tail_from = data.len().saturating_sub(16);
                    f.tail.clear();
                    f.tail.extend_from_slice(&data[tail_from..]);
                    if let Err(e) = self.server.send_chunk(conn, &data) {
                        let msg = format!("client stopped reading: {e}");
                        if self.cfg.log_requests {
                            eprintln!("router: {}: {msg}", f.rid);
                        }
                        self.server.close(conn);
                        f.client = None;
                        self.by_conn.remove(&conn);
                        self.finish(id, Outcome::Cancelled);
                    }
                } else if f.resp_body.len() + data.len() > self.cfg.upstream_body_bytes_max {
                    let msg = format!("worker's answer is over {} bytes", self.cfg.upstream_body_bytes_max);
                    self.fail(id, Outcome::UpstreamFailed, 502, "upstream_failed", msg, None);
                } else {
                    f.resp_body.extend_from_slice(&data);
                }
            }
            ResponseEvent::End => {
                let worker = f.leg.map(|l| l.2);
                f.leg = None;
                if let Some(w) = worker.and_then(|w| self.workers.get_mut(w)) {
                    w.outstanding = w.outstanding.saturating_sub(1);
                    w.breaker.request_ok();
                }
                self.release_slot(slot);
                match kind {
                    LegKind::Prefill => self.on_prefilled(id),
                    LegKind::Main | LegKind::Decode => self.on_answered(id),
                }
            }
        }
    }

    /// The prefill leg ended: an error goes to the client at once; a KV handle starts the decode leg.
    fn on_prefilled(&mut self, id: u64) {
        let Some(f) = self.flights.get_mut(&id) else { return };
        if let Some(t) = f.prefill_sent {
            self.metrics.prefill_leg.observe_duration(t.elapsed());
        }
        if f.status != 200 {
            // The worker's own error, in the shape of api.md: forwarded as is, no decode leg.
            return self.on_answered(id);
        }
        let body = std::mem::take(&mut f.resp_body);
        let Some(handle) = pd_handle(&body) else {
            let msg = "prefill worker answered 200 without a `pd_transfer` handle".to_owned();
            return self.fail(id, Outcome::UpstreamFailed, 502, "upstream_failed", msg, None);
        };
        let Some(decode_body) = with_pd_transfer(&f.body, &handle) else {
            return self.fail(
                id,
                Outcome::Invalid,
                400,
                "invalid_request",
                "body is not a JSON object".into(),
                None,
            );
        };
        f.decode_body = decode_body;
        f.status = 0;
        f.content_type = None;
        f.refused.clear();
        f.stale_retried = false;
        let _ = self.ledger.set_stage(&f.rid, Stage::KvHeld, Instant::now());
        self.route_leg(id, LegKind::Decode);
    }

    /// The final leg's response ended: answer the client (the stream is already flowing).
    fn on_answered(&mut self, id: u64) {
        let Some(f) = self.flights.get_mut(&id) else { return };
        let outcome = if (200..300).contains(&f.status) { Outcome::Ok } else { Outcome::WorkerError };
        if let Some(conn) = f.client {
            if f.streaming {
                let _ = self.server.end_stream(conn);
            } else if f.purpose == Purpose::HealthGenerate {
                let (status, body) = if f.status == 200 {
                    (200, json!({"status": "ok", "latency_ms": ms(f.received.elapsed())}))
                } else {
                    (
                        503,
                        json!({"status": "failed", "reason": format!("worker answered {}: {}", f.status, String::from_utf8_lossy(&f.resp_body))}),
                    )
                };
                let _ = self.server.respond(conn, &health_response(status, &body));
            } else {
                let mut resp = pdserve_http::Response::new(f.status)
                    .header("content-type", f.content_type.as_deref().unwrap_or("application/json"))
                    .header("x-request-id", &f.rid)
                    .body(std::mem::take(&mut f.resp_body));
                if f.status == 429 || f.status == 503 {
                    resp = resp.header("retry-after", "1");
                }
                let _ = self.server.respond(conn, &resp);
                self.metrics.ttfb.observe_duration(f.received.elapsed());
            }
            self.by_conn.remove(&conn);
            f.client = None;
        }
        self.finish(id, outcome);
    }

    // ----- health probes -------------------------------------------------------------------------

    fn run_probes(&mut self, now: Instant) {
        self.next_probe = now + self.cfg.probe_interval;
        self.probe_round += 1;
        for wid in self.workers.ids() {
            let Some(w) = self.workers.get(wid) else { continue };
            if w.probing {
                continue; // the last one is still out; its own deadline ends it
            }
            let path = if w.role == Role::Unified { "/health/generate" } else { "/health/ready" };
            let authority = w.authority.clone();
            let slot = match self.acquire(wid) {
                Ok(s) => s,
                Err((msg, refused)) => {
                    if let Some(w) = self.workers.get_mut(wid) {
                        if refused {
                            w.breaker.probe_failed(now, msg);
                        }
                    }
                    continue;
                }
            };
            if let Some(w) = self.workers.get_mut(wid) {
                w.probing = true;
            }
            let req = format!(
                "GET {path} HTTP/1.1\r\nhost: {authority}\r\nx-request-id: probe-{}-{wid}\r\n\r\n",
                self.probe_round
            );
            self.owners[slot] = Owner::Probe { worker: wid };
            if let Some(up) = self.ups[slot].as_mut() {
                up.timer = now + self.cfg.probe_timeout;
                if let Err(e) = up.send(req.into_bytes(), false) {
                    self.upstream_failed(slot, e);
                }
            }
        }
        // Pair probes through healthy prefill and decode workers: each prefill worker with some decode
        // worker and each decode worker with some prefill worker, rotating over rounds.
        if self.pair_probes_in_flight > 0 || now < self.next_pair_probe {
            return;
        }
        self.next_pair_probe = now + self.cfg.pair_probe_interval;
        let ids = |role: Role| -> Vec<u32> {
            self.workers.iter().filter(|w| w.role == role && w.routable()).map(|w| w.id).collect()
        };
        let (prefills, decodes) = (ids(Role::Prefill), ids(Role::Decode));
        if prefills.is_empty() || decodes.is_empty() {
            return;
        }
        for j in 0..prefills.len().max(decodes.len()) {
            let p = prefills[(j + self.probe_round) % prefills.len()];
            let d = decodes[j % decodes.len()];
            self.start_pair_probe(p, d);
        }
    }

    fn on_probe_event(&mut self, slot: usize, worker: u32, ev: ResponseEvent) {
        let status = match ev {
            ResponseEvent::Head(h) => {
                if let Some(up) = self.ups[slot].as_mut() {
                    up.status = h.status;
                }
                return;
            }
            ResponseEvent::Data(_) => return,
            ResponseEvent::End => self.ups[slot].as_ref().is_some_and(|u| u.status == 200),
        };
        let code = self.ups[slot].as_ref().map_or(0, |u| u.status);
        if let Some(w) = self.workers.get_mut(worker) {
            w.probing = false;
        }
        self.release_slot(slot);
        let now = Instant::now();
        self.metrics.probes.with(&["worker", if status { "ok" } else { "failed" }]).map(|c| c.inc()).ok();
        if let Some(w) = self.workers.get_mut(worker) {
            if status {
                w.breaker.probe_ok(now);
            } else {
                w.breaker.probe_not_ready(now, format!("probe answered {}", code));
            }
        }
    }

    fn send_abort(&mut self, worker: u32, rid: &str) {
        let Ok(slot) = self.acquire(worker) else { return };
        let authority = self.workers.get(worker).map(|w| w.authority.clone()).unwrap_or_default();
        let req = format!("POST /abort/{rid} HTTP/1.1\r\nhost: {authority}\r\nx-request-id: {rid}\r\ncontent-length: 0\r\n\r\n");
        self.owners[slot] = Owner::Abort;
        self.metrics.aborts_sent.inc();
        if let Some(up) = self.ups[slot].as_mut() {
            up.timer = Instant::now() + Duration::from_secs(2);
            if let Err(e) = up.send(req.into_bytes(), false) {
                self.upstream_failed(slot, e);
            }
        }
    }

    // ----- /debug/requests -----------------------------------------------------------------------

    fn start_collect(&mut self, conn: ConnId, req: &Request) {
        let older_than = req
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("older_than_ms=")))
            .and_then(|v| v.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        let id = self.next_id;
        self.next_id += 1;
        let now = Instant::now();
        let mut c = Collect {
            conn,
            older_than,
            pending: 0,
            deadline: now + self.cfg.debug_fanout_timeout,
            hops: Vec::new(),
            workers: Vec::new(),
            raw: HashMap::new(),
        };
        let ids = self.workers.ids();
        let mut slots = Vec::new();
        for wid in ids {
            let Some(w) = self.workers.get(wid) else { continue };
            let (authority, url) = (w.authority.clone(), w.url.clone());
            match self.acquire(wid) {
                Ok(slot) => {
                    let req = format!("GET /debug/requests HTTP/1.1\r\nhost: {authority}\r\n\r\n");
                    self.owners[slot] = Owner::Collect { id, worker: wid };
                    if let Some(up) = self.ups[slot].as_mut() {
                        up.timer = c.deadline;
                        slots.push((slot, req));
                    }
                    c.pending += 1;
                }
                Err((e, _)) => c.workers.push(json!({"url": url, "error": e})),
            }
        }
        self.collects.insert(id, c);
        for (slot, req) in slots {
            if let Some(up) = self.ups[slot].as_mut() {
                if let Err(e) = up.send(req.into_bytes(), false) {
                    self.upstream_failed(slot, e);
                }
            }
        }
        self.collect_maybe_done(id, false);
    }

    fn on_collect_event(&mut self, slot: usize, id: u64, worker: u32, ev: ResponseEvent) {
        match ev {
            ResponseEvent::Head(_) => {}
            ResponseEvent::Data(d) => {
                if let Some(c) = self.collects.get_mut(&id) {
                    c.raw.entry(worker).or_default().extend_from_slice(&d);
                }
            }
            ResponseEvent::End => {
                self.release_slot(slot);
                let url = self.workers.get(worker).map(|w| w.url.clone()).unwrap_or_default();
                let raw = self.collects.get_mut(&id).and_then(|c| c.raw.remove(&worker)).unwrap_or_default();
                match serde_json::from_slice::<serde_json::Value>(&raw) {
                    Ok(v) => self.collect_done(
                        id,
                        json!({"url": url, "process": v["process"], "ok": true}),
                        Some((url, v)),
                    ),
                    Err(_) => self.collect_done(
                        id,
                        json!({"url": url, "error": "unreadable /debug/requests answer"}),
                        None,
                    ),
                }
            }
        }
    }

    fn collect_done(
        &mut self,
        id: u64,
        worker: serde_json::Value,
        answer: Option<(String, serde_json::Value)>,
    ) {
        let Some(c) = self.collects.get_mut(&id) else { return };
        c.pending = c.pending.saturating_sub(1);
        c.workers.push(worker);
        if let Some((url, v)) = answer {
            if let Some(reqs) = v["requests"].as_array() {
                for r in reqs {
                    let mut r = r.clone();
                    r["process"] = v["process"].clone();
                    r["worker"] = json!(url);
                    c.hops.push(r);
                }
            }
        }
        self.collect_maybe_done(id, false);
    }

    fn collect_maybe_done(&mut self, id: u64, timed_out: bool) {
        let Some(c) = self.collects.get(&id) else { return };
        if c.pending > 0 && !timed_out {
            return;
        }
        let Some(c) = self.collects.remove(&id) else { return };
        let now = Instant::now();
        let mut body = self.ledger.debug_json(now, unix_ms(), c.older_than);
        if let Some(reqs) = body["requests"].as_array_mut() {
            for r in reqs.iter_mut() {
                let rid = r["id"].as_str().unwrap_or("").to_owned();
                let hops: Vec<_> =
                    c.hops.iter().filter(|h| h["id"].as_str() == Some(&rid)).cloned().collect();
                r["hops"] = json!(hops);
            }
        }
        let mut workers = c.workers;
        if timed_out {
            workers.push(json!({"error": format!("{} workers did not answer within {} ms", c.pending, ms(self.cfg.debug_fanout_timeout))}));
        }
        body["workers"] = json!(workers);
        let resp = pdserve_http::Response::json(200, body.to_string());
        let _ = self.server.respond(c.conn, &resp);
    }

    // ----- timers --------------------------------------------------------------------------------

    fn timers(&mut self, now: Instant) {
        while let Some(&Reverse((d, id))) = self.deadlines.peek() {
            if d > now {
                break;
            }
            self.deadlines.pop();
            let Some(f) = self.flights.get(&id) else { continue };
            if f.deadline != d {
                continue;
            }
            let stage = self.ledger.get(&f.rid).map_or("unknown", |e| e.stage.as_str());
            let msg = format!(
                "deadline of {} ms passed at stage {stage} (worker: {})",
                ms(f.deadline - f.received),
                f.leg.and_then(|l| self.workers.get(l.2)).map_or("none", |w| w.url.as_str())
            );
            self.fail(id, Outcome::DeadlineExceeded, 504, "deadline_exceeded", msg, None);
        }
        let mut expired = Vec::new();
        self.admission.expired(now, &mut expired);
        for id in expired {
            if let Some(f) = self.flights.get_mut(&id) {
                f.queued_at = None;
            }
            let msg = format!(
                "waited {} ms in the router queue without a dispatch slot ({} in flight, limit {})",
                ms(self.cfg.admission.queue_timeout),
                self.admission.in_flight(),
                self.cfg.admission.in_flight_max
            );
            let retry = self.admission.retry_after_s(now);
            self.fail(id, Outcome::QueueFull, 429, "queue_full", msg, Some(retry));
        }
        if now >= self.next_probe {
            self.run_probes(now);
        }
        if now >= self.next_sweep {
            self.next_sweep = now + Duration::from_millis(50);
            self.sweep_connections(now);
            let timed_out: Vec<u64> =
                self.collects.iter().filter(|(_, c)| c.deadline <= now).map(|(&id, _)| id).collect();
            for id in timed_out {
                self.collect_maybe_done(id, true);
            }
            self.sweep_workers();
        }
    }

    /// Connections past their timer: connects that took too long, probes and aborts with no answer,
    /// idle connections past the pool's idle timeout.
    fn sweep_connections(&mut self, now: Instant) {
        for slot in 0..self.ups.len() {
            let Some(up) = self.ups[slot].as_ref() else { continue };
            if up.timer > now {
                continue;
            }
            match up.phase {
                Phase::Idle => self.close_slot(slot),
                Phase::Connecting => {
                    let e = io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no connection within {} ms", ms(self.cfg.connect_timeout)),
                    );
                    self.upstream_failed(slot, UpError::Connect(e));
                }
                Phase::Busy => {
                    let e = io::Error::new(io::ErrorKind::TimedOut, "no answer before the deadline");
                    self.upstream_failed(slot, UpError::Io(e));
                }
            }
        }
    }

    /// Removes drained workers.
    fn sweep_workers(&mut self) {
        let done: Vec<u32> =
            self.workers.iter().filter(|w| w.draining && w.outstanding == 0).map(|w| w.id).collect();
        for id in done {
            let idle = self.workers.get(id).map(|w| w.idle.clone()).unwrap_or_default();
            for slot in idle {
                self.close_slot(slot);
            }
            // Connections still owned by probes or aborts finish on their own timers.
            if let Some(w) = self.workers.remove(id) {
                w.in_flight_gauge.set(0.0);
                w.connections_gauge.set(0.0);
            }
        }
    }

    fn refresh_gauges(&self) {
        self.metrics.in_flight.set(self.admission.in_flight() as f64);
        self.metrics.queued.set(self.admission.queued() as f64);
        self.metrics.client_connections.set(self.server.connection_count() as f64);
        for role in [Role::Unified, Role::Prefill, Role::Decode] {
            for state in ["up", "down", "draining"] {
                let n = self.workers.iter().filter(|w| w.role == role && w.state_str() == state).count();
                if let Ok(g) = self.metrics.workers_up.with(&[role.as_str(), state]) {
                    g.set(n as f64);
                }
            }
        }
        for w in self.workers.iter() {
            w.in_flight_gauge.set(f64::from(w.outstanding));
            w.connections_gauge.set(w.connections as f64);
        }
    }

    /// Counts for tests and `/debug`: flights, upstream connections open, idle.
    pub fn counts(&self) -> (usize, usize) {
        (self.flights.len(), self.ups.iter().flatten().count())
    }
}

#[cfg(test)]
mod tests {
    use super::key_matches;

    #[test]
    fn keys() {
        assert!(key_matches(Some("Bearer s3cret"), "s3cret"));
        assert!(!key_matches(Some("Bearer s3cre"), "s3cret"));
        assert!(!key_matches(Some("Bearer s3cretx"), "s3cret"));
        assert!(!key_matches(Some("s3cret"), "s3cret"));
        assert!(!key_matches(None, "s3cret"));
    }
}
