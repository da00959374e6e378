//! One engine step as the core sees it: plan the batch ([`EngineCore::poll_step`]), then take what
//! the backend made of it ([`EngineCore::handle_step_done`]): sample, verify drafts, report.

use llguidance::toktrie::SimpleVob;
use pdserve_api::Role;
use pdserve_kvcache::{BlockCopy, BlockId, StateId, TierCopy};
use pdserve_model::{ModelError, SeqStep};
use pdserve_scheduler::{BatchItem, RequestId};

use super::sample::Rows;
use super::EngineCore;
use crate::grammar::Guide;
use std::time::Instant;

/// One sequence's rows of a planned step.
#[derive(Debug, Clone)]
pub struct PlannedRow {
    /// The new tokens, at consecutive positions from `start_pos`.
    pub tokens: Vec<u32>,
    pub start_pos: usize,
    /// Covers every position up to the last new one.
    pub block_table: Vec<BlockId>,
    /// How many of the last rows return logits (0, 1, or more to verify drafts).
    pub logits: usize,
    /// The sequence's state slot (a backend with per-request state).
    pub state: Option<u32>,
}

/// The constraints of a step's sampling requests: their token masks are computed beside the forward
/// pass (they depend only on the tokens so far), on another thread if the shell likes: one mask per
/// row the request samples (with drafts, the masks after each draft token).
#[derive(Debug, Default)]
pub struct Guides(Vec<(u64, Guide, Vec<u32>, Vec<Mask>)>);

/// The tokens a request's constraint allows next, or why they could not be computed.
type Mask = Result<SimpleVob, String>;

