//! The HTTP thread: routes, OpenAI request/response shapes, streaming, health, introspection, and the
//! watchdog that ends anything the engine left past its deadline.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender, TrySendError};
use pdserve_http::{ConnId, Event as HttpEvent, Request, Response, Server, SSE_DONE};
use pdserve_model::{ChatMessage, IncrementalDecoder, TextCodec};
use pdserve_scheduler::{FinishReason, Outcome};
use serde_json::json;

use crate::api::{self, Endpoint, Generate, Meta, Prompt, TokenLogprob};
use crate::engine::{Command, RemoteKv, Reply, Shared, Submission, Times};
use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::WorkerConfig;

enum Kind {
    Generate {
        endpoint: Endpoint,
        stream: bool,
        include_usage: bool,
        logprobs: bool,
        stop: Vec<String>,
    },
    /// `/health/generate`: a real one-token request.
    Probe,
}

struct Live {
    conn: Option<ConnId>,
    request_id: String,
    kind: Kind,
    meta: Meta,
    prompt_tokens: usize,
    completion_tokens: usize,
    detok: IncrementalDecoder,
    pending: String,
    text: String,
    logprobs: Vec<TokenLogprob>,
    started: bool,
    /// A stop string was seen; the engine was told to abort, and the end is reported as `stop`.
    stopped: bool,
    received: Instant,
    last_token: Option<Instant>,
    deadline: Instant,
    /// Prefill role: the prompt's token ids, for the handle the decode worker takes.
    prompt_ids: Vec<u32>,
    first_token_at: Option<Instant>,
    /// Decode role: the prefill worker's stage timings, from the handle, reported on with ours.
    prefill_timings: Option<serde_json::Value>,
}

pub(crate) struct Frontend {
    pub server: Server,
    pub config: WorkerConfig,
    pub codec: Arc<TextCodec>,
    pub context_tokens: usize,
    pub vocab_size: usize,
    pub commands: Sender<Command>,
    pub replies: Receiver<Reply>,
    pub shared: Arc<Shared>,
    pub metrics: Metrics,
    live: HashMap<u64, Live>,
    by_conn: HashMap<ConnId, u64>,
    by_request_id: HashMap<String, u64>,
    /// Prefill role: recent request ids whose KV is (or was) offered, so `/abort/{id}` can end the offer.
    recent_prefills: std::collections::VecDeque<(String, u64)>,
    next_id: u64,
    draining_since: Option<Instant>,
    created: u64,
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn json_response(status: u16, v: &serde_json::Value, request_id: Option<&str>) -> Response {
    let mut r = Response::json(status, v.to_string());
    if let Some(id) = request_id {
        r = r.header("x-request-id", id);
    }
    r
}

impl Frontend {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        server: Server,
        config: WorkerConfig,
        codec: Arc<TextCodec>,
        context_tokens: usize,
        vocab_size: usize,
        commands: Sender<Command>,
        replies: Receiver<Reply>,
        shared: Arc<Shared>,
        metrics: Metrics,
    ) -> Self {
        Frontend {
            server,
            config,
            codec,
            context_tokens,
            vocab_size,
            commands,
            replies,
            shared,
            metrics,
            live: HashMap::new(),
            by_conn: HashMap::new(),
            by_request_id: HashMap::new(),
            recent_prefills: std::collections::VecDeque::new(),
            next_id: 1,
            draining_since: None,
            created: unix_now(),
        }
    }

