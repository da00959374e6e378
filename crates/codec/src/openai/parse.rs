//! Request bodies: chat-completions, completions (and Messages, read into chat), `/tokenize` and
//! `/detokenize`, checked field by field.

use serde_json::{json, Map, Value};

use pdserve_api::generation::Constraint;
use pdserve_api::pd::{PdHandle, Resume, HANDLE_FIELD, RESUME_FIELD};
use pdserve_api::tools::{Tool, ToolCall, ToolChoice};
use pdserve_api::ApiError;

use super::tools::{parse_tool_choice, parse_tools};
use crate::{Endpoint, GenerateRequest, Message, Prompt, Sampling};

/// Fields every generation body may carry, beside the endpoint's own. OpenAI's informational fields
/// (`user`, `metadata`, `store`, `service_tier`) are accepted and have no effect.
const COMMON_FIELDS: &[&str] = &[
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "n",
    "stream",
    "stream_options",
    "stop",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "user",
    "metadata",
    "store",
    "service_tier",
    // Extensions users send to vLLM/SGLang.
    "top_k",
    "min_p",
    "repetition_penalty",
    "ignore_eos",
    "stop_token_ids",
    "min_tokens",
    "include_stop_str_in_output",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "regex",
    "json_schema",
    "timeout",
    "priority",
    HANDLE_FIELD,
    RESUME_FIELD,
];
const CHAT_FIELDS: &[&str] = &[
    "messages",
    "max_completion_tokens",
    "logprobs",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "response_format",
    "chat_template_kwargs",
    "reasoning_effort",
];
const COMPLETION_FIELDS: &[&str] = &["prompt", "logprobs", "best_of", "echo", "suffix", "response_format"];

/// Most stop strings a request may set, and their longest length in bytes.
pub const STOP_STRINGS_MAX: usize = 16;
pub const STOP_STRING_BYTES_MAX: usize = 256;
pub const TOP_LOGPROBS_MAX: u32 = 20;
/// Most choices one request may ask for (`n`).
pub const N_MAX: u32 = 16;

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn f64(&self, k: &str) -> Result<Option<f64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_f64()
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| ApiError::invalid(format!("`{k}` must be a number")))
            })
            .transpose()
    }
    fn ranged(&self, k: &str, lo: f64, hi: f64) -> Result<Option<f32>, ApiError> {
        match self.f64(k)? {
            Some(v) if (lo..=hi).contains(&v) => Ok(Some(v as f32)),
            Some(v) => Err(ApiError::invalid(format!("`{k}` must be between {lo} and {hi}, got {v}"))),
            None => Ok(None),
        }
    }
    fn u64(&self, k: &str) -> Result<Option<u64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_u64().ok_or_else(|| ApiError::invalid(format!("`{k}` must be a non-negative integer")))
            })
            .transpose()
    }
    fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        self.get(k)
            .map(|v| v.as_bool().ok_or_else(|| ApiError::invalid(format!("`{k}` must be true or false"))))
            .transpose()
    }
    fn str(&self, k: &str) -> Result<Option<&str>, ApiError> {
        self.get(k)
            .map(|v| v.as_str().ok_or_else(|| ApiError::invalid(format!("`{k}` must be a string"))))
            .transpose()
    }
}

