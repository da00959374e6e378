//! The HTTP thread: routes, the OpenAI request and response shapes, streaming, health, introspection
//! and the SIGTERM drain, in front of the engine.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdserve_api::{header, path, pd, ApiError, ErrorKind, Health, Role};
use pdserve_codec::anthropic::MessageStream;
use pdserve_codec::openai;
use pdserve_codec::responses::{self, ResponseStore, ResponseStream};
use pdserve_codec::{Endpoint, GenerateRequest, Meta, Prompt};
use pdserve_engine::ChatMessage;
use pdserve_engine::SamplingParams;
use pdserve_engine::{Engine, Id, Input, Output, Request as EngineRequest, Timings};
use pdserve_engine::{TokenLogprob, ToolCall};
use pdserve_http::{ConnId, Event as HttpEvent, Request, Response, Server};
use serde_json::{json, Value};

use crate::WorkerConfig;

mod answer;
mod choices;
mod output;
mod routes;
mod trace;
use choices::Group;

/// What a live request answers with.
#[derive(Debug, Clone, Copy)]
enum Kind {
    Generate {
        stream: bool,
        include_usage: bool,
        logprobs: bool,
    },
    /// `/health/generate`: a real one-token request.
    Probe,
}

#[derive(Debug)]
struct Live {
    conn: Option<ConnId>,
    request_id: String,
    kind: Kind,
    meta: Meta,
    /// The stream's `200` head is out.
    started: bool,
    text: String,
    logprobs: Vec<TokenLogprob>,
    received: Instant,
    /// The calls found so far.
    calls: Vec<ToolCall>,
    /// The id of the call whose arguments are streaming, if one is.
    call_open: Option<String>,
    /// A streamed Messages answer: which content block is open.
    blocks: MessageStream,
    /// Completions with `echo`: the prompt's text, ahead of the answer.
    echo: Option<String>,
    /// With `n` > 1: the request's group, and which of its choices this is.
    group: Option<u64>,
    choice: usize,
    /// Test hook: rendering this request's output panics.
    panic_in_output: bool,
    /// The router asked for resume marks ([`pd::mark`]) in this stream.
    marks: bool,
    /// Moved here mid-answer: the client has the stream's opening events already.
    resumed: bool,
    /// When the stream last sent anything (for the keep-alive marks).
    last_sent: Instant,
    /// A Responses request: what its answer echoes and stores, and its stream's events.
    resp: Option<Box<Responding>>,
    /// A thinking model's thinking so far (non-streaming answers).
    reasoning: String,
    /// Its span here (`--otlp-traces-endpoint`).
    trace: Option<trace::RequestTrace>,
    /// The `traceparent` a prefill worker's KV handle carries on: its span's, or without an exporter
    /// the caller's own.
    handoff: Option<String>,
}

/// A Responses request's own state.
#[derive(Debug)]
struct Responding {
    /// The request's settings as the response object echoes them.
    echo: Value,
    /// The conversation so far (stored with the output when `store` is on).
    items: Vec<Value>,
    store: bool,
    /// The router keeps the answer: this worker does not.
    kept_by_router: bool,
    stream: ResponseStream,
}

/// A marked stream quiet for this long gets a keep-alive mark (if the engine loop is turning).
const KEEP_ALIVE_AFTER: Duration = Duration::from_secs(2);

pub(crate) struct Frontend {
    server: Server,
    config: WorkerConfig,
    engine: Engine,
    connections: routes::HttpMetrics,
    live: HashMap<Id, Live>,
    by_conn: HashMap<ConnId, Id>,
    next_id: u64,
    draining_since: Option<Instant>,
    created: u64,
    outputs: Vec<Output>,
    /// Requests with `n` > 1, by group id.
    groups: HashMap<u64, Group>,
    /// Answered Responses requests, for `previous_response_id` and `GET /v1/responses/{id}`.
    responses: ResponseStore,
    /// Keys the Responses ids (`Frontend::response_id`).
    id_salt: String,
    next_group: u64,
    last_keep_alive: Instant,
    /// Exports spans (`--otlp-traces-endpoint`).
    traces: Option<pdserve_trace::Exporter>,
    /// Prefill role, traced: requests whose KV is offered, until the engine says the transfer ended
    /// (`Output::Served`): their span, when the offer was made, their id. The oldest go past
    /// [`trace::OFFERS_TRACED_MAX`].
    offers_traced: std::collections::BTreeMap<Id, (trace::RequestTrace, Instant, String)>,
}