    /// Serves until a termination signal has been handled and the drain finished.
    pub(crate) fn run(mut self) -> std::io::Result<()> {
        let mut events = Vec::new();
        loop {
            self.server.poll(&mut events, Some(Duration::from_millis(20)))?;
            for ev in events.drain(..) {
                match ev {
                    HttpEvent::Request { conn, request } => {
                        let result = catch_unwind(AssertUnwindSafe(|| self.handle(conn, request)));
                        if result.is_err() {
                            // One request's bug: it gets a 500, everyone else is served on.
                            let e =
                                ApiError::new(500, "internal", "internal error while handling the request");
                            let _ = self.server.respond(conn, &e.reply("unknown"));
                        }
                    }
                    HttpEvent::Disconnected { conn, .. } => self.disconnected(conn),
                    HttpEvent::Io { .. } => {} // no sources of its own
                }
            }
            while let Ok(r) = self.replies.try_recv() {
                self.reply(r);
            }
            self.watchdog();
            self.metrics.connections.set(self.server.connection_count() as f64);
            if crate::sys::terminate_requested() && self.draining_since.is_none() {
                self.draining_since = Some(Instant::now());
            }
            if let Some(since) = self.draining_since {
                if since.elapsed() > self.config.drain_timeout {
                    for id in self.live.keys().copied().collect::<Vec<_>>() {
                        let _ = self.commands.try_send(Command::Abort(id));
                    }
                }
                // A stuck engine must not keep the process alive: past the drain timeout plus the grace,
                // whatever is left ends here (its clients see the connection close).
                let give_up = since.elapsed() > self.config.drain_timeout + self.config.watchdog_grace * 2;
                if self.live.is_empty() || give_up {
                    // Give the last responses a moment to flush.
                    let until = Instant::now() + Duration::from_millis(200);
                    while Instant::now() < until {
                        self.server.poll(&mut events, Some(Duration::from_millis(20)))?;
                        events.clear();
                    }
                    return Ok(());
                }
            }
        }
    }

    fn request_id(req: &Request, fallback: u64) -> String {
        match req.request_id() {
            Some(id) => id.to_owned(),
            None => format!("req-{:x}-{fallback}", unix_now()),
        }
    }

