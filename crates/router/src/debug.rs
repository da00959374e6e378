//! Answers the router builds from every worker's, asked in parallel under a deadline and outside
//! admission: `GET /debug/requests` (its own ledger, with each request's entries on every worker
//! nested as `hops`) and `GET /v1/models` / `/v1/models/{id}` (the models the workers serve, each with
//! the list of workers serving it: role, weights, KV bytes).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdserve_http::{write_request_head, ConnId, Request, ResponseEvent};
use serde_json::{json, Value};

use crate::flight::LegKind;
use crate::router::{ms, unix_ms, Router};
use crate::upstream::Owner;
use crate::Choice;

/// What a collection answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Collecting {
    /// `/debug/requests`, entries older than this only.
    Requests { older_than: Duration },
    /// `/v1/models`, or with an id `/v1/models/{id}`.
    Models { id: Option<String> },
}

impl Collecting {
    /// What a worker is asked.
    fn path(&self) -> &'static str {
        match self {
            Collecting::Requests { .. } => pdserve_api::path::DEBUG_REQUESTS,
            Collecting::Models { .. } => pdserve_api::path::MODELS,
        }
    }
}

/// One collection waiting for its workers.
#[derive(Debug)]
pub(crate) struct Collect {
    pub conn: ConnId,
    what: Collecting,
    rid: String,
    pending: usize,
    deadline: Instant,
    hops: Vec<Value>,
    workers: Vec<Value>,
    raw: HashMap<u32, Vec<u8>>,
}

