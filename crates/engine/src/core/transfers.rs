//! The engine thread's KV transfers: offering a finished prompt's KV (prefill role), pulling it
//! (decode role: only the blocks this worker's prefix cache lacks), and settling each transfer's end
//! with the scheduler. Pumped between steps; never waited on.

use std::time::{Duration, Instant};

use pdserve_api::{Outcome as ApiOutcome, Stage as ApiStage};
use pdserve_kvcache::{BlockId, TransferId};
use pdserve_model::Backend;
use pdserve_pd_transfer::{
    BlockMemory, Endpoint, EndpointEvent, FailReason, Outcome as TransferOutcome, PromptMeta, Side,
    TransferError, TransferKey,
};
use pdserve_scheduler::{KvSource, NewRequest, Outcome, RequestId, Stage};

use super::{Core, Offered, Pulled, RemoteFirst, Reply, Submission, Times};
use crate::{EngineError, KvTransferProblem};

/// The backend's KV memory, as the transfer endpoint reads and writes it.
struct Memory<'a>(&'a mut dyn Backend);

impl BlockMemory for Memory<'_> {
    fn read_block(&self, block: BlockId, out: &mut [u8]) -> Result<(), TransferError> {
        self.0.read_block(block, out).map_err(|_| TransferError::BlockIo { block })
    }
    fn write_block(&mut self, block: BlockId, data: &[u8]) -> Result<(), TransferError> {
        self.0.write_block(block, data).map_err(|_| TransferError::BlockIo { block })
    }
}

impl Core {
    pub(super) fn abort_transfer(&mut self, transfer: u64) {
        if let Some(ep) = self.endpoint.as_mut() {
            ep.abort(transfer);
        }
    }

    /// Decode role: connects to the prefill worker and asks what the transfer holds; the request is
    /// admitted once the answer comes (`describe`).
    pub(super) fn start_pull(&mut self, s: Box<Submission>, now: Instant) {
        let Some(source) = s.remote.clone() else { return };
        let deadline = self.sched.now_ms(s.deadline);
        let now_ms = self.sched.now_ms(now);
        let Some(ep) = self.endpoint.as_mut() else {
            return self.reject(s.id, EngineError::KvTransfer(KvTransferProblem::NotDecodeWorker));
        };
        if self.describing.contains_key(&source.key.transfer)
            || self.pulling.contains_key(&source.key.transfer)
        {
            let problem = KvTransferProblem::AlreadyPulling { key: source.key };
            return self.reject(s.id, EngineError::KvTransfer(problem));
        }
        match ep.pull(&source, deadline, now_ms) {
            Ok(()) => {
                let _ = self.shared.ledger().admit(
                    &s.request_id,
                    ApiStage::KvTransfer,
                    now,
                    s.deadline,
                    "engine",
                );
                self.describing.insert(source.key.transfer, (s, now));
            }
            Err(e) => self.reject(s.id, EngineError::KvTransfer(KvTransferProblem::Pull(e))),
        }
    }

