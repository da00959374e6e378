//! OpenAI's Responses API (`POST /v1/responses`) over the same engine: a Responses body (`input` as a
//! string or items: messages, `function_call`, `function_call_output`; `instructions`, function
//! `tools`, `text.format`, `max_output_tokens`, ...) is read into the chat body it stands for, and
//! answers are written as a response object or its stream of typed events (`response.created` ...
//! `response.output_text.delta`, `response.function_call_arguments.delta`, ... `response.completed`).
//! [`ResponseStore`] keeps answered conversations for `previous_response_id`, bounded in count and
//! age.

use serde_json::{json, Map, Value};

use pdserve_api::pd::{HANDLE_FIELD, RESUME_FIELD};
use pdserve_api::{ApiError, ErrorKind};

mod answer;
mod store;
pub use answer::{
    ended, event_data, failed_json, logprobs_json, output_items, response_json, stream_error_events, Event,
    ResponseStream,
};
pub use store::ResponseStore;

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
    // This stack's own (and vLLM's): the request's deadline and priority, a decode worker's KV
    // handle, a moved request's output, and the router's expanded conversation.
    "timeout",
    "priority",
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
    let obj = crate::object_of(body, FIELDS)?;
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
        ("priority", "priority"),
        (HANDLE_FIELD, HANDLE_FIELD),
        (RESUME_FIELD, RESUME_FIELD),
    ] {
        if let Some(v) = get(from) {
            chat.insert(to.to_owned(), v.clone());
        }
    }
    // `reasoning.effort` is the chat request's `reasoning_effort` (`summary` changes nothing here:
    // the reasoning item holds the thinking itself).
    match get("reasoning") {
        None | Some(Value::Null) => {}
        Some(Value::Object(r)) => {
            if let Some(e) = r.get("effort").filter(|e| !e.is_null()) {
                chat.insert("reasoning_effort".into(), e.clone());
            }
        }
        Some(_) => return Err(invalid("`reasoning` must be an object")),
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
#[cfg(test)]
mod tests {
    use super::*;
    use crate::Endpoint;

    pub(super) fn none(_: &str) -> Option<Vec<Value>> {
        None
    }

    /// `reasoning_effort` reaches the template's variables (the kwargs' own value wins), and the
    /// Responses API's `reasoning.effort` is the same; an unknown effort is a 400 naming the values.
    #[test]
    fn reasoning_effort_is_a_template_variable() {
        let chat = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "x"}}]{extra}}}"#);
        let kwargs = |extra: &str| {
            crate::parse_generate(Endpoint::Chat, chat(extra).as_bytes()).map(|r| r.chat_template_kwargs)
        };
        assert_eq!(kwargs(r#","reasoning_effort": "max""#).unwrap()["reasoning_effort"], "max");
        let both =
            kwargs(r#","reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high"}"#);
        assert_eq!(both.unwrap()["reasoning_effort"], "high");
        assert!(kwargs("").unwrap().is_empty());
        let e = kwargs(r#","reasoning_effort": "extreme""#).unwrap_err();
        assert!(e.message.contains("minimal, low, medium, high"), "{e}");
        let none = |_: &str| None;
        let r = read(br#"{"input": "x", "reasoning": {"effort": "high"}}"#, &none, false).unwrap();
        let chat = crate::parse_generate(Endpoint::Chat, r.chat.to_string().as_bytes()).unwrap();
        assert_eq!(chat.chat_template_kwargs["reasoning_effort"], "high");
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
}
