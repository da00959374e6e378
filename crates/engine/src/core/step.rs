//! One engine step: plan the batch, run the forward pass, sample, report. A long step runs on a
//! thread of its own while the engine thread serves aborts, so a client that leaves is let go
//! within milliseconds, not after the step in progress.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::Ordering;
use std::time::Instant;

use crossbeam_channel::Receiver;
use pdserve_api::Role;
use pdserve_kvcache::{BlockCopy, BlockId};
use pdserve_model::{Backend, KvLayout, ModelError, SeqStep};
use pdserve_scheduler::RequestId;

use super::sample::Rows;
use super::{Command, Core};
use crate::grammar::Guide;

/// Steps of at least this many tokens run on their own thread while the engine thread serves
/// aborts; shorter ones (a few decoding sequences, a few milliseconds) run on the engine thread.
const SERVED_STEP_TOKENS: usize = 8;

/// Commands kept for after a step at most; past it the engine thread stops taking commands until the
/// step ends, so the command channel fills and pushes back on its senders as it does between steps.
const DEFERRED_MAX: usize = 1024;

/// What a forward pass returns: every wanted row's logits, or (when every sampling request of the
/// step is plain greedy) only each row's pick and its log-probability.
pub(super) enum StepOutput {
    Logits(Vec<Vec<f32>>),
    Picks(Vec<(u32, f32)>),
}

/// A step's output, taken item by item.
enum StepRows {
    Logits(std::vec::IntoIter<Vec<f32>>),
    Picks(std::vec::IntoIter<(u32, f32)>),
}

/// A forward pass's output, or the panic it raised.
type StepResult = std::thread::Result<Result<StepOutput, ModelError>>;

