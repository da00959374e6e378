//! KV cache events in vLLM's wire format, so fleet routers that route on vLLM's events (llm-d,
//! NVIDIA Dynamo, SGLang's gateway) route on a pdserve worker's too.
//!
//! A [`Publisher`] binds a ZMQ PUB socket (or connects it out to a subscriber that binds, as vLLM
//! does for an endpoint that names a host: [`PubEndpoint`]) and, optionally, a ROUTER socket for
//! replay, speaking
//! ZMTP 3.0 itself over std TCP (no libzmq, no async runtime). Each batch goes out as the multipart
//! message `[topic, sequence (8 bytes, big-endian), payload]`, the payload msgpack
//! `[timestamp, [events...], data_parallel_rank]` with each event a tagged array in vLLM's field
//! order ([`KvEvent`]). The replay socket answers a request carrying a start sequence (8 bytes,
//! big-endian) with every buffered batch from it on, then `[-1, ""]`.
//!
//! Serving never waits on a subscriber: batches go through a bounded queue to the publishing thread
//! (a full queue drops the batch, counted), each subscriber has a bounded queue of its own (a slow
//! one loses batches, counted, and is dropped when a write blocks 5 s), and the replay buffer keeps
//! the last `buffer_steps` batches.
//!
//! The other side is here too, for routers that route on a worker's events: a [`Subscription`]
//! (ZMTP SUB) reads batches back into [`KvEvent`]s and [`replay`] asks a replay socket for the ones
//! missed, every read under a deadline and every length bounded.
//!
//! ```
//! use pdserve_kv_events::{KvEvent, KvEventsConfig, Publisher};
//! let cfg = KvEventsConfig::parse(r#"{"enable_kv_cache_events": true, "publisher": "zmq",
//!     "endpoint": "tcp://*:0", "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv@pod@m"}"#)
//!     .unwrap()
//!     .expect("enabled");
//! let p = Publisher::start(&cfg).unwrap();
//! p.publish(vec![KvEvent::stored(vec![11, 12], None, (0..32).collect(), 16)]);
//! assert!(p.pub_addr().is_some_and(|a| a.port() != 0));
//! ```
#![forbid(unsafe_code)]

mod msgpack;
mod subscribe;
/// ZMTP framing, public for the fuzz targets only.
#[doc(hidden)]
pub mod zmtp;

use std::collections::VecDeque;
use std::io;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crossbeam_channel::{Receiver, Sender, TrySendError};

use subscribe::Until;
pub use subscribe::{
    decode_batch, replay, Batch, Subscription, BATCH_BYTES_MAX, REPLAY_BATCHES_MAX, REPLAY_BYTES_MAX,
};

/// The medium vLLM names its primary KV pool with; a pdserve worker's pool, on whatever device, is
/// that tier (an offload tier would be `CPU`).
pub const MEDIUM_PRIMARY: &str = "GPU";

/// One change to a worker's prefix cache, in vLLM's terms.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks whose KV became reusable: their hashes (each chained on the one before, the first on
    /// `parent_block_hash`, `None` at the start of a prompt) and their tokens, `block_size` each.
    BlockStored {
        block_hashes: Vec<u64>,
        parent_block_hash: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
        medium: &'static str,
    },
    /// Blocks that left the cache.
    BlockRemoved { block_hashes: Vec<u64>, medium: &'static str },
    /// Everything left the cache (a worker's start).
    AllBlocksCleared,
}

impl KvEvent {
    /// Blocks stored in the primary pool.
    pub fn stored(
        block_hashes: Vec<u64>,
        parent: Option<u64>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> KvEvent {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash: parent,
            token_ids,
            block_size,
            medium: MEDIUM_PRIMARY,
        }
    }

    /// Blocks removed from the primary pool.
    pub fn removed(block_hashes: Vec<u64>) -> KvEvent {
        KvEvent::BlockRemoved { block_hashes, medium: MEDIUM_PRIMARY }
    }

