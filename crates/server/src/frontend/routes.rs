//! The routes that are not a generation: `/tokenize`, `/detokenize`, `/v1/models`, readiness,
//! `/debug/requests` and `/abort/{id}`; who may call any route (`authorize`); the panic test hook.

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pdserve_api::header::{self, secret_matches};
use pdserve_api::{path, ApiError, ErrorKind, Health, Stage};
use pdserve_codec::{anthropic, openai, Prompt};
use pdserve_engine::{Aborted, Input, PanicSite};
use pdserve_http::{Request, Response};
use serde_json::json;

use super::{chat_message, choices, json_response, Frontend};

/// The client connections' series: open now, and closed after idling past the keep-alive; and the
/// trace exporter's spans (`--otlp-traces-endpoint`), exported or dropped.
pub(super) struct HttpMetrics {
    open: pdserve_telemetry::Gauge,
    idle_closed: pdserve_telemetry::Counter,
    otlp_spans: pdserve_telemetry::CounterVec,
}

impl HttpMetrics {
    pub(super) fn register(r: &pdserve_telemetry::Registry) -> std::io::Result<HttpMetrics> {
        let e = |e: pdserve_telemetry::TelemetryError| std::io::Error::other(e.to_string());
        Ok(HttpMetrics {
            open: r.gauge("http_connections", "Open client connections.").map_err(e)?,
            idle_closed: r
                .counter(
                    "http_idle_closed_total",
                    "Client connections closed after sitting idle past --keep-alive-timeout-s.",
                )
                .map_err(e)?,
            otlp_spans: r
                .counter_vec(
                    "otlp_spans_total",
                    "Spans for --otlp-traces-endpoint: exported (the collector took them) or dropped (a \
                     full queue, or a batch the collector refused or never answered).",
                    &["result"],
                )
                .map_err(e)?,
        })
    }

    /// vLLM's names for the engine's load and cache metrics, which endpoint pickers (the Gateway API
    /// Inference Extension's, llm-d's) scrape by default: aliases read from the engine's own series
    /// at each scrape, with vLLM's `model_name` and `engine` labels and vLLM's semantics (the crate README lists
    /// them). No LoRA adapters are served, so `vllm:lora_requests_info` names none.
    pub(super) fn register_vllm_aliases(r: &pdserve_telemetry::Registry, model: &str) -> std::io::Result<()> {
        use pdserve_telemetry::{AliasSource, MetricKind};
        let e = |e: pdserve_telemetry::TelemetryError| std::io::Error::other(e.to_string());
        let labels = [("model_name", model), ("engine", "0")];
        let aliases = [
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed (requests_waiting).",
             MetricKind::Gauge, AliasSource::all("requests_waiting")),
            ("vllm:num_requests_running", "Number of requests in model execution batches (requests_running).",
             MetricKind::Gauge, AliasSource::all("requests_running")),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage (kv_cache_usage_ratio).",
             MetricKind::Gauge, AliasSource::all("kv_cache_usage_ratio")),
            ("vllm:prefix_cache_queries_total",
             "Prefix cache queries, in terms of number of queried tokens (prefix_cache_tokens_total).",
             MetricKind::Counter, AliasSource::all("prefix_cache_tokens_total")),
            ("vllm:prefix_cache_hits_total",
             "Prefix cache hits, in terms of number of cached tokens (prefix_cache_tokens_total{result=\"hit\"}).",
             MetricKind::Counter, AliasSource::only("prefix_cache_tokens_total", "result", "hit")),
        ];
        for (name, help, kind, source) in aliases {
            r.peer_alias(name, help, kind, &labels, source).map_err(e)?;
        }
        let lora = [("max_lora", "0"), ("waiting_lora_adapters", ""), ("running_lora_adapters", "")];
        r.peer_alias(
            "vllm:lora_requests_info",
            "Running stats on LoRA requests: none are served (the value is the scrape's Unix time, as vLLM sets it).",
            MetricKind::Gauge,
            &lora,
            AliasSource::UnixTime,
        )
        .map_err(e)
    }

    /// The exporter's counts, read at each scrape (a batch may fail after the last request ended).
    pub(super) fn tell_spans(&self, exporter: Option<&pdserve_trace::Exporter>) {
        let Some(x) = exporter else { return };
        for (result, total) in x.stats().spans_by_result() {
            if let Ok(c) = self.otlp_spans.with(&[result]) {
                c.add(total.saturating_sub(c.get()));
            }
        }
    }

    pub(super) fn tell(&self, server: &pdserve_http::Server) {
        self.open.set(server.connection_count() as f64);
        let closed = server.stats().idle_timeouts_total;
        self.idle_closed.add(closed.saturating_sub(self.idle_closed.get()));
    }
}

