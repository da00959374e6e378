//! The shell's side of flights: starting them (admission, deadline, ledger), carrying out their
//! actions ([`Router::drive`]), picking workers for their legs, and settling their ends.

use std::cmp::Reverse;
use std::time::{Duration, Instant};

use pdserve_api::{path, ApiError, ErrorKind, Outcome, Role, Stage};
use pdserve_codec::Endpoint;
use pdserve_http::{ConnId, UpstreamPhase};

use crate::admission::Admit;
use crate::flight::{Action, Finish, Flight, FlightSpec, LegFailure, LegId, LegKind, Plan, Purpose, Retry};
use crate::peek::peek;
use crate::router::{Entry, Router, PROBE_BODY};
use crate::upstream::{AcquireError, Owner};
use crate::Candidate;

/// Whether `rid` has the shape of a later try's id at the workers (`{id}.m{n}`): a client's such id
/// could be taken for another request's try.
fn is_attempt_id(rid: &str) -> bool {
    rid.rsplit_once(".m").is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

impl Router {
    pub(crate) fn candidates(&self, role: Role, exclude: &[u32]) -> Vec<Candidate> {
        self.workers
            .iter()
            .filter(|w| w.role == role && w.routable() && !exclude.contains(&w.id))
            .filter(|w| w.connections < self.cfg.connections_per_worker_max || !w.idle.is_empty())
            .map(|w| Candidate::new(w.id, w.outstanding))
            .collect()
    }

    /// What each candidate's published cache holds of flight `id`'s prompt (`--tokenizer`).
    fn with_cached(&self, id: u64, cands: &mut [Candidate]) {
        let Some(kv) = self.kv.as_ref() else { return };
        let Some(p) = self.flights.get(&id).and_then(|e| e.kv_prompt.as_ref()) else { return };
        for c in cands {
            c.cached_tokens = kv.held_tokens(c.worker, p).map(|held| (held, p.tokens));
        }
    }

    pub(crate) fn has_role(&self, role: Role) -> bool {
        self.workers.iter().any(|w| w.role == role && w.routable())
    }

    /// Starts a flight for a client request on `conn`: its deadline, its admission.
    /// `path` is a completion endpoint (a POST with `body`), or another path forwarded as is to one
    /// worker: `/version` (a GET), `/tokenize`, `/detokenize` and `/v1/messages/count_tokens` (POSTs with
    /// `body`).
    pub(crate) fn start_flight(
        &mut self,
        conn: ConnId,
        rid: &str,
        path: &str,
        body: Vec<u8>,
        (purpose, traceparent): (Purpose, Option<String>),
        now: Instant,
    ) {
        let forward = Endpoint::from_path(path).is_none();
        let method_get = path == path::VERSION;
        let (timeout_s, prompt, priority) = if forward {
            (None, String::new(), 0)
        } else {
            match peek(&body) {
                Ok(p) => (p.timeout_s, p.prompt, p.priority),
                Err(e) => {
                    self.metrics.finished(Outcome::Rejected, Stage::RouterQueued);
                    self.respond(
                        conn,
                        &pdserve_http::Response::error_at(path, &ApiError::invalid(e.to_string()), Some(rid)),
                    );
                    return;
                }
            }
        };
        if self.draining_since.is_some() {
            self.metrics.finished(Outcome::Rejected, Stage::RouterQueued);
            let e =
                ApiError::new(ErrorKind::NotReady, "the router is shutting down and takes no new requests")
                    .with_retry_after(1);
            self.respond(conn, &pdserve_http::Response::error_at(path, &e, Some(rid)));
            return;
        }
        if is_attempt_id(rid) {
            self.metrics.finished(Outcome::Rejected, Stage::RouterQueued);
            let msg = format!("request id {rid} ends like the router's own ids for a moved request's later tries (`.m` and digits)");
            self.respond(conn, &pdserve_http::Response::error_at(path, &ApiError::invalid(msg), Some(rid)));
            return;
        }
        if self.by_rid.contains_key(rid) {
            self.metrics.finished(Outcome::Rejected, Stage::RouterQueued);
            let msg = format!("request id {rid} is already in flight; x-request-id must be unique");
            self.respond(
                conn,
                &pdserve_http::Response::error_at(
                    path,
                    &ApiError::new(ErrorKind::DuplicateRequestId, msg),
                    Some(rid),
                ),
            );
            return;
        }
        // No working capacity at all: answer at once rather than queue.
        let capacity =
            self.has_role(Role::Unified) || (self.has_role(Role::Prefill) && self.has_role(Role::Decode));
        if !forward && !capacity {
            self.metrics.finished(Outcome::Rejected, Stage::RouterQueued);
            let why = self.workers.path_ready(Duration::ZERO, Duration::ZERO, now).err().unwrap_or_default();
            let msg = format!("no healthy worker can take the request ({why})");
            let resp = if purpose == Purpose::HealthGenerate {
                pdserve_http::Response::health(
                    &pdserve_api::Health::GenerateFailed { reason: msg },
                    Some(rid),
                )
            } else {
                pdserve_http::Response::error_at(path, &ApiError::new(ErrorKind::NoCapacity, msg), Some(rid))
            };
            self.respond(conn, &resp);
            return;
        }
        let timeout = match (purpose, timeout_s) {
            (Purpose::HealthGenerate, _) => self.cfg.probe_timeout,
            (_, Some(t)) => Duration::from_secs_f64(t.min(1e6)).min(self.cfg.request_timeout_max),
            (_, None) => self.cfg.request_timeout_max,
        };
        // Responses: the stored conversation in the body; what storing the answer needs.
        let (body, storing, conversation) = match path {
            path::RESPONSES => match self.responses_body(body, now) {
                Ok(f) => (f.body, f.storing, f.prompt),
                Err(e) => {
                    self.metrics.finished(Outcome::Rejected, Stage::RouterQueued);
                    self.respond(conn, &pdserve_http::Response::error_at(path, &e, Some(rid)));
                    return;
                }
            },
            _ => (body, None, None),
        };
        let prompt = conversation.unwrap_or(prompt);
        let kv_prompt = match (&self.kv, Endpoint::from_path(path)) {
            (Some(kv), Some(endpoint)) if purpose == Purpose::Client => kv.prompt(endpoint, &body),
            _ => None,
        };
        let spec = FlightSpec {
            request_id: rid.to_owned(),
            purpose,
            method_get,
            path: path.to_owned(),
            body,
            prompt,
            received: now,
            deadline: now + timeout,
            retries_max: self.cfg.retries_max,
            body_bytes_max: self.cfg.upstream_body_bytes_max,
            migrations_max: self.cfg.migrations_max,
            stall_timeout: self.cfg.stall_timeout,
        };
        let id = self.new_id();
        self.by_conn.insert(conn, id);
        self.insert(id, Flight::new(spec, true), Some(conn), now);
        if let Some(e) = self.flights.get_mut(&id) {
            e.storing = storing.map(Box::new);
            e.kv_prompt = kv_prompt;
            if self.traces.is_some() && purpose == Purpose::Client {
                let t = crate::trace::FlightTrace::new(traceparent.as_deref());
                let _ = self.ledger.set_trace(rid, &t.trace_id());
                e.trace = Some(t);
            } else if purpose == Purpose::Client {
                if let Some(ctx) = traceparent.as_deref().and_then(pdserve_trace::TraceContext::parse) {
                    let _ = self.ledger.set_trace(rid, &ctx.trace_id_hex());
                    e.passthrough = Some(ctx.traceparent());
                }
            }
        }
        if purpose == Purpose::HealthGenerate {
            // Probes are never queued behind client traffic.
            return self.dispatch(id, now);
        }
        match self.admission.offer(id, priority, now) {
            Admit::Dispatch => {
                if let Some(e) = self.flights.get_mut(&id) {
                    e.admitted = true;
                }
                self.dispatch(id, now);
            }
            Admit::Queued => {
                if let Some(e) = self.flights.get_mut(&id) {
                    e.queued_at = Some(now);
                }
            }
            Admit::Displaced { victim, retry_after_s } => {
                if let Some(e) = self.flights.get_mut(&id) {
                    e.queued_at = Some(now);
                }
                if let Some(e) = self.flights.get_mut(&victim) {
                    e.queued_at = None;
                }
                let msg = format!(
                    "router queue is full ({} waiting, limit {}): this request gave its place to one of a lower `priority` value ({priority})",
                    self.admission.queued(),
                    self.cfg.admission.queued_max
                );
                let err = ApiError::new(ErrorKind::QueueFull, msg).with_retry_after(retry_after_s);
                self.reject(victim, err, now);
            }
            Admit::Full { retry_after_s } => {
                let msg = format!(
                    "router queue is full ({} waiting, limit {}; {} in flight)",
                    self.admission.queued(),
                    self.cfg.admission.queued_max,
                    self.admission.in_flight()
                );
                let err = ApiError::new(ErrorKind::QueueFull, msg).with_retry_after(retry_after_s);
                self.reject(id, err, now);
            }
        }
    }

    pub(crate) fn insert(&mut self, id: u64, flight: Flight, conn: Option<ConnId>, now: Instant) {
        let (rid, deadline) = (flight.spec().request_id.clone(), flight.deadline());
        let _ = self.ledger.admit(&rid, Stage::RouterQueued, now, deadline, "");
        self.by_rid.insert(rid, id);
        self.push_deadline(deadline, id);
        let entry = Entry {
            flight,
            conn,
            slot: None,
            admitted: false,
            queued_at: None,
            routing: Vec::new(),
            storing: None,
            trace: None,
            passthrough: None,
            kv_prompt: None,
        };
        self.flights.insert(id, entry);
    }

    /// Starts an internal pair probe through the given prefill and decode workers.
    pub(crate) fn start_pair_probe(&mut self, prefill: u32, decode: u32, now: Instant) {
        let id = self.new_id();
        let spec = FlightSpec {
            request_id: format!("probe-{id}"),
            purpose: Purpose::PairProbe { prefill, decode },
            method_get: false,
            path: Endpoint::CHAT_PATH.to_owned(),
            body: PROBE_BODY.to_vec(),
            prompt: String::new(),
            received: now,
            // A real request through two workers, queued behind their work like any other: it may
            // take until the next one is due (a worker's own probe answers within `probe_timeout`).
            deadline: now + self.cfg.pair_probe_interval.max(self.cfg.probe_timeout),
            retries_max: 0,
            body_bytes_max: self.cfg.upstream_body_bytes_max,
            migrations_max: 0,
            stall_timeout: None,
        };
        self.insert(id, Flight::new(spec, false), None, now);
        self.pair_probes_in_flight += 1;
        self.dispatch(id, now);
    }

    /// Deadlines are removed lazily (when they come due); the heap is rebuilt from the live flights
    /// when stale entries outnumber them, so its size stays bounded by the flights in progress.
    pub(crate) fn push_deadline(&mut self, deadline: Instant, id: u64) {
        self.deadlines.push(Reverse((deadline, id)));
        if self.deadlines.len() > 2 * self.flights.len() + 1024 {
            self.deadlines = self.flights.iter().map(|(&id, e)| Reverse((e.flight.deadline(), id))).collect();
            self.deadlines.push(Reverse((deadline, id)));
        }
    }

    /// Sends the flight's first leg: to a unified worker, or to a prefill worker in PD mode.
    pub(crate) fn dispatch(&mut self, id: u64, now: Instant) {
        let Some(e) = self.flights.get_mut(&id) else { return };
        if let Some(q) = e.queued_at.take() {
            self.metrics.queue_wait.record(now.saturating_duration_since(q));
        }
        if let Some(t) = e.trace.as_mut() {
            t.dispatched(now);
        }
        let (purpose, forward) =
            (e.flight.spec().purpose, Endpoint::from_path(&e.flight.spec().path).is_none());
        let plan = match purpose {
            Purpose::PairProbe { .. } => Plan::Disaggregated,
            _ if forward => Plan::Forward,
            _ if self.workers.iter().any(|w| w.role == Role::Unified && w.routable()) => Plan::Unified,
            _ if self.decode_holds(id) => Plan::DecodeLocal,
            _ => Plan::Disaggregated,
        };
        if let (Purpose::Client, Ok(c)) = (purpose, self.metrics.dispatched.with(&[plan.as_str()])) {
            c.inc();
        }
        if let Some(e) = self.flights.get_mut(&id) {
            e.flight.handle_dispatch(plan);
        }
        self.drive(id, now);
    }

    /// Conditional disaggregation: a client request whose prompt the decode policy would route to a
    /// decode worker for its cache, that worker lacking at most `max_local_prefill_bytes` of it (a
    /// conversation's next round: the last answer and the new message), is computed there; the
    /// prefill worker, the transfer and the pull would cost more than the short tail.
    fn decode_holds(&mut self, id: u64) -> bool {
        let max = self.cfg.max_local_prefill_bytes;
        let Some(e) = self.flights.get(&id) else { return false };
        let spec = e.flight.spec();
        if max == 0 || spec.purpose != Purpose::Client || spec.prompt.is_empty() {
            return false;
        }
        let mut cands = self.candidates(Role::Decode, &[]);
        self.with_cached(id, &mut cands);
        let Some(prompt) = self.flights.get(&id).map(|e| &e.flight.spec().prompt) else { return false };
        match self.decode_policy.holder(&cands, prompt) {
            Some((_, held)) => held > 0 && prompt.len().saturating_sub(held) <= max,
            None => false,
        }
    }

    pub(crate) fn reject(&mut self, id: u64, err: ApiError, now: Instant) {
        if let Some(e) = self.flights.get_mut(&id) {
            e.flight.handle_rejected(err);
        }
        self.drive(id, now);
    }

    /// Carries out what flight `id` asks for, until it has nothing more to say.
    pub(crate) fn drive(&mut self, id: u64, now: Instant) {
        loop {
            let Some(e) = self.flights.get_mut(&id) else { return };
            let Some(action) = e.flight.poll_action() else { return };
            match action {
                Action::OpenLeg { leg, kind, exclude, pinned, retry } => {
                    match retry {
                        Some(Retry::Refused) => self.metrics.retries.inc(),
                        Some(Retry::Stale) => self.metrics.stale_retries.inc(),
                        None => {}
                    }
                    self.open_leg(id, leg, (kind, retry), &exclude, pinned, now);
                }
                Action::StartStream { headers } => {
                    if let Some(conn) = e.conn {
                        let h: Vec<(&str, &str)> =
                            headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
                        let received = e.flight.spec().received;
                        let _ = self.server.start_stream(conn, 200, &h);
                        self.metrics.ttfb.record(now.saturating_duration_since(received));
                    }
                }
                Action::Forward(bytes) => {
                    if let Some(s) = e.storing.as_mut() {
                        s.capture(&bytes, self.cfg.upstream_body_bytes_max);
                    }
                    if let Some(conn) = e.conn {
                        if let Err(err) = self.server.send_chunk(conn, &bytes) {
                            // The client stopped reading: its request ends here.
                            if self.cfg.log_requests {
                                let trace = e.trace.as_ref().map(|t| format!(" trace_id={}", t.trace_id()));
                                eprintln!(
                                    "router: request_id={}{}: client stopped reading: {err}",
                                    e.flight.spec().request_id,
                                    trace.unwrap_or_default()
                                );
                            }
                            self.server.close(conn);
                            e.conn = None;
                            self.by_conn.remove(&conn);
                            e.flight.handle_cancel(true);
                        }
                    }
                }
                Action::EndStream => {
                    if let Some(conn) = e.conn {
                        let _ = self.server.end_stream(conn);
                    }
                }
                Action::Respond(resp) => {
                    if let Some(s) = e.storing.as_mut().filter(|_| resp.status == 200) {
                        s.capture(&resp.body, self.cfg.upstream_body_bytes_max);
                    }
                    if let Some(conn) = e.conn.take() {
                        let received = e.flight.spec().received;
                        let _ = self.server.respond(conn, &resp);
                        self.by_conn.remove(&conn);
                        self.metrics.ttfb.record(now.saturating_duration_since(received));
                    }
                }
                Action::CloseLeg { .. } => {
                    if let Some(slot) = e.slot.take() {
                        self.leg_closed(slot);
                    }
                }
                Action::Abort { worker, request_id } => self.send_abort(worker, &request_id, now),
                Action::Stage { stage, worker } => {
                    let rid = e.flight.spec().request_id.clone();
                    let _ = self.ledger.set_stage(&rid, stage, now);
                    if let Some(w) = worker.and_then(|w| self.workers.get(w)) {
                        let _ = self.ledger.set_owner(&rid, &w.url);
                    }
                }
                Action::Finished(f) => return self.finished(id, f, now),
            }
        }
    }

    /// A leg's connection closed by the shell: the worker has one request fewer.
    pub(crate) fn leg_closed(&mut self, slot: usize) {
        if let Some(w) = self.ups.get(slot).map(|u| u.worker).and_then(|w| self.workers.get_mut(w)) {
            w.outstanding = w.outstanding.saturating_sub(1);
        }
        self.ups.close(slot, self.server.registry(), &mut self.workers);
    }

    /// Picks a worker for a leg and sends it, or tells the flight why not.
    fn open_leg(
        &mut self,
        id: u64,
        leg: LegId,
        (kind, retry): (crate::flight::LegKind, Option<Retry>),
        exclude: &[u32],
        pinned: Option<u32>,
        now: Instant,
    ) {
        let role = match kind {
            LegKind::Main if self.has_role(Role::Unified) => Role::Unified,
            LegKind::Main if self.has_role(Role::Decode) => Role::Decode,
            LegKind::Main => Role::Prefill,
            k => k.role(),
        };
        let worker = match pinned {
            Some(w) => w,
            None => {
                let mut cands = self.candidates(role, exclude);
                self.with_cached(id, &mut cands);
                if cands.is_empty() {
                    let total = self.workers.iter().filter(|w| w.role == role).count();
                    let up = self.workers.iter().filter(|w| w.role == role && w.routable()).count();
                    let reason = format!(
                        "no {role} worker can take the request ({up} of {total} healthy; {} refused the connection; {} connections per worker at most)",
                        exclude.len(),
                        self.cfg.connections_per_worker_max
                    );
                    return self.leg_failed(id, leg, LegFailure::NoWorker { reason }, now);
                }
                let prompt =
                    self.flights.get(&id).map(|e| e.flight.spec().prompt.clone()).unwrap_or_default();
                // Prefill and decode each have their cache: both follow the prompt's prefix (the next
                // round of a conversation finds the decode worker that kept the last one's KV).
                let policy = if kind == LegKind::Decode { &mut self.decode_policy } else { &mut self.policy };
                let w = cands[policy.pick(&cands, &prompt)].worker;
                policy.routed(w, &prompt);
                if let (Some(c), Some(e)) = (policy.last_choice(), self.flights.get_mut(&id)) {
                    e.routing.push((kind, c.clone()));
                }
                w
            }
        };
        let limits =
            pdserve_http::Limits { body_bytes_max: self.cfg.upstream_body_bytes_max, ..Default::default() };
        let acquired = self.ups.acquire(
            &mut self.workers,
            worker,
            &self.server,
            limits,
            now + self.cfg.connect_timeout,
            self.cfg.connections_per_worker_max,
        );
        let slot = match acquired {
            Ok(s) => s,
            Err(err) => {
                if let (AcquireError::Connect { .. }, Some(w)) = (&err, self.workers.get_mut(worker)) {
                    w.breaker.request_failed(now, err.to_string(), true);
                }
                let failure = LegFailure::Refused { worker, reason: err.to_string() };
                return self.leg_failed(id, leg, failure, now);
            }
        };
        let Some(e) = self.flights.get_mut(&id) else {
            return self.ups.close(slot, self.server.registry(), &mut self.workers);
        };
        self.ups.set_owner(slot, Owner::Leg { flight: id, leg });
        e.slot = Some(slot);
        e.flight.handle_leg_sent(leg, worker, now);
        let (authority, url) =
            self.workers.get(worker).map_or(("", ""), |w| (w.authority.as_str(), w.url.as_str()));
        let tp = match e.trace.as_mut() {
            Some(t) => Some(t.leg(kind, url, retry, now)),
            // A probe: its legs ask the workers not to trace them (the sampled flag off).
            None if self.traces.is_some() => Some(
                pdserve_trace::TraceContext { flags: 0, ..pdserve_trace::TraceContext::new_root() }
                    .traceparent(),
            ),
            None => e.passthrough.clone(),
        };
        let secret = self.cfg.cluster_secret.as_deref();
        let bytes = e.flight.leg_request(kind, authority, secret, tp.as_deref(), now);
        let deadline = e.flight.deadline();
        if let Some(w) = self.workers.get_mut(worker) {
            w.outstanding += 1;
            w.requests_total += 1;
        }
        let Some(up) = self.ups.get_mut(slot) else { return };
        if up.phase != UpstreamPhase::Connecting {
            up.timer = deadline + Duration::from_secs(1);
        }
        if let Err(err) = up.send(bytes, false) {
            self.upstream_failed(slot, err, now);
        }
    }

    fn leg_failed(&mut self, id: u64, leg: LegId, failure: LegFailure, _now: Instant) {
        if let Some(e) = self.flights.get_mut(&id) {
            e.flight.handle_leg_failed(leg, failure);
        }
    }

    /// The one place a flight's end is settled: its admission slot, connection, ledger entry, metrics;
    /// the queue then dispatches what it holds.
    fn finished(&mut self, id: u64, f: Finish, now: Instant) {
        let Some(mut e) = self.flights.remove(&id) else { return };
        if let Some(s) = e.storing.take().filter(|_| f.outcome == Outcome::Completed) {
            self.responses_done(*s, now);
        }
        let spec = e.flight.spec();
        self.by_rid.remove(&spec.request_id);
        if let Some(conn) = e.conn {
            self.by_conn.remove(&conn);
        }
        if let Some(slot) = e.slot {
            self.leg_closed(slot);
        }
        self.ledger.finish(&spec.request_id);
        if e.queued_at.is_some() {
            self.admission.remove(id);
        }
        if e.admitted {
            self.admission.finished(now);
        }
        if let Some(d) = f.prefill_leg {
            self.metrics.prefill_leg.record(d);
        }
        if self.cfg.log_requests || f.error == Some(ErrorKind::UpstreamFailed) {
            let what = f.error.map_or(f.outcome.as_str().to_owned(), |k| format!("{} {k}", k.status()));
            let trace = e.trace.as_ref().map(|t| format!(" trace_id={}", t.trace_id())).unwrap_or_default();
            eprintln!(
                "router: request_id={}{trace} ended: {what}: {}",
                spec.request_id,
                f.message.as_deref().unwrap_or("")
            );
        }
        if let (Some(t), Some(x)) = (e.trace.take(), self.traces.as_ref()) {
            t.export(x, spec, &f, now);
        }
        match spec.purpose {
            Purpose::PairProbe { prefill, decode } => {
                self.pair_probes_in_flight = self.pair_probes_in_flight.saturating_sub(1);
                let ok = f.outcome == Outcome::Completed;
                self.metrics.probes.with(&["pair", if ok { "ok" } else { "failed" }]).map(|c| c.inc()).ok();
                // A pair probe that failed withdraws the proof at once (the two workers may each answer
                // their own probes while the link between them is down), from the worker where it
                // failed: the prefill worker before its answer, the decode worker once it had the
                // request, both while the KV was between them. One that only ran out of time (a busy
                // stack) withdraws nothing: the proof then lapses by itself unless a probe or a
                // request through the pair succeeds within the window. The next success restores it.
                let blamed: &[u32] = match f.stage {
                    _ if ok => &[prefill, decode],
                    _ if f.outcome == Outcome::TimedOut => &[],
                    _ if f.error == Some(ErrorKind::KvTransferFailed) => &[prefill, decode],
                    Stage::RouterQueued | Stage::PrefillQueued | Stage::Prefilling => &[prefill],
                    Stage::KvTransfer | Stage::Migrating => &[prefill, decode],
                    // (KvHeld: the prefill worker answered; the decode leg did not go out.)
                    Stage::KvHeld | Stage::DecodeQueued | Stage::Decoding | Stage::Streaming => &[decode],
                };
                for &w in blamed {
                    if let Some(w) = self.workers.get_mut(w) {
                        w.path_ok = ok.then_some(now);
                    }
                }
            }
            Purpose::Client | Purpose::HealthGenerate => {
                // A request that went through a prefill and a decode worker proves that path as well
                // as a probe does.
                if f.outcome == Outcome::Completed {
                    if let (Some(p), Some(d)) = (f.prefill_worker, f.decode_worker) {
                        for w in [p, d] {
                            if let Some(w) = self.workers.get_mut(w) {
                                w.path_ok = Some(now);
                            }
                        }
                    }
                }
                self.metrics.finished(f.outcome, f.stage);
                for m in &f.migrations {
                    let labels = [m.as_str(), f.outcome.as_str()];
                    if let Ok(c) = self.metrics.migrations.with(&labels) {
                        c.inc();
                    }
                }
                if let Some(k) = f.error {
                    self.metrics.error(k);
                }
                self.metrics.latency.record(now.saturating_duration_since(spec.received));
            }
        }
        self.pump_queue(now);
    }

    pub(crate) fn pump_queue(&mut self, now: Instant) {
        // Not re-entered from a dispatch that fails and finishes: the outer loop keeps going instead,
        // so a burst of failures never deepens the stack.
        if std::mem::replace(&mut self.pumping, true) {
            return;
        }
        while let Some(next) = self.admission.next_dispatch() {
            match self.flights.get_mut(&next) {
                Some(e) => {
                    e.admitted = true;
                    self.dispatch(next, now);
                }
                None => self.admission.finished(now),
            }
        }
        self.pumping = false;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn attempt_ids_are_recognised() {
        assert!(super::is_attempt_id("abc.m1"));
        assert!(super::is_attempt_id("x.y.m12"));
        assert!(!super::is_attempt_id("abc.m"));
        assert!(!super::is_attempt_id("abc.mx1"));
        assert!(!super::is_attempt_id("req-1"));
    }
}
