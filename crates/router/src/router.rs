//! The router's mio shell: one thread holding the client connections (through
//! [`pdserve_http::Server`]) and every upstream connection to workers, the clock and the timers. Each
//! request's decisions are its [`Flight`]'s; the shell feeds flights what happens on their sockets and
//! carries out what they ask ([`Router::drive`]). The admin API is in `admin.rs`, health probes in
//! `probes.rs`, the `/debug/requests` join in `debug.rs`.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdserve_api::{header, path, ApiError, ErrorKind};
use pdserve_codec::Endpoint;
use pdserve_http::{
    write_request_head, ConnId, Event, HttpError, Request, ResponseEvent, Server, UpstreamPhase,
};
use pdserve_telemetry::RequestLedger;

use crate::admission::Admission;
use crate::config::RouterConfig;
use crate::debug::{Collect, Collecting};
use crate::flight::{Flight, LegFailure, LegId, LegKind, Purpose};
use crate::metrics::Metrics;
use crate::upstream::{AcquireError, Owner, Upstreams};
use crate::workers::Workers;
use crate::{Choice, Policy};

/// How often the loop looks at timers when nothing else wakes it.
const TICK: Duration = Duration::from_millis(10);
/// How long a finished drain waits for the last answers' bytes to reach their clients.
const FLUSH_MAX: Duration = Duration::from_secs(5);
/// Requests the router's ledger tracks at once (client requests are bounded far below by admission).
const LEDGER_CAPACITY: usize = 1 << 16;
/// The router's own 2-token requests (pair probes, `/health/generate`): first in the workers'
/// queues (vLLM's `priority`, lower first), as in the router's, so they prove the path serves tokens,
/// not how long its queue is.
pub(crate) const PROBE_BODY: &[u8] =
    br#"{"messages":[{"role":"user","content":"Hi"}],"max_tokens":2,"temperature":0,"priority":-1000000}"#;

/// A flight and what the shell keeps beside it.
#[derive(Debug)]
pub(crate) struct Entry {
    pub flight: Flight,
    pub conn: Option<ConnId>,
    /// The open leg's connection.
    pub slot: Option<usize>,
    /// Holds an admission slot.
    pub admitted: bool,
    pub queued_at: Option<Instant>,
    /// Why each leg went to its worker (for `/debug/requests`), in the order the legs were sent.
    pub routing: Vec<(LegKind, Choice)>,
    /// A Responses request whose answer is kept (`crate::responses`).
    pub storing: Option<Box<crate::responses::Storing>>,
    /// Its spans so far (`--otlp-traces-endpoint`).
    pub trace: Option<crate::trace::FlightTrace>,
    /// Without an exporter: the client's `traceparent` (when valid), passed on unchanged on every leg
    /// so the workers' spans still join the client's trace (the router then takes no part in it).
    pub passthrough: Option<String>,
    /// Its prompt's blocks, for routing on the workers' KV events (`--tokenizer`).
    pub kv_prompt: Option<crate::kv_listen::KvPrompt>,
}

/// The router. Build with [`Router::bind`], run with [`Router::run`].
#[derive(Debug)]
pub struct Router {
    pub(crate) cfg: RouterConfig,
    pub(crate) server: Server,
    pub(crate) workers: Workers,
    pub(crate) ups: Upstreams,
    pub(crate) flights: HashMap<u64, Entry>,
    pub(crate) by_conn: HashMap<ConnId, u64>,
    pub(crate) by_rid: HashMap<String, u64>,
    pub(crate) admission: Admission,
    pub(crate) deadlines: BinaryHeap<Reverse<(Instant, u64)>>,
    pub(crate) policy: Box<dyn Policy>,
    /// Decode legs are placed by their own policy (the same kind), so a conversation's next round
    /// finds the decode worker that kept its KV.
    pub(crate) decode_policy: Box<dyn Policy>,
    pub(crate) ledger: RequestLedger,
    pub(crate) metrics: Metrics,
    pub(crate) next_id: u64,
    pub(crate) collects: HashMap<u64, Collect>,
    /// Answered Responses requests, for `previous_response_id` through this router.
    pub(crate) responses: pdserve_codec::responses::ResponseStore,
    pub(crate) next_probe: Instant,
    pub(crate) next_pair_probe: Instant,
    pub(crate) probe_round: usize,
    pub(crate) pair_probes_in_flight: usize,
    next_sweep: Instant,
    pub(crate) pumping: bool,
    read_buf: Vec<u8>,
    resp_events: Vec<ResponseEvent>,
    stop: Arc<AtomicBool>,
    /// Set to drain: no new requests (503), the ones in flight finish, then `run` returns.
    drain: Arc<AtomicBool>,
    pub(crate) draining_since: Option<Instant>,
    /// Answers of the `--discover` lookup thread.
    discovery: Option<std::sync::mpsc::Receiver<crate::discovery::Resolved>>,
    /// `--discover` sources whose last lookup failed (logged once per outage).
    pub(crate) discovery_failing: std::collections::HashSet<usize>,
    /// Exports spans (`--otlp-traces-endpoint`).
    pub(crate) traces: Option<pdserve_trace::Exporter>,
    /// Precise prefix routing on the workers' KV events (`--tokenizer`).
    pub(crate) kv: Option<crate::kv_listen::KvRouting>,
}

pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}

pub(crate) fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl Router {
    /// Binds the client port and registers the configured workers (their health is probed at once).
    pub fn bind(cfg: RouterConfig) -> io::Result<Router> {
        let server = Server::bind(cfg.listen, cfg.server)?;
        let now = Instant::now();
        let metrics = Metrics::new().map_err(io::Error::other)?;
        let mut r = Router {
            server,
            workers: Workers::default(),
            ups: Upstreams::default(),
            flights: HashMap::new(),
            by_conn: HashMap::new(),
            by_rid: HashMap::new(),
            admission: Admission::new(cfg.admission, now),
            deadlines: BinaryHeap::new(),
            policy: cfg.policy.build(),
            decode_policy: cfg.policy.build(),
            ledger: RequestLedger::new(&cfg.process_name, LEDGER_CAPACITY),
            metrics,
            next_id: 1,
            collects: HashMap::new(),
            responses: pdserve_codec::responses::ResponseStore::new(
                cfg.responses_max,
                cfg.responses_max_bytes,
                cfg.responses_max_age,
            ),
            next_probe: now,
            next_pair_probe: now,
            probe_round: 0,
            pair_probes_in_flight: 0,
            next_sweep: now,
            pumping: false,
            read_buf: vec![0; 64 * 1024],
            resp_events: Vec::new(),
            stop: Arc::new(AtomicBool::new(false)),
            drain: Arc::new(AtomicBool::new(false)),
            draining_since: None,
            discovery: None,
            discovery_failing: Default::default(),
            traces: match &cfg.otlp_traces_endpoint {
                Some(e) => Some(pdserve_trace::Exporter::start(e.clone(), "pdserve-router")?),
                None => None,
            },
            kv: match &cfg.tokenizer {
                Some(dir) => Some(crate::kv_listen::KvRouting::load(dir).map_err(io::Error::other)?),
                None => None,
            },
            cfg,
        };
        for spec in r.cfg.workers.clone() {
            r.add_worker(&spec.url, spec.role, now).map_err(io::Error::other)?;
        }
        if !r.cfg.discover.is_empty() {
            let conf = r.cfg.resolver.clone().unwrap_or_else(crate::discovery::ResolverConf::system);
            let (specs, every, stop) = (r.cfg.discover.clone(), r.cfg.discover_interval, r.stop_flag());
            r.discovery = Some(crate::discovery::spawn(specs, conf, every, stop)?);
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

    /// A flag that drains the router (what SIGTERM does to `pdserve-router`): `/health/ready` turns
    /// 503 and new requests get a 503 with `Retry-After`, the requests in flight run to their end,
    /// and [`run`](Self::run) returns once none is left, or after
    /// [`drain_timeout`](RouterConfig::drain_timeout), when those left end with an explicit error.
    pub fn drain_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.drain)
    }

    /// Runs the loop until the stop flag is set or a drain has finished.
    pub fn run(&mut self) -> io::Result<()> {
        let mut events = Vec::new();
        while !self.stop.load(Ordering::Relaxed) {
            if self.drain.load(Ordering::Relaxed) && self.drained(Instant::now()) {
                // The last answers go out to their clients (a client too slow to take them within
                // FLUSH_MAX is cut: the drain has its bound).
                let until = Instant::now() + FLUSH_MAX;
                while Instant::now() < until && self.server.unsent_total() > 0 {
                    self.server.poll(&mut events, Some(Duration::from_millis(20)))?;
                    events.clear();
                }
                return Ok(());
            }
            let now = Instant::now();
            let mut timeout = TICK;
            if let Some(Reverse((d, _))) = self.deadlines.peek() {
                timeout = timeout.min(d.saturating_duration_since(now));
            }
            self.server.poll(&mut events, Some(timeout))?;
            for ev in events.drain(..) {
                let now = Instant::now();
                match ev {
                    Event::Request { conn, request } => self.handle_request(conn, request, now),
                    Event::Disconnected { conn, .. } => {
                        if let Some(id) = self.by_conn.remove(&conn) {
                            if let Some(e) = self.flights.get_mut(&id) {
                                e.conn = None;
                                e.flight.handle_cancel(true);
                            }
                            self.drive(id, now);
                        }
                        self.collects.retain(|_, c| c.conn != conn);
                    }
                    Event::Io { token, readable, writable, read_closed } => {
                        self.on_upstream(token, readable, writable, read_closed, now)
                    }
                }
            }
            self.timers(Instant::now());
        }
        Ok(())
    }

    /// One turn of a drain; true once nothing is left in flight.
    fn drained(&mut self, now: Instant) -> bool {
        let since = *self.draining_since.get_or_insert_with(|| {
            eprintln!("router: draining {} requests in flight", self.flights.len());
            now
        });
        if now.saturating_duration_since(since) >= self.cfg.drain_timeout {
            let left: Vec<u64> = self.flights.keys().copied().collect();
            for id in left {
                if let Some(e) = self.flights.get_mut(&id) {
                    let msg = format!(
                        "the router shut down before the request finished (drain timeout {} ms)",
                        ms(self.cfg.drain_timeout)
                    );
                    e.flight.handle_rejected(ApiError::new(ErrorKind::NotReady, msg).with_retry_after(1));
                }
                self.drive(id, now);
            }
        }
        // The aborts of requests that ended still reach their workers (each is bounded by its timer).
        self.flights.is_empty() && self.ups.aborts_pending() == 0
    }

    /// Counts for tests: flights in progress, upstream connections open.
    pub fn counts(&self) -> (usize, usize) {
        (self.flights.len(), self.ups.count())
    }

    pub(crate) fn new_id(&mut self) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        id
    }

    pub(crate) fn respond(&mut self, conn: ConnId, resp: &pdserve_http::Response) {
        let _ = self.server.respond(conn, resp);
    }

    /// `POST /abort/{id}` to `worker`; the answer is read and dropped.
    pub(crate) fn send_abort(&mut self, worker: u32, rid: &str, now: Instant) {
        let Some(authority) = self.workers.get(worker).map(|w| w.authority.clone()) else { return };
        let mut req = Vec::with_capacity(128);
        let mut headers = vec![("host", authority.as_str()), (header::REQUEST_ID, rid)];
        headers.extend(self.cfg.cluster_secret.as_deref().map(|s| (header::CLUSTER_SECRET, s)));
        write_request_head(&mut req, "POST", &format!("/abort/{rid}"), &headers, 0);
        if self.send_aside(worker, Owner::Abort, req, now + Duration::from_secs(2), now).is_ok() {
            self.metrics.aborts_sent.inc();
        }
    }

    /// Sends `request` (wire bytes) to `worker` for `owner` (a probe, an abort, a `/debug/requests`
    /// fan-out) on a pooled connection or a new one, its answer due by `timer`. A failure after this
    /// returns `Ok` reaches the owner through `upstream_failed`.
    pub(crate) fn send_aside(
        &mut self,
        worker: u32,
        owner: Owner,
        request: Vec<u8>,
        timer: Instant,
        now: Instant,
    ) -> Result<(), AcquireError> {
        let slot = self.ups.acquire(
            &mut self.workers,
            worker,
            &self.server,
            pdserve_http::Limits::default(),
            now + self.cfg.connect_timeout,
            self.cfg.connections_per_worker_max,
        )?;
        self.ups.set_owner(slot, owner);
        if let Some(up) = self.ups.get_mut(slot) {
            up.timer = timer;
            if let Err(e) = up.send(request, false) {
                self.upstream_failed(slot, e, now);
            }
        }
        Ok(())
    }

    // ----- upstream I/O --------------------------------------------------------------------------

    fn on_upstream(&mut self, slot: usize, readable: bool, writable: bool, read_closed: bool, now: Instant) {
        let Some(up) = self.ups.get_mut(slot) else { return };
        match up.phase {
            UpstreamPhase::Connecting => match up.finish_connect() {
                Ok(false) => return,
                Ok(true) => {
                    if let Owner::Leg { flight, .. } = self.ups.owner(slot) {
                        let d = self.flights.get(&flight).map(|e| e.flight.deadline());
                        if let (Some(d), Some(up)) = (d, self.ups.get_mut(slot)) {
                            up.timer = d + Duration::from_secs(1);
                        }
                    }
                }
                Err(e) => return self.upstream_failed(slot, e, now),
            },
            UpstreamPhase::Idle => {
                if readable {
                    let mut buf = [0u8; 64];
                    if up.idle_is_dead(&mut buf) {
                        self.ups.close(slot, self.server.registry(), &mut self.workers);
                    }
                }
                return;
            }
            UpstreamPhase::Busy => {
                if writable {
                    if let Err(e) = up.flush() {
                        return self.upstream_failed(slot, e, now);
                    }
                }
            }
        }
        if !readable {
            return;
        }
        let mut events = std::mem::take(&mut self.resp_events);
        let mut buf = std::mem::take(&mut self.read_buf);
        let result = match self.ups.get_mut(slot) {
            Some(up) => up.read(&mut buf, &mut events, read_closed),
            None => Ok(()),
        };
        self.read_buf = buf;
        for ev in events.drain(..) {
            if self.ups.get(slot).is_none() {
                break;
            }
            self.on_response_event(slot, ev, now);
        }
        self.resp_events = events;
        if let Err(e) = result {
            if self.ups.get(slot).is_some() {
                self.upstream_failed(slot, e, now);
            }
        }
    }

    pub(crate) fn upstream_failed(&mut self, slot: usize, err: HttpError, now: Instant) {
        let owner = self.ups.owner(slot);
        let Some(up) = self.ups.get_mut(slot) else { return };
        let (worker, stale, timer) = (up.worker, up.stale(&err), up.timer);
        let request = if stale { up.take_request() } else { Vec::new() };
        self.ups.close(slot, self.server.registry(), &mut self.workers);
        if stale {
            // The worker closed this pooled connection while it was idle (a restart, its keep-alive
            // timeout) and never saw the request; its other idle connections are as old.
            self.ups.close_idle(worker, self.server.registry(), &mut self.workers);
            if !matches!(owner, Owner::Leg { .. } | Owner::None) {
                // A probe, abort or fan-out goes out again on a new connection (which cannot be stale).
                self.metrics.stale_retries.inc();
                match self.send_aside(worker, owner, request, timer, now) {
                    Ok(()) => return,
                    Err(e) => return self.aside_failed(owner, worker, &e.to_string(), now),
                }
            }
        }
        let connect = matches!(err, HttpError::Connect(_));
        let url = self.workers.get(worker).map(|w| w.url.clone()).unwrap_or_default();
        match owner {
            Owner::None | Owner::Abort | Owner::Probe { .. } | Owner::Collect { .. } => {
                self.aside_failed(owner, worker, &err.to_string(), now)
            }
            Owner::Leg { flight, leg } => {
                let Some(e) = self.flights.get_mut(&flight) else { return };
                e.slot = None;
                let failure = if connect {
                    LegFailure::Refused { worker, reason: format!("{url}: {err}") }
                } else if stale {
                    LegFailure::Stale
                } else {
                    LegFailure::Broken { reason: err.to_string() }
                };
                if let Some(w) = self.workers.get_mut(worker) {
                    w.outstanding = w.outstanding.saturating_sub(1);
                    // A pooled connection the worker had closed says nothing about its health.
                    if failure != LegFailure::Stale {
                        w.breaker.request_failed(now, err.to_string(), connect);
                    }
                }
                if let Some(e) = self.flights.get_mut(&flight) {
                    e.flight.handle_leg_failed(leg, failure);
                }
                self.drive(flight, now);
            }
        }
    }

    /// A probe, abort or fan-out that got no answer from `worker`.
    pub(crate) fn aside_failed(&mut self, owner: Owner, worker: u32, error: &str, now: Instant) {
        match owner {
            Owner::None | Owner::Abort | Owner::Leg { .. } => {}
            Owner::Probe { .. } => self.probe_failed(worker, error, now),
            Owner::Collect { id, .. } => {
                let url = self.workers.get(worker).map(|w| w.url.clone()).unwrap_or_default();
                self.collect_done(id, serde_json::json!({"url": url, "error": error}), None)
            }
        }
    }

    fn on_response_event(&mut self, slot: usize, ev: ResponseEvent, now: Instant) {
        match self.ups.owner(slot) {
            Owner::None => {}
            Owner::Abort => {
                if ev == ResponseEvent::End {
                    self.ups.release(
                        slot,
                        self.server.registry(),
                        &mut self.workers,
                        now + self.cfg.idle_connection_timeout,
                    );
                }
            }
            Owner::Probe { worker } => self.on_probe_event(slot, worker, ev, now),
            Owner::Collect { id, worker } => self.on_collect_event(slot, id, worker, ev),
            Owner::Leg { flight, leg } => self.on_leg_event(slot, flight, leg, ev, now),
        }
    }

    fn on_leg_event(&mut self, slot: usize, id: u64, leg: LegId, ev: ResponseEvent, now: Instant) {
        let Some(e) = self.flights.get_mut(&id) else {
            self.ups.close(slot, self.server.registry(), &mut self.workers);
            return;
        };
        match ev {
            ResponseEvent::Head(head) => {
                let ct = head.header_str("content-type");
                let retry = head.header_str(pdserve_api::header::RETRY_AFTER);
                let resumable = head.header_str(pdserve_api::header::RESUMABLE).is_some();
                e.flight.handle_leg_head(leg, head.status, ct, retry, resumable);
            }
            ResponseEvent::Data(data) => e.flight.handle_leg_data(leg, &data, now),
            ResponseEvent::End => {
                e.slot = None;
                let worker = self.ups.get(slot).map(|u| u.worker);
                if let Some(w) = worker.and_then(|w| self.workers.get_mut(w)) {
                    w.outstanding = w.outstanding.saturating_sub(1);
                    w.breaker.request_ok();
                }
                self.ups.release(
                    slot,
                    self.server.registry(),
                    &mut self.workers,
                    now + self.cfg.idle_connection_timeout,
                );
                if let Some(e) = self.flights.get_mut(&id) {
                    e.flight.handle_leg_end(leg, now);
                }
            }
        }
        self.drive(id, now);
    }

    // ----- timers --------------------------------------------------------------------------------

    /// Streams whose worker went quiet past the stall timeout move on (or end with an error).
    fn sweep_stalls(&mut self, now: Instant) {
        let due: Vec<u64> = self
            .flights
            .iter()
            .filter(|(_, e)| e.flight.stall_deadline().is_some_and(|d| d <= now))
            .map(|(&id, _)| id)
            .collect();
        for id in due {
            if let Some(e) = self.flights.get_mut(&id) {
                e.flight.handle_stall(now);
            }
            self.drive(id, now);
        }
    }

    fn timers(&mut self, now: Instant) {
        while let Some(&Reverse((d, id))) = self.deadlines.peek() {
            if d > now {
                break;
            }
            self.deadlines.pop();
            let Some(e) = self.flights.get_mut(&id) else { continue };
            if e.flight.deadline() != d {
                continue;
            }
            e.flight.handle_timeout(now);
            self.drive(id, now);
        }
        let mut expired = Vec::new();
        self.admission.expired(now, &mut expired);
        for id in expired {
            if let Some(e) = self.flights.get_mut(&id) {
                e.queued_at = None;
            }
            let msg = format!(
                "waited {} ms in the router queue without a dispatch slot ({} in flight, limit {})",
                ms(self.cfg.admission.queue_timeout),
                self.admission.in_flight(),
                self.cfg.admission.in_flight_max
            );
            let retry = self.admission.retry_after_s(now);
            self.reject(id, ApiError::new(ErrorKind::QueueFull, msg).with_retry_after(retry), now);
        }
        while let Some(found) = self.discovery.as_ref().and_then(|rx| rx.try_recv().ok()) {
            self.apply_discovery(found, now);
        }
        if now >= self.next_probe && self.draining_since.is_none() {
            self.run_probes(now);
        }
        if now >= self.next_sweep {
            self.next_sweep = now + Duration::from_millis(50);
            self.sweep_connections(now);
            self.sweep_stalls(now);
            self.collects_due(now);
            self.sweep_workers();
        }
    }

    /// Connections past their timer: connects that took too long, probes and aborts with no answer,
    /// idle connections past the pool's idle timeout.
    fn sweep_connections(&mut self, now: Instant) {
        for (slot, phase) in self.ups.due(now) {
            match phase {
                UpstreamPhase::Idle => self.ups.close(slot, self.server.registry(), &mut self.workers),
                UpstreamPhase::Connecting => {
                    let e = io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no connection within {} ms", ms(self.cfg.connect_timeout)),
                    );
                    self.upstream_failed(slot, HttpError::Connect(e), now);
                }
                UpstreamPhase::Busy => {
                    let e = io::Error::new(io::ErrorKind::TimedOut, "no answer before the deadline");
                    self.upstream_failed(slot, HttpError::Io(e), now);
                }
            }
        }
    }

    /// Removes drained workers.
    pub(crate) fn sweep_workers(&mut self) {
        let done: Vec<u32> =
            self.workers.iter().filter(|w| w.draining && w.outstanding == 0).map(|w| w.id).collect();
        for id in done {
            self.ups.close_idle(id, self.server.registry(), &mut self.workers);
            // Connections still owned by probes or aborts finish on their own timers.
            if let Some(w) = self.workers.remove(id) {
                // Its series leave `/metrics` with it (pods come and go under discovery).
                let labels = [w.url.as_str(), w.role.as_str()];
                self.metrics.worker_in_flight.remove(&labels);
                self.metrics.worker_connections.remove(&labels);
            }
        }
    }

    /// A request on the router's own port: the admin API or a flight.
    fn handle_request(&mut self, conn: ConnId, req: Request, now: Instant) {
        let rid = match req.request_id() {
            Some(id) => id.to_owned(),
            None => format!("rt-{:x}-{}", unix_ms(), self.new_id()),
        };
        if !self.authorized(conn, &req, &rid) {
            return;
        }
        let path = req.path().to_owned();
        match (req.method.as_str(), path.as_str()) {
            ("GET", path::HEALTH_GENERATE) => self.start_flight(
                conn,
                &rid,
                Endpoint::CHAT_PATH,
                PROBE_BODY.to_vec(),
                (Purpose::HealthGenerate, None),
                now,
            ),
            ("POST", p) if Endpoint::from_path(p).is_some() => {
                let tp = req.header_str(pdserve_api::header::TRACEPARENT).map(str::to_owned);
                self.start_flight(conn, &rid, p, req.body, (Purpose::Client, tp), now)
            }
            ("GET", path::MODELS) => self.collect(conn, Collecting::Models { id: None }, rid, now),
            ("GET", p) if path::model_id(p).is_some() => {
                let id = path::model_id(p).map(str::to_owned);
                self.collect(conn, Collecting::Models { id }, rid, now)
            }
            (m @ ("GET" | "DELETE"), p) if path::response_id(p).is_some() => {
                let resp = match self.stored_response(m, path::response_id(p).unwrap_or("")) {
                    Ok(v) => pdserve_http::Response::json(200, v.to_string())
                        .header(pdserve_api::header::REQUEST_ID, &rid),
                    Err(e) => pdserve_http::Response::error(&e, Some(&rid)),
                };
                self.respond(conn, &resp);
            }
            ("GET", p @ path::VERSION) => {
                self.start_flight(conn, &rid, p, Vec::new(), (Purpose::Client, None), now)
            }
            ("POST", p @ (path::TOKENIZE | path::DETOKENIZE | path::MESSAGES_COUNT_TOKENS)) => {
                self.start_flight(conn, &rid, p, req.body, (Purpose::Client, None), now)
            }
            ("POST", p) if p.starts_with("/abort/") => {
                let target = &p["/abort/".len()..];
                match self.by_rid.get(target).copied() {
                    Some(id) => {
                        if let Some(e) = self.flights.get_mut(&id) {
                            e.flight.handle_cancel(false);
                        }
                        self.drive(id, now);
                        let body = serde_json::json!({"aborted": target});
                        self.respond(
                            conn,
                            &pdserve_http::Response::json(200, body.to_string())
                                .header(pdserve_api::header::REQUEST_ID, &rid),
                        );
                    }
                    None => {
                        let e = ApiError::new(ErrorKind::NotFound, format!("no live request {target}"));
                        self.respond(conn, &pdserve_http::Response::error(&e, Some(&rid)));
                    }
                }
            }
            _ => self.admin(conn, &req, &rid, now),
        }
    }
}
