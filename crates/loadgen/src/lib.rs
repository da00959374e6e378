//! A load generator for OpenAI-compatible endpoints, written for this project and usable against any
//! server that speaks `/v1/chat/completions` with SSE streaming (ours, llama.cpp's, vLLM's, SGLang's).
//!
//! Workloads ([`Load`]): a closed loop at a fixed concurrency, an open loop with Poisson arrivals, and
//! agents (N conversations of R rounds whose context grows every round with tool-call-like turns).
//! Every request streams; the client records time to first token, the gaps between tokens and the
//! end-to-end time; a request with no terminal event (final chunk, `[DONE]`, error, close) by its
//! deadline plus a grace period is counted as **hung** and its connection cut, so the generator itself
//! never waits without bound. [`PointResult`] holds the percentiles (hdrhistogram), goodput (requests
//! meeting both a TTFT and a per-token SLO, as DistServe defines it), errors by type, and the
//! generator's own CPU use.
//!
//! ```no_run
//! use pdserve_loadgen::{run_point, Load, Progress, Shape, Slo, Target};
//! let target = Target::parse("http://127.0.0.1:8000").unwrap();
//! let r = run_point(&target, &Load::Closed { concurrency: 4, requests: 16 }, &Shape::default(), &Slo::default(), &Progress::quiet());
//! println!("{:.1} req/s, p99 TTFT {:.0} ms, hung {}", r.requests_per_s(), r.ttft.p99_ms(), r.hung);
//! ```
#![forbid(unsafe_code)]

mod client;
mod stats;

/// The README's examples, compiled as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

use std::collections::BTreeMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

pub use client::{Conn, Observation};
pub use pdserve_telemetry::LatencySummary;
pub use stats::{PointResult, RoundResult};

/// An endpoint under test.
#[derive(Debug, Clone)]
pub struct Target {
    /// The target's name in every table: its URL, plus `+NAME` when [`Target::with_body`] set fields.
    pub url: String,
    pub addr: SocketAddr,
    /// Fields set in every request body sent to this target (e.g. a `response_format`).
    pub body_fields: serde_json::Map<String, serde_json::Value>,
}

impl Target {
    pub fn parse(url: &str) -> Result<Target, TargetError> {
        let authority = url
            .strip_prefix("http://")
            .ok_or_else(|| TargetError::NotHttp { url: url.to_owned() })?
            .trim_end_matches('/');
        let addr = authority
            .to_socket_addrs()
            .map_err(|error| TargetError::DoesNotResolve { url: url.to_owned(), error })?
            .next()
            .ok_or_else(|| TargetError::NoAddress { url: url.to_owned() })?;
        Ok(Target { url: format!("http://{authority}"), addr, body_fields: serde_json::Map::new() })
    }

    /// The same server under another name (`URL+name`) whose requests also carry `fields`: the same
    /// server with and without a feature, alternating as two targets.
    pub fn with_body(mut self, name: &str, fields: serde_json::Map<String, serde_json::Value>) -> Target {
        self.url = format!("{}+{name}", self.url);
        self.body_fields = fields;
        self
    }
}

/// The crate's one error: a target URL it cannot load.
#[derive(Debug)]
#[non_exhaustive]
pub enum TargetError {
    /// Not `http://host:port`.
    NotHttp { url: String },
    /// The resolver failed.
    DoesNotResolve { url: String, error: std::io::Error },
    /// The name resolved to no address.
    NoAddress { url: String },
}

impl std::fmt::Display for TargetError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TargetError::NotHttp { url } => write!(f, "{url}: only http:// targets"),
            TargetError::DoesNotResolve { url, error } => write!(f, "{url}: {error}"),
            TargetError::NoAddress { url } => write!(f, "{url}: no address"),
        }
    }
}

impl std::error::Error for TargetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TargetError::DoesNotResolve { error, .. } => Some(error),
            _ => None,
        }
    }
}

/// The offered load of one point.
#[derive(Debug, Clone, PartialEq)]
pub enum Load {
    /// `concurrency` clients, each sending its next request when the last one ends, `requests` in all.
    Closed { concurrency: usize, requests: usize },
    /// Requests arrive at `rate` per second (exponential gaps) for `duration`, served by at most
    /// `connections` at once; latencies count from the scheduled arrival.
    Poisson { rate: f64, duration: Duration, connections: usize },
    /// `agents` conversations of `rounds` requests each, run concurrently; every round appends the answer
    /// and a tool result of `tool_words` words, so the context grows.
    Agents { agents: usize, rounds: usize, tool_words: usize },
}

