//! The Responses API's stored conversations at the router: a request naming `previous_response_id`
//! reaches its workers with the whole conversation in `input` (marked
//! [`CONVERSATION_FIELD`](pdserve_codec::responses::CONVERSATION_FIELD), so prefill and decode
//! workers alike render the same prompt whichever of them kept the previous turn), and each answered
//! response (`store` on) is kept here from the bytes its client got. `GET` and `DELETE
//! /v1/responses/{id}` answer from this store.

use std::time::Instant;

use pdserve_api::{ApiError, ErrorKind};
use pdserve_codec::responses::CONVERSATION_FIELD;
use serde_json::{json, Value};

use crate::router::Router;

/// A Responses flight that stores its answer: the conversation's items, and the client's bytes so
/// far (bounded; past the bound nothing is stored).
#[derive(Debug, Default)]
pub(crate) struct Storing {
    items: Vec<Value>,
    captured: Vec<u8>,
    over: bool,
}

impl Storing {
    /// Bytes the client got. Of a stream, only the event in progress is kept (its last event holds
    /// the whole response).
    pub(crate) fn capture(&mut self, bytes: &[u8], max: usize) {
        if self.over || self.captured.len() + bytes.len() > max {
            self.over = true;
            self.captured = Vec::new();
            return;
        }
        self.captured.extend_from_slice(bytes);
        // Everything before the last event (complete or in progress) is done with.
        let c = &self.captured;
        let end = if c.ends_with(b"\n\n") { c.len() - 2 } else { c.len() };
        if let Some(i) = c[..end].windows(2).rposition(|w| w == b"\n\n") {
            self.captured.drain(..i + 2);
        }
    }

    /// The response object the client got: the whole body, or a stream's last event's `response`.
    fn response(&self) -> Option<Value> {
        if self.over {
            return None;
        }
        let text = std::str::from_utf8(&self.captured).ok()?.trim();
        if text.starts_with('{') {
            return serde_json::from_str(text).ok();
        }
        let last = text.rsplit("\ndata: ").next()?.trim_start_matches("data: ");
        let v: Value = serde_json::from_str(last.lines().next()?).ok()?;
        Some(v.get("response")?.clone())
    }
}

/// A Responses body as its workers get it, what storing its answer needs, and the text routing
/// follows when the conversation was expanded.
pub(crate) struct Forwarded {
    pub body: Vec<u8>,
    pub storing: Option<Storing>,
    pub prompt: Option<String>,
}

impl Router {
    /// A Responses body as its workers get it: with `previous_response_id`, the stored conversation
    /// then this input in `input` (marked); and what storing its answer needs (`None` with `store:
    /// false`, or a body the worker will refuse anyway). A previous response not kept is a 404.
    pub(crate) fn responses_body(&self, body: Vec<u8>, now: Instant) -> Result<Forwarded, ApiError> {
        let Ok(Value::Object(mut v)) = serde_json::from_slice::<Value>(&body) else {
            return Ok(Forwarded { body, storing: None, prompt: None });
        };
        let input: Vec<Value> = match v.get("input") {
            Some(Value::String(s)) => vec![json!({"type": "message", "role": "user", "content": s})],
            Some(Value::Array(a)) => a.clone(),
            _ => return Ok(Forwarded { body, storing: None, prompt: None }),
        };
        let items;
        let mut prompt = None;
        if let Some(id) = v.get("previous_response_id").filter(|p| !p.is_null()) {
            let Some(id) = id.as_str() else { return Ok(Forwarded { body, storing: None, prompt: None }) };
            let mut stored = self.responses.items(id, now).ok_or_else(|| {
                let msg = format!("response {id:?} is not stored at this router (never stored, or past its count, size or age limit)");
                ApiError::new(ErrorKind::NotFound, msg)
            })?;
            stored.extend(input);
            items = stored;
            v.insert("input".into(), Value::Array(items.clone()));
            // Cache-aware routing follows the whole conversation (where its KV may be).
            let mut text: Vec<&str> = v.get("instructions").and_then(Value::as_str).into_iter().collect();
            text.extend(items.iter().filter_map(|i| i.get("content").and_then(Value::as_str)));
            prompt = Some(text.join("\n"));
        } else {
            items = input;
        }
        // Marked: the workers render `input` as the whole conversation and leave storing to the
        // router.
        v.insert(CONVERSATION_FIELD.into(), json!(true));
        let store = v.get("store") != Some(&Value::Bool(false)) && self.responses.count_max > 0;
        let rewritten = Value::Object(v).to_string().into_bytes();
        let storing = store.then(|| Storing { items, ..Storing::default() });
        Ok(Forwarded { body: rewritten, storing, prompt })
    }

    /// A flight ended: its response, if complete, is kept.
    pub(crate) fn responses_done(&mut self, storing: Storing, now: Instant) {
        let Some(r) = storing.response() else { return };
        if matches!(r["status"].as_str(), Some("completed" | "incomplete")) {
            self.responses.put(storing.items, r, now);
        }
    }

    /// `GET /v1/responses/{id}` (the stored response) and `DELETE` (forgets it).
    pub(crate) fn stored_response(&mut self, method: &str, id: &str) -> Result<Value, ApiError> {
        let gone =
            || ApiError::new(ErrorKind::NotFound, format!("response {id:?} is not stored at this router"));
        if method == "DELETE" {
            return match self.responses.delete(id) {
                true => Ok(json!({"id": id, "object": "response", "deleted": true})),
                false => Err(gone()),
            };
        }
        self.responses.response(id, Instant::now()).ok_or_else(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_answer_is_read_from_a_body_or_a_streams_last_event() {
        // A stream in pieces cut anywhere: only the event in progress is held.
        let stream = b"event: response.created\ndata: {\"response\":{\"id\":\"r\",\"status\":\"in_progress\"}}\n\nevent: response.output_text.delta\ndata: {\"delta\":\"hi\"}\n\nevent: response.completed\ndata: {\"response\":{\"id\":\"r\",\"status\":\"completed\"},\"type\":\"response.completed\"}\n\n";
        for cut in 1..stream.len() {
            let mut s = Storing::default();
            s.capture(&stream[..cut], 1 << 20);
            s.capture(&stream[cut..], 1 << 20);
            assert_eq!(s.response().map(|r| r["status"].clone()), Some(json!("completed")), "cut at {cut}");
            assert!(s.captured.len() < 130, "cut at {cut}: {} bytes held", s.captured.len());
        }
        let mut s = Storing::default();
        s.capture(br#"{"id": "resp_1", "status": "completed", "output": []}"#, 1 << 20);
        assert_eq!(s.response().unwrap()["id"], "resp_1");
        let mut s = Storing::default();
        s.capture(b"event: response.created\ndata: {\"response\":{\"id\":\"resp_2\",\"status\":\"in_progress\"}}\n\n", 1 << 20);
        s.capture(b"event: response.completed\ndata: {\"response\":{\"id\":\"resp_2\",\"status\":\"completed\"},\"type\":\"response.completed\"}\n\n", 1 << 20);
        assert_eq!(s.response().unwrap()["status"], "completed");
        s.capture(&[b'x'; 100], 64);
        assert!(s.response().is_none());
    }
}
