//! The scheduler's inputs and outputs.

use std::fmt;
use std::time::{Duration, Instant};

use pdserve_kvcache::{BlockId, TransferId};

/// A request, named by the caller (unique among live requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "request {}", self.0)
    }
}

/// What this worker does with a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Prompt and generation here.
    Unified,
    /// Prompt only: the request ends after its first token, its KV kept under a lease for a decode peer.
    Prefill,
    /// Generation only: the prompt's KV arrives from a prefill peer.
    Decode,
}

/// Bounds and knobs. Every queue is bounded; every wait has a deadline.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub role: Role,
    /// Requests waiting for admission (including preempted ones). One more is rejected with 429.
    pub queued_requests_max: usize,
    /// Requests in the running batch.
    pub running_requests_max: usize,
    /// Tokens computed per step (decodes count one each, prefill chunks their length).
    pub batch_tokens_max: usize,
    /// Largest prefill chunk of one request in one step.
    pub prefill_chunk_tokens_max: usize,
    /// The model's context: prompt plus generated tokens never exceed it.
    pub context_tokens_max: usize,
    /// Prefill role: how long a finished prompt's KV waits for its decode peer.
    pub kv_lease: Duration,
    /// Decode role: how long a request may wait for its KV to arrive.
    pub kv_transfer_timeout: Duration,
    /// Blocks kept free when admitting, so running decodes can grow without preempting at once.
    pub admission_watermark_blocks: usize,
    /// The order waiting requests are admitted in.
    pub admission_order: AdmissionOrder,
    /// The model's sliding attention window, if it has one: on the unified and decode roles, blocks a
    /// running sequence will never attend to again are given back after each step (see
    /// `KvGroups::release_outside_window`), and prompts are cached only when they end, whole.
    pub sliding_window: Option<usize>,
    /// Prefill chunks shrink with the context they attend to: attending to this many earlier positions
    /// costs about as much as a token's own work (weights), so a chunk of `n` tokens from position `p`
    /// costs `n * (1 + p / attention_cost_positions)` tokens of the step's budget. Alone, a chunk may
    /// cost the whole budget; beside other work (waiting requests, other running ones) at most
    /// `prefill_chunk_tokens_max`, so the step stays as short as one at the start of a prompt: a short
    /// request arriving during a long prompt waits one short step, running decodes keep their pace.
    /// `None`: chunks by tokens alone.
    pub attention_cost_positions: Option<usize>,
}

impl SchedulerConfig {
    /// What a prefill chunk of `n` tokens from position `p` counts against a step's budget.
    pub fn chunk_cost(&self, p: usize, n: usize) -> usize {
        let p = self.attended(p);
        match self.attention_cost_positions {
            Some(e) if e > 0 => n.saturating_add(n.saturating_mul(p).div_ceil(e)),
            _ => n,
        }
    }

    /// How many earlier positions a token at position `p` attends to (a sliding window caps it).
    fn attended(&self, p: usize) -> usize {
        self.sliding_window.map_or(p, |w| p.min(w))
    }

    /// The longest chunk from position `p` within `budget` and the chunk size whose cost fits the budget
    /// (`contended`: the chunk size), at least one token (a step always makes progress), at most
    /// `remaining`; none without a budget.
    pub fn chunk_len(&self, p: usize, remaining: usize, budget: usize, contended: bool) -> usize {
        if budget == 0 {
            return 0;
        }
        let limit = budget.min(self.prefill_chunk_tokens_max);
        let p = self.attended(p);
        let n = match self.attention_cost_positions {
            Some(e) if e > 0 => {
                let cost_limit = if contended { limit } else { budget };
                limit.min(cost_limit.saturating_mul(e) / e.saturating_add(p))
            }
            _ => limit,
        };
        n.max(1).min(remaining)
    }
}

