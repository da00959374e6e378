//! One streamed chat request over a blocking connection, every read under the request's deadline.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use pdserve_http::{Limits, ResponseDecoder, ResponseEvent, SseDecoder};
use serde_json::Value;

/// What happened to one request, as the client saw it.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
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
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.status == 200 && self.error.is_none() && self.terminal && !self.hung
    }
}

/// A kept-alive connection to one target, reopened after any failure.
#[derive(Debug)]
pub struct Conn {
    addr: SocketAddr,
    authority: String,
    stream: Option<TcpStream>,
    leave_after: Option<u64>,
}

impl Conn {
    pub fn new(addr: SocketAddr) -> Conn {
        Conn { addr, authority: addr.to_string(), stream: None, leave_after: None }
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
    ) -> Outcome {
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
    ) -> Outcome {
        self.leave_after = leave_after;
        let start = Instant::now();
        let mut out = Outcome::default();
        let hard = deadline + grace;
        let reused = self.stream.is_some();
        let mut result = self.exchange(path, body, hard, api_key, start, &mut out);
        // A kept-alive connection the server had already closed fails before a single byte of answer:
        // the request never reached it. Send it once more on a fresh connection.
        if reused && out.status == 0 && !out.terminal && result.as_ref().map_or(true, |_| out.error.is_some())
        {
            self.stream = None;
            out = Outcome::default();
            result = self.exchange(path, body, hard, api_key, start, &mut out);
        }
        out.e2e = start.elapsed();
        match result {
            Ok(reusable) => {
                if !reusable {
                    self.stream = None;
                }
            }
            Err(e) => {
                self.stream = None;
                if e.kind() == io::ErrorKind::TimedOut || e.kind() == io::ErrorKind::WouldBlock {
                    if !out.terminal {
                        out.hung = true;
                        out.error.get_or_insert_with(|| "hung".into());
                    }
                } else if !out.terminal {
                    let word = if out.status == 0 && e.kind() == io::ErrorKind::ConnectionRefused {
                        "connect"
                    } else {
                        "io"
                    };
                    out.error.get_or_insert_with(|| word.into());
                }
            }
        }
        out
    }

    fn exchange(
        &mut self,
        path: &str,
        body: &[u8],
        hard: Instant,
        api_key: Option<&str>,
        start: Instant,
        out: &mut Outcome,
    ) -> io::Result<bool> {
        let remaining = |now: Instant| hard.checked_duration_since(now).filter(|d| !d.is_zero());
        if self.stream.is_none() {
            let t = remaining(Instant::now()).ok_or(io::ErrorKind::TimedOut)?;
            let s = TcpStream::connect_timeout(&self.addr, t.min(Duration::from_secs(5)))?;
            s.set_nodelay(true)?;
            self.stream = Some(s);
        }
        let s = self.stream.as_mut().expect("connected above");
        let auth = api_key.map(|k| format!("authorization: Bearer {k}\r\n")).unwrap_or_default();
        let mut req = format!(
            "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n{auth}content-length: {}\r\n\r\n",
            self.authority,
            body.len()
        )
        .into_bytes();
        req.extend_from_slice(body);
        s.set_write_timeout(remaining(Instant::now()))?;
        s.write_all(&req)?;
        let leave_after = self.leave_after;
        let leave = |out: &mut Outcome| {
            out.client_left = true;
            out.terminal = true;
            out.error = Some("client_disconnect".into());
        };
        if leave_after == Some(0) {
            leave(out);
            return Ok(false);
        }
        let mut dec = ResponseDecoder::new(Limits { body_bytes_max: 64 << 20, ..Limits::default() }, false);
        let mut sse = SseDecoder::new(1 << 20);
        let mut sse_mode = false;
        let mut plain = Vec::new();
        let mut last_token: Option<Instant> = None;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let Some(t) = remaining(Instant::now()) else { return Err(io::ErrorKind::TimedOut.into()) };
            s.set_read_timeout(Some(t))?;
            let n = s.read(&mut buf)?;
            let mut events = Vec::new();
            if n == 0 {
                loop {
                    match dec.handle_eof() {
                        Ok(Some(e)) => events.push(e),
                        Ok(None) => break,
                        Err(_) => {
                            if !out.terminal {
                                out.error.get_or_insert_with(|| "closed".into());
                            }
                            break;
                        }
                    }
                }
            } else {
                dec.push(&buf[..n]);
                loop {
                    match dec.poll() {
                        Ok(Some(e)) => events.push(e),
                        Ok(None) => break,
                        Err(_) => {
                            out.error = Some("protocol".into());
                            return Ok(false);
                        }
                    }
                }
            }
            for ev in events {
                match ev {
                    ResponseEvent::Head(h) => {
                        out.status = h.status;
                        sse_mode =
                            h.header_str("content-type").is_some_and(|c| c.starts_with("text/event-stream"));
                    }
                    ResponseEvent::Data(d) if sse_mode => {
                        sse.push(&d);
                        while let Ok(Some(e)) = sse.next_event() {
                            on_sse(&e.data, start, &mut last_token, out);
                        }
                        if leave_after.is_some_and(|n| out.output_tokens >= n) && !out.terminal {
                            leave(out);
                            return Ok(false);
                        }
                    }
                    ResponseEvent::Data(d) => plain.extend_from_slice(&d),
                    ResponseEvent::End => {
                        if !sse_mode {
                            on_plain(&plain, start, out);
                        }
                        out.terminal = true;
                        return Ok(dec.is_reusable());
                    }
                }
            }
            if n == 0 {
                return Ok(false);
            }
        }
    }
}

fn on_sse(data: &str, start: Instant, last: &mut Option<Instant>, out: &mut Outcome) {
    if data == "[DONE]" {
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
    }
    read_stages(&v, out);
    if choice["finish_reason"].as_str() == Some("error") {
        out.error.get_or_insert_with(|| "finish_error".into());
    }
}

fn on_plain(body: &[u8], start: Instant, out: &mut Outcome) {
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
    read_stages(&v, out);
}

/// `timings` as this project's workers report it (`{"queue_ms":..,"prefill_ms":..}`), or llama.cpp's
/// (`prompt_ms`, `predicted_ms`).
fn read_stages(v: &Value, out: &mut Outcome) {
    if let Some(t) = v.get("timings").and_then(Value::as_object) {
        out.stages = t
            .iter()
            .filter(|(k, _)| k.ends_with("_ms") && !k.ends_with("per_token_ms"))
            .filter_map(|(k, x)| x.as_f64().map(|f| (k.clone(), f)))
            .collect();
    }
}
