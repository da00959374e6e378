//! How a request's answer is written: stream events for text and tool calls, and the end (the full
//! body, the stream's last events, or the error).

use pdserve_api::{pd, ApiError, ErrorKind, Health};
use pdserve_codec::anthropic;
use pdserve_codec::openai::{self, Delta};
use pdserve_codec::responses;
use pdserve_codec::{sse, Endpoint};
use pdserve_engine::{Finish, Id, Timings};
use pdserve_engine::{Piece, Usage};
use pdserve_http::Response;
use serde_json::{json, Value};

use super::{json_response, timings_json, Frontend, Kind, Live};

impl Frontend {
    /// The stream events of text and calls, framed: text as content deltas, each call as `tool_calls`
    /// deltas with its index, whole or (formats that stream arguments) its head and then its
    /// arguments as they arrive (Messages: text and `tool_use` blocks; Responses: items). `lp` goes
    /// with the first text chunk (taken if used).
    pub(super) fn stream_pieces(
        l: &mut Live,
        reasoning: &str,
        pieces: Vec<Piece>,
        lp: &mut Option<Value>,
    ) -> String {
        let mut frames = String::new();
        if let Some(r) = l.resp.as_mut() {
            let mut events = Vec::new();
            // (The chat shape's `content` list is the Responses' `logprobs` list.)
            let mut lps: Vec<Value> = lp
                .take()
                .and_then(|v| v.get("content").and_then(Value::as_array).cloned())
                .unwrap_or_default();
            r.stream.reasoning(&l.meta, reasoning, &mut events);
            for p in pieces {
                match p {
                    Piece::Text(t) => r.stream.text(&l.meta, &t, std::mem::take(&mut lps), &mut events),
                    Piece::CallBegin { id, name } => {
                        r.stream.call_begin(&l.meta, &id, &name, &mut events);
                        l.call_open = Some(id);
                    }
                    Piece::CallArguments(a) => {
                        let id = l.call_open.as_deref().unwrap_or_default();
                        r.stream.call_arguments(id, &a, &mut events);
                    }
                    Piece::Call(c) => {
                        r.stream.call(&l.meta, &c, &mut events);
                        l.call_open = None;
                        l.calls.push(c);
                    }
                }
            }
            // Log-probabilities of text the tool-call parser holds back go out on their own.
            r.stream.text(&l.meta, "", lps, &mut events);
            for e in &events {
                frames.push_str(&sse(Some(&e.0), &responses::event_data(e)));
            }
            return frames;
        }
        if l.meta.endpoint == Endpoint::Messages {
            let mut events = Vec::new();
            l.blocks.thinking(reasoning, &mut events);
            for p in pieces {
                match p {
                    Piece::Text(t) => l.blocks.text(&t, &mut events),
                    Piece::CallBegin { id, name } => l.blocks.call_begin(&id, &name, &mut events),
                    Piece::CallArguments(a) => l.blocks.call_arguments(&a, &mut events),
                    Piece::Call(c) => {
                        l.blocks.call(&c, &mut events);
                        l.calls.push(c);
                    }
                }
            }
            for e in &events {
                frames.push_str(&sse(Some(e.0), &anthropic::event_data(e)));
            }
            return frames;
        }
        if !reasoning.is_empty() {
            let delta = Delta { reasoning: Some(reasoning), index: l.choice, ..Delta::default() };
            frames.push_str(&sse(None, &openai::chunk(&l.meta, delta, None).to_string()));
        }
        for p in pieces {
            let c = match p {
                Piece::Text(t) if t.is_empty() => continue,
                Piece::Text(t) => {
                    let delta = Delta { text: Some(&t), index: l.choice, ..Delta::default() };
                    openai::chunk(&l.meta, delta, lp.take())
                }
                Piece::CallBegin { id, name } => {
                    l.call_open = Some(id.clone());
                    let part = openai::call_begin_json(l.calls.len(), &id, &name);
                    let delta = Delta { call_part: Some(&part), index: l.choice, ..Delta::default() };
                    openai::chunk(&l.meta, delta, None)
                }
                Piece::CallArguments(a) => {
                    let part = openai::call_arguments_json(l.calls.len(), &a);
                    let delta = Delta { call_part: Some(&part), index: l.choice, ..Delta::default() };
                    openai::chunk(&l.meta, delta, None)
                }
                Piece::Call(call) if l.call_open.take().is_some() => {
                    // Its head and arguments went out as they arrived.
                    l.calls.push(call);
                    continue;
                }
                Piece::Call(call) => {
                    let calls = [(l.calls.len(), call)];
                    let delta = Delta { tool_calls: Some(&calls), index: l.choice, ..Delta::default() };
                    let c = openai::chunk(&l.meta, delta, None);
                    let [(_, call)] = calls;
                    l.calls.push(call);
                    c
                }
            };
            frames.push_str(&sse(None, &c.to_string()));
        }
        frames
    }

