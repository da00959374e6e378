//! The continuous-batching state machine.

mod check;
mod draft;
mod pressure;

pub use draft::Drafter;

use std::collections::{BTreeSet, HashSet, VecDeque};
use std::time::{Duration, Instant};

use pdserve_kvcache::{IdMap, KvError, KvGroups, SeqId, TransferId};

use crate::types::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Queued,
    AwaitingKv {
        transfer: TransferId,
        first_token: u32,
    },
    /// In the running batch; `prefilled` once every known token's KV is computed at least once.
    Running {
        prefilled: bool,
    },
}

#[derive(Debug)]
struct Req {
    id: RequestId,
    seq: SeqId,
    prompt_len: usize,
    /// Prompt plus output so far.
    tokens: Vec<u32>,
    output_len: usize,
    max_tokens: usize,
    queue_deadline: Instant,
    deadline: Instant,
    /// When the request was taken in (for the admission order's aging).
    arrived: Instant,
    state: State,
    admitted_order: u64,
    /// The deadline of the current wait (the queue, or the KV transfer), as keyed in `Scheduler::waits`.
    /// A preempted request waits again without one: it was admitted once already.
    wait_until: Option<Instant>,
    /// Prompt tokens whose KV was reused at the first admission (`None` until then).
    cached_tokens: Option<usize>,
    /// A model with per-request state: where the prompt's blocks cached by others end, past the
    /// restore point it resumed from (0: nowhere). Its prefill ends a chunk there, so a state is
    /// saved where the next prompt sharing that prefix resumes.
    shared_end: usize,
    /// Lower first (see `NewRequest::priority`).
    priority: i32,
}

impl Req {
    fn stage(&self) -> Stage {
        match self.state {
            State::Queued => Stage::Queued,
            State::AwaitingKv { .. } => Stage::KvTransfer,
            State::Running { prefilled: false } => Stage::Prefilling,
            State::Running { prefilled: true } => Stage::Decoding,
        }
    }
}

/// The scheduler of one worker. It owns the worker's KV ledger ([`KvGroups`]: one group for most
/// models, the plain cache); the engine reads block tables and
/// copy-on-write work from [`kv`](Self::kv) / [`kv_mut`](Self::kv_mut).
///
/// Call order per engine iteration (time always comes in as `now`):
/// 1. any number of [`handle_request`](Self::handle_request) (answered at once: admitted or rejected),
///    [`handle_abort`](Self::handle_abort), [`handle_kv_arrived`](Self::handle_kv_arrived),
///    [`handle_transfer_done`](Self::handle_transfer_done);
/// 2. [`poll_batch`](Self::poll_batch): ends what timed out, plans the step and reserves its KV;
/// 3. the engine runs the step, then reports it with exactly one of
///    [`handle_step_result`](Self::handle_step_result) or [`handle_step_failed`](Self::handle_step_failed);
/// 4. [`poll_event`](Self::poll_event) until `None`.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    epoch: Instant,
    kv: KvGroups,
    reqs: IdMap<RequestId, Req>,
    /// Every live request by total deadline, and waiting / awaiting ones by their wait deadline, so
    /// the expiry scan looks only at what is due.
    deadlines: BTreeSet<(Instant, RequestId)>,
    waits: BTreeSet<(Instant, RequestId)>,
    queued: VecDeque<RequestId>,
    running: Vec<RequestId>,
    awaiting: Vec<RequestId>,
    /// Prefill role: leases handed to decode peers and not yet released or expired.
    leases_out: HashSet<TransferId>,
    in_flight: Vec<BatchItem>,
    events: VecDeque<Event>,
    finishes: VecDeque<Instant>,
    next_order: u64,
    stats: SchedulerStats,
}

const DRAIN_WINDOW: usize = 64;
/// An offer outlives its request's deadline by this much, so the decode worker, which ends the
/// request at the same deadline, reports it as timed out rather than as a failed transfer.
const LEASE_PAST_DEADLINE: Duration = Duration::from_secs(1);

