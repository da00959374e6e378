//! OpenAI's Responses API (`POST /v1/responses`) over the same engine: a Responses body (`input` as a
//! string or items: messages, `function_call`, `function_call_output`; `instructions`, function
//! `tools`, `text.format`, `max_output_tokens`, ...) is read into the chat body it stands for, and
//! answers are written as a response object or its stream of typed events (`response.created` ...
//! `response.output_text.delta`, `response.function_call_arguments.delta`, ... `response.completed`).
//! [`ResponseStore`] keeps answered conversations for `previous_response_id`, bounded in count and
//! age.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use pdserve_api::generation::{TokenLogprob, Usage};
use pdserve_api::pd::{HANDLE_FIELD, RESUME_FIELD};
use pdserve_api::tools::ToolCall;
use pdserve_api::{ApiError, ErrorKind};

use crate::Meta;

/// Set by the router only, on every Responses request it forwards: the router keeps the answered
/// conversation (so the worker does not), and `input` already holds the whole conversation (the
/// router expanded the client's `previous_response_id` from its own store, which stays in the body
/// to be echoed).
pub const CONVERSATION_FIELD: &str = "pd_conversation";

/// Fields of a Responses body.
const FIELDS: &[&str] = &[
    "model",
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "max_output_tokens",
    "temperature",
    "top_p",
    "stream",
    "stream_options",
    "store",
    "previous_response_id",
    "include",
    "top_logprobs",
    "seed",
    "reasoning",
    "truncation",
    "background",
    // Informational: they change nothing of the answer (`metadata` is echoed back).
    "metadata",
    "user",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "max_tool_calls",
    // This stack's own: the request's deadline, a decode worker's KV handle, a moved request's
    // output, and the router's expanded conversation.
    "timeout",
    HANDLE_FIELD,
    RESUME_FIELD,
    CONVERSATION_FIELD,
];

fn invalid(msg: impl Into<String>) -> ApiError {
    ApiError::invalid(msg)
}

/// A Responses request as read: the chat body it stands for, and what its answer echoes and stores.
#[derive(Debug, Clone)]
pub struct ResponsesRequest {
    /// The equivalent chat-completions body ([`crate::openai::parse_value`] checks it like any other).
    pub chat: Value,
    /// The request's settings as the response object echoes them (`instructions`, `tools`,
    /// `tool_choice`, `text`, `temperature`, ...).
    pub echo: Value,
    /// The conversation's items so far, without `instructions`: the previous response's, then this
    /// request's `input`. Stored with the answer's output items when `store` is on.
    pub items: Vec<Value>,
    pub store: bool,
    /// The router keeps this answer ([`CONVERSATION_FIELD`]): the worker stores nothing.
    pub kept_by_router: bool,
}

/// The items of `previous_response_id`'s conversation, if still stored.
pub trait Previous {
    fn items(&self, id: &str) -> Option<Vec<Value>>;
}

impl<F: Fn(&str) -> Option<Vec<Value>>> Previous for F {
    fn items(&self, id: &str) -> Option<Vec<Value>> {
        self(id)
    }
}