    /// vLLM's encoding: a tagged array, fields in order (msgspec's `array_like` and `tag`), written
    /// through `lora_name` for `BlockStored` (through `medium` for `BlockRemoved`); the optional tail
    /// after it (`extra_keys`, ..., `group_idx`) left out at its defaults (`omit_defaults`).
    fn encode(&self, out: &mut Vec<u8>) {
        match self {
            KvEvent::BlockStored { block_hashes, parent_block_hash, token_ids, block_size, medium } => {
                // tag, block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name
                msgpack::array(out, 8);
                msgpack::str(out, "BlockStored");
                hashes(out, block_hashes);
                match parent_block_hash {
                    Some(h) => msgpack::uint(out, *h),
                    None => msgpack::nil(out),
                }
                msgpack::array(out, token_ids.len());
                for &t in token_ids {
                    msgpack::uint(out, u64::from(t));
                }
                msgpack::uint(out, u64::from(*block_size));
                msgpack::nil(out);
                msgpack::str(out, medium);
                msgpack::nil(out);
            }
            KvEvent::BlockRemoved { block_hashes, medium } => {
                msgpack::array(out, 3);
                msgpack::str(out, "BlockRemoved");
                hashes(out, block_hashes);
                msgpack::str(out, medium);
            }
            KvEvent::AllBlocksCleared => {
                msgpack::array(out, 1);
                msgpack::str(out, "AllBlocksCleared");
            }
        }
    }
}

fn hashes(out: &mut Vec<u8>, h: &[u64]) {
    msgpack::array(out, h.len());
    for &x in h {
        msgpack::uint(out, x);
    }
}

/// Merges runs of stores that continue one another (the next's parent is the last hash before it)
/// into one event, as vLLM reports a request's new blocks.
pub fn coalesce(events: Vec<KvEvent>) -> Vec<KvEvent> {
    let mut out: Vec<KvEvent> = Vec::with_capacity(events.len());
    for e in events {
        if let (
            Some(KvEvent::BlockStored { block_hashes, token_ids, block_size, medium, .. }),
            KvEvent::BlockStored {
                block_hashes: next,
                parent_block_hash: Some(p),
                token_ids: t,
                block_size: bs,
                medium: m,
                ..
            },
        ) = (out.last_mut(), &e)
        {
            if block_hashes.last() == Some(p) && block_size == bs && medium == m {
                block_hashes.extend_from_slice(next);
                token_ids.extend_from_slice(t);
                continue;
            }
        }
        if let (
            Some(KvEvent::BlockRemoved { block_hashes, medium }),
            KvEvent::BlockRemoved { block_hashes: next, medium: m },
        ) = (out.last_mut(), &e)
        {
            if medium == m {
                block_hashes.extend_from_slice(next);
                continue;
            }
        }
        out.push(e);
    }
    out
}

/// A batch's payload: msgpack `[ts, [events...], data_parallel_rank]`.
pub fn encode_batch(ts: f64, events: &[KvEvent], data_parallel_rank: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + events.len() * 64);
    msgpack::array(&mut out, 3);
    msgpack::float(&mut out, ts);
    msgpack::array(&mut out, events.len());
    for e in events {
        e.encode(&mut out);
    }
    msgpack::uint(&mut out, u64::from(data_parallel_rank));
    out
}

/// vLLM's `--kv-events-config`, as far as a ZMQ publisher goes.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventsConfig {
    /// Where the PUB socket binds, or where it connects (as vLLM decides: see [`PubEndpoint`]).
    pub endpoint: PubEndpoint,
    /// Where the replay ROUTER socket binds, if anywhere.
    pub replay_endpoint: Option<SocketAddr>,
    /// The first frame of every message (subscribers filter on its prefix).
    pub topic: String,
    /// Batches kept for replay.
    pub buffer_steps: usize,
    /// Batches queued for one subscriber at most (ZMQ's high-water mark).
    pub hwm: usize,
    /// Batches queued for the publishing thread at most.
    pub max_queue_size: usize,
}

/// Where the PUB socket goes. As vLLM's publisher decides: an endpoint with `*` or `::` in it binds
/// (`tcp://*:5557`: every interface); any other connects out to a subscriber that binds there
/// (`tcp://indexer.ns.svc:5557`: llm-d's indexer has vLLM pods do this), and connects again after a
/// drop, the name looked up anew each time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PubEndpoint {
    Bind(SocketAddr),
    /// `HOST:PORT`, HOST a name or an address.
    Connect(String),
}