fn parse_messages(f: &Fields<'_>) -> Result<Prompt, ApiError> {
    let msgs = f.get("messages").ok_or_else(|| ApiError::invalid("`messages` is required"))?;
    let msgs = msgs.as_array().ok_or_else(|| ApiError::invalid("`messages` must be an array"))?;
    if msgs.is_empty() {
        return Err(ApiError::invalid("`messages` must not be empty"));
    }
    let mut out = Vec::with_capacity(msgs.len());
    for (i, m) in msgs.iter().enumerate() {
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| ApiError::invalid(format!("messages[{i}].role must be a string")))?;
        if !matches!(role, "system" | "user" | "assistant" | "tool" | "developer") {
            return Err(ApiError::invalid(format!(
                "messages[{i}].role {role:?} is not one of system, user, assistant, tool, developer"
            )));
        }
        let content = match m.get("content") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.get("type").and_then(Value::as_str), p.get("text").and_then(Value::as_str)) {
                        (Some("text"), Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid(format!(
                                "messages[{i}].content: only text parts are supported"
                            )))
                        }
                    }
                }
                text
            }
            Some(Value::Null) | None if role == "assistant" => String::new(),
            _ => {
                return Err(ApiError::invalid(format!(
                    "messages[{i}].content must be a string or an array of text parts"
                )))
            }
        };
        let mut msg = Message { role: role.to_owned(), content, ..Message::default() };
        let obj =
            m.as_object().ok_or_else(|| ApiError::invalid(format!("messages[{i}] must be an object")))?;
        for (k, v) in obj {
            let bad = |what: &str| ApiError::invalid(format!("messages[{i}].{k} {what}"));
            match k.as_str() {
                "role" | "content" => {}
                "name" => msg.name = Some(v.as_str().ok_or_else(|| bad("must be a string"))?.to_owned()),
                "tool_call_id" if role == "tool" => {
                    msg.tool_call_id = Some(v.as_str().ok_or_else(|| bad("must be a string"))?.to_owned())
                }
                "tool_calls" if role == "assistant" => msg.tool_calls = parse_message_calls(i, v)?,
                // A thinking model's earlier thinking (`reasoning` is vLLM's newer name): the
                // template renders it where it has a place for it.
                "reasoning_content" | "reasoning" if role == "assistant" && !v.is_null() => {
                    msg.reasoning = Some(v.as_str().ok_or_else(|| bad("must be a string"))?.to_owned())
                }
                // A refusal is what the model said: its text, when the message has no other.
                "refusal" if role == "assistant" && !v.is_null() => {
                    let r = v.as_str().ok_or_else(|| bad("must be a string"))?;
                    if !msg.content.is_empty() && msg.content != r {
                        return Err(bad("and `content` both hold text; send the one the model said"));
                    }
                    msg.content = r.to_owned();
                }
                "audio" if role == "assistant" && !v.is_null() => {
                    return Err(bad("refers to an audio answer; this model answers in text only"))
                }
                // Informational fields of assistant messages (a client echoing a response back).
                "refusal" | "annotations" | "audio" | "function_call" | "reasoning_content" | "reasoning"
                    if role == "assistant" && (v.is_null() || k == "annotations") => {}
                _ => return Err(ApiError::invalid(format!("messages[{i}] has an unrecognized field `{k}`"))),
            }
        }
        if role == "tool" && msg.tool_call_id.is_none() {
            return Err(ApiError::invalid(format!("messages[{i}]: a tool message needs `tool_call_id`")));
        }
        out.push(msg);
    }
    Ok(Prompt::Messages(out))
}

/// The values `reasoning_effort` takes (OpenAI's, and DeepSeek V4's `max`).
pub const REASONING_EFFORTS: &[&str] = &["none", "minimal", "low", "medium", "high", "xhigh", "max"];

/// `chat_template_kwargs`: an object of extra template variables (Qwen3's `enable_thinking`); a
/// chat request's `reasoning_effort` goes there too (templates and DeepSeek V4's encoder read it),
/// unless the kwargs set it.
fn parse_template_kwargs(f: &Fields<'_>) -> Result<Map<String, Value>, ApiError> {
    let mut kwargs = match f.get("chat_template_kwargs") {
        None => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => return Err(ApiError::invalid("`chat_template_kwargs` must be an object")),
    };
    match f.get("reasoning_effort") {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) if REASONING_EFFORTS.contains(&e.as_str()) => {
            kwargs.entry("reasoning_effort").or_insert_with(|| Value::String(e.clone()));
        }
        Some(_) => {
            return Err(ApiError::invalid(format!(
                "`reasoning_effort` must be one of {}",
                REASONING_EFFORTS.join(", ")
            )))
        }
    }
    Ok(kwargs)
}

