//! Precise prefix routing (`--tokenizer DIR`): the router subscribes to the KV events of every worker
//! that publishes them (its `/v1/models` card names the endpoints, `--kv-events-config` on the
//! worker), keeps a [`KvIndex`] of what each holds, and tokenizes each request as the workers do
//! (the same `TextCodec`: chat template, tools, `chat_template_kwargs`) to find the prompt's blocks
//! there.
//!
//! One thread per worker: it reads the card, subscribes, replays the history the publisher still
//! buffers, then applies batches as they come, replaying a gap when one shows. Every step has a
//! deadline; a failure makes the worker unknown to the index (routed by the approximate tree) and the
//! thread tries again after a pause. Removing a worker stops its thread within a read's wait.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pdserve_chat_template::{ChatMessage, ToolFormat};
use pdserve_codec::{Endpoint, Prompt};
use pdserve_kv_events::{replay, Subscription};
use pdserve_model::TextCodec;

use crate::kv_index::{prompt_chains, Applied, KvIndex};

/// Every step of reading a card, subscribing or replaying finishes within this.
const STEP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a read waits for a batch before the thread looks at its stop flag.
const POLL: Duration = Duration::from_millis(200);
/// Pause after a failure, or after a card that names no events, before trying again.
const RETRY_AFTER: Duration = Duration::from_secs(2);
/// A card larger than this is refused.
const CARD_BYTES_MAX: usize = 1 << 20;
/// While following, the card is read again this often: a worker restarted at the same address
/// (a new `instance`) or changed endpoints is followed anew, a worker gone ends the subscription
/// (a SUB socket never writes, so a dead peer would otherwise go unnoticed).
const RECHECK_EVERY: Duration = Duration::from_secs(10);
/// Batches of a replay applied per hold of the index's lock (lookups go in between).
const REPLAY_CHUNK: usize = 256;
/// Request bodies larger than this are not tokenized for routing (the router's event loop would
/// stall on them): the approximate tree routes them.
pub const PROMPT_BODY_BYTES_MAX: usize = 256 << 10;

/// What the listener threads have done, for `/metrics`.
#[derive(Debug, Default)]
pub struct KvStats {
    /// Batches applied to the index.
    pub batches: AtomicU64,
    /// Gaps in a worker's sequence that a replay could not fill (the worker became unknown).
    pub gaps: AtomicU64,
    /// Subscriptions that failed or ended (the worker became unknown until the next).
    pub failures: AtomicU64,
}

/// A prompt's blocks, as the index compares them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvPrompt {
    pub tokens: u32,
    pub block_size: u32,
    pub chains: Vec<u64>,
}

#[derive(Debug)]
struct Listener {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

/// The tokenizer, the index and the listener threads.
pub struct KvRouting {
    codec: TextCodec,
    /// The template's tool format, until a worker's card names the one it uses (`tool_parser`).
    tool_format: Arc<Mutex<ToolFormat>>,
    index: Arc<Mutex<KvIndex>>,
    listeners: HashMap<u32, Listener>,
    /// Listeners started so far: each one's epoch in the index.
    epochs: u64,
    pub stats: Arc<KvStats>,
}

impl std::fmt::Debug for KvRouting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvRouting").field("listeners", &self.listeners.len()).finish()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl KvRouting {
    /// Loads the served model's tokenizer and chat template from its folder (`tokenizer.json`,
    /// `tokenizer_config.json`), as the workers load them.
    pub fn load(dir: &Path) -> Result<KvRouting, String> {
        let codec = TextCodec::load(dir).map_err(|e| format!("--tokenizer {}: {e}", dir.display()))?;
        let tool_format = codec.chat_template().map_or(ToolFormat::Hermes, ToolFormat::from_template);
        Ok(KvRouting {
            codec,
            tool_format: Arc::new(Mutex::new(tool_format)),
            index: Arc::default(),
            listeners: HashMap::new(),
            epochs: 0,
            stats: Arc::default(),
        })
    }