impl Load {
    pub fn label(&self) -> String {
        match self {
            Load::Closed { concurrency, .. } => format!("closed c={concurrency}"),
            Load::Poisson { rate, .. } => format!("poisson {rate}/s"),
            Load::Agents { agents, rounds, .. } => format!("agents {agents}x{rounds}"),
        }
    }

    /// The x value of this point on a chart (concurrency, rate, or agents).
    pub fn x(&self) -> f64 {
        match self {
            Load::Closed { concurrency, .. } => *concurrency as f64,
            Load::Poisson { rate, .. } => *rate,
            Load::Agents { agents, .. } => *agents as f64,
        }
    }
}

/// What each request looks like.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Words in a prompt (about 1.3 tokens each with common tokenizers).
    pub prompt_words: usize,
    pub max_tokens: u64,
    /// Ask the server to ignore end-of-sequence so every answer has `max_tokens` tokens.
    pub ignore_eos: bool,
    pub model: Option<String>,
    /// The request's deadline, also sent as `timeout` (seconds).
    pub timeout: Duration,
    /// Extra wait past the deadline before a request counts as hung.
    pub grace: Duration,
    pub api_key: Option<String>,
    /// One request in this many (0: none) is abandoned by its client: the connection is closed after
    /// 0-7 tokens, as a user who gives up would. Counted as `client_disconnect`, never as hung.
    pub disconnect_one_in: u64,
    /// Copy-heavy prompts (the `copy` workload): a tool's output of about `prompt_words` words as
    /// code lines, which the model is asked to write out again, answered greedily, as an agent
    /// editing a file does; what speculative decoding from the prompt is for.
    pub copy: bool,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            prompt_words: 75,
            max_tokens: 64,
            ignore_eos: true,
            model: None,
            timeout: Duration::from_secs(120),
            grace: Duration::from_secs(5),
            api_key: None,
            disconnect_one_in: 0,
            copy: false,
        }
    }
}

/// Service-level objectives for goodput.
#[derive(Debug, Clone, Copy)]
pub struct Slo {
    pub ttft: Duration,
    /// Mean time per output token after the first.
    pub tpot: Duration,
}

impl Default for Slo {
    fn default() -> Self {
        Slo { ttft: Duration::from_secs(5), tpot: Duration::from_millis(500) }
    }
}

/// Live counters a progress display reads.
#[derive(Debug, Default)]
pub struct Progress {
    pub done: AtomicU64,
    pub failed: AtomicU64,
    pub total: AtomicU64,
    pub quiet: bool,
}

impl Progress {
    pub fn quiet() -> Progress {
        Progress { quiet: true, ..Progress::default() }
    }
}

const WORDS: &[&str] = &[
    "river", "stone", "market", "signal", "garden", "engine", "harbor", "lantern", "copper", "meadow",
    "thunder", "ladder", "pocket", "winter", "canvas", "orbit", "pepper", "silver", "timber", "violet",
    "anchor", "bridge", "candle", "desert", "feather", "glacier", "hollow", "island", "jungle", "kettle",
    "lemon", "mirror",
];

/// Deterministic filler text: `n` words chosen by `seed`.
pub fn words(n: usize, seed: u64) -> String {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = String::with_capacity(n * 7);
    for i in 0..n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[(x % WORDS.len() as u64) as usize]);
    }
    out
}

fn body(target: &Target, shape: &Shape, messages: &serde_json::Value) -> Vec<u8> {
    let mut b = serde_json::json!({
        "messages": messages,
        "max_tokens": shape.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": if shape.copy { 0.0 } else { 0.7 },
        "timeout": shape.timeout.as_secs_f64(),
    });
    if shape.ignore_eos {
        b["ignore_eos"] = serde_json::Value::Bool(true);
    }
    if let Some(m) = &shape.model {
        b["model"] = serde_json::Value::String(m.clone());
    }
    for (k, v) in &target.body_fields {
        b[k] = v.clone();
    }
    serde_json::to_vec(&b).unwrap_or_default()
}

/// A number of this point of this run: every prompt starts with it, so no prompt of one point, or of
/// an earlier run against the same server, can be answered from a prefix cache (only the chat
/// template's opening, which every real request shares too).
fn point_nonce() -> u64 {
    static RUN: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    static POINT: AtomicU64 = AtomicU64::new(0);
    let run = *RUN.get_or_init(|| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        (nanos ^ (u64::from(std::process::id()) << 40)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
    });
    run.wrapping_add(POINT.fetch_add(1, Ordering::Relaxed).wrapping_mul(0xbf58_476d_1ce4_e5b9))
}