/// An assistant message's `tool_calls`.
fn parse_message_calls(i: usize, v: &Value) -> Result<Vec<ToolCall>, ApiError> {
    let bad = |what: &str| ApiError::invalid(format!("messages[{i}].tool_calls{what}"));
    let list = v.as_array().ok_or_else(|| bad(" must be an array"))?;
    let mut calls = Vec::with_capacity(list.len());
    for (j, c) in list.iter().enumerate() {
        let f = c.get("function").ok_or_else(|| bad(&format!("[{j}].function is required")))?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(&format!("[{j}].function.name must be a string")))?;
        let arguments = match f.get("arguments") {
            Some(Value::String(s)) => s.clone(),
            Some(o @ Value::Object(_)) => o.to_string(),
            None | Some(Value::Null) => "{}".to_owned(),
            Some(_) => return Err(bad(&format!("[{j}].function.arguments must be a JSON string"))),
        };
        let id = c.get("id").and_then(Value::as_str).map_or_else(|| format!("call_{j}"), str::to_owned);
        calls.push(ToolCall { id, name: name.to_owned(), arguments });
    }
    Ok(calls)
}

/// `response_format` and the structured-output extensions: at most one of them.
fn parse_constraint(f: &Fields<'_>) -> Result<Option<Constraint>, ApiError> {
    let mut found: Vec<(&str, Constraint)> = Vec::new();
    if let Some(rf) = f.get("response_format") {
        let kind = rf.get("type").and_then(Value::as_str).ok_or_else(|| {
            ApiError::invalid("`response_format.type` must be \"text\", \"json_object\" or \"json_schema\"")
        })?;
        match kind {
            "text" => {}
            "json_object" => {
                found.push(("response_format", Constraint::JsonSchema(json!({"type": "object"}))))
            }
            "json_schema" => {
                let js = rf
                    .get("json_schema")
                    .and_then(Value::as_object)
                    .ok_or_else(|| ApiError::invalid("`response_format.json_schema` must be an object"))?;
                let schema = match js.get("schema") {
                    Some(s @ Value::Object(_)) => s.clone(),
                    None | Some(Value::Null) => json!({"type": "object"}),
                    Some(_) => {
                        return Err(ApiError::invalid(
                            "`response_format.json_schema.schema` must be an object",
                        ))
                    }
                };
                found.push(("response_format", Constraint::JsonSchema(schema)));
            }
            other => {
                return Err(ApiError::invalid(format!(
                "`response_format.type` {other:?} is not one of \"text\", \"json_object\", \"json_schema\""
            )))
            }
        }
    }
    for k in ["guided_json", "json_schema"] {
        match f.get(k) {
            None => {}
            Some(o @ Value::Object(_)) => found.push((k, Constraint::JsonSchema(o.clone()))),
            Some(Value::String(s)) => match serde_json::from_str::<Value>(s) {
                Ok(o @ Value::Object(_)) => found.push((k, Constraint::JsonSchema(o))),
                _ => return Err(ApiError::invalid(format!("`{k}` is not a JSON schema object"))),
            },
            Some(_) => return Err(ApiError::invalid(format!("`{k}` must be a JSON schema (an object)"))),
        }
    }
    for k in ["guided_regex", "regex"] {
        if let Some(r) = f.str(k)? {
            found.push((k, Constraint::Regex(r.to_owned())));
        }
    }
    if let Some(g) = f.str("guided_grammar")? {
        found.push(("guided_grammar", Constraint::Lark(g.to_owned())));
    }
    if let Some(c) = f.get("guided_choice") {
        let list: Option<Vec<String>> =
            c.as_array().map(|a| a.iter().filter_map(|x| x.as_str().map(str::to_owned)).collect());
        match list {
            Some(l) if !l.is_empty() && l.len() == c.as_array().map_or(0, Vec::len) => {
                found.push(("guided_choice", Constraint::Choice(l)))
            }
            _ => return Err(ApiError::invalid("`guided_choice` must be a non-empty array of strings")),
        }
    }
    match found.len() {
        0 | 1 => Ok(found.pop().map(|(_, c)| c)),
        _ => Err(ApiError::invalid(format!(
            "`{}` and `{}` both constrain the output; give one",
            found[0].0, found[1].0
        ))),
    }
}

