//! The circuit breaker of one worker: probes and request outcomes in, "may we route here" out.
//! Sans-IO; the router's loop feeds it.

use std::time::{Duration, Instant};

/// Thresholds of the breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive request failures (not connect refusals, which open at once) that open the breaker.
    pub failures_to_open: u32,
    /// Consecutive successful probes that close it again.
    pub probes_to_close: u32,
    /// Consecutive probes a live worker answers with "not ready" that open it. A probe that gets no
    /// answer at all (refused, reset, timed out) opens it at once.
    pub not_ready_to_open: u32,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig { failures_to_open: 3, probes_to_close: 1, not_ready_to_open: 2 }
    }
}

/// Closed: traffic flows. Open: the worker is out of rotation until probes succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
}

#[derive(Debug, Clone)]
pub struct Breaker {
    config: BreakerConfig,
    state: BreakerState,
    since: Instant,
    failures: u32,
    probe_successes: u32,
    not_ready: u32,
    last_probe_ok: Option<Instant>,
    last_error: Option<String>,
}

impl Breaker {
    /// A new worker starts closed (routable) but unproven: readiness waits for its first probe.
    pub fn new(config: BreakerConfig, now: Instant) -> Self {
        Breaker {
            config,
            state: BreakerState::Closed,
            since: now,
            failures: 0,
            probe_successes: 0,
            not_ready: 0,
            last_probe_ok: None,
            last_error: None,
        }
    }

    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// When the state last changed.
    pub fn since(&self) -> Instant {
        self.since
    }

    pub fn routable(&self) -> bool {
        self.state == BreakerState::Closed
    }

    pub fn last_error(&self) -> Option<&str> {
        self.last_error.as_deref()
    }

    pub fn last_probe_ok(&self) -> Option<Instant> {
        self.last_probe_ok
    }

    /// True if a probe succeeded within `window` and the breaker is closed.
    pub fn proven_within(&self, window: Duration, now: Instant) -> bool {
        self.routable() && self.last_probe_ok.is_some_and(|t| now.saturating_duration_since(t) <= window)
    }

    fn set(&mut self, state: BreakerState, now: Instant) {
        if self.state != state {
            self.state = state;
            self.since = now;
        }
    }

    pub fn probe_ok(&mut self, now: Instant) {
        self.last_probe_ok = Some(now);
        self.failures = 0;
        self.not_ready = 0;
        self.probe_successes += 1;
        if self.probe_successes >= self.config.probes_to_close {
            self.set(BreakerState::Closed, now);
        }
    }

    /// A failed probe opens the breaker at once: the probe is the real path under a short deadline.
    pub fn probe_failed(&mut self, now: Instant, why: String) {
        self.probe_successes = 0;
        self.not_ready = 0;
        self.last_error = Some(why);
        self.set(BreakerState::Open, now);
    }

    /// The worker answered its probe, but with "not ready" (busy past its own bound, or draining). A
    /// run of `not_ready_to_open` such answers opens the breaker.
    pub fn probe_not_ready(&mut self, now: Instant, why: String) {
        self.probe_successes = 0;
        self.not_ready += 1;
        self.last_error = Some(why);
        if self.not_ready >= self.config.not_ready_to_open {
            self.set(BreakerState::Open, now);
        }
    }

    /// A request through this worker finished without a worker fault.
    pub fn request_ok(&mut self) {
        self.failures = 0;
    }

    /// A request through this worker failed for a reason of the worker's (reset, garbage, no answer).
    /// `hard` (the connection was refused) opens the breaker at once.
    pub fn request_failed(&mut self, now: Instant, why: String, hard: bool) {
        self.failures += 1;
        self.last_error = Some(why);
        if hard || self.failures >= self.config.failures_to_open {
            self.probe_successes = 0;
            self.set(BreakerState::Open, now);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusal_opens_at_once_and_probes_close() {
        let t = Instant::now();
        let mut b =
            Breaker::new(BreakerConfig { failures_to_open: 3, probes_to_close: 2, not_ready_to_open: 2 }, t);
        assert!(b.routable());
        assert!(!b.proven_within(Duration::from_secs(1), t), "unproven until a probe");
        b.request_failed(t, "refused".into(), true);
        assert!(!b.routable());
        assert_eq!(b.last_error(), Some("refused"));
        b.probe_ok(t);
        assert!(!b.routable(), "one probe is not enough with probes_to_close = 2");
        b.probe_ok(t + Duration::from_millis(5));
        assert!(b.routable());
        assert!(b.proven_within(Duration::from_secs(1), t + Duration::from_millis(10)));
        assert!(!b.proven_within(Duration::from_secs(1), t + Duration::from_secs(3)));
    }

    #[test]
    fn soft_failures_need_a_run() {
        let t = Instant::now();
        let mut b = Breaker::new(BreakerConfig::default(), t);
        b.request_failed(t, "reset".into(), false);
        b.request_failed(t, "reset".into(), false);
        b.request_ok();
        b.request_failed(t, "reset".into(), false);
        b.request_failed(t, "reset".into(), false);
        assert!(b.routable(), "a success in between resets the run");
        b.request_failed(t, "reset".into(), false);
        assert!(!b.routable());
        b.probe_failed(t, "probe timed out".into());
        assert_eq!(b.state(), BreakerState::Open);
    }

    #[test]
    fn one_not_ready_answer_is_tolerated() {
        let t = Instant::now();
        let mut b = Breaker::new(BreakerConfig::default(), t);
        b.probe_not_ready(t, "busy".into());
        assert!(b.routable());
        b.probe_ok(t);
        b.probe_not_ready(t, "busy".into());
        assert!(b.routable(), "the run was broken by a good probe");
        b.probe_not_ready(t, "busy".into());
        assert!(!b.routable());
    }
}