impl Scheduler {
    pub fn new(config: SchedulerConfig, kv: KvGroups, now: Instant) -> Self {
        Scheduler {
            config,
            epoch: now,
            kv,
            reqs: IdMap::default(),
            deadlines: BTreeSet::new(),
            waits: BTreeSet::new(),
            queued: VecDeque::new(),
            running: Vec::new(),
            awaiting: Vec::new(),
            leases_out: HashSet::new(),
            in_flight: Vec::new(),
            events: VecDeque::new(),
            finishes: VecDeque::with_capacity(DRAIN_WINDOW),
            next_order: 0,
            stats: SchedulerStats::default(),
        }
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn kv(&self) -> &KvGroups {
        &self.kv
    }

    /// For the engine's copy-on-write work (`take_copies`) only; changing sequences behind the
    /// scheduler's back breaks its invariants.
    pub fn kv_mut(&mut self) -> &mut KvGroups {
        &mut self.kv
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            queued: self.queued.len(),
            running: self.running.len(),
            awaiting_kv: self.awaiting.len(),
            ..self.stats
        }
    }

    /// Live requests (waiting, awaiting KV, or running).
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// Where a live request is, and how many tokens it has generated.
    pub fn stage_of(&self, id: RequestId) -> Option<(Stage, usize)> {
        self.reqs.get(&id).map(|r| (r.stage(), r.output_len))
    }

    fn ms(&self, t: Instant) -> u64 {
        t.saturating_duration_since(self.epoch).as_millis() as u64
    }

    /// How long a rejected client should wait: the queue divided by the recent drain rate, 1 to 60 s.
    pub fn retry_after(&self, now: Instant) -> Duration {
        let Some(&oldest) = self.finishes.front() else { return Duration::from_secs(1) };
        let span = now.saturating_duration_since(oldest).as_secs_f64();
        if span <= 0.0 {
            return Duration::from_secs(1);
        }
        let rate = self.finishes.len() as f64 / span;
        let secs = (self.queued.len().max(1) as f64 / rate).ceil();
        Duration::from_secs(secs.clamp(1.0, 60.0) as u64)
    }

    /// Takes a request in, or says at once why not.
    pub fn handle_request(&mut self, req: NewRequest, now: Instant) -> Result<(), Rejection> {
        let result = self.admit(req, now);
        if result.is_err() {
            self.stats.rejected_total += 1;
        }
        result
    }