impl std::fmt::Display for PubEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PubEndpoint::Bind(a) => write!(f, "bind tcp://{a}"),
            PubEndpoint::Connect(to) => write!(f, "connect tcp://{to}"),
        }
    }
}

fn pub_endpoint(s: &str) -> Result<PubEndpoint, String> {
    if s.contains('*') || s.contains("::") {
        return bind_addr("endpoint", s).map(PubEndpoint::Bind);
    }
    let rest = s
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("endpoint {s:?}: only tcp:// endpoints are served"))?;
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
            Ok(PubEndpoint::Connect(rest.to_owned()))
        }
        _ => Err(format!(
            "endpoint {s:?}: tcp://*:PORT to bind, or tcp://HOST:PORT of a subscriber to connect to"
        )),
    }
}

/// `tcp://*:PORT` or `tcp://HOST:PORT` as an address to bind.
fn bind_addr(field: &str, s: &str) -> Result<SocketAddr, String> {
    let rest =
        s.strip_prefix("tcp://").ok_or_else(|| format!("{field} {s:?}: only tcp:// endpoints are served"))?;
    let rest = rest.replacen('*', "0.0.0.0", 1);
    rest.parse::<SocketAddr>().map_err(|e| format!("{field} {s:?}: {e} (a tcp://HOST:PORT to bind)"))
}

impl KvEventsConfig {
    /// The config from vLLM's JSON; `None` when events are off (`enable_kv_cache_events` false or
    /// absent, or `publisher` `"null"`). Unknown keys and wrong types are errors.
    pub fn parse(json: &str) -> Result<Option<KvEventsConfig>, String> {
        let v: serde_json::Value =
            serde_json::from_str(json).map_err(|e| format!("--kv-events-config: {e}"))?;
        let o = v.as_object().ok_or("--kv-events-config: a JSON object")?;
        const KNOWN: &[&str] = &[
            "enable_kv_cache_events",
            "publisher",
            "endpoint",
            "replay_endpoint",
            "topic",
            "buffer_steps",
            "hwm",
            "max_queue_size",
        ];
        if let Some(k) = o.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(format!("--kv-events-config: unknown key {k:?} (known: {})", KNOWN.join(", ")));
        }
        let string = |k: &str| -> Result<Option<&str>, String> {
            match o.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s)),
                Some(other) => Err(format!("--kv-events-config: {k} must be a string, not {other}")),
            }
        };
        let count =
            |k: &str, default: usize| -> Result<usize, String> {
                match o.get(k) {
                    None => Ok(default),
                    Some(v) => v.as_u64().filter(|&n| n > 0).map(|n| n as usize).ok_or_else(|| {
                        format!("--kv-events-config: {k} must be a positive integer, not {v}")
                    }),
                }
            };
        let enabled = match o.get("enable_kv_cache_events") {
            None => false,
            Some(v) => {
                v.as_bool().ok_or("--kv-events-config: enable_kv_cache_events must be true or false")?
            }
        };
        let publisher = string("publisher")?.unwrap_or("zmq");
        if !enabled || publisher == "null" {
            return Ok(None);
        }
        if publisher != "zmq" {
            return Err(format!("--kv-events-config: publisher {publisher:?}: zmq or null"));
        }
        let endpoint = pub_endpoint(string("endpoint")?.unwrap_or("tcp://*:5557"))?;
        let replay_endpoint =
            string("replay_endpoint")?.map(|s| bind_addr("replay_endpoint", s)).transpose()?;
        Ok(Some(KvEventsConfig {
            endpoint,
            replay_endpoint,
            topic: string("topic")?.unwrap_or("").to_owned(),
            buffer_steps: count("buffer_steps", 10_000)?,
            hwm: count("hwm", 100_000)?,
            max_queue_size: count("max_queue_size", 100_000)?,
        }))
    }
}

/// Subscribers served at once; more are refused (their connection closed).
pub const SUBSCRIBERS_MAX: usize = 64;

/// A read or write on a subscriber's connection that takes longer ends it.
const IO_TIMEOUT: Duration = Duration::from_secs(5);

/// A replay client's wait for its next request plus that request's answer, at most.
const REPLAY_EXCHANGE: Duration = Duration::from_secs(60);

