//! The worker registry: each worker's address, role, breaker, load and pooled connections.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use pdserve_telemetry::Gauge;
use serde_json::json;

use crate::error::{RouterError, UrlProblem};
use crate::health::{Breaker, BreakerConfig, BreakerState};
use pdserve_api::Role;

#[derive(Debug)]
pub(crate) struct Worker {
    pub id: u32,
    pub url: String,
    pub addr: SocketAddr,
    /// `host:port`, for the Host header.
    pub authority: String,
    pub role: Role,
    pub breaker: Breaker,
    /// When a probe request last went through a prefill + decode pair holding this worker.
    pub path_ok: Option<Instant>,
    /// Requests (legs) in flight to it.
    pub outstanding: u32,
    /// Open connections, busy or idle.
    pub connections: usize,
    /// Pooled idle connections (upstream slots), most recently used last.
    pub idle: Vec<usize>,
    /// Removed by `DELETE /workers`: takes no new requests and leaves once `outstanding` is zero.
    pub draining: bool,
    /// A health probe is out.
    pub probing: bool,
    /// The `--discover` source (an index into the router's list) that found it; `None`: named by a
    /// flag or `POST /workers`.
    pub source: Option<usize>,
    pub requests_total: u64,
    pub in_flight_gauge: Gauge,
    pub connections_gauge: Gauge,
}

impl Worker {
    pub fn routable(&self) -> bool {
        !self.draining && self.breaker.routable()
    }

    pub fn state_str(&self) -> &'static str {
        if self.draining {
            "draining"
        } else {
            match self.breaker.state() {
                BreakerState::Closed => "up",
                BreakerState::Open => "down",
            }
        }
    }

    pub fn to_json(&self, now: Instant, sources: &[crate::DiscoverSpec]) -> serde_json::Value {
        let source = self.source.and_then(|s| sources.get(s));
        let ago = |t: Option<Instant>| t.map(|t| now.saturating_duration_since(t).as_millis() as u64);
        json!({
            "id": self.id,
            "url": self.url,
            "role": self.role.as_str(),
            "state": self.state_str(),
            "state_age_ms": now.saturating_duration_since(self.breaker.since()).as_millis() as u64,
            "in_flight": self.outstanding,
            "connections": self.connections,
            "idle_connections": self.idle.len(),
            "requests_total": self.requests_total,
            "last_probe_ok_ago_ms": ago(self.breaker.last_probe_ok()),
            "last_path_ok_ago_ms": ago(self.path_ok),
            "last_error": self.breaker.last_error(),
            "discovered_by": source.map(|s| format!("dns:{}:{}", s.name, s.port)),
        })
    }
}

/// Parses `http://host:port[/]` and resolves it (once, when the worker is added).
pub(crate) fn resolve(url: &str) -> Result<(String, SocketAddr, String), RouterError> {
    let bad = |problem| RouterError::BadWorkerUrl { url: url.to_owned(), problem };
    let rest = url.strip_prefix("http://").ok_or_else(|| bad(UrlProblem::NotHttp))?;
    let authority = rest.trim_end_matches('/');
    if authority.is_empty() || authority.contains('/') {
        return Err(bad(UrlProblem::NotHostPort));
    }
    let with_port = if authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
        authority.to_owned()
    } else {
        format!("{authority}:80")
    };
    let addr = with_port
        .to_socket_addrs()
        .map_err(|e| bad(UrlProblem::DoesNotResolve(e.to_string())))?
        .next()
        .ok_or_else(|| bad(UrlProblem::NoAddress))?;
    Ok((format!("http://{authority}"), addr, authority.to_owned()))
}

/// All workers; ids are never reused, so a late event for a removed worker finds nothing.
#[derive(Debug, Default)]
pub(crate) struct Workers {
    slots: Vec<Option<Worker>>,
}

