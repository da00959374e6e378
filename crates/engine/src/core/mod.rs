//! The engine's decisions as a sans-IO state machine: [`EngineCore`] owns the scheduler (and with it
//! the KV cache's ledger), every request's sampler, its constraint and its drafts, and the
//! bookkeeping of its KV transfers. It sees token ids only. No threads, no channels, no sockets, no
//! clock: every input is a `handle_*` call with `now`, every output is polled. The engine thread
//! ([`crate::shell`]) feeds it commands and transfer events, runs the steps it plans on the model
//! backend and performs the transfer calls it asks for on the endpoint; a simulation
//! (`tests/engine_sim.rs`) does the same on a virtual clock with a fake model and in-memory transports.
//!
//! # Call order
//!
//! 1. [`EngineCore::new`].
//! 2. Whenever something happens, the matching input:
//!    - [`handle_submit`](EngineCore::handle_submit), [`handle_abort`](EngineCore::handle_abort),
//!      [`handle_fail`](EngineCore::handle_fail), [`handle_abort_transfer`](EngineCore::handle_abort_transfer):
//!      the caller's commands, in the order it gave them;
//!    - [`handle_transfer_event`](EngineCore::handle_transfer_event): each event the endpoint reports;
//!    - the answer to each [`TransferCall`] that asks for one (`Offer`: [`handle_offered`](EngineCore::handle_offered);
//!      `Pull`: [`handle_pull_started`](EngineCore::handle_pull_started); `SetDestination`:
//!      [`handle_destination_set`](EngineCore::handle_destination_set)), before any other input.
//! 3. After every input, [`poll_transfer`](EngineCore::poll_transfer) until `None`, performing each
//!    call (and answering it) in order; then [`poll_reply`](EngineCore::poll_reply) until `None`.
//! 4. When no step is in flight: [`poll_step`](EngineCore::poll_step). A step it returns is run on the
//!    backend and answered with exactly one [`handle_step_done`](EngineCore::handle_step_done); while
//!    it runs, the endpoint is not pumped (its block writes need the backend), and the caller's
//!    commands may still come: aborts take effect at once (the request ends, its blocks go back to the
//!    pool, which nothing allocates from before the step is done), everything else waits inside the
//!    core for the step's end, in order.
//!
//! # Guarantees (checked by `tests/engine_sim.rs` on a virtual clock)
//!
//! - Every submission gets exactly one end: [`Reply::Rejected`], [`Reply::Finished`] or (prefill
//!   role) [`Reply::Prefilled`]; `Admitted` and `Token`s come only between a submission and its end;
//!   after a `Prefilled`, at most one [`Reply::Served`] when its offer's transfer ends.
//! - Every request ends by its deadline: the scheduler times out what passes it at the next step it
//!   plans; a pull's transfer carries the deadline too.
//! - When every request has ended and every transfer settled, the KV ledger holds no block for a
//!   sequence or a transfer (the prefix cache may keep what it cached).
//! - A request's tokens depend only on the logits its own rows get: the same sampler draws in the
//!   same order on a unified worker, through prefill and decode, resumed after a move, with drafts.

mod draft_pass;
mod sample;
mod step;
mod transfers;

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use pdserve_api::{Outcome, Role, Stage as ApiStage};
use pdserve_kvcache::{KvGroups, SeqId};
use pdserve_model::{Sampler, SamplingParams};
use pdserve_pd_transfer::{Source, TransferKey};
use pdserve_scheduler::{Event, Exit, KvSource, NewRequest, RequestId, Scheduler, SchedulerStats, Stage};

use crate::grammar::Guide;
use crate::EngineError;
pub use draft_pass::DraftPlan;

pub use step::{Guides, PlannedRow, StepDone, StepFailure, StepOutput, StepPlan};
pub use transfers::TransferCall;

