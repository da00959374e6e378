//! The crate's one error type.

use std::fmt;

use pdserve_api::ErrorKind;
use pdserve_scheduler::Rejection;

/// Why the engine could not start, or why it did not take a request.
#[derive(Debug)]
#[non_exhaustive]
pub enum EngineError {
    /// The model folder could not be loaded, or the backend could not be built.
    Model(pdserve_model::ModelError),
    /// A socket or file of the engine's own (the KV transfer listener, the shared KV file).
    Io(std::io::Error),
    /// A setting the engine cannot run with.
    Config { field: &'static str, value: String },
    /// The engine's metrics could not be registered (a bug: their names are fixed).
    Metrics(pdserve_telemetry::TelemetryError),
    /// A device name that is none of `cpu`, `cuda`, `cuda:N`.
    UnknownDevice { value: String },
    /// Quantized weights are a CPU format; the GPU backend stores bf16.
    GpuWeights { weights: &'static str },
    /// Shared KV memory is host memory; the GPU backend keeps its KV on the device.
    GpuSharedKv,
    /// `--kv-dtype` named a type the GPU backend does not hold at its block interface.
    GpuKvDtype { dtype: &'static str },
    /// The scheduler refused the request (queue full, too long for the context or the KV pool).
    Rejected(Rejection),
    /// The request itself is wrong (an empty prompt, a token outside the vocabulary, a template
    /// the prompt does not fit).
    InvalidInput { problem: String },
    /// The prompt leaves no room to generate.
    ContextLengthExceeded { prompt_tokens: usize, context_tokens: usize },
    /// The waiting queue is full.
    QueueFull { queued: usize, limit: usize },
    /// A live request already has this id.
    DuplicateRequestId { request_id: String },
    /// The engine thread's command queue is full (it is not keeping up).
    Busy { limit: usize },
    /// The engine thread has stopped.
    Stopped,
    /// The prompt's KV could not be had from the prefill worker.
    KvTransfer(KvTransferProblem),
}

/// Why a decode worker could not get a prompt's KV from the prefill worker.
#[derive(Debug)]
#[non_exhaustive]
pub enum KvTransferProblem {
    /// This engine has no transfer endpoint (it is not a decode worker).
    NotDecodeWorker,
    /// The same transfer is already being pulled here.
    AlreadyPulling { key: pdserve_pd_transfer::TransferKey },
    /// The pull could not start (connecting to the prefill worker, a full table).
    Pull(pdserve_pd_transfer::TransferError),
    /// The prefill worker described a prompt with a token outside this model's vocabulary.
    TokenOutsideVocabulary { token: u32 },
    /// A resumed request: the prefill worker's prompt does not end with the tokens being resumed.
    ResumeMismatch,
    /// The transfer failed; the protocol's reason.
    Failed(pdserve_pd_transfer::FailReason),
    /// The transfer ended before the prefill worker described it.
    EndedUndescribed,
}

impl fmt::Display for KvTransferProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KvTransferProblem::NotDecodeWorker => {
                write!(f, "this worker has no KV transfer (it is not a decode worker)")
            }
            KvTransferProblem::AlreadyPulling { key } => write!(f, "{key} is already being pulled here"),
            KvTransferProblem::Pull(e) => write!(f, "{e}"),
            KvTransferProblem::TokenOutsideVocabulary { token } => {
                write!(f, "the prompt holds token {token}, outside the vocabulary")
            }
            KvTransferProblem::ResumeMismatch => {
                write!(f, "the prefill worker's prompt does not end with the resumed tokens")
            }
            KvTransferProblem::Failed(r) => write!(f, "{r}"),
            KvTransferProblem::EndedUndescribed => write!(f, "ended before it was described"),
        }
    }
}

