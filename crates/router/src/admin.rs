//! The router's own API: keys, health, metrics, and the worker registry (`GET/POST/DELETE /workers`).

use std::time::{Duration, Instant};

use pdserve_api::{header, path, ApiError, ErrorKind, Health, Outcome, Role, Stage};
use pdserve_http::{ConnId, Request, Response};
use serde_json::json;

use crate::discovery::Resolved;
use crate::router::Router;
use crate::RouterError;

use pdserve_api::header::secret_matches as key_matches;

impl Router {
    /// Checks the API key (`/v1/*`) or the admin key (`/workers`, `/debug/*`, `/abort/*`); answers 401
    /// and returns false if it is wrong.
    pub(crate) fn authorized(&mut self, conn: ConnId, req: &Request, rid: &str) -> bool {
        let path = req.path();
        let admin =
            path.starts_with("/workers") || path.starts_with("/debug/") || path.starts_with("/abort/");
        let key = if admin {
            self.cfg.admin_key.as_deref()
        } else if path.starts_with("/v1/") {
            self.cfg.api_key.as_deref()
        } else {
            None
        };
        let Some(key) = key else { return true };
        // `Authorization: Bearer KEY` (OpenAI's clients) or `x-api-key: KEY` (Anthropic's).
        let bearer = req.header_str(header::AUTHORIZATION).and_then(|h| h.strip_prefix("Bearer "));
        if key_matches(bearer, key) || key_matches(req.header_str(header::API_KEY), key) {
            return true;
        }
        self.metrics.finished(Outcome::Rejected, Stage::RouterQueued);
        let e = ApiError::new(
            ErrorKind::Unauthorized,
            "missing or wrong API key (Authorization: Bearer ... or x-api-key)",
        );
        self.respond(conn, &Response::error_at(req.path(), &e, Some(rid)));
        false
    }

    /// Every route that is not a flight.
    pub(crate) fn admin(&mut self, conn: ConnId, req: &Request, rid: &str, now: Instant) {
        let path = req.path().to_owned();
        let method = req.method.as_str();
        match (method, path.as_str()) {
            ("GET", path::HEALTH_LIVE) => self.respond(conn, &Response::health(&Health::Live, Some(rid))),
            ("GET", path::HEALTH_READY | path::HEALTH) => {
                let ready = match self.draining_since {
                    Some(_) => Err(format!("draining: {} requests in flight", self.flights.len())),
                    None => self.workers.path_ready(self.ready_window(), self.pair_window(), now),
                };
                let health = match ready {
                    Ok(()) => Health::Ready { details: json!({"workers": self.workers.iter().count()}) },
                    Err(reason) => Health::NotReady { reason },
                };
                self.respond(conn, &Response::health(&health, Some(rid)));
            }
            ("GET", path::METRICS) => {
                self.refresh_gauges();
                let resp = Response::text(200, self.metrics.registry.render())
                    .header("content-type", "text/plain; version=0.0.4; charset=utf-8");
                self.respond(conn, &resp);
            }
            ("GET", path::DEBUG_REQUESTS) => self.start_collect(conn, req, now),
            ("GET", "/workers") => {
                let list: Vec<_> = self
                    .workers
                    .iter()
                    .map(|w| {
                        let mut j = w.to_json(now, &self.cfg.discover);
                        // What its KV events say it holds (`--tokenizer`), where they are followed.
                        if let (Some(kv), Some(o)) = (self.kv.as_ref(), j.as_object_mut()) {
                            let (blocks, history) = kv.known(w.id);
                            o.insert("kv_event_blocks".into(), blocks.into());
                            o.insert("kv_event_history".into(), history.into());
                        }
                        j
                    })
                    .collect();
                self.respond_json(conn, 200, &json!({"workers": list}), rid);
            }
            ("POST", "/workers") => self.post_worker(conn, req, rid, now),
            ("DELETE", p) if p == "/workers" || p.starts_with("/workers/") => {
                self.delete_worker(conn, req, rid)
            }
            _ => {
                let e = path::no_route(method, &path, &["/workers"]);
                self.respond(conn, &Response::error(&e, Some(rid)));
            }
        }
    }

