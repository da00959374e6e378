//! What the router reads from a request body: only the fields routing needs (`stream`, `timeout`, the
//! prompt text for cache-aware routing), without building a JSON tree; and the decode leg's body, made
//! by splicing the prefill worker's KV handle into the client's bytes.

use serde::Deserialize;
use std::borrow::Cow;

/// The routing view of an OpenAI completion or chat request body.
#[derive(Debug, Default, PartialEq)]
pub struct Peek {
    pub stream: bool,
    /// The client's `timeout`, in seconds.
    pub timeout_s: Option<f64>,
    /// The prompt text (chat messages' contents joined with newlines), for cache-aware routing.
    pub prompt: String,
}

#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    timeout: Option<f64>,
    #[serde(default, borrow)]
    messages: Option<Vec<RawMessage<'a>>>,
    #[serde(default, borrow)]
    prompt: Option<Shape<'a>>,
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
    Part(Option<Cow<'a, str>>),
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
                let mut text = None;
                while let Some(key) = map.next_key::<Cow<'de, str>>()? {
                    if let ("text", Shape::Text(t)) = (key.as_ref(), map.next_value::<Shape<'de>>()?) {
                        text = Some(t);
                    }
                }
                Ok(Shape::Part(text))
            }
        }
        d.deserialize_any(V(std::marker::PhantomData))
    }
}

/// Reads the routing fields of `body`. Unknown fields are skipped, not checked: the worker validates the
/// whole request. Errors name what is wrong, for a 400.
pub fn peek(body: &[u8]) -> Result<Peek, String> {
    if body.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err("request body must be a JSON object".to_owned());
    }
    let raw: Raw<'_> =
        serde_json::from_slice(body).map_err(|e| format!("request body is not valid JSON: {e}"))?;
    if let Some(t) = raw.timeout {
        if !(t.is_finite() && t > 0.0) {
            return Err(format!("`timeout` must be a positive number of seconds, got {t}"));
        }
    }
    let mut prompt = String::new();
    if let Some(messages) = &raw.messages {
        for m in messages {
            match &m.content {
                Some(Shape::Text(t)) => push_line(&mut prompt, t),
                Some(Shape::List(parts)) => {
                    for p in parts {
                        if let Shape::Part(Some(t)) = p {
                            push_line(&mut prompt, t);
                        }
                    }
                }
                None => {}
                Some(_) => {
                    return Err("a message's `content` must be a string or an array of content parts".into())
                }
            }
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
    Ok(Peek { stream: raw.stream.unwrap_or(false), timeout_s: raw.timeout, prompt })
}

fn push_line(out: &mut String, t: &str) {
    if !out.is_empty() {
        out.push('\n');
    }
    out.push_str(t);
}

/// The decode leg's body: the client's JSON object with `"pd_transfer": handle` added as its first
/// member. `handle` is the prefill worker's JSON value, as bytes. `None` if `body` is not an object.
pub fn with_pd_transfer(body: &[u8], handle: &[u8]) -> Option<Vec<u8>> {
    let open = body.iter().position(|b| !b.is_ascii_whitespace())?;
    if body[open] != b'{' {
        return None;
    }
    let rest = &body[open + 1..];
    let empty = rest.iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(body.len() + handle.len() + 20);
    out.extend_from_slice(b"{\"pd_transfer\":");
    out.extend_from_slice(handle);
    if !empty {
        out.push(b',');
    }
    out.extend_from_slice(rest);
    Some(out)
}

/// The raw bytes of the `pd_transfer` member of a prefill worker's answer.
pub fn pd_handle(prefill_answer: &[u8]) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Answer<'a> {
        #[serde(borrow)]
        pd_transfer: &'a serde_json::value::RawValue,
    }
    let a: Answer<'_> = serde_json::from_slice(prefill_answer).ok()?;
    Some(a.pd_transfer.get().as_bytes().to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_fields() {
        let p = peek(br#"{"model":"m","stream":true,"timeout":2.5,"messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}],"extra":{"a":[1,2]}}"#).unwrap();
        assert_eq!(p, Peek { stream: true, timeout_s: Some(2.5), prompt: "Be brief.\nHi".into() });
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
        assert!(peek(b"{not json").unwrap_err().contains("not valid JSON"));
        assert!(peek(br#"{"stream":"yes"}"#).is_err());
        assert!(peek(br#"{"timeout":-1}"#).unwrap_err().contains("timeout"));
        assert!(peek(b"[1]").is_err());
        assert!(peek(br#"{"messages":[{"content":true}]}"#).is_err());
        assert!(peek(br#"{"messages":[{"content":7}]}"#)
            .unwrap_err()
            .contains("a string or an array of content parts"));
    }

    #[test]
    fn splices_the_handle() {
        let b = with_pd_transfer(b" {\"a\":1}", br#"{"transfer":7}"#).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b).unwrap();
        assert_eq!(v["pd_transfer"]["transfer"], 7);
        assert_eq!(v["a"], 1);
        let b = with_pd_transfer(b"{ }", b"1").unwrap();
        assert_eq!(serde_json::from_slice::<serde_json::Value>(&b).unwrap()["pd_transfer"], 1);
        assert!(with_pd_transfer(b"[]", b"1").is_none());
        let h = pd_handle(br#"{"pd_transfer":{"transfer":3,"shm":null},"usage":{}}"#).unwrap();
        assert_eq!(h, br#"{"transfer":3,"shm":null}"#);
        assert!(pd_handle(br#"{"usage":{}}"#).is_none());
    }
}
