//! What goes into the engine and what comes out, as the caller sees it.

use std::time::Instant;

use pdserve_api::generation::{Constraint, TokenLogprob, Usage};
use pdserve_api::pd::PdHandle;
use pdserve_api::tools::{Tool, ToolChoice};
use pdserve_api::Stage;
use pdserve_chat_template::Piece;
use pdserve_model::{ChatMessage, SamplingParams};

use crate::EngineError;

/// A request's id within one engine, given by [`crate::Engine::submit`]. Ids are unique among every
/// engine of every process with overwhelming probability (they also name KV transfers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id(pub u64);

impl std::fmt::Display for Id {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

/// What to generate from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Chat messages, rendered through the model's chat template.
    Chat(Vec<ChatMessage>),
    /// Plain text, tokenized as is.
    Text(String),
    Tokens(Vec<u32>),
    /// Decode role: a prompt a prefill worker computed; its KV and token ids are pulled from it.
    Remote(PdHandle),
}

/// One generation.
#[derive(Debug, Clone)]
pub struct Request {
    /// The caller's name for it (the `x-request-id`): in the ledger and the log.
    pub request_id: String,
    pub input: Input,
    /// Tokens to generate at most; `None`: up to the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    /// The sampler's seed (a request without one gets a fresh one).
    pub seed: Option<u64>,
    /// Text that ends generation (not included in the output).
    pub stop: Vec<String>,
    /// Tokens that end generation.
    pub stop_token_ids: Vec<u32>,
    /// Generate past the model's end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Report each token's log-probability (and `sampling.top_logprobs` alternatives).
    pub logprobs: bool,
    /// The request ends by then, whatever its stage.
    pub deadline: Instant,
    /// Chat: the functions offered to the model (through its template, or described in the system
    /// message when the template has no place for them).
    pub tools: Vec<Tool>,
    /// Whether the model may or must call them: `Auto` (the default) lets it answer or call;
    /// `Required` and `Function` force a call with a grammar over the model's call format; `None`
    /// offers nothing. Calls the model writes are lifted out of its text into `Output::Text`'s
    /// `calls`, in the format of its chat template (`EngineInfo::tool_format`).
    pub tool_choice: ToolChoice,
    /// Whether more than one call may be made (under `Required` and `Auto` alike).
    pub parallel_tool_calls: bool,
    /// Extra variables for the chat template (a request's `chat_template_kwargs`: Qwen3's
    /// `enable_thinking`, say).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Whether a thinking model's `<think>` span is split from the answer (into `Output::Text`'s
    /// `reasoning`); `None`: for chat input. A decode engine's input is the prefill engine's handle,
    /// so its caller says whether the request was a chat.
    pub reasoning: Option<bool>,
    /// What the ids of the request's calls begin with (default: `request_id`); each call's id is
    /// this, then its index.
    pub tool_call_ids: Option<String>,
    /// What the output must match, token by token.
    pub constraint: Option<Constraint>,
    /// End-of-sequence and stop tokens are not sampled before this many tokens.
    pub min_tokens: usize,
    /// Added to these tokens' logits before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// A matched stop string stays in the text.
    pub include_stop_str: bool,
    /// Tokens this request already generated elsewhere (a worker it was moved away from): they
    /// follow the prompt, count as output (`max_tokens`, `min_tokens`, penalties, `usage`), move the
    /// seeded sampler past them and are turned into text again, as `Text` outputs marked `replayed`
    /// ahead of any new token, so stop strings and the caller's own parsers pick up where they were.
    pub resume: Vec<u32>,
    /// vLLM's `priority`: lower is admitted first among waiting requests (0 by default).
    pub priority: i32,
    /// The W3C trace id of the request's trace (32 hex digits), shown in `/debug/requests`.
    pub trace_id: Option<String>,
    /// Test hook: panic in the named place while serving this request (the engine must fail it alone).
    #[doc(hidden)]
    pub test_panic: Option<PanicSite>,
}

/// Where a request's test panic happens.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PanicSite {
    /// The engine thread, sampling its token.
    Sampling,
    /// The text thread, turning its token into text.
    Detokenizing,
}

impl Request {
    /// A request with the engine's defaults: greedy, up to the context, no stop strings.
    pub fn new(request_id: impl Into<String>, input: Input, deadline: Instant) -> Request {
        Request {
            request_id: request_id.into(),
            input,
            max_tokens: None,
            sampling: SamplingParams::greedy(),
            seed: None,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            logprobs: false,
            deadline,
            tools: Vec::new(),
            tool_choice: ToolChoice::Auto,
            parallel_tool_calls: true,
            chat_template_kwargs: serde_json::Map::new(),
            reasoning: None,
            tool_call_ids: None,
            constraint: None,
            min_tokens: 0,
            logit_bias: Vec::new(),
            include_stop_str: false,
            resume: Vec::new(),
            priority: 0,
            trace_id: None,
            test_panic: None,
        }
    }
}