    /// Decode role: the prefill worker described the transfer; admit the request with its prompt and
    /// give the pull its destination blocks.
    pub(super) fn describe(&mut self, transfer: u64, blocks: u32, meta: PromptMeta, now: Instant) {
        let Some((mut s, pull_started)) = self.describing.remove(&transfer) else {
            self.abort_transfer(transfer);
            return;
        };
        let prompt = meta.prompt;
        let bad = if prompt.is_empty() {
            Some(EngineError::InvalidInput { problem: "the prefill worker described an empty prompt".into() })
        } else if let Some(t) = prompt.iter().find(|&&t| t as usize >= self.vocab_size) {
            Some(EngineError::KvTransfer(KvTransferProblem::TokenOutsideVocabulary { token: *t }))
        } else if !prompt.ends_with(&s.resumed) {
            Some(EngineError::KvTransfer(KvTransferProblem::ResumeMismatch))
        } else if prompt.len() >= self.context_tokens {
            Some(EngineError::ContextLengthExceeded {
                prompt_tokens: prompt.len(),
                context_tokens: self.context_tokens,
            })
        } else {
            None
        };
        if let Some(e) = bad {
            self.abort_transfer(transfer);
            self.shared.ledger().finish(&s.request_id);
            return self.reject(s.id, e);
        }
        let max_tokens = s
            .max_tokens
            .map_or(self.context_tokens - prompt.len(), |m| m.saturating_sub(s.resumed.len()).max(1));
        let req = NewRequest {
            id: RequestId(s.id),
            prompt: prompt.clone(),
            max_tokens,
            queue_deadline: s.deadline,
            deadline: s.deadline,
            kv: KvSource::Remote { transfer: TransferId(transfer), first_token: meta.first_token },
        };
        if let Err(r) = self.sched.handle_request(req, now) {
            self.abort_transfer(transfer);
            self.shared.ledger().finish(&s.request_id);
            return self.reject(s.id, EngineError::Rejected(r));
        }
        // The lease's leading blocks came from this worker's prefix cache (an earlier round of the
        // conversation ended here): only the rest is pulled.
        let (from, dest): (usize, Vec<(BlockId, u32)>) = match self.sched.kv().lease(TransferId(transfer)) {
            Ok(l) => {
                (l.reused, l.blocks.iter().copied().zip(l.epochs.iter().copied()).skip(l.reused).collect())
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
        self.admitted(&mut s, prompt, ApiStage::KvTransfer, now, Some(first));
        let block_bytes = self.endpoint.as_ref().map_or(0, |ep| ep.layout().block_bytes());
        if let Some(l) = self.live.get_mut(&s.id) {
            let bytes = (dest.len() * block_bytes) as u64;
            l.times.pulled = Some(Pulled { blocks: dest.len(), bytes, reused_blocks: from });
            l.times.pull_started = Some(pull_started);
        }
        self.pulling.insert(transfer, s.id);
        let set = self.endpoint.as_mut().map(|ep| ep.set_destination(transfer, from as u32, dest));
        if let Some(Err(e)) = set {
            let reason = format!("{blocks} blocks described, the destination differs: {e:?}");
            self.pulling.remove(&transfer);
            self.sched.handle_kv_failed(RequestId(s.id), &reason, now);
            self.drain_events();
        }
    }

    /// Prefill role: offers a finished prompt's leased KV to decode workers, with what they need to go
    /// on from it.
    pub(super) fn offer(
        &mut self,
        transfer: TransferId,
        blocks: Vec<BlockId>,
        prompt: Vec<u32>,
        o: Offered,
    ) -> Option<TransferKey> {
        let Offered { first_token, first, times, cached_tokens } = o;
        let (_, expires_at) = self.sched.lease_of(transfer)?;
        let now = Instant::now();
        let us = |a: Option<Instant>, b: Option<Instant>| match (a, b) {
            (Some(a), Some(b)) => b.saturating_duration_since(a).as_micros() as u64,
            _ => 0,
        };
        let (first_logprob, first_top) = first.map_or((0.0, Vec::new()), |s| (s.logprob, s.top));
        let meta = PromptMeta {
            prompt,
            first_token,
            first_logprob,
            first_top,
            queue_us: us(times.submitted, times.scheduled),
            prefill_us: us(times.scheduled, Some(now)),
            cached_tokens: cached_tokens.min(u32::MAX as usize) as u32,
        };
        let now_ms = self.sched.now_ms(now);
        self.endpoint.as_mut()?.offer(transfer, blocks, expires_at, meta, now_ms).ok()
    }

    /// Moves transfer frames and block bytes, and settles ended transfers with the scheduler.
    pub(super) fn pump_transfers(&mut self) {
        self.pump_transfers_waiting(Duration::ZERO);
    }

    /// Like [`pump_transfers`](Self::pump_transfers), first waiting up to `wait` for transfer I/O.
    pub(super) fn pump_transfers_waiting(&mut self, wait: Duration) {
        let Some(ep) = self.endpoint.as_mut() else { return };
        let now_ms = self.sched.now_ms(Instant::now());
        if let Err(e) = ep.pump(self.sched.kv(), &mut Memory(self.backend.as_mut()), now_ms, wait) {
            eprintln!("engine: KV transfer poll failed: {e}");
        }
        // After the wait: what arrived, arrived now.
        let now = Instant::now();
        while let Some(e) = self.endpoint.as_mut().and_then(Endpoint::poll_event) {
            match e {
                EndpointEvent::Described { transfer, blocks, meta } => {
                    self.describe(transfer, blocks, meta, now)
                }
                EndpointEvent::Ended { side, transfer, outcome, took_ms } => {
                    self.transfer_ended(side, transfer, outcome, took_ms, now)
                }
            }
        }
        self.drain_events();
    }

    pub(super) fn transfer_ended(
        &mut self,
        side: Side,
        t: u64,
        outcome: TransferOutcome,
        took_ms: u64,
        now: Instant,
    ) {
        let label = match &outcome {
            TransferOutcome::Completed => "completed",
            TransferOutcome::Failed(r) => r.as_str(),
        };
        let side_label = if side == Side::Sending { "prefill" } else { "decode" };
        if let Ok(c) = self.metrics.transfers_finished.with(&[side_label, label]) {
            c.inc();
        }
        if outcome == TransferOutcome::Completed {
            self.metrics.transfer_time.record(Duration::from_millis(took_ms));
        }
        if side == Side::Sending {
            self.sched.handle_transfer_done(TransferId(t));
            return;
        }
        // The pull waits until the request's deadline: running out is the request timing out (the
        // scheduler ends an admitted one at that deadline), not a broken transfer.
        let timed_out = outcome == TransferOutcome::Failed(FailReason::DataTimeout);
        if let Some((s, _)) = self.describing.remove(&t) {
            // Ended before the prefill worker described it: the request was never admitted.
            self.shared.ledger().finish(&s.request_id);
            if timed_out {
                self.count_finished(ApiOutcome::TimedOut, ApiStage::KvTransfer);
                let outcome = Outcome::TimedOut { stage: Stage::KvTransfer };
                let times = Times::default();
                let id = s.id;
                return self.send(Reply::Finished { id, outcome, output_tokens: 0, cached_tokens: 0, times });
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
                if let (Some(first), Some(l)) = (first, self.live.get_mut(&req)) {
                    l.times.kv_arrived = Some(now);
                    // Counted once the blocks are here: a pull that failed moved nothing usable.
                    if let Some(p) = l.times.pulled {
                        for (result, n) in [("skipped", p.reused_blocks), ("transferred", p.blocks)] {
                            if let Ok(c) = self.metrics.transfer_blocks.with(&[result]) {
                                c.add(n as u64);
                            }
                        }
                    }
                    let eos = self.eos_ids.contains(&first);
                    let mut stop = l.stop_ids.contains(&first) || (!l.ignore_eos && eos);
                    // The prefill worker sampled it under the same constraint: the matcher takes it.
                    if let Some(g) = l.guide.as_mut() {
                        stop |= eos && g.is_accepting();
                        if !eos && g.accept(first).is_err() {
                            stop = true;
                        }
                    }
                    let (logprob, top) = l.remote_first.take().unwrap_or_default();
                    self.sched.handle_kv_arrived(RequestId(req), stop, now);
                    self.send(Reply::Token { id: req, token: first, logprob, top, stop });
                }
            }
            TransferOutcome::Failed(_) if timed_out => {}
            TransferOutcome::Failed(reason) => {
                self.sched.handle_kv_failed(RequestId(req), &format!("KV transfer failed: {reason}"), now);
            }
        }
    }
}
