//! The one generation request both dialects are read into.

use pdserve_api::generation::Constraint;
use pdserve_api::pd::{PdHandle, Resume};
use pdserve_api::tools::{Tool, ToolCall, ToolChoice};

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Message {
    pub role: String,
    pub content: String,
    /// An assistant message's calls (`tool_calls`); their ids are the `tool` answers' `tool_call_id`.
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` message: the call it answers.
    pub tool_call_id: Option<String>,
    /// `name` (a participant's, or the function's in a `tool` message).
    pub name: Option<String>,
    /// An assistant message's thinking (`reasoning_content`).
    pub reasoning: Option<String>,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.to_owned(), content: content.to_owned(), ..Message::default() }
    }
}

/// What to feed the model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Chat messages, rendered through the model's chat template.
    Messages(Vec<Message>),
    Text(String),
    Tokens(Vec<u32>),
}

/// The sampling settings the client set; `None` leaves the engine's default.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// 0 or less turns top-k off.
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
}

/// A parsed generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<u32>,
    pub sampling: Sampling,
    /// The sampler's seed: the same request with the same seed gives the same tokens, whatever else
    /// the worker is running (see the server's README); without one a fresh seed is drawn.
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    /// Alternatives per token with `logprobs` (at most 20).
    pub top_logprobs: u32,
    pub ignore_eos: bool,
    /// Seconds, from the body's `timeout`.
    pub timeout_s: Option<f64>,
    /// Decode role: the prefill worker's handle.
    /// Choices to generate (each samples on from the same prompt; seeded ones with seed + index).
    pub n: u32,
    /// Decode role: the prefill worker's handles, one per choice.
    pub pd_handles: Vec<PdHandle>,
    /// A request the router moved here mid-answer: what the client already has.
    pub resume: Option<Resume>,
    /// Chat: the functions offered, and whether and how the model must call them.
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
    /// Chat: extra variables for the chat template (`chat_template_kwargs`).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// What the output must match.
    pub constraint: Option<Constraint>,
    /// End-of-sequence and stop tokens are not sampled before this many tokens.
    pub min_tokens: u32,
    /// Token id -> bias added to its logit (-100..100).
    pub logit_bias: Vec<(u32, f32)>,
    /// A matched stop string stays in the text.
    pub include_stop_str_in_output: bool,
    /// Completions: the prompt's text comes back ahead of the answer.
    pub echo: bool,
    /// Completions: the text after the gap the model fills (fill-in-the-middle).
    pub suffix: Option<String>,
    /// vLLM's `priority`: lower is admitted first among waiting requests, by the router and by the
    /// workers (0 by default).
    pub priority: i32,
}
