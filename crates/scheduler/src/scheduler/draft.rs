//! Speculative decoding's share of the scheduler: room for draft tokens in a decode's item, and the
//! accepted drafts kept (the rest given back) once the engine has verified them.

use pdserve_kvcache::KvError;

use super::Scheduler;
use crate::types::{BatchItem, RequestId};

/// Proposes draft tokens for a decode: `(request, its tokens so far, room)` to at most `room` tokens
/// (fewer, or none, where it has no good guess).
pub type Drafter<'a> = dyn FnMut(RequestId, &[u32], usize) -> Vec<u32> + 'a;

impl Scheduler {
    /// Extends a decode item (its one token's KV already reserved) with the drafts `drafter` proposes,
    /// as many as the step's remaining `budget`, the request's `max_tokens`, the context and the pool
    /// allow. Drafts never preempt: they take blocks only where every running request could still get
    /// one, and the item stays as it was when they cannot.
    pub(super) fn add_draft(
        &mut self,
        mut item: BatchItem,
        budget: usize,
        drafter: &mut Drafter<'_>,
    ) -> BatchItem {
        let r = &self.reqs[&item.id];
        // The step produces the drafts it accepts plus one sampled token.
        let room = budget
            .min(r.max_tokens.saturating_sub(r.output_len + 1))
            .min(self.config.context_tokens_max.saturating_sub(r.tokens.len() + 1));
        if room == 0 {
            return item;
        }
        let mut draft = drafter(item.id, &r.tokens, room);
        draft.truncate(room);
        if draft.is_empty() {
            return item;
        }
        let held = self.kv.block_table(item.seq, 0).map_or(0, <[_]>::len);
        let needed = self.kv.blocks_for(r.tokens.len() + draft.len()).saturating_sub(held);
        if needed + self.running.len() > self.kv.blocks_available() {
            return item;
        }
        if self.kv.reserve(item.seq, 1 + draft.len()).is_err()
            || self.kv.append_tokens(item.seq, &draft).is_err()
        {
            return item;
        }
        item.num_tokens += draft.len();
        item.draft = draft.len();
        item
    }

    /// After a step with drafts for `id`, whose first `accepted` drafts' KV is committed: the drafts
    /// become the request's tokens and the rest are cut from its sequence, their blocks freed.
    pub(super) fn settle_draft(&mut self, id: RequestId, accepted: usize) -> Result<(), KvError> {
        let r = self.reqs.get_mut(&id).unwrap_or_else(|| unreachable!("settled requests are live"));
        let base = r.tokens.len();
        let kept = self.kv.tokens(r.seq)?.get(base..base + accepted).map(<[u32]>::to_vec).unwrap_or_default();
        self.kv.truncate(r.seq, base + kept.len())?;
        r.output_len += kept.len();
        r.tokens.extend_from_slice(&kept);
        Ok(())
    }
}