/// Reads a Responses body. `previous` finds a stored conversation; an id it does not know is a 404
/// (gone or never stored). With `inside` (the router's own request), a body marked
/// [`CONVERSATION_FIELD`] already holds the whole conversation in `input`.
pub fn read(body: &[u8], previous: &dyn Previous, inside: bool) -> Result<ResponsesRequest, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("body is not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| invalid("body must be a JSON object"))?;
    if let Some(k) = obj.keys().find(|k| !FIELDS.contains(&k.as_str())) {
        return Err(invalid(format!("unrecognized request argument supplied: `{k}`")));
    }
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    let expanded = get(CONVERSATION_FIELD).is_some();
    if expanded && !inside {
        return Err(ApiError::new(
            ErrorKind::Unauthorized,
            format!("`{CONVERSATION_FIELD}` is taken only from the router (with the cluster secret)"),
        ));
    }
    if get("background").and_then(Value::as_bool) == Some(true) {
        return Err(invalid("`background: true` is not supported: responses are answered on the connection"));
    }
    match get("truncation").map(|t| t.as_str()) {
        None | Some(Some("disabled")) => {}
        _ => return Err(invalid("`truncation` must be \"disabled\" (a prompt over the context is a 400)")),
    }
    let mut chat = Map::new();
    for (from, to) in [
        ("model", "model"),
        ("stream", "stream"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("seed", "seed"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("max_output_tokens", "max_tokens"),
        ("timeout", "timeout"),
        (HANDLE_FIELD, HANDLE_FIELD),
        (RESUME_FIELD, RESUME_FIELD),
    ] {
        if let Some(v) = get(from) {
            chat.insert(to.to_owned(), v.clone());
        }
    }
    if let Some(s) = get("stream_options") {
        // `include_obfuscation` pads events against length side channels; these events carry none.
        let ok = s.as_object().is_some_and(|o| o.keys().all(|k| k == "include_obfuscation"));
        if !ok {
            return Err(invalid("`stream_options` takes only `include_obfuscation`"));
        }
    }
    let mut logprobs = false;
    if let Some(inc) = get("include") {
        let list = inc.as_array().ok_or_else(|| invalid("`include` must be an array of strings"))?;
        for i in list {
            match i.as_str() {
                Some("message.output_text.logprobs") => logprobs = true,
                // No reasoning is encrypted here: there is nothing to include.
                Some("reasoning.encrypted_content") => {}
                Some(other) => return Err(invalid(format!("`include`: {other:?} is not supported"))),
                None => return Err(invalid("`include` must be an array of strings")),
            }
        }
    }
    if let Some(n) = get("top_logprobs") {
        chat.insert("top_logprobs".into(), n.clone());
        logprobs = true;
    }
    if logprobs {
        chat.insert("logprobs".into(), json!(true));
    }
    let store = match get("store") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("`store` must be true or false")),
    };
    // The conversation: the previous response's items, then this input.
    let mut items = match get("previous_response_id") {
        _ if expanded => Vec::new(),
        None => Vec::new(),
        Some(Value::String(id)) => previous.items(id).ok_or_else(|| {
            ApiError::new(
                ErrorKind::NotFound,
                format!("response {id:?} is not stored here (never stored, or past the store's count or age limit)"),
            )
        })?,
        Some(_) => return Err(invalid("`previous_response_id` must be a string")),
    };
    match get("input") {
        Some(Value::String(s)) => items.push(json!({"type": "message", "role": "user", "content": s})),
        Some(Value::Array(a)) => items.extend(a.iter().cloned()),
        Some(_) => return Err(invalid("`input` must be a string or an array of items")),
        None => return Err(invalid("`input` is required")),
    }
    let mut messages = Vec::new();
    if let Some(i) = get("instructions") {
        let text = i.as_str().ok_or_else(|| invalid("`instructions` must be a string"))?;
        messages.push(json!({"role": "system", "content": text}));
    }
    let mut thought = None;
    for (i, item) in items.iter().enumerate() {
        chat_messages(i, item, &mut thought, &mut messages)?;
    }
    if messages.iter().all(|m| m["role"] == "system") {
        return Err(invalid("`input` must hold at least one message or item"));
    }
    chat.insert("messages".into(), Value::Array(messages));
    let mut echo_tools = Vec::new();
    if let Some(tools) = get("tools") {
        let list = tools.as_array().ok_or_else(|| invalid("`tools` must be an array"))?;
        let mut out = Vec::with_capacity(list.len());
        for (i, t) in list.iter().enumerate() {
            let o = t.as_object().ok_or_else(|| invalid(format!("tools[{i}] must be an object")))?;
            match o.get("type").and_then(Value::as_str) {
                Some("function") => {}
                Some(other) => {
                    return Err(invalid(format!(
                        "tools[{i}].type {other:?}: only function tools are supported (built-in tools run at OpenAI)"
                    )))
                }
                None => return Err(invalid(format!("tools[{i}].type is required"))),
            }
            if let Some(k) = o
                .keys()
                .find(|k| !matches!(k.as_str(), "type" | "name" | "description" | "parameters" | "strict"))
            {
                return Err(invalid(format!("tools[{i}] has an unrecognized field `{k}`")));
            }
            let mut f = Map::new();
            for k in ["name", "description", "parameters", "strict"] {
                if let Some(v) = o.get(k).filter(|v| !v.is_null()) {
                    f.insert(k.into(), v.clone());
                }
            }
            out.push(json!({"type": "function", "function": f}));
            echo_tools.push(t.clone());
        }
        chat.insert("tools".into(), Value::Array(out));
    }
    let tool_choice = get("tool_choice").cloned().unwrap_or(json!("auto"));
    let choice = match &tool_choice {
        Value::String(s) if matches!(s.as_str(), "auto" | "none" | "required") => tool_choice.clone(),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o.get("name").and_then(Value::as_str).ok_or_else(|| invalid("`tool_choice.name` must be a string"))?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(invalid(
                "`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"name\": ...}",
            ))
        }
    };
    if get("tools").is_some() || get("tool_choice").is_some() {
        chat.insert("tool_choice".into(), choice);
    }
    let mut text_echo = json!({"format": {"type": "text"}});
    if let Some(t) = get("text") {
        let o = t.as_object().ok_or_else(|| invalid("`text` must be an object"))?;
        for (k, v) in o.iter().filter(|(_, v)| !v.is_null()) {
            match k.as_str() {
                "format" => match v.get("type").and_then(Value::as_str) {
                    Some("text") => {}
                    Some("json_object") => {
                        chat.insert("response_format".into(), json!({"type": "json_object"}));
                    }
                    Some("json_schema") => {
                        let schema = v
                            .get("schema")
                            .filter(|s| s.is_object())
                            .ok_or_else(|| invalid("`text.format.schema` must be a JSON schema object"))?;
                        let name = v.get("name").and_then(Value::as_str).unwrap_or("output");
                        chat.insert(
                            "response_format".into(),
                            json!({"type": "json_schema", "json_schema": {"name": name, "schema": schema}}),
                        );
                    }
                    _ => {
                        return Err(invalid(
                            "`text.format.type` must be \"text\", \"json_object\" or \"json_schema\"",
                        ))
                    }
                },
                // How long answers are (low, medium, high): a hint to OpenAI's models; none here.
                "verbosity" => {}
                other => return Err(invalid(format!("`text.{other}` is not supported"))),
            }
        }
        text_echo = t.clone();
    }
    let pick = |k: &str, default: Value| get(k).cloned().unwrap_or(default);
    let echo = json!({
        "instructions": pick("instructions", Value::Null),
        "tools": echo_tools,
        "tool_choice": tool_choice,
        "parallel_tool_calls": pick("parallel_tool_calls", json!(true)),
        "temperature": pick("temperature", Value::Null),
        "top_p": pick("top_p", Value::Null),
        "max_output_tokens": pick("max_output_tokens", Value::Null),
        "previous_response_id": pick("previous_response_id", Value::Null),
        "text": text_echo,
        "reasoning": pick("reasoning", json!({"effort": null, "summary": null})),
        "store": store,
        "truncation": "disabled",
        "metadata": pick("metadata", json!({})),
        "user": pick("user", Value::Null),
    });
    Ok(ResponsesRequest { chat: Value::Object(chat), echo, items, store, kept_by_router: expanded })
}