impl Frontend {
    pub(super) fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model.filter(|m| !m.is_empty() && *m != self.config.model_name) {
            Some(m) => Err(ApiError::new(
                ErrorKind::ModelNotFound,
                format!("model {m:?} is not served here (serving {:?})", self.config.model_name),
            )),
            None => Ok(()),
        }
    }

    /// `POST /tokenize`: the token ids a request with this prompt or these messages would have.
    pub(super) fn tokenize(&self, req: &Request, rid: &str) -> Result<Response, ApiError> {
        let tokens = self.token_ids(openai::parse_tokenize(&req.body)?)?;
        let body = json!({"count": tokens.len(), "max_model_len": self.engine.info().context_tokens, "tokens": tokens});
        Ok(json_response(200, &body, Some(rid)))
    }

    /// `POST /v1/messages/count_tokens` (Anthropic's): the prompt tokens of a Messages request, tools
    /// and system included, as its generation would count them.
    pub(super) fn count_tokens(&self, req: &Request, rid: &str) -> Result<Response, ApiError> {
        let chat = anthropic::count_tokens_chat_body(&req.body)?;
        let mut body = serde_json::Map::new();
        for k in ["model", "messages", "tools", "chat_template_kwargs"] {
            if let Some(v) = chat.get(k) {
                body.insert(k.to_owned(), v.clone());
            }
        }
        let t = openai::parse_tokenize(serde_json::Value::Object(body).to_string().as_bytes())?;
        let tokens = self.token_ids(t)?;
        Ok(json_response(200, &json!({"input_tokens": tokens.len()}), Some(rid)))
    }

    fn token_ids(&self, t: pdserve_codec::openai::TokenizeRequest) -> Result<Vec<u32>, ApiError> {
        self.check_model(t.model.as_deref())?;
        let input = match &t.prompt {
            Prompt::Messages(msgs) => Input::Chat(msgs.iter().map(chat_message).collect()),
            Prompt::Text(s) => Input::Text(s.clone()),
            Prompt::Tokens(ids) => Input::Tokens(ids.clone()),
        };
        self.engine.tokenize(&input, &t.tools, &t.chat_template_kwargs).map_err(|e| e.to_api_error())
    }

    /// `POST /detokenize`: the text of token ids.
    pub(super) fn detokenize(&self, req: &Request, rid: &str) -> Result<Response, ApiError> {
        let (model, tokens) = openai::parse_detokenize(&req.body)?;
        self.check_model(model.as_deref())?;
        let vocab = self.engine.info().vocab_size;
        if let Some(t) = tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(ApiError::invalid(format!("token id {t} is outside the vocabulary of {vocab}")));
        }
        let text =
            self.engine.codec().decode(&tokens, false).map_err(|e| ApiError::invalid(e.to_string()))?;
        Ok(json_response(200, &json!({"prompt": text}), Some(rid)))
    }

    /// `GET /v1/responses/{id}`: a stored response; `DELETE` forgets it. 404 for one not kept (never
    /// stored, `store: false`, or past the store's count or age limit).
    pub(super) fn stored_response(
        &mut self,
        method: &str,
        id: &str,
        rid: &str,
    ) -> Result<Response, ApiError> {
        let gone = || ApiError::new(ErrorKind::NotFound, format!("response {id:?} is not stored here"));
        if method == "DELETE" {
            if !self.responses.delete(id) {
                return Err(gone());
            }
            return Ok(json_response(
                200,
                &json!({"id": id, "object": "response", "deleted": true}),
                Some(rid),
            ));
        }
        let r = self.responses.response(id, Instant::now()).ok_or_else(gone)?;
        Ok(json_response(200, &r, Some(rid)))
    }

    /// `GET /v1/models`: the one model this worker serves, with what it runs on.
    pub(super) fn models(&self, rid: &str) -> Response {
        json_response(200, &json!({"object": "list", "data": [self.model_json()]}), Some(rid))
    }

    /// `GET /v1/models/{id}` (the openai SDK's `models.retrieve`): the model, or 404 for another id.
    pub(super) fn model(&self, id: &str, rid: &str) -> Result<Response, ApiError> {
        if id != self.config.model_name {
            let msg = format!("model {id:?} is not served here (serving {:?})", self.config.model_name);
            return Err(ApiError::new(ErrorKind::ModelNotFound, msg));
        }
        Ok(json_response(200, &self.model_json(), Some(rid)))
    }

    fn model_json(&self) -> serde_json::Value {
        let info = self.engine.info();
        let model = json!({"id": self.config.model_name, "object": "model", "created": self.created,
            "owned_by": "pdserve", "max_model_len": info.context_tokens, "device": info.device.to_string(),
            "weights": info.weights.name(), "activations": info.activations, "multi_row_weights": info.multi_row_weights, "kv_dtype": info.kv_dtype.name(),
            "weight_bytes": info.weight_bytes, "kv_bytes": info.kv_bytes, "kv_bytes_per_token": info.kv_bytes_per_token, "speculative": info.speculative,
            "cpu_cores": self.config.cpu_cores, "compute_threads": std::thread::available_parallelism().map_or(1, usize::from),
            "cpu_kernels": pdserve_engine::cpu_kernels().name(), "role": info.role.as_str(),
            "tool_parser": info.tool_format.name(), "reasoning_parser": info.reasoning_format.name(),
            "unauthenticated": self.config.unauthenticated(), "kv_events": info.kv_events,
            "kv_groups": info.kv_groups.iter().map(|g| json!({"name": g.name, "layers": g.layers,
                "window": match g.kind { pdserve_engine::KvLayerKind::Sliding { window } => Some(window), _ => None },
                "tokens_per_row": g.kind.ratio(), "bytes_per_token": g.bytes_per_token()})).collect::<Vec<_>>(),
            "kv_state_bytes_per_request": info.kv_state_bytes,
            "kv_rows": info.kv_rows.iter().map(|(name, b)| json!({"name": name, "bytes_per_token": b})).collect::<Vec<_>>()});
        model
    }

    /// 200 while the engine loop turns and, with work in it, tokens come out; 503 with the reason.
    pub(super) fn ready(&self) -> Response {
        let now = Instant::now();
        let h = self.engine.health(now);
        let busy = h.queued + h.running;
        let ms = |d: Duration| d.as_millis() as u64;
        let reason = if self.draining_since.is_some() {
            Some("draining: not taking new requests".to_owned())
        } else if h.tick_age > self.config.ready_tick {
            Some(format!("engine loop has not ticked for {} ms", ms(h.tick_age)))
        } else if busy > 0
            && h.token_age.is_none_or(|a| a > self.config.ready_token)
            && h.oldest > self.config.ready_token
        {
            Some(format!(
                "{busy} requests in the engine and no token for {} ms",
                ms(h.token_age.unwrap_or(h.oldest))
            ))
        } else {
            None
        };
        let health = match reason {
            None => {
                Health::Ready { details: json!({"engine_tick_age_ms": ms(h.tick_age), "requests": busy}) }
            }
            Some(reason) => Health::NotReady { reason },
        };
        Response::health(&health, None)
    }

    pub(super) fn debug_requests(&self, req: &Request) -> Response {
        let older = req
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("older_than_ms=")))
            .and_then(|v| v.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        let unix_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
        json_response(200, &self.engine.debug_requests(Instant::now(), unix_ms, older), None)
    }

    pub(super) fn abort(&mut self, request_id: &str) -> Response {
        // The other choices of an `n` > 1 request, if it is one (`{id}.1`, `{id}.2`, ...).
        for i in 1..openai::N_MAX as usize {
            self.engine.abort_request(&choices::member_id(request_id, i));
        }
        match self.engine.abort_request(request_id) {
            Some(Aborted::InFlight(_)) => {
                json_response(200, &json!({"aborted": request_id}), Some(request_id))
            }
            Some(Aborted::Offered(_)) => json_response(
                200,
                &json!({"aborted": request_id, "stage": Stage::KvHeld.as_str()}),
                Some(request_id),
            ),
            None => Response::error(
                &ApiError::new(ErrorKind::NotFound, format!("no live request {request_id}")),
                Some(request_id),
            ),
        }
    }

    /// A KV handle this prefill worker answers: tagged under the stack's secret where there is one.
    pub(super) fn signed(&self, h: pdserve_api::pd::PdHandle) -> pdserve_api::pd::PdHandle {
        match self.config.cluster_secret.as_deref() {
            Some(s) => h.signed(s),
            None => h,
        }
    }

    /// Whether a decode worker may take `handles`: with a secret, only those carrying the tag a
    /// prefill worker of this stack made over their fields (without one, any: an open stack).
    pub(super) fn handles_verify(&self, handles: &[pdserve_api::pd::PdHandle]) -> bool {
        let secret = self.config.cluster_secret.as_deref();
        secret.is_none_or(|s| handles.iter().all(|h| h.verifies(s)))
    }

    /// Whether `req` may be served: `/v1/*` with the worker's API key if it has one; with a cluster
    /// secret, everything else only with the secret (the probes without it when they are open).
    /// `Ok(true)`: it came from inside the stack (the secret, or a worker with neither secret nor
    /// key, open as on one trusted host), so it may carry a KV handle.
    pub(super) fn authorize(&self, req: &Request, path: &str) -> Result<bool, ApiError> {
        let c = &self.config;
        let secret = c.cluster_secret.as_deref();
        if secret.is_some_and(|s| secret_matches(req.header_str(header::CLUSTER_SECRET), s)) {
            return Ok(true);
        }
        if let Some(key) = c.api_key.as_deref().filter(|_| path.starts_with("/v1/")) {
            let bearer = req.header_str(header::AUTHORIZATION).and_then(|h| h.strip_prefix("Bearer "));
            if secret_matches(bearer, key) || secret_matches(req.header_str(header::API_KEY), key) {
                return Ok(false);
            }
            let msg = "missing or wrong API key (Authorization: Bearer ... or x-api-key)";
            return Err(ApiError::new(ErrorKind::Unauthorized, msg));
        }
        let probe = matches!(path, path::HEALTH_LIVE | path::HEALTH_READY | path::HEALTH | path::METRICS)
            || path == path::HEALTH_GENERATE;
        match secret {
            None => Ok(c.api_key.is_none()),
            Some(_) if probe && c.open_probes => Ok(false),
            Some(_) => {
                let msg = format!(
                    "this worker serves its stack only: missing or wrong `{}`",
                    header::CLUSTER_SECRET
                );
                Err(ApiError::new(ErrorKind::Unauthorized, msg))
            }
        }
    }
}

/// Test hook: where a prompt holding `trigger` asks to panic. `None`: it does not hold it; `Some(None)`
/// with `@output` after it (rendering the answer); `Some(Some(site))` with `@sample` or `@detokenize`.
/// Anything else after the trigger panics right here, in the request handler.
pub(super) fn test_panic_site(text: &str, trigger: &str) -> Option<Option<PanicSite>> {
    let at = text.find(trigger)?;
    let rest = &text[at + trigger.len()..];
    let site = rest.strip_prefix('@').and_then(|r| r.split(|c: char| !c.is_ascii_alphabetic()).next());
    match site {
        Some("sample") => Some(Some(PanicSite::Sampling)),
        Some("detokenize") => Some(Some(PanicSite::Detokenizing)),
        Some("output") => Some(None),
        _ => panic!("test panic trigger in the prompt"),
    }
}
