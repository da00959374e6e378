//! One chat request, streamed or not, over the workspace's HTTP client, every read under the request's
//! deadline.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use pdserve_http::{ClientConfig, Header, HttpClient, HttpError, Limits, PoolConfig, Request, SseDecoder};
use serde_json::Value;

/// What happened to one request, as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct Observation {
    /// HTTP status (0: none arrived).
    pub status: u16,
    /// The error `type` from a JSON error body or an SSE error event, or a client-side word
    /// (`connect`, `io`, `protocol`, `hung`).
    pub error: Option<String>,
    /// From send to the first content token.
    pub ttft: Option<Duration>,
    /// Gaps between consecutive content chunks.
    pub itl: Vec<Duration>,
    /// From send to the terminal event.
    pub e2e: Duration,
    /// Content chunks seen (usage's `completion_tokens` when reported).
    pub output_tokens: u64,
    pub prompt_tokens: u64,
    /// The assistant's text (agents append it to their conversation).
    pub text: String,
    /// A terminal event arrived: a final chunk, `[DONE]`, an error, or a whole non-streamed answer.
    pub terminal: bool,
    /// No terminal event before the deadline plus grace: the connection was cut by the client.
    pub hung: bool,
    /// Per-stage times the server reported (`timings` in the final chunk), in milliseconds.
    pub stages: Vec<(String, f64)>,
    /// The client itself closed the connection before the end (see `Shape::disconnect_one_in`).
    pub client_left: bool,
    /// Prompt tokens the server says it found cached (`usage.prompt_tokens_details.cached_tokens`).
    pub cached_tokens: Option<u64>,
    /// KV bytes a disaggregated server pulled between its workers for this request
    /// (`timings.kv_pulled_bytes`, this project's decode workers).
    pub kv_pulled_bytes: Option<u64>,
    /// Agents workload: which agent sent it, in which round.
    pub agent_round: Option<(u32, u32)>,
}

impl Observation {
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none() && self.terminal && !self.hung
    }

    /// Time per output token after the first: (e2e - TTFT) / (output tokens - 1), whatever the
    /// server's event sizes (vLLM's TPOT); `None` with fewer than two tokens or no first token.
    pub fn tpot(&self) -> Option<Duration> {
        let decode = self.e2e.checked_sub(self.ttft?)?;
        (self.output_tokens > 1).then(|| decode / (self.output_tokens - 1) as u32)
    }
}

/// A kept-alive connection to one target (`pdserve_http::HttpClient` with a pool of one), reopened
/// after any failure; a pooled connection the server had closed is retried by the client itself.
#[derive(Debug)]
pub struct Conn {
    addr: SocketAddr,
    authority: String,
    client: HttpClient,
}

impl Conn {
    pub fn new(addr: SocketAddr) -> Conn {
        let config = ClientConfig {
            pool: PoolConfig {
                connections_per_upstream_max: 1,
                waiters_per_upstream_max: 1,
                ..PoolConfig::default()
            },
            connect_timeout: Duration::from_secs(5),
            limits: Limits { body_bytes_max: 64 << 20, ..Limits::default() },
        };
        Conn { addr, authority: addr.to_string(), client: HttpClient::new(config) }
    }

    /// Sends `body` to `path` and reads the answer, streamed or not, until a terminal event, the
    /// connection's end, or `deadline + grace`.
    pub fn request(
        &mut self,
        path: &str,
        body: &[u8],
        deadline: Instant,
        grace: Duration,
        api_key: Option<&str>,
    ) -> Observation {
        self.request_leaving_after(path, body, deadline, grace, api_key, None)
    }

