//! The model's draft layer (DeepSeek's multi-token prediction layer) between steps: after a step,
//! the core plans a draft pass over the rows the step computed that stay valid (a prompt chunk's,
//! or a decode row and its accepted drafts), each row reading the token after it; the shell runs it
//! on the backend right after the step ([`EngineCore::take_draft_plan`]) and answers with
//! [`EngineCore::handle_drafts`]. The pass stores the draft layer's KV for those positions (on a
//! prefill worker too, so a decode worker drafts over a prompt it never computed) and, for a
//! request that decodes next, guesses the token after the one just chosen: its draft for the next
//! step, verified there like any other.

use pdserve_kvcache::BlockId;
use pdserve_model::{DraftStep, ModelError};
use pdserve_scheduler::{BatchItem, Sampled};

use super::EngineCore;
use pdserve_api::Role;

/// A draft pass for the backend: the draft layer over rows of the step just done.
#[derive(Debug, Default)]
pub struct DraftPlan {
    rows: Vec<PlannedDraft>,
}

#[derive(Debug)]
struct PlannedDraft {
    id: u64,
    /// The item's index in the step.
    step: usize,
    /// The token after each valid row.
    next: Vec<u32>,
    block_table: Vec<BlockId>,
    /// The sequence's length once the step's tokens are in: the position the first guess is for
    /// (`None`: no guess wanted).
    guess_at: Option<usize>,
    /// Chained guesses wanted (each one position on, within the block table).
    guesses: usize,
}

impl DraftPlan {
    /// The backend's view of the pass.
    pub fn draft_steps(&self) -> Vec<DraftStep<'_>> {
        self.rows
            .iter()
            .map(|r| DraftStep {
                step: r.step,
                next: &r.next,
                block_table: &r.block_table,
                guesses: r.guesses,
            })
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }
}

impl EngineCore {
    /// Plans the draft pass over `batch`'s rows, `sampled` being what its sampling items kept (before
    /// the scheduler is told, while every sequence's tokens and blocks are as the step saw them).
    pub(super) fn plan_drafts(&mut self, batch: &[BatchItem], sampled: &[Sampled]) {
        self.draft_plan = None;
        let spec = self.config.speculative;
        if !spec.from_model() {
            return;
        }
        // Guesses only while few enough requests run for them to be verified.
        let guessing = self.config.role != Role::Prefill && self.sched.stats().running <= spec.max_running;
        let kv = self.sched.kv();
        let mut rows = Vec::new();
        for (step, item) in batch.iter().enumerate() {
            let (Ok(tokens), Ok(table)) = (kv.tokens(item.seq), kv.block_table(item.seq, 0)) else {
                continue;
            };
            let start = item.start_pos;
            let (valid, last, guess) = if item.sample {
                let Some(s) = sampled.iter().find(|s| s.id == item.id) else { continue };
                // The rows of the item's first token and of its accepted drafts; the sampled token
                // follows the last of them. No guess (nor its LM head product) for a request whose
                // drafting is paused.
                let paused = self.active.get(&item.id.0).is_none_or(|a| !a.drafting.may_draft());
                (
                    item.num_tokens - item.draft + s.drafts_accepted,
                    Some(s.token),
                    !s.stop && guessing && !paused,
                )
            } else {
                (item.num_tokens, None, false)
            };
            let known = valid - usize::from(last.is_some());
            let Some(after) = tokens.get(start + 1..start + 1 + known) else { continue };
            let mut next = after.to_vec();
            next.extend(last);
            if next.is_empty() || table.len() * kv.block_size() < start + valid {
                continue;
            }
            let guess_at = guess.then_some(start + valid + 1);
            // The chained guesses' rows go one position on each, as far as the blocks and the
            // context reach (a backend stops there, and a pass answering fewer guesses than asked
            // would lose every request's).
            let end = (table.len() * kv.block_size()).min(self.sched.config().context_tokens_max);
            let reach = end.saturating_sub(start + valid - 1);
            let guesses = if guess { spec.max_draft.min(reach) } else { 0 };
            rows.push(PlannedDraft {
                id: item.id.0,
                step,
                next,
                block_table: table.to_vec(),
                guess_at,
                guesses,
            });
        }
        if !rows.is_empty() {
            self.draft_plan = Some(DraftPlan { rows });
        }
    }

    /// The draft pass planned after the step just answered, for the backend to run before anything
    /// else touches the KV memory (the next step, a transfer's block reads).
    pub fn take_draft_plan(&mut self) -> Option<DraftPlan> {
        self.draft_plan.take()
    }

    /// The backend's answer to a draft pass: each guessing row's chained guesses' logits, in order.
    /// A request's guesses are the greedy picks there, kept for its next step. A failed pass, or one
    /// that answered another count, leaves no guesses (the output is the same without them) and
    /// says why, for the shell's log.
    pub fn handle_drafts(
        &mut self,
        plan: DraftPlan,
        output: Result<Vec<Vec<f32>>, ModelError>,
    ) -> Result<(), String> {
        let wanted: usize = plan.rows.iter().map(|r| r.guesses).sum();
        let logits = match output {
            Ok(l) if l.len() == wanted => l,
            Ok(l) => return Err(format!("{} guesses' logits for {wanted} asked", l.len())),
            Err(e) => return Err(e.to_string()),
        };
        let mut logits = logits.into_iter();
        for r in plan.rows {
            let guesses: Vec<u32> =
                logits.by_ref().take(r.guesses).map(|l| pdserve_model::greedy_pick(&l).0).collect();
            let (Some(at), Some(a)) = (r.guess_at, self.active.get_mut(&r.id)) else { continue };
            a.model_draft = Some((at, guesses));
        }
        Ok(())
    }
}
