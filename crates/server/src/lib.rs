//! The pdserve worker: the OpenAI-compatible HTTP API in front of a `pdserve-engine`. One thread runs
//! the `pdserve-http` mio loop (routes, the OpenAI shapes of `pdserve-api`, streaming, health,
//! `/metrics`, `/debug/requests`, `/abort/{id}`, the SIGTERM drain); the engine runs on its own
//! thread behind bounded channels. Every failure becomes an answer through `pdserve_api::ApiError`.
//!
//! The binary is `pdserve-server`; [`run`] is the same worker for programs that embed it.

mod frontend;
mod sys;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdserve_engine::{Engine, EngineConfig, EngineError};
use pdserve_http::{Server, ServerConfig};

/// Everything a worker is configured with. Every bound is here or in [`EngineConfig`].
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub addr: SocketAddr,
    /// The name clients put in `model` (the folder name by default).
    pub model_name: String,
    pub http: ServerConfig,
    pub engine: EngineConfig,
    /// A request's deadline when neither its body nor its headers give one.
    pub default_timeout: Duration,
    /// The longest deadline a request may ask for.
    pub max_timeout: Duration,
    pub probe_timeout: Duration,
    /// `/health/ready` fails when the engine loop has not ticked for this long...
    pub ready_tick: Duration,
    /// ... or when work is waiting and no token came out for this long.
    pub ready_token: Duration,
    /// After SIGTERM: how long running requests may take before they are aborted.
    pub drain_timeout: Duration,
    /// Test hook: a prompt containing this text panics the request handler (for the panic-isolation test).
    pub panic_trigger: Option<String>,
    /// Stop (as on SIGTERM) when standard input reaches end of file: a supervisor that dies, or a test
    /// process that exits, takes the worker with it.
    pub exit_on_stdin_eof: bool,
    /// The stack's secret: requests without it (`x-pdserve-cluster-secret`) are refused, except the
    /// probes with `open_probes`, and `/v1/*` with `api_key`; a KV handle (`pd_transfer`) is taken
    /// only with it.
    pub cluster_secret: Option<String>,
    /// `/health/*` and `/metrics` answer without the cluster secret (for probes that cannot send it).
    pub open_probes: bool,
    /// Clients may call `/v1/*` directly with this key (`Authorization: Bearer` or `x-api-key`).
    pub api_key: Option<String>,
    /// Serve on a non-loopback address with neither `api_key` nor `cluster_secret` (otherwise such a
    /// worker refuses to start: anyone reaching it could use it and hand it KV handles).
    pub allow_unauthenticated: bool,
    /// Answered Responses requests kept for `previous_response_id` (`store: true`, the default): at
    /// most this many ...
    pub responses_max: usize,
    /// ... together at most this many bytes (each keeps its whole conversation) ...
    pub responses_max_bytes: usize,
    /// ... and none older than this.
    pub responses_max_age: Duration,
    /// Where each request's spans go (`--otlp-traces-endpoint`, OTLP/HTTP); `None`: no traces.
    pub otlp_traces_endpoint: Option<pdserve_trace::Endpoint>,
    /// The CPU cores every thread of the worker runs on (`--cpu-cores`), its compute pool one thread
    /// per core: workers sharing a host then never fight over cores. `None`: every core it may use.
    pub cpu_cores: Option<Vec<usize>>,
}

impl WorkerConfig {
    /// Reachable beyond this host (not a loopback address) with neither an API key nor a secret.
    pub fn unauthenticated(&self) -> bool {
        !self.addr.ip().is_loopback() && self.api_key.is_none() && self.cluster_secret.is_none()
    }

    pub fn new(addr: SocketAddr, engine: EngineConfig) -> Self {
        let model_name = engine
            .model_dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        WorkerConfig {
            addr,
            model_name,
            http: ServerConfig::default(),
            engine,
            default_timeout: Duration::from_secs(600),
            max_timeout: Duration::from_secs(3600),
            probe_timeout: Duration::from_secs(10),
            // One engine step over a full token budget can take seconds on a small CPU; a loop that
            // has not come round in 10 s is stuck, not busy.
            ready_tick: Duration::from_secs(10),
            ready_token: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(30),
            panic_trigger: None,
            exit_on_stdin_eof: false,
            cluster_secret: None,
            open_probes: false,
            api_key: None,
            allow_unauthenticated: false,
            responses_max: 4096,
            responses_max_bytes: 256 << 20,
            responses_max_age: Duration::from_secs(3600),
            otlp_traces_endpoint: None,
            cpu_cores: None,
        }
    }
}

/// Why the worker could not start or stopped with an error.
#[derive(Debug)]
#[non_exhaustive]
pub enum WorkerError {
    Engine(EngineError),
    Io(std::io::Error),
    /// Bound beyond loopback with no API key and no cluster secret, without `allow_unauthenticated`.
    Unauthenticated(SocketAddr),
}

impl std::fmt::Display for WorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerError::Engine(e) => write!(f, "engine: {e}"),
            WorkerError::Io(e) => write!(f, "i/o: {e}"),
            WorkerError::Unauthenticated(a) => write!(
                f,
                "{a} is reachable from other hosts, and this worker has neither an API key (--api-key) nor a \
                 cluster secret (--cluster-secret-file or PDSERVE_CLUSTER_SECRET): anyone reaching it could \
                 use it and hand it KV handles; give it one, bind a loopback address (--host 127.0.0.1), or \
                 pass --allow-unauthenticated to serve it open"
            ),
        }
    }
}

impl std::error::Error for WorkerError {}

/// Binds, starts the engine, calls `on_ready` with the bound address, and serves until SIGTERM/SIGINT
/// (or the end of standard input, with `exit_on_stdin_eof`) and the drain that follows.
pub fn run(config: WorkerConfig, on_ready: impl FnOnce(SocketAddr)) -> Result<(), WorkerError> {
    if let Some(cores) = &config.cpu_cores {
        // Before any other thread starts: each inherits the mask, and the compute pool sizes itself
        // to it.
        sys::pin_to_cores(cores).map_err(|e| {
            WorkerError::Io(std::io::Error::new(e.kind(), format!("--cpu-cores {cores:?}: {e}")))
        })?;
    }
    if config.unauthenticated() {
        if !config.allow_unauthenticated {
            return Err(WorkerError::Unauthenticated(config.addr));
        }
        eprintln!(
            "pdserve-server: WARNING: serving on {} with no API key and no cluster secret \
             (--allow-unauthenticated): anyone reaching it may use it and hand it KV handles",
            config.addr
        );
    }
    sys::install_termination_handler();
    if config.exit_on_stdin_eof {
        std::thread::Builder::new()
            .name("stdin-watch".into())
            .spawn(|| {
                let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
                sys::request_termination();
            })
            .map_err(WorkerError::Io)?;
    }
    let server = Server::bind(config.addr, config.http).map_err(WorkerError::Io)?;
    let addr = server.local_addr().map_err(WorkerError::Io)?;
    let waker = server.waker();
    let engine = Engine::start(
        config.engine.clone(),
        Arc::new(move || {
            let _ = waker.wake();
        }),
    )
    .map_err(WorkerError::Engine)?;
    sys::trim_heap();
    let front = frontend::Frontend::new(server, config, engine).map_err(WorkerError::Io)?;
    on_ready(addr);
    // Dropping the frontend drops the engine, which ends its thread.
    front.run().map_err(WorkerError::Io)
}