/// The text of a content value: a string, or a list of text parts.
fn text_of(v: &Value, at: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for (j, p) in parts.iter().enumerate() {
                match p.get("type").and_then(Value::as_str) {
                    Some("input_text" | "output_text" | "text" | "refusal") => {
                        let t = p.get("text").or_else(|| p.get("refusal"));
                        out.push_str(
                            t.and_then(Value::as_str)
                                .ok_or_else(|| invalid(format!("{at}[{j}] must have a string `text`")))?,
                        );
                    }
                    Some(other) => {
                        return Err(invalid(format!(
                            "{at}[{j}].type {other:?}: only text parts are supported (this model reads text)"
                        )))
                    }
                    None => return Err(invalid(format!("{at}[{j}].type is required"))),
                }
            }
            Ok(out)
        }
        _ => Err(invalid(format!("{at} must be a string or an array of parts"))),
    }
}

/// One input item as chat messages (appended to `out`): a message, a call the model made (joined to
/// the assistant message before it), a call's output, or a thinking model's earlier thinking
/// (`thought`, the `reasoning_content` of the assistant turn that follows it).
fn chat_messages(
    i: usize,
    item: &Value,
    thought: &mut Option<String>,
    out: &mut Vec<Value>,
) -> Result<(), ApiError> {
    let at = format!("input[{i}]");
    let o = item.as_object().ok_or_else(|| invalid(format!("{at} must be an object")))?;
    let kind = o.get("type").and_then(Value::as_str).unwrap_or("message");
    match kind {
        "message" => {
            let role = match o.get("role").and_then(Value::as_str) {
                Some(r @ ("user" | "assistant" | "system")) => r,
                Some("developer") => "system",
                _ => {
                    return Err(invalid(format!(
                        "{at}.role must be \"user\", \"assistant\", \"system\" or \"developer\""
                    )))
                }
            };
            let content = text_of(o.get("content").unwrap_or(&Value::Null), &format!("{at}.content"))?;
            let mut m = json!({"role": role, "content": content});
            if let Some(t) = thought.take().filter(|_| role == "assistant") {
                m["reasoning_content"] = json!(t);
            }
            out.push(m);
        }
        "function_call" => {
            let field = |k: &str| {
                o.get(k).and_then(Value::as_str).ok_or_else(|| invalid(format!("{at}.{k} must be a string")))
            };
            let call = json!({"id": field("call_id")?, "type": "function",
                "function": {"name": field("name")?, "arguments": field("arguments")?}});
            match out.last_mut().filter(|m| m["role"] == "assistant" && thought.is_none()) {
                Some(m) => match m.get_mut("tool_calls").and_then(Value::as_array_mut) {
                    Some(calls) => calls.push(call),
                    None => m["tool_calls"] = json!([call]),
                },
                None => {
                    let mut m = json!({"role": "assistant", "content": null, "tool_calls": [call]});
                    if let Some(t) = thought.take() {
                        m["reasoning_content"] = json!(t);
                    }
                    out.push(m);
                }
            }
        }
        "function_call_output" => {
            let id = o
                .get("call_id")
                .and_then(Value::as_str)
                .ok_or_else(|| invalid(format!("{at}.call_id must be a string")))?;
            let output = text_of(o.get("output").unwrap_or(&Value::Null), &format!("{at}.output"))?;
            out.push(json!({"role": "tool", "tool_call_id": id, "content": output}));
        }
        // A thinking model's earlier thinking: the next assistant turn's `reasoning_content`
        // (rendered where the template has a place for it; a model that does not think refuses it).
        "reasoning" => {
            let mut text = String::new();
            for key in ["content", "summary"] {
                for part in o.get(key).and_then(Value::as_array).into_iter().flatten() {
                    text.push_str(part.get("text").and_then(Value::as_str).unwrap_or(""));
                }
                if !text.is_empty() {
                    break;
                }
            }
            if !text.is_empty() {
                thought.get_or_insert_with(String::new).push_str(&text);
            }
        }
        other => {
            return Err(invalid(format!(
            "{at}.type {other:?} is not supported (message, function_call, function_call_output, reasoning)"
        )))
        }
    }
    Ok(())
}

