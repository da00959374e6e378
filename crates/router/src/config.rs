//! Everything the router bounds, one field each, units last.

use std::net::SocketAddr;
use std::time::Duration;

pub use pdserve_api::Role;
use pdserve_http::ServerConfig;

use crate::admission::AdmissionConfig;
use crate::discovery::{DiscoverSpec, ResolverConf};
use crate::health::BreakerConfig;

/// Which [`crate::Policy`] picks workers (in PD mode: prefill workers; decode workers go by load).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PolicyKind {
    RoundRobin,
    LeastOutstanding,
    PowerOfTwo,
    CacheAware,
}

impl PolicyKind {
    pub fn parse(s: &str) -> Option<PolicyKind> {
        match s {
            "round_robin" | "round-robin" => Some(PolicyKind::RoundRobin),
            "least_outstanding" | "least-outstanding" => Some(PolicyKind::LeastOutstanding),
            "power_of_two" | "power-of-two" => Some(PolicyKind::PowerOfTwo),
            "cache_aware" | "cache-aware" => Some(PolicyKind::CacheAware),
            _ => None,
        }
    }

    pub fn build(self) -> Box<dyn crate::Policy> {
        match self {
            PolicyKind::RoundRobin => Box::new(crate::RoundRobin::default()),
            PolicyKind::LeastOutstanding => Box::new(crate::LeastOutstanding),
            PolicyKind::PowerOfTwo => Box::new(crate::PowerOfTwo::new(0x5eed_f00d)),
            PolicyKind::CacheAware => Box::new(crate::CacheAware::default()),
        }
    }
}

/// A worker to start with: its base URL (`http://host:port`) and role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    pub url: String,
    pub role: Role,
}

#[derive(Debug, Clone)]
pub struct RouterConfig {
    pub listen: SocketAddr,
    /// Names this process in `/debug/requests` and logs.
    pub process_name: String,
    pub workers: Vec<WorkerSpec>,
    pub policy: PolicyKind,
    pub admission: AdmissionConfig,
    pub breaker: BreakerConfig,
    /// A request's deadline when the client sets no `timeout`, and the most it may set.
    pub request_timeout_max: Duration,
    /// Bound on connecting to a worker; a connect that takes longer counts as a worker failure.
    pub connect_timeout: Duration,
    /// Open connections per worker (busy and idle); a request that needs one more gets a 503.
    pub connections_per_worker_max: usize,
    /// Idle pooled connections are closed after this (below the workers' own keep-alive timeout).
    pub idle_connection_timeout: Duration,
    /// Connect-refused retries on other workers, per leg. Nothing else is ever retried.
    pub retries_max: u32,
    /// Interval of active health probes.
    pub probe_interval: Duration,
    /// Deadline of one probe.
    pub probe_timeout: Duration,
    /// Interval of the prefill + decode pair probes (a real 2-token request through both). A client
    /// request that completes through a pair proves the path as well, so a busy router sends few.
    /// Each one may take this long (it queues behind the workers' work like any request).
    pub pair_probe_interval: Duration,
    /// Largest upstream response body the router buffers (non-streaming answers).
    pub upstream_body_bytes_max: usize,
    /// Deadline for collecting workers' `/debug/requests`.
    pub debug_fanout_timeout: Duration,
    /// Answered `/v1/responses` kept for `previous_response_id` through this router: at most this
    /// many (0: none) ...
    pub responses_max: usize,
    /// ... together at most this many bytes ...
    pub responses_max_bytes: usize,
    /// ... none older than this.
    pub responses_max_age: Duration,
    /// Bearer key for `/v1/*`, if set.
    pub api_key: Option<String>,
    /// Bearer key for `/workers` and `/debug/*`, if set.
    pub admin_key: Option<String>,
    /// The stack's secret, sent to workers on every request (`x-pdserve-cluster-secret`), if set.
    pub cluster_secret: Option<String>,
    /// The client-facing HTTP server's bounds.
    pub server: ServerConfig,
    /// Log one line per request to stderr.
    pub log_requests: bool,
    /// Moves of one request to another worker after its worker died, stalled or lost its KV, at most
    /// (0 turns migration off).
    pub migrations_max: u32,
    /// A stream whose worker sends no token for this long (after its first) has stalled: it moves to
    /// another worker. `None`: streams never count as stalled (their deadline still ends them).
    pub stall_timeout: Option<Duration>,
    /// Conditional disaggregation (PD pools, cache-aware policy): a request the decode policy would
    /// send to a decode worker for its cache, that worker lacking at most this many bytes of the
    /// prompt text, goes to that worker alone, which computes the tail itself (0: every request goes
    /// through a prefill worker).
    pub max_local_prefill_bytes: usize,
    /// The served model's folder (`--tokenizer`): precise prefix routing on the workers' KV events
    /// (`crate::kv_listen`); `None`: the cache-aware policy goes by the prompts it routed.
    pub tokenizer: Option<std::path::PathBuf>,
    /// Where spans go (`--otlp-traces-endpoint`, OTLP/HTTP); `None`: no traces.
    pub otlp_traces_endpoint: Option<pdserve_trace::Endpoint>,
    /// Worker pools read from DNS (`--discover`): re-read every `discover_interval`; new addresses
    /// join, vanished ones drain.
    pub discover: Vec<DiscoverSpec>,
    pub discover_interval: Duration,
    /// Where `discover` names are looked up (default: `/etc/resolv.conf`).
    pub resolver: Option<ResolverConf>,
    /// After a drain starts (SIGTERM, or [`crate::Router::drain_flag`]): how long requests in flight
    /// may take; those left then end with an explicit 503 error.
    pub drain_timeout: Duration,
}

impl Default for RouterConfig {
    fn default() -> Self {
        RouterConfig {
            listen: "127.0.0.1:8000".parse().expect("literal address"),
            process_name: "router".to_owned(),
            workers: Vec::new(),
            policy: PolicyKind::CacheAware,
            admission: AdmissionConfig::default(),
            breaker: BreakerConfig::default(),
            request_timeout_max: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(1),
            connections_per_worker_max: 512,
            idle_connection_timeout: Duration::from_secs(20),
            retries_max: 2,
            probe_interval: Duration::from_secs(1),
            probe_timeout: Duration::from_secs(3),
            pair_probe_interval: Duration::from_secs(5),
            upstream_body_bytes_max: 16 * 1024 * 1024,
            debug_fanout_timeout: Duration::from_millis(500),
            responses_max: 4096,
            responses_max_bytes: 256 << 20,
            responses_max_age: Duration::from_secs(3600),
            api_key: None,
            admin_key: None,
            cluster_secret: None,
            server: ServerConfig::default(),
            log_requests: false,
            migrations_max: 2,
            stall_timeout: Some(Duration::from_secs(30)),
            max_local_prefill_bytes: 4096,
            otlp_traces_endpoint: None,
            tokenizer: None,
            discover: Vec::new(),
            discover_interval: Duration::from_secs(5),
            resolver: None,
            drain_timeout: Duration::from_secs(30),
        }
    }
}
