//! The OpenAI-compatible shapes: chat-completions and completions request bodies, checked field by
//! field, and the response bodies and stream chunks built from plain values. (A Messages answer is
//! Anthropic's: [`crate::full_response`] and its siblings pick the dialect.)

use pdserve_api::generation::{TokenLogprob, Usage};
use pdserve_api::tools::ToolCall;
use pdserve_api::ApiError;
use serde_json::{json, Map, Value};

use crate::{sse, Endpoint, Meta};

mod tools;
pub use tools::{parse_tool_choice, parse_tools, TOOLS_MAX};

mod parse;
pub use parse::{
    parse_detokenize, parse_tokenize, parse_value, TokenizeRequest, N_MAX, STOP_STRINGS_MAX,
    STOP_STRING_BYTES_MAX, TOP_LOGPROBS_MAX,
};

/// The `usage` object of an answer.
pub fn usage_json(u: Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

fn bytes_of(s: &str) -> Value {
    Value::Array(s.bytes().map(|b| json!(b)).collect())
}

/// The `logprobs` object of a choice.
pub fn logprobs_json(endpoint: Endpoint, lps: &[TokenLogprob]) -> Value {
    match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            json!({ "content": lps.iter().map(|l| json!({
            "token": l.token, "logprob": l.logprob, "bytes": bytes_of(&l.token),
            "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p, "bytes": bytes_of(t)})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>() })
        }
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

/// A whole non-streaming chat or completion response (a Messages endpoint's is answered as chat). With
/// `tool_calls`, the message carries them (and its content is null when the model wrote nothing else).
pub fn full_response(
    meta: &Meta,
    text: &str,
    tool_calls: &[ToolCall],
    finish_reason: &str,
    logprobs: Option<Value>,
    usage: Usage,
) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
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
    };
    json!({
        "id": meta.id,
        "object": meta.endpoint.object(false),
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage_json(usage),
    })
}

/// A chat answer's `finish_reason`: `tool_calls` whenever calls were made, also when `max_tokens`
/// cut the last one (as vLLM reports; the engine's end stays `length` for the other dialects).
pub fn finish_reason(endpoint: Endpoint, reason: &str, called: bool) -> &str {
    match (endpoint, reason, called) {
        (Endpoint::Chat, "length", true) => "tool_calls",
        _ => reason,
    }
}

/// A thinking model's thinking in a whole chat response: the message's `reasoning_content`.
pub fn with_reasoning(response: &mut Value, reasoning: &str) {
    if reasoning.is_empty() {
        return;
    }
    for c in response["choices"].as_array_mut().into_iter().flatten() {
        if c.get("message").is_some() {
            c["message"]["reasoning_content"] = json!(reasoning);
        }
    }
}

/// What one stream chunk carries.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Delta<'a> {
    /// The assistant role (the first chat chunk).
    pub role: bool,
    pub text: Option<&'a str>,
    /// A thinking model's thinking (chat: `reasoning_content`).
    pub reasoning: Option<&'a str>,
    /// Whole calls, each with its index among the response's calls.
    pub tool_calls: Option<&'a [(usize, ToolCall)]>,
    /// A streamed call's part ([`call_begin_json`], [`call_arguments_json`]), as `tool_calls`' entry.
    pub call_part: Option<&'a Value>,
    pub finish_reason: Option<&'a str>,
    /// Which choice it belongs to (`n` > 1).
    pub index: usize,
}

/// The first delta of a call whose arguments stream: entry `index` of `tool_calls` with its id and
/// function, and no arguments yet.
pub fn call_begin_json(index: usize, id: &str, name: &str) -> Value {
    json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}})
}

/// More of call `index`'s arguments.
pub fn call_arguments_json(index: usize, arguments: &str) -> Value {
    json!({"index": index, "function": {"arguments": arguments}})
}

/// A chat or completion stream chunk (a Messages stream is written by
/// [`crate::anthropic::MessageStream`]).
pub fn chunk(meta: &Meta, delta: Delta<'_>, logprobs: Option<Value>) -> Value {
    let choice = match meta.endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            let mut d = Map::new();
            if delta.role {
                d.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = delta.reasoning {
                d.insert("reasoning_content".into(), json!(t));
            }
            if let Some(t) = delta.text {
                d.insert("content".into(), json!(t));
            }
            if let Some(calls) = delta.tool_calls {
                d.insert("tool_calls".into(), calls.iter().map(|(i, c)| c.delta_json(*i)).collect());
            }
            if let Some(part) = delta.call_part {
                d.insert("tool_calls".into(), json!([part]));
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
        "usage": usage_json(usage),
    })
}

/// The events that end a chat or completion stream which failed after it began, framed: the error
/// body, a last chunk with `finish_reason: "error"` and `[DONE]`.
pub fn stream_error_frames(meta: &Meta, error: &ApiError, request_id: &str) -> String {
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
        let e = ApiError::new(pdserve_api::ErrorKind::UpstreamFailed, "decode worker died");
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
        let frames = crate::stream_error_frames(&meta, &e, "r1");
        assert!(
            frames.starts_with("event: error\ndata: {") && frames.ends_with(Endpoint::Messages.stream_end())
        );
    }

    #[test]
    fn usage_reports_cached_tokens() {
        let u = usage_json(Usage { prompt_tokens: 10, completion_tokens: 2, cached_tokens: 4 });
        assert_eq!(u["total_tokens"], 12);
        assert_eq!(u["prompt_tokens_details"]["cached_tokens"], 4);
    }
}