/// A call's output item.
fn call_item(c: &ToolCall, status: &str) -> Value {
    json!({"type": "function_call", "id": format!("fc_{}", c.id), "call_id": c.id, "name": c.name,
           "arguments": c.arguments, "status": status})
}

/// The message item holding the answer's text (`logprobs`: its tokens', when asked for).
fn message_item(id: &str, text: &str, logprobs: &[Value], status: &str) -> Value {
    let content = if text.is_empty() && status == "in_progress" {
        json!([])
    } else {
        json!([{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}])
    };
    json!({"type": "message", "id": id, "status": status, "role": "assistant", "content": content})
}

/// The id of the answer's `n`th message item (text after a call opens another).
fn message_id(meta: &Meta, n: usize) -> String {
    match n {
        0 => format!("msg_{}", meta.id.trim_start_matches("resp_")),
        n => format!("msg_{}_{n}", meta.id.trim_start_matches("resp_")),
    }
}

/// Tokens' log-probabilities as the Responses API writes them (`message.output_text.logprobs`).
pub fn logprobs_json(lps: &[TokenLogprob]) -> Vec<Value> {
    let one =
        |token: &str, logprob: f32| json!({"token": token, "logprob": logprob, "bytes": token.as_bytes()});
    lps.iter()
        .map(|l| {
            let mut v = one(&l.token, l.logprob);
            v["top_logprobs"] = l.top.iter().map(|(t, p)| one(t, *p)).collect();
            v
        })
        .collect()
}

fn reasoning_id(meta: &Meta) -> String {
    format!("rs_{}", meta.id.trim_start_matches("resp_"))
}

/// The item holding a thinking model's thinking.
fn reasoning_item(meta: &Meta, text: &str, status: &str) -> Value {
    let content = if text.is_empty() { json!([]) } else { json!([{"type": "reasoning_text", "text": text}]) };
    json!({"type": "reasoning", "id": reasoning_id(meta), "summary": [], "content": content, "status": status})
}

/// The output items of an answer: its thinking (if any), its text (if any, or if there is nothing
/// else), then its calls.
pub fn output_items(
    meta: &Meta,
    reasoning: &str,
    text: &str,
    logprobs: &[Value],
    calls: &[ToolCall],
) -> Vec<Value> {
    let mut out = Vec::new();
    if !reasoning.is_empty() {
        out.push(reasoning_item(meta, reasoning, "completed"));
    }
    if !text.trim().is_empty() || calls.is_empty() {
        out.push(message_item(&message_id(meta, 0), text, logprobs, "completed"));
    }
    out.extend(calls.iter().map(|c| call_item(c, "completed")));
    out
}

fn usage_json(u: Usage) -> Value {
    json!({"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens},
           "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
           "total_tokens": u.prompt_tokens + u.completion_tokens})
}

/// The response object. `finish_reason` is the engine's (`length` makes it `incomplete`); `None`
/// while in progress.
pub fn response_json(
    meta: &Meta,
    echo: &Value,
    output: Vec<Value>,
    finish_reason: Option<&str>,
    usage: Option<Usage>,
) -> Value {
    let (status, incomplete) = match finish_reason {
        None => ("in_progress", Value::Null),
        Some("length") => ("incomplete", json!({"reason": "max_output_tokens"})),
        Some(_) => ("completed", Value::Null),
    };
    let mut r = json!({"id": meta.id, "object": "response", "created_at": meta.created, "status": status,
        "error": null, "incomplete_details": incomplete, "model": meta.model, "output": output,
        "usage": usage.map(usage_json)});
    if let (Some(r), Some(e)) = (r.as_object_mut(), echo.as_object()) {
        for (k, v) in e {
            r.insert(k.clone(), v.clone());
        }
    }
    r
}

/// A failed response object (the stream's last event when it fails after it began).
pub fn failed_json(meta: &Meta, error: &ApiError) -> Value {
    json!({"id": meta.id, "object": "response", "created_at": meta.created, "status": "failed",
        "error": {"code": error.kind.as_str(), "message": error.message}, "incomplete_details": null,
        "model": meta.model, "output": []})
}

/// One event: its type and its data (which carries the type and a sequence number).
pub type Event = (String, Value);