    fn respond_json(&mut self, conn: ConnId, status: u16, body: &serde_json::Value, rid: &str) {
        let resp = Response::json(status, body.to_string()).header(header::REQUEST_ID, rid);
        self.respond(conn, &resp);
    }

    pub(crate) fn ready_window(&self) -> Duration {
        self.cfg.probe_interval * 2 + self.cfg.probe_timeout
    }

    pub(crate) fn pair_window(&self) -> Duration {
        self.cfg.pair_probe_interval.max(self.cfg.probe_interval) * 2 + self.cfg.probe_timeout
    }

    /// Registers a worker; it is probed (and a pair through it) on the next turn.
    pub(crate) fn add_worker(&mut self, url: &str, role: Role, now: Instant) -> Result<u32, RouterError> {
        let (canonical, _, _) = crate::workers::resolve(url)?;
        let labels = [canonical.as_str(), role.as_str()];
        let gauges = (
            self.metrics.worker_in_flight.with(&labels).map_err(RouterError::Metrics)?,
            self.metrics.worker_connections.with(&labels).map_err(RouterError::Metrics)?,
        );
        if self.workers.by_url(&canonical).is_some() {
            return Err(RouterError::DuplicateWorker { url: canonical });
        }
        let id = self.workers.add(url, role, self.cfg.breaker, now, gauges)?;
        self.next_probe = now;
        self.next_pair_probe = now;
        Ok(id)
    }

    fn post_worker(&mut self, conn: ConnId, req: &Request, rid: &str, now: Instant) {
        #[derive(serde::Deserialize)]
        struct Add {
            url: String,
            #[serde(default)]
            role: Option<String>,
        }
        let result = serde_json::from_slice::<Add>(&req.body)
            .map_err(|e| ApiError::invalid(format!("body must be {{\"url\": ..., \"role\": ...}}: {e}")))
            .and_then(|a| {
                let role = match a.role.as_deref() {
                    None => Role::Unified,
                    Some(r) => Role::parse(r).ok_or_else(|| {
                        ApiError::invalid(format!("unknown role {r:?} (unified, prefill, decode)"))
                    })?,
                };
                self.add_worker(&a.url, role, now).map_err(|e| match e {
                    RouterError::DuplicateWorker { .. } => ApiError::new(ErrorKind::Conflict, e.to_string()),
                    _ => ApiError::invalid(e.to_string()),
                })
            });
        match result {
            Ok(id) => {
                let body =
                    self.workers.get(id).map(|w| w.to_json(now, &self.cfg.discover)).unwrap_or_default();
                eprintln!("router: worker added: {body}");
                self.respond_json(conn, 201, &body, rid);
            }
            Err(e) => self.respond(conn, &Response::error(&e, Some(rid))),
        }
    }