    fn admit(&mut self, req: NewRequest, now: Instant) -> Result<(), Rejection> {
        let c = &self.config;
        if req.prompt.is_empty() {
            return Err(Rejection::InvalidRequest { problem: "the prompt is empty" });
        }
        if req.max_tokens == 0 {
            return Err(Rejection::InvalidRequest { problem: "max_tokens must be at least 1" });
        }
        if self.reqs.contains_key(&req.id) {
            return Err(Rejection::DuplicateId);
        }
        // (A decode worker also computes a prompt itself: the router sends it a conversation's next
        // round whose history it holds, the new tail being short.)
        if matches!(req.kv, KvSource::Remote { .. }) && c.role != Role::Decode {
            return Err(Rejection::WrongRole { role: c.role });
        }
        let total = req.prompt.len() + req.max_tokens;
        if total > c.context_tokens_max {
            return Err(Rejection::ContextLengthExceeded {
                prompt_tokens: req.prompt.len(),
                max_tokens: req.max_tokens,
                context_tokens: c.context_tokens_max,
            });
        }
        let here = if c.role == Role::Prefill { req.prompt.len() + 1 } else { total };
        let needed_blocks = self.blocks_needed(here, req.prompt.len(), 0);
        let total_blocks = self.kv.stats().blocks_total;
        if needed_blocks > total_blocks {
            return Err(Rejection::KvCapacityExceeded { needed_blocks, total_blocks });
        }
        let seq = SeqId(req.id.0);
        let mut r = Req {
            id: req.id,
            seq,
            prompt_len: req.prompt.len(),
            tokens: req.prompt,
            output_len: 0,
            max_tokens: req.max_tokens,
            queue_deadline: req.queue_deadline,
            deadline: req.deadline,
            arrived: now,
            state: State::Queued,
            admitted_order: 0,
            wait_until: None,
            cached_tokens: None,
            shared_end: 0,
            priority: req.priority,
        };
        match req.kv {
            KvSource::Compute => {
                if self.queued.len() >= c.queued_requests_max {
                    return Err(Rejection::QueueFull {
                        queued: self.queued.len(),
                        limit: c.queued_requests_max,
                        retry_after: self.retry_after(now),
                    });
                }
                self.queued.push_back(r.id);
                r.wait_until = Some(r.queue_deadline);
            }
            KvSource::Remote { transfer, first_token } => {
                let busy = self.slots_taken();
                if busy >= c.running_requests_max {
                    return Err(Rejection::QueueFull {
                        queued: busy,
                        limit: c.running_requests_max,
                        retry_after: self.retry_after(now),
                    });
                }
                let until = self.ms((now + c.kv_transfer_timeout).min(r.deadline));
                // The prompt's leading blocks this worker holds already (in every group) are not
                // pulled again.
                let bs = self.kv.block_size();
                match self.kv.allocate_lease_reusing(transfer, &r.tokens, until) {
                    Ok(lease) => {
                        let reused = lease.groups.iter().map(|g| g.reused).min().unwrap_or(0);
                        let hit = (reused * bs).min(r.tokens.len());
                        r.cached_tokens = Some(hit);
                        self.stats.prefix_hit_tokens_total += hit as u64;
                        self.stats.prefix_miss_tokens_total += (r.tokens.len() - hit) as u64;
                    }
                    Err(e) => {
                        return Err(match e {
                            KvError::OutOfBlocks { .. } | KvError::OutOfStates { .. } => {
                                Rejection::QueueFull {
                                    queued: busy,
                                    limit: c.running_requests_max,
                                    retry_after: self.retry_after(now),
                                }
                            }
                            _ => Rejection::DuplicateId,
                        })
                    }
                }
                r.state = State::AwaitingKv { transfer, first_token };
                r.wait_until = Some((now + c.kv_transfer_timeout).min(r.deadline));
                self.awaiting.push(r.id);
            }
        }
        self.deadlines.insert((r.deadline, r.id));
        if let Some(w) = r.wait_until {
            self.waits.insert((w, r.id));
        }
        self.reqs.insert(r.id, r);
        Ok(())
    }

    /// Ends `id`'s current wait (it left the queue or got its KV).
    fn end_wait(&mut self, id: RequestId) {
        if let Some(r) = self.reqs.get_mut(&id) {
            if let Some(w) = r.wait_until.take() {
                self.waits.remove(&(w, id));
            }
        }
    }

    /// Decode role: the KV for `id` has fully arrived in its lease; the request joins the running batch.
    /// `first_token_stops`: the peer's first token is a stop token (the request then ends at once).
    pub fn handle_kv_arrived(&mut self, id: RequestId, first_token_stops: bool, now: Instant) -> bool {
        let Some(r) = self.reqs.get(&id) else { return false };
        let State::AwaitingKv { transfer, first_token } = r.state else { return false };
        let (seq, prompt) = (r.seq, r.tokens.clone());
        if let Err(e) = self.kv.adopt_lease(transfer, seq, &prompt) {
            self.finish(id, Exit::Failed { stage: Stage::KvTransfer, reason: e.to_string() }, now);
            return true;
        }
        self.awaiting.retain(|&x| x != id);
        self.end_wait(id);
        let order = self.next_order;
        self.next_order += 1;
        let r = self.reqs.get_mut(&id).unwrap_or_else(|| unreachable!("checked above"));
        r.state = State::Running { prefilled: true };
        r.admitted_order = order;
        self.running.push(id);
        self.accept_token(id, first_token, first_token_stops, now);
        true
    }