/// The events of a streamed response, in order, each with its sequence number: `response.created`,
/// `response.in_progress`; per output item `response.output_item.added`, its parts and deltas,
/// `response.output_item.done`; then `response.completed` (or `response.incomplete`).
#[derive(Debug, Default)]
pub struct ResponseStream {
    seq: u64,
    /// The thinking so far, and whether its reasoning item is open (and at which output index).
    thought: String,
    thinking: Option<usize>,
    /// The answer's text so far (and its tokens' log-probabilities), and whether its message item is
    /// open (and at which output index).
    text: String,
    logprobs: Vec<Value>,
    open: Option<usize>,
    /// Message items opened so far (each gets its own id).
    messages: usize,
    /// Whitespace not yet given out (and its log-probabilities): before a call it is no answer (as
    /// the whole answer drops it).
    blank: String,
    blank_logprobs: Vec<Value>,
    /// The finished output items.
    items: Vec<Value>,
}

impl ResponseStream {
    /// A stream taken over mid-answer (a request the router moved here): the client has its
    /// opening events, so numbering goes on after them (and after the replayed answer's own events,
    /// which the replay makes again without sending).
    pub fn resumed() -> ResponseStream {
        ResponseStream { seq: 2, ..ResponseStream::default() }
    }

    fn event(&mut self, kind: &str, mut data: Value) -> Event {
        data["sequence_number"] = json!(self.seq);
        // The type last, so a stream's end is known from its last bytes (the router reads them).
        data["type"] = json!(kind);
        self.seq += 1;
        (kind.to_owned(), data)
    }

    /// The opening events.
    pub fn start(&mut self, meta: &Meta, echo: &Value, out: &mut Vec<Event>) {
        let r = response_json(meta, echo, Vec::new(), None, None);
        out.push(self.event("response.created", json!({"response": r})));
        let r = response_json(meta, echo, Vec::new(), None, None);
        out.push(self.event("response.in_progress", json!({"response": r})));
    }

    /// A thinking model's thinking: its reasoning item (before the answer's).
    pub fn reasoning(&mut self, meta: &Meta, text: &str, out: &mut Vec<Event>) {
        if text.is_empty() {
            return;
        }
        self.close_message(meta, out);
        let index = match self.thinking {
            Some(i) => i,
            None => {
                let i = self.items.len();
                self.thinking = Some(i);
                let item = reasoning_item(meta, "", "in_progress");
                out.push(self.event("response.output_item.added", json!({"output_index": i, "item": item})));
                i
            }
        };
        self.thought.push_str(text);
        out.push(self.event(
            "response.reasoning_text.delta",
            json!({"item_id": reasoning_id(meta), "output_index": index, "content_index": 0, "delta": text}),
        ));
    }

    fn close_reasoning(&mut self, meta: &Meta, out: &mut Vec<Event>) {
        let Some(i) = self.thinking.take() else { return };
        let text = std::mem::take(&mut self.thought);
        out.push(self.event(
            "response.reasoning_text.done",
            json!({"item_id": reasoning_id(meta), "output_index": i, "content_index": 0, "text": text}),
        ));
        let item = reasoning_item(meta, &text, "completed");
        out.push(self.event("response.output_item.done", json!({"output_index": i, "item": item.clone()})));
        self.items.push(item);
    }

    /// Text the model wrote, with its tokens' log-probabilities (when asked for).
    pub fn text(&mut self, meta: &Meta, text: &str, logprobs: Vec<Value>, out: &mut Vec<Event>) {
        if text.is_empty() && logprobs.is_empty() {
            return;
        }
        self.close_reasoning(meta, out);
        if self.open.is_none() && text.trim().is_empty() {
            // Whitespace ahead of the answer waits: before a call it is no answer.
            self.blank.push_str(text);
            self.blank_logprobs.extend(logprobs);
            return;
        }
        let index = match self.open {
            Some(i) => i,
            None => self.open_message(meta, out),
        };
        let delta = std::mem::take(&mut self.blank) + text;
        let mut delta_lps = std::mem::take(&mut self.blank_logprobs);
        delta_lps.extend(logprobs);
        self.text.push_str(&delta);
        self.logprobs.extend(delta_lps.iter().cloned());
        out.push(self.event(
            "response.output_text.delta",
            json!({"item_id": message_id(meta, self.messages - 1), "output_index": index, "content_index": 0,
                   "delta": delta, "logprobs": delta_lps}),
        ));
    }

    fn open_message(&mut self, meta: &Meta, out: &mut Vec<Event>) -> usize {
        let i = self.items.len();
        self.open = Some(i);
        let id = message_id(meta, self.messages);
        self.messages += 1;
        let item = message_item(&id, "", &[], "in_progress");
        out.push(self.event("response.output_item.added", json!({"output_index": i, "item": item})));
        let part = json!({"type": "output_text", "text": "", "annotations": [], "logprobs": []});
        out.push(self.event(
            "response.content_part.added",
            json!({"item_id": id, "output_index": i, "content_index": 0, "part": part}),
        ));
        i
    }

    fn close_text(&mut self, meta: &Meta, out: &mut Vec<Event>) {
        self.close_reasoning(meta, out);
        self.close_message(meta, out);
    }