fn parse_logit_bias(f: &Fields<'_>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = f.get("logit_bias") else { return Ok(Vec::new()) };
    let o = v
        .as_object()
        .ok_or_else(|| ApiError::invalid("`logit_bias` must be an object of token id -> bias"))?;
    if o.len() > 300 {
        return Err(ApiError::invalid("`logit_bias` takes at most 300 tokens"));
    }
    o.iter()
        .map(|(k, b)| {
            let id = k
                .parse::<u32>()
                .map_err(|_| ApiError::invalid(format!("`logit_bias` key {k:?} is not a token id")))?;
            match b.as_f64() {
                Some(b) if (-100.0..=100.0).contains(&b) => Ok((id, b as f32)),
                _ => {
                    Err(ApiError::invalid(format!("`logit_bias[{k}]` must be a number between -100 and 100")))
                }
            }
        })
        .collect()
}

fn parse_prompt(f: &Fields<'_>) -> Result<Prompt, ApiError> {
    Ok(match f.get("prompt") {
        Some(Value::String(s)) => Prompt::Text(s.clone()),
        Some(Value::Array(a))
            if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some_and(|t| t <= u64::from(u32::MAX))) =>
        {
            Prompt::Tokens(a.iter().filter_map(Value::as_u64).map(|t| t as u32).collect())
        }
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            Prompt::Text(a[0].as_str().unwrap_or("").to_owned())
        }
        Some(Value::Array(_)) => {
            return Err(ApiError::invalid(
                "`prompt` must be a string, one string in an array, or an array of token ids",
            ))
        }
        Some(_) => return Err(ApiError::invalid("`prompt` must be a string or an array of token ids")),
        None => return Err(ApiError::invalid("`prompt` is required")),
    })
}

fn parse_stop(f: &Fields<'_>) -> Result<(Vec<String>, Vec<u32>), ApiError> {
    let mut stop = Vec::new();
    let mut ids = Vec::new();
    match f.get("stop") {
        None => {}
        Some(Value::String(s)) => stop.push(s.clone()),
        Some(Value::Array(a)) => {
            for x in a {
                match x {
                    Value::String(s) => stop.push(s.clone()),
                    Value::Number(n) if n.as_u64().is_some_and(|t| t <= u64::from(u32::MAX)) => {
                        ids.push(n.as_u64().unwrap_or(0) as u32)
                    }
                    _ => {
                        return Err(ApiError::invalid(
                            "`stop` must be a string or an array of strings or token ids",
                        ))
                    }
                }
            }
        }
        Some(_) => return Err(ApiError::invalid("`stop` must be a string or an array of strings")),
    }
    if stop.len() > STOP_STRINGS_MAX || stop.iter().any(|s| s.is_empty() || s.len() > STOP_STRING_BYTES_MAX) {
        return Err(ApiError::invalid(format!(
            "`stop` takes at most {STOP_STRINGS_MAX} non-empty strings of at most {STOP_STRING_BYTES_MAX} bytes"
        )));
    }
    match f.get("stop_token_ids") {
        None => {}
        Some(Value::Array(a)) => {
            for t in a {
                let t = t
                    .as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| ApiError::invalid("`stop_token_ids` must be an array of token ids"))?;
                ids.push(t);
            }
        }
        Some(_) => return Err(ApiError::invalid("`stop_token_ids` must be an array of token ids")),
    }
    Ok((stop, ids))
}

