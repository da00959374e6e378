//! Active health checks: a probe per worker every interval (`/health/generate` for unified workers,
//! `/health/ready` for the others), and pair probes, real 2-token requests through a prefill and a
//! decode worker, which prove the path between them.

use std::time::Instant;

use pdserve_api::{header, path, Role};
use pdserve_http::{write_request_head, ResponseEvent};

use crate::router::Router;
use crate::upstream::{AcquireError, Owner};

impl Router {
    pub(crate) fn run_probes(&mut self, now: Instant) {
        self.next_probe = now + self.cfg.probe_interval;
        self.probe_round += 1;
        self.sync_kv_events();
        for wid in self.workers.ids() {
            let Some(w) = self.workers.get(wid) else { continue };
            if w.probing {
                continue; // the last one is still out; its own timer ends it
            }
            let path = if w.role == Role::Unified { path::HEALTH_GENERATE } else { path::HEALTH_READY };
            let authority = w.authority.clone();
            let mut req = Vec::with_capacity(128);
            let rid = format!("probe-{}-{wid}", self.probe_round);
            let mut headers = vec![("host", authority.as_str()), (header::REQUEST_ID, rid.as_str())];
            headers.extend(self.cfg.cluster_secret.as_deref().map(|s| (header::CLUSTER_SECRET, s)));
            write_request_head(&mut req, "GET", path, &headers, 0);
            if let Some(w) = self.workers.get_mut(wid) {
                w.probing = true;
            }
            let timer = now + self.cfg.probe_timeout;
            match self.send_aside(wid, Owner::Probe { worker: wid }, req, timer, now) {
                Ok(()) => {}
                Err(e @ AcquireError::Connect { .. }) => self.probe_failed(wid, &e.to_string(), now),
                // A full pool is a busy worker, not a failed probe.
                Err(_) => {
                    if let Some(w) = self.workers.get_mut(wid) {
                        w.probing = false;
                    }
                }
            }
        }
        // Pair probes through healthy prefill and decode workers: each prefill worker with some decode
        // worker and each decode worker with some prefill worker, rotating over rounds.
        if self.pair_probes_in_flight > 0 || now < self.next_pair_probe {
            return;
        }
        self.next_pair_probe = now + self.cfg.pair_probe_interval;
        let ids = |role: Role| -> Vec<u32> {
            self.workers.iter().filter(|w| w.role == role && w.routable()).map(|w| w.id).collect()
        };
        let (prefills, decodes) = (ids(Role::Prefill), ids(Role::Decode));
        if prefills.is_empty() || decodes.is_empty() {
            return;
        }
        for j in 0..prefills.len().max(decodes.len()) {
            let p = prefills[(j + self.probe_round) % prefills.len()];
            let d = decodes[j % decodes.len()];
            self.start_pair_probe(p, d, now);
        }
    }

    pub(crate) fn on_probe_event(&mut self, slot: usize, worker: u32, ev: ResponseEvent, now: Instant) {
        match ev {
            ResponseEvent::Head(h) => {
                if let Some(up) = self.ups.get_mut(slot) {
                    up.status = h.status;
                }
                return;
            }
            ResponseEvent::Data(_) => return,
            ResponseEvent::End => {}
        }
        let code = self.ups.get(slot).map_or(0, |u| u.status);
        self.ups.release(
            slot,
            self.server.registry(),
            &mut self.workers,
            now + self.cfg.idle_connection_timeout,
        );
        let ok = code == 200;
        self.metrics.probes.with(&["worker", if ok { "ok" } else { "failed" }]).map(|c| c.inc()).ok();
        if let Some(w) = self.workers.get_mut(worker) {
            w.probing = false;
            if ok {
                w.breaker.probe_ok(now);
            } else {
                w.breaker.probe_not_ready(now, format!("probe answered {code}"));
            }
        }
    }

    /// A probe got no answer (refused, reset, timed out): the worker is out at once.
    pub(crate) fn probe_failed(&mut self, worker: u32, err: &str, now: Instant) {
        self.metrics.probes.with(&["worker", "failed"]).map(|c| c.inc()).ok();
        if let Some(w) = self.workers.get_mut(worker) {
            w.probing = false;
            w.breaker.probe_failed(now, format!("probe: {err}"));
        }
    }

    /// Precise prefix routing (`--tokenizer`): a KV event listener per worker in the pool (draining
    /// ones leave), and the listeners' counts into `/metrics`.
    fn sync_kv_events(&mut self) {
        let Some(kv) = self.kv.as_mut() else { return };
        let workers: Vec<_> = self
            .workers
            .iter()
            .filter(|w| !w.draining)
            .map(|w| (w.id, w.addr, w.authority.clone()))
            .collect();
        kv.sync(&workers, self.cfg.cluster_secret.as_deref());
        let st = &kv.stats;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(std::sync::atomic::Ordering::Relaxed);
        for (result, total) in
            [("applied", load(&st.batches)), ("gap", load(&st.gaps)), ("failed", load(&st.failures))]
        {
            if let Ok(c) = self.metrics.kv_event_batches.with(&[result]) {
                c.add(total.saturating_sub(c.get()));
            }
        }
    }
}
