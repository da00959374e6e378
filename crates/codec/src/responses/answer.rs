//! A Responses answer as the API writes it: the output items, the response object, and the typed,
//! numbered events of a stream.

use serde_json::{json, Value};

use pdserve_api::generation::{TokenLogprob, Usage};
use pdserve_api::tools::ToolCall;
use pdserve_api::ApiError;

use crate::Meta;

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
    /// The output index of the call whose arguments are streaming, if one is.
    call_open: Option<usize>,
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

    /// A call whose arguments stream: its item opens.
    pub fn call_begin(&mut self, meta: &Meta, id: &str, name: &str, out: &mut Vec<Event>) {
        self.close_text(meta, out);
        self.blank.clear();
        self.blank_logprobs.clear();
        let i = self.items.len();
        let c = ToolCall { id: id.to_owned(), name: name.to_owned(), arguments: String::new() };
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": i, "item": call_item(&c, "in_progress")}),
        ));
        self.call_open = Some(i);
    }

    /// More of the streaming call's arguments.
    pub fn call_arguments(&mut self, id: &str, arguments: &str, out: &mut Vec<Event>) {
        if let Some(i) = self.call_open {
            let id = format!("fc_{id}");
            out.push(self.event(
                "response.function_call_arguments.delta",
                json!({"item_id": id, "output_index": i, "delta": arguments}),
            ));
        }
    }

    /// A complete call: its item, its arguments (as one delta unless they streamed), its end.
    pub fn call(&mut self, meta: &Meta, c: &ToolCall, out: &mut Vec<Event>) {
        let id = format!("fc_{}", c.id);
        if let Some(i) = self.call_open.take() {
            return self.call_done(c, i, &id, out);
        }
        self.close_text(meta, out);
        self.blank.clear();
        self.blank_logprobs.clear();
        let i = self.items.len();
        let mut item = call_item(c, "in_progress");
        item["arguments"] = json!("");
        out.push(self.event("response.output_item.added", json!({"output_index": i, "item": item})));
        out.push(self.event(
            "response.function_call_arguments.delta",
            json!({"item_id": id, "output_index": i, "delta": c.arguments}),
        ));
        self.call_done(c, i, &id, out);
    }

    fn call_done(&mut self, c: &ToolCall, i: usize, id: &str, out: &mut Vec<Event>) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::responses::read;
    use crate::Endpoint;

    fn none(_: &str) -> Option<Vec<Value>> {
        None
    }

    /// A call whose arguments stream: its item opens at the head, each piece is an arguments delta
    /// of that item, and the whole call gives `done` the joined arguments and closes the item.
    #[test]
    fn a_streamed_call_is_one_item_of_deltas() {
        let meta =
            Meta { endpoint: Endpoint::Responses, id: "resp_r1".into(), created: 1, model: "m".into() };
        let mut s = ResponseStream::default();
        let mut out = Vec::new();
        s.call_begin(&meta, "call_1", "ls", &mut out);
        s.call_arguments("call_1", "{\"d\":", &mut out);
        s.call_arguments("call_1", "\"src\"}", &mut out);
        let call = ToolCall { id: "call_1".into(), name: "ls".into(), arguments: r#"{"d":"src"}"#.into() };
        s.call(&meta, &call, &mut out);
        let kinds: Vec<&str> = out.iter().map(|e| e.0.as_str()).collect();
        assert_eq!(
            kinds,
            [
                "response.output_item.added",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.delta",
                "response.function_call_arguments.done",
                "response.output_item.done",
            ]
        );
        assert!(out.iter().all(|e| e.1["output_index"] == 0), "{out:?}");
        assert!(out[1..4].iter().all(|e| e.1["item_id"] == "fc_call_1"), "{out:?}");
        assert_eq!(
            (&out[0].1["item"]["arguments"], &out[3].1["arguments"]),
            (&json!(""), &json!(r#"{"d":"src"}"#))
        );
        assert_eq!(out[4].1["item"]["status"], "completed");
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
}
