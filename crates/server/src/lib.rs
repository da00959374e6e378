//! The pdserve worker: a mio HTTP loop (from `pdserve-http`) on one thread, an engine thread owning the
//! scheduler, the KV cache and the model, and two bounded channels between them. It serves the
//! OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`), truthful health
//! (`/health/live`, `/health/ready`, `/health/generate`), `/metrics`, `/debug/requests` and
//! `/abort/{id}`. Every failure becomes an answer in one place (`error.rs`).
//!
//! The binary is `pdserve-server`; [`run`] is the same worker for programs that embed it.

mod api;
mod engine;
mod error;
mod frontend;
mod metrics;
mod sys;
mod transfer;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pdserve_http::{Server, ServerConfig};
use pdserve_kvcache::{KvCache, KvConfig};
use pdserve_model::{CpuBackend, ModelFiles};
use pdserve_scheduler::{Scheduler, SchedulerConfig};
use pdserve_telemetry::RequestLedger;

/// Everything a worker is configured with. Every bound is here.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub addr: SocketAddr,
    pub model_dir: PathBuf,
    /// The name clients put in `model` (the folder name by default).
    pub model_name: String,
    /// This process's name in `/debug/requests`.
    pub process_name: String,
    pub http: ServerConfig,
    pub scheduler: SchedulerConfig,
    pub kv_blocks: usize,
    pub block_size: usize,
    /// A request's deadline when neither its body nor its headers give one.
    pub default_timeout: Duration,
    /// The longest deadline a request may ask for.
    pub max_timeout: Duration,
    pub probe_timeout: Duration,
    /// `/health/ready` fails when the engine loop has not ticked for this long.
    pub ready_tick_ms: u64,
    /// ... or when work is waiting and no token came out for this long.
    pub ready_token_ms: u64,
    /// After SIGTERM: how long running requests may take before they are aborted.
    pub drain_timeout: Duration,
    /// How long past its deadline the HTTP thread waits for the engine to end a request itself.
    pub watchdog_grace: Duration,
    /// Live requests the ledger tracks at most.
    pub ledger_capacity: usize,
    /// Test hook: a prompt containing this text panics the request handler (for the panic-isolation test).
    pub panic_trigger: Option<String>,
    /// What this worker does: unified, prefill (computes prompts and offers their KV) or decode
    /// (pulls the KV from a prefill worker and generates).
    pub role: pdserve_scheduler::Role,
    /// Prefill role: where decode workers connect to pull KV (port 0 picks one).
    pub transfer_addr: SocketAddr,
    /// Prefill role: keep the KV memory in a shared file under `/dev/shm`, so decode workers on the same
    /// host copy blocks straight out of it instead of receiving them over TCP.
    pub kv_shm: bool,
    /// Set at start: the shared KV file, when `kv_shm`.
    pub kv_shm_path: Option<PathBuf>,
    /// Stop (as on SIGTERM) when standard input reaches end of file: a supervisor that dies, or a test
    /// process that exits, takes the worker with it.
    pub exit_on_stdin_eof: bool,
    /// What runs the model.
    pub device: Device,
    /// How the CPU backend stores the weights its decode steps read (`--weights f32|q8|q4`).
    pub weights: pdserve_model::WeightFormat,
    /// What steps of more than two rows read ("f32" or "bf16"): set when the worker starts, from the
    /// backend (the CPU's bf16 GEMM needs AVX-512 BF16; the GPU backend is bf16).
    pub multi_row_weights: &'static str,
}

/// What runs the model: the CPU backend, or the GPU backend on CUDA device N.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Device {
    Cpu,
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("unknown device {s:?}: cpu, cuda or cuda:N")),
        }
    }
}

impl WorkerConfig {
    pub fn new(addr: SocketAddr, model_dir: PathBuf) -> Self {
        let model_name =
            model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "model".into());
        WorkerConfig {
            addr,
            model_dir,
            model_name,
            process_name: "worker".into(),
            http: ServerConfig::default(),
            scheduler: SchedulerConfig::default(),
            kv_blocks: 1024,
            block_size: 16,
            default_timeout: Duration::from_secs(600),
            max_timeout: Duration::from_secs(3600),
            probe_timeout: Duration::from_secs(10),
            // One engine step over a full token budget can take seconds on a small CPU; a loop that
            // has not come round in 10 s is stuck, not busy.
            ready_tick_ms: 10_000,
            ready_token_ms: 30_000,
            drain_timeout: Duration::from_secs(30),
            watchdog_grace: Duration::from_secs(2),
            ledger_capacity: 65_536,
            panic_trigger: None,
            exit_on_stdin_eof: false,
            role: pdserve_scheduler::Role::Unified,
            transfer_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            kv_shm: false,
            device: Device::Cpu,
            weights: pdserve_model::WeightFormat::F32,
            multi_row_weights: "f32",
            kv_shm_path: None,
        }
    }
}

/// Why the worker could not start or stopped with an error.
#[derive(Debug)]
pub enum WorkerError {
    Model(pdserve_model::ModelError),
    Io(std::io::Error),
    Config(String),
}

impl std::fmt::Display for WorkerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            WorkerError::Model(e) => write!(f, "model: {e}"),
            WorkerError::Io(e) => write!(f, "i/o: {e}"),
            WorkerError::Config(e) => write!(f, "configuration: {e}"),
        }
    }
}

impl std::error::Error for WorkerError {}