/// Why generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Finish {
    /// A stop token, or the end-of-sequence token (or the end of the output's constraint).
    Stop,
    /// As `Stop`, after the model made tool calls (it stopped for them).
    ToolCalls,
    /// One of the request's stop strings (this one).
    StopString(String),
    /// `max_tokens` or the context.
    Length,
    /// Aborted by the caller.
    Cancelled,
    /// The deadline passed at `stage`.
    TimedOut { stage: Stage },
    /// Something broke at `stage`.
    Failed { stage: Stage, reason: String },
}

impl Finish {
    /// `Some("stop" | "tool_calls" | "length")` for a normal end (OpenAI's `finish_reason`).
    pub fn reason(&self) -> Option<&'static str> {
        match self {
            Finish::Stop | Finish::StopString(_) => Some("stop"),
            Finish::ToolCalls => Some("tool_calls"),
            Finish::Length => Some("length"),
            _ => None,
        }
    }

    /// The error a client gets for an end that is not normal.
    pub fn to_api_error(&self) -> Option<pdserve_api::ApiError> {
        use pdserve_api::{ApiError, ErrorKind};
        Some(match self {
            Finish::Stop | Finish::ToolCalls | Finish::StopString(_) | Finish::Length => return None,
            Finish::Cancelled => ApiError::new(ErrorKind::Cancelled, "the request was cancelled"),
            Finish::TimedOut { stage } => ApiError::new(
                ErrorKind::DeadlineExceeded,
                format!("the request's deadline passed while it was {}", stage.describe()),
            ),
            // The KV never arrived from the prefill worker: a failure of the path, not a bug here.
            Finish::Failed { stage: stage @ Stage::KvTransfer, reason } => ApiError::new(
                ErrorKind::KvTransferFailed,
                format!("the request failed while {}: {reason}", stage.describe()),
            ),
            Finish::Failed { stage, reason } => ApiError::new(
                ErrorKind::Internal,
                format!("the request failed while {}: {reason}", stage.describe()),
            ),
        })
    }

    /// The `outcome` word it is counted under.
    pub fn outcome(&self) -> pdserve_api::Outcome {
        match self.to_api_error() {
            None => pdserve_api::Outcome::Completed,
            Some(e) => e.kind.outcome(),
        }
    }
}

/// Milliseconds a request spent in each stage on this engine (and, for a decode worker, on the
/// prefill worker before it), in the order they happened (names ending in `_ms`); a decode worker adds
/// what its KV pull moved: `kv_pulled_blocks`, `kv_pulled_bytes` and `kv_reused_blocks` (blocks its
/// own prefix cache held, not pulled).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Timings(pub Vec<(&'static str, f64)>);

/// What the engine tells its caller, in order per request: `Admitted` or `Rejected`; then `Text` as
/// it comes; then exactly one `Finished` (or, for a prefill worker, `Prefilled`).
#[derive(Debug)]
pub enum Output {
    /// The request is in the scheduler: a stream may start now.
    Admitted {
        id: Id,
    },
    /// Not taken; nothing else follows.
    Rejected {
        id: Id,
        error: EngineError,
    },
    /// New text (empty when a stop string or a tool call may be starting), then the tool calls'
    /// pieces after it (lifted out of the text: calls the model finished writing, and for formats
    /// that stream a call's arguments, its beginning and arguments as they arrive), and, when asked
    /// for, the token's
    /// log-probability. `tokens`: the ids consumed since the previous `Text` (this one's and any
    /// whose text was held back); `replayed`: the text of a [`Request::resume`] token, which the
    /// caller already delivered.
    Text {
        id: Id,
        /// Answer text.
        text: String,
        /// A thinking model's thinking, ahead of `text` (split from it: never in `text`).
        reasoning: String,
        /// [`Piece::CallBegin`], [`Piece::CallArguments`] and [`Piece::Call`] only, in order.
        calls: Vec<Piece>,
        logprob: Option<TokenLogprob>,
        tokens: Vec<u32>,
        replayed: bool,
    },
    Finished {
        id: Id,
        finish: Finish,
        usage: Usage,
        timings: Timings,
    },
    /// Prefill role: the prompt is done and its KV waits for a decode worker at `handle`.
    Prefilled {
        id: Id,
        handle: PdHandle,
        usage: Usage,
        timings: Timings,
    },
    /// Prefill role, after `Prefilled`: the transfer of that KV ended (`outcome`: `completed`, or
    /// why not), for the request's trace. Nothing else follows.
    Served {
        id: Id,
        outcome: String,
    },
}

impl Output {
    pub fn id(&self) -> Id {
        match self {
            Output::Admitted { id }
            | Output::Rejected { id, .. }
            | Output::Text { id, .. }
            | Output::Finished { id, .. }
            | Output::Prefilled { id, .. }
            | Output::Served { id, .. } => *id,
        }
    }
}