    pub(super) fn finished(&mut self, id: Id, finish: Finish, usage: Usage, timings: Timings) {
        let Some(mut l) = self.remove(id) else { return };
        let result = finish.reason().ok_or_else(|| {
            let e =
                finish.to_api_error().unwrap_or_else(|| ApiError::new(ErrorKind::Internal, "unexpected end"));
            (e.kind.as_str().to_owned(), e.message)
        });
        self.trace_end(&l, result, &usage, Some(&timings));
        log_end(&l, &finish.outcome().to_string(), &usage);
        if let Some(gid) = l.group {
            return self.group_finished(gid, l, finish, usage, timings);
        }
        let Some(conn) = l.conn else { return };
        let timings = timings_json(&timings);
        let stop_sequence = match &finish {
            Finish::StopString(s) => Some(s.clone()),
            _ => None,
        };
        let result = finish.reason().ok_or_else(|| {
            finish.to_api_error().unwrap_or_else(|| ApiError::new(ErrorKind::Internal, "unexpected end"))
        });
        match (&l.kind, result) {
            (Kind::Probe, Ok(_)) => {
                let health = Health::Generated {
                    latency_ms: l.received.elapsed().as_millis() as u64,
                    details: json!({"tokens": usage.completion_tokens}),
                };
                let _ = self.server.respond(conn, &Response::health(&health, None));
            }
            (Kind::Generate { stream: false, logprobs, .. }, Ok(reason)) => {
                if let Some(e) = &l.echo {
                    l.text.insert_str(0, e);
                }
                let mut body = if let Some(r) = l.resp.take() {
                    let lps = if *logprobs { responses::logprobs_json(&l.logprobs) } else { Vec::new() };
                    let output = responses::output_items(&l.meta, &l.reasoning, &l.text, &lps, &l.calls);
                    let body = responses::response_json(&l.meta, &r.echo, output, Some(reason), Some(usage));
                    if r.store && !r.kept_by_router {
                        self.responses.put(r.items, body.clone(), std::time::Instant::now());
                    }
                    body
                } else if l.meta.endpoint == Endpoint::Messages {
                    let stop = stop_sequence.as_deref();
                    let why = anthropic::stop_reason(reason, !l.calls.is_empty(), stop);
                    let mut m = anthropic::message_json(&l.meta, &l.text, &l.calls, why, stop, usage);
                    anthropic::with_thinking(&mut m, &l.reasoning);
                    m
                } else {
                    let lp = logprobs.then(|| openai::logprobs_json(l.meta.endpoint, &l.logprobs));
                    let reason = openai::finish_reason(l.meta.endpoint, reason, !l.calls.is_empty());
                    let mut r = openai::full_response(&l.meta, &l.text, &l.calls, reason, lp, usage);
                    openai::with_reasoning(&mut r, &l.reasoning);
                    r
                };
                body["timings"] = timings;
                let _ = self.server.respond(conn, &json_response(200, &body, Some(&l.request_id)));
            }
            (Kind::Generate { stream: true, .. }, _) if !l.started => {
                // Ended before the stream began (a deadline in the queue): a plain error answer.
                let e = finish
                    .to_api_error()
                    .unwrap_or_else(|| ApiError::new(ErrorKind::Internal, "stream ended before it started"));
                let _ = self.server.respond(conn, &Self::error_response(&l, &e));
            }
            (Kind::Generate { stream: true, include_usage, .. }, result) => {
                let mut frames = String::new();
                match result {
                    Ok(reason) if l.resp.is_some() => {
                        let Some(mut r) = l.resp.take() else { return };
                        let mut events = Vec::new();
                        let output = r.stream.finish(&l.meta, &r.echo, reason, usage, &mut events);
                        if r.store && !r.kept_by_router {
                            // The response as the client read it, kept for the next turn.
                            let body =
                                responses::response_json(&l.meta, &r.echo, output, Some(reason), Some(usage));
                            self.responses.put(r.items, body, std::time::Instant::now());
                        }
                        for e in &events {
                            frames.push_str(&sse(Some(&e.0), &responses::event_data(e)));
                        }
                    }
                    Ok(reason) if l.meta.endpoint == Endpoint::Messages => {
                        let stop = stop_sequence.as_deref();
                        let why = anthropic::stop_reason(reason, !l.calls.is_empty(), stop);
                        let mut events = Vec::new();
                        l.blocks.finish(why, stop, usage, &mut events);
                        for e in &events {
                            frames.push_str(&sse(Some(e.0), &anthropic::event_data(e)));
                        }
                    }
                    Ok(reason) => {
                        let reason = openai::finish_reason(l.meta.endpoint, reason, !l.calls.is_empty());
                        let mut last = openai::chunk(
                            &l.meta,
                            Delta { finish_reason: Some(reason), ..Delta::default() },
                            None,
                        );
                        last["timings"] = timings;
                        frames.push_str(&sse(None, &last.to_string()));
                        if *include_usage {
                            frames.push_str(&sse(None, &openai::usage_chunk(&l.meta, usage).to_string()));
                        }
                        frames.push_str(&sse(None, openai::DONE));
                    }
                    Err(e) => {
                        if l.marks && e.kind == ErrorKind::KvTransferFailed {
                            // Another pair may have the KV: the router may move the request there.
                            frames.push_str(&format!("{}{}\n\n", pd::mark::RETRY, e.kind));
                        }
                        frames.push_str(&pdserve_codec::stream_error_frames(&l.meta, &e, &l.request_id))
                    }
                }
                if self.server.send_chunk(conn, frames.as_bytes()).is_ok() {
                    let _ = self.server.end_stream(conn);
                } else {
                    self.server.close(conn);
                }
            }
            (_, Err(e)) => {
                let _ = self.server.respond(conn, &Self::error_response(&l, &e));
            }
        }
    }
}

/// The request's one log line, with its id and its trace's (the caller's, where this worker exports
/// no spans), so a log search finds it: how it ended, its tokens and its time here.
pub(super) fn log_end(l: &Live, outcome: &str, usage: &pdserve_engine::Usage) {
    let trace = l.handoff.as_deref().and_then(|t| t.get(3..35)).map(|t| format!(" trace_id={t}"));
    eprintln!(
        "request_id={}{} outcome={outcome} prompt_tokens={} completion_tokens={} latency_ms={}",
        l.request_id,
        trace.unwrap_or_default(),
        usage.prompt_tokens,
        usage.completion_tokens,
        l.received.elapsed().as_millis()
    );
}
