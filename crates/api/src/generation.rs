//! What a generation request asks and what it gets back, independent of any API dialect: the
//! constraint its output must match, each token's log-probability, the token counts of the answer.

use serde_json::Value;

/// What the output must match, enforced token by token: `response_format` or one of the extensions
/// users know from vLLM (`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`) and SGLang
/// (`regex`, `json_schema`).
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// A JSON schema (`{"type": "object"}` for `json_object`).
    JsonSchema(Value),
    Regex(String),
    /// One of these strings exactly.
    Choice(Vec<String>),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
}

/// One generated token's log-probability, its text already decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV was reused rather than computed.
    pub cached_tokens: usize,
}