impl Guides {
    /// Computes every request's masks of allowed tokens.
    pub fn compute(&mut self) {
        for (_, g, drafts, masks) in &mut self.0 {
            *masks = g.masks_along(drafts);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// A step for the backend: the rows to compute, the copy-on-write block copies to make first, and
/// whether greedy picks are enough (every sampling request is plain greedy).
#[derive(Debug)]
pub struct StepPlan {
    pub rows: Vec<PlannedRow>,
    /// Copies between the pool and the KV offload tier, made first, in order.
    pub tier_copies: Vec<TierCopy>,
    pub copies: Vec<BlockCopy>,
    pub picks_only: bool,
    /// Handed back in [`StepDone::guides`], masks computed.
    pub guides: Guides,
}

impl StepPlan {
    /// The backend's view of the rows.
    pub fn seq_steps(&self) -> Vec<SeqStep<'_>> {
        self.rows
            .iter()
            .map(|r| SeqStep {
                tokens: &r.tokens,
                start_pos: r.start_pos,
                block_table: &r.block_table,
                logits: r.logits,
                state: r.state,
            })
            .collect()
    }

    /// New tokens in the step.
    pub fn tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }
}

/// What a forward pass returned: every wanted row's logits, or (when the plan asked for picks only)
/// each row's greedy pick and its log-probability.
#[derive(Debug)]
pub enum StepOutput {
    Logits(Vec<Vec<f32>>),
    Picks(Vec<(u32, f32)>),
}

/// Why a step gave nothing.
#[derive(Debug)]
pub enum StepFailure {
    /// The backend's error (the block copies' or the forward pass's).
    Model(ModelError),
    /// The forward pass panicked (caught by the shell).
    Panicked,
    /// A copy to or from the KV offload tier failed (or panicked): blocks the cache counts as
    /// restored or offloaded may hold KV that never arrived.
    Offload(String),
}

/// The answer to a [`StepPlan`].
#[derive(Debug)]
pub struct StepDone {
    pub output: Result<StepOutput, StepFailure>,
    /// The plan's guides, their masks computed (a request whose mask is missing fails).
    pub guides: Guides,
}

impl StepDone {
    /// The answer of a step that ran.
    pub fn new(output: Result<StepOutput, StepFailure>, guides: Guides) -> StepDone {
        StepDone { output, guides }
    }
}

/// The step in flight: what the core planned.
#[derive(Debug)]
pub(super) struct InFlight {
    batch: Vec<BatchItem>,
}

impl EngineCore {
    /// Plans the next step: `None` while one is in flight or when there is nothing to compute (the
    /// scheduler still ends what passed its deadline). `transfers_live`: the endpoint holds live
    /// transfers (a prefill worker then keeps its steps short).
    pub fn poll_step(&mut self, now: Instant, transfers_live: bool) -> Option<StepPlan> {
        if self.stepping.is_some() {
            return None;
        }
        // A prefill worker's transfers advance only between steps (each protocol round trip waits for
        // the step in progress): while any is live, steps stay short. Offers not yet pulled count too:
        // the decode worker's pull comes within milliseconds, and one the router abandoned is
        // aborted by it (only a vanished router leaves offers to their lease expiry).
        let budget = match self.config.role {
            Role::Prefill if transfers_live => self.config.transfer_step_tokens,
            _ => usize::MAX,
        };
        let spec = self.config.speculative;
        let drafting = spec.is_on()
            && self.config.role != Role::Prefill
            && self.sched.stats().running <= spec.max_running;
        let batch = if drafting {
            let (active, rows) = (&mut self.active, self.config.verify_rows);
            self.sched.poll_batch_drafting(now, budget, &mut |id, tokens, room| {
                match active.get_mut(&id.0) {
                    Some(a) => {
                        let room = a.drafting.room(spec.max_draft).min(room);
                        let mut drafts = if spec.from_model() {
                            // The draft layer's guess, where it was made for this very length.
                            match a.model_draft.take() {
                                Some((at, mut guesses)) if at == tokens.len() => {
                                    guesses.truncate(room);
                                    guesses
                                }
                                _ => Vec::new(),
                            }
                        } else {
                            spec.propose(tokens, room)
                        };
                        // A constrained request drafts only what its constraint allows (each draft
                        // row then gets the mask after the drafts before it).
                        if let Some(g) = a.guide.as_mut() {
                            let valid = g.valid_prefix(&drafts);
                            drafts.truncate(valid);
                        }
                        crate::draft::fit_to_rows(&mut drafts, rows);
                        drafts
                    }
                    None => Vec::new(),
                }
            })
        } else {
            self.sched.poll_batch_within(now, budget)
        };
        self.drain_events(now);
        if batch.is_empty() {
            // Nothing to compute, but state copies handed out are made now: the slots they touch
            // stay parked until then (a queued request may be waiting for one).
            let copies = self.state_copies();
            if copies.is_empty() {
                self.sched.handle_step_result(&[], now);
                self.drain_events(now);
                return None;
            }
            self.stepping = Some(InFlight { batch });
            let (rows, tier_copies, guides) = (Vec::new(), Vec::new(), Guides::default());
            return Some(StepPlan { rows, tier_copies, copies, picks_only: false, guides });
        }
        for item in &batch {
            if let Some(a) = self.active.get_mut(&item.id.0) {
                if a.times.scheduled.is_none() {
                    a.times.scheduled = Some(now);
                    let waited = now.saturating_duration_since(a.times.submitted.unwrap_or(now));
                    self.stats.queue_waits.push(waited);
                }
            }
        }
        let tier_copies = self.sched.kv_mut().take_tier_copies();
        // (The engine's ledgers are single-group: every copy is group 0's.) Then the state copies.
        let mut copies: Vec<_> = self.sched.kv_mut().take_copies().into_iter().map(|(_, c)| c).collect();
        copies.extend(self.state_copies());
        let kv = self.sched.kv();
        let rows = batch
            .iter()
            .map(|i| PlannedRow {
                tokens: kv
                    .tokens(i.seq)
                    .map(|t| t[i.start_pos..i.start_pos + i.num_tokens].to_vec())
                    .unwrap_or_default(),
                start_pos: i.start_pos,
                block_table: kv.block_table(i.seq, 0).map(<[_]>::to_vec).unwrap_or_default(),
                logits: if i.sample { i.draft + 1 } else { 0 },
                state: kv.state(i.seq).ok().filter(|s| *s != StateId::NONE).map(|s| s.0),
            })
            .collect();
        // Before the constraints leave for the mask computation: a constrained request needs logits.
        let picks_only = self.picks_only(&batch);
        if picks_only {
            self.stats.greedy_steps_total += 1;
        }
        let kv = self.sched.kv();
        let guides = batch
            .iter()
            .filter(|i| i.sample)
            .filter_map(|i| {
                let g = self.active.get_mut(&i.id.0)?.guide.take()?;
                let all = kv.tokens(i.seq).unwrap_or(&[]);
                let drafts = all[all.len().saturating_sub(i.draft)..].to_vec();
                Some((i.id.0, g, drafts, Vec::new()))
            })
            .collect();
        self.stepping = Some(InFlight { batch });
        Some(StepPlan { rows, tier_copies, copies, picks_only, guides: Guides(guides) })
    }