    /// Starts a listener for each worker new to it and stops those of workers gone. `workers`:
    /// (id, address, host header).
    pub fn sync(&mut self, workers: &[(u32, SocketAddr, String)], secret: Option<&str>) {
        self.listeners.retain(|id, l| {
            let keep = workers.iter().any(|(w, a, _)| w == id && *a == l.addr);
            if !keep {
                l.stop.store(true, Ordering::Relaxed);
            }
            keep
        });
        for (id, addr, authority) in workers {
            if self.listeners.contains_key(id) {
                continue;
            }
            let stop = Arc::new(AtomicBool::new(false));
            self.epochs += 1;
            let job = Job {
                worker: *id,
                epoch: self.epochs,
                tool_format: Arc::clone(&self.tool_format),
                addr: *addr,
                authority: authority.clone(),
                secret: secret.map(str::to_owned),
                index: Arc::clone(&self.index),
                stats: Arc::clone(&self.stats),
                stop: Arc::clone(&stop),
            };
            let spawned =
                std::thread::Builder::new().name(format!("kv-events-{id}")).spawn(move || job.run());
            if spawned.is_ok() {
                self.listeners.insert(*id, Listener { stop, addr: *addr });
            }
        }
    }

    /// The request's prompt blocks, tokenized as a worker does; `None` when no worker is followed
    /// (nothing to compare with), the body is over [`PROMPT_BODY_BYTES_MAX`], or it does not render
    /// as a worker would render it (a completion with a `suffix` is wrapped for fill-in-the-middle).
    pub fn prompt(&self, endpoint: Endpoint, body: &[u8]) -> Option<KvPrompt> {
        if body.len() > PROMPT_BODY_BYTES_MAX {
            return None;
        }
        let block_size = lock(&self.index).any_block_size()?;
        let g = match endpoint {
            // The router's own expanded body (the stored conversation in it) reads as the worker
            // reads it, behind the cluster secret.
            Endpoint::Responses => {
                let none = |_: &str| None;
                let chat = pdserve_codec::responses::read(body, &none, true).ok()?.chat;
                pdserve_codec::openai::parse_value(Endpoint::Chat, chat).ok()?
            }
            _ => pdserve_codec::parse_generate(endpoint, body).ok()?,
        };
        if g.suffix.is_some() {
            return None;
        }
        let tokens = match &g.prompt {
            Prompt::Messages(m) => {
                let msgs: Vec<ChatMessage> = m.iter().map(chat_message).collect();
                let format = *lock(&self.tool_format);
                let text = self.codec.render_chat(&msgs, &g.tools, format, &g.chat_template_kwargs).ok()?;
                self.codec.encode(&text).ok()?
            }
            Prompt::Text(t) => self.codec.encode_prompt(t).ok()?,
            Prompt::Tokens(t) => t.clone(),
        };
        let chains = prompt_chains(&tokens, block_size as usize);
        Some(KvPrompt { tokens: tokens.len() as u32, block_size, chains })
    }

    /// Of `prompt`'s tokens, how many `worker`'s cache holds (from its start); `None` when the
    /// index does not vouch for the worker.
    pub fn held_tokens(&self, worker: u32, prompt: &KvPrompt) -> Option<u32> {
        let ix = lock(&self.index);
        if ix.block_size(worker) != Some(prompt.block_size) {
            return None;
        }
        ix.matched(worker, &prompt.chains).map(|n| n as u32 * prompt.block_size)
    }

    /// Blocks indexed for `worker` and what the index knows of its cache (`whole`, `part`, or
    /// `None`: not followed), for `/workers`.
    pub fn known(&self, worker: u32) -> (usize, Option<&'static str>) {
        let ix = lock(&self.index);
        (ix.blocks(worker), ix.history(worker))
    }
}

impl Drop for KvRouting {
    fn drop(&mut self) {
        for l in self.listeners.values() {
            l.stop.store(true, Ordering::Relaxed);
        }
    }
}

/// A client's chat message as the template sees it (the workers' conversion).
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

/// Where a card's endpoint listens: `tcp://*:PORT` and `tcp://0.0.0.0:PORT` are the worker's own
/// address.
fn endpoint_addr(endpoint: &str, worker: SocketAddr) -> Option<SocketAddr> {
    let rest = endpoint.strip_prefix("tcp://")?;
    let (host, port) = rest.rsplit_once(':')?;
    let port: u16 = port.parse().ok()?;
    match host {
        "*" | "0.0.0.0" | "[::]" => Some(SocketAddr::new(worker.ip(), port)),
        h => h.trim_start_matches('[').trim_end_matches(']').parse().ok().map(|ip| SocketAddr::new(ip, port)),
    }
}