/// A generation handed to the core.
#[derive(Debug)]
pub struct Submission {
    /// The engine's id for it (unique among live requests; it also names its KV transfer).
    pub id: u64,
    /// The caller's name for it (the `x-request-id`).
    pub request_id: String,
    /// The prompt followed by `resumed` (empty when it comes from a prefill worker).
    pub tokens: Vec<u32>,
    /// Decode role: where the prompt's KV and token ids come from.
    pub remote: Option<Source>,
    /// `None`: up to the context.
    pub max_tokens: Option<usize>,
    pub params: SamplingParams,
    pub seed: u64,
    pub stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub deadline: Instant,
    /// What the output must match (compiled by the text thread).
    pub guide: Option<Guide>,
    /// End-of-sequence and stop tokens are held back before this many output tokens.
    pub min_tokens: usize,
    pub logit_bias: Vec<(u32, f32)>,
    /// Output generated before this engine (the request moved here mid-answer): the prompt's last
    /// tokens, counted as output.
    pub resumed: Vec<u32>,
    /// Test hook (`Request::test_panic`): sampling this request panics.
    pub panic_in_sampling: bool,
    /// Lower first (vLLM's `priority`; see `pdserve_scheduler::NewRequest::priority`).
    pub priority: i32,
    /// The request's trace id, for the ledger (`Request::trace_id`).
    pub trace_id: Option<String>,
}

impl Submission {
    /// A submission with the engine's defaults: greedy, up to the context, no stop tokens.
    pub fn new(id: u64, request_id: impl Into<String>, tokens: Vec<u32>, deadline: Instant) -> Submission {
        Submission {
            id,
            request_id: request_id.into(),
            tokens,
            remote: None,
            max_tokens: None,
            params: SamplingParams::greedy(),
            seed: id,
            stop_ids: Vec::new(),
            ignore_eos: false,
            deadline,
            guide: None,
            min_tokens: 0,
            logit_bias: Vec::new(),
            resumed: Vec::new(),
            panic_in_sampling: false,
            priority: 0,
            trace_id: None,
        }
    }
}

/// How many tokens a request may generate here: the context rule, in one place. `prompt_len` counts
/// the prompt and the `resumed` output that follows it; without `max_tokens`, up to the context; with
/// it, what is left of it after the resumed tokens (at least one: a resumed request that had used it
/// all ends before it is submitted). A prompt that leaves no room is refused, unless resumed output
/// filled the context (that request ends with `length` before it is submitted).
pub fn output_budget(
    prompt_len: usize,
    resumed: usize,
    max_tokens: Option<usize>,
    context_tokens: usize,
) -> Result<usize, EngineError> {
    let own = prompt_len.saturating_sub(resumed);
    if own >= context_tokens || (resumed == 0 && prompt_len >= context_tokens) {
        return Err(EngineError::ContextLengthExceeded { prompt_tokens: prompt_len, context_tokens });
    }
    Ok(match max_tokens {
        None => context_tokens.saturating_sub(prompt_len),
        Some(m) => m.saturating_sub(resumed).max(1),
    })
}

/// Whether a resumed request's output already reached its limits: `max_tokens`, or (computed here)
/// the context. Such a request ends with `length` without being submitted.
pub fn resumed_is_complete(
    prompt_len: usize,
    resumed: usize,
    max_tokens: Option<usize>,
    context_tokens: usize,
    remote: bool,
) -> bool {
    resumed > 0 && (max_tokens.is_some_and(|m| resumed >= m) || (!remote && prompt_len >= context_tokens))
}

/// When a request reached the engine's milestones, for the per-stage timings answers carry.
#[derive(Debug, Clone, Copy, Default)]
pub struct Times {
    pub submitted: Option<Instant>,
    /// First scheduled into a batch.
    pub scheduled: Option<Instant>,
    /// Decode role: the pull began (this engine asked the prefill worker).
    pub pull_started: Option<Instant>,
    /// Decode role: the prompt's KV arrived from the prefill worker.
    pub kv_arrived: Option<Instant>,
    /// Decode role: the prefill worker's queue and prefill times, in microseconds.
    pub prefill_us: Option<(u64, u64)>,
    /// Decode role: what the pull moved, and what this worker's prefix cache spared it.
    pub pulled: Option<Pulled>,
    /// Speculative decoding: draft tokens verified, and those accepted.
    pub drafted: u32,
    pub accepted: u32,
}

/// Decode role: the prompt's KV blocks pulled from the prefill worker, and those reused from this
/// worker's own prefix cache instead.
#[derive(Debug, Clone, Copy, Default)]
pub struct Pulled {
    pub blocks: usize,
    pub bytes: u64,
    pub reused_blocks: usize,
}