/// Checks a chat-completions or completions body (or the chat body a Messages body stands for) and
/// reads it into a [`GenerateRequest`]. Every field is checked for type and range, and a field this
/// server does not know is refused (as OpenAI's API does), never silently ignored; errors name the
/// field. [`crate::parse_generate`] takes the raw bytes of any endpoint.
pub fn parse_value(endpoint: Endpoint, v: Value) -> Result<GenerateRequest, ApiError> {
    let obj = v.as_object().ok_or_else(|| ApiError::invalid("body must be a JSON object"))?;
    let own = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => CHAT_FIELDS,
        Endpoint::Completion => COMPLETION_FIELDS,
    };
    if let Some(k) = obj.keys().find(|k| !COMMON_FIELDS.contains(&k.as_str()) && !own.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!("unrecognized request argument supplied: `{k}`")));
    }
    let f = Fields(obj);
    let echo = f.bool("echo")?.unwrap_or(false);
    if echo && f.get("logprobs").is_some() {
        return Err(ApiError::invalid(
            "`echo` with `logprobs` is not supported: the prompt's log-probabilities are not computed",
        ));
    }
    let suffix = f.str("suffix")?.filter(|s| !s.is_empty()).map(str::to_owned);
    if suffix.is_some() && !matches!(f.get("prompt"), Some(Value::String(_))) {
        return Err(ApiError::invalid("`suffix` needs `prompt` as a string (the text before the gap)"));
    }
    let prompt = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => parse_messages(&f)?,
        Endpoint::Completion => parse_prompt(&f)?,
    };
    let n = f.u64("n")?.unwrap_or(1);
    if !(1..=u64::from(N_MAX)).contains(&n) || (n > 1 && endpoint == Endpoint::Messages) {
        return Err(ApiError::invalid(format!("`n` must be between 1 and {N_MAX}, got {n}")));
    }
    // A decode worker's handles: one per choice (an array when `n` > 1).
    let pd_handles = match f.get(HANDLE_FIELD) {
        None => Vec::new(),
        Some(Value::Array(list)) => list.iter().map(PdHandle::from_json).collect::<Result<Vec<_>, _>>()?,
        Some(h) => vec![PdHandle::from_json(h)?],
    };
    if !pd_handles.is_empty() && pd_handles.len() as u64 != n {
        return Err(ApiError::invalid(format!(
            "`{HANDLE_FIELD}` has {} handles for `n` = {n}",
            pd_handles.len()
        )));
    }
    let resume = f.get(RESUME_FIELD).filter(|v| !v.is_null()).map(Resume::from_json).transpose()?;
    // A moved request with several choices goes on only from the start (its tokens are per choice).
    if resume.as_ref().is_some_and(|r| !r.tokens.is_empty()) && n > 1 {
        return Err(ApiError::invalid(format!("`{RESUME_FIELD}` with tokens is for `n` = 1 only")));
    }
    if f.u64("best_of")?.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("`best_of` must be 1"));
    }
    let max_tokens = match f.u64("max_completion_tokens")? {
        Some(m) => Some(m),
        None => f.u64("max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(ApiError::invalid("`max_tokens` must be at least 1"));
    }
    let sampling = Sampling {
        temperature: f.ranged("temperature", 0.0, 2.0)?,
        top_p: match f.ranged("top_p", 0.0, 1.0)? {
            Some(0.0) => return Err(ApiError::invalid("`top_p` must be greater than 0")),
            p => p,
        },
        top_k: f
            .get("top_k")
            .map(|k| k.as_i64().ok_or_else(|| ApiError::invalid("`top_k` must be an integer")))
            .transpose()?,
        min_p: f.ranged("min_p", 0.0, 1.0)?,
        frequency_penalty: f.ranged("frequency_penalty", -2.0, 2.0)?,
        presence_penalty: f.ranged("presence_penalty", -2.0, 2.0)?,
        repetition_penalty: f.ranged("repetition_penalty", 0.01, 10.0)?,
    };
    let seed = match f.get("seed") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|x| x as u64))
                .ok_or_else(|| ApiError::invalid("`seed` must be an integer"))?,
        ),
    };
    let (stop, stop_token_ids) = parse_stop(&f)?;
    let include_usage = match f.get("stream_options") {
        Some(Value::Object(o)) => {
            let flag = |k: &str| match o.get(k) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(ApiError::invalid(format!("`stream_options.{k}` must be true or false"))),
            };
            for k in o.keys() {
                match k.as_str() {
                    // Padding against length side channels: these chunks carry none.
                    "include_usage" | "include_obfuscation" => {}
                    "continuous_usage_stats" if !flag(k)? => {}
                    "continuous_usage_stats" => {
                        return Err(ApiError::invalid(
                            "`stream_options.continuous_usage_stats` is not supported: usage comes once, at the end (`include_usage`)",
                        ))
                    }
                    other => return Err(ApiError::invalid(format!("`stream_options.{other}` is not supported"))),
                }
            }
            flag("include_usage")?
        }
        Some(_) => return Err(ApiError::invalid("`stream_options` must be an object")),
        None => false,
    };
    let (logprobs, top) = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => {
            (f.bool("logprobs")?.unwrap_or(false), f.u64("top_logprobs")?.unwrap_or(0))
        }
        // Completions: `logprobs` is the number of top alternatives.
        Endpoint::Completion => match f.u64("logprobs")? {
            Some(n) => (true, n),
            None => (false, 0),
        },
    };
    if top > u64::from(TOP_LOGPROBS_MAX) {
        return Err(ApiError::invalid(format!(
            "`top_logprobs` must be at most {TOP_LOGPROBS_MAX}, got {top}"
        )));
    }
    let tools = match endpoint {
        Endpoint::Chat | Endpoint::Messages | Endpoint::Responses => parse_tools(f.get("tools"))?,
        Endpoint::Completion => Vec::new(),
    };
    let tool_choice = parse_tool_choice(f.get("tool_choice"), &tools)?;
    let constraint = parse_constraint(&f)?;
    if constraint.is_some() && matches!(tool_choice, ToolChoice::Required | ToolChoice::Function(_)) {
        return Err(ApiError::invalid(
            "`tool_choice` requires a call, which is its own constraint: drop `response_format` or the guided field",
        ));
    }
    let min_tokens = f.u64("min_tokens")?.unwrap_or(0);
    if max_tokens.is_some_and(|m| m < min_tokens) {
        return Err(ApiError::invalid("`min_tokens` must not exceed `max_tokens`"));
    }
    let timeout_s = f.f64("timeout")?;
    if timeout_s.is_some_and(|t| t <= 0.0) {
        return Err(ApiError::invalid("`timeout` must be a positive number of seconds"));
    }
    let priority = match f.get("priority") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_i64()
            .and_then(|p| i32::try_from(p).ok())
            .ok_or_else(|| ApiError::invalid("`priority` must be an integer (lower is served first)"))?,
    };
    Ok(GenerateRequest {
        model: f.str("model")?.map(str::to_owned),
        prompt,
        max_tokens: max_tokens.map(|m| m.min(u64::from(u32::MAX)) as u32),
        sampling,
        seed,
        stop,
        stop_token_ids,
        stream: f.bool("stream")?.unwrap_or(false),
        include_usage,
        logprobs,
        top_logprobs: top as u32,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        timeout_s,
        n: n as u32,
        pd_handles,
        resume,
        parallel_tool_calls: f.bool("parallel_tool_calls")?.unwrap_or(true),
        chat_template_kwargs: parse_template_kwargs(&f)?,
        tools,
        tool_choice,
        constraint,
        min_tokens: min_tokens.min(u64::from(u32::MAX)) as u32,
        logit_bias: parse_logit_bias(&f)?,
        include_stop_str_in_output: f.bool("include_stop_str_in_output")?.unwrap_or(false),
        echo,
        suffix,
        priority,
    })
}