/// 16 random bytes from the kernel, in hex (a clock's nanoseconds where /dev/urandom is missing).
fn random_hex() -> String {
    use std::io::Read as _;
    let mut b = [0u8; 16];
    let ok = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut b)).is_ok();
    if !ok {
        let t = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        b = t.to_le_bytes();
    }
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A Responses id: `resp_`, then 128 bits keyed by `salt` from the request id and its creation
/// second (two SipHash passes with different domains; without the salt, not guessable).
fn response_id(salt: &str, rid: &str, created: u64) -> String {
    use std::hash::{Hash, Hasher};
    let half = |domain: u8| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (domain, salt, rid, created).hash(&mut h);
        h.finish()
    };
    format!("resp_{:016x}{:016x}", half(1), half(2))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn json_response(status: u16, v: &Value, request_id: Option<&str>) -> Response {
    let mut r = Response::json(status, v.to_string());
    if let Some(id) = request_id {
        r = r.header(header::REQUEST_ID, id);
    }
    r
}

fn timings_json(t: &Timings) -> Value {
    Value::Object(t.0.iter().map(|&(k, v)| (k.to_owned(), json!(v))).collect())
}

/// A chat message as the template sees it: calls with their arguments as objects (templates write
/// them with `tojson`).
fn chat_message(m: &pdserve_codec::Message) -> ChatMessage {
    let mut c = ChatMessage::new(&m.role, &m.content);
    for t in &m.tool_calls {
        c.push_call(&t.id, &t.name, &t.arguments);
    }
    c.tool_call_id = m.tool_call_id.clone();
    c.name = m.name.clone();
    c.reasoning_content = m.reasoning.clone();
    c
}

/// The client's sampling settings over the model's defaults (`d`).
fn sampling(g: &GenerateRequest, d: &SamplingParams) -> SamplingParams {
    let s = g.sampling;
    SamplingParams {
        temperature: s.temperature.unwrap_or(d.temperature),
        top_p: s.top_p.unwrap_or(d.top_p),
        top_k: s.top_k.map_or(d.top_k, |k| usize::try_from(k).unwrap_or(0)),
        min_p: s.min_p.unwrap_or(d.min_p),
        repetition_penalty: s.repetition_penalty.unwrap_or(d.repetition_penalty),
        frequency_penalty: s.frequency_penalty.unwrap_or(d.frequency_penalty),
        presence_penalty: s.presence_penalty.unwrap_or(d.presence_penalty),
        top_logprobs: g.top_logprobs as usize,
    }
}

impl Frontend {
    pub(crate) fn new(server: Server, config: WorkerConfig, engine: Engine) -> std::io::Result<Frontend> {
        let responses_max = (config.responses_max, config.responses_max_bytes, config.responses_max_age);
        // What response ids are made unguessable with: the stack's secret (every worker of a stack
        // makes the same id for the same request, so a moved request keeps it), else this
        // process's own random bytes.
        let id_salt = config.cluster_secret.clone().unwrap_or_else(random_hex);
        let connections = routes::HttpMetrics::register(engine.registry())?;
        let service = format!("pdserve-{}", engine.info().role.as_str());
        let traces = match &config.otlp_traces_endpoint {
            Some(e) => Some(pdserve_trace::Exporter::start(e.clone(), &service)?),
            None => None,
        };
        routes::HttpMetrics::register_vllm_aliases(engine.registry(), &config.model_name)?;
        Ok(Frontend {
            server,
            config,
            engine,
            connections,
            live: HashMap::new(),
            by_conn: HashMap::new(),
            next_id: 1,
            draining_since: None,
            created: unix_now(),
            outputs: Vec::new(),
            groups: HashMap::new(),
            responses: ResponseStore::new(responses_max.0, responses_max.1, responses_max.2),
            id_salt,
            next_group: 0,
            last_keep_alive: Instant::now(),
            traces,
            offers_traced: std::collections::BTreeMap::new(),
        })
    }