/// What a publisher has done, for the worker's metrics.
#[derive(Debug, Default)]
pub struct PublisherStats {
    /// Batches sent (numbered 0, 1, ...).
    pub batches_published: AtomicU64,
    /// Batches dropped before numbering: the publishing thread's queue was full.
    pub batches_dropped: AtomicU64,
    /// Batches a subscriber did not get: its queue was full, or it was cut off for blocking a write.
    pub subscriber_batches_dropped: AtomicU64,
    /// Batches written to subscribers (one per subscriber that wanted it).
    pub subscriber_batches_sent: AtomicU64,
    /// Subscribers connected now.
    pub subscribers: AtomicUsize,
}

/// One subscriber's queue and subscriptions.
struct Subscriber {
    queue: Sender<Arc<(u64, Vec<u8>)>>,
    prefixes: Arc<Mutex<Vec<Vec<u8>>>>,
    /// Cleared when its connection ends.
    alive: Arc<std::sync::atomic::AtomicBool>,
    /// Batches its queue holds at most.
    hwm: usize,
}

type Ring = Arc<Mutex<VecDeque<Arc<(u64, Vec<u8>)>>>>;

/// A running publisher (see the crate docs). Dropping it stops the publishing thread; the listening
/// threads stay until the process ends.
#[derive(Debug)]
pub struct Publisher {
    batches: Sender<(f64, Vec<KvEvent>)>,
    stats: Arc<PublisherStats>,
    pub_addr: Option<SocketAddr>,
    replay_addr: Option<SocketAddr>,
    /// Set when it is dropped: a connecting publisher stops connecting again.
    closed: Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.closed.store(true, Ordering::Relaxed);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Publisher {
    /// Binds the sockets (or starts connecting out) and starts the publishing thread.
    pub fn start(cfg: &KvEventsConfig) -> io::Result<Publisher> {
        let stats = Arc::new(PublisherStats::default());
        let closed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let listener = match &cfg.endpoint {
            PubEndpoint::Bind(a) => Some(TcpListener::bind(a)?),
            PubEndpoint::Connect(_) => None,
        };
        let pub_addr = listener.as_ref().map(TcpListener::local_addr).transpose()?;
        let ring: Ring = Arc::new(Mutex::new(VecDeque::with_capacity(cfg.buffer_steps.min(1 << 16))));
        let subscribers: Arc<Mutex<Vec<Subscriber>>> = Arc::default();
        let replay_addr = match cfg.replay_endpoint {
            Some(a) => {
                let l = TcpListener::bind(a)?;
                let addr = l.local_addr()?;
                let ring = Arc::clone(&ring);
                std::thread::Builder::new()
                    .name("kv-events-replay".into())
                    .spawn(move || serve_replay(l, ring))?;
                Some(addr)
            }
            None => None,
        };
        {
            let (subscribers, stats, hwm) = (Arc::clone(&subscribers), Arc::clone(&stats), cfg.hwm);
            let topic = cfg.topic.clone().into_bytes();
            match (listener, &cfg.endpoint) {
                (Some(listener), _) => std::thread::Builder::new()
                    .name("kv-events-accept".into())
                    .spawn(move || accept_subscribers(listener, subscribers, stats, hwm, topic))?,
                (None, PubEndpoint::Connect(to)) => {
                    let (to, closed) = (to.clone(), Arc::clone(&closed));
                    std::thread::Builder::new()
                        .name("kv-events-connect".into())
                        .spawn(move || connect_out(&to, &closed, &subscribers, &stats, hwm, &topic))?
                }
                (None, PubEndpoint::Bind(_)) => unreachable!("bound above"),
            };
        }
        let (batches, rx) = crossbeam_channel::bounded(cfg.max_queue_size);
        {
            let (stats, topic, keep) = (Arc::clone(&stats), cfg.topic.clone().into_bytes(), cfg.buffer_steps);
            std::thread::Builder::new()
                .name("kv-events".into())
                .spawn(move || publish_loop(&rx, &topic, &ring, keep, &subscribers, &stats))?;
        }
        Ok(Publisher { batches, stats, pub_addr, replay_addr, closed })
    }

    /// Queues `events` as one batch (stamped now); `false` if the queue was full and it was dropped.
    /// Never waits.
    pub fn publish(&self, events: Vec<KvEvent>) -> bool {
        let ts = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        match self.batches.try_send((ts, events)) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.batches_dropped.fetch_add(1, Ordering::Relaxed);
                false
            }
        }
    }

    pub fn stats(&self) -> &PublisherStats {
        &self.stats
    }

    /// Where the PUB socket listens (`None`: it connects out instead).
    pub fn pub_addr(&self) -> Option<SocketAddr> {
        self.pub_addr
    }

    /// Where the replay socket listens.
    pub fn replay_addr(&self) -> Option<SocketAddr> {
        self.replay_addr
    }
}