fn one_shot_messages(shape: &Shape, nonce: u64, i: u64) -> serde_json::Value {
    if shape.copy {
        return copy_messages(shape, nonce, i);
    }
    let text = format!(
        "Run {:08x} request {i}. Continue this list: {}",
        nonce >> 32,
        words(shape.prompt_words, nonce ^ i)
    );
    serde_json::json!([{"role": "user", "content": text}])
}

/// An agent's turn that copies: a file a tool read, as code lines made of this point's words, to be
/// written out again.
fn copy_messages(shape: &Shape, nonce: u64, i: u64) -> serde_json::Value {
    let w: Vec<String> = words(shape.prompt_words.max(6), nonce ^ i).split(' ').map(str::to_owned).collect();
    let lines: Vec<String> = w
        .chunks(6)
        .filter(|c| c.len() == 6)
        .map(|c| format!("    let {}_{} = {}.{}_{}({});", c[0], c[1], c[2], c[3], c[4], c[5]))
        .collect();
    let file = format!("fn {}_{i}() {{\n{}\n}}", w[0], lines.join("\n"));
    serde_json::json!([
        {"role": "system", "content": format!("Session {:08x}. You are a coding agent.", nonce >> 32)},
        {"role": "user", "content": format!(
            "Tool output (read_file src/{}.rs):\n```rust\n{file}\n```\nWrite this file out again exactly as it is, in a rust code block.",
            w[1]
        )},
    ])
}

fn send(
    conn: &mut Conn,
    target: &Target,
    shape: &Shape,
    messages: &serde_json::Value,
    seed: u64,
) -> Observation {
    let deadline = Instant::now() + shape.timeout;
    let mixed = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 17;
    let leave_after = (shape.disconnect_one_in > 0 && mixed.is_multiple_of(shape.disconnect_one_in))
        .then_some((mixed >> 8) % 8);
    conn.request_leaving_after(
        "/v1/chat/completions",
        &body(target, shape, messages),
        deadline,
        shape.grace,
        shape.api_key.as_deref(),
        leave_after,
    )
}