    /// Serves until a termination signal has been handled and the drain finished.
    pub(crate) fn run(mut self) -> std::io::Result<()> {
        let mut events = Vec::new();
        loop {
            self.server.poll(&mut events, Some(Duration::from_millis(20)))?;
            for ev in events.drain(..) {
                match ev {
                    HttpEvent::Request { conn, request } => {
                        let rid = self.request_id(&request);
                        let result = catch_unwind(AssertUnwindSafe(|| self.handle(conn, &rid, request)));
                        if result.is_err() {
                            // One request's bug: it gets a 500, everyone else is served on.
                            let e = ApiError::new(
                                ErrorKind::Internal,
                                "internal error while handling the request",
                            );
                            let _ = self.server.respond(conn, &Response::error(&e, Some(&rid)));
                        }
                    }
                    HttpEvent::Disconnected { conn, .. } => self.disconnected(conn),
                    HttpEvent::Io { .. } => {} // no sources of its own
                }
            }
            let mut outputs = std::mem::take(&mut self.outputs);
            self.engine.poll(Instant::now(), &mut outputs);
            for o in outputs.drain(..) {
                let id = o.id();
                let conn = self.live.get(&id).and_then(|l| l.conn);
                if catch_unwind(AssertUnwindSafe(|| self.output(o))).is_err() {
                    // One request's bug while rendering its answer (parsing its tool calls, say): it
                    // ends with an error, everyone else is served on.
                    let e = ApiError::new(ErrorKind::Internal, "internal error while rendering the answer");
                    if !self.fail(id, &e) {
                        // Taken off the table before the panic (its answer was being built): answer
                        // its connection anyway, or close it if its stream had started.
                        if let Some(c) = conn {
                            if self.server.respond(c, &Response::error(&e, None)).is_err() {
                                self.server.close(c);
                            }
                        }
                    }
                }
            }
            self.outputs = outputs;
            self.connections.tell(&self.server);
            self.keep_alive();
            if crate::sys::terminate_requested() && self.draining_since.is_none() {
                self.draining_since = Some(Instant::now());
            }
            if let Some(since) = self.draining_since {
                if since.elapsed() > self.config.drain_timeout {
                    for &id in self.live.keys() {
                        self.engine.abort(id);
                    }
                }
                // A stuck engine must not keep the process alive: past the drain timeout plus the grace,
                // whatever is left ends here (its clients see the connection close).
                let grace = self.config.engine.watchdog_grace * 2;
                // A prefill worker's answered requests leave `live` with their KV still offered:
                // it stays (within the drain timeout) until the decode side has pulled it.
                let offered = self.engine.health(Instant::now()).transfers;
                let done =
                    self.live.is_empty() && (offered == 0 || since.elapsed() > self.config.drain_timeout);
                if done || since.elapsed() > self.config.drain_timeout + grace {
                    // The last responses go out (a client too slow to take them within 5 s is cut).
                    let until = Instant::now() + Duration::from_secs(5);
                    while Instant::now() < until && self.server.unsent_total() > 0 {
                        self.server.poll(&mut events, Some(Duration::from_millis(20)))?;
                        events.clear();
                    }
                    return Ok(());
                }
            }
        }
    }

    fn request_id(&mut self, req: &Request) -> String {
        match req.request_id() {
            Some(id) => id.to_owned(),
            None => {
                self.next_id += 1;
                format!("req-{:x}-{}", unix_now(), self.next_id)
            }
        }
    }

