//! The OpenAI-compatible shapes: chat-completions and completions request bodies, checked field by
//! field, and the response bodies and stream chunks built from plain values.

use serde_json::{json, Map, Value};

use crate::pd::PdHandle;
use crate::tools::{Tool, ToolCall, ToolChoice};
use crate::ApiError;

/// Which endpoint a generation came from; it decides the response shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    Chat,
    /// `POST /v1/completions`
    Completion,
    /// `POST /v1/messages` (Anthropic's Messages API; see [`crate::anthropic`])
    Messages,
}

impl Endpoint {
    pub const CHAT_PATH: &'static str = crate::path::CHAT;
    pub const COMPLETION_PATH: &'static str = crate::path::COMPLETIONS;
    pub const MESSAGES_PATH: &'static str = crate::path::MESSAGES;

    /// The endpoint served at `path`.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path {
            Endpoint::CHAT_PATH => Some(Endpoint::Chat),
            Endpoint::COMPLETION_PATH => Some(Endpoint::Completion),
            Endpoint::MESSAGES_PATH => Some(Endpoint::Messages),
            _ => None,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Endpoint::Chat => Endpoint::CHAT_PATH,
            Endpoint::Completion => Endpoint::COMPLETION_PATH,
            Endpoint::Messages => Endpoint::MESSAGES_PATH,
        }
    }

    /// The response `id` of request `request_id`, the same whichever process answers.
    pub fn response_id(self, request_id: &str) -> String {
        match self {
            Endpoint::Chat => format!("chatcmpl-{request_id}"),
            Endpoint::Completion => format!("cmpl-{request_id}"),
            Endpoint::Messages => format!("msg_{request_id}"),
        }
    }

    /// How a stream from this endpoint ends when it ends well: the router reads it to tell a
    /// finished stream from a cut one.
    pub fn stream_end(self) -> &'static str {
        match self {
            Endpoint::Chat | Endpoint::Completion => "data: [DONE]\n\n",
            Endpoint::Messages => crate::anthropic::STREAM_END,
        }
    }

    fn object(self, chunk: bool) -> &'static str {
        match (self, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
            (Endpoint::Messages, _) => "message",
        }
    }
}

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
}

impl Message {
    pub fn new(role: &str, content: &str) -> Message {
        Message { role: role.to_owned(), content: content.to_owned(), ..Message::default() }
    }
}

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
    pub resume: Option<crate::pd::Resume>,
    /// Chat: the functions offered, and whether and how the model must call them.
    pub tools: Vec<Tool>,
    pub tool_choice: ToolChoice,
    pub parallel_tool_calls: bool,
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
}

mod parse;
pub use parse::{
    parse_detokenize, parse_generate, parse_tokenize, TokenizeRequest, N_MAX, STOP_STRINGS_MAX,
    STOP_STRING_BYTES_MAX, TOP_LOGPROBS_MAX,
};

/// One generated token's log-probability, its text already decoded.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

fn bytes_of(s: &str) -> Value {
    Value::Array(s.bytes().map(|b| json!(b)).collect())
}