fn record(progress: &Progress, o: &Observation) {
    progress.done.fetch_add(1, Ordering::Relaxed);
    if !o.ok() {
        progress.failed.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs one point against one target and gathers its figures.
pub fn run_point(target: &Target, load: &Load, shape: &Shape, slo: &Slo, progress: &Progress) -> PointResult {
    let outcomes = Arc::new(Mutex::new(Vec::new()));
    let nonce = point_nonce();
    let cpu0 = stats::own_cpu_seconds();
    let started = Instant::now();
    progress.done.store(0, Ordering::Relaxed);
    progress.failed.store(0, Ordering::Relaxed);
    match load {
        Load::Closed { concurrency, requests } => {
            progress.total.store(*requests as u64, Ordering::Relaxed);
            let next = Arc::new(AtomicUsize::new(0));
            std::thread::scope(|s| {
                for _ in 0..(*concurrency).max(1) {
                    let (next, outcomes) = (Arc::clone(&next), Arc::clone(&outcomes));
                    s.spawn(move || {
                        let mut conn = Conn::new(target.addr);
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= *requests {
                                break;
                            }
                            let o = send(
                                &mut conn,
                                target,
                                shape,
                                &one_shot_messages(shape, nonce, i as u64),
                                i as u64,
                            );
                            record(progress, &o);
                            outcomes.lock().unwrap_or_else(|e| e.into_inner()).push(o);
                        }
                    });
                }
            });
        }
        Load::Poisson { rate, duration, connections } => {
            let expected = (rate * duration.as_secs_f64()).ceil() as u64;
            progress.total.store(expected, Ordering::Relaxed);
            let (tx, rx) = mpsc::sync_channel::<(u64, Instant)>(*connections * 4);
            let rx = Arc::new(Mutex::new(rx));
            let overflow = Arc::new(AtomicU64::new(0));
            std::thread::scope(|s| {
                for _ in 0..(*connections).max(1) {
                    let (rx, outcomes) = (Arc::clone(&rx), Arc::clone(&outcomes));
                    s.spawn(move || {
                        let mut conn = Conn::new(target.addr);
                        loop {
                            let job = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                            let Ok((i, scheduled)) = job else { break };
                            let waited = scheduled.elapsed();
                            let mut o =
                                send(&mut conn, target, shape, &one_shot_messages(shape, nonce, i), i);
                            // Open loop: time counts from the scheduled arrival, not from the send.
                            o.ttft = o.ttft.map(|t| t + waited);
                            o.e2e += waited;
                            record(progress, &o);
                            outcomes.lock().unwrap_or_else(|e| e.into_inner()).push(o);
                        }
                    });
                }
                let mut x: u64 = 0x2545_f491_4f6c_dd1d;
                let mut at = Instant::now();
                let end = at + *duration;
                let mut i = 0u64;
                while at < end {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let u = ((x >> 11) as f64 / (1u64 << 53) as f64).max(1e-12);
                    at += Duration::from_secs_f64(-u.ln() / rate.max(1e-9));
                    if let Some(d) = at.checked_duration_since(Instant::now()) {
                        std::thread::sleep(d);
                    }
                    if tx.try_send((i, at)).is_err() {
                        overflow.fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                }
                drop(tx);
            });
            let n = overflow.load(Ordering::Relaxed);
            let mut g = outcomes.lock().unwrap_or_else(|e| e.into_inner());
            for _ in 0..n {
                g.push(Observation { error: Some("generator_backlog".into()), ..Observation::default() });
            }
        }
        Load::Agents { agents, rounds, tool_words } => {
            progress.total.store((agents * rounds) as u64, Ordering::Relaxed);
            // One system prompt for every agent of the point (as a harness has), unique to the point.
            let system = format!("Session {:08x}. You are a coding agent. Work in small steps. After each step a tool runs and its output follows. Keep answers short.", nonce >> 32);
            let system = system.as_str();
            std::thread::scope(|s| {
                for a in 0..*agents {
                    let outcomes = Arc::clone(&outcomes);
                    s.spawn(move || {
                        let mut conn = Conn::new(target.addr);
                        let mut messages = vec![
                            serde_json::json!({"role": "system", "content": system}),
                            serde_json::json!({"role": "user", "content": format!("Run {:08x} task {a}: sort these items: {}", nonce >> 32, words(shape.prompt_words, nonce ^ (a as u64 + 1000)))}),
                        ];
                        for r in 0..*rounds {
                            let seed = (a * 1000 + r) as u64;
                            let mut o =
                                send(&mut conn, target, shape, &serde_json::Value::Array(messages.clone()), seed);
                            o.agent_round = Some((a as u32, r as u32));
                            record(progress, &o);
                            // A turn its own client abandoned is retried by the agent in the next round; a turn the
                            // server failed ends the agent, as a harness would after its retries.
                            let ok = o.ok() || o.client_left;
                            messages.push(serde_json::json!({"role": "assistant", "content": o.text.clone()}));
                            messages.push(serde_json::json!({"role": "user", "content": format!(
                                "Tool output (call {r}): exit 0. {}", words(*tool_words, nonce ^ (a * 1000 + r) as u64))}));
                            outcomes.lock().unwrap_or_else(|e| e.into_inner()).push(o);
                            if !ok {
                                // An agent whose turn failed stops, as a harness would after retries.
                                break;
                            }
                        }
                    });
                }
            });
        }
    }
    let wall = started.elapsed();
    let cpu = stats::own_cpu_seconds() - cpu0;
    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap_or_else(|e| e.into_inner()));
    PointResult::from_outcomes(&target.url, load, &outcomes, wall, cpu, slo)
}

/// Prints a one-line progress bar to stderr every 250 ms until `stop` is set (only when stderr is a
/// terminal: a log file gets no bar).
pub fn progress_bar(
    label: String,
    progress: Arc<Progress>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
    std::thread::spawn(move || {
        if !tty {
            return;
        }
        let start = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            if !progress.quiet {
                let done = progress.done.load(Ordering::Relaxed);
                let total = progress.total.load(Ordering::Relaxed).max(1);
                let width = 30;
                let filled = ((done as f64 / total as f64).min(1.0) * width as f64) as usize;
                eprint!(
                    "\r{label:<48} [{}{}] {done}/{total} failed {} {:.0}s   ",
                    "#".repeat(filled),
                    ".".repeat(width - filled),
                    progress.failed.load(Ordering::Relaxed),
                    start.elapsed().as_secs_f64()
                );
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        if !progress.quiet {
            eprint!("\r{}\r", " ".repeat(100));
        }
    })
}

/// Stage timings summed over successful requests: `(mean ms, count)` per stage name.
pub fn stage_means(outcomes: &[Observation]) -> BTreeMap<String, (f64, u64)> {
    let mut m: BTreeMap<String, (f64, u64)> = BTreeMap::new();
    for o in outcomes.iter().filter(|o| o.ok()) {
        for (k, v) in &o.stages {
            let e = m.entry(k.clone()).or_default();
            e.0 += v;
            e.1 += 1;
        }
    }
    for v in m.values_mut() {
        v.0 /= v.1.max(1) as f64;
    }
    m
}
