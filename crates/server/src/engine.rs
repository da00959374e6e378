//! The engine thread: it owns the scheduler (and with it the KV cache), the model backend and every
//! request's sampler. It talks to the HTTP thread only through two bounded channels.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use pdserve_kvcache::{OwnerKind, SeqId};
use pdserve_model::{Backend, Sampler, SamplingParams, SeqStep};
use pdserve_scheduler::{
    Event, KvSource, NewRequest, Outcome, Rejection, RequestId, Sampled, Scheduler, Stage,
};
use pdserve_telemetry::{RequestLedger, Stage as LedgerStage};

use crate::metrics::Metrics;

/// A generation handed to the engine.
#[derive(Debug)]
pub(crate) struct Submission {
    pub id: u64,
    pub request_id: String,
    pub tokens: Vec<u32>,
    pub max_tokens: usize,
    pub params: SamplingParams,
    pub seed: u64,
    pub stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub deadline: Instant,
}

#[derive(Debug)]
pub(crate) enum Command {
    Submit(Box<Submission>),
    Abort(u64),
}

/// What the engine tells the HTTP thread, in order per request: `Admitted` or `Rejected`, then
/// `Token`s, then exactly one `Finished`.
#[derive(Debug)]
pub(crate) enum Reply {
    Admitted(u64),
    Rejected(u64, Rejection),
    Token { id: u64, token: u32, logprob: f32, top: Vec<(u32, f32)>, stop: bool },
    Finished { id: u64, outcome: Outcome, output_tokens: usize },
}

/// What the HTTP thread can read of the engine without asking it.
#[derive(Debug)]
pub(crate) struct Shared {
    pub epoch: Instant,
    /// Milliseconds since `epoch` of the last loop iteration.
    pub last_tick_ms: AtomicU64,
    /// Milliseconds since `epoch` of the last token sampled (0: never).
    pub last_token_ms: AtomicU64,
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub ledger: Mutex<RequestLedger>,
}

impl Shared {
    pub(crate) fn ms_since_epoch(&self, now: Instant) -> u64 {
        now.saturating_duration_since(self.epoch).as_millis() as u64
    }
}

struct Live {
    request_id: String,
    sampler: Sampler,
    prompt_len: usize,
    stop_ids: Vec<u32>,
    ignore_eos: bool,
    submitted: Instant,
    scheduled: bool,
}

pub(crate) struct Engine {
    pub sched: Scheduler,
    pub backend: Box<dyn Backend>,
    pub eos_ids: Vec<u32>,
    pub commands: Receiver<Command>,
    pub replies: Sender<Reply>,
    pub waker: Arc<mio::Waker>,
    pub shared: Arc<Shared>,
    pub metrics: Metrics,
}

impl Engine {
    /// Runs until the HTTP thread drops its command sender.
    pub(crate) fn run(mut self) {
        let mut live: HashMap<u64, Live> = HashMap::new();
        loop {
            let now = Instant::now();
            self.shared.last_tick_ms.store(self.shared.ms_since_epoch(now), Ordering::Relaxed);
            // Block briefly when idle; otherwise take what is queued and go on stepping.
            let wait = if self.sched.is_empty() { Duration::from_millis(50) } else { Duration::ZERO };
            match self.commands.recv_timeout(wait) {
                Ok(cmd) => self.command(cmd, &mut live),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => return,
            }
            for _ in 0..1024 {
                match self.commands.try_recv() {
                    Ok(cmd) => self.command(cmd, &mut live),
                    Err(_) => break,
                }
            }
            self.step(&mut live);
            self.publish(&live);
        }
    }

    fn send(&self, r: Reply) {
        // The HTTP thread drains this channel every turn; a full channel for seconds means it is stuck,
        // and then dropping the reply is the lesser evil (its watchdog ends the request at its deadline).
        let _ = self.replies.send_timeout(r, Duration::from_secs(5));
        let _ = self.waker.wake();
    }