/// What the core tells its caller, in order per request: `Admitted` or `Rejected`, then `Token`s,
/// then exactly one `Finished` or `Prefilled`.
#[derive(Debug)]
pub enum Reply {
    Admitted {
        id: u64,
        prompt_tokens: usize,
    },
    Rejected {
        id: u64,
        error: EngineError,
    },
    Token {
        id: u64,
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
        stop: bool,
    },
    /// `cached_tokens`: prompt tokens whose KV was reused, not computed (in PD, the prefill worker's).
    Finished {
        id: u64,
        outcome: Exit,
        /// Where it was counted: the outcome's word and the stage it ended in.
        counted: (Outcome, ApiStage),
        output_tokens: usize,
        cached_tokens: usize,
        times: Times,
    },
    /// Prefill role: the prompt is done; its KV waits under `key` for the decode worker.
    Prefilled {
        id: u64,
        key: TransferKey,
        cached_tokens: usize,
        times: Times,
    },
    /// Prefill role, after `Prefilled`: the transfer of the request's KV ended (`outcome`:
    /// `completed`, or why not). The request itself had ended already.
    Served {
        id: u64,
        outcome: String,
    },
}

impl Reply {
    /// The request it is about.
    pub fn id(&self) -> u64 {
        match self {
            Reply::Admitted { id, .. }
            | Reply::Rejected { id, .. }
            | Reply::Token { id, .. }
            | Reply::Finished { id, .. }
            | Reply::Prefilled { id, .. }
            | Reply::Served { id, .. } => *id,
        }
    }

    /// Whether it ends its request.
    pub fn is_end(&self) -> bool {
        matches!(self, Reply::Rejected { .. } | Reply::Finished { .. } | Reply::Prefilled { .. })
    }
}

/// What the core needs to know of the model and the worker besides its scheduler.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub role: Role,
    pub eos_ids: Vec<u32>,
    /// Prompt plus generated tokens never exceed it.
    pub context_tokens: usize,
    pub vocab_size: usize,
    /// Prefill role: the step's token budget while transfers are live (each protocol round trip
    /// waits for the step in progress).
    pub transfer_step_tokens: usize,
    pub speculative: crate::Speculative,
    /// The backend's `verify_rows_multiple` (drafts are sized to fill its tiles).
    pub verify_rows: usize,
    /// Bytes of one KV block as a transfer moves it (what a decode's timings report as pulled).
    pub block_bytes: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// The backend's per-request state, if it keeps one (`Backend::kv_state`): its slots' blocks
    /// follow the pool's, and move and copy as blocks.
    pub kv_state: Option<pdserve_model::KvState>,
}

/// Counters the shell mirrors into the metrics (totals since the start; the shell adds what grew).
#[derive(Debug, Clone, Default)]
pub struct CoreStats {
    pub tokens_prompt_total: u64,
    pub tokens_generated_total: u64,
    /// Steps whose sampling requests were all plain greedy (the backend returned picks only).
    pub greedy_steps_total: u64,
    pub draft_tokens_total: u64,
    pub draft_accepted_total: u64,
    /// Requests refused, by the word of their error.
    pub rejected_total: HashMap<&'static str, u64>,
    /// Requests ended, by outcome and stage.
    pub finished_total: HashMap<(Outcome, ApiStage), u64>,
    /// Transfers ended, by side (`prefill`/`decode`) and result.
    pub transfers_finished_total: HashMap<(&'static str, &'static str), u64>,
    /// Decode role: prompt blocks pulled, and those a prefix hit spared.
    pub transfer_blocks_transferred_total: u64,
    pub transfer_blocks_skipped_total: u64,
    /// Waits in the queue (admission to first step) and completed transfers' times, in milliseconds,
    /// since the shell last took them ([`EngineCore::take_samples`]).
    pub queue_waits: Vec<std::time::Duration>,
    pub transfer_times_ms: Vec<u64>,
}

/// Where a live request stands, for the ledger that `/debug/requests` shows.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    pub id: u64,
    pub request_id: &'a str,
    pub stage: ApiStage,
    pub submitted: Instant,
    pub deadline: Instant,
    pub tokens_in: usize,
    pub tokens_out: usize,
    /// KV blocks it holds (a sliding window's released ones are not).
    pub kv_blocks: usize,
    /// What it waits for where it is not being computed (see `LedgerEntry::waiting_for`).
    pub waiting_for: Option<&'static str>,
    pub trace_id: Option<&'a str>,
}