    fn handle(&mut self, conn: ConnId, rid: &str, req: Request) {
        let path = req.path().to_owned();
        let inside = match self.authorize(&req, &path) {
            Ok(inside) => inside,
            Err(e) => {
                let _ = self.server.respond(conn, &Response::error_at(&path, &e, Some(rid)));
                return;
            }
        };
        let result = match (req.method.as_str(), path.as_str()) {
            ("GET", path::HEALTH_LIVE) => Ok(Some(Response::health(&Health::Live, None))),
            ("GET", path::HEALTH_READY | path::HEALTH) => Ok(Some(self.ready())),
            ("GET", path::HEALTH_GENERATE) => self.probe(conn, rid),
            ("GET", path::METRICS) => {
                self.connections.tell_spans(self.traces.as_ref());
                Ok(Some(
                    Response::text(200, self.engine.registry().render())
                        .header("content-type", "text/plain; version=0.0.4; charset=utf-8"),
                ))
            }
            ("GET", path::DEBUG_REQUESTS) => Ok(Some(self.debug_requests(&req))),
            ("GET", path::MODELS) => Ok(Some(self.models(rid))),
            ("GET", p) if path::model_id(p).is_some() => {
                self.model(path::model_id(p).unwrap_or(""), rid).map(Some)
            }
            ("POST", path::MESSAGES_COUNT_TOKENS) => self.count_tokens(&req, rid).map(Some),
            (m @ ("GET" | "DELETE"), p) if path::response_id(p).is_some() => {
                self.stored_response(m, path::response_id(p).unwrap_or(""), rid).map(Some)
            }
            ("GET", path::VERSION) => {
                Ok(Some(json_response(200, &json!({"version": env!("CARGO_PKG_VERSION")}), Some(rid))))
            }
            ("POST", path::TOKENIZE) => self.tokenize(&req, rid).map(Some),
            ("POST", path::DETOKENIZE) => self.detokenize(&req, rid).map(Some),
            ("POST", p) if Endpoint::from_path(p).is_some() => {
                let endpoint = Endpoint::from_path(p).unwrap_or(Endpoint::Chat);
                self.generate(conn, rid, &req, endpoint, inside)
            }
            ("POST", p) if p.starts_with("/abort/") => Ok(Some(self.abort(&p["/abort/".len()..]))),
            _ => Err(path::no_route(&req.method, &path, &[])),
        };
        match result {
            Ok(Some(resp)) => {
                let _ = self.server.respond(conn, &resp);
            }
            Ok(None) => {} // answered later, from the engine's outputs
            Err(e) => {
                let _ = self.server.respond(conn, &Response::error_at(&path, &e, Some(rid)));
            }
        }
    }

    fn probe(&mut self, conn: ConnId, rid: &str) -> Result<Option<Response>, ApiError> {
        if self.engine.info().role != Role::Unified {
            // A prefill or decode worker cannot finish a request alone; its readiness is the engine's.
            return Ok(Some(self.ready()));
        }
        let mut req =
            EngineRequest::new(rid, Input::Text("Hi".into()), Instant::now() + self.config.probe_timeout);
        req.max_tokens = Some(1);
        self.submit(conn, rid, req, Kind::Probe, Endpoint::Completion)?;
        Ok(None)
    }