    fn close_message(&mut self, meta: &Meta, out: &mut Vec<Event>) {
        let Some(i) = self.open.take() else { return };
        let text = std::mem::take(&mut self.text);
        let logprobs = std::mem::take(&mut self.logprobs);
        let id = message_id(meta, self.messages - 1);
        out.push(self.event(
            "response.output_text.done",
            json!({"item_id": id, "output_index": i, "content_index": 0, "text": text, "logprobs": logprobs}),
        ));
        let part = json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs});
        out.push(self.event(
            "response.content_part.done",
            json!({"item_id": id, "output_index": i, "content_index": 0, "part": part}),
        ));
        let item = message_item(&id, &text, &logprobs, "completed");
        out.push(self.event("response.output_item.done", json!({"output_index": i, "item": item.clone()})));
        self.items.push(item);
    }

    /// A complete call: its item, its arguments (as one delta), its end.
    pub fn call(&mut self, meta: &Meta, c: &ToolCall, out: &mut Vec<Event>) {
        self.close_text(meta, out);
        self.blank.clear();
        self.blank_logprobs.clear();
        let i = self.items.len();
        let mut item = call_item(c, "in_progress");
        item["arguments"] = json!("");
        out.push(self.event("response.output_item.added", json!({"output_index": i, "item": item})));
        let id = format!("fc_{}", c.id);
        out.push(self.event(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": i, "delta": c.arguments}),
        ));
        out.push(self.event(
            "response.function_call_arguments.done",
            json!({"item_id": id, "output_index": i, "name": c.name, "arguments": c.arguments}),
        ));
        let item = call_item(c, "completed");
        out.push(self.event("response.output_item.done", json!({"output_index": i, "item": item.clone()})));
        self.items.push(item);
    }

    /// The end: the open item closes, then `response.completed` (`response.incomplete` when cut by
    /// `max_output_tokens`) with the whole response. Returns the output items (for the store).
    pub fn finish(
        &mut self,
        meta: &Meta,
        echo: &Value,
        finish_reason: &str,
        usage: Usage,
        out: &mut Vec<Event>,
    ) -> Vec<Value> {
        // An answer of nothing but whitespace (or nothing at all) is still a message, as whole.
        let called = self.items.iter().any(|i| i["type"] == "function_call");
        if self.open.is_none() && !called {
            self.open_message(meta, out);
            let (blank, lps) = (std::mem::take(&mut self.blank), std::mem::take(&mut self.blank_logprobs));
            self.text(meta, &blank, lps, out);
        }
        self.close_text(meta, out);
        let items = std::mem::take(&mut self.items);
        let r = response_json(meta, echo, items.clone(), Some(finish_reason), Some(usage));
        let kind = if r["status"] == "incomplete" { "response.incomplete" } else { "response.completed" };
        out.push(self.event(kind, json!({"response": r})));
        items
    }

    /// A stream that fails after it began: `response.failed`.
    pub fn fail(&mut self, meta: &Meta, error: &ApiError, out: &mut Vec<Event>) {
        out.push(self.event("response.failed", json!({"response": failed_json(meta, error)})));
    }
}

/// The data of an event, one line.
pub fn event_data(e: &Event) -> String {
    e.1.to_string()
}

/// A stream that fails after it began, when no stream state is at hand (the router's): a
/// `response.failed` event.
pub fn stream_error_events(meta: &Meta, error: &ApiError) -> String {
    let mut s = ResponseStream { seq: 1_000_000, ..ResponseStream::default() };
    let mut out = Vec::new();
    s.fail(meta, error, &mut out);
    out.iter().map(|e| crate::sse(Some(&e.0), &event_data(e))).collect()
}

/// Whether a Responses stream's last bytes are its last event (completed, incomplete or failed).
pub fn ended(tail: &[u8]) -> bool {
    ["response.completed", "response.incomplete", "response.failed"]
        .iter()
        .any(|k| tail.ends_with(format!("\"type\":\"{k}\"}}\n\n").as_bytes()))
}

/// One stored response: the conversation's items up to and including its output, and the response
/// object (`GET /v1/responses/{id}`).
#[derive(Debug, Clone)]
struct Stored {
    items: Vec<Value>,
    response: Value,
    at: Instant,
    /// Its size as JSON text (what the byte bound counts).
    bytes: usize,
}

/// Answered responses kept for `previous_response_id` and `GET /v1/responses/{id}`: at most
/// `count_max`, together at most `bytes_max` (each holds its whole conversation), none older than
/// `age_max`; the oldest go first. Requests with `store: false` are never kept.
#[derive(Debug)]
pub struct ResponseStore {
    by_id: HashMap<String, Stored>,
    order: VecDeque<String>,
    bytes: usize,
    pub count_max: usize,
    pub bytes_max: usize,
    pub age_max: Duration,
}

impl ResponseStore {
    pub fn new(count_max: usize, bytes_max: usize, age_max: Duration) -> ResponseStore {
        ResponseStore {
            by_id: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            count_max,
            bytes_max,
            age_max,
        }
    }