fn publish_loop(
    rx: &Receiver<(f64, Vec<KvEvent>)>,
    topic: &[u8],
    ring: &Ring,
    keep: usize,
    subscribers: &Mutex<Vec<Subscriber>>,
    stats: &PublisherStats,
) {
    // Ends when the publisher is dropped.
    for (seq, (ts, events)) in (0u64..).zip(rx) {
        let batch = Arc::new((seq, encode_batch(ts, &events, 0)));
        {
            let mut r = lock(ring);
            if r.len() >= keep {
                r.pop_front();
            }
            r.push_back(Arc::clone(&batch));
        }
        let mut subs = lock(subscribers);
        subs.retain(|s| {
            if !s.alive.load(Ordering::Relaxed) {
                return false;
            }
            // ZMQ's PUB filters by the topic's prefix; what no subscription wants is not sent.
            if !lock(&s.prefixes).iter().any(|p| topic.starts_with(p)) {
                return true;
            }
            if s.queue.len() >= s.hwm {
                stats.subscriber_batches_dropped.fetch_add(1, Ordering::Relaxed);
                return true;
            }
            s.queue.send(Arc::clone(&batch)).is_ok()
        });
        stats.batches_published.fetch_add(1, Ordering::Relaxed);
    }
}

/// Subscriptions one subscriber may hold, and the longest topic prefix; past either it is cut off.
const SUBSCRIPTIONS_MAX: usize = 256;
const PREFIX_BYTES_MAX: usize = 4096;

/// A subscriber that has subscribed to nothing this long after its handshake is closed (its slot is
/// one of [`SUBSCRIBERS_MAX`]).
const IDLE_UNSUBSCRIBED: Duration = Duration::from_secs(30);

