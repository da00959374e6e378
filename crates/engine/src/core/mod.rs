//! The engine thread: it owns the scheduler (and with it the KV cache), the model backend, every
//! request's sampler and the KV transfer endpoint. It sees token ids only, talks to the text thread
//! only through two bounded channels, and never waits on a socket: transfers are pumped between steps.

mod sample;
mod step;
mod transfers;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, SendTimeoutError, Sender};
use pdserve_api::{Outcome as ApiOutcome, Role, Stage as ApiStage};
use pdserve_kvcache::{OwnerKind, SeqId};
use pdserve_model::{Backend, Sampler, SamplingParams};
use pdserve_pd_transfer::{Endpoint, EndpointStats, Source, TransferKey};
use pdserve_scheduler::{Event, KvSource, NewRequest, Outcome, RequestId, Scheduler, Stage};
use pdserve_telemetry::RequestLedger;

use crate::grammar::Guide;
use crate::metrics::Metrics;
use crate::EngineError;

/// A generation handed to the engine thread.
#[derive(Debug)]
pub(crate) struct Submission {
    pub id: u64,
    pub request_id: String,
    /// The prompt (empty when it comes from a prefill worker).
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
    /// End-of-sequence and stop tokens are held back before this many tokens.
    pub min_tokens: usize,
    pub logit_bias: Vec<(u32, f32)>,
    /// Output generated before this engine (the request moved here mid-answer): the prompt's last
    /// tokens, counted as output.
    pub resumed: Vec<u32>,
    /// Test hook (`EngineConfig::test_panic_trigger`): sampling this request panics.
    pub panic_in_sampling: bool,
}

#[derive(Debug)]
pub(crate) enum Command {
    Submit(Box<Submission>),
    Abort(u64),
    /// The text thread could not go on with this request (a panic while detokenizing it): it ends
    /// with an error naming why; the others run on.
    Fail {
        id: u64,
        reason: String,
    },
    /// Prefill role: end the offer of a finished prompt's KV (its transfer id is the request's id).
    AbortTransfer(u64),
}

impl Command {
    /// Whether this submits or fails request `id` (an abort must not overtake either).
    fn concerns(&self, id: u64) -> bool {
        matches!(self, Command::Submit(s) if s.id == id)
            || matches!(self, Command::Fail { id: f, .. } if *f == id)
    }
}

/// When a request reached the engine's milestones, for the per-stage timings answers carry.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Times {
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
pub(crate) struct Pulled {
    pub blocks: usize,
    pub bytes: u64,
    pub reused_blocks: usize,
}

/// What the engine thread tells the handle, in order per request: `Admitted` or `Rejected`, then
/// `Token`s, then exactly one `Finished` or `Prefilled`.
#[derive(Debug)]
pub(crate) enum Reply {
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
        outcome: Outcome,
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
    /// One turn's replies, in order.
    Batch(Vec<Reply>),
}

/// What the handle can read of the engine thread without asking it.
#[derive(Debug)]
pub(crate) struct Shared {
    pub epoch: Instant,
    /// Milliseconds since `epoch` of the last loop iteration.
    pub last_tick_ms: AtomicU64,
    /// Milliseconds since `epoch` of the last token sampled (0: never).
    pub last_token_ms: AtomicU64,
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    /// KV transfers offered or being pulled.
    pub transfers: AtomicUsize,
    pub ledger: Mutex<RequestLedger>,
}

impl Shared {
    pub(crate) fn ms_since_epoch(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }

    pub(crate) fn ledger(&self) -> std::sync::MutexGuard<'_, RequestLedger> {
        // The ledger holds plain data; one poisoned by a panic elsewhere is still consistent.
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[derive(Debug)]
struct Live {
    request_id: String,
    sampler: Sampler,
    prompt_len: usize,
    stop_ids: Vec<u32>,
    ignore_eos: bool,
    guide: Option<Guide>,
    min_tokens: usize,
    logit_bias: Vec<(u32, f32)>,
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

/// Prefill role: what goes to the decode worker with a finished prompt's KV besides the prompt.
struct Offered {
    first_token: u32,
    first: Option<pdserve_model::Sampled>,
    times: Times,
    cached_tokens: usize,
}

pub(crate) struct Core {
    pub sched: Scheduler,
    pub backend: Box<dyn Backend>,
    /// Prefill and decode roles: every KV transfer of this worker.
    pub endpoint: Option<Endpoint>,
    pub role: Role,
    pub eos_ids: Vec<u32>,
    pub context_tokens: usize,
    pub vocab_size: usize,
    pub commands: Receiver<Command>,
    pub replies: Sender<Reply>,
    /// Replies of this turn, sent together at its end.
    outbox: std::cell::RefCell<Vec<Reply>>,
    pub shared: Arc<Shared>,
    pub metrics: Metrics,
    live: HashMap<u64, Live>,
    /// Prefill role: the step's token budget while transfers are live.
    transfer_step_tokens: usize,
    /// Decode role: pulls whose prompt the prefill worker has not described yet, by transfer.
    describing: HashMap<u64, (Box<Submission>, Instant)>,
    /// Decode role: described pulls still receiving blocks: transfer -> request.
    pulling: HashMap<u64, u64>,
    transfer_stats: EndpointStats,
    /// Commands that came while a step ran, for the next turn (aborts are served at once).
    deferred: Vec<Command>,
    /// Whether long steps run on a thread of their own while aborts are served (CPU backends).
    step_thread: bool,
    speculative: crate::Speculative,
    /// The backend's `verify_rows_multiple` (drafts are sized to fill its tiles).
    verify_rows: usize,
}

impl Core {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        sched: Scheduler,
        backend: Box<dyn Backend>,
        endpoint: Option<Endpoint>,
        role: Role,
        eos_ids: Vec<u32>,
        context_tokens: usize,
        vocab_size: usize,
        commands: Receiver<Command>,
        replies: Sender<Reply>,
        shared: Arc<Shared>,
        metrics: Metrics,
        transfer_step_tokens: usize,
    ) -> Core {
        let verify_rows = backend.verify_rows_multiple();
        Core {
            sched,
            backend,
            endpoint,
            role,
            eos_ids,
            context_tokens,
            vocab_size,
            commands,
            replies,
            shared,
            metrics,
            outbox: Default::default(),
            live: HashMap::new(),
            transfer_step_tokens,
            describing: HashMap::new(),
            pulling: HashMap::new(),
            transfer_stats: EndpointStats::default(),
            deferred: Vec::new(),
            step_thread: false,
            speculative: crate::Speculative::OFF,
            verify_rows,
        }
    }

    /// Drafts tokens for decodes (unified and decode roles).
    pub(crate) fn with_speculative(mut self, s: crate::Speculative) -> Core {
        self.speculative = s;
        self
    }

    /// Lets steps of `SERVED_STEP_TOKENS` or more run on a thread of their own (`core/step.rs`).
    pub(crate) fn with_step_thread(mut self, on: bool) -> Core {
        self.step_thread = on;
        self
    }

