//! Requests with `n` > 1: one engine request per choice (`{id}`, `{id}.1`, ...), answered as one
//! response whose choices carry their index. The first choice computes the prompt; the others are
//! submitted once it has (its blocks are then in the prefix cache, so they compute only the prompt's
//! last partial block). A decode worker's choices each pull their own KV (one handle per choice, from
//! the prefill worker's answer) and start at once. Any choice failing fails the request.

use std::time::Instant;

use pdserve_api::pd::{self, PdHandle};
use pdserve_api::{header, ApiError, ErrorKind, Role};
use pdserve_codec::openai::{self, Delta};
use pdserve_codec::{sse, Endpoint, Meta};
use pdserve_engine::Usage;
use pdserve_engine::{Finish, Id, Input, Request as EngineRequest, Timings};
use pdserve_http::{ConnId, Response};
use serde_json::{json, Value};

use super::{json_response, timings_json, unix_now, Frontend, Kind, Live};

/// The engine request id of choice `i`.
pub(super) fn member_id(request_id: &str, i: usize) -> String {
    if i == 0 {
        request_id.to_owned()
    } else {
        format!("{request_id}.{i}")
    }
}

type Deferred = (usize, EngineRequest);

pub(super) struct Group {
    /// The client's connection (`None` once it is gone).
    pub(super) conn: Option<ConnId>,
    request_id: String,
    kind: Kind,
    meta: Meta,
    n: usize,
    echo: Option<String>,
    /// Choices not yet submitted (until the first choice's prompt is computed).
    deferred: Vec<Deferred>,
    /// Engine ids of the choices submitted and not ended.
    live: Vec<Id>,
    /// Choices ended: each one's JSON (non-streaming) or KV handle (prefill role).
    ended: Vec<Option<Value>>,
    usage: Usage,
    timings: Value,
    /// The stream's `200` head is out.
    started: bool,
}