    fn handle(&mut self, conn: ConnId, req: Request) {
        let id = self.next_id;
        self.next_id += 1;
        let rid = Self::request_id(&req, id);
        let path = req.path().to_owned();
        let result = match (req.method.as_str(), path.as_str()) {
            ("GET", "/health/live") => Ok(Some(json_response(200, &json!({"status": "live"}), None))),
            ("GET", "/health/ready" | "/health") => Ok(Some(self.ready())),
            ("GET", "/health/generate") => self.probe(conn, id, &rid),
            ("GET", "/metrics") => Ok(Some(
                Response::text(200, self.metrics.registry.render())
                    .header("content-type", "text/plain; version=0.0.4; charset=utf-8"),
            )),
            ("GET", "/debug/requests") => Ok(Some(self.debug_requests(&req))),
            ("GET", "/v1/models") => Ok(Some(json_response(
                200,
                &json!({"object": "list", "data": [{"id": self.config.model_name, "object": "model",
                    "created": self.created, "owned_by": "pdserve", "max_model_len": self.context_tokens,
                    "device": self.config.device.to_string(), "weights": self.config.weights.name(),
                    "multi_row_weights": self.config.multi_row_weights}]}),
                Some(&rid),
            ))),
            ("POST", "/v1/chat/completions") => self.generate(conn, id, &rid, &req, Endpoint::Chat),
            ("POST", "/v1/completions") => self.generate(conn, id, &rid, &req, Endpoint::Completion),
            ("POST", p) if p.starts_with("/abort/") => Ok(Some(self.abort(&p["/abort/".len()..]))),
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
                | "/v1/completions",
            ) => Err(ApiError::new(
                405,
                "method_not_allowed",
                format!("{} is not allowed on {path}", req.method),
            )),
            _ => Err(ApiError::new(404, "not_found", format!("no route {} {path}", req.method))),
        };
        match result {
            Ok(Some(resp)) => {
                let _ = self.server.respond(conn, &resp);
            }
            Ok(None) => {} // answered later, from the engine's replies
            Err(e) => {
                let _ = self.server.respond(conn, &e.reply(&rid));
            }
        }
    }

    fn ready(&self) -> Response {
        let now = self.shared.ms_since_epoch(Instant::now());
        let tick_age = now.saturating_sub(self.shared.last_tick_ms.load(Ordering::Relaxed));
        let busy = self.shared.waiting.load(Ordering::Relaxed) + self.shared.running.load(Ordering::Relaxed);
        let last_token = self.shared.last_token_ms.load(Ordering::Relaxed);
        let token_age = now.saturating_sub(last_token);
        let reason = if self.draining_since.is_some() {
            Some("draining: not taking new requests".to_owned())
        } else if tick_age > self.config.ready_tick_ms {
            Some(format!("engine loop has not ticked for {tick_age} ms"))
        } else if busy > 0
            && token_age > self.config.ready_token_ms
            && self.live_started_before(self.config.ready_token_ms)
        {
            Some(format!("{busy} requests in the engine and no token for {token_age} ms"))
        } else {
            None
        };
        match reason {
            None => json_response(
                200,
                &json!({"status": "ready", "engine_tick_age_ms": tick_age, "requests": busy}),
                None,
            ),
            Some(reason) => {
                let body = json!({"status": "not_ready", "reason": reason});
                json_response(503, &body, None).header("retry-after", "1")
            }
        }
    }

    /// True if some live request has waited longer than `ms` (so "no token lately" is meaningful).
    fn live_started_before(&self, ms: u64) -> bool {
        self.live.values().any(|l| l.received.elapsed() > Duration::from_millis(ms))
    }

    fn debug_requests(&self, req: &Request) -> Response {
        let older = req
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("older_than_ms=")))
            .and_then(|v| v.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        let now_unix_ms =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        let ledger = self.shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
        json_response(200, &ledger.debug_json(Instant::now(), now_unix_ms, older), None)
    }

    fn abort(&mut self, request_id: &str) -> Response {
        let offered = self.recent_prefills.iter().find(|(r, _)| r == request_id).map(|&(_, id)| id);
        match (self.by_request_id.get(request_id), offered) {
            (Some(&id), _) => {
                let _ = self.commands.try_send(Command::Abort(id));
                json_response(200, &json!({"aborted": request_id}), Some(request_id))
            }
            (None, Some(id)) => {
                let _ = self.commands.try_send(Command::AbortTransfer(id));
                json_response(200, &json!({"aborted": request_id, "stage": "kv_held"}), Some(request_id))
            }
            (None, None) => {
                ApiError::new(404, "not_found", format!("no live request {request_id}")).reply(request_id)
            }
        }
    }

    fn probe(&mut self, conn: ConnId, id: u64, rid: &str) -> Result<Option<Response>, ApiError> {
        let tokens = self.codec.encode("Hi").map_err(|e| ApiError::new(500, "internal", e.to_string()))?;
        let deadline = Instant::now() + self.config.probe_timeout;
        if self.config.role != pdserve_scheduler::Role::Unified {
            // A prefill or decode worker cannot finish a request alone; its readiness is the engine's.
            return Ok(Some(self.ready()));
        }
        self.submit(
            conn,
            id,
            rid,
            tokens,
            1,
            Default::default(),
            0,
            Vec::new(),
            false,
            deadline,
            Kind::Probe,
            None,
        )?;
        Ok(None)
    }

    fn generate(
        &mut self,
        conn: ConnId,
        id: u64,
        rid: &str,
        req: &Request,
        endpoint: Endpoint,
    ) -> Result<Option<Response>, ApiError> {
        if self.draining_since.is_some() {
            return Err(ApiError::not_ready("the worker is draining and takes no new requests"));
        }
        let g: Generate = api::parse_generate(endpoint, &req.body)?;
        if let Some(m) = &g.model {
            if m != &self.config.model_name && !m.is_empty() {
                return Err(ApiError::new(
                    404,
                    "model_not_found",
                    format!("model {m:?} is not served here (serving {:?})", self.config.model_name),
                ));
            }
        }
        let role = self.config.role;
        let remote = match (&g.pd_transfer, role) {
            (Some(h), pdserve_scheduler::Role::Decode) => Some(h.clone()),
            (None, pdserve_scheduler::Role::Decode) => {
                return Err(ApiError::invalid(
                    "a decode worker needs `pd_transfer` (the prefill worker's answer) in the body",
                ))
            }
            (Some(_), _) => return Err(ApiError::invalid("`pd_transfer` is only taken by a decode worker")),
            (None, _) => None,
        };
        let text_for_trigger;
        let tokens = match &g.prompt {
            _ if remote.is_some() => {
                text_for_trigger = String::new();
                remote.as_ref().map(|h| h.prompt_tokens.clone()).unwrap_or_default()
            }
            Prompt::Messages(msgs) => {
                let msgs: Vec<ChatMessage> = msgs.iter().map(|(r, c)| ChatMessage::new(r, c)).collect();
                let text = self
                    .codec
                    .apply_chat_template(&msgs, true)
                    .map_err(|e| ApiError::invalid(e.to_string()))?;
                let t = self.codec.encode(&text).map_err(|e| ApiError::invalid(e.to_string()))?;
                text_for_trigger = text;
                t
            }
            Prompt::Text(text) => {
                text_for_trigger = text.clone();
                self.codec.encode(text).map_err(|e| ApiError::invalid(e.to_string()))?
            }
            Prompt::Tokens(t) => {
                text_for_trigger = String::new();
                if let Some(bad) = t.iter().find(|&&x| x as usize >= self.vocab_size) {
                    return Err(ApiError::invalid(format!(
                        "token id {bad} is outside the vocabulary of {}",
                        self.vocab_size
                    )));
                }
                t.clone()
            }
        };
        if let Some(trigger) = &self.config.panic_trigger {
            assert!(!text_for_trigger.contains(trigger.as_str()), "test panic trigger in the prompt");
        }
        if tokens.is_empty() {
            return Err(ApiError::invalid("the prompt is empty"));
        }
        if tokens.len() >= self.context_tokens {
            return Err(ApiError::new(
                400,
                "context_length_exceeded",
                format!(
                    "prompt is {} tokens; the context is {} tokens and at least one must be left to generate",
                    tokens.len(),
                    self.context_tokens
                ),
            ));
        }
        let max_tokens = g.max_tokens.unwrap_or(self.context_tokens - tokens.len());
        let timeout = req
            .header_str("x-request-deadline-ms")
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis)
            .or(g.timeout_s.map(Duration::from_secs_f64))
            .unwrap_or(self.config.default_timeout)
            .min(self.config.max_timeout);
        let deadline = Instant::now() + timeout;
        let seed = g.seed.unwrap_or_else(|| id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ unix_now());
        let kind = Kind::Generate {
            endpoint,
            // A prefill worker answers with the KV handle, never a stream.
            stream: g.stream && role != pdserve_scheduler::Role::Prefill,
            include_usage: g.include_usage,
            logprobs: g.logprobs,
            stop: g.stop.clone(),
        };
        let remote = remote.map(|h| RemoteKv {
            key: pdserve_pd_transfer::TransferKey { transfer: h.transfer, epoch: h.epoch },
            addr: h.addr,
            first_token: h.first_token,
            shm: h.shm.map(std::path::PathBuf::from),
        });
        self.submit(
            conn,
            id,
            rid,
            tokens,
            max_tokens,
            g.params,
            seed,
            g.stop_token_ids,
            g.ignore_eos,
            deadline,
            kind,
            remote,
        )?;
        if let (Some(h), Some(l)) = (&g.pd_transfer, self.live.get_mut(&id)) {
            l.prefill_timings = h.timings.clone();
        }
        Ok(None)
    }

    #[allow(clippy::too_many_arguments)]
    fn submit(
        &mut self,
        conn: ConnId,
        id: u64,
        rid: &str,
        tokens: Vec<u32>,
        max_tokens: usize,
        params: pdserve_model::SamplingParams,
        seed: u64,
        stop_ids: Vec<u32>,
        ignore_eos: bool,
        deadline: Instant,
        kind: Kind,
        remote: Option<RemoteKv>,
    ) -> Result<(), ApiError> {
        if self.by_request_id.contains_key(rid) {
            return Err(ApiError::new(
                409,
                "duplicate_request_id",
                format!("request id {rid} is already live"),
            ));
        }
        // Fast path: a full queue answers at once, without a round trip to the engine.
        let waiting = self.shared.waiting.load(Ordering::Relaxed);
        if waiting >= self.config.scheduler.max_queued_requests {
            let mut e = ApiError::new(
                429,
                "queue_full",
                format!(
                    "request queue is full ({waiting} waiting, limit {})",
                    self.config.scheduler.max_queued_requests
                ),
            );
            e.retry_after_s = Some(1);
            return Err(e);
        }
        let prompt_tokens = tokens.len();
        let prompt_ids =
            if self.config.role == pdserve_scheduler::Role::Prefill { tokens.clone() } else { Vec::new() };
        let sub = Submission {
            id,
            request_id: rid.to_owned(),
            tokens,
            max_tokens,
            params,
            seed,
            stop_ids,
            ignore_eos,
            deadline,
            remote,
        };
        match self.commands.try_send(Command::Submit(Box::new(sub))) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(ApiError::new(503, "no_capacity", "the engine's command queue is full"))
            }
            Err(TrySendError::Disconnected(_)) => return Err(ApiError::not_ready("the engine has stopped")),
        }
        let meta = Meta {
            id: format!(
                "{}-{rid}",
                if matches!(kind, Kind::Generate { endpoint: Endpoint::Completion, .. }) {
                    "cmpl"
                } else {
                    "chatcmpl"
                }
            ),
            created: unix_now(),
            model: self.config.model_name.clone(),
        };
        self.live.insert(
            id,
            Live {
                conn: Some(conn),
                request_id: rid.to_owned(),
                kind,
                meta,
                prompt_tokens,
                completion_tokens: 0,
                detok: IncrementalDecoder::new(),
                pending: String::new(),
                text: String::new(),
                logprobs: Vec::new(),
                started: false,
                stopped: false,
                received: Instant::now(),
                last_token: None,
                deadline,
                prompt_ids,
                first_token_at: None,
                prefill_timings: None,
            },
        );
        self.by_conn.insert(conn, id);
        self.by_request_id.insert(rid.to_owned(), id);
        Ok(())
    }

    fn disconnected(&mut self, conn: ConnId) {
        if let Some(id) = self.by_conn.remove(&conn) {
            if let Some(l) = self.live.get_mut(&id) {
                l.conn = None;
            }
            let _ = self.commands.try_send(Command::Abort(id));
        }
    }

    fn send_sse(&mut self, id: u64, payload: &str) -> bool {
        let Some(conn) = self.live.get(&id).and_then(|l| l.conn) else { return false };
        let mut frame = Vec::with_capacity(payload.len() + 16);
        pdserve_http::write_sse_event(&mut frame, payload);
        if self.server.send_chunk(conn, &frame).is_err() {
            // The client is gone or not reading: end the request.
            self.disconnected(conn);
            self.server.close(conn);
            return false;
        }
        true
    }

    fn reply(&mut self, r: Reply) {
        match r {
            Reply::Admitted(id) => {
                let Some(l) = self.live.get_mut(&id) else { return };
                let Kind::Generate { endpoint, stream: true, .. } = l.kind else { return };
                let Some(conn) = l.conn else { return };
                let rid = l.request_id.clone();
                let headers = [
                    ("content-type", "text/event-stream"),
                    ("cache-control", "no-cache"),
                    ("x-request-id", rid.as_str()),
                ];
                if self.server.start_stream(conn, 200, &headers).is_err() {
                    self.disconnected(conn);
                    return;
                }
                l.started = true;
                if endpoint == Endpoint::Chat {
                    let c = api::chunk(endpoint, &l.meta, Some(""), true, None, None).to_string();
                    self.send_sse(id, &c);
                }
            }
            Reply::Rejected(id, rejection) => {
                if let Some(l) = self.remove(id) {
                    let e = ApiError::from_rejection(&rejection);
                    if let Some(conn) = l.conn {
                        let _ = self.server.respond(conn, &self.error_response(&l, &e));
                    }
                }
            }
            Reply::Token { id, token, logprob, top, stop } => self.token(id, token, logprob, top, stop),
            Reply::Prefilled { id, first_token, key, blocks, times } => {
                let Some(l) = self.remove(id) else { return };
                self.metrics.e2e.observe_duration(l.received.elapsed());
                if self.recent_prefills.len() >= 4096 {
                    self.recent_prefills.pop_front();
                }
                self.recent_prefills.push_back((l.request_id.clone(), id));
                let Some(conn) = l.conn else {
                    // Nobody will take this KV: end the offer now instead of at the lease expiry.
                    let _ = self.commands.try_send(Command::AbortTransfer(id));
                    return;
                };
                let handle = api::PdHandle {
                    transfer: key.transfer,
                    epoch: key.epoch,
                    addr: self.config.transfer_addr,
                    first_token,
                    prompt_tokens: l.prompt_ids.clone(),
                    shm: self.config.kv_shm_path.as_ref().map(|p| p.display().to_string()),
                    timings: None,
                };
                let timings = stage_timings(&l, times, Instant::now());
                let mut h = handle.to_json(blocks);
                // Carried by the handle to the decode worker, which reports them with its own.
                h["timings"] = timings.clone();
                let body =
                    json!({"pd_transfer": h, "usage": api::usage(l.prompt_tokens, 1), "timings": timings});
                let _ = self.server.respond(conn, &json_response(200, &body, Some(&l.request_id)));
            }
            Reply::Finished { id, outcome, output_tokens, times } => {
                self.finished(id, outcome, output_tokens, times)
            }
        }
    }

    fn error_response(&self, l: &Live, e: &ApiError) -> Response {
        match l.kind {
            Kind::Probe => json_response(503, &json!({"status": "failed", "reason": e.message}), None)
                .header("retry-after", "1"),
            Kind::Generate { .. } => e.reply(&l.request_id),
        }
    }

    fn token(&mut self, id: u64, token: u32, logprob: f32, top: Vec<(u32, f32)>, stop: bool) {
        let now = Instant::now();
        let codec = Arc::clone(&self.codec);
        let Some(l) = self.live.get_mut(&id) else { return };
        match l.last_token {
            None => {
                self.metrics.ttft.observe_duration(now - l.received);
                l.first_token_at = Some(now);
            }
            Some(t) => self.metrics.itl.observe_duration(now - t),
        }
        l.last_token = Some(now);
        l.completion_tokens += 1;
        let (endpoint, stream, logprobs, stops) = match &l.kind {
            Kind::Generate { endpoint, stream, logprobs, stop: s, .. } => {
                (*endpoint, *stream, *logprobs, s.clone())
            }
            Kind::Probe => return,
        };
        if stop || l.stopped {
            return; // stop tokens are not text
        }
        let piece = l.detok.push(&codec, token).unwrap_or_default();
        if logprobs {
            let name = |t: u32| codec.decode(&[t], false).unwrap_or_default();
            l.logprobs.push(TokenLogprob {
                token: name(token),
                logprob,
                top: top.iter().map(|&(t, p)| (name(t), p)).collect(),
            });
        }
        l.pending.push_str(&piece);
        let (out, hit) = api::apply_stop(&mut l.pending, &stops);
        if hit {
            l.stopped = true;
            let _ = self.commands.try_send(Command::Abort(id));
        }
        if stream {
            if out.is_empty() && !logprobs {
                return;
            }
            let lp = logprobs
                .then(|| api::logprobs_json(endpoint, &l.logprobs[l.logprobs.len().saturating_sub(1)..]));
            let c = api::chunk(endpoint, &l.meta, Some(&out), false, None, lp).to_string();
            self.send_sse(id, &c);
        } else {
            l.text.push_str(&out);
        }
    }

    fn finished(&mut self, id: u64, outcome: Outcome, output_tokens: usize, times: Times) {
        let codec = Arc::clone(&self.codec);
        let Some(mut l) = self.remove(id) else { return };
        let timings = stage_timings(&l, times, Instant::now());
        self.metrics.e2e.observe_duration(l.received.elapsed());
        // One line per request, with its id, so a log search finds it.
        eprintln!(
            "request_id={} outcome={} prompt_tokens={} completion_tokens={} latency_ms={}",
            l.request_id,
            if l.stopped { "completed" } else { outcome.label() },
            l.prompt_tokens,
            l.completion_tokens,
            l.received.elapsed().as_millis()
        );
        let finish_reason = match (&outcome, l.stopped) {
            (_, true) | (Outcome::Completed(FinishReason::Stop), _) => Ok("stop"),
            (Outcome::Completed(FinishReason::Length), _) => Ok("length"),
            (o, _) => Err(ApiError::from_outcome(o)
                .unwrap_or_else(|| ApiError::new(500, "internal", "unexpected outcome"))),
        };
        let Some(conn) = l.conn else { return };
        if !l.stopped {
            let rest = l.detok.finish(&codec).unwrap_or_default();
            l.pending.push_str(&rest);
        }
        let tail = if l.stopped { String::new() } else { std::mem::take(&mut l.pending) };
        match l.kind {
            Kind::Probe => {
                let resp = match finish_reason {
                    Ok(_) => json_response(
                        200,
                        &json!({"status": "ok", "latency_ms": l.received.elapsed().as_millis() as u64, "tokens": output_tokens}),
                        None,
                    ),
                    Err(e) => self.error_response(&l, &e),
                };
                let _ = self.server.respond(conn, &resp);
            }
            Kind::Generate { endpoint, stream: false, logprobs, .. } => {
                let resp = match finish_reason {
                    Ok(reason) => {
                        l.text.push_str(&tail);
                        let lp = logprobs.then(|| api::logprobs_json(endpoint, &l.logprobs));
                        let mut body = api::full_response(
                            endpoint,
                            &l.meta,
                            &l.text,
                            reason,
                            lp,
                            l.prompt_tokens,
                            l.completion_tokens,
                        );
                        body["timings"] = timings;
                        json_response(200, &body, Some(&l.request_id))
                    }
                    Err(e) => self.error_response(&l, &e),
                };
                let _ = self.server.respond(conn, &resp);
            }
            Kind::Generate { endpoint, stream: true, include_usage, .. } => {
                if !l.started {
                    // Ended before the stream began (a deadline in the queue): a plain error answer.
                    let e = finish_reason
                        .err()
                        .unwrap_or_else(|| ApiError::new(500, "internal", "stream ended before it started"));
                    let _ = self.server.respond(conn, &self.error_response(&l, &e));
                    return;
                }
                let mut frames = Vec::new();
                if !tail.is_empty() {
                    frames.push(api::chunk(endpoint, &l.meta, Some(&tail), false, None, None).to_string());
                }
                let reason = match finish_reason {
                    Ok(r) => r,
                    Err(e) => {
                        frames.push(json!({"error": {"type": e.error_type, "message": e.message, "code": e.status, "request_id": l.request_id}}).to_string());
                        "error"
                    }
                };
                let mut last = api::chunk(endpoint, &l.meta, None, false, Some(reason), None);
                last["timings"] = timings;
                frames.push(last.to_string());
                if include_usage {
                    frames.push(
                        api::usage_chunk(endpoint, &l.meta, l.prompt_tokens, l.completion_tokens).to_string(),
                    );
                }
                frames.push(SSE_DONE.to_owned());
                let mut bytes = Vec::new();
                for f in frames {
                    pdserve_http::write_sse_event(&mut bytes, &f);
                }
                if self.server.send_chunk(conn, &bytes).is_ok() {
                    let _ = self.server.end_stream(conn);
                } else {
                    self.server.close(conn);
                }
            }
        }
    }

    fn remove(&mut self, id: u64) -> Option<Live> {
        let l = self.live.remove(&id)?;
        if let Some(conn) = l.conn {
            self.by_conn.remove(&conn);
        }
        self.by_request_id.remove(&l.request_id);
        Some(l)
    }

    /// Ends requests the engine has not ended by their deadline plus a grace period (a stuck engine):
    /// the client gets an answer, the engine an abort.
    fn watchdog(&mut self) {
        let grace = self.config.watchdog_grace;
        let now = Instant::now();
        let overdue: Vec<u64> =
            self.live.iter().filter(|(_, l)| now > l.deadline + grace).map(|(&id, _)| id).collect();
        for id in overdue {
            let _ = self.commands.try_send(Command::Abort(id));
            // The stage the engine last recorded for it (queued if it never got that far).
            use pdserve_api::Stage as L;
            let stage = self
                .live
                .get(&id)
                .and_then(|l| {
                    self.shared
                        .ledger
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get(&l.request_id)
                        .map(|e| e.stage)
                })
                .map_or(pdserve_scheduler::Stage::Queued, |s| match s {
                    L::Prefilling => pdserve_scheduler::Stage::Prefilling,
                    L::Decoding | L::Streaming | L::Migrating => pdserve_scheduler::Stage::Decoding,
                    L::KvTransfer | L::KvHeld => pdserve_scheduler::Stage::KvTransfer,
                    L::RouterQueued | L::PrefillQueued | L::DecodeQueued => pdserve_scheduler::Stage::Queued,
                });
            self.finished(id, Outcome::TimedOut { stage }, 0, Times::default());
        }
    }
}