    /// As [`request`](Self::request), but with `leave_after: Some(n)` the client closes the connection
    /// once `n` content tokens have arrived (0: right after sending), as a user who gives up.
    pub fn request_leaving_after(
        &mut self,
        path: &str,
        body: &[u8],
        deadline: Instant,
        grace: Duration,
        api_key: Option<&str>,
        leave_after: Option<u64>,
    ) -> Observation {
        let start = Instant::now();
        let hard = deadline + grace;
        let mut req = Request::new("POST", path);
        req.body = body.to_vec();
        let mut header = |name: &str, value: String| {
            req.headers.push(Header { name: name.into(), value: value.into_bytes() })
        };
        header("host", self.authority.clone());
        header("content-type", "application/json".into());
        if let Some(k) = api_key {
            header(pdserve_api::header::AUTHORIZATION, format!("Bearer {k}"));
        }
        let mut out = Observation::default();
        let leave = |out: &mut Observation| {
            out.client_left = true;
            out.terminal = true;
            out.error = Some("client_disconnect".into());
        };
        if leave_after == Some(0) {
            match self.client.send_and_leave(self.addr, &req, hard) {
                Ok(()) => leave(&mut out),
                Err(e) => out.error = Some(word(&e, &out).into()),
            }
            out.e2e = start.elapsed();
            return out;
        }
        let mut resp = match self.client.send(self.addr, &req, hard) {
            Ok(r) => r,
            Err(e) => {
                out.hung = matches!(e, HttpError::DeadlineExceeded);
                out.error = Some(word(&e, &out).into());
                out.e2e = start.elapsed();
                return out;
            }
        };
        out.status = resp.status();
        let sse_mode =
            resp.head().header_str("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
        let mut sse = SseDecoder::new(1 << 20);
        let mut plain = Vec::new();
        let mut last_token: Option<Instant> = None;
        loop {
            match resp.next_chunk() {
                Ok(Some(d)) if sse_mode => {
                    sse.push(&d);
                    while let Ok(Some(e)) = sse.next_event() {
                        on_sse(&e.data, start, &mut last_token, &mut out);
                    }
                    if leave_after.is_some_and(|n| out.output_tokens >= n) && !out.terminal {
                        // Dropping the response closes the connection mid-answer.
                        leave(&mut out);
                        break;
                    }
                }
                Ok(Some(d)) => plain.extend_from_slice(&d),
                Ok(None) => {
                    if !sse_mode {
                        on_plain(&plain, start, &mut out);
                    }
                    out.terminal = true;
                    break;
                }
                Err(e) => {
                    if !out.terminal {
                        out.hung = matches!(e, HttpError::DeadlineExceeded);
                        let w = word(&e, &out);
                        out.error.get_or_insert_with(|| w.into());
                    }
                    break;
                }
            }
        }
        out.e2e = start.elapsed();
        out
    }
}

/// The client-side word for a failure: `hung`, `connect`, `protocol`, `closed` or `io`.
fn word(e: &HttpError, out: &Observation) -> &'static str {
    match e {
        HttpError::DeadlineExceeded => "hung",
        HttpError::Connect(c) if c.kind() == io::ErrorKind::ConnectionRefused => "connect",
        HttpError::UnexpectedEof => "closed",
        HttpError::Io(e) if out.status != 0 && e.kind() == io::ErrorKind::UnexpectedEof => "closed",
        HttpError::Io(_)
        | HttpError::Connect(_)
        | HttpError::AcquireTimeout { .. }
        | HttpError::TooManyWaiters { .. } => "io",
        _ => "protocol",
    }
}

/// One stream event. Error `type` words are read as the server wrote them (not through
/// `pdserve_api::ApiError`, which knows only this project's words), so peers' errors keep their names.
fn on_sse(data: &str, start: Instant, last: &mut Option<Instant>, out: &mut Observation) {
    if data == pdserve_codec::openai::DONE {
        out.terminal = true;
        return;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else { return };
    if let Some(t) = v["error"]["type"].as_str().or_else(|| v["error"]["code"].as_str()) {
        out.error = Some(t.to_owned());
        return;
    }
    if v.get("error").is_some_and(|e| !e.is_null()) {
        out.error = Some("error_event".into());
        return;
    }
    let choice = &v["choices"][0];
    let piece = choice["delta"]["content"].as_str().or_else(|| choice["text"].as_str()).unwrap_or("");
    if !piece.is_empty() {
        let now = Instant::now();
        match *last {
            None => out.ttft = Some(now - start),
            Some(prev) => out.itl.push(now - prev),
        }
        *last = Some(now);
        out.output_tokens += 1;
        out.text.push_str(piece);
    }
    if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
        out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(out.output_tokens);
        out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0);
        out.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
    }
    read_stages(&v, out);
    if choice["finish_reason"].as_str() == Some("error") {
        out.error.get_or_insert_with(|| "finish_error".into());
    }
}

fn on_plain(body: &[u8], start: Instant, out: &mut Observation) {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        if out.status != 200 {
            out.error = Some(format!("http_{}", out.status));
        }
        return;
    };
    if out.status != 200 {
        out.error =
            Some(v["error"]["type"].as_str().map_or_else(|| format!("http_{}", out.status), str::to_owned));
        return;
    }
    out.ttft = Some(start.elapsed());
    let choice = &v["choices"][0];
    out.text =
        choice["message"]["content"].as_str().or_else(|| choice["text"].as_str()).unwrap_or("").to_owned();
    out.output_tokens = v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
    out.prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap_or(0);
    out.cached_tokens = v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
    read_stages(&v, out);
}

/// `timings` as this project's workers report it (`{"queue_ms":..,"prefill_ms":..}`), or llama.cpp's
/// (`prompt_ms`, `predicted_ms`).
fn read_stages(v: &Value, out: &mut Observation) {
    if let Some(t) = v.get("timings").and_then(Value::as_object) {
        out.stages = t
            .iter()
            .filter(|(k, _)| k.ends_with("_ms") && !k.ends_with("per_token_ms"))
            .filter_map(|(k, x)| x.as_f64().map(|f| (k.clone(), f)))
            .collect();
        out.kv_pulled_bytes = t.get("kv_pulled_bytes").and_then(Value::as_f64).map(|b| b as u64);
    }
}