impl Frontend {
    /// Starts the `n` choices of one request.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_group(
        &mut self,
        conn: ConnId,
        rid: &str,
        first: EngineRequest,
        n: usize,
        kind: Kind,
        endpoint: Endpoint,
        handles: &[PdHandle],
        echo: Option<String>,
    ) -> Result<(), ApiError> {
        // KV pulled from a prefill worker, one handle per choice (a decode worker computes a prompt
        // sent without handles itself, as a unified worker does).
        let decode = self.engine.info().role == Role::Decode && !handles.is_empty();
        let mut members: Vec<Deferred> = Vec::with_capacity(n);
        for i in 0..n {
            let mut r = first.clone();
            r.request_id = member_id(rid, i);
            r.tool_call_ids = Some(format!("{rid}_{i}"));
            r.seed = first.seed.map(|s| s.wrapping_add(i as u64));
            if let (true, Some(h)) = (decode, handles.get(i)) {
                r.input = Input::Remote(h.clone());
            }
            members.push((i, r));
        }
        let deferred = if decode { Vec::new() } else { members.split_off(1) };
        let gid = self.next_group;
        self.next_group += 1;
        let meta = Meta {
            endpoint,
            id: endpoint.response_id(rid),
            created: unix_now(),
            model: self.config.model_name.clone(),
        };
        let group = Group {
            conn: Some(conn),
            request_id: rid.to_owned(),
            kind,
            meta,
            n,
            echo,
            deferred,
            live: Vec::new(),
            ended: vec![None; n],
            usage: Usage::default(),
            timings: Value::Null,
            started: false,
        };
        self.groups.insert(gid, group);
        for (i, r) in members {
            if let Err(e) = self.submit_member(gid, i, r) {
                self.group_abort(gid);
                return Err(e);
            }
        }
        Ok(())
    }

    fn submit_member(&mut self, gid: u64, i: usize, req: EngineRequest) -> Result<(), ApiError> {
        let id = self.engine.submit(req).map_err(|e| e.to_api_error())?;
        let Some(g) = self.groups.get_mut(&gid) else { return Ok(()) };
        g.live.push(id);
        let live = Live {
            conn: None,
            request_id: member_id(&g.request_id, i),
            kind: g.kind,
            meta: g.meta.clone(),
            started: false,
            text: String::new(),
            logprobs: Vec::new(),
            received: Instant::now(),
            calls: Vec::new(),
            call_open: None,
            blocks: Default::default(),
            echo: g.echo.clone(),
            panic_in_output: false,
            marks: false,
            resumed: false,
            last_sent: Instant::now(),
            reasoning: String::new(),
            resp: None,
            group: Some(gid),
            choice: i,
            trace: None,
            handoff: None,
        };
        self.live.insert(id, live);
        Ok(())
    }

    /// The first choice's prompt is computed: the other choices start.
    pub(super) fn release_deferred(&mut self, gid: u64) {
        let Some(g) = self.groups.get_mut(&gid) else { return };
        for (i, r) in std::mem::take(&mut g.deferred) {
            if let Err(e) = self.submit_member(gid, i, r) {
                return self.group_failed(gid, &e);
            }
        }
    }

    /// Streams frames to the group's client; a client that is gone or not reading ends the request.
    pub(super) fn group_send(&mut self, gid: u64, frames: &str) {
        let Some(conn) = self.groups.get(&gid).and_then(|g| g.conn) else { return };
        if self.server.send_chunk(conn, frames.as_bytes()).is_err() {
            self.server.close(conn);
            self.group_abort(gid);
        }
    }

    /// A choice was admitted: the stream's head goes out with the first, then each choice's opening.
    pub(super) fn group_admitted(&mut self, gid: u64, id: Id) {
        let Some(g) = self.groups.get_mut(&gid) else { return };
        let (Kind::Generate { stream: true, .. }, Some(conn)) = (g.kind, g.conn) else { return };
        if !g.started {
            let headers = [
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
                (header::REQUEST_ID, g.request_id.as_str()),
            ];
            if self.server.start_stream(conn, 200, &headers).is_err() {
                return self.group_abort(gid);
            }
            g.started = true;
        }
        let Some(l) = self.live.get(&id) else { return };
        let delta = match (g.meta.endpoint, &l.echo) {
            (Endpoint::Chat, _) => Delta { role: true, text: Some(""), index: l.choice, ..Delta::default() },
            (Endpoint::Completion, Some(e)) => Delta { text: Some(e), index: l.choice, ..Delta::default() },
            _ => return,
        };
        let frame = sse(None, &openai::chunk(&g.meta, delta, None).to_string());
        self.group_send(gid, &frame);
    }

    /// A choice of a prefill worker's request: its KV handle; all of them go back as one array.
    pub(super) fn group_prefilled(&mut self, gid: u64, l: &Live, handle: PdHandle, usage: Usage, t: Timings) {
        let handle = self.signed(handle);
        if l.choice == 0 {
            self.release_deferred(gid);
        }
        let Some(g) = self.groups.get_mut(&gid) else {
            self.engine.abort_request(&l.request_id);
            return;
        };
        g.live.retain(|&x| self.live.contains_key(&x));
        g.ended[l.choice] = Some(handle.to_json());
        g.usage.completion_tokens += usage.completion_tokens;
        if l.choice == 0 {
            g.usage.prompt_tokens = usage.prompt_tokens;
            g.usage.cached_tokens = usage.cached_tokens;
            g.timings = timings_json(&t);
        }
        if g.ended.iter().any(Option::is_none) {
            return;
        }
        let Some(g) = self.groups.remove(&gid) else { return };
        let handles: Vec<Value> = g.ended.into_iter().flatten().collect();
        let Some(conn) = g.conn else {
            for i in 0..g.n {
                self.engine.abort_request(&member_id(&g.request_id, i));
            }
            return;
        };
        let mut body = json!({"usage": openai::usage_json(g.usage), "timings": g.timings});
        body[pd::HANDLE_FIELD] = Value::Array(handles);
        let _ = self.server.respond(conn, &json_response(200, &body, Some(&g.request_id)));
    }

    /// A choice ended; the last one ends the response.
    pub(super) fn group_finished(&mut self, gid: u64, mut l: Live, finish: Finish, usage: Usage, t: Timings) {
        if l.choice == 0 {
            self.release_deferred(gid);
        }
        let reason = match finish.reason() {
            Some(r) => r,
            None => {
                let e = finish
                    .to_api_error()
                    .unwrap_or_else(|| ApiError::new(ErrorKind::Internal, "unexpected end"));
                return self.group_failed(gid, &e);
            }
        };
        let Some(g) = self.groups.get_mut(&gid) else { return };
        g.live.retain(|&x| self.live.contains_key(&x));
        g.usage.completion_tokens += usage.completion_tokens;
        if l.choice == 0 {
            g.usage.prompt_tokens = usage.prompt_tokens;
            g.usage.cached_tokens = usage.cached_tokens;
            g.timings = timings_json(&t);
        }
        let Kind::Generate { stream, logprobs, .. } = g.kind else { return };
        let reason = openai::finish_reason(g.meta.endpoint, reason, !l.calls.is_empty());
        if stream {
            g.ended[l.choice] = Some(Value::Null);
            let delta = Delta { finish_reason: Some(reason), index: l.choice, ..Delta::default() };
            let frames = sse(None, &openai::chunk(&g.meta, delta, None).to_string());
            self.group_send(gid, &frames);
        } else {
            if let Some(e) = &l.echo {
                l.text.insert_str(0, e);
            }
            let lp = logprobs.then(|| openai::logprobs_json(g.meta.endpoint, &l.logprobs));
            let mut body = openai::full_response(&g.meta, &l.text, &l.calls, reason, lp, usage);
            openai::with_reasoning(&mut body, &l.reasoning);
            let mut choice = body["choices"][0].clone();
            choice["index"] = json!(l.choice);
            g.ended[l.choice] = Some(choice);
        }
        if self.groups.get(&gid).is_some_and(|g| g.ended.iter().all(Option::is_some)) {
            self.group_complete(gid);
        }
    }

    fn group_complete(&mut self, gid: u64) {
        let Some(g) = self.groups.remove(&gid) else { return };
        let Some(conn) = g.conn else { return };
        let Kind::Generate { stream, include_usage, .. } = g.kind else { return };
        if stream {
            let mut frames = String::new();
            if include_usage {
                frames.push_str(&sse(None, &openai::usage_chunk(&g.meta, g.usage).to_string()));
            }
            frames.push_str(&sse(None, openai::DONE));
            if self.server.send_chunk(conn, frames.as_bytes()).is_ok() {
                let _ = self.server.end_stream(conn);
            } else {
                self.server.close(conn);
            }
            return;
        }
        let mut body = openai::full_response(&g.meta, "", &[], "stop", None, g.usage);
        body["choices"] = Value::Array(g.ended.into_iter().flatten().collect());
        body["timings"] = g.timings;
        let _ = self.server.respond(conn, &json_response(200, &body, Some(&g.request_id)));
    }

    /// Ends every choice without an answer (the client is gone).
    pub(super) fn group_abort(&mut self, gid: u64) {
        let Some(g) = self.groups.remove(&gid) else { return };
        for id in &g.live {
            self.engine.abort(*id);
            self.live.remove(id);
        }
        // A prefill worker's choices already offered: their KV is not going to be taken.
        for (i, _) in g.ended.iter().enumerate().filter(|(_, h)| h.is_some()) {
            self.engine.abort_request(&member_id(&g.request_id, i));
        }
    }

    /// One choice failed: the others end and the client gets the error (as a stream's last events
    /// once the stream began).
    pub(super) fn group_failed(&mut self, gid: u64, e: &ApiError) {
        let Some(g) = self.groups.get(&gid) else { return };
        let (conn, started, meta, rid) = (g.conn, g.started, g.meta.clone(), g.request_id.clone());
        self.group_abort(gid);
        let Some(conn) = conn else { return };
        if started {
            let frames = openai::stream_error_frames(&meta, e, &rid);
            if self.server.send_chunk(conn, frames.as_bytes()).is_ok() {
                let _ = self.server.end_stream(conn);
            } else {
                self.server.close(conn);
            }
        } else {
            let _ = self.server.respond(conn, &Response::error(e, Some(&rid)));
        }
    }
}
