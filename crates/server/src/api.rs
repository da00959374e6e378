//! The OpenAI-compatible request bodies, checked field by field, and the response bodies.

use pdserve_model::SamplingParams;
use serde_json::{json, Map, Value};

use crate::error::ApiError;

/// Which endpoint a generation came from; it decides the response shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Endpoint {
    Chat,
    Completion,
}

/// What to feed the model.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Prompt {
    /// Chat messages (role, content), rendered through the chat template.
    Messages(Vec<(String, String)>),
    Text(String),
    Tokens(Vec<u32>),
}

/// A parsed generation request.
#[derive(Debug, Clone)]
pub(crate) struct Generate {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    pub params: SamplingParams,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: bool,
    pub ignore_eos: bool,
    /// Seconds, from the body's `timeout`.
    pub timeout_s: Option<f64>,
    /// Decode role: the prefill worker's handle (`pd_transfer` in the body).
    pub pd_transfer: Option<PdHandle>,
}

/// What a prefill worker answers and a decode worker takes: where the prompt's KV is and what came of
/// the prompt.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct PdHandle {
    pub transfer: u64,
    pub epoch: u32,
    pub addr: std::net::SocketAddr,
    pub first_token: u32,
    pub prompt_tokens: Vec<u32>,
    /// The prefill worker's shared KV file, when it has one (same-host transfers copy from it).
    pub shm: Option<String>,
    /// The prefill worker's stage timings, passed through to the decode worker's report.
    pub timings: Option<Value>,
}

impl PdHandle {
    pub(crate) fn to_json(&self, blocks: usize) -> Value {
        json!({"transfer": self.transfer, "epoch": self.epoch, "addr": self.addr.to_string(),
               "first_token": self.first_token, "prompt_tokens": self.prompt_tokens, "blocks": blocks,
               "shm": self.shm})
    }

    fn parse(v: &Value) -> Result<PdHandle, ApiError> {
        let bad = |f: &str| invalid(format!("`pd_transfer.{f}` is missing or has the wrong type"));
        Ok(PdHandle {
            transfer: v.get("transfer").and_then(Value::as_u64).ok_or_else(|| bad("transfer"))?,
            epoch: v
                .get("epoch")
                .and_then(Value::as_u64)
                .and_then(|e| u32::try_from(e).ok())
                .ok_or_else(|| bad("epoch"))?,
            addr: v
                .get("addr")
                .and_then(Value::as_str)
                .and_then(|a| a.parse().ok())
                .ok_or_else(|| bad("addr"))?,
            first_token: v
                .get("first_token")
                .and_then(Value::as_u64)
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| bad("first_token"))?,
            prompt_tokens: v
                .get("prompt_tokens")
                .and_then(Value::as_array)
                .and_then(|a| a.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect())
                .ok_or_else(|| bad("prompt_tokens"))?,
            shm: v.get("shm").and_then(Value::as_str).map(str::to_owned),
            timings: v.get("timings").filter(|t| t.is_object()).cloned(),
        })
    }
}

fn invalid(msg: String) -> ApiError {
    ApiError::invalid(msg)
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, k: &str) -> Option<&Value> {
        self.0.get(k).filter(|v| !v.is_null())
    }
    fn f64(&self, k: &str) -> Result<Option<f64>, ApiError> {
        self.get(k)
            .map(|v| {
                v.as_f64().filter(|x| x.is_finite()).ok_or_else(|| invalid(format!("`{k}` must be a number")))
            })
            .transpose()
    }
    fn u64(&self, k: &str) -> Result<Option<u64>, ApiError> {
        self.get(k)
            .map(|v| v.as_u64().ok_or_else(|| invalid(format!("`{k}` must be a non-negative integer"))))
            .transpose()
    }
    fn bool(&self, k: &str) -> Result<Option<bool>, ApiError> {
        self.get(k)
            .map(|v| v.as_bool().ok_or_else(|| invalid(format!("`{k}` must be true or false"))))
            .transpose()
    }
    fn str(&self, k: &str) -> Result<Option<&str>, ApiError> {
        self.get(k).map(|v| v.as_str().ok_or_else(|| invalid(format!("`{k}` must be a string")))).transpose()
    }
}

fn range(name: &str, v: f64, lo: f64, hi: f64) -> Result<f64, ApiError> {
    if (lo..=hi).contains(&v) {
        Ok(v)
    } else {
        Err(invalid(format!("`{name}` must be between {lo} and {hi}, got {v}")))
    }
}

