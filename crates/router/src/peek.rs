//! What the router reads from a request body: only the fields routing needs (`stream`, `timeout`, the
//! prompt text for cache-aware routing), without building a JSON tree. (The decode leg's body is made
//! by `pdserve_api::pd::splice_handle`.)

use serde::Deserialize;

use crate::RouterError;
use std::borrow::Cow;

/// The routing view of an OpenAI completion or chat request body.
#[derive(Debug, Default, PartialEq)]
pub struct Peek {
    pub stream: bool,
    /// The client's `timeout`, in seconds.
    pub timeout_s: Option<f64>,
    /// The prompt text (chat messages' contents joined with newlines), for cache-aware routing.
    pub prompt: String,
    /// vLLM's `priority` (lower first in the router's queue; 0 when absent).
    pub priority: i32,
}

#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    timeout: Option<f64>,
    #[serde(default)]
    priority: Option<serde_json::Value>,
    #[serde(default, borrow)]
    messages: Option<Vec<RawMessage<'a>>>,
    /// Anthropic's Messages API: the system prompt beside the messages.
    #[serde(default, borrow)]
    system: Option<Shape<'a>>,
    #[serde(default, borrow)]
    prompt: Option<Shape<'a>>,
    /// Set only by the router on a decode leg: a client's would make a decode worker connect where
    /// the client says.
    #[serde(default, rename = "pd_transfer", deserialize_with = "present")]
    handle: bool,
    /// Set only by the router on a moved request: a client's would claim output it never got.
    #[serde(default, rename = "pd_resume", deserialize_with = "present")]
    resume: bool,
    /// Set only by the router on a Responses request it expanded: a client's would pass off its
    /// own conversation as stored.
    #[serde(default, rename = "pd_conversation", deserialize_with = "present")]
    conversation: bool,
    /// The Responses API: `instructions`, then `input` (a string, or items whose `content` is text).
    #[serde(default, borrow)]
    instructions: Option<Shape<'a>>,
    #[serde(default, borrow)]
    input: Option<Shape<'a>>,
}

/// True for any value (null included): the member is there.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    serde::de::IgnoredAny::deserialize(d).map(|_| true)
}

#[derive(Deserialize)]
struct RawMessage<'a> {
    #[serde(default, borrow)]
    content: Option<Shape<'a>>,
}

/// A JSON value as routing reads it, without building a tree: text, a token id, a list, an object
/// (only its `text` member kept: a chat content part), or anything else. Dispatched on the JSON token
/// itself (serde's untagged enums would first copy the value into a buffer to try each variant).
enum Shape<'a> {
    Text(Cow<'a, str>),
    Token(u64),
    List(Vec<Shape<'a>>),
    /// An object with a `text` member (a content part) or without one.
    Part(Option<Cow<'a, str>>),
    /// An object with no `text` but a `content` member of text (a Responses input item).
    Item(Cow<'a, str>),
    Other,
}

impl<'de: 'a, 'a> Deserialize<'de> for Shape<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> serde::de::Visitor<'de> for V<'a> {
            type Value = Shape<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_borrowed_str<E: serde::de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Shape::Text(Cow::Borrowed(v)))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Shape::Text(Cow::Owned(v.to_owned())))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Shape::Token(v))
            }
            fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
                Ok(Shape::Other)
            }
            fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
                Ok(Shape::Other)
            }
            fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
                Ok(Shape::Other)
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
                Ok(Shape::Other)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let mut items = Vec::new();
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Shape::List(items))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
                let (mut text, mut content) = (None, None);
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    match (key.as_ref(), map.next_value::<Shape<'de>>()?) {
                        ("text", Shape::Text(t)) => text = Some(t),
                        ("content", Shape::Text(t)) => content = Some(t),
                        ("content", Shape::List(parts)) => {
                            let mut joined = String::new();
                            for p in parts {
                                if let Shape::Part(Some(t)) = p {
                                    push_line(&mut joined, &t);
                                }
                            }
                            content = Some(Cow::Owned(joined));
                        }
                        _ => {}
                    }
                }
                Ok(match (text, content) {
                    (None, Some(c)) => Shape::Item(c),
                    (text, _) => Shape::Part(text),
                })
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// Reads the routing fields of `body`. Unknown fields are skipped, not checked: the worker validates the
/// whole request.
pub fn peek(body: &[u8]) -> Result<Peek, RouterError> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(RouterError::NotAnObject);
    }
    let raw: Raw<'_> =
        serde_json::from_slice(body).map_err(|e| RouterError::NotJson { reason: e.to_string() })?;
    if raw.handle {
        return Err(RouterError::InternalField { field: pdserve_api::pd::HANDLE_FIELD });
    }
    if raw.resume {
        return Err(RouterError::InternalField { field: pdserve_api::pd::RESUME_FIELD });
    }
    if raw.conversation {
        return Err(RouterError::InternalField { field: pdserve_codec::responses::CONVERSATION_FIELD });
    }
    if let Some(t) = raw.timeout {
        if !(t.is_finite() && t > 0.0) {
            return Err(RouterError::BadTimeout { seconds: t });
        }
    }
    let mut prompt = String::new();
    if let Some(messages) = &raw.messages {
        for content in raw.system.iter().chain(messages.iter().filter_map(|m| m.content.as_ref())) {
            match content {
                Shape::Text(t) => push_line(&mut prompt, t),
                Shape::List(parts) => {
                    for p in parts {
                        if let Shape::Part(Some(t)) = p {
                            push_line(&mut prompt, t);
                        }
                    }
                }
                _ => return Err(RouterError::BadContent),
            }
        }
    } else if let Some(input) = &raw.input {
        if let Some(Shape::Text(t)) = &raw.instructions {
            push_line(&mut prompt, t);
        }
        match input {
            Shape::Text(t) => push_line(&mut prompt, t),
            Shape::List(items) => {
                for i in items {
                    if let Shape::Part(Some(t)) | Shape::Item(t) = i {
                        push_line(&mut prompt, t);
                    }
                }
            }
            _ => {}
        }
    } else if let Some(Shape::Text(t)) = &raw.prompt {
        prompt.push_str(t);
    } else if let Some(Shape::List(items)) = &raw.prompt {
        // A uniform array only, as the API allows (strings, or token ids); others route as no text.
        if items.iter().all(|i| matches!(i, Shape::Text(_))) {
            items
                .iter()
                .filter_map(|i| if let Shape::Text(t) = i { Some(t) } else { None })
                .for_each(|t| push_line(&mut prompt, t));
        } else if items.iter().all(|i| matches!(i, Shape::Token(_))) {
            for i in items {
                if let Shape::Token(id) = i {
                    prompt.push_str(&id.to_string());
                    prompt.push(' ');
                }
            }
        }
    }
    let priority = match &raw.priority {
        None | Some(serde_json::Value::Null) => 0,
        Some(v) => v.as_i64().and_then(|p| i32::try_from(p).ok()).ok_or(RouterError::BadPriority)?,
    };
    Ok(Peek { stream: raw.stream.unwrap_or(false), timeout_s: raw.timeout, prompt, priority })
}

