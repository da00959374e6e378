//! The core's side of KV transfers: offering a finished prompt's KV (prefill role), pulling it
//! (decode role: only the blocks this worker's prefix cache lacks), and settling each transfer's end
//! with the scheduler. The endpoint itself lives in the shell: the core asks for what it needs done
//! as [`TransferCall`]s and hears back through `handle_*`.

use std::time::Instant;

use pdserve_api::{Outcome, Role, Stage as ApiStage};
use pdserve_kvcache::{BlockId, TransferId};
use pdserve_pd_transfer::{
    EndpointEvent, FailReason, PromptMeta, Side, Source, TransferError, TransferKey, TransferOutcome,
};
use pdserve_scheduler::{Exit, KvSource, NewRequest, RequestId, Stage};

use super::{output_budget, EngineCore, Pulled, RemoteFirst, Reply, Times};
use crate::{EngineError, KvTransferProblem};

/// What the core asks of the transfer endpoint, in order.
#[derive(Debug)]
pub enum TransferCall {
    /// Prefill role: offer `blocks` (held by the lease of `transfer`) until `expires_at_ms`.
    /// Answer: [`EngineCore::handle_offered`] with the key the endpoint gave (or its error).
    Offer { transfer: TransferId, blocks: Vec<BlockId>, expires_at_ms: u64, meta: PromptMeta, now_ms: u64 },
    /// Decode role: connect to the prefill worker and ask what `source` holds; the transfer ends by
    /// `deadline_ms` whatever happens. Answer: [`EngineCore::handle_pull_started`].
    Pull { source: Source, deadline_ms: u64, now_ms: u64 },
    /// Decode role: where a described transfer's blocks go, from sender block `from` on.
    /// Answer: [`EngineCore::handle_destination_set`].
    SetDestination { transfer: u64, from: u32, dest: Vec<(BlockId, u32)> },
    /// End `transfer` on whichever side holds it (idempotent; no answer).
    Abort { transfer: u64 },
}

/// Prefill role: a finished prompt whose offer the endpoint has not answered yet.
#[derive(Debug)]
pub(super) struct Offering {
    pub id: u64,
    pub first_token: u32,
    pub first: Option<pdserve_model::Sampled>,
    pub times: Times,
    pub cached_tokens: usize,
    pub output_tokens: usize,
}

/// Offers remembered for [`Reply::Served`] at most (each ends with its transfer; a lease that ends
/// without one is forgotten with the oldest).
pub(super) const HELD_OFFERS_MAX: usize = 4096;

impl EngineCore {
    pub(super) fn abort_transfer(&mut self, transfer: u64) {
        if self.config.role != Role::Unified {
            self.calls.push_back(TransferCall::Abort { transfer });
        }
    }

    /// Decode role: asks the prefill worker what the transfer holds; the request is admitted once the
    /// answer comes (`describe`).
    pub(super) fn start_pull(&mut self, s: Box<super::Submission>, now: Instant) {
        let Some(source) = s.remote.clone() else { return };
        if self.config.role != Role::Decode {
            return self.reject(s.id, EngineError::KvTransfer(KvTransferProblem::NotDecodeWorker));
        }
        let t = source.key.transfer;
        if self.describing.contains_key(&t) || self.pulling.contains_key(&t) {
            let problem = KvTransferProblem::AlreadyPulling { key: source.key };
            return self.reject(s.id, EngineError::KvTransfer(problem));
        }
        let (deadline_ms, now_ms) = (self.sched.now_ms(s.deadline), self.sched.now_ms(now));
        self.describing.insert(t, (s, now));
        self.calls.push_back(TransferCall::Pull { source, deadline_ms, now_ms });
    }

    /// The endpoint's answer to [`TransferCall::Pull`] for `transfer`.
    pub fn handle_pull_started(&mut self, _now: Instant, transfer: u64, result: Result<(), TransferError>) {
        if let Err(e) = result {
            if let Some((s, _)) = self.describing.remove(&transfer) {
                self.reject(s.id, EngineError::KvTransfer(KvTransferProblem::Pull(e)));
            }
        }
    }

    /// What the endpoint reports: a pull described by the prefill worker, or a transfer's end.
    pub fn handle_transfer_event(&mut self, now: Instant, e: EndpointEvent) {
        debug_assert!(self.stepping.is_none(), "the endpoint is pumped between steps only");
        match e {
            EndpointEvent::Described { transfer, blocks, meta } => self.describe(transfer, blocks, meta, now),
            EndpointEvent::Ended { side, transfer, outcome, took_ms } => {
                self.transfer_ended(side, transfer, outcome, took_ms, now)
            }
        }
        self.drain_events(now);
    }

