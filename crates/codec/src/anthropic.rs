//! Anthropic's Messages API (`POST /v1/messages`) over the same engine: the request is read into the
//! chat request the rest of the stack knows (its `system`, content blocks, `tool_use` / `tool_result`
//! blocks, tools and `tool_choice` mapped one to one, unknown fields refused with a 400 naming them),
//! and answers are written as Anthropic's message body or its stream of named events.

use serde_json::{json, Map, Value};

use pdserve_api::generation::Usage;
use pdserve_api::pd::{HANDLE_FIELD, RESUME_FIELD};
use pdserve_api::tools::ToolCall;
use pdserve_api::ApiError;

use crate::Meta;

/// Fields of a Messages body.
const FIELDS: &[&str] = &[
    "model",
    "messages",
    "system",
    "max_tokens",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "tools",
    "tool_choice",
    "output_config",
    "thinking",
    // Informational: `metadata` and `service_tier` have no effect; `cache_control` asks for the
    // prompt to be cached, which this stack's prefix cache does for every request.
    "metadata",
    "service_tier",
    "cache_control",
    // This stack's own: the request's deadline, and a decode worker's KV handle.
    "timeout",
    HANDLE_FIELD,
    RESUME_FIELD,
];

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::invalid(msg)
}

/// The text of a `content` that is a string or a list of text blocks.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut out = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    (kind, _) => {
                        return Err(invalid(format!(
                            "{at}[{j}]: block type {} is not supported here (only text)",
                            kind.map_or_else(|| "(none)".to_owned(), |k| format!("{k:?}"))
                        )))
                    }
                }
            }
            Ok(out)
        }
        _ => Err(invalid(format!("{at} must be a string or an array of content blocks"))),
    }
}

/// One Anthropic message as the chat messages it stands for: an assistant turn's `tool_use` blocks
/// become its `tool_calls`; a user turn's `tool_result` blocks become `tool` messages, ahead of its
/// text.
fn chat_messages(i: usize, m: &Value, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let obj = m.as_object().ok_or_else(|| invalid(format!("messages[{i}] must be an object")))?;
    if let Some(k) = obj.keys().find(|k| !matches!(k.as_str(), "role" | "content")) {
        return Err(invalid(format!("messages[{i}] has an unrecognized field `{k}`")));
    }
    let role = match obj.get("role").and_then(Value::as_str) {
        Some(r @ ("user" | "assistant")) => r,
        Some(r) => return Err(invalid(format!("messages[{i}].role {r:?} is not \"user\" or \"assistant\""))),
        None => return Err(invalid(format!("messages[{i}].role must be a string"))),
    };
    let blocks = match obj.get("content") {
        Some(Value::String(s)) => {
            out.push(json!({"role": role, "content": s}));
            return Ok(());
        }
        Some(Value::Array(b)) => b,
        _ => return Err(invalid(format!("messages[{i}].content must be a string or an array of blocks"))),
    };
    let (mut text, mut calls, mut results) = (String::new(), Vec::new(), Vec::new());
    let mut thinking: Option<String> = None;
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => text.push_str(
                b.get("text")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("{at}.text must be a string")))?,
            ),
            Some("tool_use") if role == "assistant" => {
                let id = b
                    .get("id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("{at}.id must be a string")))?;
                let name = b
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("{at}.name must be a string")))?;
                let input = match b.get("input") {
                    Some(o @ Value::Object(_)) => o.clone(),
                    None | Some(Value::Null) => json!({}),
                    Some(_) => return Err(invalid(format!("{at}.input must be an object"))),
                };
                calls.push(json!({"id": id, "type": "function",
                                  "function": {"name": name, "arguments": input.to_string()}}));
            }
            Some("tool_result") if role == "user" => {
                let id = b
                    .get("tool_use_id")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("{at}.tool_use_id must be a string")))?;
                let content = match b.get("content") {
                    None | Some(Value::Null) => String::new(),
                    Some(c) => text_of(c, &format!("{at}.content"))?,
                };
                let content = if b.get("is_error").and_then(Value::as_bool) == Some(true) {
                    format!("Error: {content}")
                } else {
                    content
                };
                results.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            // A thinking model's earlier thinking (its signature is this stack's empty one).
            Some("thinking") if role == "assistant" => thinking.get_or_insert_with(String::new).push_str(
                b.get("thinking")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("{at}.thinking must be a string")))?,
            ),
            Some(kind @ ("tool_use" | "tool_result")) => {
                return Err(invalid(format!("{at}: a {kind} block cannot be in a {role} message")))
            }
            Some(other) => {
                return Err(invalid(format!(
                    "{at}: block type {other:?} is not supported (text, tool_use, tool_result)"
                )))
            }
            None => return Err(invalid(format!("{at}.type must be a string"))),
        }
    }
    let only_results = !results.is_empty() && text.is_empty();
    out.extend(results);
    let mut m = json!({"role": role, "content": text});
    if !calls.is_empty() {
        m["tool_calls"] = json!(calls);
    }
    if let Some(t) = thinking {
        m["reasoning_content"] = json!(t);
    }
    if !calls.is_empty() || !only_results {
        out.push(m);
    }
    Ok(())
}