/// Per-stage milliseconds of one request on this worker (`timings` in its final chunk or body):
/// unified `queue_ms`, `prefill_ms`, `decode_ms`; prefill `queue_ms`, `prefill_ms`; decode the prefill
/// worker's two as `prefill_queue_ms` and `prefill_ms`, then `transfer_ms`, `decode_queue_ms`,
/// `decode_ms`.
fn stage_timings(l: &Live, times: Times, end: Instant) -> serde_json::Value {
    let ms = |a: Instant, b: Instant| (b.saturating_duration_since(a).as_secs_f64() * 1e4).round() / 10.0;
    let mut m = serde_json::Map::new();
    let scheduled = times.scheduled.unwrap_or(end);
    match times.kv_arrived {
        Some(kv) => {
            if let Some(p) = l.prefill_timings.as_ref().and_then(|v| v.as_object()) {
                for (k, v) in p {
                    let name = if k == "queue_ms" { "prefill_queue_ms".to_owned() } else { k.clone() };
                    m.insert(name, v.clone());
                }
            }
            m.insert("transfer_ms".into(), json!(ms(l.received, kv)));
            m.insert("decode_queue_ms".into(), json!(ms(kv, scheduled.max(kv))));
            m.insert("decode_ms".into(), json!(ms(scheduled.max(kv), end)));
        }
        None => {
            m.insert("queue_ms".into(), json!(ms(l.received, scheduled)));
            let first = l.first_token_at.unwrap_or(end);
            m.insert("prefill_ms".into(), json!(ms(scheduled, first)));
            if l.first_token_at.is_some() {
                m.insert("decode_ms".into(), json!(ms(first, end)));
            }
        }
    }
    serde_json::Value::Object(m)
}