impl Workers {
    pub fn add(
        &mut self,
        url: &str,
        role: Role,
        breaker: BreakerConfig,
        now: Instant,
        gauges: (Gauge, Gauge),
    ) -> Result<u32, RouterError> {
        let (url, addr, authority) = resolve(url)?;
        if self.iter().any(|w| w.url == url) {
            return Err(RouterError::DuplicateWorker { url });
        }
        let id = self.slots.len() as u32;
        self.slots.push(Some(Worker {
            id,
            url,
            addr,
            authority,
            role,
            breaker: Breaker::new(breaker, now),
            path_ok: None,
            outstanding: 0,
            connections: 0,
            idle: Vec::new(),
            draining: false,
            probing: false,
            source: None,
            requests_total: 0,
            in_flight_gauge: gauges.0,
            connections_gauge: gauges.1,
        }));
        Ok(id)
    }

    pub fn get(&self, id: u32) -> Option<&Worker> {
        self.slots.get(id as usize)?.as_ref()
    }

    pub fn get_mut(&mut self, id: u32) -> Option<&mut Worker> {
        self.slots.get_mut(id as usize)?.as_mut()
    }

    pub fn remove(&mut self, id: u32) -> Option<Worker> {
        self.slots.get_mut(id as usize)?.take()
    }

    pub fn by_url(&self, url: &str) -> Option<u32> {
        let url = url.trim_end_matches('/');
        self.iter().find(|w| w.url == url).map(|w| w.id)
    }

    pub fn iter(&self) -> impl Iterator<Item = &Worker> {
        self.slots.iter().flatten()
    }

    pub fn ids(&self) -> Vec<u32> {
        self.iter().map(|w| w.id).collect()
    }

    /// Whether a complete path has proven itself within `window`: a unified worker whose probe passed,
    /// or a prefill and a decode worker that a pair probe went through.
    pub fn path_ready(&self, window: Duration, pair_window: Duration, now: Instant) -> Result<(), String> {
        let recent = |t: Option<Instant>| t.is_some_and(|t| now.saturating_duration_since(t) <= pair_window);
        if self
            .iter()
            .any(|w| w.role == Role::Unified && w.routable() && w.breaker.proven_within(window, now))
        {
            return Ok(());
        }
        let p = self.iter().any(|w| w.role == Role::Prefill && w.routable() && recent(w.path_ok));
        let d = self.iter().any(|w| w.role == Role::Decode && w.routable() && recent(w.path_ok));
        if p && d {
            return Ok(());
        }
        let count = |r: Role| self.iter().filter(|w| w.role == r).count();
        let up = |r: Role| self.iter().filter(|w| w.role == r && w.routable()).count();
        Err(format!(
            "no working path: unified {}/{} up, prefill {}/{} up, decode {}/{} up, none proven (a unified worker by its probe in the last {} ms, a prefill and decode pair by a request or pair probe through it in the last {} ms)",
            up(Role::Unified),
            count(Role::Unified),
            up(Role::Prefill),
            count(Role::Prefill),
            up(Role::Decode),
            count(Role::Decode),
            window.as_millis(),
            pair_window.as_millis()
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls() {
        let (url, addr, auth) = resolve("http://127.0.0.1:8101/").unwrap();
        assert_eq!(
            (url.as_str(), addr.port(), auth.as_str()),
            ("http://127.0.0.1:8101", 8101, "127.0.0.1:8101")
        );
        let problem = |url| match resolve(url) {
            Err(RouterError::BadWorkerUrl { problem, .. }) => problem,
            other => panic!("{url}: {other:?}"),
        };
        assert_eq!(problem("https://x:1"), UrlProblem::NotHttp);
        assert_eq!(problem("http://127.0.0.1:1/v1"), UrlProblem::NotHostPort);
        assert!(resolve("https://x:1").unwrap_err().to_string().contains("http://"));
        assert_eq!(resolve("http://localhost").unwrap().1.port(), 80);
    }
}