/// Reads a Messages body into the equivalent chat-completions body, which
/// [`crate::parse_generate`] then checks like any other.
pub fn to_chat_body(body: &[u8]) -> Result<Value, ApiError> {
    to_chat(body, true)
}

/// Reads a `/v1/messages/count_tokens` body (a Messages body without `max_tokens`) into the chat
/// body whose prompt it counts (`/tokenize`'s input).
pub fn count_tokens_chat_body(body: &[u8]) -> Result<Value, ApiError> {
    to_chat(body, false)
}

fn to_chat(body: &[u8], generation: bool) -> Result<Value, ApiError> {
    let obj = crate::object_of(body, FIELDS)?;
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let mut chat = Map::new();
    for k in ["model", "stream", "temperature", "top_p", "top_k", "timeout", HANDLE_FIELD, RESUME_FIELD] {
        if let Some(v) = get(k) {
            chat.insert(k.to_owned(), v.clone());
        }
    }
    if get("temperature").and_then(Value::as_f64).is_some_and(|t| t > 1.0) {
        return Err(invalid("`temperature` must be between 0 and 1"));
    }
    match get("max_tokens") {
        Some(m) => chat.insert("max_tokens".into(), m.clone()),
        None if generation => return Err(invalid("`max_tokens` is required")),
        None => None,
    };
    if let Some(s) = get("stop_sequences") {
        if !s.as_array().is_some_and(|a| a.iter().all(Value::is_string)) {
            return Err(invalid("`stop_sequences` must be an array of strings"));
        }
        chat.insert("stop".into(), s.clone());
    }
    let mut messages = Vec::new();
    if let Some(s) = get("system") {
        messages.push(json!({"role": "system", "content": text_of(s, "system")?}));
    }
    let list =
        get("messages").and_then(Value::as_array).ok_or_else(|| invalid("`messages` must be an array"))?;
    if list.is_empty() {
        return Err(invalid("`messages` must not be empty"));
    }
    for (i, m) in list.iter().enumerate() {
        chat_messages(i, m, &mut messages)?;
    }
    chat.insert("messages".into(), Value::Array(messages));
    if let Some(tools) = get("tools") {
        let list = tools.as_array().ok_or_else(|| invalid("`tools` must be an array"))?;
        let mut out = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let o = t.as_object().ok_or_else(|| invalid(format!("tools[{i}] must be an object")))?;
            if let Some(k) =
                // (`cache_control`: the prefix cache keeps every prompt's tools cached anyway.)
                o.keys().find(|k| {
                    !matches!(k.as_str(), "name" | "description" | "input_schema" | "type" | "cache_control")
                })
            {
                return Err(invalid(format!("tools[{i}] has an unrecognized field `{k}`")));
            }
            if o.get("type").and_then(Value::as_str).is_some_and(|t| t != "custom") {
                return Err(invalid(format!(
                    "tools[{i}].type: only client tools (\"custom\") are supported"
                )));
            }
            let mut f = Map::new();
            for (from, to) in
                [("name", "name"), ("description", "description"), ("input_schema", "parameters")]
            {
                if let Some(v) = o.get(from) {
                    f.insert(to.into(), v.clone());
                }
            }
            out.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    if let Some(t) = get("thinking") {
        // Extended thinking: the template's own switch (Qwen3's `enable_thinking`); a worker whose
        // model does not think refuses `enabled`. (`budget_tokens` is not enforced: the model
        // thinks until it closes its thinking, within `max_tokens`.)
        let enabled = match t.get("type").and_then(Value::as_str) {
            Some("enabled") => Some(true),
            Some("disabled") => Some(false),
            Some("adaptive") => None,
            _ => return Err(invalid("`thinking.type` must be \"enabled\", \"disabled\" or \"adaptive\"")),
        };
        if let Some(on) = enabled {
            chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": on}));
        }
    }
    if let Some(oc) = get("output_config") {
        let o = oc.as_object().ok_or_else(|| invalid("`output_config` must be an object"))?;
        for (k, v) in o.iter().filter(|(_, v)| !v.is_null()) {
            match k.as_str() {
                "format" => {
                    let schema = match (v.get("type").and_then(Value::as_str), v.get("schema")) {
                        (Some("json_schema"), Some(s @ Value::Object(_))) => s.clone(),
                        _ => return Err(invalid(
                            "`output_config.format` must be {\"type\": \"json_schema\", \"schema\": {...}}",
                        )),
                    };
                    chat.insert(
                        "response_format".into(),
                        json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema}}),
                    );
                }
                other => {
                    return Err(invalid(format!("`output_config.{other}` is not supported (only `format`)")))
                }
            }
        }
    }
    if let Some(tc) = get("tool_choice") {
        let choice = match tc.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => {
                let name = tc
                    .get("name")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid("`tool_choice.name` must be a string"))?;
                json!({"type": "function", "function": {"name": name}})
            }
            _ => return Err(invalid("`tool_choice.type` must be \"auto\", \"any\", \"tool\" or \"none\"")),
        };
        chat.insert("tool_choice".into(), choice);
        match tc.get("disable_parallel_tool_use") {
            None | Some(Value::Null) => {}
            Some(Value::Bool(b)) => {
                chat.insert("parallel_tool_calls".into(), json!(!b));
            }
            Some(_) => return Err(invalid("`tool_choice.disable_parallel_tool_use` must be true or false")),
        }
    }
    Ok(Value::Object(chat))
}

