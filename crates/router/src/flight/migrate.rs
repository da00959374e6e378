//! Migration: how a flight moves to another worker when its own dies, stalls or loses the KV (see
//! the [parent module](super) for the guarantees), and how a marked stream passes through.

use std::time::Instant;

use pdserve_api::{pd, ApiError, ErrorKind, Stage};

use super::{ms, Action, Flight, LegKind, Plan, Purpose, State};

/// Why a request moved to another worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Migration {
    /// The prefill worker's connection broke before its answer.
    PrefillLost,
    /// The decode (or unified) worker's connection broke mid-answer.
    DecodeLost,
    /// The streaming worker sent nothing for the stall timeout.
    Stalled,
    /// The decode worker could not get the prompt's KV from the prefill worker.
    KvTransfer,
}

impl Migration {
    pub fn as_str(self) -> &'static str {
        match self {
            Migration::PrefillLost => "prefill_lost",
            Migration::DecodeLost => "decode_lost",
            Migration::Stalled => "stalled",
            Migration::KvTransfer => "kv_transfer",
        }
    }
}

/// A streamed answer with resume marks, as it passes through: events wait in `held` until the mark
/// that covers them arrives.
#[derive(Debug, Default)]
pub(super) struct Marked {
    /// Bytes of an event not complete yet.
    pub(super) partial: Vec<u8>,
    /// Complete events after the newest mark.
    pub(super) held: Vec<u8>,
    /// The worker said the request failed in a way another worker may not (the KV did not arrive).
    pub(super) retry: bool,
    /// `partial` holds no event end before this offset (each byte is looked at once).
    pub(super) scanned: usize,
}

impl Flight {
    /// A marked stream's bytes: whole events wait for the mark that covers them, then go to the
    /// client; marks themselves never do.
    pub(super) fn marked_data(&mut self, data: &[u8], now: Instant) {
        let Some(m) = self.marked.as_mut() else { return };
        m.partial.extend_from_slice(data);
        let mut out = Vec::new();
        let (mut start, mut marks) = (0, 0);
        let mut from = m.scanned;
        while let Some(end) = m.partial[from..].windows(2).position(|w| w == b"\n\n") {
            let event = &m.partial[start..from + end + 2];
            start = from + end + 2;
            from = start;
            match pd::mark::read(event) {
                // A keep-alive mark: the worker's engine turns; nothing to forward.
                Some(Ok((0, ids))) if ids.is_empty() => marks += 1,
                Some(Ok((created, ids))) if !m.retry => {
                    self.generated.extend_from_slice(&ids);
                    self.created = Some(created);
                    out.append(&mut m.held);
                    marks += 1;
                }
                Some(Err(_)) => m.retry = true,
                _ => m.held.extend_from_slice(event),
            }
        }
        m.partial.drain(..start);
        m.scanned = m.partial.len().saturating_sub(1);
        if marks > 0 {
            self.last_mark = Some(now);
        }
        let over = m.partial.len() + m.held.len() > self.spec.body_bytes_max;
        self.forward(out);
        if over {
            let msg =
                format!("worker's stream held over {} bytes without a resume mark", self.spec.body_bytes_max);
            self.fail(ApiError::new(ErrorKind::UpstreamFailed, msg));
        }
    }

    /// Whether this flight may ever move to another worker.
    pub(super) fn may_migrate(&self) -> bool {
        self.spec.purpose == Purpose::Client
            && !self.spec.method_get
            && self.plan != Plan::Forward
            && self.spec.migrations_max > 0
    }

    /// Whether it may move now: moves left, a client waiting, and nothing the client saw that the
    /// next worker could not go on from.
    pub(super) fn can_migrate(&self) -> bool {
        self.may_migrate()
            && self.client
            && !self.is_done()
            && (self.migrations.len() as u32) < self.spec.migrations_max
            && (!self.streaming || self.resumable)
    }

    /// Moves the request to another worker: the open leg closed, its workers told to drop it, and
    /// the first leg of the next try asked for, with the tokens the client has (`lost`: a worker no
    /// leg goes to again).
    pub(super) fn migrate(&mut self, cause: Migration, lost: Option<u32>) {
        if let State::Open { leg, .. } = self.state {
            self.push(Action::CloseLeg { leg });
        }
        self.state = State::Waiting;
        let rid = self.worker_request_id();
        for r in std::mem::take(&mut self.reached) {
            if !r.answered_error {
                self.push(Action::Abort { worker: r.worker, request_id: rid.clone() });
            }
        }
        if let Some(w) = lost.filter(|w| !self.lost.contains(w)) {
            self.lost.push(w);
        }
        self.migrations.push(cause);
        self.attempt += 1;
        self.marked = None;
        self.last_mark = None;
        self.refused.clear();
        self.draining_answer = None;
        self.stale_retried = false;
        let resume = pd::Resume {
            request_id: self.spec.request_id.clone(),
            created: self.created,
            tokens: self.generated.clone(),
        };
        let value = resume.to_json().to_string();
        self.resume_body = pd::splice_field(&self.spec.body, pd::RESUME_FIELD, value.as_bytes());
        self.push(Action::Stage { stage: Stage::Migrating, worker: None });
        if self.plan == Plan::DecodeLocal {
            // The worker that held the history is gone or failed: the next try computes the prompt
            // on a prefill worker.
            self.plan = Plan::Disaggregated;
        }
        let kind = if self.plan == Plan::Disaggregated { LegKind::Prefill } else { LegKind::Main };
        self.open(kind, None);
    }

    /// When the streaming leg will count as stalled, if it is one: the stall timeout after its newest
    /// mark (tokens or keep-alive: a worker whose engine turns marks a waiting stream every few
    /// seconds). Before its first mark, a queued request may wait; its deadline bounds it.
    pub fn stall_deadline(&self) -> Option<Instant> {
        match self.state {
            State::Open { .. } if self.marked.is_some() => Some(self.last_mark? + self.spec.stall_timeout?),
            _ => None,
        }
    }

    /// Call when [`stall_deadline`](Self::stall_deadline) has come: the request moves on, or ends with
    /// an error naming the stall.
    pub fn handle_stall(&mut self, now: Instant) {
        let Some(at) = self.stall_deadline() else { return };
        if now < at {
            return;
        }
        let worker = self.worker();
        if self.can_migrate() {
            return self.migrate(Migration::Stalled, worker);
        }
        let waited = self.spec.stall_timeout.map_or(0, ms);
        let at = worker.map_or(String::new(), |w| format!(" {w}"));
        let msg = format!("worker{at} sent nothing for {waited} ms mid-stream");
        self.fail(ApiError::new(ErrorKind::UpstreamFailed, msg));
    }
}