/// The `logprobs` object of a choice.
pub fn logprobs_json(endpoint: Endpoint, lps: &[TokenLogprob]) -> Value {
    match endpoint {
        Endpoint::Chat | Endpoint::Messages => json!({ "content": lps.iter().map(|l| json!({
            "token": l.token, "logprob": l.logprob, "bytes": bytes_of(&l.token),
            "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p, "bytes": bytes_of(t)})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>() }),
        Endpoint::Completion => {
            let mut offset = 0;
            let mut offsets = Vec::with_capacity(lps.len());
            for l in lps {
                offsets.push(offset);
                offset += l.token.len();
            }
            json!({
                "tokens": lps.iter().map(|l| l.token.clone()).collect::<Vec<_>>(),
                "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
                "top_logprobs": lps.iter().map(|l| l.top.iter().map(|(t, p)| (t.clone(), json!(p))).collect::<Map<_, _>>()).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}

/// The identity of a response: id, creation time, model.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meta {
    pub endpoint: Endpoint,
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    pub model: String,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens whose KV was reused rather than computed.
    pub cached_tokens: usize,
}

impl Usage {
    pub fn to_json(self) -> Value {
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        })
    }
}

/// A whole non-streaming response. With `tool_calls`, the message carries them (and its content is
/// null when the model wrote nothing else).
pub fn full_response(
    meta: &Meta,
    text: &str,
    tool_calls: &[ToolCall],
    finish_reason: &str,
    logprobs: Option<Value>,
    usage: Usage,
) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat => {
            let mut message = json!({"role": "assistant", "content": text});
            if !tool_calls.is_empty() {
                if text.trim().is_empty() {
                    message["content"] = Value::Null;
                }
                message["tool_calls"] = tool_calls.iter().map(ToolCall::to_json).collect();
            }
            json!({"index": 0, "message": message, "logprobs": logprobs, "finish_reason": finish_reason})
        }
        Endpoint::Completion => {
            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
        }
        Endpoint::Messages => {
            let reason = crate::anthropic::stop_reason(finish_reason, !tool_calls.is_empty(), None);
            return crate::anthropic::message_json(meta, text, tool_calls, reason, None, usage);
        }
    };
    json!({
        "id": meta.id,
        "object": meta.endpoint.object(false),
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage.to_json(),
    })
}

/// What one stream chunk carries.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Delta<'a> {
    /// The assistant role (the first chat chunk).
    pub role: bool,
    pub text: Option<&'a str>,
    /// Whole calls, each with its index among the response's calls.
    pub tool_calls: Option<&'a [(usize, ToolCall)]>,
    pub finish_reason: Option<&'a str>,
    /// Which choice it belongs to (`n` > 1).
    pub index: usize,
}

/// A chat or completion stream chunk (a Messages stream is written by
/// [`crate::anthropic::MessageStream`]).
pub fn chunk(meta: &Meta, delta: Delta<'_>, logprobs: Option<Value>) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat | Endpoint::Messages => {
            let mut d = Map::new();
            if delta.role {
                d.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = delta.text {
                d.insert("content".into(), json!(t));
            }
            if let Some(calls) = delta.tool_calls {
                d.insert("tool_calls".into(), calls.iter().map(|(i, c)| c.delta_json(*i)).collect());
            }
            json!({"index": delta.index, "delta": d, "logprobs": logprobs, "finish_reason": delta.finish_reason})
        }
        Endpoint::Completion => {
            json!({"index": delta.index, "text": delta.text.unwrap_or(""), "logprobs": logprobs,
                                       "finish_reason": delta.finish_reason})
        }
    };
    json!({
        "id": meta.id,
        "object": meta.endpoint.object(true),
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

/// The usage chunk of `stream_options.include_usage`: no choices.
pub fn usage_chunk(meta: &Meta, usage: Usage) -> Value {
    json!({
        "id": meta.id,
        "object": meta.endpoint.object(true),
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage.to_json(),
    })
}

/// One server-sent event, framed (`data` is one line: compact JSON or `[DONE]`).
pub fn sse(event: Option<&str>, data: &str) -> String {
    match event {
        Some(name) => format!("event: {name}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

/// The events that end a stream which failed after it began, framed: the error body, a last chunk
/// with `finish_reason: "error"` and `[DONE]`; for Messages, an `error` event and `message_stop`.
pub fn stream_error_frames(meta: &Meta, error: &ApiError, request_id: &str) -> String {
    if meta.endpoint == Endpoint::Messages {
        return crate::anthropic::stream_error_events(error, request_id)
            .iter()
            .map(|e| sse(Some(e.0), &crate::anthropic::event_data(e)))
            .collect();
    }
    [
        error.to_json(Some(request_id)).to_string(),
        chunk(meta, Delta { finish_reason: Some("error"), ..Delta::default() }, None).to_string(),
        DONE.to_owned(),
    ]
    .iter()
    .map(|d| sse(None, d))
    .collect()
}

/// The payload of the event that ends every stream.
pub const DONE: &str = "[DONE]";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_calls_are_in_the_message_and_the_stream() {
        let meta = Meta { endpoint: Endpoint::Chat, id: "chatcmpl-1".into(), created: 1, model: "m".into() };
        let call = ToolCall { id: "call_1_0".into(), name: "f".into(), arguments: "{}".into() };
        let full =
            full_response(&meta, "", std::slice::from_ref(&call), "tool_calls", None, Usage::default());
        assert_eq!(full["choices"][0]["message"]["content"], Value::Null);
        assert_eq!(full["choices"][0]["message"]["tool_calls"][0]["function"]["name"], "f");
        let calls = [(0, call)];
        let c = chunk(&meta, Delta { tool_calls: Some(&calls), ..Delta::default() }, None);
        assert_eq!(c["choices"][0]["delta"]["tool_calls"][0]["index"], 0);
        assert_eq!(c["choices"][0]["delta"]["tool_calls"][0]["id"], "call_1_0");
    }

    #[test]
    fn stream_error_events_are_valid_json_in_order() {
        let meta = Meta {
            endpoint: Endpoint::Chat,
            id: Endpoint::Chat.response_id("r1"),
            created: 1,
            model: String::new(),
        };
        let e = ApiError::new(crate::ErrorKind::UpstreamFailed, "decode worker died");
        let frames = stream_error_frames(&meta, &e, "r1");
        let data: Vec<&str> = frames.split("\n\n").filter_map(|f| f.strip_prefix("data: ")).collect();
        let err: Value = serde_json::from_str(data[0]).unwrap();
        assert_eq!(err["error"]["type"], "upstream_failed");
        let last: Value = serde_json::from_str(data[1]).unwrap();
        assert_eq!(last["choices"][0]["finish_reason"], "error");
        assert_eq!(last["id"], "chatcmpl-r1");
        assert_eq!(data[2], DONE);
        assert!(frames.ends_with(Endpoint::Chat.stream_end()));
        let meta = Meta { endpoint: Endpoint::Messages, ..meta };
        let frames = stream_error_frames(&meta, &e, "r1");
        assert!(
            frames.starts_with("event: error\ndata: {") && frames.ends_with(Endpoint::Messages.stream_end())
        );
    }

    #[test]
    fn usage_reports_cached_tokens() {
        let u = Usage { prompt_tokens: 10, completion_tokens: 2, cached_tokens: 4 }.to_json();
        assert_eq!(u["total_tokens"], 12);
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 4);
    }
}