    fn drop_oldest(&mut self) -> bool {
        let Some(old) = self.order.pop_front() else { return false };
        if let Some(s) = self.by_id.remove(&old) {
            self.bytes -= s.bytes;
        }
        true
    }

    /// Keeps response `response` (its `id` names it), whose conversation is `items` then its output.
    pub fn put(&mut self, mut items: Vec<Value>, response: Value, now: Instant) {
        let Some(id) = response["id"].as_str().map(str::to_owned) else { return };
        if self.count_max == 0 {
            return;
        }
        items.extend(response["output"].as_array().into_iter().flatten().cloned());
        let bytes = items.iter().map(|i| i.to_string().len()).sum::<usize>() + response.to_string().len();
        if bytes > self.bytes_max {
            return; // larger than the whole store: not kept
        }
        self.expire(now);
        self.delete(&id);
        while self.by_id.len() >= self.count_max || self.bytes + bytes > self.bytes_max {
            if !self.drop_oldest() {
                break;
            }
        }
        self.bytes += bytes;
        self.by_id.insert(id.clone(), Stored { items, response, at: now, bytes });
        self.order.push_back(id);
    }

    fn expire(&mut self, now: Instant) {
        while let Some(id) = self.order.front() {
            match self.by_id.get(id) {
                Some(s) if now.saturating_duration_since(s.at) < self.age_max => break,
                _ => {
                    self.drop_oldest();
                }
            }
        }
    }

    fn live(&self, id: &str, now: Instant) -> Option<&Stored> {
        self.by_id.get(id).filter(|s| now.saturating_duration_since(s.at) < self.age_max)
    }

    /// The conversation items of response `id` (its output included), if kept.
    pub fn items(&self, id: &str, now: Instant) -> Option<Vec<Value>> {
        self.live(id, now).map(|s| s.items.clone())
    }

    /// The response object `id`, if kept.
    pub fn response(&self, id: &str, now: Instant) -> Option<Value> {
        self.live(id, now).map(|s| s.response.clone())
    }

    /// Forgets response `id`; whether it was kept.
    pub fn delete(&mut self, id: &str) -> bool {
        let Some(s) = self.by_id.remove(id) else { return false };
        self.bytes -= s.bytes;
        self.order.retain(|o| o != id);
        true
    }

    /// Bytes held (the stored conversations and responses as JSON text).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Endpoint;

    fn none(_: &str) -> Option<Vec<Value>> {
        None
    }