/// A `/tokenize` body: a prompt, or chat messages with their tools (rendered as a chat request
/// would be).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub tools: Vec<Tool>,
    pub chat_template_kwargs: Map<String, Value>,
}

fn object_with<'a>(body: &'a [u8], known: &[&str], v: &'a mut Value) -> Result<Fields<'a>, ApiError> {
    *v = serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("body is not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| ApiError::invalid("body must be a JSON object"))?;
    if let Some(k) = obj.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(ApiError::invalid(format!("unrecognized request argument supplied: `{k}`")));
    }
    Ok(Fields(obj))
}

/// Parses a `/tokenize` body (`prompt`, or `messages` and `tools`).
pub fn parse_tokenize(body: &[u8]) -> Result<TokenizeRequest, ApiError> {
    let mut v = Value::Null;
    let f = object_with(body, &["model", "prompt", "messages", "tools", "chat_template_kwargs"], &mut v)?;
    let prompt = match (f.get("messages"), f.get("prompt")) {
        (Some(_), None) => parse_messages(&f)?,
        (None, Some(_)) => parse_prompt(&f)?,
        _ => return Err(ApiError::invalid("give exactly one of `prompt` and `messages`")),
    };
    Ok(TokenizeRequest {
        model: f.str("model")?.map(str::to_owned),
        prompt,
        tools: parse_tools(f.get("tools"))?,
        chat_template_kwargs: parse_template_kwargs(&f)?,
    })
}