/// The worker's events, from its card.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Advert {
    pub_addr: SocketAddr,
    replay: Option<SocketAddr>,
    topic: String,
    /// The publishing process (a restarted worker has a new one).
    instance: String,
    /// The card's `tool_parser`.
    tool_parser: Option<String>,
}

struct Job {
    worker: u32,
    epoch: u64,
    tool_format: Arc<Mutex<ToolFormat>>,
    addr: SocketAddr,
    authority: String,
    secret: Option<String>,
    index: Arc<Mutex<KvIndex>>,
    stats: Arc<KvStats>,
    stop: Arc<AtomicBool>,
}

impl Job {
    fn run(self) {
        while !self.stop.load(Ordering::Relaxed) {
            let advert = match self.card() {
                Ok(Some(a)) => a,
                Ok(None) | Err(_) => {
                    lock(&self.index).forget(self.worker, self.epoch);
                    self.pause(RETRY_AFTER * 5);
                    continue;
                }
            };
            if let Some(f) = advert.tool_parser.as_deref().and_then(ToolFormat::from_name) {
                *lock(&self.tool_format) = f;
            }
            if self.follow(&advert).is_err() {
                self.stats.failures.fetch_add(1, Ordering::Relaxed);
            }
            lock(&self.index).forget(self.worker, self.epoch);
            self.pause(RETRY_AFTER);
        }
        lock(&self.index).forget(self.worker, self.epoch);
    }

    fn pause(&self, d: Duration) {
        let until = Instant::now() + d;
        while !self.stop.load(Ordering::Relaxed) && Instant::now() < until {
            std::thread::sleep(POLL);
        }
    }

    /// `GET /v1/models`: the worker's `kv_events`, if it publishes.
    fn card(&self) -> Result<Option<Advert>, String> {
        let deadline = Instant::now() + STEP_TIMEOUT;
        let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
        let mut s = TcpStream::connect_timeout(&self.addr, left()).map_err(|e| e.to_string())?;
        let mut headers = vec![("host", self.authority.as_str()), ("connection", "close")];
        headers.extend(self.secret.as_deref().map(|v| (pdserve_api::header::CLUSTER_SECRET, v)));
        let mut req = Vec::with_capacity(128);
        pdserve_http::write_request_head(&mut req, "GET", pdserve_api::path::MODELS, &headers, 0);
        s.set_write_timeout(Some(left())).map_err(|e| e.to_string())?;
        s.write_all(&req).map_err(|e| e.to_string())?;
        let limits = pdserve_http::Limits { body_bytes_max: CARD_BYTES_MAX, ..Default::default() };
        let mut dec = pdserve_http::ResponseDecoder::new(limits, false);
        let (mut status, mut body, mut buf, mut eof) = (0u16, Vec::new(), [0u8; 8192], false);
        loop {
            if Instant::now() >= deadline {
                return Err("the card took too long".into());
            }
            while let Some(ev) = dec.poll().map_err(|e| e.to_string())? {
                match ev {
                    pdserve_http::ResponseEvent::Head(h) => status = h.status,
                    pdserve_http::ResponseEvent::Data(d) => body.extend_from_slice(&d),
                    pdserve_http::ResponseEvent::End => return Self::advert(status, &body, self.addr),
                }
            }
            s.set_read_timeout(Some(left())).map_err(|e| e.to_string())?;
            match s.read(&mut buf) {
                Ok(0) if eof => return Err("the card ended early".into()),
                Ok(0) => {
                    eof = true;
                    dec.handle_eof().map_err(|e| e.to_string())?;
                }
                Ok(n) => dec.push(&buf[..n]),
                Err(e) => return Err(e.to_string()),
            }
        }
    }

    fn advert(status: u16, body: &[u8], worker: SocketAddr) -> Result<Option<Advert>, String> {
        if status != 200 {
            return Err(format!("/v1/models answered {status}"));
        }
        let v: serde_json::Value = serde_json::from_slice(body).map_err(|e| e.to_string())?;
        let card = &v["data"][0];
        let ev = &card["kv_events"];
        let Some(pub_addr) = ev["endpoint"].as_str().and_then(|e| endpoint_addr(e, worker)) else {
            return Ok(None);
        };
        let text = |v: &serde_json::Value| v.as_str().unwrap_or("").to_owned();
        Ok(Some(Advert {
            pub_addr,
            replay: ev["replay_endpoint"].as_str().and_then(|e| endpoint_addr(e, worker)),
            topic: text(&ev["topic"]),
            instance: text(&ev["instance"]),
            tool_parser: card["tool_parser"].as_str().map(str::to_owned),
        }))
    }

