//! The dialects of pdserve's HTTP API: OpenAI's chat completions and completions, and Anthropic's
//! Messages, read into one generation request and written back in each one's shapes. The wire
//! vocabulary every process shares (errors, stages, headers, the PD handle, usage, constraints, tool
//! calls) is `pdserve-api`'s; this crate knows the bodies.
//!
//! - [`Endpoint`] and [`Meta`]: which endpoint a request came from and a response's identity; the
//!   functions here above both dialects ([`parse_generate`], [`full_response`],
//!   [`stream_error_frames`]) pick the dialect by the endpoint.
//! - [`openai`]: request bodies checked field by field (every field honoured or refused with a 400
//!   naming it) into a [`GenerateRequest`]; response bodies, stream chunks, log-probabilities.
//! - [`anthropic`]: a Messages body read into the chat body it stands for; the message body and the
//!   named stream events.
//!
//! The two dialects do not know each other: each knows only [`Endpoint`], [`GenerateRequest`] and
//! the wire vocabulary.
//!
//! ```
//! use pdserve_codec::{parse_generate, Endpoint, Prompt};
//! let body = br#"{"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}"#;
//! let chat = parse_generate(Endpoint::Chat, body).unwrap();
//! let messages = parse_generate(Endpoint::Messages, body).unwrap();
//! assert!(matches!(&chat.prompt, Prompt::Messages(m) if m[0].content == "Hi"));
//! assert_eq!(chat.prompt, messages.prompt);
//! ```
#![forbid(unsafe_code)]

pub mod anthropic;
mod endpoint;
pub mod openai;
mod request;
pub mod responses;

use pdserve_api::generation::Usage;
use pdserve_api::tools::ToolCall;
use pdserve_api::ApiError;
use serde_json::Value;

pub use endpoint::{sse, Endpoint, Meta, MESSAGES_STREAM_END};
pub use request::{GenerateRequest, Message, Prompt, Sampling};

/// Parses a chat-completions, completions, Messages or Responses body into the one generation
/// request: a Messages or Responses body is read into the chat body it stands for, then checked as
/// one. (A Responses body naming a `previous_response_id` needs the store: see [`responses::read`].)
pub fn parse_generate(endpoint: Endpoint, body: &[u8]) -> Result<GenerateRequest, ApiError> {
    let v: Value = match endpoint {
        Endpoint::Messages => anthropic::to_chat_body(body)?,
        Endpoint::Responses => {
            let none = |_: &str| None;
            return openai::parse_value(Endpoint::Chat, responses::read(body, &none, false)?.chat);
        }
        _ => serde_json::from_slice(body)
            .map_err(|e| ApiError::invalid(format!("body is not valid JSON: {e}")))?,
    };
    openai::parse_value(endpoint, v)
}

/// A request body as a JSON object whose members are all among `fields` (the first unknown one is
/// named in the 400).
pub(crate) fn object_of(body: &[u8], fields: &[&str]) -> Result<serde_json::Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("body is not valid JSON: {e}")))?;
    let Value::Object(obj) = v else { return Err(ApiError::invalid("body must be a JSON object")) };
    if let Some(k) = obj.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!("unrecognized request argument supplied: `{k}`")));
    }
    Ok(obj)
}

/// A whole non-streaming answer in the endpoint's dialect. With `tool_calls`, the message carries
/// them.
pub fn full_response(
    meta: &Meta,
    text: &str,
    tool_calls: &[ToolCall],
    finish_reason: &str,
    logprobs: Option<Value>,
    usage: Usage,
) -> Value {
    match meta.endpoint {
        Endpoint::Messages => {
            let reason = anthropic::stop_reason(finish_reason, !tool_calls.is_empty(), None);
            anthropic::message_json(meta, text, tool_calls, reason, None, usage)
        }
        Endpoint::Responses => {
            let output = responses::output_items(meta, "", text, &[], tool_calls);
            responses::response_json(
                meta,
                &Value::Object(Default::default()),
                output,
                Some(finish_reason),
                Some(usage),
            )
        }
        _ => openai::full_response(meta, text, tool_calls, finish_reason, logprobs, usage),
    }
}

/// The events that end a stream which failed after it began, framed, in the endpoint's dialect:
/// the error body, a last chunk with `finish_reason: "error"` and `[DONE]`; for Messages, an `error`
/// event and `message_stop`.
pub fn stream_error_frames(meta: &Meta, error: &ApiError, request_id: &str) -> String {
    match meta.endpoint {
        Endpoint::Responses => responses::stream_error_events(meta, error),
        Endpoint::Messages => anthropic::stream_error_events(error, request_id)
            .iter()
            .map(|e| sse(Some(e.0), &anthropic::event_data(e)))
            .collect(),
        _ => openai::stream_error_frames(meta, error, request_id),
    }
}

/// The README's examples, compiled and run as doc tests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
