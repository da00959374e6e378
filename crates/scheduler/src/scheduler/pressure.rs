//! KV pressure: reserving a running request's next tokens, and preempting (freeing a request's KV,
//! its full blocks left in the prefix cache, and queueing it at the front to be recomputed) where
//! the pool is short.

use std::time::Instant;

use pdserve_kvcache::{KvError, SeqId};

use super::{Scheduler, State};
use crate::types::{BatchItem, Exit, RequestId, Stage};

impl Scheduler {
    /// Reserves the next prefill chunk of `id` (KV permitting) and returns its item.
    pub(super) fn plan_prefill(
        &mut self,
        id: RequestId,
        budget: usize,
        contended: bool,
    ) -> Option<BatchItem> {
        let r = &self.reqs[&id];
        let computed = self.kv.computed_tokens(r.seq).ok()?;
        let mut n = self.config.chunk_len(computed, r.tokens.len() - computed, budget, contended);
        // A model with per-request state caches a prefix only where a state is saved: a chunk ending
        // further past a block boundary than the state goes back ends at the boundary instead.
        let kv = self.kv.config();
        let (bt, reach) = (kv.block_tokens as usize, kv.state_rewind_tokens as usize);
        let boundary = (computed + n) - (computed + n) % bt;
        if kv.state_bytes > 0 && boundary > computed && computed + n - boundary > reach {
            n = boundary - computed;
        }
        // And where the prompt's blocks cached by others end (see `Req::shared_end`).
        if kv.state_bytes > 0 && computed < r.shared_end && r.shared_end < computed + n {
            n = r.shared_end - computed;
        }
        if n == 0 {
            return None;
        }
        let (seq, total) = (r.seq, r.tokens.len());
        match self.kv.reserve(seq, n) {
            Ok(()) => {
                let sample = computed + n == total;
                Some(BatchItem { id, seq, start_pos: computed, num_tokens: n, sample, draft: 0 })
            }
            // No room this step: the request keeps its place and its KV, and tries again next step.
            Err(_) => None,
        }
    }

    /// [`plan_prefill`](Self::plan_prefill) for a running request; while the pool cannot hold its
    /// chunk, the newest running request admitted after it and not in `planned` goes back to the
    /// queue (its full blocks stay cached for its recompute). Without that, running requests that
    /// each hold part of the pool and wait for one more block would wait for each other forever;
    /// this way the oldest always moves. With no such request left, `id` keeps its place and its KV.
    pub(super) fn plan_prefill_or_preempt(
        &mut self,
        id: RequestId,
        budget: usize,
        contended: bool,
        planned: &[BatchItem],
    ) -> Option<BatchItem> {
        if budget == 0 {
            return None;
        }
        loop {
            if let Some(item) = self.plan_prefill(id, budget, contended) {
                return Some(item);
            }
            let order = self.reqs[&id].admitted_order;
            let victim = self
                .running
                .iter()
                .copied()
                .filter(|v| self.reqs[v].admitted_order > order && !planned.iter().any(|i| i.id == *v))
                .max_by_key(|v| self.reqs[v].admitted_order)?;
            self.preempt(victim);
        }
    }

    /// Reserves `n` tokens for running request `id`, preempting newer running requests while the pool
    /// is short. Returns false if `id` itself was preempted.
    pub(super) fn reserve_or_preempt(&mut self, id: RequestId, n: usize, now: Instant) -> bool {
        let seq = SeqId(id.0);
        loop {
            match self.kv.reserve(seq, n) {
                Ok(()) => return true,
                Err(KvError::OutOfBlocks { .. }) => {
                    // Decodes are planned oldest first, so the newest running request is either `id`
                    // itself or one not planned yet: preempting it never undoes a planned item.
                    let victim = self
                        .running
                        .iter()
                        .copied()
                        .max_by_key(|v| self.reqs[v].admitted_order)
                        .unwrap_or(id);
                    self.preempt(victim);
                    if victim == id {
                        return false;
                    }
                }
                Err(e) => {
                    self.finish(id, Exit::Failed { stage: Stage::Decoding, reason: e.to_string() }, now);
                    return false;
                }
            }
        }
    }

    /// Frees `id`'s KV (keeping full blocks in the prefix cache, so recompute is cheap) and puts it at
    /// the front of the queue with every token so far; it is recomputed when readmitted.
    pub(super) fn preempt(&mut self, id: RequestId) {
        let Some(r) = self.reqs.get_mut(&id) else { return };
        let _ = self.kv.free_sequence(r.seq, true);
        r.state = State::Queued;
        self.running.retain(|&x| x != id);
        self.queued.push_front(id);
        self.stats.preemptions_total += 1;
    }
}