    /// Decode role: the prefill worker described the transfer; admit the request with its prompt and
    /// give the pull its destination blocks.
    fn describe(&mut self, transfer: u64, _blocks: u32, meta: PromptMeta, now: Instant) {
        let Some((mut s, pull_started)) = self.describing.remove(&transfer) else {
            self.abort_transfer(transfer);
            return;
        };
        let prompt = meta.prompt;
        let context = self.config.context_tokens;
        let budget = output_budget(prompt.len(), s.resumed.len(), s.max_tokens, context);
        let bad = if prompt.is_empty() {
            Some(EngineError::InvalidInput { problem: "the prefill worker described an empty prompt".into() })
        } else if let Some(t) = prompt.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            Some(EngineError::KvTransfer(KvTransferProblem::TokenOutsideVocabulary { token: *t }))
        } else if !prompt.ends_with(&s.resumed) {
            Some(EngineError::KvTransfer(KvTransferProblem::ResumeMismatch))
        } else {
            budget.as_ref().err().map(|_| EngineError::ContextLengthExceeded {
                prompt_tokens: prompt.len(),
                context_tokens: context,
            })
        };
        if let Some(e) = bad {
            self.abort_transfer(transfer);
            return self.reject(s.id, e);
        }
        let req = NewRequest {
            id: RequestId(s.id),
            prompt: prompt.clone(),
            max_tokens: budget.unwrap_or(1),
            queue_deadline: s.deadline,
            deadline: s.deadline,
            kv: KvSource::Remote { transfer: TransferId(transfer), first_token: meta.first_token },
            priority: s.priority,
        };
        if let Err(r) = self.sched.handle_request(req, now) {
            self.abort_transfer(transfer);
            return self.reject(s.id, EngineError::Rejected(r));
        }
        // The lease's leading blocks came from this worker's prefix cache (an earlier round of the
        // conversation ended here): only the rest is pulled.
        let (from, dest): (usize, Vec<(BlockId, u32)>) = match self.sched.kv().lease(TransferId(transfer)) {
            Ok(lease) => {
                let l = &lease.groups[0];
                let mut dest: Vec<_> =
                    l.blocks.iter().copied().zip(l.epochs.iter().copied()).skip(l.reused).collect();
                // A model's per-request state comes last, as its slot's blocks (written under the
                // slot's epoch).
                if let Some(st) = self.config.kv_state {
                    dest.extend(st.slot_blocks(lease.state.0).map(|b| (b, lease.state_epoch)));
                }
                (l.reused, dest)
            }
            Err(_) => (0, Vec::new()),
        };
        let first = RemoteFirst {
            logprob: meta.first_logprob,
            top: meta.first_top,
            queue_us: meta.queue_us,
            prefill_us: meta.prefill_us,
            cached_tokens: meta.cached_tokens as usize,
        };
        self.admitted(&mut s, prompt, now, Some(first));
        if let Some(a) = self.active.get_mut(&s.id) {
            let bytes = (dest.len() * self.config.block_bytes) as u64;
            a.times.pulled = Some(Pulled { blocks: dest.len(), bytes, reused_blocks: from });
            a.times.pull_started = Some(pull_started);
        }
        self.pulling.insert(transfer, s.id);
        self.calls.push_back(TransferCall::SetDestination { transfer, from: from as u32, dest });
    }

    /// The endpoint's answer to [`TransferCall::SetDestination`] for `transfer`.
    pub fn handle_destination_set(&mut self, now: Instant, transfer: u64, result: Result<(), TransferError>) {
        if let Err(e) = result {
            if let Some(req) = self.pulling.remove(&transfer) {
                let reason = format!("the destination does not match the description: {e}");
                self.sched.handle_kv_failed(RequestId(req), &reason, now);
                self.drain_events(now);
            }
        }
    }

    /// Prefill role: offers a finished prompt's leased KV to decode workers, with what they need to go
    /// on from it.
    pub(super) fn offer(
        &mut self,
        transfer: TransferId,
        mut blocks: Vec<BlockId>,
        prompt: Vec<u32>,
        o: Offering,
        now: Instant,
    ) {
        let Some((_, expires_at_ms)) = self.sched.lease_of(transfer) else {
            return self.offer_failed(transfer, o);
        };
        // A model's per-request state goes after the blocks, as its slot's blocks.
        if let (Some(st), Ok(lease)) = (self.config.kv_state, self.sched.kv().lease(transfer)) {
            blocks.extend(st.slot_blocks(lease.state.0));
        }
        let us = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => b.saturating_duration_since(a).as_micros() as u64,
            _ => 0,
        };
        let (first_logprob, first_top) =
            o.first.as_ref().map_or((0.0, Vec::new()), |s| (s.logprob, s.top.clone()));
        let meta = PromptMeta {
            prompt,
            first_token: o.first_token,
            first_logprob,
            first_top,
            queue_us: us(o.times.submitted, o.times.scheduled),
            prefill_us: us(o.times.scheduled, Some(now)),
            cached_tokens: o.cached_tokens.min(u32::MAX as usize) as u32,
        };
        let now_ms = self.sched.now_ms(now);
        self.offering.insert(transfer.0, o);
        self.calls.push_back(TransferCall::Offer { transfer, blocks, expires_at_ms, meta, now_ms });
    }

    /// The endpoint's answer to [`TransferCall::Offer`] for `transfer`.
    pub fn handle_offered(
        &mut self,
        _now: Instant,
        transfer: u64,
        result: Result<TransferKey, TransferError>,
    ) {
        let Some(o) = self.offering.remove(&transfer) else { return };
        match result {
            Ok(key) => {
                *self.stats.finished_total.entry((Outcome::Completed, ApiStage::Prefilling)).or_default() +=
                    1;
                let (id, cached_tokens, times) = (o.id, o.cached_tokens, o.times);
                self.held_offers.insert(transfer, id);
                while self.held_offers.len() > HELD_OFFERS_MAX {
                    self.held_offers.pop_first();
                }
                self.replies.push_back(Reply::Prefilled { id, key, cached_tokens, times });
            }
            Err(_) => self.offer_failed(TransferId(transfer), o),
        }
    }

    fn offer_failed(&mut self, transfer: TransferId, o: Offering) {
        self.sched.handle_transfer_done(transfer);
        let outcome =
            Exit::Failed { stage: Stage::Prefilling, reason: "could not offer the KV for transfer".into() };
        let counted = (Outcome::Failed, ApiStage::Prefilling);
        self.finished(o.id, outcome, counted, o.output_tokens, o.cached_tokens, o.times);
    }

    fn transfer_ended(&mut self, side: Side, t: u64, outcome: TransferOutcome, took_ms: u64, now: Instant) {
        let label = match &outcome {
            TransferOutcome::Completed => "completed",
            TransferOutcome::Failed(r) => r.as_str(),
        };
        let side_label = if side == Side::Sending { "prefill" } else { "decode" };
        *self.stats.transfers_finished_total.entry((side_label, label)).or_default() += 1;
        if outcome == TransferOutcome::Completed {
            self.stats.transfer_times_ms.push(took_ms);
        }
        if side == Side::Sending {
            self.sched.handle_transfer_done(TransferId(t));
            if let Some(id) = self.held_offers.remove(&t) {
                self.replies.push_back(Reply::Served { id, outcome: label.to_owned() });
            }
            return;
        }
        // The pull waits until the request's deadline: running out is the request timing out (the
        // scheduler ends an admitted one at that deadline), not a broken transfer.
        let timed_out = outcome == TransferOutcome::Failed(FailReason::DataTimeout);
        if let Some((s, _)) = self.describing.remove(&t) {
            // Ended before the prefill worker described it: the request was never admitted.
            if timed_out {
                let counted = (Outcome::TimedOut, ApiStage::KvTransfer);
                let outcome = Exit::TimedOut { stage: Stage::KvTransfer };
                return self.finished(s.id, outcome, counted, 0, 0, Times::default());
            }
            let problem = match outcome {
                TransferOutcome::Failed(r) => KvTransferProblem::Failed(r),
                TransferOutcome::Completed => KvTransferProblem::EndedUndescribed,
            };
            return self.reject(s.id, EngineError::KvTransfer(problem));
        }
        let Some(req) = self.pulling.remove(&t) else { return };
        match outcome {
            TransferOutcome::Completed => {
                let first = self.sched.awaiting_first_token(RequestId(req));
                let eos_ids = &self.config.eos_ids;
                if let (Some(first), Some(a)) = (first, self.active.get_mut(&req)) {
                    a.times.kv_arrived = Some(now);
                    // Counted once the blocks are here: a pull that failed moved nothing usable.
                    if let Some(p) = a.times.pulled {
                        self.stats.transfer_blocks_skipped_total += p.reused_blocks as u64;
                        self.stats.transfer_blocks_transferred_total += p.blocks as u64;
                    }
                    let eos = eos_ids.contains(&first);
                    let mut stop = a.stop_ids.contains(&first) || (!a.ignore_eos && eos);
                    // The prefill worker sampled it under the same constraint: the matcher takes it.
                    if let Some(g) = a.guide.as_mut() {
                        stop |= eos && g.is_accepting();
                        if !eos && g.accept(first).is_err() {
                            stop = true;
                        }
                    }
                    let (logprob, top) = a.remote_first.take().unwrap_or_default();
                    self.sched.handle_kv_arrived(RequestId(req), stop, now);
                    self.replies.push_back(Reply::Token { id: req, token: first, logprob, top, stop });
                }
            }
            TransferOutcome::Failed(_) if timed_out => {}
            TransferOutcome::Failed(reason) => {
                self.sched.handle_kv_failed(RequestId(req), &format!("KV transfer failed: {reason}"), now);
            }
        }
    }
}