fn push_line(out: &mut String, t: &str) {
    if !out.is_empty() {
        out.push('\n');
    }
    out.push_str(t);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_fields() {
        let p = peek(br#"{"model":"m","stream":true,"timeout":2.5,"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}],"extra":{"a":[1,2]}}"#).unwrap();
        assert_eq!(
            p,
            Peek { stream: true, timeout_s: Some(2.5), prompt: "Be brief.\nHi".into(), priority: 0 }
        );
        // Anthropic's Messages: the system prompt first; tool blocks carry no routing text.
        let p = peek(br#"{"system":"Be brief.","messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":[{"type":"tool_use","id":"t","name":"f","input":{}}]},{"role":"user","content":[{"type":"tool_result","tool_use_id":"t","content":"x"}]}]}"#).unwrap();
        assert_eq!(p.prompt, "Be brief.\nHi");
    }

    #[test]
    fn responses_input() {
        let p = peek(br#"{"instructions":"Be brief.","input":"Hi"}"#).unwrap();
        assert_eq!(p.prompt, "Be brief.\nHi");
        let p = peek(br#"{"input":[{"role":"user","content":"Hi"},{"type":"function_call","call_id":"c","name":"f","arguments":"{}"},{"role":"user","content":[{"type":"input_text","text":"there"}]}]}"#).unwrap();
        assert_eq!(p.prompt, "Hi\nthere");
        let body = br#"{"input":"x","pd_conversation":true}"#;
        assert_eq!(peek(body), Err(RouterError::InternalField { field: "pd_conversation" }));
    }

    #[test]
    fn completion_prompts() {
        assert_eq!(peek(br#"{"prompt":"Once upon"}"#).unwrap().prompt, "Once upon");
        assert_eq!(peek(br#"{"prompt":[1,2,3]}"#).unwrap().prompt, "1 2 3 ");
        assert_eq!(peek(br#"{"prompt":"a\u00e9\"b"}"#).unwrap().prompt, "a\u{e9}\"b");
        assert!(!peek(br#"{}"#).unwrap().stream);
        assert_eq!(peek(br#"{"prompt":["a","b\n"]}"#).unwrap().prompt, "a\nb\n");
        // Arrays the API does not define route as no text; the worker answers them.
        assert_eq!(peek(br#"{"prompt":["a",1]}"#).unwrap().prompt, "");
        assert_eq!(peek(br#"{"prompt":[[1,2],[3]]}"#).unwrap().prompt, "");
        assert_eq!(
            peek(br#"{"prompt":{"x":[1]},"stream":true}"#).unwrap(),
            Peek { stream: true, ..Peek::default() }
        );
        assert_eq!(peek(br#"{"prompt":null}"#).unwrap().prompt, "");
    }

    #[test]
    fn bad_bodies_are_named() {
        assert!(matches!(peek(b"{not json"), Err(RouterError::NotJson { .. })));
        assert!(matches!(peek(br#"{"stream":"yes"}"#), Err(RouterError::NotJson { .. })));
        assert_eq!(peek(br#"{"timeout":-1}"#), Err(RouterError::BadTimeout { seconds: -1.0 }));
        assert_eq!(peek(b"[1]"), Err(RouterError::NotAnObject));
        assert_eq!(peek(br#"{"messages":[{"content":true}]}"#), Err(RouterError::BadContent));
        assert_eq!(peek(br#"{"messages":[{"content":7}]}"#), Err(RouterError::BadContent));
        // A client's KV handle (even null) never reaches a worker.
        for body in [
            &br#"{"prompt":"x","pd_transfer":{"addr":"10.0.0.1:9","transfer":1,"epoch":1}}"#[..],
            br#"{"pd_transfer":null}"#,
        ] {
            assert_eq!(peek(body), Err(RouterError::InternalField { field: "pd_transfer" }));
        }
        let body = br#"{"prompt":"x","pd_resume":{"request_id":"r","tokens":[1]}}"#;
        assert_eq!(peek(body), Err(RouterError::InternalField { field: "pd_resume" }));
    }
}