    /// Runs until the handle drops its command sender.
    pub(crate) fn run(mut self) {
        loop {
            let now = Instant::now();
            self.shared.last_tick_ms.store(self.shared.ms_since_epoch(now), Ordering::Relaxed);
            // Block briefly when idle; otherwise take what is queued and go on stepping. Transfers are
            // pumped between waits: often while one is live (a new one starts from a command, which
            // ends the wait at once).
            for cmd in std::mem::take(&mut self.deferred) {
                self.command(cmd);
            }
            let transfers = self.endpoint.as_ref().is_some_and(|e| !e.is_empty());
            if transfers && self.sched.is_empty() {
                // Nothing to step but a transfer: wait on its sockets rather than on the command
                // channel, so each of its round trips goes on the moment the other worker's frame
                // arrives (a command waits a millisecond at most).
                self.pump_transfers_waiting(Duration::from_millis(1));
            } else {
                let wait = if self.sched.is_empty() { Duration::from_millis(50) } else { Duration::ZERO };
                match self.commands.recv_timeout(wait) {
                    Ok(cmd) => self.command(cmd),
                    Err(RecvTimeoutError::Timeout) => {}
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            for _ in 0..1024 {
                match self.commands.try_recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(_) => break,
                }
            }
            self.pump_transfers();
            // Admissions and refusals go out before the step (which may take a while), its tokens
            // after it.
            self.flush();
            self.step();
            self.publish();
            self.flush();
        }
    }

    /// Queues a reply; the turn's replies go out together at its end ([`flush`](Self::flush)), so a
    /// step's tokens cost the text thread one wake-up, not one per sequence.
    fn send(&self, r: Reply) {
        self.outbox.borrow_mut().push(r);
    }

    fn flush(&self) {
        let mut out = std::mem::take(&mut *self.outbox.borrow_mut());
        let r = match out.len() {
            0 => return,
            1 => out.pop().expect("one reply"),
            _ => Reply::Batch(out),
        };
        // The text thread drains this channel as replies come and never waits on the caller; a full
        // channel for seconds means it is stuck, and then dropping the replies is the lesser evil: the
        // handle's watchdog ends their requests at their deadlines, and the log names them.
        match self.replies.send_timeout(r, Duration::from_secs(5)) {
            Ok(()) | Err(SendTimeoutError::Disconnected(_)) => {} // shutting down
            Err(SendTimeoutError::Timeout(r)) => {
                eprintln!(
                    "engine: replies dropped, the text thread did not drain its channel for 5 s: {r:?}"
                );
            }
        }
    }

    fn stage(&self, s: Stage) -> ApiStage {
        match s {
            Stage::Queued => ApiStage::queued(self.role),
            Stage::KvTransfer => ApiStage::KvTransfer,
            Stage::Prefilling => ApiStage::Prefilling,
            Stage::Decoding => ApiStage::Decoding,
        }
    }

    fn command(&mut self, cmd: Command) {
        let now = Instant::now();
        match cmd {
            Command::Submit(s) if s.remote.is_some() => self.start_pull(s, now),
            Command::Submit(mut s) => {
                let max_tokens =
                    s.max_tokens.map_or(self.context_tokens.saturating_sub(s.tokens.len()), |m| {
                        m.saturating_sub(s.resumed.len()).max(1)
                    });
                let req = NewRequest {
                    id: RequestId(s.id),
                    prompt: s.tokens.clone(),
                    max_tokens,
                    queue_deadline: s.deadline,
                    deadline: s.deadline,
                    kv: KvSource::Compute,
                };
                match self.sched.handle_request(req, now) {
                    Ok(()) => {
                        let stage = ApiStage::queued(self.role);
                        let tokens = s.tokens.clone();
                        self.admitted(&mut s, tokens, stage, now, None);
                    }
                    Err(r) => self.reject(s.id, EngineError::Rejected(r)),
                }
            }
            Command::Abort(id) => {
                if let Some((&t, _)) = self.describing.iter().find(|(_, (s, _))| s.id == id) {
                    // Not admitted yet: the pull ends, and so does the request.
                    if let Some((s, _)) = self.describing.remove(&t) {
                        self.shared.ledger().finish(&s.request_id);
                        let outcome = Outcome::Cancelled;
                        let times = Times::default();
                        self.send(Reply::Finished { id, outcome, output_tokens: 0, cached_tokens: 0, times });
                    }
                    self.abort_transfer(t);
                    return;
                }
                self.sched.handle_abort(RequestId(id), now);
                // A prefill request may have finished already, its KV offered under the same id: the
                // abort ends the offer too, instead of leaving it to the lease expiry.
                self.abort_transfer(id);
                self.drain_events();
            }
            // Idempotent: an ended transfer is left alone.
            Command::AbortTransfer(t) => self.abort_transfer(t),
            Command::Fail { id, reason } => {
                if self.describing.values().any(|(s, _)| s.id == id) {
                    return self.command(Command::Abort(id));
                }
                self.sched.handle_failed(RequestId(id), &reason, now);
                self.abort_transfer(id);
                self.drain_events();
            }
        }
    }

    fn reject(&mut self, id: u64, error: EngineError) {
        let reason = error.kind().as_str();
        if let Ok(c) = self.metrics.rejected.with(&[reason]) {
            c.inc();
        }
        self.send(Reply::Rejected { id, error });
    }

    /// The scheduler took `s`: the ledger, the sampler, and the `Admitted` reply.
    fn admitted(
        &mut self,
        s: &mut Submission,
        prompt: Vec<u32>,
        stage: ApiStage,
        now: Instant,
        remote: Option<RemoteFirst>,
    ) {
        self.metrics.tokens_prompt.add(prompt.len() as u64);
        {
            let mut ledger = self.shared.ledger();
            if ledger.get(&s.request_id).is_none() {
                let _ = ledger.admit(&s.request_id, stage, now, s.deadline, "engine");
            }
            let _ = ledger.set_stage(&s.request_id, stage, now);
            let _ = ledger.set_counts(&s.request_id, prompt.len() as u32, 0, 0);
        }
        let (remote_first, prefill_us, remote_cached) = match remote {
            Some(r) => (Some((r.logprob, r.top)), Some((r.queue_us, r.prefill_us)), Some(r.cached_tokens)),
            None => (None, None, None),
        };
        // Output generated elsewhere counts as output here; the sampler goes on past its draws (and,
        // on a decode worker, past the prefill worker's draw of the first token).
        let prompt_len = prompt.len().saturating_sub(s.resumed.len());
        let mut sampler = Sampler::new(s.params.clone(), s.seed);
        sampler.skip(s.resumed.len() + usize::from(self.role == Role::Decode));
        self.live.insert(
            s.id,
            Live {
                request_id: s.request_id.clone(),
                sampler,
                prompt_len,
                stop_ids: s.stop_ids.clone(),
                ignore_eos: s.ignore_eos,
                guide: s.guide.take(),
                min_tokens: s.min_tokens,
                logit_bias: std::mem::take(&mut s.logit_bias),
                times: Times { submitted: Some(now), prefill_us, ..Times::default() },
                prompt: if self.role == Role::Prefill { prompt } else { Vec::new() },
                first: None,
                remote_first,
                remote_cached,
                panic_in_sampling: s.panic_in_sampling,
                drafting: Default::default(),
            },
        );
        self.send(Reply::Admitted { id: s.id, prompt_tokens: prompt_len });
    }

    fn drain_events(&mut self) {
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
            let mut live = self.live.remove(&id.0);
            if let Some(l) = &live {
                self.shared.ledger().finish(&l.request_id);
            }
            // A decode request that ends while its KV is still coming: end the pull too.
            if let Some(t) = self.pulling.iter().find(|(_, &r)| r == id.0).map(|(&t, _)| t) {
                self.pulling.remove(&t);
                self.abort_transfer(t);
            }
            let times = live.as_ref().map(|l| l.times).unwrap_or_default();
            // In PD, what the client is told was cached is the prefill worker's hit.
            let cached_tokens = live.as_ref().and_then(|l| l.remote_cached).unwrap_or(cached_tokens);
            if let Outcome::PrefillDone { first_token, transfer, blocks } = &outcome {
                let first = live.as_mut().and_then(|l| l.first.take());
                let prompt = live.map(|l| l.prompt).unwrap_or_default();
                let offered = Offered { first_token: *first_token, first, times, cached_tokens };
                if let Some(key) = self.offer(*transfer, blocks.clone(), prompt, offered) {
                    self.count_finished(ApiOutcome::Completed, ApiStage::Prefilling);
                    self.send(Reply::Prefilled { id: id.0, key, cached_tokens, times });
                    continue;
                }
                self.sched.handle_transfer_done(*transfer);
                let outcome = Outcome::Failed {
                    stage: Stage::Prefilling,
                    reason: "could not offer the KV for transfer".into(),
                };
                self.count_finished(ApiOutcome::Failed, ApiStage::Prefilling);
                self.send(Reply::Finished { id: id.0, outcome, output_tokens, cached_tokens, times });
                continue;
            }
            let stage = match &outcome {
                Outcome::TimedOut { stage } | Outcome::Failed { stage, .. } => self.stage(*stage),
                _ if self.role == Role::Prefill => ApiStage::Prefilling,
                _ => ApiStage::Decoding,
            };
            let word = match &outcome {
                Outcome::Completed(_) | Outcome::PrefillDone { .. } => ApiOutcome::Completed,
                Outcome::Cancelled => ApiOutcome::Cancelled,
                Outcome::TimedOut { .. } => ApiOutcome::TimedOut,
                Outcome::Failed { .. } => ApiOutcome::Failed,
            };
            self.count_finished(word, stage);
            self.send(Reply::Finished { id: id.0, outcome, output_tokens, cached_tokens, times });
        }
    }

