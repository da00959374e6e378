//! Everything an engine is configured with; every bound is here.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use pdserve_api::Role;
use pdserve_model::{KvDtype, WeightFormat};
use pdserve_scheduler::SchedulerConfig;

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
    type Err = crate::EngineError;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device, crate::EngineError> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| crate::EngineError::UnknownDevice { value: s.to_owned() }),
        }
    }
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// A Hugging Face model folder (config.json, safetensors, tokenizer.json).
    pub model_dir: PathBuf,
    /// This process's name in `/debug/requests`.
    pub process_name: String,
    /// Unified, prefill (computes prompts and offers their KV) or decode (pulls the KV and generates).
    pub role: Role,
    pub device: Device,
    /// How the CPU backend stores the weights its steps read; `Auto` (the default) takes the
    /// checkpoint's own precision (bf16, f16 or FP8 as shipped, else f32; see `WeightFormat::resolve`).
    pub weights: WeightFormat,
    /// Q8 or Q4 weights' products round their input rows to int8 (`--activations q8`; see
    /// `CpuBackend::with_int8_activations`): faster decode on CPUs without AVX-512, as llama.cpp
    /// computes; off by default (f32 activations, the reference's numbers).
    pub int8_activations: bool,
    /// The CPU backend's KV element type; `None` takes f16 (half the bytes of f32 for decode
    /// attention, the pool and a PD transfer). The GPU backend keeps its own (bf16 on the device, f32
    /// at its block interface) and refuses any other.
    pub kv_dtype: Option<KvDtype>,
    pub scheduler: SchedulerConfig,
    pub kv_blocks: usize,
    pub block_size: usize,
    /// Prefill role: where decode workers connect to pull KV (port 0 picks one).
    pub transfer_addr: SocketAddr,
    /// Prefill role: keep the KV memory in a shared file under `/dev/shm`, so decode workers on the
    /// same host copy blocks straight out of it instead of receiving them over TCP.
    pub kv_shm: bool,
    /// KV over UCX (the `ucx` feature): a prefill engine keeps its KV in a shared region (as
    /// `kv_shm`) and exports it for one-sided reads; a decode engine reads named blocks with UCX.
    pub kv_ucx: bool,
    /// The stack's scope for shared KV files (`pdserve_pd_transfer::transport::shm::valid_scope`): a
    /// prefill engine names its region in it, a decode engine maps no other.
    pub shm_scope: String,
    /// Live requests the ledger tracks at most.
    pub ledger_capacity: usize,
    /// How long past its deadline a request may stay before the caller's side ends it itself (a stuck
    /// engine thread).
    pub watchdog_grace: Duration,
    /// Results the engine thread may have queued for the caller, per allowed live request.
    pub replies_per_request: usize,
    /// Prefill role: tokens per step while any KV transfer is live. The transfer protocol moves only
    /// between steps, so each of its round trips waits for the step in progress; shorter steps then
    /// keep a finished prompt's time to first token from waiting on the next prompts' prefill.
    pub transfer_step_tokens: usize,
    /// The format tool calls are written and read in; `None` takes the chat template's.
    pub tool_format: Option<crate::ToolFormat>,
    /// The most tool calls one answer makes where parallel calls are allowed (a forced call's grammar
    /// ends after this many; under `auto` the answer ends with the call that reaches it).
    pub tool_calls_max: usize,
    /// How the model marks its thinking; `None` takes the chat template's (`Think` where it writes
    /// or strips `<think>` spans).
    pub reasoning_format: Option<crate::ReasoningFormat>,
    /// Speculative decoding (unified and decode roles): draft tokens from the model's draft layer
    /// (DeepSeek's multi-token prediction layer, one guess per step while up to 4 requests run) where
    /// the checkpoint ships one, else from the request's own context (prompt lookup, up to 8 per
    /// step while one request runs), verified in one multi-row step: `Speculative::auto(8)` by
    /// default, `Speculative::OFF` to turn it off. The output is the same either way. A prefill
    /// worker with the draft layer runs its pass over the prompt, so that a decode worker can draft;
    /// both sides of a PD pair load it or neither (their KV layouts differ by its layer).
    pub speculative: crate::Speculative,
    /// How long a request's output constraint (a JSON schema, regex, grammar or forced tool call)
    /// may take to compile (`--grammar-compile-timeout-s`); past it the request is a 400. Compiles
    /// run beside the text thread, so a slow one delays only its own request.
    pub grammar_compile_timeout: Duration,
    /// Publish the prefix cache's changes as vLLM's KV events (`--kv-events-config`, vLLM's flag and
    /// JSON): ZMQ PUB and replay sockets, see `pdserve_kv_events`.
    pub kv_events: Option<pdserve_kv_events::KvEventsConfig>,
    /// The KV offload tier (unified and prefill roles; `--kv-offloading-size`,
    /// `--kv-offload-disk-gib`): blocks the prefix cache evicts are kept in host memory beyond the
    /// pool, then in a file, and copied back on a prefix match instead of being computed again. Off
    /// by default.
    pub kv_offload: crate::OffloadConfig,
    /// Test hook (`--test-corrupt-kv N`): the first KV block received after this worker's Nth pull
    /// starts (from 1; 0: none) has one bit flipped before it is stored and checked, as a faulty link
    /// or a stray write would (the checksum catches it; the router computes the prompt again).
    pub test_corrupt_kv_pull: u32,
    /// Test hooks (`--test-stall-transfer N`, `--test-drop-done N`): faults of this worker's KV
    /// offers, by prompt length (see `pdserve_pd_transfer::SenderFaults`).
    pub test_transfer_faults: pdserve_pd_transfer::SenderFaults,
}

impl EngineConfig {
    /// The KV element type the backend holds and the transfer handshake states.
    pub fn resolved_kv_dtype(&self) -> KvDtype {
        match self.device {
            Device::Cpu => self.kv_dtype.unwrap_or(KvDtype::F16),
            Device::Cuda(_) => KvDtype::F32,
        }
    }

    pub fn new(model_dir: PathBuf) -> EngineConfig {
        EngineConfig {
            model_dir,
            process_name: "engine".into(),
            role: Role::Unified,
            device: Device::Cpu,
            weights: WeightFormat::Auto,
            int8_activations: false,
            kv_dtype: None,
            // The model's maximum context (capped by what the KV pool holds) unless set lower.
            // Attending to 1,000 earlier positions costs the CPU backend about one token's own work
            // (`cargo bench -p pdserve-model --bench forward -- --only chunk256`: a 256-token chunk
            // at 7,500 costs 8.7 chunks at 0), so late chunks of a long prompt shrink to keep steps short.
            scheduler: SchedulerConfig {
                context_tokens_max: usize::MAX,
                attention_cost_positions: Some(1000),
                ..SchedulerConfig::default()
            },
            kv_blocks: 1024,
            block_size: 16,
            transfer_addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            kv_shm: false,
            kv_ucx: false,
            shm_scope: pdserve_pd_transfer::transport::shm::LOCAL_SCOPE.to_owned(),
            ledger_capacity: 65_536,
            watchdog_grace: Duration::from_secs(2),
            replies_per_request: 64,
            transfer_step_tokens: 256,
            tool_format: None,
            tool_calls_max: 8,
            reasoning_format: None,
            speculative: crate::Speculative::auto(8),
            grammar_compile_timeout: Duration::from_secs(10),
            kv_events: None,
            kv_offload: crate::OffloadConfig::default(),
            test_corrupt_kv_pull: 0,
            test_transfer_faults: pdserve_pd_transfer::SenderFaults::default(),
        }
    }
}