/// Which waiting request is admitted next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdmissionOrder {
    /// First come, first served.
    Fifo,
    /// The least work first: the request with the fewest prompt tokens left to compute after its
    /// prefix-cache hit (the next round of a conversation, mostly cached, overtakes a cold prompt),
    /// aged so nothing starves: past `aging_after` of waiting, each further second counts as
    /// `aging_tokens_per_s` tokens less, so a request is overtaken for at most `aging_after` plus its
    /// work over that rate. Among the first `window` waiting requests; ties go first come, first served.
    LeastWorkFirst { aging_after: Duration, aging_tokens_per_s: u32, window: usize },
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            role: Role::Unified,
            queued_requests_max: 256,
            running_requests_max: 64,
            batch_tokens_max: 2048,
            prefill_chunk_tokens_max: 512,
            context_tokens_max: 8192,
            // Both also end at the request's own deadline. Generous, because a busy decode worker may
            // take a while to make room for the KV; the router's aborts end abandoned offers early.
            kv_lease: Duration::from_secs(120),
            kv_transfer_timeout: Duration::from_secs(120),
            admission_watermark_blocks: 1,
            // A 1,000-token cold prompt is overtaken by cached rounds for at most 60 + 1000/100 = 70 s.
            admission_order: AdmissionOrder::LeastWorkFirst {
                aging_after: Duration::from_secs(60),
                aging_tokens_per_s: 100,
                window: 32,
            },
            sliding_window: None,
            attention_cost_positions: None,
        }
    }
}

/// Where a request's prompt KV comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvSource {
    /// Computed here (unified and prefill roles).
    Compute,
    /// Received from a prefill peer under `transfer` (decode role); `first_token` was sampled there.
    Remote { transfer: TransferId, first_token: u32 },
}

/// A request handed to the scheduler.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    pub id: RequestId,
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    /// Admission (leaving the queue) must happen by then.
    pub queue_deadline: Instant,
    /// The request must end by then, whatever its stage.
    pub deadline: Instant,
    pub kv: KvSource,
    /// vLLM's `priority`: lower first. A queued request is admitted before every queued one of a
    /// higher value (the admission order applies among equals); 0 by default.
    pub priority: i32,
}

/// Why a request was not admitted. Nothing is ever dropped without one of these.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Rejection {
    /// The waiting queue is full; try again after `retry_after`.
    QueueFull { queued: usize, limit: usize, retry_after: Duration },
    /// Prompt plus `max_tokens` does not fit the context.
    ContextLengthExceeded { prompt_tokens: usize, max_tokens: usize, context_tokens: usize },
    /// Even the whole KV pool could not hold this request.
    KvCapacityExceeded { needed_blocks: usize, total_blocks: usize },
    /// `max_tokens` is 0 or the prompt is empty.
    InvalidRequest { problem: &'static str },
    /// A live request already has this id.
    DuplicateId,
    /// This worker's role does not take this kind of request (remote KV at a prefill worker, say).
    WrongRole { role: Role },
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Rejection::QueueFull { queued, limit, retry_after } => write!(
                f,
                "request queue is full ({queued} waiting, limit {limit}); retry after {}s",
                retry_after.as_secs()
            ),
            Rejection::ContextLengthExceeded { prompt_tokens, max_tokens, context_tokens } => write!(
                f,
                "prompt of {prompt_tokens} tokens plus max_tokens {max_tokens} exceeds the context of {context_tokens} tokens"
            ),
            Rejection::KvCapacityExceeded { needed_blocks, total_blocks } => {
                write!(f, "request needs {needed_blocks} KV blocks, the pool has {total_blocks}")
            }
            Rejection::InvalidRequest { problem } => write!(f, "{problem}"),
            Rejection::DuplicateId => write!(f, "a live request already has this id"),
            Rejection::WrongRole { role } => write!(f, "a {role:?} worker does not take this request"),
        }
    }
}