/// One request the core has admitted.
#[derive(Debug)]
struct Active {
    request_id: String,
    trace_id: Option<String>,
    sampler: Sampler,
    prompt_len: usize,
    stop_ids: Vec<u32>,
    ignore_eos: bool,
    guide: Option<Guide>,
    min_tokens: usize,
    logit_bias: Vec<(u32, f32)>,
    deadline: Instant,
    times: Times,
    /// Prefill role: the prompt, and the first token as sampled, for the decode worker.
    prompt: Vec<u32>,
    first: Option<pdserve_model::Sampled>,
    /// Decode role: the first token's log-probabilities, from the prefill worker.
    remote_first: Option<(f32, Vec<(u32, f32)>)>,
    /// Decode role: prompt tokens the prefill worker found cached (what `usage` reports).
    remote_cached: Option<usize>,
    panic_in_sampling: bool,
    drafting: crate::draft::DraftState,
    /// The model's draft layer's guesses: (the sequence length the first is for, the tokens).
    model_draft: Option<(usize, Vec<u32>)>,
}

/// Decode role: what the prefill worker said of the first token and of its own timings.
#[derive(Debug)]
struct RemoteFirst {
    logprob: f32,
    top: Vec<(u32, f32)>,
    queue_us: u64,
    prefill_us: u64,
    cached_tokens: usize,
}

/// An input that came while a step was in flight, kept for its end.
#[derive(Debug)]
enum Deferred {
    Submit(Box<Submission>),
    Abort(u64),
    Fail { id: u64, reason: String },
    AbortTransfer(u64),
}

impl Deferred {
    /// Whether it submits or fails request `id` (an abort must not overtake either).
    fn concerns(&self, id: u64) -> bool {
        matches!(self, Deferred::Submit(s) if s.id == id)
            || matches!(self, Deferred::Fail { id: f, .. } if *f == id)
    }
}

/// Inputs kept for a step's end at most; past this, aborts are kept too (the caller's channel then
/// pushes back as it does between steps).
const DEFERRED_MAX: usize = 1024;

/// The engine's decisions. See the [module docs](self).
#[derive(Debug)]
pub struct EngineCore {
    config: CoreConfig,
    sched: Scheduler,
    active: HashMap<u64, Active>,
    /// Decode role: pulls whose prompt the prefill worker has not described yet, by transfer, with
    /// when the pull began.
    describing: HashMap<u64, (Box<Submission>, Instant)>,
    /// Decode role: described pulls still receiving blocks: transfer -> request.
    pulling: HashMap<u64, u64>,
    /// Prefill role: offers the endpoint has not answered yet: transfer -> what ends the request.
    offering: HashMap<u64, transfers::Offering>,
    /// Prefill role: offers made, until their transfer ends: transfer -> the request (for
    /// [`Reply::Served`]); the oldest go past [`transfers::HELD_OFFERS_MAX`].
    held_offers: std::collections::BTreeMap<u64, u64>,
    replies: VecDeque<Reply>,
    calls: VecDeque<TransferCall>,
    deferred: VecDeque<Deferred>,
    /// The step in flight, if any.
    stepping: Option<step::InFlight>,
    /// The draft pass planned after the last step, until the shell takes it.
    draft_plan: Option<DraftPlan>,
    stats: CoreStats,
}