impl EngineError {
    /// What a client is told: the one mapping to the wire's error kinds.
    pub fn kind(&self) -> ErrorKind {
        match self {
            EngineError::Model(_)
            | EngineError::Io(_)
            | EngineError::Config { .. }
            | EngineError::Metrics(_)
            | EngineError::UnknownDevice { .. }
            | EngineError::GpuWeights { .. }
            | EngineError::GpuSharedKv
            | EngineError::GpuKvDtype { .. } => ErrorKind::Internal,
            EngineError::Rejected(r) => match r {
                Rejection::QueueFull { .. } => ErrorKind::QueueFull,
                Rejection::ContextLengthExceeded { .. } | Rejection::KvCapacityExceeded { .. } => {
                    ErrorKind::ContextLengthExceeded
                }
                Rejection::DuplicateId => ErrorKind::DuplicateRequestId,
                _ => ErrorKind::InvalidRequest,
            },
            EngineError::InvalidInput { .. } => ErrorKind::InvalidRequest,
            EngineError::ContextLengthExceeded { .. } => ErrorKind::ContextLengthExceeded,
            EngineError::QueueFull { .. } => ErrorKind::QueueFull,
            EngineError::DuplicateRequestId { .. } => ErrorKind::DuplicateRequestId,
            EngineError::Busy { .. } => ErrorKind::NoCapacity,
            EngineError::Stopped => ErrorKind::NotReady,
            EngineError::KvTransfer(_) => ErrorKind::KvTransferFailed,
        }
    }

    /// Seconds a client should wait before trying again, where that is known.
    pub fn retry_after_s(&self) -> Option<u32> {
        match self {
            EngineError::Rejected(Rejection::QueueFull { retry_after, .. }) => {
                Some(retry_after.as_secs().max(1) as u32)
            }
            _ => None,
        }
    }

    /// The answer a client gets.
    pub fn to_api_error(&self) -> pdserve_api::ApiError {
        let e = pdserve_api::ApiError::new(self.kind(), self.to_string());
        match self.retry_after_s() {
            Some(s) => e.with_retry_after(s),
            None => e,
        }
    }
}

impl fmt::Display for EngineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EngineError::Model(e) => write!(f, "model: {e}"),
            EngineError::Io(e) => write!(f, "i/o: {e}"),
            EngineError::Config { field, value } => write!(f, "cannot run with {field} {value}"),
            EngineError::Metrics(e) => write!(f, "engine metrics: {e}"),
            EngineError::UnknownDevice { value } => write!(f, "unknown device {value:?}: cpu, cuda or cuda:N"),
            EngineError::GpuWeights { weights } => {
                write!(f, "weights {weights} are a CPU format; the GPU backend stores bf16")
            }
            EngineError::GpuKvDtype { dtype } => {
                write!(f, "KV dtype {dtype} is a CPU setting; the GPU backend keeps bf16 KV on the device")
            }
            EngineError::GpuSharedKv => {
                write!(f, "shared KV memory needs the CPU backend; the GPU keeps its KV in device memory")
            }
            EngineError::Rejected(r) => write!(f, "{r}"),
            EngineError::InvalidInput { problem } => f.write_str(problem),
            EngineError::ContextLengthExceeded { prompt_tokens, context_tokens } => write!(
                f,
                "prompt is {prompt_tokens} tokens; the context is {context_tokens} tokens and at least one must be left to generate"
            ),
            EngineError::QueueFull { queued, limit } => {
                write!(f, "request queue is full ({queued} waiting, limit {limit})")
            }
            EngineError::DuplicateRequestId { request_id } => write!(f, "request id {request_id} is already live"),
            EngineError::Busy { limit } => write!(f, "the engine's command queue is full ({limit} commands)"),
            EngineError::Stopped => write!(f, "the engine has stopped"),
            EngineError::KvTransfer(problem) => write!(f, "KV transfer failed: {problem}"),
        }
    }
}

impl std::error::Error for EngineError {}

impl From<pdserve_model::ModelError> for EngineError {
    fn from(e: pdserve_model::ModelError) -> Self {
        EngineError::Model(e)
    }
}

impl From<std::io::Error> for EngineError {
    fn from(e: std::io::Error) -> Self {
        EngineError::Io(e)
    }
}