    /// Replays from `from` into the index, a chunk per hold of its lock; true if the index then
    /// has every batch before `until` (a replay that fails, or no longer holds `from`: false).
    fn catch_up(&self, replay_addr: Option<SocketAddr>, from: u64, until: u64) -> bool {
        let Some(batches) = replay_addr.and_then(|r| replay(r, from, STEP_TIMEOUT).ok()) else {
            return false;
        };
        if batches.first().is_some_and(|b| b.seq > from) {
            return false;
        }
        for chunk in batches.chunks(REPLAY_CHUNK) {
            let mut ix = lock(&self.index);
            for b in chunk {
                if ix.apply(self.worker, self.epoch, b) == Applied::Gap {
                    return false;
                }
                self.stats.batches.fetch_add(1, Ordering::Relaxed);
            }
        }
        lock(&self.index).next_seq(self.worker).is_some_and(|n| n >= until)
    }

    /// Subscribes and applies batches until the connection fails, the card changes or the thread is
    /// stopped.
    fn follow(&self, advert: &Advert) -> std::io::Result<()> {
        let mut sub = Subscription::connect(advert.pub_addr, advert.topic.as_bytes(), STEP_TIMEOUT)?;
        lock(&self.index).reset(self.worker, self.epoch);
        // The history the publisher still buffers; whole if it starts at its first batch.
        self.catch_up(advert.replay, 0, 0);
        let mut recheck = Instant::now() + RECHECK_EVERY;
        while !self.stop.load(Ordering::Relaxed) {
            if Instant::now() >= recheck {
                if self.card().ok().flatten().as_ref() != Some(advert) {
                    return Err(std::io::Error::other("the worker's card changed or is gone"));
                }
                recheck = Instant::now() + RECHECK_EVERY;
            }
            let Some(b) = sub.next(POLL)? else { continue };
            let applied = lock(&self.index).apply(self.worker, self.epoch, &b);
            if applied == Applied::Gap {
                let from = lock(&self.index).next_seq(self.worker).unwrap_or(0);
                if !self.catch_up(advert.replay, from, b.seq) {
                    // Batches lost for good: start over from this one, knowing part of the cache.
                    self.stats.gaps.fetch_add(1, Ordering::Relaxed);
                    let mut ix = lock(&self.index);
                    ix.reset(self.worker, self.epoch);
                    ix.apply(self.worker, self.epoch, &b);
                    continue;
                }
                lock(&self.index).apply(self.worker, self.epoch, &b);
            }
            self.stats.batches.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn card_endpoints_resolve_to_the_worker() {
        let w: SocketAddr = "10.1.2.3:8100".parse().unwrap();
        assert_eq!(endpoint_addr("tcp://*:5557", w), Some("10.1.2.3:5557".parse().unwrap()));
        assert_eq!(endpoint_addr("tcp://0.0.0.0:5557", w), Some("10.1.2.3:5557".parse().unwrap()));
        assert_eq!(endpoint_addr("tcp://127.0.0.1:7", w), Some("127.0.0.1:7".parse().unwrap()));
        assert_eq!(endpoint_addr("tcp://[::1]:7", w), Some("[::1]:7".parse().unwrap()));
        assert_eq!(endpoint_addr("ipc:///tmp/x", w), None);
        let body = br#"{"data": [{"id": "m", "tool_parser": "hermes", "kv_events": {"endpoint": "tcp://*:5557", "replay_endpoint": null, "topic": "kv@a", "instance": "9f"}}]}"#;
        let want = Advert {
            pub_addr: "10.1.2.3:5557".parse().unwrap(),
            replay: None,
            topic: "kv@a".into(),
            instance: "9f".into(),
            tool_parser: Some("hermes".into()),
        };
        assert_eq!(Job::advert(200, body, w), Ok(Some(want)));
        assert_eq!(Job::advert(200, br#"{"data": [{"id": "m", "kv_events": null}]}"#, w), Ok(None));
        assert!(Job::advert(401, b"{}", w).is_err());
    }
}