    /// Decode role: the first token (sampled by the prefill peer) of a request still waiting for its KV.
    pub fn awaiting_first_token(&self, id: RequestId) -> Option<u32> {
        match self.reqs.get(&id)?.state {
            State::AwaitingKv { first_token, .. } => Some(first_token),
            _ => None,
        }
    }

    /// Decode role: the KV for `id` could not be received; the request fails in `kv_transfer` with
    /// `reason` and its destination lease is released. `false` if `id` is not waiting for KV.
    pub fn handle_kv_failed(&mut self, id: RequestId, reason: &str, now: Instant) -> bool {
        if !matches!(self.reqs.get(&id).map(|r| r.state), Some(State::AwaitingKv { .. })) {
            return false;
        }
        self.finish(id, Exit::Failed { stage: Stage::KvTransfer, reason: reason.to_owned() }, now);
        true
    }

    /// The prefill role's lease for `transfer`, if still held: block ids and expiry (scheduler ms).
    pub fn lease_of(&self, transfer: TransferId) -> Option<(Vec<pdserve_kvcache::BlockId>, u64)> {
        self.kv.lease(transfer).ok().map(|l| (l.groups[0].blocks.to_vec(), l.groups[0].expires_at))
    }

    /// Milliseconds since the scheduler's epoch: the unit of lease expiries.
    pub fn now_ms(&self, now: Instant) -> u64 {
        self.ms(now)
    }

    /// Prefill role: the decode peer has taken the KV of `transfer`; its blocks can go.
    pub fn handle_transfer_done(&mut self, transfer: TransferId) -> bool {
        if self.leases_out.remove(&transfer) {
            let _ = self.kv.release_lease(transfer);
            true
        } else {
            false
        }
    }

    /// Ends `id` as cancelled wherever it is. Idempotent: `false` if it is not live.
    pub fn handle_abort(&mut self, id: RequestId, now: Instant) -> bool {
        if !self.reqs.contains_key(&id) {
            return false;
        }
        self.finish(id, Exit::Cancelled, now);
        true
    }

    /// Ends `id` as failed with `reason` wherever it is (the engine could not go on with it, e.g. its
    /// output constraint broke). Idempotent: `false` if it is not live.
    pub fn handle_failed(&mut self, id: RequestId, reason: &str, now: Instant) -> bool {
        let Some(r) = self.reqs.get(&id) else { return false };
        let stage = r.stage();
        self.finish(id, Exit::Failed { stage, reason: reason.to_owned() }, now);
        true
    }

    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// Ends expired requests and leases, then plans the next step: every running decode first, then
    /// prefill chunks (continuing ones, then newly admitted ones) under the token budget (chunks count
    /// their cost: [`SchedulerConfig::chunk_cost`]). The KV for every item is reserved on return.
    pub fn poll_batch(&mut self, now: Instant) -> Vec<BatchItem> {
        self.poll_batch_within(now, self.config.batch_tokens_max)
    }

    /// [`poll_batch`](Self::poll_batch) with a smaller token budget for this one step (at most
    /// `batch_tokens_max`): a shorter step, for a caller with I/O it must not leave waiting long (a
    /// prefill worker whose KV transfers progress only between steps).
    pub fn poll_batch_within(&mut self, now: Instant, max_tokens: usize) -> Vec<BatchItem> {
        self.poll_batch_drafting(now, max_tokens, &mut |_, _, _| Vec::new())
    }