/// Where a request was in the scheduler when it ended. (The words a ledger or metric shows are the
/// caller's: pdserve's engine maps these to `pdserve_api::Stage`, role-aware.)
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Stage {
    Queued,
    KvTransfer,
    Prefilling,
    Decoding,
}

/// Why generation stopped normally.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// A stop token or string (the engine decided).
    Stop,
    /// `max_tokens` or the context was reached.
    Length,
}

/// How a request left the scheduler. Each admitted request gets exactly one (the engine maps it to
/// the api's `Outcome` and `Stage`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    Completed(FinishReason),
    /// Prefill role: the prompt is done and its KV waits under `transfer` for the decode peer.
    PrefillDone {
        first_token: u32,
        transfer: TransferId,
        blocks: Vec<BlockId>,
    },
    Cancelled,
    TimedOut {
        stage: Stage,
    },
    Failed {
        stage: Stage,
        reason: String,
    },
}

/// What the engine learns from the scheduler besides batches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A request reached its terminal state; its KV (other than a prefill lease) is freed, its full
    /// computed blocks left in the prefix cache. `cached_tokens`: prompt tokens whose KV was found here
    /// instead of computed (unified and prefill roles) or pulled (decode role).
    Finished {
        id: RequestId,
        outcome: Exit,
        prompt_tokens: usize,
        output_tokens: usize,
        cached_tokens: usize,
    },
    /// A prefill lease ran out before the decode peer took the KV; its blocks are free again.
    LeaseExpired { transfer: TransferId },
}

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchItem {
    pub id: RequestId,
    pub seq: pdserve_kvcache::SeqId,
    /// Position of the first token computed in this step.
    pub start_pos: usize,
    pub num_tokens: usize,
    /// The engine samples a token from this item's last logits and reports it.
    pub sample: bool,
    /// The last `draft` of the item's tokens are draft tokens to verify (speculative decoding, from
    /// [`Scheduler::poll_batch_drafting`](crate::Scheduler::poll_batch_drafting)): the engine samples
    /// from the logits of the item's last `draft + 1` rows in order while each sample equals the draft
    /// token it scores, and reports how many drafts it accepted.
    pub draft: usize,
}

/// What the engine reports for an item that sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampled {
    pub id: RequestId,
    pub token: u32,
    /// The engine saw a stop condition (EOS, a stop string).
    pub stop: bool,
    /// Of the item's draft tokens, how many (in order) the engine's samples confirmed; `token` is the
    /// one it sampled after them. 0 for an item without drafts.
    pub drafts_accepted: usize,
}

/// Counters the shell exports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SchedulerStats {
    pub queued: usize,
    pub running: usize,
    pub awaiting_kv: usize,
    pub batch_tokens_last_step: usize,
    pub steps_total: u64,
    pub preemptions_total: u64,
    pub rejected_total: u64,
    pub completed_total: u64,
    pub cancelled_total: u64,
    pub timed_out_total: u64,
    pub failed_total: u64,
    /// Prompt tokens found in the prefix cache at admission (decode role: whose KV needed no
    /// transfer), and those computed or pulled. Counted once per request, not again after preemption.
    pub prefix_hit_tokens_total: u64,
    pub prefix_miss_tokens_total: u64,
    /// Why the last planned step admitted no more of the waiting requests (`None`: none waited).
    pub queue_wait: Option<QueueWait>,
}

/// What the waiting requests wait for: why a step's planning stopped admitting them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueWait {
    /// Free KV blocks: the pool (less its watermark) cannot hold the next request's prompt.
    Blocks,
    /// A running slot: `running_requests_max` requests run.
    Slot,
    /// The step's token budget went to running requests' decodes and prefill chunks.
    Budget,
}

impl QueueWait {
    pub fn as_str(self) -> &'static str {
        match self {
            QueueWait::Blocks => "kv_blocks",
            QueueWait::Slot => "running_slot",
            QueueWait::Budget => "step_budget",
        }
    }
}