/// Accepts subscribers (up to [`SUBSCRIBERS_MAX`]), each served by a thread that does the handshake,
/// then registers it and writes its queue, and one that reads its subscriptions.
fn accept_subscribers(
    listener: TcpListener,
    subscribers: Arc<Mutex<Vec<Subscriber>>>,
    stats: Arc<PublisherStats>,
    hwm: usize,
    topic: Vec<u8>,
) {
    for conn in listener.incoming() {
        let stream = match conn {
            Ok(s) => s,
            // Out of file descriptors, say: wait a little rather than spin.
            Err(_) => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if stats.subscribers.load(Ordering::Relaxed) >= SUBSCRIBERS_MAX {
            continue; // dropped: closed
        }
        stats.subscribers.fetch_add(1, Ordering::Relaxed);
        let (subs, st, t) = (Arc::clone(&subscribers), Arc::clone(&stats), topic.clone());
        let spawned = std::thread::Builder::new().name("kv-events-sub".into()).spawn(move || {
            let cut_off = serve_subscriber(stream, &t, &subs, &st, hwm);
            if let Err(e) = cut_off {
                if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                    st.subscriber_batches_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            st.subscribers.fetch_sub(1, Ordering::Relaxed);
        });
        if spawned.is_err() {
            stats.subscribers.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// A publisher configured to connect: to `to`, a subscriber that binds there (one connection, as a
/// ZMQ PUB that connects has), served like an accepted one; after it drops or fails, again after a
/// pause of 100 ms doubling to 5 s (back to 100 ms after a connection that was served), until the
/// publisher is dropped. Each lookup of the name and each connect is bounded by [`IO_TIMEOUT`].
fn connect_out(
    to: &str,
    closed: &std::sync::atomic::AtomicBool,
    subscribers: &Mutex<Vec<Subscriber>>,
    stats: &PublisherStats,
    hwm: usize,
    topic: &[u8],
) {
    const FIRST: Duration = Duration::from_millis(100);
    let (mut pause, mut lookup) = (FIRST, None);
    while !closed.load(Ordering::Relaxed) {
        let stream = resolve(to, &mut lookup).and_then(|addr| TcpStream::connect_timeout(&addr, IO_TIMEOUT));
        if let Ok(stream) = stream {
            stats.subscribers.fetch_add(1, Ordering::Relaxed);
            let served = serve_subscriber(stream, topic, subscribers, stats, hwm);
            stats.subscribers.fetch_sub(1, Ordering::Relaxed);
            if let Err(e) = &served {
                if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) {
                    stats.subscriber_batches_dropped.fetch_add(1, Ordering::Relaxed);
                }
            }
            if !matches!(&served, Err(e) if e.kind() == io::ErrorKind::InvalidData) {
                pause = FIRST;
            }
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(IO_TIMEOUT);
    }
}

/// A name lookup under way on its helper thread.
type Lookup = Receiver<io::Result<Option<SocketAddr>>>;

/// `HOST:PORT`'s first address, looked up on a helper thread within [`IO_TIMEOUT`]. One lookup at a
/// time: one that is still running when the wait ends stays in `pending`, and the next call waits
/// for it again instead of starting another (a hung resolver cannot pile threads up).
fn resolve(to: &str, pending: &mut Option<Lookup>) -> io::Result<SocketAddr> {
    use std::net::ToSocketAddrs;
    let rx = match pending.take() {
        Some(rx) => rx,
        None => {
            let (tx, rx) = crossbeam_channel::bounded(1);
            let name = to.to_owned();
            std::thread::Builder::new().name("kv-events-resolve".into()).spawn(move || {
                let _ = tx.send(name.to_socket_addrs().map(|mut a| a.next()));
            })?;
            rx
        }
    };
    match rx.recv_timeout(IO_TIMEOUT) {
        Ok(Ok(Some(a))) => Ok(a),
        Ok(Ok(None)) => Err(io::Error::new(io::ErrorKind::NotFound, format!("{to}: no address"))),
        Ok(Err(e)) => Err(e),
        Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
            *pending = Some(rx);
            Err(io::Error::new(io::ErrorKind::TimedOut, format!("looking {to} up took over 5 s")))
        }
        Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
            Err(io::Error::other(format!("looking {to} up failed")))
        }
    }
}

/// One subscriber: the handshake; then, registered, a reader thread keeping its subscriptions up to
/// date while this one writes its queue (`[topic, seq, payload]`) until the connection, the
/// subscriber's limits or the publisher end. Every exit shuts the connection down (the reader then
/// ends too) and leaves the registration to be swept.
fn serve_subscriber(
    mut stream: TcpStream,
    topic: &[u8],
    subscribers: &Mutex<Vec<Subscriber>>,
    stats: &PublisherStats,
    hwm: usize,
) -> io::Result<()> {
    stream.set_nodelay(true)?;
    // The whole handshake within one deadline (a peer dripping bytes cannot stretch it).
    zmtp::handshake(&mut Until { s: &mut stream, deadline: Instant::now() + IO_TIMEOUT }, "PUB")?;
    let prefixes: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
    let alive = Arc::new(std::sync::atomic::AtomicBool::new(true));
    // Unbounded in type, held to `hwm` by the publisher (no memory taken up front per subscriber).
    let (tx, queue) = crossbeam_channel::unbounded();
    {
        let mut subs = lock(subscribers);
        subs.retain(|s| s.alive.load(Ordering::Relaxed));
        subs.push(Subscriber { queue: tx, prefixes: Arc::clone(&prefixes), alive: Arc::clone(&alive), hwm });
    }
    let result = write_loop(&mut stream, topic, &queue, &prefixes, &alive, stats);
    alive.store(false, Ordering::Relaxed);
    let _ = stream.shutdown(std::net::Shutdown::Both);
    result
}

fn write_loop(
    stream: &mut TcpStream,
    topic: &[u8],
    queue: &Receiver<Arc<(u64, Vec<u8>)>>,
    prefixes: &Arc<Mutex<Vec<Vec<u8>>>>,
    alive: &Arc<std::sync::atomic::AtomicBool>,
    stats: &PublisherStats,
) -> io::Result<()> {
    let mut reader = stream.try_clone()?;
    // Subscriptions may come at any time: the reader waits as long as the connection lives (the
    // writer shuts it down on its way out).
    reader.set_read_timeout(None)?;
    let (p, a) = (Arc::clone(prefixes), Arc::clone(alive));
    let reading = std::thread::Builder::new().name("kv-events-sub-read".into()).spawn(move || {
        while let Ok(m) = zmtp::read(&mut reader) {
            let Some((on, t)) = zmtp::subscription(&m) else { continue };
            let mut list = lock(&p);
            if on {
                if list.len() >= SUBSCRIPTIONS_MAX || t.len() > PREFIX_BYTES_MAX {
                    break; // past its limits: cut off
                }
                list.push(t);
            } else if let Some(i) = list.iter().position(|x| *x == t) {
                list.swap_remove(i);
            }
        }
        a.store(false, Ordering::Relaxed);
    })?;
    let since = Instant::now();
    let result = loop {
        if !alive.load(Ordering::Relaxed) {
            break Ok(());
        }
        if lock(prefixes).is_empty() && since.elapsed() > IDLE_UNSUBSCRIBED {
            break Ok(());
        }
        match queue.recv_timeout(Duration::from_millis(500)) {
            Ok(batch) => {
                let seq = batch.0.to_be_bytes();
                // Each batch written whole within one deadline, however slowly the subscriber reads.
                let mut until = Until { s: &mut *stream, deadline: Instant::now() + IO_TIMEOUT };
                if let Err(e) = zmtp::write_message(&mut until, &[topic, &seq, &batch.1]) {
                    break Err(e);
                }
                stats.subscriber_batches_sent.fetch_add(1, Ordering::Relaxed);
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {}
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break Ok(()),
        }
    };
    let _ = stream.shutdown(std::net::Shutdown::Both);
    let _ = reading.join();
    result
}

/// The end of a replay: sequence -1 and an empty payload.
const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Answers replay requests: a message whose last frame is a start sequence (8 bytes, big-endian)
/// gets every buffered batch from it on as `["", seq, payload]`, then `["", -1, ""]` (the empty
/// first frame is the delimiter a REQ client expects; a DEALER sends and gets it too).
fn serve_replay(listener: TcpListener, ring: Ring) {
    let open = Arc::new(AtomicUsize::new(0));
    for conn in listener.incoming() {
        let Ok(mut stream) = conn else {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        if open.load(Ordering::Relaxed) >= SUBSCRIBERS_MAX {
            continue;
        }
        open.fetch_add(1, Ordering::Relaxed);
        let (ring, open2) = (Arc::clone(&ring), Arc::clone(&open));
        let spawned = std::thread::Builder::new().name("kv-events-replay-conn".into()).spawn(move || {
            let _ = (|| -> io::Result<()> {
                let deadline = Instant::now() + IO_TIMEOUT;
                zmtp::handshake(&mut Until { s: &mut stream, deadline }, "ROUTER")?;
                // A client may ask again and again; an idle one waits up to a minute for its next
                // request, each request read and answered whole within a minute of the wait's start.
                loop {
                    let deadline = Instant::now() + REPLAY_EXCHANGE;
                    let mut stream = Until { s: &mut stream, deadline };
                    let zmtp::Incoming::Message(frames) = zmtp::read(&mut stream)? else { continue };
                    let Some(start) = frames.last().and_then(|f| <[u8; 8]>::try_from(f.as_slice()).ok())
                    else {
                        continue; // not a replay request
                    };
                    let start = u64::from_be_bytes(start);
                    let batches: Vec<_> = lock(&ring).iter().filter(|b| b.0 >= start).cloned().collect();
                    for b in batches {
                        zmtp::write_message(&mut stream, &[b"", &b.0.to_be_bytes(), &b.1])?;
                    }
                    zmtp::write_message(&mut stream, &[b"", &END_SEQ, b""])?;
                }
            })();
            open2.fetch_sub(1, Ordering::Relaxed);
        });
        if spawned.is_err() {
            open.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