    fn count_finished(&self, outcome: ApiOutcome, stage: ApiStage) {
        if let Ok(c) = self.metrics.finished.with(&[outcome.as_str(), stage.as_str()]) {
            c.inc();
        }
    }

    /// Gauges and the ledger's stages, once per loop.
    fn publish(&mut self) {
        let now = Instant::now();
        {
            let mut ledger = self.shared.ledger();
            for (&id, l) in &self.live {
                let Some((stage, out)) = self.sched.stage_of(RequestId(id)) else { continue };
                // Blocks held (a sliding window's released ones are not).
                let table = self.sched.kv().block_table(SeqId(id)).unwrap_or_default();
                let blocks = table.iter().filter(|b| !b.is_released()).count();
                let stage = match stage {
                    Stage::Queued => ApiStage::queued(self.role),
                    Stage::KvTransfer => ApiStage::KvTransfer,
                    Stage::Prefilling => ApiStage::Prefilling,
                    Stage::Decoding => ApiStage::Decoding,
                };
                let _ = ledger.set_stage(&l.request_id, stage, now);
                let _ = ledger.set_counts(&l.request_id, l.prompt_len as u32, out as u32, blocks as u32);
            }
        }
        let st = self.sched.stats();
        self.shared.waiting.store(st.waiting + self.describing.len(), Ordering::Relaxed);
        self.shared.running.store(st.running + st.awaiting_kv, Ordering::Relaxed);
        self.metrics.waiting.set(st.waiting as f64);
        self.metrics.running.set(st.running as f64);
        let kv = self.sched.kv().stats();
        if let Ok(g) = self.metrics.kv_blocks.with(&["free"]) {
            g.set(kv.blocks_free as f64);
        }
        let held = kv.owned(OwnerKind::Sequence) + kv.owned(OwnerKind::Transfer);
        self.metrics.kv_usage.set(held as f64 / kv.blocks_total.max(1) as f64);
        for k in OwnerKind::ALL {
            if let Ok(g) = self.metrics.kv_blocks.with(&[k.as_str()]) {
                g.set(kv.owned(k) as f64);
            }
        }
        let preempted = st.preemptions_total.saturating_sub(self.metrics.preemptions.get());
        self.metrics.preemptions.add(preempted);
        // Counters mirror the scheduler's and the cache's own totals.
        for (result, total) in [("hit", st.prefix_hit_tokens_total), ("miss", st.prefix_miss_tokens_total)] {
            if let Ok(c) = self.metrics.prefix_tokens.with(&[result]) {
                c.add(total.saturating_sub(c.get()));
            }
        }
        self.metrics
            .evicted_blocks
            .add(kv.evicted_blocks_total.saturating_sub(self.metrics.evicted_blocks.get()));
        if let Some(ep) = &self.endpoint {
            self.shared.transfers.store(ep.len(), Ordering::Relaxed);
            self.metrics.transfers_in_flight.set(ep.len() as f64);
            let s = ep.stats();
            let last = std::mem::replace(&mut self.transfer_stats, s);
            for (dir, now, before) in [
                ("sent", s.bytes_sent, last.bytes_sent),
                ("received", s.bytes_received, last.bytes_received),
                ("shared", s.bytes_shared, last.bytes_shared),
            ] {
                if now > before {
                    if let Ok(c) = self.metrics.transfer_bytes.with(&[dir]) {
                        c.add(now - before);
                    }
                }
            }
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