    fn generate(
        &mut self,
        conn: ConnId,
        rid: &str,
        req: &Request,
        endpoint: Endpoint,
        inside: bool,
    ) -> Result<Option<Response>, ApiError> {
        if self.draining_since.is_some() {
            return Err(ApiError::new(
                ErrorKind::NotReady,
                "the worker is draining and takes no new requests",
            ));
        }
        let (g, responding) = if endpoint == Endpoint::Responses {
            let now = Instant::now();
            let previous = |id: &str| self.responses.items(id, now);
            let r = responses::read(&req.body, &previous, inside)?;
            let g = openai::parse_value(Endpoint::Chat, r.chat)?;
            // (As `Live::resumed`: the opening events went out from the worker before.)
            let resumed = g.resume.as_ref().is_some_and(|r| !r.tokens.is_empty());
            let stream =
                if inside && resumed { ResponseStream::resumed() } else { ResponseStream::default() };
            let kept_by_router = r.kept_by_router;
            (
                g,
                Some(Box::new(Responding {
                    echo: r.echo,
                    items: r.items,
                    store: r.store,
                    kept_by_router,
                    stream,
                })),
            )
        } else {
            (pdserve_codec::parse_generate(endpoint, &req.body)?, None)
        };
        self.check_model(g.model.as_deref())?;
        let role = self.engine.info().role;
        let input = match (g.pd_handles.first().cloned(), role) {
            // A handle makes this worker connect where it says: taken only from inside the stack.
            (Some(_), Role::Decode) if !inside => {
                let msg = format!("`{}` is taken only from the router (with the cluster secret)", pd::HANDLE_FIELD);
                return Err(ApiError::new(ErrorKind::Unauthorized, msg));
            }
            (Some(_), Role::Decode) if !self.handles_verify(&g.pd_handles) => {
                let msg = format!("`{}` does not verify: its tag is not the one this stack's secret gives its fields", pd::HANDLE_FIELD);
                return Err(ApiError::new(ErrorKind::Unauthorized, msg));
            }
            (Some(h), Role::Decode) => Input::Remote(h),
            (Some(_), _) => {
                let msg = format!("`{}` is only taken by a decode worker", pd::HANDLE_FIELD);
                return Err(ApiError::invalid(msg));
            }
            (None, _) if g.resume.is_some() && !inside => {
                let msg = format!("`{}` is taken only from the router (with the cluster secret)", pd::RESUME_FIELD);
                return Err(ApiError::new(ErrorKind::Unauthorized, msg));
            }
            (None, _) => match (&g.prompt, &g.suffix) {
                (Prompt::Messages(msgs), _) => Input::Chat(msgs.iter().map(chat_message).collect()),
                (Prompt::Text(t), None) => Input::Text(t.clone()),
                // Fill-in-the-middle in the model's own format.
                (Prompt::Text(t), Some(suffix)) => match &self.engine.info().fim {
                    Some([pre, suf, mid]) => Input::Text(format!("{pre}{t}{suf}{suffix}{mid}")),
                    None => {
                        return Err(ApiError::invalid(
                            "`suffix` is not supported: the served model's vocabulary has no fill-in-the-middle tokens",
                        ))
                    }
                },
                (Prompt::Tokens(t), _) => Input::Tokens(t.clone()),
            },
        };
        // The prompt's text, for `echo` (the decode worker of a pair reads it from the same body).
        let echo = match (&g.prompt, g.echo && role != Role::Prefill) {
            (Prompt::Text(t), true) => Some(t.clone()),
            (Prompt::Tokens(ids), true) => {
                Some(self.engine.codec().decode(ids, false).map_err(|e| ApiError::invalid(e.to_string()))?)
            }
            _ => None,
        };
        // Test hook: a prompt holding the trigger panics here, or with `@sample`, `@detokenize` or
        // `@output` after it, while that request is sampled, detokenized or rendered.
        let mut test_site = None;
        if let Some(trigger) = &self.config.panic_trigger {
            let text = match &g.prompt {
                Prompt::Messages(m) => m.iter().map(|m| m.content.as_str()).collect::<Vec<_>>().join("\n"),
                Prompt::Text(t) => t.clone(),
                Prompt::Tokens(_) => String::new(),
            };
            test_site = routes::test_panic_site(&text, trigger);
        }
        let timeout = req
            .header_str(header::DEADLINE_MS)
            .and_then(|v| v.parse::<u64>().ok())
            .map(Duration::from_millis)
            .or(g.timeout_s.map(Duration::from_secs_f64))
            .unwrap_or(self.config.default_timeout)
            .min(self.config.max_timeout);
        let mut er = EngineRequest::new(rid, input, Instant::now() + timeout);
        er.max_tokens = g.max_tokens.map(|m| m as usize);
        er.sampling = sampling(&g, &self.engine.info().sampling_defaults);
        er.seed = g.seed;
        er.priority = g.priority;
        er.stop = g.stop.clone();
        er.stop_token_ids = g.stop_token_ids.clone();
        er.ignore_eos = g.ignore_eos;
        er.logprobs = g.logprobs;
        let vocab = self.engine.info().vocab_size;
        if let Some((t, _)) = g.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            return Err(ApiError::invalid(format!(
                "`logit_bias` names token {t}, outside the vocabulary of {vocab}"
            )));
        }
        er.logit_bias = g.logit_bias.clone();
        er.min_tokens = g.min_tokens as usize;
        er.include_stop_str = g.include_stop_str_in_output;
        er.test_panic = test_site.flatten();
        er.resume = g.resume.as_ref().map(|r| r.tokens.clone()).unwrap_or_default();
        er.constraint = g.constraint.clone();
        er.tools = g.tools.clone();
        er.tool_choice = g.tool_choice.clone();
        er.parallel_tool_calls = g.parallel_tool_calls;
        er.chat_template_kwargs = g.chat_template_kwargs.clone();
        // Chat-like answers split a thinking model's thinking out (a decode worker cannot tell
        // from its input, the prefill worker's handle).
        er.reasoning = Some(endpoint != Endpoint::Completion);
        let thinks = self.engine.info().reasoning_format != pdserve_engine::ReasoningFormat::None;
        if endpoint == Endpoint::Messages
            && !thinks
            && g.chat_template_kwargs.get("enable_thinking") == Some(&json!(true))
        {
            return Err(ApiError::invalid(
                "`thinking`: the served model does not think (its chat template has no thinking)",
            ));
        }
        // Call ids from the client's request id (a moved request's own id names the try).
        er.tool_call_ids = Some(g.resume.as_ref().map_or(rid, |r| r.request_id.as_str()).to_owned());
        // A prefill worker answers with the KV handle, never a stream.
        let kind = Kind::Generate {
            stream: g.stream && role != Role::Prefill,
            include_usage: g.include_usage,
            logprobs: g.logprobs,
        };
        // Its span context here (`--otlp-traces-endpoint`), under the caller's `traceparent` or, called
        // without one, the one the KV handle carries from the prefill worker; `/debug/requests` names
        // the trace.
        let caller = req
            .header_str(header::TRACEPARENT)
            .map(str::to_owned)
            .or_else(|| g.pd_handles.first().and_then(|h| h.traceparent.clone()));
        let caller = caller.as_deref().and_then(pdserve_trace::TraceContext::parse);
        let trace = self.traces.is_some().then(|| trace::RequestTrace::new(caller));
        er.trace_id = trace.map(|t| t.ctx).or(caller).map(|c| c.trace_id_hex());
        let handoff = trace.map(|t| t.ctx).or(caller).map(|c| c.traceparent());
        if g.n > 1 {
            return self
                .start_group(conn, rid, er, g.n as usize, kind, endpoint, &g.pd_handles, echo)
                .map(|()| None);
        }
        self.submit(conn, rid, er, kind, endpoint)?;
        if let Some(l) = self.by_conn.get(&conn).and_then(|id| self.live.get_mut(id)) {
            l.trace = trace;
            l.handoff = handoff;
            l.echo = echo;
            l.panic_in_output = test_site == Some(None);
            l.marks =
                inside && g.stream && role != Role::Prefill && req.header_str(header::RESUMABLE).is_some();
            l.resp = responding;
            if let Some(r) = &g.resume {
                // The client's response, continued: its id and time.
                l.meta.id = endpoint.response_id(&r.request_id);
                l.meta.created = r.created.unwrap_or(l.meta.created);
                l.resumed = !r.tokens.is_empty();
            }
            if endpoint == Endpoint::Responses {
                // Stored responses are read back by id: one nobody can guess from a request id.
                let rid = g.resume.as_ref().map_or(rid, |r| r.request_id.as_str());
                l.meta.id = response_id(&self.id_salt, rid, l.meta.created);
            }
        }
        Ok(None)
    }

    fn submit(
        &mut self,
        conn: ConnId,
        rid: &str,
        req: EngineRequest,
        kind: Kind,
        endpoint: Endpoint,
    ) -> Result<(), ApiError> {
        let id = self.engine.submit(req).map_err(|e| e.to_api_error())?;
        let meta = Meta {
            endpoint,
            id: endpoint.response_id(rid),
            created: unix_now(),
            model: self.config.model_name.clone(),
        };
        let live = Live {
            conn: Some(conn),
            request_id: rid.to_owned(),
            kind,
            meta,
            started: false,
            text: String::new(),
            logprobs: Vec::new(),
            received: Instant::now(),
            calls: Vec::new(),
            call_open: None,
            blocks: MessageStream::default(),
            echo: None,
            group: None,
            choice: 0,
            panic_in_output: false,
            marks: false,
            resumed: false,
            last_sent: Instant::now(),
            resp: None,
            reasoning: String::new(),
            trace: None,
            handoff: None,
        };
        self.live.insert(id, live);
        self.by_conn.insert(conn, id);
        Ok(())
    }

    fn disconnected(&mut self, conn: ConnId) {
        if let Some(gid) = self.groups.iter().find(|(_, g)| g.conn == Some(conn)).map(|(&k, _)| k) {
            return self.group_abort(gid);
        }
        if let Some(id) = self.by_conn.remove(&conn) {
            if let Some(l) = self.live.get_mut(&id) {
                l.conn = None;
            }
            self.engine.abort(id);
        }
    }

    /// Sends framed server-sent events.
    fn send_frames(&mut self, id: Id, frames: &str) -> bool {
        let Some(l) = self.live.get_mut(&id) else { return false };
        l.last_sent = Instant::now();
        let Some(conn) = l.conn else { return false };
        if self.server.send_chunk(conn, frames.as_bytes()).is_err() {
            // The client is gone or not reading: end the request.
            self.disconnected(conn);
            self.server.close(conn);
            return false;
        }
        true
    }

    /// Marked streams that sent nothing for a while (waiting in the queue, preempted) get a keep-alive
    /// mark, while the engine loop runs: the router tells a request that waits from a worker that
    /// hangs by it.
    fn keep_alive(&mut self) {
        let now = Instant::now();
        if now.saturating_duration_since(self.last_keep_alive) < Duration::from_millis(500) {
            return;
        }
        self.last_keep_alive = now;
        if self.engine.health(now).tick_age > KEEP_ALIVE_AFTER {
            return;
        }
        let quiet: Vec<Id> = self
            .live
            .iter()
            .filter(|(_, l)| {
                l.marks && l.started && now.saturating_duration_since(l.last_sent) > KEEP_ALIVE_AFTER
            })
            .map(|(&id, _)| id)
            .collect();
        for id in quiet {
            self.send_frames(id, pd::mark::ALIVE);
        }
    }

    /// Ends live request `id` with `e`: the engine drops it, its client gets the error (an error
    /// event if its stream had started). False if it was not live.
    fn fail(&mut self, id: Id, e: &ApiError) -> bool {
        self.engine.abort(id);
        if let Some(gid) = self.live.get(&id).and_then(|l| l.group) {
            self.live.remove(&id);
            self.group_failed(gid, e);
            return true;
        }
        let Some(l) = self.remove(id) else { return false };
        let Some(conn) = l.conn else { return true };
        if !l.started {
            let _ = self.server.respond(conn, &Self::error_response(&l, e));
            return true;
        }
        let frames = pdserve_codec::stream_error_frames(&l.meta, e, &l.request_id);
        if self.server.send_chunk(conn, frames.as_bytes()).is_ok() {
            let _ = self.server.end_stream(conn);
        } else {
            self.server.close(conn);
        }
        true
    }

    /// Exports `l`'s spans, if it is traced.
    fn trace_end(
        &self,
        l: &Live,
        result: Result<&str, (String, String)>,
        usage: &pdserve_engine::Usage,
        timings: Option<&Timings>,
    ) {
        let (Some(x), Some(t)) = (self.traces.as_ref(), l.trace) else { return };
        let name = format!(
            "{} {}",
            if matches!(l.kind, Kind::Probe) { "probe" } else { "POST" },
            l.meta.endpoint.path()
        );
        let ended = trace::Ended {
            request_id: &l.request_id,
            name: &name,
            received: l.received,
            role: self.engine.info().role,
            result,
            prompt_tokens: usage.prompt_tokens as u64,
            completion_tokens: usage.completion_tokens as u64,
            timings,
        };
        trace::export(x, t, &ended);
    }

    fn remove(&mut self, id: Id) -> Option<Live> {
        let l = self.live.remove(&id)?;
        if let Some(conn) = l.conn {
            self.by_conn.remove(&conn);
        }
        Some(l)
    }

    fn error_response(l: &Live, e: &ApiError) -> Response {
        match l.kind {
            Kind::Probe => Response::health(&Health::GenerateFailed { reason: e.message.clone() }, None),
            Kind::Generate { .. } => Response::error_at(l.meta.endpoint.path(), e, Some(&l.request_id)),
        }
    }
}