    /// The state copies handed out since the last step (restores, restore points saved, forks), as
    /// whole blocks of the state's slots.
    fn state_copies(&mut self) -> Vec<BlockCopy> {
        let (Some(st), bs) = (self.config.kv_state, self.config.block_size) else { return Vec::new() };
        let copies = self.sched.kv_mut().take_state_copies();
        copies
            .iter()
            .flat_map(|c| st.slot_blocks(c.from.0).zip(st.slot_blocks(c.to.0)))
            .map(|(src, dst)| BlockCopy { src, dst, tokens: bs })
            .collect()
    }

    /// The backend's answer to the step in flight: samples every sampling row, verifies drafts,
    /// reports tokens, and runs the inputs that waited for the step's end.
    pub fn handle_step_done(&mut self, now: Instant, done: StepDone) {
        self.draft_plan = None;
        let Some(InFlight { batch }) = self.stepping.take() else {
            debug_assert!(false, "a step's answer without a step in flight");
            return;
        };
        // The step's state copies are made: their slots may change hands. A failed step may not have
        // made them: the restore points they were to fill go.
        match &done.output {
            Ok(_) => self.sched.kv_mut().copies_done(),
            Err(_) => self.sched.kv_mut().copies_failed(),
        }
        let mut masks = std::collections::HashMap::new();
        for (id, g, _, mut computed) in done.guides.0 {
            if let Some(a) = self.active.get_mut(&id) {
                a.guide = Some(g);
            }
            if computed.is_empty() {
                computed.push(Err("the step's token mask was not computed".into()));
            }
            masks.insert(id, computed);
        }
        match done.output {
            Ok(output) => self.sample_step(&batch, output, &masks, now),
            Err(StepFailure::Model(e)) => self.sched.handle_step_failed(&format!("model error: {e}"), now),
            Err(StepFailure::Panicked) => {
                self.sched.handle_step_failed("internal error: the model step panicked", now)
            }
            Err(StepFailure::Offload(e)) => {
                self.sched.handle_step_failed(&format!("KV offload tier: {e}"), now);
                // What the tier and the cache hold can no longer be trusted: the tier goes, and every
                // cached block nobody holds with it (a later prompt computes them again).
                eprintln!("engine: a KV offload tier copy failed ({e}); the tier is off and the prefix cache emptied");
                self.sched.kv_mut().drop_tier();
            }
        }
        self.drain_events(now);
        self.run_deferred(now);
    }

    fn sample_step(
        &mut self,
        batch: &[BatchItem],
        output: StepOutput,
        masks: &std::collections::HashMap<u64, Vec<Mask>>,
        now: Instant,
    ) {
        let mut sampled = Vec::new();
        let mut failed: Vec<(RequestId, String)> = Vec::new();
        let (mut logits, mut picks) = match output {
            StepOutput::Logits(l) => (Some(l.into_iter()), None),
            StepOutput::Picks(p) => (None, Some(p.into_iter())),
        };
        for item in batch.iter().filter(|i| i.sample) {
            let verified = match (&mut picks, &mut logits) {
                (Some(p), _) => match p.next() {
                    Some((token, logprob)) => {
                        let s = pdserve_model::Sampled { token, logprob, top: Vec::new() };
                        self.verify(item, Rows::Picked(s), None)
                    }
                    None => Err("internal error: the model step returned too few picks".to_owned()),
                },
                (None, Some(l)) => {
                    let rows: Vec<Vec<f32>> = l.by_ref().take(item.draft + 1).collect();
                    self.verify(item, Rows::Logits(&rows), masks.get(&item.id.0).map(Vec::as_slice))
                }
                (None, None) => unreachable!("the output is logits or picks"),
            };
            match verified {
                Ok(Some(s)) => sampled.push(s),
                Ok(None) => {}
                Err(reason) => failed.push((item.id, reason)),
            }
        }
        let drafts: usize = sampled.iter().map(|s| s.drafts_accepted).sum();
        self.stats.tokens_generated_total += (sampled.len() + drafts) as u64;
        self.plan_drafts(batch, &sampled);
        for (id, reason) in failed {
            self.sched.handle_failed(id, &reason, now);
        }
        self.sched.handle_step_result(&sampled, now);
    }
}