/// Runs the step, asking the backend for picks only when `picks` (see [`Core::picks_only`]).
fn forward(backend: &mut dyn Backend, steps: &[SeqStep<'_>], picks: bool) -> Result<StepOutput, ModelError> {
    if picks {
        backend.forward_greedy(steps).map(StepOutput::Picks)
    } else {
        backend.forward(steps).map(StepOutput::Logits)
    }
}

impl Core {
    pub(super) fn step(&mut self) {
        let now = Instant::now();
        // A prefill worker's transfers advance only between steps (each protocol round trip waits for
        // the step in progress): while any is live, steps stay short. Offers not yet pulled count too:
        // the decode worker's pull comes within milliseconds, and one the router abandoned is
        // aborted by it (only a vanished router leaves offers to their lease expiry).
        let budget = match &self.endpoint {
            Some(ep) if self.role == Role::Prefill && !ep.is_empty() => self.transfer_step_tokens,
            _ => usize::MAX,
        };
        let drafting = self.speculative.is_on()
            && self.role != Role::Prefill
            && self.sched.stats().running <= self.speculative.max_running;
        let batch = if drafting {
            let (spec, live, rows) = (self.speculative, &mut self.live, self.verify_rows);
            self.sched.poll_batch_drafting(now, budget, &mut |id, tokens, room| {
                match live.get_mut(&id.0) {
                    // A constrained request's mask follows its tokens one at a time: no drafts.
                    Some(l) if l.guide.is_none() => {
                        let mut drafts = spec.propose(tokens, l.drafting.room(spec.max_draft).min(room));
                        crate::draft::fit_to_rows(&mut drafts, rows);
                        drafts
                    }
                    _ => Vec::new(),
                }
            })
        } else {
            self.sched.poll_batch_within(now, budget)
        };
        self.drain_events();
        // Gauges show the step's reservations while it runs, not only after it.
        self.publish();
        if batch.is_empty() {
            self.sched.handle_step_result(&[], now);
            return;
        }
        for item in &batch {
            if let Some(l) = self.live.get_mut(&item.id.0) {
                if l.times.scheduled.is_none() {
                    l.times.scheduled = Some(now);
                    let waited = now.saturating_duration_since(l.times.submitted.unwrap_or(now));
                    self.metrics.queue_wait.record(waited);
                }
            }
        }
        let copies = self.sched.kv_mut().take_copies();
        if let Err(e) = self.backend.copy_blocks(&copies) {
            self.sched.handle_step_failed(&format!("model error: {e}"), Instant::now());
            self.drain_events();
            return;
        }
        let kv = self.sched.kv();
        let inputs: Vec<(Vec<u32>, Vec<BlockId>)> = batch
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
                logits: if i.sample { i.draft + 1 } else { 0 },
            })
            .collect();
        // Before the constraints leave `live` for the mask thread: a constrained request needs logits.
        let picks = self.picks_only(&batch);
        if picks {
            self.metrics.greedy_steps.add(1);
        }
        // The token masks of constrained requests are computed on a second thread while the forward
        // pass runs: they depend only on the tokens so far.
        let mut guided: Vec<(u64, Guide)> = batch
            .iter()
            .filter(|i| i.sample)
            .filter_map(|i| Some((i.id.0, self.live.get_mut(&i.id.0)?.guide.take()?)))
            .collect();
        let served =
            self.step_thread && steps.iter().map(|s| s.tokens.len()).sum::<usize>() >= SERVED_STEP_TOKENS;
        let (result, masks) = std::thread::scope(|scope| {
            let masker = (!guided.is_empty()).then(|| {
                scope.spawn(|| guided.iter_mut().map(|(id, g)| (*id, g.mask())).collect::<HashMap<u64, _>>())
            });
            let result = if served {
                self.forward_serving_aborts(&steps, picks)
            } else {
                catch_unwind(AssertUnwindSafe(|| forward(self.backend.as_mut(), &steps, picks)))
            };
            (result, masker.map(|m| m.join().unwrap_or_default()).unwrap_or_default())
        });
        for (id, g) in guided {
            if let Some(l) = self.live.get_mut(&id) {
                l.guide = Some(g);
            }
        }
        self.metrics.step.record(now.elapsed());
        let output = match result {
            Ok(Ok(o)) => o,
            Ok(Err(e)) => {
                self.sched.handle_step_failed(&format!("model error: {e}"), Instant::now());
                self.drain_events();
                return;
            }
            Err(_) => {
                self.sched.handle_step_failed("internal error: the model step panicked", Instant::now());
                self.drain_events();
                return;
            }
        };
        let mut sampled = Vec::new();
        let mut failed: Vec<(RequestId, String)> = Vec::new();
        let mut output = match output {
            StepOutput::Logits(l) => StepRows::Logits(l.into_iter()),
            StepOutput::Picks(p) => StepRows::Picks(p.into_iter()),
        };
        for item in batch.iter().filter(|i| i.sample) {
            let verified = match &mut output {
                StepRows::Picks(p) => match p.next() {
                    Some((token, logprob)) => {
                        let s = pdserve_model::Sampled { token, logprob, top: Vec::new() };
                        self.verify(item, Rows::Picked(s), None)
                    }
                    None => Err("internal error: the model step returned too few picks".to_owned()),
                },
                StepRows::Logits(l) => {
                    let rows: Vec<Vec<f32>> = l.by_ref().take(item.draft + 1).collect();
                    self.verify(item, Rows::Logits(&rows), masks.get(&item.id.0))
                }
            };
            match verified {
                Ok(Some(s)) => sampled.push(s),
                Ok(None) => {}
                Err(reason) => failed.push((item.id, reason)),
            }
        }
        if !sampled.is_empty() {
            let drafts: usize = sampled.iter().map(|s| s.drafts_accepted).sum();
            self.metrics.tokens_generated.add((sampled.len() + drafts) as u64);
            self.shared.last_token_ms.store(self.shared.ms_since_epoch(Instant::now()), Ordering::Relaxed);
        }
        for (id, reason) in failed {
            self.sched.handle_failed(id, &reason, Instant::now());
        }
        self.sched.handle_step_result(&sampled, Instant::now());
        self.drain_events();
    }

    /// Runs `steps` on a thread of their own. Meanwhile an abort takes effect at once: the request
    /// ends, is no longer listed, and its blocks go back to the pool. The step's arithmetic for it
    /// goes on and is dropped; nothing can be given those blocks before the step ends, since only
    /// the engine thread allocates, between steps. Other commands wait for the step's end, in order
    /// (an abort of a request whose submission or failure waits with them waits too).
    fn forward_serving_aborts(&mut self, steps: &[SeqStep<'_>], picks: bool) -> StepResult {
        let layout = self.backend.kv_layout();
        let mut backend = std::mem::replace(&mut self.backend, Box::new(Stepping(layout)));
        let (done, finished) = crossbeam_channel::bounded::<()>(1);
        let (result, backend) = std::thread::scope(|scope| {
            let stepper = scope.spawn(move || {
                let r = catch_unwind(AssertUnwindSafe(|| forward(backend.as_mut(), steps, picks)));
                drop(done);
                (r, backend)
            });
            self.serve_aborts(&finished);
            stepper.join().expect("the step's panic is caught on its thread")
        });
        self.backend = backend;
        result
    }

    /// Takes commands until `finished` closes: aborts now, the rest into `deferred` (at most
    /// `DEFERRED_MAX`, then it waits for the step alone).
    fn serve_aborts(&mut self, finished: &Receiver<()>) {
        loop {
            if self.deferred.len() >= DEFERRED_MAX {
                let _ = finished.recv();
                return;
            }
            crossbeam_channel::select! {
                recv(finished) -> _ => return,
                recv(self.commands) -> cmd => match cmd {
                    Ok(Command::Abort(id)) if !self.deferred.iter().any(|c| c.concerns(id)) => {
                        self.command(Command::Abort(id));
                        self.flush();
                    }
                    Ok(c) => self.deferred.push(c),
                    Err(_) => {
                        let _ = finished.recv();
                        return;
                    }
                },
            }
        }
    }
}

/// Stands in for the backend while a step runs on its own thread; nothing uses it then (aborts
/// touch only the scheduler, the ledger and the transfer endpoint), and anything that did would
/// get an error, not a race.
struct Stepping(KvLayout);

impl Stepping {
    fn busy<T>(&self) -> Result<T, ModelError> {
        Err(ModelError::Device { problem: "the backend is running a step".into() })
    }
}

impl Backend for Stepping {
    fn kv_layout(&self) -> KvLayout {
        self.0
    }
    fn forward(&mut self, _: &[SeqStep<'_>]) -> Result<Vec<Vec<f32>>, ModelError> {
        self.busy()
    }
    fn copy_blocks(&mut self, _: &[BlockCopy]) -> Result<(), ModelError> {
        self.busy()
    }
    fn read_block(&self, _: BlockId, _: &mut [u8]) -> Result<(), ModelError> {
        self.busy()
    }
    fn write_block(&mut self, _: BlockId, _: &[u8]) -> Result<(), ModelError> {
        self.busy()
    }
}