/// Parses a `/detokenize` body: `(model, tokens)`.
pub fn parse_detokenize(body: &[u8]) -> Result<(Option<String>, Vec<u32>), ApiError> {
    let mut v = Value::Null;
    let f = object_with(body, &["model", "tokens"], &mut v)?;
    let tokens = f
        .get("tokens")
        .and_then(Value::as_array)
        .and_then(|a| {
            a.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect::<Option<Vec<_>>>()
        })
        .ok_or_else(|| ApiError::invalid("`tokens` must be an array of token ids"))?;
    Ok((f.str("model")?.map(str::to_owned), tokens))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse_generate;

    /// vLLM's `priority`: an integer, 0 when absent; anything else is a 400 naming it.
    #[test]
    fn priority_is_an_integer() {
        let chat = |extra: &str| format!(r#"{{"messages": [{{"role": "user", "content": "x"}}]{extra}}}"#);
        assert_eq!(parse_generate(Endpoint::Chat, chat("").as_bytes()).unwrap().priority, 0);
        assert_eq!(
            parse_generate(Endpoint::Chat, chat(r#","priority": -3"#).as_bytes()).unwrap().priority,
            -3
        );
        let c = parse_generate(Endpoint::Completion, br#"{"prompt": "x", "priority": 7}"#).unwrap();
        assert_eq!(c.priority, 7);
        for bad in [r#","priority": "high""#, r#","priority": 1.5"#, r#","priority": 99999999999"#] {
            let e = parse_generate(Endpoint::Chat, chat(bad).as_bytes()).unwrap_err();
            assert!(e.message.contains("priority"), "{bad}: {e}");
        }
    }

    #[test]
    fn bodies_are_checked_field_by_field() {
        let bad = [
            (Endpoint::Chat, r#"{"messages": []}"#, "must not be empty"),
            (Endpoint::Chat, r#"{"messages": "hi"}"#, "must be an array"),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": true, "frobnicate": 1}}"#,
                "stream_options.frobnicate",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "stream_options": {"continuous_usage_stats": true}}"#,
                "continuous_usage_stats",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 1}"#,
                "must be an object",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#,
                "`temperature` must be a number",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "n": 17}"#,
                "`n` must be between 1 and 16",
            ),
            (Endpoint::Chat, r#"{"messages": [{"role": "user", "content": "x"}], "fancy": 1}"#, "`fancy`"),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x", "mood": "ok"}]}"#,
                "messages[0] has an unrecognized field `mood`",
            ),
            (Endpoint::Chat, r#"{"messages": [{"role": "tool", "content": "x"}]}"#, "tool_call_id"),
            (Endpoint::Completion, r#"{"prompt": "x", "tools": []}"#, "`tools`"),
            (
                Endpoint::Completion,
                r#"{"prompt": "x", "echo": true, "logprobs": 1}"#,
                "`echo` with `logprobs`",
            ),
            (Endpoint::Completion, r#"{"prompt": [1, 2], "suffix": "x"}"#, "`suffix` needs `prompt`"),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "yaml"}}"#,
                "yaml",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}, "guided_regex": "a+"}"#,
                "both constrain",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 300}}"#,
                "logit_bias[5]",
            ),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "min_tokens": 3}"#,
                "min_tokens",
            ),
            (Endpoint::Chat, r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, "role"),
            (Endpoint::Completion, r#"{"prompt": 5}"#, "`prompt` must be"),
            (Endpoint::Completion, r#"{"prompt": "x", "max_tokens": 0}"#, "at least 1"),
            (Endpoint::Completion, r#"{"prompt": "x", "top_p": 3}"#, "between"),
            (Endpoint::Completion, r#"{"prompt": "x", "stop_token_ids": ["a"]}"#, "stop_token_ids"),
            (Endpoint::Completion, r#"[1, 2]"#, "JSON object"),
            (Endpoint::Completion, r#"{"prompt": "x""#, "not valid JSON"),
            (Endpoint::Completion, r#"{"prompt": "x", "pd_transfer": {"addr": 1}}"#, "pd_transfer.addr"),
        ];
        for (ep, body, want) in bad {
            let err = parse_generate(ep, body.as_bytes()).unwrap_err();
            assert!(err.message.contains(want), "{body}: {}", err.message);
            assert_eq!(err.status(), 400);
        }
        let g = parse_generate(
            Endpoint::Chat,
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 5, "stop": ["a", 7], "stream": true, "stream_options": {"include_usage": true},
                "logprobs": true, "top_logprobs": 3, "seed": 9, "temperature": 0.5, "user": "u-1", "metadata": {"a": "b"}}"#,
        )
        .unwrap();
        assert_eq!(g.prompt, Prompt::Messages(vec![Message::new("user", "hi")]));
        assert_eq!(
            (g.max_tokens, g.stop.clone(), g.stop_token_ids.clone()),
            (Some(5), vec!["a".to_owned()], vec![7])
        );
        assert!(g.stream && g.include_usage && g.logprobs);
        assert_eq!(
            (g.top_logprobs, g.seed, g.sampling.temperature, g.sampling.top_p),
            (3, Some(9), Some(0.5), None)
        );
    }

    #[test]
    fn tool_conversations_and_constraints_are_read() {
        let g = parse_generate(
            Endpoint::Chat,
            br#"{"messages": [{"role": "user", "content": "Read a.txt"},
                   {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function",
                     "function": {"name": "read_file", "arguments": "{\"path\": \"a.txt\"}"}}]},
                   {"role": "tool", "tool_call_id": "c1", "content": "hello"}],
                 "tools": [{"type": "function", "function": {"name": "read_file"}}],
                 "tool_choice": "required", "parallel_tool_calls": false}"#,
        )
        .unwrap();
        let Prompt::Messages(m) = &g.prompt else { panic!() };
        assert_eq!(m[1].tool_calls[0].name, "read_file");
        assert_eq!(m[2].tool_call_id.as_deref(), Some("c1"));
        assert_eq!(
            (g.tool_choice.clone(), g.parallel_tool_calls, g.tools.len()),
            (ToolChoice::Required, false, 1)
        );
        let g = parse_generate(
            Endpoint::Chat,
            br#"{"messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}, "strict": true}}}"#,
        )
        .unwrap();
        assert_eq!(
            g.constraint,
            Some(Constraint::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "integer"}}})))
        );
        let g = parse_generate(
            Endpoint::Completion,
            br#"{"prompt": "x", "guided_choice": ["yes", "no"], "logit_bias": {"7": -100}}"#,
        )
        .unwrap();
        assert_eq!(
            (g.constraint, g.logit_bias),
            (Some(Constraint::Choice(vec!["yes".into(), "no".into()])), vec![(7, -100.0)])
        );
    }
}