    #[test]
    fn items_read_as_the_chat_they_stand_for() {
        let body = br#"{"model": "m", "instructions": "Be brief.", "max_output_tokens": 20,
            "input": [
                {"role": "user", "content": "Read a.txt"},
                {"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": "{\"path\":\"a.txt\"}"},
                {"type": "function_call_output", "call_id": "c1", "output": "hello"},
                {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer now."}]}
            ],
            "tools": [{"type": "function", "name": "read_file", "parameters": {"type": "object"}, "strict": true}],
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}}"#;
        let r = read(body, &none, false).unwrap();
        let m = &r.chat["messages"];
        assert_eq!((m[0]["role"].as_str(), m[0]["content"].as_str()), (Some("system"), Some("Be brief.")));
        assert_eq!(m[2]["tool_calls"][0]["function"]["name"], "read_file");
        assert_eq!((m[3]["role"].as_str(), m[3]["tool_call_id"].as_str()), (Some("tool"), Some("c1")));
        assert_eq!(m[4]["role"], "system");
        assert_eq!(r.chat["max_tokens"], 20);
        assert_eq!(r.chat["response_format"]["type"], "json_schema");
        assert_eq!(r.chat["tools"][0]["function"]["name"], "read_file");
        assert_eq!((r.items.len(), r.store), (4, true));
        let g = crate::openai::parse_value(Endpoint::Chat, r.chat).unwrap();
        assert_eq!(g.tools.len(), 1);
    }

    #[test]
    fn what_is_not_served_is_named() {
        for (body, want) in [
            (r#"{"input": "x", "tools": [{"type": "web_search"}]}"#, "only function tools"),
            (r#"{"input": "x", "background": true}"#, "background"),
            (
                r#"{"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}"#,
                "input_image",
            ),
            (r#"{"input": "x", "frobnicate": 1}"#, "frobnicate"),
            (r#"{"input": "x", "previous_response_id": "resp_gone"}"#, "resp_gone"),
            (r#"{"input": "x", "pd_conversation": true}"#, "router"),
            (r#"{"input": "x", "truncation": "auto"}"#, "truncation"),
            (r#"{"model": "m"}"#, "`input` is required"),
        ] {
            let e = read(body.as_bytes(), &none, false).unwrap_err();
            assert!(e.message.contains(want), "{body}: {e}");
        }
    }

    #[test]
    fn a_stream_opens_and_closes_each_item_and_ends_readably() {
        let meta =
            Meta { endpoint: Endpoint::Responses, id: "resp_r1".into(), created: 1, model: "m".into() };
        let echo = json!({"store": true});
        let mut s = ResponseStream::default();
        let mut out = Vec::new();
        s.start(&meta, &echo, &mut out);
        s.text(&meta, "Hel", Vec::new(), &mut out);
        s.text(&meta, "lo", Vec::new(), &mut out);
        let call = ToolCall { id: "call_r1_0".into(), name: "ls".into(), arguments: "{}".into() };
        s.call(&meta, &call, &mut out);
        let items = s.finish(&meta, &echo, "tool_calls", Usage::default(), &mut out);
        let kinds: Vec<&str> = out.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.created",
                "response.in_progress",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_text.delta",
                "response.output_text.delta",
                "response.output_text.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
                "response.completed",
            ]
        );
        assert!(out
            .iter()
            .enumerate()
            .all(|(i, e)| e.1["sequence_number"] == i as u64 && e.1["type"] == e.0));
        assert_eq!(items[0]["content"][0]["text"], "Hello");
        assert_eq!(items[1]["call_id"], "call_r1_0");
        let framed: String = out.iter().map(|e| crate::sse(Some(&e.0), &event_data(e))).collect();
        assert!(ended(framed.as_bytes()) && !ended(&framed.as_bytes()[..framed.len() - 3]));
    }

    #[test]
    fn a_stream_has_the_items_of_the_whole_answer() {
        let meta =
            Meta { endpoint: Endpoint::Responses, id: "resp_r2".into(), created: 1, model: "m".into() };
        let echo = json!({});
        let call = ToolCall { id: "c0".into(), name: "ls".into(), arguments: "{}".into() };
        // Whitespace before a call is no answer, streamed or whole.
        let mut s = ResponseStream::default();
        let mut out = Vec::new();
        s.text(&meta, "\n ", Vec::new(), &mut out);
        s.call(&meta, &call, &mut out);
        let streamed = s.finish(&meta, &echo, "tool_calls", Usage::default(), &mut out);
        assert_eq!(streamed, output_items(&meta, "", "\n ", &[], std::slice::from_ref(&call)));
        // Text after a call is another message item, with its own id; thinking after text another
        // index.
        let mut s = ResponseStream::default();
        let mut out = Vec::new();
        s.text(&meta, "a", Vec::new(), &mut out);
        s.call(&meta, &call, &mut out);
        s.text(&meta, "b", Vec::new(), &mut out);
        s.reasoning(&meta, "hm", &mut out);
        let items = s.finish(&meta, &echo, "stop", Usage::default(), &mut out);
        let ids: Vec<&str> = items.iter().map(|i| i["id"].as_str().unwrap()).collect();
        assert_eq!(ids, ["msg_r2", "fc_c0", "msg_r2_1", "rs_r2"]);
        let added: Vec<u64> = out
            .iter()
            .filter(|e| e.0 == "response.output_item.added")
            .map(|e| e.1["output_index"].as_u64().unwrap())
            .collect();
        assert_eq!(added, [0, 1, 2, 3]);
        // Reasoning items go back as the next assistant turn's thinking.
        let body = br#"{"input": [{"role": "user", "content": "2+2?"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "four"}]},
            {"role": "assistant", "content": "4"}]}"#;
        let r = read(body, &none, false).unwrap();
        assert_eq!(r.chat["messages"][1]["reasoning_content"], "four");
    }

    #[test]
    fn the_store_is_bounded_in_count_and_age() {
        let t0 = Instant::now();
        let mut store = ResponseStore::new(2, 1 << 20, Duration::from_secs(60));
        let resp = |id: &str| json!({"id": id, "output": [{"type": "message", "role": "assistant", "content": "x"}]});
        store.put(vec![json!({"role": "user", "content": "a"})], resp("r1"), t0);
        store.put(Vec::new(), resp("r2"), t0);
        assert_eq!(store.items("r1", t0).map(|i| i.len()), Some(2));
        store.put(Vec::new(), resp("r3"), t0);
        assert!(store.items("r1", t0).is_none() && store.items("r2", t0).is_some());
        assert!(store.items("r3", t0 + Duration::from_secs(61)).is_none());
        assert!(store.delete("r2") && !store.delete("r2"));
        // The byte bound: a conversation too large for what is left pushes the oldest out.
        let mut small = ResponseStore::new(100, 300, Duration::from_secs(60));
        for id in ["a", "b", "c"] {
            small.put(vec![json!({"role": "user", "content": "x".repeat(60)})], resp(id), t0);
        }
        assert!(small.items("a", t0).is_none() && small.items("c", t0).is_some() && small.bytes() <= 300);
        small.put(vec![json!("y".repeat(400))], resp("huge"), t0);
        assert!(small.items("huge", t0).is_none() && small.items("c", t0).is_some());
        // A follow-up reads the stored conversation, then its own input.
        let previous = |id: &str| store.items(id, t0);
        let r = read(br#"{"input": "next", "previous_response_id": "r3"}"#, &previous, false).unwrap();
        assert_eq!(r.items.len(), 2);
    }
}