/// Loads the model, binds, calls `on_ready` with the bound address, and serves until SIGTERM/SIGINT
/// and the drain that follows.
pub fn run(mut config: WorkerConfig, on_ready: impl FnOnce(SocketAddr)) -> Result<(), WorkerError> {
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
    let files = ModelFiles::load(&config.model_dir).map_err(WorkerError::Model)?;
    let context = files.config.max_position_embeddings.min(config.scheduler.max_context_tokens);
    config.scheduler.max_context_tokens = context;
    config.scheduler.role = config.role;
    let model_config = files.config.clone();
    let weights = Arc::new(files.weights);
    let backend: Box<dyn pdserve_model::Backend> = if let Device::Cuda(n) = config.device {
        if config.kv_shm {
            return Err(WorkerError::Config(
                "--kv-shm needs the CPU backend (the GPU keeps KV in device memory)".into(),
            ));
        }
        if config.weights != pdserve_model::WeightFormat::F32 {
            return Err(WorkerError::Config(format!(
                "--weights {} is a CPU format; the GPU backend stores bf16",
                config.weights.name()
            )));
        }
        config.multi_row_weights = "bf16";
        Box::new(
            pdserve_model::GpuBackend::new(
                model_config.clone(),
                &weights,
                config.kv_blocks,
                config.block_size,
                n,
            )
            .map_err(WorkerError::Model)?,
        )
    } else if config.kv_shm && config.role == pdserve_scheduler::Role::Prefill {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let path = PathBuf::from(format!("/dev/shm/pdserve-kv-{}-{nanos}", std::process::id()));
        let b =
            CpuBackend::new_shared(model_config.clone(), weights, config.kv_blocks, config.block_size, &path)
                .and_then(|b| b.with_weight_format(config.weights))
                .map_err(WorkerError::Model)?;
        config.kv_shm_path = Some(path);
        config.multi_row_weights = b.multi_row_format();
        Box::new(b)
    } else {
        let b = CpuBackend::new(model_config.clone(), weights, config.kv_blocks, config.block_size)
            .with_weight_format(config.weights)
            .map_err(WorkerError::Model)?;
        config.multi_row_weights = b.multi_row_format();
        Box::new(b)
    };
    let pd = match config.role {
        pdserve_scheduler::Role::Unified => None,
        role => {
            let listen = (role == pdserve_scheduler::Role::Prefill).then_some(config.transfer_addr);
            let io = transfer::TransferIo::new(listen).map_err(WorkerError::Io)?;
            if let Some(a) = io.local_addr() {
                config.transfer_addr = a;
            }
            let c = &files.config;
            Some(engine::Pd {
                io,
                sender: pdserve_pd_transfer::Sender::new(pdserve_pd_transfer::SenderConfig {
                    shared_region: config.kv_shm_path.is_some(),
                    ..pdserve_pd_transfer::SenderConfig::default()
                }),
                receiver: pdserve_pd_transfer::Receiver::new(4),
                layout: pdserve_pd_transfer::Layout {
                    num_layers: c.num_layers as u32,
                    num_kv_heads: c.num_kv_heads as u32,
                    head_dim: c.head_dim as u32,
                    block_size: config.block_size as u32,
                    dtype: pdserve_pd_transfer::Dtype::F32,
                },
                next_epoch: (std::process::id() as u32).wrapping_mul(2_654_435_761),
                incoming: Default::default(),
                started: Default::default(),
                views: Default::default(),
            })
        }
    };
    let kv =
        KvCache::new(KvConfig { num_blocks: config.kv_blocks as u32, block_size: config.block_size as u32 })
            .map_err(|e| WorkerError::Config(e.to_string()))?;
    let now = Instant::now();
    let sched = Scheduler::new(config.scheduler.clone(), kv, now);
    let metrics = metrics::Metrics::new().map_err(|e| WorkerError::Config(e.to_string()))?;
    let server = Server::bind(config.addr, config.http).map_err(WorkerError::Io)?;
    let addr = server.local_addr().map_err(WorkerError::Io)?;
    let shared = Arc::new(engine::Shared {
        epoch: now,
        last_tick_ms: Default::default(),
        last_token_ms: Default::default(),
        waiting: Default::default(),
        running: Default::default(),
        ledger: Mutex::new(RequestLedger::new(&config.process_name, config.ledger_capacity)),
    });
    let bound = config.scheduler.max_queued_requests + config.scheduler.max_running_requests + 64;
    let (cmd_tx, cmd_rx) = crossbeam_channel::bounded(bound);
    let (reply_tx, reply_rx) = crossbeam_channel::bounded(bound * 64);
    let engine = engine::Engine {
        sched,
        pd,
        backend,
        eos_ids: files.config.eos_token_ids.clone(),
        commands: cmd_rx,
        replies: reply_tx,
        waker: server.waker(),
        shared: Arc::clone(&shared),
        metrics: metrics.clone(),
    };
    let engine_thread = std::thread::Builder::new()
        .name("engine".into())
        .spawn(move || engine.run())
        .map_err(WorkerError::Io)?;
    let vocab = files.config.vocab_size;
    let front = frontend::Frontend::new(
        server,
        config,
        Arc::new(files.text),
        context,
        vocab,
        cmd_tx,
        reply_rx,
        shared,
        metrics,
    );
    on_ready(addr);
    let result = front.run().map_err(WorkerError::Io);
    // Dropping the frontend closed the command channel; the engine ends its loop.
    let _ = engine_thread.join();
    result
}