impl EngineCore {
    pub fn new(config: CoreConfig, sched: Scheduler) -> EngineCore {
        EngineCore {
            config,
            sched,
            active: HashMap::new(),
            describing: HashMap::new(),
            pulling: HashMap::new(),
            offering: HashMap::new(),
            held_offers: std::collections::BTreeMap::new(),
            replies: VecDeque::new(),
            calls: VecDeque::new(),
            deferred: VecDeque::new(),
            stepping: None,
            draft_plan: None,
            stats: CoreStats::default(),
        }
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// The KV ledger (the endpoint checks block reads and writes against its leases: the one
    /// group's, `kv().group(0)`).
    pub fn kv(&self) -> &KvGroups {
        self.sched.kv()
    }

    /// Has the KV cache record what its prefix cache gains and loses (`take_kv_events`), `max` at
    /// most between takes.
    pub fn record_kv_events(&mut self, max: usize) {
        self.sched.kv_mut().record_events(max);
    }

    /// The prefix cache's changes since the last call, in order.
    pub fn take_kv_events(&mut self) -> Vec<pdserve_kvcache::CacheEvent> {
        self.sched.kv_mut().take_events()
    }

    /// Changes the KV cache dropped (its log was full).
    pub fn kv_events_dropped(&self) -> u64 {
        self.sched.kv().events_dropped()
    }

    pub fn scheduler_stats(&self) -> SchedulerStats {
        self.sched.stats()
    }

    pub fn stats(&self) -> &CoreStats {
        &self.stats
    }

    /// The duration samples gathered since the last call (queue waits, transfer times).
    pub fn take_samples(&mut self) -> (Vec<std::time::Duration>, Vec<u64>) {
        (std::mem::take(&mut self.stats.queue_waits), std::mem::take(&mut self.stats.transfer_times_ms))
    }

    /// Milliseconds on the transfer protocol's clock (the scheduler's epoch) at `now`.
    pub fn now_ms(&self, now: Instant) -> u64 {
        self.sched.now_ms(now)
    }

    /// Requests waiting for admission (a pull not described yet counts).
    pub fn queued(&self) -> usize {
        self.sched.stats().queued + self.describing.len()
    }

    /// Requests running (a described pull awaiting its KV counts).
    pub fn running(&self) -> usize {
        let s = self.sched.stats();
        s.running + s.awaiting_kv
    }

    /// Nothing to step: no request waits or runs (transfers may still be live at the endpoint).
    pub fn is_idle(&self) -> bool {
        self.sched.is_empty() && self.stepping.is_none()
    }

    /// Whether a step is in flight (planned, not yet answered).
    pub fn is_stepping(&self) -> bool {
        self.stepping.is_some()
    }

    /// Requests the core holds: admitted, or (decode role) waiting for their prompt's description.
    pub fn len(&self) -> usize {
        self.active.len() + self.describing.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where each live request stands.
    pub fn requests(&self) -> impl Iterator<Item = RequestView<'_>> + '_ {
        let queue_wait = self.sched.stats().queue_wait.map(|w| w.as_str());
        let admitted = self.active.iter().map(move |(&id, a)| {
            let (stage, out) = self.sched.stage_of(RequestId(id)).unwrap_or((Stage::Queued, 0));
            let table = self.sched.kv().block_table(SeqId(id), 0).unwrap_or_default();
            let stage = self.stage(stage);
            let waiting_for = match stage {
                ApiStage::PrefillQueued | ApiStage::DecodeQueued => queue_wait,
                ApiStage::KvHeld => Some("decode_pull"),
                ApiStage::KvTransfer => Some("kv_pull"),
                _ => None,
            };
            RequestView {
                id,
                request_id: &a.request_id,
                stage,
                waiting_for,
                submitted: a.times.submitted.unwrap_or(a.deadline),
                deadline: a.deadline,
                tokens_in: a.prompt_len,
                tokens_out: out,
                kv_blocks: table.iter().filter(|b| !b.is_released()).count(),
                trace_id: a.trace_id.as_deref(),
            }
        });
        let described = self.describing.values().map(|(s, since)| RequestView {
            id: s.id,
            request_id: &s.request_id,
            stage: ApiStage::KvTransfer,
            submitted: *since,
            deadline: s.deadline,
            tokens_in: 0,
            tokens_out: 0,
            kv_blocks: 0,
            waiting_for: Some("kv_pull"),
            trace_id: s.trace_id.as_deref(),
        });
        admitted.chain(described)
    }

    /// The next reply, in order.
    pub fn poll_reply(&mut self) -> Option<Reply> {
        self.replies.pop_front()
    }

    /// The next transfer call to perform, in order.
    pub fn poll_transfer(&mut self) -> Option<TransferCall> {
        self.calls.pop_front()
    }

    /// A request: admitted into the scheduler (or, decode role, its pull started), or refused.
    pub fn handle_submit(&mut self, now: Instant, s: Box<Submission>) {
        if self.stepping.is_some() {
            return self.defer(Deferred::Submit(s));
        }
        if s.remote.is_some() {
            return self.start_pull(s, now);
        }
        let max_tokens =
            match output_budget(s.tokens.len(), s.resumed.len(), s.max_tokens, self.config.context_tokens) {
                Ok(m) => m,
                Err(e) => return self.reject(s.id, e),
            };
        let req = NewRequest {
            id: RequestId(s.id),
            prompt: s.tokens.clone(),
            max_tokens,
            queue_deadline: s.deadline,
            deadline: s.deadline,
            kv: KvSource::Compute,
            priority: s.priority,
        };
        match self.sched.handle_request(req, now) {
            Ok(()) => {
                let mut s = s;
                let tokens = std::mem::take(&mut s.tokens);
                self.admitted(&mut s, tokens, now, None);
            }
            Err(r) => self.reject(s.id, EngineError::Rejected(r)),
        }
    }

    /// The caller gave up on request `id` (an abort, a stop string, a deadline): it ends as
    /// `Cancelled`, at once even while a step runs. Unknown ids are ignored.
    pub fn handle_abort(&mut self, now: Instant, id: u64) {
        if self.stepping.is_some() && self.deferred.iter().any(|d| d.concerns(id)) {
            return self.defer(Deferred::Abort(id));
        }
        if let Some((&t, _)) = self.describing.iter().find(|(_, (s, _))| s.id == id) {
            // Not admitted yet: the pull ends, and so does the request.
            self.describing.remove(&t);
            let counted = (Outcome::Cancelled, ApiStage::KvTransfer);
            self.finished(id, Exit::Cancelled, counted, 0, 0, Times::default());
            self.abort_transfer(t);
            return;
        }
        self.sched.handle_abort(RequestId(id), now);
        // A prefill request may have finished already, its KV offered under the same id: the abort
        // ends the offer too, instead of leaving it to the lease expiry.
        self.abort_transfer(id);
        self.drain_events(now);
    }

    /// The caller could not go on with request `id` (a panic while turning its tokens into text): it
    /// ends as failed, naming `reason`; the others run on.
    pub fn handle_fail(&mut self, now: Instant, id: u64, reason: String) {
        if self.stepping.is_some() {
            return self.defer(Deferred::Fail { id, reason });
        }
        if self.describing.values().any(|(s, _)| s.id == id) {
            return self.handle_abort(now, id);
        }
        self.sched.handle_failed(RequestId(id), &reason, now);
        self.abort_transfer(id);
        self.drain_events(now);
    }

    /// Prefill role: end the offer of a finished prompt's KV (its transfer id is the request's id).
    /// Idempotent: an ended transfer is left alone.
    pub fn handle_abort_transfer(&mut self, transfer: u64) {
        if self.stepping.is_some() {
            return self.defer(Deferred::AbortTransfer(transfer));
        }
        self.abort_transfer(transfer);
    }

    fn defer(&mut self, d: Deferred) {
        // Past the bound the caller has broken the call order (it is told to stop taking commands
        // while the step runs once the core holds this many); keep it anyway rather than lose it.
        debug_assert!(self.deferred.len() <= DEFERRED_MAX * 2, "the caller kept feeding a step in flight");
        self.deferred.push_back(d);
    }

    /// Whether the core holds as many inputs for the step's end as it should: the caller stops
    /// taking commands until the step is done.
    pub fn deferred_full(&self) -> bool {
        self.deferred.len() >= DEFERRED_MAX
    }

    /// Runs the inputs kept while the step was in flight, in order.
    fn run_deferred(&mut self, now: Instant) {
        while let Some(d) = self.deferred.pop_front() {
            match d {
                Deferred::Submit(s) => self.handle_submit(now, s),
                Deferred::Abort(id) => self.handle_abort(now, id),
                Deferred::Fail { id, reason } => self.handle_fail(now, id, reason),
                Deferred::AbortTransfer(t) => self.abort_transfer(t),
            }
        }
    }

    fn reject(&mut self, id: u64, error: EngineError) {
        *self.stats.rejected_total.entry(error.kind().as_str()).or_default() += 1;
        self.replies.push_back(Reply::Rejected { id, error });
    }

    fn stage(&self, s: Stage) -> ApiStage {
        match s {
            Stage::Queued => ApiStage::queued(self.config.role),
            Stage::KvTransfer => ApiStage::KvTransfer,
            Stage::Prefilling => ApiStage::Prefilling,
            Stage::Decoding => ApiStage::Decoding,
        }
    }

    /// The scheduler took `s`: its sampler, and the `Admitted` reply.
    fn admitted(&mut self, s: &mut Submission, prompt: Vec<u32>, now: Instant, remote: Option<RemoteFirst>) {
        self.stats.tokens_prompt_total += prompt.len() as u64;
        let (remote_first, prefill_us, remote_cached) = match remote {
            Some(r) => (Some((r.logprob, r.top)), Some((r.queue_us, r.prefill_us)), Some(r.cached_tokens)),
            None => (None, None, None),
        };
        // Output generated elsewhere counts as output here; the sampler goes on past its draws (and,
        // for a prompt whose KV was pulled, past the prefill worker's draw of the first token).
        let prompt_len = prompt.len().saturating_sub(s.resumed.len());
        let mut sampler = Sampler::new(s.params.clone(), s.seed);
        sampler.skip(s.resumed.len() + usize::from(remote_first.is_some()));
        let prefill = self.config.role == Role::Prefill;
        self.active.insert(
            s.id,
            Active {
                request_id: std::mem::take(&mut s.request_id),
                trace_id: s.trace_id.take(),
                sampler,
                prompt_len,
                stop_ids: std::mem::take(&mut s.stop_ids),
                ignore_eos: s.ignore_eos,
                guide: s.guide.take(),
                min_tokens: s.min_tokens,
                logit_bias: std::mem::take(&mut s.logit_bias),
                deadline: s.deadline,
                times: Times { submitted: Some(now), prefill_us, ..Times::default() },
                prompt: if prefill { prompt } else { Vec::new() },
                first: None,
                remote_first,
                remote_cached,
                panic_in_sampling: s.panic_in_sampling,
                drafting: Default::default(),
                model_draft: None,
            },
        );
        self.replies.push_back(Reply::Admitted { id: s.id, prompt_tokens: prompt_len });
    }

    /// Ends request `id` with `outcome`, counted under `counted`.
    fn finished(
        &mut self,
        id: u64,
        outcome: Exit,
        counted: (Outcome, ApiStage),
        output_tokens: usize,
        cached_tokens: usize,
        times: Times,
    ) {
        *self.stats.finished_total.entry(counted).or_default() += 1;
        self.replies.push_back(Reply::Finished { id, outcome, counted, output_tokens, cached_tokens, times });
    }

    /// Acts on what the scheduler reports: ended requests (a finished prompt's KV offered, on a
    /// prefill worker) and expired leases.
    fn drain_events(&mut self, now: Instant) {
        while let Some(e) = self.sched.poll_event() {
            let (id, outcome, output_tokens, cached_tokens) = match e {
                Event::LeaseExpired { transfer } => {
                    // The scheduler freed the blocks: the offer ends now, before any reader is confirmed.
                    self.abort_transfer(transfer.0);
                    continue;
                }
                Event::Finished { id, outcome, output_tokens, cached_tokens, .. } => {
                    (id, outcome, output_tokens, cached_tokens)
                }
            };
            let mut active = self.active.remove(&id.0);
            // A decode request that ends while its KV is still coming: end the pull too.
            if let Some(t) = self.pulling.iter().find(|(_, &r)| r == id.0).map(|(&t, _)| t) {
                self.pulling.remove(&t);
                self.abort_transfer(t);
            }
            let times = active.as_ref().map(|a| a.times).unwrap_or_default();
            // In PD, what the client is told was cached is the prefill worker's hit.
            let cached_tokens = active.as_ref().and_then(|a| a.remote_cached).unwrap_or(cached_tokens);
            if let Exit::PrefillDone { first_token, transfer, blocks } = outcome {
                let first = active.as_mut().and_then(|a| a.first.take());
                let prompt = active.map(|a| a.prompt).unwrap_or_default();
                let o =
                    transfers::Offering { id: id.0, first_token, first, times, cached_tokens, output_tokens };
                self.offer(transfer, blocks, prompt, o, now);
                continue;
            }
            let stage = match &outcome {
                Exit::TimedOut { stage } | Exit::Failed { stage, .. } => self.stage(*stage),
                _ if self.config.role == Role::Prefill => ApiStage::Prefilling,
                _ => ApiStage::Decoding,
            };
            let word = match &outcome {
                Exit::Completed(_) | Exit::PrefillDone { .. } => Outcome::Completed,
                Exit::Cancelled => Outcome::Cancelled,
                Exit::TimedOut { .. } => Outcome::TimedOut,
                Exit::Failed { .. } => Outcome::Failed,
            };
            self.finished(id.0, outcome, (word, stage), output_tokens, cached_tokens, times);
        }
    }
}

/// What a caught panic said.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> &str {
    p.downcast_ref::<&str>()
        .copied()
        .or_else(|| p.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic")
}