    fn delete_worker(&mut self, conn: ConnId, req: &Request, rid: &str) {
        let from_query = req
            .query()
            .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("url=")))
            .map(|u| u.replace("%3A", ":").replace("%2F", "/").replace("%3a", ":").replace("%2f", "/"));
        let from_body = serde_json::from_slice::<serde_json::Value>(&req.body)
            .ok()
            .and_then(|v| v.get("url").and_then(|u| u.as_str()).map(str::to_owned));
        let from_path = req.path().strip_prefix("/workers/").and_then(|id| id.parse::<u32>().ok());
        let id = match (from_path, from_query.or(from_body)) {
            (Some(id), _) => self.workers.get(id).map(|w| w.id),
            (None, Some(url)) => self.workers.by_url(&url),
            (None, None) => {
                let e =
                    ApiError::invalid("say which worker: DELETE /workers/{id}, ?url=..., or {\"url\": ...}");
                return self.respond(conn, &Response::error(&e, Some(rid)));
            }
        };
        let Some(w) = id.and_then(|id| self.workers.get_mut(id)) else {
            let e = ApiError::new(ErrorKind::NotFound, "no such worker");
            return self.respond(conn, &Response::error(&e, Some(rid)));
        };
        let id = w.id;
        let (url, draining) = self.drain_worker(id, "removed");
        self.respond_json(conn, 200, &json!({"removed": url, "draining_requests": draining}), rid);
    }

    /// Takes a worker out of rotation; it leaves once its requests in flight have finished (all of
    /// them: nothing in flight is dropped). Returns its URL and how many requests it still has.
    fn drain_worker(&mut self, id: u32, why: &str) -> (String, u32) {
        let Some(w) = self.workers.get_mut(id) else { return (String::new(), 0) };
        w.draining = true;
        let (url, draining) = (w.url.clone(), w.outstanding);
        eprintln!("router: worker {url} {why}; draining {draining} requests");
        self.policy.forget(id);
        self.decode_policy.forget(id);
        self.sweep_workers();
        (url, draining)
    }

    /// One DNS answer for `--discover` source `r.source`: addresses new to it join (a draining one
    /// of its own comes back), its workers whose address is gone drain. A failed lookup changes
    /// nothing: a DNS outage must not empty the pool.
    pub(crate) fn apply_discovery(&mut self, r: Resolved, now: Instant) {
        let Some(spec) = self.cfg.discover.get(r.source).cloned() else { return };
        let label = format!("dns:{}:{}", spec.name, spec.port);
        let addrs = match r.result {
            Ok(a) => a,
            Err(e) => {
                self.metrics.discovery_lookup(&label, "failed");
                if self.discovery_failing.insert(r.source) {
                    eprintln!("router: discovery {label}: lookup failed, workers kept as they are: {e}");
                }
                return;
            }
        };
        if self.discovery_failing.remove(&r.source) {
            eprintln!("router: discovery {label}: lookups answer again");
        }
        self.metrics.discovery_lookup(&label, "ok");
        if let Ok(g) = self.metrics.discovery_addresses.with(&[&label]) {
            g.set(addrs.len() as f64);
        }
        let urls: Vec<String> = addrs.iter().map(|&ip| spec.url(ip)).collect();
        for url in &urls {
            match self.workers.by_url(url).and_then(|id| self.workers.get_mut(id)) {
                Some(w) if w.draining && w.source == Some(r.source) => {
                    w.draining = false;
                    eprintln!("router: discovery {label}: {url} is back");
                }
                Some(_) => {}
                None => match self.add_worker(url, spec.role, now) {
                    Ok(id) => {
                        if let Some(w) = self.workers.get_mut(id) {
                            w.source = Some(r.source);
                        }
                        eprintln!("router: discovery {label}: {url} added as {}", spec.role.as_str());
                    }
                    Err(e) => eprintln!("router: discovery {label}: {url} not added: {e}"),
                },
            }
        }
        let gone: Vec<u32> = self
            .workers
            .iter()
            .filter(|w| w.source == Some(r.source) && !w.draining && !urls.contains(&w.url))
            .map(|w| w.id)
            .collect();
        for id in gone {
            self.drain_worker(id, &format!("left {label}"));
        }
    }

    fn refresh_gauges(&self) {
        self.metrics.in_flight.set(self.admission.in_flight() as f64);
        self.metrics.queued.set(self.admission.queued() as f64);
        self.metrics.client_connections.set(self.server.connection_count() as f64);
        for role in Role::ALL {
            for state in ["up", "down", "draining"] {
                let n = self.workers.iter().filter(|w| w.role == role && w.state_str() == state).count();
                if let Ok(g) = self.metrics.workers_up.with(&[role.as_str(), state]) {
                    g.set(n as f64);
                }
            }
        }
        for w in self.workers.iter() {
            w.in_flight_gauge.set(f64::from(w.outstanding));
            w.connections_gauge.set(w.connections as f64);
        }
        // The exporter's counts, read at each scrape (a batch may fail after the last request ended).
        if let Some(x) = self.traces.as_ref() {
            for (result, total) in x.stats().spans_by_result() {
                if let Ok(c) = self.metrics.otlp_spans.with(&[result]) {
                    c.add(total.saturating_sub(c.get()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::key_matches;

    #[test]
    fn keys() {
        assert!(key_matches(Some("s3cret"), "s3cret"));
        assert!(!key_matches(Some("s3cre"), "s3cret"));
        assert!(!key_matches(Some("s3cretx"), "s3cret"));
        assert!(!key_matches(Some("Bearer s3cret"), "s3cret"));
        assert!(!key_matches(None, "s3cret"));
    }
}