/// Why a message ended, in Anthropic's words, from the engine's end and what the model did.
pub fn stop_reason(finish_reason: &str, called: bool, stop_sequence: Option<&str>) -> &'static str {
    match (finish_reason, called, stop_sequence) {
        ("length", _, _) => "max_tokens",
        (_, true, _) => "tool_use",
        (_, false, Some(_)) => "stop_sequence",
        _ => "end_turn",
    }
}

fn usage_json(u: Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens - u.cached_tokens.min(u.prompt_tokens),
           "output_tokens": u.completion_tokens,
           "cache_read_input_tokens": u.cached_tokens, "cache_creation_input_tokens": 0})
}

fn tool_use_block(c: &ToolCall) -> Value {
    let input = serde_json::from_str::<Value>(&c.arguments).unwrap_or_else(|_| json!({}));
    json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input})
}

/// The whole answer: a text block (if the model wrote text) and one `tool_use` block per call.
pub fn message_json(
    meta: &Meta,
    text: &str,
    calls: &[ToolCall],
    stop_reason: &str,
    stop_sequence: Option<&str>,
    usage: Usage,
) -> Value {
    let mut content: Vec<Value> = Vec::new();
    if !text.is_empty() && (calls.is_empty() || !text.trim().is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    content.extend(calls.iter().map(tool_use_block));
    json!({"id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
           "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
           "usage": usage_json(usage)})
}

/// A thinking model's thinking in a whole message: a `thinking` block ahead of the others (no
/// signature: nothing here is signed).
pub fn with_thinking(message: &mut Value, thinking: &str) {
    if thinking.is_empty() {
        return;
    }
    if let Some(content) = message["content"].as_array_mut() {
        content.insert(0, json!({"type": "thinking", "thinking": thinking, "signature": ""}));
    }
}

/// One server-sent event: its name and its JSON data.
pub type Event = (&'static str, Value);

/// The events of a streamed message, in order: `message_start`, then per content block
/// `content_block_start`, its deltas and `content_block_stop`, then `message_delta` and
/// `message_stop`.
#[derive(Debug, Default)]
pub struct MessageStream {
    /// The index of the open text block, if one is.
    text_open: Option<usize>,
    /// The index of the open thinking block, if one is.
    thinking_open: Option<usize>,
    /// The index of the `tool_use` block whose input is streaming, if one is.
    call_open: Option<usize>,
    blocks: usize,
}

impl MessageStream {
    pub fn start(meta: &Meta) -> Event {
        (
            "message_start",
            json!({"type": "message_start", "message": {
            "id": meta.id, "type": "message", "role": "assistant", "model": meta.model, "content": [],
            "stop_reason": null, "stop_sequence": null, "usage": usage_json(Usage::default())}}),
        )
    }

    fn close_text(&mut self, out: &mut Vec<Event>) {
        self.close_thinking(out);
        if let Some(i) = self.text_open.take() {
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
        }
    }

    fn close_thinking(&mut self, out: &mut Vec<Event>) {
        if let Some(i) = self.thinking_open.take() {
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i, "delta": {"type": "signature_delta", "signature": ""}}),
            ));
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
        }
    }

    /// A thinking model's thinking: a `thinking` block (before any text or call).
    pub fn thinking(&mut self, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        let index = match self.thinking_open {
            Some(i) => i,
            None => {
                let i = self.blocks;
                self.blocks += 1;
                self.thinking_open = Some(i);
                out.push((
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                ));
                i
            }
        };
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
            "delta": {"type": "thinking_delta", "thinking": text}}),
        ));
    }

    /// Text the model wrote.
    pub fn text(&mut self, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        self.close_thinking(out);
        let index = match self.text_open {
            Some(i) => i,
            None => {
                let i = self.blocks;
                self.blocks += 1;
                self.text_open = Some(i);
                out.push((
                    "content_block_start",
                    json!({"type": "content_block_start", "index": i,
                    "content_block": {"type": "text", "text": ""}}),
                ));
                i
            }
        };
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index,
            "delta": {"type": "text_delta", "text": text}}),
        ));
    }

    /// A call whose input streams: its `tool_use` block opens.
    pub fn call_begin(&mut self, id: &str, name: &str, out: &mut Vec<Event>) {
        self.close_text(out);
        let i = self.blocks;
        self.blocks += 1;
        self.call_open = Some(i);
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": i,
            "content_block": {"type": "tool_use", "id": id, "name": name, "input": {}}}),
        ));
    }

    /// More of the streaming call's input.
    pub fn call_arguments(&mut self, arguments: &str, out: &mut Vec<Event>) {
        if let Some(i) = self.call_open {
            out.push((
                "content_block_delta",
                json!({"type": "content_block_delta", "index": i,
                "delta": {"type": "input_json_delta", "partial_json": arguments}}),
            ));
        }
    }

    /// A complete call: the streaming call's block closes; a call that did not stream is its
    /// `tool_use` block with the input as one JSON delta.
    pub fn call(&mut self, c: &ToolCall, out: &mut Vec<Event>) {
        if let Some(i) = self.call_open.take() {
            out.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
            return;
        }
        self.close_text(out);
        let i = self.blocks;
        self.blocks += 1;
        out.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": i,
            "content_block": {"type": "tool_use", "id": c.id, "name": c.name, "input": {}}}),
        ));
        out.push((
            "content_block_delta",
            json!({"type": "content_block_delta", "index": i,
            "delta": {"type": "input_json_delta", "partial_json": c.arguments}}),
        ));
        out.push(("content_block_stop", json!({"type": "content_block_stop", "index": i})));
    }

    /// The end: the open block closes, then the stop reason and usage, then `message_stop`.
    pub fn finish(
        &mut self,
        stop_reason: &str,
        stop_sequence: Option<&str>,
        usage: Usage,
        out: &mut Vec<Event>,
    ) {
        self.close_text(out);
        out.push(("message_delta", json!({"type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence}, "usage": usage_json(usage)})));
        out.push(MESSAGE_STOP);
    }
}

/// The last event of every stream, a failed one included.
pub const MESSAGE_STOP: Event = ("message_stop", Value::Null);

/// The `data` of an event (`message_stop`'s is fixed).
pub fn event_data(e: &Event) -> String {
    match e {
        (name, Value::Null) => json!({"type": name}).to_string(),
        (_, v) => v.to_string(),
    }
}

/// The bytes a stream ends with, checked by the router to see the stream end cleanly.
pub const STREAM_END: &str = crate::MESSAGES_STREAM_END;

/// A stream that fails after it began: an `error` event (the client raises it), then `message_stop`.
pub fn stream_error_events(error: &ApiError, request_id: &str) -> [Event; 2] {
    [("error", error.to_anthropic_json(Some(request_id))), MESSAGE_STOP]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Endpoint;

    #[test]
    fn a_tool_conversation_reads_as_the_chat_it_stands_for() {
        let chat = to_chat_body(
            br#"{"model": "m", "max_tokens": 64, "system": [{"type": "text", "text": "Be brief."}],
                 "messages": [
                   {"role": "user", "content": "Read a.txt"},
                   {"role": "assistant", "content": [{"type": "text", "text": "Reading."},
                     {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.txt"}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "hello"},
                     {"type": "text", "text": "And now?"}]}],
                 "tools": [{"name": "read_file", "input_schema": {"type": "object"}}],
                 "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
                 "stop_sequences": ["END"], "metadata": {"user_id": "u"}}"#,
        )
        .unwrap();
        let m = &chat["messages"];
        assert_eq!(m[0], json!({"role": "system", "content": "Be brief."}));
        assert_eq!(m[2]["tool_calls"][0]["function"]["arguments"], r#"{"path":"a.txt"}"#);
        assert_eq!(m[3], json!({"role": "tool", "tool_call_id": "t1", "content": "hello"}));
        assert_eq!(m[4], json!({"role": "user", "content": "And now?"}));
        assert_eq!(
            (&chat["tool_choice"], &chat["parallel_tool_calls"], &chat["stop"]),
            (&json!("required"), &json!(false), &json!(["END"]))
        );
        let g = crate::parse_generate(
            Endpoint::Messages,
            &serde_json::to_vec(&json!({
            "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}))
            .unwrap(),
        )
        .unwrap();
        assert_eq!(g.max_tokens, Some(8));
    }

    #[test]
    fn what_is_not_served_is_named() {
        for (body, want) in [
            (r#"{"messages": [{"role": "user", "content": "x"}]}"#, "`max_tokens` is required"),
            (
                r#"{"max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "thinking": {}}"#,
                "`thinking.type`",
            ),
            (
                r#"{"max_tokens": 1, "messages": [{"role": "user", "content": [{"type": "image"}]}]}"#,
                "\"image\"",
            ),
            (r#"{"max_tokens": 1, "messages": [{"role": "system", "content": "x"}]}"#, "messages[0].role"),
            (r#"{"max_tokens": 1, "messages": [], "temperature": 0.5}"#, "must not be empty"),
        ] {
            let e = to_chat_body(body.as_bytes()).unwrap_err();
            assert!(e.message.contains(want), "{body}: {}", e.message);
        }
    }

    #[test]
    fn a_stream_opens_and_closes_each_block() {
        let meta = Meta { endpoint: Endpoint::Messages, id: "msg_1".into(), created: 0, model: "m".into() };
        let mut s = MessageStream::default();
        let mut ev = vec![MessageStream::start(&meta)];
        s.text("Hi", &mut ev);
        s.text(" there", &mut ev);
        s.call(&ToolCall { id: "c".into(), name: "f".into(), arguments: "{}".into() }, &mut ev);
        s.finish(
            "tool_use",
            None,
            Usage { prompt_tokens: 5, completion_tokens: 3, cached_tokens: 2 },
            &mut ev,
        );
        let names: Vec<&str> = ev.iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        assert_eq!(ev[8].1["usage"]["input_tokens"], 3);
        assert_eq!(event_data(&ev[9]), r#"{"type":"message_stop"}"#);
        let full = message_json(
            &meta,
            "",
            &[ToolCall { id: "c".into(), name: "f".into(), arguments: r#"{"a":1}"#.into() }],
            "tool_use",
            None,
            Usage::default(),
        );
        assert_eq!(full["content"], json!([{"type": "tool_use", "id": "c", "name": "f", "input": {"a": 1}}]));
    }

    /// A call whose input streams: its block opens with the head, each piece is an
    /// `input_json_delta` of that block, and the whole call closes it (no second copy of the input).
    #[test]
    fn a_streamed_call_is_one_block_of_pieces() {
        let mut s = MessageStream::default();
        let mut ev = Vec::new();
        s.text("Sure.", &mut ev);
        s.call_begin("c", "f", &mut ev);
        s.call_arguments("{\"a\":", &mut ev);
        s.call_arguments("1}", &mut ev);
        s.call(&ToolCall { id: "c".into(), name: "f".into(), arguments: r#"{"a":1}"#.into() }, &mut ev);
        let names: Vec<&str> = ev.iter().map(|e| e.0).collect();
        assert_eq!(
            names,
            [
                "content_block_start",
                "content_block_delta",
                "content_block_stop",
                "content_block_start",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop"
            ]
        );
        assert_eq!(
            ev[3].1["content_block"],
            json!({"type": "tool_use", "id": "c", "name": "f", "input": {}})
        );
        let pieces: String =
            ev[4..6].iter().map(|e| e.1["delta"]["partial_json"].as_str().unwrap()).collect();
        assert_eq!((pieces.as_str(), &ev[6].1["index"]), (r#"{"a":1}"#, &json!(1)));
    }
}
