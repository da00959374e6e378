//! Legs that fail before or without doing their work: a refused connect, a stale pooled connection,
//! a draining worker's `not_ready` answer (sent again to another worker), and a connection that
//! broke (a migration, or the request's explicit error).

use pdserve_api::{ApiError, ErrorKind};

use super::migrate::Migration;
use super::{Flight, Head, LegFailure, LegId, LegKind, Plan, Purpose, Retry, State};

impl Flight {
    /// The leg could not go out, or failed after it did.
    pub fn handle_leg_failed(&mut self, leg: LegId, failure: LegFailure) {
        let kind = match self.state {
            State::Opening { leg: l, kind } | State::Open { leg: l, kind, .. } if l == leg => kind,
            _ => return,
        };
        let worker = self.worker();
        self.state = State::Waiting;
        if matches!(failure, LegFailure::NoWorker { .. } | LegFailure::Refused { .. } | LegFailure::Stale) {
            // A decode-local leg its worker never took: through a prefill worker instead (never the
            // whole prompt to a decode worker that does not hold the conversation).
            if self.local_fell_through(kind) {
                if let (LegFailure::Stale, Some(w)) = (&failure, worker) {
                    self.reached.retain(|r| r.worker != w);
                }
                return;
            }
        }
        match failure {
            LegFailure::NoWorker { reason } => match self.draining_answer.take() {
                // Every other worker is gone too: the client hears the draining worker's own answer.
                Some(refusal) => self.fail(refusal.with_retry_after(1)),
                None => self.fail(ApiError::new(ErrorKind::NoCapacity, reason).with_retry_after(1)),
            },
            LegFailure::Refused { worker, reason } => {
                // Nothing was sent: another worker may take it.
                self.reached.retain(|r| r.worker != worker);
                self.refused.push(worker);
                let tries = self.refused.len() as u32;
                if tries <= self.spec.retries_max {
                    self.open(kind, Some(Retry::Refused));
                } else {
                    let msg = format!("{tries} connect attempts failed; last: {reason}");
                    self.fail(ApiError::new(ErrorKind::NoCapacity, msg).with_retry_after(1));
                }
            }
            LegFailure::Stale if !self.stale_retried => {
                // The worker closed that connection while it was idle and never took the request.
                self.stale_retried = true;
                if let Some(w) = worker {
                    self.reached.retain(|r| r.worker != w);
                }
                self.open(kind, Some(Retry::Stale));
            }
            LegFailure::Stale => {
                let msg = "a second pooled connection failed before any answer".to_owned();
                self.leg_broke(kind, worker, msg);
            }
            LegFailure::Broken { reason } => self.leg_broke(kind, worker, reason),
        }
    }

    fn leg_broke(&mut self, kind: LegKind, worker: Option<u32>, reason: String) {
        if self.can_migrate() {
            let cause = if kind == LegKind::Prefill { Migration::PrefillLost } else { Migration::DecodeLost };
            return self.migrate(cause, worker);
        }
        let which = match kind {
            LegKind::Prefill => "prefill worker",
            LegKind::Decode => "decode worker",
            LegKind::Main => "worker",
        };
        let at = worker.map_or(String::new(), |w| format!(" {w}"));
        self.fail(ApiError::new(ErrorKind::UpstreamFailed, format!("{which}{at} failed: {reason}")));
    }

    /// A client request's refusal by a draining worker (503 `not_ready`) that another worker may
    /// take instead, within the retry budget: the worker's error.
    pub(super) fn draining_refusal(&self, head: &Head, body: &[u8], worker: u32) -> Option<ApiError> {
        let retry = head.status == 503
            && self.spec.purpose == Purpose::Client
            && (self.refused.len() as u32) < self.spec.retries_max
            && !self.refused.contains(&worker);
        ApiError::parse(body).filter(|e| retry && e.kind == ErrorKind::NotReady)
    }

    /// A decode-local leg that did not do its work (refused for load, a refused or stale connection,
    /// a draining worker, no worker at all) goes on as [`Plan::Disaggregated`]: a prefill leg now.
    /// Whether it did (false for any other leg).
    pub(super) fn local_fell_through(&mut self, kind: LegKind) -> bool {
        if self.plan != Plan::DecodeLocal || kind != LegKind::Decode || self.streaming || self.is_done() {
            return false;
        }
        self.plan = Plan::Disaggregated;
        self.refused.clear();
        self.draining_answer = None;
        self.stale_retried = false;
        self.open(LegKind::Prefill, None);
        true
    }
}