/// Parses a chat-completions or completions body.
pub(crate) fn parse_generate(endpoint: Endpoint, body: &[u8]) -> Result<Generate, ApiError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| invalid(format!("body is not valid JSON: {e}")))?;
    let obj = v.as_object().ok_or_else(|| invalid("body must be a JSON object".into()))?;
    let f = Fields(obj);
    let prompt = match endpoint {
        Endpoint::Chat => {
            let msgs = f.get("messages").ok_or_else(|| invalid("`messages` is required".into()))?;
            let msgs = msgs.as_array().ok_or_else(|| invalid("`messages` must be an array".into()))?;
            if msgs.is_empty() {
                return Err(invalid("`messages` must not be empty".into()));
            }
            let mut out = Vec::with_capacity(msgs.len());
            for (i, m) in msgs.iter().enumerate() {
                let role = m
                    .get("role")
                    .and_then(Value::as_str)
                    .ok_or_else(|| invalid(format!("messages[{i}].role must be a string")))?;
                if !matches!(role, "system" | "user" | "assistant" | "tool" | "developer") {
                    return Err(invalid(format!(
                        "messages[{i}].role {role:?} is not one of system, user, assistant, tool"
                    )));
                }
                let content = match m.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    Some(Value::Array(parts)) => {
                        let mut text = String::new();
                        for p in parts {
                            match (
                                p.get("type").and_then(Value::as_str),
                                p.get("text").and_then(Value::as_str),
                            ) {
                                (Some("text"), Some(t)) => text.push_str(t),
                                _ => {
                                    return Err(invalid(format!(
                                        "messages[{i}].content: only text parts are supported"
                                    )))
                                }
                            }
                        }
                        text
                    }
                    Some(Value::Null) | None if role == "assistant" => String::new(),
                    _ => {
                        return Err(invalid(format!(
                            "messages[{i}].content must be a string or an array of text parts"
                        )))
                    }
                };
                out.push((role.to_owned(), content));
            }
            Prompt::Messages(out)
        }
        Endpoint::Completion => match f.get("prompt") {
            Some(Value::String(s)) => Prompt::Text(s.clone()),
            Some(Value::Array(a))
                if !a.is_empty() && a.iter().all(|x| x.as_u64().is_some_and(|t| t <= u32::MAX as u64)) =>
            {
                Prompt::Tokens(a.iter().filter_map(Value::as_u64).map(|t| t as u32).collect())
            }
            Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
                Prompt::Text(a[0].as_str().unwrap_or("").to_owned())
            }
            Some(Value::Array(_)) => {
                return Err(invalid(
                    "`prompt` must be a string, one string in an array, or an array of token ids".into(),
                ))
            }
            Some(_) => return Err(invalid("`prompt` must be a string or an array of token ids".into())),
            None => return Err(invalid("`prompt` is required".into())),
        },
    };
    let n = f.u64("n")?.unwrap_or(1);
    if n != 1 {
        return Err(invalid(format!("`n` must be 1 (got {n}); send separate requests for more choices")));
    }
    if f.u64("best_of")?.is_some_and(|b| b != 1) {
        return Err(invalid("`best_of` must be 1".into()));
    }
    let max_tokens = match f.u64("max_completion_tokens")? {
        Some(m) => Some(m),
        None => f.u64("max_tokens")?,
    };
    if max_tokens == Some(0) {
        return Err(invalid("`max_tokens` must be at least 1".into()));
    }
    let mut params = SamplingParams::default();
    if let Some(t) = f.f64("temperature")? {
        params.temperature = range("temperature", t, 0.0, 2.0)? as f32;
    }
    if let Some(p) = f.f64("top_p")? {
        params.top_p = range("top_p", p, 0.0, 1.0)? as f32;
        if params.top_p == 0.0 {
            return Err(invalid("`top_p` must be greater than 0".into()));
        }
    }
    if let Some(k) = f.get("top_k") {
        let k = k.as_i64().ok_or_else(|| invalid("`top_k` must be an integer".into()))?;
        params.top_k = if k <= 0 { 0 } else { k as usize };
    }
    if let Some(m) = f.f64("min_p")? {
        params.min_p = range("min_p", m, 0.0, 1.0)? as f32;
    }
    if let Some(p) = f.f64("frequency_penalty")? {
        params.frequency_penalty = range("frequency_penalty", p, -2.0, 2.0)? as f32;
    }
    if let Some(p) = f.f64("presence_penalty")? {
        params.presence_penalty = range("presence_penalty", p, -2.0, 2.0)? as f32;
    }
    if let Some(p) = f.f64("repetition_penalty")? {
        params.repetition_penalty = range("repetition_penalty", p, 0.01, 10.0)? as f32;
    }
    let seed = match f.get("seed") {
        None => None,
        Some(v) => Some(
            v.as_u64()
                .or_else(|| v.as_i64().map(|x| x as u64))
                .ok_or_else(|| invalid("`seed` must be an integer".into()))?,
        ),
    };
    let mut stop = Vec::new();
    let mut stop_token_ids = Vec::new();
    match f.get("stop") {
        None => {}
        Some(Value::String(s)) => stop.push(s.clone()),
        Some(Value::Array(a)) => {
            for x in a {
                match x {
                    Value::String(s) => stop.push(s.clone()),
                    Value::Number(n) if n.as_u64().is_some() => {
                        stop_token_ids.push(n.as_u64().unwrap_or(0) as u32)
                    }
                    _ => {
                        return Err(invalid(
                            "`stop` must be a string or an array of strings or token ids".into(),
                        ))
                    }
                }
            }
        }
        Some(_) => return Err(invalid("`stop` must be a string or an array of strings".into())),
    }
    if stop.len() > 16 || stop.iter().any(|s| s.is_empty() || s.len() > 256) {
        return Err(invalid("`stop` takes at most 16 non-empty strings of at most 256 bytes".into()));
    }
    if let Some(Value::Array(a)) = f.get("stop_token_ids") {
        stop_token_ids.extend(a.iter().filter_map(Value::as_u64).map(|t| t as u32));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = match f.get("stream_options") {
        Some(o) => o.get("include_usage").and_then(Value::as_bool).unwrap_or(false),
        None => false,
    };
    let (logprobs, top) = match endpoint {
        Endpoint::Chat => (f.bool("logprobs")?.unwrap_or(false), f.u64("top_logprobs")?.unwrap_or(0)),
        // Completions: `logprobs` is the number of top alternatives.
        Endpoint::Completion => match f.u64("logprobs")? {
            Some(n) => (true, n),
            None => (false, 0),
        },
    };
    if top > 20 {
        return Err(invalid(format!("`top_logprobs` must be at most 20, got {top}")));
    }
    params.top_logprobs = top as usize;
    let timeout_s = f.f64("timeout")?;
    if timeout_s.is_some_and(|t| t <= 0.0) {
        return Err(invalid("`timeout` must be a positive number of seconds".into()));
    }
    Ok(Generate {
        model: f.str("model")?.map(str::to_owned),
        prompt,
        max_tokens: max_tokens.map(|m| m as usize),
        params,
        seed,
        stop,
        stop_token_ids,
        stream,
        include_usage,
        logprobs,
        ignore_eos: f.bool("ignore_eos")?.unwrap_or(false),
        timeout_s,
        pd_transfer: f.get("pd_transfer").map(PdHandle::parse).transpose()?,
    })
}