    /// [`poll_batch_within`](Self::poll_batch_within) that offers each decode a place for draft
    /// tokens (speculative decoding): `drafter(id, tokens so far, room)` proposes up to `room` tokens
    /// to follow the request's tokens, and those the pool and the step have room for are appended to
    /// its item ([`BatchItem::draft`]). [`handle_step_result`](Self::handle_step_result) keeps the
    /// KV of the drafts the engine accepted and gives back the rest.
    pub fn poll_batch_drafting(
        &mut self,
        now: Instant,
        max_tokens: usize,
        drafter: &mut Drafter<'_>,
    ) -> Vec<BatchItem> {
        assert!(self.in_flight.is_empty(), "poll_batch called before the previous step was reported");
        self.expire(now);
        let cap = max_tokens.clamp(1, self.config.batch_tokens_max);
        let mut budget = cap;
        let mut batch: Vec<BatchItem> = Vec::new();

        // One pass sorts the running requests (oldest first) into decodes and prefills.
        let (mut decoding, mut prefilling) = (Vec::with_capacity(self.running.len()), Vec::new());
        for id in &self.running {
            match self.reqs[id].state {
                State::Running { prefilled: true } => decoding.push(*id),
                _ => prefilling.push(*id),
            }
        }
        // Decodes first. A decode that cannot get a block preempts the newest running request.
        for id in decoding {
            if budget == 0 {
                break;
            }
            let Some(r) = self.reqs.get(&id).filter(|r| matches!(r.state, State::Running { .. })) else {
                continue; // preempted earlier in this loop
            };
            let item = BatchItem {
                id,
                seq: r.seq,
                start_pos: r.tokens.len() - 1,
                num_tokens: 1,
                sample: true,
                draft: 0,
            };
            if self.reserve_or_preempt(id, 1, now) {
                let item = self.add_draft(item, budget - 1, drafter);
                budget -= item.num_tokens;
                batch.push(item);
            }
        }
        // Then prefill chunks of running requests, oldest first, each at most half the step while others wait.
        let joining = !self.queued.is_empty() && self.slots_taken() < self.config.running_requests_max;
        let contended = joining || self.running.len() > 1;
        let share = if !joining && prefilling.len() < 2 { cap } else { cap.div_ceil(2) };
        for id in prefilling {
            if budget == 0 {
                break;
            }
            if !self.reqs.get(&id).is_some_and(|r| matches!(r.state, State::Running { .. })) {
                continue; // preempted earlier in this loop
            }
            if let Some(item) = self.plan_prefill_or_preempt(id, budget.min(share), contended, &batch) {
                budget = budget.saturating_sub(self.config.chunk_cost(item.start_pos, item.num_tokens));
                batch.push(item);
            }
        }

        // Admit waiting requests, in the configured order, while there is room.
        let mut short_of_blocks = false;
        while budget > 0 && self.slots_taken() < self.config.running_requests_max {
            let Some(at) = self.next_admission(now) else { break };
            let id = self.queued[at];
            let r = &self.reqs[&id];
            let (seq, tokens) = (r.seq, r.tokens.clone());
            let hit = match self.kv.add_sequence(seq, &tokens) {
                Ok(hit) => hit,
                Err(KvError::OutOfStates { .. }) => {
                    // Every state slot is a running request's or a lease's: it waits for one.
                    short_of_blocks = true;
                    break;
                }
                Err(e) => {
                    self.queued.remove(at);
                    self.finish(id, Exit::Failed { stage: Stage::Queued, reason: e.to_string() }, now);
                    continue;
                }
            };
            let cached_blocks = hit.cached_tokens / self.kv.block_size();
            let needed = self.blocks_needed(tokens.len(), tokens.len() - hit.cached_tokens, cached_blocks);
            // (The watermark keeps room for running requests' next tokens: with none running, a
            // request as large as the pool still goes in, as a preempted stateful one whose prefix
            // has no restore point must.)
            let watermark = if self.running.is_empty() { 0 } else { self.config.admission_watermark_blocks };
            if self.kv.blocks_available() < needed + watermark {
                // Not now: it waits (it fits the pool, so running requests will make room).
                let _ = self.kv.free_sequence(seq, false);
                short_of_blocks = true;
                break;
            }
            // Blocks others cached past the restore point this request resumes from: a state saved
            // where they end lets the next prompt sharing them resume there.
            let shared = self.kv.cached_block_tokens(&tokens);
            self.queued.remove(at);
            self.end_wait(id);
            let order = self.next_order;
            self.next_order += 1;
            let r = self.reqs.get_mut(&id).unwrap_or_else(|| unreachable!("in the queue"));
            r.state = State::Running { prefilled: false };
            r.admitted_order = order;
            r.shared_end = if shared > hit.cached_tokens { shared } else { 0 };
            if r.cached_tokens.is_none() {
                // First admission (a preempted request's own blocks do not count as a hit).
                r.cached_tokens = Some(hit.cached_tokens);
                self.stats.prefix_hit_tokens_total += hit.cached_tokens as u64;
                self.stats.prefix_miss_tokens_total += (tokens.len() - hit.cached_tokens) as u64;
            }
            self.running.push(id);
            let contended = !batch.is_empty() || !self.queued.is_empty() || self.running.len() > 1;
            match self.plan_prefill(id, budget, contended) {
                Some(item) => {
                    budget = budget.saturating_sub(self.config.chunk_cost(item.start_pos, item.num_tokens));
                    batch.push(item);
                }
                None => break,
            }
        }
        self.stats.queue_wait = match () {
            _ if self.queued.is_empty() => None,
            _ if short_of_blocks => Some(QueueWait::Blocks),
            _ if self.slots_taken() >= self.config.running_requests_max => Some(QueueWait::Slot),
            _ => Some(QueueWait::Budget),
        };
        self.stats.batch_tokens_last_step = batch.iter().map(|i| i.num_tokens).sum();
        if !batch.is_empty() {
            self.stats.steps_total += 1;
        }
        self.in_flight = batch.clone();
        batch
    }