impl Router {
    pub(crate) fn start_collect(&mut self, conn: ConnId, req: &Request, now: Instant) {
        let older_than = req
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("older_than_ms=")))
            .and_then(|v| v.parse().ok())
            .map_or(Duration::ZERO, Duration::from_millis);
        self.collect(conn, Collecting::Requests { older_than }, String::new(), now);
    }

    /// Asks every worker for `what`'s path and answers `conn` once all have answered or the
    /// deadline passed.
    pub(crate) fn collect(&mut self, conn: ConnId, what: Collecting, rid: String, now: Instant) {
        let id = self.new_id();
        let ask = what.path();
        let mut c = Collect {
            conn,
            what,
            rid,
            pending: 0,
            deadline: now + self.cfg.debug_fanout_timeout,
            hops: Vec::new(),
            workers: Vec::new(),
            raw: HashMap::new(),
        };
        let ids = self.workers.ids();
        c.pending = ids.len();
        let deadline = c.deadline;
        self.collects.insert(id, c);
        for wid in ids {
            let Some(authority) = self.workers.get(wid).map(|w| w.authority.clone()) else {
                self.collect_done(id, json!({"worker": wid, "error": "worker is gone"}), None);
                continue;
            };
            let mut req = Vec::with_capacity(96);
            let mut headers = vec![("host", authority.as_str())];
            let secret = self.cfg.cluster_secret.as_deref();
            headers.extend(secret.map(|s| (pdserve_api::header::CLUSTER_SECRET, s)));
            write_request_head(&mut req, "GET", ask, &headers, 0);
            let owner = Owner::Collect { id, worker: wid };
            if let Err(e) = self.send_aside(wid, owner, req, deadline, now) {
                self.aside_failed(owner, wid, &e.to_string(), now);
            }
        }
        self.collect_maybe_done(id, false, now);
    }

    pub(crate) fn on_collect_event(&mut self, slot: usize, id: u64, worker: u32, ev: ResponseEvent) {
        match ev {
            ResponseEvent::Head(_) => {}
            ResponseEvent::Data(d) => {
                if let Some(c) = self.collects.get_mut(&id) {
                    c.raw.entry(worker).or_default().extend_from_slice(&d);
                }
            }
            ResponseEvent::End => {
                let now = Instant::now();
                self.ups.release(
                    slot,
                    self.server.registry(),
                    &mut self.workers,
                    now + self.cfg.idle_connection_timeout,
                );
                let url = self.workers.get(worker).map(|w| w.url.clone()).unwrap_or_default();
                let raw = self.collects.get_mut(&id).and_then(|c| c.raw.remove(&worker)).unwrap_or_default();
                let role = self.workers.get(worker).map_or("", |w| w.role.as_str());
                let ask = self.collects.get(&id).map_or("", |c| c.what.path());
                match serde_json::from_slice::<Value>(&raw) {
                    Ok(v) => {
                        // A worker's stages (how long each one's oldest request has waited, and for
                        // what) beside its name: a stalled queue anywhere shows in one answer.
                        let mut summary =
                            json!({"url": url, "role": role, "process": v["process"], "ok": true});
                        if v.get("stages").is_some() {
                            summary["stages"] = v["stages"].clone();
                        }
                        self.collect_done(id, summary, Some((url, v)))
                    }
                    Err(_) => {
                        let error = format!("unreadable {ask} answer");
                        self.collect_done(id, json!({"url": url, "role": role, "error": error}), None)
                    }
                }
            }
        }
    }

    pub(crate) fn collect_done(&mut self, id: u64, worker: Value, answer: Option<(String, Value)>) {
        let Some(c) = self.collects.get_mut(&id) else { return };
        c.pending = c.pending.saturating_sub(1);
        c.workers.push(worker);
        if let Some((url, v)) = answer {
            if let Collecting::Models { .. } = c.what {
                // Each model a worker serves, as that worker describes it.
                for m in v["data"].as_array().into_iter().flatten() {
                    let mut m = m.clone();
                    m["worker"] = json!(url);
                    c.hops.push(m);
                }
            } else if let Some(reqs) = v["requests"].as_array() {
                for r in reqs {
                    let mut r = r.clone();
                    r["process"] = v["process"].clone();
                    r["worker"] = json!(url);
                    c.hops.push(r);
                }
            }
        }
        self.collect_maybe_done(id, false, Instant::now());
    }

    /// Answers the collections whose deadline has passed with what came back.
    pub(crate) fn collects_due(&mut self, now: Instant) {
        let due: Vec<u64> =
            self.collects.iter().filter(|(_, c)| c.deadline <= now).map(|(&id, _)| id).collect();
        for id in due {
            self.collect_maybe_done(id, true, now);
        }
    }

    fn collect_maybe_done(&mut self, id: u64, timed_out: bool, now: Instant) {
        let Some(c) = self.collects.get(&id) else { return };
        if c.pending > 0 && !timed_out {
            return;
        }
        let Some(c) = self.collects.remove(&id) else { return };
        let older_than = match &c.what {
            Collecting::Requests { older_than } => *older_than,
            Collecting::Models { id: model } => {
                let model = model.clone();
                return self.answer_models(c, model.as_deref());
            }
        };
        let mut body = self.ledger.debug_json(now, unix_ms(), older_than);
        if let Some(reqs) = body["requests"].as_array_mut() {
            for r in reqs.iter_mut() {
                let rid = r["id"].as_str().unwrap_or("").to_owned();
                // A moved request's later tries are `{id}.m{n}` at their workers.
                let tries = format!("{rid}.m");
                let hops: Vec<_> = c
                    .hops
                    .iter()
                    .filter(|h| h["id"].as_str().is_some_and(|h| h == rid || h.starts_with(&tries)))
                    .cloned()
                    .collect();
                r["hops"] = json!(hops);
                if let Some(e) = self.by_rid.get(&rid).and_then(|id| self.flights.get(id)) {
                    r["routing"] = self.routing_json(&e.routing);
                    if e.admitted {
                        // unified, disaggregated, decode_local (the decode worker computes the tail)
                        r["plan"] = json!(e.flight.plan().as_str());
                    }
                    let moves: Vec<_> = e.flight.migrations().iter().map(|m| m.as_str()).collect();
                    r["migrations"] = json!(moves);
                }
            }
        }
        let mut workers = c.workers;
        if timed_out {
            let msg = format!(
                "{} workers did not answer within {} ms",
                c.pending,
                ms(self.cfg.debug_fanout_timeout)
            );
            workers.push(json!({"error": msg}));
        }
        body["workers"] = json!(workers);
        self.respond(c.conn, &pdserve_http::Response::json(200, body.to_string()));
    }

    /// `/v1/models` from the workers' answers: one entry per model id, with the workers serving it
    /// (for a worker that did not answer, `workers_unanswered` names it). With `model`, that one
    /// model's entry or 404.
    fn answer_models(&mut self, c: Collect, model: Option<&str>) {
        let mut models: Vec<Value> = Vec::new();
        for m in &c.hops {
            let Some(mid) = m["id"].as_str() else { continue };
            let worker = json!({
                "url": m["worker"], "role": m["role"], "device": m["device"], "weights": m["weights"],
                "kv_dtype": m["kv_dtype"], "weight_bytes": m["weight_bytes"], "kv_bytes": m["kv_bytes"],
                "kv_bytes_per_token": m["kv_bytes_per_token"], "max_model_len": m["max_model_len"],
            });
            match models.iter_mut().find(|e| e["id"] == mid) {
                Some(e) => {
                    // A model's context is what every worker serving it takes.
                    if let (Some(a), Some(b)) = (e["max_model_len"].as_u64(), m["max_model_len"].as_u64()) {
                        e["max_model_len"] = json!(a.min(b));
                    }
                    if let Some(list) = e["workers"].as_array_mut() {
                        list.push(worker);
                    }
                }
                None => models.push(json!({
                    "id": mid, "object": "model", "created": m["created"], "owned_by": "pdserve",
                    "max_model_len": m["max_model_len"], "workers": [worker],
                })),
            }
        }
        let unanswered: Vec<&Value> = c.workers.iter().filter(|w| w.get("error").is_some()).collect();
        let rid = Some(c.rid.as_str());
        let resp = match model {
            None => {
                let mut body = json!({"object": "list", "data": models});
                if !unanswered.is_empty() {
                    body["workers_unanswered"] = json!(unanswered);
                }
                pdserve_http::Response::json(200, body.to_string())
            }
            Some(want) => match models.into_iter().find(|m| m["id"] == want) {
                Some(m) => pdserve_http::Response::json(200, m.to_string()),
                None => {
                    let msg = format!("model {want:?} is not served by any worker of this router");
                    let e = pdserve_api::ApiError::new(pdserve_api::ErrorKind::ModelNotFound, msg);
                    pdserve_http::Response::error(&e, rid)
                }
            },
        };
        let resp = resp.header(pdserve_api::header::REQUEST_ID, &c.rid);
        self.respond(c.conn, &resp);
    }

    /// Why each leg went where it went: the rule, and per candidate the prompt bytes its prefix tree
    /// matched (the router's estimate of what that worker holds cached) or, for a worker publishing
    /// KV events, the share its cache holds (`match_source`: `kv_events`).
    fn routing_json(&self, routing: &[(LegKind, Choice)]) -> Value {
        let url = |w: u32| self.workers.get(w).map_or_else(|| format!("worker {w}"), |w| w.url.clone());
        json!(routing
            .iter()
            .map(|(kind, c)| json!({
                "leg": kind.role().as_str(),
                "worker": url(c.worker),
                "rule": c.rule,
                "prompt_bytes": c.prompt_bytes,
                "match_source": c.source,
                "candidates": c.matched.iter().map(|&(w, m)| json!({"worker": url(w), "matched_prefix_bytes": m})).collect::<Vec<_>>(),
            }))
            .collect::<Vec<_>>())
    }
}
