//! `GET /debug/requests` on the router: its own ledger, with each request's entries on every worker
//! (asked in parallel, under a deadline) nested as `hops`.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pdserve_http::{write_request_head, ConnId, Request, ResponseEvent};
use serde_json::{json, Value};

use crate::flight::LegKind;
use crate::router::{ms, unix_ms, Router};
use crate::upstream::Owner;
use crate::Choice;

/// One `/debug/requests` call waiting for its workers.
#[derive(Debug)]
pub(crate) struct Collect {
    pub conn: ConnId,
    older_than: Duration,
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
        let id = self.new_id();
        let mut c = Collect {
            conn,
            older_than,
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
            write_request_head(&mut req, "GET", pdserve_api::path::DEBUG_REQUESTS, &headers, 0);
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
                match serde_json::from_slice::<Value>(&raw) {
                    Ok(v) => {
                        let summary = json!({"url": url, "process": v["process"], "ok": true});
                        self.collect_done(id, summary, Some((url, v)))
                    }
                    Err(_) => self.collect_done(
                        id,
                        json!({"url": url, "error": "unreadable /debug/requests answer"}),
                        None,
                    ),
                }
            }
        }
    }

    pub(crate) fn collect_done(&mut self, id: u64, worker: Value, answer: Option<(String, Value)>) {
        let Some(c) = self.collects.get_mut(&id) else { return };
        c.pending = c.pending.saturating_sub(1);
        c.workers.push(worker);
        if let Some((url, v)) = answer {
            if let Some(reqs) = v["requests"].as_array() {
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
        let mut body = self.ledger.debug_json(now, unix_ms(), c.older_than);
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

    /// Why each leg went where it went: the rule, and per candidate the prompt bytes its prefix tree
    /// matched (the router's estimate of what that worker holds cached).
    fn routing_json(&self, routing: &[(LegKind, Choice)]) -> Value {
        let url = |w: u32| self.workers.get(w).map_or_else(|| format!("worker {w}"), |w| w.url.clone());
        json!(routing
            .iter()
            .map(|(kind, c)| json!({
                "leg": kind.role().as_str(),
                "worker": url(c.worker),
                "rule": c.rule,
                "prompt_bytes": c.prompt_bytes,
                "candidates": c.matched.iter().map(|&(w, m)| json!({"worker": url(w), "matched_prefix_bytes": m})).collect::<Vec<_>>(),
            }))
            .collect::<Vec<_>>())
    }
}