    /// Which waiting request (its index in `waiting`) is admitted next: one of the lowest priority
    /// value waiting, chosen among them by the admission order.
    fn next_admission(&self, now: Instant) -> Option<usize> {
        let best = self.queued.iter().map(|id| self.reqs[id].priority).min()?;
        let of_best = |(_, id): &(usize, &RequestId)| self.reqs[*id].priority == best;
        let AdmissionOrder::LeastWorkFirst { aging_after, aging_tokens_per_s, window } =
            self.config.admission_order
        else {
            return self.queued.iter().enumerate().find(of_best).map(|(i, _)| i);
        };
        let work = |id: &RequestId| {
            let r = &self.reqs[id];
            let left = r.tokens.len() - self.kv.lookup_prefix(&r.tokens);
            let aged = now.saturating_duration_since(r.arrived).saturating_sub(aging_after).as_secs_f64();
            left as f64 - f64::from(aging_tokens_per_s) * aged
        };
        // The first of the least: ties go to the earliest.
        self.queued
            .iter()
            .enumerate()
            .filter(of_best)
            .take(window.max(1))
            .map(|(i, id)| (i, work(id)))
            .min_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(&b.0)))
            .map(|(i, _)| i)
    }

    fn expire(&mut self, now: Instant) {
        let mut due: Vec<RequestId> = Vec::new();
        for set in [&self.deadlines, &self.waits] {
            due.extend(set.iter().take_while(|(t, _)| *t <= now).map(|&(_, id)| id));
        }
        due.sort();
        due.dedup();
        for id in due {
            if let Some(stage) = self.reqs.get(&id).map(Req::stage) {
                self.finish(id, Exit::TimedOut { stage }, now);
            }
        }
        let now_ms = self.ms(now);
        let mut expired: Vec<TransferId> = self
            .leases_out
            .iter()
            .copied()
            .filter(|t| self.kv.lease(*t).map_or(true, |l| l.groups[0].expires_at <= now_ms))
            .collect();
        expired.sort();
        for t in expired {
            self.leases_out.remove(&t);
            let _ = self.kv.release_lease(t);
            self.events.push_back(Event::LeaseExpired { transfer: t });
        }
    }

    /// Running slots taken: running requests, and on a decode worker those whose KV is on its way (a
    /// prompt it computes itself waits for a slot no pull has taken).
    fn slots_taken(&self) -> usize {
        self.running.len() + self.awaiting.len()
    }

    /// Blocks a sequence of `tokens` tokens, `to_prefill` of them still to compute, needs beyond the
    /// `cached` it found in the prefix cache, at the most it ever holds at once: all of them, or with a
    /// sliding window (not on the prefill role, which keeps its prompt for the decode peer) the window,
    /// one prefill chunk and two partial blocks.
    fn blocks_needed(&self, tokens: usize, to_prefill: usize, cached: usize) -> usize {
        let all = self.kv.blocks_for(tokens).saturating_sub(cached);
        match self.config.sliding_window {
            Some(w) if self.config.role != Role::Prefill => {
                let chunk = self.config.prefill_chunk_tokens_max.min(to_prefill);
                all.min(self.kv.blocks_for(w + chunk) + 2)
            }
            _ => all,
        }
    }

    /// Reports the step planned by the last `poll_batch`: its KV is now written, and `sampled` holds
    /// the token drawn for each item that asked for one.
    pub fn handle_step_result(&mut self, sampled: &[Sampled], now: Instant) {
        let items = std::mem::take(&mut self.in_flight);
        let tokens: IdMap<RequestId, &Sampled> = sampled.iter().map(|s| (s.id, s)).collect();
        for item in items {
            let Some(r) = self.reqs.get(&item.id) else { continue }; // aborted meanwhile
            let stage = r.stage();
            let accepted = tokens.get(&item.id).map_or(0, |s| s.drafts_accepted.min(item.draft));
            if let Err(e) = self.kv.commit(item.seq, item.num_tokens - item.draft + accepted) {
                self.finish(item.id, Exit::Failed { stage, reason: e.to_string() }, now);
                continue;
            }
            if item.draft > 0 {
                if let Err(e) = self.settle_draft(item.id, accepted) {
                    self.finish(item.id, Exit::Failed { stage, reason: e.to_string() }, now);
                    continue;
                }
            }
            match self.config.sliding_window {
                Some(w) if self.config.role != Role::Prefill => {
                    // Blocks no later position attends to go back to the pool now. (A prefill worker
                    // hands its whole prompt's KV to the decode peer, so it keeps every block.)
                    if let Err(e) = self.kv.release_outside_window(item.seq, w) {
                        self.finish(item.id, Exit::Failed { stage, reason: e.to_string() }, now);
                        continue;
                    }
                }
                _ if self.kv.config().state_bytes > 0 => {
                    // A model with per-request state: its full blocks are cached, and its state saved
                    // as their restore point, each time it passes a block boundary (prompt or output).
                    let _ = self.kv.save_restore_point(item.seq);
                }
                _ if stage == Stage::Prefilling => {
                    // Early insertion: a prompt's full blocks are in the prefix cache as soon as their
                    // KV is written, so requests sharing the prefix hit while this one still runs.
                    // (Not with a window: cached blocks stay held, and the window could not free them.)
                    let _ = self.kv.cache_prefix(item.seq);
                }
                _ => {}
            }
            if !item.sample {
                continue;
            }
            match tokens.get(&item.id) {
                Some(s) => self.accept_token(item.id, s.token, s.stop, now),
                None => self.finish(
                    item.id,
                    Exit::Failed { stage, reason: "the engine reported no token for a sampling step".into() },
                    now,
                ),
            }
        }
    }

    /// Reports that the planned step could not run; every request in it fails with `reason`.
    pub fn handle_step_failed(&mut self, reason: &str, now: Instant) {
        let items = std::mem::take(&mut self.in_flight);
        for item in items {
            if let Some(r) = self.reqs.get(&item.id) {
                let stage = r.stage();
                self.finish(item.id, Exit::Failed { stage, reason: reason.to_owned() }, now);
            }
        }
    }

    fn accept_token(&mut self, id: RequestId, token: u32, stop: bool, now: Instant) {
        let Some(r) = self.reqs.get_mut(&id) else { return };
        r.tokens.push(token);
        r.output_len += 1;
        let (seq, was_prefilled) = (r.seq, matches!(r.state, State::Running { prefilled: true }));
        let r_deadline = r.deadline;
        r.state = State::Running { prefilled: true };
        let done_length = r.output_len >= r.max_tokens || r.tokens.len() >= self.config.context_tokens_max;
        if let Err(e) = self.kv.append_tokens(seq, &[token]) {
            self.finish(id, Exit::Failed { stage: Stage::Decoding, reason: e.to_string() }, now);
            return;
        }
        if self.config.role == Role::Prefill && !was_prefilled {
            // The lease references the blocks, which the prefix cache keeps once the transfer ends.
            let _ = self.kv.cache_prefix(seq);
            let transfer = TransferId(id.0);
            let until = self.ms((now + self.config.kv_lease).min(r_deadline + LEASE_PAST_DEADLINE));
            match self.kv.lease_sequence(seq, transfer, until) {
                Ok(lease) => {
                    let blocks = lease.groups[0].blocks.to_vec();
                    self.leases_out.insert(transfer);
                    self.finish(id, Exit::PrefillDone { first_token: token, transfer, blocks }, now);
                }
                Err(e) => {
                    self.finish(id, Exit::Failed { stage: Stage::Prefilling, reason: e.to_string() }, now)
                }
            }
            return;
        }
        if stop {
            self.finish(id, Exit::Completed(FinishReason::Stop), now);
        } else if done_length {
            self.finish(id, Exit::Completed(FinishReason::Length), now);
        }
    }

    /// The one exit: removes `id` from wherever it is, frees what it holds, and emits its event.
    fn finish(&mut self, id: RequestId, outcome: Exit, now: Instant) {
        self.end_wait(id);
        let Some(r) = self.reqs.remove(&id) else { return };
        self.deadlines.remove(&(r.deadline, id));
        match r.state {
            State::Queued => self.queued.retain(|&x| x != id),
            State::AwaitingKv { transfer, .. } => {
                self.awaiting.retain(|&x| x != id);
                let _ = self.kv.release_lease(transfer);
            }
            State::Running { .. } => {
                self.running.retain(|&x| x != id);
                // Whatever the outcome, the full blocks whose KV was written stay in the prefix cache
                // (the next round of a conversation resends them); unreferenced, they are evictable.
                if !matches!(outcome, Exit::PrefillDone { .. }) {
                    let _ = self.kv.free_sequence(r.seq, true);
                }
            }
        }
        self.in_flight.retain(|item| item.id != id);
        match &outcome {
            Exit::Completed(_) | Exit::PrefillDone { .. } => self.stats.completed_total += 1,
            Exit::Cancelled => self.stats.cancelled_total += 1,
            Exit::TimedOut { .. } => self.stats.timed_out_total += 1,
            Exit::Failed { .. } => self.stats.failed_total += 1,
        }
        if self.finishes.len() == DRAIN_WINDOW {
            self.finishes.pop_front();
        }
        self.finishes.push_back(now);
        self.events.push_back(Event::Finished {
            id,
            outcome,
            prompt_tokens: r.prompt_len,
            output_tokens: r.output_len,
            cached_tokens: r.cached_tokens.unwrap_or(0),
        });
    }
}