/// One generated token's log-probability information, already turned into text.
#[derive(Debug, Clone)]
pub(crate) struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

fn bytes_of(s: &str) -> Value {
    Value::Array(s.bytes().map(|b| json!(b)).collect())
}

/// The `logprobs` object of a choice.
pub(crate) fn logprobs_json(endpoint: Endpoint, lps: &[TokenLogprob]) -> Value {
    match endpoint {
        Endpoint::Chat => json!({ "content": lps.iter().map(|l| json!({
            "token": l.token, "logprob": l.logprob, "bytes": bytes_of(&l.token),
            "top_logprobs": l.top.iter().map(|(t, p)| json!({"token": t, "logprob": p, "bytes": bytes_of(t)})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>() }),
        Endpoint::Completion => {
            let mut offset = 0;
            let mut offsets = Vec::new();
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
#[derive(Debug, Clone)]
pub(crate) struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
}

pub(crate) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// A whole non-streaming response.
pub(crate) fn full_response(
    endpoint: Endpoint,
    meta: &Meta,
    text: &str,
    finish_reason: &str,
    logprobs: Option<Value>,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> Value {
    let choice = match endpoint {
        Endpoint::Chat => json!({"index": 0, "message": {"role": "assistant", "content": text},
                                  "logprobs": logprobs, "finish_reason": finish_reason}),
        Endpoint::Completion => {
            json!({"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason})
        }
    };
    json!({
        "id": meta.id,
        "object": if endpoint == Endpoint::Chat { "chat.completion" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
        "usage": usage(prompt_tokens, completion_tokens),
    })
}

/// One streaming chunk. `text: None` with `first` sends the assistant role (chat).
pub(crate) fn chunk(
    endpoint: Endpoint,
    meta: &Meta,
    text: Option<&str>,
    first: bool,
    finish_reason: Option<&str>,
    logprobs: Option<Value>,
) -> Value {
    let choice = match endpoint {
        Endpoint::Chat => {
            let mut delta = Map::new();
            if first {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason})
        }
        Endpoint::Completion => {
            json!({"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish_reason})
        }
    };
    json!({
        "id": meta.id,
        "object": if endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [choice],
    })
}

/// The usage chunk of `stream_options.include_usage`: no choices.
pub(crate) fn usage_chunk(endpoint: Endpoint, meta: &Meta, prompt: usize, completion: usize) -> Value {
    json!({
        "id": meta.id,
        "object": if endpoint == Endpoint::Chat { "chat.completion.chunk" } else { "text_completion" },
        "created": meta.created,
        "model": meta.model,
        "choices": [],
        "usage": usage(prompt, completion),
    })
}

/// Splits `pending` at the first stop string: `(text to emit, stopped)`. Without a stop, the longest
/// tail that could still become a stop string is held back in `pending`.
pub(crate) fn apply_stop(pending: &mut String, stops: &[String]) -> (String, bool) {
    if stops.is_empty() {
        return (std::mem::take(pending), false);
    }
    if let Some(at) = stops.iter().filter_map(|s| pending.find(s.as_str())).min() {
        let out = pending[..at].to_owned();
        pending.clear();
        return (out, true);
    }
    let mut keep = 0;
    for s in stops {
        for k in (1..s.len().min(pending.len() + 1)).rev() {
            if pending.is_char_boundary(pending.len() - k)
                && s.is_char_boundary(k)
                && pending.ends_with(&s[..k])
            {
                keep = keep.max(k);
                break;
            }
        }
    }
    let cut = pending.len() - keep;
    let out = pending[..cut].to_owned();
    pending.drain(..cut);
    (out, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_hold_back_possible_prefixes() {
        let stops = vec!["END".to_owned(), "\n\n".to_owned()];
        let mut p = String::from("hello E");
        assert_eq!(apply_stop(&mut p, &stops), ("hello ".into(), false));
        assert_eq!(p, "E");
        p.push_str("NDING");
        assert_eq!(apply_stop(&mut p, &stops), ("".into(), true));
        let mut p = String::from("a\nb\n");
        assert_eq!(apply_stop(&mut p, &stops), ("a\nb".into(), false));
        let mut p = String::from("x");
        assert_eq!(apply_stop(&mut p, &[]), ("x".into(), false));
    }

    #[test]
    fn bodies_are_checked_field_by_field() {
        let bad = [
            (Endpoint::Chat, r#"{"messages": []}"#, "must not be empty"),
            (Endpoint::Chat, r#"{"messages": "hi"}"#, "must be an array"),
            (
                Endpoint::Chat,
                r#"{"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}"#,
                "`temperature` must be a number",
            ),
            (Endpoint::Chat, r#"{"messages": [{"role": "user", "content": "x"}], "n": 2}"#, "`n` must be 1"),
            (Endpoint::Chat, r#"{"messages": [{"role": "wizard", "content": "x"}]}"#, "role"),
            (Endpoint::Completion, r#"{"prompt": 5}"#, "`prompt` must be"),
            (Endpoint::Completion, r#"{"prompt": "x", "max_tokens": 0}"#, "at least 1"),
            (Endpoint::Completion, r#"{"prompt": "x", "top_p": 3}"#, "between"),
            (Endpoint::Completion, r#"[1, 2]"#, "JSON object"),
            (Endpoint::Completion, r#"{"prompt": "x""#, "not valid JSON"),
        ];
        for (ep, body, want) in bad {
            let err = parse_generate(ep, body.as_bytes()).unwrap_err();
            assert!(err.message.contains(want), "{body}: {}", err.message);
            assert_eq!(err.status, 400);
        }
        let g = parse_generate(
            Endpoint::Chat,
            br#"{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 5, "stop": ["a", 7], "stream": true, "stream_options": {"include_usage": true},
                "logprobs": true, "top_logprobs": 3, "seed": 9, "unknown_field": {"ignored": true}}"#,
        )
        .unwrap();
        assert_eq!(g.prompt, Prompt::Messages(vec![("user".into(), "hi".into())]));
        assert_eq!(
            (g.max_tokens, g.stop.clone(), g.stop_token_ids.clone()),
            (Some(5), vec!["a".to_owned()], vec![7])
        );
        assert!(g.stream && g.include_usage && g.logprobs);
        assert_eq!((g.params.top_logprobs, g.seed), (3, Some(9)));
    }
}