    fn command(&mut self, cmd: Command, live: &mut HashMap<u64, Live>) {
        let now = Instant::now();
        match cmd {
            Command::Submit(s) => {
                let req = NewRequest {
                    id: RequestId(s.id),
                    prompt: s.tokens.clone(),
                    max_tokens: s.max_tokens,
                    queue_deadline: s.deadline,
                    deadline: s.deadline,
                    kv: KvSource::Compute,
                };
                match self.sched.handle_request(req, now) {
                    Ok(()) => {
                        self.metrics.tokens_prompt.add(s.tokens.len() as u64);
                        let mut ledger = self.shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
                        let _ = ledger.admit(
                            &s.request_id,
                            LedgerStage::PrefillQueued,
                            now,
                            s.deadline,
                            "engine",
                        );
                        let _ = ledger.set_counts(&s.request_id, s.tokens.len() as u32, 0, 0);
                        drop(ledger);
                        live.insert(
                            s.id,
                            Live {
                                request_id: s.request_id.clone(),
                                sampler: Sampler::new(s.params, s.seed),
                                prompt_len: s.tokens.len(),
                                stop_ids: s.stop_ids,
                                ignore_eos: s.ignore_eos,
                                submitted: now,
                                scheduled: false,
                            },
                        );
                        self.send(Reply::Admitted(s.id));
                    }
                    Err(r) => {
                        let reason = match r {
                            Rejection::QueueFull { .. } => "queue_full",
                            Rejection::ContextLengthExceeded { .. } => "context_length_exceeded",
                            _ => "invalid_request",
                        };
                        if let Ok(c) = self.metrics.rejected.with(&[reason]) {
                            c.inc();
                        }
                        self.send(Reply::Rejected(s.id, r));
                    }
                }
            }
            Command::Abort(id) => {
                self.sched.handle_abort(RequestId(id), now);
                self.drain_events(live);
            }
        }
    }

