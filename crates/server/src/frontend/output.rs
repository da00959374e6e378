//! Turning the engine's outputs into each request's answer: stream events, whole responses, errors
//! and prefill handles.

use pdserve_api::pd;
use pdserve_codec::anthropic;
use pdserve_codec::openai::{self, Delta};
use pdserve_codec::{sse, Endpoint};
use pdserve_engine::{Output, Piece};
use serde_json::json;

use super::*;

impl Frontend {
    pub(super) fn output(&mut self, o: Output) {
        match o {
            Output::Admitted { id } => {
                if let Some(gid) = self.live.get(&id).and_then(|l| l.group) {
                    return self.group_admitted(gid, id);
                }
                let Some(l) = self.live.get_mut(&id) else { return };
                let Kind::Generate { stream: true, .. } = l.kind else { return };
                let Some(conn) = l.conn else { return };
                let mut headers = vec![
                    ("content-type", "text/event-stream"),
                    ("cache-control", "no-cache"),
                    (header::REQUEST_ID, l.request_id.as_str()),
                ];
                if l.marks {
                    headers.push((header::RESUMABLE, "1"));
                }
                if self.server.start_stream(conn, 200, &headers).is_err() {
                    self.disconnected(conn);
                    return;
                }
                l.started = true;
                let first = match l.meta.endpoint {
                    // The client has the opening events from the worker before.
                    _ if l.resumed => String::new(),
                    Endpoint::Chat => sse(
                        None,
                        &openai::chunk(
                            &l.meta,
                            Delta { role: true, text: Some(""), ..Delta::default() },
                            None,
                        )
                        .to_string(),
                    ),
                    Endpoint::Messages => {
                        let e = MessageStream::start(&l.meta);
                        sse(Some(e.0), &anthropic::event_data(&e))
                    }
                    Endpoint::Responses => match l.resp.as_mut() {
                        Some(r) => {
                            let mut events = Vec::new();
                            r.stream.start(&l.meta, &r.echo, &mut events);
                            events.iter().map(|e| sse(Some(&e.0), &responses::event_data(e))).collect()
                        }
                        None => String::new(),
                    },
                    Endpoint::Completion => match &l.echo {
                        Some(t) => sse(
                            None,
                            &openai::chunk(&l.meta, Delta { text: Some(t), ..Delta::default() }, None)
                                .to_string(),
                        ),
                        None => String::new(),
                    },
                };
                if !first.is_empty() {
                    self.send_frames(id, &first);
                }
            }
            Output::Rejected { id, error } => {
                if let Some(gid) = self.live.get(&id).and_then(|l| l.group) {
                    self.live.remove(&id);
                    return self.group_failed(gid, &error.to_api_error());
                }
                if let Some(l) = self.remove(id) {
                    let e = error.to_api_error();
                    self.trace_end(
                        &l,
                        Err((e.kind.as_str().to_owned(), e.message.clone())),
                        &pdserve_engine::Usage::default(),
                        None,
                    );
                    super::answer::log_end(&l, &format!("rejected:{}", e.kind.as_str()), &Default::default());
                    if let Some(conn) = l.conn {
                        let _ = self.server.respond(conn, &Self::error_response(&l, &e));
                    }
                }
            }
            Output::Text { id, text, reasoning, calls, logprob, tokens, replayed } => {
                let Some(l) = self.live.get_mut(&id) else { return };
                let Kind::Generate { stream, .. } = l.kind else { return };
                assert!(!l.panic_in_output, "test panic while rendering the output");
                let pieces: Vec<Piece> = std::iter::once(Piece::Text(text)).chain(calls).collect();
                let group = l.group;
                if let Some(gid) = group.filter(|_| l.choice == 0) {
                    // The first choice's prompt is computed (and cached): the others may start.
                    self.release_deferred(gid);
                }
                let Some(l) = self.live.get_mut(&id) else { return };
                if !stream {
                    l.reasoning.push_str(&reasoning);
                    l.logprobs.extend(logprob);
                    for p in pieces {
                        match p {
                            Piece::Text(t) => l.text.push_str(&t),
                            Piece::Call(c) => l.calls.push(c),
                            // (A whole answer has each call whole.)
                            Piece::CallBegin { .. } | Piece::CallArguments(_) => {}
                        }
                    }
                    return;
                }
                let mut lp = logprob.map(|p| openai::logprobs_json(l.meta.endpoint, &[p]));
                let mut frames = Self::stream_pieces(l, &reasoning, pieces, &mut lp);
                if replayed {
                    // The client has these events from the worker before; the parsers' state is
                    // what counted.
                    return;
                }
                if let Some(lp) =
                    lp.filter(|_| matches!(l.meta.endpoint, Endpoint::Chat | Endpoint::Completion))
                {
                    // Log-probabilities of text the tool-call parser holds back go out on their own.
                    let delta = Delta { text: Some(""), index: l.choice, ..Delta::default() };
                    let c = openai::chunk(&l.meta, delta, Some(lp));
                    frames.insert_str(0, &sse(None, &c.to_string()));
                }
                if l.marks && !tokens.is_empty() {
                    // After the events these tokens made: the router moves the request on from here.
                    frames.push_str(&pd::mark::tokens(l.meta.created, &tokens));
                }
                match group {
                    _ if frames.is_empty() => {}
                    Some(gid) => self.group_send(gid, &frames),
                    None => {
                        self.send_frames(id, &frames);
                    }
                }
            }
            Output::Prefilled { id, handle, usage, timings } => {
                let Some(l) = self.remove(id) else { return };
                self.trace_end(&l, Ok("length"), &usage, Some(&timings));
                super::answer::log_end(&l, "prefilled", &usage);
                if let (Some(_), Some(t)) = (self.traces.as_ref(), l.trace) {
                    self.offers_traced.insert(id, (t, Instant::now(), l.request_id.clone()));
                    while self.offers_traced.len() > trace::OFFERS_TRACED_MAX {
                        self.offers_traced.pop_first();
                    }
                }
                if let Some(gid) = l.group {
                    return self.group_prefilled(gid, &l, handle, usage, timings);
                }
                let Some(conn) = l.conn else {
                    // Nobody will take this KV: end the offer now instead of at the lease expiry.
                    self.engine.abort_request(&l.request_id);
                    return;
                };
                let mut body = json!({"usage": openai::usage_json(usage), "timings": timings_json(&timings)});
                let handle = pdserve_api::pd::PdHandle { traceparent: l.handoff.clone(), ..handle };
                body[pd::HANDLE_FIELD] = self.signed(handle).to_json();
                let _ = self.server.respond(conn, &json_response(200, &body, Some(&l.request_id)));
            }
            Output::Finished { id, finish, usage, timings } => self.finished(id, finish, usage, timings),
            Output::Served { id, outcome } => {
                let (Some(x), Some((t, since, rid))) = (self.traces.as_ref(), self.offers_traced.remove(&id))
                else {
                    return;
                };
                trace::export_served(x, t, &rid, since, &outcome);
            }
        }
    }
}