    fn step(&mut self, live: &mut HashMap<u64, Live>) {
        let now = Instant::now();
        let batch = self.sched.poll_batch(now);
        self.drain_events(live);
        // Gauges show the step's reservations while it runs, not only after it.
        self.publish(live);
        if batch.is_empty() {
            self.sched.handle_step_result(&[], now);
            return;
        }
        for item in &batch {
            if let Some(l) = live.get_mut(&item.id.0) {
                if !l.scheduled {
                    l.scheduled = true;
                    self.metrics.queue_wait.observe_duration(now.saturating_duration_since(l.submitted));
                }
            }
        }
        let copies = self.sched.kv_mut().take_copies();
        self.backend.copy_blocks(&copies);
        let kv = self.sched.kv();
        let inputs: Vec<(Vec<u32>, Vec<pdserve_kvcache::BlockId>)> = batch
            .iter()
            .map(|i| {
                let tokens = kv
                    .tokens(i.seq)
                    .map(|t| t[i.start_pos..i.start_pos + i.num_tokens].to_vec())
                    .unwrap_or_default();
                (tokens, kv.block_table(i.seq).map(<[_]>::to_vec).unwrap_or_default())
            })
            .collect();
        let steps: Vec<SeqStep<'_>> = batch
            .iter()
            .zip(&inputs)
            .map(|(i, (t, b))| SeqStep {
                tokens: t,
                start_pos: i.start_pos,
                block_table: b,
                logits: i.sample,
            })
            .collect();
        let backend = &mut self.backend;
        let result = catch_unwind(AssertUnwindSafe(|| backend.forward(&steps)));
        self.metrics.step.observe_duration(now.elapsed());
        let logits = match result {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                self.sched.handle_step_failed(&format!("model error: {e}"), Instant::now());
                self.drain_events(live);
                return;
            }
            Err(_) => {
                self.sched.handle_step_failed("internal error: the model step panicked", Instant::now());
                self.drain_events(live);
                return;
            }
        };
        let mut sampled = Vec::new();
        for (item, l) in batch.iter().filter(|i| i.sample).zip(&logits) {
            let Some(lv) = live.get_mut(&item.id.0) else { continue };
            let all = self.sched.kv().tokens(item.seq).unwrap_or(&[]);
            let (prompt, output) = all.split_at(lv.prompt_len.min(all.len()));
            let s = lv.sampler.sample(l, prompt, output);
            let stop = lv.stop_ids.contains(&s.token) || (!lv.ignore_eos && self.eos_ids.contains(&s.token));
            sampled.push(Sampled { id: item.id, token: s.token, stop });
            self.send(Reply::Token { id: item.id.0, token: s.token, logprob: s.logprob, top: s.top, stop });
        }
        if !sampled.is_empty() {
            self.metrics.tokens_generated.add(sampled.len() as u64);
            self.shared.last_token_ms.store(self.shared.ms_since_epoch(Instant::now()), Ordering::Relaxed);
        }
        self.sched.handle_step_result(&sampled, Instant::now());
        self.drain_events(live);
    }

    fn drain_events(&mut self, live: &mut HashMap<u64, Live>) {
        while let Some(e) = self.sched.poll_event() {
            if let Event::Finished { id, outcome, output_tokens, .. } = e {
                if let Some(l) = live.remove(&id.0) {
                    self.shared.ledger.lock().unwrap_or_else(|e| e.into_inner()).finish(&l.request_id);
                }
                let stage = match &outcome {
                    Outcome::TimedOut { stage } | Outcome::Failed { stage, .. } => stage.as_str(),
                    _ => "finished",
                };
                if let Ok(c) = self.metrics.finished.with(&[outcome.label(), stage]) {
                    c.inc();
                }
                self.send(Reply::Finished { id: id.0, outcome, output_tokens });
            }
        }
    }

    /// Gauges and the ledger's stages, once per loop.
    fn publish(&self, live: &HashMap<u64, Live>) {
        let now = Instant::now();
        {
            let mut ledger = self.shared.ledger.lock().unwrap_or_else(|e| e.into_inner());
            for (&id, l) in live {
                if let Some((stage, out, blocks)) = Self::snapshot(&self.sched, id) {
                    let _ = ledger.set_stage(&l.request_id, stage, now);
                    let _ = ledger.set_counts(&l.request_id, l.prompt_len as u32, out as u32, blocks as u32);
                }
            }
        }
        let st = self.sched.stats();
        self.shared.waiting.store(st.waiting, Ordering::Relaxed);
        self.shared.running.store(st.running + st.awaiting_kv, Ordering::Relaxed);
        self.metrics.waiting.set(st.waiting as f64);
        self.metrics.running.set(st.running as f64);
        let kv = self.sched.kv().stats();
        if let Ok(g) = self.metrics.kv_blocks.with(&["free"]) {
            g.set(kv.blocks_free as f64);
        }
        for k in OwnerKind::ALL {
            if let Ok(g) = self.metrics.kv_blocks.with(&[k.as_str()]) {
                g.set(kv.owned(k) as f64);
            }
        }
        let preempted = st.preemptions_total.saturating_sub(self.metrics.preemptions.get());
        self.metrics.preemptions.add(preempted);
    }

    /// Stage and counts of one request, for the ledger.
    pub(crate) fn snapshot(sched: &Scheduler, id: u64) -> Option<(LedgerStage, usize, usize)> {
        let (stage, out) = sched.stage_of(RequestId(id))?;
        let blocks = sched.kv().block_table(SeqId(id)).map_or(0, <[_]>::len);
        let stage = match stage {
            Stage::Queued => LedgerStage::PrefillQueued,
            Stage::KvTransfer => LedgerStage::KvTransfer,
            Stage::Prefilling => LedgerStage::Prefilling,
            Stage::Decoding => LedgerStage::Decoding,
        };
        Some((stage, out, blocks))
    }
}
